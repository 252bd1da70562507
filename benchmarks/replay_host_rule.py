"""Replay a regret run (``gpu_checks.py regret``'s regret.json) under two ways of pricing an
eager call, nothing measured here: "sum" (the planner's: device time + host overhead) and "max"
(max(host, device): the host enqueues while the GPU runs, so a GPU-bound call hides its host
time). The eager rows of RESULTS.md fit "max" better at GPU-bound shapes (o3 16x16 B8 T4096
0.362 ms for 0.343 of kernels and ~0.3 of modelled host); this tells which rule ranks and
prices the measured alternatives better before the planner changes.

    python3 benchmarks/replay_host_rule.py RUN/regret.json

Per rule, from the costs the run's plan gave every measured alternative: the median and largest
|log(predicted / measured)|, and at each point the regret of the alternative the rule ranks
first among those measured (its measured time over the fastest's, minus 1); points within 5%.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

RULES = {
    "sum": lambda c: c["seconds"],
    "max": lambda c: max(c["host_s"], c["seconds"] - c["host_s"]),
}


def replay(data: dict) -> dict:
    """Per rule: the cost errors and the pick's regret over the run's measured alternatives,
    priced from the costs the run's plan gave them (``cost``: seconds with host_s inside)."""
    out = {}
    for rule, price in RULES.items():
        errors, regrets = [], []
        for row in data["rows"]:
            priced = [(price(a["cost"]), a["measured_s"]) for a in row["alternatives"]
                      if a.get("measured_s") and "host_s" in a.get("cost", {})]
            if not priced:
                continue
            errors += [abs(math.log(p / m)) for p, m in priced]
            pick = min(priced)[1]
            regrets.append(pick / min(m for _, m in priced) - 1)
        out[rule] = {"points": len(regrets), "error_median": statistics.median(errors) if errors else float("nan"),
                     "error_max": max(errors, default=float("nan")), "regret_max": max(regrets, default=float("nan")),
                     "within_5pct": sum(r <= 0.05 for r in regrets)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("regret_json")
    a = ap.parse_args(argv)
    try:
        res = replay(json.loads(Path(a.regret_json).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"replay_host_rule: {a.regret_json}: not a regret.json ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    print(f"{'rule':5} {'points':>6} {'within 5%':>9} {'max regret':>10} {'median |log|':>12} {'max |log|':>9}")
    for rule, r in res.items():
        print(f"{rule:5} {r['points']:6} {r['within_5pct']:9} {r['regret_max']:10.3f} {r['error_median']:12.3f} "
              f"{r['error_max']:9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
