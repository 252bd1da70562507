"""The measured objective of one trial: run a variant, check it, time it.

Runs in a worker's child process (``python -m rtcompile.tuning.objective``: JSON requests on
stdin, one line each, JSON results on stdout), so a compile error, an out-of-resources launch,
an illegal memory access or a hang ends that process, not the study. The process serves a
worker's trials one after another until one fails or hangs (``study.TrialRunner``).

Invariants: a variant whose output differs from the float64 reference by more than the
dtype's tolerance, over the whole output or in any one token's row (ROW_TOLERANCE), is
``rejected`` and never timed (the train bucket, kernel "chunk_bwd":
every gradient too, ``train_objective``); inputs are fresh random data (seeded): the
check inputs come from the study's seed (their float64 reference is computed once per study
and cached), the timing inputs from the trial's;
times are medians of repeats after a warm-up: on the GPU, replays of the call captured in a
CUDA graph (device time without the eager call's host time, which on the H200 on 2026-11-30
added ~0.15-0.2 ms to every prefill call and varied with the other workers' compiles: the
sweep's trial values moved 10-20% when re-measured), or CUDA events around eager calls where
capture fails (the trial records which); on the CPU the wall clock, interpreter timings, not
GPU timings. Only the timed section holds the
device (``store.device_lock``): compiling and checking run outside it, in parallel across
workers.
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..timing import as_replayed, kernel_seconds
from .keys import Bucket
from .store import device_lock
from .train_objective import GRAD_TOLERANCE, make_train_inputs, run_train, train_reference, worst_error

# relative RMS error against float64 that a variant may not exceed (the kernel tests' own
# tolerances are tighter: fp32 2e-5 max-relative; bf16 outputs round at about 2e-3 RMS)
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}
# The output's worst token row (one token of one sequence, all heads): its RMS error over the
# whole reference's RMS (the global scale, so a row the reference leaves near zero does not
# divide by ~0). The global check alone let a kernel that zeroes one row per sequence pass at
# T 4096 (bf16: ~1.6e-2, under 2e-2), as a zeroed row of typical size scores ~1 here. 5x the
# global tolerance: the correct kernels' worst row was 2-4x their global error on the CPU
# interpreter (2026-12-05; bf16 1.4e-2 at o3 4x4 V32 H2 T256, fp16 1.5e-3, fp32 7.5e-7; not yet
# measured on a GPU), a row's rounding scaling with its size. A zeroed row whose own RMS is
# under 5x the tolerance of the output's (bf16: a tenth) still passes.
ROW_TOLERANCE = {dtype: 5 * tol for dtype, tol in TOLERANCE.items()}


@dataclass
class Inputs:
    q: list
    k: list
    v: Any
    g: Any
    beta: Any
    cache: Any = None
    indices: Any = None


def make_inputs(bucket: Bucket, device: str, seed: int):
    """The bucket's problem (drawn on the CPU: one study checks every trial on the same values),
    plus a state cache and a slot permutation for the decode kernel (the train bucket's:
    ``train_objective.make_train_inputs``)."""
    import torch

    if bucket.kernel == "chunk_bwd":
        return make_train_inputs(bucket, device, seed)

    from ..kernels.inputs import random_inputs

    B, H, V = bucket.batch, bucket.heads, bucket.value_width
    *qkvgb, gen = random_inputs(B, bucket.seq_len, H, bucket.key_widths, V, bucket.dtype, device, seed)
    inp = Inputs(*qkvgb)
    if bucket.kernel == "recurrent":
        inp.cache = torch.randn(B, H, *bucket.key_widths, V, generator=gen).to(device)
        inp.indices = torch.randperm(B, generator=gen).to(device=device, dtype=torch.int32)
    return inp


def run_kernel(bucket: Bucket, variant, inp: Inputs):
    """The kernel under test: returns (output, state) for comparison; decode updates
    ``inp.cache`` in place."""
    from ..kernels.launch import running_tensor_decode_, running_tensor_fwd

    if bucket.kernel == "chunk":
        return running_tensor_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, output_final_state=True, l2norm=True,
                                  mode="chunk", variant=variant)
    o = running_tensor_decode_(inp.q, inp.k, inp.v, inp.g, inp.beta, state_cache=inp.cache,
                               state_indices=inp.indices, l2norm=True, validate=False, variant=variant)
    return o, inp.cache  # updated in place (timing a clone would add its traffic)


def reference(bucket: Bucket, inp) -> dict[str, Any]:
    """The float64 token loop on the inputs' own device. On the CPU, B8 T4096 H8 K256 is 4096
    steps over a 4 M-element float64 state, tens of seconds (more than the trial itself); on
    the GPU the same loop is a few thousand small launches (not yet timed there)."""
    from ..kernels.reference import running_tensor_recurrent_ref

    if bucket.kernel == "chunk_bwd":
        return train_reference(bucket, inp)
    up = lambda x: x.detach().double()
    s0 = None
    if bucket.kernel == "recurrent":
        s0 = up(inp.cache)[inp.indices.long()]
    o, s = running_tensor_recurrent_ref([up(x) for x in inp.q], [up(x) for x in inp.k], up(inp.v), up(inp.g),
                                        up(inp.beta), initial_state=s0, output_final_state=True, l2norm=True)
    if bucket.kernel == "recurrent":  # compare the cache rows the kernel updated
        full = up(inp.cache).clone()
        full[inp.indices.long()] = s
        s = full
    return {"o": o, "s": s}


def cached_reference(bucket: Bucket, inp: Inputs, seed: int, device: str):
    """:func:`reference` for the check inputs of ``seed``, computed once per study and kept as
    safetensors in the cache (the trials of a study share their check inputs; each trial still
    times on fresh ones). Stored in fp32: 1e-7 relative, far below every tolerance."""
    import hashlib

    import torch
    from safetensors.torch import load_file, save

    from ..kernels import reference as reference_module
    from ..kernels import tuned
    from ..fileio import atomic_write, file_sha256
    from .store import file_lock

    from . import train_objective

    # a changed oracle, or a changed train problem, re-runs
    code = file_sha256(reference_module.__file__) + file_sha256(train_objective.__file__)
    key = hashlib.sha256(f"{bucket.label}|{seed}|{torch.__version__}|{device}|{code}".encode()).hexdigest()[:24]
    path = tuned.cache_dir() / "references" / f"{key}.safetensors"
    with file_lock(path.with_suffix(".lock")):
        if path.exists():
            got = load_file(str(path), device=str(device))
            return {name: x.double() for name, x in got.items()}
        ref = reference(bucket, inp)
        atomic_write(path, save({name: x.float().contiguous() for name, x in ref.items()}))
        return ref


def rel_rms(a, b) -> float:
    a, b = a.detach().double(), b.detach().double().to(a.device)
    if not bool(a.isfinite().all()):
        return float("inf")
    return float(((a - b).pow(2).mean() / b.pow(2).mean().clamp_min(1e-300)).sqrt())


def worst_row(a, b) -> tuple[float, tuple[int, int]]:
    """The worst token row of output ``a`` (B, T, H, V) against reference ``b``: its RMS error
    over ``b``'s global RMS (ROW_TOLERANCE), and its (sequence, token)."""
    a, b = a.detach().double(), b.detach().double().to(a.device)
    if not bool(a.isfinite().all()):
        return float("inf"), (0, 0)
    rows = (a - b).pow(2).reshape(b.shape[0] * b.shape[1], -1).mean(1)
    err, i = (rows / b.pow(2).mean().clamp_min(1e-300)).max(0)
    return float(err.sqrt()), divmod(int(i), b.shape[1])


