"""Comparisons, where, take / gather and scatter_add (ops/indexing.py) against NumPy, and the
tensor operators (==, <, ..., t[indices]).

Every test taking `m` runs twice: on the GPU (marked `gpu`, skipped without one: the
indexing.cu.j2 kernels, the device-side bounds flag) and in fallback mode (NumPy, skipped in a
process that has a GPU). scatter_add's float results are checked against np.add.at in float64
within the bound of their summation count (atomic adds land in any order).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from cuda_backend import (CudaDataType as DT, DTypeMismatchError, IndexOutOfRangeError,
                          InvalidArgumentError, ShapeMismatchError, from_bfloat16_bits,
                          to_bfloat16_bits)
from cuda_backend.driver import load_driver
from cuda_backend.ops import indexing as ix
from cuda_backend.ops import indexing_kernels as ixk, indexing_take as ixt

ALL = list(DT)
OPS = list(ixk.COMPARE_OPS)
NP_OPS = {"equal": np.equal, "not_equal": np.not_equal, "less": np.less,
          "less_equal": np.less_equal, "greater": np.greater, "greater_equal": np.greater_equal}
needs_fallback = pytest.mark.skipif(
    load_driver()[0] is not None,
    reason="this process has a GPU: the fallback variant runs only without one")


@pytest.fixture(scope="module", params=[pytest.param("gpu", marks=pytest.mark.gpu),
                                        pytest.param("cpu", marks=needs_fallback)])
def m(request, backend):
    from cuda_backend.cuda_math import CudaMath
    math_ = CudaMath(backend)
    assert math_.gpu == (request.param == "gpu")
    ix.warm_up(math_, 0, workers=16)     # every variant in parallel (0 in fallback mode)
    return math_


def make(m, shape, dtype, rng, small=False):
    """A tensor of random values (small integers with ties when small) and its host values
    (bfloat16 as float32)."""
    if dtype is DT.BOOL:
        v = rng.random(shape) < 0.5
    elif small or not dtype.is_floating:
        lo = 0 if dtype is DT.UINT8 else -3
        v = rng.integers(lo, 4, shape)
    else:
        v = rng.standard_normal(shape) * 10
    t = m.from_numpy(np.asarray(v).astype(np.float32 if dtype is DT.BFLOAT16
                                          else dtype.numpy_dtype), dtype=dtype)
    return t, m.to_numpy(t)


def found(m, call, match, error=IndexOutOfRangeError, free=True):
    """call() with an index out of range: on the GPU the device finds it and the next
    synchronizing call raises (cuda_backend/device_errors.py); in fallback mode the call
    raises itself. The result is freed first (free=False: it is an operand, scatter_add's)."""
    with pytest.raises(error, match=match):
        res = call()
        if free:
            res.free()
        m.backend.synchronize()


def same(m, t, expected):
    got = m.to_numpy(t)
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def ids(dtypes):
    return [d.name_str for d in dtypes]


# -- comparisons ----------------------------------------------------------------------------------
SHAPE_PAIRS = [((7,), (7,)), ((3, 5), (5,)), ((3, 1), (1, 6)), ((2, 3, 4), (3, 1)),
               ((), (4,)), ((5, 1, 3), (4, 1)), ((1,), (33,))]


@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
@pytest.mark.parametrize("op", OPS)
def test_compare_every_op_and_dtype(m, op, dtype):
    """Broadcast shapes, tensor-tensor and tensor-scalar (both sides), ties included."""
    rng = np.random.default_rng(0)
    f = NP_OPS[op]
    for sa, sb in SHAPE_PAIRS:
        a, ra = make(m, sa, dtype, rng, small=True)
        b, rb = make(m, sb, dtype, rng, small=True)
        out = getattr(m, op)(a, b)
        assert out.dtype is DT.BOOL
        same(m, out, f(ra, rb))
    a, ra = make(m, (4, 9), dtype, rng, small=True)
    s = True if dtype is DT.BOOL else 1
    same(m, getattr(m, op)(a, s), f(ra, np.asarray(s, ra.dtype)))
    same(m, getattr(m, op)(s, a), f(np.asarray(s, ra.dtype), ra))


def test_compare_floats_nan_and_scalar_rounding(m):
    v = np.array([np.nan, 1.0, -np.inf, np.inf, 0.1, -0.0], np.float32)
    x = m.from_numpy(v)
    same(m, m.equal(x, x), v == v)
    same(m, m.not_equal(x, x), v != v)
    same(m, m.less(x, np.inf), v < np.inf)
    same(m, m.equal(x, 0.0), v == 0)
    same(m, m.equal(x, 0.1), v == np.float32(0.1))          # the scalar in float32 first
    h = m.from_numpy(np.array([0.1, 0.2], np.float16))
    same(m, m.equal(h, 0.1), np.array([True, False]))        # NumPy 2: 0.1 as float16
    b = m.from_numpy(np.array([0.1, 1.0 + 2.0**-8], np.float32), dtype="bfloat16")
    same(m, m.equal(b, 1.0), np.array([False, True]))        # 1 + 2^-8 rounds to 1 in bf16


def test_compare_errors(m):
    a = m.zeros(3)
    with pytest.raises(ShapeMismatchError):
        m.less(a, m.zeros(4))
    with pytest.raises(DTypeMismatchError):
        m.less(a, m.zeros(3, DT.FLOAT64))
    with pytest.raises(DTypeMismatchError, match="is not an integer"):
        m.less(m.zeros(3, DT.INT32), 1.5)
    with pytest.raises(InvalidArgumentError):
        m.less(1, 2)
    with pytest.raises(DTypeMismatchError):
        m.less(a, np.zeros(3))


def test_comparison_operators(m):
    rng = np.random.default_rng(1)
    a, ra = make(m, (3, 4), DT.FLOAT32, rng, small=True)
    b, rb = make(m, (4,), DT.FLOAT32, rng, small=True)
    same(m, a == b, ra == rb)
    same(m, a != b, ra != rb)
    same(m, a < b, ra < rb)
    same(m, a <= 1, ra <= 1)
    same(m, 1 < a, 1 < ra)                  # reflected: a > 1
    same(m, a >= np.float32(0), ra >= 0)
    same(m, a > np.array(0.0), ra > 0)      # a 0-d array is its scalar
    assert (a == None) is False and (a != "x") is True    # noqa: E711
    assert len({a, b}) == 2 and a in [a]                # hashable by identity
    with pytest.raises(InvalidArgumentError, match="ambiguous"):
        bool(a == a)
    with pytest.raises(InvalidArgumentError, match="ambiguous"):
        a in [b]                                        # NumPy's rule, not a silent True
    assert bool(m.from_numpy(np.array([2.0])) > 1) is True
    with pytest.raises(InvalidArgumentError, match="numpy"):
        np.asarray(a)


# -- where ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
def test_where(m, dtype):
    rng = np.random.default_rng(2)
    for sc, sa, sb in [((6,), (6,), (6,)), ((3, 1), (1, 5), (3, 5)), ((2, 3, 4), (4,), (3, 1)),
                       ((), (3,), (2, 3)), ((4, 1, 2), (1, 7, 1), (1,))]:
        c, rc = make(m, sc, DT.BOOL, rng)
        a, ra = make(m, sa, dtype, rng)
        b, rb = make(m, sb, dtype, rng)
        same(m, m.where(c, a, b), np.where(rc, ra, rb))
    c, rc = make(m, (3, 8), DT.BOOL, rng)
    a, ra = make(m, (8,), dtype, rng)
    s = True if dtype is DT.BOOL else 2
    same(m, m.where(c, a, s), np.where(rc, ra, np.asarray(s, ra.dtype)))
    same(m, m.where(c, s, a), np.where(rc, np.asarray(s, ra.dtype), ra))
    # three tensors of one shape (the flat kernel's vectors and its element tail), twice: the
    # general path, then the plan
    for shape in [(1,), (17,), (1000,), (33, 65)]:
        c, rc = make(m, shape, DT.BOOL, rng)
        a, ra = make(m, shape, dtype, rng)
        b, rb = make(m, shape, dtype, rng)
        for _ in range(2):
            same(m, m.where(c, a, b), np.where(rc, ra, rb))


def test_where_flat_misaligned(m):
    """where of three tensors of one shape when one is a view off a 16-byte boundary (the
    flat kernel's element loop)."""
    from cuda_backend.tensor import CudaTensor
    rng = np.random.default_rng(23)
    base, rbase = make(m, (1001,), DT.FLOAT32, rng)
    c, rc = make(m, (1000,), DT.BOOL, rng)
    b, rb = make(m, (1000,), DT.FLOAT32, rng)
    if m.gpu:
        off, roff = CudaTensor((1000,), DT.FLOAT32, 0, base.ptr + 4, owner=base), rbase[1:]
    else:
        off, roff = m.from_numpy(rbase[1:]), rbase[1:]
    same(m, m.where(c, off, b), np.where(rc, roff, rb))
    same(m, m.where(c, b, off), np.where(rc, rb, roff))


def test_where_masking_and_errors(m):
    x = m.from_numpy(np.array([-1.5, 2.0, np.nan, 4.0], np.float32))
    same(m, m.where(x > 0, x, 0.0), np.array([0.0, 2.0, 0.0, 4.0], np.float32))
    same(m, m.where(x > 0, -np.inf, x), np.array([-1.5, -np.inf, np.nan, -np.inf], np.float32))
    with pytest.raises(DTypeMismatchError, match="cond must be a bool tensor"):
        m.where(x, x, x)
    with pytest.raises(InvalidArgumentError):
        m.where(x > 0, 1.0, 2.0)
    with pytest.raises(DTypeMismatchError):
        m.where(x > 0, x, m.zeros(4, DT.FLOAT64))
    with pytest.raises(ShapeMismatchError):
        m.where(x > 0, x, m.zeros(3))


# -- take / gather --------------------------------------------------------------------------------
ELEM_DTYPES = [DT.FLOAT32, DT.FLOAT64, DT.BFLOAT16, DT.UINT8, DT.BOOL, DT.INT64]


@pytest.mark.parametrize("index_dtype", [DT.INT32, DT.INT64], ids=ids([DT.INT32, DT.INT64]))
@pytest.mark.parametrize("dtype", ELEM_DTYPES, ids=ids(ELEM_DTYPES))
def test_take(m, dtype, index_dtype):
    """Every axis of odd shapes, repeated and negative indices, index tensors of 0-2 dims;
    rows of 16-byte multiples (the vector path: embedding lookups) and odd ones."""
    rng = np.random.default_rng(3)
    for shape in [(5,), (7, 3), (4, 5, 6), (3, 2, 64), (9, 32)]:
        x, rx = make(m, shape, dtype, rng)
        for axis in range(len(shape)):
            n = shape[axis]
            for ishape in [(), (4,), (2, 3)]:
                idx = rng.integers(-n, n, ishape)
                if idx.size:
                    idx.flat[0] = idx.flat[-1]                  # a repeat
                it = m.from_numpy(idx.astype(index_dtype.numpy_dtype))
                same(m, m.take(x, it, axis=axis), np.take(rx, idx, axis=axis))
    x, rx = make(m, (3, 4), dtype, rng)
    it = m.from_numpy(np.array([11, -12, 0], index_dtype.numpy_dtype))
    same(m, m.take(x, it, axis=None), np.take(rx, [11, -12, 0]))
    same(m, x[m.from_numpy(np.array([2, 0, 2], index_dtype.numpy_dtype))], rx[[2, 0, 2]])


def test_embedding_lookup(m):
    rng = np.random.default_rng(4)
    w, rw = make(m, (50, 128), DT.FLOAT32, rng)
    ids_ = rng.integers(0, 50, (4, 17))
    same(m, m.take(w, m.from_numpy(ids_)), rw[ids_])
    same(m, m.take(w, m.from_numpy(ids_.astype(np.int32)), check_bounds=False), rw[ids_])


@pytest.mark.parametrize("check", [True, False])
def test_take_out_of_range(m, check):
    x = m.from_numpy(np.arange(12, dtype=np.float32).reshape(3, 4) + 1)
    bad = m.from_numpy(np.array([0, 3, -4, 2], np.int64))
    before = m.backend.memory_pools[0].get_stats()["active_blocks"] if m.gpu else None
    if check:
        found(m, lambda: m.take(x, bad, axis=0), "out of bounds for axis 0 with size 3")
        found(m, lambda: m.gather(x, m.from_numpy(np.array([[4]], np.int32)), axis=1), "",
              IndexError)
        if m.gpu:
            assert m.backend.memory_pools[0].get_stats()["active_blocks"] == before
    else:                               # out-of-range rows are zeros, silently
        out = m.take(x, bad, axis=0, check_bounds=False)
        exp = np.zeros((4, 4), np.float32)
        exp[0], exp[3] = np.arange(1, 5), np.arange(9, 13)
        same(m, out, exp)
        g = m.gather(x, m.from_numpy(np.array([[4], [1], [-5]], np.int32)), axis=1,
                     check_bounds=False)
        same(m, g, np.array([[0], [6], [0]], np.float32))


def test_take_errors(m):
    x = m.zeros((3, 4))
    with pytest.raises(DTypeMismatchError, match="indices must be int32 or int64, got float32"):
        m.take(x, m.zeros(2), axis=0)
    with pytest.raises(InvalidArgumentError):
        m.take(x, np.array([0, 1]))
    with pytest.raises(InvalidArgumentError, match="axis 2 is out of range"):
        m.take(x, m.from_numpy(np.array([0])), axis=2)
    with pytest.raises(IndexOutOfRangeError):
        m.take(m.zeros((0, 4)), m.from_numpy(np.array([0])), axis=0)
    assert m.take(m.zeros((0, 4)), m.from_numpy(np.zeros(0, np.int64)), axis=0).shape == (0, 4)


@pytest.mark.parametrize("index_dtype", [DT.INT32, DT.INT64], ids=ids([DT.INT32, DT.INT64]))
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT16, DT.INT32, DT.UINT8],
                         ids=ids([DT.FLOAT32, DT.FLOAT16, DT.INT32, DT.UINT8]))
