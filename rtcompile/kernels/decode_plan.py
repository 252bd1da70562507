"""The eager T = 1 calls' host path: the launch plans of the decode step and of the public
API's recurrent calls, their caches, and the decode step's index checks.

Decode is called once per token with the same shapes, and its kernel runs for a few
microseconds: the host path is the cost. A plan cache keyed by a signature of the arguments
skips re-validation (fla's wrapper spends 110-130 us per step in Python); the plan then
launches the compiled kernel through torch's or Triton's launcher (``static_launch.py``).
"""

from __future__ import annotations

import functools
import operator

import torch
from triton.compiler import CompiledKernel

from . import args
from .recurrent import fused_recurrent_running_tensor_fwd_kernel
from .static_launch import static_launcher


class DecodePlan:
    """A validated launch of the recurrent kernel: grid, constexprs, the scalar arguments and,
    after the first launch on a GPU, the compiled kernel's launchers.

    Triton's ``kernel[grid](...)`` binds and specialises all ~30 arguments on every call; with
    it the eager decode step cost 65 us of host time on the H200 machine. The compiled kernel's
    launchers skip that work, and are reused only while the specialisation it was compiled for
    holds: the scalar arguments (scale, T = 1, the cache's slots) are fixed
    by the plan (its key holds every shape), the None inputs (no gate, no delta rule, no
    cu_seqlens) are part of the plan's key, and every pointer must be 16-byte aligned, as at
    the first launch (checked per call; an unaligned call takes Triton's full path).
    """

    __slots__ = ("_runner", "_static", "_tail", "consts", "copy", "grid", "scalars")

    def __init__(self, grid: tuple, consts: dict, scalars: tuple, *, copy: bool = False):
        # scalars: the kernel's scale, T and num_slots. copy: some input is a
        # strided view, to be made contiguous before each launch (the plan's key holds each
        # input's contiguity, so a plan serves calls of one layout only)
        self.grid, self.consts, self.scalars, self.copy = grid, consts, scalars, copy
        self._runner = None
        self._static = None
        self._tail: tuple = ()

    def launch(self, tensors: tuple) -> None:
        """Launch with the kernel's tensor arguments (tensors or None, in its order)."""
        ptrs = [None if t is None else t.data_ptr() for t in tensors]
        # 0.8 us against 1.1 for any() on the CPU machine; filter drops the None inputs
        aligned = not functools.reduce(operator.or_, filter(None, ptrs)) & 15
        if aligned:
            # raw addresses: a launcher then skips a data_ptr() call (and, on older Tritons, a
            # driver pointer query) per tensor; Triton's compiled launcher alone cost 19 us per
            # call with tensors on the H200 machine, 8.9 with addresses, torch's 5.2 in the same
            # process (static_launch.py; benchmarks/serving_host.py times these paths). A None
            # input's position is a constexpr of the compiled kernel: the launchers skip it.
            if self._static is not None:
                self._static((*ptrs, *self.scalars))
                return
            if self._runner is not None:
                self._runner(*ptrs, *self.scalars, *self._tail)
                return
        kernel = fused_recurrent_running_tensor_fwd_kernel
        kargs = (*tensors, *self.scalars)
        compiled = kernel[self.grid](*kargs, **self.consts)
        if self._runner is None and aligned and isinstance(compiled, CompiledKernel) and not args.interpreting():
            # the launcher takes every parameter: the constexprs follow the runtime ones
            self._tail = tuple(self.consts[name] for name in kernel.arg_names[len(kargs):])
            self._runner = compiled[(*self.grid, 1, 1)[:3]]
            device = next(t for t in tensors if isinstance(t, torch.Tensor)).get_device()
            self._static = static_launcher(compiled, self.grid, len(kargs), device)


try:  # torch's C++ check of tensor metadata, of which dynamo's guards are made
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # another torch: the keys alone serve (PlanCache.recent then finds nothing)
    _TensorGuards = None

RECENT_PLANS = 4  # signatures recognised without a key: a model's layers share one per step


