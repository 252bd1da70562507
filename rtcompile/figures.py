"""Derived figures of a spec: state size, parameters, FLOPs and bytes per token.

These are the formulas ``rtcompile info`` prints and the cost model (issue 5) starts from. All
counts are per layer and per token unless the name says otherwise; a FLOP is one multiply or
one add (a multiply-add is 2).

Per head, with K = prod(d_i), V = value width, C = chunk size, S = sum(d_i):

recurrent step (reads and writes the whole state once)
    readout  <S_t, q>           2 K V
    update   phi(k) (x) u       2 K V
    decay    a_t S              K V       (forget gate)
    delta    <a S, k_hat>       2 K V     (delta rule)
    phi      build phi(q), phi(k) on chip: 2 K (o - 2)  (order 2 needs none)
    bytes    2 * state bytes + inputs + outputs

chunk-parallel (state read and written once per chunk, so 2 * state bytes / C per token)
    scores   Q K^T as a product of o-1 Gram blocks       2 C S
    apply    scores @ U                                   2 C V
    state    phi(Q) S0 and phi(K)^T U                     4 K V
    delta    phi(K) S0, the K K^T Gram blocks, the solve  2 K V + 2 C S + 2 C V
This is DESIGN.md's "about 2 (C S + C V + 3 K V)" made explicit per feature (the causal mask
halves the C terms in a kernel that skips the upper triangle; the figures do not assume it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import DTYPE_BYTES, ModelSpec


@dataclass(frozen=True)
class PhaseFigures:
    flops_per_token: int
    bytes_per_token: float

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops_per_token / self.bytes_per_token


def parameters_per_layer(spec: ModelSpec) -> int:
    """Parameters of one layer (no embedding, no MLP).

    dense:      input projection D x H (2 S + V), short conv w x H (2 S + V) when w > 0
    conconlyc:  one tied depthwise conv of width w over the D model channels per stream
                (2 (o-1) + 1 streams: the query factors, the key factors, the value), tiled
                to the stream's width: w D (2 (o-1) + 1)
    gates:      forget gate D H + H, beta D H + H, query skip (o-1) (D H + H)
    output:     output gate D H V (when on), norm V, output projection H V D
    """
    f = spec.features
    D, H, V, w = spec.model_width, spec.heads, spec.value_width, f.short_conv
    S = sum(spec.key_widths)
    streams = H * (2 * S + V)
    if f.projection == "dense":
        p = D * streams + (w * streams if w else 0)
    else:
        p = w * D * (2 * (spec.order - 1) + 1)
    if f.forget_gate:
        p += D * H + H
    if f.delta_rule:
        p += D * H + H
    if f.query_skip:
        p += (spec.order - 1) * (D * H + H)
    if f.output_gate:
        p += D * H * V + V
    p += H * V * D
    return p


def io_bytes_per_token(spec: ModelSpec) -> int:
    """Bytes of the mixer's per-token inputs and outputs, all heads."""
    f = spec.features
    ib = DTYPE_BYTES[spec.input_dtype]
    per_head = 2 * sum(spec.key_widths) + spec.value_width  # q and k factors, v
    per_head += int(f.forget_gate) + int(f.delta_rule)  # g, beta
    per_head += spec.value_width  # output
    return spec.heads * per_head * ib


_io_bytes_per_token = io_bytes_per_token  # the old name, still imported by costmodel.py until its rewrite lands; then delete


def recurrent_figures(spec: ModelSpec) -> PhaseFigures:
    """One token through the recurrent step, all heads of one layer."""
    f = spec.features
    K, V = spec.key_dim, spec.value_width
    per_head = 4 * K * V + 2 * K * (spec.order - 2)
    if f.forget_gate:
        per_head += K * V
    if f.delta_rule:
        per_head += 2 * K * V
    nbytes = 2 * spec.state_bytes_per_layer + io_bytes_per_token(spec)
    return PhaseFigures(spec.heads * per_head, float(nbytes))


def chunk_figures(spec: ModelSpec, chunk_size: int | None = None) -> PhaseFigures:
    """One token of chunk-parallel prefill (amortised over a chunk), all heads of one layer."""
    C = chunk_size or spec.resolved_chunk_size
    K, V, S = spec.key_dim, spec.value_width, sum(spec.key_widths)
    per_head = 2 * C * S + 2 * C * V + 4 * K * V
    if spec.features.delta_rule:
        per_head += 2 * K * V + 2 * C * S + 2 * C * V
    nbytes = 2 * spec.state_bytes_per_layer / C + io_bytes_per_token(spec)
    return PhaseFigures(spec.heads * per_head, nbytes)


def summary(spec: ModelSpec) -> dict:
    """Every derived figure, as plain data (what ``rtcompile info --json`` prints)."""
    rec = recurrent_figures(spec)
    chk = chunk_figures(spec)
    ppl = parameters_per_layer(spec)
    return {
        "spec": spec.to_dict(),
        "key_dim": spec.key_dim,
        "scale": spec.effective_scale,
        "update_rule": spec.features.update_rule,
        "state": {
            "shape_per_head": [*spec.key_widths, spec.value_width],
            "elements_per_head": spec.state_elements_per_head,
            "bytes_per_head": spec.state_bytes_per_head,
            "bytes_per_sequence_per_layer": spec.state_bytes_per_layer,
            "bytes_per_sequence": spec.state_bytes_per_sequence,
            "dtype": spec.state_dtype,
        },
        "parameters": {"per_layer": ppl, "model_excluding_embeddings": ppl * spec.layers},
        "recurrent": {
            "flops_per_token_per_layer": rec.flops_per_token,
            "bytes_per_token_per_layer": rec.bytes_per_token,
            "flops_per_byte": rec.intensity,
        },
        "chunk": {
            "chunk_size": spec.resolved_chunk_size,
            "chunk_size_is_default": spec.chunk_size == "auto",
            "flops_per_token_per_layer": chk.flops_per_token,
            "bytes_per_token_per_layer": chk.bytes_per_token,
            "flops_per_byte": chk.intensity,
        },
    }


def human_bytes(n: float | None, fmt: str = ".3g") -> str:
    """``n`` bytes in B, KiB, MiB, GiB or TiB (``fmt`` above bytes); "-" for None."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:{fmt}} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_count(n: float | None, fmt: str = ".3g", small: str | None = None) -> str:
    """``n`` with a k, M or G suffix (``fmt``; below 1000 ``small``, default ``fmt``); "-" for None."""
    if n is None:
        return "-"
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:{fmt}} {unit}"
    return f"{n:{small or fmt}}"
