"""How studies run (:class:`TuneOptions`), checked on construction, and the one test of a storage
URL that no tuning can use (an in-memory SQLite database), shared with ``rtcompile tune``'s
``--storage`` check (``cli_args.check_storage``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..fields import FieldValueError, check_float, check_int, check_type

DEFAULT_SEED = 20261129  # recorded in every study; TPE's choices are reproducible from it
# numpy's RandomState (Optuna's TPE) takes seeds below 2**32; a study adds its worker index and
# trial numbers (and 10_000 for the final re-measurements) to the seed, so half that range is kept
MAX_SEED = 2**31 - 1
MAX_WORKERS = 1024  # one process each, whatever the trial count (explore's bound too)
DEVICES = ("cpu", "cuda")


def memory_store_refusal(url: str) -> str | None:
    """Why ``url`` is a storage no tuning can use, or None: a SQLite database in memory
    (``sqlite://``, ``sqlite+driver://``, ``sqlite:///:memory:``), which worker processes cannot
    share and no later run can resume."""
    base = url.split("?", 1)[0]
    if base.startswith("sqlite") and base.split("://", 1)[-1] in ("", "/:memory:"):
        return (f"storage {url!r}: an in-memory database, which worker processes cannot share and no run can "
                "resume; allowed: sqlite:///FILE, journal:PATH or a database server's URL")
    return None


def _optional(name: str, value: Any, check) -> None:
    if value is not None:
        check(name, value)


@dataclass
class TuneOptions:
    """How to run studies. ``trials`` xor ``seconds`` is the budget per bucket (``exhaustive``:
    one trial per valid config is the budget, ``seconds`` None, ``trials`` ignored). Every field
    is checked on construction (and by ``dataclasses.replace``): a TypeError for a wrong type, a
    ValueError for a value out of range, naming the field and what is allowed."""

    storage: str | None = None
    trials: int | None = 20
    seconds: float | None = None
    workers: int = 1
    resume: bool = False
    retune: bool = False
    seed: int = DEFAULT_SEED
    device: str = "cpu"
    repeats: int = 5
    trial_timeout: float = 300.0
    top_k: int = 3
    impl: str | None = None  # "module:function" replacing the kernel call (tests plant wrong variants)
    table: str | None = None  # tuned-config table path (default: the kernels' own)
    fixed: dict[str, Any] = field(default_factory=dict)  # form / FORM.FIELD held at one value (a sub-space)
    exhaustive: bool = False  # one trial per valid config of the (sub-)space instead of TPE's picks
    deadline: float | None = None  # seconds mode: when this bucket's time is up (time.time()); else now + seconds

    def __post_init__(self) -> None:
        positive = lambda name, v: check_float(name, v, lambda x: x > 0, "a finite number > 0")  # noqa: E731
        _optional("storage", self.storage, lambda n, v: check_type(n, v, str, "None or a storage URL (str)"))
        if self.storage is not None and not self.storage.strip():  # it fell back to the default store unseen
            raise FieldValueError("storage", self.storage, "None or a storage URL",
                                  f"storage: got {self.storage!r}; allowed: None (the cache's store) or a storage URL")
        if self.storage is not None and (why := memory_store_refusal(self.storage)) is not None:
            raise FieldValueError("storage", self.storage, "a storage workers share", f"storage: {why}")
        _optional("trials", self.trials, lambda n, v: check_int(n, v, 1))
        _optional("seconds", self.seconds, positive)
        for name in ("resume", "retune", "exhaustive"):
            check_type(name, getattr(self, name), bool, "True or False")
        if self.exhaustive and self.seconds is not None:
            raise FieldValueError("seconds", self.seconds, "None with exhaustive",
                                  f"seconds: got {self.seconds} with exhaustive=True; allowed: None (one trial per "
                                  "valid config is the exhaustive budget)")
        if not self.exhaustive and (self.trials is None) == (self.seconds is None):
            raise FieldValueError("trials", self.trials, "exactly one of trials and seconds",
                                  f"trials, seconds: got trials={self.trials}, seconds={self.seconds}; allowed: exactly "
                                  "one of them (trials=None for a time budget)")
        if self.resume and self.retune:
            raise FieldValueError("retune", self.retune, "not with resume",
                                  "resume, retune: both True; allowed: one of them (retune deletes the study that "
                                  "resume continues)")
        check_int("workers", self.workers, 1, MAX_WORKERS)
        check_int("seed", self.seed, 0, MAX_SEED)
        check_type("device", self.device, str, f"one of {', '.join(DEVICES)}")
        if self.device not in DEVICES:
            raise FieldValueError("device", self.device, ", ".join(DEVICES),
                                  f"device: got {self.device!r}; allowed: {', '.join(DEVICES)}")
        check_int("repeats", self.repeats, 1)
        positive("trial_timeout", self.trial_timeout)
        check_int("top_k", self.top_k, 1)
        _optional("impl", self.impl, lambda n, v: check_type(n, v, str, "None or module:function (str)"))
        _optional("table", self.table, lambda n, v: check_type(n, v, str, "None or a file path (str)"))
        check_type("fixed", self.fixed, dict, "a dict of form / FORM.FIELD -> value")
        _optional("deadline", self.deadline, positive)
