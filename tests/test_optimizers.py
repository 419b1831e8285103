"""sgd_update / adam_update: 100 in-place steps against a float64 NumPy reference (SGD with and
without momentum, Nesterov, weight decay; Adam and AdamW with bias correction), half-precision
parameters with float32 buffers against a reference that rounds like them, sizes around the
vector width, misaligned tensors, the step counter, errors. GPU tests are marked `gpu`; the
rest run in whatever mode the backend is in (fallback here)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples
from helpers import call_through_plan

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend.cuda_math import CudaMath
from cuda_backend.cuda_ml import CudaML, OptimizerState
from cuda_backend.dtypes import from_bfloat16_bits, to_bfloat16_bits
from cuda_backend.ops import optimizers as opt
from cuda_backend.tensor import CudaTensor

SIZES = [1, 3, 4, 5, 7, 8, 9, 1023, 4097, (1 << 20) + 5]
SGD_CONFIGS = [  # (momentum buffer?, momentum, weight_decay, nesterov)
    (False, 0.0, 0.0, False), (False, 0.0, 0.01, False), (True, 0.9, 0.0, False),
    (True, 0.9, 1e-4, True), (True, 0.5, 0.05, False),
]
ADAM_CONFIGS = [  # (beta1, beta2, eps, weight_decay, decoupled)
    (0.9, 0.999, 1e-8, 0.0, False), (0.9, 0.999, 1e-8, 0.01, False),
    (0.9, 0.999, 1e-8, 0.01, True), (0.8, 0.99, 1e-6, 0.1, True), (0.0, 0.5, 1e-3, 0.0, False),
]
TOL = {DT.FLOAT32: 1e-5, DT.FLOAT64: 1e-12}


@pytest.fixture(scope="module")
def m():
    return CudaMath()


def rel(a, b, floor=0.0):
    """Norm-wise relative error; floor bounds the denominator from below (parameters start
    O(1) and may end near 0, while their rounding error stays that of O(1) values)."""
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), floor, 1e-300))


def prel(a, b):
    """rel for parameters and momentum / first-moment buffers (sums of N(0, 1) gradients
    that can cancel to near 0 at n = 1, while their rounding error stays that of O(1)
    values): denominator at least half the norm of n O(1) values."""
    return rel(a, b, 0.5 * np.sqrt(b.size))


def ref_sgd(p, g, b, lr, momentum, wd, nesterov, first, use_buf=True):
    """PyTorch's SGD (dampening 0) in float64; use_buf=False is plain SGD (b ignored)."""
    g = g + wd * p
    if use_buf:
        b = g.copy() if first else momentum * b + g
        g = g + momentum * b if nesterov else b
    return p - lr * g, b


def ref_adam(p, g, mb, vb, t, lr, b1, b2, eps, wd, decoupled):
    """Adam (L2 weight decay) or AdamW (decoupled) with bias correction, in float64."""
    if decoupled:
        p = p * (1 - lr * wd)
    else:
        g = g + wd * p
    mb = b1 * mb + (1 - b1) * g
    vb = b2 * vb + (1 - b2) * g * g
    mhat = mb / (1 - b1 ** t)
    vhat = vb / (1 - b2 ** t)
    return p - lr * mhat / (np.sqrt(vhat) + eps), mb, vb


def tensor(m, values, dtype):
    host = values.astype(np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype)
    t = m.from_numpy(host, dtype=dtype)
    return t, m.to_numpy(t).astype(np.float64)


def round_to(values, dtype):
    """values rounded to dtype (what a half-precision parameter stores), as float64."""
    if dtype is DT.FLOAT16:
        return values.astype(np.float16).astype(np.float64)
    if dtype is DT.BFLOAT16:
        return from_bfloat16_bits(to_bfloat16_bits(values.astype(np.float32))).astype(np.float64)
    return values


