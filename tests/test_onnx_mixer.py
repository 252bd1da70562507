"""The ONNX mixer node (custom domain + model-local function) in onnxruntime vs the reference."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from rtcompile.export.onnx_mixer import DOMAIN, UPDATE_RULES, mixer_model
from rtcompile.kernels.reference import running_tensor_recurrent_ref

WIDTHS = {2: (5,), 3: (3, 4), 4: (2, 3, 2)}


def _session(model):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("order", [2, 3, 4], ids=["o2", "o3", "o4"])
@pytest.mark.parametrize("rule", UPDATE_RULES)
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2", "raw"])
def test_onnxruntime_matches_reference(order, rule, l2norm):
    model = mixer_model(order, rule, l2norm, scale=0.37, chunk_size=64, variant='{"kernel": "chunk"}')
    onnx.checker.check_model(model, full_check=True)
    assert model.graph.node[0].domain == DOMAIN and model.functions[0].name == "RunningTensor"
    sess = _session(model)
    widths = WIDTHS[order]
    for B, T in ((2, 9), (3, 1)):  # batch and sequence axes are dynamic; T = 1 is the decode step
        gen = torch.Generator().manual_seed(B * 100 + T)
        r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
        q, k, v = [r(B, T, 2, w) for w in widths], [r(B, T, 2, w) for w in widths], r(B, T, 2, 6)
        g = -torch.rand(B, T, 2, generator=gen, dtype=torch.float64) if "gated" in rule else None
        beta = torch.rand(B, T, 2, generator=gen, dtype=torch.float64) if "delta" in rule else None
        s0 = r(B, 2, *widths, 6)
        f32 = lambda x: x.float().numpy()
        feeds = {f"q{i + 1}": f32(x) for i, x in enumerate(q)} | {f"k{i + 1}": f32(x) for i, x in enumerate(k)}
        feeds |= {"v": f32(v), "past_state": f32(s0)}
        if g is not None:
            feeds["decay"] = f32(g)
        if beta is not None:
            feeds["beta"] = f32(beta)
        o, s = sess.run(None, feeds)
        up = lambda x: None if x is None else x.float().double()
        o_ref, s_ref = running_tensor_recurrent_ref([up(x) for x in q], [up(x) for x in k], up(v), up(g), up(beta),
                                                    scale=0.37, initial_state=up(s0), output_final_state=True,
                                                    l2norm=l2norm)
        rel = lambda a, b: float(np.abs(a - b.numpy()).max() / np.abs(b.numpy()).max())
        assert o.shape == tuple(o_ref.shape) and s.shape == tuple(s_ref.shape)
        assert rel(o, o_ref) < 1e-4 and rel(s, s_ref) < 1e-4


def test_bad_arguments():
    with pytest.raises(ValueError, match="update_rule"):
        mixer_model(3, "fast", True, 1.0)
    with pytest.raises(ValueError, match="order"):
        mixer_model(1, "linear", True, 1.0)
