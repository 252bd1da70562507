"""The train bucket (kernel "chunk_bwd"): backward configs tuned with forward + backward timed
together, every gradient checked against float64 autograd; the winner read back by
``running_tensor_bwd``; the planner's train phase from the measurement. Interpreter, tiny shapes."""

from __future__ import annotations


from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from rtcompile.cli import main
from rtcompile.kernels import tuned
from rtcompile.kernels.chunk_backward import BackwardConfig, default_backward, resolve_backward
from rtcompile.kernels.config import KernelShape
from rtcompile.kernels.inputs import check_inputs, random_inputs
from rtcompile.plan import Plan, make_plan
from rtcompile.spec import ModelSpec
from rtcompile.target import get_target
from rtcompile.tuning import Bucket, TuneOptions, refusal, search_space, tune_bucket
from rtcompile.tuning.objective import evaluate
from rtcompile.tuning.space import config_params
from rtcompile.tuning.store import write_tuned

from conftest import interpreter_only

TRAIN = Bucket("chunk_bwd", (16,), 16, 1, 1, 40, "float32")  # T 40 -> bucket 64
SHAPE = KernelShape(TRAIN.key_widths, TRAIN.value_width, 4)


# the objective's trials run on its request's device, the CPU unless told: interpreter_only


@pytest.fixture(autouse=True)
def isolated(tuning_cache):
    """A private cache for every test (conftest's ``tuning_cache``)."""


def _problem(bucket: Bucket = TRAIN):
    q, k, v, g, beta, _ = random_inputs(bucket.batch, bucket.seq_len, bucket.heads, bucket.key_widths,
                                        bucket.value_width, bucket.dtype, "cpu", 0)
    return check_inputs(q, k, v, g, beta, None, None, None)


@interpreter_only
def test_a_train_study_rejects_a_wrong_gradient_and_its_winner_serves_the_backward(tmp_path):
    """An exhaustive sweep over chunk sizes 16/32/64 (every other field fixed at the default):
    C 16 gives a wrong dk[0] and is fastest, C 64 (the default) is slow, C 32 is right and fast."""
    url = f"sqlite:///{tmp_path / 'train.db'}"
    default = default_backward(SHAPE)
    assert default.chunk_size == 64  # else the planted speeds below do not make C 32 the winner
    fixed = {k: v for k, v in config_params(default).items() if k not in ("form", "backward.chunk_size")}
    r = tune_bucket(TRAIN, TuneOptions(storage=url, trials=None, exhaustive=True, repeats=2, top_k=3,
                                       impl="tuning_impls:planted_wrong_backward", fixed=fixed))
    import optuna

    study = optuna.load_study(study_name=r.study, storage=url)
    by_c = {t.params["backward.chunk_size"]: t for t in study.get_trials(deepcopy=False)}
    assert sorted(by_c) == [16, 32, 64]
    assert by_c[16].user_attrs["status"] == "rejected", "the planted wrong gradient was accepted"
    assert by_c[16].user_attrs["reason"].startswith("dk0: relative RMS error")
    assert by_c[32].user_attrs["status"] == by_c[64].user_attrs["status"] == "ok"
    winner = replace(default, chunk_size=32)
    assert r.best_variant == winner.to_dict() and r.default_seconds > r.best_seconds
    (entry,) = tuned.entries()
    assert entry["kernel"] == "chunk_bwd" and entry["variant"] == winner.to_dict()
    assert entry["source"] == tuned.source_hash("chunk_bwd") != tuned.source_hash("chunk")
    # the backward with no variant runs the tuned one; with a chunk size it keeps the default's rule
    p = _problem()
    assert resolve_backward(SHAPE, None, None, torch.device("cpu"), p) == winner
    assert resolve_backward(SHAPE, None, 16, torch.device("cpu"), p) == replace(default, chunk_size=16)


@interpreter_only
def test_a_short_tpe_train_study_runs_the_real_backward_end_to_end(tmp_path):
    url = f"sqlite:///{tmp_path / 'tpe.db'}"
    r = tune_bucket(TRAIN, TuneOptions(storage=url, trials=2, repeats=2, top_k=1))
    assert r.trials_run == 2 and r.counts.get("ok", 0) >= 1, r.counts
    assert r.default_seconds and r.best_seconds
    (entry,) = tuned.entries()
    assert entry["variant"] == r.best_variant
    best = BackwardConfig.from_dict(r.best_variant)
    assert resolve_backward(SHAPE, None, None, torch.device("cpu"), _problem()) == best


