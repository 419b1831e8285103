"""Threads (README.md, Guarantees): 8 threads x 1,000 operations on one device, every result checked
against NumPy; the same across two GPUs where present (`multigpu`); tensors made in one thread
and freed in another. Every join is bounded (a deadlock fails the test with the stuck threads'
stacks instead of hanging), no thread may raise, and the pool's active bytes come back.

Fallback mode runs fewer operations per thread (the NumPy path is not what is under test
there, the Python-level locking and pool accounting are). The GIL switch interval is shortened
while the threads run, so that thread switches land inside the library's critical sections.
"""
from __future__ import annotations

import gc
import queue
import sys
import threading
import time
import traceback

import numpy as np
import pytest
from census import live_tensors

N_THREADS = 8
GPU_OPS = 1_000
FALLBACK_OPS = 300
JOIN_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def m(backend):
    from cuda_backend.cuda_math import get_cuda_math
    return get_cuda_math()


@pytest.fixture
def fast_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


def usage(pool):
    s = pool.get_stats()
    return s["active_memory"], s["active_blocks"]


def ops_per_thread(backend) -> int:
    return GPU_OPS if backend.is_available else FALLBACK_OPS


def one_op(m, rng, dev: int, i: int) -> None:
    """One operation on fresh operands of device dev, checked against NumPy."""
    kind = i % 9
    n = int(rng.integers(1, 3000))
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    x = m.from_numpy(a, device_id=dev)
    y = m.from_numpy(b, device_id=dev)
    try:
        if kind == 0:
            r = m.add(x, y)
            np.testing.assert_array_equal(m.to_numpy(r), a + b)
        elif kind == 1:
            r = m.multiply(x, 3.0)
            np.testing.assert_array_equal(m.to_numpy(r), a * np.float32(3.0))
        elif kind == 2:
            r = m.exp(m.maximum(x, y))      # a temporary dropped by refcount
            np.testing.assert_allclose(m.to_numpy(r), np.exp(np.maximum(a, b)), rtol=1e-5)
        elif kind == 3:
            r = m.reduce_sum(x)
            np.testing.assert_allclose(m.to_numpy(r), a.astype(np.float64).sum(),
                                       rtol=1e-4, atol=1e-3)
        elif kind == 4:
            r = m.reduce_max(x)
            assert m.to_numpy(r) == a.max()
        elif kind == 5:
            r = m.softmax(x)
            z = np.exp(a.astype(np.float64) - a.max())
            np.testing.assert_allclose(m.to_numpy(r), z / z.sum(), rtol=1e-4, atol=1e-7)
        elif kind == 6:
            rows = max(1, n // 7)
            A = np.resize(a, rows * 7).reshape(rows, 7)   # n may be < 7: repeat a
            t = m.from_numpy(A, device_id=dev)
            r = m.matrix_transpose(t)
            np.testing.assert_array_equal(m.to_numpy(r), A.T)
            t.free()
        elif kind == 7:
            k = 16
            A = rng.standard_normal((8, k)).astype(np.float32)
            B = rng.standard_normal((k, 5)).astype(np.float32)
            ta, tb = m.from_numpy(A, device_id=dev), m.from_numpy(B, device_id=dev)
            r = m.matrix_multiply(ta, tb)
            np.testing.assert_allclose(m.to_numpy(r), A.astype(np.float64) @ B, rtol=1e-4,
                                       atol=1e-4)
            ta.free()
            tb.free()
        else:
            r = m.argmax(x)
            assert int(m.to_numpy(r)) == int(np.argmax(a))
        assert r.device_id == dev
        r.free()
    finally:
        x.free()
        y.free()


def warm_up(m, devices) -> None:
    rng = np.random.default_rng(0)
    for dev in devices:
        for i in range(18):
            one_op(m, rng, dev, i)


def run_threads(targets, timeout: float = JOIN_TIMEOUT_S):
    """Start every target at once (a barrier), join each with a deadline; returns the
    list of (thread name, formatted exception) the threads raised."""
    errors = []
    barrier = threading.Barrier(len(targets))

    def wrap(fn, *args):
        def body():
            try:
                barrier.wait(timeout=60)
                fn(*args)
            except BaseException:  # noqa: BLE001 - reported to the main thread
                errors.append((threading.current_thread().name, traceback.format_exc()))
        return body

    threads = [threading.Thread(target=wrap(fn, *args), name=f"worker-{i}", daemon=True)
               for i, (fn, args) in enumerate(targets)]
    for t in threads:
        t.start()
    deadline = timeout
    t0 = time.monotonic()
    for t in threads:
        t.join(max(0.0, deadline - (time.monotonic() - t0)))
    stuck = [t for t in threads if t.is_alive()]
    if stuck:
        frames = sys._current_frames()
        stacks = "\n".join(f"--- {t.name} ---\n" + "".join(traceback.format_stack(frames[t.ident]))
                           for t in stuck if t.ident in frames)
        pytest.fail(f"{len(stuck)} thread(s) still running after {timeout:.0f} s "
                    f"(deadlock?):\n{stacks}")
    return errors


def _check_errors(errors) -> None:
    assert not errors, f"{len(errors)} thread(s) raised:\n" + "\n".join(
        f"--- {name} ---\n{tb}" for name, tb in errors[:3])


def test_eight_threads_one_device(backend, m, fast_switching):
    pool = backend.memory_pools[0]
    warm_up(m, [0])
    gc.collect()
    start = usage(pool)
    n = ops_per_thread(backend)
    done = [0] * N_THREADS

    def work(tid):
        rng = np.random.default_rng(100 + tid)
        for i in range(n):
            one_op(m, rng, 0, i + tid)
            done[tid] += 1

    errors = run_threads([(work, (tid,)) for tid in range(N_THREADS)])
    _check_errors(errors)
    assert done == [n] * N_THREADS
    gc.collect()
    assert usage(pool) == start, (
        f"pool usage did not come back after the threads: {start} -> {usage(pool)}; "
        f"{live_tensors()}")


def test_tensors_freed_by_another_thread(backend, m, fast_switching):
    """Producers make tensors, consumers compute with them and free them (and let results
    go by refcount): blocks go back to the pool from threads that did not allocate them."""
    pool = backend.memory_pools[0]
    warm_up(m, [0])
    gc.collect()
    start = usage(pool)
    n = ops_per_thread(backend)
    q: "queue.Queue" = queue.Queue(maxsize=64)
    producers = N_THREADS // 2

    def produce(tid):
        rng = np.random.default_rng(200 + tid)
        for _ in range(n):
            a = rng.standard_normal(int(rng.integers(1, 2000))).astype(np.float32)
            q.put((a, m.from_numpy(a)), timeout=60)
        q.put(None, timeout=60)

    def consume(tid):
        finished = 0
        while finished < 1:
            item = q.get(timeout=60)
            if item is None:
                finished += 1
                continue
            a, t = item
            r = m.multiply(m.add(t, t), 0.5)   # the inner temporary goes by refcount
            np.testing.assert_array_equal(m.to_numpy(r), a)
            t.free()

    targets = [(produce, (i,)) for i in range(producers)] + \
              [(consume, (i,)) for i in range(N_THREADS - producers)]
    errors = run_threads(targets)
    _check_errors(errors)
    assert q.empty()
    gc.collect()
    assert usage(pool) == start, (
        f"pool usage did not come back after the threads: {start} -> {usage(pool)}; "
        f"{live_tensors()}")


def test_device_blocks_in_threads(backend, m, fast_switching):
    """`with backend.device(0):` and set_device(0) in many threads at once; each thread's
    current device is its own, and it ends where it started."""
    n = max(50, ops_per_thread(backend) // 10)

    def work(tid):
        rng = np.random.default_rng(300 + tid)
        for i in range(n):
            with backend.device(0):
                assert backend.current_device == 0
                one_op(m, rng, 0, i)
            backend.set_device(0)
        assert backend.current_device == 0

    _check_errors(run_threads([(work, (tid,)) for tid in range(N_THREADS)]))


@pytest.mark.gpu
@pytest.mark.multigpu
def test_eight_threads_two_devices(backend, m, fast_switching):
    pools = [backend.memory_pools[0], backend.memory_pools[1]]
    warm_up(m, [0, 1])
    gc.collect()
    start = [usage(p) for p in pools]
    n = ops_per_thread(backend)

    def work(tid):
        rng = np.random.default_rng(400 + tid)
        for i in range(n):
            dev = (tid + i) % 2          # every thread uses both devices, alternating
            one_op(m, rng, dev, i)

    _check_errors(run_threads([(work, (tid,)) for tid in range(N_THREADS)]))
    gc.collect()
    assert [usage(p) for p in pools] == start
