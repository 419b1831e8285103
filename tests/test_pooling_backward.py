"""max_pool2d_backward / avg_pool2d_backward (ops/pooling_backward.py) against a float64 NumPy
reference written here (window by window, the definition), finite differences of the forward
pooling, explicit routing cases (distinct values, ties, NaN, -inf, padding) and PyTorch's
autograd when torch is importable.

Bounds are derived, not tuned: an element of dx is a sum of at most T = ceil(kh / sh) *
ceil(kw / sw) upstream gradients (the windows containing it), summed in the math type (unit
roundoff u: 2^-24 for float32 and the half types, which sum in float32; 2^-53 for float64)
and rounded once to the storage (u_out: 2^-11 float16, 2^-8 bfloat16). max: |ours - ref| <=
u_out |ref| + (T - 1) u S, S the sum of the |terms| (a single term is exact); avg adds the
division: u_out |ref| + T u S / (kh kw). Tests marked `gpu` run every kernel mode ("2x2",
"tile", "direct") on odd shapes, misaligned views and the per-call plans; the rest run in
whatever mode the backend is in (NumPy fallback without a GPU).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import (ATOL, EPS64, FLOATS, U_ACC, U_OUT, call_through_plan, check, host_dtype,
                     make)

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend.cuda_math import CudaMath
from cuda_backend.cuda_ml import CudaML
from cuda_backend.ops import pooling_backward as pb
from cuda_backend.ops.pooling import fast_divisor, output_shape
from cuda_backend.tensor import CudaTensor

KINDS = ["max", "avg"]
# (input shape, pool_size, stride, padding): odd sizes, overlapping windows (stride < window),
# padding, windows that leave rows/columns out, 1-wide windows, the 2x2 layer
CASES = [
    ((3, 5, 7, 9), 2, None, 0),
    ((1, 1, 1, 1), 1, None, 0),
    ((2, 3, 17, 19), 3, 2, 1),
    ((2, 3, 17, 19), (3, 2), (2, 1), (1, 0)),
    ((1, 3, 10, 10), 3, None, 0),
    ((2, 1, 7, 7), 5, 1, 2),
    ((1, 2, 9, 10), (4, 4), (3, 3), (2, 2)),
    ((2, 2, 5, 6), (1, 3), (1, 2), (0, 1)),
    ((4, 2, 16, 16), 2, None, 0),
    ((2, 3, 15, 32), 2, 2, 0),
    ((3, 2, 9, 11), 2, None, 1),
    ((1, 2, 13, 11), 3, 1, 1),
    ((2, 1, 8, 12), (2, 2), (3, 3), (0, 0)),        # stride > window: gaps get 0
]


@pytest.fixture(scope="module")
def apis(backend):
    m = CudaMath(backend)
    return m, CudaML(m)


def triple(pool_size, stride, padding):
    return pb.window(pool_size, stride, padding, "test")


def out_shape(shape, pool_size, stride, padding):
    return output_shape(shape, *triple(pool_size, stride, padding))


# -- the float64 reference: window by window ----------------------------------------------
def picks(win):
    """The forward's choice in each row of win (planes x window elements, row-major): the
    last NaN if the row holds one, else the first maximum (the first element when all are
    -inf)."""
    nan = np.isnan(win)
    last_nan = win.shape[1] - 1 - np.argmax(nan[:, ::-1], axis=1)
    with np.errstate(invalid="ignore"):
        first_max = np.argmax(win == np.max(np.where(nan, -np.inf, win), axis=1)[:, None],
                              axis=1)
    return np.where(nan.any(axis=1), last_nan, first_max)


def brute(kind, g, x, pool_size, stride=None, padding=0):
    """dx in float64, one window at a time: each window's g to the element it picked (max)
    or g / (kh kw) to each of its elements inside the input (avg)."""
    k, s, p = triple(pool_size, stride, padding)
    n, c, h, w = x.shape
    _, _, oh, ow = output_shape(x.shape, k, s, p)
    assert g.shape == (n, c, oh, ow)
    dx = np.zeros((n * c, h, w))
    xs, gs = x.reshape(n * c, h, w), g.reshape(n * c, oh, ow)
    planes = np.arange(n * c)
    for i in range(oh):
        for j in range(ow):
            h0, w0 = i * s[0] - p[0], j * s[1] - p[1]
            hl, hh, wl, wh = max(h0, 0), min(h0 + k[0], h), max(w0, 0), min(w0 + k[1], w)
            if kind == "avg":
                dx[:, hl:hh, wl:wh] += gs[:, i, j][:, None, None] / (k[0] * k[1])
                continue
            t = picks(xs[:, hl:hh, wl:wh].reshape(n * c, -1))
            ww = wh - wl
            dx[planes, hl + t // ww, wl + t % ww] += gs[:, i, j]
    return dx.reshape(x.shape)


def terms(pool_size, stride, padding=0):
    k, s, _ = triple(pool_size, stride, padding)
    return math.ceil(k[0] / s[0]) * math.ceil(k[1] / s[1])


def bound(kind, g, x, pool_size, stride, padding, ref, dtype):
    """u_out |ref| + (T - 1) u S (max) or T u S / (kh kw) (avg: the division), S from the
    same routing of |g|."""
    S = brute(kind, np.abs(g), x, pool_size, stride, padding)
    t = terms(pool_size, stride, padding) - (kind == "max")
    return U_OUT[dtype] * np.abs(ref) + t * U_ACC[dtype] * S + ATOL[dtype]


def backward(ml, kind, g, x, pool_size, stride=None, padding=(0, 0)):
    fn = ml.max_pool2d_backward if kind == "max" else ml.avg_pool2d_backward
    return fn(g, x, pool_size, stride, padding)


def special_input(rng, shape):
    """Small integers (ties in most windows) with NaN, +inf and -inf sprinkled in."""
    x = rng.integers(-2, 3, shape).astype(np.float64)
    flat = x.reshape(-1)
    flat[rng.random(flat.size) < 0.05] = np.nan
    flat[rng.random(flat.size) < 0.05] = np.inf
    flat[rng.random(flat.size) < 0.1] = -np.inf
    return x


# -- the reference itself -----------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_module_reference_is_the_definition(kind):
    """ops/pooling_backward.reference (vectorized by window offset) against the window loop
    above, with ties, NaN, +-inf and windows of nothing but -inf."""
    rng = np.random.default_rng(1)
    for shape, k, s, p in CASES:
        for x in (rng.standard_normal(shape), special_input(rng, shape),
                  np.full(shape, -np.inf)):
            g = rng.standard_normal(out_shape(shape, k, s, p))
            ref = brute(kind, g, x, k, s, p)
            got = pb.reference(kind, g, x, k, s, p)
            b = 4 * EPS64 * terms(k, s, p) * brute(kind, np.abs(g), x, k, s, p) + 1e-300
            check(got, ref, b, f"{shape} {k} {s} {p}")


# -- any mode (fallback here) -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference(apis, kind, dtype):
    m, ml = apis
    rng = np.random.default_rng(2)
    for shape, k, s, p in CASES:
        x, hx = make(m, rng.standard_normal(shape), dtype)
        g, hg = make(m, rng.standard_normal(out_shape(shape, k, s, p)), dtype)
        dx = backward(ml, kind, g, x, k, s, p)
        assert dx.shape == shape and dx.dtype is dtype
        ref = brute(kind, hg, hx, k, s, p)
        check(m.to_numpy(dx), ref, bound(kind, hg, hx, k, s, p, ref, dtype),
              f"{shape} {k} {s} {p}")


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_max_routes_to_distinct_maxima_exactly(apis, dtype):
    """Distinct values in each plane (a permutation, exact in every dtype) and integer
    gradients (sums exact): every gradient lands on its window's maximum, nowhere else."""
    m, ml = apis
    rng = np.random.default_rng(3)
    for shape, k, s, p in CASES:
        n, c, h, w = shape
        a = np.stack([rng.permutation(h * w) for _ in range(n * c)]).reshape(shape) - h * w / 2
        x, hx = make(m, a, dtype)
        g, hg = make(m, rng.integers(-8, 9, out_shape(shape, k, s, p)), dtype)
        got = m.to_numpy(ml.max_pool2d_backward(g, x, k, s, p)).astype(np.float64)
        np.testing.assert_array_equal(got, brute("max", hg, hx, k, s, p),
                                      err_msg=f"{shape} {k} {s} {p}")


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_max_ties_nan_and_infinities(apis, dtype):
    """The forward's rule, as PyTorch's indices: the first of tied maxima, the last NaN, the
    first element of a window of -inf; padding is never picked."""
    m, ml = apis
    nan, inf = np.nan, np.inf
    x = np.array([[[[1.0, 3.0, 3.0, 0.0],
                    [3.0, 2.0, nan, 5.0],
                    [-inf, -inf, 7.0, nan],
                    [-inf, -inf, nan, 7.0]]]])
    g = np.array([[[[10.0, 20.0], [30.0, 40.0]]]])
    tx, _ = make(m, x, dtype)
    tg, _ = make(m, g, dtype)
    got = m.to_numpy(ml.max_pool2d_backward(tg, tx, 2)).astype(np.float64)
    want = np.zeros((1, 1, 4, 4))
    want[0, 0, 0, 1] = 10.0          # [1, 3; 3, 2]: the first 3 (row-major: (0,1), (1,0))
    want[0, 0, 1, 2] = 20.0          # [3, 0; nan, 5]: the NaN, not the later 5
    want[0, 0, 2, 0] = 30.0          # all -inf: the window's first element
    want[0, 0, 3, 2] = 40.0          # [7, nan; nan, 7]: the last NaN
    np.testing.assert_array_equal(got, want)
    # with padding 1 (3x3 stride 2): a corner window's padding is never picked, even when
    # every real element is -inf; overlapping windows sum on the element both picked
    x2 = np.array([[[[-inf, -inf, 1.0], [-inf, -inf, 0.0], [2.0, 9.0, 2.0]]]])
    g2 = np.array([[[[1.0, 2.0], [4.0, 8.0]]]])
    tx2, _ = make(m, x2, dtype)
    tg2, _ = make(m, g2, dtype)
    got = m.to_numpy(ml.max_pool2d_backward(tg2, tx2, 3, 2, 1)).astype(np.float64)
    want = np.zeros((1, 1, 3, 3))
    want[0, 0, 0, 0] = 1.0           # window (0,0) = rows 0-1, cols 0-1: all -inf
    want[0, 0, 0, 2] = 2.0           # window (0,1) = rows 0-1, cols 1-2: the 1
    want[0, 0, 2, 1] = 4.0 + 8.0     # windows (1,0) and (1,1) both pick the 9
    np.testing.assert_array_equal(got, want)


