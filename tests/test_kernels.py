"""Triton kernels (through the interpreter on CPU) against the float64 reference."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
import triton
import triton.language as tl

import rtcompile
from rtcompile.kernels import running_tensor_recurrent_ref, triton_fwd
from rtcompile.kernels.blocks import (
    unit_lower_inverse_blocked, unit_lower_inverse_diagonal, unit_lower_inverse_tiles,
)
from rtcompile.kernels.triton_fwd import running_tensor_decode_, running_tensor_fwd
from rtcompile.kernels.variants import ChunkVariant, KernelShape, RecurrentVariant

from conftest import make_inputs, rel_err

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU",
)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
FP32_TOL = 2e-5  # fp32 kernels vs float64: observed 2e-7 - 1e-6 on these shapes


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Every output/workspace the launchers allocate starts as NaN: an unwritten element fails."""

    def nan_empty(*shape, dtype=None, device=None):
        t = torch.empty(*shape, dtype=dtype, device=device)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(triton_fwd, "_empty", nan_empty)
    monkeypatch.setattr(triton_fwd, "_empty_like", lambda x: nan_empty(*x.shape, dtype=x.dtype, device=x.device))


def _to(xs, dtype=None):
    conv = lambda x: None if x is None else x.to(device=DEVICE, dtype=dtype or x.dtype)
    return [conv(x) for x in xs] if isinstance(xs, list) else conv(xs)


def _case(B, T, H, widths, V, dtype=torch.float32, **kw):
    q, k, v, g, beta, s0 = make_inputs(B, T, H, widths, V, dtype=torch.float64, **kw)
    low = lambda x: x if x is None else x.to(dtype)
    q16, k16, v16 = [low(x) for x in q], [low(x) for x in k], low(v)
    g16, b16 = (None if g is None else g.float()), (None if beta is None else beta.float())
    # the reference sees exactly the (rounded) inputs the kernel sees, upcast to float64
    up = lambda x: None if x is None else x.double()
    ref_in = ([up(x) for x in q16], [up(x) for x in k16], up(v16), up(g16), up(b16))
    dev_in = (_to(q16), _to(k16), _to(v16), _to(g16), _to(b16))
    return dev_in, ref_in, s0


WIDTHS = {"o2-d5": (5,), "o3-3x4": (3, 4), "o4-2x3x2": (2, 3, 2)}
FEATURES = {
    "plain": dict(gate=False, delta=False, l2norm=False),
    "gate": dict(gate=True, delta=False, l2norm=False),
    "delta-l2": dict(gate=False, delta=True, l2norm=True),
    "gated-delta-l2": dict(gate=True, delta=True, l2norm=True),
}
VARIANTS = {
    "chunk16": ("chunk", ChunkVariant(chunk_size=16, block_k=16, block_v=16)),
    "chunk16-fused": ("chunk", ChunkVariant(chunk_size=16, block_k=16, block_v=16, fuse_prepare=True)),
    "recurrent": ("recurrent", None),
}


@pytest.mark.parametrize("widths", WIDTHS.values(), ids=WIDTHS.keys())
@pytest.mark.parametrize("feat", FEATURES.keys())
@pytest.mark.parametrize("impl", VARIANTS.keys())
@pytest.mark.parametrize("h0", [True, False], ids=["h0", "no-h0"])
def test_prefill_matches_float64(widths, feat, impl, h0):
    f = FEATURES[feat]
    # T = 21: one full chunk of 16 and a partial one; V = 6 is not a power of two
    dev, ref, s0 = _case(2, 21, 2, widths, 6, gate=f["gate"], delta=f["delta"], state=h0)
    mode, variant = VARIANTS[impl]
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True,
                              l2norm=f["l2norm"], mode=mode, variant=variant)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=f["l2norm"])
    assert o.shape == (2, 21, 2, 6) and s.shape == (2, 2, *widths, 6) and s.dtype == torch.float32
    assert rel_err(o.cpu(), o_ref) < FP32_TOL
    assert rel_err(s.cpu(), s_ref) < FP32_TOL


STREAMED = {
    # K = 20 and 27 with 16-row tiles: the state is streamed, not held in registers
    "chunk-o3-4x5": ((4, 5), "chunk", ChunkVariant(chunk_size=16, block_k=16, block_v=16)),
    "chunk-o4-3x3x3-fused": ((3, 3, 3), "chunk", ChunkVariant(chunk_size=16, block_k=16, block_v=16, fuse_prepare=True)),
    "recurrent-o3-4x5": ((4, 5), "recurrent", RecurrentVariant(block_k=8, block_v=4)),
    # power-of-two widths: phi blocks are outer products of factor tiles (phi_tile_outer)
    "outer-o3-4x8-streamed": ((4, 8), "chunk", ChunkVariant(chunk_size=16, block_k=16, block_v=16)),
    "outer-o4-2x4x4-streamed": ((2, 4, 4), "chunk", ChunkVariant(chunk_size=16, block_k=16, block_v=16)),
    "outer-o3-2x4-resident": ((2, 4), "chunk", ChunkVariant(chunk_size=16, block_k=16, block_v=16)),
    "outer-o2-8-fused": ((8,), "chunk", ChunkVariant(chunk_size=16, block_k=16, block_v=16, fuse_prepare=True)),
    # merged passes: chunk c+1's products formed from each tile updated for chunk c
    "merge-o3-4x5": ((4, 5), "chunk", ChunkVariant(chunk_size=16, block_k=16, block_v=16, merge_passes=True)),
    "merge-outer-o4-2x4x4-fused": ((2, 4, 4), "chunk", ChunkVariant(chunk_size=16, block_k=16, block_v=16,
                                                                      fuse_prepare=True, merge_passes=True)),
    # kron: one index of axis 1 per tile, x1's column as a row scale on the trailing tile's products
    "kron-o4-2x2x8": ((2, 2, 8), "chunk", ChunkVariant(chunk_size=16, block_k=16, block_v=16, kron=True)),
    "kron-merge-o4-4x2x8": ((4, 2, 8), "chunk", ChunkVariant(chunk_size=16, block_k=16, block_v=16, kron=True,
                                                              merge_passes=True)),
    "kron-merge-o4-2x4x4-fused": ((2, 4, 4), "chunk", ChunkVariant(chunk_size=16, block_k=16, block_v=16, kron=True,
                                                                    fuse_prepare=True, merge_passes=True)),
}


