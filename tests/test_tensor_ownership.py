"""Tensors are bound to the backend that made them: operators (a + b, a @ b, a.T, -a, a * 2),
.numpy() and .to() run on the backend of the tensor's pool and the CudaMath registered for it
(the first one made for that backend), never on the process-wide one.

Two extra backends (CudaBackend() twice) with a CudaMath on the second: results come from the
second backend's pool (its statistics change; the first's and the process backend's do not)
and match NumPy. Runs on the GPU (marked `gpu`: two backends share the device, each with its
own pool) and in fallback mode.
"""
from __future__ import annotations

import numpy as np
import pytest

from cuda_backend import CudaBackend, InvalidDeviceError, TensorFreedError, get_cuda_backend
from cuda_backend import tensor_math
from cuda_backend.driver import load_driver

needs_fallback = pytest.mark.skipif(
    load_driver()[0] is not None,
    reason="this process has a GPU: the fallback variant runs only without one")


@pytest.fixture(scope="module", params=[pytest.param("gpu", marks=pytest.mark.gpu),
                                        pytest.param("cpu", marks=needs_fallback)])
def env(request):
    from cuda_backend.cuda_math import CudaMath, get_cuda_math
    glob = get_cuda_math()          # the process backend and its math exist first
    b1, b2 = CudaBackend(), CudaBackend()
    m2 = CudaMath(b2)
    assert m2.gpu == (request.param == "gpu")
    assert b1 is not glob.backend and b2 is not glob.backend and b1 is not b2
    assert b1.memory_pools[0] is not b2.memory_pools[0]
    return glob, b1, b2, m2


def counts(*backends):
    return [b.memory_pools[0].get_stats()["allocation_count"] for b in backends]


OPS = {
    "a + b": (lambda a, b: a + b, lambda x, y: x + y),
    "a @ b": (lambda a, b: a @ b, lambda x, y: x @ y),
    "a.T": (lambda a, b: a.T, lambda x, y: x.T),
    "-a": (lambda a, b: -a, lambda x, y: -x),
    "a * 2": (lambda a, b: a * 2, lambda x, y: x * 2),
    "2 - a": (lambda a, b: 2 - a, lambda x, y: 2 - x),
}


@pytest.mark.parametrize("op", list(OPS))
def test_operators_use_the_tensors_backend(env, op):
    glob, b1, b2, m2 = env
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 48)).astype(np.float32)
    y = rng.standard_normal((48, 48)).astype(np.float32)
    a, b = m2.from_numpy(x), m2.from_numpy(y)
    assert a._pool is b2.memory_pools[0] and a._pool.owner is b2
    assert tensor_math.math_of(a) is m2
    ours, ref = OPS[op]
    ours(a, b).free()               # compiles (GPU) and makes the op's plan
    b2.synchronize()
    before = counts(glob.backend, b1, b2)
    out = ours(a, b)
    after = counts(glob.backend, b1, b2)
    assert out._pool is b2.memory_pools[0]
    assert after[:2] == before[:2], f"{op} allocated from another backend's pool"
    assert after[2] > before[2]
    np.testing.assert_allclose(out.numpy(), ref(x.astype(np.float64), y.astype(np.float64)),
                               rtol=1e-4, atol=1e-4)
    for t in (out, a, b):
        t.free()


def test_backend_without_math_gets_one_made_and_registered(env):
    glob, b1, b2, m2 = env
    a = b1.to_device(np.arange(6, dtype=np.float32))
    before = counts(glob.backend, b2)
    out = a + a
    assert out._pool is b1.memory_pools[0]
    assert counts(glob.backend, b2) == before
    m1 = tensor_math.math_of(a)
    assert m1.backend is b1 and m1 is not glob and m1 is not m2
    assert tensor_math.math_of(out) is m1          # made once, then reused
    np.testing.assert_array_equal(out.numpy(), 2 * np.arange(6, dtype=np.float32))
    out.free(), a.free()


def test_first_math_made_for_a_backend_wins(env):
    from cuda_backend.cuda_math import CudaMath
    glob, b1, b2, m2 = env
    other = CudaMath(b2)
    a = m2.from_numpy(np.ones(4, np.float32))
    assert tensor_math.math_of(a) is m2 and other is not m2
    a.free()


def test_to_and_numpy_use_the_tensors_backend(env, monkeypatch):
    glob, b1, b2, m2 = env
    a = m2.from_numpy(np.arange(4, dtype=np.float32))
    assert a.to(0) is a
    np.testing.assert_array_equal(a.numpy(), np.arange(4, dtype=np.float32))
    seen = []
    real = b2.copy_to_tensor_device

    def spy(t, dev, *args, **kw):
        seen.append((t, dev))
        return real(t, dev, *args, **kw)
    monkeypatch.setattr(b2, "copy_to_tensor_device", spy)
    dev = b2.device_count + 7                          # no such device on any machine
    with pytest.raises(InvalidDeviceError):
        a.to(dev)
    assert seen == [(a, dev)]
    a.free()


def test_freed_and_poolless_tensors(env):
    glob, b1, b2, m2 = env
    a = m2.from_numpy(np.ones(4, np.float32))
    a.free()
    with pytest.raises(TensorFreedError):
        a + a
    with pytest.raises(TensorFreedError):
        a.numpy()
    with pytest.raises(TensorFreedError):
        a.to(1)
    z = m2.create_tensor((0, 3))                       # zero-size: no pool block
    assert z._pool is None
    assert tensor_math.math_of(z).backend is get_cuda_backend()
    assert (z + z).shape == (0, 3)
