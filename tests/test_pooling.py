"""max_pool2d / avg_pool2d against a float64 NumPy reference: every float dtype, odd shapes,
strides, padding, non-divisible windows, the 2x2 fast path and the generic kernel, NaN/inf,
poisoned outputs, misaligned inputs, errors. GPU tests are marked `gpu`; the rest run in
whatever mode the backend is in (fallback here)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples
from helpers import call_through_plan

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend.cuda_math import CudaMath
from cuda_backend.cuda_ml import CudaML
from cuda_backend.ops import pooling
from cuda_backend.tensor import CudaTensor

FLOATS = [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16]
AVG_RTOL = {DT.FLOAT32: 1e-6, DT.FLOAT64: 1e-13, DT.FLOAT16: 1e-3, DT.BFLOAT16: 8e-3}
# (shape, pool_size, stride, padding)
CASES = [
    ((3, 5, 7, 9), 2, None, 0),
    ((1, 1, 1, 1), 1, None, 0),
    ((2, 3, 17, 19), 3, 2, 1),
    ((2, 3, 17, 19), (3, 2), (2, 1), (1, 0)),
    ((1, 3, 10, 10), 3, None, 0),           # 10 is not a multiple of 3: last column dropped
    ((2, 1, 7, 7), 5, 1, 2),
    ((1, 2, 9, 10), (4, 4), (3, 3), (2, 2)),
    ((2, 2, 5, 6), (1, 3), (1, 2), (0, 1)),
    ((4, 2, 16, 16), 2, None, 0),           # 2x2 fast path for every dtype
    ((2, 3, 15, 32), 2, 2, 0),              # fast path, odd H (last row dropped)
    ((2, 2, 8, 12), 2, 2, 0),               # fast path for float32/float64, generic for halves
    ((3, 4, 33, 64), 2, None, 0),
    ((2, 3, 9, 11), 2, None, 1),            # 2x2 with padding: generic
]


@pytest.fixture(scope="module")
def m():
    return CudaMath()


def host_dtype(dtype):
    return np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype


def pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def reference(a, kind, k, s, p):
    """Pooling in float64 by window offsets: max pads with -inf (NaN propagates), avg pads
    with 0 and divides by the window size."""
    k, p = pair(k), pair(p)
    s = k if s is None else pair(s)
    a = a.astype(np.float64)
    n, c, h, w = a.shape
    oh = (h + 2 * p[0] - k[0]) // s[0] + 1
    ow = (w + 2 * p[1] - k[1]) // s[1] + 1
    fill = -np.inf if kind == "max" else 0.0
    padded = np.full((n, c, h + 2 * p[0], w + 2 * p[1]), fill)
    padded[:, :, p[0]:p[0] + h, p[1]:p[1] + w] = a
    out = np.full((n, c, oh, ow), fill)
    nan = np.zeros(out.shape, bool)
    for i in range(k[0]):
        for j in range(k[1]):
            win = padded[:, :, i:i + s[0] * (oh - 1) + 1:s[0], j:j + s[1] * (ow - 1) + 1:s[1]]
            nan |= np.isnan(win)
            out = np.fmax(out, win) if kind == "max" else out + win
    if kind == "avg":
        out = out / (k[0] * k[1])
    out[nan] = np.nan  # NaN propagates, as PyTorch
    return out


def make(m, shape, dtype, rng):
    t = m.from_numpy(rng.standard_normal(shape).astype(host_dtype(dtype)), dtype=dtype)
    return t, m.to_numpy(t)


def poisoned(m, shape, dtype):
    return m.from_numpy(np.full(shape, np.nan, host_dtype(dtype)), dtype=dtype)


def check(out, ref, kind, dtype, what=""):
    out = out.astype(np.float64)
    assert out.shape == ref.shape, what
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref), err_msg=what)
    if kind == "max":  # the max is one of the (already rounded) inputs: exact
        np.testing.assert_array_equal(out, ref, err_msg=what)
    else:
        # inputs are O(1): the float sum of a window carries an absolute error of a few ulp
        # of O(1) even where the mean cancels to near 0
        ok = ~np.isnan(ref)
        np.testing.assert_allclose(out[ok], ref[ok], rtol=AVG_RTOL[dtype],
                                   atol=AVG_RTOL[dtype] * 4, err_msg=what)


# -- GPU -------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_second_call_takes_the_plan(m, dtype, kind):
    """CudaML.max_pool2d / avg_pool2d twice on fresh inputs of odd shapes (the 2x2 kernel and
    the generic one): the second call goes through the plan the first made, and both match
    the reference."""
    ml = CudaML(m)
    call_pool = ml.max_pool2d if kind == "max" else ml.avg_pool2d
    rng = np.random.default_rng(23)
    for shape, k, s, p in [((3, 5, 10, 16), 2, None, (0, 0)), ((2, 3, 17, 19), 3, 2, 1),
                           ((1, 7, 9, 13), (2, 3), (1, 2), (1, 0))]:
        key = (f"{kind}_pool2d", shape, dtype, 0, k, s, p)
        m.plans.pop(key, None)
        for second in (False, True):
            x, a = make(m, shape, dtype, rng)
            call = lambda: call_pool(x, k, s, p)  # noqa: E731
            y = call_through_plan(m, key, call) if second else call()
            assert key in m.plans
            check(m.to_numpy(y), reference(a, kind, k, s, p), kind, dtype,
                  f"{shape} {k} {s} {p} second={second}")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_matches_numpy(m, dtype, kind):
    rng = np.random.default_rng(5630)
    for shape, k, s, p in CASES:
        x, a = make(m, shape, dtype, rng)
        ref = reference(a, kind, k, s, p)
        out = poisoned(m, ref.shape, dtype)
        pooling.pool2d(m, kind, x, k, s, p, out=out)
        check(m.to_numpy(out), ref, kind, dtype, f"{shape} k={k} s={s} p={p}")
        x.free(), out.free()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_nan_and_inf(m, dtype):
    """NaN anywhere in a window makes the max NaN (and the mean); +-inf behave as numbers."""
    rng = np.random.default_rng(8045)
    for shape, k, s, p in [((2, 3, 8, 16), 2, None, 0), ((2, 3, 17, 19), 3, 2, 1)]:
        a = rng.standard_normal(shape).astype(host_dtype(dtype))
        flat = a.reshape(-1)
        idx = rng.choice(flat.size, size=12, replace=False)
        flat[idx[:4]] = np.nan
        flat[idx[4:8]] = np.inf
        flat[idx[8:]] = -np.inf
        x = m.from_numpy(a, dtype=dtype)
        a = m.to_numpy(x)
        for kind in ("max", "avg"):
            ref = reference(a, kind, k, s, p)
            out = pooling.pool2d(m, kind, x, k, s, p)
            got = m.to_numpy(out).astype(np.float64)
            nan = np.isnan(ref)
            np.testing.assert_array_equal(np.isnan(got), nan, err_msg=kind)
            inf = np.isinf(ref)
            np.testing.assert_array_equal(got[inf], ref[inf], err_msg=kind)
            check(got[~nan & ~inf], ref[~nan & ~inf], kind, dtype, kind)
            out.free()
        x.free()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_large_2x2(m, kind):
    """The benchmark shape (fast path), against a reshape reference."""
    rng = np.random.default_rng(9371)
    shape = (32, 64, 128, 128)
    a = rng.standard_normal(shape, dtype=np.float32)
    x = m.from_numpy(a)
    out = poisoned(m, (32, 64, 64, 64), DT.FLOAT32)
    pooling.pool2d(m, kind, x, (2, 2), None, (0, 0), out=out)
    r = a.astype(np.float64).reshape(32, 64, 64, 2, 64, 2)
    ref = r.max(axis=(3, 5)) if kind == "max" else r.mean(axis=(3, 5))
    check(m.to_numpy(out), ref, kind, DT.FLOAT32)
    x.free(), out.free()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_misaligned_input_takes_generic_path(m, dtype):
    """An input one element past a 16-byte boundary (a wrapped view) cannot take the
    vector path; the result is the same."""
    rng = np.random.default_rng(184)
    shape = (2, 3, 8, 16)
    n = int(np.prod(shape))
    base, b = make(m, (n + 1,), dtype, rng)
    x = CudaTensor(shape, dtype, base.device_id, base.ptr + dtype.itemsize, owner=base)
    a = b[1:].reshape(shape)
    for kind in ("max", "avg"):
        out = poisoned(m, (2, 3, 4, 8), dtype)
        pooling.pool2d(m, kind, x, 2, None, 0, out=out)
        check(m.to_numpy(out), reference(a, kind, 2, None, 0), kind, dtype, kind)
    base.free()


@pytest.mark.gpu
@settings(max_examples=examples(40), deadline=None)
@given(n=st.integers(1, 3), c=st.integers(1, 4), h=st.integers(1, 24), w=st.integers(1, 24),
       kh=st.integers(1, 5), kw=st.integers(1, 5), sh=st.integers(1, 4), sw=st.integers(1, 4),
       kind=st.sampled_from(["max", "avg"]), dtype=st.sampled_from(FLOATS), data=st.data())
def test_property_any_window(m, n, c, h, w, kh, kw, sh, sw, kind, dtype, data):
    ph = data.draw(st.integers(0, kh // 2))
    pw = data.draw(st.integers(0, kw // 2))
    if h + 2 * ph < kh or w + 2 * pw < kw:
        return  # the window does not fit: covered by test_errors
    x, a = make(m, (n, c, h, w), dtype, np.random.default_rng(1300))
    out = pooling.pool2d(m, kind, x, (kh, kw), (sh, sw), (ph, pw))
    check(m.to_numpy(out), reference(a, kind, (kh, kw), (sh, sw), (ph, pw)), kind, dtype)
    x.free(), out.free()


# -- any mode (fallback here) ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_api_small(m, dtype):
    """CudaML.max_pool2d / avg_pool2d (the documented call) against the reference."""
    ml = CudaML(m)
    rng = np.random.default_rng(1299)
    for shape, k, s, p in CASES[:5]:
        x, a = make(m, shape, dtype, rng)
        check(m.to_numpy(ml.max_pool2d(x, k, s, p)), reference(a, "max", k, s, p), "max",
              dtype)
        check(m.to_numpy(ml.avg_pool2d(x, k, s, p)), reference(a, "avg", k, s, p), "avg",
              dtype)


def test_seed_example_shapes(m):
    """The documented API's ML example: max_pool2d(relu_output, pool_size=(2, 2)) halves H and W."""
    ml = CudaML(m)
    x = m.from_numpy(np.random.default_rng(1603).random((2, 8, 16, 16), dtype=np.float32))
    y = ml.max_pool2d(x, pool_size=(2, 2))
    assert y.shape == (2, 8, 8, 8)
    y2 = ml.avg_pool2d(x, pool_size=(2, 2), stride=(1, 1))
    assert y2.shape == (2, 8, 15, 15)


