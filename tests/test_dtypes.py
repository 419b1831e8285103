"""CudaDataType properties and the bfloat16 host conversions."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuda_backend import (CudaBackendError, CudaDataType, DTypeMismatchError,
                          from_bfloat16_bits, to_bfloat16_bits)

T = CudaDataType

EXPECTED = {
    # member: (name_str, numpy dtype, itemsize, c_type, is_floating)
    T.FLOAT32: ("float32", np.float32, 4, "float", True),
    T.FLOAT64: ("float64", np.float64, 8, "double", True),
    T.FLOAT16: ("float16", np.float16, 2, "__half", True),
    T.BFLOAT16: ("bfloat16", np.uint16, 2, "__nv_bfloat16", True),
    T.INT32: ("int32", np.int32, 4, "int", False),
    T.INT64: ("int64", np.int64, 8, "long long", False),
    T.UINT8: ("uint8", np.uint8, 1, "unsigned char", False),
    T.BOOL: ("bool", np.bool_, 1, "bool", False),
}


def test_every_member_is_described():
    assert set(EXPECTED) == set(CudaDataType)


@pytest.mark.parametrize("member", list(CudaDataType), ids=lambda m: m.name)
def test_properties(member):
    name, np_type, itemsize, c_type, floating = EXPECTED[member]
    assert member.name_str == name
    assert member.numpy_dtype == np.dtype(np_type)
    assert member.itemsize == itemsize
    assert member.c_type == c_type
    assert member.is_floating is floating
    assert repr(member) == f"CudaDataType.{member.name}"


@pytest.mark.parametrize("member", [m for m in CudaDataType if m is not T.BFLOAT16],
                         ids=lambda m: m.name)
def test_typestr_matches_numpy(member):
    assert member.typestr == member.numpy_dtype.str
    assert CudaDataType.from_typestr(member.typestr) is member


def test_bfloat16_has_no_typestr():
    with pytest.raises(DTypeMismatchError, match="bfloat16"):
        T.BFLOAT16.typestr


@pytest.mark.parametrize("value, expected", [
    (T.FLOAT16, T.FLOAT16),
    ("float32", T.FLOAT32), ("FLOAT64", T.FLOAT64), ("bfloat16", T.BFLOAT16),
    ("int32", T.INT32), ("int64", T.INT64), ("uint8", T.UINT8), ("bool", T.BOOL),
    # aliases
    ("bf16", T.BFLOAT16), ("half", T.FLOAT16), ("float", T.FLOAT32), ("double", T.FLOAT64),
    ("fp32", T.FLOAT32), ("fp16", T.FLOAT16), ("fp64", T.FLOAT64), ("FP16", T.FLOAT16),
    # NumPy dtypes, types and typestrs
    (np.dtype(np.float32), T.FLOAT32), (np.float64, T.FLOAT64), (np.float16, T.FLOAT16),
    (np.int32, T.INT32), (np.int64, T.INT64), (np.uint8, T.UINT8), (np.bool_, T.BOOL),
    ("f4", T.FLOAT32), ("<i8", T.INT64),
    # non-native byte order maps to the same type
    (np.dtype(">f4"), T.FLOAT32), (np.dtype(">i4"), T.INT32),
])
def test_from_any(value, expected):
    assert CudaDataType.from_any(value) is expected


@pytest.mark.parametrize("value", ["complex64", "float128x", "uint16", np.uint16, np.int8,
                                   np.complex128, "foo", "f4,f4", object()],
                         ids=lambda v: "object()" if type(v) is object else repr(v))
def test_from_any_unsupported_names_the_supported_ones(value):
    with pytest.raises(DTypeMismatchError) as info:
        CudaDataType.from_any(value)
    msg = str(info.value)
    assert "unsupported dtype" in msg
    for member in CudaDataType:
        assert member.name_str in msg
    # typed error, also catchable as the built-in a Python user would expect
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, CudaBackendError)


def test_from_any_none_is_rejected():
    with pytest.raises(DTypeMismatchError):
        CudaDataType.from_any(None)


# -- bfloat16 conversions ------------------------------------------------------------------

BF16_MAX = float.fromhex("0x1.fep127")  # largest finite bfloat16


def bf16_reference(x: float) -> float:
    """Round a float32 value to bfloat16 (8 significant bits, float32's exponent range) with
    round-to-nearest-even, in float64 arithmetic and without any bit manipulation."""
    if math.isnan(x) or math.isinf(x) or x == 0.0:
        return x
    _, e = math.frexp(abs(x))            # abs(x) = m * 2**e with 0.5 <= m < 1
    exponent = max(e - 1, -126)          # below 2**-126 the spacing stays that of subnormals
    ulp = 2.0 ** (exponent - 7)
    q = x / ulp                          # exact: dividing by a power of two
    r = round(q)                         # Python's round() is round-half-even on floats
    result = r * ulp
    if abs(result) > BF16_MAX:
        return math.copysign(math.inf, x)
    return result


def roundtrip(values) -> np.ndarray:
    return from_bfloat16_bits(to_bfloat16_bits(np.asarray(values, dtype=np.float32)))


def test_reference_rounding_self_check():
    # 1 + 2**-8 is exactly halfway between 1 and 1 + 2**-7: ties go to the even (1.0)
    assert bf16_reference(1 + 2**-8) == 1.0
    # 1 + 3 * 2**-8 is halfway between 1 + 2**-7 and 1 + 2**-6: ties go to 1 + 2**-6 (even)
    assert bf16_reference(1 + 3 * 2**-8) == 1 + 2**-6
    assert bf16_reference(1 + 2**-8 + 2**-20) == 1 + 2**-7


def test_known_bit_patterns():
    vals = np.array([0.0, -0.0, 1.0, -2.0, 0.5, np.inf, -np.inf, 3.140625], dtype=np.float32)
    bits = to_bfloat16_bits(vals)
    assert bits.dtype == np.uint16
    assert bits.tolist() == [0x0000, 0x8000, 0x3F80, 0xC000, 0x3F00, 0x7F80, 0xFF80, 0x4049]


def test_ties_round_to_even():
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20], dtype=np.float32)
    assert roundtrip(x).tolist() == [1.0, 1 + 2**-6, -1.0, 1 + 2**-7]


def test_overflow_to_infinity_and_largest_finite():
    f32_max = float(np.finfo(np.float32).max)
    out = roundtrip([f32_max, -f32_max, BF16_MAX])
    assert out[0] == np.inf and out[1] == -np.inf
    assert out[2] == BF16_MAX


def test_nan_and_inf():
    x = np.array([np.nan, -np.nan, np.inf, -np.inf], dtype=np.float32)
    out = roundtrip(x)
    assert np.isnan(out[0]) and np.isnan(out[1])
    assert out[2] == np.inf and out[3] == -np.inf
    # a NaN bit pattern of any payload stays NaN through both directions
    nan_bits = np.array([0x7F81, 0x7FC0, 0xFFFF, 0xFF81], dtype=np.uint16)
    back = from_bfloat16_bits(nan_bits)
    assert np.isnan(back).all()
    assert np.isnan(from_bfloat16_bits(to_bfloat16_bits(back))).all()


def test_shape_and_input_layout():
    x = np.arange(24, dtype=np.float64).reshape(2, 3, 4)[:, ::2]  # non-contiguous float64
    bits = to_bfloat16_bits(x)
    assert bits.shape == x.shape and bits.dtype == np.uint16
    assert np.array_equal(from_bfloat16_bits(bits), x.astype(np.float32))
    back = from_bfloat16_bits(bits)
    assert back.dtype == np.float32 and back.shape == x.shape


finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=500, deadline=None)
@given(st.integers(min_value=0, max_value=0xFFFF))
def test_every_bfloat16_value_round_trips_exactly(pattern):
    bits = np.array([pattern], dtype=np.uint16)
    value = from_bfloat16_bits(bits)
    assert value.dtype == np.float32
    if np.isnan(value[0]):
        assert (pattern & 0x7F80) == 0x7F80 and (pattern & 0x7F) != 0
        assert np.isnan(from_bfloat16_bits(to_bfloat16_bits(value))[0])
    else:
        assert to_bfloat16_bits(value)[0] == pattern


def test_all_bfloat16_values_round_trip_exactly_exhaustive():
    bits = np.arange(0x10000, dtype=np.uint32).astype(np.uint16)
    values = from_bfloat16_bits(bits)
    finite_or_inf = ~np.isnan(values)
    assert np.array_equal(to_bfloat16_bits(values)[finite_or_inf], bits[finite_or_inf])
    assert np.isnan(from_bfloat16_bits(to_bfloat16_bits(values[~finite_or_inf]))).all()


@settings(max_examples=1000, deadline=None)
@given(st.lists(finite_f32, min_size=1, max_size=16))
def test_rounding_matches_float64_reference(xs):
    out = roundtrip(xs)
    for x, got in zip(np.asarray(xs, dtype=np.float32).tolist(), out.tolist()):
        want = bf16_reference(x)
        assert got == want, (x.hex(), got, want)
        if want == 0.0:
            assert math.copysign(1.0, got) == math.copysign(1.0, x)  # signed zero kept


@settings(max_examples=300, deadline=None)
@given(finite_f32)
def test_rounding_error_is_at_most_half_an_ulp(x):
    got = float(roundtrip([x])[0])
    if math.isinf(got):
        assert abs(x) >= BF16_MAX
        return
    _, e = math.frexp(abs(x)) if x else (0, -125)
    ulp = 2.0 ** (max(e - 1, -126) - 7)
    assert abs(got - x) <= ulp / 2
