# One GPU session's measurements, in steps that each fit one 10-minute device call.
#
#   bash benchmarks/gpu_session.sh STEP...     (STEP: tests | bench | confirm | errors | probes | wy-tiles | three-kernel | segments | k256 | tma | tf32 | sweep-decode |
#        sweep-prefill | sweep-report | one-worker | tpe-again | sweep | tuned-bench | checks | finish)
#
# Run from the project root on the device machine, after installing the carried wheels (see
# benchmarks/README.md). Everything lands under $OUT/<step>; the tuning store and the tuned
# table live outside $OUT and come back as $OUT/cache/{sweep.db,tuned.json}. A later device
# call starts on a bare machine: to run `tuned-bench` in another call than `sweep`, copy the
# tuned table the sweep returned into the working tree and point TUNED at it (tuned entries
# are keyed by GPU name and kernel source hash, so they hold on any machine of the same kind
# at the same commit).
#
# Durations, from the H200 runs of 2026-11-30b (benchmarks/README.md has the list): tests ~110 s;
# sweep-decode ~5 min and sweep-prefill ~7 min on two GPUs; sweep-report ~60 s; bench decode
# 35 s + prefill 140 s budgets reach o4 16x16x16. Each device call also pays ~30 s of start-up.
set -euo pipefail
: "${OUT:?set OUT (the device tool sets it)}"
export RTCOMPILE_COMMIT="${RTCOMPILE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
# The store and caches live outside $OUT (the device tool returns a limited number of files:
# on 2026-11-30 the JSON results were left out behind cache files); `finish` copies back the
# sweep database and the tuned table.
export XDG_CACHE_HOME="${XDG_CACHE_HOME_RUN:-/tmp/rtcompile-run-cache}"
export RTCOMPILE_TUNED="$XDG_CACHE_HOME/rtcompile/tuned.json"
mkdir -p "$XDG_CACHE_HOME" "$OUT/cache"
# A sub-space small enough to sweep exhaustively (92 chunk / 90-115 decode variants at these
# shapes on 2026-11-30b); the TPE study searches the same sub-space with 20% of the exhaustive
# trial count. The knobs added since (prepare_warps, solve_block, merge_passes, kron) are pinned
# to their values of then; prefetch of a streamed state tile (2026-11-30c) still doubles the
# streamed part: on the CPU's 99 KiB shared-memory bound the o3 16x16 sub-space counts 209
# variants where 2026-11-30b's code counted 101, so the study limits below may cut a sweep.
CHUNK_FIX=(--fix fuse_prepare=false --fix solve=rows --fix dot_precision=ieee --fix num_stages=1
  --fix prepare_warps=4 --fix solve_block=16 --fix merge_passes=false --fix kron=false --fix output_pass=false
  --fix stored_keys=false)
DECODE_FIX=(--fix num_stages=1)

step_tests() {  # -v into a file, not through a pipe: a hung compile left an empty log on 2026-11-30
  # (600 s lost); faulthandler prints the stack of any test still running after 60 s
  timeout 330 python3 -m pytest -v -p no:cacheprovider -o faulthandler_timeout=60 --durations=10 \
    tests/test_kernels.py tests/test_ops.py tests/test_kernel_inputs.py > "$OUT/tests.txt" 2>&1 || true
  tail -5 "$OUT/tests.txt"
}

step_bench() {  # decode first (about a minute), so a long prefill run cannot starve it of budget
  python3 -m rtcompile.cli bench --out "$OUT/bench_decode" --phase decode --budget-s 60
  python3 -m rtcompile.cli bench --out "$OUT/bench_prefill" --phase prefill --budget-s 360
}

