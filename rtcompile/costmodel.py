"""Cost model: predicted time of each kernel variant on a target, per layer.

Bytes and FLOPs come from :mod:`rtcompile.figures` (the formulas ``rtcompile info`` prints).
A kernel's time is the largest of three floors, plus launches:

* memory: bytes moved / HBM bandwidth, scaled by how much of the GPU the programs fill;
* compute: FLOPs / the matrix rate (16-bit inputs) or the fp32 rate;
* latency: the sequential part. The chunk kernel walks T / C chunks per program and the
  recurrent kernel T tokens, in waves of programs over the SMs; one step costs a fixed latency
  plus a per-tile cost for each state tile streamed (twice per step when the state does not
  fit registers).

The latency constants were fitted to one H200 run (benchmarks/RESULTS.md, 2026-11-29, B8
T4096 H8 V64 bf16, 256 programs = one wave of 2 per SM): o3 16x16 chunk (C 32, state in
registers) 1.19 ms = 128 chunks x 9.3 us; o3 64x64 (C 64, 2 x 32 streamed [128, 16] tiles per
chunk) 10.4 ms = 64 x 162 us, so 2.4 us per tile visit at C x BK = 64 x 128 (the 32x32 run,
C x BK = 32 x 128, then predicts 3.6 ms against 3.17 measured); the fused prepare added 11.7 us
per 32-row chunk at 16x16 (0.37 us per row of the forward substitution); the 16x16 scan took
4.87 ms for 4096 tokens. They are not rescaled per GPU: :func:`calibrate` rescales them from
tuned measurements of the GPU at hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .figures import _io_bytes_per_token, chunk_figures, recurrent_figures
from .kernels.variants import SOLVE_BLOCK, ChunkVariant, KernelShape, RecurrentVariant
from .spec import DTYPE_BYTES, ModelSpec
from .target import Target

CHUNK_ITER_S = 9.3e-6  # one chunk iteration of a wave of programs (state in registers)
CHUNK_TILE_S = 2.4e-6  # one streamed state-tile visit at C x BK = 64 x 128, scaled by C x BK
FUSED_ROW_S = 0.37e-6  # per chunk row: the fused prepare's forward substitution on the serial path
SCAN_STEP_S = 1.2e-6  # one token of the recurrent scan, state in registers
SCAN_TILE_S = 0.3e-6  # each streamed tile visit of a scan step (not measured: a lead)
PROGRAMS_PER_SM = 2  # resident programs per SM these kernels reach (registers: ~200 per thread)
DECODE_BW_EFFICIENCY = 0.8  # decode reached 70-87% of copy bandwidth on the H200


@dataclass(frozen=True)
class Cost:
    """Predicted (or measured) seconds of one call, per layer, with what bounds it."""

    seconds: float
    bytes: float
    flops: float
    programs: int
    bound: str
    source: str = "cost model"

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "bytes": self.bytes, "flops": self.flops, "programs": self.programs,
                "bound": self.bound, "source": self.source}


@dataclass(frozen=True)
class Calibration:
    """Multipliers on the model's latency terms, from measurements (1.0: uncalibrated)."""

    chunk: float = 1.0
    recurrent: float = 1.0


def shape_of(spec: ModelSpec) -> KernelShape:
    return KernelShape(spec.key_widths, spec.value_width, DTYPE_BYTES[spec.input_dtype])


def _rate(spec: ModelSpec, target: Target) -> float:
    return target.fp32_flops if spec.input_dtype == "float32" else target.bf16_flops


def _waves(programs: int, target: Target) -> int:
    return max(1, math.ceil(programs / (target.sms * PROGRAMS_PER_SM)))


def _pick(memory: float, compute: float, latency: float) -> tuple[float, str]:
    """The largest floor and its name."""
    return max((memory, "memory"), (compute, "compute"), (latency, "latency"))


