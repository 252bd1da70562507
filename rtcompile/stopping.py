"""Stopping a command cleanly: SIGINT and SIGTERM both raise KeyboardInterrupt in the main thread.

Python's default for SIGTERM ends the process at once: no ``finally`` block or context manager
runs, so a killed ``export`` left its temporary bundle folder (``.bundle.<pid>.<hex>.tmp``)
and the parent folders it had made, and a killed ``tune`` its worker processes. While
:func:`stop_on_signal` is held, the first stop of either kind raises KeyboardInterrupt and the
clean-up runs as for a Ctrl-C. ``rtcompile.cli.main`` holds it around every command; the tune
coordinator and its workers (``tuning/processes.py``, ``tuning/worker.py``) hold it too.

A stop that lands while an import started inside the block runs (importlib's frames: finding,
loading, an extension module's initialisation, a module's body; an import statement's own C
code) is held until that import is done, looked at again every :data:`DEFER_POLL_S`: a
KeyboardInterrupt raised there aborted or crashed the process, or came out as another error,
instead of stopping it. A hung import holds the stop. And a block that a signalled stop ends by
another error (an Exception: the stop raised where C code turns it into one) ends as the stop,
with that error as its cause.

This module imports nothing of rtcompile, so the CLI holds it before any command module loads.
"""

from __future__ import annotations

import _thread
import logging
import opcode
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["raise_if_stopped", "stop_on_signal"]

_STOPS = (signal.SIGINT, signal.SIGTERM)

# How soon a stop held back by an import looks again (s); each look that finds the import still
# running starts one more timer thread. Raised inside an extension module's load, the stop ended
# `rtcompile export` 0-50 ms after its temporary folder appeared (in `import onnx`, whose
# nanobind module calls back into Python) in SIGABRT ("terminate called after throwing an
# instance of 'nanobind::python_error'") or SIGSEGV (in the module's dealloc): 3 of about 170
# SIGTERMs, CPU, 2026-12-06. 20 ms keeps a stop prompt (a person notices ~100 ms) at 50 looks a
# second at most; all of `import onnx` took 0.85 s on the CPU machine (-X importtime).
DEFER_POLL_S = 0.02
# What importlib's own frames are named (_bootstrap and _bootstrap_external, frozen in 3.11-3.13),
# and the opcodes of an import statement, whose C code calls back into Python and checks for
# signals: a stop is held while either is on the stack, not only an extension's load. Handled
# inside IMPORT_FROM's failure (`from google.protobuf.internal import _api_implementation`, a
# module that is not there, in onnx's imports), the stop came out as "TypeError: expected a
# message argument" (CPython's ImportError built without its message): exit 1 and a traceback,
# not a stop (CI, 2026-12-06, once in 2644 tests). Reproduced on 3.11 and 3.12: a SIGTERM at a
# random moment of a loop of such imports came out as that TypeError 3 times in 2000 (3.11), 17
# (3.12), each time handled at IMPORT_FROM.
_IMPORTLIB = "<frozen importlib._bootstrap"
_IMPORT_OPS = frozenset((opcode.opmap["IMPORT_NAME"], opcode.opmap["IMPORT_FROM"]))

# The stop being handled (the signal's name) while stop_on_signal is held, else None: the
# KeyboardInterrupt that _interrupt raises can be swallowed (below), and the polling loops
# re-raise it from this (raise_if_stopped)
_stopping: str | None = None
# Is a stop_on_signal block held (by this process's main thread)? An inner block leaves the
# handlers and the state to it
_held = False
# How many importing frames (_imports_under) were on the main thread's stack as the block was
# entered: a command run from a module's body (its import never ends inside the block) is
# stopped as any other
_entry_imports = 0
# The timer that looks again at a stop held back by an import (None: none pending),
# and the lock under which it fires or is cancelled: it never trips a handler stop_on_signal has restored.
# Re-entrant: the handler it trips may run in the main thread while the main thread holds it
_look_again_timer: threading.Timer | None = None
_timer_lock = threading.RLock()
# Is stop_on_signal's clean-up restoring the handlers? A held stop's look tripped just before it
# was cancelled then does nothing (raised there, it left the handlers, hook and flag behind), and
# a first stop then (a thread the stops are not blocked in took the signal) is sent again once
# the handlers are restored (_late_stop), to the handler restored
_restoring = False
_late_stop: int | None = None


