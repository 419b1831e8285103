"""Backward kernels: activation gradients (ops/activation_backward.py), softmax / log_softmax
backward (ops/softmax_backward.py) and the fused cross-entropy with its gradient
(ops/cross_entropy.py), against float64 references written here, finite differences of the
forward functions, and PyTorch's autograd when torch is importable.

Bounds are derived, not tuned: with u the unit roundoff of the math type (2^-24 for float32
and the half types, which compute in float32; 2^-53 for float64) and u_out that of the
storage (2^-11 float16, 2^-8 bfloat16), |ours - ref| <= u_out |ref| (the one rounding on
store) + c u (a condition number of the formula: the magnitudes of its terms, the depth of
the sums, |x - max| for exp's argument) + a floor for subnormal outputs. Tests marked `gpu`
run the kernels (odd shapes, every candidate plan at the mode boundaries, misaligned
pointers, large logits); the rest run in whatever mode the backend is in (NumPy fallback
without a GPU).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import (ATOL, EPS64, FLOATS, U_ACC, U_OUT, call_through_plan, check, host_dtype,
                     make, misaligned, poisoned)

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend.cuda_math import CudaMath
from cuda_backend.cuda_ml import CudaML
from cuda_backend.driver import load_driver
from cuda_backend.ops import activation_backward as ab
from cuda_backend.ops import cross_entropy as ce
from cuda_backend.ops import cross_entropy_plans as cep
from cuda_backend.ops import softmax_backward as sb

GPU = load_driver()[0] is not None
ROW_LENGTHS = [1, 7, 33, 1000, 4097, 33000]
ROW_COUNTS = [1, 5, 257]
ACT_OPS = ["relu", "leaky_relu", "elu", "gelu", "gelu_exact", "sigmoid", "tanh"]
C2 = 1.5957691216057308   # 2 sqrt(2 / pi)


@pytest.fixture(scope="module")
def apis(backend):
    m = CudaMath(backend)
    return m, CudaML(m)


def sum_depth(K):
    """Additions in sequence behind one of the kernels' row sums, any plan: at most 32 terms
    per lane in registers (K / 1024 + vec in loop mode), 5 butterfly levels and 32 warps."""
    return 80 + -(-K // 256)


# -- float64 references and their condition numbers ---------------------------------------
def _erfc(a):
    return np.vectorize(math.erfc, otypes=[np.float64])(a)


def ref_activation(op, g, v, a):
    """The gradient of op at v (x, or y for sigmoid / tanh) times g, float64."""
    with np.errstate(all="ignore"):
        if op == "relu":
            return np.where(v <= 0, 0.0, g)
        if op == "leaky_relu":
            return np.where(v > 0, g, a * g)
        if op == "elu":
            return np.where(v <= 0, a * g * np.exp(v), g)
        if op == "sigmoid":
            return g * (1 - v) * v
        if op == "tanh":
            return g * (1 - v * v)
        if op == "gelu":   # d/dx x sigmoid(z), z = C2 (x + 0.044715 x^3): s + x s (1 - s) z'
            z = C2 * (v + 0.044715 * v**3)
            s, q = 1 / (1 + np.exp(-z)), 1 / (1 + np.exp(z))
            return g * (s + np.where(s * q == 0, 0.0, v * s * q * C2 * (1 + 0.134145 * v * v)))
        cdf, pdf = 0.5 * _erfc(-v / math.sqrt(2)), np.exp(-v * v / 2) / math.sqrt(2 * math.pi)
        return g * (cdf + np.where(pdf == 0, 0.0, v * pdf))


def activation_bound(op, g, v, a, ref, dtype):
    """u_out |ref| + 16 u (|g| times the sum of |terms|, each times the error its math
    function brings: exp and erfc of an argument with a relative rounding grow it by
    |argument|, so gelu's by (1 + |z|), gelu_exact's by (1 + x^2))."""
    ag = np.abs(g)
    with np.errstate(all="ignore"):
        if op == "relu":
            mag = ag
        elif op == "leaky_relu":
            mag = ag * max(1.0, abs(a))
        elif op == "elu":
            mag = ag * (1 + abs(a) * np.exp(np.minimum(v, 0)))
        elif op == "sigmoid":
            mag = ag * np.abs(v) * (1 + np.abs(v))
        elif op == "tanh":
            mag = ag * (1 + v * v)
        elif op == "gelu":
            z = C2 * (v + 0.044715 * v**3)
            s, q = 1 / (1 + np.exp(-z)), 1 / (1 + np.exp(z))
            t2 = np.where(s * q == 0, 0.0, np.abs(v * s * q * C2 * (1 + 0.134145 * v * v)))
            mag = ag * (s + t2) * (1 + np.abs(z))
        else:
            cdf, pdf = 0.5 * _erfc(-v / math.sqrt(2)), np.exp(-v * v / 2) / math.sqrt(2 * math.pi)
            mag = ag * (cdf + np.abs(v) * pdf) * (1 + v * v)
    return U_OUT[dtype] * np.abs(ref) + 16 * U_ACC[dtype] * mag + ATOL[dtype]


def ref_softmax_backward(g, y, log):
    """(dx, bound terms): softmax dx = y (g - d), d = sum(g y); log_softmax dx = g - e^y d,
    d = sum(g)."""
    if log:
        d = g.sum(-1, keepdims=True)
        return g - np.exp(y) * d, d, np.abs(g).sum(-1, keepdims=True)
    d = (g * y).sum(-1, keepdims=True)
    return y * (g - d), d, np.abs(g * y).sum(-1, keepdims=True)


def softmax_backward_bound(g, y, log, dtype):
    """The sum d carries u * depth * S (S the sum of |terms|) plus one rounding per term;
    softmax: |y| (that + 4u (|g| + |d|)); log_softmax: e^y (that + (4 + 2|y|) u |d|) (exp of
    y, __expf for the half types: (2 + 1.2|y|) ulp) + 2u (|g| + e^y |d|)."""
    dx, d, S = ref_softmax_backward(g, y, log)
    u, K = U_ACC[dtype], g.shape[-1]
    gam = u * (sum_depth(K) + 2) * S
    if log:
        ey = np.exp(y)
        b = ey * (gam + (4 + 2 * np.abs(y)) * u * np.abs(d)) + 2 * u * (np.abs(g) + ey * np.abs(d))
    else:
        b = np.abs(y) * (gam + 4 * u * (np.abs(g) + np.abs(d)))
    return dx, b + U_OUT[dtype] * np.abs(dx) + ATOL[dtype]


def ce_stats(x, lab, ignore_index):
    """Per row: max, sum of exp(x - max), the exp-weighted mean |x - max| (Rw), the label's
    logit, which rows count (valid), float64."""
    N, C = x.shape
    with np.errstate(all="ignore"):
        mx = x.max(1)
        z = x - mx[:, None]
        e = np.exp(z)
        s = e.sum(1)
        rw = (e * np.abs(z)).sum(1) / s
    valid = lab != ignore_index
    xl = x[np.arange(N), np.clip(lab, 0, C - 1)]
    return mx, s, rw, xl, valid, e


def ref_ce_rows(x, lab, ignore_index):
    """(per-row loss, its bound terms) with the rows' statistics."""
    mx, s, rw, xl, valid, e = ce_stats(x, lab, ignore_index)
    loss = np.where(valid, np.log(s) + (mx - xl), 0.0)
    return loss, (mx, s, rw, xl, valid, e)