def test_gather_take_along_axis(m, dtype, index_dtype):
    rng = np.random.default_rng(5)
    for xs, is_, axis in [((5, 7), (5, 3), 1), ((5, 7), (2, 7), 0), ((4, 6, 3), (4, 2, 3), 1),
                          ((4, 6, 3), (1, 9, 3), 1), ((4, 6, 1), (4, 2, 5), 1),
                          ((3, 8), (3, 8), -1), ((6,), (10,), 0)]:
        x, rx = make(m, xs, dtype, rng)
        n = xs[axis]
        idx = rng.integers(-n, n, is_)
        got = m.gather(x, m.from_numpy(idx.astype(index_dtype.numpy_dtype)), axis=axis)
        bshape = np.broadcast_shapes(tuple(1 if d == axis % len(xs) else s
                                           for d, s in enumerate(xs)), is_)
        bx = np.broadcast_to(rx, tuple(xs[d] if d == axis % len(xs) else bshape[d]
                                       for d in range(len(xs))))
        same(m, got, np.take_along_axis(bx, np.where(idx < 0, idx + n, idx), axis=axis))
    with pytest.raises(ShapeMismatchError):
        m.gather(m.zeros((3, 4), dtype), m.from_numpy(np.zeros((2, 4), np.int64)), axis=1)
    with pytest.raises(ShapeMismatchError):
        m.gather(m.zeros((3, 4), dtype), m.from_numpy(np.zeros(4, np.int64)), axis=1)


