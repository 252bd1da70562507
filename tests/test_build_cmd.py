"""``rtcompile build``: the interpreter set before the kernels load (a CPU run with --storage),
orders the Triton kernels do not take refused up front, and on a GPU (faked) the tuning buckets
and the plan's target those of the command line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rtcompile.cli import main

ROOT = Path(__file__).resolve().parents[1]
SMALL = "order = 2\nkey_widths = [3]\nvalue_width = 5\nheads = 1\nmodel_width = 8\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU machine's build (CI runs it); on the GPU machine its "
                    "Triton 3.6 interpreter with numpy 2.4 cannot run range() over a runtime int")
def test_build_with_storage_on_a_cpu_sets_the_interpreter_before_the_kernels_load(tmp_path):
    """--storage is checked first, and its store imports the kernel modules: Triton chose the
    GPU driver for them (none on a CPU: "0 active drivers", a traceback) unless
    TRITON_INTERPRET=1 is set before. The variable is read at import, so the run is a fresh
    process whose environment lacks it."""
    spec = tmp_path / "o2.toml"
    spec.write_text(SMALL)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), RTCOMPILE_TUNED=str(tmp_path / "tuned.json"),
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "rtcompile.cli", "build", str(spec), "--target", "h200", "--batch", "1",
                        "--seq-len", "16", "--decode-batch", "1", "--out", str(out),
                        "--storage", f"sqlite:///{tmp_path / 'store.db'}"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("-> ok") == 3 and json.loads(out.read_text())["target"]["name"] == "h200"


@pytest.mark.parametrize("order", [5, 6], ids=["order5", "order6"])
def test_build_refuses_an_order_the_kernels_do_not_take(tmp_path, capsys, monkeypatch, order):
    """A valid order-5/6 spec: one usage line naming the order and the kernels' orders, exit 2,
    before any planning (the kernel checks raised a ValueError traceback after it)."""
    import rtcompile.plan_cmd as plan_cmd

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(plan_cmd, "_make", lambda *a: pytest.fail("planned"))
    spec = tmp_path / "big.toml"
    spec.write_text(f"order = {order}\nkey_widths = {[2] * (order - 1)}\nvalue_width = 4\nheads = 1\nmodel_width = 8\n")
    out = tmp_path / "p.json"
    assert main(["build", str(spec), "--target", "h200", "--batch", "1", "--seq-len", "64", "--decode-batch", "1",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"order {order}" in err[0] and "orders 2-4" in err[0], err
    assert not out.exists()


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A build on a faked H200: measure / detect give the h200 profile, marked measured; the
    tuner records the buckets it is given; the kernel checks pass."""
    import rtcompile.plan_cmd as plan_cmd
    import rtcompile.target as target
    import rtcompile.tuning as tuning

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("RTCOMPILE_TUNED", str(tmp_path / "tuned.json"))
    h200 = dataclasses.replace(target.PROFILES["h200"], measured=True)
    monkeypatch.setattr(plan_cmd, "_on_gpu", lambda: True)
    monkeypatch.setattr(target, "measure", lambda: h200)
    monkeypatch.setattr(target, "detect", lambda: h200)
    tuned = []

    def tune(bucket, opts, *a):
        tuned.append((bucket.kernel, bucket.batch, bucket.seq_len))
        return type("R", (), {"already_tuned": True, "trials_run": 0})()

    monkeypatch.setattr(tuning, "tune_bucket", tune)
    monkeypatch.setattr(plan_cmd, "_validate_kernels", lambda spec: [("chunk", 0.0, True)])
    return tuned


BUILD = ["--batch", "2", "--seq-len", "1000", "--decode-batch", "3"]


@pytest.mark.parametrize("target", ["auto", "h200"], ids=["auto", "this-gpus-profile"])
def test_build_on_a_gpu_tunes_the_requested_buckets(fake_gpu, tmp_path, target):
    """--batch / --seq-len / --decode-batch are what is tuned (the buckets were B8 T4096, B32 and
    B256 whatever they said), and the plan is this GPU's, from its measurements."""
    out = tmp_path / "p.json"
    assert main(["build", str(ROOT / "examples" / "order3_16x16.toml"), "--target", target, *BUILD,
                 "--out", str(out)]) == 0
    assert fake_gpu == [("chunk", 2, 1024), ("recurrent", 4, 1)]  # buckets round up to powers of two
    plan = json.loads(out.read_text())
    assert plan["target"]["name"] == "h200" and plan["target"]["measured"]
    assert {(d["phase"], d["batch"], d["seq_len"]) for d in plan["decisions"]} >= {("prefill", 2, 1000), ("decode", 3, 1)}


def test_build_on_a_gpu_for_another_gpu_plans_that_target_without_tuning(fake_gpu, tmp_path, capsys):
    """--target l4 on an H200: the plan is the L4's (it was re-planned as auto: the H200's), from
    its profile; nothing is tuned, since this GPU's measurements are not the L4's."""
    out = tmp_path / "p.json"
    assert main(["build", str(ROOT / "examples" / "order3_16x16.toml"), "--target", "l4", *BUILD,
                 "--out", str(out)]) == 0
    assert fake_gpu == []
    plan = json.loads(out.read_text())
    assert plan["target"]["name"] == "l4" and not plan["target"]["measured"]
    assert "not this GPU" in capsys.readouterr().out
