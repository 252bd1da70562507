"""The chunk forms' Triton kernels (through the interpreter on the CPU) against the float64
reference: every form's ``launch`` on fresh random inputs, outputs and workspaces poisoned with
NaN first, so an element a kernel should write and does not fails the comparison."""

from __future__ import annotations

import math
import os

import pytest
import torch
import triton
import triton.language as tl

from rtcompile.kernels import (
    args, chunk_fused, chunk_resident, chunk_split, chunk_streamed, running_tensor_recurrent_ref,
)
from rtcompile.kernels.chunk_fused import FusedConfig
from rtcompile.kernels.chunk_resident import ResidentConfig
from rtcompile.kernels.chunk_split import SplitConfig
from rtcompile.kernels.chunk_streamed import StreamedConfig
from rtcompile.kernels.config import KernelShape
from rtcompile.kernels.forms import candidates, low_memory
from rtcompile.kernels.inputs import check_inputs
from rtcompile.kernels.solves import unit_lower_inverse_products, unit_lower_inverse_tiles
from rtcompile.kernels import pipeline
from rtcompile.timing import as_replayed

from conftest import HALF_TOL, fresh_seed, make_inputs, rel_err

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU",
)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
FP32_TOL = 2e-5  # fp32 kernels vs float64: observed 1e-7 - 1e-6 on these shapes
# 16-bit inputs: the output to conftest's HALF_TOL; the fp32 state stays closer
LAUNCHERS = {ResidentConfig: chunk_resident.launch, StreamedConfig: chunk_streamed.launch,
             FusedConfig: chunk_fused.launch, SplitConfig: chunk_split.launch}


@pytest.fixture(autouse=True)
def poison_outputs(poison):
    """Every output and workspace the launchers allocate starts as NaN (conftest's ``poison``)."""


def run_form(config, q, k, v, g=None, beta=None, *, h0=None, cu_seqlens=None, l2norm=False, final_state=True):
    """``config``'s launcher on checked inputs, the final-state buffer allocated as the kernels'
    entry point allocates it (fp32, through ``args.empty``): returns (o, final state or None)."""
    p = check_inputs(q, k, v, g, beta, None, h0, cu_seqlens)
    shape = KernelShape(p.key_widths, p.value_width, v.element_size())
    assert config.check(shape, 10**9) is None, config.check(shape, 10**9)  # the test runs what the form allows
    ht = args.empty(p.state_shape, dtype=torch.float32, device=v.device) if final_state else None
    o = LAUNCHERS[type(config)](config, p, q, k, v, g, beta, h0=h0, ht=ht, cu_seqlens=cu_seqlens, l2norm=l2norm)
    assert o.shape == v.shape and o.dtype == v.dtype
    return o, ht


def case(B, T, H, widths, V, dtype=torch.float32, *, gate=True, delta=True, state=False, num_seqs=None):
    """Fresh random inputs: (device inputs in ``dtype``, float64 reference inputs, fp32 initial
    state or None). The reference sees exactly the rounded inputs the kernel sees."""
    q, k, v, g, beta, s0 = make_inputs(B, T, H, widths, V, gate=gate, delta=delta, state=state,
                                       num_seqs=num_seqs, dtype=torch.float64)
    low = [x.to(dtype) for x in q], [x.to(dtype) for x in k], v.to(dtype)
    g32 = None if g is None else g.float()
    b16 = None if beta is None else beta.to(dtype)
    dev = lambda x: None if x is None else x.to(DEVICE)
    up = lambda x: None if x is None else x.double()
    dev_in = ([dev(x) for x in low[0]], [dev(x) for x in low[1]], dev(low[2]), dev(g32), dev(b16))
    ref_in = ([up(x) for x in low[0]], [up(x) for x in low[1]], up(low[2]), up(g32), up(b16))
    return dev_in, ref_in, (None if s0 is None else s0.float())


def check_against_reference(config, B, T, H, widths, V, dtype=torch.float32, *, gate=True, delta=True,
                            h0=True, l2norm=True, offsets=None, final_state=True):
    cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32)
    dev, ref, s0 = case(B, T, H, widths, V, dtype, gate=gate, delta=delta, state=h0,
                        num_seqs=None if offsets is None else len(offsets) - 1)
    o, s = run_form(config, *dev, h0=None if s0 is None else s0.to(DEVICE), l2norm=l2norm,
                    cu_seqlens=None if cu is None else cu.to(DEVICE), final_state=final_state)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=None if s0 is None else s0.double(),
                                                output_final_state=True, l2norm=l2norm, cu_seqlens=cu)
    o_tol, s_tol = (HALF_TOL[dtype], 1e-2) if dtype in HALF_TOL else (FP32_TOL, FP32_TOL)
    assert rel_err(o.cpu(), o_ref) < o_tol
    if final_state:
        assert s.shape == s_ref.shape and s.dtype == torch.float32
        assert rel_err(s.cpu(), s_ref) < s_tol
    else:
        assert s is None
    return o


