"""benchmarks/replay_sweep.py: TPE replayed against an exhaustive sweep's stored times."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import optuna

from rtcompile.kernels.variants import ChunkVariant, KernelShape

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import replay_sweep  # noqa: E402

SPACE = {**ChunkVariant.space(KernelShape((16, 16), 64)), "num_stages": [1], "fuse_prepare": [False],
         "dot_precision": ["ieee"], "solve": ["rows"]}
NAME = "rtcompile:chunk o3 16x16 V64 H8 B8 T4096 bfloat16:src x:GPU:fixed num_stages=1:exhaustive"


def _sweep_db(path: Path) -> dict:
    """An exhaustive study over a few variants with made-up times; one is planted fastest."""
    storage = f"sqlite:///{path}"
    study = optuna.create_study(study_name=NAME, storage=storage)
    times = {}
    for i, (C, bk) in enumerate([(16, 256), (32, 256), (16, 128), (32, 128), (64, 64)]):
        params = {"chunk_size": C, "block_k": bk, "block_v": 16, "num_warps": 4, "num_stages": 1,
                  "fuse_prepare": False, "dot_precision": "ieee", "solve": "rows", "prefetch": False, "wy": False}
        dists = {k: optuna.distributions.CategoricalDistribution(SPACE[k]) for k in params}
        value = 1e-3 * (1 + i) if (C, bk) != (32, 128) else 1e-4  # planted best
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=value))
        times[(C, bk)] = value
    return times


def test_replay_reports_gaps_to_the_planted_best(tmp_path, capsys):
    times = _sweep_db(tmp_path / "sweep.db")
    out = tmp_path / "replay.json"
    assert replay_sweep.main([str(tmp_path / "sweep.db"), "--seeds", "3", "--share", "0.4", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["simulated"] and r["valid_variants"] == 5 and r["budget"] == 2
    assert r["exhaustive_best_s"] == min(times.values())
    for rule in ("counted", "replaced"):
        gaps = r[rule]["gaps"]
        assert len(gaps) == 3 and all(g >= 0 for g in gaps)
        # every finite gap is one of the stored times over the planted best: nothing invented
        allowed = {round(t / 1e-4 - 1, 9) for t in times.values()}
        assert all(g == float("inf") or round(g, 9) in allowed for g in gaps)
    assert "gap to the exhaustive best" in capsys.readouterr().out


def test_missing_db_is_a_usage_error(tmp_path, capsys):
    assert replay_sweep.main([str(tmp_path / "nope.db")]) == 2
    assert "no such file" in capsys.readouterr().err
