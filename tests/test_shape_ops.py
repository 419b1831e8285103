"""Shape ops (ops/shape.py: reshape / view, permute / transpose, slicing, concatenate, stack,
split, broadcast_to, astype) against NumPy.

Every test taking `m` runs twice: on the GPU (marked `gpu`, skipped without one: the
strided_copy.cu.j2 kernels, transpose.cu.j2 for plain 2-D transposes) and in fallback mode
(NumPy through the same offsets and strides, skipped in a process that has a GPU). Copies
are compared bit for bit (array_equal); the rest of the file checks the host-side planning
(merged dims, kernel kind, access width, index width) without a device.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from fuzzing import examples
from hypothesis import given, settings, strategies as st

from cuda_backend import (CudaDataType as DT, DTypeMismatchError,
                          IndexOutOfRangeError, InvalidArgumentError, InvalidIndexError,
                          ShapeMismatchError, from_bfloat16_bits, to_bfloat16_bits)
from cuda_backend.driver import load_driver
from cuda_backend.ops import shape as sh
from cuda_backend.ops import shape_copy as sc
from cuda_backend.ops import shape_layouts as sl

ALL = list(DT)
needs_fallback = pytest.mark.skipif(
    load_driver()[0] is not None,
    reason="this process has a GPU: the fallback variant runs only without one")


@pytest.fixture(scope="module", params=[pytest.param("gpu", marks=pytest.mark.gpu),
                                        pytest.param("cpu", marks=needs_fallback)])
def m(request, backend):
    from cuda_backend.cuda_math import CudaMath
    math_ = CudaMath(backend)
    assert math_.gpu == (request.param == "gpu")
    sh.warm_up(math_, 0, workers=16)     # every variant in parallel (0 in fallback mode)
    return math_


def make(m, shape, dtype, rng):
    """A tensor of random values of dtype and its host values (bfloat16 as float32)."""
    if dtype.is_floating:
        v = rng.standard_normal(shape) * 10
    elif dtype is DT.BOOL:
        v = rng.random(shape) < 0.5
    elif dtype is DT.UINT8:
        v = rng.integers(0, 256, shape)
    else:
        v = rng.integers(-1000, 1000, shape)
    t = m.from_numpy(np.asarray(v).astype(np.float32 if dtype is DT.BFLOAT16
                                          else dtype.numpy_dtype), dtype=dtype)
    return t, m.to_numpy(t)


def same(m, t, expected, shape=None):
    got = m.to_numpy(t)
    assert got.shape == (expected.shape if shape is None else shape)
    np.testing.assert_array_equal(got, expected)


def ids(dtypes):
    return [d.name_str for d in dtypes]


# -- reshape / view -------------------------------------------------------------------------------
def test_reshape_is_a_view_sharing_memory(m):
    rng = np.random.default_rng(0)
    x, ref = make(m, (4, 6), DT.FLOAT32, rng)
    v = m.reshape(x, (3, -1))
    assert v.shape == (3, 8) and v.ptr == x.ptr and v._owner is x
    same(m, v, ref.reshape(3, 8))
    m.fill(x, 7.0)                            # writes through the base show in the view
    same(m, v, np.full((3, 8), 7, np.float32))
    w = m.view(v, (2, 2, 6))
    assert w.ptr == x.ptr
    same(m, w, np.full((2, 2, 6), 7, np.float32))
    assert x.reshape(24).shape == (24,) and x.reshape((2, 12)).shape == (2, 12)
    assert x.view(-1, 4).shape == (6, 4)
    z = m.reshape(m.create_tensor((0, 3)), (3, 0, 5))
    assert z.shape == (3, 0, 5) and z.size == 0


def test_view_keeps_the_base_alive(m):
    x = m.from_numpy(np.arange(12, dtype=np.int64))
    ptr = x.ptr
    v = x.reshape(3, 4)
    del x
    import gc
    gc.collect()
    assert v.ptr == ptr
    same(m, v, np.arange(12).reshape(3, 4))
    v.free()                                  # frees nothing of the base (it has no block)
    assert v.is_freed


@pytest.mark.parametrize("shape, target, err", [
    ((2, 3), (4,), ShapeMismatchError), ((2, 3), (-1, 4), ShapeMismatchError),
    ((2, 3), (-1, -1), InvalidArgumentError), ((2, 3), (2, -3), InvalidArgumentError),
    ((0, 3), (-1, 0), ShapeMismatchError), ((2, 3), (2.0, 3), InvalidArgumentError)])
def test_reshape_errors(m, shape, target, err):
    x = m.zeros(shape)
    with pytest.raises(err):
        m.reshape(x, target)


# -- permute / transpose ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
def test_permute_every_axis_order(m, dtype):
    """(3, 5, 7, 2): all 24 orders, every dtype, bit for bit."""
    rng = np.random.default_rng(1)
    x, ref = make(m, (3, 5, 7, 2), dtype, rng)
    for axes in itertools.permutations(range(4)):
        same(m, m.permute(x, axes), np.transpose(ref, axes))


@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
@pytest.mark.parametrize("shape, axes", [
    ((33, 65), (1, 0)), ((2, 33, 65), (0, 2, 1)), ((67, 3, 35), (2, 1, 0)),
    ((5, 64, 9), (1, 0, 2)), ((4, 3, 8, 16), (2, 0, 3, 1)),
    ((2, 3, 4, 5, 6, 7), (5, 3, 1, 0, 2, 4)),
    ((8, 4, 3, 2, 16), (2, 0, 3, 1, 4)), ((1, 7, 1, 9), (3, 2, 1, 0)), ((40, 1, 37), (2, 1, 0))],
    ids=lambda v: str(v).replace(" ", ""))
def test_permute_odd_shapes(m, shape, axes, dtype):
    """Every copy path: 16-byte gathers (the innermost axis stays), tiled transposes with
    batch dims around them (several partial 32 x 32 tiles), transpose.cu.j2 for plain
    (batched) 2-D transposes, size-1 axes."""
    rng = np.random.default_rng(2)
    x, ref = make(m, shape, dtype, rng)
    same(m, m.permute(x, axes), np.ascontiguousarray(np.transpose(ref, axes)))


def test_permute_of_size_one_axes_is_a_view(m):
    x = m.from_numpy(np.arange(6, dtype=np.float32).reshape(1, 6, 1))
    v = m.permute(x, (2, 1, 0))
    assert v.shape == (1, 6, 1) and v.ptr == x.ptr
    t = m.transpose(m.from_numpy(np.arange(5.0).reshape(5, 1)))
    assert t.shape == (1, 5)
    same(m, t, np.arange(5.0).reshape(1, 5))


def test_transpose_and_tensor_methods(m):
    rng = np.random.default_rng(3)
    x, ref = make(m, (2, 3, 4), DT.FLOAT64, rng)
    same(m, m.transpose(x), ref.transpose())
    same(m, m.transpose(x, (1, 0, 2)), ref.transpose(1, 0, 2))
    same(m, x.transpose(), ref.transpose())
    same(m, x.transpose(2, 0, 1), ref.transpose(2, 0, 1))
    same(m, x.permute((1, 2, 0)), ref.transpose(1, 2, 0))
    same(m, x.permute(-1, 0, 1), ref.transpose(2, 0, 1))
    same(m, m.permute(x, [2, 1, 0]), ref.transpose(2, 1, 0))
    rows = list(x)                            # iteration: views along axis 0
    assert len(rows) == 2 and all(r._owner is x for r in rows)
    same(m, rows[1], ref[1])
    with pytest.raises(TypeError):
        iter(m.zeros(()))


@pytest.mark.parametrize("axes", [(0,), (0, 0, 1), (0, 1, 3), (0, 1.0, 2), None])
def test_permute_bad_axes(m, axes):
    x = m.zeros((2, 3, 4))
    with pytest.raises(InvalidArgumentError):
        m.permute(x, axes)


def test_qkv_head_split(m):
    """(B, T, 3C) -> (3, B, H, T, D): a reshape (a view) and one permute."""
    rng = np.random.default_rng(4)
    for dtype in (DT.FLOAT32, DT.BFLOAT16):
        x, ref = make(m, (2, 9, 3 * 4 * 8), dtype, rng)
        out = m.permute(m.reshape(x, (2, 9, 3, 4, 8)), (2, 0, 3, 1, 4))
        same(m, out, ref.reshape(2, 9, 3, 4, 8).transpose(2, 0, 3, 1, 4))


@pytest.mark.gpu
@pytest.mark.large
@pytest.mark.parametrize("case", ["4096^2", "qkv"])
def test_permute_report_sizes(case):
    """The report's two permute cases at full size, bit for bit."""
    from cuda_backend.cuda_math import get_cuda_math
    m = get_cuda_math()
    rng = np.random.default_rng(5)
    if case == "4096^2":
        a = rng.standard_normal((4096, 4096), dtype=np.float32)
        out = m.permute(m.from_numpy(a), (1, 0))
        np.testing.assert_array_equal(m.to_numpy(out), a.T)
    else:
        a = rng.standard_normal((8, 512, 3 * 768), dtype=np.float32)
        x = m.from_numpy(a)
        out = m.permute(m.reshape(x, (8, 512, 3, 12, 64)), (2, 0, 3, 1, 4))
        np.testing.assert_array_equal(
            m.to_numpy(out), a.reshape(8, 512, 3, 12, 64).transpose(2, 0, 3, 1, 4))


