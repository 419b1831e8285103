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
run_tool() {
    local t="$1"; shift
    local log="${SANITIZE_LOG_DIR:-/tmp}/sanitize-$t.log"
    echo "== compute-sanitizer --tool $t: $*"
    # Hypothesis examples and large sizes make sanitized runs slow; keep them small.
    # pytest-xdist workers (when installed) are child processes: the sanitizer follows them
    # (--target-processes all) and prints one summary per process.
    local xd=""; python3 -c "import xdist" 2>/dev/null && xd="-n ${SANITIZE_WORKERS:-8}"
    # The bad-input tests provoke CUDA API errors on purpose (out of memory, launch limits):
    # count device-side errors only. The one test that plants an out-of-bounds kernel is
    # marked planted_fault and left out.
    local api=""
    compute-sanitizer --report-api-errors no true >/dev/null 2>&1 && api="--report-api-errors no"
    CUDA_BACKEND_FUZZ=sanitize compute-sanitizer --tool "$t" $api \
        --target-processes all --print-limit 20 --error-exitcode 99 \
        python3 -m pytest -q -p no:cacheprovider $xd --timeout "${SANITIZE_TEST_TIMEOUT:-300}" \
        -m "not multigpu and not planted_fault and not slow and not exclusive" --ignore=tests/test_templates.py \
        "$@" >"$log" 2>&1
    local rc=$?
    grep -E "^(FAILED|ERROR) " "$log" | head -20
    grep -E "passed|failed" "$log" | tail -1
    # one summary line per sanitized process: add them up
    grep -hoE "(ERROR|RACECHECK|SYNCCHECK|INITCHECK) SUMMARY: [0-9]+ (errors?|hazards?)" "$log" |
        awk -v t="$t" '{n += $3; p += 1} END {printf "%s: %d processes, %d errors/hazards in all\n", t, p, n}'
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
