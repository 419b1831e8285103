"""Leaks (README.md, Guarantees): thousands of mixed small operations with temporaries
(elementwise, broadcasting, reductions, softmax, transpose, matmul, from_numpy/to_numpy,
explicit and implicit frees, failed calls) leave the pool's active bytes and blocks where they
started, and temporaries do not pile up (bounded peak).

10,000 operations in either mode (the count is chosen by backend.is_available; fallback mode
is fast enough for the full count, about 1.5 s; CUDA_BACKEND_LEAK_OPS overrides it). On a GPU
(`gpu`) also: after free_all_blocks() the driver's free memory (cuMemGetInfo) is back within
1 MiB of where it started, the page-locked pool holds no more blocks than after the warm-up,
and no CUDA streams made during the run stay alive.

Everything allocated once and kept on purpose (the split-reduction ticket counters, one
buffer per device; compiled kernels; autotuner choices) is made by a warm-up over the same
shapes before the baseline is taken.
"""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from cuda_backend import CudaBackendError
from census import live_tensors

GPU_OPS = 10_000
FALLBACK_OPS = 10_000      # about 1.5 s in fallback mode (NumPy), so the full count runs here too
BIG_COPY = 33 << 20          # over the transfer engine's 32 MiB staging threshold (GPU only)
PEAK_SLACK = 64 << 20        # temporaries alive at once, beyond the baseline


@pytest.fixture(scope="module")
def m(backend):
    from cuda_backend.cuda_math import get_cuda_math
    return get_cuda_math()


def op_count(backend) -> int:
    env = os.environ.get("CUDA_BACKEND_LEAK_OPS")
    if env:
        return int(env)
    return GPU_OPS if backend.is_available else FALLBACK_OPS


def usage(pool):
    s = pool.get_stats()
    return s["active_memory"], s["active_blocks"]


