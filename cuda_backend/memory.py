"""Device memory pools with statistics and an out-of-memory ladder.

`MemoryPool` wraps PyCUDA's `DeviceMemoryPool` (or, in fallback mode and in tests, the
pure-Python `HostBinnedPool` with the same interface) and adds what users of CuPy and
PyTorch expect: usage statistics, a limit, pointer-level allocate/free, and on failure
free cached blocks -> collect garbage -> retry once -> raise `CudaOutOfMemoryError`.
Sizes in the statistics are the pools' block sizes (requests rounded up to their bins):
requests of LARGE_BLOCK (16 MiB) or more go to a second pool with finer bins (at most 1/16
over the request, where PyCUDA's bins take up to 1/4: perf/NOTES.md, GPT-2-small peak
memory), the rest to the binned pool; the statistics sum the two.

Stream order (memory_streams.py): a block used on the stream of a `with stream:` is reused by
another stream only after the work issued on it before the free has completed (PyTorch's
`record_stream`); the blocks of a CUDA graph stay the graph's until `release_graph`.

Finalizers: `release()` and `StreamBlock.free()` take no lock (they free, or queue the block
with a list append), so a `__del__` that frees a tensor can run at any point, also while this
thread holds the pool's lock; `gc.collect()` of the out-of-memory ladder runs outside it.

The parts: memory_host.py (`HostBinnedPool`, `PinnedHostPool`), memory_streams.py (stream
order: `StreamBlock`, `record_stream`, `GraphMemory`, and `StreamOrder`, the free lists
`MemoryPool` inherits); all of them importable from here.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import threading
from typing import Any, Callable, Dict, Optional, Tuple, Type

import numpy as np

from .errors import CudaOutOfMemoryError, InvalidArgumentError, InvalidPointerError
from .memory_host import LARGE_BLOCK, HostBinnedPool, PinnedHostPool
from .memory_streams import DriverEvents, GraphMemory, StreamBlock, StreamOrder, record_stream
from .streams import current_pycuda_stream, local_state as _stream_local

__all__ = ["MemoryPool", "NULL_CONTEXT", "HostBinnedPool", "PinnedHostPool", "DriverEvents",
           "GraphMemory", "StreamBlock", "StreamOrder", "record_stream"]


def _check_size(nbytes: Any) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise InvalidArgumentError(
            f"allocation size must be a non-negative int, got {nbytes!r}")
    return int(nbytes)


NULL_CONTEXT = contextlib.nullcontext()  # activate()'s no-op (contexts.py returns the same one)
_CURRENT = object()  # allocate()'s default stream: this thread's `with stream:` one


class MemoryPool(StreamOrder):
    """Statistics, limits, stream order and the OOM ladder over one device's pool."""

    def __init__(self, device_id: int, pool: Any, *, device_total: int = 0,
                 activate: Optional[Callable[[], Any]] = None,
                 oom_errors: Tuple[Type[BaseException], ...] = (MemoryError,),
                 events: Any = None, large: Optional[HostBinnedPool] = None) -> None:
        """pool: the binned pool (PyCUDA's DeviceMemoryPool, or HostBinnedPool); large: a
        HostBinnedPool with finer bins for requests of LARGE_BLOCK bytes or more (None: the
        binned pool takes every request). The statistics sum the two."""
        self.device_id = device_id
        self.owner: Any = None   # the CudaBackend that made it (its tensors' operators use it)
        self._pool = pool
        self._large: Any = large   # HostBinnedPool or None (Any: read on the hot path)
        self._large_min = LARGE_BLOCK if large is not None else 1 << 62
        self._device_total = device_total
        self._activate = activate or (lambda: NULL_CONTEXT)
        self._oom_errors = oom_errors
        self._events = events
        self._lock = threading.RLock()
        self._limit = 0
        self._by_ptr: Dict[int, Any] = {}
        # stream-ordered frees: _returned is appended to without the lock (see the module
        # docstring) and sorted into _ready / _waiting under it
        self._returned: list = []
        self._ready: Dict[Tuple[Any, int], list] = {}        # (stream, size) -> [entry]
        self._ready_fifo: Dict[Any, collections.deque] = {}  # stream -> entries, free order
        self._waiting: list = []       # entries that wait for events on other streams
        self._deferred_bytes = 0
        self._deferred_blocks = 0
        self._graphs: Dict[Any, GraphMemory] = {}   # stream -> graph it is capturing
        self._closed = False
        self.reset_counters()

    def reset_counters(self) -> None:
        self._total_requested = 0
        self._explicit_frees = 0
        self._hits = 0
        self._misses = 0
        self._oom_retries = 0
        self._peak = self._total("active_bytes")
        self._base_blocks = self._total("active_blocks") - self._deferred_blocks
        self._seen_managed = [self._pool.managed_bytes,
                              self._large.managed_bytes if self._large is not None else 0]

    # -- the two pools' counters together ------------------------------------------
    def _total(self, counter: str) -> int:
        """The pool's counter (active_bytes, managed_bytes, held_blocks, active_blocks) plus
        the large-block pool's, where there is one."""
        large = self._large
        return int(getattr(self._pool, counter)) + (0 if large is None else
                                                     getattr(large, counter))

    # -- allocation -----------------------------------------------------------------
    def allocate(self, nbytes: int, stream: Any = _CURRENT) -> Any:
        """A pool block of at least nbytes (an object with int() and .free()), ordered on
        `stream` (default: this thread's `with stream:` stream on this device, else the
        legacy default stream)."""
        if type(nbytes) is not int:
            nbytes = _check_size(nbytes)
        if nbytes <= 0:
            if nbytes < 0:
                raise InvalidArgumentError(f"allocation size must be >= 0 bytes, got {nbytes}")
            nbytes = 1
        ctx = self._activate()
        if ctx is not NULL_CONTEXT:
            with ctx:
                return self._allocate_locked(nbytes, stream)
        return self._allocate_locked(nbytes, stream)

    def _allocate_locked(self, nbytes: int, stream: Any = _CURRENT) -> Any:
        """allocate() for an int nbytes > 0 with the pool's device context current (the
        ops' fast paths check both and call this directly).

        Two reads of the pool per call (its counters are C++ getters behind Boost.Python on
        a GPU): managed_bytes tells a hit from a miss, since only a new underlying allocation
        changes it (every free_held() of ours re-reads it; after an out-of-memory retry the
        call counts as a miss), and active_bytes keeps the peak. The allocation count is
        hits + misses."""
        if stream is _CURRENT:
            stream = current_pycuda_stream(self.device_id) if _stream_local.__dict__.get(
                "stack") else None
        pool = self._pool
        if stream is not None and self._graphs:
            graph = self._graphs.get(stream)
            if graph is not None:
                return self._allocate_for_graph(graph, nbytes)
        with self._lock:
            if self._returned or self._deferred_blocks:
                self._sort_returned()
            if stream is not None and self._ready:
                block = self._take_ready(stream, nbytes)
                if block is not None:
                    self._hits += 1
                    self._total_requested += nbytes
                    return StreamBlock(self, block, stream, self._alloc_size(nbytes))
            if self._limit:
                self._check_limit(nbytes)
            big = nbytes >= self._large_min
            try:
                block = (self._large if big else pool).allocate(nbytes)
            except self._oom_errors:
                block = None
            if block is not None:
                self._count(nbytes, big)
                if stream is None:
                    return block
        if block is None:       # outside the lock: collecting garbage runs finalizers
            block = self._retry_after_oom(nbytes, big)
            if block is None:
                raise self._oom_error(nbytes)
            with self._lock:
                self._count(nbytes, big)
            if stream is None:
                return block
        return StreamBlock(self, block, stream, self._alloc_size(nbytes))

    def _allocate_for_graph(self, graph: GraphMemory, nbytes: int) -> StreamBlock:
        """An allocation on a stream that captures a graph: a block the capture freed (of
        this size, else the smallest at most 1/4 larger), else one from the pool; either way
        owned by the graph."""
        size = self._alloc_size(nbytes)
        reusable = graph.free_bins.get(size)
        if not reusable and graph.free_bins:
            # best fit: the smallest freed block at most 1/4 over this one (a capture runs
            # once; its freed blocks are the graph's for good: tests/test_graphs.py)
            fits = [s for s, blocks in graph.free_bins.items()
                    if blocks and size < s <= size + size // 4]
            if fits:
                size = min(fits)
                reusable = graph.free_bins[size]
        if reusable:
            with self._lock:
                self._hits += 1
                self._total_requested += nbytes
            return StreamBlock(self, reusable.pop(), graph.stream, size, graph)
        self._graphs.pop(graph.stream)       # a plain stream allocation, then the graph's
        try:
            block = self._allocate_locked(nbytes, graph.stream)
        finally:
            self._graphs[graph.stream] = graph
        block.graph = graph
        return block

    def _count(self, nbytes: int, big: bool = False) -> None:
        """(Lock held.) Hit or miss, requested bytes and the peak of one allocation (big:
        the large pool served it)."""
        pool, large = self._pool, self._large
        managed = (large if big else pool).managed_bytes
        seen = self._seen_managed      # [small pool's, large pool's] at the last allocation
        if managed == seen[big]:
            self._hits += 1
        else:
            self._misses += 1
            seen[big] = managed
        self._total_requested += nbytes
        active = pool.active_bytes
        if large is not None:
            active += large._active_bytes   # (a counter: garbage-collected blocks reaped later)
        if active > self._peak:
            self._peak = active

    # allocate() for an int nbytes > 0 with the pool's device context current: the per-call
    # plans of the ops (ops/common.py) check both before calling it
    allocate_current = _allocate_locked

    def _free_held(self) -> None:
        """The pools' free_held(), then the managed bytes a hit leaves unchanged."""
        self._pool.free_held()
        self._seen_managed[0] = self._pool.managed_bytes
        if self._large is not None:
            self._large.free_held()
            self._seen_managed[1] = self._large.managed_bytes

    def _retry_after_oom(self, nbytes: int, big: bool = False) -> Any:
        """Wait for stream-ordered frees, free cached blocks, collect garbage, retry once;
        None if the retry fails too."""
        gc.collect()
        with self._lock:
            self._oom_retries += 1
            self._flush_deferred()
            self._free_held()
            self._seen_managed[:] = [-1, -1]    # a miss, whatever the bytes say
            try:
                return (self._large if big else self._pool).allocate(nbytes)
            except self._oom_errors:
                return None

    def _oom_error(self, nbytes: int) -> CudaOutOfMemoryError:
        return CudaOutOfMemoryError(
            nbytes, self.device_id, self.used_bytes(), self.free_bytes(), self._limit or None,
            reason="the device is out of memory even after freeing cached blocks "
                   "and collecting garbage")

    def _check_limit(self, nbytes: int) -> None:
        size = self._alloc_size(nbytes)
        if self._total("managed_bytes") + size <= self._limit:
            return
        self._flush_deferred()
        self._free_held()
        if self._total("active_bytes") + size > self._limit:
            raise CudaOutOfMemoryError(
                nbytes, self.device_id, self._total("active_bytes"), self.free_bytes(),
                self._limit,
                reason=f"it would exceed the pool limit of {self._limit} bytes "
                       f"(set with set_limit)")

    def _alloc_size(self, nbytes: int) -> int:
        if nbytes >= self._large_min:
            return int(self._large.alloc_size(nbytes))
        pool = self._pool
        if hasattr(pool, "bin_number"):
            return int(pool.alloc_size(pool.bin_number(nbytes)))
        return int(pool.alloc_size(nbytes))

    def release(self, block: Any) -> None:
        """Give a block back to the pool (counted as an explicit free). Takes no lock."""
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
        entry = self._by_ptr.pop(int(ptr), None)   # one atomic dict operation, no lock
        if entry is None:
            raise InvalidPointerError(
                f"pointer 0x{int(ptr):x} was not allocated by the pool of device "
                f"{self.device_id} with allocate_memory, or was already freed")
        self.release(entry[0])

    # -- CuPy-style queries -------------------------------------------------------
    def _settle(self) -> None:
        if self._returned or self._deferred_blocks:
            with self._activate(), self._lock:
                self._sort_returned()

    def used_bytes(self) -> int:
        self._settle()
        return self._total("active_bytes") - self._deferred_bytes

    def total_bytes(self) -> int:
        return self._total("managed_bytes")

    def free_bytes(self) -> int:
        self._settle()
        return self._total("managed_bytes") - self._total("active_bytes") + self._deferred_bytes

    def n_free_blocks(self) -> int:
        self._settle()
        return self._total("held_blocks") + self._deferred_blocks

    def free_all_blocks(self) -> None:
        """Return every cached (unused) block to the driver, after the stream work that
        stream-ordered frees wait on."""
        with self._activate(), self._lock:
            self._flush_deferred()
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
        self._peak = self._total("active_bytes")

    def get_stats(self) -> Dict[str, int]:
        """The documented API's keys plus cache and hit statistics. Blocks waiting in stream-ordered
        free lists count as cached, not active."""
        self._settle()
        count = self._hits + self._misses
        active_blocks = self._total("active_blocks") - self._deferred_blocks
        return {
            "total_allocated": self._total_requested,
            "active_memory": self._total("active_bytes") - self._deferred_bytes,
            "peak_allocated": int(self._peak),
            "allocation_count": count,
            "active_blocks": active_blocks,
            "cached_bytes": self.free_bytes(),
            "free_count": max(count - (active_blocks - self._base_blocks), 0),
            "n_free_blocks": self._total("held_blocks") + self._deferred_blocks,
            "hits": self._hits,
            "misses": self._misses,
            "oom_retries": self._oom_retries,
            "limit": self._limit,
        }

    def shutdown(self) -> None:
        """Wait for stream-ordered frees, free cached blocks and stop caching (at exit)."""
        with self._activate(), self._lock:
            try:
                self._flush_deferred()
            except Exception:
                # a faulted context: its events never complete; the blocks are dropped with
                # the lists, and PyCUDA frees them as they are collected
                self._ready, self._ready_fifo, self._waiting = {}, {}, []
            finally:
                self._closed = True
                self._by_ptr.clear()
                self._pool.stop_holding()
                if self._large is not None:
                    self._large.stop_holding()
