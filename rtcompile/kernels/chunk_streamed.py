"""The streamed chunk form: a chunk-parallel prepare kernel (``chunk_prepare.py``) writes each
chunk's scores and inverse, then one sequential program per (sequence, head, value block) walks
the chunks with the state in the final-state buffer, visiting it in [block_k, block_v] tiles
(read twice and written once per chunk, once each with ``merge_passes``): the form for states
too wide for registers, whose workspace does not grow with the state. The fused form
(``chunk_fused.py``) runs the same sequential kernel with the scores and the solve formed in
the kernel instead. The chunk recurrence is ``chunk_resident``'s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl

from . import args, chunk_stepped, chunk_streamed_gluon
from .args import factor_args, lowp_dots, width_args
from .blocks import (
    chunk_inputs, delta_outputs, dot, first_stored_state, load_state_tile, phi_block, sequence_of_program, state_tile,
)
from .chunk_prepare import prepare_scores
from .config import (
    CHUNK_MAX_EST_REGS, DEFAULT_SMEM_BYTES, DOT_PRECISIONS, PREPARE_WARPS, SOLVES, CostFigures,
    KernelConfig, KernelShape, Workload, chunk_count, chunk_programs, chunk_refusal,
    chunk_smem_estimate, estimate_registers, resource_refusal, streamed_live_elements,
    two_kernel_workspace,
)
from .inputs import Problem
from .launch_cache import cached
from .solves import unit_lower_inverse_scratch


# the chunk loop: a sequential Triton or Gluon kernel (chunk_streamed_gluon.py), or launches from
# the host, two chunk-parallel kernels a chunk (chunk_stepped.py)
LOOPS = ("triton", "gluon", "stepped")


@dataclass(frozen=True)
class StreamedConfig(KernelConfig):
    """Prepare kernel + a sequential kernel streaming the state in key tiles.

    ``block_k`` (< K): rows of a state tile. ``prefetch_state``: issue each state tile's load one
    tile ahead (without it every tile waited for its own load: ~1.2 TB/s of state traffic at o3
    64x64 on the H200). ``merge_passes``: the update pass of chunk c also forms chunk c+1's
    products from each updated tile while it is in registers, so the state is read once per
    chunk instead of twice (o3 64x64 on the H200: 6.49 ms against 7.20). ``loop="gluon"``: the
    sequential kernel of ``chunk_streamed_gluon.py`` (the state on chip; sm_90), with
    ``prefetch_inputs`` (the next chunk's factor tiles loaded ahead). ``loop="stepped"``: no
    sequential kernel, each chunk two launches over every (value block, sequence x head, run of
    ``tiles_per_program`` key tiles) (``chunk_stepped.py``; ``prefetch_state`` and
    ``merge_passes`` are inert there: the state is read once a chunk by construction; 2 T / C + 2
    launches, for CUDA-graph captures: an eager call pays each one's host time). Each run writes
    one [C, BV] partial of phi(K) S and of phi(Q) S a chunk, which the second launch reads: per
    token 2 x 2 x runs x d_v x 4 bytes beside the state's 2 K d_v x 4 / C (o3 64x64, C 64, 16
    runs: 16 against 32 KiB a token-head), so longer runs trade programs for traffic.
    ``unroll_solve`` as in :class:`~rtcompile.kernels.chunk_split.SplitConfig`. The other fields
    as in :class:`~rtcompile.kernels.chunk_resident.ResidentConfig`.
    """

    kernel: ClassVar[str] = "chunk"
    form: ClassVar[str] = "streamed"
    chunk_size: int
    block_k: int
    block_v: int
    num_warps: int = 4
    num_stages: int = 1
    prepare_warps: int = 4
    solve: str = "tiles"
    dot_precision: str = "ieee"
    prefetch_state: bool = False
    merge_passes: bool = False
    loop: str = "triton"
    prefetch_inputs: bool = False
    unroll_solve: bool = False
    tiles_per_program: int = 1

    def resident(self, shape: KernelShape) -> bool:
        return False

    def canonical(self) -> "StreamedConfig":
        if self.loop == "stepped":
            inert = dict(prefetch_state=False, merge_passes=False)
        else:
            inert = dict(tiles_per_program=1)
        inert = {k: v for k, v in inert.items() if getattr(self, k) != v}
        return dataclasses.replace(self, **inert) if inert else self

    def check(self, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> str | None:
        if (reason := chunk_refusal(self, shape)) is not None:
            return reason
        if (reason := self._check_pow2("block_k", "tiles_per_program")) is not None:
            return reason
        if self.tiles_per_program > 16:
            return f"tiles_per_program={self.tiles_per_program}; allowed: 1, 2, 4, 8 or 16"
        if not 16 <= self.block_k < shape.key_dim:
            return (f"block_k={self.block_k}; allowed: 16 <= block_k < K = {shape.key_dim} (a state that fits "
                    "one tile is ResidentConfig's)")
        if (reason := self._check_choice("loop", LOOPS)) is not None:
            return reason
        if self.loop == "gluon" and (reason := chunk_streamed_gluon.config_refusal(self, shape)) is not None:
            return reason
        if self.prefetch_inputs and self.loop != "gluon":
            return f"prefetch_inputs=True is the Gluon kernel's; allowed: False with loop={self.loop!r}"
        max_regs = chunk_stepped.MAX_EST_REGS if self.loop == "stepped" else CHUNK_MAX_EST_REGS
        return resource_refusal(self, shape, smem_limit, max_regs=max_regs)

    def estimate_registers(self, shape: KernelShape) -> int:
        if self.loop == "gluon":  # S, then the [C, BV] products and the phi tile being formed
            return shape.key_dim * self.block_v // (32 * self.num_warps) + 64
        if self.loop == "stepped":
            return chunk_stepped.estimate_registers(self.chunk_size, self.block_k, self.block_v, self.num_warps)
        return estimate_registers(streamed_live_elements(shape, self), self.num_warps)

    def estimate_smem(self, shape: KernelShape) -> int:
        if self.loop == "gluon":
            return chunk_streamed_gluon.smem_bytes(self.chunk_size, shape.key_widths, self.block_v)
        if self.loop == "stepped":
            return chunk_stepped.smem_bytes(self.chunk_size, self.block_k, self.block_v)
        return chunk_smem_estimate(self.chunk_size, self.block_k, self.block_v, self.num_stages)

    @classmethod
    def space(cls, shape: KernelShape) -> dict[str, list]:
        tiles = [b for b in (16, 32, 64, 128, 256, 512, 1024) if b < shape.key_dim]
        if not tiles:
            return {}  # K <= 16: one tile holds the state
        gluon = shape.input_bytes == 2 and len(shape.key_widths) == 2
        return {
            "chunk_size": [16, 32, 64, 128],
            "block_k": tiles,
            "block_v": [b for b in (16, 32, 64) if b <= shape.value_dim_pow2],
            "num_warps": [2, 4, 8],
            "num_stages": [1, 2, 3],
            "prepare_warps": list(PREPARE_WARPS),
            "solve": list(SOLVES),
            "dot_precision": list(DOT_PRECISIONS),
            "prefetch_state": [False, True],
            "merge_passes": [False, True],
            # the Gluon kernel (and its loads ahead) where the shape allows it (order 3, 16-bit
            # inputs; sm_90 is the launcher's)
            "loop": ["triton", "gluon", "stepped"] if gluon else ["triton", "stepped"],
            "prefetch_inputs": [False, True] if gluon else [False],
            "unroll_solve": [False, True],
            "tiles_per_program": [1, 2, 4, 8],  # the stepped loop's (inert in the others)
        }

    def workspace_bytes(self, w: Workload) -> int:
        prepared = two_kernel_workspace(self, w, scores=not self.scores_on_chip(w.shape))
        if self.loop == "stepped":  # U' [C, V] a sequence-head and the partials [2, NP, C, V]
            prepared += w.batch * w.heads * self.chunk_size * w.shape.value_width * 4 * (1 + 2 * self.runs(w.shape))
        return prepared

    def runs(self, shape: KernelShape) -> int:
        """The stepped loop's programs a (value block, sequence x head): runs of
        ``tiles_per_program`` key tiles, each writing one partial of its products."""
        return math.ceil(math.ceil(shape.key_dim / self.block_k) / self.tiles_per_program)

    def scores_on_chip(self, shape: KernelShape) -> bool:
        """Whether the sequential kernel forms P (``chunk_streamed_gluon.scores_on_chip``)."""
        return self.loop == "gluon" and chunk_streamed_gluon.scores_on_chip(shape.key_widths)

    def figures(self, w: Workload) -> CostFigures:
        n = chunk_count(w, self.chunk_size)
        if self.loop == "gluon":  # the state never leaves the chip: read and written once a call
            prepare = not self.scores_on_chip(w.shape) or w.delta_rule  # else nothing to prepare
            return CostFigures(programs=chunk_programs(w, self.block_v), serial_steps=n, state_passes=2,
                               workspace_bytes=self.workspace_bytes(w), launches=1 + prepare,
                               chip_elements=self.chunk_size * w.shape.key_dim)
        if self.loop == "stepped":  # chunk-parallel launches: the state read and written once a chunk,
            # the partials written and read once (2 x NP [C, d_v] fp32 a chunk and sequence-head)
            partials = 4 * w.batch * w.heads * n * self.chunk_size * w.shape.value_width * 4 * self.runs(w.shape)
            return CostFigures(programs=chunk_programs(w, self.block_v) * self.runs(w.shape), serial_steps=n,
                               state_passes=2 * n + 1, workspace_bytes=self.workspace_bytes(w) + partials // 2,
                               launches=2 * n + 2, host_loop=True)
        passes = (2 if self.merge_passes else 3) * n
        return CostFigures(programs=chunk_programs(w, self.block_v), serial_steps=n,
                           state_passes=passes, workspace_bytes=self.workspace_bytes(w),
                           tile_visits=2 * math.ceil(w.shape.key_dim / self.block_k),
                           tile_elements=self.chunk_size * self.block_k, launches=2)


# ----- the sequential kernel -----
@triton.jit
def _tile_products(b_s, q1, q2, q3, k1, k2, k3, r, m_t, i_k,
                   NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, K: tl.constexpr,
                   C: tl.constexpr, BK: tl.constexpr, OUTER: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr):
    """Raw phi(K)_i S_i and phi(Q)_i S_i ([C, BV] each) of key tile ``i_k`` (``b_s``) for the
    rows ``r``, from phi blocks built here in the products' operand type."""
    DT: tl.constexpr = q1.dtype.element_ty
    DOT_DT: tl.constexpr = DT if LOWP else tl.float32
    b_k = phi_block(k1, k2, k3, r, m_t, i_k, C, BK, NF, D1, D2, D3, K, OUTER, DOT_DT)
    b_q = phi_block(q1, q2, q3, r, m_t, i_k, C, BK, NF, D1, D2, D3, K, OUTER, DOT_DT)
    b_ks = dot(b_k, b_s, LOWP, DT, PREC)
    b_qs = dot(b_q, b_s, LOWP, DT, PREC)
    return b_ks, b_qs


@triton.jit
def _state_products(h0, ht, p_state, o_v, m_v, first, q1, q2, q3, k1, k2, k3, r, m_t,
                    NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
                    V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    OUTER: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr, PREFETCH_STATE: tl.constexpr):
    """Raw phi(K) S and phi(Q) S ([C, BV] each) of the rows ``r`` over a streamed state, tile by
    tile (a reading pass: nothing is written)."""
    K: tl.constexpr = D1 * D2 * D3
    NK: tl.constexpr = (K + BK - 1) // BK
    b_ks = tl.zeros([C, BV], dtype=tl.float32)
    b_qs = tl.zeros([C, BV], dtype=tl.float32)
    if PREFETCH_STATE:
        b_sn = state_tile(h0, ht, p_state, 0, o_v, m_v, first, K, BK, V, h0 is not None)
    for i_k in range(NK):
        if PREFETCH_STATE:  # the next tile's load flies while this one is used
            b_s = b_sn
            b_sn = state_tile(h0, ht, p_state, i_k + 1, o_v, m_v, first, K, BK, V, h0 is not None)
        else:
            b_s = state_tile(h0, ht, p_state, i_k, o_v, m_v, first, K, BK, V, h0 is not None)
        b_ki, b_qi = _tile_products(b_s, q1, q2, q3, k1, k2, k3, r, m_t, i_k, NF, D1, D2, D3, K, C, BK, OUTER,
                                    LOWP, PREC)
        b_ks += b_ki
        b_qs += b_qi
    return b_ks, b_qs


@triton.jit
def chunk_streamed_kernel(
    q1, q2, q3, k1, k2, k3, v, g, beta, o, h0, ht, P, Ai, cu_seqlens, Hc, Uc, Rc, chunk_offsets, scale, T,
    H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
    OUTER: tl.constexpr, SCORES: tl.constexpr, PREFETCH_STATE: tl.constexpr, MERGE_PASSES: tl.constexpr,
):
    """One program per (sequence, head, value block) walks the chunks in order; the state lives
    in ``ht`` (the final-state buffer) and is visited in [BK < K, BV] tiles, read in a pass
    forming phi(K) S and phi(Q) S and again in the update pass, which writes it back, so the
    workspace never grows with T / C. SCORES as in ``chunk_resident_kernel`` ("workspace": P
    and Ai from the prepare kernel; "rows" / "tiles": formed here, the fused form).
    PREFETCH_STATE: each state tile's load is issued one tile ahead (without it every tile
    waited for its own load: ~1.2 TB/s of state traffic at order 3 64x64 on an H200).
    MERGE_PASSES: the update pass of chunk c also forms chunk c+1's products from each updated
    tile while it is in registers, so the state is read once per chunk, not twice. ``g`` /
    ``beta`` / ``h0`` / ``cu_seqlens`` None: no gates / no delta rule / zero initial state /
    not varlen. ``o`` None: no outputs. ``Hc`` / ``Uc`` / ``Rc`` (the streamed backward's
    recompute; None in the forward): store each chunk's incoming state (the products' type, row
    (i_g0 + i_c) H + h, i_g0 from ``chunk_offsets`` with varlen), U and R = V - diag(Gamma)
    phi(K) S (fp32, laid out as v), as ``chunk_split_state_kernel`` with STRIDE 1 does."""
    K: tl.constexpr = D1 * D2 * D3
    NK: tl.constexpr = (K + BK - 1) // BK
    USE_H0: tl.constexpr = h0 is not None
    LOWP_SCORES: tl.constexpr = LOWP and SCORES == "workspace"  # fused scores stay fp32 (chunk_resident_kernel)
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, i_b = sequence_of_program(i_n, T, cu_seqlens)
    DT: tl.constexpr = q1.dtype.element_ty
    DOT_DT: tl.constexpr = DT if LOWP else tl.float32  # what dot casts its operands to
    o_c = tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_state = (i_n.to(tl.int64) * H + i_h) * K * V
    if Hc is not None:  # the sequence's first chunk in Hc
        i_g0 = first_stored_state(i_n, i_b, T, cu_seqlens, chunk_offsets, C)
    if MERGE_PASSES:  # chunk 0's products; every later chunk's ride on the update pass
        tok = bos + o_c
        b_kn, b_qn = _state_products(h0, ht, p_state, o_v, m_v, True, q1, q2, q3, k1, k2, k3,
                                     (i_b * T + tok) * H + i_h, tok < eos, NF, D1, D2, D3, V, C, BK, BV,
                                     OUTER, LOWP, PREC, PREFETCH_STATE)
    for i_c in range(0, tl.cdiv(eos - bos, C)):
        tok = bos + i_c * C + o_c
        m_t = tok < eos
        r = (i_b * T + tok) * H + i_h
        b_c, b_P, b_Ai, _, _, r_q, r_k, b_v, b_b = chunk_inputs(
            q1, q2, q3, k1, k2, k3, v, g, beta, P, Ai, None, None, r, m_t, o_v, m_v, (i_b * H + i_h) * T + tok,
            NF, D1, D2, D3, BD1, BD2, BD3, C, BK, V, L2NORM, PREC, SCORES,
        )
        if SCORES == "tiles" and beta is not None:  # fused tile solve: A inverted in this program's scratch
            b_Ai = unit_lower_inverse_scratch(Ai + (i_nh * tl.num_programs(0) + i_v).to(tl.int64) * C * C, b_Ai,
                                              C, PREC)
        b_gam = tl.exp(b_c)
        b_last = tl.sum(tl.where(o_c == C - 1, b_c, 0.0), axis=0)
        b_ratio = tl.exp(b_last - b_c)  # Gamma_C / Gamma_i <= 1
        if MERGE_PASSES:
            b_ks, b_qs = b_kn, b_qn
        else:
            b_ks, b_qs = _state_products(h0, ht, p_state, o_v, m_v, i_c == 0, q1, q2, q3, k1, k2, k3, r, m_t,
                                         NF, D1, D2, D3, V, C, BK, BV, OUTER, LOWP, PREC, PREFETCH_STATE)
        b_ks = b_ks * r_k[:, None]
        b_qs = b_qs * r_q[:, None]
        m_o = m_t[:, None] & m_v[None, :]
        b_u, b_o = delta_outputs(b_ks, b_qs, b_gam, b_v, b_b, b_Ai, b_P, scale, Rc, r[:, None] * V + o_v[None, :], m_o,
                                 beta is not None, LOWP_SCORES, DT, PREC)
        if Uc is not None:
            tl.store(Uc + r[:, None] * V + o_v[None, :], b_u, mask=m_o)
        if o is not None:
            tl.store(o + r[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_o)
        # the rows' scale (1 / ||phi(k)||, Gamma_C / Gamma_i) on U ([C, BV], once per chunk)
        # instead of on every [C, BK] block of phi(K)
        b_us = b_u * (r_k * b_ratio)[:, None]
        if MERGE_PASSES:  # the next chunk's rows (all masked off after the last chunk)
            b_kn = tl.zeros([C, BV], dtype=tl.float32)
            b_qn = tl.zeros([C, BV], dtype=tl.float32)
            r_n = (i_b * T + tok + C) * H + i_h
            m_tn = tok + C < eos
        if PREFETCH_STATE:
            b_sn = state_tile(h0, ht, p_state, 0, o_v, m_v, i_c == 0, K, BK, V, USE_H0)
        for i_k in range(NK):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            off_s = p_state + o_k[:, None] * V + o_v[None, :]
            m_s = m_k[:, None] & m_v[None, :]
            if PREFETCH_STATE:  # tile i_k + 1 is not written yet in this pass: safe to read ahead
                b_s = b_sn
                b_sn = state_tile(h0, ht, p_state, i_k + 1, o_v, m_v, i_c == 0, K, BK, V, USE_H0)
            else:
                b_s = load_state_tile(h0, ht, off_s, m_s, i_c == 0, USE_H0)
            if Hc is not None:  # the incoming state, before the update
                tl.store(Hc + ((i_g0 + i_c) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                         b_s.to(Hc.dtype.element_ty), mask=m_s)
            b_k = phi_block(k1, k2, k3, r, m_t, i_k, C, BK, NF, D1, D2, D3, K, OUTER, DOT_DT)
            b_s = tl.exp(b_last) * b_s + dot(tl.trans(b_k), b_us, LOWP, DT, PREC)
            tl.store(ht + off_s, b_s.to(ht.dtype.element_ty), mask=m_s)
            if MERGE_PASSES:  # the updated tile is in registers: the next chunk's products now
                b_kx, b_qx = _tile_products(b_s, q1, q2, q3, k1, k2, k3, r_n, m_tn, i_k, NF, D1, D2, D3, K, C, BK,
                                            OUTER, LOWP, PREC)
                b_kn += b_kx
                b_qn += b_qx


# ----- launcher -----
def run_streamed(p: Problem, q, k, v, g, beta, *, h0, ht, cu_seqlens, l2norm: bool, chunk_size: int, block_k: int,
                 block_v: int, num_warps: int, num_stages: int, precision: str, scores: str, prefetch_state: bool,
                 merge_passes: bool, ws: dict) -> torch.Tensor:
    """Allocate o and run :func:`chunk_streamed_kernel` (``ws``: its P and Ai or None each;
    with ``scores`` "tiles", Ai is the [programs, C, C] scratch). ``ht`` holds the state."""
    B, T, H, V = v.shape
    o = args.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    grid = (triton.cdiv(V, block_v), p.num_seqs * H)
    cached(chunk_streamed_kernel)[grid](
        *factor_args(q), *factor_args(k), v, g, beta, o, h0, ht, ws.get("P"), ws.get("Ai"), cu_seqlens,
        None, None, None, None, p.scale, T,
        H=H, NF=len(q), **width_args(p.key_widths, 16), V=V, C=chunk_size, BK=block_k, BV=block_v, L2NORM=l2norm,
        LOWP=lowp_dots(v.dtype), PREC=precision, OUTER=KernelShape(p.key_widths, V).outer_phi_ok(block_k),
        SCORES=scores, PREFETCH_STATE=prefetch_state, MERGE_PASSES=merge_passes,
        num_warps=num_warps, num_stages=num_stages,
    )
    return o


def launch(config: StreamedConfig, p: Problem, q, k, v, g, beta, *, h0, ht, cu_seqlens, l2norm: bool) -> torch.Tensor:
    """Run ``config`` on checked inputs (``p`` from ``check_inputs``); ``ht``: None, or the fp32
    final-state buffer to store into (the state lives there while the kernel runs: without one
    a buffer of its own is allocated). Returns o."""
    if ht is None:
        ht = args.empty(p.state_shape, dtype=torch.float32, device=v.device)
    bk = config.block_k
    shape = KernelShape(p.key_widths, p.value_width)
    ws = prepare_scores(config, p, q, k, v, g, beta, cu_seqlens=cu_seqlens, l2norm=l2norm, block_k=bk,
                        outer=shape.outer_phi_ok(bk), wy=False, scores=not config.scores_on_chip(shape))
    if config.loop == "stepped":
        return chunk_stepped.run(config, p, q, k, v, g, beta, h0=h0, ht=ht, cu_seqlens=cu_seqlens, l2norm=l2norm,
                                 ws=ws)
    if config.loop == "gluon":
        return chunk_streamed_gluon.run(config, p, q, k, v, g, beta, h0=h0, ht=ht, cu_seqlens=cu_seqlens,
                                        l2norm=l2norm, ws=ws)
    return run_streamed(p, q, k, v, g, beta, h0=h0, ht=ht, cu_seqlens=cu_seqlens, l2norm=l2norm,
                        chunk_size=config.chunk_size, block_k=bk, block_v=config.block_v, num_warps=config.num_warps,
                        num_stages=config.num_stages, precision=config.dot_precision, scores="workspace",
                        prefetch_state=config.prefetch_state, merge_passes=config.merge_passes, ws=ws)
