"""Model spec: an immutable, validated description of a RunningTensor model.

A spec names the tensor order ``o``, one width per key axis (``o - 1`` of them), the value
width, heads, model width, layers, chunk size and the layer's optional features. It imports
nothing else from rtcompile and does not need torch, so the CLI can validate a spec before
anything heavy is loaded.

Invariants (checked by :meth:`ModelSpec.__post_init__`, so every ``ModelSpec`` that exists is
valid):

* ``order >= 2`` and ``len(key_widths) == order - 1``;
* every width, ``heads``, ``model_width`` and ``layers`` is a positive ``int`` (never ``bool``);
* ``chunk_size`` is ``"auto"`` or a power of two in ``CHUNK_SIZES`` (the Triton kernels tile a
  chunk with ``tl.arange``, which needs a power of two, and ``tl.dot`` needs at least 16);
* the recurrent state of one sequence (all layers) fits in ``MAX_STATE_BYTES_PER_SEQUENCE``.

Errors are :class:`SpecError` (a ``ValueError``) or :class:`SpecTypeError` (a ``TypeError``);
both carry ``field`` and a one-line message that names the field and the allowed values.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .fileio import ReadError, atomic_write, parse_problem, read_whole

ORDERS = range(2, 7)  # 2..6; order 7 at width 2 is already 64 keys, beyond that nobody asks
MAX_WIDTH = 65536
CHUNK_SIZES = (16, 32, 64, 128, 256)
DEFAULT_CHUNK = 64  # what "auto" assumes for figures until the planner decides (issue 5)
INPUT_DTYPES = ("float32", "float16", "bfloat16")
# The dtype the decode cache keeps the state in between steps (every kernel accumulates in
# fp32); "auto" lets the planner choose per decode batch (rtcompile.plan).
STATE_DTYPES = ("float32", "float16", "bfloat16", "auto")
PROJECTIONS = ("dense", "conconlyc")
MAX_SHORT_CONV = 16
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
# No accelerator sold has 1 TiB of memory (B200: 192 GB): a spec whose state for a single
# sequence exceeds this cannot run anywhere, so it is refused at load time. Target-specific
# limits (memory at a given batch) are the planner's job.
MAX_STATE_BYTES_PER_SEQUENCE = 1 << 40


class SpecError(ValueError):
    """A spec field has a value outside its allowed set."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"spec.{field_name}: {message}")


class SpecFileError(ValueError):
    """A spec file cannot be read or parsed (missing, wrong extension, invalid TOML/JSON)."""


class SpecTypeError(TypeError):
    """A spec field has the wrong type."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"spec.{field_name}: {message}")


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecTypeError(name, f"expected an integer in [{lo}, {hi}], got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise SpecError(name, f"got {value}; allowed: an integer in [{lo}, {hi}]")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SpecTypeError(name, f"expected true or false, got {type(value).__name__} {value!r}")
    return value


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise SpecTypeError(name, f"expected one of {', '.join(allowed)}, got {type(value).__name__} {value!r}")
    if value not in allowed:
        raise SpecError(name, f"got {value!r}; allowed: {', '.join(allowed)}")
    return value


@dataclass(frozen=True)
class Features:
    """Optional parts of a RunningTensor layer.

    ``forget_gate``: data-dependent decay a_t = exp(g_t); ``delta_rule``: gated delta update with
    b_t; ``l2norm``: unit-norm query and key factors; ``query_skip``: per-token blend of each
    query factor with the all-ones vector; ``projection``: ``dense`` or ``conconlyc`` (channel
    tiling plus a tied depthwise causal convolution; needs ``short_conv >= 1``);
    ``short_conv``: causal depthwise convolution width, 0 for none; ``output_gate``: gated,
    normalised output.
    """

    forget_gate: bool = True
    delta_rule: bool = True
    l2norm: bool = True
    query_skip: bool = False
    projection: str = "dense"
    short_conv: int = 4
    output_gate: bool = True

    def __post_init__(self) -> None:
        for name in ("forget_gate", "delta_rule", "l2norm", "query_skip", "output_gate"):
            _check_bool(f"features.{name}", getattr(self, name))
        _check_choice("features.projection", self.projection, PROJECTIONS)
        _check_int("features.short_conv", self.short_conv, 0, MAX_SHORT_CONV)
        if self.projection == "conconlyc" and self.short_conv == 0:
            raise SpecError(
                "features.short_conv",
                "got 0 with projection 'conconlyc'; allowed: 1 to "
                f"{MAX_SHORT_CONV} (ConcOnlyC's tied convolution is its projection)",
            )

    @property
    def update_rule(self) -> str:
        """ONNX LinearAttention's name for the update: linear, gated, delta or gated_delta."""
        if self.delta_rule:
            return "gated_delta" if self.forget_gate else "delta"
        return "gated" if self.forget_gate else "linear"


