"""The fused layer step (kernels/layer_step.py): a dense layer's decode step from its stacked
projection to the gated mixer output in one kernel, against the same layer's unfused step in
float64 on the reference; slots, padding and the configs that may not run it."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from rtcompile.kernels import args
from rtcompile.kernels.config import KernelShape
from rtcompile.kernels.forms import covering_tile
from rtcompile.kernels.layer_step import StepLayout, eligible
from rtcompile.kernels.ops import running_tensor_layer_step_op, variant_to_json
from rtcompile.kernels.recurrent import RecurrentConfig
from rtcompile.model import RunningTensorLayer
from rtcompile.serving_step import fused_step_plan, step_layout
from rtcompile.spec import Features, ModelSpec

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not CUDA,
                                reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU")

FEATURES = {
    "all": Features(query_skip=True),
    "conv2-no-l2norm": Features(short_conv=2, l2norm=False, query_skip=True),
    "no-gates": Features(forget_gate=False, delta_rule=False, output_gate=False),
    "no-conv": Features(short_conv=0, query_skip=True),
}
# one map off at a time, odd taps (3: a padded window; 1: an empty tail)
MORE_FEATURES = {
    "conv3-no-forget": Features(short_conv=3, forget_gate=False, query_skip=True),
    "conv1-no-beta": Features(short_conv=1, delta_rule=False),
    "no-output-gate": Features(output_gate=False, query_skip=True),
}
WIDTHS = {"o2-5": (5,), "o3-3x4": (3, 4), "o4-2x3x2": (2, 3, 2)}
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _layer(widths, features, dtype, value_width=6, heads=2, seed=0, state_dtype="float32"):
    torch.manual_seed(seed)
    spec = ModelSpec(order=len(widths) + 1, key_widths=widths, value_width=value_width, heads=heads, model_width=12,
                     layers=1, features=features, state_dtype=state_dtype)
    layer = RunningTensorLayer(spec).to(DEVICE).eval()
    with torch.no_grad():  # a norm weight and biases away from their initial values: a wrong one shows
        if hasattr(layer, "norm_weight"):
            layer.norm_weight.uniform_(0.5, 1.5)
    return layer.to(dtype)


def _cache(layer, B, dtype, state_dtype=torch.float32, slots=None, seed=1):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    spec = layer.spec
    state = 0.3 * torch.randn(slots or B, spec.heads, *spec.key_widths, spec.value_width, generator=g, device=DEVICE)
    w = spec.features.short_conv
    tails = [torch.randn(B, w - 1, sum(layer.widths), generator=g, device=DEVICE).to(dtype)] if w else None
    return {"state": state.to(state_dtype), "conv": tails}


def _reference(layer, x, cache):
    """The unfused step on the reference backend in float64: (y, state, tails)."""
    ref = copy.deepcopy(layer).double()
    c = {"state": cache["state"].double().clone(), "conv": [t.double().clone() for t in cache["conv"] or []] or None}
    with torch.no_grad():
        y, c = ref(x.double(), c, backend="reference", update_cache=True)
    return y, c["state"], c["conv"]


def _close(got, want, tol, what):
    err = float((got.double() - want).abs().max().detach())
    scale = float(want.abs().max().detach()) or 1.0
    assert err <= tol * max(scale, 1.0), f"{what}: max error {err:.3g} (largest {scale:.3g}, tol {tol})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("widths", list(WIDTHS.values()), ids=list(WIDTHS))
@pytest.mark.parametrize("features", list(FEATURES.values()), ids=list(FEATURES))
def test_the_fused_step_matches_the_unfused_step_in_float64(features, widths, dtype):
    _check_fused_step(_layer(widths, features, dtype), dtype)


@pytest.mark.parametrize("case", [
    pytest.param(dict(features=f, dtype=torch.float32), id=name) for name, f in MORE_FEATURES.items()] + [
    pytest.param(dict(features=FEATURES["all"], dtype=torch.float16), id="fp16"),
    pytest.param(dict(features=FEATURES["all"], dtype=torch.bfloat16, state_dtype=torch.bfloat16), id="bf16-state"),
    pytest.param(dict(features=FEATURES["all"], dtype=torch.float32, heads=3, value_width=7), id="H3-dv7"),
])
def test_more_layers_and_types(case):
    state_dtype = case.get("state_dtype", torch.float32)
    layer = _layer((3, 4), case["features"], case["dtype"], value_width=case.get("value_width", 6),
                   heads=case.get("heads", 2), state_dtype=str(state_dtype).removeprefix("torch."))
    _check_fused_step(layer, case["dtype"], state_dtype)


def _check_fused_step(layer, dtype, state_dtype=torch.float32):
    B = 3
    cache = _cache(layer, B, dtype, state_dtype)
    x = torch.randn(B, 1, 12, device=DEVICE).to(dtype)
    want_y, want_state, want_tails = _reference(layer, x, cache)
    plan = fused_step_plan(layer, B, "triton", state_dtype)
    assert plan is not None, "the default decode config of these shapes covers a head's values"
    fused = layer.input_projection()._replace(step=plan)
    state, tails = cache["state"], cache["conv"]
    tails_before = [t.clone() for t in tails or []]
    with torch.no_grad(), args.poisoned():  # a NaN-filled output: every element is written
        y, new = layer(x, cache, backend="triton", update_cache=True, fused=fused)
    assert new["state"] is state and (tails is None or new["conv"][0] is tails[0]), "updated in place"
    tol = max(TOL[dtype], TOL[state_dtype])
    _close(y, want_y, tol, "y")
    _close(state, want_state, tol, "state")  # (bf16: the stacked product is rounded to bf16)
    for got, old, want in zip(tails or [], tails_before, want_tails or []):
        assert torch.equal(got[:, :-1], old[:, 1:]), "the kept taps move exactly"
        if got.shape[1]:  # (short_conv 1 keeps no tail)
            _close(got[:, -1], want[:, -1], tol, "the tail's new tap")  # the projection, rounded to dtype


def test_slots_follow_the_indices_and_padding_is_left_alone():
    """state_indices [3, -1, 0] into a 5-slot cache: rows 0 and 2 update slots 3 and 0 as the
    unfused step would; the padding row's slot and the unused slots keep their bits; every
    row's tail shifts (a tail belongs to the batch row, not the slot)."""
    layer = _layer((3, 4), FEATURES["all"], torch.float32)
    B = 3
    cache = _cache(layer, B, torch.float32, slots=5)
    state, tail = cache["state"], cache["conv"][0]
    before, tail_before = state.clone(), tail.clone()
    x = torch.randn(B, 1, 12, device=DEVICE)
    index = torch.tensor([3, -1, 0], dtype=torch.int64, device=DEVICE)
    past = torch.tensor([5, 7, 3], dtype=torch.int32, device=DEVICE)  # rows 0, 1 past the 5 slots: skipped
    plan = fused_step_plan(layer, B, "triton", torch.float32)
    stacked = layer.input_projection()
    pre = torch.nn.functional.linear(x[:, 0], stacked.weight, stacked.bias)
    with torch.no_grad(), args.poisoned():
        o = running_tensor_layer_step_op(pre, tail, layer.conv.weight, layer.norm_weight, state, index,
                                         list(plan.layout), layer.spec.effective_scale, True, plan.variant)
    rows = [0, 2]
    want_y, want_state, _ = _reference(layer, x[rows], {"state": before[[3, 0]], "conv": [tail_before[rows]]})
    got_y = torch.nn.functional.linear(o[rows].double(), layer.out.weight.double())
    _close(got_y, want_y[:, 0], TOL[torch.float32], "y")
    _close(state[[3, 0]], want_state, TOL[torch.float32], "state")
    for s in (1, 2, 4):
        assert torch.equal(state[s], before[s]), f"slot {s} was written"
    assert torch.equal(tail[:, :-1], tail_before[:, 1:])
    assert torch.equal(tail[:, -1], pre[:, :sum(layer.widths)])
    kept = state.clone()
    with torch.no_grad():
        running_tensor_layer_step_op(pre, tail, layer.conv.weight, layer.norm_weight, state, past,
                                     list(plan.layout), layer.spec.effective_scale, True, plan.variant)
    assert torch.equal(state[:3], kept[:3]) and torch.equal(state[4], kept[4]), "slots past the cache: none written"
    assert not torch.equal(state[3], kept[3])


