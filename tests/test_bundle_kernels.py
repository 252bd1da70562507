"""Compiled Triton kernels in a bundle (``export/compiled.py``): what export collects from a
Triton cache, what load installs, and what it refuses. The cache here is a stand-in folder laid
out as Triton writes one, on the GPU machine too (export runs as without CUDA); the GPU run is `benchmarks/gpu_checks.py bundle`."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from rtcompile.cli import main
from rtcompile.export import BUNDLE_FORMAT, BundleError, export_bundle, load_bundle, verify_bundle
from rtcompile.export import compiled
from rtcompile.fileio import file_sha256
from rtcompile.model import RunningTensorLM
from rtcompile.spec import ModelSpec

SPEC = ModelSpec(order=3, key_widths=(2, 4), value_width=5, heads=2, model_width=12, layers=2)
ENTRY = "K5ZQ3Y2XW4ABCDEFGHIJ0123456789abcdef"
H200 = {"gpu": "NVIDIA H200", "capability": "9.0", "triton": "3.6.0", "cuda": "12.8", "torch": "2.11.0"}


def _fake_cache(root: Path) -> Path:
    """One entry as Triton 3.6 writes it: metadata, cubin, IR, a group file with absolute paths,
    plus what must never travel: its host launcher (a shared library), a lock, a temp folder."""
    entry = root / ENTRY
    entry.mkdir(parents=True)
    for name, data in (("chunk_kernel.json", b'{"name": "chunk_kernel"}'), ("chunk_kernel.cubin", b"\x7fELF cubin"),
                       ("chunk_kernel.ptx", b"// ptx"), ("__triton_launcher.so", b"\x7fELF host code"),
                       ("lock", b"")):
        (entry / name).write_bytes(data)
    children = {n: str(entry / n) for n in ("chunk_kernel.json", "chunk_kernel.cubin", "chunk_kernel.ptx")}
    (entry / "__grp__chunk_kernel.json").write_text(json.dumps({"child_paths": children}))
    (root / "tmp.pid_1_x").mkdir()
    return root


@pytest.fixture
def bundle(tmp_path, monkeypatch):
    # exported as on a machine without CUDA (no kernels of its own), so each test adds the fake
    # cache's entry alone: on the GPU machine (H100, 2026-12-05) export compiled 40 real files
    # into the bundle and four tests counting files failed
    torch.manual_seed(0)
    with monkeypatch.context() as m:
        m.setattr(compiled, "machine_key", lambda: None)
        return export_bundle(RunningTensorLM(SPEC, vocab_size=11), tmp_path / "b", onnx=False, compiled=True)


def _with_kernels(path: Path, tmp_path: Path, key=H200) -> list[str]:
    """Add the fake cache's entry to a written bundle, listed with hashes, as export would."""
    names = compiled.collect(_fake_cache(tmp_path / "cache"), path)
    m = json.loads((path / "manifest.json").read_text())
    m["kernels"] = {"key": key}
    m["files"].update({n: {"sha256": file_sha256(path / n), "bytes": (path / n).stat().st_size} for n in names})
    (path / "manifest.json").write_text(json.dumps(m))
    return names


def test_export_on_a_machine_without_cuda_writes_no_kernels(bundle):
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["format"] == BUNDLE_FORMAT == 3 and m["kernels"] is None
    assert not (bundle / "kernels").exists() and not (bundle / "warmup.json").exists()


def test_collect_takes_data_files_only_and_names_group_members_by_file(bundle, tmp_path):
    names = _with_kernels(bundle, tmp_path)
    assert sorted(names) == sorted(f"kernels/{ENTRY}/{n}" for n in ("__grp__chunk_kernel.json", "chunk_kernel.cubin",
                                                                     "chunk_kernel.json", "chunk_kernel.ptx"))
    group = json.loads((bundle / "kernels" / ENTRY / "__grp__chunk_kernel.json").read_text())
    assert group["child_paths"]["chunk_kernel.cubin"] == "chunk_kernel.cubin"  # no path of the exporting machine


def test_another_machines_kernels_load_with_one_message_and_install_nothing(bundle, tmp_path, monkeypatch):
    _with_kernels(bundle, tmp_path)
    cache = tmp_path / "triton-cache"
    monkeypatch.setattr(compiled, "triton_cache_dir", lambda: cache)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = load_bundle(bundle)
    msgs = [str(w.message) for w in seen if "compiled kernel" in str(w.message)]
    assert len(msgs) == 1 and "NVIDIA H200" in msgs[0] and "compile on first use" in msgs[0], msgs
    assert not cache.exists() and isinstance(model, RunningTensorLM)