@pytest.mark.parametrize("case", STREAMED.keys())
def test_streamed_state_matches_float64(case):
    widths, mode, variant = STREAMED[case]
    dev, ref, s0 = _case(1, 19, 2, widths, 5, state=True)
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True,
                              l2norm=True, mode=mode, variant=variant)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True)
    assert rel_err(o.cpu(), o_ref) < FP32_TOL and rel_err(s.cpu(), s_ref) < FP32_TOL
    # without output_final_state the streamed state still has a buffer, and o is unchanged
    o2, s2 = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), l2norm=True, mode=mode, variant=variant)
    assert s2 is None and torch.equal(o2, o)


BLOCKED_SOLVE = {
    # (I + A)^-1 by diagonal blocks of 16 rows: 2, 4 and 8 blocks; T leaves a partial chunk
    "c32-2blocks": ((3, 4), 70, ChunkVariant(chunk_size=32, block_k=16, block_v=16, solve="blocks")),
    "c64-4blocks-fused": ((2, 3, 2), 77, ChunkVariant(chunk_size=64, block_k=16, block_v=16, fuse_prepare=True,
                                                      solve="blocks")),
    "c64-4blocks": ((5,), 130, ChunkVariant(chunk_size=64, block_k=16, block_v=16, num_warps=8, solve="blocks")),
    # smaller diagonal blocks: 4 blocks of 4 at C = 16, 8 of 4 and 16 of 4 (N^2, N^4, N^8 factors),
    # 8 of 8; a prepare kernel with its own warps
    "c16-bs4-4blocks": ((3, 4), 37, ChunkVariant(chunk_size=16, block_k=16, block_v=16, solve="blocks", solve_block=4,
                                                 prepare_warps=1)),
    "c32-bs4-8blocks": ((3, 4), 70, ChunkVariant(chunk_size=32, block_k=16, block_v=16, solve="blocks", solve_block=4,
                                                 prepare_warps=2)),
    "c64-bs4-16blocks": ((5,), 130, ChunkVariant(chunk_size=64, block_k=16, block_v=16, solve="blocks", solve_block=4,
                                                 prepare_warps=8)),
    "c64-bs8-8blocks-fused": ((2, 3, 2), 77, ChunkVariant(chunk_size=64, block_k=16, block_v=16, fuse_prepare=True,
                                                          solve="blocks", solve_block=8)),
    # the diagonal blocks inverted on their own tiles
    "c64-diagonal": ((5,), 130, ChunkVariant(chunk_size=64, block_k=16, block_v=16, num_warps=8, solve="diagonal",
                                             prepare_warps=8)),
    "c32-diagonal-bs8-fused": ((3, 4), 70, ChunkVariant(chunk_size=32, block_k=16, block_v=16, fuse_prepare=True,
                                                        solve="diagonal", solve_block=8)),
    "c16-diagonal-bs4": ((2, 3, 2), 37, ChunkVariant(chunk_size=16, block_k=16, block_v=16, solve="diagonal",
                                                     solve_block=4, prepare_warps=1)),
    # inverted in the prepare kernel's workspace, in [16, 16] tiles: last chunks of 2 and 13 rows
    # (inside the first and the last diagonal block), 1 and 4 blocks
    "c64-tiles": ((5,), 130, ChunkVariant(chunk_size=64, block_k=16, block_v=16, num_warps=8, solve="tiles")),
    "c64-tiles-pw2": ((2, 3, 2), 77, ChunkVariant(chunk_size=64, block_k=16, block_v=16, solve="tiles",
                                                  prepare_warps=2)),
    "c16-tiles-pw1": ((3, 4), 37, ChunkVariant(chunk_size=16, block_k=16, block_v=16, solve="tiles", prepare_warps=1)),
    # fused: each program inverts in a [C, C] scratch of its own, chunk after chunk
    "c64-tiles-fused": ((2, 3, 2), 77, ChunkVariant(chunk_size=64, block_k=16, block_v=16, fuse_prepare=True,
                                                    solve="tiles")),
}


PREFETCH = {
    # the next chunk's inputs loaded ahead: widths >= 16 (power of two), state in registers
    "o3-16x16-c16": ((16, 16), 37, ChunkVariant(chunk_size=16, block_k=256, block_v=16, num_warps=8, num_stages=1,
                                                       prefetch=True)),
    "o2-32-c32-fused-blocks": ((32,), 70, ChunkVariant(chunk_size=32, block_k=32, block_v=16, fuse_prepare=True,
                                                         solve="blocks", prefetch=True)),
    "o2-32-c32-fused-tiles": ((32,), 70, ChunkVariant(chunk_size=32, block_k=32, block_v=16, fuse_prepare=True,
                                                        solve="tiles", prefetch=True)),
    # with a streamed state: the next state tile loaded ahead (gathered and outer-product phi)
    "o3-5x7-c16-streamed": ((5, 7), 37, ChunkVariant(chunk_size=16, block_k=16, block_v=16, prefetch=True)),
    "o3-4x8-c32-streamed-fused": ((4, 8), 45, ChunkVariant(chunk_size=32, block_k=16, block_v=16, fuse_prepare=True,
                                                           prefetch=True)),
    "o3-3x5-refused": ((3, 5), 5, None),
    # merged passes with the state tile read ahead, and with the blocked solve
    "o3-5x7-c16-streamed-merge": ((5, 7), 37, ChunkVariant(chunk_size=16, block_k=16, block_v=16, prefetch=True,
                                                           merge_passes=True)),
    "o4-2x4x4-c32-blocks-merge": ((2, 4, 4), 70, ChunkVariant(chunk_size=32, block_k=16, block_v=16, solve="blocks",
                                                              prefetch=True, merge_passes=True)),
    "o4-4x2x8-c32-kron-merge": ((4, 2, 8), 70, ChunkVariant(chunk_size=32, block_k=16, block_v=16, solve="blocks",
                                                            solve_block=8, prefetch=True, merge_passes=True,
                                                            kron=True)),
}


