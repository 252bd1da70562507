"""TuneOptions (public through rtcompile.tuning) checks its fields on construction: trials=0
and trials=-2 each ran one trial through tune_bucket before."""

from __future__ import annotations

import dataclasses
import math

import pytest

from rtcompile.tuning import TuneOptions

BAD = [
    ("trials-zero", dict(trials=0), ValueError, "trials"),
    ("trials-negative", dict(trials=-2), ValueError, "trials"),
    ("trials-float", dict(trials=2.0), TypeError, "trials"),
    ("trials-bool", dict(trials=True), TypeError, "trials"),
    ("seconds-zero", dict(trials=None, seconds=0.0), ValueError, "seconds"),
    ("seconds-inf", dict(trials=None, seconds=math.inf), ValueError, "seconds"),
    ("seconds-nan", dict(trials=None, seconds=math.nan), ValueError, "seconds"),
    ("seconds-text", dict(trials=None, seconds="60"), TypeError, "seconds"),
    ("both-budgets", dict(trials=5, seconds=60.0), ValueError, "exactly one"),
    ("no-budget", dict(trials=None), ValueError, "exactly one"),
    ("exhaustive-with-seconds", dict(trials=None, seconds=60.0, exhaustive=True), ValueError, "seconds"),
    ("workers-zero", dict(workers=0), ValueError, "workers"),
    ("workers-float", dict(workers=1.5), TypeError, "workers"),
    ("repeats-zero", dict(repeats=0), ValueError, "repeats"),
    ("trial-timeout-zero", dict(trial_timeout=0), ValueError, "trial_timeout"),
    ("trial-timeout-inf", dict(trial_timeout=math.inf), ValueError, "trial_timeout"),
    ("top-k-zero", dict(top_k=0), ValueError, "top_k"),
    ("device-gpu", dict(device="gpu"), ValueError, "device"),
    ("device-none", dict(device=None), TypeError, "device"),
    ("seed-negative", dict(seed=-1), ValueError, "seed"),
    ("seed-float", dict(seed=1.0), TypeError, "seed"),
    ("resume-text", dict(resume="yes"), TypeError, "resume"),
    ("retune-int", dict(retune=1), TypeError, "retune"),
    ("exhaustive-none", dict(exhaustive=None), TypeError, "exhaustive"),
    ("resume-and-retune", dict(resume=True, retune=True), ValueError, "retune"),
    ("fixed-list", dict(fixed=[("form", "split")]), TypeError, "fixed"),
    ("storage-path-object", dict(storage=b"sqlite:///x.db"), TypeError, "storage"),
    ("storage-sqlite-memory", dict(storage="sqlite://"), ValueError, "in-memory"),
    ("storage-sqlite-memory-file", dict(storage="sqlite:///:memory:"), ValueError, "in-memory"),
    ("storage-sqlite-driver-memory", dict(storage="sqlite+pysqlite://"), ValueError, "in-memory"),
]


@pytest.mark.parametrize("kwargs,error,named", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_tune_options_refuse_bad_fields(kwargs, error, named):
    with pytest.raises(error, match=named):
        TuneOptions(**kwargs)


def test_replace_checks_too_and_good_options_pass():
    good = TuneOptions(storage="sqlite:///tune.db", trials=None, seconds=30.0, workers=2, device="cuda", repeats=1,
                       fixed={"form": "split"})
    assert TuneOptions(trials=None, exhaustive=True).exhaustive and TuneOptions(exhaustive=True).trials == 20
    with pytest.raises(ValueError, match="workers"):
        dataclasses.replace(good, workers=0)
    assert TuneOptions(**dataclasses.asdict(good)) == good  # as a worker process rebuilds them


@pytest.mark.parametrize("option", ["--timeout", "--seconds"])
def test_tune_refuses_infinite_seconds_as_a_usage_line(tmp_path, capsys, monkeypatch, option):
    """The options TuneOptions now refuses stay one usage line of the command line (inf was taken)."""
    from pathlib import Path

    import rtcompile.tune_cmd as tune_cmd
    from rtcompile.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(tune_cmd, "_tune_all", lambda *a: pytest.fail("a study started"))
    spec = Path(__file__).resolve().parents[1] / "examples" / "order2_matrix.toml"
    assert main(["tune", str(spec), option, "inf", "--storage", f"sqlite:///{tmp_path / 's.db'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and option in err[0] and "finite" in err[0], err
