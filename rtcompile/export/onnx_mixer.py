"""The state mixer as one ONNX node, ``ai.rtcompile::RunningTensor``, with a model-local
function body in standard ONNX ops, so plain onnxruntime runs it while a runtime with a native
kernel can take the node whole.

Node inputs: q_1..q_{o-1}, k_1..k_{o-1} ``[B, T, H, d_i]``, v ``[B, T, H, d_v]``, past_state
``[B, H, d_1, ..., d_{o-1}, d_v]``, then decay ``[B, T, H]`` (log decay; gated rules) and beta
``[B, T, H]`` (delta rules). Outputs: o ``[B, T, H, d_v]``, present_state (past_state's shape).
Attributes: order, update_rule (linear | gated | delta | gated_delta, as ONNX opset 27's
LinearAttention names them), scale, chunk_size and variant (hints for a native kernel; the
function body ignores them). The bodies (``onnx_chunk.py``) carry the state flattened to
``[B, H, K, d_v]`` (K = prod d_i), phi(k) and phi(q) being Kronecker products of the
(optionally L2-normalised) factors: a Scan over tokens (the reference's token loop), the
chunk-parallel form, or one token.
"""

from __future__ import annotations

DOMAIN = "ai.rtcompile"
OPSET = 18
UPDATE_RULES = ("linear", "gated", "delta", "gated_delta")
L2NORM_EPS = 1e-6


def input_names(order: int, update_rule: str) -> list[str]:
    nf = order - 1
    names = [f"q{i}" for i in range(1, nf + 1)] + [f"k{i}" for i in range(1, nf + 1)] + ["v", "past_state"]
    if update_rule in ("gated", "gated_delta"):
        names.append("decay")
    if update_rule in ("delta", "gated_delta"):
        names.append("beta")
    return names


BODIES = ("scan", "chunk", "token")


def running_tensor_function(order: int, update_rule: str, l2norm: bool, opset: int = OPSET, *,
                            body: str = "scan", chunk: int = 64):
    """The FunctionProto ``ai.rtcompile::RunningTensor`` for one order / rule / normalisation.

    ``body``: "scan", a Scan over tokens (any T); "chunk", the chunk-parallel form in chunks of
    ``chunk`` tokens (``onnx_chunk.py``: the prefill graph's); or "token", one token without a
    Scan (T = 1 only: the decode graph's). All compute the node's one meaning; the choice is the
    function body's only."""
    from onnx import AttributeProto
    from onnx import helper as h

    if update_rule not in UPDATE_RULES:
        raise ValueError(f"update_rule: got {update_rule!r}; allowed: {', '.join(UPDATE_RULES)}")
    if not isinstance(order, int) or order < 2:
        raise ValueError(f"order: got {order!r}; allowed: an integer >= 2")
    if body not in BODIES:
        raise ValueError(f"body: got {body!r}; allowed: {', '.join(BODIES)}")
    names = input_names(order, update_rule)
    scale_attr = AttributeProto()
    scale_attr.name, scale_attr.ref_attr_name, scale_attr.type = "value_float", "scale", AttributeProto.FLOAT
    scale_node = h.make_node("Constant", [], ["scale_t"])
    scale_node.attribute.extend([scale_attr])
    attributes = ["scale", "order", "update_rule", "chunk_size", "variant"]
    from .onnx_chunk import chunk_body, scan_body, token_body

    nodes = (chunk_body(order, update_rule, l2norm, chunk, L2NORM_EPS) if body == "chunk"
             else token_body(order, update_rule, l2norm, L2NORM_EPS) if body == "token"
             else scan_body(order, update_rule, l2norm, L2NORM_EPS))
    return h.make_function(DOMAIN, "RunningTensor", names, ["o", "present_state"], [scale_node, *nodes],
                           opset_imports=[h.make_opsetid("", opset)], attributes=attributes)


def mixer_model(order: int, update_rule: str, l2norm: bool, scale: float, chunk_size: int = 0,
                variant: str = "", *, body: str = "scan", chunk: int = 64):
    """A one-node ONNX model of the mixer with dynamic B and T (fp32), carrying the function
    (``body`` / ``chunk``: as :func:`running_tensor_function`)."""
    from onnx import TensorProto
    from onnx import helper as h

    nf = order - 1
    names = input_names(order, update_rule)
    f = TensorProto.FLOAT
    dims = lambda last: ["B", "T", "H", last]
    ins = [h.make_tensor_value_info(f"q{i}", f, dims(f"d{i}")) for i in range(1, nf + 1)]
    ins += [h.make_tensor_value_info(f"k{i}", f, dims(f"d{i}")) for i in range(1, nf + 1)]
    ins += [h.make_tensor_value_info("v", f, dims("dv")),
            h.make_tensor_value_info("past_state", f, ["B", "H", *[f"d{i}" for i in range(1, nf + 1)], "dv"])]
    if "decay" in names:
        ins.append(h.make_tensor_value_info("decay", f, ["B", "T", "H"]))
    if "beta" in names:
        ins.append(h.make_tensor_value_info("beta", f, ["B", "T", "H"]))
    outs = [h.make_tensor_value_info("o", f, dims("dv")),
            h.make_tensor_value_info("present_state", f, ["B", "H", *[f"d{i}" for i in range(1, nf + 1)], "dv"])]
    node = h.make_node("RunningTensor", names, ["o", "present_state"], domain=DOMAIN, scale=float(scale),
                       order=order, update_rule=update_rule, chunk_size=chunk_size, variant=variant)
    graph = h.make_graph([node], "running_tensor_mixer", ins, outs)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", OPSET), h.make_opsetid(DOMAIN, 1)],
                         functions=[running_tensor_function(order, update_rule, l2norm, body=body, chunk=chunk)])
    model.ir_version = 10
    return model
