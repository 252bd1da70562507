"""The planner: how each phase runs on a target, and why.

For prefill over T buckets it compares the chunk-parallel kernels (the default config, its
fused low-memory sibling and, where the default is the split form, the two-kernel one; at the
spec's ``chunk_size`` where it names one) with the recurrent scan, and finds the crossover
length below which the scan is faster (searched over those same options, not hard-coded);
decode over batch buckets always runs the recurrent step (the model's step runs nothing else),
and where the spec leaves the state dtype to the planner (``state_dtype = "auto"``) keeps the
decode cache in bf16 when that is predicted at least STATE_DTYPE_MIN_GAIN faster; train always
runs the chunk form and its backward. Costs come from tuned measurements for this GPU where
the tuned-config table has them for the bucket (B and T rounded up as the tuner rounds them;
a figure scaled from another bucket or cache dtype says so), else from the cost model
(calibrated by those measurements: a scale on the kernel time and a host overhead per kind of
call, see :class:`Calibration`); :mod:`rtcompile.plan_options` holds the options and their
costs. Every decision keeps its alternatives and their costs (those the runtime does not run
marked with a ``note``). A plan whose state plus workspace cannot fit the target's memory at
the requested batch is refused before anything is allocated, as is a spec of an order the
Triton kernels do not take (it runs on the reference backend).

Plan files are versioned JSON (``PLAN_FORMAT``); a file of another format is refused with a
message naming it (format 1, rtcompile 0.1: variants without a ``form`` tag). Every reader of a
plan's data (``Plan.load``, ``Plan.from_dict``, a bundle's manifest, export) goes through
:func:`check_plan_dict`, which checks every field and that the plan decides both phases the
model runs, naming the field's path (``plan.decisions[3].batch``) and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ._version import __version__
from .fields import FieldError, check_float, check_int, check_ints, check_type
from .fileio import ReadError, atomic_write, parse_problem, read_whole, unique_keys
from .costmodel import Calibration, chunk_cost, recurrent_cost, shape_of, workload
from .functional import MAX_TRITON_ORDER
from .kernels.chunk_backward import default_backward
from .kernels.chunk_backward_widths import rewritten_widths
from .kernels.config import DEFAULT_SMEM_BYTES, KernelConfig, KernelShape
from .kernels.forms import config_from_dict, default_config, low_memory
from .kernels.inputs import nearest_bucket
from .plan_options import (chunk_configs, chunk_size_note, crossover, fit_calibration, fitting, measured_cost,
                           measured_seconds, memory_figures, prefill_options, tuned_hit)
from .spec import ModelSpec, SpecError, SpecTypeError
from .target import Target

PLAN_FORMAT = 2  # 2: a decision's variant is a config's to_dict() (with its "form"); 1: rtcompile 0.1's variants
OLD_FORMATS = {1: "rtcompile 0.1's (ChunkVariant / RecurrentVariant dicts without a 'form' tag)"}
PREFILL_SEQ_LENS = (16, 64, 256, 1024, 4096, 16384, 65536)
PREFILL_BATCHES = (1, 8)
DECODE_BATCHES = (1, 8, 32, 128, 256)
# A 16-bit state cache rounds the state at every step (bf16: 2^-8 relative); it is taken only
# for a real gain. Decode is memory-bound, so halving the state bytes predicts ~1.9x there.
STATE_DTYPE_MIN_GAIN = 1.10
TRAIN_BACKWARD_FACTOR = 3.0  # forward + backward ~ 3x forward (two more passes of the same work)


class PlanError(ValueError):
    """A plan cannot be made (memory) or read (format, file)."""


@dataclass
class Decision:
    phase: str
    batch: int
    seq_len: int
    mode: str
    variant: dict[str, Any]  # the config's to_dict(): its "form" and fields
    cost: dict[str, Any]
    alternatives: list[dict[str, Any]]
    reason: str
    state_dtype: str = "float32"  # how the state is stored between calls (decode: the cache)
    # train: the backward's config (a BackwardConfig's to_dict(), the tuned one when measured),
    # None where the Triton backward cannot take the shape (training then runs the reference's
    # autograd). Optional, so plans written before it existed read as before.
    backward: dict[str, Any] | None = None

    @property
    def chunk_size(self) -> int | None:
        return self.variant.get("chunk_size")


@dataclass
class Plan:
    spec: dict[str, Any]
    target: dict[str, Any]
    decisions: list[Decision]
    crossover: dict[str, Any]
    memory: dict[str, Any]
    calibration: dict[str, Any]  # Calibration.to_dict(); files before the overheads hold the scales only
    versions: dict[str, str] = field(default_factory=dict)
    format: int = PLAN_FORMAT

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """A plan from its ``to_dict`` form, every field checked (:func:`check_plan_dict`):
        PlanError naming the field's path (``plan.decisions[3].batch``) and what is allowed."""
        return check_plan_dict(data)

    def save(self, path: str | os.PathLike) -> None:
        atomic_write(Path(path), json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        """A plan file, every field checked (:meth:`from_dict`); PlanError naming the file."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path: expected a str or os.PathLike plan file, got {type(path).__name__}")
        try:  # read_whole: a FIFO is refused, not waited on for ever
            raw = read_whole(path)
        except ReadError as exc:
            raise PlanError(f"plan file {str(path)!r}: {exc.why}; allowed: a plan file (rtcompile plan / build)") from None
        try:
            data = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
        except ValueError as exc:  # not UTF-8 or JSON, a repeated key, or a number past Python's 4300 digits
            raise PlanError(f"plan file {str(path)!r}: unreadable ({parse_problem(exc)})") from None
        except RecursionError:  # ~1000 nested brackets exhaust the parser; a plan nests a few levels
            raise PlanError(f"plan file {str(path)!r}: nested too deeply to parse") from None
        try:
            return cls.from_dict(data)
        except PlanError as exc:
            raise PlanError(f"plan file {str(path)!r}: {exc}") from None

    def decision_for(self, phase: str, batch: int, seq_len: int) -> Decision:
        """The decision of the nearest bucket (log distance in B and T) for ``phase``."""
        for name, value in (("batch", batch), ("seq_len", seq_len)):
            # hasattr __index__: ints, and torch's symbolic sizes under tracing
            if isinstance(value, bool) or not hasattr(type(value), "__index__"):
                raise TypeError(f"{name}: expected an integer >= 1, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ValueError(f"{name}: got {value}; allowed: an integer >= 1")
        cands = [d for d in self.decisions if d.phase == phase]
        if not cands:
            raise PlanError(f"plan: no decision for phase {phase!r}; allowed: {sorted({d.phase for d in self.decisions})}")
        return nearest_bucket(cands, batch, seq_len)

    def prefill_table(self) -> str:
        """The prefill decisions as JSON text (batch, seq_len, mode, variant per bucket): the
        custom op's ``mode`` argument ``"plan:" + table`` under tracing, where the op finds the
        bucket when it runs (:func:`rtcompile.kernels.ops.plan_choice`)."""
        rows = [{"batch": d.batch, "seq_len": d.seq_len, "mode": d.mode, "variant": d.variant}
                for d in self.decisions if d.phase == "prefill"]
        if not rows:
            self.decision_for("prefill", 1, 1)  # the PlanError an eager call raises, at trace time
        return json.dumps(rows, sort_keys=True, separators=(",", ":"))


PHASES = ("prefill", "decode", "train")
# The phases a RunningTensorLM runs (its forward and its step): a plan it follows decides both,
# so a plan without one of them is refused when read, not at the first call that needs it.
MODEL_PHASES = ("prefill", "decode")
DECISION_MODES = ("chunk", "recurrent")
DECISION_STATE_DTYPES = ("float32", "float16", "bfloat16")
_PLAN_KEYS = tuple(f.name for f in dataclasses.fields(Plan))
_PLAN_OPTIONAL = ("versions",)  # files written before it read as before
_DECISION_KEYS = tuple(f.name for f in dataclasses.fields(Decision))
_DECISION_OPTIONAL = ("state_dtype", "backward")


def _got(value: Any, typed: bool = True) -> str:
    """``value`` as an error shows it (cut at 80 characters), with its type where that is the problem."""
    if value is None:
        return "null"
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return text if typed else f"{type(value).__name__} {text}"


def _check_keys(where: str, data: Any, keys: tuple[str, ...], optional: tuple[str, ...]) -> None:
    if not isinstance(data, dict):
        raise PlanError(f"{where}: got {_got(data, False)}; allowed: an object with keys {', '.join(keys)}")
    missing = [k for k in keys if k not in data and k not in optional]
    unknown = sorted(str(k) for k in data if k not in keys)
    if missing or unknown:
        found = "; ".join(f"{what} {ks}" for what, ks in (("missing keys", missing), ("unknown keys", unknown)) if ks)
        raise PlanError(f"{where}: {found}; allowed: {', '.join(keys)}"
                        f"{' (' + ', '.join(optional) + ' optional)' if optional else ''}")


def _check_choice(where: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise PlanError(f"{where}: got {_got(value, isinstance(value, str))}; allowed: {', '.join(allowed)}")


@contextmanager
def _plan_field(arguments: bool = False) -> Iterator[None]:
    """Fields checked by :mod:`rtcompile.fields`, a refusal as a PlanError worded as every
    other of a plan's refusals: ``<path>: got <value>; allowed: <what>`` (a plan file's value
    of the wrong type is a bad value like any other, shown with its type). ``arguments``:
    :func:`make_plan`'s, from Python, where the API's rule holds: a wrong type stays the
    fields' TypeError, a value out of range is a PlanError (a ValueError) of the fields' text."""
    try:
        yield
    except FieldError as exc:
        if arguments and isinstance(exc, TypeError):
            raise
        if arguments:
            raise PlanError(str(exc)) from None
        got = _got(exc.value, isinstance(exc, ValueError))
        raise PlanError(f"{exc.name}: got {got}; allowed: {exc.allowed}") from None


def _check_config(where: str, value: Any, kernel: str, shape: KernelShape, smem: int) -> None:
    """A config of ``kernel`` that runs ``shape``: its types (``config_from_dict``), then its
    values by the config's own ``check`` (block_v=-16, num_warps=3 or a 401-digit chunk_size
    were read, written into a bundle and called verified: a launch would refuse them)."""
    try:
        config = config_from_dict(value, kernel)
    except (TypeError, ValueError) as exc:  # the config module's own check, naming the field
        raise PlanError(f"{where}: {_short_numbers(str(exc).splitlines()[0])}") from None
    if (why := config.check(shape, smem)) is not None:
        widths = "x".join(map(str, shape.key_widths))
        raise PlanError(f"{where}: {_short_numbers(why)} (for key widths {widths}, d_v {shape.value_width}, "
                        f"{smem} bytes of shared memory)")


def _check_cost(where: str, cost: Any) -> None:
    """The cost figures a decision or an alternative shows (``rtcompile plan`` prints their
    seconds, bound and source: a plan file's ``"seconds": "fast"`` was a traceback there)."""
    check_type(where, cost, dict, "an object (the cost model's figures)")
    check_float(f"{where}.seconds", cost.get("seconds"), lambda s: s >= 0, "a finite number >= 0 (seconds)")
    for key in ("bound", "source"):
        check_type(f"{where}.{key}", cost.get(key), str, "a string")


def _check_alternative(where: str, a: Any) -> None:
    """An alternative a decision lists (never run: its config's types, not its fit)."""
    check_type(where, a, dict, "an object (mode, variant, cost)")
    _check_choice(f"{where}.mode", a.get("mode"), DECISION_MODES)
    try:
        config_from_dict(a.get("variant"), a["mode"])
    except (TypeError, ValueError) as exc:
        raise PlanError(f"{where}.variant: {_short_numbers(str(exc).splitlines()[0])}") from None
    _check_cost(f"{where}.cost", a.get("cost"))
    if "state_dtype" in a:
        _check_choice(f"{where}.state_dtype", a["state_dtype"], DECISION_STATE_DTYPES)
    if "note" in a:
        check_type(f"{where}.note", a["note"], str, "a string")


def _short_numbers(text: str) -> str:
    """``text`` with every run of more than 24 digits cut to its first six and its length: a
    401-digit chunk_size made a 450-character line."""
    return re.sub(r"\d{25,}", lambda m: f"{m.group()[:6]}...({len(m.group())} digits)", text)


def _plan_smem(target: dict[str, Any]) -> int:
    """The shared memory a plan's configs must fit: its target's (``Target.to_dict``'s
    smem_per_sm), else the portable bound the configs' check assumes (DEFAULT_SMEM_BYTES)."""
    smem = target.get("smem_per_sm")
    if isinstance(smem, bool) or not isinstance(smem, int) or smem < 1:
        return DEFAULT_SMEM_BYTES
    return smem


def _check_decision(where: str, d: Any, shape: KernelShape, smem: int) -> Decision:
    """One decision the model can follow: the values the forward uses (decision_for takes the
    log2 of batch and length, the launcher builds the config at the plan's spec ``shape``; the
    backward's at the widths training rewrites them to) and the types of the rest."""
    _check_keys(where, d, _DECISION_KEYS, _DECISION_OPTIONAL)
    _check_choice(f"{where}.phase", d["phase"], PHASES)
    check_int(f"{where}.batch", d["batch"], 1)
    check_int(f"{where}.seq_len", d["seq_len"], 1)
    _check_choice(f"{where}.mode", d["mode"], DECISION_MODES)
    _check_config(f"{where}.variant", d["variant"], d["mode"], shape, smem)
    _check_cost(f"{where}.cost", d["cost"])
    check_type(f"{where}.alternatives", d["alternatives"], list, "a list of objects")
    for i, a in enumerate(d["alternatives"]):
        _check_alternative(f"{where}.alternatives[{i}]", a)
    check_type(f"{where}.reason", d["reason"], str, "a string")
    _check_choice(f"{where}.state_dtype", d.get("state_dtype", "float32"), DECISION_STATE_DTYPES)
    if d.get("backward") is not None:
        trained = dataclasses.replace(shape, key_widths=rewritten_widths(shape.key_widths))  # as _train plans it
        _check_config(f"{where}.backward", d["backward"], "chunk_bwd", trained, smem)
    return Decision(**d)


def check_plan_dict(data: Any) -> Plan:
    """The one reader of a plan's data (``Plan.from_dict``, ``Plan.load``, a bundle's manifest):
    the format, exactly the known keys, the spec through the spec module's validation, every
    decision's values, and a decision for each phase the model runs (:data:`MODEL_PHASES`).
    PlanError naming the field's path and what is allowed."""
    with _plan_field():  # the integer and type checks are rtcompile.fields'
        return _check_plan(data)


def _check_plan(data: Any) -> Plan:
    if not isinstance(data, dict) or isinstance(data.get("format"), bool) or not isinstance(data.get("format"), int):
        raise PlanError("plan: not a plan file (no integer 'format')")
    if data["format"] > PLAN_FORMAT:
        raise PlanError(f"plan: format {data['format']} is newer than this rtcompile reads ({PLAN_FORMAT}); "
                        "upgrade rtcompile or re-plan")
    if data["format"] < PLAN_FORMAT:
        old = OLD_FORMATS.get(data["format"], "an unknown old format")
        raise PlanError(f"plan: format {data['format']} is {old}; this rtcompile reads format {PLAN_FORMAT} "
                        "(configs tagged with 'form'): re-run `rtcompile plan` or `rtcompile build`")
    _check_keys("plan", data, _PLAN_KEYS, _PLAN_OPTIONAL)
    check_type("plan.spec", data["spec"], dict, "an object (the spec the plan was made for)")
    try:
        spec = ModelSpec.from_dict(data["spec"])
    except (SpecError, SpecTypeError) as exc:  # "spec.<field>: ..." -> "plan.spec.<field>: ..."
        raise PlanError(f"plan.{str(exc).splitlines()[0]}") from None
    check_type("plan.target", data["target"], dict, "an object (the target's profile, with its name)")
    if not isinstance(data["target"].get("name"), str) or not data["target"]["name"]:
        raise PlanError(f"plan.target.name: got {_got(data['target'].get('name'), False)}; allowed: a non-empty "
                        "string (the target's name)")
    check_type("plan.decisions", data["decisions"], list, "a list of decisions")
    shape, smem = shape_of(spec), _plan_smem(data["target"])
    decisions = [_check_decision(f"plan.decisions[{i}]", d, shape, smem) for i, d in enumerate(data["decisions"])]
    have = {d.phase for d in decisions}
    for phase in MODEL_PHASES:
        if phase not in have:
            raise PlanError(f"plan.decisions: no decision for phase {phase!r} (the plan has {sorted(have) or 'none'}); "
                            f"allowed: a plan with decisions for {' and '.join(MODEL_PHASES)}, the phases the model "
                            "runs (rtcompile plan writes them)")
    check_type("plan.crossover", data["crossover"], dict, "an object (batch bucket -> length or null)")
    for key, value in data["crossover"].items():
        if not re.fullmatch(r"B[1-9][0-9]{0,8}", key):
            raise PlanError(f"plan.crossover: key {_got(key)}; allowed: a batch bucket as B<batch> (B8)")
        if value is not None:
            check_int(f"plan.crossover[{key!r}]", value, 1)
    for key in ("memory", "calibration"):
        check_type(f"plan.{key}", data[key], dict, "an object")
    versions = data.get("versions", {})
    if not isinstance(versions, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in versions.items()):
        raise PlanError(f"plan.versions: got {_got(versions, False)}; allowed: an object of name -> version string")
    return Plan(**{**data, "decisions": decisions})


def check_memory(spec: ModelSpec, target: Target, batch: int, seq_len: int) -> dict[str, int]:
    """Refuse (PlanError) when the model's state plus the smallest prefill workspace and one
    layer's activations exceed the target's memory at this batch; return the figures."""
    fused = low_memory(shape_of(spec), target.smem_per_sm)
    need = memory_figures(spec, batch, seq_len, fused.workspace_bytes(workload(spec, batch, seq_len)))
    total = sum(need.values())
    if total > target.memory_bytes:
        raise PlanError(
            f"plan: does not fit {target.name} ({_gb(target.memory_bytes)}) at batch {batch}, T {seq_len}: "
            f"state {_gb(need['state'])} ({spec.layers} layers x {spec.heads} heads x "
            f"{spec.state_bytes_per_head} B per sequence) + workspace {_gb(need['workspace'])} + activations "
            f"{_gb(need['activations'])} = {_gb(total)}; reduce batch, widths, order, heads or layers"
        )
    return need


def _gb(n: float) -> str:
    try:
        return f"{n / 1e9:.3g} GB"
    except OverflowError:  # an int past float's range (--batch 10**310): its power of ten
        return f"~1e{len(str(int(n))) - 10} GB"


def _alternative(mode: str, config: KernelConfig, cost, **extra) -> dict[str, Any]:
    return {"mode": mode, "variant": config.to_dict(), **extra, "cost": cost.to_dict()}


def _prefill(spec: ModelSpec, target: Target, B: int, T: int, cal: Calibration, measured, configs) -> Decision:
    """The fastest prefill option at (B, T) whose workspace fits (:func:`~.plan_options.prefill_options`)."""
    options = prefill_options(spec, target, B, T, cal, measured, configs)
    fits = fitting(spec, target, B, T, options)
    mode, variant, cost = min(fits, key=lambda o: o[2].seconds)  # ties: the chunk form, listed first
    reason = f"fastest of {len(fits)} ({cost.source}, {cost.bound}-bound)"
    if len(fits) < len(options):
        reason += f"; {len(options) - len(fits)} refused for workspace beyond free memory"
    reason += chunk_size_note(spec, configs)
    alts = [_alternative(m, v, c) for m, v, c in options]
    return Decision("prefill", B, T, mode, variant.to_dict(), cost.to_dict(), alts, reason)


DECODE_NOT_RUN = "not run: the model decodes with the recurrent step (listed for comparison)"
TRAIN_NOT_RUN = "not run: training runs the chunk form and its backward (listed for comparison)"


def _decode(spec: ModelSpec, target: Target, B: int, cal: Calibration, measured) -> Decision:
    """The decode step: always the recurrent kernel (the model's step runs nothing else); the
    decision is its config and, under ``state_dtype = "auto"``, the cache's dtype. The chunk
    form's cost stays among the alternatives, marked as not run."""
    shape = shape_of(spec)
    rec = default_config("recurrent", shape, target.smem_per_sm, decode_rows=B * spec.heads)
    hit = tuned_hit(measured, "recurrent", B, 1)
    if hit is not None:
        rec = hit[1]

    def step_cost(dtype: str):
        """The step with the cache in ``dtype``. Tuning measures an fp32 cache; another dtype or
        batch scales that measurement by the model's ratio (and says so in its source)."""
        c = recurrent_cost(spec, target, B, 1, rec, cal, state_dtype=dtype, step=True)
        if hit is None:
            return c
        (mB, _), _, secs = hit
        if (mB, dtype) == (B, "float32"):
            return measured_cost(c, secs)
        ratio = c.kernel_s / recurrent_cost(spec, target, mB, 1, rec, cal, state_dtype="float32", step=True).kernel_s
        return measured_cost(c, secs, ratio, f"float32 cache (tuned B{mB}) by the model")

    fixed = spec.state_dtype if spec.state_dtype != "auto" else "float32"
    chosen, dtype = step_cost(fixed), fixed
    chunk = default_config("chunk", shape, target.smem_per_sm, gluon=target.wgmma)
    alts = [_alternative("recurrent", rec, chosen, state_dtype=fixed),
            _alternative("chunk", chunk, chunk_cost(spec, target, B, 1, chunk, cal), state_dtype="float32",
                         note=DECODE_NOT_RUN)]
    why_dtype = ""
    if spec.state_dtype == "auto":
        half = step_cost("bfloat16")
        alts.append(_alternative("recurrent", rec, half, state_dtype="bfloat16"))
        gain = chosen.seconds / half.seconds
        if gain >= STATE_DTYPE_MIN_GAIN:
            chosen, dtype = half, "bfloat16"
            why_dtype = f"; state dtype auto: a bf16 cache, {gain:.2f}x faster than fp32 (>= {STATE_DTYPE_MIN_GAIN}x)"
        else:
            why_dtype = f"; state dtype auto: fp32 kept, a bf16 cache only {gain:.2f}x faster (< {STATE_DTYPE_MIN_GAIN}x)"
    reason = (f"one token per sequence: the recurrent step reads and writes the state once ({chosen.source}, "
              f"{chosen.bound}-bound){why_dtype}")
    return Decision("decode", B, 1, "recurrent", rec.to_dict(), chosen.to_dict(), alts, reason, dtype)


def _nearest_train(measured, B: int, T: int):
    """The tuned train measurement (kernel "chunk_bwd") of the nearest bucket (log distance in
    B and T, as the launchers' lookup): ((B, T), (config, seconds)), or None."""
    hits = [((b, t), hit) for (kernel, b, t), hit in measured.items() if kernel == "chunk_bwd"]
    if not hits:
        return None
    dist = lambda h: abs(math.log2(h[0][0]) - math.log2(B)) + abs(math.log2(h[0][1]) - math.log2(T))
    return min(hits, key=dist)


def _train(spec: ModelSpec, target: Target, B: int, T: int, cal: Calibration, measured, configs) -> Decision:
    """Forward + backward, always the chunk form and its backward (what training runs): measured
    where the tuned table has a train (``chunk_bwd``) entry for this spec and GPU (the nearest
    bucket's seconds; another bucket's scaled to this one by the model's ratio of forward costs,
    labelled as scaled), else TRAIN_BACKWARD_FACTOR x the modelled forward. The decision pins
    the backward config (``Decision.backward``); the scan's cost is listed, marked as not run."""
    shape, smem = shape_of(spec), target.smem_per_sm
    chunk = configs[0]
    rec = default_config("recurrent", shape, smem)
    c_fwd = chunk_cost(spec, target, B, T, chunk, cal)
    scale = lambda x: dataclasses.replace(x, seconds=x.seconds * TRAIN_BACKWARD_FACTOR)
    c, r = scale(c_fwd), scale(recurrent_cost(spec, target, B, T, rec, cal))
    # widths the backward's kernels do not tile train rewritten: its configs are that shape's
    rewritten = rewritten_widths(spec.key_widths)
    backward = default_backward(dataclasses.replace(shape, key_widths=rewritten), smem,
                                gated=spec.features.forget_gate)
    hit = _nearest_train(measured or {}, B, T)
    if hit is not None:
        (mB, mT), (backward, secs) = hit
        at = f"tuned train bucket B{mB} T{mT}"
        if (mB, mT) == (B, T):
            c = measured_cost(c, secs)
            how = f"forward + backward measured ({at})"
        else:  # the nearest tuned bucket, scaled by the model's forward-cost ratio
            ratio = c_fwd.kernel_s / chunk_cost(spec, target, mB, mT, chunk, cal).kernel_s
            c = measured_cost(c, secs, ratio, f"({at}) by the model")
            how = f"forward + backward from the nearest {at}"
    else:
        how = (f"forward + backward ~ {TRAIN_BACKWARD_FACTOR:g}x forward (modelled: no tuned train measurement; "
               "`rtcompile tune --phase train` measures it)")
    bwd = None if backward is None else backward.to_dict()
    alts = [_alternative("chunk", chunk, c, backward=bwd), _alternative("recurrent", rec, r, note=TRAIN_NOT_RUN)]
    reason = f"{how}, {c.source}, {c.bound}-bound; training runs the chunk form and its backward"
    reason += chunk_size_note(spec, configs)
    if rewritten != spec.key_widths:
        reason += (f"; the backward's kernels do not tile these widths: training rewrites them exactly as "
                   f"{'x'.join(map(str, rewritten))} (materialised keys or zero-padded factors)")
    return Decision("train", B, T, "chunk", chunk.to_dict(), c.to_dict(), alts, reason, backward=bwd)


def check_plan_args(spec, target, batches, seq_lens, decode_batches, use_measurements,
                    calibration) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """:func:`make_plan`'s arguments, before any work: TypeError for a wrong type, PlanError (a
    ValueError) for a value out of range, each naming the argument and what is allowed. Returns
    the buckets (batches, seq_lens, decode_batches) without repeats: ``--batch 1,1`` planned
    every decision twice."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec: expected a ModelSpec (rtcompile.ModelSpec or rtcompile.load_spec(path)), "
                        f"got {type(spec).__name__}")
    if not isinstance(target, Target):
        raise TypeError(f"target: expected a Target (rtcompile.target.get_target(name)), got {type(target).__name__}")
    if spec.order > MAX_TRITON_ORDER:
        # running_tensor sends such a model to the reference (functional.resolve_backend): the
        # Triton configs and costs a plan holds would describe kernels that never run
        raise PlanError(f"spec.order: got {spec.order}; allowed: 2 to {MAX_TRITON_ORDER}, the orders of the Triton "
                        f"kernels the planner chooses among (an order-{spec.order} model runs on the reference "
                        "backend, PyTorch, with or without a plan: use it without one)")
    with _plan_field(arguments=True):  # the buckets' batches and lengths (decision_for takes their log2)
        buckets = (check_ints("batches", batches, 1, None, "integers >= 1"),
                   check_ints("seq_lens", seq_lens, 1, None, "integers >= 1"),
                   check_ints("decode_batches", decode_batches, 1, None, "integers >= 1", may_be_empty=True))
    if not isinstance(use_measurements, bool):
        raise TypeError(f"use_measurements: expected a bool, got {type(use_measurements).__name__}")
    if calibration is not None and not isinstance(calibration, Calibration):
        raise TypeError(f"calibration: expected a Calibration or None, got {type(calibration).__name__}")
    return buckets


def make_plan(spec: ModelSpec, target: Target, *, batches=PREFILL_BATCHES, seq_lens=PREFILL_SEQ_LENS,
              decode_batches=DECODE_BATCHES, use_measurements: bool = True,
              calibration: Calibration | None = None) -> Plan:
    """Plan every phase of ``spec`` on ``target`` (refuses what cannot fit; see module doc).

    ``batches`` and ``seq_lens`` (the prefill and train buckets) hold at least one integer >= 1;
    ``decode_batches`` may be empty, for a plan of prefill alone (a cost study's: such a plan
    cannot go into a bundle, whose model runs decode too). Repeated buckets are planned once.
    ``calibration``: plan with this one instead of the fit to the tuned measurements (replays
    of measured runs compare the two). The arguments are checked first (:func:`check_plan_args`)."""
    batches, seq_lens, decode_batches = check_plan_args(spec, target, batches, seq_lens, decode_batches,
                                                        use_measurements, calibration)
    import torch
    import triton

    memory = {f"B{B}_T{T}": check_memory(spec, target, B, T) for B in batches for T in seq_lens}
    memory.update({f"decode_B{B}": check_memory(spec, target, B, 1) for B in decode_batches})
    measured = measured_seconds(spec, target) if use_measurements else {}
    # calibrate the model on what was measured, then plan every bucket with it
    cal = calibration if calibration is not None else fit_calibration(spec, target, measured)
    configs = chunk_configs(spec, target)  # at the spec's chunk_size where it names one
    decisions = [_prefill(spec, target, B, T, cal, measured, configs) for B in batches for T in seq_lens]
    decisions += [_decode(spec, target, B, cal, measured) for B in decode_batches]
    decisions += [_train(spec, target, B, max(seq_lens), cal, measured, configs) for B in batches]
    cross = {f"B{B}": crossover(spec, target, B, cal, measured, configs) for B in batches}
    versions = {"rtcompile": __version__, "torch": torch.__version__, "triton": triton.__version__}
    return Plan(spec.to_dict(), target.to_dict(), decisions, cross, memory, cal.to_dict(), versions)
