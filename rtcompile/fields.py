"""Checks of one configuration field, shared by the dataclasses that validate on construction
(``explore``'s task, settings and options) and the plan's reader and arguments. Each raises a
:class:`FieldTypeError` (a TypeError) for a wrong type and a :class:`FieldValueError` (a
ValueError) for a value out of range, naming the field and what is allowed, before any work.

The errors keep the field's name, the value refused and what is allowed, so a caller with its
own error type (the plan's PlanError) words them its way without checking anything twice."""

from __future__ import annotations

import math
from typing import Any, Callable


class FieldError(Exception):
    """A field refused: ``name``, the ``value`` refused and what is ``allowed`` (text)."""

    def __init__(self, name: str, value: Any, allowed: str, message: str) -> None:
        super().__init__(message)
        self.name, self.value, self.allowed = name, value, allowed


class FieldTypeError(FieldError, TypeError):
    """A field of the wrong type: ``<name>: expected <allowed>, got <type> <value>``."""


class FieldValueError(FieldError, ValueError):
    """A field's value out of range: ``<name>: got <value>; allowed: <allowed>``."""


class TensorDtypeError(FieldError, TypeError, ValueError):
    """A tensor argument of the wrong dtype: ``<name>: dtype <dtype>; allowed: <allowed>``. Both a
    TypeError (its element type is wrong) and a ValueError (what the kernels' float checks raised
    before every dtype check went through :func:`dtype_error`), so either ``except`` catches it."""


def dtype_error(name: str, dtype: Any, allowed: str) -> TensorDtypeError:
    """The error for tensor ``name`` of ``dtype`` where ``allowed`` (text) dtypes are taken."""
    return TensorDtypeError(name, dtype, allowed, f"{name}: dtype {dtype}; allowed: {allowed}")


def _wrong_type(name: str, value: Any, allowed: str) -> FieldTypeError:
    return FieldTypeError(name, value, allowed, f"{name}: expected {allowed}, got {type(value).__name__} {value!r}")


def _out_of_range(name: str, value: Any, allowed: str) -> FieldValueError:
    return FieldValueError(name, value, allowed, f"{name}: got {value}; allowed: {allowed}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_type(name: str, value: Any, kind: type | tuple[type, ...], allowed: str) -> Any:
    """A value of type ``kind``; ``allowed`` says what that is in words."""
    if not isinstance(value, kind):
        raise _wrong_type(name, value, allowed)
    return value


def check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    """An integer in [lo, hi] (``hi`` None: no upper bound; bools refused)."""
    allowed = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
    if not _is_int(value):
        raise _wrong_type(name, value, allowed)
    if value < lo or (hi is not None and value > hi):
        raise _out_of_range(name, value, allowed)
    return value


def check_float(name: str, value: Any, ok: Callable[[float], bool], allowed: str) -> float:
    """A finite number (int or float, bools refused) for which ``ok`` holds; ``allowed`` says which."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong_type(name, value, allowed)
    if not (math.isfinite(value) and ok(value)):
        raise _out_of_range(name, value, allowed)
    return value


def check_ints(name: str, values: Any, lo: int, hi: int | None, allowed: str, *,
               may_be_empty: bool = False) -> tuple[int, ...]:
    """A list or tuple of integers in [lo, hi] (``hi`` None: no upper bound), non-empty unless
    ``may_be_empty`` (an empty one is a value out of range), duplicates dropped (first kept);
    ``allowed`` says which integers in words (``integers >= 1``)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise _wrong_type(name, values, f"a list or tuple of {allowed}")
    if not values and not may_be_empty:
        raise FieldValueError(name, values, f"at least one of {allowed}",
                              f"{name}: got an empty {type(values).__name__}; allowed: at least one of {allowed}")
    for v in values:
        if not _is_int(v):
            raise _wrong_type(name, v, allowed)
        if v < lo or (hi is not None and v > hi):
            raise _out_of_range(name, v, allowed)
    return tuple(dict.fromkeys(values))
