"""benchmarks/onnx_cpu.py, tpe_check.py and replay_host_rule.py run end to end at tiny
shapes on the CPU (their numbers are for the machines their headers name)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import interpreter_only

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import onnx_cpu
import tpe_check

TINY = """name = "tiny"
order = 3
key_widths = [4, 4]
value_width = 8
heads = 2
model_width = 16
layers = 1
input_dtype = "float32"
"""


def test_onnx_cpu_times_both_bodies_and_checks_the_logits(tmp_path, capsys):
    spec = tmp_path / "tiny.toml"
    spec.write_text(TINY)
    assert onnx_cpu.main([str(spec), "--seq-len", "70", "--threads", "1"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if re.match(r"\s+1\s+70\s", ln)]
    assert len(rows) == 1
    chunk_ms, scan_ms, ref_ms, diff = float(rows[0][2]), float(rows[0][3]), float(rows[0][4]), float(rows[0][7])
    assert chunk_ms > 0 and scan_ms > 0 and ref_ms > 0 and diff < 1e-4


def test_tpe_check_refuses_bad_budgets(capsys):
    assert tpe_check.main(["x.toml", "--trials", "0", "--out", "/tmp/unused"]) == 2
    assert "--trials" in capsys.readouterr().err


def test_replay_host_rule_prices_both_ways(tmp_path, capsys):
    """A GPU-bound point where the rules disagree: A (host 0.3, device 0.35 ms, measured 0.36)
    against B (host 0.15, device 0.45, measured 0.46): sum ranks B first (0.60 < 0.65), max A."""
    import json

    import replay_host_rule

    alt = lambda host, dev, meas: {"mode": "chunk", "variant": {}, "measured_s": meas,
                                   "cost": {"seconds": host + dev, "host_s": host}}
    data = {"summary": {}, "rows": [{"alternatives": [alt(0.3e-3, 0.35e-3, 0.36e-3), alt(0.15e-3, 0.45e-3, 0.46e-3)]}]}
    res = replay_host_rule.replay(data)
    assert res["sum"]["regret_max"] == pytest.approx(0.46 / 0.36 - 1) and res["sum"]["within_5pct"] == 0
    assert res["max"]["regret_max"] == 0 and res["max"]["within_5pct"] == 1
    assert res["max"]["error_median"] < res["sum"]["error_median"]
    path = tmp_path / "regret.json"
    path.write_text(json.dumps(data))
    assert replay_host_rule.main([str(path)]) == 0 and "max" in capsys.readouterr().out
    path.write_text("[]")
    assert replay_host_rule.main([str(path)]) == 2


def test_interleaved_medians_rotate_the_order_and_drop_a_failed_config():
    """Each pass starts one config later, so a machine slowing down over the passes charges every
    config alike; a config that fails once has no median."""
    order, clock = [], iter(range(100))

    def measure(c):
        order.append(c)
        t = next(clock)
        return None if c == "bad" and t > 3 else {"a": 1.0, "b": 2.0, "bad": 3.0}[c] + t / 1000

    med = tpe_check.interleaved_medians(["a", "b", "bad"], measure, 3)
    assert order == ["a", "b", "bad", "b", "bad", "a", "bad", "a", "b"]
    assert med == {"a": 1.0 + 5 / 1000, "b": 2.0 + 3 / 1000}


@interpreter_only  # CPU tensors through the interpreter's kernels (on a GPU machine Triton refuses them)
def test_tpe_check_reports_both_ratios(tmp_path, capsys, tuning_cache):
    """End to end on the interpreter at a two-config sub-space: the sweep, one study, and the
    re-timing of the sweep's best and the study's pick (ratios >= 1 against the fastest)."""
    import json

    spec = tmp_path / "tiny.toml"
    spec.write_text(TINY)
    fixed = ["form=resident", "resident.chunk_size=16", "resident.num_warps=2", "resident.num_stages=1",
             "resident.prepare_warps=1", "resident.solve=rows", "resident.dot_precision=ieee",
             "resident.prefetch_inputs=false", "resident.materialise=false"]
    argv = [str(spec), "--batch", "1", "--seq-len", "32", "--trials", "1", "--seeds", "1", "--rounds", "2",
            "--out", str(tmp_path / "out")] + [x for f in fixed for x in ("--fix", f)]
    assert tpe_check.main(argv) == 0
    [row] = json.loads((tmp_path / "out" / "tpe_check.json").read_text())
    assert row["space"] == 2 and row["remeasured"]["rounds"] == 2 and row["remeasured"]["best_ms"] > 0
    [study] = row["studies"]
    assert study["remeasured_ratio"] >= 1 and study["ratio_in_sweep"] >= 1
    assert study["counts"].get("ok", 0) >= 1 and study["not_ok"] == []
    assert "re-measured" in capsys.readouterr().out


@interpreter_only  # CPU tensors through the interpreter's kernels (on a GPU machine Triton refuses them)
def test_compare_kron_check_passes_a_right_config_and_names_a_wrong_one(monkeypatch):
    """compare_kron.check (the GPU gate before timing) on the CPU: the interpreter's kernels in
    place of CUDA ones. A config that matches float64 passes; outputs zeroed by a broken launcher
    are named (dtype, case, which output)."""
    import torch

    import compare_kron
    from rtcompile.kernels import launch
    from rtcompile.kernels.chunk_split import SplitConfig

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self: self)
    monkeypatch.setattr(launch, "smem_limit", lambda device: 232448)
    config = SplitConfig(16, 16, loop="kron", state_stride=2)
    assert compare_kron.check(config, (16, 16)) is None
    real = launch.running_tensor_fwd
    monkeypatch.setattr(launch, "running_tensor_fwd",
                        lambda *a, **kw: tuple(torch.zeros_like(x) for x in real(*a, **kw)))
    failed = compare_kron.check(config, (16, 16))
    assert failed is not None and failed.startswith("torch.bfloat16 T203 output"), failed


@interpreter_only  # CPU tensors through the interpreter's kernels (on a GPU machine Triton refuses them)
def test_compare_kron_check_runs_the_pipelined_parts(monkeypatch):
    """The GPU gate also runs the parts a graph capture would (eagerly, parts of any length): a
    launcher that drops every part after the first passes the one-part checks and is named
    there. phi_pass, the default's form at o3 16x16."""
    import torch

    import compare_kron
    from rtcompile.kernels import chunk_split, launch
    from rtcompile.kernels.chunk_fused import FusedConfig
    from rtcompile.kernels.chunk_split import SplitConfig

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self: self)
    monkeypatch.setattr(launch, "smem_limit", lambda device: 232448)
    config = SplitConfig(32, 16, state_stride=2, pipeline=2, phi_pass=True)
    assert compare_kron.check(config, (16, 16)) is None
    # a tuned table's default may be another form, without a dot_precision field (it had raised
    # TypeError); the reference stands in for its kernels here (the form is not the point)
    from rtcompile.kernels import running_tensor_recurrent_ref

    with monkeypatch.context() as m:
        def reference(q, k, v, g, beta, variant, **kw):
            o, s = running_tensor_recurrent_ref(q, k, v, g, beta, **kw)
            return o.to(v.dtype), s.to(kw["initial_state"].dtype)

        m.setattr(launch, "running_tensor_fwd", reference)
        assert compare_kron.check(FusedConfig(16, 256, 16), (16, 16)) is None
    real = chunk_split.run_parts
    monkeypatch.setattr(chunk_split, "run_parts", lambda bounds, *a, **kw: real(bounds[:1], *a, **kw))
    failed = compare_kron.check(config, (16, 16))
    assert failed is not None and failed.startswith("torch.bfloat16 T203 parts output"), failed