def run_sgd(m, n, dtype, cfg, steps, rng, lr=0.01):
    has_buf, momentum, wd, nesterov = cfg
    pt, p = tensor(m, rng.standard_normal(n), dtype)
    bt = m.from_numpy(np.full(n, np.nan, np.float32 if dtype is not DT.FLOAT64 else np.float64)) \
        if has_buf else None  # poison: step 0 must not read the buffer
    b = None
    state = OptimizerState(learning_rate=lr, momentum=momentum, weight_decay=wd,
                           nesterov=nesterov)
    for k in range(steps):
        gt, g = tensor(m, rng.standard_normal(n), dtype)
        opt.sgd_update(m, pt, gt, bt, state)
        p, b = ref_sgd(p, g, b, lr, momentum, wd, nesterov, k == 0, has_buf)
        p = round_to(p, dtype)
        gt.free()
        assert state.step == k + 1
    return pt, p, bt, b


def run_adam(m, n, dtype, cfg, steps, rng, lr=1e-3):
    b1, b2, eps, wd, decoupled = cfg
    pt, p = tensor(m, rng.standard_normal(n), dtype)
    sdt = opt.state_dtype(dtype)
    mt = m.from_numpy(np.zeros(n, sdt.numpy_dtype))
    vt = m.from_numpy(np.zeros(n, sdt.numpy_dtype))
    mb = np.zeros(n)
    vb = np.zeros(n)
    state = OptimizerState(learning_rate=lr, beta1=b1, beta2=b2, epsilon=eps, weight_decay=wd,
                           decoupled=decoupled)
    for k in range(steps):
        gt, g = tensor(m, rng.standard_normal(n), dtype)
        opt.adam_update(m, pt, gt, mt, vt, state)
        p, mb, vb = ref_adam(p, g, mb, vb, k + 1, lr, b1, b2, eps, wd, decoupled)
        p = round_to(p, dtype)
        gt.free()
        assert state.step == k + 1
    return pt, p, mt, mb, vt, vb


# -- GPU -------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16],
                         ids=lambda d: d.name_str)
def test_second_call_takes_the_plan(m, dtype):
    """CudaML.sgd_update / adam_update twice on fresh parameters and gradients of odd sizes
    (fresh states): the second call goes through the plan the first made, updates in place
    and advances state.step; both match the float64 reference."""
    ml = CudaML(m)
    rng = np.random.default_rng(25)
    sdt = opt.state_dtype(dtype)
    tol = {**TOL, DT.FLOAT16: 2e-3, DT.BFLOAT16: 1.5e-2}[dtype]
    for n in (1001, 7, 4099):
        for op in ("sgd", "adam"):
            key = ("sgd_update", (n,), dtype, 0, False) if op == "sgd" else \
                ("adam_update", (n,), dtype, 0)
            m.plans.pop(key, None)
            for second in (False, True):
                pt, p = tensor(m, rng.standard_normal(n), dtype)
                gt, g = tensor(m, rng.standard_normal(n), dtype)
                bt, b = tensor(m, rng.standard_normal(n), sdt)
                vt, v = tensor(m, rng.random(n), sdt)
                if op == "sgd":
                    state = OptimizerState(learning_rate=0.01, momentum=0.9, weight_decay=0.01,
                                           nesterov=True, step=3)
                    call = lambda: ml.sgd_update(pt, gt, bt, state)  # noqa: E731
                    p_ref, b_ref = ref_sgd(p, g, b, 0.01, 0.9, 0.01, True, False)
                    v_ref = v
                else:
                    state = OptimizerState(learning_rate=1e-3, weight_decay=0.1, decoupled=True,
                                           step=4)
                    call = lambda: ml.adam_update(pt, gt, bt, vt, state)  # noqa: E731
                    p_ref, b_ref, v_ref = ref_adam(p, g, b, v, 5, 1e-3, 0.9, 0.999, 1e-8, 0.1,
                                                   True)
                if second:
                    call_through_plan(m, key, call)
                else:
                    call()
                assert key in m.plans
                assert state.step == (4 if op == "sgd" else 5)
                what = f"{op} n={n} second={second}"
                assert prel(m.to_numpy(pt).astype(np.float64), round_to(p_ref, dtype)) < tol, what
                assert prel(m.to_numpy(bt).astype(np.float64), b_ref) < TOL[sdt], what
                assert rel(m.to_numpy(vt).astype(np.float64), v_ref) < TOL[sdt], what
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT64], ids=lambda d: d.name_str)
@pytest.mark.parametrize("cfg", SGD_CONFIGS, ids=str)
def test_sgd_100_steps(m, dtype, cfg):
    rng = np.random.default_rng()
    for n in SIZES:
        steps = 100 if n < 1 << 20 else 20
        pt, p, bt, b = run_sgd(m, n, dtype, cfg, steps, rng)
        assert prel(m.to_numpy(pt).astype(np.float64), p) < TOL[dtype], (n, cfg)
        if bt is not None:
            assert prel(m.to_numpy(bt).astype(np.float64), b) < TOL[dtype], (n, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT64], ids=lambda d: d.name_str)
