"""What ``rtcompile explore`` writes: the terminal table (rich), ``results.json``,
``results.csv`` and the PNG plots (matplotlib, Agg), with the Pareto front marked.

The front minimises state bytes per sequence and decode latency at PARETO_DECODE_BATCH and,
with recall, maximises MQAR accuracy; a point missing one of those figures (refused, failed,
a shape that could not run) is on no front. Every speed figure carries its source
(``measured`` or ``model``); the JSON header records the GPU (or ``none``), the versions, the
commit, the seeds and the learning rates chosen. Files are written atomically (temporary file,
then rename), so a reader never sees half of one.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from .._version import __version__
from ..fileio import atomic_write
from ..figures import human_bytes, human_count
from .points import MATCH_TOLERANCE, MLP, parameters
from .sweep import DECODE_BATCHES, PARETO_DECODE_BATCH, PREFILL_SHAPES, SweepResult

RESULTS_JSON, RESULTS_CSV = "results.json", "results.csv"
PLOT_DECODE, PLOT_RECALL = "state_vs_decode.png", "state_vs_recall.png"
# validation accuracy against step per point and rate: MQAR sits at chance for thousands of steps
# before it learns (order 3 16x16 left it at step ~4000 of 8000 on the H200), so a point that ends
# at chance may only have run out of schedule; the curves show which
PLOT_CURVES = "recall_curves.png"
REPORT_FILES = (RESULTS_JSON, RESULTS_CSV, PLOT_DECODE, PLOT_RECALL, PLOT_CURVES)  # what write_report may write
HEADER_IN_CSV = ("gpu", "speed_source", "target", "match", "commit", "date")  # so one CSV row says where it came from
LATENCY_MEANS = ("the state mixer of every layer: one layer's call x layers (projections, MLP, embedding and head "
                 "excluded); measured: `rtcompile bench`'s timing (CUDA-graph replays, median, L2 rotated), gate, "
                 "delta rule and l2norm on, fp32 state; model: the planner's choice and cost on the target")
NOTE_IN_TABLE = 90  # characters of a note the table shows (a refusal runs to ~250); the JSON keeps it whole
PARAMETERS_MEAN = f"RunningTensorLM({'with' if MLP else 'without'} MLP) parameters, embedding and head excluded"


def pareto_front(items: Sequence[Mapping[str, Any]], objectives: Sequence[tuple[str, str]]) -> list[bool]:
    """For each item, whether it is on the Pareto front of ``objectives`` ((key, "min" | "max")
    pairs): it has every objective (a number, not None) and no other such item is at least as
    good in all of them and better in one. Equal items are all on the front."""
    for key, sense in objectives:
        if sense not in ("min", "max"):
            raise ValueError(f"objectives: {key!r} has sense {sense!r}; allowed: min, max")
    signed = []
    for it in items:
        vals = [it.get(k) for k, _ in objectives]
        ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in vals)
        signed.append([v if s == "min" else -v for v, (_, s) in zip(vals, objectives)] if ok else None)
    # b dominates a: no worse in every objective, better in one
    dominated = lambda a, b: all(y <= x for x, y in zip(a, b)) and any(y < x for x, y in zip(a, b))
    return [a is not None and not any(b is not None and dominated(a, b) for b in signed) for a in signed]


def _tag(figure: Mapping[str, Any]) -> str:
    if figure["phase"] == "prefill":
        return f"prefill_B{figure['batch']}_T{figure['seq_len']}"
    return f"decode_B{figure['batch']}"


def objectives(recall: bool) -> list[tuple[str, str]]:
    return [("state_bytes_per_sequence", "min"), ("decode_s", "min")] + ([("recall_accuracy", "max")] if recall else [])


def records(result: SweepResult) -> list[dict[str, Any]]:
    """One plain record per point, in grid order, with its Pareto flag."""

    out = []
    for p in result.points:
        rec: dict[str, Any] = {"id": p.id, "order": p.order, "width": p.width, "key_widths": [p.width] * (p.order - 1)}
        if p.spec is None:
            rec.update(status="refused", note=p.refusal, spec=None, speed=[], recall=None)
            out.append(rec)
            continue
        s = p.spec
        got = result.results.get(p.id)
        rec.update(status="ok" if got is not None else "failed", note=result.errors.get(p.id, ""),
                   heads=s.heads, value_width=s.value_width, model_width=s.model_width, layers=s.layers,
                   match=p.match, state_bytes_per_sequence=s.state_bytes_per_sequence,
                   state_bytes_per_layer=s.state_bytes_per_layer, parameters=parameters(s),
                   speed=(got or {}).get("speed", []), recall=(got or {}).get("recall"),
                   wall_s=(got or {}).get("wall_s"), spec=s.to_dict())
        if p.match is not None and not p.match["within"]:
            rec["note"] = (rec["note"] + "; " if rec["note"] else "") + \
                f"{p.match['mode']} match missed by {p.match['gap']:.1%} (> {MATCH_TOLERANCE:.0%})"
        dec = [f for f in rec["speed"] if f["phase"] == "decode" and f["batch"] == PARETO_DECODE_BATCH]
        rec["decode_s"] = dec[0]["seconds"] if dec else None
        rec["recall_accuracy"] = rec["recall"]["accuracy"] if rec["recall"] else None
        out.append(rec)
    front = pareto_front(out, objectives(result.opts.recall is not None))
    for rec, on in zip(out, front):
        rec["pareto"] = on
    return out


def _mask(url: str) -> str:
    """The storage URL without a password (``user:secret@host`` -> ``user:***@host``)."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


