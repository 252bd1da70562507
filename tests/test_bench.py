"""The benchmark harness on CPU: CLI, plan, roofline arithmetic, result files, failure rows,
and the whole measuring path on tiny shapes with fake kernels and a fake fla (no GPU needed).
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import types
from dataclasses import replace

import pytest
import torch

from rtcompile import bench
from rtcompile.bench import measure, report
from rtcompile.bench import (
    IMPL_COPY, IMPL_FLA, IMPL_REF, IMPL_RT, IMPL_RT_RECURRENT, BenchOptions, Case, Ceilings, Deadline,
    Outcome, Row, Work,
)
from rtcompile.cli import main
from rtcompile.kernels.reference import running_tensor_chunk_ref, running_tensor_recurrent_ref


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ----- CLI ---------------------------------------------------------------------------------------
def test_cli_without_cuda_exits_2_with_one_line(no_cuda, capsys, tmp_path):
    assert main(["bench", "--out", str(tmp_path / "r")]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and "CUDA GPU" in lines[0]
    assert not (tmp_path / "r").exists()  # nothing written before the device check


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine this would start a real run")
def test_cli_without_cuda_subprocess_no_traceback():
    r = subprocess.run([sys.executable, "-m", "rtcompile.cli", "bench", "--quick"], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "CUDA" in r.stderr


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--repeats", "x"], ["--phase", "backward"], ["--budget-s", "-1"]])
def test_cli_bad_arguments(argv, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rtcompile bench:")


def test_dry_run_lists_every_case(no_cuda, capsys):
    assert main(["bench", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for case in bench.plan("all"):
        assert case.name in out
    assert "o3_64x64_B8_T4096" in out and "fla(refused: K>256, not called)" in out
    assert "o3_16x16_B256" in out and "copy-same-size" in out and "validate=False" in out


def test_dry_run_quick_and_phase(capsys):
    assert main(["bench", "--dry-run", "--quick", "--phase", "prefill"]) == 0
    out = capsys.readouterr().out
    assert "T1024" in out and "T4096" not in out and "decode " not in out
    assert len(bench.plan("all", quick=True)) < len(bench.plan("all"))


def test_plan_matches_the_issue():
    prefill = {c.key_widths for c in bench.prefill_cases()}
    assert {(16, 16), (32, 32), (64, 64), (16, 16, 16), (64,), (128,), (256,), (8, 8), (16, 8)} == prefill
    assert all((c.B, c.T, c.H, c.V, c.dtype) == (8, 4096, 8, 64, "bfloat16") for c in bench.prefill_cases())
    assert {(c.key_widths, c.B) for c in bench.decode_cases()} == {((16, 16), 256), ((32, 32), 32), ((16, 16), 32)}
    errs = bench.error_cases()
    assert {c.dtype for c in errs} == {"bfloat16", "float32"} and all((c.T, c.B) == (256, 2) for c in errs)
    assert all((IMPL_FLA in c.impls) == (c.K <= 256 and c.dtype == "bfloat16") for c in errs)
    case = replace(bench.prefill_cases()[0], variants={"bk32": {"variant": "x"}})
    assert case.impl_names() == [IMPL_RT, f"{IMPL_RT}[bk32]", IMPL_REF, IMPL_FLA]


# ----- arithmetic ---------------------------------------------------------------------------------
O3_16 = Case("o3_16x16", "prefill", (16, 16), 8, 4096)


def test_prefill_work_and_floor_by_hand():
    # chunk C=64 per head and token: 2CS 4096 + 2CV 8192 + 4KV 65536 + delta (2KV 32768 + 2CS + 2CV)
    # = 122880; x 8 heads = 983040. Bytes: 2 * (8 * 256 * 64 * 4) / 64 = 16384 state traffic
    # + 8 heads * (2*32 + 64 + 1 + 1 + 64) * 2 = 3104 inputs/outputs -> 19488 per token.
    work = bench.case_work(O3_16)
    tokens = 8 * 4096
    assert work == Work(983_040 * tokens, 19_488 * tokens, tokens)
    ceil = Ceilings(copy_gbps=4000.0, matmul_tflops=700.0)
    mem_s = 19_488 * tokens / 4000e9  # 638,582,784 B / 4 TB/s = 159.65 us: memory bound
    mm_s = 983_040 * tokens / 700e12  # 46.0 us
    assert bench.floor_seconds(work, ceil) == pytest.approx(max(mem_s, mm_s)) == pytest.approx(159.6457e-6, rel=1e-5)
    row = bench.derive_row(bench.base_row(O3_16, IMPL_RT), Outcome(seconds=0.5e-3), work, ceil)
    assert row.ms == pytest.approx(0.5)
    assert row.tokens_per_s == pytest.approx(tokens / 0.5e-3)
    assert row.gbps == pytest.approx(19_488 * tokens / 0.5e-3 / 1e9)  # 1277.2 GB/s
    assert row.frac_copy_bw == pytest.approx(row.gbps / 4000)
    assert row.tflops == pytest.approx(983_040 * tokens / 0.5e-3 / 1e12)
    assert row.x_floor == pytest.approx(0.5e-3 / 159.6457e-6, rel=1e-5)
    assert row.frac_same_size_copy is None


def test_compute_bound_floor():
    work = Work(flops=700e12, nbytes=1e9, tokens=None)  # 1 s of matmul, 0.25 ms of copy
    assert bench.floor_seconds(work, Ceilings(4000.0, 700.0)) == pytest.approx(1.0)
    assert bench.floor_seconds(work, Ceilings(None, 700.0)) is None


def test_decode_work_by_hand():
    case = Case("d", "decode", (16, 16), 32, 1)
    work = bench.case_work(case)
    # per sequence: 2 * state (8 * 256 * 64 * 4 = 524288) + 3104 inputs/outputs
    assert work.nbytes == 32 * (2 * 524_288 + 3_104) == 33_653_760
    # per head: 4KV 65536 + phi 2K(o-2) 512 + gate KV 16384 + delta 2KV 32768 = 115200
    assert work.flops == 32 * 8 * 115_200 and work.tokens == 32
    same = 2 * 32 * 524_288 / 20e-6 / 1e9  # same-size copy of the state bytes in 20 us
    row = bench.derive_row(bench.base_row(case, IMPL_RT), Outcome(seconds=25e-6), work, Ceilings(4000.0, 700.0), same)
    assert row.gbps == pytest.approx(33_653_760 / 25e-6 / 1e9)
    assert row.frac_same_size_copy == pytest.approx(row.gbps / same)
    assert row.tokens_per_s == pytest.approx(32 / 25e-6)


def test_rotation_repeats_and_graph_sizes():
    mib = 1 << 20
    assert bench.rotation_count(16 * mib, 50 * mib) == 13  # ceil(200 / 16)
    assert bench.rotation_count(300 * mib, 50 * mib) == 1
    assert bench.rotation_count(300 * mib, 50 * mib, minimum=2) == 2
    assert bench.rotation_count(1, 50 * mib) == bench.MAX_ROTATIONS
    assert bench.rotation_count(10, 0, minimum=2) == 2
    assert bench.repeats_for(1e-3, 25) == 25
    assert bench.repeats_for(1.0, 25) == 10  # 10 s of timing at most ...
    assert bench.repeats_for(60.0, 25) == bench.MIN_SLOW_REPEATS  # ... but never fewer than 5
    assert bench.graph_calls_count(13e-6, 13) == 377  # ceil(5 ms / 13 us) = 385, down to a multiple of 13
    assert bench.graph_calls_count(1e-7, 1) == 512  # capped
    assert bench.graph_calls_count(0.6e-3, 1) == 64  # ceil(5 ms / 0.6 ms) = 9, raised to the minimum
    assert bench.graph_calls_count(0.6e-3, 15) == 60
    assert bench.graph_calls_count(0.9e-3, 100) == 100  # never fewer than one call per input set


def test_rel_rms():
    e = torch.tensor([3.0, 4.0])
    assert bench.rel_rms(e, e) == 0
    assert bench.rel_rms(e + torch.tensor([0.3, 0.4]), e) == pytest.approx(0.1)
    assert bench.rel_rms(torch.tensor([float("nan"), 1.0]), e) == float("inf")
    out = measure._error_outcome(0.05, 1e-3, "bfloat16")
    assert out.rel_rms_err == 0.05 and "check" in out.note
    assert measure._error_outcome(float("inf"), None, "float32").rel_rms_err is None


# ----- result files -------------------------------------------------------------------------------
HEADER = {"gpu": "FakeGPU", "compute_capability": "9.0", "torch": "2.11", "triton": "3.6", "fla": None,
          "rtcompile": "0.1.0", "commit": "abc123", "date": "2030-01-01T00:00:00+00:00", "method": "fake"}


def _fake_rows() -> list[Row]:
    work = bench.case_work(O3_16)
    ceil = Ceilings(4000.0, 700.0)
    ok = bench.derive_row(bench.base_row(O3_16, IMPL_RT), Outcome(seconds=1e-3, timing="graph", peak_extra_mem_bytes=1024),
                          work, ceil)
    failed = replace(bench.base_row(O3_16, IMPL_FLA), note="refused: K=1024 > 256")
    nan = replace(bench.base_row(O3_16, IMPL_REF), rel_rms_err=float("nan"))
    return [ok, failed, nan]


def test_write_results_json_and_csv(tmp_path):
    out = tmp_path / "results" / "today"
    rows = _fake_rows()
    jpath, cpath = bench.write_results(out, HEADER, rows)
    doc = json.loads(jpath.read_text())
    assert doc["header"]["gpu"] == "FakeGPU" and doc["header"]["commit"] == "abc123"
    assert [r["impl"] for r in doc["rows"]] == [IMPL_RT, IMPL_FLA, IMPL_REF]
    assert doc["rows"][0]["ms"] == pytest.approx(1.0) and doc["rows"][2]["rel_rms_err"] is None  # NaN -> null
    assert set(bench.ROW_FIELDS) <= set(doc["rows"][0])
    with cpath.open(newline="") as fh:
        got = list(csv.DictReader(fh))
    assert len(got) == 3 and got[0]["gpu"] == "FakeGPU" and got[0]["commit"] == "abc123"
    assert float(got[0]["ms"]) == pytest.approx(1.0) and got[1]["ms"] == "" and got[1]["note"].startswith("refused")
    for name in ("case", "impl", "phase", "order", "key_widths", "B", "T", "H", "V", "dtype", "tokens_per_s", "gbps",
                 "tflops", "frac_copy_bw", "frac_same_size_copy", "x_floor", "peak_extra_mem_bytes", "rel_rms_err"):
        assert name in got[0]
    assert sorted(p.name for p in out.iterdir()) == ["bench.csv", "bench.json"]  # no temporaries left


def test_csv_rows_say_whether_the_tree_was_dirty(tmp_path):
    """Before: the CSV carried the commit but not git_dirty, so a dirty tree's row read as the commit's."""
    _, cpath = bench.write_results(tmp_path, {**HEADER, "git_dirty": True}, _fake_rows())
    with cpath.open(newline="") as fh:
        assert {row["git_dirty"] for row in csv.DictReader(fh)} == {"True"}


@pytest.mark.parametrize("field, value, exc, match", [
    ("repeats", 0, ValueError, r"repeats: got 0; allowed: an integer >= 3"),
    ("repeats", 2.5, TypeError, r"repeats: expected an int"),
    ("budget_s", -5.0, ValueError, r"budget_s: got -5.0; allowed: seconds > 0"),
    ("budget_s", float("nan"), ValueError, r"budget_s: got nan"),
    ("budget_s", "60", TypeError, r"budget_s: expected a float"),
], ids=["repeats-0", "repeats-float", "budget-negative", "budget-nan", "budget-str"])
def test_bench_options_refuse_what_the_cli_refuses(field, value, exc, match):
    """The Python API checks what the CLI's parser does: repeats 0 wrote a results file whose rows
    all read "no median for empty data", a negative budget one whose rows were all skipped."""
    from rtcompile.bench.lm import ModelBenchOptions
    from rtcompile.spec import ModelSpec

    with pytest.raises(exc, match=match):
        bench.BenchOptions(**{field: value})
    with pytest.raises(exc, match=match):
        ModelBenchOptions(spec=ModelSpec(order=2, key_widths=(4,), value_width=4, heads=1, model_width=8),
                          **{field: value})


def test_write_is_atomic(tmp_path, monkeypatch):
    bench.write_results(tmp_path, HEADER, _fake_rows())
    before = (tmp_path / "bench.json").read_text()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(bench.os, "replace", boom)
    with pytest.raises(OSError):
        bench.write_results(tmp_path, {**HEADER, "gpu": "Other"}, _fake_rows()[:1])
    assert (tmp_path / "bench.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.csv", "bench.json"]


def test_tables_print_and_pivot_errors():
    err_rows = [replace(bench.base_row(replace(O3_16, phase="error"), IMPL_RT), dtype=d, rel_rms_err=e)
                for d, e in (("bfloat16", 3e-3), ("float32", 2e-6))]
    buf = io.StringIO()
    bench.print_tables([*_fake_rows(), *err_rows], {**HEADER, "ceilings": {"copy_gbps": 4270.0, "matmul_tflops": 690.0}}, buf)
    text = buf.getvalue()
    assert "x floor" in text and "4270 GB/s" in text and "3.0e-03" in text and "2.0e-06" in text
    assert text.index("relative RMS error") < text.index("x floor")  # the timing table comes last


# ----- the runner never raises --------------------------------------------------------------------
def test_failing_implementations_become_rows():
    calls = []

    def ok():
        calls.append("ok")
        return Outcome(seconds=2e-3, timing="fake")

    def crash():
        raise RuntimeError("kernel exploded\nsecond line")

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def refuse():
        raise AssertionError("current kernel does not support head dimension larger than 256.")

    rows = bench.run_case(O3_16, {"a": crash, "b": oom, "c": refuse, "d": ok}, ceilings=Ceilings(4000.0, 700.0))
    assert [r.impl for r in rows] == ["a", "b", "c", "d"]
    assert rows[0].note == "error: RuntimeError: kernel exploded" and rows[0].ms is None
    assert rows[1].note.startswith("OOM: CUDA out of memory")
    assert rows[2].note.startswith("refused: current kernel does not support head dimension")
    assert rows[3].ms == pytest.approx(2.0) and rows[3].x_floor is not None and calls == ["ok"]


def test_spent_budget_skips_instead_of_running():
    deadline = Deadline(budget_s=1.0, start=0.0)  # started at monotonic 0: long spent
    rows = bench.run_case(O3_16, {"x": lambda: pytest.fail("must not run")}, deadline=deadline)
    assert rows[0].note.startswith("skipped: time budget")


def test_same_size_copy_is_the_decode_denominator():
    case = Case("d", "decode", (16, 16), 32, 1)
    copy_work = Work(0, 2 * 32 * 524_288, None)
    rows = bench.run_case(case, {IMPL_COPY: lambda: Outcome(seconds=10e-6, work=copy_work),
                                 IMPL_RT: lambda: Outcome(seconds=20e-6)}, ceilings=Ceilings(4000.0, 700.0))
    assert rows[0].frac_same_size_copy == 1.0 and rows[0].tokens_per_s is None
    assert rows[1].frac_same_size_copy == pytest.approx(rows[1].gbps / rows[0].gbps)


# ----- the measuring path on CPU with fake kernels and a fake fla ---------------------------------
class FakeKernels:
    """Stand-ins for rtcompile.kernels.launch with the agreed signatures (they call the references)."""

    def __init__(self):
        self.variants = []

    def running_tensor_fwd(self, q, k, v, g=None, beta=None, *, scale=None, initial_state=None,
                           output_final_state=False, l2norm=False, cu_seqlens=None, mode="chunk", chunk_size=64,
                           variant=None):
        self.variants.append(variant)
        kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state, l2norm=l2norm,
                  cu_seqlens=cu_seqlens)
        if mode == "recurrent":
            return running_tensor_recurrent_ref(q, k, v, g, beta, **kw)
        return running_tensor_chunk_ref(q, k, v, g, beta, chunk_size=chunk_size, **kw)

    def running_tensor_decode_(self, q, k, v, g=None, beta=None, *, state_cache, state_indices, scale=None,
                               l2norm=False, validate=True, variant=None):
        assert state_indices.dtype == torch.int32
        idx = state_indices.long()
        o, s = running_tensor_recurrent_ref(q, k, v, g, beta, scale=scale, initial_state=state_cache[idx],
                                            output_final_state=True, l2norm=l2norm)
        state_cache[idx] = s
        return o


def _fake_fla_module():
    """fla.ops.gated_delta_rule look-alike: order 2 on the Kronecker keys, fla's refusals."""

    def check(q, v):
        assert q.dtype != torch.float32, "ChunkGatedDeltaRuleFunction does not support float32. Please use bfloat16."
        assert q.shape[-1] <= 256, "current kernel does not support head dimension larger than 256."

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        check(q, v)
        return running_tensor_chunk_ref([q], [k], v, g, beta, scale=scale, initial_state=initial_state,
                                        output_final_state=output_final_state, l2norm=use_qk_l2norm_in_kernel)

    def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                         initial_state=None, output_final_state=False,
                                         use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        return running_tensor_recurrent_ref([q], [k], v, g, beta, scale=scale, initial_state=initial_state,
                                            output_final_state=output_final_state, l2norm=use_qk_l2norm_in_kernel)

    mod = types.ModuleType("fla.ops.gated_delta_rule")
    mod.chunk_gated_delta_rule = chunk_gated_delta_rule
    mod.fused_recurrent_gated_delta_rule = fused_recurrent_gated_delta_rule
    return mod


