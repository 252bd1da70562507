"""The eager fast path of the public ``running_tensor`` (a model's decode step or prefill through
the public API, issue 21): a call whose signature an earlier validated call had runs that call's
plan (``kernels/launch.py``'s ``CallPlan``) without re-validating; anything else takes the full
path. Interpreter (or a GPU), tiny shapes, outputs poisoned."""

from __future__ import annotations

import os

import pytest
import torch

import rtcompile.functional as functional
from rtcompile import running_tensor
from rtcompile.kernels import tuned
from rtcompile.kernels.launch import CALL_PLANS
from rtcompile.kernels.reference import running_tensor_recurrent_ref

from conftest import make_inputs, rel_err

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU",
)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = 2e-5  # fp32 kernels vs float64 (observed ~1e-6)


@pytest.fixture(autouse=True)
def fresh(poison, monkeypatch):
    """An empty plan cache, poisoned outputs, and a count of full validations."""
    saved = dict(CALL_PLANS)
    CALL_PLANS.clear()
    checks = []
    real = functional.check_inputs
    monkeypatch.setattr(functional, "check_inputs", lambda *a: checks.append(1) or real(*a))
    yield checks
    CALL_PLANS.clear()
    CALL_PLANS.update(saved)


def _steps(T=3, B=2, H=2, widths=(3, 4), V=5, **kw):
    """Per-token device inputs (contiguous [B, 1, H, .] slices) and the float64 originals."""
    q, k, v, g, beta, s0 = make_inputs(B, T, H, widths, V, dtype=torch.float64, state=True, **kw)
    dev = lambda x, t: None if x is None else x[:, t : t + 1].float().contiguous().to(DEVICE)
    steps = [([dev(x, t) for x in q], [dev(x, t) for x in k], dev(v, t), dev(g, t), dev(beta, t)) for t in range(T)]
    return steps, (q, k, v, g, beta), s0


def _cut(x):
    """Round to fp32 and back, as the device inputs are."""
    return None if x is None else x.float().double()


@pytest.mark.parametrize("feat", ["gated-delta-l2", "plain"])
def test_token_steps_reuse_one_plan_and_equal_the_float64_loop(feat, fresh):
    """Three T = 1 calls, each from the previous final state: the first validates and keeps a
    plan, the next two run it (no validation), and the outputs and final state equal the float64
    recurrence over the three tokens."""
    gated = feat != "plain"
    steps, ref, s0 = _steps(gate=gated, delta=gated)
    state = s0.float().to(DEVICE)
    for t, (q, k, v, g, beta) in enumerate(steps):
        o, state = running_tensor(q, k, v, g, beta, initial_state=state, output_final_state=True, l2norm=gated,
                                  mode="recurrent", backend="triton")
        o_ref, _ = running_tensor_recurrent_ref(
            [_cut(x[:, : t + 1]) for x in ref[0]], [_cut(x[:, : t + 1]) for x in ref[1]], _cut(ref[2][:, : t + 1]),
            None if ref[3] is None else ref[3][:, : t + 1].float().double(), _cut(None if ref[4] is None else ref[4][:, : t + 1]),
            initial_state=_cut(s0), output_final_state=True, l2norm=gated)
        assert rel_err(o.cpu(), o_ref[:, t : t + 1]) < TOL, f"step {t}"
    _, s_ref = running_tensor_recurrent_ref([_cut(x) for x in ref[0]], [_cut(x) for x in ref[1]], _cut(ref[2]),
                                            None if ref[3] is None else ref[3].float().double(), _cut(ref[4]),
                                            initial_state=_cut(s0), output_final_state=True, l2norm=gated)
    assert rel_err(state.cpu(), s_ref) < TOL
    assert len(fresh) == 1 and len(CALL_PLANS) == 1, (len(fresh), len(CALL_PLANS))


def test_a_call_without_final_state_or_initial_state_keeps_plans_of_its_own(fresh):
    (q, k, v, g, beta), *_ = _steps(T=1)[0]
    o1, s1 = running_tensor(q, k, v, g, beta, output_final_state=True, mode="recurrent", backend="triton")
    o2, s2 = running_tensor(q, k, v, g, beta, mode="recurrent", backend="triton")
    o3, s3 = running_tensor(q, k, v, g, beta, mode="recurrent", backend="triton")
    assert s2 is None and s3 is None and s1 is not None
    assert torch.equal(o1, o2) and torch.equal(o2, o3)
    assert len(fresh) == 2 and len(CALL_PLANS) == 2


