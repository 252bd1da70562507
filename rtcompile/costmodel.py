"""Cost model: predicted time of each kernel variant on a target, per layer.

Bytes and FLOPs come from :mod:`rtcompile.figures` (the formulas ``rtcompile info`` prints).
A kernel's time is the largest of three floors, plus launches:

* memory: bytes moved / HBM bandwidth, scaled by how much of the GPU the programs fill;
* compute: FLOPs / the matrix rate (16-bit inputs) or the fp32 rate;
* latency: the sequential part. The chunk kernel walks T / C chunks per program and the
  recurrent kernel T tokens, in waves of programs over the SMs; one step costs a fixed latency
  plus a per-tile cost for each state tile streamed (twice per step when the state does not
  fit registers). A chunk program alone on its SM steps twice as fast as one of two.

The latency constants were fitted to one H200 run (benchmarks/RESULTS.md, 2026-11-29, B8
T4096 H8 V64 bf16, 256 programs = one wave of 2 per SM): o3 16x16 chunk (C 32, state in
registers) 1.19 ms = 128 chunks x 9.3 us; o3 64x64 (C 64, 2 x 32 streamed [128, 16] tiles per
chunk) 10.4 ms = 64 x 162 us, so 2.4 us per tile visit at C x BK = 64 x 128 (the 32x32 run,
C x BK = 32 x 128, then predicts 3.6 ms against 3.17 measured); the fused prepare added 11.7 us
per 32-row chunk at 16x16 (0.37 us per row of the forward substitution); the 16x16 scan took
4.87 ms for 4096 tokens. They are not rescaled per GPU: :func:`calibrate` rescales the kernel
time from tuned measurements of the GPU at hand.

A call also costs its host: an eager call spends a fixed time in Python, the allocator and the
launcher before its kernels start. The model adds it per kind of call (chunk prefill, recurrent
prefill, decode step) on top of the kernels' time; :class:`Calibration` refits both, per kind,
as measured ~ scale x kernel time + call overhead.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from .figures import _io_bytes_per_token, chunk_figures, recurrent_figures
from .kernels.variants import (
    SOLVE_BLOCK,
    ChunkVariant,
    KernelShape,
    RecurrentVariant,
    dot_operand_bytes,
)
from .spec import DTYPE_BYTES, ModelSpec
from .target import Target

CHUNK_ITER_S = 9.3e-6  # one chunk iteration of a wave of programs (state in registers)
CHUNK_TILE_S = 2.4e-6  # one streamed state-tile visit at C x BK = 64 x 128, scaled by C x BK
FUSED_ROW_S = 0.37e-6  # per chunk row: the fused prepare's forward substitution on the serial path
SCAN_STEP_S = 1.2e-6  # one token of the recurrent scan, state in registers
SCAN_TILE_S = 0.3e-6  # each streamed tile visit of a scan step (not measured: a lead)
PROGRAMS_PER_SM = 2  # resident programs per SM these kernels reach (registers: ~200 per thread)
DECODE_BW_EFFICIENCY = 0.8  # decode reached 70-87% of copy bandwidth on the H200

# Host overhead of one eager call, fitted to the H200 regret run of 2026-11-30
# (benchmarks/results/2026-11-30_regret_measured.json: one public-API call between two CUDA
# events, median of 10): the median of measured - modelled kernel time over the calls whose
# kernels the model puts under a quarter of the measurement. It dwarfs target.launch_s (4 us,
# one launch under CUDA graphs) and the kernels of every short call.
CHUNK_CALL_S = 200e-6  # chunk prefill: input checks, variant lookup, workspace and final-state
#   allocations, 2 launches. Median of 7 calls, 0.152-0.248 ms beyond the kernels (o3 16x16 T16
#   B1 / B8: 0.196 / 0.265 ms measured, decode-size B1 / B32: 0.184 / 0.248 ms). The fused
#   variant (1 launch, no workspace) shares it: its two host-dominated calls (0.217 and 0.177 ms
#   at T16 B1 / B8) bracket the default's
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
    kind: str = "chunk"  # which call: chunk, recurrent (prefill) or decode (the in-place step)

    @property
    def kernel_s(self) -> float:
        """The device part of ``seconds``: what the calibration's scale multiplies."""
        return self.seconds - self.host_s

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "bytes": self.bytes, "flops": self.flops, "programs": self.programs,
                "bound": self.bound, "source": self.source, "host_s": self.host_s, "kind": self.kind}


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
            cal: Calibration) -> Cost:
    """The call's cost: the calibrated kernel time plus the call's host overhead."""
    host = cal.call_s(kind)
    return Cost(cal.scale(kind) * kernel_s + host, nbytes, flops, programs, bound, host_s=host, kind=kind)


