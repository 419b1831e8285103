"""`CudaBackend`: the thin front that composes devices, contexts, pools, copies, the
compiler, the launcher and the profiler; and `get_cuda_backend()`, its process-wide instance.

Without PyCUDA or a GPU the backend runs in fallback mode: `is_available` is False, device 0
is the host, memory comes from a host-memory pool with the same statistics, and GPU-only
calls (compile, launch) raise CudaNotAvailableError. The layers above compute with NumPy.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import math
import platform
import subprocess
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import __version__
from .devices import CudaDeviceInfo, enumerate_devices, host_device_info
from .driver import load_driver, pycuda_version
from .dtypes import CudaDataType
from .errors import (CudaNotAvailableError, DTypeMismatchError, GraphCaptureError,
                     InvalidArgumentError, InvalidDeviceError,
                     InvalidPointerError, TransferError, driver_failure)
from .memory import DriverEvents, HostBinnedPool, MemoryPool, PinnedHostPool, record_stream
from .profiling import Profiler, write_json_atomic
from .tensor import CudaTensor, normalize_shape, pool_tensor
from .transfers import host_contiguous

logger = logging.getLogger("cuda_backend")
_prod = math.prod
# item size by member name: an Enum member's own __hash__ is Python code, its name's is not
_ITEMSIZE = {dt._name_: dt.itemsize for dt in CudaDataType}
FALLBACK_MESSAGE = "PyCUDA not available. CUDA backend will use fallback mode."


class CudaBackend:
    """Devices, contexts, memory, copies, compilation, launches and profiling."""

    def __init__(self, enable_profiling: bool = False) -> None:
        drv, reason = load_driver()
        self._drv = drv
        self.fallback_reason: Optional[str] = reason
        self.is_available = drv is not None
        self._profiler = Profiler()
        self._profiling = False
        self._lock = threading.RLock()
        self._closed = False
        self._peer_enabled: Dict[tuple, bool] = {}
        if self.is_available:
            self._init_gpu(drv)
        else:
            logger.warning("%s (%s)", FALLBACK_MESSAGE, reason)
            self._init_fallback()
        self.enable_profiling = enable_profiling
        atexit.register(self.shutdown)

    # -- construction -------------------------------------------------------------
    def _init_gpu(self, drv: Any) -> None:
        import pycuda.tools
        from .compiler import KernelCompiler
        from .contexts import ContextManager
        from .launch import Launcher
        from .transfers import TransferEngine

        self.devices: List[CudaDeviceInfo] = enumerate_devices(drv)
        self._contexts = ContextManager(drv, len(self.devices))
        contexts = self._contexts

        def make_pool(dev: int) -> MemoryPool:
            # A DeviceMemoryPool binds to the context current when it is made.
            def activate() -> Any:
                return contexts.activate(dev)
            with contexts.activate(dev):
                pool = MemoryPool(dev, pycuda.tools.DeviceMemoryPool(),
                                  device_total=self.devices[dev].memory_total,
                                  activate=activate, oom_errors=(drv.MemoryError,),
                                  events=DriverEvents(drv, activate))
            pool.owner = self
            return pool
        self.memory_pools: Dict[int, MemoryPool] = _LazyPools(make_pool, contexts.validate)
        with contexts.activate(contexts.current_device()):
            self._pinned = PinnedHostPool(drv)
        self._transfers = TransferEngine(drv, self._contexts, self._pinned)
        self._compiler = KernelCompiler(drv, self._contexts, self.devices)
        self._launcher = Launcher(drv, self._compiler, self._contexts, self.devices)
        # the per-call check, one call deep (an instance attribute over the fallback method)
        self.direct_launch = self._launcher.direct     # type: ignore[method-assign]

    def _init_fallback(self) -> None:
        self.devices = [host_device_info()]
        # fallback mode: no GPU part; the methods that use them run only when is_available
        self._contexts = None   # type: ignore[assignment]
        self.memory_pools = {0: MemoryPool(0, HostBinnedPool(),
                                           device_total=self.devices[0].memory_total)}
        self.memory_pools[0].owner = self
        self._pinned = None     # type: ignore[assignment]
        self._transfers = None  # type: ignore[assignment]
        self._compiler = None   # type: ignore[assignment]
        self._launcher = None   # type: ignore[assignment]
        self._host_device = 0

    # -- devices and contexts -------------------------------------------------------
    @property
    def device_count(self) -> int:
        """Number of GPUs (0 in fallback mode)."""
        return len(self.devices) if self.is_available else 0

    def get_device_info(self, device_id: int) -> CudaDeviceInfo:
        return self.devices[self._validate(device_id)]

    def _validate(self, device_id: Any) -> int:
        if self.is_available:
            return self._contexts.validate(device_id)
        if device_id != 0 or type(device_id) not in (int, np.int32, np.int64):
            raise InvalidDeviceError(device_id, 0)
        return 0

    @property
    def current_device(self) -> int:
        """The calling thread's current device."""
        return self._contexts.current_device() if self.is_available else 0

    def set_device(self, device_id: int) -> None:
        """Make device_id current for the calling thread."""
        if self.is_available:
            self._contexts.set_device(device_id)
        else:
            self._validate(device_id)

    def device(self, device_id: int):
        """`with backend.device(i):` runs the block on device i, then restores the previous."""
        if self.is_available:
            return self._contexts.device(device_id)
        self._validate(device_id)
        return contextlib.nullcontext(0)

    def activate(self, device_id: int):
        """Make device_id's context current for one operation (cheap when it already is)."""
        if self.is_available:
            return self._contexts.activate(device_id)
        return contextlib.nullcontext()

    def context(self, device_id: int) -> Any:
        """The device's retained primary context (PyCUDA Context)."""
        self._require_gpu("context")
        return self._contexts.context(self._validate(device_id))

    def synchronize(self, device_id: Optional[int] = None) -> None:
        """Wait for all work on one device, or on every device that was used."""
        if not self.is_available:
            if device_id is not None:
                self._validate(device_id)
            return
        ids = [self._validate(device_id)] if device_id is not None \
            else self._contexts.initialized_devices()
        for dev in ids:
            self._no_capture(dev, "synchronize")
            with self._contexts.activate(dev):
                try:
                    self._drv.Context.synchronize()
                except self._drv.Error as exc:
                    raise driver_failure(f"synchronize of device {dev}", exc, dev) from None

    def create_stream(self, device_id: Optional[int] = None) -> Any:
        """A new PyCUDA Stream on the device."""
        return self.stream(device_id).pycuda_stream

    def stream(self, device_id: Optional[int] = None) -> Any:
        """A new `Stream` on the device; `with backend.stream() as s:` makes it the default
        for operations issued inside the block on that device."""
        from .streams import Stream
        self._require_gpu("stream")
        dev = self.current_device if device_id is None else self._validate(device_id)
        return Stream(self, dev)

    def capture(self, stream: Any = None) -> Any:
        """`with backend.capture() as graph:` records the ops issued in the block (on
        `stream`, a `Stream`, or a new one) into a CUDA graph instead of running them;
        `graph.replay()` runs them all with one launch. See graphs.py for what can be
        captured."""
        from .graphs import CudaGraph
        from .streams import Stream
        self._require_gpu("capture")
        if stream is None:
            stream = self.stream()
        elif not isinstance(stream, Stream):
            raise InvalidArgumentError(
                f"capture needs a Stream from backend.stream(), got {type(stream).__name__}")
        return CudaGraph(self, stream)

    def _no_capture(self, device_id: int, what: str) -> None:
        """Raise GraphCaptureError when this thread's stream on device_id is capturing."""
        from .streams import capturing
        if capturing(device_id):
            raise GraphCaptureError(
                f"{what} cannot be recorded into a CUDA graph (it waits for the device); "
                f"do it before or after the capture, or use the async copies with pinned "
                f"memory")

    def event(self, device_id: Optional[int] = None, timing: bool = True) -> Any:
        """A new `Event` on the device, for cross-stream dependencies and timing."""
        from .streams import Event
        self._require_gpu("event")
        dev = self.current_device if device_id is None else self._validate(device_id)
        return Event(self, dev, timing)

    def _resolve_stream(self, stream: Any, device_id: int) -> Any:
        """A PyCUDA stream (or None) from a Stream, a PyCUDA stream, or the `with` default."""
        if stream is None:
            from .streams import current_stream
            default = current_stream(device_id)
            return None if default is None else default.pycuda_stream
        return getattr(stream, "pycuda_stream", stream)

    def wait_for_foreign_stream(self, handle: int, device_id: int) -> None:
        """Order this thread's current stream on device_id after the work queued on another
        library's stream `handle` (a __cuda_array_interface__ v3 `stream`: 1 is the legacy
        default stream, 2 the per-thread one)."""
        from .driver import stream_wait_stream
        from .streams import current_pycuda_stream
        current = current_pycuda_stream(device_id)
        if handle == 1 and current is None:
            return      # the same stream: already in order
        with self._contexts.activate(device_id):
            stream_wait_stream(0 if current is None else int(current.handle), handle)

    def _require_gpu(self, what: str) -> None:
        if not self.is_available:
            raise CudaNotAvailableError(
                f"{what} needs a CUDA GPU, but the backend is in fallback mode "
                f"({self.fallback_reason})")

    # -- memory -------------------------------------------------------------------
    def _pool(self, device_id: Optional[int]) -> MemoryPool:
        dev = self.current_device if device_id is None else self._validate(device_id)
        return self.memory_pools[dev]

    def allocate_memory(self, size: int, device_id: Optional[int] = None) -> int:
        """Allocate size bytes from the device's pool; returns the device pointer."""
        return self._pool(device_id).allocate_memory(size)

    def free_memory(self, ptr: int, device_id: Optional[int] = None) -> None:
        """Free a pointer from allocate_memory; an unknown or freed pointer raises."""
        self._pool(device_id).free_memory(ptr)

    def pinned_empty(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        """A page-locked host array from the pinned pool (a plain array in fallback mode)."""
        shape = normalize_shape(shape)
        dt = CudaDataType.from_any(dtype).numpy_dtype
        if not self.is_available:
            return np.empty(shape, dt)
        with self._contexts.activate(self.current_device):
            return self._pinned.empty(shape, dt)

    def empty(self, shape: Any, dtype: Any = CudaDataType.FLOAT32,
              device_id: Optional[int] = None) -> CudaTensor:
        """An uninitialized tensor from the device's pool."""
        shape = normalize_shape(shape)
        if type(dtype) is not CudaDataType:
            dtype = CudaDataType.from_any(dtype)
        dev = self.current_device if device_id is None else self._validate(device_id)
        return self.empty_checked(shape, dtype, dev)

    def empty_checked(self, shape: Tuple[int, ...], dtype: CudaDataType,
                       dev: int) -> CudaTensor:
        """empty() for a shape tuple, dtype and device that are already valid (the ops'
        per-call fast paths take them from live operands)."""
        pool = self.memory_pools[dev]
        size = _prod(shape)
        nbytes = size * _ITEMSIZE[dtype._name_]
        if nbytes > 1 << 30:  # refuse what cannot fit before the pool empties its cache
            from .errors import CudaOutOfMemoryError, InvalidArgumentError
            if nbytes >= 1 << 63:
                raise InvalidArgumentError(
                    f"a {dtype.name_str} tensor of shape {shape} needs {nbytes} bytes, over "
                    f"the largest size a tensor can have (2**63 - 1 bytes)")
            total = self.devices[dev].memory_total
            if total and nbytes > total:
                raise CudaOutOfMemoryError(
                    nbytes, dev, pool.used_bytes(), pool.free_bytes(), pool.get_limit() or None,
                    reason=f"a {dtype.name_str} tensor of shape {shape} is larger than the "
                           f"device's total memory of {total} bytes")
        if self.is_available and nbytes:
            return pool_tensor(shape, dtype, dev, pool.allocate(nbytes), pool, size, nbytes)
        t = CudaTensor(shape, dtype, dev, 0)
        t.on_host = not self.is_available
        if t.nbytes == 0:
            if not self.is_available:
                try:
                    t._host = np.empty(shape, dtype.numpy_dtype)
                except ValueError:  # NumPy caps the product of the other dims even when empty
                    t._host = np.empty((0,) * len(shape), dtype.numpy_dtype)
            return t
        block = pool.allocate(t.nbytes)
        t._block, t._pool, t._ptr = block, pool, int(block)
        if not self.is_available:
            t._host = np.frombuffer(block._buf, dtype=dtype.numpy_dtype,
                                    count=t.size).reshape(shape)
        return t

    # -- copies -------------------------------------------------------------------
    def _destination(self, dst: Any, device_id: Optional[int]) -> tuple:
        """(pointer, device, capacity bytes or None, tensor or None) of a copy target."""
        if isinstance(dst, CudaTensor):
            return dst.ptr, dst.device_id, dst.nbytes, dst
        dev = self.current_device if device_id is None else self._validate(device_id)
        try:
            ptr = int(dst)  # an int, or an allocation object (PyCUDA's) with __int__
        except (TypeError, ValueError):
            raise InvalidPointerError(
                f"copy target {dst!r} is neither a CudaTensor nor a device pointer") from None
        capacity = self.memory_pools[dev].capacity(ptr)
        if capacity is None and not self.is_available:
            # fallback mode: "device" memory is host memory, and a pointer the pool did not
            # hand out would be written with memmove, anywhere in the process
            raise InvalidPointerError(
                f"pointer 0x{ptr:x} was not allocated by the pool of device {dev} with "
                f"allocate_memory (fallback mode copies only to and from its own allocations)")
        return ptr, dev, capacity, None

    def copy_to_device(self, host_array: Any, device_ptr: Any,
                       device_id: Optional[int] = None, stream: Any = None) -> float:
        """Copy a host array to device memory (pointer or CudaTensor); returns ms: the wall
        time of the synchronous copy on the legacy default stream, CUDA events' time on a
        stream, with profiling on, or for a staged (>= 32 MiB pageable) copy."""
        if stream is None and type(device_ptr) is CudaTensor and \
                type(host_array) is np.ndarray and self.direct_launch(device_ptr.device_id):
            # the common call: a matching array into a live tensor, its device's context
            # current, no `with stream:` block, profiling off: one synchronous driver copy
            ms = self._transfers.direct_htod(host_array, device_ptr)
            if ms is not None:
                return ms
        host = host_contiguous(host_array)
        ptr, dev, capacity, tensor = self._destination(device_ptr, device_id)
        if tensor is not None:
            _check_same(host, tensor, "copy_to_device")
        if not self.is_available:
            return _host_copy(host, ptr, capacity, to_host=False)
        self._no_capture(dev, "a synchronous copy to the device (copy_to_device, from_numpy)")
        return self._transfers.to_device(host, ptr, dev, self._resolve_stream(stream, dev),
                                         capacity)

    def copy_from_device(self, device_ptr: Any, host_array: np.ndarray,
                         device_id: Optional[int] = None, stream: Any = None) -> float:
        """Copy device memory into a host array; returns ms (as copy_to_device)."""
        if stream is None and type(device_ptr) is CudaTensor and \
                type(host_array) is np.ndarray and self.direct_launch(device_ptr.device_id):
            ms = self._transfers.direct_dtoh(device_ptr, host_array)   # as copy_to_device
            if ms is not None:
                return ms
        if not isinstance(host_array, np.ndarray):
            raise TransferError(
                f"copy_from_device needs a NumPy array to write into, got "
                f"{type(host_array).__name__}")
        if not host_array.flags.writeable:
            raise TransferError("copy_from_device needs a writeable host array")
        ptr, dev, capacity, tensor = self._destination(device_ptr, device_id)
        if tensor is not None:
            _check_same(host_array, tensor, "copy_from_device")
        target = host_array
        if not host_array.flags.c_contiguous or host_array.dtype.byteorder not in ("=", "|"):
            target = np.empty(host_array.shape, host_array.dtype.newbyteorder("="))
        if not self.is_available:
            ms = _host_copy(target, ptr, capacity, to_host=True)
        else:
            self._no_capture(dev, "a synchronous copy to the host (copy_from_device, to_numpy)")
            ms = self._transfers.from_device(target, ptr, dev, self._resolve_stream(stream, dev),
                                             capacity)
        if target is not host_array:
            host_array[...] = target
        return ms

    def copy_to_device_async(self, host_array: np.ndarray, device_ptr: Any, stream: Any,
                             device_id: Optional[int] = None) -> None:
        """Queue a copy from page-locked host memory on a stream and return at once."""
        ptr, dev, capacity, tensor = self._check_async(host_array, device_ptr, device_id,
                                                       "copy_to_device_async")
        if not self.is_available:
            _host_copy(host_array, ptr, capacity, to_host=False)
            return
        stream = self._resolve_stream(stream, dev)
        if tensor is not None:
            record_stream(tensor, stream)
        with self._contexts.activate(dev):
            self._drv.memcpy_htod_async(ptr, host_array, stream)

    def copy_from_device_async(self, device_ptr: Any, host_array: np.ndarray, stream: Any,
                               device_id: Optional[int] = None) -> None:
        """Queue a copy into page-locked host memory on a stream and return at once;
        synchronize the stream before reading host_array."""
        if isinstance(host_array, np.ndarray) and not host_array.flags.writeable:
            raise TransferError(
                "copy_from_device_async needs a writeable host array (this one is read-only: "
                "a view of immutable memory such as bytes or a read-only mmap)")
        ptr, dev, capacity, tensor = self._check_async(host_array, device_ptr, device_id,
                                                       "copy_from_device_async")
        if not self.is_available:
            _host_copy(host_array, ptr, capacity, to_host=True)
            return
        stream = self._resolve_stream(stream, dev)
        if tensor is not None:
            record_stream(tensor, stream)
        with self._contexts.activate(dev):
            self._drv.memcpy_dtoh_async(host_array, ptr, stream)

    def _check_async(self, host: Any, target: Any, device_id: Optional[int], what: str) -> tuple:
        from .transfers import is_pinned
        if not isinstance(host, np.ndarray) or not host.flags.c_contiguous:
            raise TransferError(f"{what} needs a C-contiguous NumPy array")
        ptr, dev, capacity, tensor = self._destination(target, device_id)
        if tensor is not None:
            _check_same(host, tensor, what)
        elif capacity is not None and host.nbytes > capacity:
            raise TransferError(
                f"{what}: {host.nbytes} bytes do not fit the {capacity}-byte allocation")
        if self.is_available and not is_pinned(host):
            raise TransferError(
                f"{what} needs page-locked host memory (backend.pinned_empty); pageable "
                f"memory would make the copy synchronous")
        return ptr, dev, capacity, tensor

    def copy_device_to_device(self, dst: Any, src: Any, nbytes: Optional[int] = None,
                              device_id: Optional[int] = None, stream: Any = None) -> float:
        """Copy between two allocations on one device; returns ms."""
        dptr, dev, dcap, _ = self._destination(dst, device_id)
        sptr, sdev, scap, _ = self._destination(src, device_id)
        if nbytes is None:
            if dcap is None or scap is None:
                raise TransferError("nbytes is required when copying between raw pointers")
            nbytes = min(dcap, scap)
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise TransferError(
                f"nbytes must be a non-negative int number of bytes, got {nbytes!r}")
        nbytes = int(nbytes)
        for cap, what in ((dcap, "destination"), (scap, "source")):
            if cap is not None and nbytes > cap:
                raise TransferError(f"{nbytes} bytes do not fit the {what} of {cap} bytes")
        if not self.is_available:
            import ctypes
            ctypes.memmove(dptr, sptr, nbytes)
            return 0.0
        self._no_capture(dev, "copy_device_to_device (it times the copy and waits for it)")
        return self._transfers.device_to_device(dptr, sptr, nbytes, dev,
                                                self._resolve_stream(stream, dev))

    def memset_async(self, tensor: CudaTensor, value: int, stream: Any = None) -> None:
        """Set every 32-bit word of a tensor whose size is a multiple of 4 bytes to `value`,
        queued on `stream` (None: this thread's current stream on its device); capturable."""
        tensor.check_alive()
        if tensor.nbytes % 4:
            raise InvalidArgumentError(
                f"memset_async sets 32-bit words: the tensor's {tensor.nbytes} bytes are not a "
                f"multiple of 4")
        if not self.is_available:
            tensor.host_view.view(np.uint32)[...] = value
            return
        dev = tensor.device_id
        stream = self._resolve_stream(stream, dev)
        record_stream(tensor, stream)
        with self._contexts.activate(dev):
            self._drv.memset_d32_async(tensor.ptr, int(value), tensor.nbytes // 4, stream)

    def can_access_peer(self, device_id: int, peer_device: int) -> bool:
        """Whether device_id can read peer_device's memory directly."""
        self._require_gpu("can_access_peer")
        a, b = self._validate(device_id), self._validate(peer_device)
        return a == b or bool(self._drv.Device(a).can_access_peer(self._drv.Device(b)))

    def enable_peer_access(self, device_id: int, peer_device: int) -> bool:
        """Enable device_id -> peer_device access once per pair; False if the pair cannot."""
        key = (device_id, peer_device)
        with self._lock:
            done = self._peer_enabled.get(key)
            if done is not None:
                return done
            ok = self.can_access_peer(device_id, peer_device)
            if ok and device_id != peer_device:
                with self._contexts.activate(device_id):
                    try:
                        self._drv.Context.enable_peer_access(self._contexts.context(peer_device))
                    except self._drv.Error as exc:
                        if "already" not in str(exc).lower():
                            ok = False
            self._peer_enabled[key] = ok
            return ok

    def copy_to_tensor_device(self, tensor: CudaTensor, device_id: int,
                              stream: Any = None) -> CudaTensor:
        """A copy of tensor on device_id (peer-to-peer when the devices allow, else via host)."""
        tensor.check_alive()
        dst_dev = self._validate(device_id)
        out = self.empty(tensor.shape, tensor.dtype, dst_dev)
        if tensor.nbytes == 0:
            return out
        if not self.is_available or dst_dev == tensor.device_id:
            self.copy_device_to_device(out, tensor, tensor.nbytes, stream=stream)
            return out
        ok = self.enable_peer_access(dst_dev, tensor.device_id) and \
            self.enable_peer_access(tensor.device_id, dst_dev)
        self._transfers.peer(out.ptr, dst_dev, tensor.ptr, tensor.device_id, tensor.nbytes, ok,
                             self._resolve_stream(stream, dst_dev))
        return out

    def to_device(self, array: Any, device_id: Optional[int] = None) -> CudaTensor:
        """A new tensor holding a copy of a host array (bfloat16 needs a CudaTensor dtype)."""
        host = host_contiguous(array)
        memo = self.__dict__.get("_host_dtypes")     # host dtype -> CudaDataType.from_any's
        dtype = None if memo is None else memo.get(host.dtype)
        if dtype is None:
            dtype = CudaDataType.from_any(host.dtype)
            if memo is None:
                memo = self.__dict__.setdefault("_host_dtypes", {})
            if len(memo) < 64:
                memo[host.dtype] = dtype
        t = self.empty(host.shape, dtype, device_id)
        if t.nbytes:
            self.copy_to_device(host, t)
        return t

    def to_host(self, tensor: CudaTensor) -> np.ndarray:
        """A new host array with the tensor's data."""
        out = np.empty(tensor.shape, tensor.dtype.numpy_dtype)
        if tensor.size:
            self.copy_from_device(tensor, out)
        else:
            tensor.check_alive()
        return out

    # -- kernels ------------------------------------------------------------------
    def compile_kernel(self, kernel_name: str, source_code: str,
                       options: Optional[Sequence[str]] = None, device_id: Optional[int] = None,
                       arch: Optional[str] = None, arg_types: Optional[str] = None) -> Any:
        """Compile CUDA C with SourceModule (cached); returns a CudaKernel.

        `arch` defaults to the device's ('sm_90' on Hopper); 'sm_90a' selects Hopper-only
        instructions. Kernels must be `extern "C"`.
        """
        self._require_gpu("compile_kernel")
        dev = self.current_device if device_id is None else self._validate(device_id)
        return self._compiler.compile(kernel_name, source_code, options, dev, arch, arg_types)

    def get_kernel(self, kernel_name: str, device_id: Optional[int] = None) -> Any:
        self._require_gpu("get_kernel")
        dev = self.current_device if device_id is None else self._validate(device_id)
        return self._compiler.get(kernel_name, dev)

    def launch_kernel(self, kernel_name: str, grid_size: Any, *args: Any,
                      block_size: Any = (256, 1, 1), shared_mem: int = 0, stream: Any = None,
                      device_id: Optional[int] = None) -> float:
        """Launch a compiled kernel. Returns its time in ms when profiling, else 0.0 without
        synchronizing. Limits are checked against the device before launching."""
        if self._launcher is None:
            self._require_gpu("launch_kernel")
        return self._launcher.launch(kernel_name, grid_size, args, block_size, shared_mem,
                                     stream, device_id)

    def prepare_launch(self, kernel: Any, grid_size: Any, block_size: Any,
                       shared_mem: int = 0, device_id: Optional[int] = None) -> Any:
        """A `launch.PreparedLaunch` of a compiled kernel: grid, block, shared memory and
        argument layout checked once; calling it with the arguments launches on the legacy
        default stream. Use it only when `direct_launch(device_id)` is True."""
        self._require_gpu("prepare_launch")
        dev = kernel.device_id if device_id is None else self._validate(device_id)
        return self._launcher.prepare(kernel, dev, grid_size, block_size, shared_mem)

    def direct_launch(self, device_id: int) -> bool:
        """Whether prepared launches on device_id may run now (its context current in this
        thread, no `with stream:` block, profiling off); False in fallback mode."""
        launcher = self._launcher
        return launcher is not None and launcher.direct(device_id)

    # -- profiling ----------------------------------------------------------------
    @property
    def enable_profiling(self) -> bool:
        return self._profiling

    @enable_profiling.setter
    def enable_profiling(self, value: bool) -> None:
        self._profiling = bool(value)
        prof = self._profiler if value else None
        if self._launcher is not None:
            self._launcher.profiler = prof
        if self._transfers is not None:
            self._transfers.profiler = prof

    @property
    def profiler(self) -> Profiler:
        return self._profiler

    def get_performance_stats(self) -> Dict[str, Any]:
        """Kernel and copy timings (profiling on) and every pool's statistics."""
        return {
            "profiling_enabled": self._profiling,
            "kernel_execution_times": self._profiler.kernel_stats(),
            "memory_transfer_times": self._profiler.transfer_stats(),
            "memory_pools": {dev: pool.get_stats() for dev, pool in self.memory_pools.items()},
        }

    def versions(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"cuda_backend": __version__, "python": platform.python_version(),
                               "numpy": np.__version__, "pycuda": pycuda_version(),
                               "cuda_driver": None, "nvcc": nvcc_version()}
        if self.is_available:
            out["cuda_driver"] = self._drv.get_driver_version()
        return out

    def export_performance_report(self, filename: str = "cuda_report.json") -> str:
        """Write stats, device info and versions as JSON (atomically); returns the path."""
        doc = {
            "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "fallback_mode": not self.is_available,
            "fallback_reason": self.fallback_reason,
            "versions": self.versions(),
            "devices": [d.to_dict() for d in self.devices],
            **self.get_performance_stats(),
        }
        return write_json_atomic(filename, doc)

    def export_chrome_trace(self, filename: str = "trace.json") -> str:
        """Write every profiled launch and copy in the Chrome Trace Event format."""
        return self._profiler.export_chrome_trace(filename)

    # -- shutdown -----------------------------------------------------------------
    def shutdown(self) -> None:
        """Free pools, release modules and pop contexts; registered at exit."""
        if self._closed:
            return
        self._closed = True
        if not self.is_available:
            return
        try:
            for dev in self._contexts.initialized_devices():
                with self._contexts.activate(dev):
                    try:
                        self._drv.Context.synchronize()
                    except self._drv.Error:
                        pass  # a faulted context: nothing more to wait for
                    if dev in self.memory_pools:
                        self.memory_pools[dev].shutdown()
            self._pinned.shutdown()
            self._compiler.clear()
            gc.collect()
        finally:
            self._contexts.shutdown()


class _LazyPools(dict):
    """device id -> MemoryPool, made on first access inside the device's context."""

    def __init__(self, factory: Any, validate: Any) -> None:
        super().__init__()
        self._factory = factory
        self._validate = validate
        self._lock = threading.Lock()

    def __missing__(self, device_id: int) -> MemoryPool:
        device_id = self._validate(device_id)
        with self._lock:
            if device_id not in self:
                dict.__setitem__(self, device_id, self._factory(device_id))
            return dict.__getitem__(self, device_id)


def nvcc_version() -> Optional[str]:
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.stdout.splitlines():
        if "release" in line:
            return line.strip()
    return None


def _check_same(host: np.ndarray, tensor: CudaTensor, what: str) -> None:
    expected = tensor.dtype.numpy_dtype
    if host.dtype.newbyteorder("=") != expected:
        raise DTypeMismatchError(
            f"{what}: host array dtype {host.dtype} does not match the tensor's "
            f"{tensor.dtype.name_str} (expected host dtype {expected})")
    if host.size != tensor.size:
        raise TransferError(
            f"{what}: host array of shape {host.shape} ({host.size} elements) does not match "
            f"the tensor of shape {tensor.shape} ({tensor.size} elements)")


def _host_copy(host: np.ndarray, ptr: int, capacity: Optional[int], to_host: bool) -> float:
    import ctypes
    if capacity is not None and host.nbytes > capacity:
        raise TransferError(f"{host.nbytes} bytes do not fit the {capacity}-byte allocation")
    if host.nbytes:
        if to_host:
            ctypes.memmove(host.ctypes.data, ptr, host.nbytes)
        else:
            ctypes.memmove(ptr, host.ctypes.data, host.nbytes)
    return 0.0


_backend: Optional[CudaBackend] = None
_backend_lock = threading.Lock()


def get_cuda_backend(enable_profiling: bool = False) -> CudaBackend:
    """The process-wide backend; enable_profiling=True turns profiling on for it."""
    global _backend
    if _backend is None:
        with _backend_lock:
            if _backend is None:
                _backend = CudaBackend(enable_profiling=enable_profiling)
                return _backend
    if enable_profiling and not _backend.enable_profiling:
        _backend.enable_profiling = True
    return _backend
