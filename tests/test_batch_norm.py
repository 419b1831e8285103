"""batch_norm (inference and training) against a float64 NumPy reference: every float dtype,
(N, C), (N, C, L) and (N, C, H, W) inputs, the vector and scalar paths of both layouts,
inputs far from zero mean, running-statistics updates (unbiased variance), poisoned outputs,
misaligned inputs, errors. GPU tests are marked `gpu`; the rest run in whatever mode the
backend is in (fallback here)."""
from __future__ import annotations

import re
import struct
import types

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend.cuda_math import CudaMath
from cuda_backend.compiler import arg_format, kernel_signature
from cuda_backend.cuda_ml import CudaML, OptimizerState
from cuda_backend.kernels import KernelGenerator
from cuda_backend.launch import normalize_dims
from cuda_backend.ops import dropout as dr
from cuda_backend.ops import normalization as nm
from cuda_backend.ops import optimizers as opt
from cuda_backend.ops import pooling
from cuda_backend.tensor import CudaTensor

FLOATS = [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16]
# error bound per element: RTOL * (|(x - mean) * scale| + |beta|) + 4 eps_acc |mean * scale|
# (+ FLOOR)
RTOL = {DT.FLOAT32: 4e-6, DT.FLOAT64: 1e-13, DT.FLOAT16: 2e-3, DT.BFLOAT16: 1e-2}
TRAIN_RTOL = {DT.FLOAT32: 2e-5, DT.FLOAT64: 1e-12, DT.FLOAT16: 3e-3, DT.BFLOAT16: 1.2e-2}
# float16 results below 2^-14 are subnormal: spaced 2^-24 apart whatever their size
FLOOR = {DT.FLOAT32: 1e-300, DT.FLOAT64: 1e-300, DT.FLOAT16: 2.0**-24, DT.BFLOAT16: 1e-300}
ACC_EPS = {DT.FLOAT32: 2.0**-23, DT.FLOAT64: 2.0**-52, DT.FLOAT16: 2.0**-23,
           DT.BFLOAT16: 2.0**-23}
SHAPES = [(1, 1), (3, 5), (2, 7), (4, 12), (5, 16), (2, 3, 5), (2, 8, 4), (3, 5, 7, 9),
          (1, 1, 1, 1), (2, 3, 17, 19), (4, 16, 8, 8), (6, 64, 3, 3), (16, 3, 32, 32),
          (1000, 7), (257, 40), (3, 2, 1, 1)]


@pytest.fixture(scope="module")
def m():
    return CudaMath()


def host_dtype(dtype):
    return np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype


def to_dev(m, values, dtype):
    t = m.from_numpy(np.asarray(values).astype(host_dtype(dtype)), dtype=dtype)
    return t, m.to_numpy(t).astype(np.float64)


def params(m, C, dtype, rng):
    """gamma, beta, running mean, running var (positive) as tensors and float64 arrays."""
    g = to_dev(m, rng.standard_normal(C) * 1.5 + 0.5, dtype)
    b = to_dev(m, rng.standard_normal(C), dtype)
    mu = to_dev(m, rng.standard_normal(C) * 0.5, dtype)
    var = to_dev(m, rng.random(C) * 2 + 0.1, dtype)
    return g, b, mu, var


def bshape(ndim, C):
    return (1, C) + (1,) * (ndim - 2)


def reference(a, g, b, mu, var, eps, training, momentum):
    """(y, new running mean, new running var) in float64, PyTorch's semantics."""
    C = a.shape[1]
    s = bshape(a.ndim, C)
    if training:
        axes = (0,) + tuple(range(2, a.ndim))
        bm, bv = a.mean(axis=axes), a.var(axis=axes)
        n = a.size // C
        y = (a - bm.reshape(s)) / np.sqrt(bv.reshape(s) + eps) * g.reshape(s) + b.reshape(s)
        return (y, (1 - momentum) * mu + momentum * bm,
                (1 - momentum) * var + momentum * bv * n / (n - 1), bm, bv)
    y = (a - mu.reshape(s)) / np.sqrt(var.reshape(s) + eps) * g.reshape(s) + b.reshape(s)
    return y, mu, var, mu, var


