"""The bodies of the ONNX mixer function (``onnx_mixer.running_tensor_function``): the token
Scan (``body="scan"``), one token (``"token"``, the decode graph's) and, mostly, the chunk-parallel
form (``"chunk"``): the prefill graph's, where the token Scan runs one small step per token.

The math is the chunk reference's (``kernels/reference._chunk_segment``). With the sequence
padded to NT chunks of C tokens (zero keys, values, beta and log decay: exact), per chunk
(local cumulative log decay c, Gamma = exp(c), D_ij = exp(c_i - c_j) for j <= i):

    P  = scale (prod_i Q_i K_i^T) * D                    [C, C]   the scores
    Ai = (I + A)^-1,  A = tril(diag(b) (prod_i K_i K_i^T) * D, -1)   (delta rules)
    U0 = Ai diag(b) V                                    (without the delta rule U0 = V)

in parallel over (B, H, chunks): [C, C] and [C, V] tensors only. A is strictly lower
triangular, so (I + A)^-1 = prod_j (I + (-A)^(2^j)) for j < log2 C: matrix products only
(ONNX has no triangular solve), exact like the substitution it replaces (both sum the Neumann
series). Then a Scan over the chunks carries the state S [B, H, K, V] and forms phi(Q), phi(K)
a chunk at a time ([C, K]; never [T, K], 512 MiB a head batch at K 4096 and T 4096):

    U = U0 - Ai ((diag(b Gamma) phi(K)) S),  O = scale diag(Gamma) phi(Q) S + P U,
    S = Gamma_C S + (diag(Gamma_C / Gamma) phi(K))^T U

(with everything formed for all chunks first, the [T, K] tensors took 186 ms against 160 at o3
16x16 T 2048 and 225 against 168 at o3 32x32 T 1024 in onnxruntime on the CPU machine).
"""

from __future__ import annotations

import math

LOG_DECAY_FLOOR = -104.0  # as kernels/inputs.py: the chunk forms' clamp (exp of -inf - -inf is NaN)


class _Nodes:
    """A node list with fresh value names: ``op(kind, *inputs, **attrs)`` returns the output."""

    def __init__(self, prefix: str = "_"):
        from onnx import helper

        self.h = helper
        self.prefix = prefix  # a subgraph's own: its names may not repeat the enclosing graph's
        self.nodes: list = []
        self._n = 0

    def op(self, kind: str, *inputs: str, out: str | None = None, **attrs) -> str:
        self._n += 1
        name = out or f"{self.prefix}{kind.lower()}{self._n}"
        self.nodes.append(self.h.make_node(kind, list(inputs), [name], **attrs))
        return name

    def const(self, value, dtype: str = "int64") -> str:
        import numpy as np
        from onnx import numpy_helper

        arr = np.asarray(value, dtype=dtype)
        self._n += 1
        name = f"{self.prefix}c{self._n}"
        self.nodes.append(self.h.make_node("Constant", [], [name], value=numpy_helper.from_array(arr, name + "_v")))
        return name

    def l2normed(self, x: str, eps: float) -> str:
        """``x`` over the norm of its last axis (as the references: x / sqrt(sum x^2 + eps))."""
        ss = self.op("ReduceSum", self.op("Mul", x, x), self.const([-1]), keepdims=1)
        return self.op("Div", x, self.op("Sqrt", self.op("Add", ss, self.const(eps, "float32"))))

    def kron(self, xs: list[str], lead: int) -> str:
        """phi: the row-wise Kronecker product of the factors ``xs`` (each [*lead axes, d_i]),
        flattened to [*lead axes, prod d_i] in the state's row-major order."""
        phi = xs[0]
        for x in xs[1:]:
            outer = self.op("Mul", self.op("Unsqueeze", phi, self.const([-1])), self.op("Unsqueeze", x, self.const([-2])))
            phi = self.op("Reshape", outer, self.const([0] * lead + [-1]))
        return phi

    def flat_state(self) -> str:
        """``past_state`` [B, H, d_1, ..., d_v] as [B, H, K, V]."""
        V = self.op("Gather", self.op("Shape", "v"), self.const([3]), axis=0)
        return self.op("Reshape", "past_state", self.op("Concat", self.const([0, 0, -1]), V, axis=0))

    def present_state(self, S: str) -> None:
        """``present_state``: ``S`` [B, H, K, V] in ``past_state``'s shape."""
        self.op("Reshape", S, self.op("Shape", "past_state"), out="present_state")


