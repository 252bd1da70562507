"""The public functional API: :func:`running_tensor`."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Sequence

import torch

from .kernels import Problem, check_inputs, running_tensor_chunk_ref, running_tensor_recurrent_ref
from .kernels.inputs import AUTO_CHUNK, auto_mode

MODES = ("auto", "recurrent", "chunk")
BACKENDS = ("auto", "triton", "reference")
DEFAULT_CHUNK = AUTO_CHUNK
MAX_TRITON_ORDER = 4


def _triton_available(v: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, or anywhere under the interpreter (TRITON_INTERPRET=1)."""
    return v.device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def needs_grad(*xs) -> bool:
    """Does autograd need a backward through these (grad mode on and a tensor requiring grad)?"""
    if not torch.is_grad_enabled():
        return False
    for x in xs:  # a plain loop: the generator form cost 5.6 us of a T = 1 call's 18 us (CPU machine)
        if isinstance(x, torch.Tensor) and x.requires_grad:
            return True
    return False


def running_tensor(
    q: Sequence[torch.Tensor],
    k: Sequence[torch.Tensor],
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    l2norm: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    mode: str = "auto",
    chunk_size: int | None = None,
    backend: str = "auto",
    variant=None,
    plan=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RunningTensor state mixer of order o = len(q) + 1.

    Args:
        q, k: o-1 query and key factors, each ``[B, T, H, d_i]`` (q[i] and k[i] share d_i).
        v: values ``[B, T, H, d_v]``, same dtype as the factors.
        g: log decay ``[B, T, H]`` (a_t = exp(g_t), so g <= 0); ``None`` for no forget gate.
        beta: delta-rule strength ``[B, T, H]`` in (0, 1); ``None`` for the plain (additive) update.
            The values of g and beta are not checked (a check reads them back: a device sync on
            every call, as in fla); g > 0 grows the state without bound, NaN propagates.
        scale: output scale, default ``prod(d_i) ** -0.5``.
        initial_state: ``[N, H, d_1, ..., d_{o-1}, d_v]``, N = B (or the number of sequences
            with ``cu_seqlens``).
        output_final_state: also return the final state (fp32; fp64 for fp64 inputs).
        l2norm: normalise every query and key factor to unit L2 norm.
        cu_seqlens: int32 (or int64) offsets ``[N + 1]`` of sequences packed along T, with B = 1.
        Every tensor may be a strided view (e.g. a slice of a fused projection); the Triton
        backend copies such views once before its launches, and gradients have the inputs' shapes.
        mode: ``"recurrent"``, ``"chunk"`` or ``"auto"`` (with a ``variant``, its form's mode).
        chunk_size: chunk length for ``mode="chunk"``; default: the variant's (Triton) or 64.
        backend: ``"triton"`` (CUDA, or the interpreter with TRITON_INTERPRET=1),
            ``"reference"`` (PyTorch, differentiable, any order), or ``"auto"``: Triton when it
            can run the call (device, order <= 4, 16/32-bit inputs) and, when an input requires
            grad (grad mode on), when the Triton backward can run it too
            (``rtcompile.kernels.chunk_backward.supports``; absent module: it cannot), else the
            reference. With grad, the Triton call goes through the custom op
            ``rtcompile::running_tensor_fwd``, whose autograd backward is the chunk form's Triton
            backward (for ``mode="recurrent"`` too: same function, same gradient); gradients
            reach every factor, v, g, beta and ``initial_state``, and flow from the returned
            final state. ``"triton"`` on a call the backward cannot run raises ValueError with
            the reason, before any work.
        plan: a :class:`~rtcompile.plan.Plan`: with ``mode="auto"`` the call follows the plan's
            prefill decision for the nearest (B, T) bucket (mode and, on Triton, the variant).
        variant: a kernel config (:mod:`rtcompile.kernels.forms`: ResidentConfig, StreamedConfig,
            FusedConfig or SplitConfig for mode="chunk", RecurrentConfig for "recurrent") for the Triton backend
            (default: the variant chosen from the shapes); refused where the call runs on the reference.

    Returns:
        ``(o, final_state)``: o ``[B, T, H, d_v]`` in v's dtype; final_state or ``None``.

    Eager calls on the Triton backend without grad and without ``cu_seqlens`` or ``plan`` (a
    decode step or a prefill through this API) keep a launch plan per argument signature (shapes,
    dtypes, devices, contiguity, flags, the tuned table's generation): a later call with the same
    signature skips the checks and the config lookup, which it cannot change
    (``kernels/launch.py``'s ``CallPlan``).

    Order 2 (one factor) is gated (delta) linear attention with flash-linear-attention's
    conventions. ``mode="auto"`` follows ``plan`` when given; without one it picks chunk for
    sequences of at least one chunk, a choice the Triton custom op makes when it runs (so
    ``torch.export`` and ``torch.compile(dynamic=True)`` keep T symbolic over its whole range).
    """
    plan_key = None
    if cu_seqlens is None and plan is None and mode in MODES and backend != "reference" \
            and not torch.compiler.is_compiling():
        # the eager fast path (a decode step or a prefill through this API): a call whose
        # signature a validated call already had runs that call's plan (kernels/launch.py)
        launch = _LAUNCH or _launch_module()
        try:
            tensors = (*q, *k, v, g, beta, initial_state)
            head = launch.call_head(q, k, g, beta, initial_state, scale, output_final_state, l2norm, mode,
                                    chunk_size, backend, variant)
        except TypeError:  # factors that are not sequences: the full checks say why
            head = None
        if head is not None:
            hit = launch.CALL_PLANS.recent(head, tensors)  # no tensor of a noted call requires grad
            if hit is not None:
                return hit(q, k, v, g, beta, initial_state, output_final_state)
            plan_key = launch.call_key(head, tensors)
            hit = launch.CALL_PLANS.get(plan_key) if plan_key is not None else None
            if hit is not None and not needs_grad(*q, *k, v, g, beta, initial_state):
                launch.CALL_PLANS.note(head, tensors, hit)
                return hit(q, k, v, g, beta, initial_state, output_final_state)
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode: got {mode!r}; allowed: {', '.join(MODES)}")
    if plan is not None and not callable(getattr(plan, "decision_for", None)):
        raise TypeError(f"plan: expected a rtcompile.plan.Plan or None, got {type(plan).__name__}")
    check_flags(output_final_state=output_final_state, l2norm=l2norm)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)):
        raise TypeError(f"chunk_size: expected an int or None, got {type(chunk_size).__name__}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size: got {chunk_size}; allowed: an integer >= 1, or None")
    if chunk_size is not None and mode == "recurrent":  # the scan has no chunks: it was dropped unseen
        raise ValueError(f"chunk_size: got {chunk_size} with mode='recurrent', which has no chunks; allowed: None, "
                         "or mode='chunk' / 'auto'")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: got {backend!r}; allowed: {', '.join(BACKENDS)}")
    if variant is not None:
        from .kernels.forms import KERNELS

        forward = KERNELS["chunk"] + KERNELS["recurrent"]
        if not isinstance(variant, forward):  # whatever backend runs: a fallback dropped it unseen
            raise TypeError(f"variant: expected one of {', '.join(c.__name__ for c in forward)} or None, got "
                            f"{type(variant).__name__}")
        if backend == "reference":  # it was dropped unseen
            raise ValueError(f"variant: a Triton kernel config ({type(variant).__name__}), which backend='reference' "
                             "does not run; allowed: variant=None with backend='reference', or backend='triton' / 'auto'")
    if torch.compiler.is_compiling():
        # Traced by dynamo: shapes only (the op validates when it runs, its fake checks shapes).
        order, seq_len = len(q) + 1, v.shape[1]
        eff_scale = float(scale) if scale is not None else _default_scale(q)
        p = None
    else:
        p = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
        order, seq_len, eff_scale = p.order, p.seq_len, p.scale
    C = chunk_size or DEFAULT_CHUNK
    plan_variant = False
    # traced with a plan: the op finds the plan's bucket when it runs (finding it here guards B and T)
    defer_plan = mode == "auto" and plan is not None and _tracing(v)
    if mode == "auto" and plan is not None and not defer_plan:
        decision = plan.decision_for("prefill", v.shape[0], seq_len)
        mode = decision.mode
        if variant is None and chunk_size is None:
            from .kernels.forms import config_from_dict

            variant = config_from_dict(decision.variant, "chunk" if mode == "chunk" else "recurrent")
            C = getattr(variant, "chunk_size", C)
            plan_variant = True
    grad = needs_grad(*q, *k, v, g, beta, initial_state)
    why_no_backward = None
    if grad and backend != "reference":
        if p is None:  # traced by dynamo: the question is asked once, at trace time (widths are guarded)
            widths = tuple(int(x.shape[-1]) for x in q)
            why_no_backward = traced_backward_refusal(widths, int(v.shape[3]), eff_scale, v.dtype, v.device,
                                                      cu_seqlens)
        else:
            why_no_backward = backward_refusal(p, cu_seqlens)
    backend = resolve_backend(backend, v, order, grad, why_no_backward=why_no_backward,
                              state_dtype=None if initial_state is None else initial_state.dtype)
    if defer_plan and backend != "triton":  # no op to defer to: the plan's mode, as eagerly
        mode = plan.decision_for("prefill", v.shape[0], seq_len).mode
    if backend != "triton":
        if variant is not None and not plan_variant:  # the caller's: refused, not dropped unseen
            raise ValueError(f"variant: a Triton kernel config ({type(variant).__name__}), but backend='auto' runs this "
                             "call on the reference (float64 inputs, order > 4, a backward the Triton kernels do not "
                             "run, or no GPU and no TRITON_INTERPRET=1); allowed: variant=None, or inputs the Triton "
                             "backend runs")
        variant = None  # a plan's kernel variant means nothing to the reference
    elif plan_variant and not torch.compiler.is_compiling():
        from .kernels.launch import runnable

        variant = runnable(variant, p, v.device)
    if mode == "auto" and backend == "triton" and variant is not None:
        # the caller's variant says its form: mode="auto" with a chunk config at T = 20 picked the
        # recurrent form by length and refused the config
        mode = "recurrent" if getattr(variant, "kernel", None) == "recurrent" else "chunk"  # else: refused as a variant
    if mode == "auto" and not (backend == "triton" and _tracing(v)):
        mode = auto_mode(seq_len, C)  # traced Triton calls leave it to the op (no guard on T)
    if backend == "triton" and not grad and not _tracing(v):
        # Eager without grad: straight to the launcher; the custom op's dispatch adds Python
        # overhead and nothing else when no graph is being captured and no backward is needed
        # (the op remains for compile, export and autograd).
        from .kernels.launch import fwd_checked

        return fwd_checked(p, q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                           l2norm=l2norm, cu_seqlens=cu_seqlens, mode=mode, chunk_size=chunk_size, variant=variant,
                           plan_key=plan_key)
    if backend == "triton" and grad and mode == "chunk" and variant is None and not _tracing(v):
        # an eager training call whose backward config keeps its forward (keep_forward)
        from .kernels.ops import kept_training_call

        kept = kept_training_call(p, q, k, v, g, beta, initial_state, cu_seqlens, l2norm, output_final_state,
                                  chunk_size)
        if kept is not None:
            return kept
    if backend == "triton":
        from .kernels.forms import check_config
        from .kernels.ops import running_tensor_fwd_op, variant_to_json

        if variant is not None and mode in ("chunk", "recurrent"):
            # before variant_to_json reads its fields: a dict there was an AttributeError with grad,
            # against the no-grad path's TypeError naming variant (the launcher's check, the same call)
            check_config(variant, mode)
        if defer_plan:
            mode = plan_mode(plan)
        o, ht = running_tensor_fwd_op(
            list(q), list(k), v, g, beta, initial_state, cu_seqlens, eff_scale,
            output_final_state, l2norm, mode, chunk_size or 0, variant_to_json(variant),
        )
        return o, (ht if output_final_state else None)
    kwargs = dict(
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        l2norm=l2norm, cu_seqlens=cu_seqlens,
    )
    if mode == "recurrent":
        return running_tensor_recurrent_ref(q, k, v, g, beta, **kwargs)
    return running_tensor_chunk_ref(q, k, v, g, beta, chunk_size=C, **kwargs)


def running_tensor_decode_(
    q: Sequence[torch.Tensor],
    k: Sequence[torch.Tensor],
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    *,
    state_cache: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    l2norm: bool = False,
    validate: bool = True,
    variant=None,
) -> torch.Tensor:
    """One decode step per sequence on the Triton kernel, updating ``state_cache`` in place.

    ``q``/``k``: o-1 factors ``[N, 1, H, d_i]``; ``v`` ``[N, 1, H, d_v]``; ``g``/``beta``
    ``[N, 1, H]`` (strided views accepted: copied before the launch); ``state_cache``
    ``[slots, H, d_1, ..., d_v]``, contiguous (updated in place); ``state_indices`` int32 or
    int64 ``[N]`` (negative = padding). ``validate`` checks the indices (one device sync) and that
    no input requires grad (the step has no backward); pass False inside CUDA graphs. Under
    torch.compile the call is the custom op ``rtcompile::running_tensor_decode_``.
    Returns o ``[N, 1, H, d_v]``.
    """
    if torch.compiler.is_compiling():
        from .kernels.ops import running_tensor_decode_op, variant_to_json

        return running_tensor_decode_op(
            list(q), list(k), v, g, beta, state_cache, state_indices,
            float(scale) if scale is not None else _default_scale(q), l2norm, variant_to_json(variant),
        )
    # its output had no grad_fn: gradients were lost silently (a q or k that is not a list is left
    # to the launcher's checks, which name it)
    if validate and isinstance(q, (list, tuple)) and isinstance(k, (list, tuple)) \
            and needs_grad(*q, *k, v, g, beta, state_cache):
        raise ValueError(f"running_tensor_decode_: an input requires grad, but {NO_DECODE_BACKWARD}; allowed: "
                         "inputs under torch.no_grad() / torch.inference_mode(), or running_tensor(..., "
                         "backend='reference') for a step to differentiate")
    return (_LAUNCH or _launch_module()).decode_step(q, k, v, g, beta, state_cache, state_indices, scale, l2norm,
                                                     validate, variant)


def check_flags(**flags) -> None:
    """TypeError naming the first argument of ``flags`` that is not a bool (a truthy string or
    2 would otherwise pass as True)."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")


# kernels.launch once imported: an import statement cost a T = 1 call ~1 us (CPU machine), and
# the module stays unimported until a Triton call needs it (it imports Triton)
_LAUNCH = None


def _launch_module():
    global _LAUNCH
    from .kernels import launch

    _LAUNCH = launch
    return launch


NO_DECODE_BACKWARD = "the Triton decode step has no backward"


def resolve_backend(backend: str, v: torch.Tensor, order: int, grad: bool, *,
                    why_no_backward: str | None = NO_DECODE_BACKWARD, state_dtype: torch.dtype | None = None) -> str:
    """``"triton"`` or ``"reference"`` for a call with values ``v`` (see :func:`running_tensor`'s
    ``backend``). ``grad``: an input requires grad; ``why_no_backward``: why the Triton backward
    cannot run the call (None when it can; the default serves the decode step, which has none).
    ``"triton"`` with grad on a call the Triton backward cannot run is a ValueError."""
    if grad and backend != "reference" and why_no_backward is not None:
        if backend == "triton":
            raise ValueError(
                f"backend: 'triton' with an input that requires grad, but the Triton backward cannot run "
                f"this call: {why_no_backward}; allowed: backend='reference' (or 'auto', which falls back "
                "to it), or torch.no_grad()"
            )
        return "reference"
    if backend == "auto":
        # float64 stays on the reference: the kernels accumulate in fp32 (a float64 initial state
        # too: the Triton path refuses it, the reference takes it)
        usable = _triton_available(v) and order <= MAX_TRITON_ORDER and v.dtype != torch.float64 \
            and state_dtype != torch.float64
        return "triton" if usable else "reference"
    return backend


BACKWARD_MODULE = "rtcompile.kernels.chunk_backward"


def backward_refusal(p: Problem, cu_seqlens: torch.Tensor | None) -> str | None:
    """Why the Triton backward cannot run problem ``p`` (None when it can): the answer of
    ``chunk_backward.supports``, imported here so that a build without that module still runs
    forward calls (then every backward is refused with a reason)."""
    try:
        chunk_backward = importlib.import_module(BACKWARD_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != BACKWARD_MODULE:
            raise  # a missing dependency of the module is a real error, not an absent backward
        return f"this build has no Triton backward ({BACKWARD_MODULE} is absent)"
    return chunk_backward.supports(p, cu_seqlens)


def constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing torch._dynamo, which that
    call does: 3.5 of the 4.4 s that ``rtcompile.load`` of the example bundle took on the CPU
    machine went to that import, paid by every serving process that never compiles. Dynamo's
    decorator only sets the mark below on the function (torch 2.11-2.13; a test checks that the
    two agree), so it is set here, and the real decorator runs when dynamo is loaded already."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@constant_result
def traced_backward_refusal(widths: tuple[int, ...], value_width: int, scale: float, dtype: torch.dtype,
                            device: torch.device, cu_seqlens: torch.Tensor | None) -> str | None:
    """:func:`backward_refusal` for a call dynamo traces, from plain values: dynamo runs it
    eagerly at trace time and keeps the answer as a constant, so neither the lazy import
    (importlib breaks a fullgraph trace) nor ``supports`` is traced. ``check_inputs`` has not
    run, so the problem's ``seq_bounds`` is None (reading ``cu_seqlens`` would sync). B, T and H
    are not arguments (the problem holds 1 for each): the backward's support does not depend on
    them, and a symbolic size (``torch.compile(dynamic=True)``) cannot be a constant-result
    function's argument (dynamo would break the graph there)."""
    num_seqs = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    p = Problem(1, 1, 1, widths, value_width, num_seqs, None, scale, dtype, device)
    return backward_refusal(p, cu_seqlens)


@constant_result
def plan_mode(plan) -> str:
    """The op's ``mode`` argument for a traced call under ``plan``: ``"plan:"`` and the plan's
    prefill table (dynamo runs this at trace time and keeps the text as a constant: json.dumps
    breaks a fullgraph trace)."""
    from .kernels.ops import PLAN_PREFIX

    return PLAN_PREFIX + plan.prefill_table()


def _tracing(v: torch.Tensor) -> bool:
    """Is a graph being captured (torch.compile, torch.export in either mode, make_fx)? Then
    calls must go through the custom ops, whose fake implementations tracing runs. A plain
    eager tensor is exactly ``torch.Tensor``; tracers hand in subclasses (fake, functional)."""
    exporting = getattr(torch.compiler, "is_exporting", lambda: False)
    return torch.compiler.is_compiling() or exporting() or type(v) is not torch.Tensor


def _default_scale(q: Sequence[torch.Tensor]) -> float:
    key_dim = 1
    for x in q:  # a plain loop: dynamo cannot trace math.prod over a generator
        key_dim *= x.shape[-1]
    return key_dim**-0.5
