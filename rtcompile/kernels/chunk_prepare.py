"""The chunk-parallel prepare kernel, and the launcher helpers that the resident, streamed and
split launchers run it through.

Per chunk of C tokens (local cumulative log decay c, Gamma = exp(c), D_ij = exp(c_i - c_j)):

    P  = (prod_i Q_i K_i^T) * D * causal          the scores, as products of per-axis Grams
    Ai = (I + tril(diag(b) (prod_i K_i K_i^T) * D, -1))^-1          (delta rule only)

The two-kernel forms (resident, streamed) read P and Ai from a [B, H, T, C] workspace, or with
WY (resident, delta rule) P, W = Ai diag(b Gamma) phi(K) and U0 = Ai diag(b) V. The split form
reads Ai (delta rule), the normalised phi(K) and the cumulative log decay c (gates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import args
from .args import dot_dtype, factor_args, lowp_dots, width_args
from .blocks import chunk_log_decay, chunk_rows, chunk_scores, dot, phi_block, phi_inv_norm
from .config import next_pow2, stores_inverse
from .inputs import Problem
from .launch_cache import cached
from .solves import unit_lower_inverse_tiles


@triton.jit
def _trailing_tile(p2, p3, r, m_t, C: tl.constexpr, NF: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """[C, D2 * D3] raw outer product (fp32) of the trailing factors of the rows ``r`` (NF >= 2):
    phi's column block for index i of axis 1 is this tile with row c scaled by x1[c, i]."""
    o_2 = tl.arange(0, D2)
    b_2 = tl.load(p2 + r[:, None] * D2 + o_2[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
    b_t = b_2.to(tl.float32)
    if NF > 2:
        o_3 = tl.arange(0, D3)
        b_3 = tl.load(p3 + r[:, None] * D3 + o_3[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
        b_t = tl.reshape((b_2[:, :, None] * b_3[:, None, :]).to(tl.float32), [C, D2 * D3])
    return b_t


@triton.jit
def _lead_column(p1, r, m_t, i, D1: tl.constexpr):
    """x1[:, i] of the rows ``r`` (raw, fp32): column block i's row scales."""
    return tl.load(p1 + r * D1 + i, mask=m_t, other=0.0).to(tl.float32)


@triton.jit
def _left(b_left, b_blk, DT: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr):
    """``b_left`` @ ``b_blk`` (fp32 accumulation, operands in DT with LOWP), or ``b_blk`` when
    ``b_left`` is None."""
    if b_left is not None:
        b_blk = dot(b_left, b_blk, LOWP, DT, PREC)
    return b_blk


@triton.jit
def _store_key_columns(dst, k1, k2, k3, r, m_t, p_row, b_scale, NF: tl.constexpr, C: tl.constexpr,
                       D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, GROUP: tl.constexpr, b_left,
                       LOWP: tl.constexpr, PREC: tl.constexpr):
    """Rows ``p_row`` of ``dst`` ([.., K], its type) := diag(b_scale) phi(K), one [C, D2 D3]
    column block per index i of axis 1: block i is the trailing factors' outer product T with
    row c scaled by x1[c, i], so T is built once and no [C, K] tile is held (at C 64, K 256 and
    2 warps that tile alone is 256 fp32 registers per thread). With GROUP > 1 each store covers
    GROUP indices: x1's [C, GROUP] columns in one load, one [C, GROUP D2 D3] block (o3 16x16
    C 64 on the H200: this store alone 0.047 ms with GROUP 4 against about 0.14 with one index
    per store, whose [C] column gathers each waited on a load). Needs power-of-two widths >= 16.
    ``b_left`` ([C, C] or None): store b_left diag(b_scale) phi(K) instead, each block multiplied
    on its own (the split form's W = Ai diag(b Gamma) phi(K) without a [C, K] tile)."""
    K: tl.constexpr = D1 * D2 * D3
    DT: tl.constexpr = dst.dtype.element_ty
    if NF == 1:  # phi is the factor itself: one block
        o_1 = tl.arange(0, D1)
        b_blk = tl.load(k1 + r[:, None] * D1 + o_1[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
        b_blk = _left(b_left, b_blk * b_scale[:, None], DT, LOWP, PREC)
        tl.store(dst + p_row[:, None] * K + o_1[None, :], b_blk.to(DT), mask=m_t[:, None])
    else:
        TW: tl.constexpr = D2 * D3
        b_t = _trailing_tile(k2, k3, r, m_t, C, NF, D2, D3)
        if GROUP == 1:
            o_j = tl.arange(0, TW)
            for i in range(D1):
                b_blk = _left(b_left, b_t * (_lead_column(k1, r, m_t, i, D1) * b_scale)[:, None], DT, LOWP, PREC)
                tl.store(dst + p_row[:, None] * K + i * TW + o_j[None, :], b_blk.to(DT), mask=m_t[:, None])
        else:  # GROUP indices of axis 1 per store: a [C, GROUP] load of x1 and one [C, GROUP TW] block
            o_g = tl.arange(0, GROUP)
            o_j = tl.arange(0, GROUP * TW)
            for i0 in range(0, D1, GROUP):
                b_x = tl.load(k1 + r[:, None] * D1 + i0 + o_g[None, :], mask=m_t[:, None], other=0.0)
                b_x = b_x.to(tl.float32) * b_scale[:, None]
                b_blk = tl.reshape((b_x[:, :, None] * b_t[:, None, :]).to(DT), [C, GROUP * TW])
                b_blk = _left(b_left, b_blk, DT, LOWP, PREC)
                tl.store(dst + p_row[:, None] * K + i0 * TW + o_j[None, :], b_blk.to(DT), mask=m_t[:, None])


@triton.jit
def _store_wy(W, U0, k1, k2, k3, v, beta, b_Ai, b_c, b_inv, r, m_t, p_row, DT: tl.constexpr, NF: tl.constexpr,
              D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, C: tl.constexpr, V: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr, OUTER: tl.constexpr):
    """The solve applied here, in parallel: W = Ai diag(b Gamma / ||phi(k)||) phi(K) ([C, K] in
    W's type) and U0 = Ai diag(b) V ([C, V] fp32), at rows ``p_row`` of the [B, H, T, .] workspaces."""
    K: tl.constexpr = D1 * D2 * D3
    b_b = tl.load(beta + r, mask=m_t, other=0.0).to(tl.float32)
    b_scale = b_b * tl.exp(b_c) * b_inv
    b_phi = phi_block(k1, k2, k3, r, m_t, 0, C, BK, NF, D1, D2, D3, K, OUTER)
    b_w = dot(b_Ai, b_phi * b_scale[:, None], LOWP, DT, PREC)
    o_k = tl.arange(0, BK)
    tl.store(W + p_row[:, None] * K + o_k[None, :], b_w.to(W.dtype.element_ty),
             mask=m_t[:, None] & (o_k < K)[None, :])
    _store_u0(U0, v, b_Ai, b_b, r, m_t, p_row, V, BV, DT, LOWP, PREC)


@triton.jit
def _store_u0(U0, v, b_Ai, b_b, r, m_t, p_row, V: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
              LOWP: tl.constexpr, PREC: tl.constexpr):
    """U0 = Ai diag(b) V ([C, V], U0's type) at rows ``p_row`` of its [B, H, T, V] workspace."""
    o_v = tl.arange(0, BV)
    m_v = (o_v < V)[None, :]
    b_v = tl.load(v + r[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v, other=0.0).to(tl.float32)
    b_u0 = dot(b_Ai, b_b[:, None] * b_v, LOWP, DT, PREC)
    tl.store(U0 + p_row[:, None] * V + o_v[None, :], b_u0.to(U0.dtype.element_ty), mask=m_t[:, None] & m_v)


@triton.jit(do_not_specialize=["c0"])
def chunk_prepare_kernel(
    q1, q2, q3, k1, k2, k3, v, g, beta, P, Ai, W, U0, Kw, Qw, Gc, cu_seqlens, chunk_indices, T, c0,
    H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr, C: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
    SOLVE: tl.constexpr, OUTER: tl.constexpr, KEY_GROUP: tl.constexpr, UNROLL_SOLVE: tl.constexpr = False,
):
    """One program per (chunk, head): the chunk's workspaces. Each output is written when it is
    given and skipped when None: ``P`` the scores; ``Ai`` the inverse (delta rule: ``beta``
    given; SOLVE "tiles" inverts it in place there, in [16, 16] tiles); ``W`` and ``U0`` the WY
    products (then Ai is stored only when given: the tile solve needs the memory, the backward
    reads it; with ``Kw`` too, the split form's, W is stored in Kw's column blocks); ``Kw`` /
    ``Qw`` the normalised phi(K) / phi(Q) ([B, H, T, K], its type), one column block of
    KEY_GROUP indices of axis 1 per store; ``Gc`` the cumulative log decay within the chunk ([B, H, T]
    fp32). ``g`` / ``beta`` / ``cu_seqlens`` None: no gates / no delta rule / not varlen (then
    programs are numbered over ``chunk_indices``' (sequence, chunk) pairs). ``c0``: the first
    chunk (or pair) of this launch, which may cover part of the sequence (the split form's
    pipelined parts)."""
    USE_BETA: tl.constexpr = beta is not None
    WY: tl.constexpr = W is not None
    o_c, m_t, r, p_row, i_last, p_last, _, _ = chunk_rows(T, H, C, cu_seqlens, chunk_indices, c0)
    b_c = chunk_log_decay(g, r, m_t, C)
    b_P, b_Ai = chunk_scores(
        q1, q2, q3, k1, k2, k3, beta, r, m_t, b_c,
        NF, D1, D2, D3, BD1, BD2, BD3, C, L2NORM, LOWP, PREC, SOLVE, P is not None,
    )
    # workspace [B, H, T, C]: row = token, as the sequential kernel reads it
    off_w = p_row[:, None] * C + o_c[None, :]
    if P is not None:
        tl.store(P + off_w, b_P, mask=m_t[:, None])
    if USE_BETA:
        if SOLVE == "tiles":  # b_Ai is A; invert it in place in the workspace, in [16, 16] tiles
            tl.store(Ai + off_w, b_Ai, mask=m_t[:, None])
            tl.debug_barrier()
            # the chunk's first row and its valid rows (rows from C on are never touched)
            unit_lower_inverse_tiles(Ai + (p_last - i_last) * C, i_last + 1, C, PREC, UNROLL_SOLVE)
            if WY:  # the inverse back in registers, for W and U0 (padded rows read 0: never stored)
                tl.debug_barrier()
                b_Ai = tl.load(Ai + off_w, mask=m_t[:, None], other=0.0)
        elif Ai is not None:  # the forward's wy applies the inverse below and does not store it
            tl.store(Ai + off_w, b_Ai, mask=m_t[:, None])
    if Gc is not None:
        tl.store(Gc + p_row, b_c, mask=m_t)
    b_inv = tl.full([C], 1.0, tl.float32)
    if L2NORM and (Kw is not None or WY):
        b_inv = phi_inv_norm(k1, k2, k3, r[:, None], m_t[:, None], D1, D2, D3, BD1, BD2, BD3, NF)
    if Kw is not None:
        _store_key_columns(Kw, k1, k2, k3, r, m_t, p_row, b_inv, NF, C, D1, D2, D3, KEY_GROUP, None, LOWP, PREC)
    if Qw is not None:
        b_qinv = tl.full([C], 1.0, tl.float32)
        if L2NORM:
            b_qinv = phi_inv_norm(q1, q2, q3, r[:, None], m_t[:, None], D1, D2, D3, BD1, BD2, BD3, NF)
        _store_key_columns(Qw, q1, q2, q3, r, m_t, p_row, b_qinv, NF, C, D1, D2, D3, KEY_GROUP, None, LOWP, PREC)
    if WY and Kw is not None:  # the split form: W in Kw's column blocks (no [C, K] tile), U0
        b_b = tl.load(beta + r, mask=m_t, other=0.0).to(tl.float32)
        _store_key_columns(W, k1, k2, k3, r, m_t, p_row, b_b * tl.exp(b_c) * b_inv, NF, C, D1, D2, D3, KEY_GROUP,
                           b_Ai, LOWP, PREC)
        _store_u0(U0, v, b_Ai, b_b, r, m_t, p_row, V, BV, q1.dtype.element_ty, LOWP, PREC)
    elif WY:
        _store_wy(W, U0, k1, k2, k3, v, beta, b_Ai, b_c, b_inv, r, m_t, p_row, q1.dtype.element_ty, NF,
                  D1, D2, D3, C, V, BK, BV, LOWP, PREC, OUTER)


# ----- launcher helpers -----
def chunk_indices(p: Problem, C: int, device: torch.device) -> torch.Tensor:
    """The (sequence, chunk) pairs of a varlen call, [chunks, 2] int32: the chunk-parallel grid."""
    pairs = [(n, c) for n, (lo, hi) in enumerate(p.seq_bounds) for c in range(triton.cdiv(hi - lo, C))]
    return torch.tensor(pairs, dtype=torch.int32).to(device)


def _run(p: Problem, q, k, v, g, beta, *, cu_seqlens, idx, l2norm: bool, config, outputs: dict,
         block_k: int, outer: bool, key_group: int = 1, chunks: tuple[int, int] | None = None) -> None:
    """One launch of the prepare kernel over all chunks, or over ``chunks`` = (first, end):
    a range of chunk numbers (not varlen) or of ``idx``'s pairs (varlen)."""
    C = config.chunk_size
    unroll = getattr(config, "unroll_solve", False)  # the split and streamed forms' field, else rolled
    B, T, H, V = v.shape
    c0, c1 = chunks if chunks is not None else (0, idx.shape[0] if cu_seqlens is not None else triton.cdiv(T, C))
    grid = (c1 - c0, H) if cu_seqlens is not None else (c1 - c0, B * H)
    cached(chunk_prepare_kernel)[grid](
        *factor_args(q), *factor_args(k), v, g, beta, outputs.get("P"), outputs.get("Ai"), outputs.get("W"),
        outputs.get("U0"), outputs.get("Kw"), outputs.get("Qw"), outputs.get("Gc"), cu_seqlens, idx, T, c0,
        H=H, NF=len(q), **width_args(p.key_widths, 16), C=C, V=V, BK=block_k, BV=max(16, next_pow2(V)),
        L2NORM=l2norm, LOWP=lowp_dots(v.dtype), PREC=config.dot_precision, SOLVE=config.solve, OUTER=outer,
        KEY_GROUP=key_group, UNROLL_SOLVE=unroll, num_warps=config.prepare_warps, num_stages=config.num_stages,
    )


def _wy_buffers(p: Problem, v) -> dict:
    """W ([B, H, T, K] in the products' operand type: 16-bit inputs' own) and U0 ([B, H, T, V] fp32)."""
    B, T, H, V = v.shape
    return {"W": args.empty(B, H, T, p.key_dim, dtype=dot_dtype(v), device=v.device),
            "U0": args.empty(B, H, T, V, dtype=torch.float32, device=v.device)}


def prepare_scores(config, p: Problem, q, k, v, g, beta, *, cu_seqlens, l2norm: bool, block_k: int, outer: bool,
                   wy: bool, scores: bool = True) -> dict:
    """The two-kernel forms' prepare step: allocates and fills P ([B, H, T, C] fp32; not with
    ``scores`` False, for a sequential kernel that forms it) and, with the delta rule, Ai ([B, H,
    T, C] fp32) or with ``wy`` W ([B, H, T, K] in the products' type) and U0 ([B, H, T, V] fp32),
    plus Ai for the tile solve (inverted in place there). Returns {"P", "Ai", "W", "U0"}, None for
    what is not made; launches nothing where nothing is made. ``block_k`` / ``outer``: how W's
    phi(K) tile is built (``outer``: as outer products of factor loads)."""
    B, T, H, V = v.shape
    C = config.chunk_size
    wy = wy and beta is not None  # without the delta rule there is no solve to move
    out = {"P": args.empty(B, H, T, C, dtype=torch.float32, device=v.device) if scores else None, "Ai": None,
           "W": None, "U0": None}
    if wy:
        out.update(_wy_buffers(p, v))
    if stores_inverse(beta is not None, wy, config.solve):
        out["Ai"] = args.empty(B, H, T, C, dtype=torch.float32, device=v.device)
    if all(x is None for x in out.values()):
        return out
    idx = chunk_indices(p, C, v.device) if cu_seqlens is not None else None
    _run(p, q, k, v, g, beta, cu_seqlens=cu_seqlens, idx=idx, l2norm=l2norm, config=config, outputs=out,
         block_k=block_k, outer=outer)
    return out


def keys_workspace(config, p: Problem, v, g, beta) -> dict:
    """The split form's prepare outputs, allocated: Kw (the normalised phi(K), [B, H, T, K] in
    the products' type; [B, T, H, K] with ``config.phi_pass``; None for ``config.loop`` "kron"),
    Ai ([B, H, T, C] fp32, delta rule: the loop's, or with ``config.wy`` the tile solve's scratch),
    W ([B, H, T, K] in the products' type) and U0 ([B, H, T, V] fp32) with ``config.wy`` and the
    delta rule, and Gc (the cumulative log decay within each
    chunk, [B, H, T] fp32, gates); None for what is not made."""
    B, T, H, V = v.shape
    if config.loop == "kron":  # the loop forms phi(K) from the factors
        kw = None
    elif config.phi_pass:  # token-major, filled by chunk_resident.fill_phi
        kw = args.empty(B, T, H, p.key_dim, dtype=dot_dtype(v), device=v.device)
    else:
        kw = args.empty(B, H, T, p.key_dim, dtype=dot_dtype(v), device=v.device)
    out = {"Kw": kw, "Ai": None, "W": None, "U0": None, "Gc": None}
    wy = config.wy and beta is not None
    if wy:
        out.update(_wy_buffers(p, v))
    if stores_inverse(beta is not None, wy, config.solve):
        out["Ai"] = args.empty(B, H, T, config.chunk_size, dtype=torch.float32, device=v.device)
    if g is not None:
        out["Gc"] = args.empty(B, H, T, dtype=torch.float32, device=v.device)
    return out


def prepare_keys(config, p: Problem, q, k, v, g, beta, *, cu_seqlens, idx, l2norm: bool, out: dict | None = None,
                 chunks: tuple[int, int] | None = None) -> dict:
    """The split form's prepare step: fills :func:`keys_workspace` (``out``, or a new one) and
    returns it. ``idx``: :func:`chunk_indices` with varlen, else None. ``chunks``: (first, end)
    chunk numbers to prepare (with varlen: of ``idx``'s pairs; all when None)."""
    out = keys_workspace(config, p, v, g, beta) if out is None else out
    _run(p, q, k, v, g, beta, cu_seqlens=cu_seqlens, idx=idx, l2norm=l2norm, config=config, outputs=out,
         block_k=p.key_dim, outer=False, key_group=config.key_group, chunks=chunks)
    return out


def prepare_backward(config, p: Problem, q, k, v, g, beta, *, cu_seqlens, idx, l2norm: bool, keys: bool = True) -> dict:
    """The backward's prepare step (one launch): P (the scores, [B, H, T, C] fp32), Ai ([B, H,
    T, C] fp32, delta rule), Gc ([B, H, T] fp32, gates) and, with ``keys`` (the resident state
    loops read them), Kw and Qw (the normalised phi(K) and phi(Q), [B, H, T, K] in the products'
    type). Returns {"Kw", "Qw", "P", "Ai", "Gc"}, None for what is not made. ``idx``:
    :func:`chunk_indices` with varlen, else None."""
    B, T, H, _ = v.shape
    C, dt = config.chunk_size, dot_dtype(v)
    out = {"Kw": None, "Qw": None, "P": args.empty(B, H, T, C, dtype=torch.float32, device=v.device), "Ai": None,
           "Gc": None}
    if keys:
        out["Kw"] = args.empty(B, H, T, p.key_dim, dtype=dt, device=v.device)
        out["Qw"] = args.empty(B, H, T, p.key_dim, dtype=dt, device=v.device)
    if beta is not None:
        out["Ai"] = args.empty(B, H, T, C, dtype=torch.float32, device=v.device)
    if g is not None:
        out["Gc"] = args.empty(B, H, T, dtype=torch.float32, device=v.device)
    _run(p, q, k, v, g, beta, cu_seqlens=cu_seqlens, idx=idx, l2norm=l2norm, config=config, outputs=out,
         block_k=p.key_dim, outer=False, key_group=config.key_group)
    return out
