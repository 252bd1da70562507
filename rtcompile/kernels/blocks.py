"""Triton helpers shared by the recurrent and chunk kernels.

The Kronecker feature phi(x) = x1 (x) x2 (x) x3 is never stored in HBM: kernels gather the
narrow factors (width d_i) for a tile of flattened key indices kk and multiply them on chip.
With row-major phi (x1's index major), factor i of kk is ``(kk // DIV_i) % D_i`` where DIV_i is
the product of the widths after i. Kernels take up to three factors (orders 2 to 4); unused
factor pointers are never dereferenced (``NF`` is a constexpr).

Per-token tensors are contiguous ``[B, T, H, d]``, so every one of them is addressed by the
token-head row ``r = (b T + t) H + h``: factor i at ``r * D_i``, v and o at ``r * V``, g and
beta at ``r``.
"""

from __future__ import annotations

import triton
import triton.language as tl

L2NORM_EPS = 1e-6  # same as the references and flash-linear-attention


@triton.jit
def phi_gather(p1, p2, p3, r, kk, m, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
               NF: tl.constexpr):
    """Raw phi at flattened key indices ``kk`` for the token-head rows ``r`` (broadcastable)."""
    b_phi = tl.load(p1 + r * D1 + kk // (D2 * D3), mask=m, other=0.0).to(tl.float32)
    if NF > 1:
        b_phi *= tl.load(p2 + r * D2 + (kk // D3) % D2, mask=m, other=0.0).to(tl.float32)
    if NF > 2:
        b_phi *= tl.load(p3 + r * D3 + kk % D3, mask=m, other=0.0).to(tl.float32)
    return b_phi


@triton.jit
def factor_inv_norm(p, r, m, D: tl.constexpr, BD: tl.constexpr):
    """1 / ||x|| of the factor at token-head row ``r``: a scalar or a [C, 1] column."""
    o_d = tl.arange(0, BD)
    b_x = tl.load(p + r * D + o_d, mask=m & (o_d < D), other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(b_x * b_x, axis=-1) + 1e-6)


@triton.jit
def phi_inv_norm(p1, p2, p3, r, m, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
                 BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr, NF: tl.constexpr):
    """1 / ||phi|| = prod_i 1 / ||x_i||: one scale per token instead of normalising phi."""
    b_r = factor_inv_norm(p1, r, m, D1, BD1)
    if NF > 1:
        b_r *= factor_inv_norm(p2, r, m, D2, BD2)
    if NF > 2:
        b_r *= factor_inv_norm(p3, r, m, D3, BD3)
    return b_r


@triton.jit
def factor_tile(p, r, m_t, D: tl.constexpr, BD: tl.constexpr, L2NORM: tl.constexpr):
    """[C, BD] tile of one factor for the token-head rows ``r`` ([C]), optionally normalised."""
    o_d = tl.arange(0, BD)
    b_x = tl.load(p + r[:, None] * D + o_d[None, :], mask=m_t[:, None] & (o_d < D)[None, :], other=0.0)
    b_x = b_x.to(tl.float32)
    if L2NORM:
        b_x = b_x * tl.rsqrt(tl.sum(b_x * b_x, axis=1) + 1e-6)[:, None]
    return b_x


@triton.jit
def unit_lower_inverse(b_A, C: tl.constexpr):
    """(I + A)^-1 for a strictly lower-triangular [C, C] tile, by forward substitution.

    Row i of X = (I + A)^-1 is e_i - sum_{j<i} A[i, j] X[j, :]; rows are final in order.
    """
    o_c = tl.arange(0, C)
    b_X = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    for i in range(1, C):
        b_a = tl.sum(tl.where(o_c[:, None] == i, b_A, 0.0), axis=0)
        b_row = tl.where(o_c == i, 1.0, 0.0) - tl.sum(b_a[:, None] * b_X, axis=0)
        b_X = tl.where(o_c[:, None] == i, b_row[None, :], b_X)
    return b_X


@triton.jit
def unit_lower_inverse_blocked(b_A, C: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for a strictly lower-triangular [C, C] tile, by diagonal blocks of BS rows.

    :func:`unit_lower_inverse` takes C - 1 serial steps, each two cross-warp reductions over
    the whole tile: the latency that made the fused-prepare kernel 2.3x slower than the
    two-kernel one at C = 64 on an H200. Here forward substitution runs in all C / BS diagonal
    blocks at once (BS - 1 steps), and the off-diagonal blocks follow from products: with
    X = (I + A_d)^-1 for the block diagonal A_d of A and A_o = A - A_d,

        I + A = (I + A_d)(I + N),   N = X A_o   (strictly block lower: N^(C/BS) = 0),
        (I + A)^-1 = (I - N)(I + N^2)(I + N^4)... X

    Every power of N is a sum of products along chains of blocks, the same terms block forward
    substitution adds, so nothing grows that the row-by-row form would not.
    """
    NB: tl.constexpr = C // BS
    o_c = tl.arange(0, C)
    o_b = tl.arange(0, BS)
    m_d = (o_c[:, None] // BS) == (o_c[None, :] // BS)
    b_eye = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    b_Ad = tl.reshape(tl.where(m_d, b_A, 0.0), [NB, BS, C])
    b_E = tl.reshape(b_eye, [NB, BS, C])
    b_X = b_E
    for i in range(1, BS):
        m_row = (o_b == i)[None, :, None]
        # row i of every block: its A entries ([NB, C], zero outside the block), folded to the
        # block's own BS columns, then row_i = e_i - sum_j<i a_ij X_j inside each block
        b_a = tl.sum(tl.where(m_row, b_Ad, 0.0), axis=1)
        b_a = tl.sum(tl.reshape(b_a, [NB, NB, BS]), axis=1)
        b_row = tl.sum(tl.where(m_row, b_E, 0.0), axis=1) - tl.sum(b_a[:, :, None] * b_X, axis=1)
        b_X = tl.where(m_row, b_row[:, None, :], b_X)
    return _inverse_from_diagonal(tl.reshape(b_X, [C, C]), b_A, m_d, NB, PREC)


@triton.jit
def unit_lower_inverse_diagonal(b_A, C: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr):
    """:func:`unit_lower_inverse_blocked` with the diagonal blocks inverted on their own
    [C / BS, BS, BS] tiles instead of [C / BS, BS, C] row strips: each of the BS - 1 serial
    steps reduces BS columns per block, not C (a quarter of the data at C = 64, BS = 16), and
    the block-diagonal inverse is spread back to [C, C] once. Same arithmetic, same result."""
    NB: tl.constexpr = C // BS
    o_c = tl.arange(0, C)
    o_b = tl.arange(0, BS)
    o_n = tl.arange(0, NB)
    m_d = (o_c[:, None] // BS) == (o_c[None, :] // BS)
    # [NB, BS, NB, BS] view of A; block (n, n) of each row strip is its diagonal block
    m_blk = o_n[:, None, None, None] == o_n[None, None, :, None]
    b_Ab = tl.sum(tl.where(m_blk, tl.reshape(b_A, [NB, BS, NB, BS]), 0.0), axis=2)
    b_X = _eye_blocks(NB, BS)
    for i in range(1, BS):
        b_a = tl.sum(tl.where((o_b == i)[None, :, None], b_Ab, 0.0), axis=1)  # row i of every diagonal block
        b_X = _substitute_row(b_X, b_a, i, BS)
    b_Xd = tl.reshape(tl.where(m_blk, b_X[:, :, None, :], 0.0), [C, C])
    return _inverse_from_diagonal(b_Xd, b_A, m_d, NB, PREC)


@triton.jit
def _eye_blocks(NB: tl.constexpr, BS: tl.constexpr):
    """NB identity blocks, [NB, BS, BS] fp32: forward substitution's start."""
    o_b = tl.arange(0, BS)
    return tl.where((o_b[:, None] == o_b[None, :])[None, :, :], 1.0, 0.0) + tl.zeros([NB, BS, BS], dtype=tl.float32)


@triton.jit
def _substitute_row(b_X, b_a, i, BS: tl.constexpr):
    """One forward-substitution step in every block at once: row i of X = (I + A_b)^-1 becomes
    e_i - sum_j<i a_ij X_j, from row i of each block's A (``b_a``, [NB, BS])."""
    o_b = tl.arange(0, BS)
    b_row = tl.where(o_b == i, 1.0, 0.0)[None, :] - tl.sum(b_a[:, :, None] * b_X, axis=1)
    return tl.where((o_b == i)[None, :, None], b_row[:, None, :], b_X)


@triton.jit
def unit_lower_inverse_tiles(p_A, n_rows, C: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 in place, for the strictly lower-triangular [C, C] matrix stored at ``p_A``
    (row stride C, zeros above the diagonal; rows from ``n_rows`` on are neither read nor
    written), in [16, 16] tiles.

    The register forms above hold [C, C] fp32 tiles and their [C / 16, 16, C] views at once;
    at C = 64 that made the prepare kernel the larger half of an order 3 32x32 prefill on an
    H200 (1.32 of 2.50 ms, 2026-11-30e). Here the C / 16 diagonal blocks are inverted
    together by forward substitution, each step's A row read from memory (one reduction per
    step, not two), and the blocks below follow by block forward substitution,
    X_ij = -X_ii sum_{k=j}^{i-1} A_ik X_kj, as [16, 16] products, each X_ij stored in A_ij's
    place. Exact block elimination: the same terms as the row-by-row form. The caller stores
    A from the same program and puts a barrier between that store and this call.
    """
    NB: tl.constexpr = C // 16
    o_b = tl.arange(0, 16)
    o_n = tl.arange(0, NB)
    # the diagonal blocks as one [NB, 16, 16] tile: block n covers rows and columns 16n .. 16n+15
    b_X = _eye_blocks(NB, 16)
    p_diag = p_A + (o_n * 16 * (C + 1))[:, None]  # each block's top-left element, [NB, 1]
    for i in range(1, 16):
        m_i = (o_n * 16 + i < n_rows)[:, None]
        b_a = tl.load(p_diag + i * C + o_b[None, :], mask=m_i, other=0.0)  # row i of every block, [NB, 16]
        b_X = _substitute_row(b_X, b_a, i, 16)
    o_r = o_n[:, None, None] * 16 + o_b[None, :, None]
    tl.debug_barrier()  # every warp has read its A rows before the blocks are overwritten
    tl.store(p_diag[:, :, None] + o_b[None, :, None] * C + o_b[None, None, :], b_X, mask=o_r < n_rows)
    # block row i reads A's blocks (i, k) for k >= j only when it forms X_ij, so X_ij may take
    # the place of A_ij once every warp has read it (the barrier before each store); it reads
    # X blocks of rows < i, written before the barrier that starts the row
    for i in tl.static_range(1, NB):
        tl.debug_barrier()
        b_Xii = _tile(p_A, i, i, n_rows, C)
        for j in tl.static_range(0, i):
            b_S = tl.zeros([16, 16], dtype=tl.float32)
            for k in tl.static_range(j, i):
                b_S += tl.dot(_tile(p_A, i, k, n_rows, C), _tile(p_A, k, j, n_rows, C), input_precision=PREC)
            b_Xij = -tl.dot(b_Xii, b_S, input_precision=PREC)
            tl.debug_barrier()
            tl.store(p_A + (i * 16 + o_b)[:, None] * C + j * 16 + o_b[None, :], b_Xij,
                     mask=(i * 16 + o_b < n_rows)[:, None])


@triton.jit
def unit_lower_inverse_scratch(p_X, b_A, C: tl.constexpr, PREC: tl.constexpr):
    """:func:`unit_lower_inverse_tiles` for a [C, C] register tile, through this program's own
    [C, C] fp32 scratch at ``p_X`` (the fused kernel's: no workspace that grows with T). Padded
    rows of A are zero, so their rows of the inverse are identity rows."""
    o_c = tl.arange(0, C)
    off = o_c[:, None] * C + o_c[None, :]
    tl.debug_barrier()  # the previous chunk's inverse has been read by every warp
    tl.store(p_X + off, b_A)
    tl.debug_barrier()
    unit_lower_inverse_tiles(p_X, C, C, PREC)
    tl.debug_barrier()
    return tl.load(p_X + off)


@triton.jit
def _tile(p_A, i, j, n_rows, C: tl.constexpr):
    """Block (i, j) of the [C, C] matrix at p_A as a [16, 16] tile; rows from n_rows on read 0."""
    o_b = tl.arange(0, 16)
    return tl.load(p_A + (i * 16 + o_b)[:, None] * C + j * 16 + o_b[None, :], mask=(i * 16 + o_b < n_rows)[:, None],
                   other=0.0)


@triton.jit
def _inverse_from_diagonal(b_X, b_A, m_d, NB: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 from X = (I + A_d)^-1 (A_d: A on the block diagonal ``m_d``, NB blocks):
    (I - N)(I + N^2)(I + N^4)... X with N = X (A - A_d)."""
    b_N = tl.dot(b_X, tl.where(m_d, 0.0, b_A), input_precision=PREC)
    b_Y = b_X - tl.dot(b_N, b_X, input_precision=PREC)
    if NB > 2:  # (I + N^2)
        b_N = tl.dot(b_N, b_N, input_precision=PREC)
        b_Y += tl.dot(b_N, b_Y, input_precision=PREC)
    if NB > 4:  # (I + N^4)
        b_N = tl.dot(b_N, b_N, input_precision=PREC)
        b_Y += tl.dot(b_N, b_Y, input_precision=PREC)
    if NB > 8:  # (I + N^8); ChunkVariant.check allows at most 16 blocks
        b_N = tl.dot(b_N, b_N, input_precision=PREC)
        b_Y += tl.dot(b_N, b_Y, input_precision=PREC)
    return b_Y


@triton.jit
def phi_tile_outer(p1, p2, p3, r, m_t, i_k, C: tl.constexpr, BK: tl.constexpr, NF: tl.constexpr,
                   D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, OUT_DT: tl.constexpr = tl.float32):
    """Block ``i_k`` ([C, BK]) of phi for the rows ``r``, as an outer product of factor tiles.

    Needs power-of-two widths and ``BK`` a multiple of D2 * D3: the block then covers
    M1 = BK / (D2 D3) consecutive indices of axis 1 and all of axes 2 and 3, so it is
    reshape(x1[:, M1 block] (x) x2 (x) x3). Coalesced row loads and register products replace
    the per-element gathers of :func:`phi_gather` (which serve the other widths). The product
    is exact in fp32 (16-bit factors) and cast to ``OUT_DT`` before the reshape, so a 16-bit
    block moves half the bytes through whatever layout change the reshape needs and is
    rounded exactly as a cast after it would round it.
    """
    M1: tl.constexpr = BK // (D2 * D3)
    o_1 = i_k * M1 + tl.arange(0, M1)
    b_phi = tl.load(p1 + r[:, None] * D1 + o_1[None, :], mask=m_t[:, None] & (o_1 < D1)[None, :], other=0.0)
    b_phi = b_phi.to(tl.float32)
    if NF > 1:
        o_2 = tl.arange(0, D2)
        b_2 = tl.load(p2 + r[:, None] * D2 + o_2[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
        if NF > 2:  # one 4-d product and one reshape, not a reshape per factor pair
            o_3 = tl.arange(0, D3)
            b_3 = tl.load(p3 + r[:, None] * D3 + o_3[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
            b_phi = b_phi[:, :, None, None] * b_2[:, None, :, None] * b_3[:, None, None, :]
            b_phi = tl.reshape(b_phi.to(OUT_DT), [C, BK])
        else:
            b_phi = tl.reshape((b_phi[:, :, None] * b_2[:, None, :]).to(OUT_DT), [C, BK])
    else:
        b_phi = b_phi.to(OUT_DT)
    return b_phi


@triton.jit
def phi_row_outer(p1, p2, p3, r, i_k, BK: tl.constexpr, NF: tl.constexpr,
                  D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """Block ``i_k`` ([BK]) of phi for one token-head row ``r``: the one-row form of
    :func:`phi_tile_outer` (same conditions: power-of-two widths, BK a multiple of D2 * D3).
    Contiguous factor loads and a register outer product replace BK gathered loads."""
    M1: tl.constexpr = BK // (D2 * D3)
    o_1 = i_k * M1 + tl.arange(0, M1)
    b_phi = tl.load(p1 + r * D1 + o_1, mask=o_1 < D1, other=0.0).to(tl.float32)
    if NF > 1:
        b_2 = tl.load(p2 + r * D2 + tl.arange(0, D2)).to(tl.float32)
        if NF > 2:
            b_3 = tl.load(p3 + r * D3 + tl.arange(0, D3)).to(tl.float32)
            b_2 = tl.reshape(b_2[:, None] * b_3[None, :], [D2 * D3])
        b_phi = tl.reshape(b_phi[:, None] * b_2[None, :], [BK])
    return b_phi


@triton.jit
def load_state_tile(h0, ht, off, m, first, USE_H0: tl.constexpr, EVICT_FIRST: tl.constexpr = False):
    """A state tile before a step or chunk: the initial state (or zeros) the first time, the
    running buffer ``ht`` after that. ``first`` may be a runtime condition. EVICT_FIRST: the
    tile is read once here and not again before it is written back (a decode step), so its
    lines need not stay in L2."""
    if first:
        if USE_H0:
            if EVICT_FIRST:
                b_s = tl.load(h0 + off, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
            else:
                b_s = tl.load(h0 + off, mask=m, other=0.0).to(tl.float32)
        else:
            b_s = tl.zeros(off.shape, dtype=tl.float32)
    else:
        if EVICT_FIRST:
            b_s = tl.load(ht + off, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
        else:
            b_s = tl.load(ht + off, mask=m, other=0.0).to(tl.float32)
    return b_s
