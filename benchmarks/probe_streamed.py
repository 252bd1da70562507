"""Probe: the chunk kernel with a streamed state (K > 256) over a few hand-picked variants.

Times the default and its neighbours (prefetch of the next state tile, chunk size, key and
value tiles, warps, stages) on the bench's prefill shape (B8 T4096 H8 d_v 64, bf16,
gate + delta + l2norm), each output compared with the default's (relative RMS; a variant that
computes something else is flagged, not counted). The shared-memory estimate is lifted (the
compiler's refusal is the answer there), every other check stays. Exploration only: the
recorded numbers come from ``rtcompile bench``.

    python3 benchmarks/probe_streamed.py [--widths 64 64] [--out DIR]      (GPU only)
    python3 benchmarks/probe_streamed.py --names C128-rows-merge-bk128 --lift-registers  (spills allowed)
    python3 benchmarks/probe_streamed.py --dry-run                          (CPU, T=40, no timing)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import triton

from rtcompile.bench.core import Case
from rtcompile.bench.measure import make_inputs, rel_rms
from rtcompile.kernels import triton_fwd
from rtcompile.kernels import variants as V
from rtcompile.kernels.triton_fwd import running_tensor_fwd

# (name, changes to the default): neighbours in chunk size, key tile, value tile, warps, stages
NEIGHBOURS = (
    ("prefetch", {"prefetch": True}),
    ("prefetch-stages2", {"prefetch": True, "num_stages": 2}),
    ("stages2", {"num_stages": 2}),
    ("prefetch-C64-w8", {"prefetch": True, "chunk_size": 64, "num_warps": 8}),
    ("prefetch-C32-w4", {"prefetch": True, "chunk_size": 32, "num_warps": 4}),
    ("prefetch-bk64", {"prefetch": True, "block_k": 64}),
    ("prefetch-bk256", {"prefetch": True, "block_k": 256}),
    ("prefetch-bv32", {"prefetch": True, "block_v": 32}),
    ("prefetch-C64-bk256-w8", {"prefetch": True, "chunk_size": 64, "block_k": 256, "num_warps": 8}),
    ("prefetch-fused", {"prefetch": True, "fuse_prepare": True}),
    ("prefetch-bv64", {"prefetch": True, "block_v": 64}),
    ("prefetch-bv32-w8", {"prefetch": True, "block_v": 32, "num_warps": 8}),
    ("prefetch-blocks", {"prefetch": True, "solve": "blocks"}),
    ("blocks", {"solve": "blocks"}),
    ("bv16", {"block_v": 16}),
    ("w4", {"num_warps": 4}),
    ("bk512", {"block_k": 512}),
    ("C32", {"chunk_size": 32}),
    ("C64-bk256-bv32-w8-pf-blocks", {"chunk_size": 64, "block_k": 256, "block_v": 32, "num_warps": 8,
                                     "prefetch": True, "solve": "blocks"}),
    ("C64-bk128-bv32-w8-pf-blocks", {"chunk_size": 64, "block_k": 128, "block_v": 32, "num_warps": 8,
                                     "prefetch": True, "solve": "blocks"}),
    ("C32-bk256-bv16-w4", {"chunk_size": 32, "block_k": 256, "block_v": 16, "num_warps": 4}),
    ("rows", {"solve": "rows"}),
    ("C128-rows", {"chunk_size": 128, "solve": "rows"}),
    ("merge", {"merge_passes": True}),
    ("merge-noprefetch", {"merge_passes": True, "prefetch": False}),
    ("merge-bv16", {"merge_passes": True, "block_v": 16}),
    ("merge-C64-bk256-bv32-w8-pf-blocks", {"chunk_size": 64, "block_k": 256, "block_v": 32, "num_warps": 8,
                                           "prefetch": True, "solve": "blocks", "merge_passes": True}),
    ("C32-bk128-bv16-w4", {"chunk_size": 32, "block_k": 128, "block_v": 16, "num_warps": 4, "prefetch": False}),
    # C = 128 halves the state traffic per token (the floor at K = 4096 is that traffic)
    ("C128-rows-merge-bk128", {"chunk_size": 128, "solve": "rows", "block_k": 128, "merge_passes": True,
                               "prefetch": False}),
    ("C128-rows-merge-bk128-bv16", {"chunk_size": 128, "solve": "rows", "block_k": 128, "block_v": 16,
                                    "merge_passes": True, "prefetch": False}),
    ("C128-rows-merge-bk64", {"chunk_size": 128, "solve": "rows", "block_k": 64, "merge_passes": True,
                              "prefetch": False}),
    ("C128-rows-bk128-pf", {"chunk_size": 128, "solve": "rows", "block_k": 128, "merge_passes": False,
                            "prefetch": True}),
    ("C128-rows-merge-bk128-w16", {"chunk_size": 128, "solve": "rows", "block_k": 128, "merge_passes": True,
                                   "prefetch": False, "num_warps": 16}),
    ("merge-w16", {"merge_passes": True, "prefetch": False, "num_warps": 16}),
    # the prepare kernel: its own warps, smaller diagonal blocks in the solve
    ("pw1", {"prepare_warps": 1}),
    ("pw2", {"prepare_warps": 2}),
    ("pw8", {"prepare_warps": 8}),
    ("bs8", {"solve": "blocks", "solve_block": 8}),
    ("bs4", {"solve": "blocks", "solve_block": 4}),
    ("pw2-bs8", {"prepare_warps": 2, "solve": "blocks", "solve_block": 8}),
    ("pw2-bs4", {"prepare_warps": 2, "solve": "blocks", "solve_block": 4}),
    ("pw1-bs4", {"prepare_warps": 1, "solve": "blocks", "solve_block": 4}),
    ("pw1-bs8", {"prepare_warps": 1, "solve": "blocks", "solve_block": 8}),
    ("pw4-bs8", {"prepare_warps": 4, "solve": "blocks", "solve_block": 8}),
    ("pw4-bs4", {"prepare_warps": 4, "solve": "blocks", "solve_block": 4}),
    ("pw16", {"prepare_warps": 16}),
    ("pw16-bs8", {"prepare_warps": 16, "solve": "blocks", "solve_block": 8}),
    ("pw16-bs4", {"prepare_warps": 16, "solve": "blocks", "solve_block": 4}),
    ("pw8-bs8", {"prepare_warps": 8, "solve": "blocks", "solve_block": 8}),
    ("pw8-bs4", {"prepare_warps": 8, "solve": "blocks", "solve_block": 4}),
    ("diagonal", {"solve": "diagonal"}),
    ("tf32", {"dot_precision": "tf32"}),
    ("diagonal-tf32", {"solve": "diagonal", "dot_precision": "tf32"}),
    # the prepare kernel's solve in its workspace, in [16, 16] tiles; its warps; C = 32 with it
    ("tiles", {"solve": "tiles"}),
    ("tiles-pw4", {"solve": "tiles", "prepare_warps": 4}),
    ("tiles-pw2", {"solve": "tiles", "prepare_warps": 2}),
    ("tiles-pw1", {"solve": "tiles", "prepare_warps": 1}),
    ("tiles-C32", {"solve": "tiles", "chunk_size": 32, "prepare_warps": 2}),
    ("tiles-C32-w4", {"solve": "tiles", "chunk_size": 32, "num_warps": 4, "prepare_warps": 2}),
    ("tiles-ieee", {"solve": "tiles", "dot_precision": "ieee"}),
    # the low-memory form (what ChunkVariant.fused gives) with the strip solve, and with the tile
    # solve in a per-program scratch
    ("fused-blocks", {"fuse_prepare": True, "prepare_warps": 4, "dot_precision": "ieee", "solve": "blocks"}),
    ("fused-tiles", {"fuse_prepare": True, "prepare_warps": 4, "dot_precision": "ieee", "solve": "tiles"}),
    ("fused-tiles-nopf", {"fuse_prepare": True, "prepare_warps": 4, "dot_precision": "ieee", "solve": "tiles",
                          "prefetch": False}),
    # K = 256 with a resident state: larger chunks, now that the tile solve keeps their prepare cheap
    ("C32-bv16-res", {"chunk_size": 32, "block_v": 16, "prepare_warps": 2}),
    ("C32-w8-res", {"chunk_size": 32, "num_warps": 8, "prepare_warps": 2}),
    ("C64-bv16-w8-res", {"chunk_size": 64, "block_v": 16, "num_warps": 8, "prepare_warps": 2}),
    ("C64-w8-res", {"chunk_size": 64, "num_warps": 8, "prepare_warps": 2}),
    ("bv16-res", {"block_v": 16}),
    # K = 256: the solve applied in the prepare kernel (wy) with larger chunks and 8 warps (one
    # program per SM at B8 H8 block_v 32: 128 programs)
    ("pf-w8", {"num_warps": 8}),
    ("wy-pf-C16", {"wy": True, "solve": "rows"}),
    ("wy-pf-C16-w8", {"wy": True, "solve": "rows", "num_warps": 8}),
    ("wy-pf-C32-w8", {"wy": True, "solve": "rows", "chunk_size": 32, "num_warps": 8, "prepare_warps": 4}),
    ("wy-pf-C32-w8-diag", {"wy": True, "solve": "diagonal", "chunk_size": 32, "num_warps": 8, "prepare_warps": 4}),
    ("wy-pf-C32-bv16", {"wy": True, "solve": "rows", "chunk_size": 32, "block_v": 16, "prepare_warps": 4}),
    ("wy-pf-C64-w8-diag", {"wy": True, "solve": "diagonal", "chunk_size": 64, "num_warps": 8, "prepare_warps": 8}),
    # wy with the tile solve (its inverse read back for W and U0): not yet measured
    ("wy-tiles-pf-C16", {"wy": True, "solve": "tiles"}),
    ("wy-tiles-pf-C32-w8", {"wy": True, "solve": "tiles", "chunk_size": 32, "num_warps": 8, "prepare_warps": 2}),
    ("wy-tiles-pf-C32-w8-pw4", {"wy": True, "solve": "tiles", "chunk_size": 32, "num_warps": 8, "prepare_warps": 4}),
    # the three-kernel form (output_pass): a state-only sequential loop, outputs in parallel
    ("op-C16", {"output_pass": True, "wy": False}),
    ("op-C32", {"output_pass": True, "wy": False, "chunk_size": 32, "prepare_warps": 2}),
    ("op-C32-bv16", {"output_pass": True, "wy": False, "chunk_size": 32, "block_v": 16, "prepare_warps": 2}),
    ("op-C32-w8", {"output_pass": True, "wy": False, "chunk_size": 32, "num_warps": 8, "prepare_warps": 2}),
    ("op-C64", {"output_pass": True, "wy": False, "chunk_size": 64, "prepare_warps": 2}),
    ("op-C64-w8", {"output_pass": True, "wy": False, "chunk_size": 64, "num_warps": 8, "prepare_warps": 2}),
    ("op-C64-bv16", {"output_pass": True, "wy": False, "chunk_size": 64, "block_v": 16, "prepare_warps": 2}),
    ("op-C64-bv16-w8", {"output_pass": True, "wy": False, "chunk_size": 64, "block_v": 16, "num_warps": 8, "prepare_warps": 2}),
    ("op-C64-pw4", {"output_pass": True, "wy": False, "chunk_size": 64, "prepare_warps": 4}),
    # ... with phi(K) stored by the prepare kernel and read by the state loop (stored_keys), loads
    # pipelined by the compiler (num_stages) rather than prefetched into registers
    ("op-sk-C64-s2", {"output_pass": True, "wy": False, "stored_keys": True, "prefetch": False, "chunk_size": 64,
                      "num_stages": 2, "prepare_warps": 2}),
    ("op-sk-C64-s3", {"output_pass": True, "wy": False, "stored_keys": True, "prefetch": False, "chunk_size": 64,
                      "num_stages": 3, "prepare_warps": 2}),
    ("op-sk-C64-w8-s2", {"output_pass": True, "wy": False, "stored_keys": True, "prefetch": False,
                         "chunk_size": 64, "num_warps": 8, "num_stages": 2, "prepare_warps": 2}),
    ("op-sk-C64-bv16-s2", {"output_pass": True, "wy": False, "stored_keys": True, "prefetch": False,
                           "chunk_size": 64, "block_v": 16, "num_stages": 2, "prepare_warps": 2}),
    ("op-sk-C32-s2", {"output_pass": True, "wy": False, "stored_keys": True, "prefetch": False, "chunk_size": 32,
                      "num_stages": 2, "prepare_warps": 2}),
    ("op-sk-C32-w8-s2", {"output_pass": True, "wy": False, "stored_keys": True, "prefetch": False,
                         "chunk_size": 32, "num_warps": 8, "num_stages": 2, "prepare_warps": 2}),
    ("op-sk-C64-pf", {"output_pass": True, "wy": False, "stored_keys": True, "prefetch": True, "chunk_size": 64,
                      "prepare_warps": 2}),
    ("op-C64-w8-s2", {"output_pass": True, "wy": False, "prefetch": False, "chunk_size": 64, "num_warps": 8,
                      "num_stages": 2, "prepare_warps": 2}),
    ("op-C32-w8-s2", {"output_pass": True, "wy": False, "prefetch": False, "chunk_size": 32, "num_warps": 8,
                      "num_stages": 2, "prepare_warps": 2}),
    ("op-C64-s2", {"output_pass": True, "wy": False, "prefetch": False, "chunk_size": 64, "num_stages": 2,
                   "prepare_warps": 2}),
    ("op-C32-s2", {"output_pass": True, "wy": False, "prefetch": False, "chunk_size": 32, "num_stages": 2,
                   "prepare_warps": 2}),
    ("op-sk-C64-s2-pw1", {"output_pass": True, "wy": False, "stored_keys": True, "prefetch": False,
                          "chunk_size": 64, "num_stages": 2, "prepare_warps": 1}),
    ("op-sk-C64-s2-pw4", {"output_pass": True, "wy": False, "stored_keys": True, "prefetch": False,
                          "chunk_size": 64, "num_stages": 2, "prepare_warps": 4}),
    ("op-sk-C64-s2-w2", {"output_pass": True, "wy": False, "stored_keys": True, "prefetch": False,
                         "chunk_size": 64, "num_stages": 2, "num_warps": 2, "prepare_warps": 2}),
    ("op-sk-C64-s1", {"output_pass": True, "wy": False, "stored_keys": True, "prefetch": False,
                      "chunk_size": 64, "num_stages": 1, "prepare_warps": 2}),
    ("op-sk-C64-bv64-s2", {"output_pass": True, "wy": False, "stored_keys": True, "prefetch": False,
                           "chunk_size": 64, "block_v": 64, "num_stages": 2, "prepare_warps": 2}),
    ("op-sk-C32-s3", {"output_pass": True, "wy": False, "stored_keys": True, "prefetch": False,
                      "chunk_size": 32, "num_stages": 3, "prepare_warps": 2}),
    # the stored-keys default in time segments, prepare and output kernels on side streams
    # (2026-11-30g: CPU-verified only)
    ("seg2", {"segments": 2}),
    ("seg4", {"segments": 4}),
    ("seg8", {"segments": 8}),
    ("seg4-bv16", {"segments": 4, "block_v": 16}),
    # the stored-keys default with the solve applied in the prepare kernel (wy: W and U0 stored,
    # the state loop's chain two products), alone and in segments; two stages (three do not fit
    # beside W: Triton asked for 233984 bytes). 2026-11-30h: 0.614 / 0.709 / 0.739 ms against 0.487
    ("sk-wy", {"wy": True, "num_stages": 2}),
    ("sk-wy-pw4", {"wy": True, "num_stages": 2, "prepare_warps": 4}),
    ("seg4-wy", {"wy": True, "num_stages": 2, "segments": 4}),
    # the state loop's loads and stores through tensor descriptors (tma; CPU-verified on
    # 2026-11-30h, untimed; offline sm_90 compile: no spills), with 8 warps, and 2 stages
    ("tma", {"tma": True}),
    ("tma-w8", {"tma": True, "num_warps": 8}),
    ("tma-s2", {"tma": True, "num_stages": 2}),
    ("tma-bv16", {"tma": True, "block_v": 16}),
    # the K = 256 default (tma, key_group 2 since 2026-11-30i) without each of its two changes
    ("kg1", {"key_group": 1}),
    ("kg4", {"key_group": 4}),
    ("no-tma", {"tma": False}),
    # the state stored at every 2nd / 4th chunk (state_stride, 2026-11-30i): the state loop
    # stores half / a quarter of the states, the output kernel reads them and adds the window's
    # earlier chunks as cross-chunk scores; with the output kernel's warps varied. Split on the
    # H200 (state loop / outputs, ms): st2 0.136 / 0.092, st4 0.124 / 0.115, against 0.150 /
    # 0.084 at stride 1; 8 warps or 32 columns in the output kernel slower. Since then the
    # default has stride 2: "st2" is the default itself and "st1" the default before
    ("st1", {"state_stride": 1}),
    ("st2", {"state_stride": 2}),
    ("st4", {"state_stride": 4}),
    ("st2-ow8", {"state_stride": 2, "output_warps": 8}),
    ("st4-ow8", {"state_stride": 4, "output_warps": 8}),
    ("st2-obv32", {"state_stride": 2, "output_block_v": 32}),
    # tma's neighbours (2026-11-30i, probe_split state loop against 0.149 ms for tma): 4 stages
    # 0.149; one program per (sequence, head) with 64 columns and 8 warps 0.240 (two stages
    # 0.271); C 128 did not fit (238 KB of shared memory asked for, 227 KB allowed)
    ("tma-s4", {"tma": True, "num_stages": 4}),
    ("tma-bv64-w8", {"tma": True, "block_v": 64, "num_warps": 8}),
    ("tma-bv64-w8-s2", {"tma": True, "block_v": 64, "num_warps": 8, "num_stages": 2}),
    ("tma-C128", {"tma": True, "chunk_size": 128, "solve": "rows", "num_stages": 2, "prepare_warps": 2,
                  "output_warps": 8}),
    # tf32 in the prepare kernel's tile solve at K = 256 (2026-11-30j, untimed): compiled for
    # sm_90 as launched, the prepare kernel falls from 5872 to 3704 instructions (its 16 [16, 16]
    # block products at ieee were 2048 FFMA a thread); the state loop casts the inverse to bf16
    # either way. "tf32" above is the same change on any default; here beside each stride
    ("tf32-st1", {"dot_precision": "tf32", "state_stride": 1}),
    ("tf32-st4", {"dot_precision": "tf32", "state_stride": 4}),
    # kron: tiles of one axis-1 index, products on the trailing factors' tile with x1's column as row scale
    ("kron", {"kron": True}),
    ("kron-bk64", {"kron": True, "block_k": 64}),
    ("kron-bk64-bv16", {"kron": True, "block_k": 64, "block_v": 16}),
    ("kron-bk32", {"kron": True, "block_k": 32}),
    ("kron-bk32-merge", {"kron": True, "block_k": 32, "merge_passes": True, "prefetch": False}),
    ("kron-bk64-pf", {"kron": True, "block_k": 64, "merge_passes": False, "prefetch": True}),
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", action="append", default=None,
                    help="key widths of one case (repeatable; default: 64 64, 16 16 16, 32 32)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--names", nargs="+", default=None, help="probe only these rows (default and all neighbours)")
    ap.add_argument("--lift-registers", action="store_true",
                    help="lift the register estimate too (ptxas spills instead; the timing decides)")
    ap.add_argument("--dry-run", action="store_true", help="T=40 under TRITON_INTERPRET=1, no timing (CPU check)")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("probe_streamed: needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    dev = "cpu" if args.dry_run else "cuda"
    if args.lift_registers:
        V.CHUNK_MAX_EST_REGS = 10**6
    limit = V.DEFAULT_SMEM_BYTES if args.dry_run else torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    rows = []
    for widths in args.widths or ([64, 64], [16, 16, 16], [32, 32]):
        case = Case("probe", "prefill", tuple(widths), 1 if args.dry_run else 8, 40 if args.dry_run else 4096)
        shape = V.KernelShape(case.key_widths, case.V)
        inp = make_inputs(case, dev, seed=11)
        common = {"scale": inp.scale, "output_final_state": True, "l2norm": True, "mode": "chunk"}
        default = V.ChunkVariant.default(shape, limit)
        run = lambda v, inp=inp, common=common: running_tensor_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, variant=v,
                                                                   **common)
        o_ref, s_ref = run(default)
        for name, changes in (("default", {}), *NEIGHBOURS):
            if args.names and name not in args.names:
                continue
            v = dataclasses.replace(default, **changes)
            row = {"widths": widths, "name": name, "variant": v.to_dict()}
            reason = v.check(shape, 10**9)  # the shared-memory estimate lifted: the compiler decides
            if reason is not None:
                rows.append({**row, "note": f"refused: {reason}"})
                print(f"{'x'.join(map(str, widths)):9} {name:24} refused: {reason}", flush=True)
                continue
            try:
                o, s = _run_unchecked(run, v)
                ms = 0.0 if args.dry_run else triton.testing.do_bench(lambda v=v, run=run: _run_unchecked(run, v), warmup=3,
                                                                         rep=200, return_mode="median")
            except Exception as exc:  # noqa: BLE001 -- one variant's failure is a row
                note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
                rows.append({**row, "note": note})
                print(f"{'x'.join(map(str, widths)):9} {name:24} failed: {note}", flush=True)
                continue
            err = max(rel_rms(o, o_ref), rel_rms(s, s_ref))
            rows.append({**row, "ms": ms, "err_vs_default": err, "note": "MISMATCH" if err > 2e-2 else ""})
            print(f"{'x'.join(map(str, widths)):9} {name:24} {ms:8.3f} ms  err {err:.1e} {rows[-1]['note']}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_streamed.json").write_text(json.dumps(rows, indent=1))
    return 0


def _run_unchecked(run, v):
    """``run(v)`` with the launcher's resource check using a lifted shared-memory limit."""
    real = triton_fwd._smem_limit
    triton_fwd._smem_limit = lambda index: 10**9
    try:
        return run(v)
    finally:
        triton_fwd._smem_limit = real


if __name__ == "__main__":
    raise SystemExit(main())