# -- slicing --------------------------------------------------------------------------------------
KEYS = [
    0, -1, 2, (1, 2), (slice(None), 3), (Ellipsis, 1), (1, Ellipsis, 0),
    slice(1, 3), slice(None, None, -1), slice(None, None, 2), slice(-2, None),
    (slice(None), slice(1, 5, 2)), (slice(None, None, -1), slice(None, None, -2)),
    (slice(2, 0, -1), Ellipsis, slice(None, None, -1)), (None, 1, None, slice(None, 4, 3)),
    (Ellipsis, None), (slice(0, 100), slice(-100, 2)), (slice(5, 1),), (slice(1, 2), 3, 4),
    (2, slice(None), slice(6, 0, -3), 1), (Ellipsis,), (), (slice(None), None, Ellipsis, 0),
]


@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
def test_getitem_matches_numpy(m, dtype):
    """Basic indexing of (3, 5, 7, 2): ints (negative too), slices with steps (negative too),
    None, Ellipsis; out-of-range slice bounds are clipped, as NumPy does."""
    rng = np.random.default_rng(6)
    x, ref = make(m, (3, 5, 7, 2), dtype, rng)
    for key in KEYS:
        expected = ref[key]
        got = x[key]
        assert got.shape == expected.shape, key
        np.testing.assert_array_equal(m.to_numpy(got), expected, err_msg=str(key))


