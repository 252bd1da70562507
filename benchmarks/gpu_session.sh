# The measurements of one GPU session, in steps that each fit one 10-minute device call.
#
#   bash benchmarks/gpu_session.sh STEP...      STEP: owed | large | solve | stepped | retime | tests | train (= traintests traintime) | recalltests | recallcompile | tunetrain | trainfla | trainexp | sweep | bench | tunedecode | tunelarge | model | modelbf16 | serving | tpe | splitoutput | rowgate | onnxcpu | profiletrain | profileprefill | profiledecode | checks | recall
#
# Run from the project root on the device machine after installing the carried wheels (see
# benchmarks/README.md). Everything lands under $OUT. Each step writes as it goes, so a call cut
# at its limit keeps what it measured.
set -euo pipefail
: "${OUT:?set OUT (the device tool sets it)}"
export RTCOMPILE_COMMIT="${RTCOMPILE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
# A cache of its own, so no tuned table of an earlier call changes which configs run.
export XDG_CACHE_HOME="${XDG_CACHE_HOME_RUN:-/tmp/rtcompile-run-cache}"
mkdir -p "$XDG_CACHE_HOME"

step_tests() {  # the kernel tests on the GPU: 217 took ~305 s in one process on an H200, 294 took
  # 129 s in four (PYTEST_ARGS="-n 4", with pytest-xdist and execnet carried). -v into a file, not
  # a pipe: a hung compile then still leaves its log; faulthandler prints the stack of a test
  # still running after 60 s. TESTS overrides the file list.
  timeout -s INT -k 30 500 python3 -m pytest -v -p no:cacheprovider -o faulthandler_timeout=60 --durations=10 ${PYTEST_ARGS:-} \
    ${TESTS:-tests/test_kernels.py tests/test_ops.py tests/test_kernel_inputs.py} > "$OUT/tests.txt" 2>&1 || true
  tail -5 "$OUT/tests.txt"
}

step_train() { step_traintests; step_traintime; }

step_traintests() {  # the backward on the GPU: gradient tests (-v into a file as it goes: a 170 s limit
  # cut the config sweep short on 2026-12-01), then forward + backward timings; fla last and in a
  # process of its own (its first K = 256 backward compiled and autotuned for over 3 minutes)
  timeout -s INT -k 30 "${TRAIN_TEST_S:-300}" python3 -m pytest -v -p no:cacheprovider -n "${TEST_WORKERS:-14}" \
    tests/test_backward.py tests/test_backward_streamed.py tests/test_backward_kept.py tests/test_autograd.py tests/test_extreme_decay.py tests/test_decode_guard.py \
    tests/test_generate.py tests/test_conventions.py tests/test_call_plan.py \
    > "$OUT/train_tests.txt" 2>&1 || true
  echo "passed $(grep -c PASSED "$OUT/train_tests.txt") failed $(grep -c FAILED "$OUT/train_tests.txt")"
  grep -E "^FAILED|^ERROR" "$OUT/train_tests.txt" | head -20 || true
}

step_traintime() {  # the forward + backward timings alone on the GPU (a recall run beside them would skew them)
  python3 benchmarks/train_step.py --out "$OUT/train_ours.json"
  # the former default up to K = 256 (chunks of 64): 3.23 ms but 1029 MiB at o3 16x16 against the
  # tuned default's 2.35 ms and 1221 MiB on 2026-12-02 (fla 1064): the memory-bound user's choice
  python3 benchmarks/train_step.py --set chunk_size=64 --set grads_warps=8 --set grads_stages=1 --set num_stages=2 \
    --set prepare_warps=4 --cases "o3 16x16,o2 64,o2 128" --out "$OUT/train_ours_c64.json"
  # the split gradients kernels (grads_split, in the tuner's space): 15-24% faster above K = 256 at
  # 2.5-2.9x the memory on 2026-12-02; key blocks of 64 gained nothing (3.48 ms at o3 16x16 against 3.07)
  python3 benchmarks/train_step.py --set grads_split=True --set factor_grads=workspace \
    --cases "o3 16x16,o3 32x32,o4 16x16x16" --out "$OUT/train_ours_split.json"
}

