"""Whole-model ONNX graphs: ``prefill.onnx`` and ``decode.onnx`` for a RunningTensorLM.

The model is exported with ``torch.onnx.export(dynamo=True)``; each layer's state mixer goes
through the custom op ``rtcompile::mixer_onnx``, which a custom translation turns into one
``ai.rtcompile::RunningTensor`` node (its schema registered with onnx), and the model carries
the node's function body (``onnx_mixer.running_tensor_function``) so plain onnxruntime runs
it. ``decode.onnx`` carries the state explicitly, as ONNX's LinearAttention and the
onnxruntime LLM exports do: inputs ``past_state.{layer}`` (and ``past_conv.{layer}.{i}`` for
the short convolution), outputs ``present_state.{layer}`` / ``present_conv.{layer}.{i}``.
Batch and sequence axes are dynamic (named ``batch`` and ``seq`` in the graphs).

Exporting prints nothing of its own: the exporter's notes that say nothing about this model
(torchvision absent, a deprecated pytree check inside torch.export) are dropped, and with
``opset27`` the version converter's failure (see :func:`_exporter_notes`) becomes one INFO
line on the ``rtcompile.export`` logger instead of two tracebacks.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch

from .onnx_mixer import DOMAIN, running_tensor_function

_SCHEMA_DONE = False
log = logging.getLogger("rtcompile.export")
# The prefill graph's chunk (onnx_chunk.py). Whole prefill graphs in onnxruntime on the 2-core CPU
# machine, B1, one process, alternating, best of 4: C 32 against 64 at T 512 / 2048 / 8192 took
# 85.3 / 241.1 / 953.1 against 90.2 / 257.0 / 1020.5 ms (example o3 16x16), 81.0 / 245.0 / 929.8
# against 88.5 / 266.3 / 974.4 (o2 64), 109.2 / 328.9 / 1303.4 against 112.4 / 340.3 / 1377.9
# (o3 32x32); a Scan over tokens takes ~3x C 32's time at T 128-2048 (benchmarks/onnx_cpu.py)
ONNX_CHUNK = 32
# the loggers whose records _exporter_notes takes over while a graph is exported
CONVERTER_LOGGER = "onnxscript.version_converter"
REGISTRY_LOGGER = "torch.onnx._internal.exporter._registration"


@torch.library.custom_op("rtcompile::mixer_onnx", mutates_args=())
def mixer_onnx(q: list[torch.Tensor], k: list[torch.Tensor], v: torch.Tensor, past_state: torch.Tensor,
               decay: torch.Tensor | None, beta: torch.Tensor | None, scale: float,
               l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixer as the exporter sees it (computed by the reference when run)."""
    from ..kernels.reference import running_tensor_recurrent_ref

    o, s = running_tensor_recurrent_ref(q, k, v, decay, beta, scale=scale, initial_state=past_state,
                                        output_final_state=True, l2norm=l2norm)
    return o, s.to(past_state.dtype)


@mixer_onnx.register_fake
def _(q, k, v, past_state, decay, beta, scale, l2norm):
    return torch.empty_like(v), torch.empty_like(past_state)


def _register_schema() -> None:
    """Declare ai.rtcompile::RunningTensor to onnx (the exporter needs a schema to emit it)."""
    global _SCHEMA_DONE
    import onnx
    from onnx.defs import OpSchema

    if _SCHEMA_DONE or onnx.defs.has("RunningTensor", DOMAIN):
        _SCHEMA_DONE = True
        return
    A = OpSchema.AttrType
    schema = OpSchema(
        "RunningTensor", DOMAIN, 1,
        doc="RunningTensor state mixer (order-o tensor state); see rtcompile.export.onnx_mixer",
        inputs=[OpSchema.FormalParameter("inputs", "T", param_option=OpSchema.FormalParameterOption.Variadic,
                                         is_homogeneous=True, min_arity=4)],
        outputs=[OpSchema.FormalParameter("o", "T"), OpSchema.FormalParameter("present_state", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "float tensors")],
        attributes=[OpSchema.Attribute("scale", A.FLOAT, ""), OpSchema.Attribute("order", A.INT, ""),
                    OpSchema.Attribute("update_rule", A.STRING, ""), OpSchema.Attribute("chunk_size", A.INT, ""),
                    OpSchema.Attribute("variant", A.STRING, "")],
    )
    onnx.defs.register_schema(schema)
    _SCHEMA_DONE = True


