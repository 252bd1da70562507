"""What the planner (:mod:`rtcompile.plan`) chooses among, and what it knows of each option.

* the tuned measurements of a spec on a target (:func:`measured_seconds`) and the one serving a
  plan bucket (:func:`tuned_hit`): the entry of that very bucket, else the entry of the bucket
  the tuner measures for it (B and T rounded up to powers of two, as ``tuning.Bucket`` rounds
  them, through the same ``next_pow2``). A cost taken from another bucket's measurement, or from
  the fp32 cache's for another cache dtype, is scaled by the model's ratio and labelled
  ``scaled from measured ...``, never ``measured (tuned)`` (:func:`measured_cost`);
* the chunk-parallel prefill configs (:func:`chunk_configs`), at the spec's ``chunk_size`` where
  it names one (``"auto"``: the planner's choice), and every prefill option's cost at a bucket
  (:func:`prefill_options`), those whose workspace fits (:func:`fitting`);
* the crossover length from those same options (:func:`crossover`), so it agrees with the
  prefill decisions;
* the cost model's calibration on the measurements (:func:`fit_calibration`).
"""

from __future__ import annotations

import dataclasses

from .costmodel import Calibration, Cost, calibrate, chunk_cost, recurrent_cost, shape_of, with_measured, workload
from .kernels.chunk_backward_widths import rewritten_widths
from .kernels.config import KernelConfig, KernelShape, next_pow2
from .kernels.forms import candidates, config_from_dict, default_config, low_memory, two_kernel
from .spec import DTYPE_BYTES, ModelSpec
from .target import Target, profile_for

CROSSOVER_MAX_T = 1 << 20  # the crossover search stops here: None beyond (no prompt is that long)

Measured = dict[tuple[str, int, int], tuple[KernelConfig, float]]
Option = tuple[str, KernelConfig, Cost]  # (mode, config, cost)


def measured_seconds(spec: ModelSpec, target: Target) -> Measured:
    """Tuned winners for this spec on this target's GPU: (kernel, B, T) -> (config, seconds).
    The entries the launcher would take on that GPU: every field of ``tuned.match_fields`` (the
    kernel source, Triton and rtcompile versions too: another's entry is stale) and a config
    its own check accepts at the target's shared memory; malformed ones the table's reader
    skipped already (``tuned.entry_problem``)."""
    from .kernels import tuned

    out = {}
    # train entries sit under the widths the backward runs (chunk_backward_widths.rewritten_widths)
    widths = {"chunk_bwd": rewritten_widths(spec.key_widths)}
    for e in tuned.entries():
        prof = profile_for(e["gpu"])
        if e["gpu"] != target.name and (prof is None or prof.name != target.name):
            continue
        kernel, key_widths = e["kernel"], widths.get(e["kernel"], spec.key_widths)
        want = tuned.match_fields(kernel, key_widths, spec.value_width, spec.heads, spec.input_dtype, e["gpu"])
        if any(e[k] != v for k, v in want.items()) or e.get("seconds") is None:
            continue
        config = config_from_dict(e["variant"], kernel)  # read by entry_problem already
        shape = dataclasses.replace(shape_of(spec), key_widths=tuple(key_widths))
        if config.check(shape, target.smem_per_sm) is not None:
            continue
        out[(kernel, e["batch"], e["seq_len"])] = (config, e["seconds"])
    return out


def tuned_hit(measured: Measured, kernel: str, B: int, T: int) -> tuple[tuple[int, int], KernelConfig, float] | None:
    """The tuned measurement of ``kernel`` serving plan bucket (B, T): the entry taken at (B, T)
    itself, else the entry of the tuner's bucket for it (B and T rounded up to powers of two as
    ``tuning.Bucket`` rounds them; T stays 1 for the decode step), as ((B, T) of the measurement,
    config, seconds); None without either. A B5 T4000 call runs as the B8 T4096 bucket: the
    exact-bucket match left that entry out of the plan."""
    rounded = (next_pow2(B), T if kernel == "recurrent" else next_pow2(T))
    for at in dict.fromkeys(((B, T), rounded)):
        hit = measured.get((kernel, *at))
        if hit is not None:
            return at, hit[0], hit[1]
    return None


