"""Validation of ``running_tensor`` arguments, shared by the references and the kernels.

Every check runs before any work or allocation. Wrong Python types raise ``TypeError``; wrong
shapes, dtypes, devices or values raise ``ValueError``. Messages name the argument and what is
allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..fields import dtype_error

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The chunk forms take each log decay g_t as max(g_t, LOG_DECAY_FLOOR) before the within-chunk
# cumulative sum c, so a closed gate (g = -inf: forget everything before this token) or a huge
# one (-1e10, -1e30) stays usable. exp(-104) = 6.8e-46 is below half fp32's smallest subnormal
# (7.0e-46), so it rounds to 0 and a floored gate forgets exactly as g = -inf does in the
# recurrent form; and |c| stays below 128 with one such gate in a chunk (C * 104 with all of
# them), so fp32 keeps c to 2^-17 instead of -inf - -inf = NaN, or a 1e10 term absorbing every
# other (g = -1e10 gave an error of 0.17 on outputs of at most 0.10).
LOG_DECAY_FLOOR = -104.0


@dataclass(frozen=True)
class Problem:
    """The shape of one ``running_tensor`` call, after validation.

    ``batch`` is B of the inputs; ``num_seqs`` is the number of sequences (B, or
    ``len(cu_seqlens) - 1`` for variable-length input with B = 1). ``seq_bounds`` holds the
    ``(start, end)`` token offsets of each sequence when ``cu_seqlens`` is given.
    """

    batch: int
    seq_len: int
    heads: int
    key_widths: tuple[int, ...]
    value_width: int
    num_seqs: int
    seq_bounds: tuple[tuple[int, int], ...] | None
    scale: float
    dtype: torch.dtype
    device: torch.device

    @property
    def order(self) -> int:
        return len(self.key_widths) + 1

    @property
    def key_dim(self) -> int:
        return math.prod(self.key_widths)

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.num_seqs, self.heads, *self.key_widths, self.value_width)


def _tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def _float(name: str, x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise dtype_error(name, x.dtype, "float16, bfloat16, float32, float64")


def _factors(name: str, xs: object) -> list[torch.Tensor]:
    # lists and tuples first: the abstract Sequence check runs abc's machinery, the largest
    # share of this function in a profile of T = 1 calls (host time paid every decode step)
    if type(xs) not in (list, tuple) and (isinstance(xs, torch.Tensor) or not isinstance(xs, Sequence)):
        raise TypeError(
            f"{name}: expected a list or tuple of o-1 factor tensors [B, T, H, d_i], got {type(xs).__name__}"
        )
    if len(xs) == 0:
        raise ValueError(f"{name}: got no factors; allowed: o-1 >= 1 tensors [B, T, H, d_i]")
    return [_tensor(f"{name}[{i}]", x) for i, x in enumerate(xs)]


def check_inputs(
    q: Sequence[torch.Tensor],
    k: Sequence[torch.Tensor],
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    scale: float | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> Problem:
    """Validate the arguments of ``running_tensor`` and return the problem's shape."""
    qs, ks = _factors("q", q), _factors("k", k)
    v = _tensor("v", v)
    if len(qs) != len(ks):
        raise ValueError(f"q and k: got {len(qs)} query and {len(ks)} key factors; allowed: the same number (o-1)")
    if v.dim() != 4:
        raise ValueError(f"v: expected shape [B, T, H, d_v], got {tuple(v.shape)}")
    B, T, H, V = v.shape
    if T < 1 or H < 1 or V < 1 or B < 1:
        raise ValueError(f"v: every dimension of [B, T, H, d_v] must be >= 1, got {tuple(v.shape)}")
    _float("v", v)
    widths = []
    dtype, device = v.dtype, v.device
    for i, (qi, ki) in enumerate(zip(qs, ks)):
        for name, x in ((f"q[{i}]", qi), (f"k[{i}]", ki)):
            shape = x.shape
            if len(shape) != 4 or shape[0] != B or shape[1] != T or shape[2] != H or shape[3] < 1:
                raise ValueError(
                    f"{name}: expected shape [B, T, H, d_{i + 1}] = [{B}, {T}, {H}, d] (B, T, H of v), got {tuple(shape)}"
                )
            if x.dtype != dtype:
                raise dtype_error(name, x.dtype, f"{dtype}, v's (all inputs one dtype)")
            if x.device != device:
                raise ValueError(f"{name}: on {x.device}, v on {device}; allowed: all inputs on one device")
        if qi.shape[3] != ki.shape[3]:
            raise ValueError(f"q[{i}] and k[{i}]: widths {qi.shape[3]} and {ki.shape[3]} differ; allowed: equal widths")
        widths.append(int(qi.shape[3]))
    for name, x in (("g", g), ("beta", beta)):
        if x is None:
            continue
        _tensor(name, x)
        if tuple(x.shape) != (B, T, H):
            raise ValueError(f"{name}: expected shape [B, T, H] = [{B}, {T}, {H}], got {tuple(x.shape)}")
        _float(name, x)
        if x.device != v.device:
            raise ValueError(f"{name}: on {x.device}, v on {v.device}; allowed: all inputs on one device")
    if scale is None:
        scale = math.prod(widths) ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float, got {type(scale).__name__}")
    elif not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: got {scale}; allowed: a finite number > 0, or None for prod(d_i)**-0.5")
    bounds = None
    num_seqs = B
    if cu_seqlens is not None:
        _tensor("cu_seqlens", cu_seqlens)
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise dtype_error("cu_seqlens", cu_seqlens.dtype, "torch.int32 (or int64)")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens: expected a 1-D tensor of N+1 >= 2 offsets, got shape {tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"cu_seqlens: given with B = {B}; allowed: B = 1 (sequences packed along T)")
        if cu_seqlens.device != v.device:  # before reading it: a meta or remote tensor fails in tolist
            raise ValueError(f"cu_seqlens: on {cu_seqlens.device}, v on {v.device}; allowed: the same device")
        offs = [int(x) for x in cu_seqlens.tolist()]
        if offs[0] != 0 or offs[-1] != T:
            raise ValueError(f"cu_seqlens: must start at 0 and end at T = {T}, got {offs[0]} ... {offs[-1]}")
        if any(b <= a for a, b in zip(offs, offs[1:])):
            raise ValueError("cu_seqlens: offsets must be strictly increasing (every sequence has >= 1 token)")
        bounds = tuple(zip(offs[:-1], offs[1:]))
        num_seqs = len(bounds)
    problem = Problem(B, T, H, tuple(widths), V, num_seqs, bounds, float(scale), v.dtype, v.device)
    if initial_state is not None:
        _tensor("initial_state", initial_state)
        if tuple(initial_state.shape) != problem.state_shape:
            raise ValueError(
                f"initial_state: expected shape [N, H, d_1, ..., d_{{o-1}}, d_v] = {list(problem.state_shape)}, "
                f"got {list(initial_state.shape)}"
            )
        _float("initial_state", initial_state)
        if initial_state.device != v.device:
            raise ValueError(f"initial_state: on {initial_state.device}, v on {v.device}; allowed: all on one device")
    return problem


