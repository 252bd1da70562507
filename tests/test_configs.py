"""The kernel configs (a tagged union, ``forms.py``): checks that explain, spaces that hold only
allowed values, the dict round trip, the defaults table and the cost figures."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from rtcompile.kernels.chunk_backward import BackwardConfig
from rtcompile.kernels.chunk_fused import FusedConfig
from rtcompile.kernels.chunk_resident import ResidentConfig
from rtcompile.kernels.chunk_split import SplitConfig
from rtcompile.kernels.chunk_streamed import StreamedConfig
from rtcompile.kernels.config import DEFAULT_SMEM_BYTES, KernelShape, Workload
from rtcompile.kernels.forms import (
    CHUNK_DEFAULTS, FORMS, KERNELS, RECURRENT_DEFAULTS, candidates, check_config, config_from_dict, decode_tile,
    default_config, iter_space, low_memory, two_kernel,
)
from rtcompile.kernels.recurrent import RecurrentConfig

H200_SMEM = 232448  # shared memory per block (opt-in) of the H200
CLASSES = [ResidentConfig, StreamedConfig, FusedConfig, SplitConfig, RecurrentConfig, BackwardConfig]
SHAPES = {
    "o2-64": KernelShape((64,), 64),
    "o2-128": KernelShape((128,), 64),
    "o3-16x16": KernelShape((16, 16), 64),
    "o3-32x32": KernelShape((32, 32), 64),
    "o3-64x64": KernelShape((64, 64), 64),
    "o4-16x16x16": KernelShape((16, 16, 16), 64),
    "o3-8x8-fp32": KernelShape((8, 8), 32, 4),
    "o3-2x4": KernelShape((2, 4), 16),
    "o3-3x5-v6": KernelShape((3, 5), 6),
    "o2-4": KernelShape((4,), 8),
}
LIMITS = {"portable-smem": DEFAULT_SMEM_BYTES, "h200-smem": H200_SMEM}


def _example(cls) -> object:
    """A config of ``cls`` with its required fields filled."""
    return {ResidentConfig: ResidentConfig(chunk_size=32, block_v=16),
            StreamedConfig: StreamedConfig(chunk_size=32, block_k=64, block_v=16),
            FusedConfig: FusedConfig(chunk_size=16, block_k=64, block_v=16),
            SplitConfig: SplitConfig(chunk_size=32, block_v=16),
            RecurrentConfig: RecurrentConfig(block_k=64, block_v=16),
            BackwardConfig: BackwardConfig(chunk_size=32, block_v=16)}[cls]


# ----- refusals --------------------------------------------------------------------------------

O3 = KernelShape((16, 16), 64)
BIG = KernelShape((64, 64), 64)
REFUSALS = {
    # every chunk form shares chunk_refusal's rules
    "resident-chunk-48": (ResidentConfig(chunk_size=48, block_v=16), O3, "chunk_size=48; allowed: a power of two"),
    "resident-chunk-256": (ResidentConfig(chunk_size=256, block_v=16), O3, "chunk_size=256; allowed: 16, 32, 64, 128"),
    "resident-block-v-8": (ResidentConfig(chunk_size=16, block_v=8), O3, "block_v=8; allowed: 16 .. 64"),
    "resident-stages-5": (ResidentConfig(chunk_size=16, block_v=16, num_stages=5), O3,
                          "num_stages=5; allowed: 1, 2, 3 or 4"),
    "resident-solve": (ResidentConfig(chunk_size=16, block_v=16, solve="lu"), O3,
                       "solve='lu'; allowed: 'rows', 'tiles', 'products'"),
    "resident-products-c128": (ResidentConfig(chunk_size=128, block_v=16, solve="products"),
                               KernelShape((4, 4), 16), "solve='products' needs chunk_size <= 64, got 128"),
    "streamed-tiles-per-program": (StreamedConfig(chunk_size=16, block_k=16, block_v=16, tiles_per_program=32),
                                   KernelShape((4, 8), 16), "tiles_per_program=32; allowed: 1, 2, 4, 8 or 16"),
    "split-unroll-products": (SplitConfig(chunk_size=32, block_v=16, solve="products", unroll_solve=True),
                              KernelShape((16,), 16), "unroll_solve=True unrolls the tile solve; allowed with solve='tiles'"),
    "resident-precision": (ResidentConfig(chunk_size=16, block_v=16, dot_precision="fp8"), O3,
                           "dot_precision='fp8'; allowed: 'ieee', 'tf32x3', 'tf32'"),
    "resident-prepare-warps": (ResidentConfig(chunk_size=16, block_v=16, prepare_warps=3), O3,
                               "prepare_warps=3; allowed: 1, 2, 4, 8, 16"),
    "resident-prefetch-widths": (ResidentConfig(chunk_size=16, block_v=16, prefetch_inputs=True),
                                 KernelShape((3, 5), 16), "prefetch_inputs=True needs power-of-two key widths >= 16"),
    "resident-too-wide": (ResidentConfig(chunk_size=64, block_v=64, num_warps=2), BIG,
                          "registers per thread estimated"),
    "streamed-block-k-covers": (StreamedConfig(chunk_size=16, block_k=256, block_v=16), O3,
                                "block_k=256; allowed: 16 <= block_k < K = 256"),
    "streamed-block-k-pow2": (StreamedConfig(chunk_size=16, block_k=48, block_v=16), O3,
                              "block_k=48; allowed: a power of two"),
    "streamed-smem": (StreamedConfig(chunk_size=64, block_k=128, block_v=32, num_warps=8, num_stages=3), BIG,
                      "bytes of shared memory"),
    "fused-block-k-over": (FusedConfig(chunk_size=16, block_k=512, block_v=16), O3, "block_k=512; allowed: 16 .. 256"),
    "fused-prefetch-resident": (FusedConfig(chunk_size=16, block_k=256, block_v=16, prefetch_state=True), O3,
                                "prefetch_state / merge_passes need a streamed state"),
    "fused-merge-resident": (FusedConfig(chunk_size=16, block_k=256, block_v=16, merge_passes=True), O3,
                             "prefetch_state / merge_passes need a streamed state"),
    "resident-materialise-order2": (ResidentConfig(chunk_size=16, block_v=16, materialise=True), KernelShape((16,), 16),
                                    "materialise=True needs order >= 3"),
    "resident-materialise-k512": (ResidentConfig(chunk_size=16, block_v=16, materialise=True),
                                  KernelShape((32, 16), 16), "materialise=True forms [T, K] keys up to K = 256"),
    "resident-prefetch-narrow": (ResidentConfig(chunk_size=16, block_v=16, prefetch_inputs=True), KernelShape((8, 8), 16),
                                 "prefetch_inputs=True needs power-of-two key widths >= 16"),
    "split-widths": (SplitConfig(chunk_size=16, block_v=16), KernelShape((3, 5), 16),
                     "the split form needs power-of-two key widths >= 16"),
    "split-one-stage": (SplitConfig(chunk_size=16, block_v=16, num_stages=1), O3, "num_stages=1; allowed: 2, 3 or 4"),
    "split-output-warps": (SplitConfig(chunk_size=16, block_v=16, output_warps=3), O3,
                           "output_warps=3; allowed: 2, 4, 8"),
    "split-state-stride": (SplitConfig(chunk_size=16, block_v=16, state_stride=3), O3,
                           "state_stride=3; allowed: 1, 2, 4"),
    "split-key-group": (SplitConfig(chunk_size=16, block_v=16, key_group=8), O3, "key_group=8; allowed: 1, 2, 4"),
    "split-key-group-order2": (SplitConfig(chunk_size=16, block_v=16, key_group=2), KernelShape((16,), 64),
                               "key_group=2 needs order >= 3"),
    "split-output-block-v": (SplitConfig(chunk_size=16, block_v=16, output_block_v=64), KernelShape((16, 16), 8),
                             "output_block_v=64; allowed: 16"),
    "split-tma-rows": (SplitConfig(chunk_size=16, block_v=16, tma=True), KernelShape((16, 16), 6, 4),
                       "tma=True needs rows of 16-byte multiples"),
    # the loop on the factors: order 3 only, K <= 1024, and it reads no stored phi(K)
    "split-kron-order2": (SplitConfig(chunk_size=16, block_v=16, loop="kron"), KernelShape((16,), 64),
                          "loop='kron' needs order 3 with power-of-two key widths >= 16"),
    "split-kron-order4": (SplitConfig(chunk_size=16, block_v=16, num_warps=16, loop="kron"),
                          KernelShape((16, 16, 16), 64), "loop='kron' needs order 3"),
    "split-kron-k4096": (SplitConfig(chunk_size=16, block_v=16, num_warps=16, loop="kron"), KernelShape((64, 64), 64),
                         "K <= 1024, got 4096"),
    "split-kron-tma": (SplitConfig(chunk_size=16, block_v=16, loop="kron", tma=True), O3,
                       "allowed: materialise=False, wy=False, tma=False"),
    # materialised keys are one axis: the refusal names materialise, not the (order-3) widths
    "split-kron-materialise": (SplitConfig(chunk_size=16, block_v=16, loop="kron", materialise=True),
                               KernelShape((16, 16), 64, 2), "allowed: materialise=False, wy=False, tma=False"),
    "split-kron-wy": (SplitConfig(chunk_size=16, block_v=16, loop="kron", wy=True), O3,
                      "allowed: materialise=False, wy=False, tma=False"),
    "split-phi-pass-wy": (SplitConfig(chunk_size=16, block_v=16, phi_pass=True, wy=True), O3,
                          "phi_pass=True is the Triton loop's"),
    "split-phi-pass-kron": (SplitConfig(chunk_size=16, block_v=16, phi_pass=True, loop="kron"), O3,
                            "allowed: loop='triton', wy=False, materialise=False, or phi_pass=False"),
    "recurrent-block-k-pow2": (RecurrentConfig(block_k=24, block_v=16), O3, "block_k=24; allowed: a power of two"),
    "recurrent-block-k-over": (RecurrentConfig(block_k=8192, block_v=16), O3,
                               "block_k=8192; allowed: at most K rounded up (256)"),
    "recurrent-block-v-over": (RecurrentConfig(block_k=64, block_v=128), O3,
                               "block_v=128; allowed: at most d_v rounded up (64)"),
    "recurrent-outer-widths": (RecurrentConfig(block_k=16, block_v=8, outer_phi=True), KernelShape((3, 4), 8, 4),
                               "outer_phi=True needs power-of-two key widths"),
    "recurrent-outer-tile": (RecurrentConfig(block_k=4, block_v=8, outer_phi=True), KernelShape((4, 8), 8, 4),
                             "block_k a multiple of the trailing widths' product"),
    "recurrent-hints-streamed": (RecurrentConfig(block_k=16, block_v=8, stream_hints=True), KernelShape((4, 8), 8, 4),
                                 "stream_hints=True needs the state slab resident (block_k >= 32)"),
    "recurrent-registers": (RecurrentConfig(block_k=4096, block_v=64, num_warps=1), BIG, "registers per thread"),
    # 64 warps passed the checks, then failed to launch on the H100 (2048 threads > 1024)
    "recurrent-warps-64": (RecurrentConfig(block_k=64, block_v=16, num_warps=64), O3,
                           "num_warps=64; allowed: a power of two up to 32"),
    "resident-warps-64": (ResidentConfig(chunk_size=16, block_v=16, num_warps=64), KernelShape((4, 4), 16),
                          "num_warps=64; allowed: a power of two up to 32"),
    "split-warps-128": (SplitConfig(chunk_size=16, block_v=16, num_warps=128), O3,
                        "num_warps=128; allowed: a power of two up to 32"),
}


@pytest.mark.parametrize("case", REFUSALS.keys())
def test_refusals_name_the_field_and_what_it_needs(case):
    config, shape, needle = REFUSALS[case]
    reason = config.check(shape, H200_SMEM)
    assert reason is not None and needle in reason, reason


def test_refused_cases_run_once_the_field_is_fixed():
    """The refusal is the named field's: the same config with that field at an allowed value passes."""
    fixed = [(REFUSALS["recurrent-outer-tile"][0], {"block_k": 8}, KernelShape((4, 8), 8, 4)),
             (REFUSALS["recurrent-hints-streamed"][0], {"block_k": 32}, KernelShape((4, 8), 8, 4)),
             (REFUSALS["fused-prefetch-resident"][0], {"block_k": 128}, O3),
             (REFUSALS["split-one-stage"][0], {"num_stages": 2}, O3),
             (REFUSALS["split-kron-tma"][0], {"tma": False}, O3),
             (REFUSALS["split-phi-pass-wy"][0], {"wy": False}, O3),
             # K 1024: the Triton loop's split spills there (the estimate refuses it), this one runs
             (SplitConfig(chunk_size=16, block_v=16, num_warps=8), {"loop": "kron"}, KernelShape((32, 32), 64)),
             (REFUSALS["resident-products-c128"][0], {"solve": "tiles"}, KernelShape((4, 4), 16)),
             (REFUSALS["streamed-block-k-covers"][0], {"block_k": 128}, O3),
             # materialised 8x8 keys are one 64-wide factor: its tiles can be prefetched
             (REFUSALS["resident-prefetch-narrow"][0], {"materialise": True}, KernelShape((8, 8), 16))]
    for config, change, shape in fixed:
        assert dataclasses.replace(config, **change).check(shape, H200_SMEM) is None, (config, change)


