"""What the backward reads of the forward, and the training forward that keeps it.

The chunk backward (``chunk_backward.py``) starts by recomputing the forward: the prepare kernel
(the scores P, the inverse T, the cumulative log decay and, for the resident state loops, the
normalised phi(K) and phi(Q)) and the state loop (every chunk's incoming state S, U and R).
:func:`recompute` does that and returns it as :class:`Recomputed`.

With ``BackwardConfig.keep_forward`` (the default for 16-bit inputs up to K = 256, in the train
tuner's space), an eager training call's forward is :func:`forward_kept` instead of the
forward's own config: the same prepare and state loop, with the final state stored, then the
split form's output kernel for O from the stored states (resident loops), or the streamed
forward's kernel storing the states as it forms O (streamed loops: one sequential pass). The
backward then starts from what it kept (``ops.KeptForward``), so a training step runs the
prepare and the state loop once instead of twice (the forward's own and the recompute). The
price is memory between the forward and the backward: what :func:`recompute` allocates is held
from the forward on instead of only during the backward. Per (sequence, head), with the products in 16-bit and 16-bit workspaces (bf16
inputs up to K = 256 without a gate; with one U and R are fp32, 4 d_v each: "mixed"): per chunk S (2 K d_v bytes); per token P and T (4 C each), phi(K) and
phi(Q) (2 K each), U and R (2 d_v each), the log decay (4); o3 16x16, d_v 64, C 32: 2.5 KiB
per token-head, 640 MiB at B8 T4096 H8, held per layer until its backward. Streamed loops (the
default above K = 256) keep S per chunk (2 K d_v bytes), P and T, U and R (4 d_v each, fp32):
o3 32x32 at C 64, 0.75 GiB per layer at that shape, o3 64x64 2.25 GiB (7.14 against 8.10 ms and
22.4 against 28.3 ms forward + backward with a recompute, H200, 2026-12-03). A model that
cannot hold that for every layer takes a tuned table entry with ``keep_forward`` false (the
backward then recomputes them, 2.73 against 2.01 ms forward + backward at that shape on the H200).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import triton

from . import args
from .args import dot_dtype, factor_args, lowp_dots, width_args
from .chunk_backward_streamed import recompute_streamed
from .chunk_prepare import chunk_indices, prepare_backward
from .chunk_split import ALL_CHUNKS, SplitConfig, chunk_split_output_kernel, chunk_split_state_kernel
from .inputs import Problem
from .launch_cache import cached


@dataclass
class Recomputed:
    """The forward as the backward's kernels read it. ``ws``: ``prepare_backward``'s dict ("P",
    "Ai", "Gc", and "Kw" / "Qw" for the resident loops); ``Hc``: every chunk's incoming state
    ([chunks, H, K, V], the products' type); ``Uc``, ``Rc``: U and R (v's shape, the config's
    workspace type; Rc None without the delta rule); ``idx`` / ``offsets``: the varlen chunk
    pairs and each sequence's first chunk (None when not varlen); ``n_chunks``: per sequence."""

    ws: dict
    Hc: torch.Tensor
    Uc: torch.Tensor
    Rc: torch.Tensor | None
    idx: torch.Tensor | None
    offsets: torch.Tensor | None
    n_chunks: list[int]

    def tensors(self) -> tuple:
        """Every tensor field (None where absent), in the order :meth:`from_tensors` reads."""
        return (*self.ws.values(), self.Hc, self.Uc, self.Rc, self.idx, self.offsets)

    @classmethod
    def from_tensors(cls, keys: tuple, tensors, n_chunks: list[int]) -> "Recomputed":
        """The inverse of :meth:`tensors`, given ``ws``'s keys and ``n_chunks``."""
        return cls(dict(zip(keys, tensors[:len(keys)])), *tensors[len(keys):], n_chunks=n_chunks)

    def workspaces(self) -> list[torch.Tensor]:
        """The buffers the forward made (not the varlen indices), present ones only."""
        return [t for t in (*self.ws.values(), self.Hc, self.Uc, self.Rc) if t is not None]


def prepare_config(config) -> SplitConfig:
    """The split form's config for the prepare kernel and the state loop of BackwardConfig
    ``config`` (the output kernel's 64 value columns and 4 warps: the split form's measured
    best at o3 16x16, 0.084 ms against 0.135 with 32 columns, H200)."""
    return SplitConfig(chunk_size=config.chunk_size, block_v=config.block_v, num_warps=config.num_warps,
                       num_stages=config.num_stages, prepare_warps=config.prepare_warps, solve=config.solve,
                       dot_precision=config.dot_precision, key_group=config.key_group, output_block_v=64)


def workspace_dtype(config, v: torch.Tensor) -> torch.dtype:
    """U, R and dU: fp32 (``workspace_dtype`` "float32" or "mixed"), or the inputs' 16-bit type."""
    return v.dtype if config.workspace_dtype == "inputs" else torch.float32


def phi_grads_dtype(config, v: torch.Tensor) -> torch.dtype:
    """phi's stored gradients: fp32 (``workspace_dtype`` "float32"), or the inputs' 16-bit type."""
    return torch.float32 if config.workspace_dtype == "float32" else v.dtype


