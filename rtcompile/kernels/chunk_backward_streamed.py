"""The streamed pieces of the chunk-parallel backward, for states too wide for registers (K > 256):
the forward recompute and the state-gradient loop with the state (and its gradient) kept in
global memory and visited in [block_k, block_v] tiles, and phi(K) / phi(Q) blocks built from the
factors where they are used, so neither needs a [T, K] workspace.

Notation as in ``chunk_backward.py`` (c, Gamma, gamma, r, P, T = ``Ai``, U, R, dS', dU).

- :func:`recompute_streamed` runs the forward's streamed kernel (``chunk_streamed_kernel``) with
  no outputs, storing every chunk's incoming state S (the products' type), U and R (fp32; R
  with the delta rule): what ``chunk_split_state_kernel`` with STRIDE 1 stores from the
  prepared phi(K).
- :func:`chunk_bwd_state_streamed_kernel` (launched by :func:`state_grads_streamed`): the
  outputs of ``chunk_backward_state.chunk_bwd_state_kernel`` (every chunk's dS', dU, d(initial
  state)) with the running dS in an fp32 buffer of the state's shape. Per chunk, in reverse,
  two passes over the key tiles: the first stores dS' (the tile as it is) and sums phi(K)_i
  dS'_i, which gives dU = s P^T dO + diag(r) phi(K) dS' and, with the delta rule, dR = diag(b
  Gamma) T^T dU; the second writes back dS = gamma dS' + phi(Q)^T diag(s Gamma) dO - phi(K)^T
  dR tile by tile. The state's gradient thus crosses global memory three times per chunk (read
  twice, written once) besides the dS' store, against once for the resident loop; with
  ``merge_passes`` a chunk's first pass rides on the update pass of the chunk after it, each
  updated tile being the earlier chunk's dS' (read once, written once).

The l2norm enters as one scale per row (1 / ||phi||, the product of the factors' inverse
norms) on the [C, BV] products, as in the streamed forward, not on every [C, BK] phi block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import args
from .args import dot_dtype, factor_args, lowp_dots, width_args
from .blocks import dot, first_stored_state, phi_block, phi_inv_norm, sequence_of_program, state_tile
from .chunk_backward_grads import stored_log_decay
from .chunk_streamed import chunk_streamed_kernel
from .config import KernelShape, is_pow2
from .inputs import Problem
from .launch_cache import cached


# ----- the streamed state-gradient loop -----
@triton.jit
def _row_scales(q1, q2, q3, k1, k2, k3, r, m_t, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                D3: tl.constexpr, BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr, C: tl.constexpr,
                L2NORM: tl.constexpr):
    """1 / ||phi(q)|| and 1 / ||phi(k)|| of the rows ``r`` (ones without L2NORM)."""
    r_q = tl.full([C], 1.0, tl.float32)
    r_k = tl.full([C], 1.0, tl.float32)
    if L2NORM:
        r_q = phi_inv_norm(q1, q2, q3, r[:, None], m_t[:, None], D1, D2, D3, BD1, BD2, BD3, NF)
        r_k = phi_inv_norm(k1, k2, k3, r[:, None], m_t[:, None], D1, D2, D3, BD1, BD2, BD3, NF)
    return r_q, r_k


@triton.jit
def _store_and_contract(k1, k2, k3, dht, dS, dHc, p_state, p_out, o_v, m_v, first, r, m_t,
                        NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
                        V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        OUTER: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr, PREFETCH: tl.constexpr):
    """Pass 1 over the key tiles: each tile of dS' (``dht`` or zeros when ``first``, else the
    running ``dS``) stored into ``dHc`` at ``p_out`` in the products' type; returns raw phi(K) dS'
    ([C, BV] fp32). PREFETCH: each tile's load issued one tile ahead."""
    K: tl.constexpr = D1 * D2 * D3
    DT: tl.constexpr = k1.dtype.element_ty
    DOT_DT: tl.constexpr = DT if LOWP else tl.float32
    b_acc = tl.zeros([C, BV], dtype=tl.float32)
    b_dsn = state_tile(dht, dS, p_state, 0, o_v, m_v, first, K, BK, V, dht is not None)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        if PREFETCH:  # the next tile's load flies while this one is used (a read-only pass)
            b_ds = b_dsn
            b_dsn = state_tile(dht, dS, p_state, i_k + 1, o_v, m_v, first, K, BK, V, dht is not None)
        else:
            b_ds = state_tile(dht, dS, p_state, i_k, o_v, m_v, first, K, BK, V, dht is not None)
        tl.store(dHc + p_out + o_k[:, None] * V + o_v[None, :], b_ds.to(dHc.dtype.element_ty),
                 mask=(o_k < K)[:, None] & m_v[None, :])
        b_k = phi_block(k1, k2, k3, r, m_t, i_k, C, BK, NF, D1, D2, D3, K, OUTER, DOT_DT)
        b_acc += dot(b_k, b_ds, LOWP, DT, PREC)
    return b_acc


