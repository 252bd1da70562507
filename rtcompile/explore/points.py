"""The points of ``rtcompile explore``'s sweep: its options, the grid of (order, width), the
refusals and the matching.

A point replaces the base spec's order and key widths (order o: o - 1 key axes, all of one
width w); everything else (heads, value width, layers, features, dtypes) is the base's. A
combination the spec's validation refuses is a refused point (a line in the report), never a
crash. ``match``: ``params`` sets each point's model width so its parameters (the LM with MLP,
embedding and head excluded) equal the base spec's within MATCH_TOLERANCE; ``state`` sets its
heads (or, where no head count gets there, its value width) so its state bytes per sequence
do. The base spec is the loaded spec at ``d_model``, whether or not it lies on the grid.

Bad options are ValueError / TypeError naming the field and the allowed values, raised when
:class:`SweepOptions` is built, before any work.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..fields import check_ints
from ..spec import MAX_WIDTH, ModelSpec, SpecError, SpecTypeError
from ..target import PROFILES
from .mqar import MAX_SEQ_LEN

KERNEL_ORDERS = (2, 3, 4)  # the Triton kernels' orders (kernels/launch.py): every point must run on them
MATCH_MODES = ("params", "state")
# One unit of model width moves the parameter count by 1/D (the mixer's terms, linear in D) to 2/D
# (the MLP's 8 D^2): 0.8-1.6% at D = 128, so the nearest width is within 0.4-0.8%; 2% leaves room
# for smaller widths (D 64: within 1.6%).
MATCH_TOLERANCE = 0.02
MLP = True  # the LM the parameters count (and the trainer builds) has an MLP per layer
RECALL_D_MODEL = 128  # the paper's MQAR ablation width (issue 23), the default model width with recall


def _fail(name: str, message: str) -> ValueError:
    return ValueError(f"{name}: {message}")


@dataclass(frozen=True)
class RecallOptions:
    """MQAR settings of a recall sweep: the task (sequence length, key-value pairs) and the
    training (steps, learning rates swept, seeds run, batch size)."""

    seq_len: int = 256
    kv_pairs: int = 16
    # keys from one half, values from the other. 1024, not Zoology's 8192: every measured run
    # (H200, d_model 128, 8000-16000 steps: order 3 0.99, order 2 0.67-0.88 at lr 1e-3;
    # benchmarks/RESULTS.md) used it; 8192 with the tied head has not been trained here
    vocab_size: int = 1024
    # both orders sat at chance for 3000 steps at d_model 128 on the H200; order 3 left the plateau
    # at step ~4000 of an 8000-step schedule at 16 pairs (lr 1e-3, 0.99), at ~5200 of 16000 at 32
    # pairs (0.736 with 8000 steps: the cosine had decayed the rate by then)
    steps: int = 8000
    learning_rates: tuple[float, ...] = (1e-3, 3e-3, 1e-2)
    seeds: tuple[int, ...] = (0,)
    batch_size: int = 64

    def __post_init__(self) -> None:
        for name in ("kv_pairs", "steps", "batch_size"):
            check_ints(name, [getattr(self, name)], 1, 1 << 24, "an integer in [1, 2^24]")
        # MQARTask's own bounds: 2^24 passed here, and every point then failed when it built its task
        check_ints("seq_len", [self.seq_len], 4, MAX_SEQ_LEN, f"an integer in [4, {MAX_SEQ_LEN}] (MQAR's lengths)")
        # (first: a pair count past the length is the mistake, not the vocabulary it would need)
        # MQAR lays out the pairs and their queries in the sequence: 4 tokens per pair at least
        if 4 * self.kv_pairs > self.seq_len:
            raise _fail("kv_pairs", f"got {self.kv_pairs} for seq_len {self.seq_len}; allowed: at most seq_len / 4 "
                        f"= {self.seq_len // 4} (each pair and its query take 4 positions)")
        # distinct keys and values per sequence, and the filler token
        check_ints("vocab_size", [self.vocab_size], 2 * self.kv_pairs + 1, 1 << 24,
                   f"an integer in [2 * kv_pairs + 1 = {2 * self.kv_pairs + 1}, 2^24]")
        lrs = self.learning_rates
        if isinstance(lrs, (str, bytes)) or not isinstance(lrs, (list, tuple)) or not lrs:
            raise TypeError(f"learning_rates: expected a non-empty list of numbers, got {lrs!r}")
        for lr in lrs:
            # the trainer's bound (TrainSettings: (0, 1]); this one refused 1 where the trainer took it
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and 0 < lr <= 1):
                raise _fail("learning_rates", f"got {lr!r}; allowed: numbers in (0, 1]")
        object.__setattr__(self, "learning_rates", tuple(float(x) for x in dict.fromkeys(lrs)))
        object.__setattr__(self, "seeds", check_ints("seeds", self.seeds, 0, 2**31 - 1, "integers in [0, 2^31)"))


@dataclass(frozen=True)
class SweepOptions:
    """What ``rtcompile explore`` sweeps and how. ``target``: ``auto`` measures on the CUDA GPU
    present (the cost model for DEFAULT_TARGET without one); a profile name always predicts
    for that GPU. ``d_model`` replaces the base spec's model width (default RECALL_D_MODEL with
    ``recall``, else the spec's). ``workers``: processes claiming points (one per GPU)."""

    orders: tuple[int, ...]
    widths: tuple[int, ...]
    d_model: int | None = None
    match: str | None = None
    target: str = "auto"
    recall: RecallOptions | None = None
    storage: str | None = None
    workers: int = 1

    def __post_init__(self) -> None:
        allowed = ", ".join(map(str, KERNEL_ORDERS))
        object.__setattr__(self, "orders", check_ints("orders", self.orders, KERNEL_ORDERS[0], KERNEL_ORDERS[-1],
                                                      f"{allowed} (the Triton kernels' orders)"))
        object.__setattr__(self, "widths", check_ints("widths", self.widths, 1, MAX_WIDTH,
                                                      f"integers in [1, {MAX_WIDTH}]"))
        if self.d_model is not None:
            check_ints("d_model", [self.d_model], 1, 1 << 20, "an integer in [1, 2^20]")
        for name in ("match", "storage"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise TypeError(f"{name}: expected a str or None, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.target, str):
            raise TypeError(f"target: expected a str, got {type(self.target).__name__}")
        if self.match is not None and self.match not in MATCH_MODES:
            raise _fail("match", f"got {self.match!r}; allowed: {', '.join(MATCH_MODES)}")
        if self.target.lower() not in ("auto", *PROFILES):
            raise _fail("target", f"got {self.target!r}; allowed: auto, {', '.join(PROFILES)}")
        if self.storage is not None and not self.storage.strip():  # the CLI refuses it; run_sweep took the default
            raise _fail("storage", f"got {self.storage!r}; allowed: None (the default store) or a storage URL")
        if self.recall is not None and not isinstance(self.recall, RecallOptions):
            raise TypeError(f"recall: expected RecallOptions or None, got {type(self.recall).__name__}")
        check_ints("workers", [self.workers], 1, 1024, "an integer in [1, 1024]")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SweepOptions":
        r = d.get("recall")
        recall = None if r is None else RecallOptions(**{**r, "learning_rates": tuple(r["learning_rates"]),
                                                            "seeds": tuple(r["seeds"])})
        return cls(**{**d, "orders": tuple(d["orders"]), "widths": tuple(d["widths"]), "recall": recall})


@dataclass(frozen=True)
class Point:
    """One (order, width) of the grid: its spec, or why the spec validation refused it."""

    order: int
    width: int
    spec: ModelSpec | None
    refusal: str | None = None
    match: dict[str, Any] | None = None  # by (the fields set), mode, reference, matched, gap, within

    @property
    def id(self) -> str:
        return point_id(self.order, self.width)


def point_id(order: int, width: int) -> str:
    return f"o{order}_w{width}"


def base_spec(spec: ModelSpec, opts: SweepOptions) -> ModelSpec:
    """The spec the points derive from: ``spec`` at ``opts.d_model`` (RECALL_D_MODEL by default
    with recall)."""
    d = opts.d_model if opts.d_model is not None else (RECALL_D_MODEL if opts.recall is not None else None)
    return spec if d is None else spec.replace(model_width=d)


def parameters(spec: ModelSpec) -> int:
    """Parameters of the spec's RunningTensorLM with MLP, embedding and head excluded: at MQAR's
    vocabulary of 8192 and D 128 those two hold 2.1 M, dwarfing the 0.2-0.6 M the order and
    widths move. ``parameter_count`` at vocabulary 0 is exactly that count."""
    from ..model import parameter_count

    return parameter_count(spec, 0, MLP)


def _gap(value: float, reference: float) -> float:
    return abs(value - reference) / reference


def _match_params(spec: ModelSpec, reference: int) -> tuple[ModelSpec, dict[str, Any]]:
    """The model width whose parameters come nearest ``reference`` (the count grows with D)."""
    count = lambda d: parameters(spec.replace(model_width=d))
    lo, hi = 1, 1 << 20
    while lo < hi:  # the smallest D with count >= reference
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(mid) < reference else (lo, mid)
    best = min((d for d in (lo - 1, lo) if d >= 1), key=lambda d: abs(count(d) - reference))
    return spec.replace(model_width=best), {"by": {"model_width": best}}


def _match_state(spec: ModelSpec, reference: int) -> tuple[ModelSpec, dict[str, Any]]:
    """Heads, else value width (at the spec's heads, else at one head), whose state bytes per
    sequence come nearest ``reference``: heads first, since they keep the per-head state shape
    the kernels were tuned for; one head when even a value width of 1 is too much at the
    spec's heads (o4 32x32x32 against o3 16x16 with 8 heads of d_v 64 needs 1 head of d_v 4)."""
    unit = spec.state_bytes_per_head // spec.value_width * spec.layers  # one value column, one head
    options = []
    for heads, by in ((None, "heads"), (spec.heads, "value_width"), (1, "value_width")):
        exact = reference / (unit * (spec.value_width if heads is None else heads))
        for v in {max(1, math.floor(exact)), max(1, math.ceil(exact))}:
            change = {"heads": v} if heads is None else {"heads": heads, "value_width": v}
            try:
                cand = spec.replace(**change)
            except (SpecError, SpecTypeError):
                continue
            options.append((_gap(cand.state_bytes_per_sequence, reference), len(change), change, cand))
    if not options:
        return spec, {"by": {"heads": spec.heads}}
    _, _, change, cand = min(options, key=lambda o: o[:2])
    return cand, {"by": change}


def make_point(base: ModelSpec, opts: SweepOptions, order: int, width: int) -> Point:
    """The point (order, width) of the sweep of ``base``: refused (with the spec's one-line
    reason) where the spec validation refuses it, matched as ``opts.match`` asks."""
    try:
        spec = base.replace(order=order, key_widths=(width,) * (order - 1),
                            name=f"{base.name or 'explore'}-{point_id(order, width)}")
    except (SpecError, SpecTypeError) as exc:
        return Point(order, width, None, refusal=f"refused: {exc}")
    if opts.match is None:
        return Point(order, width, spec)
    if opts.match == "params":
        ref = parameters(base)
        spec, how = _match_params(spec, ref)
        value = parameters(spec)
    else:
        ref = base.state_bytes_per_sequence
        spec, how = _match_state(spec, ref)
        value = spec.state_bytes_per_sequence
    gap = _gap(value, ref)
    match = {**how, "mode": opts.match, "reference": ref, "matched": value, "gap": gap,
             "within": gap <= MATCH_TOLERANCE}
    return Point(order, width, spec, match=match)


def make_points(base: ModelSpec, opts: SweepOptions) -> list[Point]:
    return [make_point(base, opts, o, w) for o in opts.orders for w in opts.widths]
