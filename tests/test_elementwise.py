"""Elementwise ops (binary with broadcasting, unary and activations, fill, copy) against a
float64 NumPy reference.

Every test runs twice through the `m` fixture: on the GPU (marked `gpu`, skipped without
one) and in fallback mode (CPU, skipped in a process that has a GPU). Outputs are poisoned
(NaN, or a sentinel for ints) through the ops' `out=` argument before the kernel runs.
"""
from __future__ import annotations

import itertools
import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

from cuda_backend import (CudaDataType as DT, CudaTensor, DeviceMismatchError,
                          DTypeMismatchError, InvalidArgumentError, ShapeMismatchError,
                          TensorFreedError, from_bfloat16_bits, to_bfloat16_bits)
from cuda_backend.driver import load_driver
from cuda_backend.ops import elementwise as ew, elementwise_broadcast as ewb

FLOATS = [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16]
INTS = [DT.INT32, DT.INT64]
SIZES = [1, 7, 13, 1023, 1025, 4097, 2**20 + 3]
BINARY = list(ew.BINARY_OPS)
UNARY = list(ew.UNARY_OPS)
TRANSCENDENTAL = {"exp", "log", "tanh", "sigmoid", "silu", "gelu", "gelu_exact", "elu",
                  "power"}

needs_fallback = pytest.mark.skipif(
    load_driver()[0] is not None,
    reason="this process has a GPU: the fallback variant runs only without one")


@pytest.fixture(scope="module", params=[pytest.param("gpu", marks=pytest.mark.gpu),
                                        pytest.param("cpu", marks=needs_fallback)])
def m(request, backend):
    from cuda_backend.cuda_math import CudaMath
    math_ = CudaMath(backend)
    assert math_.gpu == (request.param == "gpu")
    ew.precompile(math_, 0, workers=16)   # all kernels in parallel: first calls stay fast
    return math_


# -- helpers --------------------------------------------------------------------------------
def tol(dtype: DT, op: str = "") -> dict:
    if dtype is DT.FLOAT64:
        return dict(rtol=1e-12, atol=1e-300)
    if dtype is DT.FLOAT32:
        return dict(rtol=1e-5 if op in TRANSCENDENTAL else 1e-6, atol=1e-30)
    if dtype is DT.FLOAT16:
        return dict(rtol=1e-2, atol=1e-5)
    if dtype is DT.BFLOAT16:
        return dict(rtol=1e-2, atol=1e-30)
    return dict(rtol=0, atol=0)


def make(m, values, dtype: DT, device_id: int = 0):
    """(tensor, its exact stored values as float64 or int64)."""
    t = m.from_numpy(np.asarray(values), dtype=dtype, device_id=device_id)
    return t, stored(m, t)


def stored(m, t: CudaTensor) -> np.ndarray:
    a = m.to_numpy(t)
    return a.astype(np.float64 if t.dtype.is_floating else np.int64)


def poison(m, t: CudaTensor) -> CudaTensor:
    """Fill t with NaN (floats) or a sentinel (ints) by a host copy; returns t."""
    if t.size:
        dtype = t.dtype
        if dtype is DT.BFLOAT16:
            host = np.full(t.shape, 0x7FC0, np.uint16)
        elif dtype.is_floating:
            host = np.full(t.shape, np.nan, dtype.numpy_dtype)
        elif dtype is DT.BOOL:
            host = np.zeros(t.shape, np.bool_)
        else:
            host = np.full(t.shape, np.iinfo(dtype.numpy_dtype).max - 3, dtype.numpy_dtype)
        m.backend.copy_to_device(host, t)
    return t


def poisoned(m, shape, dtype: DT) -> CudaTensor:
    return poison(m, m.create_tensor(shape, dtype))


def rand(rng, shape, dtype: DT, kind: str = "normal") -> np.ndarray:
    if not dtype.is_floating:
        return rng.integers(-1000, 1000, size=shape).astype(dtype.numpy_dtype)
    x = rng.standard_normal(shape)
    if kind == "positive":
        return np.abs(x) + 0.05
    if kind == "denominator":
        return np.where(x < 0, -1.0, 1.0) * (0.5 + np.abs(x))
    if kind == "base":
        return 0.5 + 2 * rng.random(shape)
    if kind == "exponent":
        return 3 * rng.uniform(-1, 1, shape)
    if kind == "wide":
        return 3 * x
    return x


def operand_kinds(op: str):
    return {"divide": ("normal", "denominator"), "power": ("base", "exponent")}.get(
        op, ("normal", "normal"))


def check(out: np.ndarray, ref: np.ndarray, dtype: DT, op: str = "") -> None:
    assert out.shape == ref.shape
    if dtype.is_floating:
        np.testing.assert_allclose(out.astype(np.float64), ref, **tol(dtype, op))
    else:
        np.testing.assert_array_equal(out, ref.astype(dtype.numpy_dtype))


def ref_binary(op: str, x, y):
    with np.errstate(all="ignore"):
        return {"add": np.add, "subtract": np.subtract, "multiply": np.multiply,
                "divide": np.divide, "maximum": np.maximum, "minimum": np.minimum,
                "power": np.power}[op](x, y)


_erfc = np.frompyfunc(math.erfc, 1, 1)


def ref_unary(op: str, x: np.ndarray, alpha: float = 0.0) -> np.ndarray:
    with np.errstate(all="ignore"):
        if op == "relu":
            return np.where(x < 0, 0.0, x) if x.dtype.kind == "f" else np.maximum(x, 0)
        if op == "sigmoid":
            return 1 / (1 + np.exp(-x))
        if op == "silu":
            return x / (1 + np.exp(-x))
        if op == "gelu":   # 0.5 x (1 + tanh z) = x sigmoid(2z), without the cancellation
            z = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
            return x / (1 + np.exp(-2 * z))
        if op == "gelu_exact":
            return 0.5 * x * np.asarray(_erfc(-x / math.sqrt(2)), dtype=np.float64)
        if op == "leaky_relu":
            return np.where(x > 0, x, alpha * x)
        if op == "elu":
            return np.where(x > 0, x, alpha * np.expm1(x))
        return {"exp": np.exp, "log": np.log, "sqrt": np.sqrt, "abs": np.abs,
                "tanh": np.tanh, "negative": np.negative}[op](x)