def test_a_changed_signature_is_validated_again(fresh):
    """A wrong shape after a plan exists is still refused with the field named; a new dtype or
    flag gets its own plan."""
    (q, k, v, g, beta), *_ = _steps(T=1)[0]
    running_tensor(q, k, v, g, beta, mode="recurrent", backend="triton")
    with pytest.raises(ValueError, match="^g: expected shape"):
        running_tensor(q, k, v, g[:1], beta, mode="recurrent", backend="triton")
    running_tensor(q, k, v, g, beta, l2norm=True, mode="recurrent", backend="triton")
    assert len(CALL_PLANS) == 2 and len(fresh) == 3


@pytest.mark.parametrize("bad", [
    dict(l2norm="false"), dict(l2norm=0), dict(l2norm=1), dict(output_final_state=None),
    dict(output_final_state="yes"), dict(chunk_size=64.0), dict(scale=True),
], ids=lambda d: "-".join(f"{k}={v!r}" for k, v in d.items()))
def test_a_planned_signature_still_refuses_arguments_of_the_wrong_type(bad, fresh):
    """After a valid call made a plan, an argument that compares or hashes equal to the planned
    one but has the wrong type (``0`` for False, ``64.0`` for 64, ``True`` for a scale of 1)
    takes the full checks and is refused there, as in a fresh process: a plan never serves it."""
    (q, k, v, g, beta), *_ = _steps(T=1)[0]
    field, value = next(iter(bad.items()))
    # a plan for the value the bad one equals: l2norm True for 1 and "false", False for 0, ...
    planned = dict(l2norm=False, output_final_state=False, scale=1)
    mode = "recurrent"
    if field == "chunk_size":  # a chunk call's (the scan refuses any chunk size)
        planned, mode = planned | dict(chunk_size=64), "chunk"
    planned[field] = bool(value) if field in ("l2norm", "output_final_state") else planned[field]
    running_tensor(q, k, v, g, beta, mode=mode, backend="triton", **planned)
    assert len(CALL_PLANS) == 1
    with pytest.raises(TypeError, match=f"^{field}: expected"):
        running_tensor(q, k, v, g, beta, mode=mode, backend="triton", **(planned | bad))


@pytest.mark.parametrize("bad", ["false", 0, 1], ids=repr)
def test_a_planned_decode_signature_still_refuses_a_flag_that_is_not_a_bool(bad):
    """As above for ``running_tensor_decode_``'s ``l2norm``."""
    from rtcompile import running_tensor_decode_

    (q, k, v, g, beta), *_ = _steps(T=1, B=2)[0]
    cache = torch.zeros(3, 2, 3, 4, 5, device=DEVICE)
    idx = torch.tensor([2, 0], device=DEVICE)
    running_tensor_decode_(q, k, v, g, beta, state_cache=cache, state_indices=idx, l2norm=bool(bad))
    before = cache.clone()
    with pytest.raises(TypeError, match="^l2norm: expected a bool"):
        running_tensor_decode_(q, k, v, g, beta, state_cache=cache, state_indices=idx, l2norm=bad)
    assert torch.equal(cache, before)


def test_inputs_that_require_grad_take_the_autograd_path(fresh):
    """backend "auto": a call that needs grad takes the autograd path (the custom op, its
    backward on materialised keys at widths 3x4), never the plan."""
    (q, k, v, g, beta), *_ = _steps(T=1)[0]
    o, _ = running_tensor(q, k, v, g, beta, mode="recurrent")
    assert o.grad_fn is None and len(CALL_PLANS) == 1
    v = v.clone().requires_grad_()
    o, _ = running_tensor(q, k, v, g, beta, mode="recurrent")
    assert o.grad_fn is not None
    with torch.no_grad():  # grad mode off: the plan serves again
        o, _ = running_tensor(q, k, v, g, beta, mode="recurrent")
    assert o.grad_fn is None and len(fresh) == 2


