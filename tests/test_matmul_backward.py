"""GEMM gradients (ops/matmul_backward.py): matmul_backward, linear_backward,
fused_linear_gelu_backward, and the plain linear layer; the matmul kernels' modes they run on
(ops/matmul.py: matmul_tn, A given as (K, M); matmul_nt, B given as (N, K); the linear
kernels' bias_gelu_grad epilogue).

References are float64 NumPy of the stored (rounded) inputs; finite differences of the
forward functions check the references' formulas, and PyTorch's autograd, where torch is
importable, checks the ops. Bounds are derived, elementwise, from the arithmetic: a sum of
n terms in a type of unit roundoff u, in any order, errs by at most gamma(n) = n u / (1 - n u)
times the sum of the terms' magnitudes, so a GEMM over K by (gamma(K) + u_prod + u_out)
(|A| |B|) (u_prod: the operands' rounding before the product, 0 on CUDA cores and for the
16-bit types, whose products are exact in float32; TF32 rounds B to nearest and A at worst
by truncation, 3xTF32 drops terms of 3 2^-22; u_out: the one rounding on store; tensor-core
float32 accumulation may truncate, so u = 2^-23 there). fused_linear_gelu_backward's
dZ = G GELU'(z) adds |G| (L dz + (16 |s| + 24) u T) (L = max |GELU''| for the error dz of
the recomputed z, the second term GELU''s own evaluation: exp of an argument |s| with
relative error 8 u, T the magnitudes of its two terms), and the later GEMMs carry that error
through |W| and |x|. Column and batch sums add gamma(rows) of their terms' magnitudes.

float32's default GEMMs (precision None / "fp32": matmul, matmul_nt, matmul_tn) may run
3xTF32 on tensor cores: each operand x = big + small (two TF32 roundings to nearest, 2^-11
each, x - big exact), the products big·big + big·small + small·big exact in float32; the
dropped small·small and the small parts' roundings leave |ab - computed| <= 3 2^-22 |a||b|
(u_prod), the float32 accumulation of the mma may truncate (u = 2^-23, over at most
depth(K) additions with the final acc + acc_s and the split-K partials), so `arith` gives
the recompute's pair (2^-23, 3 2^-22) for every float32 default GEMM; "ieee" (CUDA cores)
keeps (2^-24, 0).

Tests marked `gpu` run every candidate config of the new kernel modes (a_trans with split-K,
aligned and not, batched and broadcast; the 3xTF32 GEMMs NN / NT / TN with split-K; the
bias_gelu_grad epilogue of every linear config and the skinny split-K reduce) and the
per-call plans; the rest run in whatever mode the backend is in (NumPy fallback without a
GPU).
"""
from __future__ import annotations

import re
import zlib

import numpy as np
import pytest
from helpers import (RecordingMath, call_through_plan, check_finite as check, make, poisoned,
                     tuned_math)

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend.compiler import declared_kernels, kernel_signature
from cuda_backend.cuda_ml import CudaML
from cuda_backend.kernels import KernelGenerator, dtype_params
from cuda_backend.ops import linear as lin
from cuda_backend.ops import matmul as mm
from cuda_backend.ops import matmul_backward as mb
from cuda_backend.ops import matmul_backward_layers as mbl
from cuda_backend.ops import matmul_grouped as grouped
from cuda_backend.tensor import CudaTensor

gpu = pytest.mark.gpu
GEN = KernelGenerator(backend=object())
FLOATS = [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16]
# (dtype, precision) families
FAMILIES = {"fp32": (DT.FLOAT32, None), "tf32": (DT.FLOAT32, "tf32"),
            "fp64": (DT.FLOAT64, None), "fp16": (DT.FLOAT16, None),
            "bf16": (DT.BFLOAT16, None)}
U_OUT = {DT.FLOAT32: 2.0**-24, DT.FLOAT64: 2.0**-53, DT.FLOAT16: 2.0**-11, DT.BFLOAT16: 2.0**-8}
# half of float16's smallest subnormal spacing: where tiny outputs round; else negligible
ATOL = {DT.FLOAT32: 1e-37, DT.FLOAT64: 1e-300, DT.FLOAT16: 2.0**-25, DT.BFLOAT16: 1e-37}


def arith(dtype, prec, recompute=False):
    """(u_acc, u_prod) of a GEMM of the family: the matmul / a_trans / b_trans GEMMs and
    (recompute=True) the linear layer's recompute; float32's default (None / "fp32") may run
    3xTF32 in either (the module docstring's derivation), "ieee" (CUDA cores, rounding FMA)
    is exact in the products."""
    if dtype is DT.FLOAT64:
        return 2.0**-53, 0.0
    if dtype is DT.FLOAT32 and prec == "tf32":
        return 2.0**-23, 2.0**-10 + 2.0**-11 + 2.0**-21
    if dtype is DT.FLOAT32:
        return (2.0**-24, 0.0) if prec == "ieee" and not recompute else (2.0**-23, 3 * 2.0**-22)
    return 2.0**-23, 0.0


def gamma(n, u):
    return n * u / (1 - n * u)


def depth(k):
    """Additions in sequence behind one GEMM output, any config: k terms, plus the split-K
    partials summed after (at most 16 splits, the skinny configs' at most k / 32)."""
    return k + k // 32 + 16


def gemm_bound(abs_a, abs_b, k, dtype, prec, recompute=False):
    """Elementwise bound of a stored GEMM result over k terms, |A| |B| given (any batch)."""
    u_acc, u_prod = arith(dtype, prec, recompute)
    return (gamma(depth(k), u_acc) + u_prod + U_OUT[dtype]) * np.matmul(abs_a, abs_b) \
        + ATOL[dtype]


def seed(*what):
    """A stable seed for a test's parameters (Python's str hash is salted per process)."""
    return zlib.crc32(repr(what).encode())


def sum_bound(terms_abs, n, axis, dtype):
    """Elementwise bound of a stored sum over `axis` of n terms (magnitudes given), computed
    in float32 (float64 for float64)."""
    u = 2.0**-53 if dtype is DT.FLOAT64 else 2.0**-24
    return (gamma(n, u) + U_OUT[dtype]) * terms_abs.sum(axis=axis) + ATOL[dtype]


@pytest.fixture(scope="module")
def apis(backend, tmp_path_factory):
    """A CudaMath whose autotuner writes to a temporary file, and its CudaML."""
    m = tuned_math(backend, tmp_path_factory)
    return m, CudaML(m)


def stored(m, t):
    return m.to_numpy(t).astype(np.float64)


# -- the GELU derivative: its reference and the constants of its bound -----------------------
C2 = 1.5957691216057308


def gelu_tanh(z):
    return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))


def gelu_grad_parts(z):
    """(GELU'(z), |s| + |z s (1 - s) u'|, |u|) of the tanh form, u = C2 (z + 0.044715 z^3)."""
    with np.errstate(all="ignore"):
        u = C2 * z * (1 + 0.044715 * z * z)
        s, q = 1 / (1 + np.exp(-u)), 1 / (1 + np.exp(u))
        t2 = np.where(s * q == 0, 0.0, z * s * q * C2 * (1 + 0.134145 * z * z))
        return s + t2, np.abs(s) + np.abs(t2), np.abs(u)


_ZS = np.linspace(-12, 12, 240001)
# max |GELU''| (at 0; the grid is 1e-4 apart and GELU''' is bounded by 3 there, so the grid's
# maximum is within 3e-4 of the true one)
L_GELU2 = float(np.max(np.abs(np.gradient(gelu_grad_parts(_ZS)[0], _ZS)))) + 3e-4


def test_gelu_grad_formula():
    """The kernels' GELU' (mm.gelu_tanh_grad, the same expression) against a central
    difference of gelu_tanh in float64, and the constant of the bound."""
    z = np.linspace(-9, 9, 1801)
    h = 1e-5
    fd = (gelu_tanh(z + h) - gelu_tanh(z - h)) / (2 * h)
    np.testing.assert_allclose(mm.gelu_tanh_grad(z), fd, rtol=0, atol=1e-9)
    np.testing.assert_allclose(mm.gelu_tanh_grad(z), gelu_grad_parts(z)[0], rtol=1e-13,
                               atol=0)   # (the same formula, other association orders)
    far = mm.gelu_tanh_grad(np.array([-1e4, 1e4]))   # no NaN where exp overflows
    assert far[0] == 0.0 and far[1] == 1.0
    assert 0.79 < L_GELU2 < 0.81


# -- inputs and references ---------------------------------------------------------------------
def layer_inputs(m, rng, dtype, x_shape, out_f, bias=True):
    """Device grad_out, x, W (out, in), bias (or None) and their stored float64 values; W and
    b scaled like a layer's (z ~ N(0, 2))."""
    in_f = x_shape[-1]
    vals = [rng.standard_normal(x_shape[:-1] + (out_f,)), rng.standard_normal(x_shape),
            rng.standard_normal((out_f, in_f)) / np.sqrt(max(in_f, 1)),
            rng.standard_normal(out_f)]
    pairs = [make(m, v, dtype) for v in vals]
    if not bias:
        pairs[3] = (None, np.zeros(out_f))
    return [p[0] for p in pairs], [p[1] for p in pairs]


def layer_bounds(g, x, w, b, dtype, prec, fused):
    """(reference grads, elementwise bounds) of (grad_x, grad_W, grad_b) for the layer's
    stored inputs; fused: through dZ = G GELU'(x Wᵀ + b) and its bound."""
    rows = int(np.prod(x.shape[:-1]))
    in_f, out_f = w.shape[1], w.shape[0]
    g2, x2 = g.reshape(rows, out_f), x.reshape(rows, in_f)
    ag, ax, aw = np.abs(g2), np.abs(x2), np.abs(w)
    if fused:
        z = x2 @ w.T + b
        d1, terms, au = gelu_grad_parts(z)
        dz = g2 * d1
        u_acc, u_prod = arith(dtype, prec, recompute=True)
        # z's error: the GEMM's, then the bias added in the accumulator type
        dz_err = (gamma(depth(in_f), u_acc) + u_prod) * (ax @ aw.T + np.abs(b)) + \
            u_acc * np.abs(z)
        u_eval = 2.0**-53 if dtype is DT.FLOAT64 else 2.0**-24
        ddz = ag * (L_GELU2 * dz_err + (16 * au + 24) * u_eval * terms) + \
            U_OUT[dtype] * np.abs(dz) + ATOL[dtype]
    else:
        dz, ddz = g2, np.zeros_like(g2)
    adz = np.abs(dz) + ddz
    refs = (dz @ w, dz.T @ x2, dz.sum(axis=0))
    bounds = (gemm_bound(adz, aw, out_f, dtype, prec) + ddz @ aw,
              gemm_bound(adz.T, ax, rows, dtype, prec) + ddz.T @ ax,
              sum_bound(adz, rows, 0, dtype) + ddz.sum(axis=0))
    shape_x = x.shape
    return (refs[0].reshape(shape_x), refs[1], refs[2]), \
        (bounds[0].reshape(shape_x), bounds[1], bounds[2])


