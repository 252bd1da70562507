"""A dense layer's whole decode step around the state update, in one kernel.

The serving step of a layer with the dense projection (``RunningTensorLayer``) launches, besides
its matrix products, the decode kernel and the pointwise work on either side of it: the short
convolution's weighted sum over the carried tail and the tail's shift, SiLU, the query-skip
blend, log-sigmoid of the forget gate, sigmoid of beta (inductor fuses those into two or three
kernels), and after it the RMS norm and the SiLU output gate (one more). At B256 on the H200
those took 16.6 of the compiled example model's 237 us step (``profile_decode.py``, 0bdb947),
each a latency-bound launch on ~1 MB. Here one program per (sequence, head) does all of it:

1. the state slab's load is issued first (it is what the step waits on: 64 KiB at K 256);
2. the head's channels of the stacked projection ``pre`` (q factors, k factors, v) are read with
   their tail window, convolved, passed through SiLU and the skip blend; the tail is shifted in
   place after a barrier (every thread's window read first); the decay is sigmoid(forget) (=
   exp(log-sigmoid)), beta sigmoid(beta);
3. phi(k), phi(q) and v are gathered from those channels in registers (``tl.gather``; an earlier
   version passed them through a global workspace: 1% slower at B256, see TWO_PROGRAM_REGISTERS)
   and the decode kernel's token update (``recurrent.token_update``) runs on the slab;
4. the output is normalised and gated before it is stored, when the layer has the output gate.

So the slab must be resident and one program must hold a head's whole value row (the norm is over
d_v, and the tail's q / k channels are shared by the head's value tiles): :func:`eligible`. A
config that is not runs the unfused step. The decode config is the decode kernel's own
(``launch.resolve_config`` of the same problem: the tuned table, else the default with its batch
rule), its value tile widened to d_v where narrower (``forms.covering_tile``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from ..fields import dtype_error
from . import args
from .blocks import load_state_tile
from .config import KernelShape, next_pow2
from .inputs import Problem
from .launch_cache import cached
from .recurrent import RecurrentConfig, slot_mask, state_slab, token_update

ABSENT = -1  # a layout column of a map the layer does not have
# Registers a thread may take (Triton's maxnreg) by (block_k, block_v, warps), so that two
# programs share an SM's 65536: the [256, 64] tile at 8 warps took 139 registers uncapped, one
# program an SM (H100 B256: 113.6 us a layer against 97.9 capped, same process); capped at 128 it
# compiles without spills (offline probe, Triton 3.6, sm_90). Only where measured: at 8 warps the
# cap spills 120 / 136 bytes for [512, 32] / [1024, 16] tiles, and at 16 warps ([256, 64]: 64) 88.
TWO_PROGRAM_REGISTERS = {(256, 64, 8): 128}


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Where a dense layer's inputs sit in its stacked projection ``pre`` [N, columns]: the
    projection's channels first (q factors, k factors, v: each H x width, heads outermost, as
    ``RunningTensorLayer.widths``), then the forget, beta, skip and gate columns where the layer
    has them (``ABSENT`` where not). ``conv_width`` 0: no short convolution (and no SiLU)."""

    heads: int
    key_widths: tuple[int, ...]
    value_width: int
    conv_width: int
    forget_col: int
    beta_col: int
    skip_col: int
    gate_col: int

    @property
    def channels(self) -> int:
        """The projection's channels (the convolution tail's last dimension)."""
        return self.heads * (2 * sum(self.key_widths) + self.value_width)

    def to_list(self) -> list[int]:
        """As a custom op's int list: heads, conv width, the four columns, d_v, then the widths."""
        return [self.heads, self.conv_width, self.forget_col, self.beta_col, self.skip_col, self.gate_col,
                self.value_width, *self.key_widths]

    @classmethod
    def from_list(cls, xs: list[int]) -> "StepLayout":
        """:meth:`to_list`'s inverse; ValueError naming ``layout`` for a list it cannot have made."""
        if (len(xs) not in (8, 9, 10) or not all(isinstance(x, int) for x in xs) or min(xs[0], xs[6], *xs[7:]) < 1
                or xs[1] < 0 or min(xs[2:6]) < ABSENT):
            raise ValueError(f"layout: got {xs}; allowed: StepLayout.to_list()'s [heads, conv width, forget, beta, "
                             "skip, gate columns (-1: absent), d_v, 1 to 3 key widths]")
        return cls(xs[0], tuple(xs[7:]), xs[6], xs[1], xs[2], xs[3], xs[4], xs[5])

    def kernel_shape(self) -> KernelShape:
        return KernelShape(self.key_widths, self.value_width)


