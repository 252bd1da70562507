"""The training forward that keeps the backward's prepare and state loop (``keep_forward``,
``kernels/chunk_backward_kept.py``, ``ops.KeptForward``): its output and final state against
float64, its gradients against the recomputing backward's (the same kernels on the same inputs:
equal) and against float64 autograd through the public API, with every workspace poisoned."""

from __future__ import annotations

import dataclasses
import gc
import os
import weakref

import pytest
import torch

import rtcompile
from rtcompile.kernels import chunk_backward, chunk_backward_kept, running_tensor_recurrent_ref
from rtcompile.kernels.chunk_backward import BackwardConfig, launch_backward
from rtcompile.kernels.config import KernelShape
from rtcompile.kernels.inputs import check_inputs

from conftest import make_inputs, rel_err

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU",
)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = 1e-4  # fp32 kernels against float64 (tests/test_backward.py's bound)

CASES = {  # widths, T, d_v, varlen offsets, gate, delta rule, initial state
    "o2-T37-h0": ((16,), 37, 20, None, True, True, True),
    "o3-16x16-T21-plain": ((16, 16), 21, 16, None, False, False, False),
    "o3-16x16-varlen-h0": ((16, 16), 29, 16, [0, 13, 29], True, True, True),
}


@pytest.fixture(autouse=True)
def poison_outputs(poison):
    """Every output and workspace the launchers allocate starts as NaN."""


def _case(name, seed=None, dtype=torch.float32):
    widths, T, V, offsets, gate, delta, h0 = CASES[name]
    n = None if offsets is None else len(offsets) - 1
    q, k, v, g, beta, s0 = make_inputs(1 if offsets else 2, T, 2, widths, V, gate=gate, delta=delta, state=h0,
                                       num_seqs=n, seed=seed)
    low = lambda x: None if x is None else x.to(dtype).to(DEVICE)  # noqa: E731
    f32 = lambda x: None if x is None else x.float().to(DEVICE)  # noqa: E731
    cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    return [low(x) for x in q], [low(x) for x in k], low(v), f32(g), low(beta), f32(s0), cu


def _keep_resident_default(monkeypatch) -> None:
    """The backward default, at chunks of 16 and 16 value columns, keeping its forward with the
    resident state loop and phi's gradients stored over the kept phi workspaces."""
    base = chunk_backward.default_backward
    monkeypatch.setattr(chunk_backward, "default_backward",
                        lambda *a, **kw: dataclasses.replace(base(*a, **kw), chunk_size=16, block_v=16,
                                                             keep_forward=True, state_loop="resident",
                                                             factor_grads="workspace"))


def _watch_kept(monkeypatch, *names) -> list:
    """Weak references to the named workspaces (``Recomputed`` fields) of every kept forward
    run from here on, in order."""
    refs = []
    real = chunk_backward_kept.forward_kept

    def forward_kept(*a, **kw):
        out = real(*a, **kw)
        refs.extend(weakref.ref(getattr(out[2], n)) for n in names)
        return out

    monkeypatch.setattr(chunk_backward_kept, "forward_kept", forward_kept)
    return refs


CONFIG = BackwardConfig(chunk_size=16, block_v=16, keep_forward=True)
# the streamed loops (K > 256 by default) keep theirs too: the output comes from the state loop
# that stores the states, in tiles of 64 rows (four per state at o3 16x16)
STREAMED = dataclasses.replace(CONFIG, state_loop="streamed", state_block_k=64, factor_grads="registers")


@pytest.mark.parametrize("name, dtype, loop", [(n, torch.float32, "resident") for n in CASES]
                         + [("o2-T37-h0", torch.float16, "resident")]
                         + [(n, torch.float32, "streamed") for n in ("o3-16x16-T21-plain", "o3-16x16-varlen-h0")]
                         + [("o3-16x16-varlen-h0", torch.float32, "merged")],
                         ids=[*CASES, "o2-T37-h0-fp16-inputs-workspace", "o3-16x16-T21-plain-streamed",
                              "o3-16x16-varlen-h0-streamed", "o3-16x16-varlen-h0-streamed-merged-passes"])
