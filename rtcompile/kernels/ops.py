"""torch custom ops around the Triton launchers, so torch.compile and torch.export see one op.

``rtcompile::running_tensor_fwd``: prefill (chunk, recurrent, or "auto": the op picks one from
T when it runs, so a traced graph holds one node for every T and tracing a symbolic T adds no
guard; "plan:" + a plan's prefill table likewise picks the plan's bucket for (B, T) when it
runs), returns (o, final_state); the final state is a 0-element tensor when not requested
(custom ops cannot return None). The fake implementation and the autograd registration do not
depend on the mode (both forms compute the same function).
``rtcompile::running_tensor_decode_``: one decode step, mutates ``state_cache`` in place.
``rtcompile::running_tensor_layer_step_``: a dense layer's decode step around it in one kernel
(``layer_step.py``), mutates the convolution tail and ``state_cache`` in place.
The kernel config travels as its JSON text (an op argument must be a plain type).

Autograd: ``rtcompile::running_tensor_fwd``'s backward is a second custom op,
``rtcompile::running_tensor_bwd``, which calls ``chunk_backward.running_tensor_bwd`` (the
chunk form's Triton backward, for both modes: the recurrent form computes the same function, so
its gradient is the chunk form's). Being an op with a fake, the backward traces under
torch.compile / AOTAutograd and torch.export as one node. The forward saves only its inputs;
the backward recomputes what it needs (no forward workspace outlives the forward). The one
exception is an eager training call under a backward config with ``keep_forward``
(:class:`KeptForward`, :func:`kept_training_call`): its forward keeps the backward's prepare
and state loop, and its backward skips them.
"""

from __future__ import annotations

import dataclasses
import importlib
import json

import torch

from . import launch
from .forms import FORMS, config_from_dict
from .inputs import LOG_DECAY_FLOOR, auto_mode, check_inputs, nearest_bucket

# a mode argument "plan:" + a plan's prefill table: the op finds the bucket when it runs
PLAN_PREFIX = "plan:"

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
    """``chunk_size`` 0 means the variant's (or the default variant's) chunk size. ``mode``
    "auto": :func:`inputs.auto_mode` of T; ``"plan:"`` + table: :func:`plan_choice`; both
    decided here, at run time."""
    config = variant_from_json(variant)
    if mode.startswith(PLAN_PREFIX):
        mode, config = plan_choice(mode[len(PLAN_PREFIX):], q, k, v, g, beta, initial_state, cu_seqlens, scale,
                                   chunk_size, config)
    elif mode == "auto":  # as the eager call decides (a variant of the other form is refused alike)
        mode = auto_mode(v.shape[1], chunk_size or None)
    # the scan has no chunks (running_tensor_fwd refuses a size beside it): an auto or planned
    # choice of the recurrent form drops the caller's chunk size
    o, ht = launch.running_tensor_fwd(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, l2norm=l2norm, cu_seqlens=cu_seqlens,
        mode=mode, chunk_size=(chunk_size or None) if mode == "chunk" else None, variant=config,
    )
    return o, (ht if ht is not None else v.new_empty((0,), dtype=torch.float32))


def plan_choice(table: str, q, k, v, g, beta, initial_state, cu_seqlens, scale: float, chunk_size: int, config):
    """(mode, config) of a call under a plan's prefill ``table`` (``Plan.prefill_table``): the
    nearest bucket's mode, and its config unless the caller named a variant or chunk size (or
    this device cannot run it) -- what ``rtcompile.running_tensor`` does eagerly with a plan."""
    bucket = nearest_bucket(json.loads(table), v.shape[0], v.shape[1])
    mode = bucket["mode"]
    if config is None and not chunk_size:
        planned = config_from_dict(bucket["variant"], "chunk" if mode == "chunk" else "recurrent")
        config = launch.runnable(planned, check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens), v.device)
    return mode, config


@running_tensor_fwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, l2norm, mode, chunk_size, variant):
    shape = _state_shape(q, v, cu_seqlens) if output_final_state else (0,)
    # new_empty, not empty_like: the real op's outputs are contiguous whatever v's layout (a
    # strided v is copied by the launcher), and empty_like would keep a permuted v's strides
    return v.new_empty(v.shape), v.new_empty(shape, dtype=torch.float32)


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
    return v.new_empty(v.shape)  # contiguous, as the real op's (see the forward's fake)