def test_getitem_views_and_copies(m):
    x = m.from_numpy(np.arange(60, dtype=np.float32).reshape(3, 4, 5))
    for key in (1, slice(1, 3), (2, 1), (2, slice(1, 3)), (0, 0, slice(1, 4)), Ellipsis,
                (None, 1)):
        v = x[key]
        assert v._owner is x, key              # contiguous results are views
    c = x[:, 1]
    assert c._owner is None and c.ptr != x.ptr
    v = x[1:3]
    m.fill(x, 2.0)
    same(m, v, np.full((2, 4, 5), 2, np.float32))


def test_getitem_errors(m):
    x = m.zeros((3, 4))
    with pytest.raises(IndexOutOfRangeError, match="index 3 is out of bounds for axis 0 "
                                                   "with size 3"):
        x[3]
    with pytest.raises(IndexError):
        x[0, -5]
    with pytest.raises(InvalidIndexError, match="too many indices"):
        x[0, 0, 0]
    with pytest.raises(InvalidIndexError, match="single ellipsis"):
        x[..., ...]
    with pytest.raises(InvalidIndexError):
        x[1.5]
    with pytest.raises(InvalidIndexError):
        x[True]
    with pytest.raises(InvalidIndexError):
        x[[0, 1]]
    with pytest.raises(InvalidArgumentError, match="slice step cannot be zero"):
        x[::0]
    assert x[5:].shape == (0, 4) and x[:, 10:20].shape == (3, 0)


def test_getitem_of_a_view_at_an_offset(m):
    """Slices of slices: the second offset adds to the first; strided copies of views."""
    a = np.arange(2 * 9 * 4, dtype=np.int32).reshape(2, 9, 4)
    x = m.from_numpy(a)
    v = x[1, 2:]
    same(m, v, a[1, 2:])
    same(m, v[1:4], a[1, 2:][1:4])
    same(m, v[::-2, 1:3], a[1, 2:][::-2, 1:3])
    same(m, v[3:].permute(1, 0), a[1, 2:][3:].T)


# -- concatenate / stack / split -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
def test_concatenate_three_inputs_along_each_axis(m, dtype):
    rng = np.random.default_rng(7)
    base = (3, 5, 7)
    for axis in range(3):
        parts, refs = [], []
        for k in (2, 1, 4):
            shape = base[:axis] + (k,) + base[axis + 1:]
            t, r = make(m, shape, dtype, rng)
            parts.append(t)
            refs.append(r)
        same(m, m.concatenate(parts, axis=axis), np.concatenate(refs, axis=axis))
        same(m, m.concatenate(parts, axis=axis - 3), np.concatenate(refs, axis=axis))
    same(m, m.concatenate(parts, axis=None), np.concatenate(refs, axis=None))


def test_concatenate_empty_and_errors(m):
    a = m.from_numpy(np.ones((2, 3), np.float32))
    e = m.create_tensor((2, 0))
    same(m, m.concatenate([e, a, e], axis=1), np.ones((2, 3), np.float32))
    with pytest.raises(ShapeMismatchError, match="along dimension 1, the tensor at index 0 "
                                                 "has size 3 and the tensor at index 1 has "
                                                 "size 2"):
        m.concatenate([a, m.zeros((2, 2))], axis=0)
    with pytest.raises(ShapeMismatchError, match="same number of dimensions"):
        m.concatenate([a, m.zeros(3)])
    with pytest.raises(DTypeMismatchError):
        m.concatenate([a, m.zeros((2, 3), DT.FLOAT64)])
    with pytest.raises(InvalidArgumentError):
        m.concatenate([])
    with pytest.raises(InvalidArgumentError):
        m.concatenate(a)
    with pytest.raises(InvalidArgumentError, match="axis 2 is out of range"):
        m.concatenate([a, a], axis=2)
    with pytest.raises(ShapeMismatchError, match="zero-dimensional"):
        m.concatenate([m.zeros(()), m.zeros(())])


@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT16, DT.INT64, DT.BOOL], ids=ids(
    [DT.FLOAT32, DT.FLOAT16, DT.INT64, DT.BOOL]))
def test_stack(m, dtype):
    rng = np.random.default_rng(8)
    ts, refs = zip(*[make(m, (3, 5), dtype, rng) for _ in range(3)])
    for axis in (0, 1, 2, -1, -3):
        same(m, m.stack(list(ts), axis=axis), np.stack(refs, axis=axis))
    with pytest.raises(ShapeMismatchError):
        m.stack([ts[0], m.zeros((5, 3), dtype)])
    with pytest.raises(InvalidArgumentError):
        m.stack(list(ts), axis=3)


@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.BFLOAT16, DT.UINT8],
                         ids=ids([DT.FLOAT32, DT.BFLOAT16, DT.UINT8]))
