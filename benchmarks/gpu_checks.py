"""The planner's regret and the bundle check on the GPU, in one script.

    python benchmarks/gpu_checks.py regret --out DIR     # every alternative measured at 18 points
    python benchmarks/gpu_checks.py bundle --out DIR     # a bundle on the GPU vs ONNX Runtime (CPU)
    python benchmarks/gpu_checks.py first_call --out DIR # load + first calls, with / without compiled kernels
    python benchmarks/gpu_checks.py rowgate --out DIR    # the tuner's per-row gate on the proposals' outputs

``regret``: for each example spec and each (phase, shape) point, the plan's decision is compared
with a measurement of every alternative the planner considered (median of CUDA-event repeats on
fresh random inputs). Regret = time of the chosen alternative / fastest measured - 1. The cost
model's error is |log(predicted / measured)|, reported uncalibrated and after
``costmodel.calibrate`` (a scale on the kernel time and a host overhead per kind of call: chunk,
recurrent prefill, decode step) fitted on the even-numbered points and evaluated on the
odd-numbered ones (held out), so calibration is not judged on its own data.

``bundle``: exports a bundle (weights, plan, ONNX graphs) from a seeded model, loads it with
``rtcompile.load`` and runs the torch module on the Triton kernels (the plan's pinned variants)
in bf16 and in fp32, against ONNX Runtime on the CPU in fp32: prefill logits and 16 decode
steps fed the same tokens (ONNX Runtime's greedy choice) on both sides.

``first_call``: a fresh process (empty Triton cache) loads the example bundle and runs its first
prefill (T 1024) and two decode steps; once with the compiled kernels export collected on this
machine, once from the same bundle exported without them.

``rowgate``: every chunk proposal of the defaults table (``forms.candidates``) at four shapes,
bf16 and fp32, run as the tuner's gate runs it (NaN-poisoned, a CUDA-graph replay on a GPU),
against the float64 token loop: the global relative RMS error and the worst token row's
(``objective.worst_row``), each beside the gate's tolerances (``TOLERANCE``, ``ROW_TOLERANCE``).
The row tolerance (5x the global) was set from interpreter runs: a correct kernel must clear it
on the GPU too, or the tuner rejects it.

``--quick`` runs tiny shapes (with ``TRITON_INTERPRET=1`` on a CPU machine): the tests use it
so the script cannot rot; its numbers mean nothing. Each subcommand writes ``DIR/<name>.json``
and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rtcompile.costmodel import Calibration, Cost, calibrate, chunk_cost, recurrent_cost  # noqa: E402
from rtcompile.kernels.inputs import random_inputs  # noqa: E402
from rtcompile.kernels.forms import config_from_dict  # noqa: E402
from rtcompile.kernels.launch import running_tensor_decode_, running_tensor_fwd  # noqa: E402
from rtcompile.plan import make_plan  # noqa: E402
from rtcompile.spec import Features, ModelSpec, load_spec  # noqa: E402
from rtcompile.target import get_target  # noqa: E402
from rtcompile.timing import median_seconds  # noqa: E402

TINY = ModelSpec(order=3, key_widths=(2, 4), value_width=8, heads=2, model_width=16, layers=1,
                 features=Features(short_conv=3))


def _device() -> str:
    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    return "cuda" if on_gpu else "cpu"


def _inputs(spec: ModelSpec, B: int, T: int, device: str, seed: int):
    *qkvgb, gen = random_inputs(B, T, spec.heads, spec.key_widths, spec.value_width, spec.input_dtype, device, seed)
    s0 = torch.randn(B, spec.heads, *spec.key_widths, spec.value_width, generator=gen).to(device)
    return (*qkvgb, s0)


def _call(spec: ModelSpec, phase: str, mode: str, variant: dict, B: int, T: int, device: str, seed: int):
    """A zero-argument call running one alternative on fresh inputs (decode: in place on slots)."""
    q, k, v, g, beta, s0 = _inputs(spec, B, T, device, seed)
    if phase == "decode" and mode == "recurrent":
        idx = torch.randperm(B, generator=torch.Generator().manual_seed(seed)).to(device, torch.int32)
        rv = _variant(mode, variant)
        return lambda: running_tensor_decode_(q, k, v, g, beta, state_cache=s0, state_indices=idx, l2norm=True,
                                              validate=False, variant=rv)
    var = _variant(mode, variant)
    return lambda: running_tensor_fwd(q, k, v, g, beta, initial_state=s0, output_final_state=True, l2norm=True,
                                      mode=mode, variant=var)


def _predict(spec, target, phase, mode, variant, B, T, cal) -> Cost:
    """The model's cost of one measured alternative; a recurrent decode alternative is timed as
    the in-place step (see :func:`_call`), so it is costed as one."""
    if mode == "chunk":
        return chunk_cost(spec, target, B, T, _variant(mode, variant), cal)
    step = phase == "decode"
    return recurrent_cost(spec, target, B, T, _variant(mode, variant), cal, step=step)


def _variant(mode: str, variant: dict):
    """The kernel configuration of one plan alternative, from the dict the plan stores."""
    return config_from_dict(variant, "chunk" if mode == "chunk" else "recurrent")


def _label(alt: dict) -> str:
    """How the tables name an alternative: its config's form."""
    return alt["variant"]["form"]


