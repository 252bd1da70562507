"""The fused chunk form: no prepare kernel and no workspace that grows with T. Each sequential
program computes its chunk's scores and the delta rule's inverse itself (in a [C, C] scratch of
its own with the tile solve), then updates the state, held in registers when ``block_k`` covers
K and streamed in tiles otherwise. The planner's low-memory choice.

This form has no kernel of its own: :func:`launch` runs ``chunk_resident_kernel`` or
``chunk_streamed_kernel`` with SCORES set to the solve ("rows", "tiles" or "products"), which
forms the scores and the inverse inside the sequential loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import triton

from . import args
from .chunk_resident import run_resident
from .chunk_streamed import run_streamed
from .config import (
    DEFAULT_SMEM_BYTES, SOLVES, CostFigures, KernelConfig, KernelShape, Workload, chunk_count,
    chunk_programs, chunk_refusal, chunk_smem_estimate, estimate_registers, resource_refusal, streamed_live_elements,
)
from .inputs import Problem


@dataclass(frozen=True)
class FusedConfig(KernelConfig):
    """One sequential kernel that also forms the scores and the inverse.

    ``block_k``: the state tile's rows; the state stays in registers when it covers K, and is
    streamed from the final-state buffer otherwise (then ``prefetch_state`` and
    ``merge_passes`` mean what they mean in
    :class:`~rtcompile.kernels.chunk_streamed.StreamedConfig`). ``solve``: "rows" in registers,
    or "tiles" through a [C, C] fp32 scratch per program (o3 32x32 on the H200: 3.43 ms against
    8.44 for the register strip solve), or "products" in registers by [C, C] products (not timed
    in this form; at ieee, FMA products). The scores and the solve stay fp32 at ieee precision:
    with 16-bit operands there (C 64, BK 128, 8 warps, o3 64x64) the H200 returned wrong results
    and then an illegal address (Triton 3.6), and tf32 with the tile solve an illegal address.
    """

    kernel: ClassVar[str] = "chunk"
    form: ClassVar[str] = "fused"
    chunk_size: int
    block_k: int
    block_v: int
    num_warps: int = 4
    num_stages: int = 1
    solve: str = "tiles"
    prefetch_state: bool = False
    merge_passes: bool = False

    def resident(self, shape: KernelShape) -> bool:
        return self.block_k >= shape.key_dim

    def check(self, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> str | None:
        if (reason := chunk_refusal(self, shape)) is not None:
            return reason
        if (reason := self._check_pow2("block_k")) is not None:
            return reason
        if not 16 <= self.block_k <= shape.key_dim_pow2:
            return f"block_k={self.block_k}; allowed: 16 .. {shape.key_dim_pow2} (K rounded up)"
        if self.resident(shape) and (self.prefetch_state or self.merge_passes):
            return (f"prefetch_state / merge_passes need a streamed state (block_k < K = {shape.key_dim}), "
                    f"got block_k={self.block_k}")
        return resource_refusal(self, shape, smem_limit)

    def estimate_registers(self, shape: KernelShape) -> int:
        return estimate_registers(streamed_live_elements(shape, self), self.num_warps)

    def estimate_smem(self, shape: KernelShape) -> int:
        return chunk_smem_estimate(self.chunk_size, self.block_k, self.block_v, self.num_stages)

    @classmethod
    def space(cls, shape: KernelShape) -> dict[str, list]:
        kp = shape.key_dim_pow2
        streamed = shape.key_dim > 16
        return {
            "chunk_size": [16, 32, 64, 128],
            "block_k": sorted({min(kp, b) for b in (16, 32, 64, 128, 256, kp)}),
            "block_v": [b for b in (16, 32, 64) if b <= shape.value_dim_pow2],
            "num_warps": [2, 4, 8],
            "num_stages": [1, 2, 3],
            "solve": list(SOLVES),
            "prefetch_state": [False, True] if streamed else [False],
            "merge_passes": [False, True] if streamed else [False],
        }

    def solve_rows(self) -> float:
        """Serial solve steps per chunk, in forward-substitution rows: C for the row solve; for
        the tile solve 15 rows in the diagonal blocks and one per later block row (a guess, not
        fitted: the fused tile solve ran 2.3x faster than the strip form at o3 32x32); for the
        product solve one per [C, C] product on its chain (5 for the diagonal blocks, C / 16
        more above C = 16; a guess too)."""
        if self.solve == "rows":
            return self.chunk_size
        nb = self.chunk_size // 16
        return 15 + nb - 1 if self.solve == "tiles" else 5 + (nb if nb > 1 else 0)

    def workspace_bytes(self, w: Workload) -> int:
        if self.solve == "tiles" and w.delta_rule:  # the tile solve's [C, C] fp32 scratch per program
            return chunk_programs(w, self.block_v) * self.chunk_size ** 2 * 4
        return 0

    def figures(self, w: Workload) -> CostFigures:
        n = chunk_count(w, self.chunk_size)
        resident = self.resident(w.shape)
        return CostFigures(
            programs=chunk_programs(w, self.block_v), serial_steps=n,
            state_passes=2 if resident else (2 if self.merge_passes else 3) * n,
            workspace_bytes=self.workspace_bytes(w),
            tile_visits=0 if resident else 2 * math.ceil(w.shape.key_dim / self.block_k),
            tile_elements=self.chunk_size * self.block_k,
            solve_rows=self.solve_rows() if w.delta_rule else 0.0, launches=1)


def launch(config: FusedConfig, p: Problem, q, k, v, g, beta, *, h0, ht, cu_seqlens, l2norm: bool) -> torch.Tensor:
    """Run ``config`` on checked inputs (``p`` from ``check_inputs``); ``ht``: None, or the fp32
    final-state buffer to store into (a streamed state lives there while the kernel runs:
    without one a buffer of its own is allocated). Returns o."""
    ws = {}
    if config.solve == "tiles" and beta is not None:
        # the tile solve's scratch: one [C, C] per program, whatever T (2 MiB at B8 H8 C64 BV32)
        programs = triton.cdiv(p.value_width, config.block_v) * p.num_seqs * p.heads
        ws["Ai"] = args.empty(programs, config.chunk_size, config.chunk_size, dtype=torch.float32, device=v.device)
    common = dict(h0=h0, cu_seqlens=cu_seqlens, l2norm=l2norm, chunk_size=config.chunk_size, block_k=config.block_k,
                  block_v=config.block_v, num_warps=config.num_warps, num_stages=config.num_stages,
                  precision="ieee", scores=config.solve, ws=ws)
    if config.block_k >= p.key_dim:
        return run_resident(p, q, k, v, g, beta, ht=ht, prefetch=False, **common)
    if ht is None:
        ht = args.empty(p.state_shape, dtype=torch.float32, device=v.device)
    return run_streamed(p, q, k, v, g, beta, ht=ht, prefetch_state=config.prefetch_state,
                        merge_passes=config.merge_passes, **common)