def header(result: SweepResult) -> dict[str, Any]:
    """Where and how the sweep ran: device, versions, commit, the options, the seeds and the
    learning rates chosen per point."""
    import torch

    from ..bench.report import git_commit

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit, dirty = git_commit()
    opts = {**result.opts.to_dict(), "storage": _mask(result.storage)}
    recall = None
    if result.opts.recall is not None:
        r = result.opts.recall
        recall = {"seq_len": r.seq_len, "kv_pairs": r.kv_pairs, "vocab_size": r.vocab_size, "steps": r.steps, "batch_size": r.batch_size,
                  "seeds": list(r.seeds), "learning_rates_swept": list(r.learning_rates),
                  "learning_rates_chosen": {pid: (res.get("recall") or {}).get("learning_rates_chosen")
                                            for pid, res in result.results.items()}}
    return {
        "rtcompile": __version__, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "torch": torch.__version__, "triton": triton_version, "python": sys.version.split()[0],
        "commit": commit, "git_dirty": dirty,
        "speed_source": result.mode.source, "target": result.mode.target, "speed_why": result.mode.why,
        "latency_is": LATENCY_MEANS, "parameters_are": PARAMETERS_MEAN,
        "prefill_shapes": [list(s) for s in PREFILL_SHAPES], "decode_batches": list(DECODE_BATCHES),
        "match": result.opts.match, "match_tolerance": MATCH_TOLERANCE,
        "pareto_objectives": [list(o) for o in objectives(recall is not None)],
        "pareto_decode_batch": PARETO_DECODE_BATCH, "recall": recall,
        "base_spec": result.base.to_dict(), "options": opts,
        "study": result.study, "storage": _mask(result.storage), "points_run_now": result.ran, "wall_s": result.wall_s,
    }


