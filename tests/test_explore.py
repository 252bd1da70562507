"""``rtcompile explore`` on the CPU: the cost-model sweep and its files, resume after a kill,
the recall path (with a stand-in trainer), bad input, matching, refusals and the Pareto front."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rtcompile.cli import main
from rtcompile.explore import RecallOptions, SweepOptions, pareto_front, run_sweep, write_report
from rtcompile.explore import sweep as sweep_mod
from rtcompile.explore.report import records
from rtcompile.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "order3_16x16.toml"
GRID = [(2, 8), (2, 16), (3, 8), (3, 16)]


def _storage(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'explore.db'}"


def _point_spec(order: int, width: int, **changes):
    return load_spec(SPEC).replace(order=order, key_widths=(width,) * (order - 1), **changes)


def test_cost_model_sweep_writes_table_json_csv_and_plots(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # measuring is refused under the interpreter: the model, GPU or not
    out = tmp_path / "out"
    out.mkdir()
    (out / "state_vs_recall.png").write_bytes(b"an earlier recall sweep's plot")
    rc = main(["explore", str(SPEC), "--orders", "2,3", "--widths", "8,16", "--out", str(out),
               "--storage", _storage(tmp_path)])
    assert rc == 0
    assert not (out / "state_vs_recall.png").exists()  # no recall plot beside results without recall
    table = capsys.readouterr().out
    for o, w in GRID:
        assert sum(line.startswith(f"│ o{o}_w{w} ") for line in table.splitlines()) == 1, table
    assert "model: h200" in table

    doc = json.loads((out / "results.json").read_text())
    head, pts = doc["header"], doc["points"]
    assert head["speed_source"] == "model" and head["target"] == "h200" and head["match"] is None
    assert head["torch"] and "triton" in head and head["commit"]
    import torch

    assert head["gpu"] == (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
    assert [(p["order"], p["width"]) for p in pts] == GRID
    for p in pts:
        spec = _point_spec(p["order"], p["width"])
        assert p["status"] == "ok"
        assert p["state_bytes_per_sequence"] == spec.state_bytes_per_sequence
        assert p["state_bytes_per_layer"] == spec.state_bytes_per_layer
        assert p["spec"]["key_widths"] == [p["width"]] * (p["order"] - 1)
        shapes = {(f["phase"], f["batch"], f["seq_len"]) for f in p["speed"]}
        assert shapes == {("prefill", 1, 4096), ("prefill", 8, 4096), ("decode", 1, 1), ("decode", 32, 1)}
        for f in p["speed"]:
            assert f["source"] == "model" and f["target"] == "h200", f
            assert f["seconds"] > 0 and f["seconds"] == pytest.approx(f["seconds_per_layer"] * spec.layers)
            assert f["tokens_per_s"] == pytest.approx(f["batch"] * f["seq_len"] / f["seconds"])
    assert any(p["pareto"] for p in pts)
    # the smallest state cannot be dominated: nothing has less state
    smallest = min(pts, key=lambda p: p["state_bytes_per_sequence"])
    assert smallest["pareto"]

    with open(out / "results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["id"] for r in rows] == [p["id"] for p in pts]
    for r, p in zip(rows, pts):
        assert int(r["state_bytes_per_sequence"]) == p["state_bytes_per_sequence"]
        assert r["decode_B32_source"] == r["prefill_B1_T4096_source"] == "model"
        assert float(r["decode_B32_s"]) == pytest.approx(p["decode_s"])

    png = (out / "state_vs_decode.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
    assert not (out / "state_vs_recall.png").exists()  # no --recall, no recall plot


_KILL_SCRIPT = textwrap.dedent("""
    import os, sys
    from rtcompile.explore import SweepOptions, run_sweep, sweep
    from rtcompile.spec import load_spec
    real, calls = sweep.evaluate_point, []
    def dying(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            os._exit(9)  # killed in the middle of the third point: its trial stays RUNNING
        return real(*a, **k)
    sweep.evaluate_point = dying
    run_sweep(load_spec(sys.argv[1]), SweepOptions(orders=(2, 3), widths=(8, 16), storage=sys.argv[2]), sys.argv[3])
""")


def test_killed_sweep_resumes_without_recomputing(tmp_path, monkeypatch):
    import optuna

    url, out = _storage(tmp_path), tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, str(SPEC), url, str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    (study,) = [optuna.load_study(study_name=s.study_name, storage=url) for s in optuna.get_all_study_summaries(url)]
    states = sorted(t.state.name for t in study.get_trials())
    assert states == ["COMPLETE", "COMPLETE", "RUNNING", "WAITING"], states
    before = {(t.params["order"], t.params["width"]): t.user_attrs["result"]
              for t in study.get_trials() if t.state.name == "COMPLETE"}

    real, evaluated = sweep_mod.evaluate_point, []

    def counting(point, *a, **k):
        evaluated.append((point.order, point.width))
        return real(point, *a, **k)

    monkeypatch.setattr(sweep_mod, "evaluate_point", counting)
    opts = SweepOptions(orders=(2, 3), widths=(8, 16), storage=url)
    res = run_sweep(load_spec(SPEC), opts, out)
    # the killed point and the one never started; not the two finished before the kill
    assert sorted(evaluated) == sorted(set(GRID) - set(before)) and len(evaluated) == 2
    assert res.ran == 2 and set(res.results) == {f"o{o}_w{w}" for o, w in GRID} and not res.errors
    for (o, w), result in before.items():
        assert res.results[f"o{o}_w{w}"] == result  # read back, not recomputed
    evaluated.clear()
    again = run_sweep(load_spec(SPEC), opts, out)  # a finished sweep: nothing runs
    assert evaluated == [] and again.ran == 0 and again.results == res.results
    # other speed code (an upgraded cost model or kernel): another study, every point runs again
    monkeypatch.setattr(sweep_mod, "speed_code_digest", lambda: "0" * 16)
    newer = run_sweep(load_spec(SPEC), opts, out)
    assert sorted(evaluated) == sorted(GRID) and newer.ran == len(GRID) and newer.study != res.study


@dataclass
class _FakeTask:
    vocab_size: int = 8192
    seq_len: int = 256
    num_kv_pairs: int = 16
    alpha: float = 0.01

    def check(self) -> None:
        if 4 * self.num_kv_pairs > self.seq_len:
            raise ValueError("num_kv_pairs: too many")


@dataclass(frozen=True)
class _FakeSettings:
    learning_rates: tuple = (1e-3,)
    max_steps: int = 2000
    batch_size: int = 64
    seed: int = 0


@dataclass
class _FakeResult:
    accuracy: float
    learning_rate: float
    per_rate: dict = field(default_factory=dict)
    steps: int = 1
    wall_s: float = 0.0
    train_seed: int = 0
    test_seed: int = 1
    per_rate_history: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"accuracy": self.accuracy, "learning_rate": self.learning_rate, "per_rate": self.per_rate,
                "steps": self.steps, "wall_s": self.wall_s, "train_seed": self.train_seed, "test_seed": self.test_seed,
                "per_rate_history": {repr(lr): h for lr, h in self.per_rate_history.items()}}


def test_recall_path_calls_the_trainer_and_reports_accuracy(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []

    def train_recall(spec, task, settings, *, device="cpu", checkpoint_dir=None, progress=True):
        calls.append((spec, task, settings, device, Path(checkpoint_dir), progress))
        acc = 0.95 if spec.order == 3 else 0.3 + spec.key_widths[0] / 100 + settings.seed / 1000
        history = {lr: [{"step": 2, "accuracy": 0.01, "loss": 6.0}, {"step": 5, "accuracy": acc, "loss": 1.0}]
                   for lr in settings.learning_rates}
        return _FakeResult(acc, settings.learning_rates[-1], {lr: acc for lr in settings.learning_rates},
                           per_rate_history=history)

    monkeypatch.setitem(sys.modules, "rtcompile.explore.mqar", types.SimpleNamespace(MQARTask=_FakeTask))
    monkeypatch.setitem(sys.modules, "rtcompile.explore.trainer",
                        types.SimpleNamespace(TrainSettings=_FakeSettings, train_recall=train_recall))
    out = tmp_path / "out"
    rc = main(["explore", str(SPEC), "--orders", "2,3", "--widths", "8,16", "--match", "params", "--recall",
               "--steps", "5", "--lrs", "1e-3,1e-2", "--seeds", "0,1", "--kv-pairs", "8", "--seq-len", "64",
               "--vocab", "40",
               "--out", str(out), "--storage", _storage(tmp_path)])
    assert rc == 0
    assert len(calls) == len(GRID) * 2  # every point, every seed
    for spec, task, settings, device, ckpt, progress in calls:
        assert (task.seq_len, task.num_kv_pairs, task.vocab_size) == (64, 8, 40)
        assert settings == _FakeSettings((1e-3, 1e-2), 5, 64, settings.seed) and settings.seed in (0, 1)
        assert device == "cpu" and progress is False
        pid = f"o{spec.order}_w{spec.key_widths[0]}"
        assert ckpt.parent.parent == out / "points" / pid and ckpt.name == f"seed{settings.seed}" and ckpt.is_dir()
        assert ckpt.parent.name.startswith("ckpt-")  # a folder per spec and recall settings
    base = next(c[0] for c in calls if c[0].order == 3 and c[0].key_widths == (16, 16))
    assert base.model_width == 128  # the recall default d_model; the base point is itself

    doc = json.loads((out / "results.json").read_text())
    head, pts = doc["header"], {p["id"]: p for p in doc["points"]}
    assert head["recall"]["seeds"] == [0, 1] and head["recall"]["learning_rates_swept"] == [1e-3, 1e-2]
    assert head["recall"]["learning_rates_chosen"]["o3_w16"] == [1e-2, 1e-2]
    assert pts["o2_w8"]["recall"]["accuracy"] == pytest.approx((0.38 + 0.381) / 2)
    assert pts["o2_w8"]["recall"]["device"] == "cpu"  # each point says where it trained
    with open(out / "results.csv", newline="") as fh:
        assert {row["recall_device"] for row in csv.DictReader(fh)} == {"cpu"}
    assert pts["o3_w16"]["recall_accuracy"] == pytest.approx(0.95)
    for p in pts.values():
        assert p["match"]["within"] and p["match"]["gap"] <= 0.02 and "model_width" in p["match"]["by"]
    # o3_w8: the best recall at the least order-3 state; o2_w8: the least state of all
    assert pts["o3_w8"]["pareto"] and pts["o2_w8"]["pareto"] and not pts["o3_w16"]["pareto"]
    assert (out / "state_vs_recall.png").read_bytes().startswith(b"\x89PNG")
    assert (out / "recall_curves.png").read_bytes().startswith(b"\x89PNG")
    hist = pts["o3_w16"]["recall"]["runs"][0]["per_rate_history"]  # what the curves are drawn from
    assert sorted(hist) == ["0.001", "0.01"] and [h["step"] for h in hist["0.01"]] == [2, 5]
    assert "recall" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "option"), [
    (["--orders", "5", "--widths", "8"], "--orders"),
    (["--orders", "2", "--widths", "0"], "--widths"),
    (["--orders", "2", "--widths", "8", "--match", "foo"], "--match"),
    (["--orders", "2", "--widths", "8", "--d-model", "0"], "--d-model"),
    (["--orders", "2", "--widths", "8", "--target", "nope"], "--target"),
    (["--orders", "2", "--widths", "8", "--recall", "--kv-pairs", "100"], "--kv-pairs"),
    (["--orders", "2", "--widths", "8", "--recall", "--kv-pairs", "8", "--vocab", "16"], "2 * --kv-pairs + 1 = 17"),
    (["--orders", "2", "--widths", "8", "--recall", "--lrs", "2"], "--lrs"),
    (["--widths", "8"], "--orders"),
    (["--orders", "2", "--widths", "8", "--steps", "2"], "--steps"),  # accepted and ignored without --recall
    (["--orders", "2", "--widths", "8", "--vocab", "3"], "--vocab"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, option):
    out = tmp_path / "out"
    rc = main(["explore", str(SPEC), *args, "--out", str(out), "--storage", _storage(tmp_path)])
    cap = capsys.readouterr()
    assert rc == 2
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and option in lines[0] and "explore" in lines[0], cap.err
    assert cap.out == "" and not out.exists() and not (tmp_path / "explore.db").exists()


@pytest.mark.parametrize("fields, exc, match", [
    (dict(storage=123), TypeError, r"^storage: expected a str or None, got int"),
    (dict(storage=""), ValueError, r"^storage: got ''; allowed: None"),
    (dict(storage="   "), ValueError, r"^storage: got '   '; allowed: None"),
    (dict(target=5), TypeError, r"^target: expected a str, got int"),
    (dict(match=5), TypeError, r"^match: expected a str or None, got int"),
], ids=["storage-int", "storage-empty", "storage-blank", "target-int", "match-int"])
def test_sweep_options_refuse_wrong_types(fields, exc, match):
    """Before: storage=123 failed later in run_sweep (AttributeError), storage='' took the default
    store silently, and an int target or match was a ValueError."""
    with pytest.raises(exc, match=match):
        SweepOptions(orders=(2,), widths=(8,), **fields)


def test_run_sweep_refuses_what_is_not_a_spec_or_options(tmp_path):
    opts = SweepOptions(orders=(2,), widths=(8,))
    with pytest.raises(TypeError, match=r"^spec: expected a ModelSpec"):
        run_sweep("notaspec", opts, tmp_path)
    with pytest.raises(TypeError, match=r"^opts: expected SweepOptions, got dict"):
        run_sweep(load_spec(SPEC), {"orders": (2,)}, tmp_path)


def test_options_name_the_field():
    with pytest.raises(ValueError, match=r"^orders: got 1; allowed: 2, 3, 4"):
        SweepOptions(orders=(1,), widths=(8,))
    with pytest.raises(ValueError, match=r"^match: got 'foo'; allowed: params, state"):
        SweepOptions(orders=(2,), widths=(8,), match="foo")
    with pytest.raises(TypeError, match=r"^widths: expected integers"):
        SweepOptions(orders=(2,), widths=(8.0,))
    with pytest.raises(ValueError, match=r"^seeds: got -1"):
        RecallOptions(seeds=(-1,))


def test_state_match_and_a_refused_point(tmp_path, capsys):
    """A spec the validation refuses is a line, not a crash; --match state says what it changed
    per point, and a match out of reach is reported with its gap."""
    opts = SweepOptions(orders=(2, 3), widths=(8, 512, 65536), match="state", target="l4", storage=_storage(tmp_path))
    res = run_sweep(load_spec(SPEC), opts, tmp_path / "out")
    recs = {r["id"]: r for r in records(res)}
    base = load_spec(SPEC)
    assert recs["o3_w65536"]["status"] == "refused" and "spec.key_widths" in recs["o3_w65536"]["note"]
    assert not recs["o3_w65536"]["pareto"] and "o3_w65536" not in res.results  # never run
    o2 = recs["o2_w8"]
    assert o2["state_bytes_per_sequence"] == base.state_bytes_per_sequence and o2["match"]["by"] == {"heads": 256}
    assert o2["heads"] == 256 and all(f["target"] == "l4" for f in o2["speed"])
    assert recs["o3_w8"]["match"]["by"] == {"heads": 32}
    # K = 65536: below one head of d_v 64, so one head of d_v 2 (the same 1 MiB)
    assert recs["o2_w65536"]["match"]["by"] == {"heads": 1, "value_width": 2}
    for pid in ("o2_w8", "o3_w8", "o2_w65536"):
        assert recs[pid]["state_bytes_per_sequence"] == base.state_bytes_per_sequence and recs[pid]["match"]["within"]
    far = recs["o3_w512"]  # K = 262144: one head of d_v 1 holds 2 MiB, twice the base's state
    assert far["match"]["by"] == {"heads": 1, "value_width": 1} and not far["match"]["within"]
    assert far["state_bytes_per_sequence"] == 2 * base.state_bytes_per_sequence
    assert "state match missed by 100.0%" in far["note"]
    write_report(res, tmp_path / "out")
    table = capsys.readouterr().out
    assert "o3_w65536" in table and "refused" in table


def test_a_grid_of_refused_points_still_reports(tmp_path, capsys):
    opts = SweepOptions(orders=(3, 4), widths=(65536,), storage=_storage(tmp_path))
    res = run_sweep(load_spec(SPEC), opts, tmp_path / "out")
    assert res.ran == 0 and not res.results
    paths = write_report(res, tmp_path / "out")
    pts = json.loads(paths["json"].read_text())["points"]
    assert [p["status"] for p in pts] == ["refused", "refused"] and not any(p["pareto"] for p in pts)
    assert paths["decode_plot"].read_bytes().startswith(b"\x89PNG")
    assert capsys.readouterr().out.count("refused") == 2


def test_pareto_front_on_a_hand_made_set():
    pts = [{"s": 1, "t": 5}, {"s": 2, "t": 3}, {"s": 3, "t": 3}, {"s": 4, "t": 1}, {"s": 5, "t": 5},
           {"s": 2, "t": 3}, {"s": 0.5, "t": None}]
    assert pareto_front(pts, [("s", "min"), ("t", "min")]) == [True, True, False, True, False, True, False]
    with_recall = [{"s": 1, "t": 5, "r": 0.2}, {"s": 3, "t": 3, "r": 0.9}, {"s": 3, "t": 3, "r": 0.8},
                   {"s": 4, "t": 6, "r": 0.9}]
    assert pareto_front(with_recall, [("s", "min"), ("t", "min"), ("r", "max")]) == [True, True, False, False]
    with pytest.raises(ValueError, match="allowed: min, max"):
        pareto_front(pts, [("s", "least")])


def test_two_worker_processes_split_the_points(tmp_path):
    """--workers 2: two processes claim the points from the store; each point runs once."""
    import optuna

    url = _storage(tmp_path)
    res = run_sweep(load_spec(SPEC), SweepOptions(orders=(2, 3), widths=(8, 16), storage=url, workers=2),
                    tmp_path / "out")
    assert set(res.results) == {f"o{o}_w{w}" for o, w in GRID} and not res.errors and res.ran == len(GRID)
    (study,) = [optuna.load_study(study_name=s.study_name, storage=url) for s in optuna.get_all_study_summaries(url)]
    done = [t for t in study.get_trials() if t.state.name == "COMPLETE"]
    assert len(done) == len(GRID)  # none twice
    assert os.getpid() not in {t.user_attrs["pid"] for t in done}  # the workers ran them, not this process


def test_measured_figures_come_from_the_bench_measures(monkeypatch):
    """The measured path, on the CPU at a tiny shape (the interpreter: the plumbing, not a GPU
    timing): bench's prefill and decode measures run the kernels and every figure says measured."""
    import functools

    from rtcompile.spec import ModelSpec

    spec = ModelSpec(order=3, key_widths=(4, 4), value_width=8, heads=1, model_width=16, layers=2, chunk_size=16)
    monkeypatch.setattr(sweep_mod, "PREFILL_SHAPES", ((1, 16),))
    monkeypatch.setattr(sweep_mod, "DECODE_BATCHES", (2,))
    monkeypatch.setattr(sweep_mod, "measured_layer_seconds",
                        functools.partial(sweep_mod.measured_layer_seconds, device="cpu", repeats=3))
    figs = sweep_mod.speed_figures(spec, sweep_mod.SpeedMode("measured", "cpu (test)", "test"))
    assert [(f["phase"], f["batch"], f["seq_len"]) for f in figs] == [("prefill", 1, 16), ("decode", 2, 1)]
    for f in figs:
        assert f["source"] == "measured" and f["seconds_per_layer"] > 0, f
        assert f["seconds"] == pytest.approx(2 * f["seconds_per_layer"]) and "median of 3" in f["note"]
    assert "state err" in figs[1]["note"]  # the decode step was checked against float64 before timing


def test_measured_speeds_come_first_then_the_trainings(tmp_path, monkeypatch):
    """Measured speed with recall: every point's speed is measured before any training starts
    (measured inside the trials, a timing would wait for the trainings sharing its GPU), the
    trial stores those figures, and a rerun measures nothing again."""
    events = []

    def fake_speed(spec, mode):
        events.append(("speed", spec.order, spec.key_widths[0]))
        return [{"phase": "decode", "batch": 1, "seq_len": 1, "seconds": 1e-3 * spec.order, "source": "measured"}]

    def train_recall(spec, task, settings, *, device="cpu", checkpoint_dir=None, progress=True):
        events.append(("train", spec.order, spec.key_widths[0]))
        return _FakeResult(0.5, settings.learning_rates[0], {settings.learning_rates[0]: 0.5})

    monkeypatch.setattr(sweep_mod, "speed_mode", lambda target: sweep_mod.SpeedMode("measured", "cpu (test)", "test"))
    monkeypatch.setattr(sweep_mod, "speed_figures", fake_speed)
    monkeypatch.setitem(sys.modules, "rtcompile.explore.mqar", types.SimpleNamespace(MQARTask=_FakeTask))
    monkeypatch.setitem(sys.modules, "rtcompile.explore.trainer",
                        types.SimpleNamespace(TrainSettings=_FakeSettings, train_recall=train_recall))
    opts = SweepOptions(orders=(2, 3), widths=(8, 16), storage=_storage(tmp_path),
                        recall=RecallOptions(steps=5, kv_pairs=8, seq_len=64, vocab_size=40))
    out = tmp_path / "out"
    res = run_sweep(load_spec(SPEC), opts, out)
    kinds = [e[0] for e in events]
    assert kinds == ["speed"] * len(GRID) + ["train"] * len(GRID), events
    assert sorted(e[1:] for e in events if e[0] == "speed") == sorted(GRID)
    for (o, w) in GRID:
        assert res.results[f"o{o}_w{w}"]["speed"][0]["seconds"] == pytest.approx(1e-3 * o)
        assert list((out / "points" / f"o{o}_w{w}").glob("speed-*.json"))
    events.clear()
    again = run_sweep(load_spec(SPEC), opts, out)
    assert events == [] and again.ran == 0


def test_default_workers(monkeypatch):
    """--workers left out: 1 without a GPU; one per GPU for measured speed; four per GPU with
    recall (trainings share a GPU), never more than the runnable points."""
    from rtcompile import explore_cmd

    spec = load_spec(SPEC)
    grid = SweepOptions(orders=(2, 3), widths=(8, 16))  # 4 points
    recall = SweepOptions(orders=(2, 3), widths=(8, 16, 32), recall=RecallOptions())  # 6 points
    monkeypatch.setattr(sweep_mod, "compute_device", lambda: "cpu")
    assert explore_cmd.default_workers(spec, recall) == 1  # no GPU
    monkeypatch.setattr(sweep_mod, "compute_device", lambda: "cuda")
    monkeypatch.setattr(sweep_mod, "visible_gpus", lambda: ["0"])
    assert explore_cmd.default_workers(spec, grid) == 1
    assert explore_cmd.default_workers(spec, recall) == 4
    monkeypatch.setattr(sweep_mod, "visible_gpus", lambda: ["0", "1"])
    assert explore_cmd.default_workers(spec, grid) == 2
    assert explore_cmd.default_workers(spec, recall) == 6  # 8 workers, 6 points
    named = SweepOptions(orders=(2, 3), widths=(8, 16), target="h200")
    assert explore_cmd.default_workers(spec, named) == 1  # the cost model: nothing on the GPU


def test_the_cli_recall_defaults_are_the_options_defaults():
    """`rtcompile explore --recall` with no task or training flags trains what RecallOptions()
    describes (the documented defaults cannot drift apart)."""
    import argparse

    from rtcompile import explore_cmd

    parser = argparse.ArgumentParser()
    explore_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["explore", str(SPEC), "--orders", "2", "--widths", "8", "--recall"])
    assert explore_cmd._options(args).recall == RecallOptions()


