"""``rtcompile bench --phase train``: forward + backward of the chunk form beside fla's.

Per case (B8 T4096 H8 d_v 64 bf16, gate + delta rule + l2norm, zero initial state) and
implementation: the forward + backward time (loss on the output and the final state, upstream
gradients drawn once), the forward alone, and the peak extra memory of one forward + backward.

* ``rtcompile``: ``rtcompile.running_tensor(..., mode="chunk", backend="triton")`` on factor
  leaves that require grad: the Triton forward and the Triton backward through the public API.
  A problem the Triton backward refuses is a ``refused: <reason>`` row.
* ``torch-ref``: the same call with ``backend="reference"`` (PyTorch autograd of the chunk
  form; 172 ms at o3 16x16 on the H200, RESULTS.md: cheap enough to time at every case).
* ``fla``: fla-core's ``chunk_gated_delta_rule`` forward + backward on materialised Kronecker
  keys (built outside the timed region; the gradients stop at phi(q), phi(k)), with its Hopper
  guard for Triton 3.4-3.7.0 switched off for timing only (see FLA_GUARD_NOTE), restored after.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from typing import Any, Callable, Iterator

from .core import FLA_MAX_K, IMPL_FLA, IMPL_REF, IMPL_RT, BenchContext, Case, Outcome
from .measure import (Inputs, fla_ops, fla_refusal, input_seed, kronify, make_inputs, peak_extra_bytes,
                      time_calls, warm_up)

TRAIN_B, TRAIN_T, QUICK_TRAIN_T = 8, 4096, 1024
# order 3 16x16 (the target) and fla's order-2 anchors (K 64-256: fla's chunk limit)
# above K = 256 ours alone: fla refuses it, and the reference's autograd keeps every token's
# state (o3 32x32 at B8 T4096 H8: 4096 x 1 MiB per sequence-head)
TRAIN_WIDTHS = ((16, 16), (64,), (128,), (256,), (32, 32), (64, 64), (16, 16, 16))
QUICK_TRAIN_WIDTHS = ((16, 16), (64,))

FLA_GUARD_MODULE, FLA_GUARD = "fla.ops.common.chunk_o", "TRITON_ABOVE_3_7_1"
FLA_GUARD_NOTE = (
    f"fla's Hopper guard switched off for timing only ({FLA_GUARD_MODULE}.{FLA_GUARD} = True): "
    "its gradients may be wrong (fla #640, #984); keys materialised outside the timed region"
)
_BACKWARD_REFUSAL = "the Triton backward cannot run this call: "

TRAIN_METHOD = (
    "Train: forward + backward per call = running_tensor (or fla's chunk_gated_delta_rule) then "
    "torch.autograd.backward on (o, final state) with fixed random upstream gradients, gradients "
    "cleared before each call; eager calls between CUDA events (host time included), median of "
    "--repeats (fewer for calls over 10 s of total timing), after 2 warm-up calls (compile, "
    "autotune never timed); no CUDA graph, no L2 rotation (one input set: its tensors, >= 64 MiB "
    "at these shapes, exceed L2, and a call takes milliseconds). fwd_ms: the forward alone under "
    "torch.no_grad, timed the same way. Peak extra memory = max_memory_allocated during one forward "
    "+ backward - allocated before (inputs, upstream gradients) - the gradients it returns. "
    "tok/s = B*T / (forward + backward). rtcompile = backend='triton' (Triton forward and backward), "
    "torch-ref = backend='reference' (PyTorch autograd, chunk form), both on factor leaves; fla on "
    "materialised phi(q), phi(k) with its Hopper guard off for timing only (see the row's note)."
)


def train_cases(quick: bool = False) -> list[Case]:
    """Train cases: B8 H8 V64 bf16, T 4096 (1024 quick); our kernels, the reference and fla."""
    T = QUICK_TRAIN_T if quick else TRAIN_T
    widths = QUICK_TRAIN_WIDTHS if quick else TRAIN_WIDTHS
    return [Case(f"o{len(w) + 1}_{'x'.join(map(str, w))}_B{TRAIN_B}_T{T}_train", "train", tuple(w), TRAIN_B, T,
                 impls=(IMPL_RT, IMPL_REF, IMPL_FLA) if math.prod(w) <= 256 else (IMPL_RT,)) for w in widths]


def _fla_guard_module() -> Any:
    return importlib.import_module(FLA_GUARD_MODULE)


@contextlib.contextmanager
def fla_guard_off() -> Iterator[None]:
    """fla's Hopper guard off inside the block (timing only), restored after."""
    mod = _fla_guard_module()
    missing = object()
    old = getattr(mod, FLA_GUARD, missing)
    setattr(mod, FLA_GUARD, True)
    try:
        yield
    finally:
        if old is missing:
            delattr(mod, FLA_GUARD)
        else:
            setattr(mod, FLA_GUARD, old)


