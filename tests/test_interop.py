"""bfloat16 that travels (ml_dtypes), the '<V2' typestr of __cuda_array_interface__, the array
traps (Python scalars from one-element tensors, no implicit NumPy conversion) and dtype
equality with NumPy dtypes and names.

bfloat16 round trips are bit-exact: an ml_dtypes.bfloat16 array, or uint16 patterns with
bits=True, are copied as they are (every one of the 65,536 patterns, NaN payloads included);
float inputs are rounded to nearest even, compared with `to_bfloat16_bits`. Run in whatever
mode the backend is in (fallback without a GPU).
"""
from __future__ import annotations

import operator

import ml_dtypes
import numpy as np
import pytest

from cuda_backend import CudaDataType as DT
from cuda_backend import from_bfloat16_bits, to_bfloat16_bits
from cuda_backend.cuda_math import get_cuda_math
from cuda_backend.errors import DTypeMismatchError, InvalidArgumentError
from cuda_backend.performance.peers import Peer, PeerUnsupported
from cuda_backend.tensor import interface_dtype

BF16 = np.dtype(ml_dtypes.bfloat16)
ALL_BITS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


@pytest.fixture(scope="module")
def m():
    return get_cuda_math()


# -- bfloat16 through ml_dtypes ---------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1 << 16,), (256, 256), (16, 64, 64)])
def test_every_bfloat16_pattern_round_trips(m, shape):
    x = ALL_BITS.view(BF16).reshape(shape)
    t = m.from_numpy(x)
    assert t.dtype is DT.BFLOAT16
    y = m.to_numpy(t)
    assert y.dtype == BF16 and y.shape == shape
    assert np.array_equal(y.view(np.uint16), ALL_BITS.reshape(shape))
    assert np.array_equal(t.numpy().view(np.uint16), ALL_BITS.reshape(shape))


def test_non_contiguous_bfloat16_arrays(m):
    x = ALL_BITS.view(BF16).reshape(256, 256)[3::7, ::-5]
    y = m.to_numpy(m.from_numpy(x))
    assert np.array_equal(y.view(np.uint16), np.ascontiguousarray(x).view(np.uint16))


def test_to_numpy_widens_exactly_with_astype(m):
    rng = np.random.default_rng(10)
    bits = rng.integers(0, 1 << 16, (37, 11)).astype(np.uint16)
    bits = bits[(bits & 0x7F80) != 0x7F80].reshape(-1)        # finite values only
    y = m.to_numpy(m.from_numpy(bits, bits=True))
    assert np.array_equal(y.astype(np.float32), from_bfloat16_bits(bits))


@pytest.mark.parametrize("src", [np.float32, np.float16])
def test_floats_round_to_nearest_even(m, src):
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((19, 23)) * 10.0 ** rng.integers(-3, 4, (19, 23))).astype(src)
    y = m.to_numpy(m.from_numpy(x, dtype="bfloat16"))
    assert np.array_equal(y.view(np.uint16), to_bfloat16_bits(x.astype(np.float32)))


def test_a_bfloat16_array_converts_to_other_dtypes(m):
    x = np.array([1.5, -2.25, 3.0e38, 1.0e-38], dtype=BF16)
    y = m.to_numpy(m.from_numpy(x, dtype="float32"))
    assert y.dtype == np.float32 and np.array_equal(y, x.astype(np.float32))


def test_uint16_for_bfloat16_needs_bits_true(m):
    bits = np.array([0x3F80, 0x4000, 0x7FC1], dtype=np.uint16)      # 1.0, 2.0, a NaN
    with pytest.raises(DTypeMismatchError, match="bits=True"):
        m.from_numpy(bits, dtype="bfloat16")
    with pytest.raises(DTypeMismatchError, match="bits=True"):
        m.from_numpy(bits, dtype=DT.BFLOAT16)
    t = m.from_numpy(bits, bits=True)
    assert t.dtype is DT.BFLOAT16
    assert np.array_equal(m.to_numpy(t).view(np.uint16), bits)
    assert np.array_equal(m.to_numpy(m.from_numpy(bits, bits=True, dtype="bf16"))
                          .view(np.uint16), bits)


@pytest.mark.parametrize("array, dtype", [(np.ones(3, np.float32), None),
                                          (np.ones(3, np.int64), None),
                                          ([1, 2, 3], None),
                                          (np.ones(3, np.uint16), "float32")])
def test_bits_true_takes_only_uint16_patterns(m, array, dtype):
    with pytest.raises(DTypeMismatchError, match="bits=True"):
        m.from_numpy(array, bits=True, dtype=dtype)


def test_uint16_alone_is_still_unsupported(m):
    with pytest.raises(DTypeMismatchError, match="unsupported dtype"):
        m.from_numpy(np.ones(3, np.uint16))


