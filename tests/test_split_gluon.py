"""The split form's Gluon state loop (``SplitConfig(loop="gluon")``): against the float64 reference
on an sm_90 GPU (outputs and workspaces poisoned with NaN first), its rules and refusals
everywhere, and its compile for sm_90 without a GPU (a subprocess without the interpreter)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rtcompile.kernels import chunk_split_gluon, launch
from rtcompile.kernels.chunk_split import SplitConfig
from rtcompile.kernels.config import KernelShape
from rtcompile.kernels.forms import candidates, low_memory

from test_kernels import DEVICE, FEATURES, check_against_reference

ROOT = Path(__file__).resolve().parents[1]
HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
on_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon loop runs on sm_90 GPUs only (no interpreter)")
SMEM = 232448  # an H200's opt-in shared memory per block

# (config, key widths, T): T never a multiple of C; d_v 64 (the loop's value block)
GLUON = {
    "o3-16x16-c32-stride2-kg2": (SplitConfig(32, 64, loop="gluon", key_group=2, state_stride=2), (16, 16), 200),
    "o3-16x16-c32-wy-parts2": (SplitConfig(32, 64, loop="gluon", key_group=2, wy=True, pipeline=2), (16, 16), 150),
    "o2-64-c32-wy-parts4": (SplitConfig(32, 64, loop="gluon", wy=True, pipeline=4), (64,), 150),
    "o2-64-c16-stride4": (SplitConfig(16, 64, loop="gluon", state_stride=4), (64,), 77),
    "o2-128-c32": (SplitConfig(32, 64, loop="gluon"), (128,), 100),
    "o2-256-c32-wy-stride2": (SplitConfig(32, 64, loop="gluon", wy=True, state_stride=2), (256,), 100),
    "o3-8x8-materialised-c32-wy": (SplitConfig(32, 64, loop="gluon", wy=True, materialise=True), (8, 8), 100),
    "o3-16x8-materialised-c32-stride4": (SplitConfig(32, 64, loop="gluon", materialise=True, state_stride=4),
                                         (16, 8), 130),
    # tf32 solve products, as the Gluon rows' defaults take them with 16-bit inputs (fp32 inputs: ieee)
    "o2-64-c32-tf32-parts2": (SplitConfig(32, 64, loop="gluon", dot_precision="tf32", pipeline=2), (64,), 100),
    "o3-8x8-materialised-c32-tf32": (SplitConfig(32, 64, loop="gluon", dot_precision="tf32", materialise=True),
                                     (8, 8), 77),
}


@on_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("feat", FEATURES.keys())
@pytest.mark.parametrize("form", GLUON.keys())
def test_gluon_loop_matches_reference(form, feat, dtype, poison):
    config, widths, T = GLUON[form]
    check_against_reference(config, 2, T, 3, widths, 64, dtype, **FEATURES[feat])


@on_hopper
@pytest.mark.parametrize("form", ["o3-16x16-c32-stride2-kg2", "o2-64-c32-wy-parts4", "o2-256-c32-wy-stride2"])
def test_gluon_loop_varlen_and_d_v_128(form, poison):
    config, widths, _ = GLUON[form]
    offsets = [0, 5, 6, 130, 197]  # 1 to 3 chunks, partial ones
    check_against_reference(config, 1, offsets[-1], 2, widths, 64, torch.bfloat16, offsets=offsets)
    check_against_reference(config, 2, 70, 2, widths, 128, torch.bfloat16)  # two value blocks
    check_against_reference(config, 2, 70, 2, widths, 64, torch.bfloat16, final_state=False)


def test_gluon_loop_refusals_name_the_field():
    shape = KernelShape((16, 16), 64, 2)
    ok = SplitConfig(32, 64, loop="gluon", key_group=2)
    if chunk_split_gluon.gluon is None:
        assert "Gluon" in ok.check(shape, SMEM)
        return
    assert ok.check(shape, SMEM) is None
    assert "16-bit inputs" in ok.check(KernelShape((16, 16), 64, 4), SMEM)
    assert "block_v=64" in dataclasses.replace(ok, block_v=32).check(shape, SMEM)
    assert "num_warps=4" in dataclasses.replace(ok, num_warps=8).check(shape, SMEM)
    assert "multiple of 64" in ok.check(KernelShape((16, 16), 96, 2), SMEM)
    assert "chunk_size in 16, 32" in dataclasses.replace(ok, chunk_size=64, output_block_v=64).check(shape, SMEM)
    assert "loop='cuda'; allowed: 'triton', 'gluon'" in dataclasses.replace(ok, loop="cuda").check(shape, SMEM)


def test_defaults_propose_the_gluon_loop_only_where_it_runs(monkeypatch):
    """The defaults table's Gluon proposals (K <= 256 at order 2, materialised o3 up to K 128)
    lead only where this process's GPU runs them; 32-bit inputs take the Triton proposals."""
    shape = KernelShape((64,), 64, 2)
    monkeypatch.setattr(chunk_split_gluon, "runs_here", lambda: False)
    assert all(getattr(c, "loop", "triton") == "triton" for c in candidates("chunk", shape, SMEM))
    monkeypatch.setattr(chunk_split_gluon, "runs_here", lambda: True)
    first = candidates("chunk", shape, SMEM)[0]
    assert (first.loop, first.block_v, first.num_warps) == (("gluon", 64, 4) if chunk_split_gluon.gluon else
                                                            ("triton", 32, 4))
    if chunk_split_gluon.gluon:  # the solve's products in tf32 with 16-bit inputs (0.985-0.994x, H100)
        assert first.dot_precision == "tf32"
        assert first.solve == "tiles"
        # o2 256 inverts by products in registers at 4 prepare warps (H100: 0.934x the tile solve)
        o2_256 = candidates("chunk", KernelShape((256,), 64, 2), SMEM)[0]
        assert (o2_256.loop, o2_256.solve, o2_256.prepare_warps) == ("gluon", "products", 4)
        assert low_memory(KernelShape((256,), 64, 2), SMEM).solve == "tiles"  # its fused sibling's, measured
    assert candidates("chunk", KernelShape((64,), 64, 4), SMEM)[0].loop == "triton"
    assert candidates("chunk", KernelShape((16, 16), 64, 2), SMEM)[0].loop == "triton"  # measured slower there


