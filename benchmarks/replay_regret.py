"""Replay of a measured regret run against today's cost model: nothing is measured here.

    python benchmarks/replay_regret.py [--data FILE] [--json OUT]

``benchmarks/gpu_checks.py regret`` timed every alternative the planner considered at each
(spec, phase, B, T) point on a GPU. The data file keeps those times (default: the H200 run of
2026-11-30, ``results/2026-11-30_regret_measured.json``) with the variant each label stood for
then. This script re-plans every point with the cost model of the working tree, uncalibrated and
calibrated on the even-numbered points (as gpu_checks does), and looks up the measured time of
the new choice: regret = that time / the fastest measured - 1. A choice whose variant was not
among the measured ones (the planner's defaults moved since) is reported as "unmeasured", not
guessed. "model pick" ranks only the measured variants by the model, so it judges the cost
model even when the planner's defaults have moved. The cost model's error |log(predicted /
measured)| is reported on the odd-numbered (held-out) points, before and after calibration.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rtcompile.costmodel import Calibration, Cost, calibrate, chunk_cost, recurrent_cost
from rtcompile.kernels.variants import ChunkVariant, RecurrentVariant
from rtcompile.plan import make_plan
from rtcompile.spec import load_spec
from rtcompile.target import get_target

DEFAULT_DATA = ROOT / "benchmarks" / "results" / "2026-11-30_regret_measured.json"
UNMEASURED = "unmeasured"


def _variant(mode: str, variant: dict) -> ChunkVariant | RecurrentVariant:
    return (ChunkVariant if mode == "chunk" else RecurrentVariant).from_dict(variant)


def _mode(label: str) -> str:
    return label.split()[0]  # "chunk fused" -> chunk: gpu_checks._label's names


def _label(mode: str, variant: dict, measured_variants: dict[str, dict]) -> str:
    """The data file's label of a planner alternative, by its exact variant; UNMEASURED when the
    run did not time that variant (gpu_checks names by mode and fuse_prepare only, which would
    map a moved default onto an old measurement)."""
    mine = _variant(mode, variant)
    for label, v in measured_variants.items():
        if _mode(label) == mode and _variant(mode, v) == mine:
            return label
    return UNMEASURED


def _cost(spec, target, phase: str, label: str, variant: dict, B: int, T: int, cal: Calibration) -> Cost:
    """The model's cost of one measured alternative; a recurrent decode alternative was timed as
    the in-place step, so it is costed as one."""
    if _mode(label) == "chunk":
        return chunk_cost(spec, target, B, T, ChunkVariant.from_dict(variant), cal)
    return recurrent_cost(spec, target, B, T, RecurrentVariant.from_dict(variant), cal, step=phase == "decode")


def _regret(measured_s: dict[str, float], label: str) -> float | None:
    if label not in measured_s:
        return None
    return measured_s[label] / min(measured_s.values()) - 1


def _fit(points: list[dict], target) -> Calibration:
    """Calibration on the measured alternatives of ``points`` (uncalibrated model costs)."""
    pred: dict[str, list[Cost]] = {}
    meas: dict[str, list[float]] = {}
    for p in points:
        for label, secs in p["measured_s"].items():
            c = _cost(p["spec_obj"], target, p["phase"], label, p["variants"][label], p["B"], p["T"], Calibration())
            pred.setdefault(c.kind, []).append(c)
            meas.setdefault(c.kind, []).append(secs)
    return calibrate(pred, meas)


def _errors(points: list[dict], target, cal: Calibration) -> list[float]:
    out = []
    for p in points:
        for label, secs in p["measured_s"].items():
            c = _cost(p["spec_obj"], target, p["phase"], label, p["variants"][label], p["B"], p["T"], cal)
            out.append(abs(math.log(c.seconds / secs)))
    return out


def _points(data: dict) -> list[dict]:
    """The data file's rows with seconds, the spec and the variant of every label."""
    specs = {name: load_spec(ROOT / "examples" / f"{name}.toml") for name in data["variants"]}
    to_s = {"ms": 1e-3, "s": 1.0}[data["units"]]
    return [{**r, "spec_obj": specs[r["spec"]], "variants": data["variants"][r["spec"]],
             "measured_s": {label: ms * to_s for label, ms in r["ms"].items()}} for r in data["rows"]]


