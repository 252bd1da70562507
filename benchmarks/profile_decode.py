"""Per-kernel GPU time of the example model's CUDA-graph decode step (torch.profiler), to see
where the step's time goes against issue 21's targets (B1 <= 80 us, B256 >= 1.2 M tokens/s).

    python benchmarks/profile_decode.py [--spec examples/order3_16x16.toml] [--batches 1 256]
                                        [--steps plain,stacked,compiled,combo] [--parts 1,2]
                                        [--state-dtype float32] [--out FILE.json]

Per batch and step kind (``plain``: generate's StaticStep; ``stacked``: its input maps as one
product per layer; ``compiled``: stacked and fused by torch.compile with inductor's defaults; ``combo``: with
inductor's combo kernels too; ``layers``: and each eligible layer's step one kernel, as
``compile_step`` does; ``autotune``: combo and GEMM autotuning; ``layers_autotune`` / ``layers_triton_gemm``: layers
and GEMM autotuning, or inductor's Triton GEMM templates alone):
the step captured as ``rtcompile bench --model`` captures it, 3 warm-up replays, then 20
profiled replays; prints each kernel's mean time per step (us), largest first, their sum, the
kernel count per step and the step's wall time between CUDA events (median of 5 x 20 replays),
so launch gaps show as the difference. ``--parts``: each step also in that many micro-batches
(``StaticStep(parts=...)``, rtcompile.overlap; the kernel sum then counts overlapped kernels
apart); each row's first logits against the same kind's whole step (max abs difference: the
same tokens and cache in, so it shows a wrong split). ``--state-dtype``: the spec's state_dtype
replaced (bfloat16: issue 21's bf16 state row). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# kind: (compiled, stacked, inductor options); "combo": inductor's combo kernels, which launch
# independent pointwise kernels (the decode kernel's inputs: five per layer) as one
STEPS = {"plain": (False, False, None), "stacked": (False, True, None), "compiled": (True, True, {}),
         "combo": (True, True, {"combo_kernels": True}),  # the compiled step's default since 2026-12-02
         # and inductor's GEMM autotuning (its Triton templates against cuBLAS): the step's small-M
         # products are latency-bound, 38 us of the B256 step for ~2 us of bf16 FLOPs (H200)
         "autotune": (True, True, {"combo_kernels": True, "max_autotune_gemm": True}),
         # combo, and each layer whose decode tile covers a head's values in one kernel from the stacked
         # product to the gated output (StaticStep(fuse_layers=True), kernels/layer_step.py)
         "layers": (True, True, {"combo_kernels": True}),
         # layers, and inductor's GEMM autotuning: cuBLAS against its Triton templates, or the
         # templates alone (which take the bias, GELU and residual adds as epilogues)
         "layers_autotune": (True, True, {"combo_kernels": True, "max_autotune_gemm": True}),
         "layers_triton_gemm": (True, True, {"combo_kernels": True, "max_autotune_gemm": True,
                                             "max_autotune_gemm_backends": "TRITON"})}
FUSED_LAYERS = ("layers", "layers_autotune", "layers_triton_gemm")
REPLAYS = 20
ROUNDS = 5


def _profile(lm, batch: int, kind: str, parts: int) -> dict:
    import torch

    from rtcompile.generate import StaticStep, bucket_of

    compiled, stacked, options = STEPS[kind]
    with torch.no_grad():
        prompt = torch.randint(0, lm.embed.num_embeddings, (batch, 16), device="cuda",
                               generator=torch.Generator(device="cuda").manual_seed(0))
        logits, cache = lm(prompt, backend="triton")
        step = StaticStep(lm, bucket_of(batch), "triton", capture=True, compiled=compiled, fuse_projections=stacked,
                          inductor_options=options, parts=parts, fuse_layers=kind in FUSED_LAYERS)
        fused_layers = sum(f.step is not None for f in step.fused or [])
        step.load(cache, batch)
    tok = logits[:, -1].argmax(-1)
    first = step(tok).clone()  # from the prefill's cache: the same for every parts of this batch
    for _ in range(3):
        step(tok)
    torch.cuda.synchronize()
    walls = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            step(tok)
        end.record()
        torch.cuda.synchronize()
        walls.append(start.elapsed_time(end) * 1e3 / REPLAYS)
    wall_us = statistics.median(walls)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            step(tok)
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(float)
    launches = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name] += e.device_time / REPLAYS  # us
            launches[e.name] += 1
    rows = sorted(per_kernel.items(), key=lambda kv: -kv[1])
    return {"batch": batch, "step": kind, "parts": parts, "first_logits": first, "fused_layers": fused_layers,
            "wall_us": wall_us,
            "walls_us": [round(w, 2) for w in walls], "kernel_us": sum(per_kernel.values()),
            "kernels_per_step": sum(launches.values()) / REPLAYS,
            "top": [{"kernel": name[:90], "us": round(us, 2), "per_step": launches[name] / REPLAYS}
                    for name, us in rows[:15]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="examples/order3_16x16.toml")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--steps", default="plain,stacked,compiled,combo", help=f"comma list of {', '.join(STEPS)}")
    ap.add_argument("--parts", default="1", help="comma list of micro-batch counts (each a power of two)")
    ap.add_argument("--state-dtype", choices=("float32", "bfloat16"), help="replace the spec's state_dtype")
    ap.add_argument("--out", help="write the rows as JSON")
    args = ap.parse_args(argv)
    kinds = [k for k in args.steps.split(",") if k]
    unknown = [k for k in kinds if k not in STEPS]
    if unknown:
        ap.error(f"--steps: {', '.join(unknown)}; allowed: {', '.join(STEPS)}")
    try:
        parts = sorted({int(p) for p in args.parts.split(",") if p})  # 1 first: the others compare with it
    except ValueError:
        ap.error(f"--parts: got {args.parts!r}; allowed: a comma list of powers of two")
    if not parts or any(p < 1 or p & (p - 1) for p in parts):
        ap.error(f"--parts: got {args.parts!r}; allowed: a comma list of powers of two")
    import dataclasses

    import torch

    if not torch.cuda.is_available():
        print("profile_decode.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    from rtcompile.bench.lm import VOCAB
    from rtcompile.generate import bucket_of
    from rtcompile.model import RunningTensorLM
    from rtcompile.spec import load_spec

    spec = load_spec(args.spec)
    if args.state_dtype:
        spec = dataclasses.replace(spec, state_dtype=args.state_dtype)
    torch.manual_seed(0)
    lm = RunningTensorLM(spec, vocab_size=VOCAB).to("cuda", getattr(torch, spec.input_dtype)).eval()
    results = []
    for batch in args.batches:
        firsts = {}  # the whole step's first logits by kind: "layers" against "combo"
        for kind in kinds:
            whole = None
            for p in parts:
                if batch % p or bucket_of(batch) % p:
                    continue
                r = _profile(lm, batch, kind, p)
                first = r.pop("first_logits")
                whole = first if p == 1 else whole
                r["max_abs_vs_whole"] = None if whole is None else float((first - whole).abs().max())
                if p == 1:
                    firsts[kind] = first
                    if kind in FUSED_LAYERS and "combo" in firsts:
                        r["max_abs_vs_combo"] = float((first - firsts["combo"]).float().abs().max())
                r["state_dtype"] = spec.state_dtype
                results.append(r)
                diff = "" if p == 1 or whole is None else f", first logits vs whole {r['max_abs_vs_whole']:.2e}"
                if "max_abs_vs_combo" in r:
                    diff += f", {r['fused_layers']} layers fused, first logits vs combo {r['max_abs_vs_combo']:.2e}"
                print(f"B{batch} {kind} parts {p}: wall {r['wall_us']:.1f} us, kernels {r['kernel_us']:.1f} us, "
                      f"{r['kernels_per_step']:.0f} kernels a step{diff}")
                for t in r["top"][:8]:
                    print(f"    {t['us']:8.2f} us  x{t['per_step']:.0f}  {t['kernel']}")
                if args.out:
                    Path(args.out).write_text(json.dumps(results, indent=1))
    for r in results:
        print(f"B{r['batch']:<4} {r['step']:<9} parts {r['parts']}  {r['state_dtype']:<9} wall {r['wall_us']:7.1f} us  "
              f"{r['batch'] / r['wall_us']:.3f} M tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
