"""flash_attention_backward (cuda_backend/ops/attention_backward.py) and the forward's lse
(ops/attention.py, return_lse=True).

The float64 reference `ab.reference` (softmax attention's gradient from the forward's out and
lse) is checked here against central finite differences of the forward (float64, tiny shapes)
and against PyTorch's float64 autograd when torch is importable. The op (kernels on a GPU,
NumPy in fallback mode) is checked against that reference evaluated on the same out and lse
it is given, elementwise, within bounds derived from the arithmetic (`grad_bounds`): with u_a
= 2^-24 the float32 unit roundoff, u_r the rounding of P and dS before their products (2^-8
bfloat16, 2^-11 float16 on tensor cores; 0 on the CUDA-core path, which keeps them float32),
u_o the output's rounding, c = 2 where sums run in tensor-core accumulators (they truncate)
and 1 for round-to-nearest FMA chains, u_p the relative error of one product (3xTF32 for
float32 on tensor cores: the operands' split drops ~3 * 2^-22, taken as 2^-20 as the forward's
lse bound does; 0 elsewhere), added to c n u_a in every sum of n products:
  exponent x = scale log2(e) q.k - lse log2(e): |dx| <= log2(e) (|scale| (c D u_a |q||k| +
    u_a |q.k|) + 2 u_a |lse|) + u_a |x|, so P's relative error e_P <= ln2 |dx| + U_EX2
    (ex2.approx.ftz.f32, 2^-22.5 documented, taken as 2^-21), then (e_P + u_r)(1 + u_r);
  dV = P^T dO: sum e_P P |dO| + c Sq u_a P^T |dO| + u_o |dV|;
  dS = P (dP - delta), dP by c D u_a |dO||v|, delta by D u_a sum |dO o|: e_dS = e_P |dP - delta|
    + P e_(dP - delta) + u_a P |dP - delta|, then rounded (u_r);
  dK = scale dS^T Q, dQ = scale dS K: the dS errors through |Q| (|K|), c Sq u_a (c Skv u_a) for
    the sums, u_a + u_o for the scaling and the store;
  float16 rounds values below 2^-14 to its subnormals: an absolute 2^-25 on P, dS and the
  outputs.
First-order terms, times 1.05 for the second-order ones (products of two relative errors,
each < 2^-7). A float32 NumPy model of the tensor-core path (P and dS rounded, float32 sums)
reaches 0.72 of these bounds for bfloat16 and 0.6 for float16 at the shapes below. Tests marked `gpu` run the kernels (every config, odd lengths, seq_q != seq_kv,
head dims off the tile grid, misaligned views, the per-call plan); the rest run in whatever
mode the backend is in.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from helpers import call_through_plan, host_dtype, make, tuned_math
from test_host_path import BACKEND, STUBS, run_script, script

from cuda_backend import (CudaDataType as DT, DTypeMismatchError, InvalidArgumentError,
                          ShapeMismatchError, TensorFreedError)
from cuda_backend.cuda_ml import CudaML
from cuda_backend.kernels import dtype_params
from cuda_backend.ops import attention as fa
from cuda_backend.ops import attention_backward as ab
from cuda_backend.tensor import CudaTensor

gpu = pytest.mark.gpu
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = [DT.FLOAT32, DT.FLOAT16, DT.BFLOAT16]
LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453
U_A = 2.0**-24                 # float32
U_EX2 = 2.0**-21               # ex2.approx.ftz.f32 (PTX: 2^-22.5 relative), with margin
U16 = {DT.FLOAT16: 2.0**-11, DT.BFLOAT16: 2.0**-8}
EPS64 = 2.0**-53
SECOND_ORDER = 1.05
U_TF32 = 2.0**-20              # one 3xTF32 product (float32 on tensor cores)

# (batch, heads, seq_q, seq_kv, head_dim): odd lengths, seq_q != seq_kv, head dims off the grid
SHAPES = [
    (1, 1, 1, 1, 64),
    (2, 3, 17, 17, 64),
    (1, 2, 100, 100, 128),
    (1, 2, 129, 129, 32),
    (2, 1, 300, 300, 80),
    (1, 2, 65, 130, 64),       # more keys than queries
    (1, 1, 130, 70, 128),      # more queries than keys
    (1, 1, 45, 47, 37),        # odd head_dim: element loads, element stores
    (1, 2, 100, 17, 100),
    (1, 1, 70, 66, 256),       # the largest head_dim (CUDA cores for every dtype)
    (1, 1, 33, 129, 200),
]
SHAPE_IDS = ["x".join(str(v) for v in s) for s in SHAPES]


# -- references and bounds -----------------------------------------------------------------
def attention64(q, k, v, scale, causal):
    """Plain float64 softmax(scale q kᵀ, masked j > i) v and its lse, full score matrices."""
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if causal:
        s = np.where(np.triu(np.ones(s.shape[-2:], bool), 1), -np.inf, s)
    mx = s.max(axis=-1, keepdims=True)
    p = np.exp(s - mx)
    total = p.sum(axis=-1, keepdims=True)
    return np.matmul(p / total, v), (mx + np.log(total))[..., 0]


def path_of(dtype, d):
    """The kernel path a call takes: tensor cores up to head_dim 128 (3xTF32 for float32)."""
    if ab.padded_head_dim(d) > 128:
        return "simt"
    return "tf32" if dtype is DT.FLOAT32 else "mma"


def arith(dtype, path):
    """(u_r, u_o, tiny, c): P / dS rounding, output rounding, absolute floor, sum factor."""
    u_r = U16[dtype] if path == "mma" else 0.0
    u_o = U16.get(dtype, U_A)
    tiny = (2.0**-25 if dtype is DT.FLOAT16 else 0.0) + 2.0**-126
    return u_r, u_o, tiny, (1.0 if path == "simt" else 2.0)


def grad_bounds(g, q, k, v, out, lse, scale, causal, u_r, u_o, tiny, c, u_a=U_A, u_ex=U_EX2,
                u_p=0.0):
    """Elementwise bounds on |ours - reference(given out, lse)| for (dq, dk, dv): the error
    terms of the module docstring, from float64 magnitudes of the same operands."""
    g, q, k, v, out, lse = (np.asarray(a, np.float64) for a in (g, q, k, v, out, lse))
    Sq, D = q.shape[2], q.shape[3]
    Skv = k.shape[2]
    kt = np.swapaxes(k, -1, -2)
    s = np.matmul(q, kt)
    qk = np.matmul(np.abs(q), np.abs(kt))
    mask = np.zeros((Sq, Skv), bool)
    if causal:
        mask = np.triu(np.ones((Sq, Skv), bool), 1)
    L = lse[..., None]
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.where(mask, 0.0, np.exp(scale * s - L))
    x_abs = np.abs(scale * s) * LOG2E + np.abs(L) * LOG2E
    dx = LOG2E * (abs(scale) * ((c * D * u_a + u_p) * qk + u_a * np.abs(s)) + 2 * u_a * np.abs(L)) \
        + u_a * x_abs
    e_p = LN2 * dx + u_ex
    ep = np.where(mask, 0.0, p * (e_p + u_r) * (1 + u_r) * (1 + e_p) + tiny)
    vt = np.swapaxes(v, -1, -2)
    dp = np.matmul(g, vt)
    gv = np.matmul(np.abs(g), np.abs(vt))
    delta = np.sum(g * out, axis=-1, keepdims=True)
    e_delta = D * u_a * np.sum(np.abs(g * out), axis=-1, keepdims=True)
    t = dp - delta
    e_t = (c * D * u_a + u_p) * gv + e_delta + u_a * (np.abs(dp) + np.abs(delta))
    ds = p * t
    e_ds = ep * np.abs(t) + p * e_t * (1 + u_a) + u_a * p * np.abs(t)
    e_ds = np.where(mask, 0.0, e_ds * (1 + u_r) + u_r * np.abs(ds) + tiny)
    pt, ept, dst, edst = (np.swapaxes(a, -1, -2) for a in (p, ep, ds, e_ds))
    a = abs(scale)
    dv = np.matmul(pt, g)
    bv = np.matmul(ept, np.abs(g)) + (c * Sq * u_a + u_p) * np.matmul(pt, np.abs(g)) \
        + u_o * np.abs(dv) + tiny
    dk = scale * np.matmul(dst, q)
    bk = a * (np.matmul(edst, np.abs(q))
              + (c * Sq * u_a + u_p) * np.matmul(np.abs(dst), np.abs(q))) \
        + (u_a + u_o) * np.abs(dk) + tiny
    dq = scale * np.matmul(ds, k)
    bq = a * (np.matmul(e_ds, np.abs(k))
              + (c * Skv * u_a + u_p) * np.matmul(np.abs(ds), np.abs(k))) \
        + (u_a + u_o) * np.abs(dq) + tiny
    return tuple(SECOND_ORDER * b for b in (bq, bk, bv))


def lse_bound(q, k, scale, causal, exact_lse, prod):
    """|lse ours - exact| for the forward's (m + log2 l) ln 2: each exponent's error weighted
    by its softmax probability, the sum l's rounding (Skv u_a and one ex2 per tile, taken per
    key), the final ops; prod: the relative error of one product of q.k (0 for 16-bit inputs,
    2^-20 for float32's 3xTF32 split)."""
    Skv, D = k.shape[2], q.shape[3]
    s = np.matmul(q, np.swapaxes(k, -1, -2))
    qk = np.matmul(np.abs(q), np.abs(np.swapaxes(k, -1, -2)))
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.exp(scale * s - exact_lse[..., None])
    if causal:
        p = np.where(np.triu(np.ones(p.shape[-2:], bool), 1), 0.0, p)
    dx = LN2 * (LOG2E * abs(scale) * ((2 * D * U_A + prod) * qk + U_A * np.abs(s))
                + U_A * LOG2E * np.abs(scale * s))
    return SECOND_ORDER * (np.sum(p * dx, axis=-1) + Skv * (U_A + U_EX2)
                           + 4 * U_A * (np.abs(exact_lse) + math.log(max(Skv, 1)) + 1))


def check(got, ref, bound, what):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert np.isfinite(got).all(), f"{what}: non-finite values (unwritten or NaN elements)"
    err = np.abs(got - ref)
    bad = ~(err <= bound)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err / np.maximum(bound, 1e-300), 0)),
                             err.shape)
        raise AssertionError(f"{what}: {int(bad.sum())} elements past the bound; worst at {i}: "
                             f"got {got[i]!r}, reference {ref[i]!r}, bound {bound[i]:.3g}")