sweep_one() {  # spec phase batch fixes... : TPE at 20% of the exhaustive count, then exhaustive
  local spec=$1 phase=$2 batches=$3; shift 3
  local db="sqlite:///$XDG_CACHE_HOME/sweep.db" bflag=--batch
  [ "$phase" = decode ] && bflag=--decode-batch
  local n
  n=$(python3 - "$spec" "$phase" "$batches" "$@" <<'EOF'
import sys
from rtcompile.spec import load_spec
from rtcompile.tuning import Bucket, TuneOptions
from rtcompile.tuning.study import exhaustive_variants
from rtcompile.tune_cmd import _fixed
spec, phase, b = load_spec(sys.argv[1]), sys.argv[2], int(sys.argv[3])
fixed = dict(_fixed(a) for a in sys.argv[4:] if a != "--fix")
kernel, T = ("chunk", 4096) if phase == "prefill" else ("recurrent", 1)
bucket = Bucket(kernel, spec.key_widths, spec.value_width, spec.heads, b, T, spec.input_dtype)
import torch
device = "cuda" if torch.cuda.is_available() else "cpu"
print(max(1, int(0.2 * len(exhaustive_variants(bucket, TuneOptions(device=device, fixed=fixed))))))
EOF
)
  # TPE first (one worker per GPU, the CLI's default), then the sweep (8 workers per GPU: their
  # compiles overlap, timings stay serial per GPU); both write the bucket's tuned entry and the
  # last one stays, and the exhaustive best is the better of the two by construction
  local t0=$(date +%s)
  # each study under a time limit (timeout signals the whole process group, workers included),
  # so a slow sweep still leaves the call time to copy back what it stored
  timeout "${TUNE_LIMIT_S:-120}" python3 -m rtcompile.cli tune "$spec" --phase "$phase" $bflag "$batches" \
    --storage "$db" --trials "$n" --workers "${TPE_WORKERS:-$NGPU}" ${TPE_ONLY:+--retune} "$@" \
    || echo "TPE study stopped (exit $?)"
  local t1=$(date +%s)
  [ -n "${TPE_ONLY:-}" ] && { echo "$spec $phase B$batches TPE again: trials=$n workers=${TPE_WORKERS:-$NGPU} wall_s=$((t1 - t0))" | tee -a "$OUT/sweep_walltime.txt"; return 0; }
  timeout "${SWEEP_LIMIT_S:-200}" python3 -m rtcompile.cli tune "$spec" --phase "$phase" $bflag "$batches" \
    --storage "$db" --workers $((8 * NGPU)) --exhaustive "$@" || echo "exhaustive sweep stopped (exit $?)"
  local t2=$(date +%s)
  echo "$spec $phase B$batches gpus=$NGPU tpe_trials=$n tpe_wall_s=$((t1 - t0)) exhaustive_wall_s=$((t2 - t1))" | tee -a "$OUT/sweep_walltime.txt"
}

_ngpu() { NGPU=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))"); }

step_sweep_decode() {  # two batch buckets of the decode kernel (issue 4)
  _ngpu
  sweep_one examples/order3_16x16.toml decode 256 "${DECODE_FIX[@]}"
  sweep_one examples/order3_16x16.toml decode 32 "${DECODE_FIX[@]}"
}

step_sweep_prefill() {  # two batch buckets of the chunk kernel
  _ngpu
  sweep_one examples/order3_16x16.toml prefill 8 "${CHUNK_FIX[@]}"
  sweep_one examples/order3_16x16.toml prefill 1 "${CHUNK_FIX[@]}"
}

step_tpe_again() {  # the prefill TPE studies again (--retune) against the exhaustive sweeps kept in
  # a stored store (SWEEP_DB, e.g. benchmarks/results/2026-11-30b_h200/sweep.db): valid while the
  # chunk kernel's source hash is the same; TPE_WORKERS workers (default one per GPU)
  _ngpu
  cp "${SWEEP_DB:?set SWEEP_DB}" "$XDG_CACHE_HOME/sweep.db"
  TPE_ONLY=1 sweep_one examples/order3_16x16.toml prefill 8 "${CHUNK_FIX[@]}"
  TPE_ONLY=1 sweep_one examples/order3_16x16.toml prefill 1 "${CHUNK_FIX[@]}"
  python3 benchmarks/gpu_checks.py sweep --storage "sqlite:///$XDG_CACHE_HOME/sweep.db" --out "$OUT/sweep"
  step_finish
}

step_one_worker() {  # the decode B32 TPE study again with one worker, in its own store: the
  # multi-GPU wall-time speed-up (compare with its line in sweep_walltime.txt)
  local t0=$(date +%s)
  timeout 120 python3 -m rtcompile.cli tune examples/order3_16x16.toml --phase decode --decode-batch 32 \
    --storage "sqlite:///$XDG_CACHE_HOME/one_worker.db" --workers 1 --trials 18 "${DECODE_FIX[@]}" \
    > /dev/null || echo "one-worker study stopped (exit $?)"
  echo "one-worker TPE decode B32 18 trials wall_s=$(( $(date +%s) - t0 ))" | tee -a "$OUT/sweep_walltime.txt"
}

step_sweep() {  # everything of issue 4 in one go (about 9 minutes on two GPUs)
  step_sweep_decode
  step_sweep_prefill
  [ "$NGPU" -gt 1 ] && step_one_worker
  step_sweep_report
}

