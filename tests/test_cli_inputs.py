"""Command-line inputs that went wrong (review, reproduced): each is refused in one line on
stderr with exit code 2, naming the option or field and what is allowed, before the long work,
with nothing left behind; a SIGTERM stops any command through its clean-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rtcompile.cli import EXIT_INTERRUPTED, main

ROOT = Path(__file__).resolve().parents[1]
TINY = 'order = 2\nkey_widths = [4]\nvalue_width = 4\nheads = 1\nmodel_width = 16\n'


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ----- SIGTERM -----------------------------------------------------------------------------------


def test_sigterm_during_export_leaves_no_temporary_folder(tmp_path):
    """A SIGTERM mid-export ended the process at once (Python's default): the temporary bundle
    folder ``.b.<pid>.<hex>.tmp`` and the parent folders export had made stayed behind, where a
    Ctrl-C cleaned them up. The signal is sent once the temporary folder exists (polled), so
    it lands inside the export's clean-up scope, whatever the machine's speed."""
    (tmp_path / "s.toml").write_text(TINY)
    parent = tmp_path / "made" / "here"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    p = subprocess.Popen([sys.executable, "-m", "rtcompile.cli", "export", str(tmp_path / "s.toml"), "--out",
                          str(parent / "b"), "--no-kernels"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        end = time.monotonic() + 60
        while not (parent.is_dir() and any(parent.glob(".b.*.tmp"))):
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < end, "the export made no temporary folder in 60 s"
            time.sleep(0.01)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == EXIT_INTERRUPTED, err.decode()[-2000:]
    assert err.decode().strip().splitlines() == ["rtcompile: interrupted"], err.decode()[-2000:]
    assert not (tmp_path / "made").exists(), sorted(str(x) for x in (tmp_path / "made").rglob("*"))


def test_sigterm_handler_is_held_by_main_for_every_command(tmp_path, monkeypatch, capsys):
    """In-process: a command (here ``info``) stopped by SIGTERM ends as a Ctrl-C does (exit
    130, one line), and main restores the handler it found (a process that lives on). The
    handler in place before main stands for Python's default, which would end pytest too."""
    import rtcompile.cli as cli

    spec = tmp_path / "s.toml"
    spec.write_text(TINY)

    def found(signum, frame):
        raise RuntimeError("the SIGTERM reached the handler main found: main held none")

    def stopped(args):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between bytecodes of the main thread
            pass
        raise AssertionError("the SIGTERM did not stop the command")

    parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser(), "info", stopped))
    before = signal.signal(signal.SIGTERM, found)
    try:
        assert main(["info", str(spec)]) == EXIT_INTERRUPTED
        assert signal.getsignal(signal.SIGTERM) is found
    finally:
        signal.signal(signal.SIGTERM, before)
    assert _one_line(capsys) == "rtcompile: interrupted"


def test_a_stopped_command_whose_clean_up_fails_names_the_error_on_its_one_line(tmp_path, monkeypatch, capsys):
    """A stop whose clean-up then fails (here an OSError, as a temporary folder that cannot be
    removed raises) exits 130 as a stop, and its one line names that error: what was left
    behind is not hidden behind "interrupted"."""
    import rtcompile.cli as cli

    spec = tmp_path / "s.toml"
    spec.write_text(TINY)

    def stopped(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs between bytecodes of the main thread
                pass
        finally:
            raise OSError("[Errno 39] Directory not empty: '.b.1.tmp'")

    parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser(), "info", stopped))
    assert main(["info", str(spec)]) == EXIT_INTERRUPTED
    assert _one_line(capsys) == "rtcompile: interrupted; then OSError: [Errno 39] Directory not empty: '.b.1.tmp'"


def _with_func(parser, command: str, func):
    """``parser`` with ``command``'s function replaced by ``func``."""
    sub = next(a for a in parser._actions if a.dest == "command")
    sub.choices[command].set_defaults(func=func)
    return parser


# ----- export: ONNX's 2 GiB ----------------------------------------------------------------------


