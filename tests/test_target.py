"""GPU names to datasheet profiles (whole model words: an L40 is not an L4), and the kept
measurements (targets.json): a malformed file is ignored with one warning, and rewritten."""

from __future__ import annotations

import json
import types
import warnings
from pathlib import Path

import pytest
import torch

import rtcompile.target as target
from rtcompile.target import get_target, profile_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name,profile", [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA H100 PCIe", None),  # 2.0 TB/s, not the SXM part's 3.35
    ("NVIDIA H100 NVL", None),
    ("NVIDIA GH200 480GB", None),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100-PCIE-40GB", None),
    ("NVIDIA A100-SXM4-40GB", None),
    ("NVIDIA A100 80GB PCIe", None),
    ("NVIDIA L4", "l4"),
    ("NVIDIA L40", None),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA GeForce RTX 4090", "rtx-4090"),
    ("NVIDIA GeForce RTX 4090 D", None),
    ("NVIDIA B200", "b200"),
    ("NVIDIA GB200", None),
], ids=lambda x: str(x).replace(" ", "_"))
def test_profile_for_matches_whole_model_names(name, profile):
    got = profile_for(name)
    assert (got.name if got is not None else None) == profile


def test_an_l40_gpus_tuned_entries_do_not_serve_an_l4_plan(tmp_path, monkeypatch):
    """Tuned winners of an "NVIDIA L40" were taken as the L4 profile's measurements (substring
    "l4"): the L4 plan's decode decision said measured. Now it is the cost model's."""
    from rtcompile.costmodel import shape_of
    from rtcompile.kernels import tuned
    from rtcompile.kernels.forms import default_config
    from rtcompile.plan import make_plan
    from rtcompile.spec import load_spec

    table = tmp_path / "tuned.json"
    monkeypatch.setenv("RTCOMPILE_TUNED", str(table))
    spec, l4 = load_spec(ROOT / "examples" / "order3_16x16.toml"), get_target("l4")

    def decode_source(gpu: str) -> str:
        e = tuned.match_fields("recurrent", spec.key_widths, spec.value_width, spec.heads, spec.input_dtype, gpu)
        e.update(batch=32, seq_len=1, variant=default_config("recurrent", shape_of(spec), l4.smem_per_sm).to_dict(),
                 seconds=1e-5)
        table.write_text(json.dumps({"format": tuned.FORMAT_VERSION, "entries": [e]}))
        tuned.reload()
        plan = make_plan(spec, l4, batches=(1,), seq_lens=(64,), decode_batches=(32,))
        return plan.decision_for("decode", 32, 1).cost["source"]

    try:
        assert decode_source("NVIDIA L4") != "cost model"  # the same entry of an L4 is used: the test can tell
        assert decode_source("NVIDIA L40") == "cost model"
    finally:
        table.unlink()
        tuned.reload()


@pytest.fixture
def h200_host(tmp_path, monkeypatch):
    """torch.cuda faked as one H200; the cache in tmp_path. Returns targets.json's path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=0: types.SimpleNamespace(total_memory=141 * 10**9, multi_processor_count=132, major=9))
    path = tmp_path / "rtcompile" / "targets.json"
    path.parent.mkdir(parents=True)
    return path


GOOD = {"hbm_bytes_per_s": 4.2e12, "bf16_flops": 7.9e14, "date": "2026-12-01"}


@pytest.mark.parametrize("text", [
    "[1, 2]",
    json.dumps({"NVIDIA H200": {"date": "x"}}),
    json.dumps({"NVIDIA H200": 5}),
    json.dumps({"NVIDIA H200": {**GOOD, "hbm_bytes_per_s": -1.0}}),
    json.dumps({"NVIDIA H200": {**GOOD, "bf16_flops": "fast"}}),
    json.dumps({"NVIDIA H200": {**GOOD, "bf16_flops": True}}),
    '{"NVIDIA H200": {"hbm_bytes_per_s": NaN, "bf16_flops": 1e15, "date": "x"}}',
    '{"NVIDIA H200": {"hbm_bytes_per_s": Infinity, "bf16_flops": 1e15, "date": "x"}}',
    json.dumps({"NVIDIA H200": {**GOOD, "date": None}}),
], ids=["list", "no-rates", "number", "negative-rate", "text-rate", "bool-rate", "nan-rate", "inf-rate", "no-date"])
def test_a_malformed_measurement_is_ignored_with_one_warning(h200_host, text):
    h200_host.write_text(text)
    with pytest.warns(RuntimeWarning, match="kept GPU measurements") as caught:
        t = get_target("auto")
    assert len(caught) == 1
    assert t.name == "h200" and not t.measured and t.hbm_bytes_per_s == target.PROFILES["h200"].hbm_bytes_per_s


def test_the_valid_measurements_beside_a_malformed_one_are_kept(h200_host):
    h200_host.write_text(json.dumps({"NVIDIA H200": GOOD, "NVIDIA L4": {"date": "x"}}))
    with pytest.warns(RuntimeWarning, match="'NVIDIA L4'"):
        t = get_target("auto")
    assert t.measured and t.hbm_bytes_per_s == GOOD["hbm_bytes_per_s"]


@pytest.mark.parametrize("text", ["[1, 2]", "not json", json.dumps({"NVIDIA L4": {"date": "x"}, "NVIDIA L40S": GOOD})],
                         ids=["list", "not-json", "a-malformed-entry"])
def test_keeping_a_measurement_rewrites_a_malformed_file(h200_host, text):
    """measure()'s write (data[name] = ... on the file's content) crashed on a list."""
    h200_host.write_text(text)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rewrite says nothing: it is the repair
        target._keep("NVIDIA H200", 4e12, 8e14, "2026-12-02")
        data = json.loads(h200_host.read_text())
        assert data["NVIDIA H200"] == {"hbm_bytes_per_s": 4e12, "bf16_flops": 8e14, "date": "2026-12-02"}
        assert "NVIDIA L4" not in data and (text.startswith("[") or text == "not json" or "NVIDIA L40S" in data)
        assert get_target("auto").measured