def eligible(config: RecurrentConfig, layout: StepLayout) -> bool:
    """Can ``config`` run the fused step? Its slab resident (block_k covers K), as [K, block_v]
    (not ``outer_phi``'s factored slab), and its value tile covering d_v (one program a head:
    the norm and the shared tail channels need that)."""
    return (config.block_k >= math.prod(layout.key_widths) and config.block_v >= layout.value_width
            and not config.outer_phi and config.check(layout.kernel_shape()) is None)


def problem(layout: StepLayout, batch: int, scale: float, dtype: torch.dtype, device) -> Problem:
    """The decode kernel's problem for ``batch`` sequences of this layout (T = 1)."""
    return Problem(batch, 1, layout.heads, tuple(layout.key_widths), layout.value_width, batch, None, scale, dtype,
                   torch.device(device))


@triton.jit
def _stream_columns(o_j, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
                    SQ: tl.constexpr, V: tl.constexpr):
    """For a head's channel ``o_j`` (its q factors, k factors, then v, back to back; ``SQ`` the
    q factors' total width): the start of its stream within the head's channels and the stream's
    width. The channel's column in the projection is then H start + i_h width + (o_j - start)."""
    in_k = o_j >= SQ
    jj = tl.where(in_k, o_j - SQ, o_j)
    b_start = tl.zeros_like(o_j)
    b_width = tl.zeros_like(o_j) + D1
    if NF > 1:
        b_start = tl.where(jj >= D1, D1, b_start)
        b_width = tl.where(jj >= D1, D2, b_width)
    if NF > 2:
        b_start = tl.where(jj >= D1 + D2, D1 + D2, b_start)
        b_width = tl.where(jj >= D1 + D2, D3, b_width)
    b_start = tl.where(in_k, b_start + SQ, b_start)
    in_v = o_j >= 2 * SQ
    b_start = tl.where(in_v, 2 * SQ, b_start)
    b_width = tl.where(in_v, V, b_width)
    return b_start, b_width