def ce_row_bound(stats, K, dtype, loss, stored=True):
    """log(s) + (max - x[label]): the sum s has relative error u (4 depth + 3 Rw + 8) (each
    term's exp of x - max and the rescalings of running sums on its way: 2 ulp + |x - max|
    rounded arguments, __expf's 1.17 |x - max| ulp for the half types; the adds), log and
    the two subtractions u each on their magnitudes; stored: rounded once to the dtype."""
    mx, s, rw, xl, valid, _ = stats
    u = U_ACC[dtype]
    b = u * (4 * sum_depth(K) + 3 * rw + 8 + 2 * np.abs(np.log(s)) + 2 * np.abs(mx - xl))
    if stored:
        b = b + U_OUT[dtype] * np.abs(loss)
    return np.where(valid, b, 0.0) + ATOL[dtype]


def ref_ce(x, lab, reduction, ignore_index, dtype):
    """(loss, bound): per row, or their mean / sum with the finish kernel's sum (depth
    N / 1024 + 40) on the rows' losses; the fused forward's last block of T threads (depth
    N / T + 5 + T / 32 for N <= 16 T rows, cross_entropy_plans.FUSE_ROWS_PER_THREAD) stays
    within it for every T of 128-1024."""
    loss, stats = ref_ce_rows(x, lab, ignore_index)
    rb = ce_row_bound(stats, x.shape[1], dtype, loss, stored=reduction == "none")
    if reduction == "none":
        return loss, rb
    u = U_ACC[dtype]
    total = loss.sum()
    b = rb.sum() + u * (x.shape[0] / 1024 + 42) * np.abs(loss).sum()
    if reduction == "mean":
        n = np.count_nonzero(stats[4])
        with np.errstate(all="ignore"):
            total, b = total / n, b / n + u * abs(total / n)
    return np.asarray(total), np.asarray(b + U_OUT[dtype] * abs(total) + ATOL[dtype])


def ref_ce_backward(x, lab, scale, ignore_index, dtype):
    """(dx, bound): (p - onehot) * scale_r on counted rows, 0 on the others; p's relative
    error is that of the sum (as ce_row_bound) plus (6 + 3|x - max|) u, the subtraction of
    1 and the scaling u each."""
    N, C = x.shape
    mx, s, rw, xl, valid, e = ce_stats(x, lab, ignore_index)
    p = e / s[:, None]
    onehot = np.zeros_like(p)
    onehot[np.arange(N)[valid], lab[valid]] = 1.0
    sc = np.broadcast_to(np.asarray(scale, np.float64), (N,))[:, None]
    u = U_ACC[dtype]
    rel_s = u * (4 * sum_depth(C) + 3 * rw + 8)[:, None]
    with np.errstate(invalid="ignore"):   # inf scale (no counted row) on rows not counted
        dx = np.where(valid[:, None], (p - onehot) * sc, 0.0)
        b = np.abs(sc) * (p * (rel_s + (6 + 3 * np.abs(x - mx[:, None])) * u) +
                          2 * u * np.abs(p - onehot)) + 4 * u * np.abs(dx)
        b = np.where(valid[:, None], b + U_OUT[dtype] * np.abs(dx), 0.0) + ATOL[dtype]
    return dx, b


def labels_for(rng, N, C, ignore_index=-100, frac_ignored=0.2, dtype=np.int64):
    lab = rng.integers(0, C, N)
    lab[rng.random(N) < frac_ignored] = ignore_index
    return lab.astype(dtype)


# -- activations: any mode ------------------------------------------------------------------
def act_input(op, rng, shape, scale=3.0):
    x = rng.standard_normal(shape) * scale
    if op == "sigmoid":
        return 1 / (1 + np.exp(-x))
    if op == "tanh":
        return np.tanh(x)
    return x


def call_act(ml, op, g, v, alpha=None):
    if op == "gelu_exact":
        return ml.gelu_backward(g, v, approximate="none")
    if op in ("leaky_relu", "elu"):
        return getattr(ml, f"{op}_backward")(g, v, alpha)
    return getattr(ml, f"{op}_backward")(g, v)


def default_alpha(op, dtype):
    a = ab.OPS[op][1]
    if a is None:
        return 0.0
    return float(np.asarray(a, host_dtype(dtype)).astype(np.float64)) \
        if dtype is not DT.BFLOAT16 else float(ab._alpha(op, dtype, None))


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("op", ACT_OPS)
def test_activation_backward_small(apis, op, dtype):
    m, ml = apis
    rng = np.random.default_rng(1)
    for shape in [(1,), (7,), (3, 5), (2, 3, 33)]:
        g, hg = make(m, rng.standard_normal(shape), dtype)
        v, hv = make(m, act_input(op, rng, shape), dtype)
        a = default_alpha(op, dtype)
        out = call_act(ml, op, g, v)
        assert out.shape == shape and out.dtype is dtype
        ref = ref_activation(op, hg, hv, a)
        check(m.to_numpy(out), ref, activation_bound(op, hg, hv, a, ref, dtype), f"{op} {shape}")


@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT64], ids=lambda d: d.name_str)
def test_activation_backward_special_values(apis, dtype):
    """PyTorch's choices: relu's gradient is 0 at x == 0 and passes g at NaN, leaky_relu
    scales by alpha at NaN, elu passes g at NaN; gelu's gradients are 1 at +inf and 0 at -inf,
    finite at x whose square overflows."""
    m, ml = apis
    xs = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e30, -1e30, 3.0, -3.0])
    g, _ = make(m, np.full(xs.shape, 2.0), dtype)
    x, hx = make(m, xs, dtype)
    expect = {
        "relu": [0, 0, 2, 2, 0, 2, 0, 2, 0],
        "leaky_relu": [0.02, 0.02, 0.02, 2, 0.02, 2, 0.02, 2, 0.02],
        "elu": [2, 2, 2, 2, 0, 2, 0, 2, 2 * math.exp(-3.0)],
    }
    for op, want in expect.items():
        got = m.to_numpy(getattr(ml, f"{op}_backward")(g, x)).astype(np.float64)
        np.testing.assert_allclose(got, np.array(want, np.float64), rtol=1e-6, err_msg=op)
    for op in ("gelu", "gelu_exact"):
        got = m.to_numpy(call_act(ml, op, g, x)).astype(np.float64)
        assert np.isnan(got[2]) and not np.isnan(np.delete(got, 2)).any(), (op, got)
        assert got[3] == 2 and got[4] == 0 and got[5] == 2 and got[6] == 0, (op, got)
        np.testing.assert_allclose(got[:2], 1.0, rtol=1e-6, err_msg=op)   # gelu'(0) = 1/2


def test_activation_backward_alpha_and_empty(apis):
    m, ml = apis
    rng = np.random.default_rng(2)
    g, hg = make(m, rng.standard_normal(50), DT.FLOAT64)
    x, hx = make(m, rng.standard_normal(50), DT.FLOAT64)
    for op, a in (("leaky_relu", 0.2), ("elu", 0.5)):
        out = getattr(ml, f"{op}_backward")(g, x, a)
        np.testing.assert_allclose(m.to_numpy(out), ref_activation(op, hg, hx, a), rtol=1e-14)
    e = m.create_tensor((0, 3), DT.FLOAT32)
    assert ml.relu_backward(e, e).shape == (0, 3)
    assert ml.softmax_backward(e, e).shape == (0, 3)