@pytest.mark.parametrize("feat", ["plain", "gated-delta-l2"])
@pytest.mark.parametrize("case", PREFETCH.keys())
def test_prefetch_matches_float64(case, feat):
    widths, T, variant = PREFETCH[case]
    f = FEATURES[feat]
    dev, ref, s0 = _case(2, T, 1, widths, 6, gate=f["gate"], delta=f["delta"], state=True)
    if variant is None:  # a state in registers loads whole factor tiles ahead: widths 3, 5 cannot
        with pytest.raises(ValueError, match="prefetch with the state in registers needs power-of-two"):
            running_tensor_fwd(*dev, mode="chunk", variant=ChunkVariant(16, 16, 16, prefetch=True))
        return
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True,
                              l2norm=f["l2norm"], mode="chunk", variant=variant)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=f["l2norm"])
    assert rel_err(o.cpu(), o_ref) < FP32_TOL and rel_err(s.cpu(), s_ref) < FP32_TOL


WY = {
    # the solve applied in the prepare kernel; K = 12 pads to a 16-row state tile, 256 is outer-product phi
    "o3-3x4-c16": ((3, 4), 37, ChunkVariant(chunk_size=16, block_k=16, block_v=16, wy=True)),
    "o4-2x3x2-c32-blocks": ((2, 3, 2), 70, ChunkVariant(chunk_size=32, block_k=16, block_v=16, solve="blocks",
                                                          wy=True)),
    "o3-16x16-c16-prefetch": ((16, 16), 37, ChunkVariant(chunk_size=16, block_k=256, block_v=16, num_warps=8,
                                                          num_stages=1, prefetch=True, wy=True)),
    # the tile solve's inverse read back for W and U0: last chunks of 6 and 13 rows
    "o3-3x4-c32-tiles": ((3, 4), 70, ChunkVariant(chunk_size=32, block_k=16, block_v=16, wy=True, solve="tiles")),
    "o2-16-c64-tiles-prefetch": ((16,), 77, ChunkVariant(chunk_size=64, block_k=16, block_v=16, num_warps=8,
                                                          prefetch=True, wy=True, solve="tiles", prepare_warps=2)),
}


@pytest.mark.parametrize("feat", ["gate", "gated-delta-l2"])
@pytest.mark.parametrize("case", WY.keys())
def test_wy_matches_float64(case, feat):
    widths, T, variant = WY[case]
    f = FEATURES[feat]  # without the delta rule wy has no solve to move: the plain path runs
    dev, ref, s0 = _case(2, T, 1, widths, 6, gate=f["gate"], delta=f["delta"], state=True)
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True,
                              l2norm=f["l2norm"], mode="chunk", variant=variant)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=f["l2norm"])
    assert rel_err(o.cpu(), o_ref) < FP32_TOL and rel_err(s.cpu(), s_ref) < FP32_TOL


OUTPUT_PASS = {
    # the three-kernel form: a state-only sequential loop (next chunk's inputs in registers, or
    # loaded per chunk and pipelined), outputs of all chunks in parallel; partial last chunks
    "o2-16-c16-prefetch": ((16,), 37, ChunkVariant(chunk_size=16, block_k=16, block_v=16, prefetch=True,
                                                    output_pass=True)),
    "o2-16-c32-pipelined": ((16,), 70, ChunkVariant(chunk_size=32, block_k=16, block_v=16, num_stages=2,
                                                     output_pass=True, solve="tiles", prepare_warps=2)),
    "o3-16x16-c16": ((16, 16), 21, ChunkVariant(chunk_size=16, block_k=256, block_v=16, prefetch=True,
                                                 output_pass=True, solve="tiles", prepare_warps=1)),
    # phi(K) stored by the prepare kernel and read in both orientations
    "o2-16-c64-stored": ((16,), 77, ChunkVariant(chunk_size=64, block_k=16, block_v=16, num_stages=2,
                                                  output_pass=True, stored_keys=True, solve="tiles",
                                                  prepare_warps=2)),
    "o3-16x16-c16-stored": ((16, 16), 45, ChunkVariant(chunk_size=16, block_k=256, block_v=16, num_stages=2,
                                                        output_pass=True, stored_keys=True, solve="tiles",
                                                        prepare_warps=2)),
    # phi(K) stored 2 and 4 indices of axis 1 at a time (key_group)
    "o3-16x16-c16-stored-kg2": ((16, 16), 45, ChunkVariant(chunk_size=16, block_k=256, block_v=16, num_stages=2,
                                                            output_pass=True, stored_keys=True, solve="tiles",
                                                            prepare_warps=1, key_group=2)),
    "o3-16x16-c32-stored-kg4": ((16, 16), 45, ChunkVariant(chunk_size=32, block_k=256, block_v=16, num_stages=2,
                                                            output_pass=True, stored_keys=True, solve="tiles",
                                                            prepare_warps=2, key_group=4)),
    # the state stored at every 2nd / 4th chunk only (state_stride): the output kernel adds the
    # window's earlier chunks as cross-chunk scores; T = 77 (5 chunks, the last partial)
    "o3-16x16-c16-stored-stride2": ((16, 16), 77, ChunkVariant(chunk_size=16, block_k=256, block_v=16,
                                                                num_stages=2, output_pass=True, stored_keys=True,
                                                                solve="tiles", prepare_warps=1, state_stride=2)),
    "o2-16-c16-stride4": ((16,), 77, ChunkVariant(chunk_size=16, block_k=16, block_v=16, prefetch=True,
                                                   output_pass=True, state_stride=4)),
    # wy: the prepare kernel applies the solve (W, U0, in column blocks), the loop reads them;
    # with the row solve (no inverse workspace) and the tile solve (read back)
    "o2-16-c32-wy-rows": ((16,), 70, ChunkVariant(chunk_size=32, block_k=16, block_v=16, prefetch=True,
                                                  output_pass=True, wy=True)),
    "o3-16x16-c16-stored-wy": ((16, 16), 37, ChunkVariant(chunk_size=16, block_k=256, block_v=16, num_stages=2,
                                                           output_pass=True, stored_keys=True, wy=True,
                                                           solve="tiles", prepare_warps=2)),
    # in time segments (state handed over through the final-state buffer): 5 chunks in 3 ranges
    "o2-16-c16-segments4": ((16,), 77, ChunkVariant(chunk_size=16, block_k=16, block_v=16, prefetch=True,
                                                     output_pass=True, segments=4)),
    "o3-16x16-c16-stored-segments2": ((16, 16), 45, ChunkVariant(chunk_size=16, block_k=256, block_v=16,
                                                                  num_stages=2, output_pass=True, stored_keys=True,
                                                                  solve="tiles", prepare_warps=1, segments=2)),
}


