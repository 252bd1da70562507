"""Fused recurrent kernel: the decode step (T = 1) and the multi-token recurrent scan.

One program owns one (sequence, head, value block) slab of the state, [K, BV], and walks the
sequence's tokens. Both reductions of a step read S_{t-1}:

    pred = a <S, phi(k)>,   read = a <S, phi(q)>,   u = b (v - pred)   (u = v without delta)
    S'   = a S + phi(k) (x) u,    o = scale (read + (phi(k) . phi(q)) u)

so a step can read the state once and write it once. When BK covers K the slab stays in
registers for the whole sequence (resident); otherwise it is streamed tile by tile, twice per
token (reductions, then update), the second read usually from L2. With OUTER (power-of-two
widths) a resident slab is held factored, [d_1, ..., d_{o-1}, BV], so phi(k) and phi(q) are
broadcasts of the factor vectors; a streamed tile builds them as reshaped outer products.
With STREAM_HINTS a resident slab is loaded evict-first and stored streaming (``.cs``): it is
not touched again before the next step, so it should not displace lines that are.

State indexing follows the serving convention: with ``state_indices`` the state of sequence
n lives at row ``state_indices[n]`` of a cache ``[slots, H, K, V]`` and is updated in place; a
negative index marks a padding entry whose state is neither read nor written (vLLM's
PAD_SLOT_ID).

Beside the config and the kernel: its launcher (:func:`launch`). The eager T = 1 calls' host
path (launch plans and their caches) is ``decode_plan.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import triton
import triton.language as tl

from . import args
from .args import factor_args, width_args
from .config import (
    DEFAULT_SMEM_BYTES, MAX_REGS_PER_THREAD, CostFigures, KernelConfig, KernelShape, Workload, estimate_registers,
    next_pow2, warps_refusal,
)
from .blocks import load_state_tile, phi_gather, phi_inv_norm, phi_row_outer
from .inputs import Problem
from .launch_cache import cached


@dataclass(frozen=True)
class RecurrentConfig(KernelConfig):
    """The fused recurrent kernel (decode step and multi-token scan).

    ``block_k``: the key tile; when it covers K the [K, block_v] state tile stays in registers
    for the whole sequence (one read, one write), otherwise the state is streamed in
    ceil(K / block_k) tiles twice per token (the second read usually hits L2). ``block_k`` and
    ``block_v`` are powers of two. ``outer_phi``: build phi(k) and phi(q) of a key tile as the
    outer product of contiguous factor loads instead of per-element gathers (power-of-two
    widths, ``block_k`` a multiple of the trailing widths' product; it lost at every measured
    shape on the H200: 8% behind at o3 16x16 B256, 5% at o3 32x32 B32). ``stream_hints``: load
    the resident slab evict-first and store it streaming (.cs), since nothing reads it again
    before the next step (needs ``block_k`` covering K; o3 16x16 B32 on the H200: 92% of a
    same-size copy against 85%).
    """

    kernel: ClassVar[str] = "recurrent"
    form: ClassVar[str] = "recurrent"
    block_k: int
    block_v: int
    num_warps: int = 4
    num_stages: int = 1
    outer_phi: bool = False
    stream_hints: bool = False

    def resident(self, shape: KernelShape) -> bool:
        return self.block_k >= shape.key_dim

    def check(self, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> str | None:
        if (reason := self._check_pow2("block_k", "block_v", "num_warps")) is not None:
            return reason
        if (reason := warps_refusal(self.num_warps)) is not None:
            return reason
        kp = next_pow2(shape.key_dim)  # no tl.dot here: tiles narrower than 16 are fine
        if self.block_k > kp:
            return f"block_k={self.block_k}; allowed: at most K rounded up ({kp})"
        if self.block_v > next_pow2(shape.value_width):
            return f"block_v={self.block_v}; allowed: at most d_v rounded up ({next_pow2(shape.value_width)})"
        if self.outer_phi and not shape.outer_phi_ok(self.block_k):
            return (f"outer_phi=True needs power-of-two key widths and block_k a multiple of the trailing widths' "
                    f"product, got widths {shape.key_widths}, block_k={self.block_k}")
        if self.stream_hints and self.block_k < kp:
            return (f"stream_hints=True needs the state slab resident (block_k >= {kp}), "
                    f"got block_k={self.block_k}")
        if (regs := self.estimate_registers(shape)) > MAX_REGS_PER_THREAD:
            return f"~{regs} registers per thread (> {MAX_REGS_PER_THREAD})"
        return None

    def estimate_registers(self, shape: KernelShape) -> int:
        # live fp32 tiles: the state tile and one temporary of the same size, plus phi(k), phi(q)
        return estimate_registers(2 * self.block_k * self.block_v + 2 * self.block_k, self.num_warps)

    @classmethod
    def space(cls, shape: KernelShape) -> dict[str, list]:
        kp = next_pow2(shape.key_dim)
        return {
            "block_k": sorted({min(kp, b) for b in (32, 64, 128, 256, 512, 1024, kp)}),
            # 1 and 2 only where d_v <= 2 rounds up to them: the default's tile must be in the space
            "block_v": [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= next_pow2(shape.value_width)
                        and (b >= 4 or next_pow2(shape.value_width) < 4)],
            "num_warps": [1, 2, 4, 8, 16],
            "num_stages": [1, 2, 3],
            "outer_phi": [False, True],
            "stream_hints": [False, True],
        }

    def workspace_bytes(self, w: Workload) -> int:
        return 0

    def figures(self, w: Workload) -> CostFigures:
        resident = self.resident(w.shape)
        return CostFigures(
            programs=w.batch * w.heads * math.ceil(w.shape.value_width / self.block_v), serial_steps=w.seq_len,
            state_passes=2 if resident else 3 * w.seq_len, workspace_bytes=0,
            tile_visits=0 if resident else 2 * math.ceil(w.shape.key_dim / self.block_k), tile_elements=self.block_k)

    def with_other_hints(self, shape: KernelShape) -> "RecurrentConfig | None":
        """This config with stream_hints flipped, when that can run (they split by batch on the
        H200: on at B32, 1.4% behind at B256), for a study to start from both."""
        other = replace(self, stream_hints=not self.stream_hints)
        return other if other.check(shape) is None else None


@triton.jit
def _phi(p1, p2, p3, r, i_k, o_k, m_k, BK: tl.constexpr, NF: tl.constexpr,
         D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, OUTER: tl.constexpr):
    """Raw phi at the key tile ``i_k`` (indices ``o_k``): an outer product of contiguous factor
    loads when OUTER, else per-element gathers (any widths)."""
    if OUTER:
        b_phi = phi_row_outer(p1, p2, p3, r, i_k, BK, NF, D1, D2, D3)
    else:
        b_phi = phi_gather(p1, p2, p3, r, o_k, m_k, D1, D2, D3, NF)
    return b_phi


@triton.jit
def _to_rank(x, NF: tl.constexpr):
    """A [BV] vector as [1, ..., 1, BV] beside NF key axes."""
    if NF == 1:
        y = x[None, :]
    elif NF == 2:
        y = x[None, None, :]
    else:
        y = x[None, None, None, :]
    return y


@triton.jit
def _key_index(NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """The flat key index of a factored state tile [D1, (D2, (D3,)) 1] (row-major phi)."""
    o_1 = tl.arange(0, D1)
    if NF == 1:
        idx = o_1[:, None]
    elif NF == 2:
        idx = (o_1[:, None] * D2 + tl.arange(0, D2)[None, :])[:, :, None]
    else:
        idx = (o_1[:, None, None] * D2 + tl.arange(0, D2)[None, :, None]) * D3 + tl.arange(0, D3)[None, None, :]
        idx = idx[:, :, :, None]
    return idx


@triton.jit
def _phi_factored(p1, p2, p3, r, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """Raw phi of row ``r`` shaped like a factored state tile: the factors broadcast against
    each other, so phi is never gathered, reshaped or moved between layouts."""
    b_1 = tl.load(p1 + r * D1 + tl.arange(0, D1)).to(tl.float32)
    if NF == 1:
        b_phi = b_1[:, None]
    elif NF == 2:
        b_2 = tl.load(p2 + r * D2 + tl.arange(0, D2)).to(tl.float32)
        b_phi = (b_1[:, None] * b_2[None, :])[:, :, None]
    else:
        b_2 = tl.load(p2 + r * D2 + tl.arange(0, D2)).to(tl.float32)
        b_3 = tl.load(p3 + r * D3 + tl.arange(0, D3)).to(tl.float32)
        b_phi = (b_1[:, None, None] * b_2[None, :, None] * b_3[None, None, :])[:, :, :, None]
    return b_phi


@triton.jit
def _sum_keys(x, NF: tl.constexpr):
    """Sum a factored tile over its NF key axes: [BV]."""
    y = tl.sum(x, axis=0)
    if NF > 1:
        y = tl.sum(y, axis=0)
    if NF > 2:
        y = tl.sum(y, axis=0)
    return y


@triton.jit
def _sequence(i_n, cu_seqlens, state_indices, T):
    """Sequence ``i_n``'s first token (bos), token count, batch row and state slot."""
    if cu_seqlens is not None:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_n = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        i_b = 0
    else:
        bos = 0
        T_n = T
        i_b = i_n.to(tl.int64)
    if state_indices is not None:
        slot = tl.load(state_indices + i_n).to(tl.int64)
    else:
        slot = i_n.to(tl.int64)
    return bos, T_n, i_b, slot


