"""The split form of the backward's step 4 (``BackwardConfig.grads_split``; the default above
K = 256): three or four launches where :func:`chunk_backward_grads.chunk_bwd_grads_kernel` is
one. The value pass and the C x C gradients once per chunk (:func:`chunk_bwd_cc_kernel`: dv,
dbeta, and dGq, dGs stored, fp32 C per token each); then phi's gradients, either per chunk *and
key block* (:func:`chunk_bwd_key_block_kernel`, ``factor_grads="workspace"``: K / block_k times
the programs, phi's gradients stored and contracted to the factors by the token-parallel
kernel) or per chunk and *side* (:func:`chunk_bwd_side_kernel`, ``factor_grads="registers"``:
one launch for the queries' factors, one for the keys', each contracting in registers); last
dg from the parts' sums (:func:`chunk_bwd_dg_kernel`).

Why: the one kernel is latency-bound (o3 16x16: 1.93 of 3.31 ms, ~5x its memory floor; H200).
In registers at o3 64x64 it holds both sides' [C, 64] accumulators and the C x C gradients:
255 registers and 1.7 KiB of spill stack a thread at 8 warps (sm_90, Triton 3.6,
``benchmarks/probe_offline.py --backward``); the side kernels take 255 with no spill (the
queries' at 4 warps: 112 B, 98 KB shared, two CTAs an SM). Measured (kernel ms, one kernel ->
C x C + both sides, H200, at d1c1993): o3 64x64 7.05 -> 0.39 + 5.22, 32x32 2.01 -> 0.39 + 1.35,
o4 16^3 6.08 -> 0.41 + 5.11. Notation as ``chunk_backward_grads``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import args
from .args import factor_args
from .blocks import chunk_rows
from .chunk_backward_grads import (
    register_pass, block_grads, block_state_terms, chunk_scores, cc_grads, key_gram, phi_blocks, side_norms,
    side_tiles, value_pass, stored_log_decay,
)
from .launch_cache import cached


@triton.jit
def chunk_bwd_cc_kernel(
    k1, k2, k3, P, Ai, Gc, v, beta, do, Uc, Rc, dUc, dGq, dGs, dv, dbeta, dc, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
):
    """The split form's first kernel, one program per (chunk, head): the value pass (dv stored)
    and the C x C gradients: dGq and, with the delta rule, dGs stored ([B, H, T, C] fp32) for the
    key-block kernel; dbeta stored; dc's shares that need no key block into ``dc`` ([B, H, T]
    fp32, c_last's share on the chunk's last row; gates only)."""
    USE_BETA: tl.constexpr = beta is not None
    o_c, m_t, r, p_row, i_last, p_last, i_s, i_h = chunk_rows(T, H, C, cu_seqlens, chunk_indices)
    b_c, b_last = stored_log_decay(Gc, p_row, m_t, p_last, C)
    b_P, b_Ai, b_b, off_w = chunk_scores(P, Ai, beta, r, p_row, m_t, o_c, C, USE_BETA)
    b_dP, b_dT, b_db, b_dc, b_dlast = value_pass(b_P, b_Ai, b_b, v, do, Uc, Rc, dUc, dv, r, m_t, scale, V, C,
                                                 BV, USE_BETA, PREC)
    b_gk = b_P
    if USE_BETA:
        b_k1, b_k2, b_k3, rk1, rk2, rk3 = side_tiles(k1, k2, k3, r, m_t, NF, D1, D2, D3, L2NORM)
        b_gk = key_gram(k1, b_k1, b_k2, b_k3, rk1, r, m_t, NF, C, BK, D1, D2, D3, PREC)
    b_dGq, b_dGs, b_db, b_dc = cc_grads(b_dP, b_dT, b_db, b_dc, b_P, b_Ai, b_b, b_c, b_gk, scale, C, USE_BETA,
                                        PREC)
    tl.store(dGq + off_w, b_dGq, mask=m_t[:, None])
    if USE_BETA:
        tl.store(dGs + off_w, b_dGs, mask=m_t[:, None])
        tl.store(dbeta + r, b_db.to(dbeta.dtype.element_ty), mask=m_t)
    if Gc is not None:
        # padded rows add nothing to dc, so c_last's share may sit on the last valid row
        tl.store(dc + p_row, b_dc + tl.where(o_c == i_last, b_dlast, 0.0), mask=m_t)


@triton.jit
def chunk_bwd_key_block_kernel(
    q1, q2, q3, k1, k2, k3, Qw, Kw, Gc, do, Hc, dHc, Uc, dv, dGq, dGs, dQp, dKp, dc_part, cu_seqlens, chunk_indices,
    scale, T, rows, H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
    PREC: tl.constexpr,
):
    """The split form's second kernel, one program per (chunk, head, key block ``program_id(2)``):
    phi(Q)'s and phi(K)'s gradients at the block's columns, stored to ``dQp`` / ``dKp``
    ([B, H, T, K] in the workspace type), from the first kernel's dGq, dGs and dv (dR) and the
    state loops' S, dS', U; dc's share of the block (with c_last's on the chunk's last row) into
    ``dc_part[program_id(2)]`` (``rows`` = B H T apart; gates only). ``dGs`` None: no delta rule."""
    USE_BETA: tl.constexpr = dGs is not None
    K: tl.constexpr = D1 * D2 * D3
    i_k = tl.program_id(2)
    o_c, m_t, r, p_row, i_last, p_last, i_s, i_h = chunk_rows(T, H, C, cu_seqlens, chunk_indices)
    b_c, b_last = stored_log_decay(Gc, p_row, m_t, p_last, C)
    b_gam = tl.exp(b_c)
    b_r = tl.exp(b_last - b_c)
    # (the norms go unused where phi comes normalised from the resident loops' workspaces)
    rq1, rq2, rq3 = side_norms(q1, q2, q3, r, m_t, NF, D1, D2, D3, L2NORM)
    rk1, rk2, rk3 = side_norms(k1, k2, k3, r, m_t, NF, D1, D2, D3, L2NORM)
    off_w = p_row[:, None] * C + o_c[None, :]
    b_dGq = tl.load(dGq + off_w, mask=m_t[:, None], other=0.0)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = m_t[:, None] & (o_k < K)[None, :]
    off_s = (i_s * H + i_h) * K * V
    b_dGs = tl.zeros([C, C], dtype=tl.float32)
    if USE_BETA:
        b_dGs = tl.load(dGs + off_w, mask=m_t[:, None], other=0.0)
    b_dq, b_dk, b_sds = block_state_terms(do, Uc, dv, Hc, dHc, b_gam, b_r, scale, r, m_t, o_k, off_s, V, C, BK, BV,
                                          USE_BETA, PREC)
    b_q, b_k = phi_blocks(Qw, Kw, q1, q2, q3, k1, k2, k3, rq1, rq2, rq3, rk1, rk2, rk3, p_row, r, m_t, i_k, NF, C, BK,
                          D1, D2, D3)
    zero = tl.zeros([C], dtype=tl.float32)
    b_dq, b_dk, b_dc, b_dlast = block_grads(b_q, b_k, b_dq, b_dk, b_sds, b_dGq, b_dGs, zero, b_last * 0.0, b_last,
                                            USE_BETA, PREC)
    tl.store(dQp + p_row[:, None] * K + o_k[None, :], b_dq.to(dQp.dtype.element_ty), mask=m_k)
    tl.store(dKp + p_row[:, None] * K + o_k[None, :], b_dk.to(dKp.dtype.element_ty), mask=m_k)
    if Gc is not None:
        b_dc += tl.where(o_c == i_last, b_dlast, 0.0)
        tl.store(dc_part + i_k * rows + p_row, b_dc, mask=m_t)


@triton.jit
def chunk_bwd_side_kernel(
    q1, q2, q3, k1, k2, k3, Gc, do, Hc, dHc, Uc, dv, dGq, dGs, dx1, dx2, dx3, dc_part, cu_seqlens, chunk_indices, scale,
    T, rows, H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SIDE: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
):
    """The split form's second kernel with ``factor_grads="registers"`` (NF >= 2), one program per
    (chunk, head) and one launch per side: the queries' factors' gradients (SIDE 0) or the keys'
    (SIDE 1) into ``dx*``, contracted in registers over the key blocks
    (``chunk_backward_grads.register_pass``) from the first kernel's dGq, dGs and dv (dR) and
    the state loops' S, dS', U. One side's accumulators, not both (o3 64x64: four [C, 64] fp32
    tiles in the one-kernel form). dc's share of the side (the queries' state share, or c_last's
    on the chunk's last row) into ``dc_part[SIDE]`` (gates only). ``dGs`` None: no delta rule."""
    USE_BETA: tl.constexpr = dGs is not None
    K: tl.constexpr = D1 * D2 * D3
    o_c, m_t, r, p_row, i_last, p_last, i_s, i_h = chunk_rows(T, H, C, cu_seqlens, chunk_indices)
    b_c, b_last = stored_log_decay(Gc, p_row, m_t, p_last, C)
    off_w = p_row[:, None] * C + o_c[None, :]
    b_dGq = tl.load(dGq + off_w, mask=m_t[:, None], other=0.0)
    b_dGs = tl.zeros([C, C], dtype=tl.float32)
    if USE_BETA:
        b_dGs = tl.load(dGs + off_w, mask=m_t[:, None], other=0.0)
    b_q1, b_q2, b_q3, rq1, rq2, rq3 = side_tiles(q1, q2, q3, r, m_t, NF, D1, D2, D3, L2NORM)
    b_k1, b_k2, b_k3, rk1, rk2, rk3 = side_tiles(k1, k2, k3, r, m_t, NF, D1, D2, D3, L2NORM)
    b_dc, b_dlast = register_pass(q1, q2, q3, k1, k2, k3, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, rq1, rq2, rk1, rk2, do,
                                   Hc, dHc, Uc, dv, dx1, dx2, dx3, dx1, dx2, dx3, b_dGq, b_dGs, tl.exp(b_c),
                                   tl.exp(b_last - b_c), tl.zeros([C], dtype=tl.float32), b_last * 0.0, b_last, scale,
                                   r, m_t, (i_s * H + i_h) * K * V, NF, D1, D2, D3, V, C, BK, BV, USE_BETA, L2NORM,
                                   SIDE == 0, SIDE == 1, PREC)
    if Gc is not None:
        tl.store(dc_part + SIDE * rows + p_row, b_dc + tl.where(o_c == i_last, b_dlast, 0.0), mask=m_t)