@pytest.mark.parametrize("feat", ["plain", "gate", "gated-delta-l2"])
@pytest.mark.parametrize("case", OUTPUT_PASS.keys())
def test_output_pass_matches_float64(case, feat):
    widths, T, variant = OUTPUT_PASS[case]
    f = FEATURES[feat]
    dev, ref, s0 = _case(2, T, 1, widths, 6, gate=f["gate"], delta=f["delta"], state=True)
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True,
                              l2norm=f["l2norm"], mode="chunk", variant=variant)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=f["l2norm"])
    assert rel_err(o.cpu(), o_ref) < FP32_TOL and rel_err(s.cpu(), s_ref) < FP32_TOL


@pytest.mark.parametrize("out_bv, out_warps", [(32, 2), (64, 4)], ids=["out32-w2", "out64-w4"])
def test_output_pass_output_tiles(out_bv, out_warps):
    """The output kernel's own value tile and warps: d_v 40 in two 32-column tiles (the second
    partial) or one 64-column tile, under the state loop's 16-column tiles."""
    dev, ref, s0 = _case(2, 45, 1, (16, 16), 40, gate=True, delta=True, state=True)
    variant = ChunkVariant(chunk_size=16, block_k=256, block_v=16, num_stages=2, output_pass=True, stored_keys=True,
                           solve="tiles", prepare_warps=2, output_block_v=out_bv, output_warps=out_warps)
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True, l2norm=True,
                              mode="chunk", variant=variant)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True)
    assert rel_err(o.cpu(), o_ref) < FP32_TOL and rel_err(s.cpu(), s_ref) < FP32_TOL


def test_output_pass_segments_without_final_state():
    """Segments hand the state over through a buffer of their own when no final state is asked."""
    dev, ref, s0 = _case(2, 77, 2, (16,), 6, state=True)
    variant = ChunkVariant(chunk_size=16, block_k=16, block_v=16, prefetch=True, output_pass=True, segments=8)
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), l2norm=True, mode="chunk", variant=variant)
    o_ref, _ = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True)
    assert s is None and rel_err(o.cpu(), o_ref) < FP32_TOL


@pytest.mark.parametrize("changes, match", [
    ({"block_k": 16, "output_pass": True}, "output_pass needs"),  # K = 256 streamed
    ({"output_pass": True, "fuse_prepare": True}, "output_pass needs"),
    ({"stored_keys": True, "num_stages": 2}, "stored_keys=True needs output_pass=True"),
    ({"output_pass": True, "stored_keys": True, "prefetch": True, "num_stages": 2}, "stored_keys needs prefetch=False"),
    ({"output_pass": True, "stored_keys": True, "num_stages": 1}, "stored_keys needs prefetch=False"),
    ({"segments": 2}, "segments=2 needs output_pass"),
    ({"output_pass": True, "segments": 3}, "segments=3; allowed"),
    ({"output_pass": True, "output_block_v": 32}, "output_block_v=32; allowed"),  # d_v 8
    ({"output_pass": True, "output_warps": 3}, "output_warps=3; allowed"),
    ({"output_warps": 2}, "output_warps=2 needs output_pass=True"),
    ({"output_pass": True, "stored_keys": True, "num_stages": 2, "key_group": 3}, "key_group=3; allowed: 1, 2, 4"),
    ({"output_pass": True, "num_stages": 2, "key_group": 2}, "key_group=2 needs stored_keys=True"),
    ({"output_pass": True, "state_stride": 3}, "state_stride=3; allowed: 1, 2, 4"),
    ({"state_stride": 2}, "state_stride=2 needs output_pass=True"),
    ({"output_pass": True, "state_stride": 2, "segments": 2}, "state_stride=2 needs segments=1"),
], ids=["streamed", "fused", "no-output-pass", "prefetch", "one-stage", "segments-alone", "segments-3", "out-bv-wide",
        "out-warps-3", "out-warps-alone", "key-group-3", "key-group-alone", "stride-3", "stride-alone",
        "stride-segments"])
def test_output_pass_refusals(changes, match):
    v = ChunkVariant(**{"chunk_size": 16, "block_k": 256, "block_v": 16, **changes})
    assert match in (v.check(KernelShape((16, 16), 8), 10**9) or "")
    assert "output_pass needs" in ChunkVariant(16, 16, 16, output_pass=True).check(KernelShape((3, 5), 8), 10**9)


