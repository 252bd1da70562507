from __future__ import annotations

import os
import tempfile

import pytest
import torch

# Hermetic: no test reads or writes the user's tuning store or tuned-config table (the
# launchers consult the table whenever no variant is given).
_CACHE = tempfile.mkdtemp(prefix="rtcompile-tests-")
os.environ["XDG_CACHE_HOME"] = _CACHE
os.environ["RTCOMPILE_TUNED"] = os.path.join(_CACHE, "rtcompile", "tuned.json")


def make_inputs(B, T, H, widths, V, *, gate=True, delta=True, state=False, num_seqs=None,
                dtype=torch.float64, seed=None):
    """Fresh random inputs for running_tensor; g <= 0 (log decay), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % (2**31))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q = [r(B, T, H, w).to(dtype) for w in widths]
    k = [r(B, T, H, w).to(dtype) for w in widths]
    v = r(B, T, H, V).to(dtype)
    g = (-torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.7).to(dtype) if gate else None
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64).to(dtype) if delta else None
    n = num_seqs if num_seqs is not None else B
    s0 = r(n, H, *widths, V) if state else None
    return q, k, v, g, beta, s0


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, NaN-propagating (an unwritten NaN fails)."""
    diff = (actual.double() - expected.double()).abs().max()
    if torch.isnan(actual).any():
        return float("inf")
    return float(diff / expected.double().abs().max().clamp_min(1e-300))


@pytest.fixture
def inputs():
    return make_inputs