def regret(args) -> dict:
    device = _device()
    target = get_target(args.target or ("auto" if device == "cuda" else "h200"))
    if args.quick:
        specs = [("tiny", TINY)]
        batches, seqs, decode = (1,), (8, 40), (2,)
    else:
        specs = [(Path(p).stem, load_spec(ROOT / p)) for p in ("examples/order3_16x16.toml", "examples/order3_64x64.toml")]
        batches, seqs, decode = (1, 8), (16, 256, 4096), (1, 32, 256)
    rows = []
    for name, spec in specs:
        plan = make_plan(spec, target, batches=batches, seq_lens=seqs, decode_batches=decode)
        for d in plan.decisions:
            if d.phase == "train":
                continue  # forward-only kernels: nothing to measure for train yet
            alts = []
            for i, a in enumerate(d.alternatives):
                call = _call(spec, d.phase, a["mode"], a["variant"], d.batch, d.seq_len, device, seed=1000 + i)
                try:
                    secs = median_seconds(call, device, repeats=3 if args.quick else 10)
                except Exception as exc:  # noqa: BLE001 -- one failing alternative is a row, not a crash
                    secs, err = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                else:
                    err = None
                alts.append({**a, "measured_s": secs, "error": err})
            ok = [a for a in alts if a["measured_s"] is not None]
            chosen = next((a for a in alts if a["mode"] == d.mode and a["variant"] == d.variant), None)
            best = min(ok, key=lambda a: a["measured_s"]) if ok else None
            reg = None
            if chosen and chosen["measured_s"] and best:
                reg = chosen["measured_s"] / best["measured_s"] - 1
            rows.append({"spec": name, "phase": d.phase, "batch": d.batch, "seq_len": d.seq_len, "chosen": d.mode,
                         "chosen_label": _label(chosen) if chosen else d.mode,
                         "best": best["mode"] if best else None, "best_label": _label(best) if best else None,
                         "regret": reg, "alternatives": alts, "spec_dict": spec.to_dict()})
    # cost model: uncalibrated error everywhere; calibrated on even rows, judged on odd rows
    def errors(cal: Calibration, which):
        out = []
        for j, r in enumerate(rows):
            if not which(j):
                continue
            spec = ModelSpec.from_dict(r["spec_dict"])
            for a in r["alternatives"]:
                if a["measured_s"]:
                    p = _predict(spec, target, r["phase"], a["mode"], a["variant"], r["batch"], r["seq_len"], cal)
                    out.append(abs(math.log(p.seconds / a["measured_s"])))
        return out

    pred: dict[str, list[Cost]] = {}
    meas: dict[str, list[float]] = {}
    for j, r in enumerate(rows):
        if j % 2:
            continue
        spec = ModelSpec.from_dict(r["spec_dict"])
        for a in r["alternatives"]:
            if a["measured_s"]:
                c = _predict(spec, target, r["phase"], a["mode"], a["variant"], r["batch"], r["seq_len"],
                             Calibration())
                pred.setdefault(c.kind, []).append(c)
                meas.setdefault(c.kind, []).append(a["measured_s"])
    cal = calibrate(pred, meas)
    held_out = lambda j: j % 2 == 1
    before, after = errors(Calibration(), held_out), errors(cal, held_out)
    summary = {
        "points": len(rows),
        "max_regret": max((r["regret"] for r in rows if r["regret"] is not None), default=None),
        "within_5pct": sum(1 for r in rows if r["regret"] is not None and r["regret"] <= 0.05),
        "calibration": cal.to_dict(),
        "cost_error_median_before": statistics.median(before) if before else None,
        "cost_error_median_after": statistics.median(after) if after else None,
        "cost_error_max_before": max(before, default=None),
        "cost_error_max_after": max(after, default=None),
        "target": target.name, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "quick": args.quick,
    }
    for r in rows:
        r.pop("spec_dict")
    return {"summary": summary, "rows": rows}


