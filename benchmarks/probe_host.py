"""Probe: where the host time of one eager decode call goes (o3 16x16, B1, H8, fp32 state).

Times, per call and median of several rounds, the whole ``running_tensor_decode_`` call and
its parts in isolation: the plan key, the output allocation, the alignment check, the compiled
launcher alone and Triton's full ``kernel[grid](...)`` path. Exploration only: the recorded
eager figure comes from ``rtcompile bench`` (its ``eager`` case).

    python3 benchmarks/probe_host.py          (GPU only)
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch

from rtcompile.kernels.args import factor_args
from rtcompile.kernels.launch import running_tensor_decode_
from rtcompile.kernels.recurrent import DECODE_PLANS, decode_key, fused_recurrent_running_tensor_fwd_kernel


def per_call_us(fn, n=2000, rounds=7) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_host: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, N, H, V = "cuda", 1, 8, 64
    q = [torch.randn(N, 1, H, 16, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    k = [torch.randn(N, 1, H, 16, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    v = torch.randn(N, 1, H, V, device=dev, dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(N, 1, H, device=dev))
    beta = torch.rand(N, 1, H, device=dev)
    cache = torch.zeros(4, H, 16, 16, V, device=dev)
    idx = torch.arange(N, dtype=torch.int32, device=dev)
    call = lambda: running_tensor_decode_(q, k, v, g, beta, state_cache=cache, state_indices=idx, l2norm=True,
                                          validate=False)
    call()
    plan = next(iter(DECODE_PLANS.values()))
    o = torch.empty_like(v)
    args = (*factor_args(q), *factor_args(k), v, g, beta, o, cache, cache, idx, None, plan.scale, 1)
    tensors = args[:-3]  # the None in cu_seqlens' place is a constexpr of the compiled kernel
    rows = {
        "whole call (validate=False)": call,
        "plan key": lambda: decode_key(q, k, v, g, beta, cache, idx, None, True, None),
        "plan key + lookup": lambda: DECODE_PLANS.get(decode_key(q, k, v, g, beta, cache, idx, None, True, None)),
        "torch.empty output": lambda: torch.empty(v.shape, dtype=v.dtype, device=v.device),
        "torch.empty_like output (the call's)": lambda: torch.empty_like(v),
        "alignment check": lambda: not any(t.data_ptr() & 15 for t in tensors),
        "compiled launcher, raw addresses": lambda: plan._runner(*[t.data_ptr() for t in tensors], *args[-3:],
                                                                 *plan._tail),
        "compiled launcher, raw addresses, stream=": lambda: plan._runner(
            *[t.data_ptr() for t in tensors], *args[-3:], *plan._tail,
            stream=torch._C._cuda_getCurrentRawStream(0)),
        "plan.launch (check + compiled launcher)": lambda: plan.launch(args),
        "compiled launcher alone": lambda: plan._runner(*args, *plan._tail),
        "triton kernel[grid](...)": lambda: fused_recurrent_running_tensor_fwd_kernel[plan.grid](*args, **plan.consts),
    }
    print(f"{'part':54} us/call")
    for name, fn in rows.items():
        print(f"{name:54} {per_call_us(fn):7.2f}", flush=True)
    # the bench's own eager call (its inputs, scale given, bf16 beta) and its own timer, beside
    # this probe's timer: the two disagreed by 14 us in one process on 2026-11-30d
    import gc

    from rtcompile.bench.core import BenchContext, eager_cases
    from rtcompile.bench.measure import (
        IMPL_RT,
        _decode_calls,
        _decode_setup,
        wall_per_call,
    )

    case = eager_cases()[0]
    st = _decode_setup(dataclasses.replace(case, phase="decode"), BenchContext(torch.device(dev), l2_bytes=0))
    bench_call = _decode_calls(IMPL_RT, case, st)[0][0]
    ctx = BenchContext(torch.device(dev), l2_bytes=0)
    print(f"{'bench call, this timer':42} {per_call_us(bench_call):7.2f}")
    print(f"{'bench call, bench timer (wall_per_call)':42} {wall_per_call(bench_call, ctx) * 1e6:7.2f}")
    print(f"{'this call, bench timer':42} {wall_per_call(call, ctx) * 1e6:7.2f}")
    gc.freeze()
    print(f"{'bench call, bench timer, gc.freeze()':42} {wall_per_call(bench_call, ctx) * 1e6:7.2f}")
    gc.disable()
    print(f"{'bench call, bench timer, gc off':42} {wall_per_call(bench_call, ctx) * 1e6:7.2f}")
    gc.enable()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
