"""The tuning store: Optuna's storages, opened safely, and the tuned-config table.

URLs: any SQLAlchemy URL Optuna's RDB storage takes (``sqlite:///path``,
``postgresql://user@host/db``), or ``journal:PATH`` for Optuna's journal file storage. The
default is a SQLite file in the rtcompile cache directory. Creating a SQLite store is
serialised with a file lock, because Optuna's schema creation races when several processes
create the same file at once.

Stale trials (a worker killed mid-trial): RDB storages (SQLite, PostgreSQL, ...) are opened
with Optuna's heartbeats. A worker records a heartbeat for the trial it runs every
``HEARTBEAT_S`` seconds; ``optuna.storages.fail_stale_trials`` fails a RUNNING trial whose
heartbeat is ``GRACE_S`` old, and the storage's retry callback enqueues the same parameters
again as a WAITING trial. Optuna 5.0's journal storage records no heartbeats: there
:func:`rtcompile.tuning.study.mark_stale` goes by a trial's age instead.
"""

from __future__ import annotations

import json
import os
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

from filelock import FileLock

from ..fileio import WriteError, atomic_write
from ..kernels import tuned

# A heartbeat is one small UPDATE per worker; every 5 s is noise next to a trial's compile and
# timing (seconds), and a grace of 4 beats (20 s) rides out a SQLite writer holding the file
# lock for a few seconds under eight workers without failing a live trial. A killed worker's
# trial is retried 20-25 s after the kill.
HEARTBEAT_S = 5
GRACE_S = 20
# A variant is retried at most twice after its worker died: a variant that takes its worker
# down every time (not seen: trials run in a process of their own) must not loop forever.
MAX_RETRIES = 2


class StoreError(ValueError):
    """The store cannot be opened or read: a one-line message naming the URL."""


def default_url() -> str:
    return f"sqlite:///{tuned.cache_dir() / 'tuning.db'}"


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between processes of this host, held for the ``with`` block (the
    lock file is created, with its folder, on first use and left in place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path):
        yield


HELD_DEVICE: str | None = None  # the device this process holds under device_lock (tests read it)


@contextmanager
def _shared_or_exclusive(path: Path, shared: bool) -> Iterator[None]:
    """flock(2) on ``path``: shared holders run together, an exclusive one alone (filelock's
    UnixFileLock takes the same flock exclusively, so both kinds interoperate). Where fcntl is
    missing (Windows) every holder is exclusive."""
    try:
        import fcntl
    except ImportError:
        with file_lock(path):
            yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextmanager
def device_lock(device: str, *, shared: bool = False) -> Iterator[None]:
    """A context manager held while a trial uses its device (this host only): exclusively to
    measure, ``shared`` to use it without timing anything (the explorer's recall training).

    Workers may outnumber the GPUs: their trial processes then import, compile and check in
    parallel (CPU work, several seconds each), and only the timed section waits here, so
    timings never overlap on one device nor run beside another worker's training, while
    trainings share it (a recall model of 400 k parameters leaves an H200 mostly idle: five
    trained side by side at 20-60 ms a step, 2026-12-02). GPUs are told apart by UUID, because
    each worker sees its own through CUDA_VISIBLE_DEVICES as device 0.
    """
    name = "cpu"
    if str(device).startswith("cuda"):
        import torch

        dev = torch.device(device)
        props = torch.cuda.get_device_properties(dev)
        name = f"cuda-{getattr(props, 'uuid', dev.index or 0)}"
    global HELD_DEVICE
    with _shared_or_exclusive(tuned.cache_dir() / "locks" / f"{name}.lock", shared):
        HELD_DEVICE = None if shared else name
        try:
            yield
        finally:
            HELD_DEVICE = None


def claim_lock(url: str | None = None):
    """A context manager that serialises claiming a WAITING trial across processes.

    Optuna's RDB storage claims with ``SELECT ... FOR UPDATE``, which SQLite ignores (and
    Python's sqlite3 runs that SELECT outside the transaction), so two workers could both move
    the same trial to RUNNING: seen in CI as ``UpdateFinishedTrialError`` when the slower one
    reported, and 3 of 3 times by the four-process claim test without this lock. A file lock
    next to the database closes that window. PostgreSQL's row lock and the journal storage's
    ordered log are atomic already, so they need none.
    """
    url = url or default_url()
    if serialises_claims(url):
        db = Path(url[len("sqlite:///"):])
        return file_lock(db.with_name(db.name + ".claim.lock"))
    return nullcontext()


def serialises_claims(url: str | None = None) -> bool:
    """True when :func:`claim_lock` is a real lock for this storage (SQLite), not a no-op."""
    return (url or default_url()).startswith("sqlite:///")


