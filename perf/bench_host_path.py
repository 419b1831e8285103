"""Host-side cost of small calls: on the GPU, ours against PyTorch eager; on any machine, our
Python alone with PyCUDA replaced by stubs.

    python perf/bench_host_path.py [--ops NAME,...] [--out results.json]      # GPU mode
        [--calls 1000] [--runs 15] [--warmup 20] [--transpose-n 8192] [--no-torch] [--gpu]
    python perf/bench_host_path.py --stub [--reps N]                          # stub mode

GPU mode (the default when PyCUDA imports; --gpu forces it, e.g. to check the script in
NumPy fallback mode on a machine without a GPU) times every public CudaMath/CudaML op and
the tensor operators on small inputs (see CASES: 1,024 elements for elementwise ops and
dropout/optimizers, 64x64 rows for softmax/reductions/layer_norm/transpose, 64^3 matmul,
(1,8,16,16) NCHW for batch_norm/conv2d/pooling, (1,2,64,64) attention, 32x1024 @ 1024x1024
fused_linear_gelu), each against PyTorch's equivalent call. Per op: warm-up calls on each
side (compilation, autotuning, pool growth), then `--runs` pairs of runs, interleaved (ours
run, torch run, ours run, ...), so that both sides see the same machine state (clocks, other
tenants, the host's load). One run = `--calls` back-to-back calls followed by one synchronize
(ours: backend.synchronize(); torch: torch.cuda.synchronize()), wall clock (time.perf_counter)
divided by the calls. Reported per side: the minimum over the runs (the least disturbed run)
and the median; ours/torch is min/min. The results are kept in a list and freed after the
clock stops (ours: .free(); torch: the caching allocator), so that freeing is not timed; the
GC is off during the runs. Nothing is pinned (no CPU affinity, no clock locking). float32
throughout; PyTorch's TF32 is off (our matmul/conv2d are true FP32 by default,
fused_linear_gelu float32-accurate). Then:
  mlp_forward     the batch-32 MLP forward, per call: fused_linear_gelu 1024->4096,
                  matrix_multiply 4096->1024, softmax (intermediates freed inside the call).
  mlp_graph       the same MLP captured once as a CUDA graph (`with backend.capture() as
                  graph:` after one eager warm-up call), per call graph.replay(), one run =
                  the replays + graph.synchronize(); against torch eager's MLP. Checked once:
                  the replayed output is bitwise identical to an eager run on the same inputs
                  (printed as 'identical: True/False').
  mlp_forward_gpu_time  the eager MLP's GPU time (cuda_backend/performance/timing.py's
                  DeviceTimer, CUDA events; median and best of 50), warm L2 and with the L2
                  flushed, against mlp_forward's per-call wall time (min): the host overhead.
  sync_transpose  a synchronous matrix_transpose of N^2 (--transpose-n, 8192): wall time per
                  call (call + device synchronize, median and best of 20) against its GPU time
                  (CUDA events, cuda_backend/performance/timing.py's DeviceTimer, warm L2);
                  wall - GPU is the host overhead a synchronous caller sees.
The table prints ours and torch in us per call (min and median of the runs) and ours/torch
on the minima (< 1: we are faster); --out writes all of it as JSON (every run's sample too).
Every case is guarded: one that fails prints its error and the run goes on. Without PyTorch
(or with --no-torch) only ours is timed. --ops takes comma-separated case names (write
--ops=-a,a.T when the list starts with '-').

Stub mode (--stub; the default when PyCUDA is missing): the stubs (`install_fake_pycuda`)
make the backend start in GPU mode without a GPU: the
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
    drv.memset_d32_async = lambda *a: None

    class _HostPointer:   # the base of a mapped page-locked array (device_errors.py)
        def get_device_pointer(self) -> int:
            return 0x6000000

    class _Mapped:
        """A host array with PyCUDA's `.base.get_device_pointer()` (numpy imported late:
        the stubs go in before anything else)."""

        def __new__(cls, shape: tuple, dtype: object, mem_flags: int = 0) -> object:
            import numpy

            class _MappedArray(numpy.ndarray):
                base = _HostPointer()
            return numpy.zeros(shape, dtype).view(_MappedArray)

    drv.host_alloc_flags = types.SimpleNamespace(PORTABLE=1, DEVICEMAP=2)
    drv.pagelocked_zeros = _Mapped

    class _Allocation:
        def __init__(self, n: int) -> None:
            self.n = n

        def __int__(self) -> int:
            return 0x7000000

        def free(self) -> None:
            pass

    drv.mem_alloc = _Allocation

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


def stub_main(args: argparse.Namespace) -> None:
    """Stub mode: our per-call host cost with PyCUDA replaced by stubs."""
    os.environ.pop("CUDA_BACKEND_FALLBACK", None)
    install_fake_pycuda()
    import numpy as np
    from cuda_backend.backend import CudaBackend
    from cuda_backend.cuda_math import CudaMath
    from cuda_backend.dtypes import CudaDataType
    from cuda_backend.ops import elementwise_kernels as ewk

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
    name = ewk.kernel_name(m, ewk.device_cache(m, 0), 0, "binary", "add", f32)[0]
    res = b.empty(shape, f32, 0)

    rows = [
        ("vector_add", lambda: m.vector_add(x, y), True),
        ("add (binary)", lambda: m.add(x, y), True),
        ("multiply by scalar", lambda: m.multiply(x, 2.5), True),
        ("sigmoid (unary)", lambda: m.sigmoid(x), True),
        ("backend.empty", lambda: b.empty(shape, f32, 0), True),
        ("backend.empty_checked", lambda: b.empty_checked(shape, f32, 0), True),
        ("MemoryPool.allocate", lambda: pool.allocate(4096), True),
        ("stub pool allocate (C++ in PyCUDA)", lambda: pool._pool.allocate(4096), True),
        ("launch_kernel (binary, 6 args)",
         lambda: b.launch_kernel(name, 2, res, x, y, 0.0, 1024, 0, block_size=ewk.BLOCK_DIMS,
                                 device_id=0), False),
        ("vector_add + free()", lambda: m.vector_add(x, y).free(), False),
    ]
    print(f"{'piece':<36} {'us/call':>8}")
    for label, fn, keeps in rows:
        us = per_result_us(fn, n) if keeps else per_call_us(fn, n)
        print(f"{label:<36} {us:8.3f}")
    res.free()


# -- GPU mode: ours against PyTorch eager, per call ------------------------------------------
V = (1024,)          # elementwise, dropout, optimizers
M = (64, 64)         # rows: softmax, reductions, layer_norm, transpose; matmul operands
NCHW = (1, 8, 16, 16)
C8 = (8,)
QKV = (1, 2, 64, 64)


class Case:
    """One row: `inputs` are shapes (or (shape, scale) pairs) filled with uniform values in
    [0.5, 1.5) * scale; ours(ctx, *our_tensors) and theirs(ctx, *torch_tensors) return the
    zero-argument callable to time (built inside the case's guard)."""

    def __init__(self, name: str, desc: str, inputs: list, ours, theirs=None) -> None:
        self.name, self.desc, self.inputs, self.ours, self.theirs = \
            name, desc, inputs, ours, theirs


class Timed:
    """What a case builder may return instead of a bare callable: the callable to time with
    its own synchronize and release, a close() run once after the runs (untimed), and extra
    results for the row (printed and written to the JSON)."""

    def __init__(self, fn, sync, release, close=None, extra: dict = None) -> None:
        self.fn, self.sync, self.release, self.close, self.extra = \
            fn, sync, release, close, extra or {}


def _cases() -> list:
    from functools import partial as P
    import operator as op
    from cuda_backend.ops import matmul as mm
    scale_in = 1024 ** -0.5
    # the MLP's x, w1, b1, w2 (mlp_forward, mlp_graph)
    mlp_in = [(32, 1024), ((4096, 1024), scale_in), (4096,), ((4096, 1024), 4096 ** -0.5)]

    def un(name: str, torch_name: str) -> Case:
        return Case(name, "1,024", [V], lambda c, x: P(getattr(c.m, name), x),
                    lambda c, x: P(getattr(c.torch, torch_name), x))

    def bi(name: str, torch_name: str) -> Case:
        return Case(name, "1,024 (+) 1,024", [V, V], lambda c, a, b: P(getattr(c.m, name), a, b),
                    lambda c, a, b: P(getattr(c.torch, torch_name), a, b))

    def act(name: str, kind: str, torch_fn) -> Case:
        return Case(name, "1,024", [V],
                    lambda c, x: P(c.ml.activation, x, getattr(c.ActivationType, kind)),
                    lambda c, x: P(torch_fn(c), x))

    def red(name: str, torch_name: str) -> Case:
        return Case(name, "64x64 axis=1", [M], lambda c, x: P(getattr(c.m, name), x, axis=1),
                    lambda c, x: P(getattr(c.torch, torch_name), x, dim=1))

    def bn(training: bool) -> Case:
        return Case(f"batch_norm_{'train' if training else 'infer'}", "(1,8,16,16)",
                    [NCHW, C8, C8, C8, C8],
                    lambda c, x, g, b, mu, var: P(c.ml.batch_norm, x, g, b, mu, var,
                                                  training=training),
                    lambda c, x, g, b, mu, var: P(c.F.batch_norm, x, mu, var, g, b,
                                                  training=training))

    def mlp_ours(c, x, w1, b1, w2):
        fl, mm, sm = c.ml.fused_linear_gelu, c.m.matrix_multiply, c.m.softmax

        def fn():
            h = fl(x, w1, b1)
            y = mm(h, w2)
            h.free()
            p = sm(y)
            y.free()
            return p
        return fn

    def mlp_graph_ours(c, x, w1, b1, w2):
        eager = mlp_ours(c, x, w1, b1, w2)
        eager().free()                  # the eager warm-up call: compiles, autotunes
        with c.b.capture() as graph:    # recorded on a new stream, not run
            out = eager()
        try:
            graph.replay()
            graph.synchronize()
            ref = eager()               # eager, the same inputs
            identical = bool(c.np.array_equal(c.m.to_numpy(out), c.m.to_numpy(ref)))
            ref.free()
        except BaseException:
            graph.free()
            out.free()
            raise

        def close():
            graph.free()
            out.free()
        return Timed(graph.replay, graph.synchronize, _release_none, close,
                     {"identical": identical})

    def mlp_torch(c, x, w1, b1, w2):
        F, softmax = c.F, c.torch.softmax
        return lambda: softmax(F.gelu(F.linear(x, w1, b1), approximate="tanh") @ w2, dim=-1)

    def adam_torch(c, p, g, m_, v_):
        param = c.torch.nn.Parameter(p.clone())
        param.grad = g
        return c.torch.optim.Adam([param], lr=1e-3, foreach=False, capturable=False).step

    return [
        # tensors and copies
        Case("create_tensor", "1,024", [], lambda c: P(c.m.create_tensor, V),
             lambda c: P(c.torch.empty, V, device="cuda")),
        Case("zeros", "1,024", [], lambda c: P(c.m.zeros, V),
             lambda c: P(c.torch.zeros, V, device="cuda")),
        Case("ones", "1,024", [], lambda c: P(c.m.ones, V),
             lambda c: P(c.torch.ones, V, device="cuda")),
        Case("fill", "1,024 in place", [V], lambda c, x: P(c.m.fill, x, 0.0),
             lambda c, x: P(x.fill_, 0.0)),
        Case("copy", "1,024", [V], lambda c, x: P(c.m.copy, x), lambda c, x: x.clone),
        Case("from_numpy", "1,024 host->device", [],
             lambda c: P(c.m.from_numpy, c.host(V)),
             lambda c: P(c.torch.as_tensor, c.host(V), device="cuda")),
        Case("to_numpy", "1,024 device->host", [V], lambda c, x: P(c.m.to_numpy, x),
             lambda c, x: lambda: x.cpu().numpy()),
        # elementwise
        Case("vector_add", "1,024 + 1,024", [V, V], lambda c, a, b: P(c.m.vector_add, a, b),
             lambda c, a, b: P(c.torch.add, a, b)),
        bi("add", "add"), bi("subtract", "sub"), bi("multiply", "mul"), bi("divide", "div"),
        bi("maximum", "maximum"), bi("minimum", "minimum"), bi("power", "pow"),
        Case("multiply_scalar", "1,024 * 2.5", [V], lambda c, x: P(c.m.multiply, x, 2.5),
             lambda c, x: P(c.torch.mul, x, 2.5)),
        Case("add_broadcast", "(32,1024) + (1024,)", [(32, 1024), (1024,)],
             lambda c, a, b: P(c.m.add, a, b), lambda c, a, b: P(c.torch.add, a, b)),
        # shape ops and comparisons (torch: the same result materialized)
        Case("greater", "64x64 > 0.5", [M], lambda c, x: P(c.m.greater, x, 0.5),
             lambda c, x: P(c.torch.gt, x, 0.5)),
        Case("where", "64x64, x > 0 ? x : 0", [M],
             lambda c, x: lambda: c.m.where(c.m.greater(x, 0.0), x, 0.0),
             lambda c, x: lambda: c.torch.where(x > 0.0, x, 0.0)),
        Case("slice_copy", "64x64 [1:33, ::2]", [M], lambda c, x: lambda: x[1:33, ::2],
             lambda c, x: lambda: x[1:33, ::2].contiguous()),
        Case("concatenate", "2 x 64x64, axis 1", [M, M],
             lambda c, a, b: P(c.m.concatenate, [a, b], axis=1),
             lambda c, a, b: P(c.torch.cat, [a, b], dim=1)),
        Case("astype", "64x64 f32 -> f16", [M], lambda c, x: P(c.m.astype, x, "float16"),
             lambda c, x: P(x.to, c.torch.float16)),
        un("exp", "exp"), un("log", "log"), un("sqrt", "sqrt"), un("abs", "abs"),
        un("tanh", "tanh"), un("negative", "neg"), un("relu", "relu"), un("sigmoid", "sigmoid"),
        Case("gelu", "1,024 (tanh)", [V], lambda c, x: P(c.ml.gelu, x),
             lambda c, x: P(c.F.gelu, x, approximate="tanh")),
        act("gelu_exact", "GELU_EXACT", lambda c: c.F.gelu),
        act("leaky_relu", "LEAKY_RELU", lambda c: c.F.leaky_relu),
        act("elu", "ELU", lambda c: c.F.elu),
        act("silu", "SILU", lambda c: c.F.silu),
        # rows
        Case("softmax", "64x64 dim=-1", [M], lambda c, x: P(c.m.softmax, x),
             lambda c, x: P(c.torch.softmax, x, dim=-1)),
        Case("log_softmax", "64x64 dim=-1", [M], lambda c, x: P(c.m.log_softmax, x),
             lambda c, x: P(c.torch.log_softmax, x, dim=-1)),
        red("reduce_sum", "sum"), red("reduce_mean", "mean"), red("reduce_max", "amax"),
        red("reduce_min", "amin"), red("argmax", "argmax"),
        Case("layer_norm", "64x64 weight+bias", [M, (64,), (64,)],
             lambda c, x, w, b: P(c.ml.layer_norm, x, w, b),
             lambda c, x, w, b: P(c.F.layer_norm, x, (64,), w, b)),
        # matrices
        Case("matrix_multiply", "64^3", [M, M], lambda c, a, b: P(c.m.matrix_multiply, a, b),
             lambda c, a, b: P(c.torch.matmul, a, b)),
        Case("matmul_out", "64^3 into an out= tensor (ops.matmul.matmul)", [M, M, M],
             lambda c, a, b, o: P(mm.matmul, c.m, a, b, None, out=o),
             lambda c, a, b, o: P(c.torch.matmul, a, b, out=o)),
        Case("matrix_transpose", "64x64", [M], lambda c, x: P(c.m.matrix_transpose, x),
             lambda c, x: lambda: x.t().contiguous()),
        # CudaML
        bn(False), bn(True),
        Case("conv2d", "(1,8,16,16)*(8,8,3,3) pad 1", [NCHW, (8, 8, 3, 3)],
             lambda c, x, w: P(c.ml.conv2d, x, w, c.ConvolutionConfig(3, padding=1)),
             lambda c, x, w: P(c.F.conv2d, x, w, padding=1)),
        Case("max_pool2d", "(1,8,16,16) 2x2", [NCHW], lambda c, x: P(c.ml.max_pool2d, x, 2),
             lambda c, x: P(c.F.max_pool2d, x, 2)),
        Case("avg_pool2d", "(1,8,16,16) 2x2", [NCHW], lambda c, x: P(c.ml.avg_pool2d, x, 2),
             lambda c, x: P(c.F.avg_pool2d, x, 2)),
        Case("flash_attention", "(1,2,64,64)", [QKV, QKV, QKV],
             lambda c, q, k, v: P(c.ml.flash_attention, q, k, v),
             lambda c, q, k, v: P(c.F.scaled_dot_product_attention, q, k, v)),
        Case("dropout", "1,024 keep 0.5", [V], lambda c, x: P(c.ml.dropout, x, 0.5),
             lambda c, x: P(c.F.dropout, x, 0.5, training=True)),
        Case("fused_linear_gelu", "32x1024 @ 1024x1024 + b", [(32, 1024), ((1024, 1024), scale_in),
                                                             (1024,)],
             lambda c, x, w, b: P(c.ml.fused_linear_gelu, x, w, b),
             lambda c, x, w, b: lambda: c.F.gelu(c.F.linear(x, w, b), approximate="tanh")),
        Case("sketched_linear", "32x1024, 2 terms rank 16 -> 1024",
             [(32, 1024), ((2, 1024, 16), scale_in), ((2, 16, 1024), 0.25), (1024,)],
             lambda c, x, u, v, b: P(c.ml.sketched_linear, x, u, v, b),
             lambda c, x, u, v, b: lambda: (x @ u @ v).mean(0) + b),
        Case("sgd_update", "1,024 params", [V, V],
             lambda c, p, g: P(c.ml.sgd_update, p, g, None,
                               c.OptimizerState(learning_rate=1e-3, momentum=0.0)),
             lambda c, p, g: P(p.add_, g, alpha=-1e-3)),
        Case("adam_update", "1,024 params", [V, V, V, V],
             lambda c, p, g, m_, v_: P(c.ml.adam_update, p, g, m_, v_,
                                       c.OptimizerState(learning_rate=1e-3)),
             adam_torch),
        # tensor operators
        Case("a+b", "1,024", [V, V], lambda c, a, b: P(op.add, a, b),
             lambda c, a, b: P(op.add, a, b)),
        Case("a*b", "1,024", [V, V], lambda c, a, b: P(op.mul, a, b),
             lambda c, a, b: P(op.mul, a, b)),
        Case("a@b", "64^3", [M, M], lambda c, a, b: P(op.matmul, a, b),
             lambda c, a, b: P(op.matmul, a, b)),
        Case("a.T", "64x64 (torch: .t().contiguous())", [M],
             lambda c, a: P(op.attrgetter("T"), a), lambda c, a: lambda: a.t().contiguous()),
        Case("-a", "1,024", [V], lambda c, a: P(op.neg, a), lambda c, a: P(op.neg, a)),
        # composite
        Case("mlp_forward", "batch 32: 1024->4096 gelu ->1024 softmax",
             mlp_in,
             mlp_ours, mlp_torch),
        Case("mlp_graph", "mlp_forward as a CUDA graph (torch: eager)",
             mlp_in,
             mlp_graph_ours, mlp_torch),
    ] + _more_cases()


# case -> the public op (registry.OPS name after the class) it times, where the names differ
COVERS = {
    "gelu_exact": "activation", "leaky_relu": "activation", "elu": "activation",
    "silu": "activation", "batch_norm_infer": "batch_norm", "batch_norm_train": "batch_norm",
    "slice_copy": "getitem", "add_broadcast": "add", "multiply_scalar": "multiply",
    "greater_equal_s": "greater_equal", "less_s": "less", "less_equal_s": "less_equal",
    "equal_t": "equal", "not_equal_s": "not_equal",
}


def _more_cases() -> list:
    """The public ops the cases above leave out (gradients, shape and indexing ops, the
    other comparisons, linear and cross-entropy), so that every registry.OPS entry has a row
    (tests/test_host_path.py checks it). PyTorch's peer is the aten op autograd runs."""
    from functools import partial as P
    import numpy as np

    def aten(c):
        return c.torch.ops.aten

    def idx(c, values, torch_side=False):
        a = np.asarray(values, np.int64)
        return c.torch.as_tensor(a, device="cuda") if torch_side else c.m.from_numpy(a)

    def grad_act(name, their):
        return Case(f"{name}_backward", "1,024 (grad, x or y)", [V, V],
                    lambda c, g, x: P(getattr(c.ml, f"{name}_backward"), g, x),
                    lambda c, g, x: P(their(c), g, x))

    def cmp(name, torch_name, scalar=True):
        suffix = "_s" if scalar else "_t"
        return Case(name + suffix, "64x64 vs 0.5" if scalar else "64x64 vs 64x64",
                    [M] if scalar else [M, M],
                    (lambda c, x: P(getattr(c.m, name), x, 0.5)) if scalar else
                    (lambda c, a, b: P(getattr(c.m, name), a, b)),
                    (lambda c, x: P(getattr(c.torch, torch_name), x, 0.5)) if scalar else
                    (lambda c, a, b: P(getattr(c.torch, torch_name), a, b)))

    def ln_bwd_torch(c, g, x, w):
        b = c.torch.zeros_like(w)
        _, mean, rstd = aten(c).native_layer_norm(x, [64], w, b, 1e-5)
        return P(aten(c).native_layer_norm_backward, g, x, [64], mean, rstd, w, b,
                 [True, True, True])

    def bn_bwd_torch(c, g, x, w):
        rm, rv = c.torch.zeros(8, device="cuda"), c.torch.ones(8, device="cuda")
        _, sm, sv = aten(c).native_batch_norm(x, w, None, rm, rv, True, 0.1, 1e-5)
        return P(aten(c).native_batch_norm_backward, g, x, w, rm, rv, sm, sv, True, 1e-5,
                 [True, True, True])

    def maxpool_bwd_torch(c, g, x):
        _, ind = aten(c).max_pool2d_with_indices(x, [2, 2], [2, 2])
        return P(aten(c).max_pool2d_with_indices_backward, g, x, [2, 2], [2, 2], [0, 0],
                 [1, 1], False, ind)

    def ce_torch(c, x):
        return P(c.F.cross_entropy, x, idx(c, np.arange(64) % 64, True))

    def ce_bwd_torch(c, x):
        lab = idx(c, np.arange(64) % 64, True)
        ls = c.torch.log_softmax(x, -1)
        one = c.torch.ones((), device="cuda")
        return lambda: aten(c)._log_softmax_backward_data(
            aten(c).nll_loss_backward(one, ls, lab, None, 1, -100, one), ls, -1,
            c.torch.float32)

    def attn_bwd_ours(c, g, q, k, v):
        out, lse = c.ml.flash_attention(q, k, v, return_lse=True)
        return P(c.ml.flash_attention_backward, g, q, k, v, out, lse)

    def packed_torch(c, qkv):
        q, k, v = qkv.view(1, 64, 3, 2, 64).permute(2, 0, 3, 1, 4)
        return lambda: c.F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(
            1, 64, 128)

    def packed_bwd_ours(c, g, qkv):
        out, lse = c.ml.flash_attention_packed(qkv, 2, return_lse=True)
        return P(c.ml.flash_attention_packed_backward, g, qkv, out, lse, 2)

    def ce_stats_ours(c, x):
        lab = idx(c, np.arange(64) % 64)
        _, st = c.ml.cross_entropy(x, lab, check_labels=False, return_row_stats=True)
        return P(c.ml.cross_entropy_backward, x, lab, 1.0, "mean", -100, False, st)

    return [
        # gradients
        grad_act("relu", lambda c: lambda g, x: aten(c).threshold_backward(g, x, 0)),
        grad_act("leaky_relu",
                 lambda c: lambda g, x: aten(c).leaky_relu_backward(g, x, 0.01, False)),
        grad_act("elu", lambda c: lambda g, x: aten(c).elu_backward(g, 1.0, 1, 1, False, x)),
        grad_act("gelu", lambda c: lambda g, x: aten(c).gelu_backward(g, x, approximate="tanh")),
        grad_act("sigmoid", lambda c: aten(c).sigmoid_backward),
        grad_act("tanh", lambda c: aten(c).tanh_backward),
        Case("softmax_backward", "64x64 (grad, y)", [M, M],
             lambda c, g, y: P(c.ml.softmax_backward, g, y),
             lambda c, g, y: P(aten(c)._softmax_backward_data, g, y, -1, c.torch.float32)),
        Case("log_softmax_backward", "64x64 (grad, y)", [M, M],
             lambda c, g, y: P(c.ml.log_softmax_backward, g, y),
             lambda c, g, y: P(aten(c)._log_softmax_backward_data, g, y, -1,
                               c.torch.float32)),
        Case("dropout_backward", "1,024 keep 0.5", [V],
             lambda c, g: P(c.ml.dropout_backward, g, 0.5, 7),
             lambda c, g: P(aten(c).native_dropout_backward, g, g > 1.0, 2.0)),
        Case("layer_norm_backward", "64x64 weight", [M, M, (64,)],
             lambda c, g, x, w: P(c.ml.layer_norm_backward, g, x, w), ln_bwd_torch),
        Case("batch_norm_backward", "(1,8,16,16) training", [NCHW, NCHW, C8],
             lambda c, g, x, w: P(c.ml.batch_norm_backward, g, x, w), bn_bwd_torch),
        Case("max_pool2d_backward", "(1,8,16,16) 2x2", [(1, 8, 8, 8), NCHW],
             lambda c, g, x: P(c.ml.max_pool2d_backward, g, x, 2), maxpool_bwd_torch),
        Case("avg_pool2d_backward", "(1,8,16,16) 2x2", [(1, 8, 8, 8), NCHW],
             lambda c, g, x: P(c.ml.avg_pool2d_backward, g, x, 2),
             lambda c, g, x: P(aten(c).avg_pool2d_backward, g, x, [2, 2], [2, 2], [0, 0],
                               False, True, None)),
        Case("conv2d_backward", "(1,8,16,16)*(8,8,3,3) pad 1", [NCHW, NCHW, (8, 8, 3, 3)],
             lambda c, g, x, w: P(c.ml.conv2d_backward, g, x, w,
                                  c.ConvolutionConfig(3, padding=1)),
             lambda c, g, x, w: P(aten(c).convolution_backward, g, x, w, None, [1, 1],
                                  [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])),
        Case("flash_attention_backward", "(1,2,64,64) (torch: none timed)", [QKV] * 4,
             attn_bwd_ours),
        Case("flash_attention_packed", "(1,64,3x128), 2 heads (torch: SDPA on views)",
             [(1, 64, 384)], lambda c, qkv: P(c.ml.flash_attention_packed, qkv, 2),
             packed_torch),
        Case("flash_attention_packed_backward", "(1,64,3x128), 2 heads (torch: none timed)",
             [(1, 64, 128), (1, 64, 384)], packed_bwd_ours),
        Case("linear", "32x1024 @ 1024x1024 + b", [(32, 1024), ((1024, 1024), 1024 ** -0.5),
                                                  (1024,)],
             lambda c, x, w, b: P(c.ml.linear, x, w, b),
             lambda c, x, w, b: P(c.F.linear, x, w, b)),
        Case("linear_backward", "32x1024 @ 1024x1024 + b", [(32, 1024), (32, 1024),
                                                           (1024, 1024)],
             lambda c, g, x, w: P(c.ml.linear_backward, g, x, w, True),
             lambda c, g, x, w: lambda: (g @ w, g.t() @ x, g.sum(0))),
        Case("fused_linear_gelu_backward", "32x1024 @ 1024x1024 + b (torch: none timed)",
             [(32, 1024), (32, 1024), (1024, 1024), (1024,)],
             lambda c, g, x, w, b: P(c.ml.fused_linear_gelu_backward, g, x, w, b)),
        Case("matmul_backward", "64^3", [M, M, M],
             lambda c, g, a, b: P(c.ml.matmul_backward, g, a, b),
             lambda c, g, a, b: lambda: (g @ b.t(), a.t() @ g)),
        Case("cross_entropy", "64x64, int64 labels, unchecked", [M],
             lambda c, x: P(c.ml.cross_entropy, x, idx(c, np.arange(64) % 64), "mean",
                            -100, False), ce_torch),
        Case("cross_entropy_backward", "64x64, from row stats", [M], ce_stats_ours,
             ce_bwd_torch),
        # shape and indexing ops
        Case("reshape", "64x64 -> 4096 (a view)", [M],
             lambda c, x: P(c.m.reshape, x, (4096,)), lambda c, x: P(x.reshape, 4096)),
        Case("view", "64x64 -> 4096", [M], lambda c, x: P(c.m.view, x, (4096,)),
             lambda c, x: P(x.view, 4096)),
        Case("permute", "(1,8,16,16) -> (0,2,3,1)", [NCHW],
             lambda c, x: P(c.m.permute, x, (0, 2, 3, 1)),
             lambda c, x: lambda: x.permute(0, 2, 3, 1).contiguous()),
        Case("transpose", "64x64", [M], lambda c, x: P(c.m.transpose, x),
             lambda c, x: lambda: x.t().contiguous()),
        Case("split", "64x64 into 2 along axis 1", [M],
             lambda c, x: P(c.m.split, x, 2, axis=1),
             lambda c, x: lambda: [t.contiguous() for t in c.torch.split(x, 32, dim=1)]),
        Case("stack", "2 x 64x64", [M, M], lambda c, a, b: P(c.m.stack, [a, b]),
             lambda c, a, b: P(c.torch.stack, [a, b])),
        Case("broadcast_to", "1,024 -> 4x1,024", [V],
             lambda c, x: P(c.m.broadcast_to, x, (4, 1024)),
             lambda c, x: lambda: x.expand(4, 1024).contiguous()),
        Case("take", "8 rows of 64x64, unchecked", [M],
             lambda c, x: P(c.m.take, x, idx(c, np.arange(8)), 0, False),
             lambda c, x: P(c.torch.index_select, x, 0, idx(c, np.arange(8), True))),
        Case("gather", "64x64 along axis 1, 64x3 indices, unchecked", [M],
             lambda c, x: P(c.m.gather, x, idx(c, np.zeros((64, 3))), 1, False),
             lambda c, x: P(c.torch.gather, x, 1, idx(c, np.zeros((64, 3)), True))),
        Case("scatter_add", "8 rows into 64x64, unchecked", [M, (8, 64)],
             lambda c, t, src: P(c.m.scatter_add, t, idx(c, np.arange(8)), src, 0, False),
             lambda c, t, src: P(t.index_add_, 0, idx(c, np.arange(8), True), src)),
        cmp("equal", "eq", scalar=False), cmp("not_equal", "ne"), cmp("less", "lt"),
        cmp("less_equal", "le"), cmp("greater_equal", "ge"),
    ]


def _release_ours(outs: list, keep: tuple = ()) -> None:
    """Free the tensors among outs (and tuples in it), except those in keep: the inputs,
    which in-place ops such as fill return."""
    from cuda_backend.tensor import CudaTensor
    for o in outs:
        for t in (o if isinstance(o, tuple) else (o,)):
            if isinstance(t, CudaTensor) and not any(t is k for k in keep):
                t.free()


def _release_none(outs: list) -> None:
    return None


class Side:
    """One side of a case (ours or torch): what to time, and its per-run results."""

    def __init__(self, name: str, fn, sync, release) -> None:
        self.name, self.fn, self.sync, self.release = name, fn, sync, release
        self.samples: list = []      # us per call, one per run
        self.error = None


def _one_run_us(side: Side, calls: int) -> float:
    """`calls` back-to-back calls then one sync, wall clock, us per call; the results are kept
    until the clock stops, then released (not timed)."""
    fn = side.fn
    outs = [None] * calls
    t0 = time.perf_counter()
    for i in range(calls):
        outs[i] = fn()
    side.sync()
    dt = time.perf_counter() - t0
    side.release(outs)
    del outs
    return dt / calls * 1e6


def interleaved_runs(sides: list, calls: int, runs: int, warmup: int) -> None:
    """Warm each side up, then `runs` rounds of one run per side in order (ours, torch, ours,
    torch, ...), so both sides see the same machine state; fills side.samples, or side.error
    (then its samples are dropped) when a call fails. The GC is off during the rounds."""
    for side in sides:
        try:
            outs = [side.fn() for _ in range(warmup)]
            side.sync()
            side.release(outs)
            del outs
        except Exception as exc:      # noqa: BLE001 -- the other side still runs
            side.error = f"{type(exc).__name__}: {exc}"
    live = [side for side in sides if side.error is None]
    gc.collect()
    gc.disable()
    try:
        for _ in range(runs):
            for side in live:
                if side.error is not None:
                    continue
                try:
                    side.samples.append(_one_run_us(side, calls))
                except Exception as exc:  # noqa: BLE001
                    side.error = f"{type(exc).__name__}: {exc}"
                    side.samples = []
    finally:
        gc.enable()
    gc.collect()


class _Ctx:
    """What the case builders use: our math/ml, torch, and host inputs."""


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def gpu_main(args: argparse.Namespace) -> int:
    cases = all_cases = _cases()
    known = [c.name for c in cases] + ["mlp_forward_gpu_time", "sync_transpose"]
    wanted = None
    if args.ops:
        wanted = [s.strip() for s in args.ops.split(",") if s.strip()]
        unknown = [w for w in wanted if w not in known]
        if unknown:
            print(f"unknown --ops {unknown}; known: {', '.join(known)}", file=sys.stderr)
            return 2
        cases = [c for c in cases if c.name in wanted]

    import json
    import platform
    import statistics
    import numpy as np
    from cuda_backend.cuda_math import get_cuda_math
    from cuda_backend.cuda_ml import (ActivationType, ConvolutionConfig, OptimizerState,
                                      get_cuda_ml)
    from cuda_backend.performance.timing import make_timer

    m = get_cuda_math()
    ml = get_cuda_ml()
    b = m.backend
    torch = F = None
    torch_note = "not installed"
    if args.no_torch:
        torch_note = "off (--no-torch)"
    else:
        try:
            import torch
            import torch.nn.functional as F
            if not torch.cuda.is_available() or not b.is_available:
                torch_note = "no CUDA device (torch.cuda.is_available() is False)" \
                    if not torch.cuda.is_available() else "skipped: our backend is in fallback mode"
                torch = F = None
            else:
                torch_note = torch.__version__
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.backends.cudnn.allow_tf32 = False
                torch.backends.cudnn.benchmark = True
        except Exception as exc:      # noqa: BLE001 -- report and time ours only
            torch_note = f"import failed: {type(exc).__name__}: {exc}"
            torch = F = None
    device = b.devices[0].name if b.is_available else \
        f"fallback mode, NumPy on the host ({b.fallback_reason})"
    print(f"device: {device}\ntorch: {torch_note}\n"
          f"per call: {args.runs} interleaved pairs of runs (ours, torch, ours, ...), one run = "
          f"{args.calls} back-to-back calls + one sync, wall clock / calls; {args.warmup} "
          f"warm-up calls per side; GC off during the runs\n"
          f"columns: min and median over the runs, us per call; ours/torch = ours min / torch "
          f"min\n")

    c = _Ctx()
    c.m, c.ml, c.torch, c.F, c.b, c.np = m, ml, torch, F, b, np
    c.ActivationType, c.ConvolutionConfig, c.OptimizerState = \
        ActivationType, ConvolutionConfig, OptimizerState
    rng = np.random.default_rng(0)
    c.host = lambda shape: rng.uniform(0.5, 1.5, shape).astype(np.float32)
    ours_sync = b.synchronize
    torch_sync = torch.cuda.synchronize if torch is not None else None

    def arrays(spec: list) -> list:
        out = []
        for s in spec:
            shape, scale = (s, 1.0) if isinstance(s[0], int) else s
            out.append(c.host(shape) * np.float32(scale))
        return out

    rows = []
    print(f"{'op':<18} {'inputs':<42} {'ours min':>9} {'ours med':>9} {'torch min':>9} "
          f"{'torch med':>9} {'ours/torch':>10}")
    for case in cases:
        row = {"op": case.name, "inputs": case.desc, "ours_min_us": None, "torch_min_us": None}
        hosts = arrays(case.inputs)
        sides, ours_t, close = [], [], None
        try:
            try:
                ours_t = [m.from_numpy(h) for h in hosts]
                built = case.ours(c, *ours_t)
                if isinstance(built, Timed):
                    close = built.close
                    row.update(built.extra)
                    sides.append(Side("ours", built.fn, built.sync, built.release))
                else:
                    keep = tuple(ours_t)
                    sides.append(Side("ours", built, ours_sync,
                                      lambda outs, keep=keep: _release_ours(outs, keep)))
            except Exception as exc:  # noqa: BLE001 -- one failing case must not end the run
                row["ours_error"] = f"{type(exc).__name__}: {exc}"
            if torch is not None and case.theirs is not None:
                try:
                    tt = [torch.as_tensor(h, device="cuda") for h in hosts]
                    sides.append(Side("torch", case.theirs(c, *tt), torch_sync, _release_none))
                except Exception as exc:  # noqa: BLE001
                    row["torch_error"] = f"{type(exc).__name__}: {exc}"
                tt = None
            interleaved_runs(sides, args.calls, args.runs, args.warmup)
        finally:
            try:
                if close is not None:
                    close()
                _release_ours(ours_t)
            except Exception as exc:      # noqa: BLE001
                row["ours_close_error"] = f"{type(exc).__name__}: {exc}"
        for side in sides:
            if side.error is not None:
                row[f"{side.name}_error"] = side.error
            elif side.samples:
                row[f"{side.name}_min_us"] = min(side.samples)
                row[f"{side.name}_median_us"] = statistics.median(side.samples)
                row[f"{side.name}_runs_us"] = side.samples
        sides = None
        if row["ours_min_us"] is not None and row["torch_min_us"]:
            row["ours_over_torch"] = row["ours_min_us"] / row["torch_min_us"]
        rows.append(row)
        print(f"{case.name:<18} {case.desc:<42} {_fmt(row['ours_min_us']):>9} "
              f"{_fmt(row.get('ours_median_us')):>9} {_fmt(row['torch_min_us']):>9} "
              f"{_fmt(row.get('torch_median_us')):>9} {_fmt(row.get('ours_over_torch')):>10}",
              flush=True)
        for key in ("identical",):
            if key in row:
                print(f"    {key}: {row[key]}", flush=True)
        for side in ("ours", "torch", "ours_close"):
            if f"{side}_error" in row:
                print(f"    {side} failed: {row[side + '_error']}", flush=True)

    mlp_gpu = None
    if wanted is None or "mlp_forward_gpu_time" in wanted:
        mlp_case = next(case for case in all_cases if case.name == "mlp_forward")
        mlp_gpu = {"samples": 50, "warmup": args.warmup}
        print(f"\neager mlp_forward ({mlp_case.desc}): GPU time per call (us)")
        ours_t = []
        try:
            ours_t = [m.from_numpy(h) for h in arrays(mlp_case.inputs)]
            fn = mlp_case.ours(c, *ours_t)
            for flush_l2, key, note in (
                    (False, "warm_l2", "warm L2 (from an idle GPU: includes the enqueue of "
                                       "the first kernel)"),
                    (True, "l2_flushed", "L2 flushed (the flush keeps the GPU busy while the "
                                         "call is enqueued: kernels only; weights from HBM)")):
                timer = make_timer(b, 0, flush_l2)
                try:
                    flush = timer.flush_description()
                    gpu = [ms * 1e3 for ms in timer.time(fn, args.warmup, mlp_gpu["samples"],
                                                         release=lambda t: t.free())]
                finally:
                    timer.close()
                mlp_gpu["gpu_timer"] = timer.kind
                mlp_gpu[key] = {"median_us": statistics.median(gpu), "min_us": min(gpu),
                                "flush": flush}
                print(f"  GPU ({timer.kind}) median {mlp_gpu[key]['median_us']:10.1f}  "
                      f"best {mlp_gpu[key]['min_us']:10.1f}   {note}")
            wall = next((r.get("ours_min_us") for r in rows if r["op"] == "mlp_forward"), None)
            mlp_gpu["ours_wall_min_us"] = wall
            if wall is None:
                print("  per-call wall time: run the mlp_forward case too (--ops) for the "
                      "host overhead")
            else:
                gpu_us = min(mlp_gpu["warm_l2"]["median_us"], mlp_gpu["l2_flushed"]["median_us"])
                mlp_gpu["gpu_us"] = gpu_us
                mlp_gpu["host_overhead_us"] = wall - gpu_us
                print(f"  ours wall per call (mlp_forward, min)        {wall:10.1f}\n"
                      f"  GPU time (lower median; both over-estimate)  {gpu_us:10.1f}\n"
                      f"  host overhead over GPU time                  "
                      f"{mlp_gpu['host_overhead_us']:10.1f}")
        except Exception as exc:      # noqa: BLE001
            mlp_gpu["ours_error"] = f"{type(exc).__name__}: {exc}"
            print(f"  ours failed: {mlp_gpu['ours_error']}")
        finally:
            fn = None
            try:
                _release_ours(ours_t)
            except Exception as exc:  # noqa: BLE001
                mlp_gpu["ours_close_error"] = f"{type(exc).__name__}: {exc}"

    sync_t = None
    if wanted is None or "sync_transpose" in wanted:
        sync_t = {"n": args.transpose_n}
        n = args.transpose_n
        print(f"\nsynchronous matrix_transpose of {n}x{n} float32 (us per call)")
        x = None
        try:
            x = m.from_numpy(rng.uniform(0.5, 1.5, (n, n)).astype(np.float32))
            walls = []
            for i in range(23):
                t0 = time.perf_counter()
                out = m.matrix_transpose(x)
                ours_sync()
                dt = time.perf_counter() - t0
                out.free()
                if i >= 3:                     # 3 warm-up calls
                    walls.append(dt * 1e6)
            timer = make_timer(b, 0, False)
            try:
                gpu = [ms * 1e3 for ms in timer.time(lambda: m.matrix_transpose(x), 3, 20,
                                                     release=lambda t: t.free())]
            finally:
                timer.close()
            sync_t.update(wall_median_us=statistics.median(walls), wall_min_us=min(walls),
                          gpu_median_us=statistics.median(gpu), gpu_min_us=min(gpu),
                          gpu_timer=timer.kind)
            sync_t["host_overhead_us"] = sync_t["wall_median_us"] - sync_t["gpu_median_us"]
            print(f"  ours wall (call + sync)  median {sync_t['wall_median_us']:10.1f}  "
                  f"best {sync_t['wall_min_us']:10.1f}\n"
                  f"  ours GPU ({timer.kind:<11})  median {sync_t['gpu_median_us']:10.1f}  "
                  f"best {sync_t['gpu_min_us']:10.1f}\n"
                  f"  wall - GPU (median)      {sync_t['host_overhead_us']:10.1f}")
        except Exception as exc:      # noqa: BLE001
            sync_t["ours_error"] = f"{type(exc).__name__}: {exc}"
            print(f"  ours failed: {sync_t['ours_error']}")
        finally:
            if x is not None:
                x.free()
        if torch is not None:
            try:
                tx = torch.rand((n, n), device="cuda")
                walls = []
                for i in range(23):
                    t0 = time.perf_counter()
                    out = tx.t().contiguous()
                    torch_sync()
                    if i >= 3:
                        walls.append((time.perf_counter() - t0) * 1e6)
                    del out
                sync_t["torch_wall_median_us"] = statistics.median(walls)
                sync_t["torch_wall_min_us"] = min(walls)
                print(f"  torch wall (.t().contiguous() + sync) median "
                      f"{sync_t['torch_wall_median_us']:10.1f}  best "
                      f"{sync_t['torch_wall_min_us']:10.1f}")
                del tx
            except Exception as exc:  # noqa: BLE001
                sync_t["torch_error"] = f"{type(exc).__name__}: {exc}"
                print(f"  torch failed: {sync_t['torch_error']}")

    if args.out:
        doc = {"script": "perf/bench_host_path.py", "mode": "gpu" if b.is_available else
               "fallback", "device": device, "torch": torch_note,
               "python": platform.python_version(), "calls": args.calls, "runs": args.runs,
               "warmup": args.warmup, "timing": "wall clock (time.perf_counter), us per call: "
               "`runs` pairs of runs interleaved (ours, torch, ours, ...), one run = `calls` "
               "back-to-back calls + one synchronize; per side the minimum (*_min_us) and the "
               "median (*_median_us) over the runs, every run in *_runs_us; ours_over_torch = "
               "ours_min_us / torch_min_us; results freed untimed; GC off during the runs",
               "ratio": "ours_min_us / torch_min_us",
               "torch_tf32": False if torch is not None else None,
               "cases": rows, "mlp_forward_gpu_time": mlp_gpu, "sync_transpose": sync_t}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"\nwrote {args.out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stub", action="store_true",
                    help="stub mode: our Python alone, PyCUDA replaced by stubs (the default "
                         "when PyCUDA is missing)")
    ap.add_argument("--gpu", action="store_true",
                    help="GPU mode even without PyCUDA (then NumPy fallback: checks the script)")
    ap.add_argument("--reps", type=int, default=20000, help="stub mode: calls per run")
    ap.add_argument("--ops", help="GPU mode: comma-separated case names (default: all)")
    ap.add_argument("--out", help="GPU mode: write the results as JSON")
    ap.add_argument("--calls", type=int, default=1000, help="GPU mode: calls per run")
    ap.add_argument("--runs", type=int, default=15,
                    help="GPU mode: interleaved pairs of runs (ours, torch) per case; the "
                         "minimum and the median are reported, the ratio is on the minima")
    ap.add_argument("--warmup", type=int, default=20, help="GPU mode: warm-up calls")
    ap.add_argument("--transpose-n", type=int, default=8192,
                    help="GPU mode: sync_transpose size (N x N)")
    ap.add_argument("--no-torch", action="store_true", help="GPU mode: time ours only")
    args = ap.parse_args()
    if args.stub and args.gpu:
        ap.error("--stub and --gpu exclude each other")
    if args.stub or not args.gpu:
        import importlib.util
        if args.stub or importlib.util.find_spec("pycuda") is None:
            stub_main(args)
            return 0
    return gpu_main(args)


if __name__ == "__main__":
    sys.exit(main())
