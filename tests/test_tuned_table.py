"""The tuned-config table as its readers see it: a hand-edited entry of the wrong shape is
skipped with one warning by every reader (the launchers' lookup, ``rtcompile tune``'s table
writes, the planner), never a crash; the planner takes the entries the launcher would."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from rtcompile.kernels import tuned
from rtcompile.kernels.chunk_resident import ResidentConfig
from rtcompile.kernels.forms import default_config
from rtcompile.kernels.config import KernelShape
from rtcompile.plan import make_plan
from rtcompile.plan_options import measured_seconds
from rtcompile.spec import ModelSpec
from rtcompile.target import get_target
from rtcompile.tuning.store import has_entry, table_problem, write_tuned

WIDTHS, V, H = (2, 4), 8, 1
SHAPE = KernelShape(WIDTHS, V, 4)


@pytest.fixture(autouse=True)
def isolated(tuning_cache):
    """A private cache for every test (conftest's ``tuning_cache``)."""


def _entry(variant=None, gpu="cpu-interpreter", **kw):
    variant = variant or default_config("chunk", SHAPE).to_dict()
    return {**tuned.match_fields("chunk", WIDTHS, V, H, "float32", gpu), "batch": 1, "seq_len": 32,
            "variant": variant, "seconds": 1e-3, **kw}


def _write(entries):
    path = tuned.table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": tuned.FORMAT_VERSION, "entries": entries}))
    return path


def _malformed():
    good = _entry()
    no_batch = {k: v for k, v in _entry().items() if k != "batch"}
    return [None, _entry(batch="1"), no_batch, _entry(variant="resident"), _entry(seq_len=0),
            _entry(key_widths="2x4"), _entry(variant={"form": "no-such-form"}), _entry(kernel=["chunk"]), good]


@pytest.mark.parametrize("index, field", [(0, ": expected an object"), (1, ".batch"), (2, ": missing 'batch'"),
                                          (3, ".variant"), (4, ".seq_len"), (5, ".key_widths"), (6, ".variant"),
                                          (7, ".kernel")],
                         ids=["null", "str-batch", "no-batch", "str-variant", "zero-seq_len", "str-widths", "bad-form",
                              "list-kernel"])
def test_a_malformed_entry_is_skipped_with_a_warning_naming_it(index, field):
    """Before: every lookup (each kernel call without a variant) raised TypeError, KeyError or
    AttributeError from one hand-edited entry."""
    entries = _malformed()
    _write([entries[index], entries[-1]])
    with pytest.warns(RuntimeWarning, match="tuned-config table") as caught:
        table = tuned.reload()
    assert table == [entries[-1]]
    (w,) = caught
    assert f"entries[0]{field}" in str(w.message) and str(tuned.table_path()) in str(w.message), str(w.message)
    assert w.filename == __file__  # the warning points at the reload's caller, not into tuned.py
    assert tuned.lookup("chunk", WIDTHS, V, H, "float32", "cpu-interpreter", 1, 32) == entries[-1]["variant"]


def test_a_kernel_call_runs_beside_malformed_entries():
    from rtcompile import running_tensor

    _write(_malformed()[:-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        tuned.reload()
    q = [torch.randn(1, 20, H, w) for w in WIDTHS]
    k = [torch.randn(1, 20, H, w) for w in WIDTHS]
    o, _ = running_tensor(q, k, torch.randn(1, 20, H, V), mode="chunk", backend="triton")
    assert torch.isfinite(o).all()


def test_table_writes_skip_the_malformed_entries(tmp_path):
    """``rtcompile tune``'s table write and check (store.write_tuned, table_problem, has_entry)
    read the table as the launchers do: malformed entries are dropped, the rest kept."""
    entries = _malformed()
    path = _write(entries[:-1] + [_entry(batch=8)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert table_problem(path) is None
        write_tuned([entries[-1]], path)
        assert has_entry(entries[-1], path)
    kept = json.loads(path.read_text())["entries"]
    assert kept == [_entry(batch=8), entries[-1]]


def _plan_spec():
    return ModelSpec(order=3, key_widths=WIDTHS, value_width=V, heads=H, model_width=16, input_dtype="float32")


def test_the_planner_skips_malformed_entries():
    """Before: make_plan raised AttributeError on a null entry."""
    _write(_malformed()[:-1] + [_entry(gpu="NVIDIA H200", variant=ResidentConfig(16, 16).to_dict())])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        tuned.reload()
        plan = make_plan(_plan_spec(), get_target("h200"), batches=(1,), seq_lens=(32,), decode_batches=(2,))
    d = plan.decision_for("prefill", 1, 32)
    assert any(a["cost"]["source"] == "measured (tuned)" for a in d.alternatives)


@pytest.mark.parametrize("field, value", [("triton", "0.0.1"), ("package", "0.0.1"), ("source", "0" * 16)])
def test_the_planner_takes_only_entries_the_launcher_would(field, value):
    """An entry of another Triton, rtcompile or kernel source is stale for the launcher
    (tuned.match_fields): the planner leaves it out too. Before: it planned with it."""
    good = _entry(gpu="NVIDIA H200", variant=ResidentConfig(16, 16).to_dict())
    _write([_entry(gpu="NVIDIA H200", variant=ResidentConfig(16, 16).to_dict(), **{field: value})])
    tuned.reload()
    assert measured_seconds(_plan_spec(), get_target("h200")) == {}
    _write([good])
    tuned.reload()
    assert set(measured_seconds(_plan_spec(), get_target("h200"))) == {("chunk", 1, 32)}


def test_the_planner_leaves_out_a_config_its_check_refuses():
    """A config whose check refuses the shape on the target (C 128's product solve at these
    widths) is one the launcher would not run: the planner does not cost it either."""
    refused = ResidentConfig(chunk_size=128, block_v=16, solve="products")
    assert refused.check(SHAPE, get_target("h200").smem_per_sm) is not None
    _write([_entry(gpu="NVIDIA H200", variant=refused.to_dict())])
    tuned.reload()
    assert measured_seconds(_plan_spec(), get_target("h200")) == {}


def test_a_slower_winner_never_replaces_a_faster_entry_of_its_key(tmp_path):
    """Two studies of one table key (a full study and a ``--fix`` sub-space's, same kernel
    source and versions: the key holds them): the faster winner stays. Before: the last
    written replaced it, and a 3x slower config ran."""
    path = tmp_path / "tuned.json"
    fast = _entry(seconds=1e-3, study="full")
    slow = _entry(variant=ResidentConfig(32, 16).to_dict(), seconds=3e-3, study="fixed")
    write_tuned([fast], path)
    write_tuned([slow], path)
    assert json.loads(path.read_text())["entries"] == [fast]
    assert has_entry(slow, path)  # its key holds a faster winner: nothing to rewrite
    faster = _entry(variant=ResidentConfig(32, 16).to_dict(), seconds=5e-4, study="fixed")
    write_tuned([faster], path)
    assert json.loads(path.read_text())["entries"] == [faster]
    # an entry of other kernel sources is another key: both kept (the launcher takes its own)
    other = _entry(source="0" * 16, seconds=1e-4)
    write_tuned([other], path)
    assert json.loads(path.read_text())["entries"] == [faster, other]
    # a --retune's winner replaces its key's, slower or not (a lucky or since-refused
    # measurement could not be retuned away: review of 2026-12-05)
    write_tuned([slow], path, replace=True)
    assert json.loads(path.read_text())["entries"] == [other, slow]


def test_rtcompile_plan_beside_a_malformed_table(tmp_path, capsys):
    """`rtcompile plan` with a hand-edited table: the plan, the malformed entries skipped with
    one warning. Before: an AttributeError traceback."""
    from rtcompile.cli import main

    _write(_malformed())
    spec = tmp_path / "s.toml"
    spec.write_text('order = 3\nkey_widths = [2, 4]\nvalue_width = 8\nheads = 1\nmodel_width = 16\n'
                    'input_dtype = "float32"\n')
    tuned._table = None  # as a fresh process finds it: read at the first use
    with pytest.warns(RuntimeWarning, match="malformed entries in all"):
        assert main(["plan", str(spec), "--target", "h200", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["decisions"]


def test_another_versions_entries_are_kept_by_a_rewrite_and_never_judged():
    """The table is shared by every installed rtcompile: an entry another version wrote (a form
    this one lacks) draws no warning, serves no call here, and a rewrite keeps it as it was
    (it was called malformed and dropped by the next `rtcompile tune`)."""
    other = _entry(package="9.9.0", variant={"form": "tiled2", "block": 64})
    odd = {"package": "0.0.1", "anything": [1, 2]}  # another version's, whatever its fields
    path = _write([other, odd])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuned.reload(path) == []
        write_tuned([_entry(variant=ResidentConfig(16, 16).to_dict())], path)
    kept = json.loads(path.read_text())["entries"]
    assert other in kept and odd in kept and len(kept) == 3


def test_every_kernel_source_is_hashed_into_the_entries_it_serves():
    """A tuned entry is valid for the code it was measured on (``source_hash``): every kernels
    module that defines a Triton or Gluon kernel is hashed into some kernel's entries, and the
    split form's Gluon loop into the chunk kernel's. Before, chunk_split_gluon.py was in none,
    so a changed Gluon loop kept serving entries measured on the old one."""
    import re
    from pathlib import Path

    here = Path(tuned.__file__).parent
    jit = {p.name for p in here.glob("*.py") if re.search(r"@(triton|gluon)\.jit", p.read_text(encoding="utf-8"))}
    hashed = {name for names in tuned._SOURCES.values() for name in names}
    assert jit and jit <= hashed, f"kernel sources no entry's hash covers: {sorted(jit - hashed)}"
    assert "chunk_split_gluon.py" in tuned._SOURCES["chunk"]


@pytest.mark.parametrize("text", ['{"format": 1' + "0" * 5000 + ', "entries": []}', "[" * 100000 + "]" * 100000,
                                  b"\xff\xfe{".decode("latin-1")], ids=["5000-digits", "deep-nesting", "not-utf8"])
def test_an_unparsable_table_is_named(tmp_path, text):
    """A number past Python's 4300-digit limit (and nesting past the parser's recursion) escaped
    the reader as a bare ValueError / RecursionError that named no file."""
    path = tmp_path / "tuned.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=r"^tuned-config table '.*tuned\.json': unreadable \(") as info:
        tuned.read_table(path)
    assert "set_int_max_str_digits" not in str(info.value)


@pytest.mark.parametrize("from_env", [True, False], ids=["env", "cache-folder"])
def test_an_unreadable_table_warns_once_naming_where_its_path_came_from(from_env, monkeypatch):
    """Before: the warning named the file but not $RTCOMPILE_TUNED, so a user who had set it long
    ago did not see why this file was read."""
    path = tuned.table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json", encoding="utf-8")
    if not from_env:
        monkeypatch.delenv("RTCOMPILE_TUNED")
        monkeypatch.setattr(tuned, "cache_dir", lambda: path.parent)
    monkeypatch.setattr(tuned, "_table", None)
    with pytest.warns(RuntimeWarning, match="unreadable") as caught:
        assert tuned.entries() == []
    (w,) = caught
    assert str(path) in str(w.message)
    assert ("$RTCOMPILE_TUNED" in str(w.message)) == from_env, str(w.message)
    path.unlink()  # the fixture's closing reload reads the table