@pytest.mark.parametrize("cfg", ADAM_CONFIGS, ids=str)
def test_adam_100_steps(m, dtype, cfg):
    rng = np.random.default_rng()
    for n in SIZES:
        steps = 100 if n < 1 << 20 else 20
        pt, p, mt, mb, vt, vb = run_adam(m, n, dtype, cfg, steps, rng)
        what = (n, cfg)
        assert prel(m.to_numpy(pt).astype(np.float64), p) < TOL[dtype], what
        assert prel(m.to_numpy(mt).astype(np.float64), mb) < TOL[dtype], what
        assert rel(m.to_numpy(vt).astype(np.float64), vb) < TOL[dtype], what


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DT.FLOAT16, DT.BFLOAT16], ids=lambda d: d.name_str)
def test_half_params_with_float32_buffers(m, dtype):
    """Half parameters, float32 m/v/momentum: against a reference that rounds the parameter
    each step as the kernel does (large lr so every step moves the parameters)."""
    rng = np.random.default_rng()
    tol = {DT.FLOAT16: 2e-3, DT.BFLOAT16: 1.5e-2}[dtype]
    for n in [1, 7, 8, 9, 4097]:
        pt, p, mt, mb, vt, vb = run_adam(m, n, dtype, ADAM_CONFIGS[2], 20, rng, lr=0.05)
        assert prel(m.to_numpy(pt).astype(np.float64), p) < tol, n
        assert rel(m.to_numpy(mt).astype(np.float64), mb) < tol, n
        assert mt.dtype is DT.FLOAT32
        pt, p, bt, b = run_sgd(m, n, dtype, SGD_CONFIGS[3], 20, rng, lr=0.05)
        assert prel(m.to_numpy(pt).astype(np.float64), p) < tol, n
        assert rel(m.to_numpy(bt).astype(np.float64), b) < tol, n


@pytest.mark.gpu
def test_large_adam_and_sgd(m):
    rng = np.random.default_rng()
    n = (1 << 24) + 3
    pt, p, mt, mb, vt, vb = run_adam(m, n, DT.FLOAT32, ADAM_CONFIGS[2], 3, rng)
    assert prel(m.to_numpy(pt).astype(np.float64), p) < 1e-6
    assert rel(m.to_numpy(vt).astype(np.float64), vb) < 1e-6
    for t in (pt, mt, vt):
        t.free()
    pt, p, bt, b = run_sgd(m, n, DT.FLOAT32, SGD_CONFIGS[3], 3, rng)
    assert prel(m.to_numpy(pt).astype(np.float64), p) < 1e-6