def test_activation_backward_errors(apis):
    m, ml = apis
    a, b = m.from_numpy(np.ones((2, 3), np.float32)), m.from_numpy(np.ones((3, 2), np.float32))
    with pytest.raises(cb.ShapeMismatchError, match=r"grad_out has shape \(2, 3\) and x has "
                                                    r"shape \(3, 2\)"):
        ml.relu_backward(a, b)
    with pytest.raises(cb.ShapeMismatchError, match="y has shape"):
        ml.sigmoid_backward(a, b)
    with pytest.raises(cb.DTypeMismatchError, match="mixed dtypes float32 and float64"):
        ml.tanh_backward(a, m.from_numpy(np.ones((2, 3))))
    with pytest.raises(cb.DTypeMismatchError, match="relu_backward does not support int32"):
        ml.relu_backward(m.from_numpy(np.ones(3, np.int32)), m.from_numpy(np.ones(3, np.int32)))
    with pytest.raises(cb.InvalidArgumentError, match="approximate must be 'tanh' or 'none'"):
        ml.gelu_backward(a, a, approximate="fast")
    with pytest.raises(cb.InvalidArgumentError, match="alpha must be a real number"):
        ml.elu_backward(a, a, alpha="x")
    with pytest.raises(cb.InvalidArgumentError, match="must be a CudaTensor"):
        ml.relu_backward(np.ones(3), a)
    f = m.from_numpy(np.ones((2, 3), np.float32))
    f.free()
    with pytest.raises(cb.TensorFreedError):
        ml.gelu_backward(a, f)


# -- finite differences (float64, any mode) ------------------------------------------------
def fd_check(f, x, analytic, h, c3, what):
    """analytic = f'(x) against the forward difference (f(x + h) - f(x)) / h, whose error is
    (h / 2) f''(xi), xi in [x, x + h]: the tolerance is (h / 2) (2 |f2| + 2 e2 + h c3) +
    rounding, f2 the central second difference (f''(x) within e2, its rounding) and c3 a
    bound of |f'''| (f'' moves by at most h c3 over the step); f is float64 (eps each)."""
    f0, fp, fm = f(x), f(x + h), f(x - h)
    d1 = (fp - f0) / h
    f2 = (fp - 2 * f0 + fm) / h**2
    e2 = 4 * EPS64 * (np.abs(fp) + 2 * np.abs(f0) + np.abs(fm)) / h**2
    rnd = 4 * EPS64 * (np.abs(f0) + np.abs(fp)) / h + 4 * EPS64 * np.abs(analytic)
    tol = (h / 2) * (2 * np.abs(f2) + 2 * e2 + h * c3) + rnd
    err = np.abs(analytic - d1)
    assert np.all(err <= tol), (what, float(np.max(err - tol)), float(np.max(err)))


FORWARD = {
    "relu": lambda x, a: np.where(x < 0, 0.0, x),
    "leaky_relu": lambda x, a: np.where(x > 0, x, a * x),
    "elu": lambda x, a: np.where(x > 0, x, a * np.expm1(x)),
    "gelu": lambda x, a: 0.5 * x * (1 + np.tanh(C2 / 2 * (x + 0.044715 * x**3))),
    "gelu_exact": lambda x, a: 0.5 * x * _erfc(-x / math.sqrt(2)),
    "sigmoid": lambda x, a: 1 / (1 + np.exp(-x)),
    "tanh": lambda x, a: np.tanh(x),
}


@pytest.mark.parametrize("op", ACT_OPS)
def test_activation_backward_finite_differences(apis, op):
    """Our gradient (g = 1) against forward differences of the forward function; |x| > 0.05
    keeps the kinks of relu / leaky_relu / elu out of [x - h, x + h]; |f'''| <= 2 for all
    seven (elu: alpha e^x <= 1; tanh: 2 at most)."""
    m, ml = apis
    rng = np.random.default_rng(3)
    x = rng.uniform(-4, 4, 40)
    x = np.where(np.abs(x) < 0.05, 0.5, x)
    a = ab.OPS[op][1] or 0.0
    f = lambda t: FORWARD[op](t, a)  # noqa: E731
    v = f(x) if op in ("sigmoid", "tanh") else x
    ones = m.from_numpy(np.ones_like(x))
    got = m.to_numpy(call_act(ml, op, ones, m.from_numpy(v)))
    fd_check(f, x, got, 1e-5, 2.0, op)


def _softmax(x, log=False):
    z = x - x.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True)) if log else \
        np.exp(z) / np.exp(z).sum(-1, keepdims=True)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_backward_finite_differences(apis, log):
    """d/dx_i of L(x) = sum(g * softmax(x)) per coordinate; |L'''| <= 2 sum|g| along one
    coordinate (derivatives of p_i up to the third are at most 1 in magnitude)."""
    m, ml = apis
    rng = np.random.default_rng(4)
    x, g = rng.standard_normal((3, 6)), rng.standard_normal((3, 6))
    y = _softmax(x, log)
    fn = ml.log_softmax_backward if log else ml.softmax_backward
    got = m.to_numpy(fn(m.from_numpy(g), m.from_numpy(y)))
    for r in range(3):
        for i in range(6):
            def L(t, r=r, i=i):
                xr = np.repeat(x[r][None], np.size(t), 0)
                xr[:, i] = t
                return (g[r] * _softmax(xr, log)).sum(-1)
            fd_check(L, np.array([x[r, i]]), got[r, i], 1e-5, 2 * np.abs(g[r]).sum(), (r, i))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_backward_finite_differences(apis, reduction):
    """d loss / d x_ij against forward differences of our own loss (float64): along one
    coordinate the loss's third derivative is p (1 - p) (1 - 2p), at most 0.1 (/ N for the
    mean)."""
    m, ml = apis
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 5)) * 2
    lab = np.array([1, -100, 4, 0])
    t_lab = m.from_numpy(lab)
    got = m.to_numpy(ml.cross_entropy_backward(m.from_numpy(x), t_lab, reduction=reduction))
    assert np.all(got[1] == 0)

    def loss_at(xx):
        return float(m.to_numpy(ml.cross_entropy(m.from_numpy(xx), t_lab, reduction=reduction)))
    for r in range(4):
        for j in range(5):
            def L(t, r=r, j=j):
                out = []
                for tv in np.atleast_1d(t):
                    xx = x.copy()
                    xx[r, j] = tv
                    out.append(loss_at(xx))
                return np.array(out)
            fd_check(L, np.array([x[r, j]]), got[r, j], 1e-5, 0.1, (r, j))


# -- softmax backward: any mode ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_backward_small(apis, dtype, log):
    m, ml = apis
    rng = np.random.default_rng(6)
    fn = ml.log_softmax_backward if log else ml.softmax_backward
    for shape in [(1, 1), (3, 7), (2, 3, 33), (7,), ()]:
        g, hg = make(m, rng.standard_normal(shape), dtype)
        y, hy = make(m, _softmax(rng.standard_normal(shape or (1,)) * 3, log).reshape(shape),
                     dtype)
        out = fn(g, y)
        assert out.shape == shape and out.dtype is dtype
        h2 = lambda a: a.reshape(shape if shape else (1,))  # noqa: E731
        ref, b = softmax_backward_bound(h2(hg), h2(hy), log, dtype)
        check(h2(m.to_numpy(out)), ref, b, f"{shape}")