# -- tensors ---------------------------------------------------------------------------------
def poison(m, t):
    """Fill t with NaN (every float dtype: 0xFF bytes are NaN)."""
    if t.size:
        host = np.full(t.nbytes, 0xFF, np.uint8)
        m.backend.copy_to_device(host.view(host_dtype(t.dtype) if t.dtype is not DT.BFLOAT16
                                           else np.uint16).reshape(t.shape), t)


def problem(m, ml, rng, shape, dtype, causal, scale=None):
    """Inputs on the device and their stored values, the forward's out and lse (ours)."""
    B, H, Sq, Skv, D = shape
    (q, qh), (k, kh), (v, vh), (g, gh) = (
        make(m, rng.standard_normal(s), dtype)
        for s in ((B, H, Sq, D), (B, H, Skv, D), (B, H, Skv, D), (B, H, Sq, D)))
    out, lse = ml.flash_attention(q, k, v, scale=scale, causal=causal, return_lse=True)
    oh, lh = m.to_numpy(out).astype(np.float64), m.to_numpy(lse).astype(np.float64)
    return (g, q, k, v, out, lse), (gh, qh, kh, vh, oh, lh)


def check_grads(grads, host, shape, dtype, causal, scale, what, path=None):
    gh, qh, kh, vh, oh, lh = host
    sc = 1.0 / math.sqrt(shape[4]) if scale is None else scale
    ref = ab.reference(gh, qh, kh, vh, sc, causal, oh, lh)
    path = path or path_of(dtype, shape[4])
    bounds = grad_bounds(gh, qh, kh, vh, oh, lh, sc, causal, *arith(dtype, path),
                         u_p=U_TF32 if path == "tf32" else 0.0)
    for name, got, r, b in zip(("dq", "dk", "dv"), grads, ref, bounds):
        check(got, r, b, f"{what} {name}")