step_trainexp() {  # issue 19's head-to-head (~5 min): the default beside fla in one process -- fla's
  # first K = 256 backward compiled and autotuned for ~220 s on 2026-12-02, so it goes first with
  # most of the call (o3 16x16 at 95f8c83: ours 2.07 ms / 965 MiB, fla 3.73 ms / 1064 MiB) -- then
  # the default at the other K <= 256 cases
  timeout "${FLA_S:-420}" python3 benchmarks/train_step.py --fla --cases "o3 16x16" --out "$OUT/train_fla.json" || true
  python3 benchmarks/train_step.py --cases "o2 64,o2 128,o2 256" --out "$OUT/train_ours_small.json"
  # above K = 256 phi's gradients stored by the one-pass kernel (since 1a0b4e1) against the default's
  # two register passes: offline (probe_offline.py --backward, Triton 3.6, sm_90) at o3 32x32 the
  # gradients kernel has 4464 instructions, 256 B of spills, against 6224 and 392 B; the last
  # measurement (fad70b3, the two-pass stored kernel) was 25.5 against 14.4 ms
  python3 benchmarks/train_step.py --cases "o3 32x32,o4 16x16x16" --out "$OUT/train_ours_large.json"
  python3 benchmarks/train_step.py --set factor_grads=workspace --cases "o3 32x32,o4 16x16x16" \
    --out "$OUT/train_ours_large_stored.json"
}

step_tunetrain() {  # issue 19's speed (TUNE_SPEC / TUNE_CASE for another shape, e.g.
  # examples/order3_32x32.toml / "o3 32x32"): the tuner's train bucket (forward + backward timed together, every
  # trial's gradients checked against float64) at the benchmark's shape, then the timings with its
  # winner (train_step.py reads the tuned table from this step's cache) beside the default's
  timeout "${TUNE_S:-420}" python3 -m rtcompile.cli tune "${TUNE_SPEC:-examples/order3_16x16.toml}" --phase train --batch 8 \
    --seq-len 4096 --seconds "${TUNE_BUDGET_S:-330}" --workers 4 --storage "sqlite:///$OUT/tune_train.db" \
    > "$OUT/tune_train.txt" 2>&1 || true
  tail -n 15 "$OUT/tune_train.txt"
  python3 benchmarks/train_step.py --cases "${TUNE_CASE:-o3 16x16}" --out "$OUT/train_tuned.json"
}

step_trainfla() {  # fla's forward + backward at K = 256 in a call of its own: its first backward
  # compiled and autotuned for over 3 minutes on 2026-12-01, which would push `train` past a call
  timeout "${FLA_S:-500}" python3 benchmarks/train_step.py --fla --cases "o3 16x16" --out "$OUT/train_fla.json" || true
}

step_sweep() {  # the backward's config sweep on the GPU alone: its configs compile five kernels per
  # shape each (none of 23 finished in 240 s beside other tests on 2026-12-01), so one call of its own
  timeout -s INT -k 30 "${SWEEP_S:-540}" python3 -m pytest -v -p no:cacheprovider -n "${TEST_WORKERS:-8}" \
    tests/test_backward.py -k "gpu_config_sweep or default_config_above" --junitxml "$OUT/sweep.xml" > "$OUT/sweep.txt" 2>&1 || true
  echo "passed $(grep -c PASSED "$OUT/sweep.txt") failed $(grep -c FAILED "$OUT/sweep.txt")"
  grep -E "^FAILED|^ERROR" "$OUT/sweep.txt" | head -20 || true
  # each config's worst gradient error (record_property) for the results file
  python3 -c "import sys, xml.etree.ElementTree as E; [print(c.get('name'), *(p.get('name') + '=' + p.get('value') for p in c.iter('property'))) for c in E.parse(sys.argv[1]).iter('testcase')]" "$OUT/sweep.xml" || true
}

step_tunedecode() {  # issue 22's decode rows (>= 0.90 of a copy at K 256 B256, >= 0.85 at K 1024 B32):
  # the tuner's decode bucket at those batches, then the bench's decode phase with its tables
  # (the bench's rtcompile rows take the tuned table of this step's cache, as a user's calls do)
  for spec in examples/order3_16x16.toml examples/order3_32x32.toml; do
    timeout "${TUNE_S:-200}" python3 -m rtcompile.cli tune "$spec" --phase decode --decode-batch 32,256 \
      --seconds "${TUNE_BUDGET_S:-150}" --workers 4 --storage "sqlite:///$OUT/tune_decode.db" \
      > "$OUT/tune_decode_$(basename "$spec" .toml).txt" 2>&1 || true
    tail -n 8 "$OUT/tune_decode_$(basename "$spec" .toml).txt"
  done
  python3 -m rtcompile.cli bench --out "$OUT/bench_decode_tuned" --phase decode --budget-s 60
}