@pytest.mark.parametrize("how", ["error", "interrupt"])
def test_a_failing_point_is_reported_and_an_interrupt_exits_130(how, tmp_path, capsys, monkeypatch):
    """Before: the failure handler read a live Trial's system_attrs (it has none), so any failing
    point and any Ctrl-C ended in an AttributeError traceback, exit 1."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    real = sweep_mod.evaluate_point

    def evaluate(point, *a, **kw):
        if point.id == "o2_w16":
            raise RuntimeError("planted") if how == "error" else KeyboardInterrupt
        return real(point, *a, **kw)

    monkeypatch.setattr(sweep_mod, "evaluate_point", evaluate)
    out = tmp_path / "out"
    rc = main(["explore", str(SPEC), "--orders", "2", "--widths", "8,16", "--out", str(out),
               "--storage", _storage(tmp_path)])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "AttributeError" not in err, err
    if how == "interrupt":
        assert rc == 130 and "rtcompile: interrupted" in err
    else:
        assert rc == 0 and "o2_w16: failed: error: RuntimeError: planted" in err, err
        points = {p["id"]: p for p in json.loads((out / "results.json").read_text())["points"]}
        assert points["o2_w8"]["status"] == "ok" and points["o2_w16"]["status"] != "ok"


def test_a_damaged_speed_cache_is_measured_again(tmp_path):
    """A speed cache that is not the figures (edited, truncated) is computed again, not a failed point."""
    from rtcompile.explore.points import make_point

    opts = SweepOptions(orders=(2,), widths=(8,), target="h200")
    base = sweep_mod.base_spec(load_spec(SPEC), opts)
    point = make_point(base, opts, 2, 8)
    mode = sweep_mod.speed_mode("h200")
    cache = tmp_path / "speed.json"
    want = sweep_mod.point_speed(point, mode, "cpu")
    for junk in ("{x", '{"a": 1}', "[1, 2]", '[{"a": 1}]'):
        cache.write_text(junk)
        assert sweep_mod.point_speed(point, mode, "cpu", cache) == want


def test_a_store_of_another_program_is_one_line(tmp_path, capsys):
    """A SQLite file whose "studies" table is not Optuna's: before, a StorageInternalError traceback."""
    import sqlite3

    db = tmp_path / "other.db"
    with sqlite3.connect(db) as con:
        con.execute("create table studies(x)")
    rc = main(["explore", str(SPEC), "--orders", "2", "--widths", "8", "--out", str(tmp_path / "out"),
               "--storage", f"sqlite:///{db}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "cannot open" in err[0] and str(db) in err[0], err


def test_a_report_path_that_is_a_folder_is_refused_before_any_point(tmp_path, capsys, monkeypatch):
    """Before: every point ran (hours with --recall), then "cannot write the report"."""
    out = tmp_path / "out"
    (out / "results.json").mkdir(parents=True)
    monkeypatch.setattr(sweep_mod, "run_sweep", lambda *a, **k: pytest.fail("ran the sweep before refusing"))
    rc = main(["explore", str(SPEC), "--orders", "2", "--widths", "8", "--out", str(out),
               "--storage", _storage(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "results.json there is a folder" in err[0], err


def test_a_malformed_stored_result_is_a_failed_point_not_a_crash(tmp_path, capsys, monkeypatch):
    """A store whose point result was edited ({"speed": {"a": 1}}): before, a TypeError traceback
    from the report."""
    import optuna

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    argv = ["explore", str(SPEC), "--orders", "2", "--widths", "8,16", "--out", str(tmp_path / "out"),
            "--storage", _storage(tmp_path)]
    assert main(argv) == 0
    from rtcompile.tuning.store import open_storage

    storage = open_storage(_storage(tmp_path))
    [summary] = optuna.get_all_study_summaries(storage, False)
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    trial = next(t for t in study.get_trials() if t.params == {"order": 2, "width": 16})
    import sqlite3

    with sqlite3.connect(tmp_path / "explore.db") as con:  # Optuna refuses to edit a finished trial
        con.execute("update trial_user_attributes set value_json = ? where trial_id = ? and key = 'result'",
                    (json.dumps({"speed": {"a": 1}}), trial._trial_id))
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    points = {p["id"]: p for p in json.loads((tmp_path / "out" / "results.json").read_text())["points"]}
    assert points["o2_w8"]["status"] == "ok" and points["o2_w16"]["status"] == "failed"
    assert "stored result is not a point's figures" in points["o2_w16"]["note"]


def test_explicit_workers_are_capped_at_the_waiting_points(tmp_path, monkeypatch):
    """--workers 4 for one point started four worker processes (~200 MB each); one is enough."""
    import io

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    started = []

    class Idle:  # a worker that claims nothing: the coordinator runs the point itself
        returncode = 0

        def __init__(self, *a, **k):
            started.append(a)
            self.stdin = io.StringIO()

        def poll(self):
            return 0

        def wait(self):
            return 0

    monkeypatch.setattr(sweep_mod, "subprocess", types.SimpleNamespace(Popen=Idle, PIPE=-1))  # this module's only
    monkeypatch.setattr(sweep_mod, "STALE_POLL_S", 0)
    rc = main(["explore", str(SPEC), "--orders", "2", "--widths", "8", "--workers", "4", "--out", str(tmp_path / "out"),
               "--storage", _storage(tmp_path)])
    assert rc == 0 and len(started) == 1


def test_checkpoint_folders_follow_the_trained_task_not_the_rates_or_seeds():
    """The trainer resumes across learning rates and keeps a folder per seed: adding a seed or a
    rate must find the finished trainings (hours each); another --steps or --vocab must not."""
    from rtcompile.explore.points import make_point

    opts = SweepOptions(orders=(2,), widths=(8,), recall=RecallOptions())
    point = make_point(sweep_mod.base_spec(load_spec(SPEC), opts), opts, 2, 8)
    folder = lambda **change: sweep_mod.checkpoints(Path("o"), point, RecallOptions(**change))  # noqa: E731
    assert folder() == folder(seeds=(0, 1)) == folder(learning_rates=(1e-3, 5e-4))
    assert folder() != folder(steps=10) and folder() != folder(vocab_size=2048)
