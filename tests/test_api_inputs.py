"""Bad input to the Python API (plans, the model, make_plan, generate, export) is refused before
any work with a TypeError (wrong type) or a ValueError naming the field and what is allowed;
one plan validator serves Plan.load, Plan.from_dict, export and the bundle loader."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest
import torch

import rtcompile
import rtcompile.fields
import rtcompile.generate
import rtcompile.model
import rtcompile.plan
from rtcompile.cli import main
from rtcompile.export import BundleError, export_bundle, load_bundle
from rtcompile.model import RunningTensorLM
from rtcompile.plan import Plan, PlanError, make_plan
from rtcompile.spec import Features, ModelSpec
from rtcompile.target import get_target

VOCAB = 11
SPEC = ModelSpec(order=3, key_widths=(2, 4), value_width=5, heads=2, model_width=12, layers=2)
SPEC_TOML = 'order = 3\nkey_widths = [2, 4]\nvalue_width = 5\nheads = 2\nmodel_width = 12\nlayers = 2\n'


@pytest.fixture(scope="module")
def plan_dict():
    plan = make_plan(SPEC, get_target("h200"), batches=(1,), seq_lens=(16,), decode_batches=(1,),
                     use_measurements=False)
    return plan.to_dict()


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return RunningTensorLM(SPEC, vocab_size=VOCAB).eval()


def _set(path: str, value):
    """An edit of a plan dict: ``value`` at ``path`` ("decisions.0.batch"); a value of DELETE removes it."""
    def edit(d):
        *parents, last = path.split(".")
        for p in parents:
            d = d[int(p)] if isinstance(d, list) else d[p]
        if value is DELETE:
            del d[last]
        else:
            d[int(last) if isinstance(d, list) else last] = value
    return edit


DELETE = object()

# (edit of a valid plan's dict, the pattern its PlanError must match: the field's path and what is allowed)
BAD_PLANS = [
    pytest.param(_set("decisions.0.mode", "bogus"), r"plan\.decisions\[0\]\.mode: got 'bogus'; allowed: chunk, recurrent",
                 id="mode-bogus"),
    pytest.param(_set("decisions.0.batch", 0), r"plan\.decisions\[0\]\.batch: got 0; allowed: an integer >= 1",
                 id="batch-0"),
    pytest.param(_set("decisions.0.batch", -4), r"plan\.decisions\[0\]\.batch: got -4; allowed: an integer >= 1",
                 id="batch-negative"),
    pytest.param(_set("decisions.0.batch", "abc"), r"plan\.decisions\[0\]\.batch: got str 'abc'; allowed: an integer",
                 id="batch-string"),
    pytest.param(_set("decisions.0.batch", 1.5), r"plan\.decisions\[0\]\.batch: got float 1\.5; allowed: an integer",
                 id="batch-float"),
    pytest.param(_set("decisions.0.batch", float("nan")), r"plan\.decisions\[0\]\.batch: got float nan",
                 id="batch-nan"),
    pytest.param(_set("decisions.0.batch", True), r"plan\.decisions\[0\]\.batch: got bool True", id="batch-bool"),
    pytest.param(_set("decisions.0.seq_len", 0), r"plan\.decisions\[0\]\.seq_len: got 0; allowed: an integer >= 1",
                 id="seq_len-0"),
    pytest.param(_set("decisions.0.variant.form", "bogus"), r"plan\.decisions\[0\]\.variant: config: form 'bogus'; "
                 r"allowed: ", id="form-bogus"),
    pytest.param(_set("decisions.0.variant", None), r"plan\.decisions\[0\]\.variant: config: expected a dict",
                 id="variant-null"),
    pytest.param(_set("decisions.0.variant.num_warps", "four"), r"plan\.decisions\[0\]\.variant: \w+Config\.num_warps: "
                 r"expected int, got str 'four'", id="num_warps-string"),
    pytest.param(_set("decisions.0.state_dtype", "int8"), r"plan\.decisions\[0\]\.state_dtype: got 'int8'; allowed: "
                 r"float32, float16, bfloat16", id="state_dtype-int8"),
    pytest.param(_set("decisions.0.phase", "bogus"), r"plan\.decisions\[0\]\.phase: got 'bogus'; allowed: prefill, "
                 r"decode, train", id="phase-bogus"),
    pytest.param(_set("decisions.0.backward", "x"), r"plan\.decisions\[0\]\.backward: config: expected a dict",
                 id="backward-string"),
    pytest.param(_set("decisions.0.cost", None), r"plan\.decisions\[0\]\.cost: got null; allowed: an object",
                 id="cost-null"),
    pytest.param(_set("decisions.0.alternatives", "x"), r"plan\.decisions\[0\]\.alternatives: got str 'x'",
                 id="alternatives-string"),
    pytest.param(_set("decisions.0.extra", 1), r"plan\.decisions\[0\]: unknown keys \['extra'\]; allowed: phase",
                 id="decision-unknown-key"),
    pytest.param(_set("decisions.0.mode", DELETE), r"plan\.decisions\[0\]: missing keys \['mode'\]",
                 id="decision-missing-mode"),
    pytest.param(_set("decisions.0", "x"), r"plan\.decisions\[0\]: got str 'x'; allowed: an object", id="decision-string"),
    pytest.param(_set("target", "x"), r"plan\.target: got str 'x'; allowed: an object", id="target-string"),
    pytest.param(_set("target.name", None), r"plan\.target\.name: got null; allowed: a non-empty string",
                 id="target-name-null"),
    pytest.param(_set("spec", "x"), r"plan\.spec: got str 'x'; allowed: an object", id="spec-string"),
    pytest.param(_set("spec.order", 9), r"plan\.spec\.order: got 9; allowed: an integer in \[2, 6\]", id="spec-order-9"),
    pytest.param(_set("crossover", None), r"plan\.crossover: got null; allowed: an object", id="crossover-null"),
    pytest.param(_set("crossover.B1", 0), r"plan\.crossover\['B1'\]: got 0; allowed: an integer >= 1",
                 id="crossover-0"),
    pytest.param(_set("crossover.B1", "x" * 200),  # the value cut at 80 characters
                 r"plan\.crossover\['B1'\]: got str 'x{76}\.\.\.; allowed: an integer >= 1$", id="crossover-long"),
    pytest.param(_set("decisions", {}), r"plan\.decisions: got dict \{\}; allowed: a list", id="decisions-dict"),
    pytest.param(_set("bogus", 1), r"plan: unknown keys \['bogus'\]; allowed: spec, target", id="plan-unknown-key"),
    pytest.param(_set("memory", DELETE), r"plan: missing keys \['memory'\]", id="plan-missing-memory"),
    pytest.param(_set("versions", {"torch": 2}), r"plan\.versions: got dict", id="versions-not-strings"),
]

# plans without a decision for a phase the model runs (prefill: its forward, decode: its step)
MISSING_PHASE = [
    pytest.param("prefill", id="no-prefill"),
    pytest.param("decode", id="no-decode"),
]


def _edited(plan_dict, edit):
    data = copy.deepcopy(plan_dict)
    edit(data)
    return data


def _without(plan_dict, phase):
    data = copy.deepcopy(plan_dict)
    data["decisions"] = [d for d in data["decisions"] if d["phase"] != phase]
    return data


# ----- 1. one plan validator: from_dict, load, the bundle loader, export ------------------------

@pytest.mark.parametrize("edit, pattern", BAD_PLANS)
def test_plan_from_dict_and_load_name_the_field(edit, pattern, plan_dict, tmp_path):
    data = _edited(plan_dict, edit)
    with pytest.raises(PlanError, match=pattern):
        Plan.from_dict(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=re.escape(f"plan file {str(path)!r}: ") + pattern):
        Plan.load(path)


def test_the_valid_plan_reads_back_equal(plan_dict):
    assert Plan.from_dict(copy.deepcopy(plan_dict)).to_dict() == plan_dict


@pytest.mark.parametrize("edit, pattern", [p for p in BAD_PLANS if p.id in ("mode-bogus", "batch-0", "target-string")]
                         + [pytest.param(lambda d: d.update(decisions=[x for x in d["decisions"]
                                                                       if x["phase"] != "prefill"]),
                                         r"plan\.decisions: no decision for phase 'prefill'", id="no-prefill")])
def test_bundle_loader_and_export_refuse_with_the_plan_readers_message(edit, pattern, plan_dict, tmp_path, capsys):
    good = Plan.from_dict(copy.deepcopy(plan_dict))
    bundle = export_bundle(RunningTensorLM(SPEC, vocab_size=VOCAB), tmp_path / "b", plan=good, onnx=False)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["plan"] = _edited(plan_dict, edit)
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"manifest\.json: " + pattern):
        load_bundle(bundle)
    assert main(["inspect", str(bundle)]) == 2
    assert re.search(pattern, capsys.readouterr().err)
    # `rtcompile export --plan` refuses the same plan file, one line, nothing written
    (tmp_path / "s.toml").write_text(SPEC_TOML)
    (tmp_path / "bad.json").write_text(json.dumps(manifest["plan"]))
    out = tmp_path / "b2"
    assert main(["export", str(tmp_path / "s.toml"), "--out", str(out), "--plan", str(tmp_path / "bad.json"),
                 "--no-onnx", "--vocab", str(VOCAB)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(pattern, err[0]), err
    assert not out.exists()


@pytest.mark.parametrize("phase", MISSING_PHASE)
def test_plan_without_a_phase_the_model_runs_is_refused(phase, plan_dict, tmp_path):
    data = _without(plan_dict, phase)
    with pytest.raises(PlanError, match=rf"plan\.decisions: no decision for phase '{phase}'.*allowed: a plan with "
                                        r"decisions for prefill and decode"):
        Plan.from_dict(data)
    # a Plan object built around the reader is refused by export before anything is written
    good = Plan.from_dict(copy.deepcopy(plan_dict))
    partial = dataclasses.replace(good, decisions=[d for d in good.decisions if d.phase != phase])
    with pytest.raises(BundleError, match=rf"no decision for phase '{phase}'"):
        export_bundle(RunningTensorLM(SPEC, vocab_size=VOCAB), tmp_path / "b", plan=partial, onnx=False)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("batch, seq_len, exc, pattern", [
    pytest.param(0, 16, ValueError, r"batch: got 0; allowed: an integer >= 1", id="batch-0"),
    pytest.param(1, -1, ValueError, r"seq_len: got -1; allowed: an integer >= 1", id="seq_len-negative"),
    pytest.param("x", 16, TypeError, r"batch: expected an integer >= 1, got str 'x'", id="batch-string"),
    pytest.param(1, 1.5, TypeError, r"seq_len: expected an integer >= 1, got float 1\.5", id="seq_len-float"),
])
def test_decision_for_checks_its_arguments(batch, seq_len, exc, pattern, plan_dict):
    plan = Plan.from_dict(copy.deepcopy(plan_dict))
    with pytest.raises(exc, match=pattern):
        plan.decision_for("prefill", batch, seq_len)


def test_plan_load_of_a_non_path_is_a_type_error():
    with pytest.raises(TypeError, match="path: expected a str or os.PathLike plan file, got NoneType"):
        Plan.load(None)


# ----- 3. the model's constructor, forward and step ---------------------------------------------

@pytest.mark.parametrize("kwargs, exc, pattern", [
    pytest.param(dict(spec="x"), TypeError, r"spec: expected a ModelSpec .*got str", id="spec-string"),
    pytest.param(dict(spec=None), TypeError, r"spec: expected a ModelSpec .*got NoneType", id="spec-none"),
    pytest.param(dict(spec=SPEC.to_dict()), TypeError, r"spec: expected a ModelSpec .*got dict", id="spec-dict"),
    pytest.param(dict(mlp="no"), TypeError, r"mlp: expected a bool, got str", id="mlp-string"),
    pytest.param(dict(mlp=None), TypeError, r"mlp: expected a bool, got NoneType", id="mlp-none"),
    pytest.param(dict(tie_embeddings=1), TypeError, r"tie_embeddings: expected a bool, got int", id="tie-int"),
    pytest.param(dict(vocab_size=1.5), TypeError, r"vocab_size: expected an integer >= 2, got float 1\.5",
                 id="vocab-float"),
    pytest.param(dict(vocab_size="256"), TypeError, r"vocab_size: expected an integer >= 2, got str '256'",
                 id="vocab-string"),
    pytest.param(dict(vocab_size=True), TypeError, r"vocab_size: expected an integer >= 2, got bool", id="vocab-bool"),
    pytest.param(dict(vocab_size=1), ValueError, r"vocab_size: got 1; allowed: an integer >= 2", id="vocab-1"),
])
def test_model_constructor_arguments(kwargs, exc, pattern):
    args = dict(spec=SPEC, vocab_size=VOCAB)
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        RunningTensorLM(**args)


def _cache(lm, B=1):
    with torch.no_grad():
        return lm(torch.zeros(B, 2, dtype=torch.long))[1]


def _state(shape):
    return lambda cache: [{"state": torch.zeros(shape), "conv": c["conv"]} for c in cache]


def _tails(fn):
    return lambda cache: [{"state": c["state"], "conv": fn(c["conv"])} for c in cache]


# (call(lm, cache of one sequence), exception, pattern): each is refused before the embedding runs
FORWARD_CASES = [
    pytest.param(lambda lm, c: lm(torch.tensor([[1.0, 2.0]])), TypeError,
                 r"tokens: dtype torch\.float32; allowed: torch\.int64, torch\.int32", id="forward-float-tokens"),
    pytest.param(lambda lm, c: lm(torch.tensor([1, 2])), ValueError, r"tokens: shape \[2\]; allowed: \[B, T\]",
                 id="forward-1d-tokens"),
    pytest.param(lambda lm, c: lm(torch.zeros(1, 0, dtype=torch.long)), ValueError,
                 r"tokens: shape \[1, 0\]; allowed: \[B, T\] with B >= 1 and T >= 1", id="forward-T0"),
    pytest.param(lambda lm, c: lm(torch.zeros(0, 3, dtype=torch.long)), ValueError, r"tokens: shape \[0, 3\]",
                 id="forward-B0"),
    pytest.param(lambda lm, c: lm([[1, 2]]), TypeError, r"tokens: expected a torch\.Tensor .*got list", id="forward-list"),
    pytest.param(lambda lm, c: lm(None), TypeError, r"tokens: expected a torch\.Tensor .*got NoneType", id="forward-none"),
    pytest.param(lambda lm, c: lm(torch.tensor([[1, VOCAB]])), ValueError,
                 rf"tokens: ids from 1 to {VOCAB}; allowed: 0 to {VOCAB - 1}", id="forward-out-of-vocab-cpu"),
    pytest.param(lambda lm, c: lm(torch.tensor([[-3, 1]])), ValueError, r"tokens: ids from -3 to 1", id="forward-negative"),
    pytest.param(lambda lm, c: lm(torch.tensor([[1]]), plan="h200"), TypeError,
                 r"plan: expected a rtcompile\.plan\.Plan .*got str", id="forward-plan-string"),
    pytest.param(lambda lm, c: lm(torch.tensor([[1]]), cache="x"), TypeError,
                 r"cache: expected None or the list of 2 per-layer dicts .*got str", id="forward-cache-string"),
    pytest.param(lambda lm, c: lm(torch.tensor([[1]]), cache=[]), ValueError,
                 r"cache: 0 layers; allowed: 2", id="forward-cache-empty"),
    pytest.param(lambda lm, c: lm(torch.tensor([[1]]), cache=["x", "y"]), TypeError,
                 r"cache\[0\]: expected a dict with 'state'", id="forward-cache-entry-string"),
    pytest.param(lambda lm, c: lm(torch.tensor([[1]]), cache=_state((1, 2, 2, 4))(c)), ValueError,
                 r"cache\[0\]\['state'\]: shape \[1, 2, 2, 4\]; allowed: \[B, H, d_1, \.\.\., d_v\] = \[1, 2, 2, 4, 5\]",
                 id="forward-state-shape"),
    pytest.param(lambda lm, c: lm(torch.tensor([[1]]), cache=_tails(lambda t: None)(c)), ValueError,
                 r"cache\[0\]\['conv'\]: got NoneType; allowed: 1 tails \[\[1, 3, 34\]\]", id="forward-tails-missing"),
    pytest.param(lambda lm, c: lm(torch.tensor([[1]]), cache=_tails(lambda t: [x[:, :2] for x in t])(c)), ValueError,
                 r"cache\[0\]\['conv'\]: got \[\[1, 2, 34\]\]", id="forward-tail-shape"),
    pytest.param(lambda lm, c: lm.step(torch.tensor([[1]]), c), ValueError,
                 r"tokens: got \[1, 1\]; allowed: a torch\.Tensor \[B\]", id="step-2d-tokens"),
    pytest.param(lambda lm, c: lm.step([1], c), TypeError, r"tokens: got list; allowed: a torch\.Tensor \[B\]",
                 id="step-list"),
    pytest.param(lambda lm, c: lm.step(torch.tensor([1, 2]), c), ValueError,
                 r"cache\[0\]\['state'\]: holds 1 sequences, tokens 2; allowed: the cache of the same 2 sequences",
                 id="step-wrong-batch"),
    pytest.param(lambda lm, c: lm.step(torch.tensor([1.0]), c), TypeError, r"tokens: dtype torch\.float32",
                 id="step-float"),
    pytest.param(lambda lm, c: lm.step(torch.tensor([VOCAB + 5]), c), ValueError,
                 rf"tokens: ids from {VOCAB + 5} to {VOCAB + 5}; allowed: 0 to {VOCAB - 1}", id="step-out-of-vocab-cpu"),
    pytest.param(lambda lm, c: lm.step(torch.tensor([1]), "x"), TypeError, r"cache: expected None or the list",
                 id="step-cache-string"),
    pytest.param(lambda lm, c: lm.step(torch.tensor([1]), None), TypeError,
                 r"cache: expected the list of per-layer dicts that forward returns \(a step continues a prefill\)",
                 id="step-cache-none"),
    # a misspelt backend ran the reference in a step, and was named only after the embedding in forward
    pytest.param(lambda lm, c: lm.step(torch.tensor([1]), c, backend="tirton"), ValueError,
                 r"backend: got 'tirton'; allowed: auto, triton, reference", id="step-backend-typo"),
    pytest.param(lambda lm, c: lm(torch.tensor([[1]]), backend="tirton"), ValueError, r"backend: got 'tirton'",
                 id="forward-backend-typo"),
    # update_cache="no" was truthy and updated the cache in place; at T = 2 or without a cache it was ignored
    pytest.param(lambda lm, c: lm(torch.tensor([[1]]), c, update_cache="no"), TypeError,
                 r"update_cache: expected a bool, got str", id="forward-update-cache-str"),
    pytest.param(lambda lm, c: lm(torch.tensor([[1, 2]]), c, update_cache=True), ValueError,
                 r"update_cache: True with T = 2; allowed: a cache and T = 1", id="forward-update-cache-T2"),
    pytest.param(lambda lm, c: lm(torch.tensor([[1]]), update_cache=True), ValueError,
                 r"update_cache: True with no cache", id="forward-update-cache-no-cache"),
    # an int64 state was cast to fp32 by step, and named initial_state (never passed) by forward
    pytest.param(lambda lm, c: lm.step(torch.tensor([1]), [{**x, "state": x["state"].long()} for x in c]), TypeError,
                 r"cache\[0\]\['state'\]: dtype torch\.int64; allowed: torch\.float32", id="step-int-state"),
]


@pytest.mark.parametrize("call, exc, pattern", FORWARD_CASES)
def test_forward_and_step_refuse_bad_inputs_before_any_work(call, exc, pattern, lm, monkeypatch):
    cache = _cache(lm)
    monkeypatch.setattr(lm.embed, "forward", lambda *a: pytest.fail("the embedding ran before the refusal"))
    with torch.no_grad(), pytest.raises(exc, match=pattern):
        call(lm, cache)


def test_good_inputs_still_run(lm):
    with torch.no_grad():
        logits, cache = lm(torch.tensor([[1, 2, 3]], dtype=torch.int32))
        step, _ = lm.step(torch.tensor([4]), cache)
    assert logits.shape == (1, 3, VOCAB) and step.shape == (1, VOCAB)


# ----- 4. make_plan's arguments -----------------------------------------------------------------

def test_make_plan_of_prefill_alone_is_allowed_but_not_exported(tmp_path):
    # a cost study plans prefill alone (explore's sweep); a bundle's model runs decode too
    plan = make_plan(SPEC, get_target("h200"), batches=(1,), seq_lens=(16,), decode_batches=(), use_measurements=False)
    assert {d.phase for d in plan.decisions} == {"prefill", "train"}
    with pytest.raises(BundleError, match=r"no decision for phase 'decode'"):
        export_bundle(RunningTensorLM(SPEC, vocab_size=VOCAB), tmp_path / "b", plan=plan, onnx=False)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("change, exc, pattern", [
    pytest.param(dict(batches=(0,)), ValueError, r"batches: got 0; allowed: integers >= 1", id="batches-0"),
    pytest.param(dict(batches=(-1,)), ValueError, r"batches: got -1; allowed: integers >= 1", id="batches-negative"),
    pytest.param(dict(batches=()), ValueError, r"batches: got an empty tuple; allowed: at least one", id="batches-empty"),
    pytest.param(dict(batches="8"), TypeError, r"batches: expected a list or tuple of integers >= 1, got str '8'",
                 id="batches-string"),
    pytest.param(dict(seq_lens=(1.5,)), TypeError, r"seq_lens: expected integers >= 1, got float 1\.5",
                 id="seq_lens-float"),
    pytest.param(dict(decode_batches=[0]), ValueError, r"decode_batches: got 0", id="decode_batches-0"),
    pytest.param(dict(spec="x"), TypeError, r"spec: expected a ModelSpec .*got str", id="spec-string"),
    pytest.param(dict(target="h200"), TypeError, r"target: expected a Target .*got str", id="target-string"),
    pytest.param(dict(use_measurements="yes"), TypeError, r"use_measurements: expected a bool", id="measurements-str"),
    pytest.param(dict(calibration={}), TypeError, r"calibration: expected a Calibration or None", id="calibration-dict"),
])
def test_make_plan_refuses_bad_arguments_before_any_work(change, exc, pattern, monkeypatch):
    monkeypatch.setattr(rtcompile.plan, "check_memory", lambda *a: pytest.fail("planned before refusing"))
    args = dict(spec=SPEC, target=get_target("h200"), batches=(1,), seq_lens=(16,), decode_batches=(1,))
    args.update(change)
    with pytest.raises(exc, match=pattern):
        make_plan(args.pop("spec"), args.pop("target"), **args)


def test_make_plan_and_fields_share_the_bucket_check():
    # make_plan's buckets go through rtcompile.fields.check_ints: a value out of range is a
    # PlanError, and an empty list is a value out of range there too (was a TypeError in fields)
    from rtcompile.fields import FieldValueError, check_ints

    with pytest.raises(PlanError, match=r"^decode_batches: got 0; allowed: integers >= 1$"):
        make_plan(SPEC, get_target("h200"), batches=(1,), seq_lens=(16,), decode_batches=[0])
    with pytest.raises(FieldValueError, match=r"^orders: got an empty tuple; allowed: at least one of integers") as info:
        check_ints("orders", (), 2, 6, "integers in [2, 6]")
    assert (info.value.name, info.value.value, info.value.allowed) == ("orders", (), "at least one of integers in [2, 6]")


# ----- 5. the memory refusal names the part that does not fit ----------------------------------

@pytest.fixture
def eight_gib(monkeypatch):
    monkeypatch.setattr(rtcompile.model, "device_memory_bytes", lambda device: 8 << 30)


@pytest.mark.parametrize("spec, vocab, field, reduce", [
    pytest.param(SPEC, 10**9, r"vocab_size", r"reduce vocab_size", id="vocabulary"),
    pytest.param(SPEC.replace(model_width=1 << 15), VOCAB, r"spec\.model_width", r"reduce model_width", id="mlps"),
    pytest.param(ModelSpec(order=3, key_widths=(65536, 65536), value_width=1, heads=32, model_width=4096), VOCAB,
                 r"spec\.key_widths", r"reduce key_widths", id="mixers"),
])
def test_parameter_refusal_names_the_largest_part(spec, vocab, field, reduce, eight_gib):
    with pytest.raises(ValueError, match=rf"^{field}: RunningTensorLM: the fp32 parameters: \d+ bytes needed .*"
                                         rf"parameters by part: embedding and head [\d,]+, mixers [\d,]+.*; {reduce}"):
        RunningTensorLM(spec, vocab_size=vocab)


def test_export_of_a_vocabulary_that_does_not_fit_names_vocab_size(tmp_path, capsys, monkeypatch):
    # the largest vocabulary a bundle holds (--vocab beyond it is refused before the model is
    # built: the test below), on a machine whose memory it does not fit
    monkeypatch.setattr(rtcompile.model, "device_memory_bytes", lambda device: 1 << 30)
    (tmp_path / "s.toml").write_text(SPEC_TOML)
    assert main(["export", str(tmp_path / "s.toml"), "--out", str(tmp_path / "b"), "--no-onnx",
                 "--vocab", "16777216"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rtcompile export: error: vocab_size: RunningTensorLM"), err
    assert "vocab_size 16,777,216" in err[0] and "reduce vocab_size" in err[0], err
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("vocab", ["60000000", "16777217", "1"])
def test_export_refuses_a_vocabulary_a_bundle_cannot_hold_before_building_the_model(vocab, tmp_path, capsys,
                                                                                     monkeypatch):
    # --vocab 60000000 allocated ~6 GB of embedding and head before export_bundle refused vocab_size
    monkeypatch.setattr(RunningTensorLM, "__init__", lambda *a, **k: pytest.fail("built the model before refusing"))
    (tmp_path / "s.toml").write_text(SPEC_TOML)
    assert main(["export", str(tmp_path / "s.toml"), "--out", str(tmp_path / "b"), "--no-onnx", "--vocab", vocab]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rtcompile export: error: vocab_size: --vocab "), err
    assert f"vocab_size {int(vocab):,}" in err[0] and "allowed: an integer in [2, 16777216]" in err[0], err
    assert not (tmp_path / "b").exists()


# ----- 6. generate's output bound ---------------------------------------------------------------

@pytest.mark.parametrize("batch, steps, memory, pattern", [
    pytest.param(1, 10**12, None, r"max_new_tokens: got 1000000000000; allowed: an integer from 0 to 2147483648 "
                 r"\(.*2\*\*31 tokens", id="beyond-2**31"),
    pytest.param(4, (1 << 29) + 1, None, r"max_new_tokens: got 536870913; allowed: an integer from 0 to 536870912",
                 id="beyond-2**31-over-4-rows"),
    pytest.param(2, 1 << 20, 1 << 20, r"max_new_tokens: got 1048576; allowed: an integer from 0 to 65536 "
                 r"\(.*within the 1048576 bytes of cpu memory", id="beyond-device-memory"),
])
def test_generate_refuses_an_output_that_cannot_be_allocated(batch, steps, memory, pattern, lm, monkeypatch):
    monkeypatch.setattr(rtcompile.generate, "device_memory_bytes", lambda device: memory)
    monkeypatch.setattr(lm, "forward", lambda *a, **k: pytest.fail("ran the model before refusing"))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: pytest.fail("allocated before refusing"))
    with pytest.raises(ValueError, match=pattern):
        lm.generate(torch.ones(batch, 2, dtype=torch.long), steps)


def test_output_bound_is_inclusive(monkeypatch):
    monkeypatch.setattr(rtcompile.generate, "device_memory_bytes", lambda device: None)
    rtcompile.generate.check_output_size(1 << 31, 1, "cpu")
    with pytest.raises(ValueError, match="max_new_tokens"):
        rtcompile.generate.check_output_size((1 << 31) + 1, 1, "cpu")


# ----- export_bundle's own arguments ------------------------------------------------------------

@pytest.mark.parametrize("kwargs, exc, pattern", [
    pytest.param(dict(model="x"), TypeError, r"model: expected a RunningTensorLM, got str", id="model-string"),
    pytest.param(dict(plan="h200"), TypeError, r"plan: expected a rtcompile\.plan\.Plan or None, got str",
                 id="plan-string"),
    pytest.param(dict(onnx="no"), TypeError, r"onnx: expected a bool, got str", id="onnx-string"),
    pytest.param(dict(out=None), TypeError, r"out: expected a str or os\.PathLike", id="out-none"),
])
def test_export_bundle_arguments(kwargs, exc, pattern, lm, tmp_path):
    args = dict(model=lm, out=tmp_path / "b", onnx=False)
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        export_bundle(args.pop("model"), args.pop("out"), **args)
    assert not (tmp_path / "b").exists()


def test_export_refuses_a_vocabulary_the_loader_would_refuse(tmp_path):
    from rtcompile.export.verify import MAX_VOCAB

    with torch.device("meta"):  # no memory for a 2**24 + 1 row table
        big = RunningTensorLM(SPEC, vocab_size=MAX_VOCAB + 1)
    with pytest.raises(BundleError, match=rf"vocab_size {MAX_VOCAB + 1}; allowed: an integer in \[2, {MAX_VOCAB}\]"):
        export_bundle(big, tmp_path / "b", onnx=False)
    assert not (tmp_path / "b").exists()


def test_export_bundle_that_fails_leaves_no_folder_it_made(lm, tmp_path, monkeypatch):
    # the CLI removed the parent folders it made for --out; the API left them behind
    from rtcompile.export import bundle as bundle_module
    from rtcompile.fileio import WriteError

    def full_disk(state, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bundle_module, "_save_weights", full_disk)
    with pytest.raises(WriteError, match="No space left on device"):
        export_bundle(lm, tmp_path / "new" / "deeper" / "b", onnx=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_conconlyc_cache_needs_one_tail_per_stream():
    # conconlyc: one tail per stream (q factors, k factors, v), each of its own width
    spec = SPEC.replace(features=Features(projection="conconlyc", short_conv=3))
    m = RunningTensorLM(spec, vocab_size=VOCAB).eval()
    with torch.no_grad():
        _, cache = m(torch.tensor([[1, 2]]))
        m.step(torch.tensor([3]), cache)
        cache[1]["conv"] = cache[1]["conv"][:-1]
        with pytest.raises(ValueError, match=r"cache\[1\]\['conv'\]: .*allowed: 5 tails"):
            m.step(torch.tensor([3]), cache)


def test_the_decode_step_refuses_inputs_that_require_grad():
    """Its output had no grad_fn: the gradients were lost without a word. validate=False (the
    serving path, inside CUDA graphs) skips this check as it skips the index check."""
    from rtcompile import running_tensor_decode_

    q = [torch.randn(2, 1, 1, w) for w in (2, 4)]
    k = [torch.randn(2, 1, 1, w) for w in (2, 4)]
    v = torch.randn(2, 1, 1, 3, requires_grad=True)
    cache = torch.zeros(4, 1, 2, 4, 3)
    with pytest.raises(ValueError, match=r"running_tensor_decode_: an input requires grad, but the Triton decode "
                                         r"step has no backward; allowed: .*torch\.no_grad"):
        running_tensor_decode_(q, k, v, state_cache=cache, state_indices=torch.tensor([0, 1]))
    assert torch.equal(cache, torch.zeros(4, 1, 2, 4, 3))  # refused before the launch


def _kernel_args(**over):
    """Order-3 inputs of the functional API ([1, 5, 2, (2, 4)], d_v 5), with ``over`` replacing some."""
    g = torch.Generator().manual_seed(3)
    xs = dict(q=[torch.randn(1, 5, 2, d, generator=g) for d in (2, 4)],
              k=[torch.randn(1, 5, 2, d, generator=g) for d in (2, 4)], v=torch.randn(1, 5, 2, 5, generator=g))
    xs.update(over)
    return xs


# (call, the field its message names): every tensor of the wrong dtype, whichever API takes it
DTYPE_CASES = [
    pytest.param(lambda lm, c: lm(torch.tensor([[1.0, 2.0]])), "tokens", id="forward-tokens"),
    pytest.param(lambda lm, c: lm.step(torch.tensor([1.0]), c), "tokens", id="step-tokens"),
    pytest.param(lambda lm, c: lm.step(torch.tensor([1]), [{**x, "state": x["state"].long()} for x in c]),
                 r"cache\[0\]\['state'\]", id="step-state"),
    pytest.param(lambda lm, c: rtcompile.generate.generate(lm, torch.ones(1, 2), 1), "tokens", id="generate-tokens"),
    pytest.param(lambda lm, c: rtcompile.running_tensor(**_kernel_args(v=torch.ones(1, 5, 2, 5, dtype=torch.int32)),
                                                        backend="reference"), "v", id="functional-int-v"),
    pytest.param(lambda lm, c: rtcompile.running_tensor(**_kernel_args(v=torch.randn(1, 5, 2, 5).double()),
                                                        backend="reference"), r"q\[0\]", id="functional-mixed"),
    pytest.param(lambda lm, c: rtcompile.running_tensor(**_kernel_args(), cu_seqlens=torch.tensor([0, 5], dtype=torch.int16),
                                                        backend="reference"), "cu_seqlens", id="functional-cu-seqlens"),
]


@pytest.mark.parametrize("call, field", DTYPE_CASES)
def test_a_wrong_dtype_is_both_a_type_and_a_value_error(lm, call, field):
    """A wrong dtype was a TypeError for token ids and indices but a ValueError for floats; one
    error type now serves every tensor, an instance of both, naming the field and the allowed dtypes."""
    cache = _cache(lm)
    with torch.no_grad(), pytest.raises(rtcompile.fields.TensorDtypeError, match=rf"^{field}: dtype torch\.\w+; allowed: ") as info:
        call(lm, cache)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