@pytest.mark.skipif(HOPPER, reason="off sm_90 only")
def test_gluon_loop_is_never_the_default_off_hopper_and_refused_when_asked():
    """A default or tuned config never names the Gluon loop where it cannot run; a caller's
    explicit one is refused with the reason (before any work)."""
    from rtcompile.kernels.inputs import check_inputs

    dev = torch.device(DEVICE)
    q = [torch.randn(1, 8, 1, 64, device=dev, dtype=torch.bfloat16)]
    v = torch.randn(1, 8, 1, 64, device=dev, dtype=torch.bfloat16)
    p = check_inputs(q, q, v, None, None, None, None, None)
    assert getattr(launch.resolve_config("chunk", None, p, dev), "loop", "triton") == "triton"
    gluon = SplitConfig(32, 64, loop="gluon")
    with pytest.raises(ValueError, match="loop='gluon' needs an sm_90 GPU"):
        launch.resolve_config("chunk", gluon, p, dev)
    assert launch.runnable(gluon, p, dev) is None


@pytest.mark.skipif(chunk_split_gluon.gluon is None, reason="this Triton has no Gluon")
def test_gluon_loop_compiles_for_sm90_offline():
    """The loop compiles for sm_90 with the installed Triton (no GPU: ptxas only) without spills
    at K = 64 and 128; the compiler's report is the probe's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probe_offline.py"), "--widths", "64",
                          "--set", "loop=gluon", "--set", "block_v=64", "--set", "num_warps=4", "--set", "wy=true"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("chunk_split_state_gluon_kernel"))
    assert " spill stack     0 B" in line, line