@pytest.mark.gpu
def test_misaligned_tensors_take_the_scalar_path(m):
    """Views one element past 16-byte alignment give the same steps as aligned tensors."""
    rng = np.random.default_rng()
    n = 1001
    p0 = rng.standard_normal(n).astype(np.float32)
    g0 = rng.standard_normal(n).astype(np.float32)

    def view(values):
        base = m.from_numpy(np.concatenate([[0.0], values]).astype(np.float32))
        return CudaTensor((n,), DT.FLOAT32, base.device_id, base.ptr + 4, owner=base)

    aligned = [m.from_numpy(v) for v in (p0, g0, np.zeros(n, np.float32),
                                         np.zeros(n, np.float32))]
    shifted = [view(v) for v in (p0, g0, np.zeros(n, np.float32), np.zeros(n, np.float32))]
    for ts in (aligned, shifted):
        state = OptimizerState(learning_rate=1e-2, weight_decay=0.01, decoupled=True)
        for _ in range(5):
            opt.adam_update(m, ts[0], ts[1], ts[2], ts[3], state)
        state = OptimizerState(learning_rate=1e-2, momentum=0.9, nesterov=True)
        for _ in range(5):
            opt.sgd_update(m, ts[0], ts[1], ts[2], state)
    for a, s in zip(aligned, shifted):
        np.testing.assert_allclose(m.to_numpy(s), m.to_numpy(a), rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@settings(max_examples=examples(30), deadline=None)
@given(n=st.integers(1, 3000), adam=st.booleans(), steps=st.integers(1, 6),
       lr=st.floats(1e-4, 0.1), wd=st.sampled_from([0.0, 0.01]), flag=st.booleans(),
       dtype=st.sampled_from([DT.FLOAT32, DT.FLOAT64]))
def test_property(m, n, adam, steps, lr, wd, flag, dtype):
    rng = np.random.default_rng()
    if adam:
        pt, p, mt, mb, vt, vb = run_adam(m, n, dtype, (0.9, 0.999, 1e-8, wd, flag), steps,
                                         rng, lr)
    else:
        pt, p, _, _ = run_sgd(m, n, dtype, (True, 0.9, wd, flag), steps, rng, lr)
    assert prel(m.to_numpy(pt).astype(np.float64), p) < TOL[dtype]


# -- any mode (fallback here) ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT64], ids=lambda d: d.name_str)
def test_api_few_steps(m, dtype):
    """CudaML.sgd_update / adam_update (the documented API's calls) for a few steps."""
    ml = CudaML(m)
    rng = np.random.default_rng()
    n = 37
    pt, p = tensor(m, rng.standard_normal(n), dtype)
    mt = m.from_numpy(np.zeros(n, dtype.numpy_dtype))
    vt = m.from_numpy(np.zeros(n, dtype.numpy_dtype))
    mb, vb = np.zeros(n), np.zeros(n)
    st_ = OptimizerState(learning_rate=1e-2, weight_decay=0.01, decoupled=True)
    for k in range(5):
        gt, g = tensor(m, rng.standard_normal(n), dtype)
        ml.adam_update(pt, gt, mt, vt, st_)
        p, mb, vb = ref_adam(p, g, mb, vb, k + 1, 1e-2, 0.9, 0.999, 1e-8, 0.01, True)
    assert st_.step == 5
    assert prel(m.to_numpy(pt).astype(np.float64), p) < TOL[dtype]
    bt = m.from_numpy(np.zeros(n, dtype.numpy_dtype))
    b = None
    st_ = OptimizerState(learning_rate=0.1, momentum=0.9, nesterov=True)
    for k in range(5):
        gt, g = tensor(m, rng.standard_normal(n), dtype)
        ml.sgd_update(pt, gt, bt, st_)
        p, b = ref_sgd(p, g, b, 0.1, 0.9, 0.0, True, k == 0)
    assert st_.step == 5
    assert prel(m.to_numpy(pt).astype(np.float64), p) < TOL[dtype]
    plain = OptimizerState(learning_rate=0.1, weight_decay=0.01)
    ml.sgd_update(pt, gt, None, plain)  # plain SGD, no buffer
    p, _ = ref_sgd(p, g, None, 0.1, 0.0, 0.01, False, False, use_buf=False)
    assert prel(m.to_numpy(pt).astype(np.float64), p) < TOL[dtype]
    assert plain.step == 1


def test_zero_size_advances_the_step(m):
    p = m.from_numpy(np.ones(0, np.float32))
    state = OptimizerState(learning_rate=0.1)
    opt.sgd_update(m, p, p, None, state)
    opt.adam_update(m, p, p, p, p, state)
    assert state.step == 2


def test_errors(m):
    f32 = lambda *s: m.from_numpy(np.ones(s, np.float32))  # noqa: E731
    p, g = f32(4, 3), f32(4, 3)
    state = OptimizerState(learning_rate=0.1)
    with pytest.raises(cb.ShapeMismatchError, match=r"gradients have shape \(3, 4\).*\(4, 3\)"):
        opt.sgd_update(m, p, f32(3, 4), None, state)
    with pytest.raises(cb.ShapeMismatchError, match=r"momentum has shape \(12,\).*\(4, 3\)"):
        opt.sgd_update(m, p, g, f32(12), state)
    with pytest.raises(cb.ShapeMismatchError, match=r"v_buffer has shape \(2,\)"):
        opt.adam_update(m, p, g, f32(4, 3), f32(2), state)
    with pytest.raises(cb.DTypeMismatchError, match="float32 and float64"):
        opt.sgd_update(m, p, m.from_numpy(np.ones((4, 3))), None, state)
    ph = m.from_numpy(np.ones(5, np.float16))
    with pytest.raises(cb.DTypeMismatchError, match="m_buffer has dtype float16, expected float32"):
        opt.adam_update(m, ph, ph, ph, ph, state)
    with pytest.raises(cb.DTypeMismatchError, match="int32"):
        pi = m.from_numpy(np.ones(3, np.int32))
        opt.sgd_update(m, pi, pi, None, state)
    with pytest.raises(cb.InvalidArgumentError, match="beta1"):
        opt.adam_update(m, p, g, f32(4, 3), f32(4, 3),
                        OptimizerState(learning_rate=0.1, beta1=1.0))
    with pytest.raises(cb.InvalidArgumentError, match="learning_rate"):
        opt.sgd_update(m, p, g, None, OptimizerState(learning_rate=float("nan")))
    with pytest.raises(cb.InvalidArgumentError, match="Nesterov"):
        opt.sgd_update(m, p, g, None, OptimizerState(learning_rate=0.1, nesterov=True))
    with pytest.raises(cb.InvalidArgumentError, match="OptimizerState"):
        opt.sgd_update(m, p, g, None, object())
    with pytest.raises(cb.InvalidArgumentError, match="step"):
        opt.sgd_update(m, p, g, None, OptimizerState(learning_rate=0.1, step=-1))
    with pytest.raises(cb.InvalidArgumentError, match="m_buffer and v_buffer"):
        opt.adam_update(m, p, g, None, f32(4, 3), state)
    assert state.step == 0  # nothing ran


@pytest.mark.parametrize("dtype", [DT.FLOAT16, DT.BFLOAT16], ids=lambda d: d.name_str)
def test_half_params_api(m, dtype):
    """Half parameters with float32 buffers through CudaML, against the rounding reference."""
    rng = np.random.default_rng()
    pt, p, mt, mb, vt, vb = run_adam(m, 33, dtype, ADAM_CONFIGS[0], 5, rng, lr=0.05)
    tol = {DT.FLOAT16: 2e-3, DT.BFLOAT16: 1.5e-2}[dtype]
    assert prel(m.to_numpy(pt).astype(np.float64), p) < tol


def test_template_variants():
    v = opt.template_variants()["optimizers.cu.j2"]
    assert len(v) == 8
    for p in v:
        assert p["state_ctype"] == ("double" if p["dtype"] == "float64" else "float")
