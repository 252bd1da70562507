"""Which split-form output tiles are wrong on the GPU (sm_90, Triton 3.6), behind the Triton and
the Gluon state loops. History: the H200 tests of 2026-12-04 failed at o3 16x8 materialised with
the Gluon loop at C 64 (refused since); on an H100 on 2026-12-05 (`207f2f4`, `2d5fb5e`) chunks of
64 with 16 or 32 output columns on one key axis were wrong or crashed (illegal address) at K 64
and 128, behind either loop, while 64 columns and chunks of 32 were right: the output kernel, not
the loop (``SplitConfig.check`` refuses those tiles since).

This sweeps K, chunk size, output columns, state stride and loop, one case a process (a crash
ends the CUDA context), eight at once, with the refusals lifted in each case's process only
(``SplitConfig.check``'s narrow tiles; the Gluon loop's chunk-size limit), and prints a line a
case: the wrong entries' count (> 5% of the largest, or NaN) and the output and final-state
errors, or the crash. ``--sanitize`` runs the first failing case again under compute-sanitizer,
which names the faulting kernel and address.

    python benchmarks/diagnose_split_output.py [--jobs 8] [--sanitize]
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

WIDTHS = [(32,), (64,), (128,), (16, 16)]  # K 16 passed the kernel tests on the H100 at C 64, 16 columns
FEATS = ("plain", "gated-delta-l2-h0")
# [widths, C, output columns, state stride, features, loop]; chunks of 32 are the control
ROWS = ([[w, 64, out, stride, f, "triton"] for w in WIDTHS for out in (16, 32, 64) for stride in (1, 4) for f in FEATS]
        + [[w, 32, 16, 1, f, "triton"] for w in WIDTHS for f in FEATS]
        + [[w, C, out, 4, f, "gluon"] for w in WIDTHS if w != (32,) for C in (64, 32) for out in (16, 64)
           for f in FEATS])  # the Gluon loop takes K 64, 128, 256


def one(widths, C, out, stride, feat, loop) -> dict:
    import torch

    from conftest import nan_empty, rel_err
    from rtcompile.kernels import args, chunk_split, chunk_split_gluon
    from rtcompile.kernels.chunk_split import SplitConfig
    from rtcompile.kernels.reference import running_tensor_recurrent_ref
    from test_kernels import DEVICE, FEATURES, case, run_form

    args.empty = nan_empty
    args.empty_like = lambda x: nan_empty(*x.shape, dtype=x.dtype, device=x.device)
    # what this measures: lifted in this process only (the Gluon loop's other limits stand)
    chunk_split._narrow_output_refusal = lambda config, shape: None
    gluon_refusal = chunk_split_gluon.config_refusal
    chunk_split_gluon.config_refusal = lambda cfg, shape: gluon_refusal(dataclasses.replace(cfg, chunk_size=32), shape)
    if loop == "gluon":
        cfg = SplitConfig(C, chunk_split_gluon.GLUON_BV, loop="gluon", state_stride=stride, output_block_v=out)
    else:
        cfg = SplitConfig(C, 32, state_stride=stride, output_block_v=out, key_group=1)
    torch.manual_seed(0)
    f = FEATURES[feat]
    dev, ref, s0 = case(2, 130, 3, widths, 64, torch.bfloat16, gate=f["gate"], delta=f["delta"], state=f["h0"])
    o, s = run_form(cfg, *dev, h0=None if s0 is None else s0.to(DEVICE), l2norm=f["l2norm"])
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # a crash surfaces here, in this case's process
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=None if s0 is None else s0.double(),
                                                output_final_state=True, l2norm=f["l2norm"])
    o = o.cpu()
    wrong = int(((o.double() - o_ref).abs() > 0.05 * o_ref.abs().max()).sum()) + int(o.isnan().sum())
    return {"o": rel_err(o, o_ref), "state": rel_err(s.cpu(), s_ref), "wrong": wrong}


def _command(row) -> list[str]:
    return [sys.executable, __file__, "--only", json.dumps(row)]


def run(row) -> tuple:
    res = subprocess.run(_command(row), capture_output=True, text=True, timeout=240)
    lines = res.stdout.strip().splitlines()
    if res.returncode or not lines:
        why = next((ln for ln in res.stderr.splitlines() if "Error" in ln or "error" in ln), f"exit {res.returncode}")
        return row, {"error": why.strip()[:80]}
    return row, json.loads(lines[-1])


def sanitize(row) -> None:
    """``row`` again under compute-sanitizer's memcheck: the faulting kernel and address."""
    tool = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if Path(p).exists()), None)
    if tool is None:
        print("compute-sanitizer: not found on this machine", flush=True)
        return
    res = subprocess.run([tool, "--tool", "memcheck", "--print-limit", "4", *_command(row)],
                         capture_output=True, text=True, timeout=400)
    print("\n".join((res.stdout + res.stderr).splitlines()[:60]), flush=True)


def main(jobs: int, sanitize_first: bool = False) -> int:
    failed = None
    with ThreadPoolExecutor(jobs) as pool:
        for row, got in pool.map(run, ROWS):
            w, C, out, stride, feat, loop = row
            what = (f"ERROR {got['error']}" if "error" in got else
                    f"wrong {got['wrong']:6d}  o {got['o']:.1e}  state {got['state']:.1e}")
            print(f"{'x'.join(map(str, w)):6s} {loop:6s} C{C:<3d} out{out:<3d} stride{stride} {feat:18s} {what}",
                  flush=True)
            if failed is None and ("error" in got or got["wrong"]):
                failed = row
    if sanitize_first and failed is not None:
        sanitize(failed)
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="one case as JSON [widths, C, out, stride, feat, loop] (the sweep's child)")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--sanitize", action="store_true", help="the first failing case again under compute-sanitizer")
    a = ap.parse_args()
    if a.only:
        print(json.dumps(one(*json.loads(a.only))))
        raise SystemExit(0)
    raise SystemExit(main(a.jobs, a.sanitize))
