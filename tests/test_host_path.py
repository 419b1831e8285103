"""The elementwise per-call plans (ops/elementwise.py) against the general path, on any machine.

A subprocess replaces PyCUDA by the stubs of perf/bench_host_path.py (driver calls do
nothing, the stub's `_launch_kernel` records what it was given), so the backend runs its GPU
code paths without a GPU. Each check makes the general path launch once (which makes the
plan), frees the result so that the pool hands the same block back, calls again through the
plan, and compares: same grid, block and packed argument bytes, and a result tensor whose
every slot equals what CudaTensor.__init__ would have set. The cases where a plan must step
aside (freed or mismatched operands, `with stream:`, profiling, bfloat16 or overflowing
scalars) are checked to take the general path, with its errors.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(r'''
    import os, sys
    sys.path.insert(0, os.path.join(ROOT, "perf"))
    sys.path.insert(0, ROOT)
    os.environ.pop("CUDA_BACKEND_FALLBACK", None)
    from bench_host_path import install_fake_pycuda
    install_fake_pycuda()
    import numpy as np
    import pytest
    from cuda_backend.backend import CudaBackend
    from cuda_backend.cuda_math import CudaMath
    from cuda_backend.dtypes import CudaDataType as DT
    from cuda_backend.errors import (DTypeMismatchError, ShapeMismatchError,
                                     TensorFreedError)
    from cuda_backend.tensor import CudaTensor

    launches = []
    Function = type(sys.modules["pycuda.compiler"].SourceModule("").get_function("k"))
    def record(self, grid, block, buf, shared, stream):
        assert min(grid) >= 1 and min(block) >= 1, f"empty launch: grid {grid} block {block}"
        launches.append((grid, block, bytes(buf), shared, stream))
    Function._launch_kernel = record

    b = CudaBackend()
    assert b.is_available
    m = CudaMath(b)
    pool = b.memory_pools[0]

    def slots(t):
        return {k: getattr(t, k) for k in CudaTensor.__slots__ if k != "__weakref__"}

    def same_as_general(call, plans, key):
        """call() once through the general path, once through the plan: same launch."""
        plans.pop(key, None)
        launches.clear()
        r1 = call()
        assert key in plans, key
        ref = (launches[-1], slots(r1))
        r1.free()                       # the pool hands the same block back
        r2 = call()
        assert len(launches) == 2
        assert launches[-1] == ref[0], (launches[-1], ref[0])
        got = slots(r2)
        ref_slots = ref[1]
        ref_slots["_block"] = got["_block"]
        assert got == ref_slots
        init = CudaTensor(r2.shape, r2.dtype, 0, r2._ptr, block=r2._block, pool=pool)
        assert slots(init) == got
        return r2

    x32 = m.from_numpy(np.arange(1024, dtype=np.float32))
    y32 = m.from_numpy(np.ones(1024, np.float32))
    odd = m.from_numpy(np.ones(1023, np.float32))
    bp, up, sp = m._ew_binary_plans, m._ew_unary_plans, m._ew_scalar_plans
    same_as_general(lambda: m.add(x32, y32), bp, ("add", "FLOAT32", 0))
    same_as_general(lambda: m.subtract(odd, odd), bp, ("subtract", "FLOAT32", 0))
    same_as_general(lambda: m.vector_add(x32, y32), bp, ("add", "FLOAT32", 0))
    same_as_general(lambda: m.sigmoid(x32), up, ("sigmoid", "FLOAT32", 0))
    same_as_general(lambda: m.multiply(x32, 2.5), sp, ("multiply", "FLOAT32", 0))
    same_as_general(lambda: m.multiply(0.1, x32), sp, ("multiply", "FLOAT32", 0))
    same_as_general(lambda: m.subtract(0.1, x32), sp, ("subtract", "FLOAT32", 0))
    same_as_general(lambda: m.divide(x32, 3), sp, ("divide", "FLOAT32", 0))
    same_as_general(lambda: m.subtract(x32, 1e-300), sp, ("subtract", "FLOAT32", 0))
    for dt, v in ((np.float64, 0.1), (np.float16, 0.1), (np.float16, 65519.0),
                  (np.int32, 7), (np.int64, -2**40)):
        t = m.from_numpy(np.ones(300, dt))
        name = DT.from_any(dt)._name_
        same_as_general(lambda: m.add(t, t), bp, ("add", name, 0))
        same_as_general(lambda: m.multiply(t, v), sp, ("multiply", name, 0))
        same_as_general(lambda: m.maximum(v, t), sp, ("maximum", name, 0))
    same_as_general(lambda: m.relu(odd), up, ("relu", "FLOAT32", 0))
    for n in (1, 2, 3, 5):             # fewer elements than one 16-byte vector: one block
        tiny = m.from_numpy(np.ones(n, np.float32))
        same_as_general(lambda: m.add(tiny, tiny), bp, ("add", "FLOAT32", 0))
        same_as_general(lambda: m.log(tiny), up, ("log", "FLOAT32", 0))
        same_as_general(lambda: m.multiply(tiny, 2.0), sp, ("multiply", "FLOAT32", 0))

    # scalars the plan leaves to the general path: overflow (-> inf), bool, NumPy, bad ints
    m.multiply(x32, 1.0)
    launches.clear()
    r = m.multiply(x32, 1e39)            # overflows float32: general path, inf
    import struct
    assert struct.unpack("PPPfqi", launches[-1][2][:44])[3] == float("inf")
    r = m.multiply(x32, True); r = m.multiply(x32, np.float32(2))
    i32 = m.from_numpy(np.ones(10, np.int32))
    m.add(i32, 1)
    with pytest.raises(Exception):
        m.add(i32, 2**40)
    with pytest.raises(DTypeMismatchError):
        m.add(i32, 1.5)

    # mismatched or freed operands: the general path's errors
    with pytest.raises(ShapeMismatchError):
        m.vector_add(x32, odd)
    with pytest.raises(DTypeMismatchError):
        m.add(x32, m.from_numpy(np.ones(1024, np.float64)))
    dead = m.from_numpy(np.ones(1024, np.float32))
    dead.free()
    with pytest.raises(TensorFreedError):
        m.vector_add(x32, dead)
    with pytest.raises(TensorFreedError):
        m.sigmoid(dead)
    with pytest.raises(TensorFreedError):
        m.multiply(dead, 2.0)
    empty = m.from_numpy(np.ones(0, np.float32))
    assert m.add(empty, empty).size == 0 and m.sigmoid(empty).size == 0

    # a `with stream:` block and profiling take the general path (stream given, events)
    s = b.stream()
    launches.clear()
    with s:
        m.vector_add(x32, y32)
        m.multiply(x32, 2.0)
        m.sigmoid(x32)
    assert [l[4] for l in launches] == [s.pycuda_stream] * 3
    b.enable_profiling = True
    m.vector_add(x32, y32)
    assert b.get_performance_stats()["kernel_execution_times"]
    b.enable_profiling = False

    # pool statistics through the plan: one hit per call once the block is cached
    m.vector_add(x32, y32).free()
    before = pool.get_stats()
    for _ in range(5):
        m.vector_add(x32, y32).free()
    after = pool.get_stats()
    assert after["hits"] - before["hits"] == 5 and after["misses"] == before["misses"]
    assert after["allocation_count"] - before["allocation_count"] == 5
    print("OK")
''').replace("ROOT", repr(ROOT))


def test_plans_match_general_path():
    env = {k: v for k, v in os.environ.items() if k != "CUDA_BACKEND_FALLBACK"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr
