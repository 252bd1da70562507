"""The backward's last step where phi's gradients are stored ([T, K]):
:func:`phi_grads_to_factors_kernel`, token-parallel, contracts them to each factor and takes them
through the l2norm; :func:`store_side_grads` is that step on rows in registers, which the
gradients kernel shares where it holds whole rows (``factor_grads="rows"``), and
:func:`store_factor_grads` its last part, which the register contraction shares."""

from __future__ import annotations

import triton
import triton.language as tl

from .blocks import factor_tiles


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
def _side_to_factors(dP, x1, x2, x3, dx1, dx2, dx3, b_x1, b_x2, b_x3, r, p_row, m_t, NF: tl.constexpr,
                     BT: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, L2NORM: tl.constexpr):
    """One side's (queries' or keys') phi gradient rows (at ``p_row``) to its factors' gradients
    (stored at the token-head rows ``r``)."""
    K: tl.constexpr = D1 * D2 * D3
    o_k = tl.arange(0, K)
    b_d = tl.load(dP + p_row[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
    store_side_grads(b_d, x1, x2, x3, dx1, dx2, dx3, b_x1, b_x2, b_x3, r, m_t, NF, BT, D1, D2, D3, L2NORM)


@triton.jit
def store_side_grads(b_d, x1, x2, x3, dx1, dx2, dx3, b_x1, b_x2, b_x3, r, m_t, NF: tl.constexpr, C: tl.constexpr,
                     D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, L2NORM: tl.constexpr):
    """Whole rows of one side's phi gradient ``b_d`` ([C, K] fp32) contracted to its factors
    (normalised tiles ``b_x*``; NF 1: phi is the factor) and stored through the l2norm at the
    token-head rows ``r``: what this kernel does after its load, and what the gradients kernel
    does with ``factor_grads="rows"``."""
    d1, d2, d3 = phi_to_factors(b_d, b_x1, b_x2, b_x3, NF, C, D1, D2, D3)
    store_factor_grads(dx1, dx2, dx3, x1, x2, x3, d1, d2, d3, r, m_t, NF, D1, D2, D3, L2NORM)


@triton.jit
def store_factor_grads(dx1, dx2, dx3, x1, x2, x3, a1, a2, a3, r, m_t, NF: tl.constexpr, D1: tl.constexpr,
                       D2: tl.constexpr, D3: tl.constexpr, L2NORM: tl.constexpr):
    """One side's NF factors' gradients from their accumulators ``a*`` (slots past NF unused),
    each through the l2norm (:func:`store_factor_grad`)."""
    store_factor_grad(dx1, x1, a1, r, m_t, D1, L2NORM)
    if NF > 1:
        store_factor_grad(dx2, x2, a2, r, m_t, D2, L2NORM)
    if NF > 2:
        store_factor_grad(dx3, x3, a3, r, m_t, D3, L2NORM)


@triton.jit
def phi_grads_to_factors_kernel(
    q1, q2, q3, k1, k2, k3, dQp, dKp, dq1, dq2, dq3, dk1, dk2, dk3, N, T, H: tl.constexpr,
    NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, BT: tl.constexpr, L2NORM: tl.constexpr,
):
    """Rows [i BT, (i + 1) BT) of the N = B T H token-head rows: phi(Q)'s and phi(K)'s gradients
    (``dQp`` / ``dKp``, [B, H, T, K] as the gradients kernel stores them) contracted to each
    factor (normalised when L2NORM) and taken through the l2norm into ``dq*`` / ``dk*`` (the
    factors' types). Slots past NF repeat the first."""
    r = tl.program_id(0) * BT + tl.arange(0, BT)
    m_t = r < N
    p_row = ((r // (T * H)) * H + r % H) * T + (r // H) % T
    b_q1, b_q2, b_q3, b_k1, b_k2, b_k3 = factor_tiles(q1, q2, q3, k1, k2, k3, r, m_t, NF, D1, D2, D3,
                                                      D1, D2, D3, L2NORM)
    _side_to_factors(dQp, q1, q2, q3, dq1, dq2, dq3, b_q1, b_q2, b_q3, r, p_row, m_t, NF, BT, D1, D2, D3, L2NORM)
    _side_to_factors(dKp, k1, k2, k3, dk1, dk2, dk3, b_k1, b_k2, b_k3, r, p_row, m_t, NF, BT, D1, D2, D3, L2NORM)