step_tunelarge() {  # issue 22's K > 256 rows (o3 32x32 1.31 ms against 0.67; 64x64 5.26 against
  # 2.7): the tuner's prefill study over the whole space at B8 T4096 (streamed, fused and the
  # other forms that run K 1024; no recorded prefill study there), LARGE_SPEC for another spec;
  # the table's best against the default, both re-measured by the tuner
  local spec="${LARGE_SPEC:-examples/order3_32x32.toml}"
  timeout -s INT "${TUNE_S:-540}" python3 -m rtcompile.cli tune "$spec" --phase prefill --batch 8 --seq-len 4096 \
    --seconds "${TUNE_BUDGET_S:-420}" --workers 4 --storage "sqlite:///$OUT/tune_large.db" \
    > "$OUT/tune_large_$(basename "$spec" .toml).txt" 2>&1 || true
  tail -n 8 "$OUT/tune_large_$(basename "$spec" .toml).txt"
}

step_modelbf16() {  # issue 21's B256 decode (>= 1.2 M tokens/s): the example model with a bf16 state
  # cache (the spec's state_dtype; 134 MB of fp32 state per layer at B256 is 147 of the fused
  # step's 248 us in kernels on 2026-12-02), decode only, beside the fp32 cache's rows
  sed 's/^state_dtype = "float32"/state_dtype = "bfloat16"/' examples/order3_16x16.toml > /tmp/order3_16x16_bf16state.toml
  grep -q 'state_dtype = "bfloat16"' /tmp/order3_16x16_bf16state.toml
  python3 -m rtcompile.cli bench --model /tmp/order3_16x16_bf16state.toml --only decode --out "$OUT/bench_model_bf16state"
}

step_tpe() {  # issue 22's tuner must-show at two shapes: an exhaustive sweep, then TPE studies of
  # ~20% of the sub-space with three seeds (tpe_check.py). o2 64 repeats session 24's sub-space
  # (loop x wy x parts x stride = 48, the rest at the Gluon default's: B1 was 18% off before the
  # neighbour warm starts of ec7e264); o3 16x8 materialised is the second shape (the same fields
  # plus output_warps: 144). TPE_SHAPES picks one ("o2" or "o3"); TPE_SEEDS the studies per bucket;
  # TPE_ROUNDS the interleaved rounds re-timing the picks beside the sweep's best (each time gated as a trial)
  local fixed="--fix form=split --fix split.chunk_size=32 --fix split.block_v=64 --fix split.num_warps=4
    --fix split.num_stages=3 --fix split.solve=tiles --fix split.dot_precision=ieee --fix split.output_block_v=64
    --fix split.tma=true --fix split.key_group=1 --fix split.phi_pass=false --fix split.unroll_solve=false"
  if [[ "${TPE_SHAPES:-o2 o3}" == *o2* ]]; then
    timeout -s INT "${TPE_S:-280}" python3 benchmarks/tpe_check.py examples/order2_matrix.toml --batch 1,8 --seq-len 4096 \
      $fixed --fix split.prepare_warps=2 --fix split.output_warps=4 --fix split.materialise=false \
      --trials 10 --seeds "${TPE_SEEDS:-3}" --rounds "${TPE_ROUNDS:-5}" --workers 4 --out "$OUT/tpe_o2_64" || true
  fi
  if [[ "${TPE_SHAPES:-o2 o3}" == *o3* ]]; then
    sed -e 's/^order = 2/order = 3/' -e 's/^key_widths = \[64\]/key_widths = [16, 8]/' -e 's/^name = .*/name = "order3-16x8"/' \
      examples/order2_matrix.toml > /tmp/order3_16x8.toml
    grep -q 'key_widths = \[16, 8\]' /tmp/order3_16x8.toml
    timeout -s INT "${TPE_S:-280}" python3 benchmarks/tpe_check.py /tmp/order3_16x8.toml --batch 1,8 --seq-len 4096 \
      $fixed --fix split.prepare_warps=1 --fix split.materialise=true \
      --trials 29 --seeds "${TPE_SEEDS:-3}" --rounds "${TPE_ROUNDS:-5}" --workers 4 --out "$OUT/tpe_o3_16x8" || true
  fi
}

step_onnxcpu() {  # the ONNX graphs' mixer bodies (chunk-parallel prefill, one-token decode) against
  # the token Scan they replaced, onnxruntime on this host's CPUs, beside the torch reference
  # (~2 min; no GPU used)
  python3 benchmarks/onnx_cpu.py --seq-len 128,512,2048,8192 --skip-scan-above 2048 2>&1 | grep -v Warning \
    | tee "$OUT/onnx_cpu.txt"
  python3 benchmarks/onnx_cpu.py --batch 8 --seq-len 512 2>&1 | grep -v Warning | tail -n 2 | tee -a "$OUT/onnx_cpu.txt"
}