FEATURES = {  # every switch of the problem, each on in two of four combinations
    "plain": dict(gate=False, delta=False, l2norm=False, h0=False),
    "gate-h0": dict(gate=True, delta=False, l2norm=False, h0=True),
    "delta-l2": dict(gate=False, delta=True, l2norm=True, h0=False),
    "gated-delta-l2-h0": dict(gate=True, delta=True, l2norm=True, h0=True),
}

# (config, key widths, T, d_v): T is never a multiple of C (the last chunk is partial); widths
# that are not powers of two (5, 3x4, 2x3x2, 4x5, 5x7, 3x3x3) where the form allows them
FORMS = {
    # state in registers: P and Ai from the prepare kernel (row / tile solve), or W and U0 (wy)
    "resident-o2-d5-rows-c16": (ResidentConfig(16, 16, solve="rows"), (5,), 21, 6),
    "resident-o3-3x4-tiles-c32": (ResidentConfig(32, 16, solve="tiles", prepare_warps=2), (3, 4), 45, 6),
    "resident-o4-2x3x2-wy-rows": (ResidentConfig(16, 16, solve="rows", wy=True), (2, 3, 2), 37, 5),
    "resident-o3-3x4-wy-tiles-c32": (ResidentConfig(32, 16, solve="tiles", wy=True), (3, 4), 45, 6),
    "resident-o3-2x4-outer": (ResidentConfig(16, 16, solve="tiles", prepare_warps=1), (2, 4), 21, 6),
    # the product solve in registers at C 16, 32 and 64 (one, two and four [16, 16] blocks)
    "resident-o3-3x4-products-c32": (ResidentConfig(32, 16, solve="products", prepare_warps=2), (3, 4), 45, 6),
    "resident-o2-5-products-c16": (ResidentConfig(16, 16, solve="products"), (5,), 21, 6),
    "streamed-o3-4x5-products-c64": (StreamedConfig(64, 16, 16, solve="products"), (4, 5), 77, 5),
    # the chunk loop on the host (two chunk-parallel launches a chunk): gathered and outer-product
    # phi, order 4, the unrolled tile solve, a key tile that K does not fill (4x5: 20 = 16 + 4)
    "stepped-o3-4x5-gathered-c16": (StreamedConfig(16, 16, 16, loop="stepped"), (4, 5), 37, 6),
    "stepped-o3-4x8-outer-unrolled-c32": (StreamedConfig(32, 16, 16, loop="stepped", unroll_solve=True), (4, 8), 77,
                                          5),
    # runs of key tiles: 4x5 (two tiles) in one run; 5x7 (35: three tiles) in runs of 2, the second
    # short; 3x3x3 (27: two tiles) in one run of 4
    "stepped-o3-4x5-run2": (StreamedConfig(16, 16, 16, loop="stepped", tiles_per_program=2), (4, 5), 37, 6),
    "stepped-o3-5x7-run2-c32": (StreamedConfig(32, 16, 16, loop="stepped", tiles_per_program=2), (5, 7), 45, 5),
    "stepped-o4-3x3x3-run4-c32": (StreamedConfig(32, 16, 16, loop="stepped", tiles_per_program=4), (3, 3, 3), 45, 5),
    "stepped-o4-2x3x3-rows": (StreamedConfig(16, 16, 16, solve="rows", loop="stepped"), (2, 3, 3), 37, 5),
    # C 128: the row solve, and the tile solve in two halves (the product solve is refused there)
    "streamed-o3-4x8-rows-c128": (StreamedConfig(128, 16, 16, solve="rows"), (4, 8), 150, 5),
    # (8 warps: at 4 the output kernel's [C, C] tiles spill, and the loop's estimate refuses them)
    "stepped-o3-4x8-tiles-c128": (StreamedConfig(128, 16, 16, num_warps=8, loop="stepped", unroll_solve=True),
                                  (4, 8), 150, 5),
    # the next chunk's inputs ahead (power-of-two widths >= 16), with and without wy
    "resident-o2-16-prefetch-wy-tiles-c64": (ResidentConfig(64, 16, num_warps=8, solve="tiles", prefetch_inputs=True,
                                                            wy=True, prepare_warps=2), (16,), 77, 6),
    "resident-o3-16x16-prefetch-c16": (ResidentConfig(16, 16, num_warps=8, solve="tiles", prefetch_inputs=True,
                                                      prepare_warps=1), (16, 16), 21, 6),
    # phi(q), phi(k) materialised and the order-2 kernels run on them: prefetch and wy become
    # possible below 16-wide factors (4x4: K 16); a non-power-of-two K (2x3x2: 12) at order 4
    "resident-o3-4x4-materialised-prefetch-wy-c32": (ResidentConfig(32, 16, prefetch_inputs=True, wy=True,
                                                                    materialise=True), (4, 4), 45, 6),
    "resident-o4-2x3x2-materialised-rows": (ResidentConfig(16, 16, solve="rows", materialise=True), (2, 3, 2), 21, 5),
    # state streamed in key tiles: gathered and outer-product phi, state read ahead, merged passes
    "streamed-o3-4x5-rows": (StreamedConfig(16, 16, 16, solve="rows"), (4, 5), 21, 5),
    "streamed-o4-2x4x4-outer-prefetch": (StreamedConfig(16, 16, 16, prefetch_state=True), (2, 4, 4), 21, 6),
    "streamed-o3-5x7-merge-prefetch-c32": (StreamedConfig(32, 16, 16, prefetch_state=True, merge_passes=True),
                                           (5, 7), 37, 6),
    "streamed-o4-3x3x3-tiles-merge": (StreamedConfig(16, 16, 16, merge_passes=True, dot_precision="tf32x3"),
                                      (3, 3, 3), 21, 5),
    # fused: scores and solve in the sequential kernel, state in registers or streamed
    "fused-resident-o3-3x4-tiles-c32": (FusedConfig(32, 16, 16, solve="tiles"), (3, 4), 45, 6),
    "fused-resident-o2-8-rows": (FusedConfig(16, 16, 16, solve="rows"), (8,), 21, 6),
    "fused-resident-o2-8-products-c64": (FusedConfig(64, 16, 16, solve="products"), (8,), 77, 6),
    "fused-streamed-o3-4x5-rows-merge": (FusedConfig(16, 16, 16, solve="rows", merge_passes=True), (4, 5), 21, 5),
    "fused-streamed-o4-2x4x4-tiles-prefetch-c32": (FusedConfig(32, 16, 16, solve="tiles", prefetch_state=True),
                                                   (2, 4, 4), 37, 6),
    # split: stored phi(K), state of every 1st / 2nd / 4th chunk, key groups, descriptors or pointers
    "split-o2-16-c16": (SplitConfig(16, 16, prepare_warps=1), (16,), 37, 6),
    "split-o2-16-c32-rows-stride4": (SplitConfig(32, 16, solve="rows", state_stride=4), (16,), 150, 6),
    "split-o3-16x16-c16-kg2-stride2-tma": (SplitConfig(16, 16, tma=True, key_group=2, state_stride=2), (16, 16), 77, 8),
    "split-o3-16x16-c16-kg4-stride4": (SplitConfig(16, 16, prepare_warps=2, key_group=4, state_stride=4), (16, 16),
                                       77, 6),
    # chunks of 64 (the o3 16x16 default's; the tuner's space at every K): a partial last chunk
    "split-o2-16-c64-stride4": (SplitConfig(64, 16, state_stride=4), (16,), 130, 6),
    "split-o3-4x4-materialised-c64-stride2-tma": (SplitConfig(64, 16, state_stride=2, materialise=True, tma=True),
                                                  (4, 4), 150, 8),
    "split-o3-16x16-c32-tma-out32": (SplitConfig(32, 16, tma=True, output_block_v=32, output_warps=2), (16, 16), 45, 40),
    # split on materialised keys: factors under 16 wide (4x4, 2x4x2: K 16), stored states every 2nd chunk
    "split-o3-4x4-materialised-stride2": (SplitConfig(16, 16, state_stride=2, materialise=True), (4, 4), 45, 6),
    "split-o4-2x4x2-materialised-c32": (SplitConfig(32, 16, materialise=True), (2, 4, 2), 37, 5),
    # pipelined parts (5 chunks in 4 parts of 1, 1, 1, 2; windows of 2 in 2 parts; 8 asked, 2 windows)
    "split-o2-16-c16-pipeline4": (SplitConfig(16, 16, pipeline=4), (16,), 77, 6),
    "split-o3-16x16-c16-kg2-stride2-tma-pipeline2": (SplitConfig(16, 16, tma=True, key_group=2, state_stride=2,
                                                                 pipeline=2), (16, 16), 77, 8),
    "split-o3-4x4-materialised-stride2-pipeline8": (SplitConfig(16, 16, state_stride=2, materialise=True, pipeline=8),
                                                    (4, 4), 45, 6),
    # wy: the prepare kernel applies the solve (W in phi(K)'s column blocks: one index of axis 1 a
    # block, key groups of 2 and 4, order 2's one block), the loop forms U = U0 - W S
    "split-o2-16-c32-wy-rows": (SplitConfig(32, 16, solve="rows", wy=True), (16,), 45, 6),
    "split-o3-16x16-c16-wy-stride2": (SplitConfig(16, 16, state_stride=2, wy=True), (16, 16), 37, 6),
    "split-o3-16x16-c16-wy-kg2-tma-pipeline2": (SplitConfig(16, 16, tma=True, key_group=2, wy=True, pipeline=2),
                                                (16, 16), 77, 8),
    "split-o3-16x16-c16-wy-kg4-rows": (SplitConfig(16, 16, solve="rows", key_group=4, wy=True), (16, 16), 21, 5),
    "split-o3-4x4-materialised-wy-c32": (SplitConfig(32, 16, materialise=True, wy=True), (4, 4), 37, 6),
    # the loop on the factors (loop="kron": no stored phi(K), the state as [D1, D2, BV]), at K
    # 256, 512 and 1024 (its space's K > 256); d_v past one value block
    "split-o3-16x16-kron-c16": (SplitConfig(16, 16, loop="kron"), (16, 16), 37, 6),
    "split-o3-32x16-kron-c32-stride2-pipeline2": (SplitConfig(32, 16, loop="kron", state_stride=2, pipeline=2),
                                                  (32, 16), 77, 20),
    # phi(K) token-major from the token-parallel phi kernel (phi_pass), by pointers or descriptors
    "split-o3-16x16-c32-phipass": (SplitConfig(32, 16, phi_pass=True), (16, 16), 45, 6),
    "split-o3-16x16-c16-phipass-tma-kg2-stride2-pipeline2": (SplitConfig(16, 16, tma=True, key_group=2, state_stride=2,
                                                                         pipeline=2, phi_pass=True), (16, 16), 77, 8),
    "split-o2-16-c16-phipass": (SplitConfig(16, 16, phi_pass=True), (16,), 37, 6),
    "split-o3-32x32-kron-c16-w8-stride4": (SplitConfig(16, 16, num_warps=8, loop="kron", state_stride=4), (32, 32),
                                           37, 6),
}


