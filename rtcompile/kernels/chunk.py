"""Chunk-parallel prefill kernels.

Per chunk of C tokens (local cumulative log decay c, Gamma = exp(c), D_ij = exp(c_i - c_j)):

    P  = (prod_i Q_i K_i^T) * D * causal          the scores, as products of per-axis Grams
    Ai = (I + tril(diag(b) (prod_i K_i K_i^T) * D, -1))^-1          (delta rule only)
    U  = Ai diag(b) (V - diag(Gamma) phi(K) S)         (U = V without the delta rule)
    O  = scale (diag(Gamma) phi(Q) S + P U)
    S' = Gamma_C S + (phi(K) * Gamma_C / Gamma)^T U

``chunk_prepare_running_tensor_kernel`` computes P and Ai for all chunks in parallel into a
[B, H, T, C] workspace; ``chunk_running_tensor_fwd_kernel`` walks the chunks of one
(sequence, head, value block) in order. The three-kernel form (``output_pass``) splits that
walk: ``chunk_state_running_tensor_kernel`` carries only the state (storing each chunk's
incoming state and U), and ``chunk_output_running_tensor_kernel`` computes P and the outputs of
all chunks in parallel; there the prepare kernel also stores each chunk's cumulative log
decay (gates) and, with stored keys, the normalised phi(K), which the other two read. With
FUSE_PREPARE the second kernel computes P and Ai itself (no workspace). Otherwise phi(Q) and
phi(K) are built on chip from the factors, tile by tile.
When BK covers K the [K, BV] state stays in registers (RESIDENT); otherwise it lives in the
final-state buffer, read twice and written once per chunk, so the workspace never grows
with T / C; there PREFETCH_STATE issues each state tile's load one tile ahead (without it,
every tile waited for its own load: ~1.2 TB/s of state traffic at order 3 64x64 on an H200).
Two more flags shorten the sequential loop for a resident state: PREFETCH issues
the next chunk's loads before the current chunk's arithmetic, and WY has the prepare kernel
apply the solve (W = Ai diag(b Gamma) phi(K), U0 = Ai diag(b) V), so U = U0 - W S and the
loop's dependency chain is two products (W S, then the state update) instead of three.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .blocks import (
    factor_tile, load_state_tile, phi_gather, phi_inv_norm, phi_tile_outer, unit_lower_inverse,
    unit_lower_inverse_scratch, unit_lower_inverse_tiles,
)

# The pre-redesign solves, kept here (not in blocks.py) until this file goes with triton_fwd.py.
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
def _dot(a, b, LOWP: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """a @ b: 16-bit operands in their own type (tensor cores), else fp32 at precision PREC."""
    if LOWP:
        return tl.dot(a.to(DT), b.to(DT))
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _phi_block(p1, p2, p3, r, m_t, i_k, C: tl.constexpr, BK: tl.constexpr, NF: tl.constexpr,
               D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, K: tl.constexpr, OUTER: tl.constexpr,
               OUT_DT: tl.constexpr = tl.float32):
    """Raw [C, BK] block ``i_k`` of phi: outer products when OUTER (in ``OUT_DT``: the dot's
    operand type when the block goes straight into a product), else gathers (fp32)."""
    if OUTER:
        b_phi = phi_tile_outer(p1, p2, p3, r, m_t, i_k, C, BK, NF, D1, D2, D3, OUT_DT)
    else:
        o_k = i_k * BK + tl.arange(0, BK)
        b_phi = phi_gather(p1, p2, p3, r[:, None], o_k[None, :], m_t[:, None] & (o_k < K)[None, :], D1, D2, D3, NF)
    return b_phi


@triton.jit
def _trailing_tile(p2, p3, r, m_t, C: tl.constexpr, NF: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
                   OUT_DT: tl.constexpr, TRANS: tl.constexpr = False):
    """[C, D2 * D3] raw outer product of the trailing factors of the rows ``r`` (NF >= 2); with
    TRANS its transpose [D2 * D3, C], built from transposed loads (the update's operand: the
    form the H200 tests passed with at order 4; no tl.trans of the tile).

    With a key tile of exactly D2 * D3 rows (KRON), tile ``i`` of phi is this tile with row c
    scaled by x1[c, i], and a row scale commutes with a product: phi_i S_i = x1[:, i] * (T S_i)
    and phi_i^T U = T^T (x1[:, i] * U). So T is built once per chunk, not once per tile and
    product, and no phi block is ever formed."""
    o_2 = tl.arange(0, D2)
    if TRANS:  # factor index on axis 0, row on axis 1
        b_2 = tl.load(p2 + r[None, :] * D2 + o_2[:, None], mask=m_t[None, :], other=0.0).to(tl.float32)
    else:
        b_2 = tl.load(p2 + r[:, None] * D2 + o_2[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
    b_t = b_2.to(OUT_DT)
    if NF > 2:
        o_3 = tl.arange(0, D3)
        if TRANS:
            b_3 = tl.load(p3 + r[None, :] * D3 + o_3[:, None], mask=m_t[None, :], other=0.0).to(tl.float32)
            b_t = tl.reshape((b_2[:, None, :] * b_3[None, :, :]).to(OUT_DT), [D2 * D3, C])
        else:
            b_3 = tl.load(p3 + r[:, None] * D3 + o_3[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
            b_t = tl.reshape((b_2[:, :, None] * b_3[:, None, :]).to(OUT_DT), [C, D2 * D3])
    return b_t


@triton.jit
def _lead_column(p1, r, m_t, i, D1: tl.constexpr):
    """x1[:, i] of the rows ``r`` (raw, fp32): tile ``i``'s row scales under KRON."""
    return tl.load(p1 + r * D1 + i, mask=m_t, other=0.0).to(tl.float32)


@triton.jit
def _scores_from_tiles(q1, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, b_b, b_c,
                       NF: tl.constexpr, C: tl.constexpr, USE_BETA: tl.constexpr, LOWP: tl.constexpr,
                       PREC: tl.constexpr, SOLVE: tl.constexpr, SOLVE_BLOCK: tl.constexpr,
                       NEED_P: tl.constexpr = True):
    """P = prod Q_i K_i^T * decay * causal, and Ai = (I + A)^-1 (identity without beta), from
    the chunk's (normalised) [C, BD_i] factor tiles, its beta ``b_b`` and log decay ``b_c``.

    Gram blocks take the factors in the input type when it is 16-bit (tensor cores; at K = 256
    order 2 the fp32 Grams made the prepare step dominate), else fp32 at PREC. The solve goes
    row by row (SOLVE = 0, solve="rows"), or by diagonal blocks of SOLVE_BLOCK rows inverted on
    row strips (1, "blocks") or on their own tiles (2, "diagonal"); with 3 ("tiles") Ai is A
    itself, for the prepare kernel to invert in its workspace (:func:`unit_lower_inverse_tiles`).
    ``q1`` only names the input type. Without NEED_P, P is zeros and the query tiles are not
    read (the three-kernel form's prepare kernel: its output kernel forms P).
    """
    DT: tl.constexpr = q1.dtype.element_ty
    o_c = tl.arange(0, C)
    b_qk = tl.zeros([C, C], dtype=tl.float32)
    if NEED_P:
        b_qk = _dot(b_q1, tl.trans(b_k1), LOWP, DT, PREC)
    if USE_BETA:
        b_kk = _dot(b_k1, tl.trans(b_k1), LOWP, DT, PREC)
    if NF > 1:
        if NEED_P:
            b_qk *= _dot(b_q2, tl.trans(b_k2), LOWP, DT, PREC)
        if USE_BETA:
            b_kk *= _dot(b_k2, tl.trans(b_k2), LOWP, DT, PREC)
    if NF > 2:
        if NEED_P:
            b_qk *= _dot(b_q3, tl.trans(b_k3), LOWP, DT, PREC)
        if USE_BETA:
            b_kk *= _dot(b_k3, tl.trans(b_k3), LOWP, DT, PREC)
    # exp of a masked difference: only j <= i is kept, where c_i - c_j <= 0 (no overflow)
    m_incl = o_c[:, None] >= o_c[None, :]
    b_decay = tl.exp(tl.where(m_incl, b_c[:, None] - b_c[None, :], float("-inf")))
    b_P = b_qk * b_decay
    if USE_BETA:
        b_A = tl.where(o_c[:, None] > o_c[None, :], b_b[:, None] * b_kk * b_decay, 0.0)
        if SOLVE == 1:
            b_Ai = unit_lower_inverse_blocked(b_A, C, SOLVE_BLOCK, PREC)
        elif SOLVE == 2:
            b_Ai = unit_lower_inverse_diagonal(b_A, C, SOLVE_BLOCK, PREC)
        elif SOLVE == 3:
            b_Ai = b_A
        else:
            b_Ai = unit_lower_inverse(b_A, C)
    else:
        b_Ai = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    return b_P, b_Ai