def test_a_tile_narrower_than_the_head_is_widened_and_runs():
    """K 256 d_v 64 at B2: the decode default's [256, 32] tile becomes [256, 64] for the fused
    step (one program a head), with the warps the defaults give that tile; it matches float64."""
    shape = KernelShape((16, 16), 64)
    narrow = RecurrentConfig(block_k=256, block_v=32, num_warps=4, stream_hints=True)
    assert covering_tile(narrow, shape) == RecurrentConfig(block_k=256, block_v=64, num_warps=8, stream_hints=True)
    streamed = RecurrentConfig(block_k=128, block_v=32)
    assert covering_tile(streamed, shape) is streamed, "a streamed slab is not widened"
    assert covering_tile(covering_tile(narrow, shape), shape) == covering_tile(narrow, shape)
    layer = _layer((16, 16), FEATURES["all"], torch.float32, value_width=64, heads=1)
    B = 2
    plan = fused_step_plan(layer, B, "triton", torch.float32)
    assert plan is not None and plan.config.block_v == 64
    cache = _cache(layer, B, torch.float32)
    x = torch.randn(B, 1, 12, device=DEVICE)
    want_y, want_state, _ = _reference(layer, x, cache)
    with torch.no_grad(), args.poisoned():
        y, _ = layer(x, cache, backend="triton", update_cache=True, fused=layer.input_projection()._replace(step=plan))
    _close(y, want_y, TOL[torch.float32], "y")
    _close(cache["state"], want_state, TOL[torch.float32], "state")


