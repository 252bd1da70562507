"""Configs that compute the same thing are tuned once: ``KernelConfig.canonical`` names the fields
other fields make inert, and the tuner's warm starts, neighbours, exhaustive sweep and workers
skip a config measured (or rejected) before, up to those fields."""

from __future__ import annotations

import dataclasses

import pytest

from rtcompile.kernels.chunk_resident import ResidentConfig
from rtcompile.kernels.chunk_split import SplitConfig
from rtcompile.kernels.config import KernelShape
from rtcompile.kernels.forms import default_config
from rtcompile.tuning import Bucket, TuneOptions
from rtcompile.tuning import study as study_mod
from rtcompile.tuning.keys import Machine, key_attrs
from rtcompile.tuning.space import config_params, exhaustive_variants, neighbours, search_space, warm_starts

O3_16 = KernelShape((16, 16), 64, 2)
H200_SMEM = 232448


@pytest.fixture(autouse=True)
def isolated(tuning_cache):
    """A private cache for every test (conftest's ``tuning_cache``)."""


@pytest.mark.parametrize("config, inert", [
    (SplitConfig(64, 32, phi_pass=True, key_group=2, tma=True), {"key_group": 1}),
    (SplitConfig(32, 64, loop="gluon", tma=True, key_group=2), {"tma": False}),
], ids=["phi-pass-key-group", "gluon-tma"])
def test_canonical_sets_the_inert_fields_only(config, inert):
    canonical = config.canonical()
    assert canonical == dataclasses.replace(config, **inert)
    assert canonical.canonical() == canonical
    assert config.check(O3_16, H200_SMEM) is None and canonical.check(O3_16, H200_SMEM) is None


@pytest.mark.parametrize("config", [
    SplitConfig(64, 32, key_group=2, tma=True),  # phi(K) stored by the prepare kernel: key_group counts
    SplitConfig(64, 32, phi_pass=True, tma=True),  # the Triton loop's tma counts
    ResidentConfig(16, 16),
], ids=["stored-phi", "triton-loop-tma", "resident"])
def test_canonical_keeps_fields_that_count(config):
    assert config.canonical() is config


def test_the_default_at_o3_16x16_is_canonical():
    """The phi_pass default carried key_group=2, which its kernels never read (a tuner warm
    start beside the same config with key_group=1 measured it twice)."""
    default = default_config("chunk", O3_16, H200_SMEM)
    assert default.phi_pass and default.canonical() == default


O3_BUCKET = Bucket("chunk", (16, 16), 64, 8, 8, 4096, "bfloat16")
# the split form with every field but phi_pass, key_group and tma fixed: 2 x 3 x 2 combinations,
# of which phi_pass=True makes key_group inert (8 distinct configs)
_SPLIT = dict(chunk_size=64, block_v=32, num_warps=4, num_stages=3, prepare_warps=1, solve="tiles",
              dot_precision="ieee", output_block_v=64, output_warps=4, state_stride=2, materialise=False,
              pipeline=2, wy=False, loop="triton", unroll_solve=False)


def _opts(**kw) -> TuneOptions:
    fixed = {"form": "split", **{f"split.{k}": v for k, v in _SPLIT.items()}}
    return TuneOptions(fixed=fixed, **kw)


def test_the_sweep_and_the_warm_starts_hold_no_two_configs_alike(monkeypatch):
    """Before: the sweep enqueued every phi_pass config three times (key groups 1, 2 and 4)."""
    from rtcompile.tuning import space

    monkeypatch.setattr(space, "smem_limit", lambda device: H200_SMEM)
    sweep = exhaustive_variants(O3_BUCKET, _opts(trials=None, exhaustive=True))
    assert len(sweep) == 8 and len({c.canonical() for c in sweep}) == 8
    assert {c.key_group for c in sweep if c.phi_pass} == {1}
    starts = warm_starts(O3_BUCKET, _opts(trials=8), 8)
    from rtcompile.tuning.space import params_config

    canon = [params_config(p).canonical() for p in starts]
    assert len(canon) == len(set(canon))
    # one field from a phi_pass config: key_group changes nothing there, so it is no neighbour
    base = config_params(SplitConfig(**_SPLIT, phi_pass=True, tma=True))
    found = neighbours(base, search_space(O3_BUCKET, _opts(trials=8)), O3_BUCKET, _opts(trials=8), 10)
    assert found and all(p["split.key_group"] == 1 for p in found)
    assert {p["split.phi_pass"] for p in found} == {True, False}


