"""Repeated launches of a Triton kernel without Triton's per-call binding: ``cached(kernel)[grid](...)``.

``kernel[grid](*args, **constexprs)`` binds and specialises every argument on every call
(Triton 3.6: one native specialisation per argument, the cache-key lookup, the launch-metadata
and global-value checks), ~30-90 us of host time per launch on the H200 machine with these
kernels' 20-30 arguments. An eager split-form prefill makes three launches a part: at B1 T4096
it spent 524 us of host time enqueueing 163 us of kernels, at B8 532 against 345 (host-bound;
2026-12-04). The compiled kernel's own launcher takes the arguments as they are: an eager o3
16x16 split call at B1 T256 (one part, three launches) took 427-462 us of host time against
499-570 through Triton's launch, a resident one at B8 T4096 (two launches) 341-361 against
342-409 (same process, three alternating rounds, results bit-equal; a slow host that day).

A launch is recognised by everything Triton specialises on, read more finely than Triton reads
it: the grid, the constexprs and options, and per argument None, a tensor's dtype, device and
16-byte alignment, an integer's ``== 1``, ``% 16 == 0`` and width, a float, a bool's value, a
tensor descriptor's base (as a tensor), block shape, shape, strides and (Gluon's) shared
layout (Triton's runtime knobs,
debug and instrumentation, are not: a launch remembered before they change keeps its kernel,
until :func:`clear`). Invariant: a key maps to
the kernel Triton compiled for the first call with that key, and any two calls with one key get
the same compiled kernel from Triton (every property Triton specialises on is in the key). An
argument of another kind, the interpreter, or a kernel that did not come back compiled leaves
the call to Triton.
"""

from __future__ import annotations

import functools

import torch

from .args import interpreting

MAX_PLANS = 4096  # distinct launches remembered (cleared beyond: each costs one Triton launch to refill)
_PLANS: dict = {}


class _Uncached(Exception):
    """An argument whose specialisation the key does not describe: Triton launches it."""


def _spec(x):
    """What Triton could specialise ``x`` on, as a hashable value."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.dtype, x.get_device(), x.data_ptr() % 16 == 0
    if isinstance(x, bool):
        return "b", x
    if isinstance(x, int):
        return "i", x == 1, x % 16 == 0, -(2**31) <= x < 2**31, -(2**63) <= x < 2**63
    if isinstance(x, float):
        return "f"
    base = getattr(x, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(x, "block_shape"):  # Triton's and Gluon's descriptors
        # (Gluon's carry their shared layout, and on Triton 3.9 a mode and a tf32 rounding flag)
        return ("d", _spec(base), tuple(x.block_shape), tuple(x.shape), tuple(x.strides),
                getattr(x, "padding", None), getattr(x, "layout", None), getattr(x, "mode", None),
                getattr(x, "round_f32_to_tf32", None))
    raise _Uncached


def _launch(kernel, grid: tuple, *args, **kwargs):
    if interpreting():
        return kernel[grid](*args, **kwargs)
    try:
        key = (kernel, grid, tuple(kwargs.items()), tuple(map(_spec, args)))
        plan = _PLANS.get(key)
    except (_Uncached, TypeError):  # TypeError: an unhashable constexpr
        return kernel[grid](*args, **kwargs)
    if plan is not None:
        runner, tail = plan
        return runner(*args, *tail)
    compiled = kernel[grid](*args, **kwargs)
    names = kernel.arg_names[len(args):]
    if hasattr(compiled, "function") and all(n in kwargs for n in names):
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        # the compiled launcher takes every parameter in order: the constexprs follow the
        # runtime arguments (it skips their positions)
        _PLANS[key] = (compiled[(*grid, 1, 1)[:3]], tuple(kwargs[n] for n in names))
    return compiled


class cached:  # noqa: N801 -- used as kernel syntax: cached(kernel)[grid](...)
    """``cached(kernel)[grid](*args, **kwargs)``: ``kernel[grid](*args, **kwargs)``, through the
    compiled kernel's launcher when an earlier call had the same key (see the module)."""

    __slots__ = ("kernel",)

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid: tuple):
        return functools.partial(_launch, self.kernel, tuple(grid))


def clear() -> None:
    """Forget every remembered launch (tests; a changed Triton option)."""
    _PLANS.clear()