@triton.jit
def _update_tiles(q1, q2, q3, k1, k2, k3, dht, dS, dHc, p_state, p_next, o_v, m_v, m_vn, first, r, m_t, r_n, m_tn,
                  b_gamma, b_qdo, b_kdr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
                  V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, OUTER: tl.constexpr,
                  USE_BETA: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr, MERGE: tl.constexpr,
                  PREFETCH: tl.constexpr):
    """Pass 2 over the key tiles: dS_i = gamma dS'_i + phi(Q)_i^T ``b_qdo`` - phi(K)_i^T ``b_kdr``
    (the last with the delta rule; raw phi blocks, the rows' scales are in the [C, BV] right
    operands), written back into ``dS``. MERGE: each updated tile is the previous chunk's dS'
    (rows ``r_n``, ``m_tn``; value columns ``m_vn``: none when no chunk is left), so its pass 1 happens here
    while it is in registers: stored into ``dHc`` at ``p_next`` and contracted; returns that
    chunk's raw phi(K) dS' ([C, BV] fp32; zeros without MERGE)."""
    K: tl.constexpr = D1 * D2 * D3
    DT: tl.constexpr = k1.dtype.element_ty
    DOT_DT: tl.constexpr = DT if LOWP else tl.float32
    b_acc = tl.zeros([C, BV], dtype=tl.float32)
    b_dsn = state_tile(dht, dS, p_state, 0, o_v, m_v, first, K, BK, V, dht is not None)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_s = (o_k < K)[:, None] & m_v[None, :]
        if PREFETCH:  # tile i_k + 1 is not written yet in this pass: its load is issued one tile ahead
            b_ds = b_gamma * b_dsn
            b_dsn = state_tile(dht, dS, p_state, i_k + 1, o_v, m_v, first, K, BK, V, dht is not None)
        else:
            b_ds = b_gamma * state_tile(dht, dS, p_state, i_k, o_v, m_v, first, K, BK, V, dht is not None)
        b_q = phi_block(q1, q2, q3, r, m_t, i_k, C, BK, NF, D1, D2, D3, K, OUTER, DOT_DT)
        b_ds += dot(tl.trans(b_q), b_qdo, LOWP, DT, PREC)
        if USE_BETA:
            b_k = phi_block(k1, k2, k3, r, m_t, i_k, C, BK, NF, D1, D2, D3, K, OUTER, DOT_DT)
            b_ds -= dot(tl.trans(b_k), b_kdr, LOWP, DT, PREC)
        tl.store(dS + p_state + o_k[:, None] * V + o_v[None, :], b_ds, mask=m_s)
        if MERGE:
            tl.store(dHc + p_next + o_k[:, None] * V + o_v[None, :], b_ds.to(dHc.dtype.element_ty),
                     mask=(o_k < K)[:, None] & m_vn[None, :])
            b_kn = phi_block(k1, k2, k3, r_n, m_tn, i_k, C, BK, NF, D1, D2, D3, K, OUTER, DOT_DT)
            b_acc += dot(b_kn, b_ds, LOWP, DT, PREC)
    return b_acc