def _choices(points: list[dict], target, cal: Calibration) -> list[str]:
    """The planner's choice at every point (a label, or UNMEASURED), one plan per spec."""
    out = []
    for p in points:
        same = [q for q in points if q["spec"] == p["spec"]]
        plan = make_plan(p["spec_obj"], target, use_measurements=False, calibration=cal,
                         batches=tuple(sorted({q["B"] for q in same if q["phase"] == "prefill"})),
                         seq_lens=tuple(sorted({q["T"] for q in same if q["phase"] == "prefill"})),
                         decode_batches=tuple(sorted({q["B"] for q in same if q["phase"] == "decode"})))
        d = plan.decision_for(p["phase"], p["B"], p["T"])
        assert (d.batch, d.seq_len) == (p["B"], p["T"]), (d.batch, d.seq_len, p)
        out.append(_label(d.mode, d.variant, p["variants"]))
    return out


def _model_pick(p: dict, target, cal: Calibration) -> str:
    """The measured alternative the cost model ranks fastest."""
    cost = lambda label: _cost(p["spec_obj"], target, p["phase"], label, p["variants"][label], p["B"], p["T"], cal)
    return min(p["measured_s"], key=lambda label: cost(label).seconds)


def _summary(regrets: list[float | None]) -> dict:
    known = [r for r in regrets if r is not None]
    return {"max_regret": max(known, default=None), "within_5pct": sum(r <= 0.05 for r in known),
            "unmeasured": sum(r is None for r in regrets)}


def replay(data: dict) -> dict:
    """Rows (per point: measured times, the run's choice and today's, regrets) and a summary."""
    target = get_target(data["target"])
    points = _points(data)
    cal = _fit(points[0::2], target)
    uncal = Calibration()
    planned = {"uncalibrated": _choices(points, target, uncal), "calibrated": _choices(points, target, cal)}
    rows = []
    for i, p in enumerate(points):
        row = {"spec": p["spec"], "phase": p["phase"], "B": p["B"], "T": p["T"], "held_out": i % 2 == 1,
               "measured_ms": dict(p["ms"]), "then": p["chosen"], "then_regret": _regret(p["measured_s"], p["chosen"])}
        for name, c in (("uncalibrated", uncal), ("calibrated", cal)):
            pick = _model_pick(p, target, c)
            row[name] = {"choice": planned[name][i], "regret": _regret(p["measured_s"], planned[name][i]),
                         "model_pick": pick, "model_pick_regret": _regret(p["measured_s"], pick)}
        rows.append(row)
    held_out = points[1::2]
    before, after = _errors(held_out, target, uncal), _errors(held_out, target, cal)
    summary = {
        "replay_of": data["source"], "points": len(rows), "then": _summary([r["then_regret"] for r in rows]),
        **{name: {**_summary([r[name]["regret"] for r in rows]),
                  "model_pick": _summary([r[name]["model_pick_regret"] for r in rows])}
           for name in ("uncalibrated", "calibrated")},
        "calibration": cal.to_dict(),
        "held_out_alternatives": len(before),
        "cost_error_median_before": statistics.median(before), "cost_error_median_after": statistics.median(after),
        "cost_error_max_before": max(before), "cost_error_max_after": max(after),
    }
    return {"summary": summary, "rows": rows}


def _pct(r: float | None) -> str:
    return "-" if r is None else f"{r * 100:.1f}%"


def _print(result: dict) -> None:
    s = result["summary"]
    print(f"REPLAY against measured times, no new measurement: {s['replay_of']}")
    head = f"{'spec':13} {'phase':7} {'B':>3} {'T':>5} {'then':>16} {'today':>16} {'calibrated':>16} {'model pick':>16}  ms measured"
    print(head)
    for r in result["rows"]:
        cells = [f"{r['then']} {_pct(r['then_regret'])}"]
        cells += [f"{r[n]['choice']} {_pct(r[n]['regret'])}" for n in ("uncalibrated", "calibrated")]
        cells.append(f"{r['calibrated']['model_pick']} {_pct(r['calibrated']['model_pick_regret'])}")
        ms = ", ".join(f"{k} {v:g}" for k, v in r["measured_ms"].items())
        mark = "*" if r["held_out"] else " "
        print(f"{r['spec']:13} {r['phase']:7} {r['B']:>3} {r['T']:>5} " + " ".join(f"{c:>16}" for c in cells)
              + f" {mark}{ms}")
    print("* held out of the calibration; 'model pick': the calibrated model's fastest of the measured variants")
    print(json.dumps(s, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="measured regret table (JSON)")
    ap.add_argument("--json", help="also write the replay to this file")
    args = ap.parse_args(argv)
    result = replay(json.loads(Path(args.data).read_text(encoding="utf-8")))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    _print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
