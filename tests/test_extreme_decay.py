"""Extreme and infinite log decays (issue 20): a gate that closes completely (g = -inf: forget
everything before this token) or a huge one (-1e10, -1e30) is legitimate input. Chunk mode, in
every Triton form and in the float64 chunk reference, must then give what the recurrent mode
and the float64 token loop give: before the floor (``inputs.LOG_DECAY_FLOOR``) one -inf made
every output NaN and -1e10 gave an error of 0.17 on outputs of 0.10.

Through the Triton interpreter on the CPU (fp32) or on a CUDA GPU (fp32 and bf16)."""

from __future__ import annotations

import os

import pytest
import torch

from rtcompile import running_tensor
from rtcompile.kernels import running_tensor_chunk_ref, running_tensor_recurrent_ref
from rtcompile.kernels.chunk_fused import FusedConfig
from rtcompile.kernels.chunk_resident import ResidentConfig
from rtcompile.kernels.chunk_split import SplitConfig
from rtcompile.kernels.chunk_streamed import StreamedConfig

from conftest import HALF_TOL, make_inputs, rel_err

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if CUDA else "cpu"
needs_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not CUDA,
                                  reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU")
# fp32: the kernels' usual 2e-5 against float64, times 5 for the floored cumulative sums (|c|
# near 104, where fp32 keeps c to 2^-17 = 7.6e-6 instead of 2^-20 for ordinary |c| < 16);
# the failures this catches are NaN and 0.17. bf16: conftest's HALF_TOL (200 fresh seeds per
# order here, T 70, both modes: median 0.0045, largest 0.0087; a CI run drew 0.012 at order 4).
TOL = {torch.float32: 1e-4, torch.bfloat16: HALF_TOL[torch.bfloat16]}
EXTREMES = {"-inf": float("-inf"), "-1e30": -1e30, "-1e10": -1e10, "-1e6": -1e6}
# bf16 runs under the interpreter too: the launchers upcast bf16 products there (args.lowp_dots)
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.fixture(autouse=True)
def poison_outputs(poison):
    """Every output and workspace the launchers allocate starts as NaN (conftest's ``poison``)."""


def extreme_case(widths, T, value, *, dtype=torch.float32, delta=True, seed=None):
    """Fresh random inputs (B 2, H 2, d_v 6, an initial state) with ``value`` as the log decay of
    batch 0 head 0 at tokens 0, 5 and 20 (the first token, a chunk's middle, a chunk's
    fifth) and of batch 1 head 1 at the last token: (device inputs, float64 copies, h0)."""
    q, k, v, g, beta, s0 = make_inputs(2, T, 2, widths, 6, delta=delta, state=True, seed=seed)
    for t in (0, 5, 20):
        g[0, t, 0] = value
    g[1, T - 1, 1] = value
    low = lambda x: None if x is None else x.to(dtype)
    ql, kl, vl, bl = [low(x) for x in q], [low(x) for x in k], low(v), low(beta)
    dev = lambda x: None if x is None else x.to(DEVICE)
    up = lambda x: None if x is None else x.double()
    dev_in = ([dev(x) for x in ql], [dev(x) for x in kl], dev(vl), dev(g.float()), dev(bl))
    ref_in = ([up(x) for x in ql], [up(x) for x in kl], up(vl), g, up(bl))
    return dev_in, ref_in, s0


def check(o, s, o_ref, s_ref, tol):
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o.cpu(), o_ref) < tol, rel_err(o.cpu(), o_ref)
    assert rel_err(s.cpu(), s_ref) < tol, rel_err(s.cpu(), s_ref)


@pytest.mark.parametrize("value", EXTREMES.values(), ids=EXTREMES.keys())
@pytest.mark.parametrize("widths", [(5,), (3, 4), (2, 3, 2)], ids=["o2", "o3", "o4"])
def test_reference_chunk_form_matches_the_token_loop(widths, value):
    _, ref, s0 = extreme_case(widths, 40, value)
    want = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True)
    got = running_tensor_chunk_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True, chunk_size=16)
    check(*got, *want, 1e-10)
    # the public API's reference backend, chunk mode (its default chunk of 64 over T 70)
    _, ref, s0 = extreme_case(widths, 70, value)
    want = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True)
    got = running_tensor(*ref, initial_state=s0, output_final_state=True, l2norm=True, mode="chunk",
                         backend="reference")
    check(*got, *want, 1e-10)