class Mix:
    """The operation mix. Each step draws one kind; results are checked against NumPy every
    `check_every` steps (and always during the warm-up)."""

    KINDS = ("chain", "broadcast", "reduce", "argmax", "split_reduce", "softmax", "transpose",
             "matmul", "roundtrip", "free_early", "failed_call", "scalar")

    def __init__(self, m, seed: int, big_copies: bool = False) -> None:
        self.m = m
        self.rng = np.random.default_rng(seed)
        r = np.random.default_rng(12345)
        self.A = r.standard_normal((64, 64)).astype(np.float32)
        self.B = r.standard_normal((64, 64)).astype(np.float32)
        self.row = r.standard_normal(64).astype(np.float32)
        self.long = r.standard_normal(1 << 18).astype(np.float32)
        self.a = m.from_numpy(self.A)
        self.b = m.from_numpy(self.B)
        self.r = m.from_numpy(self.row)
        self.v = m.from_numpy(self.long)
        self.big_copies = big_copies
        self.big = np.ones(BIG_COPY // 4, np.float32) if big_copies else None

    def close(self) -> None:
        for t in (self.a, self.b, self.r, self.v):
            t.free()

    def step(self, kind: str, check: bool) -> None:
        m, A, B = self.m, self.A, self.B
        close = lambda got, ref, tol=1e-5: np.testing.assert_allclose(  # noqa: E731
            got, ref, rtol=tol, atol=tol * 10)
        if kind == "chain":            # temporaries dropped by refcount, never freed by hand
            y = m.exp(m.multiply(m.add(self.a, self.b), 0.25))
            if check:
                close(m.to_numpy(y), np.exp((A + B) * np.float32(0.25)))
        elif kind == "broadcast":
            y = m.maximum(m.subtract(self.a, self.r), 0.0)
            if check:
                close(m.to_numpy(y), np.maximum(A - self.row, 0))
            y.free()
        elif kind == "reduce":
            s = m.reduce_sum(self.a, axis=1)
            mx = m.reduce_max(self.a)
            mean = m.reduce_mean(self.a, axis=0, keepdims=True)
            if check:
                close(m.to_numpy(s), A.sum(axis=1), 1e-4)
                close(m.to_numpy(mx), A.max())
                close(m.to_numpy(mean), A.mean(axis=0, keepdims=True), 1e-4)
            s.free()
            del mx, mean
        elif kind == "argmax":
            i = m.argmax(self.a, axis=1)
            if check:
                np.testing.assert_array_equal(m.to_numpy(i), A.argmax(axis=1))
            i.free()
        elif kind == "split_reduce":   # a long row: several blocks per row on a GPU
            s = m.reduce_sum(self.v)
            if check:
                close(m.to_numpy(s), self.long.astype(np.float64).sum(), 1e-3)
        elif kind == "softmax":
            log = bool(self.rng.random() < 0.5)
            y = m.log_softmax(self.a) if log else m.softmax(self.a)
            if check:
                z = A.astype(np.float64) - A.max(axis=1, keepdims=True)
                ls = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
                close(m.to_numpy(y), ls if log else np.exp(ls), 1e-4)
            y.free()
        elif kind == "transpose":
            with m.matrix_transpose(self.a) as y:
                if check:
                    np.testing.assert_array_equal(m.to_numpy(y), A.T)
        elif kind == "matmul":
            y = m.matrix_multiply(self.a, self.b)
            if check:
                close(m.to_numpy(y), A.astype(np.float64) @ B, 1e-4)
            y.free()
        elif kind == "roundtrip":
            n = int(self.rng.integers(1, 5000))
            h = self.rng.standard_normal(n).astype(np.float32)
            t = m.from_numpy(h)
            back = m.to_numpy(t)
            if check:
                np.testing.assert_array_equal(back, h)
            m.free_tensor(t)
            if self.big_copies and self.rng.random() < 0.002:
                with m.from_numpy(self.big) as t:   # the pinned staging path
                    pass
        elif kind == "free_early":     # a result freed while another result still uses memory
            x = m.add(self.a, 1.0)
            y = m.multiply(x, x)
            x.free()
            if check:
                close(m.to_numpy(y), (A + 1) * (A + 1))
            y.free()
        elif kind == "failed_call":    # errors in the middle of the mix leak nothing
            with pytest.raises(CudaBackendError):
                m.add(self.a, self.v)
            with pytest.raises(CudaBackendError):
                m.matrix_multiply(self.a, self.v)
        elif kind == "scalar":
            y = m.divide(2.0, m.add(self.a, 10.0))
            if check:
                close(m.to_numpy(y), 2.0 / (A + 10))
        else:  # pragma: no cover
            raise AssertionError(kind)

    def warm_up(self) -> None:
        for kind in self.KINDS:
            for _ in range(2):
                self.step(kind, check=True)
        if self.big_copies:
            with self.m.from_numpy(self.big):
                pass

    def run(self, n: int, check_every: int = 50) -> None:
        kinds = self.rng.choice(len(self.KINDS), size=n)
        for i, k in enumerate(kinds):
            self.step(self.KINDS[k], check=(i % check_every == 0))


def test_mixed_operations_leave_active_memory_unchanged(backend, m):
    pool = backend.memory_pools[0]
    mix = Mix(m, seed=7)
    try:
        mix.warm_up()
        gc.collect()
        backend.synchronize()
        baseline = usage(pool)
        pool.reset_peak_stats()
        n = op_count(backend)
        mix.run(n)
        gc.collect()
        backend.synchronize()
        after = usage(pool)
        peak = pool.get_stats()["peak_allocated"]
    finally:
        mix.close()
    assert after == baseline, (
        f"{n} mixed operations: pool (active bytes, blocks) {baseline} -> {after}; "
        f"{live_tensors()}")
    assert peak - baseline[0] < PEAK_SLACK, (
        f"temporaries piled up: peak {peak} bytes against a baseline of {baseline[0]}")


def test_freeing_everything_returns_to_the_start(backend, m):
    """The mix's own tensors and every result, freed: the pool is where it was before the
    mix existed (the ticket counters of the warm-up stay, as designed)."""
    pool = backend.memory_pools[0]
    Mix(m, seed=1).warm_up()           # allocates whatever is kept for good
    gc.collect()
    start = usage(pool)
    mix = Mix(m, seed=2)
    mix.run(200, check_every=10)
    mix.close()
    del mix
    gc.collect()
    assert usage(pool) == start, live_tensors()


class _StreamCounter:
    """Counts live PyCUDA streams made while installed (a counting subclass of drv.Stream,
    so isinstance checks against drv.Stream keep working)."""

    def __init__(self, drv, monkeypatch) -> None:
        counter = self
        self.created = 0
        self.live = 0
        base = drv.Stream

        class CountingStream(base):
            def __init__(self, *args, **kwargs):
                base.__init__(self, *args, **kwargs)
                counter.created += 1
                counter.live += 1

            def __del__(self):
                counter.live -= 1

        monkeypatch.setattr(drv, "Stream", CountingStream)


@pytest.mark.gpu
@pytest.mark.exclusive
def test_driver_memory_pinned_pool_and_streams_come_back(backend, m, monkeypatch):
    import pycuda.driver as drv
    from cuda_backend import streams
    pool = backend.memory_pools[0]
    pinned = backend.pinned
    counter = _StreamCounter(drv, monkeypatch)
    mix = Mix(m, seed=11, big_copies=True)
    try:
        mix.warm_up()
        gc.collect()
        backend.synchronize()
        pool.free_all_blocks()
        with backend.activate(0):
            free0, total = drv.mem_get_info()
        baseline = usage(pool)
        pinned0 = (pinned.active_blocks, pinned.held_blocks)
        live0 = counter.live
        stack0 = len(getattr(streams._local, "stack", None) or [])
        mix.run(op_count(backend))
        gc.collect()
        backend.synchronize()
        after = usage(pool)
        pinned1 = (pinned.active_blocks, pinned.held_blocks)
        pool.free_all_blocks()
        with backend.activate(0):
            free1, _ = drv.mem_get_info()
    finally:
        mix.close()
    assert after == baseline
    assert abs(free1 - free0) <= 1 << 20, (
        f"driver free memory {free0} before, {free1} after free_all_blocks() "
        f"({(free0 - free1) / 2**20:.2f} MiB apart; total {total})")
    assert pinned1[0] == pinned0[0] and pinned1[1] <= pinned0[1], (
        f"page-locked pool (active, held) blocks {pinned0} -> {pinned1}")
    assert counter.live <= live0, (
        f"{counter.live - live0} CUDA streams still alive ({counter.created} made)")
    assert len(getattr(streams._local, "stack", None) or []) == stack0
