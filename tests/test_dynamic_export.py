"""Dynamic shapes (issue 21, item 4): mode "auto" is decided inside ``rtcompile::running_tensor_fwd``
when it runs, so ``torch.export`` of the LM with a symbolic T over [2, 4096] (and a symbolic
batch) and ``torch.compile(dynamic=True)`` trace one graph for every T. Under the interpreter
the exported graph runs the Triton kernels on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

from rtcompile.kernels import ops
from rtcompile.kernels.ops import running_tensor_fwd_op
from rtcompile.model import RunningTensorLM
from rtcompile.spec import Features, ModelSpec

from conftest import make_inputs, rel_err

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU",
)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
SPEC = ModelSpec(order=3, key_widths=(4, 4), value_width=8, heads=2, model_width=16, layers=2,
                 features=Features(query_skip=True, forget_gate=True, delta_rule=True, short_conv=3))


class _Logits(torch.nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, tokens):
        return self.lm(tokens, backend="triton")[0]


@pytest.fixture
def lm():
    torch.manual_seed(0)
    return RunningTensorLM(SPEC, vocab_size=11).to(DEVICE).eval()


@pytest.fixture
def modes(monkeypatch):
    """The mode each run of the forward op launched (after the op resolved "auto")."""
    seen = []
    real = ops.launch.running_tensor_fwd

    def spy(*args, mode, **kwargs):
        seen.append(mode)
        return real(*args, mode=mode, **kwargs)

    monkeypatch.setattr(ops.launch, "running_tensor_fwd", spy)
    return seen


def test_export_lm_with_dynamic_batch_and_seq(lm, modes):
    """T from 2 to 4096 symbolic (mode "auto" used to guard T <= 63 and refuse the range); the
    exported program runs at T = 37 (recurrent) and T = 100 (chunk) and matches eager."""
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=2, max=4096)
    with torch.no_grad():
        ep = torch.export.export(_Logits(lm), (torch.randint(0, 11, (2, 37), device=DEVICE),),
                                 dynamic_shapes=({0: batch, 1: seq},))
        assert "rtcompile.running_tensor_fwd" in str(ep.graph)
        for b, t, mode in ((2, 37, "recurrent"), (3, 100, "chunk")):
            tokens = torch.randint(0, 11, (b, t), device=DEVICE)
            modes.clear()
            got = ep.module()(tokens)
            assert modes == [mode] * SPEC.layers  # decided by the op, at run time, from T
            ref = lm(tokens, backend="reference")[0]
            assert got.shape == (b, t, 11)
            assert rel_err(got, lm(tokens, backend="triton")[0]) < 1e-6
            assert rel_err(got, ref) < 1e-4


def test_compile_dynamic_traces_one_graph_for_every_seq(lm):
    """torch.compile(dynamic=True): T = 37, 100 and 5 run the one graph (no recompile per T)."""
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(_Logits(lm), dynamic=True, fullgraph=True, backend=counter)
    with torch.no_grad():
        for t in (37, 100, 5):
            tokens = torch.randint(0, 11, (2, t), device=DEVICE)
            assert rel_err(compiled(tokens), _Logits(lm)(tokens)) < 1e-6
    assert counter.frame_count == 1


@pytest.fixture
def launches(monkeypatch):
    """(mode, variant) of every launch, eager (straight to the launcher) or through the op."""
    seen = []
    real = ops.launch.fwd_checked

    def spy(*args, mode, variant, **kwargs):
        seen.append((mode, variant))
        return real(*args, mode=mode, variant=variant, **kwargs)

    monkeypatch.setattr(ops.launch, "fwd_checked", spy)
    return seen


def test_export_and_compile_follow_the_plan_at_run_time(lm, launches):
    """With a plan (as ``rtcompile.load`` sets it) the plan's bucket used to be found in Python,
    specialising T; now the op finds it when it runs: the exported program and the dynamic
    compile launch, at every T, the mode and config the eager call launches."""
    import torch._dynamo.testing

    from rtcompile.plan import make_plan
    from rtcompile.target import get_target

    # the scan at T <= 4, a chunk form above (one launch costs both calls alike: the scan's kernel
    # outgrows the chunk form's from ~8 tokens on)
    lm.plan = make_plan(SPEC, get_target("h200"), batches=(1, 8), seq_lens=(4, 64, 4096), decode_batches=(1,))
    seq = torch.export.Dim("seq", min=2, max=4096)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(_Logits(lm), dynamic=True, fullgraph=True, backend=counter)
    with torch.no_grad():
        ep = torch.export.export(_Logits(lm), (torch.randint(0, 11, (2, 37), device=DEVICE),),
                                 dynamic_shapes=({1: seq},))
        modes = set()
        for t in (3, 37, 100):
            tokens = torch.randint(0, 11, (2, t), device=DEVICE)
            launches.clear()
            want = _Logits(lm)(tokens)
            eager = launches[:]
            for run in (ep.module(), compiled):
                launches.clear()
                assert rel_err(run(tokens), want) < 1e-6
                assert launches == eager
            modes.update(m for m, _ in eager)
    assert modes == {"chunk", "recurrent"}  # the plan's buckets differ over these T
    assert counter.frame_count == 1


def test_compile_dynamic_trains_one_graph_for_every_seq():
    """Training under torch.compile(dynamic=True, fullgraph=True): the forward op, its backward
    op and the backward's support question (asked at trace time without B or T, which used to
    break the graph under a symbolic size) trace once for T = 37 and T = 100; the gradients
    equal eager's."""
    import torch._dynamo.testing

    spec = ModelSpec(order=3, key_widths=(16, 16), value_width=16, heads=2, model_width=16, layers=1,
                     features=Features(query_skip=True, forget_gate=True, delta_rule=True, short_conv=3))
    torch.manual_seed(2)
    model = RunningTensorLM(spec, vocab_size=11).to(DEVICE)

    def loss(tokens):
        logits, _ = model(tokens, backend="triton")
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())

    def grads(fn, tokens):
        model.zero_grad()
        fn(tokens).backward()
        return [p.grad.clone() for p in model.parameters()]

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, dynamic=True, fullgraph=True, backend=counter)
    compiles = []
    for t in (37, 100):
        tokens = torch.randint(0, 11, (2, t), device=DEVICE)
        for a, b in zip(grads(compiled, tokens), grads(loss, tokens)):
            assert rel_err(a, b) < 1e-5
        compiles.append(counter.frame_count)
    assert compiles[0] >= 1 and compiles[1] == compiles[0]  # T = 100 compiled nothing new


def test_fwd_op_auto_fake_and_autograd_registration():
    """The op with mode "auto": its fake (shapes only, no mode) and autograd registration pass
    opcheck, and it equals the mode it resolves to."""
    q, k, v, g, beta, s0 = make_inputs(1, 20, 2, (4, 4), 8, state=True, dtype=torch.float32, seed=3)
    q, k, v, g, beta = [[x.to(DEVICE) for x in q], [x.to(DEVICE) for x in k], v.to(DEVICE), g.to(DEVICE),
                        beta.to(DEVICE)]
    s0 = s0.float().to(DEVICE)
    args = lambda mode: (q, k, v, g, beta, s0, None, 0.3, True, True, mode, 16, "")
    torch.library.opcheck(running_tensor_fwd_op, args("auto"),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    auto_o, auto_s = running_tensor_fwd_op(*args("auto"))
    chunk_o, chunk_s = running_tensor_fwd_op(*args("chunk"))  # T = 20 >= chunk 16
    assert torch.equal(auto_o, chunk_o) and torch.equal(auto_s, chunk_s)