step_splitoutput() {  # which split output tiles are wrong at chunks of 64, behind the Triton and Gluon
  # loops (~4-5 min, 80 cases in processes of their own, eight at once; the first failure again
  # under compute-sanitizer): SplitConfig.check refuses fewer than 64 columns on one key axis at K >= 32
  timeout -s INT "${SPLITOUT_S:-400}" python3 benchmarks/diagnose_split_output.py --jobs 8 --sanitize > "$OUT/split_output.txt" 2>&1 || true
  cat "$OUT/split_output.txt"
}

step_rowgate() {  # the tuner's per-row gate (ROW_TOLERANCE, 5x the global, set on the CPU) on every
  # chunk proposal at B2 T2048 H8, bf16 and fp32, against the float64 loop (~1-2 min with compiles)
  python3 benchmarks/gpu_checks.py rowgate --out "$OUT/checks"
}

step_bench() {  # decode first (~60 s), so the prefill phase cannot starve it of budget
  python3 -m rtcompile.cli bench --out "$OUT/bench_decode" --phase decode --budget-s 60
  python3 -m rtcompile.cli bench --out "$OUT/bench_prefill" --phase prefill --budget-s 460
}

step_owed() {  # what the H200 is still owed, in one call (~6 min): issue 21's decode rows with the
  # fused layer step (B256 fp32 >= 1.2 M tokens/s, last timed on an H100 only), issue 22's decode
  # fractions under the batch rule (H100 only so far), and the decode kernel's access-pattern
  # ceiling (decode_ceiling.py; H100: 0.945-0.958 of a copy, the kernel 0.929)
  timeout 240 python3 -m rtcompile.cli bench --model examples/order3_16x16.toml --only decode \
    --out "$OUT/bench_model_decode" > "$OUT/model_decode.txt" 2>&1 || true
  tail -n 12 "$OUT/model_decode.txt"
  timeout 150 python3 -m rtcompile.cli bench --out "$OUT/bench_decode" --phase decode --budget-s 60 \
    > "$OUT/decode.txt" 2>&1 || true
  tail -n 12 "$OUT/decode.txt"
  timeout 120 python3 benchmarks/decode_ceiling.py > "$OUT/decode_ceiling.txt" 2>&1 || true
  cat "$OUT/decode_ceiling.txt"
  # K 1024 B32 (0.72 of a copy on the H200, target 0.85): the [1024, 32] tile at 16 warps, the
  # default there since the slab-size rule (H100: 0.845 against 0.805 for [1024, 16]), beside it
  timeout 100 python3 benchmarks/decode_ceiling.py --widths 32 32 --batches 32 > "$OUT/decode_ceiling_1024.txt" 2>&1 || true
  cat "$OUT/decode_ceiling_1024.txt"
}

step_solve() {  # the tile solve unrolled (unroll_solve) at the tile-solve defaults not yet measured
  # with it (o3 32x16, o2 128, o3 8x8, o3 16x8, o3 64x64), and the two defaults that have it (o3
  # 32x32, 16x16) without it (~4 min; at 6fe2f0a on an H100: 0.988 / 0.974 of the rolled solve)
  (cd benchmarks && timeout 300 python3 compare_kron.py --solve --rounds 2 --profile --out "$OUT/solve.json" \
    > "$OUT/solve.txt" 2>&1) || true
  grep -E "^o[234]" "$OUT/solve.txt" || tail -n 5 "$OUT/solve.txt"
}