@interpreter_only
def test_the_objective_rejects_wrong_or_missing_gradients_and_passes_the_real_ones():
    request = {"bucket": asdict(TRAIN), "variant": default_backward(SHAPE).to_dict(), "repeats": 1}
    ok = evaluate(request)
    assert ok["status"] == "ok" and ok["error"] < 1e-4, ok
    missing = evaluate({**request, "impl": "tuning_impls:missing_gradient"})
    assert missing["status"] == "rejected" and missing["reason"].startswith("dbeta:"), missing
    wrong = evaluate({**request, "variant": replace(default_backward(SHAPE), chunk_size=16).to_dict(),
                      "impl": "tuning_impls:planted_wrong_backward"})
    assert wrong["status"] == "rejected" and wrong["reason"].startswith("dk0:"), wrong
    # a trial with keep_forward times (and checks) the forward it keeps, then the backward from it
    kept = evaluate({**request, "variant": replace(default_backward(SHAPE), keep_forward=True).to_dict()})
    assert kept["status"] == "ok" and kept["error"] < 1e-4, kept


def test_an_unreadable_or_unrunnable_tuned_backward_is_ignored():
    base = {**tuned.match_fields("chunk_bwd", TRAIN.key_widths, 16, 1, "float32", "cpu-interpreter"),
            "batch": 1, "seq_len": 64, "seconds": 1.0}
    p, cpu = _problem(), torch.device("cpu")
    for bad in ({"form": "backward", "chunk_size": 48, "block_v": 16},  # fails its check
                {"form": "resident", "chunk_size": 32, "block_v": 16},  # another kernel's config
                {"kernel": "chunk", "chunk_size": 32}):  # rtcompile 0.1's format
        write_tuned([{**base, "variant": bad}])
        assert resolve_backward(SHAPE, None, None, cpu, p) == default_backward(SHAPE), bad


def test_unsupported_train_buckets_are_refused_before_the_store_is_touched(tmp_path):
    odd = Bucket("chunk_bwd", (12,), 16, 1, 1, 32, "float32")
    why = refusal(odd)
    assert why and "power-of-two key widths >= 16" in why
    url = f"sqlite:///{tmp_path / 'never.db'}"
    with pytest.raises(ValueError, match="power-of-two key widths"):
        tune_bucket(odd, TuneOptions(storage=url, trials=1))
    assert not (tmp_path / "never.db").exists()
    # above K = 256 the space holds the streamed state loops only
    wide = search_space(Bucket("chunk_bwd", (64, 64), 16, 1, 1, 32, "float32"), TuneOptions())
    assert wide["backward"]["state_loop"] == ["streamed"], wide


def _spec_file(tmp_path, widths) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(f'order = {len(widths) + 1}\nkey_widths = {list(widths)}\nvalue_width = 16\nheads = 1\n'
                    'model_width = 16\nlayers = 1\ninput_dtype = "float32"\n')
    return path