def _translation(spec):
    import onnxscript

    rt = onnxscript.values.Opset(DOMAIN, 1)
    rule = spec.features.update_rule

    def mixer(q, k, v, past_state, decay, beta, scale: float, l2norm: bool):
        extra = [x for x in (decay, beta) if x is not None]
        return rt.RunningTensor(*q, *k, v, past_state, *extra, scale=scale, order=len(q) + 1, update_rule=rule,
                                chunk_size=int(spec.resolved_chunk_size), variant="")

    return mixer


def _translation_opset27(spec):
    """The mixer as ONNX opset 27's standard LinearAttention on materialised Kronecker features
    phi(q), phi(k) (width K = prod d_i), for runtimes that implement that operator."""
    import onnxscript
    from onnxscript import opset18 as op

    op27 = onnxscript.values.Opset("", 27)
    rule, H, V = spec.features.update_rule, spec.heads, spec.value_width
    K = spec.key_dim

    def normed(x, l2norm: bool):
        if not l2norm:
            return x
        ss = op.ReduceSum(op.Mul(x, x), op.Constant(value_ints=[-1]), keepdims=1)
        return op.Div(x, op.Sqrt(op.Add(ss, op.Constant(value_float=1e-6))))

    def kron(xs, l2norm: bool):
        phi = normed(xs[0], l2norm)
        for x in xs[1:]:
            outer = op.Mul(op.Unsqueeze(phi, op.Constant(value_ints=[-1])),
                           op.Unsqueeze(normed(x, l2norm), op.Constant(value_ints=[-2])))
            phi = op.Reshape(outer, op.Constant(value_ints=[0, 0, 0, -1]))
        return phi

    def mixer(q, k, v, past_state, decay, beta, scale: float, l2norm: bool):
        pack = op.Constant(value_ints=[0, 0, -1])
        Q, Kf, Vp = op.Reshape(kron(q, l2norm), pack), op.Reshape(kron(k, l2norm), pack), op.Reshape(v, pack)
        S = op.Reshape(past_state, op.Constant(value_ints=[0, H, K, V]))
        o, st = op27.LinearAttention(Q, Kf, Vp, S, decay, beta, q_num_heads=H, kv_num_heads=H, scale=scale,
                                     update_rule=rule)
        return op.Reshape(o, op.Constant(value_ints=[0, 0, H, V])), op.Reshape(st, op.Shape(past_state))

    return mixer


def onnx_mixer(spec, q, k, v, g, beta, state):
    """The model's state mixer as the one ``mixer_onnx`` op (a :data:`rtcompile.model.Mixer`,
    passed as ``mixer=`` while exporting): the graph gets one node per layer, fp32 throughout."""
    past = state if state is not None else v.new_zeros(v.shape[0], spec.heads, *spec.key_widths, spec.value_width)
    return mixer_onnx(q, k, v, past.to(v.dtype), None if g is None else g.to(v.dtype), beta,
                      spec.effective_scale, spec.features.l2norm)


class _Prefill(torch.nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, tokens):
        logits, cache = self.lm(tokens, mixer=onnx_mixer)
        return (logits, *flatten_cache(cache))


class _Decode(torch.nn.Module):
    def __init__(self, lm, conv_count: int):
        super().__init__()
        self.lm, self.conv_count = lm, conv_count

    def forward(self, tokens, *state):
        for s in state:  # one batch axis: named once (as the tokens'), never twice
            torch._check(s.shape[0] == tokens.shape[0])
        logits, cache = self.lm(tokens, unflatten_cache(list(state), len(self.lm.mixers), self.conv_count),
                                mixer=onnx_mixer)
        return (logits, *flatten_cache(cache))


def flatten_cache(cache) -> list[torch.Tensor]:
    out = []
    for c in cache:
        out.append(c["state"])
        out.extend(c["conv"] or [])
    return out


def unflatten_cache(flat: list[torch.Tensor], layers: int, conv_count: int) -> list[dict]:
    per = 1 + conv_count
    return [{"state": flat[i * per], "conv": flat[i * per + 1 : (i + 1) * per] or None} for i in range(layers)]


def cache_names(layers: int, conv_count: int, prefix: str) -> list[str]:
    names = []
    for i in range(layers):
        names.append(f"{prefix}_state.{i}")
        names.extend(f"{prefix}_conv.{i}.{j}" for j in range(conv_count))
    return names


