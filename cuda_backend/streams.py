"""Streams and events: `backend.stream()` gives a `Stream` that can be made the default for
the operations a thread issues inside a `with` block, and `Event`s order work across streams."""
from __future__ import annotations

import threading
from typing import Any, List, Optional

_local = threading.local()
# this thread's `with stream:` stack is local_state.stack: fast paths test
# `local_state.__dict__.get("stack")` (a missing thread-local attribute costs ~1 us)
local_state = _local


def current_stream(device_id: int) -> Optional["Stream"]:
    """The stream a `with stream:` block made the default for this thread and device."""
    stack: Optional[List["Stream"]] = getattr(_local, "stack", None)
    if not stack:
        return None
    for s in reversed(stack):
        if s.device_id == device_id:
            return s
    return None


def current_pycuda_stream(device_id: int) -> Any:
    """The PyCUDA stream of current_stream(device_id), None for the legacy default stream."""
    stack = _local.__dict__.get("stack")   # (a missing thread-local attribute costs ~1 us)
    if not stack:
        return None
    for s in reversed(stack):
        if s.device_id == device_id:
            return s.pycuda_stream
    return None


def capturing(device_id: int) -> bool:
    """Whether this thread's current stream on device_id is recording a CUDA graph."""
    stack = _local.__dict__.get("stack")
    if not stack:
        return False
    for s in reversed(stack):
        if s.device_id == device_id:
            return s.graph is not None
    return False


class Event:
    """A CUDA event on one device: record on a stream, wait on it from another, time between."""

    def __init__(self, backend: Any, device_id: int, timing: bool = True) -> None:
        self.device_id = device_id
        self._backend = backend
        drv = backend.drv
        flags = 0 if timing else drv.event_flags.DISABLE_TIMING
        with backend.activate(device_id):
            self.pycuda_event = drv.Event(flags)

    def record(self, stream: Optional["Stream"] = None) -> "Event":
        with self._backend.activate(self.device_id):
            self.pycuda_event.record(None if stream is None else stream.pycuda_stream)
        return self

    def synchronize(self) -> None:
        self.pycuda_event.synchronize()
        self._backend.raise_device_errors()

    def query(self) -> bool:
        return self.pycuda_event.query()

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to `end` (both recorded and complete)."""
        return end.pycuda_event.time_since(self.pycuda_event)


class Stream:
    """A PyCUDA stream bound to a device. `with stream:` makes it this thread's default for
    operations on that device (launches and async copies that are not given stream=)."""

    def __init__(self, backend: Any, device_id: int) -> None:
        self.device_id = device_id
        self._backend = backend
        self.graph = None   # the CudaGraph being captured on this stream (graphs.py)
        with backend.activate(device_id):
            self.pycuda_stream = backend.drv.Stream()

    @property
    def handle(self) -> int:
        return int(self.pycuda_stream.handle)

    def synchronize(self) -> None:
        if self.graph is not None:
            from .errors import GraphCaptureError
            raise GraphCaptureError(
                "a stream that is capturing a CUDA graph cannot be synchronized: the capture "
                "records work, nothing runs until graph.replay()")
        with self._backend.activate(self.device_id):
            self.pycuda_stream.synchronize()
        self._backend.raise_device_errors()

    def query(self) -> bool:
        return self.pycuda_stream.is_done()

    def record_event(self, event: Optional[Event] = None) -> Event:
        """Record (a new) event at this point of the stream."""
        event = event or Event(self._backend, self.device_id)
        return event.record(self)

    def wait_event(self, event: Event) -> None:
        """Work issued to this stream after this call waits for the event."""
        with self._backend.activate(self.device_id):
            self.pycuda_stream.wait_for_event(event.pycuda_event)

    def __enter__(self) -> "Stream":
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        stack = _local.stack
        if stack and stack[-1] is self:
            stack.pop()
        elif self in stack:
            stack.remove(self)

    def __repr__(self) -> str:
        return f"Stream(device={self.device_id}, handle=0x{self.handle:x})"
