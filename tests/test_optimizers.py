"""sgd_update / adam_update: 100 in-place steps against a float64 NumPy reference (SGD with and
without momentum, Nesterov, weight decay; Adam and AdamW with bias correction), half-precision
parameters with float32 buffers against a reference that rounds like them, sizes around the
vector width, misaligned tensors, the step counter, errors. GPU tests are marked `gpu`; the
rest run in whatever mode the backend is in (fallback here).

Device step counts (state.step_count, advance_steps, optim's per-parameter counts): the same
steps as the host count. SGD's first-step flag is the same either way: bit-identical. Adam's
bias corrections are computed on the device in double by the host's formula; CUDA's pow is
within 2 ulp of the exact beta^t and the host's (glibc) within 1, so 1 - beta^t differs by
at most 3 ulp(beta^t) + ulp(1 - beta^t) (Sterbenz: exact subtraction above 1/2, else one
rounding each), the division and square root add one rounding each: step_size within
d1 = (3 ulp(b1^t) + ulp(1 - b1^t)) / (1 - b1^t) + 2^-52 relative of the host's and
inv_bc2_sqrt within d2 = (3 ulp(b2^t) + ulp(1 - b2^t)) / (2 (1 - b2^t)) + 2^-51
(`correction_bounds`). Rounded to float32 (float32, float16 and bfloat16 parameters) they are
the host's exactly whenever no float32 rounding boundary lies within those intervals, which
holds for every configuration and step below (checked by the test): bit-identical results.
float64 parameters: the update u = step_size m / (sqrt(v) inv_bc2_sqrt + eps) then differs
by at most |u| (d1 + d2) to first order, and the parameter's rounding by 1 ulp more; a
carried difference feeds back only through wd * p (a factor 1 + O(lr wd)), so after K steps
|dp| <= sum_k 2 (|u_k| (d1 + d2) + ulp(max |p|)), the 2 covering the second-order terms."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples
from helpers import call_through_plan

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend import autograd as ag
from cuda_backend import nn, optim
from cuda_backend.cuda_math import CudaMath
from cuda_backend.cuda_ml import CudaML, OptimizerState
from cuda_backend.dtypes import from_bfloat16_bits, to_bfloat16_bits
from cuda_backend.ops import optimizers as opt
from cuda_backend.ops.shape_layouts import make_view
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
    rng = np.random.default_rng(190)
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
    rng = np.random.default_rng(7615)
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
    rng = np.random.default_rng(2976)
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
    rng = np.random.default_rng(9498)
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
    rng = np.random.default_rng(562)
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
    rng = np.random.default_rng(6133)
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
    rng = np.random.default_rng(1981)
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
    rng = np.random.default_rng(2782)
    pt, p, mt, mb, vt, vb = run_adam(m, 33, dtype, ADAM_CONFIGS[0], 5, rng, lr=0.05)
    tol = {DT.FLOAT16: 2e-3, DT.BFLOAT16: 1.5e-2}[dtype]
    assert prel(m.to_numpy(pt).astype(np.float64), p) < tol


def test_template_variants():
    v = opt.template_variants()["optimizers.cu.j2"]
    assert len(v) == 9
    assert v[-1] == {"opt": "count", "block_size": opt.BLOCK}
    for p in v[:-1]:
        assert p["state_ctype"] == ("double" if p["dtype"] == "float64" else "float")


# -- device step counts ------------------------------------------------------------------------
def correction_bounds(b1, b2, t):
    """(d1, d2): how far, relatively, the device's step_size and inv_bc2_sqrt of step t may be
    from the host's (the module docstring's derivation)."""
    p1, p2 = b1 ** t, b2 ** t
    bc1, bc2 = 1.0 - p1, 1.0 - p2
    d1 = (3 * math.ulp(p1) + math.ulp(bc1)) / bc1 + 2.0**-52
    d2 = (3 * math.ulp(p2) + math.ulp(bc2)) / (2 * bc2) + 2.0**-51
    return d1, d2


def float32_scalars_fixed(lr, b1, b2, t):
    """Whether every value within correction_bounds rounds to the host's float32 scalars."""
    d1, d2 = correction_bounds(b1, b2, t)
    step_size, inv = lr / (1.0 - b1 ** t), 1.0 / math.sqrt(1.0 - b2 ** t)
    return all(np.float32(x * (1 - d)) == np.float32(x) == np.float32(x * (1 + d))
               for x, d in ((step_size, d1), (inv, d2)))