@pytest.fixture(scope="module")
def m(backend, tmp_path_factory):
    """A CudaMath whose autotuner writes to a temporary file; kernels compiled up front."""
    cm = tuned_math(backend, tmp_path_factory)
    if cm.gpu:
        fa.warm_up(cm, workers=16)
        ab.warm_up(cm, workers=16)
    return cm


@pytest.fixture(scope="module")
def ml(m):
    return CudaML(m)


# -- the reference ---------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 2, 4, 5, 3), (2, 1, 6, 3, 4), (1, 1, 1, 7, 2)],
                         ids=lambda s: "x".join(map(str, s)))
def test_reference_matches_finite_differences(shape, causal):
    """d/dx sum(G * attention(q, k, v)) by central differences of the float64 forward, for
    every element of q, k and v. Error of a central difference with step h: h^2 / 6 |f'''|
    (f''' estimated from a 4-point difference at step 1e-2, times 2 for its variation over
    the interval, plus 1e-12 where that estimate cancels to ~0) and the rounding of the two
    forward evaluations, each within n eps64 sum|G * o| (n = seq_kv + D + seq_q D + 10
    operations deep), divided by 2 h."""
    B, H, Sq, Skv, D = shape
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal(s) for s in ((B, H, Sq, D), (B, H, Skv, D), (B, H, Skv, D)))
    G = rng.standard_normal((B, H, Sq, D))
    scale = 0.7
    grads = ab.reference(G, q, k, v, scale, causal)
    h, h3 = 2.0**-17, 1e-2
    depth = Skv + D + Sq * D + 10

    def f(arrs):
        return float(np.sum(G * attention64(*arrs, scale, causal)[0]))

    for which in range(3):
        for idx in np.ndindex(*(q, k, v)[which].shape):
            def at(delta):
                arrs = [q.copy(), k.copy(), v.copy()]
                arrs[which][idx] += delta
                return f(arrs)
            fd = (at(h) - at(-h)) / (2 * h)
            f3 = (at(2 * h3) - 2 * at(h3) + 2 * at(-h3) - at(-2 * h3)) / (2 * h3**3)
            mag = float(np.sum(np.abs(G * attention64(q, k, v, scale, causal)[0]))) + 1.0
            bound = 2 * h * h / 6 * abs(f3) + depth * EPS64 * mag / h + 1e-12
            assert abs(fd - grads[which][idx]) <= bound, (which, idx, fd, grads[which][idx],
                                                          bound)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 3, 17, 17, 8), (1, 2, 9, 23, 5), (1, 1, 30, 12, 16),
                                   (1, 1, 1, 1, 3)], ids=lambda s: "x".join(map(str, s)))
def test_reference_matches_torch_autograd(shape, causal):
    """PyTorch's float64 autograd of scaled_dot_product_attention (top-left causal mask, as
    ours) against the reference with the exact out and lse; both float64, so the bound is
    grad_bounds' with every unit roundoff eps64 (no rounding of P, dS)."""
    torch = pytest.importorskip("torch")
    B, H, Sq, Skv, D = shape
    rng = np.random.default_rng(5)
    arrs = [rng.standard_normal(s) for s in ((B, H, Sq, D), (B, H, Skv, D), (B, H, Skv, D))]
    G = rng.standard_normal((B, H, Sq, D))
    scale = 1 / math.sqrt(D)
    ts = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in arrs]
    if causal:   # an explicit top-left mask: is_causal's alignment with seq_q != seq_kv varies
        mask = torch.tensor(~np.triu(np.ones((Sq, Skv), bool), 1))
        y = torch.nn.functional.scaled_dot_product_attention(*ts, attn_mask=mask, scale=scale)
    else:
        y = torch.nn.functional.scaled_dot_product_attention(*ts, scale=scale)
    want = torch.autograd.grad(y, ts, torch.tensor(G))
    out, lse = attention64(*arrs, scale, causal)
    ours = ab.reference(G, *arrs, scale, causal)
    bounds = grad_bounds(G, *arrs, out, lse, scale, causal, 0.0, EPS64, 1e-300, 1.0,
                         u_a=EPS64, u_ex=EPS64)
    for name, a, w, b in zip(("dq", "dk", "dv"), ours, want, bounds):
        # two float64 evaluations: each within the bound of the exact value
        check(a, w.numpy(), 2 * b, f"torch {name}")


def test_reference_given_out_and_lse_is_the_exact_one():
    """ab.reference with the exact out and lse passed equals its default; chunking changes
    nothing; no keys or no queries give zeros."""
    rng = np.random.default_rng(3)
    q, k, v, G = (rng.standard_normal(s) for s in ((1, 2, 37, 8), (1, 2, 29, 8), (1, 2, 29, 8),
                                                    (1, 2, 37, 8)))
    for causal in (False, True):
        out, lse = attention64(q, k, v, 0.4, causal)
        a = ab.reference(G, q, k, v, 0.4, causal)
        b = ab.reference(G, q, k, v, 0.4, causal, out, lse, chunk=5)
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)
    for dq, dk, dv in (ab.reference(G, q, k[:, :, :0], v[:, :, :0], 1.0, False),
                       ab.reference(G[:, :, :0], q[:, :, :0], k, v, 1.0, True)):
        assert not dq.any() and not dk.any() and not dv.any()