class _Notes(logging.Filter):
    """Takes the exporter's records that say nothing about the model being exported."""

    def __init__(self, converter: bool):
        super().__init__()
        self.converter, self.failures = converter, []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == REGISTRY_LOGGER and "torchvision is not installed" in record.getMessage():
            return False  # no torchvision op is exported here
        if self.converter and record.name == CONVERTER_LOGGER:
            if record.exc_info and record.exc_info[1] is not None:
                self.failures.append(str(record.exc_info[1]).strip().splitlines()[-1])
            return False
        return True


@contextlib.contextmanager
def _exporter_notes(opset27: bool):
    """Quiet ``torch.onnx.export`` of what is noise here. With ``opset27`` the exporter
    translates every op with the opset-27 registry, labels the graph 18, then runs onnx's
    version converter to 27, which has no adapter for Gelu (onnx 1.23) and logs a traceback
    per graph while leaving the graph as it was; :func:`_finish27` labels it 27 and the full
    onnx check decides. The converter's records become one INFO line on ``rtcompile.export``."""
    notes = _Notes(opset27)
    loggers = [logging.getLogger(name) for name in (CONVERTER_LOGGER, REGISTRY_LOGGER)]
    for logger in loggers:
        logger.addFilter(notes)
    try:
        with warnings.catch_warnings():
            # torch.export deep-copies a pytree spec whose class check torch itself deprecates
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            yield notes
    finally:
        for logger in loggers:
            logger.removeFilter(notes)
    if notes.failures:
        log.info("onnx's version converter left the graphs unconverted (%s); they were translated at opset 27 "
                 "and are labelled 27", notes.failures[0])


def _finish27(program):
    """The exporter writes opset 18 around the opset-27 node: declare 27 (the ops it emits keep
    their meaning there) and check."""
    import onnx

    model = program.model_proto
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = 27
    onnx.checker.check_model(model, full_check=True)
    return model


def _finish(program, spec, body: str):
    """The exported ModelProto with the mixer's function attached (``body``: "chunk" for the
    prefill graph, "token" for the decode step's), checked."""
    import onnx

    model = program.model_proto
    default = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    model.functions.append(running_tensor_function(spec.order, spec.features.update_rule, spec.features.l2norm,
                                                   opset=default, body=body, chunk=ONNX_CHUNK))
    onnx.checker.check_model(model, full_check=True)
    return model


def export_onnx(lm, out_dir, *, opset27: bool = False) -> tuple[str, str]:
    """Write ``prefill.onnx`` and ``decode.onnx`` for ``lm`` (fp32) into ``out_dir``.

    ``opset27``: emit ONNX's standard LinearAttention (opset 27) on materialised Kronecker
    features instead of the ai.rtcompile node (K = prod d_i wide: only for small states)."""
    import os

    import onnx

    _register_schema()
    spec = lm.spec
    lm = lm.float().eval()
    with torch.no_grad():
        tokens = torch.randint(0, lm.head.out_features, (2, 5))
        logits, cache = lm(tokens, backend="reference")
    flat = flatten_cache(cache)
    conv_count = len(cache[0]["conv"] or [])
    translate = _translation_opset27(spec) if opset27 else _translation(spec)
    table = {torch.ops.rtcompile.mixer_onnx.default: translate}
    L = len(lm.mixers)
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("seq", min=2, max=1 << 20)
    # the caches' batch axis is the tokens' (_Decode checks it, so the graph has one symbol named
    # "batch"): the Dim again on every cache made the exporter warn that the name went unused
    same = torch.export.Dim.DYNAMIC
    with _exporter_notes(opset27):
        pre = torch.onnx.export(
            _Prefill(lm).eval(), (tokens,), dynamo=True, custom_translation_table=table, verbose=False,
            input_names=["tokens"], output_names=["logits", *cache_names(L, conv_count, "present")],
            dynamic_shapes=({0: batch, 1: seq},), optimize=True, opset_version=27 if opset27 else None,
        )
        step_tokens = tokens[:, :1]
        dec = torch.onnx.export(
            _Decode(lm, conv_count).eval(), (step_tokens, *flat), dynamo=True, custom_translation_table=table,
            verbose=False, input_names=["tokens", *cache_names(L, conv_count, "past")],
            output_names=["logits", *cache_names(L, conv_count, "present")],
            dynamic_shapes=({0: batch}, tuple({0: same} for _ in flat)), optimize=True,
            opset_version=27 if opset27 else None,
        )
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, prog, body in (("prefill.onnx", pre, "chunk"), ("decode.onnx", dec, "token")):
        model = _finish27(prog) if opset27 else _finish(prog, spec, body)
        path = os.path.join(out_dir, name)
        onnx.save(model, path)
        paths.append(path)
    check_against_torch(lm, paths[0], paths[1], tokens, logits, cache)
    return paths[0], paths[1]


