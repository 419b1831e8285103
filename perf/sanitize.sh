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
    CUDA_BACKEND_FUZZ=sanitize compute-sanitizer --tool "$t" \
        --target-processes all --print-limit 20 --error-exitcode 99 \
        python3 -m pytest -q -x -p no:cacheprovider -m "gpu and not multigpu" "$@" >"$log" 2>&1
    local rc=$?
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY|INITCHECK|passed|failed" "$log" | tail -5
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