# every chunk form at orders 2-4: state in registers (workspace, prefetched, WY), streamed,
# fused (registers / streamed), split (a state every second chunk: the window path)
FORMS = {
    "resident-o2-rows": (ResidentConfig(16, 16, solve="rows"), (5,)),
    "resident-o3-wy-tiles": (ResidentConfig(16, 16, solve="tiles", wy=True), (3, 4)),
    "resident-o2-prefetch": (ResidentConfig(16, 16, prefetch_inputs=True, prepare_warps=1), (16,)),
    "streamed-o3": (StreamedConfig(16, 16, 16, merge_passes=True), (4, 5)),
    "streamed-o4": (StreamedConfig(16, 16, 16, prefetch_state=True), (2, 4, 4)),
    "fused-resident-o4": (FusedConfig(16, 16, 16, solve="tiles"), (2, 3, 2)),
    "fused-streamed-o3": (FusedConfig(16, 16, 16, solve="rows"), (4, 5)),
    "split-o2-stride2": (SplitConfig(16, 16, state_stride=2), (16,)),
    "split-o3-kg2": (SplitConfig(16, 16, key_group=2), (16, 16)),
}


@needs_triton
@pytest.mark.parametrize("value", [float("-inf"), -1e30, -1e10], ids=["-inf", "-1e30", "-1e10"])
@pytest.mark.parametrize("form", FORMS.keys())
def test_chunk_forms_match_recurrent_mode(form, value):
    config, widths = FORMS[form]
    dev, ref, s0 = extreme_case(widths, 40, value)
    h0 = s0.float().to(DEVICE)
    kw = dict(initial_state=h0, output_final_state=True, l2norm=True, backend="triton")
    o, s = running_tensor(*dev, mode="chunk", variant=config, **kw)
    want = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True)
    check(o, s, *want, TOL[torch.float32])
    o_rec, s_rec = running_tensor(*dev, mode="recurrent", **kw)
    check(o_rec, s_rec, *want, TOL[torch.float32])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [float("-inf"), -1e30, -1e10], ids=["-inf", "-1e30", "-1e10"])
@pytest.mark.parametrize("widths", [(8,), (4, 4), (2, 4, 2)], ids=["o2", "o3", "o4"])
def test_default_chunk_config_matches_recurrent_mode(widths, value, dtype):
    """What a user runs: ``mode="chunk"`` with the default config (T 70: two chunks of 64)."""
    dev, ref, s0 = extreme_case(widths, 70, value, dtype=dtype)
    kw = dict(initial_state=s0.float().to(DEVICE), output_final_state=True, l2norm=True, backend="triton")
    want = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True)
    check(*running_tensor(*dev, mode="chunk", **kw), *want, TOL[dtype])
    check(*running_tensor(*dev, mode="recurrent", **kw), *want, TOL[dtype])


@needs_triton
@pytest.mark.parametrize("value", [float("-inf"), -1e30], ids=["-inf", "-1e30"])
def test_gradients_through_a_closed_gate(value):
    """Training through a closed gate: every gradient finite and equal to the float64 token
    loop's; the floored g gets gradient 0 (the output does not depend on it)."""
    dev, ref, s0 = extreme_case((16,), 40, value)
    leaves = lambda xs: [x.clone().requires_grad_() for x in xs]
    w = torch.randn(2, 40, 2, 6, dtype=torch.float64)  # fresh (torch's global generator)
    outs = {}
    for name, (q, k, v, g, beta), backend in (("triton", dev, "triton"), ("ref", ref, "reference")):
        q, k, (v, g, beta) = leaves(q), leaves(k), leaves([v, g, beta])
        o, _ = running_tensor(q, k, v, g, beta, l2norm=True, mode="chunk", chunk_size=16, backend=backend)
        (o * w.to(o)).sum().backward()
        outs[name] = [x.grad.cpu() for x in (*q, *k, v, g, beta)]
    for got, want in zip(outs["triton"], outs["ref"]):
        assert torch.isfinite(got).all() and torch.isfinite(want).all()
        assert rel_err(got, want) < TOL[torch.float32]
    dg = outs["triton"][-2]
    assert (dg[0, [0, 5, 20], 0] == 0).all() and dg[1, -1, 1] == 0
