"""The kernels' entry points: validate, resolve the config (the caller's, else the tuned
table's for the shape bucket, else the default), allocate, launch the config's form.

TRANSITIONAL: the form files do not hold their launchers yet; until they do, a config is
translated to the pre-redesign variant and run by ``triton_fwd`` (the same kernels). The
public functions and their contracts here are final.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import torch

from . import triton_fwd, tuned
from .chunk_fused import FusedConfig
from .chunk_resident import ResidentConfig
from .chunk_split import SplitConfig
from .chunk_streamed import StreamedConfig
from .config import KernelConfig, KernelShape
from .forms import check_config, config_from_dict, default_config
from .inputs import Problem, check_inputs
from .recurrent import RecurrentConfig
from .variants import ChunkVariant, RecurrentVariant

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


@functools.lru_cache(maxsize=4096)
def _reason(config: KernelConfig, shape: KernelShape, limit: int | None) -> str | None:
    # every eager call resolves its config: the checks are pure functions of their arguments
    return config.check(shape) if limit is None else config.check(shape, limit)


@functools.lru_cache(maxsize=1024)
def _default(kernel: str, shape: KernelShape, limit: int | None) -> KernelConfig:
    return default_config(kernel, shape) if limit is None else default_config(kernel, shape, limit)


def _tuned_config(kernel: str, p: Problem, device: torch.device) -> KernelConfig | None:
    entry = tuned.lookup(kernel, p.key_widths, p.value_width, p.heads, str(p.dtype).removeprefix("torch."),
                         device_name(device), p.batch, p.seq_len)
    if entry is None:
        return None
    try:
        return config_from_dict(entry, kernel)
    except (TypeError, ValueError):
        return None  # an entry this version cannot read: the table is advice, not a contract


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
        if variant is not None and _reason(variant, shape, limit):
            variant = None
    if variant is None:
        variant = _default(kernel, shape, limit)
        if chunk_size is not None:
            variant = dataclasses.replace(variant, chunk_size=chunk_size)
    reason = _reason(variant, shape, limit)
    if reason is None and getattr(variant, "tma", False) and device.type == "cuda" \
            and torch.cuda.get_device_capability(device) < (9, 0):
        if chosen:
            variant = dataclasses.replace(variant, tma=False)
            reason = _reason(variant, shape, limit)
        else:
            reason = "tma=True needs a GPU with tensor memory access (sm_90 or newer)"
    if reason is not None:
        raise ValueError(f"variant: {variant} cannot run K={shape.key_dim}, d_v={shape.value_width}: {reason}")
    if chunk_size is not None and variant.chunk_size != chunk_size:
        raise ValueError(f"chunk_size: {chunk_size} conflicts with the variant's {variant.chunk_size}; give one")
    return variant


def _legacy(config: KernelConfig, shape: KernelShape):
    """The pre-redesign variant that runs ``config`` (transitional)."""
    kp = shape.key_dim_pow2
    if isinstance(config, RecurrentConfig):
        return RecurrentVariant(**dataclasses.asdict(config))
    common = dict(chunk_size=config.chunk_size, block_v=config.block_v, num_warps=config.num_warps,
                  num_stages=config.num_stages, solve=config.solve)
    if isinstance(config, ResidentConfig):
        return ChunkVariant(block_k=kp, prepare_warps=config.prepare_warps, dot_precision=config.dot_precision,
                            prefetch=config.prefetch_inputs, wy=config.wy, **common)
    if isinstance(config, StreamedConfig):
        return ChunkVariant(block_k=config.block_k, prepare_warps=config.prepare_warps,
                            dot_precision=config.dot_precision, prefetch=config.prefetch_state,
                            merge_passes=config.merge_passes, **common)
    if isinstance(config, FusedConfig):
        return ChunkVariant(block_k=config.block_k, fuse_prepare=True, prefetch=config.prefetch_state,
                            merge_passes=config.merge_passes, **common)
    if isinstance(config, SplitConfig):
        return ChunkVariant(block_k=kp, prepare_warps=config.prepare_warps, dot_precision=config.dot_precision,
                            output_pass=True, stored_keys=True, output_block_v=config.output_block_v,
                            output_warps=config.output_warps, tma=config.tma, key_group=config.key_group,
                            state_stride=config.state_stride, **common)
    raise TypeError(f"variant: unknown config {type(config).__name__}")


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
    p = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    return fwd_checked(p, q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                       l2norm=l2norm, cu_seqlens=cu_seqlens, mode=mode, chunk_size=chunk_size, variant=variant)


def fwd_checked(p: Problem, q, k, v, g, beta, *, initial_state, output_final_state: bool, l2norm: bool,
                cu_seqlens, mode: str, chunk_size: int | None, variant: KernelConfig | None):
    """:func:`running_tensor_fwd` after its argument checks. Invariant: ``p`` is what
    ``check_inputs`` returned for these very tensors, and ``mode``/``chunk_size`` passed the
    public checks. Layout and config are checked here."""
    kernel = "chunk" if mode == "chunk" else "recurrent"
    config = resolve_config(kernel, variant, p, v.device, chunk_size if kernel == "chunk" else None)
    return triton_fwd.fwd_checked(p, q, k, v, g, beta, initial_state=initial_state,
                                  output_final_state=output_final_state, l2norm=l2norm, cu_seqlens=cu_seqlens,
                                  mode=mode, chunk_size=None, variant=_legacy(config, kernel_shape(p)))


def running_tensor_decode_(q, k, v, g=None, beta=None, *, state_cache: torch.Tensor, state_indices: torch.Tensor,
                           scale: float | None = None, l2norm: bool = False, validate: bool = True,
                           variant: RecurrentConfig | None = None) -> torch.Tensor:
    """One decode step for N sequences, updating ``state_cache`` in place (see
    ``triton_fwd.running_tensor_decode_`` for the contract)."""
    legacy = None
    if variant is not None:
        check_config(variant, "recurrent")
        legacy = RecurrentVariant(**dataclasses.asdict(variant))
    return triton_fwd.running_tensor_decode_(q, k, v, g, beta, state_cache=state_cache, state_indices=state_indices,
                                             scale=scale, l2norm=l2norm, validate=validate, variant=legacy)
