"""The runtimes behind `CudaBackend` (cuda_backend/runtime.py): the host runtime driven through
the interface on any machine, the fallback backend's messages through it, the CUDA runtime on
the stubbed driver of perf/bench_host_path.py (tests/test_host_path.py's harness), and the
shape of the split (backend.py does not branch on is_available; modules and functions stay
small).

Copies are exact (memmove of whole elements), so the host runtime's results are compared
with the NumPy arrays bit for bit.
"""
from __future__ import annotations

import ast
import inspect
import os

import numpy as np
import pytest

from cuda_backend import runtime as rt
from cuda_backend.driver import load_driver
from cuda_backend.dtypes import CudaDataType
from cuda_backend.errors import (CudaNotAvailableError, InvalidDeviceError, InvalidPointerError,
                                 TransferError)
from cuda_backend.runtime_cuda import CudaRuntime
from cuda_backend.runtime_host import HostRuntime, host_copy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = load_driver()[0] is not None
needs_fallback = pytest.mark.skipif(GPU, reason="checks fallback mode (this process has a GPU)")
REASON = "no GPU in this test"


def require_message(what: str, reason: str = REASON) -> str:
    """CudaNotAvailableError's message (unchanged from the backend's fallback branches)."""
    return f"{what} needs a CUDA GPU, but the backend is in fallback mode ({reason})"


@pytest.fixture
def host():
    return HostRuntime(REASON, owner=None)


def abstract_names() -> set:
    return set(rt.Runtime.__abstractmethods__)


# -- the interface ----------------------------------------------------------------------
@pytest.mark.parametrize("cls", [HostRuntime, CudaRuntime])
def test_each_runtime_implements_the_whole_interface(cls):
    assert issubclass(cls, rt.Runtime) and not cls.__abstractmethods__
    for name in abstract_names():
        assert name in vars(cls), f"{cls.__name__} inherits {name} instead of implementing it"
        if name != "device_count":
            got = inspect.signature(getattr(cls, name))
            want = inspect.signature(getattr(rt.Runtime, name))
            assert list(got.parameters) == list(want.parameters), (cls.__name__, name)
    init = inspect.getsource(cls.__init__)
    for name in ("validate", "current_device", "direct"):      # the per-call paths
        assert name in vars(cls) or f"self.{name} = " in init, (cls.__name__, name)


def test_host_devices_and_contexts(host):
    assert host.is_gpu is False and host.reason == REASON and host.device_count == 0
    assert len(host.devices) == 1 and host.devices[0].device_id == 0
    assert list(host.memory_pools) == [0]
    for part in ("drv", "contexts", "pinned", "transfers", "compiler", "launcher"):
        assert getattr(host, part) is None, part
    for ok in (0, np.int32(0), np.int64(0)):
        assert host.validate(ok) == 0
        host.set_device(ok)
        with host.device(ok) as dev:
            assert dev == 0 and host.current_device() == 0
    for bad in (1, -1, True, 0.0, "0", None, np.int16(0)):
        with pytest.raises(InvalidDeviceError):
            host.validate(bad)
        with pytest.raises(InvalidDeviceError):
            host.set_device(bad)
        with pytest.raises(InvalidDeviceError):
            host.device(bad)
    with host.activate(0):
        pass
    host.synchronize(None)
    host.synchronize(0)
    assert host.direct(0) is False and host.driver_version() is None
    host.set_profiler(object())     # nothing to time
    host.wait_for_foreign_stream(1, 0)   # the legacy default stream: already in order