def test_export_refuses_onnx_graphs_beyond_2_gib_before_building(tmp_path, capsys, monkeypatch):
    """``--vocab 16777216`` at model_width 16: 2 x 2^24 x 16 fp32 embedding and head weights, 2 GiB
    in each graph. The model was built (44 s) and the export then failed in protobuf's
    serialiser ("EncodeError: Failed to serialize proto", a traceback)."""
    import rtcompile.model as model_mod

    (tmp_path / "s.toml").write_text(TINY)
    monkeypatch.setattr(model_mod, "RunningTensorLM", lambda *a, **k: pytest.fail("the model was built"))
    assert main(["export", str(tmp_path / "s.toml"), "--out", str(tmp_path / "b"), "--vocab", "16777216"]) == 2
    line = _one_line(capsys)
    assert "--vocab 16777216" in line and "2 GiB" in line and "--no-onnx" in line, line
    assert "allowed:" in line and "at most" in line, line
    assert not (tmp_path / "b").exists()


def test_export_reports_an_onnx_serialisation_failure_in_one_line(tmp_path, capsys, monkeypatch):
    """The safety net behind the size check: protobuf's EncodeError out of the ONNX export (a
    graph whose non-weight part the estimate missed) is one line naming the bundle, and the
    temporary folder is removed."""
    from google.protobuf.message import EncodeError

    import rtcompile.export.onnx_model as onnx_model

    def fails(*a, **k):
        raise EncodeError("Failed to serialize proto")

    (tmp_path / "s.toml").write_text(TINY)
    monkeypatch.setattr(onnx_model, "export_onnx", fails)
    assert main(["export", str(tmp_path / "s.toml"), "--out", str(tmp_path / "x" / "b"), "--vocab", "8",
                 "--no-kernels"]) == 2
    line = _one_line(capsys)
    assert "Failed to serialize proto" in line and "--no-onnx" in line, line
    assert not (tmp_path / "x").exists()


def test_onnx_size_check_takes_the_largest_vocabulary_it_names(capsys):
    """The vocabulary the refusal offers fits; one more token does not."""
    import re

    from rtcompile.export import BundleError
    from rtcompile.export_cmd import _check_onnx_size
    from rtcompile.spec import ModelSpec

    spec = ModelSpec(order=2, key_widths=(4,), value_width=4, heads=1, model_width=16)
    with pytest.raises(BundleError) as info:
        _check_onnx_size(spec, 1 << 24)
    largest = int(re.search(r"at most ([\d,]+)", str(info.value)).group(1).replace(",", ""))
    _check_onnx_size(spec, largest)
    with pytest.raises(BundleError, match="--no-onnx"):
        _check_onnx_size(spec, largest + 1)


# ----- numbers past float and past Python's 4300 digits; FIFOs as input files ------------------------