def special_operands(m, rng, shape, k, s, p, dtype, nan_share, inf_share=None):
    """x with ties, NaN and +-inf (special_input) and g with a share of NaN (then, given
    inf_share, of -inf) on the device: (x, its stored values, g, its stored values)."""
    x, hx = make(m, special_input(rng, shape), dtype)
    gv = rng.standard_normal(out_shape(shape, k, s, p))
    gv.reshape(-1)[rng.random(gv.size) < nan_share] = np.nan
    if inf_share is not None:
        gv.reshape(-1)[rng.random(gv.size) < inf_share] = -np.inf
    g, hg = make(m, gv, dtype)
    return x, hx, g, hg


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("kind", KINDS)
def test_special_values(apis, kind, dtype):
    """Ties, NaN and +-inf in x (max routes by the rule; avg ignores x), NaN and inf in g."""
    m, ml = apis
    rng = np.random.default_rng(4)
    for shape, k, s, p in CASES:
        x, hx, g, hg = special_operands(m, rng, shape, k, s, p, dtype, 0.03, 0.03)
        ref = brute(kind, hg, hx, k, s, p)
        with np.errstate(invalid="ignore"):
            b = bound(kind, hg, hx, k, s, p, ref, dtype)
        out = m.to_numpy(backward(ml, kind, g, x, k, s, p)).astype(np.float64)
        inf = np.isinf(ref)
        np.testing.assert_array_equal(out[inf], ref[inf])
        check(np.where(inf, 0.0, out), np.where(inf, 0.0, ref), np.where(inf, 1.0, b),
              f"{shape} {k} {s} {p}")