def test_configs_and_layers_that_cannot_run_fused():
    layout = StepLayout(2, (3, 4), 6, 4, 38, 40, 42, 46)
    assert eligible(RecurrentConfig(block_k=16, block_v=8), layout)
    assert not eligible(RecurrentConfig(block_k=16, block_v=4), layout), "a tile narrower than d_v"
    assert not eligible(RecurrentConfig(block_k=8, block_v=8), layout), "a streamed slab"
    assert StepLayout.from_list(layout.to_list()) == layout
    dense = _layer((3, 4), FEATURES["all"], torch.float32)
    assert fused_step_plan(dense, 3, "reference", torch.float32) is None
    assert fused_step_plan(dense, 3, "triton", torch.float64) is None
    assert fused_step_plan(copy.deepcopy(dense).double(), 3, "auto", torch.float64) is None
    conconlyc = _layer((3, 4), Features(projection="conconlyc", short_conv=3), torch.float32)
    assert step_layout(conconlyc) is None and fused_step_plan(conconlyc, 3, "triton", torch.float32) is None
    # the layout names the stacked product's columns: proj (2 x 2 x 7 + 2 x 6 = 40), forget, beta, skip, gate
    assert step_layout(dense) == StepLayout(2, (3, 4), 6, 4, 40, 42, 44, 48)
    assert variant_to_json(RecurrentConfig(block_k=16, block_v=8)).startswith('{"form": "recurrent"')


def _op_args(layer, B=3):
    stacked = layer.input_projection()
    pre = torch.randn(B, stacked.weight.shape[0], device=DEVICE)
    cache = _cache(layer, B, torch.float32)
    plan = fused_step_plan(layer, B, "triton", torch.float32)
    return dict(pre=pre, tail=cache["conv"][0], conv_weight=layer.conv.weight.detach(),
                norm_weight=layer.norm_weight.detach(), state_cache=cache["state"],
                state_indices=torch.arange(B, device=DEVICE), layout=list(plan.layout), scale=0.5, l2norm=True,
                variant=plan.variant)


