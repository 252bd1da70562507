"""The sweep of ``rtcompile explore``: each point's figures, and the Optuna study that runs the
points, resumes them and spreads them over processes and hosts (the points themselves, the
options and the matching: :mod:`.points`).

Figures per point: state bytes, parameters, prefill (PREFILL_SHAPES) and decode
(DECODE_BATCHES) latency and throughput of the state mixer (one layer's call x layers:
projections and MLP excluded) -- measured on the CUDA GPU present with the kernels' tuned
configs (:mod:`rtcompile.bench`'s measures), else predicted by the planner's cost model for a
target -- each figure marked ``measured`` or ``model``; MQAR accuracy with ``recall``.

Resume and distribution: each point is one trial of an Optuna study in the tuner's store
(:func:`rtcompile.tuning.store.open_storage`), enqueued with fixed parameters (order, width).
Workers claim WAITING trials atomically and beat while they run one
(:mod:`rtcompile.tuning.claims`), so processes and hosts sharing the store split the points;
a point's figures are the trial's user attribute ``result``. A rerun reads finished points
back and enqueues only the missing or failed ones; a trial left RUNNING by a killed worker is
failed and retried (at once on this host, after the heartbeat's grace elsewhere). The study
name hashes the base spec and every option that changes a figure except the grid itself, so a
wider grid reuses the points already run.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..spec import MAX_WIDTH, ModelSpec
from ..target import DEFAULT_TARGET
from .points import KERNEL_ORDERS, Point, RecallOptions, SweepOptions, base_spec, make_point, make_points

PREFILL_SHAPES = ((1, 4096), (8, 4096))  # (batch, length): `rtcompile bench`'s T, B1 and its B8
DECODE_BATCHES = (1, 32)  # bench's decode B32, and a single stream
PARETO_DECODE_BATCH = 32  # the decode latency the Pareto front minimises: the memory-bound regime
STUDY_PREFIX = "rtcompile-explore:"
RESULT_FORMAT = 1  # in the study key: a change of what a result holds starts new studies
# A journal store keeps no heartbeats: a RUNNING point older than twice this is stale there. A
# recall point trains up to 3 learning rates x 8000 steps; 6 h covers that on a CPU-sized model.
POINT_TIMEOUT_S = 6 * 3600.0
STALE_POLL_S = 2.0
# rtcompile explore's default workers per GPU with --recall: a recall step of the 400 k-parameter
# MQAR model is host-bound (~18 ms alone on the H200); six trained side by side there at 29-65 ms
# a step each (2026-12-02), so a GPU trains several points in the time of one
RECALL_WORKERS_PER_GPU = 4
# A worker process runs main(); not `python -m` on this module, which the package has imported
# already (runpy then warns of, and executes, a second copy of it)
WORKER_CODE = "import sys; from rtcompile.explore.sweep import main; sys.exit(main())"


# ----- where the speed figures come from -------------------------------------------------------
@dataclass(frozen=True)
class SpeedMode:
    """``measured`` on the GPU named ``target``, or ``model``: the cost model for ``target``."""

    source: str
    target: str
    why: str


def speed_mode(target: str = "auto") -> SpeedMode:
    """``auto``: measured where a CUDA GPU runs the kernels (not the interpreter), else the
    model for DEFAULT_TARGET; a profile name: the model for it, GPU or not."""
    if target.lower() != "auto":
        return SpeedMode("model", target.lower(), f"--target {target.lower()}: the cost model")
    from ..bench.report import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason is None:
        import torch

        return SpeedMode("measured", torch.cuda.get_device_name(0), "measured with the tuned kernels")
    return SpeedMode("model", DEFAULT_TARGET, f"the cost model for {DEFAULT_TARGET} (no measuring: {reason})")


def measured_layer_seconds(spec: ModelSpec, phase: str, batch: int, seq_len: int, device: str = "cuda",
                           repeats: int | None = None) -> tuple[float | None, str]:
    """One layer's mixer call timed as `rtcompile bench` times it (the spec's heads, widths and
    input dtype; gate, delta rule and l2norm on; fp32 state), the launcher's tuned config:
    (seconds or None, the timing method and any failure). ``device`` "cpu" is for tests."""
    import torch

    from ..bench.core import (DEFAULT_L2_BYTES, DEFAULT_REPEATS, IMPL_RT, BenchContext, Case, Ceilings, case_work,
                              run_one)
    from ..bench.measure import measures_for

    case = Case(f"{phase}_B{batch}_T{seq_len}", phase, spec.key_widths, batch, seq_len, H=spec.heads,
                V=spec.value_width, dtype=spec.input_dtype, impls=(IMPL_RT,), chunk_size=spec.resolved_chunk_size)
    dev = torch.device(device)
    l2 = int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or DEFAULT_L2_BYTES) \
        if dev.type == "cuda" else 0  # no L2 rotation off the GPU (as bench's CPU tests)
    ctx = BenchContext(dev, repeats=repeats or DEFAULT_REPEATS, l2_bytes=l2)
    with torch.no_grad():
        row = run_one(case, IMPL_RT, measures_for(case, ctx)[IMPL_RT], work=case_work(case), ceilings=Ceilings())
    note = "; ".join(x for x in (row.timing, row.note) if x)
    return (row.ms / 1e3 if row.ms else None), note


def _modelled_layer_seconds(spec: ModelSpec, target_name: str, phase: str, batch: int,
                            seq_len: int) -> tuple[float, str, str]:
    """The planner's decision for this bucket on ``target`` (its cost model, calibrated and
    replaced by the tuned table's measurement of that GPU where there is one), as device time:
    the call's modelled host overhead left out, as the measured figures (CUDA-graph replays)
    leave it out. (With it, every decode figure was the eager call's ~70 us of host time a layer
    whatever the order or width: 146 us for o2 w8 and o3 16x16 alike at B1.)"""
    from ..plan import make_plan
    from ..target import get_target

    target = get_target(target_name)
    if phase == "prefill":
        plan = make_plan(spec, target, batches=(batch,), seq_lens=(seq_len,), decode_batches=())
    else:
        plan = make_plan(spec, target, batches=(1,), seq_lens=(1,), decode_batches=(batch,))
    d = plan.decision_for(phase, batch, seq_len)
    source = "measured" if str(d.cost.get("source", "")).startswith("measured") else "model"
    form = d.variant.get("form", d.mode)
    device_s = d.cost["seconds"] - d.cost.get("host_s", 0.0)
    return device_s, f"{d.mode}{f' ({form})' if form != d.mode else ''}: {d.reason}; device time", source


def speed_figures(spec: ModelSpec, mode: SpeedMode) -> list[dict[str, Any]]:
    """Prefill and decode figures of ``spec``: seconds for all layers' mixers (one layer's call x
    layers), tokens per second, the source (measured / model) and a note per figure. A shape
    that fails (refused, out of memory) is a figure without seconds, its note saying why."""
    from ..bench.core import failure_note

    out = []
    shapes = [("prefill", b, t) for b, t in PREFILL_SHAPES] + [("decode", b, 1) for b in DECODE_BATCHES]
    for phase, batch, seq_len in shapes:
        source = mode.source
        try:
            if mode.source == "measured":
                per_layer, note = measured_layer_seconds(spec, phase, batch, seq_len)
            else:
                per_layer, note, source = _modelled_layer_seconds(spec, mode.target, phase, batch, seq_len)
        except Exception as exc:  # noqa: BLE001 -- a shape that cannot run is a figure with a note
            per_layer, note = None, failure_note(exc)
        seconds = per_layer * spec.layers if per_layer else None
        out.append({"phase": phase, "batch": batch, "seq_len": seq_len, "seconds": seconds,
                    "seconds_per_layer": per_layer, "tokens_per_s": batch * seq_len / seconds if seconds else None,
                    "source": source, "target": mode.target, "note": note})
    return out


def recall_figures(spec: ModelSpec, recall: RecallOptions, device: str, checkpoints: Path,
                   progress: bool) -> dict[str, Any]:
    """MQAR accuracy of ``spec``: one learning-rate sweep per seed (``train_recall``), each
    checkpointed under ``checkpoints/seed<S>`` so a killed point resumes its training."""
    import torch

    from .mqar import MQARTask
    from .trainer import TrainSettings, train_recall

    task = MQARTask(vocab_size=recall.vocab_size, seq_len=recall.seq_len, num_kv_pairs=recall.kv_pairs)
    runs = []
    for seed in recall.seeds:
        settings = TrainSettings(learning_rates=recall.learning_rates, max_steps=recall.steps,
                                 batch_size=recall.batch_size, seed=seed)
        ckpt = checkpoints / f"seed{seed}"
        ckpt.mkdir(parents=True, exist_ok=True)
        res = train_recall(spec, task, settings, device=device, checkpoint_dir=ckpt, progress=progress)
        run = json.loads(json.dumps(res.to_dict(), default=str))  # JSON-able (per-rate keys become text)
        runs.append({**run, "seed": seed, "accuracy": float(res.accuracy), "learning_rate": float(res.learning_rate)})
    accs = [r["accuracy"] for r in runs]
    return {"accuracy": sum(accs) / len(accs), "accuracy_min": min(accs), "accuracy_max": max(accs),
            "learning_rates_chosen": [r["learning_rate"] for r in runs], "seeds": list(recall.seeds),
            "task": {"seq_len": recall.seq_len, "num_kv_pairs": recall.kv_pairs,
                     "vocab_size": task.vocab_size}, "runs": runs,
            # where it trained (bf16 autocast on CUDA, fp32 on the CPU): the study's key leaves the
            # device out, so a store shared between hosts can serve another host's accuracy
            "device": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else device}


def checkpoints(out: Path, point: Point, recall: RecallOptions) -> Path:
    """Where a point's recall trainings keep their checkpoints: a folder per point spec and the
    recall settings the trainer's fingerprint holds (not per code version: a finished training
    resumes under newer kernels; not per learning rates or seeds: each seed has its folder and a
    training takes more rates). One folder for every setting made a rerun with another --steps,
    --vocab or --d-model fail each point ("results.json was written for other settings")."""
    task = {name: getattr(recall, name) for name in ("seq_len", "kv_pairs", "vocab_size", "steps", "batch_size")}
    key = json.dumps({"spec": point.spec.to_dict(), "recall": task}, sort_keys=True, default=str)
    return Path(out) / "points" / point.id / f"ckpt-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def speed_cache(out: Path, point: Point, study: str) -> Path:
    """Where :func:`measure_speeds_first` leaves a point's measured figures for its trial."""
    return Path(out) / "points" / point.id / f"speed-{study.rsplit(':', 1)[-1]}.json"