step_stepped() {  # issue 22's K 4096 rows with the chunk loop on the host (loop="stepped": two
  # chunk-parallel launches a chunk instead of one program an SM walking the state's tiles). o3
  # 64x64's default since 2026-12-07 from B1 on an H100 (0.920 ms against 4.005 for the
  # sequential kernel); B8 is owed: at 9516cfa a 400 s B8 run spent all of it compiling and
  # checking 5 of its 7 configs (a second process, the cache warm, did all 7 at B1 in 140 s).
  # So: o3 64x64 at B8, every proposal checked and compiled in processes of their own at once
  # (--jobs), then timed; should that fail, the default beside the sequential kernel alone. Then
  # order 4 (its default still the sequential kernel)
  (cd benchmarks && timeout 300 python3 compare_kron.py --stepped --only 64x64 --rounds 2 --jobs 6 \
    --out "$OUT/stepped.json" > "$OUT/stepped.txt" 2>&1) || true
  grep -E "^o[234]" "$OUT/stepped.txt"; grep -qE "^o[234].* ms \(" "$OUT/stepped.txt" || { tail -n 5 "$OUT/stepped.txt"
    (cd benchmarks && timeout 240 python3 compare_kron.py --stepped --only 64x64 --rounds 2 --pick loop=triton \
      --out "$OUT/stepped.json" > "$OUT/stepped_serial.txt" 2>&1) || true
    grep -E "^o[234]" "$OUT/stepped_serial.txt" || tail -n 5 "$OUT/stepped_serial.txt"; }
  (cd benchmarks && timeout 200 python3 compare_kron.py --stepped --only 16x16x16 --rounds 2 --jobs 3 \
    --out "$OUT/stepped_o4.json" > "$OUT/stepped_o4.txt" 2>&1) || true
  grep -E "^o[234]" "$OUT/stepped_o4.txt" || tail -n 5 "$OUT/stepped_o4.txt"
}

step_large() {  # issue 22's K > 256 rows on sm_90 (~3 min on an H100): the streamed Gluon kernel's
  # float64 tests on the GPU (74 passed on an H100 at 5a2e90b), then its default at o3 32x32 / 32x16
  # beside the Triton kernel, its loads-ahead switch and SCORES_ON_CHIP (H100, 5a2e90b: see
  # compare_kron's GLUON_LARGE comment)
  timeout -s INT -k 20 240 python3 -m pytest -q -p no:cacheprovider tests/test_streamed_gluon.py \
    > "$OUT/large_tests.txt" 2>&1 || true
  tail -n 3 "$OUT/large_tests.txt"
  (cd benchmarks && timeout 300 python3 compare_kron.py --gluon-large --rounds 2 --profile --out "$OUT/gluon_large.json" \
    > "$OUT/gluon_large.txt" 2>&1) || true
  grep "^o3" "$OUT/gluon_large.txt" || tail -n 5 "$OUT/gluon_large.txt"
}

step_retime() {  # the H200's K <= 256 table re-run (~6 min): the defaults beside fla with the tf32
  # solve products they have had since 2026-12-06 (the H200 table is f79a8bd's, ieee products;
  # H100: 0.985-0.994x). compare_loops.py compares configs with each other only, so the Gluon
  # loop's float64 tests (their tf32 rows among them) run first on the same GPU.
  timeout -s INT -k 20 200 python3 -m pytest -q -p no:cacheprovider tests/test_split_gluon.py \
    > "$OUT/retime_tests.txt" 2>&1 || true
  tail -n 3 "$OUT/retime_tests.txt"
  timeout 330 python3 benchmarks/compare_loops.py > "$OUT/compare_loops.txt" 2>&1 || true
  tail -n 14 "$OUT/compare_loops.txt"
}

step_model() {  # the whole model (issue 21): prefill tokens/s at B1, B8 T4096 and CUDA-graph decode
  # tokens/s at B1, B32, B256, ours (plain and torch.compile-fused step) and fla's mixer (K = 256)
  # in the same run; then the eager T = 1 paths' time per call (public API, decode_, fla)
  python3 -m rtcompile.cli bench --model examples/order3_16x16.toml --out "$OUT/bench_model"
  python3 benchmarks/serving_host.py --rounds 3 --out "$OUT/serving_host.json"
}

step_serving() {  # issue 21's table in one call (~7 min on 2026-12-02): the model bench (prefill, the
  # CUDA-graph decode steps, fla's mixer) and the eager T = 1 calls, the bf16 state cache's decode
  # rows, then the first call after load with and without the bundle's compiled kernels
  step_model
  step_modelbf16
  timeout 240 python3 benchmarks/gpu_checks.py first_call --out "$OUT/checks" || true
}

step_profiletrain() {  # issue 19's large-K rows (13-15x our forward; target 3.5x): where forward +
  # backward's time goes per kernel at the default configs, K 256 (C 32 default), 1024 and 4096
  for w in "16 16" "32 32" "16 16 16"; do
    timeout 150 python3 benchmarks/profile_backward.py --widths $w > "$OUT/profile_train_${w// /x}.txt" 2>&1 || true
    tail -n 12 "$OUT/profile_train_${w// /x}.txt"
  done
}