def chunk_workspace_bytes(spec: ModelSpec, batch: int, seq_len: int, variant: ChunkVariant) -> int:
    """Extra memory of the chunk kernels: the [B, H, T, C] scores (and inverse) in fp32 (wy: the
    scores, W and U0), or, fused, nothing beyond the final-state buffer (counted as output)."""
    if variant.fuse_prepare:
        return 0
    rows = batch * spec.heads * seq_len
    if variant.wy and spec.features.delta_rule:  # P, and W [T, K] (input type) + U0 [T, V] (fp32)
        return rows * (variant.chunk_size * 4 + spec.key_dim * DTYPE_BYTES[spec.input_dtype] + spec.value_width * 4)
    return rows * variant.chunk_size * 4 * (2 if spec.features.delta_rule else 1)


def _solve_rows(variant: ChunkVariant) -> float:
    """Serial steps of the fused solve, in forward-substitution rows. The blocked solve's
    C x C dots (2 log2(C / 16)) are counted as one row each: a guess, not yet measured."""
    if variant.solve != "blocks":
        return variant.chunk_size
    return SOLVE_BLOCK - 1 + 2 * math.log2(variant.chunk_size // SOLVE_BLOCK)


def chunk_cost(spec: ModelSpec, target: Target, batch: int, seq_len: int, variant: ChunkVariant,
               cal: Calibration = Calibration()) -> Cost:
    shape = shape_of(spec)
    C = variant.chunk_size
    n_chunks = math.ceil(seq_len / C)
    fig = chunk_figures(spec, C)
    flops = fig.flops_per_token * batch * seq_len
    resident = variant.resident(shape)
    state = spec.state_bytes_per_layer * batch
    state_traffic = 2 * state if resident else 3 * state * n_chunks
    work = chunk_workspace_bytes(spec, batch, seq_len, variant)
    nbytes = _io_bytes_per_token(spec) * batch * seq_len + state_traffic + 2 * work
    programs = batch * spec.heads * math.ceil(spec.value_width / variant.block_v)
    fill = min(1.0, programs / target.sms)
    tiles = 0 if resident else 2 * math.ceil(shape.key_dim / variant.block_k)
    per_iter = CHUNK_ITER_S + tiles * CHUNK_TILE_S * (C * variant.block_k) / (64 * 128)
    if variant.fuse_prepare:
        per_iter += _solve_rows(variant) * FUSED_ROW_S
    latency = _waves(programs, target) * n_chunks * per_iter * cal.chunk
    seconds, bound = _pick(nbytes / (target.hbm_bytes_per_s * fill), flops / (_rate(spec, target) * fill), latency)
    launches = 1 if variant.fuse_prepare else 2
    return Cost(seconds + launches * target.launch_s, nbytes, flops, programs, bound)


def recurrent_cost(spec: ModelSpec, target: Target, batch: int, seq_len: int, variant: RecurrentVariant,
                   cal: Calibration = Calibration(), state_dtype: str | None = None) -> Cost:
    """The fused recurrent kernel over ``seq_len`` tokens (decode: seq_len = 1), with the state
    stored as ``state_dtype`` (default: the spec's; fp32 for "auto")."""
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
    latency = _waves(programs, target) * seq_len * (SCAN_STEP_S + tiles * SCAN_TILE_S) * cal.recurrent
    memory = nbytes / (target.hbm_bytes_per_s * DECODE_BW_EFFICIENCY * fill)
    seconds, bound = _pick(memory, flops / (target.fp32_flops * fill), latency)
    return Cost(seconds + target.launch_s, nbytes, flops, programs, bound)


def calibrate(predicted: dict[str, list[float]], measured: dict[str, list[float]]) -> Calibration:
    """Scale factors (geometric mean of measured / predicted per kernel) from matched pairs."""
    def factor(k: str) -> float:
        pairs = [(m, p) for m, p in zip(measured.get(k, []), predicted.get(k, [])) if m > 0 and p > 0]
        if not pairs:
            return 1.0
        return math.exp(sum(math.log(m / p) for m, p in pairs) / len(pairs))

    return Calibration(chunk=factor("chunk"), recurrent=factor("recurrent"))


def with_measured(cost: Cost, seconds: float) -> Cost:
    return replace(cost, seconds=seconds, source="measured (tuned)")
