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

Beside the config and the kernel: its launcher (:func:`launch`) and the decode step's host path
(:class:`DecodePlan`, the plan cache, the index checks), which ``launch.running_tensor_decode_``
drives.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel

from . import args
from .args import factor_args, width_args
from .config import (
    DEFAULT_SMEM_BYTES, MAX_REGS_PER_THREAD, CostFigures, KernelConfig, KernelShape, Workload, estimate_registers,
    next_pow2,
)
from .blocks import load_state_tile, phi_gather, phi_inv_norm, phi_row_outer
from .inputs import Problem
from .static_launch import static_launcher


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
            "block_v": [b for b in (4, 8, 16, 32, 64) if b <= next_pow2(shape.value_width)],
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
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    K: tl.constexpr = D1 * D2 * D3
    USE_H0: tl.constexpr = h0 is not None
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
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    # state mask: padding slots (< 0) and slots past the cache's ``num_slots`` rows (unchecked
    # indices, validate=False) are neither read nor written (a vector compare: the interpreter
    # rejects masks built from scalar compares)
    b_slot = tl.zeros([BV], dtype=tl.int64) + slot
    m_sv = m_v & (b_slot >= 0) & (b_slot < num_slots)
    p_state = (slot * H + i_h) * K * V
    NK: tl.constexpr = (K + BK - 1) // BK

    if NK == 1:
        if OUTER:  # the tile as [D1, (D2, (D3,)) BV]: phi(k), phi(q) broadcast from the factors
            off_s = p_state + _key_index(NF, D1, D2, D3) * V + _to_rank(o_v, NF)
            m_s = (off_s >= 0) & _to_rank(m_sv, NF)
        else:
            o_k = tl.arange(0, BK)
            m_k = o_k < K
            off_s = p_state + o_k[:, None] * V + o_v[None, :]
            m_s = m_k[:, None] & m_sv[None, :]
        b_s = load_state_tile(h0, ht, off_s, m_s, True, USE_H0, STREAM_HINTS)
    for t in range(0, T_n):
        r = (i_b * T + bos + t) * H + i_h
        b_v = tl.load(v + r * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_a = 1.0
        if g is not None:
            b_a = tl.exp(tl.load(g + r).to(tl.float32))
        r_q = 1.0
        r_k = 1.0
        if L2NORM:
            r_q = phi_inv_norm(q1, q2, q3, r, True, D1, D2, D3, BD1, BD2, BD3, NF)
            r_k = phi_inv_norm(k1, k2, k3, r, True, D1, D2, D3, BD1, BD2, BD3, NF)
        if NK == 1 and OUTER:
            b_k = _phi_factored(k1, k2, k3, r, NF, D1, D2, D3) * r_k
            b_q = _phi_factored(q1, q2, q3, r, NF, D1, D2, D3) * r_q
            b_s = b_s * b_a
            if beta is not None:
                b_u = tl.load(beta + r).to(tl.float32) * (b_v - _sum_keys(b_s * b_k, NF))
            else:
                b_u = b_v
            b_s += b_k * _to_rank(b_u, NF)
            b_o = _sum_keys(b_s * b_q, NF) * scale
        elif NK == 1:
            b_k = phi_gather(k1, k2, k3, r, o_k, m_k, D1, D2, D3, NF) * r_k
            b_q = phi_gather(q1, q2, q3, r, o_k, m_k, D1, D2, D3, NF) * r_q
            b_s = b_s * b_a
            if beta is not None:
                b_u = tl.load(beta + r).to(tl.float32) * (b_v - tl.sum(b_s * b_k[:, None], axis=0))
            else:
                b_u = b_v
            b_s += b_k[:, None] * b_u[None, :]
            b_o = tl.sum(b_s * b_q[:, None], axis=0) * scale
        else:
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
    if NK == 1:
        if ht is not None:
            if STREAM_HINTS:
                tl.store(ht + off_s, b_s.to(ht.dtype.element_ty), mask=m_s, cache_modifier=".cs")
            else:
                tl.store(ht + off_s, b_s.to(ht.dtype.element_ty), mask=m_s)


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
    fused_recurrent_running_tensor_fwd_kernel[grid](
        *factor_args(q), *factor_args(k), v, g, beta, o, h0, ht, state_indices, cu_seqlens, p.scale, p.seq_len,
        p.num_seqs if state_indices is None else (h0 if h0 is not None else ht).shape[0], **consts,
    )
    return o


# ----- the decode step's host path -----------------------------------------------------------
# Decode is called once per token with the same shapes, and its kernel runs for a few
# microseconds: the host path is the cost. A plan cache keyed by a signature of the arguments
# skips re-validation (fla's wrapper spends 110-130 us per step in Python); the plan then
# launches through the compiled kernel's own launcher.


class DecodePlan:
    """A validated decode launch: grid, constexprs, scale and, after the first launch on a GPU,
    the compiled kernel's own launcher.

    Triton's ``kernel[grid](...)`` binds and specialises all ~30 arguments on every call; with
    it the eager decode step cost 65 us of host time on the H200 machine. The compiled launcher
    skips that work, and is reused only while the specialisation it was compiled for holds: the
    integer arguments (T = 1, the cache's slots) are fixed by the plan (its key holds the
    cache's shape), floats are never specialised, the None inputs (no gate, no delta rule, no
    cu_seqlens) are part of the plan's key, and every pointer must be 16-byte aligned, as at the first launch (checked per call; an unaligned call takes
    Triton's full path).
    """

    __slots__ = ("_runner", "_static", "_tail", "consts", "copy", "grid", "scale")

    def __init__(self, grid: tuple, consts: dict, scale: float, *, copy: bool = False):
        # copy: some input is a strided view, to be made contiguous before each launch (the
        # plan's key holds each input's contiguity, so a plan serves calls of one layout only)
        self.grid, self.consts, self.scale, self.copy = grid, consts, scale, copy
        self._runner = None
        self._static = None
        self._tail: tuple = ()

    def launch(self, kargs: tuple) -> None:
        """Launch with the runtime arguments ``kargs`` (tensors or None, then scale, T and the
        number of cache slots)."""
        ptrs = [None if t is None else t.data_ptr() for t in kargs[:-3]]
        # 0.8 us against 1.1 for any() on the CPU machine; filter drops the None inputs
        aligned = not functools.reduce(operator.or_, filter(None, ptrs)) & 15
        if aligned:
            # raw addresses: a launcher then skips a data_ptr() call (and, on older Tritons, a
            # driver pointer query) per tensor; Triton's compiled launcher alone cost 19 us per
            # call with tensors on the H200 machine, 8.9 with addresses, torch's 5.2 in the same
            # process (static_launch.py; benchmarks/serving_host.py times these paths). A None input's
            # position is a constexpr of the compiled kernel: the launchers skip the value.
            if self._static is not None:
                self._static((*ptrs, *kargs[-3:]))
                return
            if self._runner is not None:
                self._runner(*ptrs, *kargs[-3:], *self._tail)
                return
        kernel = fused_recurrent_running_tensor_fwd_kernel
        compiled = kernel[self.grid](*kargs, **self.consts)
        if self._runner is None and aligned and isinstance(compiled, CompiledKernel) and not args.interpreting():
            # the launcher takes every parameter: the constexprs follow the runtime ones
            self._tail = tuple(self.consts[name] for name in kernel.arg_names[len(kargs):])
            self._runner = compiled[(*self.grid, 1, 1)[:3]]
            device = next(t for t in kargs if isinstance(t, torch.Tensor)).get_device()
            self._static = static_launcher(compiled, self.grid, len(kargs), device)


try:  # torch's C++ check of tensor metadata, of which dynamo's guards are made
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # another torch: the keys alone serve (RecentPlans then finds nothing)
    _TensorGuards = None

RECENT_PLANS = 4  # signatures recognised without a key: a model's layers share one per step


class PlanCache(dict):
    """Launch plans by :func:`signature_key`, the latest few also recognised without a key.

    Building a key costs ~10 us of a T = 1 call's host time on the CPU machine (four attribute
    reads of each of nine tensors, then hashing). :meth:`recent` recognises the signatures of
    the last :data:`RECENT_PLANS` calls whose key found a plan: the call's plain arguments
    (``head``, compared with ==) and one C++ check of its tensors' metadata (torch's
    ``TensorGuards``: type, dispatch keys, dtype, device, sizes, strides, requires_grad), 1.3 us
    for nine tensors. Invariant: :meth:`recent` returns a plan only for a call whose head
    equals, and whose tensors have the metadata of, a call that :meth:`note` saw find that plan by
    key, so everything the key holds (shapes, dtypes, devices, contiguity) is the same; a
    call with any tensor that requires grad is never noted (autograd must see it)."""

    def __init__(self, limit: int = 1024):
        super().__init__()
        self.limit = limit
        self._recent: list = []  # (head, check, plan), latest first

    def recent(self, head, tensors):
        """The plan of a noted call with this head and these tensors' metadata, or None."""
        for h, check, plan in self._recent:
            if h == head:
                try:
                    if check(*[x for x in tensors if x is not None]):
                        return plan
                except TypeError:  # another number of tensors
                    pass
        return None

    def note(self, head, tensors, plan) -> None:
        """``plan`` was found by the key of a call with ``head`` and ``tensors``: recognise the
        call's signature by :meth:`recent` from now on (a no-op without ``TensorGuards``)."""
        present = [x for x in tensors if x is not None]
        if _TensorGuards is None or any(x.requires_grad for x in present):
            return
        try:
            check = _TensorGuards(*present, dynamic_dims_sizes=[list(x.shape) for x in present],
                                  dynamic_dims_strides=[list(x.stride()) for x in present]).check
        except (TypeError, RuntimeError):  # a tensor the check cannot describe: keys serve it
            return
        self._recent = [(head, check, plan), *self._recent[: RECENT_PLANS - 1]]

    def remember(self, key, plan) -> None:
        if key is not None:
            if len(self) >= self.limit:
                self.clear()
            self[key] = plan

    def clear(self) -> None:
        super().clear()
        self._recent = []


DECODE_PLANS = PlanCache()  # decode_key(...) -> DecodePlan


def signature_key(head, tensors, *, exact: bool = False) -> tuple | None:
    """A plan cache's key: ``head`` then (shape, dtype, device index, contiguity) of each tensor
    that is not None, in one flat tuple (the device as ``get_device()``: 5.5 us on the CPU
    machine for 11 tensors against 12 us with per-tensor tuples of ``torch.device``). None when
    an entry is not a tensor (with ``exact``: not a plain ``torch.Tensor``, as tracers hand in)
    or the key is unhashable: the full checks then say why, or run every call."""
    try:
        out = list(head)
        for x in tensors:
            if x is not None:
                if exact and type(x) is not torch.Tensor:
                    return None
                out += (x.shape, x.dtype, x.get_device(), x.is_contiguous())
        key = tuple(out)
        hash(key)
        return key
    except (AttributeError, TypeError):
        return None


def check_indices(state_indices: torch.Tensor, slots: int) -> None:
    """In range and distinct (negative entries are padding); reads the indices (one device sync)."""
    idx = state_indices.tolist()
    bad = [i for i in idx if i >= slots]
    if bad:
        raise ValueError(f"state_indices: {bad[0]} out of range; allowed: 0 <= index < slots = {slots}, or < 0 for padding")
    used = [i for i in idx if i >= 0]
    if len(set(used)) != len(used):
        raise ValueError("state_indices: repeated slot; allowed: distinct slots (each sequence owns its state)")