step_profileprefill() {  # issue 22's rows that miss (K <= 128 against fla, large K): the forward's
  # kernel split at the default configs
  for w in "64" "8 8" "128" "16 8" "16 16" "32 32" "64 64" "16 16 16"; do
    timeout 60 python3 benchmarks/profile_backward.py --forward --widths $w 2>&1 | tail -n 7 || true
  done
}

step_profiledecode() {  # where the CUDA-graph decode step's time goes (issue 21: B1 <= 80 us, B256 >= 1.2 M
  # tokens/s): per-kernel time of the plain, stacked and compiled steps at B1 and B256
  timeout "${PROFILE_S:-300}" python3 benchmarks/profile_decode.py --out "$OUT/profile_decode.json" || true
}

step_checks() {  # the bundle on the Triton kernels vs ONNX Runtime, then the planner's regret
  python3 benchmarks/gpu_checks.py bundle --out "$OUT/checks"
  python3 benchmarks/gpu_checks.py first_call --out "$OUT/checks"
  python3 benchmarks/gpu_checks.py regret --out "$OUT/checks"
  python3 benchmarks/replay_host_rule.py "$OUT/checks/regret.json"  # host + device against max(host, device)
}

step_recall() {  # issue 23's comparison: order 2 vs order 3 at matched parameters on MQAR (d_model
  # 128, 2 layers, 256 tokens, 16 pairs, vocabulary 1024, tied head). On 2026-12-02 order 3 left
  # the plateau at chance only at step ~4000 of an 8000-step schedule at lr 1e-3 (0.995, early stop
  # at 4800); 3e-3 stayed at chance for 8000 steps, 1e-2 reached 0.38; order 2 stayed at chance at
  # 3e-3 and 1e-2 (benchmarks/RESULTS.md). Two points in two worker processes on the one GPU, the
  # rates in turn: order 2 runs 2 x 8000 steps (~20 ms a step beside the other point). The store
  # sits under $OUT, so a call cut at its limit brings back the points it finished.
  # RECALL_TARGET=auto measures the speeds on the GPU first (about a minute more) instead of the model.
  timeout "${RECALL_S:-570}" python3 -m rtcompile.cli explore examples/mqar_d128.toml --orders 2,3 --widths 16 \
    --recall --target "${RECALL_TARGET:-h200}" --match params --steps "${RECALL_STEPS:-8000}" --lrs "${RECALL_LRS:-1e-3,1e-2}" \
    --vocab "${RECALL_VOCAB:-1024}" --seq-len 256 --kv-pairs 16 --batch-size 64 --workers 2 \
    --out "$OUT/explore" --storage "sqlite:///$OUT/explore.db" || true
}

step_recallcompile() {  # the trainer's compile_backend experiment: the same 1000 steps of order 3 16x16
  # (lr 1e-3) eager and through inductor, side by side on the GPU (so each sees the other's load);
  # wall_s of each, compile included. Runs beside `recall` in one call.
  timeout "${RECALLC_S:-400}" python3 benchmarks/recall_probe.py curve --steps 1000 --lr 1e-3 \
    > "$OUT/recallcompile_eager.txt" 2>&1 &
  timeout "${RECALLC_S:-400}" python3 benchmarks/recall_probe.py curve --steps 1000 --lr 1e-3 --compile inductor \
    > "$OUT/recallcompile_inductor.txt" 2>&1 &
  wait
  tail -n 1 "$OUT"/recallcompile_*.txt
}

step_recalltests() {  # one call's worth: the recall comparison (its trainings leave the GPU mostly
  # idle) with the gradient tests and the config sweep beside it, as the first call of 2026-12-02
  # ran them (recall 2 x 4000 steps, 307 tests and the sweep, within 600 s). No timings here.
  RECALL_S="${RECALL_S:-550}" step_recall > "$OUT/recall.log" 2>&1 &
  local recall=$!
  TRAIN_TEST_S="${TRAIN_TEST_S:-280}" TEST_WORKERS="${TEST_WORKERS:-8}" step_traintests
  SWEEP_S="${SWEEP_S:-220}" TEST_WORKERS=6 step_sweep
  wait "$recall" || true
  tail -n 8 "$OUT/recall.log"
}

for s in "$@"; do
  declare -F "step_$s" > /dev/null || {  # the steps listed from the functions, so none is missing
    echo "gpu_session.sh: unknown step '$s' ($(declare -F | sed -n 's/^declare -f step_//p' | paste -sd, | sed 's/,/, /g'))" >&2
    exit 2
  }
  "step_$s"
done
