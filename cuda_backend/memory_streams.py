"""Stream order of pool blocks: when a freed block may be reused.

A block allocated inside `with stream:` (or used there by a launch or copy) is a `StreamBlock`.
When it is freed it is reusable at once on the stream that allocated it, and by any other
stream only after events recorded at the free, on every stream that used it, have completed
(PyTorch's caching allocator with `record_stream`, CuPy's per-stream pools). Blocks only ever
used on the legacy default stream go back to the shared pool at once: the streams of
`backend.stream()` are blocking streams, ordered after earlier default-stream work.

A block allocated on a stream while it captures a CUDA graph belongs to the graph
(`GraphMemory`): it goes back to the pool only at `MemoryPool.release_graph`.

`StreamOrder` is the part of `MemoryPool` (memory.py) that keeps these free lists; its state is
made by `MemoryPool.__init__`. `StreamBlock.free()` takes no lock (it queues the block with a
list append), so a finalizer can free at any point (memory.py's docstring, "Finalizers").
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Dict, Optional, Tuple


class StreamBlock:
    """A pool block tied to streams: the one it was allocated on (`stream`, None for the
    legacy default stream) and any other that used it (`uses`). `free()` records an event on
    each and hands the block to its pool's stream-ordered free list; a StreamBlock that is
    garbage-collected without free() is freed the same way."""

    __slots__ = ("block", "ptr", "size", "pool", "stream", "uses", "graph")

    def __init__(self, pool: "StreamOrder", block: Any, stream: Any, size: int,
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


class StreamOrder:
    """MemoryPool's stream-ordered frees and its graphs' memory (a base class of MemoryPool,
    whose __init__ makes the state declared here)."""

    _lock: Any
    _activate: Callable[[], Any]
    _events: Any
    _closed: bool
    _graphs: Dict[Any, GraphMemory]
    _returned: list
    _ready: Dict[Tuple[Any, int], list]
    _ready_fifo: Dict[Any, collections.deque]
    _waiting: list
    _deferred_bytes: int
    _deferred_blocks: int
    _alloc_size: Callable[[int], int]

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

    # -- the memory of CUDA graphs (graphs.py) -----------------------------------------
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


def record_stream(tensor: Any, stream: Any) -> None:
    """Mark `tensor` as used on `stream` (a PyCUDA stream, None for the legacy default
    stream): its CUDA array interface exports that stream, and its pool block is not
    reused by another stream before the work issued there so far is done."""
    tensor.stream = stream
    pool = tensor._pool
    if pool is not None and tensor._block is not None and hasattr(pool, "record_use"):
        pool.record_use(tensor, stream)