@triton.jit
def _one_side_tiles(x1, x2, x3, r, m_t, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
                    BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr, L2NORM: tl.constexpr):
    """The [C, BD_i] tiles of the query or the key factors (optionally normalised); the slots
    of factors beyond NF repeat the first tile and are never read."""
    b_x1 = factor_tile(x1, r, m_t, D1, BD1, L2NORM)
    b_x2 = b_x1
    b_x3 = b_x1
    if NF > 1:
        b_x2 = factor_tile(x2, r, m_t, D2, BD2, L2NORM)
    if NF > 2:
        b_x3 = factor_tile(x3, r, m_t, D3, BD3, L2NORM)
    return b_x1, b_x2, b_x3


@triton.jit
def _factor_tiles(q1, q2, q3, k1, k2, k3, r, m_t, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                  D3: tl.constexpr, BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr, L2NORM: tl.constexpr):
    """The [C, BD_i] tiles of every query and key factor (see :func:`_one_side_tiles`)."""
    b_q1, b_q2, b_q3 = _one_side_tiles(q1, q2, q3, r, m_t, NF, D1, D2, D3, BD1, BD2, BD3, L2NORM)
    b_k1, b_k2, b_k3 = _one_side_tiles(k1, k2, k3, r, m_t, NF, D1, D2, D3, BD1, BD2, BD3, L2NORM)
    return b_q1, b_q2, b_q3, b_k1, b_k2, b_k3


@triton.jit
def _chunk_scores(q1, q2, q3, k1, k2, k3, beta, r, m_t, b_c,
                  NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
                  BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr, C: tl.constexpr,
                  USE_BETA: tl.constexpr, L2NORM: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
                  SOLVE: tl.constexpr, SOLVE_BLOCK: tl.constexpr, NEED_P: tl.constexpr = True):
    """:func:`_scores_from_tiles` on the factor tiles of the token-head rows ``r`` (without
    NEED_P only the key tiles are read, and P is zeros)."""
    if NEED_P:
        b_q1, b_q2, b_q3, b_k1, b_k2, b_k3 = _factor_tiles(q1, q2, q3, k1, k2, k3, r, m_t, NF, D1, D2, D3,
                                                           BD1, BD2, BD3, L2NORM)
    else:
        b_k1, b_k2, b_k3 = _one_side_tiles(k1, k2, k3, r, m_t, NF, D1, D2, D3, BD1, BD2, BD3, L2NORM)
        b_q1, b_q2, b_q3 = b_k1, b_k2, b_k3  # never read
    b_b = tl.zeros([C], dtype=tl.float32)
    if USE_BETA:
        b_b = tl.load(beta + r, mask=m_t, other=0.0).to(tl.float32)
    return _scores_from_tiles(q1, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, b_b, b_c,
                              NF, C, USE_BETA, LOWP, PREC, SOLVE, SOLVE_BLOCK, NEED_P)


