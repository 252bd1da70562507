"""The streamed form's Gluon sequential kernel (``StreamedConfig(loop="gluon")``): against the
float64 reference on an sm_90 GPU (outputs and workspaces poisoned with NaN first), its refusals
everywhere, and its compile for sm_90 without a GPU (a subprocess without the interpreter)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rtcompile.kernels import chunk_streamed_gluon, launch
from rtcompile.kernels.chunk_streamed import StreamedConfig
from rtcompile.kernels.config import KernelShape

from test_kernels import DEVICE, FEATURES, check_against_reference

ROOT = Path(__file__).resolve().parents[1]
HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
on_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel runs on sm_90 GPUs only (no interpreter)")
SMEM = 232448  # an H200's opt-in shared memory per block


def gluon(block_v: int = 16, num_warps: int = 4, block_k: int = 64) -> StreamedConfig:
    return StreamedConfig(chunk_size=64, block_k=block_k, block_v=block_v, num_warps=num_warps, prepare_warps=2,
                          loop="gluon")


# (config, key widths, T): T never a multiple of 64; second widths 8, 16, 32 (one to four factor-1
# columns a 64-column phi slice; phi(Q) S from registers at 16 and 32, from a phi(Q) tile at 8)
GLUON = {
    "o3-16x8-bv16-w4": (gluon(), (16, 8), 150),
    "o3-16x16-bv32-w4": (gluon(32), (16, 16), 100),
    "o3-32x16-bv32-w8": (gluon(32, 8, 256), (32, 16), 77),
    "o3-32x32-bv16-w4": (gluon(16, 4, 256), (32, 32), 130),
    "o3-32x32-bv32-w8": (gluon(32, 8, 256), (32, 32), 100),
    "o3-32x16-bv32-w8-prefetch": (dataclasses.replace(gluon(32, 8, 256), prefetch_inputs=True), (32, 16), 150),
    "o3-32x32-bv32-w8-prefetch": (dataclasses.replace(gluon(32, 8, 256), prefetch_inputs=True), (32, 32), 150),
}


@on_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("feat", FEATURES.keys())
@pytest.mark.parametrize("form", GLUON.keys())
def test_streamed_gluon_matches_reference(form, feat, dtype, poison):
    config, widths, T = GLUON[form]
    check_against_reference(config, 2, T, 3, widths, 64, dtype, **FEATURES[feat])


@on_hopper
@pytest.mark.parametrize("form", ["o3-16x8-bv16-w4", "o3-32x32-bv16-w4", "o3-32x16-bv32-w8-prefetch",
                                  "o3-32x32-bv32-w8-prefetch"])
def test_streamed_gluon_varlen_and_d_v(form, poison):
    config, widths, _ = GLUON[form]
    offsets = [0, 5, 6, 130, 197]  # 1 to 3 chunks, partial ones
    check_against_reference(config, 1, offsets[-1], 2, widths, 64, torch.bfloat16, offsets=offsets)
    check_against_reference(config, 2, 70, 2, widths, 40, torch.bfloat16)  # a partial value block
    check_against_reference(config, 2, 70, 2, widths, 64, torch.bfloat16, final_state=False)


def test_streamed_gluon_refusals_name_the_field():
    shape = KernelShape((32, 32), 64, 2)
    ok = gluon(block_k=256)
    if chunk_streamed_gluon.gluon is None:
        assert "Gluon" in ok.check(shape, SMEM)
        return
    assert ok.check(shape, SMEM) is None
    assert "16-bit inputs" in ok.check(KernelShape((32, 32), 64, 4), SMEM)
    assert "order 3" in ok.check(KernelShape((1024,), 64, 2), SMEM)
    assert "order 3" in ok.check(KernelShape((16, 8, 8), 64, 2), SMEM)
    assert "order 3" in ok.check(KernelShape((24, 16), 64, 2), SMEM)
    assert "chunk_size=64" in dataclasses.replace(ok, chunk_size=32).check(shape, SMEM)
    assert "block_v 16 or 32" in dataclasses.replace(ok, block_v=64).check(shape, SMEM)
    assert "at most 128" in dataclasses.replace(ok, block_v=32).check(shape, SMEM)
    assert dataclasses.replace(ok, block_v=32, num_warps=8).check(shape, SMEM) is None
    wide = dataclasses.replace(ok, num_warps=8)  # S [2048, 16] in 128 registers, but phi [64, 2048] is 256 KiB
    assert "shared memory" in wide.check(KernelShape((64, 32), 64, 2), SMEM)
    assert "loop='cuda'; allowed: 'triton', 'gluon'" in dataclasses.replace(ok, loop="cuda").check(shape, SMEM)
    triton_prefetch = dataclasses.replace(ok, loop="triton", prefetch_inputs=True)
    assert "prefetch_inputs=True is the Gluon kernel's" in triton_prefetch.check(shape, SMEM)


@pytest.mark.skipif(HOPPER, reason="off sm_90 only")
def test_streamed_gluon_is_refused_off_hopper():
    """A caller's Gluon config is refused with the reason before any work where it cannot run."""
    from rtcompile.kernels.inputs import check_inputs

    dev = torch.device(DEVICE)
    q = [torch.randn(1, 8, 1, w, device=dev, dtype=torch.bfloat16) for w in (16, 16)]
    v = torch.randn(1, 8, 1, 64, device=dev, dtype=torch.bfloat16)
    p = check_inputs(q, q, v, None, None, None, None, None)
    with pytest.raises(ValueError, match="loop='gluon' needs an sm_90 GPU"):
        launch.resolve_config("chunk", gluon(), p, dev)
    assert launch.runnable(gluon(), p, dev) is None


