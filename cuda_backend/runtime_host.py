"""`HostRuntime`: the `runtime.Runtime` of fallback mode, the host as device 0.

Memory comes from a host-memory pool (`memory.HostBinnedPool`) with the same statistics and
limits as a device pool, each tensor viewing its block as a NumPy array; copies are memmoves
between the pool's blocks and host arrays; what needs a GPU (compiling, launching, streams,
peers) raises CudaNotAvailableError naming the call and why there is no GPU.
"""
from __future__ import annotations

import contextlib
import ctypes
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import numpy as np

from .devices import CudaDeviceInfo, host_device_info
from .dtypes import CudaDataType
from .errors import (CudaNotAvailableError, InvalidDeviceError, InvalidPointerError,
                     TransferError)
from .memory import MemoryPool
from .memory_host import HostBinnedPool, round_to_fine_bin
from .runtime import Runtime
from .tensor import CudaTensor

_DEVICE_ID_TYPES = (int, np.int32, np.int64)


class HostRuntime(Runtime):
    """Device 0 is the host: NumPy buffers, host copies, no kernels."""

    is_gpu = False
    drv = contexts = pinned = transfers = compiler = launcher = None

    def __init__(self, reason: Optional[str], owner: Any) -> None:
        """reason: why there is no GPU (in every CudaNotAvailableError); owner: the
        CudaBackend, the pool's owner."""
        self.reason = reason
        self.devices: List[CudaDeviceInfo] = [host_device_info()]
        pool = MemoryPool(0, HostBinnedPool(), device_total=self.devices[0].memory_total,
                          large=HostBinnedPool(rounding=round_to_fine_bin))
        pool.owner = owner
        self.memory_pools: Dict[int, MemoryPool] = {0: pool}

    @property
    def device_count(self) -> int:
        return 0

    # -- devices and contexts -------------------------------------------------------
    def validate(self, device_id: Any) -> int:
        if device_id != 0 or type(device_id) not in _DEVICE_ID_TYPES:
            raise InvalidDeviceError(device_id, 0)
        return 0

    def current_device(self) -> int:
        return 0

    def set_device(self, device_id: Any) -> None:
        self.validate(device_id)

    def device(self, device_id: Any) -> ContextManager[Any]:
        self.validate(device_id)
        return contextlib.nullcontext(0)

    def activate(self, device_id: int) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def require(self, what: str) -> None:
        raise CudaNotAvailableError(
            f"{what} needs a CUDA GPU, but the backend is in fallback mode ({self.reason})")

    def context(self, device_id: Any) -> Any:
        self.require("context")

    def synchronize(self, device_id: Optional[int]) -> None:
        pass    # host copies are done when they return

    def wait_for_foreign_stream(self, handle: int, device_id: int) -> None:
        if handle != 1:     # 1, the legacy default stream, is the host's order already
            self.require("wait_for_foreign_stream")

    # -- memory ---------------------------------------------------------------------
    def pinned_empty(self, shape: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    def new_tensor(self, shape: Tuple[int, ...], dtype: CudaDataType, dev: int,
                   pool: MemoryPool, size: int, nbytes: int) -> CudaTensor:
        t = CudaTensor(shape, dtype, dev, 0)
        t.on_host = True
        if t.nbytes == 0:
            try:
                t._host = np.empty(shape, dtype.numpy_dtype)
            except ValueError:  # NumPy caps the product of the other dims even when empty
                t._host = np.empty((0,) * len(shape), dtype.numpy_dtype)
            return t
        block = pool.allocate(t.nbytes)
        t._block, t._pool, t._ptr = block, pool, int(block)
        t._host = np.frombuffer(block._buf, dtype=dtype.numpy_dtype,
                                count=t.size).reshape(shape)
        return t

    def foreign_pointer(self, ptr: int, dev: int) -> None:
        # "device" memory is host memory, and a pointer the pool did not hand out would be
        # written with memmove, anywhere in the process
        raise InvalidPointerError(
            f"pointer 0x{ptr:x} was not allocated by the pool of device {dev} with "
            f"allocate_memory (fallback mode copies only to and from its own allocations)")

    # -- copies ---------------------------------------------------------------------
    def copy_to_device(self, host: np.ndarray, ptr: int, dev: int, capacity: Optional[int],
                       stream: Any) -> float:
        return host_copy(host, ptr, capacity, to_host=False)

    def copy_from_device(self, target: np.ndarray, ptr: int, dev: int,
                         capacity: Optional[int], stream: Any) -> float:
        return host_copy(target, ptr, capacity, to_host=True)

    def check_pinned(self, host: np.ndarray, what: str) -> None:
        pass    # every host array will do: the copy is synchronous anyway

    def copy_to_device_async(self, host: np.ndarray, ptr: int, dev: int,
                             capacity: Optional[int], tensor: Optional[CudaTensor],
                             stream: Any) -> None:
        host_copy(host, ptr, capacity, to_host=False)

    def copy_from_device_async(self, ptr: int, host: np.ndarray, dev: int,
                               capacity: Optional[int], tensor: Optional[CudaTensor],
                               stream: Any) -> None:
        host_copy(host, ptr, capacity, to_host=True)

    def copy_device_to_device(self, dptr: int, sptr: int, nbytes: int, dev: int,
                              stream: Any) -> float:
        ctypes.memmove(dptr, sptr, nbytes)
        return 0.0

    def memset_async(self, tensor: CudaTensor, value: int, stream: Any) -> None:
        tensor.host_view.view(np.uint32)[...] = value

    def can_access_peer(self, device_id: Any, peer_device: Any) -> bool:
        self.require("can_access_peer")
        return False

    def enable_peer(self, device_id: int, peer_device: int) -> bool:
        self.require("enable_peer_access")
        return False

    def copy_peer(self, out: CudaTensor, tensor: CudaTensor, enable: Callable[[int, int], bool],
                  stream: Any) -> None:
        ctypes.memmove(out.ptr, tensor.ptr, tensor.nbytes)     # one memory: a plain copy

    # -- kernels --------------------------------------------------------------------
    def compile(self, kernel_name: str, source_code: str, options: Any,
                device_id: Optional[int], arch: Optional[str], arg_types: Optional[str]) -> Any:
        self.require("compile_kernel")

    def get_kernel(self, kernel_name: str, device_id: Optional[int]) -> Any:
        self.require("get_kernel")

    def launch(self, kernel_name: str, grid_size: Any, args: Any, block_size: Any,
               shared_mem: int, stream: Any, device_id: Optional[int]) -> float:
        self.require("launch_kernel")
        return 0.0

    def prepare(self, kernel: Any, device_id: Optional[int], grid_size: Any, block_size: Any,
                shared_mem: int) -> Any:
        self.require("prepare_launch")

    def direct(self, device_id: int) -> bool:
        return False

    # -- profiling and shutdown ---------------------------------------------------------
    def set_profiler(self, profiler: Any) -> None:
        pass    # nothing is timed on the host

    def driver_version(self) -> Optional[int]:
        return None

    def shutdown(self) -> None:
        pass    # the pool's host buffers go with the process


def host_copy(host: np.ndarray, ptr: int, capacity: Optional[int], to_host: bool) -> float:
    """memmove between a C-contiguous host array and a pool block; returns 0.0 ms."""
    if capacity is not None and host.nbytes > capacity:
        raise TransferError(f"{host.nbytes} bytes do not fit the {capacity}-byte allocation")
    if host.nbytes:
        if to_host:
            ctypes.memmove(host.ctypes.data, ptr, host.nbytes)
        else:
            ctypes.memmove(ptr, host.ctypes.data, host.nbytes)
    return 0.0