@triton.jit
def chunk_bwd_state_streamed_kernel(
    q1, q2, q3, k1, k2, k3, P, Ai, Gc, beta, do, dht, dS, dHc, dUc, cu_seqlens, chunk_offsets, scale, T,
    H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
    OUTER: tl.constexpr, MERGE: tl.constexpr, PREFETCH: tl.constexpr,
):
    """``chunk_backward_state.chunk_bwd_state_kernel``'s outputs for one (sequence, head, value block)
    with the running state gradient in ``dS`` (fp32, the state's shape; it ends as d(initial
    state)) visited in [BK, BV] tiles: every chunk's dS' into ``dHc`` ([chunks, H, K, V], the
    products' type; ``chunk_offsets``: each varlen sequence's first chunk), dU into ``dUc`` (fp32,
    laid out as v). Starts from ``dht`` (None: zeros). phi(Q), phi(K) blocks are built from the
    factors (raw; the l2norm is a row scale); ``P``, ``Ai``, ``Gc`` are the prepare kernel's.
    MERGE: each chunk's pass 1 rides on the next chunk's pass 2 (the state gradient read once
    per chunk instead of twice). PREFETCH: each state-gradient tile's load issued one tile ahead."""
    K: tl.constexpr = D1 * D2 * D3
    DT: tl.constexpr = k1.dtype.element_ty
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, i_b = sequence_of_program(i_n, T, cu_seqlens)
    n_c = tl.cdiv(eos - bos, C)
    i_g0 = first_stored_state(i_n, i_b, T, cu_seqlens, chunk_offsets, C)
    o_c = tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_state = (i_n.to(tl.int64) * H + i_h) * K * V
    if MERGE:  # the last chunk's pass 1; every earlier chunk's rides on the pass 2 after it
        tok = bos + (n_c - 1) * C + o_c
        b_kdn = _store_and_contract(k1, k2, k3, dht, dS, dHc, p_state, ((i_g0 + n_c - 1) * H + i_h) * K * V, o_v,
                                    m_v, True, (i_b * T + tok) * H + i_h, tok < eos, NF, D1, D2, D3, V, C, BK, BV,
                                    OUTER, LOWP, PREC, PREFETCH)
    for i_r in range(n_c):
        i_c = n_c - 1 - i_r
        tok = bos + i_c * C + o_c
        m_t = tok < eos
        m_o = m_t[:, None] & m_v[None, :]
        r = (i_b * T + tok) * H + i_h
        p_row = (i_b * H + i_h) * T + tok
        b_c, b_last = stored_log_decay(Gc, p_row, m_t, (i_b * H + i_h) * T + tl.minimum(bos + i_c * C + C, eos) - 1,
                                       C)
        r_q, r_k = _row_scales(q1, q2, q3, k1, k2, k3, r, m_t, NF, D1, D2, D3, BD1, BD2, BD3, C, L2NORM)
        if MERGE:
            b_kds = b_kdn
        else:
            b_kds = _store_and_contract(k1, k2, k3, dht, dS, dHc, p_state, ((i_g0 + i_c) * H + i_h) * K * V, o_v,
                                        m_v, i_r == 0, r, m_t, NF, D1, D2, D3, V, C, BK, BV, OUTER, LOWP, PREC, PREFETCH)
        b_pt = tl.load(P + p_row[None, :] * C + o_c[:, None], mask=m_t[None, :], other=0.0)  # P^T
        b_do = tl.load(do + r[:, None] * V + o_v[None, :], mask=m_o, other=0.0).to(tl.float32)
        b_du = scale * dot(b_pt, b_do, LOWP, DT, PREC)
        b_du += tl.where(m_t, tl.exp(b_last - b_c) * r_k, 0.0)[:, None] * b_kds
        tl.store(dUc + r[:, None] * V + o_v[None, :], b_du, mask=m_o)
        b_gam = tl.exp(b_c)
        b_qdo = (scale * b_gam * r_q)[:, None] * b_do
        b_kdr = tl.zeros([C, BV], dtype=tl.float32)
        if beta is not None:  # dR = diag(b Gamma) T^T dU, with phi(K)'s row scale
            b_b = tl.load(beta + r, mask=m_t, other=0.0).to(tl.float32)
            b_ait = tl.load(Ai + p_row[None, :] * C + o_c[:, None], mask=m_t[None, :], other=0.0)  # T^T
            b_kdr = (b_b * b_gam * r_k)[:, None] * dot(b_ait, b_du, LOWP, DT, PREC)
        tok_n = tok - C  # the previous chunk's rows (none before the first)
        m_tn = tok_n >= bos
        m_vn = m_v & (o_v * 0 + i_c > 0)  # as a vector: a scalar's & came out int32 in the interpreter
        b_kdn = _update_tiles(q1, q2, q3, k1, k2, k3, dht, dS, dHc, p_state, ((i_g0 + i_c - 1) * H + i_h) * K * V,
                              o_v, m_v, m_vn, i_r == 0, r, m_t, (i_b * T + tok_n) * H + i_h, m_tn, tl.exp(b_last),
                              b_qdo, b_kdr, NF, D1, D2, D3, V, C, BK, BV, OUTER, beta is not None, LOWP, PREC, MERGE,
                              PREFETCH)


# ----- launchers -----
def _check_tiles(chunk_size: int, block_k: int, block_v: int) -> None:
    """Refuse tiles a kernel cannot take, naming the field."""
    for name, value in (("chunk_size", chunk_size), ("block_k", block_k), ("block_v", block_v)):
        if not isinstance(value, int) or value < 16 or not is_pow2(value):
            raise ValueError(f"{name}={value!r}; allowed: a power of two >= 16 (a tl.dot operand's side)")


def _chunk_total(p: Problem, T: int, C: int) -> int:
    """Chunks over all sequences (the rows of Hc / dHc divided by H)."""
    if p.seq_bounds is not None:
        return sum(triton.cdiv(hi - lo, C) for lo, hi in p.seq_bounds)
    return p.batch * triton.cdiv(T, C)


