"""Modules built from a spec: parameter count, prefill == token-by-token steps, backends agree."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from conftest import fresh_seed
from rtcompile.figures import parameters_per_layer
from rtcompile.model import RunningTensorLayer, RunningTensorLM
from rtcompile.spec import Features, ModelSpec

CASES = {
    "o2-dense": ((6,), Features(query_skip=False)),
    "o3-dense-skip": ((3, 4), Features(query_skip=True)),
    "o3-conconlyc": ((2, 4), Features(projection="conconlyc", short_conv=3, query_skip=True)),
    "o4-plain": ((2, 3, 2), Features(forget_gate=False, delta_rule=False, l2norm=False, short_conv=0, output_gate=False)),
}


# The Triton backend's tests run on the GPU where there is one (the interpreter on the CPU)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


@pytest.fixture
def exact_fp32(monkeypatch):
    """fp32 convolutions and products without TF32 on the GPU (its 1e-3 rounding would exceed the
    1e-4 bounds that compare a prefill's convolution with the step's weighted sum)."""
    if DEVICE == "cuda":  # (torch 2.13's CPU build has no allow_tf32 attributes)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def _spec(widths, features, layers=2):
    return ModelSpec(order=len(widths) + 1, key_widths=widths, value_width=5, heads=2, model_width=12,
                     layers=layers, features=features)


@pytest.mark.parametrize("case", CASES.keys())
def test_parameter_count_matches_figures(case):
    spec = _spec(*CASES[case])
    layer = RunningTensorLayer(spec)
    assert sum(p.numel() for p in layer.parameters()) == parameters_per_layer(spec)


@pytest.mark.parametrize("case", CASES.keys())
def test_prefill_equals_token_by_token_steps(case):
    torch.manual_seed(0)
    spec = _spec(*CASES[case])
    lm = RunningTensorLM(spec, vocab_size=17).double()
    tokens = torch.randint(0, 17, (2, 11))
    with torch.no_grad():
        logits, cache = lm(tokens, backend="reference")
        # prefill 4 tokens, then 7 single steps from the cache
        part, c = lm(tokens[:, :4], backend="reference")
        steps = [part]
        for t in range(4, 11):
            lg, c = lm.step(tokens[:, t], c, backend="reference")
            steps.append(lg[:, None])
    stepped = torch.cat(steps, dim=1)
    assert torch.allclose(stepped, logits, rtol=1e-9, atol=1e-10)
    for a, b in zip(cache, c):
        assert torch.allclose(a["state"], b["state"], rtol=1e-9, atol=1e-10)


def test_triton_backend_matches_reference(exact_fp32, poison):
    """The fp32 model on the Triton backend (its outputs and workspaces poisoned: conftest's
    ``poison``) against a float64 copy of it on the reference backend, fresh weights and tokens."""
    fresh_seed()  # the global generator seeded afresh (earlier tests seed it), listed if this fails
    spec = _spec((2, 4), Features(query_skip=True))
    lm = RunningTensorLM(spec, vocab_size=9).to(DEVICE)
    lm64 = copy.deepcopy(lm).double().cpu()
    tokens = torch.randint(0, 9, (1, 20)).to(DEVICE)
    with torch.no_grad():
        ref, _ = lm64(tokens.cpu(), backend="reference")
        tri, _ = lm(tokens, backend="triton")
    assert tri.dtype == torch.float32 and ref.dtype == torch.float64
    err = float((tri.cpu().double() - ref).abs().max() / ref.abs().max())
    assert err < 1e-5, err  # fp32 model against float64: observed 2e-7 - 8e-7 (4 seeds)


def test_bad_vocab():
    with pytest.raises(ValueError, match="vocab_size"):
        RunningTensorLM(_spec((2, 4), Features()), vocab_size=1)


def _stepped(lm, tokens, backend, plan=None):
    """Prefill 3 tokens, then step the rest; the logits of every step and the final cache."""
    lm.plan = plan
    with torch.no_grad():
        _, cache = lm(tokens[:, :3], backend=backend)
        out = []
        for t in range(3, tokens.shape[1]):
            lg, cache = lm.step(tokens[:, t], cache, backend=backend)
            out.append(lg)
    return torch.stack(out, 1), cache


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_step_updates_the_state_in_place_in_the_spec_dtype(backend, exact_fp32):
    torch.manual_seed(2)
    spec32 = _spec((2, 4), Features(query_skip=True), layers=1)
    spec16 = ModelSpec(**{**spec32.to_dict(), "state_dtype": "bfloat16", "features": spec32.features})
    lm = RunningTensorLM(spec32, vocab_size=9).to(DEVICE)
    tokens = torch.randint(0, 9, (2, 9)).to(DEVICE)
    with torch.no_grad():
        full, _ = lm(tokens, backend="reference")
    ref32, cache32 = _stepped(lm, tokens, backend)
    assert cache32[0]["state"].dtype == torch.float32
    assert float((ref32 - full[:, 3:]).abs().max() / full.abs().max()) < 1e-4
    lm16 = RunningTensorLM(spec16, vocab_size=9).to(DEVICE)
    lm16.load_state_dict(lm.state_dict())
    got16, cache16 = _stepped(lm16, tokens, backend)
    assert cache16[0]["state"].dtype == torch.bfloat16
    err = float((got16 - ref32).abs().max() / ref32.abs().max())
    assert 0 < err < 2e-2, err  # rounded (so not equal), within bf16's reach
    # the step writes into the cache it is given: same storage before and after
    state, tails = cache16[0]["state"], cache16[0]["conv"]
    with torch.no_grad():
        _, again = lm16.step(tokens[:, 0], cache16, backend=backend)
    assert again[0]["state"].data_ptr() == state.data_ptr()
    assert tails and [t.data_ptr() for t in again[0]["conv"]] == [t.data_ptr() for t in tails]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
def test_conv_step_in_place_equals_the_convolution(dtype):
    """The serving step's short convolution (a weighted sum, its tail shifted in place) gives the
    convolution's output and new tail, with a 5-channel, width-4 window at B3."""
    from rtcompile.model import _CausalDepthwise

    torch.manual_seed(3)
    conv = _CausalDepthwise(5, 4).to(dtype)
    x, tail = torch.randn(3, 1, 5, dtype=dtype), torch.randn(3, 3, 5, dtype=dtype)  # [B, w - 1, C]
    with torch.no_grad():
        want, want_tail = conv(x, conv.weight, tail.clone())
        kept = tail.clone()
        got, got_tail = conv(x, conv.weight, kept, in_place=True)
    assert got_tail is kept and got.shape == want.shape == (3, 1, 5)
    torch.testing.assert_close(got_tail, want_tail, rtol=0, atol=0)
    tol = 1e-12 if dtype == torch.float64 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_auto_state_dtype_follows_the_plan():
    import dataclasses

    from rtcompile.plan import make_plan
    from rtcompile.target import get_target

    big = ModelSpec(order=3, key_widths=(16, 16), value_width=64, heads=8, model_width=512, state_dtype="auto")
    plan = make_plan(big, get_target("h200"), batches=(1,), seq_lens=(16,), decode_batches=(256,))
    (d,) = [d for d in plan.decisions if d.phase == "decode"]
    assert d.state_dtype == "bfloat16" and "bf16 cache" in d.reason  # memory-bound: half the bytes
    tiny = ModelSpec(order=3, key_widths=(2, 4), value_width=5, heads=2, model_width=12, state_dtype="auto")
    plan = make_plan(tiny, get_target("h200"), batches=(1,), seq_lens=(16,), decode_batches=(2,))
    (d,) = [d for d in plan.decisions if d.phase == "decode"]
    assert d.state_dtype == "float32" and "fp32 kept" in d.reason  # latency-bound: nothing to gain
    torch.manual_seed(3)
    lm = RunningTensorLM(tiny, vocab_size=9).to(DEVICE)
    tokens = torch.randint(0, 9, (2, 5)).to(DEVICE)
    _, cache = _stepped(lm, tokens, "triton", plan=plan)
    assert cache[0]["state"].dtype == torch.float32
    bf16 = dataclasses.replace(plan, decisions=[dataclasses.replace(x, state_dtype="bfloat16") if x.phase == "decode"
                                                else x for x in plan.decisions])
    _, cache = _stepped(lm, tokens, "triton", plan=bf16)
    assert cache[0]["state"].dtype == torch.bfloat16


