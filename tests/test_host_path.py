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

# The start of every script: PyCUDA replaced by the stubs, each launch recorded in `launches`
# as (grid, block, packed arguments, shared memory, stream).
STUBS = r'''
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
    from cuda_backend.tensor import CudaTensor

    launches = []
    Function = type(sys.modules["pycuda.compiler"].SourceModule("").get_function("k"))
    def record(self, grid, block, buf, shared, stream):
        assert min(grid) >= 1 and min(block) >= 1, f"empty launch: grid {grid} block {block}"
        launches.append((grid, block, bytes(buf), shared, stream))
    Function._launch_kernel = record
'''

# Then (after a script's own imports and stubs) the backend on the stubs, and how a result is
# compared with the general path's.
BACKEND = r'''
    b = CudaBackend()
    assert b.is_available
    m = CudaMath(b)
    pool = b.memory_pools[0]

    def slots(t):
        return {k: getattr(t, k) for k in CudaTensor.__slots__ if k != "__weakref__"}

    def like_general(r, want, check_init=True):
        """r's slots equal `want` (the general path's result's) but for the block it holds,
        and (check_init) equal what CudaTensor.__init__ sets."""
        got = slots(r)
        want["_block"] = got["_block"]
        assert got == want, (got, want)
        if check_init:
            init = CudaTensor(r.shape, r.dtype, 0, r._ptr, block=r._block, pool=pool)
            assert slots(init) == got
'''


def script(*parts: str) -> str:
    """The parts (STUBS, a script's own lines, BACKEND, its checks) as one script."""
    return "".join(textwrap.dedent(p) for p in parts).replace("ROOT", repr(ROOT))