@triton.jit
def chunk_bwd_dg_kernel(dc, dc_part, dg, cu_seqlens, chunk_indices, T, rows, H: tl.constexpr, C: tl.constexpr,
                        NKB: tl.constexpr):
    """The split form's last kernel, one program per (chunk, head): dc = the first kernel's share
    + every key block's (``dc_part``, ``NKB`` x ``rows``), then dg_t = the sum of dc over the
    chunk's rows from t on."""
    o_c, m_t, r, p_row, i_last, p_last, i_s, i_h = chunk_rows(T, H, C, cu_seqlens, chunk_indices)
    b_dc = tl.load(dc + p_row, mask=m_t, other=0.0)
    for i_k in range(NKB):
        b_dc += tl.load(dc_part + i_k * rows + p_row, mask=m_t, other=0.0)
    b_dg = tl.sum(b_dc, axis=0) - tl.cumsum(b_dc, axis=0) + b_dc
    tl.store(dg + r, b_dg.to(dg.dtype.element_ty), mask=m_t)


@dataclass(frozen=True)
class GradsTensors:
    """What step 4 of ``chunk_backward.launch_backward`` reads and writes, by its names there: the inputs
    (``q``, ``k`` tuples of factors; ``g``, ``beta`` None when the feature is off) and ``do``, the
    prepare kernel's workspaces ``ws``, the stored chunk states and their gradients (``Hc``,
    ``dHc``), the recomputed ``Uc``, ``Rc``, ``dUc``, the outputs it writes (phi's stored
    gradients ``dQp``, ``dKp``, None when the factors' ``dq``, ``dk`` are formed in registers;
    ``dv``, ``dg``, ``dbeta``) and the varlen index (``cu_seqlens`` None when dense). Keyword
    construction only: 19 tensors in a positional list were a defect."""
    q: tuple
    k: tuple
    v: torch.Tensor
    g: torch.Tensor | None
    beta: torch.Tensor | None
    do: torch.Tensor
    ws: dict
    Hc: torch.Tensor
    dHc: torch.Tensor
    Uc: torch.Tensor
    Rc: torch.Tensor
    dUc: torch.Tensor
    dQp: torch.Tensor | None
    dKp: torch.Tensor | None
    dq: list
    dk: list
    dv: torch.Tensor
    dg: torch.Tensor | None
    dbeta: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    idx: torch.Tensor


