"""layer_norm and batch_norm backward (ops/normalization_backward.py) against float64 references
written here, central finite differences of float64 forwards written here, and PyTorch's
autograd when torch is importable.

Bounds are derived, not tuned. u is the unit roundoff of the math type (2^-24 for float32 and
the half types, which compute in float32; 2^-53 for float64), u_out that of the storage
(one rounding of each output), n a sum's depth (the most terms added in sequence: a
thread's share, then the butterflies and the block's fixed-order sums). For a layer-norm row
(D elements, rstd, xhat, gw = g * w, c1 = mean(gw), c2 = mean(gw * xhat)):
  the mean is off by dmu <= u (n + 1) mean|x|, i.e. E = dmu * rstd in units of the std;
  rstd by the relative e_r = u (n + 8) + E^2 (the variance's sum, rsqrt's 2 ulp);
  xhat by dxhat = E + |xhat| (e_r + 2u);  c1 by u (n + 2) mean|gw|;
  c2 by E |c1| + u (n + 4) mean|gw xhat| + |c2| e_r;
  dx = rstd (gw - c1 - xhat c2) by |dx| (e_r + u) + rstd (dc1 + dxhat |c2| + |xhat| dc2 +
  4u (|gw| + |c1| + |xhat c2|)): the gradient's condition, |g| |w| rstd (1 + |xhat|^2)
  summed over the row, in these terms;
  grad_weight = sum over rows of g xhat by sum |g| dxhat + u (rows + 12) sum |g xhat|;
  grad_bias by u (rows + 11) sum |g|; each plus u_out |value|.
Batch norm follows the same steps per channel with the kernels' shifted sums (K = the
channel's first element): see bn_bounds. Tests marked `gpu` run every kernel path (warp,
block and loop modes at their capacity boundaries, aligned and misaligned, both layouts,
training and inference) and the per-call plans; the rest run in whatever mode the backend
is in (NumPy fallback without a GPU).
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers import (ATOL, EPS64, FLOATS, U_ACC, U_OUT, call_through_plan, check, make,
                     misaligned)

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend.cuda_math import CudaMath
from cuda_backend.cuda_ml import CudaML
from cuda_backend.driver import load_driver
from cuda_backend.ops import batch_norm_backward_plans as bb
from cuda_backend.ops import layer_norm_backward_plans as lb
from cuda_backend.ops import normalization_backward as nb
from cuda_backend.performance import cases_ml_grads

GPU = load_driver()[0] is not None
# odd row lengths, and 9000: longer than any register plan (8192; float64 4096): loop mode
ROW_LENGTHS = [1, 7, 33, 1000, 4097, 9000]


@pytest.fixture(scope="module")
def apis(backend):
    m = CudaMath(backend)
    return m, CudaML(m)


def row_depth(D):
    """A row sum's depth, any plan: at most 8 elements per thread in registers (ceil(D /
    512) in the loop kernels), 5 butterfly levels and 32 warps."""
    return 80 + -(-D // 256)


# -- layer norm: reference and bounds --------------------------------------------------------
def ref_ln(g, x, w, eps):
    """(dx, dw, db) and the row terms, float64; w None means 1 (dw is then sum g xhat)."""
    D = x.shape[-1]
    mu = x.mean(-1, keepdims=True)
    d = x - mu
    rstd = 1 / np.sqrt((d * d).mean(-1, keepdims=True) + eps)
    xhat = d * rstd
    gw = g if w is None else g * w
    c1 = gw.mean(-1, keepdims=True)
    c2 = (gw * xhat).mean(-1, keepdims=True)
    dx = rstd * (gw - c1 - xhat * c2)
    g2, xh2 = g.reshape(-1, D), xhat.reshape(-1, D)
    return dx, (g2 * xh2).sum(0), g2.sum(0), (rstd, xhat, gw, c1, c2)


def ln_bounds(g, x, w, eps, dtype):
    """(dx, dw, db, their bounds): the module docstring's steps."""
    dx, dw, db, (rstd, xhat, gw, c1, c2) = ref_ln(g, x, w, eps)
    D = x.shape[-1]
    rows = x.size // max(D, 1)
    u, uo, n = U_ACC[dtype], U_OUT[dtype], row_depth(D)
    E = u * (n + 1) * np.abs(x).mean(-1, keepdims=True) * rstd
    e_r = u * (n + 8) + E * E
    dxhat = E + np.abs(xhat) * (e_r + 2 * u)
    dc1 = u * (n + 2) * np.abs(gw).mean(-1, keepdims=True)
    dc2 = E * np.abs(c1) + u * (n + 4) * np.abs(gw * xhat).mean(-1, keepdims=True) + \
        np.abs(c2) * e_r
    b_dx = np.abs(dx) * (e_r + u + uo) + rstd * (
        dc1 + dxhat * np.abs(c2) + np.abs(xhat) * dc2
        + 4 * u * (np.abs(gw) + np.abs(c1) + np.abs(xhat * c2))) + ATOL[dtype]
    g2 = np.abs(g).reshape(-1, D)
    b_dw = uo * np.abs(dw) + (g2 * np.broadcast_to(dxhat, x.shape).reshape(-1, D)).sum(0) + \
        u * (rows + 12) * (g2 * np.abs(xhat).reshape(-1, D)).sum(0) + ATOL[dtype]
    b_db = uo * np.abs(db) + u * (rows + 11) * g2.sum(0) + ATOL[dtype]
    return dx, dw, db, b_dx, b_dw, b_db


def check_ln(m, out, hg, hx, hw, eps, dtype, what):
    dx, dw, db = out
    rdx, rdw, rdb, bdx, bdw, bdb = ln_bounds(hg, hx, hw, eps, dtype)
    D = hx.shape[-1]
    assert dx.shape == hx.shape and dx.dtype is dtype, what
    assert db.shape == (D,) and db.dtype is dtype, what
    check(m.to_numpy(dx), rdx, bdx, f"dx {what}")
    check(m.to_numpy(db), rdb, bdb, f"db {what}")
    if hw is None:
        assert dw is None, what
    else:
        assert dw.shape == (D,) and dw.dtype is dtype, what
        check(m.to_numpy(dw), rdw, bdw, f"dw {what}")


# -- batch norm: reference and bounds --------------------------------------------------------
def ref_bn(g, x, gamma, eps, training, rm=None, rv=None):
    """(dx, dgamma, dbeta) and the channel terms, float64."""
    C = x.shape[1]
    sh = (1, C) + (1,) * (x.ndim - 2)
    axes = (0,) + tuple(range(2, x.ndim))
    M = x.size // C
    mean, var = (x.mean(axis=axes), x.var(axis=axes)) if training else (rm, rv)
    rstd = 1 / np.sqrt(var + eps)
    xhat = (x - mean.reshape(sh)) * rstd.reshape(sh)
    db = g.sum(axis=axes)
    dg = (g * xhat).sum(axis=axes)
    scale = (gamma * rstd).reshape(sh)
    dx = scale * (g - db.reshape(sh) / M - xhat * dg.reshape(sh) / M) if training else scale * g
    return dx, dg, db, (sh, axes, M, mean, var, rstd)


def bn_depth(m, shape, dtype):
    """The partial sums' depth: the most elements a thread adds (the geometry's `terms` on
    this device; 1 SM in fallback mode, the most), then 16 for the warp, block and split
    sums."""
    N, C = shape[0], shape[1]
    S = int(np.prod(shape[2:])) if len(shape) > 2 else 1
    sms = m.backend.get_device_info(0).multiprocessor_count if GPU else 1
    layout = "nc" if S == 1 else "ncs"
    vec = 16 // dtype.itemsize
    terms = max(bb.bn_geometry(layout, N, C, S, ok, vec, sms, fuse)["terms"]
                for ok in (0, 1) if ok == 0 or (C if layout == "nc" else S) % vec == 0
                for fuse in (False, True))
    return terms + 16


