"""Model spec: loading, validation, round trips and derived figures."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rtcompile import Features, ModelSpec, SpecError, SpecTypeError, load_spec, save_spec
from rtcompile.cli import main
from rtcompile.figures import chunk_figures, parameters_per_layer, recurrent_figures

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.*"))

BASE = {
    "order": 3,
    "key_widths": [16, 16],
    "value_width": 64,
    "heads": 8,
    "model_width": 512,
    "layers": 2,
    "chunk_size": 64,
    "features": {"forget_gate": True, "delta_rule": True, "projection": "dense", "short_conv": 4},
}


def test_examples_cover_the_required_specs():
    specs = {p.name: load_spec(p) for p in EXAMPLES}
    shapes = {(s.order, s.key_widths) for s in specs.values()}
    assert {(2, (64,)), (3, (16, 16)), (3, (64, 64)), (4, (16, 16, 16))} <= shapes


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
@pytest.mark.parametrize("fmt", ["toml", "json"])
def test_round_trip(path, fmt, tmp_path):
    spec = load_spec(path)
    out = tmp_path / f"spec.{fmt}"
    save_spec(spec, out)
    assert load_spec(out) == spec
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary left behind


def test_spec_is_immutable():
    spec = ModelSpec.from_dict(BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.order = 4  # type: ignore[misc]
    assert spec.replace(layers=3).layers == 3 and spec.layers == 2


def test_figures_order3_16x16_by_hand():
    spec = ModelSpec.from_dict({**BASE, "features": {**BASE["features"], "query_skip": True}})
    # state: K = 256, V = 64, fp32 -> 256 * 64 * 4 = 65536 B per head; x 8 heads; x 2 layers
    assert spec.key_dim == 256
    assert spec.state_bytes_per_head == 65_536
    assert spec.state_bytes_per_layer == 524_288
    assert spec.state_bytes_per_sequence == 1_048_576
    # parameters, D = 512, H = 8, V = 64, S = 32, w = 4; streams = 8 * (2*32 + 64) = 1024
    #   dense 512*1024 = 524288, conv 4*1024 = 4096, forget 512*8+8 = 4104, beta 4104,
    #   query skip 2*4104 = 8208, output gate 512*8*64 + 64 = 262208, out proj 8*64*512 = 262144
    assert parameters_per_layer(spec) == 524_288 + 4_096 + 4_104 + 4_104 + 8_208 + 262_208 + 262_144
    # recurrent per head: 4KV = 65536, phi 2K(o-2) = 512, gate KV = 16384, delta 2KV = 32768
    rec = recurrent_figures(spec)
    assert rec.flops_per_token == 8 * (65_536 + 512 + 16_384 + 32_768)
    # bytes: 2 * 524288 state + 8 heads * (2*32 + 64 + 1 + 1 + 64) * 2 bytes (bf16)
    assert rec.bytes_per_token == 2 * 524_288 + 8 * 194 * 2
    # chunk C = 64 per head: 2CS = 4096, 2CV = 8192, 4KV = 65536, delta 2KV + 2CS + 2CV = 45056
    chk = chunk_figures(spec)
    assert chk.flops_per_token == 8 * (4_096 + 8_192 + 65_536 + 45_056)
    assert chk.bytes_per_token == 2 * 524_288 / 64 + 8 * 194 * 2


def test_figures_order2_plain_and_conconlyc():
    spec = ModelSpec.from_dict({
        "order": 2, "key_widths": [32], "value_width": 16, "heads": 2, "model_width": 64,
        "state_dtype": "bfloat16", "input_dtype": "float32",
        "features": {"forget_gate": False, "delta_rule": False, "query_skip": False,
                     "projection": "conconlyc", "short_conv": 3, "output_gate": False},
    })
    assert spec.state_bytes_per_head == 32 * 16 * 2
    # conconlyc: w * D * (2 (o-1) + 1) = 3 * 64 * 3; out proj 2 * 16 * 64
    assert parameters_per_layer(spec) == 3 * 64 * 3 + 2 * 16 * 64
    # recurrent per head 4 K V = 2048 (order 2: no phi build); bytes 2*1024*2 + 2*(64+16+16)*4
    assert recurrent_figures(spec).flops_per_token == 2 * 4 * 32 * 16
    assert recurrent_figures(spec).bytes_per_token == 2 * 2048 + 2 * 96 * 4
    # chunk C = 64 (auto): 2CS + 2CV + 4KV = 4096 + 2048 + 2048 per head
    assert chunk_figures(spec).flops_per_token == 2 * (4_096 + 2_048 + 2_048)
    assert spec.features.update_rule == "linear"


def _feat(**kw):
    return {**BASE, "features": {**BASE["features"], **kw}}


BAD_SPECS = {
    "order-1": ({**BASE, "order": 1, "key_widths": []}, "order"),
    "order-7": ({**BASE, "order": 7}, "order"),
    "order-string": ({**BASE, "order": "3"}, "order"),
    "order-bool": ({**BASE, "order": True}, "order"),
    "order-float": ({**BASE, "order": 3.0}, "order"),
    "widths-count": ({**BASE, "key_widths": [16]}, "key_widths"),
    "width-zero": ({**BASE, "key_widths": [0, 16]}, "key_widths[0]"),
    "width-negative": ({**BASE, "key_widths": [16, -4]}, "key_widths[1]"),
    "width-float": ({**BASE, "key_widths": [16.0, 16]}, "key_widths[0]"),
    "widths-string": ({**BASE, "key_widths": "16x16"}, "key_widths"),
    "value-zero": ({**BASE, "value_width": 0}, "value_width"),
    "heads-negative": ({**BASE, "heads": -1}, "heads"),
    "layers-zero": ({**BASE, "layers": 0}, "layers"),
    "model-width-missing": ({k: v for k, v in BASE.items() if k != "model_width"}, "model_width"),
    "chunk-zero": ({**BASE, "chunk_size": 0}, "chunk_size"),
    "chunk-48": ({**BASE, "chunk_size": 48}, "chunk_size"),
    "chunk-word": ({**BASE, "chunk_size": "big"}, "chunk_size"),
    "unknown-key": ({**BASE, "widths": [16, 16]}, "widths"),
    "unknown-feature": (_feat(sparse_attention=True), "features.sparse_attention"),
    "feature-not-bool": (_feat(forget_gate="yes"), "features.forget_gate"),
    "projection-unknown": (_feat(projection="lowrank"), "features.projection"),
    "short-conv-too-wide": (_feat(short_conv=99), "features.short_conv"),
    "conconlyc-without-conv": (_feat(projection="conconlyc", short_conv=0), "features.short_conv"),
    "features-not-table": ({**BASE, "features": 3}, "features"),
    "input-dtype-int8": ({**BASE, "input_dtype": "int8"}, "input_dtype"),
    "state-dtype-float64": ({**BASE, "state_dtype": "float64"}, "state_dtype"),
    "scale-negative": ({**BASE, "scale": -1.0}, "scale"),
    "name-not-string": ({**BASE, "name": 5}, "name"),
    "state-too-large": ({**BASE, "order": 6, "key_widths": [64] * 5, "value_width": 128}, "key_widths"),
}


@pytest.mark.parametrize("case", BAD_SPECS.keys())
def test_malformed_spec_api(case):
    data, field = BAD_SPECS[case]
    with pytest.raises((SpecError, SpecTypeError)) as info:
        ModelSpec.from_dict(data)
    assert info.value.field == field
    assert str(info.value).startswith(f"spec.{field}:")
    assert "\n" not in str(info.value)
    assert any(w in str(info.value) for w in ("allowed", "expected", "required"))


@pytest.mark.parametrize("case", BAD_SPECS.keys())
def test_malformed_spec_cli(case, tmp_path, capsys):
    data, field = BAD_SPECS[case]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    assert main(["info", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"spec.{field}" in lines[0]


def test_type_errors_are_type_errors():
    with pytest.raises(TypeError):
        ModelSpec.from_dict({**BASE, "order": "3"})
    with pytest.raises(ValueError):
        ModelSpec.from_dict({**BASE, "order": 1, "key_widths": []})
    with pytest.raises(TypeError):
        Features(delta_rule=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name, content, needle",
    [
        ("bad.toml", "order = [", "not valid TOML"),
        ("bad.json", "{order: 3", "not valid JSON"),
        ("spec.yaml", "order: 3", "allowed: .toml, .json"),
        ("missing.toml", None, "no such file"),
    ],
    ids=["toml-syntax", "json-syntax", "extension", "missing"],
)
def test_bad_files(name, content, needle, tmp_path, capsys):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    assert main(["info", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_cli_subprocess_no_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("order = 1\nkey_widths = []\nvalue_width = 4\nheads = 1\nmodel_width = 8\n")
    for argv in ([], ["info", str(bad)], ["info"], ["frobnicate"], ["info", "--bogus", str(bad)]):
        r = subprocess.run([sys.executable, "-m", "rtcompile.cli", *argv], capture_output=True, text=True)
        assert r.returncode == 2, (argv, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_info(capsys):
    path = next(p for p in EXAMPLES if "16x16" in p.name and p.name.startswith("order3"))
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "state per head" in out and "64.00 KiB" in out
    assert main(["info", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["state"]["bytes_per_head"] == 65_536 and data["key_dim"] == 256


def test_cli_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "info" in capsys.readouterr().out


def _spec_commands(path, tmp_path):
    """Every CLI command that reads a spec file, as a user would type it."""
    return {
        "info": ["info", str(path)],
        "plan": ["plan", str(path), "--target", "h100-sxm"],
        "tune": ["tune", str(path), "--storage", f"sqlite:///{tmp_path / 'store.db'}"],
        "build": ["build", str(path), "--target", "h100-sxm", "--out", str(tmp_path / "plan.json")],
        "export": ["export", str(path), "--out", str(tmp_path / "bundle")],
    }


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_deeply_nested_spec_is_one_line_in_every_command(suffix, tmp_path, capsys):
    # 100,000 nested brackets overflowed both parsers' recursion (RecursionError traceback).
    path = tmp_path / f"deep{suffix}"
    path.write_text(("[" * 100_000) if suffix == ".json" else "order = " + "[" * 100_000)
    for name, argv in _spec_commands(path, tmp_path).items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "nested too deeply" in err[0] and str(path) in err[0], (name, err)
    assert not (tmp_path / "bundle").exists() and not (tmp_path / "plan.json").exists()


def test_json_spec_with_a_repeated_key_is_refused(tmp_path, capsys):
    # json.loads keeps the last value of a repeated key: order 2 then 3 silently read as 3.
    path = tmp_path / "dup.json"
    body = json.dumps(BASE)[1:]
    path.write_text('{"order": 2, ' + body)
    with pytest.raises(ValueError, match="'order' appears more than once"):
        load_spec(path)
    nested = dict(BASE, features={})
    path.write_text(json.dumps(nested).replace('"features": {}', '"features": {"delta_rule": true, "delta_rule": false}'))
    with pytest.raises(ValueError, match="'delta_rule' appears more than once"):
        load_spec(path)
    for name, argv in _spec_commands(path, tmp_path).items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "'delta_rule' appears more than once" in err[0], (name, err)


def test_toml_spec_with_a_repeated_key_is_refused(tmp_path, capsys):
    path = tmp_path / "dup.toml"
    path.write_text("order = 2\norder = 3\nkey_widths = [4, 4]\nvalue_width = 4\nheads = 1\nmodel_width = 8\n")
    assert main(["info", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # tomllib already refuses a repeated key; its message gives the line, not the name.
    assert len(err) == 1 and "not valid TOML" in err[0] and "line 2" in err[0]


@pytest.mark.parametrize("path", [None, 3, {"order": 2}], ids=["none", "int", "dict"])
def test_load_spec_and_load_name_a_path_that_is_not_one(path):
    """A path argument of the wrong type is a TypeError naming it (before any file is opened)."""
    import rtcompile

    with pytest.raises(TypeError, match=r"path: expected a str or os.PathLike spec file"):
        load_spec(path)
    with pytest.raises(TypeError, match=r"path: expected a str or os.PathLike bundle folder"):
        rtcompile.load(path)
