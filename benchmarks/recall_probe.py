"""Why a recall run stays at chance: gradients of one MQAR batch on the Triton kernels against
the reference (float32, same weights), then short training curves per backend / precision.

    python3 benchmarks/recall_probe.py grads --spec examples/mqar_d128.toml
    python3 benchmarks/recall_probe.py curve --spec examples/mqar_d128.toml --backend triton --autocast 1 [--compile inductor]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from rtcompile.explore.mqar import IGNORE, MQARTask, make_batch
from rtcompile.explore.trainer import TrainSettings, train_recall
from rtcompile.model import RunningTensorLM
from rtcompile.spec import load_spec


def grads(spec, task, dev):
    torch.manual_seed(0)
    model = RunningTensorLM(spec, vocab_size=task.vocab_size, tie_embeddings=True).to(dev)
    tokens, labels = make_batch(task, 16, 123, dev)
    out = {}
    for name, backend, ac in (("reference", "reference", False), ("triton", "triton", False), ("triton-bf16", "triton", True)):
        model.zero_grad(set_to_none=True)
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if ac else torch.autocast("cuda", enabled=False)
        with ctx:
            logits = model(tokens, backend=backend)[0]
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        loss.backward()
        out[name] = (loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    ref_loss, ref = out["reference"]
    for name in ("triton", "triton-bf16"):
        loss, g = out[name]
        worst = sorted(((float((g[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)), n) for n in ref), reverse=True)
        missing = [n for n in ref if n not in g]
        print(f"{name}: loss {loss:.5f} (reference {ref_loss:.5f}); worst grad rel err {worst[:4]}; missing {missing}")


def curve(spec, task, dev, backend, autocast, steps, lr, compile_backend=None):
    s = TrainSettings(learning_rates=(lr,), max_steps=steps, batch_size=64, eval_every=max(steps // 8, 1),
                      test_examples=512, backend=backend, autocast_bf16=autocast, compile_backend=compile_backend)
    t = time.perf_counter()
    losses = []

    def hook(rate, step, loss):
        losses.append(loss)
        if step % max(steps // 10, 1) == 0:
            print(f"  {backend} ac={autocast} o{spec.order} step {step} loss {sum(losses[-50:]) / len(losses[-50:]):.3f}", flush=True)

    r = train_recall(spec, task, s, device=dev, progress=False, on_step=hook)
    print(json.dumps({"backend": backend, "autocast": autocast, "compile": compile_backend, "order": spec.order, "widths": spec.key_widths,
                      "d_model": spec.model_width, "lr": lr, "acc": r.accuracy, "wall_s": round(time.perf_counter() - t, 1)}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["grads", "curve"])
    ap.add_argument("--spec", default="examples/mqar_d128.toml")
    ap.add_argument("--order", type=int, default=0)
    ap.add_argument("--width", type=int, default=0)
    ap.add_argument("--d-model", type=int, default=0)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--autocast", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--compile", default=None, help="TrainSettings.compile_backend (e.g. inductor)")
    a = ap.parse_args()
    spec = load_spec(a.spec)
    if a.order:
        spec = spec.replace(order=a.order, key_widths=type(spec.key_widths)([a.width] * (a.order - 1)))
    if a.d_model:
        spec = spec.replace(model_width=a.d_model)
    task = MQARTask(vocab_size=a.vocab, seq_len=256, num_kv_pairs=16)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        torch.set_num_threads(1)
    if a.what == "grads":
        grads(spec, task, dev)
    else:
        curve(spec, task, dev, a.backend, bool(a.autocast), a.steps, a.lr, a.compile)


if __name__ == "__main__":
    main()
