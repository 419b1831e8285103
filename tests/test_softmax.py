"""softmax / log_softmax over the last axis against a stable float64 NumPy reference: every
float dtype, short (warp), shared-memory and online rows, -inf/+inf/NaN rows, huge values,
poisoned outputs, misaligned pointers, errors; GPU tests are marked `gpu`, the rest run in
whatever mode the backend is in (fallback here) and test the mode planning."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend.cuda_math import CudaMath
from cuda_backend.ops import softmax as sm
from cuda_backend.tensor import CudaTensor

FLOATS = [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16]
SHAPES = [(1, 1), (3, 7), (5, 1023), (2, 3, 1025), (4, 4097), (64, 33000)]
# (rtol, atol) for softmax and for log_softmax (whose values grow with |x - max|)
TOL = {DT.FLOAT32: (1e-5, 1e-7), DT.FLOAT64: (1e-12, 1e-15), DT.FLOAT16: (1e-2, 1e-3),
       DT.BFLOAT16: (1e-2, 4e-3)}


@pytest.fixture(scope="module")
def m():
    return CudaMath()


def host_dtype(dtype):
    return np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype


def reference(a, log):
    """Stable float64 softmax: exp(x - max) / sum, log: (x - max) - log(sum)."""
    a = a.astype(np.float64)
    with np.errstate(all="ignore"):
        z = a - np.max(a, axis=-1, keepdims=True)
        s = np.sum(np.exp(z), axis=-1, keepdims=True)
        return z - np.log(s) if log else np.exp(z) / s


def check(out, a, dtype, log, what=""):
    ref = reference(a, log)
    out = out.astype(np.float64)
    assert out.shape == ref.shape
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref), err_msg=what)
    ok = np.isfinite(ref)
    np.testing.assert_array_equal(out[~ok], ref[~ok], err_msg=what)
    assert_close(out[ok], ref[ok], dtype, log, what)


def assert_close(out, ref, dtype, log, what=""):
    """|out - ref| <= rtol |ref| + atol; log-softmax values carry an absolute error that
    grows with |x - max|, so they get rtol |ref| more slack."""
    rtol, atol = TOL[dtype]
    bound = rtol * np.abs(ref) + (atol * 100 + rtol * np.abs(ref) if log else atol)
    err = np.abs(out - ref)
    bad = err > bound
    assert not np.any(bad), (what, int(bad.sum()), float(np.max(err - bound)))


def make(m, shape, dtype, rng, scale=3.0):
    t = m.from_numpy((rng.standard_normal(shape) * scale).astype(host_dtype(dtype)), dtype=dtype)
    return t, m.to_numpy(t)


def poisoned(m, shape, dtype):
    return m.from_numpy(np.full(shape, np.nan, host_dtype(dtype)), dtype=dtype)


# -- GPU -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_matches_numpy(m, dtype, log):
    rng = np.random.default_rng()
    shapes = SHAPES + [(7, 128), (9, 129), (33, 512), (6, 1024), (5, 2048), (3, 61000)]
    for shape in shapes:
        x, a = make(m, shape, dtype, rng)
        out = poisoned(m, shape, dtype)
        got = sm.softmax(m, x, log=log, out=out)
        assert got is out
        h = m.to_numpy(out)
        assert np.all(np.isfinite(h)), shape
        check(h, a, dtype, log, str(shape))
        if not log:
            np.testing.assert_allclose(h.astype(np.float64).sum(-1), 1.0,
                                       rtol=TOL[dtype][0] * 10 + 1e-6)
        x.free(), out.free()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(65536, 1024), (8192, 4096)])
def test_large_float32(m, shape):
    rng = np.random.default_rng()
    x, a = make(m, shape, DT.FLOAT32, rng)
    check(m.to_numpy(m.softmax(x)), a, DT.FLOAT32, False)
    check(m.to_numpy(m.log_softmax(x)), a, DT.FLOAT32, True)
    x.free()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_online_rows_longer_than_shared_memory(m, dtype):
    """Rows over ~227 KB take the two-read online path."""
    rng = np.random.default_rng()
    K = (240 * 1024) // dtype.itemsize + 5
    assert sm.plan(K, dtype.itemsize, 227 * 1024)["mode"] == "online"
    x, a = make(m, (3, K), dtype, rng)
    for log in (False, True):
        check(m.to_numpy(sm.softmax(m, x, log=log)), a, dtype, log, f"K={K}")
    x.free()


BIG = {DT.FLOAT32: 3e38, DT.FLOAT64: 1e300, DT.FLOAT16: 6e4, DT.BFLOAT16: 3e38}


def special_rows(dtype, K, rng):
    """Rows: all -inf, one +inf, one NaN, every other -inf, huge values, one -inf."""
    a = rng.standard_normal((6, K))
    a[0, :] = -np.inf
    a[1, K // 2] = np.inf
    a[2, K - 1] = np.nan
    a[3, ::2] = -np.inf
    a[4, :] = BIG[dtype] * (1 - 0.05 * np.abs(a[4, :]) / (1 + np.abs(a[4, :])))
    a[5, 0] = -np.inf
    return a.astype(host_dtype(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("K", [5, 300, 1023, 5000, 70000])
def test_special_values_like_numpy(m, dtype, K):
    """-inf rows -> NaN, +inf -> NaN row, NaN -> NaN row, -inf elements -> 0 (log: -inf),
    huge values do not overflow."""
    rng = np.random.default_rng()
    x = m.from_numpy(special_rows(dtype, K, rng), dtype=dtype)
    h = m.to_numpy(x)
    for log in (False, True):
        out = m.to_numpy(sm.softmax(m, x, log=log)).astype(np.float64)
        ref = reference(h, log)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref), err_msg=f"log={log}")
        assert np.all(np.isnan(out[:3])), "rows of -inf only, with +inf or with NaN are NaN"
        assert not np.any(np.isnan(out[3:]))
        if log:
            assert np.all(np.isneginf(out[3, ::2])) and np.isneginf(out[5, 0])
        else:
            assert np.all(out[3, ::2] == 0) and out[5, 0] == 0
        ok = np.isfinite(ref)
        assert_close(out[ok], ref[ok], dtype, log, f"K={K} log={log}")
    x.free()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_misaligned_pointers(m, dtype):
    """Input and output one element past a 16-byte boundary (wrapped slices): every mode."""
    rng = np.random.default_rng()
    for shape in [(3, 7), (5, 64), (4, 1000), (3, 4097), (2, 70000)]:
        n = int(np.prod(shape))
        base, b = make(m, (n + 1,), dtype, rng)
        x = CudaTensor(shape, dtype, base.device_id, base.ptr + dtype.itemsize, owner=base)
        a = b[1:].reshape(shape)
        obase = poisoned(m, (n + 2,), dtype)
        for shift in (1, 2):  # out congruent with x, and not
            out = CudaTensor(shape, dtype, obase.device_id, obase.ptr + shift * dtype.itemsize,
                             owner=obase)
            check(m.to_numpy(sm.softmax(m, x, out=out)), a, dtype, False, f"{shape} {shift}")
        base.free(), obase.free()


@pytest.mark.gpu
@settings(max_examples=examples(40), deadline=None)
@given(rows=st.integers(1, 50), K=st.integers(1, 6000), log=st.booleans(),
       dtype=st.sampled_from(FLOATS), scale=st.sampled_from([0.1, 3.0, 30.0]))
def test_property_rows(m, rows, K, log, dtype, scale):
    rng = np.random.default_rng()
    x, a = make(m, (rows, K), dtype, rng, scale)
    check(m.to_numpy(sm.softmax(m, x, log=log)), a, dtype, log, f"{rows}x{K}")
    x.free()


# -- any mode: API, errors, edge shapes ----------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_api_small(m, dtype):
    rng = np.random.default_rng()
    for shape in [(1, 1), (3, 7), (2, 3, 33), (7,)]:
        x, a = make(m, shape, dtype, rng)
        for log, fn in ((False, m.softmax), (True, m.log_softmax)):
            r = fn(x)
            assert r.shape == shape and r.dtype is dtype
            check(m.to_numpy(r), a, dtype, log, str(shape))


def test_edge_shapes(m):
    assert m.softmax(m.create_tensor((0, 5))).shape == (0, 5)
    assert m.log_softmax(m.create_tensor((3, 0), DT.FLOAT16)).shape == (3, 0)
    one = m.from_numpy(np.array(4.0, np.float32))
    assert m.softmax(one).shape == () and float(m.to_numpy(m.softmax(one))) == 1.0
    assert float(m.to_numpy(m.log_softmax(one))) == 0.0
    row = m.from_numpy(np.array([[-np.inf, -np.inf], [1.0, -np.inf]], np.float32))
    out = m.to_numpy(m.softmax(row))
    assert np.all(np.isnan(out[0])) and out[1].tolist() == [1.0, 0.0]


def test_errors(m):
    x = m.from_numpy(np.ones((3, 4), np.float32))
    for dtype in (DT.INT32, DT.INT64, DT.UINT8, DT.BOOL):
        with pytest.raises(cb.DTypeMismatchError,
                           match=f"softmax does not support {dtype.name_str}"):
            m.softmax(m.create_tensor((2, 2), dtype))
    with pytest.raises(cb.DTypeMismatchError, match="log_softmax does not support int32"):
        m.log_softmax(m.create_tensor((2, 2), DT.INT32))
    with pytest.raises(cb.DTypeMismatchError, match="out has dtype float64, expected float32"):
        sm.softmax(m, x, out=m.create_tensor((3, 4), DT.FLOAT64))
    with pytest.raises(cb.ShapeMismatchError, match=r"out has shape \(4, 3\), expected \(3, 4\)"):
        sm.softmax(m, x, out=m.create_tensor((4, 3)))
    with pytest.raises(cb.InvalidArgumentError, match="must be a CudaTensor"):
        m.softmax(np.ones((2, 2)))
    x.free()
    with pytest.raises(cb.TensorFreedError):
        m.softmax(x)
    with pytest.raises(cb.TensorFreedError):
        m.log_softmax(x)


def test_plan_modes():
    limit = 227 * 1024 - 1024
    assert sm.plan(1, 4, limit) == {"mode": "warp", "nv": 4, "group": 1, "threads": 256,
                                    "smem": 0}
    assert sm.plan(7, 4, limit)["group"] == 1       # one lane holds 16 elements
    assert sm.plan(64, 4, limit)["group"] == 4      # 4 vectors per lane in flight
    p = sm.plan(512, 4, limit)
    assert p["nv"] == 4 and p["group"] == 32
    assert sm.plan(513, 4, limit)["nv"] == 8
    p = sm.plan(1024, 4, limit)
    assert p["mode"] == "warp" and p["nv"] == 8 and p["group"] == 32
    assert sm.plan(2048, 2, limit)["mode"] == "warp"
    assert sm.plan(1025, 4, limit)["mode"] == "smem"
    assert sm.plan(4096, 4, limit) == {"mode": "smem", "nv": 0, "group": 0, "threads": 256,
                                       "smem": 4100 * 4}
    assert sm.plan(33000, 4, limit)["threads"] == 1024
    assert sm.plan(60000, 4, limit)["mode"] == "online"
    for K in range(1, 3000, 7):
        for itemsize in (2, 4, 8):
            p = sm.plan(K, itemsize, limit)
            if p["mode"] == "warp":  # every element has a register slot
                assert p["group"] * (16 // itemsize) * p["nv"] >= K and p["group"] <= 32
                assert p["nv"] in sm.WARP_NV


def test_template_variants():
    sets = sm.template_variants()["softmax.cu.j2"]
    assert len(sets) == 16
    assert {p["mode"] for p in sets} == {"warp", "smem", "online"}