def test_bfloat16_dtype_lookups():
    assert DT.from_any(ml_dtypes.bfloat16) is DT.BFLOAT16
    assert DT.from_any(BF16) is DT.BFLOAT16
    assert DT.BFLOAT16.array_dtype == BF16 and DT.BFLOAT16.numpy_dtype == np.uint16
    assert all(d.array_dtype == d.numpy_dtype for d in DT if d is not DT.BFLOAT16)


# -- __cuda_array_interface__'s '<V2' ---------------------------------------------------------
def _exporter(module):
    cls = type("Array", (), {})
    cls.__module__ = module
    return cls()


@pytest.mark.parametrize("module", ["torch", "cupy", "cupy._core.core"])
def test_v2_from_torch_and_cupy_is_bfloat16(module):
    assert interface_dtype(_exporter(module), "<V2", None) is DT.BFLOAT16
    assert interface_dtype(_exporter(module), "<V2", "bfloat16") is DT.BFLOAT16


@pytest.mark.parametrize("module", ["numba.cuda.cudadrv.devicearray", "jax", "mylib"])
def test_v2_from_others_needs_dtype(module):
    with pytest.raises(DTypeMismatchError, match="dtype='bfloat16'"):
        interface_dtype(_exporter(module), "<V2", None)
    assert interface_dtype(_exporter(module), "<V2", "bfloat16") is DT.BFLOAT16
    assert interface_dtype(_exporter(module), "|V2", DT.BFLOAT16) is DT.BFLOAT16


def test_interface_dtype_checks_what_dtype_says():
    obj = _exporter("mylib")
    assert interface_dtype(obj, "<f4", None) is DT.FLOAT32
    assert interface_dtype(obj, "<f4", "float32") is DT.FLOAT32
    with pytest.raises(DTypeMismatchError, match="does not fit|exports float32"):
        interface_dtype(obj, "<f4", "bfloat16")
    with pytest.raises(DTypeMismatchError, match="does not fit"):
        interface_dtype(obj, "<V2", "float16")
    with pytest.raises(DTypeMismatchError):
        interface_dtype(obj, "<V4", "bfloat16")
    with pytest.raises(DTypeMismatchError, match="typestr"):
        interface_dtype(obj, "garbage", None)
    with pytest.raises(DTypeMismatchError, match="unsupported dtype"):
        interface_dtype(obj, "<i2", None)


def test_bfloat16_has_no_typestr_and_points_at_dlpack():
    with pytest.raises(DTypeMismatchError, match="DLPack"):
        DT.BFLOAT16.typestr


# -- one-element tensors as Python scalars ------------------------------------------------------
SCALARS = [(DT.FLOAT32, 2.5), (DT.FLOAT64, -1.25), (DT.FLOAT16, 0.5), (DT.BFLOAT16, -3.0),
           (DT.INT32, -7), (DT.INT64, 1 << 40), (DT.UINT8, 200), (DT.BOOL, True)]


@pytest.mark.parametrize("dtype, value", SCALARS, ids=lambda v: str(v))
@pytest.mark.parametrize("shape", [(), (1,), (1, 1, 1)], ids=str)
def test_one_element_tensors_convert(m, dtype, value, shape):
    t = m.from_numpy(np.full(shape, value, dtype.array_dtype))
    item = t.item()
    assert item == value and type(item) is type(value)
    assert float(t) == float(value)
    assert int(t) == int(value)
    assert bool(t) is bool(value)
    if dtype in (DT.INT32, DT.INT64, DT.UINT8):
        assert operator.index(t) == value
        assert [10, 20, 30, 40][m.from_numpy(np.full(shape, 2, dtype.numpy_dtype))] == 30
        assert len(range(m.from_numpy(np.full(shape, 5, dtype.numpy_dtype)))) == 5
    else:
        with pytest.raises(TypeError, match="integer tensor"):
            operator.index(t)
        with pytest.raises(DTypeMismatchError):
            [1, 2][t]


def test_int_truncates_toward_zero_and_zero_is_false(m):
    assert int(m.from_numpy(np.array([-2.75], np.float32))) == -2
    assert not bool(m.from_numpy(np.zeros(1, BF16)))
    assert not bool(m.from_numpy(np.array([-0.0], np.float32)))


