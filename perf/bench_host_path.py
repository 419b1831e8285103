"""Host-side cost of the small-call path, on any machine: PyCUDA is replaced by stubs.

    python perf/bench_host_path.py [--reps N]

The stubs (`install_fake_pycuda`) make the backend start in GPU mode without a GPU: the
driver calls return at once, the memory pool is a minimal Python pool whose counters are
plain attributes (PyCUDA's are C++ getters, as cheap), kernels "compile" instantly from the
real rendered template and `_launch_kernel` does nothing. What remains is our Python: the
per-call cost of vector_add -> elementwise fast path -> allocation -> launch, and of its
pieces, in microseconds per call (the fastest of several runs: the host is shared, and
the minimum is the least disturbed). These are CPU numbers for
this host; the GPU host's CPU is faster (see perf/NOTES.md for the ratio seen so far).
"""
from __future__ import annotations

import argparse
import gc
import os
import struct
import sys
import time
import timeit
import types

# BENCH_ROOT: time another checkout's cuda_backend (e.g. an export of the previous commit)
sys.path.insert(0, os.environ.get("BENCH_ROOT") or
                os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


# -- the stubs --------------------------------------------------------------------------------
def install_fake_pycuda(sm_count: int = 132) -> None:
    """Put fake `pycuda`, `pycuda.driver`, `pycuda.tools`, `pycuda.compiler` and
    `pycuda._pvt_struct` modules into sys.modules (before cuda_backend is imported)."""
    pycuda = types.ModuleType("pycuda")
    pycuda.VERSION_TEXT = "stub"
    drv = types.ModuleType("pycuda.driver")

    class Error(Exception):
        pass

    class LogicError(Error):
        pass

    class CompileError(Error):
        pass

    class MemoryError_(Error):
        pass

    class _Attrs:
        def __getattr__(self, name: str) -> str:
            return name

    _DEV_ATTRS = {"MULTIPROCESSOR_COUNT": sm_count, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 232448,
                  "MAX_THREADS_PER_BLOCK": 1024}

    class Context:
        def push(self) -> None:
            pass

        @staticmethod
        def pop() -> None:
            pass

        @staticmethod
        def synchronize() -> None:
            pass

    class Device:
        def __init__(self, i: int) -> None:
            self.i = i

        @staticmethod
        def count() -> int:
            return 1

        def name(self) -> str:
            return "stub GPU"

        def compute_capability(self) -> tuple:
            return (9, 0)

        def total_memory(self) -> int:
            return 80 << 30

        def get_attribute(self, key: str) -> int:
            return _DEV_ATTRS[key]   # KeyError: the caller takes its default

        def pci_bus_id(self) -> str:
            return "0000:00:00.0"

        def retain_primary_context(self) -> Context:
            return Context()

    class Event:
        def record(self, stream: object = None) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def time_since(self, other: object) -> float:
            return 0.0

    class Stream:
        handle = 0

    drv.Error, drv.LogicError, drv.CompileError, drv.MemoryError = \
        Error, LogicError, CompileError, MemoryError_
    drv.init = lambda: None
    drv.Device, drv.Context, drv.Event, drv.Stream = Device, Context, Event, Stream
    drv.device_attribute = drv.function_attribute = drv.event_flags = _Attrs()
    drv.memcpy_htod = drv.memcpy_dtoh = lambda *a: None
    drv.memcpy_htod_async = drv.memcpy_dtoh_async = drv.memcpy_dtod_async = lambda *a: None

    tools = types.ModuleType("pycuda.tools")

    class _Block:
        __slots__ = ("pool", "ptr", "size")

        def __init__(self, pool: "DeviceMemoryPool", ptr: int, size: int) -> None:
            self.pool, self.ptr, self.size = pool, ptr, size

        def __int__(self) -> int:
            return self.ptr

        __index__ = __int__

        def free(self) -> None:
            if self.pool is not None:
                self.pool._back(self.ptr, self.size)
                self.pool = None

        def __del__(self) -> None:
            self.free()

    class DeviceMemoryPool:
        """PyCUDA's pool, minimally: bins by size, counters as attributes."""

        def __init__(self) -> None:
            self.held: dict = {}
            self.held_blocks = self.active_blocks = self.active_bytes = self.managed_bytes = 0
            self.next_ptr = 1 << 32

        def allocate(self, size: int) -> _Block:
            size = self.alloc_size(self.bin_number(size))
            stack = self.held.get(size)
            if stack:
                ptr = stack.pop()
                self.held_blocks -= 1
            else:
                ptr = self.next_ptr
                self.next_ptr += size
                self.managed_bytes += size
            self.active_blocks += 1
            self.active_bytes += size
            return _Block(self, ptr, size)

        def _back(self, ptr: int, size: int) -> None:
            self.held.setdefault(size, []).append(ptr)
            self.held_blocks += 1
            self.active_blocks -= 1
            self.active_bytes -= size

        @staticmethod
        def bin_number(size: int) -> int:
            return max(size, 256)

        @staticmethod
        def alloc_size(b: int) -> int:
            return (b + 255) & ~255

        def free_held(self) -> None:
            self.held.clear()
            self.held_blocks = 0

        def stop_holding(self) -> None:
            self.free_held()

    class PageLockedMemoryPool:
        held_blocks = active_blocks = 0

        def allocate(self, shape: object, dtype: object) -> object:
            import numpy as np
            return np.empty(shape, dtype)

        def free_held(self) -> None:
            pass

        def stop_holding(self) -> None:
            pass

    tools.DeviceMemoryPool, tools.PageLockedMemoryPool = DeviceMemoryPool, PageLockedMemoryPool

    compiler = types.ModuleType("pycuda.compiler")

    class Function:
        def prepare(self, fmt: str) -> None:
            self.fmt = fmt

        def get_attribute(self, key: str) -> int:
            return 1024 if key in ("MAX_THREADS_PER_BLOCK",) else (
                48 * 1024 if key == "MAX_DYNAMIC_SHARED_SIZE_BYTES" else 0)

        def _launch_kernel(self, grid: tuple, block: tuple, buf: bytes, shared: int,
                           stream: object) -> None:
            pass

        def set_attribute(self, key: str, value: int) -> None:
            pass

    class SourceModule:
        def __init__(self, source: str, **kw: object) -> None:
            pass

        def get_function(self, name: str) -> Function:
            return Function()

    compiler.SourceModule = SourceModule
    compiler.compile = lambda source, **kw: b"stub cubin"   # no get_nvcc_version: no disk cache
    drv.module_from_buffer = lambda cubin: SourceModule("")
    pvt = types.ModuleType("pycuda._pvt_struct")
    pvt.pack = struct.pack
    pycuda.driver, pycuda.tools, pycuda.compiler, pycuda._pvt_struct = drv, tools, compiler, pvt
    for name, mod in (("pycuda", pycuda), ("pycuda.driver", drv), ("pycuda.tools", tools),
                      ("pycuda.compiler", compiler), ("pycuda._pvt_struct", pvt)):
        sys.modules[name] = mod


# -- timing -----------------------------------------------------------------------------------
_clock = time.process_time   # CPU time of this process: time spent descheduled is not counted
def per_call_us(fn, number: int, repeat: int = 7) -> float:
    """Fastest of `repeat` runs of `number` calls, in microseconds per call."""
    runs = timeit.repeat(fn, number=number, repeat=repeat, timer=_clock)
    return min(runs) / number * 1e6


def per_result_us(fn, number: int, repeat: int = 7) -> float:
    """Like per_call_us for a call that returns a tensor: the results are kept until the
    run ends, so their release (by refcount, as in bench_math's wall-time loop) is not
    timed."""
    runs = []
    gc.disable()        # as timeit does: thousands of live results would make collections slow
    try:
        for _ in range(repeat):
            outs = [None] * number
            t0 = _clock()
            for i in range(number):
                outs[i] = fn()
            runs.append(_clock() - t0)
            del outs
    finally:
        gc.enable()
    return min(runs) / number * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20000)
    args = ap.parse_args()
    os.environ.pop("CUDA_BACKEND_FALLBACK", None)
    install_fake_pycuda()
    import numpy as np
    from cuda_backend.backend import CudaBackend
    from cuda_backend.cuda_math import CudaMath
    from cuda_backend.dtypes import CudaDataType
    from cuda_backend.ops import elementwise as ew

    b = CudaBackend()
    assert b.is_available, b.fallback_reason
    m = CudaMath(b)
    f32 = CudaDataType.FLOAT32
    x = m.from_numpy(np.ones(1024, np.float32))
    y = m.from_numpy(np.ones(1024, np.float32))
    m.vector_add(x, y).free()            # compiles (stub) and memoizes the kernel
    m.sigmoid(x).free()
    n = args.reps
    shape = x.shape
    pool = b.memory_pools[0]
    name = ew._kernel_name(m, ew._cache(m, 0), 0, "binary", "add", f32)[0]
    res = b.empty(shape, f32, 0)

    rows = [
        ("vector_add", lambda: m.vector_add(x, y), True),
        ("add (binary)", lambda: m.add(x, y), True),
        ("multiply by scalar", lambda: m.multiply(x, 2.5), True),
        ("sigmoid (unary)", lambda: m.sigmoid(x), True),
        ("backend.empty", lambda: b.empty(shape, f32, 0), True),
        ("backend._empty_checked", lambda: b._empty_checked(shape, f32, 0), True),
        ("MemoryPool.allocate", lambda: pool.allocate(4096), True),
        ("stub pool allocate (C++ in PyCUDA)", lambda: pool._pool.allocate(4096), True),
        ("launch_kernel (binary, 6 args)",
         lambda: b.launch_kernel(name, 2, res, x, y, 0.0, 1024, 0, block_size=ew._BLOCK_DIMS,
                                 device_id=0), False),
        ("vector_add + free()", lambda: m.vector_add(x, y).free(), False),
    ]
    print(f"{'piece':<36} {'us/call':>8}")
    for label, fn, keeps in rows:
        us = per_result_us(fn, n) if keeps else per_call_us(fn, n)
        print(f"{label:<36} {us:8.3f}")
    res.free()


if __name__ == "__main__":
    main()
