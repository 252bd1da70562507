"""Bundles: written atomically, loaded without tuning or pickle, refused when tampered."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

import rtcompile
from rtcompile.cli import main
from rtcompile.export import BUNDLE_FORMAT, BundleError, export_bundle, load_bundle
from rtcompile.model import RunningTensorLM
from rtcompile.plan import make_plan
from rtcompile.spec import ModelSpec
from rtcompile.target import get_target

SPEC = ModelSpec(order=3, key_widths=(2, 4), value_width=5, heads=2, model_width=12, layers=2)


@pytest.fixture
def bundle(tmp_path):
    torch.manual_seed(0)
    model = RunningTensorLM(SPEC, vocab_size=11)
    plan = make_plan(SPEC, get_target("h200"), batches=(1,), seq_lens=(1, 4096), decode_batches=(1,))
    return model, export_bundle(model, tmp_path / "b", plan=plan, onnx=False), plan


def test_round_trip_runs_the_same_model(bundle):
    model, path, plan = bundle
    loaded = rtcompile.load(path)
    tokens = torch.randint(0, 11, (2, 7))
    with torch.no_grad():
        a, _ = model(tokens, backend="reference")
        b, _ = loaded(tokens, backend="reference")
    assert torch.equal(a, b)
    assert loaded.plan.to_dict() == plan.to_dict() and not loaded.training
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "weights.safetensors"]
    assert not any(p.name.startswith(".") for p in path.parent.iterdir())  # no temporary left


def test_load_holds_the_weights_about_once_at_its_peak(tmp_path):
    """The model is built on the meta device and its parameters are views of the verified
    bytes: the peak is those bytes once, not the bytes, safetensors' copies and a randomly
    initialised model besides. Measured in a fresh process (Linux's VmHWM): 1.41x the weights
    here with the imports the load makes; 2.42x with safetensors' copies, 3.42x before both."""
    import subprocess
    import sys

    torch.manual_seed(0)
    model = RunningTensorLM(ModelSpec(order=2, key_widths=(4,), value_width=4, heads=1, model_width=256, layers=1),
                            vocab_size=100_000)  # 51 M parameters, 205 MB: the tables dominate
    path = export_bundle(model, tmp_path / "b", onnx=False)
    weights = (path / "weights.safetensors").stat().st_size
    script = ("import pathlib, rtcompile, torch\n"
              "def kib(field):\n"
              "    line = next(x for x in pathlib.Path('/proc/self/status').read_text().splitlines() if x.startswith(field))\n"
              "    return int(line.split()[1])\n"
              "before = kib('VmRSS:')\n"
              "pathlib.Path('/proc/self/clear_refs').write_text('5')  # the peak (VmHWM) restarts from now\n"
              f"m = rtcompile.load({str(path)!r})\n"
              "assert all(p.device.type == 'cpu' and p.dtype == torch.float32 and p.requires_grad for p in m.parameters())\n"
              "print((kib('VmHWM:') - before) * 1024)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    peak = int(out.stdout.split()[-1])
    assert peak < 1.9 * weights, f"load's peak {peak / weights:.2f}x the weights"
    loaded = rtcompile.load(path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def test_load_builds_the_model_on_the_default_device_and_dtype(bundle):
    """Built on the meta device and then given the file's tensors, the model still lands where
    the caller's default device and dtype say (``with torch.device("cuda"): rtcompile.load(p)``),
    as when it was built there and copied into. The meta device stands in for a GPU here."""
    model, path, _ = bundle
    with torch.device("meta"):
        assert {p.device.type for p in rtcompile.load(path).parameters()} == {"meta"}
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        loaded = rtcompile.load(path)
    finally:
        torch.set_default_dtype(before)
    assert {p.dtype for p in loaded.parameters()} == {torch.float64}
    assert all(torch.equal(a.double(), b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def _edit_manifest(path: Path, fn):
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m))


def test_refusals(bundle, tmp_path):
    _, path, _ = bundle
    # tampered weights
    data = bytearray((path / "weights.safetensors").read_bytes())
    data[-1] ^= 1
    (path / "weights.safetensors").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="does not match its sha256"):
        load_bundle(path)
    # missing file
    (path / "weights.safetensors").unlink()
    with pytest.raises(BundleError, match="weights.safetensors is missing"):
        load_bundle(path)
    # a folder in its place: named as one, not as missing
    (path / "weights.safetensors").mkdir()
    with pytest.raises(BundleError, match="weights.safetensors is a folder"):
        load_bundle(path)
    (path / "weights.safetensors").rmdir()
    # newer format
    _edit_manifest(path, lambda m: m.update(format=BUNDLE_FORMAT + 1))
    with pytest.raises(BundleError, match="newer than this rtcompile reads"):
        load_bundle(path)
    # an entry pointing outside the bundle
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"x")
    _edit_manifest(path, lambda m: (m.update(format=BUNDLE_FORMAT), m["files"].update({"../secret.bin": {"sha256": "0"}})))
    with pytest.raises(BundleError, match="points outside the bundle"):
        load_bundle(path)


def test_loading_never_unpickles(bundle, monkeypatch):
    _, path, _ = bundle
    import pickle

    def refuse(*a, **kw):
        raise AssertionError("pickle used while loading a bundle")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    rtcompile.load(path)


def test_cli_export_and_inspect(tmp_path, capsys):
    spec = tmp_path / "s.toml"
    spec.write_text('order = 3\nkey_widths = [2, 4]\nvalue_width = 5\nheads = 2\nmodel_width = 12\n')
    out = tmp_path / "bundle"
    old_umask = os.umask(0o022)
    try:
        assert main(["export", str(spec), "--out", str(out), "--vocab", "13"]) == 0
    finally:
        os.umask(old_umask)
    # on a CUDA machine export also stores the compiled kernels (kernels/, issue 21)
    kernels = ["kernels"] if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else []
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["decode.onnx", "manifest.json", "prefill.onnx", "weights.safetensors", *kernels])
    # the umask decides, as for any file: readable by the other users of a shared machine
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert all(stat.S_IMODE(p.stat().st_mode) == (0o755 if p.is_dir() else 0o644) for p in out.rglob("*"))
    assert main(["run", str(out), "--tokens", "1,2,3", "--steps", "4"]) == 0
    assert "decoded" in capsys.readouterr().out
    assert main(["inspect", str(out)]) == 0
    assert "verified" in capsys.readouterr().out
    assert main(["export", str(spec), "--out", str(out)]) == 2  # exists: refused without --force
    assert "already exists" in capsys.readouterr().err
    junk = bytearray((out / "weights.safetensors").read_bytes())
    junk[-1] ^= 1  # of its recorded size (another size is refused before the file is hashed)
    (out / "weights.safetensors").write_bytes(bytes(junk))
    assert main(["inspect", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sha256" in err[0]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", ["plain-folder", "fake-manifest", "bundle-plus-user-file", "a-file"])
def test_force_refuses_what_is_not_a_bundle_and_leaves_it_intact(case, tmp_path, capsys):
    # `export --force` onto a user's folder deleted keep.txt and sub/y and said "bundle written".
    spec = tmp_path / "s.toml"
    spec.write_text('order = 3\nkey_widths = [2, 4]\nvalue_width = 5\nheads = 2\nmodel_width = 12\n')
    out = tmp_path / "out"
    if case == "a-file":
        out.write_text("notes")
    elif case == "bundle-plus-user-file":
        assert main(["export", str(spec), "--out", str(out), "--no-onnx"]) == 0
        (out / "keep.txt").write_text("mine")
    else:
        (out / "sub").mkdir(parents=True)
        (out / "keep.txt").write_text("mine")
        (out / "sub" / "y").write_text("y")
        if case == "fake-manifest":
            (out / "manifest.json").write_text('{"note": "a file a user happened to name manifest.json"}')
    capsys.readouterr()
    before = out.read_bytes() if case == "a-file" else _tree(out)
    assert main(["export", str(spec), "--out", str(out), "--force", "--no-onnx"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--force replaces only an existing bundle" in err[0] and str(out) in err[0], err
    assert (out.read_bytes() if case == "a-file" else _tree(out)) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "s.toml"]  # no temporary left behind
    with pytest.raises(BundleError, match="--force replaces only"):  # the API refuses the same
        export_bundle(RunningTensorLM(SPEC, vocab_size=11), out, overwrite=True, onnx=False)
    assert (out.read_bytes() if case == "a-file" else _tree(out)) == before


def test_force_replaces_a_bundle(tmp_path, capsys):
    spec = tmp_path / "s.toml"
    spec.write_text('order = 3\nkey_widths = [2, 4]\nvalue_width = 5\nheads = 2\nmodel_width = 12\n')
    out = tmp_path / "out"
    assert main(["export", str(spec), "--out", str(out), "--no-onnx", "--vocab", "7"]) == 0
    (out / "weights.safetensors").write_bytes(b"corrupted")  # a damaged bundle is still ours to replace
    assert main(["export", str(spec), "--out", str(out), "--no-onnx", "--vocab", "9", "--force"]) == 0
    assert json.loads((out / "manifest.json").read_text())["model"]["vocab_size"] == 9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "s.toml"]


def test_export_of_huge_key_widths_refused_with_the_bytes(tmp_path, capsys, monkeypatch):
    # `export` traced a batch-2 prefill for ONNX: a raw "DefaultCPUAllocator: can't allocate" error.
    import rtcompile.model

    monkeypatch.setattr(rtcompile.model, "device_memory_bytes", lambda device: 8 << 30)  # an 8 GiB machine
    spec = tmp_path / "huge.toml"
    spec.write_text("order = 3\nkey_widths = [65536, 65536]\nvalue_width = 1\nheads = 1\nmodel_width = 8\nlayers = 1\n")
    for argv in (["export", str(spec), "--out", str(tmp_path / "b")],
                 ["plan", str(spec), "--target", "h100-sxm"],
                 ["build", str(spec), "--target", "h100-sxm", "--out", str(tmp_path / "p.json")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and ("bytes" in err[0] or " B per sequence" in err[0]), (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["huge.toml"]


def _forge_after_verify(monkeypatch, forge) -> None:
    """A racing writer: ``verify_bundle`` (as load and run call it) returns, then ``forge(root)``
    replaces the bundle's files on disk. What the bundle is used as must be what was verified."""
    from rtcompile import export
    from rtcompile.export import bundle as bundle_module

    real = export.verify_bundle

    def racing(path):
        verified = real(path)
        forge(Path(path))
        return verified

    monkeypatch.setattr(bundle_module, "verify_bundle", racing)
    monkeypatch.setattr(export, "verify_bundle", racing)


def test_load_uses_the_weights_it_verified_not_a_file_swapped_in_after(bundle, monkeypatch):
    from safetensors.torch import save_file

    model, path, _ = bundle

    def forge(root):
        save_file({k: torch.zeros_like(v) for k, v in model.state_dict().items()}, str(root / "weights.safetensors"))

    _forge_after_verify(monkeypatch, forge)
    loaded = load_bundle(path)
    assert torch.equal(loaded.embed.weight, model.embed.weight)


def test_run_uses_the_graphs_it_verified_not_files_swapped_in_after(tmp_path, monkeypatch, capsys):
    torch.manual_seed(0)
    path = export_bundle(RunningTensorLM(SPEC, vocab_size=11), tmp_path / "b")
    argv = ["run", str(path), "--engine", "onnxruntime", "--steps", "3"]
    assert main(argv) == 0
    want = capsys.readouterr().out

    def forge(root):
        for name in ("prefill.onnx", "decode.onnx"):
            (root / name).write_bytes(b"forged after the check")

    _forge_after_verify(monkeypatch, forge)
    code = main(argv)
    out = capsys.readouterr()
    assert code == 0 and out.out == want, out.err


def test_loading_reads_the_weights_header_verify_checked(bundle, monkeypatch):
    """The weights' header is parsed once, by verify: the model is built from that header (a
    second parse in the load read the same bytes again)."""
    import rtcompile.export.bundle as bundle_module
    from rtcompile.export.verify import verify_bundle

    model, path, _ = bundle
    v = verify_bundle(path)
    assert set(v.weights_header) == set(model.state_dict())

    def parsed_again(data):
        raise AssertionError("the weights' header was parsed again after verify")

    monkeypatch.setattr(bundle_module, "safetensors_header", parsed_again)
    loaded = bundle_module.model_of(v)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name


@pytest.mark.parametrize("pad", [0, 1, 2, 3], ids=lambda p: f"header+{p}")
def test_safetensors_views_are_the_tensors_and_aligned(pad):
    """The loaded parameters are views of the verified bytes; a tensor whose data a hand-made
    file leaves misaligned (a header of any length) is copied to an aligned one, same values."""
    from rtcompile.export.bundle import safetensors_views

    a, b = torch.randn(3, 5), torch.randn(7).to(torch.bfloat16)
    body = a.numpy().tobytes() + b.view(torch.int16).numpy().tobytes()
    header = json.dumps({"a": {"dtype": "F32", "shape": [3, 5], "data_offsets": [0, 60]},
                         "b": {"dtype": "BF16", "shape": [7], "data_offsets": [60, 74]}}).encode()
    header += b" " * ((-len(header) - 8) % 8 + pad)  # 8 + header: aligned, then off by pad bytes
    data = bytearray(len(header).to_bytes(8, "little") + header + body)
    got = safetensors_views(data)
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
    assert all(t.data_ptr() % t.element_size() == 0 for t in got.values())
    start = got["a"].data_ptr() - torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    assert (start == 8 + len(header)) == (pad % 4 == 0)  # a view of the bytes where aligned, else a copy