def binary_cases():
    for op, dtypes in ew.BINARY_OPS.items():
        for dt in dtypes:
            yield op, dt


def unary_cases():
    for op, (dtypes, _) in ew.UNARY_OPS.items():
        for dt in dtypes:
            yield op, dt


def scalar_for(op: str, dtype: DT, side: str):
    if not dtype.is_floating:
        return 7
    if op == "power":
        return 2.5 if side == "right" else 1.5
    if op == "divide" and side == "right":
        return 3.0
    return 1.7


# -- binary ---------------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("op, dtype", list(binary_cases()),
                         ids=[f"{o}-{d.name_str}" for o, d in binary_cases()])
def test_binary_same_shape_and_scalars(m, op, dtype, size):
    rng = np.random.default_rng(1566)
    ka, kb = operand_kinds(op)
    a, xa = make(m, rand(rng, size, dtype, ka), dtype)
    b, xb = make(m, rand(rng, size, dtype, kb), dtype)
    out = poisoned(m, (size,), dtype)
    assert ew.binary(m, op, a, b, out=out) is out
    check(stored(m, out), ref_binary(op, xa, xb), dtype, op)
    # tensor op scalar, scalar op tensor; the scalar takes the tensor's dtype first
    for side in ("right", "left"):
        s = scalar_for(op, dtype, side)
        s_stored = stored(m, make(m, [s], dtype)[0])[0]
        out = poisoned(m, (size,), dtype)
        if side == "right":
            ew.binary(m, op, a, s, out=out)
            ref = ref_binary(op, xa, s_stored)
        else:
            ew.binary(m, op, s, b, out=out)
            ref = ref_binary(op, s_stored, xb)
        check(stored(m, out), ref, dtype, op)


BROADCAST_SHAPES = [
    ((4097, 64), (64,)),            # row broadcast (bias add), 16-byte vectors
    ((1025, 33), (33,)),            # row broadcast, odd rows: scalar path
    ((300, 8), (300, 1)),           # column broadcast
    ((7,), (5, 3, 1)),              # both sides broadcast
    ((1,), (1023,)),                # one-element tensor
    ((), (13,)),                    # 0-d tensor
    ((1, 129), (129,)),             # same elements: the contiguous path
    ((3, 1, 5, 1, 7, 1, 2), (1, 4, 1, 6, 1, 8, 2)),   # 7 dims after collapsing: > 6
    ((2, 3, 4, 5), (3, 1, 5)),
]


@pytest.mark.parametrize("op, dtype", list(binary_cases()),
                         ids=[f"{o}-{d.name_str}" for o, d in binary_cases()])
def test_binary_broadcast(m, op, dtype):
    rng = np.random.default_rng(9264)
    ka, kb = operand_kinds(op)
    for sa, sb in BROADCAST_SHAPES:
        for first, second in ((sa, sb), (sb, sa)):
            a, xa = make(m, rand(rng, first, dtype, ka), dtype)
            b, xb = make(m, rand(rng, second, dtype, kb), dtype)
            ref = ref_binary(op, xa, xb)
            out = poisoned(m, ref.shape, dtype)
            ew.binary(m, op, a, b, out=out)
            check(stored(m, out), ref, dtype, op)


def test_public_api_binary(m):
    rng = np.random.default_rng(194)
    x = rng.standard_normal((37, 41)).astype(np.float32)
    y = rng.standard_normal(41).astype(np.float32)
    a, b = m.from_numpy(x), m.from_numpy(y)
    for name in BINARY:
        kb = operand_kinds(name)[1]
        yy = rand(rng, 41, DT.FLOAT32, kb).astype(np.float32)
        xx = np.abs(x) + 0.5 if name == "power" else x
        a, b = m.from_numpy(xx), m.from_numpy(yy)
        got = m.to_numpy(getattr(m, name)(a, b))
        check(got, ref_binary(name, xx.astype(np.float64), yy.astype(np.float64)),
              DT.FLOAT32, name)
    v = m.vector_add(m.from_numpy(x), m.from_numpy(x))
    np.testing.assert_array_equal(m.to_numpy(v), x + x)
    with pytest.raises(ShapeMismatchError):
        m.vector_add(m.from_numpy(x), m.from_numpy(y))
    # scalars in both orders, Python and NumPy scalars
    a = m.from_numpy(x)
    np.testing.assert_allclose(m.to_numpy(m.subtract(2, a)), 2 - x, rtol=1e-6)
    np.testing.assert_allclose(m.to_numpy(m.divide(a, 3)), x / np.float32(3), rtol=1e-6)
    np.testing.assert_allclose(m.to_numpy(m.multiply(np.float64(0.5), a)), 0.5 * x)
    np.testing.assert_allclose(m.to_numpy(m.add(a, True)), x + 1)


@pytest.mark.parametrize("dtype", INTS)
def test_int_semantics(m, dtype):
    info = np.iinfo(dtype.numpy_dtype)
    x = np.array([info.max, info.min, -5, 0, 5, info.max - 1, info.min + 1], dtype.numpy_dtype)
    y = np.array([1, -1, 3, 0, -7, 5, 2], dtype.numpy_dtype)
    a, b = m.from_numpy(x), m.from_numpy(y)
    with np.errstate(all="ignore"):
        for op in ("add", "subtract", "multiply", "maximum", "minimum"):
            got = m.to_numpy(ew.binary(m, op, a, b))
            np.testing.assert_array_equal(got, ref_binary(op, x, y), err_msg=op)  # wraps
        np.testing.assert_array_equal(m.to_numpy(m.negative(a)), np.negative(x))
        np.testing.assert_array_equal(m.to_numpy(m.abs(a)), np.abs(x))
    got = m.to_numpy(m.multiply(a, 2.0))          # an integral float is fine
    np.testing.assert_array_equal(got, (x.astype(np.int64) * 2).astype(dtype.numpy_dtype))
    with pytest.raises(DTypeMismatchError, match="not an integer"):
        m.add(a, 2.5)
    if dtype is DT.INT32:
        with pytest.raises(InvalidArgumentError, match="out of range"):
            m.add(a, 2**40)
    for op in ("divide", "power"):
        with pytest.raises(DTypeMismatchError, match=op):
            ew.binary(m, op, a, b)