# ----- spaces ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.form)
def test_space_values_are_allowed_values(cls, shape):
    """Every value a space lists is one its field accepts (no refusal of the form
    ``name=value; allowed: ...``), and the space covers every field of the config."""
    space = cls.space(shape)
    if not space:
        return  # the form cannot run this shape at all
    assert set(space) == {f.name for f in dataclasses.fields(cls)}
    base = {name: values[0] for name, values in space.items()}
    for name, values in space.items():
        assert values and len(set(values)) == len(values), name
        for value in values:
            reason = cls(**{**base, name: value}).check(shape, 1 << 30) or ""
            assert not reason.startswith(f"{name}={value!r}; allowed"), reason


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.form)
def test_iter_space_yields_only_valid_configs(cls, shape):
    # the first few hundred: whole spaces are up to millions of combinations
    space = cls.space(shape)
    found = list(itertools.islice(iter_space(cls, shape), 300))
    assert all(isinstance(c, cls) and c.check(shape) is None for c in found)
    assert all(getattr(c, name) in values for c in found for name, values in space.items())
    assert len(set(found)) == len(found)


def test_iter_space_is_the_checked_product():
    """On a small space iter_space yields exactly the product's configs that pass their check."""
    shape = SHAPES["o3-2x4"]
    space = {"block_k": [4, 8, 16], "block_v": [4, 16], "num_warps": [1], "num_stages": [1],
             "outer_phi": [False, True], "stream_hints": [False, True]}
    got = list(iter_space(RecurrentConfig, shape, space))
    brute = [RecurrentConfig(*vals) for vals in itertools.product(*space.values())]
    assert got == [c for c in brute if c.check(shape) is None]
    assert 0 < len(got) < len(brute)  # some refused (block_k 16 > K = 8, hints on a streamed slab)


