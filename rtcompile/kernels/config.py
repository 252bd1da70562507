"""What every kernel config shares: the shape it is checked against, the workload it is costed
on, the figures it hands the cost model, and the resource bounds of its checks.

A config is a small frozen dataclass, one class per kernel form (``forms.py`` lists them), and
the union of those classes is the tagged union the launchers, the tuner and the planner pass
around: ``to_dict`` writes the tag (``form``) beside the fields, ``forms.config_from_dict``
reads it back. A config owns its validity check (:meth:`KernelConfig.check`: the reason it
cannot run a shape, naming the field and the value it needs, or None), its search space, its
workspace bytes and its cost figures, so none of that lives anywhere else.

Nothing here imports torch or Triton.
"""

from __future__ import annotations

import functools
import math
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, ClassVar

DOT_PRECISIONS = ("ieee", "tf32x3", "tf32")
SOLVES = ("rows", "tiles", "products")
PREPARE_WARPS = (1, 2, 4, 8, 16)
# Registers: 64K 32-bit registers per SM on every NVIDIA GPU since Volta; a program may use at
# most 255 per thread. Recurrent configs are refused above it (badly shaped decode tiles that
# spilled ran 2-3x slower on the H200).
MAX_REGS_PER_THREAD = 255
# At most 1024 threads a block on every CUDA GPU: a config of 64 warps passed its check and
# then failed to launch on the H100 ("out of resource: threads, Required: 2048").
MAX_WARPS = 32
# The chunk kernels' estimate (live fp32 tile elements per thread + 32) is a ranking, not a
# count: ptxas caps at 255 and spills. On the H200 (48 o3 16x16 configs, B8 T4096 H2) the
# fastest had an estimate of 392 (2 spilled registers) and all four estimated at 400 or more
# spilled 86-372 registers and ran 1.15-2.7x slower than the default: refuse above 392 only.
CHUNK_MAX_EST_REGS = 392
# Shared memory per block (opt-in): H100/H200 227 KiB, A100 163 KiB, L4/L40S/4090 99 KiB. The
# smallest is the portable bound when the caller does not name the device's.
DEFAULT_SMEM_BYTES = 99 * 1024


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1); ``triton.next_power_of_2`` without
    importing Triton, so the planner and the CLI stay light."""
    return 1 << max(0, (n - 1).bit_length())


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def dot_operand_bytes(input_bytes: int) -> int:
    """Bytes per element of the products' operands and of the workspaces kept in their type:
    16-bit inputs keep their own type, anything else is multiplied in fp32."""
    return input_bytes if input_bytes == 2 else 4


@dataclass(frozen=True)
class KernelShape:
    """What a config's validity depends on: key widths, value width, input element size."""

    key_widths: tuple[int, ...]
    value_width: int
    input_bytes: int = 2

    @property
    def key_dim(self) -> int:
        return math.prod(self.key_widths)

    @property
    def key_dim_pow2(self) -> int:
        """K rounded up to a power of two, at least 16 (tl.dot's smallest operand side)."""
        return max(16, next_pow2(self.key_dim))

    @property
    def value_dim_pow2(self) -> int:
        """d_v rounded up to a power of two, at least 16: the widest useful value tile."""
        return max(16, next_pow2(self.value_width))

    @property
    def whole_factor_tiles(self) -> bool:
        """Is every key factor exactly one [C, d_i] tile (a power of two >= 16)? Then kernels
        load each factor whole and build phi as the outer product of the tiles."""
        return all(w >= 16 and is_pow2(w) for w in self.key_widths)

    def outer_phi_ok(self, block_k: int) -> bool:
        """Can key tiles of ``block_k`` be built as outer products of factor loads? Needs
        power-of-two widths and ``block_k`` a multiple of the trailing widths' product."""
        return all(is_pow2(w) for w in self.key_widths) and block_k % math.prod(self.key_widths[1:]) == 0


@dataclass(frozen=True)
class Workload:
    """One call's size beyond the shape: what workspace bytes and cost figures depend on."""

    shape: KernelShape
    batch: int  # sequences
    heads: int
    seq_len: int  # tokens per sequence (1 for a decode step)
    delta_rule: bool = True
    forget_gate: bool = True

    @property
    def rows(self) -> int:
        """Token-head rows: the first dimension of every [B, H, T, .] workspace."""
        return self.batch * self.heads * self.seq_len

    @property
    def state_bytes(self) -> int:
        """The fp32 state of every sequence and head."""
        return self.batch * self.heads * self.shape.key_dim * self.shape.value_width * 4