def test_this_machines_kernels_are_installed_where_triton_looks(bundle, tmp_path, monkeypatch):
    names = _with_kernels(bundle, tmp_path)
    cache = tmp_path / "triton-cache"
    monkeypatch.setattr(compiled, "triton_cache_dir", lambda: cache)
    monkeypatch.setattr(compiled, "machine_key", lambda: dict(H200))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # installing says nothing
        load_bundle(bundle)
    got = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file())
    assert got == sorted(n.removeprefix("kernels/") for n in names)
    group = json.loads((cache / ENTRY / "__grp__chunk_kernel.json").read_text())
    assert all(Path(p).is_absolute() and Path(p).is_file() for p in group["child_paths"].values()), group
    assert (cache / ENTRY / "chunk_kernel.cubin").read_bytes() == b"\x7fELF cubin"


def test_an_entry_already_in_the_cache_is_never_replaced(bundle, tmp_path, monkeypatch):
    """Triton's cache is shared by the user's processes: a bundle adds what is missing and
    changes nothing there (an existing cubin under the same key stays byte for byte)."""
    names = _with_kernels(bundle, tmp_path)
    cache = tmp_path / "triton-cache"
    (cache / ENTRY).mkdir(parents=True)
    (cache / ENTRY / "chunk_kernel.cubin").write_bytes(b"\x7fELF compiled here")
    monkeypatch.setattr(compiled, "triton_cache_dir", lambda: cache)
    monkeypatch.setattr(compiled, "machine_key", lambda: dict(H200))
    done = compiled.install(verify_bundle(bundle))
    assert done[0] and f"installed {len(names) - 1} compiled kernel files" in done[1] and "1 already there" in done[1]
    assert (cache / ENTRY / "chunk_kernel.cubin").read_bytes() == b"\x7fELF compiled here"
    assert (cache / ENTRY / "chunk_kernel.ptx").read_bytes() == b"// ptx"


def test_a_tampered_kernel_is_refused_before_anything_is_installed(bundle, tmp_path, monkeypatch):
    _with_kernels(bundle, tmp_path)
    cache = tmp_path / "triton-cache"
    monkeypatch.setattr(compiled, "triton_cache_dir", lambda: cache)
    monkeypatch.setattr(compiled, "machine_key", lambda: dict(H200))
    (bundle / "kernels" / ENTRY / "chunk_kernel.cubin").write_bytes(b"\x7fELF other")
    with pytest.raises(BundleError, match=f"kernels/{ENTRY}/chunk_kernel.cubin: does not match its sha256"):
        load_bundle(bundle)
    assert not cache.exists()


@pytest.mark.parametrize("content, needle", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "allowed: an object"),
    (b'{"child_paths": {"chunk_kernel.cubin": 7}}', "allowed: the name of a file of its entry"),
    (b'{"child_paths": {"chunk_kernel.cubin": ".."}}', "allowed: the name of a file of its entry"),
    (b'{"child_paths": {"chunk_kernel.cubin": "/etc/passwd"}}', "allowed: the name of a file of its entry"),
    (b'{"child_paths": {"chunk_kernel.cubin": "a/chunk_kernel.cubin"}}', "allowed: the name of a file of its entry"),
    (b'{"child_paths": {"chunk_kernel.cubin": "other.cubin"}}', "allowed: the name of a file of its entry"),
    (b'{"child_paths": ["chunk_kernel.cubin"]}', "'child_paths' is list"),
], ids=["bad-json", "list", "non-string", "dot-dot", "absolute", "separator", "unlisted", "children-list"])
def test_a_malformed_group_file_is_refused_before_anything_is_installed(bundle, tmp_path, monkeypatch, content,
                                                                        needle, capsys):
    """install crashed on it halfway, after writing the entry's other files into Triton's cache,
    and wrote a member path of '..' or '/etc/passwd' into the cache's group file."""
    _with_kernels(bundle, tmp_path)
    group = f"kernels/{ENTRY}/__grp__chunk_kernel.json"
    (bundle / group).write_bytes(content)
    m = json.loads((bundle / "manifest.json").read_text())
    m["files"][group] = {"sha256": file_sha256(bundle / group), "bytes": len(content)}
    (bundle / "manifest.json").write_text(json.dumps(m))
    cache = tmp_path / "triton-cache"
    monkeypatch.setattr(compiled, "triton_cache_dir", lambda: cache)
    monkeypatch.setattr(compiled, "machine_key", lambda: dict(H200))
    with pytest.raises(BundleError, match=f"{group}: .*{re.escape(needle)}"):
        load_bundle(bundle)
    assert not cache.exists()
    assert main(["inspect", str(bundle)]) == 2  # inspect validates as load does
    assert group in capsys.readouterr().err