TINY = Bucket("chunk", (2, 4), 8, 1, 1, 32, "float32")


def _study(url: str, opts: TuneOptions):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    machine, source = Machine.current("cpu"), study_mod.tuned.source_hash("chunk")
    name = study_mod._study_name(TINY, machine, source, opts)
    study = optuna.create_study(study_name=name, storage=url)
    for k, v in key_attrs(TINY, machine, source).items():
        study.set_user_attr(k, v)
    return study, name


def _finished(study, space: dict, params: dict, status: str, value: float | None):
    """Add a finished trial of ``params`` with the distributions of ``space`` (a worker's draws'),
    as a worker's tell would have left it."""
    import optuna

    choices = {"form": list(space), **{f"{f}.{n}": c for f, fields in space.items() for n, c in fields.items()}}
    dists = {k: optuna.distributions.CategoricalDistribution(choices[k]) for k in params}
    state = optuna.trial.TrialState.COMPLETE if value is not None else optuna.trial.TrialState.FAIL
    study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=value, state=state,
                                              user_attrs={"status": status}))


def test_a_worker_does_not_run_a_config_again(tmp_path, monkeypatch):
    """A trial drawing the config of an earlier measured trial is a repeat: not run, told that
    trial's value (pruned, TPE would count the best config's fields as bad); one of a rejected
    config is pruned; a config whose trial failed (a timeout, a crash) runs again. Neither
    repeat counts as a trial run. Before: every draw ran (one config ten times in a 67-trial
    study at o3 64x64)."""
    import optuna

    url = f"sqlite:///{tmp_path / 'repeats.db'}"
    opts = TuneOptions(storage=url, trials=1, repeats=1, fixed={"form": "resident"})
    study, name = _study(url, opts)
    space = search_space(TINY, opts)
    base = warm_starts(TINY, opts, None)[0]
    measured, rejected, failed = base, *neighbours(base, space, TINY, opts, 2)
    _finished(study, space, measured, "ok", 1e-3)
    _finished(study, space, rejected, "rejected", None)
    _finished(study, space, failed, "failed", None)
    for params in (measured, rejected, failed):
        study.enqueue_trial(params)
    ran = []

    def objective(bucket, variant, opts, seed, runner=None):
        ran.append(variant)
        return {"status": "ok", "seconds": 2e-3}

    monkeypatch.setattr(study_mod, "run_objective", objective)
    monkeypatch.setattr(study_mod, "MAX_PRUNED_PER_TRIAL", 0)  # no replacement trials: the three alone
    study_mod.run_worker(url, name, TINY, opts, 0, None)
    from rtcompile.tuning.space import params_config

    assert ran == [params_config(failed).to_dict()]
    study = optuna.load_study(study_name=name, storage=url)
    repeats = [t for t in study.get_trials() if t.user_attrs.get("status") == "repeat"]
    assert [(t.state.name, t.value) for t in repeats] == [("COMPLETE", 1e-3), ("PRUNED", None)]
    assert [t.user_attrs["reason"] for t in repeats] == ["the config of trial 0", "the config of trial 1"]
    assert study_mod._finished(study) == 4  # the three added and the failed one's rerun


