"""Optuna studies over a kernel's configs (the search space: ``space.py``), run by worker processes.

Budget and distribution: in trials mode the coordinator enqueues exactly the budget as WAITING
trials (no fixed parameters: the sampler still chooses them), and workers claim WAITING trials
through the storage's atomic state change (Optuna's own mechanism for enqueued trials), so any
number of workers on any number of hosts sharing one storage run exactly the budget, none
twice. The budget counts variants that were run: a trial the resource estimate prunes costs no
compile, so its worker enqueues a replacement (up to MAX_PRUNED_PER_TRIAL per budgeted trial).
On the H200 sweep of 2026-11-30 (o3 16x16 prefill, 127 valid variants) 21 of TPE's 25 trials
were pruned when they counted, leaving 4 timed variants and a best 40% behind the exhaustive
one. In seconds mode workers ask for new trials until the deadline. A TPE study (either
budget) first runs the kernel's default candidates, the default first (user attribute
``warm_start``: 0, 1, ...), at most a quarter of a trial budget.

Trial outcome (user attribute ``status``): ``ok`` (COMPLETE, value = median seconds),
``pruned`` (the variant's resource estimate refuses it before compiling), ``repeat`` (the
config, up to inert fields, of an earlier ``ok`` trial, told that trial's value, or of a
``rejected`` one, PRUNED; named in its ``reason``, not run again, and like a pruned trial it
costs no budget; a seconds-mode worker ends after MAX_REPEATS_IN_A_ROW), ``rejected`` (wrong
result), ``failed`` (compile error, launch failure, crash or timeout), ``stale`` (its worker
died: Optuna's heartbeat lapsed, the trial was failed and retried with the same parameters as a
new WAITING trial; :func:`stale_numbers` lists them).

Recovery needs no flag: every run first fails the trials whose worker is gone (on this host
at once, by the worker's recorded pid; elsewhere by heartbeat) and retries them, so the same
command after a kill -9 finishes the budget.

Finishing a study re-measures the best few variants and the default (trials mode; with a
time budget the time was the trials' and the study's own measurements decide; either way only
configs today's check and the device accept), then records
the winner in the tuned-config table the kernels read and then in the study's user attributes
(a table that cannot be written leaves the study unfinished). An already tuned study whose
winner is missing from the table writes it again; an unreadable table is rebuilt from the
store. ``--retune`` is refused while another process tunes the study.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

from ..kernels import tuned
from ..kernels.forms import default_config
from .claims import Heartbeat, mark_stale, next_trial, process_alive, stale_numbers, trial_id
from .keys import Bucket, Machine, key_attrs, study_name
from .options import TuneOptions
from .processes import STOP_POLL_S, raise_if_stopped, spawn_workers, stop_workers
from .space import (
    bucket_decode_rows, bucket_shape, config_params, device_refusal, exhaustive_variants, params_config, search_space,
    smem_limit, suggest, warm_starts,
)
from .store import (
    StoreError, default_url, has_entry, heartbeat_interval, open_storage, retried_numbers, store_file, study_entry,
    write_tuned,
)

RESULT_ATTRS = ("best_variant", "best_seconds", "default_seconds")


@dataclass
class BucketResult:
    bucket: Bucket
    study: str
    trials_run: int
    already_tuned: bool
    counts: dict[str, int] = field(default_factory=dict)
    best_variant: dict | None = None
    best_seconds: float | None = None
    default_seconds: float | None = None
    table_written: bool = False  # the winner was (re)written to the tuned-config table by this run
    trials_total: int = 0  # the study's trials that ran a variant, every run's (what `tune --list` shows)

    @property
    def speedup(self) -> float | None:
        if self.best_seconds and self.default_seconds:
            return self.default_seconds / self.best_seconds
        return None


def _study_name(bucket: Bucket, machine: Machine, source: str, opts: TuneOptions) -> str:
    """The study key, plus a hash of the search space's choices (Optuna refuses a categorical
    parameter whose choices changed, "dynamic value space", so a space changed by a new
    version or a new check is a new study, not a crash of every worker), plus the sub-space and
    the search when they differ from the plain study, so an exhaustive sweep never mixes its
    trials into the TPE study it is compared with."""
    # the choices in their order (Optuna's CategoricalDistribution compares them in order)
    space = json.dumps(search_space(bucket, opts), separators=(",", ":"))
    name = study_name(bucket, machine, source) + f":space {hashlib.sha256(space.encode()).hexdigest()[:12]}"
    if opts.fixed:
        name += ":fixed " + ",".join(f"{k}={v}" for k, v in sorted(opts.fixed.items()))
    if opts.exhaustive:
        name += ":exhaustive"
    return name


class TrialRunner:
    """A trial process (``python -m rtcompile.tuning.objective``) that evaluates one worker's
    trials one after another, so Python, the torch and Triton imports and the CUDA context are
    paid once per worker rather than once per trial (a fresh process per trial made a decode
    trial take 6-8 s on the H200 sweep of 2026-11-30b, its kernel a few microseconds).

    Isolation stays where it matters: a trial that outlives ``timeout`` (a hang, a stuck
    compile) is killed with its process, a process that dies (a CUDA fault, a crash) fails only
    its trial, and after any failed trial the next one starts a fresh process, since a CUDA
    error poisons the context for everything after it. Not thread-safe: one per worker.
    """

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._lines: queue.Queue | None = None
        self._stderr = None

    def _start(self) -> None:
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen([sys.executable, "-m", "rtcompile.tuning.objective"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1)
        # a reader thread, so a process that prints half a line and then hangs cannot block the timeout
        self._lines = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout, self._lines), daemon=True)
        self._reader.start()

    @staticmethod
    def _read(stream, lines: queue.Queue) -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)  # end of file: the process is gone

    def _stderr_tail(self) -> str:
        self._stderr.seek(0)
        tail = [ln for ln in self._stderr.read().strip().splitlines() if ln.strip()]
        return tail[-1][:200] if tail else "no output"

    def evaluate(self, request: dict[str, Any]) -> dict[str, Any]:
        """One trial's result (see ``objective.evaluate``), ``failed`` with the reason when the
        process hangs past the timeout or dies."""
        from .objective import RESULT_PREFIX

        if self._proc is None or self._proc.poll() is not None:
            self.close()
            self._start()
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        except OSError as exc:
            self.close()
            return {"status": "failed", "reason": f"trial process unreachable: {exc}"}
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            try:  # in slices: a stop whose raise a finalizer swallowed still ends the wait
                line = self._lines.get(timeout=max(0.0, min(left, STOP_POLL_S)))
            except queue.Empty:
                if left > STOP_POLL_S:
                    raise_if_stopped()
                    continue
                self.close()
                return {"status": "failed", "reason": f"timeout after {self.timeout:.0f} s (hang or slow compile)"}
            if line is None:
                rc = self._proc.wait()
                reason = f"trial process exited {rc}: {self._stderr_tail()}"
                self.close()
                return {"status": "failed", "reason": reason}
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX):])
                if result.get("status") == "failed":
                    self.close()
                return result

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            # the reader sees end of file once the process is gone; its stream is closed after it
            # stops, so it never reads a closed file
            self._reader.join(timeout=5)
            for stream in (self._proc.stdin, self._proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        if self._stderr is not None:
            self._stderr.close()
        self._proc = self._reader = self._lines = self._stderr = None

    def __enter__(self) -> "TrialRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_objective(bucket: Bucket, variant: dict | None, opts: TuneOptions, seed: int,
                  runner: TrialRunner | None = None) -> dict[str, Any]:
    """Evaluate one variant in a trial process with a timeout (see ``objective``): checked on
    the study's inputs (``opts.seed``), timed on the trial's own (``seed``). Without a runner,
    a process of its own."""
    request = {"bucket": asdict(bucket), "variant": variant, "device": opts.device, "seed": seed,
               "check_seed": opts.seed, "repeats": opts.repeats, "impl": opts.impl}
    if runner is not None:
        return runner.evaluate(request)
    with TrialRunner(opts.trial_timeout) as own:
        return own.evaluate(request)


def _counts(study) -> dict[str, int]:
    trials = study.get_trials(deepcopy=False)
    stale = retried_numbers(trials)
    out: dict[str, int] = {}
    for t in trials:
        key = "stale" if t.number in stale else t.user_attrs.get("status") or t.state.name.lower()
        out[key] = out.get(key, 0) + 1
    return out


# TPE treats pruned trials as the worst, so it leaves refused regions after a few; the cap only
# bounds a space that is almost all refused (the study then runs fewer variants than asked).
# Repeats (below) share it.
MAX_PRUNED_PER_TRIAL = 10
# a worker whose last this many draws were all repeats ends (seconds mode): its (sub-)space is
# used up or TPE has settled (a 5 s budget over a 4-config space drew 60 repeats on the CPU)
MAX_REPEATS_IN_A_ROW = 20


def _skipped(study) -> int:
    """Trials that ran nothing: pruned, or repeats of an earlier trial's config."""
    return sum(1 for t in study.get_trials(deepcopy=False) if t.user_attrs.get("status") in ("pruned", "repeat"))