def test_softmax_backward_errors(apis):
    m, ml = apis
    a, b = m.from_numpy(np.ones((2, 3), np.float32)), m.from_numpy(np.ones((2, 4), np.float32))
    with pytest.raises(cb.ShapeMismatchError, match="softmax_backward: grad_out has shape"):
        ml.softmax_backward(a, b)
    with pytest.raises(cb.ShapeMismatchError, match="log_softmax_backward"):
        ml.log_softmax_backward(a, b)
    with pytest.raises(cb.DTypeMismatchError, match="softmax_backward does not support int64"):
        ml.softmax_backward(m.from_numpy(np.ones(3, np.int64)), m.from_numpy(np.ones(3, np.int64)))


# -- cross-entropy: any mode ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_small(apis, dtype, reduction):
    m, ml = apis
    rng = np.random.default_rng(7)
    for (N, C), ldt in (((1, 1), np.int64), ((5, 7), np.int32), ((9, 33), np.int64)):
        x, hx = make(m, rng.standard_normal((N, C)) * 3, dtype)
        lab = labels_for(rng, N, C, dtype=ldt)
        t_lab = m.from_numpy(lab)
        out = ml.cross_entropy(x, t_lab, reduction=reduction)
        ref, b = ref_ce(hx, lab.astype(np.int64), reduction, -100, dtype)
        assert out.dtype is dtype and out.shape == ref.shape
        check(m.to_numpy(out), ref, b, f"{N}x{C}")
        grad = 0.75 if reduction != "none" else m.from_numpy(
            rng.standard_normal(N).astype(host_dtype(dtype)), dtype=dtype)
        hgrad = 0.75 if reduction != "none" else m.to_numpy(grad).astype(np.float64)
        dx = ml.cross_entropy_backward(x, t_lab, grad, reduction=reduction)
        scale = hgrad / max(np.count_nonzero(lab != -100), 1) if reduction == "mean" else hgrad
        if reduction == "mean" and not np.count_nonzero(lab != -100):
            scale = np.inf
        ref, b = ref_ce_backward(hx, lab.astype(np.int64), scale, -100, dtype)
        assert dx.shape == (N, C) and dx.dtype is dtype
        check(m.to_numpy(dx), ref, b, f"backward {N}x{C}")


def test_cross_entropy_ignore_index_semantics(apis):
    """PyTorch's: ignored rows give 0 and leave the mean's count; every row ignored: mean NaN,
    sum 0, gradient 0; an ignore_index inside [0, C) ignores those rows too."""
    m, ml = apis
    x = m.from_numpy(np.array([[1.0, 2.0, 3.0], [0.5, -1.0, 2.0]]))
    all_ign = m.from_numpy(np.array([-100, -100]))
    assert np.isnan(m.to_numpy(ml.cross_entropy(x, all_ign)))
    assert m.to_numpy(ml.cross_entropy(x, all_ign, reduction="sum")) == 0
    assert m.to_numpy(ml.cross_entropy(x, all_ign, reduction="none")).tolist() == [0, 0]
    assert np.all(m.to_numpy(ml.cross_entropy_backward(x, all_ign)) == 0)
    lab = m.from_numpy(np.array([2, 0], np.int32))
    got = m.to_numpy(ml.cross_entropy(x, lab, reduction="none", ignore_index=0))
    lse = np.log(np.exp([1.0, 2.0, 3.0]).sum())
    np.testing.assert_allclose(got, [lse - 3.0, 0.0], rtol=1e-14)
    mean = m.to_numpy(ml.cross_entropy(x, lab, ignore_index=0))
    np.testing.assert_allclose(mean, lse - 3.0, rtol=1e-14)   # count 1, not 2
    empty = m.from_numpy(np.zeros((0, 4)))
    e_lab = m.from_numpy(np.zeros(0, np.int64))
    assert np.isnan(m.to_numpy(ml.cross_entropy(empty, e_lab)))
    assert m.to_numpy(ml.cross_entropy(empty, e_lab, reduction="sum")) == 0
    assert ml.cross_entropy_backward(empty, e_lab).shape == (0, 4)


def test_cross_entropy_labels_out_of_range(apis):
    """A label outside [0, C) that is not ignore_index raises, forward and backward, int32 and
    int64, naming such a row: on the GPU from the next synchronizing call (the kernels set an
    error slot, cuda_backend/device_errors.py), in fallback mode from the call itself (naming
    the first such row, its label and the count); check_labels=False gives NaN rows."""
    m, ml = apis

    def raises(call, match):
        with pytest.raises(cb.InvalidArgumentError, match=match):
            res = call()
            for t in res if isinstance(res, tuple) else (res,):
                t.free()
            m.backend.synchronize()

    x = m.from_numpy(np.arange(15, dtype=np.float32).reshape(3, 5) / 7)
    for ldt in (np.int32, np.int64):
        lab = m.from_numpy(np.array([4, 5, -1], ldt))
        for red in ("mean", "sum", "none"):
            raises(lambda: ml.cross_entropy(x, lab, reduction=red),
                   r"label (5 )?in row [12] is out of range \[0, 5\)" +
                   ("" if m.gpu else r" .*\(2 rows"))
            raises(lambda: ml.cross_entropy_backward(x, lab, reduction=red),
                   r"cross_entropy_backward: (the )?label (5 )?in row [12] ")
        got = m.to_numpy(ml.cross_entropy(x, lab, reduction="none", check_labels=False))
        assert np.isfinite(got[0]) and np.isnan(got[1]) and np.isnan(got[2])
        assert np.isnan(m.to_numpy(ml.cross_entropy(x, lab, check_labels=False)))
        dx = m.to_numpy(ml.cross_entropy_backward(x, lab, reduction="sum", check_labels=False))
        assert np.isfinite(dx[0]).all() and np.isnan(dx[1:]).all()
    neg = m.from_numpy(np.array([0, -100, -7], np.int64))
    raises(lambda: ml.cross_entropy(x, neg), r"label (-7 )?in row 2 .*ignore_index")
    m.backend.synchronize()     # nothing left pending