def check_output(out, a, g, b, mean, var, eps, rtol, dtype, what=""):
    """Elementwise: |out - ref| <= rtol (|(x - mean) scale| + |beta|) + 4 eps_acc |mean scale|
    (the last term: x - mean is formed in the accumulation precision)."""
    s = bshape(a.ndim, a.shape[1])
    scale = (g / np.sqrt(var + eps)).reshape(s)
    ref = (a - mean.reshape(s)) * scale + b.reshape(s)
    bound = rtol * (np.abs((a - mean.reshape(s)) * scale) + np.abs(b.reshape(s))) \
        + 4 * ACC_EPS[dtype] * np.abs(mean.reshape(s) * scale) + FLOOR[dtype]
    out = out.astype(np.float64)
    assert out.shape == ref.shape, what
    assert np.all(np.isfinite(out)), what
    err = np.abs(out - ref)
    bad = err > bound
    assert not bad.any(), (what, int(bad.sum()), float(np.max(err / bound)))


def run(m, x, tensors, eps, training, momentum, dtype, out=None):
    g, b, mu, var = (t for t, _ in tensors)
    if out is None:
        out = m.from_numpy(np.full(x.shape, np.nan, host_dtype(dtype)), dtype=dtype)  # poison
    nm.batch_norm(m, x, g, b, mu, var, eps, training, momentum, out=out)
    return out


def check_case(m, shape, dtype, training, rng, offset=0.0, momentum=0.1, eps=1e-5,
               x_tensor=None, a=None):
    C = shape[1]
    if x_tensor is None:
        x_tensor, a = to_dev(m, rng.standard_normal(shape) * 2 + offset, dtype)
    tensors = params(m, C, dtype, rng)
    (_, g), (_, b), (_, mu), (_, var) = tensors
    out = run(m, x_tensor, tensors, eps, training, momentum, dtype)
    y, rm, rv, bm, bv = reference(a, g, b, mu, var, eps, training, momentum)
    what = f"{shape} {dtype.name_str} training={training} offset={offset}"
    rtol = TRAIN_RTOL[dtype] if training else RTOL[dtype]
    check_output(m.to_numpy(out), a, g, b, bm, bv, eps, rtol, dtype, what)
    got_rm = m.to_numpy(tensors[2][0]).astype(np.float64)
    got_rv = m.to_numpy(tensors[3][0]).astype(np.float64)
    if training:
        stat_tol = {DT.FLOAT32: 1e-5, DT.FLOAT64: 1e-12, DT.FLOAT16: 2e-3,
                    DT.BFLOAT16: 1e-2}[dtype]
        np.testing.assert_allclose(got_rm, rm, rtol=stat_tol, atol=stat_tol * (1 + abs(offset)),
                                   err_msg=what)
        np.testing.assert_allclose(got_rv, rv, rtol=stat_tol * (10 if offset else 1),
                                   err_msg=what)
    else:  # inference leaves the running statistics alone
        np.testing.assert_array_equal(got_rm, mu, err_msg=what)
        np.testing.assert_array_equal(got_rv, var, err_msg=what)
    out.free()
    for t, _ in tensors:
        t.free()


# -- GPU -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("training", [False, True], ids=["infer", "train"])
def test_matches_numpy(m, dtype, training):
    rng = np.random.default_rng()
    for shape in SHAPES:
        if training and shape[0] * int(np.prod(shape[2:])) <= 1:
            continue
        check_case(m, shape, dtype, training, rng, momentum=float(rng.uniform(0.05, 0.5)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT64], ids=lambda d: d.name_str)
