"""``rtcompile.stopping``: a stop (SIGINT, SIGTERM) that lands while an import runs is raised once
the import is done, a stop that the code turned into another error still ends the block as a
stop, and a handled stop exits 130 also where it landed in code run by ``exec``.

Found by sending SIGTERM to ``rtcompile export`` at random moments (CPU and CI, 2026-12-06):
inside ``import onnx`` (a nanobind module calling back into Python) the process aborted
(SIGABRT, C++ terminate) or crashed (SIGSEGV), or the stop came out of the import as "TypeError:
expected a message argument" (exit 1); and a stop landing in a dataclass's generated code ended
the handled stop by SIGINT (exit -2) instead of 130."""

from __future__ import annotations

import _imp
import contextlib
import importlib._bootstrap
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from rtcompile import stopping
from rtcompile.stopping import raise_if_stopped, stop_on_signal


def _extension_load_that_stops(sig: int = signal.SIGTERM) -> bool:
    """importlib's extension-module load (``_imp.create_dynamic``, called as ExtensionFileLoader
    calls it) of a spec whose name, the first thing the load reads, sends ``sig`` to this process
    and runs on: the stop lands inside the load, as in onnx's initialisation. The load then
    fails (ImportError: there is no such module). Returns whether the spec's code ran to its end."""
    done = []

    class Spec:
        @property
        def name(self):
            os.kill(os.getpid(), sig)
            for _ in range(100000):  # the handler runs between these bytecodes
                pass
            done.append(True)
            raise ImportError("no such extension: the load ends here")

    with pytest.raises(ImportError, match="no such extension"):
        importlib._bootstrap._call_with_frames_removed(_imp.create_dynamic, Spec())
    return bool(done)


