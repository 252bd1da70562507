"""The tune's processes: starting the workers, and stopping them with their trial processes.

A stopped tune (Ctrl-C, SIGTERM, an error) leaves no process behind: the coordinator's
``study._run_workers`` ends its workers (:func:`stop_workers`), a worker's SIGTERM stops its
trial process through its context managers (:func:`stop_on_signal`, from
:mod:`rtcompile.stopping`, which every CLI command holds), and under Ctrl-C (the whole process
group) each process exits quietly, leaving the one line to the CLI.
"""

from __future__ import annotations

import json
import os
import signal  # noqa: F401 -- tests patch processes.signal's functions, as they did before the move
import subprocess
import sys
import time
from dataclasses import asdict

from .. import stopping
from ..stopping import raise_if_stopped, stop_on_signal  # noqa: F401 -- the tune's names for them, as before


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


# How often the tune's waiting loops look for a stop that was swallowed (raise_if_stopped)
STOP_POLL_S = 0.5


# the stop handling's internals, which lived here before rtcompile.stopping took them (the tests
# of the tune's stops read them through this module)
_FROM_STOPPING = ("_STOPS", "_held", "_ignore", "_interrupt", "_outer_hook", "_quiet_unraisable", "_stopping")


def __getattr__(name: str):
    """The stop handling's internals as :mod:`rtcompile.stopping` holds them now (its state too:
    not a copy taken at import)."""
    if name in _FROM_STOPPING:
        return getattr(stopping, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
