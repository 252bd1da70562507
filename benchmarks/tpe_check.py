"""Issue 22's tuner must-show: does a TPE study reach within 3% of the exhaustive best of a
sub-space with about 20% of its trials? One exhaustive sweep per bucket, then ``--seeds``
TPE studies with ``--trials`` trials each (the study's seed differs, so the warm starts' order
and TPE's draws differ), every study in a SQLite file of its own under ``--out``; a temporary
tuned-config table, so nothing this check finds becomes a default.

    python3 benchmarks/tpe_check.py examples/order2_64.toml --batch 1,8 --seq-len 4096 \\
        --fix form=split --fix split.chunk_size=32 --trials 10 --seeds 3 --workers 4 --out $OUT/tpe

Per bucket: the sub-space's size, the sweep's best, and per TPE study the best of its own
trials (inside the sub-space; ``rtcompile tune`` records the default beside it, which a fixed
sub-space may not hold), that config's time in the sweep (one measurement pass for both: the
ratio) and whether that is within 3%. Without a GPU it runs on the interpreter with the CPU's small shapes (a smoke run:
those timings are not GPU timings).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WITHIN = 1.03


def _trial_times(storage: str, name: str) -> dict:
    """config -> seconds of every completed trial of the study ``name`` (its own measurement; a
    study's recorded best may be the default re-measured, outside a fixed sub-space)."""
    import optuna

    from rtcompile.tuning.space import params_config

    study = optuna.load_study(study_name=name, storage=storage)
    return {params_config(t.params): t.value for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))}


def main(argv=None) -> int:
    from rtcompile.cli_args import fixed_param, int_list

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("--batch", type=int_list, default=None, help="prefill batch buckets, e.g. 1,8")
    ap.add_argument("--seq-len", type=int_list, default=None, help="prefill length buckets, e.g. 4096")
    ap.add_argument("--fix", type=fixed_param, action="append", default=[], metavar="NAME=VALUE",
                    help="as rtcompile tune --fix")
    ap.add_argument("--trials", type=int, default=10, help="trials per TPE study")
    ap.add_argument("--seeds", type=int, default=3, help="TPE studies per bucket, one seed each")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", required=True, help="folder for the studies' SQLite files and tpe_check.json")
    a = ap.parse_args(argv)
    if a.trials < 1 or a.seeds < 1:
        print("tpe_check: --trials and --seeds take integers >= 1", file=sys.stderr)
        return 2
    import torch

    from rtcompile.kernels.forms import config_from_dict
    from rtcompile.spec import load_spec
    from rtcompile.tune_cmd import buckets_of
    from rtcompile.tuning import TuneOptions, search_space, tune_bucket
    from rtcompile.tuning.space import exhaustive_variants, params_config
    from rtcompile.tuning.study import DEFAULT_SEED

    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"
    spec = load_spec(a.spec)
    args = types.SimpleNamespace(phase="prefill", batch=a.batch,
                                 seq_len=a.seq_len, decode_batch=None)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    table = os.path.join(tempfile.mkdtemp(prefix="tpe_check_"), "tuned.json")
    base = TuneOptions(trials=a.trials, workers=a.workers, device="cuda" if on_gpu else "cpu",
                       repeats=20 if on_gpu else 3, fixed=dict(a.fix), table=table)
    rows = []
    for bucket in buckets_of(spec, args, on_gpu):
        search_space(bucket, base)  # a bad --fix: a ValueError naming what is allowed, before any trial
        size = len(exhaustive_variants(bucket, base))
        ex_url = f"sqlite:///{out}/exhaustive.db"
        ex = tune_bucket(bucket, dataclasses.replace(base, exhaustive=True, trials=None, storage=ex_url))
        swept = _trial_times(ex_url, ex.study)
        best = min(swept, key=swept.get)
        row = {"bucket": bucket.label, "space": size, "trials": a.trials, "exhaustive_ms": swept[best] * 1e3,
               "exhaustive_best": best.to_dict(), "studies": []}
        for i in range(a.seeds):
            url = f"sqlite:///{out}/tpe_seed{i}.db"
            r = tune_bucket(bucket, dataclasses.replace(base, seed=DEFAULT_SEED + i, storage=url))
            mine = _trial_times(url, r.study)  # the study's own trials: its best inside the sub-space
            cfg = min(mine, key=mine.get)
            in_sweep = swept.get(cfg)
            row["studies"].append({
                "seed": DEFAULT_SEED + i, "best_ms": mine[cfg] * 1e3, "best": cfg.to_dict(), "ran": len(mine),
                "best_in_sweep_ms": in_sweep * 1e3 if in_sweep else None,
                "ratio_in_sweep": in_sweep / min(swept.values()) if in_sweep else None,
            })
        rows.append(row)
        (out / "tpe_check.json").write_text(json.dumps(rows, indent=1))  # as it goes: a cut call keeps it
    print(f"{'bucket':34} {'space':>5} {'trials':>6} {'exhaustive ms':>13}  TPE best ms / in sweep (ratio in sweep)")
    for row in rows:
        studies = "  ".join(
            f"{s['best_ms']:.4f}/{s['best_in_sweep_ms']:.4f} ({s['ratio_in_sweep']:.3f}"
            f"{' ok' if s['ratio_in_sweep'] <= WITHIN else ' OFF'})" if s["ratio_in_sweep"] else
            f"{s['best_ms']:.4f}/- (not in sweep)" for s in row["studies"])
        share = math.ceil(100 * row["trials"] / max(1, row["space"]))
        print(f"{row['bucket']:34} {row['space']:5} {row['trials']:4} ({share}%) {row['exhaustive_ms']:9.4f}  {studies}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