# fp32 graphs match the torch reference within 1e-4 relative (tests/test_onnx_model.py, orders
# 2-4, every update rule); a weight that differs moves the logits by O(1). 1e-3 keeps a 10x margin.
GRAPH_MATCH_RTOL = 1e-3


def _session(path_or_bytes):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(path_or_bytes, opts, providers=["CPUExecutionProvider"])


def check_against_torch(lm, prefill_path, decode_path, tokens, logits, cache) -> None:
    """BundleError unless onnxruntime's prefill logits on ``tokens`` and on a prompt of three
    chunks, and one decode step after ``tokens``, match the torch module's (``logits``, ``cache``
    from its reference forward): graphs whose weights are not the module's are never written
    into a bundle."""
    import os

    import numpy as np

    from .verify import BundleError

    pre, dec = _session(prefill_path), _session(decode_path)
    outs = pre.run(None, {"tokens": tokens.cpu().numpy()})
    tok = logits[:, -1].argmax(-1)
    # and a prompt over three of the prefill graph's chunks (a partial last one), which the short
    # one does not reach
    long = torch.randint(0, lm.head.out_features, (1, 2 * ONNX_CHUNK + 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        step, _ = lm.step(tok, cache, backend="reference")
        long_logits, _ = lm(long, backend="reference")
    names = [i.name for i in dec.get_inputs()][1:]
    got = dec.run(None, {"tokens": tok[:, None].cpu().numpy().astype(np.int64), **dict(zip(names, outs[1:]))})
    long_out = pre.run(None, {"tokens": long.numpy()})[0]
    for path, out, ref in ((prefill_path, outs[0], logits), (prefill_path, long_out, long_logits),
                           (decode_path, got[0][:, 0], step)):
        ref = ref.detach().cpu().numpy()
        err = float(np.abs(out - ref).max() / max(float(np.abs(ref).max()), 1e-30))
        if not err <= GRAPH_MATCH_RTOL:  # NaN fails too
            raise BundleError(f"{os.path.basename(path)}: onnxruntime's logits differ from the torch model's by "
                              f"{err:.3g} relative (allowed: {GRAPH_MATCH_RTOL}); the graph does not compute the "
                              "model it was exported from (an exporter bug)")


def _ort_errors() -> tuple[type[BaseException], ...]:
    """What onnxruntime raises for a graph it refuses: its own exception classes (Fail,
    InvalidGraph, NotImplemented, ...: plain Exceptions, not RuntimeError) and RuntimeError."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    return (RuntimeError, *(v for v in vars(state).values() if isinstance(v, type) and issubclass(v, Exception)))


def bundle_session(bundle, name: str):
    """An onnxruntime session of a verified bundle's graph ``name`` (``bundle``: a
    ``VerifiedBundle``; the graph's verified bytes, never its file read again), or BundleError
    naming it: a graph the checker passed may still use an op of another domain that no function
    defines, which only onnxruntime finds, when the session is made."""
    from .verify import BundleError

    try:
        return _session(bundle.graphs[name])
    except _ort_errors() as exc:
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise BundleError(f"bundle {str(bundle.root)!r}: {name}: onnxruntime cannot load it ({why[:300]})") from None


def run_greedy(bundle, prompt, steps: int):
    """Prefill ``prompt`` [B, T] (int64) with prefill.onnx, then decode ``steps`` tokens greedily
    with decode.onnx, feeding each present_* output back as past_*. ``bundle``: a
    ``VerifiedBundle`` (``verify.verify_bundle``). Returns [B, steps]."""
    import numpy as np

    pre = bundle_session(bundle, "prefill.onnx")
    dec = bundle_session(bundle, "decode.onnx")
    outs = pre.run(None, {"tokens": prompt})
    names = [i.name for i in dec.get_inputs()][1:]
    state, tok, got = outs[1:], outs[0][:, -1].argmax(-1), []
    for _ in range(steps):
        got.append(tok)
        o = dec.run(None, {"tokens": tok[:, None].astype(np.int64), **dict(zip(names, state))})
        state, tok = o[1:], o[0][:, 0].argmax(-1)
    return np.stack(got, axis=1) if got else np.zeros((prompt.shape[0], 0), dtype=np.int64)