def _leaf(x: Any) -> Any:
    return x.detach().clone().requires_grad_()


def _forward(impl: str, case: Case, inp: Inputs) -> tuple[Callable[[], Any], list]:
    """(forward returning (o, final state), its leaves) of ``impl``; fla gets phi(q), phi(k)."""
    from ..functional import running_tensor

    if impl == IMPL_FLA:
        kin = kronify(inp)
        q, k, v, g, beta = (_leaf(x) for x in (kin.q[0], kin.k[0], kin.v, kin.g, kin.beta))
        op = fla_ops().chunk_gated_delta_rule
        return (lambda: op(q=q, k=k, v=v, g=g, beta=beta, scale=inp.scale, initial_state=None,
                           output_final_state=True, use_qk_l2norm_in_kernel=True)), [q, k, v, g, beta]
    q, k = [_leaf(x) for x in inp.q], [_leaf(x) for x in inp.k]
    v, g, beta = _leaf(inp.v), _leaf(inp.g), _leaf(inp.beta)
    backend = "reference" if impl == IMPL_REF else "triton"
    # the reference at the harness's chunk (case.chunk_size); ours at its kernel's default
    extra = {"chunk_size": case.chunk_size} if impl == IMPL_REF else {}

    def fwd() -> Any:
        return running_tensor(q, k, v, g, beta, scale=inp.scale, output_final_state=True, l2norm=True,
                              mode="chunk", backend=backend, **extra)

    return fwd, [*q, *k, v, g, beta]


def _train_call(fwd: Callable[[], Any], leaves: list, do: Any, dht: Any) -> Callable[[], list]:
    """One forward + backward from cleared gradients; returns the leaves' gradients."""
    import torch

    def call() -> list:
        for x in leaves:
            x.grad = None
        o, s = fwd()
        torch.autograd.backward([o, s.reshape(dht.shape)], [do, dht])
        return [x.grad for x in leaves]

    return call


def _refused(exc: ValueError) -> NotImplementedError | None:
    """The API's refusal of a problem the Triton backward cannot run, as a refusal (its reason)."""
    text = " ".join(str(exc).split())
    if _BACKWARD_REFUSAL not in text:
        return None
    return NotImplementedError(text.split(_BACKWARD_REFUSAL, 1)[1].split("; allowed:", 1)[0])


def measure_train(case: Case, impl: str, ctx: BenchContext) -> Outcome:
    """Warm-up, peak extra memory of one forward + backward, its timing, the forward's timing."""
    import torch

    if impl == IMPL_FLA and (why := fla_refusal(case)):
        return Outcome(note=why)
    inp = make_inputs(case, ctx.device, input_seed(case, 0))
    gen = torch.Generator(device=ctx.device).manual_seed(input_seed(case, 30_000))
    do = torch.randn(inp.v.shape, generator=gen, device=ctx.device, dtype=torch.float32).to(inp.v.dtype)
    state = (case.B, case.H, case.K, case.V) if impl == IMPL_FLA else (case.B, case.H, *case.key_widths, case.V)
    dht = torch.randn(state, generator=gen, device=ctx.device, dtype=torch.float32)
    fwd, leaves = _forward(impl, case, inp)
    call = _train_call(fwd, leaves, do, dht)
    guard = fla_guard_off() if impl == IMPL_FLA else contextlib.nullcontext()
    with torch.enable_grad(), guard:  # run_bench measures under no_grad
        try:
            warm_up([call], ctx)
        except ValueError as exc:
            refusal = _refused(exc)
            if refusal is None:
                raise
            raise refusal from None
        for x in leaves:
            x.grad = None
        peak = peak_extra_bytes(call, ctx)
        t = time_calls([call], ctx, graph=False)
        with torch.no_grad():
            warm_up([fwd], ctx, passes=1)
            t_fwd = time_calls([fwd], ctx, graph=False)
    note = f"fwd {t_fwd.seconds * 1e3:.3g} ms, fwd+bwd {t.seconds / t_fwd.seconds:.1f}x fwd"
    if impl == IMPL_FLA:
        note += f"; K={case.K} <= {FLA_MAX_K}; {FLA_GUARD_NOTE}"
    return Outcome(seconds=t.seconds, timing=f"{t.method}; forward: {t_fwd.method}", peak_extra_mem_bytes=peak,
                   note=note, fwd_seconds=t_fwd.seconds)
