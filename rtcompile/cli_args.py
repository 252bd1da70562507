"""Argument helpers shared by the command modules (``cli``, ``tune_cmd``, ``plan_cmd``,
``export_cmd``): the parser class, the usage error, and the value parsers.

This module imports no other command-line module (the rest of rtcompile only inside the
function that needs it, but for ``fileio``, which imports nothing of rtcompile), so every
command module can import it and none needs another: the command modules form no import cycle.

Output paths (``--out``) are checked before any work by trying them: a file is created and
removed in the folder that would hold the output (``os.access`` says yes to root in /sys or on
a read-only mount). The checks create nothing; a command makes its output's folders when it
writes (:func:`new_folders`, :func:`write_out`) and removes the ones it made if it then fails
before anything is in them.
"""

from __future__ import annotations

import argparse
import os
import secrets
import stat
from contextlib import contextmanager
from typing import Callable, Iterator

from .fileio import WriteError, make_folders, remove_empty

EXIT_USAGE = 2


class UsageError(Exception):
    """A command-line usage error: reported as one line, exit code 2."""


# The namespace attribute in which :class:`Once` records the options given during one parse;
# :class:`Parser` removes it before the namespace reaches a command
_GIVEN = "_rtcompile_given"


class Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as :class:`UsageError` (one line, no usage block)."""

    def error(self, message: str) -> None:  # argparse prints usage + message; we want one line
        raise UsageError(f"{self.prog}: {message}")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # every argument that stores a value may be given once (argparse keeps the last of
        # `--steps 4 --steps 8` silently): the registry's "store" (also the default action) is
        # Once, for this parser's argument groups too; appending options and flags are as they are
        self.register("action", None, Once)
        self.register("action", "store", Once)

    def parse_known_args(self, args=None, namespace=None):
        namespace, rest = super().parse_known_args(args, namespace)
        vars(namespace).pop(_GIVEN, None)  # a subcommand's parser removes it before its values are copied up
        return namespace, rest


class Once(argparse.Action):
    """An option that may be given once: ``--batch 1 --batch 2`` planned batch 2 alone (argparse
    keeps the last occurrence, silently). A comma list's options (metavar ``X,..``) take every
    value at once. :class:`Parser` makes every one-value option one of these."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = vars(namespace).setdefault(_GIVEN, set())
        if self.dest in given:
            if str(self.metavar or "").endswith(",.."):
                allowed = f"once, every value in one comma-separated list ({option_string} {self.metavar})"
            else:
                allowed = "once"
            raise argparse.ArgumentError(self, f"given more than once; allowed: {allowed}")
        given.add(self.dest)
        setattr(namespace, self.dest, values)


def int_at_least(lo: int):
    """A parser of integers >= ``lo``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {value}")
        return value

    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def finite_positive_float(text: str) -> float:
    """A number > 0 that is finite: seconds a budget or a limit is made of (``inf`` has no deadline
    to compute; TuneOptions refuses it)."""
    value = positive_float(text)
    if value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def number_list_of(kind: type, minimum: float | None, what: str):
    """An argparse type: comma-separated ``kind`` values (int or float) >= ``minimum`` (None: any;
    ``what`` names them in the error)."""

    def parse(text: str) -> list:
        items = text.split(",")
        if len(items) > 1 and any(not x.strip() for x in items):  # "1,,2" planned 1 and 2, silently
            raise argparse.ArgumentTypeError(f"empty item in {text!r}; allowed: comma-separated {what}")
        try:
            values = [kind(x) for x in items if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
        if not values or (minimum is not None and any(v < minimum for v in values)):
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
        return values

    return parse


def int_list_of(minimum: int, what: str):
    """An argparse type: comma-separated integers >= ``minimum`` (``what`` names them in the error)."""
    return number_list_of(int, minimum, what)


int_list = int_list_of(1, "positive integers")  # ``8,32``


def positive_int(text: str) -> int:
    """One integer >= 1 (a single-integer option's type: its error says so, not "comma-separated")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def nonempty(what: str):
    """An argparse type: text that is not empty (``--out ""`` was ignored as if not given);
    ``what`` names what is allowed in the error."""

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"empty; allowed: {what}")
        return text

    return parse


