"""The split form's state loop on the Kronecker factors (``SplitConfig.loop = "kron"``), order 3.

The Triton loop (``chunk_split.chunk_split_state_kernel``) reads each chunk's phi(K) as a stored
[C, K] tile and multiplies it into the [K, BV] state. At K = 1024 (o3 32x32) that product has a
16 x 16 output and a 1024-long reduction, which Triton's dot gives to every warp whole (no split
over K), and the [1024, 16] state spills (probe_offline: 432-1608 B at 4-16 warps); the default
there streams the state through L2 instead (1.31 ms with 128-row tiles, DRAM 4%, chain-bound; 1.24
with the 256-row tiles of the default since 2026-12-06).

Here the state is held as [D1, D2, BV] (row i D2 + j of the [K, BV] state is [i, j]) and phi(K)'s
row c as x1[c, i] x2[c, j], so

    phi(K) S          = sum_i diag(x1[:, i]) x2 S[i]            one batched dot, a sum over i
    S += phi(K)^T U'  :  S[i] += (diag(x1[:, i]) x2)^T U'         one batched dot

with the batch (axis 1's index) spread over the warps: D1 products [C, D2] x [D2, BV] instead of
one [C, K] x [K, BV]. phi(K) is formed from the factor rows in registers, so the prepare kernel
stores no [T, K] phi(K) (537 MB at o3 32x32 B8 T4096 H8, written once and read once by the
Triton loop). Order 4 (K >= 4096 at widths >= 16) would not fit: see MAX_KEY_DIM.

Measured (H100, B8 T4096 H8 d_v 64 bf16, ``benchmarks/compare_kron.py``, 2026-12-06), it loses
everywhere, so it is an explicit config only (not in the tuner's space, no default): o3 32x32
2.68 ms at best (C 32, block_v 16, 8 warps) against the streamed default's 1.30; o3 32x16 1.53
against 0.89; o3 16x16 0.566 (C 32, block_v 16, 4 warps) against 0.384. The prepare kernel does
drop to 35-40 us from 135-147, but the loop is slower per token than the one it replaces: at o3
16x16 398 us against 152 (~3.1 us a chunk of 32 against 2.4 a chunk of 64), its factor loads
not ahead of the chain, the batched products mma.sync tiles with a cross-warp sum over the
batch; at o3 32x32 1692 us against the streamed loop's 1166, and the output kernel's whole-K
phi(Q) tile with 16 value columns 1070 us.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .args import factor_args, lowp_dots, width_args
from .blocks import dot, first_stored_state, load_row_inputs, load_state_tile, one_side_tiles, sequence_of_program
from .config import estimate_registers as estimate_registers_of
from .launch_cache import cached

# o3 64x64 (K 4096) spills 1464 B at C 16, block_v 16 and 16 warps (probe_offline, sm_90, Triton
# 3.6); o3 32x32 (K 1024) at C 16, 8 warps: 242 registers, none
MAX_KEY_DIM = 1024


@triton.jit
def _state_offsets(i_n, i_h, o_v, m_v, H: tl.constexpr, D1: tl.constexpr, TW: tl.constexpr, V: tl.constexpr):
    """A [D1, TW, BV] state tile's offsets within one [K, V] state, their mask, and the offsets
    in a [sequences, H, K, V] buffer (int64)."""
    o_i = tl.arange(0, D1)
    o_j = tl.arange(0, TW)
    off_k = (o_i[:, None, None] * TW + o_j[None, :, None]) * V + o_v[None, None, :]
    m_s = (off_k >= 0) & m_v[None, None, :]  # every key row is real (power-of-two widths): the columns
    off_s = (i_n.to(tl.int64) * H + i_h) * (D1 * TW) * V + off_k
    return off_k, m_s, off_s


@triton.jit
def _accumulate(b_acc, a, b, LOWP: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """b_acc + a @ b, the product accumulated into ``b_acc`` (fp32) in place: no second
    state-sized tile live beside it (blocks.dot's operand rules)."""
    if LOWP:
        return tl.dot(a.to(DT), b.to(DT), acc=b_acc)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc=b_acc, input_precision=PREC)