@interpreter_only  # CPU tensors through the interpreter's kernels (on a GPU machine Triton refuses them)
def test_compare_kron_check_runs_the_stepped_loop(monkeypatch):
    """The GPU gate on the stepped loop (the streamed form's chunks launched from the host) in
    runs of two key tiles: it passes, and a launcher that skips the last launch (the final
    update) is named by its state."""
    import torch

    import compare_kron
    from rtcompile.kernels import chunk_stepped, launch
    from rtcompile.kernels.chunk_streamed import StreamedConfig

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self: self)
    monkeypatch.setattr(launch, "smem_limit", lambda device: 232448)
    config = StreamedConfig(32, 16, 16, loop="stepped", tiles_per_program=2)
    assert compare_kron.check(config, (5, 7)) is None
    real = chunk_stepped.cached
    last = []  # the call's chunk count: the state kernel's launch at that chunk is the last update

    class Dropped:  # the state kernel's last launch (the update by the last chunk) never runs
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def call(*a, **kw):
                if self.kernel is chunk_stepped.chunk_stepped_state_kernel and a[14] == last[-1]:  # a[14]: i_c
                    return None
                return real(self.kernel)[grid](*a, **kw)
            return call

    real_run = chunk_stepped.run

    def run(config, p, *a, **kw):
        last.append(max(-(-(hi - lo) // config.chunk_size) for lo, hi in (p.seq_bounds or ((0, p.seq_len),))))
        return real_run(config, p, *a, **kw)

    monkeypatch.setattr(chunk_stepped, "cached", Dropped)
    monkeypatch.setattr(chunk_stepped, "run", run)
    failed = compare_kron.check(config, (5, 7))
    assert failed is not None and " state:" in failed, failed


@pytest.mark.parametrize("option, message", [("--batch", "--batch: a number of sequences >= 1, got 0"),
                                             ("--jobs", "--jobs: a number of processes >= 1, got 0")],
                         ids=["batch", "jobs"])
def test_compare_kron_count_refusal(monkeypatch, capsys, option, message):
    """--batch or --jobs below 1: one usage line naming the option, exit 2, before any GPU work."""
    import compare_kron

    monkeypatch.setattr(sys, "argv", ["compare_kron.py", "--stepped", option, "0"])
    with pytest.raises(SystemExit) as exc:
        compare_kron.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("jobs", [1, 3], ids=["one-process", "three-processes"])
def test_compare_kron_check_all_keeps_order_constants_and_failures(monkeypatch, tmp_path, jobs):
    """check_all (compare_kron --jobs): each config's result in ``todo``'s order, checked with
    its module constants set; in processes, only the configs that passed make the warming call.
    The gate and the call are stand-ins here (fork carries them into the processes); the GPU
    session runs the real ones."""
    import compare_kron
    from rtcompile.kernels import chunk_split

    def check(config, widths):
        name, wants_constant = config
        if chunk_split.PHI_BESIDE_PREPARE != wants_constant:
            return f"{name}: PHI_BESIDE_PREPARE {chunk_split.PHI_BESIDE_PREPARE}"
        return f"{name} wrong at {widths}" if name.startswith("bad") else None

    def warm(config, widths, batch):
        with open(tmp_path / f"warm-{config[0]}-{batch}", "w"):
            pass

    monkeypatch.setattr(compare_kron, "check", check)
    monkeypatch.setattr(compare_kron, "_warm_call", warm)
    todo = [("default", ("a", False), {}), ("x", ("bad1", False), {}),
            ("y", ("b", True), {"PHI_BESIDE_PREPARE": True}), ("z", ("bad2", True), {"PHI_BESIDE_PREPARE": True})]
    got = compare_kron.check_all(todo, (3, 5), jobs, batch=4, context="fork")
    assert got == [None, "bad1 wrong at (3, 5)", None, "bad2 wrong at (3, 5)"]
    assert chunk_split.PHI_BESIDE_PREPARE is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if jobs == 1 else ["warm-a-4", "warm-b-4"])


def test_compare_kron_changes_to_the_default_pass_their_checks():
    """Every change compare_kron proposes to a shape's default builds a config that passes its
    own check with an H200's shared memory (232448 B), and changes what it names (a misspelt
    field or a no-op would time the default against itself on the GPU): a config field to
    another value, or a chunk_split constant (UPPER case) that exists to another value."""
    import compare_kron
    from rtcompile.kernels import chunk_split
    from rtcompile.kernels.config import KernelShape
    from rtcompile.kernels.forms import default_config

    checked = 0
    for case, widths, proposals in (compare_kron.PHI_PASS + compare_kron.LARGE + compare_kron.SMALL_K
                                    + compare_kron.SOLVE + compare_kron.STEPPED):
        shape = KernelShape(widths, 64, 2)
        default = default_config("chunk", shape, 232448, gluon=True)  # an H200's (sm_90) default
        for proposal in proposals:
            fields, constants = compare_kron.split_fields(proposal)
            assert set(fields) <= set(default.to_dict()), (case, fields)
            assert all(hasattr(chunk_split, k) and getattr(chunk_split, k) != v for k, v in constants.items()), \
                (case, constants)
            cfg = type(default).from_dict({**default.to_dict(), **fields})
            assert cfg != default or constants, (case, proposal)
            assert cfg.check(shape, 232448) is None, (case, fields, cfg.check(shape, 232448))
            checked += 1
    assert checked > 0  # a list may be empty between trials (PHI_PASS now), not all of them


def test_compare_kron_split_configs_pass_their_checks():
    """Every split config compare_kron builds over a base (CASES over KRON, SPLIT_LARGE over
    SPLIT_TRITON) names only SplitConfig fields and passes its own check for 16-bit inputs with an
    H200's shared memory: a refused row would only say so on the GPU, after its device time."""
    import compare_kron
    from rtcompile.kernels.chunk_split import SplitConfig
    from rtcompile.kernels.config import KernelShape

    fields_allowed = set(SplitConfig(16, 16).to_dict())
    for base, rows in ((compare_kron.KRON, compare_kron.CASES), (compare_kron.SPLIT_TRITON, compare_kron.SPLIT_LARGE)):
        assert rows, base
        for case, widths, proposals in rows:
            for fields in proposals:
                assert set(base) | set(fields) <= fields_allowed, (case, fields)
                cfg = compare_kron.split_config(base, fields)
                assert cfg.check(KernelShape(widths, 64, 2), 232448) is None, (case, fields)
            names = [compare_kron._name(f, base) for f in proposals]
            assert len(set(names)) == len(names), names  # each row's name tells it apart


def test_compare_kron_says_so_when_a_list_is_empty(tuning_cache, monkeypatch, capsys):
    """--phi-pass with PHI_PASS empty (between trials) exits 2 with one line naming the list,
    before any GPU work, rather than printing an empty table."""
    import os

    import compare_kron

    monkeypatch.setenv("RTCOMPILE_TUNED", os.environ["RTCOMPILE_TUNED"])  # untuned() changes it
    monkeypatch.setattr(compare_kron, "PHI_PASS", [])
    monkeypatch.setattr(sys, "argv", ["compare_kron.py", "--phi-pass"])
    assert compare_kron.main() == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("compare_kron: PHI_PASS list no proposals"), line


def test_the_comparisons_read_no_tuned_table(tuning_cache, monkeypatch):
    """compare_defaults / compare_kron / compare_loops time "the default": a tuned table in the
    cache they share with a tuner step of the same GPU session must not stand in for it (at
    0b9f90f compare_kron timed o3 16x16's tuned pick against itself as "the default")."""
    import json
    import os

    import compare_defaults
    from rtcompile.kernels import tuned
    from rtcompile.kernels.chunk_resident import ResidentConfig

    args = ("chunk", (2, 4), 8, 1, "float32", "cpu-interpreter")
    picked = ResidentConfig(16, 16, num_warps=2)
    path = tuned.table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": tuned.FORMAT_VERSION, "entries": [
        {**tuned.match_fields(*args), "batch": 1, "seq_len": 32, "variant": picked.to_dict(), "seconds": 1e-3}]}))
    tuned.reload()
    assert tuned.lookup(*args, 1, 32) == picked.to_dict()  # the table serves the call here
    monkeypatch.setenv("RTCOMPILE_TUNED", os.environ["RTCOMPILE_TUNED"])  # restored after the test
    compare_defaults.untuned()
    assert tuned.lookup(*args, 1, 32) is None and tuned.table_path() != path