def test_key_group_needs_a_trailing_factor():
    """Order 2 stores phi(K) (the factor itself) in one block: key_group > 1 is refused there."""
    v = ChunkVariant(chunk_size=16, block_k=16, block_v=16, num_stages=2, output_pass=True, stored_keys=True,
                     solve="tiles", key_group=2)
    assert "order >= 3" in (v.check(KernelShape((16,), 8), 10**9) or "")
    assert dataclasses.replace(v, block_k=256).check(KernelShape((16, 16), 8), 10**9) is None


@pytest.mark.parametrize("case", BLOCKED_SOLVE.keys())
def test_blocked_solve_matches_float64(case):
    widths, T, variant = BLOCKED_SOLVE[case]
    dev, ref, s0 = _case(1, T, 1, widths, 5, state=True)
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True,
                              l2norm=True, mode="chunk", variant=variant)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True)
    assert rel_err(o.cpu(), o_ref) < FP32_TOL and rel_err(s.cpu(), s_ref) < FP32_TOL


@triton.jit
def _invert_kernel(A, X, C: tl.constexpr, BS: tl.constexpr, DIAGONAL: tl.constexpr):
    o = tl.arange(0, C)
    b_A = tl.load(A + o[:, None] * C + o[None, :])
    if DIAGONAL:
        b_X = unit_lower_inverse_diagonal(b_A, C, BS, "ieee")
    else:
        b_X = unit_lower_inverse_blocked(b_A, C, BS, "ieee")
    tl.store(X + o[:, None] * C + o[None, :], b_X)


@pytest.mark.parametrize("diagonal", [False, True], ids=["strips", "diagonal"])
@pytest.mark.parametrize("C, BS", [(32, 16), (64, 16), (16, 4), (32, 4), (64, 4), (64, 8)],
                         ids=["c32-bs16", "c64-bs16", "c16-bs4", "c32-bs4", "c64-bs4", "c64-bs8"])
def test_unit_lower_inverse_blocked_is_the_inverse(C, BS, diagonal):
    # entries of size 1 (beta ~ 1, near-parallel keys) make the inverse's entries grow along chains
    A = (torch.rand(C, C, dtype=torch.float64) * 2 - 1).tril(-1)
    X = torch.full((C, C), float("nan"), device=DEVICE)
    _invert_kernel[(1,)](A.float().to(DEVICE), X, C=C, BS=BS, DIAGONAL=diagonal)
    ref = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A.float().double())
    assert rel_err(X.cpu(), ref) < 1e-4


@triton.jit
def _invert_tiles_kernel(A, n_rows, C: tl.constexpr):
    unit_lower_inverse_tiles(A, n_rows, C, "ieee")


@pytest.mark.parametrize("C, n_rows", [(16, 16), (32, 32), (64, 64), (64, 37), (32, 9), (64, 1)],
                         ids=["c16", "c32", "c64", "c64-37rows", "c32-9rows", "c64-1row"])
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


VARLEN_PREFETCH = ChunkVariant(chunk_size=16, block_k=16, block_v=16, num_stages=1, prefetch=True)


VARLEN = {f"{impl}-{name}": (w, impl) for impl in ("chunk16", "recurrent")
          for name, w in (("o2", (5,)), ("o3", (3, 4)), ("o4", (2, 3, 2)))}
VARLEN["chunk16-prefetch-o2-16"] = ((16,), "chunk16-prefetch")  # prefetch takes widths >= 16 only
VARLEN["chunk16-wy-o3"] = ((3, 4), "chunk16-wy")
VARLEN["chunk16-merge-o3"] = ((3, 7), "chunk16-merge")  # K = 21: streamed in 16-row tiles
VARLEN["chunk16-kron-o4"] = ((2, 2, 16), "chunk16-kron")  # K = 64: two 32-row tiles, one per x1 index
VARLEN["chunk32-tiles-o3"] = ((3, 4), "chunk32-tiles")  # the tile solve must not touch the next sequence's rows
VARLEN["chunk32-tiles-fused-o4"] = ((2, 3, 2), "chunk32-tiles-fused")
VARLEN["chunk32-wy-tiles-o3"] = ((3, 4), "chunk32-wy-tiles")
# the three-kernel form: chunk offsets per sequence for the stored states, chunk_indices for the outputs
VARLEN["chunk16-output-pass-o2-16"] = ((16,), "chunk16-output-pass")
VARLEN["chunk16-stored-keys-o2-16"] = ((16,), "chunk16-stored-keys")


@pytest.mark.parametrize("case", VARLEN.keys())
def test_varlen_uneven_lengths(case):
    widths, impl = VARLEN[case]
    offsets = [0, 5, 6, 23, 30]  # lengths 5, 1, 17, 7
    N = len(offsets) - 1
    dev, ref, s0 = _case(1, offsets[-1], 2, widths, 3, state=True, num_seqs=N)
    cu = torch.tensor(offsets, dtype=torch.int32)
    mode, variant = {"chunk16-prefetch": ("chunk", VARLEN_PREFETCH),
                     "chunk16-wy": ("chunk", ChunkVariant(chunk_size=16, block_k=16, block_v=16, wy=True)),
                     "chunk16-merge": ("chunk", ChunkVariant(chunk_size=16, block_k=16, block_v=16, prefetch=True,
                                                             merge_passes=True)),
                     "chunk16-kron": ("chunk", ChunkVariant(chunk_size=16, block_k=32, block_v=16, kron=True,
                                                            merge_passes=True)),
                     "chunk32-tiles": ("chunk", ChunkVariant(chunk_size=32, block_k=16, block_v=16, solve="tiles")),
                     "chunk32-wy-tiles": ("chunk", ChunkVariant(chunk_size=32, block_k=16, block_v=16, wy=True,
                                                                solve="tiles")),
                     "chunk32-tiles-fused": ("chunk", ChunkVariant(chunk_size=32, block_k=16, block_v=16, solve="tiles",
                                                                   fuse_prepare=True)),
                     "chunk16-output-pass": ("chunk", ChunkVariant(chunk_size=16, block_k=16, block_v=16, prefetch=True,
                                                                   output_pass=True)),
                     "chunk16-stored-keys": ("chunk", ChunkVariant(chunk_size=16, block_k=16, block_v=16, num_stages=2,
                                                                   output_pass=True, stored_keys=True,
                                                                   solve="tiles"))}.get(
        impl) or VARIANTS[impl]
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True, l2norm=True,
                              cu_seqlens=_to(cu), mode=mode, variant=variant)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True, cu_seqlens=cu)
    assert s.shape == (N, 2, *widths, 3)
    assert rel_err(o.cpu(), o_ref) < FP32_TOL and rel_err(s.cpu(), s_ref) < FP32_TOL