@triton.jit
def _load_row_inputs(v, g, beta, r, r_g, m_t, o_v, m_v, C: tl.constexpr, V: tl.constexpr, LOAD_V: tl.constexpr,
                     LOAD_G: tl.constexpr, LOAD_BETA: tl.constexpr):
    """The values ([C, BV], LOAD_V), log-decay terms (LOAD_G: ``g`` at rows ``r_g``, the gates
    or the prepare kernel's cumulative sums) and beta ([C]; LOAD_BETA) of the token-head rows
    ``r``, in fp32; a flag that is off leaves a zero placeholder (the values' [C, 16]) that is
    never read."""
    b_v = tl.zeros([C, 16], dtype=tl.float32)
    if LOAD_V:
        b_v = tl.load(v + r[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    b_g = tl.zeros([C], dtype=tl.float32)
    if LOAD_G:
        b_g = tl.load(g + r_g, mask=m_t, other=0.0).to(tl.float32)
    b_b = tl.zeros([C], dtype=tl.float32)
    if LOAD_BETA:
        b_b = tl.load(beta + r, mask=m_t, other=0.0).to(tl.float32)
    return b_v, b_g, b_b


@triton.jit
def _load_chunk(q1, q2, q3, k1, k2, k3, v, g, beta, P, Ai, W, U0, r, m_t, o_v, m_v, off_w, p_row,
                NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, C: tl.constexpr,
                K: tl.constexpr, BK: tl.constexpr, V: tl.constexpr, USE_G: tl.constexpr, USE_BETA: tl.constexpr,
                L2NORM: tl.constexpr, FUSE_PREPARE: tl.constexpr, WY: tl.constexpr):
    """Every input of one chunk that does not depend on the state, in registers: the (normalised)
    [C, D_i] factor tiles (each D_i a power of two >= 16, so a tile is exactly its factor), values,
    log-decay increments, beta, and the prepared P and Ai (WY: W and U0) unless FUSE_PREPARE. Slots a flag turns
    off hold a small placeholder that is never read. Issued one chunk ahead (PREFETCH), these
    loads wait behind the current chunk's arithmetic instead of in front of it."""
    b_q1, b_q2, b_q3, b_k1, b_k2, b_k3 = _factor_tiles(q1, q2, q3, k1, k2, k3, r, m_t, NF, D1, D2, D3,
                                                       D1, D2, D3, L2NORM)
    b_v, b_g, b_b = _load_row_inputs(v, g, beta, r, r, m_t, o_v, m_v, C, V, True, USE_G, USE_BETA)
    b_P = tl.zeros([C, C], dtype=tl.float32)
    b_Ai = tl.zeros([C, C], dtype=tl.float32)
    b_W = tl.zeros([C, 16], dtype=tl.float32)
    b_U0 = tl.zeros([C, 16], dtype=tl.float32)
    if not FUSE_PREPARE:
        b_P = tl.load(P + off_w, mask=m_t[:, None], other=0.0)
        if WY:
            b_W, b_U0 = _load_wy(W, U0, p_row, m_t, o_v, m_v, K, BK, V)
        elif USE_BETA:
            b_Ai = tl.load(Ai + off_w, mask=m_t[:, None], other=0.0)
    return b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, b_v, b_g, b_b, b_P, b_Ai, b_W, b_U0


@triton.jit
def _load_wy(W, U0, p_row, m_t, o_v, m_v, K: tl.constexpr, BK: tl.constexpr, V: tl.constexpr):
    """The chunk's [C, BK] rows of W (BK >= K) and [C, BV] block of U0 (see the WY prepare)."""
    o_k = tl.arange(0, BK)
    b_W = tl.load(W + p_row[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :],
                  other=0.0).to(tl.float32)
    b_U0 = tl.load(U0 + p_row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
    return b_W, b_U0


@triton.jit
def _phi_from_tiles(b_x1, b_x2, b_x3, NF: tl.constexpr, C: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                    D3: tl.constexpr):
    """The whole [C, K] phi as the row-wise outer product of the factor tiles, in fp32 (cast
    to 16 bits before the reshape instead, o3 16x16 on the H200 took 0.534 against 0.512 ms
    with the default variant and 1.155 against 0.894 with output_pass at C = 64, 2026-11-30g)."""
    b_phi = b_x1
    if NF > 1:
        b_23 = b_x2
        if NF > 2:
            b_23 = tl.reshape(b_x2[:, :, None] * b_x3[:, None, :], [C, D2 * D3])
        b_phi = tl.reshape(b_x1[:, :, None] * b_23[:, None, :], [C, D1 * D2 * D3])
    return b_phi


@triton.jit
def _state_tile(h0, ht, p_state, i_k, o_v, m_v, first, K: tl.constexpr, BK: tl.constexpr, V: tl.constexpr,
                USE_H0: tl.constexpr):
    """Key tile ``i_k`` ([BK, BV]) of a streamed state (see ``load_state_tile``); a tile past
    the last is masked off entirely, so reading one ahead costs nothing at the end."""
    o_k = i_k * BK + tl.arange(0, BK)
    off_s = p_state + o_k[:, None] * V + o_v[None, :]
    return load_state_tile(h0, ht, off_s, (o_k < K)[:, None] & m_v[None, :], first, USE_H0)


@triton.jit
def _chunk_log_decay(g, r, m_t, USE_G: tl.constexpr, C: tl.constexpr):
    """Cumulative log decay within the chunk; padded rows add 0, so the last row is c_C."""
    if USE_G:
        return tl.cumsum(tl.load(g + r, mask=m_t, other=0.0).to(tl.float32), axis=0)
    else:
        return tl.zeros([C], dtype=tl.float32)


@triton.jit
def _sequence_of_program(i_n, T, cu_seqlens, IS_VARLEN: tl.constexpr):
    """Sequence ``i_n``'s start and end token and batch index (varlen: packed along T, B = 1)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        i_b = 0
    else:
        bos = 0
        eos = T
        i_b = i_n.to(tl.int64)
    return bos, eos, i_b


@triton.jit
def _states_per_sequence(T, C: tl.constexpr, STRIDE: tl.constexpr):
    """Stored states per sequence of T tokens (not varlen): one per STRIDE chunks of C."""
    return tl.cdiv(tl.cdiv(T, C), STRIDE)


@triton.jit
def _chunk_of_program(i_c, i_n, T, cu_seqlens, chunk_indices, state_offsets, C: tl.constexpr,
                      IS_VARLEN: tl.constexpr, STRIDE: tl.constexpr = 1):
    """Where a chunk-parallel program's chunk lies: (chunk within its sequence, sequence start and
    end token, batch index, and the index of the stored state its window of STRIDE chunks starts
    from: with STRIDE 1 the chunk number over all sequences; ``state_offsets``, each varlen
    sequence's first, is read only with STRIDE > 1). Varlen programs are numbered over the
    (sequence, chunk) pairs of ``chunk_indices``, in sequence order."""
    i_s = i_c.to(tl.int64)
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + 2 * i_c)
        i_c = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64)
        if STRIDE > 1:
            i_s = tl.load(state_offsets + i_n).to(tl.int64) + i_c // STRIDE
    bos, eos, i_b = _sequence_of_program(i_n, T, cu_seqlens, IS_VARLEN)
    if not IS_VARLEN:
        i_s = i_b * _states_per_sequence(T, C, STRIDE) + i_c // STRIDE
    return i_c, bos, eos, i_b, i_s


@triton.jit
def _store_key_columns(dst, k1, k2, k3, r, m_t, p_row, b_scale, b_Ai, NF: tl.constexpr, C: tl.constexpr,
                       D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, K: tl.constexpr, LOWP: tl.constexpr,
                       PREC: tl.constexpr, APPLY: tl.constexpr, GROUP: tl.constexpr = 1):
    """Rows ``p_row`` of ``dst`` ([.., K], its type) := diag(b_scale) phi(K), or with APPLY
    Ai diag(b_scale) phi(K), one [C, D2 D3] column block per index i of axis 1: block i is the
    trailing factors' outer product T with row c scaled by x1[c, i] (see :func:`_trailing_tile`),
    so T is built once and no [C, K] tile is held (at C 64, K 256 and 2 warps that tile alone
    is 256 fp32 registers per thread). With GROUP > 1 (not APPLY) each store covers GROUP
    indices: x1's [C, GROUP] columns in one load, one [C, GROUP D2 D3] block (o3 16x16 C 64 on
    the H200: this store alone 0.047 ms with GROUP 4 against about 0.14 with one index per
    store, whose [C] column gathers each waited on a load). Needs power-of-two widths >= 16."""
    DT: tl.constexpr = k1.dtype.element_ty
    if NF == 1:  # phi is the factor itself: one block
        o_1 = tl.arange(0, D1)
        b_blk = tl.load(k1 + r[:, None] * D1 + o_1[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
        b_blk = b_blk * b_scale[:, None]
        if APPLY:
            b_blk = _dot(b_Ai, b_blk, LOWP, DT, PREC)
        tl.store(dst + p_row[:, None] * K + o_1[None, :], b_blk.to(dst.dtype.element_ty), mask=m_t[:, None])
    else:
        TW: tl.constexpr = D2 * D3
        b_t = _trailing_tile(k2, k3, r, m_t, C, NF, D2, D3, tl.float32)
        if GROUP == 1 or APPLY:
            o_j = tl.arange(0, TW)
            for i in range(D1):
                b_blk = b_t * (_lead_column(k1, r, m_t, i, D1) * b_scale)[:, None]
                if APPLY:
                    b_blk = _dot(b_Ai, b_blk, LOWP, DT, PREC)
                tl.store(dst + p_row[:, None] * K + i * TW + o_j[None, :], b_blk.to(dst.dtype.element_ty),
                         mask=m_t[:, None])
        else:  # GROUP indices of axis 1 per store: a [C, GROUP] load of x1 and one [C, GROUP TW] block
            o_g = tl.arange(0, GROUP)
            o_j = tl.arange(0, GROUP * TW)
            for i0 in range(0, D1, GROUP):
                b_x = tl.load(k1 + r[:, None] * D1 + i0 + o_g[None, :], mask=m_t[:, None], other=0.0)
                b_x = b_x.to(tl.float32) * b_scale[:, None]
                b_blk = tl.reshape((b_x[:, :, None] * b_t[:, None, :]).to(dst.dtype.element_ty), [C, GROUP * TW])
                tl.store(dst + p_row[:, None] * K + i0 * TW + o_j[None, :], b_blk, mask=m_t[:, None])


@triton.jit
def chunk_prepare_running_tensor_kernel(
    q1, q2, q3, k1, k2, k3, v, g, beta, P, Ai, W, U0, Kw, Gc, cu_seqlens, chunk_indices, T, c0,
    H: tl.constexpr, NF: tl.constexpr,
    D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr, C: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_BETA: tl.constexpr, L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr,
    LOWP: tl.constexpr, PREC: tl.constexpr, SOLVE: tl.constexpr, SOLVE_BLOCK: tl.constexpr, WY: tl.constexpr,
    OUTER: tl.constexpr, STORE_P: tl.constexpr = True, STORE_PHI: tl.constexpr = False,
    COLUMNS: tl.constexpr = False, STORE_GC: tl.constexpr = False, KEY_GROUP: tl.constexpr = 1,
):
    """P and Ai (WY: W and U0) of every chunk, in parallel; without STORE_P only Ai (the
    three-kernel form's output kernel computes P itself). STORE_PHI: the normalised phi(K)
    rows into ``Kw`` ([B, H, T, K], its type), for the state loop's stored keys. COLUMNS
    (power-of-two widths >= 16): phi(K) and W are formed and stored one column block per
    index of axis 1 (:func:`_store_key_columns`), never as a whole [C, K] tile. STORE_GC: the
    cumulative log decay within the chunk into ``Gc`` ([B, H, T] fp32; gates only). KEY_GROUP:
    indices of axis 1 per phi(K) store (:func:`_store_key_columns`). Program i
    takes chunk ``c0 + i`` (a time segment's first chunk; 0 with varlen)."""
    i_c, i_nh = tl.program_id(0) + c0, tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_c, bos, eos, i_b, _ = _chunk_of_program(i_c, i_n, T, cu_seqlens, chunk_indices, chunk_indices, C, IS_VARLEN)
    o_c = tl.arange(0, C)
    tok = bos + i_c * C + o_c
    m_t = tok < eos
    r = (i_b * T + tok) * H + i_h
    b_c = _chunk_log_decay(g, r, m_t, USE_G, C)
    b_P, b_Ai = _chunk_scores(
        q1, q2, q3, k1, k2, k3, beta, r, m_t, b_c,
        NF, D1, D2, D3, BD1, BD2, BD3, C, USE_BETA, L2NORM, LOWP, PREC, SOLVE, SOLVE_BLOCK, STORE_P,
    )
    # workspace [B, H, T, C]: row = token, as the sequential kernel reads it
    off_w = ((i_b * H + i_h) * T + tok)[:, None] * C + o_c[None, :]
    if STORE_P:
        tl.store(P + off_w, b_P, mask=m_t[:, None])
    if USE_BETA:
        if SOLVE == 3:  # solve="tiles": b_Ai is A; invert it in place in the workspace, in [16, 16] tiles
            tl.store(Ai + off_w, b_Ai, mask=m_t[:, None])
            tl.debug_barrier()
            unit_lower_inverse_tiles(Ai + ((i_b * H + i_h) * T + bos + i_c * C) * C, eos - bos - i_c * C, C, PREC)
            if WY:  # the inverse back in registers, for W and U0 (padded rows read 0: never stored)
                tl.debug_barrier()
                b_Ai = tl.load(Ai + off_w, mask=m_t[:, None], other=0.0)
        elif not WY:  # with wy the inverse is applied below and not stored
            tl.store(Ai + off_w, b_Ai, mask=m_t[:, None])
    p_row = (i_b * H + i_h) * T + tok
    if STORE_GC:
        tl.store(Gc + p_row, b_c, mask=m_t)
    b_inv = tl.full([C], 1.0, tl.float32)
    if L2NORM and (STORE_PHI or WY):
        b_inv = phi_inv_norm(k1, k2, k3, r[:, None], m_t[:, None], D1, D2, D3, BD1, BD2, BD3, NF)
    if STORE_PHI:
        _store_key_columns(Kw, k1, k2, k3, r, m_t, p_row, b_inv, b_Ai, NF, C, D1, D2, D3, K, LOWP, PREC, False,
                           KEY_GROUP)
    if WY:  # the solve applied here, in parallel: W = Ai diag(b Gamma / ||phi(k)||) phi(K), U0 = Ai diag(b) V
        DT: tl.constexpr = q1.dtype.element_ty
        b_b = tl.load(beta + r, mask=m_t, other=0.0).to(tl.float32)
        b_scale = b_b * tl.exp(b_c) * b_inv
        if COLUMNS:
            _store_key_columns(W, k1, k2, k3, r, m_t, p_row, b_scale, b_Ai, NF, C, D1, D2, D3, K, LOWP, PREC, True)
        else:
            b_phi = _phi_block(k1, k2, k3, r, m_t, 0, C, BK, NF, D1, D2, D3, K, OUTER)
            b_w = _dot(b_Ai, b_phi * b_scale[:, None], LOWP, DT, PREC)
            o_k = tl.arange(0, BK)
            tl.store(W + p_row[:, None] * K + o_k[None, :], b_w.to(W.dtype.element_ty),
                     mask=m_t[:, None] & (o_k < K)[None, :])
        o_v = tl.arange(0, BV)
        m_v = (o_v < V)[None, :]
        b_v = tl.load(v + r[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v, other=0.0).to(tl.float32)
        b_u0 = _dot(b_Ai, b_b[:, None] * b_v, LOWP, DT, PREC)
        tl.store(U0 + p_row[:, None] * V + o_v[None, :], b_u0, mask=m_t[:, None] & m_v)


@triton.jit
def _tile_products(b_s, b_tk, b_tq, q1, q2, q3, k1, k2, k3, r, m_t, i_k,
                   NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, K: tl.constexpr,
                   C: tl.constexpr, BK: tl.constexpr, OUTER: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
                   KRON: tl.constexpr):
    """Raw phi(K)_i S_i and phi(Q)_i S_i ([C, BV] each) of key tile ``i_k`` (``b_s``) for the
    rows ``r``: from the trailing tiles ``b_tk``/``b_tq`` and x1's column under KRON (unused
    placeholders otherwise), else from phi blocks built here."""
    DT: tl.constexpr = q1.dtype.element_ty
    DOT_DT: tl.constexpr = DT if LOWP else tl.float32
    if KRON:
        b_ks = _dot(b_tk, b_s, LOWP, DT, PREC) * _lead_column(k1, r, m_t, i_k, D1)[:, None]
        b_qs = _dot(b_tq, b_s, LOWP, DT, PREC) * _lead_column(q1, r, m_t, i_k, D1)[:, None]
    else:
        b_k = _phi_block(k1, k2, k3, r, m_t, i_k, C, BK, NF, D1, D2, D3, K, OUTER, DOT_DT)
        b_q = _phi_block(q1, q2, q3, r, m_t, i_k, C, BK, NF, D1, D2, D3, K, OUTER, DOT_DT)
        b_ks = _dot(b_k, b_s, LOWP, DT, PREC)
        b_qs = _dot(b_q, b_s, LOWP, DT, PREC)
    return b_ks, b_qs


@triton.jit
def _state_products(h0, ht, p_state, o_v, m_v, first, q1, q2, q3, k1, k2, k3, r, m_t,
                    NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
                    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    USE_H0: tl.constexpr, OUTER: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
                    PREFETCH_STATE: tl.constexpr, KRON: tl.constexpr):
    """Raw phi(K) S and phi(Q) S ([C, BV] each) of the rows ``r`` over a streamed state, tile by
    tile (a reading pass: nothing is written)."""
    DT: tl.constexpr = q1.dtype.element_ty
    DOT_DT: tl.constexpr = DT if LOWP else tl.float32
    NK: tl.constexpr = (K + BK - 1) // BK
    b_ks = tl.zeros([C, BV], dtype=tl.float32)
    b_qs = tl.zeros([C, BV], dtype=tl.float32)
    b_tk = b_ks  # placeholders without KRON (never read)
    b_tq = b_qs
    if KRON:
        b_tk = _trailing_tile(k2, k3, r, m_t, C, NF, D2, D3, DOT_DT)
        b_tq = _trailing_tile(q2, q3, r, m_t, C, NF, D2, D3, DOT_DT)
    if PREFETCH_STATE:
        b_sn = _state_tile(h0, ht, p_state, 0, o_v, m_v, first, K, BK, V, USE_H0)
    for i_k in range(NK):
        if PREFETCH_STATE:  # the next tile's load flies while this one is used
            b_s = b_sn
            b_sn = _state_tile(h0, ht, p_state, i_k + 1, o_v, m_v, first, K, BK, V, USE_H0)
        else:
            b_s = _state_tile(h0, ht, p_state, i_k, o_v, m_v, first, K, BK, V, USE_H0)
        b_ki, b_qi = _tile_products(b_s, b_tk, b_tq, q1, q2, q3, k1, k2, k3, r, m_t, i_k,
                                    NF, D1, D2, D3, K, C, BK, OUTER, LOWP, PREC, KRON)
        b_ks += b_ki
        b_qs += b_qi
    return b_ks, b_qs


@triton.jit
def chunk_running_tensor_fwd_kernel(
    q1, q2, q3, k1, k2, k3, v, g, beta, o, h0, ht, P, Ai, W, U0, cu_seqlens,
    scale, T,
    H: tl.constexpr, NF: tl.constexpr,
    D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_BETA: tl.constexpr, L2NORM: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr,
    FUSE_PREPARE: tl.constexpr, LOWP: tl.constexpr, LOWP_SCORES: tl.constexpr, PREC: tl.constexpr,
    OUTER: tl.constexpr, SOLVE: tl.constexpr, SOLVE_BLOCK: tl.constexpr, PREFETCH: tl.constexpr, WY: tl.constexpr,
    PREFETCH_STATE: tl.constexpr, MERGE_PASSES: tl.constexpr, KRON: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, i_b = _sequence_of_program(i_n, T, cu_seqlens, IS_VARLEN)
    DT: tl.constexpr = q1.dtype.element_ty
    DOT_DT: tl.constexpr = DT if LOWP else tl.float32  # what _dot casts its operands to
    NK: tl.constexpr = (K + BK - 1) // BK
    o_c = tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_state = (i_n.to(tl.int64) * H + i_h) * K * V
    if NK == 1:
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        off_s = p_state + o_k[:, None] * V + o_v[None, :]
        m_s = m_k[:, None] & m_v[None, :]
        b_s = load_state_tile(h0, ht, off_s, m_s, True, USE_H0)
    if PREFETCH:  # chunk 0's inputs; every iteration then issues the next chunk's loads first
        tok = bos + o_c
        m_t = tok < eos
        r = (i_b * T + tok) * H + i_h
        p_row = (i_b * H + i_h) * T + tok
        n_q1, n_q2, n_q3, n_k1, n_k2, n_k3, n_v, n_g, n_b, n_P, n_Ai, n_W, n_U0 = _load_chunk(
            q1, q2, q3, k1, k2, k3, v, g, beta, P, Ai, W, U0, r, m_t, o_v, m_v, p_row[:, None] * C + o_c[None, :],
            p_row, NF, D1, D2, D3, C, K, BK, V, USE_G, USE_BETA, L2NORM, FUSE_PREPARE, WY,
        )
    if NK > 1 and MERGE_PASSES:  # chunk 0's products; every later chunk's ride on the update pass
        tok = bos + o_c
        b_kn, b_qn = _state_products(h0, ht, p_state, o_v, m_v, True, q1, q2, q3, k1, k2, k3,
                                     (i_b * T + tok) * H + i_h, tok < eos, NF, D1, D2, D3, K, V, C, BK, BV,
                                     USE_H0, OUTER, LOWP, PREC, PREFETCH_STATE, KRON)
    for i_c in range(0, tl.cdiv(eos - bos, C)):
        tok = bos + i_c * C + o_c
        m_t = tok < eos
        r = (i_b * T + tok) * H + i_h
        r_q = tl.full([C], 1.0, tl.float32)
        r_k = tl.full([C], 1.0, tl.float32)
        if PREFETCH:
            b_q1, b_q2, b_q3, b_k1, b_k2, b_k3 = n_q1, n_q2, n_q3, n_k1, n_k2, n_k3
            b_v, b_g, b_b, b_P, b_Ai, b_W, b_U0 = n_v, n_g, n_b, n_P, n_Ai, n_W, n_U0
            tok_n = tok + C  # past the end: every load is masked off
            r_n = (i_b * T + tok_n) * H + i_h
            p_row = (i_b * H + i_h) * T + tok_n
            n_q1, n_q2, n_q3, n_k1, n_k2, n_k3, n_v, n_g, n_b, n_P, n_Ai, n_W, n_U0 = _load_chunk(
                q1, q2, q3, k1, k2, k3, v, g, beta, P, Ai, W, U0, r_n, tok_n < eos, o_v, m_v,
                p_row[:, None] * C + o_c[None, :], p_row, NF, D1, D2, D3, C, K, BK, V, USE_G, USE_BETA, L2NORM,
                FUSE_PREPARE, WY,
            )
            b_c = tl.zeros([C], dtype=tl.float32)
            if USE_G:
                b_c = tl.cumsum(b_g, axis=0)
            if FUSE_PREPARE:
                b_P, b_Ai = _scores_from_tiles(q1, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, b_b, b_c,
                                               NF, C, USE_BETA, LOWP_SCORES, PREC, SOLVE, SOLVE_BLOCK)
        else:
            b_c = _chunk_log_decay(g, r, m_t, USE_G, C)
            if FUSE_PREPARE:
                b_P, b_Ai = _chunk_scores(
                    q1, q2, q3, k1, k2, k3, beta, r, m_t, b_c,
                    NF, D1, D2, D3, BD1, BD2, BD3, C, USE_BETA, L2NORM, LOWP_SCORES, PREC, SOLVE, SOLVE_BLOCK,
                )
            else:
                p_row = (i_b * H + i_h) * T + tok
                b_P = tl.load(P + p_row[:, None] * C + o_c[None, :], mask=m_t[:, None], other=0.0)
                if WY:
                    b_W, b_U0 = _load_wy(W, U0, p_row, m_t, o_v, m_v, K, BK, V)
                elif USE_BETA:
                    b_Ai = tl.load(Ai + p_row[:, None] * C + o_c[None, :], mask=m_t[:, None], other=0.0)
            if L2NORM:  # ||phi|| = prod ||x_i||: one scale per row instead of normalising phi
                r_q = phi_inv_norm(q1, q2, q3, r[:, None], m_t[:, None], D1, D2, D3, BD1, BD2, BD3, NF)
                r_k = phi_inv_norm(k1, k2, k3, r[:, None], m_t[:, None], D1, D2, D3, BD1, BD2, BD3, NF)
            b_v = tl.load(v + r[:, None] * V + o_v[None, :],
                          mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
            if USE_BETA:
                b_b = tl.load(beta + r, mask=m_t, other=0.0).to(tl.float32)
        if FUSE_PREPARE and USE_BETA and SOLVE == 3:  # solve="tiles" fused: A inverted in this program's scratch
            b_Ai = unit_lower_inverse_scratch(Ai + (i_nh * tl.num_programs(0) + i_v).to(tl.int64) * C * C, b_Ai,
                                              C, PREC)
        b_gam = tl.exp(b_c)
        b_last = tl.sum(tl.where(o_c == C - 1, b_c, 0.0), axis=0)
        b_ratio = tl.exp(b_last - b_c)  # Gamma_C / Gamma_i <= 1
        if NK == 1:
            if PREFETCH:  # the tiles are normalised already: r_q = r_k = 1
                b_k = _phi_from_tiles(b_k1, b_k2, b_k3, NF, C, D1, D2, D3)
                b_q = _phi_from_tiles(b_q1, b_q2, b_q3, NF, C, D1, D2, D3)
            else:
                b_k = _phi_block(k1, k2, k3, r, m_t, 0, C, BK, NF, D1, D2, D3, K, OUTER) * r_k[:, None]
                b_q = _phi_block(q1, q2, q3, r, m_t, 0, C, BK, NF, D1, D2, D3, K, OUTER) * r_q[:, None]
            if WY:  # the delta's prediction, Ai diag(b Gamma) phi(K) S, in one product
                b_ws = _dot(b_W, b_s, LOWP, DT, PREC)
            else:
                b_ks = _dot(b_k, b_s, LOWP, DT, PREC)
            b_qs = _dot(b_q, b_s, LOWP, DT, PREC)
        else:
            if MERGE_PASSES:
                b_ks, b_qs = b_kn, b_qn
            else:
                b_ks, b_qs = _state_products(h0, ht, p_state, o_v, m_v, i_c == 0, q1, q2, q3, k1, k2, k3, r, m_t,
                                             NF, D1, D2, D3, K, V, C, BK, BV, USE_H0, OUTER, LOWP, PREC,
                                             PREFETCH_STATE, KRON)
            b_ks = b_ks * r_k[:, None]
            b_qs = b_qs * r_q[:, None]
        if WY:
            b_u = b_U0 - b_ws
        elif USE_BETA:
            b_u = _dot(b_Ai, b_b[:, None] * (b_v - b_gam[:, None] * b_ks), LOWP_SCORES, DT, PREC)
        else:
            b_u = b_v
        b_o = scale * (b_gam[:, None] * b_qs + _dot(b_P, b_u, LOWP_SCORES, DT, PREC))
        tl.store(o + r[:, None] * V + o_v[None, :],
                 b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        if NK == 1:
            b_s = tl.exp(b_last) * b_s + _dot(tl.trans(b_k * b_ratio[:, None]), b_u, LOWP, DT, PREC)
        else:
            # the rows' scale (1 / ||phi(k)||, Gamma_C / Gamma_i) on U ([C, BV], once per chunk)
            # instead of on every [C, BK] block of phi(K)
            b_us = b_u * (r_k * b_ratio)[:, None]
            if MERGE_PASSES:  # the next chunk's rows (all masked off after the last chunk)
                b_kn = tl.zeros([C, BV], dtype=tl.float32)
                b_qn = tl.zeros([C, BV], dtype=tl.float32)
                r_n = (i_b * T + tok + C) * H + i_h
                m_tn = tok + C < eos
            b_tkt = b_us  # placeholders without KRON (never read)
            b_tkn = b_us
            b_tqn = b_us
            if KRON:  # the chunk's trailing-factor tiles, shared by every key tile
                b_tkt = _trailing_tile(k2, k3, r, m_t, C, NF, D2, D3, DOT_DT, TRANS=True)
                if MERGE_PASSES:
                    b_tkn = _trailing_tile(k2, k3, r_n, m_tn, C, NF, D2, D3, DOT_DT)
                    b_tqn = _trailing_tile(q2, q3, r_n, m_tn, C, NF, D2, D3, DOT_DT)
            if PREFETCH_STATE:
                b_sn = _state_tile(h0, ht, p_state, 0, o_v, m_v, i_c == 0, K, BK, V, USE_H0)
            for i_k in range(NK):
                o_k = i_k * BK + tl.arange(0, BK)
                m_k = o_k < K
                off_s = p_state + o_k[:, None] * V + o_v[None, :]
                m_s = m_k[:, None] & m_v[None, :]
                if PREFETCH_STATE:  # tile i_k + 1 is not written yet in this pass: safe to read ahead
                    b_s = b_sn
                    b_sn = _state_tile(h0, ht, p_state, i_k + 1, o_v, m_v, i_c == 0, K, BK, V, USE_H0)
                else:
                    b_s = load_state_tile(h0, ht, off_s, m_s, i_c == 0, USE_H0)
                if KRON:
                    b_uk = b_us * _lead_column(k1, r, m_t, i_k, D1)[:, None]
                    b_s = tl.exp(b_last) * b_s + _dot(b_tkt, b_uk, LOWP, DT, PREC)
                else:
                    b_k = _phi_block(k1, k2, k3, r, m_t, i_k, C, BK, NF, D1, D2, D3, K, OUTER, DOT_DT)
                    b_s = tl.exp(b_last) * b_s + _dot(tl.trans(b_k), b_us, LOWP, DT, PREC)
                tl.store(ht + off_s, b_s.to(ht.dtype.element_ty), mask=m_s)
                if MERGE_PASSES:  # the updated tile is in registers: the next chunk's products now
                    b_kx, b_qx = _tile_products(b_s, b_tkn, b_tqn, q1, q2, q3, k1, k2, k3, r_n, m_tn, i_k,
                                                NF, D1, D2, D3, K, C, BK, OUTER, LOWP, PREC, KRON)
                    b_kn += b_kx
                    b_qn += b_qx
    if NK == 1:
        if STORE_HT:
            tl.store(ht + off_s, b_s.to(ht.dtype.element_ty), mask=m_s)


# ----- the three-kernel form (output_pass): prepare, a state-only sequential loop, outputs in parallel -----
@triton.jit
def _load_state_inputs(k1, k2, k3, v, g, beta, Ai, Gc, r, p_row, m_t, o_v, m_v,
                       NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, C: tl.constexpr,
                       V: tl.constexpr, USE_G: tl.constexpr, USE_BETA: tl.constexpr, L2NORM: tl.constexpr,
                       STORED_KEYS: tl.constexpr, WY: tl.constexpr, LOAD_GC: tl.constexpr, TMA: tl.constexpr):
    """One chunk's inputs of the state-only loop, in registers: the (normalised) [C, D_i] key
    factor tiles (each D_i a power of two >= 16; not with STORED_KEYS), values (not with WY),
    log-decay increments (LOAD_GC: their cumulative sums, from ``Gc``), beta and the prepared
    inverse (neither with WY). ``r`` indexes the token-major inputs, ``p_row`` the [B, H, T]
    workspaces. Slots a flag turns off hold a placeholder that is never read."""
    b_k1 = tl.zeros([C, 16], dtype=tl.float32)
    b_k2 = b_k1
    b_k3 = b_k1
    if not STORED_KEYS:
        b_k1, b_k2, b_k3 = _one_side_tiles(k1, k2, k3, r, m_t, NF, D1, D2, D3, D1, D2, D3, L2NORM)
    if LOAD_GC:  # the prepare kernel's cumulative sums, [B, H, T]
        b_v, b_g, b_b = _load_row_inputs(v, Gc, beta, r, p_row, m_t, o_v, m_v, C, V, not WY, USE_G,
                                         USE_BETA and not WY)
    else:
        b_v, b_g, b_b = _load_row_inputs(v, g, beta, r, r, m_t, o_v, m_v, C, V, not WY, USE_G, USE_BETA and not WY)
    b_Ai = tl.zeros([C, C], dtype=tl.float32)
    if USE_BETA and not WY and not TMA:  # (with TMA the loop reads it by descriptor)
        b_Ai = tl.load(Ai + p_row[:, None] * C + tl.arange(0, C)[None, :], mask=m_t[:, None], other=0.0)
    return b_k1, b_k2, b_k3, b_v, b_g, b_b, b_Ai


@triton.jit
def _store_chunk_state(Hc, i_row, b_s, off_k, m_s, i_v, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                       TMA: tl.constexpr):
    """The [K, BV] state ``b_s`` into row block ``i_row`` (stored state x H + head) of ``Hc``:
    through a descriptor with TMA (no layout change in registers), else a masked store."""
    if TMA:
        Hc.store([(i_row * K).to(tl.int32), i_v * BV], b_s.to(Hc.dtype))
    else:
        tl.store(Hc + i_row * K * V + off_k, b_s.to(Hc.dtype.element_ty), mask=m_s)


@triton.jit
def chunk_state_running_tensor_kernel(
    k1, k2, k3, v, g, beta, h0, ht, Ai, Kw, W, U0, Gc, Hc, Uc, cu_seqlens, chunk_offsets, T, c_lo, c_hi,
    H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_BETA: tl.constexpr, L2NORM: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
    PREFETCH: tl.constexpr, STORED_KEYS: tl.constexpr, WY: tl.constexpr, LOAD_GC: tl.constexpr,
    TMA: tl.constexpr = False, STRIDE: tl.constexpr = 1,
):
    """The sequential loop of the three-kernel form: the state only. Per chunk of one
    (sequence, head, value block) it stores the incoming state S into ``Hc`` ([chunks, H, K, V],
    in the dot operand type) and U = Ai diag(b) (V - diag(Gamma) phi(K) S) into ``Uc`` (laid out
    as v), then S' = Gamma_C S + phi(K)^T diag(Gamma_C / Gamma) U. The dependency chain from one
    chunk to the next is the three products; the next chunk's loads are issued before them, and
    phi(Q), the scores and the outputs are left to :func:`chunk_output_running_tensor_kernel`,
    which runs over all chunks at once. The [K, BV] state stays in registers (K = prod D_i).
    PREFETCH: the next chunk's inputs are loaded into registers before this chunk's products
    (else each chunk loads its own, and num_stages > 1 lets the compiler pipeline them).
    STORED_KEYS: phi(K) is read from ``Kw`` (normalised, [B, H, T, K], written by the prepare
    kernel) instead of built from the factor tiles. WY (delta rule):
    U = U0 - W S from the prepare kernel's W = Ai diag(b Gamma) phi(K) and U0 = Ai diag(b) V
    ([B, H, T, K] in the dot type and [B, H, T, V] fp32), a chain of two products. LOAD_GC: the
    cumulative log decay within each chunk is read from ``Gc`` ([B, H, T] fp32, written by the
    prepare kernel), so the loop holds no scan and no reduction across its warps. TMA (with
    STORED_KEYS): ``Kw`` is a descriptor of phi(K) as [B H T, K] read in [C, K] blocks, ``Hc``
    one of the stored states as [chunks H K, V] written in [K, BV] blocks and, with the delta
    rule, ``Ai`` one of the inverses as [B H T, C] (the H200 timing is in ``ChunkVariant``'s
    docstring; compiled offline for sm_90 as launched, neither form spills). A block's rows
    past the sequence are the next sequence's (or zeros): U's rows there are set to zero, so
    they add nothing.
    STRIDE: the incoming state is stored at every STRIDE-th chunk only (``Hc`` then holds
    [cdiv(chunks, STRIDE), H, K, V] per sequence run; ``chunk_offsets`` counts in those units),
    for the output kernel to carry across the chunks between. Only chunks
    [c_lo, c_hi) of each sequence are walked (a time segment), from ``h0`` (or zeros)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, i_b = _sequence_of_program(i_n, T, cu_seqlens, IS_VARLEN)
    if IS_VARLEN:
        i_g0 = tl.load(chunk_offsets + i_n).to(tl.int64)  # the sequence's first stored state in Hc
    else:
        i_g0 = i_b * _states_per_sequence(T, C, STRIDE)
    DT: tl.constexpr = k1.dtype.element_ty
    o_c = tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_k = tl.arange(0, K)
    off_k = o_k[:, None] * V + o_v[None, :]
    m_s = (o_k < K)[:, None] & m_v[None, :]
    off_s = (i_n.to(tl.int64) * H + i_h) * K * V + off_k
    b_s = load_state_tile(h0, ht, off_s, m_s, True, USE_H0)
    if PREFETCH:
        tok = bos + c_lo * C + o_c
        p_row = (i_b * H + i_h) * T + tok
        n_k1, n_k2, n_k3, n_v, n_g, n_b, n_Ai = _load_state_inputs(
            k1, k2, k3, v, g, beta, Ai, Gc, (i_b * T + tok) * H + i_h, p_row, tok < eos, o_v, m_v,
            NF, D1, D2, D3, C, V, USE_G, USE_BETA, L2NORM, STORED_KEYS, WY, LOAD_GC, TMA)
    for i_c in range(c_lo, tl.minimum(c_hi, tl.cdiv(eos - bos, C))):
        tok = bos + i_c * C + o_c
        m_t = tok < eos
        r = (i_b * T + tok) * H + i_h
        p_row = (i_b * H + i_h) * T + tok
        if PREFETCH:
            b_k1, b_k2, b_k3, b_v, b_g, b_b, b_Ai = n_k1, n_k2, n_k3, n_v, n_g, n_b, n_Ai
            tok_n = tok + C  # past the end: every load is masked off
            p_row_n = p_row + C
            n_k1, n_k2, n_k3, n_v, n_g, n_b, n_Ai = _load_state_inputs(
                k1, k2, k3, v, g, beta, Ai, Gc, (i_b * T + tok_n) * H + i_h, p_row_n, tok_n < eos, o_v, m_v,
                NF, D1, D2, D3, C, V, USE_G, USE_BETA, L2NORM, STORED_KEYS, WY, LOAD_GC, TMA)
        else:
            b_k1, b_k2, b_k3, b_v, b_g, b_b, b_Ai = _load_state_inputs(
                k1, k2, k3, v, g, beta, Ai, Gc, r, p_row, m_t, o_v, m_v,
                NF, D1, D2, D3, C, V, USE_G, USE_BETA, L2NORM, STORED_KEYS, WY, LOAD_GC, TMA)
        if STORED_KEYS:
            # one load, transposed in place for the update (o3 16x16 C 64 on the H200, 2026-11-30h:
            # the loop took 0.211 ms against 0.223 with a second, transposed load, and with half
            # the shared memory per stage a third stage fits: 0.172 ms)
            if TMA:  # one descriptor load: no per-element addresses or masks (see the docstring)
                b_k = Kw.load([((i_b * H + i_h) * T + bos + i_c * C).to(tl.int32), 0])
            else:
                b_k = tl.load(Kw + p_row[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
            b_kt = tl.trans(b_k)
        else:
            b_k = _phi_from_tiles(b_k1, b_k2, b_k3, NF, C, D1, D2, D3)
            b_kt = tl.trans(b_k)
        b_c = tl.zeros([C], dtype=tl.float32)
        b_last = 0.0
        if USE_G and LOAD_GC:  # the chunk's last token's entry: one scalar load, no reduction
            b_c = b_g
            b_last = tl.load(Gc + (i_b * H + i_h) * T + tl.minimum(bos + i_c * C + C, eos) - 1)
        elif USE_G:
            b_c = tl.cumsum(b_g, axis=0)
            b_last = tl.sum(tl.where(o_c == C - 1, b_c, 0.0), axis=0)
        # the incoming state, for the output kernel (a store: nothing waits on it)
        if STRIDE == 1:
            _store_chunk_state(Hc, (i_g0 + i_c) * H + i_h, b_s, off_k, m_s, i_v, K, V, BV, TMA)
        elif i_c % STRIDE == 0:
            _store_chunk_state(Hc, (i_g0 + i_c // STRIDE) * H + i_h, b_s, off_k, m_s, i_v, K, V, BV, TMA)
        if USE_BETA and WY:
            b_w = tl.load(W + p_row[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
            b_u = tl.load(U0 + p_row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
            b_u -= _dot(b_w, b_s, LOWP, DT, PREC)
        elif USE_BETA:
            b_ks = _dot(b_k, b_s, LOWP, DT, PREC)
            if TMA:  # rows past the sequence are the next one's: U's rows there are set to zero below
                b_Ai = Ai.load([((i_b * H + i_h) * T + bos + i_c * C).to(tl.int32), 0])
            b_u = _dot(b_Ai, b_b[:, None] * (b_v - tl.exp(b_c)[:, None] * b_ks), LOWP, DT, PREC)
            if TMA:
                b_u = tl.where(m_t[:, None], b_u, 0.0)
        else:
            b_u = b_v
        tl.store(Uc + r[:, None] * V + o_v[None, :], b_u.to(Uc.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        # Gamma_C / Gamma_i <= 1 on U's rows ([C, BV]) rather than on phi(K)'s ([C, K])
        b_s = tl.exp(b_last) * b_s + _dot(b_kt, b_u * tl.exp(b_last - b_c)[:, None], LOWP, DT, PREC)
    if STORE_HT:
        tl.store(ht + off_s, b_s.to(ht.dtype.element_ty), mask=m_s)


@triton.jit
def chunk_output_running_tensor_kernel(
    q1, q2, q3, k1, k2, k3, g, Gc, o, Hc, Uc, cu_seqlens, chunk_indices, state_offsets, scale, T, c0,
    H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
    LOAD_GC: tl.constexpr, STRIDE: tl.constexpr = 1,
):
    """O = scale (diag(Gamma) phi(Q) S_c + P U) for every chunk in parallel (the three-kernel
    form): S_c and U as :func:`chunk_state_running_tensor_kernel` stored them, P from the
    factor Grams as in the prepare kernel (computed here, so no [T, C] score workspace).
    Program i takes chunk ``c0 + i``, as in the prepare kernel; LOAD_GC: the cumulative log
    decay read from ``Gc``, as the state loop reads it. STRIDE: ``Hc`` holds the state at every
    STRIDE-th chunk only (``state_offsets``: each sequence's first, with varlen); chunk c reads
    the one at its window's first chunk w and adds the earlier chunks j of the window as
    cross-chunk scores, O = scale (diag(Gamma_w->t) phi(Q) S_w + sum_{w <= j <= c} P_cj U_j):
    the state is linear in the U rows, so S_c = decayed S_w + the phi(K_j)^T U_j between."""
    i_c, i_nh, i_v = tl.program_id(0) + c0, tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    i_c, bos, eos, i_b, i_s = _chunk_of_program(i_c, i_n, T, cu_seqlens, chunk_indices, state_offsets, C,
                                                IS_VARLEN, STRIDE)
    DT: tl.constexpr = q1.dtype.element_ty
    o_c = tl.arange(0, C)
    tok = bos + i_c * C + o_c
    m_t = tok < eos
    r = (i_b * T + tok) * H + i_h
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    if USE_G and LOAD_GC:
        b_c = tl.load(Gc + (i_b * H + i_h) * T + tok, mask=m_t, other=0.0)
    else:
        b_c = _chunk_log_decay(g, r, m_t, USE_G, C)
    b_q1, b_q2, b_q3, b_k1, b_k2, b_k3 = _factor_tiles(q1, q2, q3, k1, k2, k3, r, m_t, NF, D1, D2, D3,
                                                       D1, D2, D3, L2NORM)
    b_P, _ = _scores_from_tiles(q1, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, tl.zeros([C], dtype=tl.float32), b_c,
                                NF, C, False, LOWP, PREC, 0, 16)
    m_o = m_t[:, None] & m_v[None, :]
    b_u = tl.load(Uc + r[:, None] * V + o_v[None, :], mask=m_o, other=0.0)
    b_o = _dot(b_P, b_u, LOWP, DT, PREC)
    if STRIDE > 1:
        # the window's earlier chunks, nearest first; b_off: log decay from chunk j's start to
        # this one's (a [C] vector of one value: a loop-carried tensor of fixed type)
        b_off = tl.zeros([C], dtype=tl.float32)
        for i_j in range(i_c % STRIDE):
            j = i_c - 1 - i_j
            tok_j = bos + j * C + o_c  # a whole chunk: only a sequence's last chunk is partial
            r_j = (i_b * T + tok_j) * H + i_h
            if USE_G and LOAD_GC:
                b_cj = tl.load(Gc + (i_b * H + i_h) * T + tok_j)
            else:
                b_cj = _chunk_log_decay(g, r_j, tok_j < eos, USE_G, C)
            b_off += tl.sum(tl.where(o_c == C - 1, b_cj, 0.0), axis=0)
            b_kj1, b_kj2, b_kj3 = _one_side_tiles(k1, k2, k3, r_j, tok_j < eos, NF, D1, D2, D3, D1, D2, D3, L2NORM)
            b_g = _dot(b_q1, tl.trans(b_kj1), LOWP, DT, PREC)
            if NF > 1:
                b_g *= _dot(b_q2, tl.trans(b_kj2), LOWP, DT, PREC)
            if NF > 2:
                b_g *= _dot(b_q3, tl.trans(b_kj3), LOWP, DT, PREC)
            # t in this chunk is after every i in chunk j: the exponent is <= 0
            b_g *= tl.exp((b_c + b_off)[:, None] - b_cj[None, :])
            b_uj = tl.load(Uc + r_j[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
            b_o += _dot(b_g, b_uj, LOWP, DT, PREC)
        b_c += b_off
    b_q = _phi_from_tiles(b_q1, b_q2, b_q3, NF, C, D1, D2, D3)
    o_k = tl.arange(0, K)
    b_h = tl.load(Hc + (i_s * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=(o_k < K)[:, None] & m_v[None, :], other=0.0)
    b_o = scale * (tl.exp(b_c)[:, None] * _dot(b_q, b_h, LOWP, DT, PREC) + b_o)
    tl.store(o + r[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_o)
