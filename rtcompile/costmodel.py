"""Cost model: predicted time of a kernel config on a target, per layer.

What a call does comes from the config itself (``config.figures(workload)``: programs, serial
steps, state passes, workspace bytes, streamed tile visits, fused solve rows, launches; see
:class:`~rtcompile.kernels.config.CostFigures`); FLOPs and the per-token input/output bytes from
:mod:`rtcompile.figures` (the formulas ``rtcompile info`` prints). This module only turns those
into seconds with the target's rates. A kernel's time is the largest of three floors, plus
launches:

* memory: bytes moved / HBM bandwidth, scaled by how much of the GPU the programs fill;
* compute: FLOPs / the matrix rate (16-bit inputs) or the fp32 rate;
* latency: the sequential part. The chunk kernel walks T / C chunks per program and the
  recurrent kernel T tokens, in waves of programs over the SMs; one step costs a fixed latency
  plus a per-tile cost for each state tile streamed (twice per step when the state does not
  fit registers). A chunk program alone on its SM steps twice as fast as one of two.

The split form (a state loop apart from chunk-parallel kernels: ``CostFigures.loop_elements``)
is the sum of its loop, whose step latency grows with C x K, and its bytes at the share of the
bandwidth its chunk-parallel kernels reach (``SPLIT_*``, fitted to its own H200 kernel split).
The resident form (two kernels, the state in registers) has its own step too (``RESIDENT_*``):
it grows with C x K and with how much of the GPU the programs fill.

The streamed and fused forms' latency constants were fitted to one H200 run (its RESULTS.md
section is in git history; B8 T4096 H8 V64 bf16, 256 programs = one wave of 2 per SM): o3 16x16
chunk (C 32, state in registers) 1.19 ms = 128 chunks x 9.3 us; o3 64x64 (C 64, 2 x 32 streamed [128, 16] tiles per
chunk) 10.4 ms = 64 x 162 us, so 2.4 us per tile visit at C x BK = 64 x 128 (the 32x32 run,
C x BK = 32 x 128, then predicts 3.6 ms against 3.17 measured); the fused prepare added 11.7 us
per 32-row chunk at 16x16 (0.37 us per row of the forward substitution); the 16x16 scan took
4.87 ms for 4096 tokens. They are not rescaled per GPU: :func:`calibrate` rescales the kernel
time from tuned measurements of the GPU at hand.

A call also costs its host: an eager call spends a fixed time in Python, the allocator and the
launcher before its kernels start, and a chunk call more for each further launch. The model adds
it per kind of call (chunk prefill, recurrent prefill, decode step) on top of the kernels' time;
:class:`Calibration` refits both, per kind, as measured ~ scale x kernel time + call overhead.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from .figures import chunk_figures, io_bytes_per_token, recurrent_figures
from .kernels.config import KernelConfig, KernelShape, Workload
from .spec import DTYPE_BYTES, ModelSpec
from .target import Target

CHUNK_ITER_S = 9.3e-6  # one chunk iteration of a wave of programs: the streamed and fused forms' base step
CHUNK_TILE_S = 2.4e-6  # one streamed state-tile visit at C x BK = 64 x 128, scaled by C x BK
CHUNK_TILE_ELEMENTS = 64 * 128  # the C x BK that CHUNK_TILE_S was fitted at
FUSED_ROW_S = 0.37e-6  # per chunk row: the fused prepare's forward substitution on the serial path
SCAN_STEP_S = 1.2e-6  # one token of the recurrent scan, state in registers
SCAN_TILE_S = 0.3e-6  # each streamed tile visit of a scan step (not measured: a lead)
# The split form's state loop (CostFigures.loop_elements), one program per SM: a step costs
# SPLIT_STEP_S + SPLIT_ELEMENT_S x C x K. Least squares through its measured chunks (H200,
# torch.profiler, one part, B8 T4096 H8 d_v 64 bf16, 2026-12-03/04): o2 64 C 32 (wy) 1.09 us,
# o2 256 C 32 (wy) 1.64, o3 16x16 C 64 2.13. Its prepare and output kernels moved the model's
# bytes (below) at 0.68 / 0.59 / 0.69 of the HBM rate in those runs (187 / 501 / 218 us for
# 611 / 1429 / 725 MB): SPLIT_BW_SHARE. The loop's time is added to theirs: they overlap little
# (o3 16x16 0.347 ms in two pipelined parts, 0.357 in one; 354 us of kernels). Not fitted on,
# the H200 sweep of o3 16x16's split form at B1 and B8 T4096 (96 configs: stages x stored-state
# stride x parts x wy, 2026-12-04) is predicted with a median |log(predicted / measured)| of
# 0.11, max 0.31 (0.50 and 0.77 with the chunk loop's constants below; kernel time against
# CUDA-graph replays); the five split defaults of K <= 256 0.12 / 0.35 (0.39 / 0.86).
SPLIT_STEP_S = 0.98e-6
SPLIT_ELEMENT_S = 7.2e-11
SPLIT_BW_SHARE = 0.65
# The resident form's loop (two kernels, the state in registers: no streamed tiles, no fused
# solve), one program's step: RESIDENT_STEP_S + RESIDENT_ELEMENT_S x C x K x (1 + fill), fill =
# the share of SMs its programs occupy (the same step took 1.7 us at B1 and 3.0 us at B8, both
# one program an SM: loads wait longer on a full GPU), times the programs sharing an SM.
# Least squares through eight H200 measurements of whole calls (B8 / B1 T4096 H8 d_v 64 bf16,
# CUDA graphs, 2026-12-02/04; materialise's phi kernels taken out): o2 64 C 32 + wy 0.343 ms,
# o2 128 C 16 0.385, o3 16x8 materialised C 16 0.479, o3 16x16 C 16 0.77 (B1 0.429) and
# materialised 0.810, o2 256 C 16 0.906, o3 16x16 C 32 + wy B1 0.312; median |log(predicted /
# measured)| 0.10, max 0.32. The single constant before (CHUNK_ITER_S, fitted at o3 16x16 C 32
# on an earlier kernel) put every one of them at 1.2 ms (0.6 at B1), and made small widths look
# slower than large ones in `rtcompile explore` (o2 w16 predicted 1.4 ms at B8 against 0.69 for
# o3 16x16). Below C x K = 2048 it is extrapolated (o2 widths 8-32 are not measured).
RESIDENT_STEP_S = 0.55e-6
RESIDENT_ELEMENT_S = 2.7e-10
# The streamed form's Gluon kernel (the state on chip, phi(K) formed per chunk; one program an
# SM: its shared memory), one chunk's step: CHIP_STEP_S + CHIP_ELEMENT_S x C x K; the prepare
# kernel before it moves the call's bytes, so the two add. Fitted on two H100 points, the defaults'
# (eager kernel split at bb1a5ee, B8 T4096 H8 d_v 64 bf16, 128 programs: 589 us over 64 chunks
# at o3 32x32 without the loads ahead, 429 at 32x16 with them; the prepare kernel 141 / 142 us
# against the bytes' ~130 at the datasheet's rate); whole calls then 0.728 / 0.558 ms predicted
# against 0.7344 / 0.5725 measured in CUDA graphs. No point held out: two kernels, two constants.
# The tile-visit step above put both at the Triton kernel's 1.76 / 1.15 ms (measured 1.21 / 0.84).
CHIP_STEP_S = 4.20e-6
CHIP_ELEMENT_S = 7.65e-11
PROGRAMS_PER_SM = 2  # resident programs per SM these kernels reach (registers: ~200 per thread)
DECODE_BW_EFFICIENCY = 0.8  # decode reached 70-87% of copy bandwidth on the H200

# Host overhead of one eager call, fitted to an H200 regret run (`benchmarks/gpu_checks.py
# regret`; its JSON is in git history: one public-API call between two CUDA events, median of 10): the median of measured - modelled kernel time over the calls whose
# kernels the model puts under a quarter of the measurement. It dwarfs target.launch_s (4 us,
# one launch under CUDA graphs) and the kernels of every short call.
CHUNK_CALL_S = 150e-6  # chunk prefill with one launch: input checks, variant lookup, allocations;
#   the recurrent call's (one launch too): beyond its kernels the fused form took 0.121 / 0.204 ms
#   and the scan 0.130 / 0.179 at o3 16x16 B1 T16 in two H200 regret runs (2026-12-04)
CHUNK_LAUNCH_CALL_S = 80e-6  # each further launch (the split form's eager call: three, one part;
#   its pipelined parts run in CUDA-graph captures only). The first of those runs (o3 16x16, B1 T16 / T256, eager, beyond the
#   modelled kernels): fused (1 launch) 0.121 / 0.132 ms, resident (2) 0.233 / 0.203, split (3)
#   0.292 / 0.517. Before: 200 us for every chunk call (median of 7 calls, 0.152-0.248 ms beyond
#   the kernels, most with 2 launches), which put the split form's eager calls at the fused
#   form's and chose it at T 256 (0.54 ms measured against the fused form's 0.25)
RECURRENT_CALL_S = 150e-6  # recurrent prefill: the same checks, 2 allocations, 1 launch. o3 16x16
#   T16 took 0.183 / 0.164 ms at B1 / B8 for 0.023 ms of modelled kernel: 0.160 / 0.141 beyond
DECODE_CALL_S = 68e-6  # the in-place decode step: a cached launch plan, 1 allocation, 1 launch.
#   o3 16x16 B1 / B32 took 0.083 / 0.072 ms for 0.006 / 0.013 ms of modelled kernel
KINDS = ("chunk", "recurrent", "decode")  # the calls the overhead and the calibration tell apart

# Calibration fit (see :func:`calibrate`).
MIN_AFFINE_POINTS = 2  # a scale and an overhead need two measurements at least
MIN_KERNEL_SPREAD = 2.0  # longest / shortest kernel time needed to separate scale from overhead:
#   below it the slope is set by host noise (two chunk calls of near-zero kernel time at o3 16x16
#   T16 measured 0.196 and 0.265 ms, 35% apart)
HUBER_REL = 0.2  # relative misses beyond 20% weigh less (that same host noise)
FIT_ITERATIONS = 20  # reweighting rounds of the robust fit; 2 x 2 solves, converged well before


@dataclass(frozen=True)
class Cost:
    """Predicted (or measured) seconds of one call, per layer, with what bounds it."""

    seconds: float
    bytes: float
    flops: float
    programs: int
    bound: str
    source: str = "cost model"
    host_s: float = 0.0  # the call's fixed host overhead, included in ``seconds``
    launch_host_s: float = 0.0  # the part of host_s for launches beyond the first (not calibrated)
    kind: str = "chunk"  # which call: chunk, recurrent (prefill) or decode (the in-place step)

    @property
    def kernel_s(self) -> float:
        """The device part of ``seconds``: what the calibration's scale multiplies."""
        return self.seconds - self.host_s

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "bytes": self.bytes, "flops": self.flops, "programs": self.programs,
                "bound": self.bound, "source": self.source, "host_s": self.host_s, "kind": self.kind,
                "launch_host_s": self.launch_host_s}