@pytest.mark.parametrize("stride", [2, 4])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_output_pass_state_stride_varlen(stride, tma):
    """Stored states every 2nd / 4th chunk of each sequence, with varlen: each sequence's first
    stored state comes from per-sequence offsets in stored-state units (lengths 5, 1, 54, 37:
    1, 1, 4 and 3 chunks of 16), and a window never reaches into the sequence before."""
    offsets = [0, 5, 6, 60, 97]
    dev, ref, s0 = _case(1, offsets[-1], 2, (16, 16), 8, state=True, num_seqs=len(offsets) - 1)
    cu = torch.tensor(offsets, dtype=torch.int32)
    variant = dataclasses.replace(TMA_VARIANT, tma=tma, state_stride=stride)
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True, l2norm=True,
                              cu_seqlens=_to(cu), mode="chunk", variant=variant)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True,
                                                cu_seqlens=cu)
    assert rel_err(o.cpu(), o_ref) < FP32_TOL and rel_err(s.cpu(), s_ref) < FP32_TOL


@pytest.mark.parametrize("impl", ["chunk16", "recurrent"])
def test_single_token(impl):
    dev, ref, s0 = _case(3, 1, 2, (3, 4), 5, state=True)
    mode, variant = VARIANTS[impl]
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True, l2norm=True,
                              mode=mode, variant=variant)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True)
    assert rel_err(o.cpu(), o_ref) < FP32_TOL and rel_err(s.cpu(), s_ref) < FP32_TOL


def test_default_variants_run():
    # the defaults chosen from the shapes (C = 64 here): T = 70 covers a partial second chunk
    dev, ref, s0 = _case(1, 70, 1, (4, 4), 16, state=True)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True)
    for mode in ("chunk", "recurrent"):
        o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True,
                                  l2norm=True, mode=mode)
        assert rel_err(o.cpu(), o_ref) < FP32_TOL and rel_err(s.cpu(), s_ref) < FP32_TOL


OUTER_WIDTHS = {"o2-d8": (8,), "o3-2x4": (2, 4), "o4-2x2x4": (2, 2, 4)}


@pytest.mark.parametrize("widths", OUTER_WIDTHS.values(), ids=OUTER_WIDTHS.keys())
@pytest.mark.parametrize("tiles", ["resident", "streamed"])
def test_recurrent_outer_phi(widths, tiles):
    """phi from outer products of factor loads (power-of-two widths), with the state in
    registers or streamed in tiles of exactly the trailing widths' product."""
    K = math.prod(widths)
    bk = K if tiles == "resident" else max(2, math.prod(widths[1:]))
    variant = RecurrentVariant(block_k=bk, block_v=4, outer_phi=True)
    dev, ref, s0 = _case(2, 5, 2, widths, 6, gate=True, delta=True, state=True)
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True, l2norm=True,
                              mode="recurrent", variant=variant)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True)
    assert rel_err(o.cpu(), o_ref) < FP32_TOL and rel_err(s.cpu(), s_ref) < FP32_TOL


def test_outer_phi_refused_where_it_cannot_run():
    shape = KernelShape((3, 4), 8, 4)
    assert "outer_phi needs power-of-two" in RecurrentVariant(block_k=16, block_v=8, outer_phi=True).check(shape)
    shape = KernelShape((4, 8), 8, 4)  # block_k 4 does not cover the trailing width 8
    assert "outer_phi" in RecurrentVariant(block_k=4, block_v=8, outer_phi=True).check(shape)
    assert RecurrentVariant(block_k=8, block_v=8, outer_phi=True).check(shape) is None


def test_merge_passes_needs_a_streamed_state():
    shape = KernelShape((4, 4), 8, 4)
    assert "merge_passes needs a streamed state" in ChunkVariant(16, 16, 16, merge_passes=True).check(shape)
    assert ChunkVariant(16, 16, 16, merge_passes=True).check(KernelShape((4, 8), 8, 4)) is None


def test_stream_hints_need_a_resident_slab():
    shape = KernelShape((4, 8), 8, 4)
    assert "stream_hints needs the state slab resident" in RecurrentVariant(16, 8, stream_hints=True).check(shape)
    assert RecurrentVariant(32, 8, stream_hints=True).check(shape) is None
    assert RecurrentVariant.default(shape).stream_hints
    assert not RecurrentVariant.from_dict({"block_k": 32, "block_v": 8}).stream_hints  # stored before the field


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("impl", ["chunk16", "recurrent"])
def test_half_inputs(dtype, impl):
    dev, ref, s0 = _case(2, 21, 2, (3, 4), 6, dtype=dtype, state=True)
    mode, variant = VARIANTS[impl]
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True, l2norm=True,
                              mode=mode, variant=variant)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True)
    assert o.dtype == dtype
    # 16-bit output rounding (2^-8 for bf16) dominates; the fp32 state stays close
    assert rel_err(o.cpu(), o_ref) < (1e-2 if dtype == torch.bfloat16 else 2e-3)
    assert rel_err(s.cpu(), s_ref) < 1e-2


