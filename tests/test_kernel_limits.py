"""Size limits of the package: no Triton kernel over 120 lines or with more than 20 constexpr
parameters, no module over 600 lines (read with ``ast``, nothing imported)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rtcompile"
MAX_KERNEL_LINES = 120
MAX_CONSTEXPRS = 20
MAX_MODULE_LINES = 600


def _is_triton_jit(dec: ast.expr) -> bool:
    """``@triton.jit`` or ``@triton.jit(...)``."""
    node = dec.func if isinstance(dec, ast.Call) else dec
    return isinstance(node, ast.Attribute) and node.attr == "jit" and isinstance(node.value, ast.Name) \
        and node.value.id == "triton"


def _is_constexpr(ann: ast.expr | None) -> bool:
    """``tl.constexpr`` (or ``triton.language.constexpr``)."""
    return isinstance(ann, ast.Attribute) and ann.attr == "constexpr"


def kernels(path: Path) -> list[tuple[str, int, int]]:
    """(name, body lines from the def line to the last line, constexpr parameters) of every
    ``@triton.jit`` function in ``path`` whose name ends in ``_kernel``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") \
                and any(_is_triton_jit(d) for d in node.decorator_list):
            a = node.args
            params = a.posonlyargs + a.args + a.kwonlyargs
            n_const = sum(_is_constexpr(p.annotation) for p in params)
            out.append((node.name, node.end_lineno - node.lineno + 1, n_const))
    return out


KERNEL_FILES = sorted((PACKAGE / "kernels").glob("*.py"))
MODULES = sorted(PACKAGE.rglob("*.py"))


def test_the_walk_finds_the_kernels():
    """The checks below see something: the chunk forms' kernels are found and counted."""
    names = {name for path in KERNEL_FILES for name, _, _ in kernels(path)}
    assert {"chunk_prepare_kernel", "chunk_resident_kernel", "chunk_streamed_kernel", "chunk_split_state_kernel",
            "chunk_split_output_kernel"} <= names


def test_the_counts_are_right(tmp_path):
    src = tmp_path / "k.py"
    src.write_text("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                   "def toy_kernel(x, A: tl.constexpr, B: tl.constexpr, c):\n    pass\n    pass\n\n\n"
                   "@triton.jit\ndef helper(x, A: tl.constexpr):\n    pass\n\n\ndef plain_kernel(x):\n    pass\n")
    assert kernels(src) == [("toy_kernel", 3, 2)]


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_kernel_size(path):
    for name, lines, n_const in kernels(path):
        assert lines <= MAX_KERNEL_LINES, f"{path.name}: {name} is {lines} lines (> {MAX_KERNEL_LINES})"
        assert n_const <= MAX_CONSTEXPRS, f"{path.name}: {name} takes {n_const} constexprs (> {MAX_CONSTEXPRS})"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_size(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(PACKAGE)}: {lines} lines (> {MAX_MODULE_LINES})"
