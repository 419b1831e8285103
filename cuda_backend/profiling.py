"""Kernel and copy timing statistics, a Chrome trace, and their JSON export.

Only fed when profiling is on: the hot path with profiling off never touches it.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from typing import Any, Dict, List

logger = logging.getLogger("cuda_backend")


class _Timing:
    __slots__ = ("count", "total_ms", "min_ms", "max_ms", "total_bytes")

    def __init__(self) -> None:
        self.count = 0
        self.total_ms = 0.0
        self.min_ms = float("inf")
        self.max_ms = 0.0
        self.total_bytes = 0

    def add(self, ms: float, nbytes: int = 0) -> None:
        self.count += 1
        self.total_ms += ms
        self.min_ms = min(self.min_ms, ms)
        self.max_ms = max(self.max_ms, ms)
        self.total_bytes += nbytes


class Profiler:
    """Collects per-kernel and per-direction timings and trace events."""

    def __init__(self, max_trace_events: int = 200_000) -> None:
        self._lock = threading.Lock()
        self._kernels: Dict[str, _Timing] = {}
        self._transfers: Dict[str, _Timing] = {}
        self._events: List[Dict[str, Any]] = []
        self._max_events = max_trace_events
        self._t0 = time.perf_counter()

    def reset(self) -> None:
        with self._lock:
            self._kernels.clear()
            self._transfers.clear()
            self._events.clear()

    def _trace(self, name: str, cat: str, start_s: float, ms: float, device_id: int,
               args: Dict[str, Any]) -> None:
        if len(self._events) < self._max_events:
            self._events.append({
                "name": name, "cat": cat, "ph": "X",
                "ts": round((start_s - self._t0) * 1e6, 3), "dur": round(ms * 1e3, 3),
                "pid": os.getpid(), "tid": f"device {device_id}", "args": args})

    def record_kernel(self, name: str, ms: float, device_id: int, start_s: float,
                      grid: Any = None, block: Any = None, shared_mem: int = 0) -> None:
        with self._lock:
            self._kernels.setdefault(name, _Timing()).add(ms)
            self._trace(name, "kernel", start_s, ms, device_id,
                        {"grid": list(grid or ()), "block": list(block or ()),
                         "shared_mem": shared_mem})
        logger.debug("kernel %s on device %d: %.4f ms grid=%s block=%s smem=%d",
                     name, device_id, ms, grid, block, shared_mem)

    def record_transfer(self, kind: str, nbytes: int, ms: float, device_id: int,
                        start_s: float) -> None:
        with self._lock:
            self._transfers.setdefault(kind, _Timing()).add(ms, nbytes)
            self._trace(f"memcpy {kind}", "transfer", start_s, ms, device_id,
                        {"bytes": nbytes})
        gbps = nbytes / (ms * 1e6) if ms > 0 else 0.0
        logger.debug("copy %s on device %d: %d bytes in %.4f ms (%.2f GB/s)",
                     kind, device_id, nbytes, ms, gbps)

    def kernel_stats(self) -> Dict[str, Dict[str, float]]:
        with self._lock:
            return {name: {"average_ms": t.total_ms / t.count, "min_ms": t.min_ms,
                           "max_ms": t.max_ms, "total_ms": t.total_ms,
                           "total_executions": t.count}
                    for name, t in self._kernels.items()}

    def transfer_stats(self) -> Dict[str, Dict[str, float]]:
        with self._lock:
            out = {}
            for kind, t in self._transfers.items():
                out[kind] = {"average_ms": t.total_ms / t.count, "total_ms": t.total_ms,
                             "total_bytes": t.total_bytes, "count": t.count,
                             "average_gbps": (t.total_bytes / (t.total_ms * 1e6)
                                              if t.total_ms > 0 else 0.0)}
            return out

    def trace_events(self) -> List[Dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def export_chrome_trace(self, filename: str) -> str:
        """Write the Trace Event format JSON that chrome://tracing and Perfetto open."""
        doc = {"traceEvents": self.trace_events(), "displayTimeUnit": "ms"}
        return write_json_atomic(filename, doc)


def write_json_atomic(filename: str, doc: Any) -> str:
    """Write JSON to a temp file in the same folder, then rename it into place."""
    folder = os.path.dirname(os.path.abspath(filename))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2, default=_json_default)
        os.replace(tmp, filename)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return filename


def _json_default(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return list(obj)
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return str(obj)