MIN_PART_CHUNKS = pipeline.MIN_PART_CHUNKS  # the launcher's, before the fixture below lowers it


@pytest.fixture(autouse=True)
def _parts_of_one_chunk(monkeypatch):
    """Pipelined parts of any length here, so the small T of these tests cuts into parts."""
    monkeypatch.setattr(pipeline, "MIN_PART_CHUNKS", 1)


@pytest.mark.parametrize("n_chunks, parts, unit, minimum, expected", [
    (5, 4, 1, 1, [(0, 1), (1, 2), (2, 3), (3, 5)]),
    (5, 2, 2, 1, [(0, 2), (2, 5)]),  # windows of 2 chunks never span parts
    (3, 8, 2, 1, [(0, 2), (2, 3)]),  # no more parts than windows
    (64, 2, 2, MIN_PART_CHUNKS, [(0, 32), (32, 64)]),
    (20, 8, 2, MIN_PART_CHUNKS, [(0, 10), (10, 20)]),  # parts of at least MIN_PART_CHUNKS chunks
    (MIN_PART_CHUNKS + 1, 4, 1, MIN_PART_CHUNKS, [(0, MIN_PART_CHUNKS + 1)]),
], ids=["5-in-4", "windows-of-2", "more-parts-than-windows", "t4096-c64", "min-chunks", "one-part"])
def test_part_bounds(monkeypatch, n_chunks, parts, unit, minimum, expected):
    monkeypatch.setattr(pipeline, "MIN_PART_CHUNKS", minimum)
    assert pipeline.part_bounds(n_chunks, parts, unit) == expected


