"""The cost model's host overhead per call and its affine calibration (CPU: arithmetic only)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rtcompile.costmodel import (
    CHUNK_CALL_S,
    CHUNK_LAUNCH_CALL_S,
    DECODE_CALL_S,
    RECURRENT_CALL_S,
    SPLIT_BW_SHARE,
    SPLIT_ELEMENT_S,
    SPLIT_STEP_S,
    Calibration,
    calibrate,
    chunk_cost,
    fit_kind,
    config_cost,
    recurrent_cost,
    shape_of,
    workload,
)
from rtcompile.figures import io_bytes_per_token
from rtcompile.kernels.chunk_fused import FusedConfig
from rtcompile.kernels.chunk_resident import ResidentConfig
from rtcompile.kernels.chunk_split import SplitConfig
from rtcompile.kernels.chunk_streamed import StreamedConfig
from rtcompile.kernels.forms import default_config, low_memory, two_kernel
from rtcompile.plan import Plan, make_plan
from rtcompile.spec import load_spec
from rtcompile.target import get_target

ROOT = Path(__file__).resolve().parents[1]
H200 = get_target("h200")
NO_HOST = Calibration(chunk_call_s=0.0, recurrent_call_s=0.0, decode_call_s=0.0)


def _small():
    return load_spec(ROOT / "examples" / "order3_16x16.toml")


def _prefill_choices(spec, cal=None) -> dict[tuple[int, int], tuple[str, str, dict]]:
    plan = make_plan(spec, H200, batches=(1, 8), seq_lens=(16, 4096), decode_batches=(1,), use_measurements=False,
                     calibration=cal)
    return {(d.batch, d.seq_len): (d.mode, d.variant.get("form"), {a["variant"]["form"]: a["cost"]["seconds"]
                                                                  for a in d.alternatives})
            for d in plan.decisions if d.phase == "prefill"}


def test_host_overhead_per_launch_sends_short_prompts_to_one_launch_and_long_ones_to_the_split_form():
    """H200 regret run of 2026-12-04, eager o3 16x16 at T16 B1 / B8: fused (one launch) 0.133 /
    0.115 ms, the scan 0.153 / 0.203, the split form (three launches) 0.307 / 0.335."""
    choices = _prefill_choices(_small())
    for B in (1, 8):
        mode, form, costs = choices[(B, 16)]
        assert (mode, form) == ("chunk", "fused")
        assert costs["split"] - costs["fused"] >= 2 * CHUNK_LAUNCH_CALL_S  # its two further launches
        assert choices[(B, 4096)][:2] == ("chunk", "split")


def test_every_call_carries_its_kinds_overhead():
    spec, shape = _small(), shape_of(_small())
    chunk = default_config("chunk", shape, H200.smem_per_sm)
    rec = default_config("recurrent", shape, H200.smem_per_sm)
    costs = {"chunk": chunk_cost(spec, H200, 8, 16, chunk), "recurrent": recurrent_cost(spec, H200, 8, 16, rec),
             "decode": recurrent_cost(spec, H200, 8, 1, rec, step=True)}
    launches = chunk.figures(workload(spec, 8, 16)).launches
    assert launches == 4  # the phi kernel and the split form's three (an eager call runs one part)
    expected = {"chunk": CHUNK_CALL_S + 3 * CHUNK_LAUNCH_CALL_S, "recurrent": RECURRENT_CALL_S,
                "decode": DECODE_CALL_S}
    for kind, c in costs.items():
        assert c.kind == kind and c.host_s == pytest.approx(expected[kind])
        assert c.seconds == pytest.approx(c.kernel_s + c.host_s)
        assert c.to_dict()["host_s"] == c.host_s
        assert c.launch_host_s == (3 * CHUNK_LAUNCH_CALL_S if kind == "chunk" else 0.0)
    # the eager host paths, shortest first: one launch costs the chunk and the recurrent call alike
    assert DECODE_CALL_S < CHUNK_CALL_S == RECURRENT_CALL_S < expected["chunk"]


def _chunk_costs():
    spec = _small()
    v = default_config("chunk", shape_of(spec), H200.smem_per_sm)
    return [chunk_cost(spec, H200, B, T, v) for B in (1, 8) for T in (16, 256, 1024, 4096, 16384)]


def test_affine_calibration_recovers_a_known_scale_and_overhead():
    costs = _chunk_costs()
    scale, call = 1.7, 120e-6
    # +-3% of deterministic noise, and one call 3x too slow (a stray host stall): the robust fit ignores it
    noise = [1.03, 0.97, 1.01, 0.99, 1.02, 0.98, 1.0, 1.03, 0.97, 1.0]
    measured = [(scale * c.kernel_s + call + c.launch_host_s) * n for c, n in zip(costs, noise)]
    measured[3] *= 3
    cal = calibrate({"chunk": costs}, {"chunk": measured})
    assert cal.chunk == pytest.approx(scale, rel=0.05) and cal.chunk_call_s == pytest.approx(call, rel=0.1)
    assert cal.fits.startswith("chunk: affine (10 points)")
    # kinds without points stay uncalibrated
    assert (cal.recurrent, cal.recurrent_call_s, cal.decode, cal.decode_call_s) == (1.0, RECURRENT_CALL_S, 1.0,
                                                                                    DECODE_CALL_S)
    # the calibrated model reproduces the clean (noise-free) points
    v = default_config("chunk", shape_of(_small()), H200.smem_per_sm)
    again = chunk_cost(_small(), H200, 8, 4096, v, cal).seconds
    assert again == pytest.approx(scale * costs[8].kernel_s + call + costs[8].launch_host_s, rel=0.05)


def test_calibration_falls_back_with_too_few_or_unusable_points():
    costs = _chunk_costs()
    one = costs[4]
    # one point: the scale alone, the overhead kept at the model's; it reproduces the point
    cal = calibrate({"chunk": [one]}, {"chunk": [2 * one.seconds]})
    assert cal.chunk_call_s == CHUNK_CALL_S and "chunk: scale only (1 point)" in cal.fits
    assert cal.chunk * one.kernel_s + cal.chunk_call_s + one.launch_host_s == pytest.approx(2 * one.seconds)
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


# Predictions of the pre-redesign model (the 0.1 variants at 3bdcca7) for the same configs on
# the H200 profile, B8 T4096 prefill and B32 decode, seconds per layer: the config figures
# reproduce them, except the split form, which now pays its third launch (4 us).
# o2 64's default became the split form (H200: 0.295 against 0.343 ms for the resident one, which
# stays pinned as its two-kernel sibling); its fused sibling is now the split default's (C 16),
# pinned at the same figure as o3 16x16's. The split form counts three launches: the model prices
# an eager call, which runs one part (pipelined parts run in CUDA-graph captures only; the pins
# counted 6 launches for o3 16x16's two parts and 12 for o2 64's four, 4 us each, until 2026-12-04).
# Since 2026-12-04 the split form has a model of its own (its state loop's step latency plus its
# chunk-parallel kernels' bytes, costmodel.SPLIT_*): o2 64 0.388 ms of kernels predicted (0.84
# before; 0.273 measured on the H200 with CUDA graphs), o3 16x16 0.394 (0.522; 0.349), each plus
# the chunk call's host overhead.
# Since 2026-12-04 the resident form has one too (costmodel.RESIDENT_*: its step grows with C x K
# and with the GPU's fill): o2 64's resident sibling 0.432 ms of kernels (1.198 before; 0.343
# measured on the H200).
PINNED_CHUNK_CALL_S = 200e-6  # every chunk call's host overhead then (now by launch count: test above)
PINNED = {
    ((64,), "resident"): 0.00063191552, ((64,), "fused"): 0.0021048, ((64,), "recurrent"): 7.44e-05,
    ((64,), "split"): 0.000552250204,
    # o3 16x16 split: + one launch (4 us) since 2026-12-06, phi_pass's phi kernel
    ((16, 16), "split"): 0.000586450169, ((16, 16), "fused"): 0.0021048, ((16, 16), "recurrent"): 8.0764e-05,
    ((32, 32), "streamed"): 0.0017344, ((32, 32), "fused"): 0.00194352, ((32, 32), "recurrent"): 1.0698693e-04,
    # o3 64x64's default is the stepped loop since 2026-12-07 (C 128, runs of 4 tiles: the state
    # read and written once a chunk, 66 launches; its own figures); the sequential kernel's was 0.0054208
    ((64, 64), "streamed"): 0.00198902272, ((64, 64), "fused"): 0.00562992, ((64, 64), "recurrent"): 2.8176667e-04,
}


@pytest.mark.parametrize("widths", sorted({w for w, _ in PINNED}))
def test_config_costs_match_the_pre_redesign_model(widths):
    spec = dataclasses.replace(_small(), key_widths=widths, order=len(widths) + 1)
    shape = shape_of(spec)
    two = two_kernel(shape, H200.smem_per_sm) if widths == (64,) else None  # the former default there
    for cfg in (default_config("chunk", shape, H200.smem_per_sm), low_memory(shape, H200.smem_per_sm),
                default_config("recurrent", shape, H200.smem_per_sm), *([two] if two is not None else [])):
        B, T = (8, 4096) if cfg.kernel == "chunk" else (32, 1)
        if cfg.kernel == "chunk":  # the kernels, plus the chunk call's host overhead when the pins were taken
            got = chunk_cost(spec, H200, B, T, cfg).kernel_s + PINNED_CHUNK_CALL_S
        else:
            got = recurrent_cost(spec, H200, B, T, cfg, step=True).seconds
        assert got == pytest.approx(PINNED[(widths, cfg.form)], rel=1e-6), cfg
        again = config_cost(spec, H200, B, T, cfg, **({} if cfg.kernel == "chunk" else {"step": True}))
        assert (again.kernel_s + PINNED_CHUNK_CALL_S if cfg.kernel == "chunk" else again.seconds) == got


@dataclasses.dataclass(frozen=True)
class _Figured:
    """A config stand-in with given figures (the cost model asks a config for nothing else)."""

    config: object
    fig: object
    kernel = "chunk"

    @property
    def chunk_size(self):
        return self.config.chunk_size

    def figures(self, w):
        return self.fig


def test_cost_is_the_configs_figures_in_seconds():
    """Launches, workspace and the fused solve's serial rows all come from config.figures."""
    spec = _small()
    shape, work = shape_of(spec), workload(spec, 8, 4096)
    split = default_config("chunk", shape, H200.smem_per_sm)
    fig = split.figures(work)
    assert isinstance(split, SplitConfig) and split.pipeline == 2 and fig.launches == 4  # an eager call: one part
    c = chunk_cost(spec, H200, 8, 4096, split, NO_HOST)
    io = c.bytes - fig.state_passes * spec.state_bytes_per_layer * 8 - 2 * fig.workspace_bytes
    assert io == pytest.approx(io_bytes_per_token(spec) * 8 * 4096)
    # figures with one more launch cost one more launch and its host time, nothing else
    one_more = dataclasses.replace(fig, launches=fig.launches + 1)
    more = chunk_cost(spec, H200, 8, 4096, _Figured(split, one_more), NO_HOST)
    assert more.seconds - c.seconds == pytest.approx(H200.launch_s + CHUNK_LAUNCH_CALL_S) and more.bytes == c.bytes
    assert more.launch_host_s - c.launch_host_s == pytest.approx(CHUNK_LAUNCH_CALL_S)
    # twice the workspace: twice its bytes moved (written once, read once)
    heavier = chunk_cost(spec, H200, 8, 4096, _Figured(split, dataclasses.replace(
        fig, workspace_bytes=2 * fig.workspace_bytes)), NO_HOST)
    assert heavier.bytes - c.bytes == 2 * fig.workspace_bytes
    # the fused form's serial solve rows exist only with the delta rule (no solve without it)
    fused = low_memory(shape, H200.smem_per_sm)
    assert fused.figures(work).solve_rows > 0
    plain = spec.replace(features=dataclasses.replace(spec.features, delta_rule=False))
    assert fused.figures(workload(plain, 8, 4096)).solve_rows == 0