class FinishedConfigs:
    """The finished trials whose outcome stands, measured (``ok``) or refused by the float64 gate
    (``rejected``), by config up to inert fields (``KernelConfig.canonical``). A failed trial (a
    timeout, a crash) does not count: its config may run again. Each :meth:`earlier` builds the
    configs of the trials finished since the last only (it still lists every trial; rebuilding
    every config per draw was quadratic). Invariant: a config's trial, once found, stays found."""

    def __init__(self) -> None:
        self._by_config: dict = {}
        self._read: set[int] = set()  # trial numbers already read (finished: their outcome stands)

    def earlier(self, study, variant):
        """A finished trial of ``variant`` (see the class), or None."""
        import optuna

        states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
        for t in study.get_trials(deepcopy=False, states=states):
            if t.number in self._read:
                continue
            self._read.add(t.number)
            if t.user_attrs.get("status") in ("ok", "rejected"):
                try:
                    self._by_config.setdefault(params_config(t.params).canonical(), t)
                except (KeyError, TypeError, ValueError):  # parameters of a space this version no longer has
                    continue
        return self._by_config.get(variant.canonical())


def run_worker(storage_url: str | None, name: str, bucket: Bucket, opts: TuneOptions, index: int,
               deadline: float | None) -> int:
    """One worker's loop: claim (or, in seconds mode, ask), evaluate, tell. Returns trials run."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=opts.seed + index)
    storage = open_storage(storage_url)
    study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
    shape = bucket_shape(bucket)
    space, limit = search_space(bucket, opts), smem_limit(opts.device)
    finished = FinishedConfigs()
    with TrialRunner(opts.trial_timeout) as runner:  # one trial process for the worker's trials
        done = in_a_row = 0  # in_a_row: repeats drawn one after another
        while deadline is None or time.time() < deadline:
            if deadline is not None and in_a_row >= MAX_REPEATS_IN_A_ROW:
                break
            raise_if_stopped()
            trial = next_trial(study, storage, storage_url, deadline)
            if trial is None:
                break
            # stopped after the tell; an exception ends the worker, and the daemon thread with it
            beat = Heartbeat(storage, trial_id(storage, study, trial.number)).start()
            variant = suggest(trial, space)
            reason = variant.check(shape, limit) or device_refusal(variant, opts.device)
            earlier = finished.earlier(study, variant) if reason is None else None
            if reason is not None:
                trial.set_user_attr("status", "pruned")
                trial.set_user_attr("reason", reason)
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            elif earlier is not None:
                # not run again (TPE drew one config ten times in a 67-trial study at o3 64x64 on
                # the H200); told the earlier trial's value, as a run would have been: pruned
                # (ranked last by TPE) it would count the best config's every field as bad,
                # which left 28 of 80 synthetic studies within 3% of the optimum against 46
                trial.set_user_attr("status", "repeat")
                trial.set_user_attr("reason", f"the config of trial {earlier.number}")
                if earlier.state == optuna.trial.TrialState.COMPLETE:
                    study.tell(trial, earlier.value)
                else:  # a rejected config: pruned, so TPE leaves it
                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            else:
                result = run_objective(bucket, variant.to_dict(), opts, seed=opts.seed + trial.number, runner=runner)
                trial.set_user_attr("status", result["status"])
                for key in ("reason", "error", "timing"):
                    if key in result:
                        trial.set_user_attr(key, result[key])
                if result["status"] == "ok":
                    study.tell(trial, result["seconds"])
                else:
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
            in_a_row = in_a_row + 1 if earlier is not None else 0
            if (reason is not None or earlier is not None) and deadline is None and opts.trials \
                    and _skipped(study) < MAX_PRUNED_PER_TRIAL * opts.trials:
                study.enqueue_trial({})  # nothing was run: the budget slot goes back to the queue
            beat.stop()
            done += 1
    return done


def tune_bucket(bucket: Bucket, opts: TuneOptions,
                progress: Callable[[str, int, int], None] | None = None) -> BucketResult:
    """Run (or resume, or skip when already tuned) the study of one bucket."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if opts.exhaustive and opts.seconds is not None:
        raise ValueError("exhaustive: one trial per valid variant is its own budget; allowed: seconds=None")
    search_space(bucket, opts)  # a bad fixed parameter fails here, before the store is touched
    url = opts.storage
    storage = open_storage(url)
    machine = Machine.current(opts.device)
    source = tuned.source_hash(bucket.kernel)
    name = _study_name(bucket, machine, source, opts)
    exists = study_exists(url, name)
    if exists and opts.retune:
        _refuse_retune_while_running(optuna.load_study(study_name=name, storage=storage), storage, opts)
        optuna.delete_study(study_name=name, storage=storage)
        exists = False
    study = optuna.create_study(study_name=name, storage=storage, direction="minimize", load_if_exists=True,
                                sampler=optuna.samplers.TPESampler(seed=opts.seed))
    try:
        return _tune_study(study, storage, exists, bucket, machine, source, opts, progress)
    except KeyError as exc:  # Optuna's "Record does not exist.": the study was deleted under us
        if study_exists(url, name):
            raise
        raise StoreError(f"study {name!r} was deleted while it ran (a `tune --retune` elsewhere?): "
                         "stopped") from exc