def test_kept_forward_equals_reference_and_the_backward_equals_the_recomputing_one(name, dtype, loop):
    q, k, v, g, beta, h0, cu = _case(name, dtype=dtype)
    p = check_inputs(q, k, v, g, beta, None, h0, cu)
    config = {"streamed": STREAMED, "merged": dataclasses.replace(STREAMED, merge_passes=True)}.get(loop, CONFIG)
    config = config if dtype == torch.float32 else dataclasses.replace(config, workspace_dtype="inputs")
    tol = TOL if dtype == torch.float32 else 2e-2  # fp16 products (tests/test_backward.py's HALF_TOL)
    o, ht, kept = chunk_backward_kept.forward_kept(config, p, q, k, v, g, beta, h0, cu, True, True)
    d = lambda x: None if x is None else x.double().cpu()  # noqa: E731
    ro, rs = running_tensor_recurrent_ref([d(x) for x in q], [d(x) for x in k], d(v), d(g), d(beta),
                                          initial_state=d(h0), output_final_state=True, l2norm=True,
                                          cu_seqlens=None if cu is None else cu.cpu())
    assert o.dtype == v.dtype and rel_err(o.cpu(), ro) < tol and rel_err(ht.cpu(), rs) < tol
    do, dht = torch.randn_like(v), torch.randn_like(ht)
    got = launch_backward(config, p, q, k, v, g, beta, h0, cu, True, do, dht, kept=kept)
    want = launch_backward(dataclasses.replace(config, keep_forward=False), p, q, k, v, g, beta, h0, cu, True, do, dht)
    flat = lambda gs: [*gs[0], *gs[1], *gs[2:]]  # noqa: E731
    for a, b in zip(flat(got), flat(want)):
        assert (a is None) == (b is None)
        if a is not None:  # the same kernels on the same inputs: the same bits
            assert torch.equal(a, b)
    # and both against float64 autograd through the recurrent reference on the same (rounded)
    # inputs and output gradients: a term wrong in both backwards alike fails here
    leaves = [x.detach().double().cpu().requires_grad_() for x in (*q, *k, v, g, beta, h0) if x is not None]
    n = len(q)
    it = iter(leaves[2 * n:])
    rv, rg, rb, rh0 = [next(it) if x is not None else None for x in (v, g, beta, h0)]
    ro, rs = running_tensor_recurrent_ref(leaves[:n], leaves[n:2 * n], rv, rg, rb, initial_state=rh0,
                                          output_final_state=True, l2norm=True,
                                          cu_seqlens=None if cu is None else cu.cpu())
    ref = torch.autograd.grad((ro * d(do)).sum() + (rs * d(dht)).sum(), leaves)
    # fp32: observed 2e-7 - 9e-7; fp16 inputs with fp16 workspaces: observed 5e-4 - 1.7e-3 over
    # 5 fresh runs, so test_backward.py's 16-bit 2e-2 (a wrong term gives errors of order 1)
    grad_tol = TOL if dtype == torch.float32 else 2e-2
    for i, (a, b) in enumerate(zip([x for x in flat(got) if x is not None], ref)):
        assert a.shape == b.shape and rel_err(a.cpu(), b) < grad_tol, (i, rel_err(a.cpu(), b))


@pytest.mark.parametrize("name, split, loop", [("o2-T37-h0", False, "resident"),
                                               ("o3-16x16-varlen-h0", False, "resident"),
                                               ("o2-T37-h0", True, "resident"), ("o3-16x16-varlen-h0", True, "resident"),
                                               ("o3-16x16-varlen-h0", False, "streamed")],
                         ids=["o2-T37-h0", "o3-16x16-varlen-h0", "o2-T37-h0-split", "o3-16x16-varlen-h0-split",
                              "o3-16x16-varlen-h0-streamed"])