def split_grads(config, p, t: GradsTensors, grid: tuple, widths: dict, l2norm: bool) -> None:
    """Step 4 of ``chunk_backward.launch_backward`` split (``config.grads_split``; ``p`` the checked
    Problem, ``t`` the step's tensors, ``grid`` and ``widths`` the monolithic grads kernel's): the
    C x C gradients per chunk (:func:`chunk_bwd_cc_kernel`: dv, dbeta, dGq, dGs, dc's share);
    phi's gradients per chunk and key block (:func:`chunk_bwd_key_block_kernel`, ``t.dQp``
    given) or the factors' per chunk and side (:func:`chunk_bwd_side_kernel`, ``t.dQp`` None);
    then dg (:func:`chunk_bwd_dg_kernel`)."""
    q, k, v, g, beta, do, ws = t.q, t.k, t.v, t.g, t.beta, t.do, t.ws
    B, T, H, V = v.shape
    C, K, dev = config.chunk_size, p.key_dim, v.device
    bk = min(config.block_k, K)
    nkb = triton.cdiv(K, bk)
    rows = B * H * T
    consts = {"H": H, "NF": len(q), **widths, "V": V, "C": C, "BK": bk, "BV": config.block_v, "L2NORM": l2norm,
              "PREC": config.dot_precision}
    dGq = args.empty(B, H, T, C, dtype=torch.float32, device=dev)
    dGs = args.empty(B, H, T, C, dtype=torch.float32, device=dev) if beta is not None else None
    dc = args.empty(B, H, T, dtype=torch.float32, device=dev) if g is not None else None
    registers = t.dQp is None  # factor_grads="registers": one program per chunk and side, not per key block
    parts = 2 if registers else nkb
    dc_part = args.empty(parts, B, H, T, dtype=torch.float32, device=dev) if g is not None else None
    # the C x C kernel and the queries' side kernel (one product per key block, no dS') at up to 4
    # warps, the keys' at grads_warps: two CTAs an SM (98 KB shared at o3 64x64 C 64, sm_90) where 8
    # warps leave one; fwd+bwd o3 64x64 18.24 -> 17.47 ms, 32x32 (4 warps) the same (H200, 2026-12-03)
    light = min(4, config.grads_warps)
    cached(chunk_bwd_cc_kernel)[grid](
        *factor_args(k), ws["P"], ws["Ai"], ws["Gc"], v, beta, do, t.Uc, t.Rc, t.dUc, dGq, dGs, t.dv, t.dbeta, dc,
        t.cu_seqlens, t.idx, p.scale, T, **consts, num_warps=light, num_stages=config.grads_stages,
    )
    if registers:
        consts["BV"] = config.grads_bv
        for side, dx in enumerate((t.dq, t.dk)):
            cached(chunk_bwd_side_kernel)[grid](
                *factor_args(q), *factor_args(k), ws["Gc"], do, t.Hc, t.dHc, t.Uc, t.dv, dGq, dGs, *factor_args(dx),
                dc_part, t.cu_seqlens, t.idx, p.scale, T, rows, **consts, SIDE=side,
                num_warps=config.grads_warps if side else light,
                num_stages=config.grads_stages,
            )
    else:
        cached(chunk_bwd_key_block_kernel)[(*grid, nkb)](
            *factor_args(q), *factor_args(k), ws["Qw"], ws["Kw"], ws["Gc"], do, t.Hc, t.dHc, t.Uc, t.dv, dGq, dGs,
            t.dQp, t.dKp, dc_part, t.cu_seqlens, t.idx, p.scale, T, rows, **consts, num_warps=config.grads_warps,
            num_stages=config.grads_stages,
        )
    if g is not None:
        cached(chunk_bwd_dg_kernel)[grid](dc, dc_part, t.dg, t.cu_seqlens, t.idx, T, rows, H=H, C=C, NKB=parts,
                                          num_warps=4)