def fd_linear(f, x, analytic, h, rounding, what):
    """A function linear in x along each coordinate (avg pooling; max away from its kinks):
    the forward difference (f(x + h e_i) - f(x)) / h has no truncation error, only the
    rounding of the two values (each at most `rounding`) over h, plus 4 eps |analytic|."""
    flat = x.reshape(-1)
    f0 = f(x)
    for i in range(flat.size):
        xp = flat.copy()
        xp[i] += h
        d1 = (f(xp.reshape(x.shape)) - f0) / h
        tol = 2 * rounding / h + 4 * EPS64 * abs(analytic.flat[i])
        assert abs(d1 - analytic.flat[i]) <= tol, (what, i, d1, analytic.flat[i], tol)


@pytest.mark.parametrize("kind", KINDS)
def test_finite_differences(apis, kind):
    """d/dx_i sum(g * pool(x)) against forward differences of our forward pooling (float64).
    avg is linear; max is linear between its kinks: distinct values at least 0.01 apart and
    a step of 1e-4 keep every window's argmax. Rounding of one value: each output (a window
    sum of kh kw terms and its division, or an exact max) within (kh kw + 1) eps of the sum
    of |x| it covers, the sum over outputs N eps: (N + kh kw + 2) eps sum|g| max|x| bounds
    it."""
    m, ml = apis
    rng = np.random.default_rng(5)
    for shape, k, s, p in [((1, 2, 5, 6), 3, 2, 1), ((2, 1, 4, 5), 2, 1, 0),
                           ((1, 1, 6, 7), (3, 2), (2, 3), (1, 1)), ((1, 2, 4, 4), 2, None, 0)]:
        n, c, h, w = shape
        x = rng.permutation(n * c * h * w).reshape(shape) * 0.01 + rng.uniform(-1, 1)
        g = rng.standard_normal(out_shape(shape, k, s, p))
        fwd = ml.max_pool2d if kind == "max" else ml.avg_pool2d

        def L(xx):
            return float((m.to_numpy(fwd(m.from_numpy(xx), k, s, p)) * g).sum())
        dx = m.to_numpy(backward(ml, kind, m.from_numpy(g), m.from_numpy(x), k, s, p))
        kk = np.prod(triple(k, s, p)[0])
        rounding = (g.size + kk + 2) * EPS64 * np.abs(g).sum() * (np.abs(x).max() + 1e-4)
        fd_linear(L, x, dx, 1e-4, rounding, f"{shape} {k} {s} {p}")


