"""Whole-model ONNX graphs in onnxruntime against the torch module: prefill, and a 16-step
greedy decode feeding present_* back as past_*; orders 2-4, every update rule."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from rtcompile.export.onnx_model import ONNX_CHUNK, export_onnx
from rtcompile.export.onnx_mixer import DOMAIN
from rtcompile.model import RunningTensorLM
from rtcompile.spec import Features, ModelSpec

WIDTHS = {2: (6,), 3: (2, 4), 4: (2, 3, 2)}
RULES = {"linear": (False, False), "gated": (True, False), "delta": (False, True), "gated_delta": (True, True)}


def _session(path):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


# each order with the gate on and off and the delta rule on and off, each rule at some order: the
# full 3 x 4 grid took 200 s of the CI machine's test time (an export of two graphs each)
PAIRS = [(2, "linear"), (2, "gated_delta"), (3, "gated"), (3, "delta"), (4, "gated_delta"), (4, "linear")]


@pytest.mark.parametrize("order, rule", PAIRS, ids=[f"{r}-o{o}" for o, r in PAIRS])
def test_onnxruntime_prefill_and_greedy_decode(order, rule, tmp_path):
    gate, delta = RULES[rule]
    proj = "conconlyc" if order == 4 else "dense"
    feats = Features(forget_gate=gate, delta_rule=delta, query_skip=order == 3, projection=proj, short_conv=3)
    spec = ModelSpec(order=order, key_widths=WIDTHS[order], value_width=5, heads=2, model_width=12, layers=2,
                     features=feats)
    torch.manual_seed(order)
    lm = RunningTensorLM(spec, vocab_size=11).float().eval()
    pre_path, dec_path = export_onnx(lm, tmp_path)
    for path in (pre_path, dec_path):
        model = onnx.load(path)
        onnx.checker.check_model(model, full_check=True)
        assert sum(n.domain == DOMAIN for n in model.graph.node) == spec.layers  # one mixer node per layer
    pre, dec = _session(pre_path), _session(dec_path)
    assert [i.name for i in dec.get_inputs()][1:] == [o.name.replace("present", "past") for o in dec.get_outputs()][1:]
    tokens = torch.randint(0, 11, (3, 9))
    with torch.no_grad():
        ref, cache = lm(tokens, backend="reference")
    rel = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max())
    long = torch.randint(0, 11, (2, 2 * ONNX_CHUNK + 7))  # the prefill graph's chunk form over 3 chunks
    with torch.no_grad():
        ref_long, _ = lm(long, backend="reference")
    assert rel(pre.run(None, {"tokens": long.numpy()})[0], ref_long.numpy()) < 1e-4
    outs = pre.run(None, {"tokens": tokens.numpy()})
    assert rel(outs[0], ref.numpy()) < 1e-4
    names = [i.name for i in dec.get_inputs()][1:]
    state, tok = outs[1:], outs[0][:, -1].argmax(-1)
    for _ in range(16):
        o = dec.run(None, {"tokens": tok[:, None].astype(np.int64), **dict(zip(names, state))})
        with torch.no_grad():
            lg, cache = lm.step(torch.from_numpy(tok), cache, backend="reference")
        assert rel(o[0][:, 0], lg.numpy()) < 1e-4
        state, tok = o[1:], o[0][:, 0].argmax(-1)


@pytest.mark.parametrize("rule", ["gated_delta", "linear"])
def test_opset27_linear_attention(rule, tmp_path):
    gate, delta = RULES[rule]
    spec = ModelSpec(order=3, key_widths=(2, 4), value_width=5, heads=2, model_width=12, layers=1,
                     features=Features(forget_gate=gate, delta_rule=delta, short_conv=2))
    torch.manual_seed(5)
    lm = RunningTensorLM(spec, vocab_size=11).float().eval()
    pre_path, dec_path = export_onnx(lm, tmp_path, opset27=True)
    model = onnx.load(pre_path)
    assert any(n.op_type == "LinearAttention" and n.domain == "" for n in model.graph.node)
    assert all(n.domain != DOMAIN for n in model.graph.node)
    tokens = torch.randint(0, 11, (2, 7))
    with torch.no_grad():
        ref, cache = lm(tokens, backend="reference")
    outs = _session(pre_path).run(None, {"tokens": tokens.numpy()})
    assert float(np.abs(outs[0] - ref.numpy()).max() / np.abs(ref.numpy()).max()) < 1e-4
    dec = _session(dec_path)
    tok = outs[0][:, -1].argmax(-1)
    o = dec.run(None, {"tokens": tok[:, None].astype(np.int64), **dict(zip([i.name for i in dec.get_inputs()][1:], outs[1:]))})
    with torch.no_grad():
        lg, _ = lm.step(torch.from_numpy(tok), cache, backend="reference")
    assert float(np.abs(o[0][:, 0] - lg.numpy()).max() / np.abs(lg.numpy()).max()) < 1e-4


def _axes(value_info):
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def test_export_warns_nothing_and_keeps_dynamic_axes(tmp_path, capfd):
    """Exporting warns nothing (the decode caches' batch axis used to be named a second time:
    "The axis name: batch will not be used") and writes nothing to stderr; every batch axis is
    the one named ``batch``, the prefill's sequence axis ``seq``, and onnxruntime runs the
    prefill graph at two (B, T) other than the export's (2, 5)."""
    import warnings

    spec = ModelSpec(order=3, key_widths=(2, 4), value_width=5, heads=2, model_width=12, layers=2,
                     features=Features(forget_gate=True, delta_rule=True, short_conv=3))
    torch.manual_seed(7)
    lm = RunningTensorLM(spec, vocab_size=11).float().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre_path, dec_path = export_onnx(lm, tmp_path)
    assert [str(w.message) for w in caught] == []
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Warning" not in err, err
    pre, dec = onnx.load(pre_path), onnx.load(dec_path)
    assert _axes(pre.graph.input[0]) == ["batch", "seq"] and _axes(pre.graph.output[0]) == ["batch", "seq", 11]
    for v in [*pre.graph.output[1:], *dec.graph.input, *dec.graph.output]:
        assert _axes(v)[0] == "batch", v.name
    session = _session(pre_path)
    for b, t in ((1, 3), (4, 70)):
        tokens = torch.randint(0, 11, (b, t))
        with torch.no_grad():
            ref, _ = lm(tokens, backend="reference")
        got = session.run(None, {"tokens": tokens.numpy()})[0]
        assert got.shape == (b, t, 11)
        assert float(np.abs(got - ref.numpy()).max() / np.abs(ref.numpy()).max()) < 1e-4


def test_cli_export_opset27_prints_no_traceback(tmp_path):
    """``rtcompile export --opset27`` in a fresh process: onnx's version converter (no Gelu
    adapter) used to print two tracebacks per graph; now stderr is empty and the graphs are
    labelled opset 27."""
    import os
    import subprocess
    import sys

    spec = tmp_path / "s.toml"
    spec.write_text('order = 3\nkey_widths = [2, 4]\nvalue_width = 5\nheads = 2\nmodel_width = 12\nlayers = 1\n')
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package under test, first
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "b"
    run = subprocess.run([sys.executable, "-m", "rtcompile.cli", "export", str(spec), "--out", str(out), "--opset27",
                          "--vocab", "11"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    assert run.stderr == ""
    model = onnx.load(str(out / "prefill.onnx"))
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [27]
    # its graphs pass every check of verify (onnx.checker among them: opset 27's LinearAttention)
    # and run in onnxruntime
    from rtcompile.export import verify_bundle
    from rtcompile.export.onnx_model import run_greedy

    assert run_greedy(verify_bundle(out), np.array([[1, 2, 3]], dtype=np.int64), 2).shape == (1, 2)
