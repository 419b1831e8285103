"""Fallback mode end to end (a subprocess with CUDA_BACKEND_FALLBACK=1, so it is fallback mode
even on a GPU machine), and CudaTensor basics in-process where this process has no GPU."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from cuda_backend import (CudaDataType, CudaTensor, DTypeMismatchError, FALLBACK_MESSAGE,
                          InvalidArgumentError, TensorFreedError, TransferError)
from cuda_backend.driver import load_driver

REPO = Path(__file__).resolve().parents[1]

E2E_SCRIPT = textwrap.dedent(r'''
    import json, os, sys
    import numpy as np
    import pytest
    import cuda_backend
    from cuda_backend import (CudaDataType, CudaNotAvailableError, DTypeMismatchError,
                              InvalidDeviceError, TensorFreedError, TransferError,
                              get_cuda_backend, from_bfloat16_bits, to_bfloat16_bits)

    backend = get_cuda_backend()
    assert get_cuda_backend() is backend
    assert backend.is_available is False
    assert backend.fallback_reason == "CUDA_BACKEND_FALLBACK is set", backend.fallback_reason
    assert backend.device_count == 0
    assert len(backend.devices) == 1
    host = backend.devices[0]
    assert host.device_id == 0 and "host" in host.name.lower()
    assert host.compute_capability == (0, 0) and host.multiprocessor_count >= 1
    assert backend.get_device_info(0) is host
    assert backend.current_device == 0

    # devices
    backend.set_device(0)
    with pytest.raises(InvalidDeviceError) as info:
        backend.set_device(1)
    msg = str(info.value)
    assert "invalid device id 1" in msg and "device 0" in msg, msg
    assert isinstance(info.value, ValueError)
    for bad in (-1, 2, True):
        with pytest.raises(InvalidDeviceError):
            backend.set_device(bad)
        with pytest.raises(InvalidDeviceError):
            backend.empty(4, device_id=bad)
    with backend.device(0) as dev:
        assert backend.current_device == 0
        t = backend.empty((3,), "float32")
        assert t.device_id == 0
        t.free()
    with pytest.raises(InvalidDeviceError):
        with backend.device(5):
            pass
    backend.synchronize()

    pool = backend.memory_pools[0]
    active0 = pool.get_stats()["active_memory"]

    # round trip of every dtype except bfloat16
    rng = np.random.default_rng(0)
    for dt in CudaDataType:
        if dt is CudaDataType.BFLOAT16:
            continue
        nd = dt.numpy_dtype
        if dt is CudaDataType.BOOL:
            x = rng.random((5, 7)) > 0.5
        elif dt.is_floating:
            x = (rng.standard_normal((5, 7)) * 100).astype(nd)
        else:
            x = rng.integers(0, 100, size=(5, 7)).astype(nd)
        t = backend.to_device(x)
        assert t.dtype is dt and t.shape == (5, 7) and t.nbytes == x.nbytes, (dt, t)
        y = backend.to_host(t)
        assert y.dtype == nd and y.shape == x.shape and np.array_equal(x, y), dt
        # copy_to_device / copy_from_device into existing storage
        x2 = x[::-1].copy()
        backend.copy_to_device(x2, t)
        out = np.empty_like(x2)
        backend.copy_from_device(t, out)
        assert np.array_equal(out, x2), dt
        t.free()

    # bfloat16 through its bit patterns
    xf = np.array([[1.0, -2.5, 3.140625], [0.0, 65280.0, -0.0078125]], np.float32)
    tb = backend.empty(xf.shape, CudaDataType.BFLOAT16)
    assert tb.dtype is CudaDataType.BFLOAT16 and tb.nbytes == xf.size * 2
    backend.copy_to_device(to_bfloat16_bits(xf), tb)
    back = backend.to_host(tb)
    assert back.dtype == np.uint16
    assert np.array_equal(from_bfloat16_bits(back), xf)   # all exactly representable
    with pytest.raises(DTypeMismatchError):
        backend.copy_to_device(xf, tb)                   # float32 into a bfloat16 tensor
    tb.free()

    # mismatched copies are rejected before anything is copied
    t = backend.to_device(np.arange(12, dtype=np.float32).reshape(3, 4))
    with pytest.raises(TransferError) as info:
        backend.copy_to_device(np.full(13, 7, np.float32), t)
    assert "13 elements" in str(info.value) and "12 elements" in str(info.value)
    with pytest.raises(TransferError):
        backend.copy_to_device(np.full(11, 7, np.float32), t)
    with pytest.raises(DTypeMismatchError) as info:
        backend.copy_to_device(np.full((3, 4), 7, np.float64), t)
    assert "float64" in str(info.value) and "float32" in str(info.value)
    with pytest.raises(DTypeMismatchError):
        backend.copy_to_device(np.full((3, 4), 7, np.int32), t)
    with pytest.raises(TransferError):
        backend.copy_from_device(t, np.empty(5, np.float32))
    with pytest.raises(DTypeMismatchError):
        backend.copy_from_device(t, np.empty((3, 4), np.int32))
    with pytest.raises(TransferError):
        backend.copy_from_device(t, [0.0] * 12)
    assert np.array_equal(backend.to_host(t), np.arange(12, dtype=np.float32).reshape(3, 4))

    # raw pointers: capacity is checked
    p = backend.allocate_memory(100)
    with pytest.raises(TransferError):
        backend.copy_to_device(np.zeros(26, np.float32), p)  # 104 bytes > 100
    backend.copy_to_device(np.arange(25, dtype=np.float32), p)
    got = np.empty(25, np.float32)
    backend.copy_from_device(p, got)
    assert np.array_equal(got, np.arange(25, dtype=np.float32))
    backend.free_memory(p)

    # non-contiguous and byte-swapped host arrays
    base = np.arange(48, dtype=np.float64).reshape(6, 8)
    for x in (base[:, ::2], base.T, np.asfortranarray(base), base.astype(">f8"),
              base[::2].astype(">f8")[:, 1::3]):
        t2 = backend.to_device(x)
        assert t2.dtype is CudaDataType.FLOAT64 and t2.shape == x.shape
        y = backend.to_host(t2)
        assert y.dtype == np.float64 and y.dtype.isnative and np.array_equal(x, y)
        t2.free()
    t3 = backend.to_device(np.zeros((6, 4)))
    backend.copy_to_device(base[:, ::2], t3)                          # strided source
    backend.copy_to_device(base[:, ::2].astype(">f8"), t3)            # byte-swapped source
    dst = np.zeros((6, 8))[:, ::2]                                    # strided destination
    backend.copy_from_device(t3, dst)
    assert np.array_equal(dst, base[:, ::2])
    swapped = np.zeros((6, 4), ">f8")                                 # byte-swapped destination
    backend.copy_from_device(t3, swapped)
    assert swapped.dtype == np.dtype(">f8") and np.array_equal(swapped, base[:, ::2])
    t3.free()

    # freed tensors
    t.free()
    t.free()   # no-op
    assert t.is_freed
    for use in (lambda: backend.to_host(t), lambda: backend.copy_to_device(np.zeros(12, np.float32), t),
                lambda: backend.copy_from_device(t, np.zeros(12, np.float32)),
                lambda: t.ptr, lambda: t.host_view, lambda: t.__enter__()):
        with pytest.raises(TensorFreedError) as info:
            use()
        assert "freed" in str(info.value)
    assert pool.get_stats()["active_memory"] == active0, "every tensor above was freed"

    # GPU-only calls
    with pytest.raises(CudaNotAvailableError) as info:
        backend.compile_kernel("k", 'extern "C" __global__ void k() {}')
    assert "fallback mode" in str(info.value)
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(CudaNotAvailableError):
        backend.launch_kernel("k", (1, 1, 1))
    with pytest.raises(CudaNotAvailableError):
        backend.get_kernel("k")
    with pytest.raises(CudaNotAvailableError):
        backend.create_stream()

    # statistics and the report
    stats = backend.get_performance_stats()
    for key in ("kernel_execution_times", "memory_transfer_times", "memory_pools"):
        assert key in stats, key
    assert stats["memory_pools"][0]["allocation_count"] > 0
    json.dumps(stats)
    path = backend.export_performance_report(os.path.join(os.getcwd(), "report.json"))
    with open(path) as f:
        doc = json.load(f)
    for key in ("kernel_execution_times", "memory_transfer_times", "memory_pools",
                "devices", "versions"):
        assert key in doc, key
    assert doc["fallback_mode"] is True
    assert doc["devices"][0]["name"] == host.name
    assert doc["versions"]["cuda_backend"] == cuda_backend.__version__
    assert doc["versions"]["pycuda"] is None or isinstance(doc["versions"]["pycuda"], str)
    assert doc["memory_pools"]["0"]["allocation_count"] == stats["memory_pools"][0]["allocation_count"]
    assert not [n for n in os.listdir(".") if n.startswith(".tmp-")], "temp file left behind"

    # CudaTensor basics in this (fallback) process too
    t = backend.empty((2, 3, 4), "int64")
    assert (t.shape, t.ndim, t.size, t.nbytes) == ((2, 3, 4), 3, 24, 192)
    assert t.strides == np.empty((2, 3, 4), np.int64).strides
    assert repr(t) == "CudaTensor(shape=(2, 3, 4), dtype=int64, device=host)"
    with t as same:
        assert same is t
    assert t.is_freed
    print("FALLBACK-E2E-OK")
''')


def run_fallback_script(script: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["CUDA_BACKEND_FALLBACK"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in
                                        env.get("PYTHONPATH", "").split(os.pathsep) if p])
    path = cwd / "fallback_script.py"
    path.write_text(script)
    return subprocess.run([sys.executable, str(path)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_fallback_end_to_end(tmp_path):
    proc = run_fallback_script(E2E_SCRIPT, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "FALLBACK-E2E-OK"
    # the documented fallback message, logged once, on stderr
    assert FALLBACK_MESSAGE == "PyCUDA not available. CUDA backend will use fallback mode."
    assert proc.stderr.count(FALLBACK_MESSAGE) == 1, proc.stderr
    assert FALLBACK_MESSAGE not in proc.stdout
    assert (tmp_path / "report.json").is_file()


def test_import_alone_does_not_start_the_backend(tmp_path):
    proc = run_fallback_script("import cuda_backend, cuda_backend.kernels\nprint('imported')\n",
                               tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert FALLBACK_MESSAGE not in proc.stderr


# -- in-process CudaTensor tests (this process has no GPU: CI) ------------------------------

needs_fallback = pytest.mark.skipif(
    load_driver()[0] is not None,
    reason="this process has a GPU; fallback mode is covered by the subprocess test")


@pytest.fixture
def fb(backend):
    assert not backend.is_available
    return backend


@needs_fallback
@pytest.mark.parametrize("shape, dtype", [
    ((2, 3), CudaDataType.FLOAT32), ((4,), CudaDataType.FLOAT64), ((2, 0, 3), "int32"),
    ((), "uint8"), ((1, 1, 5, 2), CudaDataType.BFLOAT16), ((3, 5), "bool"), (7, "float16"),
])
def test_tensor_basics(fb, shape, dtype):
    dt = CudaDataType.from_any(dtype)
    t = fb.empty(shape, dt)
    ref = np.empty(shape, dt.numpy_dtype)
    assert t.shape == ref.shape and t.ndim == ref.ndim and t.size == ref.size
    assert t.nbytes == ref.size * dt.itemsize == ref.nbytes
    if ref.size:
        assert t.strides == ref.strides
    assert t.dtype is dt and t.device_id == 0 and t.is_contiguous and not t.is_freed
    assert repr(t) == f"CudaTensor(shape={ref.shape}, dtype={dt.name_str}, device=host)"
    assert t.host_view.shape == ref.shape and t.host_view.dtype == dt.numpy_dtype
    if ref.ndim:
        assert len(t) == ref.shape[0]
    else:
        with pytest.raises(TypeError):
            len(t)
    t.free()
    assert t.is_freed and "freed" in repr(t)
    t.free()  # a second free is a no-op


@needs_fallback
def test_tensor_context_manager_frees(fb):
    pool = fb.memory_pools[0]
    before = pool.get_stats()
    with fb.empty((256, 4), "float32") as t:
        assert pool.get_stats()["active_memory"] == before["active_memory"] + 4096
        t.host_view[...] = 1.0
    assert t.is_freed
    after = pool.get_stats()
    assert after["active_memory"] == before["active_memory"]
    assert after["free_count"] == before["free_count"] + 1
    with pytest.raises(TensorFreedError):
        t.ptr
    with pytest.raises(TensorFreedError):
        with t:
            pass


@needs_fallback
def test_tensor_context_manager_frees_on_error(fb):
    pool = fb.memory_pools[0]
    before = pool.get_stats()["active_memory"]
    with pytest.raises(ZeroDivisionError):
        with fb.empty(100, "float64") as t:
            1 / 0
    assert t.is_freed and pool.get_stats()["active_memory"] == before


@needs_fallback
def test_tensor_data_round_trip_and_views(fb):
    x = np.arange(20, dtype=np.int32).reshape(4, 5)
    t = fb.to_device(x)
    assert np.array_equal(t.host_view, x)
    assert np.array_equal(fb.to_host(t), x)
    assert fb.to_host(t) is not fb.to_host(t)  # a new array every time
    with pytest.raises(InvalidArgumentError):
        t.__cuda_array_interface__              # host memory has no device pointer
    t.free()


@needs_fallback
def test_bad_shapes_and_dtypes(fb):
    for bad in [(-1,), (2, -3), "abc", 2.5j]:
        with pytest.raises(InvalidArgumentError):
            fb.empty(bad)
    with pytest.raises(DTypeMismatchError):
        fb.empty(3, "complex64")
    with pytest.raises(DTypeMismatchError):
        fb.to_device(np.zeros(3, np.uint16))  # bfloat16 bits need an explicit tensor dtype


@needs_fallback
def test_zero_size_tensor(fb):
    t = fb.to_device(np.zeros((0, 4), np.float32))
    assert t.size == 0 and t.nbytes == 0 and t.shape == (0, 4)
    out = fb.to_host(t)
    assert out.shape == (0, 4) and out.dtype == np.float32
    t.free()
    with pytest.raises(TensorFreedError):
        fb.to_host(t)


@needs_fallback
def test_zero_dim_array_keeps_its_shape(fb):
    t = fb.to_device(np.array(3.5))
    assert t.shape == ()


@needs_fallback
def test_copy_into_read_only_array_raises(fb):
    t = fb.to_device(np.ones(4, np.float32))
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    try:
        with pytest.raises(TransferError):
            fb.copy_from_device(t, ro)
        assert not ro.any()
    finally:
        t.free()


@needs_fallback
def test_freed_fallback_tensor_repr_says_host(fb):
    t = fb.empty(3)
    t.free()
    assert repr(t) == "CudaTensor(shape=(3,), dtype=float32, device=host, freed)"


def test_tensor_constructed_directly():
    # CudaTensor does not need a backend: wrap a plain pool block
    from cuda_backend.memory import HostBinnedPool, MemoryPool
    pool = MemoryPool(0, HostBinnedPool())
    block = pool.allocate(24)
    t = CudaTensor((2, 3), CudaDataType.FLOAT32, 0, int(block), block=block, pool=pool)
    assert t.ptr == int(block) and t.nbytes == 24 and t.strides == (12, 4)
    assert repr(t) == "CudaTensor(shape=(2, 3), dtype=float32, device=cuda:0)"
    with t:
        assert pool.get_stats()["active_memory"] == 256
    assert pool.get_stats()["active_memory"] == 0 and pool.get_stats()["free_count"] == 1
    t.free()
    assert pool.get_stats()["free_count"] == 1  # the second free did not free again
