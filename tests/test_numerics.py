"""Numerics: NaN and Inf propagate as NumPy does, through elementwise ops,
reductions, softmax / log_softmax, layer_norm, matmul (and max-pooling and dropout).

Each result is compared with NumPy on the same (dtype-rounded) inputs: the NaN, +Inf and -Inf
masks must be equal, and the finite values close. Nothing here is marked `gpu`: the tests run
in whatever mode the `backend` fixture is in (NumPy fallback without a GPU, the kernels on one),
with shapes chosen to reach the kernels' different paths (warp / shared-memory / online
softmax rows, split reductions, layer_norm's looping kernel).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from cuda_backend import CudaDataType as DT

NAN, INF = np.nan, np.inf
# Fallback mode computes float16 ops in float32 and casts the result outside its
# np.errstate, so an overflow to inf also emits NumPy's RuntimeWarning (a package bug,
# reported); the values are what is checked here, so those warnings are silenced.
# The same holds for the NumPy fallbacks of layer_norm, matmul and dropout, which compute
# without np.errstate (elementwise, reductions, softmax and pooling use it).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:cuda_backend")
# (rtol, atol) for finite values
TOL = {DT.FLOAT32: (1e-5, 1e-6), DT.FLOAT64: (1e-12, 1e-14), DT.FLOAT16: (2e-3, 1e-3),
       DT.BFLOAT16: (1.6e-2, 1e-2)}


@pytest.fixture(scope="module")
def m(backend):
    from cuda_backend.cuda_math import get_cuda_math
    return get_cuda_math()


@pytest.fixture(scope="module")
def ml(backend):
    from cuda_backend.cuda_ml import get_cuda_ml
    return get_cuda_ml()


def assert_same_specials(got, ref, dtype, what="", tol=None):
    """NaN, +Inf and -Inf at the same places as NumPy; finite values close."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    for name, fn in (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf)):
        np.testing.assert_array_equal(fn(got), fn(ref), err_msg=f"{what}: {name} mask differs")
    finite = np.isfinite(ref)
    rtol, atol = tol or TOL[dtype]
    np.testing.assert_allclose(got[finite], ref[finite], rtol=rtol, atol=atol,
                               err_msg=f"{what}: finite values differ")


def numpy_ref(fn, *args):
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fn(*args)


def special_values(dtype):
    """NaN, infinities, signed zeros, ordinary values, and values whose sum or product
    overflows in this dtype."""
    big = float(np.finfo(np.float16 if dtype is DT.FLOAT16 else
                         np.float32 if dtype in (DT.FLOAT32, DT.BFLOAT16) else
                         np.float64).max) / 2
    return np.array([NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0, 2.5, big * 1.5, -big * 1.5, 1e-3])


def upload(m, values, dtype):
    """(tensor, the values it holds as float64): the reference uses the rounded inputs."""
    t = m.from_numpy(np.asarray(values, dtype=np.float64), dtype=dtype)
    return t, m.to_numpy(t).astype(np.float64)


def np_dtype(dtype):
    """The NumPy scalar type results are computed in (bfloat16 has none: float32)."""
    return np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype.type


ELEM_DTYPES = [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16]


# -- elementwise ------------------------------------------------------------------------------
BINARY = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply,
          "divide": np.divide, "maximum": np.maximum, "minimum": np.minimum}


@pytest.mark.parametrize("dtype", ELEM_DTYPES, ids=lambda d: d.name_str)
@pytest.mark.parametrize("op", list(BINARY))
def test_binary_all_pairs_of_special_values(m, op, dtype):
    s = special_values(dtype)
    a, b = np.repeat(s, s.size), np.tile(s, s.size)        # every (a, b) pair
    ta, ha = upload(m, a, dtype)
    tb, hb = upload(m, b, dtype)
    nd = np_dtype(dtype)
    got = m.to_numpy(getattr(m, op)(ta, tb))
    ref = numpy_ref(BINARY[op], ha.astype(nd), hb.astype(nd))
    assert_same_specials(got, ref, dtype, f"{op}({dtype.name_str})")


@pytest.mark.parametrize("dtype", ELEM_DTYPES, ids=lambda d: d.name_str)
@pytest.mark.parametrize("op,scalar", [("add", NAN), ("add", -INF), ("multiply", INF),
                                       ("multiply", 0.0), ("divide", 0.0), ("divide", -0.0),
                                       ("maximum", NAN), ("minimum", NAN), ("maximum", -INF),
                                       ("subtract", INF)])