@pytest.fixture
def fakes(monkeypatch):
    kernels = FakeKernels()
    mod = types.ModuleType("rtcompile.kernels.launch")
    mod.running_tensor_fwd = kernels.running_tensor_fwd
    mod.running_tensor_decode_ = kernels.running_tensor_decode_
    monkeypatch.setitem(sys.modules, "rtcompile.kernels.launch", mod)
    fla = _fake_fla_module()
    monkeypatch.setattr(measure, "fla_ops", lambda: fla)
    for module in (measure, report):  # each holds its own name for it
        monkeypatch.setattr(module, "fla_version", lambda: "0.6.0-fake")
    monkeypatch.setattr(measure, "EAGER_CALLS", 3)
    monkeypatch.setattr(measure, "EAGER_TRIALS", 2)
    monkeypatch.setattr(measure, "EAGER_WARMUP", 1)
    return kernels


def _tiny(name, phase, widths, B, T, dtype="float32", impls=None, **kw):
    default = {"prefill": (IMPL_RT, IMPL_REF, IMPL_FLA), "error": (IMPL_RT, IMPL_RT_RECURRENT, IMPL_REF, IMPL_FLA),
               "decode": (IMPL_COPY, IMPL_RT, IMPL_REF, IMPL_FLA)}
    return Case(name, phase, widths, B, T, H=2, V=4, dtype=dtype, impls=impls or default[phase], chunk_size=16, **kw)