def run_script(code: str, *args: str) -> None:
    """Run a script in a fresh interpreter (no CUDA_BACKEND_FALLBACK): it must print OK."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_BACKEND_FALLBACK"}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr


SCRIPT = script(STUBS, r'''
    from cuda_backend.errors import (DTypeMismatchError, ShapeMismatchError,
                                     TensorFreedError)
''', BACKEND, r'''
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
        like_general(r2, ref[1])
        return r2

    x32 = m.from_numpy(np.arange(1024, dtype=np.float32))
    y32 = m.from_numpy(np.ones(1024, np.float32))
    odd = m.from_numpy(np.ones(1023, np.float32))
    bp, up, sp = m.ew_binary_plans, m.ew_unary_plans, m.ew_scalar_plans
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

    # broadcasting: one plan per (op, shapes, dtype, device), the general path's one launch
    def bshape(*shape, dt=np.float32):
        return m.from_numpy(np.arange(int(np.prod(shape)), dtype=dt).reshape(shape) % 7 + 1)
    m.add(bshape(2, 8), bshape(8))
    cp = m.ew_bcast_plans
    rows, bias = bshape(32, 1024), bshape(1024)
    same_as_general(lambda: m.add(rows, bias), cp, ("add", (32, 1024), (1024,), "FLOAT32", 0))
    same_as_general(lambda: m.multiply(bias, rows), cp,
                    ("multiply", (1024,), (32, 1024), "FLOAT32", 0))
    col, row3 = bshape(4, 1, 5), bshape(1, 3, 5)
    same_as_general(lambda: m.subtract(col, row3), cp,
                    ("subtract", (4, 1, 5), (1, 3, 5), "FLOAT32", 0))
    h, hb = bshape(3, 7, 9, dt=np.float16), bshape(7, 1, dt=np.float16)
    same_as_general(lambda: m.maximum(h, hb), cp, ("maximum", (3, 7, 9), (7, 1), "FLOAT16", 0))
    # a misaligned operand: the plan launches the element kernel (vectorize 0)
    base = bshape(1025)
    view = CudaTensor((1024,), DT.FLOAT32, 0, base._ptr + 4, owner=base)
    key = ("add", (32, 1024), (1024,), "FLOAT32", 0)
    launches.clear()
    m.add(rows, view)                  # through the plan
    through_plan = launches[-1]
    saved = cp.pop(key)
    launches.clear()
    m.add(rows, view)                  # the general path: the same launch, and no plan made
    assert launches[-1] == through_plan and key not in cp
    cp[key] = saved
    # out= (in place into the broadcast shape): the plan launches into out, as the general path
    from cuda_backend.ops import elementwise as ew
    acc = bshape(32, 1024)
    ew.binary(m, "add", acc, bias, out=acc)
    launches.clear()
    assert ew.binary(m, "add", acc, bias, out=acc) is acc        # through the plan
    through_plan = launches[-1]
    saved = cp.pop(key)
    launches.clear()
    ew.binary(m, "add", acc, bias, out=acc)                       # the general path
    assert launches[-1] == through_plan and key in cp
    cp[key] = saved
    with pytest.raises(ShapeMismatchError):                       # a wrong out: its error
        ew.binary(m, "add", acc, bias, out=bshape(32, 1023))
    # mismatched dtype or a freed operand: the general path and its errors
    with pytest.raises(DTypeMismatchError):
        m.add(rows, m.from_numpy(np.ones(1024)))
    gone = bshape(1024)
    gone.free()
    with pytest.raises(TensorFreedError):
        m.add(rows, gone)
    s2 = b.stream()
    launches.clear()
    with s2:
        m.add(rows, bias)
    assert launches[-1][4] is s2.pycuda_stream

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
''')


def test_plans_match_general_path():
    run_script(SCRIPT)


# -- matmul, fused_linear_gelu, sketched_linear, flash_attention (ops/matmul.py, linear.py,
# attention.py): every launch of the plan's call equals the general path's ---------------------
GEMM_SCRIPT = script(STUBS, r'''
    import math, tempfile
    from cuda_backend.autotune import Autotuner
    from cuda_backend.cuda_ml import CudaML
    from cuda_backend.errors import (DTypeMismatchError, InvalidArgumentError,
                                     ShapeMismatchError, TensorFreedError)
    from cuda_backend.ops import attention as fa, linear as lin, matmul as mm
    from cuda_backend.ops import attention_backward as fab
    from cuda_backend.ops import matmul_launch as mml
''', BACKEND, r'''
    m._autotuner = Autotuner(b, path=os.path.join(tempfile.mkdtemp(), "t.json"))
    ml = CudaML(m)
    rng = np.random.default_rng(0)
    # (the TMA configs read their parameter layout from the driver, which the stubs do not
    # have: tests/test_matmul.py runs them and their plan with its own stubs and on a GPU)
    mml.tma16_usable = lambda *args, **kw: False

    def t(*shape, dt=np.float32):
        return m.from_numpy(rng.standard_normal(shape).astype(dt))

    def freed(x):
        x.free()
        return x

    real_run_config, real_fa_run_config = mml.run_config, fa.run_config
    def general_path_off():
        def off(*a, **k):
            raise AssertionError("general path taken")
        mml.run_config = fa.run_config = off
    def general_path_on():
        mml.run_config, fa.run_config = real_run_config, real_fa_run_config

    def same_as_general(call, key, n=None):
        """Warm call (compiles, autotunes), then a general-path call (key dropped: the plan
        is made again) and a plan call after freeing its result: the same launches (grid,
        block, packed arguments, shared memory, stream), a result like the general one,
        temporaries back in the pool."""
        call().free()
        m.plans.pop(key, None)
        active = pool._total("active_blocks")
        launches.clear()
        r1 = call()
        assert key in m.plans, key
        general = list(launches)
        assert general and (n is None or len(general) == n), (n, general)
        ref = slots(r1)
        for k in ("_block", "_owner", "_pool"):   # (the general result may be a view)
            del ref[k]
        assert pool._total("active_blocks") == active + 1      # temporaries given back
        r1.free()
        launches.clear()
        general_path_off()
        try:
            r2 = call()
        finally:
            general_path_on()
        assert launches == general, (launches, general)
        got = slots(r2)
        assert got.pop("_owner") is None and got.pop("_block") is not None
        assert got.pop("_pool") is pool
        assert got == ref, (got, ref)
        assert pool._total("active_blocks") == active + 1
        return r2

    # -- matmul: each family and launch shape
    f32, f64, f16 = np.float32, np.float64, np.float16
    X, W = t(64, 64), t(96, 64)
    def mk(dt):
        return DT.from_any(dt)
    cases = [
        ((64, 64), (64, 64), f32, None, 1),             # SIMT, small
        ((64, 61), (61, 64), f32, None, 1),             # element loads (vec False)
        ((256, 512), (512, 64), f32, None, 2),          # split-K: gemm + reduce, workspace
        ((4, 64, 64), (64, 64), f32, None, 1),          # batch, B broadcast
        ((3, 33, 17), (3, 17, 40), f32, None, 1),       # full batch
        ((64,), (64, 32), f32, None, 1),                # 1-D
        ((45,), (45,), f64, None, 1),
        ((70, 130), (130, 72), f64, None, None),
        ((64, 64), (64, 64), f16, None, 1),             # mma
        ((67, 45), (45, 29), f16, None, 1),
        ((64, 64), (64, 64), f32, "tf32", 1),           # mma TF32
        ((512, 512), (512, 512), f32, "tf32", 2),       # wgmma: B transposed, then the GEMM
        ((2, 512, 256), (2, 256, 512), f32, "TF32", 2), # wgmma, two B planes
        ((70000, 3, 8), (70000, 8, 6), f32, None, 2),   # batch over grid z: two launches
        ((70000, 3, 8), (8, 6), f32, "tf32", 2),
        ((70000, 16, 16), (70000, 16, 16), f32, "tf32", 4),   # wgmma, 2 transposes, 2 GEMMs
        ((64, 64), (64, 64), f32, "highest", 1),
    ]
    for sa, sb, dt, prec, n in cases:
        a, bb = t(*sa, dt=dt), t(*sb, dt=dt)
        key = ("matmul", a.shape, bb.shape, mk(dt), mk(dt), 0, 0, prec)
        same_as_general(lambda: m.matrix_multiply(a, bb, precision=prec), key, n)
    # the wgmma case took the transpose + wgmma launches
    a, bb = t(512, 512), t(512, 512)
    m.matrix_multiply(a, bb, precision="tf32")
    hit = mm.memo(m)[(mm.plan_shapes(a.shape, bb.shape), DT.FLOAT32, "tf32", 0, True)]
    assert hit[0] == mm.WGMMA_TEMPLATE, hit
    # the @ operator reaches the same plans
    m.matrix_multiply(X, X)
    launches.clear()
    general_path_off()
    try:
        r = X @ X
    finally:
        general_path_on()
    assert len(launches) == 1 and r.shape == (64, 64)

    # a misaligned view: the plan steps aside, the general path adds that alignment class
    base = t(64 * 64 + 1)
    view = CudaTensor((64, 64), DT.FLOAT32, 0, base.ptr + 4, owner=base)
    key = ("matmul", (64, 64), (64, 64), DT.FLOAT32, DT.FLOAT32, 0, 0, None)
    same_as_general(lambda: m.matrix_multiply(view, X), key, 1)
    plan = m.plans[key]
    m.matrix_multiply(X, X)
    assert set(plan.runners) == {False, True}
    launches.clear()
    m.matrix_multiply(view, X)
    unaligned = launches[-1]
    m.matrix_multiply(X, X)
    assert launches[-1] != unaligned       # another kernel (vec) for aligned operands

    # the general path's errors after a plan exists for the shapes
    m.matrix_multiply(X, X)
    dead = t(64, 64)
    dead.free()
    with pytest.raises(TensorFreedError):
        m.matrix_multiply(X, dead)
    with pytest.raises(TensorFreedError):
        m.matrix_multiply(dead, X)
    with pytest.raises(DTypeMismatchError):
        m.matrix_multiply(X, t(64, 64, dt=f64))
    with pytest.raises(InvalidArgumentError):
        m.matrix_multiply(X, X, precision="fp8")
    with pytest.raises(InvalidArgumentError):
        m.matrix_multiply(X, X, precision=True)
    with pytest.raises(InvalidArgumentError):
        m.matrix_multiply(t(64, 64, dt=f64), t(64, 64, dt=f64), precision="tf32")
    with pytest.raises(ShapeMismatchError):
        m.matrix_multiply(X, W)
    # out=: the plan writes into a tensor that fits, with the general path's launches;
    # anything else takes the general path and its typed errors
    out = m.create_tensor((64, 64))
    for o in (out, CudaTensor((64, 64), DT.FLOAT32, 0, base.ptr + 4, owner=base)):
        m.plans.pop(key, None)
        launches.clear()
        assert mm.matmul(m, X, X, out=o) is o            # (general: makes the plan again)
        general = list(launches)
        launches.clear()
        general_path_off()
        try:
            assert mm.matmul(m, X, X, out=o) is o
        finally:
            general_path_on()
        assert launches == general and len(general) == 1, (launches, general)
    active = pool._total("active_blocks")
    mm.matmul(m, X, X, out=out)
    assert pool._total("active_blocks") == active       # nothing allocated
    with pytest.raises(InvalidArgumentError):
        mm.matmul(m, X, X, out=X)                        # overlap
    with pytest.raises(InvalidArgumentError):
        mm.matmul(m, X, X, out=CudaTensor((64, 64), DT.FLOAT32, 0, X.ptr + 256, owner=X))
    with pytest.raises(ShapeMismatchError):
        mm.matmul(m, X, X, out=m.create_tensor((64, 65)))
    with pytest.raises(DTypeMismatchError):
        mm.matmul(m, X, X, out=m.create_tensor((64, 64), DT.FLOAT64))
    dead_out = m.create_tensor((64, 64))
    dead_out.free()
    with pytest.raises(TensorFreedError):
        mm.matmul(m, X, X, out=dead_out)

    # a `with stream:` block and profiling take the general path; an operand last used on
    # another stream too (its use on the default stream is recorded there), then the plan
    s = b.stream()
    launches.clear()
    with s:
        m.matrix_multiply(X, X)
    assert launches[-1][4] is s.pycuda_stream
    assert X.stream is s.pycuda_stream
    r = m.matrix_multiply(X, X)
    assert X.stream is None and launches[-1][4] is None
    b.enable_profiling = True
    m.matrix_multiply(X, X)
    assert "kernel_execution_times" in b.get_performance_stats()
    b.enable_profiling = False

    # -- fused_linear_gelu
    bias = t(96)
    for x, w, bi, prec in ((X, W, bias, None), (X, W, None, None), (t(2, 32, 64), W, bias, None),
                           (t(64), W, bias, None), (t(7, 13), t(5, 13), t(5), "ieee"),
                           (t(33, 40), t(24, 40), t(24), "tf32"),
                           (t(30, 64, dt=f16), t(96, 64, dt=f16), t(96, dt=f16), None),
                           (t(9, 16, dt=f64), t(8, 16, dt=f64), None, None)):
        key = lin._linear_key(x, w, bi, prec)
        r = same_as_general(lambda: ml.fused_linear_gelu(x, w, bi, precision=prec), key, 1)
        assert r.shape == x.shape[:-1] + (w.shape[0],)
        assert key in m.plans
    ml.fused_linear_gelu(X, W, bias)
    with pytest.raises(TensorFreedError):
        ml.fused_linear_gelu(X, W, freed(t(96)))
    with pytest.raises(TensorFreedError):
        ml.fused_linear_gelu(dead, W, bias)
    with pytest.raises(DTypeMismatchError):
        ml.fused_linear_gelu(X, W, t(96, dt=f64))
    with pytest.raises(InvalidArgumentError):
        ml.fused_linear_gelu(X, W, bias, precision="fp16")
    with pytest.raises(InvalidArgumentError):
        ml.fused_linear_gelu(X, W, bias, precision=1)

    # -- sketched_linear: the products through their plans, then the same mean and bias
    # launches
    U, V = ml.sketched_linear_params(64, 48, 3, 8, seed=0)
    bs = t(48)
    for bi in (bs, None):
        key = lin._sketched_key(X, U, V, bi)
        ml.sketched_linear(X, U, V, bi).free()
        m.plans.pop(key)
        launches.clear()
        r1 = ml.sketched_linear(X, U, V, bi)
        assert key in m.plans
        general = list(launches)
        r1.free()
        launches.clear()
        mmul = m.matrix_multiply
        m.matrix_multiply = None             # the plan calls the products' plans directly
        try:
            r2 = ml.sketched_linear(X, U, V, bi)
        finally:
            del m.matrix_multiply
        assert launches == general and len(general) == (4 if bi is not None else 3)
        assert r2.shape == (64, 48)
    with pytest.raises(TensorFreedError):
        ml.sketched_linear(X, U, V, freed(t(48)))

    # -- flash_attention: scale and causal in the key, the scale's value per call
    for shape_q, shape_k, dt, scale, causal in (
            ((1, 2, 64, 64), (1, 2, 64, 64), f32, None, False),
            ((1, 2, 64, 64), (1, 2, 64, 64), f32, 0.2, True),
            ((2, 3, 33, 40), (2, 3, 70, 40), f16, None, True),
            ((1, 2, 17, 100), (1, 2, 9, 100), f16, -0.3, False),
            ((1, 1, 45, 37), (1, 1, 47, 37), f32, 0.0, False),
            ((1, 1, 20, 200), (1, 1, 20, 200), f32, None, False)):
        q = t(*shape_q, dt=dt)
        k, v = t(*shape_k, dt=dt), t(*shape_k, dt=dt)
        key = ("flash_attention", q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
               0, 0, 0, scale is None, causal)
        same_as_general(lambda: ml.flash_attention(q, k, v, scale=scale, causal=causal), key, 1)
        same_as_general(lambda: fa.flash_attention(m, q, k, v, scale, causal), key, 1)
    base = t(2 * 33 * 40 + 1, dt=f16)                    # element loads (vec 0)
    qv = CudaTensor((1, 2, 33, 40), DT.FLOAT16, 0, base.ptr + 2, owner=base)
    key = ("flash_attention", qv.shape, qv.shape, qv.shape) + (DT.FLOAT16,) * 3 + \
        (0, 0, 0, True, False)
    same_as_general(lambda: ml.flash_attention(qv, qv, qv), key, 1)
    q = t(1, 2, 64, 64)
    ml.flash_attention(q, q, q, scale=0.5)
    launches.clear()
    ml.flash_attention(q, q, q, scale=0.25)              # another scale: the plan, its value
    general_path_off()
    try:
        ml.flash_attention(q, q, q, scale=0.25)
        ml.flash_attention(q, q, q, scale=-0.0)
    finally:
        general_path_on()
    assert launches[0] == launches[1] and launches[1] != launches[2]
    ml.flash_attention(q, q, q, scale=-0.0)
    assert launches[-1] == launches[2]
    for bad in (math.inf, math.nan):
        with pytest.raises(InvalidArgumentError, match="finite"):
            ml.flash_attention(q, q, q, scale=bad)
    with pytest.raises(InvalidArgumentError):
        ml.flash_attention(q, q, q, scale=True)
    ml.flash_attention(q, q, q, causal=True)
    with pytest.raises(InvalidArgumentError, match="causal must be a bool"):
        ml.flash_attention(q, q, q, causal=1)
    with pytest.raises(TensorFreedError):
        ml.flash_attention(q, q, freed(t(1, 2, 64, 64)))
    with pytest.raises(DTypeMismatchError):
        ml.flash_attention(q, q, t(1, 2, 64, 64, dt=f16))
    ml.flash_attention(q, q, q, scale=np.float32(0.5))   # NumPy scalars: the general path

    # -- flash_attention_backward and the packed backward: three launches, prepared
    real_bwd_run_config = fab.run_config

    def bwd_off(*a, **k):
        raise AssertionError("general path taken")

    def grads_same_as_general(call, key):
        """same_as_general for results that are tuples of gradients (or one dqkv)."""
        def listed(r):
            return list(r) if isinstance(r, tuple) else [r]
        for r in listed(call()):
            r.free()
        m.plans.pop(key, None)
        active = pool._total("active_blocks")
        launches.clear()
        r1 = listed(call())
        assert key in m.plans, key
        general = list(launches)
        assert len(general) == 3, general
        refs = [slots(r) for r in r1]
        for ref in refs:
            for k in ("_block", "_owner", "_pool"):
                del ref[k]
        assert pool._total("active_blocks") == active + len(r1)   # workspaces given back
        for r in reversed(r1):
            r.free()
        launches.clear()
        fab.run_config = bwd_off
        try:
            r2 = listed(call())
        finally:
            fab.run_config = real_bwd_run_config
        assert launches == general, (launches, general)
        for r, ref in zip(r2, refs):
            got = slots(r)
            assert got.pop("_owner") is None and got.pop("_block") is not None
            assert got.pop("_pool") is pool
            assert got == ref, (got, ref)
        assert pool._total("active_blocks") == active + len(r2)
        for r in r2:
            r.free()

    for shape_q, shape_k, dt, scale, causal in (
            ((1, 2, 64, 64), (1, 2, 64, 64), f32, None, False),
            ((2, 3, 33, 40), (2, 3, 70, 40), f16, 0.3, True),
            ((1, 1, 45, 37), (1, 1, 47, 37), f32, None, True)):
        q, g = t(*shape_q, dt=dt), t(*shape_q, dt=dt)
        k, v = t(*shape_k, dt=dt), t(*shape_k, dt=dt)
        o, lse = ml.flash_attention(q, k, v, scale=scale, causal=causal, return_lse=True)
        key = fab.plan_key(q, k, scale, causal)
        grads_same_as_general(
            lambda: ml.flash_attention_backward(g, q, k, v, o, lse, scale=scale,
                                                causal=causal), key)
    for B, T, heads, D, dt, scale, causal in ((1, 64, 2, 64, f32, None, False),
                                              (2, 33, 3, 40, f16, 0.2, True),
                                              (1, 17, 1, 37, f32, None, True)):
        qkv = t(B, T, 3 * heads * D, dt=dt)
        g = t(B, T, heads * D, dt=dt)
        o, lse = ml.flash_attention_packed(qkv, heads, scale=scale, causal=causal,
                                           return_lse=True)
        key = ("flash_attention_packed_backward", qkv.shape, heads, qkv.dtype, 0,
               scale is None, causal)
        grads_same_as_general(
            lambda: ml.flash_attention_packed_backward(g, qkv, o, lse, heads, scale=scale,
                                                       causal=causal), key)
        with pytest.raises(ShapeMismatchError):            # the plan steps aside: the error
            ml.flash_attention_packed_backward(t(B, T + 1, heads * D, dt=dt), qkv, o, lse,
                                               heads, scale=scale, causal=causal)
        with pytest.raises(TensorFreedError):
            ml.flash_attention_packed_backward(freed(t(B, T, heads * D, dt=dt)), qkv, o, lse,
                                               heads, scale=scale, causal=causal)
        with pytest.raises(InvalidArgumentError, match="finite"):
            ml.flash_attention_packed_backward(g, qkv, o, lse, heads, scale=math.inf,
                                               causal=causal)
    print("OK")
''')


def test_gemm_and_attention_plans_match_general_path():
    """matmul (SIMT, element loads, split-K, batches, 1-D, mma, TF32 mma and wgmma, batches
    over grid z), fused_linear_gelu, sketched_linear and flash_attention: the plan's call
    launches what the general path launches, and bad inputs still get its errors."""
    run_script(GEMM_SCRIPT)


# -- reductions, matrix_transpose and gelu: their plans in m.plans (ops/common.py) -------------
PLANS_SCRIPT = script(STUBS, r'''
    from cuda_backend.cuda_ml import ActivationType, CudaML
    from cuda_backend.errors import (InvalidArgumentError, ShapeMismatchError,
                                     TensorFreedError, DTypeMismatchError)

    def record_kernel(self, grid, block, buf, shared, stream):   # launches name the kernel
        assert min(grid) >= 1 and min(block) >= 1, f"empty launch: grid {grid} block {block}"
        launches.append((id(self), grid, block, bytes(buf), shared, stream))
    Function._launch_kernel = record_kernel
    drv = sys.modules["pycuda.driver"]
    if not hasattr(drv, "memset_d32_async"):      # (the ticket counters' clearing)
        drv.memset_d32_async = lambda *args: None
''', BACKEND, r'''
    ml = CudaML(m)
    rng = np.random.default_rng(0)

    def same_as_general(call, key, nlaunch=None):
        """call() through the general path (which makes the plan m.plans[key]), then through
        the plan: the same launches (grid, block, packed arguments, shared memory, stream),
        the same temporaries (pool counters) and a result like the general path's."""
        m.plans.pop(key, None)
        launches.clear()
        r1 = call()
        plan = m.plans.get(key)
        assert plan is not None, key
        ref = list(launches)
        if nlaunch is not None:
            assert len(ref) == nlaunch, (key, ref)
        ref_slots = slots(r1)
        r1.free()                       # the pool hands the same blocks back
        before = pool.get_stats()
        launches.clear()
        seen = []
        m.plans[key] = lambda *a: seen.append(1) or plan(*a)
        r2 = call()
        m.plans[key] = plan
        after = pool.get_stats()
        assert seen == [1], key                         # the plan ran, and returned
        assert launches == ref, (key, launches, ref)
        like_general(r2, ref_slots)
        assert after["active_blocks"] - before["active_blocks"] == 1   # temporaries freed
        return r2

    def t(shape, dtype=np.float32):
        return m.from_numpy(rng.standard_normal(shape).astype(dtype))

    # reductions: every op, rows and middle-axis passes, several passes, split launches
    # (partials and ticket counters), keepdims, negative and tuple axes, int and half dtypes
    X = t((37, 53))
    X3 = t((5, 7, 9))
    for name, fn in (("reduce_sum", m.reduce_sum), ("reduce_mean", m.reduce_mean),
                     ("reduce_max", m.reduce_max), ("reduce_min", m.reduce_min)):
        for axis, kd in ((None, False), (1, False), (0, False), (-1, True), ((0, 1), False),
                         (None, True)):
            same_as_general(lambda: fn(X, axis=axis, keepdims=kd),
                            (name, X.shape, X.dtype, axis, kd, 0), 1)
        same_as_general(lambda: fn(X3, axis=(0, 2)), (name, X3.shape, X3.dtype, (0, 2), False, 0),
                        2)
        same_as_general(lambda: fn(X3, axis=1), (name, X3.shape, X3.dtype, 1, False, 0), 1)
    for axis, kd in ((None, False), (0, False), (1, True), (-1, False)):
        same_as_general(lambda: m.argmax(X, axis=axis, keepdims=kd),
                        ("argmax", X.shape, X.dtype, axis, kd, 0), 1)
    for dt in (np.int32, np.int64, np.float16, np.float64):
        Y = m.from_numpy((rng.standard_normal((19, 33)) * 10).astype(dt))
        same_as_general(lambda: m.reduce_sum(Y, axis=0), ("reduce_sum", Y.shape, Y.dtype, 0,
                                                          False, 0), 1)
        same_as_general(lambda: m.reduce_mean(Y), ("reduce_mean", Y.shape, Y.dtype, None,
                                                   False, 0), 1)
        same_as_general(lambda: m.argmax(Y, axis=1), ("argmax", Y.shape, Y.dtype, 1, False, 0),
                        1)
    long_rows = t((2, 100003))     # split rows: partials and ticket counters
    same_as_general(lambda: m.reduce_sum(long_rows, axis=1),
                    ("reduce_sum", long_rows.shape, long_rows.dtype, 1, False, 0), 1)
    tall = t((4099, 3))            # split middle axis
    same_as_general(lambda: m.reduce_mean(tall, axis=0),
                    ("reduce_mean", tall.shape, tall.dtype, 0, False, 0), 1)
    # a middle-axis pass sizes by its input's alignment: a plan made on an aligned input
    # launches on an unaligned one as the general path does
    base = t((4 * 64 + 1,))
    for shape, axis in (((4, 64), 0), ((2, 4, 32), 1)):
        aligned = CudaTensor(shape, DT.FLOAT32, 0, base._ptr)
        odd = CudaTensor(shape, DT.FLOAT32, 0, base._ptr + 4)
        key = ("reduce_sum", shape, DT.FLOAT32, axis, False, 0)
        m.plans.pop(key, None)
        m.reduce_sum(aligned, axis=axis).free()
        plan = m.plans.pop(key)
        launches.clear()
        m.reduce_sum(odd, axis=axis).free()           # the general path, on odd
        ref = list(launches)
        m.plans[key] = plan
        launches.clear()
        m.reduce_sum(odd, axis=axis).free()           # the aligned plan, on odd
        assert launches == ref, (launches, ref)
        assert m.plans[key] is plan
        same_as_general(lambda: m.reduce_sum(odd, axis=axis), key, 1)

    # matrix_transpose: odd shapes, 16-byte, 8-byte and element access, batches (over the
    # 65535 planes of a launch too), an autotuned size, unaligned pointers
    for shape, dt in (((37, 53), np.float32), ((64, 64), np.float32), ((3, 40, 24), np.float16),
                      ((33, 17), np.int64), ((2, 16, 6), np.float32), ((65537, 1, 2), np.float32),
                      ((8, 12), np.float64)):
        T = t(shape, dt)
        same_as_general(lambda: m.matrix_transpose(T), ("matrix_transpose", T.shape, T.dtype, 0))
    big = t((1024, 1100))
    m.matrix_transpose(big).free()                     # tunes
    same_as_general(lambda: m.matrix_transpose(big),
                    ("matrix_transpose", big.shape, big.dtype, 0), 1)
    base = t((64 * 64 + 4,))
    key = ("matrix_transpose", (64, 64), DT.FLOAT32, 0)
    aligned = CudaTensor((64, 64), DT.FLOAT32, 0, base._ptr)
    for off in (4, 8):
        odd = CudaTensor((64, 64), DT.FLOAT32, 0, base._ptr + off)
        m.plans.pop(key, None)
        m.matrix_transpose(aligned).free()
        plan = m.plans.pop(key)
        launches.clear()
        m.matrix_transpose(odd).free()
        ref = list(launches)
        m.plans[key] = plan
        launches.clear()
        m.matrix_transpose(odd).free()
        assert launches == ref, (off, launches, ref)
        assert m.plans[key] is plan

    # gelu and activation(): the elementwise unary plan, without the general path's layers
    x = t((1023,))
    up = m.ew_unary_plans
    for call, op in ((lambda: ml.gelu(x), "gelu"), (lambda: ml.gelu(x, "none"), "gelu_exact"),
                     (lambda: ml.activation(x, ActivationType.GELU), "gelu"),
                     (lambda: ml.activation(x, ActivationType.SILU), "silu")):
        up.pop((op, "FLOAT32", 0), None)
        launches.clear()
        r1 = call()
        assert (op, "FLOAT32", 0) in up
        ref = list(launches)
        r1.free()
        launches.clear()
        call().free()
        assert launches == ref
    launches.clear()
    ml.activation(x, ActivationType.LEAKY_RELU, 0.2).free()
    ml.activation(x, ActivationType.ELU).free()
    assert len(launches) == 2

    # bad calls whose key may match a plan: the general path's typed errors
    dead = t((37, 53))
    dead.free()
    for call in (lambda: m.reduce_sum(dead, axis=1), lambda: m.reduce_mean(dead),
                 lambda: m.argmax(dead), lambda: m.argmax(dead, axis=0),
                 lambda: m.matrix_transpose(dead), lambda: ml.gelu(dead),
                 lambda: ml.activation(dead, ActivationType.GELU)):
        with pytest.raises(TensorFreedError):
            call()
    m.reduce_sum(X, axis=1), m.argmax(X, axis=1), m.argmax(X)
    for call in (lambda: m.reduce_sum(X, axis=True), lambda: m.reduce_sum(X, axis=1.0),
                 lambda: m.reduce_sum(X, axis=(1.0,)), lambda: m.reduce_sum(X, axis=(True,)),
                 lambda: m.reduce_sum(X, axis=(1, 1)), lambda: m.reduce_sum(X, axis=2),
                 lambda: m.argmax(X, axis=True), lambda: m.argmax(X, axis=1.0),
                 lambda: m.argmax(X, axis=(1,)), lambda: ml.gelu(x, "tanh "),
                 lambda: m.reduce_sum(X, axis=[1.5])):
        with pytest.raises(InvalidArgumentError):
            call()
    from cuda_backend.ops import reduction, transpose
    with pytest.raises(InvalidArgumentError):
        reduction.reduce(m, "prod", X, axis=1)
    with pytest.raises(ShapeMismatchError):
        reduction.reduce(m, "sum", X, axis=1, out=m.from_numpy(np.zeros(3, np.float32)))
    with pytest.raises(DTypeMismatchError):
        reduction.reduce(m, "sum", X, axis=1, out=m.from_numpy(np.zeros(37, np.float64)))
    with pytest.raises(ShapeMismatchError):
        transpose.transpose(m, X, out=X)
    o = m.from_numpy(np.zeros(37, np.float32))
    assert reduction.reduce(m, "sum", X, axis=1, out=o) is o      # out=: the general path
    o = m.from_numpy(np.zeros((53, 37), np.float32))
    assert transpose.transpose(m, X, out=o) is o

    # `with stream:`, profiling, and an operand last used on a stream: the general path
    s = b.stream()
    launches.clear()
    with s:
        m.reduce_sum(X, axis=1)
        m.matrix_transpose(X)
        ml.gelu(x)
        Z = t((37, 53))
    assert [l[5] for l in launches] == [s.pycuda_stream] * 3
    assert Z.stream is s.pycuda_stream
    m.reduce_sum(Z, axis=1)          # the general path records the legacy stream's use
    assert Z.stream is None
    b.enable_profiling = True
    m.reduce_sum(X, axis=1), m.matrix_transpose(X), m.argmax(X)
    stats = b.get_performance_stats()["kernel_execution_times"]
    assert len(stats) >= 2, stats
    b.enable_profiling = False
    print("OK")