@triton.jit
def state_slab(slot, i_h, o_v, m_sv, H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
               D3: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, OUTER: tl.constexpr):
    """Offsets and mask of a resident state slab ([K, BV], or [D1, (D2, (D3,)) BV] with OUTER)."""
    K: tl.constexpr = D1 * D2 * D3
    p_state = (slot * H + i_h) * K * V
    if OUTER:  # the slab as [D1, (D2, (D3,)) BV]: phi(k), phi(q) broadcast from the factors
        off_s = p_state + _key_index(NF, D1, D2, D3) * V + _to_rank(o_v, NF)
        m_s = (off_s >= 0) & _to_rank(m_sv, NF)
    else:
        o_k = tl.arange(0, BK)
        off_s = p_state + o_k[:, None] * V + o_v[None, :]
        m_s = (o_k < K)[:, None] & m_sv[None, :]
    return off_s, m_s


@triton.jit
def slot_mask(slot, m_v, num_slots, BV: tl.constexpr):
    """Value columns of a slot that are read and written: not padding (< 0), not past the
    cache's rows (unchecked indices, validate=False). A vector compare: the interpreter rejects
    masks built from scalar compares."""
    b_slot = tl.zeros([BV], dtype=tl.int64) + slot
    return m_v & (b_slot >= 0) & (b_slot < num_slots)


