"""The chunk-parallel gradients kernel of the backward (``chunk_backward.py`` launches it).

One program per (chunk, head) covers every value column: it loops over the value blocks,
adding each block's share of phi(Q)'s and phi(K)'s gradients (contracted to the factors on
chip, so no [C, K] tile leaves the program), of the score and inverse gradients (C x C), of
beta's and of the cumulative log decay's, and stores the block's dv. After the loop it takes
the Gram path (the scores and the inverse as products of per-factor Grams) to the factors,
applies the l2norm backward per factor and turns the log-decay gradient into dg (a reverse
cumulative sum within the chunk). Every sum over value columns happens in registers: no
atomics, no second pass. All products are fp32 (``input_precision`` PREC): the gradient path
multiplies derived matrices (transposed products fed to products), the pattern Triton
3.4-3.7 miscompiles on Hopper with 16-bit operands (fla #640).

Notation (the backward's math: issue 19 and ``chunk_backward.py``): per chunk c = cumsum(g), Gamma = exp(c), gamma =
exp(c_last), r = gamma / Gamma, D_ij = exp(c_i - c_j) (j <= i), T = (I + A)^-1 (``Ai``), S the
incoming state (``Hc``), dS' the outgoing state's gradient (``dHc``), U as the forward stored it
(``Uc``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .blocks import chunk_log_decay, chunk_of_program, factor_tiles, phi_from_tiles


@triton.jit
def phi_to_factors(b_d, b_x1, b_x2, b_x3, NF: tl.constexpr, C: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                   D3: tl.constexpr):
    """The factors' gradients of a [C, K] gradient ``b_d`` of phi = x1 (x) x2 (x) x3 (row-major):
    dx_f[t, a] = sum over the other axes of d[t, .. a ..] times the other factors. Slots past NF
    hold placeholders (never stored)."""
    b_d1 = b_d
    b_d2 = b_x2 * 0.0
    b_d3 = b_x3 * 0.0
    if NF == 2:
        b_t = tl.reshape(b_d, [C, D1, D2])
        b_d1 = tl.sum(b_t * b_x2[:, None, :], axis=2)
        b_d2 = tl.sum(b_t * b_x1[:, :, None], axis=1)
    if NF == 3:
        b_t = tl.reshape(b_d, [C, D1, D2, D3])
        b_t12 = tl.sum(b_t * b_x3[:, None, None, :], axis=3)  # [C, D1, D2]
        b_d1 = tl.sum(b_t12 * b_x2[:, None, :], axis=2)
        b_d2 = tl.sum(b_t12 * b_x1[:, :, None], axis=1)
        b_t23 = tl.sum(b_t * b_x1[:, :, None, None], axis=1)  # [C, D2, D3]
        b_d3 = tl.sum(b_t23 * b_x2[:, :, None], axis=1)
    return b_d1, b_d2, b_d3


@triton.jit
def _value_block(b_q, b_k, b_P, b_Ai, b_b, b_gam, b_r, b_last, v, do, Hc, Uc, dHc, dv, r, m_t, i_s, i_h, i_v,
                 scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                 USE_BETA: tl.constexpr, PREC: tl.constexpr):
    """Value block ``i_v``'s shares: (dphi(Q), dphi(K), dP / scale, dT, db, dc, dc_last); its
    dv is stored here (dR with the delta rule, else dU)."""
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_o = m_t[:, None] & m_v[None, :]
    off_s = (i_s * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(Hc + off_s, mask=m_v[None, :], other=0.0)
    b_ds = tl.load(dHc + off_s, mask=m_v[None, :], other=0.0)
    b_do = tl.load(do + r[:, None] * V + o_v[None, :], mask=m_o, other=0.0).to(tl.float32)
    b_u = tl.load(Uc + r[:, None] * V + o_v[None, :], mask=m_o, other=0.0)
    b_kds = tl.dot(b_k, b_ds, input_precision=PREC)  # phi(K) dS'
    # dU = s P^T dO + diag(r) phi(K) dS'
    b_du = scale * tl.dot(tl.trans(b_P), b_do, input_precision=PREC) + b_r[:, None] * b_kds
    b_ruk = tl.sum(b_u * b_kds, axis=1) * b_r
    b_qs = tl.dot(b_q, b_s, input_precision=PREC)
    b_dc = scale * b_gam * tl.sum(b_do * b_qs, axis=1) - b_ruk
    b_dlast = tl.sum(b_ruk, axis=0) + tl.exp(b_last) * tl.sum(tl.sum(b_s * b_ds, axis=1), axis=0)
    b_dP = tl.dot(b_do, tl.trans(b_u), input_precision=PREC)
    b_dk = tl.dot(b_u * b_r[:, None], tl.trans(b_ds), input_precision=PREC)
    b_dq = tl.dot(b_do * (scale * b_gam)[:, None], tl.trans(b_s), input_precision=PREC)
    b_dT = tl.zeros_like(b_P)
    b_db = tl.zeros_like(b_gam)
    if USE_BETA:
        b_v = tl.load(v + r[:, None] * V + o_v[None, :], mask=m_o, other=0.0).to(tl.float32)
        b_ks = tl.dot(b_k, b_s, input_precision=PREC)
        b_R = b_v - b_gam[:, None] * b_ks  # R = V - diag(Gamma) phi(K) S
        b_drp = tl.dot(tl.trans(b_Ai), b_du, input_precision=PREC)  # dR' = T^T dU
        b_dr = b_b[:, None] * b_drp
        b_db = tl.sum(b_drp * b_R, axis=1)
        b_dT = tl.dot(b_du, tl.trans(b_b[:, None] * b_R), input_precision=PREC)  # dU R^T diag(b)
        b_dc -= b_gam * tl.sum(b_dr * b_ks, axis=1)
        b_dk -= tl.dot(b_dr * b_gam[:, None], tl.trans(b_s), input_precision=PREC)
        tl.store(dv + r[:, None] * V + o_v[None, :], b_dr.to(dv.dtype.element_ty), mask=m_o)
    else:
        tl.store(dv + r[:, None] * V + o_v[None, :], b_du.to(dv.dtype.element_ty), mask=m_o)
    return b_dq, b_dk, b_dP, b_dT, b_db, b_dc, b_dlast


@triton.jit
def _factor_gram_grads(b_dGq, b_dGk, b_Ho, b_Go, b_qf, b_kf, USE_BETA: tl.constexpr, PREC: tl.constexpr):
    """One factor's Gram-path gradients: dH = dGq * (the other factors' Q_f K_f^T), dq = dH K_f,
    dk = dH^T Q_f (+ (dG + dG^T) K_f with dG = dGk * the other factors' K_f K_f^T)."""
    b_dH = b_dGq * b_Ho
    b_dq = tl.dot(b_dH, b_kf, input_precision=PREC)
    b_dk = tl.dot(tl.trans(b_dH), b_qf, input_precision=PREC)
    if USE_BETA:
        b_dG = b_dGk * b_Go
        b_dk += tl.dot(b_dG + tl.trans(b_dG), b_kf, input_precision=PREC)
    return b_dq, b_dk


@triton.jit
def _gram_path(b_dP, b_dT, b_Ai, b_b, b_c, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, NF: tl.constexpr,
               C: tl.constexpr, USE_BETA: tl.constexpr, PREC: tl.constexpr):
    """From dP (masked here) and dT: the factors' Gram-path gradients, and db's and dc's
    shares (dA = -(T^T dT T^T) strictly lower; dGk = dA diag(b) D, dGq = dP D; E = (dA b Gk +
    dP Gq) D gives dc_i += sum_j E_ij, dc_j -= sum_i E_ij)."""
    o_c = tl.arange(0, C)
    m_incl = o_c[:, None] >= o_c[None, :]
    b_D = tl.exp(tl.where(m_incl, b_c[:, None] - b_c[None, :], float("-inf")))
    b_H1 = tl.dot(b_q1, tl.trans(b_k1), input_precision=PREC)
    b_G1 = tl.dot(b_k1, tl.trans(b_k1), input_precision=PREC)
    b_H2 = tl.full([C, C], 1.0, tl.float32)
    b_G2 = b_H2
    b_H3 = b_H2
    b_G3 = b_H2
    if NF > 1:
        b_H2 = tl.dot(b_q2, tl.trans(b_k2), input_precision=PREC)
        b_G2 = tl.dot(b_k2, tl.trans(b_k2), input_precision=PREC)
    if NF > 2:
        b_H3 = tl.dot(b_q3, tl.trans(b_k3), input_precision=PREC)
        b_G3 = tl.dot(b_k3, tl.trans(b_k3), input_precision=PREC)
    b_dP = tl.where(m_incl, b_dP, 0.0)
    b_dGq = b_dP * b_D
    b_E = b_dGq * (b_H1 * b_H2 * b_H3)
    b_dGk = tl.zeros([C, C], dtype=tl.float32)
    b_db = tl.zeros([C], dtype=tl.float32)
    if USE_BETA:
        b_dA = tl.dot(tl.trans(b_Ai), tl.dot(b_dT, tl.trans(b_Ai), input_precision=PREC), input_precision=PREC)
        b_dA = tl.where(o_c[:, None] > o_c[None, :], -b_dA, 0.0)
        b_gk = b_G1 * b_G2 * b_G3 * b_D
        b_db = tl.sum(b_dA * b_gk, axis=1)
        b_dGk = b_dA * b_b[:, None] * b_D
        b_E += b_dA * b_b[:, None] * b_gk
    b_dc = tl.sum(b_E, axis=1) - tl.sum(b_E, axis=0)
    b_dq1, b_dk1 = _factor_gram_grads(b_dGq, b_dGk, b_H2 * b_H3, b_G2 * b_G3, b_q1, b_k1, USE_BETA, PREC)
    b_dq2, b_dk2 = b_dq1, b_dk1
    b_dq3, b_dk3 = b_dq1, b_dk1
    if NF > 1:
        b_dq2, b_dk2 = _factor_gram_grads(b_dGq, b_dGk, b_H1 * b_H3, b_G1 * b_G3, b_q2, b_k2, USE_BETA, PREC)
    if NF > 2:
        b_dq3, b_dk3 = _factor_gram_grads(b_dGq, b_dGk, b_H1 * b_H2, b_G1 * b_G2, b_q3, b_k3, USE_BETA, PREC)
    return b_dq1, b_dq2, b_dq3, b_dk1, b_dk2, b_dk3, b_db, b_dc


@triton.jit
def store_factor_grad(dx, x, b_dxh, r, m_t, D: tl.constexpr, L2NORM: tl.constexpr):
    """Store a factor's gradient at rows ``r``: with L2NORM, through x_hat = x rho, rho =
    1 / sqrt(|x|^2 + eps): dx = rho (dx_hat - x_hat (x_hat . dx_hat))."""
    o_d = tl.arange(0, D)
    off = r[:, None] * D + o_d[None, :]
    b_dx = b_dxh
    if L2NORM:
        b_x = tl.load(x + off, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_rho = tl.rsqrt(tl.sum(b_x * b_x, axis=1) + 1e-6)
        b_xh = b_x * b_rho[:, None]
        b_dx = b_rho[:, None] * (b_dxh - b_xh * tl.sum(b_xh * b_dxh, axis=1)[:, None])
    tl.store(dx + off, b_dx.to(dx.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def chunk_bwd_grads_kernel(
    q1, q2, q3, k1, k2, k3, v, g, beta, do, Ai, Hc, Uc, dHc, dq1, dq2, dq3, dk1, dk2, dk3, dv, dg, dbeta,
    cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
):
    """Every input's gradient of one chunk (program i: chunk i, varlen: pair i of
    ``chunk_indices``) and head, from the forward recompute (``Hc`` the incoming state and
    ``Uc`` U, both fp32; ``Ai`` the inverse, delta rule) and the state-gradient loop (``dHc``
    the outgoing state's gradient of every chunk, fp32). ``dq*`` / ``dk*`` take the factors'
    gradients (before the l2norm when L2NORM), ``dv`` the values', ``dg`` / ``dbeta`` the
    gates' / beta's (None with ``g`` / ``beta`` None). Factor slots past NF repeat the first."""
    K: tl.constexpr = D1 * D2 * D3
    USE_BETA: tl.constexpr = beta is not None
    i_nh = tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_c, bos, eos, i_b, i_s = chunk_of_program(tl.program_id(0), i_n, T, cu_seqlens, chunk_indices, chunk_indices, C)
    o_c = tl.arange(0, C)
    tok = bos + i_c * C + o_c
    m_t = tok < eos
    r = (i_b * T + tok) * H + i_h
    # padded rows add 0 to the cumulative sum: row C - 1 holds c_last
    b_c = chunk_log_decay(g, r, m_t, C)
    b_last = tl.sum(tl.where(o_c == C - 1, b_c, 0.0), axis=0)
    b_gam = tl.exp(b_c)
    b_r = tl.exp(b_last - b_c)
    b_q1, b_q2, b_q3, b_k1, b_k2, b_k3 = factor_tiles(q1, q2, q3, k1, k2, k3, r, m_t, NF, D1, D2, D3,
                                                      D1, D2, D3, L2NORM)
    b_q = phi_from_tiles(b_q1, b_q2, b_q3, NF, C, D1, D2, D3)
    b_k = phi_from_tiles(b_k1, b_k2, b_k3, NF, C, D1, D2, D3)
    b_Gq = tl.dot(b_q1, tl.trans(b_k1), input_precision=PREC)
    if NF > 1:
        b_Gq *= tl.dot(b_q2, tl.trans(b_k2), input_precision=PREC)
    if NF > 2:
        b_Gq *= tl.dot(b_q3, tl.trans(b_k3), input_precision=PREC)
    b_P = b_Gq * tl.exp(tl.where(o_c[:, None] >= o_c[None, :], b_c[:, None] - b_c[None, :], float("-inf")))
    b_b = tl.zeros([C], dtype=tl.float32)
    b_Ai = tl.zeros([C, C], dtype=tl.float32)
    if USE_BETA:
        b_b = tl.load(beta + r, mask=m_t, other=0.0).to(tl.float32)
        p_row = (i_b * H + i_h) * T + tok
        b_Ai = tl.load(Ai + p_row[:, None] * C + o_c[None, :], mask=m_t[:, None], other=0.0)
    b_dq1, b_dq2, b_dq3 = b_q1 * 0.0, b_q2 * 0.0, b_q3 * 0.0
    b_dk1, b_dk2, b_dk3 = b_k1 * 0.0, b_k2 * 0.0, b_k3 * 0.0
    b_dP = tl.zeros([C, C], dtype=tl.float32)
    b_dT = tl.zeros([C, C], dtype=tl.float32)
    b_db = tl.zeros([C], dtype=tl.float32)
    b_dc = tl.zeros([C], dtype=tl.float32)  # c_last's share sits on row C - 1
    for i_v in range(tl.cdiv(V, BV)):
        b_dqp, b_dkp, b_dPv, b_dTv, b_dbv, b_dcv, b_dl = _value_block(
            b_q, b_k, b_P, b_Ai, b_b, b_gam, b_r, b_last, v, do, Hc, Uc, dHc, dv, r, m_t, i_s, i_h, i_v, scale,
            H, K, V, BV, USE_BETA, PREC)
        b_dP += b_dPv
        b_dT += b_dTv
        b_db += b_dbv
        b_dc += b_dcv + tl.where(o_c == C - 1, b_dl, 0.0)
        d1, d2, d3 = phi_to_factors(b_dqp, b_q1, b_q2, b_q3, NF, C, D1, D2, D3)
        e1, e2, e3 = phi_to_factors(b_dkp, b_k1, b_k2, b_k3, NF, C, D1, D2, D3)
        b_dq1 += d1
        b_dk1 += e1
        if NF > 1:
            b_dq2 += d2
            b_dk2 += e2
        if NF > 2:
            b_dq3 += d3
            b_dk3 += e3
    g1, g2, g3, h1, h2, h3, b_dbg, b_dcg = _gram_path(scale * b_dP, b_dT, b_Ai, b_b, b_c, b_q1, b_q2, b_q3,
                                                      b_k1, b_k2, b_k3, NF, C, USE_BETA, PREC)
    store_factor_grad(dq1, q1, b_dq1 + g1, r, m_t, D1, L2NORM)
    store_factor_grad(dk1, k1, b_dk1 + h1, r, m_t, D1, L2NORM)
    if NF > 1:
        store_factor_grad(dq2, q2, b_dq2 + g2, r, m_t, D2, L2NORM)
        store_factor_grad(dk2, k2, b_dk2 + h2, r, m_t, D2, L2NORM)
    if NF > 2:
        store_factor_grad(dq3, q3, b_dq3 + g3, r, m_t, D3, L2NORM)
        store_factor_grad(dk3, k3, b_dk3 + h3, r, m_t, D3, L2NORM)
    if USE_BETA:
        tl.store(dbeta + r, (b_db + b_dbg).to(dbeta.dtype.element_ty), mask=m_t)
    if g is not None:
        # dg_t = sum_{t' >= t} dc_t' (padded rows take part: c_last's share sits on row C - 1)
        b_dc += b_dcg
        b_dg = tl.sum(b_dc, axis=0) - tl.cumsum(b_dc, axis=0) + b_dc
        tl.store(dg + r, b_dg.to(dg.dtype.element_ty), mask=m_t)
