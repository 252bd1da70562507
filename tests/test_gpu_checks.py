"""benchmarks/gpu_checks.py runs end to end at tiny shapes (its GPU numbers live in RESULTS.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_checks  # noqa: E402


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


def test_sweep_report_compares_tpe_with_the_exhaustive_study(tmp_path):
    import optuna

    url = f"sqlite:///{tmp_path / 's.db'}"
    name = "rtcompile:chunk o3 2x4 V8 H1 B1 T32 float32:src x:cpu cccpu:triton 3:rtcompile 0:fixed num_stages=1"
    dist = optuna.distributions.CategoricalDistribution([16, 32, 64])
    for study_name, values in ((name + ":exhaustive", {16: 3.0, 32: 1.0, 64: 2.0}), (name, {16: 3.0, 64: 2.0})):
        study = optuna.create_study(study_name=study_name, storage=url)
        study.set_user_attr("default_seconds", 4.0)
        for c, v in values.items():
            study.add_trial(optuna.trial.create_trial(params={"chunk_size": c}, distributions={"chunk_size": dist},
                                                      value=v))
    assert gpu_checks.main(["sweep", "--storage", url, "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert row["exhaustive"]["best_s"] == 1.0 and row["tpe"]["best_s"] == 2.0
    assert row["gap"] == 1.0 and abs(row["trial_share"] - 2 / 3) < 1e-9 and row["fixed"] == "num_stages=1"