# ----- to_dict / from_dict ---------------------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.form)
def test_dict_round_trip(cls):
    config = _example(cls)
    d = config.to_dict()
    assert d["form"] == cls.form and FORMS[cls.form] is cls
    assert cls.from_dict(d) == config and config_from_dict(d) == config
    assert config_from_dict(d, cls.kernel) == config
    # every space value survives the trip too
    for c in itertools.islice(iter_space(cls, SHAPES["o3-16x16"]), 50):
        assert config_from_dict(c.to_dict()) == c


def test_old_variant_format_is_refused_by_name():
    old = {"kernel": "chunk", "chunk_size": 16, "block_k": 16, "block_v": 16, "prefetch": True}
    with pytest.raises(ValueError, match=r"rtcompile 0\.1's variant format \(a 'kernel' key"):
        config_from_dict(old)
    with pytest.raises(ValueError, match=r"0\.1's variant format"):
        config_from_dict({"kernel": "recurrent", "block_k": 16, "block_v": 4})


@pytest.mark.parametrize("data, exc, needle", [
    ({"form": "blocked", "chunk_size": 16}, ValueError,
     "config: form 'blocked'; allowed: resident, streamed, fused, split, recurrent, backward"),
    ({"chunk_size": 16, "block_v": 16}, ValueError, "config: no 'form'"),
    ({"form": "resident", "chunk_size": 16, "block_v": 16, "block_z": 4}, ValueError,
     "ResidentConfig: unknown fields ['block_z']; allowed: ["),
    ({"form": "resident", "chunk_size": 16, "block_v": 16, "kron": True}, ValueError, "unknown fields ['kron']"),
    ({"form": "split", "chunk_size": 16, "block_v": 16, "segments": 2}, ValueError, "unknown fields ['segments']"),
    ({"form": "streamed", "chunk_size": 16, "block_v": 16}, ValueError, "StreamedConfig: missing fields ['block_k']"),
    ("resident", TypeError, "config: expected a dict, got str"),
    ({"form": "split", "chunk_size": 16, "block_v": 16, "wy": "yes"}, TypeError,
     "SplitConfig.wy: expected bool, got str 'yes'"),
    ({"form": "split", "chunk_size": 16.0, "block_v": 16}, TypeError, "SplitConfig.chunk_size: expected int, got float"),
    ({"form": "resident", "chunk_size": 16, "block_v": True}, TypeError, "ResidentConfig.block_v: expected int, got bool"),
    ({"form": "resident", "chunk_size": 16, "block_v": 16, "solve": 1}, TypeError,
     "ResidentConfig.solve: expected str, got int"),
    # an unhashable form was a bare "unhashable type: 'list'" from the registry lookup
    ({"form": ["resident"], "chunk_size": 16, "block_v": 16}, ValueError, "config: form ['resident']; allowed: "),
    # an optional int field was not type-checked: 16.0 passed check() and failed in the kernel
    ({"form": "backward", "chunk_size": 16, "block_v": 16, "grads_block_v": 16.0}, TypeError,
     "BackwardConfig.grads_block_v: expected int | None, got float 16.0"),
])
def test_from_dict_errors(data, exc, needle):
    with pytest.raises(exc) as info:
        config_from_dict(data)
    assert needle in str(info.value)


