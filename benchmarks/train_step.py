"""Time forward + backward of the chunk form on the GPU, beside fla on materialised keys.

    python benchmarks/train_step.py [--fla] [--out FILE.json]

B8 T4096 H8 d_v 64, bf16 inputs, gate + delta rule + l2norm, zero initial state, loss on the
output and the final state. Per case: ``rtcompile.running_tensor(..., backend="triton")`` with
inputs that require grad, then ``torch.autograd.backward``; eager calls (the host time is in
the figure), CUDA events around 10 calls, median of 7 repeats after 3 warm-up calls; the
forward alone is timed the same way under ``torch.no_grad``. Peak extra memory: the most the
allocator held during one forward + backward beyond what it held before (inputs and their
gradients' buffers excluded). ``--fla``: fla-core's ``chunk_gated_delta_rule`` with its
in-kernel l2norm on phi(k) (K <= 256), with its Hopper guard for Triton 3.4-3.7 switched off
for timing only (``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True``: its gradients may then
be wrong, fla #640). Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = [("o2 64", (64,)), ("o2 128", (128,)), ("o2 256", (256,)), ("o3 16x16", (16, 16)), ("o3 32x32", (32, 32)),
         ("o3 64x64", (64, 64)), ("o4 16x16x16", (16, 16, 16))]
B, T, H, V = 8, 4096, 8, 64
REPEATS, CALLS = 7, 10


def _inputs(widths, seed):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    q = [r(B, T, H, w) for w in widths]
    k = [r(B, T, H, w) for w in widths]
    g = (-torch.rand(B, T, H, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    beta = torch.rand(B, T, H, device="cuda", generator=gen).to(torch.bfloat16)
    return q, k, r(B, T, H, V), g, beta


def _kron(xs):
    out = xs[0]
    for x in xs[1:]:
        out = (out[..., :, None] * x[..., None, :]).flatten(-2)
    return out.contiguous()


def _time(call) -> float:
    import torch

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    out = []
    for _ in range(REPEATS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(CALLS):
            call()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / CALLS)
    return statistics.median(out)


def _peak(call) -> int:
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _train_call(fwd, leaves, do, dht):
    import torch

    def call():
        for x in leaves:
            x.grad = None
        o, s = fwd()
        torch.autograd.backward([o, s], [do, dht])
    return call


def _say(*parts) -> None:
    """Progress on stderr as it happens (a run cut at its time limit still shows how far it got)."""
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


def field_value(text: str):
    """A ``--set`` value as the config field takes it: an int, True / False / None, else the text."""
    return int(text) if text.isdigit() else {"True": True, "False": False, "None": None}.get(text, text)


def allow_refused_configs() -> None:
    """``--unchecked``: the launcher runs configs the backward's check refuses (exploration only)."""
    from rtcompile.kernels import chunk_backward

    chunk_backward.BackwardConfig.check = lambda self, shape, smem_limit=None: None


def override_default(changes: dict) -> str:
    """Make the backward's default config (``chunk_backward.default_backward``, which the launcher
    takes when no tuned entry applies) the default with ``changes`` applied; returns the row label."""
    import dataclasses

    from rtcompile.kernels import chunk_backward

    base = chunk_backward.default_backward
    # every argument passed on as given (the launcher passes chunk_size third since 57afb3f)
    chunk_backward.default_backward = lambda *a, **kw: dataclasses.replace(base(*a, **kw), **changes)
    return "rtcompile[" + ",".join(f"{k}={v}" for k, v in changes.items()) + "]"


def measure(fla: bool, only: set[str] | None = None, changes: dict | None = None) -> list[dict]:
    import torch

    import rtcompile

    label = "rtcompile"
    if changes:  # the backward's default config with fields changed (an experiment's row)
        label = override_default(changes)

    rows = []
    for name, widths in CASES:
        if only and name not in only:
            continue
        _say(name, "start")
        q, k, v, g, beta = _inputs(widths, 1)
        leaves = [x.requires_grad_() for x in (*q, *k, v, g, beta)]
        do = torch.randn_like(v)
        dht = torch.randn(B, H, *widths, V, device="cuda")

        def ours():
            return rtcompile.running_tensor(q, k, v, g, beta, l2norm=True, output_final_state=True, mode="chunk",
                                            backend="triton")
        row = {"case": name, "impl": label}
        try:
            with torch.no_grad():
                row["forward_s"] = _time(ours)
            call = _train_call(ours, leaves, do, dht)
            row["train_s"], row["peak_extra_bytes"] = _time(call), _peak(call)
        except (ValueError, NotImplementedError, RuntimeError) as exc:  # a refusal is a row, not the end
            row["error"] = " ".join(str(exc).split())[:160]
        rows.append(row)
        _say(name, label, row)
        K = 1
        for w in widths:
            K *= w
        if fla and K <= 256:
            import fla.ops.common.chunk_o as chunk_o
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            chunk_o.TRITON_ABOVE_3_7_1 = True  # timing only: see the module docstring
            qk = [_kron([x.detach() for x in q]).requires_grad_(), _kron([x.detach() for x in k]).requires_grad_()]
            gf = g.detach().float().requires_grad_()
            vb, bb = v.detach().requires_grad_(), beta.detach().requires_grad_()
            dht_f = dht.reshape(B, H, K, V)

            def theirs():
                return chunk_gated_delta_rule(qk[0], qk[1], vb, gf, bb, use_qk_l2norm_in_kernel=True,
                                              output_final_state=True)
            frow = {"case": name, "impl": "fla"}
            with torch.no_grad():
                frow["forward_s"] = _time(theirs)
            call = _train_call(theirs, [*qk, vb, gf, bb], do, dht_f)
            frow["train_s"], frow["peak_extra_bytes"] = _time(call), _peak(call)
            rows.append(frow)
            _say(name, "fla", frow)
        del q, k, v, g, beta, leaves
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fla", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--cases", help="comma-separated case names (default: all), e.g. 'o3 16x16,o2 64'")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="change a field of the backward's default config (a string, or an int)")
    ap.add_argument("--unchecked", action="store_true",
                    help="run a --set config the check refuses (e.g. on its register estimate), to measure it")
    args = ap.parse_args()
    changes = {}
    for item in args.set:
        name, _, value = item.partition("=")
        changes[name] = field_value(value)
    try:
        import torch
    except ImportError:
        print("train_step: needs torch", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("train_step: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.unchecked:
        allow_refused_configs()
    rows = measure(args.fla, set(args.cases.split(",")) if args.cases else None, changes)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"forward + backward, B{B} T{T} H{H} d_v {V} bf16 (eager, median of {REPEATS}x{CALLS})")
    for col in ("case", "impl", "forward ms", "fwd+bwd ms", "fwd+bwd / fwd", "peak extra MiB"):
        table.add_column(col, justify="left" if col in ("case", "impl") else "right")
    for r in rows:
        if "error" in r:
            table.add_row(r["case"], r["impl"], "-", "-", "-", r["error"][:60])
            continue
        table.add_row(r["case"], r["impl"], f"{r['forward_s'] * 1e3:.3f}", f"{r['train_s'] * 1e3:.3f}",
                      f"{r['train_s'] / r['forward_s']:.2f}", f"{r['peak_extra_bytes'] / 2**20:.0f}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
