"""Replay: how close a TPE search of N trials gets to an exhaustive sweep's best, offline.

An exhaustive sweep (``rtcompile tune --exhaustive``) stores a measured time for every valid
variant of a sub-space. This replays TPE searches against those times instead of a GPU: the
objective of a sampled variant is its time from the sweep, and a variant the sweep does not
hold (refused by the resource estimate on that GPU) is pruned, as ``rtcompile tune`` prunes
it. It compares the two budget rules, over many sampler seeds:

* ``counted``: a pruned trial uses a budget slot (rtcompile before 2026-11-30);
* ``replaced``: a pruned trial gives its slot back (``MAX_PRUNED_PER_TRIAL`` caps the refills).

It is a simulation over measured times, not a measurement: trial-to-trial noise of the real
timing (the sweep's re-measure at the end moved values by 10-20%) is not in it.

    python3 benchmarks/replay_sweep.py SWEEP_DB [--share 0.2] [--seeds 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import optuna

from rtcompile.tuning.study import MAX_PRUNED_PER_TRIAL


def _exhaustive(storage: str) -> tuple[str, dict[tuple, float], dict[str, list]]:
    """The first exhaustive study: its name, params -> seconds, and the space its trials span."""
    names = [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)
             if s.study_name.endswith(":exhaustive")]
    if not names:
        raise SystemExit(f"replay_sweep: no exhaustive study in {storage}")
    study = optuna.load_study(study_name=names[0], storage=storage)
    done = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    keys = sorted(done[0].params)
    times = {tuple(t.params[k] for k in keys): t.value for t in done}
    return names[0], times, {k: sorted({t.params[k] for t in done}, key=str) for k in keys}


def _full_space(name: str, observed: dict[str, list]) -> dict[str, list]:
    """The kernel's declared space for the study's bucket and fixed parameters: the sampler must
    see the refused choices too (they are what gets pruned)."""
    from rtcompile.kernels.variants import ChunkVariant, KernelShape

    label = name.split(":")[1]  # "chunk o3 16x16 V64 H8 B8 T4096 bfloat16"
    parts = label.split()
    widths = tuple(int(w) for w in parts[2].split("x"))
    shape = KernelShape(widths, int(parts[3][1:]))
    space = dict(ChunkVariant.space(shape))
    for k, vals in observed.items():
        if len(vals) == 1:  # a fixed parameter of the sweep
            space[k] = vals
    return space


def search(times: dict[tuple, float], space: dict[str, list], budget: int, seed: int, replace: bool) -> float:
    """Best time a TPE search of ``budget`` run variants finds (inf when it runs none)."""
    keys = sorted(space)
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed))
    ran = pruned = 0
    best = float("inf")
    while ran < budget:
        if not replace and ran + pruned >= budget:
            break
        if replace and pruned >= MAX_PRUNED_PER_TRIAL * budget:
            break
        trial = study.ask()
        params = tuple(trial.suggest_categorical(k, space[k]) for k in keys)
        if params not in times:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            pruned += 1
            continue
        study.tell(trial, times[params])
        best = min(best, times[params])
        ran += 1
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("db", type=Path, help="SQLite file of a sweep (gpu_session.sh sweep)")
    ap.add_argument("--share", type=float, default=0.2, help="TPE budget as a share of the valid variants")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not args.db.is_file():
        print(f"replay_sweep: db: no such file {args.db}", file=sys.stderr)
        return 2
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name, times, observed = _exhaustive(f"sqlite:///{args.db}")
    space = _full_space(name, observed)
    budget = max(1, round(args.share * len(times)))
    best = min(times.values())
    result = {"study": name, "valid_variants": len(times), "budget": budget, "exhaustive_best_s": best,
              "seeds": args.seeds, "simulated": True}
    for rule in ("counted", "replaced"):
        gaps = [search(times, space, budget, seed, rule == "replaced") / best - 1 for seed in range(args.seeds)]
        result[rule] = {"gap_median": statistics.median(gaps), "gap_max": max(gaps),
                        "within_3pct": sum(g <= 0.03 for g in gaps), "gaps": gaps}
        print(f"{rule:>8}: budget {budget} of {len(times)} valid; gap to the exhaustive best: median "
              f"{statistics.median(gaps):.1%}, max {max(gaps):.1%}, within 3% in "
              f"{result[rule]['within_3pct']}/{args.seeds} seeds")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
