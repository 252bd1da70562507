"""Tuning that recovers by itself (issue 20): a killed run followed by a plain rerun (no flag)
finishes the budget and writes the table; a corrupt or deleted tuned table is rebuilt from the
store; ``--retune`` never kills a running tune with a traceback; a time budget holds; the
tuner's messages agree with the store. On the CPU: trials run the Triton interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rtcompile.cli import main
from rtcompile.kernels import tuned
from rtcompile.tuning import StoreError, open_storage
from rtcompile.tuning.store import retried_numbers, retry_callback

SPEC = ('order = 3\nkey_widths = [2, 4]\nvalue_width = 8\nheads = 1\nmodel_width = 16\n'
        'input_dtype = "float32"\n')


@pytest.fixture(autouse=True)
def isolated(tuning_cache):
    """A private cache for every test (conftest's ``tuning_cache``)."""


def _study(url):
    import optuna

    storage = open_storage(url)
    names = [s.study_name for s in optuna.get_all_study_summaries(storage, False)]
    return optuna.load_study(study_name=names[0], storage=storage) if names else None


def _trials(url):
    try:
        study = _study(url)
    except (ValueError, StoreError):
        return []
    return study.get_trials(deepcopy=False) if study is not None else []


def _spec(tmp_path):
    spec = tmp_path / "tiny.toml"
    spec.write_text(SPEC)
    return spec


def _tune_argv(tmp_path, url, *extra):
    return [str(_spec(tmp_path)), "--phase", "prefill", "--workers", "1", "--storage", url,
            "--fix", "resident.chunk_size=16", *extra]


def _kill_mid_trial(argv, url, started, env=None):
    """Start ``rtcompile tune ARGV`` (the slow kernel), kill -9 its whole process group inside a
    timed trial once one trial has finished; returns the trials the store then holds."""
    proc = subprocess.Popen([sys.executable, "-m", "rtcompile.cli", "tune", *argv], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 120
    finished = []
    while time.time() < deadline and proc.poll() is None:
        finished = [t for t in _trials(url) if t.state.name == "COMPLETE"]
        starts = started.read_text().split() if started.exists() else []
        if finished and starts and time.time() - float(starts[-1]) < 0.5:
            break
        time.sleep(0.05)
    assert proc.poll() is None and finished, "the study finished (or never started) before the kill"
    os.killpg(proc.pid, signal.SIGKILL)  # coordinator, worker and trial process at once
    proc.wait()
    return _trials(url)


@pytest.mark.parametrize("store, budget", [("sqlite", "trials"), ("journal", "trials"), ("sqlite", "seconds")])
def test_killed_tune_then_a_plain_rerun_finishes_the_budget(tmp_path, monkeypatch, capsys, store, budget):
    """kill -9 of a tuning run, then the same command again, no flag: the killed run's trials
    are failed at once (their worker is gone) and retried, nothing stays RUNNING, the budget
    runs and the table is written. Before: the rerun left them RUNNING (journal: for twice the
    trial timeout; seconds mode: for good) and marked the study tuned."""
    url = f"sqlite:///{tmp_path / 'killed.db'}" if store == "sqlite" else f"journal:{tmp_path / 'killed.log'}"
    started = tmp_path / "started.log"
    monkeypatch.setenv("RTCOMPILE_TEST_STARTED", str(started))
    argv = _tune_argv(tmp_path, url, *(["--trials", "4"] if budget == "trials" else ["--seconds", "8"]))
    # seconds: the killed run had a long budget (it must not end before the kill)
    killed = _tune_argv(tmp_path, url, "--seconds", "120") if budget == "seconds" else argv
    left = _kill_mid_trial([*killed, "--impl", "tuning_impls:slow"], url, started)
    assert any(t.state.name == "RUNNING" for t in left), "the kill left no RUNNING trial: nothing was tested"
    assert not tuned.entries()
    assert main(["tune", *argv]) == 0  # no --resume: the user need not know the flag
    assert "already tuned" not in capsys.readouterr().out
    trials = _trials(url)
    assert not [t for t in trials if t.state.name == "RUNNING"], "a killed run's trial is still RUNNING"
    stale = retried_numbers(trials)
    assert stale, "the killed trial was not failed and retried"
    if budget == "trials":
        assert not [t for t in trials if t.state.name == "WAITING"]
        counted = [t for t in trials if t.number not in stale and t.user_attrs.get("status") != "pruned"]
        assert len(counted) == 4 and all(t.state.name in ("COMPLETE", "FAIL") for t in counted)
    assert tuned.entries(), "the rerun recorded no winner"
    # and a third run has nothing left to do
    assert main(["tune", *argv]) == 0
    assert "already tuned" in capsys.readouterr().out


def test_a_retry_is_nobodys_until_claimed():
    """The retry of a failed trial keeps its parameters and other attributes but not its dead
    worker's host and pid: with them, a rerun's recovery saw the retry's live claimer as gone
    (its pid not yet recorded) and failed its trial under it (a flaky kill-and-rerun test)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    trial = study.ask({"x": optuna.distributions.IntDistribution(0, 9)})
    for key, value in (("host", "worker-host"), ("pid", 1), ("status", "timed")):
        trial.set_user_attr(key, value)
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    retry_callback()(study, study.trials[0])
    retry = study.trials[1]
    assert retry.state == optuna.trial.TrialState.WAITING and retry.params == study.trials[0].params
    assert retry.user_attrs == {"status": "timed"}
    assert retried_numbers(study.trials) == {0}
    assert study.trials[0].user_attrs["pid"] == 1  # the failed trial itself keeps its record


def _table(path=None):
    return json.loads((path or tuned.table_path()).read_text())


def test_a_corrupt_or_deleted_table_is_rebuilt_from_the_store(tmp_path, capsys):
    """Before: tune ran its trials, marked the study tuned, then exited 2 on the corrupt table;
    after the table was deleted, reruns said "already tuned" and never wrote the winner."""
    url = f"sqlite:///{tmp_path / 't.db'}"
    argv = _tune_argv(tmp_path, url, "--trials", "2")
    path = tuned.table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    assert main(["tune", *argv]) == 0
    err = capsys.readouterr().err
    assert "unreadable" in err and "rebuilt from the tuning store" in err
    (entry,) = _table()["entries"]
    study = _study(url)
    assert entry["variant"] == study.user_attrs["best_variant"] and entry["study"] == study.study_name
    path.unlink()
    assert main(["tune", *argv]) == 0
    assert "rewritten from the store" in capsys.readouterr().out
    assert _table()["entries"] == [entry]
    # garbage again, now with the study tuned: rebuilt before anything else, nothing re-run
    path.write_text("\x00garbage")
    assert main(["tune", *argv]) == 0
    assert _table()["entries"] == [entry] and len(_trials(url)) == len(study.get_trials())


_TWO_CALLS = """
import torch
from rtcompile import running_tensor
q, k, v = [torch.randn(1, 20, 1, 4)], [torch.randn(1, 20, 1, 4)], torch.randn(1, 20, 1, 4)
o1, _ = running_tensor(q, k, v, mode="chunk", backend="triton")  # unpinned: consults the table
o2, _ = running_tensor(q, k, v, mode="chunk", backend="triton")
assert torch.equal(o1, o2) and torch.isfinite(o1).all()
print("ok")
"""


def test_an_old_format_table_is_ignored_by_kernel_calls_and_rebuilt_by_tune(tmp_path, capsys):
    """Before: a format-1 table made every kernel call without a pinned config raise."""
    path = tuned.table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": 1, "entries": [{"kernel": "chunk", "variant": {"chunk_size": 32}}]}))
    run = subprocess.run([sys.executable, "-c", _TWO_CALLS], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
    warned = [ln for ln in run.stderr.splitlines() if "tuned-config table" in ln]
    assert len(warned) == 1 and "format 1" in warned[0] and "default configs" in warned[0], run.stderr
    url = f"sqlite:///{tmp_path / 'old.db'}"
    assert main(["tune", *_tune_argv(tmp_path, url, "--trials", "1")]) == 0
    err = capsys.readouterr().err
    assert "format 1" in err and "rebuilt from the tuning store" in err
    assert _table()["format"] == tuned.FORMAT_VERSION and len(_table()["entries"]) == 1


def test_retune_while_another_tune_runs_is_refused_and_the_running_one_finishes(tmp_path, monkeypatch, capsys):
    """Before: the --retune deleted the study under the running tune, which died with a
    ``KeyError: 'Record does not exist.'`` traceback."""
    url = f"sqlite:///{tmp_path / 'r.db'}"
    started = tmp_path / "started.log"
    monkeypatch.setenv("RTCOMPILE_TEST_STARTED", str(started))
    argv = _tune_argv(tmp_path, url, "--trials", "2")
    proc = subprocess.Popen([sys.executable, "-m", "rtcompile.cli", "tune", *argv, "--impl", "tuning_impls:slow"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (started.exists() and started.read_text().split()):
        time.sleep(0.1)
    assert proc.poll() is None, "the first tune finished before the --retune: nothing was tested"
    assert main(["tune", *argv, "--retune"]) == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("rtcompile")]
    assert "--retune" in line and "another `rtcompile tune`" in line and "Traceback" not in err, err
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr
    assert tuned.reload() and "best_variant" in _study(url).user_attrs


def test_a_time_budget_holds(tmp_path):
    """``--seconds S`` for the whole command (two buckets, prefill and decode: trials, the
    studies, the workers' imports and compiles, the finish) ends within 10% + one trial's
    duration. Before: --seconds 20 took 61 s (the budget was per bucket, and the finish
    re-measured four variants after it)."""
    url = f"sqlite:///{tmp_path / 'sec.db'}"
    budget = 20.0
    # what the command cannot budget: the interpreter's start before its clock and, after its
    # end, the teardown of the libraries it loaded; timed here on the same machine, now, as a
    # process's wall time less its own imports (~0.65 s idle; the test had failed by 0.06 and
    # 0.10 s with another pytest worker on the 2 cores)
    t0 = time.time()
    imports = subprocess.run([sys.executable, "-c", "import time; t = time.time(); import torch, triton, optuna, "
                              "rtcompile.cli; print(time.time() - t)"], check=True, timeout=300, capture_output=True,
                             text=True).stdout
    unbudgeted = time.time() - t0 - float(imports)
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "rtcompile.cli", "tune", str(_spec(tmp_path)), "--seconds", str(budget),
                    "--storage", url], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    took = time.time() - t0
    import optuna

    storage = open_storage(url)
    trials = [t for s in optuna.get_all_study_summaries(storage, False)
              for t in optuna.load_study(study_name=s.study_name, storage=storage).get_trials(deepcopy=False)]
    done = [t for t in trials if t.datetime_complete is not None and t.datetime_start is not None]
    assert len({t.number for t in done}) >= 2, "too few trials ran for the budget to mean anything"
    longest = max((t.datetime_complete - t.datetime_start).total_seconds() for t in done)
    assert took <= 1.1 * budget + longest + unbudgeted, (took, longest, unbudgeted)


def test_messages_agree_with_the_store(tmp_path, capsys):
    """The table's "trials run" is what `tune --list` shows and the store holds; a resumed study
    with a smaller budget never shows more done than its total; study names carry no
    "cpu-interpreter cccpu"; --list names the store; stderr that is not a terminal gets one
    line per finished trial (no progress bar)."""
    url = f"sqlite:///{tmp_path / 'm.db'}"
    argv = _tune_argv(tmp_path, url)
    assert main(["tune", *argv, "--trials", "3"]) == 0
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if "trials run" in ln]
    assert [ln.split(": ")[1].split()[0] for ln in lines] == ["1/3", "2/3", "3/3"], err
    assert "━" not in err  # no bar drawn into a file
    study = _study(url)
    assert "cccpu" not in study.study_name and ":cpu-interpreter:" in study.study_name
    ran = len([t for t in study.get_trials() if t.state.name in ("COMPLETE", "FAIL")])
    row = next(ln for ln in out.splitlines() if "chunk o3" in ln)
    assert row.split("│")[2].strip() == str(ran) == "3"
    assert main(["tune", "--list", "--storage", url]) == 0
    listed = capsys.readouterr().out
    assert f"tuning store: {url}" in listed.replace("\n", "")
    lrow = next(ln for ln in listed.splitlines() if "chunk o3" in ln)
    assert lrow.split("│")[2].strip() == str(ran)
    assert main(["tune", *argv, "--trials", "1", "--resume"]) == 0
    err = capsys.readouterr().err
    for ln in (ln for ln in err.splitlines() if "trials run" in ln):
        done, total = map(int, ln.split(": ")[1].split()[0].split("/"))
        assert done <= total, ln


def test_a_study_deleted_under_a_running_tune_stops_it_with_one_line(tmp_path, monkeypatch):
    """What a --retune from another host (which cannot see this host's processes) would do:
    the running tune stops with one line, exit 2, no traceback from it or its workers."""
    import optuna

    url = f"sqlite:///{tmp_path / 'd.db'}"
    started = tmp_path / "started.log"
    monkeypatch.setenv("RTCOMPILE_TEST_STARTED", str(started))
    argv = _tune_argv(tmp_path, url, "--trials", "3")
    proc = subprocess.Popen([sys.executable, "-m", "rtcompile.cli", "tune", *argv, "--impl", "tuning_impls:slow"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (started.exists() and started.read_text().split()):
        time.sleep(0.1)
    assert proc.poll() is None, "the tune finished before the deletion: nothing was tested"
    optuna.delete_study(study_name=_study(url).study_name, storage=open_storage(url))
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in stderr, stderr
    (line,) = [ln for ln in stderr.splitlines() if ln.startswith("rtcompile")]
    assert "was deleted while it ran" in line