# -- unary ----------------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("op, dtype", list(unary_cases()),
                         ids=[f"{o}-{d.name_str}" for o, d in unary_cases()])
def test_unary(m, op, dtype, size):
    rng = np.random.default_rng(6240)
    # gelu's far negative tail is ill-conditioned (relative error grows like x^2) and exp
    # would overflow float16 there: those take standard normal inputs, the rest 3x wider.
    kind = "positive" if op in ("log", "sqrt") else \
        "normal" if op in ("exp", "gelu", "gelu_exact") else "wide"
    x, xv = make(m, rand(rng, size, dtype, kind), dtype)
    params = {}
    if op in ("leaky_relu", "elu"):
        params = {"alpha": 0.2 if op == "leaky_relu" else 1.3}
    out = poisoned(m, (size,), dtype)
    assert ew.unary(m, op, x, out=out, **params) is out
    alpha = stored(m, make(m, [params.get("alpha", 0.0)], dtype)[0])[0] if dtype.is_floating \
        else 0
    check(stored(m, out), ref_unary(op, xv, alpha), dtype, op)


def test_unary_default_params_and_public_api(m):
    rng = np.random.default_rng(6969)
    x = rng.standard_normal(1000).astype(np.float32) * 3
    t = m.from_numpy(x)
    xv = x.astype(np.float64)
    check(m.to_numpy(ew.unary(m, "leaky_relu", t)), ref_unary("leaky_relu", xv, 0.01),
          DT.FLOAT32, "elu")
    check(m.to_numpy(ew.unary(m, "elu", t)), ref_unary("elu", xv, 1.0), DT.FLOAT32, "elu")
    for name in ("exp", "tanh", "abs", "negative", "relu", "sigmoid"):
        check(m.to_numpy(getattr(m, name)(t)), ref_unary(name, xv), DT.FLOAT32, name)
    p, pv = make(m, np.abs(x) + 0.1, DT.FLOAT32)
    for name in ("log", "sqrt"):
        check(m.to_numpy(getattr(m, name)(p)), ref_unary(name, pv), DT.FLOAT32, name)
    with pytest.raises(InvalidArgumentError, match="unexpected parameter"):
        ew.unary(m, "relu", t, alpha=0.5)
    with pytest.raises(InvalidArgumentError, match="unknown unary op"):
        ew.unary(m, "cosh", t)
    with pytest.raises(InvalidArgumentError, match="unknown binary op"):
        ew.binary(m, "hypot", t, t)


# -- large ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.BFLOAT16])
def test_large_add_and_exp(m, dtype):
    rows = 2**16 if m.gpu else 2**8     # the fallback (NumPy) variant stays quick
    n = rows * 1024 + 5
    rng = np.random.default_rng(9576)
    a, xa = make(m, rng.standard_normal(n, dtype=np.float32), dtype)
    b, xb = make(m, rng.standard_normal(n, dtype=np.float32), dtype)
    out = poisoned(m, (n,), dtype)
    ew.binary(m, "add", a, b, out=out)
    check(stored(m, out), xa + xb, dtype, "add")
    ew.unary(m, "exp", a, out=out)
    check(stored(m, out), np.exp(xa), dtype, "exp")
    # row broadcast at size: (rows, 1024) + (1024,)
    c, xc = make(m, rng.standard_normal(1024, dtype=np.float32), dtype)
    a2 = CudaTensor((rows, 1024), dtype, a.device_id, a.ptr, owner=a)   # a view of a
    out2 = CudaTensor((rows, 1024), dtype, out.device_id, out.ptr, owner=out)
    poison(m, out2)
    ew.binary(m, "add", a2, c, out=out2)
    check(stored(m, out2), xa[:rows * 1024].reshape(rows, 1024) + xc, dtype, "add")
    for t in (a, b, c, out):
        t.free()


# -- alignment ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT16, DT.FLOAT64, DT.INT64])
def test_unaligned_views(m, dtype):
    """Views at element offsets that are not 16-byte aligned take the scalar path."""
    rng = np.random.default_rng(4132)
    n = 4099
    base_a, xa = make(m, rand(rng, n + 3, dtype), dtype)
    base_b, xb = make(m, rand(rng, n + 3, dtype), dtype)
    base_o = m.create_tensor((n + 3,), dtype)
    isz = dtype.itemsize
    for oa, ob, oo in ((1, 1, 1), (1, 0, 0), (0, 0, 1), (2, 3, 1)):
        a = CudaTensor((n,), dtype, base_a.device_id, base_a.ptr + oa * isz, owner=base_a)
        b = CudaTensor((n,), dtype, base_b.device_id, base_b.ptr + ob * isz, owner=base_b)
        out = CudaTensor((n,), dtype, base_o.device_id, base_o.ptr + oo * isz, owner=base_o)
        poison(m, out)
        ew.binary(m, "add", a, b, out=out)
        check(stored(m, out), xa[oa:oa + n] + xb[ob:ob + n], dtype, "add")
        ew.binary(m, "multiply", a, 3, out=out)
        check(stored(m, out), xa[oa:oa + n] * 3, dtype, "multiply")
        ew.unary(m, "negative", a, out=out)
        check(stored(m, out), -xa[oa:oa + n], dtype, "negative")
        # broadcast with an unaligned row operand: (n // 4, 4) + (4,) at odd offsets
        rows = n // 4
        a2 = CudaTensor((rows, 4), dtype, a.device_id, a.ptr, owner=a)
        o2 = CudaTensor((rows, 4), dtype, out.device_id, out.ptr, owner=out)
        b2 = CudaTensor((4,), dtype, b.device_id, b.ptr, owner=b)
        ew.binary(m, "subtract", a2, b2, out=o2)
        check(stored(m, o2), xa[oa:oa + rows * 4].reshape(rows, 4) - xb[ob:ob + 4], dtype,
              "subtract")
        copied = m.copy(a)
        np.testing.assert_array_equal(stored(m, copied), xa[oa:oa + n])