def adam_float64_bound(p0, grads, cfg, lr):
    """The float64 bound of the module docstring on |p (device count) - p (host count)|,
    from the float64 reference's updates."""
    b1, b2, eps, wd, decoupled = cfg
    p, mb, vb = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
    bound = 0.0
    for t, g in enumerate(grads, 1):
        before = p * (1 - lr * wd) if decoupled else p
        p, mb, vb = ref_adam(p, g, mb, vb, t, lr, b1, b2, eps, wd, decoupled)
        d1, d2 = correction_bounds(b1, b2, t)
        bound += 2 * (np.abs(before - p).max() * (d1 + d2) + np.spacing(np.abs(p).max()))
    return bound


@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT64, DT.BFLOAT16],
                         ids=lambda d: d.name_str)
def test_device_count_takes_the_host_counts_steps(m, dtype):
    """Adam (every ADAM_CONFIGS) and SGD (every SGD_CONFIGS) for 12 steps through a device
    count (advance_steps, then the update reads it) and through the host's state.step, from
    the same values: bit for bit in fallback mode (the same arithmetic) and on the GPU for
    SGD and float32-computed Adam (the rounded scalars are the host's: checked per step);
    float64 Adam within the derived bound. state.step stays 0 with a device count."""
    rng = np.random.default_rng(71)
    sdt = opt.state_dtype(dtype)
    K, lr = 12, 1e-2
    for n in (7, 1001):
        p0 = rng.standard_normal(n)
        grads = [rng.standard_normal(n) for _ in range(K)]
        for kind, cfg in [("adam", c) for c in ADAM_CONFIGS] + [("sgd", c) for c in SGD_CONFIGS]:
            out = []
            for device in (False, True):
                pt, _ = tensor(m, p0, dtype)
                b1t = m.from_numpy(np.full(n, np.nan if kind == "sgd" else 0.0, sdt.numpy_dtype))
                b2t = m.from_numpy(np.zeros(n, sdt.numpy_dtype))
                count = m.from_numpy(np.zeros(1, np.int32)) if device else None
                if kind == "adam":
                    b1, b2, eps, wd, decoupled = cfg
                    state = OptimizerState(learning_rate=lr, beta1=b1, beta2=b2, epsilon=eps,
                                           weight_decay=wd, decoupled=decoupled,
                                           step_count=count)
                else:
                    has_buf, momentum, wd, nesterov = cfg
                    state = OptimizerState(learning_rate=lr, momentum=momentum,
                                           weight_decay=wd, nesterov=nesterov,
                                           step_count=count)
                for g in grads:
                    gt, _ = tensor(m, g, dtype)
                    if device:
                        opt.advance_steps(m, count)
                    if kind == "adam":
                        opt.adam_update(m, pt, gt, b1t, b2t, state)
                    else:
                        opt.sgd_update(m, pt, gt, b1t if cfg[0] else None, state)
                    gt.free()
                assert state.step == (0 if device else K)
                if device:
                    assert m.to_numpy(count).tolist() == [K]
                out.append([m.to_numpy(t) for t in (pt, b1t, b2t)])
            what = (n, kind, cfg)
            if m.gpu and kind == "adam" and dtype is DT.FLOAT64:
                bound = adam_float64_bound(p0, grads, cfg, lr)
                err = np.abs(out[0][0].astype(np.float64) - out[1][0]).max()
                assert err <= bound, (what, err, bound)
                continue
            if m.gpu and kind == "adam":
                assert all(float32_scalars_fixed(lr, cfg[0], cfg[1], t)
                           for t in range(1, K + 1)), what
            for a, b in zip(*out):
                np.testing.assert_array_equal(a, b, err_msg=str(what))