def point_speed(point: Point, mode: SpeedMode, device: str, cache: Path | None = None) -> list[dict[str, Any]]:
    """The point's speed figures: read from ``cache`` when a measuring pass left them there,
    else computed, a measurement holding the GPU exclusively (``store.device_lock``: no timing
    beside another worker's timing or training)."""
    from ..tuning.store import device_lock

    if cache is not None and cache.exists():
        try:  # written atomically by measure_speeds_first; anything else there is measured again
            figures = json.loads(cache.read_text())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            figures = None
        if _figures_ok(figures):
            return figures
    with device_lock(device) if device.startswith("cuda") and mode.source == "measured" else nullcontext():
        return speed_figures(point.spec, mode)


def measure_speeds_first(points: list[Point], ctx: "Context", study: str, skip: set) -> int:
    """Measured speed with recall: the speed of every point not in ``skip`` (finished) measured
    here, one point at a time, and left in :func:`speed_cache` before any worker trains. Measured
    inside the trials instead, a point's timing would wait for every training sharing its GPU
    and the points would run in turn. Returns how many it measured."""
    from ..fileio import atomic_write

    n = 0
    for p in points:
        if p.spec is None or (p.order, p.width) in skip or speed_cache(ctx.out, p, study).exists():
            continue
        figures = point_speed(p, ctx.mode, ctx.device)
        path = speed_cache(ctx.out, p, study)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(figures))
        n += 1
        if ctx.progress:
            ctx.progress(p.id, "speed measured")
    return n


