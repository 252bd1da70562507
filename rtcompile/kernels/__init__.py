"""Kernels for the RunningTensor state mixer.

``reference``: float64-capable PyTorch references (the oracle). Triton kernels, their launchers
and torch custom-op registration join them here. This package knows nothing of specs, tuning,
models, export or the CLI: tuned configurations reach it as plain data.
"""

from .inputs import Problem, check_inputs
from .reference import kron_features, l2normalize, running_tensor_chunk_ref, running_tensor_recurrent_ref

__all__ = [
    "Problem",
    "check_inputs",
    "kron_features",
    "l2normalize",
    "running_tensor_chunk_ref",
    "running_tensor_recurrent_ref",
]
