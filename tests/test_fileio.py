"""rtcompile.fileio: atomic writes that honour the umask, leave nothing half-written, and the
cache folder."""

from __future__ import annotations

import os
import stat

import pytest

from rtcompile import fileio


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_write_honours_the_umask(tmp_path, umask_022):
    p = fileio.atomic_write(tmp_path / "a.json", '{"x": 1}\n')
    assert p.read_text() == '{"x": 1}\n' and _mode(p) == 0o644  # mkstemp would have made it 0600
    os.umask(0o077)
    fileio.atomic_write(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01" and _mode(tmp_path / "b.bin") == 0o600


def test_atomic_write_replaces_and_keeps_newlines(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("old")
    fileio.atomic_write(p, "a,b\r\nc,d\r\n")  # csv's line ends are written as given
    assert p.read_bytes() == b"a,b\r\nc,d\r\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["t.csv"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    p = tmp_path / "table.json"
    p.write_text("old content")

    def broken_replace(src, dst):
        assert os.path.exists(src) and open(src).read() == "new content"  # written in full first
        raise OSError("disk full")

    monkeypatch.setattr(fileio.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        fileio.atomic_write(p, "new content")
    assert p.read_text() == "old content"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["table.json"]


def test_a_write_interrupted_midway_leaves_no_file(tmp_path, monkeypatch):
    def interrupted(fd):
        raise KeyboardInterrupt  # after the data, before the rename

    monkeypatch.setattr(fileio.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fileio.atomic_write(tmp_path / "x.json", "{}")
    assert list(tmp_path.iterdir()) == []


def test_atomic_directory(tmp_path, umask_022):
    dest = tmp_path / "bundle"
    with fileio.atomic_directory(dest) as tmp:
        (tmp / "f.txt").write_text("1")
        assert not dest.exists()  # nothing visible until the block ends
    assert (dest / "f.txt").read_text() == "1" and _mode(dest) == 0o755  # mkdtemp: 0700
    with pytest.raises(FileExistsError):
        with fileio.atomic_directory(dest):
            pass
    with pytest.raises(RuntimeError):
        with fileio.atomic_directory(dest, overwrite=True) as tmp:
            (tmp / "g.txt").write_text("2")
            raise RuntimeError("export failed")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["bundle"]  # old bundle kept, no temporary
    assert sorted(x.name for x in dest.iterdir()) == ["f.txt"]
    with fileio.atomic_directory(dest, overwrite=True) as tmp:
        (tmp / "g.txt").write_text("2")
    assert sorted(x.name for x in dest.iterdir()) == ["g.txt"]


@pytest.mark.parametrize("after", [".tmp", "made"], ids=["after-temporary-folder", "after-a-parent"])
def test_atomic_directory_interrupted_right_after_a_mkdir_leaves_nothing(tmp_path, monkeypatch, after):
    """A Ctrl-C / SIGTERM (KeyboardInterrupt) landing just after a mkdir returned, before the
    code that lists the folder ran, left it behind: the temporary folder (outside both clean-up
    scopes, which caught only OSError then began at the yield; a flaky SIGTERM test in CI) or a
    parent folder made on the way."""
    real = os.mkdir

    def mkdir(path, *a, **kw):
        real(path, *a, **kw)
        if str(path).endswith(after):
            raise KeyboardInterrupt

    monkeypatch.setattr(fileio.os, "mkdir", mkdir)
    with pytest.raises(KeyboardInterrupt):
        with fileio.atomic_directory(tmp_path / "made" / "here" / "b"):
            pytest.fail("the block ran")
    assert list(tmp_path.iterdir()) == []


def test_remove_empty_skips_a_listed_folder_never_made(tmp_path):
    made = [tmp_path / "a", tmp_path / "a" / "b"]
    made[0].mkdir()
    fileio.remove_empty(made)
    assert list(tmp_path.iterdir()) == []


def test_file_sha256(tmp_path):
    import hashlib

    p = tmp_path / "w"
    p.write_bytes(b"abc" * 1000)
    assert fileio.file_sha256(p) == hashlib.sha256(b"abc" * 1000).hexdigest()


def test_cache_dir_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert fileio.cache_dir() == tmp_path / "rtcompile"


def test_honour_umask_fixes_a_library_made_0600_file(tmp_path, umask_022):
    p = tmp_path / "w.safetensors"
    p.write_bytes(b"x")
    os.chmod(p, 0o600)
    fileio.honour_umask(p)
    assert _mode(p) == 0o644 and sorted(x.name for x in tmp_path.iterdir()) == ["w.safetensors"]


def test_atomic_directory_replaces_only_what_may_replace_accepts(tmp_path):
    dest = tmp_path / "d"
    (dest / "sub").mkdir(parents=True)
    (dest / "sub" / "y").write_text("y")

    def refuse(path):
        raise ValueError(f"{path} is not mine to replace")

    with pytest.raises(ValueError, match="not mine"):
        with fileio.atomic_directory(dest, overwrite=True, may_replace=refuse) as tmp:
            (tmp / "x").write_text("new")
    assert (dest / "sub" / "y").read_text() == "y" and not (dest / "x").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temporary folder left
    seen = []
    with fileio.atomic_directory(dest, overwrite=True, may_replace=seen.append) as tmp:
        (tmp / "x").write_text("new")
    assert seen == [dest, dest]  # checked before writing and again just before the swap
    assert sorted(p.name for p in dest.iterdir()) == ["x"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # the old folder, moved aside, is gone


def test_read_whole_says_why_it_cannot_read(tmp_path):
    """One reader for the inputs read whole (a spec, export's --weights): each refusal in words, a
    FIFO refused rather than waited on."""
    from rtcompile.fileio import ReadError, read_whole

    (tmp_path / "f").write_bytes(b"abc")
    assert read_whole(tmp_path / "f") == b"abc"
    os.mkfifo(tmp_path / "fifo")
    for name, why in (("missing", "no such file"), (".", "is a folder"), ("fifo", "is not a regular file")):
        with pytest.raises(ReadError) as info:
            read_whole(tmp_path / name)
        assert info.value.why == why and isinstance(info.value, ValueError)


def test_read_whole_turns_a_permission_error_of_the_checks_into_its_refusal(tmp_path, monkeypatch):
    """Path.exists() raises PermissionError in a folder that cannot be searched (Python 3.11): a
    ReadError too, not a traceback from load_spec."""
    from pathlib import Path

    from rtcompile.fileio import ReadError, read_whole

    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "exists", denied)
    with pytest.raises(ReadError) as info:
        read_whole(tmp_path / "s.toml")
    assert info.value.why == "cannot be read (Permission denied)"
