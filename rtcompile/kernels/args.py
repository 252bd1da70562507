"""What every launcher needs besides its own kernel: the allocation hook, the products' operand
type, and the pointer and width arguments of up to three key factors (orders 2 to 4).

Every output and workspace is allocated through :func:`empty`, so tests can poison them (fill
with NaN) and prove that every element a kernel should write is written.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Sequence

import torch

from .config import next_pow2

MAX_FACTORS = 3  # orders 2..4
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

empty = torch.empty
# The decode output, once per token: empty_like(v) took 1.4 us against 4.3 for
# empty(v.shape, dtype=, device=) on the CPU machine, where the eager call's budget is 30 us.
empty_like = torch.empty_like


def _nan_filled(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan")) if t.is_floating_point() else t


@contextlib.contextmanager
def poisoned() -> Iterator[None]:
    """Within: every output and workspace the launchers allocate starts as NaN (floating types),
    so an element a kernel should write and does not fails the comparison that follows. The
    tuner's correctness gate runs each config's checked call so: without it an unwritten element
    could hold the previous trial's correct value, which the caching allocator hands back in the
    same block. Not thread-safe (it swaps this module's two hooks)."""
    global empty, empty_like
    saved = empty, empty_like
    empty = lambda *a, **kw: _nan_filled(torch.empty(*a, **kw))  # noqa: E731
    empty_like = lambda x, **kw: _nan_filled(torch.empty_like(x, **kw))  # noqa: E731
    try:
        yield
    finally:
        empty, empty_like = saved


def interpreting() -> bool:
    """Are the kernels running under the Triton interpreter (TRITON_INTERPRET=1)?"""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def lowp_dots(dtype: torch.dtype) -> bool:
    """Take tl.dot operands in 16 bits? Not bf16 under the interpreter (it returns garbage there)."""
    if dtype == torch.float16:
        return True
    return dtype == torch.bfloat16 and not interpreting()


def dot_dtype(v: torch.Tensor) -> torch.dtype:
    """The type the products take operands in and 16-bit workspaces are kept in (its size is
    ``config.dot_operand_bytes``, for the checks and the cost model)."""
    return v.dtype if lowp_dots(v.dtype) else torch.float32


def factor_args(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Three factor pointers; missing ones repeat the first (never read: NF is a constexpr)."""
    return list(xs) + [xs[0]] * (MAX_FACTORS - len(xs))


def width_args(widths: tuple[int, ...], min_block: int) -> dict[str, int]:
    """D1..D3 (missing axes: 1) and their tiles BD1..BD3 (a power of two >= ``min_block``)."""
    ws = list(widths) + [1] * (MAX_FACTORS - len(widths))
    out = {f"D{i + 1}": w for i, w in enumerate(ws)}
    out.update({f"BD{i + 1}": max(min_block, next_pow2(w)) for i, w in enumerate(ws)})
    return out


def contiguous_inputs(q: Sequence[torch.Tensor], k: Sequence[torch.Tensor], *rest: torch.Tensor | None) -> tuple:
    """``(q, k, *rest)`` as the kernels address them: contiguous, copying only the views that
    are not (a contiguous tensor passes through as itself; None stays None).

    Why copy instead of passing strides: every kernel addresses a per-token tensor by its
    token-head row alone (``r = (b T + t) H + h``, see ``blocks``), which keeps stride arguments
    out of kernels already near their constexpr and register limits. A model's slices of a fused
    projection (``qkv[..., :D]``) are strided, so they are copied here, once per call at the
    launch boundary, after validation: the copy moves twice the input's bytes (o3 16x16 B8
    T4096 H8 bf16: 2 x 8 MiB per factor, ~3.5 us at the H200's 4.8 TB/s against 3.53 ms for the
    measured forward and backward), and the copy is read by every kernel of the call."""
    return ([x.contiguous() for x in q], [x.contiguous() for x in k],
            *(None if x is None else x.contiguous() for x in rest))


def all_contiguous(*xs: torch.Tensor | None) -> bool:
    """Are all of ``xs`` (None entries skipped) contiguous, so no copy is needed?"""
    return all(x is None or x.is_contiguous() for x in xs)
