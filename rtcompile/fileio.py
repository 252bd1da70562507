"""Writing files so that a reader never sees half of one, hashing them, and the cache folder.

Every file the package writes (specs, plans, bundles, the tuned-config table, bench results,
cached references and rates) goes through :func:`atomic_write` or :func:`atomic_directory`:
the data lands in a temporary name in the destination's own folder (``os.replace`` is atomic
only within one file system) and is renamed over the destination once complete.

The temporary file and folder are created with modes 0o666 and 0o777, so the process umask
applies as it would to a plain ``open``: under umask 022 a file ends 0644 and a bundle folder
0755. ``tempfile.mkstemp`` / ``mkdtemp`` would create 0600 / 0700, which left bundles and
tables unreadable to the other users of a shared machine.

A failure of those writes themselves (making the folder or the temporary, writing it, the
rename) is a :class:`WriteError`, an OSError naming the destination; so is a destination that
exists and is not a regular file (a FIFO, a device node, a folder): it is never replaced. A
writer of its own (safetensors, onnx) into the temporary folder of :func:`atomic_directory`
runs inside :func:`writing`, which makes its OSError such a WriteError too.

This module imports nothing from rtcompile, so any layer (kernels, tuning, export, CLI) may
use it without an import cycle.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

__all__ = ["ReadError", "WriteError", "atomic_directory", "atomic_write", "cache_dir", "file_sha256", "honour_umask",
           "parse_problem", "read_whole", "unique_keys", "writing"]

# A clash of two 64-bit random names is improbable; the retries only bound a pathological loop.
_NAME_TRIES = 16


class WriteError(OSError):
    """An output could not be written, or its destination is not a regular file: one line that
    names the path (the OSError that caused it, if any, is its ``__cause__``)."""


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


class ReadError(ValueError):
    """An input file that cannot be read whole; ``why`` says so in words for the caller's own
    message: "no such file", "is a folder", "is not a regular file", "cannot be read (<reason>)"."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{str(path)!r}: {why}")
        self.why = why


def read_whole(path: str | os.PathLike) -> bytes:
    """A regular file's bytes, read once; ReadError otherwise (a FIFO is refused, not waited on)."""
    p = Path(path)
    try:  # the checks too: exists() raises PermissionError in a folder that cannot be searched
        if p.exists() and not p.is_file():
            raise ReadError(p, "is a folder" if p.is_dir() else "is not a regular file")
        return p.read_bytes()
    except FileNotFoundError:
        raise ReadError(p, "no such file") from None
    except OSError as exc:
        raise ReadError(p, f"cannot be read ({_why(exc)})") from None


def unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``json.loads``' ``object_pairs_hook`` for the files rtcompile reads (plans, manifests):
    the object as a dict, or ValueError naming a repeated key (json keeps the last value silently,
    so a hand-edited file's first value would be ignored unseen)."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears more than once")
        out[key] = value
    return out


def parse_problem(exc: BaseException) -> str:
    """A parser's error (json, tomllib) as one line for a message: its first line, less Python's
    advice on its int digit limit ("Exceeds the limit (4300 digits) for integer string
    conversion ...; use sys.set_int_max_str_digits() ..."), which a command's user cannot follow."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text.split("; use sys.set_int_max_str_digits")[0]


def _failed(dest: Path, exc: OSError, part: str | None = None) -> WriteError:
    if isinstance(exc, WriteError):
        return exc
    return WriteError(f"cannot write {str(dest)!r}{f' ({part})' if part else ''}: {_why(exc)}")


@contextmanager
def writing(dest: str | os.PathLike, part: str | None = None) -> Iterator[None]:
    """A block that writes ``dest`` (``part``: which file of a folder being built for it, named
    in the message): an OSError of the block, with or without a file name (a ``write`` on a
    full disk has none), is a :class:`WriteError` naming ``dest``. Writing to a temporary name
    and renaming it into place (what leaves nothing half-written) stays the caller's."""
    try:
        yield
    except OSError as exc:
        raise _failed(Path(dest), exc, part) from exc


def _refuse_non_regular(dest: Path) -> None:
    """WriteError when ``dest`` exists and is not a regular file (a link to one is)."""
    try:
        mode = os.stat(dest).st_mode
    except OSError:
        return  # absent (or unreachable: the write reports that)
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else \
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"
        raise WriteError(f"{str(dest)!r} is {kind}: not replaced by a file; allowed: a regular file path or a new one")


def _temp_name(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")


def _create(dest: Path) -> tuple[Path, int]:
    """A new temporary file beside ``dest``, mode 0o666 less the umask: (its path, an fd)."""
    for _ in range(_NAME_TRIES):
        tmp = _temp_name(dest)
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
        except FileExistsError:
            continue
    raise FileExistsError(f"{str(dest)!r}: could not create a temporary file beside it")  # pragma: no cover


def honour_umask(path: str | os.PathLike) -> None:
    """Give a file that a library created 0600 (safetensors' ``save_file`` does) the mode a
    plain ``open`` would have given it: 0o666 less the umask. The umask is read from a probe
    file, not with ``os.umask`` (setting it to read it races with other threads)."""
    dest = Path(path)
    probe, fd = _create(dest)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
        os.unlink(probe)
    os.chmod(dest, mode)


def atomic_write(path: str | os.PathLike, data: bytes | str, *, encoding: str = "utf-8") -> Path:
    """Write ``data`` (bytes, or text encoded with ``encoding``, newlines written as given) to
    ``path`` atomically: on any failure the destination keeps its old content (or stays absent)
    and no temporary file is left behind. The folder must exist. Returns the path."""
    dest = Path(path)
    payload = data.encode(encoding) if isinstance(data, str) else bytes(data)
    _refuse_non_regular(dest)
    try:
        tmp, fd = _create(dest)
    except OSError as exc:
        raise _failed(dest, exc) from exc
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())  # the rename must not become visible before the data
        _refuse_non_regular(dest)  # again: one may have been put there meanwhile
        os.replace(tmp, dest)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise _failed(dest, exc) from exc
        raise
    return dest


def make_folders(folder: str | os.PathLike) -> list[Path]:
    """Make ``folder`` and its missing parents, outermost first; returns the folders made (one
    that appears meanwhile is not ours: not listed, never removed). On an OSError the ones made
    are removed again (:func:`remove_empty`) before it propagates."""
    missing, p = [], Path(os.path.abspath(folder))
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    made: list[Path] = []
    try:
        for d in reversed(missing):
            # listed before the mkdir: an interrupt (Ctrl-C, SIGTERM) landing just after it still
            # finds the folder; one listed but never made is skipped by remove_empty
            made.append(d)
            try:
                os.mkdir(d)
            except FileExistsError:
                made.pop()
                if not d.is_dir():
                    raise
    except BaseException:
        remove_empty(made)
        raise
    return made


def remove_empty(made: list[Path]) -> None:
    """Remove the folders of ``made`` (:func:`make_folders`' list), innermost first, while empty
    (one that something was written into since stays, and so do the folders above it)."""
    for d in reversed(made):
        try:
            os.rmdir(d)
        except FileNotFoundError:  # listed, never made (make_folders interrupted before its mkdir)
            continue
        except OSError:
            return


@contextmanager
def atomic_directory(path: str | os.PathLike, *, overwrite: bool = False,
                     may_replace: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """Build a folder in a temporary one beside ``path`` (yielded) and rename it into place when
    the block ends without an exception; on an exception it is removed and ``path`` is left as it
    was. With ``overwrite`` an existing ``path`` is moved aside, the new folder renamed into
    place, then the old one removed (a folder cannot be renamed over a non-empty one); without
    it, an existing ``path`` is a FileExistsError before anything is written. ``may_replace``
    (called with ``path`` before anything is written and again just before the old folder is
    moved aside) raises to refuse replacing what is there. Making the folders and the rename
    failing, or an OSError of the block on a path inside the temporary folder, is a WriteError.
    The missing parent folders of ``path`` are made, and removed again (those still empty) when
    it is not written: a failed export leaves no folder behind, from the CLI or the API."""
    dest = Path(path)
    if dest.exists() or dest.is_symlink():
        if not overwrite:
            raise FileExistsError(f"{str(dest)!r} already exists")
        if may_replace is not None:
            may_replace(dest)
    made: list[Path] = []
    tmp: Path | None = None
    try:
        made = make_folders(dest.absolute().parent)
        for _ in range(_NAME_TRIES):
            tmp = _temp_name(dest)  # named before the mkdir: an interrupt just after it still finds it
            try:
                os.mkdir(tmp, 0o777)  # the umask applies (mkdtemp would make it 0700)
            except FileExistsError:
                tmp = None  # not ours
                continue
            break
        else:  # pragma: no cover
            raise FileExistsError(f"{str(dest)!r}: could not create a temporary folder beside it")
    except BaseException as exc:  # an OSError, or Ctrl-C / SIGTERM before the block's own clean-up scope
        if tmp is not None:
            remove_empty([tmp])
        remove_empty(made)
        if isinstance(exc, OSError):
            raise _failed(dest, exc) from exc
        raise
    try:
        try:
            yield tmp
        except OSError as exc:  # a file of the bundle that could not be written
            inside = exc.filename is not None and Path(os.path.abspath(exc.filename)).is_relative_to(tmp.absolute())
            if inside:
                raise _failed(dest, exc) from exc
            raise
        old = None
        if dest.exists() or dest.is_symlink():
            if may_replace is not None:
                may_replace(dest)  # again: the folder may have changed while the new one was built
            old = _temp_name(dest)
            os.replace(dest, old)  # aside, not deleted: a failed rename below puts it back
        try:
            os.replace(tmp, dest)
        except BaseException as exc:
            if old is not None:
                os.replace(old, dest)
            if isinstance(exc, OSError):
                raise _failed(dest, exc) from exc
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_empty(made)
        raise
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 hex digest of a file's bytes, read in blocks (``hashlib.file_digest``)."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def cache_dir() -> Path:
    """rtcompile's cache folder (tuning store, tuned-config table, measured rates, locks):
    platformdirs' user cache folder for "rtcompile", i.e. ``$XDG_CACHE_HOME/rtcompile`` or
    ``~/.cache/rtcompile`` on Linux (read on every call: tests point ``XDG_CACHE_HOME`` at a
    private folder), ``~/Library/Caches/rtcompile`` on macOS."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("rtcompile", appauthor=False))