def matmul_inputs(m, rng, dtype, a_shape, b_shape):
    p = mm.plan_shapes(a_shape, b_shape)
    vals = [rng.standard_normal(p.out_shape), rng.standard_normal(a_shape),
            rng.standard_normal(b_shape)]
    pairs = [make(m, v, dtype) for v in vals]
    return [q[0] for q in pairs], [q[1] for q in pairs]


def matmul_bounds(g, a, b, dtype, prec):
    """(grad_a, grad_b) references (mb.reference) and bounds: each product over its
    reduction (N for grad_a, M for grad_b) and, for an operand broadcast over the batch, the
    batch sum (a's: the batched products stored, then summed; b's: one GEMM over the batch's
    M rows)."""
    ga, gb = mb.reference("matmul_backward", g, a, b)
    p = mm.plan_shapes(a.shape, b.shape)
    B, M, N, K = p.batch, p.M, p.N, p.K
    G = np.abs(g).reshape(B, M, N)
    A = np.abs(a).reshape(-1, M, K)          # (B or 1, M, K)
    Bt = np.swapaxes(np.abs(b).reshape(-1, K, N), -1, -2)
    bound_a = gemm_bound(G, Bt, N, dtype, prec)
    if B > 1 and p.stride_a == 0:
        bound_a = bound_a.sum(axis=0) + sum_bound(np.matmul(G, Bt) + bound_a, B, 0, dtype)
    if B > 1 and p.stride_b == 0:
        bound_b = gemm_bound(A.reshape(B * M, K).T, G.reshape(B * M, N), B * M, dtype, prec)
    else:
        bound_b = gemm_bound(np.swapaxes(A, -1, -2), G, M, dtype, prec)
    return (ga, gb), (bound_a.reshape(a.shape), bound_b.reshape(b.shape))


# -- the references against finite differences (float64) -------------------------------------
def fd_grad(f, v, h):
    """Central differences of the scalar f at v, element by element."""
    out = np.zeros_like(v)
    for i in np.ndindex(v.shape):
        old = v[i]
        v[i] = old + h
        hi = f()
        v[i] = old - h
        lo = f()
        v[i] = old
        out[i] = (hi - lo) / (2 * h)
    return out


# Linear / bilinear scalars: the central difference is exact up to rounding, which is at most
# ~ n 2^-52 |terms| / h (n the terms summed): with |terms| < 50, n < 100, h = 1e-3 below 1e-8.
# The GELU layer adds the truncation h^2 / 6 max|GELU'''| |G| |w|^3 summed: < 1e-6 * 2e-3.
FD_TOL = 1e-7


@pytest.mark.parametrize("case", ["linear", "fused", "fused_nobias"])
def test_layer_reference_matches_finite_differences(case):
    rng = np.random.default_rng(31)
    x = rng.standard_normal((2, 3, 4))
    w = rng.standard_normal((5, 4)) / 2
    b = rng.standard_normal(5) if case != "fused_nobias" else None
    g = rng.standard_normal((2, 3, 5))
    fused = case != "linear"

    def f():
        z = x @ w.T + (0.0 if b is None else b)
        return float(np.sum(g * (gelu_tanh(z) if fused else z)))
    op = "fused_linear_gelu_backward" if fused else "linear_backward"
    gx, gw, gb = mb.reference(op, g, x, w, bias=b, has_bias=True)
    h = 1e-3 if not fused else 1e-4
    np.testing.assert_allclose(gx, fd_grad(f, x, h), rtol=0, atol=FD_TOL)
    np.testing.assert_allclose(gw, fd_grad(f, w, h), rtol=0, atol=FD_TOL)
    if b is not None:
        np.testing.assert_allclose(gb, fd_grad(f, b, h), rtol=0, atol=FD_TOL)
    else:
        assert gb is None


@pytest.mark.parametrize("a_shape, b_shape", [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)),
                                              ((3, 4), (2, 4, 5)), ((1, 3, 4), (2, 4, 5)),
                                              ((2, 3, 4), (2, 4, 5)), ((4,), (4, 5)),
                                              ((3, 4), (4,)), ((4,), (4,)),
                                              ((2, 1, 3, 4), (1, 4, 2))])
def test_matmul_reference_matches_finite_differences(a_shape, b_shape):
    rng = np.random.default_rng(32)
    a, b = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
    g = rng.standard_normal(np.matmul(a, b).shape)

    def f():
        return float(np.sum(g * np.matmul(a, b)))
    ga, gb = mb.reference("matmul_backward", g, a, b)
    assert ga.shape == a.shape and gb.shape == b.shape
    np.testing.assert_allclose(ga, fd_grad(f, a, 1e-3), rtol=0, atol=FD_TOL)
    np.testing.assert_allclose(gb, fd_grad(f, b, 1e-3), rtol=0, atol=FD_TOL)


@pytest.mark.parametrize("op", ["linear", "fused", "matmul"])
def test_ops_match_finite_differences_in_float64(apis, op):
    """The ops themselves (this mode's: kernels on a GPU, NumPy in fallback) in float64 on
    tiny odd shapes, against central differences of the forward."""
    m, ml = apis
    rng = np.random.default_rng(33)
    if op == "matmul":
        a, b = rng.standard_normal((2, 3, 5)), rng.standard_normal((5, 4))
        g = rng.standard_normal((2, 3, 4))
        ga, gb = ml.matmul_backward(*(m.from_numpy(v) for v in (g, a, b)))

        def f():
            return float(np.sum(g * np.matmul(a, b)))
        np.testing.assert_allclose(stored(m, ga), fd_grad(f, a, 1e-3), rtol=0, atol=FD_TOL)
        np.testing.assert_allclose(stored(m, gb), fd_grad(f, b, 1e-3), rtol=0, atol=FD_TOL)
        return
    x = rng.standard_normal((3, 5))
    w = rng.standard_normal((7, 5)) / 2
    b = rng.standard_normal(7)
    g = rng.standard_normal((3, 7))
    fused = op == "fused"
    if fused:
        gx, gw, gb = ml.fused_linear_gelu_backward(*(m.from_numpy(v) for v in (g, x, w, b)))
    else:
        gx, gw, gb = ml.linear_backward(*(m.from_numpy(v) for v in (g, x, w)))

    def f():
        z = x @ w.T + b
        return float(np.sum(g * (gelu_tanh(z) if fused else z)))
    h = 1e-4 if fused else 1e-3
    for got, v in ((gx, x), (gw, w), (gb, b)):
        np.testing.assert_allclose(stored(m, got), fd_grad(f, v, h), rtol=0, atol=FD_TOL)


# -- the public ops against float64 (this mode: kernels on a GPU, NumPy in fallback) ----------
LAYER_SHAPES = [((1, 1), 1), ((3, 17), 5), ((17, 3), 129), ((129, 257), 17), ((2, 5, 33), 65),
                ((33,), 17), ((1000, 17), 3)]