def prefetch_state_tiles(config, key_widths: tuple[int, ...], state_grads: bool) -> bool:
    """Whether a streamed loop issues each state tile's load one tile ahead: for tiles of up to 128
    rows; at 256, in the state-gradient loop (``state_grads``) with two key factors only. Measured
    at 256 rows (kernel ms, H200, 2026-12-03): the forward recompute o3 64x64 7.32 -> 6.01 without,
    32x32 1.40 -> 1.32; the state-gradient loop o3 64x64 5.70 -> 5.29 with, 32x32 1.26 -> 1.25, o4
    16^3 6.28 -> 6.37 (its three-factor phi blocks leave no registers for the extra tile)."""
    rows = min(config.state_block_k, math.prod(key_widths))
    return rows <= 128 or (state_grads and len(key_widths) <= 2)


def recompute(config, p: Problem, q, k, v, g, beta, h0, cu_seqlens, l2norm: bool,
              ht: torch.Tensor | None = None, o: torch.Tensor | None = None) -> Recomputed:
    """Prepare and the state loop of BackwardConfig ``config`` on contiguous inputs; ``ht``:
    also store the final state there (fp32); ``o`` (streamed loops only): also store the
    output there (v's shape and dtype), as the streamed forward does in the same loop."""
    if o is not None and config.state_loop != "streamed":
        raise ValueError("recompute: the output is stored by the streamed state loop only; got state_loop="
                         f"{config.state_loop!r}")
    B, T, H, V = v.shape
    C, K, bv, dev = config.chunk_size, p.key_dim, config.block_v, v.device
    varlen = cu_seqlens is not None
    n_chunks = [triton.cdiv(hi - lo, C) for lo, hi in p.seq_bounds] if varlen else [triton.cdiv(T, C)] * B
    idx = offsets = None
    if varlen:
        idx = chunk_indices(p, C, dev)
        offsets = torch.tensor([0, *itertools.accumulate(n_chunks)], dtype=torch.int32).to(dev)
    resident = config.state_loop == "resident"
    store = workspace_dtype(config, v)
    ws = prepare_backward(prepare_config(config), p, q, k, v, g, beta, cu_seqlens=cu_seqlens, idx=idx, l2norm=l2norm,
                          keys=resident)
    if resident:
        Hc = args.empty(sum(n_chunks), H, K, V, dtype=dot_dtype(v), device=dev)
        Uc = args.empty(B, T, H, V, dtype=store, device=dev)
        Rc = args.empty(B, T, H, V, dtype=store, device=dev) if beta is not None else None
        cached(chunk_split_state_kernel)[(triton.cdiv(V, bv), p.num_seqs * H)](
            v, beta, h0, ht, ws["Ai"], None, None, ws["Kw"], ws["Gc"], Hc, Uc, Rc, cu_seqlens, offsets, T, 0,
            ALL_CHUNKS,
            H=H, K=K, V=V, C=C, BV=bv, LOWP=lowp_dots(v.dtype), PREC=config.dot_precision, TMA=False, STRIDE=1,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    else:
        Hc, Uc, Rc = recompute_streamed(
            p, q, k, v, g, beta, h0=h0, ht=ht, o=o, prefetch_state=prefetch_state_tiles(config, p.key_widths, False),
            cu_seqlens=cu_seqlens, offsets=offsets,
            l2norm=l2norm, ws=ws, chunk_size=C, block_k=min(config.state_block_k, K), block_v=bv, num_warps=config.num_warps,
            num_stages=config.num_stages, precision=config.dot_precision, store_dtype=store,
            merge_passes=config.merge_passes)
    return Recomputed(ws=ws, Hc=Hc, Uc=Uc, Rc=Rc, idx=idx, offsets=offsets, n_chunks=n_chunks)


def forward_kept(config, p: Problem, q, k, v, g, beta, h0, cu_seqlens, l2norm: bool,
                 output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor | None, Recomputed]:
    """The forward of a training call under BackwardConfig ``config`` (``keep_forward``) on
    contiguous inputs: (o in v's dtype, the final state in fp32 or None, what the backward
    reads). Resident loops: O = scale (diag(Gamma) phi(Q) S + P U) per chunk by the split form's
    output kernel from the kept states; streamed loops: O from the streamed state loop itself,
    which stores the states as it goes (the state lives in the final-state buffer there)."""
    B, T, H, V = v.shape
    o = args.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    if config.state_loop == "streamed":
        ht = args.empty(p.state_shape, dtype=torch.float32, device=v.device)  # the running state
        kept = recompute(config, p, q, k, v, g, beta, h0, cu_seqlens, l2norm, o=o, ht=ht)
        return o, (ht if output_final_state else None), kept
    ht = args.empty(p.state_shape, dtype=torch.float32, device=v.device) if output_final_state else None
    kept = recompute(config, p, q, k, v, g, beta, h0, cu_seqlens, l2norm, ht=ht)
    split = prepare_config(config)
    bv = min(split.output_block_v, max(16, triton.next_power_of_2(V)))
    programs = kept.idx.shape[0] if cu_seqlens is not None else kept.n_chunks[0]
    heads = H if cu_seqlens is not None else p.num_seqs * H
    cached(chunk_split_output_kernel)[(programs, heads, triton.cdiv(V, bv))](
        *factor_args(q), *factor_args(k), kept.ws["Gc"], o, kept.Hc, kept.Uc, cu_seqlens, kept.idx, kept.offsets,
        p.scale, T, 0,
        H=H, NF=len(q), **{n: w for n, w in width_args(p.key_widths, 16).items() if not n.startswith("BD")},
        V=V, C=config.chunk_size, BV=bv, L2NORM=l2norm, LOWP=lowp_dots(v.dtype), PREC=config.dot_precision, STRIDE=1,
        num_warps=split.output_warps, num_stages=config.num_stages,
    )
    return o, ht, kept
