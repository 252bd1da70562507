"""The cost model's host overhead per call and its affine calibration (CPU: arithmetic only)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rtcompile.costmodel import (
    CHUNK_CALL_S,
    DECODE_CALL_S,
    RECURRENT_CALL_S,
    Calibration,
    calibrate,
    chunk_cost,
    fit_kind,
    recurrent_cost,
    shape_of,
)
from rtcompile.kernels.variants import ChunkVariant, RecurrentVariant
from rtcompile.plan import Plan, make_plan
from rtcompile.spec import load_spec
from rtcompile.target import get_target

ROOT = Path(__file__).resolve().parents[1]
H200 = get_target("h200")
NO_HOST = Calibration(chunk_call_s=0.0, recurrent_call_s=0.0, decode_call_s=0.0)


def _small():
    return load_spec(ROOT / "examples" / "order3_16x16.toml")


def _prefill_modes(spec, cal=None) -> dict[tuple[int, int], str]:
    plan = make_plan(spec, H200, batches=(1, 8), seq_lens=(16, 4096), decode_batches=(1,), use_measurements=False,
                     calibration=cal)
    return {(d.batch, d.seq_len): d.mode for d in plan.decisions if d.phase == "prefill"}


def test_host_overhead_sends_short_prompts_to_the_scan_and_long_ones_to_chunks():
    spec = _small()
    modes = _prefill_modes(spec)
    assert modes[(1, 16)] == modes[(8, 16)] == "recurrent"  # the H200 run: 0.183 / 0.164 ms vs chunk 0.196 / 0.265
    assert modes[(1, 4096)] == modes[(8, 4096)] == "chunk"
    # the overhead is what moved the short prompts: without it the chunk kernels win there too
    assert _prefill_modes(spec, NO_HOST)[(8, 16)] == "chunk"


def test_every_call_carries_its_kinds_overhead():
    spec, shape = _small(), shape_of(_small())
    chunk = ChunkVariant.default(shape, H200.smem_per_sm)
    rec = RecurrentVariant.default(shape, H200.smem_per_sm)
    costs = {"chunk": chunk_cost(spec, H200, 8, 16, chunk), "recurrent": recurrent_cost(spec, H200, 8, 16, rec),
             "decode": recurrent_cost(spec, H200, 8, 1, rec, step=True)}
    expected = {"chunk": CHUNK_CALL_S, "recurrent": RECURRENT_CALL_S, "decode": DECODE_CALL_S}
    for kind, c in costs.items():
        assert c.kind == kind and c.host_s == expected[kind] and c.seconds == pytest.approx(c.kernel_s + c.host_s)
        assert c.to_dict()["host_s"] == expected[kind]
    assert DECODE_CALL_S < RECURRENT_CALL_S < CHUNK_CALL_S  # the eager host paths, shortest first


def _chunk_costs():
    spec = _small()
    v = ChunkVariant.default(shape_of(spec), H200.smem_per_sm)
    return [chunk_cost(spec, H200, B, T, v) for B in (1, 8) for T in (16, 256, 1024, 4096, 16384)]


def test_affine_calibration_recovers_a_known_scale_and_overhead():
    costs = _chunk_costs()
    scale, call = 1.7, 120e-6
    # +-3% of deterministic noise, and one call 3x too slow (a stray host stall): the robust fit ignores it
    noise = [1.03, 0.97, 1.01, 0.99, 1.02, 0.98, 1.0, 1.03, 0.97, 1.0]
    measured = [(scale * c.kernel_s + call) * n for c, n in zip(costs, noise)]
    measured[3] *= 3
    cal = calibrate({"chunk": costs}, {"chunk": measured})
    assert cal.chunk == pytest.approx(scale, rel=0.05) and cal.chunk_call_s == pytest.approx(call, rel=0.1)
    assert cal.fits.startswith("chunk: affine (10 points)")
    # kinds without points stay uncalibrated
    assert (cal.recurrent, cal.recurrent_call_s, cal.decode, cal.decode_call_s) == (1.0, RECURRENT_CALL_S, 1.0,
                                                                                    DECODE_CALL_S)
    # the calibrated model reproduces the clean (noise-free) points
    v = ChunkVariant.default(shape_of(_small()), H200.smem_per_sm)
    again = chunk_cost(_small(), H200, 8, 4096, v, cal).seconds
    assert again == pytest.approx(scale * costs[8].kernel_s + call, rel=0.05)


def test_calibration_falls_back_with_too_few_or_unusable_points():
    costs = _chunk_costs()
    one = costs[4]
    # one point: the scale alone, the overhead kept at the model's; it reproduces the point
    cal = calibrate({"chunk": [one]}, {"chunk": [2 * one.seconds]})
    assert cal.chunk_call_s == CHUNK_CALL_S and "chunk: scale only (1 point)" in cal.fits
    assert cal.chunk * one.kernel_s + cal.chunk_call_s == pytest.approx(2 * one.seconds)
    # no points: uncalibrated
    assert calibrate({}, {}) == dataclasses.replace(Calibration(), fits=calibrate({}, {}).fits)
    assert calibrate({}, {}).fits == "chunk: none (0 points); recurrent: none (0 points); decode: none (0 points)"
    # kernel times too close together to tell a scale from an overhead: the scale alone
    scale, call, how = fit_kind([(1e-3, 2e-3), (1.2e-3, 2.5e-3)], 1e-4)
    assert how == "scale only (2 points)" and call == 1e-4 and scale > 0
    # measured = 2 x kernel - 50 us would need a negative overhead: held at zero, the scale
    # refitted between the points' ratios (1.5 to 2)
    scale, call, how = fit_kind([(d, 2 * d - 5e-5) for d in (1e-4, 1e-3, 1e-2)], 1e-4)
    assert how.startswith("affine") and call == 0.0 and 1.5 < scale < 2.0
    # measurements below the overhead alone, falling as the kernels grow: 1.0 and the model's overhead
    assert fit_kind([(1e-3, 5e-5), (1e-2, 4e-5)], 1e-4) == (1.0, 1e-4, "none (2 points)")


def test_plan_json_keeps_the_calibration_and_reads_files_from_before_it(tmp_path):
    spec = _small()
    cal = Calibration(chunk=1.5, chunk_call_s=1e-4, fits="by hand")
    plan = make_plan(spec, H200, batches=(1,), seq_lens=(16, 4096), decode_batches=(1,), use_measurements=False,
                     calibration=cal)
    assert plan.calibration == cal.to_dict()
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again.to_dict() == plan.to_dict() and Calibration(**again.calibration) == cal
    # a plan written before the overheads: scales only, costs without host_s / kind
    old = json.loads(path.read_text())
    old["calibration"] = {"chunk": 2.2, "recurrent": 1.7}
    for d in old["decisions"]:
        for c in [d["cost"]] + [a["cost"] for a in d["alternatives"]]:
            c.pop("host_s"), c.pop("kind")
    path.write_text(json.dumps(old))
    loaded = Plan.load(path)
    assert loaded.calibration == {"chunk": 2.2, "recurrent": 1.7}
    assert loaded.decision_for("prefill", 1, 4096).mode == plan.decision_for("prefill", 1, 4096).mode


def test_merged_passes_move_two_thirds_of_the_streamed_state_traffic():
    spec = dataclasses.replace(_small(), key_widths=(64, 64))
    two_pass = ChunkVariant(chunk_size=64, block_k=256, block_v=32, num_warps=8)
    merged = dataclasses.replace(two_pass, merge_passes=True)
    a = chunk_cost(spec, H200, 8, 4096, two_pass, NO_HOST)
    b = chunk_cost(spec, H200, 8, 4096, merged, NO_HOST)
    state = spec.state_bytes_per_layer * 8 * (4096 // 64)
    assert a.bytes - b.bytes == pytest.approx(state)


def test_fused_workspace_is_the_tile_scratch_and_does_not_grow_with_t():
    from rtcompile.costmodel import chunk_workspace_bytes

    spec = _small()  # o3 16x16, d_v 64, delta rule on
    v = ChunkVariant(chunk_size=64, block_k=256, block_v=32, fuse_prepare=True, solve="tiles")
    programs = 8 * spec.heads * 2  # B8, two 32-column value tiles
    assert spec.features.delta_rule
    assert chunk_workspace_bytes(spec, 8, 4096, v) == chunk_workspace_bytes(spec, 8, 64, v) == programs * 64 * 64 * 4
    assert chunk_workspace_bytes(spec, 8, 4096, dataclasses.replace(v, solve="blocks")) == 0
    two_kernel = dataclasses.replace(v, fuse_prepare=False)  # [B, H, T, C] P and Ai: grows with T
    assert chunk_workspace_bytes(spec, 8, 4096, two_kernel) == 64 * chunk_workspace_bytes(spec, 8, 64, two_kernel)


def test_wy_with_the_tile_solve_also_keeps_its_inverse():
    from rtcompile.costmodel import chunk_workspace_bytes

    spec = _small()
    wy = ChunkVariant(chunk_size=32, block_k=256, block_v=32, prefetch=True, wy=True)
    rows = 8 * spec.heads * 4096
    extra = chunk_workspace_bytes(spec, 8, 4096, dataclasses.replace(wy, solve="tiles")) - chunk_workspace_bytes(
        spec, 8, 4096, wy)
    assert extra == rows * 32 * 4  # Ai [B, H, T, C] fp32 beside P, W and U0


def test_output_pass_workspace_counts_states_u_inverse_and_stored_keys():
    from rtcompile.costmodel import chunk_workspace_bytes

    spec = _small()  # o3 16x16 (K 256), d_v 64, delta rule on
    v = ChunkVariant(chunk_size=64, block_k=256, block_v=32, num_stages=2, output_pass=True, solve="tiles")
    dot = 2 if spec.input_dtype in ("bfloat16", "float16") else 4
    rows, chunks = 8 * spec.heads * 4096, 8 * spec.heads * 64
    states_u = chunks * 256 * 64 * dot + rows * 64 * dot
    gc = rows * 4 if spec.features.forget_gate else 0  # the gates' cumulative sums, from the prepare kernel
    assert chunk_workspace_bytes(spec, 8, 4096, v) == states_u + rows * 64 * 4 + gc
    stored = dataclasses.replace(v, stored_keys=True)
    assert chunk_workspace_bytes(spec, 8, 4096, stored) == states_u + rows * 64 * 4 + rows * 256 * dot + gc
    # wy: W [T, K] in the dot type and U0 [T, V] fp32, beside the tile solve's inverse
    wy = dataclasses.replace(stored, wy=True)
    assert chunk_workspace_bytes(spec, 8, 4096, wy) == (chunk_workspace_bytes(spec, 8, 4096, stored)
                                                         + rows * (256 * dot + 64 * 4))
