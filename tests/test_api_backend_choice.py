"""``running_tensor``'s choices for the caller: the mode a variant implies, the backend an fp64
initial state needs, and a chunk size the Triton kernels cannot run named as chunk_size."""

from __future__ import annotations

import os

import pytest
import torch

import rtcompile
from rtcompile.kernels.chunk_resident import ResidentConfig
from rtcompile.kernels.reference import running_tensor_recurrent_ref

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TRITON = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not TRITON, reason="the Triton backend: a GPU or TRITON_INTERPRET=1")


def _inputs(T: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    q = [r(1, T, 1, w) for w in (2, 4)]
    k = [r(1, T, 1, w) for w in (2, 4)]
    v = r(1, T, 1, 16)
    g = -torch.rand(1, T, 1, generator=gen).to(DEVICE)
    beta = torch.rand(1, T, 1, generator=gen).to(DEVICE)
    return q, k, v, g, beta


@needs_triton
@pytest.mark.parametrize("T", [20, 64], ids=["T20", "T64"])
def test_auto_with_a_chunk_variant_runs_that_variant(T):
    """Before: at T = 20 "auto" chose the recurrent form by length and refused the chunk config
    (TypeError: expected one of RecurrentConfig); at T = 64 it ran."""
    q, k, v, g, beta = _inputs(T)
    o, s = rtcompile.running_tensor(q, k, v, g, beta, mode="auto", variant=ResidentConfig(chunk_size=16, block_v=16),
                                    output_final_state=True, backend="triton")
    d = lambda xs: [x.double() for x in xs]  # noqa: E731
    o_ref, s_ref = running_tensor_recurrent_ref(d(q), d(k), v.double(), g.double(), beta.double(),
                                                output_final_state=True)
    assert (o.double() - o_ref).abs().max() < 1e-4 and (s.double() - s_ref).abs().max() < 1e-4


@needs_triton
def test_auto_takes_the_reference_for_a_float64_initial_state():
    """Before: fp32 inputs with an fp64 initial state went to Triton, which refused the state's
    dtype; the reference takes it, as the docstring's "auto" promises."""
    q, k, v, g, beta = _inputs(5)
    h0 = torch.randn(1, 1, 2, 4, 16, dtype=torch.float64, device=DEVICE)
    o, _ = rtcompile.running_tensor(q, k, v, g, beta, initial_state=h0)
    want, _ = rtcompile.running_tensor(q, k, v, g, beta, initial_state=h0, backend="reference")
    assert torch.equal(o, want)


@needs_triton
def test_a_chunk_size_the_kernels_cannot_run_is_named_as_chunk_size():
    """Before: "variant: ResidentConfig(chunk_size=8, ...) cannot run ..." for a call that gave
    no variant. Now the argument given, and the sizes that do run."""
    q, k, v, g, beta = _inputs(40)
    with pytest.raises(ValueError, match=r"^chunk_size: 8 cannot run K=8, d_v=16 on the Triton backend; "
                                         r"allowed: 16, .*backend='reference'"):
        rtcompile.running_tensor(q, k, v, g, beta, mode="chunk", chunk_size=8, backend="triton")


@needs_triton
@pytest.mark.parametrize("call", ["running_tensor", "running_tensor_decode_"])
def test_stacked_factors_are_refused_after_a_cached_call_too(call):
    """Before: once a call with a list of factors had a cached launch plan, the same factors
    stacked into one tensor unpacked into matching slices and ran; the full checks refuse them."""
    _, _, v, g, beta = _inputs(1)
    qs = [torch.randn(1, 1, 1, 4, device=DEVICE) for _ in range(2)]  # two factors of one width: stackable
    ks = [torch.randn(1, 1, 1, 4, device=DEVICE) for _ in range(2)]
    fn = getattr(rtcompile, call)
    kw = {} if call == "running_tensor" else dict(state_cache=torch.zeros(2, 1, 4, 4, 16, device=DEVICE),
                                                   state_indices=torch.tensor([0], device=DEVICE))
    fn(qs, ks, v, g, beta, **kw)  # the list form: a plan noted
    with pytest.raises(TypeError, match=r"q: expected a list or tuple"):
        fn(torch.stack(qs), torch.stack(ks), v, g, beta, **kw)


@needs_triton
def test_a_variant_of_the_wrong_type_is_still_a_type_error_naming_it():
    """mode="auto" reads the variant's form: a str or dict variant is refused as a variant, not
    an AttributeError."""
    q, k, v, g, beta = _inputs(5)
    for bad in ("x", {"form": "resident"}):
        with pytest.raises(TypeError, match=r"variant: expected one of"):
            rtcompile.running_tensor(q, k, v, g, beta, variant=bad, backend="triton")


def test_the_decode_step_names_q_that_is_not_a_list():
    """Its grad check comes after q and k are seen to be lists: None is refused naming q."""
    v = torch.randn(1, 1, 1, 3)
    with pytest.raises(TypeError, match=r"^q: expected a list or tuple"):
        rtcompile.running_tensor_decode_(None, [torch.randn(1, 1, 1, 2)], v, state_cache=torch.zeros(2, 1, 2, 3),
                                         state_indices=torch.tensor([0]))


@pytest.mark.parametrize("backend", ["triton", "reference", "auto"])
def test_chunk_size_with_the_recurrent_mode_is_refused(backend):
    """The scan has no chunks: a chunk_size beside mode="recurrent" was dropped unseen on every
    backend; it is refused, naming the field and what is allowed."""
    q, k, v, g, beta = _inputs(5)
    with pytest.raises(ValueError, match=r"chunk_size: got 16 with mode='recurrent'.*allowed: None"):
        rtcompile.running_tensor(q, k, v, g, beta, mode="recurrent", chunk_size=16, backend=backend)
    o, _ = rtcompile.running_tensor(q, k, v, g, beta, mode="recurrent", backend=backend)  # without it: runs
    assert o.shape == v.shape


def test_auto_choosing_the_scan_drops_the_chunk_size_in_the_op():
    """mode="auto" with a chunk size (a model's fixed one) and a sequence shorter than a chunk
    picks the scan inside the custom op (here: with grad); the scan has no chunks, so the size is
    dropped there, not refused (running_tensor_fwd refuses it beside an explicit recurrent mode)."""
    q, k, v, g, beta = _inputs(5)
    v = v.clone().requires_grad_(True)
    o, s = rtcompile.running_tensor(q, k, v, g, beta, chunk_size=64, backend="triton", output_final_state=True)
    o.sum().backward()
    ref, _ = rtcompile.running_tensor(q, k, v.detach(), g, beta, mode="recurrent", backend="reference")
    assert torch.allclose(o.detach(), ref, atol=1e-4) and v.grad is not None and s.shape[0] == v.shape[0]