def measured_cost(cost: Cost, seconds: float, ratio: float | None = None, scaled_from: str = "") -> Cost:
    """``cost`` with a tuned measurement's device time: ``seconds`` itself where it measured this
    very call (``ratio`` None; source ``measured (tuned)``), else ``seconds`` x ``ratio`` (the
    model's ratio of this call to the measured one), its source ``scaled from measured
    <scaled_from>``: a figure derived from another bucket or cache dtype is not a measurement."""
    if ratio is None:
        return with_measured(cost, seconds)
    return dataclasses.replace(with_measured(cost, seconds * ratio), source=f"scaled from measured {scaled_from}")


def fixed_chunk(spec: ModelSpec) -> int | None:
    """The spec's chunk size where it names one; None for ``"auto"`` (the planner chooses)."""
    return None if spec.chunk_size == "auto" else int(spec.chunk_size)


def _sized(config: KernelConfig | None, C: int, shape: KernelShape, smem: int) -> KernelConfig | None:
    """``config`` at chunk size C: itself, C swapped in where its check still passes, else None."""
    if config is None or config.chunk_size == C:
        return config
    sized = dataclasses.replace(config, chunk_size=C)
    return sized if sized.check(shape, smem) is None else None


def chunk_configs(spec: ModelSpec, target: Target) -> list[KernelConfig]:
    """The chunk-parallel prefill candidates, best first: the default config, the two-kernel one
    where the default is the split form (its workspace is ~9x the two-kernel one's: o3 16x16 B8
    T4096, 289 against 32 MiB) and the fused low-memory sibling. Where the spec names a chunk
    size, every one is at that size: the defaults table's first proposal of that size stands
    for the default, the others take the size where their check still passes and are dropped
    where it does not. Where none runs at that size the planner's own sizes serve, and
    :func:`chunk_size_note` says so in every decision: o3 64x64 at C 64 does not fit a 100 KiB
    shared-memory GPU, and the scan alone would be ~40x slower than the chunk form at C 32 (the
    cost model on the L4, B8 T4096: 3437 against 87 ms)."""
    shape, smem = shape_of(spec), target.smem_per_sm
    default = default_config("chunk", shape, smem, gluon=target.wgmma)
    configs = [default, two_kernel(shape, smem), low_memory(shape, smem)]
    C = fixed_chunk(spec)
    if C is not None:
        proposals = candidates("chunk", shape, smem, gluon=target.wgmma)
        first = next((c for c in proposals if c.chunk_size == C), None)
        sized = [_sized(c, C, shape, smem) for c in [first or default, *configs[1:]]]
        if any(c is not None for c in sized):
            configs = sized
    return list(dict.fromkeys(c for c in configs if c is not None))


def chunk_size_note(spec: ModelSpec, configs: list[KernelConfig]) -> str:
    """What the spec's chunk_size did to the chunk configs (:func:`chunk_configs`), for a
    decision's reason: empty for ``"auto"``."""
    C = fixed_chunk(spec)
    if C is None:
        return ""
    if any(c.chunk_size == C for c in configs):
        return f"; chunk configs at the spec's chunk_size {C}"
    sizes = ", ".join(str(s) for s in sorted({c.chunk_size for c in configs}))
    return (f"; no chunk config runs these widths at the spec's chunk_size {C} on this target: the planner's "
            f"chunk sizes instead ({sizes})")