def fixed_param(text: str) -> tuple[str, object]:
    """NAME=VALUE, the value read as an integer, true/false, or kept as text."""
    name, sep, raw = text.partition("=")
    if not sep or not name.strip() or not raw.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    raw = raw.strip()
    value: object = raw
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    elif raw.lstrip("-").isdigit():
        value = int(raw)
    return name.strip(), value


def tuning_buckets(spec, phase: str, batch: list[int] | None, seq_len: list[int] | None,
               decode_batch: list[int] | None, on_gpu: bool) -> list:
    """The tuning buckets of ``spec`` for ``phase`` (prefill, decode, train or all: prefill and
    decode) at ``--batch``, ``--seq-len`` and ``--decode-batch`` (None: the GPU's or the CPU's
    defaults), without repeats: what ``tune`` tunes, and ``build`` on a GPU."""
    from .kernels.chunk_backward_widths import rewritten_widths
    from .tuning import Bucket

    batch = batch or ([8] if on_gpu else [1])
    seq = seq_len or ([4096] if on_gpu else [32])
    dec = decode_batch or ([32, 256] if on_gpu else [2])
    common = dict(key_widths=spec.key_widths, value_width=spec.value_width, heads=spec.heads, dtype=spec.input_dtype)
    out = []
    if phase in ("prefill", "all"):
        out += [Bucket("chunk", batch=b, seq_len=t, **common) for b in batch for t in seq]
    if phase in ("decode", "all"):
        out += [Bucket("recurrent", batch=b, seq_len=1, **common) for b in dec]
    if phase == "train":
        # widths the backward's kernels do not tile train rewritten (kernels/chunk_backward_widths.py):
        # the bucket is the rewritten shape's, under which a training call's backward looks it up
        train = {**common, "key_widths": rewritten_widths(spec.key_widths)}
        out += [Bucket("chunk_bwd", batch=b, seq_len=t, **train) for b in batch for t in seq]
    return list(dict.fromkeys(out))


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a broken link")):
        if test(mode):
            return name
    return "not a regular file"  # pragma: no cover


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def _existing_part(folder: str) -> str:
    """The nearest existing part of ``folder`` (absolute): what a later ``makedirs`` starts from."""
    while not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    return folder


