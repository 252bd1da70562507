"""The tune's processes: starting the workers, and stopping them with their trial processes.

A stopped tune (Ctrl-C, SIGTERM, an error) leaves no process behind: the coordinator's
``study._run_workers`` ends its workers (:func:`stop_workers`), a worker's SIGTERM stops its
trial process through its context managers (:func:`stop_on_signal`), and under Ctrl-C
(the whole process group) each process exits quietly, leaving the one line to the CLI.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from typing import Iterator


def spawn_workers(storage_url: str, name: str, bucket, opts, deadline: float | None,
                  procs: list[subprocess.Popen]) -> None:
    """Start ``opts.workers`` worker processes (``python -m rtcompile.tuning.worker``) on the
    study, one GPU each, round robin, each appended to the caller's ``procs`` as soon as it
    exists: a stop landing while later ones start still finds the earlier ones to end (a list
    returned at the end left them running, tuning to the deadline)."""
    payload = json.dumps({"storage": storage_url, "study": name, "bucket": asdict(bucket),
                          "options": asdict(opts), "deadline": deadline})
    gpus = visible_gpus(opts.device)
    for i in range(opts.workers):
        env = dict(os.environ)
        if gpus:  # one GPU per worker (round robin): trials on one GPU never share it
            env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
        procs.append(subprocess.Popen([sys.executable, "-m", "rtcompile.tuning.worker", str(i)],
                                      stdin=subprocess.PIPE, text=True, env=env))
        procs[-1].stdin.write(payload)
        procs[-1].stdin.close()


def visible_gpus(device: str) -> list[str]:
    """The GPU ids workers are spread over (none off the GPU)."""
    if not device.startswith("cuda"):
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        return [x.strip() for x in listed.split(",") if x.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


# A worker told to stop (SIGTERM) kills its trial process and exits within a second or two; one
# that does not (stuck in a storage call) is killed, and its trial process then ends at the
# close of its request pipe
STOP_GRACE_S = 10.0


def stop_workers(procs: list[subprocess.Popen]) -> None:
    """End the workers still running: SIGTERM (the worker's handler stops it and its trial
    process, ``worker.main``), then SIGKILL after STOP_GRACE_S."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


_STOPS = (signal.SIGINT, signal.SIGTERM)


# How often the tune's waiting loops look for a stop that was swallowed (raise_if_stopped)
STOP_POLL_S = 0.5

# The stop being handled (the signal's name) while stop_on_signal is held, else None: the
# KeyboardInterrupt that _interrupt raises can be swallowed (below), and the polling loops
# re-raise it from this (raise_if_stopped)
_stopping: str | None = None


def raise_if_stopped() -> None:
    """Raise KeyboardInterrupt when a stop was signalled under :func:`stop_on_signal`.

    The handler's own KeyboardInterrupt is lost when the signal lands inside a finalizer
    (SQLAlchemy's ``InstanceState._cleanup`` in CI, 2026-12-05: "Exception ignored in", and the
    coordinator then tuned on for the rest of its budget, past the test's 30 s). Every loop
    that waits on the tune's processes calls this each pass (STOP_POLL_S in the workers' wait,
    STALE_POLL_S in the wait for other hosts' trials), and again before it judges how its
    workers ended, so a stop ends the tune as a stop however the first raise fared."""
    if _stopping is not None:
        raise KeyboardInterrupt(_stopping)


# the unraisable hook stop_on_signal replaced, which gets every other unraisable exception
_outer_hook = sys.__unraisablehook__


def _quiet_unraisable(unraisable) -> None:
    # a stop swallowed by a finalizer prints "Exception ignored in ...: KeyboardInterrupt" with
    # its traceback: noise once stopping (raise_if_stopped raises it again); others as before
    if _stopping is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
        return
    _outer_hook(unraisable)


def _interrupt(signum, frame) -> None:
    global _stopping
    _stopping = signal.Signals(signum).name
    # the first stop only: the clean-up it starts must not be interrupted in turn (a Ctrl-C to
    # the process group, then the coordinator's SIGTERM, landed both in a worker's queue wait,
    # and the second broke its lock: "RuntimeError: release unlocked lock", a traceback)
    # (a Python no-op, not SIG_IGN: a signal already pending when the handler became SIG_IGN
    # is reported as "Signal 15 ignored due to race condition", with a traceback header)
    for sig in _STOPS:
        signal.signal(sig, _ignore)
    # the interrupt may land in SQLAlchemy's connection-pool finalizer, which logs it with a
    # traceback ("Exception during reset or similar") and swallows it (CI on 2026-12-05, once, under
    # the full suite's load): once stopping, that log is noise (STOP_GRACE_S ends such a worker)
    logging.getLogger("sqlalchemy.pool").setLevel(logging.CRITICAL + 1)  # the pools log through children
    raise KeyboardInterrupt(_stopping)


def _ignore(signum, frame) -> None:
    pass


@contextmanager
def stop_on_signal() -> Iterator[None]:
    """While held, the first SIGINT or SIGTERM raises KeyboardInterrupt in the main thread and
    later ones are ignored, so ``finally`` blocks and context managers stop the workers and
    trial processes, once (Python's default for SIGTERM ends the process at once, orphaning
    them). For the tune coordinator and workers; the previous handlers are restored after
    (``rtcompile.cli.main`` may run in a process that lives on), and off the main thread,
    where no handler can be set, it does nothing. A stop whose raise a finalizer swallowed is
    raised again by the next :func:`raise_if_stopped`, or on leaving the block. Not nested (the
    tune command and a worker each hold one): an inner block would clear an outer one's stop."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _stopping, _outer_hook
    _stopping = None
    pool_level = logging.getLogger("sqlalchemy.pool").level  # _interrupt silences it
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # the signal mask as it is (unchanged)
    hook = sys.unraisablehook  # never our own (one left by an interrupted clean-up would recurse)
    _outer_hook = hook if hook is not _quiet_unraisable else sys.__unraisablehook__
    sys.unraisablehook = _quiet_unraisable
    previous = {sig: signal.signal(sig, _interrupt) for sig in _STOPS}
    try:
        yield
        raise_if_stopped()  # a stop swallowed after the last poll still ends the caller as stopped
    finally:
        _restore(previous, pool_level, mask)


def _restore(previous: dict, pool_level: int, mask) -> None:
    """:func:`stop_on_signal`'s clean-up, with the stops held off while it runs (a signal landing
    in it raised out of it, leaving the handlers, hook and flag behind in a process that lives
    on: ``rtcompile.cli.main``); a stop whose handler raises from the blocking call itself
    still gets everything restored, the mask as it was on entry, and one that came meanwhile is
    delivered after, to the handler restored."""
    global _stopping, _outer_hook
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    finally:
        try:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            sys.unraisablehook, _outer_hook = _outer_hook, sys.__unraisablehook__
            _stopping = None
            logging.getLogger("sqlalchemy.pool").setLevel(pool_level)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
