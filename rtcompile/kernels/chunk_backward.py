"""The chunk-parallel backward: gradients of every input of ``running_tensor`` (each query and key
factor, v, g, beta, the initial state, and through the final state), from the output's gradient
dO and the final state's dS_T.

Per chunk of C tokens (padded rows zero; c = cumsum(g) within the chunk, Gamma = exp(c), gamma
= exp(c_last), r = gamma / Gamma, D_ij = exp(c_i - c_j) for j <= i; A = strictly-lower(diag(b)
(Gk * D)), T = (I + A)^-1; R = V - diag(Gamma) phi(K) S, U = T diag(b) R (U = V without the
delta rule); P = Gq * D; O = s (diag(Gamma) phi(Q) S + P U); S' = gamma S + phi(K)^T diag(r) U)::

    dU = s P^T dO + diag(r) phi(K) dS'            dR' = T^T dU,  dR = diag(b) dR'
    dS = s phi(Q)^T diag(Gamma) dO + gamma dS' - phi(K)^T diag(Gamma) dR     (dv = dR, or dU)
    dphi(Q) = s diag(Gamma) dO S^T + dGq phi(K),   dGq = s (dO U^T) * D (lower, diagonal included)
    dphi(K) = diag(r) U dS'^T - diag(Gamma) dR S^T + dGq^T phi(Q) + (dGk + dGk^T) phi(K)
    dT = dU R^T diag(b),  dA = -(T^T dT T^T) strictly lower,  dGk = dA * b_i D_ij
    db = rowsum(dR' * R) + rowsum(dA * Gk * D)
    dc: the D, Gamma, r and gamma terms; dg = the reverse cumulative sum of dc within the chunk

Four to seven launches (:func:`launch_backward`):

1. prepare (``chunk_prepare.prepare_backward``): the scores P and the inverse T ([T, C] fp32
   each), the cumulative log decay, and for the resident state loops phi(K) and phi(Q)
   normalised ([T, K] each in the products' type);
2. forward recompute, storing every chunk's incoming state S ([K, V] in the products' type), U
   and R ([T, V] fp32 each; R with the delta rule): resident, the split form's state loop with
   state_stride 1 (``chunk_split.py``); streamed, the streamed forward kernel with its stores
   (``chunk_backward_streamed.recompute_streamed``);
3. the state-gradient loop, sequential in reverse per (sequence, head, value block): every
   chunk's outgoing state gradient dS' ([K, V], the products' type) and dU ([T, V] fp32), and
   d(initial state) = the dS after chunk 0 (fp32): resident, ``chunk_backward_state.chunk_bwd_state_kernel``
   (the [K, block_v] gradient in registers, K <= 256); streamed,
   ``chunk_backward_streamed.state_grads_streamed`` (the running dS in an fp32 buffer, visited
   in [state_block_k, block_v] tiles, phi blocks from the factors);
4. ``chunk_backward_grads.chunk_bwd_grads_kernel``, chunk-parallel, over key blocks of
   ``block_k`` columns: dv, dbeta, dg and, with ``factor_grads="registers"`` (orders 3-4),
   every factor's gradient (phi's contracted to the factors block by block), with ``"rows"``
   (one block of whole rows, block_k >= K) every factor's gradient (phi's contracted once per
   chunk), else phi(Q)'s and phi(K)'s ([T, K] each in the workspace type), written over phi's
   own workspaces where those are in that type (``BackwardConfig.phi_grads_over_phi``); with
   ``grads_split`` (the default above K = 256) three or four launches (``chunk_backward_split``);
5. (phi's gradients stored) ``chunk_backward_factors.phi_grads_to_factors_kernel``.

Memory (``BackwardConfig.workspace_bytes``), per (sequence, head): per chunk S and dS' (K d_v
each, the products' type); per token P and T (4 C each; T with the delta rule), U, R, dU (4 d_v
each, or the inputs' 2 with ``workspace_dtype="inputs"``; R with the delta rule), the log decay
(4, gates), resident loops phi(K), phi(Q) (K each, the products' type), stored phi gradients (K
each, as U); streamed loops add the running S and dS (fp32, K d_v each, once). o3 16x16, d_v 64,
bf16, the default without a gate (C 32, resident, stored, 16-bit): per token-head 2 x 512 (phi, then its
gradients over it) + 2 x 128 (P, T) + 3 x 128 (U, R, dU) + 4 bytes, per chunk 2 x 32 KiB; o3 64x64
(streamed, registers, split: dGq, dGs and dc's parts added): 2 x 512 KiB per chunk + 1.8 KiB per token.

Scope (:func:`supports`): orders 2-4 at any key widths, K and d_v, each feature, varlen, any T.
The kernels tile power-of-two key widths >= 16; other widths are rewritten exactly onto such a
problem (``chunk_backward_widths``: materialised keys, or zero-padded factors).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import triton

from . import args
from .args import contiguous_inputs, factor_args, width_args
from .chunk_backward_factors import phi_grads_to_factors_kernel
from .chunk_backward_grads import chunk_bwd_grads_kernel
from .chunk_backward_kept import Recomputed, phi_grads_dtype, recompute
from .chunk_backward_state import state_grads
from .chunk_backward_split import GradsTensors, split_grads
from .chunk_backward_widths import materialised_keys, materialised_bwd, padded_bwd, rewritten_widths, tiled
from .chunk_resident import MATERIALISE_TILE
from .chunk_split import KEY_GROUPS
from .config import (
    CHUNK_SIZES, DEFAULT_SMEM_BYTES, PREPARE_WARPS, SOLVES, CostFigures, KernelConfig, KernelShape, Workload,
    checked, chunk_count, chunk_programs, chunk_refusal, chunk_smem_estimate, dot_operand_bytes, estimate_registers,
    resource_refusal,
)
from .inputs import Problem, check_inputs
from .launch_cache import cached

MAX_KEY_DIM = 256
BWD_CHUNK_SIZES = (16, 32, 64)
BLOCK_KS = (16, 32, 64, 128, 256)
# no tf32x3: the gradients kernel faulted with it at C 64 where ieee and tf32 ran (H200, Triton 3.6)
BWD_PRECISIONS = ("ieee", "tf32")
GRADS_WARPS = (2, 4, 8)
# "resident": the state loops hold a [K, block_v] tile in registers, phi from [T, K] workspaces (K <= 256);
# "streamed": [state_block_k, block_v] tiles through memory, phi blocks from the factors (chunk_backward_streamed)
STATE_LOOPS = ("resident", "streamed")
STATE_BLOCK_KS = (16, 32, 64, 128, 256)
# where phi's gradients become the factors': "registers", per key block (no [T, K] tensor; orders 3-4);
# "workspace", stored [T, K] and contracted by a token-parallel kernel; "rows", formed as stored but in
# one key block of whole rows (block_k >= K) and contracted there (no [T, K] tensor, no fifth launch)
FACTOR_GRADS = ("registers", "workspace", "rows")
# the per-token workspaces' type (U, R, dU, stored phi gradients): fp32, or the inputs' 16-bit type (as
# fla keeps its recomputed values): o3 16x16 bf16 B8 T4096 H8 workspace_bytes 1345 -> 993 MiB; or "mixed":
# U, R, dU in fp32 (dg sums differences of them: 16-bit ones cancelled to bf16 dg errors of 4e-2) and
# phi's gradients in the inputs' type, over phi's own workspaces where the one-pass kernel stores them
# (all fp32 took o3 16x16 bf16 fwd+bwd 1.94 -> 2.35 ms and 965 -> 1573 MiB peak: H100, ac56808)
WORKSPACE_DTYPES = ("float32", "inputs", "mixed")


@dataclass(frozen=True)
class BackwardConfig(KernelConfig):
    """The backward's kernels. ``chunk_size`` (16, 32, 64); ``block_v``, ``num_warps``,
    ``num_stages`` (>= 2 resident: the split state loop's rule): the recompute's and the
    state-gradient loop's value tile, warps and stages, and the gradients kernel's value step;
    ``block_k`` (at most K is used), ``grads_warps``, ``grads_stages``: the gradients kernel's
    key block, warps and stages; ``prepare_warps`` / ``solve`` / ``key_group``: the prepare
    kernel's; ``dot_precision``: every fp32 product (16-bit inputs multiply the loaded operands
    in their own type); ``state_loop`` (:data:`STATE_LOOPS`) and ``state_block_k`` (the streamed
    loops' key tile; unused when resident); ``factor_grads`` (:data:`FACTOR_GRADS`)."""

    kernel: ClassVar[str] = "chunk_bwd"
    form: ClassVar[str] = "backward"
    chunk_size: int
    block_v: int
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    grads_warps: int = 8
    # the gradients kernel's software-pipelining stages: 1 by offline sm_90 counts (spills o3 32x32
    # 552 -> 392 B a thread, shared memory 118 -> 86 KB against Triton's default 3); the key loop prefetches
    grads_stages: int = 1
    prepare_warps: int = 1
    solve: str = "tiles"
    key_group: int = 1
    dot_precision: str = "ieee"
    state_loop: str = "resident"
    state_block_k: int = 128
    factor_grads: str = "registers"
    workspace_dtype: str = "float32"
    # the gradients kernel split (chunk_backward_split): C x C gradients; phi's per chunk and key block,
    # stored (factor_grads="workspace": o3 32x32 17.2 -> 14.6 ms but 1.4 -> 3.5 GiB, H200, 2026-12-02),
    # or one side's factors per program in registers; then dg
    grads_split: bool = False
    # a training call's forward keeps its prepare and state loop for the backward (chunk_backward_kept.py)
    keep_forward: bool = False
    # the gradients kernel's value step (None: block_v): 64 against the loops' 32 took its time at
    # o3 32x32 5.30 -> 3.87 ms, o3 64x64 12.1 -> 8.0 (H200, 2026-12-02, a3f20ec); block_v 64 for
    # every kernel slowed the recompute and state loops by more than that
    grads_block_v: int | None = None
    # the streamed loops read the state and its gradient once per chunk, not twice (the streamed
    # forward's merge_passes: o3 64x64 forward 6.49 -> 5.26 ms, H200); resident loops: False
    merge_passes: bool = False

    grads_bv = property(lambda self: self.block_v if self.grads_block_v is None else self.grads_block_v)

    def resident(self, shape: KernelShape) -> bool:
        return self.state_loop == "resident"

    def check(self, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> str | None:
        if (reason := chunk_refusal(self, shape)) is not None:
            return reason
        for name, allowed in (("chunk_size", BWD_CHUNK_SIZES), ("block_k", BLOCK_KS), ("grads_warps", GRADS_WARPS),
                              ("grads_stages", (1, 2, 3)),
                              ("key_group", KEY_GROUPS), ("dot_precision", BWD_PRECISIONS),
                              ("state_loop", STATE_LOOPS), ("state_block_k", STATE_BLOCK_KS),
                              ("factor_grads", FACTOR_GRADS), ("workspace_dtype", WORKSPACE_DTYPES)):
            if (reason := self._check_choice(name, allowed)) is not None:
                return reason
        if (reason := shape_refusal(shape)) is not None:
            return reason
        if len(shape.key_widths) > 1 and min(self.block_k, shape.key_dim) < shape.key_widths[-1]:
            return (f"block_k={self.block_k} < the last key width {shape.key_widths[-1]}: a key block of the "
                    f"gradients kernel holds whole rows of the last factor; allowed: "
                    f"{[b for b in BLOCK_KS if b >= shape.key_widths[-1]]}")
        if self.key_group > 1 and (len(shape.key_widths) < 2 or shape.key_widths[0] % self.key_group):
            return (f"key_group={self.key_group} needs order >= 3 and a first key width it divides, got widths "
                    f"{shape.key_widths} (or key_group=1)")
        if self.state_loop == "resident" and shape.key_dim > MAX_KEY_DIM:
            return (f"state_loop='resident' holds the [K, block_v] state in registers up to K = {MAX_KEY_DIM}, "
                    f"got K = {shape.key_dim}; use state_loop='streamed'")
        for name in ("grads_split", "keep_forward", "merge_passes"):
            if not isinstance(getattr(self, name), bool):
                return f"{name}={getattr(self, name)!r}; allowed: False, True"
        if self.merge_passes and self.state_loop == "resident":  # else a duplicate the tuner times twice
            return "merge_passes=True with state_loop='resident'; allowed: False, or state_loop='streamed'"
        if self.grads_split and self.factor_grads != "workspace" and len(shape.key_widths) == 1:  # a duplicate
            return f"factor_grads={self.factor_grads!r} with grads_split=True at order 2; allowed: 'workspace'"
        if self.factor_grads == "rows":
            if self.grads_split:
                return "factor_grads='rows' with grads_split=True; allowed: 'registers' or 'workspace'"
            if min(self.block_k, shape.key_dim_pow2) < shape.key_dim_pow2:
                return (f"factor_grads='rows' needs one key block of whole rows, block_k >= K = "
                        f"{shape.key_dim_pow2}, got block_k={self.block_k}; allowed: "
                        f"{[b for b in BLOCK_KS if b >= shape.key_dim_pow2] or 'none (K > 256)'}")
        if self.factor_grads == "registers" and self.block_k > 128:  # not run on a GPU in registers
            return f"block_k={self.block_k} with factor_grads='registers'; allowed: 16 .. 128"
        if self.grads_block_v is not None and (isinstance(self.grads_block_v, bool) or self.grads_block_v
                                               not in [b for b in (16, 32, 64, 128) if b <= shape.value_dim_pow2]):
            return (f"grads_block_v={self.grads_block_v!r}; allowed: None (block_v) or a power of two 16 .. "
                    f"{shape.value_dim_pow2} (d_v rounded up)")
        # order 4 in registers: illegal addresses on the H200 (Triton 3.6, C 64) pipelined (e8c6451), 64 columns (e3a92b7)
        if self.factor_grads == "registers" and len(shape.key_widths) == 3:
            if self.grads_stages > 1:
                return f"grads_stages={self.grads_stages} with factor_grads='registers' at order 4; allowed: 1"
            if (self.grads_block_v or 0) >= 64:
                return f"grads_block_v={self.grads_block_v} with factor_grads='registers' at order 4; allowed: None, 16, 32"
            if self.block_k > 64:  # illegal addresses at 128 and 256 columns too (8 warps, H200, 2026-12-03)
                return f"block_k={self.block_k} with factor_grads='registers' at order 4; allowed: 16, 32, 64"
        if self.num_stages < 2 and self.state_loop == "resident":
            return f"num_stages={self.num_stages}; allowed: 2, 3 or 4 (the split state loop's rule; 1 streamed)"
        return resource_refusal(self, shape, smem_limit, "; try a smaller chunk_size, block_v or block_k")

    def estimate_registers(self, shape: KernelShape) -> int:
        # the larger of the state-gradient loop's and the gradients kernel's (stored or rows: T, dGq,
        # dGs [C, C]; both sides' [C, BK] terms and one phi block; S and dS' [BK, BV] in 16 bits
        # (counted as one), three [C, BV]; in registers, below) at their warps. Calibrated on sm_90
        # (H200, C 32, 4 warps, bf16, o3 16x16): BK 256 / BV 32 spilled 60 registers and ran the
        # kernel in 0.735 ms against 0.793 at BK 128 (8 spilled); BV 64 at BK 256 spilled 110, 0.847 ms
        C, K, bv, bk = self.chunk_size, shape.key_dim_pow2, self.block_v, min(self.block_k, shape.key_dim_pow2)
        if self.state_loop == "resident":
            loop = K * bv + 2 * C * K * shape.input_bytes // 4 + 2 * C * C + 4 * C * bv
        else:  # a state tile, phi(Q) and phi(K) blocks, P and T, four [C, BV]
            sk = min(self.state_block_k, K)
            loop = sk * bv + 2 * C * sk + 2 * C * C + 4 * C * bv
        # + both sides' factor tiles and gradients (NF >= 2); in registers, the larger of the [C, C]
        # gradients and the key loop's [C, BK] product and temporary, S, dS' and the next ones, 3 [C, BV]
        factors = 4 * C * sum(shape.key_widths) if len(shape.key_widths) > 1 else 0
        gbv = self.grads_bv
        stored_pass = self.phi_grads_stored(shape) or self.factor_grads == "rows"
        grads = 3 * C * C + 3 * C * bk + bk * gbv + 3 * C * gbv + factors if stored_pass \
            else max(3 * C * C, 2 * C * bk + 4 * bk * gbv + 3 * C * gbv) + factors
        return max(estimate_registers(loop, self.num_warps), estimate_registers(grads, self.grads_warps))

    def estimate_smem(self, shape: KernelShape) -> int:
        # the state-gradient loop's loads that feed products, per stage: phi(Q), phi(K) in the
        # products' type and P, T fp32
        C, K = self.chunk_size, shape.key_dim_pow2
        if self.state_loop == "streamed":
            return chunk_smem_estimate(C, min(self.state_block_k, K), self.block_v, self.num_stages)
        return max(1, self.num_stages) * (2 * C * K * dot_operand_bytes(shape.input_bytes) + 8 * C * C)

    @classmethod
    def space(cls, shape: KernelShape) -> dict[str, list]:
        if shape_refusal(shape) is not None:
            return {}
        order3 = len(shape.key_widths) >= 2
        return {
            "chunk_size": list(BWD_CHUNK_SIZES),
            "block_v": [b for b in (16, 32, 64, 128) if b <= shape.value_dim_pow2],
            "block_k": [b for b in BLOCK_KS if b <= shape.key_dim_pow2 and (len(shape.key_widths) < 2
                                                                         or b >= shape.key_widths[-1])],
            "num_warps": [2, 4, 8],
            "num_stages": [1, 2, 3] if shape.key_dim > MAX_KEY_DIM else [2, 3],
            "grads_warps": list(GRADS_WARPS),
            "grads_stages": [1, 2, 3],
            "prepare_warps": list(PREPARE_WARPS),
            "solve": list(SOLVES),
            "key_group": [g for g in KEY_GROUPS if order3 and shape.key_widths[0] % g == 0] or [1],
            "dot_precision": list(BWD_PRECISIONS),
            "state_loop": [s for s in STATE_LOOPS if s == "streamed" or shape.key_dim <= MAX_KEY_DIM],
            "state_block_k": [b for b in STATE_BLOCK_KS if b <= shape.key_dim_pow2],
            "factor_grads": list(FACTOR_GRADS),
            "workspace_dtype": list(WORKSPACE_DTYPES) if shape.input_bytes == 2 else ["float32"],
            "grads_split": [False, True],
            "keep_forward": [False, True],
            "merge_passes": [False, True] if shape.key_dim > MAX_KEY_DIM else [False],
            "grads_block_v": [None] + [b for b in (16, 32, 64, 128) if b <= shape.value_dim_pow2],
        }

    def workspace_bytes(self, w: Workload) -> int:
        """Per (sequence, head): S and dS' of every chunk ([K, V] each in the products' type);
        per token the scores (fp32, C), U and dU (V each), stored phi gradients (K each: always at
        order 2, whose factor is phi); resident state loops: phi(K) and phi(Q) (the products'
        type, K each); streamed: the running state and state gradient (fp32, K V each, once);
        phi's gradients stored over phi (in its type, not ``grads_split``): phi's alone;
        with the delta rule the inverse (fp32, C) and R (V); with gates the cumulative log decay
        (fp32); ``grads_split``: dGq (and dGs) per token, C fp32 each, and with gates dc and
        each key block's share of it. U, R and dU take :meth:`value_bytes_per_element`, phi's
        gradients :meth:`phi_grad_bytes_per_element`. (The
        initial state's gradient, an output, is formed in an fp32 buffer of the state's size and
        cast to the state's dtype.)"""
        K, V, C = w.shape.key_dim, w.shape.value_width, self.chunk_size
        dot = dot_operand_bytes(w.shape.input_bytes)
        chunks = w.batch * w.heads * chunk_count(w, C)
        e = self.value_bytes_per_element(w.shape)
        phi_grads = 2 * self.phi_grad_bytes_per_element(w.shape) * K if self.phi_grads_stored(w.shape) else 0
        per_token = 4 * C + 2 * e * V
        running = 0
        if self.state_loop == "resident":
            per_token += 2 * K * dot if self.phi_grads_over_phi(w.shape) else 2 * K * dot + phi_grads
        else:
            per_token += phi_grads
            running = 2 * w.batch * w.heads * K * V * 4
        if w.delta_rule:
            per_token += 4 * C + e * V
        if w.forget_gate:
            per_token += 4
        if self.grads_split:  # dGq (and dGs), fp32 C each; dc and each key block's share of it
            per_token += 4 * C * (2 if w.delta_rule else 1)
            if w.forget_gate:  # parts: per key block stored, per side in registers
                parts = math.ceil(K / min(self.block_k, w.shape.key_dim_pow2)) if self.phi_grads_stored(w.shape) else 2
                per_token += 4 * (1 + parts)
        return 2 * chunks * K * V * dot + w.rows * per_token + running

    def value_bytes_per_element(self, shape: KernelShape) -> int:
        """Bytes of an element of U, R and dU (``workspace_dtype``)."""
        return shape.input_bytes if self.workspace_dtype == "inputs" else 4

    def phi_grad_bytes_per_element(self, shape: KernelShape) -> int:
        """Bytes of an element of phi's stored gradients (``workspace_dtype``)."""
        return 4 if self.workspace_dtype == "float32" else shape.input_bytes

    def phi_grads_over_phi(self, shape: KernelShape) -> bool:
        """Do phi's stored gradients go over phi's own workspaces (``launch_backward``)? When the
        one-pass gradients kernel stores them (not ``grads_split``), phi is there (the resident
        loops) and in the gradients' type (16-bit inputs with 16-bit workspaces, or fp32
        throughout): o3 16x16 B8 T4096 H8 bf16 forward + backward then peaked at 965 MiB
        against 1221 (H200)."""
        return (self.phi_grads_stored(shape) and self.state_loop == "resident" and not self.grads_split
                and self.phi_grad_bytes_per_element(shape) == dot_operand_bytes(shape.input_bytes))

    def phi_grads_stored(self, shape: KernelShape) -> bool:
        """Are phi's gradients stored ([T, K] each) and contracted by a fifth launch? (Order 2
        in registers stores them: its one factor is phi.)"""
        return self.factor_grads == "workspace" or (self.factor_grads == "registers" and len(shape.key_widths) == 1)

    def figures(self, w: Workload) -> CostFigures:
        # two sequential passes over the chunks (recompute, state gradient), the state crossing
        # HBM four times per chunk (S and dS' each stored and read once)
        stored = self.phi_grads_stored(w.shape)  # split: + the key-block (or two side) kernels and dg's
        return CostFigures(programs=chunk_programs(w, self.block_v), serial_steps=2 * chunk_count(w, self.chunk_size),
                           state_passes=4 * chunk_count(w, self.chunk_size), workspace_bytes=self.workspace_bytes(w),
                           launches=(5 if stored else 4) + ((2 if stored else 3) if self.grads_split else 0))


def shape_refusal(shape: KernelShape) -> str | None:
    """Why this pass of the backward cannot take ``shape``, or None."""
    if not shape.whole_factor_tiles:
        return (f"key widths {shape.key_widths}: the backward's configs take power-of-two key widths >= 16 "
                "(whole factor tiles); other widths train on materialised keys or zero-padded factors "
                "(chunk_backward_widths.py) under the padded shape's configs")
    return None


@functools.lru_cache(maxsize=1024)  # a pure function, resolved by every eager training call
def default_backward(shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES,
                     chunk_size: int | None = None, gated: bool = True) -> BackwardConfig:
    """The first proposal that passes its check (with ``chunk_size``, only its proposals), each
    with the fields measured for it (the numbers below): C 64, 32, 16 (16-bit inputs up to K =
    256: 32 first), 32 value columns, tf32 products for 16-bit inputs and ieee for fp32 (their
    tests ask 1e-4 of float64); up to K = 256 the resident loops, phi's gradients through the
    workspace, 16-bit workspaces for 16-bit inputs without a gate (``gated`` False) and the
    forward kept; above, the streamed loops and the factors' gradients in registers (through the
    workspace where the check refuses registers: order 2, a last width of 256 at order 3, of 128
    or more at order 4). The smallest tiles where nothing passes (:func:`supports` then refuses
    the problem with their check's reason)."""
    bv = min(32, shape.value_dim_pow2)
    streamed = shape.key_dim > MAX_KEY_DIM
    # key blocks: 128 at K = 256 through the workspace (gradients kernel 2.08 -> 1.93 ms at o3 16x16), else 64;
    # streamed, whole rows of the last width at one leading index (two: o3 32x32 3.87 -> 5.29 ms), four at
    # order 4, there in 4 warps (fwd+bwd o4 16^3 29.51 -> 20.37 ms; H200, 2026-12-03)
    last, K = (shape.key_widths[-1] if len(shape.key_widths) > 1 else 16), shape.key_dim_pow2
    order4 = len(shape.key_widths) == 3
    bk = max(16, last) * (4 if order4 else 1) if streamed else max(last, 128 if K >= 256 else min(64, K))
    # streamed, the factors' gradients in registers where the check lets a key block of whole last-width
    # rows through (<= 128 columns, <= 64 at order 4: fewer leading indices there); else through the
    # workspace (o3 16x256, o4 16x16x128), as order 2's split always (its one factor is phi: the check
    # refuses "registers" there as a duplicate). Registers' block_k 256 at o3 16x256 and 128 at o4
    # 16x16x32 were refused by the check, so every training call there failed after its forward (review)
    factor_grads = "registers"
    if streamed and order4 and bk > 64:
        bk = max(64, last)
    if streamed and (len(shape.key_widths) == 1 or bk > (64 if order4 else 128)):
        factor_grads = "workspace"
    group = 4 if len(shape.key_widths) >= 2 and shape.key_widths[0] % 4 == 0 else 1
    prec = "tf32" if shape.input_bytes == 2 else "ieee"
    # 16-bit workspaces for 16-bit inputs up to K = 256: o3 16x16 3.44 -> 3.29 ms, 1381 -> 1029 MiB,
    # bf16 error 4.3e-3 -> 5.2e-3 (H200, 76a95a8); o3 32x32 gained 1%, its dbeta error 2.1e-2 (> 2e-2).
    # Not with a gate: dg (fp32) sums differences of the rounded U, R, dU, and cancels: bf16 o2 16 dg
    # errors 9.5e-3 - 4.0e-2 over 6 seeds against 4e-7 - 1.3e-6 with fp32 workspaces (interpreter,
    # review), a model's forget-gate bias gradient 47% off. So with a gate "mixed": U, R, dU in fp32, phi's
    # gradients 16-bit: o3 16x16 1.92 -> 2.13 ms, 965 -> 1061 MiB (all fp32: 2.35 ms, 1573; H100, 2c06d2b); a tuned
    # entry may still pick "inputs" (the train tuner's gradient gate decides)
    ws = ("mixed" if gated else "inputs") if shape.input_bytes == 2 and not streamed else "float32"
    # phi's gradients through a [T, K] workspace up to K = 256 (o3 16x16 fwd+bwd 2.07 ms, 965 MiB at
    # 95f8c83); above, in registers: o3 32x32 9.63 ms, 1393 MiB against 13.46, 3441 stored (a3f20ec)
    # streamed: 256-row tiles, all trailing axes, so phi blocks are factor rows' outer products (o4 16^3, 128 gathered:
    # 61 ms); o3 128 -> 256 (prefetch_state_tiles): kernels 32x32 5.10 -> 4.80 ms, 64x64 20.68 -> 18.80 (H200, 12-03)
    tile = 256 if streamed and len(shape.key_widths) >= 2 else min(256, max(128, math.prod(shape.key_widths[1:])))
    # streamed: one stage, as the streamed forward (its 256-row tiles need the memory); the forward
    # kept and, at K >= 4096, the passes merged: fwd+bwd o3 32x32 8.10 -> 7.02 ms (merged slower),
    # o3 64x64 28.31 -> 24.20 -> 22.46, o4 16^3 43.51 -> 43.05, peaks unchanged (H200, e3a92b7); the
    # gradients kernel split, one side's factors per program: fwd+bwd o3 32x32 4.88 -> 4.63 ms, 64x64
    # 19.12 -> 18.49 (17.41 at d1c1993), o4 16^3 19.19 -> 18.90, peaks +131 MiB (H200, same call)
    loop = {"state_loop": "streamed", "state_block_k": tile, "num_stages": 1, "keep_forward": True,
            "merge_passes": shape.key_dim_pow2 >= 4096, "grads_split": True, "factor_grads": factor_grads} if streamed \
        else {"factor_grads": "workspace", "state_block_k": min(tile, shape.key_dim_pow2)}  # unused: in the space
    order = ((64, 8), (64, 4), (32, 8), (32, 4), (16, 4)) if streamed else ((64, 4), (64, 8), (32, 4), (32, 8), (16, 4))
    # 16-bit inputs up to K = 256, chunks of 32: the train tuner's winner at o3 16x16 B8 T4096 (422
    # trials, all through the gradient gate): 4 warps and 3 stages in the gradients kernel, one warp
    # preparing. fwd+bwd 3.23 -> 2.35 ms at o3 16x16, o2 64 2.51 -> 2.26, o2 128 2.58 -> 2.34, o2
    # 256 3.89 -> 3.87 (H200, 2026-12-02, dd966ea; fla 3.58 in the run that timed the winner)
    tuned = shape.input_bytes == 2 and not streamed
    order = ((32, 4), (32, 8), (64, 4), (64, 8), (16, 4)) if tuned else order
    # there, at K = 256 one key block of 256 columns: o3 16x16 gradients kernel 0.793 -> 0.735 ms (60
    # registers spilled against 8); order 2 from K = 128 with its factor's gradient contracted there
    # (factor_grads="rows", no fifth launch): fwd+bwd kernels o2 128 1.655 -> 1.490 ms (o2 64 1.115 ->
    # 1.133: not taken), and its prepare in 2 warps at K = 256 (its K x K Gram in one warp spilled 460
    # registers: 1.067 -> 0.338 ms; 4 warps 0.369; at K = 128 one warp stays, 0.175 against 0.190): o2
    # 256 3.258 -> 2.367 ms with both; o3 16x16 1.854 -> 1.802 (kernel sums, H200, 2026-12-04)
    order2 = tuned and len(shape.key_widths) == 1 and K >= 128
    c32 = {"grads_warps": 4, "grads_stages": 3, "num_stages": 3, "prepare_warps": 2 if order2 and K >= 256 else 1,
           "keep_forward": True, "block_k": K if K >= 256 or order2 else bk,
           "factor_grads": "rows" if order2 else "workspace"}
    # ... and the forward keeps the prepare and state loop for the backward (keep_forward): fwd+bwd o3 16x16
    # 2.73 -> 2.01 ms, o2 64 2.76 -> 1.55, o2 256 3.85 -> 3.25, peak 1221 MiB either way (H200, 9e68a27)
    # streamed: the gradients kernel steps 64 value columns (not order 4) in 4 warps where the check lets it:
    # o3 32x32 6.40 -> 5.74 ms (64x64, refused: 21.2 -> 28.1; H200, 2026-12-03)
    grads_bvs = (64, None) if streamed and shape.value_dim_pow2 >= 64 else (None,)
    for (C, warps), gbv, gw in itertools.product(order + ((16, 8),), grads_bvs, (4, 8) if streamed else (8,)):
        kernels = {**loop, "grads_warps": gw, "prepare_warps": 4, "block_k": bk}
        if tuned and C == 32:
            kernels.update(c32)
        cfg = BackwardConfig(chunk_size=C, block_v=bv, num_warps=warps, key_group=group, dot_precision=prec,
                             workspace_dtype=ws, grads_block_v=gbv, **kernels)
        if (chunk_size is None or C == chunk_size) and cfg.check(shape, smem_limit) is None:
            return cfg
    # the smallest tiles: returned even where its check refuses them (the caller reports why; supports()
    # asks this function first, so a training call is refused before its forward runs)
    return BackwardConfig(chunk_size=chunk_size or 16, block_v=16, block_k=bk, workspace_dtype=ws, **{**loop, "state_block_k": 16})


@functools.lru_cache(maxsize=None)
def smem_limits(device: torch.device) -> tuple[int, int]:
    """(the shared memory the default is sized for, the limit its check applies) on ``device``:
    the GPU's opt-in limit twice; elsewhere (the interpreter) a 99 KiB device's default, unchecked.
    Read once per device (every training call asks, through :func:`supports`)."""
    if device.type == "cuda":
        limit = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
        return limit, limit
    return DEFAULT_SMEM_BYTES, 10**9


def supports(p: Problem, cu_seqlens) -> str | None:
    """None when the Triton backward can run the problem, else the reason (a sentence): asked
    before a training call's forward runs, so the backward's default config is checked here (a
    refusal after the forward is the worst outcome: backend='auto' could not fall back)."""
    if p.order > 4:
        return f"order {p.order}: the Triton kernels take orders 2-4"
    if p.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {p.dtype}: the Triton backward takes float16, bfloat16 and float32 inputs"
    # any widths: tiled, materialised or zero-padded (chunk_backward_widths.py), under the rewritten shape's config
    return _default_refusal(KernelShape(rewritten_widths(p.key_widths), p.value_width, p.dtype.itemsize), p.device)


@functools.lru_cache(maxsize=256)
def _default_refusal(shape: KernelShape, device: torch.device) -> str | None:
    """Why ``shape``'s default backward cannot run on ``device`` (None: it can); found once."""
    limit, check_limit = smem_limits(device)
    if (reason := checked(default_backward(shape, limit), shape, check_limit)) is not None:
        return f"no backward config runs key widths {shape.key_widths} with d_v {shape.value_width} here: {reason}"
    return None


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
    if not tiled(shape):  # an exact rewrite onto widths the kernels tile
        rewrite = materialised_bwd if materialised_keys(shape) else padded_bwd
        return rewrite(running_tensor_bwd, p, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       cu_seqlens=cu_seqlens, l2norm=l2norm, do=do, dht=dht, chunk_size=chunk_size, variant=variant)
    config = resolve_backward(shape, variant, chunk_size, v.device, p, gated=g is not None)
    # strided inputs (slices of a fused projection) are copied once here, as the forward's
    # launcher does (args.contiguous_inputs says why); the gradients are allocated with the
    # inputs' shapes, contiguous, which autograd accumulates into views of any layout
    q, k, v, g, beta, initial_state, cu_seqlens = contiguous_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    return launch_backward(config, p, q, k, v, g, beta, initial_state, cu_seqlens, l2norm, do.contiguous(),
                           None if dht is None else dht.contiguous())


def resolve_backward(shape: KernelShape, variant, chunk_size: int | None, device: torch.device,
                     p: Problem | None = None, gated: bool = True) -> BackwardConfig:
    """``variant`` (checked), else the tuned table's for ``p``'s shape bucket (kernel
    "chunk_bwd"; only when ``chunk_size`` is not given, as the forward's launcher does), else
    the default (with ``chunk_size`` when given; ``gated``: the call has a gate g). A tuned
    entry this version cannot read or that fails its check here is ignored: the table is advice.
    A ``chunk_size`` the forward takes but no default of the backward runs (128; 64 past the
    resources) gives way to the backward's own choice: the backward's chunk length changes how
    it computes the gradient, not the gradient, and a training call's forward has run by then."""
    limit, check_limit = smem_limits(device)
    if variant is None and chunk_size is not None:
        if isinstance(chunk_size, bool) or chunk_size not in CHUNK_SIZES:
            raise ValueError(f"chunk_size: {chunk_size!r} cannot run the backward; allowed: "
                             f"{', '.join(map(str, BWD_CHUNK_SIZES))} or None (its own choice)")
        if chunk_size not in BWD_CHUNK_SIZES \
                or checked(default_backward(shape, limit, chunk_size, gated=gated), shape, check_limit) is not None:
            chunk_size = None
    if variant is None and chunk_size is None and p is not None:
        variant = tuned_backward(p, device)
        if variant is not None and checked(variant, shape, check_limit) is not None:
            variant = None
    if variant is None:
        variant = default_backward(shape, limit, chunk_size, gated=gated)
    elif not isinstance(variant, BackwardConfig):
        raise TypeError(f"variant: expected a BackwardConfig, got {type(variant).__name__}")
    elif chunk_size is not None and chunk_size != variant.chunk_size:
        raise ValueError(f"chunk_size: {chunk_size} conflicts with the variant's {variant.chunk_size}; give one")
    if (reason := checked(variant, shape, check_limit)) is not None:
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


def launch_backward(config: BackwardConfig, p: Problem, q, k, v, g, beta, h0, cu_seqlens, l2norm: bool, do, dht,
                    kept: Recomputed | None = None):
    """Steps 1-5 (the module docstring) on contiguous inputs, checked (``running_tensor_bwd``
    checks them); ``kept``: the forward's prepare and state loop
    (``chunk_backward_kept.forward_kept``), so steps 1 and 2 are not run again."""
    B, T, H, V = v.shape
    C, K, dev = config.chunk_size, p.key_dim, v.device
    varlen = cu_seqlens is not None
    prec = config.dot_precision
    store = phi_grads_dtype(config, v)  # phi's stored gradients (U, R, dU: the recompute's and state loop's)
    if kept is None:  # 1. prepare: P, T, c (and for the resident loops phi(K), phi(Q)); 2. the recompute
        kept = recompute(config, p, q, k, v, g, beta, h0, cu_seqlens, l2norm)
    dHc, dUc, dh0 = state_grads(config, p, q, k, v, beta, h0, cu_seqlens, l2norm, kept, do, dht)
    ws, Hc, Uc, Rc, idx, n_chunks = kept.ws, kept.Hc, kept.Uc, kept.Rc, kept.idx, kept.n_chunks
    del kept
    # 4. dv, dbeta, dg and every factor's gradient (or phi's, to dQp / dKp), chunk-parallel
    dq = [args.empty(x.shape, dtype=x.dtype, device=dev) for x in q]
    dk = [args.empty(x.shape, dtype=x.dtype, device=dev) for x in k]
    shape = KernelShape(p.key_widths, V, v.element_size())
    stored = config.phi_grads_stored(shape)
    dQp = dKp = None
    if config.phi_grads_over_phi(shape):  # the one-pass kernel reads each block of phi, then writes over it
        dQp, dKp = ws["Qw"], ws["Kw"]
    elif stored:
        dQp, dKp = (args.empty(B, H, T, K, dtype=store, device=dev) for _ in range(2))
    dv = args.empty(v.shape, dtype=v.dtype, device=dev)
    dg = args.empty(g.shape, dtype=g.dtype, device=dev) if g is not None else None
    dbeta = args.empty(beta.shape, dtype=beta.dtype, device=dev) if beta is not None else None
    widths = {n: w for n, w in width_args(p.key_widths, 16).items() if not n.startswith("BD")}
    grid = (idx.shape[0], H) if varlen else (n_chunks[0], B * H)
    if config.grads_split:
        tensors = GradsTensors(q=q, k=k, v=v, g=g, beta=beta, do=do, ws=ws, Hc=Hc, dHc=dHc, Uc=Uc, Rc=Rc, dUc=dUc,
                               dQp=dQp, dKp=dKp, dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, cu_seqlens=cu_seqlens,
                               idx=idx)
        split_grads(config, p, tensors, grid, widths, l2norm)
        del tensors
    else:
        cached(chunk_bwd_grads_kernel)[grid](
            *factor_args(q), *factor_args(k), ws["Qw"], ws["Kw"], ws["P"], ws["Ai"], ws["Gc"], v, beta, do, Hc, dHc, Uc,
            Rc, dUc, *factor_args(dq), *factor_args(dk), dQp, dKp, dv, dg, dbeta, cu_seqlens, idx, p.scale, T,
            H=H, NF=len(q), **widths, V=V, C=C, BK=min(config.block_k, K), BV=config.grads_bv, L2NORM=l2norm,
            ROWS=config.factor_grads == "rows", PREC=prec,
            num_warps=config.grads_warps, num_stages=config.grads_stages,
        )
    ws["Qw"] = ws["Kw"] = None  # no longer phi where its gradients went over it
    del ws, Hc, dHc, Uc, Rc, dUc
    if stored:  # 5. phi's gradients to the factors, through the l2norm, token-parallel
        rows = B * T * H
        bt = max(1, min(256, MATERIALISE_TILE // K))  # [rows, K] fp32 tiles of 4096 elements
        cached(phi_grads_to_factors_kernel)[(triton.cdiv(rows, bt),)](
            *factor_args(q), *factor_args(k), dQp, dKp, *factor_args(dq), *factor_args(dk), rows, T, H=H,
            NF=len(q), **widths, BT=bt, L2NORM=l2norm, num_warps=4,
        )
    if dh0 is not None and dh0.dtype != h0.dtype:
        dh0 = dh0.to(h0.dtype)
    return dq, dk, dv, dg, dbeta, dh0