@dataclass(frozen=True)
class Calibration:
    """Per kind of call (:data:`KINDS`): measured ~ scale x modelled kernel time + call overhead.

    The scales are the fields named by the kinds (1.0: uncalibrated), the overheads the
    ``*_call_s`` fields (default: the model's constants). ``fits`` says how each kind was fitted.
    """

    chunk: float = 1.0
    recurrent: float = 1.0
    decode: float = 1.0
    chunk_call_s: float = CHUNK_CALL_S
    recurrent_call_s: float = RECURRENT_CALL_S
    decode_call_s: float = DECODE_CALL_S
    fits: str = "uncalibrated"

    def scale(self, kind: str) -> float:
        return getattr(self, kind)

    def call_s(self, kind: str) -> float:
        return getattr(self, f"{kind}_call_s")

    def to_dict(self) -> dict:
        return asdict(self)


def shape_of(spec: ModelSpec) -> KernelShape:
    return KernelShape(spec.key_widths, spec.value_width, DTYPE_BYTES[spec.input_dtype])


def _rate(spec: ModelSpec, target: Target) -> float:
    return target.fp32_flops if spec.input_dtype == "float32" else target.bf16_flops


def _waves(programs: int, target: Target) -> int:
    return max(1, math.ceil(programs / (target.sms * PROGRAMS_PER_SM)))