def _bht(n: _Nodes, x: str, pads: str, C_t: str) -> str:
    """[B, T, H, d] -> [B, H, NT, C, d]: heads before time, time padded, cut into chunks."""
    d = n.op("Gather", n.op("Shape", x), n.const([3]), axis=0)
    shape = n.op("Concat", n.const([0, 0, -1]), C_t, d, axis=0)  # Reshape: a 0 copies that axis
    return n.op("Reshape", n.op("Pad", n.op("Transpose", x, perm=[0, 2, 1, 3]), pads), shape)


def chunk_body(order: int, update_rule: str, l2norm: bool, chunk: int, eps: float) -> list:
    """The function's nodes for the chunk-parallel body (inputs and outputs named as
    ``onnx_mixer.input_names`` and ``o`` / ``present_state``; ``scale_t`` is defined by the
    caller from the ``scale`` attribute). ``chunk``: C, a power of two."""
    import numpy as np
    from onnx import TensorProto
    from onnx import helper as h

    if chunk < 2 or chunk & (chunk - 1):
        raise ValueError(f"chunk: got {chunk}; allowed: a power of two >= 2")
    nf, C = order - 1, chunk
    gated, delta = update_rule in ("gated", "gated_delta"), update_rule in ("delta", "gated_delta")
    n = _Nodes()
    # padding and chunk shapes from T: pad = (C - T mod C) mod C
    C_t = n.const([C])
    T = n.op("Gather", n.op("Shape", "v"), n.const([1]), axis=0)
    pad = n.op("Mod", n.op("Sub", C_t, n.op("Mod", T, C_t)), C_t)
    pads4 = n.op("Concat", n.const([0] * 6), pad, n.const([0]), axis=0)  # [B, H, T, d]: T's end only
    pads3 = n.op("Concat", n.const([0] * 5), pad, axis=0)  # [B, H, T]
    chunk3 = n.const([0, 0, -1, C])
    last_axis = n.const([-1])
    normed = (lambda x: n.l2normed(x, eps)) if l2norm else (lambda x: x)
    Qc = [_bht(n, normed(f"q{i}"), pads4, C_t) for i in range(1, nf + 1)]
    Kc = [_bht(n, normed(f"k{i}"), pads4, C_t) for i in range(1, nf + 1)]
    Vc = _bht(n, "v", pads4, C_t)
    tr = dict(perm=[0, 1, 2, 4, 3])

    def gram(a: list[str], b: list[str]) -> str:
        out = None
        for x, y in zip(a, b):
            g = n.op("MatMul", x, n.op("Transpose", y, **tr))
            out = g if out is None else n.op("Mul", out, g)
        return out

    incl = n.const(np.tril(np.ones((C, C), dtype=bool)), "bool")
    scan = {f"q{i}": x for i, x in enumerate(Qc, 1)} | {f"k{i}": x for i, x in enumerate(Kc, 1)}
    if gated:
        g = n.op("Max", n.op("Transpose", "decay", perm=[0, 2, 1]), n.const(LOG_DECAY_FLOOR, "float32"))
        cum = n.op("CumSum", n.op("Reshape", n.op("Pad", g, pads3), chunk3), n.const(3))  # [B, H, NT, C]
        diff = n.op("Sub", n.op("Unsqueeze", cum, last_axis), n.op("Unsqueeze", cum, n.const([-2])))
        D = n.op("Exp", n.op("Where", incl, diff, n.const(float("-inf"), "float32")))
        last = n.op("Slice", cum, n.const([C - 1]), n.const([C]), n.const([3]))  # [B, H, NT, 1]
        scan["gam"] = n.op("Unsqueeze", n.op("Exp", cum), last_axis)  # [B, H, NT, C, 1]
        scan["kdec"] = n.op("Unsqueeze", n.op("Exp", n.op("Sub", last, cum)), last_axis)  # Gamma_C / Gamma
        scan["gC"] = n.op("Exp", last)  # [B, H, NT, 1]
    else:
        D = n.op("Cast", incl, to=TensorProto.FLOAT)
    scan["P"] = n.op("Mul", n.op("Mul", gram(Qc, Kc), D), "scale_t")
    if delta:
        b = n.op("Unsqueeze", n.op("Reshape", n.op("Pad", n.op("Transpose", "beta", perm=[0, 2, 1]), pads3), chunk3),
                 last_axis)  # [B, H, NT, C, 1]
        strict = n.const(np.tril(np.ones((C, C), dtype=bool), -1), "bool")
        A = n.op("Where", strict, n.op("Mul", n.op("Mul", b, gram(Kc, Kc)), D), n.const(0.0, "float32"))
        eye = n.const(np.eye(C, dtype="float32"), "float32")
        power = n.op("Neg", A)
        Ai = n.op("Add", eye, power)
        for _ in range(int(math.log2(C)) - 1):  # (-A)^(2^j) for j = 1 .. log2 C - 1
            power = n.op("MatMul", power, power)
            Ai = n.op("MatMul", Ai, n.op("Add", eye, power))
        scan["Ai"] = Ai
        scan["bk"] = n.op("Mul", b, scan["gam"]) if gated else b  # diag(b Gamma) on phi(K)'s rows
        scan["U0"] = n.op("MatMul", Ai, n.op("Mul", Vc, b))
    else:
        scan["U0"] = Vc

    # the sequential part: a Scan over the chunk axis carrying S [B, H, K, V]; phi(Q) and phi(K)
    # are formed here, a chunk at a time ([B, H, C, K]: never [B, H, T, K], which at K 4096 and T
    # 4096 would be 512 MiB a tensor and head batch)
    f = TensorProto.FLOAT
    body = _Nodes("_body_")
    phiQ = body.kron([f"q{i}_t" for i in range(1, nf + 1)], 3)  # [B, H, C, K]
    phiK = body.kron([f"k{i}_t" for i in range(1, nf + 1)], 3)
    U = "U0_t"
    if delta:  # U = U0 - Ai (diag(b Gamma) phi(K) S): [C, V] products, no [C, K] one
        U = body.op("Sub", "U0_t", body.op("MatMul", "Ai_t", body.op("MatMul", body.op("Mul", phiK, "bk_t"), "S_in")))
    Qg = body.op("Mul", phiQ, "scale_t")
    if gated:
        Qg = body.op("Mul", Qg, "gam_t")
    body.op("Add", body.op("MatMul", Qg, "S_in"), body.op("MatMul", "P_t", U), out="O_t")
    S, Kd = "S_in", phiK
    if gated:
        S = body.op("Mul", S, body.op("Unsqueeze", "gC_t", body.const([-1])))
        Kd = body.op("Mul", phiK, "kdec_t")
    body.op("Add", S, body.op("MatMul", body.op("Transpose", Kd, perm=[0, 1, 3, 2]), U), out="S_out")
    graph = h.make_graph(body.nodes, "running_tensor_chunk",
                         [h.make_tensor_value_info("S_in", f, None)]
                         + [h.make_tensor_value_info(f"{name}_t", f, None) for name in scan],
                         [h.make_tensor_value_info("S_out", f, None), h.make_tensor_value_info("O_t", f, None)])
    n.nodes.append(h.make_node("Scan", [n.flat_state(), *scan.values()], ["S_final", "O_chunks"], body=graph,
                               num_scan_inputs=len(scan), scan_input_axes=[2] * len(scan), scan_output_axes=[2]))
    V = n.op("Gather", n.op("Shape", "v"), n.const([3]), axis=0)
    o = n.op("Reshape", "O_chunks", n.op("Concat", n.const([0, 0, -1]), V, axis=0))  # [B, H, NT C, V]
    o = n.op("Slice", o, n.const([0]), T, n.const([2]))
    n.op("Transpose", o, perm=[0, 2, 1, 3], out="o")
    n.present_state("S_final")
    return n.nodes


