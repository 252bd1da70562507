"""A real training run: the 2-layer example model on a synthetic copy task, Triton vs reference.

    python benchmarks/train_loss.py [--steps 300] [--out train_loss.json]
    TRITON_INTERPRET=1 python benchmarks/train_loss.py --tiny --steps 2   (CPU smoke run)

The model is examples/order3_16x16.toml (order 3, key widths 16x16, d_v 64, 8 heads, d_model
512, 2 layers) as a RunningTensorLM over a vocabulary of VOCAB tokens. The task: each sequence
is COPY_LEN random tokens, a separator, then the same tokens again; the loss (cross entropy)
counts only the predictions of the copied half, which the model can make only by recalling the
first half through its state. Batches are drawn on the device from a generator seeded with
(--seed, step), so both runs see the same batches. Each run starts from the same weights
(torch.manual_seed(--seed) before the model is built), trains --steps AdamW steps under bf16
autocast (fp32 master weights, fp32 mixer state), once with backend="triton" (the Triton forward
and backward) and once with backend="reference" (PyTorch autograd).

Agreement: both loss curves smoothed by an exponential moving average (SMOOTH), then the
largest absolute difference over the steps; the runs agree when it is <= --tolerance (default
TOLERANCE nats: bf16 rounding makes the two runs' weights drift apart step by step, so the
curves are compared smoothed and with a margin, not bit for bit). tokens/s: B*T*(steps timed) /
wall seconds of the timed steps (steps after WARMUP_STEPS, which compile; CUDA synchronised at
both ends). Writes --out (JSON, atomically); exit 0 when the curves agree, 1 when they do not,
2 on bad arguments or without a GPU (one stderr line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPEC = ROOT / "examples" / "order3_16x16.toml"
VOCAB, COPY_LEN, BATCH = 64, 127, 16  # T = 2 * COPY_LEN + 1 = 255 inputs per sequence
SMOOTH = 0.1  # EMA weight of the newest step (about a 10-step window)
TOLERANCE = 0.05
WARMUP_STEPS = 3
LR = 1e-3
TINY = dict(copy_len=9, batch=2)  # --tiny: key widths (16,), d_v 16, d_model 32 (see _spec)


def _fail(msg: str) -> int:
    print(f"train_loss: {msg}", file=sys.stderr)
    return 2


def _spec(tiny: bool):
    from rtcompile.spec import Features, ModelSpec, load_spec

    if not tiny:
        return load_spec(SPEC)
    return ModelSpec(order=2, key_widths=(16,), value_width=16, heads=1, model_width=32, layers=2,
                     features=Features(query_skip=False, short_conv=4, output_gate=True), name="tiny")


def _batch(step: int, seed: int, copy_len: int, batch: int, device):
    """(inputs [B, T], targets [B, T] with -100 outside the copied half) for one step."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + step)
    first = torch.randint(1, VOCAB, (batch, copy_len), generator=gen, device=device)
    sep = torch.zeros(batch, 1, dtype=first.dtype, device=device)  # token 0 marks the copy
    seq = torch.cat([first, sep, first], dim=1)  # [B, 2L + 1]
    inputs, targets = seq[:, :-1], seq[:, 1:].clone()
    targets[:, :copy_len] = -100  # only the copied half is scored
    return inputs, targets


def train(backend: str, args, device) -> dict:
    """One run: losses per step and tokens/s of the timed steps."""
    import torch
    import torch.nn.functional as F

    from rtcompile.model import RunningTensorLM

    torch.manual_seed(args.seed)
    lm = RunningTensorLM(_spec(args.tiny), vocab_size=VOCAB).to(device)
    opt = torch.optim.AdamW(lm.parameters(), lr=LR)
    copy_len, batch = (TINY["copy_len"], TINY["batch"]) if args.tiny else (COPY_LEN, BATCH)
    losses, t0, timed = [], None, 0
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in range(args.steps):
        if step == min(WARMUP_STEPS, args.steps - 1):
            sync()
            t0 = time.perf_counter()
        inputs, targets = _batch(step, args.seed, copy_len, batch, device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits, _ = lm(inputs, backend=backend)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss))  # a sync per step: both runs pay it
        if t0 is not None:
            timed += inputs.numel()
    sync()
    seconds = time.perf_counter() - t0
    return {"backend": backend, "losses": losses, "tokens_per_s": timed / seconds if seconds > 0 else None,
            "timed_tokens": timed, "timed_seconds": seconds}


def smooth(xs: list[float], alpha: float = SMOOTH) -> list[float]:
    out, m = [], None
    for x in xs:
        m = x if m is None else alpha * x + (1 - alpha) * m
        out.append(m)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", type=float, default=TOLERANCE,
                    help=f"max abs difference of the smoothed loss curves, nats (default {TOLERANCE})")
    ap.add_argument("--out", default="train_loss.json", help="JSON results file (default train_loss.json)")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny model and task (with TRITON_INTERPRET=1 it runs on the CPU: a smoke test)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        return _fail(f"--steps: got {args.steps}; allowed: an integer >= 1")
    if not args.tolerance > 0:
        return _fail(f"--tolerance: got {args.tolerance}; allowed: a number > 0")
    import torch

    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        device = torch.device("cuda")
    elif args.tiny and os.environ.get("TRITON_INTERPRET") == "1":
        device = torch.device("cpu")
    else:
        return _fail("needs a CUDA GPU without TRITON_INTERPRET=1 (or --tiny with TRITON_INTERPRET=1 for a CPU smoke run)")
    runs = [train(backend, args, device) for backend in ("triton", "reference")]
    diff = max(abs(a - b) for a, b in zip(smooth(runs[0]["losses"]), smooth(runs[1]["losses"]), strict=True))
    agree = diff <= args.tolerance
    doc = {"spec": "tiny" if args.tiny else str(SPEC.relative_to(ROOT)), "device": str(device),
           "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None, "steps": args.steps,
           "seed": args.seed, "vocab": VOCAB, "smooth_alpha": SMOOTH, "tolerance": args.tolerance,
           "max_abs_diff_smoothed": diff, "agree": agree, "runs": runs}
    from rtcompile.fileio import atomic_write

    atomic_write(args.out, json.dumps(doc, indent=1) + "\n")
    for r in runs:
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.4g}"
        print(f"{r['backend']:9}  loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}  tokens/s {tps}")
    print(f"max |smoothed triton - smoothed reference| = {diff:.4g} nats (tolerance {args.tolerance:g}): "
          f"{'agree' if agree else 'DISAGREE'}; wrote {args.out}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
