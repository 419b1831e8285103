"""Example counts for the hypothesis property tests.

`examples(n)` is n in the everyday run; with `CUDA_BACKEND_FUZZ=full` (the fuzzing run,
`perf/gpu_checks.sh fuzz`) it is at least 200, and with `CUDA_BACKEND_FUZZ=sanitize` (runs under
compute-sanitizer) at most 3.
"""
import os

MODE = os.environ.get("CUDA_BACKEND_FUZZ", "")


def examples(n: int) -> int:
    if MODE == "full":
        return max(n, 200)
    if MODE == "sanitize":
        return min(n, 3)
    return n
