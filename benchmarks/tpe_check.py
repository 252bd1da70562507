"""Issue 22's tuner must-show: does a TPE study reach within 3% of the exhaustive best of a
sub-space with about 20% of its trials? One exhaustive sweep per bucket, then ``--seeds``
TPE studies with ``--trials`` trials each (the study's seed differs, so the warm starts' order
and TPE's draws differ), every study in a SQLite file of its own under ``--out``; a temporary
tuned-config table, so nothing this check finds becomes a default.

    python3 benchmarks/tpe_check.py examples/order2_64.toml --batch 1,8 --seq-len 4096 \\
        --fix form=split --fix split.chunk_size=32 --trials 10 --seeds 3 --workers 4 --out $OUT/tpe

Per bucket: the sub-space's size, the sweep's best, and per TPE study the best of its own
trials (inside the sub-space; ``rtcompile tune`` records the default beside it, which a fixed
sub-space may not hold), and its ratio to the sweep's best twice: with the sweep's own times
(one pass, one time per config) and re-timed beside the sweep's best few, interleaved over
``--rounds`` (medians); within 3% or not. Without a GPU it runs on the interpreter with the
CPU's small shapes (a smoke run: those timings are not GPU timings).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WITHIN = 1.03
# The sweep times each config once, and a study's pick can be timed there on a bad pass: on the
# H100 (58c9343) all three o2 64 B8 studies picked a config they timed at 0.277 ms and the sweep
# at 0.297 (7% over). So the sweep's best few and every pick are timed again, interleaved, in one
# pass of ROUNDS rounds, and the ratio is also taken there (both ratios are reported).
REMEASURE_TOP = 5
ROUNDS = 5


def interleaved_medians(configs: list, measure, rounds: int) -> dict:
    """config -> median of ``measure(config)`` over ``rounds`` passes over all configs, the order
    rotated each pass (a drift in the machine then falls on every config alike). A config whose
    measurement fails (None) in any pass is left out."""
    times = {c: [] for c in configs}
    for r in range(rounds):
        for c in configs[r % len(configs):] + configs[:r % len(configs)]:
            times[c].append(measure(c))
    return {c: sorted(t)[len(t) // 2] for c, t in times.items() if None not in t}


def _measure(bucket, base):
    """One config's gated time as the tuner takes it (objective.evaluate), or None."""
    from rtcompile.tuning.objective import evaluate

    def measure(cfg) -> float | None:
        r = evaluate({"bucket": dataclasses.asdict(bucket), "variant": cfg.to_dict(), "device": base.device,
                      "seed": 0, "repeats": base.repeats})
        return r["seconds"] if r["status"] == "ok" else None
    return measure


def _trial_times(storage: str, name: str) -> dict:
    """config -> seconds of every completed trial of the study ``name`` (its own measurement; a
    study's recorded best may be the default re-measured, outside a fixed sub-space), keyed by
    the canonical config: the sweep holds one of each set of configs that differ in inert
    fields only, while a TPE study may draw any of them (the fastest time of a config kept)."""
    import optuna

    from rtcompile.tuning.space import params_config

    study = optuna.load_study(study_name=name, storage=storage)
    times: dict = {}
    for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)):
        cfg = params_config(t.params).canonical()
        times[cfg] = min(t.value, times.get(cfg, t.value))
    return times