# -- NaN, Inf -------------------------------------------------------------------------------
SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 2.5, -3.0, np.nan, 0.5])


@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_inf_like_numpy(m, dtype):
    n = SPECIAL.size
    x = np.repeat(SPECIAL, n)          # every pair of special values
    y = np.tile(SPECIAL, n)
    a, xa = make(m, x, dtype)
    b, xb = make(m, y, dtype)
    for op in ("add", "subtract", "multiply", "divide", "maximum", "minimum", "power"):
        got = stored(m, ew.binary(m, op, a, b))
        ref = ref_binary(op, xa, xb)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=op)
        fin = ~np.isnan(ref)
        np.testing.assert_allclose(got[fin], ref[fin], rtol=tol(dtype, op)["rtol"],
                                   err_msg=op)
        # and with a NaN scalar on either side (pow(1, nan) is 1, as in NumPy)
        for got, ref in ((stored(m, ew.binary(m, op, a, float("nan"))),
                          ref_binary(op, xa, np.nan)),
                         (stored(m, ew.binary(m, op, float("nan"), a)),
                          ref_binary(op, np.nan, xa))):
            np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=op)
    for op in ("exp", "log", "sqrt", "tanh", "abs", "negative", "relu", "sigmoid"):
        got = stored(m, ew.unary(m, op, a))
        ref = ref_unary(op, xa)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=op)
        fin = ~np.isnan(ref)
        np.testing.assert_allclose(got[fin], ref[fin], rtol=tol(dtype, op)["rtol"],
                                   atol=1e-30, err_msg=op)
    neg = stored(m, m.log(m.from_numpy(np.array([-1.0, -0.5, -np.inf]), dtype=dtype)))
    assert np.isnan(neg).all()


# -- errors ---------------------------------------------------------------------------------
def test_errors(m):
    a = m.from_numpy(np.ones((3, 4), np.float32))
    b = m.from_numpy(np.ones((5,), np.float32))
    with pytest.raises(ShapeMismatchError, match=r"\(3, 4\).*\(5,\)"):
        m.add(a, b)
    with pytest.raises(ShapeMismatchError, match=r"\(5,\).*\(3, 4\)"):
        m.maximum(b, a)
    with pytest.raises(DTypeMismatchError, match="float32.*float64|float64.*float32"):
        m.add(a, m.from_numpy(np.ones((3, 4), np.float64)))
    i = m.from_numpy(np.ones(4, np.int32))
    for op in ("exp", "log", "sqrt", "tanh", "relu", "sigmoid", "gelu"):
        with pytest.raises(DTypeMismatchError, match="int32"):
            ew.unary(m, op, i)
    with pytest.raises(InvalidArgumentError, match="at least one CudaTensor"):
        m.add(1, 2)
    with pytest.raises(InvalidArgumentError, match="CudaTensor or a real number"):
        m.add(a, [1, 2])
    with pytest.raises(InvalidArgumentError):
        m.exp(np.ones(3))
    # a tensor that claims another device
    other = CudaTensor(a.shape, a.dtype, a.device_id + 1, a.ptr, owner=a)
    with pytest.raises(DeviceMismatchError, match=f"cuda:{a.device_id}.*cuda:{a.device_id + 1}"):
        m.add(a, other)
    # out= that does not fit
    with pytest.raises(ShapeMismatchError, match="out has shape"):
        ew.binary(m, "add", a, a, out=m.create_tensor((4, 3)))
    with pytest.raises(DTypeMismatchError, match="out has dtype"):
        ew.unary(m, "exp", a, out=m.create_tensor((3, 4), DT.FLOAT64))
    # freed operands
    c = m.from_numpy(np.ones((3, 4), np.float32))
    c.free()
    for call in (lambda: m.add(a, c), lambda: m.add(c, 1.0), lambda: m.exp(c),
                 lambda: m.fill(c, 1.0), lambda: m.copy(c), lambda: m.subtract(2, c)):
        with pytest.raises(TensorFreedError):
            call()


def test_errors_leak_no_memory(m):
    a = m.from_numpy(np.ones((3, 4), np.float32))
    b = m.from_numpy(np.ones((5,), np.float32))
    i = m.from_numpy(np.ones((3, 4), np.int32))
    pool = m.backend.memory_pools[a.device_id]
    before = pool.get_stats()["active_memory"]
    bad = [lambda: m.add(a, b), lambda: m.add(a, i), lambda: m.exp(i),
           lambda: m.divide(i, i), lambda: m.add(i, 0.5), lambda: m.add(a, "x")]
    for call in bad:
        with pytest.raises((ShapeMismatchError, DTypeMismatchError, InvalidArgumentError)):
            call()
    assert pool.get_stats()["active_memory"] == before