def test_against_torch_autograd(apis):
    """PyTorch's autograd (CPU, float64) of F.max_pool2d / F.avg_pool2d: the same routing
    (ties, NaN) and the same sums, within our bound (twice: torch's float64 has the same
    kind of error)."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    m, ml = apis
    rng = np.random.default_rng(6)
    for shape, k, s, p in CASES:
        for x in (rng.standard_normal(shape), special_input(rng, shape)):
            g = rng.standard_normal(out_shape(shape, k, s, p))
            for kind in KINDS:
                xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
                fn = F.max_pool2d if kind == "max" else F.avg_pool2d
                y = fn(xt, k, s, p)
                y.backward(torch.tensor(g, dtype=torch.float64))
                want = xt.grad.numpy()
                got = m.to_numpy(backward(ml, kind, m.from_numpy(g), m.from_numpy(x), k, s, p))
                ref = brute(kind, g, x, k, s, p)
                check(got, want, 2 * bound(kind, g, x, k, s, p, ref, DT.FLOAT64),
                      f"{kind} {shape} {k} {s} {p}")


def test_empty_batch(apis):
    m, ml = apis
    for kind in KINDS:
        x = m.from_numpy(np.zeros((0, 3, 4, 4), np.float32))
        g = m.from_numpy(np.zeros((0, 3, 2, 2), np.float32))
        assert backward(ml, kind, g, x, 2).shape == (0, 3, 4, 4)


# -- bad input: one row per case ------------------------------------------------------------
def _f32(m, shape):
    return m.from_numpy(np.ones(shape, np.float32))


def _freed(m, shape):
    t = _f32(m, shape)
    t.free()
    return t


def _other_device(m, shape):
    """A tensor claiming the next device (no second GPU needed to reach the check)."""
    t = _f32(m, shape)
    return CudaTensor(t.shape, t.dtype, t.device_id + 1, t.ptr, owner=t)


X_SHAPE, G_SHAPE = (2, 3, 8, 8), (2, 3, 4, 4)
BAD = [
    # (id, error, message regex, grad_out maker, input maker, pool args)
    ("grad-shape", cb.ShapeMismatchError,
     r"grad_out has shape \(2, 3, 4, 5\), expected \(2, 3, 4, 4\): the output shape",
     lambda m: _f32(m, (2, 3, 4, 5)), lambda m: _f32(m, X_SHAPE), (2,)),
    ("grad-shape-stride", cb.ShapeMismatchError, r"expected \(2, 3, 7, 7\)",
     lambda m: _f32(m, G_SHAPE), lambda m: _f32(m, X_SHAPE), (2, 1)),
    ("input-3d", cb.InvalidArgumentError, r"4-D NCHW input, got shape \(3, 8, 8\)",
     lambda m: _f32(m, G_SHAPE), lambda m: _f32(m, (3, 8, 8)), (2,)),
    ("dtype-int32", cb.DTypeMismatchError, r"pool2d_backward does not support int32",
     lambda m: m.from_numpy(np.ones(G_SHAPE, np.int32)),
     lambda m: m.from_numpy(np.ones(X_SHAPE, np.int32)), (2,)),
    ("dtype-mixed", cb.DTypeMismatchError, r"mixed dtypes float32 and float64",
     lambda m: _f32(m, G_SHAPE), lambda m: m.from_numpy(np.ones(X_SHAPE)), (2,)),
    ("grad-not-tensor", cb.InvalidArgumentError, r"grad_out must be a CudaTensor",
     lambda m: np.ones(G_SHAPE, np.float32), lambda m: _f32(m, X_SHAPE), (2,)),
    ("input-not-tensor", cb.InvalidArgumentError, r"input must be a CudaTensor",
     lambda m: _f32(m, G_SHAPE), lambda m: np.ones(X_SHAPE, np.float32), (2,)),
    ("grad-freed", cb.TensorFreedError, r"was freed",
     lambda m: _freed(m, G_SHAPE), lambda m: _f32(m, X_SHAPE), (2,)),
    ("input-freed", cb.TensorFreedError, r"was freed",
     lambda m: _f32(m, G_SHAPE), lambda m: _freed(m, X_SHAPE), (2,)),
    ("device-mismatch", cb.DeviceMismatchError, r"different devices: cuda:0 and cuda:1",
     lambda m: _f32(m, G_SHAPE), lambda m: _other_device(m, X_SHAPE), (2,)),
    ("pool-size-zero", cb.InvalidArgumentError, r"pool_size must be >= 1, got \(0, 0\)",
     lambda m: _f32(m, G_SHAPE), lambda m: _f32(m, X_SHAPE), (0,)),
    ("pool-size-float", cb.InvalidArgumentError, r"pool_size must be an int or a pair",
     lambda m: _f32(m, G_SHAPE), lambda m: _f32(m, X_SHAPE), (2.0,)),
    ("stride-bool", cb.InvalidArgumentError, r"stride must be an int or a pair",
     lambda m: _f32(m, G_SHAPE), lambda m: _f32(m, X_SHAPE), (2, True)),
    ("padding-over-half", cb.InvalidArgumentError, r"padding \(2, 2\) must be at most half",
     lambda m: _f32(m, G_SHAPE), lambda m: _f32(m, X_SHAPE), (2, 2, 2)),
    ("window-too-big", cb.ShapeMismatchError, r"pool window \(9, 9\) .* does not fit",
     lambda m: _f32(m, G_SHAPE), lambda m: _f32(m, X_SHAPE), (9,)),
    ("empty-spatial", cb.InvalidArgumentError, r"non-empty spatial dimensions",
     lambda m: _f32(m, (2, 3, 0, 4)), lambda m: _f32(m, (2, 3, 0, 8)), (2,)),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("row", BAD, ids=[r[0] for r in BAD])
def test_bad_input(apis, kind, row):
    """Each bad input raises its typed error before anything is allocated; the next good
    call works."""
    m, ml = apis
    _, error, msg, make_g, make_x, args = row
    g, x = make_g(m), make_x(m)
    pool = m.backend.memory_pools.get(0) if m.gpu else None
    before = pool.get_stats()["active_memory"] if pool is not None else None
    with pytest.raises(error, match=msg):
        backward(ml, kind, g, x, *args)
    if pool is not None:
        assert pool.get_stats()["active_memory"] == before
    good = backward(ml, kind, _f32(m, G_SHAPE), _f32(m, X_SHAPE), 2)
    assert good.shape == X_SHAPE


def test_unknown_kind(apis):
    m, _ = apis
    with pytest.raises(cb.InvalidArgumentError, match="pool kind must be 'max' or 'avg'"):
        pb.pool2d_backward(m, "min", _f32(m, G_SHAPE), _f32(m, X_SHAPE), 2)


# -- kernel selection and launch arithmetic (CPU) -------------------------------------------
def test_mode_choice():
    f32, f16 = DT.FLOAT32, DT.FLOAT16
    k2, s2, p0 = (2, 2), (2, 2), (0, 0)
    assert pb.modes("max", (8, 64, 128, 128), k2, s2, p0, f32) == ["2x2", "direct"]
    assert pb.choose("avg", (8, 64, 128, 128), k2, s2, p0, f32, True) == "2x2"
    assert pb.choose("avg", (8, 64, 128, 128), k2, s2, p0, f32, False) == "direct"
    assert pb.modes("max", (8, 64, 8, 14), k2, s2, p0, f32) == ["direct"]   # 14 % 4
    k3, p1 = (3, 3), (1, 1)
    assert pb.choose("max", (8, 64, 112, 112), k3, s2, p1, f32, True) == "tile"
    assert pb.choose("avg", (8, 64, 112, 112), k3, s2, p1, f32, True) == "direct"
    assert pb.choose("max", (8, 64, 7, 7), k3, s2, p1, f32, True) == "direct"  # small tile
    assert pb.choose("max", (8, 64, 112, 112), k3, (3, 3), p1, f16, True) == "direct"
    # windows that would not fit a tile's shared arrays
    assert "tile" not in pb.modes("max", (1, 1, 512, 512), (200, 200), (1, 1), (0, 0), f32)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_tile_windows_fit(dtype):
    """For every config the tile mode is offered, each tile's window count (the kernel's
    arithmetic) is within MAX_WINDOWS and tile-local indices fit a short."""
    rng = np.random.default_rng(7)
    seen = 0
    for _ in range(300):
        kh, kw = rng.integers(1, 8, 2)
        sh, sw = rng.integers(1, 4, 2)
        ph, pw = rng.integers(0, kh // 2 + 1), rng.integers(0, kw // 2 + 1)
        h, w = rng.integers(max(kh, 1), 300), rng.integers(max(kw, 1), 300)
        k, s, p = (int(kh), int(kw)), (int(sh), int(sw)), (int(ph), int(pw))
        shape = (1, 1, int(h), int(w))
        if "tile" not in pb.modes("max", shape, k, s, p, dtype):
            continue
        seen += 1
        _, _, oh, ow = output_shape(shape, k, s, p)
        log2, th, tw = pb.tile_shape(int(w), dtype)
        assert th * tw <= 32767

        def first(i, pp, kk, ss):
            t = i + pp - kk + 1
            return 0 if t <= 0 else (t + ss - 1) // ss
        for r0 in range(0, int(h), th):
            r1 = min(r0 + th, int(h)) - 1
            nh = max(min(oh - 1, (r1 + p[0]) // s[0]) - first(r0, p[0], k[0], s[0]) + 1, 0)
            for c0 in range(0, int(w), tw):
                c1 = min(c0 + tw, int(w)) - 1
                nw = max(min(ow - 1, (c1 + p[1]) // s[1]) - first(c0, p[1], k[1], s[1]) + 1, 0)
                assert nh * nw <= pb.MAX_WINDOWS, (shape, k, s, p, nh, nw)
    assert seen > 20


def test_launch_arguments():
    """The item counts and divisors the kernels split their indices with."""
    f32 = DT.FLOAT32
    grid, args = pb.launch_args("direct", (2, 3, 7, 9), (3, 3), (2, 2), (1, 1), f32)
    assert args[0] == 2 * 3 * 7 * 3 and args[1:3] == (7, 9)
    assert args[3:6] == fast_divisor(3) and args[6:9] == fast_divisor(7)
    assert args[9:] == (4, 5, 3, 3, 2, 2, 1, 1) and grid == 1
    grid, args = pb.launch_args("2x2", (2, 3, 15, 32), (2, 2), (2, 2), (0, 0), f32)
    assert args == (2 * 3 * 8 * 8, 15, 32, *fast_divisor(8), *fast_divisor(8), 7)
    grid, args = pb.launch_args("tile", (2, 3, 40, 70), (3, 3), (2, 2), (1, 1), f32)
    log2, th, tw = pb.tile_shape(70, f32)
    assert (log2, th, tw) == (5, 8, 128)
    assert args[0] == 2 * 3 * 5 * 1 == grid and args[-1] == 5


def test_template_variants():
    v = pb.template_variants()[pb.TEMPLATE]
    assert len(v) == len(FLOATS) * (len(pb.MODES["max"]) + len(pb.MODES["avg"]))
    assert {(p["kind"], p["mode"]) for p in v} == {("max", "2x2"), ("max", "tile"),
                                                   ("max", "direct"), ("avg", "2x2"),
                                                   ("avg", "direct")}
    assert all(p["vec"] * DT.from_any(p["dtype"]).itemsize == 16 for p in v)
    assert all(("max_windows" in p) == (p["mode"] == "tile") for p in v)


# -- the GPU code paths on a stubbed driver (any machine) ---------------------------------
STUB_SCRIPT = r'''
    ml = CudaML(m)
    rng = np.random.default_rng(0)
    from cuda_backend.ops import pooling_backward as pb
    from cuda_backend.ops.pooling import output_shape

    def t(shape, dtype=np.float32):
        return m.from_numpy(rng.standard_normal(shape).astype(dtype))

    def odd_view(shape):
        base = t((int(np.prod(shape)) + 1,))
        return CudaTensor(shape, DT.FLOAT32, 0, base._ptr + 4, owner=base)

    def general_then_plan(call, key):
        """The general path's one launch (which makes the plan), then the plan's: the same
        grid, block and packed arguments, and a result tensor like the general path's."""
        m.plans.pop(key, None)
        launches.clear()
        r1 = call()
        ref, want = list(launches), slots(r1)
        assert len(ref) == 1 and key in m.plans, (key, ref)
        r1.free()                                  # the pool hands the same block back
        plan, seen = m.plans[key], []
        m.plans[key] = lambda *a: seen.append(plan(*a)) or seen[-1]
        launches.clear()
        r2 = call()
        m.plans[key] = plan
        assert len(seen) == 1 and seen[0] is not None and launches == ref, key
        like_general(r2, want)
        r2.free()

    modes = set()
    for shape, dt in (((1, 8, 16, 16), np.float32), ((2, 3, 41, 70), np.float32),
                      ((2, 4, 8, 24), np.float16), ((3, 2, 40, 72), np.float64)):
        X = t(shape, dt)
        for kind in ("max", "avg"):
            call = ml.max_pool2d_backward if kind == "max" else ml.avg_pool2d_backward
            for args in ((2, None, (0, 0)), (3, 2, 1), ((2, 3), (1, 2), (1, 0))):
                k, s, p = pb.window(*args, "test")
                G = t(output_shape(shape, k, s, p), dt)
                general_then_plan(lambda: call(G, X, *args),
                                  (pb.PUBLIC[kind], G.shape, X.shape, X.dtype, 0) + args)
                modes.add((kind, pb.choose(kind, X.shape, k, s, p, X.dtype, True)))
    assert modes == {("max", "2x2"), ("max", "tile"), ("max", "direct"), ("avg", "2x2"),
                     ("avg", "direct")}, modes
    # a plan made on misaligned operands steps aside for aligned ones (the general path adds
    # that variant), then takes both, each launching what the general path launched
    X, Xo, G, Go = t((1, 8, 16, 16)), odd_view((1, 8, 16, 16)), t((1, 8, 8, 8)), \
        odd_view((1, 8, 8, 8))
    for kind, call in (("max", ml.max_pool2d_backward), ("avg", ml.avg_pool2d_backward)):
        key = (pb.PUBLIC[kind], G.shape, X.shape, X.dtype, 0, 2, None, (0, 0))
        m.plans.pop(key, None)
        launches.clear(); call(Go, Xo, 2).free(); odd = list(launches)
        plan = m.plans[key]
        launches.clear(); call(G, X, 2).free(); aligned = list(launches)
        assert m.plans[key] is plan and sorted(plan.variants) == ["2x2", "direct"]
        launches.clear(); call(G, X, 2).free(); assert launches == aligned
        launches.clear(); call(Go, Xo, 2).free(); assert launches == odd
        # values equal to the plan's key but not ints reach the checks, and nothing leaks
        G9 = t((1, 8, 8, 9))
        before = pool.get_stats()["active_blocks"]
        for bad in ((2.0,), (True,), ((2, 2.0),), (2, 2.0), (2, None, (0.0, 0))):
            with pytest.raises(InvalidArgumentError):
                call(G, X, *bad)
        with pytest.raises(ShapeMismatchError):
            call(G9, X, 2)
        assert pool.get_stats()["active_blocks"] == before
    print("OK")
