"""torch's C++ launcher for the T = 1 calls' compiled kernel (``kernels/static_launch.py``): the
arguments it is given for a compiled kernel's signature, what it refuses (then Triton launches),
and on a GPU that the decode step runs through it with Triton's launcher's results."""

from __future__ import annotations

import types

import pytest
import torch

from rtcompile.kernels import static_launch


class _Recorder:
    """Stands in for ``torch._C._StaticCudaLauncher``: records each launch."""

    calls: list = []

    @classmethod
    def _launch_kernel(cls, *a):
        cls.calls.append(a)


def _compiled(signature, constants=None, **metadata):
    names = list(signature)
    md = dict(num_warps=4, shared=1024, num_ctas=1, launch_cooperative_grid=False, launch_pdl=False,
              global_scratch_size=0, profile_scratch_size=0)
    md.update(metadata)
    src = types.SimpleNamespace(fn=types.SimpleNamespace(arg_names=names), signature=signature,
                                constants=constants or {})
    return types.SimpleNamespace(src=src, metadata=types.SimpleNamespace(**md), function=1234)


SIGNATURE = {"x": "*bf16", "y": "*fp32", "absent": "constexpr", "scale": "fp32", "T": "constexpr", "n": "i32",
             "H": "constexpr"}


@pytest.fixture
def recorder(monkeypatch):
    monkeypatch.setattr(torch._C, "_StaticCudaLauncher", _Recorder, raising=False)
    monkeypatch.setattr(static_launch, "_hooks_installed", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    _Recorder.calls = []
    return _Recorder.calls


def test_the_runtime_parameters_in_order_then_null_scratch(recorder):
    """Constexpr parameters (None inputs, specialised integers, declared constexprs) are
    dropped; pointers pass as "O", fp32 as "f", i32 as "i"; two null scratch pointers follow."""
    launch = static_launch.static_launcher(_compiled(SIGNATURE), (3, 5), n_values=6, device=0)
    assert launch is not None and launch.types == "OOfiOO"
    launch((100, 200, None, 0.5, 1, 9))
    assert recorder == [(1234, 3, 5, 1, 4, 1024, "OOfiOO", (100, 200, 0.5, 9, None, None), 77)]


def test_a_constant_named_by_index_is_dropped(recorder):
    sig = dict(SIGNATURE, n="i32")
    launch = static_launch.static_launcher(_compiled(sig, constants={(5,): 16}), (1,), n_values=6, device=0)
    assert launch.types == "OOfOO" and launch.keep == (0, 1, 3)


@pytest.mark.parametrize("change", [
    dict(global_scratch_size=256), dict(profile_scratch_size=64), dict(num_ctas=2), dict(launch_pdl=True),
    dict(launch_cooperative_grid=True), dict(cluster_dims=(2, 1, 1)),
], ids=["global-scratch", "profile-scratch", "ctas", "pdl", "cooperative", "cluster"])
def test_what_it_cannot_launch_is_left_to_triton(recorder, change):
    assert static_launch.static_launcher(_compiled(SIGNATURE, **change), (1,), n_values=6, device=0) is None


@pytest.mark.parametrize("ty", ["fp16", "bf16", "nvTmaDesc"])
def test_a_scalar_type_it_cannot_pass_is_left_to_triton(recorder, ty):
    sig = dict(SIGNATURE, scale=ty)
    assert static_launch.static_launcher(_compiled(sig), (1,), n_values=6, device=0) is None


def test_a_runtime_parameter_past_the_values_is_left_to_triton(recorder):
    assert static_launch.static_launcher(_compiled(SIGNATURE), (1,), n_values=5, device=0) is None


def test_launch_hooks_or_no_launcher_leave_it_to_triton(recorder, monkeypatch):
    monkeypatch.setattr(static_launch, "_hooks_installed", lambda: True)
    assert static_launch.static_launcher(_compiled(SIGNATURE), (1,), n_values=6, device=0) is None
    monkeypatch.setattr(static_launch, "_hooks_installed", lambda: False)
    monkeypatch.delattr(torch._C, "_StaticCudaLauncher")
    assert static_launch.static_launcher(_compiled(SIGNATURE), (1,), n_values=6, device=0) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="launches on a CUDA GPU")
@pytest.mark.parametrize("feat", ["gated-delta-l2", "plain"])
def test_decode_through_torchs_launcher_equals_tritons(feat):
    """Three decode steps on a slot cache through torch's launcher (where this torch has it)
    give bit-identical outputs and states to the same steps through Triton's launcher."""
    from rtcompile import running_tensor_decode_
    from rtcompile.kernels.decode_plan import DECODE_PLANS

    gen = torch.Generator(device="cuda").manual_seed(1)
    N, H, widths, V = 3, 2, (4, 8), 16
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    gated = feat != "plain"
    steps = [([r(N, 1, H, w) for w in widths], [r(N, 1, H, w) for w in widths], r(N, 1, H, V),
              -torch.rand(N, 1, H, device="cuda", generator=gen) if gated else None,
              torch.rand(N, 1, H, device="cuda", generator=gen) if gated else None) for _ in range(3)]
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    start = r(6, H, *widths, V)
    DECODE_PLANS.clear()
    outs = {}
    for launcher in ("torch", "triton"):
        cache, os_ = start.clone(), []
        for q, k, v, g, beta in steps:
            if launcher == "triton":
                for plan in DECODE_PLANS.values():
                    plan._static = None
            os_.append(running_tensor_decode_(q, k, v, g, beta, state_cache=cache, state_indices=idx,
                                              l2norm=gated, validate=False))
        outs[launcher] = (os_, cache)
        if launcher == "torch" and hasattr(torch._C, "_StaticCudaLauncher"):
            assert all(p._static is not None for p in DECODE_PLANS.values())
    for a, b in zip(outs["torch"][0], outs["triton"][0]):
        assert torch.equal(a, b)
    assert torch.equal(outs["torch"][1], outs["triton"][1])
    DECODE_PLANS.clear()
