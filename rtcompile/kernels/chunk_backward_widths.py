"""The backward for key widths the gradient kernels cannot tile (they need power-of-two factor
widths >= 16, whole factor tiles): two exact rewrites onto a problem they can.

- **Materialised keys** (order >= 3 up to K = prod d_i = ``MATERIALISE_MAX_K``: o3 8x8, 12x12,
  4x4, o4 2x3x5 ...): order 2's backward on phi(q), phi(k) ([B, T, H, K] in the inputs' type, 2 x
  2 K bytes per token-head; padded as below where K is not a power of two >= 16), phi's
  gradients taken to the factors (and through the l2norm) in closed form
  (``chunk_resident.kronecker_factor_grads``).
- **Zero-padded factors** (order 2, and larger K: 48, 24x24, 48x48 ...): every factor padded
  with zero columns to the next power of two >= 16, the initial state and the final state's
  gradient with zero rows to match, the backward run at the padded widths, and the gradients
  sliced back. Exact: a zero column of a factor makes every phi entry on it zero (with the
  l2norm too: the zeros change no norm), so the padded state rows stay zero and the real
  entries' gradients are those of the unpadded problem. The price is the padded K: o3 24x24
  runs as 32x32 (1.8x the key work), o2 48 as 64; the tuned table is read for the padded shape.

Both take the backward itself as ``bwd`` (``chunk_backward.running_tensor_bwd``, whose module
imports this one) and return its tuple: (dq list, dk list, dv, dg, dbeta, d initial state).
"""

from __future__ import annotations

import torch

from .chunk_resident import MATERIALISE_MAX_K, kronecker_factor_grads, materialise_pair
from .config import KernelShape, next_pow2


def tiled(shape: KernelShape) -> bool:
    """Can the gradient kernels take ``shape`` as it is (power-of-two key widths >= 16)?"""
    return shape.whole_factor_tiles


def materialised_keys(shape: KernelShape) -> bool:
    """Whether the backward runs ``shape`` on materialised keys: order >= 3 with factors the
    kernels cannot tile and K = prod d_i <= MATERIALISE_MAX_K (order 2's problem of width K,
    itself padded when K is not a power of two >= 16: o3 3x5 runs as o2 16)."""
    return len(shape.key_widths) >= 2 and not tiled(shape) and shape.key_dim <= MATERIALISE_MAX_K


def padded_widths(widths: tuple[int, ...]) -> tuple[int, ...]:
    """Each width rounded up to a power of two >= 16 (a whole factor tile)."""
    return tuple(max(16, next_pow2(d)) for d in widths)


def rewritten_widths(widths: tuple[int, ...]) -> tuple[int, ...]:
    """The key widths the backward's kernels run for a problem of ``widths``: themselves where
    they tile; else order 2's padded K (materialised keys) or each width padded. The train
    tuner tunes this shape, and a training call's backward looks its config up under it."""
    shape = KernelShape(tuple(widths), 16)
    if tiled(shape):
        return tuple(widths)
    return padded_widths((shape.key_dim,)) if materialised_keys(shape) else padded_widths(tuple(widths))


def materialised_bwd(bwd, p, q, k, v, g, beta, *, scale, initial_state, cu_seqlens, l2norm, do, dht, chunk_size,
                     variant):
    """The backward on materialised phi(q), phi(k) (the module docstring). The state's [.., d_1,
    .., d_v] is the same memory as [.., K, d_v]."""
    pq, pk = materialise_pair(q, k, l2norm)
    flat = (p.num_seqs, p.heads, p.key_dim, p.value_width)
    dpq, dpk, dv, dg, db, dh0 = bwd(
        [pq], [pk], v, g, beta, scale=scale,
        initial_state=None if initial_state is None else initial_state.reshape(flat), cu_seqlens=cu_seqlens,
        l2norm=False, do=do, dht=None if dht is None else dht.reshape(flat), chunk_size=chunk_size, variant=variant)
    dq, dk = kronecker_factor_grads(q, l2norm, dpq[0]), kronecker_factor_grads(k, l2norm, dpk[0])
    dh0 = None if dh0 is None else dh0.reshape(initial_state.shape)
    return dq, dk, dv, dg, db, dh0


def padded_bwd(bwd, p, q, k, v, g, beta, *, scale, initial_state, cu_seqlens, l2norm, do, dht, chunk_size, variant):
    """The backward on zero-padded factors (the module docstring): [.., d_i] -> [.., D_i] with
    D_i = :func:`padded_widths`; states [N, H, d_1, .., d_v] -> [N, H, D_1, .., d_v]."""
    widths = padded_widths(p.key_widths)
    real = tuple(slice(0, d) for d in p.key_widths)

    def pad_factor(x, d):
        return torch.nn.functional.pad(x, (0, d - x.shape[-1]))

    def pad_state(s):
        if s is None:
            return None
        out = s.new_zeros(*s.shape[:2], *widths, s.shape[-1])
        out[(slice(None), slice(None), *real)] = s
        return out

    dq, dk, dv, dg, db, dh0 = bwd(
        [pad_factor(x, d) for x, d in zip(q, widths)], [pad_factor(x, d) for x, d in zip(k, widths)], v, g, beta,
        scale=scale, initial_state=pad_state(initial_state), cu_seqlens=cu_seqlens, l2norm=l2norm, do=do,
        dht=pad_state(dht), chunk_size=chunk_size, variant=variant)
    dq = [x[..., :d].contiguous() for x, d in zip(dq, p.key_widths)]
    dk = [x[..., :d].contiguous() for x, d in zip(dk, p.key_widths)]
    dh0 = None if dh0 is None else dh0[(slice(None), slice(None), *real)].contiguous()
    return dq, dk, dv, dg, db, dh0
