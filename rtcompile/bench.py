"""``rtcompile bench``: one-run measurements of our kernels against the reference and fla.

One invocation on one CUDA GPU measures, in this order, and writes every number as a row:

1. ceilings: device-to-device copy bandwidth (``dst.copy_(src)`` of 2 GiB, bytes = read +
   write) and the bf16 matmul rate (8192^3);
2. prefill (chunk forward over T tokens from a zero state) of our Triton kernel, the PyTorch
   reference and flash-linear-attention's ``chunk_gated_delta_rule`` on explicitly
   materialised Kronecker keys (only where K <= 256; fla-core 0.6.0 refuses larger K);
3. the error of each prefill implementation against the float64 token loop at a small T;
4. decode (one token per sequence, state cache updated in place) of our kernel, the reference
   and fla's ``fused_recurrent_gated_delta_rule``, against a large copy and against a copy of
   exactly the state bytes; then the eager Python overhead per decode call.

Invariants that keep the numbers honest:

* all implementations of a case see the same inputs (same seeds on the same device);
* bytes and FLOPs are the factored problem's (:mod:`rtcompile.figures`) for every
  implementation, so GB/s and TFLOP/s compare speed; fla's extra traffic from materialised
  Kronecker keys is never credited;
* warm-up (compile, autotune) is never timed; a time is the median of repeats measured with
  CUDA events; calls under ``GRAPH_BELOW_S`` are captured in a CUDA graph (many calls per
  graph) and the replay time divided by the number of calls;
* consecutive timed calls rotate over input sets / state-cache slots whose total footprint is
  at least ``L2_ROTATE_FACTOR`` x L2, so no call reads what the previous one left in L2;
* one failing implementation (exception, OOM, refusal) yields a row with a note and the run goes
  on; results are rewritten atomically after every case, so a killed run keeps what it measured.

Nothing here touches a device at import time: torch, the kernels and fla are imported inside
the functions that need them (``--dry-run`` and the arithmetic run without CUDA).
"""

from __future__ import annotations

import csv
import gc
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from . import __version__
from .figures import chunk_figures, recurrent_figures
from .spec import Features, ModelSpec

if TYPE_CHECKING:
    import torch

# ----- what runs ---------------------------------------------------------------------------
PHASES = ("prefill", "decode", "all")
IMPL_RT = "rtcompile"  # our chunk kernel (prefill) or decode kernel; variants: "rtcompile[name]"
IMPL_RT_RECURRENT = "rtcompile-recurrent"  # our kernel in mode="recurrent" (error rows only)
IMPL_REF = "torch-ref"  # the PyTorch reference (chunk form for prefill, token loop for decode)
IMPL_FLA = "fla"
IMPL_COPY = "copy-same-size"  # a device copy of exactly the state bytes (decode cases)
FLA_MAX_K = 256  # fla-core 0.6.0's chunk kernel asserts K <= 256

HEADS, VALUE_WIDTH, CHUNK = 8, 64, 64
PREFILL_B, PREFILL_T, QUICK_T = 8, 4096, 1024
ERROR_B, ERROR_T = 2, 256
EAGER_B = 1

# ----- how it is timed ---------------------------------------------------------------------
DEFAULT_REPEATS = 25  # median of >= 20
MIN_REPEATS = 3
DEFAULT_BUDGET_S = 450.0  # the issue asks for well under 8 minutes; later cases are skipped past it
COPY_BYTES = 2 << 30
MATMUL_N = 8192
WARMUP_PASSES = 2
GRAPH_BELOW_S = 6e-3  # calls shorter than this are timed as CUDA-graph replays (fla's chunk
# forward spends ~0.5 ms of host time per eager call at K=256: graphs compare kernels, not Python)
GRAPH_TARGET_S = 5e-3  # one replay this long makes event overhead (a few us) negligible
MIN_GRAPH_CALLS = 64  # the eager estimate includes Python overhead, so it undersizes graphs
MAX_GRAPH_CALLS = 512
MAX_TIMED_S = 10.0  # per implementation: slower calls get fewer repeats ...
MIN_SLOW_REPEATS = 5  # ... but never fewer than this
L2_ROTATE_FACTOR = 4
MAX_ROTATIONS = 64
DEFAULT_L2_BYTES = 50 << 20  # H200; used when torch does not report the L2 size
EAGER_CALLS, EAGER_TRIALS, EAGER_WARMUP = 200, 5, 10
NOTE_MAX = 240
# Relative RMS error above which a row is flagged "check" (bf16 output rounding alone is ~1e-3;
# fp32 allows TF32 dots, ~1e-3).
TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 5e-3}

METHOD = (
    "Times: median of --repeats repeats with CUDA events, after {warmup} warm-up passes "
    "(compile and autotune never timed). Calls under {graph_ms:g} ms are captured in one CUDA graph "
    "of many calls and the replay time divided by the number of calls; slower calls are timed "
    "eagerly (calls over {max_timed:g} s of total timing get fewer repeats, at least {slow}). "
    "Consecutive timed calls rotate over input sets or state-cache slots totalling >= {rot}x L2, so "
    "no call reads what the previous left in L2. Bytes and FLOPs are the factored problem's for "
    "every implementation (rtcompile.figures: chunk_figures with C={chunk} for prefill; "
    "recurrent_figures for decode, i.e. 2 x state bytes + inputs + outputs per sequence); fla runs "
    "on explicitly materialised Kronecker keys (built outside the timed region) and its extra "
    "traffic is not credited. Floor = max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), both "
    "measured in this run (copy: dst.copy_(src) of 2 GiB, bytes = read + write; matmul: "
    "{mm}^3 bf16); x_floor = time / floor. Decode also compares against a copy of exactly the "
    "state bytes, timed the same way. Peak extra memory = max_memory_allocated during one call - "
    "allocated before - bytes of the returned tensors. Errors: relative RMS against the float64 "
    "token-loop reference on the same (quantised) inputs at T={et}, B={eb}. Inputs: randn factors "
    "and values, g = logsigmoid(randn) in fp32, beta = sigmoid(randn) in the input dtype, fp32 "
    "state, gate + delta rule + l2norm on, scale = K^-0.5, zero initial state for prefill. "
    "Eager overhead: wall time of {ec} back-to-back eager calls at B={eB} (median of {etr} trials)."
).format(
    warmup=WARMUP_PASSES, graph_ms=GRAPH_BELOW_S * 1e3, max_timed=MAX_TIMED_S, slow=MIN_SLOW_REPEATS,
    rot=L2_ROTATE_FACTOR, chunk=CHUNK, mm=MATMUL_N, et=ERROR_T, eb=ERROR_B, ec=EAGER_CALLS,
    eB=EAGER_B, etr=EAGER_TRIALS,
)


