"""Errors that kernels find, reported without making the host wait (`DeviceErrors`).

A bounds-checked take / gather / scatter_add and a label-checked cross_entropy find bad input
on the device. Waiting for that verdict after each call would drain the stream every time
(the GPU idles while the host reads it back and queues the next launch: perf/NOTES.md,
"Indexing"), so, as PyTorch's device-side checks do, the call returns at once and the error is
raised at the next synchronizing call of the backend: `synchronize`, a copy to the host
(`to_numpy`, `item`), a stream's or an event's `synchronize`.

The kernels write into page-locked host memory mapped into the device's address space
(portable: every device and context sees it), one slot per kind of check: an int32 pair, the
first word set to 1 when the check failed, the second a detail (a row for cross_entropy).
A slot belongs to one (op, axis size, ...) key whose `make_error(detail)` builds the typed
error, so a per-call plan gets its slot once and passes the same pointer on every call. Only
failing kernels write, with plain stores (atomics on mapped memory are not atomic across the
bus), so the good path costs nothing.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Hashable, List

import numpy as np

SLOTS = 4096
# the end of every such error's message
LATER = (" (found on the device after the call returned; raised by the next synchronizing "
         "call)")


class DeviceErrors:
    """The mapped slots of one process's GPU runtime (see the module doc)."""

    def __init__(self, drv: Any) -> None:
        self._drv = drv
        self._lock = threading.Lock()
        self._host: Any = None     # np.ndarray of (SLOTS, 2) int32, made on first use
        self._base = 0
        self._keys: Dict[Hashable, int] = {}
        self._makers: List[Callable[[int], BaseException]] = []
        self._bytes: Any = b""          # the slots in use, as raw bytes (a cheap test)
        self._zeros = bytes(8 * SLOTS)

    def _allocate(self) -> None:
        drv = self._drv
        flags = drv.host_alloc_flags.PORTABLE | drv.host_alloc_flags.DEVICEMAP
        self._host = drv.pagelocked_zeros((SLOTS, 2), np.int32, mem_flags=flags)
        self._base = int(self._host.base.get_device_pointer())

    def slot(self, key: Hashable, make_error: Callable[[int], BaseException]) -> int:
        """The device pointer of key's slot (an int32 pair), made on first use; when every
        slot is taken, the last one serves every further key with its first maker's error."""
        index = self._keys.get(key)
        if index is None:
            with self._lock:
                index = self._keys.get(key)
                if index is None:
                    if self._host is None:
                        self._allocate()
                    index = min(len(self._makers), SLOTS - 1)
                    if index == len(self._makers):
                        self._makers.append(make_error)
                        self._bytes = memoryview(self._host).cast("B")[:8 * len(self._makers)]
                    self._keys[key] = index
        return self._base + 8 * index

    def raise_pending(self) -> None:
        """Raise the error of the first slot a kernel has set since the last check, every
        set slot cleared first (one bad call, one error); nothing when none is set."""
        if self._bytes == self._zeros[:len(self._bytes)]:
            return
        used = self._host[:len(self._makers)]
        set_ = np.flatnonzero(used[:, 0])
        if not len(set_):
            return
        index = int(set_[0])
        detail = int(used[index, 1])
        used[set_] = 0
        raise self._makers[index](detail)