_FEATURE_FIELDS = tuple(f.name for f in dataclasses.fields(Features))


@dataclass(frozen=True)
class ModelSpec:
    """One RunningTensor model: ``layers`` identical layers of ``heads`` heads each.

    The per-head state has shape ``key_widths + (value_width,)``; flattened it is a
    ``K x value_width`` matrix with ``K = prod(key_widths)``.
    """

    order: int
    key_widths: tuple[int, ...]
    value_width: int
    heads: int
    model_width: int
    layers: int = 1
    chunk_size: int | str = "auto"
    input_dtype: str = "bfloat16"
    state_dtype: str = "float32"
    scale: float | None = None
    name: str = ""
    features: Features = field(default_factory=Features)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise SpecTypeError("name", f"expected a string, got {type(self.name).__name__}")
        _check_int("order", self.order, ORDERS.start, ORDERS.stop - 1)
        widths = self.key_widths
        if isinstance(widths, (str, bytes)) or not isinstance(widths, (list, tuple)):
            raise SpecTypeError(
                "key_widths", f"expected a list of {self.order - 1} integers, got {type(widths).__name__}"
            )
        if len(widths) != self.order - 1:
            raise SpecError(
                "key_widths",
                f"got {len(widths)} widths for order {self.order}; allowed: exactly order - 1 = "
                f"{self.order - 1} (one per key axis)",
            )
        for i, w in enumerate(widths):
            _check_int(f"key_widths[{i}]", w, 1, MAX_WIDTH)
        object.__setattr__(self, "key_widths", tuple(widths))
        _check_int("value_width", self.value_width, 1, MAX_WIDTH)
        _check_int("heads", self.heads, 1, 4096)
        _check_int("model_width", self.model_width, 1, 1 << 20)
        _check_int("layers", self.layers, 1, 4096)
        if isinstance(self.chunk_size, str):
            if self.chunk_size != "auto":
                raise SpecError("chunk_size", f"got {self.chunk_size!r}; allowed: 'auto' or one of {CHUNK_SIZES}")
        elif isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int):
            raise SpecTypeError(
                "chunk_size", f"expected 'auto' or one of {CHUNK_SIZES}, got {type(self.chunk_size).__name__}"
            )
        elif self.chunk_size not in CHUNK_SIZES:
            raise SpecError("chunk_size", f"got {self.chunk_size}; allowed: 'auto' or one of {CHUNK_SIZES}")
        _check_choice("input_dtype", self.input_dtype, INPUT_DTYPES)
        _check_choice("state_dtype", self.state_dtype, STATE_DTYPES)
        if self.scale is not None:
            if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)):
                raise SpecTypeError("scale", f"expected a positive number, got {type(self.scale).__name__}")
            try:
                scale = float(self.scale)
            except OverflowError:  # an int no float holds (math.isfinite raised it too): 10**400
                # its bits, not its digits: str() of an int past 4300 digits raises ValueError
                raise SpecError("scale", f"got an integer of {self.scale.bit_length()} bits, beyond a float's range "
                                "(~1.8e308); allowed: a finite number > 0 (omit for prod(key_widths)**-0.5)") from None
            if not (math.isfinite(scale) and scale > 0):
                raise SpecError("scale", f"got {self.scale}; allowed: a finite number > 0 (omit for prod(key_widths)**-0.5)")
            object.__setattr__(self, "scale", scale)
        if not isinstance(self.features, Features):
            raise SpecTypeError("features", f"expected Features, got {type(self.features).__name__}")
        total = self.state_bytes_per_sequence
        if total > MAX_STATE_BYTES_PER_SEQUENCE:
            raise SpecError(
                "key_widths",
                f"state of one sequence is {total / 2**40:.1f} TiB ({self.layers} layers x {self.heads} heads x "
                f"{self.state_elements_per_head} {self.state_dtype}); allowed: at most 1 TiB, more than any "
                "accelerator holds (reduce widths, order, heads or layers)",
            )

    # ----- derived sizes -------------------------------------------------------------------
    @property
    def key_dim(self) -> int:
        """K = prod(key_widths): the width of the Kronecker key phi(k)."""
        return math.prod(self.key_widths)

    @property
    def effective_scale(self) -> float:
        return self.scale if self.scale is not None else self.key_dim**-0.5

    @property
    def resolved_chunk_size(self) -> int:
        return DEFAULT_CHUNK if self.chunk_size == "auto" else int(self.chunk_size)

    @property
    def state_elements_per_head(self) -> int:
        return self.key_dim * self.value_width

    @property
    def state_bytes_per_head(self) -> int:
        """Bytes of one head's state; with ``state_dtype="auto"`` the fp32 bound."""
        dtype = "float32" if self.state_dtype == "auto" else self.state_dtype
        return self.state_elements_per_head * DTYPE_BYTES[dtype]

    @property
    def state_bytes_per_layer(self) -> int:
        """One sequence's state in one layer (all heads)."""
        return self.state_bytes_per_head * self.heads

    @property
    def state_bytes_per_sequence(self) -> int:
        """One sequence's state in the whole model (all layers)."""
        return self.state_bytes_per_layer * self.layers

    # ----- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "order": self.order,
            "key_widths": list(self.key_widths),
            "value_width": self.value_width,
            "heads": self.heads,
            "model_width": self.model_width,
            "layers": self.layers,
            "chunk_size": self.chunk_size,
            "input_dtype": self.input_dtype,
            "state_dtype": self.state_dtype,
        }
        if self.scale is not None:
            d["scale"] = self.scale
        d["features"] = dataclasses.asdict(self.features)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelSpec":
        """Build a spec from plain data; unknown keys are errors, never dropped."""
        if not isinstance(data, Mapping):
            raise SpecTypeError("(root)", f"expected a table/object, got {type(data).__name__}")
        allowed = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in allowed:
                raise SpecError(str(key), f"unknown key; allowed keys: {', '.join(allowed)}")
        for required in ("order", "key_widths", "value_width", "heads", "model_width"):
            if required not in data:
                raise SpecError(required, "missing; this key is required")
        kwargs = dict(data)
        feats = kwargs.pop("features", {})
        if not isinstance(feats, Mapping):
            raise SpecTypeError("features", f"expected a table/object, got {type(feats).__name__}")
        for key in feats:
            if key not in _FEATURE_FIELDS:
                raise SpecError(f"features.{key}", f"unknown feature; allowed: {', '.join(_FEATURE_FIELDS)}")
        return cls(features=Features(**feats), **kwargs)

    def replace(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, **changes)