def test_zero_batch_and_out(m):
    x = m.from_numpy(np.ones((0, 3, 8, 8), np.float32))
    y = pooling.pool2d(m, "max", x, 2)
    assert y.shape == (0, 3, 4, 4)
    rng = np.random.default_rng(4206)
    x, a = make(m, (1, 2, 6, 6), DT.FLOAT32, rng)
    out = poisoned(m, (1, 2, 3, 3), DT.FLOAT32)
    assert pooling.pool2d(m, "avg", x, 2, out=out) is out
    check(m.to_numpy(out), reference(a, "avg", 2, None, 0), "avg", DT.FLOAT32)


def test_errors(m):
    x = m.from_numpy(np.ones((2, 3, 8), np.float32))
    with pytest.raises(cb.InvalidArgumentError, match=r"4-D.*\(2, 3, 8\)"):
        pooling.pool2d(m, "max", x, 2)
    x4 = m.from_numpy(np.ones((1, 2, 6, 6), np.float32))
    with pytest.raises(cb.InvalidArgumentError, match=r"padding \(2, 2\).*pool_size \(3, 3\)"):
        pooling.pool2d(m, "max", x4, 3, 1, 2)
    with pytest.raises(cb.InvalidArgumentError, match=r"padding \(0, 2\).*pool_size \(3, 3\)"):
        pooling.pool2d(m, "avg", x4, 3, 1, (0, 2))
    with pytest.raises(cb.ShapeMismatchError, match=r"\(7, 7\).*\(1, 2, 6, 6\)"):
        pooling.pool2d(m, "max", x4, 7)
    with pytest.raises(cb.InvalidArgumentError, match="pool_size must be >= 1"):
        pooling.pool2d(m, "max", x4, 0)
    with pytest.raises(cb.InvalidArgumentError, match="stride must be >= 1"):
        pooling.pool2d(m, "max", x4, 2, (0, 1))
    with pytest.raises(cb.InvalidArgumentError, match="pool_size must be an int or a pair"):
        pooling.pool2d(m, "max", x4, (2, 2, 2))
    with pytest.raises(cb.InvalidArgumentError, match="pool_size must be an int or a pair"):
        pooling.pool2d(m, "max", x4, 2.5)
    with pytest.raises(cb.InvalidArgumentError, match="'max' or 'avg'"):
        pooling.pool2d(m, "min", x4, 2)
    xi = m.from_numpy(np.ones((1, 1, 4, 4), np.int32))
    with pytest.raises(cb.DTypeMismatchError, match="int32"):
        pooling.pool2d(m, "max", xi, 2)
    xe = m.from_numpy(np.ones((1, 1, 0, 4), np.float32))
    with pytest.raises(cb.InvalidArgumentError, match="spatial"):
        pooling.pool2d(m, "max", xe, 1)
    with pytest.raises(cb.InvalidArgumentError, match="CudaTensor"):
        pooling.pool2d(m, "max", np.ones((1, 1, 4, 4)), 2)
    bad_out = m.from_numpy(np.ones((1, 2, 2, 2), np.float32))
    with pytest.raises(cb.ShapeMismatchError, match=r"out has shape \(1, 2, 2, 2\)"):
        pooling.pool2d(m, "max", x4, 2, out=bad_out)
    ml = CudaML(m)
    with pytest.raises(cb.InvalidArgumentError, match="4-D"):
        ml.max_pool2d(x, (2, 2))


