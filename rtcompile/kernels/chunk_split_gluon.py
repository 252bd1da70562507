"""The split form's state loop written in Gluon for Hopper (``SplitConfig.loop = "gluon"``).

The Triton loop (``chunk_split.chunk_split_state_kernel``) keeps the state S [K, BV] in
registers, but each of its products takes its right operand from shared memory, so every chunk
stores S or U there first, fences and waits on a barrier: three such round trips on the chain
(19 barriers a chunk, o3 16x16 on sm_90). This loop carries S^T [BV, K] as a wgmma accumulator
instead and writes every product with its register operand on the left, where wgmma takes it
from registers:

    R^T = S^T phi(K)^T        (phi(K) from shared memory, as TMA loaded it)
    U^T = X^T Ai^T,  X = diag(b) (V - diag(Gamma) R)   (tf32: Ai is fp32 in the workspace)
    S^T <- Gamma_C S^T + (U diag(Gamma_C / Gamma))^T phi(K)

(with ``wy``: U^T = U0^T - S^T W^T, one product for the first two). Nothing on the chain goes
through shared memory; the next chunk's phi(K) and inverse (or W) arrive by TMA while this one
computes. The result is the Triton loop's (the same stores into Hc and Uc, the same products'
types); it needs sm_90 (wgmma), 16-bit inputs, 64 value columns (wgmma's M) and one warpgroup.
Gluon kernels do not run under the interpreter: ``SplitConfig.check`` refuses the loop where
Gluon is missing, the defaults table proposes it only where this process's GPU runs it
(:func:`runs_here`) and the launcher refuses a caller's Gluon config elsewhere
(``launch.device_refusal``). H200 figures: ``forms._GLUON_SPLIT``.
"""

from __future__ import annotations

import functools

import torch
import triton

from . import args
from .launch_cache import cached

try:  # Gluon's Hopper API as Triton 3.6 - 3.9 spell it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Triton 3.9 renamed the TMA copies (and refuses the old names)
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
except ImportError:  # an older Triton: the config's check says so
    gluon = None

GLUON_BV = 64  # wgmma's M: S^T's rows are the value columns
GLUON_WARPS = 4  # one warpgroup holds S^T (K = 256: 128 fp32 registers a thread)


def runs_on(device: torch.device) -> bool:
    """Whether the loop can run on ``device``: an sm_90 GPU (wgmma is Hopper's alone; sm_100 has
    tcgen05 instead) with Gluon; never under the interpreter."""
    return (gluon is not None and device.type == "cuda" and not args.interpreting()
            and torch.cuda.get_device_capability(device)[0] == 9)


def runs_here() -> bool:
    """Whether this process's default CUDA device runs the loop (asked when a default is chosen,
    never at import): the defaults table proposes it only then."""
    return gluon is not None and not args.interpreting() and torch.cuda.is_available() \
        and runs_on(torch.device("cuda", torch.cuda.current_device()))


def config_refusal(cfg, shape) -> str | None:
    """Why ``cfg`` (a SplitConfig with loop="gluon") cannot run ``shape``'s problem (the shape
    already materialised where the config says so); None when it can. The device is the
    launcher's to check (sm_90: ``launch.device_refusal``)."""
    if gluon is None:
        return f"loop='gluon' needs Triton's Gluon with Hopper ops (Triton >= 3.6; this is {triton.__version__})"
    if shape.input_bytes != 2:
        return "loop='gluon' needs 16-bit inputs (its products are bf16 / fp16 wgmma); allowed: loop='triton'"
    if cfg.block_v != GLUON_BV or cfg.num_warps != GLUON_WARPS:
        return (f"loop='gluon' takes block_v={GLUON_BV} (wgmma's M) and num_warps={GLUON_WARPS} (one warpgroup), "
                f"got block_v={cfg.block_v}, num_warps={cfg.num_warps}")
    if shape.value_width % GLUON_BV:
        return f"loop='gluon' needs d_v a multiple of {GLUON_BV}, got {shape.value_width}; allowed: loop='triton'"
    # chunk_size 64: the wrong outputs at K = 128 (H200, 2026-12-04) were the output kernel's
    # 16-column tiles, not this loop's (H100, 2026-12-05; SplitConfig.check refuses them now); still
    # refused for the spills at K = 256 (384 B, 0.50 ms against 0.38 at C 32), not re-timed since
    if shape.key_dim not in (64, 128, 256) or cfg.chunk_size not in (16, 32):
        return (f"loop='gluon' takes K in 64, 128, 256 and chunk_size in 16, 32, got K={shape.key_dim}, "
                f"chunk_size={cfg.chunk_size}")
    return None