def test_advance_steps(m):
    """Every element of an int32 tensor of any size advanced by one per call; a view
    advances only its run; errors name what was wrong."""
    for n in (1, 5, 257, 1000):
        counts = m.from_numpy(np.arange(n, dtype=np.int32))
        for _ in range(3):
            opt.advance_steps(m, counts)
        np.testing.assert_array_equal(m.to_numpy(counts), np.arange(n) + 3)
    base = m.from_numpy(np.zeros(10, np.int32))
    opt.advance_steps(m, make_view(base, (4,), 3))
    assert m.to_numpy(base).tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0, 0]
    opt.advance_steps(m, m.from_numpy(np.zeros(0, np.int32)))
    with pytest.raises(cb.DTypeMismatchError, match="float32, expected int32"):
        opt.advance_steps(m, m.from_numpy(np.zeros(3, np.float32)))
    with pytest.raises(cb.InvalidArgumentError, match="step counts must be a CudaTensor"):
        opt.advance_steps(m, np.zeros(3, np.int32))
    gone = m.from_numpy(np.zeros(3, np.int32))
    gone.free()
    with pytest.raises(cb.TensorFreedError):
        opt.advance_steps(m, gone)
    assert m.to_numpy(base).tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0, 0]


def test_step_count_errors(m):
    """A step_count that is not one live int32 element raises before anything runs; in
    fallback mode a count below 1 (advance_steps not called) raises too."""
    p, g = (m.from_numpy(np.ones(5, np.float32)) for _ in range(2))
    mb, vb = (m.from_numpy(np.zeros(5, np.float32)) for _ in range(2))
    gone = m.from_numpy(np.ones(1, np.int32))
    gone.free()
    bad = [(m.from_numpy(np.ones(1, np.float32)), cb.DTypeMismatchError,
            "step_count has dtype float32, expected int32"),
           (m.from_numpy(np.ones(2, np.int32)), cb.ShapeMismatchError,
            r"step_count has shape \(2,\), expected one element"),
           (3, cb.InvalidArgumentError, "step_count must be a CudaTensor"),
           (gone, cb.TensorFreedError, "freed")]
    for count, err, match in bad:
        state = OptimizerState(learning_rate=0.1, momentum=0.9, step_count=count)
        with pytest.raises(err, match=match):
            opt.adam_update(m, p, g, mb, vb, state)
        with pytest.raises(err, match=match):
            opt.sgd_update(m, p, g, mb, state)
        assert state.step == 0
    if not m.gpu:   # (the device's count is not read back on a GPU)
        zero = m.from_numpy(np.zeros(1, np.int32))
        for call in (lambda s: opt.adam_update(m, p, g, mb, vb, s),
                     lambda s: opt.sgd_update(m, p, g, mb, s)):
            with pytest.raises(cb.InvalidArgumentError, match="holds 0.*advance_steps"):
                call(OptimizerState(learning_rate=0.1, step_count=zero))
    np.testing.assert_array_equal(m.to_numpy(p), 1.0)
    np.testing.assert_array_equal(m.to_numpy(mb), 0.0)


# -- optim: per-parameter device counts, state save and load -----------------------------------
def make_optimizer(kind, params, lr=0.05):
    if kind == "sgd":
        return optim.SGD(params, lr, momentum=0.9, weight_decay=0.01, nesterov=True)
    if kind == "sgd_plain":
        return optim.SGD(params, lr, weight_decay=0.01)
    return (optim.Adam if kind == "adam" else optim.AdamW)(params, lr, weight_decay=0.1)


SHAPES = [(3, 5), (7,), (2, 1, 3)]
SKIPS = {1: (2, 4), 2: (0,)}     # parameter index -> steps (0-based) it has no gradient in


