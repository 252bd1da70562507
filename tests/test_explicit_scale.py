"""An explicit, non-default ``scale`` (0.37, not prod(d_i) ** -0.5) reaches every Triton path:
the chunk forms, the recurrent scan and the decode step, each against the float64 recurrent
reference with the same scale, on fresh inputs, every output and workspace poisoned."""

from __future__ import annotations

import math
import os

import pytest
import torch

from rtcompile import running_tensor, running_tensor_decode_
from rtcompile.kernels import running_tensor_recurrent_ref
from rtcompile.kernels.chunk_resident import ResidentConfig
from rtcompile.kernels.chunk_split import SplitConfig
from rtcompile.kernels.chunk_streamed import StreamedConfig

from conftest import make_inputs, rel_err

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU",
)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
SCALE = 0.37
TOL = 2e-5  # fp32 kernels against float64 (tests/test_kernels.py's bound)


@pytest.fixture(autouse=True)
def poison_outputs(poison):
    """Every output and workspace the launchers allocate starts as NaN (conftest's ``poison``)."""


def _case(widths, T, B=2, H=2, V=6):
    q, k, v, g, beta, s0 = make_inputs(B, T, H, widths, V, state=True)
    assert abs(SCALE - math.prod(widths) ** -0.5) > 0.05  # not the default: a dropped scale shows
    dev = lambda x: x.float().to(DEVICE)  # noqa: E731
    f32 = ([dev(x) for x in q], [dev(x) for x in k], dev(v), dev(g), dev(beta))
    up = lambda x: x.float().double()  # noqa: E731  (the reference sees the fp32-rounded inputs)
    f64 = ([up(x) for x in q], [up(x) for x in k], up(v), up(g), up(beta))
    return f32, f64, s0.float()


@pytest.mark.parametrize("mode, variant, widths", [
    ("chunk", ResidentConfig(16, 16), (3, 4)),
    ("chunk", SplitConfig(16, 16, state_stride=2), (16,)),
    ("chunk", StreamedConfig(16, 16, 16), (2, 4, 4)),
    ("recurrent", None, (3, 4)),
], ids=["chunk-resident-o3-3x4", "chunk-split-o2-16", "chunk-streamed-o4-2x4x4", "recurrent-o3-3x4"])
def test_explicit_scale(mode, variant, widths):
    f32, f64, s0 = _case(widths, 37)
    o, s = running_tensor(*f32, scale=SCALE, initial_state=s0.to(DEVICE), output_final_state=True, l2norm=True,
                          mode=mode, backend="triton", variant=variant)
    o_ref, s_ref = running_tensor_recurrent_ref(*f64, scale=SCALE, initial_state=s0.double(), output_final_state=True,
                                                l2norm=True)
    assert rel_err(o.cpu(), o_ref) < TOL, rel_err(o.cpu(), o_ref)
    assert rel_err(s.cpu(), s_ref) < TOL, rel_err(s.cpu(), s_ref)


@pytest.mark.parametrize("widths", [(5,), (3, 4), (2, 2, 3)], ids=["o2-5", "o3-3x4", "o4-2x2x3"])
def test_decode_step_explicit_scale(widths):
    """Three sequences in slots 2, 0 and 3 of a four-slot cache: their outputs and new states."""
    f32, f64, s0 = _case(widths, 1, B=3)
    idx = [2, 0, 3]
    cache = torch.randn(4, *s0.shape[1:]).float()
    cache[idx] = s0
    before = cache.clone()
    cache = cache.to(DEVICE)
    o = running_tensor_decode_(*f32, state_cache=cache, state_indices=torch.tensor(idx, dtype=torch.int32,
                                                                                   device=DEVICE),
                               scale=SCALE, l2norm=True)
    o_ref, s_ref = running_tensor_recurrent_ref(*f64, scale=SCALE, initial_state=s0.double(), output_final_state=True,
                                                l2norm=True)
    assert rel_err(o.cpu(), o_ref) < TOL, rel_err(o.cpu(), o_ref)
    assert rel_err(cache.cpu()[idx], s_ref) < TOL, rel_err(cache.cpu()[idx], s_ref)
    assert torch.equal(cache.cpu()[1], before[1])  # the slot no sequence names is untouched