def bn_bounds(m, g, x, gamma, eps, training, dtype, rm=None, rv=None):
    """(dx, dgamma, dbeta, their bounds): the partial sums' errors u (n + 2) sum |term| (the
    terms are x - K, (x - K)^2, g, g (x - K) with K the channel's first element; inference:
    g, g (x - mean)), the double finalize (mean, var = s2/M - dm^2, rstd relative
    e_r = dvar / (2 (var + eps)), dgamma = rstd (sgx - dm sg)), the coefficients A = gamma
    rstd, B = -gamma rstd^2 dgamma / M, Dc = -gamma rstd dbeta / M rounded to the math type,
    and dx = A g + B (x - mean) + Dc with 4u on its terms; inference dx = g gamma rstd with
    4u."""
    dx, dg, db, (sh, axes, M, mean, var, rstd) = ref_bn(g, x, gamma, eps, training, rm, rv)
    u, uo, n = U_ACC[dtype], U_OUT[dtype], bn_depth(m, x.shape, dtype)
    ag = np.abs(g)
    s_g = u * (n + 2) * ag.sum(axis=axes)
    if not training:
        s_gx = u * (n + 2) * (ag * np.abs(x - mean.reshape(sh))).sum(axis=axes)
        b_dx = (4 * u + uo) * np.abs(dx) + ATOL[dtype]
        b_dg = rstd * s_gx + uo * np.abs(dg) + ATOL[dtype]
        return dx, dg, db, b_dx, b_dg, s_g + uo * np.abs(db) + ATOL[dtype]
    K = x[(0, slice(None)) + (0,) * (x.ndim - 2)]
    dK = np.abs(x - K.reshape(sh))
    ds1 = u * (n + 2) * dK.sum(axis=axes)
    ds2 = u * (n + 2) * (dK * dK).sum(axis=axes)
    ds_gx = u * (n + 2) * (ag * dK).sum(axis=axes)
    dm = mean - K
    ddm = ds1 / M
    dvar = ds2 / M + 2 * np.abs(dm) * ddm
    e_r = dvar / (2 * (var + eps)) + 4 * EPS64
    ddg = np.abs(dg) * e_r + rstd * (ds_gx + np.abs(db) * ddm + np.abs(dm) * s_g)
    ag_ = np.abs(gamma)
    A, B, Dc = gamma * rstd, -gamma * rstd**2 * dg / M, -gamma * rstd * db / M
    dA = np.abs(A) * (e_r + u)
    dB = np.abs(B) * (2 * e_r + u) + ag_ * rstd**2 * ddg / M
    dDc = np.abs(Dc) * (e_r + u) + ag_ * rstd * s_g / M
    dmu = ddm + u * np.abs(mean)
    r = lambda a: a.reshape(sh)  # noqa: E731
    xm = np.abs(x - r(mean))
    b_dx = ag * r(dA) + xm * r(dB) + r(np.abs(B) * dmu) + r(dDc) + \
        4 * u * (np.abs(r(A) * g) + np.abs(r(B)) * xm + np.abs(r(Dc))) + \
        uo * np.abs(dx) + ATOL[dtype]
    return dx, dg, db, b_dx, ddg + uo * np.abs(dg) + ATOL[dtype], \
        s_g + uo * np.abs(db) + ATOL[dtype]


def check_bn(m, out, hg, hx, hgam, eps, training, dtype, what, hrm=None, hrv=None):
    dx, dg, db = out
    rdx, rdg, rdb, bdx, bdg, bdb = bn_bounds(m, hg, hx, hgam, eps, training, dtype, hrm, hrv)
    C = hx.shape[1]
    assert dx.shape == hx.shape and dx.dtype is dtype, what
    assert dg.shape == (C,) and db.shape == (C,) and dg.dtype is dtype, what
    check(m.to_numpy(dx), rdx, bdx, f"dx {what}")
    check(m.to_numpy(dg), rdg, bdg, f"dgamma {what}")
    check(m.to_numpy(db), rdb, bdb, f"dbeta {what}")


def ln_inputs(m, rng, shape, dtype, weight=True, offset=0.0):
    g, hg = make(m, rng.standard_normal(shape), dtype)
    x, hx = make(m, rng.standard_normal(shape) * 2 + offset, dtype)
    w, hw = make(m, rng.uniform(0.5, 1.5, shape[-1]) * rng.choice([-1, 1], shape[-1]),
                 dtype) if weight else (None, None)
    return g, hg, x, hx, w, hw


def bn_inputs(m, rng, shape, dtype, offset=0.0):
    C = shape[1]
    g, hg = make(m, rng.standard_normal(shape), dtype)
    x, hx = make(m, rng.standard_normal(shape) * 1.5 + offset, dtype)
    gam, hgam = make(m, rng.uniform(0.5, 1.5, C), dtype)
    rm, hrm = make(m, rng.standard_normal(C) * 0.3 + offset, dtype)
    rv, hrv = make(m, rng.uniform(0.5, 2.0, C), dtype)
    return g, hg, x, hx, gam, hgam, rm, hrm, rv, hrv


def free(*ts):
    for t in ts:
        if isinstance(t, (tuple, list)):
            free(*t)
        elif t is not None:
            t.free()


# -- any mode: layer norm --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_layer_norm_backward_rows(apis, dtype):
    """Every odd row length (9000: the loop kernels) times 1 and 5 rows, a 3-D input, with
    and without weight, an offset mean, eps 1e-5 and 0.1."""
    m, ml = apis
    rng = np.random.default_rng(1)
    for i, D in enumerate(ROW_LENGTHS):
        for shape in ((1, D), (5, D), (2, 3, D)):
            weight = (i + len(shape)) % 2 == 0
            eps = 0.1 if shape[0] == 1 else 1e-5
            g, hg, x, hx, w, hw = ln_inputs(m, rng, shape, dtype, weight, offset=3.0 * (i % 2))
            out = ml.layer_norm_backward(g, x, w, eps=eps)
            check_ln(m, out, hg, hx, hw, eps, dtype, f"{shape} weight={weight}")
            free(out, g, x, w)


def test_layer_norm_backward_edges(apis):
    """No rows: grad_x empty, grad_weight and grad_bias zeros; a constant row: xhat 0, the
    gradient rstd (g w - mean(g w)); 1-D input (one row); the default eps."""
    m, ml = apis
    x0, g0, w0 = (m.from_numpy(np.zeros(s)) for s in ((0, 5), (0, 5), (5,)))
    dx, dw, db = ml.layer_norm_backward(g0, x0, w0)
    assert dx.shape == (0, 5) and m.to_numpy(dw).tolist() == [0] * 5 and \
        m.to_numpy(db).tolist() == [0] * 5
    dx, dw, db = ml.layer_norm_backward(m.from_numpy(np.zeros((2, 0))),
                                        m.from_numpy(np.zeros((2, 0))))
    assert dx.shape == (2, 0) and dw is None and db.shape == (0,)
    g = np.array([[1.0, -2.0, 0.5, 3.0]])
    dx, dw, db = ml.layer_norm_backward(m.from_numpy(g), m.from_numpy(np.full((1, 4), 7.0)),
                                        m.from_numpy(np.array([1.0, 2.0, 3.0, 4.0])))
    gw = g * [1, 2, 3, 4]
    np.testing.assert_allclose(m.to_numpy(dx), (gw - gw.mean()) / np.sqrt(1e-5), rtol=1e-12)
    assert np.all(m.to_numpy(dw) == 0)
    np.testing.assert_array_equal(m.to_numpy(db), g[0])
    rng = np.random.default_rng(2)
    g1, x1 = rng.standard_normal(6), rng.standard_normal(6)
    dx, _, _ = ml.layer_norm_backward(m.from_numpy(g1), m.from_numpy(x1))
    np.testing.assert_allclose(m.to_numpy(dx), ref_ln(g1, x1, None, 1e-5)[0], rtol=1e-12,
                               atol=1e-14)


