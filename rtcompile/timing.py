"""Timing a call: median seconds after warm-up, with CUDA events on a GPU (the device's own
clock, no host sync inside the timed region) and the wall clock elsewhere.

:func:`median_seconds` brackets each eager call, so a short call's host time (Python, the
allocator, Triton's launcher) is in it. :func:`graph_replay_seconds` captures calls in one CUDA
graph and times the replays: the device time of the work alone, what a graph-captured
deployment pays. :func:`kernel_seconds` takes the graph where capture works, else the eager
median, and says which; :func:`as_replayed` gives a call's result as that graph computes it (what
a check of the timed work must see).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence


def median_seconds(fn: Callable[[], Any], device: str = "cuda", repeats: int = 10, warmup: int = 1) -> float:
    import torch

    for _ in range(warmup):
        fn()
    cuda = str(device).startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _warm_up(calls: Sequence[Callable[[], Any]]) -> None:
    """Run each call once on a side stream, as torch.cuda.graphs asks before a capture, so lazy
    initialisation (cuBLAS workspaces, Triton module loads) happens outside it."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _settle_after_failed_capture() -> None:
    import torch

    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 -- a failed capture can leave an error behind
        pass


def as_replayed(fn: Callable[[], Any], device: str = "cuda") -> Any:
    """``fn()``'s result as a replay of it captured in a CUDA graph computes it, what
    :func:`kernel_seconds` times (a call may launch other kernels while captured: the split
    form's pipelined parts run only then); the eager result off CUDA or where capture fails.
    The result's tensors are copies of the graph's outputs after its one replay."""
    if not str(device).startswith("cuda"):
        return fn()
    import torch
    from torch.utils._pytree import tree_map

    _warm_up([fn])
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = fn()
    except Exception:  # noqa: BLE001 -- capture failed: the eager call is what gets timed then
        _settle_after_failed_capture()
        return fn()
    graph.replay()
    copy = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, out)
    torch.cuda.synchronize()
    return copy


def graph_replay_seconds(calls: Sequence[Callable[[], Any]], n_calls: int, repeats: int) -> float:
    """Median seconds per call of ``n_calls`` calls (cycling ``calls``) captured in one CUDA
    graph, over ``repeats`` timed replays. The caller has warmed the calls up (compiled them).
    Raises whatever capture raises (a host sync inside a call, say)."""
    import torch

    _warm_up(calls)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_calls):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    per_call = statistics.median(start.elapsed_time(end) / 1e3 / n_calls for start, end in events)
    del graph
    return per_call


# One replay of about 5 ms makes the events' own cost (a few us) negligible; 4 to 64 calls
# per graph keep capture short for multi-ms calls and memory bounded for tiny ones.
GRAPH_TARGET_S = 5e-3
GRAPH_CALLS = (4, 64)


def kernel_seconds(fn: Callable[[], Any], device: str = "cuda", repeats: int = 10) -> tuple[float, str]:
    """(median seconds per call, method). On a GPU: graph replays of the call (device time, no
    host time), sized from one eager estimate; if capture fails, the eager median and why.
    Elsewhere: the wall-clock median. The caller has run ``fn`` once (compiled it)."""
    if not str(device).startswith("cuda"):
        return median_seconds(fn, device, repeats, warmup=0), "wall"
    est = median_seconds(fn, device, repeats=3, warmup=0)
    n = min(GRAPH_CALLS[1], max(GRAPH_CALLS[0], math.ceil(GRAPH_TARGET_S / max(est, 1e-7))))
    try:
        return graph_replay_seconds([fn], n, repeats), f"graph x{n}"
    except Exception as exc:  # noqa: BLE001 -- capture failed: time eagerly, say why
        _settle_after_failed_capture()
        first = str(exc).splitlines()[0] if str(exc) else ""
        return median_seconds(fn, device, repeats, warmup=0), f"eager (capture failed: {type(exc).__name__}: {first[:80]})"