@dataclass(frozen=True)
class CostFigures:
    """What one call of a config does, independent of the GPU; the cost model turns these into
    seconds with a target's rates (``costmodel.py``).

    ``programs``: programs of the sequential kernel (their count against the SMs sets how full
    the GPU is and how many waves run). ``serial_steps``: steps each sequential program takes in
    order (chunks, or tokens for the scan). ``state_passes``: how many times the whole state
    crosses HBM per call (a read or a write each; the cost model multiplies by the state's bytes
    in its dtype).
    ``workspace_bytes``: written once and read once. ``tile_visits``: streamed state-tile visits
    per serial step (0 with the state in registers), each of ``tile_elements`` (C x block_k for
    a chunk, block_k for a scan step). ``solve_rows``: serial forward-substitution rows per step
    inside the sequential kernel (the fused form). ``launches``: kernels per call.
    ``loop_elements``: > 0 for a sequential kernel that carries only the state, apart from
    chunk-parallel kernels that move the call's bytes (the split form): the C x K elements its
    step multiplies, which its step latency grows with; the cost model then adds the loop's
    time to the bytes' instead of taking the larger. ``chip_elements``: > 0 for a sequential
    kernel that keeps the state on chip and forms phi itself each step, one program an SM (the
    streamed form's Gluon kernel): the C x K elements of its step; its time is added to the bytes'.
    ``host_loop``: no sequential kernel, the chunks launched in order from the host, each launch
    chunk-parallel (the streamed form's "stepped" loop): bytes or FLOPs plus the launches.
    """

    programs: int
    serial_steps: int
    state_passes: float
    workspace_bytes: int
    tile_visits: int = 0
    tile_elements: int = 0
    solve_rows: float = 0.0
    launches: int = 1
    loop_elements: int = 0
    chip_elements: int = 0
    host_loop: bool = False


# The config fields' annotated types (strings: postponed annotations) and their JSON checks
_FIELD_TYPES = {
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "int | None": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
}


@dataclass(frozen=True)
class KernelConfig:
    """Base of every config. Subclasses set ``kernel`` (the tuned-table key: "chunk" or
    "recurrent") and ``form`` (the tag), and implement :meth:`check`, :meth:`space`,
    :meth:`workspace_bytes` and :meth:`figures`.

    Invariants: a config is immutable and hashable; ``from_dict(to_dict())`` is the identity;
    ``check`` never raises for a well-typed config (it returns the reason instead); every
    config that ``space`` enumerates has only values from that space.
    """

    kernel: ClassVar[str]
    form: ClassVar[str]

    def check(self, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> str | None:
        raise NotImplementedError

    @classmethod
    def space(cls, shape: KernelShape) -> dict[str, list]:
        """Every tunable field with the values worth trying at ``shape``; empty when this form
        cannot run the shape at all."""
        raise NotImplementedError

    def workspace_bytes(self, w: Workload) -> int:
        """Device memory a call allocates beyond its inputs, outputs and final state."""
        raise NotImplementedError

    def figures(self, w: Workload) -> CostFigures:
        raise NotImplementedError

    def resident(self, shape: KernelShape) -> bool:
        """Does the whole [K, block_v] state tile stay in registers across steps?"""
        raise NotImplementedError

    def canonical(self) -> "KernelConfig":
        """This config with every field that its other fields make inert at the class default:
        two configs with equal canonical forms compute the same thing in the same kernels, so
        the tuner measures one of them. Invariant: ``c.canonical().canonical() ==
        c.canonical()``, and ``check`` passes for it wherever it passes for ``c``."""
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"form": self.form, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "KernelConfig":
        data = dict(data)
        tag = data.pop("form", cls.form)
        if tag != cls.form:
            raise ValueError(f"form: {tag!r} is not {cls.__name__}'s ({cls.form!r})")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {unknown}; allowed: {sorted(names)}")
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.default is MISSING)
        if missing:
            raise ValueError(f"{cls.__name__}: missing fields {missing}")
        return cls(**data)

    def __post_init__(self):
        # every field of its annotated type, however the config was made (JSON gives any type,
        # and a constructor call too: wy="no" was a truthy flag, a 2.0 tile passed unseen)
        for f in fields(self):
            value = getattr(self, f.name)
            want = _FIELD_TYPES.get(f.type)
            if want is not None and not want(value):
                raise TypeError(f"{type(self).__name__}.{f.name}: expected {f.type}, got {type(value).__name__} "
                                f"{value!r}")

    def _check_choice(self, name: str, allowed) -> str | None:
        """The refusal for field ``name`` when its value is not one of ``allowed``."""
        value = getattr(self, name)
        if value not in allowed:
            return f"{name}={value!r}; allowed: {', '.join(map(repr, allowed))}"
        return None

    def _check_pow2(self, *names: str) -> str | None:
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not is_pow2(value):
                return f"{name}={value!r}; allowed: a power of two"
        return None


