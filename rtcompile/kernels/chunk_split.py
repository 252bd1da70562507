"""The split chunk form: three kernels. The chunk-parallel prepare kernel (``chunk_prepare.py``)
stores each chunk's inverse, its normalised phi(K) and its cumulative log decay; a sequential
state loop carries only the state (in registers), storing the incoming state of every
``state_stride``-th chunk and each chunk's U; a chunk-parallel output kernel forms the scores
and the outputs of all chunks at once. The sequential chain is then three products per chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from .config import (
    CHUNK_MAX_EST_REGS, DEFAULT_SMEM_BYTES, DOT_PRECISIONS, PREPARE_WARPS, SOLVES, CostFigures, KernelConfig,
    KernelShape, Workload, chunk_count, chunk_programs, chunk_refusal, dot_operand_bytes, estimate_registers,
)

OUTPUT_BLOCK_VS = (16, 32, 64)
STATE_STRIDES = (1, 2, 4)
KEY_GROUPS = (1, 2, 4)  # (8: the prepare kernel 0.25 ms, twice 2's, on the H200)
OUTPUT_WARPS = (2, 4, 8)


@dataclass(frozen=True)
class SplitConfig(KernelConfig):
    """Prepare kernel + state-only sequential loop + chunk-parallel output kernel.

    ``chunk_size``, ``block_v``, ``num_warps``, ``num_stages`` (>= 2: with one stage the loop's
    phi(K) loads ended in an illegal address on the H200, Triton 3.6): the state loop's.
    ``prepare_warps``, ``solve``, ``dot_precision``: as in ResidentConfig. ``output_block_v`` /
    ``output_warps``: the output kernel's value tile and warps (o3 16x16 C 64 on the H200:
    0.084 ms with 64 columns and 4 warps, 0.102 with 64 and 2, 0.135 with 32 and 4).
    ``tma``: the state loop reads phi(K) and the inverse and stores each chunk's state through
    tensor descriptors (sm_90 or newer; rows of 16-byte multiples; H200: loop 0.149 ms against
    0.164). ``key_group``: indices of key axis 1 per phi(K) store of the prepare kernel (order
    >= 3; 0.122 ms with 2, 0.136 with 1). ``state_stride``: the loop stores the state of every
    1st, 2nd or 4th chunk and the output kernel adds the chunks between as cross-chunk scores
    (loop 0.150 / 0.136 / 0.124 ms, outputs 0.084 / 0.092 / 0.115; 2 also cuts the workspace
    from 353 to 289 MiB at o3 16x16 B8 T4096 H8).
    """

    kernel: ClassVar[str] = "chunk"
    form: ClassVar[str] = "split"
    chunk_size: int
    block_v: int
    num_warps: int = 4
    num_stages: int = 2
    prepare_warps: int = 1
    solve: str = "tiles"
    dot_precision: str = "ieee"
    output_block_v: int = 16
    output_warps: int = 4
    tma: bool = False
    key_group: int = 1
    state_stride: int = 1

    def block_k(self, shape: KernelShape) -> int:
        return shape.key_dim_pow2

    def resident(self, shape: KernelShape) -> bool:
        return True

    def check(self, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> str | None:
        if (reason := chunk_refusal(self, shape)) is not None:
            return reason
        if not shape.whole_factor_tiles:
            return f"the split form needs power-of-two key widths >= 16, got {shape.key_widths}"
        if self.num_stages < 2:
            return f"num_stages={self.num_stages}; allowed: 2, 3 or 4 (one stage failed on the H200)"
        for name, allowed in (("output_warps", OUTPUT_WARPS), ("state_stride", STATE_STRIDES),
                              ("key_group", KEY_GROUPS)):
            if (reason := self._check_choice(name, allowed)) is not None:
                return reason
        if self.output_block_v not in OUTPUT_BLOCK_VS or self.output_block_v > shape.value_dim_pow2:
            allowed = ", ".join(str(b) for b in OUTPUT_BLOCK_VS if b <= shape.value_dim_pow2)
            return f"output_block_v={self.output_block_v}; allowed: {allowed}"
        if self.key_group > 1 and (len(shape.key_widths) < 2 or shape.key_widths[0] % self.key_group):
            return (f"key_group={self.key_group} needs order >= 3 and a first key width it divides, got widths "
                    f"{shape.key_widths} (or key_group=1)")
        dot = dot_operand_bytes(shape.input_bytes)
        if self.tma and (shape.key_dim * dot % 16 or shape.value_width * dot % 16):
            return (f"tma=True needs rows of 16-byte multiples (K = {shape.key_dim}, d_v = {shape.value_width} at "
                    f"{dot} bytes); allowed: tma=False")
        if (regs := self.estimate_registers(shape)) > CHUNK_MAX_EST_REGS:
            return f"~{regs} registers per thread estimated (> {CHUNK_MAX_EST_REGS})"
        if (smem := self.estimate_smem(shape)) > smem_limit:
            return f"~{smem} bytes of shared memory (> {smem_limit})"
        return None

    def estimate_registers(self, shape: KernelShape) -> int:
        # the state loop: state, phi(K), the inverse and the next one, values, U, the products
        C, bk, bv = self.chunk_size, self.block_k(shape), self.block_v
        live = bk * bv + C * bk + 2 * C * C + 4 * C * bv + 2 * C * sum(shape.key_widths)
        return estimate_registers(live, self.num_warps)

    def estimate_smem(self, shape: KernelShape) -> int:
        # per stage the loop's loads that feed products (stored phi(K) in the input type, the fp32
        # inverse), plus the 16-bit state and U staged for the products. H200, o3 16x16 C 64:
        # 3 and 4 stages ran (this model: 172032 and 221184 bytes)
        C, bk, bv = self.chunk_size, self.block_k(shape), self.block_v
        return max(1, self.num_stages) * (C * bk * shape.input_bytes + 4 * C * C) + 2 * bk * bv + 4 * C * bv

    @classmethod
    def space(cls, shape: KernelShape) -> dict[str, list]:
        # measured only up to K = 256; wider states stream better (StreamedConfig)
        if not shape.whole_factor_tiles or shape.key_dim > 256:
            return {}
        order3 = len(shape.key_widths) >= 2
        return {
            "chunk_size": [16, 32, 64],
            "block_v": [b for b in (16, 32, 64) if b <= shape.value_dim_pow2],
            "num_warps": [2, 4, 8],
            "num_stages": [2, 3, 4],
            "prepare_warps": list(PREPARE_WARPS),
            "solve": list(SOLVES),
            "dot_precision": list(DOT_PRECISIONS),
            "output_block_v": [b for b in OUTPUT_BLOCK_VS if b <= shape.value_dim_pow2],
            "output_warps": list(OUTPUT_WARPS),
            "tma": [False, True],
            "key_group": [g for g in KEY_GROUPS if order3 and shape.key_widths[0] % g == 0] or [1],
            "state_stride": list(STATE_STRIDES),
        }

    def workspace_bytes(self, w: Workload) -> int:
        """The incoming state of every state_stride-th chunk [K, V] and U [T, V] in the products'
        type, the inverse [T, C] fp32 (delta rule), the stored phi(K) [T, K] in the products'
        type and the gates' cumulative sums [T] fp32."""
        dot = dot_operand_bytes(w.shape.input_bytes)
        K, V = w.shape.key_dim, w.shape.value_width
        states = w.batch * w.heads * math.ceil(chunk_count(w, self.chunk_size) / self.state_stride)
        work = states * K * V * dot + w.rows * V * dot + w.rows * K * dot
        if w.delta_rule:
            work += w.rows * self.chunk_size * 4
        if w.forget_gate:
            work += w.rows * 4
        return work

    def figures(self, w: Workload) -> CostFigures:
        return CostFigures(programs=chunk_programs(w, self.block_v), serial_steps=chunk_count(w, self.chunk_size),
                           state_passes=2, workspace_bytes=self.workspace_bytes(w), launches=3)
