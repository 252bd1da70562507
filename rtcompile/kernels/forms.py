"""Every kernel form, how a config is read back from data, and the defaults.

A config is one of :data:`FORMS`' classes: the chunk-parallel prefill forms ``resident``,
``streamed``, ``fused`` and ``split``, the ``recurrent`` scan / decode step, and the chunk
``backward``. Tuned tables,
plans and the torch op carry a config as ``to_dict()`` (its fields and its ``form`` tag);
:func:`config_from_dict` reads it back.

The defaults are a table (:data:`CHUNK_DEFAULTS`, :data:`RECURRENT_DEFAULTS`): each row names
the shapes it is for, the configs it proposes in order of preference and, in one line, why,
with the H200 figure that chose it (B8 T4096 H8 d_v 64 bf16 unless it says otherwise). The
default for a shape is the first proposal that passes its own check on the device; a tuned
table overrides it per shape bucket.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from . import chunk_split_gluon
from .chunk_backward import BackwardConfig, default_backward
from .chunk_fused import FusedConfig
from .chunk_resident import ResidentConfig
from .chunk_split import SplitConfig
from .chunk_streamed import StreamedConfig
from .config import DEFAULT_SMEM_BYTES, KernelConfig, KernelShape, next_pow2
from .recurrent import RecurrentConfig

ChunkConfig = ResidentConfig | StreamedConfig | FusedConfig | SplitConfig
FORMS: dict[str, type[KernelConfig]] = {
    cls.form: cls for cls in (ResidentConfig, StreamedConfig, FusedConfig, SplitConfig, RecurrentConfig, BackwardConfig)
}
KERNELS: dict[str, tuple[type[KernelConfig], ...]] = {
    "chunk": (ResidentConfig, StreamedConfig, FusedConfig, SplitConfig),
    "recurrent": (RecurrentConfig,),
    "chunk_bwd": (BackwardConfig,),  # the backward (chunk_backward.py); its default: default_backward
}


def config_from_dict(data: dict[str, Any], kernel: str | None = None) -> KernelConfig:
    """The config ``data`` describes (``to_dict``'s output). ``kernel``: refuse a config of
    another kernel ("chunk" or "recurrent"). A dict in rtcompile 0.1's format (ChunkVariant /
    RecurrentVariant fields under a "kernel" key) is refused with a message saying so."""
    if not isinstance(data, dict):
        raise TypeError(f"config: expected a dict, got {type(data).__name__}")
    if "form" not in data:
        if "kernel" in data:
            raise ValueError(
                f"config: {data!r} is in rtcompile 0.1's variant format (a 'kernel' key, ChunkVariant / "
                f"RecurrentVariant fields); this version reads configs tagged with 'form' ({', '.join(FORMS)}): "
                "re-run `rtcompile tune` or `rtcompile plan` to write them anew")
        raise ValueError(f"config: no 'form' in {data!r}; allowed forms: {', '.join(FORMS)}")
    form = data["form"]
    if not isinstance(form, str) or form not in FORMS:  # an unhashable one is a TypeError in the lookup
        raise ValueError(f"config: form {form!r}; allowed: {', '.join(FORMS)}")
    cls = FORMS[form]
    if kernel is not None and cls.kernel != kernel:
        allowed = ", ".join(c.form for c in KERNELS[kernel])
        raise ValueError(f"config: form {form!r} is a {cls.kernel} config; allowed for the {kernel} kernel: {allowed}")
    return cls.from_dict(data)


def check_config(config: Any, kernel: str) -> KernelConfig:
    """``config`` itself when it is a config of ``kernel``; TypeError naming the allowed classes
    otherwise."""
    classes = KERNELS[kernel]
    if not isinstance(config, classes):
        names = ", ".join(c.__name__ for c in classes)
        raise TypeError(f"variant: expected one of {names}, got {type(config).__name__}")
    return config


# ----- defaults ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DefaultRow:
    """Configs proposed for the shapes ``when`` accepts, best first, and why (one line with the
    measured figure that chose them)."""

    when: Callable[[KernelShape], bool]
    propose: Callable[[KernelShape], list[KernelConfig]]
    reason: str


def _tiled(shape: KernelShape, C: int, block_k: int, block_v: int, warps: int, **fields) -> KernelConfig:
    """The resident config when ``block_k`` covers K, else the streamed one; the tile solve with
    one prepare warp at C = 16 and two above (o3 16x16 at C 16: 0.044 ms against 0.056 for the
    row solve; o3 32x32 at C 64: 1.32 ms with 2 prepare warps, 1.39 with 4, 1.63 with 8)."""
    fields = {"solve": "tiles", "prepare_warps": 1 if C == 16 else 2, **fields}
    bv = min(block_v, shape.value_dim_pow2)
    if block_k >= shape.key_dim:
        return ResidentConfig(chunk_size=C, block_v=bv, num_warps=warps, **fields)
    return StreamedConfig(chunk_size=C, block_k=block_k, block_v=bv, num_warps=warps, **fields)


def _stream_tile(shape: KernelShape) -> int:
    """The streamed key tile at K > 256: at least 128 rows, and all of the trailing axes so
    phi blocks are outer products of factor loads."""
    return min(shape.key_dim_pow2, max(128, next_pow2(math.prod(shape.key_widths[1:]))))


def _precision(shape: KernelShape) -> str:
    # tf32 for the solve's fp32 products with 16-bit inputs (their Grams are 16-bit already):
    # o3 32x32 / 64x64 / o4 1.81 / 5.83 / 6.48 ms against 2.09 / 6.12 / 6.75 with ieee, the bf16
    # errors unchanged; fp32 inputs keep ieee (tf32 took their error from 8e-7 to 2.5e-3)
    return "tf32" if shape.input_bytes == 2 else "ieee"


def _split(shape: KernelShape) -> list[KernelConfig]:
    # two pipelined parts: the prepare and output kernels of one part beside the loop of the
    # other (H200, B8 T4096, two runs, 2026-12-04): o3 16x16 0.349 / 0.348 ms against 0.354 / 0.354
    # in one part, o2 256 (C 32) 0.677 / 0.676 against 0.788 / 0.789; four parts lost at C 64
    # (o3 16x16 0.382, eight 0.452: the loop's three stages leave an SM no room for the others)
    vp = shape.value_dim_pow2
    return [SplitConfig(chunk_size=64, block_v=min(32, vp), num_stages=stages, prepare_warps=1,
                        output_block_v=min(64, vp), output_warps=4, tma=tma, key_group=2, state_stride=2,
                        pipeline=2)
            for tma in (True, False) for stages in (3, 2)]


def _split_phi_pass(shape: KernelShape) -> list[KernelConfig]:
    # phi(K) written token-major by the token-parallel phi kernel, the prepare kernel storing
    # none (o3 16x16, H200, compare_kron.py at 329e92d, two rounds: 0.3335 / 0.3324 ms against
    # 0.3508 / 0.3500; kernel time prepare 127.6 -> 84.0 us plus the phi kernel's 37.8; with two
    # prepare warps 0.368, in one part 0.354); the stored-phi(K) proposals after it. The solve's
    # fp32 products in tf32 with 16-bit inputs (_precision): 0.3186 / 0.3187 ms against 0.3319 /
    # 0.3321 with ieee (H200, compare_kron.py --phi-pass at 0bdb947, two rounds; outputs 5.7e-3 of
    # the largest from ieee's, both within bf16's tolerance of float64; the H100 tuner's pick first).
    # The tile solve's diagonal steps unrolled: 0.3506 ms against 0.3598 (H100, compare_kron --solve
    # at 6fe2f0a, two rounds; both float64-checked on the GPU first)
    proposals = _split(shape)
    return [*(dataclasses.replace(c, phi_pass=True, dot_precision=_precision(shape), unroll_solve=True).canonical()
              for c in proposals), *proposals]


# The split form's loop on the prepare kernel's WY products (U = U0 - W S: two products a chunk
# on its chain for three) with two prepare warps (one spills with W: 704 bytes at o3 16x16, sm_90).
# H200, B8 T4096, one process, two rounds, 2026-12-04: o2 64 0.272 ms against 0.279, o2 256 0.659
# against 0.680; no gain where the loop reads more a chunk than it saves: o3 16x16 0.490-0.581
# against 0.349 (the prepare kernel 0.21 -> 0.35 ms of kernel time, the loop unchanged), o3 8x8
# materialised 0.311 against 0.304, o3 16x8 0.495 against 0.443, o2 128 (split C 32) 0.401 / 0.385.
_SPLIT_WY = {"wy": True, "prepare_warps": 2}


# The split form with its state loop in Gluon (S^T a wgmma accumulator, no shared-memory round trip
# on the chain: chunk_split_gluon.py; sm_90 only: candidates() proposes it only there), C 32, per
# shape as measured on the H200 (B8 T4096, CUDA-graph replays, one process, 2026-12-04; the Triton
# default / fla beside): o2 64 0.260 ms (0.272 / 0.293), o2 128 0.310 (0.381 / 0.395), o2 256
# 0.532 (0.657 / 0.619), o3 8x8 0.279 (0.304 / 0.292), o3 16x8 0.401 (0.442 / 0.397); wy lost
# everywhere with it (o2 256 0.591). o3 16x16 keeps the Triton loop (0.378 at C 32 against 0.347).
# The solve's fp32 products in tf32 with 16-bit inputs (_precision), H100, compare_kron.py
# --small-k at c61325e, two rounds, every round faster: o2 64 0.2824 ms against 0.2858, o3 8x8
# 0.2851 / 0.2869, o2 128 0.3340 / 0.3380, o3 16x8 0.3637 / 0.3669, o2 256 0.6098 / 0.6190
# (outputs 2.9e-3 to 8.6e-3 of the largest from ieee's, all within bf16's tolerance of float64).
# o2 256 inverts in registers by products at 4 prepare warps (H100, compare_kron --solve, two runs:
# 0.5635 / 0.5645 ms against 0.6053 / 0.6043 with the tile solve at 2; the prepare kernel 176-182
# against 230-235 us); at the other shapes that solve ran 1.03-1.12x
_GLUON_SPLIT = {  # (materialised, K): the SplitConfig fields that differ per shape
    (False, 64): dict(pipeline=2, state_stride=1, prepare_warps=2, num_stages=3, solve="tiles"),
    (False, 128): dict(pipeline=4, state_stride=2, prepare_warps=2, num_stages=2, solve="tiles"),
    (False, 256): dict(pipeline=2, state_stride=1, prepare_warps=4, num_stages=3, solve="products"),
    (True, 64): dict(pipeline=4, state_stride=1, prepare_warps=1, num_stages=3, solve="tiles"),
    (True, 128): dict(pipeline=4, state_stride=4, prepare_warps=1, num_stages=3, solve="tiles"),
}


def _gluon_split(shape: KernelShape) -> list[KernelConfig]:
    """The Gluon-loop split config measured for ``shape`` (see _GLUON_SPLIT), or none."""
    mat = len(shape.key_widths) >= 2
    fields = _GLUON_SPLIT.get((mat, shape.key_dim))
    if fields is None:
        return []
    return [SplitConfig(chunk_size=32, block_v=64, num_warps=4, dot_precision=_precision(shape),
                        output_block_v=min(64, shape.value_dim_pow2), output_warps=4, tma=True, key_group=1,
                        materialise=mat, loop="gluon", **fields)]


def _gluon_streamed(shape: KernelShape) -> list[KernelConfig]:
    """The streamed form's Gluon kernel (state on chip, chunk_streamed_gluon.py) where it was
    measured faster: order 3 at K 512 and 1024, block_v 32 at 8 warps, the next chunk's factor
    tiles loaded ahead (**H100**, compare_kron --gluon-large, float64-checked on the GPU first, two
    rounds, the Triton kernel in the same process): o3 32x32 0.7747 ms against 1.2140 (0.8016
    without the loads ahead), o3 32x16 0.6368 against 0.8445 (0.6637); with phi(Q) S from
    registers since (1f66982) 0.7576 / 0.5714 against 1.2215 / 0.8494; block_v 16 at 8 warps
    1.11-1.30x the Triton kernel, at 4 warps (spills) 0.86-1.70x. At K 1024 without the loads
    ahead since (H100, compare_kron at 5a2e90b / 5f89585 / bb1a5ee: 0.7275 / 0.7281 / 0.7344 ms
    against 0.7607 / 0.7582 / 0.7587, the kernel 589-600 against 609-623 us); K 512 keeps them
    (without: 1.007 / 1.009x). At K 1024 the prepare kernel's tile solve unrolled (H100,
    compare_kron --solve at 6fe2f0a: 0.7284 ms against 0.7369, prepare 141.6 against 146.6 us;
    not measured at K 512). Its check refuses what it cannot run (32-bit inputs, other orders,
    phi [64, K] past shared memory at K 2048): the next proposals serve."""
    if shape.key_dim not in (512, 1024) or len(shape.key_widths) != 2:
        return []
    return [StreamedConfig(chunk_size=64, block_k=256, block_v=32, num_warps=8, prepare_warps=2,
                           dot_precision=_precision(shape), loop="gluon", prefetch_inputs=shape.key_dim == 512,
                           unroll_solve=shape.key_dim == 1024)]


def _split_small_k(shape: KernelShape, **fields) -> list[KernelConfig]:
    """The split form at K <= 128 (key groups of 1): chunks of 32 in four parts first, then the
    C 64 proposals. H200, B8 T4096 (2026-12-04): o2 64 0.280 / 0.281 ms (two runs) against 0.291
    for C 64 in two parts and 0.296 in one (fla 0.285); o3 8x8 materialised 0.303 / 0.303 against
    0.312 / 0.317 (fla 0.284); o3 16x8 materialised 0.439 against 0.479 for the resident C 16 (fla
    0.389, one run); o2 128 0.396, no gain on the resident C 16's 0.392 (not its default)."""
    c64 = [dataclasses.replace(c, key_group=1, **fields) for c in _split(shape)]
    return [dataclasses.replace(c, chunk_size=32, pipeline=4) for c in c64] + c64