def _not_ok(storage: str, name: str) -> list[str]:
    """Each trial of the study ``name`` that ran no timing, a repeat of an earlier one aside, as
    "status: reason" (a study that ran fewer than its budget of variants says why)."""
    import optuna

    study = optuna.load_study(study_name=name, storage=storage)
    return [f"{t.user_attrs.get('status')}: {t.user_attrs.get('reason', '')}" for t in study.get_trials(deepcopy=False)
            if t.user_attrs.get("status") not in (None, "ok", "repeat")]


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
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help="interleaved rounds re-timing the sweep's best few and the studies' picks")
    ap.add_argument("--out", required=True, help="folder for the studies' SQLite files and tpe_check.json")
    a = ap.parse_args(argv)
    if a.trials < 1 or a.seeds < 1 or a.rounds < 1:
        print("tpe_check: --trials, --seeds and --rounds take integers >= 1", file=sys.stderr)
        return 2
    import torch

    from rtcompile.kernels.forms import config_from_dict
    from rtcompile.spec import load_spec
    from rtcompile.cli_args import tuning_buckets
    from rtcompile.tuning import TuneOptions, search_space, tune_bucket
    from rtcompile.tuning.space import exhaustive_variants, params_config
    from rtcompile.tuning.options import DEFAULT_SEED

    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"
    spec = load_spec(a.spec)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    table = os.path.join(tempfile.mkdtemp(prefix="tpe_check_"), "tuned.json")
    base = TuneOptions(trials=a.trials, workers=a.workers, device="cuda" if on_gpu else "cpu",
                       repeats=20 if on_gpu else 3, fixed=dict(a.fix), table=table)
    rows = []
    for bucket in tuning_buckets(spec, "prefill", a.batch, a.seq_len, None, on_gpu):
        search_space(bucket, base)  # a bad --fix: a ValueError naming what is allowed, before any trial
        size = len(exhaustive_variants(bucket, base))
        ex_url = f"sqlite:///{out}/exhaustive.db"
        ex = tune_bucket(bucket, dataclasses.replace(base, exhaustive=True, trials=None, storage=ex_url))
        swept = _trial_times(ex_url, ex.study)
        best = min(swept, key=swept.get)
        row = {"bucket": bucket.label, "space": size, "trials": a.trials, "exhaustive_ms": swept[best] * 1e3,
               "exhaustive_best": best.to_dict(), "studies": []}
        picks = []
        for i in range(a.seeds):
            url = f"sqlite:///{out}/tpe_seed{i}.db"
            r = tune_bucket(bucket, dataclasses.replace(base, seed=DEFAULT_SEED + i, storage=url))
            mine = _trial_times(url, r.study)  # the study's own trials: its best inside the sub-space
            cfg = min(mine, key=mine.get)
            picks.append(cfg)
            in_sweep = swept.get(cfg)
            row["studies"].append({
                "seed": DEFAULT_SEED + i, "best_ms": mine[cfg] * 1e3, "best": cfg.to_dict(), "ran": len(mine),
                "counts": r.counts, "not_ok": _not_ok(url, r.study),
                "best_in_sweep_ms": in_sweep * 1e3 if in_sweep else None,
                "ratio_in_sweep": in_sweep / min(swept.values()) if in_sweep else None,
            })
        top = sorted(swept, key=swept.get)[:REMEASURE_TOP]
        again = interleaved_medians(list(dict.fromkeys(top + picks)), _measure(bucket, base), a.rounds)
        fastest = min(again.values()) if again else None
        row["remeasured"] = {"rounds": a.rounds, "best_ms": fastest * 1e3 if fastest else None,
                             "best": min(again, key=again.get).to_dict() if again else None}
        for study, cfg in zip(row["studies"], picks):
            study["remeasured_ratio"] = again[cfg] / fastest if cfg in again else None
        rows.append(row)
        (out / "tpe_check.json").write_text(json.dumps(rows, indent=1))  # as it goes: a cut call keeps it
    print(f"{'bucket':34} {'space':>5} {'trials':>6} {'exhaustive ms':>13}  TPE best ms / in sweep (ratio in sweep; "
          f"re-measured beside the sweep's best {REMEASURE_TOP}, {a.rounds} rounds)")
    ok = lambda ratio: "-" if ratio is None else f"{ratio:.3f}{' ok' if ratio <= WITHIN else ' OFF'}"  # noqa: E731
    for row in rows:
        studies = "  ".join(
            f"{s['best_ms']:.4f}/" + (f"{s['best_in_sweep_ms']:.4f}" if s["best_in_sweep_ms"] else "-")
            + f" ({ok(s['ratio_in_sweep'])}; {ok(s['remeasured_ratio'])})" for s in row["studies"])
        share = math.ceil(100 * row["trials"] / max(1, row["space"]))
        print(f"{row['bucket']:34} {row['space']:5} {row['trials']:4} ({share}%) {row['exhaustive_ms']:9.4f}  {studies}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
