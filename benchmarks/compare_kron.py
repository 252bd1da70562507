"""Check, then time, proposals against each shape's default in one process on one GPU: the split
form's state loop on the Kronecker factors (``loop="kron"``), changes to o3 16x16's
``phi_pass`` default (``--phi-pass``), to the streamed defaults above K = 256 (``--large``) and
to the Gluon-loop split defaults at K <= 256 (``--small-k``, sm_90), the split form's Triton
loop above K = 256 (``--split-large``, outside its space) and the streamed form's Gluon kernel
there (``--gluon-large``, sm_90). A change is config fields, or an UPPER-case name: a
``chunk_split`` (or ``chunk_streamed_gluon``) module constant set while that row is checked and
captured (a launch schedule, not a config field). A change that leaves the default as it is
(e.g. a Gluon row's on a GPU whose default is not the Gluon loop) is skipped, not timed.

    python benchmarks/compare_kron.py [--rounds 2] [--out FILE.json] [--only 32x32]
                                      [--phi-pass | --large | --small-k | --split-large | --gluon-large]
                                      [--stepped] [--batch 8] [--pick TEXT] [--jobs N]
                                      [--profile] [--timeline]

First every proposal runs against the float64 reference on the GPU (B1 T 203 and varlen
sequences of 37 and 166 tokens, H2 d_v 64: partial chunks, an initial state, gate, delta rule,
l2norm; bf16 and fp32 (ieee products); every workspace and output NaN-poisoned first). Only
proposals that pass are timed (``--jobs N``: a case's configs checked in N processes at once,
each then making one call at the timed shape, so the timing process finds them compiled).
Timing as ``compare_defaults.py``: B8 (``--batch``) T4096 H8 d_v 64 bf16, each call captured
in a CUDA graph per input set (two sets, replayed alternately), median of 7 x 20 replays; the
default and the proposals alternate within each round. The last columns: the largest
difference between a proposal's output and the default's over the largest output, and the time
over the default's. Prints a table last. ``--timeline``: each kernel's stream, start and end in
one captured replay (whether the pipelined parts run beside one another).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys

METHOD = ("B{batch} T4096 H8 d_v 64 bf16, gate + delta rule + l2norm + final state; CUDA-graph replays over two input "
          "sets, median of 7 x 20 per round, median over rounds; every proposal checked against float64 on the GPU "
          "first (bf16 and fp32, T 203 and varlen, NaN-poisoned workspaces)")
KRON = {"loop": "kron", "state_stride": 2, "pipeline": 2, "num_stages": 2, "prepare_warps": 1,
        "dot_precision": "tf32", "output_warps": 4}
# (case, widths, proposals: SplitConfig fields over KRON); probe_offline (sm_90, Triton 3.6):
# o3 32x32 C 16 8 warps 242 registers, no spill; C 32 8 warps 216 B; 16 warps at C 16 80 B
CASES = [
    ("o3 32x32", (32, 32), [
        dict(chunk_size=16, block_v=16, num_warps=8, output_block_v=16),
        dict(chunk_size=16, block_v=16, num_warps=8, output_block_v=32),
        dict(chunk_size=16, block_v=16, num_warps=16, output_block_v=16),
        dict(chunk_size=16, block_v=16, num_warps=8, output_block_v=16, state_stride=4),
        dict(chunk_size=16, block_v=16, num_warps=8, output_block_v=16, state_stride=1, pipeline=1),
        dict(chunk_size=32, block_v=16, num_warps=8, output_block_v=16),
    ]),
    ("o3 32x16", (32, 16), [
        dict(chunk_size=16, block_v=16, num_warps=8, output_block_v=32),
        dict(chunk_size=32, block_v=16, num_warps=8, output_block_v=32),
    ]),
    ("o3 16x16", (16, 16), [
        dict(chunk_size=16, block_v=32, num_warps=8, output_block_v=64),
        dict(chunk_size=32, block_v=32, num_warps=8, output_block_v=64),
        dict(chunk_size=32, block_v=16, num_warps=4, output_block_v=64),
        dict(chunk_size=16, block_v=16, num_warps=16, output_block_v=64),
        dict(chunk_size=64, block_v=32, num_warps=8, output_block_v=64, prepare_warps=2),
    ]),
]


# (case, widths, changes to the shape's default): the default is phi_pass since 2026-12-06
# (measured here at 329e92d beside the stored-phi(K) default, now a proposal). Changes to it
# measured here: at 251da1b (H200, two rounds) pipeline=4 (+ num_stages=2), block_v=16,
# output_warps=8, output_block_v=32, state_stride=1 and num_stages=2 ran 1.04-1.28x the default
# (0.3293 ms), phi(K) per part 1.008x; at e906e88 (H100) the output kernel over key slices
# 1.016-1.36x, the tile solve in registers 1.13-1.68x. tf32 products: the pick of a 40-trial
# tuner study of the phi_pass sub-space (H100, 5b49d2e: 0.3597 ms against 0.3688, both re-measured
# by the tuner); this script's run at 0b9f90f read that study's tuned table (its "default" was the
# pick) and is void: untuned() since. At 0bdb947 (H200, two rounds) tf32 ran 0.3186 ms against
# 0.3320 (the default since) and stored phi(K) with key_group 2 0.3478; at 13d22f1 (H100) ieee
# 1.028x the tf32 default, a state of every 4th chunk 1.007x, 8 loop warps 1.182x. An UPPER-case
# name is a chunk_split module constant set while that row is checked and captured; at eedfbe8
# (H100, two rounds) the phi kernel beside the first prepare kernel (PHI_BESIDE_PREPARE) ran
# 0.3623 ms against 0.3602 before it, the default. At 660c974 (H100, two rounds) phi(K) formed in
# the state loop from the key factors' tiles (no phi kernel, nothing stored) ran 1.23x at 8 warps
# (loop 274 us against 155: the outer product and its layout change sit on the chain), 1.49-1.64x
# at bv 16, C 32 or 4 warps; reverted.
# At a0c414e (H100, two rounds, each float64-checked first) one prepare launch for every part, so
# only the output kernels run beside the loops: 1.014x (2 parts), 1.023x (4), 1.065x (8); 4 parts
# as they are 1.040x. The replay's timeline (--timeline) says why: a kernel beside the loop slows
# it (a half-sequence loop 80 us alone, 101-107 beside the next prepare or the last outputs) and
# is slowed more (the half prepare 36 -> 106 us, the half outputs 50 -> 117), so the two parts
# hide only ~10 us a pair: 360 us a replay against 367 of kernel time run one after another.
# At ed1c78c (H100, two rounds) a loop that fills its SM's registers (64 programs of [256, 64] at 8
# warps) ran 1.119x (2 parts) and 1.108x (4): its quarter-sequence loop took 69-83 us (4.3-5.2 us a
# chunk against 2.5), and the outputs beside it still 55-67 us against 28 alone.
PHI_PASS: list = []
# (case, widths, changes to the default) at K <= 256 where the default is the split form with the
# Gluon loop (sm_90). The prepare kernel's solve products in tf32 with 16-bit inputs, as o3 16x16's
# default took them (0.960x there, H200 0bdb947), ran 0.985-0.994x the ieee defaults at c61325e (H100,
# two rounds) and are the defaults since; proposed now: ieee, the baseline
SMALL_K = [(case, widths, [dict(dot_precision="ieee")])
           for case, widths in (("o2 64", (64,)), ("o3 8x8", (8, 8)), ("o2 128", (128,)), ("o3 16x8", (16, 8)),
                                ("o2 256", (256,)))]
# (case, widths, changes to the streamed default) above K = 256. Measured here at 91fb7d6 (H200,
# two rounds): o3 32x32 with 256-row tiles and no state prefetch (the tuner's pick on an H100)
# 1.238 ms against 1.319 for the then default (128-row tiles loaded one ahead): the default since;
# chunks of 128 (row solve, 64-row tiles, passes merged) 61.2 ms, 46x
# At ed1c78c (H100, two rounds) the passes merged at o3 32x32 (a third less streamed state traffic
# a chunk; 250 registers at 8 warps offline, no spill) ran 1.3257 ms against 1.2218, 1.085x.
# (case, widths, SplitConfig fields over SPLIT_TRITON) above K = 256 (``--split-large``): the split
# form's Triton loop there, outside its space since its offline spills (probe_offline, Triton 3.6,
# sm_90, phi_pass + tf32: 696 B / 250 spill loads and stores in a 1276-instruction loop at C 32 bv16
# w8, 696 B at C 16, 1016 B at 16 warps; C 64, which compiles to wgmma with 128 B, needs one stage,
# refused since one failed on the H200). Timed at 1c4ee5a (H100, two rounds, float64-checked
# first): 3.84 / 6.97 / 3.66 ms in this order against the streamed default's 1.22: the spills cost
# more than the streamed loop's state round trips through L2 (16.6 us a chunk at o3 32x32)
SPLIT_TRITON = {"loop": "triton", "phi_pass": True, "state_stride": 2, "pipeline": 2, "num_stages": 2,
                "prepare_warps": 1, "dot_precision": "tf32", "output_warps": 4, "output_block_v": 16}
SPLIT_LARGE = [("o3 32x32", (32, 32), [
    dict(chunk_size=32, block_v=16, num_warps=8),
    dict(chunk_size=16, block_v=16, num_warps=8),
    dict(chunk_size=32, block_v=16, num_warps=8, state_stride=4),
])]
LARGE = [
    ("o3 32x32", (32, 32), [dict(block_k=128, prefetch_state=True)]),
    # the same row's other sizes: on an H100 at 1e7dd49 the default ran 0.850 ms against this change's
    # 0.873 at 32x16, and 2.692 against 3.231 at 64x32
    ("o3 32x16", (32, 16), [dict(block_k=128, prefetch_state=True)]),
    ("o3 64x32", (64, 32), [dict(block_k=128, prefetch_state=True)]),
]
# (case, widths, changes to the default) of the streamed form's Gluon sequential kernel
# (``--gluon-large``, chunk_streamed_gluon.py: the state on chip, phi formed once a chunk), the
# default on sm_90 at o3 K 512 and 1024 since 2026-12-07, against the Triton kernel (the default
# before) and without the factor tiles loaded ahead. H100, two rounds, one process (code of
# 8b97d0b + the loads ahead): o3 32x32 0.8016 ms without them, 1.2140 the Triton kernel, 0.7747
# with them (the default since); o3 32x16 0.6637 / 0.8445 / 0.6368. Before, the steps to the kernel:
# products as one wgmma each 1.2595 (descriptors hoisted and spilled), block_v 16 at 8 warps 1.3558,
# at 4 warps 2.0816 (o3 32x32)
# phi(Q) S from registers (chunk_streamed_gluon.query_in_registers, since 1f66982; H100, two
# runs): o3 32x32 0.7576 / 0.7569 ms against 0.7873 / 0.7841 from a phi(Q) tile (the kernel 618
# against 640 us, the prepare kernel 147 of the rest), o3 32x16 0.5714 / 0.5749 against 0.6456 /
# 0.6410; slower than that: R from registers too (0.7747, 0.6189), prepare_warps 1 or 4 (0.8154 /
# 0.8401 at o3 32x32, 0.6102 / 0.6270 at 32x16), and the kernel at o3 16x16 beside the split
# form's default (StreamedConfig C 64, block_k 64, block_v 32, 8 warps, tf32, loop "gluon", loads
# ahead: 0.4767-0.4885 against 0.3619 ms; timed through a whole-config row since removed)
# SCORES_ON_CHIP (P formed in the kernel: the prepare kernel's 255 registers and 86 spill
# loads/stores go to 144 and none, the kernel's loop 1373 -> 1634 instructions). At 5a2e90b (H100,
# two rounds): o3 32x32 default 0.7607 ms, no loads ahead 0.7275, SCORES 0.7744; o3 32x16 default
# 0.5783, no loads ahead 0.5823, SCORES 0.5631. R's and phi(Q)'s products in one loop
# (INTERLEAVE_PRODUCTS, removed since) failed the float64 gate at o3 32x32 (bf16 T 203 0.0253
# against 0.015) and ran 0.998x at 32x16
_EXPERIMENTS = [dict(SCORES_ON_CHIP=True)]
GLUON_LARGE = [
    ("o3 32x32", (32, 32), [dict(loop="triton", prefetch_inputs=False), dict(prefetch_inputs=False), *_EXPERIMENTS]),
    ("o3 32x16", (32, 16), [dict(loop="triton", prefetch_inputs=False), dict(prefetch_inputs=False), *_EXPERIMENTS]),
]
# (case, widths, changes to the default) for ``--solve``: the prepare kernel's solve. The solve in
# registers by products (solves.unit_lower_inverse_products) beside the tile solve's chain of
# loads and barriers: At 5f89585 (H100, two rounds, float64-checked first): o2 256 0.5635 ms at 4 prepare
# warps against 0.6053 (prepare kernel 176 against 230 us); elsewhere 1.02-1.34x (o3 32x32 0.7767
# against 0.7582 at 4 warps, 0.9753 at 8; 32x16 1.019x; o3 16x16 1.111x; o2 64 / o3 8x8 / o2 128 /
# o3 16x8 1.028-1.115x). The diagonal blocks by forward substitution in registers ran 1.004-1.742x
# everywhere (removed). The tile solve at 4 prepare warps: o3 32x32 1.099x. Without the loads
# ahead o3 32x32 ran 0.7281 ms against 0.7582 (0.7275 / 0.7607 in the call before; 32x16 1.009x)
# At bb1a5ee (H100, three rounds): o2 256 products 0.5884 / 0.5645 / 0.6632 ms at 2 / 4 / 8 warps
# against 0.6043; o3 32x32 without the loads ahead 0.7344 against 0.7587, with SCORES_ON_CHIP too
# 0.7518, with the product solve too 0.7609; o3 32x16 SCORES_ON_CHIP 0.5661, without the loads
# ahead too 0.5519 against 0.5725. Both defaults since; the previous ones are the proposals here
# The tile solve's diagonal steps unrolled (``unroll_solve``) at 6fe2f0a (H100, two rounds,
# float64-checked first): o3 32x32 0.7284 ms against 0.7369, o3 16x16 0.3506 against 0.3598, o2 64
# 1.006x (both defaults since; the diagonal blocks loaded at once instead: 0.972-1.079x, removed).
# Here: the default back without it, and the tile-solve defaults not yet measured with it. Chunks
# of 128 with the product solve at o3 64x64 did not compile in 500 s (since refused)
SOLVE = [
    ("o3 32x32", (32, 32), [dict(unroll_solve=False)]),
    ("o3 16x16", (16, 16), [dict(unroll_solve=False)]),
    *((case, widths, [dict(unroll_solve=True)]) for case, widths in (
        ("o3 32x16", (32, 16)), ("o2 128", (128,)), ("o3 8x8", (8, 8)), ("o3 16x8", (16, 8)), ("o3 64x64", (64, 64)))),
]

# The streamed form's chunk loop on the host (loop="stepped", chunk_stepped.py: two chunk-parallel
# launches a chunk) above K 1024, where the sequential kernel moves the state at 1.4 TB/s (o3
# 64x64, H200). Runs of key tiles (tiles_per_program) cut the partial products' traffic (16 runs
# at C 64: 16 KiB a token-head beside the state's 32), chunks of 128 the state's (the tile solve
# takes them in two halves). H100, B1 T4096 at 9516cfa (against the sequential kernel's 4.005
# ms): C 128 runs of 4 0.920 ms (o3 64x64's default since), runs of 8 1.209; C 64 1.445 (runs of
# 1), 1.491 (4), 1.638 (128-row tiles, 64 columns, 4), 1.512 (128-row tiles, 4 warps, 2). B8 and
# order 4 not timed yet. Offline (Triton 3.6, sm_90, o3 64x64) none spills: the state kernel
# 128-254 registers, the output kernel 128-254 (at C 128 it spills 584 B at 4 warps, none at 8),
# the C 128 prepare kernel 88 B at 8 warps; C 128 with 64 columns compiles to 254 registers
# without spilling (admitted since the loop has its own register estimate). o3 64x64's proposals
# are changes to that default: the sequential kernel it replaced first. Order 4's state kernel
# spills at every tiling tried offline (456 B at the C 128 proposal's).
_C128 = dict(loop="stepped", chunk_size=128, block_k=128, num_warps=8, prepare_warps=8)
STEPPED = [
    ("o3 64x64", (64, 64), [dict(loop="triton", chunk_size=64, block_k=256, prepare_warps=2, merge_passes=True,
                                 tiles_per_program=1),
                            dict(tiles_per_program=2), dict(tiles_per_program=8), dict(block_v=64),
                            dict(chunk_size=64, block_k=256, prepare_warps=2, tiles_per_program=1)]),
    ("o4 16x16x16", (16, 16, 16), [dict(loop="stepped", tiles_per_program=4), dict(_C128, tiles_per_program=4)]),
    ("o3 32x32", (32, 32), [dict(loop="stepped", block_k=256, block_v=32, num_warps=8, tiles_per_program=2)]),
]


def split_fields(fields: dict) -> tuple[dict, dict]:
    """(config fields, chunk_split module constants): UPPER-case names are the constants."""
    return ({k: v for k, v in fields.items() if not k.isupper()}, {k: v for k, v in fields.items() if k.isupper()})


def _patched(constants: dict):
    """Module ``constants`` set for the block (a schedule the launcher reads per call): each in
    chunk_split or chunk_streamed_gluon, whichever has it."""
    from unittest import mock

    from rtcompile.kernels import chunk_split, chunk_streamed_gluon

    stack = contextlib.ExitStack()
    for name, value in constants.items():
        # an unknown name falls to the last module, whose patch then fails naming it
        module = chunk_split if hasattr(chunk_split, name) else chunk_streamed_gluon
        stack.enter_context(mock.patch.object(module, name, value))
    return stack


def split_config(base: dict, fields: dict):
    """The SplitConfig of a row over ``base`` (KRON, SPLIT_TRITON): SplitConfig's defaults, then
    the base's fields, then the row's."""
    from rtcompile.kernels.chunk_split import SplitConfig

    return SplitConfig.from_dict({**SplitConfig(16, 16).to_dict(), **base, **fields})


def _name(fields: dict, base: dict | None) -> str:
    """A row's name: the changes to the default (``base`` None), or a split config's main fields."""
    if base is None:
        return "default + " + " ".join(f"{k}={v}" for k, v in fields.items())
    f = {**base, **fields}
    return (f"{f['loop']} C{f['chunk_size']} bv{f['block_v']} w{f['num_warps']} stride{f['state_stride']} "
            f"parts{f['pipeline']} out{f['output_block_v']}")


def _nan_empty(*shape, dtype, device):
    import torch

    t = torch.empty(*shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-(2**30))


@contextlib.contextmanager
def _parts(on: bool):
    """Eager calls run the config's pipelined parts (a graph capture's path) in parts of any
    length, so T 203 cuts into parts; off: as the launcher decides (one part eagerly)."""
    from rtcompile.kernels import chunk_split, pipeline

    saved = chunk_split.parts_pay, pipeline.MIN_PART_CHUNKS
    if on:
        chunk_split.parts_pay, pipeline.MIN_PART_CHUNKS = (lambda device: True), 1
    try:
        yield
    finally:
        chunk_split.parts_pay, pipeline.MIN_PART_CHUNKS = saved


def check(config, widths) -> str | None:
    """None when ``config`` matches float64 on the GPU in every case (one part, then the
    pipelined parts on their streams), else what failed."""
    import torch

    from rtcompile.kernels import args, running_tensor_recurrent_ref
    from rtcompile.kernels.config import KernelShape
    from rtcompile.kernels.launch import smem_limit
    from rtcompile.kernels.launch import running_tensor_fwd

    saved = args.empty, args.empty_like
    args.empty = _nan_empty
    args.empty_like = lambda x: _nan_empty(*x.shape, dtype=x.dtype, device=x.device)
    try:
        for dtype, tol, parts in ((torch.bfloat16, 1.5e-2, False), (torch.float32, 5e-5, False),
                                  (torch.bfloat16, 1.5e-2, True), (torch.float32, 5e-5, True)):
            cfg = config  # fp32: ieee products where the config has a precision (a tuned default may be fused)
            if dtype != torch.bfloat16 and hasattr(config, "dot_precision"):
                cfg = dataclasses.replace(config, dot_precision="ieee")
            if cfg.check(KernelShape(tuple(widths), 64, dtype.itemsize), smem_limit(torch.device("cuda"))):
                continue  # (fp32 operands need twice the shared memory: C 32 at K 1024 does not fit)
            if parts and getattr(cfg, "pipeline", 1) == 1:
                continue  # one part: the same calls again (at K 1024 each config's checks took ~70 s)
            for offsets in (None, [0, 37, 203]):
                gen = torch.Generator().manual_seed(7)
                r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
                B, T, H, V = 1, 203, 2, 64
                n = 1 if offsets is None else len(offsets) - 1
                q = [r(B, T, H, w).to(dtype) for w in widths]
                k = [r(B, T, H, w).to(dtype) for w in widths]
                v = r(B, T, H, V).to(dtype)
                g = (-torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.2).float()
                beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64).to(dtype)
                s0 = (r(n, H, *widths, V) * 0.05).float()
                cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32)
                dev = lambda x: x.cuda()  # noqa: E731
                with _parts(parts):
                    o, s = running_tensor_fwd([dev(x) for x in q], [dev(x) for x in k], dev(v), dev(g), dev(beta),
                                              initial_state=dev(s0), output_final_state=True, l2norm=True,
                                              cu_seqlens=None if cu is None else dev(cu), variant=cfg)
                    if o.is_cuda:
                        torch.cuda.synchronize()
                up = lambda x: x.double()  # noqa: E731
                o_ref, s_ref = running_tensor_recurrent_ref(
                    [up(x) for x in q], [up(x) for x in k], up(v), up(g), up(beta), initial_state=s0.double(),
                    output_final_state=True, l2norm=True, cu_seqlens=cu)
                for name, got, ref in (("output", o, o_ref), ("state", s, s_ref)):
                    got = got.cpu().double()
                    err = float("inf") if torch.isnan(got).any() else float(
                        (got - ref).abs().max() / ref.abs().max())
                    if not err < tol:
                        where = f"{'varlen' if cu is not None else 'T203'}{' parts' if parts else ''}"
                        return f"{dtype} {where} {name}: {err:.3g} (tol {tol})"
    finally:
        args.empty, args.empty_like = saved
    return None


def kernel_split(call, n: int = 5) -> dict[str, float]:
    """Per-kernel GPU time of ``call`` (eager: one pipelined part), us per call, by kernel name."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    total = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.time_range.elapsed_us() / n
    return dict(total.most_common(6))


