"""Localise the Gluon state loop's wrong outputs at chunks of 64 (GPU, sm_90), which
``chunk_split_gluon.config_refusal`` refuses since the H200 tests of 2026-12-04 failed at o3 16x8
materialised (K 128, T 130, output_block_v 16) while K 256 passed.

    python benchmarks/diagnose_gluon_c64.py

Lifts that refusal in this process only, then runs the split form on one small problem per
(widths, config, features) against the float64 reference with NaN-poisoned workspaces, as the
tests do, and prints the output and final-state errors with the tokens and value columns of the
entries off by more than 5% of the largest: the Triton loop at C 64 (the control), the Gluon loop
at C 64 with 16 and 64 output columns and with every chunk's state stored, and at C 32 (passes).
A wrong final state points at the loop, right states with wrong outputs at the stored U / states
or at the output kernel.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> int:
    import torch

    from conftest import nan_empty, rel_err
    from rtcompile.kernels import args, chunk_split_gluon
    from rtcompile.kernels.chunk_split import SplitConfig
    from rtcompile.kernels.reference import running_tensor_recurrent_ref
    from test_kernels import DEVICE, FEATURES, case, run_form

    if not chunk_split_gluon.runs_here():
        print("diagnose_gluon_c64: needs an sm_90 GPU (the Gluon loop)", file=sys.stderr)
        return 2
    args.empty = nan_empty
    args.empty_like = lambda x: nan_empty(*x.shape, dtype=x.dtype, device=x.device)
    chunk_split_gluon.config_refusal = lambda cfg, shape: None if cfg.block_v == 64 else "block_v 64 only"

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
    for widths in [(16, 8), (128,), (64,), (16, 16)]:
        for name, cfg in cases.items():
            if len(widths) == 1 or widths == (16, 16):
                cfg = dataclasses.replace(cfg, materialise=False)
            for feat in ("plain", "gated-delta-l2-h0"):
                try:
                    print(widths, name, feat, err(cfg, widths, 130, feat), flush=True)
                except Exception as exc:  # a refusal or a launch failure: the row says which
                    print(widths, name, feat, "ERROR", type(exc).__name__, str(exc)[:200], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