def test_binary_with_special_scalar(m, op, scalar, dtype):
    t, h = upload(m, special_values(dtype), dtype)
    nd = np_dtype(dtype)
    for got, ref, order in (
            (getattr(m, op)(t, scalar), numpy_ref(BINARY[op], h.astype(nd), nd(scalar)), "t op s"),
            (getattr(m, op)(scalar, t), numpy_ref(BINARY[op], nd(scalar), h.astype(nd)), "s op t")):
        assert_same_specials(m.to_numpy(got), ref, dtype, f"{op} {order} with {scalar}")


def test_divide_by_zero(m):
    a = np.array([1.0, -1.0, 0.0, -0.0, NAN, INF, -INF, 3.0], np.float32)
    b = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.0, -0.0], np.float32)
    got = m.to_numpy(m.divide(m.from_numpy(a), m.from_numpy(b)))
    ref = numpy_ref(np.divide, a, b)     # [inf, -inf, nan, nan, nan, inf, inf, -inf]
    assert_same_specials(got, ref, DT.FLOAT32, "divide by zero")
    assert np.isposinf(got[0]) and np.isneginf(got[1]) and np.isneginf(got[7])


UNARY = {
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "abs": np.abs, "negative": np.negative,
    "tanh": np.tanh, "relu": lambda x: np.maximum(x, x.dtype.type(0)),
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
}


@pytest.mark.parametrize("dtype", ELEM_DTYPES, ids=lambda d: d.name_str)
@pytest.mark.parametrize("op", list(UNARY))
def test_unary_special_values(m, op, dtype):
    # -1 and -inf: log and sqrt of negatives are NaN; 0 and -0: log gives -inf;
    # 100 and -100: exp overflows to inf / underflows to 0
    vals = np.array([NAN, INF, -INF, 0.0, -0.0, -1.0, -2.5, 1.0, 4.0, 100.0, -100.0, 1e-3])
    t, h = upload(m, vals, dtype)
    got = m.to_numpy(getattr(m, op)(t))
    ref = numpy_ref(UNARY[op], h.astype(np_dtype(dtype)))
    assert_same_specials(got, ref, dtype, f"{op}({dtype.name_str})")


def test_sqrt_of_negative_and_log_of_zero(m):
    x = m.from_numpy(np.array([-1.0, -INF, -0.0, 0.0, 4.0], np.float32))
    s = m.to_numpy(m.sqrt(x))
    lg = m.to_numpy(m.log(x))
    assert np.isnan(s[0]) and np.isnan(s[1]) and s[4] == 2.0
    assert np.isnan(lg[0]) and np.isnan(lg[1]) and np.isneginf(lg[2]) and np.isneginf(lg[3])