def _plain(v: Any) -> Any:
    """Strict JSON: non-finite floats become None, recursively."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def csv_rows(recs: Sequence[Mapping[str, Any]], head: Mapping[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """(columns, rows): one row per point, each speed figure as seconds / tokens per s / source."""
    tags = [f"prefill_B{b}_T{t}" for b, t in PREFILL_SHAPES] + [f"decode_B{b}" for b in DECODE_BATCHES]
    cols = ["id", "order", "key_widths", "status", "heads", "value_width", "model_width", "layers", "matched_by",
            "match_gap", "state_bytes_per_sequence", "state_bytes_per_layer", "parameters"]
    cols += [f"{t}_{x}" for t in tags for x in ("s", "tokens_per_s", "source")]
    cols += ["recall_accuracy", "recall_learning_rates", "recall_device", "pareto", "note", *HEADER_IN_CSV]
    rows = []
    for r in recs:
        row: dict[str, Any] = {c: r.get(c) for c in cols}
        row["key_widths"] = "x".join(map(str, r["key_widths"]))
        m = r.get("match")
        row["matched_by"] = " ".join(f"{k}={v}" for k, v in m["by"].items()) if m else None
        row["match_gap"] = m["gap"] if m else None
        for f in r.get("speed", []):
            t = _tag(f)
            row[f"{t}_s"], row[f"{t}_tokens_per_s"], row[f"{t}_source"] = f["seconds"], f["tokens_per_s"], f["source"]
        rec = r.get("recall")
        row["recall_learning_rates"] = " ".join(map(str, rec["learning_rates_chosen"])) if rec else None
        row["recall_device"] = rec.get("device") if rec else None  # absent from results stored before it was kept
        row.update({k: head.get(k) for k in HEADER_IN_CSV})
        rows.append({k: ("" if v is None else v) for k, v in row.items()})
    return cols, rows


def _clip(note: str | None, n: int = NOTE_IN_TABLE) -> str:
    note = note or ""
    return note if len(note) <= n else note[: n - 3] + "..."


def _speed_cell(f: Mapping[str, Any] | None) -> str:
    if f is None or f["seconds"] is None:
        return "-"
    s = f["seconds"]
    lat = f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"
    return f"{lat}, {human_count(f['tokens_per_s'])} tok/s"


def print_table(recs: Sequence[Mapping[str, Any]], head: Mapping[str, Any], file: Any = None) -> None:
    """The rich table: one row per point; speed cells read "latency, throughput"; the source
    column says whether a row's speed figures were measured or modelled (on which target)."""
    from rich.console import Console
    from rich.table import Table

    shapes = [("prefill", b, t) for b, t in PREFILL_SHAPES] + [("decode", b, 1) for b in DECODE_BATCHES]
    src = "measured on " + head["target"] if head["speed_source"] == "measured" else f"model: {head['target']}"
    match = f", matched by {head['match']}" if head["match"] else ""
    table = Table(title=f"explore {head['base_spec'].get('name') or ''} ({src}{match}; "
                  "mixer latency, all layers)", header_style="bold")
    cols = ["point", "key axes", "H x d_v", "D", "state/seq", "state/layer", "params"]
    cols += [f"{ph} B{b}" + (f" T{t}" if ph == "prefill" else "") for ph, b, t in shapes]
    cols += ["source"] + (["recall"] if head["recall"] else []) + ["front", "note"]
    for c in cols:
        table.add_column(c, overflow="fold")
    for r in recs:
        axes = "x".join(map(str, r["key_widths"]))
        if r["status"] == "refused":
            table.add_row(r["id"], axes, *["-"] * (len(cols) - 4), "", _clip(r["note"]))
            continue
        figs = {(f["phase"], f["batch"], f["seq_len"]): f for f in r["speed"]}
        sources = sorted({f["source"] for f in r["speed"] if f["seconds"] is not None})
        row = [r["id"], axes, f"{r['heads']} x {r['value_width']}", str(r["model_width"]),
               human_bytes(r["state_bytes_per_sequence"]), human_bytes(r["state_bytes_per_layer"]),
               human_count(r["parameters"])]
        row += [_speed_cell(figs.get(s)) for s in shapes]
        row.append("+".join(sources) or "-")
        if head["recall"]:
            row.append("-" if r["recall_accuracy"] is None else f"{r['recall_accuracy']:.3f}")
        row += ["*" if r["pareto"] else "", _clip(r["note"])]
        table.add_row(*row)
    Console(file=file or sys.stdout, width=220, markup=False).print(table)  # names and notes are text, never markup