''')


def test_reduce_transpose_gelu_plans_match_general_path():
    run_script(PLANS_SCRIPT)


# -- layer_norm, batch_norm, pooling, conv2d, dropout, sgd/adam: their plans in m.plans -------
NN_SCRIPT = script(STUBS, r'''
    from cuda_backend.cuda_ml import ConvolutionConfig, CudaML, OptimizerState
    from cuda_backend.errors import (DTypeMismatchError, InvalidArgumentError,
                                     ShapeMismatchError, TensorFreedError)
''', BACKEND, r'''
    ml = CudaML(m)
    rng = np.random.default_rng(0)
    WHICH = sys.argv[1]

    def results(r):
        return [] if r is None else list(r) if isinstance(r, tuple) else [r]

    def same_as_general(call, key, nlaunch):
        """call() through the general path (which makes the plan m.plans[key]), then through
        the plan: the same launches (grid, block, packed arguments, shared memory, stream),
        temporaries released (pool counters) and results like the general path's."""
        m.plans.pop(key, None)
        launches.clear()
        counts = lambda: (pool._explicit_frees, pool.get_stats()["allocation_count"],
                          pool.get_stats()["total_allocated"])
        c0 = counts()
        r1 = results(call())
        c1 = counts()
        plan = m.plans.get(key)
        assert plan is not None, (key, list(m.plans))
        ref = list(launches)
        assert len(ref) == nlaunch, (key, ref)
        ref_slots = [slots(r) for r in r1]
        for r in reversed(r1):
            r.free()                     # the pool hands the same blocks back, in order
        before = pool.get_stats()
        c2 = counts()
        launches.clear()
        seen = []
        m.plans[key] = lambda *a: seen.append(plan(*a)) or seen[-1]
        r2 = results(call())
        m.plans[key] = plan
        after = pool.get_stats()
        assert len(seen) == 1 and seen[0] is not None, key   # the plan ran and returned...
        assert launches == ref, (key, launches, ref)     # ...and launched what the general did
        # the same allocations (count, bytes) and temporaries released as the general path
        assert [b - a for a, b in zip(c2, counts())] == [b - a for a, b in zip(c0, c1)], key
        for r, want in zip(r2, ref_slots):
            like_general(r, want)
        assert after["active_blocks"] - before["active_blocks"] == len(r2), key  # temporaries
        for r in r2:
            r.free()

    def t(shape, dtype=np.float32):
        return m.from_numpy(rng.standard_normal(shape).astype(dtype))

    def odd_view(shape, dtype=np.float32):
        """A tensor one element past a 16-byte boundary (the unvectorized variants)."""
        base = t((int(np.prod(shape)) + 1,), dtype)
        return CudaTensor(shape, DT.from_any(dtype), 0, base._ptr + np.dtype(dtype).itemsize,
                          owner=base)

    def variant_then_plan(call_odd, call_aligned, key, nlaunch):
        """A plan made on an unaligned input steps aside for an aligned one (the general
        path launches it and adds that variant to the same plan), then takes both, each
        launching what the general path launched for it."""
        m.plans.pop(key, None)
        launches.clear()
        call_odd()
        odd_ref = list(launches)
        assert len(odd_ref) == nlaunch
        plan = m.plans[key]
        launches.clear()
        call_aligned()
        ref = list(launches)
        assert m.plans[key] is plan
        assert len(plan.variants) == 2
        launches.clear()
        call_aligned()
        assert launches == ref
        launches.clear()
        call_odd()
        assert launches == odd_ref

    if WHICH == "layer_norm":
        for shape, dt, wb in (((64, 64), np.float32, (True, True)), ((5, 33), np.float32,
                              (False, False)), ((3, 7, 1000), np.float32, (True, False)),
                              ((4, 4096), np.float16, (False, True)),
                              ((2, 70001), np.float32, (True, True)),
                              ((3, 129), np.float64, (True, True)),
                              ((6, 256), DT.BFLOAT16, (True, True))):
            npdt = np.float32 if dt is DT.BFLOAT16 else dt
            X = m.from_numpy(rng.standard_normal(shape).astype(npdt), dtype=dt)
            D = shape[-1]
            w = m.from_numpy(np.ones(D, npdt), dtype=dt) if wb[0] else None
            bb = m.from_numpy(np.zeros(D, npdt), dtype=dt) if wb[1] else None
            key = ("layer_norm", X.shape, X.dtype, 0, 1e-5, w is None, bb is None)
            same_as_general(lambda: ml.layer_norm(X, w, bb), key, 1)
            same_as_general(lambda: ml.layer_norm(X, w, bb, eps=0.1),
                            key[:4] + (0.1,) + key[5:], 1)
        big = t((1024, 4096))            # large: the autotuner picks, then the plan
        w = t((4096,))
        ml.layer_norm(big, w, None).free()
        same_as_general(lambda: ml.layer_norm(big, w, None),
                        ("layer_norm", big.shape, big.dtype, 0, 1e-5, False, True), 1)
        X, w, Xo = t((8, 64)), t((64,)), odd_view((8, 64))
        key = ("layer_norm", (8, 64), X.dtype, 0, 1e-5, False, True)
        variant_then_plan(lambda: ml.layer_norm(Xo, w, None).free(),
                          lambda: ml.layer_norm(X, w, None).free(), key, 1)
        wo, bo = odd_view((64,)), odd_view((64,))       # an unaligned weight or bias
        same_as_general(lambda: ml.layer_norm(X, wo, None), key, 1)
        same_as_general(lambda: ml.layer_norm(X, None, bo),
                        ("layer_norm", (8, 64), X.dtype, 0, 1e-5, True, False), 1)
        ml.layer_norm(X, w, None)
        dead = t((8, 64))
        dead.free()
        with pytest.raises(TensorFreedError):
            ml.layer_norm(dead, w, None)
        wdead = t((64,))
        wdead.free()
        with pytest.raises(TensorFreedError):
            ml.layer_norm(X, wdead, None)
        with pytest.raises(ShapeMismatchError):
            ml.layer_norm(X, t((63,)), None)
        with pytest.raises(DTypeMismatchError):
            ml.layer_norm(X, t((64,), np.float64), None)
        with pytest.raises(InvalidArgumentError):
            ml.layer_norm(X, np.ones(64, np.float32), None)
        with pytest.raises(InvalidArgumentError):
            ml.layer_norm(X, w, None, eps=True)
        ml.layer_norm(X, w, None, eps=1.0)
        with pytest.raises(InvalidArgumentError):
            ml.layer_norm(X, w, None, eps=True)

    if WHICH == "batch_norm":
        # training: stats, finalize, normalize; small NCHW / NCL channels the one fused kernel
        for shape, dt, train_launches in (
                ((4, 8, 5, 5), np.float32, 1), ((16, 12), np.float32, 3),
                ((3, 6, 7), np.float64, 1), ((2, 16, 8, 8), np.float16, 1),
                ((4096, 16), np.float64, 3), ((2, 3, 80, 80), np.float32, 3)):
            X = t(shape, dt)
            C = shape[1]
            ps = [t((C,), dt) for _ in range(3)] + [m.from_numpy(np.ones(C, dt))]
            key = ("batch_norm", X.shape, X.dtype, 0, 1e-5, 0.1, False)
            same_as_general(lambda: ml.batch_norm(X, *ps), key, 1)
            key = ("batch_norm", X.shape, X.dtype, 0, 1e-3, 0.25, True)
            same_as_general(lambda: ml.batch_norm(X, *ps, eps=1e-3, training=True,
                                                  momentum=0.25), key, train_launches)
        X = t((4, 8, 4, 4))
        ps = [t((8,)) for _ in range(3)] + [m.from_numpy(np.ones(8, np.float32))]
        for training in (False, True):
            key = ("batch_norm", X.shape, X.dtype, 0, 1e-5, 0.1, training)
            odd = odd_view((4, 8, 4, 4))
            same_as_general(lambda: ml.batch_norm(odd, *ps, training=training), key,
                            1)                  # the plan from an odd input (fused: training)
            launches.clear()
            m.plans[key], plan = None, m.plans[key]
            ml.batch_norm(X, *ps, training=training).free()     # the general path, aligned
            ref = list(launches)
            m.plans[key] = plan
            launches.clear()
            ml.batch_norm(X, *ps, training=training).free()     # the odd input's plan
            assert launches == ref
        dead = t((4, 8, 4, 4))
        dead.free()
        with pytest.raises(TensorFreedError):
            ml.batch_norm(dead, *ps)
        gdead = t((8,))
        gdead.free()
        with pytest.raises(TensorFreedError):
            ml.batch_norm(X, gdead, *ps[1:], training=True)
        with pytest.raises(ShapeMismatchError):
            ml.batch_norm(X, t((7,)), *ps[1:])
        with pytest.raises(DTypeMismatchError):
            ml.batch_norm(X, *ps[:3], t((8,), np.float64), training=True)
        with pytest.raises(InvalidArgumentError):
            ml.batch_norm(X, *ps, eps=-1.0)
        ml.batch_norm(X, *ps, momentum=1.0, training=True)
        with pytest.raises(InvalidArgumentError):
            ml.batch_norm(X, *ps, momentum=True, training=True)
        with pytest.raises(InvalidArgumentError):
            ml.batch_norm(t((1, 8)), *ps, training=True)
        ml.batch_norm(X, *ps, training=1)             # truthy non-bool: the general path

    if WHICH == "pooling":
        for shape, dt in (((1, 8, 16, 16), np.float32), ((2, 3, 17, 19), np.float32),
                          ((2, 4, 8, 24), np.float16), ((1, 2, 6, 8), np.float64)):
            X = t(shape, dt)
            for kind, call in (("max_pool2d", ml.max_pool2d), ("avg_pool2d", ml.avg_pool2d)):
                for args in ((2, None, (0, 0)), (3, 2, 1), ((2, 3), (1, 2), (1, 0)),
                             ((2, 2), 2, 0)):
                    key = (kind, X.shape, X.dtype, 0) + args
                    same_as_general(lambda: call(X, *args), key, 1)
        X, Xo = t((1, 8, 16, 16)), odd_view((1, 8, 16, 16))
        variant_then_plan(lambda: ml.max_pool2d(Xo, 2).free(),
                          lambda: ml.max_pool2d(X, 2).free(),
                          ("max_pool2d", X.shape, X.dtype, 0, 2, None, (0, 0)), 1)
        dead = t((1, 8, 16, 16))
        dead.free()
        with pytest.raises(TensorFreedError):
            ml.max_pool2d(dead, 2)
        ml.max_pool2d(X, 1), ml.avg_pool2d(X, (2, 2), (1, 1))
        for call in (lambda: ml.max_pool2d(X, True), lambda: ml.max_pool2d(X, 2.0),
                     lambda: ml.avg_pool2d(X, (2.0, 2)), lambda: ml.avg_pool2d(X, (2, 2), 1.0),
                     lambda: ml.max_pool2d(X, 2, padding=(0.0, 0)),
                     lambda: ml.max_pool2d(X, 2, padding=2)):
            with pytest.raises(InvalidArgumentError):
                call()

    if WHICH == "conv2d":
        # (the TMA configs read their parameter layout from the driver, which the stubs do
        # not have: tests/test_conv2d.py runs them and their plan on a GPU)
        import cuda_backend.ops.conv2d_configs as conv_configs
        conv_configs.tma_candidates = lambda *args: []
        cases = (((1, 8, 16, 16), (8, 8, 3, 3), ConvolutionConfig(3, padding=1), None, False),
                 ((2, 16, 9, 11), (32, 16, 3, 3), ConvolutionConfig(3, stride=2), None, True),
                 ((1, 8, 16, 16), (8, 8, 3, 3), ConvolutionConfig(3, padding=1), "tf32", True),
                 ((2, 8, 7, 9), (16, 4, 1, 3), ConvolutionConfig((1, 3), groups=2), None, False),
                 ((1, 8, 16, 16), (8, 1, 3, 3), ConvolutionConfig(3, padding=1, groups=8),
                  None, True),
                 ((2, 24, 10, 10), (64, 24, 3, 3), ConvolutionConfig(3, dilation=2), None,
                  True))
        for xs, ws, cfg, prec, has_bias in cases:
            for dt in ((np.float32,) if prec else (np.float32, np.float16)):
                X, W = t(xs, dt), t(ws, dt)
                bias = t((ws[0],), dt) if has_bias else None
                key = ("conv2d", X.shape, X.dtype, 0, W.shape, W.dtype, 0, ConvolutionConfig,
                       cfg.kernel_size, cfg.stride, cfg.padding, cfg.dilation, cfg.groups,
                       bias is None, prec)
                ml.conv2d(X, W, cfg, bias, prec).free()      # tunes
                from cuda_backend.ops.conv2d_configs import family
                from cuda_backend.ops.conv2d_geometry import plan as geometry
                fam = family(geometry(xs, ws, cfg), DT.from_any(dt),
                             "tf32" if prec else None)
                same_as_general(lambda: ml.conv2d(X, W, cfg, bias, prec), key,
                                {"direct": 1, "simt": 2, "mma": 3}[fam])
        X, W = t((1, 8, 16, 16)), t((8, 8, 3, 3))
        cfg = ConvolutionConfig(3, padding=1)
        ml.conv2d(X, W, cfg)
        ml.conv2d(X, W, ConvolutionConfig(3, padding=1))       # an equal config: the plan
        dead = t((8, 8, 3, 3))
        dead.free()
        with pytest.raises(TensorFreedError):
            ml.conv2d(X, dead, cfg)
        with pytest.raises(InvalidArgumentError):
            ml.conv2d(X, W, {"kernel_size": 3})
        with pytest.raises(InvalidArgumentError):
            ml.conv2d(X, W, cfg, precision="fp8")
        with pytest.raises(ShapeMismatchError):
            ml.conv2d(X, t((8, 8, 2, 2)), cfg)
        with pytest.raises(DTypeMismatchError):
            ml.conv2d(X, t((8, 8, 3, 3), np.float16), cfg)
        ml.conv2d(X, W, cfg, bias=t((8,)))
        with pytest.raises(ShapeMismatchError):
            ml.conv2d(X, W, cfg, bias=t((9,)))
        with pytest.raises(DTypeMismatchError):
            ml.conv2d(X, W, cfg, bias=t((8,), np.float64))
        with pytest.raises(InvalidArgumentError):
            ml.conv2d(X, W, cfg, bias=np.ones(8, np.float32))

    if WHICH == "dropout":
        for shape, dt in (((1024,), np.float32), ((3, 333), np.float16), ((7,), np.float64)):
            X = t(shape, dt)
            for keep in (0.5, 0.9):
                for mask in (False, True):
                    key = ("dropout", X.shape, X.dtype, 0, keep, mask)
                    same_as_general(lambda: ml.dropout(X, keep, 12345, mask), key, 1)
                    same_as_general(lambda: ml.dropout(X, keep, -3, mask), key, 1)
        X = t((1024,))
        key = ("dropout", X.shape, X.dtype, 0, 0.5, False)
        ml.dropout(X, 0.5)
        launches.clear()
        seen = []
        plan = m.plans[key]
        m.plans[key] = lambda *a: seen.append(plan(*a)) or seen[-1]
        ml.dropout(X, 0.5), ml.dropout(X, 0.5)            # seed None: fresh seeds, the plan
        m.plans[key] = plan
        assert len(seen) == 2 and None not in seen and launches[0][2] != launches[1][2]
        assert ml.dropout(X, 1.0).shape == X.shape          # keep_prob 1: a copy, no plan
        dead = t((1024,))
        dead.free()
        with pytest.raises(TensorFreedError):
            ml.dropout(dead, 0.5, 1)
        for call in (lambda: ml.dropout(X, 0.5, seed="abc"), lambda: ml.dropout(X, 0.5, 1.0),
                     lambda: ml.dropout(X, 0.5, True), lambda: ml.dropout(X, 0.0),
                     lambda: ml.dropout(X, 1.5), lambda: ml.dropout(X, float("nan"))):
            with pytest.raises(InvalidArgumentError):
                call()
        ml.dropout(X, 0.5, np.int64(3))                     # NumPy seed: the general path

    if WHICH == "optimizers":
        def same_in_place(call, key, make_state):
            """Two runs on fresh states with equal fields: the general path's launch, then
            the plan's, and state.step advanced by both."""
            m.plans.pop(key, None)
            launches.clear()
            s1 = make_state()
            call(s1)
            assert key in m.plans and len(launches) == 1
            ref = list(launches)
            launches.clear()
            s2 = make_state()
            plan, seen = m.plans[key], []
            m.plans[key] = lambda *a: seen.append(plan(*a)) or seen[-1]
            call(s2)
            m.plans[key] = plan
            assert seen == [True] and launches == ref and s1.step == s2.step
            before = pool.get_stats()["active_blocks"]
            call(s2)                                            # a later step: the plan
            assert pool.get_stats()["active_blocks"] == before

        for n, dt in ((1024, np.float32), (1001, np.float16), (17, np.float64)):
            sdt = np.float64 if dt is np.float64 else np.float32
            P, G, M1, V1 = t((n,), dt), t((n,), dt), t((n,), sdt), t((n,), sdt)
            for step in (0, 3):
                for kw in ({}, {"nesterov": True, "weight_decay": 0.01}):
                    same_in_place(lambda s: ml.sgd_update(P, G, M1, s),
                                  ("sgd_update", P.shape, P.dtype, 0, False),
                                  lambda: OptimizerState(0.01, step=step, **kw))
                same_in_place(lambda s: ml.sgd_update(P, G, None, s),
                              ("sgd_update", P.shape, P.dtype, 0, True),
                              lambda: OptimizerState(0.01, step=step))
                for kw in ({}, {"decoupled": True, "weight_decay": 0.1}):
                    same_in_place(lambda s: ml.adam_update(P, G, M1, V1, s),
                                  ("adam_update", P.shape, P.dtype, 0),
                                  lambda: OptimizerState(1e-3, step=step, **kw))
        P, G, M1, V1 = t((64,)), t((64,)), t((64,)), t((64,))
        for i, o in enumerate((P, G, M1, V1)):     # one unaligned operand: aligned=0
            ops = [P, G, M1, V1]
            ops[i] = odd_view((64,))
            same_in_place(lambda s: ml.adam_update(*ops, s), ("adam_update", (64,), P.dtype, 0),
                          lambda: OptimizerState(1e-3))
            if i < 3:
                same_in_place(lambda s: ml.sgd_update(*ops[:3], s),
                              ("sgd_update", (64,), P.dtype, 0, False),
                              lambda: OptimizerState(1e-3))
        for i in range(2):
            ops = [P, G, M1, V1]
            ops[i] = odd_view((64,))
            same_in_place(lambda s: ml.sgd_update(ops[0], ops[1], None, s),
                          ("sgd_update", (64,), P.dtype, 0, True), lambda: OptimizerState(1e-3))
        ml.sgd_update(P, G, M1, OptimizerState(0.1)), ml.adam_update(P, G, M1, V1,
                                                                     OptimizerState(0.1))
        dead = t((64,))
        dead.free()
        bad = [lambda: ml.sgd_update(P, dead, M1, OptimizerState(0.1)),
               lambda: ml.adam_update(P, G, M1, dead, OptimizerState(0.1))]
        for call in bad:
            with pytest.raises(TensorFreedError):
                call()
        with pytest.raises(ShapeMismatchError):
            ml.sgd_update(P, t((63,)), M1, OptimizerState(0.1))
        with pytest.raises(DTypeMismatchError):
            ml.adam_update(P, G, t((64,), np.float64), V1, OptimizerState(0.1))
        with pytest.raises(InvalidArgumentError):
            ml.adam_update(P, G, None, V1, OptimizerState(0.1))
        for state in (OptimizerState(-1.0), OptimizerState(float("nan")),
                      OptimizerState(0.1, momentum=True), OptimizerState(0.1, step=-1),
                      OptimizerState(0.1, step=1.0), OptimizerState(0.1, weight_decay=-1.0)):
            with pytest.raises(InvalidArgumentError):
                ml.sgd_update(P, G, M1, state)
        with pytest.raises(InvalidArgumentError):
            ml.sgd_update(P, G, None, OptimizerState(0.1, nesterov=True))
        with pytest.raises(InvalidArgumentError):
            ml.sgd_update(P, G, M1, OptimizerState(0.1, momentum=0.0, nesterov=True))
        for state in (OptimizerState(0.1, beta1=1.0), OptimizerState(0.1, beta2=-0.5),
                      OptimizerState(0.1, epsilon=float("inf")), OptimizerState(0.1, step=-2)):
            with pytest.raises(InvalidArgumentError):
                ml.adam_update(P, G, M1, V1, state)
        with pytest.raises(InvalidArgumentError):
            ml.sgd_update(P, G, M1, object())
        s = OptimizerState(1, momentum=0, weight_decay=0)     # ints: the general path
        ml.sgd_update(P, G, M1, s)
        assert s.step == 1

    # `with stream:`, profiling and an operand last used on a stream: the general path
    X = t((4, 8, 16, 16))
    ml.max_pool2d(X, 2)
    st = b.stream()
    launches.clear()
    with st:
        ml.max_pool2d(X, 2)
        Z = t((4, 8, 16, 16))
    assert [l[4] for l in launches] == [st.pycuda_stream]
    assert Z.stream is st.pycuda_stream
    ml.max_pool2d(Z, 2)              # the general path records the legacy stream's use
    assert Z.stream is None
    b.enable_profiling = True
    ml.max_pool2d(X, 2)
    assert b.get_performance_stats()["kernel_execution_times"]
    b.enable_profiling = False
    print("OK")