def test_forward_reference_lse():
    """attention.reference(return_lse=True): the log-sum-exp of the scaled scores; -inf for
    no keys."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal(s) for s in ((2, 1, 13, 6), (2, 1, 9, 6), (2, 1, 9, 6)))
    for causal in (False, True):
        out, lse = fa.reference(q, k, v, 0.9, causal, chunk=4, return_lse=True)
        o2, l2 = attention64(q, k, v, 0.9, causal)
        np.testing.assert_allclose(out, o2, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, l2, rtol=1e-12, atol=1e-12)
    _, lse = fa.reference(q, k[:, :, :0], v[:, :, :0], 1.0, False, return_lse=True)
    assert lse.shape == (2, 1, 13) and np.all(lse == -np.inf)


# -- the op, in whatever mode the backend is in -------------------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name_str)
def test_small_in_this_process(ml, dtype, causal):
    """Fallback mode here (NumPy); on a GPU machine the same calls run the kernels."""
    m = ml.math
    rng = np.random.default_rng(21)
    for shape in ((1, 2, 9, 13, 8), (2, 1, 20, 20, 16)):
        tensors, host = problem(m, ml, rng, shape, dtype, causal, scale=0.5)
        grads = ml.flash_attention_backward(*tensors, scale=0.5, causal=causal)
        assert [t.shape for t in grads] == [shape[:3] + shape[4:], tensors[2].shape,
                                            tensors[3].shape]
        assert all(t.dtype is dtype for t in grads)
        check_grads([m.to_numpy(t) for t in grads], host, shape, dtype, causal, 0.5,
                    f"{shape} {dtype.name_str}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name_str)
def test_forward_lse(ml, dtype):
    """flash_attention(..., return_lse=True): the output as without it, and the lse within
    lse_bound of the exact log-sum-exp of the stored inputs."""
    m = ml.math
    rng = np.random.default_rng(2)
    for shape, causal in (((2, 2, 45, 70, 64), False), ((1, 2, 130, 70, 128), True),
                          ((1, 1, 33, 33, 37), True)):
        B, H, Sq, Skv, D = shape
        (q, qh), (k, kh), (v, vh) = (make(m, rng.standard_normal(s), dtype)
                                     for s in ((B, H, Sq, D), (B, H, Skv, D), (B, H, Skv, D)))
        out, lse = ml.flash_attention(q, k, v, causal=causal, return_lse=True)
        assert lse.shape == (B, H, Sq) and lse.dtype is DT.FLOAT32
        plain = ml.flash_attention(q, k, v, causal=causal)
        np.testing.assert_array_equal(m.to_numpy(out), m.to_numpy(plain))
        sc = 1 / math.sqrt(D)
        exact = attention64(qh, kh, vh, sc, causal)[1]
        bound = lse_bound(qh, kh, sc, causal, exact, 2.0**-20 if dtype is DT.FLOAT32 else 0.0)
        check(m.to_numpy(lse), exact, bound, f"lse {shape} {dtype.name_str}")


def test_no_keys_and_no_queries(ml):
    """seq_kv == 0: out 0, lse -inf, grad_q 0; seq_q == 0: grad_k = grad_v = 0."""
    m = ml.math
    rng = np.random.default_rng(1)
    for dtype in (DT.FLOAT16, DT.FLOAT32):
        q, _ = make(m, rng.standard_normal((2, 3, 4, 64)), dtype)
        e, _ = make(m, np.zeros((2, 3, 0, 64)), dtype)
        out, lse = ml.flash_attention(q, e, e, return_lse=True)
        assert not m.to_numpy(out).any() and np.all(m.to_numpy(lse) == -np.inf)
        dq, dk, dv = ml.flash_attention_backward(q, q, e, e, out, lse)
        assert dq.shape == q.shape and not m.to_numpy(dq).any()
        assert dk.shape == dv.shape == e.shape
        qe, _ = make(m, np.zeros((2, 3, 0, 64)), dtype)
        k, _ = make(m, rng.standard_normal((2, 3, 5, 64)), dtype)
        out, lse = ml.flash_attention(qe, k, k, return_lse=True)
        assert out.shape == qe.shape and lse.shape == (2, 3, 0)
        dq, dk, dv = ml.flash_attention_backward(qe, qe, k, k, out, lse, causal=True)
        assert dq.shape == qe.shape
        assert not m.to_numpy(dk).any() and not m.to_numpy(dv).any()


def test_errors_name_the_problem_and_leak_nothing(ml):
    m = ml.math

    def t(shape, dtype=np.float32):
        return m.from_numpy(np.ones(shape, dtype))

    q, k = t((2, 4, 16, 64)), t((2, 4, 20, 64))
    lse = t((2, 4, 16))
    freed = t((2, 4, 16, 64))
    freed.free()
    pool = m.backend.memory_pools[q.device_id]
    before = pool.get_stats()["active_memory"]
    bw = ml.flash_attention_backward
    bad_calls = [
        (ShapeMismatchError, r"grad_out has shape \(2, 4, 16, 32\), expected q's shape",
         lambda: bw(t((2, 4, 16, 32)), q, k, k, q, lse)),
        (ShapeMismatchError, r"out has shape \(2, 4, 15, 64\)",
         lambda: bw(q, q, k, k, t((2, 4, 15, 64)), lse)),
        (ShapeMismatchError, r"lse has shape \(2, 4, 17\), expected \(batch, heads, seq_q\)",
         lambda: bw(q, q, k, k, q, t((2, 4, 17)))),
        (DTypeMismatchError, r"lse has dtype float16, expected float32",
         lambda: bw(q, q, k, k, q, t((2, 4, 16), np.float16))),
        (TensorFreedError, r"freed", lambda: bw(q, freed, k, k, q, lse)),
        (TensorFreedError, r"freed", lambda: bw(freed, q, k, k, q, lse)),
        (ShapeMismatchError, r"k and v must have the same shape",
         lambda: bw(q, q, k, t((2, 4, 21, 64)), q, lse)),
        (ShapeMismatchError, r"\(batch, heads\)", lambda: bw(q, q, t((2, 3, 20, 64)),
                                                             t((2, 3, 20, 64)), q, lse)),
        (ShapeMismatchError, r"head_dim", lambda: bw(q, q, t((2, 4, 20, 32)),
                                                     t((2, 4, 20, 32)), q, lse)),
        (DTypeMismatchError, r"float32 and float16",
         lambda: bw(t((2, 4, 16, 64), np.float16), q, k, k, q, lse)),
        (DTypeMismatchError, r"flash_attention_backward does not support float64",
         lambda: bw(*(t((1, 1, 4, 8), np.float64),) * 5, t((1, 1, 4)))),
        (InvalidArgumentError, r"4-D .* got q of shape \(4, 16, 64\)",
         lambda: bw(q, t((4, 16, 64)), k, k, q, lse)),
        (InvalidArgumentError, r"head_dim up to 256, got head_dim 300",
         lambda: bw(*(t((1, 1, 4, 300)),) * 5, t((1, 1, 4)))),
        (InvalidArgumentError, r"causal must be a bool", lambda: bw(q, q, k, k, q, lse,
                                                                    causal="yes")),
        (InvalidArgumentError, r"scale must be finite", lambda: bw(q, q, k, k, q, lse,
                                                                   scale=math.inf)),
        (InvalidArgumentError, r"CudaTensor", lambda: bw(np.ones((2, 4, 16, 64)), q, k, k, q,
                                                         lse)),
        (InvalidArgumentError, r"return_lse must be a bool",
         lambda: ml.flash_attention(q, k, k, return_lse="yes")),
    ]
    for err, pattern, call in bad_calls:
        with pytest.raises(err, match=pattern):
            call()
    assert pool.get_stats()["active_memory"] == before, "an error path leaked a pool block"
    # the pool is still usable
    out, lse2 = ml.flash_attention(q, k, k, return_lse=True)
    assert all(x.shape == y.shape for x, y in zip(bw(q, q, k, k, out, lse2), (q, k, k)))


def test_configs_and_variants():
    variants = ab.template_variants()
    main = variants[ab.TEMPLATE]
    for dt in DTYPES:
        for hd in (64, 128, 256):
            cfgs = ab.configs(dt, hd)
            assert cfgs and all(c["hd"] == hd for c in cfgs)
            assert all(c["path"] == ("simt" if hd > 128 else
                                     "tf32" if dt is DT.FLOAT32 else "mma") for c in cfgs)
            for c in cfgs:
                assert {**dtype_params(dt), **c} in main
                assert ab.shared_bytes(c) <= 227 * 1024
                if c["path"] != "simt":   # blocks per SM of the hint fit the SM's shared memory
                    assert c["min_blocks"] * (ab.shared_bytes(c) + 1024) <= 228 * 1024
                    assert c["bm"] % 32 == 0 and ab.SQ_PAD % c["bm"] == 0
                else:
                    assert ab.SQ_PAD % c["bm"] == 0 and c["bm"] % c["nw"] == 0
    assert len(variants[ab.PREP_TEMPLATE]) == 2 * len(DTYPES)


FALLBACK_SCRIPT = textwrap.dedent(r'''
    import sys
    import numpy as np
    from cuda_backend.cuda_ml import get_cuda_ml
    from cuda_backend import CudaDataType as DT
    ml = get_cuda_ml()
    assert not ml.math.gpu, "expected fallback mode"
    data = np.load(sys.argv[1])
    res = {}
    for causal in (False, True):
        q, k, v, g = (ml.math.from_numpy(data[n]) for n in ("q", "k", "v", "g"))
        out, lse = ml.flash_attention(q, k, v, causal=causal, return_lse=True)
        grads = ml.flash_attention_backward(g, q, k, v, out, lse, causal=causal)
        res[f"lse_{causal}"] = ml.math.to_numpy(lse)
        for name, t in zip(("dq", "dk", "dv"), grads):
            res[f"{name}_{causal}"] = ml.math.to_numpy(t)
    np.savez(sys.argv[2], **res)
''')


def test_fallback_mode_subprocess(tmp_path):
    """CUDA_BACKEND_FALLBACK=1: the NumPy path (float32) against the float64 reference with
    the exact out and lse: out and lse rounded to float32 once (u_o = u_a, no P/dS
    rounding), the rest float64."""
    rng = np.random.default_rng(4)
    arrs = {n: rng.standard_normal(s).astype(np.float32) for n, s in (
        ("q", (2, 2, 19, 24)), ("k", (2, 2, 23, 24)), ("v", (2, 2, 23, 24)),
        ("g", (2, 2, 19, 24)))}
    np.savez(tmp_path / "in.npz", **arrs)
    env = dict(os.environ, CUDA_BACKEND_FALLBACK="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT, str(tmp_path / "in.npz"),
                           str(tmp_path / "out.npz")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = np.load(tmp_path / "out.npz")
    q, k, v, g = (arrs[n].astype(np.float64) for n in ("q", "k", "v", "g"))
    sc = 1 / math.sqrt(24)
    for causal in (False, True):
        out, lse = attention64(q, k, v, sc, causal)
        assert np.all(np.abs(res[f"lse_{causal}"] - lse) <= U_A * (np.abs(lse) + 1))
        # out and lse as float32: the reference on those is the fallback's arithmetic
        o32, l32 = out.astype(np.float32).astype(np.float64), lse.astype(np.float32)
        ref = ab.reference(g, q, k, v, sc, causal, o32, l32.astype(np.float64))
        bounds = grad_bounds(g, q, k, v, o32, l32, sc, causal, 0.0, U_A, 1e-300, 1.0,
                             u_a=EPS64, u_ex=EPS64)
        for i, name in enumerate(("dq", "dk", "dv")):
            check(res[f"{name}_{causal}"], ref[i], bounds[i], f"fallback {name}")


# -- GPU ---------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name_str)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_grads_shapes(m, ml, shape, dtype, causal):
    tensors, host = problem(m, ml, np.random.default_rng(9669), shape, dtype, causal)
    grads = ab.flash_attention_backward(m, *tensors, None, causal)
    check_grads([m.to_numpy(t) for t in grads], host, shape, dtype, causal, None,
                f"{shape} {dtype.name_str} causal={causal}")


def _configs():
    out = []
    for dt in DTYPES:
        for hd in (64, 128, 256):
            out += [(dt, c) for c in ab.configs(dt, hd)]
    return out


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, cfg", _configs(),
                         ids=[f"{d.name_str}-{'-'.join(str(v) for v in c.values())}"
                              for d, c in _configs()])
def test_every_config(m, ml, dtype, cfg, causal):
    """Each config through run_config into NaN-poisoned gradients, on a head_dim it serves
    (the largest and one 24 below: padded columns, element loads), lengths off the tiles
    (3 query tiles + 5 rows, 2 key blocks + 7 keys, and more queries than keys)."""
    rng = np.random.default_rng(5864)
    hd, bn = cfg["hd"], ab.block_keys(cfg)
    for d in (hd, hd - 24):
        for sq, skv in ((3 * cfg["bm"] + 5, 2 * bn + 7), (2 * bn + 3, bn - 9)):
            shape = (2, 2, sq, skv, d)
            tensors, host = problem(m, ml, rng, shape, dtype, causal)
            grads = [m.backend.empty(t.shape, dtype, t.device_id)
                     for t in (tensors[1], tensors[2], tensors[3])]
            for t in grads:
                poison(m, t)
            ab.run_config(m, cfg, *tensors, grads, 1 / math.sqrt(d), causal)
            check_grads([m.to_numpy(t) for t in grads], host, shape, dtype, causal, None,
                        f"{cfg} {shape} {dtype.name_str} causal={causal}", cfg["path"])


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name_str)
def test_scales_misaligned_views_and_plan(ml, dtype):
    """Other scales (negative, zero); operands one element past an aligned pointer (the
    element loads and stores); the second call of a shape through the per-call plan."""
    m = ml.math
    rng = np.random.default_rng(7340)
    for scale in (0.05, -0.3, 0.0, 1.0):
        shape = (1, 2, 40, 50, 64)
        tensors, host = problem(m, ml, rng, shape, dtype, False, scale=scale)
        grads = ml.flash_attention_backward(*tensors, scale=scale)
        check_grads([m.to_numpy(t) for t in grads], host, shape, dtype, False, scale,
                    f"scale {scale}")
    shape = (1, 2, 33, 41, 64)
    tensors, host = problem(m, ml, rng, shape, dtype, True)
    views, bases = [], []
    for t in tensors[:5]:   # grad_out, q, k, v, out as views past an aligned pointer
        base = m.backend.empty((t.size + 1,), dtype, t.device_id)
        view = CudaTensor(t.shape, dtype, t.device_id, base.ptr + dtype.itemsize, owner=base)
        m.backend.copy_to_device(m.backend.to_host(t), view)
        views.append(view)
        bases.append(base)
    grads = ml.flash_attention_backward(*views, tensors[5], causal=True)
    check_grads([m.to_numpy(t) for t in grads], host, shape, dtype, True, None, "misaligned")
    for b in bases:
        b.free()
    # the per-call plan takes the second call of a shape
    shape = (2, 3, 65, 130, 64)
    for second in (False, True):
        tensors, host = problem(m, ml, rng, shape, dtype, True, scale=0.2)
        key = ab.plan_key(tensors[1], tensors[2], 0.2, True)
        if second:
            grads = call_through_plan(m, key, lambda: ml.flash_attention_backward(
                *tensors, scale=0.2, causal=True))
        else:
            m.plans.pop(key, None)
            grads = ml.flash_attention_backward(*tensors, scale=0.2, causal=True)
            assert key in m.plans
        check_grads([m.to_numpy(t) for t in grads], host, shape, dtype, True, 0.2,
                    f"plan {second}")


@gpu
@pytest.mark.parametrize("dtype", [DT.FLOAT16, DT.BFLOAT16], ids=lambda d: d.name_str)
def test_longer_sequences_and_torch(ml, dtype):
    """(1, 2, 1024, 1024, 128) causal and (2, 2, 512, 700, 64) against the bound; PyTorch's
    own backward in the same dtype (when importable) for scale: ours within the derived bound
    is the test, torch's normwise error is printed next to ours."""
    m = ml.math
    rng = np.random.default_rng(6572)
    for shape, causal in (((1, 2, 1024, 1024, 128), True), ((2, 2, 512, 700, 64), False)):
        tensors, host = problem(m, ml, rng, shape, dtype, causal)
        grads = [m.to_numpy(t) for t in ml.flash_attention_backward(*tensors, causal=causal)]
        check_grads(grads, host, shape, dtype, causal, None, f"{shape}")
        try:
            import torch
        except ImportError:
            continue
        gh, qh, kh, vh, oh, lh = host
        exact = ab.reference(gh, qh, kh, vh, 1 / math.sqrt(shape[4]), causal)
        tdt = torch.float16 if dtype is DT.FLOAT16 else torch.bfloat16
        ts = [torch.tensor(a, device="cuda").to(tdt).requires_grad_(True) for a in (qh, kh, vh)]
        y = torch.nn.functional.scaled_dot_product_attention(*ts, is_causal=causal)
        tg = torch.autograd.grad(y, ts, torch.tensor(gh, device="cuda").to(tdt))
        for name, ours, theirs, e in zip(("dq", "dk", "dv"), grads, tg, exact):
            n = np.linalg.norm(e)
            print(f"{shape} {name}: ours {np.linalg.norm(ours - e) / n:.2e} torch "
                  f"{np.linalg.norm(theirs.float().cpu().numpy() - e) / n:.2e}")