@pytest.mark.parametrize("what, call", [
    ("context", lambda h: h.context(0)),
    ("can_access_peer", lambda h: h.can_access_peer(0, 0)),
    ("enable_peer_access", lambda h: h.enable_peer(0, 1)),
    ("wait_for_foreign_stream", lambda h: h.wait_for_foreign_stream(2, 0)),
    ("compile_kernel", lambda h: h.compile("k", "", None, None, None, None)),
    ("get_kernel", lambda h: h.get_kernel("k", 5)),
    ("launch_kernel", lambda h: h.launch("k", 1, (), (1, 1, 1), 0, None, None)),
    ("prepare_launch", lambda h: h.prepare(object(), None, 1, 1, 0)),
    ("stream", lambda h: h.require("stream")),
])
def test_host_gpu_only_calls_raise_typed_errors(host, what, call):
    with pytest.raises(CudaNotAvailableError) as info:
        call(host)
    assert str(info.value) == require_message(what)
    assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("shape, dtype", [
    ((3, 7, 5), np.float32), ((1,), np.float64), ((13,), np.uint8),
    ((2, 3, 1, 9), np.float16), ((5, 11), np.int64), ((33,), np.bool_), ((6, 7), np.int32),
])
def test_host_tensors_and_copies(host, shape, dtype):
    rng = np.random.default_rng(sum(shape) * 7 + len(shape))
    x = (rng.standard_normal(shape) * 100).astype(dtype)
    dt = CudaDataType.from_any(dtype)
    pool = host.memory_pools[0]
    used0 = pool.used_bytes()
    size = int(np.prod(shape))
    t = host.new_tensor(shape, dt, 0, pool, size, size * dt.itemsize)
    assert t.on_host and t.shape == shape and t.nbytes == x.nbytes and t.ptr
    assert pool.used_bytes() >= used0 + t.nbytes
    assert host.copy_to_device(x, t.ptr, 0, t.nbytes, None) == 0.0
    assert np.array_equal(t.host_view, x)
    out = np.empty_like(x)
    assert host.copy_from_device(out, t.ptr, 0, t.nbytes, None) == 0.0
    assert out.tobytes() == x.tobytes()
    # async copies are synchronous memmoves on the host, every array counts as pinned
    host.check_pinned(out, "copy_from_device_async")
    y = (rng.standard_normal(shape) * 100).astype(dtype)
    host.copy_to_device_async(y, t.ptr, 0, t.nbytes, t, None)
    host.copy_from_device_async(t.ptr, out, 0, t.nbytes, t, None)
    assert out.tobytes() == y.tobytes()
    # device to device: a prefix of odd length
    u = host.new_tensor(shape, dt, 0, pool, size, t.nbytes)
    host.copy_to_device(x, u.ptr, 0, u.nbytes, None)
    n = (t.nbytes // 3) | 1
    assert host.copy_device_to_device(u.ptr, t.ptr, n, 0, None) == 0.0
    want = y.tobytes()[:n] + x.tobytes()[n:]
    assert u.host_view.tobytes() == want
    # peer copy on the host: one memory, a plain copy of the whole tensor
    host.copy_peer(u, t, lambda a, b: pytest.fail("no peer access on the host"), None)
    assert u.host_view.tobytes() == y.tobytes()
    t.free()
    u.free()
    assert pool.used_bytes() == used0


def test_host_memset_zero_size_and_pinned(host):
    pool = host.memory_pools[0]
    t = host.new_tensor((3, 5), CudaDataType.INT32, 0, pool, 15, 60)
    host.memset_async(t, 0x01020304, None)
    assert (t.host_view == 0x01020304).all()
    for shape in ((0,), (4, 0, 3), (0, 2 ** 40)):
        z = host.new_tensor(shape, CudaDataType.FLOAT32, 0, pool, 0, 0)
        assert z.nbytes == 0 and z.on_host and z.host_view.size == 0
    p = host.pinned_empty((4, 3), np.dtype(np.float16))
    assert p.shape == (4, 3) and p.dtype == np.float16
    t.free()


def test_host_pointer_and_capacity_errors(host):
    with pytest.raises(InvalidPointerError, match="0x3039 was not allocated by the pool of "
                                                  "device 0"):
        host.foreign_pointer(12345, 0)
    pool = host.memory_pools[0]
    ptr = pool.allocate_memory(24)
    cap = pool.capacity(ptr)
    too_big = np.zeros(cap // 4 + 1, np.float32)
    with pytest.raises(TransferError, match=f"{too_big.nbytes} bytes do not fit the "
                                            f"{cap}-byte allocation"):
        host_copy(too_big, ptr, cap, to_host=False)
    assert host_copy(np.zeros(0, np.float32), ptr, cap, to_host=True) == 0.0
    pool.free_memory(ptr)


# -- the fallback backend through the host runtime -----------------------------------------
@needs_fallback
def test_fallback_backend_runs_on_the_host_runtime(backend):
    assert isinstance(backend._runtime, HostRuntime)
    assert backend.memory_pools is backend._runtime.memory_pools
    assert backend.devices is backend._runtime.devices
    assert backend.fallback_reason == backend._runtime.reason
    for part in ("drv", "contexts", "pinned", "transfers", "compiler", "launcher"):
        assert getattr(backend, part) is None, part
    assert backend.direct_launch(0) is False
    assert backend.versions()["cuda_driver"] is None


@needs_fallback
@pytest.mark.parametrize("what, call", [
    ("context", lambda b: b.context(0)),
    ("stream", lambda b: b.stream()),
    ("stream", lambda b: b.stream(7)),          # before the device is checked
    ("stream", lambda b: b.create_stream()),
    ("event", lambda b: b.event(3)),
    ("capture", lambda b: b.capture(object())),
    ("can_access_peer", lambda b: b.can_access_peer(0, 9)),
    ("can_access_peer", lambda b: b.enable_peer_access(0, 0)),
    ("compile_kernel", lambda b: b.compile_kernel("k", "", device_id=4)),
    ("get_kernel", lambda b: b.get_kernel("k")),
    ("launch_kernel", lambda b: b.launch_kernel("k", (1, 1, 1))),
    ("prepare_launch", lambda b: b.prepare_launch(object(), 1, 1, device_id=2)),
])
def test_fallback_backend_messages(backend, what, call):
    with pytest.raises(CudaNotAvailableError) as info:
        call(backend)
    assert str(info.value) == require_message(what, backend.fallback_reason)


@needs_fallback
def test_fallback_backend_copies_through_the_runtime(backend):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((7, 9)).astype(np.float32)
    t = backend.to_device(x)
    ptr = backend.allocate_memory(40)
    backend.copy_device_to_device(ptr, t, 36)
    out = np.empty(9, np.float32)
    backend.copy_from_device(ptr, out)
    assert out.tobytes() == x[0].tobytes()
    with pytest.raises(InvalidPointerError):
        backend.copy_to_device(x, 4096)
    y = backend.copy_to_tensor_device(t, 0)
    assert backend.to_host(y).tobytes() == x.tobytes()
    backend.memset_async(y, 0)
    assert not backend.to_host(y).any()
    backend.free_memory(ptr)
    t.free()
    y.free()


# -- the CUDA runtime on the stubbed driver ------------------------------------------------
CUDA_ON_STUBS = r'''
    from cuda_backend.errors import GraphCaptureError
    from cuda_backend.runtime_cuda import CudaRuntime
    drv = sys.modules["pycuda.driver"]
    calls = []
    for name in ("memcpy_htod_async", "memcpy_dtoh_async", "memcpy_dtod_async",
                 "memset_d32_async"):
        def spy(*a, _name=name):
            calls.append((_name,) + tuple(x if isinstance(x, int) else type(x).__name__
                                          for x in a))
        setattr(drv, name, spy)
    drv.Context.synchronize = staticmethod(lambda: calls.append(("synchronize",)))
    drv.get_driver_version = lambda: 13000
    drv.Event.__init__ = lambda self, flags=0: None     # (stream-ordered frees pass flags)

    class FakeHostAllocation:     # transfers.is_pinned looks for this name among the bases
        def __init__(self, a):
            self.a, self.__array_interface__ = a, a.__array_interface__
    sys.modules["pycuda.tools"].PageLockedMemoryPool.allocate = \
        lambda self, shape, dtype: np.asarray(FakeHostAllocation(np.zeros(shape, dtype)))
'''

CUDA_CHECKS = r'''
    assert isinstance(b._runtime, CudaRuntime) and b.fallback_reason is None
    assert b.drv is drv and b.launcher is b._runtime.launcher and b.device_count == 1
    assert b.memory_pools[0].owner is b
    assert b.versions()["cuda_driver"] == 13000
    t = b.empty((5, 7), DT.FLOAT32)
    u = b.empty((5, 7), DT.FLOAT32)
    h = b.pinned_empty((5, 7), np.float32)
    with b.stream() as s:
        b.copy_to_device_async(h, t, None)          # the `with` stream
        b.copy_from_device_async(u, h, s)
        b.memset_async(t, 7)
        b.copy_device_to_device(u, t, 36)
        want = [("memcpy_htod_async", t.ptr, "ndarray", "Stream"),
                ("memcpy_dtoh_async", "ndarray", u.ptr, "Stream"),
                ("memset_d32_async", t.ptr, 7, 35, "Stream"),
                ("memcpy_dtod_async", u.ptr, t.ptr, 36, "Stream")]
        assert calls == want, calls
        with pytest.raises(TransferError, match="needs page-locked host memory"):
            b.copy_to_device_async(np.zeros((5, 7), np.float32), t, None)
        s.graph = object()                          # as while capturing
        for call in (lambda: b.synchronize(0), lambda: b.copy_to_device(h, t),
                     lambda: b.copy_from_device(t, h), lambda: b.copy_device_to_device(u, t)):
            with pytest.raises(GraphCaptureError):
                call()
        s.graph = None
    del calls[:]
    b.memset_async(u, 1)
    b.synchronize()
    assert calls == [("memset_d32_async", u.ptr, 1, 35, "NoneType"), ("synchronize",)], calls
    from cuda_backend.errors import InvalidDeviceError
    with pytest.raises(InvalidDeviceError):
        b.synchronize(1)
    t.free(); u.free()
    del calls[:]
    b.shutdown()
    assert calls == [("synchronize",)], calls
    print("OK")
'''


def test_cuda_runtime_on_the_stubbed_driver():
    """The backend picks the CUDA runtime when the driver loads, and its copies, memset,
    synchronize and shutdown reach the driver with the pointers, sizes and streams given,
    and the capture and pinned-memory checks still raise."""
    from test_host_path import BACKEND, STUBS, run_script, script
    run_script(script(STUBS, "    from cuda_backend.errors import TransferError\n",
                      CUDA_ON_STUBS, BACKEND, CUDA_CHECKS))


# -- the shape of the split --------------------------------------------------------------------
MODULES = ("backend", "runtime", "runtime_cuda", "runtime_host")


def module_tree(name: str) -> tuple:
    path = os.path.join(ROOT, "cuda_backend", name + ".py")
    with open(path) as f:
        text = f.read()
    return text, ast.parse(text)


def test_backend_does_not_branch_on_is_available():
    """backend.py reads is_available only to set it; the runtime does what differs."""
    _, tree = module_tree("backend")
    reads = [n.lineno for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and n.attr == "is_available"
             and isinstance(n.ctx, ast.Load)]
    assert len(reads) <= 1, f"backend.py reads is_available at lines {reads}"


@pytest.mark.parametrize("name", MODULES)
def test_modules_and_functions_stay_small(name):
    text, tree = module_tree(name)
    assert text.count("\n") < 500, f"{name}.py has {text.count(chr(10))} lines"
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            assert length <= 60, f"{name}.{node.name} is {length} lines"
