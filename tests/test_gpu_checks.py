"""benchmarks/gpu_checks.py runs end to end at tiny shapes (its GPU numbers live in RESULTS.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_checks


def test_regret_measures_every_alternative_and_holds_out_calibration(tmp_path):
    assert gpu_checks.main(["regret", "--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "regret.json").read_text())
    rows, summary = data["rows"], data["summary"]
    assert len(rows) == summary["points"] == 3  # 2 prefill lengths and one decode batch
    for r in rows:
        assert all(a["measured_s"] and a["measured_s"] > 0 for a in r["alternatives"]), r
        assert r["regret"] is not None and r["regret"] >= 0
    assert summary["cost_error_median_before"] is not None and summary["cost_error_median_after"] is not None


def test_bundle_on_the_triton_kernels_matches_onnxruntime(tmp_path):
    assert gpu_checks.main(["bundle", "--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "bundle.json").read_text())["summary"]["results"]["float32"]
    assert res["steps"] == 4
    assert res["prefill_rel_rms"] < 1e-4 and res["decode_rel_rms_max"] < 1e-4
    assert res["tolerance"] == 1e-4 and res["within_tolerance"] is True


def test_first_call_times_both_bundles_in_fresh_processes(tmp_path):
    """On the CPU no kernels are collected (no CUDA): both rows run, neither has kernels."""
    assert gpu_checks.main(["first_call", "--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "first_call.json").read_text())["summary"]["rows"]
    assert set(rows) == {"with compiled kernels", "without"}
    assert all(r["import_s"] > 0 and r["load_s"] > 0 and r["first_prefill_s"] > 0 and r["first_decode_s"] > 0
               and r["kernels"] is False for r in rows.values())


def test_train_step_set_changes_the_config_the_launcher_resolves(monkeypatch):
    """train_step.py --set: the launcher's default (resolved as a training call resolves it, with
    chunk_size passed on) carries the changed fields (a wrapper with an older signature made every
    --set row fail)."""
    import torch

    import train_step
    from rtcompile.kernels import chunk_backward
    from rtcompile.kernels.config import KernelShape

    monkeypatch.setattr(chunk_backward, "default_backward", chunk_backward.default_backward)
    label = train_step.override_default({"chunk_size": 64, "grads_warps": 8, "grads_stages": 1, "num_stages": 2,
                                         "prepare_warps": 4})
    cfg = chunk_backward.resolve_backward(KernelShape((16, 16), 64, 2), None, None, torch.device("cpu"))
    assert (cfg.chunk_size, cfg.grads_warps, cfg.grads_stages, cfg.prepare_warps) == (64, 8, 1, 4)
    assert label.startswith("rtcompile[chunk_size=64,")


def test_rowgate_checks_every_proposal_against_the_float64_loop(tmp_path):
    """The per-row gate's GPU check at tiny shapes: every proposal is run, correct (the
    interpreter runs the kernels right), and its worst row sits within the row tolerance."""
    assert gpu_checks.main(["rowgate", "--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "rowgate.json").read_text())
    rows, summary = data["rows"], data["summary"]
    assert summary["configs"] == len(rows) >= 4 and {r["dtype"] for r in rows} == {"bfloat16", "float32"}
    assert summary["rejected"] == 0 and all(r["passes"] for r in rows), rows
    assert all(r["global"] > 0 and 0 <= r["at"][0] < summary["B"] and 0 <= r["at"][1] < summary["T"] for r in rows)


def test_rowgate_reports_a_kernel_that_zeroes_one_token(tmp_path, monkeypatch):
    """The numbers come from the kernel's output as the gate sees it: one token's row zeroed
    fails every proposal, and the worst row names that token."""
    from rtcompile.tuning import objective

    run = objective.run_kernel

    def zeroes_token_5(bucket, variant, inp):
        o, s = run(bucket, variant, inp)
        o[1, 5] = 0
        return o, s

    monkeypatch.setattr(objective, "run_kernel", zeroes_token_5)
    assert gpu_checks.main(["rowgate", "--quick", "--widths", "4", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "rowgate.json").read_text())["rows"]
    assert rows and all(not r["passes"] and r["at"] == [1, 5] for r in rows), rows
