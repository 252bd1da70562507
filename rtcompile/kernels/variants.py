"""Kernel variants: every tunable parameter of every kernel, and the constraints between them.

The tuner searches exactly these spaces, and the launchers take a variant as data: no tuning
constant lives in a launcher. A variant is a frozen dataclass; ``check`` returns the reason a
variant cannot run a shape (``None`` when it can), from estimates of registers and shared
memory, before anything is compiled.

Shapes are described by :class:`KernelShape` (what the variant's validity depends on).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, ClassVar, Iterator

DOT_PRECISIONS = ("ieee", "tf32x3", "tf32")
SOLVES = ("rows", "blocks", "diagonal", "tiles")
SOLVE_BLOCK = 16  # the default rows per diagonal block of the blocked solve (ChunkVariant.solve_block)
SOLVE_BLOCKS = (4, 8, 16)
PREPARE_WARPS = (1, 2, 4, 8, 16)
SEGMENTS = (1, 2, 4, 8)  # time segments of the three-kernel form (output_pass)
OUTPUT_BLOCK_VS = (16, 32, 64)  # the three-kernel form's output value tiles
STATE_STRIDES = (1, 2, 4)  # chunks per state the three-kernel form's state loop stores
KEY_GROUPS = (1, 2, 4)  # indices of axis 1 per store of the prepare kernel's phi(K) (8: 0.25 ms, twice 2's)
# Registers: 64K 32-bit registers per SM on every NVIDIA GPU since Volta; a program of W warps
# may use at most 255 per thread. We budget the live fp32 tiles of a program against
# 255 * 32 * W and refuse variants over it (they would spill to local memory: DESIGN.md saw
# 2-3x slowdowns for badly shaped decode tiles).
MAX_REGS_PER_THREAD = 255
# The chunk kernel's estimate (live fp32 tile elements per thread + 32) is a ranking, not a
# count: ptxas caps at 255 and spills. On the H200 probe of 2026-11-30 (48 o3 16x16 variants,
# B8 T4096 H2, benchmarks/results/2026-11-30_h200/probe_registers.json) the fastest variant
# had an estimate of 392 (C32, block_v 16, 4 warps, prefetch + wy: 2 spills, 0.354 ms against
# 0.596 for the then default) and all four estimated at 400 or more spilled 86-372 registers
# and ran 1.15-2.7x slower than the default. So chunk variants are refused above 392 only;
# between 255 and 392 the tuner's timing decides.
CHUNK_MAX_EST_REGS = 392
# Shared memory per block (opt-in) on H100/H200 is 227 KiB, on A100 163 KiB, on L4/L40S/4090
# 99 KiB: the smallest is the portable bound when the caller does not name the device's.
DEFAULT_SMEM_BYTES = 99 * 1024


def outer_phi_ok(widths: tuple[int, ...], block_k: int) -> bool:
    """Can a kernel build phi's key tiles of ``block_k`` as outer products of factor loads? Needs
    power-of-two widths and ``block_k`` a multiple of the trailing widths' product (a tile then
    covers consecutive indices of axis 1 and all of the others)."""
    trailing = math.prod(widths[1:])
    return all(w & (w - 1) == 0 for w in widths) and block_k % trailing == 0


def whole_factor_tiles(widths: tuple[int, ...]) -> bool:
    """Is every factor exactly one [C, D_i] tile (a power of two >= 16, tl.dot's minimum)? Then
    a kernel loads each factor whole and builds phi as the outer product of the tiles
    (prefetch with a state in registers, the three-kernel form's state loop)."""
    return all(w >= 16 and w & (w - 1) == 0 for w in widths)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dot_operand_bytes(input_bytes: int) -> int:
    """Bytes per element of the kernels' product operands and of the workspaces kept in their
    type: 16-bit inputs keep their own type, anything else is multiplied in fp32 (the launcher's
    ``_dot_dtype`` picks the same type from the tensors)."""
    return input_bytes if input_bytes == 2 else 4


@dataclass(frozen=True)
class KernelShape:
    """What a variant's validity depends on: widths, value width and the input element size."""

    key_widths: tuple[int, ...]
    value_width: int
    input_bytes: int = 2

    @property
    def key_dim(self) -> int:
        return math.prod(self.key_widths)

    @property
    def key_dim_pow2(self) -> int:
        return next_pow2(self.key_dim)


@dataclass(frozen=True)
class _Variant:
    kernel: ClassVar[str]
    # parameter -> (gate, value): the parameter matters only when the gate has that value
    GATED: ClassVar[dict[str, tuple[str, Any]]] = {}

    def gate_refusal(self) -> str | None:
        """Why this variant is refused by ``GATED``, or None: the first parameter (in ``GATED``'s
        order) set away from its default while its gate lacks the value it needs. ``check``
        asks this, so the refusals and the sampler's gating (``gated_params``) come from the same
        data and cannot disagree."""
        defaults = {f.name: f.default for f in fields(self)}
        for name, (gate, need) in self.GATED.items():
            value = getattr(self, name)
            if value != defaults[name] and getattr(self, gate) != need:
                return (f"{name}={value!r} needs {gate}={need!r} (without it, {name} must stay at its default "
                        f"{defaults[name]!r})")
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "_Variant":
        data = {k: v for k, v in data.items() if k != "kernel"}
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown parameters {sorted(unknown)}; allowed: {sorted(names)}")
        return cls(**data)


@dataclass(frozen=True)
class RecurrentVariant(_Variant):
    """The fused recurrent kernel (decode step and multi-token scan).

    ``block_k`` is the key tile: when it covers K (``block_k >= K``) the [K, block_v] state
    tile stays in registers for the whole sequence (one read, one write); otherwise the state
    is streamed in ``ceil(K / block_k)`` tiles twice per token (the second read usually hits
    L2). ``block_k`` and ``block_v`` are powers of two. ``outer_phi``: build phi(k) and phi(q)
    of a key tile as the outer product of contiguous factor loads instead of per-element
    gathers (power-of-two widths, ``block_k`` a multiple of the trailing widths' product).
    ``stream_hints``: load the resident slab evict-first and store it streaming (``.cs``), since
    nothing reads it again before the next step (needs ``block_k`` covering K). Off in stored
    variants that predate it.
    """

    kernel: ClassVar[str] = "recurrent"
    FIELDS: ClassVar[tuple[str, ...]] = ("block_k", "block_v", "num_warps", "num_stages", "outer_phi", "stream_hints")
    block_k: int
    block_v: int
    num_warps: int = 4
    num_stages: int = 1
    outer_phi: bool = False
    stream_hints: bool = False

    def check(self, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> str | None:
        for name in ("block_k", "block_v", "num_warps"):
            val = getattr(self, name)
            if val < 1 or val & (val - 1):
                return f"{name}={val} is not a power of two"
        if self.block_k > shape.key_dim_pow2:
            return f"block_k={self.block_k} exceeds K rounded up ({shape.key_dim_pow2})"
        if self.block_v > next_pow2(shape.value_width):
            return f"block_v={self.block_v} exceeds d_v rounded up ({next_pow2(shape.value_width)})"
        if self.outer_phi and not outer_phi_ok(shape.key_widths, self.block_k):
            return (f"outer_phi needs power-of-two key widths and block_k a multiple of the trailing widths' "
                    f"product, got widths {shape.key_widths}, block_k={self.block_k}")
        if self.stream_hints and self.block_k < shape.key_dim_pow2:
            return (f"stream_hints needs the state slab resident (block_k >= {shape.key_dim_pow2}), "
                    f"got block_k={self.block_k}")
        if self.estimate_registers(shape) > MAX_REGS_PER_THREAD:
            return f"~{self.estimate_registers(shape)} registers per thread (> {MAX_REGS_PER_THREAD})"
        return None

    def estimate_registers(self, shape: KernelShape) -> int:
        # live fp32 tiles: the state tile and one temporary of the same size, plus phi(k), phi(q)
        tile = self.block_k * self.block_v
        live = 2 * tile + 2 * self.block_k
        return 32 + math.ceil(live / (32 * self.num_warps))

    def estimate_smem(self, shape: KernelShape) -> int:
        return 0  # register-only: no tl.dot, no staged loads

    @classmethod
    def space(cls, shape: KernelShape) -> dict[str, list[int]]:
        kp = shape.key_dim_pow2
        return {
            "block_k": sorted({min(kp, b) for b in (32, 64, 128, 256, 512, 1024, kp)}),
            "block_v": [b for b in (4, 8, 16, 32, 64) if b <= next_pow2(shape.value_width)],
            "num_warps": [1, 2, 4, 8, 16],
            "num_stages": [1, 2, 3],
            "outer_phi": [False, True],
            "stream_hints": [False, True],
        }

    @classmethod
    def default(cls, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> "RecurrentVariant":
        # Measured on an H200 (benchmarks/RESULTS.md, probe of 2026-11-29): at K = 256 a
        # [256, 32] register tile with 4 warps moved 86% of the large-copy bandwidth at B256
        # and 92% of a same-size copy at B32 (block_v 16: 77% / 91%; block_v 8: 66%); at
        # K = 1024 B32 one [1024, 16] tile with 8 warps reached 74%, streaming 256-row tiles
        # 53-70%. Beyond K = 1024 the tile no longer fits registers: stream 1024-row tiles.
        # Gathered phi, not outer_phi: in the exhaustive sweeps of 2026-11-30c (H200, num_stages 1,
        # 180 and 230 variants) the best outer_phi variant was 8% behind at o3 16x16 B256
        # (80.6 against 74.5 us) and 5% at o3 32x32 B32 (46.2 against 43.9 us); the bench
        # timed the factored slab at 32x32 B32 at 61% of copy bandwidth against 70% gathered.
        # Stream hints on a resident slab (benchmarks/probe_decode.py, H200, 2026-11-30d): o3 16x16
        # B32 10.69 against 11.53 us (92% of a same-size copy against 85%), o3 32x32 B32 43.7
        # against 44.7 us; o3 16x16 B256 79.8 against 78.7 us (1.4% behind), so the small batches'
        # gain decides; a tuned bucket may turn them off.
        kp = shape.key_dim_pow2
        bv = min(32 if kp <= 256 else 16, next_pow2(shape.value_width))
        bk = min(kp, 1024)
        warps = 4 if bk * bv <= 8192 else 8
        return cls(block_k=bk, block_v=bv, num_warps=warps, num_stages=1, stream_hints=bk >= kp)

    @classmethod
    def candidates(cls, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> list["RecurrentVariant"]:
        """The variants a TPE study starts from: the default, and with stream_hints flipped when
        both forms can run (they split by batch on the H200: see :meth:`default`). outer_phi is
        not flipped here: it lost at every measured shape; TPE still reaches it."""
        first = cls.default(shape, smem_limit)
        other = replace(first, stream_hints=not first.stream_hints)
        return [first] + ([other] if other.check(shape, smem_limit) is None else [])


@dataclass(frozen=True)
class ChunkVariant(_Variant):
    """The chunk-parallel prefill kernels.

    ``chunk_size`` C: tokens per chunk (the C x C scores and the (I + A)^-1 solve);
    ``block_k``/``block_v``: the state tile; when ``block_k`` covers K the state stays in
    registers across chunks, otherwise it is streamed from the final-state buffer (read twice,
    written once per chunk: workspace independent of T). ``fuse_prepare``: compute the scores
    and the triangular inverse inside the sequential kernel (no [T, C] workspace) instead of in
    a separate chunk-parallel kernel. ``dot_precision``: how fp32 operands enter ``tl.dot``
    (16-bit inputs always use their own type). ``solve``: the (I + A)^-1 of the delta rule row
    by row (``"rows"``, C - 1 serial steps) or by diagonal blocks of ``solve_block`` rows and
    products (``"blocks"``/``"diagonal"``, solve_block - 1 steps and two C x C dots per doubling
    of the block count; needs 2 solve_block <= C <= 64). ``prefetch``: with the
    state in registers, load the next chunk's inputs (factor tiles, values, gates, prepared
    scores) before computing the current one, so their latency overlaps the arithmetic of the
    sequential loop (needs power-of-two key widths >= 16: each factor tile is then exactly one
    load and phi their outer product); with a streamed state, load the next state tile before
    using the current one. ``wy``: the delta rule's solve applied in the parallel
    prepare kernel (W = Ai diag(b Gamma) phi(K), U0 = Ai diag(b) V, stored [T, K] and [T, V]),
    so the sequential loop's chain is two products (W S, then the update) instead of three;
    needs the state in registers; its workspace grows with T * K. In the three-kernel form
    (``output_pass``) the state loop then reads W and U0 instead of the inverse and the values
    (o3 16x16 on the H200, 2026-11-30h: the loop no faster, 0.218 against 0.224 ms, the prepare
    kernel slower, 0.288 against 0.155: not in the defaults).
    ``solve="diagonal"``: the blocked solve with each diagonal block inverted on its own
    [solve_block, solve_block] tile (``"blocks"`` inverts them on [solve_block, C] row strips).
    ``solve="tiles"``: the prepare kernel stores A and inverts it in its workspace in [16, 16]
    tiles (diagonal blocks by forward substitution, the rest by block forward substitution), so
    no [C, C] solve tile lives in registers (C <= 64; with wy the inverse is read back for W and
    U0, and its [T, C] workspace comes on top of theirs); fused, each program does the same in a
    [C, C] scratch of its own (a workspace that does not grow with T).
    ``merge_passes``: with a streamed state, the update pass of chunk c also forms chunk c+1's
    products phi(K) S and phi(Q) S from each updated tile while it is in registers, so the state
    is read once per chunk instead of twice (needs ``block_k`` < K). ``prepare_warps``: warps of
    the separate prepare kernel (its programs are independent, so fewer warps each let more of
    them share an SM; must stay at its default 4 with ``fuse_prepare``, where there is no such
    kernel). ``solve_block``: rows per diagonal block of the blocked solve (4, 8 or 16; C /
    solve_block blocks, 2 to 16; must stay 16 with ``solve="rows"``). ``kron``: with a streamed
    state in tiles of exactly the trailing widths' product (one index i of axis 1 per tile), use
    phi_i = diag(x1[:, i]) T, T the trailing factors' outer product: T is built once per chunk
    and each tile's products take x1's column as a row scale (phi_i S = x1[:, i] * (T S),
    phi_i^T U = T^T (x1[:, i] * U)), so no phi block is formed per tile.
    ``output_pass``: three kernels instead of two: the sequential one carries only the state
    (its chain: phi(K) S, the solve, the update; the next chunk's loads issued ahead), storing
    each chunk's incoming state ([T / C, K, V] in the dot operand type) and U ([T, V]); a third
    kernel computes the scores and outputs of all chunks in parallel. Needs the state in
    registers, power-of-two key widths >= 16 and the separate prepare kernel. There
    ``prefetch`` loads the next chunk's inputs into registers ahead (else each chunk loads its
    own and num_stages > 1 lets the compiler pipeline them), and ``stored_keys`` has the
    prepare kernel write the normalised phi(K) ([T, K] in the dot type) for the state loop to
    read instead of building it from the factors. ``segments``: the three kernels run in that
    many time segments, the prepare and output launches on side streams, so the state loop of
    one segment (few busy SMs) can overlap the parallel kernels of its neighbours (not varlen;
    untimed when added, 2026-11-30g; on the H200 at o3 16x16, 2026-11-30h, 2 / 4 / 8 segments
    took 0.76 / 1.18 / 1.50 ms against 0.49 unsegmented: not in the defaults).
    ``output_block_v`` / ``output_warps``: the output kernel's value tile and warps (o3 16x16
    C 64 on the H200, 2026-11-30h: 0.084 ms with 64 columns and 4 warps, 0.102 with 64 and 2,
    0.135 with 32 and 4, 0.156 with 64 and 8). ``tma`` (with stored_keys, on sm_90 or newer):
    the state loop reads phi(K) and the inverse and stores each chunk's state through tensor
    descriptors. On the H200 (2026-11-30i, probe_split.py) the loop took 0.149 ms against
    0.164; with phi(K) built in the loop instead of stored, 0.24-0.35. (The offline sm_90
    compile once counted 3008 loop instructions and 1120 bytes of spills without tma, but it
    lacked the launch's alignment specialisation; compiled as launched, 2026-11-30j, the loop
    is 859 instructions without tma and 914 with it, neither spilling.)
    ``key_group`` (with stored_keys, order >= 3): the prepare kernel stores phi(K) that many
    indices of axis 1 at a time, a [C, key_group] load of x1 and one [C, key_group D2 D3]
    block per store (same day: the prepare kernel 0.122 ms with 2 or 4, 0.136 with 1, 0.25
    with 8; its phi(K) store alone 0.047 with 4 against about 0.14 with 1). ``state_stride``:
    the state loop stores the incoming state of every state_stride-th chunk only, and the output
    kernel adds the chunks between as cross-chunk scores (same day, o3 16x16: state loop 0.150 /
    0.136 / 0.124 ms and outputs 0.084 / 0.092 / 0.115 with 1 / 2 / 4; the bench 0.3502 ms with
    2 against 0.3505 with 1, and 289 against 353 MiB of workspace).
    """

    kernel: ClassVar[str] = "chunk"
    GATED: ClassVar[dict[str, tuple[str, Any]]] = {
        **{n: ("output_pass", True) for n in ("stored_keys", "segments", "output_block_v", "output_warps",
                                              "state_stride")},
        **{n: ("stored_keys", True) for n in ("tma", "key_group")}}
    FIELDS: ClassVar[tuple[str, ...]] = (
        "chunk_size", "block_k", "block_v", "num_warps", "num_stages", "fuse_prepare", "dot_precision", "solve",
        "prefetch", "wy", "merge_passes", "prepare_warps", "solve_block", "kron", "output_pass",
        "stored_keys", "segments", "output_block_v", "output_warps", "tma", "key_group", "state_stride",
    )
    chunk_size: int
    block_k: int
    block_v: int
    num_warps: int = 4
    num_stages: int = 2
    fuse_prepare: bool = False
    dot_precision: str = "ieee"
    solve: str = "rows"
    prefetch: bool = False
    wy: bool = False
    merge_passes: bool = False
    prepare_warps: int = 4
    solve_block: int = SOLVE_BLOCK
    kron: bool = False
    output_pass: bool = False
    stored_keys: bool = False
    segments: int = 1
    output_block_v: int = 16
    output_warps: int = 4
    tma: bool = False
    key_group: int = 1
    state_stride: int = 1

    def check(self, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> str | None:
        for name in ("chunk_size", "block_k", "block_v", "num_warps"):
            val = getattr(self, name)
            if val < 1 or val & (val - 1):
                return f"{name}={val} is not a power of two"
        if self.prepare_warps not in PREPARE_WARPS:
            return f"prepare_warps={self.prepare_warps}; allowed: {', '.join(map(str, PREPARE_WARPS))}"
        if self.solve_block not in SOLVE_BLOCKS:
            return f"solve_block={self.solve_block}; allowed: {', '.join(map(str, SOLVE_BLOCKS))}"
        if self.fuse_prepare and self.prepare_warps != 4:
            return (f"prepare_warps={self.prepare_warps} needs fuse_prepare=False (it sets the separate prepare "
                    "kernel; with fuse_prepare it must be 4, the default)")
        if self.solve == "rows" and self.solve_block != SOLVE_BLOCK:
            return (f"solve_block={self.solve_block} needs solve='blocks' or 'diagonal' (with solve='rows' it must be "
                    f"{SOLVE_BLOCK}, the default)")
        if not 16 <= self.chunk_size <= 128:
            return f"chunk_size={self.chunk_size} outside [16, 128] (tl.dot needs 16; the solve is O(C^3))"
        if self.block_k < 16 or self.block_v < 16:
            return "block_k and block_v must be >= 16 (tl.dot operand minimum)"
        if self.block_k > max(16, shape.key_dim_pow2):
            return f"block_k={self.block_k} exceeds K rounded up ({shape.key_dim_pow2})"
        if self.block_v > max(16, next_pow2(shape.value_width)):
            return f"block_v={self.block_v} exceeds d_v rounded up"
        if self.dot_precision not in DOT_PRECISIONS:
            return f"dot_precision={self.dot_precision!r}; allowed: {', '.join(DOT_PRECISIONS)}"
        if self.solve not in SOLVES:
            return f"solve={self.solve!r}; allowed: {', '.join(SOLVES)}"
        # C = 128 (8 blocks, [8, 16, 128] tiles): Triton 3.6's LLVM lowering had not finished
        # after 50 s on the H200 (2026-11-30), so the blocked solve stops at C = 64
        if self.solve == "tiles" and (self.solve_block != SOLVE_BLOCK or self.chunk_size > 64):
            return (f"solve='tiles' inverts in memory, in [16, 16] tiles: it needs solve_block={SOLVE_BLOCK} and "
                    f"chunk_size <= 64, got solve_block={self.solve_block}, chunk_size={self.chunk_size}")
        # fused with tf32 products: an illegal address on the H200 (o3 32x32, C 64, Triton 3.6,
        # 2026-11-30f); with ieee it ran and matched
        if self.solve == "tiles" and self.fuse_prepare and self.dot_precision != "ieee":
            return (f"solve='tiles' with fuse_prepare=True needs dot_precision='ieee', "
                    f"got {self.dot_precision!r}")
        if self.solve in ("blocks", "diagonal") and not (2 * self.solve_block <= self.chunk_size <= 64
                                           and self.chunk_size <= 16 * self.solve_block):
            return (f"solve={self.solve!r} needs chunk_size in [{2 * self.solve_block}, 64] and at most 16 blocks "
                    f"(blocks of solve_block={self.solve_block} rows; C = 128 did not compile)")
        if self.prefetch and self.resident(shape) and not whole_factor_tiles(shape.key_widths):
            return f"prefetch with the state in registers needs power-of-two key widths >= 16, got {shape.key_widths}"
        if self.output_pass and (self.fuse_prepare or not self.resident(shape)
                                 or not whole_factor_tiles(shape.key_widths)):
            return (f"output_pass needs the state in registers (block_k >= K = {shape.key_dim}), power-of-two key "
                    f"widths >= 16 (got {shape.key_widths}) and fuse_prepare=False")
        if self.segments not in SEGMENTS:
            return f"segments={self.segments}; allowed: {', '.join(map(str, SEGMENTS))}"
        if self.output_block_v not in OUTPUT_BLOCK_VS or self.output_block_v > max(16, next_pow2(shape.value_width)):
            return (f"output_block_v={self.output_block_v}; allowed: {', '.join(map(str, OUTPUT_BLOCK_VS))}, "
                    "at most d_v rounded up")
        if self.output_warps not in PREPARE_WARPS:
            return f"output_warps={self.output_warps}; allowed: {', '.join(map(str, PREPARE_WARPS))}"
        if self.state_stride not in STATE_STRIDES:
            return f"state_stride={self.state_stride}; allowed: {', '.join(map(str, STATE_STRIDES))}"
        if self.key_group not in KEY_GROUPS:
            return f"key_group={self.key_group}; allowed: {', '.join(map(str, KEY_GROUPS))}"
        # the three-kernel form's own parameters (segments, stored_keys, the output kernel's tile
        # and warps, state_stride) and the stored keys' (tma, key_group) without their gate
        if (refusal := self.gate_refusal()) is not None:
            return refusal
        dot_bytes = dot_operand_bytes(shape.input_bytes)
        if self.tma and (shape.key_dim * dot_bytes % 16 or shape.value_width * dot_bytes % 16):
            return (f"tma needs rows of 16-byte multiples (K = {shape.key_dim}, d_v = {shape.value_width} at "
                    f"{dot_bytes} bytes)")
        if self.state_stride > 1 and self.segments > 1:
            return f"state_stride={self.state_stride} needs segments=1 (got segments={self.segments})"
        if self.key_group > 1 and (len(shape.key_widths) < 2 or shape.key_widths[0] % self.key_group):
            return (f"key_group={self.key_group} needs order >= 3 and a first key width that it divides, got "
                    f"widths {shape.key_widths}")
        # with the next chunk's keys in registers (prefetch, C 64) the output was wrong, and with
        # one stage the kernel ended in an illegal address on the H200 (Triton 3.6, 2026-11-30g);
        # with 2 stages (the compiler pipelining the key loads) it matched
        if self.stored_keys and (self.prefetch or self.num_stages < 2):
            return (f"stored_keys needs prefetch=False and num_stages >= 2 (got prefetch={self.prefetch}, "
                    f"num_stages={self.num_stages})")
        if self.wy and self.fuse_prepare:
            return "wy applies the solve in the prepare kernel: it needs fuse_prepare=False"
        if self.wy and not self.resident(shape):
            return f"wy needs the state in registers: block_k >= K ({shape.key_dim})"
        if self.merge_passes and self.resident(shape):
            return f"merge_passes needs a streamed state: block_k < K ({shape.key_dim})"
        if self.kron and not self.kron_ok(shape):
            return (f"kron needs order 4 and a streamed state of power-of-two widths in tiles of exactly the "
                    f"trailing widths' product ({math.prod(shape.key_widths[1:])} rows), got widths "
                    f"{shape.key_widths}, block_k={self.block_k}")
        if self.estimate_registers(shape) > CHUNK_MAX_EST_REGS:
            return f"~{self.estimate_registers(shape)} registers per thread estimated (> {CHUNK_MAX_EST_REGS})"
        if self.estimate_smem(shape) > smem_limit:
            return f"~{self.estimate_smem(shape)} bytes of shared memory (> {smem_limit})"
        return None

    def kron_ok(self, shape: KernelShape) -> bool:
        """Can key tiles be one index of axis 1 each (see ``kron``)? Order 4 only: at order 3
        64x64 (64-row tiles, [64, 64] trailing tiles, bf16) the kernel ended in an illegal
        address on the H200 (Triton 3.6, 2026-11-30), with the update's tile transposed by
        tl.trans and with it loaded transposed; order 4 16x16x16 ran and matched."""
        trailing = math.prod(shape.key_widths[1:])
        return (len(shape.key_widths) >= 3 and self.block_k == trailing < shape.key_dim
                and outer_phi_ok(shape.key_widths, self.block_k))

    def resident(self, shape: KernelShape) -> bool:
        """True when the whole [K, block_v] state tile lives in registers across chunks."""
        return self.block_k >= shape.key_dim

    def fused(self, shape: KernelShape) -> "ChunkVariant":
        """The low-memory sibling for ``shape``: one kernel, no [T, C] workspace. Without wy (its
        solve lives in the separate prepare kernel). A state in registers drops prefetch (no
        gain fused: o2 64 on the H200, 2026-11-30, 3.09 ms with it against 3.00 without); a
        streamed state keeps it (there it reads the next state tile ahead)."""
        # no separate prepare kernel: its warps at the default. The fused Grams and solve stay
        # fp32 at ieee precision (see the launcher); the tile solve runs in a per-program scratch
        # (o3 32x32 on the H200, 2026-11-30f: 3.43 ms against 8.44 with the strip solve), the
        # diagonal form becomes the strip form verified fused on the H200
        # the three-kernel form's C = 64 and two stages, fused, were estimated at ~464 registers
        # (o3 16x16): its sibling is that of the two-kernel default before it (C = 16, one stage)
        base = replace(self, chunk_size=16, num_stages=1) if self.output_pass else self
        # the three-kernel form's own parameters back at their defaults (check refuses others)
        gated = {f.name: f.default for f in fields(self) if f.name in self.GATED}
        return replace(base, fuse_prepare=True, prefetch=self.prefetch and not self.resident(shape), wy=False,
                       output_pass=False, **gated,
                       prepare_warps=4, dot_precision="ieee",
                       solve="blocks" if self.solve == "diagonal" else self.solve)

    def estimate_registers(self, shape: KernelShape) -> int:
        C, bk, bv = self.chunk_size, self.block_k, self.block_v
        if self.output_pass:  # the state loop: state, phi(K), the inverse and the next one, values, U, S products
            live = bk * bv + C * bk + 2 * C * C + 4 * C * bv + 2 * C * sum(shape.key_widths)
            return 32 + math.ceil(live / (32 * self.num_warps))
        # fp32 tiles live at once: state tile, phi(K) and phi(Q) tiles, C x C scores and
        # inverse, C x block_v values/updates/outputs (x3)
        live = bk * bv + 2 * C * bk + 2 * C * C + 3 * C * bv
        if self.solve in ("blocks", "diagonal"):  # the blocked solve's A_d, E, X, N, Y tiles, C x C each
            live += 3 * C * C
        if self.prefetch and self.resident(shape):  # the next chunk's factor tiles, values, P and Ai
            live += 2 * C * sum(shape.key_widths) + C * bv + 2 * C * C
        elif self.prefetch:  # the next state tile
            live += bk * bv
        if self.wy:  # the W rows and U0 block (twice with prefetch: this chunk's and the next)
            live += (C * bk + C * bv) * (2 if self.prefetch else 1)
        if self.merge_passes and not self.resident(shape):  # the next chunk's two products, carried
            live += 2 * C * bv
        if self.kron and not self.resident(shape):  # three trailing tiles live through the tile loop
            live += C * bk  # (in place of the two phi blocks counted above)
        return 32 + math.ceil(live / (32 * self.num_warps))

    def estimate_smem(self, shape: KernelShape) -> int:
        # tl.dot stages operands and layout conversions through shared memory. Fitted to what
        # Triton 3.6 asked for on an H200: (C=64, BK=128, BV=32, 2 stages) needed 245760 bytes
        # and failed; (C=32, BK=256, BV=16, 2 stages), (C=64, BK=64, BV=16, 2 stages) and
        # (C=64, BK=256, BV=16, 1 stage) ran (the last, refused by the factor 1.5 used before
        # 2026-11-30c, was the fastest at o3 64x64 and o4 16x16x16 in probe_streamed.py);
        # on 2026-11-30d (C=64, BK=256, BV=32, 1 stage) ran too and was faster still, so the
        # margin went from 0.25 to 0.2 stages (the failing case stays refused: 234291 bytes).
        # A heuristic for pruning: the tuner's compile is the final word.
        C, bk, bv = self.chunk_size, self.block_k, self.block_v
        if self.output_pass:
            # the state loop: per stage the loads that feed products (Ai fp32, with stored_keys
            # phi(K)), plus the 16-bit state and U staged for the products. H200, o3 16x16 C 64
            # stored keys: with phi(K) loaded in both orientations 2 stages ran and 3 asked for
            # 258560 bytes (the same model with both: 270336); loaded once, 3 and 4 stages ran
            # (this: 172032 and 221184)
            keys = C * bk * shape.input_bytes if self.stored_keys else 4 * C * bk  # else phi staged
            # wy loads W ([C, K], 16-bit inputs: 16 bits) and U0 (fp32) in place of Ai: at 3 stages
            # (C 64, o3 16x16) Triton asked for 233984 bytes (this: 245760)
            solve = C * bk * shape.input_bytes + 4 * C * bv if self.wy else 4 * C * C
            return max(1, self.num_stages) * (keys + solve) + 2 * bk * bv + 4 * C * bv
        tiles = 2 * C * bk + bk * bv + C * C + C * bv
        return int(4 * tiles * (max(1, self.num_stages) + 0.2))

    @classmethod
    def space(cls, shape: KernelShape) -> dict[str, list]:
        kp = max(16, shape.key_dim_pow2)
        three = [False, True] if shape.key_dim <= 256 and whole_factor_tiles(shape.key_widths) else [False]
        return {
            "chunk_size": [16, 32, 64, 128],
            "block_k": sorted({min(kp, b) for b in (16, 32, 64, 128, 256, kp)}),
            "block_v": [b for b in (16, 32, 64) if b <= max(16, next_pow2(shape.value_width))],
            "num_warps": [2, 4, 8],
            "num_stages": [1, 2, 3],
            "fuse_prepare": [False, True],
            "dot_precision": list(DOT_PRECISIONS),
            "solve": list(SOLVES),
            "prefetch": [False, True],
            "wy": [False, True],
            # only a streamed state (block_k < K, block_k >= 16) can merge its passes
            "merge_passes": [False, True] if shape.key_dim > 16 else [False],
            "prepare_warps": list(PREPARE_WARPS),
            "solve_block": list(SOLVE_BLOCKS),
            "kron": [False, True] if len(shape.key_widths) >= 3 else [False],
            # only where check can pass (a state in registers: K <= 256 at the register bound,
            # power-of-two widths >= 16), so the space does not grow fourfold elsewhere
            "output_pass": three,
            "stored_keys": three,
            # segments lost at every count measured (2026-11-30h, see the class docstring): kept
            # for explicit use, out of the searched space
            "segments": [1],
            "output_block_v": [b for b in OUTPUT_BLOCK_VS if b <= max(16, next_pow2(shape.value_width))]
            if len(three) > 1 else [16],
            "output_warps": [2, 4, 8] if len(three) > 1 else [4],
            "tma": [False, True] if len(three) > 1 else [False],
            "key_group": [g for g in KEY_GROUPS if shape.key_widths[0] % g == 0]
            if len(three) > 1 and len(shape.key_widths) >= 2 else [1],
            "state_stride": list(STATE_STRIDES) if len(three) > 1 else [1],
        }

    @classmethod
    def default(cls, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> "ChunkVariant":
        """The first candidate, in order of preference, that passes :meth:`check`.

        Preferences from an H200 probe (B8 T4096 H8 V64 bf16, 2026-11-29): K <= 256 keeps
        the state in registers with C = 32 (16x16: 1.16 ms; C = 64 with 64-row tiles 7.2 ms);
        K = 1024 streams 128-row tiles with C = 32 (32x32: 3.8 ms, against 10.5 ms for
        C = 64 / 64 rows; 3.17 ms on 2026-11-30c, still ahead of every prefetch neighbour in
        probe_streamed.py); K >= 4096 streams 256-row tiles with C = 64, 8 warps, each tile's
        load issued one tile ahead (prefetch; probe_streamed.py, 2026-11-30c: 64x64 8.49 ms
        against 10.48 for the earlier C64 128-row default, o4 16x16x16 16.4 ms against 34.4 for
        the earlier C32 default). At 64x64 the 256-row tile is the gain: a 24-trial TPE study
        of the same run found 8.13 ms with the blocked solve and no prefetch, 8.48 with both.
        Once phi blocks were cast to the dot type before their reshape (2026-11-30d), 32-column
        value tiles took over at K >= 4096 (probe_streamed.py: 64x64 7.36 against 8.15 ms,
        o4 16x16x16 12.38 against 16.46; at 32x32 they lost, 4.9 against 3.0 ms): a phi block
        then feeds twice the columns; the blocked solve took 2% more (7.20 and 7.75 ms). Merging
        the update pass with the next chunk's products (merge_passes: the state read once per
        chunk), without prefetch, took 64x64 to 6.49 ms and o4 to 7.10 (prefetch on: 6.79, 7.32).
        At 32x32 the same probe put C = 64, 128-row tiles, 32 columns, 8 warps, prefetch and the
        blocked solve first: 2.50 against 3.03 ms for the C = 32 default before (merged: 2.62-2.69).
        The prepare kernel was then 1.35 ms of each C = 64 call (probe_split.py, 2026-11-30e): the
        blocked solve's diagonal blocks inverted on their own [16, 16] tiles (solve="diagonal")
        and, with 16-bit inputs, its fp32 products in tf32 took the bench (same run, B8 T4096
        H8 bf16) from 2.50 / 6.53 / 7.21 ms to 1.81 / 5.83 / 6.48 at 32x32 / 64x64 / o4
        16x16x16 (diagonal alone: 2.09 / 6.12 / 6.75). The diagonal form computes what the
        strip form does (relative RMS against float64 unchanged: bf16 4.5-5.2e-3, fp32 7.8e-7 to
        8.7e-7); tf32 alone left the bf16 errors unchanged and took fp32 inputs to 2.5e-3, so
        fp32 inputs keep ieee. The solve then moved into the prepare kernel's workspace, in
        [16, 16] tiles (solve="tiles", two prepare warps; probe_streamed.py, 2026-11-30f, same
        run): 32x32 1.32 against 1.82 ms, 64x64 5.26 against 5.70, o4 5.67 against 6.16 (the
        prepare kernel at 32x32: 0.14-0.16 against 0.64 ms); outputs within 3.4e-5 of the
        diagonal form's.
        Power-of-two widths build phi blocks as outer products when block_k covers the
        trailing axes, so block_k is at least their product.

        A state that fits registers (K <= 256, power-of-two widths >= 16) first issues the
        next chunk's loads ahead (prefetch), measured on the H200 on 2026-11-30 (B8 T4096 V64
        bf16; benchmarks/results/2026-11-30_h200): at o3 16x16 H8 the exhaustive sweep's
        re-measured best was C = 16, block_v = 32, prefetch: 0.77 ms against 1.19 for the plain
        C = 32 default, and applying the solve in the prepare kernel too (wy) did not help there
        (1.05 against 0.89 ms in the sweep's trials: W is as wide as phi(K)); at o2 64 H8 the
        bench timed prefetch + wy at 0.415 ms, prefetch alone 0.574, plain 0.731, so up to
        K = 64 both are on (wy's price: a W [T, K] and U0 [T, V] workspace, 128 MiB there).
        At order >= 3 with K = 256 the three-kernel form with stored keys leads where two
        stages fit the shared memory (o3 16x16 bench, 2026-11-30g: 0.476-0.479 ms against
        0.511-0.514 for the two-kernel default before it; 352 against 32 MiB of workspace).
        """
        found = cls.candidates(shape, smem_limit)
        return found[0] if found else cls(chunk_size=16, block_k=16, block_v=16, num_warps=4, num_stages=1)

    @classmethod
    def two_kernel(cls, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> ChunkVariant | None:
        """The first candidate that is not the three-kernel form, when the default is that form
        (its workspace is ~11x the two-kernel one's: o3 16x16 B8 T4096, 352 against 32 MiB);
        None where the default is a two-kernel variant already."""
        found = cls.candidates(shape, smem_limit)
        if not found or not found[0].output_pass:
            return None
        return next((v for v in found if not v.output_pass), None)

    @classmethod
    def candidates(cls, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> list["ChunkVariant"]:
        """The default's candidates that pass :meth:`check`, best first (see :meth:`default`);
        a TPE study starts from them. For 64 < K <= 256 the second is C = 32, block_v 16,
        prefetch + wy: the fastest where few programs run (H200, B8 T4096 V64 bf16: 0.354 ms
        at H2 in the 2026-11-30 register probe; 0.312 ms against 0.429 for the first candidate
        at B1 H8 in the sweep of 2026-11-30b), while at B8 H8 the first wins (0.610 against
        0.673 ms)."""
        kp = max(16, shape.key_dim_pow2)
        max_bv = max(16, next_pow2(shape.value_width))  # block_v never exceeds d_v rounded up
        trailing = next_pow2(math.prod(shape.key_widths[1:]))
        ahead = {"prefetch": True, "wy": kp <= 64}
        # the three-kernel form with stored keys, measured at order 3 16x16 only (H200, B8 T4096
        # H8 bf16, probe_streamed.py, 2026-11-30g: 0.480-0.483 ms against 0.511-0.534 for the
        # next candidate; at order 2 K = 128 it lost, 0.480 against 0.390). Three stages where
        # they fit, the output kernel on 64 columns with 4 warps (2026-11-30h: 0.415 against
        # 0.485 ms with 2 stages and the state loop's value tile and the prepare kernel's warps),
        # and one prepare warp now that phi(K) is stored in column blocks (probe_split.py, same
        # day: the prepare kernel 0.137 ms with 1, 0.155 with 2, 0.214 with 4)
        # (2026-11-30i, probe_split.py: the state loop through tensor descriptors 0.149 ms against
        # 0.164, where 16-byte rows allow them; phi(K) stored two indices of axis 1 at a time,
        # the prepare kernel 0.122 against 0.138)
        # The state stored at every 2nd chunk (same day: state loop 0.136 against 0.150, outputs
        # 0.092 against 0.084; every 4th: 0.124 and 0.115)
        three = {"output_pass": True, "stored_keys": True, "output_block_v": min(64, max_bv), "output_warps": 4,
                 "prepare_warps": 1, "key_group": 2, "state_stride": 2}
        if kp <= 64:
            prefs = [(32, kp, 16, 4, ahead), (16, kp, 16, 4, ahead)]
        elif kp <= 256:
            prefs = [(64, kp, 32, 4, {**three, "num_stages": n, "tma": t}) for t in (True, False) for n in (3, 2)] \
                if kp == 256 and len(shape.key_widths) >= 2 else []
            prefs += [(16, kp, 32, 4, ahead), (32, kp, 16, 4, {"prefetch": True, "wy": True}), (16, kp, 16, 4, ahead)]
        if kp <= 256:
            prefs += [(32, kp, 16, 4, {}), (16, kp, 16, 4, {}), (32, min(kp, 128), 16, 4, {})]
        else:
            bk = min(kp, max(128, trailing))
            # tf32 for the solve's fp32 products when the inputs are 16-bit (their own Grams are
            # 16-bit already): see default()
            precision = {"dot_precision": "tf32" if shape.input_bytes == 2 else "ieee"}
            big = {**precision, "merge_passes": True}
            mid = {"prefetch": True, **precision}
            prefs = [(64, max(bk, 256), 32, 8, big), (64, max(bk, 256), 16, 8, big)] if kp >= 4096 else \
                [(64, bk, 32, 8, mid)]
            prefs += [(64, bk, 16, 8, {}), (32, bk, 16, 4, {}), (16, bk, 16, 4, {})] if kp >= 4096 and bk <= 128 else \
                [(32, bk, 16, 4, {}), (16, bk, 16, 4, {})]
            prefs += [(32, 128, 16, 4, {}), (16, 64, 16, 4, {})]
        out = []
        for C, bk, bv, warps, extra in prefs + [(16, 16, 16, 4, {})]:
            # the solve in [16, 16] tiles in the prepare kernel's workspace, with that kernel's
            # warps (H200, B8 T4096 H8, probe_split.py, 2026-11-30f): one at C = 16 (o3 16x16:
            # 0.044 ms against 0.056 for the row solve), two at C = 32 and 64 (32x32 prefill
            # 1.32 ms with 2, 1.39 with 4, 1.63 with 8). wy takes it at C >= 32 with the
            # sequential kernel's warps, as measured (o2 64, C 32, probe_streamed.py, 2026-11-30g:
            # 0.378 ms against 0.426 with the row solve; 2 prepare warps 0.450); at C = 16 it
            # keeps the row solve (wy with tiles there unmeasured at the shapes it leads)
            wy = bool(extra.get("wy"))
            if not wy or C >= 32:
                extra = {"solve": "tiles", **extra}
            pw = 1 if C == 16 else warps if wy else 2 if extra.get("solve") == "tiles" else warps
            v = cls(chunk_size=C, block_k=bk, block_v=min(bv, max_bv), num_warps=warps,
                    **{"num_stages": 1, "prepare_warps": pw, **extra})
            if v.check(shape, smem_limit) is None and v not in out:
                out.append(v)
        return out


def gated_params(cls: type[_Variant], space: dict[str, list]) -> dict[str, tuple[str, Any]]:
    """The parameters of ``cls.GATED`` that ``space`` varies together with their gate: each
    matters only where its gate has the named value (``iter_space`` and the TPE study enumerate
    or ask for it only there). A gate that is gated itself comes first in ``cls.GATED``, so
    walking this dict in order always finds a parameter's gate already set."""
    return {n: gate for n, gate in cls.GATED.items() if n in space and gate[0] in space}


def iter_space(cls: type[_Variant], shape: KernelShape, space: dict[str, list] | None = None,
               smem_limit: int = DEFAULT_SMEM_BYTES) -> Iterator[_Variant]:
    """Every variant of ``space`` (default: ``cls.space(shape)``) that passes ``check`` at
    ``smem_limit``, in space order (gated parameters varying fastest). A parameter of
    ``cls.GATED`` keeps its default unless its gate has the named value: ``check`` would refuse
    the other combinations, and not enumerating them keeps the count near what it was before
    such parameters (o3 16x16: 15M combinations with stored_keys and segments, ~1.9M without)."""
    import itertools

    space = cls.space(shape) if space is None else space
    defaults = {f.name: f.default for f in fields(cls)}
    gated = gated_params(cls, space)
    free = [n for n in space if n not in gated]

    def expand(params: dict, rest: list[str]) -> Iterator[dict]:
        # a gated parameter ranges over its space only where its gate has the value it needs
        # (a gate may be gated itself: GATED lists it first)
        if not rest:
            yield params
            return
        n, (g, need) = rest[0], gated[rest[0]]
        for x in space[n] if params[g] == need else [x for x in space[n] if x == defaults[n]]:
            yield from expand({**params, n: x}, rest[1:])

    for values in itertools.product(*(space[n] for n in free)):
        for params in expand(dict(zip(free, values)), list(gated)):
            v = cls(**params)
            if v.check(shape, smem_limit) is None:
                yield v
