"""The package's one timing primitive: CUDA events on the GPU, the host clock otherwise.

Used by the report (tester, runner, ceilings), the autotuner (cuda_backend/autotune.py), the
quick `benchmark_operations` and the perf/ sweeps and benchmarks; only the profiler's
per-launch timing (launch.py) has its own events, as it profiles rather than benchmarks.

GPU protocol for one sample: enqueue an L2 flush (a memset of a buffer at least twice the
device's L2 size, so no input stays cached from the previous call), then the optional gap
(GPU work that keeps the device busy longer), record the start event, call the operation
(`calls` times back to back: ms per call), record the end event, wait for it. The flush is
queued before the start event, so it is not part of the interval; it also keeps the GPU busy
while Python enqueues the call, which is then measured as the GPU sees it. Warm-up calls
(compilation, autotuning, pool growth) run first and are not recorded. `stats` gives the
quantiles; `median_ms` is time() reduced to its median.

    timer = make_timer(backend, device_id, flush_l2=True)
    try:
        ms = timer.median_ms(lambda: op(x), warmup=2, iterations=20)
    finally:
        timer.close()
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

MIN_FLUSH_BYTES = 8 << 20
# The flush of the report's and the autotuner's timers (make_long_flush_timer): its memset
# keeps an H200 busy ~130-170 us, so the timed call's host work (a multi-launch op's Python,
# arguments built per call) stays out of its GPU time up to that; 2 x L2 (~35 us) let it in
# (perf/NOTES.md "Full reports" S16, S17).
LONG_FLUSH_BYTES = 512 << 20


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


def _run(fn: Callable[[], Any], calls: int, release: Callable[[Any], None]) -> List[Any]:
    """One sample's calls: a single call's output is returned (released after the sample,
    untimed); a batch releases each output after its call, as a loop of real use does."""
    if calls == 1:
        return [fn()]
    for _ in range(calls):
        release(fn())
    return []


class HostTimer:
    """perf_counter around each call; an optional time budget stops long runs early."""

    kind = "host_clock"

    def time(self, fn: Callable[[], Any], warmup: int, iterations: int,
             release: Callable[[Any], None] = _no_release,
             budget_s: Optional[float] = None, flush: bool = True,
             calls: int = 1) -> List[float]:
        """ms per call of fn: `iterations` samples after `warmup` untimed calls; a sample
        times `calls` back-to-back calls (each output passed to release: after the sample,
        untimed, for a single call; within the batch otherwise)."""
        for _ in range(warmup):
            release(fn())
        samples: List[float] = []
        begin = time.perf_counter()
        for _ in range(iterations):
            t0 = time.perf_counter()
            outs = _run(fn, calls, release)
            samples.append((time.perf_counter() - t0) * 1e3 / calls)
            for out in outs:
                release(out)
            if budget_s is not None and time.perf_counter() - begin > budget_s:
                break
        return samples

    def median_ms(self, fn: Callable[[], Any], warmup: int, iterations: int,
                  **kw: Any) -> float:
        """The median of time(fn, warmup, iterations, **kw), in ms per call."""
        if iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {iterations}")
        st = stats(self.time(fn, warmup, iterations, **kw))
        if st is None:
            raise ValueError("no call was timed: the timer returned no samples")
        return st["median"]

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
    """CUDA events (pycuda) on the legacy default stream, with an untimed L2 flush.

    min_flush_bytes raises the flush buffer's size (a longer flush hides longer host
    overheads); gap, when given, is called after the flush and before the start event (e.g.
    a GPU spin kernel). pool=False takes the flush buffer from the driver instead of the
    memory pool, so that timing leaves the pool's statistics, peak and limit alone (the
    autotuner times inside an op's first call)."""

    kind = "cuda_events"

    def __init__(self, backend: Any, device_id: int, flush_l2: bool,
                 min_flush_bytes: int = MIN_FLUSH_BYTES,
                 gap: Optional[Callable[[], None]] = None, pool: bool = True) -> None:
        self.backend = backend
        self.device_id = device_id
        self._drv = backend.drv
        self.flush_bytes = 0
        self._flush_ptr: Optional[int] = None
        self._flush_mem: Any = None   # the driver's allocation when pool=False
        self._counter = 0
        self._gap = gap
        if flush_l2:
            l2 = backend.devices[device_id].l2_cache_size
            nbytes = max(2 * l2, min_flush_bytes)
            if pool:
                self._flush_ptr = backend.allocate_memory(nbytes, device_id)
            else:
                with backend.activate(device_id):
                    self._flush_mem = self._drv.mem_alloc(nbytes)
                self._flush_ptr = int(self._flush_mem)
            self.flush_bytes = nbytes

    def flush(self) -> None:
        """Queue a write of the whole flush buffer (evicts every cached line of inputs)."""
        if self._flush_ptr is not None:
            self._counter = (self._counter + 1) & 0x7FFFFFFF
            self._drv.memset_d32_async(self._flush_ptr, self._counter, self.flush_bytes // 4)

    def time(self, fn: Callable[[], Any], warmup: int, iterations: int,
             release: Callable[[Any], None] = _no_release,
             budget_s: Optional[float] = None, flush: bool = True,
             calls: int = 1) -> List[float]:
        """ms per call of fn from CUDA events (see the module docstring); driver errors
        (a kernel fault surfaces at a synchronize) propagate as the driver raised them."""
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
                if self._gap is not None:
                    self._gap()
                start.record()
                outs = _run(fn, calls, release)
                end.record()
                end.synchronize()
                samples.append(end.time_since(start) / calls)
                for out in outs:
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
        if self._flush_mem is not None:
            mem, self._flush_mem, self._flush_ptr = self._flush_mem, None, None
            with self.backend.activate(self.device_id):
                mem.free()
        elif self._flush_ptr is not None:
            self.backend.free_memory(self._flush_ptr, self.device_id)
            self._flush_ptr = None


def make_timer(backend: Any, device_id: int, flush_l2: bool, **kw: Any) -> HostTimer:
    """A DeviceTimer on a GPU (kw: DeviceTimer's min_flush_bytes, gap, pool), a HostTimer
    in fallback mode."""
    if backend.is_available:
        return DeviceTimer(backend, device_id, flush_l2, **kw)
    return HostTimer()


def out_of_memory(exc: BaseException) -> bool:
    """Whether exc is an allocation failure (the pool's or the driver's)."""
    return isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()


def make_long_flush_timer(backend: Any, device_id: int, pool: bool = True) -> HostTimer:
    """make_timer with the L2 flushed by LONG_FLUSH_BYTES before each sample, or by the
    2 x L2 default where there is no memory for that (a failure of the default raises)."""
    try:
        return make_timer(backend, device_id, True, pool=pool, min_flush_bytes=LONG_FLUSH_BYTES)
    except Exception as exc:
        if not out_of_memory(exc):
            raise
    return make_timer(backend, device_id, True, pool=pool)