def _plot(path: Path, recs: Sequence[Mapping[str, Any]], y_key: str, y_label: str, title: str, log_y: bool) -> Path:
    """State bytes per sequence (x, log 2) against ``y_key``; the front in red, joined."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    pts = [r for r in recs if r.get(y_key) is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    try:
        xs = [r["state_bytes_per_sequence"] for r in pts]
        ys = [r[y_key] * (1e3 if y_key == "decode_s" else 1) for r in pts]
        ax.scatter(xs, ys, c=["tab:red" if r["pareto"] else "tab:gray" for r in pts], zorder=3)
        front = sorted((x, y) for x, y, r in zip(xs, ys, pts) if r["pareto"])
        if front:
            ax.plot(*zip(*front), color="tab:red", lw=1, zorder=2, label="Pareto front")
            ax.legend(loc="best")
        for x, y, r in zip(xs, ys, pts):
            ax.annotate(r["id"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        if pts:  # log axes of no data refuse to draw
            ax.set_xscale("log", base=2)
            if log_y:
                ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "no point has this figure (see the table's notes)", ha="center", transform=ax.transAxes)
        ax.set_xlabel("state bytes per sequence (all layers)")
        ax.set_ylabel(y_label)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    return atomic_write(path, buf.getvalue())


def _plot_curves(path: Path, recs: Sequence[Mapping[str, Any]]) -> Path:
    """Each point's validation accuracy against training step, one line per learning rate (the
    first seed's run), from the trainer's ``per_rate_history``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    try:
        drawn = 0
        for i, r in enumerate(recs):
            runs = (r.get("recall") or {}).get("runs") or []
            history = (runs[0].get("per_rate_history") or {}) if runs else {}
            for j, (lr, hist) in enumerate(sorted(history.items(), key=lambda kv: float(kv[0]))):
                if hist:
                    ax.plot([h["step"] for h in hist], [h["accuracy"] for h in hist], color=f"C{i % 10}",
                            linestyle=("-", "--", ":", "-.")[j % 4], label=f"{r['id']} lr {float(lr):g}")
                    drawn += 1
        if drawn:
            ax.legend(loc="best", fontsize=7)
        else:
            ax.text(0.5, 0.5, "no training history recorded", ha="center", transform=ax.transAxes)
        ax.set_xlabel("training step")
        ax.set_ylabel("MQAR validation accuracy")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title("recall during training (first seed)", fontsize=10)
        ax.grid(True, alpha=0.3)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    return atomic_write(path, buf.getvalue())


def write_report(result: SweepResult, out: str | Path, *, file: Any = None) -> dict[str, Path]:
    """Write results.json, results.csv and the plots into ``out`` (created), then print the
    table to ``file`` (stdout); returns the paths written by name."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    recs = records(result)
    head = header(result)
    paths = {"json": atomic_write(out / RESULTS_JSON, json.dumps(_plain({"header": head, "points": recs}),
                                                                  indent=1, allow_nan=False) + "\n")}
    cols, rows = csv_rows(recs, head)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    paths["csv"] = atomic_write(out / RESULTS_CSV, buf.getvalue())
    src = f"measured on {result.mode.target}" if result.mode.source == "measured" else f"model: {result.mode.target}"
    paths["decode_plot"] = _plot(out / PLOT_DECODE, recs, "decode_s", f"decode latency, B{PARETO_DECODE_BATCH} (ms)",
                                 f"state vs decode latency ({src})", log_y=True)
    if result.opts.recall is not None:
        paths["recall_plot"] = _plot(out / PLOT_RECALL, recs, "recall_accuracy", "MQAR accuracy",
                                     "state vs recall", log_y=False)
        paths["curves_plot"] = _plot_curves(out / PLOT_CURVES, recs)
    else:  # an earlier recall sweep's plots would sit beside results that have no recall
        for name in (PLOT_RECALL, PLOT_CURVES):
            if (out / name).is_file():
                (out / name).unlink()
    print_table(recs, head, file)
    return paths
