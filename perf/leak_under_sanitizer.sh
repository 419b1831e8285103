#!/usr/bin/env bash
# Why the leak test fails only under compute-sanitizer: the same test under memcheck with
# pytest's unraisable-exception and warnings plugins on and off, warnings summary shown.
#   [BT="--show-backtrace device"] perf/leak_under_sanitizer.sh [ops]
# (perf/sanitize.sh passes --show-backtrace device: host backtraces keep the frames alive)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
T=tests/test_leaks.py::test_mixed_operations_leave_active_memory_unchanged
export CUDA_BACKEND_LEAK_OPS="${1:-300}"
cs() { compute-sanitizer --tool memcheck --report-api-errors no --target-processes application-only ${BT:-} "$@"; }
for variant in "" "-p no:unraisableexception" "-p no:warnings" "-W ignore"; do
    echo "== memcheck, pytest $variant"
    cs python3 -m pytest -q -p no:cacheprovider -rw $variant "$T" 2>&1 |
        grep -E "passed|failed|live tensors|Warning|Exception ignored|SUMMARY" | cut -c1-700 | head -12
done
