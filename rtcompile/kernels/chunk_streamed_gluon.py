"""The streamed form's sequential kernel in Gluon for Hopper (``StreamedConfig.loop = "gluon"``).

The Triton kernel (``chunk_streamed.chunk_streamed_kernel``) keeps the state in the final-state
buffer and visits it in [block_k, block_v] tiles each chunk, forming phi(K) twice and phi(Q)
once per tile from the factors: at o3 32x32 one program an SM, stalled on its L2 round trips
(Nsight at da74c34: 4% DRAM, 10% tensor). This kernel keeps S [K, BV] on chip for the whole
sequence, as the wgmma accumulator of the update (K 1024, BV 32, two warpgroups: 128 fp32
registers a thread), and forms each chunk's phi(K) once, from the factors, into shared memory
as a [C, K] bf16 / fp16 tile, R = phi(K) S16 over 64-key blocks in a runtime loop; phi(Q) S16
takes phi(Q) one factor-1 column's [C, d_2] block at a time from registers as wgmma's A operand
(``query_in_registers``; a [C, K] tile like phi(K)'s where d_2 < 16), and the next chunk's
factor tiles load while this chunk's products run (PREFETCH):

    S16 = S in the inputs' type, in shared memory (the products' right operand)
    R   = phi(K) S16                                      (wgmma, M = C)
    X   = diag(beta) (V - diag(Gamma r_k) R),   U = Ai X   (16-bit products, as the Triton kernel's)
    O   = scale (diag(Gamma r_q) phi(Q) S16 + P U)
    S  <- Gamma_C S + phi(K)^T diag(r_k Gamma_C / Gamma) U (wgmma, M = K, S the accumulator)

phi is the raw outer product of the factors (exact in fp32, then rounded once, as
``blocks.phi_tile_outer`` rounds it) and r_q, r_k are 1 / ||phi|| with l2norm, as in the Triton
kernel. P and Ai come from the same prepare kernel (P formed here from the factor tiles with
``SCORES_ON_CHIP``, an experiment, off). Needs sm_90 (wgmma), 16-bit inputs, order
3 with power-of-two widths, chunks of 64 (wgmma's M for R and O) and a state tile that
fits the registers; Gluon kernels do not run under the interpreter (``StreamedConfig.check``
refuses the loop where Gluon is missing, the launcher anywhere but sm_90).
"""

from __future__ import annotations

import torch
import triton

from . import args
from .blocks import floored_cumsum, sequence_of_program
from .inputs import LOG_DECAY_FLOOR
from .launch_cache import cached

try:  # Gluon's Hopper API as Triton 3.6 - 3.9 spell it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, warpgroup_mma, warpgroup_mma_wait,
    )
except ImportError:  # an older Triton: the config's check says so
    gluon = None

CHUNK = 64  # wgmma's M for R = phi(K) S16 and phi(Q) S16: the chunk's rows
PHI_STORE_COLUMNS = 256  # phi's columns a store (4 stores at K 1024, so 4 barriers a phi)
# experiment, off: P formed in the kernel from the factor tiles it holds (_scores_on_chip) where
# both widths are an mma K (>= 16), so the prepare kernel writes only Ai (none without the delta
# rule): at B8 T4096 H8 C 64 P is 67 MB written and, one read a value block, 134 MB read, and
# the prepare kernel was 147 of 757 us at o3 32x32 (H100). H100 (compare_kron at 5a2e90b, bb1a5ee;
# float64-checked first): 1.018x the default at o3 32x32 (0.991x without the loads ahead, where the
# default without them is 0.968x), 0.974 / 0.989x at 32x16 (0.964x without the loads ahead, once);
# the prepare kernel 141 -> 95 us, the kernel 23-31 us longer: off until a second 32x16 run
SCORES_ON_CHIP = False
MAX_STATE_REGISTERS = 128  # S's fp32 registers a thread (K BV / threads); more left no room for the rest