def test_cpu_run_with_fakes(fakes, tmp_path):
    variants = {"v2": {"variant": "V2"}}
    cases = [
        _tiny("p_small", "prefill", (2, 3), 1, 20, dtype="bfloat16", variants=variants),
        _tiny("p_wide", "prefill", (17, 17), 1, 16, dtype="bfloat16"),  # K = 289 > 256: fla not called
        _tiny("e_bf16", "error", (2, 3), 2, 24, dtype="bfloat16"),
        _tiny("e_fp32", "error", (2, 3), 2, 24),
        _tiny("d_small", "decode", (2, 3), 3, 1, dtype="bfloat16"),
        Case("eager", "eager", (2, 3), 1, 1, H=2, V=4, impls=bench.eager_cases()[0].impls),
    ]
    opts = BenchOptions(out=tmp_path / "out", repeats=3)
    table = io.StringIO()
    rows = bench.run_bench(opts, device="cpu", cases=cases, measure_ceilings=False, file=table, log=io.StringIO())
    by = {(r.case, r.dtype, r.impl): r for r in rows}

    for impl in (IMPL_RT, f"{IMPL_RT}[v2]", IMPL_REF, IMPL_FLA):
        r = by[("p_small", "bfloat16", impl)]
        assert r.ms and r.ms > 0 and r.gbps and r.tokens_per_s, (impl, r.note)
    assert "V2" in fakes.variants  # the variant's kwargs reached the kernel
    assert by[("p_wide", "bfloat16", IMPL_FLA)].note.startswith("refused: K=289 > 256")
    assert by[("p_wide", "bfloat16", IMPL_RT)].ms

    for impl in (IMPL_RT, IMPL_RT_RECURRENT, IMPL_REF):
        assert by[("e_fp32", "float32", impl)].rel_rms_err < 1e-5
        assert by[("e_bf16", "bfloat16", impl)].rel_rms_err < 2e-2
    assert by[("e_bf16", "bfloat16", IMPL_FLA)].rel_rms_err < 2e-2  # Kronecker keys == factored problem
    assert by[("e_fp32", "float32", IMPL_FLA)].note.startswith("refused: ChunkGatedDeltaRuleFunction does not support")

    copy = by[("d_small", "bfloat16", IMPL_COPY)]
    assert copy.gbps and copy.frac_same_size_copy == 1.0
    for impl in (IMPL_RT, IMPL_REF, IMPL_FLA):
        r = by[("d_small", "bfloat16", impl)]
        assert r.ms and r.frac_same_size_copy and r.rel_rms_err is not None and r.rel_rms_err < 2e-2, (impl, r.note)

    eager = [r for r in rows if r.phase == "eager"]
    assert len(eager) == 4 and all(r.ms and "us/call" in r.note for r in eager)

    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert len(doc["rows"]) == len(rows) and doc["header"]["method"] == bench.METHOD
    assert doc["header"]["rtcompile"] and doc["header"]["commit"]
    assert "x floor" in table.getvalue()


