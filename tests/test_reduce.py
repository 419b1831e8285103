"""Reductions (sum, mean, max, min, argmax) against float64 NumPy: every dtype, axis patterns,
odd and large shapes, NaN/Inf, ties, empty inputs, errors; GPU tests are marked `gpu`, the
rest run in whatever mode the backend is in (fallback here) and test the launch planning."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples
from helpers import spy_plan, view_past_aligned

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend.cuda_math import CudaMath
from cuda_backend.devices import CudaDeviceInfo
from cuda_backend.ops import reduction as red
from cuda_backend.ops import reduction_config as rcfg
from cuda_backend.tensor import CudaTensor

DTYPES = [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16, DT.INT32, DT.INT64]
OPS = ["sum", "mean", "max", "min"]
# (shape, axis, keepdims): full, first, last, middle, two axes (adjacent and not), odd sizes
CASES = [
    ((1,), None, False), ((7,), 0, True), ((13, 17), None, False), ((13, 17), 0, False),
    ((13, 17), -1, True), ((13, 17), (0, 1), True), ((3, 5, 7), 1, False),
    ((3, 5, 7), (0, 2), False), ((3, 5, 7), (0, 2), True), ((3, 5, 7), (0, 1), True),
    ((3, 5, 7), (1, 2), False), ((3, 5, 7), -1, False), ((2, 3, 4, 5), (1, 3), False),
    ((1025,), None, False), ((1, 13, 1, 17), (0, 2), False), ((2 ** 20 + 3,), None, False),
    ((5, 4097), -1, False), ((4097, 5), 0, True), ((33, 1000, 3), 1, False),
]
# the reduction's own error bound, relative to sum(|x|), plus the result's rounding
# (halves: intermediates of multi-pass reductions are rounded to the input dtype)
SUM_TOL = {DT.FLOAT32: (1e-6, 0.0), DT.FLOAT64: (1e-13, 0.0), DT.FLOAT16: (1e-3, 1e-3),
           DT.BFLOAT16: (8e-3, 8e-3)}


@pytest.fixture(scope="module")
def m():
    return CudaMath()


def host_dtype(dtype):
    return np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype


def make(m, shape, dtype, rng, ints=(-1000, 1000)):
    """A fresh random tensor and its exact values on the host (after rounding to dtype)."""
    if dtype.is_floating:
        values = rng.standard_normal(shape)
    else:
        values = rng.integers(*ints, size=shape)
    t = m.from_numpy(np.asarray(values).astype(host_dtype(dtype)), dtype=dtype)
    return t, m.to_numpy(t).astype(host_dtype(dtype))


def poisoned(m, shape, dtype):
    """An output tensor filled with NaN (floats) or a sentinel (ints) before the kernel runs."""
    fill = np.nan if dtype.is_floating else -777
    return m.from_numpy(np.full(shape, fill, host_dtype(dtype)), dtype=dtype)


def axes_of(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    return tuple(a % ndim for a in ((axis,) if isinstance(axis, int) else axis))


def reference(op, a, axis, keepdims):
    """float64 (or exact int64) NumPy reference."""
    wide = a.astype(np.float64) if a.dtype.kind == "f" else a.astype(np.int64)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        fn = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[op]
        return np.asarray(fn(wide, axis=axis, keepdims=keepdims))


def check(op, dtype, out, a, axis, keepdims, what=""):
    """out (host) against the reference, with bounds that follow the accumulation."""
    ref = reference(op, a, axis, keepdims)
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    if op in ("max", "min") or not dtype.is_floating and op == "sum":
        np.testing.assert_array_equal(out, ref.astype(out.dtype), err_msg=what)
        return
    if not dtype.is_floating:  # int mean: float64 of an exact sum
        np.testing.assert_allclose(out, ref, rtol=1e-12, err_msg=what)
        return
    rel, rounding = SUM_TOL[dtype]
    mag = np.sum(np.abs(a.astype(np.float64)), axis=axis, keepdims=keepdims)
    if op == "mean":
        mag = mag / max(1, math.prod(a.shape[i] for i in axes_of(axis, a.ndim)))
    bound = rel * mag + rounding * np.abs(ref) + 1e-30
    err = np.abs(out.astype(np.float64) - ref)
    assert np.all(np.isfinite(out)), what
    assert np.all(err <= bound), (what, float(np.max(err - bound)))


def run_op(m, op, x, axis=None, keepdims=False):
    return {"sum": m.reduce_sum, "mean": m.reduce_mean, "max": m.reduce_max,
            "min": m.reduce_min}[op](x, axis=axis, keepdims=keepdims)


# -- GPU: every op x dtype x axis pattern ------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name_str)
@pytest.mark.parametrize("op", OPS)
def test_matches_numpy_every_axis_pattern(m, op, dtype):
    rng = np.random.default_rng(8592)
    for shape, axis, keepdims in CASES:
        x, a = make(m, shape, dtype, rng)
        ref_shape = reference(op, a, axis, keepdims).shape
        out = poisoned(m, ref_shape, rcfg.result_dtype(dtype, op))
        got = red.reduce(m, op, x, axis, keepdims, out=out)
        assert got is out and got.dtype is rcfg.result_dtype(dtype, op)
        check(op, dtype, m.to_numpy(out), a, axis, keepdims, f"{op} {shape} axis={axis}")
        x.free(), out.free()


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape, axis", [
    ((64, 1 << 16), -1),        # few long rows: several blocks per row, last block folds
    ((3, 1 << 20), 0),          # short axis, wide rows: columns
    ((1 << 20, 3), 0),          # tiny inner: R split over blocks
    ((1 << 20, 12), 0),         # inner a multiple of the vector width
    ((8, 1 << 17, 2), 1),       # middle axis, split
    ((1 << 14, 1 << 10), None),
])
def test_large_split_paths(m, op, shape, axis):
    rng = np.random.default_rng(769)
    x, a = make(m, shape, DT.FLOAT32, rng)
    check(op, DT.FLOAT32, m.to_numpy(run_op(m, op, x, axis)), a, axis, False, str(shape))
    x.free()


@pytest.mark.gpu
@pytest.mark.large
@pytest.mark.parametrize("shape, axis", [((1 << 26,), None), ((1 << 13, 1 << 13), -1),
                                         ((1 << 13, 1 << 13), 0)])
def test_float32_sum_accuracy_2p26(m, shape, axis):
    """2^26 positive values: the blocked tree order keeps the relative error ~1e-7."""
    rng = np.random.default_rng(730)
    a = rng.random(shape, dtype=np.float32) + np.float32(0.5)
    x = m.from_numpy(a)
    ref = np.sum(a.astype(np.float64), axis=axis)
    out = m.to_numpy(m.reduce_sum(x, axis=axis)).astype(np.float64)
    assert np.max(np.abs(out - ref) / ref) < 1e-6
    mean = m.to_numpy(m.reduce_mean(x, axis=axis)).astype(np.float64)
    assert np.max(np.abs(mean - ref / (a.size // ref.size)) / (ref / (a.size // ref.size))) < 1e-6
    x.free()


@pytest.mark.gpu
def test_split_reduction_is_deterministic_and_reuses_counters(m):
    rng = np.random.default_rng(5208)
    x, a = make(m, (7, 1 << 20), DT.FLOAT32, rng)
    first = m.to_numpy(m.reduce_sum(x, axis=-1))
    for _ in range(5):  # the ticket counters must be back at 0 after every launch
        np.testing.assert_array_equal(m.to_numpy(m.reduce_sum(x, axis=-1)), first)
    y, b = make(m, (1 << 20, 3), DT.FLOAT32, rng)
    cols = m.to_numpy(m.reduce_sum(y, axis=0))
    np.testing.assert_array_equal(m.to_numpy(m.reduce_sum(y, axis=0)), cols)
    check("sum", DT.FLOAT32, first, a, -1, False)
    x.free(), y.free()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT16, DT.FLOAT64, DT.INT32])
def test_misaligned_base_pointer(m, dtype):
    """A tensor starting one element past a 16-byte boundary (e.g. wrapped from a slice)."""
    rng = np.random.default_rng(1587)
    for shape, axis in [((1001,), None), ((37, 129), -1), ((129, 40), 0), ((5, 66, 8), 1)]:
        n = math.prod(shape)
        base, b = make(m, (n + 1,), dtype, rng)
        x = CudaTensor(shape, dtype, base.device_id, base.ptr + dtype.itemsize, owner=base)
        a = b[1:].reshape(shape)
        for op in ("sum", "max"):
            check(op, dtype, m.to_numpy(run_op(m, op, x, axis)), a, axis, False, str(shape))
        np.testing.assert_array_equal(m.to_numpy(m.argmax(x, axis=axis)),
                                      np.argmax(a, axis=axis))


@pytest.mark.gpu
def test_int32_sum_returns_int64_without_overflow(m):
    a = np.full((3, 4096), 2 ** 30, np.int32)
    a[1, ::2] = -2 ** 31
    x = m.from_numpy(a)
    for axis in (None, -1, 0):
        s = m.reduce_sum(x, axis=axis)
        assert s.dtype is DT.INT64
        np.testing.assert_array_equal(m.to_numpy(s), np.sum(a, axis=axis))
    assert m.reduce_mean(x).dtype is DT.FLOAT64
    np.testing.assert_allclose(m.to_numpy(m.reduce_mean(x, axis=1)), np.mean(a, axis=1),
                               rtol=1e-14)
    big = np.array([np.iinfo(np.int64).max, np.iinfo(np.int64).min, 5], np.int64)
    xb = m.from_numpy(big)
    assert m.to_numpy(m.reduce_max(xb)) == big.max()
    assert m.to_numpy(m.reduce_min(xb)) == big.min()


@pytest.mark.gpu
def test_pool_blocks_are_returned(m):
    rng = np.random.default_rng(9249)
    x, _ = make(m, (5, 1 << 18), DT.FLOAT32, rng)
    y, _ = make(m, (2, 3, 5), DT.FLOAT32, rng)
    pool = m.backend.memory_pools[x.device_id]
    m.reduce_sum(x, axis=-1).free()  # the ticket counters are made once per device
    m.reduce_sum(y, axis=(0, 2)).free()
    before = pool.get_stats()["active_memory"]
    for _ in range(3):
        m.reduce_sum(x, axis=-1).free()
        m.reduce_mean(y, axis=(0, 2)).free()  # two passes with an intermediate
        m.argmax(x, axis=0).free()
    assert pool.get_stats()["active_memory"] == before
    x.free(), y.free()


# -- argmax ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name_str)
def test_argmax_ties_first_occurrence(m, dtype):
    rng = np.random.default_rng(9829)
    for shape, axis, keepdims in [((1,), None, False), ((13,), 0, True), ((13, 17), None, True),
                                  ((13, 17), 0, False), ((13, 17), -1, False),
                                  ((3, 5, 7), 1, False), ((2 ** 20 + 3,), None, False),
                                  ((4, 5000), -1, False), ((5000, 6), 0, False)]:
        # small integers: many ties, so the first occurrence matters
        values = rng.integers(-3, 4, size=shape)
        x = m.from_numpy(values.astype(host_dtype(dtype)), dtype=dtype)
        a = m.to_numpy(x)
        out = poisoned(m, np.argmax(a, axis=axis, keepdims=keepdims).shape, DT.INT64)
        got = red.argmax(m, x, axis, keepdims, out=out)
        assert got.dtype is DT.INT64
        np.testing.assert_array_equal(m.to_numpy(got), np.argmax(a, axis=axis, keepdims=keepdims),
                                      err_msg=f"{shape} axis={axis}")
        x.free(), out.free()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16])
def test_argmax_nan_and_inf(m, dtype):
    rng = np.random.default_rng(6387)
    a = rng.standard_normal((6, 3000)).astype(np.float32)
    a[0, 2900] = np.nan
    a[0, 10] = np.inf
    a[1, 5] = a[1, 2999] = np.nan  # first NaN wins
    a[2, :] = -np.inf
    a[3, 17] = a[3, 1700] = np.inf
    a[4, :] = np.nan
    x = m.from_numpy(a, dtype=dtype)
    h = m.to_numpy(x)
    for axis in (None, -1, 0):
        np.testing.assert_array_equal(m.to_numpy(m.argmax(x, axis=axis)), np.argmax(h, axis=axis))
    big = rng.standard_normal(1 << 21).astype(np.float32)
    big[[12345, 999999, 2000000]] = np.nan
    xb = m.from_numpy(big, dtype=dtype)
    assert int(m.to_numpy(m.argmax(xb))) == 12345


# -- NaN / Inf / empty ---------------------------------------------------------------------
def test_nan_and_inf_propagate_like_numpy(m):
    a = np.array([[1.0, np.nan, 3.0], [np.inf, 1.0, -np.inf], [-np.inf, -np.inf, -np.inf],
                  [np.inf, 2.0, 5.0]], np.float32)
    for dtype in (DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16):
        x = m.from_numpy(a, dtype=dtype)
        h = m.to_numpy(x)
        for op in OPS:
            for axis in (None, 0, 1):
                with warnings.catch_warnings(), np.errstate(all="ignore"):
                    warnings.simplefilter("ignore", RuntimeWarning)
                    ref = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[op](
                        h.astype(np.float64), axis=axis)
                np.testing.assert_array_equal(np.isnan(m.to_numpy(run_op(m, op, x, axis))),
                                              np.isnan(ref), err_msg=f"{op} {axis}")
                got = m.to_numpy(run_op(m, op, x, axis)).astype(np.float64)
                np.testing.assert_array_equal(got[np.isinf(ref)], ref[np.isinf(ref)])


def test_empty_reductions(m):
    for dtype in (DT.FLOAT32, DT.BFLOAT16, DT.INT32):
        x = m.create_tensor((3, 0), dtype)
        s = m.reduce_sum(x, axis=1)
        assert s.shape == (3,) and np.all(m.to_numpy(s) == 0)
        assert s.dtype is rcfg.result_dtype(dtype, "sum")
        mean = m.reduce_mean(x, axis=1)
        assert mean.shape == (3,) and np.all(np.isnan(m.to_numpy(mean)))
        assert m.reduce_sum(x).shape == () and m.to_numpy(m.reduce_sum(x)) == 0
        assert m.reduce_sum(x, axis=0, keepdims=True).shape == (1, 0)
        assert m.reduce_max(x, axis=0).shape == (0,)  # a non-empty axis: no error, like NumPy
        for op in ("max", "min"):
            with pytest.raises(cb.InvalidArgumentError, match="zero-size reduction.*no identity"):
                run_op(m, op, x, axis=1)
            with pytest.raises(cb.InvalidArgumentError, match="no identity"):
                run_op(m, op, x)
        with pytest.raises(cb.InvalidArgumentError, match="argmax of an empty sequence"):
            m.argmax(x)
        assert m.argmax(x, axis=0).shape == (0,)
        with pytest.raises(ValueError):  # the typed errors are ValueErrors too
            m.argmax(x, axis=1)


def test_no_axes_is_a_converting_copy(m):
    rng = np.random.default_rng(1270)
    x, a = make(m, (3, 4), DT.INT32, rng)
    s = m.reduce_sum(x, axis=())
    assert s.dtype is DT.INT64 and s.shape == (3, 4)
    np.testing.assert_array_equal(m.to_numpy(s), a)
    mean = m.reduce_mean(x, axis=())
    assert mean.dtype is DT.FLOAT64
    np.testing.assert_array_equal(m.to_numpy(mean), a.astype(np.float64))
    y, b = make(m, (5, 1, 3), DT.FLOAT32, rng)
    np.testing.assert_array_equal(m.to_numpy(m.reduce_max(y, axis=1)), b[:, 0, :])


def test_zero_d_tensor(m):
    x = m.from_numpy(np.array(2.5, np.float32))
    for op in OPS:
        r = run_op(m, op, x)
        assert r.shape == () and float(m.to_numpy(r)) == 2.5
    assert int(m.to_numpy(m.argmax(x))) == 0


# -- errors ---------------------------------------------------------------------------------
def test_errors_name_what_was_wrong(m):
    rng = np.random.default_rng(993)
    x, _ = make(m, (3, 4), DT.FLOAT32, rng)
    with pytest.raises(cb.InvalidArgumentError, match=r"axis 2 .*valid: -2\.\.1"):
        m.reduce_sum(x, axis=2)
    with pytest.raises(cb.InvalidArgumentError, match=r"axis -3 .*valid: -2\.\.1"):
        m.reduce_max(x, axis=(0, -3))
    with pytest.raises(cb.InvalidArgumentError, match="repeated axis"):
        m.reduce_sum(x, axis=(1, -1))
    with pytest.raises(cb.InvalidArgumentError, match="axis must be an int"):
        m.reduce_sum(x, axis=1.5)
    with pytest.raises(cb.InvalidArgumentError, match=r"argmax takes one axis"):
        m.argmax(x, axis=(0, 1))
    with pytest.raises(cb.InvalidArgumentError, match=r"valid: -2\.\.1"):
        m.argmax(x, axis=5)
    with pytest.raises(cb.InvalidArgumentError, match="unknown reduction 'prod'"):
        red.reduce(m, "prod", x)
    with pytest.raises(cb.InvalidArgumentError, match="must be a CudaTensor"):
        m.reduce_sum(np.ones(3))
    for dtype in (DT.UINT8, DT.BOOL):
        bad = m.create_tensor((4,), dtype)
        with pytest.raises(cb.DTypeMismatchError, match=f"does not support {dtype.name_str}"):
            m.reduce_sum(bad)
        with pytest.raises(cb.DTypeMismatchError, match="argmax does not support"):
            m.argmax(bad)
    wrong = m.create_tensor((4,), DT.FLOAT64)
    with pytest.raises(cb.DTypeMismatchError, match="out has dtype float64.*float32"):
        red.reduce(m, "sum", x, 0, out=wrong)
    with pytest.raises(cb.DTypeMismatchError, match="out has dtype float32.*int64"):
        red.argmax(m, x, 0, out=m.create_tensor((4,), DT.FLOAT32))
    with pytest.raises(cb.ShapeMismatchError, match=r"out has shape \(4,\).*\(3,\)"):
        red.reduce(m, "sum", x, 1, out=m.create_tensor((4,), DT.FLOAT32))
    ints = m.create_tensor((3,), DT.INT32)
    with pytest.raises(cb.DTypeMismatchError, match="int64"):
        red.reduce(m, "sum", m.from_numpy(np.ones((3, 2), np.int32)), 1, out=ints)
    x.free()
    for fn in (m.reduce_sum, m.reduce_mean, m.reduce_max, m.reduce_min, m.argmax):
        with pytest.raises(cb.TensorFreedError):
            fn(x)


def test_errors_leave_the_pool_unchanged(m):
    rng = np.random.default_rng(2591)
    x, _ = make(m, (5, 6), DT.FLOAT32, rng)
    wrong = m.create_tensor((5,), DT.INT32)
    pool = m.backend.memory_pools[x.device_id]
    before = pool.get_stats()["active_memory"]
    for call in (lambda: m.reduce_sum(x, axis=3), lambda: m.reduce_max(x, axis=(0, 0)),
                 lambda: red.reduce(m, "sum", x, 1, out=wrong),
                 lambda: m.reduce_min(m.create_tensor((0, 2)), axis=0)):
        with pytest.raises(cb.CudaBackendError):
            call()
    assert pool.get_stats()["active_memory"] == before


# -- CPU: the same API in whatever mode the backend runs ---------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name_str)
def test_api_matches_numpy_small(m, dtype):
    rng = np.random.default_rng(1752)
    for op in OPS:
        for shape, axis, keepdims in CASES[:13]:
            x, a = make(m, shape, dtype, rng)
            r = run_op(m, op, x, axis, keepdims)
            assert r.dtype is rcfg.result_dtype(dtype, op)
            check(op, dtype, m.to_numpy(r), a, axis, keepdims, f"{op} {shape} {axis}")
    x, _ = make(m, (13, 17), dtype, rng)
    a = m.to_numpy(x)
    np.testing.assert_array_equal(m.to_numpy(m.argmax(x, axis=1)), np.argmax(a, axis=1))
    assert m.argmax(x, keepdims=True).shape == (1, 1)


def test_result_dtypes_follow_numpy():
    for dtype in DTYPES:
        for op in OPS:
            got = rcfg.result_dtype(dtype, op)
            if dtype in (DT.FLOAT16, DT.BFLOAT16):
                assert got is dtype
                continue
            ref = getattr(np, op)(np.ones(2, dtype.numpy_dtype)).dtype
            assert got.numpy_dtype == ref, (dtype, op)


def test_collapse_and_plan_passes():
    assert rcfg.collapse((2, 3, 4, 5), (1, 2)) == [[2, False], [12, True], [5, False]]
    assert rcfg.collapse((1, 13, 1, 17), (0, 2)) == [[221, False]]
    assert rcfg.plan_passes((2, 3, 4, 5), (1, 2)) == [(2, 12, 5)]
    assert rcfg.plan_passes((2, 3, 4, 5), (1, 3)) == [(24, 5, 1), (2, 3, 4)]
    assert rcfg.plan_passes((3, 5, 7), (0, 2)) == [(15, 7, 1), (1, 3, 5)]
    assert rcfg.plan_passes((4, 6), ()) == [(24, 1, 1)]
    assert rcfg.plan_passes((4, 1), (1,)) == [(4, 1, 1)]
    assert rcfg.plan_passes((1 << 28,), (0,)) == [(1, 1 << 28, 1)]


H100 = CudaDeviceInfo(device_id=0, name="stub H100", compute_capability=(9, 0),
                      memory_total=80 << 30, multiprocessor_count=132)


def test_rows_config_covers_rows_and_fills_the_gpu():
    wave = 132 * 5
    for rows, R, itemsize in [(1, 1, 4), (1000, 7, 4), (5, 1024, 4), (3, 1025, 4),
                              (1, 1 << 28, 4), (1 << 14, 1 << 14, 4), (64, 1 << 16, 2),
                              (1 << 20, 1, 8)]:
        group, splits, grid = rcfg.rows_config(rows, R, itemsize, wave)
        assert group == rcfg.BLOCK or (1 <= group <= 32 and group & (group - 1) == 0)
        if group <= 32:  # short rows only, every row covered
            assert splits == 1 and grid * (rcfg.BLOCK // group) >= rows
            assert R <= 32 * (16 // itemsize) * 8
        else:
            assert grid == rows * splits and 1 <= splits <= wave
            assert splits == 1 or rows <= rcfg.MAX_SPLIT_GROUPS
    assert rcfg.rows_config(1, 1 << 28, 4, wave)[1] == wave  # a full reduction: one wave
    # a row worth fewer than MIN_SPLITS blocks of UNROLL vectors a thread runs on one block
    per_block = rcfg.BLOCK * rcfg.UNROLL
    assert rcfg.rows_config(1, 4096, 8, wave)[1:] == (1, 1)          # 2 blocks' worth
    assert rcfg.rows_config(1, 2 * per_block * 2 + 2, 8, wave)[1] == 1
    assert rcfg.rows_config(1, rcfg.MIN_SPLITS * per_block * 4, 4, wave)[1] == rcfg.MIN_SPLITS


def test_axis_config_shapes():
    wave = 132 * 8
    for outer, R, inner, itemsize, aligned in [(1, 13, 17, 4, True), (1, 1 << 20, 3, 4, True),
                                               (3, 5, 7, 8, True), (1, 4096, 4096, 4, True),
                                               (1 << 16, 3, 64, 2, True), (7, 100, 12, 4, False),
                                               (1, 2, 1 << 22, 4, True)]:
        c = rcfg.axis_config(outer, R, inner, itemsize, aligned, wave)
        w = 16 // itemsize if c["vec_on"] else 1
        assert c["bx"] * c["by"] <= rcfg.BLOCK and c["width"] == c["bx"] * w
        assert c["tiles"] * c["width"] >= inner and (c["tiles"] - 1) * c["width"] < inner
        assert c["splits"] * c["rows_per_split"] >= R
        assert (c["splits"] - 1) * c["rows_per_split"] < R
        assert c["splits"] <= 65535 and c["groups"] == outer * c["tiles"]
        assert not c["vec_on"] or (aligned and inner % (16 // itemsize) == 0)
        if c["splits"] > 1:
            assert c["groups"] <= rcfg.MAX_SPLIT_GROUPS


def test_resident_blocks():
    class K:
        num_regs, static_shared_bytes = 40, 0
    assert rcfg.resident_blocks(K, H100, 256) == 6  # 40 regs -> 10240 regs a block
    K.num_regs = 32
    assert rcfg.resident_blocks(K, H100, 256) == 8
    K.static_shared_bytes = 32 * 1024
    assert rcfg.resident_blocks(K, H100, 256) >= 1


def test_template_variants_are_listed_once():
    v = red.template_variants()
    assert set(v) == {"reduce.cu.j2", "reduce_axis.cu.j2"}
    for sets in v.values():
        assert len(sets) == 26
        assert len({tuple(sorted(p.items())) for p in sets}) == len(sets)


# -- property test --------------------------------------------------------------------------
@pytest.mark.gpu
@settings(max_examples=examples(40), deadline=None)
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=4),
       data=st.data(), op=st.sampled_from(OPS + ["argmax"]),
       dtype=st.sampled_from([DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.INT32]),
       keepdims=st.booleans())
def test_property_any_axes(m, shape, data, op, dtype, keepdims):
    ndim = len(shape)
    rng = np.random.default_rng(3069)
    x, a = make(m, tuple(shape), dtype, rng)
    if op == "argmax":
        axis = data.draw(st.one_of(st.none(), st.integers(-ndim, ndim - 1)))
        np.testing.assert_array_equal(m.to_numpy(m.argmax(x, axis=axis, keepdims=keepdims)),
                                      np.argmax(a, axis=axis, keepdims=keepdims))
    else:
        axes = data.draw(st.lists(st.integers(0, ndim - 1), unique=True))
        axis = None if len(axes) == ndim and data.draw(st.booleans()) else tuple(axes)
        check(op, dtype, m.to_numpy(run_op(m, op, x, axis, keepdims)), a, axis, keepdims,
              f"{op} {shape} {axis}")
    x.free()


# -- per-call plans (ops/common.py): the second call of a shape goes through m.plans ----------
@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS + ["argmax"])
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT16, DT.FLOAT64, DT.INT32],
                         ids=lambda d: d.name_str)
def test_plan_path_matches_numpy(m, op, dtype):
    """Each call on fresh random inputs of odd shapes: the first through the general path
    (which keeps the plan), the second through the plan; both against float64 NumPy. Shapes
    cover rows, a middle axis, two passes, split launches (partials, ticket counters) and a
    view one element past an aligned pointer."""
    rng = np.random.default_rng(363)
    cases = [((37, 53), 1, False), ((37, 53), None, False), ((129, 40), 0, True),
             ((5, 7, 9), -1, False), ((3, 4097), -1, False), ((4099, 3), 0, False),
             ((5, 66, 8), 1, False)]
    if op != "argmax":
        cases += [((5, 7, 9), (0, 2), True), ((2, 3, 4, 5), (1, 3), False)]
    for shape, axis, keepdims in cases:
        name = "argmax" if op == "argmax" else "reduce_" + op
        key = (name, shape, dtype, axis, keepdims, 0)
        m.plans.pop(key, None)
        for i in range(3):
            base = None
            if i < 2:
                x, a = make(m, shape, dtype, rng)
            else:   # a view one element past an aligned pointer
                x, base, a = view_past_aligned(m, make, shape, dtype, rng)
            if i:
                assert key in m.plans, key
                assert m.backend.direct_launch(x.device_id)
                taken = spy_plan(m, key)
            if op == "argmax":
                got = m.to_numpy(m.argmax(x, axis=axis, keepdims=keepdims))
                np.testing.assert_array_equal(got, np.argmax(a, axis=axis, keepdims=keepdims),
                                              err_msg=f"{shape} axis={axis}")
            else:
                check(op, dtype, m.to_numpy(run_op(m, op, x, axis, keepdims)), a, axis,
                      keepdims, f"{op} {shape} axis={axis} call {i}")
            if i:
                assert taken == [True], (key, taken)
            x.free()
            if base is not None:
                base.free()
