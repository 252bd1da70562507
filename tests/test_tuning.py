"""The autotuner on the CPU: correctness gate, exact budgets with several workers, crash and
resume, reload without tuning, and store errors. Trials run the Triton interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from rtcompile.cli import main
from rtcompile.kernels import tuned
from rtcompile.kernels.inputs import check_inputs
from rtcompile.kernels.chunk_resident import ResidentConfig
from rtcompile.kernels.config import KernelShape
from rtcompile.kernels.forms import FORMS, KERNELS, default_config, low_memory
from rtcompile.kernels.launch import resolve_config
from rtcompile.tuning import Bucket, StoreError, TuneOptions, open_storage, search_space, tune_bucket
from rtcompile.tuning.space import config_params, params_config
from rtcompile.tuning.store import retried_numbers

TINY = Bucket("chunk", (2, 4), 8, 1, 1, 32, "float32")
TINY_SHAPE = KernelShape(TINY.key_widths, TINY.value_width, 4)


@pytest.fixture(autouse=True)
def isolated(tuning_cache):
    """A private cache for every test (conftest's ``tuning_cache``)."""


def _trials(url, bucket=TINY):
    import optuna

    storage = open_storage(url)
    (summary,) = [s for s in optuna.get_all_study_summaries(storage, False) if bucket.label in s.study_name]
    return optuna.load_study(study_name=summary.study_name, storage=storage).get_trials(deepcopy=False)


def test_planted_wrong_variant_is_never_selected(tmp_path):
    url = f"sqlite:///{tmp_path / 'planted.db'}"
    # an exhaustive sweep of the sub-space of two configs, the default and its fused sibling (every
    # field of both forms fixed), so the planted config is certain to run: a TPE study of six
    # trials over the whole space (two workers, so the draws depend on their interleaving)
    # missed it in one CI run of 2026-11-30
    default, fused = default_config("chunk", TINY_SHAPE), low_memory(TINY_SHAPE)
    fixed = {k: v for cfg in (default, fused) for k, v in config_params(cfg).items() if k != "form"}
    r = tune_bucket(TINY, TuneOptions(storage=url, trials=None, exhaustive=True, workers=2, repeats=2,
                                      impl="tuning_impls:planted_wrong", fixed=fixed))
    trials = _trials(url)
    assert sorted(t.params["form"] for t in trials) == ["fused", "resident"]
    rejected = [t for t in trials if t.user_attrs.get("status") == "rejected"]
    assert rejected, "the planted config was never tried: the test proves nothing"
    assert all(t.params["form"] == "fused" for t in rejected)
    assert all("against float64" in t.user_attrs["reason"] for t in rejected)
    assert r.best_variant == default.to_dict()
    (entry,) = tuned.entries()
    assert entry["variant"] == default.to_dict()


def test_two_workers_run_exactly_the_budget_then_reload_runs_none(tmp_path):
    url = f"sqlite:///{tmp_path / 'fresh.db'}"  # does not exist yet: both workers open it
    r = tune_bucket(TINY, TuneOptions(storage=url, trials=5, workers=2, repeats=2))
    trials = _trials(url)
    ran = [t for t in trials if t.state.name != "PRUNED"]  # pruned ones compile nothing: not budget
    assert len(ran) == 5 and r.trials_run == 5
    assert len({t.number for t in trials}) == len(trials)
    assert all(t.state.name in ("COMPLETE", "PRUNED", "FAIL") for t in trials)
    # each timed trial says how it was timed (off the GPU: the wall clock)
    assert all(t.user_attrs.get("timing") == "wall" for t in trials if t.state.name == "COMPLETE")
    assert r.best_variant is not None and r.best_seconds > 0 and r.default_seconds > 0
    # the budget's first trial is the default variant (warm start 0; a budget of 5 leaves room
    # for one candidate, a quarter at most, and one neighbour of it, half at most); TPE picks the rest
    starts = sorted((t for t in trials if "warm_start" in t.user_attrs), key=lambda t: t.user_attrs["warm_start"])
    assert [t.user_attrs["warm_start"] for t in starts] == [0, 1]
    default = default_config("chunk", TINY_SHAPE)
    assert starts[0].params == config_params(default) and starts[0].state.name == "COMPLETE"
    assert sum(starts[1].params[k] != v for k, v in starts[0].params.items()) == 1
    # every trial asked the form, then that form's fields only
    for t in trials:
        form = t.params["form"]
        assert set(t.params) == {"form", *(f"{form}.{n}" for n in FORMS[form].space(TINY_SHAPE))}, t.params
    again = tune_bucket(TINY, TuneOptions(storage=url, trials=5, workers=2))
    assert again.already_tuned and again.trials_run == 0 and len(_trials(url)) == len(trials)


def test_pruned_trials_are_replaced_until_the_budget_has_run(tmp_path):
    # C 128 with the product solve is refused (it needs C <= 64): with the resident form held there
    # and the form and the fused chunk size left to the sampler, every resident draw is pruned,
    # and each must give its slot back. Seed 0: both workers' TPE streams draw the resident form
    # early (9 pruned in each of 4 runs); the default seed's streams, since the solve space grew a
    # value, reached it in 2 of 4 runs, and a run without a pruned trial tests nothing
    url = f"sqlite:///{tmp_path / 'pruned.db'}"
    r = tune_bucket(TINY, TuneOptions(storage=url, trials=4, workers=2, repeats=2, seed=0,
                                      fixed={"resident.chunk_size": 128, "resident.solve": "products"}))
    trials = _trials(url)
    pruned = [t for t in trials if t.state.name == "PRUNED"]
    assert pruned, "no trial was pruned: the replacement was not exercised"
    # each pruned trial's reason is its own config's refusal
    assert all(t.user_attrs["reason"] == params_config(t.params).check(TINY_SHAPE) for t in pruned)
    # the budget ran: four trials timed (a repeat of an earlier config is told its value, COMPLETE,
    # and gives its slot back too)
    timed = [t for t in trials if t.user_attrs.get("status") not in ("pruned", "repeat")]
    assert len(timed) == 4 and r.trials_run == 4


def test_an_all_refused_space_stops_at_the_prune_cap(tmp_path):
    from rtcompile.tuning.study import MAX_PRUNED_PER_TRIAL

    url = f"sqlite:///{tmp_path / 'refused.db'}"
    refused = {"form": "resident", "resident.chunk_size": 128, "resident.solve": "tiles"}
    r = tune_bucket(TINY, TuneOptions(storage=url, trials=2, workers=2, repeats=2, fixed=refused))
    trials = _trials(url)
    assert r.trials_run == 0 and all(t.state.name == "PRUNED" for t in trials)
    assert r.best_variant == default_config("chunk", TINY_SHAPE).to_dict()  # the default, timed at the finish
    assert 2 * MAX_PRUNED_PER_TRIAL <= len(trials) <= 2 * MAX_PRUNED_PER_TRIAL + 2  # + the claims in flight
    # the launcher now takes the tuned variant for this bucket (and a nearby shape) by itself
    q = [torch.randn(1, 20, 1, w) for w in (2, 4)]
    k = [torch.randn(1, 20, 1, w) for w in (2, 4)]
    p = check_inputs(q, k, torch.randn(1, 20, 1, 8), None, None, None, None, None)
    chosen = resolve_config("chunk", None, p, torch.device("cpu"))
    assert chosen.to_dict() == r.best_variant


def test_killed_study_resumes_and_keeps_finished_trials(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'killed.db'}"
    started = tmp_path / "started.log"
    monkeypatch.setenv("RTCOMPILE_TEST_STARTED", str(started))
    spec = tmp_path / "tiny.toml"
    spec.write_text('order = 3\nkey_widths = [2, 4]\nvalue_width = 8\nheads = 1\nmodel_width = 16\n'
                    'input_dtype = "float32"\n')
    # refused variants included: a pruned trial's instant claim-and-release may be where the
    # kill lands, and the resume must still find every orphan (see the next test)
    fixes = ["--fix", "resident.chunk_size=16"]
    argv = [str(spec), "--phase", "prefill", "--trials", "4", "--workers", "1", "--storage", url, *fixes,
            "--impl", "tuning_impls:slow"]
    proc = subprocess.Popen([sys.executable, "-m", "rtcompile.cli", "tune", *argv], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    finished = []
    while time.time() < deadline and proc.poll() is None:
        try:
            finished = [t for t in _trials(url) if t.state.name == "COMPLETE"]
        except (ValueError, StoreError):
            finished = []
        # the kill lands inside a call of the 1 s kernel that began under 0.5 s ago, so inside a
        # timed trial. A RUNNING trial alone was not enough: a refused draw stays RUNNING while
        # TPE samples it (0.1 s under two test workers), and a kill aimed at one found nothing
        # left to mark stale (2026-11-30)
        starts = started.read_text().split() if started.exists() else []
        if finished and starts and time.time() - float(starts[-1]) < 0.5:
            break
        time.sleep(0.05)
    assert proc.poll() is None and finished, "the study finished (or never started) before the kill"
    os.killpg(proc.pid, signal.SIGKILL)  # coordinator, worker and trial process at once
    proc.wait()
    kept = {t.number: t.value for t in _trials(url) if t.state.name == "COMPLETE"}
    assert main(["tune", *argv[:-2], "--resume"]) == 0
    trials = _trials(url)
    # the killed trial's heartbeat lapsed: Optuna failed it and the resume ran its retry
    stale = [t for t in trials if t.number in retried_numbers(trials)]
    counted = [t for t in trials if t not in stale and t.user_attrs.get("status") != "pruned"]
    assert len(stale) == 1 and stale[0].state.name == "FAIL" and len(counted) == 4
    assert all(t.state.name in ("COMPLETE", "PRUNED", "FAIL") for t in counted)
    assert all({t.number: t.value for t in trials}[n] == v for n, v in kept.items())
    assert tuned.entries(), "the resumed study recorded no winner"



@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_a_trial_whose_worker_died_is_failed_and_retried(tmp_path, monkeypatch, kind):
    """SQLite (any RDB storage): Optuna's heartbeats; a claimed trial whose worker stops beating
    is failed after the grace period and retried with its parameters, while a beating one is
    left alone. Journal (no heartbeats in Optuna 5.0): a trial RUNNING for over twice the trial
    timeout is stale."""
    import optuna

    from rtcompile.tuning import store
    from rtcompile.tuning.claims import Heartbeat, claim, mark_stale, stale_numbers, trial_id

    monkeypatch.setattr(store, "HEARTBEAT_S", 1)
    monkeypatch.setattr(store, "GRACE_S", 2)
    url = f"sqlite:///{tmp_path / 'o.db'}" if kind == "sqlite" else f"journal:{tmp_path / 'o.log'}"
    storage = open_storage(url)
    study = optuna.create_study(study_name="s", storage=storage)
    study.enqueue_trial({"x": 1})
    study.enqueue_trial({"x": 2})
    live = claim(study, storage, url)
    dead = claim(study, storage, url)  # its worker "dies": no heartbeat after the claim
    assert live.user_attrs["pid"] == os.getpid() and claim(study, storage, url) is None
    dead.suggest_categorical("x", [1, 2])
    beat = Heartbeat(storage, trial_id(storage, study, live.number)).start()
    try:
        assert mark_stale(study, storage, timeout=300) == 0  # nothing is stale yet
        time.sleep(3.5)  # past the 2 s grace (SQLite's clock has 1 s steps)
        n = mark_stale(study, storage, timeout=300 if kind == "sqlite" else 1.0)
    finally:
        beat.stop()
    trials = study.get_trials(deepcopy=False)
    states = {t.number: t.state.name for t in trials}
    if kind == "sqlite":
        assert n == 1 and states[dead.number] == "FAIL" and states[live.number] == "RUNNING"
    else:  # by age alone: both are over 2 x 1 s old
        assert n == 2 and states[dead.number] == "FAIL" and states[live.number] == "FAIL"
    assert dead.number in stale_numbers(study)
    (retry,) = [t for t in trials if t.state.name == "WAITING" and t.params == {"x": dead.params["x"]}]
    assert retry.number > dead.number


def test_journal_storage(tmp_path):
    url = f"journal:{tmp_path / 'journal.log'}"
    r = tune_bucket(Bucket("recurrent", (2, 4), 8, 1, 2, 1, "float32"),
                    TuneOptions(storage=url, trials=3, workers=2, repeats=2))
    assert r.trials_run == 3 and r.best_variant is not None


@pytest.mark.parametrize("content", [b"garbage, not a database", b""], ids=["garbage", "empty-dir"])
def test_corrupted_store_is_a_clear_error(tmp_path, capsys, content):
    db = tmp_path / "bad.db"
    if content:
        db.write_bytes(content)
    else:
        db.mkdir()  # a directory where the database file should be
    assert main(["tune", "--list", "--storage", f"sqlite:///{db}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "storage" in err[0] and "Traceback" not in err[0]


def test_corrupted_tuned_table_is_a_clear_error(tmp_path):
    path = tmp_path / "cache" / "tuned.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="tuned-config table .* unreadable"):
        tuned.reload(path)
    path.write_text(json.dumps({"format": 99, "entries": []}))
    with pytest.raises(ValueError, match=f"not a format-{tuned.FORMAT_VERSION} table"):
        tuned.reload(path)
    path.unlink()


def _postgres_url() -> str:
    url = os.environ.get("RTCOMPILE_TEST_POSTGRES")
    if not url:
        if os.environ.get("CI"):
            pytest.fail("CI must provide RTCOMPILE_TEST_POSTGRES (.ci/run starts PostgreSQL)")
        pytest.skip("set RTCOMPILE_TEST_POSTGRES=postgresql://... to run against a real server")
    return url


def test_postgresql_two_workers(tmp_path):
    url = _postgres_url()
    bucket = Bucket("chunk", (2, 4), 8, 1, 1, 16, "float32")
    r = tune_bucket(bucket, TuneOptions(storage=url, trials=4, workers=2, repeats=2, retune=True))
    trials = _trials(url, bucket)
    ran = [t for t in trials if t.state.name != "PRUNED"]  # pruned ones give their slot back
    assert r.trials_run == 4 and len(ran) == 4 and len({t.number for t in trials}) == len(trials)


def test_cli_usage_errors(capsys):
    assert main(["tune"]) == 2
    assert main(["tune", "x.toml", "--trials", "0"]) == 2
    assert main(["tune", "x.toml", "--trials", "3", "--seconds", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("rtcompile") for line in lines)
    # a bad --fix on the CPU: the one error line, not the no-GPU notice before it
    spec = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "order2_matrix.toml")
    assert main(["tune", spec, "--fix", "split.no_such_field=1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no_such_field" in lines[0], lines


def test_concurrent_creation_of_a_fresh_sqlite_store(tmp_path):
    """Several processes opening one new SQLite file at once all succeed (Optuna's schema
    creation races without the store's lock)."""
    url = f"sqlite:///{tmp_path / 'race.db'}"
    code = ("import sys; from rtcompile.tuning import open_storage; import optuna; "
            f"s = open_storage({url!r}); optuna.create_study(storage=s, study_name='p' + sys.argv[1])")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], stderr=subprocess.PIPE, text=True) for i in range(6)]
    errors = [p.communicate()[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    import optuna

    names = {s.study_name for s in optuna.get_all_study_summaries(open_storage(url), False)}
    assert names == {f"p{i}" for i in range(6)}


def test_workers_spread_over_visible_gpus(monkeypatch):
    from rtcompile.tuning.processes import visible_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert visible_gpus("cuda") == ["0", "1"] and visible_gpus("cpu") == []


_CLAIMER = """
import json, sys, time
import optuna
from rtcompile.tuning.store import open_storage
from rtcompile.tuning.claims import claim
optuna.logging.set_verbosity(optuna.logging.WARNING)
url, name, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
storage = open_storage(url)
study = optuna.load_study(study_name=name, storage=storage)
while time.time() < start:
    time.sleep(0.001)
got = []
while (t := claim(study, storage, url)) is not None:
    got.append(t.number)
print(json.dumps(got))
"""


@pytest.mark.parametrize("store", ["sqlite", "journal", "postgresql"])
def test_concurrent_claims_never_hand_one_trial_to_two_workers(tmp_path, store):
    import optuna

    url = {"sqlite": f"sqlite:///{tmp_path / 'claims.db'}", "journal": f"journal:{tmp_path / 'claims.log'}",
           "postgresql": None}[store] or _postgres_url()
    name = f"claims-{tmp_path.name}-{os.getpid()}"
    study = optuna.create_study(study_name=name, storage=open_storage(url))
    for _ in range(60):
        study.enqueue_trial({})
    start = time.time() + 3  # all four claimers start together, after their imports
    procs = [subprocess.Popen([sys.executable, "-c", _CLAIMER, url, name, str(start)], stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    claimed = [n for p in procs for n in json.loads(p.communicate(timeout=120)[0])]
    assert sorted(claimed) == list(range(60)), "a trial was claimed twice (or never)"


def test_timed_sections_of_parallel_workers_never_overlap(tmp_path, monkeypatch):
    log = tmp_path / "intervals.txt"
    monkeypatch.setenv("RTCOMPILE_TEST_INTERVALS", str(log))
    url = f"sqlite:///{tmp_path / 'lock.db'}"
    tune_bucket(TINY, TuneOptions(storage=url, trials=4, workers=2, repeats=3, impl="tuning_impls:interval_log"))
    rows = sorted((float(a), float(b), int(p)) for p, a, b in (ln.split() for ln in log.read_text().splitlines()))
    assert len({p for _, _, p in rows}) >= 2, "the timed calls came from one process: nothing was tested"
    for (a0, a1, pa), (b0, b1, pb) in zip(rows, rows[1:]):
        assert pa == pb or b0 >= a1, "two trials timed on one device at the same time"


def _valid_configs(space: dict) -> list:
    """Every valid config of a form -> field -> choices space, by brute force."""
    import itertools

    out = []
    for form, fields in space.items():
        for values in itertools.product(*fields.values()):
            cfg = FORMS[form](**dict(zip(fields, values)))
            if cfg.check(TINY_SHAPE) is None:
                out.append(cfg)
    return out


def test_exhaustive_sweep_runs_each_valid_config_of_every_form_once_in_its_own_study(tmp_path):
    from rtcompile.tuning.space import exhaustive_variants

    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    fixed = {"resident.chunk_size": 16, "resident.num_stages": 1, "resident.dot_precision": "ieee",
             "resident.wy": False, "resident.prepare_warps": 4, "resident.solve": "rows", "resident.materialise": False,
             "fused.chunk_size": 16, "fused.num_stages": 1, "fused.solve": "rows"}
    opts = TuneOptions(storage=url, workers=2, repeats=2, fixed=fixed, exhaustive=True)
    expected = exhaustive_variants(TINY, opts)
    # the forms that can run K = 8 (streamed needs K > 16, split widths >= 16), num_warps 2/4/8 each
    assert list(search_space(TINY, opts)) == ["resident", "fused"]
    assert len(expected) == 6 and {c.form for c in expected} == {"resident", "fused"}
    assert sorted(map(repr, expected)) == sorted(map(repr, _valid_configs(search_space(TINY, opts))))
    r = tune_bucket(TINY, opts)
    import optuna

    storage = open_storage(url)
    (name,) = [s.study_name for s in optuna.get_all_study_summaries(storage, False)]
    assert name.endswith(":exhaustive") and "fixed fused.chunk_size=16" in name
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    seen = [params_config(t.params) for t in trials]
    assert r.trials_run == 6 and sorted(map(repr, seen)) == sorted(map(repr, expected))
    # the winner is re-measured against the default, which may lie outside the sub-space
    default = default_config("chunk", TINY_SHAPE)
    assert FORMS[r.best_variant["form"]].from_dict(r.best_variant) in [*expected, default]
    again = tune_bucket(TINY, opts)
    assert again.already_tuned and again.trials_run == 0


def test_cli_fix_errors_name_the_parameter(tmp_path, capsys):
    spec = tmp_path / "tiny.toml"
    spec.write_text('order = 3\nkey_widths = [2, 4]\nvalue_width = 8\nheads = 1\nmodel_width = 16\n')
    url = f"sqlite:///{tmp_path / 'never.db'}"
    for fix in ("chunk_size=16", "resident.blocksize=16", "resident.chunk_size=24", "chunk_size", "form=split",
                "form=recurrent", "split.chunk_size=16"):
        assert main(["tune", str(spec), "--phase", "prefill", "--storage", url, "--fix", fix]) == 2, fix
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("rtcompile")]
    assert len(errors) == 7
    assert "'chunk_size'" in errors[0] and "form=NAME or FORM.FIELD=VALUE" in errors[0] and "resident, fused" in errors[0]
    assert "'resident.blocksize'" in errors[1] and "chunk_size, block_v, num_warps" in errors[1]
    assert "resident.chunk_size=24" in errors[2] and "16, 32, 64, 128" in errors[2]
    assert "NAME=VALUE" in errors[3]
    assert "form='split' cannot run this shape" in errors[4] and "resident, fused" in errors[4]
    assert "not a form of the chunk kernel" in errors[5]
    assert "split.chunk_size" in errors[6] and "cannot run this shape" in errors[6]
    assert not (tmp_path / "never.db").exists(), "the store was created before the input was checked"


def test_warm_starts_add_the_defaults_one_field_neighbours_up_to_half_the_budget():
    """With a budget, the candidates (a quarter at most) are followed by configs one field away
    from the default, valid and runnable here (the Gluon loop is not, on the CPU), none repeated,
    in an order the study's seed fixes; without a budget (seconds mode) the candidates alone."""
    from rtcompile.kernels.chunk_split import SplitConfig
    from rtcompile.tuning.space import warm_starts

    bucket = Bucket("chunk", (64,), 64, 1, 1, 64, "bfloat16")
    fixed = {"form": "split", "split.chunk_size": 32, "split.block_v": 64, "split.num_warps": 4,
             "split.num_stages": 3, "split.prepare_warps": 2, "split.solve": "tiles", "split.dot_precision": "ieee",
             "split.output_block_v": 64, "split.output_warps": 4, "split.tma": True, "split.key_group": 1,
             "split.materialise": False}
    shape = KernelShape((64,), 64, 2)
    alone = warm_starts(bucket, TuneOptions(fixed=fixed), None)
    for budget in (4, 10, 40):
        got = warm_starts(bucket, TuneOptions(fixed=fixed), budget)
        head = alone[: max(1, budget // 4)]
        assert got[: len(head)] == head and len(got) <= max(len(head), budget // 2)
        extra = got[len(head):]
        assert extra and len({tuple(sorted(p.items())) for p in got}) == len(got)
        for params in extra:
            assert sum(params[k] != v for k, v in got[0].items()) == 1, params
            cfg = params_config(params)
            assert isinstance(cfg, SplitConfig) and cfg.loop == "triton" and cfg.check(shape) is None
        assert warm_starts(bucket, TuneOptions(fixed=fixed), budget) == got  # seeded order
    assert len(warm_starts(bucket, TuneOptions(fixed=fixed), 40)) > len(alone)  # the neighbours fit beside them


def test_cli_refuses_a_fixed_sub_space_the_device_cannot_run(tmp_path, capsys):
    """--fix split.loop=gluon off sm_90 (here the CPU): one line naming the field and what it
    needs, exit 2, no store; with the loop free the same sub-space is accepted (its device check
    only: the study is not run here)."""
    from rtcompile.tuning import device_refusal_of_space

    spec = tmp_path / "o2.toml"
    spec.write_text('order = 2\nkey_widths = [64]\nvalue_width = 64\nheads = 1\nmodel_width = 64\n'
                    'input_dtype = "bfloat16"\n')
    url = f"sqlite:///{tmp_path / 'never.db'}"
    assert main(["tune", str(spec), "--phase", "prefill", "--storage", url, "--fix", "form=split",
                 "--fix", "split.loop=gluon"]) == 2
    errors = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.startswith("rtcompile")]
    assert len(errors) == 1
    assert "no config of the fixed sub-space runs" in errors[0] and "loop='gluon' needs an sm_90 GPU" in errors[0]
    assert not (tmp_path / "never.db").exists()
    bucket = Bucket("chunk", (64,), 64, 1, 1, 64, "bfloat16")
    assert device_refusal_of_space(bucket, TuneOptions(fixed={"form": "split"})) is None
    assert "sm_90" in device_refusal_of_space(bucket, TuneOptions(fixed={"split.loop": "gluon", "form": "split"}))


def test_fixed_form_holds_the_search_to_that_form():
    opts = TuneOptions(fixed={"form": "fused", "fused.solve": "rows"})
    space = search_space(TINY, opts)
    assert list(space) == ["fused"] and space["fused"]["solve"] == ["rows"]
    with pytest.raises(ValueError, match="the form is fixed to 'fused'; allowed forms: fused"):
        search_space(TINY, TuneOptions(fixed={"form": "fused", "resident.chunk_size": 16}))
    with pytest.raises(ValueError, match="allowed forms for the recurrent kernel .*: recurrent"):
        search_space(Bucket("recurrent", (2, 4), 8, 1, 2, 1, "float32"), TuneOptions(fixed={"form": "fused"}))


def test_kernel_seconds_off_the_gpu_is_the_wall_clock_median():
    from rtcompile.timing import kernel_seconds

    calls = []
    seconds, method = kernel_seconds(lambda: calls.append(time.perf_counter()), "cpu", repeats=7)
    assert method == "wall" and len(calls) == 7 and 0 <= seconds < 0.01


def _request(variant, impl: str) -> dict:
    from dataclasses import asdict

    return {"bucket": asdict(TINY), "variant": variant.to_dict(), "device": "cpu", "seed": 3, "check_seed": 1,
            "repeats": 1, "impl": impl}


C16 = ResidentConfig(chunk_size=16, block_v=16)
C32 = ResidentConfig(chunk_size=32, block_v=16)


@pytest.mark.parametrize("impl, reason", [("tuning_impls:hang_at_c32", "timeout after"),
                                          ("tuning_impls:crash_at_c32", "trial process exited 3")],
                         ids=["hang", "crash"])
def test_a_hung_or_crashed_trial_fails_alone_and_the_next_gets_a_fresh_process(impl, reason):
    from rtcompile.tuning.study import TrialRunner

    with TrialRunner(timeout=60 if "crash" in impl else 20) as runner:
        first = runner.evaluate(_request(C16, impl))
        assert first["status"] == "ok", first
        bad = runner.evaluate(_request(C32, impl))
        assert bad["status"] == "failed" and reason in bad["reason"], bad
        assert runner._proc is None  # killed or reaped: nothing left behind
        again = runner.evaluate(_request(C16, impl))
        assert again["status"] == "ok", again


def test_one_trial_process_serves_a_workers_trials():
    from rtcompile.tuning.study import TrialRunner

    results, pids = [], []
    with TrialRunner(timeout=120) as runner:
        for v in (C16, C32, C16):
            results.append(runner.evaluate(_request(v, "tuning_impls:pid_tagged")))
            pids.append(runner._proc.pid)
    assert [r["status"] for r in results] == ["ok"] * 3  # the printed pid lines are not results
    assert len(set(pids)) == 1  # one process for all three
    assert results[0]["error"] == results[2]["error"]  # the same check inputs, kept between trials


class _Recorder:
    """A trial that answers each suggestion from ``answers`` (else the first choice) and records
    what was asked."""

    def __init__(self, answers):
        self.answers, self.asked = answers, []

    def suggest_categorical(self, name, choices):
        self.asked.append(name)
        return self.answers.get(name, choices[0])


def test_the_sampler_asks_the_form_then_only_that_forms_fields():
    """Form first, then the chosen form's fields (FORM.FIELD) and nothing of the other forms."""
    from rtcompile.tuning.space import suggest

    bucket = Bucket("chunk", (16, 16), 64, 1, 1, 64, "bfloat16")  # K 256: every chunk form can run
    space = search_space(bucket, TuneOptions())
    assert list(space) == [cls.form for cls in KERNELS["chunk"]]
    for form in space:
        trial = _Recorder({"form": form})
        cfg = suggest(trial, space)
        assert trial.asked == ["form", *(f"{form}.{n}" for n in space[form])]
        assert isinstance(cfg, FORMS[form]) and config_params(cfg) == {
            "form": form, **{f"{form}.{n}": c[0] for n, c in space[form].items()}}
    # a real TPE study over the conditional space: each trial's parameters are its form's only
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=8))
    forms_seen = set()
    for _ in range(24):
        trial = study.ask()
        cfg = suggest(trial, space)
        form = trial.params["form"]
        forms_seen.add(form)
        assert set(trial.params) == {"form", *(f"{form}.{n}" for n in space[form])}
        assert params_config(trial.params) == cfg
        study.tell(trial, float(cfg.chunk_size))
    assert len(forms_seen) >= 2


@pytest.mark.parametrize("where", ["missing-folder", "missing-file", "missing-journal"])
def test_list_never_creates_a_store(where, tmp_path, capsys):
    # `tune --list --storage sqlite:////nonexistent_dir/x.db` reported an empty store and
    # created the folder and its database file.
    missing = tmp_path / "nonexistent_dir"
    path = missing / "x.db" if where == "missing-folder" else tmp_path / "x.db"
    url = f"journal:{path}" if where == "missing-journal" else f"sqlite:///{path}"
    assert main(["tune", "--list", "--storage", url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "Traceback" not in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no file, folder or lock file


def test_tune_into_a_missing_folder_is_refused(tmp_path, capsys):
    spec = tmp_path / "s.toml"
    spec.write_text('order = 2\nkey_widths = [4]\nvalue_width = 4\nheads = 1\nmodel_width = 8\n')
    path = tmp_path / "nonexistent_dir" / "x.db"
    assert main(["tune", str(spec), "--storage", f"sqlite:///{path}", "--trials", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path.parent) in err[0] and "does not exist" in err[0], err
    assert not path.parent.exists()


def test_list_of_the_default_store_before_any_tuning_creates_nothing(tuning_cache, capsys):
    from rtcompile.tuning.store import store_file

    assert not store_file(None).exists()  # tuning_cache: a private, empty cache
    assert main(["tune", "--list"]) == 0
    assert "no rtcompile studies" in capsys.readouterr().err
    assert not store_file(None).exists()


def test_device_lock_shares_between_trainings_and_excludes_a_timing(tmp_path, monkeypatch):
    """Shared holders (the explorer's recall training) hold the device together; an exclusive
    holder (a timing) waits until every shared one has left, and a shared one waits for it."""
    import threading

    from rtcompile.tuning import store

    monkeypatch.setattr(tuned, "cache_dir", lambda: tmp_path)
    events = []

    def hold(shared, started, release):
        with store.device_lock("cpu", shared=shared):
            events.append(("in", shared))
            started.set()
            release.wait(10)
        events.append(("out", shared))

    def thread(shared):
        started, release = threading.Event(), threading.Event()
        t = threading.Thread(target=hold, args=(shared, started, release))
        t.start()
        return t, started, release

    a, a_in, a_go = thread(True)
    assert a_in.wait(5)
    b, b_in, b_go = thread(True)
    assert b_in.wait(5), "a second shared holder waited for the first"
    c, c_in, c_go = thread(False)
    assert not c_in.wait(0.3), "the exclusive holder entered beside shared ones"
    a_go.set()
    a.join(5)
    assert not c_in.wait(0.3), "the exclusive holder entered beside the remaining shared one"
    b_go.set()
    b.join(5)
    assert c_in.wait(5)
    assert store.HELD_DEVICE == "cpu"  # the exclusive holder says so; shared ones do not
    d, d_in, d_go = thread(True)
    assert not d_in.wait(0.3), "a shared holder entered beside the exclusive one"
    c_go.set()
    c.join(5)
    assert d_in.wait(5)
    d_go.set()
    d.join(5)
    assert [e for e in events if e[0] == "in"] == [("in", True), ("in", True), ("in", False), ("in", True)]


def test_the_sweep_leaves_out_configs_the_device_cannot_run():
    """The split form's Gluon state loop passes its own check anywhere Gluon imports, but runs on
    sm_90 only: off it (here the CPU) the exhaustive sweep never enqueues it, and a TPE trial that
    draws it is pruned with the reason, never run."""
    from rtcompile.kernels.chunk_split import SplitConfig
    from rtcompile.tuning.space import device_refusal, exhaustive_variants

    bucket = Bucket("chunk", (64,), 64, 1, 1, 64, "bfloat16")
    fixed = {"form": "split", "split.chunk_size": 32, "split.block_v": 64, "split.num_warps": 4,
             "split.num_stages": 2, "split.prepare_warps": 1, "split.solve": "tiles", "split.dot_precision": "ieee",
             "split.output_block_v": 64, "split.output_warps": 4, "split.tma": True, "split.key_group": 1,
             "split.materialise": False, "split.wy": False, "split.pipeline": 1, "split.phi_pass": False,
             "split.unroll_solve": False}
    gluon = SplitConfig(32, 64, loop="gluon")
    assert "sm_90" in device_refusal(gluon, "cpu") and device_refusal(SplitConfig(32, 64), "cpu") is None
    found = exhaustive_variants(bucket, TuneOptions(fixed=fixed))
    assert found and {c.loop for c in found} == {"triton"}  # three state strides, the Triton loop only
    assert len(found) == 3


@pytest.mark.parametrize("fixed, inside", [
    ({}, True),
    ({"form": "resident"}, True),
    ({"form": "split"}, False),
    ({"resident.chunk_size": 16}, True),
    ({"resident.chunk_size": 32}, False),
    ({"split.loop": "gluon"}, True),  # a field of another form does not constrain this one
    ({"form": "resident", "resident.wy": True}, False),
], ids=["none", "its-form", "other-form", "its-field", "other-value", "other-forms-field", "form-and-field"])
def test_in_subspace_reads_a_fix_as_tune_applies_it(fixed, inside):
    """``tune --fix``'s sub-space membership, which the result table uses to say when the
    winner is the default from outside it."""
    from rtcompile.tuning.space import in_subspace

    cfg = ResidentConfig(chunk_size=16, block_v=16, wy=False)
    assert in_subspace(cfg, fixed) is inside


def test_the_correctness_gate_rejects_an_unwritten_output_element():
    """The checked call runs with poisoned allocations (kernels.args.poisoned): one element a
    config never writes is NaN there and the config is rejected, whatever its memory held; the
    real kernel through the same path passes, and the hooks are restored after the check."""
    from rtcompile.kernels import args
    from rtcompile.tuning.objective import evaluate

    hooks = (args.empty, args.empty_like)
    ok = evaluate(_request(C16, "rtcompile.tuning.objective:run_kernel"))
    assert ok["status"] == "ok" and ok["error"] < 1e-5, ok
    bad = evaluate(_request(C16, "tuning_impls:planted_unwritten"))
    assert bad["status"] == "rejected" and "against float64" in bad["reason"], bad
    assert (args.empty, args.empty_like) == hooks