@pytest.fixture(autouse=True)
def _python_sigint():
    """SIGINT handled as Python installs it (KeyboardInterrupt) during each test, whatever the
    process started with: one started in the background by a shell without job control inherits
    SIGINT ignored and Python keeps it so, where two tests here that expect KeyboardInterrupt
    failed (pytest started with ``&``, 2026-12-07)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(autouse=True)
def _slow_looks(monkeypatch):
    """A held stop's look every 0.3 s, not 20 ms: a look cannot fire in the few bytecodes
    between a held stop's load or import and the test's next step, even on a loaded machine."""
    monkeypatch.setattr(stopping, "DEFER_POLL_S", 0.3)


def _run_for(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # bytecodes between sleeps: a held stop's look runs here
        time.sleep(0.005)


def test_a_stop_inside_an_extension_load_is_raised_after_it():
    """The load's code runs to its end, and the stop is raised soon after, in the code that
    follows, not only when the block ends. Before: the KeyboardInterrupt left the load half run."""
    reached = []
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"), stop_on_signal():
        reached.append(_extension_load_that_stops())
        _run_for(5)
        reached.append("not stopped in 5 s")
    assert reached == [True]


def _module(tmp_path, monkeypatch, name: str, body: str):
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, name, None)  # recorded, so the import is undone after the test
    monkeypatch.delitem(sys.modules, name)


def test_a_stop_inside_a_python_module_body_is_raised_after_its_import(tmp_path, monkeypatch):
    """A Python module's body, imported in the block, runs to its end, and the stop is raised
    in the code that follows the import. Before: it was raised inside the body (inside onnx's
    protobuf imports CPython turned it into a TypeError, CI's failure)."""
    _module(tmp_path, monkeypatch, "stopped_while_imported", "import os, signal, time\n"
            "os.kill(os.getpid(), signal.SIGTERM)\nfor _ in range(40):\n    time.sleep(0.005)\nDONE = True\n")
    reached = []
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"), stop_on_signal():
        import stopped_while_imported
        reached.append(stopped_while_imported.DONE)
        _run_for(5)
        reached.append("not stopped in 5 s")
    assert reached == [True]


def test_a_block_inside_a_module_body_stops_at_once(tmp_path, monkeypatch):
    """A command run from a module's body (an import that never ends inside the block) is
    stopped where the stop lands, not held for the rest of the command."""
    _module(tmp_path, monkeypatch, "runs_a_command", "import os, signal, time\n"
            "from rtcompile.stopping import stop_on_signal\nSTEPS = 0\ntry:\n    with stop_on_signal():\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n        for STEPS in range(1000):\n"
            "            time.sleep(0.005)\nexcept KeyboardInterrupt:\n    pass\n")
    import runs_a_command

    assert runs_a_command.STEPS < 50  # held to the block's end: 999 (5 s)


@pytest.mark.parametrize("nested", [False, True], ids=["block", "inner-block"])
def test_a_stop_turned_into_another_error_ends_the_block_as_the_stop(nested):
    """C code that a stop's KeyboardInterrupt passes through may raise another error in its place
    (CPython's import: "TypeError: expected a message argument", CI 2026-12-06): the block ends
    as the stop, from that error, so the CLI exits 130, not 1 with a traceback."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM") as info, stop_on_signal():
        with stop_on_signal() if nested else contextlib.nullcontext():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                _run_for(5)
            except KeyboardInterrupt:
                raise TypeError("expected a message argument") from None
    assert isinstance(info.value.__cause__, TypeError)
    assert signal.getsignal(signal.SIGTERM) is before and stopping._stopping is None


def test_a_stop_inside_an_import_statements_failure_is_raised_after_it(monkeypatch):
    """A stop handled while IMPORT_FROM builds its ImportError (CPython checks for signals there,
    in the importing frame) came out of the statement as "TypeError: expected a message
    argument" (CI's failure): held, the statement raises its ImportError, which the code
    catches as it meant to, and the stop is raised after. The module's name stands in for the
    signal's timing: its repr, which the message calls, sends it."""
    class Name(str):
        def __repr__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            return str.__repr__(self)

    module = types.ModuleType("no_such_name_in_it")
    module.__name__, module.__file__ = Name("no_such_name_in_it"), "/nowhere/no_such_name_in_it.py"
    monkeypatch.setitem(sys.modules, "no_such_name_in_it", module)
    caught = []
    with pytest.raises(KeyboardInterrupt, match="SIGTERM") as info, stop_on_signal():
        try:
            from no_such_name_in_it import missing  # noqa: F401
        except ImportError as exc:
            caught.append(type(exc).__name__)
        _run_for(5)
    assert caught == ["ImportError"] and info.value.__cause__ is None


def test_an_error_without_a_stop_is_left_as_it_is():
    with pytest.raises(ValueError, match="the block's own error") as info, stop_on_signal():
        raise ValueError("the block's own error")
    assert info.value.__cause__ is None


def test_a_held_stop_raised_by_a_poll_does_not_interrupt_the_clean_up():
    """A held stop first raised by ``raise_if_stopped`` (the tune's loops poll it): its look is
    cancelled and later stops are ignored, so the clean-up it starts runs to its end. Before,
    the look raised a second KeyboardInterrupt inside the clean-up."""
    steps = []
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"), stop_on_signal():
        assert _extension_load_that_stops()
        try:
            raise_if_stopped()
        finally:
            steps.append("clean-up started")
            os.kill(os.getpid(), signal.SIGINT)  # a second stop: ignored
            _run_for(5 * stopping.DEFER_POLL_S)
            steps.append("clean-up done")
    assert steps == ["clean-up started", "clean-up done"]


def test_a_held_stop_never_fires_after_its_block(monkeypatch):
    """The block ends (a stop) before the held stop's next look: the look is cancelled, so the
    handler restored after the block (SIGINT's: raise KeyboardInterrupt) is never tripped later,
    in a process that lives on."""
    monkeypatch.setattr(stopping, "DEFER_POLL_S", 0.3)
    with pytest.raises(KeyboardInterrupt, match="SIGINT"), stop_on_signal():
        assert _extension_load_that_stops(signal.SIGINT)  # the block ends here: raise_if_stopped on leaving
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert stopping._look_again_timer is None
    _run_for(0.9)  # three times the look's delay: a stray look would raise KeyboardInterrupt here


def _trip_at_restore(monkeypatch, signum: int) -> None:
    """Run the stop's handler (as a look's timer or a signal taken by another thread does) as
    stop_on_signal's clean-up starts: the first bytecodes of ``_restore``."""
    import _thread

    real = stopping._restore

    def tripped(*args):
        _thread.interrupt_main(signum)
        real(*args)

    monkeypatch.setattr(stopping, "_restore", tripped)


@pytest.mark.parametrize("error", [ValueError("the block's own error"), SystemExit(3)], ids=["error", "exit"])
def test_a_look_at_the_clean_up_start_leaves_everything_restored(monkeypatch, error):
    """A block ended by another error while a stop is held, its look tripped as the clean-up
    starts: an Exception ends the block as the stop, from it (the handlers are ignoring stops
    by then), a SystemExit goes on as it is (the look lands in the clean-up's first bytecodes);
    either way the handlers, the unraisable hook and the stop's state are as before. Before:
    the look raised before the clean-up's first line, leaving SIGINT and SIGTERM ignored for
    good in a process that lives on."""
    before = {sig: signal.getsignal(sig) for sig in stopping._STOPS}
    hook = sys.unraisablehook
    _trip_at_restore(monkeypatch, signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt if isinstance(error, Exception) else SystemExit) as info, stop_on_signal():
        assert _extension_load_that_stops()
        raise error
    monkeypatch.undo()
    assert info.value is error or info.value.__cause__ is error
    assert {sig: signal.getsignal(sig) for sig in stopping._STOPS} == before
    assert sys.unraisablehook is hook and stopping._stopping is None and stopping._look_again_timer is None


def test_a_first_stop_during_the_clean_up_reaches_the_restored_handler(monkeypatch):
    """A block that ends normally, and a stop whose handler runs as the clean-up starts (in a
    process with other threads one of them may take the signal, where the clean-up's block of
    the stops does not reach): it is sent again once the handlers are restored, here SIGINT's
    (KeyboardInterrupt). Before: the clean-up dropped it."""
    _trip_at_restore(monkeypatch, signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), stop_on_signal():
        pass
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and stopping._late_stop is None


def test_a_poll_off_the_main_thread_leaves_the_held_stop_to_it():
    """``raise_if_stopped`` in another thread raises there and leaves the main thread's held stop
    and its look alone: the main thread is stopped soon after the load, not at the block's end."""
    import threading

    seen = []

    def poll():
        try:
            raise_if_stopped()
        except KeyboardInterrupt as exc:
            seen.append(str(exc))

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"), stop_on_signal():
        assert _extension_load_that_stops()
        t = threading.Thread(target=poll)
        t.start()
        t.join()
        _run_for(5)
    assert seen == ["SIGTERM"] and time.monotonic() - start < 2.5


PROGRAM = """\
import sys

from rtcompile.stopping import stop_on_signal


def main():
    try:
        with stop_on_signal():
            exec("import os, signal\\nos.kill(os.getpid(), signal.SIGTERM)\\nfor _ in range(100000):\\n    pass")
            return 0
    except KeyboardInterrupt:
        return 130


sys.exit(main())
"""

# the child unblocks SIGINT (an inherited mask would hide the ending by SIGINT) and becomes
# `python -m stopped_in_exec`: no preexec_fn in pytest's threaded worker
UNBLOCKED = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]); "
             "os.execv(sys.executable, [sys.executable, '-m', 'stopped_in_exec'])")


def test_a_handled_stop_inside_exec_exits_130_under_python_m(tmp_path):
    """CPython remembers a KeyboardInterrupt that left ``exec`` of a string and, under ``python
    -m``, ends the process by SIGINT at exit though the program handled it (-2)."""
    (tmp_path / "stopped_in_exec.py").write_text(PROGRAM)
    root = os.path.dirname(os.path.dirname(os.path.abspath(stopping.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), root])}
    p = subprocess.run([sys.executable, "-c", UNBLOCKED], cwd=tmp_path, capture_output=True, text=True, env=env,
                       timeout=60)
    assert p.returncode == 130, (p.returncode, p.stderr[-2000:])
    assert p.stderr == ""
