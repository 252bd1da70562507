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
@pytest.mark.parametrize("body", ["scan", "chunk", "token"])
def test_onnxruntime_matches_reference(order, rule, l2norm, body):
    """Every function body against the float64 token loop: the token Scan, the chunk form in
    chunks of 8 (T 9 and 23: a partial last chunk; 16: whole ones; 1: one padded chunk), and
    the one-token body (T 1 only)."""
    model = mixer_model(order, rule, l2norm, scale=0.37, chunk_size=64, variant='{"kernel": "chunk"}', body=body,
                        chunk=8)
    onnx.checker.check_model(model, full_check=True)
    assert model.graph.node[0].domain == DOMAIN and model.functions[0].name == "RunningTensor"
    sess = _session(model)
    widths = WIDTHS[order]
    shapes = ((3, 1), (1, 1)) if body == "token" else ((2, 9), (3, 1), (1, 16), (2, 23))
    for B, T in shapes:  # batch and sequence axes are dynamic; T = 1: a decode step
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
    with pytest.raises(ValueError, match="body: got 'fast'; allowed: scan, chunk"):
        mixer_model(3, "linear", True, 1.0, body="fast")
    with pytest.raises(ValueError, match="chunk: got 12; allowed: a power of two"):
        mixer_model(3, "linear", True, 1.0, body="chunk", chunk=12)


def test_chunk_body_takes_extreme_decay():
    """Log decay of -inf and -300 (a gate shut): the chunk body clamps it as the chunk kernels
    do (exp of -inf - -inf would be NaN) and matches the token loop, which multiplies by 0."""
    model = mixer_model(3, "gated_delta", True, scale=0.5, body="chunk", chunk=8)
    sess = _session(model)
    gen = torch.Generator().manual_seed(7)
    B, T, widths = 2, 19, (3, 4)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k, v = [r(B, T, 2, w) for w in widths], [r(B, T, 2, w) for w in widths], r(B, T, 2, 6)
    g = -torch.rand(B, T, 2, generator=gen, dtype=torch.float64)
    g[0, 3] = float("-inf")
    g[1, 10:12] = -300.0
    beta = torch.rand(B, T, 2, generator=gen, dtype=torch.float64)
    s0 = r(B, 2, *widths, 6)
    f32 = lambda x: x.float().numpy()
    feeds = {f"q{i + 1}": f32(x) for i, x in enumerate(q)} | {f"k{i + 1}": f32(x) for i, x in enumerate(k)}
    feeds |= {"v": f32(v), "past_state": f32(s0), "decay": f32(g), "beta": f32(beta)}
    o, s = sess.run(None, feeds)
    o_ref, s_ref = running_tensor_recurrent_ref(q, k, v, g, beta, scale=0.5, initial_state=s0,
                                                output_final_state=True, l2norm=True)
    assert np.isfinite(o).all() and np.isfinite(s).all()
    assert np.abs(o - o_ref.numpy()).max() < 1e-4 * np.abs(o_ref.numpy()).max()
    assert np.abs(s - s_ref.numpy()).max() < 1e-4 * np.abs(s_ref.numpy()).max()


def test_token_body_refuses_more_than_one_token():
    """The decode graph's body squeezes T: a call with T > 1 fails in onnxruntime rather than
    returning one token's update."""
    sess = _session(mixer_model(2, "linear", False, scale=1.0, body="token"))
    feeds = {"q1": np.ones((1, 2, 1, 4), np.float32), "k1": np.ones((1, 2, 1, 4), np.float32),
             "v": np.ones((1, 2, 1, 3), np.float32), "past_state": np.zeros((1, 1, 4, 3), np.float32)}
    with pytest.raises(Exception, match="(?i)squeeze|dimension|shape"):
        sess.run(None, feeds)
