"""The fused layer step (``kernels/layer_step.py``) from the model's side: a dense layer's layout
in its stacked input maps, whether a batch's decode config can run it, and the step itself.

The decision is made once per batch bucket, outside any trace (``generate.StaticStep``), and
travels in the layer's :class:`~rtcompile.model.InputProjection` (``step``): a compiled step
then holds the fused op or the unfused layer, never a branch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .functional import resolve_backend
from .kernels.layer_step import ABSENT, StepLayout, eligible, problem


def step_layout(layer) -> StepLayout | None:
    """Where ``layer``'s inputs sit in its stacked input maps (``input_projection``'s rows), or
    None for a layer without the dense projection (conconlyc tiles its input per stream)."""
    if layer.proj is None:
        return None
    spec = layer.spec
    cols, at = {}, 0
    for name in layer.input_map_names():
        cols[name] = at
        at += getattr(layer, name).out_features
    return StepLayout(spec.heads, tuple(spec.key_widths), spec.value_width,
                      spec.features.short_conv if layer.conv is not None else 0,
                      *(cols.get(n, ABSENT) for n in ("forget", "beta", "skip", "gate")))


class FusedStep(NamedTuple):
    """A layer's fused step for one batch bucket: the decode config, its JSON (the op's
    ``variant``) and the layout as the op's int list; plain values, so a trace folds them."""

    config: object
    variant: str
    layout: tuple[int, ...]


def fused_step_plan(layer, batch: int, backend: str, state_dtype: torch.dtype) -> FusedStep | None:
    """``layer``'s step over ``batch`` sequences through the fused kernel when its decode config
    can run it (:func:`~rtcompile.kernels.layer_step.eligible`): the config the unfused step's
    decode kernel would take (the tuned table's, else the default with its batch rule), its
    value tile widened to d_v where narrower (``forms.covering_tile``). None: no dense
    projection, the reference backend, float64, or no such tile passes its check (a streamed
    slab, K > 1024 at d_v 64)."""
    from .kernels.forms import covering_tile
    from .kernels.launch import resolve_config
    from .kernels.ops import variant_to_json

    layout = step_layout(layer)
    p = layer.out.weight
    if layout is None or p.dtype == torch.float64 or state_dtype == torch.float64:
        return None
    probe = p.new_empty(0)
    if resolve_backend(backend, probe, layer.spec.order, False, state_dtype=state_dtype) != "triton":
        return None
    config = resolve_config("recurrent", None, problem(layout, batch, layer.spec.effective_scale, p.dtype, p.device), p.device)
    # a tile narrower than d_v widened: at B32 and B1 (K 256: [256, 32] tiles) the wide tile's
    # decode kernel is slower alone (H100: 0.94 of a copy against 1.00 at B32), but the fused
    # step saves the three pointwise kernels around it: the example model's compiled step took
    # 90.0 -> 80.8 us at B32 and 62.2 -> 59.0 at B1 (H100, 6394276, same run)
    config = covering_tile(config, layout.kernel_shape())
    if not eligible(config, layout):
        return None
    return FusedStep(config, variant_to_json(config), tuple(layout.to_list()))


def fused_step(layer, x: torch.Tensor, cache: dict, fused, plan=None) -> tuple[torch.Tensor, dict]:
    """``layer``'s serving step (x [B, 1, D]) through the fused kernel, with ``fused`` its
    stacked input maps carrying its :class:`FusedStep` (``fused.step``): (y [B, 1, D], the cache
    with its state and tails updated in place). A state in another dtype than the step's
    (``model.step_state_dtype``) or not contiguous is converted once and the converted tensor
    returned, as the unfused step does (the static step allocates it as the step keeps it)."""
    from .kernels.ops import running_tensor_layer_step_op
    from .model import as_step_state, step_state_dtype

    B = x.shape[0]
    state = as_step_state(cache["state"], step_state_dtype(layer.spec, plan, B, x.dtype))
    pre = F.linear(x[:, 0], fused.weight, fused.bias)
    tails = cache["conv"]
    o = running_tensor_layer_step_op(
        pre, None if not tails else tails[0], None if layer.conv is None else layer.conv.weight,
        getattr(layer, "norm_weight", None), state, layer.slot_indices(B, x.device), list(fused.step.layout),
        layer.spec.effective_scale, layer.spec.features.l2norm, fused.step.variant)
    return layer.out(o)[:, None], {"state": state, "conv": tails}