def median_ms(m, dev, call, reps=10):
    """The median wall time in ms of call() over reps runs, the device synchronized around
    each; CudaTensors in a tuple it returns are freed."""
    times = []
    for _ in range(reps):
        m.backend.synchronize(dev)
        t0 = time.perf_counter()
        res = call()
        m.backend.synchronize(dev)
        times.append((time.perf_counter() - t0) * 1e3)
        for r in res if isinstance(res, tuple) else ():
            if isinstance(r, CudaTensor):
                r.free()
    return float(np.median(times))


@gpu
@pytest.mark.large
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_issue_shape_bfloat16(ml, causal):
    """(4, 16, 4096, 4096, 128) bfloat16: the gradients of two heads checked against the bound
    (the reference of a head is 21 GFLOP in float64); the time of the backward (median of 10,
    after the autotuner's first call) printed with its TFLOP/s (10 B H T^2 D, half of it
    causal) and, where torch imports, PyTorch's autograd of scaled_dot_product_attention."""
    m = ml.math
    shape = (4, 16, 4096, 4096, 128)
    tensors, host = problem(m, ml, np.random.default_rng(9), shape, DT.BFLOAT16, causal)
    dev = tensors[1].device_id
    grads = ml.flash_attention_backward(*tensors, causal=causal)
    for b, h in ((0, 0), (3, 15)):
        one = tuple(a[b:b + 1, h:h + 1] for a in host)
        check_grads([m.to_numpy(t)[b:b + 1, h:h + 1] for t in grads], one,
                    (1, 1) + shape[2:], DT.BFLOAT16, causal, None, f"head {b},{h}")
    for t in grads:
        t.free()
    ms = median_ms(m, dev, lambda: ml.flash_attention_backward(*tensors, causal=causal))
    flops = (5.0 if causal else 10.0) * 4 * 16 * 4096**2 * 128
    line = f"backward causal={causal}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s"
    try:
        import torch
    except ImportError:
        print(line)
        return
    ts = [torch.tensor(a, device="cuda").to(torch.bfloat16).requires_grad_(True)
          for a in host[1:4]]
    tg = torch.tensor(host[0], device="cuda").to(torch.bfloat16)
    y = torch.nn.functional.scaled_dot_product_attention(*ts, is_causal=causal)
    tms = median_ms(m, dev, lambda: torch.autograd.grad(y, ts, tg, retain_graph=True))
    print(f"{line}; torch {tms:.3f} ms: ours / torch time {ms / tms:.2f} (goal <= 2.0)")