@torch.library.custom_op("rtcompile::running_tensor_layer_step_", mutates_args=("tail", "state_cache"))
def running_tensor_layer_step_op(
    pre: torch.Tensor,
    tail: torch.Tensor | None,
    conv_weight: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    state_cache: torch.Tensor,
    state_indices: torch.Tensor,
    layout: list[int],
    scale: float,
    l2norm: bool,
    variant: str,
) -> torch.Tensor:
    """A dense layer's fused decode step (``layer_step.launch``): ``tail`` and ``state_cache``
    updated in place, the normed and gated mixer output [N, H d_v] returned. ``layout``:
    ``StepLayout.to_list``; ``variant``: an eligible decode config's JSON (the caller decides)."""
    from . import layer_step

    config, shape = variant_from_json(variant), layer_step.StepLayout.from_list(layout)
    layer_step.check_step_inputs(shape, pre, tail, conv_weight, norm_weight, state_cache, state_indices)
    if config is None or not layer_step.eligible(config, shape):
        raise ValueError(f"variant: {config}; allowed: a recurrent config whose slab is resident and whose value "
                         f"tile covers d_v = {shape.value_width} (serving_step.fused_step_plan picks one)")
    return layer_step.launch(config, shape, pre, tail, conv_weight, norm_weight, state_cache, state_indices,
                             scale=scale, l2norm=l2norm)


@running_tensor_layer_step_op.register_fake
def _(pre, tail, conv_weight, norm_weight, state_cache, state_indices, layout, scale, l2norm, variant):
    return pre.new_empty((pre.shape[0], layout[0] * layout[6]))


def _placeholder(x: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A custom op cannot return None: a missing gradient travels as a 0-element tensor."""
    return x if x is not None else like.new_empty((0,))


def _backward_module():
    """``chunk_backward``, imported when first needed: ops must import (and the forward run)
    before the backward module exists."""
    name = f"{__package__}.chunk_backward"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise  # a dependency of the module is missing: that is the error to see
        raise NotImplementedError(f"rtcompile: this build has no Triton backward ({name} is absent); "
                                  "use backend='reference' to train") from exc


@torch.library.custom_op("rtcompile::running_tensor_bwd", mutates_args=())
def running_tensor_bwd_op(
    q: list[torch.Tensor],
    k: list[torch.Tensor],
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    scale: float,
    l2norm: bool,
    chunk_size: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv, dg, dbeta, dh0)`` of ``running_tensor_fwd`` given ``do`` and
    ``dht`` (None: the final state carries no gradient). dg / dbeta / dh0 are 0-element tensors
    where g / beta / initial_state is None. ``chunk_size`` 0: the backward's own choice."""
    dq, dk, dv, dg, db, dh0 = _backward_module().running_tensor_bwd(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, l2norm=l2norm,
        do=do, dht=dht, chunk_size=chunk_size or None,
    )
    # an op's outputs may not alias its inputs (a backward may hand back a zero tensor it was given)
    ins = [*q, *k, v, g, beta, initial_state, cu_seqlens, do, dht]
    fresh = lambda x: x.clone(memory_format=torch.contiguous_format) if any(x is y for y in ins if y is not None) else x
    return ([fresh(x) for x in dq], [fresh(x) for x in dk], fresh(dv), fresh(_placeholder(dg, v)),
            fresh(_placeholder(db, v)), fresh(_placeholder(dh0, v)))


@running_tensor_bwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, do, dht, scale, l2norm, chunk_size):
    # contiguous gradients of the inputs' shapes, as the real op's (strided inputs included)
    like = lambda x: x.new_empty(x.shape) if x is not None else v.new_empty((0,))
    return [like(x) for x in q], [like(x) for x in k], like(v), like(g), like(beta), like(initial_state)


def _floored(dg: torch.Tensor | None, g: torch.Tensor | None) -> torch.Tensor | None:
    """dg where the forward used g; 0 below inputs.LOG_DECAY_FLOOR, where it floored g (o does
    not depend on g there)."""
    if dg is None or g is None:
        return None
    return torch.where(g < LOG_DECAY_FLOOR, torch.zeros_like(dg), dg)


def _setup(ctx, inputs, output):
    """Save the inputs (not the forward's workspaces: the backward recomputes the states)."""
    q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, l2norm, mode, chunk_size, _ = inputs
    ctx.orders = len(q)
    ctx.save_for_backward(*q, *k, v, g, beta, initial_state, cu_seqlens)
    ctx.scale, ctx.l2norm, ctx.output_final_state = scale, l2norm, output_final_state
    # the chunk length the caller asked for applies to the chunk form; the recurrent form has none.
    # "auto" and a plan keep it: deciding here would guard a traced T, and the backward's chunk length
    # changes how it computes the gradient, not the gradient
    ctx.chunk_size = 0 if mode == "recurrent" else chunk_size


def _backward(ctx, do, dht):
    saved = ctx.saved_tensors
    n = ctx.orders
    q, k = list(saved[:n]), list(saved[n:2 * n])
    v, g, beta, initial_state, cu_seqlens = saved[2 * n:]
    if do is None:  # only the final state was used
        do = torch.zeros_like(v)
    # without output_final_state the second output is a 0-element placeholder: its grad means nothing
    if not ctx.output_final_state:
        dht = None
    dq, dk, dv, dg, db, dh0 = running_tensor_bwd_op(
        q, k, v, g, beta, initial_state, cu_seqlens, do, dht, ctx.scale, ctx.l2norm, ctx.chunk_size,
    )
    drop = lambda grad, x: grad if x is not None else None
    # one gradient per op argument: q, k, v, g, beta, initial_state, then the non-differentiable
    # cu_seqlens, scale, output_final_state, l2norm, mode, chunk_size, variant
    return (dq, dk, dv, _floored(dg, g), drop(db, beta), drop(dh0, initial_state),
            None, None, None, None, None, None, None)


