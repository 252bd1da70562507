"""The planner's inputs and decisions (CPU: cost model only): a custom Target's figures checked."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from rtcompile.plan import make_plan
from rtcompile.spec import load_spec
from rtcompile.target import Target, get_target

ROOT = Path(__file__).resolve().parents[1]
O3_16 = ROOT / "examples" / "order3_16x16.toml"


# --- 8. a custom Target's figures ----------------------------------------------------------


@pytest.mark.parametrize("field,value,exc", [
    ("sms", 0, ValueError), ("hbm_bytes_per_s", 0, ValueError), ("memory_bytes", math.nan, ValueError),
    ("bf16_flops", math.inf, ValueError), ("smem_per_sm", -1, ValueError), ("launch_s", -1e-6, ValueError),
    ("l2_bytes", True, TypeError), ("fp32_flops", "67e12", TypeError), ("name", None, TypeError),
], ids=["sms-0", "hbm-0", "memory-nan", "bf16-inf", "smem-negative", "launch-negative", "l2-bool", "fp32-str",
        "name-None"])
def test_a_target_refuses_figures_the_cost_model_cannot_use(field, value, exc):
    """sms=0 or hbm_bytes_per_s=0 made make_plan raise ZeroDivisionError; memory_bytes=nan
    'min() arg is an empty sequence'."""
    h200 = get_target("h200")
    with pytest.raises(exc, match=rf"^target\.{field}: "):
        dataclasses.replace(h200, **{field: value})
    custom = Target("mine", 16 * 10**9, 1e12, 1e14, 1e14, 1e13, 20, 100 * 1024, 1 << 25, "a test's own GPU")
    assert make_plan(load_spec(O3_16), custom, batches=(1,), seq_lens=(64,), decode_batches=(1,)).decisions