def prefill_options(spec: ModelSpec, target: Target, B: int, T: int, cal: Calibration, measured: Measured,
                    configs: list[KernelConfig] | None = None) -> list[Option]:
    """Every prefill option at (B, T) with its cost: the chunk configs (``configs``, default
    :func:`chunk_configs`), the tuned config serving this bucket (:func:`tuned_hit`; only at the
    spec's chunk size where it names one that runs), then the recurrent scan."""
    configs = chunk_configs(spec, target) if configs is None else configs
    options = [("chunk", c, chunk_cost(spec, target, B, T, c, cal)) for c in configs]
    hit = tuned_hit(measured, "chunk", B, T)
    C = fixed_chunk(spec)
    at_spec_size = C is not None and any(c.chunk_size == C for c in configs)
    if hit is not None and (not at_spec_size or hit[1].chunk_size == C):
        (mB, mT), config, secs = hit
        cost = chunk_cost(spec, target, B, T, config, cal)
        ratio = None if (mB, mT) == (B, T) else cost.kernel_s / chunk_cost(spec, target, mB, mT, config, cal).kernel_s
        options.append(("chunk", config, measured_cost(cost, secs, ratio, f"(tuned B{mB} T{mT}) by the model")))
    # at T = 1 the launcher runs the decode step's tile for B x heads (forms.decode_tile)
    rec = default_config("recurrent", shape_of(spec), target.smem_per_sm,
                         decode_rows=B * spec.heads if T == 1 else None)
    options.append(("recurrent", rec, recurrent_cost(spec, target, B, T, rec, cal)))
    return options


def memory_figures(spec: ModelSpec, batch: int, seq_len: int, workspace: int) -> dict[str, int]:
    """Bytes of one call: the model's state, ``workspace`` and one layer's activations."""
    ib = DTYPE_BYTES[spec.input_dtype]
    acts = batch * seq_len * spec.heads * (2 * sum(spec.key_widths) + 2 * spec.value_width) * ib
    return {"state": spec.state_bytes_per_sequence * batch, "workspace": workspace, "activations": acts}


def fitting(spec: ModelSpec, target: Target, B: int, T: int, options: list[Option]) -> list[Option]:
    """The options whose workspace fits the target's memory beside the state and activations."""
    free = target.memory_bytes - sum(memory_figures(spec, B, T, 0).values())
    work = workload(spec, B, T)
    return [o for o in options if o[1].workspace_bytes(work) <= free]


def crossover(spec: ModelSpec, target: Target, batch: int, cal: Calibration = Calibration(),
              measured: Measured | None = None, configs: list[KernelConfig] | None = None) -> int | None:
    """The shortest prompt length from which chunk-parallel prefill is no slower than the scan
    at ``batch``: the best chunk option the prefill decision has (:func:`prefill_options` with
    ``measured`` and ``configs``, those that fit) against the scan, so the crossover agrees with
    the decisions (comparing the default config alone gave 147 at o3 16x16 H200 B1, where T = 16
    and 64 chose a chunk form); None if the scan wins up to CROSSOVER_MAX_T tokens."""
    measured = {} if measured is None else measured
    configs = chunk_configs(spec, target) if configs is None else configs

    def wins(T: int) -> bool:
        options = prefill_options(spec, target, batch, T, cal, measured, configs)
        chunk = [c.seconds for m, _, c in fitting(spec, target, batch, T, options) if m == "chunk"]
        scan = next(c.seconds for m, _, c in options if m == "recurrent")
        return bool(chunk) and min(chunk) <= scan

    lo, hi = 1, 2
    if wins(1):
        return 1
    while not wins(hi):
        lo, hi = hi, hi * 2
        if hi > CROSSOVER_MAX_T:
            return None
    while hi - lo > 1:  # first T where chunk wins, in (lo, hi]
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wins(mid) else (mid, hi)
    return hi


def fit_calibration(spec: ModelSpec, target: Target, measured: Measured) -> Calibration:
    """The cost model calibrated on the tuned measurements: chunk entries are prefill calls,
    recurrent entries (T = 1) decode steps; their seconds are device time (the tuner times
    CUDA-graph replays), so they fit the kernels' scale and leave the host overheads alone."""
    pred: dict[str, list] = {"chunk": [], "decode": []}
    meas: dict[str, list[float]] = {"chunk": [], "decode": []}
    for (kernel, B, T), (config, secs) in measured.items():
        if kernel == "chunk_bwd":  # forward + backward: the train decision uses these directly
            continue
        if kernel == "chunk":
            pred["chunk"].append(chunk_cost(spec, target, B, T, config))
            meas["chunk"].append(secs)
        else:
            pred["decode"].append(recurrent_cost(spec, target, B, T, config, step=True))
            meas["decode"].append(secs)
    return calibrate(pred, meas, device_time=True)