# -- take's row kernel: its index math in NumPy, then on the GPU -----------------------------------
def fast_div(n, d, mul, shift):
    """shape_layouts.fast_divisor's FastDiv (64-bit) as _strided.cuh.j2 computes it."""
    t = (mul * n) >> 64
    return (t + ((n - t) >> min(shift, 1))) >> max(shift - 1, 0)


def emulate_take_rows(src, idx, geo):
    """The "take_rows" kernel, thread by thread, over src's bytes (a contiguous array): every
    output unit is written exactly once; returns the output bytes."""
    unit, lanes = geo["unit"], geo["lanes"]
    gx, gy, _ = geo["grid"]
    n_rows, size, row_units, d, mul, shift, lanes_arg = geo["args"]
    assert lanes_arg == lanes and lanes & (lanes - 1) == 0 and ixk.ROW_BLOCK % lanes == 0
    units = np.ascontiguousarray(src).view(np.uint8).reshape(-1, unit)
    out = np.full((n_rows * row_units, unit), 0xAB, np.uint8)
    written = np.zeros(n_rows * row_units, np.int64)
    rpb, ustep = ixk.ROW_BLOCK // lanes, gy * lanes
    for bx in range(gx):
        for by in range(gy):
            for t in range(ixk.ROW_BLOCK):
                lane = t & (lanes - 1)
                r = bx * rpb + t // lanes
                while r < n_rows:
                    o = fast_div(r, d, mul, shift)
                    j = int(idx[r - o * d])
                    j = j + size if j < 0 else j
                    ok = 0 <= j < size
                    s0, d0 = (o * size + (j if ok else 0)) * row_units, r * row_units
                    u = by * lanes + lane
                    while u < row_units:
                        for k in range(ixk.ROW_UNROLL):
                            uk = u + k * ustep
                            if uk < row_units:
                                out[d0 + uk] = units[s0 + uk] if ok else 0
                                written[d0 + uk] += 1
                        u += ixk.ROW_UNROLL * ustep
                    r += gx * rpb
    assert (written == 1).all()
    return out.reshape(-1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.uint8, np.int64],
                         ids=["float32", "float64", "float16", "uint8", "int64"])