''')


import pytest  # noqa: E402  (this section's parametrization)


@pytest.mark.parametrize("which", ["layer_norm", "batch_norm", "pooling", "conv2d", "dropout",
                                   "optimizers"])
def test_nn_plans_match_general_path(which):
    """layer_norm, batch_norm (inference and training: statistics, finalize with the
    running-statistics update, normalize), max/avg_pool2d, conv2d (direct, SIMT, TF32 and
    float16 mma, autotuned), dropout (with and without mask; the seed an argument) and
    sgd/adam (in place): the plan's call launches what the general path launches, with its
    temporaries released, unaligned inputs take their own variant, and bad inputs still get
    the general path's typed errors."""
    run_script(NN_SCRIPT, which)


# -- leaky_relu/elu (alpha per call), fill, zeros/ones, copy, and the host<->device copies ------
COPY_FILL_SCRIPT = script(STUBS, r'''
    from cuda_backend.cuda_ml import ActivationType as AT, CudaML
    from cuda_backend.errors import (CudaOutOfMemoryError, DTypeMismatchError,
                                     InvalidArgumentError, InvalidDeviceError,
                                     TensorFreedError, TransferError)
    from cuda_backend.ops import elementwise as ew

    drv = sys.modules["pycuda.driver"]
    copies, events = [], [0]
    def dtod(dst, src, n, stream=None):
        copies.append(("dtod", int(dst), int(src), n, stream))
    drv.memcpy_dtod_async = dtod
    drv.memcpy_htod = lambda dst, src: copies.append(("htod", int(dst), src))
    drv.memcpy_dtoh = lambda dst, src: copies.append(("dtoh", dst, int(src)))
    drv.memcpy_htod_async = lambda dst, src, stream=None: copies.append(
        ("htod_async", int(dst), src, stream))
    drv.memcpy_dtoh_async = lambda dst, src, stream=None: copies.append(
        ("dtoh_async", dst, int(src), stream))
    class CountingEvent(drv.Event):
        def __init__(self, *a):
            events[0] += 1

        def query(self):                 # (stream-ordered frees of the pool ask)
            return True
    drv.Event = CountingEvent
