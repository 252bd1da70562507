import json, collections, sys, tempfile, numpy as np, onnxruntime as ort, torch
from pathlib import Path
from rtcompile.export.onnx_model import export_onnx
from rtcompile.model import RunningTensorLM
from rtcompile.spec import load_spec
spec = load_spec(sys.argv[1] if len(sys.argv) > 1 else "examples/order3_16x16.toml")
T = int(sys.argv[2]) if len(sys.argv) > 2 else 512
torch.manual_seed(0)
lm = RunningTensorLM(spec, vocab_size=256).float().eval()
tmp = Path(tempfile.mkdtemp())
chunk_path, token_path = export_onnx(lm, tmp)
so = ort.SessionOptions(); so.log_severity_level = 3; so.enable_profiling = True; so.profile_file_prefix = str(tmp / "prof")
s = ort.InferenceSession(str(chunk_path), so, providers=["CPUExecutionProvider"])
feeds = {"tokens": np.random.RandomState(0).randint(0, 256, size=(1, T)).astype(np.int64)}
for _ in range(3): s.run(None, feeds)
f = s.end_profiling()
ev = json.load(open(f))
by = collections.Counter(); cnt = collections.Counter()
runs = [e for e in ev if e.get("name") == "model_run"]
for e in ev:
    if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
        op = e["args"].get("op_name"); by[op] += e["dur"]; cnt[op] += 1
tot = sum(by.values())
print("model_run us", [r["dur"] for r in runs])
for op, d in by.most_common(15): print(f"{op:20s} {d/3/1e3:8.2f} ms/run {100*d/tot:5.1f}%  n={cnt[op]//3}")
byn = collections.Counter(); shapes = {}
for e in ev:
    if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["args"].get("op_name") in ("MatMul", "FusedMatMul", "Scan", "Mul"):
        byn[e["name"]] += e["dur"]; shapes[e["name"]] = (e["args"].get("input_type_shape"), e["args"].get("output_type_shape"))
for n, d in byn.most_common(14): print(f"{d/3/1e3:7.2f} ms {n[:60]:60s} {str(shapes[n])[:150]}")