def test_install_writes_the_kernels_it_verified_not_files_swapped_in_after(bundle, tmp_path, monkeypatch):
    from rtcompile.export import bundle as bundle_module

    _with_kernels(bundle, tmp_path)
    cache = tmp_path / "triton-cache"
    monkeypatch.setattr(compiled, "triton_cache_dir", lambda: cache)
    monkeypatch.setattr(compiled, "machine_key", lambda: dict(H200))
    real = bundle_module.verify_bundle

    def racing(path):  # a writer replacing a cubin once it has been hashed
        verified = real(path)
        (Path(path) / "kernels" / ENTRY / "chunk_kernel.cubin").write_bytes(b"\x7fELF forged")
        return verified

    monkeypatch.setattr(bundle_module, "verify_bundle", racing)
    load_bundle(bundle)
    assert (cache / ENTRY / "chunk_kernel.cubin").read_bytes() == b"\x7fELF cubin"


@pytest.mark.parametrize("name", ["__triton_launcher.so", "run.py", "../x.json"])
def test_code_or_odd_names_under_kernels_are_refused(bundle, tmp_path, name):
    _with_kernels(bundle, tmp_path)
    extra = f"kernels/{ENTRY}/{name}"
    target = bundle / "kernels" / ENTRY / name
    target.write_bytes(b"\x7fELF")
    m = json.loads((bundle / "manifest.json").read_text())
    m["files"][extra] = {"sha256": file_sha256(target), "bytes": target.stat().st_size}
    (bundle / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="never loaded from a bundle|points outside the bundle"):
        load_bundle(bundle)


@pytest.mark.parametrize("kernels, files, needle", [
    (None, True, "but 'kernels' is null"),
    ({"key": {"gpu": "x"}}, False, "'kernels' must be null or"),
    ({"key": H200, "extra": 1}, False, "'kernels' must be null or"),
    ("H200", False, "'kernels' must be null or"),
])
def test_malformed_kernels_entries_are_refused(bundle, tmp_path, kernels, files, needle, capsys):
    if files:
        _with_kernels(bundle, tmp_path)
    m = json.loads((bundle / "manifest.json").read_text())
    m["kernels"] = kernels
    (bundle / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match=needle):
        load_bundle(bundle)
    assert main(["inspect", str(bundle)]) == 2  # inspect validates as load does
    assert needle.split("'")[0] in capsys.readouterr().err


def test_a_format_2_bundle_still_loads(bundle):
    m = json.loads((bundle / "manifest.json").read_text())
    m["format"] = 2
    del m["kernels"]
    (bundle / "manifest.json").write_text(json.dumps(m))
    assert isinstance(load_bundle(bundle), RunningTensorLM)


def test_force_replaces_a_bundle_with_kernels(bundle, tmp_path):
    _with_kernels(bundle, tmp_path)
    torch.manual_seed(1)
    export_bundle(RunningTensorLM(SPEC, vocab_size=11), bundle, onnx=False, overwrite=True)
    assert not (bundle / "kernels").exists()


def test_load_and_first_calls_import_no_compiler(bundle):
    """A serving process that loads a bundle, prefills and decodes never imports torch._dynamo
    (3.3-3.5 s of the 4.4 s that load took on the CPU machine, before): a fresh process, the
    reference backend (no GPU here)."""
    import subprocess
    import sys

    code = ("import sys, torch, rtcompile\n"
            f"m = rtcompile.load({str(bundle)!r})\n"
            "with torch.no_grad():\n"
            "    m(torch.zeros(1, 5, dtype=torch.long), backend='reference')\n"
            "    m.generate(torch.zeros(1, 3, dtype=torch.long), 2, backend='reference')\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"


def test_constant_result_marks_as_dynamo_does():
    """functional.constant_result sets what torch.compiler.assume_constant_result sets, without
    importing torch._dynamo (a torch that marks functions otherwise fails here, not silently)."""
    from rtcompile.functional import constant_result

    def ours():
        return 1

    def theirs():
        return 1

    constant_result(ours)
    torch.compiler.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) and vars(theirs)