@triton.jit
def _token_inputs(q1, q2, q3, k1, k2, k3, v, g, r, o_v, m_v, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                  D3: tl.constexpr, BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr, V: tl.constexpr,
                  L2NORM: tl.constexpr):
    """Token-head row ``r``'s values, decay a = exp(g) (1 without a gate) and the inverse norms
    of phi(q) and phi(k) (1 without l2norm)."""
    b_v = tl.load(v + r * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_a = 1.0
    if g is not None:
        b_a = tl.exp(tl.load(g + r).to(tl.float32))
    r_q = 1.0
    r_k = 1.0
    if L2NORM:
        r_q = phi_inv_norm(q1, q2, q3, r, True, D1, D2, D3, BD1, BD2, BD3, NF)
        r_k = phi_inv_norm(k1, k2, k3, r, True, D1, D2, D3, BD1, BD2, BD3, NF)
    return b_v, b_a, r_q, r_k


@triton.jit
def token_update(b_s, b_k, b_q, b_v, b_a, b_beta, scale, DELTA: tl.constexpr):
    """One token on a resident [BK, BV] slab ``b_s`` from phi(k), phi(q) ([BK], normalised), v
    ([BV]), the decay ``b_a`` and ``b_beta`` (DELTA: the delta rule): the new slab and the output."""
    b_s = b_s * b_a
    if DELTA:
        b_u = b_beta * (b_v - tl.sum(b_s * b_k[:, None], axis=0))
    else:
        b_u = b_v
    b_s += b_k[:, None] * b_u[None, :]
    b_o = tl.sum(b_s * b_q[:, None], axis=0) * scale
    return b_s, b_o


@triton.jit
def _resident_tokens(b_s, q1, q2, q3, k1, k2, k3, v, g, beta, o, r0, T_n, o_v, m_v, scale,
                     H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
                     BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, L2NORM: tl.constexpr, OUTER: tl.constexpr):
    """One sequence-head's tokens (row ``r0`` on) on its resident slab: each output stored, the
    slab after the last token returned."""
    K: tl.constexpr = D1 * D2 * D3
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    for t in range(0, T_n):
        r = r0 + t * H
        b_v, b_a, r_q, r_k = _token_inputs(q1, q2, q3, k1, k2, k3, v, g, r, o_v, m_v, NF, D1, D2, D3, BD1, BD2, BD3,
                                           V, L2NORM)
        if OUTER:
            b_k = _phi_factored(k1, k2, k3, r, NF, D1, D2, D3) * r_k
            b_q = _phi_factored(q1, q2, q3, r, NF, D1, D2, D3) * r_q
            b_s = b_s * b_a
            if beta is not None:
                b_u = tl.load(beta + r).to(tl.float32) * (b_v - _sum_keys(b_s * b_k, NF))
            else:
                b_u = b_v
            b_s += b_k * _to_rank(b_u, NF)
            b_o = _sum_keys(b_s * b_q, NF) * scale
        else:
            b_k = phi_gather(k1, k2, k3, r, o_k, m_k, D1, D2, D3, NF) * r_k
            b_q = phi_gather(q1, q2, q3, r, o_k, m_k, D1, D2, D3, NF) * r_q
            b_beta = 1.0
            if beta is not None:
                b_beta = tl.load(beta + r).to(tl.float32)
            b_s, b_o = token_update(b_s, b_k, b_q, b_v, b_a, b_beta, scale, beta is not None)
        tl.store(o + r * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    return b_s


@triton.jit
def fused_recurrent_running_tensor_fwd_kernel(
    q1, q2, q3, k1, k2, k3, v, g, beta, o, h0, ht, state_indices, cu_seqlens,
    scale, T, num_slots,
    H: tl.constexpr, NF: tl.constexpr,
    D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr,
    V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, OUTER: tl.constexpr, STREAM_HINTS: tl.constexpr,
):
    # An absent input is None, which Triton specialises as a constexpr: no g (no gate), no beta
    # (no delta rule), no h0 (zero initial state), no ht (no final state; given whenever the
    # state is streamed), no state_indices (sequence n owns state row n), no cu_seqlens.
    K: tl.constexpr = D1 * D2 * D3
    NK: tl.constexpr = (K + BK - 1) // BK
    USE_H0: tl.constexpr = h0 is not None
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T_n, i_b, slot = _sequence(i_n, cu_seqlens, state_indices, T)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_sv = slot_mask(slot, m_v, num_slots, BV)
    if NK == 1:
        off_s, m_s = state_slab(slot, i_h, o_v, m_sv, H, NF, D1, D2, D3, V, BK, OUTER)
        b_s = load_state_tile(h0, ht, off_s, m_s, True, USE_H0, STREAM_HINTS)
        b_s = _resident_tokens(b_s, q1, q2, q3, k1, k2, k3, v, g, beta, o, (i_b * T + bos) * H + i_h, T_n,
                               o_v, m_v, scale, H, NF, D1, D2, D3, BD1, BD2, BD3, V, BK, L2NORM, OUTER)
        if ht is not None:
            if STREAM_HINTS:
                tl.store(ht + off_s, b_s.to(ht.dtype.element_ty), mask=m_s, cache_modifier=".cs")
            else:
                tl.store(ht + off_s, b_s.to(ht.dtype.element_ty), mask=m_s)
    else:
        p_state = (slot * H + i_h) * K * V
        for t in range(0, T_n):
            r = (i_b * T + bos + t) * H + i_h
            b_v, b_a, r_q, r_k = _token_inputs(q1, q2, q3, k1, k2, k3, v, g, r, o_v, m_v, NF, D1, D2, D3, BD1, BD2,
                                               BD3, V, L2NORM)
            # pass 1: both reductions on S_{t-1}, and phi(k) . phi(q)
            b_pred = tl.zeros([BV], dtype=tl.float32)
            b_read = tl.zeros([BV], dtype=tl.float32)
            b_kq = 0.0
            for i_k in range(NK):
                o_k = i_k * BK + tl.arange(0, BK)
                m_k = o_k < K
                off_s = p_state + o_k[:, None] * V + o_v[None, :]
                b_s = load_state_tile(h0, ht, off_s, m_k[:, None] & m_sv[None, :], t == 0, USE_H0)
                b_k = _phi(k1, k2, k3, r, i_k, o_k, m_k, BK, NF, D1, D2, D3, OUTER)
                b_q = _phi(q1, q2, q3, r, i_k, o_k, m_k, BK, NF, D1, D2, D3, OUTER)
                b_pred += tl.sum(b_s * b_k[:, None], axis=0)
                b_read += tl.sum(b_s * b_q[:, None], axis=0)
                b_kq += tl.sum(b_k * b_q, axis=0)
            if beta is not None:
                b_u = tl.load(beta + r).to(tl.float32) * (b_v - b_a * r_k * b_pred)
            else:
                b_u = b_v
            b_o = scale * r_q * (b_a * b_read + r_k * b_kq * b_u)
            # pass 2: S' = a S + phi(k) (x) u, written to the running buffer
            for i_k in range(NK):
                o_k = i_k * BK + tl.arange(0, BK)
                m_k = o_k < K
                off_s = p_state + o_k[:, None] * V + o_v[None, :]
                m_s = m_k[:, None] & m_sv[None, :]
                b_s = load_state_tile(h0, ht, off_s, m_s, t == 0, USE_H0)
                b_k = _phi(k1, k2, k3, r, i_k, o_k, m_k, BK, NF, D1, D2, D3, OUTER) * r_k
                b_s = b_s * b_a + b_k[:, None] * b_u[None, :]
                tl.store(ht + off_s, b_s.to(ht.dtype.element_ty), mask=m_s)
            tl.store(o + r * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


# ----- launcher ------------------------------------------------------------------------------


def launch_consts(p: Problem, l2norm: bool, config: RecurrentConfig) -> tuple[tuple, dict]:
    """The grid and the constexpr / launch options of the kernel for a problem (the optional
    inputs are not among them: they are None or not at launch)."""
    grid = (triton.cdiv(p.value_width, config.block_v), p.num_seqs * p.heads)
    consts = dict(
        H=p.heads, NF=len(p.key_widths), **width_args(p.key_widths, 1), V=p.value_width,
        BK=config.block_k, BV=config.block_v, L2NORM=bool(l2norm), OUTER=config.outer_phi,
        STREAM_HINTS=config.stream_hints, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return grid, consts


def launch(config: RecurrentConfig, p: Problem, q, k, v, g, beta, *, h0, ht, cu_seqlens, l2norm: bool,
           state_indices=None) -> torch.Tensor:
    """Run the scan over validated inputs and return o. ``h0``: the initial state or None
    (zeros); ``ht``: the fp32 buffer the final state is written to, or None (not kept). A
    streamed state (block_k < K) lives in ``ht`` while the kernel runs, so it needs one.
    ``state_indices``: the state row of each sequence in ``h0`` / ``ht`` (a slot cache)."""
    if ht is None and config.block_k < p.key_dim:
        raise ValueError(f"ht: None, but block_k={config.block_k} < K = {p.key_dim} streams the state through it; "
                         "allowed: a [N, H, d_1, ..., d_v] fp32 buffer")
    grid, consts = launch_consts(p, l2norm, config)
    o = args.empty(v.shape, dtype=v.dtype, device=v.device)
    cached(fused_recurrent_running_tensor_fwd_kernel)[grid](
        *factor_args(q), *factor_args(k), v, g, beta, o, h0, ht, state_indices, cu_seqlens, p.scale, p.seq_len,
        p.num_seqs if state_indices is None else (h0 if h0 is not None else ht).shape[0], **consts,
    )
    return o
