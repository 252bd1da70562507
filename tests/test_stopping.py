"""``rtcompile.stopping``: a stop (SIGINT, SIGTERM) that lands inside an import is raised once the
import is done, and a handled stop exits 130 also where it landed in code run by ``exec``.

Found by sending SIGTERM to ``rtcompile export`` at random moments (CPU, 2026-12-06): inside
``import onnx`` the process aborted (SIGABRT, nanobind's C++ terminate) or crashed (SIGSEGV), and
a stop landing in a dataclass's generated code (``exec`` of a string) ended the handled stop by
SIGINT (exit -2, CI's failure) instead of 130."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from rtcompile import stopping
from rtcompile.stopping import stop_on_signal

# a module whose body is interrupted: the stop's handler runs between its bytecodes
STOPS_WHILE_IMPORTED = """\
import os
import signal

os.kill(os.getpid(), signal.{sig})
for _ in range(100000):
    pass
DONE = True
"""


@pytest.fixture
def module_that_stops(tmp_path, monkeypatch):
    def make(name: str, sig: str = "SIGTERM") -> str:
        (tmp_path / f"{name}.py").write_text(STOPS_WHILE_IMPORTED.format(sig=sig))
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, name, raising=False)
        return name

    return make


def test_a_stop_inside_an_import_is_raised_after_it(module_that_stops):
    """The import completes (its module is in ``sys.modules`` with its last line run), and the
    stop is raised soon after, in the code that follows, not only when the block ends. Before:
    the KeyboardInterrupt left the module's body half run and the import failed."""
    name = module_that_stops("stops_while_imported")
    reached = []
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"), stop_on_signal():
        __import__(name)
        reached.append("imported")
        end = time.monotonic() + 5
        while time.monotonic() < end:  # the held stop is looked at again every DEFER_POLL_S
            time.sleep(0.005)
        reached.append("not stopped in 5 s")
    assert sys.modules[name].DONE is True
    assert reached == ["imported"]


def test_a_held_stop_never_fires_after_its_block(module_that_stops, monkeypatch):
    """The block ends (a stop) before the held stop's second look: the look is cancelled, so the
    handler restored after the block (SIGINT's: raise KeyboardInterrupt) is never tripped later,
    in a process that lives on."""
    monkeypatch.setattr(stopping, "DEFER_POLL_S", 0.3)
    name = module_that_stops("interrupts_while_imported", "SIGINT")
    with pytest.raises(KeyboardInterrupt, match="SIGINT"), stop_on_signal():
        __import__(name)  # the block ends here, at once: raise_if_stopped on leaving
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    end = time.monotonic() + 0.9  # three times the look's delay
    while time.monotonic() < end:
        time.sleep(0.005)
    assert stopping._look_again_timer is None


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


def test_a_handled_stop_inside_exec_exits_130_under_python_m(tmp_path):
    """CPython remembers a KeyboardInterrupt that left ``exec`` of a string and, under ``python
    -m``, ends the process by SIGINT at exit though the program handled it (-2). SIGINT is
    unblocked in the child, so that ending would show here."""
    (tmp_path / "stopped_in_exec.py").write_text(PROGRAM)
    env_path = f"{tmp_path}:{stopping.__file__.rsplit('/rtcompile/', 1)[0]}"
    p = subprocess.run([sys.executable, "-m", "stopped_in_exec"], cwd=tmp_path, capture_output=True, text=True,
                       env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}, timeout=60,
                       preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]))
    assert p.returncode == 130, (p.returncode, p.stderr[-2000:])
    assert p.stderr == ""