def test_take_rows_index_math(dtype):
    """take_geometry + the kernel's loops against np.take: every axis of odd shapes (outer
    > 1 goes through the FastDiv), rows of 1 element to 20000 (grid y splits long rows of
    few indices), every unit (misaligned pointers narrow it), out-of-range rows of zeros."""
    rng = np.random.default_rng(40)
    cases = [((5,), 0, (4,), 0), ((7, 3), 0, (2, 3), 0), ((4, 5, 6), 1, (7,), 0),
             ((3, 2, 64), 2, (5,), 0), ((9, 32), 0, (3,), 4), ((9, 32), 0, (3,), 2),
             ((3, 20000), 0, (2,), 0), ((2, 3, 5000), 1, (3,), 0), ((50, 1), 0, (300,), 0),
             ((6, 7, 9), 2, (2, 2), 1)]
    for shape, ax, ishape, misalign in cases:
        x = (rng.standard_normal(shape) * 100).astype(dtype)
        n = shape[ax]
        idx = rng.integers(-n, n, ishape)
        idx.flat[-1] = n + 3 if idx.size > 2 else idx.flat[-1]      # out of range: zeros
        item = x.dtype.itemsize
        j = np.where(idx < 0, idx + n, idx)
        bad = (j < 0) | (j >= n)
        want = np.take(x, np.where(bad, 0, j), axis=ax)
        want = np.where(bad.reshape((1,) * ax + idx.shape + (1,) * (x.ndim - ax - 1)),
                        np.zeros((), dtype), want)
        for sms in (132, 1):   # 1: a resident wave of ROW_RESIDENT blocks, several trips each
            geo = ixt.take_geometry(shape, ax, idx.size, item, 4096 + misalign * item, 8192,
                                    sms)
            row_bytes = int(np.prod(shape[ax + 1:])) * item
            assert row_bytes % geo["unit"] == 0 and (misalign * item) % geo["unit"] == 0
            assert geo["unit"] == max(u for u in ixk.UNITS
                                      if row_bytes % u == 0 and (misalign * item) % u == 0)
            got = emulate_take_rows(x, idx.ravel(), geo).view(dtype)
            np.testing.assert_array_equal(got.reshape(want.shape), want,
                                          err_msg=f"{shape} {ax} sms={sms}")
    long = ixt.take_geometry((3, 20000), 0, 2, 4, 0, 0, 132)
    assert long["lanes"] == ixk.ROW_BLOCK and long["grid"][1] > 1        # a split row
    # the embedding lookup: 2048 blocks of rows in 4 trips of 512 (<= 132 * 5 resident)
    emb = ixt.take_geometry((50000, 768), 0, 8192, 4, 0, 0, 132)
    assert (emb["unit"], emb["lanes"], emb["grid"]) == (16, 64, (512, 1, 1))
    assert ixt.take_geometry((50000, 768), 0, 8192, 4, 0, 0, 1)["grid"] == (5, 1, 1)


TAKE_STUB_SCRIPT = r'''
    from cuda_backend.errors import IndexOutOfRangeError
    rng = np.random.default_rng(0)
    E = m.from_numpy(rng.standard_normal((500, 768)).astype(np.float32))
    I = m.from_numpy(rng.integers(0, 500, 64))
    ROWS = 80                     # bytes of the row copy's packed arguments
    for check in (True, False):
        key = ("take", E.shape, E.dtype, I.shape, I.dtype, 0, 0, check)
        m.plans.pop(key, None)
        launches.clear()
        r1 = m.take(E, I, axis=0, check_bounds=check)
        general = list(launches)
        assert key in m.plans
        assert [len(a[2]) for a in general] == [ROWS], general   # it checks its indices
        assert general[-1][:2] == ((16, 1, 1), (256, 1, 1))     # 64 rows, 4 a block
        want = slots(r1)
        r1.free()
        plan, seen = m.plans[key], []
        m.plans[key] = lambda *a: seen.append(plan(*a)) or seen[-1]
        launches.clear()
        r2 = m.take(E, I, axis=0, check_bounds=check)
        m.plans[key] = plan
        assert len(seen) == 1 and seen[0] is not None and launches == general
        like_general(r2, want)
        r2.free()
    # a view 4 bytes past: the plan declines (its unit is 16 bytes), the general path runs
    V = CudaTensor((499, 768), DT.FLOAT32, 0, E.ptr + 4, owner=E)
    launches.clear()
    m.take(V, I, axis=0).free()
    assert [len(a[2]) for a in launches] == [ROWS]
    # a slot the check kernel set: the call returned, the next synchronizing call raises
    # (once), whether it is synchronize or a copy to the host
    for _ in range(2):
        r = m.take(E, I, axis=0)
        device_sets("take", 0, E.shape[0])
        with pytest.raises(IndexOutOfRangeError,
                           match="take: an index is out of bounds.*next synchronizing call"):
            b.synchronize()
        r.free()
        b.synchronize()
    x = m.from_numpy(np.ones((3, 4), np.float32))
    r = m.gather(x, m.from_numpy(np.zeros((3, 1), np.int32)), axis=1)
    device_sets("gather", 1, 4)
    with pytest.raises(IndexOutOfRangeError, match="gather"):
        m.to_numpy(r)
    t, j, src = m.zeros((3, 2)), m.from_numpy(np.zeros(2, np.int64)), m.zeros((2, 2))
    launches.clear()
    m.scatter_add(t, j, src)
    assert len(launches) == 1                 # the adds, checking their indices
    device_sets("scatter_add", 0, 3)
    with pytest.raises(IndexOutOfRangeError, match="scatter_add"):
        b.synchronize()
    m.take(E, I, axis=0).free()
    b.synchronize()
    print("OK")
'''