# -- reductions ---------------------------------------------------------------------------------
def reduction_rows(n):
    """Rows of length n, each with a different mix of specials, plus an ordinary row."""
    rng = np.random.default_rng(n)
    rows = rng.standard_normal((9, n))
    rows[0, n // 2] = NAN                         # one NaN
    rows[1, -1] = INF                             # one +inf (at the end)
    rows[2, 0] = -INF                             # one -inf
    rows[3, 0], rows[3, -1] = INF, -INF           # +inf and -inf: sum NaN, max inf, min -inf
    rows[4, :] = -INF                             # all -inf
    rows[5, n // 3] = NAN                         # NaN and inf: NaN wins
    rows[5, 0] = INF
    rows[6, :] = NAN                              # all NaN
    rows[7, n - 1] = NAN                          # NaN last (after the maximum)
    return rows                                   # row 8: ordinary


RED = {"reduce_sum": np.sum, "reduce_max": np.max, "reduce_min": np.min,
       "reduce_mean": np.mean}


@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16], ids=lambda d: d.name_str)
@pytest.mark.parametrize("n", [5, 1000, 1 << 17], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("op", list(RED))
def test_reductions_propagate(m, op, n, dtype):
    t, h = upload(m, reduction_rows(n), dtype)
    # half inputs accumulate in float32 (as the kernels do), the rest in their own dtype
    acc = np.float32 if dtype is DT.FLOAT16 else np_dtype(dtype)
    tol = (1e-3, 1e-3) if dtype is not DT.FLOAT64 else (1e-10, 1e-10)
    for axis in (1, 0, None):
        got = m.to_numpy(getattr(m, op)(t, axis=axis))
        ref = numpy_ref(RED[op], h.astype(acc), axis)
        assert_same_specials(got, ref, dtype, f"{op} axis={axis} n={n}", tol=tol)
    # one row at a time, so a long row is reduced by several blocks (split) on a GPU
    for i in range(h.shape[0]):
        row = m.from_numpy(h[i].astype(np_dtype(dtype)), dtype=dtype)
        got = m.to_numpy(getattr(m, op)(row))
        ref = numpy_ref(RED[op], h[i].astype(acc))
        assert_same_specials(got, ref, dtype, f"{op} of row {i} (n={n})", tol=tol)


@pytest.mark.parametrize("n", [5, 1000, 1 << 17], ids=lambda n: f"n{n}")
def test_argmax_with_nan_is_first_nan(m, n):
    h = reduction_rows(n).astype(np.float32)
    t = m.from_numpy(h)
    np.testing.assert_array_equal(m.to_numpy(m.argmax(t, axis=1)), np.argmax(h, axis=1))
    np.testing.assert_array_equal(m.to_numpy(m.argmax(t, axis=0)), np.argmax(h, axis=0))
    assert int(m.to_numpy(m.argmax(t))) == int(np.argmax(h))
    for i in range(h.shape[0]):
        got = int(m.to_numpy(m.argmax(m.from_numpy(h[i]))))
        assert got == int(np.argmax(h[i])), f"row {i}: argmax {got}, NumPy {np.argmax(h[i])}"


# -- softmax ------------------------------------------------------------------------------------
def softmax_rows(k):
    rng = np.random.default_rng(k)
    rows = rng.standard_normal((7, k)) * 3
    rows[0, :] = -INF                     # all -inf: NaN (NumPy: -inf - -inf)
    rows[1, k // 2] = INF                 # one +inf: NaN everywhere (inf - inf)
    rows[2, :] = INF                      # all +inf: NaN
    rows[3, k - 1] = NAN                  # one NaN: NaN everywhere
    if k > 1:
        rows[4, ::2] = -INF               # some -inf in a finite row: 0 there (log: -inf)
    rows[5, 0] = 1e4                      # a huge value: one 1, the rest 0
    return rows                           # row 6: ordinary


def softmax_ref(x, log):
    def f(x):
        mx = x.max(axis=-1, keepdims=True)
        z = x - mx
        s = np.exp(z).sum(axis=-1, keepdims=True)
        return z - np.log(s) if log else np.exp(z) / s
    return numpy_ref(f, x.astype(np.float64))


@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16],
                         ids=lambda d: d.name_str)
@pytest.mark.parametrize("k", [1, 7, 1500, 70_000], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_special_rows(m, k, dtype, log):
    t, h = upload(m, softmax_rows(k), dtype)
    got = m.to_numpy(m.log_softmax(t) if log else m.softmax(t))
    ref = softmax_ref(h, log)
    rtol, atol = TOL[dtype]
    assert_same_specials(got, ref, dtype, f"{'log_' if log else ''}softmax k={k}",
                         tol=(max(rtol, 1e-5), max(atol, 1e-6) * (10 if log else 1)))
    if k > 1:
        assert np.isnan(got[0]).all() and np.isnan(got[1]).all() and np.isnan(got[3]).all()


def test_softmax_minus_inf_row_is_nan_not_garbage(m):
    x = m.from_numpy(np.full((3, 5), -INF, np.float32))
    assert np.isnan(m.to_numpy(m.softmax(x))).all()
    assert np.isnan(m.to_numpy(m.log_softmax(x))).all()


# -- layer norm ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16], ids=lambda d: d.name_str)
@pytest.mark.parametrize("d", [8, 1000, 40_000], ids=lambda d: f"d{d}")
def test_layer_norm_special_rows(m, ml, d, dtype):
    rng = np.random.default_rng(d)
    x = rng.standard_normal((5, d))
    x[0, d // 2] = NAN                   # NaN row stays NaN
    x[1, 0] = INF                        # inf - inf in the mean: NaN row
    x[2, :] = -INF                       # all -inf: NaN row
    # rows 3, 4: ordinary, and must stay untouched by their neighbours
    w = rng.standard_normal(d)
    b = rng.standard_normal(d)
    tx, hx = upload(m, x, dtype)
    tw, hw = upload(m, w, dtype)
    tb, hb = upload(m, b, dtype)
    got = m.to_numpy(ml.layer_norm(tx, tw, tb, eps=1e-5))

    def ref_fn(a):
        mu = a.mean(axis=-1, keepdims=True)
        dd = a - mu
        var = (dd * dd).mean(axis=-1, keepdims=True)
        return dd / np.sqrt(var + 1e-5) * hw + hb
    ref = numpy_ref(ref_fn, hx)
    tol = {DT.FLOAT32: (1e-4, 1e-4), DT.FLOAT64: (1e-10, 1e-10), DT.FLOAT16: (1e-2, 2e-2)}[dtype]
    assert_same_specials(got, ref, dtype, f"layer_norm d={d}", tol=tol)
    assert np.isnan(got[:3]).all() and np.isfinite(got[3:]).all()


# -- matmul -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,precision", [(DT.FLOAT32, None), (DT.FLOAT32, "tf32"),
                                             (DT.FLOAT64, None), (DT.FLOAT16, None)],
                         ids=["float32", "float32-tf32", "float64", "float16"])