@triton.jit
def _factor_gather(b_x, o_k, m_k, S: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                   D3: tl.constexpr):
    """Raw phi over the key rows ``o_k`` from the factors held in the channel vector ``b_x`` at
    channels S, S + D1, S + D1 + D2 (register gathers: phi is never stored)."""
    b_phi = tl.gather(b_x, tl.where(m_k, S + o_k // (D2 * D3), 0), axis=0)
    if NF > 1:
        b_phi *= tl.gather(b_x, tl.where(m_k, S + D1 + (o_k // D3) % D2, 0), axis=0)
    if NF > 2:
        b_phi *= tl.gather(b_x, tl.where(m_k, S + D1 + D2 + o_k % D3, 0), axis=0)
    return tl.where(m_k, b_phi, 0.0)


@triton.jit
def _inv_norm(b_x, b_start, S: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr):
    """1 / ||phi|| of the factors at channels S, S + D1, S + D1 + D2 of ``b_x``: the product of the
    factors' 1 / ||x_i|| (blocks.phi_inv_norm's, over channel segments)."""
    b_sq = b_x * b_x
    b_r = tl.rsqrt(tl.sum(tl.where(b_start == S, b_sq, 0.0), axis=0) + 1e-6)
    if NF > 1:
        b_r *= tl.rsqrt(tl.sum(tl.where(b_start == S + D1, b_sq, 0.0), axis=0) + 1e-6)
    if NF > 2:
        b_r *= tl.rsqrt(tl.sum(tl.where(b_start == S + D1 + D2, b_sq, 0.0), axis=0) + 1e-6)
    return b_r


@triton.jit
def fused_layer_decode_step_kernel(
    pre, tail, conv_w, norm_w, y, state, state_indices,
    scale, num_slots, stride_pre,
    H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    SQ: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BJ: tl.constexpr,
    CW: tl.constexpr, BW: tl.constexpr,
    FORGET_COL: tl.constexpr, BETA_COL: tl.constexpr, SKIP_COL: tl.constexpr, GATE_COL: tl.constexpr,
    L2NORM: tl.constexpr, STREAM_HINTS: tl.constexpr,
):
    # None inputs are constexpr flags: no conv_w (no convolution, no SiLU, no tail), no norm_w (no
    # output norm and gate); a column < 0 is a map the layer does not have (no forget gate, no
    # delta rule, no query skip).
    K: tl.constexpr = D1 * D2 * D3
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    slot = tl.load(state_indices + i_n).to(tl.int64)
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    # 1. the slab first: the rest of the step hides under its load
    off_s, m_s = state_slab(slot, i_h, o_v, slot_mask(slot, m_v, num_slots, BV), H, NF, D1, D2, D3, V, BK, False)
    b_s = load_state_tile(state, state, off_s, m_s, True, True, STREAM_HINTS)

    # 2. the head's channels: window [BW taps, BJ channels], the last tap this token's input
    p_pre = pre + i_n.to(tl.int64) * stride_pre
    o_j = tl.arange(0, BJ)
    b_start, b_width = _stream_columns(o_j, NF, D1, D2, D3, SQ, V)
    m_j = o_j < 2 * SQ + V
    col = H * b_start + i_h * b_width + (o_j - b_start)
    b_x = tl.load(p_pre + col, mask=m_j, other=0.0).to(tl.float32)
    CH: tl.constexpr = H * (2 * SQ + V)
    if conv_w is not None:
        o_t = tl.arange(0, BW)
        p_tail = tail + i_n.to(tl.int64) * ((CW - 1) * CH) + o_t[:, None] * CH + col[None, :]
        b_win = tl.load(p_tail, mask=(o_t < CW - 1)[:, None] & m_j[None, :], other=0.0)
        b_win = tl.where((o_t == CW - 1)[:, None], b_x[None, :].to(b_win.dtype), b_win)
        b_cw = tl.load(conv_w + col[None, :] * CW + o_t[:, None], mask=(o_t < CW)[:, None] & m_j[None, :], other=0.0)
        b_x = tl.sum(b_win.to(tl.float32) * b_cw.to(tl.float32), axis=0)
        b_x = b_x * tl.sigmoid(b_x)
        # every thread's window read before any tap moves: tap t <- tap t + 1, the last <- the input
        tl.debug_barrier()
        tl.store(p_tail - CH, b_win, mask=(o_t >= 1)[:, None] & (o_t < CW)[:, None] & m_j[None, :])
    if SKIP_COL >= 0:  # q_i <- s_i q_i + (1 - s_i), s_i = sigmoid(skip) of the channel's factor
        in_q = o_j < SQ
        factor = (b_start >= D1).to(tl.int32) + (b_start >= D1 + D2).to(tl.int32)
        b_sk = tl.sigmoid(tl.load(p_pre + SKIP_COL + i_h * NF + factor, mask=in_q & m_j, other=0.0).to(tl.float32))
        b_x = tl.where(in_q, b_sk * b_x + (1.0 - b_sk), b_x)
    b_a = 1.0  # exp(log-sigmoid(f)) = sigmoid(f)
    if FORGET_COL >= 0:
        b_a = tl.sum(tl.sigmoid(tl.load(p_pre + FORGET_COL + i_h + tl.arange(0, 1)).to(tl.float32)), axis=0)
    b_beta = 1.0
    if BETA_COL >= 0:
        b_beta = tl.sum(tl.sigmoid(tl.load(p_pre + BETA_COL + i_h + tl.arange(0, 1)).to(tl.float32)), axis=0)

    # 3. phi(k), phi(q) and v gathered from the channels in registers; the decode kernel's update
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_k = _factor_gather(b_x, o_k, m_k, SQ, NF, D1, D2, D3)
    b_q = _factor_gather(b_x, o_k, m_k, 0, NF, D1, D2, D3)
    if L2NORM:
        b_k = b_k * _inv_norm(b_x, b_start, SQ, NF, D1, D2)
        b_q = b_q * _inv_norm(b_x, b_start, 0, NF, D1, D2)
    b_v = tl.gather(b_x, tl.where(m_v, 2 * SQ + o_v, 0), axis=0)
    b_s, b_o = token_update(b_s, b_k, b_q, b_v, b_a, b_beta, scale, BETA_COL >= 0)
    if STREAM_HINTS:
        tl.store(state + off_s, b_s.to(state.dtype.element_ty), mask=m_s, cache_modifier=".cs")
    else:
        tl.store(state + off_s, b_s.to(state.dtype.element_ty), mask=m_s)
    # 4. RMS norm over d_v, its weight, then the SiLU gate (RunningTensorLayer.mixer_output)
    if norm_w is not None:
        b_ms = tl.sum(tl.where(m_v, b_o * b_o, 0.0), axis=0) / V
        b_o = b_o * tl.rsqrt(b_ms + 1e-6) * tl.load(norm_w + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_gt = tl.load(p_pre + GATE_COL + i_h * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_o = b_o * (b_gt * tl.sigmoid(b_gt))
    tl.store(y + i_nh.to(tl.int64) * V + o_v, b_o.to(y.dtype.element_ty), mask=m_v)


def _tensor(name: str, x, shape: tuple | None, dtypes: tuple, device) -> None:
    """TypeError / ValueError naming ``name`` unless ``x`` is a contiguous tensor of ``shape``
    (None: any) in one of ``dtypes`` on ``device``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise dtype_error(name, x.dtype, ', '.join(map(str, dtypes)))
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {list(x.shape)}; allowed: {list(shape)} (the layer's layout)")
    if not x.is_contiguous():
        raise ValueError(f"{name}: strides {x.stride()} are not contiguous; allowed: a contiguous tensor")
    if x.device != device:
        raise ValueError(f"{name}: on {x.device}, pre on {device}; allowed: one device")


def check_step_inputs(layout: StepLayout, pre, tail, conv_weight, norm_weight, state, state_indices) -> None:
    """The fused step's arguments against ``layout``, on the host only (no sync: the indices'
    values are not read; a negative or past-the-cache index is skipped by the kernel): TypeError
    or ValueError naming the argument, before anything is launched."""
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if not isinstance(pre, torch.Tensor) or pre.dim() != 2:
        got = list(pre.shape) if isinstance(pre, torch.Tensor) else type(pre).__name__
        raise ValueError(f"pre: got {got}; allowed: the stacked projection [N, columns], a torch.Tensor")
    N, H, V, widths = pre.shape[0], layout.heads, layout.value_width, layout.key_widths
    ends = [layout.channels] + [c + n for c, n in ((layout.forget_col, H), (layout.beta_col, H),
                                                    (layout.skip_col, H * len(widths)), (layout.gate_col, H * V))
                                if c != ABSENT]
    if pre.shape[1] < max(ends) or pre.stride(1) != 1 or pre.dtype not in floats:
        raise ValueError(f"pre: shape {list(pre.shape)}, strides {pre.stride()}, {pre.dtype}; allowed: at least "
                         f"{max(ends)} columns (the layout's), contiguous rows, float32 / bfloat16 / float16")
    device = pre.device
    if layout.conv_width:
        _tensor("tail", tail, (N, layout.conv_width - 1, layout.channels), floats, device)
        _tensor("conv_weight", conv_weight, (layout.channels, layout.conv_width), floats, device)
    if layout.gate_col != ABSENT:
        _tensor("norm_weight", norm_weight, (V,), floats, device)
    _tensor("state_cache", state, None, floats, device)
    if tuple(state.shape[1:]) != (H, *widths, V):
        raise ValueError(f"state_cache: shape {list(state.shape)}; allowed: [slots, {H}, "
                         f"{', '.join(map(str, widths))}, {V}]")
    _tensor("state_indices", state_indices, (N,), (torch.int32, torch.int64), device)


def launch(config: RecurrentConfig, layout: StepLayout, pre: torch.Tensor, tail: torch.Tensor | None,
           conv_weight: torch.Tensor | None, norm_weight: torch.Tensor | None, state: torch.Tensor,
           state_indices: torch.Tensor, *, scale: float, l2norm: bool) -> torch.Tensor:
    """One decode step of a dense layer: ``pre`` [N, columns] (the stacked projection's output,
    its rows contiguous), ``tail`` [N, w - 1, channels] and ``state`` [slots, H, d_1, ..., d_v]
    updated in place; returns the mixer's output after the norm and gate, [N, H d_v] in
    ``pre``'s dtype. Inputs pass :func:`check_step_inputs` (the op calls it); ``config``
    passes :func:`eligible`."""
    N, H = pre.shape[0], layout.heads
    widths = layout.key_widths
    per_head = 2 * sum(widths) + layout.value_width
    y = args.empty(N, H * layout.value_width, dtype=pre.dtype, device=pre.device)
    conv = layout.conv_width > 0
    tile = (config.block_k, config.block_v, config.num_warps)
    cached(fused_layer_decode_step_kernel)[(N * H,)](
        pre, tail if conv else None, conv_weight if conv else None,
        norm_weight if layout.gate_col != ABSENT else None, y, state, state_indices,
        scale, state.shape[0], pre.stride(0),
        H=H, NF=len(widths), D1=widths[0], D2=(*widths, 1, 1)[1], D3=(*widths, 1, 1)[2], SQ=sum(widths),
        V=layout.value_width, BK=config.block_k, BV=config.block_v, BJ=next_pow2(per_head),
        CW=max(layout.conv_width, 1), BW=next_pow2(max(layout.conv_width, 1)), FORGET_COL=layout.forget_col,
        BETA_COL=layout.beta_col, SKIP_COL=layout.skip_col, GATE_COL=layout.gate_col, L2NORM=bool(l2norm),
        STREAM_HINTS=config.stream_hints, num_warps=config.num_warps, num_stages=config.num_stages,
        **({"maxnreg": TWO_PROGRAM_REGISTERS[tile]} if tile in TWO_PROGRAM_REGISTERS else {}),
    )
    return y
