"""Device memory pools with statistics and an out-of-memory ladder.

`MemoryPool` wraps PyCUDA's `DeviceMemoryPool` (or, in fallback mode and in tests, the
pure-Python `HostBinnedPool` with the same interface) and adds what users of CuPy and
PyTorch expect: usage statistics, a limit, pointer-level allocate/free, and on failure
free cached blocks -> collect garbage -> retry once -> raise `CudaOutOfMemoryError`.
Sizes in the statistics are the pool's block sizes (requests rounded up to its bins).
"""
from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from typing import Any, Callable, Dict, Optional, Tuple, Type

import numpy as np

from .errors import CudaOutOfMemoryError, InvalidArgumentError, InvalidPointerError


def _round_to_bin(size: int) -> int:
    """Round up keeping the 3 leading bits (the same idea as PyCUDA's bins), min 256 bytes."""
    if size <= 256:
        return 256
    shift = max(size.bit_length() - 3, 0)
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
        self._ref = None

    def __int__(self) -> int:
        return self.ptr

    __index__ = __int__

    def free(self) -> None:
        if self._live:
            self._live = False
            self._pool._give_back(self)


class HostBinnedPool:
    """Pure-Python pool with the interface of `pycuda.tools.DeviceMemoryPool`.

    `allocator(size) -> (buffer, pointer)` makes a new block; tests pass a fake one that can
    be told to fail, fallback mode uses NumPy host buffers.
    """

    def __init__(self, allocator: Optional[Callable[[int], Tuple[Any, int]]] = None,
                 oom_error: Type[BaseException] = MemoryError) -> None:
        self._allocator = allocator or _numpy_host_allocator
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

    @property
    def active_blocks(self) -> int:
        self._reap()
        return self._active_blocks

    @property
    def active_bytes(self) -> int:
        self._reap()
        return self._active_bytes

    @property
    def held_blocks(self) -> int:
        self._reap()
        return self._held_blocks

    @property
    def managed_bytes(self) -> int:
        self._reap()
        return self._active_bytes + self._held_bytes

    def alloc_size(self, size: int) -> int:
        return _round_to_bin(size)

    def allocate(self, size: int) -> _HostBlock:
        self._reap()
        bin_size = _round_to_bin(size)
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


def _check_size(nbytes: Any) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise InvalidArgumentError(
            f"allocation size must be a non-negative int, got {nbytes!r}")
    return int(nbytes)


_NULL = contextlib.nullcontext()


def _numpy_host_allocator(size: int) -> Tuple[Any, int]:
    buf = np.empty(size, dtype=np.uint8)
    return buf, int(buf.ctypes.data)