@pytest.mark.parametrize("shape", [(5, 7, 3), (70, 130, 90), (33, 600, 17)],
                         ids=lambda s: "x".join(map(str, s)))
def test_matmul_nan_and_inf(m, shape, dtype, precision):
    M, K, N = shape
    rng = np.random.default_rng(M * K * N)
    a = rng.uniform(0.5, 1.5, (M, K)) * rng.choice([-1, 1], (M, K))
    b = rng.uniform(0.5, 1.5, (K, N)) * rng.choice([-1, 1], (K, N))
    a[1, K // 2] = NAN            # row 1 of the output: NaN
    a[M - 1, 0] = INF             # last row: +-inf by the signs of b[0, :]
    b[K - 1, N // 2] = NAN        # column N//2: NaN
    ta, ha = upload(m, a, dtype)
    tb, hb = upload(m, b, dtype)
    got = m.to_numpy(m.matrix_multiply(ta, tb, precision=precision))
    ref = numpy_ref(np.matmul, ha, hb)
    tol = {DT.FLOAT32: (1e-4, 1e-4) if precision is None else (5e-3, 5e-2),
           DT.FLOAT64: (1e-10, 1e-10), DT.FLOAT16: (1e-2, 1e-1)}[dtype]
    assert_same_specials(got, ref, dtype, f"matmul {shape}", tol=tol)
    assert np.isnan(got[1]).all() and np.isnan(got[:, N // 2]).all()
    assert np.isinf(np.delete(got[M - 1], N // 2)).all()


def test_batched_matmul_nan_stays_in_its_batch(m):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((3, 4, 5)).astype(np.float32)
    b = rng.standard_normal((3, 5, 6)).astype(np.float32)
    a[1, 2, 3] = NAN
    got = m.to_numpy(m.matrix_multiply(m.from_numpy(a), m.from_numpy(b)))
    ref = numpy_ref(np.matmul, a, b)
    assert_same_specials(got, ref, DT.FLOAT32, "batched matmul", tol=(1e-4, 1e-5))
    assert np.isnan(got[1, 2]).all() and np.isfinite(np.delete(got[1], 2, axis=0)).all()
    assert np.isfinite(got[0]).all() and np.isfinite(got[2]).all()


# -- pooling and dropout (documented to propagate NaN) -----------------------------------------
def test_max_pool_propagates_nan_and_inf(m, ml):
    x = np.arange(2 * 3 * 6 * 6, dtype=np.float32).reshape(2, 3, 6, 6)
    x[0, 0, 1, 1] = NAN
    x[1, 2, 4, 5] = INF
    x[0, 1, :2, :2] = -INF
    got = m.to_numpy(ml.max_pool2d(m.from_numpy(x), 2))
    win = x.reshape(2, 3, 3, 2, 3, 2)
    ref = numpy_ref(lambda w: w.max(axis=(3, 5)), win)
    assert_same_specials(got, ref, DT.FLOAT32, "max_pool2d")
    assert np.isnan(got[0, 0, 0, 0]) and np.isposinf(got[1, 2, 2, 2])


def test_dropout_keeps_nan_and_inf_where_they_were(m, ml):
    x = np.ones(4096, np.float32)
    x[::7] = NAN
    x[3::11] = INF
    y, mask = ml.dropout(m.from_numpy(x), keep_prob=0.5, seed=1234, return_mask=True)
    y, mask = m.to_numpy(y), m.to_numpy(mask).astype(bool)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(x) | (np.isinf(x) & ~mask))
    np.testing.assert_array_equal(np.isposinf(y), np.isposinf(x) & mask)
    assert ((y == 0) == (~mask & np.isfinite(x))).all()