@pytest.mark.parametrize("with_inputs", [True, False], ids=["loop-inputs", "none"])
def test_run_parts_order_without_side_streams(with_inputs):
    """Off CUDA every launch runs in order on one stream: the loops' inputs once, first, then
    each part's prepare, loop and outputs."""
    calls = []
    pipeline.run_parts([(0, 2), (2, 5)], lambda c0, c1: calls.append(("prepare", c0, c1)),
                       lambda j, c0, c1: calls.append(("loop", j, c0, c1)),
                       lambda c0, c1: calls.append(("outputs", c0, c1)), torch.device("cpu"),
                       loop_inputs=(lambda: calls.append(("loop inputs",))) if with_inputs else None)
    parts = [("prepare", 0, 2), ("loop", 0, 0, 2), ("outputs", 0, 2), ("prepare", 2, 5), ("loop", 1, 2, 5),
             ("outputs", 2, 5)]
    assert calls == ([("loop inputs",)] if with_inputs else []) + parts


def test_phi_kernel_beside_or_before_the_first_prepare_gives_the_same_outputs(monkeypatch):
    """phi_pass in pipelined parts, one stream (the interpreter): phi(K) launched as the loops'
    input or before the first prepare kernel runs the phi kernel once either way, so the outputs
    and final state are the same bit for bit (the side streams' ordering is the GPU graph test's,
    test_parts_in_a_graph_equal_the_eager_call_in_one_part)."""
    monkeypatch.setattr(pipeline, "MIN_PART_CHUNKS", 1)
    config = SplitConfig(16, 16, state_stride=2, pipeline=2, phi_pass=True)
    got = {}
    dev, _, _ = case(1, 45, 2, (16, 16), 8)
    for beside in (True, False):
        monkeypatch.setattr(chunk_split, "PHI_BESIDE_PREPARE", beside)
        got[beside] = run_form(config, *dev, l2norm=True)
    for a, b in zip(got[True], got[False]):
        assert torch.isfinite(a).all() and torch.equal(a, b)


