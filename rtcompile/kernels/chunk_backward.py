"""The chunk-parallel backward: gradients of every input of ``running_tensor`` (each query and key
factor, v, g, beta, the initial state, and through the final state), from the output's gradient
dO and the final state's dS_T.

Per chunk of C tokens (padded rows zero; c = cumsum(g) within the chunk, Gamma = exp(c), gamma
= exp(c_last), r = gamma / Gamma, D_ij = exp(c_i - c_j) for j <= i; A = strictly-lower(diag(b)
(Gk * D)), T = (I + A)^-1; R = V - diag(Gamma) phi(K) S, U = T diag(b) R (U = V without the
delta rule); P = Gq * D; O = s (diag(Gamma) phi(Q) S + P U); S' = gamma S + phi(K)^T diag(r) U)::

    dU = s P^T dO + diag(r) phi(K) dS'            dR' = T^T dU,  dR = diag(b) dR'
    dS = s phi(Q)^T diag(Gamma) dO + gamma dS' - phi(K)^T diag(Gamma) dR     (dv = dR, or dU)
    dphi(Q) = s diag(Gamma) dO S^T,  dphi(K) = diag(r) U dS'^T - diag(Gamma) dR S^T
    dP = s dO U^T,  dT = dU R^T diag(b),  dA = -(T^T dT T^T) strictly lower
    db = rowsum(dR' * R) + rowsum(dA * Gk * D)
    dc: the D, Gamma, r and gamma terms; dg = the reverse cumulative sum of dc within the chunk

and the Gram gradients go to the factors through Gq = prod_f Q_f K_f^T, Gk = prod_f K_f K_f^T.

Three steps (three kernels of our own, two of the split forward's):

1. forward recompute: the split form's prepare kernel (phi(K), the inverse T, the cumulative
   log decay) and its state loop with state_stride 1 (``chunk_split.py``), storing every
   chunk's incoming state S and U, here in fp32 (the split forward keeps them in the products'
   type; bf16 states would put their 2^-8 rounding into every gradient);
2. :func:`chunk_bwd_state_kernel`, sequential in reverse per (sequence, head, value block):
   the outgoing state's gradient dS' of every chunk (every term is per value column, so value
   blocks are independent), and d(initial state) = the dS after chunk 0;
3. ``chunk_backward_grads.chunk_bwd_grads_kernel``, chunk-parallel, one program per (chunk,
   head) over all value blocks (sums over value columns in registers, no atomics): the
   factors' gradients (phi's gradient contracted to the factors on chip, the Gram path, the
   l2norm backward), dv, dbeta and dg.

Memory (``BackwardConfig.workspace_bytes``), per (sequence, head): per chunk the state S and
its gradient dS', K d_v fp32 each (8 K d_v bytes; o3 16x16 d_v 64: 128 KiB per chunk); per
token U (4 d_v bytes, fp32), phi(K) (K bytes x 2 for 16-bit inputs, x 4 for fp32; freed after
step 1), the inverse (4 C bytes, delta rule) and the cumulative log decay (4 bytes, gates).
o3 16x16, d_v 64, C 32, bf16: 4096 + 256 + 512 + 128 + 4 bytes per token (phi(K) included).

Scope of this pass (:func:`supports`): orders 2-4 with power-of-two key widths >= 16 and
K <= 256 (the [K, block_v] state and the [C, K] phi tiles in registers; order 4 then never
fits, 16^3 = 4096), any d_v, gates, delta rule, l2norm, initial state, final-state
gradient, varlen and any T.

Not yet measured on a GPU. Compiled offline for sm_90 (Triton 3.9 and 3.6's ptxas) every
kernel builds, but the state-gradient loop and the gradients kernel spill at these tiles
(fp32 products lowered to FMAs with ieee precision; the gradients kernel also reshapes [C, K]
phi gradients to [C, d1, d2] for the factor contraction): e.g. o3 16x16 C 32, 8 warps, ieee,
~9 KiB of stack per thread in the gradients kernel. The register estimate below ranks configs
but does not see this; a speed pass should contract phi's gradients one index of axis 1 at a
time (as the prepare kernel stores phi(K)) instead of holding [C, K] tiles.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl

from . import args
from .args import factor_args, lowp_dots, width_args
from .blocks import (
    chunk_log_decay, factor_tiles, phi_from_tiles, scores_from_tiles, sequence_of_program,
)
from .chunk_backward_grads import chunk_bwd_grads_kernel
from .chunk_prepare import chunk_indices, prepare_keys
from .chunk_split import SplitConfig, chunk_split_state_kernel
from .config import (
    DEFAULT_SMEM_BYTES, DOT_PRECISIONS, PREPARE_WARPS, SOLVES, CostFigures, KernelConfig, KernelShape, Workload,
    chunk_count, chunk_programs, chunk_refusal, estimate_registers, resource_refusal,
)
from .inputs import Problem, check_inputs

MAX_KEY_DIM = 256
BWD_CHUNK_SIZES = (16, 32, 64)


@dataclass(frozen=True)
class BackwardConfig(KernelConfig):
    """The backward's kernels: ``chunk_size`` (16, 32, 64), ``block_v`` (the recompute's and
    the state-gradient loop's value tile, and the gradients kernel's value step), ``num_warps``
    and ``num_stages`` (>= 2: the split state loop's rule) of all three sequential / parallel
    kernels, ``prepare_warps`` / ``solve`` / ``dot_precision`` of the prepare kernel and the
    precision of every fp32 product of the backward."""

    kernel: ClassVar[str] = "chunk_bwd"
    form: ClassVar[str] = "backward"
    chunk_size: int
    block_v: int
    num_warps: int = 4
    num_stages: int = 2
    prepare_warps: int = 1
    solve: str = "tiles"
    dot_precision: str = "ieee"

    def resident(self, shape: KernelShape) -> bool:
        return True

    def check(self, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> str | None:
        if (reason := chunk_refusal(self, shape)) is not None:
            return reason
        if (reason := self._check_choice("chunk_size", BWD_CHUNK_SIZES)) is not None:
            return reason
        if (reason := shape_refusal(shape)) is not None:
            return reason
        if self.num_stages < 2:
            return f"num_stages={self.num_stages}; allowed: 2, 3 or 4 (the split state loop's rule)"
        return resource_refusal(self, shape, smem_limit, "; try a smaller chunk_size or block_v, or more num_warps")

    def estimate_registers(self, shape: KernelShape) -> int:
        # the gradients kernel: phi(Q), phi(K) and one block's phi gradient [C, K], S and dS'
        # [K, BV], ~6 [C, C] and ~6 [C, BV] tiles, the factor tiles and their gradients
        C, K, bv = self.chunk_size, shape.key_dim_pow2, self.block_v
        live = 3 * C * K + 2 * K * bv + 6 * C * C + 6 * C * bv + 4 * C * sum(shape.key_widths)
        return estimate_registers(live, self.num_warps)

    def estimate_smem(self, shape: KernelShape) -> int:
        # the products' fp32 operands staged per stage: a [C, K] and a [K, BV] tile, C x C and C x BV
        C, K, bv = self.chunk_size, shape.key_dim_pow2, self.block_v
        return 4 * (C * K + K * bv + C * C + C * bv) * max(1, self.num_stages)

    @classmethod
    def space(cls, shape: KernelShape) -> dict[str, list]:
        if shape_refusal(shape) is not None:
            return {}
        return {
            "chunk_size": list(BWD_CHUNK_SIZES),
            "block_v": [b for b in (16, 32, 64, 128) if b <= shape.value_dim_pow2],
            "num_warps": [2, 4, 8],
            "num_stages": [2, 3],
            "prepare_warps": list(PREPARE_WARPS),
            "solve": list(SOLVES),
            "dot_precision": list(DOT_PRECISIONS),
        }

    def workspace_bytes(self, w: Workload) -> int:
        """Per (sequence, head): S and dS' of every chunk ([K, V] fp32 each), U [T, V] fp32,
        phi(K) [T, K] in the products' type, the inverse [T, C] fp32 (delta rule), the
        cumulative log decay [T] fp32 (gates). (The initial state's gradient, an output, is
        formed in an fp32 buffer of the state's size and cast to the state's dtype.)"""
        K, V = w.shape.key_dim, w.shape.value_width
        dot = w.shape.input_bytes if w.shape.input_bytes == 2 else 4
        chunks = w.batch * w.heads * chunk_count(w, self.chunk_size)
        work = 2 * chunks * K * V * 4 + w.rows * (V * 4 + K * dot)
        if w.delta_rule:
            work += w.rows * self.chunk_size * 4
        if w.forget_gate:
            work += w.rows * 4
        return work

    def figures(self, w: Workload) -> CostFigures:
        # two sequential passes over the chunks (recompute, state gradient), the state crossing
        # HBM four times per chunk (S and dS' each stored and read once)
        return CostFigures(programs=chunk_programs(w, self.block_v), serial_steps=2 * chunk_count(w, self.chunk_size),
                           state_passes=4 * chunk_count(w, self.chunk_size), workspace_bytes=self.workspace_bytes(w),
                           launches=4)


def shape_refusal(shape: KernelShape) -> str | None:
    """Why this pass of the backward cannot take ``shape``, or None."""
    if not shape.whole_factor_tiles:
        return (f"key widths {shape.key_widths}: the Triton backward needs power-of-two key widths >= 16 "
                "(whole factor tiles); other widths are not implemented yet")
    if shape.key_dim > MAX_KEY_DIM:
        return (f"K = {shape.key_dim} > {MAX_KEY_DIM}: the backward keeps the state in registers; wider states "
                "are not implemented yet")
    return None


def default_backward(shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> BackwardConfig:
    """The first proposal that passes its check: C 32 (C 64 at K = 256 was estimated at ~430
    registers per thread with 8 warps), 32 value columns, 4 then 8 warps; the smallest tiles
    where nothing passes (the check then says why)."""
    bv = min(32, shape.value_dim_pow2)
    for C, warps, stages in ((64, 4, 2), (32, 4, 2), (32, 8, 2), (16, 4, 2), (16, 8, 2)):
        cfg = BackwardConfig(chunk_size=C, block_v=bv, num_warps=warps, num_stages=stages)
        if cfg.check(shape, smem_limit) is None:
            return cfg
    return BackwardConfig(chunk_size=16, block_v=16)


def supports(p: Problem, cu_seqlens) -> str | None:
    """None when the Triton backward can run the problem, else the reason (a sentence)."""
    if p.order > 4:
        return f"order {p.order}: the Triton kernels take orders 2-4"
    if p.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {p.dtype}: the Triton backward takes float16, bfloat16 and float32 inputs"
    return shape_refusal(KernelShape(p.key_widths, p.value_width, torch.empty((), dtype=p.dtype).element_size()))


# ----- the state-gradient loop -----
@triton.jit
def chunk_bwd_state_kernel(
    q1, q2, q3, k1, k2, k3, g, beta, do, dht, dh0, Ai, dHc, cu_seqlens, chunk_offsets, scale, T,
    H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
):
    """The outgoing state's gradient dS' of every chunk, in reverse, for one (sequence, head,
    value block): stored into ``dHc`` ([chunks, H, K, V] fp32; ``chunk_offsets``: each varlen
    sequence's first chunk), starting from ``dht`` (None: zeros) and ending with d(initial
    state) in ``dh0`` (None: not wanted). Per chunk dS = gamma dS' + s phi(Q)^T diag(Gamma) dO
    - phi(K)^T diag(Gamma) dR (delta rule), with dR = diag(b) T^T (s P^T dO + diag(r) phi(K)
    dS'), T from the prepare kernel's ``Ai``; phi(Q), phi(K) and P are rebuilt from the factor
    tiles (fp32). The [K, BV] gradient stays in registers."""
    K: tl.constexpr = D1 * D2 * D3
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, i_b = sequence_of_program(i_n, T, cu_seqlens)
    n_c = tl.cdiv(eos - bos, C)
    if cu_seqlens is not None:
        i_g0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        i_g0 = i_b * n_c
    o_c = tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_k = tl.arange(0, K)
    off_k = o_k[:, None] * V + o_v[None, :]
    m_s = (o_k < K)[:, None] & m_v[None, :]
    off_s = (i_n.to(tl.int64) * H + i_h) * K * V + off_k
    b_ds = tl.zeros([K, BV], dtype=tl.float32)
    if dht is not None:
        b_ds = tl.load(dht + off_s, mask=m_s, other=0.0).to(tl.float32)
    for i_r in range(0, n_c):
        i_c = n_c - 1 - i_r
        tl.store(dHc + ((i_g0 + i_c) * H + i_h) * K * V + off_k, b_ds, mask=m_s)
        tok = bos + i_c * C + o_c
        m_t = tok < eos
        r = (i_b * T + tok) * H + i_h
        b_c = chunk_log_decay(g, r, m_t, C)
        b_last = tl.sum(tl.where(o_c == C - 1, b_c, 0.0), axis=0)
        b_gam = tl.exp(b_c)
        b_q1, b_q2, b_q3, b_k1, b_k2, b_k3 = factor_tiles(q1, q2, q3, k1, k2, k3, r, m_t, NF, D1, D2, D3,
                                                          D1, D2, D3, L2NORM)
        b_P, _ = scores_from_tiles(q1, b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, b_gam, b_c, NF, C, False, False, PREC,
                                   "rows")
        b_q = phi_from_tiles(b_q1, b_q2, b_q3, NF, C, D1, D2, D3)
        b_k = phi_from_tiles(b_k1, b_k2, b_k3, NF, C, D1, D2, D3)
        b_do = tl.load(do + r[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_do = b_do.to(tl.float32)
        b_new = tl.exp(b_last) * b_ds + scale * tl.dot(tl.trans(b_q), b_gam[:, None] * b_do, input_precision=PREC)
        if beta is not None:
            b_du = scale * tl.dot(tl.trans(b_P), b_do, input_precision=PREC)
            b_du += tl.exp(b_last - b_c)[:, None] * tl.dot(b_k, b_ds, input_precision=PREC)
            b_b = tl.load(beta + r, mask=m_t, other=0.0).to(tl.float32)
            b_Ai = tl.load(Ai + ((i_b * H + i_h) * T + tok)[:, None] * C + o_c[None, :], mask=m_t[:, None],
                           other=0.0)
            b_dr = b_b[:, None] * tl.dot(tl.trans(b_Ai), b_du, input_precision=PREC)
            b_new -= tl.dot(tl.trans(b_k), b_gam[:, None] * b_dr, input_precision=PREC)
        b_ds = b_new
    if dh0 is not None:
        tl.store(dh0 + off_s, b_ds, mask=m_s)


# ----- launcher -----
def running_tensor_bwd(q, k, v, g, beta, *, scale: float, initial_state, cu_seqlens, l2norm: bool, do, dht,
                       chunk_size: int | None = None, variant=None):
    """Gradients of ``running_tensor``'s chunk form (the same math as the recurrent form):
    (dq list, dk list, dv, dg or None, dbeta or None, d(initial state) or None), each with its
    input's shape and dtype. ``do``: the output's gradient (v's shape); ``dht``: the final
    state's gradient (the state's shape) or None (no gradient into the final state).
    ``variant``: a BackwardConfig (default: the tuned table's for the shape bucket, else
    :func:`default_backward`, with ``chunk_size`` when given; see :func:`resolve_backward`). Refuses what :func:`supports` refuses, with its reason."""
    from .launch import check_layout  # launch imports the forms table, which lists this module's config

    p = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    check_layout(p, q, k, v, g, beta, initial_state, cu_seqlens)
    if (reason := supports(p, cu_seqlens)) is not None:
        raise ValueError(f"running_tensor_bwd: {reason}")
    if not isinstance(do, torch.Tensor) or tuple(do.shape) != tuple(v.shape):
        raise ValueError(f"do: expected a tensor of v's shape {tuple(v.shape)}, got "
                         f"{tuple(do.shape) if isinstance(do, torch.Tensor) else type(do).__name__}")
    if dht is not None and (not isinstance(dht, torch.Tensor) or tuple(dht.shape) != p.state_shape):
        raise ValueError(f"dht: expected None or a tensor of the state's shape {list(p.state_shape)}")
    shape = KernelShape(p.key_widths, p.value_width, v.element_size())
    config = resolve_backward(shape, variant, chunk_size, v.device, p)
    return _launch(config, p, q, k, v, g, beta, initial_state, cu_seqlens, l2norm, do.contiguous(),
                   None if dht is None else dht.contiguous())


def resolve_backward(shape: KernelShape, variant, chunk_size: int | None, device: torch.device,
                     p: Problem | None = None) -> BackwardConfig:
    """``variant`` (checked), else the tuned table's for ``p``'s shape bucket (kernel
    "chunk_bwd"; only when ``chunk_size`` is not given, as the forward's launcher does), else
    the default (with ``chunk_size`` when given). A tuned entry this version cannot read or
    that fails its check here is ignored: the table is advice."""
    limit = torch.cuda.get_device_properties(device).shared_memory_per_block_optin if device.type == "cuda" \
        else DEFAULT_SMEM_BYTES
    check_limit = limit if device.type == "cuda" else 10**9
    if variant is None and chunk_size is None and p is not None:
        variant = tuned_backward(p, device)
        if variant is not None and variant.check(shape, check_limit) is not None:
            variant = None
    if variant is None:
        variant = default_backward(shape, limit)
        if chunk_size is not None:
            variant = dataclasses.replace(variant, chunk_size=chunk_size)
    elif not isinstance(variant, BackwardConfig):
        raise TypeError(f"variant: expected a BackwardConfig, got {type(variant).__name__}")
    elif chunk_size is not None and chunk_size != variant.chunk_size:
        raise ValueError(f"chunk_size: {chunk_size} conflicts with the variant's {variant.chunk_size}; give one")
    if (reason := variant.check(shape, check_limit)) is not None:
        raise ValueError(f"variant: {variant} cannot run K={shape.key_dim}, d_v={shape.value_width}: {reason}")
    return variant


def tuned_backward(p: Problem, device: torch.device) -> BackwardConfig | None:
    """The tuned table's backward config for ``p``'s nearest shape bucket on this device, or None."""
    from . import tuned
    from .forms import config_from_dict  # forms lists this module's config: imported at call time
    from .launch import device_name

    entry = tuned.lookup("chunk_bwd", p.key_widths, p.value_width, p.heads, str(p.dtype).removeprefix("torch."),
                         device_name(device), p.batch, p.seq_len)
    if entry is None:
        return None
    try:
        config = config_from_dict(entry, "chunk_bwd")
    except (TypeError, ValueError):
        return None
    return config if isinstance(config, BackwardConfig) else None


def _launch(config: BackwardConfig, p: Problem, q, k, v, g, beta, h0, cu_seqlens, l2norm: bool, do, dht):
    B, T, H, V = v.shape
    C, K, bv, dev = config.chunk_size, p.key_dim, config.block_v, v.device
    varlen = cu_seqlens is not None
    n_chunks = [triton.cdiv(hi - lo, C) for lo, hi in p.seq_bounds] if varlen else [triton.cdiv(T, C)] * B
    idx = offsets = None
    if varlen:
        idx = chunk_indices(p, C, dev)
        offsets = torch.tensor([0, *itertools.accumulate(n_chunks)], dtype=torch.int32).to(dev)
    # 1. forward recompute: the split form's prepare kernel and state loop (every chunk's state)
    split = SplitConfig(chunk_size=C, block_v=bv, num_warps=config.num_warps, num_stages=config.num_stages,
                        prepare_warps=config.prepare_warps, solve=config.solve, dot_precision=config.dot_precision)
    ws = prepare_keys(split, p, q, k, v, g, beta, cu_seqlens=cu_seqlens, idx=idx, l2norm=l2norm)
    Hc = args.empty(sum(n_chunks), H, K, V, dtype=torch.float32, device=dev)
    Uc = args.empty(B, T, H, V, dtype=torch.float32, device=dev)
    grid_v = (triton.cdiv(V, bv), p.num_seqs * H)
    prec = config.dot_precision
    chunk_split_state_kernel[grid_v](
        v, beta, h0, None, ws["Ai"], ws["Kw"], ws["Gc"], Hc, Uc, cu_seqlens, offsets, T,
        H=H, K=K, V=V, C=C, BV=bv, LOWP=lowp_dots(v.dtype), PREC=prec, TMA=False, STRIDE=1,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    del ws["Kw"]  # phi(K) only fed the recompute
    widths = {n: w for n, w in width_args(p.key_widths, 16).items() if not n.startswith("BD")}
    # 2. the outgoing state's gradient of every chunk, in reverse; d(initial state)
    dHc = args.empty(sum(n_chunks), H, K, V, dtype=torch.float32, device=dev)
    dh0 = args.empty(p.state_shape, dtype=torch.float32, device=dev) if h0 is not None else None
    chunk_bwd_state_kernel[grid_v](
        *factor_args(q), *factor_args(k), g, beta, do, dht, dh0, ws["Ai"], dHc, cu_seqlens, offsets, p.scale, T,
        H=H, NF=len(q), **widths, V=V, C=C, BV=bv, L2NORM=l2norm, PREC=prec,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    # 3. every input's gradient, chunk-parallel
    dq = [args.empty(x.shape, dtype=x.dtype, device=dev) for x in q]
    dk = [args.empty(x.shape, dtype=x.dtype, device=dev) for x in k]
    dv = args.empty(v.shape, dtype=v.dtype, device=dev)
    dg = args.empty(g.shape, dtype=g.dtype, device=dev) if g is not None else None
    dbeta = args.empty(beta.shape, dtype=beta.dtype, device=dev) if beta is not None else None
    grid = (idx.shape[0], H) if varlen else (n_chunks[0], B * H)
    chunk_bwd_grads_kernel[grid](
        *factor_args(q), *factor_args(k), v, g, beta, do, ws["Ai"], Hc, Uc, dHc, *factor_args(dq), *factor_args(dk),
        dv, dg, dbeta, cu_seqlens, idx, p.scale, T,
        H=H, NF=len(q), **widths, V=V, C=C, BV=bv, L2NORM=l2norm, PREC=prec,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if dh0 is not None and dh0.dtype != h0.dtype:
        dh0 = dh0.to(h0.dtype)
    return dq, dk, dv, dg, dbeta, dh0
