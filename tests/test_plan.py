"""Targets, the cost model and the planner (CPU: cost model only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rtcompile
import rtcompile.functional
from rtcompile.cli import main
from rtcompile.costmodel import (
    CHUNK_CALL_S,
    Calibration,
    chunk_cost,
    recurrent_cost,
    shape_of,
)
from rtcompile.kernels import tuned
from rtcompile.kernels.chunk_resident import ResidentConfig
from rtcompile.kernels.chunk_split import SplitConfig
from rtcompile.kernels.forms import FORMS, config_from_dict
from rtcompile.kernels.recurrent import RecurrentConfig
from rtcompile.plan import PLAN_FORMAT, Plan, PlanError, crossover, make_plan
from rtcompile.spec import ModelSpec, load_spec
from rtcompile.target import PROFILES, TargetError, get_target

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.*"))


def _spec(widths=(16, 16), **kw):
    return ModelSpec(order=len(widths) + 1, key_widths=widths, value_width=64, heads=8, model_width=512, layers=2, **kw)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
@pytest.mark.parametrize("target", sorted(PROFILES))
def test_every_example_plans_on_every_target(path, target):
    plan = make_plan(load_spec(path), get_target(target))
    phases = {d.phase for d in plan.decisions}
    assert phases == {"prefill", "decode", "train"}
    spec, t = load_spec(path), get_target(target)
    for d in plan.decisions:
        assert d.cost["seconds"] > 0 and len(d.alternatives) >= 2 and d.reason
        assert d.mode in ("chunk", "recurrent")
        assert config_from_dict(d.variant, d.mode).to_dict() == d.variant
        for a in d.alternatives:  # every alternative costed is one the kernels accept here
            assert a["variant"]["form"] in FORMS
            assert config_from_dict(a["variant"], a["mode"]).check(shape_of(spec), t.smem_per_sm) is None, a


def test_profiles_name_their_sources_and_unknown_targets_list_the_known():
    assert all(t.source and t.memory_bytes > 0 and t.hbm_bytes_per_s > 0 for t in PROFILES.values())
    with pytest.raises(TargetError, match="allowed: auto, h100-sxm, h200"):
        get_target("h300")


def test_memory_refusal_names_the_numbers():
    with pytest.raises(PlanError, match=r"does not fit l4 \(24 GB\) at batch 100000.*state .* GB"):
        make_plan(_spec((64, 64)), get_target("l4"), batches=(100000,), seq_lens=(16,), decode_batches=(1,))


def test_decisions_move_in_the_expected_directions():
    h200 = get_target("h200")
    small, wide = _spec((16, 16)), _spec((64, 64))
    plan = make_plan(small, h200, seq_lens=(1, 4, 4096, 65536))
    by = {(d.phase, d.batch, d.seq_len): d for d in plan.decisions}
    assert all(d.mode == "recurrent" for d in plan.decisions if d.phase == "decode")  # decode: always recurrent
    assert by[("prefill", 8, 4096)].mode == "chunk" and by[("prefill", 8, 65536)].mode == "chunk"
    assert by[("prefill", 1, 1)].mode == "recurrent"  # one token: the scan
    # the crossover is searched, and it moves with width and with order
    c_small, c_wide = crossover(small, h200, 8), crossover(wide, h200, 8)
    c_o4 = crossover(_spec((16, 16, 16)), h200, 8)
    assert c_small is not None and c_wide is not None and c_wide != c_small and c_o4 != c_small
    # cost grows with T and with B; decode cost with the state size
    cv = ResidentConfig(chunk_size=32, block_v=16)
    assert chunk_cost(small, h200, 8, 8192, cv).seconds > chunk_cost(small, h200, 8, 1024, cv).seconds
    r16 = RecurrentConfig(block_k=256, block_v=32, num_warps=4)
    assert recurrent_cost(small, h200, 256, 1, r16).seconds > recurrent_cost(small, h200, 32, 1, r16).seconds
    wide_rec = RecurrentConfig(block_k=1024, block_v=16, num_warps=8)
    assert recurrent_cost(wide, h200, 32, 1, wide_rec).seconds > recurrent_cost(small, h200, 32, 1, r16).seconds


def test_slower_gpu_is_slower():
    s = _spec()
    fast = make_plan(s, get_target("h200"), batches=(8,), seq_lens=(4096,), decode_batches=(256,))
    slow = make_plan(s, get_target("l4"), batches=(8,), seq_lens=(4096,), decode_batches=(256,))
    dec = lambda p: next(d for d in p.decisions if d.phase == "decode").cost["seconds"]
    assert dec(slow) > 3 * dec(fast)  # 300 GB/s against 4.8 TB/s


def test_plan_file_round_trip_and_newer_format_refused(tmp_path):
    plan = make_plan(_spec(), get_target("h200"), batches=(1,), seq_lens=(64, 4096), decode_batches=(32,))
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again.to_dict() == json.loads(path.read_text()) == plan.to_dict()
    data = plan.to_dict()
    data["format"] = PLAN_FORMAT + 1
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="newer than this rtcompile reads"):
        Plan.load(path)
    path.write_text("{}")
    with pytest.raises(PlanError, match="not a plan file"):
        Plan.load(path)


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["decisions"][0]["cost"].update(seconds="fast"),
     "plan.decisions[0].cost.seconds: got str 'fast'; allowed: a finite number >= 0"),
    (lambda d: d["decisions"][0]["cost"].pop("bound"), "plan.decisions[0].cost.bound"),
    (lambda d: d["decisions"][0]["alternatives"][0].update(mode="scan"),
     "plan.decisions[0].alternatives[0].mode: got 'scan'; allowed: chunk, recurrent"),
    (lambda d: d["decisions"][0]["alternatives"][0].update(variant={"form": "split", "chunk_size": "64"}),
     "plan.decisions[0].alternatives[0].variant:"),
    (lambda d: d["decisions"][0]["alternatives"][0]["cost"].update(seconds=float("nan")),
     "plan.decisions[0].alternatives[0].cost.seconds"),
    (lambda d: d["decisions"][0]["alternatives"][0].update(state_dtype="int8"),
     "plan.decisions[0].alternatives[0].state_dtype: got 'int8'"),
    (lambda d: d["crossover"].update({"batch 8": 64}), "plan.crossover: key 'batch 8'; allowed: a batch bucket"),
], ids=["cost-seconds", "cost-bound", "alt-mode", "alt-variant", "alt-nan", "alt-dtype", "crossover-key"])
def test_plan_alternatives_costs_and_crossover_are_checked_on_load(edit, needle):
    """What `rtcompile plan` prints of a loaded plan (every alternative's mode, form, state type
    and seconds; each cost's bound and source; the crossover's buckets) is checked when it is
    read: a bad value was a KeyError or a format error in the table, after the load succeeded."""
    data = json.loads(json.dumps(make_plan(_spec(), get_target("h200"), batches=(1,), seq_lens=(64,),
                                           decode_batches=(32,)).to_dict()))
    Plan.from_dict(json.loads(json.dumps(data)))  # as made: read back
    edit(data)
    with pytest.raises(PlanError) as err:
        Plan.from_dict(data)
    assert needle in str(err.value)


def _old_format(plan_dict: dict) -> dict:
    """``plan_dict`` as rtcompile 0.1 wrote it: format 1, variants without a "form" tag."""
    old = json.loads(json.dumps(plan_dict))
    old["format"] = 1
    for d in old["decisions"]:
        for v in [d["variant"]] + [a["variant"] for a in d["alternatives"]]:
            v["kernel"] = "recurrent" if "outer_phi" in v else "chunk"
            v.pop("form")
    return old


def test_plan_of_the_previous_format_is_refused_naming_it(tmp_path):
    from rtcompile.export import BundleError, export_bundle, load_bundle
    from rtcompile.model import RunningTensorLM

    assert PLAN_FORMAT == 2
    spec = ModelSpec(order=3, key_widths=(2, 4), value_width=5, heads=2, model_width=12, layers=1)
    plan = make_plan(spec, get_target("h200"), batches=(1,), seq_lens=(64,), decode_batches=(1,))
    path = tmp_path / "old.json"
    path.write_text(json.dumps(_old_format(plan.to_dict())))
    with pytest.raises(PlanError, match=r"format 1 is rtcompile 0\.1's .*'form'.*re-run `rtcompile plan`"):
        Plan.load(path)
    # a bundle holding one is refused through the same loader, naming the file
    bundle = export_bundle(RunningTensorLM(spec, vocab_size=7), tmp_path / "b", plan=plan, onnx=False)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["plan"] = _old_format(manifest["plan"])
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"bundle .*manifest\.json: plan: format 1 is rtcompile 0\.1's"):
        load_bundle(bundle)


def test_measurements_calibrate_and_override(tmp_path, monkeypatch):
    spec = _spec()
    h200 = get_target("h200")
    v = ResidentConfig(chunk_size=32, block_v=16)
    modelled = chunk_cost(spec, h200, 8, 4096, v)
    predicted = modelled.kernel_s  # a tuned entry's seconds are device time (CUDA-graph replays)
    table = tmp_path / "tuned.json"
    entry = {**tuned.match_fields("chunk", spec.key_widths, 64, 8, spec.input_dtype, "NVIDIA H200"),
             "batch": 8, "seq_len": 4096, "variant": v.to_dict(), "seconds": 2 * predicted}
    table.write_text(json.dumps({"format": tuned.FORMAT_VERSION, "entries": [entry]}))
    monkeypatch.setenv("RTCOMPILE_TUNED", str(table))
    tuned.reload()
    try:
        plan = make_plan(spec, h200, batches=(8,), seq_lens=(1024, 4096), decode_batches=(32,))
    finally:
        monkeypatch.delenv("RTCOMPILE_TUNED")
        tuned.reload()
    d = next(d for d in plan.decisions if d.phase == "prefill" and d.seq_len == 4096)
    (measured,) = [a["cost"] for a in d.alternatives if a["cost"]["source"] == "measured (tuned)"]
    # the measured option is that device time plus the call's modelled host overhead, as its rivals
    assert measured["seconds"] == pytest.approx(2 * predicted + modelled.host_s, rel=1e-9)
    assert measured["seconds"] - measured["host_s"] == pytest.approx(2 * predicted, rel=1e-9)
    # device time calibrates the kernels' scale alone, the host overhead kept at the model's; the
    # calibrated model's device time then reproduces the measurement
    cal = Calibration(**{k: v for k, v in plan.calibration.items()})
    assert cal.fits.startswith("chunk: device-time scale (1 point)") and cal.chunk_call_s == CHUNK_CALL_S
    assert cal.chunk == pytest.approx(2.0, rel=1e-6)
    assert chunk_cost(spec, h200, 8, 4096, v, cal).kernel_s == pytest.approx(2 * predicted, rel=1e-6)
    assert cal.recurrent == cal.decode == 1.0


def test_running_tensor_follows_a_plan(monkeypatch):
    spec = ModelSpec(order=3, key_widths=(2, 4), value_width=8, heads=1, model_width=16)
    plan = make_plan(spec, get_target("h200"), batches=(1,), seq_lens=(1, 4096), decode_batches=(1,))
    short = plan.decision_for("prefill", 1, 1)
    long_ = plan.decision_for("prefill", 1, 3000)
    assert short.mode == "recurrent" and long_.mode == "chunk"
    modes = []
    monkeypatch.setattr(rtcompile.functional, "running_tensor_recurrent_ref",
                        lambda *a, **kw: modes.append("recurrent") or (a[2], None))
    monkeypatch.setattr(rtcompile.functional, "running_tensor_chunk_ref",
                        lambda *a, **kw: modes.append("chunk") or (a[2], None))
    for T in (1, 3000):
        q = [torch.randn(1, T, 1, w, dtype=torch.float64) for w in (2, 4)]
        rtcompile.running_tensor(q, q, torch.randn(1, T, 1, 8, dtype=torch.float64), plan=plan, backend="reference")
    assert modes == ["recurrent", "chunk"]


def test_cli_plan_and_build(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec = str(ROOT / "examples" / "order3_16x16.toml")
    out = tmp_path / "p.json"
    assert main(["plan", spec, "--target", "a100-80gb", "--out", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["target"]["name"] == "a100-80gb" and Plan.load(out).to_dict() == data
    assert main(["plan", spec, "--target", "nope"]) == 2
    assert "allowed: auto" in capsys.readouterr().err
    built = tmp_path / "built.json"
    assert main(["build", spec, "--out", str(built)]) == 0
    text = capsys.readouterr().out
    assert text.count("-> ok") == 3 and Plan.load(built).target["name"] == "h200"


def test_build_tunes_under_the_stop_handler_and_a_sigterm_is_one_line(tmp_path, capsys, monkeypatch):
    """build on a GPU tunes as `rtcompile tune` does: a SIGTERM stops it through the stop
    handler (its workers and trial processes end with it; exit 130, one line). Before, Python's
    default ended the build at once and its workers tuned on to their deadline. The GPU is
    faked: the stand-in tune sends the SIGTERM only under the handler (else it fails)."""
    import os
    import signal

    import rtcompile.plan_cmd as plan_cmd
    import rtcompile.target
    import rtcompile.tuning
    from rtcompile.target import get_target
    from rtcompile.tuning import processes

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(plan_cmd, "_on_gpu", lambda: True)
    monkeypatch.setattr(rtcompile.target, "measure", lambda: get_target("h200"))
    monkeypatch.setattr(rtcompile.target, "detect", lambda: get_target("h200"))  # the GPU --target names

    def tune(bucket, opts):
        assert signal.getsignal(signal.SIGTERM) is processes._interrupt, "build tuned without the stop handler"
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between bytecodes
            pass
        raise AssertionError("the SIGTERM did not stop the tune")

    monkeypatch.setattr(rtcompile.tuning, "tune_bucket", tune)
    before = signal.getsignal(signal.SIGTERM)
    spec = str(ROOT / "examples" / "order2_matrix.toml")
    assert main(["build", spec, "--target", "h200", "--out", str(tmp_path / "p.json")]) == 130
    assert capsys.readouterr().err.strip() == "rtcompile: interrupted"
    assert signal.getsignal(signal.SIGTERM) is before and not (tmp_path / "p.json").exists()


def test_cli_out_is_checked_before_any_work(tmp_path, capsys, monkeypatch):
    """plan / build --out FILE: a folder, or a folder that cannot be made, is one usage line (exit
    2) before planning, tuning or kernel checks start; a missing folder is made, as the other
    commands' --out folders are. build's --storage in a missing folder is refused up front too."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec = str(ROOT / "examples" / "order2_matrix.toml")
    import rtcompile.plan_cmd as plan_cmd

    started = []
    monkeypatch.setattr(plan_cmd, "_make", lambda *a, **k: started.append(a) or (_ for _ in ()).throw(AssertionError))
    blocker = tmp_path / "file"
    blocker.write_text("")
    for argv in (["plan", spec, "--out", str(tmp_path)], ["build", spec, "--out", str(tmp_path)],
                 ["plan", spec, "--out", str(blocker / "x" / "p.json")],
                 ["build", spec, "--storage", f"sqlite:///{tmp_path / 'no' / 's.db'}"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and ("--out" in err[0] or "storage" in err[0]), err
    assert not started
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = tmp_path / "new" / "deeper" / "p.json"
    assert main(["plan", spec, "--target", "h200", "--out", str(out), "--json"]) == 0
    assert Plan.load(out).target["name"] == "h200"


def test_plan_variant_that_cannot_run_here_falls_back(monkeypatch):
    """An H200 plan may name a config over this device's shared memory: the call still runs."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton path through the interpreter")
    spec = ModelSpec(order=3, key_widths=(16, 16), value_width=16, heads=1, model_width=16)
    plan = make_plan(spec, get_target("h200"), batches=(1,), seq_lens=(64,), decode_batches=(1,))
    d = plan.decision_for("prefill", 1, 64)
    big = ResidentConfig(chunk_size=64, block_v=16, num_warps=8, num_stages=3)  # over the portable 99 KiB
    assert "shared memory" in big.check(shape_of(spec)) and big.check(shape_of(spec), 1 << 30) is None
    d.mode, d.variant = "chunk", big.to_dict()
    q = [torch.randn(1, 64, 1, 16) for _ in range(2)]
    o, _ = rtcompile.running_tensor(q, q, torch.randn(1, 64, 1, 16), plan=plan, backend="triton")
    assert o.shape == (1, 64, 1, 16) and torch.isfinite(o).all()


def test_tight_memory_picks_the_two_kernel_form_before_the_fused_one():
    """At K = 256 the split default needs ~9x the two-kernel workspace: where only the
    two-kernel one fits beside the state, the planner takes it, not the 3x slower fused form."""
    import dataclasses

    from rtcompile.costmodel import workload
    from rtcompile.kernels.forms import low_memory, two_kernel
    from rtcompile.plan_options import memory_figures

    spec, h200 = _spec((16, 16)), get_target("h200")
    plan = make_plan(spec, h200, batches=(8,), seq_lens=(4096,), decode_batches=(1,))
    prefill = next(d for d in plan.decisions if d.phase == "prefill")
    configs = [config_from_dict(a["variant"]) for a in prefill.alternatives if a["mode"] == "chunk"]
    three, two, fused = configs[:3]
    assert isinstance(three, SplitConfig) and two == two_kernel(shape_of(spec), h200.smem_per_sm)
    assert fused == low_memory(shape_of(spec), h200.smem_per_sm) and fused.form == "fused"
    assert prefill.variant["form"] == "split"  # all fit on a 141 GB H200
    fixed = sum(memory_figures(spec, 8, 4096, 0).values())
    work = workload(spec, 8, 4096)
    assert three.workspace_bytes(work) > 8 * two.workspace_bytes(work)
    room = (two.workspace_bytes(work) + three.workspace_bytes(work)) // 2
    tight = dataclasses.replace(h200, memory_bytes=fixed + room)
    plan = make_plan(spec, tight, batches=(8,), seq_lens=(4096,), decode_batches=(1,))
    prefill = next(d for d in plan.decisions if d.phase == "prefill")
    chosen = config_from_dict(prefill.variant)
    assert prefill.mode == "chunk" and chosen == two, prefill.reason
    assert "refused for workspace" in prefill.reason


def test_plan_names_the_gluon_loop_by_its_target_not_by_this_machine():
    """A plan for an sm_90 profile proposes the split form's Gluon state loop wherever it is made
    (16-bit inputs, d_v 64); one for another GPU never does."""
    from rtcompile.kernels import chunk_split_gluon

    def prefill(target):
        plan = make_plan(_spec((64,)), get_target(target), batches=(8,), seq_lens=(4096,), decode_batches=(32,))
        return next(d for d in plan.decisions if d.phase == "prefill")

    assert get_target("h200").wgmma and not get_target("a100-80gb").wgmma
    h200 = prefill("h200")
    assert h200.mode == "chunk" and h200.variant.get("loop") == ("gluon" if chunk_split_gluon.gluon else "triton")
    a100 = prefill("a100-80gb")
    assert a100.variant.get("loop", "triton") == "triton"
    assert all(a["variant"].get("loop", "triton") == "triton" for a in a100.alternatives)
