"""The recurrent scan and the decode step (``recurrent.py`` through ``launch.py``) against the
float64 token loop (``reference.running_tensor_recurrent_ref``), through the Triton
interpreter on the CPU or on a CUDA GPU.

Inputs are fresh random draws on every run; every output and final-state buffer the launchers
allocate starts as NaN, so an element the kernel should write and does not fails the
comparison.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from rtcompile.kernels import recurrent, tuned
from rtcompile.kernels.chunk_resident import ResidentConfig
from rtcompile.kernels.inputs import check_inputs
from rtcompile.kernels.launch import device_name, running_tensor_decode_, running_tensor_fwd
from rtcompile.kernels.decode_plan import DECODE_PLANS
from rtcompile.kernels.recurrent import RecurrentConfig
from rtcompile.kernels.reference import running_tensor_recurrent_ref

from conftest import HALF_TOL, make_inputs, rel_err

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU",
)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
FP32_TOL = 2e-5  # fp32 kernels vs float64: observed 2e-7 - 1e-6 on these shapes


@pytest.fixture(autouse=True)
def poison_outputs(poison):
    """Every output and workspace the launchers allocate starts as NaN (conftest's ``poison``)."""


def _to(xs, dtype=None):
    conv = lambda x: None if x is None else x.to(device=DEVICE, dtype=dtype or x.dtype)
    return [conv(x) for x in xs] if isinstance(xs, list) else conv(xs)


def _case(B, T, H, widths, V, dtype=torch.float32, **kw):
    """Device inputs in ``dtype`` and the reference's float64 copies of exactly those values."""
    q, k, v, g, beta, s0 = make_inputs(B, T, H, widths, V, dtype=torch.float64, **kw)
    low = lambda x: x if x is None else x.to(dtype)
    ql, kl, vl = [low(x) for x in q], [low(x) for x in k], low(v)
    gl, bl = (None if g is None else g.float()), (None if beta is None else beta.to(dtype))
    up = lambda x: None if x is None else x.double()
    ref_in = ([up(x) for x in ql], [up(x) for x in kl], up(vl), up(gl), up(bl))
    dev_in = (_to(ql), _to(kl), _to(vl), _to(gl), _to(bl))
    return dev_in, ref_in, s0


def _scan(dev, ref, s0, *, l2norm=True, cu=None, variant=None, tol=FP32_TOL):
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), output_final_state=True, l2norm=l2norm,
                              cu_seqlens=_to(cu), mode="recurrent", variant=variant)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=l2norm,
                                                cu_seqlens=cu)
    assert o.shape == ref[2].shape and o.dtype == dev[2].dtype
    assert s.shape == s_ref.shape and s.dtype == torch.float32
    assert rel_err(o.cpu(), o_ref) < tol, "output"
    assert rel_err(s.cpu(), s_ref) < tol, "final state"
    return o, s


WIDTHS = {"o2-d5": (5,), "o3-3x4": (3, 4), "o4-2x3x2": (2, 3, 2)}
FEATURES = {
    "plain": dict(gate=False, delta=False, l2norm=False),
    "gate": dict(gate=True, delta=False, l2norm=False),
    "delta-l2": dict(gate=False, delta=True, l2norm=True),
    "gated-delta-l2": dict(gate=True, delta=True, l2norm=True),
}


# 4-row key tiles: the state streamed through the final-state buffer (K >= 5 in these tests)
STREAMED = RecurrentConfig(block_k=4, block_v=4)


@pytest.mark.parametrize("widths", WIDTHS.values(), ids=WIDTHS.keys())
@pytest.mark.parametrize("feat", FEATURES.keys())
@pytest.mark.parametrize("tiles", ["resident", "streamed"])
@pytest.mark.parametrize("h0", [True, False], ids=["h0", "no-h0"])
def test_scan_matches_float64(widths, feat, tiles, h0):
    """T = 7, d_v 6 (not a power of two) in 4-column tiles or the default's one tile."""
    f = FEATURES[feat]
    dev, ref, s0 = _case(2, 7, 2, widths, 6, gate=f["gate"], delta=f["delta"], state=h0)
    variant = None if tiles == "resident" else STREAMED
    assert variant is None or variant.block_k < math.prod(widths)
    _scan(dev, ref, s0, l2norm=f["l2norm"], variant=variant)