def _token_update(n: _Nodes, S: str, phiq: str, phik: str, v: str, decay: str | None,
                  beta: str | None) -> tuple[str, str]:
    """One token's update: phi rows [B, H, 1, K], S [B, H, K, V], v [B, H, 1, V], log decay and
    beta [B, H, 1, 1] (None without the gate / delta rule) -> (S', o [B, H, 1, V])."""
    if decay is not None:
        S = n.op("Mul", S, n.op("Exp", decay))
    u = v
    if beta is not None:
        u = n.op("Mul", beta, n.op("Sub", v, n.op("MatMul", phik, S)))
    S = n.op("Add", S, n.op("MatMul", n.op("Transpose", phik, perm=[0, 1, 3, 2]), u))
    return S, n.op("Mul", n.op("MatMul", phiq, S), "scale_t")


def token_body(order: int, update_rule: str, l2norm: bool, eps: float) -> list:
    """The function's nodes for one token (``body="token"``: the decode graph's, T = 1): the
    token Scan's step without the Scan, its contractions as matrix products (the example model's
    B1 decode step in onnxruntime on the CPU machine: 0.84 ms against 0.91 with a one-step Scan;
    Einsum contractions had cost 1.05 ms a layer). Squeezing T fails at run time for T > 1
    rather than computing one token."""
    nf = order - 1
    gated, delta = update_rule in ("gated", "gated_delta"), update_rule in ("delta", "gated_delta")
    n = _Nodes()
    t_axis = n.const([1])

    def factor(x: str) -> str:  # [B, 1, H, d] -> [B, H, d], normalised
        x = n.op("Squeeze", x, t_axis)
        return n.l2normed(x, eps) if l2norm else x

    def phi_row(prefix: str) -> str:  # [B, H, 1, K]
        return n.op("Unsqueeze", n.kron([factor(f"{prefix}{i}") for i in range(1, nf + 1)], 2), n.const([2]))

    per_head = n.const([0, 0, 0, 1])  # [B, 1, H] -> [B, H, 1, 1] (Transpose then Reshape)
    scalar = lambda x: n.op("Reshape", n.op("Transpose", x, perm=[0, 2, 1]), per_head)
    S, o = _token_update(n, n.flat_state(), phi_row("q"), phi_row("k"), n.op("Transpose", "v", perm=[0, 2, 1, 3]),
                         scalar("decay") if gated else None, scalar("beta") if delta else None)
    n.op("Transpose", o, perm=[0, 2, 1, 3], out="o")
    n.present_state(S)
    return n.nodes