def config_refusal(cfg, shape) -> str | None:
    """Why ``cfg`` (a StreamedConfig with loop="gluon") cannot run ``shape``'s problem; None when
    it can. The device is the launcher's to check (sm_90: ``launch.device_refusal``)."""
    if gluon is None:
        return f"loop='gluon' needs Triton's Gluon with Hopper ops (Triton >= 3.6; this is {triton.__version__})"
    if shape.input_bytes != 2:
        return "loop='gluon' needs 16-bit inputs (its products are bf16 / fp16 wgmma); allowed: loop='triton'"
    widths = shape.key_widths
    if len(widths) != 2 or any(w & (w - 1) for w in widths) or not 8 <= widths[1] <= 64 or widths[0] * widths[1] < 64:
        return (f"loop='gluon' takes order 3 with power-of-two key widths, the second 8 to 64 and K >= 64, got "
                f"{list(widths)}; allowed: loop='triton'")
    K = shape.key_dim
    if cfg.chunk_size != CHUNK:
        return f"loop='gluon' takes chunk_size={CHUNK} (wgmma's M), got {cfg.chunk_size}"
    if cfg.num_warps not in (4, 8) or cfg.block_v not in (16, 32) or cfg.block_v // (cfg.num_warps // 4) < 8:
        return (f"loop='gluon' takes num_warps 4 or 8 and block_v 16 or 32 (at least 8 columns a warpgroup), "
                f"got num_warps={cfg.num_warps}, block_v={cfg.block_v}")
    if K * cfg.block_v // (32 * cfg.num_warps) > MAX_STATE_REGISTERS:
        regs = K * cfg.block_v // (32 * cfg.num_warps)
        return (f"loop='gluon' holds S [{K}, {cfg.block_v}] in {regs} fp32 registers a thread; allowed: at most "
                f"{MAX_STATE_REGISTERS} (narrower block_v or more warps)")
    return None


def query_in_registers(widths) -> bool:
    """phi(Q) S16 from registers (:func:`_factored_product`): where the second key width is a
    wgmma K (>= 16). It replaced phi(Q)'s [C, K] tile in shared memory (its store and its two
    reads, 128 KiB each a chunk at o3 32x32): 0.962x the kernel's time at o3 32x32, 0.885-0.897x
    at o3 32x16 (H100, compare_kron --gluon-large, 1f66982, two runs). R = phi(K) S16 the same
    way too (phi(K)'s tile then formed for the update only) gained less: 0.984x / 0.959x."""
    return widths[1] >= 16


def scores_on_chip(widths) -> bool:
    """Whether the kernel forms P itself (``SCORES_ON_CHIP`` and both widths >= 16, mma_v2's K
    for 16-bit operands), so the prepare kernel is asked for Ai only."""
    return SCORES_ON_CHIP and min(widths) >= 16


def smem_bytes(C: int, widths, BV: int) -> int:
    """phi [C, K], S16 [K, BV] and three [C, BV] products' operands, 16-bit (with phi(Q) from
    registers also its first factor, [d_1, C]), and the compiler's scratch for the reductions and
    layout changes (8 KiB: 217088 bytes compiled at o3 32x32 block_v 32, 8 warps, against 208896
    counted here without it; 221184 with the factor; Triton 3.6, sm_90)."""
    K = widths[0] * widths[1]
    factor = widths[0] * C if query_in_registers(widths) else 0
    return 2 * (C * K + K * BV + 3 * C * BV + factor) + 8192


