"""`Runtime`: the one internal interface `CudaBackend` delegates its device plumbing to
(devices and contexts, allocation, copies, compilation and launches, profiling hooks,
shutdown), so that the backend does not branch on whether a GPU is there.

Two implementations: `runtime_cuda.CudaRuntime` (PyCUDA over the CUDA driver) and
`runtime_host.HostRuntime` (the host as device 0: NumPy buffers from a host pool, copies with
memmove, and CudaNotAvailableError for what needs a GPU). The backend validates arguments
and checks what is common (dtypes, sizes, capacities) before calling a runtime; a runtime
receives valid devices, pointers and sizes.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import numpy as np

from .devices import CudaDeviceInfo
from .driver import load_driver
from .dtypes import CudaDataType
from .memory import MemoryPool
from .tensor import CudaTensor

logger = logging.getLogger("cuda_backend")
FALLBACK_MESSAGE = "PyCUDA not available. CUDA backend will use fallback mode."


def load_runtime(owner: Any) -> "Runtime":
    """The CUDA runtime when the driver loads, else the host one (logging FALLBACK_MESSAGE
    and why); owner, the CudaBackend, owns the runtime's pools."""
    drv, reason = load_driver()
    if drv is None:
        logger.warning("%s (%s)", FALLBACK_MESSAGE, reason)
        from .runtime_host import HostRuntime
        return HostRuntime(reason, owner)
    from .runtime_cuda import CudaRuntime
    return CudaRuntime(drv, owner)