def retry_callback():
    """Optuna's retry of a stale trial (same parameters, a new WAITING trial), at most
    ``MAX_RETRIES`` times per variant, without the failed trial's worker attributes ("host",
    "pid"): Optuna copies user attributes into the retry, and a dead worker's pid there made the
    retry's next claimer look gone (``claims.worker_gone``) until it recorded its own, so a
    rerun's recovery failed the live claim (a flaky kill-and-rerun test, 2026-12-02). The
    callback's name changed in Optuna 4.9."""
    import copy

    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None) or optuna.storages.RetryFailedTrialCallback
        callback = cls(max_retry=MAX_RETRIES)

    def retry(study, trial) -> None:
        trial = copy.copy(trial)
        trial.user_attrs = {k: v for k, v in trial.user_attrs.items() if k not in ("host", "pid")}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            callback(study, trial)

    return retry


def retried_numbers(trials) -> set[int]:
    """The numbers of the trials that went stale and were retried (from the retries' history)."""
    import optuna

    cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None) or optuna.storages.RetryFailedTrialCallback
    out: set[int] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        for t in trials:
            out.update(cls.retry_history(t))
    return out


def heartbeat_interval(storage) -> int | None:
    """Seconds between a running trial's heartbeats, or None where the storage keeps none."""
    get = getattr(storage, "get_heartbeat_interval", None)
    return get() if get is not None else None


def _rdb_storage(url: str, **kwargs):
    import inspect

    import optuna

    # the callback's keyword was renamed in Optuna 4.9 (the old one warns until 6.0)
    params = inspect.signature(optuna.storages.RDBStorage).parameters
    key = "heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in params else "failed_trial_callback"
    with warnings.catch_warnings():  # the heartbeat arguments are marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                                          **{key: retry_callback()}, **kwargs)


def store_file(url: str | None = None) -> Path | None:
    """The file behind a SQLite or journal URL (None for a server database or in-memory SQLite)."""
    url = url or default_url()
    for prefix in ("sqlite:///", "journal:"):
        if url.startswith(prefix):
            name = url[len(prefix):].split("?", 1)[0]
            return None if name in ("", ":memory:") else Path(name)
    return None


SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite 3 database file


def _existing_file(url: str, path: Path, allowed: str) -> os.stat_result | None:
    """``path``'s stat when it exists (None when not); StoreError when it is a folder or another
    non-regular file (``allowed``: the kind of file the URL takes)."""
    import stat

    try:
        st = path.stat()
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise StoreError(f"storage {url!r}: {str(path)!r} is {kind}; allowed: {allowed} or a new path")
    return st


def _check_sqlite_file(url: str, path: Path, create: bool) -> None:
    """StoreError when an existing ``path`` is not an SQLite database: a folder or other
    non-regular file, a non-empty file without SQLite's header, or (``create`` False: listing)
    an empty file, which opening would turn into a new database. Checked before the lock file
    beside it is made, so a refused file leaves none."""
    if (st := _existing_file(url, path, "an SQLite database file")) is None:
        return  # absent: created (or, listing, refused) by the caller
    if st.st_size == 0:
        if not create:
            raise StoreError(f"storage {url!r}: {str(path)!r} is an empty file, not a tuning store (listing never "
                             "creates one); allowed: an SQLite database file")
        return  # SQLite makes an empty file a new database
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(SQLITE_HEADER))
    except OSError as exc:
        raise StoreError(f"storage {url!r}: cannot read {str(path)!r} ({exc.strerror or exc})") from None
    if head != SQLITE_HEADER:
        raise StoreError(f"storage {url!r}: {str(path)!r} is not an SQLite database (no 'SQLite format 3' "
                         "header); allowed: an SQLite database file, a new path, or journal:PATH")


def _check_journal_file(url: str, path: Path) -> None:
    """StoreError when an existing ``path`` is not an Optuna journal: a folder or other
    non-regular file, bytes that are not UTF-8, or a complete line that is not one JSON record
    of Optuna's (a dict with an ``op_code``). Optuna reads such a file as an empty store and
    fails only after a study has appended to it. A last line without its newline may be another
    process's write in progress: only its first character is checked."""
    import json

    if _existing_file(url, path, "an Optuna journal file") is None:
        return  # absent: created (or, listing, refused) by the caller
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise StoreError(f"storage {url!r}: cannot read {str(path)!r} ({exc.strerror or exc})") from None
    *lines, tail = data.split(b"\n")
    bad = None
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError alike
            record = None
        if not (isinstance(record, dict) and "op_code" in record):
            bad = number
            break
    if bad is None and tail.strip() and not tail.lstrip().startswith(b"{"):
        bad = len(lines) + 1
    if bad is not None:
        raise StoreError(f"storage {url!r}: {str(path)!r} is not an Optuna journal (line {bad} is not a journal "
                         "record); allowed: a journal file, a new path, or sqlite:///FILE")


