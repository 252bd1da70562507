"""The streamed form with its chunk loop on the host (``StreamedConfig(loop="stepped")``): after
the prepare kernel (P and Ai, ``chunk_prepare.py``), each chunk is two chunk-parallel launches
instead of one step of a sequential program per (sequence, head, value block).

Why: above K = 1024 the state no longer fits on chip, so every chunk reads and writes it
(2 x 64 MiB a chunk at o3 64x64, B8 H8 d_v 64, fp32), and the sequential kernel does that with
one program an SM walking its key tiles one after another: 1.4 TB/s of state traffic, DRAM 30%
busy, 5.26 ms on the H200 (Nsight Compute at da74c34). Here every (value block, sequence x
head, run of key tiles) is a program of its own, so the state moves at the parallel kernels'
bandwidth, for two launches and the partial products' [runs, C, BV] round trip a chunk.

Per chunk c:

* :func:`chunk_stepped_state_kernel`: S_k <- Gamma_C S_k + phi(K_{c-1})_k^T U'_{c-1} (the update
  by the previous chunk; the first launch copies the initial state), stored in the final-state
  buffer, then the raw partial products phi(K_c)_k S_k and phi(Q_c)_k S_k, summed over the
  program's run of ``tiles_per_program`` key tiles.
* :func:`chunk_stepped_output_kernel`: sums the partials over the runs, then forms U_c,
  the outputs and U'_c = U_c 1 / ||phi(k)|| Gamma_C / Gamma_i for the next update, as
  ``chunk_streamed_kernel`` does within its step.

A launch past a sequence's last chunk leaves it alone, so varlen batches take as many launches
as their longest sequence's chunks (plus one). That is 130 launches at T 4096 and C 64: the loop
is for CUDA-graph captures, where a launch costs the GPU a few microseconds; an eager call pays
each launch's host time as well.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import args
from .args import factor_args, lowp_dots, width_args
from .blocks import chunk_inputs, delta_outputs, dot, load_state_tile, phi_block, sequence_of_program
from .config import KernelShape
from .inputs import Problem
from .launch_cache import cached


# The refusal bound of estimate_registers, set from 36 offline compiles (Triton 3.6, sm_90, o3
# 64x64, runs of 4; C 64 / 128, key tiles 64-256, value tiles 16-64, 4 / 8 warps): the 22
# estimated at 208 or less spilled at most 64 bytes (20 none; C 128 with 64 columns at 8 warps:
# 254 registers), the 14 at 224 or more all spilled (32-2448 bytes). The sequential kernel's
# estimate (refused above 392) admitted C 64 with 64 columns at 4 warps (192 bytes spilled) and
# refused two that spill nothing (C 128 with 64 columns at 8 warps; C 64, 256-row tiles, 4 warps).
# o3 32x32 agrees (four configs: 24 bytes at most below the bound, 96 above). Order 4 16^3 does
# not: its state kernel spilled 32-856 bytes at each of the five tilings below the bound (the
# default's tiles 456), as it did under the old estimate; the bound ranks there, the GPU's
# timing decides (order 4 keeps the sequential kernel until its stepped loop is timed).
MAX_EST_REGS = 216


def estimate_registers(chunk_size: int, block_k: int, block_v: int, num_warps: int) -> int:
    """Registers per thread of the larger of the two kernels (a ranking against MAX_EST_REGS, not
    a count), 32 for addresses and scalars plus the values live at once: the state kernel's fp32
    state tile, its two phi blocks (16-bit operands: [C, BK] fp32's worth together) and its two
    [C, BV] fp32 partial products; the output kernel's [C, C] fp32 scores and inverse and one
    [C, BV] tile (it holds no more at once: C 128 spills at 4 warps only, by 416-1368 bytes)."""
    C, bk, bv = chunk_size, block_k, block_v
    live = max(bk * bv + C * bk + 2 * C * bv, 2 * C * C + C * bv)
    return 32 + -(-live // (32 * num_warps))


def smem_bytes(chunk_size: int, block_k: int, block_v: int) -> int:
    """Shared memory of the larger of the two kernels, an upper bound on what Triton 3.6 asked
    for offline (sm_90, o3 64x64, eight configs): the state kernel's staged [C, BK] and [C, BV]
    operands (20-41 KiB measured against 4 C (BK + BV) = 72 KiB at C 64, BK 256, BV 32), the
    output kernel's [C, C] fp32 one (16 KiB at C 64, 64 KiB at C 128, both as 4 C^2)."""
    return 4 * chunk_size * max(chunk_size, block_k + block_v)


@triton.jit(do_not_specialize=["i_c"])  # one compile for every chunk number (Triton would make three)
def chunk_stepped_state_kernel(
    q1, q2, q3, k1, k2, k3, h0, ht, Us, Gl, KSp, QSp, cu_seqlens, T, i_c,
    H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, TPP: tl.constexpr,
    LOWP: tl.constexpr, PREC: tl.constexpr, OUTER: tl.constexpr, FIRST: tl.constexpr,
):
    """Program (value block, sequence x head, run of TPP key tiles) at chunk ``i_c``: each state
    tile updated by chunk i_c - 1 (``Us``: its scaled U [NH, C, V]; ``Gl``: its Gamma_C [NH];
    FIRST: the initial state instead, or zeros with ``h0`` None) and stored in ``ht``, then chunk
    i_c's raw phi(K) S and phi(Q) S summed over the run's tiles into ``KSp`` / ``QSp`` ([NP, NH,
    C, V] fp32, NP the runs). A sequence whose chunks end before ``i_c`` is left alone; at
    ``i_c`` = its chunk count only the update runs."""
    K: tl.constexpr = D1 * D2 * D3
    NK: tl.constexpr = (K + BK - 1) // BK
    DT: tl.constexpr = q1.dtype.element_ty
    DOT_DT: tl.constexpr = DT if LOWP else tl.float32
    i_v, i_nh, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, i_b = sequence_of_program(i_n, T, cu_seqlens)
    n_c = tl.cdiv(eos - bos, C)
    if i_c <= n_c:
        o_c = tl.arange(0, C)
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        tok_u = bos + (i_c - 1) * C + o_c  # the update's rows (chunk i_c - 1)
        r_u = (i_b * T + tok_u) * H + i_h
        tok = bos + i_c * C + o_c  # the products' rows (chunk i_c; all masked off at its end)
        r = (i_b * T + tok) * H + i_h
        m_t = tok < eos
        b_us = tl.zeros([C, BV], dtype=tl.float32)
        b_decay = 1.0
        if not FIRST:
            b_us = tl.load(Us + (i_nh.to(tl.int64) * C + o_c[:, None]) * V + o_v[None, :], mask=m_v[None, :],
                           other=0.0)
            b_decay = tl.load(Gl + i_nh)
        b_ks = tl.zeros([C, BV], dtype=tl.float32)
        b_qs = tl.zeros([C, BV], dtype=tl.float32)
        for j in range(TPP):
            i_k = i_p * TPP + j
            if i_k < NK:
                o_k = i_k * BK + tl.arange(0, BK)
                m_s = (o_k < K)[:, None] & m_v[None, :]
                off_s = (i_n.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
                b_s = load_state_tile(h0, ht, off_s, m_s, FIRST, h0 is not None)
                if not FIRST:
                    b_k = phi_block(k1, k2, k3, r_u, tok_u < eos, i_k, C, BK, NF, D1, D2, D3, K, OUTER, DOT_DT)
                    b_s = b_decay * b_s + dot(tl.trans(b_k), b_us, LOWP, DT, PREC)
                tl.store(ht + off_s, b_s, mask=m_s)
                if i_c < n_c:
                    b_k = phi_block(k1, k2, k3, r, m_t, i_k, C, BK, NF, D1, D2, D3, K, OUTER, DOT_DT)
                    b_q = phi_block(q1, q2, q3, r, m_t, i_k, C, BK, NF, D1, D2, D3, K, OUTER, DOT_DT)
                    b_ks += dot(b_k, b_s, LOWP, DT, PREC)
                    b_qs += dot(b_q, b_s, LOWP, DT, PREC)
        if i_c < n_c:
            p_p = ((i_p * tl.num_programs(1) + i_nh).to(tl.int64) * C + o_c[:, None]) * V + o_v[None, :]
            tl.store(KSp + p_p, b_ks, mask=m_v[None, :])
            tl.store(QSp + p_p, b_qs, mask=m_v[None, :])


@triton.jit(do_not_specialize=["i_c"])
def chunk_stepped_output_kernel(
    q1, q2, q3, k1, k2, k3, v, g, beta, o, P, Ai, Us, Gl, KSp, QSp, cu_seqlens, scale, T, i_c,
    H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NP: tl.constexpr, L2NORM: tl.constexpr, LOWP: tl.constexpr,
    PREC: tl.constexpr,
):
    """Program (value block, sequence x head) at chunk ``i_c``: phi(K) S and phi(Q) S summed over
    the NP runs' partials, then U (delta rule: Ai diag(beta) (V - Gamma phi(K) S)), the
    outputs, and U scaled for the next update into ``Us`` with Gamma_C into ``Gl``. ``g`` /
    ``beta`` None: no gates / no delta rule."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, i_b = sequence_of_program(i_n, T, cu_seqlens)
    if i_c < tl.cdiv(eos - bos, C):
        DT: tl.constexpr = q1.dtype.element_ty
        o_c = tl.arange(0, C)
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        tok = bos + i_c * C + o_c
        m_t = tok < eos
        r = (i_b * T + tok) * H + i_h
        b_c, b_P, b_Ai, _, _, r_q, r_k, b_v, b_b = chunk_inputs(
            q1, q2, q3, k1, k2, k3, v, g, beta, P, Ai, None, None, r, m_t, o_v, m_v, (i_b * H + i_h) * T + tok,
            NF, D1, D2, D3, BD1, BD2, BD3, C, BK, V, L2NORM, PREC, "workspace",
        )
        b_ks = tl.zeros([C, BV], dtype=tl.float32)
        b_qs = tl.zeros([C, BV], dtype=tl.float32)
        for i_p in range(NP):
            p_p = ((i_p * tl.num_programs(1) + i_nh).to(tl.int64) * C + o_c[:, None]) * V + o_v[None, :]
            b_ks += tl.load(KSp + p_p, mask=m_v[None, :], other=0.0)
            b_qs += tl.load(QSp + p_p, mask=m_v[None, :], other=0.0)
        b_ks = b_ks * r_k[:, None]
        b_qs = b_qs * r_q[:, None]
        b_gam = tl.exp(b_c)
        b_last = tl.sum(tl.where(o_c == C - 1, b_c, 0.0), axis=0)
        m_o = m_t[:, None] & m_v[None, :]
        b_u, b_o = delta_outputs(b_ks, b_qs, b_gam, b_v, b_b, b_Ai, b_P, scale, None, None, None, beta is not None,
                                 LOWP, DT, PREC)
        tl.store(o + r[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_o)
        # the rows' scale (1 / ||phi(k)||, Gamma_C / Gamma_i) on U once, not on every phi(K) block
        b_us = b_u * (r_k * tl.exp(b_last - b_c))[:, None]
        tl.store(Us + (i_nh.to(tl.int64) * C + o_c[:, None]) * V + o_v[None, :], b_us, mask=m_v[None, :])
        tl.store(Gl + i_nh, tl.exp(b_last), mask=i_v == 0)


def run(config, p: Problem, q, k, v, g, beta, *, h0, ht, cu_seqlens, l2norm: bool, ws: dict) -> torch.Tensor:
    """Allocate o and the per-chunk buffers, then launch the chunks in order (``ws``: the prepare
    kernel's P and Ai; ``ht`` holds the state). Returns o."""
    B, T, H, V = v.shape
    C, BK, BV = config.chunk_size, config.block_k, config.block_v
    TPP = config.tiles_per_program
    NH, NP = p.num_seqs * H, triton.cdiv(triton.cdiv(p.key_dim, BK), TPP)
    f32 = dict(dtype=torch.float32, device=v.device)
    o = args.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    us, gl = args.empty(NH, C, V, **f32), args.empty(NH, **f32)
    ksp, qsp = args.empty(NP, NH, C, V, **f32), args.empty(NP, NH, C, V, **f32)
    bounds = p.seq_bounds if p.seq_bounds is not None else ((0, T),)
    chunks = max(triton.cdiv(hi - lo, C) for lo, hi in bounds)
    widths, lowp = width_args(p.key_widths, 16), lowp_dots(v.dtype)
    outer = KernelShape(p.key_widths, V).outer_phi_ok(BK)
    state_widths = {n: widths[n] for n in ("D1", "D2", "D3")}
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    for i_c in range(chunks + 1):
        cached(chunk_stepped_state_kernel)[(triton.cdiv(V, BV), NH, NP)](
            *factor_args(q), *factor_args(k), h0, ht, us, gl, ksp, qsp, cu_seqlens, T, i_c,
            H=H, NF=len(q), **state_widths, V=V, C=C, BK=BK, BV=BV, TPP=TPP, LOWP=lowp, PREC=config.dot_precision,
            OUTER=outer, FIRST=i_c == 0, **launch,
        )
        if i_c < chunks:
            cached(chunk_stepped_output_kernel)[(triton.cdiv(V, BV), NH)](
                *factor_args(q), *factor_args(k), v, g, beta, o, ws.get("P"), ws.get("Ai"), us, gl, ksp, qsp,
                cu_seqlens, p.scale, T, i_c,
                H=H, NF=len(q), **widths, V=V, C=C, BK=BK, BV=BV, NP=NP, L2NORM=l2norm, LOWP=lowp,
                PREC=config.dot_precision, **launch,
            )
    return o