''', BACKEND, r'''
    ml = CudaML(m)

    def spied(plans, key, call):
        """call() with plans[key] wrapped: (result, whether the plan took the call)."""
        plan, seen = plans[key], []
        plans[key] = lambda *a: seen.append(plan(*a)) or seen[-1]
        try:
            r = call()
        finally:
            plans[key] = plan
        took = [x for x in seen if x is not None]   # (a declined call may be retried once
        assert len(took) <= 1 and len(seen) <= 2    # by the entry below: activation, unary)
        return r, bool(took)

    def same_result(r1_slots, r2):
        like_general(r2, r1_slots, check_init=r2.nbytes > 0)

    # -- leaky_relu / elu: the general path (alpha a NumPy float: no plan) against the plan
    up = m.ew_unary_plans
    ties = (1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8))      # bfloat16 rounding ties
    safe = (None, 0.2, -0.0, 0.0, 0.1, 1e-40, 1e-8, 65519.0, 3.0, -1.5) + ties
    edge = (3.0e38, 1e39, float("inf"), float("nan"))
    for dt in (DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16):
        for n in (1023, 3):
            x = m.from_numpy(np.linspace(-2, 2, n).astype(np.float32), dtype=dt)
            for op, kind in (("leaky_relu", AT.LEAKY_RELU), ("elu", AT.ELU)):
                key = (op, dt._name_, 0)
                up.pop(key, None)
                for alpha in safe + edge:
                    launches.clear()
                    if alpha is None and key not in up:
                        r1 = ew.unary(m, op, x)          # (makes the plan)
                    else:                                # a NumPy float: the general path
                        r1 = ew.unary(m, op, x, alpha=np.float64(
                            ew.UNARY_OPS[op][1]["alpha"] if alpha is None else alpha))
                    assert key in up and len(launches) == 1
                    ref, ref_slots = launches[-1], slots(r1)
                    r1.free()
                    for call in (lambda: ml.activation(x, kind, alpha),
                                 lambda: ew.unary(m, op, x, **({} if alpha is None else
                                                               {"alpha": alpha}))):
                        launches.clear()
                        r2, took = spied(up, key, call)
                        assert launches == [ref], (dt, op, alpha, launches, ref)
                        same_result(dict(ref_slots), r2)
                        if alpha in safe or dt is DT.FLOAT64:
                            assert took, (dt, op, alpha)
                        r2.free()
            # int / NumPy alphas: activation() makes them floats for unary()'s plan
            for alpha in (2, np.float32(0.3)):
                launches.clear()
                ew.unary(m, "leaky_relu", x, alpha=np.float64(float(alpha)))   # general
                ref = list(launches)
                launches.clear()
                r, took = spied(up, ("leaky_relu", dt._name_, 0),
                                lambda: ml.activation(x, AT.LEAKY_RELU, alpha))
                assert took and launches == ref
            # out=, a freed operand, bad parameters: the general path and its errors
            o = m.from_numpy(np.ones(x.shape, np.float32), dtype=dt)
            r, took = spied(up, ("elu", dt._name_, 0), lambda: ew.unary(m, "elu", x, out=o))
            assert r is o and not took
            dead = m.from_numpy(np.ones(4, np.float32), dtype=dt)
            dead.free()
            with pytest.raises(TensorFreedError):
                ml.activation(dead, AT.ELU, 0.5)
            with pytest.raises(InvalidArgumentError):
                ew.unary(m, "elu", x, alpha=0.5, beta=1.0)
            with pytest.raises(InvalidArgumentError):
                ew.unary(m, "relu", x, alpha=0.5)
            with pytest.raises(InvalidArgumentError):
                ml.activation(x, AT.ELU, "0.5")
            with pytest.raises(InvalidArgumentError):
                ml.activation(x, "elu", 0.5)

    # -- fill: ew.fill (always the general path) against CudaMath.fill through the plan
    fill_values = {
        DT.FLOAT32: (0, 1, 1.5, -0.0, 0.1, 1e-40, 3.0e38, 1e39, float("nan"), 2**70, True,
                     np.float32(2)),
        DT.FLOAT64: (0, 1.5, -0.0, 1e300, 2**70),
        DT.FLOAT16: (1, 0.1, 65519.0, 65520.0, 1e-8, 1e39),
        DT.BFLOAT16: ((0, 0.1, 1e39, float("nan"), float("inf")) + ties),
        DT.INT32: (0, 7, -2**31, 2**31 - 1, 2.0, True),
        DT.INT64: (0, -2**63, 2**63 - 1, 5.0),
        DT.UINT8: (0, 200, 255, 3.0),
        DT.BOOL: (0, 1, 5, -3, True, 2.0),
    }
    for dt, values in fill_values.items():
        npdt = np.float32 if dt is DT.BFLOAT16 else dt.numpy_dtype
        t = m.from_numpy(np.zeros(1025, npdt), dtype=dt)
        key = ("fill", dt, 0)
        m.plans.pop(key, None)
        ew.fill(m, t, 0)
        assert key in m.plans
        for v in values:
            launches.clear()
            assert ew.fill(m, t, v) is t
            ref = list(launches)
            launches.clear()
            r, took = spied(m.plans, key, lambda: m.fill(t, v))
            assert r is t and launches == ref, (dt, v, launches, ref)
            if type(v) is int and not dt.is_floating or \
                    type(v) in (int, float) and dt.is_floating and abs(v) < 6e4:
                assert took, (dt, v)          # (overflowing values: either way, same launch)
            elif type(v) is not int and type(v) is not float or not dt.is_floating:
                assert not took, (dt, v)      # bools, NumPy scalars, floats for int dtypes
        if not dt.is_floating:
            with pytest.raises(DTypeMismatchError):
                m.fill(t, 0.5)
        if dt is DT.INT32:
            with pytest.raises(InvalidArgumentError):
                m.fill(t, 2**31)
        with pytest.raises(InvalidArgumentError):
            m.fill(t, "1")
    dead = m.from_numpy(np.ones(4, np.float32))
    dead.free()
    with pytest.raises(TensorFreedError):
        m.fill(dead, 1.0)
    with pytest.raises(InvalidArgumentError):
        m.fill(np.ones(3), 1.0)

    # -- zeros / ones: the general path (create_tensor + fill) against the plan
    for dt in fill_values:
        for name, fn in (("zeros", m.zeros), ("ones", m.ones)):
            for shape in ((1024,), (3, 5), 7, [2, 3], (1, 1, 4097)):
                for dev in (None, 0):
                    key = (name, dt, dev)
                    m.plans.pop(key, None)
                    launches.clear()
                    r1 = fn(shape, dt, dev)
                    assert key in m.plans and len(launches) == 1
                    ref, ref_slots = list(launches), slots(r1)
                    r1.free()
                    launches.clear()
                    r2, took = spied(m.plans, key, lambda: fn(shape, dt, dev))
                    assert took and launches == ref, (name, dt, shape, launches, ref)
                    same_result(ref_slots, r2)
                    r2.free()
    m.zeros((1, 3)), m.zeros((1, 3), DT.FLOAT32, 0)
    for bad, err in ((((True, 3),), InvalidArgumentError), (((2.0, 3),), InvalidArgumentError),
                     (((-1,),), InvalidArgumentError), ((("abc"),), InvalidArgumentError),
                     (((2 ** 40, 2 ** 20),), CudaOutOfMemoryError),
                     (((3,), DT.FLOAT32, True), InvalidDeviceError),
                     (((3,), DT.FLOAT32, 1), InvalidDeviceError),
                     (((3,), "complex64"), DTypeMismatchError)):
        with pytest.raises(err):
            m.zeros(*bad)
    launches.clear()
    z = m.zeros((0, 4))                  # empty: the general path, no launch
    assert z.shape == (0, 4) and launches == []
    assert m.ones(3, "float32").shape == (3,) and m.zeros(3, np.float64).dtype is DT.FLOAT64

    # -- copy: an async device-to-device copy, no events; the plan copies what the general did
    for dt in fill_values:
        npdt = np.float32 if dt is DT.BFLOAT16 else dt.numpy_dtype
        for n in (1, 1023, 4096):
            x = m.from_numpy(np.ones(n, npdt), dtype=dt)
            key = ("copy", dt, 0)
            m.plans.pop(key, None)
            copies.clear()
            e0 = events[0]
            r1 = m.copy(x)
            assert key in m.plans and events[0] == e0
            assert copies == [("dtod", r1._ptr, x._ptr, x.nbytes, None)], copies
            ref_slots = slots(r1)
            r1.free()
            copies.clear()
            r2, took = spied(m.plans, key, lambda: m.copy(x))
            assert took and events[0] == e0
            assert copies == [("dtod", r2._ptr, x._ptr, x.nbytes, None)], copies
            same_result(ref_slots, r2)
    x = m.from_numpy(np.ones(1000, np.float32))
    m.copy(x)
    s = b.stream()
    copies.clear()
    with s:
        r = m.copy(x)
    assert copies == [("dtod", r._ptr, x._ptr, 4000, s.pycuda_stream)]
    assert r.stream is s.pycuda_stream and x.stream is s.pycuda_stream
    r2, took = spied(m.plans, ("copy", DT.FLOAT32, 0), lambda: m.copy(x))
    assert not took and x.stream is None        # the general path records the legacy stream
    r.free(), r2.free()
    b.enable_profiling = True                  # the backend's timed copy (events, recorded)
    e0 = events[0]
    r = m.copy(x)
    assert events[0] == e0 + 2 and "dtod" in b.get_performance_stats()["memory_transfer_times"]
    b.enable_profiling = False
    assert m.copy(m.zeros((0, 3))).shape == (0, 3)
    dead = m.from_numpy(np.ones(4, np.float32))
    dead.free()
    with pytest.raises(TensorFreedError):
        m.copy(dead)
    with pytest.raises(InvalidArgumentError):
        m.copy(np.ones(3))

    # -- host <-> device: on the legacy stream one synchronous driver copy, no events
    h = np.arange(1024, dtype=np.float32)
    copies.clear()
    e0 = events[0]
    t = m.from_numpy(h)
    assert copies == [("htod", t._ptr, h)] and copies[0][2] is h
    out = m.to_numpy(t)
    assert copies[-1][0] == "dtoh" and copies[-1][1] is out and copies[-1][2] == t._ptr
    assert out.dtype == np.float32 and out.shape == (1024,)
    o = np.empty(1024, np.float32)
    for ms in (b.copy_to_device(h, t), b.copy_from_device(t, o), b.copy_to_device(h, t.ptr),
               b.copy_from_device(t.ptr, o)):
        assert type(ms) is float and ms >= 0
    assert copies[-4:] == [("htod", t._ptr, h), ("dtoh", o, t._ptr), ("htod", t._ptr, h),
                           ("dtoh", o, t._ptr)]
    t2 = b.to_device(h.reshape(32, 32))
    assert t2.shape == (32, 32) and copies[-1][:2] == ("htod", t2._ptr)
    assert b.to_host(t2).shape == (32, 32) and copies[-1][0] == "dtoh"
    wide = np.arange(2048, dtype=np.float32)
    b.copy_to_device(wide[::2], t)             # not contiguous: the general path's copy
    assert copies[-1][:2] == ("htod", t._ptr) and copies[-1][2].flags.c_contiguous
    assert np.array_equal(copies[-1][2], wide[::2])
    swapped = h.astype(">f4")
    b.copy_to_device(swapped, t)               # byte-swapped: converted first
    assert copies[-1][2].dtype == np.float32 and np.array_equal(copies[-1][2], h)
    bf = m.from_numpy(np.ones(4, np.float32), dtype=DT.BFLOAT16)
    assert copies[-1][2].dtype == np.uint16 and m.to_numpy(bf).dtype == DT.BFLOAT16.array_dtype
    assert events[0] == e0, "a copy on the legacy stream created events"

    # a stream (given, or a `with stream:` block's): the async copy, timed with events
    s = b.stream()
    e0 = events[0]
    b.copy_to_device(h, t, stream=s)
    assert copies[-1] == ("htod_async", t._ptr, h, s.pycuda_stream)
    with s:
        b.copy_to_device(h, t)
        assert copies[-1] == ("htod_async", t._ptr, h, s.pycuda_stream)
        b.copy_from_device(t, o)
        assert copies[-1] == ("dtoh_async", o, t._ptr, s.pycuda_stream)
        u = m.from_numpy(h)
        assert copies[-1] == ("htod_async", u._ptr, h, s.pycuda_stream)
        m.to_numpy(u)
        assert copies[-1][0] == "dtoh_async"
    assert events[0] == e0 + 10
    # profiling: events, and the profiler records the copies
    b.enable_profiling = True
    e0 = events[0]
    m.to_numpy(m.from_numpy(h))
    assert events[0] == e0 + 4
    stats = b.get_performance_stats()["memory_transfer_times"]
    assert stats["htod"]["count"] >= 1 and stats["dtoh"]["count"] >= 1
    b.enable_profiling = False
    # staged sizes keep their path (pinned chunks on a stream, events)
    b.transfers.staging_threshold, b.transfers.staging_chunk = 2048, 1024
    e0 = events[0]
    b.copy_to_device(h, t)
    assert [c[0] for c in copies[-4:]] == ["htod_async"] * 4 and events[0] > e0
    b.transfers.staging_threshold, b.transfers.staging_chunk = 32 << 20, 16 << 20

    # the typed errors, with the fast path in front
    with pytest.raises(DTypeMismatchError):
        b.copy_to_device(np.ones(1024), t)
    with pytest.raises(TransferError):
        b.copy_to_device(np.ones(1023, np.float32), t)
    with pytest.raises(TransferError):
        b.copy_from_device(t, np.ones(1023, np.float32))
    with pytest.raises(DTypeMismatchError):
        b.copy_from_device(t, np.ones(1024, np.float64))
    ro = np.ones(1024, np.float32)
    ro.flags.writeable = False
    with pytest.raises(TransferError):
        b.copy_from_device(t, ro)
    with pytest.raises(TransferError):
        b.copy_from_device(t, [0.0] * 1024)
    o2 = np.zeros((1024, 2), np.float32)[:, 0]         # not contiguous: written back
    copies.clear()
    b.copy_from_device(t, o2)
    assert copies[-1][0] == "dtoh" and copies[-1][1] is not o2
    dead = m.from_numpy(h)
    dead.free()
    for call in (lambda: b.copy_to_device(h, dead), lambda: b.copy_from_device(dead, o),
                 lambda: m.to_numpy(dead), lambda: b.to_host(dead)):
        with pytest.raises(TensorFreedError):
            call()
    with pytest.raises(InvalidDeviceError):
        m.from_numpy(h, device_id=3)
    with pytest.raises(InvalidDeviceError):
        m.from_numpy(h, device_id=True)
    with pytest.raises(DTypeMismatchError):
        m.from_numpy(np.array(["a", "b"]))
    with pytest.raises(InvalidArgumentError):
        m.to_numpy(np.ones(3))
    assert m.from_numpy(np.ones((0, 3), np.float32)).shape == (0, 3)
    assert m.to_numpy(m.from_numpy(np.ones((0, 3), np.float32))).shape == (0, 3)
    assert m.from_numpy(np.float32(2.0)).shape == ()
    print("OK")
