"""The ONNX graphs in onnxruntime on the CPU: the exported prefill graph (the mixer's
chunk-parallel function body, ``export/onnx_chunk.py``) and decode graph (its one-token body)
each against the same graph with the token Scan body (``body="scan"``), in one process, beside the
torch reference on the same CPU threads.

    python3 benchmarks/onnx_cpu.py [SPEC] [--seq-len 128,512,2048] [--batch 1] [--threads N]

Each pair of graphs differs only in the mixer node's function (the Scan graph is the exported
one with its function swapped), so the table compares the bodies and nothing else. Prefill rows:
the best of 3 timed runs after one warm-up; decode rows: one step after a 64-token prompt, the
best of 20 steps (the state fed back); the model's weights are seeded, the tokens random.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _best(fn, runs: int = 3) -> float:
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None) -> int:
    from rtcompile.cli_args import int_list

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default=str(ROOT / "examples" / "order3_16x16.toml"))
    ap.add_argument("--seq-len", type=int_list, default=[128, 512, 2048])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads for both engines (0: their defaults)")
    ap.add_argument("--skip-scan-above", type=int, default=4096, help="leave the token Scan out above this T")
    a = ap.parse_args(argv)
    import numpy as np
    import onnx
    import onnxruntime as ort
    import torch

    from rtcompile.export.onnx_mixer import running_tensor_function
    from rtcompile.export.onnx_model import ONNX_CHUNK, export_onnx
    from rtcompile.model import RunningTensorLM
    from rtcompile.spec import load_spec

    spec = load_spec(a.spec)
    torch.manual_seed(0)
    lm = RunningTensorLM(spec, vocab_size=256).float().eval()
    tmp = Path(tempfile.mkdtemp(prefix="onnx_cpu_"))
    chunk_path, token_path = export_onnx(lm, tmp)

    def with_scan_body(path: str) -> str:
        model = onnx.load(path)
        opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        model.functions.pop()  # the mixer's function is the last one export attaches
        model.functions.append(running_tensor_function(spec.order, spec.features.update_rule, spec.features.l2norm,
                                                       opset=opset, body="scan"))
        out = str(Path(path).with_name(Path(path).stem + "_scan.onnx"))
        onnx.save(model, out)
        return out

    scan_path, scan_decode_path = with_scan_body(chunk_path), with_scan_body(token_path)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if a.threads:
        so.intra_op_num_threads = a.threads
        torch.set_num_threads(a.threads)
    sess = {name: ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])
            for name, p in (("chunk", chunk_path), ("scan", scan_path), ("token", token_path),
                            ("scan_decode", scan_decode_path))}
    print(f"{spec.name or a.spec}: order {spec.order} {spec.key_widths}, {spec.layers} layers, d_model "
          f"{spec.model_width}; onnxruntime {ort.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"threads {a.threads or 'default'}; chunk body C {ONNX_CHUNK}")
    print(f"{'B':>3} {'T':>6} {'chunk body ms':>14} {'scan body ms':>13} {'torch ref ms':>13} {'chunk tok/s':>12} "
          f"{'scan / chunk':>12} {'max |diff|':>10}")
    for T in a.seq_len:
        tok = np.random.RandomState(T).randint(0, 256, size=(a.batch, T)).astype(np.int64)
        feeds = {"tokens": tok}
        t_chunk = _best(lambda: sess["chunk"].run(None, feeds))
        scan = T <= a.skip_scan_above
        t_scan = _best(lambda: sess["scan"].run(None, feeds), runs=1) if scan else float("nan")
        with torch.no_grad():
            t_ref = _best(lambda: lm(torch.from_numpy(tok), backend="reference"))
            ref = lm(torch.from_numpy(tok), backend="reference")[0].numpy()
        diff = float(np.abs(sess["chunk"].run(None, feeds)[0] - ref).max())
        print(f"{a.batch:3} {T:6} {t_chunk * 1e3:14.1f} {t_scan * 1e3:13.1f} {t_ref * 1e3:13.1f} "
              f"{a.batch * T / t_chunk:12.0f} {t_scan / t_chunk:12.1f} {diff:10.2e}")
    # decode: one step after a 64-token prompt, the state fed back, best of 20
    prompt = np.random.RandomState(1).randint(0, 256, size=(a.batch, 64)).astype(np.int64)
    outs = sess["chunk"].run(None, {"tokens": prompt})
    names = [i.name for i in sess["token"].get_inputs()][1:]
    tok = outs[0][:, -1].argmax(-1)[:, None].astype(np.int64)
    step_s = {}
    for name in ("token", "scan_decode"):
        state, best = outs[1:], float("inf")
        for i in range(23):
            t = time.perf_counter()
            out = sess[name].run(None, {"tokens": tok, **dict(zip(names, state))})
            if i >= 3:
                best = min(best, time.perf_counter() - t)
            state = out[1:]
        step_s[name] = best
    with torch.no_grad():
        _, cache = lm(torch.from_numpy(prompt), backend="reference")
        t_step = _best(lambda: lm.step(torch.from_numpy(tok[:, 0]), cache, backend="reference"), runs=20)
    print(f"decode step B{a.batch}: token body {step_s['token'] * 1e3:.2f} ms, token Scan body "
          f"{step_s['scan_decode'] * 1e3:.2f} ms ({step_s['scan_decode'] / step_s['token']:.1f}x), torch reference "
          f"{t_step * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
