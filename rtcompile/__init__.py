"""rtcompile: autotune, plan and export RunningTensor (higher-order linear attention) models.

``rtcompile.spec`` (the model spec) needs no torch; :func:`running_tensor` loads torch on first
use, so ``rtcompile info`` stays fast and no device is probed at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__
from .spec import Features, ModelSpec, SpecError, SpecFileError, SpecTypeError, load_spec, save_spec

__all__ = [
    "Features",
    "ModelSpec",
    "SpecError",
    "SpecFileError",
    "SpecTypeError",
    "load_spec",
    "running_tensor",
    "running_tensor_decode_",
    "load",
    "save_spec",
    "__version__",
]

if TYPE_CHECKING:
    from .functional import running_tensor, running_tensor_decode_


def load(path):
    """Load a bundle written by ``rtcompile export``: a ready model, its plan pinned, no tuning."""
    from .export.bundle import load_bundle

    return load_bundle(path)


def __getattr__(name: str) -> Any:
    if name in ("running_tensor", "running_tensor_decode_"):
        from . import functional

        # bound here once, so later lookups skip this hook (3 us of a T = 1 call's 18 us of host
        # time on the CPU machine, benchmarks/serving_host.py)
        value = globals()[name] = getattr(functional, name)
        return value
    raise AttributeError(f"module 'rtcompile' has no attribute {name!r}")