@pytest.mark.parametrize("form, field, value", [
    ("resident", "wy", "no"), ("split", "wy", 1), ("recurrent", "stream_hints", "x"), ("recurrent", "outer_phi", 2),
    ("resident", "chunk_size", "16"), ("streamed", "block_k", 32.0), ("fused", "solve", None),
], ids=lambda x: str(x))
def test_a_config_built_with_a_field_of_the_wrong_type_is_refused(form, field, value):
    """The constructor checks the field types as ``from_dict`` does: ``wy="no"`` was a truthy
    flag that ran."""
    cls = FORMS[form]
    good = _example(cls).to_dict()
    good.pop("form")
    with pytest.raises(TypeError, match=rf"^{cls.__name__}\.{field}: expected "):
        cls(**{**good, field: value})


@pytest.mark.parametrize("d_v", [1, 2, 3])
def test_recurrent_space_holds_the_default_tile_at_tiny_value_widths(d_v):
    """At d_v <= 2 the space had no block_v at all (Optuna: "'choices' must contain one or
    more elements"), though the default's tile (d_v rounded up) runs."""
    shape = KernelShape((8,), d_v, 4)
    space = RecurrentConfig.space(shape)
    default = default_config("recurrent", shape)
    assert default.block_v in space["block_v"] and default.check(shape) is None
    assert next(iter_space(RecurrentConfig, shape), None) is not None


