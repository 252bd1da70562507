"""The decode step in micro-batches (rtcompile.overlap.StagedStep through StaticStep(parts=...)):
each micro-batch's rows equal the whole step's, every layer's state and convolution tails are
updated in place in the caller's buffers, and bad ``parts`` are refused before any work. The
streams and the kernels' turns are CUDA-only (the GPU test at the end)."""

from __future__ import annotations

import os

import pytest
import torch

from rtcompile.generate import StaticStep
from rtcompile.model import RunningTensorLM
from rtcompile.spec import Features, ModelSpec

VOCAB = 19
CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
FEATURES = {
    "all": Features(query_skip=True),
    "no-gates-no-conv": Features(forget_gate=False, delta_rule=False, output_gate=False, short_conv=0),
    "conconlyc": Features(projection="conconlyc", short_conv=3, query_skip=True),
}


def _lm(features, layers=3, mlp=True, dtype=torch.float64, device="cpu", seed=0):
    torch.manual_seed(seed)
    spec = ModelSpec(order=3, key_widths=(3, 4), value_width=5, heads=2, model_width=12, layers=layers,
                     features=features)
    return RunningTensorLM(spec, vocab_size=VOCAB, mlp=mlp).to(device=device, dtype=dtype).eval()


def _run(lm, parts, prompt, steps, backend, bucket, **kw):
    """Logits of ``steps`` static steps (greedy) and the final static cache, from one prefill."""
    with torch.no_grad():
        logits, cache = lm(prompt, backend=backend)
        capture = kw.pop("capture", False)
        step = StaticStep(lm, bucket, backend, capture=CUDA and capture, parts=parts, **kw)
        step.load(cache, prompt.shape[0])
        states = [c["state"] for c in step.cache]
        tails = [list(c["conv"] or []) for c in step.cache]
        tok, seen = logits[:, -1].argmax(-1), []
        for _ in range(steps):
            got = step(tok).clone()
            seen.append(got)
            tok = got.argmax(-1)
    # in place: the static tensors are the ones the step wrote
    assert all(c["state"] is s for c, s in zip(step.cache, states))
    assert all(all(a is b for a, b in zip(c["conv"] or [], t)) for c, t in zip(step.cache, tails))
    return seen, step.cache


@pytest.mark.parametrize("parts", [2, 4], ids=lambda p: f"parts{p}")
@pytest.mark.parametrize("mlp", [True, False], ids=["mlp", "no-mlp"])
@pytest.mark.parametrize("features", list(FEATURES.values()), ids=list(FEATURES))
def test_micro_batches_give_the_whole_steps_logits_and_caches(features, mlp, parts):
    """float64 on the reference: B7 in bucket 8 (a padding row in the last part), five steps,
    three layers (the middle stage runs twice): logits, states and tails as the whole step's."""
    lm = _lm(features, mlp=mlp)
    prompt = torch.randint(0, VOCAB, (7, 5), generator=torch.Generator().manual_seed(parts))
    want, want_cache = _run(lm, 1, prompt, 5, "reference", 8)
    got, got_cache = _run(lm, parts, prompt, 5, "reference", 8)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"step {i}")
    for a, b in zip(got_cache, want_cache):
        torch.testing.assert_close(a["state"], b["state"], rtol=1e-12, atol=1e-12)
        for x, y in zip(a["conv"] or [], b["conv"] or []):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)  # products at another M round apart


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not CUDA,
                    reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU")
def test_micro_batches_through_the_decode_kernel_with_stacked_maps():
    """fp32 through the Triton decode kernel's in-place slot update on each part's row range
    (each part's slots start at 0 of its own view), stacked input maps: as the whole step."""
    device = "cuda" if CUDA else "cpu"
    lm = _lm(FEATURES["all"], layers=2, dtype=torch.float32, device=device, seed=4)
    prompt = torch.randint(0, VOCAB, (6, 4), generator=torch.Generator().manual_seed(4)).to(device)
    want, want_cache = _run(lm, 1, prompt, 3, "triton", 8, fuse_projections=True)
    got, got_cache = _run(lm, 2, prompt, 3, "triton", 8, fuse_projections=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_cache, want_cache):
        torch.testing.assert_close(a["state"], b["state"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("parts,error,match", [
    (3, ValueError, r"parts: got 3; allowed: a divisor of the bucket, 8"),
    (0, ValueError, r"parts: got 0"),
    (16, ValueError, r"parts: got 16"),
    (2.0, TypeError, r"parts: expected an int, got float"),
    (True, TypeError, r"parts: expected an int, got bool"),
], ids=["not-a-divisor", "zero", "more-than-rows", "float", "bool"])
def test_bad_parts_are_refused_before_any_allocation(parts, error, match, monkeypatch):
    lm = _lm(FEATURES["all"], layers=1)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: pytest.fail("allocated before the check"))
    with pytest.raises(error, match=match):
        StaticStep(lm, 8, "reference", capture=False, parts=parts)


def test_parts_refuse_a_model_whose_forward_is_its_own():
    """The stages call the layers' halves directly: a subclass's own forward (the bench's fla
    mixer) would be skipped, so more than one part is refused for it; one part runs its step."""
    from rtcompile.bench.lm import MixerLM

    torch.manual_seed(0)
    spec = ModelSpec(order=3, key_widths=(3, 4), value_width=5, heads=2, model_width=12, layers=1)
    lm = MixerLM(spec, vocab_size=VOCAB).double().eval()
    with pytest.raises(ValueError, match=r"parts: got 2 for a MixerLM, whose forward is its own; allowed: 1"):
        StaticStep(lm, 4, "reference", capture=False, parts=2)
    assert StaticStep(lm, 4, "reference", capture=False, parts=1)._staged is None


@pytest.mark.skipif(not CUDA, reason="CUDA graphs and streams")
@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled"])
def test_gpu_captured_micro_batches_on_streams_follow_the_whole_step(compiled, monkeypatch):
    """Captured with two parts (each part's stages on a stream of its own, every decode kernel on
    one more, ordered by stream waits), fp32, B13 in bucket 16: 12 steps' logits, the states and
    tails as the captured whole step's."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    lm = _lm(FEATURES["all"], layers=2, dtype=torch.float32, device="cuda", seed=9)
    prompt = torch.randint(0, VOCAB, (13, 8), generator=torch.Generator().manual_seed(9)).cuda()
    kw = {"compiled": compiled, "fuse_projections": compiled}
    want, want_cache = _run(lm, 1, prompt, 12, "auto", 16, capture=True, **kw)
    got, got_cache = _run(lm, 2, prompt, 12, "auto", 16, capture=True, **kw)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a[:13], b[:13], rtol=1e-4, atol=1e-4, msg=f"step {i}")
    for a, b in zip(got_cache, want_cache):
        torch.testing.assert_close(a["state"][:13], b["state"][:13], rtol=1e-4, atol=1e-5)
        for x, y in zip(a["conv"], b["conv"]):
            torch.testing.assert_close(x[:13], y[:13], rtol=1e-4, atol=1e-5)