@pytest.mark.parametrize("tiles", ["resident", "streamed"])
def test_no_final_state_leaves_the_output_unchanged(tiles):
    """Without output_final_state: no state returned (a streamed state still gets its buffer)."""
    dev, ref, s0 = _case(1, 6, 2, (4, 5), 5, state=True)
    variant = RecurrentConfig(block_k=32, block_v=8) if tiles == "resident" else RecurrentConfig(block_k=8, block_v=4)
    o, _ = _scan(dev, ref, s0, variant=variant)
    o2, s2 = running_tensor_fwd(*dev, initial_state=_to(s0, torch.float32), l2norm=True, mode="recurrent",
                                variant=variant)
    assert s2 is None and torch.equal(o2, o)


OUTER_WIDTHS = {"o2-d8": (8,), "o3-2x4": (2, 4), "o4-2x2x4": (2, 2, 4)}


@pytest.mark.parametrize("widths", OUTER_WIDTHS.values(), ids=OUTER_WIDTHS.keys())
@pytest.mark.parametrize("tiles", ["resident", "streamed"])
def test_outer_phi(widths, tiles):
    """phi from outer products of factor loads (power-of-two widths): the slab held factored,
    or streamed in tiles of exactly the trailing widths' product."""
    K = math.prod(widths)
    bk = K if tiles == "resident" else max(2, math.prod(widths[1:]))
    dev, ref, s0 = _case(2, 5, 2, widths, 6, gate=True, delta=True, state=True)
    _scan(dev, ref, s0, variant=RecurrentConfig(block_k=bk, block_v=4, outer_phi=True))


@pytest.mark.parametrize("hints", [True, False], ids=["hints", "no-hints"])
@pytest.mark.parametrize("outer", [False, True], ids=["gather", "outer"])
def test_stream_hints(hints, outer):
    """Evict-first loads and streaming stores of a resident slab change no value."""
    dev, ref, s0 = _case(2, 4, 2, (2, 4), 6, state=True)
    _scan(dev, ref, s0, variant=RecurrentConfig(block_k=8, block_v=8, outer_phi=outer, stream_hints=hints))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("tiles", ["resident", "streamed"])
def test_half_inputs(dtype, tiles):
    dev, ref, s0 = _case(2, 9, 2, (3, 4), 6, dtype=dtype, state=True)
    _scan(dev, ref, s0, variant=None if tiles == "resident" else STREAMED, tol=HALF_TOL[dtype])


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16], ids=["bf16-h0", "fp16-h0"])
@pytest.mark.parametrize("tiles", ["resident", "streamed"])
def test_half_initial_state(state_dtype, tiles):
    """A 16-bit initial state is read as it is; the final state is fp32."""
    dev, ref, s0 = _case(2, 5, 2, (3, 4), 6, state=True)
    s0 = s0.to(state_dtype).double()  # the reference starts from the rounded state the kernel reads
    o, s = running_tensor_fwd(*dev, initial_state=_to(s0, state_dtype), output_final_state=True, l2norm=True,
                              mode="recurrent", variant=None if tiles == "resident" else STREAMED)
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=True)
    assert s.dtype == torch.float32
    assert rel_err(o.cpu(), o_ref) < FP32_TOL and rel_err(s.cpu(), s_ref) < FP32_TOL


@pytest.mark.parametrize("widths", WIDTHS.values(), ids=WIDTHS.keys())
@pytest.mark.parametrize("tiles", ["resident", "streamed"])
def test_varlen_uneven_lengths(widths, tiles):
    offsets = [0, 5, 6, 15, 19]  # lengths 5, 1, 9, 4
    dev, ref, s0 = _case(1, offsets[-1], 2, widths, 3, state=True, num_seqs=len(offsets) - 1)
    _scan(dev, ref, s0, cu=torch.tensor(offsets, dtype=torch.int32),
          variant=None if tiles == "resident" else STREAMED)