def graph_timeline(graph) -> list[dict]:
    """The kernels of one replay of ``graph`` in start order: name, stream, start and end (us from
    the replay's first kernel), registers and shared memory (torch.profiler's CUPTI trace). It
    shows whether the pipelined parts' kernels run beside one another and what that costs each:
    a kernel beside others lasts longer than alone (the eager split)."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        with open(f"{tmp}/trace.json") as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    events.sort(key=lambda e: e["ts"])
    t0 = events[0]["ts"] if events else 0.0
    return [{"kernel": e["name"], "stream": e.get("args", {}).get("stream"), "start_us": e["ts"] - t0,
             "end_us": e["ts"] + e["dur"] - t0, "registers": e.get("args", {}).get("registers per thread"),
             "smem": e.get("args", {}).get("shared memory")} for e in events]


def _capture_output(fn):
    """(the CUDA graph of ``fn``, the outputs its replays write)."""
    from compare_defaults import _capture

    held = []
    graph = _capture(lambda: held.append(fn()))
    return graph, held[-1]


def _proposals(case, base, default, proposals, pick) -> list[tuple[str, object, dict]]:
    """(name, config, module constants) of each proposal to time, in order: changes to
    ``default`` (``base`` None) or split configs over ``base``; one that leaves the default as it
    is is named on stderr and left out, as are those whose name does not hold ``pick``."""
    out = []
    for fields in proposals:
        fields, patch = split_fields(fields)
        cfg = type(default).from_dict({**default.to_dict(), **fields}) if base is None else split_config(base, fields)
        name = _name({**fields, **patch}, base)
        if cfg == default and not patch:  # nothing to compare: the default timed against itself
            print(f"{case} {name}: the default itself here, skipped", file=sys.stderr, flush=True)
        elif not pick or pick in name:
            out.append((name, cfg, patch))
    return out


def _warm_call(config, widths, batch) -> None:
    """One eager call at the timed inputs' shape, so the kernels the capture launches are in
    Triton's cache (the float64 gate's T 203 calls specialise some kernels' arguments apart)."""
    import torch

    import compare_defaults
    import rtcompile

    compare_defaults.B = batch
    rtcompile.running_tensor(*compare_defaults._prefill_inputs(widths, 1), l2norm=True, output_final_state=True,
                             mode="chunk", backend="triton", variant=config)
    torch.cuda.synchronize()