def test_from_dict_refuses_another_kernel_or_form():
    with pytest.raises(ValueError, match="form 'recurrent' is a recurrent config; allowed for the chunk kernel: "
                                         "resident, streamed, fused, split"):
        config_from_dict(_example(RecurrentConfig).to_dict(), "chunk")
    with pytest.raises(ValueError, match=r"form: 'split' is not ResidentConfig's \('resident'\)"):
        ResidentConfig.from_dict(_example(SplitConfig).to_dict())
    with pytest.raises(TypeError, match="variant: expected one of RecurrentConfig, got ResidentConfig"):
        check_config(_example(ResidentConfig), "recurrent")
    with pytest.raises(TypeError, match="variant: expected one of ResidentConfig, StreamedConfig, FusedConfig, "
                                        "SplitConfig, got dict"):
        check_config({"form": "resident"}, "chunk")


# ----- the defaults table ----------------------------------------------------------------------


@pytest.mark.parametrize("kernel, table", [("chunk", CHUNK_DEFAULTS), ("recurrent", RECURRENT_DEFAULTS)])
def test_every_row_proposes_configs_of_its_kernel(kernel, table):
    for row in table:
        assert row.reason.strip()
        for shape in SHAPES.values():
            if row.when(shape):
                proposals = row.propose(shape)
                assert proposals and all(isinstance(c, KERNELS[kernel]) for c in proposals), row.reason


