"""The state mixer as one ONNX node, ``ai.rtcompile::RunningTensor``, with a model-local
function body in standard ONNX ops, so plain onnxruntime runs it while a runtime with a native
kernel can take the node whole.

Node inputs: q_1..q_{o-1}, k_1..k_{o-1} ``[B, T, H, d_i]``, v ``[B, T, H, d_v]``, past_state
``[B, H, d_1, ..., d_{o-1}, d_v]``, then decay ``[B, T, H]`` (log decay; gated rules) and beta
``[B, T, H]`` (delta rules). Outputs: o ``[B, T, H, d_v]``, present_state (past_state's shape).
Attributes: order, update_rule (linear | gated | delta | gated_delta, as ONNX opset 27's
LinearAttention names them), scale, chunk_size and variant (hints for a native kernel; the
function body ignores them). The body is a Scan over T carrying the state flattened to
``[B, H, K, d_v]`` (K = prod d_i): per token, phi(k) and phi(q) are Kronecker products of the
(optionally L2-normalised) factors, and the update is the reference's token loop.
"""

from __future__ import annotations

from typing import Sequence

DOMAIN = "ai.rtcompile"
OPSET = 18
UPDATE_RULES = ("linear", "gated", "delta", "gated_delta")
L2NORM_EPS = 1e-6


def _const_i64(h, name: str, values: Sequence[int]):
    from onnx import TensorProto

    return h.make_node("Constant", [], [name], value=h.make_tensor(name + "_v", TensorProto.INT64, [len(values)], list(values)))