HALF_STREAMED = {
    # 16-bit operands (tl.dot in fp16): the streamed phi blocks are built in the dot type, and the
    # update's row scales ride on U; both pass 1 and pass 2 go through it
    "o3-4x8-streamed": ((4, 8), ChunkVariant(chunk_size=16, block_k=16, block_v=16)),
    "o4-2x4x4-streamed-prefetch": ((2, 4, 4), ChunkVariant(chunk_size=16, block_k=16, block_v=16, prefetch=True)),
    "o3-5x7-gathered": ((5, 7), ChunkVariant(chunk_size=16, block_k=16, block_v=16)),
    "o3-4x8-merge": ((4, 8), ChunkVariant(chunk_size=16, block_k=16, block_v=16, merge_passes=True)),
    # kron with square [C, 16] trailing tiles (C = 16) and the transposed tile of the update
    "o4-4x4x4-kron-merge": ((4, 4, 4), ChunkVariant(chunk_size=16, block_k=16, block_v=16, kron=True,
                                                    merge_passes=True)),
    "o4-2x4x4-kron": ((2, 4, 4), ChunkVariant(chunk_size=16, block_k=16, block_v=16, kron=True)),
    # the tile solve (C = 32: two blocks) in the workspace and fused in a scratch
    "o3-4x8-tiles-c32": ((4, 8), ChunkVariant(chunk_size=32, block_k=16, block_v=16, solve="tiles")),
    "o3-4x8-tiles-c32-fused": ((4, 8), ChunkVariant(chunk_size=32, block_k=16, block_v=16, solve="tiles",
                                                    fuse_prepare=True)),
    # the three-kernel form: stored states, U and phi(K) in the 16-bit type
    "o2-16-output-pass-stored": ((16,), ChunkVariant(chunk_size=32, block_k=16, block_v=16, num_stages=2,
                                                     output_pass=True, stored_keys=True, solve="tiles")),
    "o2-16-output-pass": ((16,), ChunkVariant(chunk_size=16, block_k=16, block_v=16, prefetch=True,
                                              output_pass=True)),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", HALF_STREAMED.keys())
def test_half_inputs_streamed_state(case, dtype):
    widths, variant = HALF_STREAMED[case]
    dev, ref, s0 = _case(2, 37, 2, widths, 6, dtype=dtype, state=True)
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True, l2norm=True,
                              mode="chunk", variant=variant)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True)
    assert o.dtype == dtype
    assert rel_err(o.cpu(), o_ref) < (1e-2 if dtype == torch.bfloat16 else 2e-3) and rel_err(s.cpu(), s_ref) < 1e-2


DECODE_SLOTS = {
    f"{o}-{kind}": (w, var)
    for o, w, kp in (("o2", (5,), 8), ("o3", (3, 4), 16), ("o4", (2, 3, 2), 16))
    for kind, var in (("resident", None),  # the default: stream hints on
                      ("resident-nohints", RecurrentVariant(block_k=kp, block_v=4, stream_hints=False)),
                      ("streamed", RecurrentVariant(block_k=4, block_v=4)))
}
# power-of-two widths: the slab held factored ([d_1, ..., d_{o-1}, BV]) or streamed as outer products
DECODE_SLOTS.update({
    f"{o}-outer-{kind}": (w, RecurrentVariant(block_k=bk, block_v=4, outer_phi=True))
    for o, w, K in (("o2", (8,), 8), ("o3", (2, 4), 8), ("o4", (2, 2, 4), 16))
    for kind, bk in (("factored", K), ("streamed", K // 2))
})


@pytest.mark.parametrize("case", DECODE_SLOTS.keys())
def test_decode_in_place_slots(case):
    widths, variant = DECODE_SLOTS[case]
    slots, H, V = 6, 2, 5
    idx = [4, 0, -1, 2]  # -1: padding entry, reads and writes nothing
    dev, ref, _ = _case(len(idx), 1, H, widths, V, state=False)
    cache = torch.randn(slots, H, *widths, V, dtype=torch.float32)
    before = cache.clone()
    cache_dev = _to(cache)
    o = running_tensor_decode_(*dev, state_cache=cache_dev, state_indices=_to(torch.tensor(idx, dtype=torch.int32)),
                               l2norm=True, variant=variant)
    cache_after = cache_dev.cpu()
    for n, slot in enumerate(idx):
        if slot < 0:
            continue
        one = lambda x: None if x is None else x[n : n + 1]
        o_ref, s_ref = running_tensor_recurrent_ref(
            [one(x) for x in ref[0]], [one(x) for x in ref[1]], one(ref[2]), one(ref[3]), one(ref[4]),
            initial_state=before[slot : slot + 1].double(), output_final_state=True, l2norm=True,
        )
        assert rel_err(o[n : n + 1].cpu(), o_ref) < FP32_TOL
        assert rel_err(cache_after[slot : slot + 1], s_ref) < FP32_TOL
    for slot in {1, 3, 5}:  # untouched slots are bit-identical
        assert torch.equal(cache_after[slot], before[slot])


def test_decode_matches_plain_form():
    dev, ref, s0 = _case(3, 1, 2, (3, 4), 5, state=True)
    s0 = s0.float()
    o_plain, s_plain = running_tensor_fwd(*dev, initial_state=_to(s0), output_final_state=True, l2norm=True, mode="recurrent")
    cache = _to(s0.clone())
    o = running_tensor_decode_(*dev, state_cache=cache, state_indices=_to(torch.arange(3, dtype=torch.int32)), l2norm=True)
    assert torch.equal(o, o_plain) and torch.equal(cache, s_plain)


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "v-unaligned"])
def test_decode_steps_reuse_the_plan(offset):
    """Three steps with the same shapes (the second and third reuse the first's launch plan, on
    a GPU its compiled launcher) equal the float64 token loop over the three tokens; a v whose
    data pointer is not 16-byte aligned takes Triton's full path and is still right."""
    N, H, widths, V = 3, 2, (3, 4), 5
    dev, ref, s0 = _case(N, 3, H, widths, V, state=True)
    cache = _to(s0.float().clone())
    idx = _to(torch.arange(N, dtype=torch.int32))
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True)
    for t in range(3):
        one = lambda x, t=t: None if x is None else x[:, t : t + 1].contiguous()
        q, k = [one(x) for x in dev[0]], [one(x) for x in dev[1]]
        v = one(dev[2])
        if offset:  # the same values at an address 4 bytes past a 16-byte boundary
            buf = torch.empty(v.numel() + offset, dtype=v.dtype, device=v.device)
            buf[offset:] = v.flatten()
            v = buf[offset:].view(v.shape)
        o = running_tensor_decode_(q, k, v, one(dev[3]), one(dev[4]), state_cache=cache, state_indices=idx,
                                   l2norm=True)
        assert rel_err(o.cpu(), o_ref[:, t : t + 1]) < FP32_TOL
    assert rel_err(cache.cpu(), s_ref) < FP32_TOL
    if DEVICE == "cuda" and not offset:  # the later steps took the compiled launcher
        assert any(plan._runner is not None for plan in triton_fwd._DECODE_PLANS.values())