def chunk_workspace_bytes(spec: ModelSpec, batch: int, seq_len: int, variant: ChunkVariant) -> int:
    """Extra memory of the chunk kernels: the [B, H, T, C] scores (and inverse) in fp32 (wy: the
    scores, W and U0; output_pass: each chunk's incoming state, U, the inverse and any stored
    keys), or, fused, nothing beyond the final-state buffer (counted as output) but the tile
    solve's [C, C] fp32 scratch per program (independent of T)."""
    if variant.fuse_prepare:
        if variant.solve == "tiles" and spec.features.delta_rule:
            programs = batch * spec.heads * math.ceil(spec.value_width / variant.block_v)
            return programs * variant.chunk_size ** 2 * 4
        return 0
    rows = batch * spec.heads * seq_len
    if variant.output_pass and variant.resident(shape_of(spec)):
        # the incoming state [K, V] of every state_stride-th chunk and U [T, V] in the dot type,
        # Ai [T, C] fp32 (delta rule; with wy only for the tile solve, beside W [T, K] in the dot
        # type and U0 [T, V] fp32), stored phi(K) [T, K] in the dot type, the gates' cumulative
        # sums [T] fp32
        dot = dot_operand_bytes(DTYPE_BYTES[spec.input_dtype])
        chunks = batch * spec.heads * math.ceil(math.ceil(seq_len / variant.chunk_size) / variant.state_stride)
        work = chunks * spec.key_dim * spec.value_width * dot + rows * spec.value_width * dot
        if spec.features.delta_rule and (not variant.wy or variant.solve == "tiles"):
            work += rows * variant.chunk_size * 4
        if spec.features.delta_rule and variant.wy:
            work += rows * (spec.key_dim * dot + spec.value_width * 4)
        if variant.stored_keys:
            work += rows * spec.key_dim * dot
        if spec.features.forget_gate and (spec.features.delta_rule or variant.stored_keys):
            work += rows * 4  # each chunk's cumulative log decay, fp32, from the prepare kernel
        return work
    if variant.wy and spec.features.delta_rule:  # P, and W [T, K] (input type) + U0 [T, V] (fp32)
        tiles = variant.chunk_size * 4 if variant.solve == "tiles" else 0  # + the tile solve's Ai [T, C]
        return rows * (variant.chunk_size * 4 + tiles + spec.key_dim * DTYPE_BYTES[spec.input_dtype]
                       + spec.value_width * 4)
    return rows * variant.chunk_size * 4 * (2 if spec.features.delta_rule else 1)