def _pick(memory: float, compute: float, latency: float) -> tuple[float, str]:
    """The largest floor and its name."""
    return max((memory, "memory"), (compute, "compute"), (latency, "latency"))


def _per_sm_share(programs: int, target: Target) -> float:
    """The share of an SM's issue slots one resident program gets, relative to the
    PROGRAMS_PER_SM the latency constants were fitted at. With one program per SM the chunk
    loop ran about twice as fast: at T4096 B1 (32 programs) against B8 (256 programs), o3 16x16
    took 0.677 against 1.18 ms and o3 64x64 4.1 against 9.29 ms (H200 regret run, 2026-11-30)."""
    per_sm = min(PROGRAMS_PER_SM, math.ceil(programs / target.sms))
    return per_sm / PROGRAMS_PER_SM


def _finish(kernel_s: float, nbytes: float, flops: float, programs: int, bound: str, kind: str,
            cal: Calibration, launches: int = 1) -> Cost:
    """The call's cost: the calibrated kernel time plus the call's host overhead (a chunk call's
    grows with its launches: :data:`CHUNK_LAUNCH_CALL_S` each beyond the first, not calibrated)."""
    extra = CHUNK_LAUNCH_CALL_S * max(0, launches - 1) if kind == "chunk" else 0.0
    host = cal.call_s(kind) + extra
    return Cost(cal.scale(kind) * kernel_s + host, nbytes, flops, programs, bound, host_s=host, kind=kind,
                launch_host_s=extra)