PINNED_STUB = r'''
    class FakeHostAllocation:     # transfers.is_pinned looks for this name among the bases
        def __init__(self, a):
            self.a, self.__array_interface__ = a, a.__array_interface__
    sys.modules["pycuda.driver"].Event.__init__ = lambda self, flags=0: None   # (flags too)
    sys.modules["pycuda.tools"].PageLockedMemoryPool.allocate = \
        lambda self, shape, dtype: np.asarray(FakeHostAllocation(np.zeros(shape, dtype)))
    mapped = []                   # the error slots' mapped host array (device_errors.py)
    _zeros = sys.modules["pycuda.driver"].pagelocked_zeros
    sys.modules["pycuda.driver"].pagelocked_zeros = \
        lambda *a, **k: mapped.append(_zeros(*a, **k)) or mapped[-1]

    def device_sets(what, ax, size):
        """What the check kernel does for a bad index: set the slot of (what, ax, size)."""
        from cuda_backend.ops.indexing_bounds import bounds_slot
        ptr = bounds_slot(m, what, ax, size)
        slots_ = mapped[0]
        slots_.reshape(-1)[(ptr - slots_.base.get_device_pointer()) // 4] = 1
'''


def test_take_paths_on_a_stubbed_driver():
    """With PyCUDA replaced by perf/bench_host_path.py's stubs (tests/test_host_path.py's
    harness): take launches the check then the row copy (the copy alone without the check),
    its plan launches exactly what the general path did, a misaligned view goes the general
    way, and set flags raise from take (both paths, result freed), gather and scatter_add."""
    from test_host_path import BACKEND, STUBS, run_script, script
    run_script(script(STUBS, PINNED_STUB, BACKEND, TAKE_STUB_SCRIPT))


GATHER_SCATTER_STUB_SCRIPT = r"""
    from cuda_backend.errors import (DTypeMismatchError, IndexOutOfRangeError,
                                     ShapeMismatchError, TensorFreedError)
    rng = np.random.default_rng(3)

    def via_plan(key, call, fresh=True):
        # call() through the general path (which makes the plan), then through the plan
        # (after freeing a fresh result, so that the pool hands its block back): the same
        # launches, the same result slots; returns the general path's launches
        m.plans.pop(key, None)
        launches.clear()
        r1 = call()
        general = list(launches)
        assert key in m.plans, key
        want = slots(r1)
        if fresh:
            r1.free()
        plan, seen = m.plans[key], []
        m.plans[key] = lambda *a: seen.append(plan(*a)) or seen[-1]
        launches.clear()
        r2 = call()
        m.plans[key] = plan
        assert len(seen) == 1 and seen[0] is not None and seen[0] is not False, seen
        assert launches == general, (launches, general)
        if fresh:
            like_general(r2, want)
            r2.free()
        else:
            assert r2 is r1
        return general

    def ints(shape, n, dt=np.int64):
        return m.from_numpy(rng.integers(-n, n, shape).astype(dt))

    # gather: element-wise (64x64 along axis 1, the benchmark's), vectorized (indices
    # broadcast along the last dim), broadcast x, float16, negative axis; checked and not
    x = m.from_numpy(rng.standard_normal((64, 64)).astype(np.float32))
    for check in (False, True):
        j = ints((64, 3), 64)
        got = via_plan(("gather", (64, 64), DT.FLOAT32, (64, 3), DT.INT64, 0, 1, check),
                       lambda: m.gather(x, j, 1, check))
        assert len(got) == 1            # the kernel checks its own indices
    a = m.from_numpy(np.ones((4, 8), np.float32))
    j31 = ints((3, 1), 4, np.int32)
    key = ("gather", (4, 8), DT.FLOAT32, (3, 1), DT.INT32, 0, 0, False)
    vec = via_plan(key, lambda: m.gather(a, j31, 0, False))
    h = m.from_numpy(np.ones((2, 1, 5), np.float16))
    j243 = ints((2, 4, 3), 5, np.int32)
    via_plan(("gather", (2, 1, 5), DT.FLOAT16, (2, 4, 3), DT.INT32, 0, -1, True),
             lambda: m.gather(h, j243, -1))
    # a source 4 bytes off 16: the plan made for aligned ones launches the element-wise
    # variant, as the general path does for it
    base = m.from_numpy(np.ones(40, np.float32))
    off = CudaTensor((4, 8), DT.FLOAT32, 0, base.ptr + 4, owner=base)
    launches.clear()
    m.gather(off, j31, 0, False).free()
    planned = list(launches)
    m.plans.pop(key)
    launches.clear()
    m.gather(off, j31, 0, False).free()
    assert planned == launches and planned[0][2] != vec[0][2]    # per element: mode 0
    # scatter_add (in place: the same target back): the benchmark's, 3-d with 2-d indices
    t = m.from_numpy(np.zeros((64, 64), np.float32))
    src = m.from_numpy(np.ones((8, 64), np.float32))
    rows = m.from_numpy(np.arange(8))
    for check in (False, True):
        got = via_plan(("scatter_add", (64, 64), DT.FLOAT32, (8,), DT.INT64, 0, 0, check),
                       lambda: m.scatter_add(t, rows, src, 0, check), fresh=False)
        assert len(got) == 1            # the kernel checks its own indices
    t3 = m.from_numpy(np.zeros((3, 5, 4)))
    j22 = ints((2, 2), 5, np.int32)
    s3 = m.from_numpy(np.ones((3, 2, 2, 4)))
    via_plan(("scatter_add", (3, 5, 4), DT.FLOAT64, (2, 2), DT.INT32, 0, 1, True),
             lambda: m.scatter_add(t3, j22, s3, 1), fresh=False)
    # what the plans leave to the general path, with its typed errors
    with pytest.raises(ShapeMismatchError):
        m.scatter_add(t3, j22, m.from_numpy(np.ones((3, 2, 4))), 1)
    with pytest.raises(DTypeMismatchError):
        m.scatter_add(t3, j22, m.from_numpy(np.ones((3, 2, 2, 4), np.float32)), 1)
    with pytest.raises(DTypeMismatchError):
        m.gather(x, m.from_numpy(np.zeros((64, 3), np.float32)), 1, False)
    dead = m.from_numpy(np.ones((3, 2, 2, 4)))
    dead.free()
    with pytest.raises(TensorFreedError):
        m.scatter_add(t3, j22, dead, 1)
    dead_x = m.from_numpy(np.ones((64, 64), np.float32))
    dead_x.free()
    with pytest.raises(TensorFreedError):
        m.gather(dead_x, m.from_numpy(np.zeros((64, 3), np.int64)), 1, False)
    # a slot set behind either plan raises from the next synchronizing call
    for _ in range(2):
        r = m.gather(h, j243, -1)
        device_sets("gather", 2, 5)
        r.free()
        with pytest.raises(IndexOutOfRangeError, match="gather: an index is out of bounds"):
            b.synchronize()
        m.scatter_add(t3, j22, s3, 1)
        device_sets("scatter_add", 1, 5)
        with pytest.raises(IndexOutOfRangeError, match="scatter_add"):
            b.synchronize()
    s = b.stream()             # (last: the stub's events cannot settle stream-ordered frees)
    launches.clear()
    with s:
        m.gather(x, m.from_numpy(np.zeros((64, 3), np.int64)), 1, False)
        m.scatter_add(t, rows, src, 0, False)
    assert [l[4] for l in launches] == [s.pycuda_stream] * 2
    print("OK")
"""