def test_cpu_run_records_a_broken_kernel(fakes, monkeypatch, tmp_path):
    def broken(*args, **kwargs):
        raise ValueError("v: expected shape [B, T, H, d_v]")

    monkeypatch.setattr(sys.modules["rtcompile.kernels.launch"], "running_tensor_fwd", broken)
    rows = bench.run_bench(BenchOptions(repeats=3), device="cpu", measure_ceilings=False,
                           cases=[_tiny("p", "prefill", (2, 2), 1, 16, dtype="bfloat16")], file=io.StringIO(), log=io.StringIO())
    assert [r.impl for r in rows] == [IMPL_RT, IMPL_REF, IMPL_FLA]
    assert rows[0].note == "error: ValueError: v: expected shape [B, T, H, d_v]" and rows[0].ms is None
    assert rows[1].ms and rows[2].ms


def test_ceilings_on_cpu():
    ctx = bench.BenchContext(torch.device("cpu"), repeats=3, l2_bytes=0)
    copy = measure._measure_big_copy(ctx, nbytes=1 << 20)
    mm = measure._measure_matmul(ctx, n=32)
    assert copy.seconds > 0 and copy.work.nbytes == 2 << 20
    assert mm.seconds > 0 and mm.work.flops == 2 * 32**3
    rows = bench.run_case(bench.CEILING_CASE, {bench.IMPL_BIG_COPY: lambda: copy, bench.IMPL_MATMUL: lambda: mm})
    ceil = bench.ceilings_from(rows)
    assert ceil.copy_gbps == pytest.approx(2 * (1 << 20) / copy.seconds / 1e9)
    assert ceil.matmul_tflops == pytest.approx(2 * 32**3 / mm.seconds / 1e12)
    assert rows[0].order is None and rows[0].phase == "ceiling"