# key widths [65536, 65536]: K = 2**32, so one head's fp32 state with d_v = 1 is 16 GiB.
HUGE_KEYS = ModelSpec(order=3, key_widths=(65536, 65536), value_width=1, heads=1, model_width=8, layers=1)


@pytest.fixture
def eight_gib(monkeypatch):
    """A machine with 8 GiB of memory, whatever this one has (the refusals compare against it)."""
    import rtcompile.model

    monkeypatch.setattr(rtcompile.model, "device_memory_bytes", lambda device: 8 << 30)


def test_parameter_count_is_exact():
    from rtcompile.model import parameter_count

    for mlp in (True, False):
        for tie in (False, True):
            lm = RunningTensorLM(HUGE_KEYS, vocab_size=11, mlp=mlp, tie_embeddings=tie)
            assert parameter_count(HUGE_KEYS, 11, mlp, tie) == sum(p.numel() for p in lm.parameters())  # unique
            assert (lm.head.weight is lm.embed.weight) == tie
    with pytest.raises(TypeError, match="tie_embeddings: expected a bool"):
        RunningTensorLM(HUGE_KEYS, vocab_size=11, tie_embeddings="yes")


def test_huge_key_widths_refused_before_allocating(eight_gib):
    # The forward allocated the [B, H, 65536, 65536, 1] state and died in the allocator.
    lm = RunningTensorLM(HUGE_KEYS, vocab_size=11)  # its parameters are small: allowed
    with pytest.raises(ValueError, match=r"state of 1 sequences: 17179869184 bytes needed .*8589934592 bytes"):
        lm(torch.zeros(1, 3, dtype=torch.long), backend="reference")
    wide = HUGE_KEYS.replace(heads=32, model_width=4096)  # 2**35 projection weights
    with pytest.raises(ValueError, match=r"parameters: \d+ bytes needed"):
        RunningTensorLM(wide)


@pytest.mark.parametrize("chunk_size", ["auto", 16, 32], ids=lambda c: f"C-{c}")
def test_a_spec_fixed_chunk_size_is_what_a_plan_less_model_runs(chunk_size, monkeypatch):
    """A spec's chunk_size was honoured by the plan and the ONNX graph only: the model without a
    plan ran the tuned table's or the default's chunk size."""
    import rtcompile.kernels.launch as launch

    seen, real = [], launch.fwd_checked

    def spy(*args, **kwargs):
        seen.append(kwargs.get("chunk_size"))
        return real(*args, **kwargs)

    monkeypatch.setattr(launch, "fwd_checked", spy)
    spec = ModelSpec(order=2, key_widths=(16,), value_width=16, heads=2, model_width=32, layers=1,
                     chunk_size=chunk_size)
    from conftest import DEVICE

    lm = RunningTensorLM(spec, vocab_size=64).to(DEVICE).eval()
    tokens = torch.randint(0, 64, (1, 40), device=DEVICE)
    with torch.no_grad():
        got, _ = lm(tokens, backend="triton")
        ref, _ = lm(tokens, backend="reference")
    assert seen == [None if chunk_size == "auto" else chunk_size]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