def workload(spec: ModelSpec, batch: int, seq_len: int) -> Workload:
    """One call of ``spec``'s mixer (one layer, all heads) on ``batch`` sequences of ``seq_len``
    tokens: what a config's workspace and cost figures are computed from."""
    return Workload(shape_of(spec), batch, spec.heads, seq_len, delta_rule=spec.features.delta_rule,
                    forget_gate=spec.features.forget_gate)


def chunk_cost(spec: ModelSpec, target: Target, batch: int, seq_len: int, config: KernelConfig,
               cal: Calibration = Calibration()) -> Cost:
    """A chunk form's call: the config's figures at this workload, in seconds on ``target``."""
    fig = config.figures(workload(spec, batch, seq_len))
    flops = chunk_figures(spec, config.chunk_size).flops_per_token * batch * seq_len
    # state_passes counts whole-state reads and writes: a streamed state is read twice and written
    # once per chunk, once each with merge_passes. The per-tile latency below stays at the
    # figures' two visits: merging keeps all three phi blocks per tile (64x64 on the H200,
    # 2026-11-30d: 6.49 ms merged against 7.20 two-pass, 0.9x)
    state = spec.state_bytes_per_layer * batch
    nbytes = io_bytes_per_token(spec) * batch * seq_len + fig.state_passes * state + 2 * fig.workspace_bytes
    fill = min(1.0, fig.programs / target.sms)
    if fig.loop_elements:  # the split form: a state loop beside chunk-parallel kernels
        seconds, bound = _split_seconds(fig, target, nbytes, flops, spec)
        return _finish(seconds + fig.launches * target.launch_s, nbytes, flops, fig.programs, bound, "chunk", cal,
                       fig.launches)
    if fig.chip_elements:  # the Gluon kernel after its prepare kernel, one program an SM
        loop = math.ceil(fig.programs / target.sms) * fig.serial_steps * (
            CHIP_STEP_S + CHIP_ELEMENT_S * fig.chip_elements)
        memory = nbytes / target.hbm_bytes_per_s
        return _finish(loop + memory + fig.launches * target.launch_s, nbytes, flops, fig.programs,
                       "latency" if loop > memory else "memory", "chunk", cal, fig.launches)
    if fig.host_loop:  # chunk-parallel launches in order: their bytes (or FLOPs) and launches, not fitted
        seconds, bound = _pick(nbytes / (target.hbm_bytes_per_s * fill), flops / (_rate(spec, target) * fill), 0.0)
        return _finish(seconds + fig.launches * target.launch_s, nbytes, flops, fig.programs, bound, "chunk", cal,
                       fig.launches)
    if fig.tile_visits == 0 and fig.solve_rows == 0:  # the resident form's loop (its own fit, above)
        latency = _resident_loop(fig, config.chunk_size, fill, spec, target)
    else:
        per_step = (CHUNK_ITER_S + fig.tile_visits * CHUNK_TILE_S * fig.tile_elements / CHUNK_TILE_ELEMENTS
                    + fig.solve_rows * FUSED_ROW_S)
        latency = _waves(fig.programs, target) * fig.serial_steps * per_step * _per_sm_share(fig.programs, target)
    seconds, bound = _pick(nbytes / (target.hbm_bytes_per_s * fill), flops / (_rate(spec, target) * fill), latency)
    return _finish(seconds + fig.launches * target.launch_s, nbytes, flops, fig.programs, bound, "chunk", cal,
                   fig.launches)