def test_split_form_adds_its_state_loop_to_its_chunk_parallel_bytes():
    """The split form's kernel time is its state loop (a step latency growing with C x K) plus
    its bytes at the chunk-parallel kernels' share of the bandwidth, not the larger of the two."""
    spec = _small()
    split = default_config("chunk", shape_of(spec), H200.smem_per_sm)
    fig = split.figures(workload(spec, 8, 4096))
    assert isinstance(split, SplitConfig) and fig.loop_elements == split.chunk_size * 256
    assert fig.programs <= H200.sms  # one loop program per SM: no sharing factor below
    cost = lambda f: chunk_cost(spec, H200, 8, 4096, _Figured(split, f), NO_HOST)
    base = cost(fig)
    step = SPLIT_STEP_S + SPLIT_ELEMENT_S * fig.loop_elements
    assert cost(dataclasses.replace(fig, serial_steps=2 * fig.serial_steps)).seconds - base.seconds == \
        pytest.approx(fig.serial_steps * step)
    wider = cost(dataclasses.replace(fig, loop_elements=2 * fig.loop_elements))
    assert wider.seconds - base.seconds == pytest.approx(fig.serial_steps * SPLIT_ELEMENT_S * fig.loop_elements)
    heavier = cost(dataclasses.replace(fig, workspace_bytes=fig.workspace_bytes + 10**9))
    assert heavier.seconds - base.seconds == pytest.approx(2e9 / (H200.hbm_bytes_per_s * SPLIT_BW_SHARE))
    # B1 runs the same loop with an eighth of the bytes (the chunk loop's model gave B1 and B8
    # the same latency-bound time; the H200 measured 0.16 and 0.35 ms)
    b1 = chunk_cost(spec, H200, 1, 4096, split, NO_HOST)
    assert b1.seconds < base.seconds
    assert base.bound == "memory" and b1.bound == "latency"
    # figures without loop_elements keep the largest-floor model
    assert cost(dataclasses.replace(fig, loop_elements=0)).seconds != pytest.approx(base.seconds)


