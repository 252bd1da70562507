"""Stopping a command cleanly: SIGINT and SIGTERM both raise KeyboardInterrupt in the main thread.

Python's default for SIGTERM ends the process at once: no ``finally`` block or context manager
runs, so a killed ``export`` left its temporary bundle folder (``.bundle.<pid>.<hex>.tmp``)
and the parent folders it had made, and a killed ``tune`` its worker processes. While
:func:`stop_on_signal` is held, the first stop of either kind raises KeyboardInterrupt and the
clean-up runs as for a Ctrl-C. ``rtcompile.cli.main`` holds it around every command; the tune
coordinator and its workers (``tuning/processes.py``, ``tuning/worker.py``) hold it too.

This module imports nothing of rtcompile, so the CLI holds it before any command module loads.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["raise_if_stopped", "stop_on_signal"]

_STOPS = (signal.SIGINT, signal.SIGTERM)

# The stop being handled (the signal's name) while stop_on_signal is held, else None: the
# KeyboardInterrupt that _interrupt raises can be swallowed (below), and the polling loops
# re-raise it from this (raise_if_stopped)
_stopping: str | None = None
# Is a stop_on_signal block held (by this process's main thread)? An inner block leaves the
# handlers and the state to it
_held = False


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
    later ones are ignored, so ``finally`` blocks and context managers clean up, once: a
    command's temporary files and folders, the tune's workers and trial processes (Python's
    default for SIGTERM ends the process at once, leaving them). The previous handlers are
    restored after (``rtcompile.cli.main`` may run in a process that lives on), and off the
    main thread, where no handler can be set, it does nothing. A stop whose raise a finalizer
    swallowed is raised again by the next :func:`raise_if_stopped`, or on leaving the block.
    A block inside another (``cli.main`` holds one around ``tune``, which holds its own) only
    raises a swallowed stop on leaving: the outer one keeps the handlers and the stop's state
    (cleared by the inner one, a stop landing between the two was lost)."""
    global _stopping, _outer_hook, _held
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _held:
        yield
        raise_if_stopped()
        return
    _stopping = None
    pool_level = logging.getLogger("sqlalchemy.pool").level  # _interrupt silences it
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # the signal mask as it is (unchanged)
    hook = sys.unraisablehook  # never our own (one left by an interrupted clean-up would recurse)
    _outer_hook = hook if hook is not _quiet_unraisable else sys.__unraisablehook__
    sys.unraisablehook = _quiet_unraisable
    previous = {sig: signal.signal(sig, _interrupt) for sig in _STOPS}
    _held = True
    try:
        yield
        raise_if_stopped()  # a stop swallowed after the last poll still ends the caller as stopped
    finally:
        try:
            _restore(previous, pool_level, mask)
        finally:
            _held = False


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
