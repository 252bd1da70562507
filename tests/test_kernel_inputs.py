"""Bad input to the Triton launchers: a clear error before any allocation or launch."""

from __future__ import annotations

import pytest
import torch

from rtcompile.kernels import args
from rtcompile.kernels.chunk_resident import ResidentConfig
from rtcompile.kernels.chunk_streamed import StreamedConfig
from rtcompile.kernels.launch import running_tensor_decode_, running_tensor_fwd
from rtcompile.kernels.recurrent import RecurrentConfig

from conftest import make_inputs


@pytest.fixture(autouse=True)
def no_allocation(monkeypatch):
    """Errors must come before any output is allocated (and so before any launch)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def refuse(*a, **kw):
        raise AssertionError("allocated before validation finished")

    monkeypatch.setattr(args, "empty", refuse)
    monkeypatch.setattr(args, "empty_like", refuse)


def _args(B=2, T=5, widths=(3, 4)):
    q, k, v, g, beta, _ = make_inputs(B, T, 2, widths, 4, dtype=torch.float32)
    return q, k, v, g, beta


def test_non_contiguous_factor_passes_validation():
    """A strided view is accepted (copied at the launch boundary: tests/test_conventions.py
    checks the values); validation then reaches the output's allocation."""
    q, k, v, g, beta = _args()
    q[1] = torch.randn(2, 5, 4, 2).transpose(2, 3)  # [B, T, H=2, d=4] view, not contiguous
    with pytest.raises(AssertionError, match="allocated"):
        running_tensor_fwd(q, k, v, g, beta)
    q[1] = torch.randn(2, 5, 3, 2).transpose(2, 3)  # strided and of the wrong width: refused first
    with pytest.raises(ValueError, match=r"q\[1\] and k\[1\]: widths 3 and 4 differ"):
        running_tensor_fwd(q, k, v, g, beta)


def test_order_too_high_for_kernels():
    q, k, v, g, beta = _args(widths=(2, 2, 2, 2))
    with pytest.raises(ValueError, match="orders 2-4"):
        running_tensor_fwd(q, k, v, g, beta)


def test_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA device"):
        running_tensor_fwd(*_args())


@pytest.mark.parametrize(
    "kwargs, exc, needle",
    [
        (dict(mode="fast"), ValueError, "mode: got 'fast'; allowed: chunk, recurrent"),
        (dict(variant=ResidentConfig(chunk_size=24, block_v=16)), ValueError, "chunk_size=24; allowed: a power of two"),
        (dict(variant=RecurrentConfig(block_k=16, block_v=4)), TypeError,
         "variant: expected one of ResidentConfig, StreamedConfig, FusedConfig, SplitConfig, got RecurrentConfig"),
        (dict(mode="recurrent", variant=ResidentConfig(chunk_size=16, block_v=16)), TypeError,
         "variant: expected one of RecurrentConfig, got ResidentConfig"),
        (dict(chunk_size=32, variant=ResidentConfig(chunk_size=16, block_v=16)), ValueError,
         "chunk_size: 32 conflicts with the variant's 16"),
        (dict(chunk_size=16.0), TypeError, "chunk_size: expected an int or None, got float"),
        (dict(mode="recurrent", variant=RecurrentConfig(block_k=64, block_v=4)), ValueError,
         r"block_k=64; allowed: at most K rounded up \(16\)"),
        (dict(variant=StreamedConfig(chunk_size=16, block_k=16, block_v=16)), ValueError,
         "block_k=16; allowed: 16 <= block_k < K = 12"),
        (dict(mode="recurrent", chunk_size=32), ValueError, "chunk_size: got 32 with mode='recurrent'"),
    ],
    ids=["mode", "chunk-24", "recurrent-config-for-chunk", "chunk-config-for-recurrent", "chunk-conflict",
         "chunk-float", "block-k-too-big", "streamed-covers-k", "chunk-size-for-recurrent"],
)
def test_bad_options(kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        running_tensor_fwd(*_args(), **kwargs)


def _decode(idx, cache_shape=(4, 2, 3, 4, 4), T=1, idx_dtype=torch.int32):
    q, k, v, g, beta = _args(B=len(idx), T=T)
    return running_tensor_decode_(q, k, v, g, beta, state_cache=torch.zeros(cache_shape),
                                  state_indices=torch.tensor(idx, dtype=idx_dtype))


@pytest.mark.parametrize(
    "kwargs, exc, needle",
    [
        (dict(idx=[0, 4]), ValueError, "out of range"),
        (dict(idx=[1, 1]), ValueError, "repeated slot"),
        (dict(idx=[0, 1], idx_dtype=torch.int16), TypeError, "allowed: torch.int32, torch.int64"),
        (dict(idx=[0, 1], cache_shape=(4, 2, 4, 3, 4)), ValueError, "state_cache: expected shape"),
        (dict(idx=[0, 1], T=2), ValueError, "T = 1"),
    ],
    ids=["slot-out-of-range", "repeated-slot", "int16-indices", "cache-shape", "two-tokens"],
)
def test_bad_decode(kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        _decode(**kwargs)


def test_padding_slots_are_allowed_by_validation():
    # -1 entries are padding (vLLM's PAD_SLOT_ID): validation passes and we reach allocation
    with pytest.raises(AssertionError, match="allocated"):
        _decode([-1, 2])


def test_decode_plan_cache_never_skips_validation():
    """A cached launch plan is found by the arguments' shapes, dtypes, devices and contiguity:
    a call that differs in any of them is validated afresh (and here refused, or, for a strided
    view, accepted) before allocating."""
    q, k, v, g, beta = _args(B=2, T=1)
    cache, idx = torch.zeros(4, 2, 3, 4, 4), torch.tensor([0, 1], dtype=torch.int32)
    call = lambda q=q, k=k, v=v, g=g, beta=beta, cache=cache: running_tensor_decode_(
        q, k, v, g, beta, state_cache=cache, state_indices=idx)
    with pytest.raises(AssertionError, match="allocated"):  # valid: the plan is cached, then allocation
        call()
    strided_v = torch.randn(2, 1, 4, 2).transpose(2, 3)  # same shape [2, 1, 2, 4], not contiguous
    with pytest.raises(AssertionError, match="allocated"):
        call(v=strided_v)
    with pytest.raises(ValueError, match=r"dtype torch.float32; allowed: torch.float64, v.s"):
        call(v=v.double())
    with pytest.raises(ValueError, match="state_cache: dtype"):
        call(cache=cache.to(torch.int32))
    strided_q = [q[0], torch.randn(2, 1, 3, 2).transpose(2, 3)]  # strided, width 3 against k[1]'s 4
    with pytest.raises(ValueError, match=r"q\[1\] and k\[1\]: widths 3 and 4 differ"):
        call(q=strided_q)