def _refuse_retune_while_running(study, storage, opts: TuneOptions) -> None:
    """StoreError when another process is tuning ``study`` now: its coordinator, recorded on
    this host, is alive, or it has RUNNING trials with a live heartbeat (deleting the study
    under it would crash it)."""
    import optuna

    mark_stale(study, storage, opts.trial_timeout)  # a killed run's trials are not a live one's
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    who = study.user_attrs.get("coordinator") or {}
    alive = (who.get("host") == socket.gethostname() and isinstance(who.get("pid"), int)
             and who["pid"] != os.getpid() and process_alive(who["pid"]))
    if running or alive:
        pid = f" (pid {who['pid']})" if alive else ""
        raise StoreError(f"--retune: study {study.study_name!r} is being tuned by another `rtcompile tune`{pid}, "
                         f"{len(running)} trial(s) running; let it finish or stop it first")


def _tune_study(study, storage, exists: bool, bucket: Bucket, machine: Machine, source: str, opts: TuneOptions,
                progress) -> BucketResult:
    url, name = opts.storage, study.study_name
    if exists and "best_variant" in study.user_attrs and not opts.resume:
        # tuned: the table must still hold the winner (it may have been deleted or rebuilt)
        entry = study_entry(name, study.user_attrs)
        written = entry is not None and not has_entry(entry, opts.table)
        if written:
            write_tuned([entry], opts.table, rebuild_from=storage)
        result = _result_from(study, bucket, 0, already=True)
        result.table_written = written
        return result
    for k, v in {**key_attrs(bucket, machine, source), "seed": opts.seed}.items():
        study.set_user_attr(k, v)
    study.set_user_attr("coordinator", {"host": socket.gethostname(), "pid": os.getpid()})  # see --retune
    # a killed run's trials: failed now (their worker is gone) and retried, with or without --resume
    mark_stale(study, storage, opts.trial_timeout)
    deadline, budget = None, 0  # budget: the trials the study holds when done (trials mode)
    if opts.seconds is not None:
        deadline = opts.deadline if opts.deadline is not None else time.time() + opts.seconds
        if not study.get_trials(deepcopy=False):  # study.ask() takes enqueued trials first
            for i, params in enumerate(warm_starts(bucket, opts, None)):
                study.enqueue_trial(params, user_attrs={"warm_start": i})
    else:
        stale = stale_numbers(study)
        counted = [t for t in study.get_trials(deepcopy=False)
                   if t.number not in stale and t.user_attrs.get("status") not in ("pruned", "repeat")]
        if opts.exhaustive:  # every valid variant once: the ones this study has not enqueued yet
            have = [t.system_attrs.get("fixed_params") for t in counted]
            for v in exhaustive_variants(bucket, opts):
                params = config_params(v)
                if params not in have:
                    study.enqueue_trial(params)
        else:
            # --resume of a finished study: N more trials; an unfinished (killed) one's budget is
            # finished first, with the flag or without
            budget = opts.trials + (len(counted) if opts.resume and "best_variant" in study.user_attrs else 0)
            missing = max(0, budget - len(counted))
            if not counted:
                for i, params in enumerate(warm_starts(bucket, opts, missing)):
                    study.enqueue_trial(params, user_attrs={"warm_start": i})  # 0: the default
                    missing -= 1
            for _ in range(missing):
                study.enqueue_trial({})
    before = _finished(study)
    total = len(exhaustive_variants(bucket, opts)) if opts.exhaustive else budget

    def report() -> None:
        if progress:
            done = _finished(study)
            progress(bucket.label, done, max(total, done))  # a resumed study may hold more than asked

    # the workers' cap on pruned replacements counts the study's pruned trials against the whole
    # budget, a resumed study's earlier trials included
    work = replace(opts, trials=budget) if budget else opts
    _run_workers(study, storage, url, name, bucket, work, deadline, report)
    ran = _finished(study) - before
    # seconds mode: the time was the trials'; the winner is the study's own measurement
    written = _finish(study, storage, bucket, machine, source, opts, remeasure=deadline is None)
    study.set_user_attr("coordinator", None)
    result = _result_from(study, bucket, ran, already=False)
    result.table_written = written
    return result