def _resident_loop(fig, chunk_size: int, fill: float, spec: ModelSpec, target: Target) -> float:
    """The resident form's sequential loop (RESIDENT_*): waves x chunks x the programs sharing an
    SM x one program's step, which grows with C x K and with ``fill``, the share of SMs the
    programs occupy."""
    per_sm = min(PROGRAMS_PER_SM, math.ceil(fig.programs / target.sms))
    key_dim = math.prod(spec.key_widths)
    step = RESIDENT_STEP_S + RESIDENT_ELEMENT_S * chunk_size * key_dim * (1 + fill)
    return _waves(fig.programs, target) * fig.serial_steps * per_sm * step


def _split_seconds(fig, target: Target, nbytes: float, flops: float, spec: ModelSpec) -> tuple[float, str]:
    """The split form's kernels: its state loop (programs sharing an SM step that much slower)
    plus the chunk-parallel kernels' bytes (or FLOPs, if larger) at their share of the GPU; the
    bound named is the larger of the two parts."""
    per_sm = min(PROGRAMS_PER_SM, math.ceil(fig.programs / target.sms))
    step = SPLIT_STEP_S + SPLIT_ELEMENT_S * fig.loop_elements
    loop = _waves(fig.programs, target) * fig.serial_steps * step * per_sm
    parallel, bound = _pick(nbytes / (target.hbm_bytes_per_s * SPLIT_BW_SHARE), flops / _rate(spec, target), 0.0)
    return loop + parallel, "latency" if loop > parallel else bound


def recurrent_cost(spec: ModelSpec, target: Target, batch: int, seq_len: int, config: KernelConfig,
                   cal: Calibration = Calibration(), state_dtype: str | None = None, step: bool = False) -> Cost:
    """The fused recurrent kernel over ``seq_len`` tokens, with the state stored as
    ``state_dtype`` (default: the spec's; fp32 for "auto"). ``step``: called as the in-place
    decode step (seq_len = 1), whose host path is shorter than a prefill call's."""
    fig = config.figures(workload(spec, batch, seq_len))
    if state_dtype is None:
        state_dtype = "float32" if spec.state_dtype == "auto" else spec.state_dtype
    state = spec.state_elements_per_head * spec.heads * DTYPE_BYTES[state_dtype] * batch
    nbytes = io_bytes_per_token(spec) * batch * seq_len + fig.state_passes * state
    flops = recurrent_figures(spec).flops_per_token * batch * seq_len
    fill = min(1.0, fig.programs / target.sms)
    # SCAN_STEP_S was fitted at one program per SM (128 programs): no per-SM share here, the scan
    # was not measured with two; a scan tile visit is not scaled by its size (not measured)
    latency = _waves(fig.programs, target) * fig.serial_steps * (SCAN_STEP_S + fig.tile_visits * SCAN_TILE_S)
    memory = nbytes / (target.hbm_bytes_per_s * DECODE_BW_EFFICIENCY * fill)
    seconds, bound = _pick(memory, flops / (target.fp32_flops * fill), latency)
    kind = "decode" if step else "recurrent"
    return _finish(seconds + fig.launches * target.launch_s, nbytes, flops, fig.programs, bound, kind, cal)


def config_cost(spec: ModelSpec, target: Target, batch: int, seq_len: int, config: KernelConfig,
                cal: Calibration = Calibration(), **recurrent: Any) -> Cost:
    """The cost of ``config``'s call, whichever kernel it is (``recurrent``: the keyword
    arguments of :func:`recurrent_cost`)."""
    if config.kernel == "chunk":
        return chunk_cost(spec, target, batch, seq_len, config, cal)
    return recurrent_cost(spec, target, batch, seq_len, config, cal, **recurrent)


def _huber_weight(rel: float) -> float:
    return 1.0 if abs(rel) <= HUBER_REL else HUBER_REL / abs(rel)


def _weighted_fit(points: list[tuple[float, float]], weights: list[float],
                  call_s: float | None) -> tuple[float, float]:
    """Weighted least squares of measured ~ scale x kernel + call over (kernel, measured)
    points: both fitted when ``call_s`` is None (the call held at 0 if it would go negative),
    else the scale alone with the call fixed."""
    swdd = sum(w * d * d for (d, _), w in zip(points, weights))
    if call_s is not None:
        return sum(w * d * (m - call_s) for (d, m), w in zip(points, weights)) / swdd, call_s
    sw = sum(weights)
    swd = sum(w * d for (d, _), w in zip(points, weights))
    swm = sum(w * m for (_, m), w in zip(points, weights))
    swdm = sum(w * d * m for (d, m), w in zip(points, weights))
    det = swdd * sw - swd * swd
    scale, call = (swdm * sw - swd * swm) / det, (swdd * swm - swd * swdm) / det
    if call < 0:  # the non-negative optimum is on the boundary
        return _weighted_fit(points, weights, 0.0)
    return scale, call