if gluon is not None:

    @gluon.constexpr_function
    def _mma(warps, N):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, N, 16])

    @gluon.constexpr_function
    def _shared(shape, dtype):
        return gl.NVMMASharedLayout.get_default_for(shape, dtype)

    @gluon.constexpr_function
    def _blocks_layout(swizzle):
        return gl.NVMMASharedLayout(swizzle, 16)  # rank 2: the leading axis indexes blocks

    # The [K / 64, rows, cols] block view of a 16-bit NVMMA tile whose 64-row (or 64-column, for
    # phi) blocks are contiguous (phi [C, K]: block j at j C 128 bytes, as the slice stores of
    # the first version addressed them), for products over key blocks in a runtime loop: one
    # descriptor a step instead of 64 hoisted out of the chunk loop (their spills were most of the
    # 616-1464 B). Triton 3.6 spells the view _reinterpret, 3.9 reinterpret.
    @gluon.jit
    def _view_36(smem, shape: gl.constexpr, layout: gl.constexpr):
        return smem._reinterpret(smem.dtype, shape, layout)

    @gluon.jit
    def _view_39(smem, shape: gl.constexpr, layout: gl.constexpr):
        return smem.reinterpret(smem.dtype, shape, layout)

    _view = _view_36 if hasattr(gl.shared_memory_descriptor, "_reinterpret") else _view_39

    @gluon.jit
    def _blocked_product(phi3, s3, acc, NB: gl.constexpr):
        """acc + phi S16 over NB key blocks of 64 (phi3 [NB, C, 64], s3 [NB, 64, BV]), async wgmma
        with one in flight."""
        for kb in range(NB):
            acc = warpgroup_mma(phi3.index(kb), s3.index(kb), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    @gluon.jit
    def _factored_product(x1t_s, b_2a, s3, acc, D1: gl.constexpr, row_a: gl.constexpr):
        """acc + phi(X) S16 with phi(X) never stored: its columns i D2 .. (i + 1) D2 are factor 1's
        column i (row i of ``x1t_s`` [D1, C], loaded one step ahead) times factor 2's tile ``b_2a``
        (registers, in wgmma's A layout), exact in fp32 and rounded once as ``_store_phi`` rounds
        them, times S16's rows of the same block (s3 [D1, D2, BV]); async wgmma, one in flight.
        A wgmma still reads its A registers until a wait retires it, so each step's A tile stays
        live until the next step's wait (``deps``): without that the compiler formed the next
        tile in the registers of the one in flight (offline sm_90 SASS, Triton 3.6)."""
        DT: gl.constexpr = b_2a.dtype
        b_2 = b_2a.to(gl.float32)
        b_1 = x1t_s.index(0).load(row_a)
        b_prev = b_2a
        for i in range(D1):
            b_a = (gl.expand_dims(b_1.to(gl.float32), 1) * b_2).to(DT)
            b_1 = x1t_s.index((i + 1) % D1).load(row_a)
            acc = warpgroup_mma(b_a, s3.index(i), acc, is_async=True)
            acc, b_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, b_prev))
            b_prev = b_a
        acc, b_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, b_prev))
        return acc

    @gluon.jit
    def _scores_on_chip(b_q1, b_q2, b_k1, b_k2, b_g, L2NORM: gl.constexpr, layout: gl.constexpr):
        """The chunk's P [C, C] = (Q1 K1^T * Q2 K2^T) diag-scaled by 1 / ||phi(q)||, 1 / ||phi(k)||
        (with L2NORM), times exp(c_i - c_j) on and below the diagonal, 0 above, in fp32 in
        ``layout`` (an mma_v2 layout): the prepare kernel's scores from the factor tiles as loaded
        (raw 16-bit factors, exact fp32 Grams, the norms applied in fp32). ``b_g``: the chunk's
        log decays (zeros without gates)."""
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=layout, k_width=2)
        b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=layout, k_width=2)
        C: gl.constexpr = b_q1.shape[0]
        zero = gl.zeros([C, C], gl.float32, layout=layout)
        b_qk = mma_v2(gl.convert_layout(b_q1, a_op), gl.convert_layout(gl.permute(b_k1, (1, 0)), b_op), zero)
        b_qk = b_qk * mma_v2(gl.convert_layout(b_q2, a_op), gl.convert_layout(gl.permute(b_k2, (1, 0)), b_op), zero)
        rows: gl.constexpr = gl.SliceLayout(1, layout)
        cols: gl.constexpr = gl.SliceLayout(0, layout)
        if L2NORM:  # the norms from the tiles again: the kernel's r_q, r_k passed in instead gave 1698
            # loop instructions and 88 spill loads/stores against 1634 and 49 (offline sm_90, o3 32x32)
            b_qk = b_qk * gl.expand_dims(gl.convert_layout(_inv_norm(b_q1) * _inv_norm(b_q2), rows), 1)
            b_qk = b_qk * gl.expand_dims(gl.convert_layout(_inv_norm(b_k1) * _inv_norm(b_k2), cols), 0)
        b_c = floored_cumsum(b_g)
        o_c = gl.arange(0, C, layout=rows)
        m_incl = gl.expand_dims(o_c, 1) >= gl.expand_dims(gl.arange(0, C, layout=cols), 0)
        # exp of a masked difference: only j <= i is kept, where c_i - c_j <= 0 (no overflow)
        b_diff = gl.expand_dims(gl.convert_layout(b_c, rows), 1) - gl.expand_dims(gl.convert_layout(b_c, cols), 0)
        return b_qk * gl.exp(gl.where(m_incl, b_diff, float("-inf")))

    @gluon.jit
    def _rows(bos, eos, i_c, i_b, T, H, i_h, C: gl.constexpr, layout: gl.constexpr):
        """The chunk's token numbers' mask and token-head rows ([C], in ``layout``)."""
        tok = bos + i_c * C + gl.arange(0, C, layout=layout)
        return tok < eos, (i_b * T + tok) * H + i_h

    @gluon.jit
    def _factor_tile(p, r, m_t, D: gl.constexpr, layout: gl.constexpr):
        """[C, D] tile of one factor at the rows ``r`` (in SliceLayout(1, ``layout``)), as stored."""
        o_d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        return gl.load(p + gl.expand_dims(r, 1) * D + gl.expand_dims(o_d, 0), mask=gl.expand_dims(m_t, 1), other=0.0)

    @gluon.jit
    def _factor_tiles(k1, k2, q1, q2, bos, eos, i_c, i_b, T, H, i_h, D1: gl.constexpr, D2: gl.constexpr,
                      C: gl.constexpr, layout: gl.constexpr):
        """Chunk ``i_c``'s four factor tiles (k1, k2, q1, q2), as stored; rows past the sequence
        (all of them past its last chunk) masked off."""
        m_f, r_f = _rows(bos, eos, i_c, i_b, T, H, i_h, C, gl.SliceLayout(1, layout))
        return (_factor_tile(k1, r_f, m_f, D1, layout), _factor_tile(k2, r_f, m_f, D2, layout),
                _factor_tile(q1, r_f, m_f, D1, layout), _factor_tile(q2, r_f, m_f, D2, layout))

    @gluon.jit
    def _inv_norm(b_x):
        """1 / ||x|| of each row of a factor tile."""
        b_x = b_x.to(gl.float32)
        return gl.rsqrt(gl.sum(b_x * b_x, axis=1) + 1e-6)

    @gluon.constexpr_function
    def _phi_layout(W, D2, NW):
        """[C, W / D2, D2]: 8 factor-2 columns a thread (16-byte stores), four rows a warp."""
        t2 = D2 // 8
        t1 = min(W // D2, 8 // t2)
        return gl.BlockedLayout([1, W // D2 // t1, 8], [4, t1, t2], [NW, 1, 1], [2, 1, 0])

    @gluon.jit
    def _store_phi(phi_s, p1, bos, eos, i_c, i_b, T, H, i_h, b_2, D1: gl.constexpr, D2: gl.constexpr,
                   C: gl.constexpr, W: gl.constexpr, NW: gl.constexpr):
        """The chunk's raw phi [C, K] (K = D1 D2) into ``phi_s``, W columns a store: each a [C,
        W / D2, D2] outer product of a slice of factor 1 (loaded again: the chunk's tile was just
        loaded, so from L1) and factor 2 (``b_2``, registers), in fp32 and rounded once, as the
        Triton kernel rounds it. Few wide stores: the barrier pass orders every store into a slice
        of phi_s after the one before (64-column slices: 32 barriers a chunk)."""
        DT: gl.constexpr = phi_s.dtype
        M: gl.constexpr = W // D2
        l3: gl.constexpr = _phi_layout(W, D2, NW)
        l_1: gl.constexpr = gl.SliceLayout(2, l3)
        b_2 = gl.convert_layout(b_2, gl.SliceLayout(1, l3)).to(gl.float32)
        m_1, r_1 = _rows(bos, eos, i_c, i_b, T, H, i_h, C, gl.SliceLayout(1, l_1))
        p_1 = p1 + gl.expand_dims(r_1, 1) * D1 + gl.expand_dims(gl.arange(0, M, layout=gl.SliceLayout(0, l_1)), 0)
        for j in gl.static_range(D1 // M):
            b_1 = gl.load(p_1 + j * M, mask=gl.expand_dims(m_1, 1), other=0.0).to(gl.float32)
            b_phi = gl.expand_dims(b_1, 2) * gl.expand_dims(b_2, 1)
            phi_s.slice(j * W, W, dim=1).store(gl.reshape(b_phi.to(DT), [C, W]))

    @gluon.jit
    def chunk_streamed_gluon_kernel(
        q1, q2, k1, k2, v, g, beta, o, h0, ht, P, Ai, cu_seqlens, scale, T,
        H: gl.constexpr, D1: gl.constexpr, D2: gl.constexpr, V: gl.constexpr,
        C: gl.constexpr, BV: gl.constexpr, W: gl.constexpr, L2NORM: gl.constexpr, DECAY_FLOOR: gl.constexpr,
        PREFETCH: gl.constexpr, QUERY_REGS: gl.constexpr,
    ):
        """One program per (sequence, head, value block of BV) walks the chunks in order with S
        [K, BV] in registers (module docstring). Arguments as ``chunk_streamed_kernel``'s: the
        factors [B, T, H, D_i], ``P`` / ``Ai`` the prepare
        kernel's [B, H, T, C] fp32 scores and inverse (``P`` None: formed here from the factor tiles,
        ``_scores_on_chip``; ``Ai`` None without the delta rule),
        ``g`` / ``beta`` / ``h0`` / ``cu_seqlens`` None: no gates / no delta rule / zero initial
        state / not varlen; ``ht`` [N, H, K, V] fp32 receives the final state; ``W``: phi's
        columns a store (``PHI_STORE_COLUMNS``, at most K); PREFETCH: the next chunk's factor tiles
        load while this chunk's products run; QUERY_REGS (``query_in_registers``): phi(Q) S16 takes
        phi(Q) from registers (``_factored_product``), before the update, instead of from shared
        memory after it."""
        K: gl.constexpr = D1 * D2
        NW: gl.constexpr = gl.num_warps()
        DT: gl.constexpr = v.dtype.element_ty
        i_v, i_nh = gl.program_id(0), gl.program_id(1)
        i_n, i_h = i_nh // H, i_nh % H
        bos, eos, i_b = sequence_of_program(i_n, T, cu_seqlens)

        # S [K, BV]: the update's accumulator over every warp (M = K); R, O [C, BV]: M = C over
        # four warps a column block (more warps split the columns)
        s_layout: gl.constexpr = _mma([NW, 1], BV)
        r_layout: gl.constexpr = _mma([4, NW // 4], BV // (NW // 4))
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=r_layout, k_width=2)
        row_a: gl.constexpr = gl.SliceLayout(1, a_op)
        row_r: gl.constexpr = gl.SliceLayout(1, r_layout)
        col_r: gl.constexpr = gl.SliceLayout(0, r_layout)
        l_cc: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])  # P, Ai as loaded
        l_g: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])  # the gates' scan
        l_f: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [NW, 1], [1, 0])  # factor tiles as loaded
        l_pp: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, NW // 4],
                                                       instr_shape=[16, 8])  # P's Grams (SCORES_ON_CHIP)

        o_ks = gl.arange(0, K, layout=gl.SliceLayout(1, s_layout))
        o_vs = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, s_layout))
        off_s = (i_n.to(gl.int64) * H + i_h) * K * V + gl.expand_dims(o_ks, 1) * V + gl.expand_dims(o_vs, 0)
        m_s = gl.expand_dims(o_ks < K, 1) & gl.expand_dims(o_vs < V, 0)
        if h0 is not None:
            b_s = gl.load(h0 + off_s, mask=m_s, other=0.0).to(gl.float32)
        else:
            b_s = gl.zeros([K, BV], gl.float32, layout=s_layout)

        phi_s = gl.allocate_shared_memory(DT, [C, K], _shared([C, K], DT))
        s16_s = gl.allocate_shared_memory(DT, [K, BV], _shared([K, BV], DT))
        x_s = gl.allocate_shared_memory(DT, [C, BV], _shared([C, BV], DT))
        u_s = gl.allocate_shared_memory(DT, [C, BV], _shared([C, BV], DT))
        us_s = gl.allocate_shared_memory(DT, [C, BV], _shared([C, BV], DT))
        phi3 = _view(phi_s, [K // 64, C, 64], _blocks_layout(128))
        s3 = _view(s16_s, [K // 64, 64, BV], _blocks_layout(BV * 2))
        if QUERY_REGS:
            s3_q = _view(s16_s, [D1, D2, BV], _blocks_layout(BV * 2))  # S16's rows by factor-1 index
            q1t_s = gl.allocate_shared_memory(DT, [D1, C], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
            q1t_rows = _view(q1t_s, [D1, C], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # rank 1: row i a load

        o_v = i_v * BV + gl.arange(0, BV, layout=col_r)
        m_v = o_v < V
        o_cc = gl.arange(0, C, layout=gl.SliceLayout(0, l_cc))
        if PREFETCH:  # chunk 0's factor tiles; each later chunk's load during the one before
            b_k1n, b_k2n, b_q1n, b_q2n = _factor_tiles(k1, k2, q1, q2, bos, eos, 0, i_b, T, H, i_h, D1, D2, C, l_f)
        for i_c in range(0, gl.cdiv(eos - bos, C)):
            # the chunk's global loads first, so that their latencies overlap (one load after
            # another, each phi slice's factor load from L2, the loop ran 1.31 ms at o3 32x32 on an
            # H100); with PREFETCH its factor tiles were loaded during the chunk before
            if PREFETCH:
                b_k1, b_k2, b_q1, b_q2 = b_k1n, b_k2n, b_q1n, b_q2n
            else:
                b_k1, b_k2, b_q1, b_q2 = _factor_tiles(k1, k2, q1, q2, bos, eos, i_c, i_b, T, H, i_h, D1, D2, C, l_f)
            m_t, r = _rows(bos, eos, i_c, i_b, T, H, i_h, C, row_r)
            m_o = gl.expand_dims(m_t, 1) & gl.expand_dims(m_v, 0)
            b_v = gl.load(v + gl.expand_dims(r, 1) * V + gl.expand_dims(o_v, 0), mask=m_o, other=0.0).to(gl.float32)
            m_cc, _ = _rows(bos, eos, i_c, i_b, T, H, i_h, C, gl.SliceLayout(1, l_cc))
            p_cc = ((i_b * H + i_h) * T + bos + i_c * C + gl.arange(0, C, layout=gl.SliceLayout(1, l_cc))) * C
            off_cc = gl.expand_dims(p_cc, 1) + gl.expand_dims(o_cc, 0)
            # P and Ai rounded as loaded, as the products take them (fp32, both held 64 registers a
            # thread at 4 warps); without P (SCORES_ON_CHIP) P from the factor tiles, below
            if P is not None:
                b_P = gl.load(P + off_cc, mask=gl.expand_dims(m_cc, 1), other=0.0).to(DT)
            if beta is not None:
                b_b = gl.load(beta + r, mask=m_t, other=0.0).to(gl.float32)
                b_Ai = gl.load(Ai + off_cc, mask=gl.expand_dims(m_cc, 1), other=0.0).to(DT)
            if g is not None:
                m_g, r_g = _rows(bos, eos, i_c, i_b, T, H, i_h, C, l_g)
                b_g = gl.load(g + r_g, mask=m_g, other=0.0).to(gl.float32)
            else:
                b_g = gl.zeros([C], gl.float32, layout=l_g)  # read by _scores_on_chip only
            if P is None:
                b_P = _scores_on_chip(b_q1, b_q2, b_k1, b_k2, b_g, L2NORM, l_pp).to(DT)
            r_q = gl.full([C], 1.0, gl.float32, layout=row_r)
            r_k = gl.full([C], 1.0, gl.float32, layout=row_r)
            if L2NORM:  # ||phi|| = prod ||x_i||
                r_q = gl.convert_layout(_inv_norm(b_q1) * _inv_norm(b_q2), row_r)
                r_k = gl.convert_layout(_inv_norm(b_k1) * _inv_norm(b_k2), row_r)
            # R = phi(K) S16
            s16_s.store(b_s.to(DT))
            _store_phi(phi_s, k1, bos, eos, i_c, i_b, T, H, i_h, b_k2, D1, D2, C, W, NW)
            fence_async_shared()
            b_R = _blocked_product(phi3, s3, gl.zeros([C, BV], gl.float32, layout=r_layout), K // 64)
            if QUERY_REGS:  # phi(Q) S16 on the state before the update, as the tile path takes it
                q1t_s.store(gl.permute(b_q1, (1, 0)))
                b_qs = _factored_product(q1t_rows, gl.convert_layout(b_q2, a_op), s3_q,
                                         gl.zeros([C, BV], gl.float32, layout=r_layout), D1, row_a)
            if PREFETCH:  # the next chunk's factor tiles
                b_k1n, b_k2n, b_q1n, b_q2n = _factor_tiles(k1, k2, q1, q2, bos, eos, i_c + 1, i_b, T, H, i_h, D1, D2,
                                                           C, l_f)
            # the gates' scan while R's products run (padded rows add 0, so its last row is c_C)
            b_gam = gl.zeros([C], gl.float32, layout=row_r)
            b_last = 0.0
            b_decay = 1.0  # Gamma_C
            if g is not None:
                b_cs = floored_cumsum(b_g)
                b_last = gl.sum(gl.where(gl.arange(0, C, layout=l_g) == C - 1, b_cs, 0.0), axis=0)
                b_gam = gl.convert_layout(b_cs, row_r)
                b_decay = gl.exp(b_last)
            b_ratio = gl.exp(b_last - b_gam)  # Gamma_C / Gamma_i <= 1
            b_gam = gl.exp(b_gam)
            b_ks = b_R * gl.expand_dims(r_k, 1)
            if beta is not None:  # U = Ai diag(beta) (V - diag(Gamma) R)
                b_x = gl.expand_dims(b_b, 1) * (b_v - gl.expand_dims(b_gam, 1) * b_ks)
                x_s.store(b_x.to(DT))
                fence_async_shared()
                b_u = warpgroup_mma(gl.convert_layout(b_Ai, a_op), x_s,
                                    gl.zeros([C, BV], gl.float32, layout=r_layout))
            else:
                b_u = b_v
            b_u = gl.where(m_o, b_u, 0.0)
            u_s.store(b_u.to(DT))
            us_s.store((b_u * gl.expand_dims(r_k * b_ratio, 1)).to(DT))
            fence_async_shared()
            # S <- Gamma_C S + phi(K)^T U diag(r_k Gamma_C / Gamma)
            b_s = warpgroup_mma(phi_s.permute((1, 0)), us_s, b_s * b_decay)
            # O = scale (diag(Gamma r_q) phi(Q) S16 + P U), phi(Q) where phi(K) was
            if not QUERY_REGS:
                _store_phi(phi_s, q1, bos, eos, i_c, i_b, T, H, i_h, b_q2, D1, D2, C, W, NW)
                fence_async_shared()
                b_qs = _blocked_product(phi3, s3, gl.zeros([C, BV], gl.float32, layout=r_layout), K // 64)
            b_o = warpgroup_mma(gl.convert_layout(b_P, a_op), u_s, b_qs * gl.expand_dims(b_gam * r_q, 1))
            gl.store(o + gl.expand_dims(r, 1) * V + gl.expand_dims(o_v, 0), (scale * b_o).to(o.dtype.element_ty),
                     mask=m_o)
        gl.store(ht + off_s, b_s, mask=m_s)


def run(config, p, q, k, v, g, beta, *, h0, ht, cu_seqlens, l2norm: bool, ws: dict) -> torch.Tensor:
    """Allocate o and run :func:`chunk_streamed_gluon_kernel` on the prepare kernel's ``ws`` (P,
    None where the kernel forms it: :func:`scores_on_chip`; Ai); ``ht`` receives the final state."""
    B, T, H, V = v.shape
    o = args.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    (q1, q2), (k1, k2) = q, k
    grid = (triton.cdiv(V, config.block_v), p.num_seqs * H)
    cached(chunk_streamed_gluon_kernel)[grid](
        q1, q2, k1, k2, v, g, beta, o, h0, ht, ws["P"], ws.get("Ai"), cu_seqlens, p.scale, T,
        H=H, D1=p.key_widths[0], D2=p.key_widths[1], V=V, C=config.chunk_size, BV=config.block_v,
        W=min(PHI_STORE_COLUMNS, p.key_dim), PREFETCH=config.prefetch_inputs,
        QUERY_REGS=query_in_registers(p.key_widths), L2NORM=l2norm,
        DECAY_FLOOR=LOG_DECAY_FLOOR,
        num_warps=config.num_warps,
    )
    return o