def test_packed_one_token_sequences_with_the_wide_decode_tile():
    """Varlen with one token a sequence (a serving engine's packed decode step) takes the decode
    step's default tile, the doubled [K, 2 BV] from 48 MiB of slabs (``launch.decode_rows``;
    test_configs checks the choice): that tile on such a call against float64, d_v 48 in one
    64-column tile (16 columns masked)."""
    from rtcompile.kernels.forms import decode_tile, default_config
    from rtcompile.kernels.launch import kernel_shape

    n = 3
    dev, ref, s0 = _case(1, n, 2, (16, 16), 48, state=True, num_seqs=n)
    shape = kernel_shape(check_inputs(*dev, None, None, None))
    wide = decode_tile(default_config("recurrent", shape), shape, 1024)
    assert wide.block_v == 2 * default_config("recurrent", shape).block_v == 64
    _scan(dev, ref, s0, cu=torch.arange(n + 1, dtype=torch.int32), variant=wide)


def test_single_token_and_default_config():
    dev, ref, s0 = _case(3, 1, 2, (3, 4), 5, state=True)
    _scan(dev, ref, s0)


# ----- decode --------------------------------------------------------------------------------


@pytest.fixture
def fresh_plans():
    """An empty decode plan cache (plans are keyed by argument signatures other tests share)."""
    saved = dict(DECODE_PLANS)
    DECODE_PLANS.clear()
    yield DECODE_PLANS
    DECODE_PLANS.clear()
    DECODE_PLANS.update(saved)


