"""RunningTensorLM trains through the Triton kernels (interpreter on CPU): a few AdamW steps under
bf16 autocast with the Triton forward + backward track the reference's losses from the same
seed, the Triton backward really runs (counted), and the mixer state stays fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rtcompile.kernels import chunk_backward
from rtcompile.model import RunningTensorLM
from rtcompile.spec import Features, ModelSpec

VOCAB, STEPS, T = 16, 3, 20
# Losses of the two backends differ by ~5e-4 after 3 steps (measured on CPU: 2.8789 vs 2.8791,
# 2.9549 vs 2.9554, 2.8958 vs 2.8962): under bf16 autocast the two paths round differently.
# 5e-3 is 10x that and well below the 0.06-0.08 the loss moves from step to step.
LOSS_TOL = 5e-3


def _spec():
    return ModelSpec(order=3, key_widths=(16, 16), value_width=16, heads=1, model_width=32, layers=2,
                     features=Features(query_skip=True, short_conv=4, output_gate=True))


def _train(backend, seen_dtypes):
    torch.manual_seed(0)
    lm = RunningTensorLM(_spec(), vocab_size=VOCAB)
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    losses, states = [], []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (2, T + 1), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, cache = lm(tokens[:, :-1], backend=backend)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        states.append({c["state"].dtype for c in cache})
    return losses, states


def test_training_steps_on_triton_match_the_reference(monkeypatch):
    seen, calls = [], []
    real = chunk_backward.launch_backward  # both the recomputing op's backward and a kept forward's run it

    def counting(config, p, q, k, v, *args, **kwargs):
        calls.append(1)
        seen.append(v.dtype)
        return real(config, p, q, k, v, *args, **kwargs)

    monkeypatch.setattr(chunk_backward, "launch_backward", counting)
    ref, ref_states = _train("reference", seen)
    assert not calls  # the reference never reaches the Triton backward
    tri, tri_states = _train("triton", seen)
    assert len(calls) == STEPS * _spec().layers, "the Triton backward did not run once per layer and step"
    assert set(seen) == {torch.bfloat16}  # autocast's bf16 activations reached the kernels
    assert all(s == {torch.float32} for s in tri_states + ref_states)  # fp32 state
    assert all(a == pytest.approx(b, abs=LOSS_TOL) for a, b in zip(tri, ref)), (tri, ref)
    assert ref[0] != ref[-1]  # the steps did move the model (a frozen model would agree trivially)


SCRIPT = __import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks" / "train_loss.py"


def _script(*argv, interpret=True, tmp_path=None):
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1" if interpret else "0"}
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)


def test_train_loss_tiny_runs_both_backends_on_cpu(tmp_path):
    import json

    out = tmp_path / "r.json"
    r = _script("--tiny", "--steps", "2", "--out", str(out), tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [run["backend"] for run in doc["runs"]] == ["triton", "reference"]
    assert all(len(run["losses"]) == 2 and run["tokens_per_s"] > 0 for run in doc["runs"])
    assert doc["agree"] and doc["max_abs_diff_smoothed"] <= doc["tolerance"] == 0.05
    assert "agree" in r.stdout and "tokens/s" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script would train")
def test_train_loss_without_a_gpu_exits_2_with_one_line(tmp_path):
    r = _script("--steps", "2", interpret=False, tmp_path=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "CUDA GPU" in r.stderr
    assert not (tmp_path / "train_loss.json").exists()
    bad = _script("--tiny", "--steps", "0", tmp_path=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("train_loss: --steps")