def test_split(m, dtype):
    rng = np.random.default_rng(9)
    x, ref = make(m, (6, 4, 9), dtype, rng)
    for arg, axis in [(3, 0), (2, 1), (3, 2), ([1, 4], 0), ([2, 2, 7, 20], 2), ([-3], 1),
                      ([], 0), ([5, 2], 2)]:
        got = m.split(x, arg, axis=axis)
        exp = np.split(ref, arg, axis=axis)
        assert len(got) == len(exp)
        for g, e in zip(got, exp):
            same(m, g, e)
    assert all(p._owner is x for p in m.split(x, 3, axis=0))    # leading axis: views
    with pytest.raises(ShapeMismatchError, match="equal division"):
        m.split(x, 4, axis=0)
    with pytest.raises(InvalidArgumentError):
        m.split(x, 0)


# -- broadcast_to ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
@pytest.mark.parametrize("src, target", [
    ((1,), (7,)), ((5,), (3, 5)), ((3, 1), (3, 16)), ((3, 1), (2, 3, 17)), ((1, 8), (5, 8)),
    ((2, 1, 4), (2, 3, 4)), ((), (2, 3)), ((4, 1, 1), (4, 3, 64)), ((2, 3), (2, 3))],
    ids=lambda v: str(v).replace(" ", ""))
def test_broadcast_to(m, src, target, dtype):
    rng = np.random.default_rng(10)
    x, ref = make(m, src, dtype, rng)
    same(m, m.broadcast_to(x, target), np.broadcast_to(ref, target))


def test_broadcast_to_errors(m):
    x = m.zeros((3, 2))
    with pytest.raises(ShapeMismatchError, match=r"cannot broadcast a tensor of shape \(3, 2\) "
                                                 r"to shape \(3, 3\)"):
        m.broadcast_to(x, (3, 3))
    with pytest.raises(ShapeMismatchError):
        m.broadcast_to(x, (2,))
    with pytest.raises(InvalidArgumentError):
        m.broadcast_to(x, (-1, 2))


# -- astype ---------------------------------------------------------------------------------------
SPECIAL = np.array([0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, 255.9, 256.0, 300.7, -1.0, -300.2,
                    65504.0, 65520.0, 1e5, -1e5, 3.0e9, -3.0e9, 2.0**31, -2.0**31, 2.0**63,
                    -2.0**63, 1e30, -1e30, np.inf, -np.inf, np.nan, 1.0 + 2.0**-8,
                    1.0 + 3 * 2.0**-9, 1e-40, 7.0, -7.0])


def _source_values(src, rng):
    """Values of src dtype: the special values that fit, then random ones."""
    if src.is_floating:
        v = np.concatenate([SPECIAL, rng.standard_normal(37) * 1000])
        with np.errstate(all="ignore"):
            return v.astype(np.float32 if src is DT.BFLOAT16 else src.numpy_dtype)
    if src is DT.BOOL:
        return rng.random(50) < 0.5
    if src is DT.UINT8:
        return np.arange(256, dtype=np.uint8)
    info = np.iinfo(src.numpy_dtype)
    v = np.concatenate([[0, 1, -1, 255, 256, -256, 65504, 65520, 2**24 + 1, info.min,
                         info.max], rng.integers(info.min, info.max, 40, dtype=np.int64,
                                                 endpoint=True)])
    return v.astype(src.numpy_dtype)


PAIRS = [(s, d) for s in ALL for d in ALL]


@pytest.mark.parametrize("src, dst", PAIRS, ids=[f"{s.name_str}-{d.name_str}" for s, d in PAIRS])
def test_astype_every_pair(m, src, dst):
    """Every dtype pair on special values (NaN, infinities, out of range, ties of rounding,
    subnormals) against the documented semantics (shape_copy.convert_host), and against NumPy's
    astype where NumPy's result is defined (finite values in the target's range)."""
    rng = np.random.default_rng(11)
    vals = _source_values(src, rng)
    x = m.from_numpy(vals, dtype=src)
    stored = m.backend.to_host(x)                  # the storage values (bfloat16: bits)
    out = m.astype(x, dst)
    assert out.dtype is dst and out.shape == x.shape and out.ptr != x.ptr
    got = m.backend.to_host(out)
    expected = sc.convert_host(stored, src, dst)
    if dst.is_floating:                            # NaN == NaN, any NaN bits
        g = from_bfloat16_bits(got) if dst is DT.BFLOAT16 else got
        e = from_bfloat16_bits(expected) if dst is DT.BFLOAT16 else expected
        np.testing.assert_array_equal(g, e)
    else:
        np.testing.assert_array_equal(got, expected)
    # NumPy where it is defined
    host = m.to_numpy(x)
    if dst.is_floating or dst is DT.BOOL:
        if dst is DT.BFLOAT16:
            ref = from_bfloat16_bits(to_bfloat16_bits(host.astype(np.float32)))
            np.testing.assert_array_equal(m.to_numpy(out).astype(np.float32), ref)
        else:
            with np.errstate(all="ignore"):
                np.testing.assert_array_equal(m.to_numpy(out), host.astype(dst.numpy_dtype))
    else:
        info = np.iinfo(dst.numpy_dtype)
        if src.is_floating:
            with np.errstate(all="ignore"):
                ok = np.isfinite(host) & (host > info.min - 1.0) & (host < info.max + 1.0)
        else:
            ok = np.ones(host.shape, bool)
        with np.errstate(all="ignore"):
            np.testing.assert_array_equal(m.to_numpy(out)[ok], host[ok].astype(dst.numpy_dtype))


