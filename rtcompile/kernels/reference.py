"""Pure-PyTorch references for RunningTensor: the oracle for every kernel and export.

Two forms with the public signature of :func:`rtcompile.running_tensor`:

* :func:`running_tensor_recurrent_ref`: a plain token loop on the order-o state, contracting
  one key axis at a time (it never forms the Kronecker feature phi, so the equivalence with
  order-2 linear attention on phi is something the tests check, not an assumption);
* :func:`running_tensor_chunk_ref`: the chunk-parallel form (intra-chunk scores as products of
  per-axis Gram blocks, the UT/WY triangular solve for the delta rule, gates, state carried
  between chunks). It is the CPU fallback for moderate sizes.

Both compute in float64 when the inputs are float64 and in float32 otherwise; the output has
the dtype of ``v`` and the final state the compute dtype. Conventions follow
flash-linear-attention's gated delta rule (``g`` is the log decay, ``a_t = exp(g_t)``; ``beta``
switches the delta rule on; ``l2norm`` normalises every query and key factor with eps 1e-6)::

    S_t = a_t S_{t-1} + b_t (v_t - <a_t S_{t-1}, k_t>) (x) k1_t (x) ... (x) k{o-1}_t
    o_t = scale * <S_t, q1_t, ..., q{o-1}_t>
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .inputs import LOG_DECAY_FLOOR, Problem, check_inputs

L2NORM_EPS = 1e-6  # flash-linear-attention's l2norm eps, so order 2 matches its kernels


def l2normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def kron_features(factors: Sequence[torch.Tensor]) -> torch.Tensor:
    """phi = f1 (x) f2 (x) ... over the last axis, row-major (f1's index major)."""
    phi = factors[0]
    for f in factors[1:]:
        phi = (phi.unsqueeze(-1) * f.unsqueeze(-2)).flatten(-2)
    return phi


def _compute_dtype(p: Problem) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _contract(S: torch.Tensor, factors: Sequence[torch.Tensor]) -> torch.Tensor:
    """<S, f1, f2, ...>: contract S [B, H, d_1, ..., d_v] key axis by key axis."""
    for f in factors:
        S = torch.einsum("bhi...,bhi->bh...", S, f)
    return S


def _outer(factors: Sequence[torch.Tensor], u: torch.Tensor) -> torch.Tensor:
    """f1 (x) f2 (x) ... (x) u as a [B, H, d_1, ..., d_v] tensor."""
    X = u
    for f in reversed(factors):
        X = torch.einsum("bhi,bh...->bhi...", f, X)
    return X


Segment = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _run(segment: Segment, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens, **kw):
    """Validate, then run ``segment`` on the whole batch or on each packed sequence."""
    p = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    cdt = _compute_dtype(p)

    def prep(x: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
        return None if x is None else x[:, lo:hi].to(cdt)

    if initial_state is None:
        S0 = torch.zeros(p.state_shape, dtype=cdt, device=p.device)
    else:
        S0 = initial_state.to(cdt)
    bounds = p.seq_bounds or ((0, p.seq_len),)
    outs, finals = [], []
    for n, (lo, hi) in enumerate(bounds):
        qs = [prep(x, lo, hi) for x in q]
        ks = [prep(x, lo, hi) for x in k]
        if l2norm:
            qs, ks = [l2normalize(x) for x in qs], [l2normalize(x) for x in ks]
        s0 = S0 if p.seq_bounds is None else S0[n : n + 1]
        o, s = segment(qs, ks, prep(v, lo, hi), prep(g, lo, hi), prep(beta, lo, hi), s0, p.scale, **kw)
        outs.append(o)
        finals.append(s)
    o = torch.cat(outs, dim=1).to(v.dtype)
    return o, (torch.cat(finals, dim=0) if output_final_state else None)


def _recurrent_segment(qs, ks, v, g, beta, S, scale):
    """Token loop over [B, T, H, .] inputs from state S [B, H, d_1, ..., d_v]."""
    T = v.shape[1]
    extra = (None,) * (S.dim() - 2)
    out = torch.empty_like(v)
    for t in range(T):
        if g is not None:
            S = S * g[:, t].exp()[(...,) + extra]
        u = v[:, t]
        kt = [x[:, t] for x in ks]
        if beta is not None:
            u = beta[:, t, :, None] * (u - _contract(S, kt))
        S = S + _outer(kt, u)
        out[:, t] = scale * _contract(S, [x[:, t] for x in qs])
    return out, S


def _chunk_segment(qs, ks, v, g, beta, S, scale, chunk_size):
    """Chunk-parallel form over [B, T, H, .] inputs from state S [B, H, d_1, ..., d_v].

    Per chunk (C tokens, local cumulative log decay c, Gamma = exp(c), D_ij = exp(c_i - c_j)
    for j <= i):
        U = (I + A)^-1 diag(b) (V - diag(Gamma) phi(K) S0),  A = tril(diag(b) (K K^T * D), -1)
        O = scale (diag(Gamma) phi(Q) S0 + (Q K^T * D) U)
        S = Gamma_C S0 + (phi(K) * Gamma_C / Gamma)^T U
    with Q K^T = prod_i Q_i K_i^T and K K^T = prod_i K_i K_i^T (Gram blocks of the factors).
    Without the delta rule U = V. Padding the last chunk with zeros (k = v = 0, g = 0) is exact.
    """
    B, T, H, V = v.shape
    C = min(chunk_size, T)  # one chunk holds the whole segment: no [.., C, C] tensors beyond it
    NT = -(-T // C)
    pad = NT * C - T

    def to_chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, NT, C, ...]
        x = x.movedim(2, 1)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        return x.reshape(B, H, NT, C, *x.shape[3:])

    Qs, Ks, Vc = [to_chunks(x) for x in qs], [to_chunks(x) for x in ks], to_chunks(v)
    cum = torch.zeros(B, H, NT, C, dtype=v.dtype, device=v.device)
    if g is not None:
        cum = to_chunks(g).clamp_min(LOG_DECAY_FLOOR).cumsum(-1)  # as the chunk kernels: -inf - -inf is NaN
    bc = to_chunks(beta) if beta is not None else None
    idx = torch.arange(C, device=v.device)
    incl = idx[:, None] >= idx[None, :]
    decay = torch.where(incl, cum[..., :, None] - cum[..., None, :], float("-inf")).exp()  # [B,H,NT,C,C]
    scores = torch.ones_like(decay)
    for Qi, Ki in zip(Qs, Ks):
        scores = scores * (Qi @ Ki.transpose(-1, -2))
    scores = scores * decay
    eye = torch.eye(C, dtype=v.dtype, device=v.device)
    if bc is not None:
        gram = torch.ones_like(decay)
        for Ki in Ks:
            gram = gram * (Ki @ Ki.transpose(-1, -2))
        A = torch.tril(bc[..., :, None] * gram * decay, -1)
        IA = eye + A
    Sf = S.reshape(B, H, -1, V)
    out = torch.empty(B, H, NT, C, V, dtype=v.dtype, device=v.device)
    for n in range(NT):
        phiQ = kron_features([x[:, :, n] for x in Qs])  # on chip in a kernel; [B, H, C, K]
        phiK = kron_features([x[:, :, n] for x in Ks])
        gam = cum[:, :, n].exp()[..., None]  # [B, H, C, 1]
        if bc is not None:
            rhs = bc[:, :, n, :, None] * (Vc[:, :, n] - gam * (phiK @ Sf))
            U = torch.linalg.solve_triangular(IA[:, :, n], rhs, upper=False, unitriangular=True)
        else:
            U = Vc[:, :, n]
        out[:, :, n] = scale * (gam * (phiQ @ Sf) + scores[:, :, n] @ U)
        last = cum[:, :, n, -1:]  # [B, H, 1]
        Sf = last.exp()[..., None] * Sf + (phiK * (last - cum[:, :, n]).exp()[..., None]).transpose(-1, -2) @ U
    o = out.reshape(B, H, NT * C, V)[:, :, :T].movedim(1, 2)
    return o, Sf.reshape(S.shape)


def running_tensor_recurrent_ref(
    q: Sequence[torch.Tensor],
    k: Sequence[torch.Tensor],
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    l2norm: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-loop reference (the oracle). See the module docstring for the math."""
    return _run(_recurrent_segment, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens)


def running_tensor_chunk_ref(
    q: Sequence[torch.Tensor],
    k: Sequence[torch.Tensor],
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    l2norm: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunk-parallel reference (CPU fallback); matches the token loop to rounding."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size: got {chunk_size}; allowed: an integer >= 1")
    return _run(
        _chunk_segment, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens,
        chunk_size=chunk_size,
    )