step_sweep_report() {  # the store's studies, TPE against exhaustive, then the first call after a reload
  python3 -m rtcompile.cli tune --list --storage "sqlite:///$XDG_CACHE_HOME/sweep.db" > "$OUT/sweep_list.txt"
  python3 benchmarks/gpu_checks.py sweep --storage "sqlite:///$XDG_CACHE_HOME/sweep.db" --out "$OUT/sweep"
  step_finish
  # first calls after a reload: the tuned entries are found, nothing is tuned, only compiled
  # (an empty Triton cache, so the compile is really paid)
  TRITON_CACHE_DIR="$(mktemp -d)" python3 - <<'EOF' | tee "$OUT/first_call.txt"
import time, torch
t0 = time.perf_counter()
from rtcompile.kernels.triton_fwd import running_tensor_decode_, running_tensor_fwd
H, V, dev, bf = 8, 64, "cuda", torch.bfloat16
def factors(B, T):
    return [torch.randn(B, T, H, 16, device=dev, dtype=bf) for _ in range(2)]
q, k, v = factors(8, 4096), factors(8, 4096), torch.randn(8, 4096, H, V, device=dev, dtype=bf)
g = torch.nn.functional.logsigmoid(torch.randn(8, 4096, H, device=dev))
beta = torch.rand(8, 4096, H, device=dev, dtype=bf)
cache = torch.zeros(256, H, 16, 16, V, device=dev)
idx = torch.arange(256, device=dev, dtype=torch.int32)
qd, kd, vd = factors(256, 1), factors(256, 1), torch.randn(256, 1, H, V, device=dev, dtype=bf)
t1 = time.perf_counter()
running_tensor_fwd(q, k, v, g, beta, l2norm=True, output_final_state=True, mode="chunk")
torch.cuda.synchronize()
t2 = time.perf_counter()
running_tensor_decode_(qd, kd, vd, state_cache=cache, state_indices=idx, l2norm=True)
torch.cuda.synchronize()
t3 = time.perf_counter()
print(f"first chunk call after reload (B8 T4096, empty Triton cache): {t2 - t1:.2f} s; "
      f"first decode call (B256): {t3 - t2:.2f} s; imports and inputs {t1 - t0:.2f} s")
EOF
}

step_confirm() {  # the defaults of 2026-11-30f (the solve in tiles) beside the two before them
  # (rtcompile[diagonal], rtcompile[blocks-ieee]), timing only (`errors` has their error cases):
  # five shapes, ~250 s
  python3 -m rtcompile.cli bench --out "$OUT/bench_confirm" --phase prefill --only o3_16x16_B8 --only o3_32x32_B8 \
    --only o3_64x64_B8 --only o4_16x16x16_B8 --only o2_128_B8 --budget-s 300
}

step_errors() {  # the error cases alone (the prefill bench's budget seldom reaches them): on 2026-11-30f,
  # beside `tests` in the same call, 250 s reached o3 64x64 but not o4 (seven named variants)
  python3 -m rtcompile.cli bench --out "$OUT/bench_error" --phase prefill --only _B2_T256 --budget-s 300
}

step_probes() {  # large-K chunk neighbours, decode designs, the eager call's host time: <= 520 s
  timeout 260 python3 benchmarks/probe_streamed.py --out "$OUT" > "$OUT/probe_streamed.txt" 2>&1 || true
  timeout 200 python3 benchmarks/probe_decode.py --out "$OUT/probe_decode.json" > "$OUT/probe_decode.txt" 2>&1 || true
  timeout 60 python3 benchmarks/probe_host.py > "$OUT/probe_host.txt" 2>&1 || true
  tail -40 "$OUT/probe_streamed.txt" "$OUT/probe_decode.txt" "$OUT/probe_host.txt"
}

step_wy_tiles() {  # wy with the tile solve (CPU-verified only on 2026-11-30f) at K = 256 and o2 64,
  # where wy's row solve made its prepare kernel slow (0.26 ms at C 32): the GPU tests for it, then
  # the probes (~150 s)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "wy or tiles" 2>&1 | tail -3 || true
  timeout 120 python3 benchmarks/probe_streamed.py --widths 16 16 --widths 64 --names default tiles \
    wy-tiles-pf-C16 wy-tiles-pf-C32-w8 wy-tiles-pf-C32-w8-pw4 wy-pf-C32-w8 2>&1 | grep -v Warn || true
  timeout 90 python3 benchmarks/probe_split.py --widths 16 16 --widths 64 --names tiles wy-tiles-pf-C32-w8 \
    2>&1 | grep -v "Warn\|_warn" || true
}

step_three_kernel() {  # the three-kernel form (output_pass + stored_keys, the K = 256 default since
  # 2026-11-30g): its GPU tests, the bench at o3 16x16 beside the two-kernel default before it, and
  # its error cases (~300 s)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "output_pass or output-pass or stored" \
    2>&1 | tail -3 || true
  python3 -m rtcompile.cli bench --out "$OUT/bench_three" --phase prefill --only o3_16x16_B8 --budget-s 150
  python3 -m rtcompile.cli bench --out "$OUT/bench_three_error" --phase prefill --only o3_16x16_B2 --budget-s 100
}