def test_cli_phase_train_errors(tmp_path, capsys):
    assert main(["tune", str(_spec_file(tmp_path, (16,))), "--phase", "training"]) == 2
    assert main(["tune", str(_spec_file(tmp_path, (16,))), "--phase", "train", "--fix", "resident.chunk_size=32"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    lines = [ln for ln in lines if "no CUDA GPU" not in ln and "CPU timings" not in ln]
    assert len(lines) == 2 and all(ln.startswith("rtcompile") for ln in lines), lines
    assert "train" in lines[0] and "backward" in lines[1]
    assert not (tmp_path / "cache" / "tuning.db").exists()


@pytest.mark.parametrize("widths, tuned", [((12,), (16,)), ((3, 5), (16,)), ((24, 8), (256,)), ((24, 24), (32, 32)),
                                           ((16, 16), (16, 16))], ids=str)
def test_train_buckets_take_the_rewritten_widths(widths, tuned):
    """The train bucket of widths the kernels do not tile is the shape the backward runs them as
    (materialised keys padded, or padded factors): where a training call looks its config up."""
    from rtcompile.cli_args import tuning_buckets
    from rtcompile.spec import ModelSpec

    spec = ModelSpec(order=len(widths) + 1, key_widths=widths, value_width=16, heads=1, model_width=16, layers=1)
    (bucket,) = tuning_buckets(spec, "train", None, None, None, on_gpu=False)
    assert bucket.kernel == "chunk_bwd" and bucket.key_widths == tuned and refusal(bucket) is None


def _train_entry(spec: ModelSpec, config: BackwardConfig, seconds: float, B=8, T=4096) -> dict:
    return {**tuned.match_fields("chunk_bwd", spec.key_widths, spec.value_width, spec.heads, spec.input_dtype,
                                 "NVIDIA H200"), "batch": B, "seq_len": T, "variant": config.to_dict(), "seconds": seconds}


def test_the_train_decision_uses_measured_forward_plus_backward(tmp_path):
    spec = ModelSpec(order=3, key_widths=(16, 16), value_width=64, heads=8, model_width=512, layers=2)
    h200 = get_target("h200")
    shape = KernelShape(spec.key_widths, spec.value_width, 2)
    plain = make_plan(spec, h200, batches=(8,), seq_lens=(4096,), decode_batches=(32,))
    (before,) = [d for d in plain.decisions if d.phase == "train"]
    assert "modelled" in before.reason and before.cost["source"] != "measured (tuned)"
    assert before.backward == default_backward(shape, h200.smem_per_sm).to_dict()
    tuned_cfg = BackwardConfig(chunk_size=16, block_v=32, num_warps=8)
    measured = before.alternatives[0]["cost"]["seconds"] / 2  # the chunk form's modelled cost, halved
    write_tuned([_train_entry(spec, tuned_cfg, measured)])
    plan = make_plan(spec, h200, batches=(8,), seq_lens=(4096,), decode_batches=(32,))
    (after,) = [d for d in plan.decisions if d.phase == "train"]
    # the tuned seconds are device time (graph replays): the decision adds the call's host overhead
    assert after.cost["source"] == "measured (tuned)"
    assert after.cost["seconds"] - after.cost["host_s"] == pytest.approx(measured)
    assert "measured" in after.reason and "B8 T4096" in after.reason and "scaled" not in after.reason
    assert after.backward == tuned_cfg.to_dict()
    assert after.alternatives[0]["backward"] == tuned_cfg.to_dict()
    # the train measurement does not calibrate the forward model (prefill decisions unchanged)
    assert [d.cost for d in plan.decisions if d.phase == "prefill"] == \
           [d.cost for d in plain.decisions if d.phase == "prefill"]
    # another bucket: the nearest measurement, scaled by the model, and labelled so (it was
    # "measured (tuned)" though nothing measured this bucket)
    far = make_plan(spec, h200, batches=(8,), seq_lens=(16384,), decode_batches=(32,))
    (scaled,) = [d for d in far.decisions if d.phase == "train"]
    assert scaled.cost["source"] == "scaled from measured (tuned train bucket B8 T4096) by the model"
    assert "scaled" in scaled.reason
    assert scaled.cost["seconds"] > measured
    # the plan pins the backward and reads back
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json").decision_for("train", 8, 4096).backward == tuned_cfg.to_dict()


def test_a_train_decision_at_widths_the_kernels_do_not_tile_says_how_it_trains(tmp_path):
    """24x24 trains as 32x32: the pinned backward config is that shape's default, or the tuned
    train entry filed under 32x32 (where the tuner files it and the backward looks it up), and
    the reason says so, not that training leaves the kernels."""
    spec = ModelSpec(order=3, key_widths=(24, 24), value_width=64, heads=8, model_width=512, layers=2)
    h200 = get_target("h200")
    wide = KernelShape((32, 32), 64, 2)
    plain = make_plan(spec, h200, batches=(8,), seq_lens=(4096,), decode_batches=(32,))
    (before,) = [d for d in plain.decisions if d.phase == "train"]
    assert before.backward == default_backward(wide, h200.smem_per_sm).to_dict()
    assert "as 32x32" in before.reason and "reference" not in before.reason and "modelled" in before.reason
    tuned_cfg = replace(default_backward(wide), grads_warps=4)
    measured = before.alternatives[0]["cost"]["seconds"] / 2
    write_tuned([_train_entry(replace(spec, key_widths=(32, 32)), tuned_cfg, measured)])
    plan = make_plan(spec, h200, batches=(8,), seq_lens=(4096,), decode_batches=(32,))
    (after,) = [d for d in plan.decisions if d.phase == "train"]
    assert after.backward == tuned_cfg.to_dict() and after.cost["source"] == "measured (tuned)", after.reason


def test_a_train_decision_above_k256_takes_the_streamed_backward():
    spec = ModelSpec(order=3, key_widths=(64, 64), value_width=64, heads=8, model_width=512, layers=2)
    plan = make_plan(spec, get_target("h200"), batches=(1,), seq_lens=(1024,), decode_batches=(1,))
    (d,) = [d for d in plan.decisions if d.phase == "train"]
    assert d.backward is not None and d.backward["state_loop"] == "streamed", d
