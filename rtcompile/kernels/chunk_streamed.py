"""The streamed chunk form: a chunk-parallel prepare kernel (``chunk_prepare.py``) writes each
chunk's scores and inverse, then one sequential program per (sequence, head, value block) walks
the chunks with the state in the final-state buffer, visiting it in [block_k, block_v] tiles
(read twice and written once per chunk, once each with ``merge_passes``): the form for states
too wide for registers, whose workspace does not grow with the state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from .config import (
    CHUNK_MAX_EST_REGS, DEFAULT_SMEM_BYTES, DOT_PRECISIONS, PREPARE_WARPS, SOLVES, CostFigures, KernelConfig,
    KernelShape, Workload, chunk_count, chunk_live_elements, chunk_programs, chunk_refusal, chunk_smem_estimate,
    estimate_registers, two_kernel_workspace,
)


@dataclass(frozen=True)
class StreamedConfig(KernelConfig):
    """Prepare kernel + a sequential kernel streaming the state in key tiles.

    ``block_k`` (< K): rows of a state tile. ``prefetch_state``: issue each state tile's load one
    tile ahead (without it every tile waited for its own load: ~1.2 TB/s of state traffic at o3
    64x64 on the H200). ``merge_passes``: the update pass of chunk c also forms chunk c+1's
    products from each updated tile while it is in registers, so the state is read once per
    chunk instead of twice (o3 64x64 on the H200: 6.49 ms against 7.20). The other fields as in
    :class:`~rtcompile.kernels.chunk_resident.ResidentConfig`.
    """

    kernel: ClassVar[str] = "chunk"
    form: ClassVar[str] = "streamed"
    chunk_size: int
    block_k: int
    block_v: int
    num_warps: int = 4
    num_stages: int = 1
    prepare_warps: int = 4
    solve: str = "tiles"
    dot_precision: str = "ieee"
    prefetch_state: bool = False
    merge_passes: bool = False

    def resident(self, shape: KernelShape) -> bool:
        return False

    def check(self, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> str | None:
        if (reason := chunk_refusal(self, shape)) is not None:
            return reason
        if (reason := self._check_pow2("block_k")) is not None:
            return reason
        if not 16 <= self.block_k < shape.key_dim:
            return (f"block_k={self.block_k}; allowed: 16 <= block_k < K = {shape.key_dim} (a state that fits "
                    "one tile is ResidentConfig's)")
        if (regs := self.estimate_registers(shape)) > CHUNK_MAX_EST_REGS:
            return f"~{regs} registers per thread estimated (> {CHUNK_MAX_EST_REGS})"
        if (smem := self.estimate_smem(shape)) > smem_limit:
            return f"~{smem} bytes of shared memory (> {smem_limit})"
        return None

    def estimate_registers(self, shape: KernelShape) -> int:
        live = chunk_live_elements(shape, self.chunk_size, self.block_k, self.block_v)
        if self.prefetch_state:  # the next state tile
            live += self.block_k * self.block_v
        if self.merge_passes:  # the next chunk's two products, carried
            live += 2 * self.chunk_size * self.block_v
        return estimate_registers(live, self.num_warps)

    def estimate_smem(self, shape: KernelShape) -> int:
        return chunk_smem_estimate(self.chunk_size, self.block_k, self.block_v, self.num_stages)

    @classmethod
    def space(cls, shape: KernelShape) -> dict[str, list]:
        tiles = [b for b in (16, 32, 64, 128, 256, 512, 1024) if b < shape.key_dim]
        if not tiles:
            return {}  # K <= 16: one tile holds the state
        return {
            "chunk_size": [16, 32, 64, 128],
            "block_k": tiles,
            "block_v": [b for b in (16, 32, 64) if b <= shape.value_dim_pow2],
            "num_warps": [2, 4, 8],
            "num_stages": [1, 2, 3],
            "prepare_warps": list(PREPARE_WARPS),
            "solve": list(SOLVES),
            "dot_precision": list(DOT_PRECISIONS),
            "prefetch_state": [False, True],
            "merge_passes": [False, True],
        }

    def workspace_bytes(self, w: Workload) -> int:
        return two_kernel_workspace(self, w)

    def figures(self, w: Workload) -> CostFigures:
        n = chunk_count(w, self.chunk_size)
        return CostFigures(programs=chunk_programs(w, self.block_v), serial_steps=n,
                           state_passes=(2 if self.merge_passes else 3) * n, workspace_bytes=self.workspace_bytes(w),
                           tile_visits=2 * math.ceil(w.shape.key_dim / self.block_k),
                           tile_elements=self.chunk_size * self.block_k, launches=2)