# How often the coordinator looks for stale trials while it waits (one query of the RUNNING trials)
STALE_POLL_S = 2.0


def _run_workers(study, storage, url: str | None, name: str, bucket: Bucket, opts: TuneOptions,
                 deadline: float | None, report: Callable[[], Any]) -> None:
    """Run worker processes until the study's queue is empty, failing stale trials meanwhile.

    In trials mode the coordinator then waits for RUNNING trials it did not start (a previous
    run's, whose worker died: stale within the grace period; or a live worker's on another
    host: it finishes) and runs workers again for the retries that their staleness enqueued, so
    a ``--resume`` right after a kill still runs the whole budget. However it ends (Ctrl-C,
    SIGTERM, an error), no worker outlives it (``processes.stop_workers``)."""
    procs: list[subprocess.Popen] = []
    try:
        while True:
            procs = []  # the last round's have all ended
            spawn_workers(url or _default_url(), name, bucket, opts, deadline, procs)
            if not _wait_workers(study, storage, url, name, opts, deadline, procs, report):
                return
    finally:  # stopped (Ctrl-C, SIGTERM, an error): the workers and their trial processes end too
        stop_workers(procs)


def _wait_workers(study, storage, url: str | None, name: str, opts: TuneOptions, deadline: float | None,
                  procs: list[subprocess.Popen], report: Callable[[], Any]) -> bool:
    """Wait for ``procs`` to end, failing stale trials meanwhile; True when retries wait for
    another round of workers (see :func:`_run_workers`)."""
    import optuna

    state = optuna.trial.TrialState
    last = time.monotonic()
    while any(p.poll() is None for p in procs):
        raise_if_stopped()
        report()
        if time.monotonic() - last >= STALE_POLL_S:
            mark_stale(study, storage, opts.trial_timeout)
            last = time.monotonic()
        time.sleep(STOP_POLL_S)
    raise_if_stopped()  # workers stopped by the same Ctrl-C exit 130: a stop, not their failure
    report()
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad and not study_exists(url, name):
        raise StoreError(f"study {name!r} was deleted while it ran (a `tune --retune` elsewhere?): stopped")
    if bad:
        raise RuntimeError(f"tuning workers exited with {bad}: see their output above")
    if deadline is not None or heartbeat_interval(storage) is None:
        # seconds mode: the time is spent. Journal: no heartbeats, an orphan goes stale only
        # after twice the trial timeout (minutes): a later --resume retries it
        return False
    while study.get_trials(deepcopy=False, states=(state.RUNNING,)):
        raise_if_stopped()
        mark_stale(study, storage, opts.trial_timeout)
        if study.get_trials(deepcopy=False, states=(state.WAITING,)):
            break
        time.sleep(STALE_POLL_S)
    raise_if_stopped()
    return bool(study.get_trials(deepcopy=False, states=(state.WAITING,)))


