"""``rtcompile.stopping``: a stop (SIGINT, SIGTERM) that lands while an extension module loads is
raised once the load is done, and a handled stop exits 130 also where it landed in code run by
``exec``.

Found by sending SIGTERM to ``rtcompile export`` at random moments (CPU, 2026-12-06): inside
``import onnx`` (a nanobind module calling back into Python) the process aborted (SIGABRT, C++
terminate) or crashed (SIGSEGV), and a stop landing in a dataclass's generated code ended the
handled stop by SIGINT (exit -2, CI's failure) instead of 130."""

from __future__ import annotations

import _imp
import importlib._bootstrap
import os
import signal
import subprocess
import sys
import time

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


def test_a_stop_inside_a_python_module_body_is_raised_there(tmp_path, monkeypatch):
    """A Python module's body is interrupted as any code: a hung or long import still stops."""
    (tmp_path / "long_import.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(0.01)\nfor _ in range(1000):\n"
        "    time.sleep(0.005)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "long_import", raising=False)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"), stop_on_signal():
        import long_import  # noqa: F401
    assert time.monotonic() - start < 2.5  # the body alone runs 5 s
    assert "long_import" not in sys.modules


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


@pytest.mark.parametrize("second_stop", [False, True], ids=["block-ends", "stop-in-restore"])
def test_a_held_stop_never_fires_after_its_block(monkeypatch, second_stop):
    """The block ends (a stop) before the held stop's next look: the look is cancelled, so the
    handler restored after the block (SIGINT's: raise KeyboardInterrupt) is never tripped later,
    in a process that lives on. With ``stop-in-restore`` a second stop lands as the clean-up
    that restores the handlers cancels the look (the window the review found: raised there, it
    left the look armed)."""
    monkeypatch.setattr(stopping, "DEFER_POLL_S", 0.3)
    if second_stop:
        import _thread

        real = stopping._cancel_look_again

        def stopped_first():
            if sys._getframe(1).f_code.co_name == "_restore":
                _thread.interrupt_main(signal.SIGINT)  # runs the handler at the next bytecodes
            real()

        monkeypatch.setattr(stopping, "_cancel_look_again", stopped_first)
    with pytest.raises(KeyboardInterrupt, match="SIGINT"), stop_on_signal():
        assert _extension_load_that_stops(signal.SIGINT)  # the block ends here: raise_if_stopped on leaving
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert stopping._look_again_timer is None
    _run_for(0.9)  # three times the look's delay: a stray look would raise KeyboardInterrupt here


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