@pytest.mark.parametrize("shape", [(4096, 16), (8, 6, 40, 40), (5, 12, 7)])
def test_training_far_from_zero_mean(m, dtype, shape):
    """mean 100 * std: the shifted sums keep the variance precise (a plain sum of squares in
    float32 would lose it)."""
    check_case(m, shape, dtype, True, np.random.default_rng(), offset=200.0)


@pytest.mark.gpu
@pytest.mark.parametrize("training", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("shape", [(8192, 4096), (32, 64, 32, 32)])
def test_large_float32(m, shape, training):
    check_case(m, shape, DT.FLOAT32, training, np.random.default_rng())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_misaligned_input(m, dtype):
    """x one element past a 16-byte boundary: the scalar paths give the same result."""
    rng = np.random.default_rng()
    for shape in [(6, 16), (3, 4, 8, 8)]:
        n = int(np.prod(shape))
        base, b = to_dev(m, rng.standard_normal(n + 1), dtype)
        x = CudaTensor(shape, dtype, base.device_id, base.ptr + dtype.itemsize, owner=base)
        for training in (False, True):
            check_case(m, shape, dtype, training, rng, x_tensor=x, a=b[1:].reshape(shape))
        base.free()


@pytest.mark.gpu
@settings(max_examples=examples(40), deadline=None)
@given(n=st.integers(1, 9), c=st.integers(1, 24),
       spatial=st.lists(st.integers(1, 12), min_size=0, max_size=2),
       training=st.booleans(), dtype=st.sampled_from(FLOATS),
       momentum=st.floats(0.0, 1.0), eps=st.sampled_from([1e-5, 1e-3, 0.1]))
def test_property(m, n, c, spatial, training, dtype, momentum, eps):
    shape = (n, c, *spatial)
    if training and n * int(np.prod(spatial)) <= 1:
        return  # covered by test_errors
    check_case(m, shape, dtype, training, np.random.default_rng(), momentum=momentum, eps=eps)


# -- any mode (fallback here) ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_api_inference_and_training(m, dtype):
    """CudaML.batch_norm (the seed's signature, then training=True with in-place running
    statistics) against the reference."""
    ml = CudaML(m)
    rng = np.random.default_rng()
    for shape in [(3, 5), (2, 3, 5, 7)]:
        x, a = to_dev(m, rng.standard_normal(shape) + 0.3, dtype)
        tensors = params(m, shape[1], dtype, rng)
        (gt, g), (bt, b), (mt, mu), (vt, var) = tensors
        y = ml.batch_norm(x, gt, bt, mt, vt, eps=1e-5)
        check_output(m.to_numpy(y), a, g, b, mu, var, 1e-5, RTOL[dtype], dtype, "infer")
        y = ml.batch_norm(x, gt, bt, mt, vt, eps=1e-5, training=True, momentum=0.2)
        _, rm, rv, bm, bv = reference(a, g, b, mu, var, 1e-5, True, 0.2)
        check_output(m.to_numpy(y), a, g, b, bm, bv, 1e-5, TRAIN_RTOL[dtype], dtype, "train")
        tol = 1e-5 if dtype in (DT.FLOAT32, DT.FLOAT64) else 1e-2
        np.testing.assert_allclose(m.to_numpy(mt), rm, rtol=tol, atol=tol)
        np.testing.assert_allclose(m.to_numpy(vt), rv, rtol=tol, atol=tol)


def test_zero_size(m):
    for shape in [(0, 3), (4, 0), (0, 3, 4, 4), (2, 3, 0, 4)]:
        x = m.from_numpy(np.ones(shape, np.float32))
        C = shape[1]
        ts = [m.from_numpy(np.ones(C, np.float32)) for _ in range(4)]
        y = nm.batch_norm(m, x, *ts)
        assert y.shape == shape


def test_errors(m):
    rng = np.random.default_rng()
    x = m.from_numpy(rng.standard_normal((4, 3, 2, 2)).astype(np.float32))
    ok = [m.from_numpy(np.ones(3, np.float32)) for _ in range(4)]
    bad = m.from_numpy(np.ones(4, np.float32))
    for i, name in enumerate(["gamma", "beta", "mean", "var"]):
        args = list(ok)
        args[i] = bad
        with pytest.raises(cb.ShapeMismatchError,
                           match=rf"{name} has shape \(4,\).*\(3,\).*\(4, 3, 2, 2\)"):
            nm.batch_norm(m, x, *args)
    with pytest.raises(cb.InvalidArgumentError, match=r"\(4,\)"):
        nm.batch_norm(m, m.from_numpy(np.ones(4, np.float32)), *ok)
    with pytest.raises(cb.InvalidArgumentError, match=r"\(1, 3, 1, 1, 1\)"):
        nm.batch_norm(m, m.from_numpy(np.ones((1, 3, 1, 1, 1), np.float32)), *ok)
    g64 = m.from_numpy(np.ones(3, np.float64))
    with pytest.raises(cb.DTypeMismatchError, match="float32 and float64"):
        nm.batch_norm(m, x, g64, *ok[1:])
    xi = m.from_numpy(np.ones((2, 3), np.int32))
    with pytest.raises(cb.DTypeMismatchError, match="int32"):
        nm.batch_norm(m, xi, *ok)
    one = m.from_numpy(np.ones((1, 3), np.float32))
    with pytest.raises(cb.InvalidArgumentError, match="more than 1 value per channel"):
        nm.batch_norm(m, one, *ok, training=True)
    with pytest.raises(cb.InvalidArgumentError, match="eps"):
        nm.batch_norm(m, x, *ok, eps=-1.0)
    with pytest.raises(cb.InvalidArgumentError, match="momentum"):
        nm.batch_norm(m, x, *ok, momentum=float("nan"), training=True)
    with pytest.raises(cb.InvalidArgumentError, match="CudaTensor"):
        nm.batch_norm(m, x, np.ones(3), *ok[1:])
    pool = m.backend.memory_pools[x.device_id]
    before = pool.get_stats()["active_blocks"]
    with pytest.raises(cb.ShapeMismatchError):
        nm.batch_norm(m, x, bad, *ok[1:], training=True)
    assert pool.get_stats()["active_blocks"] == before


def test_template_variants():
    v = nm.template_variants()["batch_norm.cu.j2"]
    assert len(v) == 28
    kinds = {(p["kernel"], p.get("layout"), p.get("mode")) for p in v}
    assert ("finalize", None, None) in kinds and ("normalize", "ncs", "train") in kinds


class _FakeGpuBackend:
    """Records launches instead of running them: every launch must pack with its kernel's
    parameter format, fit the grid limits and use exactly the template's block size."""

    is_available = True

    def __init__(self):
        self.next_ptr = 1 << 20
        self.kernels = {}
        self.launches = []

    def empty(self, shape, dtype, device_id=0):
        t = CudaTensor(tuple(shape), DT.from_any(dtype), 0, self.next_ptr)
        self.next_ptr += (t.nbytes // 256 + 2) * 256
        return t

    def get_device_info(self, device_id):
        return types.SimpleNamespace(multiprocessor_count=132)

    def copy_device_to_device(self, *args, **kwargs):
        return 0.0

    def launch_kernel(self, name, grid, *args, block_size=(256, 1, 1), shared_mem=0,
                      device_id=0):
        k = self.kernels[name]
        values = [a.ptr if isinstance(a, CudaTensor) else a for a in args]
        assert len(values) == len(k.fmt), (k.template, k.params, len(values), k.fmt)
        struct.pack("".join("Q" if c == "P" else c for c in k.fmt), *values)
        g, b = normalize_dims(grid, "grid"), normalize_dims(block_size, "block")
        assert g[0] < 2**31 and g[1] <= 65535 and g[2] <= 65535, (k.template, g)
        assert b[0] * b[1] * b[2] == k.block, (k.template, k.params, b)
        self.launches.append((k.template, k.params, g, b, values))
        return 0.0


class _FakeGpuMath:
    gpu = True

    def __init__(self):
        self.backend = _FakeGpuBackend()
        self.generator = KernelGenerator(backend=object())
        self.autotuner = types.SimpleNamespace(
            pick=lambda op, size_class, cands, run, device_id=0: [run(c) for c in cands]
            and dict(cands[0]))

    def kernel(self, template, device_id, **params):
        name, src = self.generator.render_kernel(template, **dict(params))
        k = types.SimpleNamespace(
            name=name, template=template, params=params,
            fmt=arg_format(src, name, kernel_signature(src, name)),
            block=int(re.search(r"#define BLOCK (\d+)", src).group(1)))
        self.backend.kernels[name] = k
        return k

    def fill(self, tensor, value):
        return tensor


def test_gpu_launch_paths_pack_their_arguments():
    """The GPU branch of every part-A op (pooling, batch/layer norm, dropout, optimizers) runs
    against a recording backend: argument counts and types match each kernel's signature,
    block sizes match the templates, grids fit. Catches launch bugs without a GPU."""
    m = _FakeGpuMath()
    B = m.backend
    for dt in FLOATS:
        for shape, k, s, p in [((32, 64, 128, 128), 2, None, 0), ((2, 3, 17, 19), 3, 2, 1),
                               ((2, 2, 8, 12), 2, 2, 0)]:
            for kind in ("max", "avg"):
                pooling.pool2d(m, kind, B.empty(shape, dt), k, s, p)
        for shape in [(8192, 4096), (3, 5), (1000, 7), (32, 64, 16, 16), (6, 64, 3, 3),
                      (2, 8, 4), (1, 1, 1, 1)]:
            ps = [B.empty((shape[1],), dt) for _ in range(4)]
            nm.batch_norm(m, B.empty(shape, dt), *ps)
            if shape[0] * int(np.prod(shape[2:])) > 1:
                nm.batch_norm(m, B.empty(shape, dt), *ps, training=True)
        for D in [1, 5, 128, 1000, 4096, 4097, 40000, 1 << 20]:
            nm.layer_norm(m, B.empty((64, D), dt), B.empty((D,), dt), None)
        for n in [1, 5, 1 << 24]:
            dr.dropout(m, B.empty((n,), dt), 0.5, 2**64 - 1, True)
            sdt = opt.state_dtype(dt)
            p = B.empty((n,), dt)
            opt.sgd_update(m, p, B.empty((n,), dt), B.empty((n,), sdt),
                           OptimizerState(learning_rate=0.1, nesterov=True))
            opt.sgd_update(m, p, B.empty((n,), dt), None, OptimizerState(learning_rate=0.1))
            opt.adam_update(m, p, B.empty((n,), dt), B.empty((n,), sdt), B.empty((n,), sdt),
                            OptimizerState(learning_rate=0.1, decoupled=True))
    templates = {t for t, *_ in B.launches}
    assert templates == {"pool2d.cu.j2", "batch_norm.cu.j2", "layer_norm.cu.j2",
                         "dropout.cu.j2", "optimizers.cu.j2"}
    # both pooling kernels, all batch-norm kernels and layouts, register and looping LN
    assert {p["window"] for t, p, *_ in B.launches if t == "pool2d.cu.j2"} == {0, 2}
    assert {(p["kernel"], p.get("layout"), p.get("mode")) for t, p, *_ in B.launches
            if t == "batch_norm.cu.j2"} == {
        ("normalize", "nc", "infer"), ("normalize", "nc", "train"), ("stats", "nc", None),
        ("normalize", "ncs", "infer"), ("normalize", "ncs", "train"), ("stats", "ncs", None),
        ("finalize", None, None)}
    assert {p["vpt"] == 0 for t, p, *_ in B.launches if t == "layer_norm.cu.j2"} == {0, 1}