def test_training_call_keeps_its_forward_and_matches_float64_autograd(name, split, loop, monkeypatch):
    """running_tensor(backend="triton") with grad, under a default that keeps the forward: the
    prepare and state loop run once (in the forward), and every gradient, through the output
    and the final state, matches float64 autograd of the reference. phi's stored gradients go
    over the kept phi workspaces (the one-pass kernel), or with ``grads_split`` into their own;
    the streamed loop's forward is the state loop that stores the states, the factors'
    gradients formed in registers."""
    base = chunk_backward.default_backward
    fields = {"state_loop": "streamed", "state_block_k": 64, "factor_grads": "registers"} if loop == "streamed" \
        else {"state_loop": "resident", "factor_grads": "workspace", "grads_split": split}
    monkeypatch.setattr(chunk_backward, "default_backward",
                        lambda *a, **kw: dataclasses.replace(base(*a, **kw), chunk_size=16, block_v=16,
                                                             keep_forward=True, **fields))
    calls = []
    for mod in (chunk_backward_kept, chunk_backward):  # the forward's and the backward's names for it
        real = mod.recompute
        monkeypatch.setattr(mod, "recompute", lambda *a, _r=real, _m=mod.__name__, **kw: calls.append(_m) or _r(*a, **kw))
    q, k, v, g, beta, h0, cu = _case(name)
    leaves = [x.requires_grad_() for x in (*q, *k, v, g, beta, h0)]
    o, s = rtcompile.running_tensor(q, k, v, g, beta, initial_state=h0, output_final_state=True, l2norm=True,
                                    cu_seqlens=cu, mode="chunk", backend="triton")
    do, ds = torch.randn_like(o), torch.randn_like(s)
    grads = torch.autograd.grad((o * do).sum() + (s * ds).sum(), leaves)
    assert calls == [chunk_backward_kept.__name__]  # once, in the forward; the backward kept it
    ref = [x.detach().double().cpu().requires_grad_() for x in leaves]
    n = len(q)
    ro, rs = running_tensor_recurrent_ref(ref[:n], ref[n:2 * n], ref[2 * n], ref[2 * n + 1], ref[2 * n + 2],
                                          initial_state=ref[-1], output_final_state=True, l2norm=True,
                                          cu_seqlens=None if cu is None else cu.cpu())
    want = torch.autograd.grad((ro * do.double().cpu()).sum() + (rs * ds.double().cpu()).sum(), ref)
    for i, (a, b) in enumerate(zip(grads, want)):
        assert a.shape == b.shape and rel_err(a.cpu(), b) < TOL, (i, rel_err(a.cpu(), b))