def test_astype_float_to_int_edges(m):
    """NaN -> 0, saturation, truncation toward zero, uint8 modulo 256 (documented)."""
    x = m.from_numpy(np.array([np.nan, np.inf, -np.inf, 3e9, -3e9, -2.7, 2.7, 300.0, -1.0],
                              np.float32))
    same(m, m.astype(x, "int32"), np.array([0, 2**31 - 1, -2**31, 2**31 - 1, -2**31, -2, 2,
                                            300, -1], np.int32))
    same(m, m.astype(x, DT.INT64), np.array([0, 2**63 - 1, -2**63, 3000000000, -3000000000, -2,
                                             2, 300, -1], np.int64))
    same(m, m.astype(x, "uint8"), np.array([0, 255, 0, 3000000000 % 256, -3000000000 % 256,
                                            254, 2, 44, 255], np.uint8))
    same(m, x.astype("bool"), np.array([True] * 9))


def test_astype_bfloat16_rounds_to_nearest_even(m):
    vals = np.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-8 + 2.0**-20, 3.0e38, -0.0],
                    np.float64)
    x = m.from_numpy(vals)
    got = m.to_numpy(m.astype(x, "bfloat16"))
    np.testing.assert_array_equal(got, from_bfloat16_bits(to_bfloat16_bits(
        vals.astype(np.float32))))
    assert got[0] == 1.0 and got[1] == 1.0 + 2.0**-6 and got[2] == 1.0 + 2.0**-7


def test_astype_same_dtype_is_a_copy(m):
    x = m.from_numpy(np.arange(5, dtype=np.int32))
    y = m.astype(x, DT.INT32)
    assert y.ptr != x.ptr
    same(m, y, np.arange(5, dtype=np.int32))


# -- misaligned operands (views at odd offsets: the scalar paths) ---------------------------------
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT16, DT.UINT8, DT.INT64],
                         ids=ids([DT.FLOAT32, DT.FLOAT16, DT.UINT8, DT.INT64]))
def test_views_past_an_aligned_pointer(m, dtype):
    rng = np.random.default_rng(12)
    base, ref = make(m, (1 + 8 * 3 * 16,), dtype, rng)
    x = base[1:].reshape(8, 3, 16)
    r = ref[1:].reshape(8, 3, 16)
    same(m, m.permute(x, (1, 0, 2)), r.transpose(1, 0, 2))
    same(m, m.permute(x, (2, 0, 1)), r.transpose(2, 0, 1))
    same(m, m.concatenate([x, x], axis=2), np.concatenate([r, r], axis=2))
    same(m, m.broadcast_to(x[:, :1], (8, 5, 16)), np.broadcast_to(r[:, :1], (8, 5, 16)))
    if dtype is not DT.UINT8:
        same(m, m.astype(x, DT.FLOAT64), r.astype(np.float64))


# -- properties -----------------------------------------------------------------------------------
def _slice(size):
    bound = st.one_of(st.none(), st.integers(-size - 3, size + 3))
    step = st.one_of(st.none(), st.integers(-4, 4).filter(lambda v: v != 0))
    return st.builds(slice, bound, bound, step)


@st.composite
def layouts(draw):
    """A shape of 1-6 dims (sizes 0-9), a permutation and a basic-indexing key for it."""
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=6)))
    perm = tuple(draw(st.permutations(range(len(shape)))))
    def items(sizes):
        out = []
        for size in sizes:
            choices = [_slice(size)]
            if size:
                choices.append(st.integers(-size, size - 1))
            out.append(draw(st.one_of(*choices)))
        return out
    lead = draw(st.integers(0, len(shape)))
    key = items(shape[:lead])
    if draw(st.booleans()):             # ... then items for the trailing dims
        trail = draw(st.integers(0, len(shape) - lead))
        key += [Ellipsis] + items(shape[len(shape) - trail:])
    for _ in range(draw(st.integers(0, 2))):      # new axes: they index no dim
        key.insert(draw(st.integers(0, len(key))), None)
    return shape, perm, tuple(key)


@settings(max_examples=examples(40), deadline=None)
@given(layout=layouts(), dtype=st.sampled_from(ALL))
def test_permute_and_getitem_property(m, layout, dtype):
    shape, perm, key = layout
    x, ref = make(m, shape, dtype, np.random.default_rng(7081))
    same(m, m.permute(x, perm), np.transpose(ref, perm))
    same(m, x[key], ref[key])
    ones = tuple(slice(0, 1) if i % 2 else slice(None) for i in range(len(shape)))
    if all(s for s in shape):           # every other axis of size 1, broadcast back
        same(m, m.broadcast_to(x[ones], (2,) + shape), np.broadcast_to(ref[ones], (2,) + shape))


# -- host-side planning (no device) ---------------------------------------------------------------
def test_collapse_merges_what_every_operand_walks_alike():
    assert sl.collapse((2, 3, 4), [12, 4, 1], [12, 4, 1]) == ([24], [[1], [1]])
    assert sl.collapse((2, 3, 4), [1, 2, 6], [12, 4, 1]) == ([2, 3, 4], [[1, 2, 6], [12, 4, 1]])
    assert sl.collapse((3, 1, 4), [4, 99, 1], [0, 7, 1]) == ([3, 4], [[4, 1], [0, 1]])
    assert sl.collapse((1, 1), [5, 6]) == ([1], [[1]])
    assert sl.collapse((2, 5, 7), [0, 0, 1], [35, 7, 1]) == ([10, 7], [[0, 1], [7, 1]])


