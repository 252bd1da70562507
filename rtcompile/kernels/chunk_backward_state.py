"""The backward's state-gradient loop (step 3 of ``chunk_backward.py``, whose notation this
follows): sequential in reverse per (sequence, head, value block), every chunk's outgoing state
gradient dS', dU and d(initial state). Resident (K <= 256): :func:`chunk_bwd_state_kernel`, the
[K, block_v] gradient in registers; streamed: ``chunk_backward_streamed.state_grads_streamed``.
:func:`state_grads` launches the one the config names."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import args
from .args import dot_dtype, lowp_dots
from .blocks import dot, first_stored_state, resident_state_tile, sequence_of_program
from .chunk_backward_grads import stored_log_decay
from .chunk_backward_kept import Recomputed, prefetch_state_tiles, workspace_dtype
from .chunk_backward_streamed import state_grads_streamed
from .inputs import Problem
from .launch_cache import cached


@triton.jit
def chunk_bwd_state_kernel(
    Qw, Kw, P, Ai, Gc, beta, do, dht, dh0, dHc, dUc, cu_seqlens, chunk_offsets, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
    LOWP: tl.constexpr, PREC: tl.constexpr,
):
    """The outgoing state's gradient dS' of every chunk, in reverse, for one (sequence, head,
    value block): stored into ``dHc`` ([chunks, H, K, V], the products' type; ``chunk_offsets``:
    each varlen sequence's first chunk) with dU = s P^T dO + diag(r) phi(K) dS' into ``dUc`` (fp32,
    laid out as v); starts from ``dht`` (None: zeros) and ends with d(initial state) in ``dh0``
    (None: not wanted). Per chunk dS = gamma dS' + phi(Q)^T diag(s Gamma) dO - phi(K)^T
    diag(Gamma b) T^T dU (the last term with the delta rule). phi(Q), phi(K) (``Qw``, ``Kw``),
    the scores ``P``, the inverse ``Ai`` and the log decay ``Gc`` are the prepare kernel's, so the
    chain is five products per chunk; only loaded tiles are transposed. The [K, BV] gradient
    stays in registers (fp32)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, i_b = sequence_of_program(i_n, T, cu_seqlens)
    n_c = tl.cdiv(eos - bos, C)
    i_g0 = first_stored_state(i_n, i_b, T, cu_seqlens, chunk_offsets, C)
    DT: tl.constexpr = Kw.dtype.element_ty
    o_c = tl.arange(0, C)
    o_v, m_v, o_k, off_k, m_s, off_s = resident_state_tile(i_v, i_n, i_h, H, K, V, BV)
    b_ds = tl.zeros([K, BV], dtype=tl.float32)
    if dht is not None:
        b_ds = tl.load(dht + off_s, mask=m_s, other=0.0).to(tl.float32)
    for i_r in range(0, n_c):
        i_c = n_c - 1 - i_r
        tl.store(dHc + ((i_g0 + i_c) * H + i_h) * K * V + off_k, b_ds.to(dHc.dtype.element_ty), mask=m_s)
        tok = bos + i_c * C + o_c
        m_t = tok < eos
        r = (i_b * T + tok) * H + i_h
        p_row = (i_b * H + i_h) * T + tok
        b_c, b_last = stored_log_decay(Gc, p_row, m_t, (i_b * H + i_h) * T + tl.minimum(bos + i_c * C + C, eos) - 1,
                                       C)
        b_k = tl.load(Kw + p_row[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_q = tl.load(Qw + p_row[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_pt = tl.load(P + p_row[None, :] * C + o_c[:, None], mask=m_t[None, :], other=0.0)  # P^T
        b_do = tl.load(do + r[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_do = b_do.to(tl.float32)
        b_du = scale * dot(b_pt, b_do, LOWP, DT, PREC)
        b_du += tl.where(m_t, tl.exp(b_last - b_c), 0.0)[:, None] * dot(b_k, b_ds, LOWP, DT, PREC)
        tl.store(dUc + r[:, None] * V + o_v[None, :], b_du, mask=m_t[:, None] & m_v[None, :])
        b_gam = tl.exp(b_c)
        b_ds = tl.exp(b_last) * b_ds + dot(tl.trans(b_q), (scale * b_gam)[:, None] * b_do, LOWP, DT, PREC)
        if beta is not None:
            b_b = tl.load(beta + r, mask=m_t, other=0.0).to(tl.float32)
            b_ait = tl.load(Ai + p_row[None, :] * C + o_c[:, None], mask=m_t[None, :], other=0.0)  # T^T
            b_dr = (b_b * b_gam)[:, None] * dot(b_ait, b_du, LOWP, DT, PREC)
            b_ds -= dot(tl.trans(b_k), b_dr, LOWP, DT, PREC)
    if dh0 is not None:
        tl.store(dh0 + off_s, b_ds, mask=m_s)


def state_grads(config, p: Problem, q, k, v, beta, h0, cu_seqlens, l2norm: bool, kept: Recomputed,
                 do, dht):
    """Step 3: every chunk's dS', dU and d(initial state) (fp32; None without ``h0``)."""
    B, T, H, V = v.shape
    C, K, bv = config.chunk_size, p.key_dim, config.block_v
    store, ws = workspace_dtype(config, v), kept.ws
    if config.state_loop != "resident":
        return state_grads_streamed(p, q, k, beta, do, dht, want_dh0=h0 is not None, scale=p.scale, ws=ws,
                                    cu_seqlens=cu_seqlens, offsets=kept.offsets, l2norm=l2norm, chunk_size=C,
                                    block_k=min(config.state_block_k, K), block_v=bv, num_warps=config.num_warps,
                                    num_stages=config.num_stages, precision=config.dot_precision, store_dtype=store,
                                    merge_passes=config.merge_passes, prefetch_state=prefetch_state_tiles(
                                        config, p.key_widths, True))
    dHc = args.empty(sum(kept.n_chunks), H, K, V, dtype=dot_dtype(v), device=v.device)
    dUc = args.empty(B, T, H, V, dtype=store, device=v.device)
    dh0 = args.empty(p.state_shape, dtype=torch.float32, device=v.device) if h0 is not None else None
    cached(chunk_bwd_state_kernel)[(triton.cdiv(V, bv), p.num_seqs * H)](
        ws["Qw"], ws["Kw"], ws["P"], ws["Ai"], ws["Gc"], beta, do, dht, dh0, dHc, dUc, cu_seqlens, kept.offsets,
        p.scale, T, H=H, K=K, V=V, C=C, BV=bv, LOWP=lowp_dots(v.dtype), PREC=config.dot_precision,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return dHc, dUc, dh0
