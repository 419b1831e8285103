"""Two or more GPUs: per-device tensors, peer copies, parallel collectives, threads."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import cuda_backend as cb
from cuda_backend import parallel

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


@pytest.fixture(scope="module")
def m():
    from cuda_backend.cuda_math import get_cuda_math
    return get_cuda_math()


def test_seed_multi_gpu_example(backend, m):
    backend.set_device(0)
    t0 = m.create_tensor((1000, 1000))
    backend.set_device(1)
    t1 = m.create_tensor((1000, 1000))
    assert (t0.device_id, t1.device_id) == (0, 1)
    backend.set_device(0)


def test_ops_run_on_operand_device_and_restore_caller(backend, m):
    rng = np.random.default_rng(3977)
    a = rng.standard_normal((257, 129)).astype(np.float32)
    backend.set_device(0)
    x1 = m.from_numpy(a, device_id=1)
    y1 = m.exp(x1)
    assert y1.device_id == 1 and backend.current_device == 0
    np.testing.assert_allclose(m.to_numpy(y1), np.exp(a.astype(np.float64)), rtol=1e-5)
    x0 = m.from_numpy(a, device_id=0)
    with pytest.raises(cb.DeviceMismatchError, match="cuda:0 and cuda:1"):
        m.add(x0, x1)


def test_to_moves_between_devices(backend, m):
    a = np.random.default_rng(4132).standard_normal((1 << 20) + 3).astype(np.float32)
    x0 = m.from_numpy(a, device_id=0)
    x1 = x0.to(1)
    assert x1.device_id == 1
    np.testing.assert_array_equal(m.to_numpy(x1), a)
    np.testing.assert_array_equal(m.to_numpy(m.to_device(x1, 0)), a)


def test_scatter_gather_broadcast_all_reduce(backend, m):
    devs = list(range(backend.device_count))
    rng = np.random.default_rng(9413)
    a = rng.standard_normal((1001, 7)).astype(np.float32)
    parts = parallel.scatter(a, devs)
    assert [p.device_id for p in parts] == devs
    np.testing.assert_array_equal(m.to_numpy(parallel.gather(parts)), a)
    np.testing.assert_array_equal(m.to_numpy(parallel.gather(parts, axis=0, device_id=1)), a)
    copies = parallel.broadcast(parts[0], devs)
    assert [c.device_id for c in copies] == devs
    vals = [rng.standard_normal(12345).astype(np.float32) for _ in devs]
    ts = [m.from_numpy(v, device_id=d) for v, d in zip(vals, devs)]
    parallel.all_reduce(ts, op="sum")
    ref = np.sum(np.stack(vals).astype(np.float64), axis=0)
    for t in ts:
        np.testing.assert_allclose(m.to_numpy(t), ref, rtol=1e-5, atol=1e-5)
    ts = [m.from_numpy(v, device_id=d) for v, d in zip(vals, devs)]
    parallel.all_reduce(ts, op="max")
    for t in ts:
        np.testing.assert_array_equal(m.to_numpy(t), np.max(np.stack(vals), axis=0))


def test_data_parallel_matmul(backend, m):
    devs = list(range(backend.device_count))
    rng = np.random.default_rng(1250)
    a = rng.standard_normal((512, 256)).astype(np.float32)
    w = rng.standard_normal((256, 64)).astype(np.float32)
    shards = parallel.scatter(a, devs)
    ws = parallel.broadcast(m.from_numpy(w, device_id=0), devs)
    outs = parallel.data_parallel(lambda pair: m.matrix_multiply(*pair), list(zip(shards, ws)),
                                  devs)
    got = m.to_numpy(parallel.gather(outs))
    ref = a.astype(np.float64) @ w
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5 * 16


def test_threads_on_two_devices(backend, m):
    errors = []

    def work(tid):
        try:
            dev = tid % 2
            rng = np.random.default_rng(tid)
            for _ in range(50):
                a = rng.standard_normal(4097).astype(np.float32)
                x = m.from_numpy(a, device_id=dev)
                y = m.add(x, x)
                np.testing.assert_array_equal(m.to_numpy(y), a * 2)
                x.free(); y.free()
        except Exception as exc:
            errors.append(exc)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