def test_gather_scatter_plans_on_a_stubbed_driver():
    """gather's and scatter_add's per-call plans (stubbed driver, as
    test_take_paths_on_a_stubbed_driver): the plan launches exactly what the general path
    did (the bounds check first when asked), per element or in vectors as the pointers'
    alignment allows, and leaves bad operands, freed ones and `with stream:` calls to the
    general path (its typed errors); a set bounds flag raises from either plan."""
    from test_host_path import BACKEND, STUBS, run_script, script
    run_script(script(STUBS, PINNED_STUB, BACKEND, GATHER_SCATTER_STUB_SCRIPT))


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [DT.INT32, DT.INT64], ids=ids([DT.INT32, DT.INT64]))
@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
def test_gpu_take_rows(m, dtype, index_dtype):
    """The row kernel on every dtype: long rows of few indices (grid y), many short rows
    (several waves), outer > 1, a source view one element past an aligned pointer (narrower
    units), out-of-range indices as zero rows with check_bounds=False, then the same calls
    through the per-call plan."""
    from helpers import call_through_plan

    from cuda_backend.tensor import CudaTensor
    rng = np.random.default_rng(41)
    cases = [((3, 20000), 0, (2,)), ((2001, 12), 0, (4099,)), ((3, 77, 10), 1, (5, 3)),
             ((64, 256), 0, (33,)), ((11,), 0, (7, 2))]
    for shape, ax, ishape in cases:
        n = shape[ax]
        x, rx = make(m, shape, dtype, rng)
        base, rbase = make(m, (int(np.prod(shape)) + 1,), dtype, rng)
        xm = CudaTensor(shape, dtype, base.device_id, base.ptr + dtype.itemsize, owner=base)
        rxm = rbase[1:].reshape(shape)
        idx = rng.integers(-n, n, ishape)
        it = m.from_numpy(idx.astype(index_dtype.numpy_dtype))
        key = ("take", shape, dtype, ishape, index_dtype, 0, ax, True)
        for t, rt in ((xm, rxm), (x, rx)):      # a misaligned view first: the plan stays wide
            same(m, m.take(t, it, axis=ax), np.take(rt, idx, axis=ax))
        same(m, call_through_plan(m, key, lambda: m.take(x, it, axis=ax)),
             np.take(rx, idx, axis=ax))
        # the plan declines where its unit does not divide the view's offset
        same(m, m.take(xm, it, axis=ax), np.take(rxm, idx, axis=ax))
        bad = idx.copy()
        bad.flat[0] = n
        bt = m.from_numpy(bad.astype(index_dtype.numpy_dtype))
        exp = np.take(rx, np.where(bad >= n, 0, bad), axis=ax)
        mask = (bad >= n).reshape((1,) * ax + bad.shape + (1,) * (len(shape) - ax - 1))
        for _ in range(2):                               # the general path, then the plan
            same(m, m.take(x, bt, axis=ax, check_bounds=False),
                 np.where(mask, np.zeros((), exp.dtype), exp))
        for _ in range(2):
            before = m.backend.memory_pools[0].get_stats()["active_blocks"]
            found(m, lambda: m.take(x, bt, axis=ax), f"axis {ax} with size {n}")
            assert m.backend.memory_pools[0].get_stats()["active_blocks"] == before