def test_merged_passes_move_two_thirds_of_the_streamed_state_traffic():
    spec = dataclasses.replace(_small(), key_widths=(64, 64))
    two_pass = StreamedConfig(chunk_size=64, block_k=256, block_v=32, num_warps=8)
    merged = dataclasses.replace(two_pass, merge_passes=True)
    a = chunk_cost(spec, H200, 8, 4096, two_pass, NO_HOST)
    b = chunk_cost(spec, H200, 8, 4096, merged, NO_HOST)
    state = spec.state_bytes_per_layer * 8 * (4096 // 64)
    assert a.bytes - b.bytes == pytest.approx(state)


def test_stepped_loop_costs_its_bytes_and_launches_over_every_key_tile():
    """loop="stepped" (the chunk loop on the host): every key tile a program, the state read and
    written once a chunk plus the initial copy, two launches a chunk plus the prepare and the
    last update; its time is the larger floor plus the launches, with no step latency."""
    spec = dataclasses.replace(_small(), key_widths=(64, 64))
    stepped = StreamedConfig(chunk_size=64, block_k=256, block_v=32, num_warps=8, loop="stepped")
    fig = stepped.figures(workload(spec, 8, 4096))
    assert fig.host_loop and fig.programs == 8 * 8 * 2 * 16 and fig.launches == 2 * 64 + 2
    assert fig.state_passes == 2 * 64 + 1
    cost = chunk_cost(spec, H200, 8, 4096, stepped, NO_HOST)
    assert cost.bound in ("memory", "compute")
    more = chunk_cost(spec, H200, 8, 4096, _Figured(stepped, dataclasses.replace(fig, launches=fig.launches + 10)),
                      NO_HOST)
    # each launch: its GPU-side gap, and in an eager call its host time (~130 launches at T 4096:
    # the form is for CUDA-graph captures)
    assert more.seconds - cost.seconds == pytest.approx(10 * (H200.launch_s + CHUNK_LAUNCH_CALL_S))
    assert more.host_s - cost.host_s == pytest.approx(10 * CHUNK_LAUNCH_CALL_S)
    # the partials and the scaled U are workspace beside the prepare kernel's
    base = StreamedConfig(chunk_size=64, block_k=256, block_v=32, num_warps=8)
    assert _ws(spec, 8, 4096, stepped) - _ws(spec, 8, 4096, base) == 8 * 8 * 64 * 64 * 4 * (1 + 2 * 16)
    # runs of four key tiles: a quarter of the programs and of the partials' traffic
    runs = dataclasses.replace(stepped, tiles_per_program=4)
    fig4 = runs.figures(workload(spec, 8, 4096))
    assert fig4.programs * 4 == fig.programs
    # a run's partials: 2 products x 64 chunks x [C, d_v] fp32 x B H, written and read (the model
    # counts workspace bytes twice); plus their buffers' bytes once, as any workspace
    per_run = 2 * 64 * 64 * 64 * 4 * 8 * 8 + 2 * 64 * 64 * 4 * 8 * 8
    assert fig.workspace_bytes - fig4.workspace_bytes == per_run * (16 - 4)
    assert chunk_cost(spec, H200, 8, 4096, runs, NO_HOST).bytes < cost.bytes
    # prefetch_state and merge_passes do nothing there, tiles_per_program nothing elsewhere
    assert dataclasses.replace(stepped, merge_passes=True, prefetch_state=True).canonical() == stepped
    assert dataclasses.replace(base, tiles_per_program=4).canonical() == base


def _ws(spec, B, T, cfg):
    return cfg.workspace_bytes(workload(spec, B, T))


def test_fused_workspace_is_the_tile_scratch_and_does_not_grow_with_t():
    spec = _small()  # o3 16x16, d_v 64, delta rule on
    v = FusedConfig(chunk_size=64, block_k=256, block_v=32, solve="tiles")
    programs = 8 * spec.heads * 2  # B8, two 32-column value tiles
    assert spec.features.delta_rule
    assert _ws(spec, 8, 4096, v) == _ws(spec, 8, 64, v) == programs * 64 * 64 * 4
    assert _ws(spec, 8, 4096, dataclasses.replace(v, solve="rows")) == 0
    two_kernel = ResidentConfig(chunk_size=64, block_v=32)  # [B, H, T, C] P and Ai: grows with T
    assert _ws(spec, 8, 4096, two_kernel) == 64 * _ws(spec, 8, 64, two_kernel)


def test_wy_with_the_tile_solve_also_keeps_its_inverse():
    spec = _small()
    wy = ResidentConfig(chunk_size=32, block_v=32, prefetch_inputs=True, wy=True, solve="rows")
    rows = 8 * spec.heads * 4096
    extra = _ws(spec, 8, 4096, dataclasses.replace(wy, solve="tiles")) - _ws(spec, 8, 4096, wy)
    assert extra == rows * 32 * 4  # Ai [B, H, T, C] fp32 beside P, W and U0


def test_split_workspace_counts_states_u_inverse_and_stored_keys():
    spec = _small()  # o3 16x16 (K 256), d_v 64, delta rule on
    v = SplitConfig(chunk_size=64, block_v=32, num_stages=2, solve="tiles")
    dot = 2 if spec.input_dtype in ("bfloat16", "float16") else 4
    rows, chunks = 8 * spec.heads * 4096, 8 * spec.heads * 64
    states_u = chunks * 256 * 64 * dot + rows * 64 * dot
    gc = rows * 4 if spec.features.forget_gate else 0  # the gates' cumulative sums, from the prepare kernel
    assert _ws(spec, 8, 4096, v) == states_u + rows * 64 * 4 + rows * 256 * dot + gc
    # the state of every 2nd chunk only: half the stored states
    strided = dataclasses.replace(v, state_stride=2)
    assert _ws(spec, 8, 4096, v) - _ws(spec, 8, 4096, strided) == chunks // 2 * 256 * 64 * dot


def test_device_time_calibrates_the_scale_and_keeps_the_host_overheads():
    """Tuned entries are CUDA-graph replays (no host time): fitted as whole eager calls, 1.5 x
    the kernels would have come out as a smaller scale plus the model's overhead taken off."""
    costs = _chunk_costs()
    device = {"chunk": [1.5 * c.kernel_s for c in costs]}
    cal = calibrate({"chunk": costs}, device, device_time=True)
    assert cal.chunk == pytest.approx(1.5, rel=1e-6) and cal.chunk_call_s == CHUNK_CALL_S
    assert cal.fits.startswith(f"chunk: device-time scale ({len(costs)} points)")
    assert cal.decode == 1.0 and "decode: none (0 points)" in cal.fits
    eager = calibrate({"chunk": costs}, device)  # the same numbers read as eager calls
    assert eager.chunk < 1.5 or eager.chunk_call_s < CHUNK_CALL_S