'''


def test_plans_match_the_general_path_on_a_stubbed_driver():
    """With PyCUDA replaced by perf/bench_host_path.py's stubs (tests/test_host_path.py's
    harness), the GPU code paths run on any machine: every mode's general path makes a
    plan that launches exactly what it launched; misaligned and aligned operands share one
    plan; float or bool window values equal to a plan's key still raise."""
    from test_host_path import BACKEND, STUBS, run_script, script
    run_script(script(STUBS, "\n    from cuda_backend.cuda_ml import CudaML\n    from "
                      "cuda_backend.errors import InvalidArgumentError, ShapeMismatchError\n",
                      BACKEND, STUB_SCRIPT))


# -- GPU --------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
# shapes that offer every mode: 2x2 layers (even and odd H), tile-sized overlapping windows
GPU_CASES = CASES + [
    ((2, 3, 41, 70), 3, 2, 1),
    ((1, 2, 130, 9), 3, 2, 1),
    ((1, 2, 33, 40), 3, 1, 1),
    ((1, 1, 300, 5), 7, 3, 3),
    ((2, 3, 21, 64), 2, None, 0),
    ((3, 2, 40, 72), (3, 2), (2, 1), (1, 1)),
]


def poisoned(m, shape, dtype):
    return m.from_numpy(np.full(shape, np.nan, host_dtype(dtype)), dtype=dtype)


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_every_mode(apis, kind, dtype):
    """Every mode able to run each case (launched directly on a poisoned dx: every element
    must be written), within the bound, and bit for bit the same across modes (each sums the
    same terms in the same order)."""
    m, _ = apis
    rng = np.random.default_rng(10)
    offered = set()
    for shape, ps, st, pd in GPU_CASES:
        k, s, p = triple(ps, st, pd)
        x, hx = make(m, rng.standard_normal(shape), dtype)
        g, hg = make(m, rng.standard_normal(out_shape(shape, k, s, p)), dtype)
        ref = brute(kind, hg, hx, k, s, p)
        b = bound(kind, hg, hx, k, s, p, ref, dtype)
        results = {}
        for mode in pb.modes(kind, shape, k, s, p, dtype):
            dx = poisoned(m, shape, dtype)
            pb.launch(m, kind, mode, g, x, dx, k, s, p)
            results[mode] = m.to_numpy(dx).astype(np.float64)
            check(results[mode], ref, b, f"{mode} {shape} {k} {s} {p}")
            dx.free()
        first = next(iter(results.values()))
        for mode, r in results.items():
            np.testing.assert_array_equal(r, first, err_msg=f"{mode} {shape}")
        offered |= set(results)
        x.free(), g.free()
    assert offered == set(pb.MODES[kind])


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_special_values_every_mode(apis, kind, dtype):
    """Ties, NaN, +-inf in x and NaN / inf in g through every mode: the forward's routing."""
    m, _ = apis
    rng = np.random.default_rng(11)
    for shape, ps, st, pd in GPU_CASES:
        k, s, p = triple(ps, st, pd)
        x, hx, g, hg = special_operands(m, rng, shape, k, s, p, dtype, 0.02)
        ref = brute(kind, hg, hx, k, s, p)
        b = bound(kind, hg, hx, k, s, p, ref, dtype)
        for mode in pb.modes(kind, shape, k, s, p, dtype):
            dx = poisoned(m, shape, dtype)
            pb.launch(m, kind, mode, g, x, dx, k, s, p)
            check(m.to_numpy(dx), ref, b, f"{mode} {shape} {k} {s} {p}")
            dx.free()
        x.free(), g.free()


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_second_call_takes_the_plan(apis, kind, dtype):
    """The public method twice on fresh operands: the second call goes through the plan the
    first made (2x2 on aligned operands, tile / direct otherwise), with the same result."""
    m, ml = apis
    rng = np.random.default_rng(12)
    for shape, ps, st, pd in [((3, 5, 10, 16), 2, None, (0, 0)), ((2, 3, 41, 70), 3, 2, 1),
                              ((1, 7, 9, 13), (2, 3), (1, 2), (1, 0))]:
        g_shape = out_shape(shape, ps, st, pd)
        key = (pb.PUBLIC[kind], g_shape, shape, dtype, 0, ps, st, pd)
        m.plans.pop(key, None)
        hx = rng.standard_normal(shape)
        hg = rng.standard_normal(g_shape)
        outs = []
        for second in (False, True):
            x, sx = make(m, hx, dtype)
            g, sg = make(m, hg, dtype)
            call = lambda: backward(ml, kind, g, x, ps, st, pd)  # noqa: E731
            dx = call_through_plan(m, key, call) if second else call()
            assert key in m.plans
            ref = brute(kind, sg, sx, ps, st, pd)
            outs.append(m.to_numpy(dx))
            check(outs[-1], ref, bound(kind, sg, sx, ps, st, pd, ref, dtype),
                  f"{shape} second={second}")
            x.free(), g.free(), dx.free()
        np.testing.assert_array_equal(outs[0], outs[1])


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_misaligned_views(apis, kind, dtype):
    """x and g one element past 16-byte alignment: the 2x2 kernel is not taken where it
    needs wider alignment (a plan made on aligned operands hands such a call back to the
    general path); the same values."""
    m, ml = apis
    rng = np.random.default_rng(13)
    shape = (2, 3, 16, 32)
    g_shape = (2, 3, 8, 16)
    hx, hg = rng.standard_normal(shape), rng.standard_normal(g_shape)
    xa, sx = make(m, hx, dtype)
    ga, sg = make(m, hg, dtype)
    aligned = m.to_numpy(backward(ml, kind, ga, xa, 2)).astype(np.float64)

    def view(values):
        base, h = make(m, np.concatenate([[0.0], values.ravel()]), dtype)
        return CudaTensor(values.shape, dtype, base.device_id, base.ptr + dtype.itemsize,
                          owner=base), base
    xv, bx = view(hx)
    gv, bg = view(hg)
    got = m.to_numpy(backward(ml, kind, gv, xv, 2)).astype(np.float64)
    np.testing.assert_array_equal(got, aligned)
    ref = brute(kind, sg, sx, 2)
    check(got, ref, bound(kind, sg, sx, 2, None, 0, ref, dtype), "misaligned")
    for t in (xa, ga, bx, bg):
        t.free()


@gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_deterministic_on_large_inputs(apis, kind):
    """The benchmark shapes (2x2 and 3x3 stride 2 padding 1): against the reference, and
    bit for bit the same on a repeat (no atomics)."""
    m, ml = apis
    rng = np.random.default_rng(14)
    for shape, k, s, p in [((8, 64, 128, 128), 2, None, 0), ((4, 64, 112, 112), 3, 2, 1)]:
        hx = rng.standard_normal(shape, dtype=np.float32)
        hg = rng.standard_normal(out_shape(shape, k, s, p), dtype=np.float32)
        x, g = m.from_numpy(hx), m.from_numpy(hg)
        a = m.to_numpy(backward(ml, kind, g, x, k, s, p))
        b = m.to_numpy(backward(ml, kind, g, x, k, s, p))
        np.testing.assert_array_equal(a, b)
        ref = pb.reference(kind, hg, hx, k, s, p)
        S = pb.reference(kind, np.abs(hg).astype(np.float64), hx, k, s, p)
        t = terms(k, s, p) - (kind == "max")
        check(a, ref, 2.0**-24 * (np.abs(ref) + t * S) + 1e-30, f"{shape}")
        x.free(), g.free()


@gpu
def test_gpu_bad_input_leaves_the_pool_as_it_was(apis):
    m, ml = apis
    pool = m.backend.memory_pools[0]
    x, g = _f32(m, X_SHAPE), _f32(m, (2, 3, 4, 5))
    before = pool.get_stats()["active_memory"]
    for kind in KINDS:
        with pytest.raises(cb.ShapeMismatchError):
            backward(ml, kind, g, x, 2)
    assert pool.get_stats()["active_memory"] == before
