"""The register-resident chunk form: a chunk-parallel prepare kernel (``chunk_prepare.py``)
writes each chunk's scores and inverse, then one sequential program per (sequence, head, value
block) walks the chunks with the whole [K, block_v] state tile in registers (read once, written
once per call). The fused form (``chunk_fused.py``) runs the same sequential kernel with the
scores and the solve formed in the kernel instead.

Per chunk (local cumulative log decay c, Gamma = exp(c)), with P and Ai as in ``chunk_prepare``:

    U  = Ai diag(b) (V - diag(Gamma) phi(K) S)         (U = V without the delta rule)
    O  = scale (diag(Gamma) phi(Q) S + P U)
    S' = Gamma_C S + (phi(K) * Gamma_C / Gamma)^T U
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl

from . import args
from .args import factor_args, lowp_dots, width_args
from .blocks import (
    chunk_inputs, dot, factor_tiles, floored_cumsum, load_row_inputs, load_state_tile, load_wy, one_side_tiles,
    phi_block, phi_from_tiles, sequence_of_program,
)
from .chunk_prepare import prepare_scores
from .config import (
    DEFAULT_SMEM_BYTES, DOT_PRECISIONS, PREPARE_WARPS, SOLVES, CostFigures, KernelConfig,
    KernelShape, Workload, chunk_count, chunk_live_elements, chunk_programs, chunk_refusal, chunk_smem_estimate,
    estimate_registers, next_pow2, resource_refusal, two_kernel_workspace,
)
from .inputs import Problem
from .launch_cache import cached
from .reference import L2NORM_EPS, l2normalize
from .solves import unit_lower_inverse_scratch

# materialised keys cost 2 x 2 K bytes per token-head; above K = 256 the resident state tile does
# not fit registers anyway (the check's own limit)
MATERIALISE_MAX_K = 256


@dataclass(frozen=True)
class ResidentConfig(KernelConfig):
    """Prepare kernel + a sequential kernel holding the state tile in registers.

    ``chunk_size`` C: tokens per chunk. ``block_v``: the state tile's value columns (the key
    tile is all of K, rounded up to a power of two). ``num_warps``/``num_stages``: the
    sequential kernel's. ``prepare_warps``: the prepare kernel's (its programs are independent,
    so fewer warps each let more of them share an SM). ``solve``: the delta rule's (I + A)^-1 row
    by row in registers ("rows"), in [16, 16] tiles in the prepare kernel's workspace ("tiles")
    or by [C, C] products in registers ("products", C <= 64). ``dot_precision``: how fp32
    operands enter tl.dot (16-bit inputs use their own type). ``prefetch_inputs``: load the
    next chunk's factor tiles, values, gates and prepared scores before the current chunk's
    arithmetic, so their latency hides behind it (needs power-of-two key widths >= 16: a factor
    tile is then exactly one load).
    ``wy``: the prepare kernel applies the solve (W = Ai diag(b Gamma) phi(K), U0 = Ai diag(b) V,
    a [T, K] and a [T, V] workspace), leaving two products on the sequential chain instead of
    three (o2 64 on the H200: 0.415 ms with prefetch + wy, 0.574 with prefetch alone).
    ``materialise`` (order >= 3, K <= 256): form phi(q), phi(k) as [B, T, H, K] tensors in the
    inputs' type first (factors normalised in fp32 when l2norm) and run the order-2 kernels on
    them: 2 x 2 K bytes per token-head written and read again, against factored tiles that
    cannot be prefetched below 16-wide factors (o3 8x8 ran 0.486 ms where o2 64, the same
    problem materialised, ran 0.359: issue 22). The default for order >= 3 up to K = 128
    (``forms.CHUNK_DEFAULTS``: o3 16x8 0.476 ms against 0.593 factored, H200); the tuner
    weighs it like any other field.
    """

    kernel: ClassVar[str] = "chunk"
    form: ClassVar[str] = "resident"
    chunk_size: int
    block_v: int
    num_warps: int = 4
    num_stages: int = 1
    prepare_warps: int = 4
    solve: str = "tiles"
    dot_precision: str = "ieee"
    prefetch_inputs: bool = False
    wy: bool = False
    materialise: bool = False

    def block_k(self, shape: KernelShape) -> int:
        return shape.key_dim_pow2

    def resident(self, shape: KernelShape) -> bool:
        return True

    def check(self, shape: KernelShape, smem_limit: int = DEFAULT_SMEM_BYTES) -> str | None:
        if (reason := chunk_refusal(self, shape)) is not None:
            return reason
        if self.materialise:
            if (reason := materialise_refusal(shape)) is not None:
                return reason
            shape = materialised(shape)
        if self.prefetch_inputs and not shape.whole_factor_tiles:
            return f"prefetch_inputs=True needs power-of-two key widths >= 16, got {shape.key_widths}"
        return resource_refusal(self, shape, smem_limit,
                                f": K = {shape.key_dim} is too wide to keep in registers (use StreamedConfig)")

    def estimate_registers(self, shape: KernelShape) -> int:
        C, bk, bv = self.chunk_size, self.block_k(shape), self.block_v
        live = chunk_live_elements(shape, C, bk, bv)
        if self.prefetch_inputs:  # the next chunk's factor tiles, values, P and Ai
            live += 2 * C * sum(shape.key_widths) + C * bv + 2 * C * C
        if self.wy:  # the W rows and U0 block (twice with prefetch: this chunk's and the next)
            live += (C * bk + C * bv) * (2 if self.prefetch_inputs else 1)
        return estimate_registers(live, self.num_warps)

    def estimate_smem(self, shape: KernelShape) -> int:
        return chunk_smem_estimate(self.chunk_size, self.block_k(shape), self.block_v, self.num_stages)

    @classmethod
    def space(cls, shape: KernelShape) -> dict[str, list]:
        if cls(chunk_size=16, block_v=16, num_warps=8).check(shape, 1 << 30) is not None:
            return {}  # even the smallest tile does not fit registers
        mat = can_materialise(shape)
        return {
            "chunk_size": [16, 32, 64, 128],
            "block_v": [b for b in (16, 32, 64) if b <= shape.value_dim_pow2],
            "num_warps": [2, 4, 8],
            "num_stages": [1, 2, 3],
            "prepare_warps": list(PREPARE_WARPS),
            "solve": list(SOLVES),
            "dot_precision": list(DOT_PRECISIONS),
            "prefetch_inputs": [False, True] if shape.whole_factor_tiles or mat else [False],
            "wy": [False, True],
            "materialise": [False, True] if mat else [False],
        }

    def workspace_bytes(self, w: Workload) -> int:
        keys = 2 * w.rows * w.shape.key_dim * w.shape.input_bytes if self.materialise else 0  # phi(q), phi(k)
        return two_kernel_workspace(self, w, wy=self.wy) + keys

    def figures(self, w: Workload) -> CostFigures:
        extra = 2 if self.materialise else 0  # materialise_phi_kernel, once per side
        return CostFigures(programs=chunk_programs(w, self.block_v), serial_steps=chunk_count(w, self.chunk_size),
                           state_passes=2, workspace_bytes=self.workspace_bytes(w), launches=2 + extra)


# ----- the sequential kernel -----
@triton.jit
def _load_chunk(q1, q2, q3, k1, k2, k3, v, g, beta, P, Ai, W, U0, r, m_t, o_v, m_v, p_row,
                NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, C: tl.constexpr,
                BK: tl.constexpr, V: tl.constexpr, L2NORM: tl.constexpr):
    """Every input of one chunk that does not depend on the state, in registers (PREFETCH): the
    (normalised) [C, D_i] factor tiles (each D_i a power of two >= 16, so a tile is exactly its
    factor), values, log-decay increments, beta, and the prepared P and Ai (W and U0 when W is
    given). Slots that are off hold a small placeholder that is never read. Issued one chunk
    ahead, these loads wait behind the current chunk's arithmetic instead of in front of it."""
    b_q1, b_q2, b_q3, b_k1, b_k2, b_k3 = factor_tiles(q1, q2, q3, k1, k2, k3, r, m_t, NF, D1, D2, D3,
                                                      D1, D2, D3, L2NORM)
    b_v, b_g, b_b = load_row_inputs(v, g, beta, r, r, m_t, o_v, m_v, C, V, True, g is not None, beta is not None)
    b_Ai = tl.zeros([C, C], dtype=tl.float32)
    b_W = tl.zeros([C, 16], dtype=tl.float32)
    b_U0 = tl.zeros([C, 16], dtype=tl.float32)
    b_P = tl.load(P + p_row[:, None] * C + tl.arange(0, C)[None, :], mask=m_t[:, None], other=0.0)
    if W is not None:
        b_W, b_U0 = load_wy(W, U0, p_row, m_t, o_v, m_v, D1 * D2 * D3, BK, V)
    elif beta is not None:
        b_Ai = tl.load(Ai + p_row[:, None] * C + tl.arange(0, C)[None, :], mask=m_t[:, None], other=0.0)
    return b_q1, b_q2, b_q3, b_k1, b_k2, b_k3, b_v, b_g, b_b, b_P, b_Ai, b_W, b_U0