def test_git_commit_prefers_env_then_git_then_unknown(monkeypatch):
    monkeypatch.setenv("RTCOMPILE_COMMIT", "feedbeef")  # named by the caller: wins over a stale checkout
    assert bench.git_commit() == ("feedbeef", None)
    monkeypatch.delenv("RTCOMPILE_COMMIT")
    commit, _ = bench.git_commit()
    assert len(commit) == 40 and commit != "feedbeef"  # this repository's HEAD

    def no_git(*a, **k):
        raise FileNotFoundError("git")

    monkeypatch.setattr(bench.subprocess, "run", no_git)
    assert bench.git_commit() == ("unknown", None)


def test_import_does_not_touch_a_device():
    code = ("import sys, rtcompile.bench, rtcompile.cli; rtcompile.cli.build_parser(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_variant_names_survive_rich_markup():
    import io

    from rtcompile.bench.report import _print_table

    buf = io.StringIO()
    _print_table("t", ["impl"], [["rtcompile[fused]"]], buf)
    assert "rtcompile[fused]" in buf.getvalue()


def test_only_keeps_matching_cases(capsys):
    assert main(["bench", "--dry-run", "--only", "64x64", "--only", "_eager"]) == 0
    out = capsys.readouterr().out
    assert "o3_64x64_B8_T4096" in out and "o3_64x64_B2_T256" in out and "o3_16x16_B1_eager" in out
    assert "o3_16x16_B8_T4096" not in out and "o3_16x16_B256" not in out
    names = {c.name for c in bench.plan("all", only=("64x64",))}
    assert names == {"o3_64x64_B8_T4096", "o3_64x64_B2_T256"}


def test_only_without_a_match_is_a_usage_error(capsys):
    assert main(["bench", "--dry-run", "--phase", "decode", "--only", "64x64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--only '64x64': no case of phase decode matches" in err[0]


H200_SMEM = types.SimpleNamespace(shared_memory_per_block_optin=227 * 1024)


def test_named_variants_are_the_forms_two_kernel_and_low_memory_configs(monkeypatch):
    from rtcompile.bench.core import DEFAULT_VARIANTS, ERROR_VARIANTS
    from rtcompile.kernels import forms
    from rtcompile.kernels.config import KernelShape

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: H200_SMEM)
    assert set(DEFAULT_VARIANTS) == set(ERROR_VARIANTS) == {"two-kernel", "fused", "split", "materialise"}
    split_case = Case("o3_16x16", "prefill", (16, 16), 2, 256, dtype="bfloat16")  # the split default
    shape = KernelShape((16, 16), 64, 2)
    assert forms.default_config("chunk", shape, H200_SMEM.shared_memory_per_block_optin).form == "split"
    two = DEFAULT_VARIANTS["two-kernel"](split_case)["variant"]
    assert two == forms.two_kernel(shape, H200_SMEM.shared_memory_per_block_optin) and two.form != "split"
    fused = DEFAULT_VARIANTS["fused"](split_case)["variant"]
    assert fused == forms.low_memory(shape, H200_SMEM.shared_memory_per_block_optin) and fused.form == "fused"
    # refused (a "refused: ..." row) where the default is not the split form
    with pytest.raises(NotImplementedError, match="not the split form"):
        DEFAULT_VARIANTS["two-kernel"](Case("o3_32x32", "prefill", (32, 32), 2, 256, dtype="bfloat16"))
    # the split form beside another default (o2 128), refused where it is the default already
    o2 = Case("o2_128", "prefill", (128,), 2, 256, dtype="bfloat16")
    split = DEFAULT_VARIANTS["split"](o2)["variant"]
    assert split.form == "split" and split == forms.split_form(KernelShape((128,), 64, 2), 227 * 1024)
    with pytest.raises(NotImplementedError, match="split form"):
        DEFAULT_VARIANTS["split"](split_case)
    # phi materialised: order >= 3 up to K = 256, refused at order 2
    assert DEFAULT_VARIANTS["materialise"](split_case)["variant"].materialise
    with pytest.raises(NotImplementedError, match="materialise"):
        DEFAULT_VARIANTS["materialise"](o2)


@pytest.mark.parametrize("dtype, itemsize", [("bfloat16", 2), ("float32", 4)], ids=["bf16", "fp32"])
def test_named_variants_follow_the_input_width(monkeypatch, dtype, itemsize):
    # the defaults depend on the input width (the product precision at K > 256); a named variant
    # built for bf16 and run on fp32 inputs measured tf32's error (2.5e-3) as if it were the variant's
    from rtcompile.bench.core import DECODE_VARIANTS, DEFAULT_VARIANTS
    from rtcompile.kernels import forms

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: H200_SMEM)
    seen = []
    for name in ("low_memory", "two_kernel", "default_config"):
        real = getattr(forms, name)
        monkeypatch.setattr(forms, name, lambda *a, _real=real, **kw: seen.append(
            next(x for x in a if hasattr(x, "input_bytes")).input_bytes) or _real(*a, **kw))
    case = Case("o3_16x16", "prefill", (16, 16), 2, 256, dtype=dtype)
    for call in (DEFAULT_VARIANTS["fused"], DEFAULT_VARIANTS["two-kernel"], DECODE_VARIANTS["outer-phi"]):
        call(case)
    assert seen and set(seen) == {itemsize}


def test_batch_free_decode_variant_is_the_tile_before_the_batch_rule(monkeypatch):
    from rtcompile.bench.core import DECODE_VARIANTS
    from rtcompile.kernels import forms

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: H200_SMEM)
    big = Case("o3_16x16_B256", "decode", (16, 16), 256, 1)
    cfg = DECODE_VARIANTS["batch-free"](big)["variant"]
    shape = forms.KernelShape((16, 16), 64, 2)
    assert cfg == forms.default_config("recurrent", shape) and cfg.block_v == 32
    assert forms.default_config("recurrent", shape, decode_rows=256 * 8).block_v == 64
    with pytest.raises(NotImplementedError, match="no doubled tile"):  # B32: nothing to compare
        DECODE_VARIANTS["batch-free"](Case("o3_16x16_B32", "decode", (16, 16), 32, 1))
    # the outer-phi row is the batch's default with outer_phi alone changed
    outer = DECODE_VARIANTS["outer-phi"](big)["variant"]
    wide = forms.default_config("recurrent", shape, H200_SMEM.shared_memory_per_block_optin, decode_rows=256 * 8)
    assert outer == replace(wide, outer_phi=True)