# ----- data ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One shape and the implementations to run on it.

    ``phase`` is "prefill" (chunk forward over T tokens), "decode" (T = 1, state cache updated
    in place), "error" (a prefill shape at small T against the float64 token loop) or "eager"
    (Python overhead per decode call). ``variants`` maps a name to extra keyword arguments for
    our kernel (for example ``{"variant": obj}``): each becomes an implementation
    ``rtcompile[name]`` beside the default ``rtcompile``.
    """

    name: str
    phase: str
    key_widths: tuple[int, ...]
    B: int
    T: int
    H: int = HEADS
    V: int = VALUE_WIDTH
    dtype: str = "bfloat16"
    impls: tuple[str, ...] = ()
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, compare=False, hash=False)
    chunk_size: int = CHUNK

    @property
    def order(self) -> int:
        return len(self.key_widths) + 1

    @property
    def K(self) -> int:
        return math.prod(self.key_widths)

    @property
    def widths_text(self) -> str:
        return "x".join(map(str, self.key_widths))

    @property
    def state_bytes_per_seq(self) -> int:
        """fp32 state of one sequence, all heads."""
        return self.H * self.K * self.V * 4

    def impl_names(self) -> list[str]:
        """``impls`` with ``rtcompile`` followed by one ``rtcompile[name]`` per variant."""
        out: list[str] = []
        for impl in self.impls:
            out.append(impl)
            if impl == IMPL_RT:
                out.extend(f"{IMPL_RT}[{name}]" for name in self.variants)
        return out


@dataclass(frozen=True)
class Work:
    """What one timed call does: FLOPs, bytes moved (model figures), tokens (None: not tokens)."""

    flops: float
    nbytes: float
    tokens: int | None


@dataclass(frozen=True)
class Ceilings:
    """Copy bandwidth (GB/s, read + write) and bf16 matmul rate (TFLOP/s) measured in this run."""

    copy_gbps: float | None = None
    matmul_tflops: float | None = None


@dataclass
class Outcome:
    """What a measurement returns; the runner turns it into a :class:`Row`.

    ``seconds`` is per call (None: nothing timed). ``work`` overrides the case's work (copies).
    """

    seconds: float | None = None
    timing: str = ""
    peak_extra_mem_bytes: int | None = None
    rel_rms_err: float | None = None
    note: str = ""
    work: Work | None = None


@dataclass(frozen=True)
class Row:
    case: str
    impl: str
    phase: str
    order: int | None
    key_widths: str
    B: int | None
    T: int | None
    H: int | None
    V: int | None
    dtype: str
    ms: float | None = None
    tokens_per_s: float | None = None
    gbps: float | None = None
    tflops: float | None = None
    frac_copy_bw: float | None = None
    frac_same_size_copy: float | None = None
    x_floor: float | None = None
    peak_extra_mem_bytes: int | None = None
    rel_rms_err: float | None = None
    timing: str = ""
    note: str = ""


ROW_FIELDS = tuple(f.name for f in fields(Row))
# Header entries repeated on every CSV row, so a CSV row alone says where it was measured.
CSV_HEADER_FIELDS = ("gpu", "compute_capability", "torch", "triton", "fla", "rtcompile", "commit", "date")


@dataclass(frozen=True)
class BenchOptions:
    phase: str = "all"
    quick: bool = False
    out: Path | None = None
    repeats: int = DEFAULT_REPEATS
    budget_s: float = DEFAULT_BUDGET_S
    variants: Mapping[str, Any] = field(default_factory=lambda: dict(DEFAULT_VARIANTS), compare=False, hash=False)


def _default_with(**changes: Any) -> Callable[["Case"], dict[str, Any]]:
    """A function of the case: its default chunk variant with ``changes``; where the result
    cannot run the shape, a NotImplementedError (the row reads ``refused: <reason>``)."""
    def variant(case: "Case") -> dict[str, Any]:
        import dataclasses

        import torch

        from .kernels.variants import ChunkVariant, KernelShape

        shape = KernelShape(tuple(case.key_widths), case.V)
        limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
        v = dataclasses.replace(ChunkVariant.default(shape, limit), **changes)
        reason = v.check(shape, limit)
        if reason is not None:
            raise NotImplementedError(reason)
        return {"variant": v}

    return variant


ERROR_VARIANTS = ("fused", "prefetch", "wy")  # the named variants whose error the error cases report

# Named extra implementations timed beside the default: name -> kwargs, or a function of the
# case returning kwargs (for variants that depend on the shape). "fused": no [T, C] workspace,
# so its extra memory does not grow with T (the planner's low-memory choice); "fused-blocks"
# the same with the blocked solve; "prefetch": the next chunk's loads issued ahead; "wy": the
# solve applied in the parallel prepare kernel (two products on the sequential chain).
DEFAULT_VARIANTS: dict[str, Any] = {
    "fused": _default_with(fuse_prepare=True),
    "fused-blocks": _default_with(fuse_prepare=True, solve="blocks"),
    "prefetch": _default_with(prefetch=True),
    "prefetch-fused-blocks": _default_with(prefetch=True, fuse_prepare=True, solve="blocks"),
    "wy": _default_with(wy=True),
    "prefetch-wy": _default_with(prefetch=True, wy=True),
}


@dataclass
class Deadline:
    """Soft time budget: once spent, remaining implementations are recorded as skipped."""

    budget_s: float
    start: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def expired(self) -> bool:
        return self.elapsed() > self.budget_s


@dataclass
class BenchContext:
    """Where and how to measure. ``l2_bytes`` 0 disables rotation (CPU tests)."""

    device: Any
    repeats: int = DEFAULT_REPEATS
    l2_bytes: int = DEFAULT_L2_BYTES
    ceilings: Ceilings = field(default_factory=Ceilings)
    deadline: Deadline | None = None

    @property
    def is_cuda(self) -> bool:
        return getattr(self.device, "type", str(self.device)) == "cuda"


# ----- the plan --------------------------------------------------------------------------------
PREFILL_WIDTHS = ((16, 16), (32, 32), (64, 64), (16, 16, 16))
ANCHOR_WIDTHS = ((64,), (128,), (256,))  # order 2 = Gated DeltaNet: DESIGN.md's fla anchors
DECODE_SHAPES = (((16, 16), 256), ((32, 32), 32), ((16, 16), 32))
QUICK_PREFILL_WIDTHS = ((16, 16), (32, 32))
QUICK_ANCHOR_WIDTHS = ((256,),)
QUICK_DECODE_SHAPES = (((16, 16), 32), ((32, 32), 32))


def _tag(widths: Sequence[int]) -> str:
    return f"o{len(widths) + 1}_{'x'.join(map(str, widths))}"


def prefill_cases(quick: bool = False, variants: Mapping[str, Mapping[str, Any]] | None = None) -> list[Case]:
    """Prefill timing cases: B8 H8 V64 bf16, T 4096 (1024 quick); fla on every one (K > 256 is
    recorded as refused without a call)."""
    T = QUICK_T if quick else PREFILL_T
    widths = (QUICK_PREFILL_WIDTHS + QUICK_ANCHOR_WIDTHS) if quick else (PREFILL_WIDTHS + ANCHOR_WIDTHS)
    return [
        Case(f"{_tag(w)}_B{PREFILL_B}_T{T}", "prefill", tuple(w), PREFILL_B, T,
             impls=(IMPL_RT, IMPL_REF, IMPL_FLA), variants=dict(variants or {}))
        for w in widths
    ]


def error_cases(quick: bool = False, variants: Mapping[str, Mapping[str, Any]] | None = None) -> list[Case]:
    """Error cases: each main prefill shape at T=256 B2, bf16 and fp32 inputs.

    fla only with bf16 and K <= 256: fla-core 0.6.0 accepts fp32 in its chunk kernel, but the
    first fp32 call compiles and autotunes for ~110 s on an H200 (measured), a quarter of the
    run's budget for a dtype fla is not meant for. Of the named variants only ERROR_VARIANTS
    run here: each variant is a compile per shape and dtype (2-5 s on an H200), and the others'
    correctness is checked by the GPU tests and by every tuning trial.
    """
    variants = {k: v for k, v in (variants or {}).items() if k in ERROR_VARIANTS}
    out = []
    for w in QUICK_PREFILL_WIDTHS[:1] if quick else PREFILL_WIDTHS:
        for dtype in ("bfloat16", "float32"):
            fla = (IMPL_FLA,) if math.prod(w) <= FLA_MAX_K and dtype == "bfloat16" else ()
            out.append(Case(f"{_tag(w)}_B{ERROR_B}_T{ERROR_T}", "error", tuple(w), ERROR_B, ERROR_T, dtype=dtype,
                            impls=(IMPL_RT, IMPL_RT_RECURRENT, IMPL_REF, *fla), variants=variants))
    return out


def decode_cases(quick: bool = False, variants: Mapping[str, Mapping[str, Any]] | None = None) -> list[Case]:
    """Decode cases (one token per sequence, H8 V64 fp32 state), each led by a same-size copy."""
    shapes = QUICK_DECODE_SHAPES if quick else DECODE_SHAPES
    return [
        Case(f"{_tag(w)}_B{B}", "decode", tuple(w), B, 1,
             impls=(IMPL_COPY, IMPL_RT, IMPL_REF, IMPL_FLA), variants=dict(variants or {}))
        for w, B in shapes
    ]


def eager_cases() -> list[Case]:
    """Python overhead per eager decode call at a small shape (order 3 16x16, B1)."""
    impls = (f"{IMPL_RT} validate=True", f"{IMPL_RT} validate=False", IMPL_REF, IMPL_FLA)
    return [Case(f"{_tag((16, 16))}_B{EAGER_B}_eager", "eager", (16, 16), EAGER_B, 1, impls=impls)]


def plan(phase: str = "all", quick: bool = False,
         variants: Mapping[str, Mapping[str, Any]] | None = None) -> list[Case]:
    """Every case of a run, in run order: prefill, its errors, decode, eager overhead."""
    if phase not in PHASES:
        raise ValueError(f"phase: got {phase!r}; allowed: {', '.join(PHASES)}")
    cases: list[Case] = []
    if phase in ("prefill", "all"):
        cases += prefill_cases(quick, variants) + error_cases(quick, variants)
    if phase in ("decode", "all"):
        cases += decode_cases(quick) + eager_cases()  # named variants are chunk-kernel variants
    return cases


# ----- arithmetic (pure) -----------------------------------------------------------------------
def case_spec(case: Case) -> ModelSpec:
    """The one-layer ModelSpec whose figures describe ``case`` (gate, delta rule, l2norm on)."""
    feats = Features(forget_gate=True, delta_rule=True, l2norm=True, query_skip=False,
                     projection="dense", short_conv=0, output_gate=False)
    return ModelSpec(order=case.order, key_widths=case.key_widths, value_width=case.V, heads=case.H,
                     model_width=case.H * case.V, layers=1, chunk_size=case.chunk_size,
                     input_dtype=case.dtype, state_dtype="float32", name=case.name, features=feats)


def case_work(case: Case) -> Work | None:
    """Per-call work: chunk figures x B*T for prefill/error, recurrent figures x B for decode.

    Eager-overhead cases have no work (their time is Python, not data movement).
    """
    if case.phase in ("prefill", "error"):
        f = chunk_figures(case_spec(case), case.chunk_size)
        n = case.B * case.T
        return Work(f.flops_per_token * n, f.bytes_per_token * n, n)
    if case.phase == "decode":
        f = recurrent_figures(case_spec(case))
        return Work(f.flops_per_token * case.B, f.bytes_per_token * case.B, case.B)
    return None


def floor_seconds(work: Work, ceilings: Ceilings) -> float | None:
    """Roofline floor: max(bytes / copy bandwidth, FLOPs / matmul rate); None without ceilings."""
    if not ceilings.copy_gbps or not ceilings.matmul_tflops:
        return None
    return max(work.nbytes / (ceilings.copy_gbps * 1e9), work.flops / (ceilings.matmul_tflops * 1e12))


def derive_row(base: Row, outcome: Outcome, work: Work | None, ceilings: Ceilings,
               same_size_gbps: float | None = None) -> Row:
    """Fill ``base`` with the outcome and the rates derived from seconds per call."""
    row = replace(base, timing=outcome.timing, note=_clip(outcome.note),
                  peak_extra_mem_bytes=outcome.peak_extra_mem_bytes, rel_rms_err=outcome.rel_rms_err)
    s = outcome.seconds
    if s is None or not s > 0:
        return row
    row = replace(row, ms=s * 1e3)
    if work is None:
        return row
    gbps = work.nbytes / s / 1e9 if work.nbytes else None
    floor = floor_seconds(work, ceilings)
    return replace(
        row,
        tokens_per_s=work.tokens / s if work.tokens else None,
        gbps=gbps,
        tflops=work.flops / s / 1e12 if work.flops else None,
        frac_copy_bw=gbps / ceilings.copy_gbps if gbps and ceilings.copy_gbps else None,
        frac_same_size_copy=gbps / same_size_gbps if gbps and same_size_gbps else None,
        x_floor=s / floor if floor else None,
    )


def rotation_count(bytes_per_call: float, l2_bytes: int, *, factor: int = L2_ROTATE_FACTOR,
                   minimum: int = 1, cap: int = MAX_ROTATIONS) -> int:
    """How many distinct input sets / slot groups to cycle so they total >= factor x L2."""
    need = math.ceil(factor * l2_bytes / bytes_per_call) if bytes_per_call > 0 else 1
    return max(minimum, min(cap, need))


def repeats_for(est_s: float, repeats: int) -> int:
    """``repeats``, reduced for slow calls so one implementation's timing stays near MAX_TIMED_S."""
    if est_s * repeats <= MAX_TIMED_S:
        return repeats
    return max(MIN_SLOW_REPEATS, min(repeats, int(MAX_TIMED_S / est_s)))


