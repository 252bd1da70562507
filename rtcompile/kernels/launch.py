"""The kernels' entry points: validate, resolve the config (the caller's, else the tuned
table's for the shape bucket, else the default), allocate, launch the config's form.

Every argument is validated before anything is allocated or launched (``check_inputs`` plus
:func:`check_layout`, the kernels' layout rules). Layout rule: the kernels address contiguous
tensors (as in flash-linear-attention), so one token-head row index addresses all per-token
inputs; a strided view (a model's slice of a fused projection) is accepted and copied once,
after validation, at the launch boundary (``args.contiguous_inputs`` says why). Only the decode
step's ``state_cache``, which the kernel updates in place, must be contiguous. The kernels take
up to three factors (orders 2 to 4).

Each config runs through the ``launch`` function of its form's module (:data:`LAUNCHERS`);
the decode step through ``decode_plan.py``'s launch plans.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import torch

from ..fields import dtype_error
from . import args, chunk_fused, chunk_resident, chunk_split, chunk_split_gluon, chunk_streamed, recurrent, tuned
from .args import MAX_FACTORS, STATE_DTYPES, factor_args, interpreting
from .chunk_fused import FusedConfig
from .chunk_resident import ResidentConfig
from .chunk_split import SplitConfig
from .chunk_streamed import StreamedConfig
from .config import CHUNK_SIZES, DEFAULT_SMEM_BYTES, KernelConfig, KernelShape, checked
from .forms import check_config, config_from_dict, default_config, wide_decode_rows
from .inputs import Problem, check_inputs
from .decode_plan import DECODE_PLANS, DecodePlan, PlanCache, check_indices, signature_key
from .recurrent import RecurrentConfig

MODES = ("chunk", "recurrent")


def kernel_shape(p: Problem) -> KernelShape:
    return KernelShape(p.key_widths, p.value_width, torch.empty((), dtype=p.dtype).element_size())


@functools.lru_cache(maxsize=None)
def smem_limit(device: torch.device) -> int | None:
    """Shared memory per block (opt-in) of a CUDA device; None elsewhere (the checks' portable bound)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device.index or 0).shared_memory_per_block_optin


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    """The GPU's name as tuned entries record it ("cpu-interpreter" off the GPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device.index or 0)
    return "cpu-interpreter"


@functools.lru_cache(maxsize=1024)
def _default(kernel: str, shape: KernelShape, limit: int | None, device: torch.device,
             decode_rows: int | None = None, chunk_size: int | None = None) -> KernelConfig:
    """The defaults table's first proposal that runs on ``device`` (the Gluon kernels only on
    sm_90; ``decode_rows``, ``chunk_size``: :func:`~.forms.candidates`')."""
    return default_config(kernel, shape, DEFAULT_SMEM_BYTES if limit is None else limit,
                          gluon=chunk_split_gluon.runs_on(device), decode_rows=decode_rows, chunk_size=chunk_size)


def decode_rows(kernel: str, p: Problem) -> int | None:
    """Sequences x heads of a one-token recurrent call (the decode step), whose default tile
    depends on them (:func:`~.forms.decode_tile`), capped at the rule's threshold (the rule
    reads no more, and the cached defaults stay one per batch below it); None for any other
    call. A varlen call of one token a sequence (B = 1, T = N: every sequence has at least one
    token, so T = N means exactly one each; serving engines pack their decode steps so) is one:
    the kernel runs the same N x H programs as at [N, 1]."""
    one_token = p.seq_len == 1 or (p.seq_bounds is not None and p.seq_len == p.num_seqs)
    if kernel != "recurrent" or not one_token:
        return None
    return min(p.num_seqs * p.heads, wide_decode_rows(kernel_shape(p)))


def device_refusal(config: KernelConfig, device: torch.device) -> str | None:
    """Why ``config`` cannot run on ``device`` beyond its own check (None when it can): ``tma`` on
    a GPU older than sm_90, the Gluon state loop anywhere but sm_90."""
    if getattr(config, "loop", "triton") == "gluon" and not chunk_split_gluon.runs_on(device):
        return "loop='gluon' needs an sm_90 GPU (Hopper's wgmma; Gluon kernels do not run under the interpreter)"
    if getattr(config, "tma", False) and device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        return "tma=True needs a GPU with tensor memory access (sm_90 or newer)"
    return None


def _tuned_config(kernel: str, p: Problem, device: torch.device) -> KernelConfig | None:
    entry = tuned.lookup(kernel, p.key_widths, p.value_width, p.heads, str(p.dtype).removeprefix("torch."),
                         device_name(device), p.batch, p.seq_len)
    if entry is None:
        return None
    try:
        return config_from_dict(entry, kernel)
    except (TypeError, ValueError):
        return None  # an entry this version cannot read: the table is advice, not a contract


def runnable(config: KernelConfig, p: Problem, device: torch.device) -> KernelConfig | None:
    """``config`` when it can run problem ``p`` on ``device``, else None: a plan made for another
    GPU may name a config this device cannot run (then the launcher's own choice serves)."""
    if checked(config, kernel_shape(p), smem_limit(device)) is not None or device_refusal(config, device) is not None:
        return None
    return config


def resolve_config(kernel: str, variant: KernelConfig | None, p: Problem, device: torch.device,
                   chunk_size: int | None = None) -> KernelConfig:
    """The config a call runs: ``variant`` (checked), else the tuned table's, else the default
    (with ``chunk_size`` when given). A chosen config with ``tma`` on a GPU older than sm_90
    runs without it; the caller's is refused there."""
    shape = kernel_shape(p)
    limit = smem_limit(device)
    chosen = variant is None
    if variant is not None:
        check_config(variant, kernel)
    elif chunk_size is None:
        variant = _tuned_config(kernel, p, device)
        if variant is not None and (checked(variant, shape, limit) or device_refusal(variant, device)):
            variant = None
    if variant is None:  # with a caller's chunk size, the first proposal that runs it
        variant = _default(kernel, shape, limit, device, decode_rows(kernel, p), chunk_size)
    reason = checked(variant, shape, limit)
    if reason is None and (reason := device_refusal(variant, device)) is not None and chosen \
            and getattr(variant, "tma", False):  # a chosen config runs without TMA on an older GPU
        variant = dataclasses.replace(variant, tma=False)
        reason = checked(variant, shape, limit) or device_refusal(variant, device)
    if reason is not None and chosen and chunk_size is not None:  # the caller named a chunk size, not a variant
        sized = [_default(kernel, shape, limit, device, chunk_size=c) for c in CHUNK_SIZES]
        ok = [str(c.chunk_size) for c in sized if checked(c, shape, limit) is None and device_refusal(c, device) is None]
        why = f" ({reason})" if chunk_size in CHUNK_SIZES else ""  # else the size rule, restated by allowed
        raise ValueError(f"chunk_size: {chunk_size} cannot run K={shape.key_dim}, d_v={shape.value_width} on the Triton "
                         f"backend{why}; allowed: {', '.join(ok) or 'none here'}, or backend='reference' (any size)")
    if reason is not None:
        raise ValueError(f"variant: {variant} cannot run K={shape.key_dim}, d_v={shape.value_width}: {reason}")
    if chunk_size is not None and variant.chunk_size != chunk_size:
        raise ValueError(f"chunk_size: {chunk_size} conflicts with the variant's {variant.chunk_size}; give one")
    return variant


# every config class -> the launcher of its form: launch(config, p, q, k, v, g, beta, *, h0, ht,
# cu_seqlens, l2norm) -> o, with ``ht`` the fp32 final-state buffer or None
LAUNCHERS = {
    ResidentConfig: chunk_resident.launch,
    StreamedConfig: chunk_streamed.launch,
    FusedConfig: chunk_fused.launch,
    SplitConfig: chunk_split.launch,
    RecurrentConfig: recurrent.launch,
}


def check_layout(p: Problem, q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    """The kernels' own rules beyond ``check_inputs``: orders 2-4, floating inputs, a state
    dtype they read, cu_seqlens beside v, and a CUDA device (or the interpreter). Strided
    inputs pass: the launchers copy them (``args.contiguous_inputs``)."""
    if len(q) > MAX_FACTORS:
        raise ValueError(
            f"q: {len(q)} factors (order {len(q) + 1}); allowed: the Triton kernels take orders 2-4 "
            "(1-3 factors); use the reference (backend='reference') for higher orders"
        )
    if v.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise dtype_error("v", v.dtype, "float16, bfloat16, float32 (the Triton kernels)")
    if initial_state is not None and initial_state.dtype not in STATE_DTYPES:
        raise dtype_error("initial_state", initial_state.dtype, "float32, bfloat16, float16")
    if cu_seqlens is not None and cu_seqlens.device != v.device:
        raise ValueError(f"cu_seqlens: on {cu_seqlens.device}, v on {v.device}; allowed: the same device")
    if v.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"v: on {v.device}; the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on the CPU)"
        )


def running_tensor_fwd(
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
    mode: str = "chunk",
    chunk_size: int | None = None,
    variant: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prefill with the Triton kernels; same contract as :func:`rtcompile.running_tensor`.

    ``mode="chunk"`` runs a chunk form (``variant``: a ResidentConfig, StreamedConfig,
    FusedConfig or SplitConfig), ``mode="recurrent"`` the recurrent scan (a RecurrentConfig).
    The final state is fp32 (the initial state may be fp32, bf16 or fp16).
    """
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode: got {mode!r}; allowed: {', '.join(MODES)}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)):
        raise TypeError(f"chunk_size: expected an int or None, got {type(chunk_size).__name__}")
    if chunk_size is not None and mode == "recurrent":
        raise ValueError(f"chunk_size: got {chunk_size} with mode='recurrent', which has no chunks; allowed: None, "
                         "or mode='chunk'")
    p = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    return fwd_checked(p, q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                       l2norm=l2norm, cu_seqlens=cu_seqlens, mode=mode, chunk_size=chunk_size, variant=variant)


def fwd_checked(p: Problem, q, k, v, g, beta, *, initial_state, output_final_state: bool, l2norm: bool,
                cu_seqlens, mode: str, chunk_size: int | None, variant: KernelConfig | None, plan_key=None):
    """:func:`running_tensor_fwd` after its argument checks. Invariant: ``p`` is what
    ``check_inputs`` returned for these very tensors, and ``mode``/``chunk_size`` passed the
    public checks (``rtcompile.running_tensor`` has done both; checking again cost ~27 us of
    its ~84 us of Python per call on the CPU machine). Layout and config are checked here;
    strided inputs are then copied (once, for every kernel of the call to read). ``plan_key``
    (:func:`call_key` of the public call): a recurrent call is run through a :class:`CallPlan`
    kept under that key, which later calls with the same key run without these checks."""
    check_layout(p, q, k, v, g, beta, initial_state, cu_seqlens)
    kernel = "chunk" if mode == "chunk" else "recurrent"
    config = resolve_config(kernel, variant, p, v.device, chunk_size if kernel == "chunk" else None)
    if plan_key is not None and cu_seqlens is None:
        plan = CallPlan(p, config, l2norm, copy=not args.all_contiguous(*q, *k, v, g, beta, initial_state),
                        initial_state=initial_state)
        CALL_PLANS.remember(plan_key, plan)
        return plan(q, k, v, g, beta, initial_state, output_final_state)
    q, k, v, g, beta, initial_state, cu_seqlens = args.contiguous_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    # a streamed state lives in the final-state buffer while the kernel runs
    need_ht = output_final_state or not config.resident(kernel_shape(p))
    ht = args.empty(p.state_shape, dtype=torch.float32, device=v.device) if need_ht else None
    o = LAUNCHERS[type(config)](config, p, q, k, v, g, beta, h0=initial_state, ht=ht, cu_seqlens=cu_seqlens,
                                l2norm=l2norm)
    return o, (ht if output_final_state else None)


# ----- the eager call's host path ------------------------------------------------------------
# A recurrent call at T = 1 (a model's decode step through the public API) runs its kernel for a
# few microseconds; validating and resolving its config again each call cost 22 us of Python on
# the idle CPU machine, 11 us with the plan (benchmarks/serving_host.py, launches stubbed). A
# chunk call (an eager prefill) is host-bound too: with the plan an o3 16x16 split call took 316
# us instead of 409 at B1 T256, 362 instead of 446 at B8 T4096 (H200 machine, one process). As
# for the decode step, a plan found once per argument signature is reused; the signature holds
# everything the checks and the config depend on (shapes, dtypes, devices, contiguity, flags,
# the tuned table's generation).


class CallPlan:
    """A validated eager call of ``running_tensor`` (not varlen, no grad): for the recurrent form
    the kernel's launch plan (a :class:`DecodePlan`: grid, constexprs, scalar arguments, the
    compiled kernel's launchers), for a chunk form its config and the checked problem, which its
    launcher runs; and the outputs' shapes. Invariant: only called with arguments whose
    :func:`call_key` found it (or that :meth:`PlanCache.recent` recognised)."""

    __slots__ = ("config", "copy", "ht_like_h0", "kernel", "l2norm", "need_ht", "problem", "state_shape")

    def __init__(self, p: Problem, config: KernelConfig, l2norm: bool, *, copy: bool, initial_state=None):
        # copy: some input is a strided view, made contiguous before each launch (the plan's key
        # holds each input's contiguity, so a plan serves calls of one layout only)
        self.problem, self.config, self.l2norm, self.copy = p, config, l2norm, copy
        if isinstance(config, RecurrentConfig):
            grid, consts = recurrent.launch_consts(p, l2norm, config)
            self.kernel = DecodePlan(grid, consts, (p.scale, p.seq_len, p.num_seqs))
            # a streamed state (block_k < K) lives in the final-state buffer while the kernel runs
            self.need_ht = config.block_k < p.key_dim
        else:  # a chunk form: its launcher, which decides its parts per call (graph capture)
            self.kernel = None
            self.need_ht = not config.resident(kernel_shape(p))
        self.state_shape = p.state_shape
        # the final state allocated like an fp32 initial state: empty_like took 3.7 us against
        # 8.5 for empty(shape, dtype=, device=) on the H200 machine (the key holds h0's dtype)
        self.ht_like_h0 = initial_state is not None and initial_state.dtype == torch.float32

    def __call__(self, q, k, v, g, beta, initial_state, output_final_state: bool):
        if self.copy:
            q, k, v, g, beta, initial_state = args.contiguous_inputs(q, k, v, g, beta, initial_state)
        if not (output_final_state or self.need_ht):
            ht = None
        elif self.ht_like_h0:  # contiguous by now, of the state's shape (check_inputs)
            ht = args.empty_like(initial_state)
        else:
            ht = args.empty(self.state_shape, dtype=torch.float32, device=v.device)
        if self.kernel is None:
            o = LAUNCHERS[type(self.config)](self.config, self.problem, q, k, v, g, beta, h0=initial_state, ht=ht,
                                             cu_seqlens=None, l2norm=self.l2norm)
        else:
            o = args.empty_like(v)  # v is contiguous here: its layout is the output's
            self.kernel.launch((*factor_args(q), *factor_args(k), v, g, beta, o, initial_state, ht, None, None))
        return o, (ht if output_final_state else None)


CALL_PLANS = PlanCache()  # call_key(...) -> CallPlan


# a stacked tensor unpacks into slices of the shapes a cached list of factors had: a plan found by
# them served q = torch.stack(factors), which the full checks refuse ("q: expected a list or tuple")
FACTOR_SEQUENCES = (list, tuple)


def call_head(q, k, g, beta, initial_state, scale, output_final_state, l2norm, mode, chunk_size, backend,
              variant) -> tuple:
    """The plain arguments of a public ``running_tensor`` call that its plan depends on (with the
    tuned table's generation, so a plan found before the table changed is not reused);
    TypeError for factors that are not sequences, or for flags that are not bools (the full
    checks then name them: a cached plan must never serve ``l2norm="false"`` or ``0``, which
    compare or hash equal to a bool). ``scale`` and ``chunk_size`` enter with their types, so
    ``64.0`` or ``True`` is not served by a plan made for ``64`` or ``1``."""
    if output_final_state.__class__ is not bool or l2norm.__class__ is not bool:
        raise TypeError("flags that are not bools go through the full checks")
    if q.__class__ not in FACTOR_SEQUENCES or k.__class__ not in FACTOR_SEQUENCES:
        raise TypeError("factors not in a list or tuple go through the full checks")
    return (len(q), len(k), g is None, beta is None, initial_state is None, scale, scale.__class__,
            output_final_state, l2norm, mode, chunk_size, chunk_size.__class__, backend, variant, interpreting(),
            tuned.generation())


def call_key(head, tensors):
    """The call-plan key of a public ``running_tensor`` call (:func:`signature_key` of
    :func:`call_head` and the call's tensors), or None when a plan cannot serve it (an argument
    that is not a plain tensor, as tracers hand in, or unhashable)."""
    return signature_key(head, tensors, exact=True)


def decode_head(q, k, g, beta, scale, l2norm, variant) -> tuple:
    """The plain arguments of a decode call that its plan depends on, as :func:`call_head`."""
    if l2norm.__class__ is not bool:
        raise TypeError("flags that are not bools go through the full checks")
    if q.__class__ not in FACTOR_SEQUENCES or k.__class__ not in FACTOR_SEQUENCES:
        raise TypeError("factors not in a list or tuple go through the full checks")
    return (len(q), len(k), g is None, beta is None, scale, scale.__class__, l2norm, variant, interpreting(),
            tuned.generation())


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
    variant: RecurrentConfig | None = None,
) -> torch.Tensor:
    """One decode step for N sequences, updating ``state_cache`` in place.

    Args:
        q, k, v, g, beta: as :func:`running_tensor_fwd` with B = N sequences and T = 1.
            Strided views are accepted (copied before the launch).
        state_cache: ``[slots, H, d_1, ..., d_{o-1}, d_v]`` (fp32, bf16 or fp16), contiguous
            (updated in place: a copy's update would be lost).
        state_indices: int32 or int64 ``[N]``: the cache row of each sequence; a negative
            entry is padding (its state is neither read nor written, its output is meaningless).
        validate: check that indices are in range and distinct (one device sync). Turn off
            inside CUDA graphs and hot loops whose indices are known good.
        variant: a RecurrentConfig, or None for the tuned table's (looked up once per new
            argument signature) or the default.

    Returns:
        o ``[N, 1, H, d_v]`` in v's dtype.
    """
    return decode_step(q, k, v, g, beta, state_cache, state_indices, scale, l2norm, validate, variant)


def decode_step(q, k, v, g, beta, state_cache, state_indices, scale, l2norm, validate, variant) -> torch.Tensor:
    """:func:`running_tensor_decode_` with every argument positional (keywords cost the public
    call ~1 us of its host time, a third of what the public API's wrapper added on the CPU
    machine)."""
    # the eager hot path (~20 us on the H200 with its kernel): a plan found by the arguments'
    # signature, the index check, one allocation and the compiled kernel's own launcher
    try:
        tensors = (*q, *k, v, g, beta, state_cache, state_indices)
        head = decode_head(q, k, g, beta, scale, l2norm, variant)
    except TypeError:  # factors that are not sequences: the full checks say why
        tensors = head = None
    plan = DECODE_PLANS.recent(head, tensors) if head is not None else None
    if plan is None:
        key = signature_key(head, tensors) if head is not None else None
        plan = DECODE_PLANS.get(key) if key is not None else None
        if plan is None:
            plan = _plan_decode(q, k, v, g, beta, state_cache, state_indices, scale, l2norm, variant)
            DECODE_PLANS.remember(key, plan)
        if key is not None:
            DECODE_PLANS.note(head, tensors, plan)
    if validate is True:
        check_indices(state_indices, state_cache.shape[0])
    elif validate is not False:
        raise TypeError(f"validate: expected a bool, got {type(validate).__name__}")
    if plan.copy:  # the plan's key holds every input's contiguity: contiguous calls skip this
        q, k, v, g, beta, state_indices = args.contiguous_inputs(q, k, v, g, beta, state_indices)
    # empty_like(v): v is contiguous by then, so its copy's layout is the output's
    o = args.empty_like(v)
    plan.launch((*factor_args(q), *factor_args(k), v, g, beta, o, state_cache, state_cache, state_indices, None))
    return o


def _plan_decode(q, k, v, g, beta, state_cache, state_indices, scale, l2norm, variant) -> DecodePlan:
    """Validate a decode call completely and return its launch plan."""
    if not isinstance(state_cache, torch.Tensor):
        raise TypeError(f"state_cache: expected a torch.Tensor, got {type(state_cache).__name__}")
    if not isinstance(state_indices, torch.Tensor):
        raise TypeError(f"state_indices: expected a torch.Tensor, got {type(state_indices).__name__}")
    if not isinstance(l2norm, bool):
        raise TypeError(f"l2norm: expected a bool, got {type(l2norm).__name__}")
    p = check_inputs(q, k, v, g, beta, scale, None, None)
    if p.seq_len != 1:
        raise ValueError(f"v: T = {p.seq_len}; allowed: T = 1 for a decode step (use running_tensor_fwd for more)")
    check_layout(p, q, k, v, g, beta, None, None)
    want = (p.heads, *p.key_widths, p.value_width)
    if state_cache.dim() != len(want) + 1 or tuple(state_cache.shape[1:]) != want:
        raise ValueError(f"state_cache: expected shape [slots, {', '.join(map(str, want))}], got {list(state_cache.shape)}")
    if state_cache.dtype not in STATE_DTYPES:
        raise dtype_error("state_cache", state_cache.dtype, "float32, bfloat16, float16")
    if not state_cache.is_contiguous():
        raise ValueError(f"state_cache: strides {state_cache.stride()} are not contiguous; allowed: a contiguous cache "
                         "(the step updates it in place, so it cannot work on a copy)")
    if state_cache.device != v.device:
        raise ValueError(f"state_cache: on {state_cache.device}, v on {v.device}; allowed: the same device")
    # the kernel widens each index to int64 as it loads it, so either width addresses the cache
    if state_indices.dtype not in (torch.int32, torch.int64):
        raise dtype_error("state_indices", state_indices.dtype, "torch.int32, torch.int64")
    if tuple(state_indices.shape) != (p.batch,) or state_indices.device != v.device:
        raise ValueError(f"state_indices: expected shape [{p.batch}] on {v.device}, got {list(state_indices.shape)} "
                         f"on {state_indices.device}")
    config = resolve_config("recurrent", variant, p, v.device)
    grid, consts = recurrent.launch_consts(p, l2norm, config)
    copy = not args.all_contiguous(*q, *k, v, g, beta, state_indices)
    # the plan's key holds the cache's shape: its slot count is fixed with it
    return DecodePlan(grid, consts, (p.scale, 1, state_cache.shape[0]), copy=copy)