@pytest.mark.parametrize("bits", [32, 64])
def test_fast_divisor_is_exact(bits):
    """The FastDiv formula, in Python at the kernel's width, against integer division."""
    rng = np.random.default_rng(13)
    mask = (1 << bits) - 1
    divisors = [1, 2, 3, 5, 7, 31, 32, 33, 100, 641, 2**16 + 1, 2**31 - 1, 2**31, 2**32 - 65]
    divisors += [int(d) for d in rng.integers(1, 2**31, 20)]
    ns = [0, 1, 2, 3, 63, 64, 65, 2**31 - 1, 2**31, 2**32 - 65, (1 << bits) - 1]
    ns += [int(n) for n in rng.integers(0, 2**32 - 1, 50)]
    for d in divisors:
        dd, mult, l = sl.fast_divisor(d, bits)
        assert dd == d and 0 < mult < (1 << bits)
        s1, s2 = min(l, 1), max(l - 1, 0)
        for n in ns:
            n &= mask
            t = (mult * n) >> bits
            assert (t + ((n - t) >> s1)) >> s2 == n // d, (d, n, bits)


class _Stub:
    """Just what plan_copy's transpose delegation reads (small problems are not timed)."""
    gpu = True
    plans: dict = {}

    class backend:
        @staticmethod
        def get_device_info(dev):
            from types import SimpleNamespace
            return SimpleNamespace(max_grid_dims=(2**31 - 1, 65535, 65535))


def _plan(shape, axes, dtype=DT.FLOAT32, src=0, dst=0):
    xs = sl.contiguous_strides(shape)
    out_shape = tuple(shape[a] for a in axes)
    return sc.plan_copy(_Stub, 0, dtype, out_shape, [xs[a] for a in axes],
                        sl.contiguous_strides(out_shape), src, dst)


def test_plan_copy_picks_the_kernel():
    (g,) = _plan((64, 8, 4), (1, 0, 2))                   # innermost stays: 16-byte gather
    assert g.params == sc.copy_params("gather", 4, 32, 3) and g.args[2] == 1  # mode 1
    assert g.params["nd"] == g.args[1] == 3          # the render for its ndim (nd)
    assert g.args[0] == 64 * 8 * 4 // 4 and g.args[3] == 1                   # items, contig
    (g,) = _plan((64, 8, 4), (1, 0, 2), src=4)              # misaligned source: elements
    assert g.args[2] == 0 and g.args[0] == 64 * 8 * 4
    (t,) = _plan((5, 7, 3), (2, 1, 0))                     # innermost moves: tile
    assert t.params["kind"] == "tile" and t.block == (32, 8, 1)
    launches = _plan((2, 33, 65), (0, 2, 1))                 # batched 2-D: transpose.cu.j2
    assert launches and all(L.template == "transpose.cu.j2" for L in launches)
    (t,) = _plan((33, 65), (1, 0), DT.UINT8)              # 1-byte elements: tile
    assert t.params == sc.copy_params("tile", 1, 32)
    (g6,) = _plan((2, 3, 2, 3, 2, 3), (0, 2, 1, 4, 3, 5))  # 6 dims: the any-ndim render
    assert g6.params["kind"] == "gather" and g6.args[1] == 6 and g6.params["nd"] == 0
    assert _plan((0, 3), (1, 0)) == []
    big = sc.plan_copy(_Stub, 0, DT.FLOAT32, (3, 2**32), [1, 3], [2**32, 1], 0, 0)
    assert big[0].params["index"] == 64 and big[0].params["kind"] == "tile"   # sizes >= 2^32
    mid = sc.plan_copy(_Stub, 0, DT.FLOAT32, (3, 2**31), [1, 3], [2**31, 1], 0, 0)
    assert mid[0].params["index"] == 32
    (b,) = sc.plan_copy(_Stub, 0, DT.FLOAT32, (4, 64), [1, 0], [64, 1], 0, 0)   # broadcast
    assert b.params["kind"] == "gather" and b.args[2] == 2                   # mode 2


def test_template_variants_cover_every_kind_and_pair():
    sets = sh.template_variants()[sh.TEMPLATE]
    assert sum(p["kind"] == "convert" for p in sets) == len(ALL) * (len(ALL) - 1)
    assert {(p["elem"], p["index"]) for p in sets if p["kind"] == "gather"} == \
        {(e, i) for e in sh.ELEMS for i in sh.INDEX_BITS}
    assert {(p["elem"], p["index"]) for p in sets if p["kind"] == "tile"} == \
        {(e, i) for e in sh.ELEMS for i in sh.INDEX_BITS}


def test_parse_key_offsets_and_strides():
    assert sl.parse_key((3, 4), (1, slice(None, None, -1))) == ((4,), [-1], 7)
    assert sl.parse_key((3, 4), (None, Ellipsis, 2)) == ((1, 3), [0, 4], 2)
    assert sl.parse_key((3, 4), slice(5, 9)) == ((0, 4), [4, 1], 0)