def test_cross_entropy_errors(apis):
    m, ml = apis
    x = m.from_numpy(np.ones((3, 4), np.float32))
    lab = m.from_numpy(np.zeros(3, np.int64))
    with pytest.raises(cb.DTypeMismatchError, match="labels must be int32 or int64 .*float32"):
        ml.cross_entropy(x, m.from_numpy(np.zeros(3, np.float32)))
    with pytest.raises(cb.DTypeMismatchError, match="cross_entropy does not support int32"):
        ml.cross_entropy(m.from_numpy(np.ones((3, 4), np.int32)), lab)
    with pytest.raises(cb.InvalidArgumentError, match="reduction must be 'mean', 'sum' or "
                                                      "'none', got 'avg'"):
        ml.cross_entropy(x, lab, reduction="avg")
    with pytest.raises(cb.InvalidArgumentError, match="reduction must be"):
        ml.cross_entropy_backward(x, lab, reduction=None)
    with pytest.raises(cb.ShapeMismatchError, match=r"labels must have shape \(3,\)"):
        ml.cross_entropy(x, m.from_numpy(np.zeros(4, np.int64)))
    with pytest.raises(cb.ShapeMismatchError, match=r"logits must be 2-D \(N, C\)"):
        ml.cross_entropy(m.from_numpy(np.ones(4, np.float32)), lab)
    with pytest.raises(cb.ShapeMismatchError, match="at least one class"):
        ml.cross_entropy(m.from_numpy(np.ones((3, 0), np.float32)), lab)
    with pytest.raises(cb.InvalidArgumentError, match="ignore_index must be an int"):
        ml.cross_entropy(x, lab, ignore_index=1.5)
    with pytest.raises(cb.InvalidArgumentError, match="check_labels must be a bool"):
        ml.cross_entropy(x, lab, check_labels="yes")
    with pytest.raises(cb.ShapeMismatchError, match=r"grad_loss has shape \(2,\), expected "
                                                    r"\(3,\)"):
        ml.cross_entropy_backward(x, lab, m.from_numpy(np.ones(2, np.float32)), "none")
    with pytest.raises(cb.ShapeMismatchError, match=r"expected \(\) or \(1,\)"):
        ml.cross_entropy_backward(x, lab, m.from_numpy(np.ones(3, np.float32)), "sum")
    with pytest.raises(cb.DTypeMismatchError, match="grad_loss has dtype float64"):
        ml.cross_entropy_backward(x, lab, m.from_numpy(np.ones(3)), "none")
    with pytest.raises(cb.InvalidArgumentError, match="grad_loss must be a real number"):
        ml.cross_entropy_backward(x, lab, "1")


def test_cross_entropy_grad_tensor_for_scalar_reductions(apis):
    """grad_loss as a tensor of shape () or (1,) for "mean" and "sum" equals the float."""
    m, ml = apis
    rng = np.random.default_rng(8)
    x = m.from_numpy(rng.standard_normal((6, 9)))
    lab = m.from_numpy(labels_for(rng, 6, 9))
    for red in ("mean", "sum"):
        want = m.to_numpy(ml.cross_entropy_backward(x, lab, 1.5, red))
        for shape in ((), (1,)):
            got = ml.cross_entropy_backward(x, lab, m.from_numpy(np.full(shape, 1.5)), red)
            np.testing.assert_allclose(m.to_numpy(got), want, rtol=1e-15, atol=0)


def check_row_stats(got, x, C, dtype, what):
    """The forward's (max, sum of exp(x - max)) per row: the max is one of the row's stored
    values (exact), the sum within the forward's bound (ce_row_bound's u (4 depth + 3 Rw + 8))."""
    mx, s, rw = ce_stats(x, np.zeros(x.shape[0], np.int64), -100)[:3]
    u = U_ACC[dtype]
    assert got.shape == (x.shape[0], 2), what
    np.testing.assert_array_equal(got[:, 0], mx, err_msg=what)
    check(got[:, 1], s, u * (4 * sum_depth(C) + 3 * rw + 8) * s, what + " sum")


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_cross_entropy_row_stats(apis, dtype):
    """return_row_stats gives the loss unchanged and each row's (max, sum); the backward
    from them matches the float64 gradient within the same bound as without them."""
    m, ml = apis
    rng = np.random.default_rng(17)
    acc = DT.FLOAT64 if dtype is DT.FLOAT64 else DT.FLOAT32
    for (N, C), red in (((1, 1), "mean"), ((5, 7), "sum"), ((9, 1031), "none")):
        x, hx = make(m, rng.standard_normal((N, C)) * 3, dtype)
        lab = labels_for(rng, N, C)
        t_lab = m.from_numpy(lab)
        loss, stats = ml.cross_entropy(x, t_lab, red, return_row_stats=True)
        assert stats.dtype is acc and stats.shape == (N, 2)
        plain = ml.cross_entropy(x, t_lab, red)
        np.testing.assert_array_equal(m.to_numpy(loss).astype(np.float64),
                                      m.to_numpy(plain).astype(np.float64))
        check_row_stats(m.to_numpy(stats).astype(np.float64), hx, C, dtype, f"{N}x{C}")
        n = np.count_nonzero(lab != -100)
        scale = (0.75 / n if n else np.inf) if red == "mean" else 0.75
        ref, b = ref_ce_backward(hx, lab, scale, -100, dtype)
        dx = ml.cross_entropy_backward(x, t_lab, 0.75, red, row_stats=stats)
        check(m.to_numpy(dx), ref, b, f"backward from stats {N}x{C} {red}")


def test_cross_entropy_row_stats_errors(apis):
    m, ml = apis
    x = m.from_numpy(np.ones((3, 4), np.float32))
    lab = m.from_numpy(np.zeros(3, np.int64))
    _, stats = ml.cross_entropy(x, lab, return_row_stats=True)
    with pytest.raises(cb.InvalidArgumentError, match="return_row_stats must be a bool"):
        ml.cross_entropy(x, lab, return_row_stats=1)
    with pytest.raises(cb.InvalidArgumentError, match="row_stats must be None or the "
                                                      "CudaTensor"):
        ml.cross_entropy_backward(x, lab, row_stats=np.ones((3, 2), np.float32))
    with pytest.raises(cb.DTypeMismatchError, match="row_stats has dtype float64, expected "
                                                    "float32 for float32 logits"):
        ml.cross_entropy_backward(x, lab, row_stats=m.from_numpy(np.ones((3, 2))))
    with pytest.raises(cb.ShapeMismatchError, match=r"row_stats has shape \(2, 2\), expected "
                                                    r"\(3, 2\)"):
        ml.cross_entropy_backward(x, lab, row_stats=m.from_numpy(np.ones((2, 2), np.float32)))
    stats.free()
    with pytest.raises(cb.TensorFreedError):
        ml.cross_entropy_backward(x, lab, row_stats=stats)
    ml.cross_entropy_backward(x, lab)   # still usable


# -- plans and the template contract (any mode) -------------------------------------------------
def test_plans_hold_the_row():
    for itemsize in (2, 4, 8):
        vec = 16 // itemsize
        for K in [1, 2, 7, 33, 255, 256, 257, 1000, 1025, 4097, 8193, 16385, 33000, 100003]:
            for p in sb.candidates(K, itemsize):
                if p["mode"] == "warp":
                    assert p["group"] * vec * p["nv"] >= K and p["group"] <= 32
                elif p["mode"] == "block":
                    assert p["threads"] * p["nv"] * vec >= K
            assert sb.candidates(K, itemsize)[0] == sb.plan(K, itemsize)
            assert sb.candidates(K, itemsize)[-1]["mode"] == "loop"
            for p in cep.backward_candidates(K, itemsize):
                if p["mode"] == "warp":
                    assert p["group"] * vec * p["nv"] >= K and p["group"] <= 32
                elif p["mode"] == "block":
                    assert p["threads"] * p["nv"] * vec >= K
            assert cep.backward_candidates(K, itemsize)[0] == cep.backward_plan(K, itemsize)
            fp = cep.forward_plan(K, itemsize)
            assert fp["mode"] == ("warp" if K <= 32 * vec * cep.FWD_WARP_VECS else "block")
    assert sb.plan(512, 4)["mode"] == "warp" and sb.plan(513, 4)["mode"] == "block"
    assert sb.plan(8192, 4) == {"mode": "block", "nv": 2, "threads": 1024, "group": 0}
    assert sb.plan(8193, 4)["mode"] == "loop"
    assert cep.backward_plan(1024, 4)["mode"] == "warp"
    assert cep.backward_plan(8193, 4)["mode"] == "loop"


