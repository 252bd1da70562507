"""Localise the Gluon state loop's wrong outputs at chunks of 64 (GPU, sm_90), which
``chunk_split_gluon.config_refusal`` refuses since the H200 tests of 2026-12-04 failed at o3 16x8
materialised (K 128, T 130, output_block_v 16) while K 256 passed.

    python benchmarks/diagnose_gluon_c64.py [--sanitize]     (each case in a process of its own)

Lifts that refusal in this process only, then runs the split form on one small problem per
(widths, config, features) against the float64 reference with NaN-poisoned workspaces, as the
tests do, and prints the output and final-state errors with the tokens and value columns of the
entries off by more than 5% of the largest: the Triton loop at C 64 (the control), the Gluon loop
at C 64 with 16 and 64 output columns and with every chunk's state stored, and at C 32 (passes).
A wrong final state points at the loop, right states with wrong outputs at the stored U / states
or at the output kernel.

First run (H200, `fb0aef6`, 2026-12-05, all cases in one process): the very first case, the
*Triton* loop's control at C 64 (o3 16x8 materialised, K 128, stride 4, 32 value columns, no
descriptors), ended in an illegal memory access, and every later case failed with it (a CUDA
context does not survive one). So C 64 below K 256 may be wrong for the Triton loop too, not only
the Gluon one; no test ran the split form at C 64 below K 256 until then (the interpreter passes
it). Now each case runs in its own process, and ``--sanitize`` names the faulting kernel.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


WIDTHS = [(16, 8), (128,), (64,), (16, 16)]
FEATS = ("plain", "gated-delta-l2-h0")
CASE_NAMES = ("triton c64 out16", "gluon c64 out16", "gluon c64 out64", "gluon c64 out16 stride1", "gluon c32 out16")


def main(only: str | None = None) -> int:
    import torch

    from conftest import nan_empty, rel_err
    from rtcompile.kernels import args, chunk_split, chunk_split_gluon
    from rtcompile.kernels.chunk_split import SplitConfig
    from rtcompile.kernels.reference import running_tensor_recurrent_ref
    from test_kernels import DEVICE, FEATURES, case, run_form

    if not chunk_split_gluon.runs_here():
        print("diagnose_gluon_c64: needs an sm_90 GPU (the Gluon loop)", file=sys.stderr)
        return 2
    args.empty = nan_empty
    args.empty_like = lambda x: nan_empty(*x.shape, dtype=x.dtype, device=x.device)
    chunk_split_gluon.config_refusal = lambda cfg, shape: None if cfg.block_v == 64 else "block_v 64 only"
    chunk_split._narrow_output_refusal = lambda config, shape: None  # its out16 rows are what it found

    def err(config, widths, T, feat, B=2, H=3, V=64):
        torch.manual_seed(0)
        f = FEATURES[feat]
        dev, ref, s0 = case(B, T, H, widths, V, torch.bfloat16, gate=f["gate"], delta=f["delta"], state=f["h0"])
        o, s = run_form(config, *dev, h0=None if s0 is None else s0.to(DEVICE), l2norm=f["l2norm"])
        o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=None if s0 is None else s0.double(),
                                                    output_final_state=True, l2norm=f["l2norm"])
        o = o.cpu()
        where = ((o.double() - o_ref).abs() > 0.05 * o_ref.abs().max()).nonzero()
        return (f"o {rel_err(o, o_ref):.1e} state {rel_err(s.cpu(), s_ref):.1e} nan {int(o.isnan().sum())} "
                f"wrong {len(where)} tokens {sorted(set(where[:, 1].tolist()))[:12]} "
                f"columns {sorted(set(where[:, 3].tolist()))[:8]}")

    cases = {
        "triton c64 out16": SplitConfig(64, 32, materialise=True, state_stride=4),
        "gluon c64 out16": SplitConfig(64, 64, loop="gluon", materialise=True, state_stride=4),
        "gluon c64 out64": SplitConfig(64, 64, loop="gluon", materialise=True, state_stride=4, output_block_v=64),
        "gluon c64 out16 stride1": SplitConfig(64, 64, loop="gluon", materialise=True),
        "gluon c32 out16": SplitConfig(32, 64, loop="gluon", materialise=True, state_stride=4),
    }
    rows = [(widths, name, feat) for widths in WIDTHS for name in cases for feat in FEATS]
    if only is not None:  # one case in this process (an illegal address ends the CUDA context)
        rows = [r for r in rows if _row_id(*r) == only]
        if not rows:
            print(f"diagnose_gluon_c64: no case {only!r}", file=sys.stderr)
            return 2
    for widths, name, feat in rows:
        cfg = cases[name]
        if len(widths) == 1 or widths == (16, 16):
            cfg = dataclasses.replace(cfg, materialise=False)
        try:
            print(widths, name, feat, err(cfg, widths, 130, feat), flush=True)
        except Exception as exc:  # a refusal or a launch failure: the row says which
            print(widths, name, feat, "ERROR", type(exc).__name__, str(exc)[:200], flush=True)
    return 0


def _row_id(widths, name, feat) -> str:
    return f"{'x'.join(map(str, widths))}/{name.replace(' ', '-')}/{feat}"


def run_each(sanitize: bool) -> int:
    """Every case in a process of its own, so one illegal address cannot fail the cases after
    it (on 2026-12-05 the first case's did, and every later row read the same error); with
    ``sanitize`` the first case that fails runs again under compute-sanitizer, which names the
    kernel and the address."""
    import shutil
    import subprocess

    ids = [_row_id(w, n, f) for w in WIDTHS for n in CASE_NAMES for f in FEATS]
    sanitizer = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if Path(p).exists()), None)
    for row in ids:
        cmd = [sys.executable, __file__, "--only", row]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        line = (res.stdout.strip().splitlines() or [f"{row} exit {res.returncode} {res.stderr.strip()[-200:]}"])[-1]
        print(line, flush=True)
        if sanitize and ("ERROR" in line or res.returncode) and sanitizer:
            san = subprocess.run([sanitizer, "--tool", "memcheck", "--print-limit", "4", *cmd],
                                 capture_output=True, text=True, timeout=400)
            print("\n".join((san.stdout + san.stderr).splitlines()[:60]), flush=True)
            sanitize = False
        elif sanitize and "ERROR" in line:
            print("compute-sanitizer: not found on this machine", flush=True)
            sanitize = False
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="one case, WIDTHS/CASE/FEATURES as the rows print it (e.g. 16x8/triton-c64-out16/plain)")
    ap.add_argument("--sanitize", action="store_true", help="rerun the first failing case under compute-sanitizer")
    a = ap.parse_args()
    raise SystemExit(main(a.only) if a.only else run_each(a.sanitize))