def test_stack_reshape_repeated_calls(m):
    """The same shapes three times on fresh values (on the GPU the later calls take the
    per-call paths: stack's plan, reshape's remembered target shape): stack as np.stack for
    each axis, bit for bit, also from a source one element past an aligned pointer; reshape /
    view / the tensor methods give views sharing the memory of the tensor at hand."""
    rng = np.random.default_rng(12)
    base = m.from_numpy(np.zeros(3 * 7 * 5 + 1, np.float16))
    for _ in range(3):
        a, ra = make(m, (3, 7, 5), DT.FLOAT16, rng)
        b, rb = make(m, (3, 7, 5), DT.FLOAT16, rng)
        off = m.reshape(base[1:], (3, 7, 5))
        m.backend.copy_to_device(rb, off)
        for axis in (0, 1, -1, 3):
            same(m, m.stack([a, b, a], axis), np.stack([ra, rb, ra], axis))
            same(m, m.stack((off, a), axis), np.stack([rb, ra], axis))
        x, rx = make(m, (6, 10), DT.INT32, rng)
        for v, shape in ((m.reshape(x, (60,)), (60,)), (m.view(x, (-1, 12)), (5, 12)),
                         (x.reshape(3, 20), (3, 20)), (x.view((2, -1, 5)), (2, 6, 5)),
                         (m.reshape(x, 60), (60,))):
            assert v.shape == shape and v.ptr == x.ptr and v._owner is x
            same(m, v, rx.reshape(shape))
        m.fill(x, 3)
        same(m, m.reshape(x, (60,)), np.full(60, 3, np.int32))


# -- "cat": concatenate / stack / split in one launch per 8 pieces -------------------------------
def _fast_div(n, d, mul, l, bits):
    """FastDiv::div of _strided.cuh.j2 on Python ints (mulhi of `bits`-wide words)."""
    t = (mul * n) >> bits
    return (t + ((n - t) >> min(l, 1))) >> max(l - 1, 0)


