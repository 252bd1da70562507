"""torch custom ops around the Triton launchers, so torch.compile and torch.export see one op.

``rtcompile::running_tensor_fwd``: prefill (chunk or recurrent), returns (o, final_state);
the final state is a 0-element tensor when not requested (custom ops cannot return None).
``rtcompile::running_tensor_decode_``: one decode step, mutates ``state_cache`` in place.
The kernel config travels as its JSON text (an op argument must be a plain type).
Forward only: calling with inputs that require grad raises (backward is a later release).
"""

from __future__ import annotations

import dataclasses
import json

import torch

from . import launch
from .forms import FORMS, config_from_dict

# each form's field names, read once: dynamo folds a dict lookup and attribute reads, not
# dataclasses.fields
FIELD_NAMES = {form: tuple(f.name for f in dataclasses.fields(cls)) for form, cls in FORMS.items()}


def variant_to_json(variant) -> str:
    """The variant as JSON text, built from plain attribute reads and string formatting so
    that dynamo folds it to a constant (json.dumps and frozen-dataclass reconstruction both
    break a fullgraph trace, the latter on torch 2.11)."""
    if variant is None:
        return ""
    items = [f'"form": "{variant.form}"']
    for name in FIELD_NAMES[variant.form]:
        value = getattr(variant, name)
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = f'"{value}"'
        else:
            text = str(int(value))
        items.append(f'"{name}": {text}')
    return "{" + ", ".join(items) + "}"


def variant_from_json(text: str):
    if not text:
        return None
    return config_from_dict(json.loads(text))


def _state_shape(q, v, cu_seqlens):
    n = v.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (n, v.shape[2], *(x.shape[-1] for x in q), v.shape[-1])


@torch.library.custom_op("rtcompile::running_tensor_fwd", mutates_args=())
def running_tensor_fwd_op(
    q: list[torch.Tensor],
    k: list[torch.Tensor],
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    output_final_state: bool,
    l2norm: bool,
    mode: str,
    chunk_size: int,
    variant: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_size`` 0 means the variant's (or the default variant's) chunk size."""
    o, ht = launch.running_tensor_fwd(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, l2norm=l2norm, cu_seqlens=cu_seqlens,
        mode=mode, chunk_size=chunk_size or None, variant=variant_from_json(variant),
    )
    return o, (ht if ht is not None else v.new_empty((0,), dtype=torch.float32))


@running_tensor_fwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, l2norm, mode, chunk_size, variant):
    shape = _state_shape(q, v, cu_seqlens) if output_final_state else (0,)
    return torch.empty_like(v), v.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op("rtcompile::running_tensor_decode_", mutates_args=("state_cache",))
def running_tensor_decode_op(
    q: list[torch.Tensor],
    k: list[torch.Tensor],
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    state_cache: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float,
    l2norm: bool,
    variant: str,
) -> torch.Tensor:
    # Index validation syncs the device: it is done once by the eager wrapper, not in graphs.
    return launch.running_tensor_decode_(
        q, k, v, g, beta, state_cache=state_cache, state_indices=state_indices, scale=scale,
        l2norm=l2norm, validate=False, variant=variant_from_json(variant),
    )


@running_tensor_decode_op.register_fake
def _(q, k, v, g, beta, state_cache, state_indices, scale, l2norm, variant):
    return torch.empty_like(v)


def _no_backward(ctx, *grads):
    raise NotImplementedError(
        "rtcompile: the Triton kernels are forward-only in this release; use backend='reference' to train"
    )


def _setup(ctx, inputs, output):  # nothing to save: backward refuses
    pass


torch.library.register_autograd("rtcompile::running_tensor_fwd", _no_backward, setup_context=_setup)
