"""Pipelined parts: a chunk form's chunk-parallel kernels run beside its sequential state loop.

The split form's state loop keeps one program per (sequence, head, value block) busy for the
whole sequence: 128 programs at B8 H8 with 32 value columns, one an SM, each walking its chunks
in order (o3 16x16 on the H200: 2.13 us a chunk, the latency of its chain of dependent products
with their shared-memory staging and 19 barriers a chunk; not its loads: the inverse in 16 bits,
13% fewer bytes a chunk, took 3% off), while the prepare kernel before it and the output kernel
after it are chunk-parallel. Cut the sequence into parts of whole chunks and the prepare
kernel of part j + 1 and the output kernel of part j - 1 can run while the loop walks part j:
each kernel is launched once per part, the prepare kernels on one side stream, the loops on a
high-priority one (when SM slots free up, a waiting loop program goes first), the output kernels
on a third, ordered by events. The state crosses parts through the final-state buffer. Parts
run in CUDA-graph captures only (:func:`parts_pay`): an eager call is host-bound.

Without CUDA (the CPU interpreter) the parts run in order on the one stream: the same launches
and the same numbers, so the interpreter tests cover the parts' bounds.
"""

from __future__ import annotations

from typing import Callable

import torch

PIPELINE_PARTS = (1, 2, 4, 8)
# A part walks at least this many chunks: each part costs three launches (their host time in an
# eager call, a loop that restarts its loads), which a part of a few chunks cannot win back. Not
# a measured optimum: the parts were timed at T 4096 only (32-64 chunks a part, H200 2026-12-04)
MIN_PART_CHUNKS = 8

_STREAMS: dict[int, tuple] = {}  # device index -> (prepare, loop, output) streams, made on first use
_EVENTS: dict[int, list] = {}  # device index -> events reused by every call (see run_parts)


def part_bounds(n_chunks: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """Up to ``parts`` ranges [c0, c1) of chunk numbers covering 0..n_chunks, each boundary a
    multiple of ``unit`` (the split form's ``state_stride``: a window of chunks never spans two
    parts), as even as the units allow, none empty and none under :data:`MIN_PART_CHUNKS`
    chunks unless there is one part (fewer parts when there are fewer chunks)."""
    units = -(-n_chunks // unit)
    parts = max(1, min(parts, units, n_chunks // max(1, MIN_PART_CHUNKS)))
    cuts = [min(n_chunks, (units * j // parts) * unit) for j in range(parts + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b]


def parts_pay(device: torch.device) -> bool:
    """Whether a call on ``device`` runs its config's pipelined parts: while a CUDA graph is
    being captured (a replay pays for kernels only), and off CUDA (the interpreter, whose tests
    cover the parts' bounds). An eager CUDA call runs one part: it is host-bound, and each part
    adds three launches and its stream orderings. H200 machine, default configs, eager per call
    with parts against one part (the same process, 2026-12-04): o3 16x16 B1 T1024 458 -> 259 us
    (kernels 59), B8 T4096 450 -> 362 (343), o2 64 B8 T4096 834 -> 442 (269); the one loss, o2
    256 at B8 T4096, whose kernels outlast the parts' host time: 674 -> 716 (656 in a graph)."""
    return device.type != "cuda" or torch.cuda.is_current_stream_capturing()


def side_streams(device: torch.device) -> tuple | None:
    """The (prepare, loop, output) streams of a CUDA device, made on first use (the loop's with
    the highest priority); None off CUDA or under the interpreter."""
    from .args import interpreting

    if device.type != "cuda" or interpreting():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _, high = torch.cuda.Stream.priority_range()  # (least, greatest): greater is a lower number
        _STREAMS[index] = (torch.cuda.Stream(index), torch.cuda.Stream(index, priority=high),
                           torch.cuda.Stream(index))
    return _STREAMS[index]


def run_parts(bounds: list[tuple[int, int]], prepare: Callable[[int, int], None],
              loop: Callable[[int, int, int], None], outputs: Callable[[int, int], None],
              device: torch.device, loop_inputs: Callable[[], None] | None = None) -> None:
    """Run ``prepare(c0, c1)``, ``loop(j, c0, c1)`` and ``outputs(c0, c1)`` for each part j of
    ``bounds``, after ``loop_inputs()`` (work that only the loops read, for the whole sequence).
    Invariant: loop j starts after prepare j, loop j - 1 and ``loop_inputs`` have finished,
    outputs j after loop j, and the caller's stream continues only after every launch here (so
    the tensors the launches use, allocated on it before the call, are not reused early). With
    side streams ``loop_inputs`` runs on the output stream, idle until the first loop ends,
    beside the first prepare kernel. One part, or no side streams: every launch in order on the
    current stream, ``loop_inputs`` first."""
    streams = side_streams(device) if len(bounds) > 1 else None
    if streams is None:
        if loop_inputs is not None:
            loop_inputs()
        for j, (c0, c1) in enumerate(bounds):
            prepare(c0, c1)
            loop(j, c0, c1)
            outputs(c0, c1)
        return
    # Stream switches by set_stream and orderings by events made once: with a stream context and
    # wait_stream (a new event each) per launch, two parts cost 134-191 us of host time with
    # no-op launches on the H200 machine, 53 us this way (2026-12-04, same process). An event is
    # re-recorded only after the waits on its last record were enqueued, and a wait orders
    # against the record before it, so reuse cannot reorder a later call.
    main = torch.cuda.current_stream(device)
    s_prep, s_loop, s_out = streams
    events = _events(main.device_index, 2 * len(bounds) + 3)
    events[0].record(main)
    for s in streams:
        s.wait_event(events[0])
    try:
        if loop_inputs is not None:
            torch.cuda.set_stream(s_out)
            loop_inputs()
            _order(events[-2], s_out, s_loop)
        for j, (c0, c1) in enumerate(bounds):
            torch.cuda.set_stream(s_prep)
            prepare(c0, c1)
            _order(events[2 * j + 1], s_prep, s_loop)
            torch.cuda.set_stream(s_loop)
            loop(j, c0, c1)
            _order(events[2 * j + 2], s_loop, s_out)
            torch.cuda.set_stream(s_out)
            outputs(c0, c1)
    finally:
        torch.cuda.set_stream(main)
    _order(events[-1], s_out, main)


def _order(event, before, after) -> None:
    """Work enqueued on ``after`` from now on waits for the work enqueued on ``before`` so far."""
    event.record(before)
    after.wait_event(event)


def _events(index: int, n: int) -> list:
    """At least ``n`` events of device ``index``, made once and reused by every call."""
    made = _EVENTS.setdefault(index, [])
    while len(made) < n:
        made.append(torch.cuda.Event())
    return made
