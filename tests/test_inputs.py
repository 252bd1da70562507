"""Bad arguments to running_tensor: clear ValueError/TypeError before any work."""

from __future__ import annotations

import re

import pytest
import torch

import rtcompile
from rtcompile.kernels import running_tensor_chunk_ref, running_tensor_recurrent_ref

from conftest import make_inputs


def _base():
    q, k, v, g, beta, s0 = make_inputs(1, 10, 2, (3, 4), 5, state=True, dtype=torch.float32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0)


def _with(**changes):
    a = _base()
    for key, fn in changes.items():
        a[key] = fn(a)
    return a


CASES = {
    "q-not-a-list": (TypeError, "q", lambda: _with(q=lambda a: a["q"][0])),
    "k-element-not-tensor": (TypeError, "k[1]", lambda: _with(k=lambda a: [a["k"][0], 3.0])),
    "factor-count-mismatch": (ValueError, "q and k", lambda: _with(k=lambda a: a["k"][:1])),
    "width-mismatch": (ValueError, "q[1] and k[1]", lambda: _with(k=lambda a: [a["k"][0], torch.randn(1, 10, 2, 5)])),
    "factor-wrong-T": (ValueError, "q[0]", lambda: _with(q=lambda a: [torch.randn(1, 9, 2, 3), a["q"][1]])),
    "factor-3d": (ValueError, "k[0]", lambda: _with(k=lambda a: [torch.randn(10, 2, 3), a["k"][1]])),
    "dtype-mismatch": (ValueError, "q[0]", lambda: _with(q=lambda a: [a["q"][0].half(), a["q"][1]])),
    "int-values": (ValueError, "v", lambda: _with(
        v=lambda a: torch.zeros(1, 10, 2, 5, dtype=torch.int32),
        q=lambda a: [x.int() for x in a["q"]], k=lambda a: [x.int() for x in a["k"]])),
    "v-3d": (ValueError, "v", lambda: _with(v=lambda a: a["v"][0])),
    "g-wrong-shape": (ValueError, "g", lambda: _with(g=lambda a: a["g"][..., None])),
    "beta-not-tensor": (TypeError, "beta", lambda: _with(beta=lambda a: 0.5)),
    "state-wrong-shape": (ValueError, "initial_state", lambda: _with(initial_state=lambda a: a["initial_state"][..., :4])),
}


@pytest.mark.parametrize("case", CASES.keys())
def test_bad_arguments(case):
    exc, field, build = CASES[case]
    args = build()
    for fn in (running_tensor_recurrent_ref, running_tensor_chunk_ref, rtcompile.running_tensor):
        with pytest.raises(exc, match="^" + re.escape(field)):
            fn(args["q"], args["k"], args["v"], args["g"], args["beta"],
               initial_state=args["initial_state"])


@pytest.mark.parametrize(
    "offsets, dtype, B, exc, needle",
    [
        ([0, 4, 4, 10], torch.int32, 1, ValueError, "strictly increasing"),
        ([0, 6, 3, 10], torch.int32, 1, ValueError, "strictly increasing"),
        ([0, 4, 9], torch.int32, 1, ValueError, "end at T"),
        ([1, 4, 10], torch.int32, 1, ValueError, "start at 0"),
        ([0, 4, 10], torch.float32, 1, TypeError, "int32"),
        ([0, 4, 10], torch.int32, 2, ValueError, "B = 1"),
        ([0, 4, 10], "meta", 1, ValueError, "same device"),
    ],
    ids=["empty-seq", "decreasing", "short", "offset-start", "float", "batch2", "other-device"],
)
def test_bad_cu_seqlens(offsets, dtype, B, exc, needle):
    q, k, v, g, beta, _ = make_inputs(B, 10, 2, (3,), 4, dtype=torch.float32)
    # "meta": offsets on another device, refused before they are read (reading a meta tensor fails)
    cu = torch.tensor(offsets, dtype=torch.int32, device="meta") if dtype == "meta" else torch.tensor(offsets, dtype=dtype)
    for backend in ("auto", "reference"):
        with pytest.raises(exc, match="cu_seqlens") as info:
            rtcompile.running_tensor(q, k, v, g, beta, cu_seqlens=cu, backend=backend)
        assert needle in str(info.value)


def test_a_chunk_longer_than_the_sequence_is_one_chunk():
    """The chunk reference with a chunk far longer than T (10^6) computes one chunk of T (it
    padded to the chunk: a [T, 10^6]-sized allocation) and equals the token loop."""
    q, k, v, g, beta, s0 = make_inputs(1, 10, 2, (3, 2), 4, state=True, dtype=torch.float64)
    want = running_tensor_recurrent_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    got = running_tensor_chunk_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=10**6)
    assert torch.allclose(got[0], want[0], atol=1e-12) and torch.allclose(got[1], want[1], atol=1e-12)


def test_varlen_state_count():
    q, k, v, g, beta, _ = make_inputs(1, 10, 2, (3,), 4, dtype=torch.float32)
    s0 = torch.zeros(1, 2, 3, 4)  # three sequences need N = 3 states
    with pytest.raises(ValueError, match=r"initial_state: expected shape .*\[3, 2, 3, 4\]"):
        rtcompile.running_tensor(q, k, v, initial_state=s0, cu_seqlens=torch.tensor([0, 2, 5, 10], dtype=torch.int32))


@pytest.mark.parametrize(
    "kwargs, exc, needle",
    [
        (dict(mode="fast"), ValueError, "mode"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(chunk_size=8.0), TypeError, "chunk_size"),
        (dict(scale=-1.0), ValueError, "scale"),
        (dict(scale="big"), TypeError, "scale"),
        (dict(l2norm="yes"), TypeError, "l2norm: expected a bool, got str"),
        (dict(output_final_state=1), TypeError, "output_final_state: expected a bool, got int"),
        (dict(plan="h200"), TypeError, "plan: expected a rtcompile.plan.Plan or None, got str"),
    ],
    ids=["mode", "chunk0", "chunk-float", "scale-neg", "scale-str", "l2norm-str", "final-state-int", "plan-str"],
)
def test_bad_options(kwargs, exc, needle):
    q, k, v, g, beta, _ = make_inputs(1, 10, 2, (3,), 4, dtype=torch.float32)
    with pytest.raises(exc, match=needle):
        rtcompile.running_tensor(q, k, v, g, beta, **kwargs)
