"""The package's layering rules, checked on the source with ``ast`` (nothing is imported):

- no module below the package root imports the root (``from .. import __version__``: the
  version lives in ``rtcompile/_version.py``; importing the root from inside loads the public
  API, and an import cycle with it);
- no private name (``_x``) is imported from another module;
- the command-line modules (``cli*.py``, ``*_cmd.py``) form no import cycle, and the command
  modules take their shared helpers from ``cli_args``, never from ``cli`` or each other;
- the model knows nothing of export or ONNX (the exporter hands the model its mixer).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "rtcompile"
ROOT = "rtcompile"

NOT_YET_CHECKED: tuple[str, ...] = ()  # every module is checked


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imports(module: str, path: Path):
    """(imported module, names taken from it, line) for every import statement of the file,
    at any depth (a function-level import is an import too); relative imports resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _package_of(module, path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            # ``from . import tune_cmd`` imports the submodule ``rtcompile.tune_cmd``
            subs = [n for n in names if f"{target}.{n}" in MODULES]
            for n in subs:
                yield f"{target}.{n}", [], node.lineno
            rest = [n for n in names if n not in subs]
            if rest or not subs:
                yield target, rest, node.lineno


def _rel(path: Path) -> str:
    return path.relative_to(PKG).as_posix()


def _skipped(path: Path) -> bool:
    return _rel(path).startswith(NOT_YET_CHECKED)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_the_walk_sees_the_package():
    # a walk that found nothing would pass every rule below
    assert {"rtcompile", "rtcompile.cli", "rtcompile.cli_args", "rtcompile.model", "rtcompile.tuning.study",
            "rtcompile.export.bundle"} <= set(MODULES)
    found = {t for t, _, _ in _imports("rtcompile.cli", MODULES["rtcompile.cli"])}
    assert {"rtcompile.cli_args", "rtcompile.tune_cmd", "rtcompile._version"} <= found


def test_no_module_imports_the_package_root():
    bad = []
    for module, path in MODULES.items():
        if module == ROOT or _skipped(path):
            continue
        for target, names, line in _imports(module, path):
            if target == ROOT:
                bad.append(f"{_rel(path)}:{line} imports the package root ({', '.join(names) or 'import rtcompile'})")
    assert not bad, "\n".join(bad)


def test_no_private_name_is_imported_across_modules():
    bad = []
    for module, path in MODULES.items():
        if _skipped(path):
            continue
        for target, names, line in _imports(module, path):
            if not target.startswith(ROOT) or (target in MODULES and _skipped(MODULES[target])):
                continue  # other projects' names are theirs; see NOT_YET_CHECKED
            for n in names:
                if _is_private(n):
                    bad.append(f"{_rel(path)}:{line} imports {n} from {target}")
    assert not bad, "\n".join(bad)


def _cli_graph() -> dict[str, set[str]]:
    cli = {m for m, p in MODULES.items() if m.count(".") == 1 and (p.stem.startswith("cli") or p.stem.endswith("_cmd"))}
    return {m: {t for t, _, _ in _imports(m, MODULES[m]) if t in cli and t != m} for m in cli}


def test_the_command_line_modules_form_no_import_cycle():
    graph = _cli_graph()
    assert {"rtcompile.cli", "rtcompile.cli_args", "rtcompile.tune_cmd", "rtcompile.plan_cmd",
            "rtcompile.export_cmd"} <= set(graph)
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            pytest.fail("import cycle: " + " -> ".join(stack[stack.index(node):] + [node]))
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, stack + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    # the command modules share helpers through cli_args only
    for m, targets in graph.items():
        if m.endswith("_cmd"):
            assert targets <= {"rtcompile.cli_args"}, f"{m} imports {sorted(targets)}"
    assert graph["rtcompile.cli_args"] == set()


def test_cycle_check_catches_a_cycle(monkeypatch):
    """The walk above can fail: a planted cycle among the graph's modules is reported."""
    graph = _cli_graph()
    graph["rtcompile.cli_args"] = {"rtcompile.cli"}
    monkeypatch.setattr(f"{__name__}._cli_graph", lambda: graph)
    with pytest.raises(pytest.fail.Exception, match="import cycle"):
        test_the_command_line_modules_form_no_import_cycle()


@pytest.mark.parametrize("module", ["rtcompile.model", "rtcompile.functional"])
def test_the_model_knows_nothing_of_export(module):
    targets = {t for t, _, _ in _imports(module, MODULES[module])}
    assert not {t for t in targets if t.startswith(("rtcompile.export", "onnx", "onnxscript", "onnxruntime"))}


def test_design_layout_names_every_module():
    """docs/design.md's layout block names every module file of the package, so a newcomer's map
    stays true when files are added or renamed."""
    layout = (PKG.parent / "docs" / "design.md").read_text(encoding="utf-8").split("## ", 2)[1]
    missing = sorted(_rel(p) for p in PKG.rglob("*.py") if p.name != "__init__.py" and p.name not in layout)
    assert not missing, f"docs/design.md's layout does not name: {missing}"
