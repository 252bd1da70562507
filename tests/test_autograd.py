"""Autograd through ``rtcompile::running_tensor_fwd`` (issue 19, item 2: the plumbing).

Every test takes the ``bwd`` fixture: the real ``rtcompile.kernels.chunk_backward`` when it
imports, else a STAND-IN module whose ``running_tensor_bwd`` is float64 autograd through the
recurrent reference and whose ``supports`` accepts everything. ``RTCOMPILE_BWD_STANDIN=1``
forces the stand-in (to test the plumbing alone). Tests that only make sense with the stand-in
(they script ``supports``' answer) say so in their names (``standin``). With the stand-in, the
gradient comparisons check the plumbing: every gradient reaches its leaf, in order, with its
shape and dtype, from the custom op (counted), never from the reference's autograd.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import math
import os
import sys
import types

import pytest
import torch

import rtcompile
from rtcompile import functional
from rtcompile.kernels import launch, running_tensor_recurrent_ref
from rtcompile.kernels.chunk_resident import ResidentConfig
from rtcompile.kernels.decode_plan import PlanCache
from rtcompile.kernels.ops import running_tensor_bwd_op, running_tensor_fwd_op
from rtcompile.kernels.recurrent import RecurrentConfig

from conftest import make_inputs, rel_err

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU",
)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
MODULE = "rtcompile.kernels.chunk_backward"
CHUNK16 = ResidentConfig(chunk_size=16, block_v=16)  # K <= 16: one 16-row tile


def variant(mode: str, widths=(16,)):
    """The config each mode's tests pin: for the recurrent scan, key tiles of half of K, so the
    state streams through the final-state buffer in two tiles (block_k 8 at K = 256 streamed 32
    tiles and took 52 s a forward in the interpreter, against 2.7 s at 128)."""
    if mode == "chunk":
        return CHUNK16
    return RecurrentConfig(block_k=max(8, math.prod(widths) // 2), block_v=8, num_warps=2)


def standin_bwd(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, l2norm, do, dht, chunk_size=None,
                variant=None):
    """STAND-IN for chunk_backward.running_tensor_bwd: float64 autograd through the recurrent
    reference, run on a worker thread: inside a custom op's kernel the autograd dispatch keys
    are excluded (thread-local), so tensors made on the calling thread record no graph."""
    xs = [*q, *k, v, g, beta, initial_state]
    n = len(q)

    def grads():
        d = [None if x is None else x.detach().double().requires_grad_() for x in xs]
        o, ht = running_tensor_recurrent_ref(d[:n], d[n:2 * n], d[2 * n], d[2 * n + 1], d[2 * n + 2],
                                             scale=scale, initial_state=d[2 * n + 3], output_final_state=True,
                                             l2norm=l2norm, cu_seqlens=cu_seqlens)
        loss = (o * do.double()).sum() + ((ht * dht.double()).sum() if dht is not None else 0.0)
        leaves = [x for x in d if x is not None]
        got = iter(torch.autograd.grad(loss, leaves, allow_unused=True))
        return [None if x is None else next(got) for x in d]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        out = pool.submit(grads).result()
    out = [None if x is None else (gr if gr is not None else torch.zeros_like(x)).to(x.dtype)
           for gr, x in zip(out, xs)]
    return out[:n], out[n:2 * n], out[2 * n], out[2 * n + 1], out[2 * n + 2], out[2 * n + 3]


def _real_module():
    if os.environ.get("RTCOMPILE_BWD_STANDIN") == "1":
        return None
    try:
        return importlib.import_module(MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != MODULE:
            raise
        return None


@pytest.fixture
def bwd(monkeypatch):
    """The backward module under test (real, or the stand-in), with its calls counted:
    ``bwd.calls["bwd"]`` backward kernels, ``bwd.calls["fwd"]`` forward launches."""
    real = _real_module()
    if real is None:
        mod = types.ModuleType(MODULE)
        mod.running_tensor_bwd = standin_bwd
        mod.supports = lambda p, cu_seqlens: None
        monkeypatch.setitem(sys.modules, MODULE, mod)
        monkeypatch.setattr(rtcompile.kernels, "chunk_backward", mod, raising=False)
    else:
        mod = real
    calls = {"bwd": 0, "fwd": 0}
    inner_bwd, inner_fwd = mod.running_tensor_bwd, launch.running_tensor_fwd

    def counted_bwd(*a, **kw):
        calls["bwd"] += 1
        return inner_bwd(*a, **kw)

    def counted_fwd(*a, **kw):
        calls["fwd"] += 1
        return inner_fwd(*a, **kw)

    monkeypatch.setattr(mod, "running_tensor_bwd", counted_bwd)
    monkeypatch.setattr(launch, "running_tensor_fwd", counted_fwd)

    # a gradient silently produced by the reference's autograd fails the test
    def no_reference(*a, **kw):
        raise AssertionError("the PyTorch reference ran where the Triton path was expected")

    monkeypatch.setattr(functional, "running_tensor_chunk_ref", no_reference)
    monkeypatch.setattr(functional, "running_tensor_recurrent_ref", no_reference)
    return types.SimpleNamespace(module=mod, standin=real is None, calls=calls)


@pytest.fixture(autouse=True)
def poison_outputs(poison):
    """Every output and workspace the launchers allocate starts as NaN (conftest's ``poison``)."""


def _tol(bwd) -> float:
    # stand-in: fp64 gradients cast to fp32 (exact up to the fp32 forward's rounding);
    # real kernels: fp32 accumulation over T <= 40 tokens: the largest error of any leaf over 85
    # fresh-seed comparisons (5 runs of this file's gradient tests) was 2.7e-5 (the next 7e-6),
    # so ~10x that (test_backward.py holds the same kernels to 1e-4)
    return 1e-5 if bwd.standin else 3e-4


def _leaves(B=1, T=20, H=2, widths=(16,), V=16, *, gate=True, delta=True, state=True, num_seqs=None, seed=None):
    q, k, v, g, beta, s0 = make_inputs(B, T, H, widths, V, gate=gate, delta=delta, state=state, num_seqs=num_seqs,
                                       dtype=torch.float32, seed=seed)
    leaf = lambda x: None if x is None else x.to(DEVICE).float().requires_grad_()
    return [leaf(x) for x in q], [leaf(x) for x in k], leaf(v), leaf(g), leaf(beta), leaf(s0)


def _flat(q, k, v, g, beta, s0):
    return [x for x in (*q, *k, v, g, beta, s0) if x is not None]


def _reference_grads(q, k, v, g, beta, s0, weights, *, l2norm, cu_seqlens=None, final_weight=None):
    """Leaf gradients of the loss sum(o * weights) (+ sum(final * final_weight)) by float64
    autograd through the recurrent reference."""
    d = lambda x: None if x is None else x.detach().double().requires_grad_()
    q64, k64, v64, g64, b64, s64 = [d(x) for x in q], [d(x) for x in k], d(v), d(g), d(beta), d(s0)
    o, ht = running_tensor_recurrent_ref(q64, k64, v64, g64, b64, initial_state=s64, output_final_state=True,
                                         l2norm=l2norm, cu_seqlens=cu_seqlens)
    loss = (o * weights.double()).sum()
    if final_weight is not None:
        loss = loss + (ht * final_weight.double()).sum()
    leaves = _flat(q64, k64, v64, g64, b64, s64)
    return torch.autograd.grad(loss, leaves, allow_unused=True)


def _check_grads(bwd, leaves, expected):
    for i, (x, ref) in enumerate(zip(leaves, expected)):
        assert x.grad is not None, f"leaf {i} got no gradient"
        assert x.grad.shape == x.shape and x.grad.dtype == x.dtype, f"leaf {i}: {x.grad.shape} {x.grad.dtype}"
        assert rel_err(x.grad, ref) < _tol(bwd), f"leaf {i}: rel err {rel_err(x.grad, ref):.2e}"


CASES = [  # (order widths, gate, delta, l2norm): shapes the Triton backward takes, so the same
    # cases run against the stand-in and the real kernels. 8x8 takes the materialised-keys form
    # (factors too narrow to tile): through the op its kernel runs with autograd's dispatch keys
    # excluded, which broke its autograd of phi on the H200 (MQAR training at 8x8, 2026-12-02)
    ((16,), True, True, True),
    ((8, 8), True, True, True),
    ((16,), False, False, False),
    ((16, 16), True, False, True),
    ((32,), False, True, False),
    ((16, 16), True, True, False),
]


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("widths, gate, delta, l2norm", CASES, ids=lambda x: str(x))
def test_every_gradient_reaches_its_leaf(bwd, mode, widths, gate, delta, l2norm):
    """Grads of every factor, v, g, beta, initial_state (through o and the final state) equal the
    float64 reference's autograd; one forward launch and one backward call, no reference."""
    q, k, v, g, beta, s0 = _leaves(T=20, widths=widths, gate=gate, delta=delta)
    o, ht = rtcompile.running_tensor(q, k, v, g, beta, initial_state=s0, output_final_state=True, l2norm=l2norm,
                                     mode=mode, backend="triton", variant=variant(mode, widths))
    assert o.grad_fn is not None and ht.grad_fn is not None
    w = torch.randn_like(o)
    wf = torch.randn_like(ht)
    ((o * w).sum() + (ht * wf).sum()).backward()
    # the real materialised-keys form (8x8) runs order 2's backward on phi: one nested call
    nested = int(not bwd.standin and len(widths) > 1 and min(widths) < 16)
    assert bwd.calls == {"fwd": 1, "bwd": 1 + nested}
    expected = _reference_grads(q, k, v, g, beta, s0, w, l2norm=l2norm, final_weight=wf)
    _check_grads(bwd, _flat(q, k, v, g, beta, s0), expected)


def test_loss_on_final_state_only(bwd):
    """A loss on the final state alone: gradients flow from it (o's gradient is zero)."""
    q, k, v, g, beta, s0 = _leaves()
    _, ht = rtcompile.running_tensor(q, k, v, g, beta, initial_state=s0, output_final_state=True, mode="chunk",
                                     backend="triton", variant=CHUNK16)
    wf = torch.randn_like(ht)
    (ht * wf).sum().backward()
    expected = _reference_grads(q, k, v, g, beta, s0, torch.zeros_like(v), l2norm=False, final_weight=wf)
    _check_grads(bwd, _flat(q, k, v, g, beta, s0), expected)
    assert s0.grad.abs().max() > 0 and v.grad.abs().max() > 0


def test_without_final_state(bwd):
    """output_final_state=False: the 0-element placeholder's gradient is ignored."""
    q, k, v, g, beta, s0 = _leaves(state=False)
    o, ht = rtcompile.running_tensor(q, k, v, g, beta, mode="chunk", backend="triton", variant=CHUNK16)
    assert ht is None
    w = torch.randn_like(o)
    (o * w).sum().backward()
    _check_grads(bwd, _flat(q, k, v, g, beta, None), _reference_grads(q, k, v, g, beta, None, w, l2norm=False))


def test_initial_state_only_leaf(bwd):
    """Only initial_state requires grad (the inputs are constants): its gradient still comes."""
    q, k, v, g, beta, s0 = _leaves()
    q, k, v, g, beta = [x.detach() for x in q], [x.detach() for x in k], v.detach(), g.detach(), beta.detach()
    o, _ = rtcompile.running_tensor(q, k, v, g, beta, initial_state=s0, mode="recurrent", backend="triton",
                                    variant=variant("recurrent"))
    w = torch.randn_like(o)
    (o * w).sum().backward()
    assert bwd.calls["bwd"] == 1
    _check_grads(bwd, [s0], _reference_grads(q, k, v, g, beta, s0, w, l2norm=False)[-1:])


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_varlen(bwd, mode):
    cu = torch.tensor([0, 7, 25, 40], dtype=torch.int32, device=DEVICE)
    q, k, v, g, beta, s0 = _leaves(T=40, num_seqs=3)
    o, ht = rtcompile.running_tensor(q, k, v, g, beta, initial_state=s0, output_final_state=True, l2norm=True,
                                     cu_seqlens=cu, mode=mode, backend="triton", variant=variant(mode))
    w, wf = torch.randn_like(o), torch.randn_like(ht)
    ((o * w).sum() + (ht * wf).sum()).backward()
    expected = _reference_grads(q, k, v, g, beta, s0, w, l2norm=True, cu_seqlens=cu, final_weight=wf)
    _check_grads(bwd, _flat(q, k, v, g, beta, s0), expected)


def test_auto_backend_takes_triton_when_the_backward_supports(bwd):
    q, k, v, g, beta, s0 = _leaves()
    o, _ = rtcompile.running_tensor(q, k, v, g, beta, initial_state=s0, mode="chunk", chunk_size=16)
    o.sum().backward()
    assert bwd.calls == {"fwd": 1, "bwd": 1}


def test_standin_auto_backend_falls_back_when_refused(bwd, monkeypatch):
    """STAND-IN scripted: supports refuses, so "auto" takes the reference (counted: no launch)."""
    monkeypatch.setattr(bwd.module, "supports", lambda p, cu: "order 3 is not supported by this backward")
    ran = []
    monkeypatch.setattr(functional, "running_tensor_chunk_ref", lambda *a, **kw: ran.append(1) or (a[2] * 1.0, None))
    q, k, v, g, beta, _ = _leaves(state=False)
    rtcompile.running_tensor(q, k, v, g, beta, mode="chunk", chunk_size=16)
    assert ran == [1] and bwd.calls["fwd"] == 0


def test_standin_triton_refused_problem_raises_naming_the_reason(bwd, monkeypatch):
    """STAND-IN scripted: "triton" + grad on a problem the backward cannot run is a ValueError
    with supports' reason, before any launch."""
    seen = []
    monkeypatch.setattr(bwd.module, "supports", lambda p, cu: seen.append((p, cu)) or "d_v 16 is refused here")
    q, k, v, g, beta, _ = _leaves(state=False)
    with pytest.raises(ValueError, match="d_v 16 is refused here"):
        rtcompile.running_tensor(q, k, v, g, beta, mode="chunk", backend="triton", variant=CHUNK16)
    assert bwd.calls["fwd"] == 0
    p, cu = seen[0]
    assert p.key_widths == (16,) and p.value_width == 16 and cu is None
    launches = []
    inner = launch.fwd_checked
    monkeypatch.setattr(launch, "fwd_checked", lambda *a, **kw: launches.append(1) or inner(*a, **kw))
    monkeypatch.setattr(launch, "CALL_PLANS", PlanCache())  # no plan from an earlier test
    with torch.no_grad():  # no grad: the backward's support does not matter
        rtcompile.running_tensor(q, k, v, g, beta, mode="chunk", backend="triton", variant=CHUNK16)
    assert launches == [1]


def test_absent_backward_module_is_a_clear_refusal(monkeypatch):
    """A build without chunk_backward: "triton" + grad names the absent module; "auto" falls
    back to the reference; no grad is untouched."""
    monkeypatch.setitem(sys.modules, MODULE, None)  # import now raises ModuleNotFoundError
    # every launch passes through fwd_checked but a repeated signature's, which its call plan
    # runs: no plans from earlier tests here
    monkeypatch.setattr(launch, "CALL_PLANS", PlanCache())
    launches = []
    inner = launch.fwd_checked
    monkeypatch.setattr(launch, "fwd_checked", lambda *a, **kw: launches.append(1) or inner(*a, **kw))
    q, k, v, g, beta, _ = _leaves(state=False)
    with pytest.raises(ValueError, match="chunk_backward is absent"):
        rtcompile.running_tensor(q, k, v, g, beta, mode="chunk", backend="triton", variant=CHUNK16)
    o, _ = rtcompile.running_tensor(q, k, v, g, beta, mode="chunk", chunk_size=16)
    assert o.grad_fn is not None and not launches  # the reference ran, differentiably
    with torch.no_grad():
        rtcompile.running_tensor(q, k, v, g, beta, mode="chunk", backend="triton", variant=CHUNK16)
    assert launches == [1]
    # the op called directly runs its forward; its backward names the absent module
    o, _ = running_tensor_fwd_op(q, k, v, g, beta, None, None, 0.3, False, False, "chunk", 0, "")
    with pytest.raises(NotImplementedError, match="no Triton backward .*chunk_backward is absent"):
        o.sum().backward()


def test_decode_step_with_grad_refused():
    v = torch.zeros(1, 1, 1, 4, device=DEVICE)
    with pytest.raises(ValueError, match="decode step has no backward"):
        functional.resolve_backend("triton", v, 3, True)
    assert functional.resolve_backend("auto", v, 3, True) == "reference"


MIXER = dict(widths=(16, 16), V=16)  # the two-factor problem of the tests below


def test_opcheck_bwd(bwd):
    q, k, v, g, beta, s0 = [x.detach() if isinstance(x, torch.Tensor) else [y.detach() for y in x]
                            for x in _leaves(**MIXER)]
    do = torch.randn_like(v)
    dht = torch.randn(1, 2, 16, 16, 16, device=DEVICE)
    for args in ((q, k, v, g, beta, s0, None, do, dht, 0.3, True, 16),
                 (q, k, v, None, None, None, None, do, None, 0.3, False, 0)):
        torch.library.opcheck(running_tensor_bwd_op, args,
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_opcheck_fwd_autograd_registration(bwd):
    q, k, v, g, beta, s0 = _leaves(**MIXER)
    torch.library.opcheck(running_tensor_fwd_op, (q, k, v, g, beta, s0, None, 0.3, True, True, "chunk", 0, ""),
                          test_utils=("test_autograd_registration",))


class _Mixer(torch.nn.Module):
    """A projection (parameters that require grad) in front of the mixer."""

    def __init__(self, mode, backend="triton"):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(16, 16, device=DEVICE)
        self.mode, self.backend = mode, backend

    def forward(self, q1, q2, k1, k2, v, g, beta, s0):
        o, s = rtcompile.running_tensor([q1, q2], [k1, k2], self.proj(v), g, beta, initial_state=s0,
                                        output_final_state=True, l2norm=True, mode=self.mode, backend=self.backend,
                                        variant=variant(self.mode, MIXER["widths"]) if self.backend == "triton" else None)
        return o * 2.0, s


def _grads_of(m, args):
    m.zero_grad()
    for a in args:
        a.grad = None
    o, s = m(*args)
    (o.square().sum() + s.sum()).backward()
    return [m.proj.weight.grad.clone(), *[a.grad.clone() for a in args]]


@pytest.mark.parametrize("mode, backend", [("chunk", "aot_eager"), ("recurrent", "aot_eager"), ("chunk", "inductor")])
def test_compile_fullgraph_trains(bwd, mode, backend):
    """torch.compile(fullgraph=True) (AOTAutograd; aot_eager, and inductor, which also runs on
    the CPU) traces the forward op and its backward op with no graph break; its gradients
    equal eager's."""
    q, k, v, g, beta, s0 = _leaves(**MIXER)
    args = (*q, *k, v, g, beta, s0)
    m = _Mixer(mode)
    eager = _grads_of(m, args)
    assert bwd.calls == {"fwd": 1, "bwd": 1}
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend=backend)
    got = _grads_of(compiled, args)
    assert bwd.calls == {"fwd": 2, "bwd": 2}
    for a, b in zip(eager, got):  # inductor fuses the projection and the loss: fp32 reassociation
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_compile_backward_graph_holds_the_bwd_op(bwd):
    """The joint graph AOTAutograd builds calls rtcompile::running_tensor_bwd (not a decomposition)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _):
        graphs.append(str(gm.graph))
        return make_boxed_func(gm.forward)

    q, k, v, g, beta, s0 = _leaves(**MIXER)
    torch._dynamo.reset()
    compiled = torch.compile(_Mixer("chunk"), fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    _grads_of(compiled, (*q, *k, v, g, beta, s0))
    assert len(graphs) == 2
    assert "running_tensor_fwd" in graphs[0] and "running_tensor_bwd" in graphs[1]


def test_export_in_grad_mode_records_the_op(bwd):
    """torch.export of a module whose parameters require grad, under grad mode, records the
    custom op (backend "auto": the backward supports the call), not the reference's ops."""
    q, k, v, g, beta, s0 = [x.detach() if isinstance(x, torch.Tensor) else [y.detach() for y in x]
                            for x in _leaves(**MIXER)]
    args = (*q, *k, v, g, beta, s0)
    m = _Mixer("chunk", backend="auto")
    assert torch.is_grad_enabled()
    ep = torch.export.export(m, args)
    assert "rtcompile.running_tensor_fwd" in str(ep.graph)
    out = ep.module()(*args)
    ref = m(*args)
    assert torch.allclose(out[0], ref[0], rtol=1e-5, atol=1e-5)


def test_model_trains_through_the_op(bwd, monkeypatch):
    """RunningTensorLM with backend="triton": one backward per layer through the op; its
    parameter gradients equal the reference backend's."""
    from rtcompile.kernels import running_tensor_chunk_ref
    from rtcompile.model import RunningTensorLM
    from rtcompile.spec import Features, ModelSpec

    spec = ModelSpec(order=3, key_widths=(16, 16), value_width=16, heads=2, model_width=32, layers=2,
                     features=Features(query_skip=True))
    torch.manual_seed(1)
    lm = RunningTensorLM(spec, vocab_size=9).to(DEVICE)
    tokens = torch.randint(0, 9, (2, 20), device=DEVICE)

    def grads(backend):
        lm.zero_grad()
        logits, _ = lm(tokens, backend=backend)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        return {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}

    tri = grads("triton")
    assert bwd.calls["bwd"] == spec.layers
    monkeypatch.setattr(functional, "running_tensor_chunk_ref", running_tensor_chunk_ref)
    monkeypatch.setattr(functional, "running_tensor_recurrent_ref", running_tensor_recurrent_ref)
    ref = grads("reference")
    assert tri.keys() == ref.keys() and len(ref) > 10
    for name in ref:
        assert rel_err(tri[name], ref[name]) < 1e-3, name


def test_compile_varlen_asks_supports_with_the_offsets(bwd):
    """Under dynamo the backward's support is asked at trace time (cu_seqlens a graph input),
    with the number of sequences; the compiled gradients equal eager's."""
    cu = torch.tensor([0, 7, 25, 40], dtype=torch.int32, device=DEVICE)
    q, k, v, g, beta, s0 = _leaves(T=40, num_seqs=3, **MIXER)
    leaves = _flat(q, k, v, g, beta, s0)
    seen = []
    inner = bwd.module.supports
    bwd.module.supports = lambda p, c: seen.append((p.num_seqs, c is not None)) or inner(p, c)

    def f(q, k, v, g, beta, s0, cu):
        o, ht = rtcompile.running_tensor(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                                         mode="chunk", backend="triton", variant=CHUNK16)
        return o.square().sum() + ht.sum()

    def grads(fn):
        for x in leaves:
            x.grad = None
        fn(q, k, v, g, beta, s0, cu).backward()
        return [x.grad.clone() for x in leaves]

    try:
        eager = grads(f)
        torch._dynamo.reset()
        compiled = grads(torch.compile(f, fullgraph=True, backend="aot_eager"))
    finally:
        bwd.module.supports = inner
    # once eagerly and once at trace time (the real backward may ask again before it launches)
    assert len(seen) >= 2 and set(seen) == {(3, True)}
    for a, b in zip(eager, compiled):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