def test_zero_size_no_launch(m, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a zero-size op launched a kernel")

    monkeypatch.setattr(m.backend, "launch_kernel", no_launch)
    for dtype in (DT.FLOAT32, DT.BFLOAT16, DT.INT64):
        z = m.create_tensor((0,), dtype)
        z2 = m.create_tensor((3, 0), dtype)
        one = m.from_numpy(np.ones((1,), np.float32), dtype=dtype)
        assert m.add(z, z).shape == (0,)
        assert m.multiply(z2, one).shape == (3, 0)
        assert m.subtract(one, m.create_tensor((2, 0, 1), dtype)).shape == (2, 0, 1)
        assert m.maximum(z2, 2).shape == (3, 0)
        assert m.negative(z2).shape == (3, 0)
        assert m.fill(z2, 1) is z2
        assert m.copy(z2).shape == (3, 0)
    assert ew.unary(m, "exp", m.create_tensor((0, 5))).shape == (0, 5)
    assert ew.binary(m, "add", m.create_tensor((2, 0)), m.create_tensor((1,))).shape == (2, 0)


# -- fill and copy --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS + INTS + [DT.UINT8, DT.BOOL])
@pytest.mark.parametrize("size", [1, 1025, 2**20 + 3])
def test_fill_and_copy(m, dtype, size):
    t = poisoned(m, (size,), dtype) if dtype is not DT.BOOL else m.create_tensor(size, dtype)
    value = {DT.UINT8: 200, DT.BOOL: True, DT.INT32: -7, DT.INT64: 2**40}.get(dtype, 1.1)
    assert m.fill(t, value) is t
    got = m.to_numpy(t)
    if dtype is DT.BFLOAT16:
        want = from_bfloat16_bits(to_bfloat16_bits(np.array([value], np.float32)))[0]
    elif dtype is DT.BOOL:
        want = True
    else:
        want = dtype.numpy_dtype.type(value)
    assert (got == want).all()
    assert (m.to_numpy(m.zeros(size, dtype)) == 0).all()
    assert (m.to_numpy(m.ones(size, dtype)) == 1).all()
    rng = np.random.default_rng(4225)
    src = m.from_numpy(rng.integers(0, 2, size).astype(np.bool_)) if dtype is DT.BOOL \
        else make(m, rand(rng, size, dtype), dtype)[0]
    c = m.copy(src)
    assert c.ptr != src.ptr and c.shape == src.shape and c.dtype is src.dtype
    np.testing.assert_array_equal(m.to_numpy(c), m.to_numpy(src))
    if dtype in INTS:
        with pytest.raises(DTypeMismatchError, match="not an integer"):
            m.fill(t, 0.5)


@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT16, DT.FLOAT64, DT.UINT8, DT.INT64])
def test_fill_views_at_every_offset_touch_only_the_view(m, dtype):
    """fill.cu.j2 stores 16-byte vectors where the view is 16-byte aligned, elements
    elsewhere, and the last n % vec elements by the first block's threads: views at each
    element offset within a vector and lengths around the vector and block sizes fill
    exactly their own elements (the base's others keep their values)."""
    rng = np.random.default_rng(4227)
    vec = 16 // dtype.itemsize
    isz = dtype.itemsize
    for n in (1, vec - 1, vec + 1, 256 * vec - 1, 256 * vec + vec + 3, 3 * 256 * vec + 5):
        for off in sorted({0, 1, vec // 2, vec - 1}):
            total = n + off + vec
            vals = rng.integers(0, 100, total).astype(dtype.numpy_dtype)
            base = m.from_numpy(vals)
            view = CudaTensor((n,), dtype, base.device_id, base.ptr + off * isz, owner=base)
            assert m.fill(view, 7) is view
            want = vals.copy()
            want[off:off + n] = 7
            np.testing.assert_array_equal(m.to_numpy(base), want, err_msg=f"n={n} off={off}")
            base.free()


# -- memoized kernels -----------------------------------------------------------------------
def test_repeat_calls_do_not_render_again(m, monkeypatch):
    a = m.from_numpy(np.ones(1024, np.float32))
    m.add(a, a)
    m.exp(a)

    def no_render(*args, **kwargs):
        raise AssertionError("kernel looked up through the generator again")

    monkeypatch.setattr(m, "kernel", no_render)
    for _ in range(3):
        np.testing.assert_array_equal(m.to_numpy(m.add(a, a)), 2)
        np.testing.assert_allclose(m.to_numpy(m.exp(a)), np.e, rtol=1e-6)


# -- property test --------------------------------------------------------------------------
@st.composite
def broadcast_pair(draw):
    out = draw(st.lists(st.integers(1, 9), min_size=0, max_size=5))
    shapes = []
    for _ in range(2):
        drop = draw(st.integers(0, len(out)))
        s = [d if draw(st.booleans()) else 1 for d in out[drop:]]
        shapes.append(tuple(s))
    return tuple(shapes)


@settings(max_examples=examples(60), deadline=None)
@given(pair=broadcast_pair(), dtype=st.sampled_from(FLOATS + INTS),
       op=st.sampled_from(BINARY), seed=st.integers(0, 2**32 - 1))
def test_property_broadcast(m, pair, dtype, op, seed):
    if dtype not in ew.BINARY_OPS[op]:
        op = "add"
    rng = np.random.default_rng(seed)
    ka, kb = operand_kinds(op)
    a, xa = make(m, rand(rng, pair[0], dtype, ka), dtype)
    b, xb = make(m, rand(rng, pair[1], dtype, kb), dtype)
    ref = ref_binary(op, xa, xb)
    out = poisoned(m, ref.shape, dtype)
    ew.binary(m, op, a, b, out=out)
    check(stored(m, out), ref, dtype, op)


# -- the broadcast launch plan, checked on the CPU by emulating the kernel's indexing -------
def emulate_plan(plan, itemsize, bases, a_flat, b_flat, out_size):
    """Run the broadcast kernel's index math in NumPy for every launch of a plan, with out, a
    and b at the byte addresses `bases`; checks the alignment that vectorized launches
    promise, and that every output element is written exactly once."""
    vec = 16 // itemsize
    out = np.full(out_size, np.nan)
    written = np.zeros(out_size, np.int64)
    for (po, pa, pb, n, ndim, vectorize, *rest) in plan:
        sizes, sa, sb = rest[0:6], rest[6:12], rest[12:18]
        assert 0 < n < ewb.LAUNCH_LIMIT and n == math.prod(sizes)
        assert all(s == 1 for s in sizes[ndim:]) and sa[0] in (0, 1) and sb[0] in (0, 1)
        i = np.arange(n, dtype=np.int64)
        oa = np.zeros(n, np.int64)
        ob = np.zeros(n, np.int64)
        rem = i.copy()
        for d in range(ndim):
            c = rem % sizes[d] if d < ndim - 1 else rem
            rem = rem // sizes[d]
            oa += c * sa[d]
            ob += c * sb[d]
        if vectorize:   # 16-byte accesses at every vector start of out and running operands
            assert sizes[0] % vec == 0 and po % 16 == 0
            for p, s0, off in ((pa, sa[0], oa), (pb, sb[0], ob)):
                if s0:
                    assert ((p + off[::vec] * itemsize) % 16 == 0).all()
        ai = (pa - bases[1]) // itemsize + oa
        bi = (pb - bases[2]) // itemsize + ob
        oi = (po - bases[0]) // itemsize + i
        out[oi] = a_flat[ai] + b_flat[bi]
        written[oi] += 1
    assert (written == 1).all(), "every output element written exactly once"
    return out


@st.composite
def plan_case(draw):
    sa, sb = draw(broadcast_pair())
    itemsize = draw(st.sampled_from([2, 4, 8]))
    small = draw(st.booleans())      # tiny launch limits exercise the outer loop and chunks
    shifts = draw(st.tuples(*[st.sampled_from([0, 0, 1, 3])] * 3))   # unaligned bases
    return sa, sb, itemsize, small, shifts


@settings(max_examples=examples(300), deadline=None)
@given(case=plan_case())
def test_broadcast_plan_covers_every_element(case):
    sa, sb, itemsize, small, shifts = case
    out_shape = np.broadcast_shapes(sa, sb)
    dims = ewb.collapse(out_shape, sa, sb)
    if dims is None:       # same elements: the contiguous path
        assert math.prod(sa) == math.prod(sb) == math.prod(out_shape)
        return
    rng = np.random.default_rng(5035)
    xa = rng.standard_normal(sa)
    xb = rng.standard_normal(sb)
    limit, chunk = (64, 16) if small else (0, 0)
    bases = [(k << 40) + s * itemsize for k, s in zip((2, 0, 1), shifts)]
    plan = list(ewb.broadcast_plan(dims, itemsize, *bases, limit=limit, chunk=chunk))
    if small:
        for p in plan:
            assert p[3] < 64 or (p[4] == 1 and p[3] <= 16)
    got = emulate_plan(plan, itemsize, bases, xa.ravel(), xb.ravel(), math.prod(out_shape))
    np.testing.assert_array_equal(got.reshape(out_shape), xa + xb)


def test_broadcast_plan_bias_add_is_vectorized():
    dims = ewb.collapse((4097, 64), (4097, 64), (64,))
    assert dims == [(4097, 64, 0), (64, 1, 1)]
    plan = list(ewb.broadcast_plan(dims, 4, 0, 256, 1024))
    assert len(plan) == 1
    po, pa, pb, n, ndim, vectorize, *rest = plan[0]
    assert (n, ndim, vectorize) == (4097 * 64, 2, 1)
    assert rest[:2] == [64, 4097] and rest[6:8] == [1, 64] and rest[12:14] == [1, 0]
    # an unaligned row operand turns vectors off
    assert next(ewb.broadcast_plan(dims, 4, 0, 256, 1028))[5] == 0
    # more than 6 collapsed dims: the outer ones are looped over
    dims = ewb.collapse((3, 4, 5, 6, 7, 8, 2), (3, 1, 5, 1, 7, 1, 2), (1, 4, 1, 6, 1, 8, 2))
    assert len(dims) == 7
    plan = list(ewb.broadcast_plan(dims, 4, 0, 0, 0))
    assert len(plan) == 3 and all(p[4] == 6 for p in plan)


def test_broadcast_plan_cuts_huge_outputs_by_elements():
    """An output of 2^31 elements or more takes a few launches, each under the limit, however
    many rows it has (not one per row), and the plan is made lazily: host memory does not
    grow with the rows."""
    dims = ewb.collapse((1000, 7), (1000, 7), (7,))   # limit 64: runs of 9 rows or fewer
    plan = list(ewb.broadcast_plan(dims, 4, 0, 1 << 40, 2 << 40, limit=64, chunk=32))
    assert len(plan) == 112 and sum(p[3] for p in plan) == 7000
    assert all(p[3] < 64 and p[4] == 2 for p in plan)
    for shape, row, itemsize, vectors in (((2**21, 1024), (1024,), 2, True),
                                          ((2**30, 2), (2,), 4, False)):
        dims = ewb.collapse(shape, shape, row)
        tracemalloc.start()
        try:
            plan = list(itertools.islice(
                ewb.broadcast_plan(dims, itemsize, 0, 1 << 40, 2 << 40), 8))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 64 << 10
        assert len(plan) == 2 and all(p[3] < 2**31 and p[4] == 2 for p in plan)
        assert sum(p[3] for p in plan) == math.prod(shape)
        assert plan[1][0] == plan[0][0] + plan[0][3] * itemsize   # the runs are adjacent
        assert plan[0][1] == plan[1][1] - plan[0][3] * itemsize and plan[0][2] == plan[1][2]
        assert all(bool(p[5]) is vectors for p in plan)   # 16-byte accesses where rows allow


# Launch limit and row chunk forced small, so that small shapes take many launches: runs of
# rows, pieces of rows longer than the limit, more than 6 collapsed dims.
PLAN_LIMIT, PLAN_CHUNK = 50, 32
CHUNKED_SHAPES = [
    ((1000, 7), (7,)),
    ((37, 5, 3), (5, 1)),
    ((3, 130), (3, 1)),
    ((2, 1, 130), (4, 1)),
    ((6, 11, 13), (6, 1, 13)),
    ((129, 16), (16,)),
    ((3, 1, 5, 1, 7, 1, 2), (1, 4, 1, 6, 1, 8, 2)),
]


@pytest.mark.parametrize("sa, sb", CHUNKED_SHAPES, ids=str)
def test_broadcast_plan_forced_small_limit_matches_numpy(monkeypatch, sa, sb):
    """The plan under the module's (forced small) limit, its index math emulated in NumPy
    at aligned and unaligned bases: NumPy broadcasting, every launch under the limit, and
    up to 6 collapsed dims in fewer than 3 * elements / (limit - 1) + 1 launches."""
    monkeypatch.setattr(ewb, "LAUNCH_LIMIT", PLAN_LIMIT)
    monkeypatch.setattr(ewb, "CHUNK", PLAN_CHUNK)
    rng = np.random.default_rng(20240611)
    for first, second in ((sa, sb), (sb, sa)):
        out_shape = np.broadcast_shapes(first, second)
        total = math.prod(out_shape)
        dims = ewb.collapse(out_shape, first, second)
        xa, xb = rng.standard_normal(first), rng.standard_normal(second)
        for itemsize, shift in ((4, 0), (2, 0), (8, 1), (2, 3)):
            bases = [(2 << 40) + shift * itemsize, 0, 1 << 40]
            plan = list(ewb.broadcast_plan(dims, itemsize, *bases))
            if len(dims) <= ewb.MAX_BCAST_DIMS:
                assert len(plan) < 3 * total / (PLAN_LIMIT - 1) + 1
            got = emulate_plan(plan, itemsize, bases, xa.ravel(), xb.ravel(), total)
            np.testing.assert_array_equal(got.reshape(out_shape), xa + xb)


@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT16, DT.FLOAT64, DT.INT64],
                         ids=lambda d: d.name_str)