@pytest.mark.parametrize("field,bad,error,match", [
    ("pre", lambda a: a["pre"][:, :40], ValueError, "pre: shape"),
    ("pre", lambda a: a["pre"].t().contiguous().t(), ValueError, "pre: shape"),
    ("tail", lambda a: None, TypeError, "tail: expected a torch.Tensor"),
    ("tail", lambda a: a["tail"].transpose(1, 2).contiguous().transpose(1, 2), ValueError, "tail: strides"),
    ("conv_weight", lambda a: None, TypeError, "conv_weight: expected"),
    ("norm_weight", lambda a: None, TypeError, "norm_weight: expected"),
    ("state_cache", lambda a: a["state_cache"][..., :5], ValueError, "state_cache: "),
    ("state_indices", lambda a: a["state_indices"][:2], ValueError, "state_indices: shape"),
    ("state_indices", lambda a: a["state_indices"].float(), TypeError, "state_indices: dtype"),
    ("layout", lambda a: a["layout"][:5], ValueError, "layout: got"),
    ("variant", lambda a: variant_to_json(RecurrentConfig(block_k=16, block_v=4)), ValueError, "variant: "),
], ids=lambda x: x if isinstance(x, str) and not x.endswith(":") else None)
def test_the_op_refuses_bad_inputs_naming_them(field, bad, error, match):
    """Every argument is checked against the layout before the launch: a missing or misshapen
    tensor (which the kernel would read out of bounds or skip a map for) names itself."""
    layer = _layer((3, 4), FEATURES["all"], torch.float32)
    a = _op_args(layer)
    state = a["state_cache"].clone()
    a[field] = bad(a)
    with pytest.raises(error, match=match):
        running_tensor_layer_step_op(**a)
    if field != "state_cache":
        assert torch.equal(a["state_cache"], state), "refused before any work"


def test_reference_backend_and_grad_run_the_unfused_step(monkeypatch):
    """A fused step plan does not override backend='reference', and with grad (the op has no
    backward) the step runs unfused: the kernel is never launched."""
    from rtcompile.kernels import layer_step

    layer = _layer((3, 4), FEATURES["all"], torch.float32)
    fused = layer.input_projection()._replace(step=fused_step_plan(layer, 3, "triton", torch.float32))
    monkeypatch.setattr(layer_step, "launch", lambda *a, **k: pytest.fail("the fused kernel ran"))
    x = torch.randn(3, 1, 12, device=DEVICE)
    with torch.no_grad():
        layer(x, _cache(layer, 3, torch.float32), backend="reference", update_cache=True, fused=fused)
    y, _ = layer(x, _cache(layer, 3, torch.float32), backend="auto", update_cache=True, fused=fused)
    assert y.requires_grad  # (auto: the reference step, as without the plan)


def test_static_step_refuses_fuse_layers_it_would_drop():
    from rtcompile.generate import StaticStep
    from rtcompile.model import RunningTensorLM

    spec = ModelSpec(order=3, key_widths=(3, 4), value_width=6, heads=2, model_width=12, layers=1)
    lm = RunningTensorLM(spec, vocab_size=17).eval()
    with pytest.raises(ValueError, match="fuse_layers: True with fuse_projections=False"):
        StaticStep(lm, 4, "triton", capture=False, fuse_layers=True)
    with pytest.raises(ValueError, match="fuse_layers: True with parts=2"):
        StaticStep(lm, 4, "triton", capture=False, fuse_projections=True, fuse_layers=True, parts=2)
    with pytest.raises(TypeError, match="fuse_layers: expected a bool"):
        StaticStep(lm, 4, "triton", capture=False, fuse_projections=True, fuse_layers=1)