DECODE_SLOTS = {
    f"{o}-{kind}": (w, var)
    for o, w, kp in (("o2", (5,), 8), ("o3", (3, 4), 16), ("o4", (2, 3, 2), 16))
    for kind, var in (("default", None),  # resident, stream hints on
                      ("resident-nohints", RecurrentConfig(block_k=kp, block_v=4, stream_hints=False)),
                      ("streamed", RecurrentConfig(block_k=4, block_v=4)))
}
# power-of-two widths: the slab held factored ([d_1, ..., d_{o-1}, BV]) or streamed as outer products
DECODE_SLOTS.update({
    f"{o}-outer-{kind}": (w, RecurrentConfig(block_k=bk, block_v=4, outer_phi=True))
    for o, w, K in (("o2", (8,), 8), ("o3", (2, 4), 8), ("o4", (2, 2, 4), 16))
    for kind, bk in (("factored", K), ("streamed", K // 2))
})


def _check_decode(widths, variant, *, feat="gated-delta-l2", dtype=torch.float32, cache_dtype=torch.float32,
                  idx=(4, 0, -1, 2), slots=6, tol=FP32_TOL):
    """One decode step on a slot cache: out-of-order slots, a padding entry (-1, reads and
    writes nothing); untouched slots stay bit-identical."""
    f = FEATURES[feat]
    H, V = 2, 5
    dev, ref, _ = _case(len(idx), 1, H, widths, V, dtype=dtype, gate=f["gate"], delta=f["delta"])
    cache = torch.randn(slots, H, *widths, V, dtype=torch.float32).to(cache_dtype)
    before = cache.clone()
    cache_dev = _to(cache)
    o = running_tensor_decode_(*dev, state_cache=cache_dev, state_indices=_to(torch.tensor(idx, dtype=torch.int32)),
                               l2norm=f["l2norm"], variant=variant)
    assert o.shape == dev[2].shape and o.dtype == dtype
    after = cache_dev.cpu()
    for n, slot in enumerate(idx):
        if slot < 0:
            continue
        one = lambda x: None if x is None else x[n : n + 1]
        o_ref, s_ref = running_tensor_recurrent_ref(
            [one(x) for x in ref[0]], [one(x) for x in ref[1]], one(ref[2]), one(ref[3]), one(ref[4]),
            initial_state=before[slot : slot + 1].double(), output_final_state=True, l2norm=f["l2norm"],
        )
        assert rel_err(o[n : n + 1].cpu(), o_ref) < tol, f"output of sequence {n}"
        assert rel_err(after[slot : slot + 1], s_ref) < tol, f"state of slot {slot}"
    for slot in set(range(slots)) - set(idx):
        assert torch.equal(after[slot], before[slot]), f"slot {slot} was not in state_indices"


@pytest.mark.parametrize("case", DECODE_SLOTS.keys())
def test_decode_in_place_slots(case):
    widths, variant = DECODE_SLOTS[case]
    _check_decode(widths, variant)


@pytest.mark.parametrize("feat", ["plain", "gate", "delta-l2"])
@pytest.mark.parametrize("tiles", ["resident", "streamed"])
def test_decode_optional_inputs(feat, tiles):
    """No gate / no delta rule: those inputs reach the kernel as None."""
    _check_decode((3, 4), None if tiles == "resident" else RecurrentConfig(block_k=4, block_v=4), feat=feat)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16-cache", "fp16-cache"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_half_inputs_and_cache(dtype, cache_dtype):
    """16-bit inputs and a 16-bit cache (the step computes in fp32 and rounds the new state)."""
    tol = HALF_TOL[torch.bfloat16 if torch.bfloat16 in (dtype, cache_dtype) else torch.float16]
    _check_decode((3, 4), None, dtype=dtype, cache_dtype=cache_dtype, tol=tol)


def test_decode_all_padding_touches_nothing():
    _check_decode((3, 4), None, idx=(-1, -1), slots=3)


def test_decode_matches_the_scan():
    dev, ref, s0 = _case(3, 1, 2, (3, 4), 5, state=True)
    s0 = s0.float()
    o_scan, s_scan = running_tensor_fwd(*dev, initial_state=_to(s0), output_final_state=True, l2norm=True,
                                        mode="recurrent")
    cache = _to(s0.clone())
    o = running_tensor_decode_(*dev, state_cache=cache, state_indices=_to(torch.arange(3, dtype=torch.int32)),
                               l2norm=True)
    assert torch.equal(o, o_scan) and torch.equal(cache, s_scan)


@pytest.mark.parametrize("feat", ["gated-delta-l2", "plain"])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "v-unaligned"])
def test_decode_steps_reuse_the_plan(offset, feat, fresh_plans, monkeypatch):
    """Three steps with the same shapes (the second and third reuse the first's launch plan, on
    a GPU its compiled launcher, with None in the absent inputs' places) equal the float64
    token loop over the three tokens; a v whose data pointer is not 16-byte aligned takes
    Triton's full path and is still right. Only the first step builds a signature key (the
    later ones are recognised by the metadata check, where torch has it)."""
    from rtcompile.kernels import decode_plan, launch

    keys = []
    real_key = launch.signature_key
    monkeypatch.setattr(launch, "signature_key", lambda *a, **kw: keys.append(1) or real_key(*a, **kw))
    f = FEATURES[feat]
    N, H, widths, V = 3, 2, (3, 4), 5
    dev, ref, s0 = _case(N, 3, H, widths, V, gate=f["gate"], delta=f["delta"], state=True)
    idx = _to(torch.tensor([2, 0, 1], dtype=torch.int32))
    cache = _to(torch.empty(N, H, *widths, V))
    cache[idx.long()] = _to(s0.float())  # sequence n's state in slot idx[n]
    o_ref, s_ref = running_tensor_recurrent_ref(*ref, initial_state=s0, output_final_state=True, l2norm=f["l2norm"])
    for t in range(3):
        one = lambda x, t=t: None if x is None else x[:, t : t + 1].contiguous()
        q, k = [one(x) for x in dev[0]], [one(x) for x in dev[1]]
        v = one(dev[2])
        if offset:  # the same values at an address 4 bytes past a 16-byte boundary
            buf = torch.empty(v.numel() + offset, dtype=v.dtype, device=v.device)
            buf[offset:] = v.flatten()
            v = buf[offset:].view(v.shape)
        o = running_tensor_decode_(q, k, v, one(dev[3]), one(dev[4]), state_cache=cache, state_indices=idx,
                                   l2norm=f["l2norm"])
        assert rel_err(o.cpu(), o_ref[:, t : t + 1]) < FP32_TOL, f"step {t}"
    assert rel_err(cache[idx.long()].cpu(), s_ref) < FP32_TOL
    assert len(fresh_plans) == 1  # one signature, one plan
    assert len(keys) == (1 if decode_plan._TensorGuards is not None else 3)
    if DEVICE == "cuda" and not offset:  # the later steps took the compiled launcher
        assert all(plan._runner is not None for plan in fresh_plans.values())


