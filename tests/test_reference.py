"""The float64 references: token loop == chunk form, Kronecker equivalence, containment."""

from __future__ import annotations

import math

import pytest
import torch

import rtcompile
from rtcompile.kernels import kron_features, l2normalize, running_tensor_chunk_ref, running_tensor_recurrent_ref

from conftest import make_inputs, rel_err

WIDTHS = {
    "o2-d5": (5,),
    "o2-d16": (16,),
    "o3-3x4": (3, 4),
    "o3-1x7": (1, 7),
    "o4-2x3x2": (2, 3, 2),
}
TOL = 1e-10


def _ids(flag, name):
    return [f"{name}" if f else f"no-{name}" for f in flag]


@pytest.mark.parametrize("widths", WIDTHS.values(), ids=WIDTHS.keys())
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "no-gate"])
@pytest.mark.parametrize("delta", [True, False], ids=["delta", "no-delta"])
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "raw"])
@pytest.mark.parametrize("state", [True, False], ids=["h0", "no-h0"])
def test_chunk_matches_token_loop(widths, gate, delta, l2norm, state):
    # T = 37 is not a multiple of either chunk; V = 6 is not a power of two.
    q, k, v, g, beta, s0 = make_inputs(2, 37, 3, widths, 6, gate=gate, delta=delta, state=state)
    kw = dict(initial_state=s0, output_final_state=True, l2norm=l2norm)
    o_ref, s_ref = running_tensor_recurrent_ref(q, k, v, g, beta, **kw)
    for C in (8, 16):
        o, s = running_tensor_chunk_ref(q, k, v, g, beta, chunk_size=C, **kw)
        assert o.shape == v.shape and s.shape == (2, 3, *widths, 6)
        assert rel_err(o, o_ref) < TOL
        assert rel_err(s, s_ref) < TOL


@pytest.mark.parametrize("widths", [(4,), (3, 2), (2, 2, 3)], ids=["o2", "o3", "o4"])
@pytest.mark.parametrize("T", [1, 5, 16])
def test_short_sequences(widths, T):
    q, k, v, g, beta, s0 = make_inputs(1, T, 2, widths, 3, state=True)
    kw = dict(initial_state=s0, output_final_state=True, l2norm=True)
    o_ref, s_ref = running_tensor_recurrent_ref(q, k, v, g, beta, **kw)
    o, s = running_tensor_chunk_ref(q, k, v, g, beta, chunk_size=16, **kw)
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL


@pytest.mark.parametrize("widths", [(5,), (3, 4), (2, 3, 2)], ids=["o2", "o3", "o4"])
@pytest.mark.parametrize("form", ["loop", "chunk"])
def test_varlen_equals_separate_sequences(widths, form):
    offsets = [0, 5, 6, 23, 30]  # uneven lengths, one of a single token
    N = len(offsets) - 1
    q, k, v, g, beta, s0 = make_inputs(1, offsets[-1], 2, widths, 3, state=True, num_seqs=N)
    cu = torch.tensor(offsets, dtype=torch.int32)
    fn = running_tensor_recurrent_ref if form == "loop" else lambda *a, **kw: running_tensor_chunk_ref(*a, chunk_size=4, **kw)
    o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, l2norm=True, cu_seqlens=cu)
    for n in range(N):
        lo, hi = offsets[n], offsets[n + 1]
        sl = lambda x: None if x is None else x[:, lo:hi]
        o_n, s_n = running_tensor_recurrent_ref(
            [sl(x) for x in q], [sl(x) for x in k], sl(v), sl(g), sl(beta),
            initial_state=s0[n : n + 1], output_final_state=True, l2norm=True,
        )
        assert rel_err(o[:, lo:hi], o_n) < TOL
        assert rel_err(s[n : n + 1], s_n) < TOL


def _matrix_gated_delta(q, k, v, g, beta, scale, s0):
    """Gated DeltaNet written as a K x V matrix recurrence (fla's naive convention), float64."""
    B, T, H, K = q.shape
    S = s0.clone()
    o = torch.zeros_like(v)
    for t in range(T):
        if g is not None:
            S = S * g[:, t].exp()[..., None, None]
        u = v[:, t]
        if beta is not None:
            u = beta[:, t, :, None] * (u - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        o[:, t] = scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t])
    return o, S


