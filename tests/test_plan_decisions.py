"""The planner's decisions against what the runtime runs (CPU: cost model only): the spec's
chunk size, decode always recurrent and train always the chunk form, a crossover that agrees
with the prefill decisions, tuned measurements found by the tuner's bucket and labelled honestly
where they are scaled, buckets planned once, orders beyond the Triton kernels refused, and a
custom Target's figures checked."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from rtcompile.cli import main
from rtcompile.costmodel import shape_of
from rtcompile.functional import MAX_TRITON_ORDER, resolve_backend
from rtcompile.kernels import tuned
from rtcompile.kernels.chunk_backward import default_backward
from rtcompile.kernels.forms import default_config
from rtcompile.plan import PlanError, make_plan
from rtcompile.spec import ModelSpec, load_spec
from rtcompile.target import Target, get_target

ROOT = Path(__file__).resolve().parents[1]
O3_16 = ROOT / "examples" / "order3_16x16.toml"
MEASURED = "measured (tuned)"


def _phase(plan, phase):
    return [d for d in plan.decisions if d.phase == phase]


def _with_table(monkeypatch, tmp_path, entries):
    table = tmp_path / "tuned.json"
    table.write_text(json.dumps({"format": tuned.FORMAT_VERSION, "entries": entries}))
    monkeypatch.setenv("RTCOMPILE_TUNED", str(table))
    tuned.reload()


@pytest.fixture
def restore_table():
    yield
    tuned.reload()  # the conftest's table again, after monkeypatch restored the variable


def _entry(spec, kernel, config, batch, seq_len, seconds):
    e = tuned.match_fields(kernel, spec.key_widths, spec.value_width, spec.heads, spec.input_dtype, "NVIDIA H200")
    return {**e, "batch": batch, "seq_len": seq_len, "variant": config.to_dict(), "seconds": seconds}


# --- 1. the spec's chunk_size ---------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [64, 16], ids=["C64", "C16"])
def test_a_spec_chunk_size_is_the_chunk_size_every_chunk_option_uses(chunk_size):
    """order2_matrix.toml names chunk_size = 64; the planner chose C 32 for prefill and train
    (H200, B8 T4096) while `info` and the ONNX export used 64."""
    spec = dataclasses.replace(load_spec(ROOT / "examples" / "order2_matrix.toml"), chunk_size=chunk_size)
    plan = make_plan(spec, get_target("h200"), batches=(8,), seq_lens=(4096,), decode_batches=(1,))
    for d in _phase(plan, "prefill") + _phase(plan, "train"):
        assert d.mode == "chunk" and d.chunk_size == chunk_size, (d.phase, d.variant)
        chunks = [a["variant"]["chunk_size"] for a in d.alternatives if a["mode"] == "chunk"]
        assert chunks and set(chunks) == {chunk_size}, (d.phase, chunks)
        assert f"chunk_size {chunk_size}" in d.reason


def test_auto_chunk_size_leaves_the_size_to_the_planner():
    spec = dataclasses.replace(load_spec(ROOT / "examples" / "order2_matrix.toml"), chunk_size="auto")
    plan = make_plan(spec, get_target("h200"), batches=(8,), seq_lens=(4096,), decode_batches=(1,))
    (d,) = _phase(plan, "prefill")
    sizes = {a["variant"]["chunk_size"] for a in d.alternatives if a["mode"] == "chunk"}
    assert len(sizes) > 1 and "chunk_size" not in d.reason  # the default's 32 beside the fused 64


def test_a_chunk_size_no_config_runs_here_is_said_in_the_decision():
    """o4 16^3 at C 64 does not fit the L4's shared memory: the decisions say so and name the
    sizes used instead (the scan alone would cost ~40x at T 4096). (o3 64x64 did not fit either
    until its default became the stepped loop, whose C 64 tiles fit.)"""
    spec = load_spec(ROOT / "examples" / "order4_16x16x16.json")
    assert spec.chunk_size == 64
    plan = make_plan(spec, get_target("l4"), batches=(8,), seq_lens=(4096,), decode_batches=(1,))
    for d in _phase(plan, "prefill") + _phase(plan, "train"):
        assert d.mode == "chunk" and d.chunk_size != 64
        assert "no chunk config runs these widths at the spec's chunk_size 64" in d.reason, d.reason


# --- 2. decode runs the recurrent step, train the chunk form ------------------------------


def test_decode_decides_among_recurrent_steps_and_cache_dtypes_only():
    """At B256 on the L4 the chunk form was chosen for decode (the model never runs it) and the
    bf16 cache of state_dtype = "auto" was never considered."""
    spec = ModelSpec(order=3, key_widths=(16, 16), value_width=64, heads=8, model_width=512, layers=2,
                     state_dtype="auto")
    plan = make_plan(spec, get_target("l4"), batches=(1,), seq_lens=(64,), decode_batches=(1, 128, 256))
    for d in _phase(plan, "decode"):
        assert d.mode == "recurrent" and d.variant["form"] == "recurrent", d.batch
        dtypes = {a["state_dtype"] for a in d.alternatives if a["mode"] == "recurrent"}
        assert dtypes == {"float32", "bfloat16"}, d.batch
        (chunk,) = [a for a in d.alternatives if a["mode"] == "chunk"]
        assert chunk["note"].startswith("not run")
    assert {d.state_dtype for d in _phase(plan, "decode") if d.batch >= 128} == {"bfloat16"}


def test_train_is_the_chunk_form_with_its_backward():
    """o3 16x16 on the H200 at B1 T64: train chose the scan, whose backward training never runs."""
    plan = make_plan(load_spec(O3_16), get_target("h200"), batches=(1, 8), seq_lens=(16, 64), decode_batches=(1,))
    for d in _phase(plan, "train"):
        assert d.mode == "chunk" and d.backward is not None, (d.batch, d.mode)
        (scan,) = [a for a in d.alternatives if a["mode"] == "recurrent"]
        assert scan["note"].startswith("not run")


def test_the_plan_table_marks_the_alternatives_that_do_not_run(capsys):
    """The table listed "chunk split fp32" beside each decode decision and "recurrent" beside
    each train decision with nothing to say the runtime never runs them."""
    assert main(["plan", str(O3_16), "--target", "h200", "--batch", "1", "--seq-len", "64",
                 "--decode-batch", "1"]) == 0
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.count("│") > 5}
    assert "(not run)" in rows["decode"] and "(not run)" in rows["train"]
    assert "(not run)" not in rows["prefill"]


# --- 3. the crossover agrees with the prefill decisions -----------------------------------


@pytest.mark.parametrize("example,target", [("order3_16x16.toml", "h200"), ("order2_matrix.toml", "l4"),
                                            ("order3_32x32.toml", "a100-80gb"), ("order4_16x16x16.json", "h200")],
                         ids=["o3_16-h200", "o2-l4", "o3_32-a100", "o4-h200"])
def test_the_crossover_agrees_with_every_prefill_decision(example, target):
    """The crossover compared the default config alone with the scan: o3 16x16 H200 B1 printed
    147 while T = 16 and 64 chose a chunk form (the fused one)."""
    seq_lens = (1, 4, 16, 64, 128, 256, 1024, 4096)
    plan = make_plan(load_spec(ROOT / "examples" / example), get_target(target), batches=(1, 8), seq_lens=seq_lens,
                     decode_batches=(1,))
    for d in _phase(plan, "prefill"):
        cross = plan.crossover[f"B{d.batch}"]
        assert (d.mode == "chunk") == (cross is not None and d.seq_len >= cross), (d.batch, d.seq_len, d.mode, cross)


# --- 4 and 5. tuned measurements: the tuner's bucket, honest labels ------------------------


def test_a_tuned_entry_serves_the_calls_of_its_bucket(tmp_path, monkeypatch, restore_table):
    """The tuner measures B5 T4000 as bucket B8 T4096 (B and T rounded up to powers of two); the
    plan used that entry at B8 T4096 only. Elsewhere in the bucket it is scaled, and says so."""
    spec, h200 = load_spec(O3_16), get_target("h200")
    cfg = default_config("chunk", shape_of(spec), h200.smem_per_sm, gluon=True)
    _with_table(monkeypatch, tmp_path, [_entry(spec, "chunk", cfg, 8, 4096, 2e-4)])
    plan = make_plan(spec, h200, batches=(5, 8), seq_lens=(4000, 4096), decode_batches=(1,))
    for d in _phase(plan, "prefill"):
        sources = [a["cost"]["source"] for a in d.alternatives]
        want = MEASURED if (d.batch, d.seq_len) == (8, 4096) else "scaled from measured (tuned B8 T4096) by the model"
        assert want in sources, (d.batch, d.seq_len, sources)
    # a call of the next bucket (T 4097 rounds up to 8192) does not take it
    plan = make_plan(spec, h200, batches=(8,), seq_lens=(4097,), decode_batches=(1,))
    (d,) = _phase(plan, "prefill")
    assert all(a["cost"]["source"] == "cost model" for a in d.alternatives)


def test_costs_derived_from_a_measurement_are_not_labelled_measured(tmp_path, monkeypatch, restore_table):
    """A bf16 decode cache scaled from the fp32 measurement, and a train bucket scaled from
    another bucket's, were both labelled "measured (tuned)"."""
    spec = ModelSpec(order=3, key_widths=(16, 16), value_width=64, heads=8, model_width=512, layers=2,
                     state_dtype="auto")
    h200 = get_target("h200")
    bwd = default_backward(shape_of(spec), h200.smem_per_sm)
    rec = default_config("recurrent", shape_of(spec), h200.smem_per_sm)
    _with_table(monkeypatch, tmp_path, [_entry(spec, "chunk_bwd", bwd, 1, 64, 1e-3),
                                        _entry(spec, "recurrent", rec, 32, 1, 5e-5)])
    plan = make_plan(spec, h200, batches=(1, 8), seq_lens=(64, 65536), decode_batches=(32,))
    train = {d.batch: d for d in _phase(plan, "train")}
    assert train[8].cost["source"] == "scaled from measured (tuned train bucket B1 T64) by the model"
    assert train[1].seq_len == 65536 and train[1].cost["source"].startswith("scaled from measured")
    (dec,) = _phase(plan, "decode")
    by_dtype = {a["state_dtype"]: a["cost"]["source"] for a in dec.alternatives if a["mode"] == "recurrent"}
    assert by_dtype == {"float32": MEASURED,
                        "bfloat16": "scaled from measured float32 cache (tuned B32) by the model"}
    assert dec.cost["source"] == by_dtype[dec.state_dtype]
    # the exact train bucket is a measurement
    plan = make_plan(spec, h200, batches=(1,), seq_lens=(64,), decode_batches=(32,))
    assert _phase(plan, "train")[0].cost["source"] == MEASURED


