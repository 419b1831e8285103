"""Timers for the tester: CUDA events on the GPU, the host clock otherwise.

GPU protocol for one sample: enqueue an L2 flush (a memset of a buffer at least twice the
device's L2 size, so no input stays cached from the previous call), record the start event,
call the operation, record the end event, wait for it. The flush is queued before the start
event, so it is not part of the interval; it also keeps the GPU busy while Python enqueues
the call, which is then measured as the GPU sees it. Warm-up calls (compilation, autotuning,
pool growth) run first and are not recorded.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

MIN_FLUSH_BYTES = 8 << 20


def stats(samples_ms: List[float]) -> Optional[Dict[str, float]]:
    """median, mean, min, max, p20, p80 (ms) and the sample count; None without samples."""
    if not samples_ms:
        return None
    a = np.asarray(samples_ms, dtype=np.float64)
    p20, p50, p80 = np.percentile(a, [20, 50, 80])
    return {"median": float(p50), "mean": float(a.mean()), "min": float(a.min()),
            "max": float(a.max()), "p20": float(p20), "p80": float(p80), "count": int(a.size)}


def _no_release(_: Any) -> None:
    return None


class HostTimer:
    """perf_counter around each call; an optional time budget stops long runs early."""

    kind = "host_clock"

    def time(self, fn: Callable[[], Any], warmup: int, iterations: int,
             release: Callable[[Any], None] = _no_release,
             budget_s: Optional[float] = None, flush: bool = True) -> List[float]:
        for _ in range(warmup):
            release(fn())
        samples: List[float] = []
        begin = time.perf_counter()
        for _ in range(iterations):
            t0 = time.perf_counter()
            out = fn()
            samples.append((time.perf_counter() - t0) * 1e3)
            release(out)
            if budget_s is not None and time.perf_counter() - begin > budget_s:
                break
        return samples

    def time_batched(self, fn: Callable[[], Any], calls: int, iterations: int,
                     sync: Callable[[], None] = lambda: None) -> List[float]:
        """ms per call of fn, each sample averaging `calls` back-to-back calls then sync()."""
        for _ in range(min(calls, 100)):
            fn()
        sync()
        samples = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            samples.append((time.perf_counter() - t0) * 1e3 / calls)
        return samples

    def flush_description(self) -> str:
        return "none (host clock)"

    def close(self) -> None:
        return None


class DeviceTimer(HostTimer):
    """CUDA events (pycuda) on the legacy default stream, with an untimed L2 flush."""

    kind = "cuda_events"

    def __init__(self, backend: Any, device_id: int, flush_l2: bool) -> None:
        self.backend = backend
        self.device_id = device_id
        self._drv = backend._drv
        self.flush_bytes = 0
        self._flush_ptr: Optional[int] = None
        self._counter = 0
        if flush_l2:
            l2 = backend.devices[device_id].l2_cache_size
            self.flush_bytes = max(2 * l2, MIN_FLUSH_BYTES)
            self._flush_ptr = backend.allocate_memory(self.flush_bytes, device_id)

    def flush(self) -> None:
        """Queue a write of the whole flush buffer (evicts every cached line of inputs)."""
        if self._flush_ptr is not None:
            self._counter = (self._counter + 1) & 0x7FFFFFFF
            self._drv.memset_d32_async(self._flush_ptr, self._counter, self.flush_bytes // 4)

    def time(self, fn: Callable[[], Any], warmup: int, iterations: int,
             release: Callable[[Any], None] = _no_release,
             budget_s: Optional[float] = None, flush: bool = True) -> List[float]:
        drv = self._drv
        with self.backend.activate(self.device_id):
            for _ in range(warmup):
                release(fn())
            drv.Context.synchronize()
            start, end = drv.Event(), drv.Event()
            samples: List[float] = []
            for _ in range(iterations):
                if flush:
                    self.flush()
                start.record()
                out = fn()
                end.record()
                end.synchronize()
                samples.append(end.time_since(start))
                release(out)
        return samples

    def time_batched(self, fn: Callable[[], Any], calls: int, iterations: int,
                     sync: Optional[Callable[[], None]] = None) -> List[float]:
        with self.backend.activate(self.device_id):
            return super().time_batched(fn, calls, iterations,
                                        sync or self._drv.Context.synchronize)

    def flush_description(self) -> str:
        if self._flush_ptr is None:
            return "off (warm L2)"
        return f"memset of {self.flush_bytes >> 20} MiB (>= 2x L2) before each timed call"

    def close(self) -> None:
        if self._flush_ptr is not None:
            self.backend.free_memory(self._flush_ptr, self.device_id)
            self._flush_ptr = None


def make_timer(backend: Any, device_id: int, flush_l2: bool) -> HostTimer:
    """A DeviceTimer on a GPU, a HostTimer in fallback mode."""
    if backend.is_available:
        return DeviceTimer(backend, device_id, flush_l2)
    return HostTimer()
