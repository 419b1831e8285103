"""`CudaMath.benchmark_operations`: quick per-operation timings in the documented API's format.

Times come from the package's timing primitive (performance/timing.py): on the GPU CUDA
events around each call after one warm-up call, the L2 flushed before each; in fallback mode
the host clock. For the full comparison against peers use `cuda-backend report`.
"""
from __future__ import annotations

import statistics
from typing import Any, Dict, Sequence, Tuple

import numpy as np

from .errors import InvalidArgumentError


def _free(out: Any) -> None:
    if hasattr(out, "free"):
        out.free()


def benchmark_operations(m: Any, sizes: Sequence[Tuple[int, ...]],
                         iterations: int = 20) -> Dict[str, Dict[Any, Dict[str, float]]]:
    """{operation: {size: {"average_time_ms", "median_time_ms", "min_time_ms",
    "gflops" or "gbps"}}} for vector_add, relu, sigmoid, reduce_sum, softmax,
    matrix_transpose and matrix_multiply on float32 inputs of each 2-D size."""
    if iterations < 1:
        raise InvalidArgumentError(f"iterations must be >= 1, got {iterations}")
    shapes = []
    for size in sizes:
        shape = tuple(int(s) for s in size)
        if len(shape) != 2:
            raise InvalidArgumentError(f"sizes must be (rows, cols) pairs, got {size!r}")
        shapes.append(shape)
    from .performance.timing import make_timer
    timer = make_timer(m.backend, m.backend.current_device, flush_l2=True)
    try:
        return _run(m, sizes, shapes, iterations, timer)
    finally:
        timer.close()


def _run(m: Any, sizes: Sequence[Tuple[int, ...]], shapes: Sequence[Tuple[int, int]],
         iterations: int, timer: Any) -> Dict[str, Dict[Any, Dict[str, float]]]:
    rng = np.random.default_rng()
    results: Dict[str, Dict[Any, Dict[str, float]]] = {}
    for size, shape in zip(sizes, shapes):
        rows, cols = shape
        n = rows * cols
        a = m.from_numpy(rng.standard_normal(shape, dtype=np.float32))
        b = m.from_numpy(rng.standard_normal(shape, dtype=np.float32))
        bt = m.from_numpy(rng.standard_normal((cols, rows), dtype=np.float32))
        cases = {
            "vector_add": (lambda: m.vector_add(a, b), ("gbps", 3 * 4 * n)),
            "relu": (lambda: m.relu(a), ("gbps", 2 * 4 * n)),
            "sigmoid": (lambda: m.sigmoid(a), ("gbps", 2 * 4 * n)),
            "reduce_sum": (lambda: m.reduce_sum(a), ("gbps", 4 * n)),
            "softmax": (lambda: m.softmax(a), ("gbps", 2 * 4 * n)),
            "matrix_transpose": (lambda: m.matrix_transpose(a), ("gbps", 2 * 4 * n)),
            "matrix_multiply": (lambda: m.matrix_multiply(a, bt), ("gflops", 2 * rows * rows * cols)),
        }
        for name, (fn, (unit, amount)) in cases.items():
            times = timer.time(fn, warmup=1, iterations=iterations, release=_free)
            avg = statistics.fmean(times)
            med = statistics.median(times)
            entry = {"average_time_ms": avg, "median_time_ms": med, "min_time_ms": min(times)}
            entry[unit] = amount / (med * 1e-3) / 1e9 if med > 0 else 0.0
            results.setdefault(name, {})[size] = entry
        for t in (a, b, bt):
            t.free()
    return results