def train(om, kind, values, grads, steps, opt_=None):
    """steps optimizer steps over float64 parameters from values with grads[step][i] (None
    where SKIPS says so); returns (params, optimizer)."""
    params = [nn.Parameter(om.from_numpy(v.copy())) for v in values] if opt_ is None \
        else opt_.params
    opt_ = opt_ or make_optimizer(kind, params)
    for s in steps:
        for i, p in enumerate(params):
            p.grad = None if s in SKIPS.get(i, ()) else om.from_numpy(grads[s][i])
        opt_.step()
    return params, opt_


@pytest.mark.parametrize("kind", ["sgd", "sgd_plain", "adam", "adamw"])
def test_optimizer_counts_follow_each_parameters_steps(kind):
    """A parameter without a gradient in a step keeps its count (PyTorch's per-parameter
    step): every parameter against the float64 reference at its own step, its count read
    back (steps(p)), state.step left at 0 (the count is on the device)."""
    om = ag.apis()[0]
    rng = np.random.default_rng(72)
    values = [rng.standard_normal(s) for s in SHAPES]
    grads = [[rng.standard_normal(s) for s in SHAPES] for _ in range(6)]
    params, o = train(om, kind, values, grads, range(6))
    for i, p in enumerate(params):
        ref, bufs, taken = values[i].copy(), None, 0
        for s in range(6):
            if s in SKIPS.get(i, ()):
                continue
            st = OptimizerState(learning_rate=0.05, momentum=o.state[id(p)][0].momentum,
                                beta1=0.9, beta2=0.999, epsilon=1e-8,
                                weight_decay=0.01 if kind.startswith("sgd") else 0.1,
                                nesterov=kind == "sgd", decoupled=kind == "adamw", step=taken)
            if kind.startswith("sgd"):
                ref, bufs = opt.reference("sgd", st, ref, grads[s][i],
                                          *(() if kind == "sgd_plain" else
                                            (np.zeros_like(ref) if bufs is None else bufs,)))
            else:
                bufs = bufs or (np.zeros_like(ref), np.zeros_like(ref))
                ref, m1, v1 = opt.reference("adam", st, ref, grads[s][i], *bufs)
                bufs = (m1, v1)
            taken += 1
        assert o.steps(p) == taken == 6 - len(SKIPS.get(i, ()))
        assert o.state[id(p)][0].step == 0
        assert prel(m_host(om, p), ref) < TOL[DT.FLOAT64], (kind, i)
    with pytest.raises(cb.InvalidArgumentError, match="not a parameter of this optimizer"):
        o.steps(nn.Parameter(om.from_numpy(np.ones(2))))


def m_host(om, p):
    return np.asarray(om.to_numpy(p.data), np.float64)