@pytest.mark.parametrize("feat", FEATURES.keys())
@pytest.mark.parametrize("form", FORMS.keys())
def test_form_matches_float64(form, feat):
    config, widths, T, V = FORMS[form]
    check_against_reference(config, 2, T, 1, widths, V, **FEATURES[feat])


HALF = {  # 16-bit inputs: products in the input type (fp16 here; bf16 is upcast under the interpreter)
    "resident-o3-3x4-tiles-c32": (ResidentConfig(32, 16), (3, 4)),
    "resident-o2-16-prefetch-wy": (ResidentConfig(32, 16, prefetch_inputs=True, wy=True), (16,)),
    "resident-o3-4x4-materialised-prefetch-wy": (ResidentConfig(32, 16, prefetch_inputs=True, wy=True,
                                                                materialise=True), (4, 4)),
    "streamed-o3-4x8-merge-prefetch": (StreamedConfig(16, 16, 16, prefetch_state=True, merge_passes=True), (4, 8)),
    "streamed-o3-5x7-gathered": (StreamedConfig(32, 16, 16, solve="rows"), (5, 7)),
    "stepped-o3-4x8": (StreamedConfig(16, 16, 16, loop="stepped"), (4, 8)),
    "fused-streamed-o3-4x8-tiles-c32": (FusedConfig(32, 16, 16, prefetch_state=True), (4, 8)),
    "fused-resident-o2-16-rows": (FusedConfig(16, 16, 16, solve="rows"), (16,)),
    "split-o3-16x16-c16-kg2-stride2-tma": (SplitConfig(16, 16, tma=True, key_group=2, state_stride=2), (16, 16)),
    "split-o2-16-c32": (SplitConfig(32, 16, dot_precision="tf32"), (16,)),
    "split-o3-16x16-c64-products-tf32": (SplitConfig(64, 16, solve="products", dot_precision="tf32"), (16, 16)),
    "split-o2-32-c32-products-tf32": (SplitConfig(32, 16, solve="products", dot_precision="tf32", prepare_warps=4),
                                      (32,)),
    "split-o3-16x16-c16-wy-kg2": (SplitConfig(16, 16, key_group=2, wy=True), (16, 16)),
    "split-o3-16x32-kron-c32": (SplitConfig(32, 16, loop="kron"), (16, 32)),
    "split-o3-16x16-c16-phipass-tma": (SplitConfig(16, 16, tma=True, phi_pass=True), (16, 16)),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("form", HALF.keys())
def test_half_inputs(form, dtype):
    config, widths = HALF[form]
    check_against_reference(config, 2, 37, 2, widths, 8, dtype)


VARLEN = {  # sequences of 5, 1, 17 and 7 tokens packed along T (split: 5, 1, 54, 37, up to 4 chunks)
    "resident-o3-3x4-tiles-c32": (ResidentConfig(32, 16), (3, 4), None),
    "resident-o2-16-prefetch-wy-c16": (ResidentConfig(16, 16, prefetch_inputs=True, wy=True), (16,), None),
    "resident-o3-3x4-wy-tiles-c32": (ResidentConfig(32, 16, wy=True), (3, 4), None),
    "resident-o3-4x4-materialised-prefetch-c16": (ResidentConfig(16, 16, prefetch_inputs=True, materialise=True),
                                                  (4, 4), None),
    "streamed-o3-3x7-merge": (StreamedConfig(16, 16, 16, prefetch_state=True, merge_passes=True), (3, 7), None),
    "stepped-o3-3x7": (StreamedConfig(16, 16, 16, loop="stepped"), (3, 7), None),
    "stepped-o3-4x8-run2": (StreamedConfig(16, 16, 16, loop="stepped", tiles_per_program=2), (4, 8), None),
    "fused-resident-o4-2x3x2-tiles-c32": (FusedConfig(32, 16, 16), (2, 3, 2), None),
    "fused-streamed-o3-4x5-rows": (FusedConfig(16, 16, 16, solve="rows"), (4, 5), None),
    "split-o2-16-c16": (SplitConfig(16, 16), (16,), None),
    "split-o3-16x16-stride2-tma": (SplitConfig(16, 16, tma=True, key_group=2, state_stride=2), (16, 16), "long"),
    "split-o3-16x16-stride4": (SplitConfig(16, 16, state_stride=4), (16, 16), "long"),
    # pipeline=4 asked, but under varlen the launcher runs all chunks in one part (no pipeline)
    "split-o2-16-c16-pipeline4-asked-runs-one-part": (SplitConfig(16, 16, pipeline=4), (16,), "long"),
    "split-o3-16x16-wy-tma": (SplitConfig(16, 16, tma=True, key_group=2, wy=True), (16, 16), "long"),
    "split-o3-16x16-kron-stride2": (SplitConfig(16, 16, loop="kron", state_stride=2), (16, 16), "long"),
    "split-o3-16x16-phipass-tma-stride2": (SplitConfig(16, 16, tma=True, state_stride=2, phi_pass=True), (16, 16),
                                           "long"),
}


@pytest.mark.parametrize("form", VARLEN.keys())
def test_varlen_uneven_lengths(form, monkeypatch):
    config, widths, lengths = VARLEN[form]
    offsets = [0, 5, 6, 60, 97] if lengths == "long" else [0, 5, 6, 23, 30]
    parts = []
    run_parts = chunk_split.run_parts
    monkeypatch.setattr(chunk_split, "run_parts",
                        lambda bounds, *a, **kw: (parts.append(len(bounds)), run_parts(bounds, *a, **kw)))
    check_against_reference(config, 1, offsets[-1], 2, widths, 8, offsets=offsets)
    assert parts == ([1] if isinstance(config, SplitConfig) else []), parts  # varlen: one part, whatever pipeline asks


FINAL_STATE_OFF = {
    "resident": ResidentConfig(16, 16, prefetch_inputs=True, wy=True),
    "streamed": StreamedConfig(16, 16, 16, merge_passes=True),  # the state lives in a buffer of its own
    "fused-streamed": FusedConfig(16, 16, 16, prefetch_state=True),
    "split-tma": SplitConfig(16, 16, tma=True, key_group=2, state_stride=2),
    "split-pipeline": SplitConfig(16, 16, state_stride=2, pipeline=4),  # parts pass the state in a buffer
    "split-wy-pipeline": SplitConfig(16, 16, wy=True, pipeline=2),
}


@pytest.mark.parametrize("capturing, expected", [(False, False), (True, True)], ids=["eager", "capturing"])
def test_parts_run_in_graph_captures_only(monkeypatch, capturing, expected):
    """A CUDA call runs its pipelined parts only while a graph is captured (an eager call is
    host-bound: each part adds three launches); off CUDA (the interpreter) they always run."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    assert pipeline.parts_pay(torch.device("cuda")) is expected
    assert pipeline.parts_pay(torch.device("cpu"))


GRAPH_PARTS = {
    "stored-phi": (SplitConfig(16, 16, tma=True, key_group=2, state_stride=2, pipeline=2), False),
    # phi(K) from the phi kernel before the first prepare, or beside it on the output stream (the
    # first loop waits for it by an event: the one test of that ordering on side streams)
    "phi-pass-before": (SplitConfig(16, 16, tma=True, state_stride=2, pipeline=2, phi_pass=True), False),
    "phi-pass-beside": (SplitConfig(16, 16, tma=True, state_stride=2, pipeline=2, phi_pass=True), True),
}


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", GRAPH_PARTS.keys())
def test_parts_in_a_graph_equal_the_eager_call_in_one_part(monkeypatch, name):
    """The same pipelined config eager (one part) and as a CUDA-graph replay computes it (two
    parts on the side streams; what the tuner checks and times): outputs and final state
    bit-equal, and each ran the parts the rule gives."""
    config, beside = GRAPH_PARTS[name]
    monkeypatch.setattr(chunk_split, "PHI_BESIDE_PREPARE", beside)
    parts = []
    run_parts = chunk_split.run_parts
    monkeypatch.setattr(chunk_split, "run_parts",
                        lambda bounds, *a, **kw: (parts.append(len(bounds)), run_parts(bounds, *a, **kw)))
    dev, _, s0 = case(2, 77, 2, (16, 16), 8, torch.bfloat16, state=True)
    h0 = s0.to(DEVICE)  # outside the capture: a copy from host memory cannot be captured
    call = lambda: run_form(config, *dev, h0=h0, l2norm=True)  # noqa: E731
    o_eager, s_eager = call()
    o_graph, s_graph = as_replayed(call, DEVICE)
    assert parts == [1, 1, 2]  # eager, the warm-up before the capture, the capture
    assert torch.equal(o_graph, o_eager) and torch.equal(s_graph, s_eager)


@pytest.mark.parametrize("form", FINAL_STATE_OFF.keys())
def test_without_final_state(form):
    """No final-state buffer: o is unchanged (and the streamed forms keep their state elsewhere)."""
    o = check_against_reference(FINAL_STATE_OFF[form], 2, 37, 1, (16, 16), 8, final_state=False)
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("form", ["resident", "streamed", "fused-streamed", "split-tma"])
def test_single_token(form):
    config = FINAL_STATE_OFF[form]
    check_against_reference(config, 3, 1, 2, (16, 16), 8)


DEFAULT_SHAPES = {"o2-32": (32,), "o2-64": (64,), "o2-256": (256,), "o3-16x16": (16, 16), "o3-32x16": (32, 16),
                  "o3-32x32": (32, 32),
                  "o3-3x5": (3, 5)}


@pytest.mark.parametrize("low_mem", [False, True], ids=["default", "fused-sibling"])
@pytest.mark.parametrize("shape", DEFAULT_SHAPES.keys())
def test_defaults_run(shape, low_mem):
    """The defaults table's first candidate (and its fused sibling) for the shape, as the
    entry point would pick it on a GPU with 227 KiB of shared memory; bf16 inputs, T = 70."""
    widths = DEFAULT_SHAPES[shape]
    ks = KernelShape(widths, 8, 2)
    config = low_memory(ks, 227 * 1024) if low_mem else candidates("chunk", ks, 227 * 1024)[0]
    # the config as resolved, chunk size included (the split defaults' C 64 / C 32 run under the
    # interpreter too: T 70 is one whole chunk of 64 and a partial one)
    check_against_reference(config, 1, 70, 2, widths, 8, torch.bfloat16)


@triton.jit
def _invert_tiles_kernel(A, n_rows, C: tl.constexpr):
    unit_lower_inverse_tiles(A, n_rows, C, "ieee")


# C 128 as two halves: whole, the second half partial, and only the first half's rows
@pytest.mark.parametrize("C, n_rows", [(16, 16), (32, 32), (64, 64), (64, 37), (32, 9), (64, 1), (128, 128),
                                       (128, 101), (128, 50)],
                         ids=["c16", "c32", "c64", "c64-37rows", "c32-9rows", "c64-1row", "c128", "c128-101rows",
                              "c128-50rows"])
def test_unit_lower_inverse_tiles_is_the_inverse(C, n_rows):
    # in place; rows from n_rows on belong to someone else (the next sequence): never written
    A = (torch.rand(C, C, dtype=torch.float64) * 2 - 1).tril(-1)
    A[n_rows:] = 0.0
    buf = A.float().clone()
    buf[n_rows:] = float("nan")
    buf = buf.to(DEVICE)
    _invert_tiles_kernel[(1,)](buf, n_rows, C=C)
    ref = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A.float().double())
    assert rel_err(buf.cpu()[:n_rows], ref[:n_rows]) < 1e-4
    assert buf[n_rows:].isnan().all()


@pytest.mark.parametrize("config, widths, T", [
    (StreamedConfig(64, 16, 16, unroll_solve=True), (4, 5), 77),
    (SplitConfig(32, 16, unroll_solve=True), (16,), 45),
    (SplitConfig(64, 16, unroll_solve=True, phi_pass=True, dot_precision="tf32", prepare_warps=2), (16, 16), 77),
], ids=["streamed-o3-4x5-c64", "split-o2-16-c32", "split-o3-16x16-phi-pass-c64"])
def test_unrolled_tile_solve_matches_float64(config, widths, T):
    """``unroll_solve``: the tile solve's diagonal steps unrolled (the o3 16x16 and 32x32
    defaults' prepare kernel); partial last chunk, every feature switch on."""
    check_against_reference(config, 2, T, 1, widths, 6)


@triton.jit
def _invert_products_kernel(A, X, C: tl.constexpr):
    o_c = tl.arange(0, C)
    off = o_c[:, None] * C + o_c[None, :]
    tl.store(X + off, unit_lower_inverse_products(tl.load(A + off), C, "ieee"))


@pytest.mark.parametrize("scale", [0.3, 1.0], ids=["small", "unit"])
@pytest.mark.parametrize("C", [16, 32, 64, 128], ids=["c16", "c32", "c64", "c128"])
def test_unit_lower_inverse_products_is_the_inverse(C, scale):
    """The register product solve against float64's inverse; entries up to ``scale`` (1: the
    bound of beta k_i . k_j with unit keys), a poisoned output."""
    fresh_seed()
    A = ((torch.rand(C, C, dtype=torch.float64) * 2 - 1) * scale).tril(-1)
    X = torch.full((C, C), float("nan"), device=DEVICE)
    _invert_products_kernel[(1,)](A.float().to(DEVICE), X, C=C)
    ref = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A.float().double())
    assert rel_err(X.cpu(), ref) < 1e-5


