"""The chunk-parallel kernels of the backward (``chunk_backward.py`` launches them).

:func:`chunk_bwd_grads_kernel`, one program per (chunk, head): first, over value blocks, the
C x C gradients (scores dP, inverse dT and through it dA), dv, dbeta's and dc's shares that need
no key contraction; then phi(Q)'s gradient (with dc's state share) and phi(K)'s, either stored
(``factor_grads="workspace"``, [B, H, T, K] in the workspace type: one pass over key blocks of
BK columns, which may write them over phi's own workspaces; ``"rows"``: the same pass over one
block of whole rows, contracted to the factors there) or contracted to the factors in
registers block by block (:func:`register_pass`); last, dg (a reverse cumulative sum of dc
within the chunk).
(``chunk_backward_factors.py``: the stored phi gradients to the factors, token-parallel.)

In registers, the Kronecker structure does the work of a [T, K] workspace. The within-chunk
terms (dGq phi(K) and its kin) contract to factor i in C x C space: (dGq * prod_{j != i} q_j
k_j^T) k_i. The state terms (dO S^T, U dS'^T, dR S^T) are formed on the tensor cores in key
blocks of whole rows of the last factor (block_k / d_last leading indices), so contracting a
block is column updates (rowsum(d * x_last) times the other leading entries) and outer-product
updates of the last factor's gradient; no phi block is built. Stored, phi's gradients cost a
fifth launch and, where they cannot go over phi, 2 K elements per token-head.

No [C, K] or [K, V] tile is held whole: the key loop keeps [C, BK] and [BK, BV] tiles (the
single-kernel form before it held [C, K] phi tiles and gradients and spilled ~14 KiB of stack
per thread at o3 16x16 on sm_90). Two identities of the forward recompute save key
contractions: Gamma phi(K) S = V - R (R stored by the recompute) and r (phi(K) dS') = dU - s P^T dO
(dU stored by the state-gradient loop).

Notation (``chunk_backward.py``): c = cumsum(g) within the chunk, Gamma = exp(c), gamma =
exp(c_last), r = gamma / Gamma, D_ij = exp(c_i - c_j) (j <= i), P = Gq * D the scores, T = (I +
A)^-1 (``Ai``), S the incoming state (``Hc``), dS' the outgoing state's gradient (``dHc``), U
and R as the recompute stored them (``Uc``, ``Rc``), dU (``dUc``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .blocks import chunk_rows, dot, factor_inv_norm, one_side_tiles
from .chunk_backward_factors import store_factor_grads, store_side_grads


@triton.jit
def f32dot(a, b, PREC: tl.constexpr):
    """a @ b in fp32 at precision PREC: every product here has a derived operand (a transposed
    or masked product), the pattern Triton 3.4-3.7 miscompiles on Hopper with 16-bit operands
    (fla #640); the tuner's gradient gate checks each precision on the GPU."""
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def stored_log_decay(Gc, p_row, m_t, p_last, C: tl.constexpr):
    """The chunk's cumulative log decay c from the prepare kernel's ``Gc`` at rows ``p_row`` and
    c_last at row ``p_last`` (its last token); padded rows take c_last, as the within-chunk sum
    gives them (they add 0). ``Gc`` None (no gates): zeros."""
    b_c = tl.zeros([C], dtype=tl.float32)
    b_last = 0.0
    if Gc is not None:
        b_last = tl.load(Gc + p_last)
        b_c = tl.where(m_t, tl.load(Gc + p_row, mask=m_t, other=0.0), b_last)
    return b_c, b_last


@triton.jit
def _rows(x, r, o_v, m, V: tl.constexpr):
    """A [C, BV] block of a token-major [.., V] tensor, fp32."""
    return tl.load(x + r[:, None] * V + o_v[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def value_pass(b_P, b_Ai, b_b, v, do, Uc, Rc, dUc, dv, r, m_t, scale, V: tl.constexpr, C: tl.constexpr,
               BV: tl.constexpr, USE_BETA: tl.constexpr, PREC: tl.constexpr):
    """Over the value blocks: dP = dO U^T, dT = dU R^T diag(b), db = rowsum(dR' R), the dc terms
    -r (U . phi(K) dS') and -(dR . Gamma phi(K) S), c_last's term sum(r (U . phi(K) dS')), and
    dv (stored)."""
    b_dP = tl.zeros([C, C], dtype=tl.float32)
    b_dT = tl.zeros([C, C], dtype=tl.float32)
    b_db = tl.zeros([C], dtype=tl.float32)
    b_dc = tl.zeros([C], dtype=tl.float32)
    b_ru = tl.zeros([C], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_o = m_t[:, None] & (o_v < V)[None, :]
        b_do = _rows(do, r, o_v, m_o, V)
        b_u = _rows(Uc, r, o_v, m_o, V)
        b_du = _rows(dUc, r, o_v, m_o, V)
        b_dP += f32dot(b_do, tl.trans(b_u), PREC)
        # r (phi(K) dS') = dU - s P^T dO
        b_ru += tl.sum(b_u * (b_du - scale * f32dot(tl.trans(b_P), b_do, PREC)), axis=1)
        if USE_BETA:
            b_R = _rows(Rc, r, o_v, m_o, V)
            b_drp = f32dot(tl.trans(b_Ai), b_du, PREC)  # dR' = T^T dU
            b_dr = b_b[:, None] * b_drp
            b_db += tl.sum(b_drp * b_R, axis=1)
            b_dT += f32dot(b_du, tl.trans(b_b[:, None] * b_R), PREC)
            b_dc -= tl.sum(b_dr * (_rows(v, r, o_v, m_o, V) - b_R), axis=1)  # Gamma phi(K) S = V - R
            tl.store(dv + r[:, None] * V + o_v[None, :], b_dr.to(dv.dtype.element_ty), mask=m_o)
        else:
            tl.store(dv + r[:, None] * V + o_v[None, :], b_du.to(dv.dtype.element_ty), mask=m_o)
    return b_dP, b_dT, b_db, b_dc - b_ru, tl.sum(b_ru, axis=0)


@triton.jit
def block_state_terms(do, Uc, dv, Hc, dHc, b_gam, b_r, scale, r, m_t, o_k, off_s, V: tl.constexpr, C: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, USE_BETA: tl.constexpr, PREC: tl.constexpr):
    """Key block ``o_k``'s state terms of both sides, summed over value blocks: s Gamma dO S^T and
    r U dS'^T - Gamma dR S^T ([C, BK] fp32 each) and sum(S * dS'). Each S^T and dS'^T tile
    ([BV, BK]: loaded, not derived, operands) loads once for both sides, and 16-bit operands
    multiply in their own type, as in :func:`register_pass` (fp32 ones at PREC): per side, in
    fp32 at tf32, the gradients kernel took 0.994 ms at o3 16x16 B8 T4096 H8 bf16, now 0.803
    (fwd+bwd 2.073 -> 1.854 ms, bf16 errors unchanged within 4e-3 - 8e-3; H200). dR = diag(b) T^T dU is read back from ``dv`` (the value pass stored it there,
    in v's type) instead of formed again per key block (which kept T live and cost a [C, C] x
    [C, BV] product per key and value block)."""
    DT: tl.constexpr = Hc.dtype.element_ty
    LOWP: tl.constexpr = DT != tl.float32
    b_dq = tl.zeros([C, BK], dtype=tl.float32)
    b_dk = tl.zeros([C, BK], dtype=tl.float32)
    b_sds = 0.0
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_o = m_t[:, None] & m_v[None, :]
        p_o = r[:, None] * V + o_v[None, :]
        off = off_s + o_k[None, :] * V + o_v[:, None]
        b_st = tl.load(Hc + off, mask=m_v[:, None], other=0.0)
        b_dst = tl.load(dHc + off, mask=m_v[:, None], other=0.0)
        b_sds += tl.sum(tl.sum(b_st.to(tl.float32) * b_dst.to(tl.float32), axis=1), axis=0)
        b_dq += (scale * b_gam)[:, None] * dot(tl.load(do + p_o, mask=m_o, other=0.0), b_st, LOWP, DT, PREC)
        b_dk += b_r[:, None] * dot(tl.load(Uc + p_o, mask=m_o, other=0.0), b_dst, LOWP, DT, PREC)
        if USE_BETA:
            b_dk -= b_gam[:, None] * dot(tl.load(dv + p_o, mask=m_o, other=0.0), b_st, LOWP, DT, PREC)
    return b_dq, b_dk, b_sds


@triton.jit
def side_block(Xw, x1, x2, x3, b_rho1, b_rho2, b_rho3, p_row, r, m_t, i_k, NF: tl.constexpr, C: tl.constexpr,
               BK: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """Key block ``i_k`` of one side's normalised phi ([C, BK] fp32): from the resident state
    loops' workspace ``Xw`` ([B, H, T, K]) when given, else built from the factors."""
    K: tl.constexpr = D1 * D2 * D3
    if Xw is not None:
        o_k = i_k * BK + tl.arange(0, BK)
        b_x = tl.load(Xw + p_row[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)
        b_x = b_x.to(tl.float32)
    else:
        b_x = _phi_block(x1, x2, x3, b_rho1, b_rho2, b_rho3, r, m_t, i_k, NF, C, BK, D1, D2, D3)
    return b_x


@triton.jit
def _gathered(x, r, idx, m, D: tl.constexpr, b_rho):
    """x[r, idx] * rho ([C, BK] fp32): a factor's entries at each column of a key block."""
    return tl.load(x + r[:, None] * D + idx, mask=m, other=0.0).to(tl.float32) * b_rho[:, None]


@triton.jit
def _phi_block(x1, x2, x3, b_rho1, b_rho2, b_rho3, r, m_t, i_k, NF: tl.constexpr, C: tl.constexpr,
               BK: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """Key block ``i_k`` ([C, BK] fp32) of the normalised phi = x1 (x) x2 (x) x3 (row-major),
    each factor's entries read at every column (cached loads of [C, d_i] rows) and scaled by
    the rows' 1 / ||x_i|| ``b_rho*``."""
    o_k = i_k * BK + tl.arange(0, BK)
    m = m_t[:, None] & (o_k < D1 * D2 * D3)[None, :]
    b_phi = _gathered(x1, r, (o_k // (D2 * D3))[None, :], m, D1, b_rho1)
    if NF > 1:
        b_phi *= _gathered(x2, r, ((o_k // D3) % D2)[None, :], m, D2, b_rho2)
    if NF > 2:
        b_phi *= _gathered(x3, r, (o_k % D3)[None, :], m, D3, b_rho3)
    return b_phi


@triton.jit
def key_gram(k1, b_k1, b_k2, b_k3, b_rho, r, m_t, NF: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
             D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, PREC: tl.constexpr):
    """phi(K) phi(K)^T of the chunk (normalised): the product of the factors' Grams (the
    Kronecker identity) for NF >= 2, over key blocks for NF 1."""
    if NF == 1:
        b_G = tl.zeros([C, C], dtype=tl.float32)
        for i_k in range(tl.cdiv(D1, BK)):
            b_k = _phi_block(k1, k1, k1, b_rho, b_rho, b_rho, r, m_t, i_k, NF, C, BK, D1, D2, D3)
            b_G += f32dot(b_k, tl.trans(b_k), PREC)
    else:
        b_G = f32dot(b_k1, tl.trans(b_k1), PREC) * f32dot(b_k2, tl.trans(b_k2), PREC)
        if NF == 3:
            b_G *= f32dot(b_k3, tl.trans(b_k3), PREC)
    return b_G


@triton.jit
def side_norms(x1, x2, x3, r, m_t, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
               L2NORM: tl.constexpr):
    """Each factor's 1 / ||x_i|| per row (with L2NORM, else ones): what a phi block built from
    the factors scales by."""
    b_rho1 = tl.full(m_t.shape, 1.0, tl.float32)
    b_rho2, b_rho3 = b_rho1, b_rho1
    if L2NORM:
        b_rho1 = factor_inv_norm(x1, r[:, None], m_t[:, None], D1, D1)
        if NF > 1:
            b_rho2 = factor_inv_norm(x2, r[:, None], m_t[:, None], D2, D2)
        if NF > 2:
            b_rho3 = factor_inv_norm(x3, r[:, None], m_t[:, None], D3, D3)
    return b_rho1, b_rho2, b_rho3


@triton.jit
def side_tiles(x1, x2, x3, r, m_t, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
               L2NORM: tl.constexpr):
    """One side's normalised factor tiles (NF >= 2; NF 1: placeholders, phi read per block) and
    each factor's 1 / ||x_i|| per row (with L2NORM, else ones)."""
    b_rho1, b_rho2, b_rho3 = side_norms(x1, x2, x3, r, m_t, NF, D1, D2, D3, L2NORM)
    if NF == 1:
        b_x1 = b_rho1[:, None]
        b_x2, b_x3 = b_x1, b_x1
    else:
        b_x1, b_x2, b_x3 = one_side_tiles(x1, x2, x3, r, m_t, NF, D1, D2, D3, D1, D2, D3, L2NORM)
    return b_x1, b_x2, b_x3, b_rho1, b_rho2, b_rho3


@triton.jit
def cc_grads(b_dP, b_dT, b_db, b_dc, b_P, b_Ai, b_b, b_c, b_gk, scale, C: tl.constexpr, USE_BETA: tl.constexpr,
             PREC: tl.constexpr):
    """The C x C gradients: dGq = s dP * D (lower, diagonal included), with the delta rule dA =
    -(T^T dT T^T) (strictly lower) and dGs = dGk + dGk^T, dGk = dA * b_i D_ij; dbeta's and dc's
    shares from them (``b_gk``: phi(K) phi(K)^T). Returns (dGq, dGs, db, dc)."""
    o_c = tl.arange(0, C)
    m_incl = o_c[:, None] >= o_c[None, :]
    b_D = tl.exp(tl.where(m_incl, b_c[:, None] - b_c[None, :], float("-inf")))
    b_dP = tl.where(m_incl, scale * b_dP, 0.0)
    b_dGq = b_dP * b_D
    b_E = b_dP * b_P
    b_dGs = tl.zeros([C, C], dtype=tl.float32)
    if USE_BETA:
        b_dA = -f32dot(tl.trans(b_Ai), f32dot(b_dT, tl.trans(b_Ai), PREC), PREC)
        b_dA = tl.where(o_c[:, None] > o_c[None, :], b_dA, 0.0)
        b_gkD = b_gk * b_D
        b_db += tl.sum(b_dA * b_gkD, axis=1)
        b_dGk = b_dA * b_b[:, None] * b_D
        b_E += b_dA * b_b[:, None] * b_gkD
        b_dGs = b_dGk + tl.trans(b_dGk)
    b_dc += tl.sum(b_E, axis=1) - tl.sum(b_E, axis=0)
    return b_dGq, b_dGs, b_db, b_dc


@triton.jit
def chunk_scores(P, Ai, beta, r, p_row, m_t, o_c, C: tl.constexpr, USE_BETA: tl.constexpr):
    """The prepare kernel's scores P and inverse T (``Ai``; zeros without the delta rule) of the
    chunk and beta (zeros without), fp32, and the [C, C] workspace offsets ``off_w``."""
    off_w = p_row[:, None] * C + o_c[None, :]
    b_P = tl.load(P + off_w, mask=m_t[:, None], other=0.0)
    b_b = tl.zeros([C], dtype=tl.float32)
    b_Ai = tl.zeros([C, C], dtype=tl.float32)
    if USE_BETA:
        b_b = tl.load(beta + r, mask=m_t, other=0.0).to(tl.float32)
        # loaded again: the value pass's copy kept two shared-memory layouts of it live through cc_grads
        # (o3 32x32 122880 -> 114688 B, two CTAs an SM; gradients kernel 2.52 -> 1.93 ms, H200)
        b_Ai = tl.load(Ai + off_w, mask=m_t[:, None], other=0.0)
    return b_P, b_Ai, b_b, off_w


@triton.jit
def phi_blocks(Qw, Kw, q1, q2, q3, k1, k2, k3, rq1, rq2, rq3, rk1, rk2, rk3, p_row, r, m_t, i_k, NF: tl.constexpr,
               C: tl.constexpr, BK: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """Key block ``i_k`` of phi(Q) and of phi(K) ([C, BK] fp32 each; :func:`side_block`)."""
    b_q = side_block(Qw, q1, q2, q3, rq1, rq2, rq3, p_row, r, m_t, i_k, NF, C, BK, D1, D2, D3)
    b_k = side_block(Kw, k1, k2, k3, rk1, rk2, rk3, p_row, r, m_t, i_k, NF, C, BK, D1, D2, D3)
    return b_q, b_k


@triton.jit
def block_grads(b_q, b_k, b_dq, b_dk, b_sds, b_dGq, b_dGs, b_dc, b_dlast, b_last, USE_BETA: tl.constexpr,
                PREC: tl.constexpr):
    """A key block's phi(Q) and phi(K) gradients ([C, BK]) from its state terms (``b_dq``, ``b_dk``,
    ``b_sds``: :func:`block_state_terms`) and its phi(Q), phi(K) blocks, with the block's shares
    of dc (the state term's) and of c_last added. Returns (dq, dk, dc, dc_last)."""
    b_dc += tl.sum(b_dq * b_q, axis=1)
    b_dlast += tl.exp(b_last) * b_sds
    b_dq += f32dot(b_dGq, b_k, PREC)
    b_dk += f32dot(tl.trans(b_dGq), b_q, PREC)
    if USE_BETA:
        b_dk += f32dot(b_dGs, b_k, PREC)
    return b_dq, b_dk, b_dc, b_dlast


@triton.jit
def _stored_pass(Qw, Kw, q1, q2, q3, k1, k2, k3, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, rq1, rq2, rq3, rk1, rk2, rk3,
                 do, Hc, dHc, Uc, dv, dQp, dKp, dq1, dq2, dq3, dk1, dk2, dk3, b_dGq, b_dGs, b_gam, b_r, b_dc, b_dlast,
                 b_last, scale, p_row, r, m_t, off_s, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                 D3: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 USE_BETA: tl.constexpr, L2NORM: tl.constexpr, ROWS: tl.constexpr, PREC: tl.constexpr):
    """phi's gradients formed per key block, both sides' gradients of a block from one load of
    its phi blocks. Stored ([B, H, T, K], ``p_row``) after every thread has read those, so
    ``dQp`` / ``dKp`` may be ``Qw`` / ``Kw`` themselves (each program reads and writes only its
    own chunk's rows, block by block); with ROWS (one block, BK = K) contracted to the factors
    (normalised tiles ``b_q*`` / ``b_k*``) in registers and stored into ``dq*`` / ``dk*``, so
    no [T, K] gradient is written and read back. Returns (dc, dc_last's share)."""
    K: tl.constexpr = D1 * D2 * D3
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        b_dq, b_dk, b_sds = block_state_terms(do, Uc, dv, Hc, dHc, b_gam, b_r, scale, r, m_t, o_k, off_s, V, C, BK,
                                              BV, USE_BETA, PREC)
        b_q, b_k = phi_blocks(Qw, Kw, q1, q2, q3, k1, k2, k3, rq1, rq2, rq3, rk1, rk2, rk3, p_row, r, m_t, i_k, NF, C,
                              BK, D1, D2, D3)
        b_dq, b_dk, b_dc, b_dlast = block_grads(b_q, b_k, b_dq, b_dk, b_sds, b_dGq, b_dGs, b_dc, b_dlast, b_last,
                                                USE_BETA, PREC)
        if ROWS:
            store_side_grads(b_dq, q1, q2, q3, dq1, dq2, dq3, b_q1, b_q2, b_q3, r, m_t, NF, C, D1, D2, D3, L2NORM)
            store_side_grads(b_dk, k1, k2, k3, dk1, dk2, dk3, b_k1, b_k2, b_k3, r, m_t, NF, C, D1, D2, D3, L2NORM)
        else:
            tl.debug_barrier()  # every thread has read this block of phi: its gradients may go over it
            off = p_row[:, None] * K + o_k[None, :]
            m = m_t[:, None] & (o_k < K)[None, :]
            tl.store(dQp + off, b_dq.to(dQp.dtype.element_ty), mask=m)
            tl.store(dKp + off, b_dk.to(dKp.dtype.element_ty), mask=m)
    return b_dc, b_dlast


@triton.jit
def _factor_column(x, r, m_t, j, D: tl.constexpr, b_rho):
    """Column ``j`` of a factor at rows ``r``, normalised by ``b_rho`` ([C] fp32; a cached load,
    no cross-thread reduction)."""
    return tl.load(x + r * D + j, mask=m_t, other=0.0).to(tl.float32) * b_rho


@triton.jit
def _factor_columns(x, r, m_t, o_j, D: tl.constexpr, b_rho):
    """Columns ``o_j`` ([NL]) of a factor at rows ``r``, normalised by ``b_rho``: [C, NL] fp32."""
    return tl.load(x + r[:, None] * D + o_j[None, :], mask=m_t[:, None], other=0.0).to(tl.float32) * b_rho[:, None]


@triton.jit
def _lead_columns(x1, x2, b_rho1, b_rho2, r, m_t, i_k, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                  NL: tl.constexpr):
    """The leading factors' normalised entries that key block ``i_k`` (NL leading indices) takes:
    NF 2, x1's columns ([C], or [C, NL]); NF 3, x1's column at the block's first index ([C]) and
    x2's ([C], or [C, NL]); the second is the first where NF is 2. Loaded one block ahead in
    :func:`register_pass`: loaded in the block, their latency opened every step (o3 64x64
    side kernels ~1.2 of 7.0 ms, H200)."""
    o_l = tl.arange(0, NL)
    if NF == 2:
        if NL == 1:
            b_c1 = _factor_column(x1, r, m_t, i_k, D1, b_rho1)
        else:
            b_c1 = _factor_columns(x1, r, m_t, i_k * NL + o_l, D1, b_rho1)
        b_c2 = b_c1
    else:
        b_c1 = _factor_column(x1, r, m_t, (i_k * NL) // D2, D1, b_rho1)
        if NL == 1:
            b_c2 = _factor_column(x2, r, m_t, i_k % D2, D2, b_rho2)
        else:
            b_c2 = _factor_columns(x2, r, m_t, (i_k * NL) % D2 + o_l, D2, b_rho2)
    return b_c1, b_c2


@triton.jit
def _lead_block_to_factors(b_d, b_c1, b_c2, b_x2, b_x3, a1, a2, a3, i_k, NF: tl.constexpr, D1: tl.constexpr,
                           D2: tl.constexpr, C: tl.constexpr, NL: tl.constexpr, DL: tl.constexpr):
    """Add key block ``i_k`` of phi's gradient ``b_d`` ([C, NL D_last]: the last axis whole at NL
    leading indices) to the factors' accumulators ``a*`` ([C, d_i]): the last factor's gains d
    times the leading entries (``b_c*``, :func:`_lead_columns`); each leading factor's column at
    its index, rowsum(d * x_last) times the other leading entries. At order 4 the NL indices
    share the first axis' index."""
    if NL == 1:
        if NF == 2:
            a2 += b_d * b_c1[:, None]
            a1 += tl.where(tl.arange(0, D1)[None, :] == i_k, tl.sum(b_d * b_x2, axis=1)[:, None], 0.0)
        else:
            i1 = i_k // D2
            i2 = i_k % D2
            a3 += b_d * (b_c1 * b_c2)[:, None]
            b_s = tl.sum(b_d * b_x3, axis=1)
            a1 += tl.where(tl.arange(0, D1)[None, :] == i1, (b_s * b_c2)[:, None], 0.0)
            a2 += tl.where(tl.arange(0, D2)[None, :] == i2, (b_s * b_c1)[:, None], 0.0)
    else:  # the block as [C, NL, D_last]: one lead per middle index
        b_d3 = tl.reshape(b_d, [C, NL, DL])
        o_l = tl.arange(0, NL)
        if NF == 2:
            i1 = i_k * NL + o_l
            a2 += tl.sum(b_d3 * b_c1[:, :, None], axis=1)
            b_s = tl.sum(b_d3 * b_x2[:, None, :], axis=2)
            a1 += tl.sum(tl.where(tl.arange(0, D1)[None, None, :] == i1[None, :, None], b_s[:, :, None], 0.0), axis=1)
        else:
            i1 = (i_k * NL) // D2
            i2 = (i_k * NL) % D2 + o_l
            a3 += tl.sum(b_d3 * (b_c1[:, None] * b_c2)[:, :, None], axis=1)
            b_s = tl.sum(b_d3 * b_x3[:, None, :], axis=2)
            a1 += tl.where(tl.arange(0, D1)[None, :] == i1, tl.sum(b_s * b_c2, axis=1)[:, None], 0.0)
            a2 += tl.sum(tl.where(tl.arange(0, D2)[None, None, :] == i2[None, :, None],
                                  (b_s * b_c1[:, None])[:, :, None], 0.0), axis=1)
    return a1, a2, a3


@triton.jit
def _gram_except(xa1, xa2, xa3, xb1, xb2, xb3, I: tl.constexpr, NF: tl.constexpr, PREC: tl.constexpr):
    """The product over factors j != I of xa_j xb_j^T ([C, C]; NF >= 2): what contracts a
    [C, C] weight times phi(xb) to factor I of xa's side (the Kronecker identity)."""
    if I == 1:
        b_g = f32dot(xa2, tl.trans(xb2), PREC)
    else:
        b_g = f32dot(xa1, tl.trans(xb1), PREC)
    if NF == 3:
        if I == 3:
            b_g *= f32dot(xa2, tl.trans(xb2), PREC)
        else:
            b_g *= f32dot(xa3, tl.trans(xb3), PREC)
    return b_g


@triton.jit
def _intra_to_factor(b_dGq, b_dGs, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, b_qi, b_ki, aq, ak, I: tl.constexpr,
                     NF: tl.constexpr, USE_BETA: tl.constexpr, QUERIES: tl.constexpr, KEYS: tl.constexpr,
                     PREC: tl.constexpr):
    """Factor I's share of the within-chunk terms dGq phi(K) (queries', with QUERIES) and dGq^T
    phi(Q) + dGs phi(K) (keys', with KEYS), contracted in C x C space: (dGq * prod_{j != I} q_j
    k_j^T) k_I and its transpose times q_I, (dGs * prod_{j != I} k_j k_j^T) k_I; no K-wide product."""
    b_m = b_dGq * _gram_except(b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, I, NF, PREC)
    if QUERIES:
        aq += f32dot(b_m, b_ki, PREC)
    if KEYS:
        ak += f32dot(tl.trans(b_m), b_qi, PREC)
        if USE_BETA:
            ak += f32dot(b_dGs * _gram_except(b_k1, b_k2, b_k3, b_k1, b_k2, b_k3, I, NF, PREC), b_ki, PREC)
    return aq, ak


@triton.jit
def register_pass(q1, q2, q3, k1, k2, k3, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, rq1, rq2, rk1, rk2, do, Hc, dHc,
                   Uc, dv, dq1, dq2, dq3, dk1, dk2, dk3, b_dGq, b_dGs, b_gam, b_r, b_dc, b_dlast, b_last, scale, r,
                   m_t, off_s, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, V: tl.constexpr,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_BETA: tl.constexpr, L2NORM: tl.constexpr,
                   QUERIES: tl.constexpr, KEYS: tl.constexpr, PREC: tl.constexpr):
    """phi's gradients contracted to the factors in registers (NF >= 2), one pass over key blocks
    of BK columns (the last axis whole at BK / D_last leading indices): each block's state terms
    (dO S^T; U dS'^T and dR S^T) on the tensor cores, contracted by :func:`_lead_block_to_factors`;
    the within-chunk terms first, in C x C space (:func:`_intra_to_factor`), so no phi block is
    built or gathered (the two-pass form it replaced, phi blocks built from gathered entries:
    12.9 of 17.2 ms fwd+bwd at o3 32x32, H200, a3f20ec). The queries' factors (QUERIES: stored,
    with dc's state share added) and the keys' (KEYS: stored, with c_last's share added): both
    in the one-kernel form, one each in ``grads_split``'s side kernels. Returns (dc, dc_last's share)."""
    DL: tl.constexpr = D2 if NF == 2 else D3
    K: tl.constexpr = D1 * D2 * D3
    aq1, ak1 = _intra_to_factor(b_dGq, b_dGs, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, b_q1, b_k1, b_q1 * 0.0, b_k1 * 0.0,
                                1, NF, USE_BETA, QUERIES, KEYS, PREC)
    aq2, ak2 = _intra_to_factor(b_dGq, b_dGs, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, b_q2, b_k2, b_q2 * 0.0, b_k2 * 0.0,
                                2, NF, USE_BETA, QUERIES, KEYS, PREC)
    aq3, ak3 = b_q3 * 0.0, b_k3 * 0.0
    if NF == 3:
        aq3, ak3 = _intra_to_factor(b_dGq, b_dGs, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, b_q3, b_k3, aq3, ak3, 3, NF,
                                    USE_BETA, QUERIES, KEYS, PREC)
    # dc's state share sum_k dphi(Q)[t, k] phi(Q)[t, k] = sum_a (its factor-1 contraction) q1[t, a]:
    # the loop's additions to aq1, so the intra share comes off here
    if QUERIES:
        b_dc -= tl.sum(aq1 * b_q1, axis=1)
    # value blocks outside, key blocks inside: a value block's dO, r U and Gamma dR rows load once,
    # and each key block then loads only its S and dS' tiles (the contraction is linear, so each
    # value block's share contracts on its own). Key blocks outside reloaded every row tile per
    # block: 6.6 ms of gradients kernel at o3 32x32 (H200, 2026-12-02, 7cd127e)
    # dO S^T and dR S^T multiply loaded 16-bit values (dO, dR as stored in dv's type, S in the
    # products' type) in that type: exact products, as tf32 would give them, at half the operand
    # bytes. r U dS'^T too, r U (an fp32 workspace above K = 256) rounded to that type: adopted with the
    # side kernels (o3 64x64 bf16 worst gradient error 4.1e-3 either way, H200). Row scales after the products.
    DT: tl.constexpr = Hc.dtype.element_ty
    LOWP: tl.constexpr = DT != tl.float32
    AHEAD: tl.constexpr = not (QUERIES and KEYS)
    b_sds = 0.0
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_o = m_t[:, None] & m_v[None, :]
        p_o = r[:, None] * V + o_v[None, :]
        if QUERIES:
            b_do = tl.load(do + p_o, mask=m_o, other=0.0)
        if KEYS:
            b_u = b_r[:, None] * _rows(Uc, r, o_v, m_o, V)
            if USE_BETA:
                b_dr = tl.load(dv + p_o, mask=m_o, other=0.0)  # dR, as the value pass stored it
        # the next key block's S and dS' tiles load before this block's products (in registers,
        # [BK, BV] each), so their latency overlaps the products instead of opening every step
        off = off_s + tl.arange(0, BK)[None, :] * V + o_v[:, None]
        b_st_n = tl.load(Hc + off, mask=m_v[:, None], other=0.0)
        if KEYS:
            b_dst_n = tl.load(dHc + off, mask=m_v[:, None], other=0.0)
        # one side (the split form's side kernels): the leading entries one block ahead as well; both
        # sides at once, not (their registers): with, o3 32x32 1.93 -> 2.01 ms, o4 16^3 5.70 -> 6.08 there
        if QUERIES and AHEAD:
            b_cq1_n, b_cq2_n = _lead_columns(q1, q2, rq1, rq2, r, m_t, 0, NF, D1, D2, BK // DL)
        if KEYS and AHEAD:
            b_ck1_n, b_ck2_n = _lead_columns(k1, k2, rk1, rk2, r, m_t, 0, NF, D1, D2, BK // DL)
        for i_k in range(K // BK):
            b_st = b_st_n
            m_n = m_v[:, None] & ((i_k + 1) * BK + tl.arange(0, BK) < K)[None, :]
            b_st_n = tl.load(Hc + off + (i_k + 1) * BK * V, mask=m_n, other=0.0)
            i_n = (i_k + 1) % (K // BK)  # the next block's leading entries (the last step's: block 0's, unused)
            if KEYS:
                b_dst = b_dst_n
                b_dst_n = tl.load(dHc + off + (i_k + 1) * BK * V, mask=m_n, other=0.0)
                b_sds += tl.sum(tl.sum(b_st.to(tl.float32) * b_dst.to(tl.float32), axis=1), axis=0)
            # each side's block contracted before the other's is formed: one [C, BK] product live
            if QUERIES:
                if AHEAD:
                    b_cq1, b_cq2 = b_cq1_n, b_cq2_n
                    b_cq1_n, b_cq2_n = _lead_columns(q1, q2, rq1, rq2, r, m_t, i_n, NF, D1, D2, BK // DL)
                else:
                    b_cq1, b_cq2 = _lead_columns(q1, q2, rq1, rq2, r, m_t, i_k, NF, D1, D2, BK // DL)
                b_dq = (scale * b_gam)[:, None] * dot(b_do, b_st, LOWP, DT, PREC)
                aq1, aq2, aq3 = _lead_block_to_factors(b_dq, b_cq1, b_cq2, b_q2, b_q3, aq1, aq2, aq3, i_k, NF, D1, D2,
                                                       C, BK // DL, DL)
            if KEYS:
                if AHEAD:
                    b_ck1, b_ck2 = b_ck1_n, b_ck2_n
                    b_ck1_n, b_ck2_n = _lead_columns(k1, k2, rk1, rk2, r, m_t, i_n, NF, D1, D2, BK // DL)
                else:
                    b_ck1, b_ck2 = _lead_columns(k1, k2, rk1, rk2, r, m_t, i_k, NF, D1, D2, BK // DL)
                b_dk = dot(b_u, b_dst, LOWP, DT, PREC)
                if USE_BETA:
                    b_dk -= b_gam[:, None] * dot(b_dr, b_st, LOWP, DT, PREC)
                ak1, ak2, ak3 = _lead_block_to_factors(b_dk, b_ck1, b_ck2, b_k2, b_k3, ak1, ak2, ak3, i_k, NF, D1, D2,
                                                       C, BK // DL, DL)
    if QUERIES:
        b_dc += tl.sum(aq1 * b_q1, axis=1)
        store_factor_grads(dq1, dq2, dq3, q1, q2, q3, aq1, aq2, aq3, r, m_t, NF, D1, D2, D3, L2NORM)
    if KEYS:
        b_dlast += tl.exp(b_last) * b_sds
        store_factor_grads(dk1, dk2, dk3, k1, k2, k3, ak1, ak2, ak3, r, m_t, NF, D1, D2, D3, L2NORM)
    return b_dc, b_dlast


@triton.jit
def chunk_bwd_grads_kernel(
    q1, q2, q3, k1, k2, k3, Qw, Kw, P, Ai, Gc, v, beta, do, Hc, dHc, Uc, Rc, dUc, dq1, dq2, dq3, dk1, dk2, dk3, dQp, dKp,
    dv, dg, dbeta, cu_seqlens, chunk_indices, scale, T, H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr,
    D2: tl.constexpr, D3: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, ROWS: tl.constexpr, PREC: tl.constexpr,
):
    """One chunk's (program i: chunk i, varlen: pair i of ``chunk_indices``) gradients for one
    head: dv, dbeta, dg and phi's gradients. phi(Q), phi(K) blocks are read from ``Qw`` / ``Kw``
    (the resident loops' workspaces) or, when those are None, built from the factors
    (:func:`side_block`). With ``dQp`` / ``dKp`` given ([B, H, T, K], the workspace type) phi's
    gradients are stored there for ``phi_grads_to_factors_kernel``; with ROWS (BK = K) formed the
    same way, whole rows at once, and contracted to the factors here; else contracted per key
    block (:func:`register_pass`); the factors' into ``dq*`` / ``dk*``. ``P``,
    ``Ai``, ``Gc``: the prepare kernel's; ``Hc``, ``Uc``, ``Rc``: the recompute's; ``dHc``,
    ``dUc``: the state-gradient loop's. ``Gc`` / ``beta`` None: no gates / no delta rule."""
    USE_BETA: tl.constexpr = beta is not None
    K: tl.constexpr = D1 * D2 * D3
    o_c, m_t, r, p_row, i_last, p_last, i_s, i_h = chunk_rows(T, H, C, cu_seqlens, chunk_indices)
    b_c, b_last = stored_log_decay(Gc, p_row, m_t, p_last, C)
    b_gam = tl.exp(b_c)
    b_r = tl.exp(b_last - b_c)
    b_P, b_Ai, b_b, off_w = chunk_scores(P, Ai, beta, r, p_row, m_t, o_c, C, USE_BETA)
    b_dP, b_dT, b_db, b_dc, b_dlast = value_pass(b_P, b_Ai, b_b, v, do, Uc, Rc, dUc, dv, r, m_t, scale, V, C,
                                                 BV, USE_BETA, PREC)
    b_q1, b_q2, b_q3, rq1, rq2, rq3 = side_tiles(q1, q2, q3, r, m_t, NF, D1, D2, D3, L2NORM)
    b_k1, b_k2, b_k3, rk1, rk2, rk3 = side_tiles(k1, k2, k3, r, m_t, NF, D1, D2, D3, L2NORM)
    b_gk = b_P
    if USE_BETA:
        # loaded again: the value pass's copy kept two shared-memory layouts of it live through cc_grads
        # (o3 32x32 122880 -> 114688 B, two CTAs an SM; gradients kernel 2.52 -> 1.93 ms, H200)
        b_Ai = tl.load(Ai + off_w, mask=m_t[:, None], other=0.0)
        b_gk = key_gram(k1, b_k1, b_k2, b_k3, rk1, r, m_t, NF, C, BK, D1, D2, D3, PREC)
    b_dGq, b_dGs, b_db, b_dc = cc_grads(b_dP, b_dT, b_db, b_dc, b_P, b_Ai, b_b, b_c, b_gk, scale, C, USE_BETA,
                                        PREC)
    off_s = (i_s * H + i_h) * K * V
    tl.debug_barrier()  # the value pass's dv (dR) stores, read back by every thread in the keys' terms
    if dQp is not None or ROWS:
        b_dc, b_dlast = _stored_pass(Qw, Kw, q1, q2, q3, k1, k2, k3, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, rq1, rq2,
                                     rq3, rk1, rk2, rk3, do, Hc, dHc, Uc, dv, dQp, dKp, dq1, dq2, dq3, dk1, dk2, dk3,
                                     b_dGq, b_dGs, b_gam, b_r, b_dc, b_dlast, b_last, scale, p_row, r, m_t, off_s,
                                     NF, D1, D2, D3, V, C, BK, BV, USE_BETA, L2NORM, ROWS, PREC)
    else:
        b_dc, b_dlast = register_pass(q1, q2, q3, k1, k2, k3, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, rq1, rq2, rk1,
                                       rk2, do, Hc, dHc, Uc, dv, dq1, dq2, dq3, dk1, dk2, dk3, b_dGq, b_dGs, b_gam,
                                       b_r, b_dc, b_dlast, b_last, scale, r, m_t, off_s, NF, D1, D2, D3, V, C, BK,
                                       BV, USE_BETA, L2NORM, True, True, PREC)
    if USE_BETA:
        tl.store(dbeta + r, b_db.to(dbeta.dtype.element_ty), mask=m_t)
    if Gc is not None:
        # dg_t = sum_{t' >= t} dc_t' within the chunk; c_last's share sits on the last row
        b_dc += tl.where(o_c == C - 1, b_dlast, 0.0)
        b_dg = tl.sum(b_dc, axis=0) - tl.cumsum(b_dc, axis=0) + b_dc
        tl.store(dg + r, b_dg.to(dg.dtype.element_ty), mask=m_t)
