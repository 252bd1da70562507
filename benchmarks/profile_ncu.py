"""What bounds each kernel of issue 22's rows: Nsight Compute metrics of the default configs'
kernels (one eager call a case, so the split form runs one part), printed as one table.

On the GPU machine (ncu from the CUDA toolkit; ``RTCOMPILE_NCU`` overrides its path):

    python3 benchmarks/profile_ncu.py [--csv FILE]     profile (ncu runs this script's --target)
    python3 benchmarks/profile_ncu.py --parse FILE     the table from a saved CSV (no GPU)

The target runs every case once to compile, then each once more between
``cudaProfilerStart``/``Stop`` (ncu ``--profile-from-start off``), in :data:`CASES` order and
printing its name: the kernels' IDs in the CSV follow that order (a prefill case's kernels in
its form's launch order: materialise, prepare, the state loop, outputs). ncu locks the clocks to
base, so its durations run 10-20% over CUDA-graph timings. Columns: duration, DRAM and SM
throughput, L2 throughput (% of peak), achieved occupancy (% of 64 warps an SM), instructions a
cycle, tensor-pipe activity (% of peak) and the average warps stalled per issue on the main
reasons (long scoreboard: global memory; barrier; wait: fixed latency).
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
H, V = 8, 64
PREFILL = [("o2 64", (64,)), ("o2 128", (128,)), ("o2 256", (256,)), ("o3 8x8", (8, 8)), ("o3 16x8", (16, 8)),
           ("o3 16x16", (16, 16)), ("o3 32x32", (32, 32)), ("o3 64x64", (64, 64)), ("o4 16^3", (16, 16, 16))]
DECODE = [("decode K256 B32", (16, 16), 32), ("decode K256 B256", (16, 16), 256), ("decode K1024 B32", (32, 32), 32)]
CASES = [name for name, _ in PREFILL] + [name for name, _, _ in DECODE]
METRICS = {  # ncu metric -> column
    "gpu__time_duration.sum": "us",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram%",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm%",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "l2%",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occ%",
    "sm__inst_executed.avg.per_cycle_active": "ipc",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "tensor%",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": "long_sb",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": "barrier",
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": "wait",
}


def _calls():
    """(case, call) for every case: B8 T4096 bf16 prefill (gate, delta rule, l2norm, final
    state) and decode steps of an fp32 state cache (4 x B slots, B of them stepped)."""
    import torch

    import rtcompile

    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    gates = lambda *s: ((-torch.rand(*s, device="cuda", generator=gen) * 0.1).to(torch.bfloat16),  # noqa: E731
                        torch.rand(*s, device="cuda", generator=gen).to(torch.bfloat16))

    def prefill(widths, B=8, T=4096):
        q, k, v = [r(B, T, H, w) for w in widths], [r(B, T, H, w) for w in widths], r(B, T, H, V)
        g, beta = gates(B, T, H)
        return lambda: rtcompile.running_tensor(q, k, v, g, beta, l2norm=True, output_final_state=True,
                                                mode="chunk", backend="triton")

    def decode(widths, N):
        cache = torch.randn(4 * N, H, *widths, V, device="cuda", generator=gen) * 0.01
        idx = torch.randperm(4 * N, device="cuda", generator=gen)[:N].to(torch.int32)
        q, k, v = [r(N, 1, H, w) for w in widths], [r(N, 1, H, w) for w in widths], r(N, 1, H, V)
        g, beta = gates(N, 1, H)
        return lambda: rtcompile.running_tensor_decode_(q, k, v, g, beta, state_cache=cache, state_indices=idx,
                                                        l2norm=True, validate=False)

    return [(n, prefill(w)) for n, w in PREFILL] + [(n, decode(w, b)) for n, w, b in DECODE]


def target() -> int:
    """Run under ncu: every case compiled first, then each profiled once."""
    import torch

    calls = _calls()
    for _, call in calls:
        call()
    torch.cuda.synchronize()
    for name, call in calls:
        torch.cuda.cudart().cudaProfilerStart()
        call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print("case", name, flush=True)
    return 0


def parse(path: str) -> list[dict]:
    """One row per profiled kernel of an ncu ``--csv`` log: ID, kernel, grid, block and the
    :data:`METRICS` columns (numbers; thousands separators dropped; None where absent)."""
    header, kernels = None, collections.OrderedDict()
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if row and row[0] == "ID":
                header = row
            elif header and len(row) == len(header):
                d = dict(zip(header, row))
                key = (int(d["ID"]), d["Kernel Name"].split("(")[0], d["Grid Size"], d["Block Size"])
                kernels.setdefault(key, {})[d["Metric Name"]] = d["Metric Value"]
    rows = []
    for (i, name, grid, block), m in kernels.items():
        row = {"id": i, "kernel": name, "grid": grid, "block": block}
        for metric, col in METRICS.items():
            value = m.get(metric)
            row[col] = None if value in (None, "", "n/a") else float(value.replace(",", ""))
        if row["us"] is not None:
            row["us"] /= 1e3  # ncu reports ns
        rows.append(row)
    return rows


def table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Nsight Compute, one eager call a case (kernels in the cases' order)")
    for col in ("id", "kernel", "grid", *METRICS.values()):
        t.add_column(col, justify="left" if col in ("kernel", "grid") else "right")
    for r in rows:
        t.add_row(str(r["id"]), r["kernel"][:34], r["grid"],
                  *("-" if r[c] is None else f"{r[c]:.2f}" if c != "us" else f"{r[c]:.1f}" for c in METRICS.values()))
    Console(width=max(160, Console().width)).print(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--parse", metavar="FILE", help="print the table of a saved ncu CSV log")
    ap.add_argument("--csv", metavar="FILE", help="keep ncu's CSV log here")
    args = ap.parse_args(argv)
    if args.target:
        return target()
    if args.parse:
        if not os.path.isfile(args.parse):
            print(f"profile_ncu: --parse: no file {args.parse}", file=sys.stderr)
            return 2
        table(parse(args.parse))
        return 0
    ncu = os.environ.get("RTCOMPILE_NCU") or "/usr/local/cuda/bin/ncu"
    if not os.path.isfile(ncu):
        print(f"profile_ncu: no ncu at {ncu} (set RTCOMPILE_NCU)", file=sys.stderr)
        return 2
    log = args.csv or os.path.join(tempfile.mkdtemp(), "ncu.csv")
    cmd = [ncu, "--profile-from-start", "off", "--csv", "--log-file", log, "--metrics", ",".join(METRICS),
           sys.executable, __file__, "--target"]
    done = subprocess.run(cmd, cwd=ROOT)
    if done.returncode != 0:
        print(f"profile_ncu: ncu exited with {done.returncode} (log: {log})", file=sys.stderr)
        return 1
    print("cases in order:", ", ".join(CASES))
    table(parse(log))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
