"""The delta rule's solve: (I + A)^-1 for a chunk's strictly lower-triangular [C, C] matrix A
(unit-lower, so exact by substitution), three ways a config's ``solve`` picks: row by row in
registers ("rows", :func:`unit_lower_inverse`), in [16, 16] tiles in a workspace ("tiles",
:func:`unit_lower_inverse_tiles`; :func:`unit_lower_inverse_scratch` for a register tile), or by
[C, C] products in registers ("products", :func:`unit_lower_inverse_products`).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _diagonal_step(b_X, p_diag, o_n, i, n_rows, S: tl.constexpr):
    """Step i of the diagonal blocks' forward substitution, row i of every block's A read from
    memory at ``p_diag`` (each block's top-left element, [NB, 1]; row stride S)."""
    o_b = tl.arange(0, 16)
    b_a = tl.load(p_diag + i * S + o_b[None, :], mask=(o_n * 16 + i < n_rows)[:, None], other=0.0)  # [NB, 16]
    return _substitute_row(b_X, b_a, i, 16)


@triton.jit
def unit_lower_inverse_tiles(p_A, n_rows, C: tl.constexpr, PREC: tl.constexpr, UNROLL: tl.constexpr = False):
    """(I + A)^-1 in place, for the strictly lower-triangular [C, C] matrix stored at ``p_A``
    (row stride C, zeros above the diagonal; rows from ``n_rows`` on are neither read nor
    written), in [16, 16] tiles; at C = 128 as two 64-row halves, then X21 = -X22 A21 X11 (all
    eight blocks at once: Triton 3.6's LLVM lowering had not finished after 50 s on the H200).

    The register forms above hold [C, C] fp32 tiles and their [C / 16, 16, C] views at once;
    at C = 64 that made the prepare kernel the larger half of an order 3 32x32 prefill on an
    H200 (1.32 of 2.50 ms, 2026-11-30e). Here the C / 16 diagonal blocks are inverted
    together by forward substitution, each step's A row read from memory (one reduction per
    step, not two), and the blocks below follow by block forward substitution,
    X_ij = -X_ii sum_{k=j}^{i-1} A_ik X_kj, as [16, 16] products, each X_ij stored in A_ij's
    place. Exact block elimination: the same terms as the row-by-row form. The caller stores
    A from the same program and puts a barrier between that store and this call. UNROLL (a
    config's ``unroll_solve``) unrolls the 15 diagonal steps: H100, B8 T4096, compare_kron
    --solve at 6fe2f0a, o3 16x16 0.3506 ms against 0.3598, o3 32x32 0.7284 against 0.7369
    (prepare kernel 141.6 against 146.6 us), o2 64 1.006x; the rows from the diagonal blocks
    loaded at once: 0.972 / 1.013 / 1.079x. All of A loaded once and inverted in registers ran
    the o3 16x16 split default 1.13-1.68x as long at 1-4 prepare warps (H100, e906e88).
    """
    if C <= 64:
        _inverse_in_tiles(p_A, n_rows, C, C, PREC, UNROLL)
    else:
        H: tl.constexpr = C // 2
        _inverse_in_tiles(p_A, n_rows, H, C, PREC, UNROLL)
        _inverse_in_tiles(p_A + H * C + H, n_rows - H, H, C, PREC, UNROLL)
        tl.debug_barrier()  # both halves' inverses are stored
        o_h = tl.arange(0, H)
        m_r = (H + o_h < n_rows)[:, None]
        p_21 = p_A + (H + o_h)[:, None] * C + o_h[None, :]
        b_x11 = tl.load(p_A + o_h[:, None] * C + o_h[None, :], mask=(o_h < n_rows)[:, None], other=0.0)
        b_x22 = tl.load(p_21 + H, mask=m_r, other=0.0)
        b_x21 = -tl.dot(b_x22, tl.dot(tl.load(p_21, mask=m_r, other=0.0), b_x11, input_precision=PREC),
                        input_precision=PREC)
        tl.debug_barrier()  # every warp has read A21 before X21 takes its place
        tl.store(p_21, b_x21, mask=m_r)


@triton.jit
def _inverse_in_tiles(p_A, n_rows, C: tl.constexpr, S: tl.constexpr, PREC: tl.constexpr, UNROLL: tl.constexpr):
    """:func:`unit_lower_inverse_tiles` of the [C <= 64, C] block at ``p_A`` of a matrix with
    row stride ``S``."""
    NB: tl.constexpr = C // 16
    o_b = tl.arange(0, 16)
    o_n = tl.arange(0, NB)
    # the diagonal blocks as one [NB, 16, 16] tile: block n covers rows and columns 16n .. 16n+15
    b_X = _eye_blocks(NB, 16)
    p_diag = p_A + (o_n * 16 * (S + 1))[:, None]  # each block's top-left element, [NB, 1]
    if UNROLL:  # each step's row offset and mask constant
        for i in tl.static_range(1, 16):
            b_X = _diagonal_step(b_X, p_diag, o_n, i, n_rows, S)
    else:
        for i in range(1, 16):
            b_X = _diagonal_step(b_X, p_diag, o_n, i, n_rows, S)
    o_r = o_n[:, None, None] * 16 + o_b[None, :, None]
    tl.debug_barrier()  # every warp has read its A rows before the blocks are overwritten
    tl.store(p_diag[:, :, None] + o_b[None, :, None] * S + o_b[None, None, :], b_X, mask=o_r < n_rows)
    # block row i reads A's blocks (i, k) for k >= j only when it forms X_ij, so X_ij may take
    # the place of A_ij once every warp has read it (the barrier before each store); it reads
    # X blocks of rows < i, written before the barrier that starts the row
    for i in tl.static_range(1, NB):
        tl.debug_barrier()
        b_Xii = _tile(p_A, i, i, n_rows, S)
        for j in tl.static_range(0, i):
            b_S = tl.zeros([16, 16], dtype=tl.float32)
            for k in tl.static_range(j, i):
                b_S += tl.dot(_tile(p_A, i, k, n_rows, S), _tile(p_A, k, j, n_rows, S), input_precision=PREC)
            b_Xij = -tl.dot(b_Xii, b_S, input_precision=PREC)
            tl.debug_barrier()
            tl.store(p_A + (i * 16 + o_b)[:, None] * S + j * 16 + o_b[None, :], b_Xij,
                     mask=(i * 16 + o_b < n_rows)[:, None])




@triton.jit
def unit_lower_inverse_products(b_A, C: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for a strictly lower-triangular [C, C] register tile, in registers and by
    [C, C] products alone (tensor cores at PREC tf32): no memory round trip, no barrier.

    D = I + N is I + A's block diagonal in [16, 16] blocks (N^16 = 0), so D^-1 = (I - N)(I + N^2)
    (I + N^4)(I + N^8); with E the rest of A, I + A = D (I + M) for M = D^-1 E, strictly
    block-lower, so M^(C / 16) = 0 and (I + A)^-1 = (I - M)(I + M^2)(I + M^4) D^-1 (as far as
    C / 16 needs): ten products at C = 64, twelve at 128 (exact there too, but the prepare kernel
    did not compile in 500 s on an H100: config.chunk_refusal). Where it pays (H100, B8
    T4096, 4 prepare warps): o2 256 0.5635 ms against 0.6053 with the tile solve (its prepare
    kernel 176 against 230 us); elsewhere 1.02-1.34x. The diagonal blocks by forward substitution
    in registers instead ran 1.00-1.74x (its [NB, 16, 16] row reductions: 3576 instructions at
    o3 32x32 and 4 warps against 3024)."""
    o_c = tl.arange(0, C)
    m_same = (o_c[:, None] // 16) == (o_c[None, :] // 16)
    b_I = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    b_N = tl.where(m_same, b_A, 0.0)
    b_N2 = tl.dot(b_N, b_N, input_precision=PREC)
    b_N4 = tl.dot(b_N2, b_N2, input_precision=PREC)
    b_Di = tl.dot(b_I - b_N, b_I + b_N2, input_precision=PREC)
    b_Di = tl.dot(b_Di, b_I + b_N4, input_precision=PREC)
    b_Di = tl.dot(b_Di, b_I + tl.dot(b_N4, b_N4, input_precision=PREC), input_precision=PREC)
    if C > 16:  # (I + M)^-1 = (I - M)(I + M^2)(I + M^4) as far as C / 16 blocks need
        b_M = tl.dot(b_Di, tl.where(o_c[:, None] // 16 > o_c[None, :] // 16, b_A, 0.0), input_precision=PREC)
        b_S = -b_M  # (I + M)^-1 - I: strictly block-lower, so D^-1's diagonal blocks pass unrounded
        if C > 32:
            b_M2 = tl.dot(b_M, b_M, input_precision=PREC)
            b_R = tl.dot(b_I - b_M, b_I + b_M2, input_precision=PREC)
            if C > 64:
                b_R = tl.dot(b_R, b_I + tl.dot(b_M2, b_M2, input_precision=PREC), input_precision=PREC)
            b_S = b_R - b_I  # exact zeros on the diagonal blocks (so are M's powers')
        b_Di += tl.dot(b_S, b_Di, input_precision=PREC)
    return b_Di


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
def _tile(p_A, i, j, n_rows, S: tl.constexpr):
    """Block (i, j) of the matrix at p_A (row stride S) as a [16, 16] tile; rows from n_rows on
    read 0."""
    o_b = tl.arange(0, 16)
    return tl.load(p_A + (i * 16 + o_b)[:, None] * S + j * 16 + o_b[None, :], mask=(i * 16 + o_b < n_rows)[:, None],
                   other=0.0)
