"""``running_tensor_decode_(..., validate=False)`` (for CUDA graphs, where the index check's
device sync is not allowed) with slot indices outside the cache: the kernel itself writes
nothing outside the cache, whatever the indices (issue 20: an index past the cache wrote into
the tensor after it in memory). The cache is a view into a larger buffer with guard rows
before and after it; every guard byte must stay unchanged."""

from __future__ import annotations

import os

import pytest
import torch

from rtcompile import running_tensor_decode_
from rtcompile.kernels import running_tensor_recurrent_ref

from conftest import make_inputs, rel_err

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not CUDA,
                                reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU")
SLOTS, GUARD, H, V = 4, 3, 2, 5
# past the end (the next rows, further on), far past it, and negative (padding)
BAD = {"next-row": [SLOTS, 2, -1], "rows-after": [SLOTS + 1, SLOTS + 2, 0], "far": [2**31 - 1, SLOTS * 100, 3],
       "negative": [-2, -(2**31), 1]}


def guarded_cache(widths):
    """(buffer, cache): the cache is rows GUARD .. GUARD + SLOTS of a random buffer."""
    buf = torch.randn(GUARD + SLOTS + GUARD, H, *widths, V, dtype=torch.float32, device=DEVICE)
    return buf, buf[GUARD:GUARD + SLOTS]


def step_inputs(widths, n):
    q, k, v, g, beta, _ = make_inputs(n, 1, H, widths, V, dtype=torch.float32)
    dev = lambda x: x.to(DEVICE)
    return [dev(x) for x in q], [dev(x) for x in k], dev(v), dev(g), dev(beta)


def assert_only_valid_slots_written(buf, before, idx):
    """Guard rows bit-identical; cache rows not named by a valid index bit-identical; valid ones changed."""
    buf, before = buf.cpu(), before.cpu()
    assert torch.equal(buf[:GUARD], before[:GUARD]), "the guard before the cache was written"
    assert torch.equal(buf[GUARD + SLOTS:], before[GUARD + SLOTS:]), "the guard after the cache was written"
    valid = {i for i in idx if 0 <= i < SLOTS}
    for slot in range(SLOTS):
        row = GUARD + slot
        assert torch.equal(buf[row], before[row]) == (slot not in valid), f"slot {slot}"


@pytest.mark.parametrize("widths", [(5,), (3, 4), (2, 2, 4)], ids=["o2", "o3", "o4"])
@pytest.mark.parametrize("bad", BAD.keys())
def test_unchecked_indices_never_write_outside_the_cache(bad, widths, poison):
    """The output (poisoned: conftest's ``poison``) and the valid slots' new states also equal
    one float64 step of the recurrent reference from the slots' old states."""
    idx = BAD[bad]
    buf, cache = guarded_cache(widths)
    before = buf.clone()
    inputs = step_inputs(widths, len(idx))
    o = running_tensor_decode_(*inputs, state_cache=cache,
                               state_indices=torch.tensor(idx, dtype=torch.int32, device=DEVICE), validate=False)
    assert o.shape == (len(idx), 1, H, V)
    assert_only_valid_slots_written(buf, before, idx)
    rows = [j for j, i in enumerate(idx) if 0 <= i < SLOTS]  # the sequences with a slot
    assert rows
    q, k, v, g, beta = inputs
    pick = lambda x: x[rows].double().cpu()  # noqa: E731
    s0 = before[[GUARD + idx[j] for j in rows]].double().cpu()
    o_ref, s_ref = running_tensor_recurrent_ref([pick(x) for x in q], [pick(x) for x in k], pick(v), pick(g),
                                                pick(beta), initial_state=s0, output_final_state=True)
    # fp32 kernel against float64: one step (observed ~1e-7)
    assert rel_err(o[rows].cpu(), o_ref) < 1e-5, rel_err(o[rows].cpu(), o_ref)
    got = buf.cpu()[[GUARD + idx[j] for j in rows]]
    assert rel_err(got, s_ref) < 1e-5, rel_err(got, s_ref)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs: on the GPU")
@pytest.mark.parametrize("widths", [(8,), (4, 4)], ids=["o2", "o3"])
def test_unchecked_indices_inside_a_cuda_graph(widths):
    """Captured once with valid indices, replayed with indices past the cache copied into the
    graph's static index tensor (how a serving engine drives it)."""
    buf, cache = guarded_cache(widths)
    inputs = step_inputs(widths, 3)
    idx = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph: compile, plan
        running_tensor_decode_(*inputs, state_cache=cache, state_indices=idx, validate=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        running_tensor_decode_(*inputs, state_cache=cache, state_indices=idx, validate=False)
    for bad in BAD.values():
        idx.copy_(torch.tensor(bad, dtype=torch.int32))
        before = buf.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert_only_valid_slots_written(buf, before, bad)