def _tf32_configs():
    return [c for hd in (64, 128) for c in ab.configs(DT.FLOAT32, hd)]


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cfg", _tf32_configs(),
                         ids=["-".join(str(v) for v in c.values()) for c in _tf32_configs()])
def test_tf32_configs_odd_lengths(m, ml, cfg, causal):
    """float32 on tensor cores (3xTF32): every tf32 config forced through run_config into
    NaN-poisoned gradients at sequence lengths 1, 17, 100, 129, 300 (and seq_q != seq_kv), on
    the head dims it serves of 32 / 64 / 80 / 128, against the bound with u_p = 2^-20."""
    rng = np.random.default_rng(21)
    dims = [d for d in (32, 64, 80, 128) if ab.padded_head_dim(d) == cfg["hd"]]
    for d in dims:
        for sq, skv in ((1, 1), (17, 17), (100, 100), (129, 129), (300, 300), (17, 129),
                        (300, 100)):
            shape = (2, 3, sq, skv, d)
            tensors, host = problem(m, ml, rng, shape, DT.FLOAT32, causal)
            grads = [m.backend.empty(t.shape, DT.FLOAT32, t.device_id)
                     for t in (tensors[1], tensors[2], tensors[3])]
            for t in grads:
                poison(m, t)
            ab.run_config(m, cfg, *tensors, grads, 1 / math.sqrt(d), causal)
            check_grads([m.to_numpy(t) for t in grads], host, shape, DT.FLOAT32, causal, None,
                        f"{cfg} {shape} causal={causal}", "tf32")
            for t in grads:
                t.free()