# ----- the train phase ---------------------------------------------------------------------------
def test_dry_run_lists_the_train_cases(no_cuda, capsys):
    assert main(["bench", "--dry-run", "--phase", "train"]) == 0
    out = capsys.readouterr().out
    cases = bench.plan("train")
    assert {c.key_widths for c in cases} == {(16, 16), (64,), (128,), (256,), (32, 32), (64, 64), (16, 16, 16)}
    assert all((c.B, c.T, c.H, c.V, c.dtype, c.phase) == (8, 4096, 8, 64, "bfloat16", "train") for c in cases)
    for case in cases:  # above K = 256 ours alone (fla refuses it, the reference keeps every state)
        want = [IMPL_RT, IMPL_REF, IMPL_FLA] if case.K <= 256 else [IMPL_RT]
        assert case.name in out and case.impl_names() == want
    assert "prefill " not in out and "decode " not in out
    # "all" stays prefill + decode: the train phase runs only when named
    assert not [c for c in bench.plan("all") if c.phase == "train"]


def test_train_work_is_tokens_only():
    case = bench.plan("train", quick=True)[0]
    assert bench.case_work(case) == Work(0.0, 0.0, 8 * 1024)



@pytest.fixture
def fake_fla_train(monkeypatch):
    from rtcompile.bench import train

    guard = types.SimpleNamespace(TRITON_ABOVE_3_7_1=False)
    seen = []
    fla = _fake_fla_module()
    inner = fla.chunk_gated_delta_rule

    def chunk(*args, **kwargs):
        seen.append(guard.TRITON_ABOVE_3_7_1)  # the guard is off while fla runs ...
        return inner(*args, **kwargs)

    fla.chunk_gated_delta_rule = chunk
    monkeypatch.setattr(train, "fla_ops", lambda: fla)
    monkeypatch.setattr(train, "_fla_guard_module", lambda: guard)
    monkeypatch.setattr(measure, "fla_version", lambda: "0.6.0-fake")  # fla_refusal's
    return guard, seen