@pytest.mark.skipif(chunk_streamed_gluon.gluon is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("widths, on_chip", [((16, 8), False), ((16, 16), True)], ids=["o3-16x8", "o3-16x16-on-chip"])
def test_streamed_gluon_compiles_for_sm90_offline(widths, on_chip):
    """The kernel compiles for sm_90 with the installed Triton (no GPU: ptxas only), with P
    from the prepare kernel (16x8) and formed on chip (16x16, SCORES_ON_CHIP); the compiler's
    report is the probe's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    config = '{"form": "streamed", "chunk_size": 64, "block_k": 64, "block_v": 16, "num_warps": 4, "loop": "gluon"}'
    argv = ["probe_offline.py", "--widths", *map(str, widths), "--config", config]
    script = (f"import runpy, sys; from rtcompile.kernels import chunk_streamed_gluon as g; "
              f"g.SCORES_ON_CHIP = {on_chip}; sys.argv = {argv!r}; "
              f"runpy.run_path({str(ROOT / 'benchmarks' / 'probe_offline.py')!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert any(x.startswith("chunk_streamed_gluon_kernel") for x in out.stdout.splitlines()), out.stdout


def test_default_at_o3_k512_is_the_gluon_kernel_only_where_it_runs(monkeypatch):
    """o3 at K 512 and 1024 with 16-bit inputs takes the Gluon kernel first on sm_90 (0.64-0.75x
    the Triton kernel, H100); elsewhere, with fp32 inputs and at K 2048 the Triton kernel leads,
    and the fused low-memory sibling keeps the Triton kernel's tiles."""
    from rtcompile.kernels.forms import candidates, low_memory

    shape = KernelShape((32, 16), 64, 2)
    first = candidates("chunk", shape, SMEM, gluon=True)[0]
    if chunk_streamed_gluon.gluon is not None:
        assert (first.form, first.loop, first.block_v, first.num_warps, first.prefetch_inputs) == \
            ("streamed", "gluon", 32, 8, True)
        large = candidates("chunk", KernelShape((32, 32), 64, 2), SMEM, gluon=True)[0]
        # K 1024: no loads ahead (H100: 0.96-0.97x), the tile solve unrolled (0.988x); K 512 rolled
        assert (large.loop, large.prefetch_inputs, large.unroll_solve) == ("gluon", False, True)
        assert not first.unroll_solve
    assert candidates("chunk", shape, SMEM, gluon=False)[0].loop == "triton"
    assert candidates("chunk", KernelShape((32, 16), 64, 4), SMEM, gluon=True)[0].loop == "triton"
    assert candidates("chunk", KernelShape((64, 32), 64, 2), SMEM, gluon=True)[0].loop == "triton"
    from rtcompile.kernels import chunk_split_gluon

    monkeypatch.setattr(chunk_split_gluon, "runs_here", lambda: True)  # as on sm_90
    assert low_memory(shape, SMEM).block_v == candidates("chunk", shape, SMEM, gluon=False)[0].block_v


def test_a_callers_chunk_size_falls_back_from_the_gluon_default(monkeypatch):
    """Where the default is a Gluon kernel with a fixed chunk (sm_90, o3 K 1024: 64), a caller's
    chunk_size runs the first proposal that takes that size (the defaults table filtered by it,
    ``forms.candidates(chunk_size=...)``) instead of being refused."""
    from rtcompile.kernels import chunk_split_gluon
    from rtcompile.kernels.inputs import check_inputs

    q = [torch.randn(1, 8, 1, 32, dtype=torch.bfloat16) for _ in range(2)]
    v = torch.randn(1, 8, 1, 64, dtype=torch.bfloat16)
    p = check_inputs(q, q, v, None, None, None, None, None)
    monkeypatch.setattr(chunk_split_gluon, "runs_on", lambda device: True)  # as on sm_90
    monkeypatch.setattr(launch, "smem_limit", lambda device: SMEM)
    cpu = torch.device("cpu")
    if chunk_streamed_gluon.gluon is not None:
        assert launch.resolve_config("chunk", None, p, cpu).loop == "gluon"
    sized = launch.resolve_config("chunk", None, p, cpu, chunk_size=32)
    assert (sized.form, sized.loop, sized.chunk_size) == ("streamed", "triton", 32)


def test_gluon_figures_keep_the_state_on_chip():
    """The cost model's figures: the Gluon kernel's state crosses HBM once each way a call, the
    Triton kernel's three times a chunk (twice with merged passes)."""
    from rtcompile.kernels.config import Workload

    w = Workload(KernelShape((32, 32), 64, 2), batch=8, heads=8, seq_len=4096)
    triton_kernel = dataclasses.replace(gluon(32, 8, 256), loop="triton")
    assert gluon(32, 8, 256).figures(w).state_passes == 2
    assert triton_kernel.figures(w).state_passes == 3 * 64


@pytest.mark.parametrize("widths, measured_ms, prefetch", [((32, 32), 0.7344, False), ((32, 16), 0.5725, True)],
                         ids=["o3-32x32", "o3-32x16"])
def test_gluon_cost_follows_its_measurements(widths, measured_ms, prefetch):
    """The cost model's Gluon step (costmodel.CHIP_*): its kernel time within 5% of the H100's
    CUDA-graph times of the defaults it was fitted to (bb1a5ee), and under the Triton kernel's
    (1.2052 / 0.8421 ms at 5a2e90b); the tile-visit step before put the two kernels at the same
    1.76 / 1.15 ms."""
    from rtcompile.costmodel import chunk_cost
    from rtcompile.spec import ModelSpec
    from rtcompile.target import get_target

    spec = ModelSpec(order=3, key_widths=widths, value_width=64, heads=8, model_width=512, layers=1,
                     input_dtype="bfloat16")
    config = dataclasses.replace(gluon(32, 8, 256), prefetch_inputs=prefetch)
    cost = chunk_cost(spec, get_target("h100-sxm"), 8, 4096, config)
    kernel_ms = (cost.seconds - cost.host_s) * 1e3
    assert abs(kernel_ms / measured_ms - 1) < 0.05, kernel_ms
    triton_kernel = chunk_cost(spec, get_target("h100-sxm"), 8, 4096, dataclasses.replace(config, loop="triton",
                                                                                           prefetch_inputs=False))
    assert cost.seconds < 0.8 * triton_kernel.seconds


# SCORES_ON_CHIP (an experiment, off by default): P formed in the Gluon kernel from the factor
# tiles, the prepare kernel asked for Ai only
ON_CHIP = ["o3-16x16-bv32-w4", "o3-32x32-bv32-w8-prefetch"]


@on_hopper
@pytest.mark.parametrize("feat", ["plain", "gated-delta-l2-h0"])  # every switch off, then on (fewer compiles)
@pytest.mark.parametrize("form", ON_CHIP)
def test_scores_on_chip_match_reference(form, feat, poison, monkeypatch):
    monkeypatch.setattr(chunk_streamed_gluon, "SCORES_ON_CHIP", True)
    config, widths, T = GLUON[form]
    check_against_reference(config, 2, T, 3, widths, 64, torch.bfloat16, **FEATURES[feat])
    offsets = [0, 5, 6, 130, 197]
    check_against_reference(config, 1, offsets[-1], 2, widths, 64, torch.bfloat16, offsets=offsets, **FEATURES[feat])


@pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU")
def test_prepare_without_scores_writes_the_inverse_only(poison, monkeypatch):
    """``prepare_scores(scores=False)``: no P, the same Ai as with P (fresh inputs, a partial chunk,
    NaN-poisoned workspaces); without the delta rule nothing is left to prepare and nothing runs."""
    from rtcompile.kernels import chunk_prepare
    from rtcompile.kernels.inputs import check_inputs

    from test_kernels import case

    dev, _, _ = case(2, 45, 2, (4, 4), 8, torch.bfloat16)
    q, k, v, g, beta = dev
    p = check_inputs(q, k, v, g, beta, None, None, None)
    config = StreamedConfig(chunk_size=16, block_k=16, block_v=8, num_warps=4, prepare_warps=2)
    kw = dict(cu_seqlens=None, l2norm=True, block_k=16, outer=False, wy=False)
    both = chunk_prepare.prepare_scores(config, p, q, k, v, g, beta, **kw)
    inverse = chunk_prepare.prepare_scores(config, p, q, k, v, g, beta, scores=False, **kw)
    assert both["P"] is not None and torch.isfinite(both["P"]).all() and inverse["P"] is None
    assert torch.isfinite(inverse["Ai"]).all() and torch.equal(inverse["Ai"], both["Ai"])
    runs = []
    monkeypatch.setattr(chunk_prepare, "_run", lambda *a, **k: runs.append(a))
    p = check_inputs(q, k, v, g, None, None, None, None)
    assert chunk_prepare.prepare_scores(config, p, q, k, v, g, None, scores=False, **kw) == \
        {"P": None, "Ai": None, "W": None, "U0": None}
    assert runs == []


def test_scores_on_chip_drop_p_from_the_workspace_and_the_prepare_launch(monkeypatch):
    """With SCORES_ON_CHIP the Gluon config's workspace loses P ([B, H, T, C] fp32) where both
    widths are >= 16 (mma_v2's K), and its call one launch without the delta rule."""
    from rtcompile.kernels.config import Workload

    w = Workload(KernelShape((32, 32), 64, 2), batch=8, heads=8, seq_len=4096)
    plain = dataclasses.replace(w, delta_rule=False)
    narrow = Workload(KernelShape((16, 8), 64, 2), batch=8, heads=8, seq_len=4096)
    cfg = gluon(32, 8, 256)
    before = [cfg.workspace_bytes(x) for x in (w, plain, narrow)]
    assert [cfg.figures(x).launches for x in (w, plain)] == [2, 2]
    monkeypatch.setattr(chunk_streamed_gluon, "SCORES_ON_CHIP", True)
    after = [cfg.workspace_bytes(x) for x in (w, plain, narrow)]
    assert [b - a for b, a in zip(before, after)] == [w.rows * 64 * 4, w.rows * 64 * 4, 0]
    assert [cfg.figures(x).launches for x in (w, plain)] == [2, 1]
    assert dataclasses.replace(cfg, loop="triton").workspace_bytes(w) == before[0]