# -- any mode: batch norm --------------------------------------------------------------------
BN_SHAPES = [(5, 3), (4, 8), (257, 6), (3, 5, 7), (2, 4, 8), (4, 3, 5, 5), (2, 16, 4, 4),
             (1, 3, 1, 2)]


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_batch_norm_backward(apis, dtype, training):
    """(N, C), (N, C, L), (N, C, H, W) at odd sizes, an offset mean (the shifted sums)."""
    m, ml = apis
    rng = np.random.default_rng(3)
    for i, shape in enumerate(BN_SHAPES):
        g, hg, x, hx, gam, hgam, rm, hrm, rv, hrv = bn_inputs(m, rng, shape, dtype,
                                                             offset=4.0 * (i % 2))
        eps = 1e-3 if i % 3 == 0 else 1e-5
        if training:
            out = ml.batch_norm_backward(g, x, gam, eps=eps)
        else:
            out = ml.batch_norm_backward(g, x, gam, eps=eps, training=False, running_mean=rm,
                                         running_var=rv)
        check_bn(m, out, hg, hx, hgam, eps, training, dtype, f"{shape}", hrm, hrv)
        free(out, g, x, gam, rm, rv)


def test_batch_norm_backward_edges(apis):
    """Inference on an empty batch: zeros for gamma and beta; no channels: empty results;
    training accepts (and ignores) running statistics."""
    m, ml = apis
    C = 3
    z = m.from_numpy(np.zeros((0, C, 2, 2)))
    gam, rm, rv = (m.from_numpy(np.full(C, v)) for v in (1.5, 0.0, 1.0))
    dx, dg, db = ml.batch_norm_backward(z, z, gam, training=False, running_mean=rm,
                                        running_var=rv)
    assert dx.shape == (0, C, 2, 2) and m.to_numpy(dg).tolist() == [0] * C and \
        m.to_numpy(db).tolist() == [0] * C
    e = m.from_numpy(np.zeros((4, 0)))
    dx, dg, db = ml.batch_norm_backward(e, e, m.from_numpy(np.zeros(0)))
    assert dx.shape == (4, 0) and dg.shape == (0,) and db.shape == (0,)
    rng = np.random.default_rng(4)
    x, g = rng.standard_normal((6, C)), rng.standard_normal((6, C))
    a = ml.batch_norm_backward(m.from_numpy(g), m.from_numpy(x), gam)
    b = ml.batch_norm_backward(m.from_numpy(g), m.from_numpy(x), gam, running_mean=rm,
                               running_var=rv)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(m.to_numpy(u), m.to_numpy(v))


# -- finite differences (float64, any mode) ------------------------------------------------
def fd_check(L, x0, analytic, h, scale, what):
    """analytic = dL/dt at x0 against the central difference at step h/2, D(h/2); its
    truncation error is about (D(h) - D(h/2)) / 3 (D(h) = f' + h^2 f'''/6 + O(h^4)): the
    tolerance is |D(h) - D(h/2)| (three times that) plus the rounding of L's values (each
    within 8 eps * scale) over the step, and 4 eps |analytic|."""
    def d(step):
        return (L(x0 + step) - L(x0 - step)) / (2 * step)
    d1, d2 = d(h), d(h / 2)
    tol = np.abs(d1 - d2) + 2 * 8 * EPS64 * scale / (h / 2) + 4 * EPS64 * np.abs(analytic)
    assert np.all(np.abs(analytic - d2) <= tol), (what, analytic, d2, tol)


