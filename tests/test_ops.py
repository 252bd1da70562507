"""torch integration: custom ops pass opcheck, compile with fullgraph, and export."""

from __future__ import annotations

import os

import pytest
import torch

import rtcompile
from rtcompile.kernels.chunk_fused import FusedConfig
from rtcompile.kernels.chunk_resident import ResidentConfig
from rtcompile.kernels.chunk_split import SplitConfig
from rtcompile.kernels.chunk_streamed import StreamedConfig
from rtcompile.kernels.ops import running_tensor_decode_op, running_tensor_fwd_op, variant_from_json, variant_to_json
from rtcompile.kernels.recurrent import RecurrentConfig

from conftest import make_inputs

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU",
)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
CHUNK16 = ResidentConfig(chunk_size=16, block_v=16)  # K = 12: one 16-row tile
RECURRENT = RecurrentConfig(block_k=8, block_v=4, num_warps=2)  # K = 12 streamed in two tiles


def _inputs(B=1, T=9, H=2, widths=(3, 4), V=4):
    q, k, v, g, beta, s0 = make_inputs(B, T, H, widths, V, state=True, dtype=torch.float32)
    dev = lambda x: x.to(DEVICE)
    return [dev(x) for x in q], [dev(x) for x in k], dev(v), dev(g), dev(beta), dev(s0.float())


def test_variant_json_round_trip():
    every_form = (CHUNK16, StreamedConfig(chunk_size=32, block_k=64, block_v=16, solve="rows", prefetch_state=True),
                  FusedConfig(chunk_size=16, block_k=64, block_v=16, merge_passes=True),
                  SplitConfig(chunk_size=64, block_v=32, tma=True, dot_precision="tf32", state_stride=2), RECURRENT)
    for v in every_form:
        assert variant_from_json(variant_to_json(v)) == v
    assert variant_from_json("") is None


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_opcheck_fwd(mode):
    q, k, v, g, beta, s0 = _inputs()
    var = variant_to_json(CHUNK16 if mode == "chunk" else None)
    torch.library.opcheck(
        running_tensor_fwd_op, (q, k, v, g, beta, s0, None, 0.3, True, True, mode, 0, var),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


def test_opcheck_decode():
    q, k, v, g, beta, _ = _inputs(B=2, T=1)
    cache = torch.randn(3, 2, 3, 4, 4, device=DEVICE)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(
        running_tensor_decode_op, (q, k, v, g, beta, cache, idx, 0.3, True, ""),
        test_utils=("test_schema", "test_faketensor"),
    )


class _Mixer(torch.nn.Module):
    def __init__(self, mode, variant):
        super().__init__()
        self.mode, self.variant = mode, variant

    def forward(self, q1, q2, k1, k2, v, g, beta, s0):
        o, s = rtcompile.running_tensor([q1, q2], [k1, k2], v, g, beta, initial_state=s0, output_final_state=True,
                                        l2norm=True, mode=self.mode, backend="triton", variant=self.variant)
        return o * 2.0, s


@pytest.mark.parametrize("mode, variant", [("chunk", CHUNK16), ("recurrent", RECURRENT)], ids=["chunk", "recurrent"])
def test_compile_fullgraph_and_export(monkeypatch, mode, variant):
    q, k, v, g, beta, s0 = _inputs()
    args = (*q, *k, v, g, beta, s0)
    m = _Mixer(mode, variant)
    from rtcompile.kernels import ops

    calls = []
    real = ops.running_tensor_fwd_op
    monkeypatch.setattr(ops, "running_tensor_fwd_op", lambda *a: calls.append(1) or real(*a))
    eager = m(*args)
    assert not calls, "an eager call went through the custom op's dispatch"
    monkeypatch.setattr(ops, "running_tensor_fwd_op", real)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])
    ep = torch.export.export(m, args)
    assert "rtcompile.running_tensor_fwd" in str(ep.graph)
    out = ep.module()(*args)
    assert torch.equal(out[0], eager[0])


@pytest.mark.parametrize("variant", [None, RECURRENT], ids=["default", "config"])
def test_decode_compiles_fullgraph(variant):
    q, k, v, g, beta, _ = _inputs(B=2, T=1)
    cache = torch.randn(3, 2, 3, 4, 4, device=DEVICE)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)

    def step(cache):
        return rtcompile.running_tensor_decode_(q, k, v, g, beta, state_cache=cache, state_indices=idx, l2norm=True,
                                                variant=variant)

    c_eager, c_comp = cache.clone(), cache.clone()
    o_eager = step(c_eager)
    o_comp = torch.compile(step, fullgraph=True, backend="aot_eager")(c_comp)
    assert torch.equal(o_eager, o_comp) and torch.equal(c_eager, c_comp)
