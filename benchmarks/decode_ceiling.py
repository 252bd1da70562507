"""The decode kernel's access-pattern ceiling (GPU only): at H8 d_v 64 fp32, K 256 (``--widths 16
16``, the default) or any other widths, B256 and B32 (``--batches``), one process, beside torch's
copy of the same bytes:

- the decode step itself (``running_tensor_decode_``, gate + delta rule + l2norm), without beta,
  and without gate and beta; then at each of the tiles below that cover K (the default's other
  fields kept), so the copy pattern of a tile and the decode kernel on it sit side by side;
- a copy-shaped Triton kernel on the decode grid's tiles: each program loads a [BK, BV] tile of
  one sequence-head's slab (evict-first), scales it and stores it in place (streaming), with the
  slot read from state_indices first (as the decode kernel reads it) or the sequence's own row.

So the decode kernel's distance to a copy splits into what its grid's access pattern costs and
what its arithmetic costs. Each call is timed as graph replays over slot groups that rotate past
the L2 (``rtcompile.timing.graph_replay_seconds``: 20 calls a graph, median of 7 replays), two
rounds, median.

    python benchmarks/decode_ceiling.py [--widths 32 32] [--batches 32]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# BK, BV, warps by K. K 1024: the default's [1024, 16] tile reads 64-byte pieces of each 256-byte
# state row (at K 256 the [256, 16] pattern lost 37% of the copy on the H100); [512, 32] reads
# 128-byte pieces, [256, 64] and [128, 64] whole rows, but these split the key axis, which the
# decode kernel's reductions over K would have to join across programs
TILES = {256: ((256, 64, 8), (256, 32, 4), (256, 16, 2), (128, 64, 4), (64, 64, 2), (256, 64, 4)),
         1024: ((1024, 16, 8), (1024, 32, 16), (512, 32, 8), (256, 64, 8), (128, 64, 4))}


@triton.jit
def slab_tile_copy_kernel(state, state_indices, K: tl.constexpr, V: tl.constexpr, H: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr):
    """Tile program_id(0) of sequence-head program_id(1)'s [K, V] slab, scaled in place; the slot
    from ``state_indices`` (None: the sequence's own row)."""
    i_t, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    NV: tl.constexpr = V // BV
    i_k, i_v = i_t // NV, i_t % NV
    if state_indices is not None:
        slot = tl.load(state_indices + i_n).to(tl.int64)
    else:
        slot = i_n.to(tl.int64)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    off = (slot * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(state + off, eviction_policy="evict_first")
    tl.store(state + off, b_s * 0.999, cache_modifier=".cs")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[16, 16], help="key widths (K = their product)")
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 32])
    opts = ap.parse_args(argv)
    K = math.prod(opts.widths)
    if K not in TILES:
        ap.error(f"--widths: K = {K}; allowed: key widths whose product is one of {sorted(TILES)}")
    if min(opts.batches) < 1:
        ap.error(f"--batches: {min(opts.batches)}; allowed: integers >= 1")
    import dataclasses

    import torch

    from rtcompile import running_tensor_decode_
    from rtcompile.kernels import check_inputs, launch
    from rtcompile.timing import graph_replay_seconds

    dev = "cuda"
    H, W, V = 8, tuple(opts.widths), 64
    print(torch.cuda.get_device_name(), f"K {K}")
    for B in opts.batches:
        # slot groups rotated past the 50 MB L2 (K 256: 134 MB a group at B256, 17 MB at B32)
        groups = max(2, math.ceil(120e6 / (B * H * K * V * 4)))
        gen = torch.Generator(device=dev).manual_seed(0)
        cache = torch.randn(groups * B, H, *W, V, device=dev, generator=gen) * 0.1
        idx = [torch.arange(i * B, (i + 1) * B, device=dev, dtype=torch.int32)[torch.randperm(B, device=dev)]
               for i in range(groups)]
        own = [cache[i * B:(i + 1) * B] for i in range(groups)]
        q = [torch.randn(B, 1, H, w, device=dev, dtype=torch.bfloat16) for w in W]
        k = [torch.randn(B, 1, H, w, device=dev, dtype=torch.bfloat16) for w in W]
        v = torch.randn(B, 1, H, V, device=dev, dtype=torch.bfloat16)
        g = -torch.rand(B, 1, H, device=dev) * 0.1
        beta = torch.rand(B, 1, H, device=dev)
        src = [torch.empty(B * H * K * V * 4, dtype=torch.uint8, device=dev).fill_(1) for _ in range(groups)]
        dst = [torch.empty_like(s) for s in src]

        def decode(gate, b, variant=None):
            return [lambda i=i: running_tensor_decode_(q, k, v, gate, b, state_cache=cache, state_indices=i,
                                                       l2norm=True, validate=False, variant=variant) for i in idx]

        problem = check_inputs(q, k, v, g, beta, None, None, None)
        shape = launch.kernel_shape(problem)
        default = launch.resolve_config("recurrent", None, problem, torch.device(dev))
        print(f"B{B} default decode config: {default}")
        variants = {"copy_": [lambda s=s, d=d: d.copy_(s) for s, d in zip(src, dst)],
                    "decode": decode(g, beta), "decode, no beta": decode(g, None),
                    "decode, no gate or beta": decode(None, None)}
        for bk, bv, warps in TILES[K]:  # the decode kernel on each tile that covers K
            tile = dataclasses.replace(default, block_v=bv, num_warps=warps)
            if bk == K and tile.check(shape) is None:
                variants[f"decode [{bk},{bv}] w{warps}"] = decode(g, beta, tile)
        for bk, bv, warps in TILES[K]:
            grid = ((K // bk) * (V // bv), B * H)
            for name, args in ((f"tile copy [{bk},{bv}] w{warps}, slot loaded", [(cache, i) for i in idx]),
                               (f"tile copy [{bk},{bv}] w{warps}, own row", [(c, None) for c in own])):
                variants[name] = [lambda a=a, grid=grid, bk=bk, bv=bv, w=warps: slab_tile_copy_kernel[grid](
                    *a, K=K, V=V, H=H, BK=bk, BV=bv, num_warps=w) for a in args]
        rows = [(name, graph_replay_seconds(calls, 20, 7) * 1e6) for _ in range(2) for name, calls in variants.items()]
        copy = statistics.median(us for name, us in rows if name == "copy_")
        for name in variants:
            us = statistics.median(u for n, u in rows if n == name)
            print(f"B{B} {name:40s} {us:8.2f} us  fraction of the copy {copy / us:.3f}")


if __name__ == "__main__":
    main()
