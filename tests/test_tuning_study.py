"""A study's key and its winner: a changed search space is a new study, and the winner is a
config today's checks accept (the study's own measurements may predate them)."""

from __future__ import annotations

import pytest

from rtcompile.kernels import tuned
from rtcompile.tuning import Bucket, TuneOptions, search_space
from rtcompile.tuning import study as study_mod
from rtcompile.tuning.keys import Machine

TINY = Bucket("chunk", (2, 4), 8, 1, 1, 32, "float32")


@pytest.fixture(autouse=True)
def isolated(tuning_cache):
    """A private cache for every test (conftest's ``tuning_cache``)."""


def test_a_changed_search_space_is_a_new_study(monkeypatch):
    """Before: the study's name hashed the kernel files only, so a space whose choices changed
    (a new value, a dropped one) reopened the old study and every worker died on Optuna's
    "CategoricalDistribution does not support dynamic value space"."""
    machine, source = Machine.current("cpu"), tuned.source_hash("chunk")
    opts = TuneOptions()
    name = study_mod._study_name(TINY, machine, source, opts)
    assert study_mod._study_name(TINY, machine, source, opts) == name  # stable
    space = search_space(TINY, opts)
    changed = {form: {n: list(c) for n, c in fields.items()} for form, fields in space.items()}
    changed["resident"]["num_warps"] = changed["resident"]["num_warps"][:-1]
    monkeypatch.setattr(study_mod, "search_space", lambda bucket, o: changed)
    assert study_mod._study_name(TINY, machine, source, opts) != name
    assert study_mod._study_name(TINY, machine, source, opts).startswith(name.rsplit(":space ", 1)[0])
