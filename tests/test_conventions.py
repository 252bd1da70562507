"""Serving conventions of the Triton path (issue 21, item 5): strided inputs, as a model slices
them out of a fused projection, give the results of contiguous copies (forward in both modes,
the decode step, the backward); ``state_indices`` may be int32 or int64.

Every comparison is exact (``torch.equal``): the launchers copy a strided input once at the
launch boundary, so the kernels see the same values in the same layout either way.
"""

from __future__ import annotations

import os

import pytest
import torch

import rtcompile
from rtcompile.kernels.ops import running_tensor_bwd_op, running_tensor_decode_op, running_tensor_fwd_op

from conftest import make_inputs

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU",
)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
ORDERS = {"o2": (4,), "o3": (2, 3)}
# widths the backward's kernels tile directly (others are rewritten: chunk_backward_widths.py)
GRAD_ORDERS = {"o2": (16,), "o3": (16, 16)}
FEATURES = {"plain": dict(gate=False, delta=False), "gated-delta": dict(gate=True, delta=True)}


def fused_slice(x: torch.Tensor, part: int = 1, parts: int = 3) -> torch.Tensor:
    """``x``'s values as part ``part`` of a fused projection along the last axis (as
    ``proj(x).view(B, T, H, 3 * D)[..., D:2 * D]``): a view whose rows are strided."""
    d = x.shape[-1]
    buf = torch.randn(*x.shape[:-1], parts * d, dtype=x.dtype, device=x.device)
    buf[..., part * d:(part + 1) * d] = x
    return buf[..., part * d:(part + 1) * d]


def head_major(x: torch.Tensor, heads_axis: int = 2) -> torch.Tensor:
    """``x`` stored with its heads axis outermost ([H, B, T, ...] for a per-token tensor,
    [H, N, ...] for a state) and viewed back: a dense, permuted view (non-contiguous also at
    T = 1, where a [B, H, T, d] storage would be contiguous)."""
    return x.movedim(heads_axis, 0).contiguous().movedim(0, heads_axis)


LAYOUTS = {"fused-slice": fused_slice, "head-major": head_major}


def _inputs(B, T, widths, feat, *, state=True, seed=0):
    q, k, v, g, beta, s0 = make_inputs(B, T, 2, widths, 4, dtype=torch.float32, state=state, seed=seed,
                                       **FEATURES[feat])
    dev = lambda x: None if x is None else x.float().to(DEVICE)
    return [dev(x) for x in q], [dev(x) for x in k], dev(v), dev(g), dev(beta), dev(s0)


def _strided(xs, layout):
    """The inputs (q, k, v, g, beta, initial state) as non-contiguous views with the same values."""
    make = LAYOUTS[layout]
    q, k, v, g, beta, s0 = xs
    state = None if s0 is None else (make(s0) if layout == "fused-slice" else head_major(s0, heads_axis=1))
    out = [make(x) for x in q], [make(x) for x in k], make(v), *(None if x is None else make(x) for x in (g, beta)), state
    for x in (*out[0], *out[1], *out[2:]):
        assert x is None or not x.is_contiguous()
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("feat", FEATURES)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_prefill_strided_equals_contiguous(mode, order, feat, layout):
    """T = 20 with chunk_size 16: a full chunk and a partial one."""
    xs = _inputs(2, 20, ORDERS[order], feat)
    kw = dict(output_final_state=True, l2norm=True, mode=mode, backend="triton",
              chunk_size=16 if mode == "chunk" else None)
    q, k, v, g, beta, s0 = xs
    o_ref, s_ref = rtcompile.running_tensor(q, k, v, g, beta, initial_state=s0, **kw)
    q, k, v, g, beta, s0 = _strided(xs, layout)
    o, s = rtcompile.running_tensor(q, k, v, g, beta, initial_state=s0, **kw)
    assert o.shape == o_ref.shape and torch.equal(o, o_ref)
    assert torch.equal(s, s_ref)