def _solve_rows(variant: ChunkVariant) -> float:
    """Serial steps of the fused solve, in forward-substitution rows. The blocked solve's
    C x C dots (2 log2(C / solve_block)) and the tile solve's C / 16 - 1 block rows of [16, 16]
    products are counted as one row each: guesses, not fitted (the fused tile solve ran 2.3x
    faster than the strip form at o3 32x32 on the H200, 2026-11-30f, which this does not show)."""
    if variant.solve == "rows":
        return variant.chunk_size
    if variant.solve == "tiles":
        return SOLVE_BLOCK - 1 + variant.chunk_size // SOLVE_BLOCK - 1
    return variant.solve_block - 1 + 2 * math.log2(variant.chunk_size // variant.solve_block)


def chunk_cost(spec: ModelSpec, target: Target, batch: int, seq_len: int, variant: ChunkVariant,
               cal: Calibration = Calibration()) -> Cost:
    shape = shape_of(spec)
    C = variant.chunk_size
    n_chunks = math.ceil(seq_len / C)
    fig = chunk_figures(spec, C)
    flops = fig.flops_per_token * batch * seq_len
    resident = variant.resident(shape)
    state = spec.state_bytes_per_layer * batch
    # a streamed state is read twice and written once per chunk; merge_passes reads it once.
    # The per-tile latency below stays at two visits: merging keeps all three phi blocks per
    # tile (64x64 on the H200, 2026-11-30d: 6.49 ms merged against 7.20 two-pass, 0.9x)
    state_traffic = 2 * state if resident else (2 if variant.merge_passes else 3) * state * n_chunks
    work = chunk_workspace_bytes(spec, batch, seq_len, variant)
    nbytes = _io_bytes_per_token(spec) * batch * seq_len + state_traffic + 2 * work
    programs = batch * spec.heads * math.ceil(spec.value_width / variant.block_v)
    fill = min(1.0, programs / target.sms)
    tiles = 0 if resident else 2 * math.ceil(shape.key_dim / variant.block_k)
    per_iter = CHUNK_ITER_S + tiles * CHUNK_TILE_S * (C * variant.block_k) / (64 * 128)
    if variant.fuse_prepare:
        per_iter += _solve_rows(variant) * FUSED_ROW_S
    latency = _waves(programs, target) * n_chunks * per_iter * _per_sm_share(programs, target)
    seconds, bound = _pick(nbytes / (target.hbm_bytes_per_s * fill), flops / (_rate(spec, target) * fill), latency)
    launches = 1 if variant.fuse_prepare else 2
    return _finish(seconds + launches * target.launch_s, nbytes, flops, programs, bound, "chunk", cal)


def recurrent_cost(spec: ModelSpec, target: Target, batch: int, seq_len: int, variant: RecurrentVariant,
                   cal: Calibration = Calibration(), state_dtype: str | None = None, step: bool = False) -> Cost:
    """The fused recurrent kernel over ``seq_len`` tokens, with the state stored as
    ``state_dtype`` (default: the spec's; fp32 for "auto"). ``step``: called as the in-place
    decode step (seq_len = 1), whose host path is shorter than a prefill call's."""
    shape = shape_of(spec)
    resident = variant.block_k >= shape.key_dim
    if state_dtype is None:
        state_dtype = "float32" if spec.state_dtype == "auto" else spec.state_dtype
    state = spec.state_elements_per_head * spec.heads * DTYPE_BYTES[state_dtype] * batch
    io = _io_bytes_per_token(spec) * batch * seq_len
    nbytes = io + (2 * state if resident else 3 * state * seq_len)
    flops = recurrent_figures(spec).flops_per_token * batch * seq_len
    programs = batch * spec.heads * math.ceil(spec.value_width / variant.block_v)
    fill = min(1.0, programs / target.sms)
    tiles = 0 if resident else 2 * math.ceil(shape.key_dim / variant.block_k)
    # SCAN_STEP_S was fitted at one program per SM (128 programs): no per-SM share here, the scan
    # was not measured with two
    latency = _waves(programs, target) * seq_len * (SCAN_STEP_S + tiles * SCAN_TILE_S)
    memory = nbytes / (target.hbm_bytes_per_s * DECODE_BW_EFFICIENCY * fill)
    seconds, bound = _pick(memory, flops / (target.fp32_flops * fill), latency)
    kind = "decode" if step else "recurrent"
    return _finish(seconds + target.launch_s, nbytes, flops, programs, bound, kind, cal)


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


def calibrate(predicted: dict[str, list[Cost]], measured: dict[str, list[float]]) -> Calibration:
    """Fit a :class:`Calibration` from matched pairs per kind (:data:`KINDS`): ``predicted``
    holds uncalibrated costs (their ``kernel_s`` is what the scale multiplies), ``measured``
    the seconds measured for the same calls."""
    base = Calibration()
    fields: dict = {}
    how = []
    for kind in KINDS:
        points = [(c.kernel_s, m) for c, m in zip(predicted.get(kind, []), measured.get(kind, []))]
        scale, call, fit = fit_kind(points, base.call_s(kind))
        fields[kind], fields[f"{kind}_call_s"] = scale, call
        how.append(f"{kind}: {fit}")
    return Calibration(**fields, fits="; ".join(how))


def with_measured(cost: Cost, seconds: float) -> Cost:
    return replace(cost, seconds=seconds, source="measured (tuned)")
