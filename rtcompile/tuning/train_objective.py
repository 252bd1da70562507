"""The train bucket's trial (kernel "chunk_bwd"): forward + backward, every gradient checked.

A trial runs the forward as training would (``launch.running_tensor_fwd``, chunk mode, the
launcher's own config: the tuned table's, else the default) and then
``chunk_backward.running_tensor_bwd`` with the trial's ``BackwardConfig``, on one problem with
every feature on: gates, the delta rule, factor l2norm, an initial state, and gradients into
both the output (dO) and the final state (dS_T). Every result, the output, the final state and
each gradient (each query and key factor, v, g, beta, the initial state), is compared with
float64 autograd through ``reference.running_tensor_recurrent_ref``; the worst relative RMS
error must be within the dtype's tolerance, or the config is rejected. That gate is why the
tuner may search the backward at all: Triton 3.4-3.7 miscompile backward kernels on Hopper
(fla issues #640 and #984: wrong dk / dg / dbeta at 64-wide blocks), so a config that compiles
and runs may still give wrong gradients. The forward and backward are timed together: that is
what one training step pays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .keys import Bucket

# relative RMS error of any gradient against float64 autograd (tests/test_backward.py's bounds:
# fp32 gradients measured 1e-7 - 2e-6 there against a 1e-4 bound; 16-bit inputs 2e-2)
GRAD_TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 2e-2}


@dataclass
class TrainInputs:
    q: list
    k: list
    v: Any
    g: Any
    beta: Any
    h0: Any  # fp32 initial state
    do: Any  # the output's gradient (v's dtype)
    dht: Any  # the final state's gradient (fp32)


def make_train_inputs(bucket: Bucket, device: str, seed: int) -> TrainInputs:
    """The bucket's problem (drawn on the CPU, as the forward trials' are) with an initial
    state and the two incoming gradients, all from ``seed``."""
    import torch

    from ..kernels.inputs import random_inputs

    B, H, V = bucket.batch, bucket.heads, bucket.value_width
    q, k, v, g, beta, gen = random_inputs(B, bucket.seq_len, H, bucket.key_widths, V, bucket.dtype, device, seed)
    state = (B, H, *bucket.key_widths, V)
    h0 = (0.5 * torch.randn(*state, generator=gen)).to(device)
    do = torch.randn(*v.shape, generator=gen).to(device=device, dtype=v.dtype)
    dht = torch.randn(*state, generator=gen).to(device)
    return TrainInputs(q, k, v, g, beta, h0, do, dht)


def names(bucket: Bucket) -> list[str]:
    """What a train trial returns and is checked on, in order."""
    nf = len(bucket.key_widths)
    return ["o", "s", *(f"dq{i}" for i in range(nf)), *(f"dk{i}" for i in range(nf)), "dv", "dg", "dbeta", "dh0"]


def run_train(bucket: Bucket, variant, inp: TrainInputs) -> dict[str, Any]:
    """Forward (the launcher's config; with ``keep_forward``, the variant's own forward that
    the backward then starts from) then the backward with ``variant``: every result by name
    (:func:`names`)."""
    from ..kernels.chunk_backward import running_tensor_bwd
    from ..kernels.launch import running_tensor_fwd

    scale = float(bucket_scale(bucket))
    if getattr(variant, "keep_forward", False):  # the forward the backward keeps, as a training call runs it
        from ..kernels.chunk_backward import launch_backward
        from ..kernels.chunk_backward_kept import forward_kept
        from ..kernels.inputs import check_inputs

        p = check_inputs(inp.q, inp.k, inp.v, inp.g, inp.beta, scale, inp.h0, None)
        o, s, kept = forward_kept(variant, p, inp.q, inp.k, inp.v, inp.g, inp.beta, inp.h0, None, True, True)
        dq, dk, dv, dg, db, dh0 = launch_backward(variant, p, inp.q, inp.k, inp.v, inp.g, inp.beta, inp.h0, None,
                                                  True, inp.do, inp.dht, kept=kept)
        return dict(zip(names(bucket), [o, s, *dq, *dk, dv, dg, db, dh0]))
    o, s = running_tensor_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, initial_state=inp.h0, output_final_state=True,
                              l2norm=True, mode="chunk")
    dq, dk, dv, dg, db, dh0 = running_tensor_bwd(inp.q, inp.k, inp.v, inp.g, inp.beta, scale=scale,
                                                 initial_state=inp.h0, cu_seqlens=None, l2norm=True, do=inp.do,
                                                 dht=inp.dht, variant=variant)
    return dict(zip(names(bucket), [o, s, *dq, *dk, dv, dg, db, dh0]))


def bucket_scale(bucket: Bucket) -> float:
    """The forward's default scale, prod(d_i) ** -0.5 (the backward takes it explicitly)."""
    import math

    return math.prod(bucket.key_widths) ** -0.5


def train_reference(bucket: Bucket, inp: TrainInputs) -> dict[str, Any]:
    """Float64 autograd of the token loop: the output, the final state and every gradient."""
    import torch

    from ..kernels.reference import running_tensor_recurrent_ref

    leaf = lambda x: x.detach().double().requires_grad_(True)  # noqa: E731
    q, k = [leaf(x) for x in inp.q], [leaf(x) for x in inp.k]
    v, g, beta, h0 = leaf(inp.v), leaf(inp.g), leaf(inp.beta), leaf(inp.h0)
    with torch.enable_grad():
        o, s = running_tensor_recurrent_ref(q, k, v, g, beta, scale=bucket_scale(bucket), initial_state=h0,
                                            output_final_state=True, l2norm=True)
        loss = (o * inp.do.double()).sum() + (s * inp.dht.double()).sum()
        grads = torch.autograd.grad(loss, [*q, *k, v, g, beta, h0])
    return dict(zip(names(bucket), [o.detach(), s.detach(), *grads]))


def worst_error(got: dict[str, Any], ref: dict[str, Any], rel_rms) -> tuple[float, str]:
    """The largest relative RMS error over ``ref``'s names and the name it was seen on; a result
    the kernel did not return counts as an infinite error (a missing gradient is wrong)."""
    worst, where = 0.0, ""
    for name, want in ref.items():
        have = got.get(name)
        err = float("inf") if have is None or tuple(have.shape) != tuple(want.shape) else rel_rms(have, want)
        if not err <= worst:  # NaN and inf win
            worst, where = err, name
            if err != err:
                break
    return worst, where