def ln_forward(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    d = x - mu
    return d / np.sqrt((d * d).mean(-1, keepdims=True) + eps) * w + b


def bn_forward(x, gamma, beta, eps, training, rm=None, rv=None):
    C = x.shape[1]
    sh = (1, C) + (1,) * (x.ndim - 2)
    axes = (0,) + tuple(range(2, x.ndim))
    mean, var = (x.mean(axis=axes), x.var(axis=axes)) if training else (rm, rv)
    return (x - mean.reshape(sh)) / np.sqrt(var.reshape(sh) + eps) * gamma.reshape(sh) + \
        beta.reshape(sh)


def _fd_all(L_of, params, h, what):
    """fd_check of every coordinate of every named parameter: L_of(name, index, value)."""
    for name, (p, got) in params.items():
        for idx in np.ndindex(p.shape):
            def L(t, name=name, idx=idx):
                return L_of(name, idx, t)
            scale = L_of(name, idx, p[idx], magnitude=True)
            fd_check(L, p[idx], got[idx], h, scale, (what, name, idx))


def test_layer_norm_backward_finite_differences(apis):
    """d/dt of L = sum(G * layer_norm(x, w, b)) along each coordinate of x, w and b."""
    m, ml = apis
    rng = np.random.default_rng(5)
    x, G = rng.standard_normal((3, 5)) * 2 + 1, rng.standard_normal((3, 5))
    w, b, eps = rng.standard_normal(5), rng.standard_normal(5), 1e-3
    dx, dw, db = (m.to_numpy(t) for t in ml.layer_norm_backward(
        m.from_numpy(G), m.from_numpy(x), m.from_numpy(w), eps=eps))
    vals = {"x": x, "w": w, "b": b}

    def L_of(name, idx, t, magnitude=False):
        v = {k: a.copy() for k, a in vals.items()}
        v[name][idx] = t
        terms = G * ln_forward(v["x"], v["w"], v["b"], eps)
        return np.abs(terms).sum() * 4 * x.shape[-1] if magnitude else terms.sum()
    _fd_all(L_of, {"x": (x, dx), "w": (w, dw), "b": (b, db)}, 1e-3, "layer_norm")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_batch_norm_backward_finite_differences(apis, training):
    """d/dt of L = sum(G * batch_norm(x, gamma, beta)) along each coordinate of x, gamma and
    beta (training: the batch statistics move with x)."""
    m, ml = apis
    rng = np.random.default_rng(6)
    x, G = rng.standard_normal((3, 2, 2, 2)) + 0.5, rng.standard_normal((3, 2, 2, 2))
    gamma, beta = rng.standard_normal(2), rng.standard_normal(2)
    rm, rv, eps = rng.standard_normal(2) * 0.2, rng.uniform(0.5, 2, 2), 1e-3
    kw = {} if training else {"training": False, "running_mean": m.from_numpy(rm),
                              "running_var": m.from_numpy(rv)}
    dx, dg, db = (m.to_numpy(t) for t in ml.batch_norm_backward(
        m.from_numpy(G), m.from_numpy(x), m.from_numpy(gamma), eps=eps, **kw))
    vals = {"x": x, "gamma": gamma, "beta": beta}

    def L_of(name, idx, t, magnitude=False):
        v = {k: a.copy() for k, a in vals.items()}
        v[name][idx] = t
        terms = G * bn_forward(v["x"], v["gamma"], v["beta"], eps, training, rm, rv)
        return np.abs(terms).sum() * 4 * x.size if magnitude else terms.sum()
    _fd_all(L_of, {"x": (x, dx), "gamma": (gamma, dg), "beta": (beta, db)}, 1e-3,
            f"batch_norm training={training}")


# -- PyTorch's autograd (CPU torch, float64) ------------------------------------------------
def test_against_torch_autograd(apis):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    m, ml = apis
    rng = np.random.default_rng(7)
    dt = DT.FLOAT64
    t64 = lambda a: torch.tensor(a, dtype=torch.float64, requires_grad=True)  # noqa: E731
    x, G = rng.standard_normal((6, 33)) * 2 + 1, rng.standard_normal((6, 33))
    w, b = rng.standard_normal(33), rng.standard_normal(33)
    xt, wt, bt = t64(x), t64(w), t64(b)
    F.layer_norm(xt, (33,), wt, bt, 1e-5).backward(torch.tensor(G))
    ours = ml.layer_norm_backward(m.from_numpy(G), m.from_numpy(x), m.from_numpy(w))
    _, _, _, bdx, bdw, bdb = ln_bounds(G, x, w, 1e-5, dt)
    # twice our bound: torch's float64 result carries the same kind of error
    for got, want, bd, what in zip(ours, (xt.grad, wt.grad, bt.grad), (bdx, bdw, bdb),
                                   ("dx", "dw", "db")):
        check(m.to_numpy(got), want.numpy(), 2 * bd, f"layer_norm {what}")
    for training in (True, False):
        xb, Gb = rng.standard_normal((5, 3, 4, 3)) + 2, rng.standard_normal((5, 3, 4, 3))
        gam, bet = rng.uniform(0.5, 1.5, 3), rng.standard_normal(3)
        rm, rv = rng.standard_normal(3) * 0.3, rng.uniform(0.5, 2, 3)
        xt, gt, bt = t64(xb), t64(gam), t64(bet)
        F.batch_norm(xt, torch.tensor(rm), torch.tensor(rv), gt, bt, training=training,
                     eps=1e-5).backward(torch.tensor(Gb))
        kw = {} if training else {"training": False, "running_mean": m.from_numpy(rm),
                                  "running_var": m.from_numpy(rv)}
        ours = ml.batch_norm_backward(m.from_numpy(Gb), m.from_numpy(xb), m.from_numpy(gam),
                                      **kw)
        _, _, _, bdx, bdg, bdb = bn_bounds(m, Gb, xb, gam, 1e-5, training, dt, rm, rv)
        for got, want, bd, what in zip(ours, (xt.grad, gt.grad, bt.grad), (bdx, bdg, bdb),
                                       ("dx", "dgamma", "dbeta")):
            check(m.to_numpy(got), want.numpy(), 2 * bd, f"batch_norm {training} {what}")


# -- the report's references, the module's reference and the plans ----------------------------
def test_references_agree():
    """The module's `reference` and the report cases' NumPy references against the ones
    written here."""
    rng = np.random.default_rng(8)
    g, x, w = rng.standard_normal((4, 9)), rng.standard_normal((4, 9)) + 1, rng.standard_normal(9)
    want = ref_ln(g, x, w, 1e-5)
    got = nb.reference("layer_norm", g, x, w)
    for a, b in zip(got, want[:3]):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)
    assert nb.reference("layer_norm", g, x)[1] is None
    np.testing.assert_allclose(cases_ml_grads.layer_norm_grad(np, g, x, w), want[0], rtol=1e-13,
                               atol=1e-14)
    gb, xb, gam = rng.standard_normal((3, 4, 2, 5)), rng.standard_normal((3, 4, 2, 5)), \
        rng.uniform(0.5, 1.5, 4)
    rm, rv = rng.standard_normal(4), rng.uniform(0.5, 2, 4)
    for training, extra in ((True, ()), (False, (rm, rv))):
        want = ref_bn(gb, xb, gam, 1e-5, training, *extra)
        got = nb.reference("batch_norm", gb, xb, gam, *extra, training=training)
        for a, b in zip(got, want[:3]):
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(cases_ml_grads.batch_norm_grad(np, gb, xb, gam, *extra), want[0],
                                   rtol=1e-13, atol=1e-14)
    with pytest.raises(cb.InvalidArgumentError, match="unknown normalization"):
        nb.reference("group_norm", g, x)