BIG_INT = "1" + "0" * 400  # an int no float holds: math.isfinite raised OverflowError
HUGE_INT = "1" + "0" * 5000  # past Python's int-from-text limit (4300 digits): json and tomllib raise ValueError


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny spec, a plan of it (h200, one bucket a phase) and a bundle of it (no ONNX)."""
    from rtcompile.plan import make_plan
    from rtcompile.spec import load_spec
    from rtcompile.target import get_target

    root = tmp_path_factory.mktemp("made")
    (root / "s.toml").write_text(TINY)
    plan = make_plan(load_spec(root / "s.toml"), get_target("h200"), batches=(1,), seq_lens=(16,), decode_batches=(1,))
    plan.save(root / "plan.json")
    assert main(["export", str(root / "s.toml"), "--out", str(root / "b"), "--vocab", "8", "--no-onnx",
                 "--no-kernels"]) == 0
    return root


def _with_raw(path: Path, edit, raw: str) -> str:
    """``path``'s JSON with ``edit(data)`` applied, where the placeholder it sets is written as
    the raw number text ``raw`` (json.dumps cannot write a 5000-digit int)."""
    import json

    data = json.loads(path.read_text())
    edit(data)
    return json.dumps(data).replace('"@RAW@"', raw)


def _set_scale(data):
    data["spec"]["scale"] = "@RAW@"


def _copy_bundle(made, tmp_path) -> Path:
    import shutil

    return Path(shutil.copytree(made / "b", tmp_path / "b"))


_PLACES = ["spec-toml-info", "spec-json-info", "spec-toml-plan", "plan-file", "manifest"]


# --force replaces a bundle whatever its spec says (a corrupted one is what it is for): a scale there is no refusal
@pytest.mark.parametrize("where, raw, field", [
    *[pytest.param(w, BIG_INT, "scale", id=f"scale-1e400-{w}") for w in _PLACES],
    *[pytest.param(w, HUGE_INT, "digits", id=f"5000-digits-{w}") for w in [*_PLACES, "manifest-force"]],
])
def test_huge_numbers_in_input_files_are_one_line(where, raw, field, made, tmp_path, capsys):
    """A 401-digit scale: "OverflowError: int too large to convert to float" out of
    math.isfinite (spec.py), a traceback from info, plan, export --plan and inspect. A 5000-digit
    number anywhere: "ValueError: Exceeds the limit (4300 digits)" from the parsers, a traceback
    wherever it was not caught as a ValueError (the spec, the plan file, --force's manifest)."""
    spec_text = TINY + (f"scale = {raw}\n" if field == "scale" else f"name = {raw}\n")
    if where == "spec-toml-info":
        (tmp_path / "s.toml").write_text(spec_text)
        argv = ["info", str(tmp_path / "s.toml")]
    elif where == "spec-json-info":
        import json
        import tomllib

        data = tomllib.loads(TINY)
        data["scale"] = "@RAW@"
        (tmp_path / "s.json").write_text(json.dumps(data).replace('"@RAW@"', raw))
        argv = ["info", str(tmp_path / "s.json")]
    elif where == "spec-toml-plan":
        (tmp_path / "s.toml").write_text(spec_text)
        argv = ["plan", str(tmp_path / "s.toml"), "--target", "h200", "--out", str(tmp_path / "p" / "plan.json")]
    elif where == "plan-file":
        (tmp_path / "plan.json").write_text(_with_raw(made / "plan.json", _set_scale, raw))
        argv = ["export", str(made / "s.toml"), "--out", str(tmp_path / "o" / "b"), "--plan", str(tmp_path / "plan.json")]
    else:
        bundle = _copy_bundle(made, tmp_path)
        (bundle / "manifest.json").write_text(_with_raw(made / "b" / "manifest.json", _set_scale, raw))
        argv = (["inspect", str(bundle)] if where == "manifest" else
                ["export", str(made / "s.toml"), "--out", str(bundle), "--force", "--no-onnx", "--no-kernels"])
    assert main(argv) == 2
    line = _one_line(capsys)
    if field == "scale":
        assert "scale: got" in line and "allowed: a finite number > 0" in line and len(line) < 400, line
    else:
        assert "Exceeds the limit (4300 digits)" in line and "set_int_max_str_digits" not in line, line
    assert not any((tmp_path / name).exists() for name in ("p", "o")), line


class _Unblocking:
    """Opens ``fifo`` for writing (non-blocking, so it needs a reader) and closes it again,
    every 20 ms until stopped: a reader that waits on the FIFO gets its end of file after at
    most ``after_s`` instead of hanging the test for ever (what the unfixed reads did)."""

    def __init__(self, fifo: Path, after_s: float = 3.0):
        import threading

        self.fifo, self.after_s, self.stop = fifo, after_s, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        start = time.monotonic()
        while not self.stop.wait(0.02):
            if time.monotonic() - start < self.after_s:
                continue
            try:
                os.close(os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader (ENXIO): nothing waits on it
                pass

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


@pytest.mark.parametrize("where", ["export-plan", "inspect-manifest", "force-manifest"])
def test_a_fifo_as_an_input_file_is_refused_not_waited_on(where, made, tmp_path, capsys):
    """``export --plan fifo.json`` and ``inspect DIR`` whose manifest.json is a FIFO waited for
    a writer for ever (read_text opens it blocking); read_whole refuses what is not a regular file."""
    if where == "export-plan":
        fifo = tmp_path / "fifo.json"
        os.mkfifo(fifo)
        argv = ["export", str(made / "s.toml"), "--out", str(tmp_path / "o" / "b"), "--plan", str(fifo)]
    else:
        bundle = _copy_bundle(made, tmp_path)
        fifo = bundle / "manifest.json"
        fifo.unlink()
        os.mkfifo(fifo)
        argv = (["inspect", str(bundle)] if where == "inspect-manifest" else
                ["export", str(made / "s.toml"), "--out", str(bundle), "--force", "--no-onnx", "--no-kernels"])
    start = time.monotonic()
    with _Unblocking(fifo):
        assert main(argv) == 2
    line = _one_line(capsys)
    assert "not a regular file" in line and time.monotonic() - start < 2.5, line
    assert not (tmp_path / "o").exists()


# ----- --out naming the spec -----------------------------------------------------------------------


def _json_spec(path: Path) -> str:
    import json
    import tomllib

    text = json.dumps(tomllib.loads(TINY))
    path.write_text(text)
    return text


@pytest.mark.parametrize("how", ["build-default-out", "plan-same-path", "plan-dotted-path", "plan-hard-link"])
def test_out_naming_the_spec_file_is_refused(how, tmp_path, capsys, monkeypatch):
    """``cp spec.json plan.json; rtcompile build plan.json`` (build's --out defaults to plan.json)
    replaced the spec with the plan, silently; ``plan S --out S`` too."""
    import rtcompile.plan_cmd as plan_cmd

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plan_cmd, "_validate_kernels", lambda spec: pytest.fail("the kernels were checked"))
    text = _json_spec(tmp_path / "plan.json")
    if how == "build-default-out":
        argv = ["build", "plan.json", "--target", "h200"]
    else:
        out = {"plan-same-path": "plan.json", "plan-dotted-path": "./sub/../plan.json", "plan-hard-link": "link.json"}[how]
        (tmp_path / "sub").mkdir()
        if how == "plan-hard-link":
            os.link(tmp_path / "plan.json", tmp_path / "link.json")
        argv = ["plan", "plan.json", "--target", "h200", "--out", out]
    assert main(argv) == 2
    line = _one_line(capsys)
    assert "--out" in line and "is the spec file" in line and "allowed:" in line, line
    assert (tmp_path / "plan.json").read_text() == text


# ----- explore: what only failed at every point -----------------------------------------------------


@pytest.mark.parametrize("case", ["seq-len-past-mqar", "points-is-a-file"])
def test_explore_refuses_what_every_point_would_fail_on(case, tmp_path, capsys, monkeypatch):
    """``--recall --seq-len 2000000`` passed the options (2^24) but MQARTask takes at most 2^20:
    every point failed when it ran, exit 0. ``--out DIR`` whose ``points`` is a file: every
    point's checkpoint folder failed, exit 0. Both before any point now."""
    import rtcompile.explore.sweep as sweep

    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pytest.fail("the sweep ran"))
    out = tmp_path / "out"
    argv = ["explore", str(ROOT / "examples" / "order3_16x16.toml"), "--orders", "2", "--widths", "4", "--out",
            str(out), "--storage", f"sqlite:///{tmp_path / 'e.db'}"]
    if case == "seq-len-past-mqar":
        argv += ["--recall", "--seq-len", "2000000"]
    else:
        out.mkdir()
        (out / "points").write_text("")
    assert main(argv) == 2
    line = _one_line(capsys)
    if case == "seq-len-past-mqar":
        assert "--seq-len" in line and "1048576" in line and "allowed" in line, line
        assert not out.exists()
    else:
        assert "points" in line and "allowed" in line, line
    assert not (tmp_path / "e.db").exists()


