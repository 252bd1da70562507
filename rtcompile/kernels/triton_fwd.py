"""Launchers of the Triton forward kernels: prefill (chunk or recurrent) and the decode step.

Every argument is validated before anything is allocated or launched (``check_inputs`` plus
the layout rules of the kernels below). Block sizes, warps, stages and the chunk size come
from a variant (``variants.py``): the caller's, else the default for the shape. The launchers
hold no tuning constant of their own.

Layout rule: every tensor is contiguous (as in flash-linear-attention), so one token-head row
index addresses all per-token inputs; a strided view is refused with a message, never copied
behind the caller's back. Kernels take up to three factors (orders 2 to 4).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from typing import Sequence

import torch
import triton

from . import tuned
from .chunk import (
    chunk_output_running_tensor_kernel, chunk_prepare_running_tensor_kernel, chunk_running_tensor_fwd_kernel,
    chunk_state_running_tensor_kernel,
)
from .inputs import Problem, check_inputs
from .variants import SOLVE_BLOCK, ChunkVariant, KernelShape, RecurrentVariant, next_pow2, outer_phi_ok

MAX_FACTORS = 3  # orders 2..4
MODES = ("chunk", "recurrent")
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Every output and workspace is allocated through this function, so tests can poison them
# (fill with NaN) and prove that every element a kernel should write is written.
_empty = torch.empty
# The decode output, once per token: empty_like(v) took 1.4 us against 4.3 for
# empty(v.shape, dtype=, device=) on the CPU machine (2026-11-30e), where the eager call's
# budget is 30 us. v is contiguous by then, so its copy's layout is the output's.
_empty_like = torch.empty_like


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _lowp_dots(dtype: torch.dtype) -> bool:
    """Use 16-bit tl.dot operands? Not bf16 under the interpreter (it returns garbage there)."""
    if dtype == torch.float16:
        return True
    return dtype == torch.bfloat16 and not _interpreting()


def _check_layout(p: Problem, q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    if len(q) > MAX_FACTORS:
        raise ValueError(
            f"q: {len(q)} factors (order {len(q) + 1}); allowed: the Triton kernels take orders 2-4 "
            "(1-3 factors); use the reference (backend='reference') for higher orders"
        )
    if v.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"v: dtype {v.dtype}; allowed for the Triton kernels: float16, bfloat16, float32")
    named = [(f"q[{i}]", x) for i, x in enumerate(q)] + [(f"k[{i}]", x) for i, x in enumerate(k)]
    named += [("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state), ("cu_seqlens", cu_seqlens)]
    for name, x in named:
        if x is not None and not x.is_contiguous():
            raise ValueError(
                f"{name}: strides {x.stride()} are not contiguous; allowed: contiguous tensors (call .contiguous())"
            )
    if initial_state is not None and initial_state.dtype not in STATE_DTYPES:
        raise ValueError(f"initial_state: dtype {initial_state.dtype}; allowed: float32, bfloat16, float16")
    if cu_seqlens is not None and cu_seqlens.device != v.device:
        raise ValueError(f"cu_seqlens: on {cu_seqlens.device}, v on {v.device}; allowed: the same device")
    if v.device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"v: on {v.device}; the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on the CPU)"
        )


def _factor_args(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Three factor pointers; missing ones repeat the first (never read: NF is a constexpr)."""
    return list(xs) + [xs[0]] * (MAX_FACTORS - len(xs))


def _width_args(widths: tuple[int, ...], min_block: int) -> dict[str, int]:
    ws = list(widths) + [1] * (MAX_FACTORS - len(widths))
    out = {f"D{i + 1}": w for i, w in enumerate(ws)}
    out.update({f"BD{i + 1}": max(min_block, next_pow2(w)) for i, w in enumerate(ws)})
    return out


def kernel_shape(p: Problem) -> KernelShape:
    return KernelShape(p.key_widths, p.value_width, torch.empty((), dtype=p.dtype).element_size())


