"""``kernels/launch_cache.py``: a repeated launch goes through the compiled kernel's launcher
only when everything Triton specialises on is the same as at the launch that compiled it; on a
GPU the chunk forms give the same results through it as through Triton's launch."""

from __future__ import annotations

import dataclasses
import os
import pytest
import torch

from rtcompile.kernels import launch_cache
from rtcompile.kernels.launch_cache import _spec, cached

GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


class _Kernel:
    """Stands in for a JITFunction: ``[grid](*args, **kw)`` records the call and returns a
    compiled kernel whose ``[grid]`` launcher records its own calls."""

    arg_names = ["x", "n", "scale", "maybe", "BLOCK"]

    def __init__(self):
        self.triton_calls, self.runner_calls = [], []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.triton_calls.append((grid, args, kw))
            return _Compiled(self.runner_calls)
        return launch


class _Compiled:
    """Stands in for a CompiledKernel: ``[grid](*args)`` records a launch by its launcher."""

    function = 1

    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args: self.calls.append((grid, args))


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(launch_cache, "interpreting", lambda: False)
    launch_cache.clear()
    yield _Kernel()
    launch_cache.clear()


def test_a_repeated_launch_skips_triton_and_passes_the_constexprs_in_order(kernel):
    x = torch.zeros(8)
    cached(kernel)[(3, 2)](x, 5, 0.5, None, BLOCK=16, num_warps=4)
    cached(kernel)[(3, 2)](x + 1, 5, 0.25, None, BLOCK=16, num_warps=4)
    assert len(kernel.triton_calls) == 1 and len(kernel.runner_calls) == 1
    grid, args = kernel.runner_calls[0]
    assert grid == (3, 2, 1) and args[1:] == (5, 0.25, None, 16)  # the constexpr after the runtime values


@pytest.mark.parametrize("change", ["grid", "constexpr", "option", "none-input", "dtype", "alignment", "int-one",
                                    "int-divisibility", "int-width", "bool"])
def test_anything_triton_specialises_on_makes_a_new_launch(kernel, change):
    x = torch.zeros(64)
    base = dict(grid=(3,), args=(x, 17, 0.5, True), kw=dict(BLOCK=16, num_warps=4))
    other = {
        "grid": dict(base, grid=(4,)),
        "constexpr": dict(base, kw=dict(BLOCK=32, num_warps=4)),
        "option": dict(base, kw=dict(BLOCK=16, num_warps=8)),
        "none-input": dict(base, args=(None, 17, 0.5, True)),
        "dtype": dict(base, args=(x.double(), 17, 0.5, True)),
        "alignment": dict(base, args=(x[1:], 17, 0.5, True)),  # 4 bytes past a 16-byte boundary
        "int-one": dict(base, args=(x, 1, 0.5, True)),
        "int-divisibility": dict(base, args=(x, 32, 0.5, True)),
        "int-width": dict(base, args=(x, 2**32 + 17, 0.5, True)),
        "bool": dict(base, args=(x, 17, 0.5, False)),
    }[change]
    for call in (base, other, other):
        cached(kernel)[call["grid"]](*call["args"], **call["kw"])
    assert len(kernel.triton_calls) == 2 and len(kernel.runner_calls) == 1


def test_unknown_arguments_and_the_interpreter_go_to_triton(kernel, monkeypatch):
    for _ in range(2):
        cached(kernel)[(1,)](torch.zeros(4), 2, 0.5, [1, 2], BLOCK=16)  # a list: no key
    assert len(kernel.triton_calls) == 2 and not kernel.runner_calls
    monkeypatch.setattr(launch_cache, "interpreting", lambda: True)
    for _ in range(2):
        cached(kernel)[(1,)](torch.zeros(4), 2, 0.5, None, BLOCK=16)
    assert len(kernel.triton_calls) == 4 and not kernel.runner_calls


def test_a_kernel_missing_a_constexpr_is_never_remembered(kernel):
    for _ in range(2):
        cached(kernel)[(1,)](torch.zeros(4), 2, 0.5, None)  # BLOCK left to a default
    assert len(kernel.triton_calls) == 2 and not kernel.runner_calls


def test_keys_of_descriptors_hold_their_tensor_and_tile():
    from triton.tools.tensor_descriptor import TensorDescriptor

    x = torch.zeros(64, 32, dtype=torch.bfloat16)
    d = TensorDescriptor(x, [64, 32], [32, 1], [16, 32])
    assert _spec(d)[:6] == ("d", _spec(x), (16, 32), (64, 32), (32, 1), getattr(d, "padding", None))
    assert _spec(TensorDescriptor(x, [64, 32], [32, 1], [32, 32])) != _spec(d)


def test_keys_of_gluon_descriptors_hold_their_layout():
    gluon = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl

    x = torch.zeros(64, 64, dtype=torch.bfloat16)
    layouts = [gl.NVMMASharedLayout(swizzle_byte_width=w, element_bitwidth=16, rank=2) for w in (128, 64)]
    a, b = (gluon.TensorDescriptor(x, [64, 64], [64, 1], [32, 64], lay) for lay in layouts)
    assert _spec(a) == _spec(gluon.TensorDescriptor(x, [64, 64], [64, 1], [32, 64], layouts[0]))
    assert _spec(a) != _spec(b)


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (the interpreter never caches)")
@pytest.mark.parametrize("form", ["split", "split-gluon", "resident", "streamed"])
def test_chunk_forms_give_triton_launch_results_through_the_cache(form):
    """Three calls of one config on fresh inputs of one shape (the second and third through the
    cache, the third from views 2 elements into their buffers: unaligned, a new compile), each
    equal to the same call with the cache emptied first (Triton's own launch)."""
    from rtcompile.kernels.chunk_resident import ResidentConfig
    from rtcompile.kernels.chunk_split import SplitConfig
    from rtcompile.kernels.chunk_streamed import StreamedConfig
    from rtcompile.kernels.launch import running_tensor_fwd

    from rtcompile.kernels import chunk_split_gluon

    if form == "split-gluon" and not chunk_split_gluon.runs_here():
        pytest.skip("the Gluon loop runs on sm_90 GPUs only")
    config = {"split": SplitConfig(64, 32, tma=True, key_group=2, state_stride=2, pipeline=2),
              "split-gluon": SplitConfig(32, 64, loop="gluon", state_stride=2, pipeline=2),
              "resident": ResidentConfig(32, 16, prefetch_inputs=True, wy=True),
              "streamed": StreamedConfig(64, 128, 32, num_warps=8, merge_passes=True)}[form]
    widths = (16, 16)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for offset in (0, 0, 2):
        r = lambda *s: torch.randn(*s[:-1], s[-1] + offset, device="cuda", generator=gen,  # noqa: E731
                                   dtype=torch.bfloat16)[..., offset:]
        q, k = [r(2, 700, 4, w) for w in widths], [r(2, 700, 4, w) for w in widths]
        v = r(2, 700, 4, 64)
        g = -torch.rand(2, 700, 4, device="cuda", generator=gen) * 0.1
        beta = torch.rand(2, 700, 4, device="cuda", generator=gen).to(torch.bfloat16)
        call = lambda: running_tensor_fwd(q, k, v, g, beta, l2norm=True, output_final_state=True,  # noqa: E731
                                          variant=config)
        o, s = call()
        launch_cache.clear()
        o_triton, s_triton = call()
        assert torch.equal(o, o_triton) and torch.equal(s, s_triton)