@pytest.mark.parametrize("widths", [(3, 4), (4, 1), (2, 3, 2)], ids=["o3-3x4", "o3-4x1", "o4-2x3x2"])
@pytest.mark.parametrize("delta", [True, False], ids=["delta", "no-delta"])
def test_kronecker_equivalence(widths, delta):
    """Order o == order 2 (matrix state) on the materialised Kronecker features phi."""
    q, k, v, g, beta, s0 = make_inputs(2, 19, 2, widths, 5, delta=delta, state=True)
    # l2norm of each factor == l2norm of phi only up to eps, so normalise outside for exactness.
    q = [l2normalize(x, 0.0) for x in q]
    k = [l2normalize(x, 0.0) for x in k]
    K = math.prod(widths)
    o, s = running_tensor_recurrent_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    phi_q, phi_k = kron_features(q), kron_features(k)
    s0_flat = s0.reshape(2, 2, K, 5)
    o2, s2 = running_tensor_recurrent_ref([phi_q], [phi_k], v, g, beta, initial_state=s0_flat, output_final_state=True)
    o3, s3 = _matrix_gated_delta(phi_q, phi_k, v, g, beta, K**-0.5, s0_flat)
    assert rel_err(o, o2) < TOL and rel_err(s.reshape(2, 2, K, 5), s2) < TOL
    assert rel_err(o, o3) < TOL and rel_err(s.reshape(2, 2, K, 5), s3) < TOL


def test_containment_order3_with_unit_axis_is_linear_attention():
    """The paper's Proposition 1: a second key axis of width 1 holding 1 is linear attention."""
    q, k, v, g, beta, _ = make_inputs(2, 23, 3, (6,), 4, gate=False, delta=False)
    ones = torch.ones(2, 23, 3, 1, dtype=torch.float64)
    o3, s3 = running_tensor_recurrent_ref([q[0], ones], [k[0], ones], v, output_final_state=True)
    # causal linear attention, written as the masked quadratic form
    scores = torch.einsum("bthd,bshd->bhts", q[0], k[0]).tril()
    expected = 6**-0.5 * torch.einsum("bhts,bshv->bthv", scores, v)
    assert rel_err(o3, expected) < TOL
    assert s3.shape == (2, 3, 6, 1, 4)


def test_hand_computed_values():
    # Order 2, d = V = 1, a = 0.5, b = 0.5, k = q = 1, v = (2, 4), S0 = 0:
    #   t0: S = 0.5 * (2 - 0) = 1              -> o = 1
    #   t1: aS = 0.5; S = 0.5 + 0.5 (4 - 0.5) = 2.25 -> o = 2.25
    one = torch.ones(1, 2, 1, 1, dtype=torch.float64)
    v = torch.tensor([2.0, 4.0], dtype=torch.float64).reshape(1, 2, 1, 1)
    g = torch.full((1, 2, 1), math.log(0.5), dtype=torch.float64)
    b = torch.full((1, 2, 1), 0.5, dtype=torch.float64)
    for fn in (running_tensor_recurrent_ref, running_tensor_chunk_ref):
        o, s = fn([one], [one], v, g, b, output_final_state=True)
        assert o.flatten().tolist() == pytest.approx([1.0, 2.25], abs=1e-14)
        assert s.flatten().tolist() == pytest.approx([2.25], abs=1e-14)
    # Order 3, no gate/delta: two values written at key slots (0,0) and (0,1); a query
    # (1) x (1, 1) reads their sum, scale 1.
    k1 = torch.ones(1, 2, 1, 1, dtype=torch.float64)
    k2 = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64).reshape(1, 2, 1, 2)
    q2 = torch.ones(1, 2, 1, 2, dtype=torch.float64)
    v = torch.tensor([3.0, 5.0], dtype=torch.float64).reshape(1, 2, 1, 1)
    o, s = running_tensor_recurrent_ref([k1, q2], [k1, k2], v, scale=1.0, output_final_state=True)
    assert o.flatten().tolist() == pytest.approx([3.0, 8.0], abs=1e-14)
    assert s.flatten().tolist() == pytest.approx([3.0, 5.0], abs=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_low_precision_inputs_follow_float64(dtype):
    q, k, v, g, beta, s0 = make_inputs(1, 21, 2, (4, 3), 4, state=True, dtype=dtype)
    up = lambda x: None if x is None else x.double()
    o, s = running_tensor_chunk_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True, l2norm=True, chunk_size=8)
    o64, s64 = running_tensor_recurrent_ref(
        [up(x) for x in q], [up(x) for x in k], up(v), up(g), up(beta),
        initial_state=s0, output_final_state=True, l2norm=True,
    )
    assert o.dtype == dtype and s.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(o, o64) < tol and rel_err(s, s64) < 1e-5


@pytest.mark.parametrize("mode", ["auto", "recurrent", "chunk"])
def test_public_api_modes_agree(mode):
    q, k, v, g, beta, s0 = make_inputs(2, 30, 2, (3, 2), 4, state=True)
    chunk = {} if mode == "recurrent" else dict(chunk_size=8)  # the scan refuses a chunk size
    o, s = rtcompile.running_tensor(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, l2norm=True, mode=mode, **chunk
    )
    o_ref, s_ref = running_tensor_recurrent_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True, l2norm=True)
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL
    o, s = rtcompile.running_tensor(q, k, v, g, beta, mode=mode)
    assert s is None and rel_err(o, running_tensor_recurrent_ref(q, k, v, g, beta)[0]) < TOL