def test_tpe_check_finds_a_pick_that_differs_from_the_swept_config_in_inert_fields_only(tmp_path):
    """The sweep holds one of each set of configs that differ in inert fields only; a TPE pick
    with phi_pass and key_group 2 is the swept key_group 1 config (before: no sweep time)."""
    import optuna

    from rtcompile.kernels.chunk_split import SplitConfig
    from rtcompile.tuning.space import config_params

    url = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="s", storage=url)
    for group, seconds in ((2, 2e-3), (1, 1e-3)):
        params = config_params(SplitConfig(64, 32, phi_pass=True, key_group=group, pipeline=2))
        dists = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()}
        dists["split.key_group"] = optuna.distributions.CategoricalDistribution([1, 2])
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=seconds))
    times = tpe_check._trial_times(url, "s")
    pick = SplitConfig(64, 32, phi_pass=True, key_group=2, pipeline=2)
    assert times == {pick.canonical(): 1e-3} and pick.canonical() in times


@pytest.mark.parametrize("parts, match", [("3", "allowed: a comma list of powers of two"),
                                          ("x", "allowed: a comma list of powers of two"),
                                          ("0,2", "allowed: a comma list of powers of two")],
                         ids=["not-a-power", "not-a-number", "zero"])
def test_profile_decode_refuses_bad_parts(parts, match, capsys):
    """--parts is checked before torch is imported or a GPU asked for: one usage line, exit 2."""
    import profile_decode

    with pytest.raises(SystemExit) as exc:
        profile_decode.main(["--parts", parts])
    assert exc.value.code == 2 and match in capsys.readouterr().err