def load_spec(path: str | os.PathLike) -> ModelSpec:
    """Read a spec from ``.toml`` or ``.json`` (no code is ever executed)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a str or os.PathLike spec file, got {type(path).__name__}")
    if not os.fspath(path).strip():  # Path("") is ".", which the message would name instead
        raise SpecFileError(f"spec file {os.fspath(path)!r}: empty path; allowed: a .toml or .json spec file")
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise SpecFileError(f"spec file {str(p)!r}: unsupported extension {suffix or '(none)'!r}; allowed: .toml, .json")
    try:
        raw = read_whole(p)
    except ReadError as exc:
        raise SpecFileError(f"spec file {str(p)!r}: {exc.why}") from None
    try:
        text = raw.decode("utf-8")
        data = tomllib.loads(text) if suffix == ".toml" else json.loads(text, object_pairs_hook=_unique_keys)
    except ValueError as exc:  # a decode error of either parser, or a number past Python's 4300 digits
        raise SpecFileError(f"spec file {str(p)!r}: not valid {suffix[1:].upper()}: {parse_problem(exc)}") from None
    except _DuplicateKey as exc:
        raise SpecFileError(f"spec file {str(p)!r}: key {exc.args[0]!r} appears more than once; "
                            "allowed: each key once") from None
    except RecursionError:
        # Both parsers recurse once per nesting level, so a file of ~1000 nested brackets
        # exhausts Python's default recursion limit (1000); a spec nests at most 2 levels.
        raise SpecFileError(f"spec file {str(p)!r}: nested too deeply to parse; "
                            "allowed: a table of fields nested at most a few levels") from None
    return ModelSpec.from_dict(data)


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object hook: the object as a dict, or _DuplicateKey naming a repeated key (json
    itself keeps the last value silently, so ``{"order": 2, "order": 3}`` would read as 3)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def save_spec(spec: ModelSpec, path: str | os.PathLike) -> None:
    """Write ``spec`` as ``.toml`` or ``.json``, atomically (temporary file, then rename)."""
    import tomli_w

    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise SpecFileError(f"spec file {str(p)!r}: unsupported extension {suffix or '(none)'!r}; allowed: .toml, .json")
    data = spec.to_dict()
    text = tomli_w.dumps(data) if suffix == ".toml" else json.dumps(data, indent=2) + "\n"
    atomic_write(p, text)