def evaluate_point(point: Point, opts: SweepOptions, mode: SpeedMode, out: Path, device: str,
                   progress: bool = False, speed_from: Path | None = None) -> dict[str, Any]:
    """A point's measured or predicted figures (what its trial stores): speed (from
    ``speed_from`` when :func:`measure_speeds_first` measured it), and recall. On a GPU the
    training shares the device with other workers' trainings (``store.device_lock``)."""
    from ..tuning.store import device_lock

    gpu = device.startswith("cuda")
    t0 = time.monotonic()
    result: dict[str, Any] = {"speed": point_speed(point, mode, device, speed_from), "recall": None}
    if opts.recall is not None:
        with device_lock(device, shared=True) if gpu else nullcontext():
            result["recall"] = recall_figures(point.spec, opts.recall, device, checkpoints(out, point, opts.recall),
                                              progress)
    result["wall_s"] = round(time.monotonic() - t0, 3)
    return result


# ----- the study -------------------------------------------------------------------------------
# the code a point's speed figures come from: the kernels (measured, and the configs whose figures
# the model prices), the cost model, the planner that picks and calibrates, the target profiles,
# and this module's reading of them
SPEED_SOURCES = ("costmodel.py", "figures.py", "plan.py", "target.py", "kernels/*.py", "explore/sweep.py")