def test_decode_key_split_matches_float64_and_its_check_can_fail(monkeypatch, capsys):
    """The key-split decode experiment's own check (interpreter: the 'last' join, orders 2-4,
    padding, two calls in a row) passes, and refuses a step whose state is off by 1e-4."""
    import decode_key_split as dks

    monkeypatch.setattr(dks, "check_cases", lambda dev: [((8, 8), 16, 4, 3), ((4, 4, 4), 32, 4, 2)])
    assert dks.main(["--check-only"]) == 0
    assert capsys.readouterr().out.count("check ") == 4
    right = dks.step64

    def off(*a):
        o, new = right(*a)
        return o, new * (1 + 1e-4)

    monkeypatch.setattr(dks, "step64", off)
    with pytest.raises(SystemExit, match="is wrong"):
        dks.main(["--check-only"])


def test_decode_key_split_refuses_bad_arguments(capsys):
    import decode_key_split as dks

    with pytest.raises(SystemExit) as e:
        dks.main(["--rounds", "0"])
    assert e.value.code == 2 and "--rounds: 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="join: 'both'; allowed: last, wait"):
        dks.decode_key_split(None, None, torch.zeros(1, 1, 1, 4), None, None, None, None, scale=1.0, l2norm=False,
                             block_k=4, num_warps=1, join="both")


