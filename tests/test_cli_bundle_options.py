"""``rtcompile export`` and ``rtcompile run``: options refused with their value, in one line and
exit code 2, before the expensive part (building the model, hashing the bundle)."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file

import rtcompile.export as export_pkg
import rtcompile.model as model_mod
from rtcompile.cli import main

SPEC_TOML = 'order = 3\nkey_widths = [2, 4]\nvalue_width = 5\nheads = 2\nmodel_width = 12\n'


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One bundle with ONNX graphs and a vocabulary of 11, written by the CLI."""
    root = tmp_path_factory.mktemp("exported")
    (root / "s.toml").write_text(SPEC_TOML)
    assert main(["export", str(root / "s.toml"), "--out", str(root / "b"), "--vocab", "11", "--no-kernels"]) == 0
    return root / "b"


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("argv, pattern", [
    (["--steps", "-1"], r"argument --steps: expected an integer >= 0, got -1"),
    (["--tokens", ""], r"argument --tokens: expected comma-separated integers >= 0 \(token ids\), got ''"),
    (["--tokens", "1,x"], r"argument --tokens: expected comma-separated integers >= 0 \(token ids\), got '1,x'"),
    (["--tokens", "1,-2"], r"argument --tokens: expected comma-separated integers >= 0 \(token ids\), got '1,-2'"),
], ids=["steps", "empty", "not-int", "negative"])
def test_run_refuses_its_options_before_verifying_the_bundle(argv, pattern, exported, capsys, monkeypatch):
    """Before: the bundle was hashed first (1.35 s for this toy one), then every case read
    "--tokens/--steps: token ids in [0, 11) and steps >= 0 required"."""
    # run_bundle imports verify_bundle from the package when it is called
    monkeypatch.setattr(export_pkg, "verify_bundle", lambda *a: pytest.fail("verified before the options"))
    assert main(["run", str(exported), *argv]) == 2
    assert re.search(pattern, _one_line(capsys))


def test_run_names_the_token_id_outside_the_vocabulary(exported, capsys):
    assert main(["run", str(exported), "--tokens", "1,11,3", "--steps", "1"]) == 2
    assert "--tokens: id 11; allowed: ids 0 to 10 (the bundle's vocabulary)" in _one_line(capsys)


def test_export_refuses_opset27_without_the_onnx_graphs(tmp_path, capsys):
    """Before: accepted and ignored, a bundle without any graph and no word said."""
    (tmp_path / "s.toml").write_text(SPEC_TOML)
    assert main(["export", str(tmp_path / "s.toml"), "--out", str(tmp_path / "b"), "--no-onnx", "--opset27"]) == 2
    assert "--opset27: with --no-onnx" in _one_line(capsys)
    assert not (tmp_path / "b").exists()


def test_export_onto_a_file_does_not_suggest_force(tmp_path, capsys):
    """Before: "already exists; allowed: a new path, or --force to replace a bundle", and --force
    was then refused too (a file is never replaced)."""
    (tmp_path / "s.toml").write_text(SPEC_TOML)
    assert main(["export", str(tmp_path / "s.toml"), "--out", str(tmp_path / "s.toml")]) == 2
    line = _one_line(capsys)
    assert "exists and is not a folder" in line and "--force replaces only an existing bundle" in line, line
    assert (tmp_path / "s.toml").read_text() == SPEC_TOML


@pytest.mark.parametrize("case", ["absent", "wrong-shape"])
def test_export_checks_the_weights_before_building_the_model(case, tmp_path, capsys, monkeypatch):
    """The weights file is read and its header checked against a meta-device model: before, the
    model was built first (at --vocab 2**24: 10 s and 1.8 GB, then "no such file")."""
    (tmp_path / "s.toml").write_text(SPEC_TOML)
    w = tmp_path / "w.safetensors"
    if case == "wrong-shape":
        save_file({"head.weight": torch.zeros(11, 13)}, str(w))
    built = model_mod.RunningTensorLM.__init__

    def meta_only(self, *a, **kw):
        assert torch.get_default_device().type == "meta", "a model was built on a real device before the check"
        built(self, *a, **kw)

    monkeypatch.setattr(model_mod.RunningTensorLM, "__init__", meta_only)
    assert main(["export", str(tmp_path / "s.toml"), "--out", str(tmp_path / "b"), "--vocab", "11",
                 "--weights", str(w), "--no-onnx"]) == 2
    line = _one_line(capsys)
    assert str(w) in line and ("no such file" if case == "absent" else "lacks") in line, line