torch.library.register_autograd("rtcompile::running_tensor_fwd", _backward, setup_context=_setup)


# ----- the eager training call that keeps its forward (BackwardConfig.keep_forward) -----

class KeptForward(torch.autograd.Function):
    """An eager training call whose forward keeps the backward's prepare and state loop
    (``chunk_backward_kept.forward_kept``), so its backward starts from them. Inputs: the
    backward config, the checked problem, l2norm, output_final_state, cu_seqlens, then the
    differentiable v, g, beta, initial state and the factors. Graph capture keeps the custom op
    (the recomputing backward): this class is for eager calls only (``kept_training_call``)."""

    @staticmethod
    def forward(ctx, config, p, l2norm, output_final_state, cu_seqlens, v, g, beta, h0, *factors):
        from .args import contiguous_inputs
        from .chunk_backward_kept import forward_kept

        n = len(factors) // 2
        q, k, v, g, beta, h0, cu_seqlens = contiguous_inputs(factors[:n], factors[n:], v, g, beta, h0, cu_seqlens)
        o, ht, kept = forward_kept(config, p, q, k, v, g, beta, h0, cu_seqlens, l2norm, output_final_state)
        ctx.config, ctx.p, ctx.l2norm, ctx.spent = config, p, l2norm, False
        # the kept workspaces are saved tensors, not ctx attributes, so saved-tensor hooks see
        # them: non-reentrant checkpointing drops them after the forward and recomputes them
        # for the backward (as ctx attributes every checkpointed layer's stayed alive until its
        # backward), and save_on_cpu moves them
        ctx.ws_keys, ctx.n_chunks, ctx.n_factors = tuple(kept.ws), kept.n_chunks, len(q)
        ctx.save_for_backward(*q, *k, v, g, beta, h0, cu_seqlens, *kept.tensors())
        return o, ht

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernels' gradients have no graph: a double backward
    def backward(ctx, do, dht):  # (create_graph=True) is refused, as the custom op's, not a silent first order
        from .chunk_backward_kept import Recomputed

        saved, n = ctx.saved_tensors, ctx.n_factors
        q, k = list(saved[:n]), list(saved[n:2 * n])
        v, g, beta, h0, cu_seqlens = saved[2 * n:2 * n + 5]
        kept, spent = None, []
        if not ctx.spent:  # a second backward (retain_graph) recomputes: the first wrote over phi's workspaces
            kept = Recomputed.from_tensors(ctx.ws_keys, saved[2 * n + 5:], ctx.n_chunks)
            spent = kept.workspaces()
            ctx.spent = True
        do = torch.zeros_like(v) if do is None else do.contiguous()
        dq, dk, dv, dg, db, dh0 = _backward_module().launch_backward(
            ctx.config, ctx.p, q, k, v, g, beta, h0, cu_seqlens, ctx.l2norm, do,
            None if dht is None else dht.contiguous(), kept=kept)
        # a retained graph (retain_graph=True) would hold the spent workspaces until it is freed,
        # though no backward reads them again: their memory goes now (each was made by the
        # forward; a resize does not count as a write to autograd's version check)
        for t in spent:
            t.untyped_storage().resize_(0)
        # launch_backward gives None for an absent beta or initial state
        return (None, None, None, None, None, dv, _floored(dg, g), db, dh0, *dq, *dk)


def kept_training_call(p, q, k, v, g, beta, initial_state, cu_seqlens, l2norm: bool, output_final_state: bool,
                       chunk_size: int | None):
    """(o, final state or None) of an eager chunk-form training call when its backward config
    (the tuned table's, else the default, as the backward would resolve it) has
    ``keep_forward``; None otherwise (the caller then takes the custom op). Invariant: the
    backward supports the problem (``running_tensor`` checked that before)."""
    from .config import KernelShape

    chunk_backward = _backward_module()
    shape = KernelShape(p.key_widths, p.value_width, v.element_size())
    if not chunk_backward.tiled(shape):  # rewritten widths take the op (chunk_backward_widths.py)
        return None
    # a chunk size the backward cannot run (24, 128 ...) takes the op: its forward refuses one that is
    # wrong there too (naming chunk_size, as without grad), its backward runs its own chunk length
    if chunk_size is not None and chunk_size not in chunk_backward.BWD_CHUNK_SIZES:
        return None
    config = chunk_backward.resolve_backward(shape, None, chunk_size, v.device, p, gated=g is not None)
    # the kept forward runs at the backward config's chunk size: only where that is the caller's
    if not config.keep_forward or (chunk_size is not None and config.chunk_size != chunk_size):
        return None
    o, ht = KeptForward.apply(config, p, l2norm, output_final_state, cu_seqlens, v, g, beta, initial_state, *q, *k)
    return o, ht