def random_inputs(batch: int, seq_len: int, heads: int, key_widths: Sequence[int], value_width: int,
                  dtype: str | torch.dtype, device, seed: int, *, draw_on: str = "cpu"):
    """Seeded random ``(q, k, v, g, beta, generator)`` for tests, tuning trials and benchmarks.

    Factors and values ~ N(0, 1) in ``dtype``; ``g = logsigmoid(N(0, 1))`` <= 0 in fp32 (fla's
    log-decay convention); ``beta = sigmoid(N(0, 1))`` in ``dtype``. Everything is drawn in fp32
    and then cast, so the fp32 and bf16 problems of one seed share their draws. ``draw_on="cpu"``
    draws on the CPU and moves the tensors (the same values on every machine: the tuner checks
    every trial of a study on one seed); ``"device"`` draws on ``device`` (fast for benchmark
    sizes; values differ between CPU and GPU). The generator is returned for further draws
    (state caches, slot permutations) in a fixed order after these."""
    if draw_on not in ("cpu", "device"):
        raise ValueError(f"draw_on={draw_on!r}; allowed: 'cpu', 'device'")
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    where = "cpu" if draw_on == "cpu" else device
    gen = torch.Generator(device=where).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=where, dtype=torch.float32)

    B, T, H = batch, seq_len, heads
    q = [randn(B, T, H, w).to(device=device, dtype=dt) for w in key_widths]
    k = [randn(B, T, H, w).to(device=device, dtype=dt) for w in key_widths]
    v = randn(B, T, H, value_width).to(device=device, dtype=dt)
    g = torch.nn.functional.logsigmoid(randn(B, T, H)).to(device)
    beta = torch.sigmoid(randn(B, T, H)).to(device=device, dtype=dt)
    return q, k, v, g, beta, gen


# mode "auto"'s chunk length when the caller names none (rtcompile.running_tensor's default)
AUTO_CHUNK = 64


def auto_mode(seq_len: int, chunk_size: int | None = None) -> str:
    """Mode "auto" without a plan: chunk for sequences of at least one chunk (``chunk_size``,
    default :data:`AUTO_CHUNK`), else recurrent. Until the planner measures the crossover: a
    sequence shorter than one chunk gains nothing from the chunk form."""
    return "chunk" if seq_len >= (chunk_size or AUTO_CHUNK) else "recurrent"


def nearest_bucket(buckets, batch: int, seq_len: int):
    """The entry of ``buckets`` (each with ``batch`` and ``seq_len`` attributes or keys) nearest
    to (batch, seq_len) in log distance, the first of equals: how a plan's decision is found
    for a shape, by the plan and, at run time, by the custom op."""
    get = (lambda b, n: b[n]) if buckets and isinstance(buckets[0], dict) else getattr
    dist = lambda b: (abs(math.log2(get(b, "batch")) - math.log2(max(1, batch)))
                      + abs(math.log2(get(b, "seq_len")) - math.log2(max(1, seq_len))))
    return min(buckets, key=dist)