def scan_body(order: int, update_rule: str, l2norm: bool, eps: float) -> list:
    """The function's nodes for the token Scan (``body="scan"``: any T, one token a step; the
    portable baseline the other bodies are checked against): the state flattened to
    [B, H, K, V] is carried, each step the token update of :func:`token_body`."""
    from onnx import TensorProto
    from onnx import helper as h

    nf = order - 1
    gated, delta = update_rule in ("gated", "gated_delta"), update_rule in ("delta", "gated_delta")
    scanned = [f"q{i}" for i in range(1, nf + 1)] + [f"k{i}" for i in range(1, nf + 1)] + ["v"]
    scanned += ["decay"] * gated + ["beta"] * delta
    # the step sees each scanned input without its T axis: factors [B, H, d], v [B, H, V], [B, H]
    body = _Nodes("_body_")  # a subgraph's names may not repeat the enclosing function's
    normed = (lambda x: body.l2normed(x, eps)) if l2norm else (lambda x: x)
    phi_row = lambda p: body.op("Unsqueeze", body.kron([normed(f"{p}{i}_t") for i in range(1, nf + 1)], 2),
                                body.const([2]))
    scalar = lambda x: body.op("Unsqueeze", x, body.const([2, 3]))
    S, o = _token_update(body, "S_in", phi_row("q"), phi_row("k"), body.op("Unsqueeze", "v_t", body.const([2])),
                         scalar("decay_t") if gated else None, scalar("beta_t") if delta else None)
    body.op("Identity", S, out="S_out")
    body.op("Squeeze", o, body.const([2]), out="o_t")
    f = TensorProto.FLOAT
    graph = h.make_graph(body.nodes, "running_tensor_step",
                         [h.make_tensor_value_info("S_in", f, None)]
                         + [h.make_tensor_value_info(f"{name}_t", f, None) for name in scanned],
                         [h.make_tensor_value_info("S_out", f, None), h.make_tensor_value_info("o_t", f, None)])
    n = _Nodes()
    n.nodes.append(h.make_node("Scan", [n.flat_state(), *scanned], ["S_final", "o"], body=graph,
                               num_scan_inputs=len(scanned), scan_input_axes=[1] * len(scanned),
                               scan_output_axes=[1]))
    n.present_state("S_final")
    return n.nodes