class Runtime(ABC):
    """What a device runtime provides to `CudaBackend`.

    The attributes `drv`, `contexts`, `pinned`, `transfers`, `compiler` and `launcher` are the
    CUDA runtime's parts (None on the host); the backend exposes them as `drv` etc. to the
    modules that drive PyCUDA directly (streams, timing, parallel copies).
    """

    is_gpu: bool
    reason: Optional[str]                   # why there is no GPU (None with one)
    devices: List[CudaDeviceInfo]
    memory_pools: Dict[int, MemoryPool]
    drv: Any
    contexts: Any
    pinned: Any
    transfers: Any
    compiler: Any
    launcher: Any
    # per-call paths, bound once (an instance attribute where a part's method does the work)
    validate: Callable[[Any], int]          # a valid device id, or InvalidDeviceError
    current_device: Callable[[], int]       # the calling thread's current device
    direct: Callable[[int], bool]           # launch.Launcher.direct (False on the host)

    @property
    @abstractmethod
    def device_count(self) -> int:
        """Number of GPUs (0 on the host)."""

    # -- devices and contexts -------------------------------------------------------
    @abstractmethod
    def set_device(self, device_id: Any) -> None:
        """Make device_id current for the calling thread."""

    @abstractmethod
    def device(self, device_id: Any) -> ContextManager[Any]:
        """A `with` block on device_id that restores the previous device."""

    @abstractmethod
    def activate(self, device_id: int) -> ContextManager[Any]:
        """device_id's context current for one operation."""

    @abstractmethod
    def require(self, what: str) -> None:
        """Raise CudaNotAvailableError naming `what` unless a GPU is there."""

    @abstractmethod
    def context(self, device_id: Any) -> Any:
        """The device's retained primary context."""

    @abstractmethod
    def synchronize(self, device_id: Optional[int]) -> None:
        """Wait for one device (a valid id) or, with None, every device that was used."""

    def error_slot(self, key: Any, make_error: Any) -> int:
        """The device pointer of a checking kernel's error slot (device_errors.py)."""
        raise NotImplementedError("device-side checks run only on a GPU")

    def raise_device_errors(self) -> None:
        """Raise what checking kernels found since the last call (device_errors.py); the host
        runtime's checks raise at once, so nothing is pending here."""

    @abstractmethod
    def wait_for_foreign_stream(self, handle: int, device_id: int) -> None:
        """Order this thread's stream on device_id after another library's stream."""

    # -- memory ---------------------------------------------------------------------
    @abstractmethod
    def pinned_empty(self, shape: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A host array that async copies may use."""

    @abstractmethod
    def new_tensor(self, shape: Tuple[int, ...], dtype: CudaDataType, dev: int,
                   pool: MemoryPool, size: int, nbytes: int) -> CudaTensor:
        """A tensor from `pool` (shape, size and nbytes already checked)."""

    @abstractmethod
    def foreign_pointer(self, ptr: int, dev: int) -> None:
        """A copy targets ptr, which dev's pool did not hand out: allow it or raise."""

    # -- copies ---------------------------------------------------------------------
    @abstractmethod
    def copy_to_device(self, host: np.ndarray, ptr: int, dev: int, capacity: Optional[int],
                       stream: Any) -> float:
        """Copy a C-contiguous host array to ptr; returns ms (see CudaBackend)."""

    @abstractmethod
    def copy_from_device(self, target: np.ndarray, ptr: int, dev: int,
                         capacity: Optional[int], stream: Any) -> float:
        """Copy from ptr into a C-contiguous native-order host array; returns ms."""

    @abstractmethod
    def check_pinned(self, host: np.ndarray, what: str) -> None:
        """Raise TransferError when an async copy's host array cannot be used."""

    @abstractmethod
    def copy_to_device_async(self, host: np.ndarray, ptr: int, dev: int,
                             capacity: Optional[int], tensor: Optional[CudaTensor],
                             stream: Any) -> None:
        """Queue a copy of host to ptr on stream."""

    @abstractmethod
    def copy_from_device_async(self, ptr: int, host: np.ndarray, dev: int,
                               capacity: Optional[int], tensor: Optional[CudaTensor],
                               stream: Any) -> None:
        """Queue a copy of ptr into host on stream."""

    @abstractmethod
    def copy_device_to_device(self, dptr: int, sptr: int, nbytes: int, dev: int,
                              stream: Any) -> float:
        """Copy nbytes (checked against both capacities) on one device; returns ms."""

    @abstractmethod
    def memset_async(self, tensor: CudaTensor, value: int, stream: Any) -> None:
        """Set every 32-bit word of a live tensor (nbytes a multiple of 4) to value."""

    @abstractmethod
    def can_access_peer(self, device_id: Any, peer_device: Any) -> bool:
        """Whether device_id can read peer_device's memory directly."""

    @abstractmethod
    def enable_peer(self, device_id: int, peer_device: int) -> bool:
        """Enable device_id -> peer_device access (two distinct devices that can)."""

    @abstractmethod
    def copy_peer(self, out: CudaTensor, tensor: CudaTensor, enable: Callable[[int, int], bool],
                  stream: Any) -> None:
        """Copy tensor into out on another device; enable(a, b) enables a -> b peer access
        (CudaBackend.enable_peer_access, once per pair) and says whether it can."""

    # -- kernels --------------------------------------------------------------------
    @abstractmethod
    def compile(self, kernel_name: str, source_code: str, options: Any,
                device_id: Optional[int], arch: Optional[str], arg_types: Optional[str]) -> Any:
        """Compile (cached) for device_id (None: the current one); a CudaKernel."""

    @abstractmethod
    def get_kernel(self, kernel_name: str, device_id: Optional[int]) -> Any:
        """A kernel compiled before."""

    @abstractmethod
    def launch(self, kernel_name: str, grid_size: Any, args: Any, block_size: Any,
               shared_mem: int, stream: Any, device_id: Optional[int]) -> float:
        """Launch a compiled kernel (launch.Launcher.launch)."""

    @abstractmethod
    def prepare(self, kernel: Any, device_id: Optional[int], grid_size: Any, block_size: Any,
                shared_mem: int) -> Any:
        """A launch.PreparedLaunch of a compiled kernel."""

    # -- profiling and shutdown ---------------------------------------------------------
    @abstractmethod
    def set_profiler(self, profiler: Any) -> None:
        """Time launches and copies into profiler (None: stop timing)."""

    @abstractmethod
    def driver_version(self) -> Optional[int]:
        """The CUDA driver's version (None on the host)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Wait for the devices, free pools and modules, release contexts."""
