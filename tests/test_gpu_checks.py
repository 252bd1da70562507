"""benchmarks/gpu_checks.py runs end to end at tiny shapes (its GPU numbers live in RESULTS.md), and
benchmarks/replay_regret.py replays the measured H200 regret run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # gpu_checks, replay_regret

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


def test_replay_regret_reads_its_times_from_the_data_file(tmp_path, capsys):
    import replay_regret

    data = json.loads(replay_regret.DEFAULT_DATA.read_text())
    out = tmp_path / "replay.json"
    assert replay_regret.main(["--json", str(out)]) == 0
    assert "REPLAY against measured times, no new measurement" in capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert len(rows) == result["summary"]["points"] == len(data["rows"]) == 18
    for r, d in zip(rows, data["rows"]):
        ms = d["ms"]
        assert r["measured_ms"] == ms and r["then_regret"] == pytest.approx(ms[d["chosen"]] / min(ms.values()) - 1)
        for name in ("uncalibrated", "calibrated"):
            pick = r[name]
            assert pick["model_pick"] in ms  # the model ranks the measured variants only
            assert pick["model_pick_regret"] == pytest.approx(ms[pick["model_pick"]] / min(ms.values()) - 1)
            if pick["choice"] == replay_regret.UNMEASURED:  # the planner's variant moved since the run
                assert pick["regret"] is None
            else:
                assert pick["regret"] == pytest.approx(ms[pick["choice"]] / min(ms.values()) - 1)
    s = result["summary"]
    assert s["held_out_alternatives"] == sum(len(d["ms"]) for d in data["rows"][1::2])
    assert s["cost_error_median_before"] > 0 and s["cost_error_median_after"] > 0
    # other times in the file, other regrets: make the run's fastest at B8 T16 3x slower
    slow = json.loads(json.dumps(data))
    row = slow["rows"][3]
    best = min(row["ms"], key=row["ms"].get)
    row["ms"][best] *= 3
    again = replay_regret.replay(slow)["rows"][3]
    assert again["then_regret"] == pytest.approx(row["ms"][row["chosen"]] / min(row["ms"].values()) - 1)
    assert again["measured_ms"][best] == pytest.approx(3 * data["rows"][3]["ms"][best])


def test_replay_reports_a_variant_it_did_not_measure_as_unmeasured():
    import replay_regret

    data = json.loads(replay_regret.DEFAULT_DATA.read_text())
    for variants in data["variants"].values():  # pretend the run measured other recurrent variants
        variants["recurrent"] = {**variants["recurrent"], "num_warps": 1}
    rows = replay_regret.replay(data)["rows"]
    for r in rows:
        if r["phase"] == "decode":  # the planner's recurrent default was not measured now
            assert r["uncalibrated"]["choice"] == replay_regret.UNMEASURED and r["uncalibrated"]["regret"] is None