''')


def test_activation_fill_copy_transfer_plans_match_general_path():
    """leaky_relu/elu through CudaML.activation and elementwise.unary with alpha per call
    (float32/64, float16, bfloat16; alphas that round, tie, underflow, overflow), fill for
    every dtype and value kind, zeros/ones (device given or current), copy (an async
    device-to-device copy on the current stream, no events): the plan launches or copies
    exactly what the general path does and returns a tensor like it; values or operands it
    cannot take go the general way, with its typed errors. Host<->device copies on the legacy
    stream with profiling off are one synchronous driver copy without events; with a stream
    or profiling on, the async copy between events (recorded by the profiler)."""
    run_script(COPY_FILL_SCRIPT)


# -- comparisons, where, slicing, concatenate (ops/indexing.py, ops/shape.py): the plan's
# launches equal the general path's ----------------------------------------------------------
COMPARE_SCRIPT = script(STUBS, r'''
    from cuda_backend.errors import DTypeMismatchError, InvalidArgumentError, TensorFreedError
''', BACKEND, r'''
    def same_as_general(call, key):
        """General path (the key dropped: the plan is made again), then the plan after
        freeing the result: the same launch, a result like the general one."""
        call().free()
        m.plans.pop(key, None)
        launches.clear()
        r1 = call()
        assert key in m.plans, key
        ref = (list(launches), slots(r1))
        r1.free()
        launches.clear()
        r2 = call()
        assert launches == ref[0], (launches, ref[0])
        like_general(r2, ref[1])
        return r2

    f32 = DT.FLOAT32
    x = m.from_numpy(np.arange(60, dtype=np.float32).reshape(3, 4, 5))
    y = m.from_numpy(np.ones((4, 1), np.float32))
    c = m.from_numpy(np.arange(20).reshape(4, 5) % 2 == 0)
    i32 = m.from_numpy(np.arange(7, dtype=np.int32))
    same_as_general(lambda: m.greater(x, 0.5),
                    ("compare", "greater", None, (3, 4, 5), None, f32, 0))
    same_as_general(lambda: m.less_equal(2, x), ("compare", "less_equal", None, None,
                                                 (3, 4, 5), f32, 0))
    same_as_general(lambda: m.equal(x, y), ("compare", "equal", None, (3, 4, 5), (4, 1), f32, 0))
    same_as_general(lambda: m.not_equal(i32, 3), ("compare", "not_equal", None, (7,), None,
                                                  DT.INT32, 0))
    same_as_general(lambda: m.where(c, x, 0.0), ("where", "", (4, 5), (3, 4, 5), None, f32, 0))
    same_as_general(lambda: m.where(c, -1, y), ("where", "", (4, 5), None, (4, 1), f32, 0))
    same_as_general(lambda: m.where(c, x, y), ("where", "", (4, 5), (3, 4, 5), (4, 1), f32, 0))
    # another scalar through the plan: its own converted value in the launch
    m.greater(x, 0.5).free()
    launches.clear()
    m.greater(x, 7.0).free()
    via_plan = launches[-1]
    m.plans.pop(("compare", "greater", None, (3, 4, 5), None, f32, 0))
    launches.clear()
    m.greater(x, 7.0).free()
    assert launches[-1] == via_plan
    # what the plans leave to the general path, with its errors
    with pytest.raises(InvalidArgumentError):
        m.not_equal(i32, 2**40)                  # out of int32's range
    with pytest.raises(DTypeMismatchError):
        m.greater(x, m.from_numpy(np.ones((3, 4, 5))))
    with pytest.raises(DTypeMismatchError):
        m.where(m.from_numpy(np.ones((4, 5), np.float32)), x, 0.0)
    dead = m.from_numpy(np.ones((3, 4, 5), np.float32))
    dead.free()
    with pytest.raises(TensorFreedError):
        m.greater(dead, 0.5)
    with pytest.raises(TensorFreedError):
        m.where(c, dead, 0.0)
    s = b.stream()
    launches.clear()
    with s:
        m.greater(x, 0.5)
        m.where(c, x, 0.0)
    assert [l[4] for l in launches] == [s.pycuda_stream] * 2
    r = m.greater(x, True)                       # a bool scalar: the general path
    assert r.shape == (3, 4, 5)

    # slicing: a copy (strided) or a view (contiguous), both through the key's plan
    from cuda_backend.ops.shape import key_token
    tok = key_token((slice(1, 3), slice(None, None, 2), 1))
    same_as_general(lambda: x[1:3, ::2, 1], ("getitem", (3, 4, 5), f32, 0, tok))
    tok = key_token((Ellipsis, slice(4, 0, -1)))
    same_as_general(lambda: x[..., 4:0:-1], ("getitem", (3, 4, 5), f32, 0, tok))
    v = x[1:]
    key = ("getitem", (3, 4, 5), f32, 0, key_token(slice(1, None)))
    assert key in m.plans and v.shape == (2, 4, 5) and v._ptr == x._ptr + 20 * 4
    w = x[1:]                                    # through the plan: the same view
    assert w._ptr == v._ptr and w._owner is x and w.shape == v.shape
    assert key_token((slice(np.int64(1), None),)) is None     # a NumPy int: no plan
    with pytest.raises(TensorFreedError):
        dead[1:3, ::2, 1]
    # concatenate: one plan for the inputs' shapes, dtype, device and axis
    z = m.from_numpy(np.ones((3, 2, 5), np.float32))
    same_as_general(lambda: m.concatenate([x, z], axis=1),
                    ("concatenate", ((3, 4, 5), (3, 2, 5)), f32, 0, 1))
    same_as_general(lambda: m.concatenate((x, x, x), axis=0),
                    ("concatenate", ((3, 4, 5),) * 3, f32, 0, 0))
    launches.clear()
    r = m.concatenate([x, z], axis=1)
    assert len(launches) == 1 and r.shape == (3, 6, 5)      # one "cat" launch
    with pytest.raises(DTypeMismatchError):      # a mismatch: the general path's error
        m.concatenate([x, m.from_numpy(np.ones((3, 2, 5)))], axis=1)
    with pytest.raises(TensorFreedError):
        m.concatenate([x, dead], axis=0)
    # astype: one plan per (shape, dtype, target, device), vectorized where aligned
    same_as_general(lambda: m.astype(x, "float16"), ("astype", (3, 4, 5), f32, "float16", 0))
    same_as_general(lambda: m.astype(i32, DT.FLOAT64),
                    ("astype", (7,), DT.INT32, DT.FLOAT64, 0))
    three = m.from_numpy(np.ones(3, np.float32))
    same_as_general(lambda: m.astype(three, "bfloat16"), ("astype", (3,), f32, "bfloat16", 0))
    with pytest.raises(TensorFreedError):
        m.astype(dead, "float16")
    # broadcast_to (materialized): the copy's plan per (shape, dtype, device, target shape)
    same_as_general(lambda: m.broadcast_to(y, (2, 4, 5)),
                    ("broadcast_to", (4, 1), f32, 0, (2, 4, 5)))
    same_as_general(lambda: m.broadcast_to(three, (4, 3)),
                    ("broadcast_to", (3,), f32, 0, (4, 3)))
    with pytest.raises(TensorFreedError):
        m.broadcast_to(dead, (3, 4, 5))
    print("OK")
