"""A study's key and its winner: a changed search space is a new study, and the winner is a
config today's checks accept (the study's own measurements may predate them)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import interpreter_only

from rtcompile.kernels import tuned
from rtcompile.kernels.chunk_resident import ResidentConfig
from rtcompile.kernels.config import KernelShape
from rtcompile.tuning import Bucket, TuneOptions, search_space
from rtcompile.tuning import study as study_mod
from rtcompile.tuning.keys import Machine, key_attrs
from rtcompile.tuning.space import config_params

# the Triton kernels' device: a GPU where there is one, else the CPU through the interpreter
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TINY = Bucket("chunk", (2, 4), 8, 1, 1, 32, "float32")
TINY_SHAPE = KernelShape(TINY.key_widths, TINY.value_width, 4)


@pytest.fixture(autouse=True)
def isolated(tuning_cache):
    """A private cache for every test (conftest's ``tuning_cache``)."""


def test_a_changed_search_space_is_a_new_study(monkeypatch):
    """Before: the study's name hashed the kernel files only, so a space whose choices changed
    (a new value, a dropped one) reopened the old study and every worker died on Optuna's
    "CategoricalDistribution does not support dynamic value space"."""
    machine, source = Machine.current("cpu"), tuned.source_hash("chunk")
    opts = TuneOptions()
    name = study_mod._study_name(TINY, machine, source, opts)
    assert study_mod._study_name(TINY, machine, source, opts) == name  # stable
    space = search_space(TINY, opts)
    changed = {form: {n: list(c) for n, c in fields.items()} for form, fields in space.items()}
    changed["resident"]["num_warps"] = changed["resident"]["num_warps"][:-1]
    monkeypatch.setattr(study_mod, "search_space", lambda bucket, o: changed)
    assert study_mod._study_name(TINY, machine, source, opts) != name
    assert study_mod._study_name(TINY, machine, source, opts).startswith(name.rsplit(":space ", 1)[0])


def _study_with(trials):
    """An in-memory study keyed for TINY holding COMPLETE trials (config, seconds)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    machine, source = Machine.current("cpu"), tuned.source_hash("chunk")
    study = optuna.create_study(study_name=study_mod._study_name(TINY, machine, source, TuneOptions()))
    for k, v in key_attrs(TINY, machine, source).items():
        study.set_user_attr(k, v)
    for cfg, seconds in trials:
        params = config_params(cfg)
        dists = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()}
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=seconds))
    return study, machine, source


def test_the_finish_without_remeasuring_never_records_a_refused_config(tmp_path):
    """A study measured before a check tightened (a resumed, stale study; ``--seconds``, which
    takes the study's own measurements) holds a fast config today's check refuses: the winner
    is the fastest one it accepts. Before: the refused one was recorded and written."""
    refused = ResidentConfig(chunk_size=128, block_v=16, solve="products")
    ok = ResidentConfig(chunk_size=16, block_v=16)
    assert refused.check(TINY_SHAPE) is not None and ok.check(TINY_SHAPE) is None
    study, machine, source = _study_with([(refused, 1e-4), (ok, 2e-4)])
    table = tmp_path / "tuned.json"
    opts = TuneOptions(table=str(table))
    assert study_mod._finish(study, None, TINY, machine, source, opts, remeasure=False)
    assert study.user_attrs["best_variant"] == ok.to_dict()
    (entry,) = json.loads(table.read_text())["entries"]
    assert entry["variant"] == ok.to_dict() and entry["seconds"] == 2e-4


def test_the_finish_records_nothing_when_every_config_is_refused(tmp_path):
    study, machine, source = _study_with([(ResidentConfig(chunk_size=128, block_v=16, solve="products"), 1e-4)])
    opts = TuneOptions(table=str(tmp_path / "tuned.json"))
    assert not study_mod._finish(study, None, TINY, machine, source, opts, remeasure=False)
    assert "best_variant" not in study.user_attrs and not (tmp_path / "tuned.json").exists()


SPEC = ('order = 3\nkey_widths = [2, 4]\nvalue_width = 8\nheads = 1\nmodel_width = 16\n'
        'input_dtype = "float32"\n')


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_a_stopped_tune_leaves_no_process_and_says_one_line(tmp_path, monkeypatch, how):
    """SIGTERM to the coordinator, or Ctrl-C (SIGINT to the whole process group), inside a
    trial: the tune exits 130 with one stderr line, and its workers and trial processes end
    with it. Before: SIGTERM orphaned them (they tuned on to the budget's end), and Ctrl-C
    printed a KeyboardInterrupt traceback from every process."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from rtcompile.tuning import open_storage
    from rtcompile.tuning.claims import process_alive

    started, pids = tmp_path / "started.log", tmp_path / "pids.log"
    monkeypatch.setenv("RTCOMPILE_TEST_STARTED", str(started))
    monkeypatch.setenv("RTCOMPILE_TEST_PIDS", str(pids))
    spec = tmp_path / "tiny.toml"
    spec.write_text(SPEC)
    url = f"sqlite:///{tmp_path / 's.db'}"
    argv = [str(spec), "--phase", "prefill", "--workers", "2", "--storage", url, "--trials", "20",
            "--fix", "resident.chunk_size=16", "--impl", "tuning_impls:slow"]
    proc = subprocess.Popen([sys.executable, "-m", "rtcompile.cli", "tune", *argv], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None and not (started.exists() and started.read_text().split()):
        time.sleep(0.1)
    assert proc.poll() is None, "the tune ended before the signal: nothing was tested"
    import optuna

    storage = open_storage(url)
    (summary,) = optuna.get_all_study_summaries(storage, False)
    trials = optuna.load_study(study_name=summary.study_name, storage=storage).get_trials(deepcopy=False)
    workers = {t.user_attrs["pid"] for t in trials if "pid" in t.user_attrs}
    if how == "sigterm":
        os.kill(proc.pid, signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if "trials run" not in ln]  # progress: stderr is no terminal
    assert len(lines) == 1 and "interrupted" in lines[0], err
    children = workers | {int(p) for p in pids.read_text().split()}
    assert workers and len(children) > len(workers)
    end = time.time() + 10
    while time.time() < end and any(process_alive(p) for p in children):
        time.sleep(0.1)
    assert not [p for p in children if process_alive(p)], "a worker or trial process outlived the tune"


def test_an_error_after_the_cpu_notice_is_exactly_one_stderr_line(tmp_path, monkeypatch, capsys):
    """The no-GPU notice goes to stdout with the results: a late error (here the store
    refusing the study mid-run) stays one stderr line. Before: the notice came first on stderr."""
    from rtcompile import tune_cmd
    from rtcompile.cli import main
    from rtcompile.tuning import StoreError

    def refused(*args, **kwargs):
        raise StoreError("storage 'x': refused mid-run")

    monkeypatch.setattr(tune_cmd, "_tune_all", refused)
    spec = tmp_path / "tiny.toml"
    spec.write_text(SPEC)
    assert main(["tune", str(spec), "--phase", "prefill", "--storage", f"sqlite:///{tmp_path / 'n.db'}"]) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == ["rtcompile tune: error: storage 'x': refused mid-run"], err
    assert "no CUDA GPU" in out


def _gate(bucket, impl: str, variant=None, device: str = "cpu") -> dict:
    from dataclasses import asdict

    from rtcompile.tuning.objective import evaluate

    return evaluate({"bucket": asdict(bucket), "variant": variant, "device": device, "seed": 3, "check_seed": 1,
                     "repeats": 1, "impl": impl})


# one sequence of 4096 tokens in bf16: one zeroed token row moves the global relative RMS
# error by about 1/sqrt(4096) = 1.6e-2, inside bf16's 2e-2
LONG_BF16 = Bucket("chunk", (2, 4), 8, 1, 1, 4096, "bfloat16")


def test_the_gate_refuses_an_output_with_one_zeroed_token_row():
    """Before: a kernel that zeroed one output row per sequence at T 4096 passed the gate
    (bf16 global relative RMS ~1.6e-2 against 2e-2); the per-token check refuses it, while the
    correctly rounded output (the float64 result in bf16) passes."""
    ok = _gate(LONG_BF16, "tuning_impls:rounded_reference")
    assert ok["status"] == "ok", ok
    bad = _gate(LONG_BF16, "tuning_impls:zeroed_row")
    assert bad["status"] == "rejected", bad
    assert bad["error"] <= 2e-2  # the global check alone passes it
    assert "token" in bad["reason"] and "t=2048" in bad["reason"] and "against float64" in bad["reason"], bad


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_real_kernels_pass_the_per_token_check(dtype):
    """The row tolerance leaves the kernels' own rounding room (objective.ROW_TOLERANCE)."""
    for bucket in (Bucket("chunk", (4, 4), 32, 2, 1, 256, dtype), Bucket("recurrent", (16,), 16, 2, 8, 1, dtype)):
        r = _gate(bucket, "rtcompile.tuning.objective:run_kernel", device=DEVICE)
        assert r["status"] == "ok", (bucket.label, r)


@interpreter_only  # its trials run the real kernels on the CPU (TuneOptions' device)
def test_resume_runs_n_more_trials(tmp_path):
    """``--resume --trials N`` on a finished study runs N more trials. Before: N counted the
    study's total, so a study of 2 resumed with 1 ran none."""
    from rtcompile.tuning import tune_bucket

    url = f"sqlite:///{tmp_path / 'resume.db'}"
    fixed = {"form": "resident", "resident.chunk_size": 16}
    first = tune_bucket(TINY, TuneOptions(storage=url, trials=2, repeats=1, top_k=1, fixed=fixed))
    assert first.trials_run == 2 and first.trials_total == 2
    more = tune_bucket(TINY, TuneOptions(storage=url, trials=1, repeats=1, top_k=1, fixed=fixed, resume=True))
    assert more.trials_run == 1 and more.trials_total == 3 and more.best_variant is not None


def test_a_stop_handled_in_process_restores_the_handlers_and_the_pool_log_level():
    """``rtcompile.cli.main`` may run in a process that lives on after an interrupted tune: the
    signal handlers and the SQLAlchemy pool log level the stop changed come back as they were."""
    import logging
    import os
    import signal

    from rtcompile.tuning.processes import stop_on_signal

    pool = logging.getLogger("sqlalchemy.pool")
    pool.setLevel(logging.WARNING)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), stop_on_signal():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # the handler runs between bytecodes of the main thread
            pass
    assert pool.level == logging.WARNING
    assert signal.getsignal(signal.SIGTERM) is before


class _StopsInItsFinalizer:
    def __del__(self):
        import os
        import signal

        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs here, between bytecodes, inside __del__
            pass


def _swallow_a_stop() -> None:
    """SIGTERM to this process inside a finalizer: Python reports the handler's
    KeyboardInterrupt as unraisable and goes on (the stop is lost but for stop_on_signal's flag)."""
    import gc

    _StopsInItsFinalizer()  # dropped at once: its __del__ runs
    gc.collect()


def test_a_stop_swallowed_by_a_finalizer_still_stops_quietly(capfd):
    """SIGTERM landing inside a finalizer: Python swallows the handler's KeyboardInterrupt
    ("Exception ignored in ...", CI on 2026-12-05 inside SQLAlchemy's ``InstanceState._cleanup``)
    and the coordinator tuned on past the stop. ``raise_if_stopped`` (every waiting loop's poll)
    raises it again, leaving the block raises it too, and the swallowed one prints nothing."""
    from rtcompile.tuning.processes import raise_if_stopped, stop_on_signal

    with stop_on_signal():
        raise_if_stopped()  # no stop yet: nothing raised
    for leave_by in ("poll", "block end"):
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"), stop_on_signal():
            _swallow_a_stop()  # without the flag the block would end normally here
            if leave_by == "poll":
                raise_if_stopped()
        with stop_on_signal():  # a new block starts unstopped
            raise_if_stopped()
    assert "Exception ignored" not in capfd.readouterr().err


def test_workers_ended_by_a_swallowed_stop_end_the_wait_as_a_stop():
    """Ctrl-C to the process group: the workers exit 130, and the coordinator's own interrupt
    was swallowed by a finalizer. The wait ends in KeyboardInterrupt (the CLI's one line), not
    in "tuning workers exited with [130]" (a RuntimeError traceback)."""
    import subprocess

    from rtcompile.tuning.processes import stop_on_signal

    worker = subprocess.Popen(["sh", "-c", "exit 130"])
    worker.wait()
    with pytest.raises(KeyboardInterrupt), stop_on_signal():
        _swallow_a_stop()
        study_mod._wait_workers(None, None, "sqlite://", "n", None, None, [worker], lambda: None)


def test_other_unraisable_exceptions_reach_the_hook_that_was_set(monkeypatch):
    """Inside ``stop_on_signal`` only a stop's swallowed KeyboardInterrupt is silenced: any
    other finalizer error still reaches the hook installed before (an app's, pytest's)."""
    import sys

    from rtcompile.tuning.processes import stop_on_signal

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_type))

    class FailsInItsFinalizer:
        def __del__(self):
            raise ValueError("finalizer")

    with stop_on_signal():
        FailsInItsFinalizer()
    assert seen == [ValueError] and sys.unraisablehook is not None
    assert sys.unraisablehook.__name__ == "<lambda>"  # restored on leaving


def test_a_stop_raised_from_the_clean_up_still_restores_everything(monkeypatch):
    """A stop whose handler runs inside the clean-up's own signal-blocking call (CPython runs
    pending handlers there) raised out of it and left SIGTERM ignored, the hook and the flag
    set, and the stops blocked, in a process that lives on. Simulated: the blocking call raises
    KeyboardInterrupt after blocking."""
    import signal
    import sys

    from rtcompile.tuning import processes

    real = signal.pthread_sigmask
    mask = real(signal.SIG_BLOCK, ())
    before, hook = signal.getsignal(signal.SIGTERM), sys.unraisablehook

    def blocks_then_raises(how, sigs):
        out = real(how, sigs)
        if how == signal.SIG_BLOCK and tuple(sigs) == processes._STOPS:
            raise KeyboardInterrupt("SIGTERM")
        return out

    monkeypatch.setattr(processes.signal, "pthread_sigmask", blocks_then_raises)
    with pytest.raises(KeyboardInterrupt), processes.stop_on_signal():
        pass
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGTERM) is before and sys.unraisablehook is hook
    assert processes._stopping is None and real(signal.SIG_BLOCK, ()) == mask