@pytest.mark.parametrize("shape", [(0,), (2,), (3, 1), (1, 0)], ids=str)
@pytest.mark.parametrize("convert", ["item", "float", "int", "bool", "index"])
def test_other_sizes_raise_naming_the_size(m, shape, convert):
    t = m.from_numpy(np.zeros(shape, np.int64))
    size = int(np.prod(shape))
    fn = {"item": lambda: t.item(), "float": lambda: float(t), "int": lambda: int(t),
          "bool": lambda: bool(t), "index": lambda: operator.index(t)}[convert]
    err = DTypeMismatchError if convert == "index" else InvalidArgumentError
    with pytest.raises(err, match=str(shape).replace("(", r"\(").replace(")", r"\)")) as info:
        fn()
    if convert in ("item", "float", "int", "index"):
        assert f"{size} elements" in str(info.value)


def test_no_implicit_numpy_conversion(m):
    t = m.from_numpy(np.ones((2, 2), np.float32))
    with pytest.raises(InvalidArgumentError, match="numpy"):
        np.asarray(t)
    with pytest.raises(InvalidArgumentError):
        np.array([t])


# -- dtype equality --------------------------------------------------------------------------
NAMES = {DT.FLOAT32: ["float32", "fp32", "float", "f4", np.float32, np.dtype("<f4")],
         DT.FLOAT64: ["float64", "double", np.float64, np.dtype(">f8"), float],
         DT.FLOAT16: ["float16", "half", np.float16],
         DT.BFLOAT16: ["bfloat16", "bf16", ml_dtypes.bfloat16, BF16],
         DT.INT32: ["int32", np.int32, "i4"], DT.INT64: ["int64", np.int64],
         DT.UINT8: ["uint8", np.uint8], DT.BOOL: ["bool", np.bool_, bool]}


@pytest.mark.parametrize("member", list(DT), ids=str)
def test_members_equal_what_they_name_and_nothing_else(member):
    for other, names in NAMES.items():
        for name in names:
            assert (member == name) is (other is member), (member, name)
            assert (name == member) is (other is member), (member, name)
            assert (member != name) is (other is not member), (member, name)
        assert (member == other) is (other is member)
    assert member != np.uint16                   # BFLOAT16's storage is not its type


@pytest.mark.parametrize("other", [1, 2.5, None, [], (), object(), np.float32(1.0),
                                   "garbage", "", np.dtype("complex64"), np.int8, object])
def test_equality_with_anything_else_is_false_and_never_raises(other):
    for member in DT:
        assert (member == other) is False
        assert (member != other) is True


def test_hashing_stays_by_identity():
    for member in DT:
        assert hash(member) == object.__hash__(member)
    table = {member: member.name_str for member in DT}
    assert all(table[member] == member.name_str for member in DT)
    assert table.get("float32") is None          # names are not keys: from_any looks them up
    assert DT.FLOAT32 in {DT.FLOAT32} and DT.FLOAT32 not in {DT.FLOAT64}
    assert len(set(DT)) == len(DT)


def test_tensor_dtype_compares_with_numpy(m):
    t = m.from_numpy(np.ones(3, np.float32))
    assert t.dtype == np.float32 and t.dtype == "float32" and np.dtype("float32") == t.dtype
    assert t.dtype != np.float64 and t.dtype is DT.FLOAT32
    b = m.from_numpy(np.ones(3, BF16))
    assert b.dtype == ml_dtypes.bfloat16 and b.dtype == "bfloat16"
    assert b.dtype == m.to_numpy(b).dtype


# -- the report's CuPy peer in bfloat16 ---------------------------------------------------------
class _FakeCupy:
    """The surface of CuPy that Peer.array uses; asarray as a CuPy with or without bfloat16."""
    __version__ = "0-fake"

    def __init__(self, mode):
        self.mode = mode

        class _Device:
            def __init__(self, _i):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        class _Cuda:
            Device = _Device
        self.cuda = _Cuda

    def asarray(self, values):
        if self.mode == "raises" and values.dtype == BF16:
            raise ValueError("Unsupported dtype bfloat16")
        if self.mode == "void" and values.dtype == BF16:
            return values.view("V2")
        return values


def test_cupy_peer_measures_bfloat16_where_it_has_it():
    host = np.random.default_rng(12).standard_normal((4, 5)).astype(np.float32)
    arr = Peer("cupy", _FakeCupy("ok")).array(host, "bfloat16")
    assert arr.dtype == BF16 and np.array_equal(arr, host.astype(BF16))
    idx = np.arange(5, dtype=np.int64)          # integer inputs keep their dtype
    assert Peer("cupy", _FakeCupy("ok")).array(idx, "bfloat16").dtype == np.int64


@pytest.mark.parametrize("mode", ["raises", "void"])
def test_cupy_peer_without_bfloat16_is_skipped_with_the_reason(mode):
    host = np.ones((2, 3), np.float32)
    with pytest.raises(PeerUnsupported, match="no bfloat16"):
        Peer("cupy", _FakeCupy(mode)).array(host, "bfloat16")