def test_plans_hold_the_row():
    for dt in FLOATS:
        vec = 16 // dt.itemsize
        top = max(lb.ln_capacity(p, dt) for p in lb.ln_row_plans(dt))
        assert top == (4096 if dt is DT.FLOAT64 else 8192)
        for D in [1, 2, 7, 33, 64, 65, 128, 129, 255, 256, 257, 1000, 1025, 4097, 8192, 8193,
                  33000]:
            cands = lb.ln_candidates(D, dt)
            assert cands[0] == lb.ln_plan(D, dt) and cands[-1]["mode"] == "loop"
            for p in cands[:-1]:
                assert lb.ln_capacity(p, dt) >= D
                if p["mode"] == "warp":
                    assert p["tpr"] <= 32 and p["tpr"] & (p["tpr"] - 1) == 0
                    assert p["tpr"] == 1 or lb.ln_capacity(dict(p, tpr=p["tpr"] // 2), dt) < D
            assert (lb.ln_plan(D, dt)["mode"] == "loop") == (D > top)
        assert lb.ln_plan(32 * vec, dt)["mode"] == "warp"


def test_block_plans_prefetch_where_the_device_holds_the_stages():
    """The rule's block plans prefetch (16-byte path only); the stages' shared memory is
    LN_STAGES x (x, g) x nv vectors per thread, and a device whose opt-in shared memory per
    block cannot hold sums + stages + 1 KiB gets the plain kernel."""
    from types import SimpleNamespace
    p = lb.ln_plan(1024, DT.FLOAT32)
    assert p == {"mode": "block", "nv": 2, "tpr": 128, "block": 512, "prefetch": True}
    assert lb.ln_prefetches(p, True) and not lb.ln_prefetches(p, False)
    assert lb.ln_stage_bytes(p, True) == 2 * 2 * 2 * 512 * 16
    assert lb.ln_stage_bytes(p, False) == 0
    assert not lb.ln_prefetches(lb.ln_plan(256, DT.FLOAT32), True)      # warp mode
    h100 = SimpleNamespace(shared_memory_per_block_optin=227 * 1024)
    a100 = SimpleNamespace(shared_memory_per_block_optin=163 * 1024)
    small = SimpleNamespace(shared_memory_per_block_optin=48 * 1024)
    for dt in FLOATS:
        for q in lb.ln_row_plans(dt):
            if q["mode"] != "block" or not q["prefetch"]:
                continue
            rpb = q["block"] // q["tpr"]
            acc = 8 if dt is DT.FLOAT64 else 4
            need = rpb * 2 * lb.ln_capacity(q, dt) * acc + lb.ln_stage_bytes(q, True) + 1024
            assert lb.ln_prefetch_fits(q, dt, h100)          # every config on H100 / H200
            assert lb.ln_prefetch_fits(q, dt, a100) == (need <= 163 * 1024)
            assert not lb.ln_prefetch_fits(q, dt, small)
    big = lb.ln_plan(8192, DT.FLOAT32)
    assert big["tpr"] == 1024 and not lb.ln_prefetch_fits(big, DT.FLOAT32, a100)


def test_prefetch_stages_emulated():
    """The rows kernel's stage slots ((s * 2 + tensor) * nv + k) * block + thread fill the
    stage memory once each, and its pipeline (copy the next trip's row into stage s ^ 1,
    wait for all but the newest copy, read stage s) reads each trip's own row, on every
    trip count a block can get (rows not a multiple of the grid's)."""
    for dt in FLOATS:
        for q in lb.ln_row_plans(dt):
            if not q["prefetch"]:
                continue
            nv, blk = q["nv"], q["block"]
            slots = {((st * 2 + ten) * nv + k) * blk + t for st in range(lb.LN_STAGES)
                     for ten in range(2) for k in range(nv) for t in range(blk)}
            assert slots == set(range(lb.ln_stage_bytes(q, True) // 16))
    for rows, grid, rpb, block in ((1, 1, 4, 0), (37, 2, 4, 1), (301, 3, 2, 2), (64, 3, 1, 0)):
        step, sub = grid * rpb, 0
        row = block * rpb + sub
        stage = {0: row}                     # stage -> the row its copy holds
        pending = [0]                        # copies in flight, oldest first
        s, trips = 0, 0
        while row - sub < rows:
            stage[s ^ 1] = row + step        # a row past the end: zeros, no reads
            pending.append(s ^ 1)
            while len(pending) > 1:          # cp.async.wait_group 1
                pending.pop(0)
            assert s not in pending and stage[s] == row
            row, s, trips = row + step, s ^ 1, trips + 1
        assert trips == max(0, -(-(rows - block * rpb) // step))


def test_template_variants():
    v = nb.template_variants()
    ln, bn = v[nb.LN_TEMPLATE], v[nb.BN_TEMPLATE]
    # per dtype: warp nvs x aligned / not; block configs x (aligned with and without
    # prefetch, the element path: one kernel for both); each of those with its finalize
    # fused and not; rowstats, apply, finalize
    assert len(ln) == sum(2 * (2 * len(lb.ln_warp_nvs(dt)) + 3 * len(lb.LN_BLOCK_CONFIGS)) + 3
                          for dt in FLOATS)
    rows = [p for p in ln if p["kernel"] == "rows"]
    assert all(p["aligned"] and p["mode"] == "block" for p in rows if p["prefetch"])
    assert sum(p["prefetch"] for p in rows) == 2 * len(FLOATS) * len(lb.LN_BLOCK_CONFIGS)
    assert sum(p["fused"] for p in rows) == len(rows) // 2
    assert len(bn) == 4 * 7    # the passes finalize their channel groups themselves; "ncs"
    assert {(p["kernel"], p["layout"], p.get("fused")) for p in bn} == {   # reduce fused too
        (k, lay, f) for k, f in (("reduce", False), ("eval", None), ("apply", None))
        for lay in ("nc", "ncs")} | {("reduce", "ncs", True)}


# -- bad input (any mode) ---------------------------------------------------------------------
def test_layer_norm_backward_errors(apis):
    m, ml = apis
    x = m.from_numpy(np.ones((3, 4), np.float32))
    g = m.from_numpy(np.ones((3, 4), np.float32))
    w = m.from_numpy(np.ones(4, np.float32))
    with pytest.raises(cb.ShapeMismatchError, match=r"grad_out has shape \(3, 5\) and x has "
                                                    r"shape \(3, 4\)"):
        ml.layer_norm_backward(m.from_numpy(np.ones((3, 5), np.float32)), x)
    with pytest.raises(cb.ShapeMismatchError, match=r"weight has shape \(5,\), expected \(4,\)"):
        ml.layer_norm_backward(g, x, m.from_numpy(np.ones(5, np.float32)))
    with pytest.raises(cb.DTypeMismatchError, match="layer_norm_backward does not support int32"):
        ml.layer_norm_backward(m.from_numpy(np.ones((3, 4), np.int32)),
                               m.from_numpy(np.ones((3, 4), np.int32)))
    with pytest.raises(cb.DTypeMismatchError, match="mixed dtypes float64 and float32"):
        ml.layer_norm_backward(m.from_numpy(np.ones((3, 4))), x)
    with pytest.raises(cb.DTypeMismatchError, match="mixed dtypes"):
        ml.layer_norm_backward(g, x, m.from_numpy(np.ones(4)))
    with pytest.raises(cb.InvalidArgumentError, match="grad_out must be a CudaTensor"):
        ml.layer_norm_backward(np.ones((3, 4)), x)
    with pytest.raises(cb.InvalidArgumentError, match="at least 1 dimension"):
        ml.layer_norm_backward(m.from_numpy(np.float32(1)), m.from_numpy(np.float32(1)))
    for bad in (-1e-5, float("nan"), True, "1e-5"):
        with pytest.raises(cb.InvalidArgumentError, match="eps must be"):
            ml.layer_norm_backward(g, x, w, eps=bad)
    f = m.from_numpy(np.ones((3, 4), np.float32))
    f.free()
    with pytest.raises(cb.TensorFreedError):
        ml.layer_norm_backward(g, f, w)
    with pytest.raises(cb.TensorFreedError):
        ml.layer_norm_backward(f, x, w)
    # the pool stays usable: the same call goes through afterwards
    out = ml.layer_norm_backward(g, x, w)
    np.testing.assert_allclose(m.to_numpy(out[2]), [3, 3, 3, 3])


def test_batch_norm_backward_errors(apis):
    m, ml = apis
    x = m.from_numpy(np.ones((4, 3, 2), np.float32))
    g = m.from_numpy(np.ones((4, 3, 2), np.float32))
    gam = m.from_numpy(np.ones(3, np.float32))
    rm, rv = m.from_numpy(np.zeros(3, np.float32)), m.from_numpy(np.ones(3, np.float32))
    with pytest.raises(cb.ShapeMismatchError, match=r"grad_out has shape \(4, 3, 3\) and input"):
        ml.batch_norm_backward(m.from_numpy(np.ones((4, 3, 3), np.float32)), x, gam)
    with pytest.raises(cb.ShapeMismatchError, match=r"gamma has shape \(4,\), expected \(3,\)"):
        ml.batch_norm_backward(g, x, m.from_numpy(np.ones(4, np.float32)))
    with pytest.raises(cb.ShapeMismatchError, match=r"running_var has shape \(2,\)"):
        ml.batch_norm_backward(g, x, gam, training=False, running_mean=rm,
                               running_var=m.from_numpy(np.ones(2, np.float32)))
    with pytest.raises(cb.InvalidArgumentError, match="training=False .* running_mean and "
                                                      "running_var"):
        ml.batch_norm_backward(g, x, gam, training=False, running_mean=rm)
    with pytest.raises(cb.InvalidArgumentError, match="training must be a bool"):
        ml.batch_norm_backward(g, x, gam, training=1)
    with pytest.raises(cb.InvalidArgumentError, match=r"\(N, C\), \(N, C, L\) or \(N, C, H, W\)"):
        ml.batch_norm_backward(m.from_numpy(np.ones(3, np.float32)),
                               m.from_numpy(np.ones(3, np.float32)), gam)
    with pytest.raises(cb.InvalidArgumentError, match="more than 1 value per channel"):
        ml.batch_norm_backward(m.from_numpy(np.ones((1, 3), np.float32)),
                               m.from_numpy(np.ones((1, 3), np.float32)), gam)
    with pytest.raises(cb.DTypeMismatchError, match="mixed dtypes"):
        ml.batch_norm_backward(g, x, m.from_numpy(np.ones(3)))
    with pytest.raises(cb.DTypeMismatchError, match="batch_norm_backward does not support int64"):
        ml.batch_norm_backward(m.from_numpy(np.ones((4, 3), np.int64)),
                               m.from_numpy(np.ones((4, 3), np.int64)),
                               m.from_numpy(np.ones(3, np.int64)))
    with pytest.raises(cb.InvalidArgumentError, match="gamma must be a CudaTensor"):
        ml.batch_norm_backward(g, x, None)
    with pytest.raises(cb.InvalidArgumentError, match="eps must be"):
        ml.batch_norm_backward(g, x, gam, eps=-1.0)
    f = m.from_numpy(np.ones(3, np.float32))
    f.free()
    with pytest.raises(cb.TensorFreedError):
        ml.batch_norm_backward(g, x, f)
    out = ml.batch_norm_backward(g, x, gam, training=False, running_mean=rm, running_var=rv)
    np.testing.assert_allclose(m.to_numpy(out[2]), [8, 8, 8])


LN_STUB_SCRIPT = r'''
    import struct
    from cuda_backend.cuda_ml import CudaML
    from cuda_backend.ops import layer_norm_backward_plans as lb
    ml = CudaML(m)
    rng = np.random.default_rng(0)

    def same_through_plan(out, call, general):
        """out freed, then call() through the plan: the general path's launches."""
        for t in out:
            if t is not None:
                t.free()
        launches.clear()
        call()
        assert launches == general

    for shape, dtype, weight in (((8192, 1024), DT.FLOAT32, True),
                                 ((50, 1000), DT.FLOAT16, False), ((9, 4094), DT.FLOAT64, True)):
        host = np.float16 if dtype is DT.FLOAT16 else dtype.numpy_dtype
        G, X = (m.from_numpy(rng.standard_normal(shape).astype(host)) for _ in range(2))
        W = m.from_numpy(np.ones(shape[-1], host)) if weight else None
        D, key = shape[-1], ("layer_norm_backward", shape, dtype, 0, 1e-5, not weight)
        p = lb.ln_plan(D, dtype)
        assert p["mode"] == "block" and p["prefetch"]
        acc = 8 if dtype is DT.FLOAT64 else 4
        sums = (p["block"] // p["tpr"]) * 2 * lb.ln_capacity(p, dtype) * acc
        m.plans.pop(key, None)
        launches.clear()
        out = ml.layer_norm_backward(G, X, W)
        general = list(launches)
        assert key in m.plans and len(general) == 2          # rows (with the stages), finalize
        assert general[0][3] == sums + lb.ln_stage_bytes(p, True), general[0][3]
        assert general[0][1] == (p["block"], 1, 1) and general[1][3] == 0
        if shape == (8192, 1024):
            assert general[0][0] == (264, 1, 1)              # 2 blocks of 96 KiB per SM
        same_through_plan(out, lambda: ml.layer_norm_backward(G, X, W), general)
        # a view one element past: the element path, no stages
        Xm = CudaTensor(shape, dtype, 0, X.ptr + dtype.itemsize, owner=X)
        launches.clear()
        ml.layer_norm_backward(G, Xm, W)
        assert launches[0][3] == sums, launches[0][3]
    # few partials (blocks x D <= LN_FUSE_MAX): one launch, the rows kernel's last block adds
    # them (its ticket counter, grad_weight and grad_bias after the rows kernel's arguments)
    for shape, dtype, weight in (((64, 64), DT.FLOAT32, True), ((5, 1000), DT.FLOAT16, False)):
        host = np.float16 if dtype is DT.FLOAT16 else dtype.numpy_dtype
        G, X = (m.from_numpy(rng.standard_normal(shape).astype(host)) for _ in range(2))
        W = m.from_numpy(np.ones(shape[-1], host)) if weight else None
        D, key = shape[-1], ("layer_norm_backward", shape, dtype, 0, 1e-5, not weight)
        q = lb.ln_prepared(m, dtype, D, 0, True)
        geo = lb.ln_geometry(q, shape[0], D, True, dtype)
        assert geo["fused"] and geo["nparts"] * D <= lb.LN_FUSE_MAX
        assert not lb.ln_geometry(dict(q, fuse_max=0), shape[0], D, True, dtype)["fused"]
        m.plans.pop(key, None)
        launches.clear()
        out = ml.layer_norm_backward(G, X, W)
        general = list(launches)
        assert len(general) == 1 and general[0][0] == geo["grid"], general
        counter = lb.LN_COUNTERS.get(m, 0, None, 1).ptr
        tail = struct.pack("PPP", counter, out[1].ptr if weight else 0, out[2].ptr)
        assert general[0][2].endswith(tail)
        same_through_plan(out, lambda: ml.layer_norm_backward(G, X, W), general)
    print("OK")
'''


def test_layer_norm_launches_on_a_stubbed_driver():
    """With PyCUDA replaced by perf/bench_host_path.py's stubs (tests/test_host_path.py's
    harness): the rule's block plans launch the rows kernel with the sums plus the prefetch
    stages of shared memory (aligned rows) or the sums alone (a misaligned view), 264
    blocks for 8192 x 1024 float32 on 132 SMs, and the per-call plan launches exactly what the
    general path did."""
    from test_host_path import BACKEND, STUBS, run_script, script
    run_script(script(STUBS, BACKEND, LN_STUB_SCRIPT))


# -- GPU --------------------------------------------------------------------------------------
gpu = pytest.mark.gpu


def boundary_lengths(caps):
    ks = {1, 2, 3, 31, 33, 997}
    for c in caps:
        ks |= {c - 1, c, c + 1}
    return sorted(k for k in ks if k > 0)


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_gpu_layer_norm_every_plan(apis, dtype):
    """Every plan ln_candidates offers at each register plan's capacity - 1, capacity, + 1
    (and a few odd lengths), on aligned rows (16-byte kernels where D allows) and on views
    one element past (the element kernels), with and without weight; 7 rows, and 300 rows
    through a grid of at most 2 blocks (the persistent loop's later trips)."""
    m, _ = apis
    rng = np.random.default_rng(20)
    caps = sorted({lb.ln_capacity(p, dtype) for p in lb.ln_row_plans(dtype)})
    for D in boundary_lengths(caps):
        for rows in (7, 300 if D <= 1025 else 7):
            g, hg, x, hx, w, hw = ln_inputs(m, rng, (rows, D), dtype, weight=D % 2 == 1)
            xm, base, hxm = misaligned(m, rng.standard_normal((rows, D)) * 2 + 1, dtype)
            for p in lb.ln_candidates(D, dtype):
                for xx, hxx in ((x, hx), (xm, hxm)):
                    aligned = xx is x and D % (16 // dtype.itemsize) == 0
                    q = lb.ln_prepare(m, p, dtype, D, 0, aligned)
                    if rows == 300 and p["mode"] != "loop":
                        q = dict(q, resident=min(q["resident"], 2))
                    out = (m.create_tensor((rows, D), dtype),
                           m.create_tensor((D,), dtype) if w is not None else None,
                           m.create_tensor((D,), dtype))
                    lb.ln_launch(m, q, g, xx, w, *out, 1e-5)
                    check_ln(m, out, hg, hxx, hw, 1e-5, dtype, f"D={D} rows={rows} {p} "
                                                               f"aligned={aligned}")
                    free(out)
            free(g, x, w, base)


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_gpu_layer_norm_prefetch_pipeline(apis, dtype, monkeypatch):
    """The prefetch kernels' stage alternation: odd and even numbers of trips per block (grids
    of 1 to 3 blocks), a last trip with inactive sub-rows and blocks with no row in it, a row
    count under one trip, rows of every block config's capacity class; then the same plan on
    a device that cannot hold the stages (the plain kernel, no stage memory)."""
    m, _ = apis
    rng = np.random.default_rng(25)
    vec = 16 // dtype.itemsize
    for D in (vec * 9, vec * 64 + vec, 1000 - 1000 % vec, 4096 - vec):
        for p in lb.ln_candidates(D, dtype):
            if not p["prefetch"]:
                continue
            for rows, grid in ((1, 1), (5, 1), (37, 2), (64, 3), (301, 3)):
                g, hg, x, hx, w, hw = ln_inputs(m, rng, (rows, D), dtype, weight=rows % 2 == 1)
                q = lb.ln_prepare(m, p, dtype, D, 0, True)
                assert q["prefetch"] and q["smem"] > lb.ln_stage_bytes(p, True)
                q = dict(q, resident=min(q["resident"], grid))
                out = (m.create_tensor((rows, D), dtype),
                       m.create_tensor((D,), dtype) if w is not None else None,
                       m.create_tensor((D,), dtype))
                lb.ln_launch(m, q, g, x, w, *out, 1e-5)
                check_ln(m, out, hg, hx, hw, 1e-5, dtype, f"D={D} rows={rows} grid={grid} {p}")
                free(out, g, x, w)
    monkeypatch.setattr(lb, "ln_prefetch_fits", lambda *a: False)
    D = 1000 - 1000 % vec
    p = lb.ln_plan(D, dtype)
    q = lb.ln_prepare(m, p, dtype, D, 0, True)
    assert p["prefetch"] and not q["prefetch"]
    assert q["smem"] == (p["block"] // p["tpr"]) * 2 * lb.ln_capacity(p, dtype) * \
        (8 if dtype is DT.FLOAT64 else 4)
    g, hg, x, hx, w, hw = ln_inputs(m, rng, (77, D), dtype)
    out = (m.create_tensor((77, D), dtype), m.create_tensor((D,), dtype),
           m.create_tensor((D,), dtype))
    lb.ln_launch(m, dict(q, resident=min(q["resident"], 2)), g, x, w, *out, 1e-5)
    check_ln(m, out, hg, hx, hw, 1e-5, dtype, f"D={D} without the stages")
    free(out, g, x, w)


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_gpu_layer_norm_fused_finalize(apis, dtype):
    """The rows kernel that adds its own partials (blocks x D <= LN_FUSE_MAX): right on odd
    shapes, one block and many (grids capped at 1, 3 and the plan's own), with and without
    weight; the two-launch path (fuse_max 0) on the same inputs within the same bounds; the
    same bits on a repeat; the ticket counter back at 0 after the launches, on the default
    stream and on a second one (through the public method)."""
    m, ml = apis
    rng = np.random.default_rng(26)
    vec = 16 // dtype.itemsize
    for rows, D in ((1, 1), (3, 7), (64, 64), (33, 255), (300, 27), (5000, 3), (3, 2047)):
        for weight in (True, False):
            g, hg, x, hx, w, hw = ln_inputs(m, rng, (rows, D), dtype, weight)
            aligned = D % vec == 0
            q = lb.ln_prepared(m, dtype, D, 0, aligned)
            assert q["mode"] != "loop"
            for cap in (1, 3, q["resident"]):
                qc = dict(q, resident=min(q["resident"], cap))
                geo = lb.ln_geometry(qc, rows, D, aligned, dtype)
                assert geo["fused"], (rows, D, geo)
                got = []
                for qq in (qc, qc, dict(qc, fuse_max=0)):
                    out = (m.create_tensor((rows, D), dtype),
                           m.create_tensor((D,), dtype) if w is not None else None,
                           m.create_tensor((D,), dtype))
                    lb.ln_launch(m, qq, g, x, w, *out, 1e-5)
                    check_ln(m, out, hg, hx, hw, 1e-5, dtype,
                             f"({rows}, {D}) grid={geo['grid']} fused={qq is qc}")
                    got.append([None if t is None else m.to_numpy(t) for t in out])
                    free(out)
                for a, b in zip(got[0], got[1]):     # the fused kernel twice: the same bits
                    if a is not None:
                        np.testing.assert_array_equal(a, b)
            assert m.to_numpy(lb.LN_COUNTERS.get(m, 0, None, 1))[0] == 0
            free(g, x, w)
    g, hg, x, hx, w, hw = ln_inputs(m, rng, (64, 64), dtype)
    s = m.backend.stream()
    with s:
        out = ml.layer_norm_backward(g, x, w)
    s.synchronize()
    check_ln(m, out, hg, hx, hw, 1e-5, dtype, "(64, 64) on a stream")
    assert m.to_numpy(lb.LN_COUNTERS.get(m, 0, s.pycuda_stream, 1))[0] == 0
    free(out, g, x, w)


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_gpu_layer_norm_plan_and_determinism(apis, dtype):
    """Many rows (more than one resident wave) through the public method, a repeat through
    its per-call plan with the same bits, and a third call with the same bits again."""
    m, ml = apis
    rng = np.random.default_rng(21)
    for shape in ((3000, 1000), (40, 7, 33), (9, 9000)):
        for weight in (True, False):
            g, hg, x, hx, w, hw = ln_inputs(m, rng, shape, dtype, weight)
            out = ml.layer_norm_backward(g, x, w)
            check_ln(m, out, hg, hx, hw, 1e-5, dtype, f"{shape}")
            key = ("layer_norm_backward", shape, dtype, 0, 1e-5, not weight)
            again = call_through_plan(m, key, lambda: ml.layer_norm_backward(g, x, w))
            third = ml.layer_norm_backward(g, x, w)
            for a, b, c in zip(out, again, third):
                if a is not None:
                    np.testing.assert_array_equal(m.to_numpy(a), m.to_numpy(b))
                    np.testing.assert_array_equal(m.to_numpy(a), m.to_numpy(c))
            free(out, again, third, g, x, w)


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_gpu_batch_norm_layouts(apis, dtype, training):
    """Both layouts at shapes that split into 16-byte vectors and shapes that do not, views
    one element past (the scalar paths), many splits (N * H * W large), the public method,
    then its plan (same bits)."""
    m, ml = apis
    rng = np.random.default_rng(22)
    vec = 16 // dtype.itemsize
    shapes = [(3000, 2 * vec), (513, 3), (64, 3, 33, 33), (9, 5, 2 * vec, 4), (7, 6, 1001)]
    for shape in shapes:
        g, hg, x, hx, gam, hgam, rm, hrm, rv, hrv = bn_inputs(m, rng, shape, dtype, offset=2.0)
        kw = {} if training else {"training": False, "running_mean": rm, "running_var": rv}
        out = ml.batch_norm_backward(g, x, gam, **kw)
        check_bn(m, out, hg, hx, hgam, 1e-5, training, dtype, f"{shape}", hrm, hrv)
        key = ("batch_norm_backward", shape, dtype, 0, 1e-5, training)
        again = call_through_plan(m, key, lambda: ml.batch_norm_backward(g, x, gam, **kw))
        for a, b in zip(out, again):
            np.testing.assert_array_equal(m.to_numpy(a), m.to_numpy(b))
        xm, base, hxm = misaligned(m, rng.standard_normal(shape) * 1.5 + 2.0, dtype)
        out2 = ml.batch_norm_backward(g, xm, gam, **kw)
        check_bn(m, out2, hg, hxm, hgam, 1e-5, training, dtype, f"{shape} misaligned", hrm,
                 hrv)
        free(out, again, out2, g, x, gam, rm, rv, base)


@gpu
def test_gpu_errors_leave_the_pool_as_it_was(apis):
    """Bad input raises before anything is allocated: the pool's active memory is what it
    was, and the next call (through its plan) is right."""
    m, ml = apis
    rng = np.random.default_rng(23)
    g, hg, x, hx, w, hw = ln_inputs(m, rng, (33, 1000), DT.FLOAT32)
    gb, hgb, xb, hxb, gam, hgam, *_ = bn_inputs(m, rng, (8, 4, 5, 5), DT.FLOAT32)
    free(ml.layer_norm_backward(g, x, w), ml.batch_norm_backward(gb, xb, gam))
    pool = m.backend.memory_pools[0]
    before = pool.get_stats()["active_memory"]
    with pytest.raises(cb.ShapeMismatchError):
        ml.layer_norm_backward(g, x, gam)
    with pytest.raises(cb.InvalidArgumentError):
        ml.batch_norm_backward(gb, xb, gam, training=False)
    with pytest.raises(cb.ShapeMismatchError):
        ml.batch_norm_backward(g, x, gam)
    assert pool.get_stats()["active_memory"] == before
    check_ln(m, ml.layer_norm_backward(g, x, w), hg, hx, hw, 1e-5, DT.FLOAT32, "after")
    check_bn(m, ml.batch_norm_backward(gb, xb, gam), hgb, hxb, hgam, 1e-5, True, DT.FLOAT32,
             "after")


@gpu
def test_gpu_large_inputs_are_right(apis):
    """The report's shapes at full size (float32): 8192 x 1024 rows; 8 x 64 x 128 x 128
    images, training and inference."""
    m, ml = apis
    rng = np.random.default_rng(24)
    g, hg, x, hx, w, hw = ln_inputs(m, rng, (8192, 1024), DT.FLOAT32)
    check_ln(m, ml.layer_norm_backward(g, x, w), hg, hx, hw, 1e-5, DT.FLOAT32, "8192x1024")
    free(g, x, w)
    g, hg, x, hx, gam, hgam, rm, hrm, rv, hrv = bn_inputs(m, rng, (8, 64, 128, 128),
                                                         DT.FLOAT32)
    check_bn(m, ml.batch_norm_backward(g, x, gam), hg, hx, hgam, 1e-5, True, DT.FLOAT32,
             "images train")
    check_bn(m, ml.batch_norm_backward(g, x, gam, training=False, running_mean=rm,
                                       running_var=rv),
             hg, hx, hgam, 1e-5, False, DT.FLOAT32, "images eval", hrm, hrv)
    free(g, x, gam, rm, rv)


# -- the passes' fused finalize (ticket per channel group) ------------------------------------
# many splits per channel group, several groups ("nc": C over bx * W channels a group, with
# and without 16-byte vectors; "ncs": one channel a group), odd sizes
BN_GROUP_SHAPES = [(300, 2052), (513, 1030), (97, 5, 33, 31), (7, 300, 3, 3), (2000, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_batch_norm_backward_fused_pass_gpu(apis, dtype, monkeypatch):
    """Training on small channels of NCHW / NCL inputs (bb.BN_FUSE_MAX): the one pass that
    also computes grad_input, on planes of odd and vector sizes and views one element past
    (the scalar path), within the float64 bounds, the same bits through the plan and on a
    repeat; then the two-launch path on the same inputs (BN_FUSE_MAX 0), within the same
    bounds. NC inputs never fuse."""
    if not GPU:
        pytest.skip("needs a GPU")
    m, ml = apis
    rng = np.random.default_rng(27)
    vec = 16 // dtype.itemsize
    for shape in ((7, 1000), (2, 3), (100, 40)):
        assert not any(bb.bn_geometry("nc", shape[0], shape[1], 1, ok, vec, 132, True)["fused"]
                       for ok in (0, 1) if ok == 0 or shape[1] % vec == 0)
    shapes = ((1, 8, 16, 16), (3, 5, 7, 9), (2, 3, 2, 1), (2, 4, 3 * vec, 1), (5, 2, 31, 33),
              (1, 3, 8192), (4, 2, 5))
    for shape in shapes:
        N, C = shape[0], shape[1]
        S = int(np.prod(shape[2:])) if len(shape) > 2 else 1
        assert all(bb.bn_geometry("ncs", N, C, S, ok, vec, 132, True)["fused"]
                   for ok in (0, 1) if ok == 0 or S % vec == 0), shape
        g, hg, x, hx, gam, hgam, _, _, _, _ = bn_inputs(m, rng, shape, dtype, offset=2.0)
        xm, base, hxm = misaligned(m, rng.standard_normal(shape) * 1.5 + 2.0, dtype)
        for xx, hxx in ((x, hx), (xm, hxm)):
            first = ml.batch_norm_backward(g, xx, gam)
            check_bn(m, first, hg, hxx, hgam, 1e-5, True, dtype, f"{shape} fused")
            key = ("batch_norm_backward", shape, dtype, 0, 1e-5, True)
            again = call_through_plan(m, key, lambda: ml.batch_norm_backward(g, xx, gam))
            third = ml.batch_norm_backward(g, xx, gam)
            for a, b, c in zip(first, again, third):
                np.testing.assert_array_equal(m.to_numpy(a), m.to_numpy(b))
                np.testing.assert_array_equal(m.to_numpy(a), m.to_numpy(c))
            free(*first, *again, *third)
        with monkeypatch.context() as mp:
            mp.setattr(bb, "BN_FUSE_MAX", 0)
            m.plans.clear()
            assert not bb.bn_geometry("ncs", N, C, S, 0, vec, 132, True)["fused"]
            two = ml.batch_norm_backward(g, x, gam)
            check_bn(m, two, hg, hx, hgam, 1e-5, True, dtype, f"{shape} two launches")
            free(*two)
        m.plans.clear()
        free(g, x, gam, base)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_batch_norm_backward_group_finalize_gpu(apis, dtype):
    """The last block of each channel group adds the group's partials: every channel of
    every group within the float64 bounds, for training and inference, through the general
    path and the plan; the ticket counters go back to 0 (a repeat call, and calls of other
    shapes between, give the same bits)."""
    if not GPU:
        pytest.skip("needs a GPU")
    m, ml = apis
    rng = np.random.default_rng(11)
    for shape in BN_GROUP_SHAPES:
        g, hg, x, hx, gam, hgam, rm, hrm, rv, hrv = bn_inputs(m, rng, shape, dtype, offset=3.0)
        for training in (True, False):
            kw = {} if training else {"training": False, "running_mean": rm,
                                      "running_var": rv}
            first = ml.batch_norm_backward(g, x, gam, **kw)          # general path
            check_bn(m, first, hg, hx, hgam, 1e-5, training, dtype, f"{shape} {training}",
                     hrm, hrv)
            key = ("batch_norm_backward", x.shape, dtype, x.device_id, 1e-5, training)
            again = call_through_plan(m, key, lambda: ml.batch_norm_backward(g, x, gam, **kw))
            other = ml.batch_norm_backward(*bn_inputs(m, rng, (3, 4, 5), dtype)[0:6:2])
            third = ml.batch_norm_backward(g, x, gam, **kw)
            for a, b, c in zip(first, again, third):
                np.testing.assert_array_equal(m.to_numpy(a), m.to_numpy(b))
                np.testing.assert_array_equal(m.to_numpy(a), m.to_numpy(c))
            free(*first, *again, *other, *third)
        free(g, x, gam, rm, rv)
    # inference on empty batches (N = 0, S = 0): the pass over nothing writes zeros
    for shape in ((0, 5), (4, 3, 0), (0, 6, 2, 2)):
        C = shape[1]
        z, _ = make(m, np.zeros(shape), dtype)
        gam, _ = make(m, np.ones(C), dtype)
        rv, _ = make(m, np.ones(C), dtype)
        dx, dg, db = ml.batch_norm_backward(z, z, gam, training=False, running_mean=gam,
                                            running_var=rv)
        assert dx.shape == shape and not m.to_numpy(dg).any() and not m.to_numpy(db).any()