def test_public_api_dispatches_to_triton(monkeypatch):
    calls = []
    real = triton_fwd.fwd_checked  # the launcher after the public API's own argument checks
    monkeypatch.setattr(triton_fwd, "fwd_checked", lambda *a, **kw: calls.append(kw["mode"]) or real(*a, **kw))
    dev, ref, s0 = _case(1, 20, 2, (3, 4), 4)
    o, _ = rtcompile.running_tensor(*dev, l2norm=True, mode="chunk", chunk_size=16)
    assert calls == ["chunk"]
    o_ref, _ = running_tensor_recurrent_ref(*ref, l2norm=True)
    assert rel_err(o.cpu(), o_ref) < FP32_TOL
    # inputs that require grad: 'auto' falls back to the (differentiable) reference ...
    q = [x.clone().requires_grad_() for x in dev[0]]
    o2, _ = rtcompile.running_tensor(q, *dev[1:], l2norm=True, mode="chunk", chunk_size=16)
    assert calls == ["chunk"] and o2.requires_grad
    # ... and 'triton' refuses before launching anything
    with pytest.raises(ValueError, match="backend: 'triton' is forward-only"):
        rtcompile.running_tensor(q, *dev[1:], backend="triton")
    assert calls == ["chunk"]


TMA_VARIANT = ChunkVariant(chunk_size=16, block_k=256, block_v=16, num_stages=2, output_pass=True, stored_keys=True,
                           solve="tiles", prepare_warps=2, tma=True, key_group=2)


@pytest.mark.parametrize("stride", [1, 4], ids=["every-chunk", "stride4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("feat", ["plain", "gate", "gated-delta-l2"])
def test_output_pass_tma_matches_float64(feat, dtype, stride):
    """phi(K) read and each chunk's state stored through tensor descriptors (tma): T = 45 ends
    in a partial chunk whose block reads the next head's rows, d_v 8 (16-byte rows); with the
    state stored at every 4th chunk, the output kernel adds up to 2 earlier chunks."""
    f = FEATURES[feat]
    dev, ref, s0 = _case(2, 45, 2, (16, 16), 8, dtype=dtype, gate=f["gate"], delta=f["delta"], state=True)
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True,
                              l2norm=f["l2norm"], mode="chunk",
                              variant=dataclasses.replace(TMA_VARIANT, state_stride=stride))
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=f["l2norm"])
    tol = FP32_TOL if dtype == torch.float32 else 1e-2
    assert rel_err(o.cpu(), o_ref) < tol and rel_err(s.cpu(), s_ref) < tol


def test_tile_solve_in_tf32_keeps_the_bf16_tolerance():
    """The tile solve's [16, 16] products in tf32 with bf16 inputs (the K > 256 defaults' rule,
    a candidate at K = 256): C = 32, so the inverse has 2 x 2 blocks and a block product (C = 64
    is over the portable shared-memory limit here), and T = 75 ends in a partial chunk. The
    interpreter computes tf32 products in fp32; on the GPU this checks tf32's own rounding
    against the bf16 tolerance."""
    dev, ref, s0 = _case(1, 75, 1, (16, 16), 8, dtype=torch.bfloat16, gate=True, delta=True, state=True)
    variant = dataclasses.replace(TMA_VARIANT, chunk_size=32, dot_precision="tf32", prepare_warps=1)
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True, l2norm=True,
                              mode="chunk", variant=variant)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True)
    assert rel_err(o.cpu(), o_ref) < 1e-2 and rel_err(s.cpu(), s_ref) < 1e-2


def test_output_pass_tma_varlen():
    """Varlen: a chunk's block runs into the next sequence's rows; they must add nothing."""
    offsets = [0, 5, 6, 23, 30]
    dev, ref, s0 = _case(1, offsets[-1], 2, (16, 16), 8, state=True, num_seqs=len(offsets) - 1)
    cu = torch.tensor(offsets, dtype=torch.int32)
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True, l2norm=True,
                              cu_seqlens=_to(cu), mode="chunk", variant=TMA_VARIANT)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True,
                                                cu_seqlens=cu)
    assert rel_err(o.cpu(), o_ref) < FP32_TOL and rel_err(s.cpu(), s_ref) < FP32_TOL


def test_tma_refusals():
    shape = KernelShape((16, 16), 6)  # d_v 6 in fp32: 24-byte rows
    assert "16-byte" in (TMA_VARIANT.check(shape, 10**9) or "")
    assert "tma=True needs stored_keys=True" in (dataclasses.replace(TMA_VARIANT, stored_keys=False).check(
        KernelShape((16, 16), 8), 10**9) or "")
    assert TMA_VARIANT.check(KernelShape((16, 16), 8), 10**9) is None
