"""Probe: where the device time of one prefill call goes, kernel by kernel.

Runs the default chunk variant (and any probe_streamed.py neighbours named with --names) on the
bench's prefill shape (B8 T4096 H8 d_v 64, bf16, gate + delta + l2norm) under the PyTorch
profiler and prints each kernel's mean device time per call: the parallel prepare kernel
against the sequential one, so effort goes where the time is. Exploration only: the recorded
numbers come from ``rtcompile bench``.

    python3 benchmarks/probe_split.py [--widths 16 16] [--names C128-rows ...] [--fla]     (GPU only)

With --fla, fla's chunk_gated_delta_rule on the same problem (materialised Kronecker keys,
K <= 256) is split too: its chain kernel against its parallel ones.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict

import torch
from probe_streamed import NEIGHBOURS, _run_unchecked

from rtcompile.bench.core import Case
from rtcompile.bench.measure import _fla_ops, kronify, make_inputs
from rtcompile.kernels import variants as V
from rtcompile.kernels.triton_fwd import running_tensor_fwd

CALLS = 5


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", action="append", default=None,
                    help="key widths of one case (repeatable; default: 16 16, 32 32, 64 64, 16 16 16)")
    ap.add_argument("--names", nargs="+", default=(), help="probe_streamed.py neighbours to split too")
    ap.add_argument("--fla", action="store_true", help="split fla's chunk_gated_delta_rule too (K <= 256)")
    ap.add_argument("--prepare-parts", action="store_true",
                    help="time the default's prepare kernel with parts of its work switched off (wrong outputs: "
                         "timing only): no phi(K) store, no delta rule (no Grams of A, no solve), neither")
    ap.add_argument("--registers", action="store_true",
                    help="after each variant, the registers and spills of the chunk kernels it compiled")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_split: needs a CUDA GPU", file=sys.stderr)
        return 2
    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    V.CHUNK_MAX_EST_REGS = 10**6  # exploration: ptxas spills instead, the timing decides
    changes_of = dict(NEIGHBOURS)
    print(f"{'case':9} {'variant':30} {'kernel':42} {'ms/call':>8}")
    for widths in args.widths or ([16, 16], [32, 32], [64, 64], [16, 16, 16]):
        case = Case("probe", "prefill", tuple(widths), 8, 4096)
        shape = V.KernelShape(case.key_widths, case.V)
        inp = make_inputs(case, "cuda", seed=11)
        default = V.ChunkVariant.default(shape, limit)
        names = ("default", *args.names, *(("fla",) if args.fla and shape.key_dim <= 256 else ()))
        for name in names:
            if name == "fla":
                kin, op = kronify(inp), _fla_ops().chunk_gated_delta_rule
                _profile(widths, name, lambda x=kin, op=op: op(q=x.q[0], k=x.k[0], v=x.v, g=x.g, beta=x.beta, scale=x.scale,
                                                            output_final_state=True, use_qk_l2norm_in_kernel=True))
                continue
            if name != "default" and name not in changes_of:
                print(f"unknown neighbour {name!r}", file=sys.stderr)
                return 2
            v = dataclasses.replace(default, **changes_of.get(name, {}))
            if (why := v.check(shape, 10**9)) is not None:
                print(f"{'x'.join(map(str, widths)):9} {name:30} refused: {why}")
                continue
            run = lambda v=v, x=inp: _run_unchecked(lambda vv: running_tensor_fwd(
                x.q, x.k, x.v, x.g, x.beta, variant=vv, scale=x.scale, output_final_state=True,
                l2norm=True, mode="chunk"), v)
            try:
                run()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 -- one variant's failure is a row
                print(f"{'x'.join(map(str, widths)):9} {name:30} failed: {type(exc).__name__}: {str(exc)[:90]}")
                continue
            seen = _compiled() if args.registers else {}
            _profile(widths, name, run)
            if args.registers:
                for (kname, key), (regs, spills, warps) in _compiled().items():
                    if (kname, key) not in seen:
                        print(f"{'x'.join(map(str, widths)):9} {name:30} {kname:42} regs {regs} spills {spills} "
                              f"warps {warps}")
        if args.prepare_parts:
            _prepare_parts(widths, inp, default)
    return 0


# the prepare kernel's parts, switched off one at a time (constexpr overrides; outputs wrong)
PREPARE_PARTS = (
    ("prep-no-phi", {"STORE_PHI": False}),
    ("prep-no-delta", {"USE_BETA": False}),
    ("prep-gc-only", {"STORE_PHI": False, "USE_BETA": False}),
    ("prep-rows-solve", {"SOLVE": 0}),
    ("prep-no-phi-w2", {"STORE_PHI": False, "num_warps": 2}),
    ("prep-no-phi-w4", {"STORE_PHI": False, "num_warps": 4}),
    # phi(K) stored GROUP indices of axis 1 at a time (a [C, GROUP] load of x1, one [C, GROUP TW] block)
    ("prep-kg2", {"KEY_GROUP": 2}),
    ("prep-kg4", {"KEY_GROUP": 4}),
    ("prep-kg8", {"KEY_GROUP": 8}),
    ("prep-kg4-w2", {"KEY_GROUP": 4, "num_warps": 2}),
    ("prep-kg8-w2", {"KEY_GROUP": 8, "num_warps": 2}),
    ("prep-kg16-w4", {"KEY_GROUP": 16, "num_warps": 4}),
    ("prep-no-delta-kg4", {"KEY_GROUP": 4, "USE_BETA": False}),
)


def _prepare_parts(widths, inp, default) -> None:
    from rtcompile.kernels import triton_fwd

    real = triton_fwd.chunk_prepare_running_tensor_kernel

    class Patched:
        def __init__(self, over):
            self.over = over

        def __getitem__(self, grid):
            return lambda *a, **kw: real[grid](*a, **{**kw, **self.over})

    for name, over in PREPARE_PARTS:
        triton_fwd.chunk_prepare_running_tensor_kernel = Patched(over)
        try:
            run = lambda x=inp: running_tensor_fwd(x.q, x.k, x.v, x.g, x.beta, variant=default, scale=x.scale,
                                                   output_final_state=True, l2norm=True, mode="chunk")
            _profile(widths, name, run)
        except Exception as exc:  # noqa: BLE001 -- one part's failure is a row
            print(f"{'x'.join(map(str, widths)):9} {name:30} failed: {type(exc).__name__}: {str(exc)[:90]}")
        finally:
            triton_fwd.chunk_prepare_running_tensor_kernel = real


def _compiled() -> dict:
    """(kernel name, cache key) -> (registers, spills, warps) of every chunk kernel compiled so far."""
    from rtcompile.kernels import chunk

    out = {}
    for fn in (chunk.chunk_prepare_running_tensor_kernel, chunk.chunk_running_tensor_fwd_kernel,
               chunk.chunk_state_running_tensor_kernel, chunk.chunk_output_running_tensor_kernel):
        for dev_cache in getattr(fn, "device_caches", {}).values():
            for key, ck in dev_cache[0].items():
                out[(fn.__name__, key)] = (ck.n_regs, ck.n_spills, getattr(ck.metadata, "num_warps", "?"))
    return out


def _profile(widths, name: str, run) -> None:
    """Print each CUDA kernel's mean device time per call of ``run`` (after one warm-up call)."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            run()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:42]] += ev.device_time_total / 1e3 / CALLS
    for kname, ms in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"{'x'.join(map(str, widths)):9} {name:30} {kname:42} {ms:8.3f}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
