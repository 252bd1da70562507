"""Variant spaces: defaults are valid, the space holds only valid variants, checks explain."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from rtcompile.kernels.variants import ChunkVariant, KernelShape, RecurrentVariant, iter_space

SHAPES = {
    "o2-64": KernelShape((64,), 64),
    "o3-16x16": KernelShape((16, 16), 64),
    "o3-32x32": KernelShape((32, 32), 64),
    "o3-64x64": KernelShape((64, 64), 64),
    "o4-16x16x16": KernelShape((16, 16, 16), 64),
    "o3-3x5-v6": KernelShape((3, 5), 6),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("cls", [ChunkVariant, RecurrentVariant], ids=["chunk", "recurrent"])
def test_default_is_valid_and_in_space(cls, shape):
    default = cls.default(shape)
    assert default.check(shape) is None
    space = cls.space(shape)
    for name, value in default.to_dict().items():
        if name != "kernel":
            assert value in space[name], (name, value)
    # the first few hundred: the whole chunk space is millions of combinations at o3 16x16
    # (minutes here), and iter_space yields only what check accepts
    variants = list(itertools.islice(iter_space(cls, shape), 300))
    assert variants and all(v.check(shape) is None for v in variants)


def test_large_state_defaults_stream():
    big = SHAPES["o3-64x64"]
    assert not ChunkVariant.default(big).resident(big)
    assert RecurrentVariant.default(big).block_k < big.key_dim
    small = SHAPES["o3-16x16"]
    assert RecurrentVariant.default(small).block_k == 256  # one [K, 16] register tile (DESIGN.md)


@pytest.mark.parametrize(
    "variant, needle",
    [
        (ChunkVariant(chunk_size=48, block_k=16, block_v=16), "not a power of two"),
        (ChunkVariant(chunk_size=256, block_k=16, block_v=16), "outside [16, 128]"),
        (ChunkVariant(chunk_size=64, block_k=8, block_v=16), ">= 16"),
        (ChunkVariant(chunk_size=64, block_k=4096, block_v=64, num_warps=2), "registers"),
        (ChunkVariant(chunk_size=64, block_k=16, block_v=16, dot_precision="fp8"), "dot_precision"),
        (RecurrentVariant(block_k=4096, block_v=64, num_warps=1), "registers"),
        (RecurrentVariant(block_k=8192, block_v=16), "exceeds K"),
        (ChunkVariant(chunk_size=16, block_k=16, block_v=16, solve="blocks"), "needs chunk_size in [32, 64]"),
        (ChunkVariant(chunk_size=128, block_k=16, block_v=16, solve="blocks"), "needs chunk_size in [32, 64]"),
        (ChunkVariant(chunk_size=128, block_k=16, block_v=16, solve="blocks", solve_block=8), "in [16, 64]"),
        (ChunkVariant(chunk_size=32, block_k=16, block_v=16, solve_block=8), "solve_block=8 needs solve='blocks'"),
        (ChunkVariant(chunk_size=32, block_k=16, block_v=16, solve="blocks", solve_block=2), "allowed: 4, 8, 16"),
        (ChunkVariant(chunk_size=32, block_k=16, block_v=16, prepare_warps=3), "allowed: 1, 2, 4, 8, 16"),
        (ChunkVariant(chunk_size=32, block_k=16, block_v=16, prepare_warps=2, fuse_prepare=True),
         "prepare_warps=2 needs fuse_prepare=False"),
        (ChunkVariant(chunk_size=64, block_k=64, block_v=16, kron=True), "kron needs order 4"),
        (ChunkVariant(chunk_size=32, block_k=16, block_v=16, solve="lu"), "allowed: rows, blocks"),
        (ChunkVariant(chunk_size=32, block_k=128, block_v=16, wy=True), "wy needs the state in registers"),
        (ChunkVariant(chunk_size=32, block_k=128, block_v=16, wy=True, fuse_prepare=True), "fuse_prepare=False"),
    ],
    ids=["chunk-48", "chunk-256", "block-k-8", "chunk-registers", "precision", "rec-registers", "rec-block-k",
         "blocks-c16", "blocks-c128", "blocks8-c128", "solve-block-rows", "solve-block-2", "prepare-warps-3",
         "prepare-warps-fused", "kron-order-3", "solve-name", "wy-streamed", "wy-fused"],
)
def test_check_explains(variant, needle):
    reason = variant.check(SHAPES["o3-64x64"])
    assert reason is not None and needle in reason


@pytest.mark.parametrize("cls", [ChunkVariant, RecurrentVariant], ids=["chunk", "recurrent"])
def test_fields_list_every_parameter(cls):
    import dataclasses

    assert cls.FIELDS == tuple(f.name for f in dataclasses.fields(cls))


def test_dict_round_trip_and_unknown_keys():
    v = ChunkVariant(chunk_size=32, block_k=64, block_v=16, fuse_prepare=True)
    assert ChunkVariant.from_dict(v.to_dict()) == v
    with pytest.raises(ValueError, match="unknown parameters"):
        ChunkVariant.from_dict({**v.to_dict(), "block_z": 4})


def test_prefetch_needs_wide_power_of_two_factors():
    v = ChunkVariant(chunk_size=16, block_k=16, block_v=16, prefetch=True)
    assert "power-of-two key widths >= 16" in v.check(KernelShape((2, 8), 16))
    assert ChunkVariant(chunk_size=16, block_k=256, block_v=16, num_warps=8, num_stages=1,
                        prefetch=True).check(KernelShape((16, 16), 16)) is None


@pytest.mark.parametrize("widths", [(16, 16), (64,), (32, 32), (16, 16, 16), (2, 4), (3, 5)], ids=str)
def test_chunk_candidates_are_valid_distinct_and_start_with_the_default(widths):
    shape = KernelShape(widths, 64)
    found = ChunkVariant.candidates(shape, 232448)
    assert found and found[0] == ChunkVariant.default(shape, 232448)
    assert len(set(found)) == len(found) and all(v.check(shape, 232448) is None for v in found)


def test_warm_starts_apply_fixed_parameters_and_a_quarter_of_the_budget():
    from rtcompile.tuning import Bucket, TuneOptions
    from rtcompile.tuning.study import _warm_starts

    b = Bucket("chunk", (16, 16), 64, 8, 8, 4096, "bfloat16")
    every = _warm_starts(b, TuneOptions(device="cpu"), None)
    assert len(every) >= 3 and every[0]["prefetch"] and not every[0]["wy"]  # the default first
    assert len(_warm_starts(b, TuneOptions(device="cpu"), 8)) == 2
    fixed = _warm_starts(b, TuneOptions(device="cpu", fixed={"chunk_size": 32}), None)
    assert fixed and all(p["chunk_size"] == 32 for p in fixed)
    # a fixed value that makes every candidate invalid leaves nothing to start from
    assert _warm_starts(b, TuneOptions(device="cpu", fixed={"block_k": 16, "wy": True}), None) == []


@pytest.mark.parametrize("limit", [None, 232448], ids=["portable-smem", "h200-smem"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_default_has_a_valid_low_memory_sibling(shape, limit):
    """The planner's low-memory choice (``fused``) must run wherever the default does: the
    three-kernel default at K = 256 (C 64, two stages) once gave a fused sibling refused at
    ~464 estimated registers."""
    kw = {} if limit is None else {"smem_limit": limit}
    default = ChunkVariant.default(shape, **kw)
    fused = default.fused(shape)
    assert fused.fuse_prepare and not fused.output_pass and fused.check(shape, **kw) is None


def test_three_kernel_default_only_where_measured():
    """output_pass + stored_keys leads at order >= 3 with K = 256 where the shared memory allows
    two stages (the H200's 227 KiB), not at order 2 K = 128 (slower there) nor under 99 KiB."""
    h200 = 232448
    assert ChunkVariant.default(KernelShape((16, 16), 64), h200).output_pass
    assert ChunkVariant.default(KernelShape((16, 16), 64), h200).stored_keys
    assert not ChunkVariant.default(KernelShape((128,), 64), h200).output_pass
    assert not ChunkVariant.default(KernelShape((16, 16), 64)).output_pass


def test_gated_parameters_are_enumerated_only_beside_their_gate():
    """iter_space skips stored_keys / segments away from output_pass=True without losing a valid
    variant: the same set as filtering the full product through check."""
    shape = KernelShape((16,), 64)
    base = {k: [v] for k, v in ChunkVariant.default(shape).to_dict().items() if k != "kernel"}
    space = {**base, "wy": [False], "output_pass": [False, True], "stored_keys": [False, True],
             "segments": [1, 2, 4], "prefetch": [False, True], "num_stages": [1, 2]}
    got = list(iter_space(ChunkVariant, shape, space))
    brute = [v for v in (ChunkVariant(**dict(zip(space, vals))) for vals in itertools.product(*space.values()))
             if v.check(shape) is None]
    assert len(got) == len(set(got)) and set(got) == set(brute)
    assert any(v.segments == 4 and v.stored_keys for v in got)  # the gated values are reached


def test_a_gated_gate_opens_what_it_gates():
    """key_group is gated by stored_keys, itself gated by output_pass: iter_space reaches every
    valid combination (the same set as check over the full product) and TPE's parameter
    request asks for key_group only where stored_keys was asked for and is True."""
    from rtcompile.tuning.study import _suggest

    shape = KernelShape((16, 16), 64)
    base = {k: [v] for k, v in ChunkVariant.default(shape).to_dict().items() if k != "kernel"}
    space = {**base, "output_pass": [False, True], "stored_keys": [False, True], "key_group": [1, 2, 4],
             "prefetch": [False, True], "num_stages": [1, 2], "tma": [False, True]}
    got = list(iter_space(ChunkVariant, shape, space))
    brute = [v for v in (ChunkVariant(**dict(zip(space, vals))) for vals in itertools.product(*space.values()))
             if v.check(shape) is None]
    assert len(got) == len(set(got)) and set(got) == set(brute)
    assert {v.key_group for v in got if v.stored_keys} == {1, 2, 4}
    assert {(v.tma, v.key_group) for v in got if v.stored_keys} == set(itertools.product((False, True), (1, 2, 4)))

    class Trial:  # answers every request with a fixed choice, recording what was asked
        def __init__(self, picks):
            self.picks, self.asked = picks, []

        def suggest_categorical(self, name, choices):
            self.asked.append(name)
            return self.picks.get(name, choices[0])

    for picks, asked in (({"output_pass": False}, False), ({"output_pass": True, "stored_keys": False}, False),
                         ({"output_pass": True, "stored_keys": True}, True)):
        trial = Trial(picks)
        _suggest(trial, ChunkVariant, space)
        assert ("key_group" in trial.asked) == asked, picks


# one value away from the default for each gated parameter; the test below fails when GATED
# gains a parameter that is not listed here
GATED_PROBES = {"stored_keys": True, "segments": 2, "output_block_v": 32, "output_warps": 2, "state_stride": 2,
                "tma": True, "key_group": 2}


@pytest.mark.parametrize("name", GATED_PROBES)
def test_every_gated_parameter_is_refused_without_its_gate(name):
    """check's gate refusal is read from GATED: a gated parameter away from its default is
    refused, naming the gate and the value it needs, exactly when its gate is closed, and the
    same variant with the gate open passes (so the refusal is the gate's, not another rule's)."""
    assert set(GATED_PROBES) == set(ChunkVariant.GATED)
    shape, h200 = KernelShape((16, 16), 64), 232448
    gate, need = ChunkVariant.GATED[name]
    # the K = 256 three-kernel default with every gated parameter back at its default, then the
    # gate chain opened and only the probed one set
    bare = {f.name: f.default for f in dataclasses.fields(ChunkVariant) if f.name in ChunkVariant.GATED}
    opened = dataclasses.replace(ChunkVariant.default(shape, h200), **{**bare, "stored_keys": gate == "stored_keys"})
    opened = dataclasses.replace(opened, **{name: GATED_PROBES[name]})
    # (built keys at three stages exceed the H200's shared memory: the checks below are the gates')
    assert opened.output_pass and getattr(opened, gate) == need and opened.check(shape, 10**9) is None
    closed = dataclasses.replace(opened, **{gate: not need})
    assert f"{name}={GATED_PROBES[name]!r} needs {gate}={need!r}" in (closed.check(shape, 10**9) or "")