@gpu
@pytest.mark.large
@pytest.mark.parametrize("shape, causal", [((8, 12, 1024, 64), True),
                                           ((4, 16, 4096, 128), False),
                                           ((4, 16, 4096, 128), True)],
                         ids=["gpt2-causal", "4k-full", "4k-causal"])
def test_issue_shape_float32(ml, shape, causal):
    """float32 at the GPT-2-small training shape and (4, 16, 4096, 128): two heads checked
    against the bound (3xTF32); the time (median of 10, after the autotuner's first call)
    printed with PyTorch's float32 efficient-attention backward
    (aten._scaled_dot_product_efficient_attention_backward, fmha_cutlassB_f32) when torch
    imports; goal ours / torch <= 1.0."""
    m = ml.math
    B, H, S, D = shape
    tensors, host = problem(m, ml, np.random.default_rng(9), (B, H, S, S, D), DT.FLOAT32, causal)
    dev = tensors[1].device_id
    grads = ml.flash_attention_backward(*tensors, causal=causal)
    for b, h in ((0, 0), (B - 1, H - 1)):
        one = tuple(a[b:b + 1, h:h + 1] for a in host)
        check_grads([m.to_numpy(t)[b:b + 1, h:h + 1] for t in grads], one,
                    (1, 1, S, S, D), DT.FLOAT32, causal, None, f"head {b},{h}")
    for t in grads:
        t.free()
    ms = median_ms(m, dev, lambda: ml.flash_attention_backward(*tensors, causal=causal))
    flops = (5.0 if causal else 10.0) * B * H * S * S * D
    line = f"float32 backward {shape} causal={causal}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s"
    try:
        import torch
    except ImportError:
        print(line)
        return
    q, k, v = (torch.tensor(a, device="cuda", dtype=torch.float32) for a in host[1:4])
    go = torch.tensor(host[0], device="cuda", dtype=torch.float32)
    out, lse, seed, off = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, is_causal=causal)[:4]

    def theirs():
        return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            go, q, k, v, None, out, lse, seed, off, 0.0, [True, True, True, False],
            is_causal=causal)
    theirs()
    tms = median_ms(m, dev, theirs)
    print(f"{line}; torch {tms:.3f} ms: ours / torch time {ms / tms:.2f} (goal <= 1.0)")