def _run_cat_emulated(launches, pieces, one, one_addr):
    """strided_copy.cu.j2's "cat" kernel in NumPy over plan_cat's launches: every work item's
    row (FastDiv), column, piece (the unrolled compares) and both offsets, on byte buffers
    (pieces: uint8 arrays, one: the uint8 buffer whose byte 0 is at one_addr, the whole
    tensor's row 0 starting there less the first piece's column)."""
    for L in launches:
        unit, bits = L.params["unit"], L.params["index"]
        assert L.params["kind"] == "cat" and len(L.args) == 6 + 8 + 7
        n, split, d, mul, l, ostride = L.args[:6]
        inner, off = list(L.args[6:14]), [0] + list(L.args[14:21])
        assert len(L.pieces) <= 8 and all(inner[k] == 0 for k in range(len(L.pieces), 8))
        assert all(o == d for o in off[len(L.pieces):])          # unused slots: never chosen
        assert n < 2**bits and n == (n // d) * d
        i = np.arange(n, dtype=np.uint64)
        o = np.array([_fast_div(int(v), d, mul, l, bits) for v in i], dtype=np.int64)
        np.testing.assert_array_equal(o, np.arange(n) // d)
        c = np.arange(n) - o * d
        k = np.zeros(n, np.int64)
        for s in range(1, 8):
            k = np.where(c >= off[s], s, k)
        one_u = one[:one.size // unit * unit].view(f"V{unit}")
        at_one = L.one_off // unit + o * ostride + c
        for s in range(len(L.pieces)):
            sel = k == s
            p = pieces[L.pieces[s]].view(f"V{unit}")
            at_piece = o[sel] * inner[s] + c[sel] - off[s]
            if split:
                p[at_piece] = one_u[at_one[sel]]
            else:
                one_u[at_one[sel]] = p[at_piece]


@pytest.mark.parametrize("seed", range(6))
def test_cat_launches_emulated(seed):
    """plan_cat's launches, run through the kernel's index math in NumPy, concatenate and
    split as NumPy does: 1..19 pieces along each axis of odd shapes, every element size,
    pointers at random alignments (16-byte items only where every size and pointer allows),
    split pieces covering part of the axis."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        nd = int(rng.integers(1, 4))
        base = [int(v) for v in rng.integers(1, 6, nd)]
        ax = int(rng.integers(0, nd))
        npieces = int(rng.choice([1, 2, 3, 7, 8, 9, 16, 17, 19]))
        dt = np.dtype(rng.choice([np.uint8, np.float16, np.float32, np.float64]))
        widths = [int(v) for v in rng.integers(1, 9, npieces)]
        parts = [rng.integers(0, 255, base[:ax] + [w] + base[ax + 1:]).astype(dt)
                 for w in widths]
        ref = np.concatenate(parts, axis=ax)
        rows = math.prod(base[:ax])
        row_piece = [p.size // rows * dt.itemsize for p in parts]
        addrs = [int(rng.integers(0, 64)) * dt.itemsize for _ in parts]
        one_addr = int(rng.integers(0, 64)) * dt.itemsize
        launches = sc.plan_cat(rows, row_piece, addrs, one_addr, False)
        assert len(launches) == -(-npieces // 8)
        unit = launches[0].params["unit"]
        assert unit == max(u for u in (1, 2, 4, 8, 16)
                           if all(v % u == 0 for v in row_piece + addrs + [one_addr]))
        one = np.zeros(ref.size, dt)
        _run_cat_emulated(launches, [p.reshape(-1).view(np.uint8) for p in parts],
                          one.view(np.uint8), one_addr)
        np.testing.assert_array_equal(one.reshape(ref.shape), ref)
        # split: pieces [a, b) of the axis, side by side, from a tensor of a wider axis
        lead = int(rng.integers(0, 3))
        wide = base[:ax] + [lead + ref.shape[ax] + int(rng.integers(0, 3))] + base[ax + 1:]
        src = rng.integers(0, 255, wide).astype(dt)
        src[(slice(None),) * ax + (slice(lead, lead + ref.shape[ax]),)] = ref
        inner = math.prod(base[ax + 1:]) * dt.itemsize
        launches = sc.plan_cat(rows, row_piece, addrs, one_addr + lead * inner, True,
                               wide[ax] * inner)
        outs = [np.zeros(p.size, dt) for p in parts]
        flat = src.reshape(-1).view(np.uint8)
        _run_cat_emulated(launches, [o.view(np.uint8) for o in outs], flat[lead * inner:],
                          one_addr + lead * inner)
        for o, p in zip(outs, parts):
            np.testing.assert_array_equal(o.reshape(p.shape), p)


def test_cat_unit_and_index_width():
    assert sc.cat_unit(0, 32, 48) == 16 and sc.cat_unit(16, 12) == 4
    assert sc.cat_unit(8, 16) == 8 and sc.cat_unit(3) == 1 and sc.cat_unit() == 16
    launches = sc.plan_cat(3, [28, 20], [0, 16], 32, False)       # float32 (3, 7) | (3, 5)
    assert [L.params for L in launches] == [sc.cat_params(4, 32)]
    assert launches[0].args[:2] == (36, 0) and launches[0].args[5] == 12
    big = sc.plan_cat(2**20, [2**13, 2**13], [0, 0], 0, False)      # 2^29 16-byte items
    assert big[0].params == sc.cat_params(16, 32)
    big = sc.plan_cat(2**24, [2**13, 2**13], [0, 0], 0, False)      # 2^33 items: 64-bit
    assert big[0].params == sc.cat_params(16, 64)
    assert sc.cat_params(16, 32) in sh.template_variants()[sh.TEMPLATE]


@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
def test_concatenate_one_to_nine_inputs(m, dtype):
    """1..9 inputs (9: two launches) of (3, 5, 7) pieces along each axis, mixed sizes along
    it (16-byte items for some calls, elements for others), bit for bit; each call twice (the
    second through the plan on the GPU)."""
    rng = np.random.default_rng(21)
    base = (3, 5, 7)
    for n in range(1, 10):
        for axis in range(3):
            parts, refs = [], []
            for k in rng.integers(1, 5, n):
                t, r = make(m, base[:axis] + (int(k),) + base[axis + 1:], dtype, rng)
                parts.append(t)
                refs.append(r)
            want = np.concatenate(refs, axis=axis)
            for _ in range(2):
                same(m, m.concatenate(parts, axis=axis), want)
    a, ra = make(m, (4, 4), dtype, rng)           # 16-byte rows for 4- and 8-byte dtypes
    b, rb = make(m, (4, 8), dtype, rng)
    for _ in range(3):
        same(m, m.concatenate([a, b, a], axis=1), np.concatenate([ra, rb, ra], axis=1))


@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
def test_stack_many_inputs_each_axis(m, dtype):
    rng = np.random.default_rng(22)
    for n in (1, 2, 5, 8, 9):
        ts, refs = zip(*[make(m, (3, 5, 7), dtype, rng) for _ in range(n)])
        for axis in range(-4, 4):
            want = np.stack(refs, axis=axis)
            for _ in range(2):
                same(m, m.stack(list(ts), axis=axis), want)


@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
def test_split_side_by_side_pieces(m, dtype):
    """split along inner axes (copies: one launch per 8 pieces on the GPU) into sections and
    at indices (empty pieces, pieces starting after 0 or ending before the end, more than 8
    pieces, overlapping pieces through getitem), each call three times (plans)."""
    rng = np.random.default_rng(23)
    x, ref = make(m, (3, 10, 7), dtype, rng)
    for arg, axis in [(2, 1), (5, 1), (10, 1), (7, 2), (1, 2), ([3, 3, 8], 1), ([-2], 2),
                      ([2, 5], 1), ([1, 2, 3, 4, 5, 6, 7, 8, 9], 1), ([4, 2], 2),
                      ((0, 10), 1), ([3, 12], 1), ([9, 20], 1)]:
        exp = np.split(ref, arg, axis=axis)
        for _ in range(3):
            got = m.split(x, arg, axis=axis)
            assert len(got) == len(exp)
            for g, e in zip(got, exp):
                same(m, g, e)
    v = m.reshape(m.from_numpy(np.zeros(3 * 10 * 7 + 1, np.float32))[1:], (3, 10, 7))
    r = np.arange(210, dtype=np.float32).reshape(3, 10, 7)
    m.backend.copy_to_device(r, v)                # one element past an aligned pointer
    for _ in range(3):
        for g, e in zip(m.split(v, 2, axis=2 - 1), np.split(r, 2, axis=1)):
            same(m, g, e)