def test_a_second_backward_through_a_kept_forward_recomputes(monkeypatch):
    """The first backward writes phi's gradients over the kept phi workspaces, so the kept
    forward is spent: a second backward (``retain_graph=True``) must recompute it, never read
    the overwritten phi. Both backwards give the same gradients (the same kernels on the same
    inputs), and those match float64 autograd."""
    _keep_resident_default(monkeypatch)
    calls = []
    real = chunk_backward.recompute
    monkeypatch.setattr(chunk_backward, "recompute", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    kept_states = _watch_kept(monkeypatch, "Hc", "Uc")
    q, k, v, g, beta, h0, cu = _case("o3-16x16-varlen-h0")
    leaves = [x.requires_grad_() for x in (*q, *k, v, g, beta, h0)]
    o, s = rtcompile.running_tensor(q, k, v, g, beta, initial_state=h0, output_final_state=True, l2norm=True,
                                    cu_seqlens=cu, mode="chunk", backend="triton")
    do, ds = torch.randn_like(o), torch.randn_like(s)
    loss = (o * do).sum() + (s * ds).sum()
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    assert calls == []  # the first backward starts from the kept forward
    # the retained graph keeps the spent workspaces' tensors, not their memory (it had held it
    # until the graph was freed)
    assert kept_states and all(t().untyped_storage().nbytes() == 0 for t in kept_states)
    second = torch.autograd.grad(loss, leaves)
    assert calls == [1]  # the second recomputes it
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    ref = [x.detach().double().cpu().requires_grad_() for x in leaves]
    n = len(q)
    ro, rs = running_tensor_recurrent_ref(ref[:n], ref[n:2 * n], ref[2 * n], ref[2 * n + 1], ref[2 * n + 2],
                                          initial_state=ref[-1], output_final_state=True, l2norm=True,
                                          cu_seqlens=cu.cpu())
    want = torch.autograd.grad((ro * do.double().cpu()).sum() + (rs * ds.double().cpu()).sum(), ref)
    for i, (a, b) in enumerate(zip(second, want)):
        assert rel_err(a.cpu(), b) < TOL, (i, rel_err(a.cpu(), b))


def test_non_reentrant_checkpointing_drops_the_kept_workspaces_and_recomputes_them(monkeypatch):
    """Under torch.utils.checkpoint(use_reentrant=False) the kept workspaces (the chunk states,
    U, R, the inverse ...) go through the saved-tensor hooks like any saved tensor, so the
    checkpoint drops them after the forward; as ctx attributes every checkpointed layer's had
    stayed alive until its backward. Here the hooks of the checkpoint's forward see the stored
    chunk states ([chunks, H, K, V]), the forward runs twice (once recomputed for the backward),
    and the gradients equal those of the same call without the checkpoint."""
    from torch.utils.checkpoint import checkpoint

    _keep_resident_default(monkeypatch)
    forwards = []
    real = chunk_backward_kept.recompute
    monkeypatch.setattr(chunk_backward_kept, "recompute", lambda *a, **kw: forwards.append(1) or real(*a, **kw))
    states = _watch_kept(monkeypatch, "Hc")  # each kept forward's stored chunk states
    q, k, v, g, beta, h0, cu = _case("o3-16x16-varlen-h0")
    leaves = [x.requires_grad_() for x in (*q, *k, v, g, beta, h0)]
    n = len(q)

    def layer(*xs):
        return rtcompile.running_tensor(list(xs[:n]), list(xs[n:2 * n]), *xs[2 * n:-1], initial_state=xs[-1],
                                        output_final_state=True, l2norm=True, cu_seqlens=cu, mode="chunk",
                                        backend="triton")

    do = ds = None
    grads = []
    for checkpointed in (False, True):
        packed = []

        def pack(t):
            packed.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            o, s = checkpoint(layer, *leaves, use_reentrant=False) if checkpointed else layer(*leaves)
        if do is None:
            do, ds = torch.randn_like(o), torch.randn_like(s)
        gc.collect()
        # after the forward: the checkpoint dropped the workspaces; without it they wait for the backward
        assert (states[-1]() is None) == checkpointed
        forwards.clear()
        grads.append(torch.autograd.grad((o * do).sum() + (s * ds).sum(), leaves))
        if checkpointed:
            assert forwards == [1]  # the checkpoint recomputed the forward (with its workspaces) for the backward
        else:
            H, K, V = 2, 256, 16
            assert any(len(x) == 4 and x[1:] == (H, K, V) for x in packed), packed  # the chunk states
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_keep_forward_with_either_state_loop():
    shape = KernelShape((16, 16), 64)
    assert CONFIG.check(shape) is None and STREAMED.check(shape) is None
    assert BackwardConfig.space(KernelShape((32, 32), 64))["keep_forward"] == [False, True]
    assert BackwardConfig.space(shape)["keep_forward"] == [False, True]
    with pytest.raises(ValueError, match="streamed state loop only"):  # the resident loop has no output
        chunk_backward_kept.recompute(CONFIG, None, [], [], torch.empty(1, 1, 1, 1), None, None, None, None, True,
                                      o=torch.empty(1))


def test_the_bf16_default_keeps_its_forward_and_matches_float64(monkeypatch):
    """The default as users get it on the H200 (its shared memory: the CPU's portable limit picks
    another): bf16 inputs at o3 16x16 with a gate resolve to chunks of 32 with ``keep_forward``
    and fp32 U, R, dU with 16-bit phi gradients ("mixed": 16-bit U, R, dU cancelled in dg); the forward keeps the prepare and state loop (once, in the forward), and the
    output, the final state and every gradient match float64 autograd to bf16's tolerance
    (tests/test_backward.py's 2e-2). T 70: two chunks and a part."""
    shape = KernelShape((16, 16), 20, 2)
    base = chunk_backward.default_backward
    default = base(shape, 232448)
    assert default.keep_forward and default.chunk_size == 32 and default.workspace_dtype == "mixed", default
    assert base(shape, 232448, gated=False).workspace_dtype == "inputs"  # no gate: 16-bit workspaces stay
    monkeypatch.setattr(chunk_backward, "default_backward",
                        lambda s, limit=None, chunk_size=None, **kw: base(s, 232448, chunk_size, **kw))
    calls = []
    for mod in (chunk_backward_kept, chunk_backward):
        real = mod.recompute
        monkeypatch.setattr(mod, "recompute", lambda *a, _r=real, _m=mod.__name__, **kw: calls.append(_m) or _r(*a, **kw))
    q, k, v, g, beta, h0 = make_inputs(2, 70, 2, (16, 16), 20, gate=True, delta=True, state=True, seed=3)
    low = lambda x: x.to(torch.bfloat16).to(DEVICE)  # noqa: E731
    q, k, v, beta = [low(x) for x in q], [low(x) for x in k], low(v), low(beta)
    g, h0 = g.float().to(DEVICE), h0.float().to(DEVICE)
    leaves = [x.requires_grad_() for x in (*q, *k, v, g, beta, h0)]
    o, s = rtcompile.running_tensor(q, k, v, g, beta, initial_state=h0, output_final_state=True, l2norm=True,
                                    mode="chunk", backend="triton")
    do, ds = torch.randn_like(o), torch.randn_like(s)
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (s * ds).sum(), leaves)
    assert calls == [chunk_backward_kept.__name__]
    ref = [x.detach().double().cpu().requires_grad_() for x in leaves]
    ro, rs = running_tensor_recurrent_ref(ref[:2], ref[2:4], ref[4], ref[5], ref[6], initial_state=ref[7],
                                          output_final_state=True, l2norm=True)
    assert rel_err(o.detach().cpu(), ro.detach()) < 2e-2 and rel_err(s.detach().cpu(), rs.detach()) < 2e-2
    want = torch.autograd.grad((ro * do.double().cpu()).sum() + (rs * ds.double().cpu()).sum(), ref)
    for i, (a, b) in enumerate(zip(grads, want)):
        assert a.shape == b.shape and rel_err(a.cpu(), b) < 2e-2, (i, rel_err(a.cpu(), b))


def test_double_backward_through_the_kept_forward_is_refused():
    """A gradient penalty (create_graph=True, then a backward through the first gradient) through
    the kept forward: its backward's gradients carry no graph, so the second backward is refused
    (as the custom op's is), not run as if the penalty's second-order term were zero."""
    q, k, v, g, beta, _ = make_inputs(1, 20, 1, (16,), 16, seed=0)
    low = lambda x: x.to(torch.bfloat16).to(DEVICE).requires_grad_()  # noqa: E731
    q, k, v, beta, g = [low(x) for x in q], [low(x) for x in k], low(v), low(beta), g.float().to(DEVICE)
    o, _ = rtcompile.running_tensor(q, k, v, g, beta, mode="chunk", backend="triton")
    assert type(o.grad_fn).__name__ == "KeptForwardBackward", o.grad_fn  # the bf16 default keeps its forward
    (dq,) = torch.autograd.grad(o.float().pow(2).sum(), q[0], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice a function that was marked with @once_differentiable"):
        (o.float().sum() + dq.float().pow(2).sum()).backward()