@pytest.mark.parametrize("argv, match", [(["--widths", "3", "5"], "--widths: K = 15; allowed"),
                                         (["--batches", "0", "32"], "--batches: 0; allowed: integers >= 1")],
                         ids=["K-15", "batch-0"])
def test_decode_ceiling_refuses_bad_arguments(argv, match, capsys):
    import decode_ceiling

    with pytest.raises(SystemExit) as e:
        decode_ceiling.main(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_gpu_session_refuses_an_unknown_step_with_every_step_listed(tmp_path):
    """gpu_session.sh answers an unknown step with one line naming it and the steps it has (listed
    from its step functions), exit 2, before any step runs."""
    import subprocess

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_session.sh"
    run = subprocess.run(["bash", str(script), "owed_typo"], capture_output=True, text=True,
                         env={**os.environ, "OUT": str(tmp_path), "XDG_CACHE_HOME_RUN": str(tmp_path / "cache")})
    assert run.returncode == 2, run
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_session.sh: unknown step 'owed_typo' ("), run.stderr
    listed = lines[0].split("(", 1)[1].rstrip(")").split(", ")
    defined = re.findall(r"^step_(\w+)\(\)", script.read_text(), flags=re.M)
    assert sorted(listed) == sorted(defined) and {"owed", "retime", "serving"} <= set(listed), listed
    assert {p.name for p in tmp_path.iterdir()} <= {"cache"}  # no step's output (the run's cache folder only)
