"""The run's header (GPU, versions, commit, method), its files (JSON and CSV, atomic), the
tables, and ``run_bench``."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from .._version import __version__
from ..fileio import atomic_write
from .core import (
    COPY_BYTES,
    CSV_HEADER_FIELDS,
    DEFAULT_L2_BYTES,
    ERROR_B,
    ERROR_T,
    FLA_MAX_K,
    IMPL_FLA,
    MATMUL_N,
    METHOD,
    ROW_FIELDS,
    BenchContext,
    BenchOptions,
    Case,
    Deadline,
    Row,
    case_work,
    plan,
    run_case,
)
from .measure import (
    CEILING_CASE,
    ceiling_measures,
    ceilings_from,
    fla_version,
    measures_for,
)

# ----- header and files ----------------------------------------------------------------------------
def git_commit() -> tuple[str, bool | None]:
    """(commit, dirty): $RTCOMPILE_COMMIT when set, else ``git rev-parse HEAD`` of this checkout,
    else unknown. The variable comes first: the GPU machine's copy of the tree carried a stale
    ``.git`` on 2026-11-30 (its bench header read c12a73d, dirty, for a run of e6bb863)."""
    if os.environ.get("RTCOMPILE_COMMIT"):
        return os.environ["RTCOMPILE_COMMIT"], None
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                    capture_output=True, text=True, timeout=10)
            dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
            return head.stdout.strip(), dirty
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown", None


def collect_header(options: BenchOptions, ctx: BenchContext) -> dict[str, Any]:
    """Where and how this run measured: device, versions, commit, date, method."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit, dirty = git_commit()
    header: dict[str, Any] = {"gpu": None, "compute_capability": None, "sm_count": None, "l2_bytes": ctx.l2_bytes}
    if ctx.is_cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        header.update(gpu=props.name, compute_capability=f"{props.major}.{props.minor}",
                      sm_count=props.multi_processor_count, memory_bytes=props.total_memory)
    else:
        header["gpu"] = f"none ({ctx.device})"
    header.update(
        torch=torch.__version__, cuda=torch.version.cuda, triton=triton_version, fla=fla_version(),
        rtcompile=__version__, commit=commit, git_dirty=dirty, python=sys.version.split()[0],
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        phase=options.phase, quick=options.quick, repeats=ctx.repeats, budget_s=options.budget_s,
        float32_matmul_precision=torch.get_float32_matmul_precision(), method=METHOD,
        ceilings=asdict(ctx.ceilings),
    )
    if options.phase == "train":
        from .train import TRAIN_METHOD

        header["train_method"] = TRAIN_METHOD
    return header


def _plain(value: Any) -> Any:
    """JSON-safe scalar: non-finite floats become None (strict JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def row_dict(row: Row) -> dict[str, Any]:
    return {k: _plain(v) for k, v in asdict(row).items()}


def write_results(out_dir: Path, header: Mapping[str, Any], rows: Sequence[Row],
                  stem: str = "bench") -> tuple[Path, Path]:
    """Write ``<stem>.json`` ({header, rows}) and ``<stem>.csv`` (rows + header columns), atomically
    (``stem`` "model": the model-level run of :mod:`.lm`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath, cpath = out_dir / f"{stem}.json", out_dir / f"{stem}.csv"
    doc = {"header": {k: _plain(v) for k, v in header.items()}, "rows": [row_dict(r) for r in rows]}
    atomic_write(jpath, json.dumps(doc, indent=2, allow_nan=False) + "\n")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=[*ROW_FIELDS, *CSV_HEADER_FIELDS], lineterminator="\n")
    writer.writeheader()
    extra = {k: header.get(k) for k in CSV_HEADER_FIELDS}
    for r in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in {**row_dict(r), **extra}.items()})
    atomic_write(cpath, buf.getvalue())
    return jpath, cpath


# ----- printing -------------------------------------------------------------------------------------
def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _si(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g} {unit}"
    return f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def progress_line(row: Row, elapsed_s: float) -> str:
    ms = "-" if row.ms is None else f"{row.ms:.4g} ms"
    err = "" if row.rel_rms_err is None else f"err {row.rel_rms_err:.1e}  "
    return f"[{elapsed_s:6.1f}s] {row.phase:8} {row.case:22} {row.dtype:8} {row.impl:26} {ms:>12}  {err}{row.note}"