@pytest.mark.parametrize("delta,gate", [(True, True), (False, True), (True, False)], ids=["delta-gate", "gate", "delta"])
@pytest.mark.parametrize("config", [
    ResidentConfig(chunk_size=16, block_v=16),
    ResidentConfig(chunk_size=16, block_v=16, solve="rows", wy=True),
    ResidentConfig(chunk_size=32, block_v=16, wy=True),
    ResidentConfig(chunk_size=16, block_v=16, wy=True, materialise=True),
    StreamedConfig(chunk_size=16, block_k=64, block_v=16),
    FusedConfig(chunk_size=16, block_k=256, block_v=16),
    FusedConfig(chunk_size=16, block_k=256, block_v=16, solve="rows"),
    SplitConfig(chunk_size=16, block_v=16, state_stride=2),
    # phi(K) token-major (one buffer, not the stored layout's too), and none with the kron loop
    SplitConfig(chunk_size=16, block_v=16, phi_pass=True),
    SplitConfig(chunk_size=16, block_v=16, loop="kron"),
], ids=lambda c: f"{c.form}-{c.solve}{'-wy' if getattr(c, 'wy', False) else ''}"
                 f"{'-materialised' if getattr(c, 'materialise', False) else ''}"
                 f"{'-phipass' if getattr(c, 'phi_pass', False) else ''}-{getattr(c, 'loop', '')}")
