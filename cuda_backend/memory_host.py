"""Host-memory pools: `HostBinnedPool`, the pure-Python pool with the interface of PyCUDA's
`DeviceMemoryPool` that fallback mode and the tests put under a `MemoryPool` (NumPy host
buffers, or a fake allocator that can be told to fail), and `PinnedHostPool`, the page-locked
staging buffers of the copies (PyCUDA's `PageLockedMemoryPool`).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, Optional, Tuple, Type

import numpy as np


def round_to_bin(size: int) -> int:
    """Round up keeping the 3 leading bits (the same idea as PyCUDA's bins), min 256 bytes."""
    if size <= 256:
        return 256
    shift = max(size.bit_length() - 3, 0)
    return ((size + (1 << shift) - 1) >> shift) << shift


LARGE_BLOCK = 16 << 20   # requests of this many bytes or more: MemoryPool's large pool


def round_to_fine_bin(size: int) -> int:
    """Round up keeping the 5 leading bits: at most 1/16 over the request (3.1 % from 32 MiB),
    where 3 bits waste up to 25 % (perf/NOTES.md, GPT-2-small peak memory)."""
    if size <= 256:
        return 256
    shift = max(size.bit_length() - 5, 0)
    return ((size + (1 << shift) - 1) >> shift) << shift


class _HostBlock:
    """A pool block backed by host memory (fallback mode / fake allocator).

    It has no __del__: a block that is garbage-collected without free() is noticed by its
    pool through a weak reference whose callback is the C method list.append, so no Python
    code runs while it dies (a KeyboardInterrupt arriving in a Python __del__ would be
    swallowed, and the block's bytes would stay counted as active)."""

    __slots__ = ("_pool", "_buf", "ptr", "size", "_live", "_ref", "__weakref__")

    def __init__(self, pool: "HostBinnedPool", buf: Any, ptr: int, size: int) -> None:
        self._pool, self._buf, self.ptr, self.size, self._live = pool, buf, ptr, size, True
        self._ref: Optional["weakref.ReferenceType[_HostBlock]"] = None

    def __int__(self) -> int:
        return self.ptr

    __index__ = __int__

    def free(self) -> None:
        if self._live:
            self._live = False
            self._pool._give_back(self)


def _reaped(count: str) -> Any:
    """A read-only property: the pool's counter `count`, after the blocks that were
    garbage-collected without free() are taken back (HostBinnedPool._reap)."""
    def get(pool: "HostBinnedPool") -> int:
        pool._reap()
        return getattr(pool, count)
    return property(get)


class HostBinnedPool:
    """Pure-Python pool with the interface of `pycuda.tools.DeviceMemoryPool`.

    `allocator(size) -> (buffer, pointer)` makes a new block; tests pass a fake one that can
    be told to fail, fallback mode uses NumPy host buffers. `rounding`: request -> block size
    (PyCUDA's bins by default; MemoryPool's large pool uses finer ones).
    """

    def __init__(self, allocator: Optional[Callable[[int], Tuple[Any, int]]] = None,
                 oom_error: Type[BaseException] = MemoryError,
                 rounding: Callable[[int], int] = round_to_bin) -> None:
        self._allocator = allocator or _numpy_host_allocator
        self._round = rounding
        self.oom_error = oom_error
        self._held: Dict[int, list] = {}
        self._active_blocks = 0
        self._active_bytes = 0
        self._held_blocks = 0
        self._held_bytes = 0
        self._holding = True
        self.underlying_allocations = 0
        self.underlying_frees = 0
        self._lock = threading.RLock()
        self._refs: Dict[Any, Tuple[Any, int, int]] = {}  # weakref -> (buffer, ptr, size)
        self._dead: list = []                              # weakrefs of collected blocks
        self._dead_append = self._dead.append

    def _reap(self) -> None:
        """Take back the blocks that were garbage-collected without free()."""
        if self._dead:
            with self._lock:
                while self._dead:
                    entry = self._refs.pop(self._dead.pop(), None)
                    if entry is not None:
                        self._release(*entry)

    active_blocks = _reaped("_active_blocks")
    active_bytes = _reaped("_active_bytes")
    held_blocks = _reaped("_held_blocks")

    @property
    def managed_bytes(self) -> int:
        self._reap()
        return self._active_bytes + self._held_bytes

    def alloc_size(self, size: int) -> int:
        return self._round(size)

    def allocate(self, size: int) -> _HostBlock:
        self._reap()
        bin_size = self._round(size)
        with self._lock:
            stack = self._held.get(bin_size)
            if stack:
                buf, ptr = stack.pop()
                self._held_blocks -= 1
                self._held_bytes -= bin_size
            else:
                buf, ptr = self._allocator(bin_size)  # may raise oom_error
                self.underlying_allocations += 1
            self._active_blocks += 1
            self._active_bytes += bin_size
            block = _HostBlock(self, buf, ptr, bin_size)
            ref = weakref.ref(block, self._dead_append)
            block._ref = ref
            self._refs[ref] = (buf, ptr, bin_size)
            return block

    def _give_back(self, block: _HostBlock) -> None:
        with self._lock:
            entry = self._refs.pop(block._ref, None)
            if entry is not None:
                self._release(*entry)
        block._buf = None

    def _release(self, buf: Any, ptr: int, size: int) -> None:
        self._active_blocks -= 1
        self._active_bytes -= size
        if self._holding:
            self._held.setdefault(size, []).append((buf, ptr))
            self._held_blocks += 1
            self._held_bytes += size
        else:
            self.underlying_frees += 1

    def free_held(self) -> None:
        self._reap()
        with self._lock:
            self.underlying_frees += self._held_blocks
            self._held.clear()
            self._held_blocks = 0
            self._held_bytes = 0

    def stop_holding(self) -> None:
        self._reap()
        self._holding = False
        self.free_held()



def _numpy_host_allocator(size: int) -> Tuple[Any, int]:
    buf = np.empty(size, dtype=np.uint8)
    return buf, int(buf.ctypes.data)


class PinnedHostPool:
    """Page-locked host buffers from `pycuda.tools.PageLockedMemoryPool`, with counts."""

    def __init__(self, drv: Any) -> None:
        import pycuda.tools
        self._pool = pycuda.tools.PageLockedMemoryPool()
        self._lock = threading.Lock()
        self.allocations = 0

    def empty(self, shape: Any, dtype: Any) -> np.ndarray:
        with self._lock:
            self.allocations += 1
            return self._pool.allocate(shape, np.dtype(dtype))

    @property
    def held_blocks(self) -> int:
        return int(self._pool.held_blocks)

    @property
    def active_blocks(self) -> int:
        return int(self._pool.active_blocks)

    def free_held(self) -> None:
        self._pool.free_held()

    def shutdown(self) -> None:
        self._pool.stop_holding()