@pytest.mark.gpu
def test_gpu_take_bounds_check_and_graphs(m):
    """check_bounds=True cannot be captured (GraphCaptureError, nothing left allocated);
    check_bounds=False is, and its replay follows new indices; a gather and a scatter_add
    with a bad index still raise (by the next synchronize) after a good call, and the pool
    stays usable."""
    from cuda_backend.errors import GraphCaptureError
    rng = np.random.default_rng(42)
    w, rw = make(m, (50, 128), DT.FLOAT32, rng)
    ids_ = rng.integers(0, 50, (4, 17))
    it = m.from_numpy(ids_)
    same(m, m.take(w, it, check_bounds=False), rw[ids_])
    pool = m.backend.memory_pools[0]
    with m.backend.capture() as graph:
        before = pool.get_stats()["active_blocks"]
        with pytest.raises(GraphCaptureError, match="check_bounds=False"):
            m.take(w, it)
        assert pool.get_stats()["active_blocks"] == before
        out = m.take(w, it, check_bounds=False)
    graph.replay()
    graph.synchronize()
    same(m, out, rw[ids_])
    new = rng.integers(0, 50, (4, 17))
    m.backend.copy_to_device(new, it)
    graph.replay()
    graph.synchronize()
    same(m, out, rw[new])
    graph.free()
    x = m.from_numpy(np.arange(12, dtype=np.float32).reshape(3, 4))
    same(m, m.gather(x, m.from_numpy(np.array([[1], [0], [3]], np.int64)), axis=1),
         np.array([[1], [4], [11]], np.float32))
    found(m, lambda: m.gather(x, m.from_numpy(np.array([[1], [4], [3]], np.int64)), axis=1),
          "gather")
    t = m.zeros((3, 2))
    found(m, lambda: m.scatter_add(t, m.from_numpy(np.array([0, -4], np.int32)),
                                   m.zeros((2, 2))), "scatter_add", free=False)
    same(m, m.take(x, m.from_numpy(np.array([2, -3], np.int32))), np.array(
        [[8, 9, 10, 11], [0, 1, 2, 3]], np.float32))


# -- scatter_add ----------------------------------------------------------------------------------
EPS = {DT.FLOAT64: 2.0**-53, DT.FLOAT32: 2.0**-24, DT.FLOAT16: 2.0**-11, DT.BFLOAT16: 2.0**-8}


@pytest.mark.parametrize("index_dtype", [DT.INT32, DT.INT64], ids=ids([DT.INT32, DT.INT64]))
@pytest.mark.parametrize("dtype", list(ixk.SCATTER_DTYPES), ids=ids(ixk.SCATTER_DTYPES))
def test_scatter_add_repeated_indices(m, dtype, index_dtype):
    """np.add.at in float64 with heavily repeated indices (every axis of odd shapes): floats
    within count * eps * sum |terms| of each element (plus the final rounding), ints exact."""
    rng = np.random.default_rng(6)
    for tshape, ishape, axis in [((5, 3), (40,), 0), ((4, 7), (3, 9), 1), ((3, 5, 6), (25,), 1),
                                 ((6, 16), (2, 50), 0), ((2, 3, 4), (7,), 2)]:
        t, rt = make(m, tshape, dtype, rng, small=not dtype.is_floating)
        n = tshape[axis]
        idx = rng.integers(-n, n, ishape)
        sshape = tshape[:axis] + ishape + tshape[axis + 1:]
        s, rs = make(m, sshape, dtype, rng, small=not dtype.is_floating)
        res = m.scatter_add(t, m.from_numpy(idx.astype(index_dtype.numpy_dtype)), s, axis=axis)
        assert res is t
        key = (slice(None),) * axis + (idx,)
        if not dtype.is_floating:
            exp = rt.copy()
            np.add.at(exp, key, rs)
            same(m, t, exp)
            continue
        exp = rt.astype(np.float64)
        np.add.at(exp, key, rs.astype(np.float64))
        mag = np.abs(rt.astype(np.float64))
        np.add.at(mag, key, np.abs(rs.astype(np.float64)))
        count = np.zeros(tshape)
        np.add.at(count, key, 1.0)
        bound = (count + 1) * EPS[dtype] * mag + 1e-300
        err = np.abs(m.to_numpy(t).astype(np.float64) - exp)
        assert np.all(err <= bound), (tshape, axis, float((err / bound).max()))


def test_scatter_add_embedding_backward(m):
    """grad_weight (vocab, dim) += grad_out (B, T, dim) at token_ids (B, T), float32 and
    float64; take's adjoint: sum(take(w, ids) * g) == sum(w * scatter_add(0, ids, g))."""
    rng = np.random.default_rng(7)
    ids_ = rng.integers(0, 20, (3, 11))
    ids_[0, :5] = 7                                  # a hot token
    for dtype in (DT.FLOAT32, DT.FLOAT64):
        g, rg = make(m, (3, 11, 64), dtype, rng)
        gw = m.zeros((20, 64), dtype)
        m.scatter_add(gw, m.from_numpy(ids_), g)
        exp = np.zeros((20, 64))
        np.add.at(exp, ids_, rg.astype(np.float64))
        np.testing.assert_allclose(m.to_numpy(gw), exp, rtol=1e-5 if dtype is DT.FLOAT32
                                   else 1e-13, atol=1e-5 if dtype is DT.FLOAT32 else 1e-13)