def raise_if_stopped() -> None:
    """Raise KeyboardInterrupt when a stop was signalled under :func:`stop_on_signal`.

    The handler's own KeyboardInterrupt is lost when the signal lands inside a finalizer
    (SQLAlchemy's ``InstanceState._cleanup`` in CI, 2026-12-05: "Exception ignored in", and the
    coordinator then tuned on for the rest of its budget, past the test's 30 s). Every loop
    that waits on the tune's processes calls this each pass (STOP_POLL_S in the workers' wait,
    STALE_POLL_S in the wait for other hosts' trials), and again before it judges how its
    workers ended, so a stop ends the tune as a stop however the first raise fared."""
    if _stopping is not None:
        _raise_stop()


def _raise_stop(cause: Exception | None = None) -> None:
    """Raise the stop, the first time or again (from ``cause``, the error it became): a held
    stop's look is cancelled and later stops are ignored from here on, so the clean-up this raise
    starts is not interrupted in turn (a Ctrl-C to the process group, then the coordinator's
    SIGTERM, landed both in a worker's queue wait, and the second broke its lock: "RuntimeError:
    release unlocked lock", a traceback)."""
    stop = KeyboardInterrupt(_stopping)
    if threading.current_thread() is threading.main_thread():  # the main thread's look and handlers are its own
        _cancel_look_again()
        if _held:
            # a Python no-op, not SIG_IGN: a signal already pending when the handler became SIG_IGN
            # is reported as "Signal 15 ignored due to race condition", with a traceback header
            for sig in _STOPS:
                signal.signal(sig, _ignore)
    if cause is not None:
        raise stop from cause
    raise stop


def _stop_instead(exc: Exception) -> None:
    """A block that a signalled stop ends by another error ends as the stop: the stop raised
    inside C code that turns it into something else (CPython's import, above) still stops the
    command, after the same clean-up, and exits 130, not 1 with a traceback."""
    if _stopping is not None:
        _raise_stop(exc)


# the unraisable hook stop_on_signal replaced, which gets every other unraisable exception
_outer_hook = sys.__unraisablehook__


def _quiet_unraisable(unraisable) -> None:
    # a stop swallowed by a finalizer prints "Exception ignored in ...: KeyboardInterrupt" with
    # its traceback: noise once stopping (raise_if_stopped raises it again); others as before
    if _stopping is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
        return
    _outer_hook(unraisable)


def _imports_under(frame) -> int:
    """How many of ``frame`` and the frames that called it run an import: importlib's (finding,
    loading, an extension's initialisation and what it calls back, a module's body), or one
    whose current instruction is an import statement's (its C code, and what that calls back)."""
    count = 0
    while frame is not None:
        code, at = frame.f_code, frame.f_lasti
        ops = code.co_code  # a copy: read as a block is entered and as a stop lands, never on a hot path
        count += code.co_filename.startswith(_IMPORTLIB) or (0 <= at < len(ops) and ops[at] in _IMPORT_OPS)
        frame = frame.f_back
    return count


def _look_again(signum: int) -> None:
    global _look_again_timer
    with _timer_lock:
        if _look_again_timer is None:
            _look_again_timer = threading.Timer(DEFER_POLL_S, _trip, (signum,))
            _look_again_timer.daemon = True
            _look_again_timer.start()


def _trip(signum: int) -> None:
    # in the timer's thread: run the stop's handler again in the main thread, unless the block
    # ended meanwhile (_cancel_look_again)
    global _look_again_timer
    with _timer_lock:
        if _look_again_timer is threading.current_thread():
            _look_again_timer = None
            _thread.interrupt_main(signum)


