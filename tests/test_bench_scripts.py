"""benchmarks/onnx_prefill.py and tpe_check.py run end to end at tiny shapes on the CPU (their
numbers are for the machines their headers name)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import onnx_prefill
import tpe_check

TINY = """name = "tiny"
order = 3
key_widths = [4, 4]
value_width = 8
heads = 2
model_width = 16
layers = 1
input_dtype = "float32"
"""


def test_onnx_prefill_times_both_bodies_and_checks_the_logits(tmp_path, capsys):
    spec = tmp_path / "tiny.toml"
    spec.write_text(TINY)
    assert onnx_prefill.main([str(spec), "--seq-len", "70", "--threads", "1"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if re.match(r"\s+1\s+70\s", ln)]
    assert len(rows) == 1
    chunk_ms, scan_ms, ref_ms, diff = float(rows[0][2]), float(rows[0][3]), float(rows[0][4]), float(rows[0][7])
    assert chunk_ms > 0 and scan_ms > 0 and ref_ms > 0 and diff < 1e-4


def test_tpe_check_refuses_bad_budgets(capsys):
    assert tpe_check.main(["x.toml", "--trials", "0", "--out", "/tmp/unused"]) == 2
    assert "--trials" in capsys.readouterr().err
