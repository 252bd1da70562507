"""Mistakes that got past the CLI's checks: an unbounded ``tune --workers``, an integer past
float's range, ``--out DIR/`` for a file, a plan file with a repeated key; and Python's own
warning format on stderr. Each refusal is one stderr line and exit 2 before any work; a warning
is one ``rtcompile: warning:`` line, once."""

from __future__ import annotations

import json

import pytest

from rtcompile.cli import main
from conftest import TINY_SPEC



@pytest.fixture
def work(tmp_path, monkeypatch):
    """A folder holding a tiny spec (the current folder), a private cache, no work started."""
    import rtcompile.tuning as tuning

    (tmp_path / "tiny.toml").write_text(TINY_SPEC)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("RTCOMPILE_TUNED", str(tmp_path / "cache" / "tuned.json"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.chdir(tmp_path)

    def started(*a, **k):
        raise AssertionError("a study started before the input was checked")

    monkeypatch.setattr(tuning, "tune_bucket", started)
    return tmp_path


def _refused(argv, capsys, *needles: str) -> str:
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in cap.err, (code, cap.err)
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.mark.parametrize("workers", [1025, 10**6])
def test_tune_bounds_its_workers_as_explore_does(work, capsys, workers):
    _refused(["tune", "tiny.toml", "--workers", workers, "--trials", "1", "--phase", "decode"], capsys,
             "--workers", str(workers), "allowed: an integer in [1, 1024]")
    assert not (work / "cache" / "rtcompile" / "tuning.db").exists()


@pytest.mark.parametrize("argv", [
    ["plan", "tiny.toml", "--seq-len", 10**310],
    ["plan", "tiny.toml", "--batch", 10**310],
    ["plan", "tiny.toml", "--decode-batch", 10**310],
], ids=["seq-len", "batch", "decode-batch"])
def test_an_integer_past_floats_range_is_one_line(work, capsys, argv):
    _refused(argv, capsys, "does not fit")


def test_make_plan_refuses_an_integer_past_floats_range_with_value_error():
    from rtcompile.plan import make_plan
    from rtcompile.spec import ModelSpec
    from rtcompile.target import get_target

    spec = ModelSpec(order=3, key_widths=(4, 4), value_width=8, heads=2, model_width=32, layers=1)
    with pytest.raises(ValueError, match="does not fit"):
        make_plan(spec, get_target("h200"), batches=(10**310,), seq_lens=(64,), decode_batches=(1,),
                  use_measurements=False)


@pytest.mark.parametrize("command", ["plan", "build"])
def test_out_ending_in_a_slash_is_refused_not_written_as_a_file(work, capsys, command):
    _refused([command, "tiny.toml", "--out", "outdir/"], capsys, "--out 'outdir/'", "ends with a slash",
             "outdir/plan.json")
    assert not (work / "outdir").exists()


def test_a_warning_is_one_line_once(work):
    """In a process of its own: pytest records warnings instead of printing them."""
    import os
    import subprocess
    import sys

    bad = work / "bad.json"
    bad.write_text("{not json")
    env = {**os.environ, "RTCOMPILE_TUNED": str(bad)}
    for command in ("plan", "build"):  # build read the table twice
        run = subprocess.run([sys.executable, "-m", "rtcompile.cli", command, "tiny.toml", "--out", "p.json"],
                             capture_output=True, text=True, env=env, cwd=work, timeout=600)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 0, run.stderr
        assert len(lines) == 1 and lines[0].startswith("rtcompile: warning: tuned-config table"), lines
        assert "unreadable" in lines[0] and "RuntimeWarning" not in lines[0]


def test_a_warning_still_reaches_a_caller_that_records_them(work, monkeypatch):
    bad = work / "bad.json"
    bad.write_text("{not json")
    monkeypatch.setenv("RTCOMPILE_TUNED", str(bad))
    from rtcompile.kernels import tuned

    monkeypatch.setattr(tuned, "_table", None)
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert main(["plan", "tiny.toml", "--out", "p.json"]) == 0


def test_a_plan_file_with_a_repeated_key_is_refused(work, capsys):
    assert main(["plan", "tiny.toml", "--out", "p.json"]) == 0
    capsys.readouterr()
    text = (work / "p.json").read_text()
    data = json.loads(text)
    repeated = text.replace('"format":', f'"format": {json.dumps(data["format"])}, "format":', 1)
    (work / "p2.json").write_text(repeated)
    _refused(["export", "tiny.toml", "--out", "b", "--plan", "p2.json", "--no-onnx", "--no-kernels"], capsys,
             "p2.json", "key 'format' appears more than once")
    assert not (work / "b").exists()


@pytest.mark.parametrize("argv, needles", [
    (["tune", "--list", "tiny.toml"], ["--list", "takes only --storage", "SPEC"]),
    (["tune", "--list", "--trials", "3", "--phase", "decode"], ["--trials, --phase"]),
    (["tune", "tiny.toml", "--phase", "decode", "--batch", "4", "--seq-len", "64"], ["--batch, --seq-len", "--phase decode"]),
    (["tune", "tiny.toml", "--phase", "prefill", "--decode-batch", "4"], ["--decode-batch", "--phase prefill"]),
    (["tune", "tiny.toml", "--phase", "train", "--decode-batch", "4"], ["--decode-batch", "--phase train"]),
], ids=["list-spec", "list-trials", "decode-batch-seq", "prefill-decode-batch", "train-decode-batch"])
def test_tune_refuses_options_it_would_ignore(work, capsys, argv, needles):
    _refused(argv, capsys, *needles)
    assert not (work / "cache" / "rtcompile" / "tuning.db").exists()


@pytest.mark.parametrize("command", ["info", "plan"])
def test_an_empty_spec_path_is_named_as_given(work, capsys, command):
    _refused([command, ""], capsys, "spec file ''", "empty path", "allowed: a .toml or .json spec file")


def test_load_spec_refuses_an_empty_path_with_value_error():
    from rtcompile.spec import load_spec

    with pytest.raises(ValueError, match="spec file '   ': empty path"):
        load_spec("   ")


def test_explore_blames_the_pair_count_past_the_length_not_the_vocabulary(work, capsys):
    _refused(["explore", "tiny.toml", "--orders", "3", "--widths", "4", "--recall", "--kv-pairs", "1000",
              "--seq-len", "8", "--out", "ex"], capsys, "--kv-pairs: got 1000 for --seq-len 8", "at most --seq-len / 4 = 2")
    assert not (work / "ex").exists()


def test_a_variant_with_the_reference_backend_is_refused_not_dropped():
    import torch

    import rtcompile
    from rtcompile.kernels.forms import default_config
    from rtcompile.kernels.launch import kernel_shape
    from rtcompile.kernels.inputs import check_inputs

    q = [torch.randn(1, 5, 2, 4) for _ in range(2)]
    k = [torch.randn(1, 5, 2, 4) for _ in range(2)]
    v = torch.randn(1, 5, 2, 8)
    cfg = default_config("recurrent", kernel_shape(check_inputs(q, k, v, None, None, None, None, None)))
    with pytest.raises(ValueError, match="variant: a Triton kernel config .*backend='reference'"):
        rtcompile.running_tensor(q, k, v, backend="reference", variant=cfg, mode="recurrent")


@pytest.mark.parametrize("text", ["abc", "1.5", ""], ids=["word", "float", "empty"])
def test_export_vocab_text_names_the_range(work, capsys, text):
    from rtcompile.export.verify import MAX_VOCAB

    _refused(["export", "tiny.toml", "--out", "b", "--vocab", text], capsys, "--vocab", f"[2, {MAX_VOCAB}]")
    assert not (work / "b").exists()


@pytest.mark.parametrize("backend", ["auto", "reference", "triton"])
def test_a_variant_that_is_no_config_is_a_type_error_on_every_backend(backend):
    import torch

    import rtcompile

    q = [torch.randn(1, 5, 2, 4, dtype=torch.float64) for _ in range(2)]
    k = [torch.randn(1, 5, 2, 4, dtype=torch.float64) for _ in range(2)]
    v = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="variant: expected one of .*RecurrentConfig or None, got str"):
        rtcompile.running_tensor(q, k, v, backend=backend, variant="nonsense")


def test_a_variant_is_refused_where_auto_falls_back_to_the_reference():
    import torch

    import rtcompile
    from rtcompile.kernels.forms import default_config
    from rtcompile.kernels.inputs import check_inputs
    from rtcompile.kernels.launch import kernel_shape

    q = [torch.randn(1, 5, 2, 4, dtype=torch.float64) for _ in range(2)]  # float64: the reference's
    k = [torch.randn(1, 5, 2, 4, dtype=torch.float64) for _ in range(2)]
    v = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    cfg = default_config("recurrent", kernel_shape(check_inputs(q, k, v, None, None, None, None, None)))
    with pytest.raises(ValueError, match="variant: a Triton kernel config .*runs this call on the reference"):
        rtcompile.running_tensor(q, k, v, variant=cfg, mode="recurrent")
    o, _ = rtcompile.running_tensor(q, k, v, mode="recurrent")  # without it, the fallback runs
    assert o.dtype == torch.float64


def test_a_decode_call_on_another_device_kind_is_checked_not_served_from_the_plan_cache():
    """The plan cache keyed devices by get_device(), -1 for CPU and meta alike: a meta index
    tensor after a valid CPU call took its plan and failed in the copy (NotImplementedError)."""
    import torch

    import rtcompile

    B, H, w, d_v = 2, 2, 4, 8
    q = [torch.randn(B, 1, H, w) for _ in range(2)]
    k = [torch.randn(B, 1, H, w) for _ in range(2)]
    v = torch.randn(B, 1, H, d_v)
    cache = torch.zeros(B, H, w, w, d_v)
    idx = torch.arange(B, dtype=torch.int32)
    rtcompile.running_tensor_decode_(q, k, v, state_cache=cache, state_indices=idx, validate=False)
    with pytest.raises(ValueError, match="state_indices: expected shape .* on cpu, got .* on meta"):
        rtcompile.running_tensor_decode_(q, k, v, state_cache=cache, state_indices=idx.to("meta"), validate=False)


@pytest.mark.parametrize("storage", ["", "  "], ids=["empty", "blank"])
def test_tune_options_refuse_an_empty_storage_as_sweep_options_do(storage):
    from rtcompile.tuning import TuneOptions

    with pytest.raises(ValueError, match="storage: got .*allowed: None"):
        TuneOptions(storage=storage)


@pytest.mark.parametrize("command", ["run", "inspect"])
@pytest.mark.parametrize("what, needle", [("tiny.toml", "not a folder"), ("nowhere", "no such folder")],
                         ids=["a-file", "absent"])
def test_a_bundle_path_that_is_no_folder_says_so(work, capsys, command, what, needle):
    _refused([command, what], capsys, f"bundle '{what}'", needle)


def test_load_names_a_file_given_as_the_bundle():
    import rtcompile
    from rtcompile.export import BundleError

    with pytest.raises(BundleError, match="not a folder"):
        rtcompile.load(__file__)