def test_broadcast_forced_small_launch_limit(m, monkeypatch, dtype):
    """Broadcast adds on odd shapes with the launch limit and row chunk forced small (each
    call many launches at pointer offsets) against NumPy, outputs poisoned."""
    monkeypatch.setattr(ewb, "LAUNCH_LIMIT", PLAN_LIMIT)
    monkeypatch.setattr(ewb, "CHUNK", PLAN_CHUNK)
    grids = []
    launch = m.backend.launch_kernel

    def counted(name, grid, *args, **kwargs):
        grids.append(grid)
        return launch(name, grid, *args, **kwargs)

    monkeypatch.setattr(m.backend, "launch_kernel", counted)
    rng = np.random.default_rng(7)
    for sa, sb in CHUNKED_SHAPES:
        for first, second in ((sa, sb), (sb, sa)):
            a, xa = make(m, rand(rng, first, dtype), dtype)
            b, xb = make(m, rand(rng, second, dtype), dtype)
            ref = ref_binary("add", xa, xb)
            out = poisoned(m, ref.shape, dtype)
            grids.clear()
            ew.binary(m, "add", a, b, out=out)
            check(stored(m, out), ref, dtype, "add")
            if m.gpu and len(ewb.collapse(ref.shape, first, second)) <= ewb.MAX_BCAST_DIMS:
                assert 1 < len(grids) < 3 * ref.size / (PLAN_LIMIT - 1) + 1


