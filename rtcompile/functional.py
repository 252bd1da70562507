"""The public functional API: :func:`running_tensor`."""

from __future__ import annotations

from typing import Sequence

import torch

from .kernels import check_inputs, running_tensor_chunk_ref, running_tensor_recurrent_ref

MODES = ("auto", "recurrent", "chunk")
DEFAULT_CHUNK = 64


def running_tensor(
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
    mode: str = "auto",
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RunningTensor state mixer of order o = len(q) + 1.

    Args:
        q, k: o-1 query and key factors, each ``[B, T, H, d_i]`` (q[i] and k[i] share d_i).
        v: values ``[B, T, H, d_v]``, same dtype as the factors.
        g: log decay ``[B, T, H]`` (a_t = exp(g_t), so g <= 0); ``None`` for no forget gate.
        beta: delta-rule strength ``[B, T, H]`` in (0, 1); ``None`` for the plain (additive) update.
        scale: output scale, default ``prod(d_i) ** -0.5``.
        initial_state: ``[N, H, d_1, ..., d_{o-1}, d_v]``, N = B (or the number of sequences
            with ``cu_seqlens``).
        output_final_state: also return the final state (fp32; fp64 for fp64 inputs).
        l2norm: normalise every query and key factor to unit L2 norm.
        cu_seqlens: int32 offsets ``[N + 1]`` of sequences packed along T, with B = 1.
        mode: ``"recurrent"``, ``"chunk"`` or ``"auto"``.
        chunk_size: chunk length for ``mode="chunk"``; default 64.

    Returns:
        ``(o, final_state)``: o ``[B, T, H, d_v]`` in v's dtype; final_state or ``None``.

    Order 2 (one factor) is gated (delta) linear attention with flash-linear-attention's
    conventions. Today every mode runs the PyTorch references; the Triton kernels and the
    planner take over ``mode`` in later releases.
    """
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode: got {mode!r}; allowed: {', '.join(MODES)}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)):
        raise TypeError(f"chunk_size: expected an int or None, got {type(chunk_size).__name__}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size: got {chunk_size}; allowed: an integer >= 1, or None")
    p = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    C = chunk_size or DEFAULT_CHUNK
    if mode == "auto":
        # Until the planner measures the crossover: a sequence shorter than one chunk gains
        # nothing from the chunk form.
        mode = "chunk" if p.seq_len >= C else "recurrent"
    kwargs = dict(
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        l2norm=l2norm, cu_seqlens=cu_seqlens,
    )
    if mode == "recurrent":
        return running_tensor_recurrent_ref(q, k, v, g, beta, **kwargs)
    return running_tensor_chunk_ref(q, k, v, g, beta, chunk_size=C, **kwargs)