def check_store_file(url: str | None, create: bool) -> None:
    """StoreError, before anything is created, when the file behind ``url`` cannot be (or, with
    ``create`` False, is not) there, or is there and is not an SQLite database or an Optuna
    journal (:func:`_check_sqlite_file`, :func:`_check_journal_file`), or the URL has a query
    (which SQLAlchemy would drop). Only the default store's folder (the cache) is created: a
    folder a user named that does not exist is a typo far more often than a wish for a new tree."""
    url = url or default_url()
    path = store_file(url)
    if path is None:
        return
    if "?" in url:
        # SQLAlchemy drops a query it does not know (?mode=ro: the file still opened read-write)
        raise StoreError(f"storage {url!r}: a file store takes no query ({url[url.index('?'):]!r}); allowed: "
                         "sqlite:///FILE or journal:PATH")
    if url.startswith("sqlite:///"):
        _check_sqlite_file(url, path, create)
    else:
        _check_journal_file(url, path)
    if url == default_url():
        return
    if not create and not path.exists():
        raise StoreError(f"storage {url!r}: no store at {str(path)!r} (listing never creates one)")
    if not path.parent.is_dir():
        raise StoreError(f"storage {url!r}: folder {str(path.parent)!r} does not exist; allowed: a file in an "
                         "existing folder")


PROBE_STUDY = "rtcompile:probe:no-such-study"  # looked up, never made (open_storage)


def open_storage(url: str | None = None, *, create: bool = True):
    """An Optuna storage for ``url`` (default: the cache's SQLite file); RDB storages keep
    heartbeats (see the module's docstring). With ``create`` False a SQLite or journal file that
    does not exist is a StoreError instead of a new, empty store."""
    import optuna
    import sqlalchemy.exc

    url = url or default_url()
    check_store_file(url, create)
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        path = store_file(url)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
        except Exception as exc:  # noqa: BLE001 -- any failure to read the log is a store error
            raise StoreError(f"storage {url!r}: cannot open the journal ({str(exc).splitlines()[0]})") from None
    try:
        if url.startswith("sqlite:///"):
            db = store_file(url)
            if db.exists() and not os.access(db, os.R_OK | os.W_OK):
                raise StoreError(f"storage {url!r}: the file is not readable and writable")
            with file_lock(db.with_name(db.name + ".lock")):
                # SQLite waits up to 60 s for a lock held by another worker instead of failing
                storage = _rdb_storage(url, engine_kwargs={"connect_args": {"timeout": 60}})
        else:
            storage = _rdb_storage(url)
        # a database whose tables are another program's (a "studies" table of other columns) is
        # opened without complaint and failed at the first study made: one indexed lookup of a
        # name no study has reads that table here (get_all_studies would load every study)
        try:
            storage.get_study_id_from_name(PROBE_STUDY)
        except KeyError:
            pass
        return storage
    except StoreError:
        raise
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError, RuntimeError, ValueError,
            ImportError, OSError) as exc:  # OSError: the lock file beside it cannot be made
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StoreError(f"storage {url!r}: cannot open ({first}); check the URL, or move a corrupted file away") from None


TABLE_KEYS = ("kernel", "source", "key_widths", "value_width", "heads", "dtype", "gpu", "triton", "package",
              "batch", "seq_len")


def study_entry(name: str, attrs: dict[str, Any]) -> dict[str, Any] | None:
    """The tuned-table entry a finished study records (from its user attributes: the key
    ``study.key_attrs`` wrote and the winner), or None for a study without a winner."""
    if "best_variant" not in attrs or not {"bucket", "machine", "source"} <= set(attrs):
        return None
    try:
        b, m = json.loads(attrs["bucket"]), json.loads(attrs["machine"])
        return {"kernel": b["kernel"], "source": attrs["source"], "key_widths": list(b["key_widths"]),
                "value_width": b["value_width"], "heads": b["heads"], "dtype": b["dtype"], "gpu": m["gpu"],
                "triton": m["triton"], "package": m["package"], "batch": b["batch"], "seq_len": b["seq_len"],
                "variant": attrs["best_variant"], "seconds": attrs.get("best_seconds"), "study": name}
    except (TypeError, KeyError, ValueError):
        return None  # a study some other tool wrote: not ours to record


