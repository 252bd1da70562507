"""Checks of one configuration field, shared by the dataclasses that validate on construction
(``explore``'s task, settings and options). Each raises TypeError for a wrong type and
ValueError for a value out of range, naming the field and what is allowed, before any work."""

from __future__ import annotations

import math
from typing import Any, Callable


def check_int(name: str, value: Any, lo: int, hi: int) -> int:
    """An integer in [lo, hi] (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an integer in [{lo}, {hi}], got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}: got {value}; allowed: an integer in [{lo}, {hi}]")
    return value


def check_float(name: str, value: Any, ok: Callable[[float], bool], allowed: str) -> float:
    """A finite number (int or float, bools refused) for which ``ok`` holds; ``allowed`` says which."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected {allowed}, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and ok(value)):
        raise ValueError(f"{name}: got {value}; allowed: {allowed}")
    return value


def check_ints(name: str, values: Any, lo: int, hi: int, allowed: str) -> tuple[int, ...]:
    """A non-empty list or tuple of integers in [lo, hi], duplicates dropped (first kept)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or not values:
        raise TypeError(f"{name}: expected a non-empty list of integers, got {values!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}: expected integers, got {type(v).__name__} {v!r}")
        if not lo <= v <= hi:
            raise ValueError(f"{name}: got {v}; allowed: {allowed}")
    return tuple(dict.fromkeys(values))