def test_a_hook_left_behind_is_not_taken_for_the_outer_one(monkeypatch):
    """Were our own hook left installed (an interrupted clean-up), the next block would take it
    as the hook to pass other errors to, and a finalizer error would recurse without end."""
    import sys

    from rtcompile.tuning import processes

    monkeypatch.setattr(sys, "unraisablehook", processes._quiet_unraisable)
    seen = []
    monkeypatch.setattr(sys, "__unraisablehook__", lambda u: seen.append(u.exc_type))

    class FailsInItsFinalizer:
        def __del__(self):
            raise ValueError("finalizer")

    with processes.stop_on_signal():
        FailsInItsFinalizer()
    assert seen == [ValueError]


def test_a_stop_while_workers_start_ends_those_already_started(monkeypatch):
    """SIGTERM while ``spawn_workers`` is still starting workers: the ones started are ended by
    ``_run_workers``' clean-up (a list returned only at the end left them running)."""
    import os
    import signal
    import subprocess
    import threading
    import time

    from rtcompile.tuning.processes import stop_on_signal

    started = []

    def slow_spawn(url, name, bucket, opts, deadline, procs):
        for _ in range(4):  # stands in for four worker starts, each a fresh Python
            procs.append(subprocess.Popen(["sleep", "60"]))
            started.append(procs[-1])
            time.sleep(0.2)

    monkeypatch.setattr(study_mod, "spawn_workers", slow_spawn)
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt), stop_on_signal():
            study_mod._run_workers(None, None, "sqlite://", "n", None, None, None, lambda: None)
    finally:
        timer.cancel()
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()
                pytest.fail(f"worker {p.pid} outlived the stop")
    assert 1 <= len(started) < 4