@pytest.mark.parametrize("limit", LIMITS.values(), ids=LIMITS.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_default_passes_its_own_check_and_leads_the_candidates(kernel, shape, limit):
    default = default_config(kernel, shape, limit)
    assert isinstance(default, KERNELS[kernel]) and default.check(shape, limit) is None
    found = candidates(kernel, shape, limit)
    assert found[0] == default
    assert len(set(found)) == len(found), "repeated candidates"
    assert all(c.check(shape, limit) is None for c in found)


@pytest.mark.parametrize("limit", LIMITS.values(), ids=LIMITS.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_low_memory_is_fused_and_its_workspace_does_not_grow_with_T(shape, limit):
    fused = low_memory(shape, limit)
    assert isinstance(fused, FusedConfig) and fused.check(shape, limit) is None
    w = lambda T: Workload(shape, batch=8, heads=8, seq_len=T)
    assert fused.workspace_bytes(w(1024)) == fused.workspace_bytes(w(4096))
    assert default_config("chunk", shape, limit).workspace_bytes(w(4096)) >= fused.workspace_bytes(w(4096))


@pytest.mark.parametrize("limit", LIMITS.values(), ids=LIMITS.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_two_kernel_only_beside_a_split_default(shape, limit):
    other = two_kernel(shape, limit)
    if not isinstance(default_config("chunk", shape, limit), SplitConfig):
        assert other is None
    else:
        assert other is not None and not isinstance(other, SplitConfig) and other.check(shape, limit) is None
        w = Workload(shape, batch=8, heads=8, seq_len=4096)
        if shape.key_dim >= 256:  # the split form's stored phi(K) and states outweigh the two-kernel
            # workspace from K = 256 (o3 16x16: 289 against 32 MiB); at o2 64 the wy workspace is
            # the larger (160 against 145 MiB)
            assert other.workspace_bytes(w) < default_config("chunk", shape, limit).workspace_bytes(w)


def test_split_default_only_where_measured():
    """The split form leads at o3 16x16 where the H200's shared memory allows its stages and at
    o2 64, not at order 2 K = 128 nor under the portable 99 KiB at o3 16x16 -- off sm_90: there
    the Gluon loop's split leads at o2 128 (``gluon`` pinned, so the answer is the same on any
    machine; on the H100 the machine's own answer failed this test)."""
    for gluon in (False, True):
        assert isinstance(default_config("chunk", SHAPES["o3-16x16"], H200_SMEM, gluon), SplitConfig)
        assert isinstance(default_config("chunk", SHAPES["o2-64"], H200_SMEM, gluon), SplitConfig)
        assert not isinstance(default_config("chunk", SHAPES["o3-16x16"], gluon=gluon), SplitConfig)
        # phi from the phi kernel, the tile solve unrolled (H100: 0.974x rolled)
        o3 = default_config("chunk", SHAPES["o3-16x16"], H200_SMEM, gluon)
        assert (o3.phi_pass, o3.solve, o3.unroll_solve) == (True, "tiles", True)
    assert two_kernel(SHAPES["o3-16x16"], H200_SMEM) is not None
    assert not isinstance(default_config("chunk", SHAPES["o2-128"], H200_SMEM, gluon=False), SplitConfig)
    assert default_config("chunk", SHAPES["o2-128"], H200_SMEM, gluon=True).loop == "gluon"


def test_the_stepped_loop_is_the_default_only_where_measured():
    """o3 64x64 runs the chunk loop on the host at C 128 (H100, B1: 0.920 ms against 4.005 for
    the sequential kernel); order 4 at the same K was not timed and keeps the sequential kernel.
    The low-memory sibling takes the sequential kernel's tiles (the fused form cannot fit C 128's)."""
    o3 = default_config("chunk", SHAPES["o3-64x64"], H200_SMEM)
    assert (o3.loop, o3.chunk_size, o3.block_k, o3.tiles_per_program) == ("stepped", 128, 128, 4)
    o4 = default_config("chunk", SHAPES["o4-16x16x16"], H200_SMEM)
    assert isinstance(o4, StreamedConfig) and o4.loop == "triton" and o4.merge_passes
    fused = low_memory(SHAPES["o3-64x64"], H200_SMEM)
    assert (fused.chunk_size, fused.block_k, fused.merge_passes) == (64, 256, True)
    assert fused.check(SHAPES["o3-64x64"], H200_SMEM) is None


@pytest.mark.parametrize("tiles, admitted", [
    ((128, 128, 64, 8), True),    # 254 registers, no spill (offline, sm_90): refused before
    ((64, 256, 16, 4), True),     # no spill: refused before
    ((128, 128, 32, 8), True),    # the default's tiles
    ((64, 128, 64, 4), False),    # 192 bytes spilled: admitted before
    ((128, 256, 32, 8), False),   # 216 bytes spilled
    ((128, 64, 16, 4), False),    # the output kernel's [C, C] tiles at 4 warps: 416 bytes spilled
], ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else ("admitted" if x else "refused"))
def test_the_stepped_loop_refuses_by_its_own_register_estimate(tiles, admitted):
    """The stepped loop's kernels are estimated as themselves, not as the sequential kernel
    (chunk_stepped.MAX_EST_REGS, from 36 offline compiles at o3 64x64); the refusal names the
    estimate and its bound."""
    C, bk, bv, warps = tiles
    cfg = StreamedConfig(C, bk, bv, num_warps=warps, prepare_warps=8, loop="stepped", tiles_per_program=4)
    reason = cfg.check(SHAPES["o3-64x64"], H200_SMEM)
    if admitted:
        assert reason is None
    else:
        assert reason is not None and "registers per thread estimated (> 216)" in reason, reason


def test_large_states_stream():
    big = SHAPES["o3-64x64"]
    assert isinstance(default_config("chunk", big), StreamedConfig)
    assert not default_config("chunk", big).resident(big)
    assert default_config("recurrent", big).block_k < big.key_dim
    small = SHAPES["o3-16x16"]
    rec = default_config("recurrent", small)
    assert rec.block_k == 256 and rec.resident(small) and rec.stream_hints  # one [K, 32] register slab


def test_recurrent_candidates_try_both_hints():
    shape = SHAPES["o3-16x16"]
    first, second = candidates("recurrent", shape)
    assert second == dataclasses.replace(first, stream_hints=not first.stream_hints)
    assert first.with_other_hints(shape) == second
    streamed = SHAPES["o3-64x64"]  # no hints on a streamed slab: nothing to flip to
    assert candidates("recurrent", streamed) == [default_config("recurrent", streamed)]


@pytest.mark.parametrize("widths, d_v, rows, tile", [
    ((16, 16), 64, 64 * 8, (32, 4)),  # 32 MiB of fp32 slabs: the [K, 32] default
    ((16, 16), 64, 96 * 8 - 1, (32, 4)),  # one row short of 48 MiB
    ((16, 16), 64, 96 * 8, (64, 8)),  # 48 MiB: doubled
    ((16, 16), 64, 256 * 8, (64, 8)),
    ((32, 32), 64, 16 * 8, (16, 8)),  # K 1024 B16 (32 MiB): [1024, 16]
    ((32, 32), 64, 24 * 8, (32, 16)),  # B24 (48 MiB): doubled, as at K 256 B96
    ((32, 32), 64, 128 * 8, (32, 16)),
    ((32, 16), 64, 256 * 8, (32, 8)),  # K 512: [512, 16] with 4 warps, doubled
    ((16, 16), 32, 4096 * 8, (32, 4)),  # the default's tile already covers d_v
    ((64, 64), 64, 4096 * 8, (16, 8)),  # a streamed slab (K 4096): not measured, not doubled
    ((8, 8), 64, 4096 * 8, (32, 4)),  # K 64: not measured, not doubled
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_decode_tile_doubles_where_it_still_fills_the_gpu(widths, d_v, rows, tile):
    shape = KernelShape(widths, d_v)
    base = default_config("recurrent", shape)
    cfg = default_config("recurrent", shape, decode_rows=rows)
    assert (cfg.block_v, cfg.num_warps) == tile
    assert cfg.check(shape) is None and cfg.block_k == base.block_k and cfg.stream_hints == base.stream_hints
    assert decode_tile(base, shape, rows) == cfg
    # the flipped-hints proposal follows the batch's tile, not the batch-free default's
    assert candidates("recurrent", shape, decode_rows=rows)[1:] in ([], [cfg.with_other_hints(shape)])


def test_decode_rows_reach_the_launcher_default_at_one_token_only():
    import torch

    from rtcompile.kernels import launch
    from rtcompile.kernels.inputs import check_inputs

    def problem(B, T, cu_seqlens=None):
        q = [torch.randn(B, T, 8, 16) for _ in range(2)]
        k = [torch.randn(B, T, 8, 16) for _ in range(2)]
        return check_inputs(q, k, torch.randn(B, T, 8, 64), None, None, None, None, cu_seqlens)

    cpu = torch.device("cpu")
    assert launch.resolve_config("recurrent", None, problem(128, 1), cpu).block_v == 64
    assert launch.resolve_config("recurrent", None, problem(64, 1), cpu).block_v == 32
    assert launch.resolve_config("recurrent", None, problem(128, 3), cpu).block_v == 32  # a scan, not a step
    # varlen, one token a sequence (as serving engines pack a decode step): the [N, 1] call's tile
    for n, block_v in ((128, 64), (95, 32)):
        packed = problem(1, n, torch.arange(n + 1, dtype=torch.int32))
        assert launch.decode_rows("recurrent", packed) == min(n * 8, 768)
        assert launch.resolve_config("recurrent", None, packed, cpu).block_v == block_v
        assert launch.resolve_config("recurrent", None, problem(n, 1), cpu).block_v == block_v
    # one sequence of two tokens among one-token ones: a scan (T = 129 > N = 128)
    longer = problem(1, 129, torch.tensor([0, 2, *range(3, 130)], dtype=torch.int32))
    assert launch.decode_rows("recurrent", longer) is None
    assert launch.resolve_config("recurrent", None, longer, cpu).block_v == 32
    # the rule reads no more than its threshold (48 MiB of slabs: 768 rows of [256, 64]): the
    # cached defaults stay one per batch below it
    assert launch.decode_rows("recurrent", problem(4096, 1)) == 768
    assert launch.decode_rows("recurrent", problem(95, 1)) == 760
    assert launch.decode_rows("chunk", problem(4096, 1)) is None


def test_every_decode_tile_chooser_agrees_at_one_token():
    """The launcher, the planner (its decode decision and its prefill option at T = 1) and the
    tuner's decode bucket pick one tile for the same call: B256 H8 at o3 16x16."""
    from rtcompile.costmodel import Calibration
    from rtcompile.plan import make_plan
    from rtcompile.plan_options import prefill_options
    from rtcompile.spec import ModelSpec
    from rtcompile.target import get_target
    from rtcompile.tuning.keys import Bucket
    from rtcompile.tuning.space import bucket_decode_rows

    spec = ModelSpec(order=3, key_widths=(16, 16), value_width=64, heads=8, model_width=512, layers=1)
    want = default_config("recurrent", SHAPES["o3-16x16"], H200_SMEM, decode_rows=256 * 8)
    assert want.block_v == 64
    h200 = get_target("h200")
    (rec,) = [c for mode, c, _ in prefill_options(spec, h200, 256, 1, Calibration(), {}) if mode == "recurrent"]
    assert rec == want
    plan = make_plan(spec, h200, batches=(1,), seq_lens=(64,), decode_batches=(256,), use_measurements=False)
    (decode,) = [d for d in plan.decisions if d.phase == "decode"]
    assert config_from_dict(decode.variant, "recurrent") == want
    bucket = Bucket("recurrent", (16, 16), 64, 8, 256, 1, "bfloat16")
    assert default_config("recurrent", SHAPES["o3-16x16"], H200_SMEM, decode_rows=bucket_decode_rows(bucket)) == want


# ----- cost figures ----------------------------------------------------------------------------


def _figures(config, shape, T):
    return config.figures(Workload(shape, batch=8, heads=8, seq_len=T))


def test_cost_figures():
    o3, big = SHAPES["o3-16x16"], SHAPES["o3-64x64"]
    resident = ResidentConfig(chunk_size=32, block_v=16)
    streamed = StreamedConfig(chunk_size=32, block_k=256, block_v=16)
    merged = dataclasses.replace(streamed, merge_passes=True)
    split = SplitConfig(chunk_size=64, block_v=32)
    fused = FusedConfig(chunk_size=32, block_k=256, block_v=16)
    for T in (1024, 4096):
        assert _figures(resident, o3, T).state_passes == 2
        assert _figures(resident, o3, T).serial_steps == T // 32
        assert _figures(resident, o3, T).launches == 2 and _figures(split, o3, T).launches == 3
        assert _figures(fused, o3, T).launches == 1 and _figures(fused, o3, T).state_passes == 2
    for cfg in (streamed, merged):  # the state crosses HBM every chunk
        f1, f4 = _figures(cfg, big, 1024), _figures(cfg, big, 4096)
        assert f4.state_passes == 4 * f1.state_passes > 2
        assert f1.tile_visits == 2 * (4096 // 256) and f1.tile_elements == 32 * 256
    assert _figures(merged, big, 1024).state_passes < _figures(streamed, big, 1024).state_passes
    assert _figures(resident, o3, 1024).programs == 8 * 8 * 64 // 16
    rec = RecurrentConfig(block_k=256, block_v=32)
    assert _figures(rec, o3, 1).state_passes == 2 and _figures(rec, o3, 1).workspace_bytes == 0
    rec_streamed = RecurrentConfig(block_k=1024, block_v=16)
    assert _figures(rec_streamed, big, 8).state_passes == 3 * 8
    assert _figures(rec_streamed, big, 8).tile_visits == 2 * 4
    # workspace: the split form's stored states and keys dwarf the two-kernel form's scores
    w = Workload(o3, batch=8, heads=8, seq_len=4096)
    assert split.workspace_bytes(w) > resident.workspace_bytes(w) > 0 == rec.workspace_bytes(w)


@pytest.mark.parametrize("solve", ["tiles", "rows"])
def test_split_workspace_counts_wy_and_the_running_state_of_parts(solve):
    """wy adds W [T, K] in the products' type and U0 [T, V] fp32 per token-head and keeps the
    inverse only as the tile solve's scratch; parts add one fp32 running state per
    sequence-head (allocated when the caller keeps no final state); without the delta rule wy
    changes nothing."""
    shape = SHAPES["o3-16x16"]
    w = Workload(shape, batch=8, heads=8, seq_len=4096)
    base = SplitConfig(chunk_size=64, block_v=32, solve=solve)
    K, V, C = shape.key_dim, shape.value_width, 64
    wy = dataclasses.replace(base, wy=True).workspace_bytes(w) - base.workspace_bytes(w)
    assert wy == w.rows * (K * 2 + V * 4) - (0 if solve == "tiles" else w.rows * C * 4)
    parts = dataclasses.replace(base, pipeline=2).workspace_bytes(w) - base.workspace_bytes(w)
    assert parts == w.state_bytes == 8 * 8 * K * V * 4
    short = Workload(shape, batch=8, heads=8, seq_len=64)  # one chunk: one part, no running state
    assert dataclasses.replace(base, pipeline=2).workspace_bytes(short) == base.workspace_bytes(short)
    plain = Workload(shape, batch=8, heads=8, seq_len=4096, delta_rule=False)
    assert dataclasses.replace(base, wy=True).workspace_bytes(plain) == base.workspace_bytes(plain)


def test_tuned_table_of_the_old_format_is_refused_naming_it(tmp_path):
    from rtcompile.kernels import tuned

    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"format": 1, "entries": [{"kernel": "chunk", "variant": {"kernel": "chunk"}}]}))
    with pytest.raises(ValueError, match=r"format 1 is rtcompile 0\.1's .*delete the file"):
        tuned.reload(path)
    tuned.reload(tmp_path / "missing.json")  # leave an empty table behind for the other tests


@pytest.mark.parametrize("widths, d_v, chunk, out, refused", [
    ((64,), 64, 64, 16, True), ((128,), 64, 64, 32, True), ((32,), 64, 64, 16, True),
    ((16,), 64, 64, 16, False), ((64,), 64, 64, 64, False), ((64,), 64, 32, 16, False), ((64,), 32, 64, 32, False),
    ((16, 16), 64, 64, 16, False),
], ids=["o2-64-c64-out16", "o2-128-c64-out32", "o2-32-c64-out16", "o2-16-c64-out16",
        "o2-64-c64-out64", "o2-64-c32-out16", "o2-64-dv32-c64-out32", "o3-16x16-c64-out16"])
def test_split_output_tiles_measured_wrong_on_sm90_are_refused(widths, d_v, chunk, out, refused):
    # chunks of 64 with 16 / 32 output columns on one key axis: wrong outputs or an illegal
    # address on an H100 at K 32-128 (2026-12-05), right at K 16 and at o3 16x16 (two axes);
    # the interpreter runs them all correctly
    shape = KernelShape(widths, d_v, 2)
    reason = SplitConfig(chunk, 32, output_block_v=out).check(shape, 10**9)
    if refused:
        assert reason is not None and f"output_block_v={out} at chunk_size={chunk}" in reason, reason
        assert f"allowed: output_block_v={min(64, d_v)}, or chunk_size=32" in reason
    else:
        assert reason is None or "output_block_v" not in reason, reason
    materialised = SplitConfig(64, 32, materialise=True, output_block_v=16).check(KernelShape((16, 8), 64, 2), 10**9)
    assert materialised is not None and "K = 128" in materialised  # the materialised K counts