def _cancel_look_again() -> None:
    global _look_again_timer
    with _timer_lock:
        if _look_again_timer is not None:
            _look_again_timer.cancel()
            _look_again_timer = None


def _interrupt(signum, frame) -> None:
    global _stopping, _late_stop
    if _restoring:  # the block has ended: a look, or a signal another thread took (see _restoring)
        if _stopping is None:
            _late_stop = signum
        return
    if _stopping is None:
        _stopping = signal.Signals(signum).name
    # the interrupt may land in SQLAlchemy's connection-pool finalizer, which logs it with a
    # traceback ("Exception during reset or similar") and swallows it (CI on 2026-12-05, once, under
    # the full suite's load): once stopping, that log is noise (STOP_GRACE_S ends such a worker)
    logging.getLogger("sqlalchemy.pool").setLevel(logging.CRITICAL + 1)  # the pools log through children
    if _imports_under(frame) > _entry_imports:  # held until the import is done; a later stop meanwhile joins it
        _look_again(signum)
        return
    _raise_stop()


def _ignore(signum, frame) -> None:
    pass


@contextmanager
def stop_on_signal() -> Iterator[None]:
    """While held, the first SIGINT or SIGTERM raises KeyboardInterrupt in the main thread and
    later ones are ignored, so ``finally`` blocks and context managers clean up, once: a
    command's temporary files and folders, the tune's workers and trial processes (Python's
    default for SIGTERM ends the process at once, leaving them). A stop during an import begun
    in the block is raised once the import is done (one that hangs holds it), and a block that a
    stop ends by another error (an Exception) ends as the stop, from that error. The previous
    handlers are restored after (``rtcompile.cli.main`` may run in a process that lives on),
    and off the main thread, where no handler can be set, it does nothing. A stop whose raise
    a finalizer swallowed is raised again by the next :func:`raise_if_stopped`, or on leaving
    the block. A block inside another (``cli.main`` holds one around ``tune``, which holds its
    own) only raises a swallowed stop on leaving: the outer one keeps the handlers and the
    stop's state (cleared by the inner one, a stop landing between the two was lost)."""
    global _stopping, _outer_hook, _held, _restoring, _entry_imports
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _held:
        try:
            yield
        except Exception as exc:
            _stop_instead(exc)
            raise
        raise_if_stopped()
        return
    _stopping = None
    pool_level = logging.getLogger("sqlalchemy.pool").level  # _interrupt silences it
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # the signal mask as it is (unchanged)
    hook = sys.unraisablehook  # never our own (one left by an interrupted clean-up would recurse)
    _outer_hook = hook if hook is not _quiet_unraisable else sys.__unraisablehook__
    sys.unraisablehook = _quiet_unraisable
    _entry_imports = _imports_under(sys._getframe())
    previous = {sig: signal.signal(sig, _interrupt) for sig in _STOPS}
    _held = True
    try:
        yield
        raise_if_stopped()  # a stop swallowed after the last poll still ends the caller as stopped
    except Exception as exc:
        _stop_instead(exc)
        raise
    finally:
        # before the call: its first bytecode may run a tripped look, which must not raise there
        _restoring = True
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
    global _stopping, _outer_hook, _restoring, _late_stop
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    finally:
        try:
            _cancel_look_again()  # before the handlers: a look never trips one restored
            if _stopping is not None:
                # CPython (3.11-3.13) remembers a KeyboardInterrupt that left code run by exec()
                # of a string (a dataclass's generated methods: the stop landed there) and, run as
                # `python -m`, ends the process by SIGINT at exit although the stop was handled:
                # exit -2, not 130 (`rtcompile export`, CI 2026-12-06). An exec of a string clears it.
                exec("")
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            sys.unraisablehook, _outer_hook = _outer_hook, sys.__unraisablehook__
            _stopping = None
            logging.getLogger("sqlalchemy.pool").setLevel(pool_level)
        finally:
            _restoring = False
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            late, _late_stop = _late_stop, None
            if late is not None:
                signal.raise_signal(late)