# -- the GPU code paths on stubs (any machine) ------------------------------------------------
STUB_SCRIPT = script(STUBS, r'''
    import math, tempfile
    from cuda_backend.autotune import Autotuner
    from cuda_backend.cuda_ml import CudaML
    from cuda_backend.errors import (DTypeMismatchError, InvalidArgumentError,
                                     ShapeMismatchError, TensorFreedError)
    from cuda_backend.ops import attention as fa, attention_backward as ab
''', BACKEND, r'''
    m._autotuner = Autotuner(b, path=os.path.join(tempfile.mkdtemp(), "t.json"))
    ml = CudaML(m)
    rng = np.random.default_rng(0)
    # (the TMA forward reads its parameter layout from the driver, which the stubs do not
    # have: tests/test_flash_attention.py runs it and its plan on a GPU)
    from cuda_backend.ops import attention_tma
    attention_tma.CONFIGS.clear()

    def t(shape, dt=np.float32):
        return m.from_numpy(rng.standard_normal(shape).astype(dt))

    def same_as_general(call, key, nlaunch):
        """A warm call (compiles, autotunes), a general-path call (the key dropped: the plan
        is made again) and a plan call after freeing its results: the same launches, results
        of the same shapes and dtypes, the temporaries back in the pool."""
        for r in call():
            r.free()
        m.plans.pop(key, None)
        active = pool._total("active_blocks")
        launches.clear()
        r1 = call()
        assert key in m.plans, key
        general = list(launches)
        assert len(general) == nlaunch, (nlaunch, general)
        meta = [(r.shape, r.dtype) for r in r1]
        for r in reversed(r1):   # the pool hands the blocks back in the order taken
            r.free()
        launches.clear()
        seen, plan = [], m.plans[key]
        m.plans[key] = lambda *a: seen.append(1) or plan(*a)
        r2 = call()
        m.plans[key] = plan
        assert seen == [1], key
        assert launches == general, (key, launches, general)
        assert [(r.shape, r.dtype) for r in r2] == meta
        for r in r2:
            r.free()
        assert pool._total("active_blocks") == active, "a temporary was not given back"

    f32, f16, bf16 = np.float32, np.float16, DT.BFLOAT16
    for shape_q, shape_k, dt, scale, causal in (
            ((1, 2, 64, 64), (1, 2, 64, 64), f16, None, False),
            ((2, 3, 33, 40), (2, 3, 70, 40), f16, 0.2, True),
            ((1, 2, 17, 128), (1, 2, 9, 128), f16, -0.3, False),
            ((1, 1, 45, 37), (1, 1, 47, 37), f32, None, True),
            ((1, 1, 20, 200), (1, 1, 30, 200), f16, None, False)):
        q, k, v = t(shape_q, dt), t(shape_k, dt), t(shape_k, dt)
        g = t(shape_q, dt)
        dtype = q.dtype
        fkey = (fa.LSE_PLAN, q.shape, k.shape, v.shape, dtype, dtype, dtype, 0, 0, 0,
                scale is None, causal)
        same_as_general(lambda: ml.flash_attention(q, k, v, scale=scale, causal=causal,
                                                   return_lse=True), fkey, 1)
        out, lse = ml.flash_attention(q, k, v, scale=scale, causal=causal, return_lse=True)
        bkey = ab.plan_key(q, k, scale, causal)
        same_as_general(lambda: ml.flash_attention_backward(g, q, k, v, out, lse, scale=scale,
                                                            causal=causal), bkey, 3)
        same_as_general(lambda: ab.flash_attention_backward(m, g, q, k, v, out, lse, scale,
                                                            causal), bkey, 3)
    # the plan steps aside for what the general path must reject
    q, lse = t((1, 2, 64, 64), f16), t((1, 2, 64))
    out, lse = ml.flash_attention(q, q, q, return_lse=True)
    ml.flash_attention_backward(q, q, q, q, out, lse)
    with pytest.raises(ShapeMismatchError, match="lse has shape"):
        ml.flash_attention_backward(q, q, q, q, out, t((1, 2, 63)))
    with pytest.raises(DTypeMismatchError, match="lse has dtype float16"):
        ml.flash_attention_backward(q, q, q, q, out, t((1, 2, 64), f16))
    with pytest.raises(InvalidArgumentError, match="finite"):
        ml.flash_attention_backward(q, q, q, q, out, lse, scale=math.inf)
    dead = t((1, 2, 64, 64), f16)
    dead.free()
    with pytest.raises(TensorFreedError):
        ml.flash_attention_backward(dead, q, q, q, out, lse)
    print("OK")
''')


def test_plans_match_general_path_on_stubs():
    """With PyCUDA replaced by stubs (perf/bench_host_path.py), the forward with return_lse
    and the backward run their GPU code paths: the per-call plans launch exactly what the
    general path launches (3 launches for the backward), give the workspaces back, and step
    aside for bad inputs."""
    run_script(STUB_SCRIPT)