def warps_refusal(num_warps: int, name: str = "num_warps") -> str | None:
    """The refusal of a power-of-two warp count beyond the hardware's block (MAX_WARPS)."""
    if num_warps > MAX_WARPS:
        return f"{name}={num_warps}; allowed: a power of two up to {MAX_WARPS} (1024 threads a block)"
    return None


def estimate_registers(live_elements: int, num_warps: int) -> int:
    """Registers per thread for ``live_elements`` fp32 values live at once in a program of
    ``num_warps`` warps, plus 32 for addresses and scalars: a ranking for refusals, not a count."""
    return 32 + math.ceil(live_elements / (32 * num_warps))


@functools.lru_cache(maxsize=4096)
def checked(config: "KernelConfig", shape: KernelShape, limit: int | None) -> str | None:
    """``config.check(shape, limit)`` (``limit`` None: the check's portable default), cached:
    every eager call resolves its configs, and a check is a pure function of its arguments
    (default_backward's 5-10 checks took ~45 us a call on the CPU machine)."""
    return config.check(shape) if limit is None else config.check(shape, limit)


CHUNK_SIZES = (16, 32, 64, 128)  # what chunk_refusal lets through, before each form's own limits


def chunk_refusal(cfg, shape: KernelShape) -> str | None:
    """The rules every chunk form shares: power-of-two tiles, 16 <= C <= 128 (tl.dot needs
    16 on every side; the solve is O(C^3)), a value tile no wider than d_v rounded up, a known
    solve and precision, the product solve only up to C = 64 (at C = 128 Triton 3.6's LLVM
    lowering of o3 64x64's prepare kernel at 8 prepare warps had not finished after 500 s on an
    H100, where pip's Triton 3.6.0 compiles it offline in 14 s; the tile solve takes C = 128 as
    two halves), the tile solve's unrolling only with it, and the prepare kernel's warps."""
    if (reason := cfg._check_pow2("chunk_size", "block_v", "num_warps")) is not None:
        return reason
    if (reason := warps_refusal(cfg.num_warps)) is not None:
        return reason
    if cfg.chunk_size not in CHUNK_SIZES:
        return f"chunk_size={cfg.chunk_size}; allowed: {', '.join(map(str, CHUNK_SIZES))}"
    if not 16 <= cfg.block_v <= shape.value_dim_pow2:
        return f"block_v={cfg.block_v}; allowed: 16 .. {shape.value_dim_pow2} (d_v rounded up)"
    if isinstance(cfg.num_stages, bool) or not isinstance(cfg.num_stages, int) or not 1 <= cfg.num_stages <= 4:
        return f"num_stages={cfg.num_stages!r}; allowed: 1, 2, 3 or 4"
    if (reason := cfg._check_choice("solve", SOLVES)) is not None:
        return reason
    if cfg.solve == "products" and cfg.chunk_size > 64:
        return f"solve='products' needs chunk_size <= 64, got {cfg.chunk_size} (or solve='tiles' or 'rows')"
    if getattr(cfg, "unroll_solve", False) and cfg.solve != "tiles":
        return f"unroll_solve=True unrolls the tile solve; allowed with solve='tiles' (got {cfg.solve!r}), or False"
    if hasattr(cfg, "dot_precision") and (reason := cfg._check_choice("dot_precision", DOT_PRECISIONS)):
        return reason
    if hasattr(cfg, "prepare_warps") and (reason := cfg._check_choice("prepare_warps", PREPARE_WARPS)):
        return reason
    return None