def graph_calls_count(est_s: float, n_distinct: int) -> int:
    """Calls captured in one graph: about GRAPH_TARGET_S of (eagerly estimated) work, clamped to
    [MIN_GRAPH_CALLS, MAX_GRAPH_CALLS], rounded down to a multiple of ``n_distinct`` so every
    input set is used equally (and never fewer than one call per set)."""
    want = math.ceil(GRAPH_TARGET_S / max(est_s, 1e-7))
    # at least MIN_GRAPH_CALLS, but keep one replay of multi-ms calls under ~0.25 s
    floor_calls = min(MIN_GRAPH_CALLS, max(1, math.ceil(0.25 / max(est_s, 1e-7))))
    want = max(floor_calls, min(MAX_GRAPH_CALLS, want))
    return max(n_distinct, (want // n_distinct) * n_distinct)


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


# ----- failures --------------------------------------------------------------------------------
def _clip(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= NOTE_MAX else text[: NOTE_MAX - 3] + "..."


def failure_note(exc: BaseException) -> str:
    """One line for a failed implementation: ``OOM: ...``, ``refused: ...`` or ``error: ...``."""
    lines = str(exc).strip().splitlines()
    msg = lines[0] if lines else ""
    low = msg.lower()
    if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in low:
        return _clip(f"OOM: {msg}")
    if isinstance(exc, NotImplementedError) or "does not support" in low or "not supported" in low:
        return _clip(f"refused: {msg or type(exc).__name__}")
    return _clip(f"error: {type(exc).__name__}: {msg}")


def _release_memory() -> None:
    """Free what a finished (or failed) implementation left, so the next starts clean."""
    gc.collect()
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and torch_mod.cuda.is_initialized():
        torch_mod.cuda.empty_cache()


# ----- the runner --------------------------------------------------------------------------------
Measure = Callable[[], Outcome]


def base_row(case: Case, impl: str) -> Row:
    if case.phase == "ceiling":
        return Row(case.name, impl, "ceiling", None, "", None, None, None, None, case.dtype)
    return Row(case.name, impl, case.phase, case.order, case.widths_text, case.B, case.T, case.H, case.V, case.dtype)


def run_one(case: Case, impl: str, measure: Measure, *, work: Work | None, ceilings: Ceilings,
            same_size_gbps: float | None = None, deadline: Deadline | None = None) -> Row:
    """Run one implementation; any exception becomes a row with a note, never propagates."""
    base = base_row(case, impl)
    if deadline is not None and deadline.expired():
        return replace(base, note=f"skipped: time budget of {deadline.budget_s:.0f} s spent")
    try:
        outcome = measure()
    except Exception as exc:  # noqa: BLE001 -- a failing implementation is a result, not a crash
        return replace(base, note=failure_note(exc))
    finally:
        _release_memory()
    return derive_row(base, outcome, outcome.work or work, ceilings, same_size_gbps)


def run_case(case: Case, measures: Mapping[str, Measure], *, ceilings: Ceilings = Ceilings(),
             deadline: Deadline | None = None, on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """Run every implementation of ``case`` in order; returns one row per implementation.

    The same-size copy's bandwidth (impl ``copy-same-size``, when it runs first) is the
    denominator of ``frac_same_size_copy`` for the rows after it.
    """
    work = case_work(case)
    same_size: float | None = None
    rows = []
    for impl, measure in measures.items():
        row = run_one(case, impl, measure, work=work, ceilings=ceilings, same_size_gbps=same_size,
                      deadline=deadline)
        if impl == IMPL_COPY and row.gbps:
            same_size = row.gbps
            row = replace(row, frac_same_size_copy=1.0)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


# ----- timing (torch imported lazily) ------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    seconds: float  # per call
    method: str


def _sync(ctx: BenchContext) -> None:
    if ctx.is_cuda:
        import torch

        torch.cuda.synchronize()


def warm_up(calls: Sequence[Callable[[], Any]], ctx: BenchContext, passes: int = WARMUP_PASSES) -> None:
    """Run every call ``passes`` times (the first compiles and autotunes); never timed."""
    for _ in range(passes):
        for c in calls:
            c()
    _sync(ctx)


def _per_call_times(calls: Sequence[Callable[[], Any]], ctx: BenchContext, n: int) -> list[float]:
    """Seconds of each of ``n`` eager calls (cycling ``calls``): CUDA events, or wall on CPU."""
    if not ctx.is_cuda:
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            calls[i % len(calls)]()
            out.append(time.perf_counter() - t0)
        return out
    import torch

    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for i, (start, end) in enumerate(events):
        start.record()
        calls[i % len(calls)]()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def _graph_timing(calls: Sequence[Callable[[], Any]], est_s: float, ctx: BenchContext) -> Timing:
    """Capture ``graph_calls_count`` calls in one CUDA graph; median replay / calls per graph."""
    import torch

    n = graph_calls_count(est_s, len(calls))
    # Warm up on a side stream first, as torch.cuda.graphs asks, so lazy initialisation
    # (cuBLAS workspaces, Triton module loads) happens outside the capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(ctx.repeats)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    per_call = median(start.elapsed_time(end) / 1e3 / n for start, end in events)
    del graph
    return Timing(per_call, f"graph x{n} calls ({len(calls)} sets), median of {ctx.repeats} replays")


def time_calls(calls: Sequence[Callable[[], Any]], ctx: BenchContext, *, graph: bool = True) -> Timing:
    """Median seconds per call of ``calls`` (cycled), already warmed up by the caller.

    Graph replay for calls under GRAPH_BELOW_S on CUDA; if capture fails (a host sync in the
    call, say), eager events, with the reason in the method text.
    """
    est = median(_per_call_times(calls, ctx, max(3, len(calls))))
    fallback = ""
    if graph and ctx.is_cuda and est < GRAPH_BELOW_S:
        try:
            return _graph_timing(calls, est, ctx)
        except Exception as exc:  # noqa: BLE001 -- fall back to eager timing, say why
            _sync_quietly()
            fallback = f"; graph capture failed ({_clip(failure_note(exc))[:80]})"
    n = repeats_for(est, ctx.repeats)
    times = _per_call_times(calls, ctx, n)
    kind = "events" if ctx.is_cuda else "wall"
    return Timing(median(times), f"eager {kind}, {len(calls)} sets, median of {n}{fallback}")


def _sync_quietly() -> None:
    try:
        import torch

        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 -- best effort after a failed capture
        pass


def wall_per_call(call: Callable[[], Any], ctx: BenchContext, n: int | None = None,
                  trials: int | None = None) -> float:
    """Eager seconds per call: wall time of ``n`` back-to-back calls + one sync, median of trials.

    Nothing is subtracted: at a small shape this is the Python and launch cost a serving loop pays.
    """
    n, trials = n or EAGER_CALLS, trials or EAGER_TRIALS
    for _ in range(EAGER_WARMUP):
        call()
    _sync(ctx)
    out = []
    for _ in range(trials):
        _sync(ctx)
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        _sync(ctx)
        out.append((time.perf_counter() - t0) / n)
    return median(out)


def _tensor_bytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(x) for x in obj)
    return 0


def peak_extra_bytes(call: Callable[[], Any], ctx: BenchContext) -> int | None:
    """Peak memory of one call beyond what was allocated before and what it returns (CUDA only)."""
    if not ctx.is_cuda:
        return None
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    kept = _tensor_bytes(out)
    del out
    return int(peak - before - kept)


def rel_rms(actual: "torch.Tensor", expected: "torch.Tensor") -> float:
    """||actual - expected||_rms / ||expected||_rms in float64; inf if actual is not finite."""
    a, e = actual.double(), expected.double().reshape(actual.shape)
    if not bool(a.isfinite().all()):
        return math.inf
    num = (a - e).pow(2).mean().sqrt()
    den = e.pow(2).mean().sqrt().clamp_min(1e-300)
    return float(num / den)


def _error_outcome(err_o: float, err_s: float | None, dtype: str) -> Outcome:
    """Error fields: output error in ``rel_rms_err``, final-state error and any flag in the note."""
    if not math.isfinite(err_o) or (err_s is not None and not math.isfinite(err_s)):
        return Outcome(note="NaN/Inf in output or final state")
    worst = max(err_o, err_s or 0.0)
    note = f"state err {err_s:.1e}" if err_s is not None else ""
    tol = TOLERANCE.get(dtype)
    if tol is not None and worst > tol:
        note += f"; above {tol:g} ({dtype}): check"
    return Outcome(rel_rms_err=err_o, note=note)


# ----- inputs ------------------------------------------------------------------------------------
@dataclass
class Inputs:
    """One call's inputs: factor lists q, k ``[B, T, H, d_i]``, v ``[B, T, H, V]``, g, beta ``[B, T, H]``."""

    q: list
    k: list
    v: Any
    g: Any
    beta: Any
    scale: float

    def tensors(self) -> list:
        return [*self.q, *self.k, self.v, self.g, self.beta]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def make_inputs(case: Case, device: Any, seed: int) -> Inputs:
    """Fresh random inputs for ``case`` in ``case.dtype``; the same seed gives the same values
    (drawn in fp32, then cast, so bf16 and fp32 cases of one seed share their underlying draws)."""
    import torch

    dt = getattr(torch, case.dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    B, T, H = case.B, case.T, case.H

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    q = [randn(B, T, H, d).to(dt) for d in case.key_widths]
    k = [randn(B, T, H, d).to(dt) for d in case.key_widths]
    v = randn(B, T, H, case.V).to(dt)
    g = torch.nn.functional.logsigmoid(randn(B, T, H))  # fp32, g <= 0 (fla's convention)
    beta = torch.sigmoid(randn(B, T, H)).to(dt)
    return Inputs(q, k, v, g, beta, case.K ** -0.5)


def kronify(inp: Inputs) -> Inputs:
    """The same problem at order 2: q, k replaced by phi(q), phi(k) (built in fp32, then cast)."""
    from .kernels.reference import kron_features

    dt = inp.v.dtype
    phi_q = kron_features([x.float() for x in inp.q]).to(dt)
    phi_k = kron_features([x.float() for x in inp.k]).to(dt)
    return Inputs([phi_q], [phi_k], inp.v, inp.g, inp.beta, inp.scale)


def to_double(inp: Inputs) -> Inputs:
    return Inputs([x.double() for x in inp.q], [x.double() for x in inp.k], inp.v.double(),
                  inp.g.double(), inp.beta.double(), inp.scale)


def reference64(inp: Inputs, initial_state: Any = None) -> tuple:
    """The oracle: float64 token loop on the (already quantised) inputs -> (o, final state)."""
    from .kernels.reference import running_tensor_recurrent_ref

    i64 = to_double(inp)
    s0 = None if initial_state is None else initial_state.double()
    return running_tensor_recurrent_ref(i64.q, i64.k, i64.v, i64.g, i64.beta, scale=i64.scale,
                                        initial_state=s0, output_final_state=True, l2norm=True)


def _seed(case: Case, i: int) -> int:
    """Seed of input set i of a case. It depends on the case name and i only, so every
    implementation (and both dtypes of an error case) gets the same underlying values; crc32,
    not hash(), because str hashes change between processes."""
    return (zlib.crc32(case.name.encode()) * 1009 + i) & 0x7FFFFFFF


# ----- kernel entry points (imported when first called) ----------------------------------------
def _rt_fwd() -> Callable:
    from .kernels.triton_fwd import running_tensor_fwd

    return running_tensor_fwd


def _rt_decode() -> Callable:
    from .kernels.triton_fwd import running_tensor_decode_

    return running_tensor_decode_


def fla_version() -> str | None:
    """Installed fla-core version, or None (no import of fla itself)."""
    from importlib import metadata

    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _fla_ops() -> Any:
    """fla's gated-delta-rule ops module; ImportError when fla is not installed."""
    import importlib

    return importlib.import_module("fla.ops.gated_delta_rule")


def _variant_kwargs(case: Case, impl: str) -> dict[str, Any]:
    """Extra kwargs for ``rtcompile[name]`` (none for plain ``rtcompile``)."""
    if impl.startswith(f"{IMPL_RT}[") and impl.endswith("]"):
        spec = case.variants[impl[len(IMPL_RT) + 1 : -1]]
        return dict(spec(case) if callable(spec) else spec)
    return {}


def _prefill_call(impl: str, case: Case, inp: Inputs) -> Callable[[], Any]:
    """A zero-argument call of ``impl`` on ``inp`` returning (o, final_state)."""
    common = dict(scale=inp.scale, output_final_state=True, l2norm=True)
    if impl == IMPL_REF:
        from .kernels.reference import running_tensor_chunk_ref

        return lambda: running_tensor_chunk_ref(inp.q, inp.k, inp.v, inp.g, inp.beta,
                                                chunk_size=case.chunk_size, **common)
    if impl == IMPL_FLA:
        op = _fla_ops().chunk_gated_delta_rule
        return lambda: op(q=inp.q[0], k=inp.k[0], v=inp.v, g=inp.g, beta=inp.beta, scale=inp.scale,
                          initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    fwd = _rt_fwd()
    if impl == IMPL_RT_RECURRENT:
        return lambda: fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, mode="recurrent", **common)
    # No chunk_size: the kernel's default variant (or the named one) picks its own, as a caller
    # would get; forcing 64 would also conflict with a variant of another chunk size.
    # case.chunk_size is the reference's chunk and the C of the floor's figures.
    extra = _variant_kwargs(case, impl)
    return lambda: fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, mode="chunk", **common, **extra)


def _fla_refusal(case: Case) -> str | None:
    """Why fla is not called on ``case`` (None: call it)."""
    if fla_version() is None:
        return "skipped: fla-core not installed (pip install -e '.[bench]')"
    if case.phase in ("prefill", "error") and case.K > FLA_MAX_K:
        return (f"refused: K={case.K} > {FLA_MAX_K}, not called (fla-core 0.6.0's chunk_gated_delta_rule "
                "asserts 'current kernel does not support head dimension larger than 256')")
    return None


# ----- prefill and error measures ----------------------------------------------------------------
def _prefill_sets(case: Case, ctx: BenchContext, kron: bool) -> list[Inputs]:
    """Enough input sets that consecutive calls do not reuse L2 (same seeds for every impl)."""
    first = make_inputs(case, ctx.device, _seed(case, 0))
    if kron:
        first = kronify(first)
    out_bytes = case.B * case.T * case.H * case.V * first.v.element_size() + case.B * case.state_bytes_per_seq
    n = rotation_count(first.nbytes() + out_bytes, ctx.l2_bytes)
    sets = [first]
    for i in range(1, n):
        s = make_inputs(case, ctx.device, _seed(case, i))
        sets.append(kronify(s) if kron else s)
    return sets


def measure_prefill(case: Case, impl: str, ctx: BenchContext) -> Outcome:
    """Time one prefill implementation: warm-up, peak extra memory of one call, median timing."""
    if impl == IMPL_FLA and (why := _fla_refusal(case)):
        return Outcome(note=why)
    sets = _prefill_sets(case, ctx, kron=impl == IMPL_FLA)
    calls = [_prefill_call(impl, case, s) for s in sets]
    warm_up(calls, ctx)
    peak = peak_extra_bytes(calls[0], ctx)
    t = time_calls(calls, ctx)
    return Outcome(seconds=t.seconds, timing=t.method, peak_extra_mem_bytes=peak)


class _Oracle:
    """The error case's inputs and float64 reference, computed once and shared by all impls."""

    def __init__(self, case: Case, ctx: BenchContext):
        self.case, self.ctx = case, ctx
        self._value: tuple | None = None

    def get(self) -> tuple:
        if self._value is None:
            inp = make_inputs(self.case, self.ctx.device, _seed(self.case, 0))
            o_ref, s_ref = reference64(inp)
            self._value = (inp, o_ref, s_ref)
        return self._value


def measure_error(case: Case, impl: str, oracle: _Oracle) -> Outcome:
    """Relative RMS error of one implementation's output (and final state) vs the float64 loop."""
    if impl == IMPL_FLA and (why := _fla_refusal(case)):
        return Outcome(note=why)
    inp, o_ref, s_ref = oracle.get()
    call = _prefill_call(impl, case, kronify(inp) if impl == IMPL_FLA else inp)
    o, s = call()
    return _error_outcome(rel_rms(o, o_ref), rel_rms(s, s_ref) if s is not None else None, case.dtype)


# ----- decode measures ---------------------------------------------------------------------------
@dataclass
class _DecodeSetup:
    """Rotation over ``n`` groups of B slots in one state cache [n*B, H, d_1.., V] (fp32)."""

    sets: list  # Inputs with T = 1, one per group
    cache: Any
    indices: list  # int32 [B] per group, a random permutation of all slots


def _decode_setup(case: Case, ctx: BenchContext) -> _DecodeSetup:
    import torch

    n = rotation_count(case.B * case.state_bytes_per_seq, ctx.l2_bytes, minimum=2)
    sets = [make_inputs(case, ctx.device, _seed(case, i)) for i in range(n)]
    gen = torch.Generator(device=ctx.device).manual_seed(_seed(case, 10_000))
    slots = n * case.B
    cache = torch.randn(slots, case.H, *case.key_widths, case.V, generator=gen, device=ctx.device,
                        dtype=torch.float32)
    perm = torch.randperm(slots, generator=torch.Generator().manual_seed(_seed(case, 20_000)))
    indices = [perm[i * case.B : (i + 1) * case.B].to(device=ctx.device, dtype=torch.int32) for i in range(n)]
    return _DecodeSetup(sets, cache, indices)


def _decode_calls(impl: str, case: Case, st: _DecodeSetup, *, validate: bool = False) -> tuple[list, Any]:
    """One call per group for ``impl``, and ``state_of(i)``: the state that group i reads next."""
    if impl == IMPL_REF:
        from .kernels.reference import running_tensor_recurrent_ref

        longs = [i.long() for i in st.indices]

        def ref_call(s: Inputs, idx: Any) -> Callable[[], Any]:
            def call() -> Any:
                S = st.cache.index_select(0, idx)
                o, S1 = running_tensor_recurrent_ref(s.q, s.k, s.v, s.g, s.beta, scale=s.scale, initial_state=S,
                                                     output_final_state=True, l2norm=True)
                st.cache.index_copy_(0, idx, S1)
                return o
            return call

        return [ref_call(s, i) for s, i in zip(st.sets, longs, strict=True)], lambda i: st.cache[longs[i]]
    if impl == IMPL_FLA:
        op = _fla_ops().fused_recurrent_gated_delta_rule
        B, H, K, V = case.B, case.H, case.K, case.V
        states = [st.cache[i.long()].reshape(B, H, K, V).contiguous() for i in st.indices]
        st.cache = None  # fla keeps its own per-group states; free the shared cache
        phis = [kronify(s) for s in st.sets]

        def fla_call(p: Inputs, S: Any) -> Callable[[], Any]:
            return lambda: op(q=p.q[0], k=p.k[0], v=p.v, g=p.g, beta=p.beta, scale=p.scale, initial_state=S,
                              output_final_state=True, use_qk_l2norm_in_kernel=True)

        return ([fla_call(p, S) for p, S in zip(phis, states, strict=True)],
                lambda i: states[i].reshape(B, H, *case.key_widths, V))
    dec = _rt_decode()
    extra = _variant_kwargs(case, impl)

    def rt_call(s: Inputs, idx: Any) -> Callable[[], Any]:
        return lambda: dec(s.q, s.k, s.v, s.g, s.beta, state_cache=st.cache, state_indices=idx, scale=s.scale,
                           l2norm=True, validate=validate, **extra)

    return [rt_call(s, i) for s, i in zip(st.sets, st.indices, strict=True)], lambda i: st.cache[st.indices[i].long()]


def _decode_error(impl: str, case: Case, st: _DecodeSetup, call: Callable, state_of: Callable) -> Outcome:
    """Error of one decode step from the current state of group 0 vs the float64 token loop."""
    s0 = state_of(0).clone()
    out = call()
    o, s1 = (out[0], out[1]) if impl == IMPL_FLA else (out, state_of(0))
    o_ref, s_ref = reference64(st.sets[0], initial_state=s0)
    return _error_outcome(rel_rms(o, o_ref), rel_rms(s1, s_ref), case.dtype)


def measure_decode(case: Case, impl: str, ctx: BenchContext) -> Outcome:
    """Warm-up, one checked step (error), then graph-replay timing rotating over slot groups."""
    if impl == IMPL_FLA and (why := _fla_refusal(case)):
        return Outcome(note=why)
    if impl == IMPL_COPY:
        return _measure_same_size_copy(case, ctx)
    st = _decode_setup(case, ctx)
    if impl.startswith(IMPL_RT):
        checked, state_of = _decode_calls(impl, case, st, validate=True)
        checked[0]()  # first call: compile/autotune with validation on, the API default
        _sync(ctx)
        calls, _ = _decode_calls(impl, case, st, validate=False)
    else:
        calls, state_of = _decode_calls(impl, case, st)
        checked = calls
    warm_up(calls, ctx)
    err = _decode_error(impl, case, st, checked[0], state_of)
    t = time_calls(calls, ctx)
    validate_text = ", validate=False" if impl.startswith(IMPL_RT) else ""
    return replace(err, seconds=t.seconds, timing=t.method + validate_text)


def _measure_same_size_copy(case: Case, ctx: BenchContext) -> Outcome:
    """A device copy of exactly the state bytes of one decode call, rotated over as many buffer
    pairs as the decode call rotates over slot groups, and timed the same way."""
    import torch

    nbytes = case.B * case.state_bytes_per_seq
    n = rotation_count(nbytes, ctx.l2_bytes, minimum=2)
    src = [torch.empty(nbytes, dtype=torch.uint8, device=ctx.device).fill_(1) for _ in range(n)]
    dst = [torch.empty_like(s) for s in src]
    calls = [lambda s=s, d=d: d.copy_(s) for s, d in zip(src, dst, strict=True)]
    warm_up(calls, ctx)
    t = time_calls(calls, ctx)
    return Outcome(seconds=t.seconds, timing=t.method, work=Work(0, 2 * nbytes, None))


def measure_eager(case: Case, impl: str, ctx: BenchContext) -> Outcome:
    """Wall time per eager decode call at a small shape: Python and launch overhead."""
    if impl == IMPL_FLA and (why := _fla_refusal(case)):
        return Outcome(note=why)
    st = _decode_setup(replace(case, phase="decode"), BenchContext(ctx.device, l2_bytes=0))
    if impl.startswith(IMPL_RT):
        calls, _ = _decode_calls(IMPL_RT, case, st, validate=impl.endswith("validate=True"))
    else:
        calls, _ = _decode_calls(impl, case, st)
    per = wall_per_call(calls[0], ctx)
    return Outcome(seconds=per, timing=f"wall, {EAGER_CALLS} eager calls back to back, median of {EAGER_TRIALS}",
                   note=f"{per * 1e6:.1f} us/call")


def measures_for(case: Case, ctx: BenchContext) -> dict[str, Measure]:
    """impl name -> zero-argument measurement for ``case`` (inputs are built inside each)."""
    if case.phase == "error":
        oracle = _Oracle(case, ctx)
        return {impl: (lambda impl=impl: measure_error(case, impl, oracle)) for impl in case.impl_names()}
    fn = {"prefill": measure_prefill, "decode": measure_decode, "eager": measure_eager}[case.phase]
    return {impl: (lambda impl=impl: fn(case, impl, ctx)) for impl in case.impl_names()}


# ----- ceilings --------------------------------------------------------------------------------
CEILING_CASE = Case("ceiling", "ceiling", (), 0, 0, dtype="")
IMPL_BIG_COPY = "copy 2 GiB"
IMPL_MATMUL = f"matmul bf16 {MATMUL_N}^3"


def _measure_big_copy(ctx: BenchContext, nbytes: int = COPY_BYTES) -> Outcome:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device).fill_(1)
    dst = torch.empty_like(src)
    calls = [lambda: dst.copy_(src)]
    warm_up(calls, ctx)
    t = time_calls(calls, ctx, graph=False)  # ~1 ms per call and 2 GiB: no graph, no L2 concern
    return Outcome(seconds=t.seconds, timing=t.method, work=Work(0, 2 * nbytes, None))


def _measure_matmul(ctx: BenchContext, n: int = MATMUL_N) -> Outcome:
    import torch

    gen = torch.Generator(device=ctx.device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=ctx.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, generator=gen, device=ctx.device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    calls = [lambda: torch.matmul(a, b, out=c)]
    warm_up(calls, ctx, passes=5)  # let clocks ramp before timing
    t = time_calls(calls, ctx, graph=False)
    return Outcome(seconds=t.seconds, timing=t.method, work=Work(2 * n**3, 0, None))  # a rate, not bytes


def ceiling_measures(ctx: BenchContext) -> dict[str, Measure]:
    return {IMPL_BIG_COPY: lambda: _measure_big_copy(ctx), IMPL_MATMUL: lambda: _measure_matmul(ctx)}


def ceilings_from(rows: Sequence[Row]) -> Ceilings:
    by_impl = {r.impl: r for r in rows}
    copy, mm = by_impl.get(IMPL_BIG_COPY), by_impl.get(IMPL_MATMUL)
    return Ceilings(copy.gbps if copy else None, mm.tflops if mm else None)


# ----- header and files ----------------------------------------------------------------------------
def git_commit() -> tuple[str, bool | None]:
    """(commit, dirty): ``git rev-parse HEAD`` of this checkout, else $RTCOMPILE_COMMIT, else unknown."""
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
    return os.environ.get("RTCOMPILE_COMMIT") or "unknown", None


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
    return header


def _atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same folder and os.replace."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _plain(value: Any) -> Any:
    """JSON-safe scalar: non-finite floats become None (strict JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def row_dict(row: Row) -> dict[str, Any]:
    return {k: _plain(v) for k, v in asdict(row).items()}


def write_results(out_dir: Path, header: Mapping[str, Any], rows: Sequence[Row]) -> tuple[Path, Path]:
    """Write ``bench.json`` ({header, rows}) and ``bench.csv`` (rows + header columns), atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath, cpath = out_dir / "bench.json", out_dir / "bench.csv"
    doc = {"header": {k: _plain(v) for k, v in header.items()}, "rows": [row_dict(r) for r in rows]}
    _atomic_write(jpath, json.dumps(doc, indent=2, allow_nan=False) + "\n")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=[*ROW_FIELDS, *CSV_HEADER_FIELDS], lineterminator="\n")
    writer.writeheader()
    extra = {k: header.get(k) for k in CSV_HEADER_FIELDS}
    for r in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in {**row_dict(r), **extra}.items()})
    _atomic_write(cpath, buf.getvalue())
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
        from rich.markup import escape
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
        table.add_row(*(escape(c) for c in cell))  # "rtcompile[fused]" is not a markup tag
    Console(file=file, width=220).print(table)


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


