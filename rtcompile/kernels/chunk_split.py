"""The split chunk form: three kernels. The chunk-parallel prepare kernel (``chunk_prepare.py``)
stores each chunk's inverse, its normalised phi(K) and its cumulative log decay; a sequential
state loop carries only the state (in registers), storing the incoming state of every
``state_stride``-th chunk and each chunk's U; a chunk-parallel output kernel forms the scores
and the outputs of all chunks at once. The sequential chain is then three products per chunk,
two with ``wy`` (the prepare kernel applies the solve: U = U0 - W S in the loop).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl

from . import args
from .args import dot_dtype, factor_args, lowp_dots, width_args
from .blocks import (
    chunk_of_program, dot, factor_tiles, load_row_inputs, load_state_tile, one_side_tiles, phi_from_tiles,
    first_stored_state, resident_state_tile, scores_from_tiles, sequence_of_program,
)
from .chunk_prepare import chunk_indices, keys_workspace, prepare_keys
from .chunk_resident import can_materialise, fill_phi, materialise_refusal, materialised, materialised_call
from .config import (
    DEFAULT_SMEM_BYTES, DOT_PRECISIONS, PREPARE_WARPS, SOLVES, CostFigures, KernelConfig,
    KernelShape, Workload, chunk_count, chunk_programs, chunk_refusal, dot_operand_bytes, estimate_registers,
    resource_refusal, stores_inverse, wy_workspace,
)
from .inputs import Problem
from .launch_cache import cached
from .pipeline import PIPELINE_PARTS, part_bounds, parts_pay, run_parts
from . import chunk_split_gluon, chunk_split_kron

OUTPUT_BLOCK_VS = (16, 32, 64)
STATE_STRIDES = (1, 2, 4)
KEY_GROUPS = (1, 2, 4)  # (8: the prepare kernel 0.25 ms, twice 2's, on the H200)
OUTPUT_WARPS = (2, 4, 8)
LOOPS = ("triton", "gluon", "kron")  # the state loop's implementation (chunk_split_gluon.py, chunk_split_kron.py)
ALL_CHUNKS = 2**31 - 1  # a state loop's chunk bound that every sequence ends before


@dataclass(frozen=True)
class SplitConfig(KernelConfig):
    """Prepare kernel + state-only sequential loop + chunk-parallel output kernel.

    ``chunk_size``, ``block_v``, ``num_warps``, ``num_stages`` (>= 2: with one stage the loop's
    phi(K) loads ended in an illegal address on the H200, Triton 3.6): the state loop's.
    ``prepare_warps``, ``solve``, ``dot_precision``: as in ResidentConfig. ``output_block_v`` /
    ``output_warps``: the output kernel's value tile and warps (o3 16x16 C 64 on the H200:
    0.084 ms with 64 columns and 4 warps, 0.102 with 64 and 2, 0.135 with 32 and 4; at chunks of
    64 on one key axis, K >= 32, only 64 columns or d_v rounded up: ``_narrow_output_refusal``).
    ``tma``: the state loop reads phi(K) and the inverse and stores each chunk's state through
    tensor descriptors (sm_90 or newer; rows of 16-byte multiples; H200: loop 0.149 ms against
    0.164). ``key_group``: indices of key axis 1 per phi(K) store of the prepare kernel (order
    >= 3; 0.122 ms with 2, 0.136 with 1). ``state_stride``: the loop stores the state of every
    1st, 2nd or 4th chunk and the output kernel adds the chunks between as cross-chunk scores
    (loop 0.150 / 0.136 / 0.124 ms, outputs 0.084 / 0.092 / 0.115; 2 also cuts the workspace
    from 353 to 289 MiB at o3 16x16 B8 T4096 H8). ``materialise`` (order >= 3, K <= 256): the
    form runs order 2's problem on phi(q), phi(k) formed first (``chunk_resident.materialise_phi``;
    2 x 2 K bytes per token-head more), which takes widths under 16 (o3 8x8: order 2 K = 64's
    split form ran 0.295 ms on the H200 where the factored default took 0.501; materialised, o3
    8x8 ran 0.316 ms, its default since). ``pipeline``: the sequence cut into this many parts
    (whole windows of ``state_stride`` chunks; varlen calls run one), the prepare kernel of the
    next part and the output kernel of the last running on side streams while the state loop
    walks a part (``pipeline.py``); in CUDA-graph captures only (and the interpreter): an eager
    call on a GPU runs one part (``pipeline.parts_pay``). ``wy`` (delta rule; ignored without
    it): the prepare kernel also applies the solve, W = Ai diag(b Gamma) phi(K) and U0 = Ai
    diag(b) V, so the state loop forms U = U0 - W S: two products on its serial chain instead of
    three, for W's [T, K] and U0's [T, V] fp32 more workspace traffic. ``loop``: the state loop
    in Triton ("triton") or in Gluon with S^T as a wgmma accumulator ("gluon",
    ``chunk_split_gluon.py``: no shared-memory round trip on the chain; sm_90 only, 16-bit
    inputs, 64 value columns, 4 warps; ``num_stages`` and ``tma`` are the Triton loop's), or
    on the Kronecker factors ("kron", ``chunk_split_kron.py``: no stored phi(K); order 3, K <=
    1024; an experiment, not in the space: 1.5-3.8x slower than the defaults, see there).
    ``phi_pass`` (the Triton loop; not with ``wy``): phi(K) is written token-major by the
    token-parallel ``chunk_resident.fill_phi`` before the first part, and the prepare kernel
    stores none (its column-block stores were ~100 of its 135 us at o3 16x16 C 64 on an H100).
    ``unroll_solve`` (``solve="tiles"``): the prepare kernel's tile solve with its 15 diagonal
    steps unrolled (``solves.unit_lower_inverse_tiles``).
    """

    kernel: ClassVar[str] = "chunk"
    form: ClassVar[str] = "split"
    chunk_size: int
    block_v: int
    num_warps: int = 4
    num_stages: int = 2
    prepare_warps: int = 1
    solve: str = "tiles"
    dot_precision: str = "ieee"
    output_block_v: int = 16
    output_warps: int = 4
    tma: bool = False
    key_group: int = 1
    state_stride: int = 1
    materialise: bool = False
    pipeline: int = 1
    wy: bool = False
    loop: str = "triton"
    phi_pass: bool = False
    unroll_solve: bool = False

    def block_k(self, shape: KernelShape) -> int:
        return shape.key_dim_pow2

    def canonical(self) -> "SplitConfig":
        inert = {}
        if self.phi_pass:  # the prepare kernel stores no phi(K) whose column blocks key_group groups
            inert["key_group"] = 1
        if self.loop == "gluon":  # the Gluon loop loads through TMA whatever ``tma`` says
            inert["tma"] = False
        inert = {k: v for k, v in inert.items() if getattr(self, k) != v}
        return dataclasses.replace(self, **inert) if inert else self

    def resident(self, shape: KernelShape) -> bool:
        return True

    def check(self, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> str | None:
        if (reason := chunk_refusal(self, shape)) is not None:
            return reason
        if self.materialise:
            if (reason := materialise_refusal(shape)) is not None:
                return reason
            shape = materialised(shape)
        if not shape.whole_factor_tiles:
            return (f"the split form needs power-of-two key widths >= 16, got {shape.key_widths} (or "
                    "materialise=True)")
        if self.num_stages < 2:
            return f"num_stages={self.num_stages}; allowed: 2, 3 or 4 (one stage failed on the H200)"
        for name, allowed in (("output_warps", OUTPUT_WARPS), ("state_stride", STATE_STRIDES),
                              ("key_group", KEY_GROUPS), ("pipeline", PIPELINE_PARTS)):
            if (reason := self._check_choice(name, allowed)) is not None:
                return reason
        if self.output_block_v not in OUTPUT_BLOCK_VS or self.output_block_v > shape.value_dim_pow2:
            allowed = ", ".join(str(b) for b in OUTPUT_BLOCK_VS if b <= shape.value_dim_pow2)
            return f"output_block_v={self.output_block_v}; allowed: {allowed}"
        if (reason := _narrow_output_refusal(self, shape)) is not None:
            return reason
        if self.key_group > 1 and (len(shape.key_widths) < 2 or shape.key_widths[0] % self.key_group):
            return (f"key_group={self.key_group} needs order >= 3 and a first key width it divides, got widths "
                    f"{shape.key_widths} (or key_group=1)")
        if (reason := self._check_choice("loop", LOOPS)) is not None:
            return reason
        if self.loop == "gluon" and (reason := chunk_split_gluon.config_refusal(self, shape)) is not None:
            return reason
        if self.loop == "kron" and (reason := chunk_split_kron.config_refusal(self, shape)) is not None:
            return reason
        if self.phi_pass and (self.loop != "triton" or self.wy or self.materialise):
            return (f"phi_pass=True is the Triton loop's on the factors' phi(K) (got loop={self.loop!r}, "
                    f"wy={self.wy}, materialise={self.materialise}); allowed: loop='triton', wy=False, "
                    "materialise=False, or phi_pass=False")
        dot = dot_operand_bytes(shape.input_bytes)
        if self.tma and (shape.key_dim * dot % 16 or shape.value_width * dot % 16):
            return (f"tma=True needs rows of 16-byte multiples (K = {shape.key_dim}, d_v = {shape.value_width} at "
                    f"{dot} bytes); allowed: tma=False")
        return resource_refusal(self, shape, smem_limit)

    def estimate_registers(self, shape: KernelShape) -> int:
        # the state loop: state, phi(K), the inverse and the next one (wy: U0's block; W feeds
        # its product from shared memory as phi(K) does: sm_90, Triton 3.6, o3 16x16 C 64 bv 32
        # compiles to 226 registers, 199 with wy; probe_offline.py), values, U, the products
        C, bk, bv = self.chunk_size, self.block_k(shape), self.block_v
        if self.loop == "gluon":  # S^T, its 16-bit copy and four [BV, C] products; no phi(K) tile
            return estimate_registers(bk * bv * 3 // 2 + 4 * C * bv, self.num_warps)
        if self.loop == "kron":
            return chunk_split_kron.estimate_registers(shape, C, bv, self.num_warps)
        live = bk * bv + C * bk + 4 * C * bv + 2 * C * sum(shape.key_widths)
        live += C * bv if self.wy else 2 * C * C
        return estimate_registers(live, self.num_warps)

    def estimate_smem(self, shape: KernelShape) -> int:
        # per stage the loop's loads that feed products (stored phi(K) in the input type, the fp32
        # inverse), plus the 16-bit state and U staged for the products. H200, o3 16x16 C 64:
        # 3 and 4 stages ran (this model: 172032 and 221184 bytes). With wy: W's rows and U0's
        # fp32 block per stage instead of the inverse (3 stages: 245760 here, 246344 compiled)
        C, bk, bv = self.chunk_size, self.block_k(shape), self.block_v
        if self.loop == "gluon":
            return chunk_split_gluon.smem_bytes(C, bk, bv, self.wy)
        if self.loop == "kron":
            return chunk_split_kron.smem_bytes(shape, C, bv)
        solve = C * bk * shape.input_bytes + 4 * C * bv if self.wy else 4 * C * C
        return max(1, self.num_stages) * (C * bk * shape.input_bytes + solve) + 2 * bk * bv + 4 * C * bv

    @classmethod
    def space(cls, shape: KernelShape) -> dict[str, list]:
        # measured only up to K = 256; wider states stream (StreamedConfig): at K 1024 this loop's
        # [1024, 16] state spills in every variant compiled for sm_90 (Triton 3.6, probe_offline
        # --config: 255 registers and 528-1608 B of spill stack at 4-8 warps and C 16-64, 432-1016
        # B at 16 warps; the output kernel's whole-K phi(Q) tile 200-216 B)
        mat = can_materialise(shape) and materialised(shape).whole_factor_tiles
        if not (shape.whole_factor_tiles or mat) or shape.key_dim > 256:
            return {}
        order3 = len(shape.key_widths) >= 2
        return {
            "chunk_size": [16, 32, 64],
            "block_v": [b for b in (16, 32, 64) if b <= shape.value_dim_pow2],
            "num_warps": [2, 4, 8],
            "num_stages": [2, 3, 4],
            "prepare_warps": list(PREPARE_WARPS),
            "solve": list(SOLVES),
            "dot_precision": list(DOT_PRECISIONS),
            "output_block_v": [b for b in OUTPUT_BLOCK_VS if b <= shape.value_dim_pow2],
            "output_warps": list(OUTPUT_WARPS),
            "tma": [False, True],
            "key_group": [g for g in KEY_GROUPS if order3 and shape.key_widths[0] % g == 0] or [1],
            "state_stride": list(STATE_STRIDES),
            "materialise": [False] * shape.whole_factor_tiles + [True] * mat,
            "pipeline": list(PIPELINE_PARTS),
            "wy": [False, True],
            "loop": [loop for loop in LOOPS if loop != "kron"],  # (kron: 1.5-3.8x the default at o3 16x16)
            "phi_pass": [False, True],
            "unroll_solve": [False, True],
        }

    def workspace_bytes(self, w: Workload) -> int:
        """The incoming state of every state_stride-th chunk [K, V] and U [T, V] in the products'
        type, the inverse [T, C] fp32 (delta rule), the stored phi(K) [T, K] in the products'
        type and the gates' cumulative sums [T] fp32; with ``wy`` W [T, K] in the products' type
        and U0 [T, V] fp32, the inverse only for the tile solve (its scratch). In parts, the
        running state [K, V] fp32 per sequence-head (allocated when the caller keeps no final
        state: counted, an upper bound)."""
        dot = dot_operand_bytes(w.shape.input_bytes)
        K, V = w.shape.key_dim, w.shape.value_width
        states = w.batch * w.heads * math.ceil(chunk_count(w, self.chunk_size) / self.state_stride)
        work = states * K * V * dot + w.rows * V * dot
        if self.loop != "kron":  # the stored phi(K); the "kron" loop forms it from the factors
            work += w.rows * K * dot
        if w.delta_rule and self.wy:
            work += wy_workspace(w)
        if stores_inverse(w.delta_rule, self.wy, self.solve):
            work += w.rows * self.chunk_size * 4
        if w.forget_gate:
            work += w.rows * 4
        if self.materialise:  # phi(q), phi(k) in the inputs' type
            work += 2 * w.rows * K * w.shape.input_bytes
        if self._parts(w) > 1:
            work += w.state_bytes
        return work

    def _parts(self, w: Workload) -> int:
        chunks = chunk_count(w, self.chunk_size)
        return len(part_bounds(chunks, self.pipeline, self.state_stride)) if chunks > 0 else 1

    def figures(self, w: Workload) -> CostFigures:
        # three launches (four with phi_pass): the cost model prices an eager call (its host
        # time), which runs one part (pipeline.parts_pay; the parts' overlap in a graph is not modelled); the state
        # loop apart from the chunk-parallel kernels
        return CostFigures(programs=chunk_programs(w, self.block_v), serial_steps=chunk_count(w, self.chunk_size),
                           state_passes=2, workspace_bytes=self.workspace_bytes(w),
                           launches=3 + 2 * self.materialise + self.phi_pass,
                           loop_elements=self.chunk_size * w.shape.key_dim_pow2)


# ----- the state loop -----
@triton.jit
def _load_state_inputs(v, Gc, beta, Ai, r, p_row, m_t, o_v, m_v, C: tl.constexpr, V: tl.constexpr,
                       TMA: tl.constexpr, WY: tl.constexpr):
    """One chunk's inputs of the state loop, in registers: values, the cumulative log decay
    (from ``Gc``, when given), beta and the prepared inverse (delta rule; with TMA the loop
    reads it by descriptor; with WY neither values, beta nor the inverse: U0 and W replace
    them). ``r`` indexes the token-major inputs, ``p_row`` the [B, H, T] workspaces.
    Placeholders are never read."""
    b_v, b_g, b_b = load_row_inputs(v, Gc, beta, r, p_row, m_t, o_v, m_v, C, V, not WY, Gc is not None,
                                    beta is not None and not WY)
    b_Ai = tl.zeros([C, C], dtype=tl.float32)
    if beta is not None and not TMA and not WY:
        b_Ai = tl.load(Ai + p_row[:, None] * C + tl.arange(0, C)[None, :], mask=m_t[:, None], other=0.0)
    return b_v, b_g, b_b, b_Ai


@triton.jit
def _store_chunk_state(Hc, i_row, b_s, off_k, m_s, i_v, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                       TMA: tl.constexpr):
    """The [K, BV] state ``b_s`` into row block ``i_row`` (stored state x H + head) of ``Hc``:
    through a descriptor with TMA (no layout change in registers), else a masked store."""
    if TMA:
        Hc.store([(i_row * K).to(tl.int32), i_v * BV], b_s.to(Hc.dtype))
    else:
        tl.store(Hc + i_row * K * V + off_k, b_s.to(Hc.dtype.element_ty), mask=m_s)


@triton.jit(do_not_specialize=["c0", "c_end"])
def chunk_split_state_kernel(
    v, beta, h0, ht, Ai, W, U0, Kw, Gc, Hc, Uc, Rc, cu_seqlens, chunk_offsets, T, c0, c_end,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
    LOWP: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr, STRIDE: tl.constexpr,
    TOKEN_KEYS: tl.constexpr = False,
):
    """The sequential loop of the split form: the state only. Per chunk of one (sequence, head,
    value block) it stores the incoming state S into ``Hc`` ([stored states, H, K, V], in the
    products' type) at every STRIDE-th chunk (``chunk_offsets``: each varlen sequence's first,
    in stored-state units) and U = Ai diag(b) (V - diag(Gamma) phi(K) S) into ``Uc`` (laid out
    as v), then S' = Gamma_C S + phi(K)^T diag(Gamma_C / Gamma) U. phi(K) is read from ``Kw``
    (normalised, [B, H, T, K]; token-major with TOKEN_KEYS, written by the phi kernel) and the
    cumulative log decay from ``Gc`` ([B, H, T] fp32; None: no gates), written by the prepare
    kernel, so the loop holds no scan and no reduction
    across its warps; phi(Q), the scores and the outputs are left to
    :func:`chunk_split_output_kernel`, which runs over all chunks at once. The [K, BV] state
    stays in registers. TMA: ``Kw`` is a descriptor of phi(K) as [B H T, K] read in [C, K]
    blocks, ``Hc`` one of the stored states as [chunks H K, V] written in [K, BV] blocks and,
    with the delta rule, ``Ai`` one of the inverses as [B H T, C] (H200: loop 0.149 ms against
    0.164; compiled offline for sm_90 as launched, neither form spills). A block's rows past
    the sequence are the next sequence's (or zeros): U's rows there are set to zero, so they
    add nothing. ``beta`` / ``h0`` / ``ht`` / ``cu_seqlens`` None: no delta rule / zero
    initial state / no final state / not varlen. ``Rc`` (the backward's recompute, delta rule):
    also store R = V - diag(Gamma) phi(K) S (fp32, laid out as v); None in the forward.
    ``c0`` / ``c_end``: the chunks [c0, c_end) of each sequence that this launch walks (a
    pipelined part: the state comes in by ``h0`` and leaves by ``ht``); 0 / ALL_CHUNKS for all.
    ``W`` / ``U0`` (delta rule, the prepare kernel's WY products W = Ai diag(b Gamma) phi(K) as
    [B, H, T, K] or its descriptor with TMA, U0 = Ai diag(b) V as [B, H, T, V] fp32; None:
    Ai is applied here): U = U0 - W S, one product on the chain where Ai's takes two (phi(K) S,
    then Ai); ``Ai`` and ``v`` are not read then, and ``Rc`` must be None. TOKEN_KEYS: ``Kw`` is
    token-major ([B, T, H, K], ``SplitConfig.phi_pass``; its descriptor [B T, H K] in [C, K]
    blocks)."""
    WY: tl.constexpr = W is not None
    tl.static_assert(not (WY and Rc is not None), "the backward's recompute (Rc) reads R, which WY never forms")
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, i_b = sequence_of_program(i_n, T, cu_seqlens)
    i_g0 = first_stored_state(i_n, i_b, T, cu_seqlens, chunk_offsets, C, STRIDE)  # its first state in Hc
    DT: tl.constexpr = v.dtype.element_ty
    o_c = tl.arange(0, C)
    o_v, m_v, o_k, off_k, m_s, off_s = resident_state_tile(i_v, i_n, i_h, H, K, V, BV)
    b_s = load_state_tile(h0, ht, off_s, m_s, True, h0 is not None)
    for i_c in range(c0, tl.minimum(c_end, tl.cdiv(eos - bos, C))):
        tok = bos + i_c * C + o_c
        m_t = tok < eos
        r = (i_b * T + tok) * H + i_h
        p_row = (i_b * H + i_h) * T + tok
        b_v, b_g, b_b, b_Ai = _load_state_inputs(v, Gc, beta, Ai, r, p_row, m_t, o_v, m_v, C, V, TMA, WY)
        # one load, transposed in place for the update (o3 16x16 C 64 on the H200: the loop took
        # 0.211 ms against 0.223 with a second, transposed load, and with half the shared memory
        # per stage a third stage fits: 0.172 ms)
        if TMA and TOKEN_KEYS:  # one descriptor load: no per-element addresses or masks (see the docstring)
            b_k = Kw.load([(i_b * T + bos + i_c * C).to(tl.int32), i_h * K])
        elif TMA:
            b_k = Kw.load([((i_b * H + i_h) * T + bos + i_c * C).to(tl.int32), 0])
        elif TOKEN_KEYS:
            b_k = tl.load(Kw + r[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        else:
            b_k = tl.load(Kw + p_row[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_kt = tl.trans(b_k)
        b_c = tl.zeros([C], dtype=tl.float32)
        b_last = 0.0
        if Gc is not None:  # the chunk's last token's entry: one scalar load, no reduction
            b_c = b_g
            b_last = tl.load(Gc + (i_b * H + i_h) * T + tl.minimum(bos + i_c * C + C, eos) - 1)
        # the incoming state, for the output kernel (a store: nothing waits on it)
        if STRIDE == 1:
            _store_chunk_state(Hc, (i_g0 + i_c) * H + i_h, b_s, off_k, m_s, i_v, K, V, BV, TMA)
        elif i_c % STRIDE == 0:
            _store_chunk_state(Hc, (i_g0 + i_c // STRIDE) * H + i_h, b_s, off_k, m_s, i_v, K, V, BV, TMA)
        if WY:  # U = U0 - W S: the solve applied by the prepare kernel
            if TMA:
                b_w = W.load([((i_b * H + i_h) * T + bos + i_c * C).to(tl.int32), 0])
            else:
                b_w = tl.load(W + p_row[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
            b_u = tl.load(U0 + p_row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
            b_u -= dot(b_w, b_s, LOWP, DT, PREC)
            if TMA:  # rows past the sequence are the next one's: U's rows there are set to zero
                b_u = tl.where(m_t[:, None], b_u, 0.0)
        elif beta is not None:
            b_ks = dot(b_k, b_s, LOWP, DT, PREC)
            if TMA:  # rows past the sequence are the next one's: U's rows there are set to zero below
                b_Ai = Ai.load([((i_b * H + i_h) * T + bos + i_c * C).to(tl.int32), 0])
            b_R = b_v - tl.exp(b_c)[:, None] * b_ks
            if Rc is not None:
                tl.store(Rc + r[:, None] * V + o_v[None, :], b_R, mask=m_t[:, None] & m_v[None, :])
            b_u = dot(b_Ai, b_b[:, None] * b_R, LOWP, DT, PREC)
            if TMA:
                b_u = tl.where(m_t[:, None], b_u, 0.0)
        else:
            b_u = b_v
        tl.store(Uc + r[:, None] * V + o_v[None, :], b_u.to(Uc.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        # Gamma_C / Gamma_i <= 1 on U's rows ([C, BV]) rather than on phi(K)'s ([C, K])
        b_s = tl.exp(b_last) * b_s + dot(b_kt, b_u * tl.exp(b_last - b_c)[:, None], LOWP, DT, PREC)
    if ht is not None:
        tl.store(ht + off_s, b_s.to(ht.dtype.element_ty), mask=m_s)


# ----- the output kernel -----
@triton.jit
def _window_outputs(b_o, b_c, b_q1, b_q2, b_q3, k1, k2, k3, Gc, Uc, i_c, bos, eos, i_b, i_h, T, o_v, m_v,
                    H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
                    V: tl.constexpr, C: tl.constexpr, L2NORM: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
                    STRIDE: tl.constexpr):
    """``b_o`` plus the cross-chunk scores of the window's earlier chunks j (nearest first) times
    their U, and ``b_c`` plus the log decay from the window's first chunk to this one: the
    state is linear in the U rows, so S_c = decayed S_w + the phi(K_j)^T U_j between."""
    DT: tl.constexpr = k1.dtype.element_ty
    o_c = tl.arange(0, C)
    # b_off: log decay from chunk j's start to this one's (a [C] vector of one value: a
    # loop-carried tensor of fixed type)
    b_off = tl.zeros([C], dtype=tl.float32)
    for i_j in range(i_c % STRIDE):
        j = i_c - 1 - i_j
        tok_j = bos + j * C + o_c  # a whole chunk: only a sequence's last chunk is partial
        r_j = (i_b * T + tok_j) * H + i_h
        if Gc is not None:
            b_cj = tl.load(Gc + (i_b * H + i_h) * T + tok_j)
        else:
            b_cj = tl.zeros([C], dtype=tl.float32)
        b_off += tl.sum(tl.where(o_c == C - 1, b_cj, 0.0), axis=0)
        b_kj1, b_kj2, b_kj3 = one_side_tiles(k1, k2, k3, r_j, tok_j < eos, NF, D1, D2, D3, D1, D2, D3, L2NORM)
        b_g = dot(b_q1, tl.trans(b_kj1), LOWP, DT, PREC)
        if NF > 1:
            b_g *= dot(b_q2, tl.trans(b_kj2), LOWP, DT, PREC)
        if NF > 2:
            b_g *= dot(b_q3, tl.trans(b_kj3), LOWP, DT, PREC)
        # t in this chunk is after every i in chunk j: the exponent is <= 0
        b_g *= tl.exp((b_c + b_off)[:, None] - b_cj[None, :])
        b_uj = tl.load(Uc + r_j[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_o += dot(b_g, b_uj, LOWP, DT, PREC)
    return b_o, b_c + b_off


@triton.jit(do_not_specialize=["c0"])
def chunk_split_output_kernel(
    q1, q2, q3, k1, k2, k3, Gc, o, Hc, Uc, cu_seqlens, chunk_indices, state_offsets, scale, T, c0,
    H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, LOWP: tl.constexpr,
    PREC: tl.constexpr, STRIDE: tl.constexpr,
):
    """O = scale (diag(Gamma) phi(Q) S_c + P U) for every chunk in parallel: S_c and U as
    :func:`chunk_split_state_kernel` stored them, P from the factor Grams as in the prepare
    kernel (computed here, so no [T, C] score workspace), the cumulative log decay from ``Gc``
    (None: no gates). Program i takes chunk i (varlen: pair i of ``chunk_indices``). STRIDE:
    ``Hc`` holds the state at every STRIDE-th chunk only (``state_offsets``: each sequence's
    first, with varlen); chunk c reads the one at its window's first chunk w and adds the
    earlier chunks j of the window as cross-chunk scores,
    O = scale (diag(Gamma_w->t) phi(Q) S_w + sum_{w <= j <= c} P_cj U_j). ``c0``: the first
    chunk (or pair) of this launch (a pipelined part). phi(Q) S_w in one product over the whole
    K: over key slices of 32 / 64 / 128 rows in a loop (247 -> 194-205 registers, sm_90) the
    default ran 1.06 / 1.016 / 1.03x as long (o3 16x16, H100, compare_kron.py at e906e88; the
    kernel 109 us against 96): its loads no longer all issue at once."""
    K: tl.constexpr = D1 * D2 * D3
    i_nh, i_v = tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    i_c, bos, eos, i_b, i_s = chunk_of_program(tl.program_id(0) + c0, i_n, T, cu_seqlens, chunk_indices, state_offsets,
                                               C, STRIDE)
    DT: tl.constexpr = q1.dtype.element_ty
    o_c = tl.arange(0, C)
    tok = bos + i_c * C + o_c
    m_t = tok < eos
    r = (i_b * T + tok) * H + i_h
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    if Gc is not None:
        b_c = tl.load(Gc + (i_b * H + i_h) * T + tok, mask=m_t, other=0.0)
    else:
        b_c = tl.zeros([C], dtype=tl.float32)
    b_q1, b_q2, b_q3, b_k1, b_k2, b_k3 = factor_tiles(q1, q2, q3, k1, k2, k3, r, m_t, NF, D1, D2, D3,
                                                      D1, D2, D3, L2NORM)
    b_P, _ = scores_from_tiles(q1, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, tl.zeros([C], dtype=tl.float32), b_c,
                               NF, C, False, LOWP, PREC, "rows")
    m_o = m_t[:, None] & m_v[None, :]
    b_u = tl.load(Uc + r[:, None] * V + o_v[None, :], mask=m_o, other=0.0)
    b_o = dot(b_P, b_u, LOWP, DT, PREC)
    if STRIDE > 1:
        b_o, b_c = _window_outputs(b_o, b_c, b_q1, b_q2, b_q3, k1, k2, k3, Gc, Uc, i_c, bos, eos, i_b, i_h, T,
                                   o_v, m_v, H, NF, D1, D2, D3, V, C, L2NORM, LOWP, PREC, STRIDE)
    b_q = phi_from_tiles(b_q1, b_q2, b_q3, NF, C, D1, D2, D3)
    o_k = tl.arange(0, K)
    b_h = tl.load(Hc + (i_s * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=(o_k < K)[:, None] & m_v[None, :], other=0.0)
    b_o = scale * (tl.exp(b_c)[:, None] * dot(b_q, b_h, LOWP, DT, PREC) + b_o)
    tl.store(o + r[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_o)


def _narrow_output_refusal(config: SplitConfig, shape: KernelShape) -> str | None:
    """The output kernel at chunks of 64 or more with fewer than 64 value columns (or d_v
    rounded up) on one key axis (order 2, or materialised) at K >= 32, refused: on an H100
    (Triton 3.6, 2026-12-05, diagnose_split_output.py, bf16, T 130) C 64 gave wrong outputs
    (up to 25 k of 50 k entries; an illegal address at o3 16x8 materialised) at K 64 and 128
    with 16 and 32 columns, at K 32 with 16 (state stride 1), whichever state loop fed it;
    64 columns, chunks of 32, K 16, and o3 16x16 (two key axes) with any columns were right.
    The interpreter runs them all correctly."""
    widest = min(64, shape.value_dim_pow2)
    if (config.chunk_size >= 64 and len(shape.key_widths) == 1 and shape.key_dim >= 32
            and config.output_block_v < widest):
        return (f"output_block_v={config.output_block_v} at chunk_size={config.chunk_size} and K = {shape.key_dim} on "
                f"one key axis: wrong outputs on sm_90 (Triton 3.6); allowed: output_block_v={widest}, or chunk_size=32")
    return None


# ----- the state loops, by SplitConfig.loop -----
def triton_state_loop(config: SplitConfig, p: Problem, v, beta, ws: dict, Hc, Uc, cu_seqlens, offsets, *, keys,
                      l2norm: bool):
    """:func:`chunk_split_state_kernel` bound to one call's workspaces (``keys_workspace``), as
    ``walk(h_in, h_out, c0, c1)``: chunks [c0, c1) of every (sequence, head, value block), the
    state in from ``h_in`` (None: zeros) and out to ``h_out``. With ``tma`` the loop reads phi(K)
    and the inverse (or W) and stores the states through tensor descriptors made once here.
    ``keys`` / ``l2norm`` (the key factors) are not read: the loop reads the stored phi(K)."""
    B, T, H, V = v.shape
    C, K = config.chunk_size, p.key_dim
    wy = ws["W"] is not None
    Kd, Hd, Ad, Wd = ws["Kw"], Hc, ws["Ai"], ws["W"]
    if config.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        if config.phi_pass:  # token-major: a head's rows are every H-th K-wide slice of a [B T, H K] row
            Kd = TensorDescriptor(ws["Kw"].view(B * T, H * K), [B * T, H * K], [H * K, 1], [C, K])
        else:
            Kd = TensorDescriptor(ws["Kw"].view(B * H * T, K), [B * H * T, K], [K, 1], [C, K])
        Hd = TensorDescriptor(Hc.view(-1, V), [Hc.numel() // V, V], [V, 1], [K, config.block_v])
        if wy:
            Wd = TensorDescriptor(ws["W"].view(B * H * T, K), [B * H * T, K], [K, 1], [C, K])
        elif beta is not None:
            Ad = TensorDescriptor(ws["Ai"].view(B * H * T, C), [B * H * T, C], [C, 1], [C, C])
    lowp, prec = lowp_dots(v.dtype), config.dot_precision
    kernel_call = cached(chunk_split_state_kernel)[(triton.cdiv(V, config.block_v), p.num_seqs * H)]

    def walk(h_in, h_out, c0: int, c1: int) -> None:
        kernel_call(v, beta, h_in, h_out, None if wy else Ad, Wd, ws["U0"], Kd, ws["Gc"], Hd, Uc, None, cu_seqlens,
                    offsets, T, c0, c1, H=H, K=K, V=V, C=C, BV=config.block_v, LOWP=lowp, PREC=prec, TMA=config.tma,
                    STRIDE=config.state_stride, TOKEN_KEYS=config.phi_pass, num_warps=config.num_warps,
                    num_stages=config.num_stages)

    return walk


# phi_pass: True launches the phi kernel (all of phi(K)) beside the first prepare kernel
# (pipeline.run_parts' loop_inputs, on the idle output stream) rather than before it on the
# prepare stream. It lost: o3 16x16 0.3623 ms against 0.3602 (H100, compare_kron.py --phi-pass at
# eedfbe8, two rounds; the kernels' own times unchanged: the two share the memory system); not
# timed on the H200. All of phi(K) with the first part, not each part's before its prepare
# kernel: 0.3293 ms against 0.3320 (o3 16x16, H200, compare_kron.py at 251da1b, two rounds)
PHI_BESIDE_PREPARE = False

# SplitConfig.loop -> the builder of that loop for one call (same signature, same walk)
STATE_LOOPS = {"triton": triton_state_loop, "gluon": chunk_split_gluon.state_loop, "kron": chunk_split_kron.state_loop}


# ----- launcher -----
def launch(config: SplitConfig, p: Problem, q, k, v, g, beta, *, h0, ht, cu_seqlens, l2norm: bool) -> torch.Tensor:
    """Run ``config`` on checked inputs (``p`` from ``check_inputs``): prepare, state loop and
    outputs, once each, or once per part with ``pipeline`` > 1 (not varlen; ``pipeline.py``).
    ``ht``: None, or the fp32 final-state buffer to store into. Returns o.
    Workspace (``SplitConfig.workspace_bytes``): the incoming state of every state_stride-th
    chunk ([stored states, H, K, V]) and U ([B, T, H, V]), both in the products' type, the
    prepare kernel's inverse and cumulative log decay, and phi(K) (the prepare kernel's; with
    ``phi_pass`` the phi kernel's, token-major; none with ``loop`` "kron"); with ``materialise``
    phi(q), phi(k) (order 2's problem on them); with parts, the running state when ``ht`` is None."""
    if config.materialise:
        p, q, k, h0, ht, l2norm = materialised_call(p, q, k, h0, ht, l2norm)
    B, T, H, V = v.shape
    C, K = config.chunk_size, p.key_dim
    varlen = cu_seqlens is not None
    dt = dot_dtype(v)
    o = args.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    n_chunks = [triton.cdiv(hi - lo, C) for lo, hi in p.seq_bounds] if varlen else [triton.cdiv(T, C)] * B
    n_states = [triton.cdiv(n, config.state_stride) for n in n_chunks]  # per sequence
    Hc = args.empty(sum(n_states), H, K, V, dtype=dt, device=v.device)
    Uc = args.empty(B, T, H, V, dtype=dt, device=v.device)
    idx = offsets = None
    if varlen:
        idx = chunk_indices(p, C, v.device)
        offsets = torch.tensor([0, *itertools.accumulate(n_states)], dtype=torch.int32).to(v.device)
    # varlen sequences end at different chunks: one part over every (sequence, chunk) pair, whose
    # count also bounds each sequence's chunks in the loop. Pipelined parts only in CUDA-graph
    # captures and the interpreter (pipeline.parts_pay): an eager call is host-bound
    n_parts = config.pipeline if parts_pay(v.device) else 1
    bounds = [(0, idx.shape[0])] if varlen else part_bounds(n_chunks[0], n_parts, config.state_stride)
    parts = len(bounds) > 1
    run = ht if ht is not None or not parts else args.empty(p.state_shape, dtype=torch.float32, device=v.device)
    ws = keys_workspace(config, p, v, g, beta)
    lowp, prec = lowp_dots(v.dtype), config.dot_precision

    def phi_keys() -> None:  # phi(K) of the whole sequence: only the state loop reads it
        fill_phi([k], [ws["Kw"]], l2norm)

    def prepare(c0: int, c1: int) -> None:
        if config.phi_pass and not PHI_BESIDE_PREPARE and c0 == bounds[0][0]:
            phi_keys()
        prepare_keys(config, p, q, k, v, g, beta, cu_seqlens=cu_seqlens, idx=idx, l2norm=l2norm,
                     out={**ws, "Kw": None} if config.phi_pass else ws, chunks=(c0, c1))

    walk = STATE_LOOPS[config.loop](config, p, v, beta, ws, Hc, Uc, cu_seqlens, offsets, keys=k, l2norm=l2norm)

    def loop(j: int, c0: int, c1: int) -> None:  # part j > 0 takes the state from the running buffer
        walk(h0 if j == 0 else run, run, c0, c1)

    def outputs(c0: int, c1: int) -> None:
        cached(chunk_split_output_kernel)[(c1 - c0, H if varlen else p.num_seqs * H,
                                           triton.cdiv(V, config.output_block_v))](
            *factor_args(q), *factor_args(k), ws["Gc"], o, Hc, Uc, cu_seqlens, idx, offsets, p.scale, T, c0,
            H=H, NF=len(q), **{n: w for n, w in width_args(p.key_widths, 16).items() if not n.startswith("BD")},
            V=V, C=C, BV=config.output_block_v, L2NORM=l2norm, LOWP=lowp, PREC=prec, STRIDE=config.state_stride,
            num_warps=config.output_warps, num_stages=config.num_stages,
        )

    run_parts(bounds, prepare, loop, outputs, v.device,
              loop_inputs=phi_keys if config.phi_pass and PHI_BESIDE_PREPARE else None)
    return o
