"""Modules built from a spec: parameter count, prefill == token-by-token steps, backends agree."""

from __future__ import annotations

import pytest
import torch

from rtcompile.figures import parameters_per_layer
from rtcompile.model import RunningTensorLayer, RunningTensorLM
from rtcompile.spec import Features, ModelSpec

CASES = {
    "o2-dense": ((6,), Features(query_skip=False)),
    "o3-dense-skip": ((3, 4), Features(query_skip=True)),
    "o3-conconlyc": ((2, 4), Features(projection="conconlyc", short_conv=3, query_skip=True)),
    "o4-plain": ((2, 3, 2), Features(forget_gate=False, delta_rule=False, l2norm=False, short_conv=0, output_gate=False)),
}


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


def test_triton_backend_matches_reference():
    torch.manual_seed(1)
    spec = _spec((2, 4), Features(query_skip=True))
    lm = RunningTensorLM(spec, vocab_size=9)
    tokens = torch.randint(0, 9, (1, 20))
    with torch.no_grad():
        ref, _ = lm(tokens, backend="reference")
        tri, _ = lm(tokens, backend="triton")
    assert float((tri - ref).abs().max() / ref.abs().max()) < 1e-4


def test_bad_vocab():
    with pytest.raises(ValueError, match="vocab_size"):
        RunningTensorLM(_spec((2, 4), Features()), vocab_size=1)