@functools.lru_cache(maxsize=None)
def _smem_limit(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    """The GPU's name as tuned entries record it ("cpu-interpreter" off the GPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device.index or 0)
    return "cpu-interpreter"


def _tuned_variant(cls, p: Problem | None, shape: KernelShape, device: torch.device | None):
    """The tuned table's variant for this call, or None (no entry, or one that cannot run)."""
    if p is None or device is None:
        return None
    entry = tuned.lookup(cls.kernel, p.key_widths, p.value_width, p.heads, str(p.dtype).removeprefix("torch."),
                         device_name(device), p.batch, p.seq_len)
    if entry is None:
        return None
    try:
        return cls.from_dict(entry)
    except (TypeError, ValueError):
        return None


# Every eager call resolves its variant; the default's search and the resource checks are pure
# functions of (variant, shape, limit), and were ~45% of the chunk call's own Python time
# (profiled on the CPU with the launches stubbed out: ~98 us per call before).
@functools.lru_cache(maxsize=4096)
def _reason(variant, shape: KernelShape, limit: int | None) -> str | None:
    return variant.check(shape) if limit is None else variant.check(shape, limit)


@functools.lru_cache(maxsize=1024)
def _default(cls, shape: KernelShape, limit: int | None):
    return cls.default(shape) if limit is None else cls.default(shape, limit)


def _resolve_variant(cls, variant, shape: KernelShape, device: torch.device | None = None,
                     problem: Problem | None = None, **overrides):
    """The caller's variant, else the tuned table's for this shape bucket, else the default."""
    limit = _smem_limit(device.index or 0) if device is not None and device.type == "cuda" else None
    chosen = variant is None  # not the caller's: adapted to the device where it must be
    if variant is None and not overrides:  # an explicit chunk_size asks for the default's family
        variant = _tuned_variant(cls, problem, shape, device)
        if variant is not None and _reason(variant, shape, limit):
            variant = None  # an entry that cannot run here: the table is advice, not a contract
    if variant is None:
        variant = _default(cls, shape, limit)
        if overrides:
            variant = type(variant)(**{**variant.__dict__, **overrides})
    elif not isinstance(variant, cls):
        raise TypeError(f"variant: expected {cls.__name__}, got {type(variant).__name__}")
    reason = _reason(variant, shape, limit)
    if reason is None and getattr(variant, "tma", False) and device is not None and device.type == "cuda" \
            and torch.cuda.get_device_capability(device) < (9, 0):
        if chosen:  # the default's or the table's choice: the same variant without tensor descriptors
            variant = dataclasses.replace(variant, tma=False)
            reason = _reason(variant, shape, limit)
        else:
            reason = "tma needs a GPU with tensor memory access (sm_90 or newer)"
    if reason is not None:
        raise ValueError(f"variant: {variant} cannot run K={shape.key_dim}, d_v={shape.value_width}: {reason}")
    return variant


def _chunk_indices(p: Problem, C: int, device: torch.device) -> torch.Tensor:
    pairs = [(n, c) for n, (lo, hi) in enumerate(p.seq_bounds) for c in range(triton.cdiv(hi - lo, C))]
    return torch.tensor(pairs, dtype=torch.int32).to(device)


# the solve's form as the kernels' SOLVE constexpr (chunk.py, _scores_from_tiles)
SOLVE_CODES = {"rows": 0, "blocks": 1, "diagonal": 2, "tiles": 3}


def _launch_chunk(p: Problem, q, k, v, g, beta, *, h0, ht, cu_seqlens, l2norm, store_ht: bool,
                  variant: ChunkVariant, resident: bool) -> torch.Tensor:
    """``resident``: the variant keeps the state in registers at this shape (its caller knows)."""
    B, T, H, V = v.shape
    C = variant.chunk_size
    o = _empty(B, T, H, V, dtype=v.dtype, device=v.device)
    dummy = v
    widths = _width_args(p.key_widths, 16)  # tl.dot needs >= 16 on every axis
    common = dict(H=H, NF=len(q), **widths, USE_G=g is not None, USE_BETA=beta is not None,
                  L2NORM=l2norm, IS_VARLEN=cu_seqlens is not None, LOWP=_lowp_dots(v.dtype),
                  PREC=variant.dot_precision,
                  SOLVE=SOLVE_CODES[variant.solve], SOLVE_BLOCK=variant.solve_block)
    g_arg = g if g is not None else dummy
    beta_arg = beta if beta is not None else dummy
    cu_arg = cu_seqlens if cu_seqlens is not None else dummy
    if variant.output_pass and resident:
        return _launch_chunk_output_pass(p, q, k, v, g_arg, beta_arg, cu_arg, o, h0=h0, ht=ht, store_ht=store_ht,
                                         variant=variant, common=common)
    P = Ai = W = U0 = dummy
    wy = variant.wy and beta is not None  # without the delta rule there is no solve to move
    outer = outer_phi_ok(p.key_widths, variant.block_k)
    if not variant.fuse_prepare:
        P = _empty(B, H, T, C, dtype=torch.float32, device=v.device)
        if wy:  # W in the dot operand type (16-bit inputs: their own), U0 in fp32
            W = _empty(B, H, T, p.key_dim, dtype=_dot_dtype(v, common), device=v.device)
            U0 = _empty(B, H, T, V, dtype=torch.float32, device=v.device)
        if beta is not None and (not wy or variant.solve == "tiles"):  # with wy, only the tile solve's
            Ai = _empty(B, H, T, C, dtype=torch.float32, device=v.device)
        if cu_seqlens is not None:
            idx = _chunk_indices(p, C, v.device)
            grid = (idx.shape[0], H)
        else:
            idx = dummy
            grid = (triton.cdiv(T, C), B * H)
        chunk_prepare_running_tensor_kernel[grid](
            *_factor_args(q), *_factor_args(k), v, g_arg, beta_arg, P, Ai, W, U0, dummy, dummy, cu_arg, idx, T, 0, C=C,
            K=p.key_dim, V=V, BK=variant.block_k, BV=max(16, next_pow2(V)), WY=wy, OUTER=outer, **common,
            num_warps=variant.prepare_warps, num_stages=variant.num_stages,
        )
    grid = (triton.cdiv(V, variant.block_v), p.num_seqs * H)
    # the solve runs in the sequential kernel only when fused: otherwise one compiled sequential
    # kernel serves every solve setting of the prepare kernel
    seq_common = common if variant.fuse_prepare else {**common, "SOLVE": 0, "SOLVE_BLOCK": SOLVE_BLOCK}
    if variant.fuse_prepare and variant.solve == "tiles" and beta is not None:
        # the fused tile solve's scratch: one [C, C] per program, whatever T (2 MiB at B8 H8 C64 BV32)
        Ai = _empty(grid[0] * grid[1], C, C, dtype=torch.float32, device=v.device)
    chunk_running_tensor_fwd_kernel[grid](
        *_factor_args(q), *_factor_args(k), v, g_arg, beta_arg, o,
        h0 if h0 is not None else dummy, ht if ht is not None else dummy, P, Ai, W, U0, cu_arg,
        p.scale, T,
        K=p.key_dim, V=V, C=C, BK=variant.block_k, BV=variant.block_v,
        USE_H0=h0 is not None, STORE_HT=store_ht, FUSE_PREPARE=variant.fuse_prepare,
        # prefetch means the next chunk's inputs with the state in registers, the next state
        # tile with a streamed state
        OUTER=outer, PREFETCH=variant.prefetch and resident, WY=wy,
        PREFETCH_STATE=variant.prefetch and not resident, MERGE_PASSES=variant.merge_passes and not resident,
        KRON=variant.kron and not resident,
        # The fused prepare keeps its Grams, solve and score products in fp32: with 16-bit
        # operands there, (C=64, BK=128, 8 warps, order 3 64x64) returned wrong results and then
        # an illegal address on an H200 (Triton 3.6, 2026-11-29); fp32 was verified there.
        LOWP_SCORES=common["LOWP"] and not variant.fuse_prepare,
        **seq_common,
        num_warps=variant.num_warps, num_stages=variant.num_stages,
    )
    return o


def _dot_dtype(v: torch.Tensor, common: dict) -> torch.dtype:
    """The type the kernels' products take operands in, and their 16-bit workspaces are kept in:
    16-bit inputs their own (LOWP), else fp32 (``variants.dot_operand_bytes`` is its size, for
    the checks and the cost model)."""
    return v.dtype if common["LOWP"] else torch.float32


def _launch_chunk_output_pass(p: Problem, q, k, v, g_arg, beta_arg, cu_arg, o, *, h0, ht, store_ht: bool,
                              variant: ChunkVariant, common: dict) -> torch.Tensor:
    """The three-kernel form (``ChunkVariant.output_pass``): Ai in parallel (delta rule only),
    the state-only sequential loop, then the outputs of all chunks in parallel. Workspace: the
    incoming state of every chunk ([chunks, H, K, V]) and U ([B, T, H, V]), both in the dot
    operand type, and Ai ([B, H, T, C] fp32) with the delta rule (with ``wy``, W [B, H, T, K]
    in the dot type and U0 [B, H, T, V] fp32 instead, and Ai only for the tile solve).

    With ``segments`` > 1 (not varlen) the chunks are cut into that many time segments, each
    with its three launches; on a GPU the prepare and output launches go to two side streams,
    so segment g's state loop, which keeps few SMs busy, can overlap segment g + 1's prepare and
    segment g - 1's outputs. The state is handed from segment to segment through ``ht`` (a
    buffer of its own when the caller wants no final state)."""
    B, T, H, V = v.shape
    C = variant.chunk_size
    varlen = common["IS_VARLEN"]
    dot_dtype = _dot_dtype(v, common)
    n_chunks = [triton.cdiv(hi - lo, C) for lo, hi in p.seq_bounds] if varlen else [triton.cdiv(T, C)] * B
    # the incoming state of every state_stride-th chunk of each sequence
    n_states = [triton.cdiv(n, variant.state_stride) for n in n_chunks]
    Hc = _empty(sum(n_states), H, p.key_dim, V, dtype=dot_dtype, device=v.device)
    Uc = _empty(B, T, H, V, dtype=dot_dtype, device=v.device)
    Ai = Kw = W = U0 = v  # placeholders without the delta rule / stored keys / wy (never read)
    wy = variant.wy and common["USE_BETA"]
    idx = offsets = v
    if varlen:
        idx = _chunk_indices(p, C, v.device)
        offsets = torch.tensor([0, *itertools.accumulate(n_states)], dtype=torch.int32).to(v.device)
    if variant.stored_keys:
        Kw = _empty(B, H, T, p.key_dim, dtype=dot_dtype, device=v.device)
    if wy:
        W = _empty(B, H, T, p.key_dim, dtype=dot_dtype, device=v.device)
        U0 = _empty(B, H, T, V, dtype=torch.float32, device=v.device)
    if common["USE_BETA"] and (not wy or variant.solve == "tiles"):
        Ai = _empty(B, H, T, C, dtype=torch.float32, device=v.device)
    Kd, Hd, Ad = Kw, Hc, Ai  # tma: the state loop reads phi(K) and stores each chunk's
    # state (and reads the inverse) through tensor descriptors
    if variant.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        Kd = TensorDescriptor(Kw.view(B * H * T, p.key_dim), [B * H * T, p.key_dim], [p.key_dim, 1], [C, p.key_dim])
        Hd = TensorDescriptor(Hc.view(-1, V), [Hc.numel() // V, V], [V, 1], [p.key_dim, variant.block_v])
        if common["USE_BETA"] and not wy:
            Ad = TensorDescriptor(Ai.view(B * H * T, C), [B * H * T, C], [C, 1], [C, C])
    # the prepare kernel (when it runs) also stores each chunk's cumulative log decay, which the
    # state loop and the output kernel then read instead of scanning the gates themselves
    has_prepare = common["USE_BETA"] or variant.stored_keys
    load_gc = has_prepare and common["USE_G"]
    Gc = _empty(B, H, T, dtype=torch.float32, device=v.device) if load_gc else v
    # time segments: [c_lo, c_hi) chunk ranges of every sequence (one range, all chunks, with varlen)
    n_max = idx.shape[0] if varlen else n_chunks[0]
    per = triton.cdiv(n_max, 1 if varlen else variant.segments)
    ranges = [(lo, min(lo + per, n_max)) for lo in range(0, n_max, per)]
    if len(ranges) > 1 and ht is None:  # the hand-off buffer between segments
        ht = _empty(p.state_shape, dtype=torch.float32, device=v.device)
    state_consts = {n: common[n] for n in ("H", "NF", "D1", "D2", "D3", "USE_G", "USE_BETA", "L2NORM", "IS_VARLEN",
                                           "LOWP", "PREC")}
    out_consts = {n: v_ for n, v_ in state_consts.items() if n != "USE_BETA"}
    heads = p.num_seqs * H if not varlen else H  # the chunk-parallel grids' second axis

    def prepare(lo: int, hi: int) -> None:
        if has_prepare:
            chunk_prepare_running_tensor_kernel[(hi - lo, heads)](
                *_factor_args(q), *_factor_args(k), v, g_arg, beta_arg, v, Ai, W, U0, Kw, Gc, cu_arg, idx, T, lo, C=C,
                K=p.key_dim, V=V, BK=variant.block_k, BV=max(16, next_pow2(V)), WY=wy, OUTER=True,
                STORE_P=False, STORE_PHI=variant.stored_keys, COLUMNS=True, STORE_GC=load_gc,
                KEY_GROUP=variant.key_group, **common,
                num_warps=variant.prepare_warps, num_stages=variant.num_stages,
            )

    def state(seg: int, lo: int, hi: int) -> None:
        first, last = seg == 0, seg == len(ranges) - 1
        s0 = h0 if first else ht  # later segments start from the state the one before stored
        chunk_state_running_tensor_kernel[(triton.cdiv(V, variant.block_v), p.num_seqs * H)](
            *_factor_args(k), v, g_arg, beta_arg, s0 if s0 is not None else v, ht if ht is not None else v, Ad, Kd,
            W, U0, Gc, Hd, Uc, cu_arg, offsets, T, lo, hi if not varlen else 2**31 - 1, K=p.key_dim, V=V, C=C,
            BV=variant.block_v, USE_H0=s0 is not None, STORE_HT=store_ht or not last, PREFETCH=variant.prefetch,
            STORED_KEYS=variant.stored_keys, WY=wy, LOAD_GC=load_gc, TMA=variant.tma, STRIDE=variant.state_stride,
            **state_consts, num_warps=variant.num_warps, num_stages=variant.num_stages,
        )

    def output(lo: int, hi: int) -> None:
        chunk_output_running_tensor_kernel[(hi - lo, heads, triton.cdiv(V, variant.output_block_v))](
            *_factor_args(q), *_factor_args(k), g_arg, Gc, o, Hc, Uc, cu_arg, idx, offsets, p.scale, T, lo,
            K=p.key_dim, V=V, C=C, BV=variant.output_block_v, LOAD_GC=load_gc, STRIDE=variant.state_stride,
            **out_consts, num_warps=variant.output_warps, num_stages=variant.num_stages,
        )

    if len(ranges) == 1 or v.device.type != "cuda":
        for seg, (lo, hi) in enumerate(ranges):
            prepare(lo, hi)
            state(seg, lo, hi)
            output(lo, hi)
        return o
    main = torch.cuda.current_stream(v.device)
    side_prepare, side_output = _side_streams(v.device)
    side_prepare.wait_stream(main)
    side_output.wait_stream(main)
    prepared = []
    with torch.cuda.stream(side_prepare):
        for lo, hi in ranges:
            prepare(lo, hi)
            prepared.append(side_prepare.record_event())
    for seg, (lo, hi) in enumerate(ranges):
        main.wait_event(prepared[seg])
        state(seg, lo, hi)
        side_output.wait_event(main.record_event())
        with torch.cuda.stream(side_output):
            output(lo, hi)
    main.wait_stream(side_output)  # everything after this call is ordered after every segment
    return o


@functools.cache
def _side_streams(device: torch.device) -> tuple:
    """Two side streams per device for the segmented three-kernel form (created once: a stream
    is a driver object, not something to make per call)."""
    return torch.cuda.Stream(device), torch.cuda.Stream(device)


def running_tensor_fwd(
    q: Sequence[torch.Tensor],
    k: Sequence[torch.Tensor],
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    l2norm: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    mode: str = "chunk",
    chunk_size: int | None = None,
    variant: ChunkVariant | RecurrentVariant | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prefill with the Triton kernels; same contract as :func:`rtcompile.running_tensor`.

    ``mode="chunk"`` runs the chunk-parallel kernels with a :class:`ChunkVariant`,
    ``mode="recurrent"`` the fused recurrent scan with a :class:`RecurrentVariant`. The final
    state is fp32 (the initial state may be fp32, bf16 or fp16).
    """
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode: got {mode!r}; allowed: {', '.join(MODES)}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)):
        raise TypeError(f"chunk_size: expected an int or None, got {type(chunk_size).__name__}")
    p = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    return fwd_checked(p, q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                       l2norm=l2norm, cu_seqlens=cu_seqlens, mode=mode, chunk_size=chunk_size, variant=variant)


def fwd_checked(
    p: Problem,
    q: Sequence[torch.Tensor],
    k: Sequence[torch.Tensor],
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    *,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    l2norm: bool,
    cu_seqlens: torch.Tensor | None,
    mode: str,
    chunk_size: int | None,
    variant: ChunkVariant | RecurrentVariant | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`running_tensor_fwd` after its argument checks. Invariant: ``p`` is what
    ``check_inputs`` returned for these very tensors, and ``mode``/``chunk_size`` passed the
    public checks (``rtcompile.running_tensor`` has done both; checking again cost ~27 us of
    its ~84 us of Python per call on the CPU machine). Layout and variant are checked here."""
    if mode == "recurrent":  # moved to recurrent.py, run through launch.py with the config
        from .launch import fwd_checked as run

        return run(p, q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                   l2norm=l2norm, cu_seqlens=cu_seqlens, mode=mode, chunk_size=None, variant=_config(variant))
    _check_layout(p, q, k, v, g, beta, initial_state, cu_seqlens)
    shape = kernel_shape(p)
    over = {} if chunk_size is None else {"chunk_size": chunk_size}
    var = _resolve_variant(ChunkVariant, variant, shape, v.device, p, **over)
    if chunk_size is not None and var.chunk_size != chunk_size:
        raise ValueError(f"chunk_size: {chunk_size} conflicts with the variant's {var.chunk_size}; give one")
    streamed = not var.resident(shape)
    # A streamed state lives in the final-state buffer while the kernel runs.
    need_ht = output_final_state or streamed
    ht = _empty(p.state_shape, dtype=torch.float32, device=v.device) if need_ht else None
    o = _launch_chunk(p, q, k, v, g, beta, h0=initial_state, ht=ht, cu_seqlens=cu_seqlens, l2norm=l2norm,
                      store_ht=need_ht, variant=var, resident=not streamed)
    return o, (ht if output_final_state else None)


def _config(variant):
    """The RecurrentConfig of a pre-redesign RecurrentVariant (None stays None)."""
    from .recurrent import RecurrentConfig

    if variant is None or isinstance(variant, RecurrentConfig):
        return variant
    if not isinstance(variant, RecurrentVariant):
        raise TypeError(f"variant: expected RecurrentVariant, got {type(variant).__name__}")
    return RecurrentConfig(**dataclasses.asdict(variant))


def running_tensor_decode_(
    q: Sequence[torch.Tensor],
    k: Sequence[torch.Tensor],
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    *,
    state_cache: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    l2norm: bool = False,
    validate: bool = True,
    variant: RecurrentVariant | None = None,
) -> torch.Tensor:
    """One decode step for N sequences, updating ``state_cache`` in place.

    Args:
        q, k, v, g, beta: as :func:`running_tensor_fwd` with B = N sequences and T = 1.
        state_cache: ``[slots, H, d_1, ..., d_{o-1}, d_v]`` (fp32, bf16 or fp16), contiguous.
        state_indices: int32 ``[N]``: the cache row of each sequence; a negative entry is
            padding (its state is neither read nor written, its output is meaningless).
        validate: check that indices are in range and distinct (one device sync). Turn off
            inside CUDA graphs and hot loops whose indices are known good.

    Returns:
        o ``[N, 1, H, d_v]`` in v's dtype.
    """
    from .launch import running_tensor_decode_ as run  # moved to recurrent.py / launch.py

    return run(q, k, v, g, beta, state_cache=state_cache, state_indices=state_indices, scale=scale, l2norm=l2norm,
               validate=validate, variant=_config(variant))
