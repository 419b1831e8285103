"""CUDA graphs: record a sequence of our ops on a stream once, replay it with one launch.

    with backend.capture() as graph:       # a new stream, current inside the block
        y = ml.fused_linear_gelu(x, w, b)  # recorded, not run
    graph.replay()                         # runs everything recorded; y holds the result

Inputs are the tensors made before the capture (copy new values into them between replays);
outputs are the tensors the recorded ops returned. Memory allocated while capturing belongs to
the graph (`memory.GraphMemory`): the replays write the same addresses, so it goes back to the
pool only at `graph.free()` (or when the graph is collected).

What cannot be captured raises `GraphCaptureError`: synchronous copies (from_numpy, to_numpy,
copy_to_device), synchronize, and an op's first call for a shape class when it compiles or
autotunes (run the ops once before capturing). Pinned-memory async copies and every kernel
launch can be captured.

PyCUDA wraps no graph API; the six driver calls used here go through ctypes to libcuda (no
extra dependency): cuStreamBeginCapture_v2, cuStreamEndCapture, cuGraphInstantiateWithFlags,
cuGraphLaunch, cuGraphExecDestroy, cuGraphDestroy.
"""
from __future__ import annotations

import ctypes
from typing import Any, Optional

from .errors import CudaBackendError, GraphCaptureError

_RELAXED = 2   # CU_STREAM_CAPTURE_MODE_RELAXED: other threads' calls do not break the capture
_lib: Any = None


def _driver() -> Any:
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
    return _lib


def _check(res: int, what: str) -> None:
    if res != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(res, ctypes.byref(name))
        raise GraphCaptureError(
            f"{what} failed: {(name.value or b'CUDA error').decode()} ({res}). Inside a "
            f"capture only launches and async copies are allowed: synchronous copies, "
            f"synchronize and first calls that compile or autotune are not (run the ops once "
            f"before capturing)")


class CudaGraph:
    """A captured sequence of launches on one stream; `replay()` runs it again."""

    def __init__(self, backend: Any, stream: Any) -> None:
        self.backend = backend
        self.stream = stream
        self.device_id = stream.device_id
        self._graph = ctypes.c_void_p()
        self._exec = ctypes.c_void_p()
        self._memory: Any = None
        self._pool = backend.memory_pools[self.device_id]
        self._replayed_on: set = {stream.pycuda_stream}   # streams free() waits for

    # -- capture ------------------------------------------------------------------------
    def __enter__(self) -> "CudaGraph":
        if self.stream.graph is not None:
            raise GraphCaptureError("this stream is already capturing a graph")
        self.stream.__enter__()
        handle = self.stream.pycuda_stream.handle
        with self.backend.activate(self.device_id):
            self._memory = self._pool.begin_graph(self.stream.pycuda_stream)
            self.stream.graph = self
            try:
                _check(_driver().cuStreamBeginCapture_v2(ctypes.c_void_p(handle), _RELAXED),
                       "cuStreamBeginCapture")
            except BaseException:
                self._abandon()
                raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        handle = self.stream.pycuda_stream.handle
        with self.backend.activate(self.device_id):
            res = _driver().cuStreamEndCapture(ctypes.c_void_p(handle),
                                               ctypes.byref(self._graph))
            self.stream.graph = None
            self.stream.__exit__(None, None, None)
            self._pool.end_graph(self._memory)
            if exc_type is not None or res != 0:
                self._abandon()
                if exc_type is None:
                    _check(res, "cuStreamEndCapture (a call in the block broke the capture)")
                if isinstance(exc, GraphCaptureError):
                    return None
                raise GraphCaptureError(
                    f"the capture failed: {exc_type.__name__}: {exc}. Inside a capture only "
                    f"launches and async copies are allowed: synchronous copies, synchronize "
                    f"and first calls that compile or autotune are not (run the ops once "
                    f"before capturing)") from exc
            try:
                _check(_driver().cuGraphInstantiateWithFlags(
                    ctypes.byref(self._exec), self._graph, ctypes.c_ulonglong(0)),
                    "cuGraphInstantiate")
            except BaseException:
                self._abandon()
                raise
        return None

    def _abandon(self) -> None:
        """Drop a failed capture: nothing ran, its memory goes back at once."""
        self.stream.graph = None
        self._destroy()

    def _destroy(self) -> None:
        """Destroy the executable graph and the graph, give the graph's memory back (its
        stream has finished every replay)."""
        if self._exec:
            _driver().cuGraphExecDestroy(self._exec)
            self._exec = ctypes.c_void_p()
        if self._graph:
            _driver().cuGraphDestroy(self._graph)
            self._graph = ctypes.c_void_p()
        if self._memory is not None:
            self._pool.release_graph(self._memory)
            self._memory = None

    # -- use ----------------------------------------------------------------------------
    def replay(self, stream: Optional[Any] = None) -> None:
        """Run the recorded work on its stream (or `stream`), asynchronously."""
        if not self._exec:
            raise CudaBackendError("the graph was freed, or its capture did not finish")
        target: Any = getattr(self.stream if stream is None else stream, "pycuda_stream", stream)
        handle = target.handle
        self._replayed_on.add(target)
        with self.backend.activate(self.device_id):
            res = _driver().cuGraphLaunch(self._exec, ctypes.c_void_p(handle))
        if res != 0:
            _check(res, "cuGraphLaunch")

    def synchronize(self) -> None:
        """Wait for the replays issued so far."""
        self.stream.synchronize()

    def free(self) -> None:
        """Wait for the replays, destroy the graph and give its memory back to the pool
        (blocks of tensors still alive go back when those are freed)."""
        if self._memory is None and not self._exec:
            return
        with self.backend.activate(self.device_id):
            for s in self._replayed_on:
                s.synchronize()
            self._replayed_on.clear()
            self._destroy()

    def __del__(self) -> None:
        try:
            if not self.backend.closed:
                self.free()
        except Exception:   # at interpreter exit the driver may be gone
            pass
