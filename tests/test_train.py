"""RunningTensorLM trains through the Triton kernels (interpreter on CPU): a few AdamW steps under
bf16 autocast with the Triton forward + backward track the reference's losses from the same
seed, the Triton backward really runs (counted), and the mixer state stays fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rtcompile.kernels import chunk_backward
from rtcompile.model import RunningTensorLM
from rtcompile.spec import Features, ModelSpec

VOCAB, STEPS, T = 16, 3, 20
# Losses of the two backends differ by ~5e-4 after 3 steps (measured on CPU: 2.8789 vs 2.8791,
# 2.9549 vs 2.9554, 2.8958 vs 2.8962): under bf16 autocast the two paths round differently.
# 5e-3 is 10x that and well below the 0.06-0.08 the loss moves from step to step.
LOSS_TOL = 5e-3


def _spec():
    return ModelSpec(order=3, key_widths=(16, 16), value_width=16, heads=1, model_width=32, layers=2,
                     features=Features(query_skip=True, short_conv=4, output_gate=True))


def _train(backend, seen_dtypes):
    torch.manual_seed(0)
    lm = RunningTensorLM(_spec(), vocab_size=VOCAB)
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    losses, states = [], []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (2, T + 1), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, cache = lm(tokens[:, :-1], backend=backend)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        states.append({c["state"].dtype for c in cache})
    return losses, states


def test_training_steps_on_triton_match_the_reference(monkeypatch):
    seen, calls = [], []
    real = chunk_backward.running_tensor_bwd

    def counting(q, k, v, *args, **kwargs):
        calls.append(1)
        seen.append(v.dtype)
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(chunk_backward, "running_tensor_bwd", counting)
    ref, ref_states = _train("reference", seen)
    assert not calls  # the reference never reaches the Triton backward
    tri, tri_states = _train("triton", seen)
    assert len(calls) == STEPS * _spec().layers, "the Triton backward did not run once per layer and step"
    assert set(seen) == {torch.bfloat16}  # autocast's bf16 activations reached the kernels
    assert all(s == {torch.float32} for s in tri_states + ref_states)  # fp32 state
    assert all(a == pytest.approx(b, abs=LOSS_TOL) for a, b in zip(tri, ref)), (tri, ref)
    assert ref[0] != ref[-1]  # the steps did move the model (a frozen model would agree trivially)