def _split_any(shape: KernelShape) -> list[KernelConfig]:
    """The split form's proposals, then with key groups of 1, then chunks of 32 (o2 256: ~608
    registers per thread estimated at C 64): the first that passes its check runs."""
    proposals = _split(shape)
    return [*proposals, *(dataclasses.replace(c, key_group=1) for c in proposals),
            *(dataclasses.replace(c, key_group=1, chunk_size=32) for c in proposals)]


CHUNK_DEFAULTS: tuple[DefaultRow, ...] = (
    DefaultRow(lambda s: len(s.key_widths) >= 2 and s.key_dim_pow2 <= 128,
               lambda s: [*_gluon_split(s), *_materialised_proposals(s)],
               "order >= 3, K <= 128: on sm_90 the materialised split form with the Gluon loop (o3 8x8 0.262 ms, "
               "16x8 0.333; fla 0.292 / 0.396; H200, 2026-12-04; tf32 solve products since: 0.994 / 0.991x, "
               "H100); else phi(q), phi(k) materialised (one kernel) and "
               "order 2's defaults for that "
               "K on them: o3 8x8 0.316 ms against 0.500 factored, o3 16x8 0.476 against 0.593 (fla 0.285 / "
               "0.388; H200, bench --phase prefill, one run, 2026-12-02, 95f8c83); the split form in four "
               "pipelined parts of C 32 since 2026-12-04: o3 8x8 0.303, o3 16x8 0.439"),
    DefaultRow(lambda s: s.key_dim_pow2 == 256 and len(s.key_widths) == 1,
               lambda s: [*_gluon_split(s), *(dataclasses.replace(c, **_SPLIT_WY) for c in _split_any(s)),
                          *_split_any(s)],
               "o2 256: on sm_90 the split form with the Gluon loop, 0.535 ms (fla 0.619; H200, 2026-12-04; tf32 "
               "solve products since: 0.985x, H100); else "
               "the split form (chunks of 32, two pipelined parts), 0.676 ms against 0.788 in one part "
               "and 0.906 for the resident C 16 below, fla 0.611 (H200, 2026-12-04); with the solve in the "
               "prepare kernel (wy, two prepare warps) 0.659 against 0.680, fla 0.619 (two rounds, 2026-12-04)"),
    DefaultRow(lambda s: s.key_dim_pow2 == 64 and len(s.key_widths) == 1,
               lambda s: [*_gluon_split(s), *_split_small_k(s, **_SPLIT_WY), *_split_small_k(s)],
               "o2 64: on sm_90 the split form with the Gluon loop, 0.263 ms (fla 0.293; H200, 2026-12-04; tf32 "
               "solve products since: 0.988x, H100); else "
               "the split form (key groups of 1, C 32 in four pipelined parts), 0.280 ms against 0.296 "
               "in one part at C 64 and 0.343 for the resident C 32 + wy below, fla 0.285 (H200, 2026-12-04; "
               "o2 128: 0.606 at best in parts against 0.392 for the resident C 16); with the solve in the "
               "prepare kernel (wy, two prepare warps) 0.272 against 0.279, fla 0.293 (two rounds, 2026-12-04)"),
    DefaultRow(lambda s: s.key_dim_pow2 <= 64,
               lambda s: [ResidentConfig(chunk_size=32, block_v=16, prepare_warps=4, prefetch_inputs=True, wy=True),
                          ResidentConfig(chunk_size=16, block_v=16, prepare_warps=1, solve="rows",
                                         prefetch_inputs=True, wy=True)],
               "K <= 64: next chunk's inputs ahead + the solve applied in parallel (wy); o2 64: 0.378 ms "
               "with the tile solve, 0.426 rows, 0.574 without wy, 0.731 with neither"),
    DefaultRow(lambda s: s.key_dim_pow2 == 256 and len(s.key_widths) >= 2, _split_phi_pass,
               "o3 16x16: the split form, phi(K) from the token-parallel phi kernel (phi_pass), state of every 2nd "
               "chunk, tma and 3 stages where they fit, two pipelined parts, tf32 solve products with 16-bit "
               "inputs: 0.319 ms against 0.332 with ieee products and 0.348 with phi(K) stored by the prepare kernel, "
               "1.95x fla's 0.621 (H200, 2026-12-06, two rounds)"),
    DefaultRow(lambda s: 64 < s.key_dim_pow2 <= 256,
               lambda s: [*_gluon_split(s), _tiled(s, 16, s.key_dim_pow2, 32, 4, prefetch_inputs=True),
                          _tiled(s, 32, s.key_dim_pow2, 16, 4, prepare_warps=4, prefetch_inputs=True, wy=True),
                          _tiled(s, 16, s.key_dim_pow2, 16, 4, prefetch_inputs=True)],
               "64 < K <= 256 (o2 128 on sm_90: the split form with the Gluon loop, 0.311 ms (tf32 solve products "
               "since: 0.988x, H100) against 0.383 for the "
               "resident C 16 below, fla 0.396; H200, 2026-12-04), state in registers with the next chunk's inputs "
               "ahead: o3 16x16 C 16 0.77 ms "
               "against 1.19 without; C 32 + wy leads with few programs (B1: 0.312 against 0.429 ms)"),
    DefaultRow(lambda s: s.key_dim_pow2 <= 256,
               lambda s: [_tiled(s, 32, s.key_dim_pow2, 16, 4), _tiled(s, 16, s.key_dim_pow2, 16, 4),
                          _tiled(s, 32, min(s.key_dim_pow2, 128), 16, 4)],
               "K <= 256 without power-of-two widths >= 16 (no prefetch): state in registers, C 32 "
               "(o3 16x16: 1.16 ms against 7.2 at C 64 with 64-row tiles)"),
    DefaultRow(lambda s: s.key_dim == 4096 and len(s.key_widths) == 2,
               lambda s: [StreamedConfig(chunk_size=128, block_k=128, block_v=min(32, s.value_dim_pow2), num_warps=8,
                                         prepare_warps=8, dot_precision=_precision(s), loop="stepped",
                                         tiles_per_program=4)],
               "order 3 at K 4096 (o3 64x64 measured): the chunk loop on the host (two chunk-parallel launches "
               "a chunk, chunk_stepped.py), C 128 in 128-row tiles, runs of 4: B1 T4096 0.920 ms against "
               "4.005 for the sequential kernel below (H100, compare_kron --stepped --batch 1 at 9516cfa, "
               "float64-checked on the GPU first; C 64: 1.445-1.638 ms); not measured at order 4 (K 4096 "
               "as well), which keeps the row below"),
    DefaultRow(lambda s: s.key_dim_pow2 >= 4096,
               lambda s: [StreamedConfig(chunk_size=64, block_k=max(_stream_tile(s), 256), block_v=min(bv, s.value_dim_pow2),
                                         num_warps=8, prepare_warps=2, dot_precision=_precision(s), merge_passes=True)
                          for bv in (32, 16)],
               "K >= 4096: 256-row tiles, 32 columns, passes merged (state read once per chunk), tf32 solve: "
               "o3 64x64 5.26 ms, o4 16^3 5.67 (6.49 / 7.10 unmerged)"),
    DefaultRow(lambda s: 256 < s.key_dim_pow2 < 4096,
               lambda s: [*_gluon_streamed(s), StreamedConfig(chunk_size=64, block_k=max(_stream_tile(s), 256),
                                         block_v=min(32, s.value_dim_pow2), num_warps=8, prepare_warps=2,
                                         dot_precision=_precision(s)),
                          StreamedConfig(chunk_size=64, block_k=_stream_tile(s), block_v=min(32, s.value_dim_pow2),
                                         num_warps=8, prepare_warps=2, dot_precision=_precision(s),
                                         prefetch_state=True)],
               "256 < K < 4096 (order 3 at K 512 and 1024 on sm_90: the Gluon kernel first, _gluon_streamed): "
               "256-row tiles, C 64, tf32 solve: o3 32x32 1.238 ms against 1.319 for 128-row tiles "
               "loaded one ahead (H200, compare_kron --large at 91fb7d6; the tuner's pick on an H100, 1.212 against "
               "1.293); those where 256 rows do not fit (3.03 ms at C 32)"),
    DefaultRow(lambda s: s.key_dim_pow2 > 256,
               lambda s: [_tiled(s, C, _stream_tile(s), 16, w) for C, w in
                          ([(64, 8)] if s.key_dim_pow2 >= 4096 and _stream_tile(s) <= 128 else []) + [(32, 4), (16, 4)]]
               + [_tiled(s, 32, 128, 16, 4), _tiled(s, 16, 64, 16, 4)],
               "K > 256 where the tiles above do not fit the device: narrower tiles, one prepare warp per 16 rows"),
    DefaultRow(lambda s: True, lambda s: [_tiled(s, 16, 16, 16, 4)],
               "the smallest tiles: runs wherever anything runs"),
    # last at K = 256: in the tuner's space, never the default there
    DefaultRow(lambda s: len(s.key_widths) >= 2 and s.key_dim_pow2 == 256,
               lambda s: _materialised_proposals(s),
               "order >= 3, K = 256: phi(q), phi(k) materialised, for the tuner; o3 16x16 0.810 ms against "
               "0.351 for the split form (H200, the same run)"),
)

