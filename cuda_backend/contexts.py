"""One retained primary context per device, made current per thread.

PyCUDA keeps a per-thread context stack and aborts the process if a thread's stack is not
empty when it is torn down, so every push made here is recorded and popped again: by
`device()` on exit, by `shutdown()` for the main thread at interpreter exit, and by a
thread-local guard when a worker thread ends.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, List, Optional

from .errors import InvalidDeviceError


class _ThreadState:
    """What this thread pushed: a list of (device_id, context, persistent)."""

    def __init__(self) -> None:
        self.stack: List[tuple] = []

    def __del__(self) -> None:  # runs in the exiting thread when its thread-locals are cleared
        while self.stack:
            self.stack.pop()
            try:
                self.stack_pop()
            except Exception:
                pass

    stack_pop: Any = None  # set to drv.Context.pop by the manager


class ContextManager:
    """Owns the retained primary contexts and each thread's current device."""

    def __init__(self, drv: Any, device_count: int) -> None:
        self._drv = drv
        self._count = device_count
        self._contexts: List[Optional[Any]] = [None] * device_count
        self._lock = threading.Lock()
        self._local = threading.local()
        # this thread's stack of (device, context, persistent): local_state.__dict__.get("state")
        self.local_state = self._local
        self._closed = False
        _ThreadState.stack_pop = staticmethod(drv.Context.pop)

    # -- lookup -------------------------------------------------------------------------
    @property
    def device_count(self) -> int:
        return self._count

    def validate(self, device_id: Any) -> int:
        """Return device_id as int, or raise InvalidDeviceError naming the valid range."""
        if isinstance(device_id, bool) or not isinstance(device_id, int) \
                or not 0 <= device_id < self._count:
            try:
                import numpy as np
                if isinstance(device_id, np.integer) and 0 <= int(device_id) < self._count:
                    return int(device_id)
            except ImportError:
                pass
            raise InvalidDeviceError(device_id, self._count)
        return device_id

    def context(self, device_id: int) -> Any:
        """The device's retained primary context, retained on first use."""
        ctx = self._contexts[device_id]
        if ctx is None:
            with self._lock:
                ctx = self._contexts[device_id]
                if ctx is None:
                    ctx = self._drv.Device(device_id).retain_primary_context()
                    self._contexts[device_id] = ctx
        return ctx

    def initialized_devices(self) -> List[int]:
        return [i for i, c in enumerate(self._contexts) if c is not None]

    def _state(self) -> _ThreadState:
        st = getattr(self._local, "state", None)
        if st is None:
            st = _ThreadState()
            self._local.state = st
        return st

    # -- current device ---------------------------------------------------------------
    def top_device(self) -> Optional[int]:
        """Device whose context this thread has current through us, None if none yet."""
        st = getattr(self._local, "state", None)
        if st is None or not st.stack:
            return None
        return st.stack[-1][0]

    def current_device(self) -> int:
        """The calling thread's current device (0 until set)."""
        st = getattr(self._local, "state", None)
        if st is None or not st.stack:
            return 0
        return st.stack[-1][0]

    def set_device(self, device_id: int) -> None:
        """Make device_id current for the calling thread until changed."""
        device_id = self.validate(device_id)
        st = self._state()
        if st.stack and st.stack[-1][0] == device_id:
            return
        ctx = self.context(device_id)
        if st.stack and st.stack[-1][2]:
            self._drv.Context.pop()
            st.stack.pop()
        ctx.push()
        st.stack.append((device_id, ctx, True))

    @contextlib.contextmanager
    def device(self, device_id: int) -> Iterator[int]:
        """Make device_id current inside the block; restore the previous one after, even on error."""
        device_id = self.validate(device_id)
        st = self._state()
        ctx = self.context(device_id)
        ctx.push()
        depth = len(st.stack)
        st.stack.append((device_id, ctx, False))
        try:
            yield device_id
        finally:
            while len(st.stack) > depth:
                st.stack.pop()
                self._drv.Context.pop()

    def activate(self, device_id: int):
        """Context manager that makes device_id current for one operation (free if it already is)."""
        st = getattr(self._local, "state", None)
        if st is not None and st.stack and st.stack[-1][0] == device_id:
            return _NULL
        if st is None or not st.stack:
            # First use in this thread: adopt the device persistently, like CUDA's runtime does.
            self.set_device(device_id)
            return _NULL
        return self.device(device_id)

    # -- shutdown ---------------------------------------------------------------------
    def pop_thread_contexts(self) -> None:
        """Pop everything this thread pushed (used at exit for the main thread)."""
        st = getattr(self._local, "state", None)
        while st is not None and st.stack:
            st.stack.pop()
            try:
                self._drv.Context.pop()
            except Exception:
                pass

    def shutdown(self) -> None:
        """Pop this thread's contexts and drop the references to the primary contexts."""
        if self._closed:
            return
        self._closed = True
        self.pop_thread_contexts()
        self._contexts = [None] * self._count


from .memory import NULL_CONTEXT as _NULL  # noqa: E402  (one shared no-op context object)
