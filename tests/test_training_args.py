"""A training call's arguments that the forward and the backward read differently: an explicit
``chunk_size`` (the backward runs fewer chunk sizes than the forward) and a ``variant`` of the
wrong type; each is refused, naming its argument, before any kernel runs, or trains."""

from __future__ import annotations

import os

import pytest
import torch

import rtcompile
from rtcompile.kernels import running_tensor_recurrent_ref
from rtcompile.kernels.chunk_backward import BWD_CHUNK_SIZES, resolve_backward
from rtcompile.kernels.chunk_split import SplitConfig
from rtcompile.kernels.config import KernelShape

from conftest import make_inputs, rel_err

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU",
)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
C128 = SplitConfig(chunk_size=128, block_v=16, num_warps=2, num_stages=2, prepare_warps=1, solve="rows",
                   output_block_v=16, output_warps=2, wy=True)


def _leaves(T, widths=(16,), V=8, dtype=torch.float32):
    q, k, v, g, beta, h0 = make_inputs(1, T, 1, widths, V, state=True, seed=0)
    dev = lambda x, dt=dtype: x.to(DEVICE, dt).requires_grad_()  # noqa: E731
    return [dev(x) for x in q], [dev(x) for x in k], dev(v), dev(g, torch.float32), dev(beta), dev(h0, torch.float32)


def test_a_chunk_size_the_backward_cannot_run_trains():
    """chunk_size=128 (the forward's largest, here a split config's with the row solve; the
    backward's are 16-64), backend='auto': the forward runs at 128,
    the backward at its own chunk length (which changes no gradient), and every gradient matches
    float64 autograd. The backward was handed 128 and refused it after the forward had run."""
    q, k, v, g, beta, h0 = leaves = _leaves(130)
    o, s = rtcompile.running_tensor(q, k, v, g, beta, initial_state=h0, output_final_state=True, mode="chunk",
                                    chunk_size=128, variant=C128)
    grads = torch.autograd.grad(o.sum() + s.sum(), [*q, *k, v, g, beta, h0])
    ref = [x.detach().cpu().double().requires_grad_() for x in (*q, *k, v, g, beta, h0)]
    ro, rs = running_tensor_recurrent_ref(ref[:1], ref[1:2], *ref[2:5], initial_state=ref[5], output_final_state=True)
    want = torch.autograd.grad(ro.sum() + rs.sum(), ref)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], grads, want):
        assert rel_err(a.cpu(), b) < 1e-4, (name, rel_err(a.cpu(), b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_chunk_size_no_form_runs_is_refused_naming_it(dtype):
    """chunk_size=24 with grad is refused as without grad (naming chunk_size and the allowed
    sizes), not as a 'variant: BackwardConfig(chunk_size=24 ...)' the caller never passed."""
    q, k, v, g, beta, h0 = _leaves(20, dtype=dtype)
    messages = []
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError) as err:
            rtcompile.running_tensor(q, k, v, g, beta, mode="chunk", chunk_size=24)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and messages[1].startswith("chunk_size: 24"), messages
    assert "variant" not in messages[1], messages[1]


def test_resolve_backward_chunk_sizes():
    """The backward's own resolution: a chunk size the forward takes but the backward does not
    gives way to its own choice; one no form takes is a ValueError naming chunk_size."""
    shape, cpu = KernelShape((16,), 8), torch.device("cpu")
    assert resolve_backward(shape, None, 128, cpu).chunk_size in BWD_CHUNK_SIZES
    assert resolve_backward(shape, None, 16, cpu).chunk_size == 16
    with pytest.raises(ValueError, match=r"^chunk_size: 24 .*allowed: 16, 32, 64"):
        resolve_backward(shape, None, 24, cpu)


@pytest.mark.parametrize("variant", [{"form": "resident", "chunk_size": 16, "block_v": 16}, "resident",
                                     "backward-config"], ids=["dict", "str", "backward-config"])
def test_a_variant_of_the_wrong_type_is_a_type_error_with_grad(variant):
    """With grad as without: TypeError naming variant and the allowed classes (with grad, a dict
    was an AttributeError from the op's JSON encoding, before any check)."""
    from rtcompile.kernels.chunk_backward import BackwardConfig

    if variant == "backward-config":  # a config of another kernel: the backward's is not a forward variant
        variant = BackwardConfig(chunk_size=16, block_v=16)
    q, k, v, g, beta, h0 = _leaves(20)
    messages = []
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(TypeError) as err:
            rtcompile.running_tensor(q, k, v, g, beta, mode="chunk", variant=variant)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and messages[1].startswith("variant: expected one of ResidentConfig"), messages