@functools.lru_cache(maxsize=1)
def speed_code_digest() -> str:
    """sha256 (16 hex digits) of :data:`SPEED_SOURCES`: a study made by other code is another
    study, so an upgrade never serves the figures an older cost model or kernel gave (a finished
    point's recall training resumes from its checkpoints, so only the speed is recomputed)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for pattern in SPEED_SOURCES:
        for path in sorted(root.glob(pattern)):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def study_key(base: ModelSpec, opts: SweepOptions, mode: SpeedMode) -> dict[str, Any]:
    """Everything a point's figures depend on besides (order, width): the study's identity."""
    return {"format": RESULT_FORMAT, "base": base.to_dict(), "match": opts.match,
            "speed": [mode.source, mode.target], "prefill": PREFILL_SHAPES, "decode": DECODE_BATCHES,
            "recall": None if opts.recall is None else asdict(opts.recall), "code": speed_code_digest()}


def study_name(base: ModelSpec, opts: SweepOptions, mode: SpeedMode) -> str:
    digest = hashlib.sha256(json.dumps(study_key(base, opts, mode), sort_keys=True).encode()).hexdigest()[:16]
    return f"{STUDY_PREFIX}{base.name or 'spec'}:{digest}"


def _trial_point(trial) -> tuple[int, int] | None:
    p = trial.system_attrs.get("fixed_params") or trial.params
    try:
        return int(p["order"]), int(p["width"])
    except (KeyError, TypeError, ValueError):
        return None


def enqueue_missing(study, points: list[Point]) -> int:
    """Enqueue one trial per runnable point that no trial has finished, waits for or runs;
    returns how many. (Failed points are enqueued again: failed is not finished.)"""
    import optuna

    st = optuna.trial.TrialState
    taken = {_trial_point(t) for t in study.get_trials(deepcopy=False, states=(st.COMPLETE, st.WAITING, st.RUNNING))}
    n = 0
    for p in points:
        if p.spec is not None and (p.order, p.width) not in taken:
            study.enqueue_trial({"order": p.order, "width": p.width}, user_attrs={"point": p.id})
            n += 1
    return n


@dataclass
class Context:
    """What a worker needs besides the store: the sweep and where its files go."""

    base: ModelSpec
    opts: SweepOptions
    mode: SpeedMode
    out: Path
    device: str
    progress: Callable[[str, str], None] | None = None  # (point id, what happened)
    show_training: bool = False


def work(study, storage, url: str | None, ctx: Context) -> int:
    """Claim and evaluate WAITING points until none waits; returns how many this call ran. A
    point whose evaluation raises is told FAIL with the error (a rerun retries it); an
    interrupt is told FAIL and re-raised."""
    import optuna

    from ..tuning.claims import Heartbeat, claim, trial_id

    ran = 0
    while (trial := claim(study, storage, url)) is not None:
        beat = Heartbeat(storage, trial_id(storage, study, trial.number)).start()
        try:
            point = make_point(ctx.base, ctx.opts, trial.suggest_int("order", KERNEL_ORDERS[0], KERNEL_ORDERS[-1]),
                               trial.suggest_int("width", 1, MAX_WIDTH))
            if ctx.progress:
                ctx.progress(point.id, "started")
            result = evaluate_point(point, ctx.opts, ctx.mode, ctx.out, ctx.device, ctx.show_training,
                                    speed_cache(ctx.out, point, study.study_name))
            trial.set_user_attr("result", result)
            trial.set_user_attr("spec", point.spec.to_dict())
            study.tell(trial, float(point.spec.state_bytes_per_sequence))
            ran += 1
            if ctx.progress:
                ctx.progress(point.id, f"done ({result['wall_s']:.1f} s)")
        except BaseException as exc:
            from ..bench.core import failure_note

            note = failure_note(exc) if isinstance(exc, Exception) else type(exc).__name__
            # the enqueued point's id: a live Trial has no system_attrs (_trial_point's fixed
            # params), and reading them here raised over every failure and every Ctrl-C
            label = trial.user_attrs.get("point") or f"trial {trial.number}"
            trial.set_user_attr("error", note)
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            if ctx.progress:
                ctx.progress(label, f"failed: {note}")
            if not isinstance(exc, Exception):
                raise
        finally:
            beat.stop()
    return ran


@dataclass
class SweepResult:
    """A sweep's outcome: every point (refused ones too), the stored figures of the finished
    ones, why the others are missing, and how many finished while it ran (here, in its
    workers, or in other processes sharing the store)."""

    base: ModelSpec
    opts: SweepOptions
    mode: SpeedMode
    points: list[Point]
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # point id -> its trial's result
    errors: dict[str, str] = field(default_factory=dict)  # point id -> why it has no result
    ran: int = 0
    study: str = ""
    storage: str = ""
    wall_s: float = 0.0


def compute_device() -> str:
    """Where recall trains: the CUDA GPU where the kernels run on one, else the CPU."""
    from ..bench.report import cuda_unavailable_reason

    return "cuda" if cuda_unavailable_reason() is None else "cpu"


def visible_gpus() -> list[str]:
    """The GPU ids worker processes are spread over (CUDA_VISIBLE_DEVICES, else all)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [x.strip() for x in listed.split(",") if x.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def run_sweep(spec: ModelSpec, opts: SweepOptions, out: str | os.PathLike, *,
              progress: Callable[[str, str], None] | None = None, show_training: bool = False) -> SweepResult:
    """Run (or resume) the sweep of ``spec``: enqueue the points no trial finished, evaluate
    them here (``opts.workers`` processes, one GPU each, when more than one), wait for points
    that workers elsewhere still run, and read every finished point back from the store."""
    import optuna

    from ..tuning.claims import mark_stale
    from ..tuning.store import claim_lock, default_url, open_storage

    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec: expected a ModelSpec (rtcompile.load_spec(path)), got {type(spec).__name__}")
    if not isinstance(opts, SweepOptions):
        raise TypeError(f"opts: expected SweepOptions, got {type(opts).__name__}")
    t0 = time.monotonic()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    base = base_spec(spec, opts)
    points = make_points(base, opts)
    mode = speed_mode(opts.target)
    name = study_name(base, opts, mode)
    storage = open_storage(opts.storage)
    study = optuna.create_study(study_name=name, storage=storage, direction="minimize", load_if_exists=True)
    study.set_user_attr("sweep", json.loads(json.dumps(study_key(base, opts, mode))))  # for a person reading the store
    with claim_lock(opts.storage):  # one process enqueues a missing point, not two
        mark_stale(study, storage, POINT_TIMEOUT_S)  # a killed run's points: failed and retried
        enqueue_missing(study, points)
    finished_before = {t.number for t in _ours(study, points, (optuna.trial.TrialState.COMPLETE,))}
    ctx = Context(base, opts, mode, Path(out), compute_device(), progress, show_training)
    if mode.source == "measured" and opts.recall is not None:
        done = {_trial_point(t) for t in _ours(study, points, (optuna.trial.TrialState.COMPLETE,))}
        measure_speeds_first(points, ctx, name, done)
    if opts.workers > 1:
        _run_workers(study, storage, name, ctx)
    _drain(study, storage, ctx, points)
    ran = len({t.number for t in _ours(study, points, (optuna.trial.TrialState.COMPLETE,))} - finished_before)
    result = SweepResult(base, opts, mode, points, ran=ran, study=name, storage=opts.storage or default_url())
    collect(study, result)
    result.wall_s = round(time.monotonic() - t0, 3)
    return result


def _ours(study, points: list[Point], states) -> list:
    keys = {(p.order, p.width) for p in points if p.spec is not None}
    return [t for t in study.get_trials(deepcopy=False, states=states) if _trial_point(t) in keys]


def _drain(study, storage, ctx: Context, points: list[Point]) -> int:
    """Work here until none of the sweep's points waits or runs: points running in a live
    worker elsewhere are waited for; a dead one's are failed and retried by ``mark_stale``."""
    import optuna

    from ..tuning.claims import mark_stale

    st = optuna.trial.TrialState
    ran, said = 0, False
    while True:
        ran += work(study, storage, ctx.opts.storage, ctx)
        running = _ours(study, points, (st.RUNNING,))
        if not running:
            return ran
        if ctx.progress and not said:
            ctx.progress("sweep", f"waiting for {len(running)} point(s) running in other workers")
            said = True
        time.sleep(STALE_POLL_S)
        mark_stale(study, storage, POINT_TIMEOUT_S)


def _run_workers(study, storage, name: str, ctx: Context) -> None:
    """``ctx.opts.workers`` processes (:func:`main`), one GPU each in turn, claiming points
    from the study until none waits."""
    import optuna

    from ..tuning.claims import mark_stale

    payload = json.dumps({"spec": ctx.base.to_dict(), "options": ctx.opts.to_dict(), "mode": asdict(ctx.mode),
                          "out": str(ctx.out), "study": name, "device": ctx.device})
    gpus = visible_gpus() if ctx.device.startswith("cuda") else []
    waiting = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)))
    procs = []
    for i in range(min(ctx.opts.workers, max(1, waiting))):  # --workers 8 for one point started 8 (~200 MB each)
        env = dict(os.environ)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
        p = subprocess.Popen([sys.executable, "-c", WORKER_CODE], stdin=subprocess.PIPE, text=True, env=env)
        p.stdin.write(payload)
        p.stdin.close()
        procs.append(p)
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(STALE_POLL_S)
            mark_stale(study, storage, POINT_TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad and ctx.progress:  # their points are retried here (a dead worker's RUNNING trial goes stale)
        ctx.progress("sweep", f"worker processes exited with {bad}; their points are retried here")


def _figures_ok(figures: Any) -> bool:
    """Speed figures as :func:`speed_figures` makes them: phase, batch, source, seconds (None for
    a shape that failed)."""
    return isinstance(figures, list) and all(
        isinstance(f, dict) and isinstance(f.get("phase"), str) and isinstance(f.get("batch"), int)
        and isinstance(f.get("source"), str) and isinstance(f.get("seconds", ""), (int, float, type(None)))
        for f in figures)


def _well_formed(result: Any) -> bool:
    """A stored point result as :func:`evaluate_point` writes it: speed figures
    (:func:`_figures_ok`) and recall None or with an accuracy."""
    if not isinstance(result, dict) or not _figures_ok(result.get("speed")):
        return False
    recall = result.get("recall")
    return recall is None or isinstance(recall, dict) and isinstance(recall.get("accuracy"), (int, float))


def collect(study, result: SweepResult) -> None:
    """Fill ``result`` from the store: each runnable point's finished figures (its latest
    COMPLETE trial), else why it has none (its latest failure, or still running)."""
    import optuna

    st = optuna.trial.TrialState
    by_point: dict[tuple[int, int], list] = {}
    for t in study.get_trials(deepcopy=False):
        by_point.setdefault(_trial_point(t), []).append(t)
    for p in result.points:
        if p.spec is None:
            continue
        trials = sorted(by_point.get((p.order, p.width), []), key=lambda t: t.number)
        done = [t for t in trials if t.state == st.COMPLETE]
        if done and _well_formed(done[-1].user_attrs.get("result")):
            result.results[p.id] = done[-1].user_attrs["result"]
        elif done:  # an edited or foreign store: reported per point, not a crash of the report
            result.errors[p.id] = (f"failed: trial {done[-1].number}'s stored result is not a point's figures; "
                                   "run with another --storage to measure it again")
        elif any(t.state in (st.RUNNING, st.WAITING) for t in trials):
            result.errors[p.id] = "not finished: running in another worker"
        else:
            failed = [t for t in trials if t.state == st.FAIL]
            result.errors[p.id] = "failed: " + (failed[-1].user_attrs.get("error", "no reason recorded") if failed
                                                else "never ran")


def main() -> int:
    """A worker process of :func:`run_sweep` (the sweep as JSON on stdin)."""
    import optuna

    from ..tuning.store import open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    payload = json.loads(sys.stdin.read())
    opts = SweepOptions.from_dict(payload["options"])
    ctx = Context(ModelSpec.from_dict(payload["spec"]), opts, SpeedMode(**payload["mode"]), Path(payload["out"]),
                  payload["device"], lambda pid, what: print(f"{pid}: {what}", file=sys.stderr, flush=True))
    storage = open_storage(opts.storage)
    study = optuna.load_study(study_name=payload["study"], storage=storage)
    work(study, storage, opts.storage, ctx)
    return 0
