"""DLPack both ways (cuda_backend/dlpack.py): `CudaTensor.__dlpack__` / `__dlpack_device__`
and `from_dlpack`.

Every round trip is bit-exact (no arithmetic), so values are compared with equality and
zero-copy is checked by pointer. A counting producer (a DLManagedTensor[Versioned] built with
ctypes over a NumPy buffer, its deleter a ctypes callback that counts) shows the deleter runs
exactly once, when our tensor goes, and never for a capsule that was rejected. Tests that
need host tensors (np.from_dlpack of a tensor) run in fallback mode only; the stream
handshake is checked without a GPU against a stubbed driver call (which streams wait for
which), and on the GPU with PyTorch producers and consumers whose pending writes must be seen.
"""
from __future__ import annotations

import ctypes
import gc

import ml_dtypes
import numpy as np
import pytest

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend import dlpack_abi as abi
from cuda_backend import driver as driver_module
from cuda_backend import streams as streams_module
from cuda_backend.cuda_math import get_cuda_math
from cuda_backend.driver import load_driver
from cuda_backend.errors import (CudaNotAvailableError, DTypeMismatchError,
                                 InvalidArgumentError, InvalidDeviceError, TensorFreedError)
from cuda_backend.tensor import CudaTensor

GPU = load_driver()[0] is not None
needs_fallback = pytest.mark.skipif(GPU, reason="host tensors exist only in fallback mode")
ALL = list(DT)
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 3), (2, 3, 1, 5), (33, 17)]

_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))
_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@pytest.fixture(scope="module")
def m():
    return get_cuda_math()


def values(dtype, shape, rng):
    """Seeded host values of a dtype (bfloat16 as ml_dtypes.bfloat16)."""
    if dtype is DT.BOOL:
        return np.asarray(rng.random(shape) < 0.5)
    if dtype in (DT.INT32, DT.INT64, DT.UINT8):
        return np.asarray(rng.integers(0, 100, shape), dtype.numpy_dtype)
    return np.asarray(rng.standard_normal(shape), dtype.array_dtype)


def bits(a):
    """An array's bytes, for bit-exact comparisons of any dtype."""
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


class Counting:
    """A DLPack producer over host memory (a NumPy array) or any address, that counts the
    calls of its deleter and records the keywords __dlpack__ was called with."""

    def __init__(self, array, *, versioned=True, dl_dtype=None, lanes=1, shape=None,
                 strides=None, offset=0, flags=0, device=(1, 0), ndim=None, data=None,
                 null_shape=False):
        self.array = array
        self.calls = 0
        self.kwargs = []

        @_DELETER
        def deleter(_ptr):
            self.calls += 1
        self.deleter = deleter                  # (the callback must outlive the capsule)
        shp = array.shape if shape is None else shape
        nd = len(shp) if ndim is None else ndim
        self.shape = (ctypes.c_int64 * max(nd, 1))(*shp)
        self.strides = None if strides is None else (ctypes.c_int64 * max(nd, 1))(*strides)
        kind = abi.DLManagedTensorVersioned if versioned else abi.DLManagedTensor
        mt = self.managed = kind()
        dl = mt.dl_tensor
        dl.data = array.ctypes.data if data is None else (data or None)
        dl.byte_offset = offset
        dl.device.device_type, dl.device.device_id = device
        dl.ndim = nd
        code, nbits = dl_dtype or (abi.KDL_FLOAT, array.dtype.itemsize * 8)
        dl.dtype.code, dl.dtype.bits, dl.dtype.lanes = code, nbits, lanes
        if not null_shape:
            dl.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        if self.strides is not None:
            dl.strides = ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64))
        mt.deleter = ctypes.cast(deleter, ctypes.c_void_p).value
        if versioned:
            mt.version.major, mt.version.minor = 1, 0
            mt.flags = flags
        self.name = ctypes.create_string_buffer(
            b"dltensor_versioned" if versioned else b"dltensor")

    def capsule(self):
        # no destructor: a capsule nobody consumed leaks, and nothing calls the deleter
        return _capsule_new(ctypes.addressof(self.managed), ctypes.addressof(self.name), None)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        self.kwargs.append({"stream": stream, "max_version": max_version})
        return self.capsule()

    def __dlpack_device__(self):
        d = self.managed.dl_tensor.device
        return (d.device_type, d.device_id)