def _robust_fit(points: list[tuple[float, float]], call_s: float | None) -> tuple[float, float]:
    """:func:`_weighted_fit` on relative misses (weights 1 / measured^2), Huber-reweighted."""
    weights = [1.0 / (m * m) for _, m in points]
    scale, call = _weighted_fit(points, weights, call_s)
    for _ in range(FIT_ITERATIONS):
        weights = [_huber_weight((scale * d + call - m) / m) / (m * m) for d, m in points]
        scale, call = _weighted_fit(points, weights, call_s)
    return scale, call


def fit_kind(points: list[tuple[float, float]], default_call_s: float) -> tuple[float, float, str]:
    """(scale, call overhead, how) for one kind from (modelled kernel s, measured s) points.

    Affine when there are MIN_AFFINE_POINTS whose kernel times spread by MIN_KERNEL_SPREAD and
    the scale comes out positive; else the scale alone, the overhead kept at the model's;
    else (no points, or measurements below the overhead alone) 1.0 and the model's overhead.
    """
    points = [(d, m) for d, m in points if d > 0 and m > 0]
    n = len(points)
    if n >= MIN_AFFINE_POINTS and max(d for d, _ in points) >= MIN_KERNEL_SPREAD * min(d for d, _ in points):
        scale, call = _robust_fit(points, None)
        if scale > 0:
            return scale, call, f"affine ({n} points)"
    if n:
        scale, call = _robust_fit(points, default_call_s)
        if scale > 0:
            return scale, call, f"scale only ({n} point{'s' * (n > 1)})"
    return 1.0, default_call_s, f"none ({n} points)"


def fit_device_kind(points: list[tuple[float, float]], default_call_s: float) -> tuple[float, float, str]:
    """(scale, call overhead, how) for one kind from (modelled kernel s, measured device s)
    points: the scale alone, through the origin (device time holds no call overhead), the
    overhead kept at the model's; 1.0 with no usable point."""
    points = [(d, m) for d, m in points if d > 0 and m > 0]
    n = len(points)
    if n:
        scale, _ = _robust_fit(points, 0.0)
        if scale > 0:
            return scale, default_call_s, f"device-time scale ({n} point{'s' * (n > 1)})"
    return 1.0, default_call_s, f"none ({n} points)"


def calibrate(predicted: dict[str, list[Cost]], measured: dict[str, list[float]], *,
              device_time: bool = False) -> Calibration:
    """Fit a :class:`Calibration` from matched pairs per kind (:data:`KINDS`): ``predicted``
    holds uncalibrated costs (their ``kernel_s`` is what the scale multiplies), ``measured``
    the seconds measured for the same calls: whole eager calls, or with ``device_time`` the
    device time alone (CUDA-graph replays, as the tuner times: its table's seconds), which fits
    the scale only and keeps the model's host overheads. (Fitted as whole calls, one tuned
    B8 T4096 measurement of 0.35 ms would have put a chunk call's kernels at half their time:
    the 0.15 ms of host overhead it never contained came off them.)"""
    base = Calibration()
    fields: dict = {}
    how = []
    fit = fit_device_kind if device_time else fit_kind
    for kind in KINDS:
        pairs = zip(predicted.get(kind, []), measured.get(kind, []))
        # an eager call's measurement holds its launch's host time; a device time does not
        points = [(c.kernel_s, m - (0.0 if device_time else c.launch_host_s)) for c, m in pairs]
        fields[kind], fields[f"{kind}_call_s"], why = fit(points, base.call_s(kind))
        how.append(f"{kind}: {why}")
    return Calibration(**fields, fits="; ".join(how))


def with_measured(cost: Cost, device_seconds: float) -> Cost:
    """``cost`` with its device time replaced by a measured one (a tuned entry: CUDA-graph
    replays, no host time); the call's host overhead stays the model's, so the measured option
    competes with modelled ones on the same footing."""
    return replace(cost, seconds=device_seconds + cost.host_s, source="measured (tuned)")