@pytest.mark.parametrize("seq_len", [3, (1 << 20) + 1], ids=["below-4", "past-2^20"])
def test_recall_options_take_mqar_lengths(seq_len):
    """RecallOptions' bounds are MQARTask's (4 to 2^20 tokens); its error names seq_len."""
    from rtcompile.explore.mqar import MAX_SEQ_LEN, MQARTask
    from rtcompile.explore.points import RecallOptions

    with pytest.raises(ValueError, match=r"^seq_len: .*\[4, 1048576\]"):
        RecallOptions(seq_len=seq_len, kv_pairs=1)
    RecallOptions(seq_len=MAX_SEQ_LEN, kv_pairs=1)  # the longest MQAR takes is taken
    MQARTask(seq_len=MAX_SEQ_LEN, num_kv_pairs=1)


# ----- comma lists: empty items, repeated options --------------------------------------------------


@pytest.fixture
def no_long_work(monkeypatch):
    """A command that got past its option checks fails at once instead of tuning, checking the
    kernels or sweeping (minutes under the interpreter)."""
    import rtcompile.explore.sweep as sweep
    import rtcompile.plan_cmd as plan_cmd
    import rtcompile.tune_cmd as tune_cmd

    monkeypatch.setattr(tune_cmd, "_tune_all", lambda *a, **k: pytest.fail("a study started"))
    monkeypatch.setattr(plan_cmd, "_validate_kernels", lambda *a, **k: pytest.fail("the kernels were checked"))
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pytest.fail("the sweep ran"))


