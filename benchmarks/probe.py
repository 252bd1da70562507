"""Exploratory GPU probe: correctness on the GPU, then times of a few kernel variants.

Used to choose the default variants before the tuner exists; the recorded numbers come from
``rtcompile bench``. Usage (GPU machine): ``python benchmarks/probe.py [--quick]``.
Prints one table row per (case, variant): ms, GB/s or TFLOP/s, error against float64.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from rtcompile.kernels.reference import kron_features, running_tensor_chunk_ref
from rtcompile.kernels.triton_fwd import running_tensor_decode_, running_tensor_fwd
from rtcompile.kernels.variants import ChunkVariant, RecurrentVariant

DEV = "cuda"


def inputs(B, T, H, widths, V, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)
    q = [r(B, T, H, w).to(dtype) for w in widths]
    k = [r(B, T, H, w).to(dtype) for w in widths]
    v = r(B, T, H, V).to(dtype)
    g = torch.nn.functional.logsigmoid(r(B, T, H)) * 0.1
    beta = torch.sigmoid(r(B, T, H))
    return q, k, v, g, beta


def time_ms(fn, warmup=3, reps=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def graph_ms(fn, calls=20, reps=10):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    return time_ms(g.replay, warmup=2, reps=reps) / calls


def rel_rms(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float(((a - b).pow(2).mean() / b.pow(2).mean()).sqrt())


def copy_bw(nbytes):
    src = torch.empty(nbytes // 4, device=DEV)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6  # GB/s


def graph_copy_bw(nbytes, n):
    """Same-size copies, captured in a graph and rotated over n buffers, as decode is timed."""
    srcs = [torch.empty(nbytes // 4, device=DEV) for _ in range(n)]
    dsts = [torch.empty(nbytes // 4, device=DEV) for _ in range(n)]
    ms = graph_ms(lambda i: dsts[i % n].copy_(srcs[(i + 1) % n]))
    return 2 * nbytes / ms / 1e6


def check(widths, mode, variant, dtype=torch.float32):
    q, k, v, g, beta = inputs(2, 200, 2, widths, 64, dtype=dtype, seed=1)
    s0 = torch.randn(2, 2, *widths, 64, device=DEV)
    o, s = running_tensor_fwd(q, k, v, g, beta, initial_state=s0, output_final_state=True, l2norm=True,
                              mode=mode, variant=variant)
    up = lambda x: x.double().cpu()
    o_ref, s_ref = running_tensor_chunk_ref([up(x) for x in q], [up(x) for x in k], up(v), up(g), up(beta),
                                            initial_state=up(s0), output_final_state=True, l2norm=True)
    return rel_rms(o, o_ref), rel_rms(s, s_ref)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rows = []
    big = copy_bw(2 << 30)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} copy {big:.0f} GB/s", flush=True)
    B, T, H, V = 8, 4096, 8, 64
    CV, RV = ChunkVariant, RecurrentVariant
    prefill = {
        (16, 16): [
            CV(32, 256, 16, num_warps=4, num_stages=1),
            CV(64, 256, 16, num_warps=8, num_stages=1),
            CV(32, 256, 32, num_warps=8, num_stages=1),
            CV(64, 64, 16, num_warps=4, num_stages=1),
            CV(32, 128, 16, num_warps=4, num_stages=1),
            CV(64, 128, 32, num_warps=8, num_stages=1),
            CV(32, 256, 16, num_warps=4, num_stages=1, fuse_prepare=True),
            CV(16, 256, 16, num_warps=4, num_stages=1),
        ],
        (32, 32): [CV(64, 64, 16, num_warps=4, num_stages=1), CV(32, 128, 16, num_warps=4, num_stages=1),
                   CV(64, 128, 16, num_warps=8, num_stages=1), CV(32, 256, 16, num_warps=8, num_stages=1)],
        (64, 64): [CV(64, 64, 16, num_warps=4, num_stages=1), CV(64, 128, 16, num_warps=8, num_stages=1),
                   CV(32, 128, 32, num_warps=4, num_stages=1), CV(64, 256, 16, num_warps=8, num_stages=1)],
        (16, 16, 16): [CV(64, 256, 16, num_warps=8, num_stages=1), CV(32, 256, 16, num_warps=4, num_stages=1),
                       CV(32, 512, 16, num_warps=8, num_stages=1)],
    }
    if args.quick:
        prefill = {k: v[:2] for k, v in list(prefill.items())[:2]}
    for widths, variants in prefill.items():
        q, k, v, g, beta = inputs(B, T, H, widths, V)
        for var in variants:
            mode = "chunk" if isinstance(var, ChunkVariant) else "recurrent"
            name = f"prefill {'x'.join(map(str, widths))} {mode} {var}"
            try:
                err = check(widths, mode, var)
                ms = graph_ms(lambda i: running_tensor_fwd(q, k, v, g, beta, l2norm=True, output_final_state=True,
                                                           mode=mode, variant=var), calls=3, reps=10)
                rows.append((name, ms, f"rms32 {err[0]:.1e}/{err[1]:.1e}"))
            except Exception as exc:  # a variant that fails to compile is a row, not the end
                rows.append((name, float("nan"), f"FAILED {type(exc).__name__}: {str(exc)[:120]}"))
            print(rows[-1], flush=True)
        if len(widths) == 2 and widths[0] * widths[1] <= 256:
            try:
                from fla.ops.gated_delta_rule import chunk_gated_delta_rule

                qq, kk = kron_features(q), kron_features(k)
                ms = graph_ms(lambda i: chunk_gated_delta_rule(qq, kk, v, g, beta, scale=(qq.shape[-1]) ** -0.5,
                                                               output_final_state=True, use_qk_l2norm_in_kernel=True),
                              calls=3, reps=10)
                rows.append((f"prefill {widths} fla chunk_gated_delta_rule", ms, ""))
            except Exception as exc:
                rows.append((f"prefill {widths} fla", float("nan"), f"{type(exc).__name__}: {str(exc)[:100]}"))
            print(rows[-1], flush=True)
    for widths, Bd, variants in [
        ((16, 16), 256, [RV(256, 32, 8), RV(256, 64, 8), RV(256, 32, 4), RV(256, 16, 8), RV(256, 64, 16)]),
        ((32, 32), 32, [RV(1024, 16, 8), RV(1024, 32, 16), RV(1024, 16, 16), RV(512, 32, 8), RV(1024, 8, 8)]),
        ((16, 16), 32, [RV(256, 16, 2), RV(256, 16, 4), RV(256, 32, 4), RV(256, 32, 8)]),
    ]:
        K = widths[0] * widths[1]
        state_bytes = Bd * H * K * V * 4
        n_caches = max(2, (4 * 60 << 20) // state_bytes + 1)  # rotate: > 4x the 60 MB L2
        caches = [torch.randn(Bd, H, *widths, V, device=DEV) for _ in range(n_caches)]
        same = graph_copy_bw(state_bytes, n_caches)
        q, k, v, g, beta = inputs(Bd, 1, H, widths, V)
        idx = torch.arange(Bd, dtype=torch.int32, device=DEV)
        for var in variants:
            name = f"decode {'x'.join(map(str, widths))} B{Bd} {var}"
            try:
                ms = graph_ms(lambda i: running_tensor_decode_(q, k, v, g, beta, state_cache=caches[i % n_caches],
                                                               state_indices=idx, l2norm=True, validate=False,
                                                               variant=var))
                gbps = 2 * state_bytes / ms / 1e6
                rows.append((name, ms, f"{gbps:.0f} GB/s = {gbps / big:.0%} big copy, {gbps / same:.0%} same-size copy ({same:.0f})"))
            except Exception as exc:
                rows.append((name, float("nan"), f"FAILED {type(exc).__name__}: {str(exc)[:120]}"))
            print(rows[-1], flush=True)
    # eager overhead of one small decode call
    q, k, v, g, beta = inputs(4, 1, 2, (4, 4), 16)
    cache = torch.randn(4, 2, 4, 4, 16, device=DEV)
    idx = torch.arange(4, dtype=torch.int32, device=DEV)
    for validate in (True, False):
        f = lambda: running_tensor_decode_(q, k, v, g, beta, state_cache=cache, state_indices=idx, l2norm=True, validate=validate)
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            f()
        torch.cuda.synchronize()
        rows.append((f"decode eager overhead validate={validate}", (time.perf_counter() - t0) / 500 * 1e3, "ms/call wall"))
    print("\n=== summary ===")
    for name, ms, note in rows:
        print(f"{ms:9.4f} ms  {name}  {note}")


if __name__ == "__main__":
    sys.exit(main())