# --- 6. buckets planned once ------------------------------------------------------------------


def test_repeated_buckets_are_planned_once():
    plan = make_plan(load_spec(O3_16), get_target("h200"), batches=(1, 1), seq_lens=(16, 16), decode_batches=(1, 1))
    assert [(d.phase, d.batch, d.seq_len) for d in plan.decisions] == [("prefill", 1, 16), ("decode", 1, 1),
                                                                      ("train", 1, 16)]


# --- 7. orders beyond the Triton kernels ------------------------------------------------------


@pytest.mark.parametrize("order", [5, 6], ids=["order5", "order6"])
def test_orders_the_triton_kernels_do_not_take_are_refused(order, tmp_path, capsys, monkeypatch):
    """running_tensor sends orders 5 and 6 to the reference; the plan gave them Triton configs."""
    assert resolve_backend("auto", torch.zeros(1, device="cpu"), order, False) == "reference"
    assert MAX_TRITON_ORDER == 4
    spec = ModelSpec(order=order, key_widths=(2,) * (order - 1), value_width=4, heads=1, model_width=8)
    import rtcompile.plan

    monkeypatch.setattr(rtcompile.plan, "check_memory", lambda *a: pytest.fail("planned before refusing"))
    with pytest.raises(PlanError, match=rf"spec\.order: got {order}; allowed: 2 to 4, .*reference backend"):
        make_plan(spec, get_target("h200"), batches=(1,), seq_lens=(16,), decode_batches=(1,))
    path = tmp_path / "s.json"
    path.write_text(json.dumps(spec.to_dict()))
    assert main(["plan", str(path), "--target", "h200"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"spec.order: got {order}" in err[0]


# --- 8. a custom Target's figures ----------------------------------------------------------


@pytest.mark.parametrize("field,value,exc", [
    ("sms", 0, ValueError), ("hbm_bytes_per_s", 0, ValueError), ("memory_bytes", math.nan, ValueError),
    ("bf16_flops", math.inf, ValueError), ("smem_per_sm", -1, ValueError), ("launch_s", -1e-6, ValueError),
    ("l2_bytes", True, TypeError), ("fp32_flops", "67e12", TypeError), ("name", None, TypeError),
], ids=["sms-0", "hbm-0", "memory-nan", "bf16-inf", "smem-negative", "launch-negative", "l2-bool", "fp32-str",
        "name-None"])
def test_a_target_refuses_figures_the_cost_model_cannot_use(field, value, exc):
    """sms=0 or hbm_bytes_per_s=0 made make_plan raise ZeroDivisionError; memory_bytes=nan
    'min() arg is an empty sequence'."""
    h200 = get_target("h200")
    with pytest.raises(exc, match=rf"^target\.{field}: "):
        dataclasses.replace(h200, **{field: value})
    custom = Target("mine", 16 * 10**9, 1e12, 1e14, 1e14, 1e13, 20, 100 * 1024, 1 << 25, "a test's own GPU")
    assert make_plan(load_spec(O3_16), custom, batches=(1,), seq_lens=(64,), decode_batches=(1,)).decisions