def _materialised_proposals(shape: KernelShape) -> list[KernelConfig]:
    """Order 2's defaults for K = prod d_i, materialised: the split form at K = 64 and 128 (C 32
    in four parts, :func:`_split_small_k`: o3 8x8 0.303 ms, o3 16x8 0.439 on the H200), the
    resident C 32 + wy up to 64, the resident C 16 with prefetch above."""
    wy = ResidentConfig(chunk_size=32, block_v=16, prepare_warps=4, prefetch_inputs=True, wy=True, materialise=True)
    c16 = _tiled(shape, 16, shape.key_dim_pow2, 32, 4, prefetch_inputs=True, materialise=True)
    if shape.key_dim_pow2 > 128:
        return [c16, wy]
    split = _split_small_k(shape, materialise=True)
    if shape.key_dim_pow2 == 128:
        return [*split[:len(split) // 2], c16, wy]  # the C 32 parts; C 64 was not measured at K = 128
    return [*(split if shape.key_dim_pow2 == 64 else []), wy, c16]


RECURRENT_DEFAULTS: tuple[DefaultRow, ...] = (
    DefaultRow(lambda s: True,
               lambda s: [_recurrent_default(s)],
               "the whole [K, 32] slab in registers up to K = 256 (86% of copy bandwidth at o3 16x16 B256), "
               "[K, 16] with 8 warps to K = 1024 (74% at B32), 1024-row tiles beyond; stream hints on a "
               "resident slab (92% of a same-size copy at B32 against 85%); at T = 1 twice the value "
               "columns and warps from 48 MiB of fp32 slabs (decode_tile)"),
)


# A one-token call (the decode step) whose state slabs hold this many elements (sequences x
# heads x K x d_v, both rounded up to powers of two; 48 MiB in fp32) runs the doubled tile: [K,
# 2 BV] with twice the warps (64 state elements a thread either way); resident slabs of 256 <= K
# <= 1024 only (not measured below or beyond). One size for every K: the doubled tile lost below
# it at K 256 and K 1024 alike, while a count of programs (1024, the former rule) kept K 1024
# from doubling at B32, where it gains. H100 80GB HBM3, fraction of a same-size copy, default ->
# doubled (the call's slabs):
# - `decode_ceiling.py` (slot groups rotated past the L2; code of 0f4ab50, two rounds at K 1024
#   B32): K 1024 B16 0.851 -> 0.830 (34 MB), B24 0.816 -> 0.826 (50 MB), B32 0.805 -> 0.845 (67
#   MB), B48 0.808 -> 0.870 (101 MB); K 256 B64 0.909 -> 0.876 (34 MB), B96 0.892 -> 0.895 (50 MB),
#   B128 0.894 -> 0.912 (67 MB), B256 0.930 with the doubled tile against 0.885.
# - `rtcompile bench --phase decode` at dd0bc1b: K 256 B256 0.90 -> 0.94, B128 0.89 -> 0.92, B64
#   0.90 -> 0.88, B32 1.00 -> 0.94; K 1024 B128 0.82 -> 0.92, B32 0.84 -> 0.84, B8 0.99 -> 0.83.
# The tuner's K 256 B256 pick is the doubled tile (H100 and H200), and so is its K 1024 B32 pick
# (H100). Not yet measured on the H200.
WIDE_DECODE_ELEMENTS = 12 * 2**20


def wide_decode_rows(shape: KernelShape) -> int:
    """The sequences x heads from which a one-token call's slabs reach :data:`WIDE_DECODE_ELEMENTS`."""
    return -(-WIDE_DECODE_ELEMENTS // (next_pow2(shape.key_dim) * next_pow2(shape.value_width)))


def _recurrent_default(shape: KernelShape) -> RecurrentConfig:
    kp = next_pow2(shape.key_dim)
    bv = min(32 if kp <= 256 else 16, next_pow2(shape.value_width))
    bk = min(kp, 1024)
    return RecurrentConfig(block_k=bk, block_v=bv, num_warps=_recurrent_warps(bk, bv), num_stages=1,
                           stream_hints=bk >= kp)


def _recurrent_warps(block_k: int, block_v: int) -> int:
    """64 state elements a thread, 4 to 16 warps ([256, 32]: 4; [1024, 16]: 8; [1024, 32]: 16)."""
    return min(16, max(4, block_k * block_v // 2048))


def decode_tile(config: RecurrentConfig, shape: KernelShape, decode_rows: int) -> RecurrentConfig:
    """``config`` with its value tile and warps doubled when a one-token call over ``decode_rows``
    (sequences x heads) reaches :func:`wide_decode_rows` and its slab is resident, 256 <= K <=
    1024; else ``config``. Invariant: the result passes its check whenever ``config`` does (a
    doubled tile that would not is not taken)."""
    bv, kp = 2 * config.block_v, next_pow2(shape.key_dim)
    if (not 256 <= kp <= 1024 or config.block_k < kp or bv > next_pow2(shape.value_width)
            or decode_rows < wide_decode_rows(shape)):
        return config
    return _with_value_tile(config, shape, bv)


def covering_tile(config: RecurrentConfig, shape: KernelShape) -> RecurrentConfig:
    """``config`` with its value tile widened to cover d_v (warps as the defaults give that tile),
    for a kernel that needs a head's whole value row in one program (the fused layer step's
    norm); ``config`` itself where it covers d_v already, its slab is not resident, or the wide
    tile fails its check. Invariant: the result passes its check whenever ``config`` does."""
    bv = next_pow2(shape.value_width)
    if config.block_v >= bv or config.block_k < next_pow2(shape.key_dim):
        return config
    return _with_value_tile(config, shape, bv)


def _with_value_tile(config: RecurrentConfig, shape: KernelShape, block_v: int) -> RecurrentConfig:
    """``config`` with value tile ``block_v`` and the warps the defaults give that tile, where
    that passes its check; else ``config``."""
    wide = dataclasses.replace(config, block_v=block_v, num_warps=_recurrent_warps(config.block_k, block_v))
    return wide if wide.check(shape) is None else config


_TABLES = {"chunk": CHUNK_DEFAULTS, "recurrent": RECURRENT_DEFAULTS}


def candidates(kernel: str, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES,
               gluon: bool | None = None, decode_rows: int | None = None,
               chunk_size: int | None = None) -> list[KernelConfig]:
    """Every proposal of the defaults table for ``shape`` that passes its check, best first, without
    repeats (a TPE study starts from them); the Gluon-loop proposals only where ``gluon`` says the
    GPU runs them (None: this process's GPU, ``chunk_split_gluon.runs_here``; the planner passes
    its target's). For the recurrent kernel the default is followed by
    itself with stream hints flipped (they split by batch on the H200); with ``decode_rows`` (the
    sequences x heads of a one-token call) its tile is :func:`decode_tile`'s for that many. With
    ``chunk_size`` (a chunk kernel's caller's size) every proposal takes it, and those that cannot
    run it drop out (a Gluon kernel's fixed chunk: the Triton proposals after it serve). The
    backward has one proposal, :func:`~.chunk_backward.default_backward`."""
    if kernel == "chunk_bwd":
        cfg = default_backward(shape, smem_limit)
        return [cfg] if cfg.check(shape, smem_limit) is None else []
    out: list[KernelConfig] = []
    for row in _TABLES[kernel]:
        if row.when(shape):
            for cfg in row.propose(shape):
                if chunk_size is not None and hasattr(cfg, "chunk_size"):
                    cfg = dataclasses.replace(cfg, chunk_size=chunk_size)
                if getattr(cfg, "loop", "triton") == "gluon":
                    gluon = chunk_split_gluon.runs_here() if gluon is None else gluon
                    if not gluon:  # not on this machine's GPU (or none): the next proposals serve
                        continue
                if cfg not in out and cfg.check(shape, smem_limit) is None:
                    out.append(cfg)
    if kernel == "recurrent" and out and decode_rows is not None:
        out = list(dict.fromkeys(decode_tile(cfg, shape, decode_rows) for cfg in out))
    if kernel == "recurrent" and out and (other := out[0].with_other_hints(shape)) is not None:
        out.append(other)
    return out


def default_config(kernel: str, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES,
                   gluon: bool | None = None, decode_rows: int | None = None,
                   chunk_size: int | None = None) -> KernelConfig:
    """The first of :func:`candidates`; the smallest resident or streamed tiles where nothing
    passes (at ``chunk_size`` when given: the launcher then reports why they cannot run).
    ``decode_rows``, ``chunk_size``: as :func:`candidates`."""
    found = candidates(kernel, shape, smem_limit, gluon, decode_rows, chunk_size)
    if found:
        return found[0]
    if kernel == "chunk_bwd":
        return default_backward(shape, smem_limit)
    if kernel == "chunk":
        tiled = _tiled(shape, 16, 16, 16, 4)
        return tiled if chunk_size is None else dataclasses.replace(tiled, chunk_size=chunk_size)
    return _recurrent_default(shape)


def split_form(shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> SplitConfig | None:
    """The split form as the K = 256 default row proposes it (key groups of 1 where the shape
    takes no other), for a shape whose default is another form; None where the default is the
    split form or no proposal passes its check. Timed at o3 16x16 (0.350 ms, fla 0.612, its
    default), o2 64 (0.295, fla 0.285) and o2 256 (0.783, fla 0.611): their defaults now; o2
    128 (0.659 against its default's 0.391, fla 0.388)."""
    found = candidates("chunk", shape, smem_limit)
    if found and isinstance(found[0], SplitConfig):
        return None
    return next((c for c in _split_any(shape) if c.check(shape, smem_limit) is None), None)


def two_kernel(shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> KernelConfig | None:
    """The first chunk candidate that is not the split form, when the default is that form (its
    workspace is ~9x the two-kernel one's at o3 16x16 B8 T4096, 289 against 32 MiB; at o2 64 the
    smaller, 145 against 160); None where the default is a two-kernel config already."""
    found = candidates("chunk", shape, smem_limit)
    if not found or not isinstance(found[0], SplitConfig):
        return None
    return next((c for c in found if not isinstance(c, SplitConfig)), None)


def low_memory(shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> FusedConfig:
    """The fused sibling of the chunk default: its tiles, no prepare kernel, no workspace that
    grows with T. The split default's sibling takes C 16 and one stage (the split form's C 64,
    fused, was estimated at ~464 registers at o3 16x16); a resident state drops the input
    prefetch (fused at o2 64: 3.09 ms with it, 3.00 without). The product solve (o2 256's split
    default) was measured in the prepare kernel only: the sibling keeps the tile solve there."""
    def triton_loop(c: KernelConfig) -> bool:  # the tiles fused runs: not the Gluon kernel's, nor the
        # stepped loop's C 128, which fused does not fit
        return not isinstance(c, StreamedConfig) or c.loop == "triton"

    base = default_config("chunk", shape, smem_limit)
    if not triton_loop(base):
        base = next(filter(triton_loop, candidates("chunk", shape, smem_limit, gluon=False)), base)
    C, stages = base.chunk_size, base.num_stages
    if isinstance(base, SplitConfig):
        C, stages = 16, 1
    streamed = isinstance(base, StreamedConfig)
    fused = FusedConfig(chunk_size=C, block_k=base.block_k if streamed else shape.key_dim_pow2,
                        block_v=base.block_v, num_warps=base.num_warps, num_stages=stages,
                        solve="tiles" if base.solve == "products" else base.solve,
                        prefetch_state=streamed and base.prefetch_state, merge_passes=streamed and base.merge_passes)
    if fused.check(shape, smem_limit) is None:
        return fused
    small = FusedConfig(chunk_size=16, block_k=min(shape.key_dim_pow2, 64), block_v=16)
    return small


def iter_space(cls: type[KernelConfig], shape: KernelShape, space: dict[str, list] | None = None,
               smem_limit: int = DEFAULT_SMEM_BYTES) -> Iterator[KernelConfig]:
    """Every config of ``space`` (default: ``cls.space(shape)``) that passes its check at
    ``smem_limit``, in the space's order (the last field varying fastest)."""
    space = cls.space(shape) if space is None else space
    if not space:
        return
    names = list(space)
    for values in itertools.product(*(space[n] for n in names)):
        cfg = cls(**dict(zip(names, values)))
        if cfg.check(shape, smem_limit) is None:
            yield cfg