@triton.jit
def chunk_resident_kernel(
    q1, q2, q3, k1, k2, k3, v, g, beta, o, h0, ht, P, Ai, W, U0, cu_seqlens, scale, T,
    H: tl.constexpr, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
    OUTER: tl.constexpr, SCORES: tl.constexpr, PREFETCH: tl.constexpr,
):
    """One program per (sequence, head, value block) walks the chunks in order with the
    [BK >= K, BV] state in registers. SCORES "workspace": P and Ai (W given: W and U0, the WY
    form, U = U0 - W S, a chain of two products instead of three) come from the prepare
    kernel; "rows" / "tiles" / "products": formed here (the fused form; "tiles" inverts in this
    program's [C, C] scratch ``Ai``). PREFETCH (workspace, power-of-two widths >= 16): the next chunk's
    inputs are loaded before this chunk's arithmetic. ``g`` / ``beta`` / ``h0`` / ``ht`` /
    ``cu_seqlens`` None: no gates / no delta rule / zero initial state / no final state / not
    varlen."""
    K: tl.constexpr = D1 * D2 * D3
    USE_BETA: tl.constexpr = beta is not None
    WY: tl.constexpr = W is not None
    # The fused scores keep their Grams, solve and score products in fp32: with 16-bit operands
    # there (C=64, BK=128, 8 warps, order 3 64x64) the H200 returned wrong results and then an
    # illegal address (Triton 3.6); fp32 was verified there.
    LOWP_SCORES: tl.constexpr = LOWP and SCORES == "workspace"
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, i_b = sequence_of_program(i_n, T, cu_seqlens)
    DT: tl.constexpr = q1.dtype.element_ty
    o_c = tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_state = (i_n.to(tl.int64) * H + i_h) * K * V
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    off_s = p_state + o_k[:, None] * V + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    b_s = load_state_tile(h0, ht, off_s, m_s, True, h0 is not None)
    if PREFETCH:  # chunk 0's inputs; every iteration then issues the next chunk's loads first
        tok = bos + o_c
        p_row = (i_b * H + i_h) * T + tok
        n_q1, n_q2, n_q3, n_k1, n_k2, n_k3, n_v, n_g, n_b, n_P, n_Ai, n_W, n_U0 = _load_chunk(
            q1, q2, q3, k1, k2, k3, v, g, beta, P, Ai, W, U0, (i_b * T + tok) * H + i_h, tok < eos, o_v, m_v,
            p_row, NF, D1, D2, D3, C, BK, V, L2NORM,
        )
    for i_c in range(0, tl.cdiv(eos - bos, C)):
        tok = bos + i_c * C + o_c
        m_t = tok < eos
        r = (i_b * T + tok) * H + i_h
        if PREFETCH:
            b_q1, b_q2, b_q3, b_k1, b_k2, b_k3 = n_q1, n_q2, n_q3, n_k1, n_k2, n_k3
            b_v, b_g, b_b, b_P, b_Ai, b_W, b_U0 = n_v, n_g, n_b, n_P, n_Ai, n_W, n_U0
            tok_n = tok + C  # past the end: every load is masked off
            p_row = (i_b * H + i_h) * T + tok_n
            n_q1, n_q2, n_q3, n_k1, n_k2, n_k3, n_v, n_g, n_b, n_P, n_Ai, n_W, n_U0 = _load_chunk(
                q1, q2, q3, k1, k2, k3, v, g, beta, P, Ai, W, U0, (i_b * T + tok_n) * H + i_h, tok_n < eos, o_v,
                m_v, p_row, NF, D1, D2, D3, C, BK, V, L2NORM,
            )
            b_c = tl.zeros([C], dtype=tl.float32)
            if g is not None:
                b_c = floored_cumsum(b_g)
        else:
            b_c, b_P, b_Ai, b_W, b_U0, r_q, r_k, b_v, b_b = chunk_inputs(
                q1, q2, q3, k1, k2, k3, v, g, beta, P, Ai, W, U0, r, m_t, o_v, m_v, (i_b * H + i_h) * T + tok,
                NF, D1, D2, D3, BD1, BD2, BD3, C, BK, V, L2NORM, PREC, SCORES,
            )
            if SCORES == "tiles" and USE_BETA:  # fused tile solve: A inverted in this program's scratch
                b_Ai = unit_lower_inverse_scratch(Ai + (i_nh * tl.num_programs(0) + i_v).to(tl.int64) * C * C,
                                                  b_Ai, C, PREC)
        b_gam = tl.exp(b_c)
        b_last = tl.sum(tl.where(o_c == C - 1, b_c, 0.0), axis=0)
        b_ratio = tl.exp(b_last - b_c)  # Gamma_C / Gamma_i <= 1
        if PREFETCH:  # the tiles are normalised already: no row scales
            b_k = phi_from_tiles(b_k1, b_k2, b_k3, NF, C, D1, D2, D3)
            b_q = phi_from_tiles(b_q1, b_q2, b_q3, NF, C, D1, D2, D3)
        else:
            b_k = phi_block(k1, k2, k3, r, m_t, 0, C, BK, NF, D1, D2, D3, K, OUTER) * r_k[:, None]
            b_q = phi_block(q1, q2, q3, r, m_t, 0, C, BK, NF, D1, D2, D3, K, OUTER) * r_q[:, None]
        if WY:  # the delta's prediction, Ai diag(b Gamma) phi(K) S, in one product
            b_ws = dot(b_W, b_s, LOWP, DT, PREC)
        else:
            b_ks = dot(b_k, b_s, LOWP, DT, PREC)
        b_qs = dot(b_q, b_s, LOWP, DT, PREC)
        if WY:
            b_u = b_U0 - b_ws
        elif USE_BETA:
            b_u = dot(b_Ai, b_b[:, None] * (b_v - b_gam[:, None] * b_ks), LOWP_SCORES, DT, PREC)
        else:
            b_u = b_v
        b_o = scale * (b_gam[:, None] * b_qs + dot(b_P, b_u, LOWP_SCORES, DT, PREC))
        tl.store(o + r[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        b_s = tl.exp(b_last) * b_s + dot(tl.trans(b_k * b_ratio[:, None]), b_u, LOWP, DT, PREC)
    if ht is not None:
        tl.store(ht + off_s, b_s.to(ht.dtype.element_ty), mask=m_s)


# ----- launcher -----
def run_resident(p: Problem, q, k, v, g, beta, *, h0, ht, cu_seqlens, l2norm: bool, chunk_size: int, block_k: int,
                 block_v: int, num_warps: int, num_stages: int, precision: str, scores: str, prefetch: bool,
                 ws: dict) -> torch.Tensor:
    """Allocate o and run :func:`chunk_resident_kernel` (``ws``: its P, Ai, W, U0 or None each;
    with ``scores`` "tiles", Ai is the [programs, C, C] scratch)."""
    B, T, H, V = v.shape
    o = args.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    grid = (triton.cdiv(V, block_v), p.num_seqs * H)
    cached(chunk_resident_kernel)[grid](
        *factor_args(q), *factor_args(k), v, g, beta, o, h0, ht, ws.get("P"), ws.get("Ai"), ws.get("W"),
        ws.get("U0"), cu_seqlens, p.scale, T,
        H=H, NF=len(q), **width_args(p.key_widths, 16), V=V, C=chunk_size, BK=block_k, BV=block_v, L2NORM=l2norm,
        LOWP=lowp_dots(v.dtype), PREC=precision, OUTER=KernelShape(p.key_widths, V).outer_phi_ok(block_k),
        SCORES=scores, PREFETCH=prefetch, num_warps=num_warps, num_stages=num_stages,
    )
    return o


def materialised(shape: KernelShape) -> KernelShape:
    """The order-2 shape of ``shape``'s problem with its keys materialised (K = prod d_i)."""
    return KernelShape((shape.key_dim,), shape.value_width, shape.input_bytes)


def can_materialise(shape: KernelShape) -> bool:
    return materialise_refusal(shape) is None


def materialise_refusal(shape: KernelShape) -> str | None:
    """Why a config with ``materialise=True`` cannot take ``shape``, or None."""
    if len(shape.key_widths) < 2:
        return "materialise=True needs order >= 3 (an order-2 key is its one factor already)"
    if shape.key_dim > MATERIALISE_MAX_K:
        return (f"materialise=True forms [T, K] keys up to K = {MATERIALISE_MAX_K}, got K = "
                f"{shape.key_dim}; allowed: materialise=False")
    return None


def materialise_pair(q, k, l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """phi(q), phi(k) as :func:`materialise_phi` makes each, in one launch."""
    qs, ks = [x.contiguous() for x in q], [x.contiguous() for x in k]
    B, T, H, _ = qs[0].shape
    K = math.prod(x.shape[-1] for x in qs)
    outs = [args.empty(B, T, H, K, dtype=phi_store_dtype(qs[0].dtype), device=qs[0].device) for _ in range(2)]
    fill_phi([qs, ks], outs, l2norm)
    return outs[0].to(qs[0].dtype), outs[1].to(ks[0].dtype)


def materialised_call(p: Problem, q, k, h0, ht, l2norm: bool):
    """(p, q, k, h0, ht, l2norm) of the order-2 problem on phi(q), phi(k) (normalised here, so
    l2norm False after): the flattened state [.., K, V] is the same memory as [.., d_1, .., V]."""
    pq, pk = materialise_pair(q, k, l2norm)
    p = dataclasses.replace(p, key_widths=(p.key_dim,))
    flat = (p.num_seqs, p.heads, p.key_dim, p.value_width)
    return p, [pq], [pk], None if h0 is None else h0.view(flat), None if ht is None else ht.view(flat), False


def _unit_factors(factors, l2norm: bool) -> list[torch.Tensor]:
    """The factors in fp32, each normalised when ``l2norm`` (the reference's eps, the kernels')."""
    xs = [x.float() for x in factors]
    return [l2normalize(x) for x in xs] if l2norm else xs


@triton.jit
def _unit_row_scale(x, r, m_t, D: tl.constexpr, BD: tl.constexpr, L2NORM: tl.constexpr):
    """[BT] fp32: 1 / ||x_r|| (the reference's eps) when L2NORM, else ones; BD: D's power of two."""
    if L2NORM:
        o_d = tl.arange(0, BD)
        b_x = tl.load(x + r[:, None] * D + o_d[None, :], mask=m_t[:, None] & (o_d < D)[None, :], other=0.0)
        b_x = b_x.to(tl.float32)
        return tl.rsqrt(tl.sum(b_x * b_x, axis=1) + 1e-6)
    return tl.where(m_t, 1.0, 0.0)


@triton.jit
def _phi_rows(x1, x2, x3, out, r, m_t, NF: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
              BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
              L2NORM: tl.constexpr):
    """Rows ``r`` (mask ``m_t``) of phi = x1 (x) x2 (x) x3 (row-major, [.., K] in ``out``'s type),
    each factor normalised in fp32 first when L2NORM. Any widths: every column gathers its
    factor entries from the rows' cached loads; power-of-two widths load each factor's tile once
    and multiply in registers."""
    K: tl.constexpr = D1 * D2 * D3
    o_k = tl.arange(0, KP)
    m = m_t[:, None] & (o_k < K)[None, :]
    if K == KP and D1 == BD1 and D2 == BD2 and D3 == BD3:
        # power-of-two widths: one contiguous tile load a factor and the outer product in
        # registers, where the gathers below issue a load per phi entry and factor
        b_x1, b_x2, b_x3 = one_side_tiles(x1, x2, x3, r, m_t, NF, D1, D2, D3, D1, D2, D3, L2NORM)
        b_phi = phi_from_tiles(b_x1, b_x2, b_x3, NF, BT, D1, D2, D3)
    else:
        b_phi = tl.load(x1 + r[:, None] * D1 + (o_k // (D2 * D3))[None, :], mask=m, other=0.0).to(tl.float32)
        b_phi *= _unit_row_scale(x1, r, m_t, D1, BD1, L2NORM)[:, None]
        if NF > 1:
            b_x = tl.load(x2 + r[:, None] * D2 + ((o_k // D3) % D2)[None, :], mask=m, other=0.0).to(tl.float32)
            b_phi *= b_x * _unit_row_scale(x2, r, m_t, D2, BD2, L2NORM)[:, None]
        if NF > 2:
            b_x = tl.load(x3 + r[:, None] * D3 + (o_k % D3)[None, :], mask=m, other=0.0).to(tl.float32)
            b_phi *= b_x * _unit_row_scale(x3, r, m_t, D3, BD3, L2NORM)[:, None]
    tl.store(out + r[:, None] * K + o_k[None, :], b_phi.to(out.dtype.element_ty), mask=m)


@triton.jit
def materialise_phi_kernel(x1, x2, x3, y1, y2, y3, out_x, out_y, N, NF: tl.constexpr, D1: tl.constexpr,
                           D2: tl.constexpr, D3: tl.constexpr, BD1: tl.constexpr, BD2: tl.constexpr,
                           BD3: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, L2NORM: tl.constexpr):
    """Rows [i BT, (i + 1) BT) of phi of the N token-head rows of the factors ``x`` into
    ``out_x``; program_id(1) 1: the second side, ``y`` into ``out_y`` (None: one side). Both
    sides in one launch (o3 8x8 B8 T4096 H8 bf16 on the H200: 24.1 us against 26.3 in two)."""
    r = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    m_t = r < N
    if y1 is None:
        _phi_rows(x1, x2, x3, out_x, r, m_t, NF, D1, D2, D3, BD1, BD2, BD3, KP, BT, L2NORM)
    elif tl.program_id(1) == 0:
        _phi_rows(x1, x2, x3, out_x, r, m_t, NF, D1, D2, D3, BD1, BD2, BD3, KP, BT, L2NORM)
    else:
        _phi_rows(y1, y2, y3, out_y, r, m_t, NF, D1, D2, D3, BD1, BD2, BD3, KP, BT, L2NORM)


# rows per program of materialise_phi_kernel: a [BT, K] fp32 tile of 4096 elements (32 registers
# per thread at 4 warps), as the token-parallel phi-to-factors kernel of the backward
MATERIALISE_TILE = 4096


def phi_store_dtype(dtype: torch.dtype) -> torch.dtype:
    """The type materialise_phi_kernel stores for factors of ``dtype``: their own, but fp32 for
    bf16 under the interpreter, which casts fp32 to bf16 toward zero (half the entries one ulp
    low; the kernel tests' bf16 output error 0.0080 mean against 0.0047 rounded): round in torch
    there."""
    return torch.float32 if dtype == torch.bfloat16 and args.interpreting() else dtype


def fill_phi(sides, outs, l2norm: bool) -> None:
    """phi of each side's factors ([B, T, H, d_i] each, contiguous; one or two sides) into its
    ``outs`` buffer ([B, T, H, K] in :func:`phi_store_dtype`), in one launch."""
    rows = sides[0][0].numel() // sides[0][0].shape[-1]
    kp = next_pow2(outs[0].shape[-1])
    bt = max(1, min(256, MATERIALISE_TILE // kp))
    second = factor_args(sides[1]) if len(sides) > 1 else (None, None, None)
    cached(materialise_phi_kernel)[(triton.cdiv(rows, bt), len(sides))](
        *factor_args(sides[0]), *second, outs[0], outs[-1] if len(sides) > 1 else None, rows,
        NF=len(sides[0]), **width_args(tuple(x.shape[-1] for x in sides[0]), 1), KP=kp, BT=bt, L2NORM=l2norm,
        num_warps=4)


def materialise_phi(factors, l2norm: bool) -> torch.Tensor:
    """phi = x1 (x) x2 (x) .. ([B, T, H, K], row-major, in the factors' type) of the factors
    [B, T, H, d_i], normalised in fp32 first when ``l2norm``: one token-parallel kernel that reads
    the factors and writes phi once (before it, ~10 ATen launches with fp32 temporaries: o3 8x8
    at B8 T4096 H8 took 0.62 ms with the materialised config where o2 64 took 0.34, H200)."""
    xs = [x.contiguous() for x in factors]
    B, T, H, _ = xs[0].shape
    K = math.prod(x.shape[-1] for x in xs)
    out = args.empty(B, T, H, K, dtype=phi_store_dtype(xs[0].dtype), device=xs[0].device)
    fill_phi([xs], [out], l2norm)
    return out.to(xs[0].dtype)


def kronecker_factor_grads(factors, l2norm: bool, dphi: torch.Tensor) -> list[torch.Tensor]:
    """The factors' gradients given phi's (``dphi`` [B, T, H, K]) for phi = :func:`materialise_phi`,
    in closed form: du_i is dphi contracted with every other (unit) factor, and through the l2norm
    dx = r (du - u <u, du>) with r = 1 / sqrt(|x|^2 + eps). Plain ATen ops, no autograd: the
    backward runs inside a custom op's kernel, where autograd's dispatch keys are excluded and a
    graph built there records nothing (o3 8x8 MQAR training failed so on the H200, 2026-12-02).
    Holds dphi in fp32 ([T, K] temporary) and the factors in the inputs' type."""
    us = _unit_factors(factors, l2norm)
    d = dphi.float().reshape(*dphi.shape[:-1], *(u.shape[-1] for u in us))
    axes = "abcdefgh"[:len(us)]
    out = []
    for i, u in enumerate(us):
        others = [us[j] for j in range(len(us)) if j != i]
        eq = f"...{axes}," + ",".join(f"...{axes[j]}" for j in range(len(us)) if j != i) + f"->...{axes[i]}"
        du = torch.einsum(eq, d, *others)
        if l2norm:
            x = factors[i].float()
            r = torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)
            du = r * (du - u * (u * du).sum(-1, keepdim=True))
        out.append(du.to(factors[i].dtype))
    return out


def launch(config: ResidentConfig, p: Problem, q, k, v, g, beta, *, h0, ht, cu_seqlens, l2norm: bool) -> torch.Tensor:
    """Run ``config`` on checked inputs (``p`` from ``check_inputs``); ``ht``: None, or the fp32
    final-state buffer to store into. Returns o. With ``materialise``, the order-2 kernels run on
    phi(q), phi(k) (the flattened state [.., K, V] is the same memory as [.., d_1, .., V])."""
    if config.materialise:
        p, q, k, h0, ht, l2norm = materialised_call(p, q, k, h0, ht, l2norm)
    bk = max(16, next_pow2(p.key_dim))
    ws = prepare_scores(config, p, q, k, v, g, beta, cu_seqlens=cu_seqlens, l2norm=l2norm, block_k=bk,
                        outer=KernelShape(p.key_widths, p.value_width).outer_phi_ok(bk), wy=config.wy)
    return run_resident(p, q, k, v, g, beta, h0=h0, ht=ht, cu_seqlens=cu_seqlens, l2norm=l2norm,
                        chunk_size=config.chunk_size, block_k=bk, block_v=config.block_v, num_warps=config.num_warps,
                        num_stages=config.num_stages, precision=config.dot_precision, scores="workspace",
                        prefetch=config.prefetch_inputs, ws=ws)
