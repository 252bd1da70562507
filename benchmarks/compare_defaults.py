"""Time the default configs of two checkouts of rtcompile in one GPU run, alternating.

    python benchmarks/compare_defaults.py --baseline DIR [--rounds 3] [--fla] [--out FILE.json]

``DIR`` holds another checkout's ``rtcompile`` package (for example
``git archive COMMIT rtcompile | tar -x -C DIR``). Each round runs one measuring process per
checkout, the baseline first, so both see the same GPU state in turn; a case's figure is the
median over rounds of each process's median. Only the public API is called
(``rtcompile.running_tensor`` in chunk mode, ``rtcompile.running_tensor_decode_``), with no
config given, so each checkout runs its own default for the shape (no tuned table is read:
``untuned``).

Method: B8 T4096 H8 d_v 64 bf16 prefill (gate, delta rule, l2norm, final state returned), each
call captured in a CUDA graph per input set (two sets, replayed alternately, so the second
reads inputs the first evicted from L2); decode steps of an fp32 state cache updated in place,
four disjoint slot sets (at B32 the 16 MB state of one set would stay in the 50 MB L2). Per
process: 7 repeats of 20 replays between CUDA events, median. ``--fla`` adds
flash-linear-attention's ``chunk_gated_delta_rule`` on materialised Kronecker keys (K <= 256),
measured in the current checkout's processes. Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PREFILL = [("o2 64", (64,)), ("o3 16x16", (16, 16)), ("o3 32x32", (32, 32)), ("o3 64x64", (64, 64)),
           ("o4 16x16x16", (16, 16, 16)), ("o2 128", (128,)), ("o3 8x8", (8, 8)), ("o3 16x8", (16, 8))]
DECODE = [("o3 16x16 B32", (16, 16), 32), ("o3 16x16 B256", (16, 16), 256), ("o3 32x32 B32", (32, 32), 32)]
B, T, H, V = 8, 4096, 8, 64
REPEATS, REPLAYS = 7, 20


def _timed(graphs) -> float:
    """Median seconds per replay, the graphs replayed in turn."""
    import torch

    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(REPLAYS):
            graphs[i % len(graphs)].replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / REPLAYS)
    return statistics.median(times)


def _capture(call):
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def _prefill_inputs(widths, seed):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    q = [r(B, T, H, w) for w in widths]
    k = [r(B, T, H, w) for w in widths]
    g = -torch.rand(B, T, H, device="cuda", generator=gen) * 0.1
    beta = torch.rand(B, T, H, device="cuda", generator=gen).to(torch.bfloat16)
    return q, k, r(B, T, H, V), g.to(torch.bfloat16), beta


def _kron(xs):
    out = xs[0]
    for x in xs[1:]:
        out = (out[..., :, None] * x[..., None, :]).flatten(-2)
    return out.contiguous()


def measure(fla: bool) -> dict:
    """Every case with the rtcompile importable here; {case: seconds}."""
    import torch

    import rtcompile

    out = {}
    for name, widths in PREFILL:
        sets = [_prefill_inputs(widths, s) for s in (1, 2)]

        def ours(s):
            return lambda: rtcompile.running_tensor(*s, l2norm=True, output_final_state=True, mode="chunk",
                                                    backend="triton")
        out[f"prefill {name}"] = _timed([_capture(ours(s)) for s in sets])
        K = 1
        for w in widths:
            K *= w
        if fla and K <= 256:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            kron = [(_kron(q), _kron(k), v, g, beta) for q, k, v, g, beta in sets]

            def theirs(s):
                q, k, v, g, beta = s
                return lambda: chunk_gated_delta_rule(q, k, v, g.float(), beta, use_qk_l2norm_in_kernel=True,
                                                      output_final_state=True)
            out[f"prefill {name} fla"] = _timed([_capture(theirs(s)) for s in kron])
        del sets
        torch.cuda.empty_cache()
    for name, widths, batch in DECODE:
        gen = torch.Generator(device="cuda").manual_seed(3)
        cache = torch.randn(4 * batch, H, *widths, V, device="cuda", generator=gen) * 0.01
        perm = torch.randperm(4 * batch, device="cuda", generator=gen).to(torch.int32)

        def step(i):
            r = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
            q, k = [r(batch, 1, H, w) for w in widths], [r(batch, 1, H, w) for w in widths]
            v, g = r(batch, 1, H, V), (-torch.rand(batch, 1, H, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
            beta = torch.rand(batch, 1, H, device="cuda", generator=gen).to(torch.bfloat16)
            idx = perm[i * batch:(i + 1) * batch].contiguous()
            return lambda: rtcompile.running_tensor_decode_(q, k, v, g, beta, state_cache=cache, state_indices=idx,
                                                            l2norm=True, validate=False)
        out[f"decode {name}"] = _timed([_capture(step(i)) for i in range(4)])
        del cache
    return out


def compare(args) -> int:
    here = Path(__file__).resolve().parents[1]
    runs: dict[str, list[dict]] = {"baseline": [], "current": []}
    for _ in range(args.rounds):
        for label, path in (("baseline", args.baseline), ("current", str(here))):
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])}
            cmd = [sys.executable, __file__, "--measure"] + (["--fla"] if args.fla and label == "current" else [])
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=path)
            if res.returncode != 0:
                print(f"{label}: measuring failed:\n{res.stderr[-3000:]}", file=sys.stderr)
                return 1
            runs[label].append(json.loads(res.stdout.strip().splitlines()[-1]))
    cases = list(runs["current"][0])
    rows = []
    for case in cases:
        cur = statistics.median(r[case] for r in runs["current"])
        base = [r[case] for r in runs["baseline"] if case in r]
        rows.append({"case": case, "current_s": cur, "baseline_s": statistics.median(base) if base else None,
                     "current_rounds": [r[case] for r in runs["current"]], "baseline_rounds": base})
    if args.out:
        Path(args.out).write_text(json.dumps({"rounds": args.rounds, "rows": rows}, indent=1))
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"defaults, median of {args.rounds} alternating rounds (B{B} T{T} H{H} d_v {V} bf16)")
    for col in ("case", "baseline", "current", "current / baseline"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        ratio = f"{r['current_s'] / r['baseline_s']:.3f}" if r["baseline_s"] else "-"
        base = f"{r['baseline_s'] * 1e3:.4f} ms" if r["baseline_s"] else "-"
        table.add_row(r["case"], base, f"{r['current_s'] * 1e3:.4f} ms", ratio)
    Console().print(table)
    return 0


def untuned() -> None:
    """Calls without a config run the defaults table's config, never a tuned table's: an empty
    table of this process's own (and its children's). A tuner step earlier in the same GPU
    session shares the cache, and its pick then ran as "the default" (compare_kron at 0b9f90f
    timed o3 16x16's tuned pick against itself)."""
    import tempfile

    os.environ["RTCOMPILE_TUNED"] = os.path.join(tempfile.mkdtemp(prefix="untuned_"), "tuned.json")
    if "rtcompile.kernels.tuned" in sys.modules:
        sys.modules["rtcompile.kernels.tuned"].reload()


def main() -> int:
    untuned()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="a directory holding the baseline checkout's rtcompile package")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fla", action="store_true", help="also time fla on materialised keys (K <= 256)")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.fla)))
        return 0
    if not args.baseline:
        ap.error("--baseline is required")
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
