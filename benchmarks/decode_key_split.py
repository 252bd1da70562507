"""An experiment for the decode step at K >= 1024 (GPU timing; its check also runs on the CPU):
the key axis of each slab split over sibling programs that read whole state rows.

At K 1024 the decode kernel's [1024, 16] tile reads 64-byte pieces of each 256-byte state row,
and that pattern alone holds a copy to 0.741 of torch's (``decode_ceiling.py --widths 32 32
--batches 32``, H100) against 0.956 for [256, 64] tiles. Here each of a slab's ceil(K / block_k)
siblings reads one [block_k, d_v] tile once, reduces it (phi(k) . S, phi(q) . S, phi(k) . phi(q))
into a workspace and counts itself in (an int64 count per slab that only grows); the step is then
finished by either join:

- ``last``: the last sibling in sums the partials, stores o and updates the whole slab, its
  siblings' tiles re-read from L2. No program waits, so the interpreter runs it.
- ``wait``: every sibling waits for its slab's count, then updates its own tile from registers
  (one read, one write). It relies on siblings (adjacent program ids) being resident together,
  as GPUs dispatch blocks in order; the interpreter, which runs programs one by one, cannot.

H100 at ``fde6556`` (RESULTS.md): the wait join at block_k 128 ran K 1024 B32 in 0.819 of a copy
against the library's 0.776, but lost at B64 and B128 (0.852 / 0.856 against 0.877 / 0.892) and
at K 256; the last join lost everywhere (0.64-0.77). Not in the library.

Each variant is checked against the float64 step (bf16 factors, fp32 values so that o is compared
unrounded, padding slots, two calls in a row, NaN-poisoned outputs), then timed beside the library's decode step and torch's copy of the same
bytes: CUDA-graph replays over slot groups rotated past the L2, median of 7 replays of 20 calls,
two rounds.

    python benchmarks/decode_key_split.py [--check-only] [--rounds 2]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rtcompile.kernels.args import factor_args, width_args  # noqa: E402
from rtcompile.kernels.blocks import phi_gather  # noqa: E402
from rtcompile.kernels.recurrent import _sequence, _token_inputs, slot_mask  # noqa: E402
from rtcompile.kernels.reference import running_tensor_recurrent_ref  # noqa: E402

JOINS = ("last", "wait")


@triton.jit
def decode_key_split_kernel(q1, q2, q3, k1, k2, k3, v, g, beta, o, state, state_indices, part, count, scale,
                            num_slots, H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                            D3: tl.constexpr, BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr,
                            V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NKS: tl.constexpr,
                            L2NORM: tl.constexpr, EVICT: tl.constexpr, WAIT: tl.constexpr):
    """Sibling program_id(0) of slab program_id(1) (sequence x head): its [BK, BV] tile of the
    slot's state, its partials into ``part`` ([slabs, NKS, 3, BV] fp32), its count into ``count``
    ([slabs] int64); WAIT: the join (module docstring). EVICT: the tile loaded evict-last, for the
    last sibling's re-read from L2."""
    K: tl.constexpr = D1 * D2 * D3
    i_k, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    _, _, i_b, slot = _sequence(i_n, None, state_indices, 1)
    r = i_b * H + i_h
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    m_sv = slot_mask(slot, m_v, num_slots, BV)
    p_state = (slot * H + i_h) * K * V
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_s = m_k[:, None] & m_sv[None, :]
    # the slice first: it is what the program waits on
    if EVICT:
        b_s = tl.load(state + p_state + o_k[:, None] * V + o_v[None, :], mask=m_s, other=0.0, eviction_policy="evict_last")
    else:
        b_s = tl.load(state + p_state + o_k[:, None] * V + o_v[None, :], mask=m_s, other=0.0)
    b_v, b_a, r_q, r_k = _token_inputs(q1, q2, q3, k1, k2, k3, v, g, r, o_v, m_v, NF, D1, D2, D3, BD1, BD2, BD3,
                                       V, L2NORM)
    b_k = phi_gather(k1, k2, k3, r, o_k, m_k, D1, D2, D3, NF) * r_k
    b_q = phi_gather(q1, q2, q3, r, o_k, m_k, D1, D2, D3, NF) * r_q
    p_part = part + (i_nh.to(tl.int64) * NKS + i_k) * 3 * BV
    tl.store(p_part + o_v, tl.sum(b_s * b_k[:, None], axis=0))
    tl.store(p_part + BV + o_v, tl.sum(b_s * b_q[:, None], axis=0))
    tl.store(p_part + 2 * BV + o_v, tl.zeros([BV], dtype=tl.float32) + tl.sum(b_k * b_q, axis=0))
    tl.debug_barrier()  # every thread's partials stored before the count's release
    # counts only grow (int64): each call adds NKS to a group's, so none is ever reset
    old = tl.atomic_add(count + i_nh, 1, sem="acq_rel")
    if WAIT:  # every sibling waits for the group, then updates its own tile in registers
        target = (old // NKS + 1) * NKS
        while tl.atomic_add(count + i_nh, 0, sem="acquire") < target:
            pass
    if WAIT or old % NKS == NKS - 1:
        o_j = tl.arange(0, NKS)
        p_all = part + (i_nh.to(tl.int64) * NKS + o_j[:, None]) * 3 * BV + o_v[None, :]
        b_pred = tl.sum(tl.load(p_all, cache_modifier=".cg"), axis=0)
        b_read = tl.sum(tl.load(p_all + BV, cache_modifier=".cg"), axis=0)
        b_kq = tl.sum(tl.load(p_all + 2 * BV, cache_modifier=".cg"), axis=0)
        if beta is not None:
            b_u = tl.load(beta + r).to(tl.float32) * (b_v - b_a * b_pred)
        else:
            b_u = b_v
        b_o = scale * (b_a * b_read + b_kq * b_u)
        if WAIT:
            m_o = m_v & (o_v * 0 + i_k == 0)  # sibling 0 stores o (a vector compare, as the interpreter needs)
            tl.store(o + r * V + o_v, b_o.to(o.dtype.element_ty), mask=m_o)
            tl.store(state + p_state + o_k[:, None] * V + o_v[None, :], b_s * b_a + b_k[:, None] * b_u[None, :],
                     mask=m_s, cache_modifier=".cs")
        else:  # the last sibling in finishes the step for all of them
            tl.store(o + r * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
            for j in range(NKS):  # a loop, not unrolled: one tile live at a time (unrolled: 254 registers)
                o_kj = j * BK + tl.arange(0, BK)
                m_kj = o_kj < K
                off = p_state + o_kj[:, None] * V + o_v[None, :]
                m_j = m_kj[:, None] & m_sv[None, :]
                b_sj = tl.load(state + off, mask=m_j, other=0.0)  # from L2: its sibling read it just now
                b_kj = phi_gather(k1, k2, k3, r, o_kj, m_kj, D1, D2, D3, NF) * r_k
                tl.store(state + off, b_sj * b_a + b_kj[:, None] * b_u[None, :], mask=m_j, cache_modifier=".cs")


_WORK: dict = {}  # (device, slabs, siblings, columns) -> (partials, counts): counts start at zero


def decode_key_split(q, k, v, g, beta, state, state_indices, *, scale: float, l2norm: bool, block_k: int,
                     num_warps: int, join: str = "last", evict: bool = False, out=None) -> torch.Tensor:
    """One decode step (T = 1) on ``state`` [slots, H, d_1, ..., d_v] fp32, in place; returns o
    (into ``out`` when given). One stream at a time: the workspace is shared by calls of a shape."""
    if join not in JOINS:
        raise ValueError(f"join: {join!r}; allowed: {', '.join(JOINS)}")
    N, _, H, V = v.shape
    widths = [x.shape[-1] for x in k]
    K = math.prod(widths)
    nks, bv = triton.cdiv(K, block_k), triton.next_power_of_2(V)
    key = (v.device, N * H, nks, bv)
    if key not in _WORK:
        _WORK[key] = (torch.empty(N * H * nks * 3 * bv, device=v.device),
                      torch.zeros(N * H, dtype=torch.int64, device=v.device))
    part, count = _WORK[key]
    o = torch.empty_like(v) if out is None else out
    decode_key_split_kernel[(nks, N * H)](
        *factor_args(q), *factor_args(k), v, g, beta, o, state, state_indices, part, count, scale, state.shape[0],
        H=H, NF=len(widths), **width_args(widths, 1), V=V, BK=block_k, BV=bv, NKS=nks,
        L2NORM=l2norm, EVICT=evict, WAIT=join == "wait", num_warps=num_warps)
    return o


def inputs(B: int, H: int, W: tuple, V: int, dev, slots: int, seed: int, values=torch.bfloat16):
    """bf16 factors, values (and so o) in ``values``, fp32 gates and beta, an fp32 cache of
    ``slots`` rows."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    q = [torch.randn(B, 1, H, w, device=dev, generator=gen).to(torch.bfloat16) for w in W]
    k = [torch.randn(B, 1, H, w, device=dev, generator=gen).to(torch.bfloat16) for w in W]
    v = torch.randn(B, 1, H, V, device=dev, generator=gen).to(values)
    g = -torch.rand(B, 1, H, device=dev, generator=gen) * 0.1
    beta = torch.rand(B, 1, H, device=dev, generator=gen)
    cache = torch.randn(slots, H, *W, V, device=dev, generator=gen) * 0.1
    return q, k, v, g, beta, cache


def step64(q, k, v, g, beta, cache, idx, scale):
    """The float64 decode step by the library's token-loop oracle: o [N, H, V] and the cache
    after it (padding rows untouched)."""
    new = cache.double().clone()
    live = idx >= 0
    rows = idx.clamp(min=0).long()
    d = [x.double() for x in (*q, *k, v, g, beta)]
    n = len(q)
    o, S = running_tensor_recurrent_ref(d[:n], d[n:2 * n], *d[2 * n:], scale=scale, initial_state=new[rows],
                                        output_final_state=True, l2norm=True)
    new[rows[live]] = S[live]
    return o[:, 0], new


def check(B: int, W: tuple, dev, block_k: int, num_warps: int, join: str, pad: bool, H: int = 3, V: int = 64):
    """Two calls in a row against the float64 step: the largest error of o over its largest entry
    and of the cache over its largest. fp32 values, so o is fp32 too (a bf16 o's rounding alone
    is ~5e-3 of its largest entry, the library's step's as this one's). Padding rows' o is not
    compared (it is meaningless)."""
    slots = B + 3
    q, k, v, g, beta, cache = inputs(B, H, W, V, dev, slots, 1, values=torch.float32)
    idx = torch.randperm(slots, device=dev)[:B].to(torch.int32)
    if pad:
        idx[B // 2] = -1
    scale = math.prod(W) ** -0.5
    ref = cache.double()
    err_o = err_s = 0.0
    for _ in range(2):
        o_ref, ref = step64(q, k, v, g, beta, ref, idx, scale)
        o = torch.full_like(v, float("nan"))  # an unwritten entry fails
        decode_key_split(q, k, v, g, beta, cache, idx, scale=scale, l2norm=True, block_k=block_k,
                         num_warps=num_warps, join=join, out=o)
        keep = idx >= 0
        d_o = (o[:, 0].double() - o_ref)[keep]
        err_o = max(err_o, (d_o.abs().max() / o_ref[keep].abs().max()).item() if keep.any() else 0.0)
        err_s = max(err_s, ((cache.double() - ref).abs().max() / ref.abs().max()).item())
    return err_o, err_s


# fp32 sums over K <= 1024 (the interpreter: 0.9e-7 - 4.6e-7 of the largest entry)
O_TOLERANCE, STATE_TOLERANCE = 1e-5, 1e-5


def check_cases(dev) -> list[tuple]:
    """(widths, block_k, warps, batch) of the checks: odd batches, orders 2-4, 2 to 16 siblings."""
    if dev == "cpu":
        return [((64,), 16, 4, 3), ((8, 8), 4, 4, 3), ((4, 4, 4), 32, 4, 2), ((32, 32), 256, 4, 2)]
    return [((256,), 64, 4, 37), ((16, 16), 64, 4, 37), ((32, 32), 256, 8, 37), ((32, 32), 512, 16, 37),
            ((32, 32), 128, 4, 37), ((16, 16, 4), 256, 8, 37)]


def run_checks(dev) -> None:
    joins = ("last",) if dev == "cpu" else JOINS  # the interpreter cannot run a waiting sibling
    for W, bk, warps, B in check_cases(dev):
        for join in joins:
            for pad in (False, True):
                e_o, e_s = check(B, W, dev, bk, warps, join, pad)
                print(f"check {'x'.join(map(str, W))} block_k {bk} w{warps} {join}{' padded' if pad else ''}: "
                      f"o {e_o:.1e}, state {e_s:.1e}", flush=True)
                if not (e_o < O_TOLERANCE and e_s < STATE_TOLERANCE):
                    raise SystemExit(f"decode_key_split: {join} at {W} block_k {bk} is wrong: o {e_o:.2e}, "
                                     f"state {e_s:.2e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    opts = ap.parse_args(argv)
    if opts.rounds < 1:
        ap.error(f"--rounds: {opts.rounds}; allowed: an integer >= 1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    run_checks(dev)
    if opts.check_only or dev == "cpu":
        return 0
    from rtcompile import running_tensor_decode_
    from rtcompile.timing import graph_replay_seconds

    print(torch.cuda.get_device_name())
    table = []
    for W, B in (((32, 32), 32), ((32, 32), 64), ((32, 32), 128), ((16, 16), 256), ((16, 16), 32)):
        H, V = 8, 64
        K = W[0] * W[1]
        per = B * H * K * V * 4
        groups = max(2, -(-int(120e6) // per))  # slot groups rotated past the 50 MB L2
        q, k, v, g, beta, cache = inputs(B, H, W, V, "cuda", groups * B, 0)
        idx = [torch.arange(i * B, (i + 1) * B, device="cuda", dtype=torch.int32)[torch.randperm(B, device="cuda")]
               for i in range(groups)]
        src = [torch.empty(per, dtype=torch.uint8, device="cuda").fill_(1) for _ in range(groups)]
        dst = [torch.empty_like(s) for s in src]
        scale = K**-0.5
        variants = {"copy": [lambda s=s, d=d: d.copy_(s) for s, d in zip(src, dst)],
                    "default": [lambda i=i: running_tensor_decode_(q, k, v, g, beta, state_cache=cache, state_indices=i,
                                                                   l2norm=True, validate=False) for i in idx]}
        for bk, warps in (((256, 8), (512, 16), (128, 4)) if K == 1024 else ((64, 4), (128, 8))):
            for join, ev in (("last", False), ("last", True), ("wait", False)):
                variants[f"split {bk} w{warps} {join}{' evict_last' if ev else ''}"] = [
                    lambda i=i, bk=bk, w=warps, j=join, ev=ev: decode_key_split(
                        q, k, v, g, beta, cache, i, scale=scale, l2norm=True, block_k=bk, num_warps=w, join=j, evict=ev)
                    for i in idx]
        times = {n: [] for n in variants}
        for _ in range(opts.rounds):
            for n, calls in variants.items():
                times[n].append(graph_replay_seconds(calls, 20, 7) * 1e6)
        copy = statistics.median(times["copy"])
        for n, ts in times.items():
            us = statistics.median(ts)
            table.append((f"K{K} B{B}", n, us, copy / us))
        del cache, src, dst
        torch.cuda.empty_cache()
    print(f"{'case':10s} {'variant':28s} {'us':>8s} {'x copy':>7s}")
    for case, n, us, frac in table:
        print(f"{case:10s} {n:28s} {us:8.2f} {frac:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