@settings(max_examples=examples(60), deadline=None)
@given(shape=st.lists(st.integers(0, 40), min_size=0, max_size=4),
       case=st.sampled_from(list(unary_cases())), seed=st.integers(0, 2**32 - 1),
       offset=st.sampled_from([0, 1, 3]))
def test_property_unary(m, shape, case, seed, offset):
    """Unary ops and activations on random shapes (0 and 1 included), every dtype they take,
    at 16-byte-aligned and unaligned starts, against float64 NumPy."""
    op, dtype = case
    rng = np.random.default_rng(seed)
    shape = tuple(shape)
    kind = "positive" if op in ("log", "sqrt") else \
        "normal" if op in ("exp", "gelu", "gelu_exact") else "wide"
    n = math.prod(shape)
    base, vals = make(m, rand(rng, n + offset, dtype, kind), dtype)
    x = CudaTensor(shape, dtype, base.device_id, base.ptr + offset * dtype.itemsize, owner=base)
    xv = vals[offset:].reshape(shape)
    params = {"alpha": 0.2 if op == "leaky_relu" else 1.3} if op in ("leaky_relu", "elu") \
        else {}
    out = poisoned(m, shape, dtype)
    ew.unary(m, op, x, out=out, **params)
    alpha = stored(m, make(m, [params.get("alpha", 0.0)], dtype)[0])[0] if dtype.is_floating \
        else 0
    check(stored(m, out), ref_unary(op, xv, alpha), dtype, op)


# -- per-call plans -------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT16, DT.FLOAT64, DT.BFLOAT16],
                         ids=lambda d: d.name_str)