@pytest.mark.parametrize("argv, option", [
    (["plan", "{spec}", "--target", "h200", "--seq-len", "1,,2"], "--seq-len"),
    (["plan", "{spec}", "--target", "h200", "--batch", "1,2,"], "--batch"),
    (["plan", "{spec}", "--target", "h200", "--decode-batch", ",4"], "--decode-batch"),
    (["tune", "{spec}", "--batch", "1, ,2"], "--batch"),
    (["explore", "{spec}", "--orders", "2,,3", "--widths", "4"], "--orders"),
    (["explore", "{spec}", "--orders", "2", "--widths", "4", "--recall", "--lrs", "0.1,,0.2"], "--lrs"),
], ids=["plan-seq-len", "plan-batch-trailing", "plan-decode-batch-leading", "tune-batch-blank", "explore-orders",
        "explore-lrs"])
def test_an_empty_item_in_a_comma_list_is_refused(argv, option, tmp_path, capsys, no_long_work):
    """``--seq-len 1,,2`` planned 1 and 2: the empty item was dropped silently (a typo'd bucket)."""
    (tmp_path / "s.toml").write_text(TINY)
    assert main([a.replace("{spec}", str(tmp_path / "s.toml")) for a in argv]) == 2
    line = _one_line(capsys)
    assert f"argument {option}: empty item in" in line and "allowed: comma-separated" in line, line


@pytest.mark.parametrize("argv, option", [
    (["plan", "{spec}", "--target", "h200", "--batch", "1", "--batch", "2"], "--batch"),
    (["build", "{spec}", "--target", "h200", "--seq-len", "16", "--seq-len", "32"], "--seq-len"),
    (["plan", "{spec}", "--target", "h200", "--decode-batch", "1", "--decode-batch", "1"], "--decode-batch"),
    (["tune", "{spec}", "--seq-len", "16", "--seq-len", "32"], "--seq-len"),
    (["explore", "{spec}", "--orders", "2", "--orders", "3", "--widths", "4"], "--orders"),
    (["explore", "{spec}", "--orders", "2", "--widths", "4", "--widths", "8"], "--widths"),
    (["explore", "{spec}", "--orders", "2", "--widths", "4", "--recall", "--seeds", "0", "--seeds", "1"], "--seeds"),
    (["run", "{spec}", "--tokens", "1", "--tokens", "2"], "--tokens"),
], ids=["plan-batch", "build-seq-len", "plan-decode-batch-same", "tune-seq-len", "explore-orders", "explore-widths",
        "explore-seeds", "run-tokens"])
