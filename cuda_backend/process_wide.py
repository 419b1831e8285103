"""`ProcessWide`: the one object of its kind in the process (the backend, CudaMath, CudaML,
the kernel generator), made on first use."""
from __future__ import annotations

import threading
from typing import Any, Callable


class ProcessWide:
    """make(*args) at the first get(*args), under a lock: made once, whichever threads ask;
    later calls return it without the lock. `value` is None until then."""

    def __init__(self, make: Callable[..., Any]) -> None:
        self.make = make
        self.value: Any = None
        self._lock = threading.Lock()

    def get(self, *args: Any) -> Any:
        value = self.value
        if value is None:
            with self._lock:
                if self.value is None:
                    self.value = self.make(*args)
                value = self.value
        return value
