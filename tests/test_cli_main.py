"""``rtcompile``'s main: a stdout whose reader has gone (``| head``) ends quietly, and ``tune
--fix`` refuses a field held twice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rtcompile.cli import EXIT_BROKEN_PIPE, main

ROOT = Path(__file__).resolve().parents[1]
SPEC = str(ROOT / "examples" / "order3_16x16.toml")


@pytest.mark.parametrize("extra", [["--json"], []], ids=["json", "table"])
def test_a_closed_stdout_pipe_ends_quietly(tmp_path, extra):
    """``plan ... --json | head -1`` printed a BrokenPipeError traceback. The pipe's read end is
    closed before the command writes, so its first write finds no reader (what ``head`` does
    once it has its line, with an output longer than the pipe's buffer). The table goes through
    rich, which handles the closed pipe itself: it must stay quiet with main's handling too."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "rtcompile.cli", "plan", SPEC, *extra], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == EXIT_BROKEN_PIPE and err == "", err[-2000:]


@pytest.mark.parametrize("fixes", [["form=split", "form=fused"], ["resident.chunk_size=16", "resident.chunk_size=16"]],
                         ids=["two-values", "same-value"])
def test_tune_fix_refuses_a_field_given_twice(tmp_path, capsys, monkeypatch, fixes):
    """The last --fix of a field was kept silently while the title named both."""
    import rtcompile.tune_cmd as tune_cmd

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(tune_cmd, "_tune_all", lambda *a: pytest.fail("a study started"))
    argv = ["tune", SPEC, "--phase", "prefill", "--storage", f"sqlite:///{tmp_path / 's.db'}"]
    for f in fixes:
        argv += ["--fix", f]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    field = fixes[0].partition("=")[0]
    assert len(err) == 1 and f"--fix {field}: given twice" in err[0], err
    assert not (tmp_path / "s.db").exists()


@pytest.mark.parametrize("argv, line", [
    ([], "rtcompile: error: missing COMMAND"),
    (["bogus"], "rtcompile: error: argument COMMAND: invalid choice: 'bogus'"),
    (["tune", SPEC, "--phase", "x"], "rtcompile tune: error: argument --phase: invalid choice: 'x'"),
    (["run"], "rtcompile run: error: the following arguments are required: DIR"),
    (["plan", "no-such-spec.toml"], "rtcompile plan: error: spec file 'no-such-spec.toml': no such file"),
], ids=["no-command", "bad-command", "usage", "missing-argument", "input"])
def test_every_refusal_is_one_line_in_one_form(tmp_path, capsys, monkeypatch, argv, line):
    """Usage errors printed ``rtcompile tune: <message>``, input errors ``rtcompile: error:
    <message>`` without the command; both are argparse's ``<prog>: error: <message>`` now."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(line), err