TIMING_COLUMNS = ("phase", "case", "impl", "ms", "tok/s", "GB/s", "TFLOP/s", "%copy", "%same", "x floor",
                  "mem+", "err", "note")


def timing_table_rows(rows: Sequence[Row]) -> list[tuple[str, ...]]:
    """Cells of the final table: everything except error rows (they have their own table)."""
    out = []
    for r in rows:
        if r.phase == "error":
            continue
        out.append((r.phase, r.case, r.impl, _num(r.ms, ".4g"), _si(r.tokens_per_s), _num(r.gbps, ".0f"),
                    _num(r.tflops, ".1f"), _pct(r.frac_copy_bw), _pct(r.frac_same_size_copy),
                    _num(r.x_floor, ".1f"), _mib(r.peak_extra_mem_bytes), _num(r.rel_rms_err, ".1e"),
                    r.note[:48]))
    return out


_SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def error_table_rows(rows: Sequence[Row]) -> list[tuple[str, ...]]:
    """(case, impl, bf16 err, fp32 err, note) pivoted from the error rows."""
    table: dict[tuple[str, str], dict[str, Row]] = {}
    for r in rows:
        if r.phase == "error":
            table.setdefault((r.case, r.impl), {})[r.dtype] = r
    out = []
    for (case, impl), by_dtype in table.items():
        bf, fp = by_dtype.get("bfloat16"), by_dtype.get("float32")
        notes = "; ".join(f"{_SHORT_DTYPE.get(d, d)}: {x.note}" for d, x in by_dtype.items() if x.note)
        out.append((case, impl, _num(bf.rel_rms_err if bf else None, ".1e"),
                    _num(fp.rel_rms_err if fp else None, ".1e"), notes[:60]))
    return out


def _print_table(title: str, columns: Sequence[str], cells: Sequence[Sequence[str]], file: Any) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich missing on an offline GPU box: plain text, same content
        widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
        print(title, file=file)
        for line in (columns, *cells):
            print("  ".join(s.ljust(w) for s, w in zip(line, widths, strict=True)), file=file)
        return
    table = Table(title=title, header_style="bold")
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i < 3 or c == "note" else "right")
    for cell in cells:
        table.add_row(*cell)
    Console(file=file, width=220, markup=False).print(table)  # "rtcompile[fused]" is not a markup tag


def print_tables(rows: Sequence[Row], header: Mapping[str, Any], file: Any = None) -> None:
    """The error table, then the timing table LAST (what a truncated log tail still shows)."""
    file = file or sys.stdout
    errs = error_table_rows(rows)
    if errs:
        _print_table(f"relative RMS error vs float64 token loop (T={ERROR_T}, B={ERROR_B})",
                     ("case", "impl", "bf16", "fp32", "note"), errs, file)
    c = header.get("ceilings") or {}
    title = (f"{header.get('gpu')} | copy {_num(c.get('copy_gbps'), '.0f')} GB/s, "
             f"bf16 matmul {_num(c.get('matmul_tflops'), '.0f')} TFLOP/s | commit {str(header.get('commit'))[:12]}"
             f"{' (dirty)' if header.get('git_dirty') else ''}")
    _print_table(title, TIMING_COLUMNS, timing_table_rows(rows), file)


MODEL_COLUMNS = ("phase", "case", "impl", "ms", "tok/s", "mem+", "err", "timing", "note")


def model_table_rows(rows: Sequence[Row]) -> list[tuple[str, ...]]:
    """Cells of the model-level table (:mod:`.lm`): time, tokens/s, memory, fla's logits error."""
    return [(r.phase, r.case, r.impl, _num(r.ms, ".4g"), _si(r.tokens_per_s), _mib(r.peak_extra_mem_bytes),
             _num(r.rel_rms_err, ".1e"), r.timing[:60], r.note[:60]) for r in rows]


