"""Helpers shared by several test files: watching a per-call plan (ops/common.py
remember_plan) take a call, a view one element past an aligned pointer, a stand-in
CudaMath for the warm-up helpers, the backward tests' unit-roundoff tables, device tensors
of given values and the elementwise bound checks, a CudaMath with its own autotuner file,
central differences, and a backend that records launches. conftest.py has pytest rewrite
this module's asserts."""
from __future__ import annotations

import contextlib
import math
import re
import struct
import threading
from types import SimpleNamespace

import numpy as np

from cuda_backend import CudaDataType as DT
from cuda_backend.compiler import arg_format, kernel_signature
from cuda_backend.kernels import KernelGenerator
from cuda_backend.launch import normalize_dims
from cuda_backend.tensor import CudaTensor

FLOATS = [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16]
# unit roundoff of the storage and of the math type (the half types compute in float32)
U_OUT = {DT.FLOAT32: 2.0**-24, DT.FLOAT64: 2.0**-53, DT.FLOAT16: 2.0**-11, DT.BFLOAT16: 2.0**-8}
U_ACC = {DT.FLOAT32: 2.0**-24, DT.FLOAT64: 2.0**-53, DT.FLOAT16: 2.0**-24,
         DT.BFLOAT16: 2.0**-24}
# the absolute floor: half the spacing of float16's subnormals (its outputs round there),
# else far below any value tested
ATOL = {DT.FLOAT32: 1e-30, DT.FLOAT64: 1e-300, DT.FLOAT16: 2.0**-25, DT.BFLOAT16: 1e-30}
EPS64 = 2.0**-52


def call_through_plan(m, key, call):
    """call() with m.plans[key] (the per-call plan an earlier call made, ops/common.py
    remember_plan) wrapped to record what it returns: it must have run and taken the call."""
    plan = m.plans[key]
    seen = []
    m.plans[key] = lambda *args: seen.append(plan(*args)) or seen[-1]
    try:
        res = call()
    finally:
        m.plans[key] = plan
    assert len(seen) == 1 and seen[0] is not None and seen[0] is not False, key
    return res


def spy_plan(m, key):
    """Replace the one-operand plan under key by one that notes whether it gave the result;
    returns that list of notes."""
    plan, taken = m.plans[key], []

    def spy(x):
        res = plan(x)
        taken.append(res is not None)
        return res
    m.plans[key] = spy
    return taken


def view_past_aligned(m, make, shape, dtype, rng):
    """A view of `shape` one element past an aligned pointer (a narrower access width):
    (the view, the tensor it views, which the caller frees, the view's host values).
    make(m, shape, dtype, rng) -> (tensor, host values) is the test file's own."""
    base, host = make(m, (math.prod(shape) + 1,), dtype, rng)
    x = CudaTensor(shape, dtype, base.device_id, base.ptr + dtype.itemsize, owner=base)
    return x, base, host[1:].reshape(shape)


# -- a stand-in CudaMath for the warm-up helpers (records the kernels asked for) -------------
class StandInBackend:
    current_device = 0

    @contextlib.contextmanager
    def device(self, device_id):
        yield device_id


class StandInMath:
    """Only what compile_all, warm_up and the kernel getters touch: gpu, backend, kernel();
    `calls` holds (template, device_id, sorted parameter names) per kernel asked for."""

    def __init__(self, gpu=True):
        self.gpu = gpu
        self.backend = StandInBackend()
        self.calls = []
        self._lock = threading.Lock()

    def kernel(self, template, device_id, **params):
        with self._lock:
            self.calls.append((template, device_id, tuple(sorted(params))))
        return SimpleNamespace(name="k")


# -- device tensors of given values and the elementwise checks ------------------------------
def host_dtype(dtype):
    """The NumPy dtype a host array for dtype has (bfloat16 goes through float32)."""
    return np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype


def make(m, values, dtype):
    """(tensor, its stored values in float64)."""
    t = m.from_numpy(np.asarray(values, np.float64).astype(host_dtype(dtype)), dtype=dtype)
    return t, m.to_numpy(t).astype(np.float64)


def misaligned(m, values, dtype):
    """A view of values one element past a 16-byte aligned pointer (the element paths):
    (view, base to free, stored values)."""
    values = np.asarray(values, np.float64)
    base, h = make(m, np.concatenate([[0.0], values.ravel()]), dtype)
    v = CudaTensor(values.shape, dtype, base.device_id, base.ptr + dtype.itemsize, owner=base)
    return v, base, h[1:].reshape(values.shape)


def poisoned(m, shape, dtype):
    """A new tensor of shape filled with NaN (bfloat16: 0x7FC0), to catch unwritten elements."""
    out = m.create_tensor(shape, dtype)
    if out.size:
        host = np.full(shape, 0x7FC0, np.uint16) if dtype is DT.BFLOAT16 else \
            np.full(shape, np.nan, dtype.numpy_dtype)
        m.backend.copy_to_device(host, out)
    return out


