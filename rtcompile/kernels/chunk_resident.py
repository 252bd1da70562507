"""The register-resident chunk form: a chunk-parallel prepare kernel (``chunk_prepare.py``)
writes each chunk's scores and inverse, then one sequential program per (sequence, head, value
block) walks the chunks with the whole [K, block_v] state tile in registers (read once, written
once per call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .config import (
    CHUNK_MAX_EST_REGS, DEFAULT_SMEM_BYTES, DOT_PRECISIONS, PREPARE_WARPS, SOLVES, CostFigures, KernelConfig,
    KernelShape, Workload, chunk_count, chunk_live_elements, chunk_programs, chunk_refusal, chunk_smem_estimate,
    estimate_registers, two_kernel_workspace,
)


@dataclass(frozen=True)
class ResidentConfig(KernelConfig):
    """Prepare kernel + a sequential kernel holding the state tile in registers.

    ``chunk_size`` C: tokens per chunk. ``block_v``: the state tile's value columns (the key
    tile is all of K, rounded up to a power of two). ``num_warps``/``num_stages``: the
    sequential kernel's. ``prepare_warps``: the prepare kernel's (its programs are independent,
    so fewer warps each let more of them share an SM). ``solve``: the delta rule's (I + A)^-1 row
    by row in registers ("rows") or in [16, 16] tiles in the prepare kernel's workspace
    ("tiles", C <= 64). ``dot_precision``: how fp32 operands enter tl.dot (16-bit inputs use
    their own type). ``prefetch_inputs``: load the next chunk's factor tiles, values, gates and
    prepared scores before the current chunk's arithmetic, so their latency hides behind it
    (needs power-of-two key widths >= 16: a factor tile is then exactly one load).
    ``wy``: the prepare kernel applies the solve (W = Ai diag(b Gamma) phi(K), U0 = Ai diag(b) V,
    a [T, K] and a [T, V] workspace), leaving two products on the sequential chain instead of
    three (o2 64 on the H200: 0.415 ms with prefetch + wy, 0.574 with prefetch alone).
    """

    kernel: ClassVar[str] = "chunk"
    form: ClassVar[str] = "resident"
    chunk_size: int
    block_v: int
    num_warps: int = 4
    num_stages: int = 1
    prepare_warps: int = 4
    solve: str = "tiles"
    dot_precision: str = "ieee"
    prefetch_inputs: bool = False
    wy: bool = False

    def block_k(self, shape: KernelShape) -> int:
        return shape.key_dim_pow2

    def resident(self, shape: KernelShape) -> bool:
        return True

    def check(self, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> str | None:
        if (reason := chunk_refusal(self, shape)) is not None:
            return reason
        if self.prefetch_inputs and not shape.whole_factor_tiles:
            return f"prefetch_inputs=True needs power-of-two key widths >= 16, got {shape.key_widths}"
        if (regs := self.estimate_registers(shape)) > CHUNK_MAX_EST_REGS:
            return f"~{regs} registers per thread estimated (> {CHUNK_MAX_EST_REGS}): K = {shape.key_dim} is too wide to keep in registers (use StreamedConfig)"
        if (smem := self.estimate_smem(shape)) > smem_limit:
            return f"~{smem} bytes of shared memory (> {smem_limit})"
        return None

    def estimate_registers(self, shape: KernelShape) -> int:
        C, bk, bv = self.chunk_size, self.block_k(shape), self.block_v
        live = chunk_live_elements(shape, C, bk, bv)
        if self.prefetch_inputs:  # the next chunk's factor tiles, values, P and Ai
            live += 2 * C * sum(shape.key_widths) + C * bv + 2 * C * C
        if self.wy:  # the W rows and U0 block (twice with prefetch: this chunk's and the next)
            live += (C * bk + C * bv) * (2 if self.prefetch_inputs else 1)
        return estimate_registers(live, self.num_warps)

    def estimate_smem(self, shape: KernelShape) -> int:
        return chunk_smem_estimate(self.chunk_size, self.block_k(shape), self.block_v, self.num_stages)

    @classmethod
    def space(cls, shape: KernelShape) -> dict[str, list]:
        if cls(chunk_size=16, block_v=16, num_warps=8).check(shape, 1 << 30) is not None:
            return {}  # even the smallest tile does not fit registers
        return {
            "chunk_size": [16, 32, 64, 128],
            "block_v": [b for b in (16, 32, 64) if b <= shape.value_dim_pow2],
            "num_warps": [2, 4, 8],
            "num_stages": [1, 2, 3],
            "prepare_warps": list(PREPARE_WARPS),
            "solve": list(SOLVES),
            "dot_precision": list(DOT_PRECISIONS),
            "prefetch_inputs": [False, True] if shape.whole_factor_tiles else [False],
            "wy": [False, True],
        }

    def workspace_bytes(self, w: Workload) -> int:
        return two_kernel_workspace(self, w, wy=self.wy)

    def figures(self, w: Workload) -> CostFigures:
        return CostFigures(programs=chunk_programs(w, self.block_v), serial_steps=chunk_count(w, self.chunk_size),
                           state_passes=2, workspace_bytes=self.workspace_bytes(w), launches=2)