@pytest.mark.parametrize("kind", ["sgd", "sgd_plain", "adam", "adamw"])
def test_optimizer_state_save_and_load(kind, tmp_path):
    """state_dict names each updated parameter's step and buffers; 3 steps, save(), a fresh
    optimizer over copies of the parameters load()s it, and 3 more steps on both give the
    same parameters and state bit for bit as 6 steps in one run."""
    om = ag.apis()[0]
    rng = np.random.default_rng(73)
    values = [rng.standard_normal(s) for s in SHAPES]
    grads = [[rng.standard_normal(s) for s in SHAPES] for _ in range(6)]
    whole, o_whole = train(om, kind, values, grads, range(6))
    half, o_half = train(om, kind, values, grads, range(3))
    sd = o_half.state_dict()
    names = {"sgd": ("momentum_buffer",), "sgd_plain": (), "adam": ("exp_avg", "exp_avg_sq"),
             "adamw": ("exp_avg", "exp_avg_sq")}[kind]
    assert set(sd) == {f"state.{i}.{n}" for i in range(3) for n in ("step",) + names}
    assert [int(sd[f"state.{i}.step"]) for i in range(3)] == [3, 2, 2]
    path = str(tmp_path / "opt.npz")
    o_half.save(path)
    copies = [nn.Parameter(om.from_numpy(m_host(om, p))) for p in half]
    o_new = make_optimizer(kind, copies)
    o_new.load(path)
    assert [o_new.steps(p) for p in copies] == [3, 2, 2]
    for o in (o_half, o_new):
        train(om, kind, values, grads, range(3, 6), o)
    want = o_whole.state_dict()
    for o in (o_half, o_new):
        for p, w in zip(o.params, whole):
            np.testing.assert_array_equal(m_host(om, p), m_host(om, w))
        got = o.state_dict()
        assert set(got) == set(want)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_optimizer_load_errors_leave_the_state():
    """Keys it does not know, entries without a step or a buffer, a buffer of another shape
    and steps that are not integers in [0, 2**31) raise before anything is copied."""
    om = ag.apis()[0]
    rng = np.random.default_rng(74)
    values = [rng.standard_normal(s) for s in SHAPES]
    grads = [[rng.standard_normal(s) for s in SHAPES] for _ in range(2)]
    params, o = train(om, "adam", values, grads, range(2))
    good = o.state_dict()
    before = [m_host(om, p) for p in params]
    z = np.zeros((3, 5))
    bad = [({**good, "state.9.step": np.int64(1)}, cb.InvalidArgumentError, "unexpected key"),
           ({**good, "lr": np.float64(0.1)}, cb.InvalidArgumentError, "unexpected key"),
           ({**good, "state.0.momentum_buffer": z}, cb.InvalidArgumentError, "unexpected key"),
           ({"state.0.exp_avg": z, "state.0.exp_avg_sq": z}, cb.InvalidArgumentError,
            "state.0.step must be one integer"),
           ({"state.0.step": np.int64(2), "state.0.exp_avg": z}, cb.InvalidArgumentError,
            r"missing \['exp_avg_sq'\]"),
           ({**good, "state.0.step": np.int64(7),          # valid, and not copied either
             "state.2.exp_avg_sq": np.zeros(18)}, cb.ShapeMismatchError,
            r"state.2.exp_avg_sq has shape \(18,\), the parameter \(2, 1, 3\)")]
    for step in (-1, 1.5, 2**31, np.nan):
        bad.append(({**good, "state.1.step": np.float64(step)}, cb.InvalidArgumentError,
                    "state.1.step must be one integer"))
    for state, err, match in bad:
        with pytest.raises(err, match=match):
            o.load_state_dict(state)
        after = o.state_dict()
        for k in good:
            np.testing.assert_array_equal(after[k], good[k], err_msg=k)
    for p, b in zip(params, before):
        np.testing.assert_array_equal(m_host(om, p), b)
    plain = make_optimizer("sgd_plain", params)
    with pytest.raises(cb.InvalidArgumentError, match="unexpected key"):
        plain.load_state_dict({"state.0.step": np.int64(1), "state.0.exp_avg": z})


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_optimizers_match_pytorch_with_skipped_gradients(kind):
    """optim's SGD / Adam / AdamW against torch.optim's on float64 parameters, some without a
    gradient in some steps (their own step counts in both)."""
    torch = pytest.importorskip("torch")
    om = ag.apis()[0]
    rng = np.random.default_rng(75)
    values = [rng.standard_normal(s) for s in SHAPES]
    grads = [[rng.standard_normal(s) for s in SHAPES] for _ in range(6)]
    params, _ = train(om, kind, values, grads, range(6))
    tparams = [torch.nn.Parameter(torch.from_numpy(v.copy())) for v in values]
    if kind == "sgd":
        topt = torch.optim.SGD(tparams, 0.05, momentum=0.9, weight_decay=0.01, nesterov=True)
    else:
        topt = (torch.optim.Adam if kind == "adam" else torch.optim.AdamW)(
            tparams, 0.05, weight_decay=0.1)
    for s in range(6):
        for i, p in enumerate(tparams):
            p.grad = None if s in SKIPS.get(i, ()) else torch.from_numpy(grads[s][i].copy())
        topt.step()
    for p, tp in zip(params, tparams):
        assert prel(m_host(om, p), tp.detach().numpy()) < TOL[DT.FLOAT64], kind