def _step_body(order: int, update_rule: str, l2norm: bool):
    """The Scan body: (state [B,H,K,V], q_i, k_i, v, g?, beta?) per token -> (state, o_t)."""
    from onnx import TensorProto
    from onnx import helper as h

    nf = order - 1
    gated, delta = update_rule in ("gated", "gated_delta"), update_rule in ("delta", "gated_delta")
    # only the constants this body uses (onnxruntime warns about unused ones)
    nodes = [_const_i64(h, "ax_last", [-1])]
    if nf > 1:
        nodes += [_const_i64(h, "ax_m2", [-2]), _const_i64(h, "shape_bh_", [0, 0, -1])]
    if gated:
        nodes.append(_const_i64(h, "ax_23", [2, 3]))
    if l2norm:
        nodes.append(h.make_node("Constant", [], ["eps"], value_float=L2NORM_EPS))

    def normed(x: str) -> str:
        if not l2norm:
            return x
        nodes.extend([
            h.make_node("Mul", [x, x], [x + "_sq"]),
            h.make_node("ReduceSum", [x + "_sq", "ax_last"], [x + "_ss"], keepdims=1),
            h.make_node("Add", [x + "_ss", "eps"], [x + "_sse"]),
            h.make_node("Sqrt", [x + "_sse"], [x + "_n"]),
            h.make_node("Div", [x, x + "_n"], [x + "_hat"]),
        ])
        return x + "_hat"

    def kron(prefix: str) -> str:
        phi = normed(f"{prefix}1")
        for i in range(2, nf + 1):
            x = normed(f"{prefix}{i}")
            nodes.extend([
                h.make_node("Unsqueeze", [phi, "ax_last"], [f"{prefix}_a{i}"]),
                h.make_node("Unsqueeze", [x, "ax_m2"], [f"{prefix}_b{i}"]),
                h.make_node("Mul", [f"{prefix}_a{i}", f"{prefix}_b{i}"], [f"{prefix}_o{i}"]),
                h.make_node("Reshape", [f"{prefix}_o{i}", "shape_bh_"], [f"{prefix}_phi{i}"]),
            ])
            phi = f"{prefix}_phi{i}"
        return phi

    phik, phiq = kron("k"), kron("q")
    s = "S_in"
    if gated:
        nodes.extend([h.make_node("Exp", ["g"], ["a"]), h.make_node("Unsqueeze", ["a", "ax_23"], ["a4"]),
                      h.make_node("Mul", [s, "a4"], ["S_dec"])])
        s = "S_dec"
    u = "v"
    if delta:
        nodes.extend([
            h.make_node("Einsum", [s, phik], ["pred"], equation="bhkv,bhk->bhv"),
            h.make_node("Sub", ["v", "pred"], ["err"]),
            h.make_node("Unsqueeze", ["beta", "ax_last"], ["beta3"]),
            h.make_node("Mul", ["beta3", "err"], ["u"]),
        ])
        u = "u"
    nodes.extend([
        h.make_node("Einsum", [phik, u], ["write"], equation="bhk,bhv->bhkv"),
        h.make_node("Add", [s, "write"], ["S_out"]),
        h.make_node("Einsum", ["S_out", phiq], ["read"], equation="bhkv,bhk->bhv"),
        h.make_node("Mul", ["read", "scale_t"], ["o_t"]),
    ])
    f = TensorProto.FLOAT
    ins = [h.make_tensor_value_info("S_in", f, None)]
    ins += [h.make_tensor_value_info(f"q{i}", f, None) for i in range(1, nf + 1)]
    ins += [h.make_tensor_value_info(f"k{i}", f, None) for i in range(1, nf + 1)]
    ins += [h.make_tensor_value_info("v", f, None)]
    if gated:
        ins.append(h.make_tensor_value_info("g", f, None))
    if delta:
        ins.append(h.make_tensor_value_info("beta", f, None))
    outs = [h.make_tensor_value_info("S_out", f, None), h.make_tensor_value_info("o_t", f, None)]
    graph = h.make_graph(nodes, "running_tensor_step", ins, outs)
    return graph


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
    nf = order - 1
    names = input_names(order, update_rule)
    scale_attr = AttributeProto()
    scale_attr.name, scale_attr.ref_attr_name, scale_attr.type = "value_float", "scale", AttributeProto.FLOAT
    scale_node = h.make_node("Constant", [], ["scale_t"])
    scale_node.attribute.extend([scale_attr])
    attributes = ["scale", "order", "update_rule", "chunk_size", "variant"]
    if body != "scan":
        from .onnx_chunk import chunk_body, token_body

        nodes = (chunk_body(order, update_rule, l2norm, chunk, L2NORM_EPS) if body == "chunk"
                 else token_body(order, update_rule, l2norm, L2NORM_EPS))
        return h.make_function(DOMAIN, "RunningTensor", names, ["o", "present_state"], [scale_node, *nodes],
                               opset_imports=[h.make_opsetid("", opset)], attributes=attributes)
    # flatten the state to [B, H, K, V] for the loop, restore the order-o shape at the end
    nodes = [
        scale_node,
        _const_i64(h, "flat_shape", [0, 0, -1]),
        h.make_node("Shape", ["v"], ["v_shape"]),
        _const_i64(h, "last_idx", [-1]),
        h.make_node("Gather", ["v_shape", "last_idx"], ["v_width"], axis=0),
        h.make_node("Concat", ["flat_shape", "v_width"], ["state_flat_shape"], axis=0),
        h.make_node("Reshape", ["past_state", "state_flat_shape"], ["S0"]),
    ]
    scan_inputs = [f"q{i}" for i in range(1, nf + 1)] + [f"k{i}" for i in range(1, nf + 1)] + ["v"]
    if update_rule in ("gated", "gated_delta"):
        scan_inputs.append("decay")
    if update_rule in ("delta", "gated_delta"):
        scan_inputs.append("beta")
    body = _step_body(order, update_rule, l2norm)
    # the body reads the scale from the enclosing scope
    nodes.append(h.make_node("Scan", ["S0", *scan_inputs], ["S_final", "o"], body=body,
                             num_scan_inputs=len(scan_inputs), scan_input_axes=[1] * len(scan_inputs),
                             scan_output_axes=[1]))
    nodes.append(h.make_node("Shape", ["past_state"], ["state_shape"]))
    nodes.append(h.make_node("Reshape", ["S_final", "state_shape"], ["present_state"]))
    return h.make_function(DOMAIN, "RunningTensor", names, ["o", "present_state"], nodes,
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