def test_a_reread_tuned_table_retires_the_plans(fresh, tuning_cache):
    (q, k, v, g, beta), *_ = _steps(T=1)[0]
    running_tensor(q, k, v, g, beta, mode="recurrent", backend="triton")
    running_tensor(q, k, v, g, beta, mode="recurrent", backend="triton")
    assert len(fresh) == 1
    tuned.reload()  # a new table may pick another config: the next call resolves it again
    running_tensor(q, k, v, g, beta, mode="recurrent", backend="triton")
    assert len(fresh) == 2


def test_strided_slices_of_a_fused_projection_equal_contiguous_inputs(fresh):
    """Inputs that are views into one [B, 1, H, 3 + 4 + 3 + 4 + 5] tensor (as a model's fused
    projection gives them): the plan copies them before each launch."""
    B, H, widths, V = 2, 2, (3, 4), 5
    fused = torch.randn(B, 1, H, 2 * sum(widths) + V, device=DEVICE)
    cuts = torch.split(fused, [*widths, *widths, V], dim=-1)
    q, k, v = list(cuts[:2]), list(cuts[2:4]), cuts[4]
    assert not v.is_contiguous()
    g = -torch.rand(B, 1, H, device=DEVICE)
    want, _ = running_tensor([x.contiguous() for x in q], [x.contiguous() for x in k], v.contiguous(), g,
                             mode="recurrent", backend="triton")
    for _ in range(2):
        got, _ = running_tensor(q, k, v, g, mode="recurrent", backend="triton")
        assert torch.equal(got, want)
    assert len(CALL_PLANS) == 2 and len(fresh) == 2


@pytest.mark.parametrize("mode", ["chunk", "auto"])
def test_chunk_calls_keep_plans_too(fresh, mode):
    """A prefill (T 37 in chunks of 16, a partial last one; "auto" picks the chunk form there):
    the first call validates and keeps a plan, the next two run it; every output and final
    state equals the float64 recurrence."""
    q, k, v, g, beta, s0 = make_inputs(2, 37, 2, (4, 4), 8, dtype=torch.float64, state=True)
    d = lambda x: x.float().to(DEVICE)  # noqa: E731
    want_o, want_s = running_tensor_recurrent_ref([_cut(x) for x in q], [_cut(x) for x in k], _cut(v), _cut(g),
                                                  _cut(beta), initial_state=_cut(s0), output_final_state=True,
                                                  l2norm=True)
    for _ in range(3):
        o, s = running_tensor([d(x) for x in q], [d(x) for x in k], d(v), d(g), d(beta), initial_state=d(s0),
                              output_final_state=True, l2norm=True, mode=mode, chunk_size=16, backend="triton")
        assert rel_err(o.cpu(), want_o) < TOL and rel_err(s.cpu(), want_s) < TOL
    assert len(fresh) == 1 and len(CALL_PLANS) == 1


# ----- the plan caches' key-free recognition (decode_plan.PlanCache) ---------------------------


def _signature(device=DEVICE):
    """A decode-like call's tensors: factors, values, gate, a fp32 cache and int32 indices."""
    q = [torch.randn(2, 1, 3, w, device=device) for w in (4, 8)]
    return (*q, torch.randn(2, 1, 3, 5, device=device), -torch.rand(2, 1, 3, device=device), None,
            torch.zeros(4, 3, 4, 8, 5, device=device), torch.arange(2, dtype=torch.int32, device=device))


CHANGES = {
    "shape": lambda ts, i: torch.randn(3, *ts[i].shape[1:], device=ts[i].device),
    "dtype": lambda ts, i: ts[i].to(torch.float16),
    "strides": lambda ts, i: torch.randn(*ts[i].shape[:-1], 2 * ts[i].shape[-1], device=ts[i].device)[..., ::2],
    "requires-grad": lambda ts, i: ts[i].detach().clone().requires_grad_(),
    "subclass": lambda ts, i: torch.nn.Parameter(ts[i].clone(), requires_grad=False),
    "not-a-tensor": lambda ts, i: ts[i].tolist(),
}