def _tuned_entry(config: RecurrentConfig, widths, V, H, dtype, batch) -> dict:
    fields = tuned.match_fields("recurrent", widths, V, H, str(dtype).removeprefix("torch."),
                                device_name(torch.device(DEVICE)))
    return {**fields, "batch": batch, "seq_len": 1, "variant": config.to_dict()}


def test_decode_consults_the_tuned_table_once_per_plan(tmp_path, monkeypatch, fresh_plans):
    """variant=None: the tuned table's entry for the shape bucket serves (looked up on a plan
    miss only); an entry this shape cannot run falls back to the default."""
    widths, H, V, N = (3, 4), 2, 5, 2
    picked = RecurrentConfig(block_k=4, block_v=2, num_warps=2)
    table = tuned.table_path()
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"format": tuned.FORMAT_VERSION,
                                "entries": [_tuned_entry(picked, widths, V, H, torch.float32, N)]}))
    monkeypatch.setenv("RTCOMPILE_TUNED", str(path))
    tuned.reload()
    calls = []
    real = tuned.lookup
    monkeypatch.setattr(tuned, "lookup", lambda *a: calls.append(a[0]) or real(*a))
    try:
        for _ in range(2):
            _check_decode(widths, None, idx=(1, 0), slots=2)
        assert calls == ["recurrent"]  # the second step found the plan
        (plan,) = fresh_plans.values()
        assert (plan.consts["BK"], plan.consts["BV"], plan.consts["num_warps"]) == (4, 2, 2)
        # an entry that cannot run here (block_k over K rounded up) is advice, not a contract
        bad = RecurrentConfig(block_k=64, block_v=2)
        path.write_text(json.dumps({"format": tuned.FORMAT_VERSION,
                                    "entries": [_tuned_entry(bad, widths, V, H, torch.float32, N)]}))
        tuned.reload()
        fresh_plans.clear()
        _check_decode(widths, None, idx=(1, 0), slots=2)
        (plan,) = fresh_plans.values()
        assert plan.consts["BK"] == 16
    finally:
        tuned.reload(table)  # the session's (empty) table again


# ----- errors --------------------------------------------------------------------------------


def _decode_args(N=2, widths=(3, 4), H=2, V=4, T=1):
    q, k, v, g, beta, _ = make_inputs(N, T, H, widths, V, dtype=torch.float32)
    dev = lambda x: x.to(DEVICE)
    cache = torch.zeros(4, H, *widths, V, device=DEVICE)
    idx = torch.arange(N, dtype=torch.int32, device=DEVICE)
    return [dev(x) for x in q], [dev(x) for x in k], dev(v), dev(g), dev(beta), cache, idx


@pytest.mark.parametrize("idx, needle", [
    ([0, 4], r"state_indices: 4 out of range; allowed: 0 <= index < slots = 4"),
    ([1, 1], r"state_indices: repeated slot"),
    ([3, 3], r"state_indices: repeated slot"),
], ids=["out-of-range", "repeated", "repeated-last"])
def test_decode_refuses_bad_indices(idx, needle):
    q, k, v, g, beta, cache, _ = _decode_args()
    before = cache.clone()
    with pytest.raises(ValueError, match=needle):
        running_tensor_decode_(q, k, v, g, beta, state_cache=cache,
                               state_indices=torch.tensor(idx, dtype=torch.int32, device=DEVICE))
    assert torch.equal(cache, before)  # refused before the launch


