"""The backward's default config (``chunk_backward.default_backward``) against its own check over
a grid of widths, orders, value widths and shared-memory limits (config construction and checks
only: no kernel runs), and the gradients of defaults at widths whose earlier defaults the check
refused (through the interpreter, against float64 autograd of the recurrent reference)."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

from rtcompile.kernels.chunk_backward import BackwardConfig, default_backward, supports
from rtcompile.kernels.chunk_backward_widths import rewritten_widths
from rtcompile.kernels.config import DEFAULT_SMEM_BYTES, KernelShape
from rtcompile.kernels.inputs import Problem

from conftest import DEVICE
from test_backward import check_gradients

needs_kernels = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU",
)

# powers of two from 16 (tiled as they are), others (materialised or zero-padded), and the widths
# whose defaults the check refused before (o2 >= 512 and 300 padded, o3 x256, o4 x32 and wider)
WIDTHS = [(w,) for w in (8, 16, 64, 256, 300, 512, 1024, 4096)] \
    + list(itertools.product((3, 16, 24, 64, 256), (16, 48, 128, 256))) \
    + list(itertools.product((4, 16, 32), (16, 64), (16, 32, 64, 128, 256)))
# (the limit a default is sized for, the limit its check applies): the CPU's, an H200's, a 99 KiB GPU's
LIMITS = [(DEFAULT_SMEM_BYTES, 10**9), (232448, 232448), (101376, 101376)]


@pytest.fixture(autouse=True)
def poison_outputs(poison):
    """Every output and workspace the launchers allocate starts as NaN (conftest's ``poison``)."""


def _problem(widths, V, dtype):
    return Problem(1, 1, 1, tuple(widths), V, 1, None, 1.0, dtype, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("V", [1, 20, 64, 256], ids=lambda v: f"dv{v}")
def test_default_passes_its_check_wherever_supported(V, dtype):
    """supports() accepts every width of orders 2-4, so a training call's forward runs; the
    backward then resolves default_backward for the rewritten widths, which must pass its own
    check (order 2 above K = 256, o3 16x256 and o4 16x16x32 got configs the check refused, so
    the training call failed after its forward, even under backend='auto')."""
    refused = []
    for widths in WIDTHS:
        assert supports(_problem(widths, V, dtype), None) is None, widths
        shape = KernelShape(rewritten_widths(widths), V, dtype.itemsize)
        for limit, check_limit in LIMITS:
            if (reason := default_backward(shape, limit).check(shape, check_limit)) is not None:
                refused.append(f"{widths} smem {limit}: {reason}")
    assert not refused, "\n".join(refused[:10])


@needs_kernels
@pytest.mark.parametrize("widths, padded", [((300,), (512,)), ((16, 256), (16, 256)), ((16, 16, 32), (16, 16, 32))],
                         ids=["o2-300", "o3-16x256", "o4-16x16x32"])
def test_default_gradients_where_the_check_refused_it(widths, padded):
    """Every gradient of the default config at widths whose earlier default the check refused
    (the factors' gradients through the workspace, or the key block capped at order 4)."""
    V = 4
    config = default_backward(KernelShape(padded, V, 4))
    assert config.check(KernelShape(padded, V, 4), 10**9) is None, config
    check_gradients(widths, 17, V, chunk_size=config.chunk_size, config=config, H=1)


def test_supports_refuses_where_the_default_cannot_run(monkeypatch, request):
    """Where no default passes its check, supports() says why, so the training call is refused
    before its forward runs: backend='auto' takes the reference, backend='triton' raises naming
    the reason (not an error from the backward after the forward ran)."""
    import rtcompile
    from rtcompile.kernels import chunk_backward
    from rtcompile.kernels.chunk_backward import BackwardConfig

    refused = BackwardConfig(chunk_size=16, block_v=16, block_k=256)  # 'registers' refuses block_k 256
    monkeypatch.setattr(chunk_backward, "default_backward", lambda *a, **kw: refused)
    # supports() keeps each shape's answer: none from before the patch, none of it after the test
    chunk_backward._default_refusal.cache_clear()
    request.addfinalizer(chunk_backward._default_refusal.cache_clear)
    reason = supports(_problem((16, 16), 8, torch.float32), None)
    assert reason is not None and "no backward config" in reason and "block_k=256" in reason, reason
    q, k = [torch.randn(1, 5, 1, 16, requires_grad=True) for _ in range(2)], [torch.randn(1, 5, 1, 16) for _ in range(2)]
    v = torch.randn(1, 5, 1, 8)
    o, _ = rtcompile.running_tensor(q, k, v, mode="chunk", backend="auto")
    name = type(o.grad_fn).__name__  # the Triton calls' nodes: the op's (running_tensor_fwd) or KeptForward's
    assert "running_tensor_fwd" not in name and "KeptForward" not in name, name
    with pytest.raises(ValueError, match="backend: 'triton'.*block_k=256"):
        rtcompile.running_tensor(q, k, v, mode="chunk", backend="triton")


@needs_kernels
@pytest.mark.parametrize("path", ["launcher", "running_tensor"])
def test_bf16_gate_gradient_of_the_default(path):
    """bf16 inputs with a gate: the default keeps U, R and dU in fp32, since dg (fp32) sums
    differences of them and 16-bit workspaces cancelled to dg errors of 9.5e-3 - 4.0e-2 at o2 16
    (fp32 workspaces: ~1e-6). Through the launcher (variant None) and through running_tensor's
    training call (the default keeps its forward there), over ten seeds."""
    import rtcompile
    from rtcompile.kernels import running_tensor_recurrent_ref
    from rtcompile.kernels.chunk_backward import running_tensor_bwd

    from conftest import make_inputs, rel_err
    from test_backward import HALF_TOL

    errors = []
    for seed in range(10):
        q, k, v, g, beta, h0 = make_inputs(1, 21, 2, (16,), 8, state=True, seed=seed)
        low = lambda x: x.to(torch.bfloat16).to(DEVICE)  # noqa: E731
        q, k, v, beta, g, h0 = ([low(x) for x in q], [low(x) for x in k], low(v), low(beta), g.float().to(DEVICE),
                                h0.float().to(DEVICE))
        up = lambda x: x.detach().cpu().double().requires_grad_()  # noqa: E731
        rq, rk, rv, rg, rb, rh0 = [up(x) for x in q], [up(x) for x in k], up(v), up(g), up(beta), up(h0)
        ro, rs = running_tensor_recurrent_ref(rq, rk, rv, rg, rb, scale=0.25, initial_state=rh0,
                                              output_final_state=True, l2norm=True)
        gen = torch.Generator().manual_seed(100 + seed)
        do, dht = torch.randn(ro.shape, generator=gen).bfloat16(), torch.randn(rs.shape, generator=gen)
        do, dht = do.to(DEVICE), dht.to(DEVICE)
        (want,) = torch.autograd.grad((ro * do.cpu().double()).sum() + (rs * dht.cpu().double()).sum(), [rg])
        if path == "launcher":
            dg = running_tensor_bwd(q, k, v, g, beta, scale=0.25, initial_state=h0, cu_seqlens=None, l2norm=True,
                                    do=do, dht=dht)[3]
        else:
            g = g.requires_grad_()
            o, s = rtcompile.running_tensor(q, k, v, g, beta, scale=0.25, initial_state=h0, output_final_state=True,
                                            l2norm=True, mode="chunk", backend="triton")
            (dg,) = torch.autograd.grad((o.float() * do.float()).sum() + (s * dht).sum(), [g])
        errors.append(rel_err(dg.cpu(), want))
    # 16-bit workspaces (the earlier default): 3.1e-3 - 2.3e-2 here, two seeds of ten over 2e-2; fp32: < 1e-6
    assert max(errors) < HALF_TOL[torch.bfloat16], errors


@needs_kernels
@pytest.mark.parametrize("widths, extra", [((16,), {}), ((16, 16), {"factor_grads": "workspace"})],
                         ids=["o2-16", "o3-16x16-workspace"])
def test_mixed_workspaces(widths, extra, monkeypatch):
    """workspace_dtype="mixed" (the bf16 default with a gate): U, R and dU in fp32 and phi's
    stored gradients in bf16 -- all fp32 cost o3 16x16 bf16 training 1.94 -> 2.35 ms and
    965 -> 1573 MiB on the H100, nearly all of it phi's gradients -- every gradient within
    bf16's tolerance of float64 autograd, partial chunk, every feature on."""
    from rtcompile.kernels import args

    from test_backward import FEATURES, HALF_TOL

    config = BackwardConfig(chunk_size=16, block_v=16, block_k=32, workspace_dtype="mixed", **extra)
    shape = KernelShape(widths, 20, 2)
    assert (config.value_bytes_per_element(shape), config.phi_grad_bytes_per_element(shape)) == (4, 2)
    assert config.check(shape) is None
    made, empty = [], args.empty
    monkeypatch.setattr(args, "empty", lambda *a, **kw: made.append((tuple(a[0] if len(a) == 1 else a), kw["dtype"]))
                        or empty(*a, **kw))
    check_gradients(widths, 37, 20, chunk_size=16, dtype=torch.bfloat16, config=config,
                    tol=HALF_TOL[torch.bfloat16], **FEATURES["gated-delta-l2-h0"])
    K = math.prod(widths)
    assert made.count(((1, 37, 2, 20), torch.float32)) == 3, made  # U, R, dU
    assert made.count(((1, 37, 2, 20), torch.bfloat16)) == 1, made  # dv
    if K != 16:  # [B, H, T, K] is then not also the [B, H, T, C] scores' and inverse's shape
        # phi's 16-bit gradients go over phi(Q), phi(K) (the memory all-fp32 lost): the only two
        # [B, H, T, K] tensors made are phi's own (bf16 on the GPU; fp32 under the interpreter,
        # whose bf16 tl.dot is wrong)
        assert config.phi_grads_over_phi(shape)
        assert sum(1 for size, _ in made if size == (1, 2, 37, K)) == 2, made
