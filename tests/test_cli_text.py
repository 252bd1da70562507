"""What a user typed is shown as typed: a spec's name, a spec, bundle or store path and a note
holding Rich markup (``[/bold]``, ``[red]``, ``[v2]``) print verbatim in the CLI's tables, never
parsed as markup (an unmatched closing tag raised MarkupError, a traceback after the work was
done; a matched tag was silently dropped from a name)."""

from __future__ import annotations

import io

import pytest

from rtcompile.cli import main
from conftest import TINY_SPEC

MARKUP = "x[/bold]y [red]z [v2]"
SPEC = f'name = "{MARKUP}"\n' + TINY_SPEC


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A folder whose path holds markup (``d[/i]``), with the spec inside; a private cache."""
    root = tmp_path / "d[/i]"
    root.mkdir(parents=True)
    (root / "s.toml").write_text(SPEC)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("RTCOMPILE_TUNED", str(tmp_path / "cache" / "tuned.json"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return root


def _ran(argv, capsys) -> str:
    """Run the CLI: exit 0, no traceback; stdout without whitespace (a table wraps its title)."""
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err and "MarkupError" not in cap.err, cap.err
    assert code == 0, cap.err
    return _squeezed(cap.out)


def _squeezed(text: str) -> str:
    return "".join(str(text).split())


@pytest.mark.parametrize("command", ["info", "plan"])
def test_spec_name_with_markup_prints_verbatim(work, capsys, command):
    out = _ran([command, work / "s.toml"], capsys)
    assert _squeezed(MARKUP) in out


def test_bundle_name_and_path_with_markup_print_verbatim(work, capsys):
    bundle = work / "b"
    _ran(["export", work / "s.toml", "--out", bundle, "--vocab", "11", "--no-onnx", "--no-kernels"], capsys)
    out = _ran(["inspect", bundle], capsys)
    assert _squeezed(MARKUP) in out and _squeezed(bundle) in out


def test_store_path_with_markup_prints_verbatim(work, capsys):
    import optuna

    store = work / "t.db"
    optuna.storages.RDBStorage(f"sqlite:///{store}")  # an empty store: the table is its title alone
    out = _ran(["tune", "--list", "--storage", f"sqlite:///{store}"], capsys)
    assert _squeezed(store) in out


def test_bench_and_explore_tables_print_cells_verbatim():
    from rtcompile.bench.report import _print_table
    from rtcompile.explore.report import print_table

    buf = io.StringIO()
    _print_table(f"bench {MARKUP}", ["case", "note"], [("a[/b]", "[red]c")], buf)
    text = _squeezed(buf.getvalue())
    assert _squeezed(f"bench {MARKUP}") in text and "a[/b]" in text and "[red]c" in text
    head = {"base_spec": {"name": MARKUP}, "speed_source": "model", "target": "h[/b]", "match": None, "recall": False}
    rec = {"id": "p0", "key_widths": [4, 4], "status": "refused", "note": "[/n] refused"}
    buf = io.StringIO()
    print_table([rec], head, buf)
    text = _squeezed(buf.getvalue())
    assert _squeezed(MARKUP) in text and "h[/b]" in text and "[/n]refused" in text
