"""Per-kernel GPU time of one forward + backward (torch.profiler), to see where the time goes.

    python benchmarks/profile_backward.py [--widths 16 16] [--variant "field=value,field=value" ...]

B8 T4096 H8 d_v 64 bf16, gate + delta rule + l2norm, as ``train_step.py``. Per variant (the
backward's default config with those fields changed; none: the default): 3 warm-up calls, then
5 profiled calls; prints each kernel's mean time per call (ms), largest first, and their sum.
``--forward``: the forward alone under ``torch.no_grad`` (the prefill's kernel split, issue 22),
with the forward's own config (tuned table, else default; ``--variant`` does not apply).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from rtcompile.kernels import chunk_backward
    from train_step import allow_refused_configs, field_value  # this folder: the script's own

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[16, 16])
    ap.add_argument("--variant", action="append", default=[], metavar="FIELD=VALUE,...")
    ap.add_argument("--forward", action="store_true", help="the forward alone (no grad)")
    ap.add_argument("--spills", action="store_true",
                    help="print each compiled backward kernel's registers, spills and shared memory per variant")
    ap.add_argument("--unchecked", action="store_true",
                    help="run variants the config check refuses (e.g. on its register estimate), to measure them")
    args = ap.parse_args()
    if args.unchecked:
        allow_refused_configs()
    if args.forward:
        _profile(args.widths, {}, forward=True)
        return 0
    base = chunk_backward.default_backward
    for variant in args.variant or [""]:
        changes = {}
        for item in filter(None, variant.split(",")):
            name, _, value = item.partition("=")
            changes[name] = field_value(value)
        # every argument passed on as given (the launcher passes chunk_size third since 57afb3f)
        chunk_backward.default_backward = lambda *a, c=changes, **kw: dataclasses.replace(base(*a, **kw), **c)
        try:
            seen = _compiled() if args.spills else None
            _profile(args.widths, changes)
            if args.spills:
                for name, kernel in [(k, c) for k, c in _compiled().items() if k not in seen]:
                    print(f"  {name[0]}: {kernel.n_regs} registers, {kernel.n_spills} spilled, "
                          f"{kernel.metadata.shared} B shared, {kernel.metadata.num_warps} warps")
        except Exception as exc:  # a variant that does not compile or fit is a line, not the end
            print(f"widths {args.widths} changes {changes}: {type(exc).__name__}: {str(exc)[:200]}")
    return 0


def _compiled() -> dict:
    """Every compiled variant of the backward's Triton kernels so far: {(kernel name, key): kernel}."""
    import triton

    from rtcompile.kernels import (
        chunk_backward_factors, chunk_backward_grads, chunk_backward_split, chunk_backward_state, chunk_prepare, chunk_split,
    )

    found = {}
    for module in (chunk_backward_factors, chunk_backward_grads, chunk_backward_split, chunk_backward_state, chunk_prepare,
                   chunk_split):
        for name, fn in vars(module).items():
            if isinstance(fn, triton.runtime.jit.JITFunction) and name.endswith("kernel"):
                for caches in fn.device_caches.values():
                    found.update({(name, key): kernel for key, kernel in caches[0].items()})
    return found


def _profile(widths, changes, forward: bool = False):
    import torch
    from torch.profiler import ProfilerActivity, profile

    import rtcompile

    B, T, H, V = 8, 4096, 8, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    q = [r(B, T, H, w).requires_grad_() for w in widths]
    k = [r(B, T, H, w).requires_grad_() for w in widths]
    v = r(B, T, H, V).requires_grad_()
    g = (-torch.rand(B, T, H, device="cuda", generator=gen) * 0.1).to(torch.bfloat16).requires_grad_()
    beta = torch.rand(B, T, H, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    do = torch.randn_like(v)

    def call():
        if forward:
            with torch.no_grad():
                rtcompile.running_tensor(q, k, v, g, beta, l2norm=True, output_final_state=True, mode="chunk",
                                         backend="triton")
            return
        o, s = rtcompile.running_tensor(q, k, v, g, beta, l2norm=True, output_final_state=True, mode="chunk",
                                        backend="triton")
        torch.autograd.backward([o, s], [do, torch.ones_like(s)])

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    n = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    total = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:  # a kernel: its range is device time
            total[e.name] += e.time_range.elapsed_us() / 1e3 / n  # ms per call
    what = "forward" if forward else "fwd+bwd"
    print(f"widths {widths} changes {changes}: kernel ms per {what}, sum {sum(total.values()):.3f}")
    for name, ms in total.most_common(6):
        print(f"  {ms:8.3f}  {name[:90]}")


if __name__ == "__main__":
    sys.exit(main())