def test_plan_path_matches_numpy(m, dtype):
    """The elementwise plans (same-shape binary, tensor-scalar, unary; gelu and activation()
    of CudaML look the unary plan up themselves): each op twice on fresh random inputs of
    odd sizes, the first through the general path (which makes the plan), the second
    through the plan, then on views one element past an aligned pointer (the scalar path's
    grid); every result against float64 NumPy."""
    from cuda_backend.cuda_ml import ActivationType, CudaML
    if not m.gpu:
        pytest.skip("plans are made on the GPU path only")
    ml = CudaML(m)
    rng = np.random.default_rng(8474)
    sv = stored(m, make(m, [2.5], dtype)[0])[0]     # 2.5 as the dtype holds it
    cases = [  # (plans, key op, call, reference)
        (m.ew_binary_plans, "add", lambda a, b: m.vector_add(a, b), lambda x, y: x + y),
        (m.ew_binary_plans, "multiply", lambda a, b: m.multiply(a, b), lambda x, y: x * y),
        (m.ew_unary_plans, "relu", lambda a, b: m.relu(a), lambda x, y: ref_unary("relu", x)),
        (m.ew_unary_plans, "sigmoid", lambda a, b: m.sigmoid(a),
         lambda x, y: ref_unary("sigmoid", x)),
        (m.ew_unary_plans, "gelu", lambda a, b: ml.gelu(a), lambda x, y: ref_unary("gelu", x)),
        (m.ew_unary_plans, "gelu_exact", lambda a, b: ml.gelu(a, approximate="none"),
         lambda x, y: ref_unary("gelu_exact", x)),
        (m.ew_unary_plans, "silu", lambda a, b: ml.activation(a, ActivationType.SILU),
         lambda x, y: ref_unary("silu", x)),
    ]
    if dtype is not DT.BFLOAT16:   # (no scalar plan for bfloat16)
        cases.append((m.ew_scalar_plans, "subtract", lambda a, b: m.subtract(2.5, a),
                      lambda x, y: sv - x))
    for size in (1, 7, 1023, 4097, 2**20 + 3):
        for plans, op, call, ref in cases:
            key = (op, dtype._name_, 0)
            plans.pop(key, None)
            for i in range(3):
                xv, yv = rand(rng, size + 1, dtype), rand(rng, size + 1, dtype)
                ta, a = make(m, xv, dtype)
                tb, b = make(m, yv, dtype)
                off = 1 if i == 2 else 0   # the third call: views at an unaligned offset
                x = CudaTensor((size,), dtype, 0, ta.ptr + off * dtype.itemsize, owner=ta)
                y = CudaTensor((size,), dtype, 0, tb.ptr + off * dtype.itemsize, owner=tb)
                if i:
                    assert key in plans, key
                    assert m.backend.direct_launch(0)
                    plan, taken = plans[key], []

                    def spy(*args, plan=plan, taken=taken):
                        res = plan(*args)
                        taken.append(res is not None)
                        return res
                    plans[key] = spy
                out = call(x, y)
                if i:
                    assert taken == [True], (key, size, i)
                    plans[key] = plan
                check(stored(m, out), ref(a[off:off + size], b[off:off + size]), dtype, op)
                out.free(), ta.free(), tb.free()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS + INTS + [DT.UINT8, DT.BOOL], ids=lambda d: d.name_str)
def test_activation_fill_zeros_copy_plans_match_numpy(m, dtype):
    """The plans of leaky_relu/elu (alpha per call, through CudaML.activation), fill,
    zeros/ones and copy: each op three times, the first through the general path (which
    makes the plan), the next two through the plan (checked by a spy), every result against
    NumPy; copy() also inside a `with stream:` block (queued there, no synchronize)."""
    from cuda_backend.cuda_ml import ActivationType, CudaML
    if not m.gpu:
        pytest.skip("plans are made on the GPU path only")
    ml = CudaML(m)
    rng = np.random.default_rng(11)

    def through_plan(plans, key, call):
        plan, taken = plans[key], []

        def spy(*args):
            res = plan(*args)
            taken.append(res is not None)
            return res
        plans[key] = spy
        try:
            out = call()
        finally:
            plans[key] = plan
        assert taken == [True], key
        return out

    npdt = np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype
    for size in (1, 7, 1023, 4097, 2**20 + 3):
        if dtype.is_floating:     # leaky_relu / elu, alpha default and given
            for kind, op, alphas in ((ActivationType.LEAKY_RELU, "leaky_relu", (None, 0.2, 0.05)),
                                     (ActivationType.ELU, "elu", (None, 1.3, 0.5))):
                key = (op, dtype._name_, 0)
                m.ew_unary_plans.pop(key, None)
                for i, alpha in enumerate(alphas):
                    t, xv = make(m, rand(rng, size, dtype, "wide"), dtype)
                    call = lambda: ml.activation(t, kind, alpha)
                    out = call() if i == 0 else through_plan(m.ew_unary_plans, key, call)
                    a = ew.UNARY_OPS[op][1]["alpha"] if alpha is None else alpha
                    av = stored(m, make(m, [a], dtype)[0])[0]     # alpha as the dtype holds it
                    check(stored(m, out), ref_unary(op, xv, av), dtype, op)
                    out.free(), t.free()
        # fill (in place), zeros, ones
        value = {DT.UINT8: 200, DT.BOOL: 1, DT.INT32: -7, DT.INT64: 2**40}.get(dtype, 1.1)
        want = stored(m, make(m, np.full(1, value), dtype)[0])[0] if dtype.is_floating \
            else np.array(value).astype(npdt)
        m.plans.pop(("fill", dtype, 0), None)
        for i in range(3):
            t = poisoned(m, (size,), dtype) if dtype is not DT.BOOL else \
                m.from_numpy(np.zeros(size, np.bool_))
            call = lambda: m.fill(t, value)
            r = call() if i == 0 else through_plan(m.plans, ("fill", dtype, 0), call)
            assert r is t and (stored(m, t) == want).all()
            t.free()
        for name, fn, v in (("zeros", m.zeros, 0), ("ones", m.ones, 1)):
            for dev in (None, 0):
                m.plans.pop((name, dtype, dev), None)
                for i in range(3):
                    shape = (size,) if i < 2 else (1, size)
                    call = lambda: fn(shape, dtype, dev)
                    z = call() if i == 0 else through_plan(m.plans, (name, dtype, dev), call)
                    assert z.shape == shape and z.dtype is dtype
                    assert (m.to_numpy(z) == v).all(), (name, dtype, size, i)
                    z.free()
        # copy
        m.plans.pop(("copy", dtype, 0), None)
        for i in range(3):
            src = m.from_numpy(rng.integers(0, 2, size).astype(np.bool_)) if dtype is DT.BOOL \
                else make(m, rand(rng, size, dtype), dtype)[0]
            call = lambda: m.copy(src)
            c = call() if i == 0 else through_plan(m.plans, ("copy", dtype, 0), call)
            assert c.ptr != src.ptr and c.shape == src.shape and c.dtype is dtype
            np.testing.assert_array_equal(m.to_numpy(c), m.to_numpy(src))
            c.free(), src.free()
    # copy() on a stream: queued after the stream's kernel, read after its synchronize
    stream = m.backend.stream()
    src = m.from_numpy(np.zeros(2**20, npdt), dtype=dtype)
    with stream:
        m.fill(src, 1)
        c = m.copy(src)
        assert c.stream is stream.pycuda_stream
    stream.synchronize()
    assert (m.to_numpy(c) == 1).all()