def _change(name):
    """The decode arguments with one of them made wrong."""
    q, k, v, g, beta, cache, idx = _decode_args()
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, state_cache=cache, state_indices=idx)
    if name == "cache-shape":
        kw["state_cache"] = torch.zeros(4, 2, 4, 3, 4, device=DEVICE)
    elif name == "cache-rank":
        kw["state_cache"] = torch.zeros(4, 2, 12, 4, device=DEVICE)
    elif name == "cache-dtype":
        kw["state_cache"] = cache.double()
    elif name == "cache-strided":
        kw["state_cache"] = torch.zeros(4, 2, 3, 4, 8, device=DEVICE)[..., ::2]
    elif name == "cache-type":
        kw["state_cache"] = cache.tolist()
    elif name == "indices-dtype":
        kw["state_indices"] = idx.to(torch.int16)  # int32 and int64 are both taken
    elif name == "indices-shape":
        kw["state_indices"] = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    elif name == "indices-type":
        kw["state_indices"] = [0, 1]
    elif name == "two-tokens":
        kw.update(zip(("q", "k", "v", "g", "beta"), _decode_args(T=2)[:5]))
    elif name == "l2norm-str":
        kw["l2norm"] = "yes"
    elif name == "validate-int":
        kw["validate"] = 1
    elif name == "wrong-config-class":
        kw["variant"] = ResidentConfig(chunk_size=16, block_v=16)
    elif name == "config-cannot-run":
        kw["variant"] = RecurrentConfig(block_k=64, block_v=4)
    return kw


@pytest.mark.parametrize("name, exc, needle", [
    ("cache-shape", ValueError, r"state_cache: expected shape \[slots, 2, 3, 4, 4\], got \[4, 2, 4, 3, 4\]"),
    ("cache-rank", ValueError, r"state_cache: expected shape \[slots, 2, 3, 4, 4\]"),
    ("cache-dtype", ValueError, r"state_cache: dtype torch.float64; allowed: float32, bfloat16, float16"),
    ("cache-strided", ValueError, r"state_cache: strides .* not contiguous"),
    ("cache-type", TypeError, r"state_cache: expected a torch.Tensor, got list"),
    ("indices-dtype", TypeError, r"state_indices: dtype torch.int16; allowed: torch.int32, torch.int64"),
    ("indices-shape", ValueError, r"state_indices: expected shape \[2\]"),
    ("indices-type", TypeError, r"state_indices: expected a torch.Tensor, got list"),
    ("two-tokens", ValueError, r"v: T = 2; allowed: T = 1"),
    ("l2norm-str", TypeError, r"l2norm: expected a bool, got str"),
    ("validate-int", TypeError, r"validate: expected a bool, got int"),
    ("wrong-config-class", TypeError, r"variant: expected one of RecurrentConfig, got ResidentConfig"),
    ("config-cannot-run", ValueError, r"block_k=64; allowed: at most K rounded up \(16\)"),
])
def test_decode_refusals_name_the_field(name, exc, needle):
    kw = _change(name)
    with pytest.raises(exc, match=needle):
        running_tensor_decode_(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("g"), kw.pop("beta"), **kw)


@pytest.mark.parametrize("variant, exc, needle", [
    (RecurrentConfig(block_k=64, block_v=4), ValueError, r"block_k=64; allowed: at most K rounded up \(16\)"),
    (RecurrentConfig(block_k=16, block_v=16), ValueError, r"block_v=16; allowed: at most d_v rounded up \(8\)"),
    (RecurrentConfig(block_k=12, block_v=4), ValueError, r"block_k=12; allowed: a power of two"),
    (RecurrentConfig(block_k=16, block_v=4, outer_phi=True), ValueError, r"outer_phi=True needs power-of-two"),
    (ResidentConfig(chunk_size=16, block_v=16), TypeError, r"variant: expected one of RecurrentConfig"),
], ids=["block-k", "block-v", "block-k-pow2", "outer-phi", "chunk-config"])
def test_scan_refusals_name_the_field(variant, exc, needle):
    dev, _, _ = _case(1, 3, 1, (3, 4), 5)
    with pytest.raises(exc, match=needle):
        running_tensor_fwd(*dev, mode="recurrent", variant=variant)


def test_streamed_launch_needs_the_state_buffer():
    """The launcher's own contract: a streamed state runs through ``ht``."""
    dev, _, _ = _case(1, 3, 1, (3, 4), 5)
    p = check_inputs(*dev, None, None, None)
    with pytest.raises(ValueError, match=r"ht: None, but block_k=4 < K = 12"):
        recurrent.launch(RecurrentConfig(block_k=4, block_v=4), p, *dev, h0=None, ht=None, cu_seqlens=None,
                         l2norm=False)
