"""`CudaDataType`: the element types tensors and templates support.

NumPy has no bfloat16 of its own; `ml_dtypes.bfloat16` (a dependency) is the NumPy dtype the
ecosystem (JAX, PyTorch's and CuPy's interop) shares, so `to_numpy` returns it and `from_numpy`
takes it (`array_dtype`). Storage is still handled as uint16 bit patterns (`numpy_dtype`:
host views, copies); `to_bfloat16_bits` / `from_bfloat16_bits` convert explicitly between
float32 and those patterns (round to nearest even).

Members compare equal to the NumPy dtypes, types and names they stand for
(`CudaDataType.FLOAT32 == np.float32 == "float32"`) but hash by identity, as before: `is`
comparisons and dicts keyed by members are unchanged.
"""
from __future__ import annotations

import enum
from typing import Any, Union

import ml_dtypes
import numpy as np

from .errors import DTypeMismatchError

BFLOAT16_NUMPY = np.dtype(ml_dtypes.bfloat16)   # '<V2' as a typestr: NumPy sees a 2-byte void


class CudaDataType(enum.Enum):
    """Element type: its NumPy host dtype, item size and the C type templates use."""

    FLOAT32 = ("float32", "float", "f4")
    FLOAT64 = ("float64", "double", "f8")
    FLOAT16 = ("float16", "__half", "f2")
    BFLOAT16 = ("bfloat16", "__nv_bfloat16", "bf16")
    INT32 = ("int32", "int", "i4")
    INT64 = ("int64", "long long", "i8")
    UINT8 = ("uint8", "unsigned char", "u1")
    BOOL = ("bool", "bool", "b1")

    # members are singletons: hash by identity in C (Enum's own __hash__ is Python code, and
    # dtypes are in the key of every per-call plan)
    __hash__ = object.__hash__

    def __eq__(self, other: Any) -> Any:
        """A member equals itself, and the NumPy dtype, type or name it stands for
        (`dtype == np.float32`, `dtype == "bf16"`); never raises. Members hash by identity, so
        a dict keyed by members is not looked up by names: use `from_any` for that."""
        if type(other) is CudaDataType:
            return self is other
        if isinstance(other, (str, np.dtype, type)):
            hit = _EQUAL.get(other)
            if hit is None:
                hit = _equal_member(other)
            return self is hit
        return NotImplemented

    @property
    def name_str(self) -> str:
        """Short name, as NumPy and PyTorch spell it ('float32', 'bfloat16')."""
        return self.value[0]

    @property
    def c_type(self) -> str:
        """The C/CUDA type name templates declare ('float', '__nv_bfloat16')."""
        return self.value[1]

    @property
    def numpy_dtype(self) -> np.dtype:
        """Host storage dtype (host views, copies); BFLOAT16 maps to uint16 (its bit pattern)."""
        return _NUMPY[self]

    @property
    def array_dtype(self) -> np.dtype:
        """The dtype of the arrays `to_numpy` returns and `from_numpy` takes as they are:
        numpy_dtype, but ml_dtypes.bfloat16 for BFLOAT16 (same bits, NumPy arithmetic)."""
        return BFLOAT16_NUMPY if self is CudaDataType.BFLOAT16 else _NUMPY[self]

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_floating(self) -> bool:
        return self in _FLOATING    # a set: found by identity, no __eq__ call

    @property
    def typestr(self) -> str:
        """The `__cuda_array_interface__` typestr; bfloat16 has none and raises."""
        if self is CudaDataType.BFLOAT16:
            raise DTypeMismatchError(
                "bfloat16 has no __cuda_array_interface__ typestr of its own (it would be the "
                "opaque '<V2'); share bfloat16 tensors through DLPack (torch.from_dlpack(t), "
                "cupy.from_dlpack(t)), or convert to float32 or float16 first")
        return self.numpy_dtype.str

    @classmethod
    def from_any(cls, value: Union["CudaDataType", str, np.dtype, type]) -> "CudaDataType":
        """Accept a CudaDataType, a name ('float32', 'bf16'), a NumPy dtype or type."""
        if isinstance(value, CudaDataType):     # (cls: an enum with members has no subclass)
            return value
        if value is None:
            raise DTypeMismatchError("dtype must be given, got None")
        if isinstance(value, str):
            key = value.lower()
            aliases = {"bf16": "bfloat16", "half": "float16", "float": "float32",
                       "double": "float64", "fp32": "float32", "fp16": "float16",
                       "fp64": "float64"}
            key = aliases.get(key, key)
            for member in cls:
                if member.name_str == key:
                    return member
        try:
            dt = np.dtype(value)
        except TypeError:
            dt = None
        if dt is not None:
            if dt == BFLOAT16_NUMPY:
                return CudaDataType.BFLOAT16
            dt = dt.newbyteorder("=") if dt.byteorder not in ("=", "|") else dt
            for member in cls:
                if member is not CudaDataType.BFLOAT16 and member.numpy_dtype == dt:
                    return member
        supported = ", ".join(m.name_str for m in cls)
        raise DTypeMismatchError(f"unsupported dtype {value!r}: expected one of {supported}")

    @classmethod
    def from_typestr(cls, typestr: str) -> "CudaDataType":
        return cls.from_any(np.dtype(typestr))

    def __repr__(self) -> str:
        return f"CudaDataType.{self.name}"


_NUMPY = {m: np.dtype(np.uint16) if m is CudaDataType.BFLOAT16 else np.dtype(m.value[0])
          for m in CudaDataType}
_ITEMSIZE = {m: dt.itemsize for m, dt in _NUMPY.items()}
_FLOATING = frozenset((CudaDataType.FLOAT32, CudaDataType.FLOAT64, CudaDataType.FLOAT16,
                       CudaDataType.BFLOAT16))
_EQUAL: dict = {}   # names, NumPy dtypes and types already compared -> member (or None)


def _equal_member(other: Union[str, np.dtype, type]) -> Any:
    """The member a name, NumPy dtype or type stands for (as from_any), False for none;
    remembered in _EQUAL."""
    try:
        hit: Any = CudaDataType.from_any(other)
    except (DTypeMismatchError, TypeError, ValueError):
        hit = False
    if len(_EQUAL) < 1024:
        _EQUAL[other] = hit
    return hit


_HOST: dict = {}   # host arrays' NumPy dtypes -> member, as from_any gives it


def from_host_dtype(dt: np.dtype) -> CudaDataType:
    """CudaDataType.from_any(dt) for a host array's dtype, remembered (from_any scans the
    members; a process meets few host dtypes, at most 64 are kept): the host-to-device
    copies' per-call lookup."""
    hit = _HOST.get(dt)
    if hit is None:
        hit = CudaDataType.from_any(dt)
        if len(_HOST) < 64:
            _HOST[dt] = hit
    return hit


def to_bfloat16_bits(array: np.ndarray) -> np.ndarray:
    """float32 (or anything castable) -> uint16 bfloat16 bit patterns, round to nearest even."""
    a = np.ascontiguousarray(array, dtype=np.float32)
    bits = a.view(np.uint32)
    nan = np.isnan(a)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    out[nan] = np.uint16(0x7FC0)
    return out


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32 (exact)."""
    b = np.ascontiguousarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)
