"""Kernel and copy timing statistics, a Chrome trace, and their JSON export; NVTX ranges.

Only fed when profiling is on: the hot path with profiling off never touches it.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import json
import logging
import os
import secrets
import shutil
import threading
import time
from typing import Any, Dict, Iterator, List, Optional

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


def write_json_atomic(filename: str, doc: Any, private: bool = False) -> str:
    """Write JSON to a temporary file in the same folder, then rename it into place (a reader
    sees the old file or the new one, never a part). The file gets the mode open() would
    give it (0666 less the umask, 0644 usually), like the report's other files; `private`
    makes it 0600 (files whose contents steer what runs, e.g. the autotune choices)."""
    folder = os.path.dirname(os.path.abspath(filename))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-{secrets.token_hex(4)}.json")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2, default=_json_default)
        os.replace(tmp, filename)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return filename


# -- NVTX -------------------------------------------------------------------------------------
# PyCUDA has no NVTX binding: the C API's two range calls through ctypes, from the NVTX v2
# library or the CUDA 12.8+ "interop" one, found by the loader or next to nvcc. Without a
# profiler attached (Nsight Systems) they return at once; without the library they are skipped.
NVTX_LIBRARIES = ("libnvToolsExt.so.1", "libnvToolsExt.so", "libnvtx3interop.so.1",
                  "libnvtx3interop.so", "nvToolsExt64_1.dll")


def _nvtx_candidates() -> List[str]:
    names = list(NVTX_LIBRARIES)
    for short in ("nvToolsExt", "nvtx3interop"):
        found = ctypes.util.find_library(short)
        if found:
            names.append(found)
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for home in filter(None, homes):
        for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
            names += [os.path.join(home, sub, n) for n in NVTX_LIBRARIES]
    return names


@functools.lru_cache(maxsize=1)
def nvtx_library() -> Optional[Any]:
    """The loaded NVTX library (nvtxRangePushA / nvtxRangePop), or None where there is none."""
    for name in _nvtx_candidates():
        try:
            lib = ctypes.CDLL(name)
            push, pop = lib.nvtxRangePushA, lib.nvtxRangePop
        except (OSError, AttributeError):
            continue
        push.argtypes, push.restype = [ctypes.c_char_p], ctypes.c_int
        pop.argtypes, pop.restype = [], ctypes.c_int
        logger.debug("NVTX ranges through %s", name)
        return lib
    return None


@contextlib.contextmanager
def nvtx_range(name: str, enabled: bool = True) -> Iterator[None]:
    """An NVTX range named `name` around the block (Nsight Systems shows it on the thread's
    timeline above the kernels it launched); a no-op when disabled or without libnvtx."""
    lib = nvtx_library() if enabled else None
    if lib is None:
        yield
        return
    lib.nvtxRangePushA(name.encode("utf-8", "replace"))
    try:
        yield
    finally:
        lib.nvtxRangePop()


def _json_default(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return list(obj)
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return str(obj)
