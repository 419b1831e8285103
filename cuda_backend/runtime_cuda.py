"""`CudaRuntime`: the `runtime.Runtime` of the GPU, PyCUDA over the CUDA driver. It composes
`contexts.ContextManager` (one context per device), one `memory.MemoryPool` per device (made on first use), the pinned
host pool, `transfers.TransferEngine`, `compiler.KernelCompiler` and `launch.Launcher`.
Imported only when the driver loaded.
"""
from __future__ import annotations

import gc
import threading
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import numpy as np

from .compiler import KernelCompiler
from .contexts import ContextManager as DeviceContexts
from .device_errors import DeviceErrors
from .devices import CudaDeviceInfo, enumerate_devices
from .driver import stream_wait_stream
from .dtypes import CudaDataType
from .errors import GraphCaptureError, TransferError, driver_failure
from .launch import Launcher
from .memory import MemoryPool
from .memory_host import HostBinnedPool, PinnedHostPool, round_to_fine_bin
from .memory_streams import DriverEvents, record_stream
from .runtime import Runtime
from .streams import capturing, current_pycuda_stream, current_stream
from .tensor import CudaTensor, pool_tensor
from .transfers import TransferEngine, is_pinned


class CudaRuntime(Runtime):
    """Devices, contexts, pools, copies, compilation and launches through PyCUDA."""

    is_gpu = True
    reason = None

    def __init__(self, drv: Any, owner: Any) -> None:
        """owner: the CudaBackend, each pool's owner."""
        import pycuda.tools

        self.drv = drv
        self.devices: List[CudaDeviceInfo] = enumerate_devices(drv)
        self.contexts = contexts = DeviceContexts(drv, len(self.devices))
        devices = self.devices

        def make_pool(dev: int) -> MemoryPool:
            # A DeviceMemoryPool binds to the context current when it is made.
            def activate() -> Any:
                return contexts.activate(dev)
            def device_buffer(size: int) -> Any:
                buf = drv.mem_alloc(size)     # freed when the large pool drops it
                return buf, int(buf)
            with contexts.activate(dev):
                large = HostBinnedPool(device_buffer, drv.MemoryError, round_to_fine_bin)
                pool = MemoryPool(dev, pycuda.tools.DeviceMemoryPool(),
                                  device_total=devices[dev].memory_total,
                                  activate=activate, oom_errors=(drv.MemoryError,),
                                  events=DriverEvents(drv, activate), large=large)
            pool.owner = owner
            return pool
        self.memory_pools: Dict[int, MemoryPool] = LazyPools(make_pool, contexts.validate)
        with contexts.activate(contexts.current_device()):
            self.pinned = PinnedHostPool(drv)
        self.transfers = TransferEngine(drv, contexts, self.pinned)
        self.compiler = KernelCompiler(drv, contexts, devices)
        self.launcher = Launcher(drv, self.compiler, contexts, devices)
        self.errors = DeviceErrors(drv)
        self.error_slot = self.errors.slot                  # type: ignore[method-assign]
        self.raise_device_errors = self.errors.raise_pending  # type: ignore[method-assign]
        # the per-call paths, one call deep (instance attributes over the parts' methods)
        self.validate = contexts.validate
        self.current_device = contexts.current_device
        self.direct = self.launcher.direct
        self.launch = self.launcher.launch      # type: ignore[method-assign]

    @property
    def device_count(self) -> int:
        return len(self.devices)

    # -- devices and contexts -------------------------------------------------------
    def set_device(self, device_id: Any) -> None:
        self.contexts.set_device(device_id)

    def device(self, device_id: Any) -> ContextManager[Any]:
        return self.contexts.device(device_id)

    def activate(self, device_id: int) -> ContextManager[Any]:
        return self.contexts.activate(device_id)

    def require(self, what: str) -> None:
        pass

    def context(self, device_id: Any) -> Any:
        return self.contexts.context(self.validate(device_id))

    def synchronize(self, device_id: Optional[int]) -> None:
        ids = [device_id] if device_id is not None else self.contexts.initialized_devices()
        for dev in ids:
            no_capture(dev, "synchronize")
            with self.contexts.activate(dev):
                try:
                    self.drv.Context.synchronize()
                except self.drv.Error as exc:
                    raise driver_failure(f"synchronize of device {dev}", exc, dev) from None
        self.errors.raise_pending()

    def wait_for_foreign_stream(self, handle: int, device_id: int) -> None:
        current = current_pycuda_stream(device_id)
        if handle == 1 and current is None:
            return      # the same stream: already in order
        with self.contexts.activate(device_id):
            stream_wait_stream(0 if current is None else int(current.handle), handle)

    # -- memory ---------------------------------------------------------------------
    def pinned_empty(self, shape: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        with self.contexts.activate(self.current_device()):
            return self.pinned.empty(shape, dtype)

    def new_tensor(self, shape: Tuple[int, ...], dtype: CudaDataType, dev: int,
                   pool: MemoryPool, size: int, nbytes: int) -> CudaTensor:
        if nbytes:
            return pool_tensor(shape, dtype, dev, pool.allocate(nbytes), pool, size, nbytes)
        t = CudaTensor(shape, dtype, dev, 0)
        t.on_host = False
        return t

    def foreign_pointer(self, ptr: int, dev: int) -> None:
        pass    # a pointer from elsewhere (PyCUDA, another library): the driver checks it

    # -- copies ---------------------------------------------------------------------
    def copy_to_device(self, host: np.ndarray, ptr: int, dev: int, capacity: Optional[int],
                       stream: Any) -> float:
        no_capture(dev, "a synchronous copy to the device (copy_to_device, from_numpy)")
        return self.transfers.to_device(host, ptr, dev, resolve_stream(stream, dev), capacity)

    def copy_from_device(self, target: np.ndarray, ptr: int, dev: int,
                         capacity: Optional[int], stream: Any) -> float:
        no_capture(dev, "a synchronous copy to the host (copy_from_device, to_numpy)")
        ms = self.transfers.from_device(target, ptr, dev, resolve_stream(stream, dev),
                                        capacity)
        self.errors.raise_pending()
        return ms

    def check_pinned(self, host: np.ndarray, what: str) -> None:
        if not is_pinned(host):
            raise TransferError(
                f"{what} needs page-locked host memory (backend.pinned_empty); pageable "
                f"memory would make the copy synchronous")

    def copy_to_device_async(self, host: np.ndarray, ptr: int, dev: int,
                             capacity: Optional[int], tensor: Optional[CudaTensor],
                             stream: Any) -> None:
        self._copy_async(dev, tensor, stream, self.drv.memcpy_htod_async, ptr, host)

    def copy_from_device_async(self, ptr: int, host: np.ndarray, dev: int,
                               capacity: Optional[int], tensor: Optional[CudaTensor],
                               stream: Any) -> None:
        self._copy_async(dev, tensor, stream, self.drv.memcpy_dtoh_async, host, ptr)

    def _copy_async(self, dev: int, tensor: Optional[CudaTensor], stream: Any, copy: Any,
                    dst: Any, src: Any) -> None:
        """copy(dst, src, stream) on dev in stream order (the resolved stream), tensor's pool
        block recorded on that stream first."""
        stream = resolve_stream(stream, dev)
        if tensor is not None:
            record_stream(tensor, stream)
        with self.contexts.activate(dev):
            copy(dst, src, stream)

    def copy_device_to_device(self, dptr: int, sptr: int, nbytes: int, dev: int,
                              stream: Any) -> float:
        no_capture(dev, "copy_device_to_device (it times the copy and waits for it)")
        return self.transfers.device_to_device(dptr, sptr, nbytes, dev,
                                               resolve_stream(stream, dev))

    def memset_async(self, tensor: CudaTensor, value: int, stream: Any) -> None:
        dev = tensor.device_id
        stream = resolve_stream(stream, dev)
        record_stream(tensor, stream)
        with self.contexts.activate(dev):
            self.drv.memset_d32_async(tensor.ptr, int(value), tensor.nbytes // 4, stream)

    def can_access_peer(self, device_id: Any, peer_device: Any) -> bool:
        a, b = self.validate(device_id), self.validate(peer_device)
        return a == b or bool(self.drv.Device(a).can_access_peer(self.drv.Device(b)))

    def enable_peer(self, device_id: int, peer_device: int) -> bool:
        with self.contexts.activate(device_id):
            try:
                self.drv.Context.enable_peer_access(self.contexts.context(peer_device))
            except self.drv.Error as exc:
                if "already" not in str(exc).lower():
                    return False
        return True

    def copy_peer(self, out: CudaTensor, tensor: CudaTensor, enable: Callable[[int, int], bool],
                  stream: Any) -> None:
        dst_dev = out.device_id
        ok = enable(dst_dev, tensor.device_id) and enable(tensor.device_id, dst_dev)
        self.transfers.peer(out.ptr, dst_dev, tensor.ptr, tensor.device_id, tensor.nbytes, ok,
                            resolve_stream(stream, dst_dev))

    # -- kernels --------------------------------------------------------------------
    def compile(self, kernel_name: str, source_code: str, options: Any,
                device_id: Optional[int], arch: Optional[str], arg_types: Optional[str]) -> Any:
        dev = self.current_device() if device_id is None else self.validate(device_id)
        return self.compiler.compile(kernel_name, source_code, options, dev, arch, arg_types)

    def get_kernel(self, kernel_name: str, device_id: Optional[int]) -> Any:
        dev = self.current_device() if device_id is None else self.validate(device_id)
        return self.compiler.get(kernel_name, dev)

    def launch(self, kernel_name: str, grid_size: Any, args: Any, block_size: Any,
               shared_mem: int, stream: Any, device_id: Optional[int]) -> float:
        return self.launcher.launch(kernel_name, grid_size, args, block_size, shared_mem,
                                    stream, device_id)

    def prepare(self, kernel: Any, device_id: Optional[int], grid_size: Any, block_size: Any,
                shared_mem: int) -> Any:
        dev = kernel.device_id if device_id is None else self.validate(device_id)
        return self.launcher.prepare(kernel, dev, grid_size, block_size, shared_mem)

    # -- profiling and shutdown ---------------------------------------------------------
    def set_profiler(self, profiler: Any) -> None:
        self.launcher.profiler = profiler
        self.transfers.profiler = profiler

    def driver_version(self) -> Optional[int]:
        return self.drv.get_driver_version()

    def shutdown(self) -> None:
        try:
            for dev in self.contexts.initialized_devices():
                with self.contexts.activate(dev):
                    try:
                        self.drv.Context.synchronize()
                    except self.drv.Error:
                        pass  # a faulted context: nothing more to wait for
                    if dev in self.memory_pools:
                        self.memory_pools[dev].shutdown()
            self.pinned.shutdown()
            self.compiler.clear()
            gc.collect()
        finally:
            self.contexts.shutdown()


class LazyPools(dict):
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


def no_capture(device_id: int, what: str) -> None:
    """Raise GraphCaptureError when this thread's stream on device_id is capturing."""
    if capturing(device_id):
        raise GraphCaptureError(
            f"{what} cannot be recorded into a CUDA graph (it waits for the device); "
            f"do it before or after the capture, or use the async copies with pinned "
            f"memory")


def resolve_stream(stream: Any, device_id: int) -> Any:
    """A PyCUDA stream (or None) from a Stream, a PyCUDA stream, or the `with` default."""
    if stream is None:
        default = current_stream(device_id)
        return None if default is None else default.pycuda_stream
    return getattr(stream, "pycuda_stream", stream)
