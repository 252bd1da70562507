"""Which split-form output tiles are wrong on the GPU (sm_90, Triton 3.6): the H100 run of
`diagnose_gluon_c64.py` on 2026-12-05 (`207f2f4`) found chunks of 64 with 16 output columns
wrong or crashing (illegal address) at K 64 and 128, for the Triton and the Gluon loop alike,
while 64 output columns and chunks of 32 were right. This sweeps the Triton loop over K,
chunk size, output columns and state stride, one case a process (a crash ends the CUDA
context), eight at once, with ``SplitConfig.check``'s refusal of these tiles lifted in each
case's process, and prints a table of the wrong entries' count (or the crash).

    python benchmarks/diagnose_split_output.py [--jobs 8]
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

WIDTHS = [(32,), (64,), (128,), (16, 16)]  # K 16 passed the kernel tests on the H100 at C 64, 16 columns
FEATS = ("plain", "gated-delta-l2-h0")
ROWS = ([[w, 64, out, stride, f] for w in WIDTHS for out in (16, 32, 64) for stride in (1, 4) for f in FEATS]
        + [[w, 32, 16, 1, f] for w in WIDTHS for f in FEATS])  # chunks of 32: the control


def one(widths, C, out, stride, feat) -> dict:
    import torch

    from conftest import nan_empty, rel_err
    from rtcompile.kernels import args, chunk_split
    from rtcompile.kernels.chunk_split import SplitConfig
    from rtcompile.kernels.reference import running_tensor_recurrent_ref
    from test_kernels import DEVICE, FEATURES, case, run_form

    args.empty = nan_empty
    chunk_split._narrow_output_refusal = lambda config, shape: None  # what this measures: lifted here only
    args.empty_like = lambda x: nan_empty(*x.shape, dtype=x.dtype, device=x.device)
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


def run(row) -> tuple:
    cmd = [sys.executable, __file__, "--only", json.dumps(row)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    lines = res.stdout.strip().splitlines()
    if res.returncode or not lines:
        why = next((ln for ln in res.stderr.splitlines() if "Error" in ln or "error" in ln), f"exit {res.returncode}")
        return row, {"error": why.strip()[:80]}
    return row, json.loads(lines[-1])


def main(jobs: int) -> int:
    with ThreadPoolExecutor(jobs) as pool:
        for row, got in pool.map(run, ROWS):
            w, C, out, stride, feat = row
            what = (f"ERROR {got['error']}" if "error" in got else
                    f"wrong {got['wrong']:6d}  o {got['o']:.1e}  state {got['state']:.1e}")
            print(f"{'x'.join(map(str, w)):6s} C{C:<3d} out{out:<3d} stride{stride} {feat:18s} {what}", flush=True)
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="one case as JSON [widths, C, out, stride, feat] (the sweep's child)")
    ap.add_argument("--jobs", type=int, default=8)
    a = ap.parse_args()
    if a.only:
        w, C, out, stride, feat = json.loads(a.only)
        print(json.dumps(one(tuple(w), C, out, stride, feat)))
        raise SystemExit(0)
    raise SystemExit(main(a.jobs))