class MemoryPool:
    """Statistics, limits and the OOM ladder over one device's pool."""

    def __init__(self, device_id: int, pool: Any, *, device_total: int = 0,
                 activate: Optional[Callable[[], Any]] = None,
                 oom_errors: Tuple[Type[BaseException], ...] = (MemoryError,)) -> None:
        self.device_id = device_id
        self._pool = pool
        self._device_total = device_total
        self._activate = activate or (lambda: _NULL)
        self._oom_errors = oom_errors
        self._lock = threading.Lock()
        self._limit = 0
        self._by_ptr: Dict[int, Any] = {}
        self.reset_counters()

    def reset_counters(self) -> None:
        self._total_requested = 0
        self._explicit_frees = 0
        self._hits = 0
        self._misses = 0
        self._oom_retries = 0
        self._peak = self._pool.active_bytes
        self._base_blocks = self._pool.active_blocks
        self._managed = self._pool.managed_bytes

    # -- allocation -----------------------------------------------------------------
    def allocate(self, nbytes: int) -> Any:
        """A pool block of at least nbytes (an object with int() and .free())."""
        if type(nbytes) is not int:
            nbytes = _check_size(nbytes)
        if nbytes <= 0:
            if nbytes < 0:
                raise InvalidArgumentError(f"allocation size must be >= 0 bytes, got {nbytes}")
            nbytes = 1
        ctx = self._activate()
        if ctx is not _NULL:
            with ctx:
                return self._allocate_locked(nbytes)
        return self._allocate_locked(nbytes)

    def _allocate_locked(self, nbytes: int) -> Any:
        """allocate() for an int nbytes > 0 with the pool's device context current (the
        ops' fast paths check both and call this directly).

        Two reads of the pool per call (its counters are C++ getters behind Boost.Python on
        a GPU): managed_bytes tells a hit from a miss, since only a new underlying allocation
        changes it (every free_held() of ours re-reads it; after an out-of-memory retry the
        call counts as a miss), and active_bytes keeps the peak. The allocation count is
        hits + misses."""
        pool = self._pool
        with self._lock:
            if self._limit:
                self._check_limit(nbytes)
            try:
                block = pool.allocate(nbytes)
            except self._oom_errors:
                block = self._retry_after_oom(nbytes)
                self._managed = -1                     # a miss, whatever the bytes say
            managed = pool.managed_bytes
            if managed == self._managed:
                self._hits += 1
            else:
                self._misses += 1
                self._managed = managed
            self._total_requested += nbytes
            active = pool.active_bytes
            if active > self._peak:
                self._peak = active
            return block

    def _free_held(self) -> None:
        """The pool's free_held(), then the managed bytes a hit leaves unchanged."""
        self._pool.free_held()
        self._managed = self._pool.managed_bytes

    def _retry_after_oom(self, nbytes: int) -> Any:
        self._oom_retries += 1
        self._free_held()
        gc.collect()
        self._free_held()
        try:
            return self._pool.allocate(nbytes)
        except self._oom_errors:
            raise CudaOutOfMemoryError(
                nbytes, self.device_id, self._pool.active_bytes, self.free_bytes(),
                self._limit or None,
                reason="the device is out of memory even after freeing cached blocks "
                       "and collecting garbage") from None

    def _check_limit(self, nbytes: int) -> None:
        size = self._alloc_size(nbytes)
        if self._pool.managed_bytes + size <= self._limit:
            return
        self._free_held()
        if self._pool.active_bytes + size > self._limit:
            raise CudaOutOfMemoryError(
                nbytes, self.device_id, self._pool.active_bytes, self.free_bytes(),
                self._limit,
                reason=f"it would exceed the pool limit of {self._limit} bytes "
                       f"(set with set_limit)")

    def _alloc_size(self, nbytes: int) -> int:
        pool = self._pool
        if hasattr(pool, "bin_number"):
            return int(pool.alloc_size(pool.bin_number(nbytes)))
        return int(pool.alloc_size(nbytes))

    def release(self, block: Any) -> None:
        """Give a block back to the pool (counted as an explicit free)."""
        with self._lock:
            self._explicit_frees += 1
            block.free()

    def allocate_memory(self, size: int) -> int:
        """Allocate and return a raw device pointer; free it with `free_memory`."""
        if size == 0 and type(size) is int:
            return 0
        block = self.allocate(size)
        ptr = int(block)
        self._by_ptr[ptr] = (block, size)
        return ptr

    def capacity(self, ptr: int) -> Optional[int]:
        """Bytes requested for a pointer from allocate_memory, None if unknown."""
        entry = self._by_ptr.get(ptr)
        return None if entry is None else entry[1]

    def free_memory(self, ptr: int) -> None:
        """Free a pointer from `allocate_memory`; unknown or already freed pointers raise."""
        if isinstance(ptr, bool) or not isinstance(ptr, (int, np.integer)):
            raise InvalidPointerError(
                f"pointer {ptr!r} was not allocated by the pool of device {self.device_id} "
                f"with allocate_memory (pointers are ints)")
        if ptr == 0:
            return
        with self._lock:
            entry = self._by_ptr.pop(ptr, None)
            if entry is None:
                raise InvalidPointerError(
                    f"pointer 0x{int(ptr):x} was not allocated by the pool of device "
                    f"{self.device_id} with allocate_memory, or was already freed")
            self._explicit_frees += 1
            entry[0].free()

    # -- CuPy-style queries -------------------------------------------------------
    def used_bytes(self) -> int:
        return int(self._pool.active_bytes)

    def total_bytes(self) -> int:
        return int(self._pool.managed_bytes)

    def free_bytes(self) -> int:
        return int(self._pool.managed_bytes - self._pool.active_bytes)

    def n_free_blocks(self) -> int:
        return int(self._pool.held_blocks)

    def free_all_blocks(self) -> None:
        """Return every cached (unused) block to the driver."""
        with self._activate(), self._lock:
            self._free_held()

    def set_limit(self, size: Optional[int] = None, fraction: Optional[float] = None) -> None:
        """Cap the pool's total bytes (in use + cached); no arguments or 0 removes the cap."""
        if size is not None and fraction is not None:
            raise InvalidArgumentError("give size or fraction, not both")
        if fraction is not None:
            if isinstance(fraction, bool) or \
                    not isinstance(fraction, (int, float, np.integer, np.floating)) or \
                    not 0 <= fraction <= 1:
                raise InvalidArgumentError(f"fraction must be in [0, 1], got {fraction}")
            size = int(fraction * self._device_total)
        if size is not None and (isinstance(size, bool) or
                                 not isinstance(size, (int, np.integer))):
            raise InvalidArgumentError(
                f"limit must be an int number of bytes (or None), got {size!r}")
        if size is not None and size < 0:
            raise InvalidArgumentError(f"limit must be >= 0 bytes, got {size}")
        self._limit = int(size or 0)

    def get_limit(self) -> int:
        """The cap in bytes, 0 when there is none (as in CuPy)."""
        return self._limit

    def reset_peak_stats(self) -> None:
        self._peak = self._pool.active_bytes

    def get_stats(self) -> Dict[str, int]:
        """The seed's keys plus cache and hit statistics."""
        pool = self._pool
        count = self._hits + self._misses
        return {
            "total_allocated": self._total_requested,
            "active_memory": int(pool.active_bytes),
            "peak_allocated": int(self._peak),
            "allocation_count": count,
            "active_blocks": int(pool.active_blocks),
            "cached_bytes": self.free_bytes(),
            "free_count": max(count - (int(pool.active_blocks) - self._base_blocks), 0),
            "n_free_blocks": int(pool.held_blocks),
            "hits": self._hits,
            "misses": self._misses,
            "oom_retries": self._oom_retries,
            "limit": self._limit,
        }

    def shutdown(self) -> None:
        """Free cached blocks and stop caching (used at exit)."""
        with self._activate(), self._lock:
            self._by_ptr.clear()
            self._pool.stop_holding()


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
