"""Probe: which kron-tile variants run, each in its own process (an illegal address poisons a
CUDA context). Prints one line per (widths, variant): relative RMS error against the default
variant on B1 T256 H2 d_v 64 bf16 inputs, or the failure. GPU only; exploration."""
from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import sys, torch
from rtcompile.kernels.variants import ChunkVariant, KernelShape
from rtcompile.kernels.inputs import random_inputs
from rtcompile.kernels.triton_fwd import running_tensor_fwd
from rtcompile.bench.measure import rel_rms
widths = tuple(int(x) for x in sys.argv[1].split("x"))
C, bv, warps, pf, T = (int(x) for x in sys.argv[2:7])
q, k, v, g, beta, _ = random_inputs(1, T, 2, widths, 64, "bfloat16", "cuda", 3)
run = lambda var: running_tensor_fwd(q, k, v, g, beta, l2norm=True, output_final_state=True, variant=var)
o0, s0 = run(None)
var = ChunkVariant(chunk_size=C, block_k=widths[-1], block_v=bv, num_warps=warps, num_stages=1, prefetch=bool(pf), kron=True)
o1, s1 = run(var)
torch.cuda.synchronize()
print(f"err {max(rel_rms(o1, o0), rel_rms(s1, s0)):.1e}")
"""


def main() -> int:
    configs = [("64x64", 64, 16, 8, 0, 256), ("64x64", 16, 16, 4, 0, 256), ("64x64", 32, 16, 4, 0, 256),
               ("64x64", 64, 16, 4, 0, 256), ("64x64", 64, 32, 8, 1, 256), ("16x16x16", 64, 16, 8, 0, 256),
               ("16x16x16", 16, 16, 4, 0, 256), ("32x32", 32, 16, 4, 0, 256), ("4x64", 64, 16, 8, 0, 256),
               ("64x64", 64, 16, 8, 0, 64)]
    for cfg in configs:
        args = [str(x) for x in cfg]
        try:
            p = subprocess.run([sys.executable, "-c", CHILD, *args], check=False, capture_output=True, text=True,
                               timeout=90)
            out = p.stdout.strip().splitlines()[-1:] or [(p.stderr.strip().splitlines() or ["?"])[-1][:120]]
        except subprocess.TimeoutExpired:
            out = ["timeout"]
        print(f"{cfg[0]:9} C{cfg[1]:<3} bv{cfg[2]:<3} w{cfg[3]} pf{cfg[4]} T{cfg[5]:<4} {out[0]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