def print_model_table(rows: Sequence[Row], header: Mapping[str, Any], file: Any = None) -> None:
    """The model-level run's one table, titled with the GPU, the spec and the commit."""
    spec = header.get("spec") or {}
    widths = "x".join(map(str, spec.get("key_widths", ())))
    title = (f"{header.get('gpu')} | model {spec.get('name') or header.get('spec_path')}: order {spec.get('order')} "
             f"{widths}, {spec.get('layers')} layers, d_model {spec.get('model_width')}, {header.get('weights_dtype')} "
             f"| commit {str(header.get('commit'))[:12]}{' (dirty)' if header.get('git_dirty') else ''}")
    _print_table(title, MODEL_COLUMNS, model_table_rows(rows), file or sys.stdout)


def dry_run_lines(options: BenchOptions) -> list[str]:
    """What a run would do, one line per case (no device needed)."""
    fla = fla_version()
    lines = [f"rtcompile bench plan: phase {options.phase}, {'quick, ' if options.quick else ''}"
             f"repeats {options.repeats}, budget {options.budget_s:.0f} s, fla-core {fla or 'not installed'}",
             f"ceiling  copy {COPY_BYTES >> 30} GiB d2d; matmul bf16 {MATMUL_N}^3"]
    for case in plan(options.phase, options.quick, options.variants, options.only):
        work = case_work(case)
        impls = list(case.impl_names())
        if IMPL_FLA in impls and case.phase in ("prefill", "error") and case.K > FLA_MAX_K:
            impls[impls.index(IMPL_FLA)] = "fla(refused: K>256, not called)"
        size = f"B{case.B} T{case.T} H{case.H} V{case.V} K{case.K} {case.dtype}"
        wtxt = f"  {work.nbytes / 1e9:.3g} GB {work.flops / 1e9:.3g} GFLOP" if work and work.nbytes else ""
        if case.phase == "train":
            wtxt = "  forward + backward, forward alone, peak memory"
        lines.append(f"{case.phase:8} {case.name:22} {size:36}{wtxt}  impls: {', '.join(impls)}")
    return lines


# ----- the run ----------------------------------------------------------------------------------------
def cuda_unavailable_reason() -> str | None:
    """Why a measuring run cannot start here (None: it can)."""
    import torch

    if not torch.cuda.is_available():
        return ("needs a CUDA GPU, and torch.cuda.is_available() is False on this machine "
                "(--dry-run lists the cases without one)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 is set: timing the Triton interpreter measures nothing; unset it"
    return None


def _l2_bytes(device: Any) -> int:
    import torch

    if getattr(device, "type", None) != "cuda":
        return 0  # rotation is about GPU L2; CPU tests skip it
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def run_bench(options: BenchOptions, *, device: Any = None, cases: Sequence[Case] | None = None,
              measure_ceilings: bool = True, file: Any = None, log: Any = None) -> list[Row]:
    """Measure everything ``options`` asks for, writing results after every case; returns rows.

    ``device``, ``cases`` and ``measure_ceilings`` exist for tests (a CPU device, tiny cases).
    Progress goes to ``log`` (stderr), the tables to ``file`` (stdout), printed last.
    """
    import torch

    device = torch.device(device or "cuda")
    log = log or sys.stderr
    ctx = BenchContext(device, options.repeats, _l2_bytes(device), deadline=Deadline(options.budget_s))
    header = collect_header(options, ctx)
    rows: list[Row] = []

    def flush() -> None:
        header["ceilings"] = asdict(ctx.ceilings)
        header["elapsed_s"] = round(ctx.deadline.elapsed(), 1)
        if options.out is not None:
            write_results(options.out, header, rows)

    def emit(row: Row) -> None:
        rows.append(row)
        print(progress_line(row, ctx.deadline.elapsed()), file=log, flush=True)

    try:
        with torch.no_grad():  # inference: no implementation records autograd state
            if measure_ceilings:
                ctx.ceilings = ceilings_from(run_case(CEILING_CASE, ceiling_measures(ctx), on_row=emit))
                flush()
            for case in cases if cases is not None else plan(options.phase, options.quick, options.variants, options.only):
                run_case(case, measures_for(case, ctx), ceilings=ctx.ceilings, deadline=ctx.deadline, on_row=emit)
                flush()
    finally:
        flush()  # a failed or interrupted run still leaves what it measured
    print_tables(rows, header, file or sys.stdout)
    return rows
