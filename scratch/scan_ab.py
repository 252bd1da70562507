import time, numpy as np, onnxruntime as ort, sys
sys.path.insert(0, "scratch")
import old_onnx_mixer as old
from rtcompile.export import onnx_mixer as new
rng = np.random.default_rng(0)
B, T, H, d, dv = 1, 256, 8, 16, 64
feeds = {f"q{i}": rng.standard_normal((B, T, H, d), dtype=np.float32) for i in (1, 2)}
feeds |= {f"k{i}": rng.standard_normal((B, T, H, d), dtype=np.float32) for i in (1, 2)}
feeds |= {"v": rng.standard_normal((B, T, H, dv), dtype=np.float32), "past_state": np.zeros((B, H, d, d, dv), np.float32),
          "decay": -rng.random((B, T, H), dtype=np.float32), "beta": rng.random((B, T, H), dtype=np.float32)}
so = ort.SessionOptions(); so.log_severity_level = 3
sess = {n: ort.InferenceSession(m.mixer_model(3, "gated_delta", True, 0.25).SerializeToString(), so, providers=["CPUExecutionProvider"]) for n, m in (("old", old), ("new", new))}
outs = {n: s.run(None, feeds) for n, s in sess.items()}
print("max diff o", np.abs(outs["old"][0] - outs["new"][0]).max(), "state", np.abs(outs["old"][1] - outs["new"][1]).max())
best = {n: 1e9 for n in sess}
for _ in range(7):
    for n, s in sess.items():
        t = time.perf_counter(); s.run(None, feeds); best[n] = min(best[n], time.perf_counter() - t)
print({n: round(v * 1e3, 2) for n, v in best.items()}, "ms, B1 T256 o3 16x16 gated_delta l2norm")