def test_a_list_option_given_twice_is_refused(argv, option, tmp_path, capsys, no_long_work):
    """``--batch 1 --batch 2`` planned batch 2 alone: argparse keeps the last, silently."""
    (tmp_path / "s.toml").write_text(TINY)
    assert main([a.replace("{spec}", str(tmp_path / "s.toml")) for a in argv]) == 2
    line = _one_line(capsys)
    assert f"argument {option}: given more than once" in line and "allowed:" in line, line


@pytest.mark.parametrize("argv, option", [
    (["run", "{spec}", "--steps", "4", "--steps", "8"], "--steps"),
    (["tune", "{spec}", "--seconds", "5", "--seconds", "9"], "--seconds"),
    (["plan", "{spec}", "--target", "h200", "--target", "h100"], "--target"),
    (["export", "{spec}", "--out", "{tmp}/a", "--out", "{tmp}/b"], "--out"),
    (["bench", "--phase", "decode", "--phase", "prefill"], "--phase"),
], ids=["run-steps", "tune-seconds", "plan-target", "export-out", "bench-phase"])
def test_a_one_value_option_given_twice_is_refused(argv, option, tmp_path, capsys, no_long_work):
    """``run --steps 4 --steps 8`` decoded 8 steps: every one-value option (cli_args.Parser
    makes each a cli_args.Once) is refused the second time, before any work; nothing is written."""
    (tmp_path / "s.toml").write_text(TINY)
    assert main([a.replace("{spec}", str(tmp_path / "s.toml")).replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    line = _one_line(capsys)
    assert line.endswith(f"argument {option}: given more than once; allowed: once"), line
    assert sorted(x.name for x in tmp_path.iterdir()) == ["s.toml"]


@pytest.mark.parametrize("tokens", ["1,,2", "1,2,", " ,1"], ids=["middle", "trailing", "blank-first"])
def test_run_refuses_an_empty_token_item(tokens, made, capsys, monkeypatch):
    """``run --tokens 1,,2`` ran the prompt [1, 2]. Refused before the bundle is verified."""
    import rtcompile.export as export_pkg

    monkeypatch.setattr(export_pkg, "verify_bundle", lambda *a: pytest.fail("verified before the options"))
    assert main(["run", str(made / "b"), "--tokens", tokens, "--steps", "1"]) == 2
    line = _one_line(capsys)
    assert f"--tokens: empty item in {tokens!r}; allowed: comma-separated integers >= 0 (token ids)" in line, line


def test_parsed_arguments_carry_no_bookkeeping():
    """The once-only options' record of what was given does not reach the commands."""
    from rtcompile.cli import build_parser

    args = build_parser().parse_args(["plan", "s.toml", "--batch", "1,2"])
    assert args.batch == [1, 2] and not [k for k in vars(args) if k.startswith("_")]


# ----- plans: configs checked for their values, not only their types -----------------------------------


def _edit_decision(made, phase: str, key: str, field: str, raw: str) -> str:
    """The made plan's JSON with ``field`` of the first ``phase`` decision's ``key`` config set to
    the raw number text ``raw``."""
    def edit(data):
        d = next(d for d in data["decisions"] if d["phase"] == phase)
        d[key][field] = "@RAW@"

    return _with_raw(made / "plan.json", edit, raw)


@pytest.mark.parametrize("phase, key, field, raw, why", [
    ("prefill", "variant", "block_v", "-16", "block_v=-16; allowed: a power of two"),
    ("prefill", "variant", "num_warps", "3", "num_warps=3; allowed: a power of two"),
    ("prefill", "variant", "chunk_size", "1" + "0" * 400, "chunk_size=100000...(401 digits); allowed: a power of two"),
    ("decode", "variant", "block_v", "-16", "block_v=-16"),
    ("train", "backward", "num_warps", "3", "num_warps=3"),
], ids=["block_v-negative", "num_warps-3", "chunk_size-1e400", "decode-block_v", "train-backward-warps"])
@pytest.mark.parametrize("via", ["export-plan", "inspect-manifest"])
def test_a_plan_config_that_cannot_run_is_refused(via, phase, key, field, raw, why, made, tmp_path, capsys):
    """A plan with variant block_v=-16, num_warps=3 or a 401-digit chunk_size was exported into a
    bundle and inspect called it verified: configs were type-checked only. Each is now checked
    with its own check() at the plan's spec shape, the field named."""
    text = _edit_decision(made, phase, key, field, raw)
    if via == "export-plan":
        (tmp_path / "plan.json").write_text(text)
        argv = ["export", str(made / "s.toml"), "--out", str(tmp_path / "o" / "b"), "--plan", str(tmp_path / "plan.json"),
                "--no-onnx", "--no-kernels"]
    else:
        import json

        bundle = _copy_bundle(made, tmp_path)
        manifest = json.loads((bundle / "manifest.json").read_text())
        manifest["plan"], manifest["target"] = "@PLAN@", "h200"
        (bundle / "manifest.json").write_text(json.dumps(manifest).replace('"@PLAN@"', text))
        argv = ["inspect", str(bundle)]
    assert main(argv) == 2
    line = _one_line(capsys)
    assert f"plan.decisions[" in line and f"].{key}: {why}" in line and len(line) < 400, line
    assert not (tmp_path / "o").exists()


def test_plans_of_every_example_and_target_read_back():
    """The check refuses no plan the planner writes: every example spec on every GPU profile."""
    from rtcompile.plan import Plan, make_plan
    from rtcompile.spec import load_spec
    from rtcompile.target import PROFILES, get_target

    specs = sorted((ROOT / "examples").glob("*.*"))
    assert len(specs) >= 6
    for path in specs:
        for name in PROFILES:
            plan = make_plan(load_spec(path), get_target(name))
            assert Plan.from_dict(plan.to_dict()).decisions == plan.decisions, (path.name, name)


# ----- the tuned-config table named by $RTCOMPILE_TUNED ---------------------------------------------


def test_a_tuned_table_error_says_rtcompile_tuned_named_it(tmp_path, capsys, monkeypatch):
    """``RTCOMPILE_TUNED=<a folder> rtcompile tune ...`` said "'<folder>' is a folder: not replaced
    by a file", with nothing saying the path came from the environment, not from an option."""
    import rtcompile.tune_cmd as tune_cmd

    (tmp_path / "s.toml").write_text(TINY)
    (tmp_path / "table").mkdir()
    monkeypatch.setenv("RTCOMPILE_TUNED", str(tmp_path / "table"))
    monkeypatch.setattr(tune_cmd, "_tune_all", lambda *a, **k: pytest.fail("a study started"))
    assert main(["tune", str(tmp_path / "s.toml"), "--phase", "decode", "--trials", "1", "--storage",
                 f"sqlite:///{tmp_path / 's.db'}"]) == 2
    line = _one_line(capsys)
    assert "tuned-config table ($RTCOMPILE_TUNED)" in line and "is a folder" in line, line


@pytest.mark.parametrize("named_by", ["env", "argument"])
def test_table_problem_names_rtcompile_tuned_only_when_it_set_the_path(named_by, tmp_path, monkeypatch):
    from rtcompile.tuning.store import table_problem

    table = tmp_path / "t.json"
    table.write_text("{")
    monkeypatch.setenv("RTCOMPILE_TUNED", str(table))
    problem = table_problem() if named_by == "env" else table_problem(table)
    assert problem.startswith("tuned-config table ($RTCOMPILE_TUNED) " if named_by == "env" else
                              f"tuned-config table {str(table)!r}"), problem


@pytest.mark.parametrize("text", [f'{{"format": {HUGE_INT}}}', "[" * 100_000], ids=["5000-digits", "nested"])
def test_a_recall_checkpoint_json_past_the_parser_names_checkpoint_dir(text, tmp_path):
    """explore's recall checkpoints: a number past 4300 digits (ValueError) or brackets nested
    past the recursion limit (RecursionError) escaped unnamed from the reader."""
    from rtcompile.explore.trainer import _read_json

    (tmp_path / "lr.json").write_text(text)
    with pytest.raises(ValueError, match=r"^checkpoint_dir: .*lr\.json' cannot be read as JSON"):
        _read_json(tmp_path / "lr.json")