def test_a_repeat_is_found_up_to_inert_fields():
    """phi_pass with key groups 2 and 1 is one config: the second is the first's repeat."""
    import optuna

    from rtcompile.tuning.space import config_params

    study = optuna.create_study()
    first = config_params(SplitConfig(64, 32, phi_pass=True, key_group=2, state_stride=2, pipeline=2))
    dists = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in first.items()}
    study.add_trial(optuna.trial.create_trial(params=first, distributions=dists, value=1e-3,
                                              user_attrs={"status": "ok"}))
    same = SplitConfig(64, 32, phi_pass=True, key_group=1, state_stride=2, pipeline=2)
    finished = study_mod.FinishedConfigs()
    assert finished.earlier(study, same).number == 0
    assert finished.earlier(study, dataclasses.replace(same, phi_pass=False)) is None


def test_finished_configs_read_each_trial_once(monkeypatch):
    """Each draw reads only the trials finished since the last: the params of a study's trials
    are turned into configs once each, not once per draw; a trial added later is found."""
    import optuna

    from rtcompile.tuning.space import config_params

    study = optuna.create_study()

    def add(cfg, status="ok"):
        params = config_params(cfg)
        dists = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()}
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=1e-3,
                                                  user_attrs={"status": status}))

    a, b, c = (SplitConfig(64, 32, state_stride=s) for s in (1, 2, 4))
    add(a)
    add(b, status="failed")  # a failed trial's config may run again: never an earlier one
    reads = []
    real = study_mod.params_config
    monkeypatch.setattr(study_mod, "params_config", lambda p: reads.append(p) or real(p))
    finished = study_mod.FinishedConfigs()
    for _ in range(5):
        assert finished.earlier(study, a).number == 0 and finished.earlier(study, b) is None
    assert len(reads) == 1  # trial 0's config, once; the failed one is never read
    add(c)
    assert finished.earlier(study, c).number == 2 and len(reads) == 2


def test_trials_mode_replaces_a_repeat_and_seconds_mode_ends_on_repeats(tmp_path, monkeypatch):
    """A repeat costs no budget: in trials mode the worker enqueues a trial in its place (up to
    the pruned trials' cap); in seconds mode a worker whose draws are all repeats (a one-config
    sub-space measured before) ends after MAX_REPEATS_IN_A_ROW instead of drawing until the
    deadline (60 repeats in 5 s on a tiny space)."""
    import time

    import optuna

    from rtcompile.tuning.space import search_space as space_of

    fixed = {"form": "resident", **{f"resident.{n}": c[0] for n, c in space_of(TINY, TuneOptions())["resident"].items()}}
    url = f"sqlite:///{tmp_path / 'one.db'}"
    opts = TuneOptions(storage=url, trials=1, repeats=1, fixed=fixed)
    study, name = _study(url, opts)
    space = search_space(TINY, opts)
    [only] = [{"form": "resident", **{f"resident.{n}": c[0] for n, c in space["resident"].items()}}]
    _finished(study, space, only, "ok", 1e-3)
    study.enqueue_trial(only)
    monkeypatch.setattr(study_mod, "run_objective", lambda *a, **k: pytest.fail("a repeat ran"))
    monkeypatch.setattr(study_mod, "MAX_PRUNED_PER_TRIAL", 3)
    study_mod.run_worker(url, name, TINY, opts, 0, None)
    trials = optuna.load_study(study_name=name, storage=url).get_trials()
    assert [t.user_attrs.get("status") for t in trials] == ["ok", "repeat", "repeat", "repeat"]

    monkeypatch.setattr(study_mod, "MAX_REPEATS_IN_A_ROW", 5)
    seconds = TuneOptions(storage=url, trials=None, seconds=60, repeats=1, fixed=fixed)
    start = time.time()
    study_mod.run_worker(url, name, TINY, seconds, 0, time.time() + 60)
    assert time.time() - start < 30
    trials = optuna.load_study(study_name=name, storage=url).get_trials()
    assert [t.user_attrs.get("status") for t in trials[4:]] == ["repeat"] * 5
