"""`CudaDeviceInfo`: what a GPU is and the limits kernels must respect."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Tuple


@dataclass(frozen=True)
class CudaDeviceInfo:
    """Properties of one GPU, read once from the driver."""

    device_id: int
    name: str
    compute_capability: Tuple[int, int]
    memory_total: int
    multiprocessor_count: int
    max_threads_per_block: int = 1024
    max_block_dims: Tuple[int, int, int] = (1024, 1024, 64)
    max_grid_dims: Tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    shared_memory_per_block: int = 48 * 1024
    shared_memory_per_block_optin: int = 48 * 1024
    shared_memory_per_multiprocessor: int = 0
    registers_per_block: int = 65536
    max_threads_per_multiprocessor: int = 2048
    # occupancy limits (occupancy.py); defaults: Hopper's, where the driver lacks the attribute
    registers_per_multiprocessor: int = 65536
    max_blocks_per_multiprocessor: int = 32
    reserved_shared_memory_per_block: int = 1024
    warp_size: int = 32
    l2_cache_size: int = 0
    clock_rate_khz: int = 0
    memory_clock_rate_khz: int = 0
    memory_bus_width_bits: int = 0
    pci_bus_id: str = ""
    extra: Dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def theoretical_bandwidth_gbps(self) -> float:
        """Peak DRAM bandwidth in GB/s: 2 transfers per memory clock × bus width in bytes."""
        return 2.0 * self.memory_clock_rate_khz * 1e3 * (self.memory_bus_width_bits / 8) / 1e9

    @property
    def arch(self) -> str:
        """nvcc architecture name, e.g. 'sm_90'."""
        return "sm_%d%d" % self.compute_capability

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        d["theoretical_bandwidth_gbps"] = round(self.theoretical_bandwidth_gbps, 1)
        d["arch"] = self.arch
        return d


def read_device_info(drv: Any, device_id: int) -> CudaDeviceInfo:
    """Read a device's properties through PyCUDA (no context needed)."""
    dev = drv.Device(device_id)
    A = drv.device_attribute

    def attr(name: str, default: int = 0) -> int:
        key = getattr(A, name, None)
        if key is None:
            return default
        try:
            return int(dev.get_attribute(key))
        except Exception:
            return default

    try:
        pci = dev.pci_bus_id()
    except Exception:
        pci = ""
    return CudaDeviceInfo(
        device_id=device_id,
        name=dev.name(),
        compute_capability=tuple(dev.compute_capability()),
        memory_total=int(dev.total_memory()),
        multiprocessor_count=attr("MULTIPROCESSOR_COUNT"),
        max_threads_per_block=attr("MAX_THREADS_PER_BLOCK", 1024),
        max_block_dims=(attr("MAX_BLOCK_DIM_X", 1024), attr("MAX_BLOCK_DIM_Y", 1024),
                        attr("MAX_BLOCK_DIM_Z", 64)),
        max_grid_dims=(attr("MAX_GRID_DIM_X", 2**31 - 1), attr("MAX_GRID_DIM_Y", 65535),
                       attr("MAX_GRID_DIM_Z", 65535)),
        shared_memory_per_block=attr("MAX_SHARED_MEMORY_PER_BLOCK", 48 * 1024),
        shared_memory_per_block_optin=attr("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", 48 * 1024),
        shared_memory_per_multiprocessor=attr("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"),
        registers_per_block=attr("MAX_REGISTERS_PER_BLOCK", 65536),
        max_threads_per_multiprocessor=attr("MAX_THREADS_PER_MULTIPROCESSOR", 2048),
        registers_per_multiprocessor=attr("MAX_REGISTERS_PER_MULTIPROCESSOR", 65536),
        max_blocks_per_multiprocessor=attr("MAX_BLOCKS_PER_MULTIPROCESSOR", 32),
        reserved_shared_memory_per_block=attr("RESERVED_SHARED_MEMORY_PER_BLOCK", 1024),
        warp_size=attr("WARP_SIZE", 32),
        l2_cache_size=attr("L2_CACHE_SIZE"),
        clock_rate_khz=attr("CLOCK_RATE"),
        memory_clock_rate_khz=attr("MEMORY_CLOCK_RATE"),
        memory_bus_width_bits=attr("GLOBAL_MEMORY_BUS_WIDTH"),
        pci_bus_id=pci,
    )


def enumerate_devices(drv: Any) -> List[CudaDeviceInfo]:
    return [read_device_info(drv, i) for i in range(drv.Device.count())]


def host_device_info() -> CudaDeviceInfo:
    """The pseudo-device fallback mode runs on (the host CPU, through NumPy)."""
    import os
    import platform
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 0
    return CudaDeviceInfo(device_id=0, name=f"host CPU ({platform.machine()}, NumPy fallback)",
                          compute_capability=(0, 0), memory_total=int(mem),
                          multiprocessor_count=os.cpu_count() or 1)
