"""benchmarks/profile_ncu.py: the Nsight Compute log read into rows (no GPU needed)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import profile_ncu

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _line(i, kernel, metric, value, grid="(2, 64, 1)"):
    return (f'"{i}","668","python3.12","127.0.0.1","{kernel}","1","7","(128, 1, 1)","{grid}","0","9.0",'
            f'"Command line profiler metrics","{metric}","x","{value}"')


def test_a_log_becomes_one_row_per_kernel_in_launch_order(tmp_path):
    log = tmp_path / "ncu.csv"
    log.write_text("\n".join([
        "==PROF== Connected to process 668",
        HEADER,
        _line(0, "chunk_prepare_kernel", "gpu__time_duration.sum", "145,504", "(128, 64, 1)"),
        _line(0, "chunk_prepare_kernel", "dram__throughput.avg.pct_of_peak_sustained_elapsed", "30.35", "(128, 64, 1)"),
        _line(1, "chunk_split_state_kernel", "gpu__time_duration.sum", "168,928"),
        _line(1, "chunk_split_state_kernel", "sm__warps_active.avg.pct_of_peak_sustained_active", "6.24"),
    ]) + "\n")
    rows = profile_ncu.parse(str(log))
    assert [(r["id"], r["kernel"]) for r in rows] == [(0, "chunk_prepare_kernel"), (1, "chunk_split_state_kernel")]
    assert rows[0]["us"] == pytest.approx(145.504) and rows[0]["dram%"] == 30.35 and rows[0]["occ%"] is None
    assert rows[1]["us"] == pytest.approx(168.928) and rows[1]["occ%"] == 6.24 and rows[1]["grid"] == "(2, 64, 1)"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_ncu.py"), "--parse", str(log)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "chunk_split_state_kernel" in out and "168.9" in out


def test_a_missing_log_is_a_usage_error(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_ncu.py"), "--parse",
                          str(tmp_path / "none.csv")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "no file" in res.stderr
