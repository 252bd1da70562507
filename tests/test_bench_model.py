"""``rtcompile bench --model SPEC`` on the CPU: the case list (with and without fla), the CLI's
refusals, tokens/s from times, the files, the fla mixer against the model's own, and the whole
measuring path at a tiny spec (our kernels under the Triton interpreter, a reference-backed
stand-in for fla)."""

from __future__ import annotations

import csv
import io
import json
import types
from pathlib import Path

import pytest
import torch

from rtcompile.bench import (
    IMPL_FLA,
    IMPL_RT,
    Case,
    Ceilings,
    Outcome,
    measure,
    report,
    run_one,
)
from rtcompile.bench import lm as model_bench
from rtcompile.cli import main
from rtcompile.generate import StaticStep
from rtcompile.kernels.reference import running_tensor_recurrent_ref
from rtcompile.spec import Features, ModelSpec

from conftest import interpreter_only

ROOT = Path(__file__).resolve().parent.parent
O3_16 = str(ROOT / "examples/order3_16x16.toml")  # K = 256: fla runs beside ours
O3_32 = str(ROOT / "examples/order3_32x32.toml")  # K = 1024: ours alone


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _case_lines(out: str) -> list[tuple[str, str]]:
    """(case name, impls) of each case line of a dry run."""
    rows = []
    for line in out.splitlines():
        if line.startswith(("prefill ", "decode ")):
            rows.append((line.split()[1], line.split("impls: ", 1)[1]))
    return rows