def _cannot_create_in(base: str) -> str | None:
    """Why this process cannot create a file in the existing folder ``base`` (None: it can; a file
    is created and removed to find out)."""
    probe = os.path.join(base, f".rtcompile-probe.{os.getpid()}.{secrets.token_hex(8)}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        return _why(exc)
    os.close(fd)
    os.unlink(probe)
    return None


def _usable_folder(prog: str, text: str, folder: str) -> None:
    """``folder`` (absolute) can hold ``--out text``: its nearest existing part is a folder in
    which this process can create a file (created and removed here), so the rest can be made."""
    base = _existing_part(folder)
    if not os.path.isdir(base):
        raise UsageError(f"{prog}: --out {text!r}: {base!r} is {_kind(os.lstat(base).st_mode)}, not a folder; "
                         "allowed: a path whose existing parents are folders")
    if (why := _cannot_create_in(base)) is not None:
        raise UsageError(f"{prog}: --out {text!r}: cannot write in {base!r} ({why}); allowed: a path in "
                         "a folder this user can write")


def cannot_write_in(folder: str | os.PathLike) -> str | None:
    """Why this process could not create files in ``folder``, making it (and its parents) first
    where missing; None when it can. Tried, not asked (``os.access`` says yes to root on a
    read-only mount); nothing is left behind."""
    base = _existing_part(os.path.abspath(os.fspath(folder)))
    if not os.path.isdir(base):
        return f"{base!r} is {_kind(os.lstat(base).st_mode)}, not a folder"
    if (why := _cannot_create_in(base)) is not None:
        return f"cannot write in {base!r} ({why})"
    return None


def cannot_write(path: str | os.PathLike) -> str | None:
    """Why this process could not write the file ``path`` as rtcompile writes its own files (a
    lock or temporary beside it, then the file itself or a rename over it), or make the folders
    it needs; None when it can (:func:`cannot_write_in`, then the file itself)."""
    path = os.path.abspath(os.fspath(path))
    if (why := cannot_write_in(os.path.dirname(path))) is not None:
        return why
    if os.path.isfile(path):
        try:
            os.close(os.open(path, os.O_RDWR))  # an immutable file in a writable folder
        except OSError as exc:
            return f"cannot open {path!r} for writing ({_why(exc)})"
    return None


def check_cache_writable(prog: str) -> None:
    """The files a tuning run writes besides its store, before any trial: the rtcompile cache
    folder (device locks, cached references) and the tuned-config table ($RTCOMPILE_TUNED or
    the cache's tuned.json; a failure there came after every trial had run). A
    :class:`UsageError` naming the file and the environment variable that moves it."""
    from .fileio import cache_dir
    from .kernels.tuned import table_path

    for what, path, problem, moved_by in (("the cache folder", cache_dir(), cannot_write_in, "XDG_CACHE_HOME"),
                                          ("the tuned-config table", table_path(), cannot_write, "RTCOMPILE_TUNED")):
        if (why := problem(path)) is not None:
            raise UsageError(f"{prog}: {what} {os.fspath(path)!r}: {why}; allowed: a writable path (set ${moved_by})")


def _out_text(prog: str, out: str | os.PathLike, allowed: str) -> str:
    """``--out``'s text, refused when empty or blank (:class:`UsageError`; ``allowed`` says what
    the option takes)."""
    text = os.fspath(out)
    if not text.strip():
        raise UsageError(f"{prog}: --out {text!r}: empty; allowed: {allowed}")
    return text


def check_out_dir(prog: str, out: str | os.PathLike) -> None:
    """``--out DIR`` before any work (minutes of measuring, not after): a folder, or a new path
    whose existing parents are folders, writable (tried); else a :class:`UsageError` naming
    ``prog``'s option. Nothing is created."""
    text = _out_text(prog, out, "a folder path")
    path = os.path.abspath(text)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UsageError(f"{prog}: --out {text!r}: is {_kind(os.lstat(path).st_mode)}, not a folder; allowed: a "
                         "folder path or a new one")
    _usable_folder(prog, text, path)


def check_out_file(prog: str, out: str | os.PathLike) -> None:
    """``--out FILE`` before any work: a regular file (replaced atomically later) or a new path,
    never a folder, FIFO or device node; its folder existing or makeable, and writable (tried).
    Nothing is created."""
    text = _out_text(prog, out, "a regular file path or a new one")
    if text.endswith((os.sep, "/")):  # abspath drops the slash: "out/" would become a file named out
        raise UsageError(f"{prog}: --out {text!r}: ends with a slash, which names a folder; allowed: a file path "
                         f"({text.rstrip(os.sep + '/') or '.'}/plan.json)")
    path = os.path.abspath(text)
    if os.path.lexists(path):
        try:
            mode = os.stat(path).st_mode  # a link to a regular file is replaced as a file is
        except OSError:
            mode = os.lstat(path).st_mode  # a broken link: replaced by the new file
        if stat.S_ISDIR(mode) or not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            raise UsageError(f"{prog}: --out {text!r}: is {_kind(mode)}; allowed: a regular file path or a new one")
    _usable_folder(prog, text, os.path.dirname(path))


def check_out_not_input(prog: str, out: str | os.PathLike, name: str, given: str | os.PathLike) -> None:
    """``--out`` is not the input file ``given`` (``name``: what it is, "the spec file"): build's
    default --out plan.json, run on a spec copied to plan.json, replaced the spec with the
    plan. The same path once resolved (``./x/../spec.json``, a symbolic link), or the same file
    (a hard link): a :class:`UsageError` before any work."""
    a, b = os.path.realpath(out), os.path.realpath(given)
    try:
        same = a == b or os.path.samefile(a, b)
    except OSError:  # one of them absent: only the resolved paths can tell
        same = False
    if same:
        raise UsageError(f"{prog}: --out {os.fspath(out)!r}: is {name} {os.fspath(given)!r}, which the output would "
                         f"replace; allowed: another path")


def check_out_parent(prog: str, out: str | os.PathLike) -> None:
    """The folder that will hold ``--out`` (a bundle folder, which the command judges itself):
    existing or makeable, and writable (tried). Nothing is created."""
    text = _out_text(prog, out, "a folder path")
    _usable_folder(prog, text, os.path.dirname(os.path.abspath(text)))


@contextmanager
def new_folders(prog: str, folder: str | os.PathLike) -> Iterator[None]:
    """Make ``folder`` and its missing parents for ``--out``, and remove the ones made here when
    the block fails while they are still empty: a command that fails before writing its output
    leaves no folder behind."""
    try:
        made = make_folders(folder)
    except OSError as exc:
        raise UsageError(f"{prog}: --out: cannot create {str(exc.filename or folder)!r} ({_why(exc)}); allowed: a path "
                         "whose parents can be made") from None
    try:
        yield
    except BaseException:
        remove_empty(made)
        raise


def write_out(prog: str, out: str | os.PathLike, write: Callable[[], object]) -> None:
    """A command's final write of ``--out FILE``: ``write()`` (an atomic write of ``out``) with
    the file's folder made first. An OSError of that write (a full disk, a folder made read-only
    since the check, a FIFO put there since) is a :class:`UsageError` naming ``--out``; a folder
    made for it is removed again."""
    with new_folders(prog, os.path.dirname(os.path.abspath(out))):
        try:
            write()
        except WriteError as exc:  # already "cannot write <path>: <why>"
            raise UsageError(f"{prog}: --out {os.fspath(out)!r}: {exc}") from None
        except OSError as exc:
            raise UsageError(f"{prog}: --out {os.fspath(out)!r}: cannot write ({_why(exc)})") from None


def check_storage(url: str | None, create: bool) -> None:
    """``--storage URL`` before any work or notice: the file behind a SQLite or journal URL
    (``tuning.store.check_store_file``: its folder, and for SQLite that it is a database), and
    for a server database the URL's form and its SQLAlchemy dialect, without connecting; with
    ``create``, that this process can write the file (:func:`cannot_write`). Raises the store's
    StoreError (one line naming the storage)."""
    from .tuning.options import memory_store_refusal
    from .tuning.store import StoreError, check_store_file, store_file

    check_store_file(url, create)
    if (path := store_file(url)) is not None:  # None: the cache's file
        if create and (why := cannot_write(path)) is not None:
            from .tuning.store import default_url

            raise StoreError(f"storage {url or default_url()!r}: {why}; allowed: a store this user can write")
        return
    if (why := memory_store_refusal(url)) is not None:  # sqlite[+driver]://: gone at exit
        raise StoreError(why)
    if url.startswith("journal:"):
        raise StoreError(f"storage {url!r}: no file named; allowed: journal:PATH")
    import sqlalchemy.exc
    from sqlalchemy.engine import make_url

    try:
        make_url(url).get_dialect()
    except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.NoSuchModuleError, ImportError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StoreError(f"storage {url!r}: not a database URL this installation can open ({first}); allowed: "
                         "sqlite:///FILE, journal:PATH, or a SQLAlchemy URL of an installed driver "
                         "(postgresql://...)") from None