@triton.jit(do_not_specialize=["c0", "c_end"])
def chunk_split_state_kron_kernel(
    k1, k2, k3, v, beta, h0, ht, Ai, Gc, Hc, Uc, cu_seqlens, chunk_offsets, T, c0, c_end,
    H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, LOWP: tl.constexpr,
    PREC: tl.constexpr, STRIDE: tl.constexpr,
):
    """The split form's sequential loop, as :func:`chunk_split.chunk_split_state_kernel` computes
    it (the incoming state of every STRIDE-th chunk into ``Hc``, U = Ai diag(b) (V - diag(Gamma)
    phi(K) S) into ``Uc``, S' = Gamma_C S + phi(K)^T diag(Gamma_C / Gamma) U), with phi(K) formed
    from the key factors ``k1``, ``k2`` (token-major, normalised here with L2NORM; ``k3`` is
    not read) and the state held as [D1, D2, BV]: see the module docstring. Order 3 (NF = 2)
    with power-of-two widths >= 16 (each batched product's dimensions). ``Ai`` (delta rule) and
    ``Gc`` (gates) are the prepare kernel's [B, H, T, C] inverse and [B, H, T] cumulative log
    decay; ``beta`` / ``Gc`` / ``h0`` / ``ht`` / ``cu_seqlens`` None: no delta rule / no gates /
    zero initial state / no final state / not varlen. ``c0`` / ``c_end``: the chunks this launch
    walks (a pipelined part), 0 / ALL_CHUNKS for all. Rows past the sequence load zero factors,
    so they add nothing to S."""
    tl.static_assert(NF == 2, "order 3: the state as [D1, D2, BV]")
    TW: tl.constexpr = D2 * D3
    DT: tl.constexpr = v.dtype.element_ty
    PT: tl.constexpr = DT if LOWP else tl.float32  # the products' operand type (bf16 upcast: interpreter)
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, i_b = sequence_of_program(i_n, T, cu_seqlens)
    i_g0 = first_stored_state(i_n, i_b, T, cu_seqlens, chunk_offsets, C, STRIDE)
    o_c = tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    off_k, m_s, off_s = _state_offsets(i_n, i_h, o_v, m_v, H, D1, TW, V)
    b_s = load_state_tile(h0, ht, off_s, m_s, True, h0 is not None)
    for i_c in range(c0, tl.minimum(c_end, tl.cdiv(eos - bos, C))):
        tok = bos + i_c * C + o_c
        m_t = tok < eos
        r = (i_b * T + tok) * H + i_h
        p_row = (i_b * H + i_h) * T + tok
        b_v, b_c, b_b = load_row_inputs(v, Gc, beta, r, p_row, m_t, o_v, m_v, C, V, True, Gc is not None,
                                        beta is not None)
        b_x1, b_t, _ = one_side_tiles(k1, k2, k3, r, m_t, NF, D1, D2, D3, D1, D2, D3, L2NORM)
        # phi(K) as [D1, C, D2]: batch i holds diag(x1[:, i]) x2. Multiplied in the products'
        # operand type: at o3 32x32 C 16 (8 warps, sm_90, Triton 3.6) 242 registers and no spill
        # against 255 and 168 B formed in fp32 and cast (loop 779 SASS instructions against 968)
        b_k3 = tl.trans(b_x1.to(PT))[:, :, None] * b_t.to(PT)[None, :, :]
        b_last = 0.0
        if Gc is not None:
            b_last = tl.load(Gc + (i_b * H + i_h) * T + tl.minimum(bos + i_c * C + C, eos) - 1)
        if STRIDE == 1:
            tl.store(Hc + ((i_g0 + i_c) * H + i_h) * (D1 * TW) * V + off_k, b_s.to(Hc.dtype.element_ty), mask=m_s)
        elif i_c % STRIDE == 0:
            tl.store(Hc + ((i_g0 + i_c // STRIDE) * H + i_h) * (D1 * TW) * V + off_k, b_s.to(Hc.dtype.element_ty),
                     mask=m_s)
        if beta is not None:
            b_ks = tl.sum(dot(b_k3, b_s, LOWP, DT, PREC), axis=0)  # phi(K) S: [C, BV]
            b_Ai = tl.load(Ai + p_row[:, None] * C + o_c[None, :], mask=m_t[:, None], other=0.0)
            b_u = dot(b_Ai, b_b[:, None] * (b_v - tl.exp(b_c)[:, None] * b_ks), LOWP, DT, PREC)
        else:
            b_u = b_v
        tl.store(Uc + r[:, None] * V + o_v[None, :], b_u.to(Uc.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        # Gamma_C / Gamma_i <= 1 on U's rows, as in the Triton loop; U' the same for every batch
        b_w = (b_u * tl.exp(b_last - b_c)[:, None]).to(PT)
        b_w3 = tl.broadcast_to(b_w[None, :, :], (D1, C, BV))
        b_s = _accumulate(tl.exp(b_last) * b_s, tl.permute(b_k3, (0, 2, 1)), b_w3, LOWP, DT, PREC)
    if ht is not None:
        tl.store(ht + off_s, b_s.to(ht.dtype.element_ty), mask=m_s)


def config_refusal(config, shape) -> str | None:
    """Why ``loop="kron"`` cannot run ``shape`` with ``config``, or None. The batched products
    need order 3 on the factors themselves (no ``materialise``) with power-of-two widths >= 16
    and K <= MAX_KEY_DIM; the loop reads no stored phi(K) (so neither ``wy``'s W nor ``tma``'s
    descriptors)."""
    if config.materialise or config.wy or config.tma:
        return "loop='kron' forms phi(K) from the factors; allowed: materialise=False, wy=False, tma=False"
    if len(shape.key_widths) != 2 or not shape.whole_factor_tiles:
        return (f"loop='kron' needs order 3 with power-of-two key widths >= 16, got {shape.key_widths}; "
                "allowed: loop='triton'")
    if shape.key_dim > MAX_KEY_DIM:
        return f"loop='kron' holds the [K, block_v] state in registers: K <= {MAX_KEY_DIM}, got {shape.key_dim}"
    return None


def state_loop(config, p, v, beta, ws: dict, Hc, Uc, cu_seqlens, chunk_offsets, *, keys, l2norm: bool):
    """:func:`chunk_split_state_kron_kernel` bound to one call's workspaces and key factors
    ``keys``, as ``chunk_split.triton_state_loop``'s ``walk(h_in, h_out, c0, c1)``."""
    _, T, H, V = v.shape
    kernel_call = cached(chunk_split_state_kron_kernel)[(triton.cdiv(V, config.block_v), p.num_seqs * H)]
    widths = {n: w for n, w in width_args(p.key_widths, 16).items() if not n.startswith("BD")}
    lowp, prec = lowp_dots(v.dtype), config.dot_precision

    def walk(h_in, h_out, c0: int, c1: int) -> None:
        kernel_call(*factor_args(keys), v, beta, h_in, h_out, ws["Ai"], ws["Gc"], Hc, Uc, cu_seqlens, chunk_offsets,
                    T, c0, c1, H=H, NF=len(keys), **widths, V=V, C=config.chunk_size, BV=config.block_v,
                    L2NORM=l2norm, LOWP=lowp, PREC=prec, STRIDE=config.state_stride,
                    num_warps=config.num_warps, num_stages=config.num_stages)

    return walk


def estimate_registers(shape, C: int, block_v: int, num_warps: int) -> int:
    """The loop's registers per thread (a ranking, as config.estimate_registers): the state,
    phi(K) formed in registers, the batched product before its sum, the inverse, values and U.
    o3 32x32 C 16 block_v 16, 8 warps: 197 here, 242 compiled (probe_offline)."""
    K, D1 = shape.key_dim, shape.key_widths[0]
    return estimate_registers_of(K * block_v + C * K + D1 * C * block_v + C * C + 4 * C * block_v, num_warps)


def smem_bytes(shape, C: int, block_v: int) -> int:
    """Shared memory the batched products stage: phi(K) (twice: as is and transposed), the
    state's and U's 16-bit copies, and the inverse (fp32)."""
    K, D1, ib = shape.key_dim, shape.key_widths[0], shape.input_bytes
    return 2 * C * K * ib + K * block_v * ib + D1 * C * block_v * ib + 4 * C * C