def test_nothing_leaks_on_errors(m):
    """Errors are raised before the output is allocated."""
    x4 = m.from_numpy(np.ones((1, 2, 6, 6), np.float32))
    pool = m.backend.memory_pools[x4.device_id]
    before = pool.get_stats()["active_blocks"]
    for _ in range(3):
        with pytest.raises(cb.InvalidArgumentError):
            pooling.pool2d(m, "max", x4, 3, 1, 2)
        with pytest.raises(cb.ShapeMismatchError):
            pooling.pool2d(m, "max", x4, 7)
    assert pool.get_stats()["active_blocks"] == before


def test_fast_divisor_exact():
    rng = np.random.default_rng(3985)
    M = (1 << 64) - 1
    for d in [1, 2, 3, 7, 64, 127, 1000, 65537, (1 << 31) - 1, 1 << 40, (1 << 62) + 3]:
        d_, mult, l = pooling.fast_divisor(d)
        s1, s2 = min(l, 1), max(l - 1, 0)
        for n in [0, 1, d - 1, d, d + 1, 5 * d + 3, (1 << 63) - 1] + \
                [int(v) for v in rng.integers(0, 1 << 62, size=50)]:
            if n < 0 or n >= 1 << 63:
                continue
            t = (mult * n) >> 64
            q = (((t + ((n - t) >> s1)) & M) >> s2)
            assert q == n // d, (n, d)


def test_template_variants():
    v = pooling.template_variants()["pool2d.cu.j2"]
    assert len(v) == 16
    assert {p["window"] for p in v} == {0, 2}
    for p in v:
        assert p["vec"] == (1 if p["window"] == 0 else 16 // DT.from_any(p["dtype"]).itemsize)