def recompute_streamed(p: Problem, q, k, v, g, beta, *, h0, cu_seqlens, offsets, l2norm: bool, ws: dict,
                       chunk_size: int, block_k: int, block_v: int, num_warps: int, num_stages: int, precision: str,
                       prefetch_state: bool = False, merge_passes: bool = False,
                       store_dtype: torch.dtype = torch.float32, ht: torch.Tensor | None = None,
                       o: torch.Tensor | None = None):
    """The forward recompute with a streamed state: (Hc, Uc, Rc) as ``chunk_backward``'s split
    recompute stores them (Hc [chunks, H, K, V] in the products' type; Uc, Rc of v's shape in
    ``store_dtype``; Rc None without the delta rule). ``ws``: ``chunk_prepare.prepare_backward``'s
    dict (its "P" and "Ai" are read; "Kw" and "Qw" are not); ``offsets``: each varlen sequence's
    first chunk (int32, with ``cu_seqlens``), else None. ``ht``: the running state's fp32 buffer
    (the final state when done; None: one of its own); ``o``: also the forward's output there
    (the kept forward, ``chunk_backward_kept.forward_kept``)."""
    _check_tiles(chunk_size, block_k, block_v)
    B, T, H, V = v.shape
    dev = v.device
    Hc = args.empty(_chunk_total(p, T, chunk_size), H, p.key_dim, V, dtype=dot_dtype(v), device=dev)
    Uc = args.empty(B, T, H, V, dtype=store_dtype, device=dev)
    Rc = args.empty(B, T, H, V, dtype=store_dtype, device=dev) if beta is not None else None
    if ht is None:
        ht = args.empty(p.state_shape, dtype=torch.float32, device=dev)  # the running state
    grid = (triton.cdiv(V, block_v), p.num_seqs * H)
    cached(chunk_streamed_kernel)[grid](
        *factor_args(q), *factor_args(k), v, g, beta, o, h0, ht, ws["P"], ws["Ai"], cu_seqlens,
        Hc, Uc, Rc, offsets, p.scale, T,
        H=H, NF=len(q), **width_args(p.key_widths, 16), V=V, C=chunk_size, BK=block_k, BV=block_v, L2NORM=l2norm,
        LOWP=lowp_dots(v.dtype), PREC=precision, OUTER=KernelShape(p.key_widths, V).outer_phi_ok(block_k),
        SCORES="workspace", PREFETCH_STATE=prefetch_state, MERGE_PASSES=merge_passes,
        num_warps=num_warps, num_stages=num_stages,
    )
    return Hc, Uc, Rc


def state_grads_streamed(p: Problem, q, k, beta, do, dht, *, ws: dict, cu_seqlens, offsets, l2norm: bool,
                         want_dh0: bool, scale: float, chunk_size: int, block_k: int, block_v: int, num_warps: int,
                         num_stages: int, precision: str, store_dtype: torch.dtype = torch.float32,
                         merge_passes: bool = False, prefetch_state: bool = False):
    """Run :func:`chunk_bwd_state_streamed_kernel`: (dHc [chunks, H, K, V] in the products'
    type, dUc of v's shape in ``store_dtype``, d(initial state) fp32 of the state's shape or None
    when not ``want_dh0``). ``dht``: the final state's gradient (fp32, the state's shape) or None;
    ``ws``: ``chunk_prepare.prepare_backward``'s dict ("P", "Ai", "Gc" are read)."""
    _check_tiles(chunk_size, block_k, block_v)
    B, T, H, V = do.shape
    dev = do.device
    dHc = args.empty(_chunk_total(p, T, chunk_size), H, p.key_dim, V, dtype=dot_dtype(do), device=dev)
    dUc = args.empty(B, T, H, V, dtype=store_dtype, device=dev)
    # the running gradient; after chunk 0 it is d(initial state), every element written
    dS = args.empty(p.state_shape, dtype=torch.float32, device=dev)
    grid = (triton.cdiv(V, block_v), p.num_seqs * H)
    cached(chunk_bwd_state_streamed_kernel)[grid](
        *factor_args(q), *factor_args(k), ws["P"], ws["Ai"], ws["Gc"], beta, do, dht, dS, dHc, dUc, cu_seqlens,
        offsets, scale, T, H=H, NF=len(q), **width_args(p.key_widths, 16), V=V, C=chunk_size, BK=block_k,
        BV=block_v, L2NORM=l2norm, LOWP=lowp_dots(do.dtype), PREC=precision,
        OUTER=KernelShape(p.key_widths, V).outer_phi_ok(block_k), MERGE=merge_passes, PREFETCH=prefetch_state,
        num_warps=num_warps, num_stages=num_stages,
    )
    return dHc, dUc, (dS if want_dh0 else None)
