"""The MQAR trainer (rtcompile.explore.trainer) on the CPU with the reference backend and a tiny
model: the loss falls, the learning-rate sweep returns the best rate, early stop, a killed run
resumes from its checkpoint at the same step without re-running finished rates, checkpoints are
safetensors + JSON (no pickle), and bad settings are refused naming the field."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rtcompile.explore import MQARTask, RecallResult, TrainSettings, split_seeds, train_recall
from rtcompile.spec import Features, ModelSpec

SPEC = ModelSpec(order=3, key_widths=(4, 4), value_width=8, heads=2, model_width=32, layers=1,
                 features=Features(short_conv=2))
# 2 pairs over 7 keys and 8 values: the model first learns to answer with some value (1/8 right),
# recall itself takes longer than a test can wait; the two are enough to tell rates apart.
TASK = MQARTask(vocab_size=16, seq_len=16, num_kv_pairs=2)


@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: one intra-op thread runs a step in ~12 ms, two threads on this 2-core
    machine (shared with other work) took 30-130 ms per step (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _settings(**changes) -> TrainSettings:
    base = dict(learning_rates=(3e-3,), max_steps=12, batch_size=16, train_examples=512, test_examples=128,
                eval_every=4, warmup_fraction=0.1, target_accuracy=1.0, backend="reference", seed=0)
    return TrainSettings(**{**base, **changes})


class Steps:
    """The on_step hook: records (lr, step, loss); raises at ``stop`` = (lr, step) to simulate a kill."""

    def __init__(self, stop=None):
        self.seen, self.stop = [], stop

    def __call__(self, lr, step, loss):
        self.seen.append((lr, step, loss))
        if (lr, step) == self.stop:
            raise KeyboardInterrupt

    def losses(self, lr):
        return {s: loss for r, s, loss in self.seen if r == lr}


def test_loss_falls_and_the_sweep_returns_the_best_rate():
    hook = Steps()
    # 1e-6 barely moves the weights in 40 steps; 3e-3 learns to answer with a value token
    result = train_recall(SPEC, TASK, _settings(learning_rates=(1e-6, 3e-3), max_steps=40, eval_every=20),
                          progress=False, on_step=hook)
    losses = [hook.losses(3e-3)[s] for s in range(1, 41)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, (first, last)  # measured: ~2.9 -> ~2.2 nats
    assert result.per_rate[3e-3] > result.per_rate[1e-6]  # the rates are distinguishable ...
    assert result.learning_rate == 3e-3 and result.accuracy == result.per_rate[3e-3]  # ... and the best is chosen
    assert result.steps == 40 and result.per_rate_steps == {1e-6: 40, 3e-3: 40}
    for lr in (1e-6, 3e-3):  # the evaluations, in order, for the explorer's training curves
        hist = result.per_rate_history[lr]
        assert [h["step"] for h in hist] == [20, 40] and hist[-1]["accuracy"] <= result.per_rate[lr]
        assert max(h["accuracy"] for h in hist) == result.per_rate[lr]
    assert (result.train_seed, result.test_seed) == split_seeds(0)
    json.dumps(result.to_dict())  # JSON-ready


def test_early_stop_at_a_reached_target():
    hook = Steps()
    result = train_recall(SPEC, TASK, _settings(learning_rates=(3e-3, 1e-3), max_steps=50, eval_every=3,
                                                target_accuracy=0.0), progress=False, on_step=hook)
    assert result.per_rate_steps == {3e-3: 3, 1e-3: 3}  # each rate stops at its first evaluation
    assert len(hook.seen) == 6


def _no_pickle(folder):
    from safetensors.torch import load_file

    files = sorted(p for p in folder.iterdir())
    assert files
    for path in files:
        head = path.read_bytes()[:16]
        # pickle streams start with PROTO 0x80; torch.save writes a zip ("PK")
        assert not head.startswith((b"\x80", b"PK")), path
        if path.suffix == ".safetensors":
            assert load_file(path)  # safetensors reads it without unpickling anything
        else:
            assert path.suffix == ".json"
            json.loads(path.read_text())
    return [p.name for p in files]


def test_a_killed_run_resumes_at_its_checkpoint_and_skips_finished_rates(tmp_path):
    settings = _settings(learning_rates=(3e-3, 1e-3))
    whole_hook = Steps()
    whole = train_recall(SPEC, TASK, settings, progress=False, on_step=whole_hook, checkpoint_dir=tmp_path / "a")

    folder = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):  # killed during step 10 of the second rate: last checkpoint at 8
        train_recall(SPEC, TASK, settings, progress=False, on_step=Steps(stop=(1e-3, 10)), checkpoint_dir=folder)
    names = _no_pickle(folder)
    assert set(names) == {"results.json", "lr-0.001.json", "lr-0.001.step-8.safetensors"}
    meta = json.loads((folder / "lr-0.001.json").read_text())
    assert meta["step"] == 8 and [h["step"] for h in meta["history"]] == [4, 8]

    again = Steps()
    resumed = train_recall(SPEC, TASK, settings, progress=False, on_step=again, checkpoint_dir=folder)
    assert [(lr, s) for lr, s, _ in again.seen] == [(1e-3, s) for s in (9, 10, 11, 12)]  # nothing finished re-runs
    for step, loss in again.losses(1e-3).items():  # the same batches and optimizer state as the unbroken run
        assert loss == pytest.approx(whole_hook.losses(1e-3)[step], rel=1e-6), step
    assert resumed.per_rate == whole.per_rate and resumed.learning_rate == whole.learning_rate
    assert resumed.per_rate_steps == {3e-3: 12, 1e-3: 12}
    assert _no_pickle(folder) == ["results.json"]  # a finished rate's checkpoint is removed

    third = Steps()
    assert train_recall(SPEC, TASK, settings, progress=False, on_step=third, checkpoint_dir=folder).per_rate == whole.per_rate
    assert not third.seen
    with pytest.raises(ValueError, match=r"checkpoint_dir: .*settings\.weight_decay"):
        train_recall(SPEC, TASK, _settings(learning_rates=(3e-3, 1e-3), weight_decay=0.5), progress=False,
                     checkpoint_dir=folder)


@pytest.mark.parametrize("fields, error, name", [
    (dict(learning_rates=()), TypeError, "learning_rates"),
    (dict(learning_rates=(1e-3, -1.0)), ValueError, r"learning_rates\[1\]"),
    (dict(learning_rates=(1e-3, 1e-3)), ValueError, "learning_rates"),
    (dict(max_steps=0), ValueError, "max_steps"),
    (dict(batch_size=2.5), TypeError, "batch_size"),
    (dict(eval_every=0), ValueError, "eval_every"),
    (dict(warmup_fraction=1.0), ValueError, "warmup_fraction"),
    (dict(target_accuracy=1.5), ValueError, "target_accuracy"),
    (dict(weight_decay=float("inf")), ValueError, "weight_decay"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(autocast_bf16=1), TypeError, "autocast_bf16"),
    (dict(tie_embeddings="yes"), TypeError, "tie_embeddings"),
])
def test_bad_settings_raise_naming_the_field(fields, error, name):
    with pytest.raises(error, match=rf"TrainSettings\.{name}"):
        _settings(**fields)


def test_bad_arguments_raise_before_any_work(tmp_path):
    with pytest.raises(TypeError, match="task"):
        train_recall(SPEC, {"vocab_size": 16}, _settings(), progress=False)
    with pytest.raises(TypeError, match="spec"):
        train_recall(SPEC.to_dict(), TASK, _settings(), progress=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="checkpoint_dir"):
        train_recall(SPEC, TASK, _settings(), progress=False, checkpoint_dir=tmp_path / "file")
    assert isinstance(RecallResult(1.0, 1e-3, {1e-3: 1.0}, 1, 0.0, 0, 1).to_dict(), dict)


def test_the_tied_head_checkpoint_resumes(tmp_path):
    """The head shares the embedding (untied at vocabulary 1024 the loss stayed at ln 512 for 2000
    steps, issue 23's runs): a tied model's checkpoint (one shared tensor, which safetensors
    refuses to write twice) resumes to the unbroken run's losses, and untied is another model."""
    task = MQARTask(vocab_size=1024, seq_len=16, num_kv_pairs=2)
    settings = _settings(max_steps=6, eval_every=3)
    assert settings.tie_embeddings  # the default
    whole = Steps()
    train_recall(SPEC, task, settings, progress=False, on_step=whole)
    # the head is the N(0, 1) embedding: first logits of std ~sqrt(32), loss far above ln(1024)
    assert whole.losses(3e-3)[1] > math.log(1024) + 3, whole.losses(3e-3)[1]
    with pytest.raises(KeyboardInterrupt):
        train_recall(SPEC, task, settings, progress=False, on_step=Steps(stop=(3e-3, 5)), checkpoint_dir=tmp_path)
    assert "lr-0.003.step-3.safetensors" in _no_pickle(tmp_path)
    again = Steps()
    train_recall(SPEC, task, settings, progress=False, on_step=again, checkpoint_dir=tmp_path)
    assert sorted(again.losses(3e-3)) == [4, 5, 6]
    for step, loss in again.losses(3e-3).items():
        assert loss == pytest.approx(whole.losses(3e-3)[step], rel=1e-6), step
    untied = Steps()  # the model's own small head init: the first loss near ln(1024)
    train_recall(SPEC, task, _settings(max_steps=1, tie_embeddings=False), progress=False, on_step=untied)
    assert abs(untied.losses(3e-3)[1] - math.log(1024)) < 1.0, untied.losses(3e-3)[1]


def test_a_compiled_model_trains_as_the_eager_one():
    """compile_backend: the same steps through torch.compile (aot_eager: the same ATen ops,
    traced) give the eager run's losses; fullgraph, so a graph break would fail here."""
    from torch._dynamo.utils import counters

    eager, compiled = Steps(), Steps()
    train_recall(SPEC, TASK, _settings(max_steps=6), progress=False, on_step=eager)
    graphs = counters["stats"]["unique_graphs"]
    train_recall(SPEC, TASK, _settings(max_steps=6, compile_backend="aot_eager"), progress=False, on_step=compiled)
    assert counters["stats"]["unique_graphs"] > graphs  # dynamo did trace the model
    want, got = eager.losses(3e-3), compiled.losses(3e-3)
    assert sorted(got) == list(range(1, 7))
    assert all(math.isclose(got[s], want[s], rel_tol=1e-4) for s in want), (want, got)


@pytest.mark.parametrize("value, error", [("no-such-backend", ValueError), (3, TypeError)])
def test_compile_backend_is_checked(value, error):
    with pytest.raises(error, match=r"TrainSettings\.compile_backend"):
        _settings(compile_backend=value)


@pytest.mark.parametrize("damage", ["scheduler", "step", "history"])
def test_a_damaged_checkpoint_json_is_a_value_error_naming_it(damage, tmp_path):
    """The checkpoint's JSON (not hashed, unlike its tensors) with a field removed or of the wrong
    type: before, a KeyError or TypeError from deep in the resume."""
    settings = _settings(learning_rates=(1e-3,))
    with pytest.raises(KeyboardInterrupt):
        train_recall(SPEC, TASK, settings, progress=False, on_step=Steps(stop=(1e-3, 10)), checkpoint_dir=tmp_path)
    path = tmp_path / "lr-0.001.json"
    meta = json.loads(path.read_text())
    if damage == "scheduler":
        del meta["scheduler"]
    else:
        meta[damage] = {"step": "x", "history": 5}[damage]
    path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"checkpoint_dir: .*lr-0\.001\.json' is damaged"):
        train_recall(SPEC, TASK, settings, progress=False, checkpoint_dir=tmp_path)
