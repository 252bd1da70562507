"""The CLI's output paths and input checks: a path that cannot be written, a non-regular file, a
folder left by a failed command, a store file that is not a database, shapes that do not fit,
and the messages of single-integer, bounded and empty options. Each refusal is exit 2 with one
stderr line naming the option, before any work, and leaves no file, folder or lock behind.

Unwritable folders are simulated (a probe's ``os.open`` refused, a rename failing): the tests
run as root too, where a 0555 folder is writable, and never touch /sys, /proc or /dev."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from rtcompile import fileio
from rtcompile.cli import main
from conftest import TINY_SPEC

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A folder holding a tiny spec, a private cache outside it, and the current folder."""
    root = tmp_path / "w"
    root.mkdir()
    (root / "tiny.toml").write_text(TINY_SPEC)
    (root / "order0.toml").write_text(TINY_SPEC.replace("order = 3", "order = 0"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("RTCOMPILE_TUNED", str(tmp_path / "cache" / "tuned.json"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.chdir(root)
    return root


def _tree(root: Path) -> dict[str, tuple[str, int]]:
    """Every path under ``root``: its kind and size (a folder's size as 0)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        kind = "dir" if p.is_dir() else "fifo" if p.is_fifo() else "file"
        out[str(p.relative_to(root))] = (kind, 0 if kind == "dir" else st.st_size)
    return out


def _refused(argv, capsys, root: Path, *needles: str) -> str:
    """Run the CLI: exit 2, exactly one stderr line holding every needle, no traceback, and
    ``root`` exactly as it was (no output, folder, temporary or lock left)."""
    before = _tree(root)
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert code == 2, (code, cap.err)
    assert len(lines) == 1, lines
    assert "Traceback" not in cap.err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert _tree(root) == before
    return lines[0]


def _no_work(monkeypatch):
    """Planning, the kernel checks and the sweep raise if they start."""
    import rtcompile.explore.sweep as sweep
    import rtcompile.plan_cmd as plan_cmd

    def started(*a, **k):
        raise AssertionError("work started before the input was checked")

    monkeypatch.setattr(plan_cmd, "_make", started)
    monkeypatch.setattr(plan_cmd, "_validate_kernels", started)
    monkeypatch.setattr(sweep, "run_sweep", started)


def _unwritable(monkeypatch, folder: Path, err: int):
    """Creating a file in ``folder`` fails with ``err`` (EACCES: root in /sys; ENOENT: /proc;
    EROFS: a read-only mount), also for root; elsewhere os.open is the real one."""
    real = os.open
    folder = str(folder)

    def fake(path, flags, *a, **k):
        if flags & os.O_CREAT and os.path.dirname(os.path.abspath(os.fspath(path))) == folder:
            raise OSError(err, os.strerror(err), os.fspath(path))
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", fake)
    os.chmod(folder, 0o555)  # a real refusal for a user that is not root


COMMANDS = {  # command -> argv before --out (relative to the work folder)
    "plan": ["plan", "tiny.toml", "--target", "h200"],
    "build": ["build", "tiny.toml"],
    "export": ["export", "tiny.toml", "--no-onnx", "--no-kernels"],
    "explore": ["explore", "tiny.toml", "--orders", "2", "--widths", "4", "--target", "h200"],
}
OUT_NAME = {"plan": "p.json", "build": "p.json", "export": "bundle", "explore": "ex"}


@pytest.mark.parametrize("err", [errno.EACCES, errno.ENOENT, errno.EROFS], ids=["eacces", "enoent-proc", "erofs"])
@pytest.mark.parametrize("cmd", sorted(COMMANDS))
@pytest.mark.parametrize("depth", ["in-folder", "new-subfolder"])
def test_an_unwritable_out_is_refused_before_any_work(work, capsys, monkeypatch, cmd, err, depth):
    ro = work / "ro"
    ro.mkdir()
    out = ro / OUT_NAME[cmd] if depth == "in-folder" else ro / "new" / OUT_NAME[cmd]
    _no_work(monkeypatch)
    _unwritable(monkeypatch, ro, err)
    try:
        line = _refused([*COMMANDS[cmd], "--out", out], capsys, work, "--out", "cannot write in", str(ro))
    finally:
        os.chmod(ro, 0o755)
    assert os.strerror(err) in line


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_a_file_where_a_folder_of_out_should_be(work, capsys, monkeypatch, cmd):
    (work / "afile").write_text("x")
    _no_work(monkeypatch)
    _refused([*COMMANDS[cmd], "--out", work / "afile" / "sub" / OUT_NAME[cmd]], capsys, work, "--out",
             "is a file, not a folder", "allowed: a path whose existing parents are folders")


@pytest.mark.parametrize("cmd", ["plan", "build"])
@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_out_file_that_is_not_a_regular_file_is_never_replaced(work, capsys, monkeypatch, cmd, kind):
    target = work / "target"
    os.mkfifo(target) if kind == "fifo" else target.mkdir()
    _no_work(monkeypatch)
    _refused([*COMMANDS[cmd], "--out", target], capsys, work, "--out",
             "a FIFO" if kind == "fifo" else "a folder", "allowed: a regular file path or a new one")
    assert target.is_fifo() if kind == "fifo" else target.is_dir()


def test_the_atomic_writer_refuses_to_rename_over_a_fifo(tmp_path):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    with pytest.raises(fileio.WriteError, match="is a FIFO"):
        fileio.atomic_write(fifo, "{}")
    assert fifo.is_fifo() and sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # no temporary left


@pytest.mark.parametrize("cmd", ["plan", "build", "export"])
def test_a_write_that_fails_at_the_end_is_one_line_and_leaves_nothing(work, capsys, monkeypatch, cmd):
    """The check passed, then the rename fails (a full disk, a folder made read-only meanwhile):
    one line naming --out, exit 2, no output, no temporary, and no folder made for it (build's
    no-GPU notice is not on stderr before it: it goes to stdout with the report)."""
    real = os.replace

    def full(src, dst, *a, **k):
        if str(work) in os.fspath(dst):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(fileio.os, "replace", full)
    _refused([*COMMANDS[cmd], "--out", work / "new" / OUT_NAME[cmd]], capsys, work, "--out",
             os.strerror(errno.ENOSPC))


@pytest.mark.parametrize(("argv", "needle"), [
    (["plan", "order0.toml", "--out", "new/plan.json"], "spec.order"),
    (["plan", "tiny.toml", "--target", "nope", "--out", "new/plan.json"], "target"),
    (["plan", "tiny.toml", "--target", "h200", "--seq-len", "1000000000", "--out", "new/plan.json"], "does not fit"),
    (["build", "tiny.toml", "--target", "nope", "--out", "new/plan.json"], "target"),
    (["build", "order0.toml", "--out", "new/plan.json"], "spec.order"),
    (["explore", "tiny.toml", "--orders", "2", "--widths", "4", "--out", "new/ex", "--storage", "bogus://x"], "storage"),
    (["export", "order0.toml", "--out", "new/bundle"], "spec.order"),
], ids=["plan-bad-spec", "plan-bad-target", "plan-too-big", "build-bad-target", "build-bad-spec",
        "explore-bad-storage", "export-bad-spec"])
def test_a_failed_command_leaves_no_folder(work, capsys, monkeypatch, argv, needle):
    import rtcompile.plan_cmd as plan_cmd

    monkeypatch.setattr(plan_cmd, "_validate_kernels", lambda *a: pytest.fail("kernels checked"))
    _refused(argv, capsys, work, needle)
    assert not (work / "new").exists()


def test_explore_removes_the_folder_it_made_when_the_sweep_fails(work, capsys, monkeypatch):
    import rtcompile.explore.sweep as sweep
    from rtcompile.tuning.store import StoreError

    def unreachable(*a, **k):
        raise StoreError("storage 'postgresql://nohost/db': cannot open (no such host)")

    monkeypatch.setattr(sweep, "run_sweep", unreachable)
    _refused(["explore", "tiny.toml", "--orders", "2", "--widths", "4", "--out", "new/deeper/ex"], capsys, work,
             "storage")
    assert not (work / "new").exists()


def test_tune_checks_the_storage_url_before_its_notice(work, capsys):
    _refused(["tune", "tiny.toml", "--storage", "bogus://x", "--trials", "1", "--phase", "decode"], capsys, work,
             "storage 'bogus://x'", "allowed: sqlite:///FILE")


@pytest.mark.parametrize("url", ["sqlite:///:memory:", "sqlite://", "sqlite+pysqlite://"])
def test_an_in_memory_store_is_refused(url, work, capsys):
    """Before: accepted; explore's workers each died on "Record does not exist" and lock files
    named ':memory:.lock' were left in the working folder."""
    _refused(["explore", "tiny.toml", "--orders", "2", "--widths", "4", "--storage", url, "--out", "ex"], capsys, work,
             "an in-memory database")
    _refused(["tune", "tiny.toml", "--storage", url, "--trials", "1", "--phase", "decode"], capsys, work,
             "an in-memory database")
    assert not list(work.glob("*.lock"))


def test_build_checks_the_storage_url_on_a_cpu(work, capsys, monkeypatch):
    _no_work(monkeypatch)
    _refused(["build", "tiny.toml", "--storage", "bogus://x", "--out", "p.json"], capsys, work, "storage 'bogus://x'")


@pytest.mark.parametrize(("content", "argv", "needle"), [
    (b"", ["tune", "--list"], "is an empty file"),
    (b"just some notes\n", ["tune", "--list"], "is not an SQLite database"),
    (b"just some notes\n", ["tune", "tiny.toml", "--trials", "1", "--phase", "decode"], "is not an SQLite database"),
    (b"just some notes\n", ["build", "tiny.toml", "--out", "p.json"], "is not an SQLite database"),
    (b"just some notes\n", ["explore", "tiny.toml", "--orders", "2", "--widths", "4", "--out", "ex"],
     "is not an SQLite database"),
], ids=["list-empty", "list-notes", "tune-notes", "build-notes", "explore-notes"])
def test_a_file_that_is_not_a_store_is_refused_untouched(work, capsys, monkeypatch, content, argv, needle):
    _no_work(monkeypatch)
    db = work / "store.db"
    db.write_bytes(content)
    _refused([*argv, "--storage", f"sqlite:///{db}"], capsys, work, "storage", str(db), needle)
    assert db.read_bytes() == content and not (work / "store.db.lock").exists()


@pytest.mark.parametrize(("argv", "option"), [
    (["--phase", "prefill", "--seq-len", "1000000000"], "--seq-len"),
    (["--phase", "prefill", "--batch", "1000000000"], "--batch"),
    (["--phase", "decode", "--decode-batch", "1000000000"], "--decode-batch"),
], ids=["prefill-seq-len", "prefill-batch", "decode-batch"])
def test_tune_refuses_shapes_that_do_not_fit_as_plan_does(work, capsys, monkeypatch, argv, option):
    import rtcompile.tune_cmd as tune_cmd

    monkeypatch.setattr(tune_cmd, "_tune_all", lambda *a: pytest.fail("a study started"))
    _refused(["tune", "tiny.toml", "--trials", "1", "--storage", f"sqlite:///{work / 's.db'}", *argv], capsys, work,
             option, "does not fit")


# --seq-len's bound is MQAR's own (2^20): 2^24 was refused by every point's task when it ran
@pytest.mark.parametrize("option, bound", [("--seq-len", "[4, 1048576]"), ("--steps", "[1, 2^24]"),
                                           ("--batch-size", "[1, 2^24]"), ("--kv-pairs", "[1, 2^24]")])
def test_explore_names_the_real_bound(work, capsys, option, bound):
    _refused(["explore", "tiny.toml", "--orders", "2", "--widths", "4", "--recall", option, "99999999999",
              "--out", "ex"], capsys, work, option, f"allowed: an integer in {bound}")


@pytest.mark.parametrize("argv", [
    ["tune", "tiny.toml", "--trials", "0"],
    ["tune", "tiny.toml", "--workers", "0"],
    ["build", "tiny.toml", "--trials", "0"],
    ["explore", "tiny.toml", "--orders", "2", "--widths", "4", "--d-model", "0"],
    ["explore", "tiny.toml", "--orders", "2", "--widths", "4", "--workers", "2,3"],
], ids=["tune-trials", "tune-workers", "build-trials", "explore-d-model", "explore-workers-list"])
def test_single_integer_options_say_a_positive_integer(work, capsys, argv):
    line = _refused(argv, capsys, work, "expected a positive integer")
    assert "comma-separated" not in line


def test_export_weights_that_are_a_folder(work, capsys):
    (work / "weights").mkdir()
    _refused(["export", "tiny.toml", "--weights", "weights", "--out", "b", "--no-onnx"], capsys, work,
             "--weights", "is a folder", "allowed: a safetensors file")


@pytest.mark.parametrize(("argv", "option"), [
    (["plan", "tiny.toml", "--out", ""], "--out"),
    (["plan", "tiny.toml", "--target", ""], "--target"),
    (["build", "tiny.toml", "--storage", ""], "--storage"),
    (["export", "tiny.toml", "--out", ""], "--out"),
    (["explore", "tiny.toml", "--orders", "2", "--widths", "4", "--out", ""], "--out"),
    (["tune", "--list", "--storage", ""], "--storage"),
], ids=["plan-out", "plan-target", "build-storage", "export-out", "explore-out", "tune-storage"])
def test_empty_strings_are_refused_not_ignored(work, capsys, monkeypatch, argv, option):
    _no_work(monkeypatch)
    _refused(argv, capsys, work, option, "empty; allowed:")


@pytest.mark.parametrize(("fix", "phase"), [("resident.chunk_size=32", "prefill"), ("form=recurrent", "decode")],
                         ids=["chunk-form-field", "recurrent-form"])
def test_a_fix_under_phase_all_names_the_phase_of_its_form(work, capsys, fix, phase):
    _refused(["tune", "tiny.toml", "--fix", fix, "--storage", f"sqlite:///{work / 's.db'}"], capsys, work,
             f"--fix {fix}", f"allowed: --phase {phase}")


def _plan_file(work: Path, edit=None) -> Path:
    """A plan of the tiny spec written to plan.json, ``edit`` applied to its dict first."""
    import json

    from rtcompile.plan import make_plan
    from rtcompile.spec import load_spec
    from rtcompile.target import get_target

    data = make_plan(load_spec(work / "tiny.toml"), get_target("h200"), batches=(1,), seq_lens=(16,),
                     decode_batches=(1,), use_measurements=False).to_dict()
    if edit is not None:
        edit(data)
    path = work / "plan.json"
    path.write_text(json.dumps(data))
    return path


def _no_model(monkeypatch):
    """Building the model (its weights allocated) raises."""
    import rtcompile.model

    def built(*a, **k):
        raise AssertionError("the model was built before the input was checked")

    monkeypatch.setattr(rtcompile.model, "RunningTensorLM", built)


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda d: d["decisions"][0].update(batch=0), "plan.decisions[0].batch: got 0; allowed: an integer >= 1"),
    (lambda d: d.update(decisions=[x for x in d["decisions"] if x["phase"] != "decode"]),
     "no decision for phase 'decode'"),
    (lambda d: d["spec"].update(value_width=16), "made for another spec"),
    (lambda d: d.update(format=99), "newer than this rtcompile reads"),
    ("not json", "unreadable"),
], ids=["bad-field", "no-decode", "other-spec", "newer-format", "not-json"])
def test_export_refuses_a_bad_plan_before_building_the_model(work, capsys, monkeypatch, edit, needle):
    path = _plan_file(work, None if isinstance(edit, str) else edit)
    if isinstance(edit, str):
        path.write_text(edit)
    _no_model(monkeypatch)
    _refused(["export", "tiny.toml", "--plan", path, "--out", "new/bundle", "--no-onnx", "--no-kernels"], capsys,
             work, needle)



@pytest.mark.parametrize("part", ["weights.safetensors", "the ONNX graphs"])
def test_export_a_weights_or_graph_write_that_fails_is_one_line_and_leaves_nothing(work, capsys, monkeypatch, part):
    """safetensors' save_file or onnx.save fails part-way (a full disk): one line naming --out and
    the file, exit 2, and no bundle, half-written file, temporary or folder left."""
    full = os.strerror(errno.ENOSPC)
    if part == "weights.safetensors":
        import safetensors.torch
        from safetensors import SafetensorError

        def save_file(state, path, *a, **k):
            Path(path).write_bytes(b"half")  # what was written when the disk filled up
            raise SafetensorError(f"Error while serializing: I/O error: {full} (os error 28) at path {path!r}")

        monkeypatch.setattr(safetensors.torch, "save_file", save_file)
        argv = [*COMMANDS["export"], "--out", "new/bundle"]
    else:
        import onnx

        def save(model, path, *a, **k):
            with open(path, "wb") as fh:
                fh.write(b"half")
            raise OSError(errno.ENOSPC, full)  # a write() on a full disk: no file name

        monkeypatch.setattr(onnx, "save", save)
        argv = ["export", "tiny.toml", "--no-kernels", "--out", "new/bundle"]
    _refused(argv, capsys, work, "--out 'new/bundle'", part, full)


def _no_trial(monkeypatch):
    """Tuning raises if a study starts (beside ``_no_work``'s planning, checks and sweep)."""
    import rtcompile.tuning as tuning

    def started(*a, **k):
        raise AssertionError("a trial started before the store was checked")

    monkeypatch.setattr(tuning, "tune_bucket", started)


STORE_COMMANDS = {  # command -> argv before --storage (relative to the work folder)
    "tune": ["tune", "tiny.toml", "--trials", "1", "--phase", "decode"],
    "explore": ["explore", "tiny.toml", "--orders", "2", "--widths", "4", "--target", "h200", "--out", "ex"],
    "build": ["build", "tiny.toml", "--out", "p.json"],
}


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
@pytest.mark.parametrize("cmd", sorted(STORE_COMMANDS))
def test_an_unwritable_store_is_refused_before_any_work(work, capsys, monkeypatch, cmd, kind):
    ro = work / "ro"
    ro.mkdir()
    url = f"sqlite:///{ro / 's.db'}" if kind == "sqlite" else f"journal:{ro / 'j.log'}"
    _no_work(monkeypatch)
    _no_trial(monkeypatch)
    _unwritable(monkeypatch, ro, errno.EROFS)
    try:
        line = _refused([*STORE_COMMANDS[cmd], "--storage", url], capsys, work, f"storage {url!r}", "cannot write in",
                        str(ro))
    finally:
        os.chmod(ro, 0o755)
    assert os.strerror(errno.EROFS) in line


@pytest.mark.parametrize("moved", ["XDG_CACHE_HOME", "RTCOMPILE_TUNED"])
def test_tune_refuses_an_unwritable_cache_or_tuned_table_before_any_trial(work, capsys, monkeypatch, moved):
    ro = work / "ro"
    ro.mkdir()
    monkeypatch.setenv(moved, str(ro / ("cache" if moved == "XDG_CACHE_HOME" else "tuned.json")))
    _no_trial(monkeypatch)
    _unwritable(monkeypatch, ro, errno.EACCES)
    try:  # a store of its own, so the cache's (the default store) is not what is refused first
        line = _refused([*STORE_COMMANDS["tune"], "--storage", f"sqlite:///{work / 's.db'}"], capsys, work,
                        "cannot write in", str(ro))
    finally:
        os.chmod(ro, 0o755)
    assert f"${moved}" in line and os.strerror(errno.EACCES) in line


@pytest.mark.parametrize("content", [b"garbage\n", b"\x93\xff\x00 not text", b'{"op_code": 0}\n[1, 2]\n{"op'],
                         ids=["text-line", "binary-no-newline", "a-bad-second-line"])
@pytest.mark.parametrize("argv", [["tune", "--list"], STORE_COMMANDS["tune"]], ids=["list", "tune"])
def test_a_file_that_is_not_a_journal_is_refused_untouched(work, capsys, monkeypatch, content, argv):
    log = work / "j.log"
    log.write_bytes(content)
    _no_trial(monkeypatch)
    _refused([*argv, "--storage", f"journal:{log}"], capsys, work, f"journal:{log}", "is not an Optuna journal")
    assert log.read_bytes() == content


def test_an_optuna_journal_is_listed(work, capsys):
    import optuna
    from optuna.storages.journal import JournalFileBackend

    log = work / "j.log"
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # its notice would go to an earlier test's stderr
    try:
        optuna.create_study(study_name="rtcompile:some-bucket",
                            storage=optuna.storages.JournalStorage(JournalFileBackend(str(log))))
    finally:
        optuna.logging.set_verbosity(verbosity)
    capsys.readouterr()
    assert main(["tune", "--list", "--storage", f"journal:{log}"]) == 0
    cap = capsys.readouterr()
    assert "rtcompile:some-bucket" in "".join(cap.out.split()) and "Traceback" not in cap.err


@pytest.mark.parametrize("url", ["sqlite:///{}?mode=ro", "journal:{}?x=1"], ids=["sqlite", "journal"])
def test_a_file_store_url_with_a_query_is_refused(work, capsys, url):
    url = url.format(work / "s")
    _refused(["tune", "--list", "--storage", url], capsys, work, f"storage {url!r}", "takes no query")
    _refused([*STORE_COMMANDS["tune"], "--storage", url], capsys, work, "takes no query")