def test_a_noted_signature_is_recognised_without_a_key():
    """The same head and tensors of the same metadata (fresh values, another storage) find the
    noted plan; another head does not."""
    from rtcompile.kernels.decode_plan import _TensorGuards, PlanCache

    if _TensorGuards is None:
        pytest.skip("this torch has no TensorGuards: the keys serve alone")
    cache, plan = PlanCache(), object()
    cache.note(("head", 1), _signature(), plan)
    assert cache.recent(("head", 1), _signature()) is plan
    assert cache.recent(("head", 2), _signature()) is None
    cache.clear()
    assert cache.recent(("head", 1), _signature()) is None


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("which", [0, 2, 5], ids=["factor", "values", "cache"])
def test_a_changed_tensor_is_not_recognised(change, which):
    """Any change a signature key would see (shape, dtype, strides, hence contiguity) or that
    would need autograd (requires_grad), or a tensor that is not a plain one: no plan."""
    from rtcompile.kernels.decode_plan import _TensorGuards, PlanCache

    if _TensorGuards is None:
        pytest.skip("this torch has no TensorGuards: the keys serve alone")
    cache = PlanCache()
    cache.note("h", _signature(), object())
    ts = list(_signature())
    ts[which] = CHANGES[change](ts, which)
    assert cache.recent("h", ts) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device kind")
def test_another_device_is_not_recognised():
    from rtcompile.kernels.decode_plan import PlanCache

    cache = PlanCache()
    cache.note("h", _signature("cuda"), object())
    assert cache.recent("h", _signature("cpu")) is None


def test_a_call_that_requires_grad_is_never_noted():
    from rtcompile.kernels.decode_plan import PlanCache

    cache, ts = PlanCache(), list(_signature())
    ts[2] = ts[2].clone().requires_grad_()
    cache.note("h", ts, object())
    assert cache.recent("h", ts) is None


def test_calls_run_by_key_alone_without_tensor_guards(fresh, monkeypatch):
    """A torch without TensorGuards: plans are still found by key (one validation for three
    calls) and the outputs equal the guarded path's."""
    import rtcompile.kernels.decode_plan as decode_plan

    (q, k, v, g, beta), *_ = _steps(T=1)[0]
    want, _ = running_tensor(q, k, v, g, beta, mode="recurrent", backend="triton")
    CALL_PLANS.clear()
    monkeypatch.setattr(decode_plan, "_TensorGuards", None)
    outs = [running_tensor(q, k, v, g, beta, mode="recurrent", backend="triton")[0] for _ in range(3)]
    assert all(torch.equal(o, want) for o in outs)
    assert len(fresh) == 2 and CALL_PLANS._recent == []


def test_alternating_signatures_each_keep_their_plan(fresh, monkeypatch):
    """Two layers of different widths called in turn (as a model's decode step): each call runs
    its own signature's plan and equals a fresh validated call; from the third round on (with
    TensorGuards) no call builds a key."""
    import rtcompile.kernels.launch as launch
    from rtcompile.kernels.decode_plan import _TensorGuards

    layers = [_steps(T=1, widths=w)[0][0] for w in ((3, 4), (2, 5))]
    want = [running_tensor(*x, mode="recurrent", backend="triton")[0] for x in layers]
    keys = []
    real = launch.call_key
    monkeypatch.setattr(launch, "call_key", lambda head, tensors: keys.append(1) or real(head, tensors))
    for _ in range(3):
        keys.clear()
        for x, w in zip(layers, want):
            assert torch.equal(running_tensor(*x, mode="recurrent", backend="triton")[0], w)
    assert len(fresh) == 2 and len(CALL_PLANS) == 2
    assert len(keys) == (0 if _TensorGuards is not None else 2)


def test_a_head_that_cannot_be_compared_is_no_match():
    """A scale passed as a multi-element tensor makes == on the head ambiguous: no plan (the
    full checks then say what is wrong), never an exception from the cache."""
    from rtcompile.kernels.decode_plan import _TensorGuards, PlanCache

    if _TensorGuards is None:
        pytest.skip("this torch has no TensorGuards: the keys serve alone")
    cache, ts = PlanCache(), _signature()
    cache.note(("h", 0.5), ts, object())
    assert cache.recent(("h", torch.tensor([0.5, 0.5])), ts) is None