class PlanCache(dict):
    """Launch plans by :func:`signature_key`, the latest few also recognised without a key.

    Building a key costs ~10 us of a T = 1 call's host time on the CPU machine (four attribute
    reads of each of nine tensors, then hashing). :meth:`recent` recognises the signatures of
    the last :data:`RECENT_PLANS` calls whose key found a plan: the call's plain arguments
    (``head``, compared with ==) and one C++ check of its tensors' metadata (torch's
    ``TensorGuards``: type, dispatch keys, dtype, device, sizes, strides, requires_grad), 1.3 us
    for nine tensors. Invariant: :meth:`recent` returns a plan only for a call whose head
    equals, and whose tensors have the metadata of, a call that :meth:`note` saw find that plan by
    key, so everything the key holds (shapes, dtypes, devices, contiguity) is the same; a
    call with any tensor that requires grad is never noted (autograd must see it)."""

    def __init__(self, limit: int = 1024):
        super().__init__()
        self.limit = limit
        self._recent: list = []  # (head, check, plan), latest first

    def recent(self, head, tensors):
        """The plan of a noted call with this head and these tensors' metadata, or None."""
        for h, check, plan in self._recent:
            try:  # == on a head holding a tensor (a scale given as one) may raise: then no match
                if h == head and check(*[x for x in tensors if x is not None]):
                    return plan
            except (TypeError, RuntimeError):  # another number of tensors, or the above
                pass
        return None

    def note(self, head, tensors, plan) -> None:
        """``plan`` was found by the key of a call with ``head`` and ``tensors``: recognise the
        call's signature by :meth:`recent` from now on (a no-op without ``TensorGuards``)."""
        present = [x for x in tensors if x is not None]
        if _TensorGuards is None or any(x.requires_grad for x in present):
            return
        try:
            check = _TensorGuards(*present, dynamic_dims_sizes=[list(x.shape) for x in present],
                                  dynamic_dims_strides=[list(x.stride()) for x in present]).check
        except (TypeError, RuntimeError):  # a tensor the check cannot describe: keys serve it
            return
        self._recent = [(head, check, plan), *self._recent[: RECENT_PLANS - 1]]

    def remember(self, key, plan) -> None:
        if key is not None:
            if len(self) >= self.limit:
                self.clear()
            self[key] = plan

    def clear(self) -> None:
        super().clear()
        self._recent = []


DECODE_PLANS = PlanCache()  # signature_key(launch.decode_head(...), tensors) -> DecodePlan


def signature_key(head, tensors, *, exact: bool = False) -> tuple | None:
    """A plan cache's key: ``head`` then (shape, dtype, device index, contiguity) of each tensor
    that is not None, in one flat tuple (the device as ``get_device()``: 5.5 us on the CPU
    machine for 11 tensors against 12 us with per-tensor tuples of ``torch.device``). None when
    an entry is not a tensor (with ``exact``: not a plain ``torch.Tensor``, as tracers hand in)
    or the key is unhashable: the full checks then say why, or run every call."""
    try:
        out = list(head)
        for x in tensors:
            if x is not None:
                if exact and type(x) is not torch.Tensor:
                    return None
                # get_device() is -1 for every device but CUDA's: a meta tensor took a CPU call's plan
                out += (x.shape, x.dtype, x.get_device() if x.is_cuda else x.device.type, x.is_contiguous())
        key = tuple(out)
        hash(key)
        return key
    except (AttributeError, TypeError):
        return None


def check_indices(state_indices: torch.Tensor, slots: int) -> None:
    """In range and distinct (negative entries are padding); reads the indices (one device sync)."""
    idx = state_indices.tolist()
    bad = [i for i in idx if i >= slots]
    if bad:
        raise ValueError(f"state_indices: {bad[0]} out of range; allowed: 0 <= index < slots = {slots}, or < 0 for padding")
    used = [i for i in idx if i >= 0]
    if len(set(used)) != len(used):
        raise ValueError("state_indices: repeated slot; allowed: distinct slots (each sequence owns its state)")