def test_cpu_train_run_times_forward_and_backward(fake_fla_train, monkeypatch, tmp_path):
    """The real Triton forward + backward (interpreter) through the public API, the reference and
    a fake fla, on a tiny train case; a width the kernels do not tile (12: zero-padded to 16)
    trains too; an order the Triton kernels do not take is a refused row."""
    from rtcompile.kernels import chunk_backward

    guard, seen = fake_fla_train
    calls = []  # launch_backward: both the recomputing op's backward and a kept forward's run it
    real = chunk_backward.launch_backward
    monkeypatch.setattr(chunk_backward, "launch_backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    cases = [Case("t16", "train", (16,), 1, 20, H=1, V=16, impls=(IMPL_RT, IMPL_REF, IMPL_FLA), chunk_size=16),
             Case("t12", "train", (12,), 1, 20, H=1, V=16, impls=(IMPL_RT,), chunk_size=16),
             Case("t5", "train", (2, 2, 2, 2), 1, 20, H=1, V=16, impls=(IMPL_RT,), chunk_size=16)]
    opts = BenchOptions(phase="train", out=tmp_path / "out", repeats=3)
    table = io.StringIO()
    rows = bench.run_bench(opts, device="cpu", cases=cases, measure_ceilings=False, file=table, log=io.StringIO())
    by = {(r.case, r.impl): r for r in rows}
    for impl in (IMPL_RT, IMPL_REF, IMPL_FLA):
        r = by[("t16", impl)]
        assert r.ms and r.fwd_ms and r.tokens_per_s and r.phase == "train", (impl, r.note)
        assert r.note.startswith("fwd ") and r.gbps is None
    assert calls, "the Triton backward never ran"
    assert seen and all(seen) and guard.TRITON_ABOVE_3_7_1 is False  # ... and restored after
    assert "guard switched off for timing only" in by[("t16", IMPL_FLA)].note
    assert by[("t12", IMPL_RT)].ms and by[("t12", IMPL_RT)].fwd_ms, by[("t12", IMPL_RT)].note
    refused = by[("t5", IMPL_RT)]
    assert refused.note.startswith("refused: ") and refused.ms is None, refused.note
    # the reason itself, not the API's preamble ("backend: 'triton' with an input that requires grad ...")
    assert refused.note.startswith("refused: order 5") and "backend:" not in refused.note
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert "forward + backward" in doc["header"]["train_method"]
    assert {"fwd_ms"} <= set(doc["rows"][0])
