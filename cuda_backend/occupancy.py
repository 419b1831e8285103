"""Resident blocks per SM: the CUDA occupancy calculator's arithmetic on a device's limits.

`blocks_per_sm(kernel, info, threads, dynamic_smem)` is the one occupancy rule every op's
launch sizing and __launch_bounds__ budget uses (softmax, normalization, matmul, transpose,
reduction). It follows cuda_occupancy.h (cudaOccMaxActiveBlocksPerMultiprocessor), the
formula PyCUDA's OccupancyRecord takes from the same calculator:

* warps: the SM's warps (max threads per SM / warp size) over the block's warps (rounded up);
* registers: each warp takes registers x 32 rounded up to the allocation unit (256), in one of
  the SM's 4 sub-partitions (each a quarter of the register file);
* shared memory: static + dynamic + the driver's per-block reserve, rounded up to the
  allocation unit (128 bytes from sm_80 on, 256 before), out of the SM's shared memory;
* blocks: the SM's maximum resident blocks.

The limits come from `CudaDeviceInfo` (devices.py); a missing `info`, or a zero field (not
reported), takes the Hopper value. `kernel` is anything with `num_regs` and
`static_shared_bytes` (a CompiledKernel, or `KernelResources` for a budget planned before
compiling); 0 registers means no register limit, as in the calculator.
"""
from __future__ import annotations

from typing import Any, NamedTuple

# Hopper (H100 / H200) limits: used where the device info lacks one
REGISTERS_PER_SM = 65536
THREADS_PER_SM = 2048
BLOCKS_PER_SM = 32
SHARED_MEMORY_PER_SM = 228 * 1024
RESERVED_SHARED_MEMORY_PER_BLOCK = 1024
WARP_SIZE = 32
# not device attributes: the calculator's per-architecture constants
REGISTER_ALLOCATION_UNIT = 256   # registers per warp are allocated in these units (sm_30+)
MAX_REGISTERS_PER_THREAD = 255
SUB_PARTITIONS = 4               # register file quarters (warp schedulers) per SM


class KernelResources(NamedTuple):
    """What a kernel takes per thread and per block, for a budget computed before it is
    compiled (a template's __launch_bounds__ minimum)."""
    num_regs: int
    static_shared_bytes: int = 0


def _limit(info: Any, name: str, default: int) -> int:
    value = getattr(info, name, 0) if info is not None else 0
    return int(value or default)


def shared_memory_granularity(info: Any) -> int:
    """Shared memory allocation unit in bytes: 128 from compute capability 8.0, else 256."""
    cc = getattr(info, "compute_capability", None) if info is not None else None
    return 256 if cc and 0 < cc[0] < 8 else 128


def sub_partitions(info: Any) -> int:
    """Register file partitions per SM: 2 on sm_60 (GP100), else 4."""
    cc = getattr(info, "compute_capability", None) if info is not None else None
    return 2 if cc and tuple(cc) == (6, 0) else SUB_PARTITIONS


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def blocks_per_sm(kernel: Any, info: Any, threads: int, dynamic_smem: int = 0) -> int:
    """Blocks of `threads` threads one SM holds at once (at least 1: a block no SM can hold
    fails at launch, launch.py) by registers, warps, shared memory and the block limit."""
    warp = _limit(info, "warp_size", WARP_SIZE)
    warps = max(1, -(-int(threads) // warp))
    limits = [_limit(info, "max_blocks_per_multiprocessor", BLOCKS_PER_SM),
              _limit(info, "max_threads_per_multiprocessor", THREADS_PER_SM) // warp // warps]
    regs = min(int(getattr(kernel, "num_regs", 0) or 0), MAX_REGISTERS_PER_THREAD)
    if regs > 0:
        per_warp = _round_up(regs * warp, REGISTER_ALLOCATION_UNIT)
        parts = sub_partitions(info)
        per_part = _limit(info, "registers_per_multiprocessor", REGISTERS_PER_SM) // parts
        limits.append(per_part // per_warp * parts // warps)
    smem = int(getattr(kernel, "static_shared_bytes", 0) or 0) + int(dynamic_smem) + \
        int(getattr(info, "reserved_shared_memory_per_block", RESERVED_SHARED_MEMORY_PER_BLOCK)
            if info is not None else RESERVED_SHARED_MEMORY_PER_BLOCK)
    if smem > 0:
        limits.append(_limit(info, "shared_memory_per_multiprocessor", SHARED_MEMORY_PER_SM)
                      // _round_up(smem, shared_memory_granularity(info)))
    return max(1, min(limits))