def _check_and_warm(config, patch, widths, batch) -> str | None:
    """A pool worker's :func:`check` of one config (its module constants set), then, where it
    passed, :func:`_warm_call`: what failed, or None."""
    with _patched(patch):
        failed = check(config, widths)
        if failed is None:
            _warm_call(config, widths, batch)
    return failed


def check_all(todo, widths, jobs: int, batch: int, context: str = "spawn") -> list[str | None]:
    """:func:`check` of each (name, config, constants) in ``todo``, in order. ``jobs`` > 1:
    in that many processes at once, each also making one call at the timed shape (``batch``),
    so the main process captures on a warm Triton cache: a cold config took ~60-80 s to compile
    and check at K 4096 (H100, 9516cfa), one after another, while 15 of the machine's 16 cores
    sat idle. ``context``: the processes' start method (spawn: the caller holds a CUDA context)."""
    if jobs <= 1:
        results = []
        for _, cfg, patch in todo:
            with _patched(patch):
                results.append(check(cfg, widths))
        return results
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context(context)
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(todo)), mp_context=ctx) as pool:
        return list(pool.map(_check_and_warm, *zip(*[(cfg, patch, widths, batch) for _, cfg, patch in todo])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--only", help="only the cases whose name contains this")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--phi-pass", action="store_true", help="only the phi_pass proposals")
    only.add_argument("--large", action="store_true", help="only the proposals above K = 256")
    only.add_argument("--small-k", action="store_true", help="only the proposals for the Gluon-loop rows, K <= 256")
    only.add_argument("--split-large", action="store_true",
                      help="only the split form's Triton-loop configs above K = 256")
    only.add_argument("--solve", action="store_true", help="only the solves in registers, every default's shape")
    only.add_argument("--gluon-large", action="store_true",
                      help="only the streamed form's Gluon sequential kernel above K = 256 (sm_90)")
    only.add_argument("--stepped", action="store_true",
                      help="only the streamed form's chunk loop on the host (loop='stepped') at K >= 1024")
    ap.add_argument("--batch", type=int, default=8,
                    help="sequences of the timed calls (default 8; B1 is the single-prompt prefill)")
    ap.add_argument("--pick", help="only the proposals whose name contains this (the default is always timed)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="check (and compile) a case's configs in this many processes at once before timing")
    ap.add_argument("--timeline", action="store_true",
                    help="also the kernel timeline of one captured replay of the default and the fastest proposal")
    ap.add_argument("--profile", action="store_true",
                    help="also the per-kernel split (torch.profiler, eager) of the default and the fastest proposal")
    args = ap.parse_args()
    if args.batch < 1:
        ap.error(f"--batch: a number of sequences >= 1, got {args.batch}")
    if args.jobs < 1:
        ap.error(f"--jobs: a number of processes >= 1, got {args.jobs}")
    # (split fields the proposals go over, or None for changes to the default; case, widths,
    # proposals), by the list's name
    lists = {"CASES": [(KRON, *c) for c in CASES], "PHI_PASS": [(None, *c) for c in PHI_PASS],
             "LARGE": [(None, *c) for c in LARGE], "SMALL_K": [(None, *c) for c in SMALL_K],
             "SPLIT_LARGE": [(SPLIT_TRITON, *c) for c in SPLIT_LARGE],
             "GLUON_LARGE": [(None, *c) for c in GLUON_LARGE], "SOLVE": [(None, *c) for c in SOLVE],
             "STEPPED": [(None, *c) for c in STEPPED]}
    chosen = [name for name in ("PHI_PASS", "LARGE", "SMALL_K", "SPLIT_LARGE", "GLUON_LARGE", "SOLVE", "STEPPED")
              if getattr(args, name.lower())] \
        or ["CASES", "PHI_PASS"]
    if not any(lists[name] for name in chosen):  # an empty list between trials: nothing to time
        print(f"compare_kron: {' and '.join(chosen)} list no proposals; add (case, widths, "
              "[changes to the default]) to time one", file=sys.stderr)
        return 2
    import compare_defaults
    from compare_defaults import _prefill_inputs, _timed, untuned

    compare_defaults.B = args.batch  # the timed inputs' batch (_prefill_inputs reads it)

    untuned()  # "default": the defaults table's config, whatever a tuner step wrote before
    import torch

    import rtcompile
    from rtcompile.kernels import launch
    from rtcompile.kernels.inputs import check_inputs

    dev = torch.device("cuda")
    rows = []
    for base, case, widths, proposals in (c for name in chosen for c in lists[name]):
        if args.only and args.only not in case:
            continue
        sets = [_prefill_inputs(widths, seed) for seed in (1, 2)]
        p = check_inputs(*sets[0], None, None, None)
        default = launch.resolve_config("chunk", None, p, dev)
        todo = [("default", default, {})]  # the default runs the same checks first
        for name, cfg, patch in _proposals(case, base, default, proposals, args.pick):
            refusal = cfg.check(launch.kernel_shape(p), launch.smem_limit(dev))
            if refusal:
                print(f"{case} {name}: refused: {refusal}", file=sys.stderr, flush=True)
                rows.append({"case": case, "config": name, "failed": refusal})
            else:
                todo.append((name, cfg, patch))
        configs, constants = {}, {}
        for (name, cfg, patch), failed in zip(todo, check_all(todo, widths, args.jobs, args.batch)):
            print(f"{case} {name}: {failed or 'matches float64'}", file=sys.stderr, flush=True)
            if failed:
                rows.append({"case": case, "config": name, "failed": failed})
            elif name == "default" or "default" in configs:
                configs[name], constants[name] = cfg, patch
        if "default" not in configs:
            continue

        def call(s, cfg):
            return lambda: rtcompile.running_tensor(*s, l2norm=True, output_final_state=True, mode="chunk",
                                                    backend="triton", variant=cfg)
        outs, graphs = {}, {}
        for n, c in configs.items():
            with _patched(constants.get(n, {})):
                captured = [_capture_output(call(s, c)) for s in sets]
            graphs[n] = [graph for graph, _ in captured]
            graphs[n][0].replay()  # the captured parts' output (the graph's memory), compared below
            torch.cuda.synchronize()
            outs[n] = captured[0][1][0].float()
        times = {n: [] for n in configs}
        for _ in range(args.rounds):
            for n in configs:
                times[n].append(_timed(graphs[n]))
        ref = outs["default"]
        base = statistics.median(times["default"])
        for n in configs:
            t = statistics.median(times[n])
            diff = float((outs[n] - ref).abs().max() / ref.abs().max())
            rows.append({"case": case, "config": n, "fields": configs[n].to_dict(), "constants": constants.get(n, {}),
                         "ms": t * 1e3,
                         "rounds_ms": [x * 1e3 for x in times[n]], "vs_default": t / base, "diff": diff})
            print(f"{case} {n}: {t * 1e3:.4f} ms ({t / base:.3f} of the default), diff {diff:.2e}", file=sys.stderr,
                  flush=True)
        fastest = min((n for n in configs if n != "default"), key=lambda n: statistics.median(times[n]),
                      default=None)
        if args.profile:
            for n in ("default", fastest) if fastest else ("default",):
                with _patched(constants.get(n, {})):
                    split = kernel_split(call(sets[0], configs[n]))
                rows.append({"case": case, "profile": n, "kernels_us": split})
                print(f"{case} {n} kernels (us per eager call): "
                      + "; ".join(f"{k[:40]} {v:.1f}" for k, v in split.items()), flush=True)
        if args.timeline:
            for n in ("default", fastest) if fastest else ("default",):
                lines = graph_timeline(graphs[n][0])
                rows.append({"case": case, "profile": n, "timeline": lines})
                print(f"{case} {n}: kernel timeline of one replay (us; stream, start, end, duration)", flush=True)
                for e in lines:
                    print(f"  {e['kernel'][:40]:40s} {e['stream']!s:>4} {e['start_us']:7.1f} {e['end_us']:7.1f} "
                          f"{e['end_us'] - e['start_us']:6.1f}", flush=True)
        del sets, graphs, outs
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("RTCOMPILE_COMMIT", "unknown"),
                       "method": METHOD.format(batch=args.batch), "torch": torch.__version__,
                       "triton": __import__("triton").__version__, "rows": rows}, f, indent=1)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"proposals vs the default, B{args.batch} T4096 H8 d_v 64 bf16 "
                        f"({torch.cuda.get_device_name()}, median of {args.rounds} rounds)")
    for col in ("case", "config", "ms", "x default", "diff"):
        table.add_column(col)
    for r in rows:
        if "profile" in r:
            continue
        if "failed" in r:
            table.add_row(r["case"], r["config"], "FAILED", r["failed"], "")
        else:
            table.add_row(r["case"], r["config"], f"{r['ms']:.4f}", f"{r['vs_default']:.3f}", f"{r['diff']:.1e}")
    Console(width=160).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