def resource_refusal(cfg, shape: KernelShape, smem_limit: int, hint: str = "",
                     max_regs: int = CHUNK_MAX_EST_REGS) -> str | None:
    """The refusal of a chunk config whose estimated registers (the ranking bound ``max_regs``,
    the sequential kernels' CHUNK_MAX_EST_REGS unless the form's estimate has its own) or shared
    memory (``smem_limit``) do not fit; ``hint`` says what to do."""
    if (regs := cfg.estimate_registers(shape)) > max_regs:
        return f"~{regs} registers per thread estimated (> {max_regs}){hint}"
    if (smem := cfg.estimate_smem(shape)) > smem_limit:
        return f"~{smem} bytes of shared memory (> {smem_limit})"
    return None


def chunk_smem_estimate(chunk_size: int, block_k: int, block_v: int, num_stages: int) -> int:
    """Shared memory of a sequential chunk kernel: tl.dot stages its operands and layout changes
    there. Fitted to what Triton 3.6 asked for on an H200: (C 64, BK 128, BV 32, 2 stages) needed
    245760 bytes and failed; (C 32, BK 256, BV 16, 2), (C 64, BK 64, BV 16, 2), (C 64, BK 256,
    BV 16, 1) and (C 64, BK 256, BV 32, 1) ran, hence the 0.2-stage margin. A pruning heuristic:
    the tuner's compile is the final word."""
    C, bk, bv = chunk_size, block_k, block_v
    tiles = 2 * C * bk + bk * bv + C * C + C * bv
    return int(4 * tiles * (max(1, num_stages) + 0.2))


def chunk_live_elements(shape: KernelShape, chunk_size: int, block_k: int, block_v: int) -> int:
    """fp32 values a sequential chunk program holds at once: the state tile, phi(K) and phi(Q)
    blocks, the C x C scores and inverse, and C x block_v values, updates and outputs."""
    C, bk, bv = chunk_size, block_k, block_v
    return bk * bv + 2 * C * bk + 2 * C * C + 3 * C * bv


def streamed_live_elements(shape: KernelShape, cfg) -> int:
    """:func:`chunk_live_elements` of a sequential program over a state tile of ``cfg.block_k``
    rows, plus the next state tile (``prefetch_state``) and the next chunk's two products carried
    through the update pass (``merge_passes``)."""
    live = chunk_live_elements(shape, cfg.chunk_size, cfg.block_k, cfg.block_v)
    if cfg.prefetch_state:
        live += cfg.block_k * cfg.block_v
    if cfg.merge_passes:
        live += 2 * cfg.chunk_size * cfg.block_v
    return live


def stores_inverse(delta_rule: bool, wy: bool, solve: str) -> bool:
    """Whether the prepare kernel keeps the [B, H, T, C] fp32 inverse: with the delta rule, unless
    ``wy`` applies it there, where the tile solve still needs it (it inverts in place)."""
    return delta_rule and (not wy or solve == "tiles")


def wy_workspace(w: Workload) -> int:
    """W [T, K] in the products' type and U0 [T, V] fp32 per token-head (the WY products)."""
    return w.rows * (w.shape.key_dim * dot_operand_bytes(w.shape.input_bytes) + w.shape.value_width * 4)


def two_kernel_workspace(cfg, w: Workload, wy: bool = False, scores: bool = True) -> int:
    """The prepare kernel's [B, H, T, C] fp32 scores (not with ``scores`` False: the sequential
    kernel forms them) and (delta rule) inverse; with ``wy`` the scores, W and U0
    (:func:`wy_workspace`) instead of the inverse (plus the inverse again for the tile solve,
    which inverts in place in the workspace)."""
    C = cfg.chunk_size
    inverse = w.rows * C * 4 if stores_inverse(w.delta_rule, wy, cfg.solve) else 0
    return (w.rows * C * 4 if scores else 0) + inverse + (wy_workspace(w) if wy and w.delta_rule else 0)


def chunk_programs(w: Workload, block_v: int) -> int:
    return w.batch * w.heads * math.ceil(w.shape.value_width / block_v)


def chunk_count(w: Workload, chunk_size: int) -> int:
    return math.ceil(w.seq_len / chunk_size)