STUDY_DELETED_EXIT = 3  # a worker's exit status when its study was deleted while it ran


def study_exists(url: str | None, name: str) -> bool:
    import optuna

    return name in {s.study_name for s in optuna.get_all_study_summaries(open_storage(url), include_best_trial=False)}


def _default_url() -> str:
    from .store import default_url

    return default_url()


def _finished(study) -> int:
    """Trials that ran a variant (pruned ones and repeats ran nothing and do not count against the
    budget)."""
    import optuna

    st = optuna.trial.TrialState
    stale = stale_numbers(study)
    return sum(1 for t in study.get_trials(deepcopy=False, states=(st.COMPLETE, st.FAIL))
               if t.number not in stale and t.user_attrs.get("status") != "repeat")


def _finish(study, storage, bucket: Bucket, machine: Machine, source: str, opts: TuneOptions,
            remeasure: bool = True) -> bool:
    """Re-measure the best few and the default (``remeasure``; else take the study's own
    measurements); record the winner in the table, then in the study (a table that cannot be
    written leaves the study unfinished, so a rerun finishes it). Returns whether a winner was
    recorded."""
    import optuna

    # a study measured before today's checks (a resumed, stale one) may hold a config they now
    # refuse: never a winner, nor re-measured
    done = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if _runs(t.params, bucket, opts.device)]
    done.sort(key=lambda t: t.value)
    default = default_config(bucket.kernel, bucket_shape(bucket), smem_limit(opts.device),
                             decode_rows=bucket_decode_rows(bucket))
    timed = []
    if remeasure:
        # distinct configs (a repeat holds the value of the trial it repeats); the default as itself
        top = list(dict.fromkeys(params_config(t.params).canonical() for t in done))[: opts.top_k]
        top = [default if c == default.canonical() else c for c in top]
        with TrialRunner(opts.trial_timeout) as runner:
            for i, v in enumerate(dict.fromkeys(top + [default])):
                r = run_objective(bucket, v.to_dict(), opts, seed=opts.seed + 10_000 + i, runner=runner)
                if r["status"] == "ok":
                    timed.append((r["seconds"], v))
    else:
        timed = [(t.value, params_config(t.params)) for t in done]
    default_s = next((s for s, v in timed if v.canonical() == default.canonical()), None)
    if not timed:
        return False
    best_s, best = min(timed, key=lambda sv: sv[0])
    attrs = {**study.user_attrs, "best_variant": best.to_dict(), "best_seconds": best_s,
             "default_seconds": default_s}
    write_tuned([study_entry(study.study_name, attrs)], opts.table, rebuild_from=storage, replace=opts.retune)
    for k in RESULT_ATTRS:
        study.set_user_attr(k, attrs[k])
    return True


def _runs(params: dict[str, Any], bucket: Bucket, device: str) -> bool:
    """Does the config of a trial's parameters pass today's check and run on ``device``, as a
    trial's draw must (``run_worker``) and the launcher requires of a tuned entry?"""
    try:
        cfg = params_config(params)
    except (KeyError, TypeError, ValueError):  # parameters of a space this version no longer has
        return False
    return cfg.check(bucket_shape(bucket), smem_limit(device)) is None and device_refusal(cfg, device) is None


def _result_from(study, bucket: Bucket, ran: int, already: bool) -> BucketResult:
    a = study.user_attrs
    return BucketResult(bucket, study.study_name, ran, already, _counts(study), a.get("best_variant"),
                        a.get("best_seconds"), a.get("default_seconds"), trials_total=_finished(study))


def list_studies(storage_url: str | None = None) -> list[dict[str, Any]]:
    """What the store holds: one row per rtcompile study."""
    import optuna

    default = store_file(None)
    if storage_url in (None, default_url()) and default is not None and not default.exists():
        return []  # nothing tuned on this machine yet; listing never creates the store
    storage = open_storage(storage_url, create=False)
    rows = []
    for s in optuna.get_all_study_summaries(storage, include_best_trial=False):
        if not s.study_name.startswith("rtcompile:"):
            continue
        a = s.user_attrs
        ran = _finished(optuna.load_study(study_name=s.study_name, storage=storage))  # as tune's table counts
        rows.append({"study": s.study_name, "trials": ran, "best_variant": a.get("best_variant"),
                     "best_seconds": a.get("best_seconds"), "default_seconds": a.get("default_seconds")})
    return rows
