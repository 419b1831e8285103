#!/usr/bin/env bash
# Run the GPU tests under NVIDIA compute-sanitizer.
#   perf/sanitize.sh [memcheck|racecheck|synccheck|initcheck|all] [pytest args...]
# memcheck runs the whole `gpu` suite (or the tests given); racecheck and synccheck run the
# tests of the kernels that use shared memory; initcheck the ones that read what they allocate.
# Each tool's summary line ("ERROR SUMMARY: N errors" / "RACECHECK SUMMARY: N hazards") is
# printed at the end; the script fails if any is non-zero.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tool="${1:-all}"; shift || true
SHARED_TESTS="tests/test_transpose.py tests/test_reduce.py tests/test_softmax.py tests/test_matmul.py tests/test_layer_norm.py tests/test_batch_norm.py tests/test_conv2d.py tests/test_flash_attention.py tests/test_pooling.py"
existing() { for f in "$@"; do [ -e "$f" ] && printf '%s ' "$f"; done; }
MARK="not multigpu and not planted_fault and not slow and not exclusive"
run_tool() {
    local t="$1"; shift
    local log="${SANITIZE_LOG_DIR:-/tmp}/sanitize-$t.log"
    local n="${SANITIZE_WORKERS:-8}" dir; dir=$(mktemp -d)
    # The bad-input tests provoke CUDA API errors on purpose (out of memory, launch limits):
    # count device-side errors only. The test that plants an out-of-bounds kernel (marker
    # planted_fault) and those that need the GPU alone (exclusive) are left out.
    # racecheck and synccheck leave out the tests at the issues' full sizes (marker large):
    # the hazards they look for are inside a block, and every config those tests run is also
    # run at small odd sizes
    local mark="$MARK"
    case "$t" in racecheck|synccheck) mark="$MARK and not large" ;; esac
    # Host backtraces off (device ones kept): collecting them holds a reference to the Python
    # frame above each kernel launch for the rest of the process (perf/frames_under_sanitizer.py:
    # 200 of 200 frames kept with the default, 0 with --show-backtrace no), so every tensor a
    # caller held stays allocated and the pool-accounting tests fail for that reason alone.
    local bt="--show-backtrace ${SANITIZE_BACKTRACE:-device}"
    local api=""
    compute-sanitizer --help 2>&1 | grep -q -- "--report-api-errors" && api="--report-api-errors no"
    # The selected tests' node ids, dealt round-robin into n shards: one sanitized pytest per
    # shard (the pytest process only: nvcc and the subprocess tests of tests/test_exit.py,
    # which check interpreter teardown rather than kernels, are not instrumented), the
    # sanitizer's reports in their own files (%p: one per process).
    python3 -m pytest -q -p no:cacheprovider --collect-only -m "$mark" \
        --ignore=tests/test_templates.py --ignore=tests/test_exit.py "$@" 2>/dev/null | grep "::" |
        awk -v n="$n" -v d="$dir" '{ print > (d "/shard" (NR % n)) }'
    echo "== compute-sanitizer --tool $t: $(cat "$dir"/shard* | wc -l) tests in $n shards: $*"
    local to=""; python3 -c "import pytest_timeout" 2>/dev/null && to="--timeout ${SANITIZE_TEST_TIMEOUT:-300}"
    # SANITIZE_GPUS="0 1": deal the shards over these GPUs (CUDA_VISIBLE_DEVICES per shard)
    local gpus=(${SANITIZE_GPUS:-}) i=0
    local pids=() f
    for f in "$dir"/shard*; do
        [ ${#gpus[@]} -gt 0 ] && export CUDA_VISIBLE_DEVICES="${gpus[$((i % ${#gpus[@]}))]}"
        i=$((i + 1))
        # SANITIZE_SHARD_LIMIT: stop a shard with SIGINT (pytest then reports what ran and
        # the sanitizer its summary) before an outer time limit would kill everything
        CUDA_BACKEND_FUZZ=sanitize CUDA_BACKEND_AUTOTUNE_REPEATS=1 timeout -s INT -k 20 "${SANITIZE_SHARD_LIMIT:-7200}" \
            compute-sanitizer --tool "$t" $api $bt \
            --target-processes application-only --print-limit 20 --error-exitcode 99 \
            --log-file "$f.cs-%p.txt" \
            python3 perf/pytest_shard.py "$f" -q -p no:cacheprovider --durations=5 $to >"$f.out" 2>&1 &
        pids+=($!)
    done
    local rc=0 p
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    { for f in "$dir"/shard*.out; do echo "--- $f"; cat "$f"; done
      for f in "$dir"/*.cs-*; do echo "--- $f"; cat "$f"; done; } >"$log" 2>&1
    grep -hE "^(FAILED|ERROR) " "$dir"/shard*.out | head -20
    grep -hE "[0-9]+ (passed|failed)" "$dir"/shard*.out | tail -n "$n"
    # one summary line per sanitized process: add them up
    grep -hoE "(ERROR|RACECHECK|SYNCCHECK|INITCHECK) SUMMARY: [0-9]+ (errors?|hazards?)" \
        "$dir"/*.cs-* 2>/dev/null |
        awk -v t="$t" '{n += $3; p += 1} END {printf "%s: %d processes, %d errors/hazards in all\n", t, p, n}'
    rm -rf "$dir"
    return $rc
}
status=0
case "$tool" in
    memcheck) run_tool memcheck "${@:-tests}" || status=1 ;;
    racecheck|synccheck) run_tool "$tool" "${@:-$(existing $SHARED_TESTS)}" || status=1 ;;
    initcheck) run_tool initcheck "${@:-$(existing tests/test_reduce.py tests/test_softmax.py tests/test_transpose.py)}" || status=1 ;;
    all)
        run_tool memcheck "${@:-tests}" || status=1
        for t in racecheck synccheck; do run_tool "$t" $(existing $SHARED_TESTS) || status=1; done
        run_tool initcheck $(existing tests/test_reduce.py tests/test_softmax.py tests/test_transpose.py) || status=1 ;;
    *) echo "unknown tool $tool"; exit 2 ;;
esac
exit $status