def test_launcher_allocates_the_workspace_its_config_declares(monkeypatch, config, delta, gate):
    """What a form's launcher allocates beyond the output is what its config's ``workspace_bytes``
    says (the planner's memory check and the cost model read that figure)."""
    from rtcompile.kernels.config import Workload

    sizes = []

    def counting_empty(*shape, dtype=None, device=None):
        t = torch.empty(*shape, dtype=dtype, device=device)
        sizes.append((tuple(t.shape), t.numel() * t.element_size()))
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(args, "empty", counting_empty)
    B, T, H, widths, V = 2, 40, 2, (16, 16), 32
    dev, _, _ = case(B, T, H, widths, V, gate=gate, delta=delta)
    run_form(config, *dev, l2norm=True, final_state=True)
    # less the output and the final state, one each (the split form's U has the output's shape)
    out_bytes, state_bytes = B * T * H * V * 4, B * H * 256 * V * 4
    assert ((B, T, H, V), out_bytes) in sizes and ((B, H, *widths, V), state_bytes) in sizes
    allocated = sum(n for _, n in sizes) - out_bytes - state_bytes
    work = Workload(KernelShape(widths, V, 4), B, H, T, delta_rule=delta, forget_gate=gate)
    assert allocated == config.workspace_bytes(work)


