"""`CudaBackend`: the thin front that checks arguments and delegates devices, contexts,
pools, copies, compilation and launches to a runtime (`runtime.Runtime`), and keeps the
profiler; and `get_cuda_backend()`, its process-wide instance.

The runtime is chosen once, at construction (`runtime.load_runtime`): `runtime_cuda.CudaRuntime`
when the CUDA driver loads, else `runtime_host.HostRuntime`, fallback mode: `is_available` is False, device 0 is
the host, memory comes from a host-memory pool with the same statistics, and GPU-only calls
(compile, launch) raise CudaNotAvailableError. The layers above compute with NumPy.
"""
from __future__ import annotations

import atexit
import math
import platform
import subprocess
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import __version__
from .devices import CudaDeviceInfo
from .driver import pycuda_version
from .dtypes import CudaDataType, from_host_dtype
from .errors import DTypeMismatchError, InvalidArgumentError, InvalidPointerError, TransferError
from .memory import MemoryPool
from .process_wide import ProcessWide
from .profiling import Profiler, write_json_atomic
from .runtime import FALLBACK_MESSAGE, load_runtime
from .tensor import CudaTensor, normalize_shape
from .transfers import host_contiguous

_prod = math.prod
# item size by member name: an Enum member's own __hash__ is Python code, its name's is not
_ITEMSIZE = {dt._name_: dt.itemsize for dt in CudaDataType}
__all__ = ["CudaBackend", "FALLBACK_MESSAGE", "get_cuda_backend", "nvcc_version"]