def _rel_rms(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float(((a - b).pow(2).mean() / b.pow(2).mean().clamp_min(1e-300)).sqrt())


# Logits' relative RMS against ONNX Runtime's fp32 graphs: fp32 the CPU ONNX tests' 1e-4; bf16
# the CPU kernel tests' bf16 tolerance, 1e-2 (2.5x bf16's unit roundoff, 2^-8 = 3.9e-3).
REL_RMS_TOL = {"float32": 1e-4, "bfloat16": 1e-2}


def bundle(args) -> dict:
    import numpy as np
    import onnxruntime as ort

    import rtcompile
    from rtcompile.export import export_bundle
    from rtcompile.model import RunningTensorLM

    device = _device()
    target = get_target(args.target or ("auto" if device == "cuda" else "h200"))
    spec = TINY if args.quick else load_spec(ROOT / "examples/order3_16x16.toml")
    B, T, steps = (2, 9, 4) if args.quick else (2, 128, 16)
    torch.manual_seed(0)
    model = RunningTensorLM(spec, vocab_size=64 if args.quick else 256).float().eval()
    plan = make_plan(spec, target, batches=(B,), seq_lens=(T,), decode_batches=(B,))
    out = Path(args.out) / "bundle"
    export_bundle(model, out, plan=plan, overwrite=True, onnx=True)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    pre = ort.InferenceSession(str(out / "prefill.onnx"), opts, providers=["CPUExecutionProvider"])
    dec = ort.InferenceSession(str(out / "decode.onnx"), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in dec.get_inputs()][1:]
    tokens = torch.randint(0, model.head.out_features, (B, T), generator=torch.Generator().manual_seed(1))
    ort_out = pre.run(None, {"tokens": tokens.numpy()})
    ort_logits, state = [ort_out[0]], ort_out[1:]
    fed, tok = [], ort_out[0][:, -1].argmax(-1)
    for _ in range(steps):  # ONNX Runtime's greedy tokens are fed to both sides
        fed.append(tok)
        o = dec.run(None, {"tokens": tok[:, None].astype(np.int64), **dict(zip(names, state))})
        ort_logits.append(o[0][:, 0])
        state, tok = o[1:], o[0][:, 0].argmax(-1)
    results = {}
    dtypes = ("float32",) if args.quick else ("float32", "bfloat16")
    for dt in dtypes:
        loaded = rtcompile.load(out).to(device=device, dtype=getattr(torch, dt))
        backend = "triton"
        with torch.no_grad():
            logits, cache = loaded(tokens.to(device), backend=backend)
            errs = [_rel_rms(logits.float().cpu(), ort_logits[0])]
            for i, t in enumerate(fed):
                lg, cache = loaded.step(torch.from_numpy(t).to(device), cache, backend=backend)
                errs.append(_rel_rms(lg.float().cpu(), ort_logits[i + 1]))
        tol = REL_RMS_TOL[dt]
        results[dt] = {"prefill_rel_rms": errs[0], "decode_rel_rms_max": max(errs[1:]), "steps": len(fed),
                       "tolerance": tol, "within_tolerance": max(errs) <= tol}
    summary = {"spec": spec.to_dict(), "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
               "batch": B, "prompt": T, "results": results, "pinned_variants": [
                   {"phase": d.phase, "mode": d.mode, "variant": d.variant} for d in plan.decisions
                   if d.phase != "train"], "quick": args.quick}
    return {"summary": summary}


_FIRST_CALL = """
import sys, time
t0 = time.perf_counter()
import torch, rtcompile
dev = "cuda" if torch.cuda.is_available() else "cpu"
if dev == "cuda":
    torch.cuda.init()
t1 = time.perf_counter()
m = rtcompile.load(sys.argv[1]).to(dev)
t2 = time.perf_counter()
with torch.no_grad():
    m(torch.zeros(1, int(sys.argv[2]), dtype=torch.long, device=dev))
    if dev == "cuda":
        torch.cuda.synchronize()
    t3 = time.perf_counter()
    m.generate(torch.zeros(1, 4, dtype=torch.long, device=dev), 2)
if dev == "cuda":
    torch.cuda.synchronize()
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {t3 - t2:.3f} {time.perf_counter() - t3:.3f}")
"""

# A fresh process's stages, each alone: on 2026-12-02 (H200) import + load + first calls read 7.78 s +
# 3.42 s with the compiled kernels, the import and the prefill not told apart; the plain bundle ran
# past the call's limit (over 96 s), so each child now has a limit of its own
FIRST_CALL_LIMIT_S = 240


def first_call(args) -> dict:
    """Seconds of a fresh process's import, ``rtcompile.load``, first prefill (T = the plan's) and
    generate (a 4-token prompt, two decode steps), with an empty Triton cache each time: the bundle with its compiled kernels
    (exported on this machine) and the same bundle exported without them."""
    import subprocess
    import tempfile

    from rtcompile.export import export_bundle
    from rtcompile.model import RunningTensorLM

    device = _device()
    target = get_target(args.target or ("auto" if device == "cuda" else "h200"))
    spec = TINY if args.quick else load_spec(ROOT / "examples/order3_16x16.toml")
    T = 9 if args.quick else 1024
    torch.manual_seed(0)
    model = RunningTensorLM(spec, vocab_size=64 if args.quick else 256).float().eval()
    plan = make_plan(spec, target, batches=(1,), seq_lens=(T,), decode_batches=(1,))
    rows = {}
    t0 = time.perf_counter()
    # each stage stamped on stderr, each row in first_call.partial.json as it lands: a run of 2026-12-02
    # overran a 170 s limit and left nothing to say which stage took the time
    for name, with_kernels in (("with compiled kernels", True), ("without", False)):
        out = Path(args.out) / f"bundle-{'kernels' if with_kernels else 'plain'}"
        export_bundle(model, out, plan=plan, overwrite=True, onnx=False, compiled=with_kernels)
        print(f"[{time.perf_counter() - t0:6.1f}s] exported {out.name}", file=sys.stderr, flush=True)
        kernels = json.loads((out / "manifest.json").read_text())["kernels"]
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            try:
                done = subprocess.run([sys.executable, "-c", _FIRST_CALL, str(out), str(T)], env=env,
                                      capture_output=True, text=True, check=True, timeout=FIRST_CALL_LIMIT_S)
            except subprocess.TimeoutExpired:
                done = None
        if done is None:
            rows[name] = {"over_s": FIRST_CALL_LIMIT_S, "kernels": kernels is not None}
        else:
            stages = dict(zip(("import_s", "load_s", "first_prefill_s", "first_decode_s"),
                              map(float, done.stdout.split()[-4:])))
            rows[name] = {**stages, "kernels": kernels is not None}
        print(f"[{time.perf_counter() - t0:6.1f}s] {name}: {rows[name]}", file=sys.stderr, flush=True)
        (Path(args.out) / "first_call.partial.json").write_text(json.dumps(rows, indent=1))
    summary = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "prompt": T, "rows": rows,
               "quick": args.quick}
    return {"summary": summary}