@pytest.mark.parametrize("widths", [(8, 8), (16, 8), (3, 5), (4, 4, 4), (2, 3, 7)], ids=lambda w: "x".join(map(str, w)))
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "raw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_materialise_phi_kernel(poison, widths, l2norm, dtype):
    """The one-kernel phi(x) of the materialised configs against the float64 Kronecker product
    of the (normalised) factors, odd widths and a row count no tile divides; the output poisoned."""
    from rtcompile.kernels.reference import l2normalize

    xs = [torch.randn(2, 37, 3, d, device=DEVICE).to(dtype) for d in widths]
    got = chunk_resident.materialise_phi(xs, l2norm)
    want = l2normalize(xs[0].double()) if l2norm else xs[0].double()
    for x in xs[1:]:
        u = l2normalize(x.double()) if l2norm else x.double()
        want = (want[..., :, None] * u[..., None, :]).flatten(-2)
    assert got.dtype == dtype and got.shape == want.shape
    # bf16: one rounding to nearest, <= 2^-9 relative (a cast toward zero, as the interpreter's, took 7.6e-3)
    assert rel_err(got, want) < (1e-6 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("widths", [(8, 8), (3, 5), (2, 3, 4)], ids=lambda w: "x".join(map(str, w)))
def test_materialise_pair_forms_both_sides_in_one_launch(monkeypatch, widths):
    """phi(q), phi(k) of the materialised call from one launch (into NaN-filled buffers), each
    equal to its side's own kernel."""
    q = [torch.randn(3, 37, 2, d, device=DEVICE) for d in widths]
    k = [torch.randn(3, 37, 2, d, device=DEVICE) for d in widths]
    outs = [torch.full((3, 37, 2, math.prod(widths)), float("nan"), device=DEVICE) for _ in range(2)]
    launches = []
    real = chunk_resident.cached
    monkeypatch.setattr(chunk_resident, "cached", lambda kernel: launches.append(kernel) or real(kernel))
    chunk_resident.fill_phi([q, k], outs, True)
    assert len(launches) == 1
    for l2norm in (True, False):
        pair = (outs if l2norm else chunk_resident.materialise_pair(q, k, False))
        for got, x in zip(pair, (q, k)):
            torch.testing.assert_close(got, chunk_resident.materialise_phi(x, l2norm), rtol=0, atol=0)