''')


def test_compare_where_plans_match_general_path():
    run_script(COMPARE_SCRIPT)


def test_every_public_op_has_a_host_path_case():
    """perf/bench_host_path.py times every public CudaMath / CudaML operation (registry.OPS)
    against PyTorch: each has a case of its name, or one COVERS maps to it."""
    sys.path.insert(0, os.path.join(ROOT, "perf"))
    try:
        import bench_host_path as bhp
    finally:
        sys.path.pop(0)
    from cuda_backend import registry
    names = {c.name for c in bhp._cases()}
    assert set(bhp.COVERS) <= names
    covered = names | set(bhp.COVERS.values())
    missing = sorted(op for op in registry.OPS if op.split(".", 1)[1] not in covered)
    assert not missing, f"public ops without a perf/bench_host_path.py case: {missing}"


# -- stack, reshape / view, batch_norm_backward: their per-call paths against the general ones;
# the helpers (same_as_general with pool counters, t, odd_view) are NN_SCRIPT's -------------------
SHAPE_BN_SCRIPT = NN_SCRIPT[:NN_SCRIPT.index("\nif WHICH == ")] + textwrap.dedent(r'''
    from cuda_backend.ops import shape as shape_ops
    from cuda_backend.ops.shape_layouts import make_view

    # stack: one plan per (shapes, dtype, device, axis): concatenate's copies on the inputs
    A, B, C3 = t((64, 64)), t((64, 64)), t((5, 7, 3), np.float16)
    same_as_general(lambda: m.stack([A, B]), ("stack", ((64, 64),) * 2, DT.FLOAT32, 0, 0), 1)
    same_as_general(lambda: m.stack((A, B, A), axis=-1),
                    ("stack", ((64, 64),) * 3, DT.FLOAT32, 0, -1), 1)
    same_as_general(lambda: m.stack([C3, C3], 2), ("stack", ((5, 7, 3),) * 2, DT.FLOAT16, 0, 2),
                    1)
    r = m.stack([A, B], 1)
    assert r.shape == (64, 2, 64)
    with pytest.raises(ShapeMismatchError):               # the general path's checks
        m.stack([A, t((64, 63))])
    with pytest.raises(DTypeMismatchError):
        m.stack([A, t((64, 64), np.float64)])
    dead = t((64, 64))
    dead.free()
    with pytest.raises(TensorFreedError):
        m.stack([A, dead])
    with pytest.raises(InvalidArgumentError):
        m.stack([A, B], 3)

    # reshape / view: a request seen before for this shape is a lookup; the view has the
    # slots make_view gives it (owner, pointer, pool, stream), as the general path's
    for req in ((4096,), 4096, (-1, 128), (2, -1, 64)):
        for call in (lambda: m.reshape(A, req), lambda: m.view(A, req),
                     lambda: A.reshape(req), lambda: A.view(req)):
            shape_ops._TARGETS.clear()
            launches.clear()
            first, again = call(), call()
            assert not launches
            want = slots(make_view(A, first.shape))
            assert slots(first) == want and slots(again) == want, (req, slots(again), want)
            assert again._owner is A and again._block is None
    odd = odd_view((6, 10))
    assert slots(m.reshape(odd, (60,))) == slots(m.reshape(odd, (60,))) == \
        slots(make_view(odd, (60,)))
    m.reshape(A, (1, 4096))      # cached: equal to (True, 4096) as a key, as (4096,) to (4096.0,)
    for bad, err in (((4096.0,), InvalidArgumentError), ((True, 4096), InvalidArgumentError),
                     ((4095,), ShapeMismatchError), ((-1, -1), InvalidArgumentError),
                     ([64, 64.5], InvalidArgumentError)):
        for _ in range(2):
            with pytest.raises(err):
                m.reshape(A, bad)
    assert m.reshape(A, [64, 64]).shape == (64, 64)      # a list: the general path
    assert m.reshape(A, (np.int64(8), 512)).shape == (8, 512)
    with pytest.raises(TensorFreedError):
        m.reshape(dead, (4096,))
    with pytest.raises(TensorFreedError):
        dead.view(4096)

    # batch_norm_backward: training (pass with its finalize, apply; one fused pass for small
    # channels of NCHW / NCL) and inference (the pass), NCHW / NCL / NC layouts, float32/64/16,
    # grads vectorized or not
    ml.batch_norm_backward(t((2, 3)), t((2, 3)), t((3,)))   # (its ticket counters, made once)
    for shape, dt, train_launches in (
            ((1, 8, 16, 16), np.float32, 1), ((2, 3, 5, 7), np.float32, 1),
            ((3, 6, 7), np.float64, 1), ((2, 16, 8, 8), np.float16, 1),
            ((33, 12), np.float32, 2), ((2, 3, 80, 80), np.float32, 2),
            ((9000, 4), np.float32, 2)):
        X, G = t(shape, dt), t(shape, dt)
        C = shape[1]
        gam, rm, rv = t((C,), dt), t((C,), dt), m.from_numpy(np.ones(C, dt))
        same_as_general(lambda: ml.batch_norm_backward(G, X, gam),
                        ("batch_norm_backward", X.shape, X.dtype, 0, 1e-5, True),
                        train_launches)
        same_as_general(lambda: ml.batch_norm_backward(G, X, gam, eps=1e-3, training=False,
                                                       running_mean=rm, running_var=rv),
                        ("batch_norm_backward", X.shape, X.dtype, 0, 1e-3, False), 1)
        same_as_general(lambda: ml.batch_norm_backward(G, X, gam, running_mean=rm,
                                                       running_var=rv),
                        ("batch_norm_backward", X.shape, X.dtype, 0, 1e-5, True),
                        train_launches)
    X, G = t((4, 8, 4, 4)), t((4, 8, 4, 4))
    gam, rm, rv = t((8,)), t((8,)), m.from_numpy(np.ones(8, np.float32))
    key = ("batch_norm_backward", X.shape, X.dtype, 0, 1e-5, True)
    for r in ml.batch_norm_backward(G, X, gam)[::-1]:
        r.free()
    O = odd_view((4, 8, 4, 4))      # an unaligned grad: the other variant of the same plan
    launches.clear()
    for r in ml.batch_norm_backward(O, X, gam)[::-1]:
        r.free()
    planned = list(launches)
    m.plans.pop(key)
    launches.clear()
    for r in ml.batch_norm_backward(O, X, gam)[::-1]:
        r.free()
    assert launches == planned and key in m.plans
    for args, kw, err in (((t((4, 8, 4, 5)), X, gam), {}, ShapeMismatchError),
                          ((G, X, t((7,))), {}, ShapeMismatchError),
                          ((G, X, t((8,), np.float64)), {}, DTypeMismatchError),
                          ((G, X, gam), {"training": False, "running_mean": rm},
                           InvalidArgumentError),
                          ((G, X, gam), {"running_mean": t((7,)), "running_var": rv},
                           ShapeMismatchError),
                          ((dead, X, gam), {}, TensorFreedError),
                          ((G, X, gam), {"eps": -1.0}, InvalidArgumentError)):
        for _ in range(2):
            with pytest.raises(err):
                ml.batch_norm_backward(*args, **kw)
    gdead = t((8,))
    gdead.free()
    with pytest.raises(TensorFreedError):
        ml.batch_norm_backward(G, X, gdead)
    print("OK")
