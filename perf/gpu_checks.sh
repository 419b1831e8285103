#!/usr/bin/env bash
# One batched pass over everything that needs a GPU, for a device session of limited time.
#   perf/gpu_checks.sh [stage ...]      stages: core tests tests_heavy tests_rest kc_load kc_save
#   tests_heavy_a tests_heavy_b fuzz bench bench_math multigpu sweep report sanitize memcheck
#   racecheck synccheck initcheck (default: core tests bench). The whole suite no longer fits
#   one 600 s device call: run `kc_load tests_heavy kc_save` in one call and `kc_load
#   tests_rest` in the next; on a cold kernel cache the heavy files need two calls of their
#   own (S19: 570 s were not enough for them): `tests_heavy_a kc_save` (the matmul, matmul
#   backward and linear files), then `kc_load tests_heavy_b` (the other heavy files).
# Writes into ${OUT:-/tmp/gpu-checks}: tests.log, fuzz.log, bench.log, bench_*.json,
# sweep_rows.json, report.tgz, sanitize-<tool>.log. The device tool returns 8 files at most: pick
# stages accordingly. Each stage has its own time limit (TESTS_LIMIT, FUZZ_LIMIT, LIMIT_<tool>)
# so one slow stage cannot eat the run; TEST_ARGS narrows the tests stage.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/gpu-checks}"; mkdir -p "$out"
# the kernel cache holds code this process runs: a per-user folder (the backend refuses one
# that another user owns or can write to)
export PYTHONUNBUFFERED=1 CUDA_BACKEND_CACHE_DIR="${CUDA_BACKEND_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/cuda_backend/kernels}"
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(core tests bench)
T() { timeout "$@"; }
for stage in "${stages[@]}"; do
  case "$stage" in
    core)   # issue 2's own checks first: the cheapest proof that the runtime works
      T 300 python3 -m pytest -q -p no:cacheprovider tests/test_backend_gpu.py tests/test_streams.py \
          2>&1 | tee -a "$out/tests.log" | tail -n 25 ;;
    tests)  # the whole suite: on a GPU machine the unmarked tests (bad input, numerics, leaks,
            # threads...) run on the GPU too; multigpu ones skip on one GPU. The nvcc-only
            # template check and the slow wheel build are CI's.
      xd=""; python3 -c "import xdist" 2>/dev/null && xd="-n ${TEST_WORKERS:-8}"
      T "${TESTS_LIMIT:-540}" python3 -m pytest -q -p no:cacheprovider -m "not slow and not exclusive" \
          $xd --timeout 300 -rfE --ignore=tests/test_templates.py ${TEST_ARGS:-tests} \
          2>&1 | tee -a "$out/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -n 60
      # tests that need the GPU to themselves (fill its memory, read the driver's free memory)
      T 200 python3 -m pytest -q -p no:cacheprovider -m "exclusive" --timeout 180 -rfE tests \
          2>&1 | tee -a "$out/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -n 10 ;;
    tests_heavy|tests_heavy_a|tests_heavy_b|tests_rest)   # the suite in two calls of under
            # 600 s each: the files that compile and autotune most (HEAVY = HEAVY_A + HEAVY_B),
            # then every other one (-n 15 on 16 cores)
      HEAVY_A="test_matmul test_matmul_backward test_linear"
      HEAVY_B="test_conv2d test_conv2d_backward test_optimizers test_graphs test_nn test_indexing
               test_backend_runtime test_host_path"
      case "$stage" in
        tests_heavy_a) files="$HEAVY_A" ;;
        tests_heavy_b) files="$HEAVY_B" ;;
        *) files="$HEAVY_A $HEAVY_B" ;;
      esac
      sel=""
      for f in $files; do
        if [ "$stage" = tests_rest ]; then sel="$sel --ignore=tests/$f.py"; else sel="$sel tests/$f.py"; fi
      done
      [ "$stage" = tests_rest ] && sel="$sel --ignore=tests/test_templates.py tests"
      T "${TESTS_LIMIT:-540}" python3 -m pytest -q -p no:cacheprovider -m "not slow and not exclusive" \
          -n "${TEST_WORKERS:-15}" --timeout 300 -rfE $sel \
          2>&1 | tee -a "$out/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -n 60 ;;
    kc_load)   # a kernel cache saved by kc_save in an earlier call, carried as .kc/kc.tgz
      [ -e .kc/kc.tgz ] && mkdir -p "$CUDA_BACKEND_CACHE_DIR" && \
          tar -xzf .kc/kc.tgz -C "$CUDA_BACKEND_CACHE_DIR" && echo "kernel cache loaded" ;;
    kc_save)   # the kernel cache as $out/kc.tgz (bring it back, carry it as .kc/kc.tgz)
      tar -czf "$out/kc.tgz" -C "$CUDA_BACKEND_CACHE_DIR" . && ls -la "$out/kc.tgz" ;;
    bench)
      T 120 python3 perf/bench_core.py --out "$out/bench_core.json" 2>&1 | tee -a "$out/bench.log"
      T 200 python3 perf/bench_math.py --out "$out/bench_math.json" 2>&1 | tail -n 25 | tee -a "$out/bench.log"
      T 200 python3 perf/bench_matmul.py --out "$out/bench_matmul.json" 2>&1 | tail -n 40 | tee -a "$out/bench.log"
      T 200 python3 perf/bench_ml.py --out "$out/bench_ml.json" 2>&1 | tail -n 25 | tee -a "$out/bench.log"
      T 200 python3 perf/bench_ml_compute.py 2>&1 | tail -n 25 | tee -a "$out/bench.log" ;;
    fuzz)   # issue 7's full fuzzing run: >= 200 hypothesis examples per operation family
      xd=""; python3 -c "import xdist" 2>/dev/null && xd="-n 8"
      CUDA_BACKEND_FUZZ=full T "${FUZZ_LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider $xd \
          --timeout 280 -rfE -k "property" --hypothesis-show-statistics tests \
          2>&1 | tee -a "$out/fuzz.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -n 30
      grep -E "^tests/.*::.*:$|passing, [0-9]+ failing" "$out/fuzz.log" | paste - - | tail -n 30 ;;
    bench_math)   # the CudaMath table alone (copy bandwidth, elementwise, rows, transpose, small call)
      T 200 python3 perf/bench_math.py --out "$out/bench_math.json" 2>&1 | tee -a "$out/bench.log" | tail -n 25 ;;
    multigpu) # issue 6's figures: overlap, matmul split over GPUs, all_reduce (needs 2 GPUs for the last two)
      T 150 python3 perf/bench_multigpu.py 2>&1 | tail -n 25 | tee -a "$out/bench.log" ;;
    report)
      T 580 python3 -m cuda_backend.cli report --out /tmp/cb-report 2>&1 | tail -n 30 | tee -a "$out/bench.log"
      tar -czf "$out/report.tgz" -C /tmp/cb-report . ;;
    sanitize)
      SANITIZE_LOG_DIR=/tmp T 580 perf/sanitize.sh all 2>&1 | tee "$out/sanitize.log" ;;
    memcheck|racecheck|synccheck|initcheck)   # one tool; its full log lands in $out
      lim_var="LIMIT_$stage"; lim="${!lim_var:-${SANITIZE_LIMIT:-580}}"   # e.g. LIMIT_memcheck
      SANITIZE_LOG_DIR="$out" SANITIZE_SHARD_LIMIT=$(( lim - 25 )) \
          T "$lim" perf/sanitize.sh "$stage" 2>&1 | tail -n 25 ;;
    sweep)  # kernel-variant sweeps of the row ops and transpose, and the fused linear layer
      [ -e perf/sweep_rows.py ] && T 200 python3 perf/sweep_rows.py --out "$out/sweep_rows.json" \
          2>&1 | tee -a "$out/bench.log" | tail -n 60
      [ -e perf/bench_linear.py ] && T 120 python3 perf/bench_linear.py --out "$out/bench_linear.json" \
          2>&1 | tee -a "$out/bench.log" | tail -n 20 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