# ----- the case list ---------------------------------------------------------------------------
def test_dry_run_lists_prefill_and_decode_with_fla_where_k_is_at_most_256(no_cuda, capsys):
    assert main(["bench", "--model", O3_16, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert _case_lines(out) == [(name, "rtcompile, fla") for name in ("prefill_B1_T4096", "prefill_B8_T4096")] + \
        [(name, "rtcompile, rtcompile+stacked, rtcompile+compile, rtcompile+layers, fla") for name in ("decode_B1", "decode_B32", "decode_B256")]
    assert "K 256" in out and "2 layers" in out and "bfloat16 weights" in out and "not run" not in out


def test_dry_run_without_fla_above_k_256_and_quick(no_cuda, capsys):
    assert main(["bench", "--model", O3_32, "--dry-run", "--quick"]) == 0
    out = capsys.readouterr().out
    assert _case_lines(out) == [(name, "rtcompile") for name in ("prefill_B1_T1024", "prefill_B8_T1024")] + \
        [(name, "rtcompile, rtcompile+stacked, rtcompile+compile, rtcompile+layers") for name in ("decode_B1", "decode_B32")]
    assert "fla      not run: K=1024 > 256" in out


def test_only_filters_the_model_cases(capsys):
    assert main(["bench", "--model", O3_16, "--dry-run", "--only", "decode_B2"]) == 0
    assert [n for n, _ in _case_lines(capsys.readouterr().out)] == ["decode_B256"]


# ----- the CLI's refusals ----------------------------------------------------------------------
def test_without_cuda_exits_2_with_one_line(no_cuda, capsys, tmp_path):
    assert main(["bench", "--model", O3_16, "--out", str(tmp_path / "r")]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and "needs a CUDA GPU" in lines[0]
    assert not (tmp_path / "r").exists()  # nothing written before the device check


@pytest.mark.parametrize("argv, text", [
    (["--model", "no/such/spec.toml"], "no such file"),
    (["--model", str(ROOT / "README.md")], "unsupported extension"),
    (["--model", O3_16, "--phase", "decode"], "--phase decode with --model"),
    (["--model", O3_16, "--only", "B7"], "no case of --model matches"),
])
def test_bad_input_exits_2_with_one_line(no_cuda, capsys, argv, text):
    assert main(["bench", *argv, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and text in lines[0], err


def test_a_spec_the_validation_refuses_exits_2(no_cuda, capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("order = 3\nkey_widths = [16, 16]\nvalue_width = 64\nheads = 8\nmodel_width = 0\n")
    assert main(["bench", "--model", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_width" in err[0]


# ----- arithmetic and files ----------------------------------------------------------------------
def test_tokens_per_second_from_times():
    prefill = Case("prefill_B8_T4096", "prefill", (16, 16), 8, 4096, impls=(IMPL_RT,))
    decode = Case("decode_B256", "decode", (16, 16), 256, 1, impls=(IMPL_RT,))
    p = run_one(prefill, IMPL_RT, lambda: Outcome(seconds=0.01), work=model_bench.case_tokens(prefill),
                ceilings=Ceilings())
    d = run_one(decode, IMPL_RT, lambda: Outcome(seconds=365e-6), work=model_bench.case_tokens(decode),
                ceilings=Ceilings())
    assert p.tokens_per_s == pytest.approx(8 * 4096 / 0.01) and p.ms == pytest.approx(10.0)
    assert d.tokens_per_s == pytest.approx(256 / 365e-6)  # issue 21's 0.70 M tokens/s
    assert p.gbps is None and p.x_floor is None  # no model bytes claimed


def test_model_files_are_model_json_and_csv(tmp_path):
    case = Case("decode_B1", "decode", (4, 4), 1, 1, impls=(IMPL_RT,))
    rows = [run_one(case, IMPL_RT, lambda: Outcome(seconds=1e-4, timing="t"), work=model_bench.case_tokens(case),
                    ceilings=Ceilings())]
    header = {"gpu": "G", "commit": "abc", "method": "m", "spec": {"order": 3}}
    jpath, cpath = report.write_results(tmp_path, header, rows, stem="model")
    assert (jpath.name, cpath.name) == ("model.json", "model.csv") and not (tmp_path / "bench.json").exists()
    doc = json.loads(jpath.read_text())
    assert doc["header"]["method"] == "m" and doc["rows"][0]["tokens_per_s"] == pytest.approx(1e4)
    (row,) = csv.DictReader(io.StringIO(cpath.read_text()))
    assert row["gpu"] == "G" and row["commit"] == "abc" and row["impl"] == IMPL_RT


# ----- the fla mixer and the measuring path --------------------------------------------------------
def _fake_fla(calls: list):
    """fla.ops.gated_delta_rule look-alike on the float64 token loop; records which op ran."""

    def op(name):
        def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False):
            calls.append((name, q.shape[1]))
            return running_tensor_recurrent_ref([q], [k], v, g, beta, scale=scale, initial_state=initial_state,
                                                output_final_state=output_final_state,
                                                l2norm=use_qk_l2norm_in_kernel)
        return run

    mod = types.ModuleType("fla.ops.gated_delta_rule")
    mod.chunk_gated_delta_rule = op("chunk")
    mod.fused_recurrent_gated_delta_rule = op("fused_recurrent")
    return mod


@pytest.fixture
def fake_fla(monkeypatch):
    calls: list = []
    mod = _fake_fla(calls)
    monkeypatch.setattr(model_bench, "fla_ops", lambda: mod)
    for module in (model_bench, measure, report):  # each holds its own name for it
        monkeypatch.setattr(module, "fla_version", lambda: "0.6.0-fake")
    return calls


def _tiny_lm(**features):
    spec = ModelSpec(order=3, key_widths=(2, 4), value_width=4, heads=2, model_width=12, layers=2, chunk_size=16,
                     input_dtype="float32", features=Features(query_skip=True, **features))
    return model_bench.build_model(spec, "cpu", vocab=19)


@pytest.mark.parametrize("forget_gate, l2norm, tol", [(True, False, 1e-4), (False, False, 1e-4), (True, True, 2e-2)])
def test_fla_mixer_is_the_same_model(fake_fla, forget_gate, l2norm, tol):
    """Prefill logits and four graph-loop steps (StaticStep, run eagerly) of the model on the fla
    mixer equal the model on the reference: phi(q), phi(k), the scale, the gate and the state's
    [K, V] <-> [d_1, d_2, V] layout agree. With l2norm, only nearly: ours normalises each factor
    with eps 1e-6, fla normalises phi (the eps lands differently at these 2- and 4-wide factors)."""
    lm = _tiny_lm(forget_gate=forget_gate, l2norm=l2norm)
    prompt = torch.randint(0, 19, (3, 9), generator=torch.Generator().manual_seed(1))
    steppers = {}
    with torch.no_grad():
        for mixer in (None, model_bench.fla_mixer):
            lm.bench_mixer = mixer
            logits, cache = lm(prompt, backend="reference")
            step = StaticStep(lm, 4, "reference", capture=False)  # B3 in bucket 4: a padding row
            step.load(cache, 3)
            tok, out = logits[:, -1].argmax(-1), [logits]
            for _ in range(4):
                out.append(step(tok).clone())
                tok = out[-1].argmax(-1)
            steppers[mixer] = out
    ours, fla = steppers[None], steppers[model_bench.fla_mixer]
    for a, b in zip(ours, fla, strict=True):
        assert torch.allclose(a, b, rtol=tol, atol=tol), float((a - b).abs().max())
    assert {c[0] for c in fake_fla} == {"chunk", "fused_recurrent"}
    assert all((name == "fused_recurrent") == (T == 1) for name, T in fake_fla)  # T = 1 is the decode op


def test_fla_without_delta_rule_is_a_refused_row(fake_fla):
    lm = _tiny_lm(delta_rule=False)
    case = Case("prefill_B1_T8", "prefill", (2, 4), 1, 8, H=2, V=4, impls=(IMPL_RT, IMPL_FLA))
    ctx = model_bench.BenchContext(torch.device("cpu"), repeats=3, l2_bytes=0)
    with torch.no_grad():
        row = run_one(case, IMPL_FLA, lambda: model_bench.measure_model_prefill(lm, case, IMPL_FLA, ctx),
                      work=model_bench.case_tokens(case), ceilings=Ceilings())
    assert row.ms is None and row.note.startswith("refused:") and "delta rule" in row.note
    assert lm.bench_mixer is None  # the next implementation runs on ours


def test_fla_not_installed_is_a_row_saying_so(monkeypatch):
    monkeypatch.setattr(measure, "fla_version", lambda: None)  # fla_refusal's
    lm = _tiny_lm()
    case = model_bench.model_cases(lm.spec)[2]
    ctx = model_bench.BenchContext(torch.device("cpu"), repeats=3, l2_bytes=0)
    out = model_bench.measure_model_decode(lm, case, IMPL_FLA, ctx)
    assert out.seconds is None and "not installed" in out.note


@interpreter_only
def test_cpu_run_measures_prefill_and_decode_of_both(fake_fla, monkeypatch, tmp_path):
    """The whole run at a tiny fp32 spec on the CPU: our Triton kernels (interpreter) and the fla
    stand-in, each row timed, tokens/s = tokens / time, files and table written."""
    monkeypatch.setattr(model_bench, "QUICK_T", 16)
    monkeypatch.setattr(model_bench, "PREFILL_BATCHES", (2,))
    monkeypatch.setattr(model_bench, "QUICK_DECODE_BATCHES", (2,))
    spec = ModelSpec(order=3, key_widths=(4, 4), value_width=8, heads=1, model_width=16, layers=1, chunk_size=16,
                     input_dtype="float32")
    opts = model_bench.ModelBenchOptions(spec=spec, spec_path="tiny.toml", quick=True, out=tmp_path / "o", repeats=3)
    table, log = io.StringIO(), io.StringIO()
    rows = model_bench.run_model_bench(opts, device="cpu", file=table, log=log)
    assert [(r.case, r.impl) for r in rows] == [("prefill_B2_T16", IMPL_RT), ("prefill_B2_T16", IMPL_FLA),
                                                ("decode_B2", IMPL_RT), ("decode_B2", model_bench.IMPL_RT_FUSED),
                                                ("decode_B2", model_bench.IMPL_RT_COMPILED),
                                                ("decode_B2", model_bench.IMPL_RT_LAYERS), ("decode_B2", IMPL_FLA)]
    for compiled in (rows.pop(5), rows.pop(4)):  # the compiled steps are measured on CUDA only: rows that say so
        assert compiled.ms is None and "CUDA only" in compiled.note
    for r in rows:
        assert r.ms and r.ms > 0, r
        assert r.tokens_per_s == pytest.approx((32 if r.phase == "prefill" else 2) / (r.ms / 1e3))
    assert rows[1].rel_rms_err < 1e-4 and "logits vs rtcompile's" in rows[1].note  # the same model
    assert "static step run eagerly (bucket 2)" in rows[2].timing and "median of 3" in rows[2].timing
    assert ("fused_recurrent", 1) in fake_fla and ("chunk", 16) in fake_fla
    doc = json.loads((tmp_path / "o" / "model.json").read_text())
    assert doc["header"]["method"] == model_bench.MODEL_METHOD and doc["header"]["spec"]["key_widths"] == [4, 4]
    assert doc["header"]["gpu"] == "none (cpu)" and doc["header"]["commit"] and len(doc["rows"]) == 7
    assert len(list(csv.DictReader(io.StringIO((tmp_path / "o" / "model.csv").read_text())))) == 7
    assert "prefill_B2_T16" in table.getvalue() and len(log.getvalue().splitlines()) == 7