ROWGATE_SHAPES = [(64,), (8, 8), (16, 16), (32, 32)]


def _config_label(d: dict) -> str:
    """A proposal named by the fields that tell the defaults table's rows apart."""
    extra = [f"{d[k]}" for k in ("loop", "solve") if k in d] + (["materialised"] if d.get("materialise") else [])
    return f"{d['form']} C{d['chunk_size']} {' '.join(extra)}".strip()


def rowgate(args) -> dict:
    from rtcompile.kernels.args import poisoned
    from rtcompile.kernels.config import KernelShape
    from rtcompile.kernels.forms import candidates
    from rtcompile.timing import as_replayed
    from rtcompile.tuning import objective
    from rtcompile.tuning.keys import Bucket
    from rtcompile.tuning.objective import ROW_TOLERANCE, TOLERANCE, rel_rms, worst_row

    device = _device()
    B, T, H, V = (2, 32, 2, 8) if args.quick else (2, 2048, 8, 64)
    shapes = [(2, 4), (4,)] if args.quick else ROWGATE_SHAPES
    if args.widths:
        shapes = [tuple(int(w) for w in part.split("x")) for part in args.widths.split(",")]
    rows, start = [], time.perf_counter()
    # a row a line as it goes, flushed: a device call cut at its time limit keeps the rows it ran
    partial = open(Path(args.out) / "rowgate.partial.jsonl", "w", encoding="utf-8")
    for widths in shapes:
        for dtype in ("bfloat16", "float32"):
            bucket = Bucket("chunk", widths, V, H, B, T, dtype)
            inp = objective.make_inputs(bucket, device, seed=7)
            ref = objective.reference(bucket, inp)["o"]
            shape = KernelShape(tuple(widths), V, 2 if dtype == "bfloat16" else 4)
            for cfg in candidates("chunk", shape):
                # as the tuner's gate runs it (objective.evaluate): NaN-poisoned outputs and
                # workspaces, and on a GPU a CUDA-graph replay, where the pipelined parts run
                with poisoned():
                    o, _ = as_replayed(lambda: objective.run_kernel(bucket, cfg, inp), device)
                glob, (row, (b, t)) = rel_rms(o, ref), worst_row(o, ref)
                variant = cfg.to_dict()
                r = {"widths": "x".join(map(str, widths)), "dtype": dtype, "config": _config_label(variant),
                     "variant": variant, "global": glob, "worst_row": row, "at": [b, t],
                     "row_over_global": row / glob if glob > 0 else None,
                     "passes": glob <= TOLERANCE[dtype] and row <= ROW_TOLERANCE[dtype]}
                rows.append(r)
                partial.write(json.dumps(r) + "\n")
                partial.flush()
                print(f"rowgate {time.perf_counter() - start:6.1f} s {r['widths']} {dtype} {r['config']}: "
                      f"global {glob:.2e} row {row:.2e} passes {r['passes']}", file=sys.stderr, flush=True)
    partial.close()
    ratios = [r["row_over_global"] for r in rows if r["row_over_global"] is not None]
    summary = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
               "B": B, "T": T, "H": H, "V": V, "configs": len(rows), "rejected": sum(not r["passes"] for r in rows),
               "row_over_global_max": max(ratios) if ratios else None,
               "row_margin_min": min((ROW_TOLERANCE[r["dtype"]] / r["worst_row"] for r in rows if r["worst_row"] > 0),
                                     default=None)}
    return {"rows": rows, "summary": summary}