def capsule_name(capsule):
    return ctypes.string_at(ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object)(
        ("PyCapsule_GetName", ctypes.pythonapi))(capsule))


# -- our tensors <-> NumPy (fallback mode: tensors are host memory) ----------------------------
@needs_fallback
@pytest.mark.parametrize("dtype", [d for d in ALL if d is not DT.BFLOAT16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_numpy_reads_a_tensor_without_copying(m, dtype, shape):
    rng = np.random.default_rng(1)
    t = m.from_numpy(values(dtype, shape, rng))
    y = np.from_dlpack(t)
    assert y.dtype == dtype.numpy_dtype and y.shape == shape
    assert bits(y) == bits(m.to_numpy(t))
    if t.size:
        assert y.ctypes.data == t.ptr and np.shares_memory(y, t.host_view)
        y.reshape(-1)[-1] = y.reshape(-1)[0]             # a write through NumPy shows in t
        assert bits(m.to_numpy(t).reshape(-1)[-1:]) == bits(y.reshape(-1)[:1])


@needs_fallback
@pytest.mark.parametrize("dtype", [d for d in ALL if d is not DT.BFLOAT16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_numpy_array_becomes_a_tensor_without_copying(m, dtype, shape):
    rng = np.random.default_rng(2)
    x = values(dtype, shape, rng)
    t = cb.from_dlpack(x)
    assert t.dtype is dtype and t.shape == shape and t.on_host
    assert bits(m.to_numpy(t)) == bits(x)
    if x.size:
        assert t.ptr == x.ctypes.data
        x.reshape(-1)[0] = x.reshape(-1)[-1]
        assert bits(m.to_numpy(t).reshape(-1)[:1]) == bits(x.reshape(-1)[-1:])
    # the tensor works as any other
    if dtype.is_floating and x.size:
        np.testing.assert_array_equal(m.to_numpy(t * 2), x * 2)


@needs_fallback
def test_bfloat16_round_trips_through_our_capsules(m):
    x = np.random.default_rng(3).standard_normal((5, 9)).astype(ml_dtypes.bfloat16)
    t = m.from_numpy(x)
    for capsule in (t.__dlpack__(), t.__dlpack__(max_version=(1, 0))):
        r = cb.from_dlpack(capsule)
        assert r.dtype is DT.BFLOAT16 and r.ptr == t.ptr
        assert bits(m.to_numpy(r)) == bits(x)


@needs_fallback
def test_numpy_rejecting_bfloat16_leaves_no_export_behind(m):
    t = m.from_numpy(np.ones(4, ml_dtypes.bfloat16))
    with pytest.raises(Exception) as info:       # NumPy has no DLPack bfloat16
        np.from_dlpack(t)
    assert not isinstance(info.value, SystemError)   # its own error came through
    assert t._exports == 0


@needs_fallback
@pytest.mark.parametrize("max_version, name", [(None, b"dltensor"), ((0, 8), b"dltensor"),
                                               ((1, 0), b"dltensor_versioned"),
                                               ((1, 3), b"dltensor_versioned")])
def test_capsule_kind_follows_max_version(m, max_version, name):
    t = m.from_numpy(np.arange(6, dtype=np.float32))
    capsule = t.__dlpack__(max_version=max_version)
    assert capsule_name(capsule) == name
    assert t._exports == 1
    r = m.from_dlpack(capsule)
    assert capsule_name(capsule) == b"used_" + name
    assert r.ptr == t.ptr
    del capsule, r
    gc.collect()
    assert t._exports == 0


@needs_fallback
def test_an_unconsumed_capsule_releases_its_export(m):
    t = m.from_numpy(np.arange(6, dtype=np.float32))
    for mv in (None, (1, 0)):
        capsule = t.__dlpack__(max_version=mv)
        assert t._exports == 1
        del capsule
        assert t._exports == 0


@needs_fallback
def test_free_while_exported_keeps_the_memory_for_the_consumer(m):
    pool = m.backend.memory_pools[0]
    x = np.arange(4096, dtype=np.float32)
    before = pool.used_bytes()
    t = m.from_numpy(x)
    share = pool.used_bytes() - before
    y = np.from_dlpack(t)
    t.free()
    assert t.is_freed
    with pytest.raises(TensorFreedError):
        m.to_numpy(t)
    assert pool.used_bytes() == before + share       # still held for y
    others = [m.from_numpy(np.full(4096, -1, np.float32)) for _ in range(4)]
    np.testing.assert_array_equal(y, x)              # not reused under y
    with_others = pool.used_bytes()
    del y
    gc.collect()
    assert pool.used_bytes() == with_others - share
    assert len(others) == 4


@needs_fallback
def test_free_of_the_base_of_an_exported_view_waits_for_the_consumer(m):
    pool = m.backend.memory_pools[0]
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    base = m.from_numpy(x)
    view = base[2]
    y = np.from_dlpack(view)
    assert base._exports == 1 and view._exports == 1
    before = pool.used_bytes()
    base.free()
    assert pool.used_bytes() == before
    np.testing.assert_array_equal(y, x[2])
    del y
    gc.collect()
    assert base._exports == 0 and pool.used_bytes() < before


@needs_fallback
def test_copy_true_and_host_device_export(m):
    x = np.arange(10, dtype=np.int64)
    t = m.from_numpy(x)
    y = np.from_dlpack(t, copy=True)
    assert y.ctypes.data != t.ptr
    np.testing.assert_array_equal(y, x)
    capsule = t.__dlpack__(dl_device=(1, 0), copy=False)   # already on the host: no copy
    assert m.from_dlpack(capsule).ptr == t.ptr


# -- the counting producer ---------------------------------------------------------------------
@needs_fallback
@pytest.mark.parametrize("versioned", [True, False])
def test_deleter_runs_once_at_free(versioned):
    x = np.arange(15, dtype=np.float32).reshape(3, 5)
    p = Counting(x, versioned=versioned)
    t = cb.from_dlpack(p)
    assert t.ptr == x.ctypes.data and p.calls == 0
    assert p.kwargs == [{"stream": None, "max_version": abi.MAX_VERSION}]
    np.testing.assert_array_equal(get_cuda_math().to_numpy(t), x)
    t.free()
    assert p.calls == 1
    t.free()
    del t
    gc.collect()
    assert p.calls == 1


@needs_fallback
def test_deleter_runs_once_at_garbage_collection():
    p = Counting(np.ones(8, np.float64))
    t = cb.from_dlpack(p)
    v = t.reshape(2, 4)                  # a view keeps the memory
    del t
    gc.collect()
    assert p.calls == 0
    del v
    gc.collect()
    assert p.calls == 1


@needs_fallback
def test_a_bare_capsule_is_imported_and_renamed():
    p = Counting(np.arange(4, dtype=np.float32), versioned=False)
    capsule = p.capsule()
    t = cb.from_dlpack(capsule)
    assert capsule_name(capsule) == b"used_dltensor"
    with pytest.raises(InvalidArgumentError, match="already consumed"):
        cb.from_dlpack(capsule)
    del t
    gc.collect()
    assert p.calls == 1


@needs_fallback
@pytest.mark.parametrize("case", ["transposed", "reversed", "step", "offset_reversed"])
def test_strides_tensors_cannot_share_are_copied(m, case):
    rng = np.random.default_rng(4)
    base = rng.standard_normal(60).astype(np.float32)
    view = {"transposed": base.reshape(5, 12).T, "reversed": base[::-1],
            "step": base.reshape(6, 10)[:, 1::3],
            "offset_reversed": base.reshape(3, 4, 5)[::-1, :, ::-2]}[case]
    strides = tuple(s // 4 for s in view.strides)         # DLPack strides are in elements
    offset = view.ctypes.data - base.ctypes.data          # element 0 of the view, in bytes
    p = Counting(base, shape=view.shape, strides=strides, offset=offset)
    t = cb.from_dlpack(p)
    assert p.calls == 1                   # copied, and the producer released at once
    np.testing.assert_array_equal(m.to_numpy(t), view)
    q = Counting(base, shape=view.shape, strides=strides, offset=offset)
    with pytest.raises(InvalidArgumentError, match="not C-contiguous"):
        cb.from_dlpack(q, copy=False)
    assert q.calls == 0


@needs_fallback
def test_strides_of_size_one_dims_are_shared(m):
    x = np.arange(12, dtype=np.int32)
    p = Counting(x, dl_dtype=(abi.KDL_INT, 32), shape=(1, 12, 1), strides=(999, 1, -7))
    t = cb.from_dlpack(p, copy=False)
    assert t.ptr == x.ctypes.data and p.calls == 0
    np.testing.assert_array_equal(m.to_numpy(t).reshape(-1), x)


@needs_fallback
def test_read_only_exports_are_copied(m):
    x = np.arange(6, dtype=np.float32)
    p = Counting(x, flags=abi.FLAG_READ_ONLY)
    t = cb.from_dlpack(p)
    assert t.ptr != x.ctypes.data and p.calls == 1
    m.fill(t, 5.0)
    np.testing.assert_array_equal(x, np.arange(6, dtype=np.float32))
    q = Counting(x, flags=abi.FLAG_READ_ONLY)
    with pytest.raises(InvalidArgumentError, match="read-only"):
        cb.from_dlpack(q, copy=False)
    assert q.calls == 0
    ro = np.arange(5, dtype=np.float64)
    ro.flags.writeable = False
    if np.lib.NumpyVersion(np.__version__) >= "2.1.0":   # it flags its versioned export
        assert cb.from_dlpack(ro).ptr != ro.ctypes.data


@needs_fallback
def test_copy_true_always_copies():
    x = np.arange(6, dtype=np.float32)
    p = Counting(x)
    t = cb.from_dlpack(p, copy=True)
    assert t.ptr != x.ctypes.data and p.calls == 1


# -- rejected capsules: typed errors, nothing consumed -----------------------------------------
BAD = {
    "int8": (dict(dl_dtype=(abi.KDL_INT, 8)), DTypeMismatchError, "unsupported DLPack dtype"),
    "complex": (dict(dl_dtype=(5, 64)), DTypeMismatchError, "unsupported DLPack dtype"),
    "two lanes": (dict(lanes=2), DTypeMismatchError, "2 lanes"),
    "metal": (dict(device=(8, 0)), InvalidArgumentError, "kDLMetal"),
    "ndim 65": (dict(shape=(1,) * 65), InvalidArgumentError, "ndim 65"),
    "null shape": (dict(null_shape=True), InvalidArgumentError, "NULL shape"),
    "null data": (dict(data=0), InvalidArgumentError, "NULL data"),
    "negative dim": (dict(shape=(3, -5)), InvalidArgumentError, "negative dimension"),
}


@needs_fallback
@pytest.mark.parametrize("case", list(BAD))
def test_bad_capsules_raise_typed_errors_and_are_not_consumed(case):
    kwargs, error, match = BAD[case]
    p = Counting(np.arange(15, dtype=np.float32).reshape(3, 5), **kwargs)
    capsule = p.capsule()
    with pytest.raises(error, match=match):
        cb.from_dlpack(capsule)
    assert capsule_name(capsule) in (b"dltensor", b"dltensor_versioned")
    assert p.calls == 0
    with pytest.raises(error, match=match):      # through __dlpack__ as well
        cb.from_dlpack(p)


def test_cuda_memory_in_fallback_mode_or_a_device_out_of_range(m):
    p = Counting(np.ones(3, np.float32), device=(2, 1000 if GPU else 0))
    err = InvalidDeviceError if GPU else CudaNotAvailableError
    with pytest.raises(err):
        cb.from_dlpack(p)
    assert p.calls == 0


def test_a_later_dlpack_version_is_refused():
    p = Counting(np.ones(3, np.float32))
    p.managed.version.major = 2
    with pytest.raises(InvalidArgumentError, match="DLPack 2.0"):
        cb.from_dlpack(p)
    assert p.calls == 0


def test_objects_that_are_not_producers():
    with pytest.raises(InvalidArgumentError, match="__dlpack__"):
        cb.from_dlpack([1.0, 2.0])
    name = ctypes.create_string_buffer(b"other")     # (outlives the capsule)
    other = _capsule_new(1234, ctypes.addressof(name), None)
    with pytest.raises(InvalidArgumentError, match="not a DLPack capsule"):
        cb.from_dlpack(other)

    class Liar:
        def __dlpack__(self, **kwargs):
            return "not a capsule"
    with pytest.raises(InvalidArgumentError, match="not a DLPack capsule|returned a str"):
        cb.from_dlpack(Liar())
    with pytest.raises(InvalidArgumentError, match="copy"):
        cb.from_dlpack(np.ones(2), copy="yes")


@pytest.mark.parametrize("kwargs, match", [
    (dict(stream=True), "stream must be"), (dict(stream="1"), "stream must be"),
    (dict(stream=0), "ambiguous|stream must be None or -1"),
    (dict(stream=-2), "not allowed|stream must be None or -1"),
    (dict(max_version=(1,)), "max_version"), (dict(max_version="1.0"), "max_version"),
    (dict(copy="yes"), "copy must be"), (dict(dl_device=(8, 0)), "kDLMetal"),
    (dict(dl_device="cpu"), "dl_device"),
])
def test_bad_export_arguments(m, kwargs, match):
    t = m.from_numpy(np.ones(3, np.float32))
    with pytest.raises(InvalidArgumentError, match=match):
        t.__dlpack__(**kwargs)
    assert t._exports == 0


def test_a_freed_tensor_cannot_be_exported(m):
    t = m.from_numpy(np.ones(3, np.float32))
    t.free()
    with pytest.raises(TensorFreedError):
        t.__dlpack__()


def test_dlpack_device(m):
    t = m.from_numpy(np.ones(3, np.float32))
    assert t.__dlpack_device__() == ((2, 0) if GPU else (1, 0))


# -- the stream handshake, against a stubbed driver call ----------------------------------------
class _FakeStream:
    def __init__(self, handle):
        self.handle = handle


def _device_tensor(host):
    """A tensor labelled device memory over a host buffer (never dereferenced here)."""
    return CudaTensor(host.shape, DT.FLOAT32, 0, host.ctypes.data, owner=host)


@pytest.mark.parametrize("consumer, producer, waits", [
    (None, None, []),                 # both the legacy default stream
    (1, None, []),
    (2, None, [(2, 1)]),
    (0x5000, None, [(0x5000, 1)]),
    (None, 0x7000, [(1, 0x7000)]),
    (0x5000, 0x7000, [(0x5000, 0x7000)]),
    (0x7000, 0x7000, []),             # the same stream
    (-1, 0x7000, []),                 # the consumer asked for no synchronization
])
def test_consumer_stream_waits_for_the_producer_stream(monkeypatch, consumer, producer, waits):
    calls = []
    monkeypatch.setattr(driver_module, "stream_wait_stream", lambda w, p: calls.append((w, p)))
    host = np.zeros((4, 4), np.float32)
    t = _device_tensor(host)
    t.stream = None if producer is None else _FakeStream(producer)
    capsule = t.__dlpack__(stream=consumer, max_version=(1, 0))
    assert calls == waits
    mt = abi.DLManagedTensorVersioned.from_address(
        ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
            ("PyCapsule_GetPointer", ctypes.pythonapi))(capsule, b"dltensor_versioned"))
    dl = mt.dl_tensor
    assert (dl.device.device_type, dl.device.device_id) == (abi.KDL_CUDA, 0)
    assert dl.data == t.ptr and (dl.dtype.code, dl.dtype.bits) == (abi.KDL_FLOAT, 32)


def test_a_view_waits_for_its_base_stream_too(monkeypatch):
    calls = []
    monkeypatch.setattr(driver_module, "stream_wait_stream", lambda w, p: calls.append((w, p)))
    host = np.zeros(8, np.float32)
    base = _device_tensor(host)
    base.stream = _FakeStream(0x7000)
    view = CudaTensor((4,), DT.FLOAT32, 0, base.ptr + 16, owner=base)
    view.stream = _FakeStream(0x8000)
    view.__dlpack__(stream=0x5000)
    assert calls == [(0x5000, 0x8000), (0x5000, 0x7000)]


class _FakePool:
    owner = None


class _FakeBackend:
    """A backend with one 'GPU' whose memory is host memory, for the import's bookkeeping."""
    is_available = True
    device_count = 1
    fallback_reason = None

    def __init__(self):
        self.memory_pools = {0: _FakePool()}


@pytest.mark.parametrize("current", [None, 0x6000])
def test_the_import_passes_this_threads_stream(monkeypatch, current):
    x = np.arange(6, dtype=np.float32)
    p = Counting(x, device=(abi.KDL_CUDA, 0))
    if current is not None:
        class _Block:                     # a `with stream:` block's entry on the stack
            device_id = 0
            pycuda_stream = _FakeStream(current)
        monkeypatch.setattr(streams_module.local_state, "stack", [_Block()], raising=False)
    t = cb.from_dlpack(p, backend=_FakeBackend())
    assert p.kwargs == [{"stream": 1 if current is None else current,
                         "max_version": abi.MAX_VERSION}]
    assert t.ptr == x.ctypes.data and not t.on_host and t.device_id == 0
    assert (t.stream is None) == (current is None)
    t.free()
    assert p.calls == 1


# -- the GPU: PyTorch and CuPy, zero-copy both ways, and the stream handshake ------------------
TORCH_DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "bool"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_gpu_our_capsules_round_trip(m, dtype):
    rng = np.random.default_rng(5)
    x = values(dtype, (37, 3), rng)
    t = m.from_numpy(x)
    for mv in (None, (1, 0)):
        r = m.from_dlpack(t.__dlpack__(max_version=mv))
        assert r.ptr == t.ptr and r.dtype is dtype and not r.on_host
        assert bits(m.to_numpy(r)) == bits(x)


@pytest.mark.gpu
@pytest.mark.parametrize("name", TORCH_DTYPES)
def test_gpu_torch_round_trip_without_copies(m, name):
    torch = pytest.importorskip("torch")
    dtype = DT.from_any(name)
    rng = np.random.default_rng(6)
    x = values(dtype, (19, 7), rng)
    t = m.from_numpy(x)
    pt = torch.from_dlpack(t)
    assert pt.data_ptr() == t.ptr and pt.dtype == getattr(torch, name)
    assert pt.device == torch.device("cuda", t.device_id)
    back = pt.cpu()
    host = (back.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if name == "bfloat16"
            else back.numpy())
    assert bits(host) == bits(x)
    # and back: a tensor torch made, from its fourth row on (an offset pointer)
    src = pt.clone()[3:]
    r = m.from_dlpack(src)
    assert r.ptr == src.data_ptr() and r.shape == tuple(src.shape)
    assert bits(m.to_numpy(r)) == bits(host[3:])


@pytest.mark.gpu
def test_gpu_torch_non_contiguous_is_copied(m):
    torch = pytest.importorskip("torch")
    src = torch.arange(60, dtype=torch.float32, device="cuda").reshape(6, 10)
    for view in (src.t(), src[:, 1::3], src[::2]):
        r = m.from_dlpack(view)
        np.testing.assert_array_equal(m.to_numpy(r), view.cpu().numpy())
        with pytest.raises(InvalidArgumentError, match="not C-contiguous"):
            m.from_dlpack(view, copy=False)


@pytest.mark.gpu
def test_gpu_torch_sees_our_pending_writes(m):
    """We write on a stream of ours behind a long matmul; torch reads on a non-blocking
    stream of its own: the handshake (torch passes its stream) must order the read."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    a = m.from_numpy(rng.standard_normal((4096, 4096)).astype(np.float32))
    m.matrix_multiply(a, a)                           # compiled and tuned outside the timing
    t = m.zeros((1 << 20,), DT.FLOAT32)
    m.backend.synchronize()
    with m.backend.stream() as s:
        m.matrix_multiply(a, a)                       # milliseconds of work ahead of the fill
        m.fill(t, 5.0)
    assert t.stream is s.pycuda_stream
    ts = torch.cuda.Stream()
    with torch.cuda.stream(ts):
        z = torch.from_dlpack(t).clone()
    ts.synchronize()
    assert bool((z == 5).all())


@pytest.mark.gpu
def test_gpu_we_see_torchs_pending_writes(m):
    torch = pytest.importorskip("torch")
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    ts = torch.cuda.Stream()
    with torch.cuda.stream(ts):
        torch.cuda._sleep(100_000_000)               # ~50 ms ahead of the fill, on ts
        x.fill_(5)
        r = m.from_dlpack(x)                         # torch's current stream is ts
    assert (m.to_numpy(r) == 5).all()                # a copy on our (legacy) stream


@pytest.mark.gpu
def test_gpu_free_while_torch_holds_the_memory(m):
    torch = pytest.importorskip("torch")
    pool = m.backend.memory_pools[0]
    x = np.arange(1 << 16, dtype=np.float32)
    before = pool.used_bytes()
    t = m.from_numpy(x)
    share = pool.used_bytes() - before
    pt = torch.from_dlpack(t)
    t.free()
    assert pool.used_bytes() == before + share
    others = [m.from_numpy(np.full(1 << 16, -1, np.float32)) for _ in range(4)]
    np.testing.assert_array_equal(pt.cpu().numpy(), x)
    with_others = pool.used_bytes()
    del pt
    gc.collect()
    assert pool.used_bytes() == with_others - share
    assert len(others) == 4


@pytest.mark.gpu
def test_gpu_deleter_runs_once(m):
    t = m.from_numpy(np.arange(12, dtype=np.float32))
    p = Counting(np.empty(12, np.float32), data=t.ptr, device=(abi.KDL_CUDA, t.device_id))
    r = m.from_dlpack(p)
    assert r.ptr == t.ptr and p.calls == 0
    assert p.kwargs[0]["stream"] == 1
    np.testing.assert_array_equal(m.to_numpy(r), np.arange(12, dtype=np.float32))
    r.free()
    r.free()
    gc.collect()
    assert p.calls == 1


@pytest.mark.gpu
def test_gpu_host_memory_is_copied_to_the_device(m):
    x = np.arange(10, dtype=np.int64)
    t = m.from_dlpack(x)
    assert not t.on_host
    np.testing.assert_array_equal(m.to_numpy(t), x)
    with pytest.raises(InvalidArgumentError, match="host memory"):
        m.from_dlpack(x, copy=False)


@pytest.mark.gpu
def test_gpu_host_copy_export(m):
    if np.lib.NumpyVersion(np.__version__) < "2.1.0":
        pytest.skip("np.from_dlpack(device=) needs NumPy 2.1")
    x = np.random.default_rng(8).standard_normal((5, 3)).astype(np.float32)
    t = m.from_numpy(x)
    y = np.from_dlpack(t, device="cpu")
    np.testing.assert_array_equal(y, x)
    with pytest.raises(BufferError):
        t.__dlpack__(dl_device=(1, 0), copy=False)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["float32", "float16", "int64", "bfloat16"])
def test_gpu_cupy_round_trip_without_copies(m, name):
    cupy = pytest.importorskip("cupy")
    dtype = DT.from_any(name)
    x = values(dtype, (11, 13), np.random.default_rng(9))
    t = m.from_numpy(x)
    try:
        c = cupy.from_dlpack(t)
    except (TypeError, ValueError, BufferError, RuntimeError) as exc:
        if name == "bfloat16":
            pytest.skip(f"this CuPy has no bfloat16: {exc}")
        raise
    assert c.data.ptr == t.ptr
    assert bits(cupy.asnumpy(c)) == bits(x)
    r = m.from_dlpack(c)
    assert r.ptr == c.data.ptr and bits(m.to_numpy(r)) == bits(x)