@pytest.mark.parametrize("fam", list(FAMILIES))
@pytest.mark.parametrize("shape", LAYER_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("op", ["linear", "fused", "fused_nobias"])
def test_layer_gradients(apis, op, shape, fam):
    m, ml = apis
    dtype, prec = FAMILIES[fam]
    x_shape, out_f = shape
    rng = np.random.default_rng(seed(op, shape, fam))
    fused = op != "linear"
    (tg, tx, tw, tb), (g, x, w, b) = layer_inputs(m, rng, dtype, x_shape, out_f,
                                                   bias=op == "fused")
    if fused:
        res = ml.fused_linear_gelu_backward(tg, tx, tw, tb, precision=prec)
    else:
        res = ml.linear_backward(tg, tx, tw, precision=prec)
    refs, bounds = layer_bounds(g, x, w, b, dtype, prec, fused)
    assert res[0].shape == x.shape and res[1].shape == w.shape
    assert all(r.dtype is dtype for r in res if r is not None)
    for got, ref, bound, what in zip(res, refs, bounds, ("grad_x", "grad_W", "grad_b")):
        if op == "fused_nobias" and what == "grad_b":
            assert got is None
            continue
        check(stored(m, got), ref, bound, f"{op} {what} {fam} {shape}")


def test_linear_backward_without_bias(apis):
    m, ml = apis
    rng = np.random.default_rng(5)
    (tg, tx, tw, _), (g, x, w, _) = layer_inputs(m, rng, DT.FLOAT32, (9, 6), 4)
    gx, gw, gb = ml.linear_backward(tg, tx, tw, has_bias=False)
    assert gb is None
    refs, bounds = layer_bounds(g, x, w, np.zeros(4), DT.FLOAT32, None, False)
    check(stored(m, gx), refs[0], bounds[0])
    check(stored(m, gw), refs[1], bounds[1])


MATMUL_SHAPES = [((1, 1), (1, 1)), ((3, 17), (17, 5)), ((129, 3), (3, 257)),
                 ((17, 257), (257, 129)), ((3, 67, 45), (3, 45, 29)), ((3, 67, 45), (45, 29)),
                 ((1, 67, 45), (3, 45, 29)), ((67, 45), (3, 45, 29)),
                 ((2, 3, 33, 17), (17, 40)), ((45,), (45, 29)), ((67, 45), (45,)),
                 ((45,), (45,)), ((5, 1, 9), (5, 9, 1)), ((1000, 17), (17, 3))]


@pytest.mark.parametrize("fam", list(FAMILIES))
@pytest.mark.parametrize("a_shape, b_shape", MATMUL_SHAPES,
                         ids=lambda s: "x".join(map(str, s)))
def test_matmul_gradients(apis, a_shape, b_shape, fam):
    m, ml = apis
    dtype, prec = FAMILIES[fam]
    rng = np.random.default_rng(seed(a_shape, b_shape, fam))
    (tg, ta, tb), (g, a, b) = matmul_inputs(m, rng, dtype, a_shape, b_shape)
    ga, gb = ml.matmul_backward(tg, ta, tb, precision=prec)
    assert ga.shape == a.shape and gb.shape == b.shape and ga.dtype is dtype
    (ra, rb), (ba, bb) = matmul_bounds(g, a, b, dtype, prec)
    check(stored(m, ga), ra, ba, f"grad_a {fam}")
    check(stored(m, gb), rb, bb, f"grad_b {fam}")


@pytest.mark.parametrize("a_shape, b_shape", [((0, 5), (5, 3)), ((4, 0), (0, 3)),
                                              ((4, 5), (5, 0)), ((0, 4, 5), (5, 3)),
                                              ((0, 4, 5), (0, 5, 3))])
def test_matmul_gradients_of_empty_products(apis, a_shape, b_shape):
    """Zero-size dimensions: gradients of the operands' shapes, zeros where a sum is empty."""
    m, ml = apis
    rng = np.random.default_rng(3)
    (tg, ta, tb), (g, a, b) = matmul_inputs(m, rng, DT.FLOAT32, a_shape, b_shape)
    ga, gb = ml.matmul_backward(tg, ta, tb)
    ra, rb = mb.reference("matmul_backward", g, a, b)
    assert ga.shape == a_shape and gb.shape == b_shape
    np.testing.assert_array_equal(stored(m, ga), ra)
    np.testing.assert_array_equal(stored(m, gb), rb)


def test_linear_forward(apis):
    """CudaML.linear: x Wᵀ + b in every family, x with leading dimensions and 1-D."""
    m, ml = apis
    rng = np.random.default_rng(8)
    for fam, (dtype, prec) in FAMILIES.items():
        for x_shape, n in (((7, 13), 5), ((2, 3, 33), 17), ((33,), 9)):
            (_, tx, tw, tb), (_, x, w, b) = layer_inputs(m, rng, dtype, x_shape, n)
            y = ml.linear(tx, tw, tb, precision=prec)
            assert y.shape == x_shape[:-1] + (n,) and y.dtype is dtype
            ref = lin.reference("linear", x, w, bias=b)
            k = x_shape[-1]
            u_acc, u_prod = arith(dtype, prec, recompute=True)
            # the GEMM's error, the bias added in the accumulator type, the store
            bound = (gamma(depth(k), u_acc) + u_prod + u_acc + U_OUT[dtype]) * \
                (np.abs(x) @ np.abs(w).T + np.abs(b)) + ATOL[dtype]
            check(stored(m, y), ref, bound, f"linear {fam} {x_shape}")
            y2 = ml.linear(tx, tw)
            check(stored(m, y2), x @ w.T, gemm_bound(np.abs(x), np.abs(w).T, k, dtype, None,
                                                     recompute=True))


def test_pytorch_autograd_agrees(apis):
    """Our gradients (float32, this mode) against PyTorch's autograd in float64 of F.linear,
    GELU(F.linear) and torch.matmul, within the float32 bounds."""
    torch = pytest.importorskip("torch")
    m, ml = apis
    rng = np.random.default_rng(11)
    (tg, tx, tw, tb), (g, x, w, b) = layer_inputs(m, rng, DT.FLOAT32, (37, 19), 23)
    T = [torch.tensor(v, requires_grad=True) for v in (x, w, b)]
    for fused in (False, True):
        y = torch.nn.functional.linear(*T)
        if fused:
            y = torch.nn.functional.gelu(y, approximate="tanh")
        want = torch.autograd.grad(y, T, torch.tensor(g))
        res = ml.fused_linear_gelu_backward(tg, tx, tw, tb) if fused else \
            ml.linear_backward(tg, tx, tw)
        _, bounds = layer_bounds(g, x, w, b, DT.FLOAT32, None, fused)
        for got, ref, bound in zip(res, want, bounds):
            check(stored(m, got), ref.numpy(), bound + 1e-12 * np.abs(ref.numpy()))
    (tg, ta, tb2), (g, a, bb) = matmul_inputs(m, rng, DT.FLOAT32, (3, 29, 31), (31, 17))
    A, B = torch.tensor(a, requires_grad=True), torch.tensor(bb, requires_grad=True)
    want = torch.autograd.grad(torch.matmul(A, B), (A, B), torch.tensor(g))
    got = ml.matmul_backward(tg, ta, tb2)
    _, bounds = matmul_bounds(g, a, bb, DT.FLOAT32, None)
    for o, ref, bound in zip(got, want, bounds):
        check(stored(m, o), ref.numpy(), bound + 1e-12 * np.abs(ref.numpy()))


def test_reference_agrees_with_the_ops(apis):
    """The family's float64 reference is what the ops compute (float64, this mode)."""
    m, ml = apis
    rng = np.random.default_rng(12)
    g, x, w, b = (rng.standard_normal(s) for s in ((4, 6), (4, 5), (6, 5), (6,)))
    for op, res in (("linear_backward", ml.linear_backward(*map(m.from_numpy, (g, x, w)))),
                    ("fused_linear_gelu_backward", ml.fused_linear_gelu_backward(
                        *map(m.from_numpy, (g, x, w, b))))):
        for got, ref in zip(res, mb.reference(op, g, x, w, bias=b)):
            np.testing.assert_allclose(stored(m, got), ref, rtol=1e-12, atol=1e-12)
    a, bm_, gm = rng.standard_normal((3, 4, 5)), rng.standard_normal((5, 6)), \
        rng.standard_normal((3, 4, 6))
    for got, ref in zip(ml.matmul_backward(*map(m.from_numpy, (gm, a, bm_))),
                        mb.reference("matmul_backward", gm, a, bm_)):
        np.testing.assert_allclose(stored(m, got), ref, rtol=1e-12, atol=1e-12)


# -- bad input: typed errors, the pool still usable after ---------------------------------------
def test_bad_input_raises_typed_errors(apis):
    m, ml = apis
    rng = np.random.default_rng(2)
    f32 = [m.from_numpy(rng.standard_normal(s).astype(np.float32))
           for s in ((4, 6), (4, 5), (6, 5), (6,))]
    g, x, w, b = f32
    x64 = m.from_numpy(rng.standard_normal((4, 5)))
    cases = [
        (cb.ShapeMismatchError, "grad_out has shape", lambda: ml.linear_backward(
            m.from_numpy(np.ones((4, 7), np.float32)), x, w)),
        (cb.ShapeMismatchError, "grad_out has shape", lambda: ml.fused_linear_gelu_backward(
            m.from_numpy(np.ones((3, 6), np.float32)), x, w, b)),
        (cb.ShapeMismatchError, "in_features", lambda: ml.linear_backward(
            g, m.from_numpy(np.ones((4, 4), np.float32)), w)),
        (cb.ShapeMismatchError, "weight must be", lambda: ml.linear_backward(
            g, x, m.from_numpy(np.ones((6, 5, 1), np.float32)))),
        (cb.ShapeMismatchError, "bias must have shape", lambda: ml.fused_linear_gelu_backward(
            g, x, w, m.from_numpy(np.ones(5, np.float32)))),
        (cb.DTypeMismatchError, "mixed dtypes", lambda: ml.linear_backward(g, x64, w)),
        (cb.DTypeMismatchError, "mixed dtypes", lambda: ml.matmul_backward(g, x64, w)),
        (cb.DTypeMismatchError, "does not support", lambda: ml.linear_backward(
            *(m.from_numpy(np.ones(s, np.int32)) for s in ((4, 6), (4, 5), (6, 5))))),
        (cb.InvalidArgumentError, "has_bias", lambda: ml.linear_backward(g, x, w, has_bias=1)),
        (cb.InvalidArgumentError, "precision must be", lambda: ml.linear_backward(
            g, x, w, precision="fp16")),
        (cb.InvalidArgumentError, "float32 operands only", lambda: ml.matmul_backward(
            *(m.from_numpy(rng.standard_normal(s)) for s in ((4, 6), (4, 5), (5, 6))),
            precision="tf32")),
        (cb.InvalidArgumentError, "CudaTensor", lambda: ml.matmul_backward(
            np.ones((4, 6), np.float32), x, m.from_numpy(np.ones((5, 6), np.float32)))),
        (cb.ShapeMismatchError, "grad_out has shape", lambda: ml.matmul_backward(
            g, x, m.from_numpy(np.ones((5, 7), np.float32)))),
        (cb.ShapeMismatchError, "inner dimensions", lambda: ml.matmul_backward(
            g, x, m.from_numpy(np.ones((6, 6), np.float32)))),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()
    dead = m.from_numpy(np.ones((4, 5), np.float32))
    dead.free()
    for call in (lambda: ml.linear_backward(g, dead, w),
                 lambda: ml.fused_linear_gelu_backward(g, dead, w, b),
                 lambda: ml.matmul_backward(g, dead, m.from_numpy(np.ones((5, 6), np.float32)))):
        with pytest.raises(cb.TensorFreedError):
            call()
    # the pool and the ops still work after the errors
    (tg, tx, tw, _), (gv, xv, wv, _) = layer_inputs(m, rng, DT.FLOAT32, (4, 5), 6)
    gx, gw, gb = ml.linear_backward(tg, tx, tw)
    refs, bounds = layer_bounds(gv, xv, wv, np.zeros(6), DT.FLOAT32, None, False)
    for got, ref, bound in zip((gx, gw, gb), refs, bounds):
        check(stored(m, got), ref, bound)


def test_matmul_nt_and_tn_argument_errors(apis):
    m, _ = apis
    a = m.from_numpy(np.ones((4, 5), np.float32))
    with pytest.raises(cb.ShapeMismatchError, match="at least 2 dimensions"):
        mm.matmul_tn(m, m.from_numpy(np.ones(5, np.float32)), a)
    with pytest.raises(cb.ShapeMismatchError, match="inner dimensions"):
        mm.matmul_tn(m, a, m.from_numpy(np.ones((5, 3), np.float32)))
    with pytest.raises(cb.ShapeMismatchError, match="inner dimensions"):
        mm.matmul_nt(m, a, m.from_numpy(np.ones((3, 4), np.float32)))
    with pytest.raises(cb.ShapeMismatchError, match="out has shape"):
        mm.matmul_tn(m, a, a, out=m.create_tensor((4, 4)))
    with pytest.raises(cb.InvalidArgumentError, match="grad"):
        mm.linear(m, a, a, epilogue=mm.GRAD_EPILOGUE)
    with pytest.raises(cb.InvalidArgumentError, match="grad"):
        mm.linear(m, a, a, epilogue="bias", grad=m.create_tensor((4, 4)))
    with pytest.raises(cb.ShapeMismatchError, match="grad must have"):
        mm.linear(m, a, a, epilogue=mm.GRAD_EPILOGUE, grad=m.create_tensor((4, 5)))


def test_matmul_tn_and_nt_against_numpy(apis):
    """aᵀ b and a bᵀ with full and broadcast batches, every family."""
    m, _ = apis
    rng = np.random.default_rng(4)
    for fam, (dtype, prec) in FAMILIES.items():
        for a_shape, b_shape in (((13, 7), (13, 5)), ((3, 13, 7), (13, 5)),
                                 ((13, 7), (3, 13, 5)), ((2, 40, 33), (2, 40, 17))):
            ta, a = make(m, rng.standard_normal(a_shape), dtype)
            tb, b = make(m, rng.standard_normal(b_shape), dtype)
            out = mm.matmul_tn(m, ta, tb, prec)
            at = np.swapaxes(a, -1, -2)
            check(stored(m, out), np.matmul(at, b),
                  gemm_bound(np.abs(at), np.abs(b), a_shape[-2], dtype, prec), f"tn {fam}")
            tb2, b2 = make(m, rng.standard_normal(b_shape[:-2] + (b_shape[-1], a_shape[-1])),
                           dtype)
            out = mm.matmul_nt(m, ta, tb2, prec)
            bt = np.swapaxes(b2, -1, -2)
            check(stored(m, out), np.matmul(a, bt),
                  gemm_bound(np.abs(a), np.abs(bt), a_shape[-1], dtype, prec), f"nt {fam}")


# -- kernels: parameter sets, rendering (anywhere) --------------------------------------------
def test_template_variants_are_the_configs_launched():
    """The family lists the a_trans GEMM of every tn config (both alignments; none for TF32),
    the bias_gelu_grad kernel of every linear config, the skinny reduce with it and the
    grouped kernels (every dtype, tile and column-sum choice); all
    render to one kernel without #error, with names unique across the package's variants."""
    v = mb.template_variants()
    want = set()
    for dt, prec in mb.TN_FAMILIES:
        family, _ = mm.family(dt, prec)
        for vec in (True, False):
            for c in mm.tn_configs(dt, prec, vec):
                t = mm.config_template(c, family)   # (float32's x3 configs: mma, vec only)
                assert vec or not c.get("x3")
                want.add((t, tuple(sorted(mm.tn_params(t, dt, c, vec).items()))))
    assert any(c.get("x3") for c in mm.tn_configs(DT.FLOAT32, None, True))
    assert not any(c.get("x3") for c in mm.tn_configs(DT.FLOAT32, "ieee", True))
    for dt, prec in mb.LINEAR_FAMILIES:
        family, _ = mm.family(dt, prec, linear=True)
        for vec in (True, False):
            for c in mm.linear_configs(dt, prec, vec):
                t = mm.config_template(c, family)
                want.add((t, tuple(sorted(mm.linear_params(t, dt, c, vec,
                                                           mm.GRAD_EPILOGUE).items()))))
    want.add((mm.SIMT_TEMPLATE, tuple(sorted(mm.splitk_epilogue_params(
        DT.FLOAT32, mm.GRAD_EPILOGUE).items()))))
    for dt in FLOATS:   # the grouped small GEMMs: every tile, with and without column sums
        for bm in grouped.TILES:
            for colsum in (False, True):
                want.add((grouped.TEMPLATE, tuple(sorted({
                    **dtype_params(dt), "bm": bm, "bk": grouped.BK, "colsum": colsum}.items()))))
    got = {(t, tuple(sorted(p.items()))) for t, sets in v.items() for p in sets}
    assert got == want and len(got) == sum(len(s) for s in v.values())
    assert not mm.tn_configs(DT.FLOAT32, "tf32", True) and mm.has_tn_kernel(DT.FLOAT16, None)
    names = set()
    for t, sets in v.items():
        for p in sets:
            name, src = GEN.render_kernel(t, **dict(p))
            assert declared_kernels(src) == [name] and "#error" not in src
            if p.get("a_trans"):
                assert "a_trans" in p and p["b_trans"] is False and p["epilogue"] == "none"
                if t == mm.SIMT_TEMPLATE:
                    assert "a_col_ok" in src
                elif p["dtype"] == "float32":   # (x3: m permuted, 16-byte fragment loads)
                    assert "sap + a_off[q]" in src and "int batch, int k_chunk" in src
                else:
                    assert "ldsm_x4_t(sa + a_off[i]" in src
            names.add(name)
    from cuda_backend.kernels import template_variants
    others = {GEN.render_kernel(t, **dict(p))[0] for t, sets in template_variants().items()
              for p in sets if t in v}
    assert len(names) == len(got) and names <= others


def test_a_trans_excludes_b_trans():
    """a_trans with b_trans is an #error in both templates; the mma template's float32
    a_trans (TF32 or x3) renders, with m permuted (EROW) and A's fragments 16-byte loads."""
    cfg = mm.S_64x64x8_q2
    bad = {**mm.tn_params(mm.SIMT_TEMPLATE, DT.FLOAT32, cfg, True), "b_trans": True}
    assert "#error" in GEN.render_kernel(mm.SIMT_TEMPLATE, **bad)[1]
    for c in (mm.T_64x64x16, mm.X_64x128x32_w32x64):
        for vec in (True, False):
            ok = mm.tn_params(mm.MMA_TEMPLATE, DT.FLOAT32, c, vec)
            src = GEN.render_kernel(mm.MMA_TEMPLATE, **ok)[1]
            assert "#error" not in src and "#define EROW(i, h) (er + 2 * (i) + (h))" in src
            assert ("int batch, int k_chunk" in src) is bool(c.get("x3"))
            bad = {**ok, "b_trans": True}
            assert "#error" in GEN.render_kernel(mm.MMA_TEMPLATE, **bad)[1]
    plain = mm.simt_params(DT.FLOAT32, cfg, True)
    assert "a_trans" not in plain and "a_trans" not in mm.kernel_params(
        mm.SIMT_TEMPLATE, DT.FLOAT32, cfg, True)
    assert mm.linear_params(mm.SIMT_TEMPLATE, DT.FLOAT32, cfg, True, "bias")["a_trans"] is False


def test_gelu_grad_kernels_take_g_after_bias():
    for t, p in ((mm.SIMT_TEMPLATE, mm.linear_params(mm.SIMT_TEMPLATE, DT.FLOAT64,
                                                     mm.D_64x64x8, False, mm.GRAD_EPILOGUE)),
                 (mm.MMA_TEMPLATE, mm.linear_params(mm.MMA_TEMPLATE, DT.FLOAT16,
                                                    mm.H_64x64x32, True, mm.GRAD_EPILOGUE)),
                 (mm.SIMT_TEMPLATE, mm.splitk_epilogue_params(DT.FLOAT32, mm.GRAD_EPILOGUE))):
        name, src = GEN.render_kernel(t, **p)
        sig = kernel_signature(src, name)
        names = [re.split(r"[\s*]+", s.strip())[-1] for s in sig]
        assert names[names.index("bias") + 1] == "G", names
        assert "gelu_grad(" in src


# -- launches on a recording backend (anywhere) ---------------------------------------------
@pytest.mark.parametrize("fam", ["fp32", "fp64", "fp16", "bf16"])
@pytest.mark.parametrize("shape", [(1, 3, 1), (130, 3000, 136), (4096, 32, 1024),
                                   (3, 131, 7, 5)])
def test_matmul_tn_launches_the_a_trans_kernel(fam, shape):
    """aᵀ b launches a_trans kernels of the GEMM's configs with a, b, out, M, N, K, the
    batch strides (a's K M, b's 0 when broadcast) and, for SIMT and 3xTF32, the batch and
    K chunk (split-K when chosen); the alignment class reads M, not K."""
    dtype, prec = FAMILIES[fam]
    m = RecordingMath()
    batch, (K, M, N) = (shape[0], shape[1:]) if len(shape) == 4 else (1, shape)
    a = m.backend.empty(((batch,) if batch > 1 else ()) + (K, M), dtype)
    b = m.backend.empty((K, N), dtype)
    out = mm.matmul_tn(m, a, b, prec)
    assert out.shape == a.shape[:-2] + (M, N)
    if m.picked is not None:   # (one candidate: no autotuning)
        op, cands = m.picked
        assert op.endswith("_at") and not any(c.get("wgmma") or c.get("skinny") for c in cands)
    m.backend.launches.clear()
    mm.matmul_tn(m, a, b, prec, out=out)
    gemm = [(k, g, v) for k, g, _, v in m.backend.launches
            if k.params.get("kind") != "splitk_reduce"]
    assert len(gemm) == 1
    k, grid, values = gemm[0]
    vw = 16 // dtype.itemsize
    assert k.params["a_trans"] is True and k.params["vec"] is (M % vw == 0 and N % vw == 0)
    assert values[0] == a.ptr and values[1] == b.ptr and values[3:6] == [M, N, K]
    assert values[6:8] == [K * M if batch > 1 else 0, 0]
    if k.template == mm.SIMT_TEMPLATE or k.params.get("x3"):
        assert grid[2] % batch == 0 and values[8] == batch
        assert values[2] == out.ptr or grid[2] > batch   # split-K: a workspace, then reduce
    else:
        assert len(values) == 8


def test_matmul_nt_launches_the_linear_kernel_without_bias():
    m = RecordingMath()
    for dtype in (DT.FLOAT32, DT.FLOAT16):
        a = m.backend.empty((3, 70, 33), dtype)
        b = m.backend.empty((40, 33), dtype)
        out = mm.matmul_nt(m, a, b)
        assert out.shape == (3, 70, 40)
        m.backend.launches.clear()
        mm.matmul_nt(m, a, b, out=out)
        (k, grid, _, values), = m.backend.launches
        assert k.params["b_trans"] is True and k.params["epilogue"] == "bias"
        assert values[:7] == [a.ptr, b.ptr, out.ptr, 0, 70, 40, 33]
        assert values[7:9] == [70 * 33, 0] and grid[2] == 3
        if dtype is DT.FLOAT32:   # K = 33: element loads, so no 3xTF32 config (CUDA cores)
            assert k.template == mm.SIMT_TEMPLATE


@pytest.mark.parametrize("shape", [(7, 13, 5), (129, 127, 131), (32, 1024, 4096)])
def test_gelu_grad_recompute_passes_g(shape):
    """mm.linear with the bias_gelu_grad epilogue: x, W, out, bias, G, M, N, K (or, for the
    skinny configs, G to the reduce after the bias)."""
    m = RecordingMath()
    M, K, N = shape
    x, w = m.backend.empty((M, K), DT.FLOAT32), m.backend.empty((N, K), DT.FLOAT32)
    b, g = m.backend.empty((N,), DT.FLOAT32), m.backend.empty((M, N), DT.FLOAT32)
    dz = mm.linear(m, x, w, b, mm.GRAD_EPILOGUE, grad=g)
    assert m.picked is None or m.picked[0].endswith("_gelugrad")
    m.backend.launches.clear()
    mm.linear(m, x, w, b, mm.GRAD_EPILOGUE, out=dz, grad=g)
    k, _, _, values = m.backend.launches[-1]
    assert k.params["epilogue"] == mm.GRAD_EPILOGUE
    if k.params.get("kind") == "splitk_epilogue":
        assert values[1:4] == [dz.ptr, b.ptr, g.ptr]
    else:
        assert values[:8] == [x.ptr, w.ptr, dz.ptr, b.ptr, g.ptr, M, N, K]


# -- GPU: every candidate config of the new modes -------------------------------------------
def _shifted(m, values, dtype):
    """A tensor of values one element past a 16-byte aligned pointer: (view, base)."""
    values = np.asarray(values, np.float64)
    base, _ = make(m, np.concatenate([[0.0], values.ravel()]), dtype)
    return CudaTensor(values.shape, dtype, base.device_id, base.ptr + dtype.itemsize,
                      owner=base), base


@gpu
@pytest.mark.parametrize("fam", ["fp32", "fp64", "fp16", "bf16"])
def test_gpu_every_tn_config_is_correct(apis, fam):
    """Every a_trans config, aligned (vec) and not (odd M, N, K, and misaligned pointers),
    split-K forced for SIMT, with a full batch, a broadcast b and a broadcast a."""
    m, _ = apis
    dtype, prec = FAMILIES[fam]
    template, _ = mm.family(dtype, prec)
    dev = m.backend.current_device
    rng = np.random.default_rng(21)
    m_vec = 130 if dtype is DT.FLOAT64 else 136
    for vec, (K, M, N), layout in ((True, (131, m_vec, m_vec), "batch"),
                                   (True, (264, 64 + 8, 16), "broadcast_a"),
                                   (False, (197, 133, 131), "batch"),
                                   (False, (70, 33, 129), "broadcast_b"),
                                   (False, (131, 136, 136), "misaligned")):
        a_shape = (K, M) if layout == "broadcast_a" else (3, K, M)
        b_shape = (K, N) if layout in ("broadcast_b", "misaligned") else (3, K, N)
        if layout == "misaligned":
            ta, base = _shifted(m, rng.standard_normal(a_shape), dtype)
            a = stored(m, ta)
        else:
            ta, a = make(m, rng.standard_normal(a_shape), dtype)
        tb, b = make(m, rng.standard_normal(b_shape), dtype)
        at = np.swapaxes(a, -1, -2)
        ref = np.matmul(at, b)
        bound = gemm_bound(np.abs(at), np.abs(b), K, dtype, prec)
        p = mm.plan_shapes(ta.shape[:-2] + (M, K), tb.shape)
        for cfg in mm.tn_configs(dtype, prec, vec):
            for splits in ((1, 3) if template == mm.SIMT_TEMPLATE else (None,)):
                out = poisoned(m, ref.shape, dtype)
                assert mm.is_vec_ok(ta, tb, out, p, a_trans=True) is vec
                mm.run_config(m, template, cfg, ta, tb, out, p, dtype, vec, dev,
                              splits=splits, a_trans=True)
                check(stored(m, out), ref, bound, f"{cfg} {vec} {splits} {layout}")
                out.free()


@gpu
@pytest.mark.parametrize("fam", list(FAMILIES) + ["ieee"])
def test_gpu_every_gelu_grad_config_is_correct(apis, fam):
    """The bias_gelu_grad epilogue of every linear config (and the skinny split-K configs
    with their reduce), aligned and not, with and without a bias, against float64."""
    m, _ = apis
    dtype, prec = FAMILIES.get(fam, (DT.FLOAT32, "ieee"))
    family, _ = mm.family(dtype, mm.normalize_precision(prec, dtype), linear=True)
    dev = m.backend.current_device
    rng = np.random.default_rng(22)
    n_vec = 130 if dtype is DT.FLOAT64 else 136
    for vec, (M, K, N) in ((True, (131, 264, n_vec)), (False, (131, 197, 133)),
                           (True, (32, 1024, 264))):
        for with_bias in (True, False):
            (tg, tx, tw, tb), (g, x, w, b) = layer_inputs(m, rng, dtype, (M, K), N, with_bias)
            z = x @ w.T + b
            d1, terms, au = gelu_grad_parts(z)
            ref = g * d1
            u_acc, u_prod = arith(dtype, mm.normalize_precision(prec, dtype), recompute=True)
            dz_err = (gamma(depth(K), u_acc) + u_prod) * (np.abs(x) @ np.abs(w).T + np.abs(b)) \
                + u_acc * np.abs(z)
            u_eval = 2.0**-53 if dtype is DT.FLOAT64 else 2.0**-24
            bound = np.abs(g) * (L_GELU2 * dz_err + (16 * au + 24) * u_eval * terms) + \
                U_OUT[dtype] * np.abs(ref) + ATOL[dtype]
            p = mm.Plan(1, M, N, K, 0, 0, (M, N))
            pn = mm.normalize_precision(prec, dtype)
            # the linear configs, and the skinny split-K ones (M <= 64, or few output tiles)
            # at their split counts
            cands = mm.linear_configs(dtype, pn, vec) + \
                mm.skinny_candidates(dtype, pn, p, 132, linear=True)
            for cfg in cands:
                out = poisoned(m, (M, N), dtype)
                assert mm.is_vec_ok(tx, tw, out, p) is vec
                mm.run_config(m, mm.config_template(cfg, family), cfg, tx, tw, out, p, dtype,
                              vec, dev, epilogue=mm.GRAD_EPILOGUE, bias=tb, grad=tg)
                check(stored(m, out), ref, bound, f"{cfg} {vec} bias={with_bias}")
                out.free()


@gpu
@pytest.mark.large
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_gpu_large_layer_and_batch_32(apis, fam):
    """The report's shapes, smaller in K: a 1024-row layer and the batch-32 MLP layer
    (1024 -> 4096), every op, against float64 on sampled rows."""
    m, ml = apis
    dtype, prec = FAMILIES[fam]
    rng = np.random.default_rng(23)
    for rows in (1024, 32):
        (tg, tx, tw, tb), (g, x, w, b) = layer_inputs(m, rng, dtype, (rows, 1024), 4096)
        for fused in (False, True):
            res = ml.fused_linear_gelu_backward(tg, tx, tw, tb, precision=prec) if fused \
                else ml.linear_backward(tg, tx, tw, precision=prec)
            refs, bounds = layer_bounds(g, x, w, b, dtype, prec, fused)
            for got, ref, bound in zip(res, refs, bounds):
                check(stored(m, got), ref, bound, f"{fused} {rows}")
                got.free()


@gpu
def test_gpu_plans_take_the_repeated_call(apis):
    """After a first call, each op's plan (m.plans) takes the same call and gives the same
    result; a freed operand makes it step aside (the general path raises)."""
    m, ml = apis
    rng = np.random.default_rng(24)
    (tg, tx, tw, tb), _ = layer_inputs(m, rng, DT.FLOAT32, (70, 33), 40)
    (mg, ma, mb_), _ = matmul_inputs(m, rng, DT.FLOAT32, (3, 70, 33), (33, 40))
    calls = [
        (mbl.layer_plan_key("linear_backward", tg, tx, tw, True, None),
         lambda: ml.linear_backward(tg, tx, tw)),
        (mbl.layer_plan_key("fused_linear_gelu_backward", tg, tx, tw, tb, None),
         lambda: ml.fused_linear_gelu_backward(tg, tx, tw, tb)),
        (mb.matmul_plan_key(mg, ma, mb_, None), lambda: ml.matmul_backward(mg, ma, mb_)),
    ]
    for key, call in calls:
        first = [stored(m, r) for r in call() if r is not None]
        assert key in m.plans, key[0]
        again = call_through_plan(m, key, call)
        for r0, r1 in zip(first, [r for r in again if r is not None]):
            np.testing.assert_array_equal(r0, stored(m, r1))
    dead = m.from_numpy(np.ones((70, 33), np.float32))
    dead.free()
    with pytest.raises(cb.TensorFreedError):
        ml.linear_backward(tg, dead, tw)


@gpu
def test_gpu_tf32_transposes_a_first(apis):
    """TF32 has no a_trans kernel: matmul_tn runs the plain GEMM on a transposed copy."""
    m, _ = apis
    assert not mm.has_tn_kernel(DT.FLOAT32, "tf32")
    rng = np.random.default_rng(25)
    ta, a = make(m, rng.standard_normal((300, 257)), DT.FLOAT32)
    tb, b = make(m, rng.standard_normal((300, 129)), DT.FLOAT32)
    out = mm.matmul_tn(m, ta, tb, "tf32")
    check(stored(m, out), a.T @ b, gemm_bound(np.abs(a.T), np.abs(b), 300, DT.FLOAT32, "tf32"))


# -- 3xTF32 GEMMs (float32's default): NN (matmul), NT (matmul_nt), TN (matmul_tn) ------------
X3_LAYOUTS = ("nn", "nt", "tn")
# (batch or 0, M, K, N): element loads (odd K, M, N) and 16-byte loads (K, M and N multiples of
# 4 but of no tile; a small output over a long K, where split-K matters)
X3_ODD = [(0, 129, 131, 127), (0, 1000, 1001, 999), (3, 65, 67, 63)]
X3_ALIGNED = [(0, 132, 1000, 996), (3, 68, 260, 60), (0, 36, 4100, 20)]
HOPPER = (9, 0)


def x3_call(layout):
    return {"nn": mm.matmul, "nt": mm.matmul_nt, "tn": mm.matmul_tn}[layout]


def x3_shapes(layout, batch, M, K, N):
    """(a's shape, b's shape) of the layout's call for a (batch of) M x K @ K x N."""
    lead = (batch,) if batch else ()
    return lead + ((K, M) if layout == "tn" else (M, K)), \
        lead + ((N, K) if layout == "nt" else (K, N))


def x3_plan(layout, a_shape, b_shape):
    swap = lambda s: s[:-2] + (s[-1], s[-2])   # noqa: E731
    return mm.plan_shapes(swap(a_shape) if layout == "tn" else a_shape,
                          swap(b_shape) if layout == "nt" else b_shape)


def x3_reference(layout, a, b):
    """(A @ B, its elementwise bound: the float32 default's arithmetic) of stored operands."""
    A = np.swapaxes(a, -1, -2) if layout == "tn" else a
    B = np.swapaxes(b, -1, -2) if layout == "nt" else b
    return np.matmul(A, B), gemm_bound(np.abs(A), np.abs(B), A.shape[-1], DT.FLOAT32, None)


def _recording_runs(cc=HOPPER):
    """A RecordingMath whose autotuner runs every candidate (each launch packed with its
    kernel's parameter format, its threads the rendered THREADS) and keeps each one's
    launches in `runs`; it picks the first candidate."""
    import types
    m = RecordingMath(cc)
    m.runs = []

    def pick(op, key, cands, run, device_id=0, repeats=3):
        m.picked = (op, list(cands))
        for c in cands:
            n0 = len(m.backend.launches)
            run(c)
            m.runs.append((dict(c), m.backend.launches[n0:]))
        return dict(cands[0])
    m.autotuner = types.SimpleNamespace(pick=pick)
    return m


@pytest.mark.parametrize("layout", X3_LAYOUTS)
@pytest.mark.parametrize("prec", [None, "fp32", "ieee", "tf32"])
@pytest.mark.parametrize("shape", [(0, 1000, 1004, 996), (3, 260, 516, 200),
                                   (0, 3072, 8192, 768), (0, 4096, 4096, 1024),
                                   (0, 300, 301, 299)], ids=lambda s: "x".join(map(str, s)))
def test_float32_default_offers_x3(layout, prec, shape):
    """On a recording sm_90 device: float32's default (None / "fp32") offers the 3xTF32
    configs beside the SIMT ones where the operands allow 16-byte loads (matmul, matmul_tn:
    X3_GEMM at x3_split_options' counts; matmul_nt: the linear layer's), "ieee" and "tf32"
    none; every candidate's launches pack their kernel's format. An x3 candidate of NN / TN
    is one launch of the mma kernel (a_trans for TN) with a, b, out, M, N, K, the batch
    strides, the batch and K, or with split > 1 its K slices into a workspace that
    splitk_reduce sums into out; of NT one launch of the b_trans kernel, a null bias."""
    batch, M, K, N = shape
    if prec == "tf32" and layout == "tn":   # (a transposed first: test_gpu_tf32_transposes_a_first)
        assert not mm.has_tn_kernel(DT.FLOAT32, "tf32")
        return
    # (TF32 on sm_90 would time wgmma, whose B transpose this recording backend cannot
    # render: the TF32 list is checked on sm_80)
    m = _recording_runs((8, 0) if prec == "tf32" else HOPPER)
    a_shape, b_shape = x3_shapes(layout, batch, M, K, N)
    a, b = m.backend.empty(a_shape, DT.FLOAT32), m.backend.empty(b_shape, DT.FLOAT32)
    out = x3_call(layout)(m, a, b, prec)
    p = x3_plan(layout, a_shape, b_shape)
    vec = (M if layout == "tn" else K) % 4 == 0 and N % 4 == 0
    op, cands = m.picked or ("", [])   # (one candidate: no autotuning)
    x3 = [c for c in cands if c.get("x3")]
    if prec not in (None, "fp32") or not vec:
        assert not x3 and not any(k.params.get("x3") for k, *_ in m.backend.launches)
        return
    assert x3 and op == ("linear" if layout == "nt" else "matmul") + "_x3simt_float32" + \
        ("_at" if layout == "tn" else "")
    assert any(c.get("bm") and not c.get("x3") for c in cands)   # the SIMT ones too
    sa = M * K if batch else 0
    sb = K * N if batch else 0
    nb = max(batch, 1)
    for c, launches in m.runs:
        if not c.get("x3"):
            continue
        cfg = {k: v for k, v in c.items() if k != "split"}
        k, grid, smem, values = launches[0]
        assert k.template == mm.MMA_TEMPLATE
        assert smem == cfg["stages"] * (cfg["bm"] + cfg["bn"]) * cfg["bk"] * 4
        assert k.threads == (cfg["bm"] // cfg["wm"]) * (cfg["bn"] // cfg["wn"]) * 32
        tiles = -(-M // cfg["bm"]) * -(-N // cfg["bn"])
        if layout == "nt":
            assert cfg in mm.LINEAR_MMA_F32X3 and len(launches) == 1
            assert k.params == mm.linear_params(mm.MMA_TEMPLATE, DT.FLOAT32, cfg, True, "bias")
            assert grid == (tiles, 1, nb)
            assert values == [a.ptr, b.ptr, out.ptr, 0, M, N, K, sa, sb]
            continue
        assert cfg in mm.X3_GEMM
        assert k.params == mm.kernel_params(mm.MMA_TEMPLATE, DT.FLOAT32, cfg, True,
                                             a_trans=layout == "tn")
        splits = [s for d, s in ((dict(x), x["split"]) for x in x3) if
                  {q: v for q, v in d.items() if q != "split"} == cfg]
        assert splits == mm.x3_split_options(cfg, p, 132)
        chunk = -(-K // c["split"])
        chunk = -(-chunk // cfg["bk"]) * cfg["bk"]
        eff = -(-K // chunk)
        if eff == 1:
            assert len(launches) == 1 and grid == (tiles, 1, nb)
            assert values == [a.ptr, b.ptr, out.ptr, M, N, K, sa, sb, nb, K]
            continue
        kr, _, _, values_r = launches[1]
        assert len(launches) == 2 and grid == (tiles, 1, nb * eff)
        assert values[:2] == [a.ptr, b.ptr] and values[3:] == [M, N, K, sa, sb, nb, chunk]
        assert kr.params["kind"] == "splitk_reduce"
        assert values_r == [values[2], out.ptr, nb * M * N, eff]
    if layout != "nt":   # split-K offered except where the output fills the SMs
        assert any(c["split"] > 1 for c in x3) is (shape[1:] != (4096, 4096, 1024))


def test_x3_split_options_model():
    """x3_split_options: 1 first, then at most two counts >= 3 % faster by the model, whose
    K slices are >= 256 and whose split x batch fits the grid's z; none where the output
    fills the SMs (4096 x 1024 over K = 4096), some for the GPT-2 dW shapes (3072 x 768 and
    768 x 768 over 8192 rows: 144 and 36 tiles of 128 x 128 on 132 SMs)."""
    for cfg in mm.X3_GEMM:
        for (M, N, K, batch), many in (((4096, 1024, 4096, 1), False),
                                       ((3072, 768, 8192, 1), True),
                                       ((768, 768, 8192, 1), True),
                                       ((768, 768, 8192, 40000), False),
                                       ((768, 768, 300, 1), False)):
            p = mm.Plan(batch, M, N, K, M * K, K * N, (M, N))
            opts = mm.x3_split_options(cfg, p, 132)
            assert opts[0] == 1 and (len(opts) > 1) is many, (cfg, M, N, K, opts)
            t1 = mm.x3_split_time(cfg, p, 132, 1)
            for s in opts[1:]:
                assert K // s >= mm.X3_MIN_CHUNK - cfg["bk"] and s * batch <= 65535
                assert mm.effective_split(cfg, K, s) == s
                assert mm.x3_split_time(cfg, p, 132, s) < 0.97 * t1
            assert len(set(opts)) == len(opts) <= 3


@pytest.mark.parametrize("cfg", mm.X3_GEMM + [mm.T_64x64x16, mm.T_128x128x32],
                         ids=lambda c: "{}{bm}x{bn}x{bk}_w{wm}x{wn}".format(
                             "x3_" if c.get("x3") else "tf32_", **c))
def test_a_trans_tf32_tile_math_against_numpy(cfg):
    """The float32 a_trans kernel's A (K, M) tile, emulated: both loaders (16-byte chunks,
    rows A_RSTEP apart with the first row's swizzle; 4-byte elements, each at its own) put
    A[k][m] at the same place; each lane's 16-byte fragment loads give a0..a3 of m-tile i
    the values of rows EROW(i, 0) and EROW(i, 1) (the epilogue's rows) at k = t and t + 4,
    so that the mma's rows g and g + 8 of every m-tile cover the warp tile once; and the
    eight loads of each quarter warp fall in eight different 16-byte bank groups."""
    bm, bn, bk, wm, wn = (cfg[k] for k in ("bm", "bn", "bk", "wm", "wn"))
    threads = (bm // wm) * (bn // wn) * 32
    src = GEN.render_kernel(mm.MMA_TEMPLATE, **mm.tn_params(mm.MMA_TEMPLATE, DT.FLOAT32, cfg,
                                                          True))[1]
    cpt = wm // 32
    body = src[src.index("int swz_at(int r, int c) {"):]
    body = body[:body.index("}")]
    swz = {1: lambda r, c: c ^ ((r & 3) << 1), 2: lambda r, c: c ^ ((r & 1) | ((r & 2) << 1)),
           4: lambda r, c: c ^ (r & 3)}[cpt]
    expr = {1: "c ^ ((r & 3) << 1)", 2: "c ^ ((r & 1) | ((r & 2) << 1))", 4: "c ^ (r & 3)"}[cpt]
    assert f"return {expr};" in body   # the emulated swizzle is the rendered one
    assert "#define EROW(i, h) (er + 2 * (i) + (h))" in src
    assert "const int er = m0 + wrow + (lane >> 2) * 2 * MT;" in src
    epc, row = 4, bm * 4
    a_cpr = bm // epc
    rstep = threads // a_cpr
    assert threads % a_cpr == 0 and rstep % 4 == 0
    tile = np.random.default_rng(7).standard_normal((bk, bm))
    vec_smem = np.full(bk * bm, np.nan)
    for tid in range(threads):
        ch, r0 = tid % a_cpr, tid // a_cpr
        dst = r0 * row + swz(r0, ch) * 16
        for i in range(-(-bk * a_cpr // threads)):
            r = r0 + i * rstep
            if r < bk:
                d = (dst + i * rstep * row) // 4
                vec_smem[d:d + 4] = tile[r, ch * epc:(ch + 1) * epc]
    elem_smem = np.full(bk * bm, np.nan)
    for idx in range(bk * bm):
        r, c = divmod(idx, bm)
        elem_smem[(r * row + swz(r, c // epc) * 16 + (c % epc) * 4) // 4] = tile[r, c]
    np.testing.assert_array_equal(vec_smem, elem_smem)
    mt = wm // 16
    for warp in range(threads // 32):
        wrow = (warp // (bn // wn)) * wm
        for kk in range(bk // 8):
            covered = np.zeros((8, wm), int)   # (k, m) pairs the warp's fragments supply
            for q in range(mt // 2):
                for hi in (0, 1):
                    groups = []
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        off = t * row + swz(t, (wrow + g * 2 * mt) // epc + q) * 16
                        addr = kk * 8 * row + off + hi * 4 * row
                        groups.append((addr // 16) % 8)
                        vals = vec_smem[addr // 4:addr // 4 + 4]
                        # (x, y) -> m-tile 2q, rows h = 0, 1; (z, w) -> m-tile 2q + 1
                        for e in range(4):
                            i, h = 2 * q + e // 2, e % 2
                            m_row = wrow + g * 2 * mt + 2 * i + h    # EROW(i, h) - m0
                            k = kk * 8 + t + 4 * hi
                            assert vals[e] == tile[k, m_row], (warp, lane, q, e)
                            covered[t + 4 * hi, m_row - wrow] += 1
                    for quarter in range(4):
                        assert len(set(groups[8 * quarter:8 * quarter + 8])) == 8
            assert (covered == 1).all()


def test_x3_variants_are_listed_and_split_k():
    """The x3 GEMM kernels (16-byte loads only) are in matmul's and matmul_backward's
    variants, render without #error with batch and k_chunk after the strides (matmul_nt's
    b_trans x3 kernels, with the bias epilogue, do not split K); the mma variants other than
    x3 keep their 5-stride signature."""
    nn = [p for p in mm.template_variants()[mm.MMA_TEMPLATE]
          if p.get("x3") and "epilogue" not in p]   # (not the linear layer's)
    tn = [p for p in mb.template_variants()[mm.MMA_TEMPLATE]
          if p.get("x3") and p.get("a_trans")]
    assert {tuple(sorted(p.items())) for p in nn} == {
        tuple(sorted(mm.kernel_params(mm.MMA_TEMPLATE, DT.FLOAT32, c, True).items()))
        for c in mm.X3_GEMM}
    assert {tuple(sorted(p.items())) for p in tn} == {
        tuple(sorted(mm.tn_params(mm.MMA_TEMPLATE, DT.FLOAT32, c, True).items()))
        for c in mm.X3_GEMM}
    for p in nn + tn:
        name, src = GEN.render_kernel(mm.MMA_TEMPLATE, **p)
        sig = [re.split(r"[\s*]+", s.strip())[-1] for s in kernel_signature(src, name)]
        assert sig[-4:] == ["stride_a", "stride_b", "batch", "k_chunk"] and "#error" not in src
        assert "const int k_begin = (blockIdx.z / batch) * k_chunk;" in src
    for c in mm.LINEAR_MMA_F32X3:
        for epilogue in ("bias", "none"):
            p = {**mm.linear_params(mm.MMA_TEMPLATE, DT.FLOAT32, c, True, "bias"),
                 "epilogue": epilogue}
            name, src = GEN.render_kernel(mm.MMA_TEMPLATE, **p)
            sig = [re.split(r"[\s*]+", s.strip())[-1] for s in kernel_signature(src, name)]
            assert "#error" not in src and ("k_chunk" in sig) is (epilogue == "none")
    p = mm.kernel_params(mm.MMA_TEMPLATE, DT.FLOAT32, mm.T_128x128x32, True)
    name, src = GEN.render_kernel(mm.MMA_TEMPLATE, **p)
    assert [re.split(r"[\s*]+", s.strip())[-1] for s in kernel_signature(src, name)][-2:] == \
        ["stride_a", "stride_b"] and "const int k_begin = 0;" in src


@gpu
@pytest.mark.parametrize("layout", X3_LAYOUTS)
def test_gpu_every_x3_config(apis, layout):
    """Every 3xTF32 config of the layout (NN, TN: X3_GEMM at split counts 1, 3 and
    x3_split_options'; NT: the linear layer's x3 configs with a null bias) through
    run_config into a poisoned output: element loads on odd shapes (129x131x127,
    1000x1001x999, a batch of 3 65x67x63), 16-byte loads on aligned ones, against float64
    within the 3xTF32 bound (the module docstring)."""
    m, _ = apis
    dev = m.backend.current_device
    rng = np.random.default_rng(seed("x3", layout))
    cfgs = mm.LINEAR_MMA_F32X3 if layout == "nt" else mm.X3_GEMM
    for vec, shapes in ((False, X3_ODD), (True, X3_ALIGNED)):
        for batch, M, K, N in shapes:
            a_shape, b_shape = x3_shapes(layout, batch, M, K, N)
            ta, a = make(m, rng.standard_normal(a_shape), DT.FLOAT32)
            tb, b = make(m, rng.standard_normal(b_shape), DT.FLOAT32)
            ref, bound = x3_reference(layout, a, b)
            p = x3_plan(layout, a_shape, b_shape)
            for cfg in cfgs:
                splits = [None] if layout == "nt" else \
                    sorted({1, 3} | set(mm.x3_split_options(cfg, p, 132)))
                for s in splits:
                    out = poisoned(m, ref.shape, DT.FLOAT32)
                    assert mm.is_vec_ok(ta, tb, out, p, a_trans=layout == "tn") is vec
                    mm.run_config(m, mm.MMA_TEMPLATE, cfg, ta, tb, out, p, DT.FLOAT32, vec,
                                  dev, splits=s, epilogue="bias" if layout == "nt" else None,
                                  a_trans=layout == "tn")
                    check(stored(m, out), ref, bound, f"{layout} {cfg} {shape_id(p)} split {s}")
                    out.free()
            for t in (ta, tb):
                t.free()


def shape_id(p):
    return f"{p.batch}x{p.M}x{p.K}x{p.N}"


@gpu
@pytest.mark.parametrize("layout", X3_LAYOUTS)
def test_gpu_x3_through_the_autotuner(backend, layout, monkeypatch):
    """The public matmul / matmul_nt / matmul_tn (float32 default) on a CudaMath whose
    autotuner runs every candidate of the call into the call's output, poisoned first, and
    checks each result against float64 (the x3 ones among them where the operands allow
    16-byte loads), then picks an x3 one (the largest split); the call's result, and two
    more calls through the per-call plan (run_config made to raise), within the same
    bound."""
    import types
    from cuda_backend.cuda_math import CudaMath
    m = CudaMath(backend)
    rng = np.random.default_rng(seed("x3 tune", layout))
    for batch, M, K, N in ((0, 1000, 1004, 996), (3, 260, 516, 200), (0, 129, 131, 127)):
        a_shape, b_shape = x3_shapes(layout, batch, M, K, N)
        ta, a = make(m, rng.standard_normal(a_shape), DT.FLOAT32)
        tb, b = make(m, rng.standard_normal(b_shape), DT.FLOAT32)
        ref, bound = x3_reference(layout, a, b)
        out = poisoned(m, ref.shape, DT.FLOAT32)
        seen = []

        def pick(op, key, cands, run, device_id=0, repeats=3):
            for c in cands:
                m.backend.copy_to_device(np.full(ref.shape, np.nan, np.float32), out)
                run(c)
                check(stored(m, out), ref, bound, f"{layout} {c} {a_shape} {b_shape}")
                seen.append(c)
            x3 = sorted((c for c in cands if c.get("x3")), key=lambda c: c.get("split", 1))
            return dict(x3[-1] if x3 else cands[0])
        m._autotuner = types.SimpleNamespace(pick=pick)
        assert x3_call(layout)(m, ta, tb, out=out) is out
        check(stored(m, out), ref, bound, f"{layout} chosen")
        assert any(c.get("x3") for c in seen) is (M != 129), seen
        for _ in range(2):
            with monkeypatch.context() as mp:
                res = x3_call(layout)(m, ta, tb)   # makes the plan, or takes it
                mp.setattr("cuda_backend.ops.matmul_launch.run_config", _no_general_path)
                again = x3_call(layout)(m, ta, tb)
            check(stored(m, res), ref, bound, f"{layout} general")
            check(stored(m, again), ref, bound, f"{layout} plan")
            res.free()
            again.free()
        for t in (ta, tb, out):
            t.free()


def _no_general_path(*args, **kwargs):
    raise AssertionError("the general path ran where the per-call plan should have")


@gpu
@pytest.mark.large
@pytest.mark.parametrize("case", ["linear_backward", "gpt2_fc1_dW", "gpt2_fc2_dW",
                                  "gpt2_proj_dW", "gpt2_fc1_dX"])
def test_gpu_issue_shapes_float32(apis, case):
    """float32 default at the issue's shapes: linear_backward 4096x1024 -> 4096 (no bias) and
    GPT-2-small's gradient GEMMs over 8192 tokens (dW = Gᵀ X through matmul_tn, dX = G W
    through matmul), checked against float64 on 64 sampled output rows; the time (L2 flushed,
    CUDA events, median of 15, after the autotuner's first call) printed with PyTorch's
    float32 (TF32 off) where torch imports. Predictions (H100): linear_backward 1.00-1.10 ms
    (PyTorch 1.33); dW 3072x768 / 768x3072 over 8192: 0.62-0.70 ms, 768x768: 0.17-0.20 ms;
    dX 8192x768 from 3072: 0.56-0.62 ms (floors at 71 TFLOP/s: 0.544 / 0.136 / 0.544)."""
    from cuda_backend.performance.timing import DeviceTimer
    m, ml = apis
    dev = m.backend.current_device
    rng = np.random.default_rng(seed("issue", case))
    if case == "linear_backward":
        (tg, tx, tw, _), (g, x, w, _) = layer_inputs(m, rng, DT.FLOAT32, (4096, 1024), 4096,
                                                     bias=False)
        call = lambda: ml.linear_backward(tg, tx, tw, has_bias=False)   # noqa: E731
        rows = rng.choice(4096, 64, replace=False)
        refs = ((g[rows] @ w, x.shape), (g.T[rows] @ x, w.shape))
        bounds = (gemm_bound(np.abs(g[rows]), np.abs(w), 4096, DT.FLOAT32, None),
                  gemm_bound(np.abs(g.T[rows]), np.abs(x), 4096, DT.FLOAT32, None))
        flops = 4.0 * 4096 * 1024 * 4096
        torch_args = (g, x, w)
    else:
        out_f, in_f = {"gpt2_fc1_dW": (3072, 768), "gpt2_fc2_dW": (768, 3072),
                       "gpt2_proj_dW": (768, 768), "gpt2_fc1_dX": (3072, 768)}[case]
        tg, g = make(m, rng.standard_normal((8192, out_f)), DT.FLOAT32)
        if case.endswith("dW"):
            tx, x = make(m, rng.standard_normal((8192, in_f)), DT.FLOAT32)
            call = lambda: (mm.matmul_tn(m, tg, tx),)   # noqa: E731
            rows = rng.choice(out_f, 64, replace=False)
            refs = ((g.T[rows] @ x, (out_f, in_f)),)
            bounds = (gemm_bound(np.abs(g.T[rows]), np.abs(x), 8192, DT.FLOAT32, None),)
        else:
            tx, x = make(m, rng.standard_normal((out_f, in_f)) / np.sqrt(out_f), DT.FLOAT32)
            call = lambda: (mm.matmul(m, tg, tx),)   # noqa: E731
            rows = rng.choice(8192, 64, replace=False)
            refs = ((g[rows] @ x, (8192, in_f)),)
            bounds = (gemm_bound(np.abs(g[rows]), np.abs(x), out_f, DT.FLOAT32, None),)
        flops = 2.0 * 8192 * out_f * in_f
        torch_args = None
    res = call()
    for got, (ref, shape), bound in zip(res, refs, bounds):
        assert got.shape == shape
        check(stored(m, got)[rows], ref, bound, case)
    for r in res:
        if r is not None:
            r.free()
    timer = DeviceTimer(m.backend, dev, flush_l2=True)
    try:
        ms = float(np.median(timer.time(call, 2, 15, release=lambda r: [
            t.free() for t in r if t is not None])))
        line = f"{case} float32: {ms * 1e3:.1f} us, {flops / ms / 1e9:.1f} TFLOP/s"
        try:
            import torch
        except ImportError:
            print(line)
            return
        torch.backends.cuda.matmul.allow_tf32 = False
        if torch_args is not None:
            G, X, W = (torch.tensor(v, device="cuda", dtype=torch.float32) for v in torch_args)
            theirs = lambda: (G @ W, G.t() @ X)   # noqa: E731
        else:
            G = torch.tensor(g, device="cuda", dtype=torch.float32)
            X = torch.tensor(x, device="cuda", dtype=torch.float32)
            theirs = (lambda: G.t() @ X) if case.endswith("dW") else (lambda: G @ X)
        tms = float(np.median(timer.time(theirs, 2, 15)))
        print(f"{line}; torch {tms * 1e3:.1f} us: torch / ours time {tms / ms:.2f}")
    finally:
        timer.close()


# -- grouped launches (ops/matmul_grouped.py): the small gradients in one launch ---------------
def _emulate_grouped(products, cfg, flats):
    """The grouped kernel's partition in float64 NumPy: every product's tiles and K splits
    as cfg lays them out, each operand read from its flat array through the product's
    strides. Checks that each output element gets every k exactly once and that the blocks,
    workspace ranges and counters are disjoint and counted as cfg says; returns each C."""
    bm, out, first, ws_end, cnt_end = cfg.bm, [], 0, 0, 0
    for p, (splits, kchunk, tiles_n, p_first, ws_off, cnt_off), (a, b) in zip(
            products, cfg.jobs, flats):
        assert p_first == first and kchunk % grouped.BK == 0
        assert splits == 1 or (ws_off == ws_end and cnt_off == cnt_end)
        tiles = -(-p.M // bm) * tiles_n
        assert tiles_n == -(-p.N // bm)
        c = np.zeros((p.M, p.N))
        seen = np.zeros((p.M, p.N, p.K), np.int64)
        for tile in range(tiles):
            m0, n0 = (tile // tiles_n) * bm, (tile % tiles_n) * bm
            rows = np.arange(m0, min(p.M, m0 + bm))[:, None]
            cols = np.arange(n0, min(p.N, n0 + bm))[None, :]
            for split in range(splits):
                ks = np.arange(split * kchunk, min(p.K, (split + 1) * kchunk))
                A = a[rows * p.sam + ks[None, :] * p.sak]
                B = b[ks[:, None] * p.sbk + cols * p.sbn]
                c[rows, cols] += A @ B
                seen[rows[:, :, None], cols[:, :, None], ks[None, None, :]] += 1
        assert (seen == 1).all()
        out.append(c)
        first += tiles * splits
        if splits > 1:
            ws_end += tiles * splits * bm * bm
            cnt_end += tiles
    assert cfg.sum_first == first and cfg.ws_elems == ws_end and cfg.counters == cnt_end
    return out


@pytest.mark.parametrize("op, dims", [("matmul", (1, 1, 1)), ("matmul", (3, 17, 5)),
                                      ("matmul", (64, 64, 64)), ("matmul", (129, 33, 1000)),
                                      ("matmul", (17, 1000, 2048)), ("linear", (1000, 17, 3)),
                                      ("linear", (32, 1024, 1024)), ("linear", (7, 300, 65))])
def test_grouped_products_compute_the_gradients(op, dims):
    """matmul_products / linear_products read the operands in place (strides, no
    transposed copy) and, in choose's layout, give the reference gradients."""
    rng = np.random.default_rng(seed("grouped", op, dims))
    if op == "matmul":
        M, N, K = dims
        g, a, b = (rng.standard_normal(s) for s in ((M, N), (M, K), (K, N)))
        products = grouped.matmul_products(M, N, K)
        flats = ((g.ravel(), b.ravel()), (a.ravel(), g.ravel()))
        refs = mb.reference("matmul_backward", g, a, b)
        sums = (0, 0)
    else:
        rows, in_f, out_f = dims
        g, x, w = (rng.standard_normal(s) for s in ((rows, out_f), (rows, in_f), (out_f, in_f)))
        products = grouped.linear_products(rows, in_f, out_f)
        flats = ((g.ravel(), w.ravel()), (g.ravel(), x.ravel()))
        refs = mb.reference("linear_backward", g, x, w)[:2]
        sums = (rows, out_f)
    cfg = grouped.choose(products, *sums, 132)
    assert cfg is not None
    assert cfg.blocks == cfg.sum_first + -(-sums[1] // 32)
    for got, ref in zip(_emulate_grouped(products, cfg, flats), refs):
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_grouped_choose_declines_what_one_launch_does_not_pay():
    """Empty products, long K (over MAX_ITERS * MAX_SPLITS k tiles), too many
    multiply-adds or rows to sum: None (the separate launches run). The tile is the largest
    whose grid fills the SMs."""
    lp = grouped.linear_products
    assert grouped.choose(grouped.matmul_products(0, 5, 3), 0, 0, 132) is None
    assert grouped.choose(grouped.matmul_products(2049 + grouped.BK, 5, 4), 0, 0, 132) is None
    assert grouped.choose(lp(64, 2048, 2048), 64, 2048, 132) is None        # 2^28 MACs
    assert grouped.choose(lp(grouped.MAX_SUM_ROWS + 1, 8, 8), grouped.MAX_SUM_ROWS + 1, 8,
                          132) is None
    assert grouped.choose(lp(grouped.MAX_SUM_ROWS, 8, 8), grouped.MAX_SUM_ROWS, 8,
                          132) is not None
    big = grouped.choose(lp(32, 1024, 1024), 32, 1024, 132)
    assert big.bm == 32 and big.jobs[0][0] == 8 and big.jobs[1][0] == 1   # grad_x splits K
    assert grouped.choose(grouped.matmul_products(64, 64, 64), 0, 0, 132).bm == 16


@pytest.mark.parametrize("fam", ["fp32", "fp64", "fp16", "bf16"])
def test_grouped_launch_is_the_gradients_one_launch(fam):
    """Small linear_backward, fused_linear_gelu_backward's GEMMs and matmul_backward: one
    launch of the grouped kernel with the operands in place and choose's integers; TF32
    and large or batched products keep their separate launches."""
    dtype, prec = FAMILIES[fam]
    m = RecordingMath()
    e = m.backend.empty
    g, x, w = e((1000, 40), dtype), e((1000, 24), dtype), e((40, 24), dtype)
    gx, gw, gb = mbl.linear_backward(m, g, x, w)
    grp = [ln for ln in m.backend.launches if ln[0] != "memset"]
    assert len(grp) == 1
    k, grid, _, v = grp[0]
    assert k.template == grouped.TEMPLATE and k.params["colsum"] is True
    cfg = grouped.choose(grouped.linear_products(1000, 24, 40), 1000, 40, 132)
    assert grid == (cfg.blocks, 1, 1) and cfg.counters > 0
    assert v[:8] == [g.ptr, w.ptr, gx.ptr, g.ptr, x.ptr, gw.ptr, g.ptr, gb.ptr]
    assert v[8] != 0 and v[9] != 0     # the split-K workspace and the ticket counters
    splits, kchunk, tiles_n = cfg.jobs[0][:3]
    assert v[10:20] == [1000, 24, 40, 40, 1, 24, 1, tiles_n, splits, kchunk]
    assert v[-3:] == [1000, 40, cfg.sum_first]
    m.backend.launches.clear()
    ga, gb2 = mb.matmul_backward(m, e((3, 5), dtype), e((3, 7), dtype), e((7, 5), dtype))
    (k, _, _, v), = m.backend.launches
    assert k.template == grouped.TEMPLATE and k.params["colsum"] is False
    assert v[8:10] == [0, 0] and ga.shape == (3, 7) and gb2.shape == (7, 5)
    assert not grouped.use_for(m, DT.FLOAT32, "tf32") and grouped.use_for(m, dtype, prec)
    for call in (lambda: mbl.linear_backward(m, e((64, 2048), dtype), e((64, 2048), dtype),
                                             e((2048, 2048), dtype), has_bias=False),
                 lambda: mb.matmul_backward(m, e((2, 3, 5), dtype), e((2, 3, 7), dtype),
                                            e((2, 7, 5), dtype))):
        m.backend.launches.clear()
        call()
        assert all(ln[0] == "memset" or ln[0].template != grouped.TEMPLATE
                   for ln in m.backend.launches)


@gpu
@pytest.mark.parametrize("fam", ["fp32", "fp64", "fp16", "bf16", "ieee"])
def test_gpu_grouped_gradients(apis, fam, monkeypatch):
    """The grouped kernel on the GPU at every tile (grouped.TILES), with and without K splits,
    odd sizes, through the general path and then the plan (the same bits), against float64
    with the module's bounds. (The larger shapes run grouped in float32 and float64 only.)"""
    m, ml = apis
    dtype, prec = FAMILIES.get(fam, (DT.FLOAT32, "ieee"))
    launches = []
    real = grouped.Grouped.launch
    monkeypatch.setattr(grouped.Grouped, "launch",
                        lambda self, m_, ptrs: launches.append(self.cfg.bm) or real(self, m_, ptrs))
    rng = np.random.default_rng(seed("gpu grouped", fam))
    for x_shape, out_f in (((3, 17), 5), ((1000, 17), 3), ((2, 33, 70), 129), ((3, 352), 352),
                           ((2, 768), 768), ((32, 1000), 1000), ((130, 257), 300)):
        for op in ("linear", "fused"):
            (tg, tx, tw, tb), (g, x, w, b) = layer_inputs(m, rng, dtype, x_shape, out_f,
                                                           bias=op == "fused")
            call = (lambda: ml.fused_linear_gelu_backward(tg, tx, tw, tb, precision=prec)) \
                if op == "fused" else (lambda: ml.linear_backward(tg, tx, tw, precision=prec))
            refs, bounds = layer_bounds(g, x, w, b, dtype, prec, op == "fused")
            first = call()
            key = mbl.layer_plan_key(f"{op}_backward" if op == "linear" else
                                     "fused_linear_gelu_backward", tg, tx, tw,
                                     True if op == "linear" else tb, prec)
            again = call_through_plan(m, key, call)
            for r0, r1, ref, bound in zip(first, again, refs, bounds):
                check(stored(m, r0), ref, bound, f"{op} {fam} {x_shape} {out_f}")
                np.testing.assert_array_equal(stored(m, r0), stored(m, r1))
    for a_shape, b_shape in (((3, 17), (17, 5)), ((64, 64), (64, 64)), ((129, 1000), (1000, 33)),
                             ((1000, 130), (130, 70))):
        (tg, ta, tb), (g, a, b) = matmul_inputs(m, rng, dtype, a_shape, b_shape)
        (ra, rb), (ba, bb) = matmul_bounds(g, a, b, dtype, prec)
        first = ml.matmul_backward(tg, ta, tb, precision=prec)
        again = call_through_plan(m, mb.matmul_plan_key(tg, ta, tb, prec),
                                  lambda: ml.matmul_backward(tg, ta, tb, precision=prec))
        for r0, r1, ref, bound in zip(first, again, (ra, rb), (ba, bb)):
            check(stored(m, r0), ref, bound, f"matmul {fam} {a_shape} {b_shape}")
            np.testing.assert_array_equal(stored(m, r0), stored(m, r1))
    assert set(launches) == set(grouped.TILES), launches