def _table(name: str, data: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=name, header_style="bold")
    if name == "regret":
        for c in ("spec", "phase", "B", "T", "chosen", "best", "regret", "ms per alternative"):
            t.add_column(c)
        for r in data["rows"]:
            alts = ", ".join(f"{_label(a)} {a['measured_s'] * 1e3:.3g}" if a["measured_s"] else f"{_label(a)} failed"
                             for a in r["alternatives"])
            reg = f"{r['regret'] * 100:.1f}%" if r["regret"] is not None else "-"
            t.add_row(r["spec"], r["phase"], str(r["batch"]), str(r["seq_len"]), r["chosen_label"], str(r["best_label"]),
                      reg, alts)
    if name == "rowgate":
        for c in ("widths", "dtype", "config", "global", "worst row", "row / global", "at (b, t)", "passes"):
            t.add_column(c)
        for r in data["rows"]:
            ratio = "-" if r["row_over_global"] is None else f"{r['row_over_global']:.2f}"
            t.add_row(r["widths"], r["dtype"], r["config"], f"{r['global']:.2e}", f"{r['worst_row']:.2e}", ratio,
                      str(tuple(r["at"])), "yes" if r["passes"] else "NO")
    Console(width=200).print(t)
    print(json.dumps(data["summary"], indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("check", choices=["regret", "bundle", "first_call", "rowgate"])
    ap.add_argument("--out", required=True, help="directory for <check>.json (and the bundle)")
    ap.add_argument("--target", help="target profile (default: auto on a GPU, h200 on the CPU)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, for the CPU tests")
    ap.add_argument("--widths", help="rowgate: key widths to check, e.g. 64,16x16 (default: 64,8x8,16x16,32x32)")
    args = ap.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    data = {"regret": regret, "bundle": bundle, "first_call": first_call, "rowgate": rowgate}[args.check](args)
    path = Path(args.out) / f"{args.check}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)
    _table(args.check, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