def test_stats_plans_cover_the_row():
    """A stats plan cuts each row into items of STATS_BLOCK * vec elements: chunks - 1 of them
    fall short of K, all of them reach it; blocks take nv items each (the rule: 4)."""
    for itemsize in (2, 4, 8):
        vec = 16 // itemsize
        for K in [1, 7, 1000, 1023, 1024, 1025, 6208, 16383, 16384, 16385, 50257, 100003]:
            plans = ce.candidates("stats", K, itemsize)
            assert plans[0] == cep.stats_plan(K, itemsize) and plans[0]["nv"] == 4
            assert {p["nv"] for p in plans} == set(cep.STATS_NV)
            for p in plans:
                chunk = p["threads"] * vec
                n = cep.stats_chunks(p, K, itemsize)
                assert (n - 1) * chunk < K <= n * chunk
                assert cep.grid(p, 9, K, itemsize) == -(-9 * n // p["nv"])


def test_template_variants():
    assert len(ab.template_variants()[ab.TEMPLATE]) == len(ab.OPS) * 4
    assert len(sb.template_variants()[sb.TEMPLATE]) == 4 * (len(sb.WARP_NV) +
                                                            len(sb.BLOCK_CONFIGS) + 1)
    kinds = {(p["kind"], p.get("mode")) for p in ce.template_variants()[ce.TEMPLATE]}
    assert kinds == {("forward", "warp"), ("forward", "block"), ("backward", "warp"),
                     ("backward", "block"), ("backward", "loop"), ("backward", "stats"),
                     ("finish", None)}


# -- PyTorch's autograd (CPU torch, float64) ------------------------------------------------
def test_against_torch_autograd(apis):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    m, ml = apis
    rng = np.random.default_rng(9)
    dt = DT.FLOAT64
    x_np, g_np = rng.standard_normal((5, 33)) * 3, rng.standard_normal((5, 33))

    def torch_grad(fn, x, g):
        xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        y = fn(xt)
        y.backward(torch.tensor(g, dtype=torch.float64))
        return y.detach().numpy(), xt.grad.numpy()

    # activations: ours from x (or y for sigmoid / tanh), within our bound (twice: torch's
    # float64 result has the same kind of error)
    acts = {"relu": (torch.relu, None), "leaky_relu": (lambda t: F.leaky_relu(t, 0.01), 0.01),
            "elu": (F.elu, 1.0), "gelu": (lambda t: F.gelu(t, approximate="tanh"), None),
            "gelu_exact": (F.gelu, None), "sigmoid": (torch.sigmoid, None),
            "tanh": (torch.tanh, None)}
    for op, (fn, a) in acts.items():
        y, want = torch_grad(fn, x_np, g_np)
        v = y if op in ("sigmoid", "tanh") else x_np
        got = m.to_numpy(call_act(ml, op, m.from_numpy(g_np), m.from_numpy(v)))
        ref = ref_activation(op, g_np, v, a or 0.0)
        b = 2 * activation_bound(op, g_np, v, a or 0.0, ref, dt) + 1e-14 * np.abs(g_np)
        check(got, want, b, op)
    for log, fn in ((False, lambda t: torch.softmax(t, -1)),
                    (True, lambda t: torch.log_softmax(t, -1))):
        y, want = torch_grad(fn, x_np, g_np)
        ours = ml.log_softmax_backward if log else ml.softmax_backward
        got = m.to_numpy(ours(m.from_numpy(g_np), m.from_numpy(y)))
        _, b = softmax_backward_bound(g_np, y, log, dt)
        check(got, want, 2 * b, f"softmax log={log}")
    lab = labels_for(rng, 5, 33)
    lab[0] = 3
    for red in ("mean", "sum", "none"):
        xt = torch.tensor(x_np, dtype=torch.float64, requires_grad=True)
        loss = F.cross_entropy(xt, torch.tensor(lab), reduction=red, ignore_index=-100)
        gl = np.ones(5) * 0.5 if red == "none" else 0.5
        loss.backward(torch.tensor(gl, dtype=torch.float64))
        t_lab = m.from_numpy(lab)
        got = m.to_numpy(ml.cross_entropy(m.from_numpy(x_np), t_lab, reduction=red))
        _, b = ref_ce(x_np, lab, red, -100, dt)
        check(got, loss.detach().numpy(), 2 * b, f"cross_entropy {red}")
        grad = m.from_numpy(gl) if red == "none" else gl
        got = m.to_numpy(ml.cross_entropy_backward(m.from_numpy(x_np), t_lab, grad, red))
        n = np.count_nonzero(lab != -100)
        _, b = ref_ce_backward(x_np, lab, gl / n if red == "mean" else gl, -100, dt)
        check(got, xt.grad.numpy(), 2 * b, f"cross_entropy_backward {red}")


# -- GPU --------------------------------------------------------------------------------------
gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("op", ACT_OPS)
def test_gpu_activation_backward(apis, op, dtype):
    """Odd sizes (the 16-byte body and the scalar tail), a misaligned view (the element
    path), and the per-call plan taking a repeat call with the same result."""
    m, ml = apis
    rng = np.random.default_rng(10)
    a = default_alpha(op, dtype)
    for n in ROW_LENGTHS + [257 * 33]:
        g, hg = make(m, rng.standard_normal(n), dtype)
        v, hv = make(m, act_input(op, rng, n), dtype)
        ref = ref_activation(op, hg, hv, a)
        b = activation_bound(op, hg, hv, a, ref, dtype)
        out = call_act(ml, op, g, v)
        check(m.to_numpy(out), ref, b, f"{op} n={n}")
        again = call_through_plan(m, (op + "_backward", dtype, 0), lambda: call_act(ml, op, g, v))
        np.testing.assert_array_equal(m.to_numpy(again).astype(np.float64),
                                                  m.to_numpy(out).astype(np.float64))
        vm, base, hvm = misaligned(m, act_input(op, rng, n), dtype)
        ref = ref_activation(op, hg, hvm, a)
        check(m.to_numpy(call_act(ml, op, g, vm)), ref,
              activation_bound(op, hg, hvm, a, ref, dtype), f"{op} n={n} misaligned")
        for t in (g, v, out, again, base):
            t.free()


def _grad_and_output(m, rng, shape, dtype, log):
    g, hg = make(m, rng.standard_normal(shape), dtype)
    y, hy = make(m, _softmax(rng.standard_normal(shape) * 3, log), dtype)
    return g, hg, y, hy


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_gpu_softmax_backward(apis, dtype, log):
    """Rows of 1, 7, 33, 1000, 4097, 33000 elements (warp, block and loop modes) times 1, 5,
    257 rows through the public method, then again through its plan."""
    m, ml = apis
    rng = np.random.default_rng(11)
    fn = ml.log_softmax_backward if log else ml.softmax_backward
    for K in ROW_LENGTHS:
        for N in ROW_COUNTS:
            g, hg, y, hy = _grad_and_output(m, rng, (N, K), dtype, log)
            ref, b = softmax_backward_bound(hg, hy, log, dtype)
            out = fn(g, y)
            check(m.to_numpy(out), ref, b, f"{N}x{K}")
            again = call_through_plan(m, ("softmax_backward", (N, K), dtype, 0, log),
                                      lambda: fn(g, y))
            np.testing.assert_array_equal(m.to_numpy(again).astype(np.float64),
                                                  m.to_numpy(out).astype(np.float64))
            for t in (g, y, out, again):
                t.free()


def boundary_lengths(itemsize, caps):
    ks = {1, 2, 3, 997, 1031, 4099}
    for c in caps:
        ks |= {c - 1, c, c + 1}
    return sorted(k for k in ks if 0 < k <= max(caps) + 1)


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_gpu_softmax_backward_every_candidate(apis, dtype):
    """Every plan `candidates` offers at each mode's capacity - 1, capacity, + 1, on aligned
    rows (16-byte vectors where K allows) and on views one element past (element path)."""
    m, _ = apis
    rng = np.random.default_rng(12)
    vec = 16 // dtype.itemsize
    caps = [32 * vec * nv for nv in sb.WARP_NV] + [b * nv * vec for b, nv in sb.BLOCK_CONFIGS]
    for K in boundary_lengths(dtype.itemsize, caps):
        for log in (False, True):
            g, hg, y, hy = _grad_and_output(m, rng, (7, K), dtype, log)
            ym, base, hym = misaligned(m, _softmax(rng.standard_normal((7, K)) * 3, log), dtype)
            for p in sb.candidates(K, dtype.itemsize):
                q = sb.prepare(m, p, dtype, 0)
                for yy, hyy in ((y, hy), (ym, hym)):
                    dx = m.create_tensor((7, K), dtype)
                    sb.launch(m, q, g, yy, dx, log)
                    ref, b = softmax_backward_bound(hg, hyy, log, dtype)
                    check(m.to_numpy(dx), ref, b, f"K={K} {p} log={log}")
                    dx.free()
            for t in (g, y, base):
                t.free()


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_gpu_cross_entropy(apis, dtype):
    """Classes 1 .. 33000 times rows 1, 5, 257, labels int32 and int64 with ignored rows,
    every reduction, forward and backward (a float grad_loss; for "none" also a tensor),
    through the public methods and again through their plans."""
    m, ml = apis
    rng = np.random.default_rng(13)
    for i, C in enumerate(ROW_LENGTHS):
        for j, N in enumerate(ROW_COUNTS):
            ldt = np.int32 if (i + j) % 2 else np.int64
            x, hx = make(m, rng.standard_normal((N, C)) * 3, dtype)
            lab = labels_for(rng, N, C, dtype=ldt)
            t_lab = m.from_numpy(lab)
            lab64 = lab.astype(np.int64)
            n = np.count_nonzero(lab64 != -100)
            for red in ("mean", "sum", "none"):
                what = f"{N}x{C} {red} {ldt.__name__}"
                ref, b = ref_ce(hx, lab64, red, -100, dtype)
                out = ml.cross_entropy(x, t_lab, reduction=red)
                check(m.to_numpy(out), ref, b, what)
                key = ("cross_entropy", (N, C), dtype, t_lab.dtype, 0, red, -100, True, False)
                again = call_through_plan(m, key, lambda: ml.cross_entropy(x, t_lab,
                                                                           reduction=red))
                np.testing.assert_array_equal(m.to_numpy(again).astype(np.float64),
                                                  m.to_numpy(out).astype(np.float64))
                scale = (1.25 / n if n else np.inf) if red == "mean" else 1.25
                ref, b = ref_ce_backward(hx, lab64, scale, -100, dtype)
                dx = ml.cross_entropy_backward(x, t_lab, 1.25, red)
                check(m.to_numpy(dx), ref, b, "backward " + what)
                key = ("cross_entropy_backward", (N, C), dtype, t_lab.dtype, 0, red, -100, True,
                       False)
                dx2 = call_through_plan(m, key, lambda: ml.cross_entropy_backward(
                    x, t_lab, 1.25, red))
                np.testing.assert_array_equal(m.to_numpy(dx2), m.to_numpy(dx))
                out2, st = ml.cross_entropy(x, t_lab, reduction=red, return_row_stats=True)
                np.testing.assert_array_equal(m.to_numpy(out2).astype(np.float64),
                                              m.to_numpy(out).astype(np.float64))
                check_row_stats(m.to_numpy(st).astype(np.float64), hx, C, dtype, what)
                dx3 = ml.cross_entropy_backward(x, t_lab, 1.25, red, row_stats=st)
                check(m.to_numpy(dx3), ref, b, "backward from stats " + what)
                key = ("cross_entropy", (N, C), dtype, t_lab.dtype, 0, red, -100, True, True)
                out3, st3 = call_through_plan(m, key, lambda: ml.cross_entropy(
                    x, t_lab, reduction=red, return_row_stats=True))
                np.testing.assert_array_equal(m.to_numpy(st3), m.to_numpy(st))
                key = ("cross_entropy_backward", (N, C), dtype, t_lab.dtype, 0, red, -100, True,
                       True)
                dx4 = call_through_plan(m, key, lambda: ml.cross_entropy_backward(
                    x, t_lab, 1.25, red, row_stats=st3))
                np.testing.assert_array_equal(m.to_numpy(dx4), m.to_numpy(dx3))
                for t in (out, again, dx, dx2, out2, st, dx3, out3, st3, dx4):
                    t.free()
            gt, hgt = make(m, rng.standard_normal(N), dtype)
            ref, b = ref_ce_backward(hx, lab64, hgt, -100, dtype)
            dx = ml.cross_entropy_backward(x, t_lab, gt, "none")
            check(m.to_numpy(dx), ref, b, f"backward {N}x{C} none, grad tensor")
            for t in (x, t_lab, gt, dx):
                t.free()


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_gpu_cross_entropy_every_candidate(apis, dtype):
    """Every forward and backward plan (also from the forward's row statistics) at the
    backward modes' capacities +- 1, aligned and misaligned logits, ignored rows and an
    ignore_index inside [0, C)."""
    m, ml = apis
    rng = np.random.default_rng(14)
    vec = 16 // dtype.itemsize
    caps = [32 * vec * nv for nv in cep.BWD_WARP_NV] + \
        [b * nv * vec for b, nv in cep.BWD_BLOCK_CONFIGS] + [32 * vec * cep.FWD_WARP_VECS] + \
        [cep.STATS_BLOCK * vec * nv for nv in cep.STATS_NV]
    for K in boundary_lengths(dtype.itemsize, caps):
        ii = 0 if K % 3 == 0 else -100
        lab = labels_for(rng, 7, K, ignore_index=ii, frac_ignored=0.3)
        t_lab = m.from_numpy(lab)
        x, hx = make(m, rng.standard_normal((7, K)) * 3, dtype)
        xm, base, hxm = misaligned(m, rng.standard_normal((7, K)) * 3, dtype)
        for xx, hxx in ((x, hx), (xm, hxm)):
            what = f"K={K} aligned={xx is x}"
            ref, b = ref_ce(hxx, lab, "none", ii, dtype)
            for p in cep.forward_candidates(K, dtype.itemsize):
                q = cep.prepare(m, "forward", p, dtype, 0)
                out = m.create_tensor((7,), dtype)
                cep.launch_forward(m, q, xx, t_lab, out, False, 0, 0, ii)
                check(m.to_numpy(out), ref, b, f"forward {what} {p}")
                out.free()
            ref, b = ref_ce_backward(hxx, lab, 0.5, ii, dtype)
            for p in cep.backward_candidates(K, dtype.itemsize):
                q = cep.prepare(m, "backward", p, dtype, 0)
                dx = m.create_tensor((7, K), dtype)
                cep.launch_backward(m, q, xx, t_lab, dx, 0, 0, 0.5, 0, 0, ii)
                check(m.to_numpy(dx), ref, b, f"backward {what} {p}")
                dx.free()
            _, st = ml.cross_entropy(xx, t_lab, "none", ii, return_row_stats=True)
            for p in ce.candidates("stats", K, dtype.itemsize):
                q = cep.prepare(m, "backward", p, dtype, 0)
                dx = poisoned(m, (7, K), dtype)
                cep.launch_backward(m, q, xx, t_lab, dx, 0, 0, 0.5, 0, 0, ii, st)
                check(m.to_numpy(dx), ref, b, f"backward from stats {what} {p}")
                dx.free()
            st.free()
        for t in (x, base, t_lab):
            t.free()


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_gpu_cross_entropy_fused_every_candidate(apis, dtype):
    """The fused kernels of every candidate: the forward summing its own losses (the last of
    many blocks by ticket; "mean" and "sum"; twice, so the ticket is back at 0) against the
    reference, and the "mean" backward counting its rows in every block bit-identical to the
    unfused kernel given the finish kernel's scale (gmul / count, one rounding either way),
    also with a grad tensor of shape ()."""
    m, ml = apis
    rng = np.random.default_rng(17)
    adt = cep.acc_dtype(dtype)
    counter = cep.COUNTERS.get(m, 0, None, 1)
    for K in (1, 3, 64, 997, 4099):
        for N in (1, 300):
            ii = 0 if K % 3 == 0 else -100
            lab = labels_for(rng, N, K, ignore_index=ii, frac_ignored=0.3)
            t_lab = m.from_numpy(lab.astype(np.int32 if N == 1 else np.int64))
            x, hx = make(m, rng.standard_normal((N, K)) * 3, dtype)
            n = np.count_nonzero(lab != ii)
            buf, out = m.create_tensor((N,), adt), m.create_tensor((), dtype)
            for p in cep.forward_candidates(K, dtype.itemsize):
                q = cep.prepare(m, "forward", p, dtype, 0, True)
                for red in ("mean", "sum"):
                    ref, b = ref_ce(hx, lab, red, ii, dtype)
                    got = []
                    for _ in range(2):
                        cep.launch_forward(m, q, x, t_lab, buf, True, 0, 0, ii,
                                           (counter, out, int(red == "mean")))
                        got.append(m.to_numpy(out).astype(np.float64))
                    check(got[0], ref, b, f"fused forward {N}x{K} {red} {p}")
                    np.testing.assert_array_equal(got[1], got[0])
            _, st = ml.cross_entropy(x, t_lab, "none", ii, return_row_stats=True)
            g = m.from_numpy(np.asarray(0.75, host_dtype(dtype)), dtype=dtype)
            with np.errstate(divide="ignore"):      # (no counted row: an infinite scale)
                sc = adt.numpy_dtype.type(0.5) / adt.numpy_dtype.type(n)
            scale = m.from_numpy(np.asarray([sc], adt.numpy_dtype))
            ref, b = ref_ce_backward(hx, lab, 0.75 / n if n else np.inf, ii, dtype)
            plans = [("backward", p) for p in cep.backward_candidates(K, dtype.itemsize)] + \
                [("stats", p) for p in cep.stats_candidates(K, dtype.itemsize)]
            for kind, p in plans:
                q = cep.prepare(m, "backward", p, dtype, 0, True)
                q0 = cep.prepare(m, "backward", p, dtype, 0)
                sts = st if kind == "stats" else None
                dx, dx0 = poisoned(m, (N, K), dtype), poisoned(m, (N, K), dtype)
                cep.launch_backward(m, q, x, t_lab, dx, 0, 0, 0.5, 0, 0, ii, sts)
                cep.launch_backward(m, q0, x, t_lab, dx0, 0, 0, 0.0, scale, 0, ii, sts)
                np.testing.assert_array_equal(m.to_numpy(dx), m.to_numpy(dx0))
                cep.launch_backward(m, q, x, t_lab, dx, g, 0, 1.0, 0, 0, ii, sts)
                check(m.to_numpy(dx), ref, b, f"fused backward {N}x{K} {kind} {p}")
                dx.free()
                dx0.free()
            for t in (x, t_lab, buf, out, st, g, scale):
                t.free()


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_gpu_cross_entropy_large_logits(apis, dtype):
    """Logits 1e4 + N(0, 3) (float16's spacing there is 8, bfloat16's 64): the loss keeps
    its digits (max - x[label] is exact), the gradient is the softmax's."""
    m, ml = apis
    rng = np.random.default_rng(15)
    for N, C in ((5, 7), (257, 1000), (5, 33000)):
        x, hx = make(m, 1e4 + rng.standard_normal((N, C)) * 3, dtype)
        lab = labels_for(rng, N, C)
        t_lab = m.from_numpy(lab)
        for red in ("mean", "none"):
            ref, b = ref_ce(hx, lab, red, -100, dtype)
            got = m.to_numpy(ml.cross_entropy(x, t_lab, reduction=red))
            assert np.all(np.isfinite(got))
            check(got, ref, b, f"{N}x{C} {red}")
        ref, b = ref_ce_backward(hx, lab, 1.0, -100, dtype)
        check(m.to_numpy(ml.cross_entropy_backward(x, t_lab, 1.0, "sum")), ref, b, f"{N}x{C}")
        _, st = ml.cross_entropy(x, t_lab, "sum", return_row_stats=True)
        check(m.to_numpy(ml.cross_entropy_backward(x, t_lab, 1.0, "sum", row_stats=st)), ref,
              b, f"{N}x{C} from stats")
        for t in (x, t_lab, st):
            t.free()


@gpu
def test_gpu_cross_entropy_bad_label_frees_and_recovers(apis):
    """A bad label raises from the next synchronize (the kernels set an error slot,
    cuda_backend/device_errors.py), once; with the results freed the pool holds what it held
    before, and the next call (through the plan) is right."""
    m, ml = apis
    rng = np.random.default_rng(16)
    x, hx = make(m, rng.standard_normal((33, 1000)), DT.FLOAT32)
    good = m.from_numpy(labels_for(rng, 33, 1000))
    bad_lab = labels_for(rng, 33, 1000)
    bad_lab[17] = 1000
    bad = m.from_numpy(bad_lab)
    ml.cross_entropy(x, good)
    pool = m.backend.memory_pools[0]
    before = pool.get_stats()["active_memory"]
    _, st = ml.cross_entropy(x, good, return_row_stats=True)
    before = pool.get_stats()["active_memory"]
    for fn in (ml.cross_entropy, ml.cross_entropy_backward,
               lambda x, lab: ml.cross_entropy(x, lab, return_row_stats=True),
               lambda x, lab: ml.cross_entropy_backward(x, lab, row_stats=st)):
        res = fn(x, bad)
        for t in res if isinstance(res, tuple) else (res,):
            t.free()
        with pytest.raises(cb.InvalidArgumentError, match=r"label in row 17 is out of range"):
            m.backend.synchronize()
        m.backend.synchronize()      # raised once
    assert pool.get_stats()["active_memory"] == before
    st.free()
    ref, b = ref_ce(hx, m.to_numpy(good).astype(np.int64), "mean", -100, DT.FLOAT32)
    check(m.to_numpy(ml.cross_entropy(x, good)), ref, b, "after the error")
