"""Device memory pools with statistics and an out-of-memory ladder.

`MemoryPool` wraps PyCUDA's `DeviceMemoryPool` (or, in fallback mode and in tests, the
pure-Python `HostBinnedPool` with the same interface) and adds what users of CuPy and
PyTorch expect: usage statistics, a limit, pointer-level allocate/free, and on failure
free cached blocks -> collect garbage -> retry once -> raise `CudaOutOfMemoryError`.
Sizes in the statistics are the pool's block sizes (requests rounded up to its bins).

Stream order: a block allocated inside `with stream:` (or used there by a launch or copy) is a
`StreamBlock`. When it is freed it is reusable at once on the stream that allocated it, and by
any other stream only after events recorded at the free, on every stream that used it, have
completed (PyTorch's caching allocator with `record_stream`, CuPy's per-stream pools).
Blocks only ever used on the legacy default stream go back to the shared pool at once: the
streams of `backend.stream()` are blocking streams, ordered after earlier default-stream work.

Finalizers: `release()` and `StreamBlock.free()` take no lock (they free, or queue the block
with a list append), so a `__del__` that frees a tensor can run at any point, also while this
thread holds the pool's lock; `gc.collect()` of the out-of-memory ladder runs outside it.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import threading
import weakref
from typing import Any, Callable, Dict, Optional, Tuple, Type

import numpy as np

from .errors import CudaOutOfMemoryError, InvalidArgumentError, InvalidPointerError
from .streams import current_pycuda_stream, local_state as _stream_local


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
        self._ref: Optional["weakref.ReferenceType[_HostBlock]"] = None

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


class StreamBlock:
    """A pool block tied to streams: the one it was allocated on (`stream`, None for the
    legacy default stream) and any other that used it (`uses`). `free()` records an event on
    each and hands the block to its pool's stream-ordered free list; a StreamBlock that is
    garbage-collected without free() is freed the same way."""

    __slots__ = ("block", "ptr", "size", "pool", "stream", "uses", "graph")

    def __init__(self, pool: "MemoryPool", block: Any, stream: Any, size: int,
                 graph: Optional["GraphMemory"] = None) -> None:
        self.block, self.ptr, self.size, self.pool = block, int(block), size, pool
        self.stream = stream
        self.uses: set = set()
        self.graph = graph   # set when allocated while `stream` captured a CUDA graph

    def __int__(self) -> int:
        return self.ptr

    __index__ = __int__

    def free(self) -> None:
        block, self.block = self.block, None
        if block is not None:
            graph = self.graph
            if graph is not None and not graph.released:
                graph.keep(block, self.size)
            else:
                self.pool._stream_free(block, self.size, self.stream, self.uses)

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:  # at interpreter exit the driver may be gone; nothing to order
            pass


class DriverEvents:
    """record / query / wait on CUDA events for a MemoryPool (tests pass a fake)."""

    def __init__(self, drv: Any, activate: Callable[[], Any]) -> None:
        self._new = lambda: drv.Event(drv.event_flags.DISABLE_TIMING)
        self._activate = activate
        self._spare: list = []

    def record(self, stream: Any) -> Any:
        with self._activate():
            ev = self._spare.pop() if self._spare else self._new()
            ev.record(stream)
        return ev

    def query(self, ev: Any) -> bool:
        return ev.query()

    def wait(self, ev: Any) -> None:
        ev.synchronize()

    def recycle(self, ev: Any) -> None:
        if len(self._spare) < 256:
            self._spare.append(ev)


_CURRENT = object()  # allocate()'s default stream: this thread's `with stream:` one


class GraphMemory:
    """The blocks of one CUDA graph (graphs.py): what was allocated on its stream while it was
    captured, and what was freed then or later while the graph may still replay. A block
    freed during the capture is reusable by the capture itself (its work is in stream order);
    nothing it holds goes back to the pool before `MemoryPool.release_graph`."""

    __slots__ = ("stream", "capturing", "released", "free_bins", "kept")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.capturing = True
        self.released = False
        self.free_bins: Dict[int, list] = {}   # size -> blocks reusable during the capture
        self.kept: list = []                   # (block, size) freed after the capture

    def keep(self, block: Any, size: int) -> None:
        """A block of the graph was freed (no lock: a finalizer may call this)."""
        if self.capturing:
            self.free_bins.setdefault(size, []).append(block)
        else:
            self.kept.append((block, size))

    def blocks(self) -> list:
        out = list(self.kept)
        for size, blocks in self.free_bins.items():
            out.extend((b, size) for b in blocks)
        return out


class _Freed:
    """A stream-ordered free: the block (None once reused or given back), its bin size,
    the event on its own stream and those on the other streams that used it."""

    __slots__ = ("block", "size", "own", "others")

    def __init__(self, block: Any, size: int, own: Any, others: list) -> None:
        self.block, self.size, self.own, self.others = block, size, own, others


class MemoryPool:
    """Statistics, limits, stream order and the OOM ladder over one device's pool."""

    def __init__(self, device_id: int, pool: Any, *, device_total: int = 0,
                 activate: Optional[Callable[[], Any]] = None,
                 oom_errors: Tuple[Type[BaseException], ...] = (MemoryError,),
                 events: Any = None) -> None:
        self.device_id = device_id
        self.owner: Any = None   # the CudaBackend that made it (its tensors' operators use it)
        self._pool = pool
        self._device_total = device_total
        self._activate = activate or (lambda: _NULL)
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
        self._peak = self._pool.active_bytes
        self._base_blocks = self._pool.active_blocks - self._deferred_blocks
        self._managed = self._pool.managed_bytes

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
        if ctx is not _NULL:
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
            try:
                block = pool.allocate(nbytes)
            except self._oom_errors:
                block = None
            if block is not None:
                self._count(nbytes)
                if stream is None:
                    return block
        if block is None:       # outside the lock: collecting garbage runs finalizers
            block = self._retry_after_oom(nbytes)
            if block is None:
                raise self._oom_error(nbytes)
            with self._lock:
                self._count(nbytes)
            if stream is None:
                return block
        return StreamBlock(self, block, stream, self._alloc_size(nbytes))

    def _allocate_for_graph(self, graph: GraphMemory, nbytes: int) -> StreamBlock:
        """An allocation on a stream that captures a graph: a block the capture freed, else
        one from the pool; either way owned by the graph."""
        size = self._alloc_size(nbytes)
        reusable = graph.free_bins.get(size)
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

    def begin_graph(self, stream: Any) -> GraphMemory:
        """Route allocations on `stream` (a PyCUDA stream) to a new graph's memory."""
        graph = GraphMemory(stream)
        self._graphs[stream] = graph
        return graph

    def end_graph(self, graph: GraphMemory) -> None:
        """The capture ended: later frees of the graph's blocks are kept until release."""
        self._graphs.pop(graph.stream, None)
        graph.capturing = False
        for size, blocks in graph.free_bins.items():
            graph.kept.extend((b, size) for b in blocks)
        graph.free_bins = {}

    def release_graph(self, graph: GraphMemory) -> None:
        """Give the graph's freed blocks back (its stream has finished every replay); blocks
        of live tensors go back when those are freed."""
        self.end_graph(graph)
        graph.released = True
        kept, graph.kept = graph.kept, []
        for block, size in kept:
            block.free()

    def _count(self, nbytes: int) -> None:
        """(Lock held.) Hit or miss, requested bytes and the peak of one allocation."""
        pool = self._pool
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

    # allocate() for an int nbytes > 0 with the pool's device context current: the per-call
    # plans of the ops (ops/common.py) check both before calling it
    allocate_current = _allocate_locked

    def _free_held(self) -> None:
        """The pool's free_held(), then the managed bytes a hit leaves unchanged."""
        self._pool.free_held()
        self._managed = self._pool.managed_bytes

    def _retry_after_oom(self, nbytes: int) -> Any:
        """Wait for stream-ordered frees, free cached blocks, collect garbage, retry once;
        None if the retry fails too."""
        gc.collect()
        with self._lock:
            self._oom_retries += 1
            self._flush_deferred()
            self._free_held()
            self._managed = -1                     # a miss, whatever the bytes say
            try:
                return self._pool.allocate(nbytes)
            except self._oom_errors:
                return None

    def _oom_error(self, nbytes: int) -> CudaOutOfMemoryError:
        return CudaOutOfMemoryError(
            nbytes, self.device_id, self.used_bytes(), self.free_bytes(), self._limit or None,
            reason="the device is out of memory even after freeing cached blocks "
                   "and collecting garbage")

    def _check_limit(self, nbytes: int) -> None:
        size = self._alloc_size(nbytes)
        if self._pool.managed_bytes + size <= self._limit:
            return
        self._flush_deferred()
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

    # -- stream-ordered frees --------------------------------------------------------
    def record_use(self, tensor: Any, stream: Any) -> None:
        """Note that `tensor` (a tensor of this pool) is used on `stream`, so that its block
        is not handed to another stream before that work is done (PyTorch's
        `Tensor.record_stream`). The launcher and the copies call it when a tensor's stream
        changes."""
        block = tensor._block
        if type(block) is not StreamBlock:
            if stream is None or block is None:
                return
            block = tensor._block = StreamBlock(self, block, None, self._alloc_size(
                max(tensor.nbytes, 1)))
        if stream is not block.stream:
            block.uses.add(stream)

    def _stream_free(self, block: Any, size: int, stream: Any, uses: set) -> None:
        """StreamBlock.free(): events on every stream that used the block, then the block
        queued for _sort_returned. No lock: this may run inside a finalizer."""
        if self._closed or self._events is None:
            block.free()
            return
        if self._graphs:     # used by a capture in progress: the graph's replays use it
            for s in (stream, *uses):
                graph = self._graphs.get(s)
                if graph is not None:
                    graph.kept.append((block, size))
                    return
        others = [self._events.record(s) for s in uses if s is not stream]
        own = None if stream is None else self._events.record(stream)
        self._returned.append((block, size, stream, own, others))

    def _sort_returned(self) -> None:
        """(Lock held.) Queue returned blocks by stream; give back those whose events are done."""
        returned = self._returned
        while returned:
            block, size, stream, own, others = returned.pop()
            entry = _Freed(block, size, own, others)
            self._deferred_bytes += size
            self._deferred_blocks += 1
            if others or stream is None:
                self._waiting.append(entry)
            else:
                self._ready.setdefault((stream, size), []).append(entry)
                fifo = self._ready_fifo.get(stream)
                if fifo is None:
                    fifo = self._ready_fifo[stream] = collections.deque()
                fifo.append(entry)
        ev = self._events
        for stream, fifo in list(self._ready_fifo.items()):
            while fifo and (fifo[0].block is None or ev.query(fifo[0].own)):
                entry = fifo.popleft()
                if entry.block is not None:
                    key = (stream, entry.size)
                    same = self._ready[key]
                    same.remove(entry)
                    if not same:
                        del self._ready[key]
                    self._give_back(entry)
            if not fifo:
                del self._ready_fifo[stream]
        if self._waiting:
            still = []
            for entry in self._waiting:
                if all(ev.query(e) for e in entry.others) and (entry.own is None or
                                                                ev.query(entry.own)):
                    self._give_back(entry)
                else:
                    still.append(entry)
            self._waiting = still

    def _take_ready(self, stream: Any, nbytes: int) -> Any:
        """(Lock held.) A block freed on `stream` in nbytes' bin, reusable there at once."""
        size = self._alloc_size(nbytes)
        entries = self._ready.get((stream, size))
        if not entries:
            return None
        entry = entries.pop()
        if not entries:
            del self._ready[(stream, size)]
        block, entry.block = entry.block, None   # its place in the free order is skipped
        self._events.recycle(entry.own)
        self._deferred_bytes -= size
        self._deferred_blocks -= 1
        return block

    def _give_back(self, entry: _Freed) -> None:
        block, entry.block = entry.block, None
        for e in entry.others:
            self._events.recycle(e)
        if entry.own is not None:
            self._events.recycle(entry.own)
        self._deferred_bytes -= entry.size
        self._deferred_blocks -= 1
        block.free()

    def _flush_deferred(self) -> None:
        """(Lock held.) Wait for every stream-ordered free and give the blocks back."""
        self._sort_returned()
        ev = self._events
        for fifo in self._ready_fifo.values():
            for entry in fifo:
                if entry.block is not None:
                    ev.wait(entry.own)
        for entry in self._waiting:
            for e in entry.others:
                ev.wait(e)
            if entry.own is not None:
                ev.wait(entry.own)
        self._sort_returned()

    def synchronize_frees(self) -> None:
        """Wait for the work that stream-ordered frees wait on, and give their blocks back."""
        with self._activate(), self._lock:
            if self._deferred_blocks or self._returned:
                self._flush_deferred()

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
        return int(self._pool.active_bytes) - self._deferred_bytes

    def total_bytes(self) -> int:
        return int(self._pool.managed_bytes)

    def free_bytes(self) -> int:
        self._settle()
        return int(self._pool.managed_bytes - self._pool.active_bytes) + self._deferred_bytes

    def n_free_blocks(self) -> int:
        self._settle()
        return int(self._pool.held_blocks) + self._deferred_blocks

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
        self._peak = self._pool.active_bytes

    def get_stats(self) -> Dict[str, int]:
        """The documented API's keys plus cache and hit statistics. Blocks waiting in stream-ordered
        free lists count as cached, not active."""
        self._settle()
        pool = self._pool
        count = self._hits + self._misses
        active_blocks = int(pool.active_blocks) - self._deferred_blocks
        return {
            "total_allocated": self._total_requested,
            "active_memory": int(pool.active_bytes) - self._deferred_bytes,
            "peak_allocated": int(self._peak),
            "allocation_count": count,
            "active_blocks": active_blocks,
            "cached_bytes": self.free_bytes(),
            "free_count": max(count - (active_blocks - self._base_blocks), 0),
            "n_free_blocks": int(pool.held_blocks) + self._deferred_blocks,
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


def record_stream(tensor: Any, stream: Any) -> None:
    """Mark `tensor` as used on `stream` (a PyCUDA stream, None for the legacy default
    stream): its CUDA array interface exports that stream, and its pool block is not
    reused by another stream before the work issued there so far is done."""
    tensor.stream = stream
    pool = tensor._pool
    if pool is not None and tensor._block is not None and hasattr(pool, "record_use"):
        pool.record_use(tensor, stream)