''')


def test_stack_reshape_batch_norm_backward_plans_match_general_path():
    """stack's plan (concatenate's copies on the inputs themselves), reshape / view of a
    request seen before (a lookup and the view's slots, no launch) and batch_norm_backward's
    plan (training and inference, each layout and float dtype, both alignment variants):
    the same launches, pool counters and result slots as the general path, and the general
    path's typed errors for what they cannot take."""
    run_script(SHAPE_BN_SCRIPT, "none")


# -- concatenate / stack / split through "cat" (one launch per 8 pieces): the plans against the
# general path; the helpers are NN_SCRIPT's -----------------------------------------------------
CAT_SCRIPT = NN_SCRIPT[:NN_SCRIPT.index("\nif WHICH == ")] + textwrap.dedent(r'''
    f32, f16 = DT.FLOAT32, DT.FLOAT16
    A, B, C = t((64, 64)), t((64, 64)), t((3, 5, 7), np.float16)
    nine = [t((3, k, 7), np.float16) for k in (1, 2, 3, 4, 5, 1, 2, 3, 4)]
    same_as_general(lambda: m.concatenate([A, B], axis=1),
                    ("concatenate", ((64, 64),) * 2, f32, 0, 1), 1)
    same_as_general(lambda: m.concatenate(nine, axis=1),
                    ("concatenate", tuple(x.shape for x in nine), f16, 0, 1), 2)
    same_as_general(lambda: m.concatenate([C, t((3, 5, 1), np.float16), C], axis=2),
                    ("concatenate", ((3, 5, 7), (3, 5, 1), (3, 5, 7)), f16, 0, 2), 1)
    E = m.create_tensor((64, 0))
    same_as_general(lambda: m.concatenate([E, A, E, B], axis=1),
                    ("concatenate", ((64, 0), (64, 64), (64, 0), (64, 64)), f32, 0, 1), 1)
    same_as_general(lambda: m.stack(nine[:1] * 9, axis=2), ("stack", ((3, 1, 7),) * 9, f16, 0, 2),
                    2)
    same_as_general(lambda: m.stack([A, B], axis=2), ("stack", ((64, 64),) * 2, f32, 0, 2), 1)
    # a source at another alignment: the general path (16-byte items, then elements)
    O = odd_view((64, 64))
    launches.clear()
    m.concatenate([A, B], axis=1).free()
    m.concatenate([O, B], axis=1).free()
    assert len(launches) == 2 and launches[0][2] != launches[1][2]
    key = ("concatenate", ((64, 64),) * 2, f32, 0, 1)
    planned = launches[1]
    m.plans.pop(key)
    launches.clear()
    m.concatenate([O, B], axis=1).free()
    assert launches == [planned]
    # split: pieces of inner axes side by side, one launch per 8; the plan per (shape, dtype,
    # device, sections or indices, axis)
    same_as_general(lambda: tuple(m.split(A, 2, axis=1)), ("split", (64, 64), f32, 0, 1, 2), 1)
    same_as_general(lambda: tuple(m.split(C, [2, 6], axis=2)),
                    ("split", (3, 5, 7), f16, 0, 2, (True, (2, 6))), 1)
    same_as_general(lambda: tuple(m.split(C, (1, 2, 3, 4, 5, 6), axis=-1)),
                    ("split", (3, 5, 7), f16, 0, -1, (False, (1, 2, 3, 4, 5, 6))), 1)
    D = t((2, 9, 3))
    same_as_general(lambda: tuple(m.split(D, 9, axis=1)), ("split", (2, 9, 3), f32, 0, 1, 9), 2)
    launches.clear()
    parts = m.split(C, [3, 3, 9], axis=1)      # an empty piece, one past the end: no plan
    assert len(launches) == 1 and [p.shape[1] for p in parts] == [3, 0, 2, 0]
    assert ("split", (3, 5, 7), f16, 0, 1, (True, (3, 3, 9))) not in m.plans
    launches.clear()
    parts = m.split(C, [4, 2], axis=1)         # overlapping pieces: getitem per piece
    assert len(launches) == 2 and [p.shape[1] for p in parts] == [4, 0, 3]
    assert all(p._owner is A for p in m.split(A, 4, axis=0))      # views, no launch
    with pytest.raises(TensorFreedError):
        dead = t((64, 64))
        dead.free()
        m.split(dead, 2, axis=1)
    with pytest.raises(ShapeMismatchError):
        m.split(A, 3, axis=1)
    s = b.stream()
    launches.clear()
    with s:
        m.split(A, 2, axis=1)
        m.concatenate([A, B], axis=1)
    assert [l[4] for l in launches] == [s.pycuda_stream] * 2
    print("OK")
''')


def test_concatenate_stack_split_cat_plans_match_general_path():
    """concatenate, stack and split by "cat" launches (one per 8 pieces): each plan launches
    what the general path launched, with its pool counters and result slots; a source at
    another alignment, a `with stream:` block, empty or overlapping split pieces and freed
    or mismatched operands take the general path, with its typed errors."""
    run_script(CAT_SCRIPT, "none")


COMPARE_FLAT_SCRIPT = script(STUBS, r'''
    import struct
    from cuda_backend.errors import DTypeMismatchError, ShapeMismatchError, TensorFreedError
''', BACKEND, r'''
    rng = np.random.default_rng(3)
    OPS = ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal")
    for dt in (np.float32, np.float64, np.float16, np.int32, np.int64, np.bool_):
        for shape in ((3, 5, 7), (1,), (1023,), (64, 64)):
            A = m.from_numpy((rng.standard_normal(shape) * 3).astype(dt))
            B = m.from_numpy((rng.standard_normal(shape) * 3).astype(dt))
            n = int(np.prod(shape))
            for op in OPS:
                key = ("compare", op, None, shape, shape, DT.from_any(dt), 0)
                getattr(m, op)(A, B).free()
                m.plans.pop(key, None)
                launches.clear()
                r1 = getattr(m, op)(A, B)                      # the general path, flat kernel
                assert key in m.plans and len(launches) == 1
                general = launches[-1]
                # four arguments: out, a, b and the element count (no dims, no strides)
                assert general[2] == struct.pack("PPPQ", r1._ptr, A._ptr, B._ptr, n), op
                want = slots(r1)
                r1.free()
                launches.clear()
                r2 = getattr(m, op)(A, B)                      # the plan
                assert launches == [general], (launches, general)
                like_general(r2, want)
                r2.free()
    # broadcasting and scalars keep the general kernel (its many arguments)
    A, S = m.from_numpy(np.ones((4, 6), np.float32)), m.from_numpy(np.ones((6,), np.float32))
    launches.clear()
    m.equal(A, S).free()
    m.less(A, 0.5).free()
    assert all(len(l[2]) > 64 for l in launches) and len(launches) == 2
    # what the plan cannot take goes to the general path and its typed errors
    A, B = m.from_numpy(np.ones((4, 6), np.float32)), m.from_numpy(np.ones((4, 6), np.float32))
    m.greater(A, B).free()
    with pytest.raises(DTypeMismatchError):
        m.greater(A, m.from_numpy(np.ones((4, 6), np.float64)))
    with pytest.raises(ShapeMismatchError):
        m.greater(A, m.from_numpy(np.ones((4, 5), np.float32)))
    dead = m.from_numpy(np.ones((4, 6), np.float32))
    dead.free()
    with pytest.raises(TensorFreedError):
        m.greater(A, dead)
    with pytest.raises(TensorFreedError):
        m.greater(dead, A)
    r = m.greater(A, B.reshape(24).reshape(4, 6))   # a view: the plan takes it
    assert r.shape == (4, 6)
    print("OK")
''')


def test_compare_two_tensors_of_one_shape_take_the_flat_kernel_and_its_plan():
    """equal ... greater_equal of two tensors of one shape (every dtype, odd sizes): one
    launch of the four-argument flat kernel (out, a, b, n), the plan launching exactly what
    the general path launched, a result like the general one; broadcasting and scalars keep
    the general kernel; bad operands still raise the general path's typed errors."""
    run_script(COMPARE_FLAT_SCRIPT)


BN_TICKET_SCRIPT = script(STUBS, r'''
    import struct
    from cuda_backend.cuda_ml import CudaML
    from cuda_backend.ops import batch_norm_backward_plans as bb
''', BACKEND, r'''
    ml = CudaML(m)
    rng = np.random.default_rng(5)

    def t(shape, dtype=np.float32):
        return m.from_numpy(rng.standard_normal(shape).astype(dtype))

    def pass_args(launch):
        """(x, g, dx, gamma, mean, var, eps, partials, counters, dgamma, dbeta, coef)."""
        return struct.unpack_from("PPPPPPdPPPPP", launch[2])

    def allocations():
        return pool.get_stats()["allocation_count"]

    # small: the workspace inside grad_input's block (3 allocations), one launch (training:
    # the pass computes grad_input itself, bb.BN_FUSE_MAX)
    X, G, gam = t((1, 8, 16, 16)), t((1, 8, 16, 16)), t((8,))
    rm, rv = t((8,)), m.from_numpy(np.ones(8, np.float32))
    for training, nlaunch in ((True, 1), (False, 1)):
        kw = {} if training else {"training": False, "running_mean": rm, "running_var": rv}
        key = ("batch_norm_backward", X.shape, X.dtype, 0, 1e-5, training)
        for r in ml.batch_norm_backward(G, X, gam, **kw):
            r.free()
        for via in ("general", "plan"):
            if via == "general":
                m.plans.pop(key, None)
            launches.clear()
            a0 = allocations()
            dx, dg, db = ml.batch_norm_backward(G, X, gam, **kw)
            assert allocations() - a0 == 3 and len(launches) == nlaunch, (via, launches)
            p = pass_args(launches[0])
            assert p[2] == dx._ptr and p[7] == dx._ptr + 8192
            assert (p[9], p[10]) == (dg._ptr, db._ptr)
            geo = bb.bn_geometry("ncs", 1, 8, 256, 1, 4, 132, training)   # (vectors)
            assert geo["fused"] == training and (geo["splits"] == 1 or not training)
            assert p[11] == (p[7] + geo["splits"] * 8 * 4 * 4 if training else 0)
            assert key in m.plans
            for r in (dx, dg, db):
                r.free()
    # large (over bb.BN_INLINE_MAX with its workspace): a workspace block of its own
    Y, H, gy = t((4, 16, 128, 128)), t((4, 16, 128, 128)), t((16,))
    assert Y.nbytes > bb.BN_INLINE_MAX
    for via in ("general", "plan"):
        launches.clear()
        a0 = allocations()
        dx, dg, db = ml.batch_norm_backward(H, Y, gy)
        assert allocations() - a0 == 4 and len(launches) == 2, via
        for r in (dx, dg, db):
            r.free()
    # many channel groups ("ncs": one a channel): the counters grow (doubling) and a plan
    # made before takes the new ones
    launches.clear()
    dx, dg, db = ml.batch_norm_backward(G, X, gam)              # the plan: current counters
    held = pass_args(launches[0])[8]
    Z, K, gz = t((2, 3000, 2, 2)), t((2, 3000, 2, 2)), t((3000,))
    launches.clear()
    ml.batch_norm_backward(K, Z, gz)
    grown = pass_args(launches[0])[8]
    assert grown != held and launches[0][0][0] == 3000
    counters = bb.COUNTERS.held()
    assert len(counters) == 1 and counters[0].size == 4096 and counters[0]._ptr == grown
    launches.clear()
    ml.batch_norm_backward(G, X, gam)                           # the plan made earlier
    assert pass_args(launches[0])[8] == grown
    print("OK")
''')


def test_batch_norm_backward_workspace_and_ticket_counters():
    """batch_norm_backward's passes finalize their channel groups (ticket counters): small
    inputs take 3 allocations (the workspace inside grad_input's block) and one launch (for
    training the fused pass), through the general path and the plan alike, with the
    pointers where they belong; large inputs keep a workspace block; the counters grow for
    a grid of more groups and a plan made before takes the new ones."""
    run_script(BN_TICKET_SCRIPT)
