"""Claiming trials and recovering the ones whose worker died.

Workers take enqueued (WAITING) trials themselves (:func:`claim`) instead of ``study.ask``,
which would create a trial when none waits and overrun a trial budget. While a worker runs a
trial it records Optuna heartbeats (:class:`Heartbeat`); :func:`mark_stale` fails the trials
whose heartbeat lapsed (``optuna.storages.fail_stale_trials``) and the storage's retry callback
enqueues each one's parameters again. Everything goes through the storage's public methods,
with the storage object the caller opened (:func:`rtcompile.tuning.store.open_storage`).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import warnings

from .store import claim_lock, heartbeat_interval, retried_numbers, retry_callback


def stale_numbers(study) -> set[int]:
    """The numbers of the study's trials whose worker died (failed as stale and retried)."""
    return retried_numbers(study.get_trials(deepcopy=False))


def trial_id(storage, study, number: int) -> int:
    """The storage's id of the study's trial ``number`` (Optuna keeps the id private on trials)."""
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study.study_name), number)


class Heartbeat:
    """Records a RUNNING trial's heartbeat every ``HEARTBEAT_S`` while its worker runs it, from a
    thread (the evaluation itself waits on a trial process). Optuna beats inside
    ``study.optimize``; the workers here claim enqueued trials themselves (:func:`claim`), so
    they beat themselves, through the storage's public ``record_heartbeat``. A no-op where the
    storage keeps no heartbeats (journal)."""

    def __init__(self, storage, trial: int):
        self.storage, self.trial = storage, trial
        self.interval = heartbeat_interval(storage)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.storage.record_heartbeat(self.trial)
            except Exception:  # noqa: BLE001 -- a missed beat (a busy database) is covered by the grace period
                pass

    def start(self) -> "Heartbeat":
        if self.interval is not None:
            self._thread = threading.Thread(target=self._beat, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None


def mark_stale(study, storage, timeout: float) -> int:
    """Fail the study's RUNNING trials whose worker is gone and enqueue each one's retry (same
    parameters, a new WAITING trial; :func:`rtcompile.tuning.store.retry_callback`). Returns
    how many were failed. A worker of this host that exited is gone at once (:func:`worker_gone`).

    RDB storages: Optuna's ``fail_stale_trials`` (a trial whose heartbeat is ``GRACE_S`` old;
    a worker beats before it moves a trial to RUNNING, so no RUNNING trial lacks a heartbeat).
    The journal storage keeps no heartbeats (Optuna 5.0): there a trial RUNNING for over twice
    the trial timeout is stale, since a live worker ends every trial at the timeout."""
    import optuna

    state = optuna.trial.TrialState
    failed = lambda: {t.number for t in study.get_trials(deepcopy=False, states=(state.FAIL,))}
    before = failed()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        now, retry = time.time(), retry_callback()
        for t in study.get_trials(deepcopy=False, states=(state.RUNNING,)):
            aged = heartbeat_interval(storage) is None and t.datetime_start is not None \
                and now - t.datetime_start.timestamp() > 2 * timeout
            if aged or worker_gone(t):
                fail_and_retry(study, storage, t.number, retry)
        if heartbeat_interval(storage) is not None:
            optuna.storages.fail_stale_trials(study)
    return len(failed() - before)


def fail_and_retry(study, storage, number: int, retry) -> None:
    """Fail a RUNNING trial and enqueue its retry (``retry``: the storage's callback)."""
    import optuna

    tid = trial_id(storage, study, number)
    try:
        if storage.set_trial_state_values(tid, state=optuna.trial.TrialState.FAIL):
            retry(study, storage.get_trial(tid))
    except optuna.exceptions.UpdateFinishedTrialError:
        pass  # another process finished or failed it first


def worker_gone(trial) -> bool:
    """Did the trial's worker, recorded on this host at its claim, exit? A killed tune is then
    recovered at once (without this, after the heartbeat's grace period on an RDB store and
    after twice the trial timeout on a journal, where a rerun had already marked the study
    tuned). A trial of another host, or one claimed before its pid was recorded, goes by its
    heartbeat."""
    pid = trial.user_attrs.get("pid")
    if trial.user_attrs.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    return not process_alive(pid)


def process_alive(pid: int) -> bool:
    """Is process ``pid`` running on this host (a zombie, whose parent died without reaping
    it, is not)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process holds the number
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True  # no /proc (not Linux): the signal check stands


def claim(study, storage, storage_url: str | None = None):
    """Take one WAITING trial, or None. Atomic: no two workers ever get the same trial (the
    storage's compare-and-set of the state, plus ``claim_lock`` where that is not atomic).
    Optuna's ``study.ask`` would create a new trial when none waits, overrunning the budget.

    The heartbeat is recorded before the state change: a worker killed right after the claim
    leaves a RUNNING trial with a heartbeat, which goes stale; one without a heartbeat would
    never be seen by ``fail_stale_trials``."""
    import optuna

    beats = heartbeat_interval(storage) is not None
    claimed = None
    with claim_lock(storage_url):
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
            tid = trial_id(storage, study, t.number)
            if beats:
                storage.record_heartbeat(tid)
            try:
                if storage.set_trial_state_values(tid, state=optuna.trial.TrialState.RUNNING):
                    claimed = optuna.Trial(study, tid)
                    break
            except optuna.exceptions.UpdateFinishedTrialError:
                continue
    if claimed is not None:  # where it ran, for a person reading the store
        try:
            claimed.set_user_attr("host", socket.gethostname())
            claimed.set_user_attr("pid", os.getpid())
        except optuna.exceptions.UpdateFinishedTrialError:
            # another process's recovery failed it (and enqueued its retry) between the claim and
            # these records: this claim is lost, take the next waiting trial
            return claim(study, storage, storage_url)
    return claimed


def next_trial(study, storage, storage_url: str | None, deadline: float | None):
    """The worker's next trial: a WAITING one (trials mode: None ends the worker); in seconds
    mode, a new one is enqueued whenever none waits, until the deadline."""
    while True:
        trial = claim(study, storage, storage_url)
        if trial is not None or deadline is None or time.time() >= deadline:
            return trial
        study.enqueue_trial({})  # another worker may take it first: then claim again