def _load_impl(path: str | None, kernel: str = "chunk") -> Callable:
    if not path:
        return run_train if kernel == "chunk_bwd" else run_kernel
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


# A long-lived trial process keeps the last study's check inputs and reference (one bucket and
# seed at a time): building B8 T4096 inputs on the CPU and loading the reference would repeat
# for every trial of the study.
_CHECK: dict[str, Any] = {}


def _check_problem(bucket: Bucket, device: str, check_seed: int):
    key = f"{bucket.label}|{device}|{check_seed}"
    if _CHECK.get("key") != key:
        _CHECK.clear()
        inp = make_inputs(bucket, device, check_seed)
        ref = cached_reference(bucket, inp, check_seed, device)
        _CHECK.update(key=key, inp=inp, ref=ref)
    inp = _CHECK["inp"]
    if getattr(inp, "cache", None) is not None:  # decode updates its cache in place: each trial gets its own copy
        inp = replace(inp, cache=inp.cache.clone())
    return inp, _CHECK["ref"]


def evaluate(request: dict[str, Any]) -> dict[str, Any]:
    """Check then time one config (``request["variant"]``: its ``to_dict()``, or None for the
    launcher's own choice); the result's ``status`` is ok, rejected or failed."""
    from ..kernels.args import poisoned
    from ..kernels.forms import config_from_dict

    bucket = Bucket(**{**request["bucket"], "key_widths": tuple(request["bucket"]["key_widths"])})
    variant = config_from_dict(request["variant"], bucket.kernel) if request.get("variant") is not None else None
    device = request.get("device", "cpu")
    impl = _load_impl(request.get("impl"), bucket.kernel)
    train = bucket.kernel == "chunk_bwd"
    tol = (GRAD_TOLERANCE if train else TOLERANCE)[bucket.dtype]
    try:
        check_seed = int(request.get("check_seed", request.get("seed", 0)))
        inp, ref = _check_problem(bucket, device, check_seed)
        # a chunk call checked as timed: on a GPU its result from a CUDA-graph replay (the split
        # form's pipelined parts run only in captures: pipeline.parts_pay); a decode step
        # updates its cache in place, so it runs once. Outputs and workspaces start as NaN, so
        # an element the config leaves unwritten fails the check (args.poisoned)
        with poisoned():
            if bucket.kernel == "chunk":
                got = as_replayed(lambda: impl(bucket, variant, inp), device)
            else:
                got = impl(bucket, variant, inp)
        if not isinstance(got, dict):  # the forward kernels return (output, state)
            got = dict(zip(("o", "s"), got))
        err, where = worst_error(got, ref, rel_rms)
        if not err <= tol:
            what = f"{where}: " if train else ""
            return {"status": "rejected", "error": err,
                    "reason": f"{what}relative RMS error {err:.2e} > {tol:.0e} against float64"}
        if not train and not (row := worst_row(got["o"], ref["o"]))[0] <= ROW_TOLERANCE[bucket.dtype]:
            (b, t), rtol = row[1], ROW_TOLERANCE[bucket.dtype]
            return {"status": "rejected", "error": err,
                    "reason": f"o: token (b={b}, t={t}) relative RMS error {row[0]:.2e} > {rtol:.0e} against "
                              f"float64 (per token, over the output's RMS)"}
        timing_inp = make_inputs(bucket, device, int(request.get("seed", 0)) + 1)  # fresh data
        call = lambda: impl(bucket, variant, timing_inp)  # noqa: E731
        with device_lock(device):  # the warm-up too: any launch would disturb another's timing
            call()
            seconds, method = kernel_seconds(call, device, int(request.get("repeats", 5)))
        return {"status": "ok", "seconds": seconds, "error": err, "timing": method}
    except Exception as exc:  # noqa: BLE001 -- any failure of one variant fails that trial only
        first = str(exc).splitlines()[0] if str(exc) else ""
        return {"status": "failed", "reason": f"{type(exc).__name__}: {first}"[:300]}


# Each result line starts with this: Triton, torch or a kernel stand-in may print lines of their own.
RESULT_PREFIX = "rtcompile-trial-result "


def main() -> int:
    """Serve requests, one JSON line each on stdin, until EOF (see ``study.TrialRunner``); a
    Ctrl-C (the terminal's, to the whole process group) ends it quietly: the tune says so."""
    try:
        for line in sys.stdin:
            if line.strip():
                print(RESULT_PREFIX + json.dumps(evaluate(json.loads(line))), flush=True)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