def test_gather_scatter_add_repeated_calls(m):
    """The same shapes called three times on fresh values (on the GPU the later calls go
    through the per-call plans, ops/indexing_take.py and ops/indexing.py): gather as
    np.take_along_axis, exactly, checked and unchecked, aligned and one element off;
    scatter_add of small integers in float64 (every partial sum exact, so any order of the
    atomic adds gives np.add.at's result) and int32."""
    rng = np.random.default_rng(11)
    base = m.from_numpy(np.zeros(33, np.float32))
    for call in range(3):
        x, rx = make(m, (5, 13), DT.FLOAT32, rng)
        idx = rng.integers(-13, 13, (5, 3))
        for check in (True, False):
            got = m.gather(x, m.from_numpy(idx), 1, check)
            same(m, got, np.take_along_axis(rx, np.where(idx < 0, idx + 13, idx), axis=1))
        h, rh = make(m, (7, 1, 6), DT.FLOAT16, rng)
        j = rng.integers(0, 7, (3, 5, 1)).astype(np.int32)
        same(m, m.gather(h, m.from_numpy(j), 0, False),
             np.take_along_axis(np.broadcast_to(rh, (7, 5, 6)), np.broadcast_to(j, (3, 5, 6)),
                                axis=0))
        # indices broadcast along rows of 8: 16-byte vectors where aligned; then a source one
        # element past base's start (not aligned) through the same shapes
        a, ra = make(m, (4, 8), DT.FLOAT32, rng)
        off = m.reshape(base[1:33], (4, 8))
        m.backend.copy_to_device(np.ascontiguousarray(ra), off)
        j31 = m.from_numpy(rng.integers(-4, 4, (3, 1)).astype(np.int32))
        want = np.take_along_axis(ra, np.broadcast_to(m.to_numpy(j31) % 4, (3, 8)), axis=0)
        same(m, m.gather(a, j31, 0, False), want)
        same(m, m.gather(off, j31, 0, False), want)
        for dtype in (DT.FLOAT64, DT.INT32):
            t, rt = make(m, (4, 9, 3), dtype, rng, small=True)
            k = rng.integers(-9, 9, (2, 11))
            src, rs = make(m, (4, 2, 11, 3), dtype, rng, small=True)
            assert m.scatter_add(t, m.from_numpy(k.astype(np.int32)), src, 1,
                                 call % 2 == 0) is t
            exp = rt.copy()
            np.add.at(exp, (slice(None), k), rs)
            same(m, t, exp)


def test_scatter_add_out_of_range_and_errors(m):
    t = m.zeros((3, 2))
    src = m.from_numpy(np.ones((3, 2), np.float32))
    bad = m.from_numpy(np.array([0, 5, -1], np.int64))
    found(m, lambda: m.scatter_add(t, bad, src), "scatter_add", free=False)
    same(m, t, np.array([[1, 1], [0, 0], [1, 1]], np.float32))   # the in-range adds landed
    m.scatter_add(t, bad, src, check_bounds=False)
    same(m, t, np.array([[2, 2], [0, 0], [2, 2]], np.float32))
    with pytest.raises(ShapeMismatchError, match="expected"):
        m.scatter_add(t, bad, m.zeros((2, 2)))
    with pytest.raises(DTypeMismatchError):
        m.scatter_add(m.zeros(3, DT.UINT8), m.from_numpy(np.array([0])), m.zeros(1, DT.UINT8))
    with pytest.raises(DTypeMismatchError):
        m.scatter_add(t, bad, m.zeros((3, 2), DT.FLOAT64))
    with pytest.raises(DTypeMismatchError):
        m.scatter_add(t, m.zeros(3), src)


# -- host-side helpers -----------------------------------------------------------------------------
def test_template_variants():
    sets = ix.template_variants()[ixk.TEMPLATE]
    assert sum(p["kind"] == "map" and p["op"] != "where" for p in sets) == len(OPS) * len(ALL)
    assert {(p["elem"], p["index_dtype"]) for p in sets if p["kind"] == "gather"} == \
        set(itertools.product(ixk.ELEMS, ("int32", "int64")))
    assert len([p for p in sets if p["kind"] == "scatter_add"]) == 2 * len(ixk.SCATTER_DTYPES)


def test_reference():
    x = np.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(ix.reference("take", x, [2, 0], axis=1), x[:, [2, 0]])
    np.testing.assert_array_equal(ix.reference("less", x, 5.0), x < 5)
    out = ix.reference("scatter_add", np.zeros(3), np.array([1, 1, 2]), np.ones(3))
    np.testing.assert_array_equal(out, [0, 2, 1])
    assert from_bfloat16_bits(to_bfloat16_bits(np.float32([1.0])))[0] == 1.0


@pytest.mark.gpu
def test_compare_two_tensors_of_one_shape_gpu(m):
    """The flat kernel (two tensors of one shape): every op and dtype at odd sizes against
    NumPy (float64 for the float types), NaN unequal to everything, through the general
    path and then the plan."""
    if not m.gpu:
        pytest.skip("the flat kernel runs on the GPU")
    rng = np.random.default_rng(17)
    for dt in (DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16, DT.INT32, DT.INT64, DT.BOOL):
        for shape in ((1,), (7,), (1023,), (3, 5, 7), (33, 65)):
            raw = np.round(rng.standard_normal((2,) + shape) * 2)   # many equal pairs
            if dt is DT.BOOL:
                host = raw > 0
            elif dt.is_floating:
                host = raw.astype(np.float32 if dt is DT.BFLOAT16 else dt.numpy_dtype)
                host.reshape(2, -1)[0, ::5] = np.nan
            else:
                host = raw.astype(dt.numpy_dtype)
            a, b = (m.from_numpy(h, dtype=dt) for h in host)
            ha, hb = m.to_numpy(a), m.to_numpy(b)
            if dt is DT.BFLOAT16:
                ha, hb = ha.astype(np.float64), hb.astype(np.float64)
            for op in ixk.COMPARE_OPS:
                want = ix.reference(op, ha, hb)
                for _ in range(2):                       # the general path, then the plan
                    got = getattr(m, op)(a, b)
                    assert got.dtype is DT.BOOL and got.shape == shape
                    np.testing.assert_array_equal(m.to_numpy(got), want, err_msg=f"{op} {dt}")
                    got.free()
            a.free()
            b.free()
    # operands 4 bytes off a 16-byte boundary: the element loop instead of the vectors
    from cuda_backend.tensor import CudaTensor
    base = m.from_numpy(rng.standard_normal(1000).astype(np.float32))
    hb = np.round(rng.standard_normal(999)).astype(np.float32)
    off, b = CudaTensor((999,), DT.FLOAT32, 0, base.ptr + 4, owner=base), m.from_numpy(hb)
    for x, y, hx, hy in ((off, b, m.to_numpy(base)[1:], hb), (b, off, hb, m.to_numpy(base)[1:])):
        got = m.less(x, y)
        np.testing.assert_array_equal(m.to_numpy(got), hx < hy)
        got.free()