def dry_run_lines(options: BenchOptions) -> list[str]:
    """What a run would do, one line per case (no device needed)."""
    fla = fla_version()
    lines = [f"rtcompile bench plan: phase {options.phase}, {'quick, ' if options.quick else ''}"
             f"repeats {options.repeats}, budget {options.budget_s:.0f} s, fla-core {fla or 'not installed'}",
             f"ceiling  copy {COPY_BYTES >> 30} GiB d2d; matmul bf16 {MATMUL_N}^3"]
    for case in plan(options.phase, options.quick, options.variants):
        work = case_work(case)
        impls = list(case.impl_names())
        if IMPL_FLA in impls and case.phase in ("prefill", "error") and case.K > FLA_MAX_K:
            impls[impls.index(IMPL_FLA)] = "fla(refused: K>256, not called)"
        size = f"B{case.B} T{case.T} H{case.H} V{case.V} K{case.K} {case.dtype}"
        wtxt = f"  {work.nbytes / 1e9:.3g} GB {work.flops / 1e9:.3g} GFLOP" if work else ""
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
            for case in cases if cases is not None else plan(options.phase, options.quick, options.variants):
                run_case(case, measures_for(case, ctx), ceilings=ctx.ceilings, deadline=ctx.deadline, on_row=emit)
                flush()
    finally:
        flush()  # a failed or interrupted run still leaves what it measured
    print_tables(rows, header, file or sys.stdout)
    return rows