def test_prefill_strided_varlen_offsets():
    """cu_seqlens taken every other element of a longer tensor (a strided 1-D view)."""
    xs = _inputs(1, 20, (2, 3), "gated-delta", state=False)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=DEVICE)
    cu_strided = torch.tensor([0, -5, 7, -5, 20], dtype=torch.int32, device=DEVICE)[::2]
    assert not cu_strided.is_contiguous()
    kw = dict(output_final_state=True, mode="chunk", chunk_size=16, backend="triton")
    o_ref, s_ref = rtcompile.running_tensor(*xs[:5], cu_seqlens=cu, **kw)
    q, k, v, g, beta, _ = _strided((*xs[:5], None), "fused-slice")
    o, s = rtcompile.running_tensor(q, k, v, g, beta, cu_seqlens=cu_strided, **kw)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


def _leaves(xs):
    return [None if x is None else x.detach().clone().requires_grad_() for x in xs]


@pytest.mark.parametrize("feat", FEATURES)
@pytest.mark.parametrize("order", GRAD_ORDERS)
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_gradients_through_strided_inputs(mode, order, feat):
    """Strided views of fused leaves that require grad: the gradients reaching the views equal
    those of contiguous leaves and have the views' shapes; the fused leaves get them back in
    their slices and zeros elsewhere."""
    widths = GRAD_ORDERS[order]
    xs = _inputs(1, 18, widths, feat)
    flat = lambda q, k, v, g, beta, s0: [*q, *k, v, g, beta, s0]
    n = len(widths)
    kw = dict(output_final_state=True, l2norm=True, mode=mode, backend="triton",
              chunk_size=16 if mode == "chunk" else None)

    def run(leaves):
        q, k, v, g, beta, s0 = leaves[:n], leaves[n:2 * n], *leaves[2 * n:]
        o, s = rtcompile.running_tensor(q, k, v, g, beta, initial_state=s0, **kw)
        w = torch.linspace(-1, 1, o.numel(), device=o.device).view(o.shape)
        return (o * w).sum() + s.square().sum()

    contiguous = _leaves(flat(*xs))
    # every input a slice of its own fused leaf [..., 3 d] (part 1 of 3)
    fused = []
    for x in flat(*xs):
        if x is None:
            fused.append(None)
            continue
        d = x.shape[-1]
        buf = torch.zeros(*x.shape[:-1], 3 * d, device=x.device)
        buf[..., d:2 * d] = x
        fused.append(buf.requires_grad_())
    views = [None if b is None else b[..., b.shape[-1] // 3:2 * b.shape[-1] // 3] for b in fused]
    want = torch.autograd.grad(run(contiguous), [x for x in contiguous if x is not None])
    got = torch.autograd.grad(run(views), [x for x in views if x is not None])
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, f"gradient {i}: shape {tuple(a.shape)}, want {tuple(b.shape)}"
        assert torch.equal(a, b), f"gradient {i} differs"
    leaves = [b for b in fused if b is not None]
    full = torch.autograd.grad(run(views), leaves)
    for i, (grad, b, w) in enumerate(zip(full, leaves, want)):
        d = b.shape[-1] // 3
        assert torch.equal(grad[..., d:2 * d], w), f"fused leaf {i}: its slice's gradient"
        assert not grad[..., :d].any() and not grad[..., 2 * d:].any(), f"fused leaf {i}: outside its slice"


def _opcheck_args(op):
    """Arguments of each custom op with head-major (dense, permuted) inputs."""
    widths = (16,) if op == "bwd" else (2, 3)
    q, k, v, g, beta, s0 = _strided(_inputs(2, 9, widths, "gated-delta"), "head-major")
    if op == "fwd":
        return running_tensor_fwd_op, (q, k, v, g, beta, s0, None, 0.3, True, True, "chunk", 16, "")
    if op == "bwd":
        do, dht = head_major(torch.randn_like(v)), head_major(torch.randn_like(s0), heads_axis=1)
        return running_tensor_bwd_op, (q, k, v, g, beta, s0, None, do, dht, 0.3, True, 16)
    xs, cache = _decode_case((2, 3), "gated-delta", idx=(2, 0))
    q, k, v, g, beta = _strided((*xs, None), "head-major")[:5]
    idx = torch.tensor([2, 0], dtype=torch.int64, device=DEVICE)
    return running_tensor_decode_op, (q, k, v, g, beta, cache, idx, 0.3, True, "")


@pytest.mark.parametrize("op", ["fwd", "bwd", "decode"])
def test_opcheck_strided(op):
    """Each custom op's fake output layout matches the real one's for strided inputs (the real
    ops return contiguous tensors; a fake ``empty_like`` of a head-major input would not)."""
    fn, args = _opcheck_args(op)
    utils = ("test_schema", "test_faketensor") + (("test_aot_dispatch_static",) if op != "decode" else ())
    torch.library.opcheck(fn, args, test_utils=utils)


# ----- the decode step -----------------------------------------------------------------------


def _decode_case(widths, feat, idx, slots=5, seed=1):
    q, k, v, g, beta, _ = _inputs(len(idx), 1, widths, feat, state=False, seed=seed)
    cache = torch.randn(slots, 2, *widths, 4, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    return (q, k, v, g, beta), cache


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("feat", FEATURES)
@pytest.mark.parametrize("order", ORDERS)
def test_decode_strided_equals_contiguous(order, feat, layout):
    """Two steps each (the second finds the first's launch plan): outputs and caches equal."""
    xs, cache = _decode_case(ORDERS[order], feat, idx=(3, -1, 0))
    idx = torch.tensor([3, -1, 0], dtype=torch.int32, device=DEVICE)
    strided = _strided((*xs, None), layout)[:5]
    c_ref, c = cache.clone(), cache.clone()
    for step in range(2):
        o_ref = rtcompile.running_tensor_decode_(*xs, state_cache=c_ref, state_indices=idx, l2norm=True)
        o = rtcompile.running_tensor_decode_(*strided, state_cache=c, state_indices=idx, l2norm=True)
        assert torch.equal(o, o_ref), f"step {step}: output"
        assert torch.equal(c, c_ref), f"step {step}: cache"


def test_decode_strided_indices():
    """state_indices as a strided view (every other entry of a longer tensor) address the
    same slots as a contiguous copy."""
    xs, cache = _decode_case((2, 3), "gated-delta", idx=(4, 0, 2))
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    idx_strided = torch.tensor([4, 1, 0, 3, 2, 1], dtype=torch.int32, device=DEVICE)[::2]
    assert not idx_strided.is_contiguous() and torch.equal(idx_strided, idx)
    c_ref, c = cache.clone(), cache.clone()
    o_ref = rtcompile.running_tensor_decode_(*xs, state_cache=c_ref, state_indices=idx)
    o = rtcompile.running_tensor_decode_(*xs, state_cache=c, state_indices=idx_strided)
    assert torch.equal(o, o_ref) and torch.equal(c, c_ref)


@pytest.mark.parametrize("feat", FEATURES)
@pytest.mark.parametrize("order", ORDERS)
def test_decode_int64_indices_equal_int32(order, feat):
    """The same step with int32 and with int64 indices (a padding entry among them), through
    the public function and the custom op; int32 first, so the int64 call finds a plan cache
    holding the int32 one."""
    xs, cache = _decode_case(ORDERS[order], feat, idx=(2, -1, 4, 0))
    idx = [2, -1, 4, 0]
    outs = {}
    for dtype in (torch.int32, torch.int64):
        c = cache.clone()
        o = rtcompile.running_tensor_decode_(*xs, state_cache=c, state_indices=torch.tensor(idx, dtype=dtype,
                                                                                           device=DEVICE))
        c_op = cache.clone()
        o_op = running_tensor_decode_op(list(xs[0]), list(xs[1]), *xs[2:], c_op,
                                        torch.tensor(idx, dtype=dtype, device=DEVICE), 0.5, False, "")
        outs[dtype] = (o, c, o_op, c_op)
    for a, b in zip(outs[torch.int32], outs[torch.int64]):
        assert torch.equal(a, b)
    assert not torch.equal(outs[torch.int32][1], cache), "the step changed nothing"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_decode_index_checks_both_widths(dtype):
    """Range and distinctness are checked whatever the index width; other dtypes are refused."""
    xs, cache = _decode_case((2, 3), "plain", idx=(0, 1))
    call = lambda idx, dt=dtype: rtcompile.running_tensor_decode_(
        *xs, state_cache=cache, state_indices=torch.tensor(idx, dtype=dt, device=DEVICE))
    with pytest.raises(ValueError, match="out of range"):
        call([0, 5])
    with pytest.raises(ValueError, match="repeated slot"):
        call([1, 1])
    with pytest.raises(TypeError, match="state_indices: dtype torch.int16; allowed: torch.int32, torch.int64"):
        call([0, 1], torch.int16)