def check(out, ref, bound, what=""):
    """|out - ref| <= bound elementwise, NaN where ref is NaN."""
    out = np.asarray(out, np.float64)
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref), err_msg=what)
    ok = ~np.isnan(ref)
    err = np.abs(out[ok] - ref[ok])
    bad = ~(err <= bound[ok])
    assert not bad.any(), (what, int(bad.sum()), float(np.max(err[bad] / bound[ok][bad])),
                           out[ok][bad][:4], ref[ok][bad][:4])


def check_finite(out, ref, bound, what=""):
    """|out - ref| <= bound elementwise, every element of out finite (written)."""
    out = np.asarray(out, np.float64)
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    assert np.isfinite(out).all(), (what, "non-finite (unwritten?) elements")
    err = np.abs(out - ref)
    bad = ~(err <= bound)
    assert not bad.any(), (what, int(bad.sum()), float(np.max(err[bad] / bound[bad])),
                           out[bad][:4], ref[bad][:4])


def tuned_math(backend, tmp_path_factory):
    """A CudaMath on backend whose autotuner writes to a temporary file."""
    from cuda_backend.autotune import Autotuner
    from cuda_backend.cuda_math import CudaMath
    m = CudaMath(backend)
    m._autotuner = Autotuner(backend, path=str(tmp_path_factory.mktemp("tune") / "t.json"))
    return m


def fd_grad(f, arrays, i, h):
    """Central differences (step h) of the scalar f(*arrays) with respect to arrays[i]."""
    x = arrays[i]
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + h
        hi = f(*arrays)
        x[idx] = old - h
        lo = f(*arrays)
        x[idx] = old
        g[idx] = (hi - lo) / (2 * h)
    return g


# -- launches on a recording backend (any machine) ------------------------------------------
class RecordingBackend:
    """Records launches instead of running them: each must pack with its kernel's parameter
    format and use the template's thread count."""

    is_available = True
    current_device = 0

    def __init__(self, cc=None):
        self.next_ptr = 1 << 20
        self.kernels = {}
        self.launches = []
        self.info = {} if cc is None else {"compute_capability": cc}

    def empty(self, shape, dtype, device_id=0):
        t = CudaTensor(tuple(shape), DT.from_any(dtype), 0, self.next_ptr)
        self.next_ptr += (t.nbytes // 256 + 2) * 256
        return t

    def memset_async(self, tensor, value, stream=None):
        self.launches.append(("memset", tensor.ptr, value, stream))

    def get_device_info(self, device_id):
        return SimpleNamespace(multiprocessor_count=132,
                               max_grid_dims=(2**31 - 1, 65535, 65535), **self.info)

    def launch_kernel(self, name, grid, *args, block_size=(256, 1, 1), shared_mem=0,
                      device_id=0):
        k = self.kernels[name]
        values = [a.ptr if isinstance(a, CudaTensor) else a for a in args]
        assert len(values) == len(k.fmt), (k.params, len(values), k.fmt)
        struct.pack("".join("Q" if c == "P" else c for c in k.fmt), *values)
        g, b = normalize_dims(grid, "grid"), normalize_dims(block_size, "block")
        assert b == (k.threads, 1, 1), (k.params, b)
        self.launches.append((k, g, shared_mem, values))
        return 0.0


def defined_int(src, name):
    """The value of an integer #define of a rendered kernel, its macros expanded (C's
    integer division)."""
    defs = dict(re.findall(r"^#define (\w+) (.+?)\s*(?://.*)?$", src, re.M))
    expr = defs[name]
    while True:
        expanded = re.sub(r"\b[A-Z_][A-Z0-9_]*\b", lambda t: f"({defs[t.group(0)]})", expr)
        if expanded == expr:
            assert re.fullmatch(r"[0-9\s()+*/-]+", expr), expr
            return int(eval(expr.replace("/", "//"), {}))   # integer arithmetic only
        expr = expanded


class RecordingMath:
    """A CudaMath stand-in on a RecordingBackend: kernels rendered (not compiled), the
    autotuner running every candidate and taking the first; `picked` holds the last
    (op, candidates) it was asked about. cc: the device's compute capability (None: its
    info has none, as before clusters)."""

    gpu = True

    def __init__(self, cc=None):
        self.backend = RecordingBackend(cc)
        self.generator = KernelGenerator(backend=object())
        self.autotuner = SimpleNamespace(pick=self._pick)
        self.picked = None

    def _pick(self, op, key, cands, run, device_id=0, repeats=3):
        self.picked = (op, cands)
        for c in cands:
            run(c)
        return dict(cands[0])

    def kernel(self, template, device_id, **params):
        name, src = self.generator.render_kernel(template, **dict(params))
        if re.search(r"^#define THREADS ", src, re.M):   # a number, or macros of the params
            threads = defined_int(src, "THREADS")
        else:                                             # (the reduces: block_size)
            threads = params["block_size"]
        k = SimpleNamespace(
            name=name, template=template, params=params,
            fmt=arg_format(src, name, kernel_signature(src, name)), threads=threads)
        self.backend.kernels[name] = k
        return k
