"""Tuned kernel configurations, read as data at run time.

The tuner (``rtcompile.tuning``) writes a JSON table of winners; the launchers ask
:func:`lookup` for a variant when the caller gives none. Nothing here runs a study or imports
the tuner. An entry matches on kernel, kernel source hash, widths, value width, heads, dtype,
GPU name and Triton/package versions; among matches the nearest shape bucket (log distance in
B and T) wins; with no match the caller falls back to the variant's default.

The table file is ``$RTCOMPILE_TUNED`` if set, else ``tuned.json`` in the rtcompile cache
directory (``$XDG_CACHE_HOME/rtcompile`` or ``~/.cache/rtcompile``). It is read once per
process and on :func:`reload`. The table is advice: a kernel call that finds it unreadable
(corrupt, or an older format) warns once and runs the defaults; ``rtcompile tune`` rebuilds
it from the tuning store. An entry of the wrong shape (a hand edit: ``"batch": "1"``, a
missing field, ``null``) is skipped by every reader, with one warning naming the file and the
field (:func:`entry_problem`): one bad entry must not stop every kernel call, nor ``rtcompile
tune`` and ``rtcompile plan``, which read the table through :func:`reload` too.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

FORMAT_VERSION = 2
# earlier formats, named in the refusal (their entries hold configs this version cannot read)
OLD_FORMATS = {1: "rtcompile 0.1's (ChunkVariant / RecurrentVariant entries without a 'form' tag)"}
_SOURCES = {
    # chunk_split_gluon.py: the split form's sm_90 state loop (loop="gluon"), missing until
    # 2026-12-05, so a tuned entry outlived a change of that loop
    "chunk": ("chunk_prepare.py", "chunk_resident.py", "chunk_streamed.py", "chunk_fused.py", "chunk_split.py",
              "chunk_split_gluon.py", "chunk_split_kron.py", "chunk_streamed_gluon.py", "chunk_stepped.py",
              "blocks.py", "solves.py"),
    # layer_step.py: the fused layer step runs a recurrent entry's config (serving_step.fused_step_plan)
    "recurrent": ("recurrent.py", "layer_step.py", "blocks.py"),
    # the backward runs the split (or streamed) form's prepare kernel and state loop for its recompute
    "chunk_bwd": ("chunk_backward.py", "chunk_backward_state.py", "chunk_backward_grads.py", "chunk_backward_factors.py",
                  "chunk_backward_streamed.py", "chunk_backward_kept.py", "chunk_backward_split.py",
                  "chunk_prepare.py", "chunk_split.py", "chunk_streamed.py", "blocks.py", "solves.py"),
}
_table: list[dict[str, Any]] | None = None
# Bumped whenever the table is (re)read: the launch-plan caches key on it, so a plan found
# before a table changed is not reused after (launch.py's call plans, the decode plans).
_generation = 0


def cache_dir() -> Path:
    """The rtcompile cache folder (:func:`rtcompile.fileio.cache_dir`)."""
    from ..fileio import cache_dir as folder

    return folder()


def table_path() -> Path:
    return Path(os.environ.get("RTCOMPILE_TUNED") or cache_dir() / "tuned.json")


@functools.lru_cache(maxsize=None)
def source_hash(kernel: str) -> str:
    """sha256 (first 16 hex digits) of the kernel's Triton source: a tuned entry is only valid
    for the code it was measured on."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in _SOURCES[kernel]:
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def reload(path: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """(Re)read the table this process looks configs up in: :func:`read_table`'s entries of
    this version. A missing file is an empty table, a malformed one an error."""
    global _table, _generation
    _generation += 1
    _table, _ = read_table(Path(path) if path is not None else table_path(), stacklevel=3)
    return _table


def read_table(path: Path, stacklevel: int = 2) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(this version's valid entries, other versions' entries as they were) of the table at
    ``path``; reads nothing into the module. The table is shared by every installed version:
    the second list is what a rewrite keeps unjudged (``store.write_tuned``). A missing file is
    empty; one that is not a format-FORMAT_VERSION table raises ValueError naming it. A
    malformed entry of this version is skipped with one warning, attributed ``stacklevel``
    frames up as ``warnings.warn`` counts from here (2: the caller)."""
    if not path.exists():
        return [], []
    from ..fileio import parse_problem

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: JSON, UTF-8, a number past 4300 digits
        raise ValueError(f"tuned-config table {str(path)!r}: unreadable ({parse_problem(exc)}); "
                         "delete it or re-run `rtcompile tune`") from None
    if isinstance(data, dict) and data.get("format") in OLD_FORMATS:
        raise ValueError(f"tuned-config table {str(path)!r}: format {data['format']} is {OLD_FORMATS[data['format']]}; "
                         f"this version reads format {FORMAT_VERSION}: delete the file and re-run `rtcompile tune`")
    if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION or not isinstance(data.get("entries"), list):
        raise ValueError(f"tuned-config table {str(path)!r}: not a format-{FORMAT_VERSION} table; "
                         "delete it or re-run `rtcompile tune`")
    mine, others = [], []
    for i, e in enumerate(data["entries"]):
        (others if other_version(e) else mine).append((i, e))
    return _valid_entries(path, mine, stacklevel + 1), [e for _, e in others]


# what an entry must hold to serve a call (match_fields' keys and the shape bucket); "seconds"
# and "study" are optional: a table written by hand or by an older tune may lack them
_STRING_KEYS = ("source", "dtype", "gpu", "triton", "package")
_SIZE_KEYS = ("value_width", "heads", "batch", "seq_len")


def entry_problem(entry: Any, where: str = "entry") -> str | None:
    """Why ``entry`` cannot serve a call (``<where>.<field>: ...`` naming what is allowed), or
    None: the fields :func:`lookup` compares and reads, each of its type, and a variant the
    kernel's configs read (``forms.config_from_dict``)."""
    from ..fields import FieldError, check_float, check_int, check_ints, check_type
    from .forms import config_from_dict  # forms sits above the launchers, which import this module

    try:
        check_type(where, entry, dict, "an object")
        missing = [k for k in ("kernel", *_STRING_KEYS, "key_widths", *_SIZE_KEYS, "variant") if k not in entry]
        if missing:
            return f"{where}: missing {', '.join(map(repr, missing))}"
        check_type(f"{where}.kernel", entry["kernel"], str, "a string")
        if entry["kernel"] not in _SOURCES:
            return f"{where}.kernel: got {entry['kernel']!r}; allowed: {', '.join(_SOURCES)}"
        for k in _STRING_KEYS:
            check_type(f"{where}.{k}", entry[k], str, "a string")
        check_ints(f"{where}.key_widths", entry["key_widths"], 1, None, "integers >= 1")
        for k in _SIZE_KEYS:
            check_int(f"{where}.{k}", entry[k], 1)
        if entry.get("seconds") is not None:
            check_float(f"{where}.seconds", entry["seconds"], lambda x: x > 0, "a number > 0 or null")
        config_from_dict(entry["variant"], entry["kernel"])
    except FieldError as exc:
        return str(exc)
    except (TypeError, ValueError) as exc:  # config_from_dict's refusal, naming the config's field
        return f"{where}.variant: {str(exc).splitlines()[0]}"
    return None


def other_version(entry: Any) -> bool:
    """Is ``entry`` another rtcompile version's (its ``package`` a string naming another)? The
    table is shared by every installed version: such an entry never serves this one
    (``match_fields``), is not judged by this version's configs (a newer form is no defect),
    and a rewrite keeps it as it was (``store.write_tuned``)."""
    from .._version import __version__

    return isinstance(entry, dict) and isinstance(entry.get("package"), str) and entry["package"] != __version__


def _valid_entries(path: Path, entries: list[tuple[int, Any]], stacklevel: int) -> list[dict[str, Any]]:
    """This version's ``entries`` (with their index in the file) less the malformed ones, with
    one warning naming the first and the count."""
    problems = [(e, entry_problem(e, f"entries[{i}]")) for i, e in entries]
    bad = [why for _, why in problems if why is not None]
    if bad:
        more = f" ({len(bad)} malformed entries in all)" if len(bad) > 1 else ""
        warnings.warn(f"tuned-config table {str(path)!r}: {bad[0]}; that entry is skipped{more}: fix or delete it "
                      "(a table rewrite by `rtcompile tune` drops it)", RuntimeWarning, stacklevel=stacklevel)
    return [e for e, why in problems if why is None]


def generation() -> int:
    """A number that changes whenever the table is (re)read (see the launch-plan caches); reads
    the table first if no call has yet, so a plan's key is not retired by that first read."""
    if _table is None:
        entries()
    return _generation


def entries() -> list[dict[str, Any]]:
    """The table's entries; an unreadable table is an empty one, with one warning per process
    (until :func:`reload`): a bad table of advice must not stop every kernel call."""
    global _table
    if _table is None:
        try:
            reload()
        except ValueError as exc:
            _table = []
            named = " (the file $RTCOMPILE_TUNED names)" if os.environ.get("RTCOMPILE_TUNED") else ""
            warnings.warn(f"{exc}{named}; until then the kernels use their default configs", RuntimeWarning,
                          stacklevel=2)
    return _table


def match_fields(kernel: str, key_widths, value_width: int, heads: int, dtype: str, gpu: str) -> dict[str, Any]:
    """The fields an entry must equal to serve a call (everything but the shape bucket)."""
    import triton

    from .._version import __version__

    return {
        "kernel": kernel, "source": source_hash(kernel), "key_widths": list(key_widths),
        "value_width": value_width, "heads": heads, "dtype": dtype, "gpu": gpu,
        "triton": triton.__version__, "package": __version__,
    }


def lookup(kernel: str, key_widths, value_width: int, heads: int, dtype: str, gpu: str,
           batch: int, seq_len: int) -> dict[str, Any] | None:
    """The tuned variant (as a dict) for the nearest bucket, or None."""
    table = entries()
    if not table:
        return None
    want = match_fields(kernel, key_widths, value_width, heads, dtype, gpu)
    best, best_d = None, math.inf
    for e in table:
        if any(e.get(k) != v for k, v in want.items()):
            continue
        d = abs(math.log2(max(1, e["batch"])) - math.log2(max(1, batch)))
        d += abs(math.log2(max(1, e["seq_len"])) - math.log2(max(1, seq_len)))
        if d < best_d:
            best, best_d = e, d
    return None if best is None else dict(best["variant"])