def smem_bytes(C: int, K: int, BV: int, wy: bool) -> int:
    """The loop's shared memory: two stages of phi(K) and W + U0 (wy) or values + the fp32
    inverse, and the stored state's staging tile (o3 16x16 C 64: 147472 bytes compiled)."""
    stage = C * K * 2 + (C * K * 2 + C * BV * 4 if wy else C * BV * 2 + C * C * 4)
    return 2 * stage + K * BV * 2


if gluon is not None:

    @gluon.constexpr_function
    def _mma_layout(N, KI):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, KI])


    @gluon.jit
    def _issue_loads(Kd, Wd, Ad, Vd, U0d, k_buf, w_buf, a_buf, v_buf, u0_buf, bar, row, vrow, vcol, ucol, pred,
                     nbytes: gl.constexpr):
        """One chunk's TMA loads into one stage (``pred`` False: none): phi(K), then W and U0
        (wy) or the values and the inverse (delta rule)."""
        mbarrier.expect(bar, nbytes, pred)
        tma_load(Kd, [row.to(gl.int32), 0], bar, k_buf, pred)
        if Wd is not None:
            tma_load(Wd, [row.to(gl.int32), 0], bar, w_buf, pred)
            tma_load(U0d, [row.to(gl.int32), ucol], bar, u0_buf, pred)
        else:
            tma_load(Vd, [vrow.to(gl.int32), vcol], bar, v_buf, pred)
            if Ad is not None:
                tma_load(Ad, [row.to(gl.int32), 0], bar, a_buf, pred)

    @gluon.jit(do_not_specialize=["c0", "c_end"])
    def chunk_split_state_gluon_kernel(
        Vd, beta, h0, ht, Ad, Wd, U0d, Kd, Gc, Hd, Uc, cu_seqlens, chunk_offsets, T, c0, c_end,
        H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, C: gl.constexpr, BV: gl.constexpr,
        STRIDE: gl.constexpr,
    ):
        """:func:`~rtcompile.kernels.chunk_split.chunk_split_state_kernel`'s loop (its arguments,
        with TMA) on S^T held as a wgmma accumulator; one program per (sequence, head, value
        block of BV = 64). ``Kd`` / ``Ad`` / ``Wd``: descriptors of phi(K) [B H T, K] in [C, K]
        blocks, of the inverse [B H T, C] in [C, C] blocks (delta rule without wy) and of W
        (wy); ``Hd``: of the stored states [states H K, V] in [K, BV] blocks. None as in that
        kernel. Rows past the sequence in a TMA block are the next sequence's (or zeros): U's
        columns there are set to zero, so they add nothing."""
        WY: gl.constexpr = Wd is not None
        DELTA: gl.constexpr = beta is not None
        DT: gl.constexpr = Kd.dtype
        i_v, i_nh = gl.program_id(0), gl.program_id(1)
        i_n, i_h = i_nh // H, i_nh % H
        if cu_seqlens is not None:
            bos = gl.load(cu_seqlens + i_n).to(gl.int64)
            eos = gl.load(cu_seqlens + i_n + 1).to(gl.int64)
            i_b = 0
            i_g0 = gl.load(chunk_offsets + i_n).to(gl.int64)
        else:
            bos = 0
            eos = T
            i_b = i_n.to(gl.int64)
            i_g0 = i_b * gl.cdiv(gl.cdiv(T, C), STRIDE)

        # S^T [BV, K] and the chunk's [BV, C] products: wgmma accumulators of one warpgroup
        s_layout: gl.constexpr = _mma_layout(K, 16)
        r_layout: gl.constexpr = _mma_layout(C, 16)
        a_layout: gl.constexpr = _mma_layout(C, 8)  # the tf32 product with the inverse
        s_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=r_layout, k_width=2)
        u_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        x_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=1)
        col_r: gl.constexpr = gl.SliceLayout(0, r_layout)  # along C
        row_r: gl.constexpr = gl.SliceLayout(1, r_layout)  # along BV
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)  # along K
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

        # the incoming state, S^T[v, k] = h0[n, h, k, v]
        o_vs = i_v * BV + gl.arange(0, BV, layout=row_s)
        o_ks = gl.arange(0, K, layout=col_s)
        off_s = (i_n.to(gl.int64) * H + i_h) * K * V + gl.expand_dims(o_ks, 0) * V + gl.expand_dims(o_vs, 1)
        m_s = gl.expand_dims(o_vs < V, 1) & gl.expand_dims(o_ks < K, 0)
        if h0 is not None:
            b_st = gl.load(h0 + off_s, mask=m_s, other=0.0).to(gl.float32)
        else:
            b_st = gl.zeros([BV, K], gl.float32, layout=s_layout)

        # two stages of TMA buffers: chunk j + 1's loads fly while chunk j computes
        k_smem = gl.allocate_shared_memory(DT, [2, C, K], Kd.layout)
        w_smem, a_smem, v_smem, u0_smem = k_smem, k_smem, k_smem, k_smem  # placeholders, never read
        if WY:
            w_smem = gl.allocate_shared_memory(DT, [2, C, K], Wd.layout)
            u0_smem = gl.allocate_shared_memory(gl.float32, [2, C, BV], U0d.layout)
        else:
            v_smem = gl.allocate_shared_memory(DT, [2, C, BV], Vd.layout)
            if DELTA:
                a_smem = gl.allocate_shared_memory(gl.float32, [2, C, C], Ad.layout)
        h_smem = gl.allocate_shared_memory(DT, [K, BV], Hd.layout)
        bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(bars.index(s), count=1)
        nbytes: gl.constexpr = C * K * 2 + (C * K * 2 + C * BV * 4 if WY else C * BV * 2) + \
            (C * C * 4 if DELTA and not WY else 0)

        n_end = gl.minimum(c_end, gl.cdiv(eos - bos, C)).to(gl.int32)  # int32 stage indices
        row0 = (i_b * H + i_h) * T + bos  # the sequence's first row in the [B H T, .] workspaces
        vrow0 = i_b * T + bos  # and in v as [B T, H V]
        _issue_loads(Kd, Wd, Ad, Vd, U0d, k_smem.index(0), w_smem.index(0), a_smem.index(0), v_smem.index(0),
                     u0_smem.index(0), bars.index(0), row0 + c0 * C, vrow0 + c0 * C, i_h * V + i_v * BV, i_v * BV,
                     c0 < n_end, nbytes)

        o_c = gl.arange(0, C, layout=col_r)
        o_vr = i_v * BV + gl.arange(0, BV, layout=row_r)
        m_vr = o_vr < V
        for i_c in range(c0, n_end):
            j = i_c - c0
            st = j % 2
            # the next chunk's loads into the other stage (its last readers, chunk j - 1's
            # products, were waited for)
            _issue_loads(Kd, Wd, Ad, Vd, U0d, k_smem.index(1 - st), w_smem.index(1 - st), a_smem.index(1 - st),
                         v_smem.index(1 - st), u0_smem.index(1 - st), bars.index(1 - st), row0 + (i_c + 1) * C,
                         vrow0 + (i_c + 1) * C, i_h * V + i_v * BV, i_v * BV, i_c + 1 < n_end, nbytes)
            tok = bos + i_c * C + o_c
            m_t = tok < eos
            r = (i_b * T + tok) * H + i_h
            if Gc is not None:
                b_c = gl.load(Gc + row0 + i_c * C + o_c, mask=m_t, other=0.0)
                b_last = gl.load(Gc + (i_b * H + i_h) * T + gl.minimum(bos + i_c * C + C, eos) - 1)
            else:
                b_c = gl.zeros([C], gl.float32, layout=col_r)
                b_last = 0.0
            if DELTA and not WY:
                b_b = gl.load(beta + r, mask=m_t, other=0.0).to(gl.float32)
            b_sb = b_st.to(DT)  # S^T as the products' left operand (and the stored state)
            # the incoming state for the output kernel: through shared memory and a TMA store
            if i_c % STRIDE == 0:
                tma.store_wait(0)
                h_smem.permute((1, 0)).store(b_sb)
                fence_async_shared()
                tma_store(Hd, [(((i_g0 + i_c // STRIDE) * H + i_h) * K).to(gl.int32), i_v * BV], h_smem)
            mbarrier.wait(bars.index(st), (j // 2) & 1)
            k_tile = k_smem.index(st)
            if WY:  # U^T = U0^T - S^T W^T
                b_ws = warpgroup_mma(gl.convert_layout(b_sb, s_op), w_smem.index(st).permute((1, 0)),
                                     gl.zeros([BV, C], gl.float32, layout=r_layout), is_async=True)
                b_ws = warpgroup_mma_wait(num_outstanding=0, deps=(b_ws,))
                b_u = u0_smem.index(st).permute((1, 0)).load(r_layout) - b_ws
            elif DELTA:  # R^T = S^T phi(K)^T, U^T = X^T Ai^T
                b_rt = warpgroup_mma(gl.convert_layout(b_sb, s_op), k_tile.permute((1, 0)),
                                     gl.zeros([BV, C], gl.float32, layout=r_layout), is_async=True)
                b_rt = warpgroup_mma_wait(num_outstanding=0, deps=(b_rt,))
                b_vt = v_smem.index(st).permute((1, 0)).load(r_layout).to(gl.float32)
                b_xt = gl.expand_dims(b_b, 0) * (b_vt - gl.expand_dims(gl.exp(b_c), 0) * b_rt)
                b_u = warpgroup_mma(gl.convert_layout(b_xt, x_op), a_smem.index(st).permute((1, 0)),
                                    gl.zeros([BV, C], gl.float32, layout=a_layout), is_async=True)  # tf32
                b_u = gl.convert_layout(warpgroup_mma_wait(num_outstanding=0, deps=(b_u,)), r_layout)
            else:
                b_u = v_smem.index(st).permute((1, 0)).load(r_layout).to(gl.float32)
            m_o = gl.expand_dims(m_vr, 1) & gl.expand_dims(m_t, 0)
            b_u = gl.where(m_o, b_u, 0.0)
            gl.store(Uc + gl.expand_dims(r, 0) * V + gl.expand_dims(o_vr, 1), b_u.to(Uc.dtype.element_ty), mask=m_o)
            # Gamma_C / Gamma_i <= 1 on U's columns rather than on phi(K)'s rows
            b_us = (b_u * gl.expand_dims(gl.exp(b_last - b_c), 0)).to(DT)
            b_st = warpgroup_mma(gl.convert_layout(b_us, u_op), k_tile, b_st * gl.exp(b_last), is_async=True)
            b_st = warpgroup_mma_wait(num_outstanding=0, deps=(b_st,))
        tma.store_wait(0)
        for s in gl.static_range(2):
            mbarrier.invalidate(bars.index(s))
        if ht is not None:
            gl.store(ht + off_s, b_st, mask=m_s)


@functools.lru_cache(maxsize=None)
def _layout(block: tuple[int, int], dtype: torch.dtype):
    # made once per block and type: a call's four descriptors took 110 us of host time with the layouts
    # made each time, 39 with them cached (the CPU machine)
    return gl.NVMMASharedLayout.get_default_for(list(block), {torch.float32: gl.float32, torch.bfloat16: gl.bfloat16,
                                                              torch.float16: gl.float16}[dtype])


def _desc(t: torch.Tensor, cols: int, block: list[int]):
    """A descriptor of ``t`` (contiguous) seen as [rows, cols], read or written in ``block``s."""
    rows = t.numel() // cols
    return TensorDescriptor(t.view(rows, cols), [rows, cols], [cols, 1], block, _layout(tuple(block), t.dtype))


def descriptors(v: torch.Tensor, ws: dict, Hc: torch.Tensor, C: int) -> dict:
    """Gluon tensor descriptors of the loop's TMA operands, by argument name: ``Vd`` (v [B, T,
    H, V] as [B T, H V] in [C, 64] blocks; not with wy), ``Kd`` / ``Wd`` (phi(K) and W, [B, H,
    T, K] as [B H T, K] in [C, K] blocks), ``Ad`` (the inverse, [B, H, T, C] fp32 in [C, C]
    blocks; delta rule without wy), ``U0d`` (U0 [B, H, T, V] fp32 in [C, 64] blocks) and ``Hd``
    (the stored states [states, H, K, V] as [states H K, V] in [K, 64] blocks); None where the
    workspace ``ws`` (``chunk_prepare.keys_workspace``) has no such buffer."""
    K, V, BV = ws["Kw"].shape[-1], v.shape[-1], GLUON_BV
    wy = ws["W"] is not None
    return {
        "Vd": None if wy else _desc(v, v.shape[2] * V, [C, BV]),
        "Kd": _desc(ws["Kw"], K, [C, K]),
        "Wd": _desc(ws["W"], K, [C, K]) if wy else None,
        "Ad": _desc(ws["Ai"], C, [C, C]) if ws["Ai"] is not None and not wy else None,
        "U0d": _desc(ws["U0"], V, [C, BV]) if wy else None,
        "Hd": _desc(Hc, V, [K, BV]),
    }


def state_loop(config, p, v, beta, ws: dict, Hc, Uc, cu_seqlens, chunk_offsets, *, keys, l2norm: bool):
    """:func:`chunk_split_state_gluon_kernel` bound to one call's workspaces, as
    ``chunk_split.triton_state_loop``'s ``walk(h_in, h_out, c0, c1)``: the descriptors
    (:func:`descriptors`) made once here, one launch per walk over chunks [c0, c1) of every
    (sequence, head, value block of 64). ``keys`` / ``l2norm`` (the key factors) are not read:
    the loop reads the prepare kernel's phi(K)."""
    _, T, H, V = v.shape
    C, K = config.chunk_size, p.key_dim
    gd = descriptors(v, ws, Hc, C)
    kernel_call = cached(chunk_split_state_gluon_kernel)[(triton.cdiv(V, GLUON_BV), p.num_seqs * H)]

    def walk(h_in, h_out, c0: int, c1: int) -> None:
        kernel_call(gd["Vd"], beta, h_in, h_out, gd["Ad"], gd["Wd"], gd["U0d"], gd["Kd"], ws["Gc"], gd["Hd"], Uc,
                    cu_seqlens, chunk_offsets, T, c0, c1, H=H, K=K, V=V, C=C, BV=GLUON_BV, STRIDE=config.state_stride,
                    num_warps=GLUON_WARPS)

    return walk