def store_entries(storage) -> list[dict[str, Any]]:
    """Every winner the store holds, as table entries."""
    import optuna

    out = []
    for s in optuna.get_all_study_summaries(storage, include_best_trial=False):
        if s.study_name.startswith("rtcompile:") and (e := study_entry(s.study_name, s.user_attrs)) is not None:
            out.append(e)
    return out


TABLE = "tuned-config table"


def _from_env(path: Path | None) -> bool:
    """Is the table at ``path`` (None: the default) the one $RTCOMPILE_TUNED names?"""
    return path is None and bool(os.environ.get("RTCOMPILE_TUNED"))


def _env_named(text: str, path: Path | None) -> str:
    """``text`` (an error about the table) saying that $RTCOMPILE_TUNED named the table where
    it did: a path that no option gave is otherwise a puzzle."""
    if not _from_env(path):
        return text
    if text.startswith(TABLE + " "):
        return f"{TABLE} ($RTCOMPILE_TUNED) {text[len(TABLE) + 1:]}"
    return f"{TABLE} ($RTCOMPILE_TUNED): {text}"


def table_problem(path: Path | None = None) -> str | None:
    """Why the tuned-config table cannot be read (None: readable, or absent)."""
    where = Path(path) if path is not None else tuned.table_path()
    try:
        tuned.read_table(where)
    except ValueError as exc:
        return _env_named(str(exc).split(";")[0], path)
    return None


def _key(entry: dict[str, Any]) -> tuple[str, ...]:
    return tuple(json.dumps(entry.get(k)) for k in TABLE_KEYS)


def _faster(entry: dict[str, Any], than: dict[str, Any]) -> bool:
    """Is ``entry`` the better winner of its key than ``than``? Measured faster, or either
    lacks a measurement (nothing to compare: the later one). The key holds the kernel source
    and the Triton and rtcompile versions, so both were measured on the same code."""
    a, b = entry.get("seconds"), than.get("seconds")
    return a is None or b is None or a <= b


def _merge(table: list[dict[str, Any]], entries: list[dict[str, Any]], replace: bool = False) -> list[dict[str, Any]]:
    """``table`` with ``entries`` merged in, one entry per key: a new entry replaces the
    table's of its key (moved to the end) when it is faster (:func:`_faster`), else the
    table's stays. Two studies share a key (a full study and a ``--fix`` sub-space's, an
    exhaustive sweep): the last finished used to win, and a 3x slower sub-space winner then ran.
    ``replace``: the new entries replace their keys' whatever their speed (``--retune``)."""
    out = {_key(t): t for t in table}  # a dict keeps insertion order; one key each
    for e in entries:
        k = _key(e)
        if k not in out:
            out[k] = e
        elif replace or _faster(e, out[k]):
            del out[k]  # re-inserted last: the newest winner ends the table
            out[k] = e
    return list(out.values())


def write_tuned(entries: list[dict[str, Any]], path: Path | None = None, *, rebuild_from=None,
                replace: bool = False) -> Path:
    """Merge ``entries`` into the tuned-config table atomically (same key: the faster kept,
    :func:`_merge`). A table that cannot be read (corrupt, an older format) is replaced: by the
    winners of the storage ``rebuild_from`` when given (the table is derived data, the store is
    the record), else by ``entries`` alone. Malformed entries of this version in a readable
    table (``tuned.entry_problem``) are skipped by its reader, so a rewrite drops them; other
    versions' entries (``tuned.other_version``) are kept as they were. ``replace`` (a
    ``--retune``'s winner): ``entries`` replace their keys' even where those were faster (a
    lucky or since-refused measurement could not be retuned away)."""
    given, path = path, Path(path) if path is not None else tuned.table_path()
    try:
        with file_lock(path.with_name(path.name + ".lock")):
            try:
                old, others = tuned.read_table(path)
            except ValueError:
                old, others = (store_entries(rebuild_from) if rebuild_from is not None else []), []
            merged = others + _merge(_merge([], old), entries, replace)
            atomic_write(path, json.dumps({"format": tuned.FORMAT_VERSION, "entries": merged}, indent=1))
    except WriteError as exc:  # already one line naming the path; say where the path came from
        raise WriteError(_env_named(str(exc), given)) from exc
    tuned.reload(path)
    return path


def has_entry(entry: dict[str, Any], path: Path | None = None) -> bool:
    """Does the (readable) table hold ``entry``'s winner under its key, or one it does not
    replace (:func:`_merge`: a faster one)?"""
    path = Path(path) if path is not None else tuned.table_path()
    try:
        table, _ = tuned.read_table(path)
    except ValueError:
        return False
    return any(_key(e) == _key(entry) and (e.get("variant") == entry["variant"] or not _faster(entry, e))
               for e in table)
