"""Triton building blocks shared by the recurrent and chunk kernels: phi builders, factor tiles,
per-axis Gram scores, state tile loads, the program-to-sequence/chunk mapping and the products'
operand rule (:func:`dot`). The solves of (I + A)^-1 are ``solves.py``'s.

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

from .inputs import LOG_DECAY_FLOOR
from .solves import unit_lower_inverse, unit_lower_inverse_products

L2NORM_EPS = 1e-6  # same as the references and flash-linear-attention
DECAY_FLOOR = tl.constexpr(LOG_DECAY_FLOOR)  # see inputs.LOG_DECAY_FLOOR


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


# ----- the chunk kernels' building blocks -----
@triton.jit
def dot(a, b, LOWP: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """a @ b: 16-bit operands in their own type (tensor cores), else fp32 at precision PREC (an
    operand loaded from a 16-bit workspace is widened: bf16 inputs under the interpreter)."""
    if LOWP:
        return tl.dot(a.to(DT), b.to(DT))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def delta_outputs(b_ks, b_qs, b_gam, b_v, b_b, b_Ai, b_P, scale, Rc, p_rows, m_o, USE_BETA: tl.constexpr,
                  LOWP: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """A chunk's step after its state products (``b_ks`` / ``b_qs``: phi(K) S and phi(Q) S with
    their rows' scales; ``b_gam``: Gamma): U = Ai diag(beta) R with R = V - diag(Gamma) phi(K) S
    (V without the delta rule) and the outputs scale (diag(Gamma) phi(Q) S + P U), fp32. ``Rc``
    not None (the streamed backward's recompute): R is stored there at ``p_rows``, before the
    solve product: stored after it, the recompute kernel's SASS changed (offline, sm_90, o3
    64x64), here it is the same as before the step was shared. The streamed and stepped loops
    share it, so their step cannot drift apart."""
    if USE_BETA:
        b_R = b_v - b_gam[:, None] * b_ks
        if Rc is not None:
            tl.store(Rc + p_rows, b_R, mask=m_o)
        b_u = dot(b_Ai, b_b[:, None] * b_R, LOWP, DT, PREC)
    else:
        b_u = b_v
    b_o = scale * (b_gam[:, None] * b_qs + dot(b_P, b_u, LOWP, DT, PREC))
    return b_u, b_o


@triton.jit
def phi_block(p1, p2, p3, r, m_t, i_k, C: tl.constexpr, BK: tl.constexpr, NF: tl.constexpr,
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
def scores_from_tiles(q1, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, b_b, b_c,
                      NF: tl.constexpr, C: tl.constexpr, USE_BETA: tl.constexpr, LOWP: tl.constexpr,
                      PREC: tl.constexpr, SOLVE: tl.constexpr, NEED_P: tl.constexpr = True):
    """P = prod Q_i K_i^T * decay * causal, and Ai = (I + A)^-1 (identity without beta), from
    the chunk's (normalised) [C, BD_i] factor tiles, its beta ``b_b`` and log decay ``b_c``.

    Gram blocks take the factors in the input type when it is 16-bit (tensor cores; at K = 256
    order 2 the fp32 Grams made the prepare step dominate), else fp32 at PREC. SOLVE "rows":
    the inverse row by row in registers; "products": in registers by [C, C] products
    (:func:`unit_lower_inverse_products`); "tiles": Ai is A itself, for the caller to invert in
    memory (:func:`unit_lower_inverse_tiles`). ``q1`` only names the input type. Without
    NEED_P, P is zeros and the query tiles are not read (the split form's prepare kernel).
    """
    DT: tl.constexpr = q1.dtype.element_ty
    o_c = tl.arange(0, C)
    b_qk = tl.zeros([C, C], dtype=tl.float32)
    if NEED_P:
        b_qk = dot(b_q1, tl.trans(b_k1), LOWP, DT, PREC)
    if USE_BETA:
        b_kk = dot(b_k1, tl.trans(b_k1), LOWP, DT, PREC)
    if NF > 1:
        if NEED_P:
            b_qk *= dot(b_q2, tl.trans(b_k2), LOWP, DT, PREC)
        if USE_BETA:
            b_kk *= dot(b_k2, tl.trans(b_k2), LOWP, DT, PREC)
    if NF > 2:
        if NEED_P:
            b_qk *= dot(b_q3, tl.trans(b_k3), LOWP, DT, PREC)
        if USE_BETA:
            b_kk *= dot(b_k3, tl.trans(b_k3), LOWP, DT, PREC)
    # exp of a masked difference: only j <= i is kept, where c_i - c_j <= 0 (no overflow)
    m_incl = o_c[:, None] >= o_c[None, :]
    b_decay = tl.exp(tl.where(m_incl, b_c[:, None] - b_c[None, :], float("-inf")))
    b_P = b_qk * b_decay
    if USE_BETA:
        b_A = tl.where(o_c[:, None] > o_c[None, :], b_b[:, None] * b_kk * b_decay, 0.0)
        if SOLVE == "tiles":
            b_Ai = b_A
        elif SOLVE == "products":
            b_Ai = unit_lower_inverse_products(b_A, C, PREC)
        else:
            b_Ai = unit_lower_inverse(b_A, C)
    else:
        b_Ai = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    return b_P, b_Ai


@triton.jit
def one_side_tiles(x1, x2, x3, r, m_t, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
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
def factor_tiles(q1, q2, q3, k1, k2, k3, r, m_t, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                 D3: tl.constexpr, BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr, L2NORM: tl.constexpr):
    """The [C, BD_i] tiles of every query and key factor (see :func:`one_side_tiles`)."""
    b_q1, b_q2, b_q3 = one_side_tiles(q1, q2, q3, r, m_t, NF, D1, D2, D3, BD1, BD2, BD3, L2NORM)
    b_k1, b_k2, b_k3 = one_side_tiles(k1, k2, k3, r, m_t, NF, D1, D2, D3, BD1, BD2, BD3, L2NORM)
    return b_q1, b_q2, b_q3, b_k1, b_k2, b_k3


@triton.jit
def chunk_scores(q1, q2, q3, k1, k2, k3, beta, r, m_t, b_c,
                 NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
                 BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr, C: tl.constexpr,
                 L2NORM: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
                 SOLVE: tl.constexpr, NEED_P: tl.constexpr = True):
    """:func:`scores_from_tiles` on the factor tiles of the token-head rows ``r`` (without
    NEED_P only the key tiles are read, and P is zeros); ``beta`` None: no delta rule."""
    USE_BETA: tl.constexpr = beta is not None
    if NEED_P:
        b_q1, b_q2, b_q3, b_k1, b_k2, b_k3 = factor_tiles(q1, q2, q3, k1, k2, k3, r, m_t, NF, D1, D2, D3,
                                                          BD1, BD2, BD3, L2NORM)
    else:
        b_k1, b_k2, b_k3 = one_side_tiles(k1, k2, k3, r, m_t, NF, D1, D2, D3, BD1, BD2, BD3, L2NORM)
        b_q1, b_q2, b_q3 = b_k1, b_k2, b_k3  # never read
    b_b = tl.zeros([C], dtype=tl.float32)
    if USE_BETA:
        b_b = tl.load(beta + r, mask=m_t, other=0.0).to(tl.float32)
    return scores_from_tiles(q1, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, b_b, b_c,
                             NF, C, USE_BETA, LOWP, PREC, SOLVE, NEED_P)


@triton.jit
def load_row_inputs(v, g, beta, r, r_g, m_t, o_v, m_v, C: tl.constexpr, V: tl.constexpr, LOAD_V: tl.constexpr,
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
def phi_from_tiles(b_x1, b_x2, b_x3, NF: tl.constexpr, C: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                   D3: tl.constexpr):
    """The whole [C, K] phi as the row-wise outer product of the factor tiles, in fp32 (cast
    to 16 bits before the reshape instead, o3 16x16 on the H200 took 0.534 against 0.512 ms
    with the resident default and 1.155 against 0.894 with the split form at C = 64)."""
    b_phi = b_x1
    if NF > 1:
        b_23 = b_x2
        if NF > 2:
            b_23 = tl.reshape(b_x2[:, :, None] * b_x3[:, None, :], [C, D2 * D3])
        b_phi = tl.reshape(b_x1[:, :, None] * b_23[:, None, :], [C, D1 * D2 * D3])
    return b_phi


@triton.jit
def state_tile(h0, ht, p_state, i_k, o_v, m_v, first, K: tl.constexpr, BK: tl.constexpr, V: tl.constexpr,
               USE_H0: tl.constexpr):
    """Key tile ``i_k`` ([BK, BV]) of a streamed state (see ``load_state_tile``); a tile past
    the last is masked off entirely, so reading one ahead costs nothing at the end."""
    o_k = i_k * BK + tl.arange(0, BK)
    off_s = p_state + o_k[:, None] * V + o_v[None, :]
    return load_state_tile(h0, ht, off_s, (o_k < K)[:, None] & m_v[None, :], first, USE_H0)


@triton.jit
def chunk_log_decay(g, r, m_t, C: tl.constexpr):
    """Cumulative log decay within the chunk (zeros when ``g`` is None); padded rows add 0, so
    the last row is c_C."""
    if g is not None:
        return floored_cumsum(tl.load(g + r, mask=m_t, other=0.0).to(tl.float32))
    else:
        return tl.zeros([C], dtype=tl.float32)


@triton.jit
def floored_cumsum(b_g):
    """The within-chunk cumulative sum of the log decays ``b_g`` ([C] fp32), each first raised to
    DECAY_FLOOR (g = -inf or -1e30: a closed gate, exp underflows to 0 all the same; see
    inputs.LOG_DECAY_FLOOR for the number). Every chunk form forms c here and only here."""
    return tl.cumsum(tl.maximum(b_g, DECAY_FLOOR), axis=0)


@triton.jit
def sequence_of_program(i_n, T, cu_seqlens):
    """Sequence ``i_n``'s start and end token and batch index (``cu_seqlens`` given: packed
    along T, B = 1)."""
    if cu_seqlens is not None:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        i_b = 0
    else:
        bos = 0
        eos = T
        i_b = i_n.to(tl.int64)
    return bos, eos, i_b


@triton.jit
def states_per_sequence(T, C: tl.constexpr, STRIDE: tl.constexpr):
    """Stored states per sequence of T tokens (not varlen): one per STRIDE chunks of C."""
    return tl.cdiv(tl.cdiv(T, C), STRIDE)


@triton.jit
def first_stored_state(i_n, i_b, T, cu_seqlens, state_offsets, C: tl.constexpr, STRIDE: tl.constexpr = 1):
    """Where sequence ``i_n`` (batch index ``i_b``)'s stored per-chunk states start in a [states,
    H, ...] buffer of every STRIDE-th chunk: ``state_offsets[i_n]`` with varlen, else ``i_b``
    times :func:`states_per_sequence` (the sequential kernels' stores, the chunk-parallel
    kernels' reads through :func:`chunk_of_program`)."""
    if cu_seqlens is not None:
        i_s = tl.load(state_offsets + i_n).to(tl.int64)
    else:
        i_s = i_b * states_per_sequence(T, C, STRIDE)
    return i_s


@triton.jit
def resident_state_tile(i_v, i_n, i_h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """Value block ``i_v`` of a sequential program's [K, BV] state tile (sequence ``i_n``, head
    ``i_h``): its value columns and mask, the tile's offsets within one [K, V] state and its mask,
    and its offsets in a [sequences, H, K, V] state buffer (int64)."""
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_k = tl.arange(0, K)
    off_k = o_k[:, None] * V + o_v[None, :]
    m_s = (o_k < K)[:, None] & m_v[None, :]
    off_s = (i_n.to(tl.int64) * H + i_h) * K * V + off_k
    return o_v, m_v, o_k, off_k, m_s, off_s


@triton.jit
def chunk_of_program(i_c, i_n, T, cu_seqlens, chunk_indices, state_offsets, C: tl.constexpr,
                     STRIDE: tl.constexpr = 1):
    """Where a chunk-parallel program's chunk lies: (chunk within its sequence, sequence start and
    end token, batch index, and the index of the stored state its window of STRIDE chunks starts
    from: with STRIDE 1 the chunk number over all sequences; ``state_offsets``, each varlen
    sequence's first, is read only with STRIDE > 1). Varlen programs (``cu_seqlens`` given) are
    numbered over the (sequence, chunk) pairs of ``chunk_indices``, in sequence order."""
    i_s = i_c.to(tl.int64)
    if cu_seqlens is not None:
        i_n = tl.load(chunk_indices + 2 * i_c)
        i_c = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64)
        if STRIDE > 1:
            i_s = tl.load(state_offsets + i_n).to(tl.int64) + i_c // STRIDE
    bos, eos, i_b = sequence_of_program(i_n, T, cu_seqlens)
    if cu_seqlens is None:
        i_s = i_b * states_per_sequence(T, C, STRIDE) + i_c // STRIDE
    return i_c, bos, eos, i_b, i_s


@triton.jit
def chunk_rows(T, H: tl.constexpr, C: tl.constexpr, cu_seqlens, chunk_indices, c0=0):
    """The program's chunk rows (program axis 0: chunk, or pair of ``chunk_indices`` when varlen,
    counted from ``c0``, the first of a launch that covers part of the sequence; axis 1: sequence
    x head): token offsets, their mask, the token-head rows ``r`` of [B, T, H, ..] tensors, the
    rows ``p_row`` of [B, H, T, ..] workspaces, the chunk's last valid row index among ``o_c``,
    the last token's ``p_row``, and the state chunk index."""
    i_nh = tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_c, bos, eos, i_b, i_s = chunk_of_program(tl.program_id(0) + c0, i_n, T, cu_seqlens, chunk_indices,
                                               chunk_indices, C)
    o_c = tl.arange(0, C)
    tok = bos + i_c * C + o_c
    m_t = tok < eos
    r = (i_b * T + tok) * H + i_h
    p_row = (i_b * H + i_h) * T + tok
    n_valid = tl.minimum(bos + i_c * C + C, eos) - (bos + i_c * C)
    p_last = (i_b * H + i_h) * T + bos + i_c * C + n_valid - 1
    return o_c, m_t, r, p_row, n_valid - 1, p_last, i_s, i_h


@triton.jit
def load_wy(W, U0, p_row, m_t, o_v, m_v, K: tl.constexpr, BK: tl.constexpr, V: tl.constexpr):
    """The chunk's [C, BK] rows of W (BK >= K) and [C, BV] block of U0 (see the WY prepare)."""
    o_k = tl.arange(0, BK)
    b_W = tl.load(W + p_row[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :],
                  other=0.0).to(tl.float32)
    b_U0 = tl.load(U0 + p_row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
    return b_W, b_U0


@triton.jit
def chunk_inputs(q1, q2, q3, k1, k2, k3, v, g, beta, P, Ai, W, U0, r, m_t, o_v, m_v, p_row,
                  NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
                  BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                  V: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr, SCORES: tl.constexpr):
    """One chunk's inputs loaded where they are used (no PREFETCH): its log decay c, P and Ai
    (from the workspace, or formed here when SCORES is "rows" / "tiles": the fused form, whose
    Grams, solve and score products stay fp32), W and U0 (W given), the rows' 1 / ||phi(q)||
    and 1 / ||phi(k)|| (L2NORM; else ones), values and beta. Placeholders are never read."""
    b_c = chunk_log_decay(g, r, m_t, C)
    b_W = tl.zeros([C, 16], dtype=tl.float32)
    b_U0 = tl.zeros([C, 16], dtype=tl.float32)
    b_Ai = tl.zeros([C, C], dtype=tl.float32)
    if SCORES != "workspace":
        b_P, b_Ai = chunk_scores(q1, q2, q3, k1, k2, k3, beta, r, m_t, b_c, NF, D1, D2, D3, BD1, BD2, BD3, C,
                                 L2NORM, False, PREC, SCORES)
    else:
        b_P = tl.load(P + p_row[:, None] * C + tl.arange(0, C)[None, :], mask=m_t[:, None], other=0.0)
        if W is not None:
            b_W, b_U0 = load_wy(W, U0, p_row, m_t, o_v, m_v, D1 * D2 * D3, BK, V)
        elif beta is not None:
            b_Ai = tl.load(Ai + p_row[:, None] * C + tl.arange(0, C)[None, :], mask=m_t[:, None], other=0.0)
    r_q = tl.full([C], 1.0, tl.float32)
    r_k = tl.full([C], 1.0, tl.float32)
    if L2NORM:  # ||phi|| = prod ||x_i||: one scale per row instead of normalising phi
        r_q = phi_inv_norm(q1, q2, q3, r[:, None], m_t[:, None], D1, D2, D3, BD1, BD2, BD3, NF)
        r_k = phi_inv_norm(k1, k2, k3, r[:, None], m_t[:, None], D1, D2, D3, BD1, BD2, BD3, NF)
    b_v, _, b_b = load_row_inputs(v, g, beta, r, r, m_t, o_v, m_v, C, V, True, False, beta is not None)
    return b_c, b_P, b_Ai, b_W, b_U0, r_q, r_k, b_v, b_b
