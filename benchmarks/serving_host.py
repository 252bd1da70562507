"""Eager per-call time of the T = 1 paths (issue 21's "public running_tensor at T = 1" and
"running_tensor_decode_" rows): B1, H8, order 3 16x16, d_v 64, bf16 inputs, fp32 state.

On a GPU: the median over 7 rounds of (1000 back-to-back calls, then one synchronize) / 1000, so
host time and kernel time overlap as a serving loop sees them; fla's fused_recurrent step on
materialised keys beside it when fla is installed. Without a GPU (TRITON_INTERPRET=1 on the CPU
machine): host time only, every kernel launch replaced by a no-op, which is what the plan caches
change.

    python3 benchmarks/serving_host.py [--calls 1000] [--rounds 1] [--out results/serving_host.json]

``--rounds R`` times the whole table R times in turn (the rows interleaved, so a change in the
host's state between rounds reaches every row alike) and reports each row's rounds and their
median: on the H200 machine one row moved from 15 to 27 us between rounds of one process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def _time(fn, calls: int, sync) -> float:
    fn()
    sync()
    rounds = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        rounds.append((time.perf_counter() - t0) / calls)
    return statistics.median(rounds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=1, help="time the whole table this many times in turn")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    if not gpu:
        os.environ["TRITON_INTERPRET"] = "1"
    import rtcompile
    from rtcompile.kernels import decode_plan, recurrent

    if not gpu:  # host time only: the launches become no-ops
        from rtcompile.kernels import launch

        decode_plan.DecodePlan.launch = lambda self, tensors: None
        launch.LAUNCHERS[recurrent.RecurrentConfig] = lambda config, p, q, k, v, *a, **kw: torch.empty_like(v)
    dev = "cuda" if gpu else "cpu"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    B, H, widths, V, dt = 1, 8, (16, 16), 64, torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, generator=gen).to(dt)  # noqa: E731
    q, k, v = [r(B, 1, H, w) for w in widths], [r(B, 1, H, w) for w in widths], r(B, 1, H, V)
    g = -torch.rand(B, 1, H, device=dev, generator=gen)
    beta = torch.rand(B, 1, H, device=dev, generator=gen).to(dt)
    state = torch.zeros(B, H, *widths, V, device=dev)
    cache, idx = state.clone(), torch.arange(B, device=dev, dtype=torch.int32)
    rows = {
        "running_tensor T=1 (recurrent, state in and out)": lambda: rtcompile.running_tensor(
            q, k, v, g, beta, initial_state=state, output_final_state=True, l2norm=True, mode="recurrent"),
        "running_tensor_decode_ (validate=True)": lambda: rtcompile.running_tensor_decode_(
            q, k, v, g, beta, state_cache=cache, state_indices=idx, l2norm=True),
        "running_tensor_decode_ (validate=False)": lambda: rtcompile.running_tensor_decode_(
            q, k, v, g, beta, state_cache=cache, state_indices=idx, l2norm=True, validate=False),
    }
    if gpu:
        try:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        except ImportError:
            fused_recurrent_gated_delta_rule = None
        if fused_recurrent_gated_delta_rule is not None:
            from rtcompile.kernels.chunk_resident import materialise_phi

            pq, pk = materialise_phi(q, l2norm=True), materialise_phi(k, l2norm=True)
            s2 = torch.zeros(B, H, 256, V, device=dev)
            rows["fla fused_recurrent_gated_delta_rule (materialised keys)"] = lambda: fused_recurrent_gated_delta_rule(
                pq, pk, v, g, beta.float().to(dt), initial_state=s2, output_final_state=True)
    if a.calls < 1 or a.rounds < 1:
        ap.error("--calls and --rounds: allowed: integers >= 1")
    rounds = {name: [] for name in rows}
    for _ in range(a.rounds):
        for name, fn in rows.items():
            rounds[name].append(round(_time(fn, a.calls, sync) * 1e6, 1))
    out = {"device": torch.cuda.get_device_name() if gpu else "cpu (host time only, launches stubbed)",
           "torch": torch.__version__, "calls": a.calls, "rounds": a.rounds,
           "us_per_call": {name: statistics.median(us) for name, us in rounds.items()},
           "us_per_call_rounds": rounds}
    for name, us in out["us_per_call"].items():
        spread = f"  (rounds {', '.join(f'{u:.1f}' for u in rounds[name])})" if a.rounds > 1 else ""
        print(f"{us:8.1f} us  {name}{spread}")
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