class CudaBackend:
    """Devices, contexts, memory, copies, compilation, launches and profiling."""

    def __init__(self, enable_profiling: bool = False) -> None:
        self._runtime = runtime = load_runtime(self)
        self.fallback_reason: Optional[str] = runtime.reason
        self.is_available = runtime.is_gpu
        self._validate: Callable[[Any], int] = runtime.validate     # a valid device id
        self._new_tensor = runtime.new_tensor
        self.devices: List[CudaDeviceInfo] = runtime.devices
        self.memory_pools: Dict[int, MemoryPool] = runtime.memory_pools
        # the CUDA runtime's parts (None in fallback mode), for the modules that drive
        # PyCUDA themselves (streams, timing, parallel copies, the ops' transfer fast path)
        self.drv: Any = runtime.drv
        self.contexts: Any = runtime.contexts
        self.pinned: Any = runtime.pinned
        self.transfers: Any = runtime.transfers
        self.compiler: Any = runtime.compiler
        self.launcher: Any = runtime.launcher
        # the per-call check, one call deep (an instance attribute over the method)
        self.direct_launch = runtime.direct     # type: ignore[method-assign,assignment]
        self._profiler = Profiler()
        self._profiling = False
        self._lock = threading.RLock()
        self.closed = False
        self._peer_enabled: Dict[tuple, bool] = {}
        self.enable_profiling = enable_profiling
        atexit.register(self.shutdown)

    # -- devices and contexts -------------------------------------------------------
    @property
    def device_count(self) -> int:
        """Number of GPUs (0 in fallback mode)."""
        return self._runtime.device_count

    def get_device_info(self, device_id: int) -> CudaDeviceInfo:
        return self.devices[self._validate(device_id)]

    @property
    def current_device(self) -> int:
        """The calling thread's current device."""
        return self._runtime.current_device()

    def set_device(self, device_id: int) -> None:
        """Make device_id current for the calling thread."""
        self._runtime.set_device(device_id)

    def device(self, device_id: int):
        """`with backend.device(i):` runs the block on device i, then restores the previous."""
        return self._runtime.device(device_id)

    def activate(self, device_id: int):
        """Make device_id's context current for one operation (cheap when it already is)."""
        return self._runtime.activate(device_id)

    def context(self, device_id: int) -> Any:
        """The device's retained primary context (PyCUDA Context)."""
        return self._runtime.context(device_id)

    def synchronize(self, device_id: Optional[int] = None) -> None:
        """Wait for all work on one device, or on every device that was used."""
        self._runtime.synchronize(None if device_id is None else self._validate(device_id))

    def error_slot(self, key: Any, make_error: Callable[[int], BaseException]) -> int:
        """The device pointer of a checking kernel's error slot: an int32 pair in mapped host
        memory that a kernel sets ([1, detail]) when its check fails; make_error(detail) is
        the typed error then raised by the next synchronizing call (device_errors.py)."""
        return self._runtime.error_slot(key, make_error)

    def raise_device_errors(self) -> None:
        """Raise what checking kernels found since the last synchronizing call (the typed
        error of the first failed check), else nothing; synchronize and the copies to the host
        call it."""
        self._runtime.raise_device_errors()

    def create_stream(self, device_id: Optional[int] = None) -> Any:
        """A new PyCUDA Stream on the device."""
        return self.stream(device_id).pycuda_stream

    # stream, capture and event exist only on a GPU: the runtime's `require` raises
    # CudaNotAvailableError in fallback mode, before the device is validated
    def stream(self, device_id: Optional[int] = None) -> Any:
        """A new `Stream` on the device; `with backend.stream() as s:` makes it the default
        for operations issued inside the block on that device."""
        from .streams import Stream
        self._runtime.require("stream")
        dev = self.current_device if device_id is None else self._validate(device_id)
        return Stream(self, dev)

    def capture(self, stream: Any = None) -> Any:
        """`with backend.capture() as graph:` records the ops issued in the block (on
        `stream`, a `Stream`, or a new one) into a CUDA graph instead of running them;
        `graph.replay()` runs them all with one launch. See graphs.py for what can be
        captured."""
        from .graphs import CudaGraph
        from .streams import Stream
        self._runtime.require("capture")
        if stream is None:
            stream = self.stream()
        elif not isinstance(stream, Stream):
            raise InvalidArgumentError(
                f"capture needs a Stream from backend.stream(), got {type(stream).__name__}")
        return CudaGraph(self, stream)

    def event(self, device_id: Optional[int] = None, timing: bool = True) -> Any:
        """A new `Event` on the device, for cross-stream dependencies and timing."""
        from .streams import Event
        self._runtime.require("event")
        dev = self.current_device if device_id is None else self._validate(device_id)
        return Event(self, dev, timing)

    def wait_for_foreign_stream(self, handle: int, device_id: int) -> None:
        """Order this thread's current stream on device_id after the work queued on another
        library's stream `handle` (a __cuda_array_interface__ v3 `stream`: 1 is the legacy
        default stream, 2 the per-thread one)."""
        self._runtime.wait_for_foreign_stream(handle, device_id)

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
        return self._runtime.pinned_empty(shape, CudaDataType.from_any(dtype).numpy_dtype)

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
        return self._new_tensor(shape, dtype, dev, pool, size, nbytes)

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
        if capacity is None:
            self._runtime.foreign_pointer(ptr, dev)
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
            ms = self.transfers.direct_htod(host_array, device_ptr)
            if ms is not None:
                return ms
        host = host_contiguous(host_array)
        ptr, dev, capacity, tensor = self._destination(device_ptr, device_id)
        if tensor is not None:
            _check_same(host, tensor, "copy_to_device")
        return self._runtime.copy_to_device(host, ptr, dev, capacity, stream)

    def copy_from_device(self, device_ptr: Any, host_array: np.ndarray,
                         device_id: Optional[int] = None, stream: Any = None) -> float:
        """Copy device memory into a host array; returns ms (as copy_to_device)."""
        if stream is None and type(device_ptr) is CudaTensor and \
                type(host_array) is np.ndarray and self.direct_launch(device_ptr.device_id):
            ms = self.transfers.direct_dtoh(device_ptr, host_array)   # as copy_to_device
            if ms is not None:
                self._runtime.raise_device_errors()
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
        ms = self._runtime.copy_from_device(target, ptr, dev, capacity, stream)
        if target is not host_array:
            host_array[...] = target
        return ms

    def copy_to_device_async(self, host_array: np.ndarray, device_ptr: Any, stream: Any,
                             device_id: Optional[int] = None) -> None:
        """Queue a copy from page-locked host memory on a stream and return at once."""
        ptr, dev, capacity, tensor = self._check_async(host_array, device_ptr, device_id,
                                                       "copy_to_device_async")
        self._runtime.copy_to_device_async(host_array, ptr, dev, capacity, tensor, stream)

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
        self._runtime.copy_from_device_async(ptr, host_array, dev, capacity, tensor, stream)

    def _check_async(self, host: Any, target: Any, device_id: Optional[int], what: str) -> tuple:
        if not isinstance(host, np.ndarray) or not host.flags.c_contiguous:
            raise TransferError(f"{what} needs a C-contiguous NumPy array")
        ptr, dev, capacity, tensor = self._destination(target, device_id)
        if tensor is not None:
            _check_same(host, tensor, what)
        elif capacity is not None and host.nbytes > capacity:
            raise TransferError(
                f"{what}: {host.nbytes} bytes do not fit the {capacity}-byte allocation")
        self._runtime.check_pinned(host, what)
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
        return self._runtime.copy_device_to_device(dptr, sptr, nbytes, dev, stream)

    def memset_async(self, tensor: CudaTensor, value: int, stream: Any = None) -> None:
        """Set every 32-bit word of a tensor whose size is a multiple of 4 bytes to `value`,
        queued on `stream` (None: this thread's current stream on its device); capturable."""
        tensor.check_alive()
        if tensor.nbytes % 4:
            raise InvalidArgumentError(
                f"memset_async sets 32-bit words: the tensor's {tensor.nbytes} bytes are not a "
                f"multiple of 4")
        self._runtime.memset_async(tensor, value, stream)

    def can_access_peer(self, device_id: int, peer_device: int) -> bool:
        """Whether device_id can read peer_device's memory directly."""
        return self._runtime.can_access_peer(device_id, peer_device)

    def enable_peer_access(self, device_id: int, peer_device: int) -> bool:
        """Enable device_id -> peer_device access once per pair; False if the pair cannot."""
        key = (device_id, peer_device)
        with self._lock:
            done = self._peer_enabled.get(key)
            if done is not None:
                return done
            ok = self.can_access_peer(device_id, peer_device)
            if ok and device_id != peer_device:
                ok = self._runtime.enable_peer(device_id, peer_device)
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
        if dst_dev == tensor.device_id:
            self.copy_device_to_device(out, tensor, tensor.nbytes, stream=stream)
            return out
        self._runtime.copy_peer(out, tensor, self.enable_peer_access, stream)
        return out

    def to_device(self, array: Any, device_id: Optional[int] = None) -> CudaTensor:
        """A new tensor holding a copy of a host array (bfloat16 needs a CudaTensor dtype)."""
        host = host_contiguous(array)
        t = self.empty(host.shape, from_host_dtype(host.dtype), device_id)
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
        return self._runtime.compile(kernel_name, source_code, options, device_id, arch,
                                     arg_types)

    def get_kernel(self, kernel_name: str, device_id: Optional[int] = None) -> Any:
        return self._runtime.get_kernel(kernel_name, device_id)

    def launch_kernel(self, kernel_name: str, grid_size: Any, *args: Any,
                      block_size: Any = (256, 1, 1), shared_mem: int = 0, stream: Any = None,
                      device_id: Optional[int] = None) -> float:
        """Launch a compiled kernel. Returns its time in ms when profiling, else 0.0 without
        synchronizing. Limits are checked against the device before launching."""
        return self._runtime.launch(kernel_name, grid_size, args, block_size, shared_mem,
                                    stream, device_id)

    def prepare_launch(self, kernel: Any, grid_size: Any, block_size: Any,
                       shared_mem: int = 0, device_id: Optional[int] = None) -> Any:
        """A `launch.PreparedLaunch` of a compiled kernel: grid, block, shared memory and
        argument layout checked once; calling it with the arguments launches on the legacy
        default stream. Use it only when `direct_launch(device_id)` is True."""
        return self._runtime.prepare(kernel, device_id, grid_size, block_size, shared_mem)

    def direct_launch(self, device_id: int) -> bool:
        """Whether prepared launches on device_id may run now (its context current in this
        thread, no `with stream:` block, profiling off); False in fallback mode."""
        return self._runtime.direct(device_id)

    # -- profiling ----------------------------------------------------------------
    @property
    def enable_profiling(self) -> bool:
        return self._profiling

    @enable_profiling.setter
    def enable_profiling(self, value: bool) -> None:
        self._profiling = bool(value)
        self._runtime.set_profiler(self._profiler if value else None)

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
        return {"cuda_backend": __version__, "python": platform.python_version(),
                "numpy": np.__version__, "pycuda": pycuda_version(),
                "cuda_driver": self._runtime.driver_version(), "nvcc": nvcc_version()}

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
        if self.closed:
            return
        self.closed = True
        self._runtime.shutdown()


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


_backend = ProcessWide(CudaBackend)


def is_process_backend(backend: Any) -> bool:
    """Whether backend is the process-wide one get_cuda_backend() made (False before it)."""
    return backend is not None and backend is _backend.value


def get_cuda_backend(enable_profiling: bool = False) -> CudaBackend:
    """The process-wide backend; enable_profiling=True turns profiling on for it."""
    backend: CudaBackend = _backend.get(enable_profiling)
    if enable_profiling and not backend.enable_profiling:
        backend.enable_profiling = True
    return backend