step_segments() {  # the three-kernel form in time segments on side streams, and with the solve in
  # the prepare kernel (wy): their GPU tests, then the default with 2 / 4 / 8 segments and with wy
  # (~120 s; 2026-11-30h: all slower than the default)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "output_pass or segments" \
    2>&1 | tail -3 || true
  timeout 200 python3 benchmarks/probe_streamed.py --widths 16 16 --names default sk-wy sk-wy-pw4 seg2 \
    seg4 seg8 seg4-wy seg4-bv16 2>&1 | grep -v "Warn\|_warn" || true
  timeout 90 python3 benchmarks/probe_split.py --widths 16 16 --names sk-wy seg4 2>&1 | grep -v "Warn\|_warn" || true
}

step_k256() {  # the K = 256 default: its kernels split, the bench beside fla, its error cases, then the
  # kernel tests in 4 processes (pytest-xdist: ../shared/device/wheels.sh pytest-xdist execnet) (~500 s)
  timeout 90 python3 benchmarks/probe_split.py --widths 16 16 --names kg1 kg4 no-tma 2>&1 | grep -v "Warn\|_warn" || true
  python3 -m rtcompile.cli bench --out "$OUT/bench_k256" --phase prefill --only o3_16x16_B8 --budget-s 150 \
    > "$OUT/bench_k256.txt" 2>&1 || true
  python3 -m rtcompile.cli bench --out "$OUT/bench_k256_error" --phase prefill --only o3_16x16_B2 --budget-s 100 \
    > "$OUT/bench_k256_error.txt" 2>&1 || true
  timeout 280 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_kernels.py tests/test_ops.py \
    tests/test_kernel_inputs.py > "$OUT/tests.txt" 2>&1 || true
  tail -3 "$OUT/tests.txt"
  grep -E "o3_16x16_B8_T4096 +(bfloat16 )?(rtcompile|fla)|rtcompile +\||fla +\|" "$OUT/bench_k256.txt" | tail -12 || true
  grep -E "^│ o3_16x16_B2" "$OUT/bench_k256_error.txt" || true
}

step_tma() {  # the state loop through tensor descriptors (tma, CPU-verified only on 2026-11-30h): its GPU
  # tests, probe rows beside the K = 256 default, the split, (~200 s)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "tma or output_pass or stored" \
    2>&1 | tail -3 || true
  timeout 120 python3 benchmarks/probe_streamed.py --widths 16 16 --names default tma tma-w8 tma-s2 tma-bv16 \
    2>&1 | grep -v "Warn\|_warn" || true
  timeout 60 python3 benchmarks/probe_split.py --widths 16 16 --names tma tma-w8 2>&1 | grep -v "Warn\|_warn" || true
}

step_tf32() {  # the K = 256 default with tf32 in the prepare kernel's tile solve (2026-11-30j, offline only:
  # compiled for sm_90 as launched, 5872 -> 3704 instructions; K > 256 has used tf32 with 16-bit inputs
  # since 2026-11-30f, where the bf16 error stayed the same): its GPU test, the split beside the
  # default and its strides, the whole call and its distance from the default's outputs (~200 s)
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "tf32 or tma" 2>&1 | tail -2 || true
  timeout 90 python3 benchmarks/probe_split.py --widths 16 16 --names tf32 tf32-st1 tf32-st4 st1 st4 \
    2>&1 | grep -v "Warn\|_warn" || true
  timeout 90 python3 benchmarks/probe_streamed.py --widths 16 16 --names default tf32 tf32-st4 \
    2>&1 | grep -v "Warn\|_warn" || true
}

step_tuned_bench() {  # the prefill bench again, reading the tuned table (TUNED, or the sweep's)
  RTCOMPILE_TUNED="${TUNED:-$RTCOMPILE_TUNED}" python3 -m rtcompile.cli bench --out "$OUT/bench_tuned" \
    --budget-s 380 --phase prefill
}

step_finish() {  # the sweep database and the tuned table, nothing else of the caches
  cp "$XDG_CACHE_HOME/sweep.db" "$OUT/cache/" 2>/dev/null || true
  cp "$RTCOMPILE_TUNED" "$OUT/cache/" 2>/dev/null || true
}

step_checks() {
  python3 benchmarks/gpu_checks.py bundle --out "$OUT/checks"
  python3 benchmarks/gpu_checks.py regret --out "$OUT/checks"
}

for s in "$@"; do
  "step_${s//-/_}"
done
