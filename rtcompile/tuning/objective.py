"""The measured objective of one trial: run a variant, check it, time it.

Runs in a worker's child process (``python -m rtcompile.tuning.objective``, a JSON request on
stdin, a JSON result on stdout), so a compile error, an out-of-resources launch, an illegal
memory access or a hang ends that process, not the study.

Invariants: a variant whose output differs from the float64 reference by more than the
dtype's tolerance is ``rejected`` and never timed; every input is fresh random data (seeded);
times are medians of repeats after a warm-up (CUDA events on the GPU, the wall clock on the
CPU, where they are interpreter timings, not GPU timings).
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable

from ..timing import median_seconds
from .keys import Bucket

# relative RMS error against float64 that a variant may not exceed (the kernel tests' own
# tolerances are tighter: fp32 2e-5 max-relative; bf16 outputs round at about 2e-3 RMS)
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}


@dataclass
class Inputs:
    q: list
    k: list
    v: Any
    g: Any
    beta: Any
    cache: Any = None
    indices: Any = None


def make_inputs(bucket: Bucket, device: str, seed: int) -> Inputs:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    dt = getattr(torch, bucket.dtype)
    B, T, H, V = bucket.batch, bucket.seq_len, bucket.heads, bucket.value_width
    r = lambda *s: torch.randn(*s, generator=gen)
    q = [r(B, T, H, w).to(device=device, dtype=dt) for w in bucket.key_widths]
    k = [r(B, T, H, w).to(device=device, dtype=dt) for w in bucket.key_widths]
    v = r(B, T, H, V).to(device=device, dtype=dt)
    g = torch.nn.functional.logsigmoid(r(B, T, H)).to(device)
    beta = torch.sigmoid(r(B, T, H)).to(device=device, dtype=dt)
    inp = Inputs(q, k, v, g, beta)
    if bucket.kernel == "recurrent":
        inp.cache = r(B, H, *bucket.key_widths, V).to(device)
        inp.indices = torch.randperm(B, generator=gen).to(device=device, dtype=torch.int32)
    return inp


def run_kernel(bucket: Bucket, variant, inp: Inputs):
    """The kernel under test: returns (output, state) for comparison; decode updates
    ``inp.cache`` in place."""
    from ..kernels.triton_fwd import running_tensor_decode_, running_tensor_fwd

    if bucket.kernel == "chunk":
        return running_tensor_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, output_final_state=True, l2norm=True,
                                  mode="chunk", variant=variant)
    o = running_tensor_decode_(inp.q, inp.k, inp.v, inp.g, inp.beta, state_cache=inp.cache,
                               state_indices=inp.indices, l2norm=True, validate=False, variant=variant)
    return o, inp.cache  # updated in place (timing a clone would add its traffic)


def reference(bucket: Bucket, inp: Inputs):
    from ..kernels.reference import running_tensor_recurrent_ref

    up = lambda x: x.detach().double().cpu()
    s0 = None
    if bucket.kernel == "recurrent":
        s0 = up(inp.cache)[inp.indices.long().cpu()]
    o, s = running_tensor_recurrent_ref([up(x) for x in inp.q], [up(x) for x in inp.k], up(inp.v), up(inp.g),
                                        up(inp.beta), initial_state=s0, output_final_state=True, l2norm=True)
    if bucket.kernel == "recurrent":  # compare the cache rows the kernel updated
        full = up(inp.cache).clone()
        full[inp.indices.long().cpu()] = s
        s = full
    return o, s


def rel_rms(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not bool(a.isfinite().all()):
        return float("inf")
    return float(((a - b).pow(2).mean() / b.pow(2).mean().clamp_min(1e-300)).sqrt())


def _load_impl(path: str | None) -> Callable:
    if not path:
        return run_kernel
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def evaluate(request: dict[str, Any]) -> dict[str, Any]:
    """Check then time one variant; the result's ``status`` is ok, rejected or failed."""
    from ..kernels.variants import ChunkVariant, RecurrentVariant

    bucket = Bucket(**{**request["bucket"], "key_widths": tuple(request["bucket"]["key_widths"])})
    cls = ChunkVariant if bucket.kernel == "chunk" else RecurrentVariant
    variant = cls.from_dict(request["variant"]) if request.get("variant") is not None else None
    device = request.get("device", "cpu")
    impl = _load_impl(request.get("impl"))
    try:
        inp = make_inputs(bucket, device, int(request.get("seed", 0)))
        o_ref, s_ref = reference(bucket, inp)  # first: decode then updates inp.cache in place
        o, s = impl(bucket, variant, inp)
        err = max(rel_rms(o, o_ref), rel_rms(s, s_ref))
        if not err <= TOLERANCE[bucket.dtype]:
            return {"status": "rejected", "error": err,
                    "reason": f"relative RMS error {err:.2e} > {TOLERANCE[bucket.dtype]:.0e} against float64"}
        timing_inp = make_inputs(bucket, device, int(request.get("seed", 0)) + 1)  # fresh data
        seconds = median_seconds(lambda: impl(bucket, variant, timing_inp), device, int(request.get("repeats", 5)))
        return {"status": "ok", "seconds": seconds, "error": err}
    except Exception as exc:  # noqa: BLE001 -- any failure of one variant fails that trial only
        first = str(exc).splitlines()[0] if str(exc) else ""
        return {"status": "failed", "reason": f"{type(exc).__name__}: {first}"[:300]}


def main() -> int:
    request = json.loads(sys.stdin.read())
    print(json.dumps(evaluate(request)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
