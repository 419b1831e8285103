"""The elementwise kernels: which ops and dtypes exist, how `templates/elementwise.cu.j2` is
rendered and sized for them, the compiled kernels per device, and the conversion of a Python
scalar into a kernel argument.

Every other elementwise module (the entry points in `elementwise`, the per-call plans in
`elementwise_plans`, the broadcast launches in `elementwise_broadcast`) builds on these
tables, so they live apart from all of them. One render per (kind, op, dtype): kinds
"binary", "broadcast" and "unary" (the `elementwise` module docstring says what each does).
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np

from ..dtypes import CudaDataType, from_bfloat16_bits, to_bfloat16_bits
from ..errors import DTypeMismatchError, InvalidArgumentError
from ..kernels import dtype_params
from . import common

DT = CudaDataType
FLOATS = common.FLOATS
INTS = (DT.INT32, DT.INT64)
ALL = FLOATS + INTS

TEMPLATE = "elementwise.cu.j2"
# Launch shape, from a sweep on an H200 (2^28 float32; block x unroll, exact grid vs capped
# grid-stride): 128 threads, one 16-byte vector per operand per thread and an exact grid ran
# add/multiply-by-scalar/exp at 1.00/1.02/1.01x PyTorch; 256x4 at 0.99/0.96/0.96x; capping
# the grid at 2 or 8 waves cost 5-10%.
BLOCK = 128          # threads per block
UNROLL = 1           # 16-byte vectors per operand per thread per loop step
FILL_BLOCK = 256     # fill.cu.j2's block size (the parameter sets kernels.py lists)
GRID_MAX = 2**31 - 1

# op -> dtypes it supports
BINARY_OPS: Dict[str, Tuple[CudaDataType, ...]] = {
    "add": ALL, "subtract": ALL, "multiply": ALL, "divide": FLOATS,
    "maximum": ALL, "minimum": ALL, "power": FLOATS,
}
COMMUTATIVE = frozenset({"add", "multiply", "maximum", "minimum"})

# op -> (dtypes, {parameter: default}); a parameter is passed to the kernel as `alpha`.
UNARY_OPS: Dict[str, Tuple[Tuple[CudaDataType, ...], Dict[str, float]]] = {
    "exp": (FLOATS, {}), "log": (FLOATS, {}), "sqrt": (FLOATS, {}), "tanh": (FLOATS, {}),
    "abs": (ALL, {}), "negative": (ALL, {}), "relu": (FLOATS, {}), "sigmoid": (FLOATS, {}),
    "silu": (FLOATS, {}), "gelu": (FLOATS, {}), "gelu_exact": (FLOATS, {}),
    "leaky_relu": (FLOATS, {"alpha": 0.01}), "elu": (FLOATS, {"alpha": 1.0}),
}

# unary ops with a parameter: their plan takes it per call, plan(x, alpha=default)
ALPHA_OPS = frozenset(op for op, (_, p) in UNARY_OPS.items() if p)

BLOCK_DIMS = (BLOCK, 1, 1)
INT_RANGE = {DT.INT32: (-2**31, 2**31 - 1), DT.INT64: (-2**63, 2**63 - 1),
             DT.UINT8: (0, 255), DT.BOOL: (0, 1)}


def _vec(dtype: CudaDataType) -> int:
    """Elements per 16-byte vector."""
    return 16 // dtype.itemsize


def _unroll(op: str, dtype: CudaDataType) -> int:
    """Vectors in flight per thread: UNROLL, except float64 (2; power 1), where the slow paths
    of the math functions are subroutine calls and ptxas spills a few registers around them
    at other counts (seen with -Xptxas -v: exp and sigmoid at 1, divide at 4, power at 2)."""
    if dtype is DT.FLOAT64:
        return 1 if op == "power" else 2
    return UNROLL


def kernel_params(kind: str, op: str, dtype: CudaDataType) -> Dict[str, Any]:
    return {"kind": kind, "op": op, **dtype_params(dtype), "block_size": BLOCK,
            "vec": _vec(dtype), "unroll": _unroll(op, dtype)}


# -- kernels and launch sizing --------------------------------------------------------------
class DeviceCache:
    """Per (CudaMath, device): compiled kernels by (kind, op, dtype) and the SM count."""

    __slots__ = ("kernels", "sm_count")

    def __init__(self, sm_count: int) -> None:
        self.kernels: Dict[tuple, Any] = {}
        self.sm_count = sm_count


def device_cache(m: Any, dev: int) -> DeviceCache:
    caches = m.__dict__.get("_elementwise_cache")
    if caches is None:
        caches = m.__dict__.setdefault("_elementwise_cache", {})
    c = caches.get(dev)
    if c is None:
        c = caches.setdefault(dev, DeviceCache(
            m.backend.get_device_info(dev).multiprocessor_count))
    return c


def kernel_name(m: Any, cache: DeviceCache, dev: int, kind: str, op: str,
                dtype: CudaDataType) -> Tuple[str, int]:
    """(compiled kernel name, items per block-step) for one render; memoized as
    (name, items per block-step, elements per 16-byte vector, the op's default scalar)."""
    key = (kind, op, dtype)
    k = cache.kernels.get(key)
    if k is None:
        params = kernel_params(kind, op, dtype)
        zero: Any = 0.0 if dtype.is_floating else 0
        if kind == "unary":
            for pname, default in UNARY_OPS[op][1].items():
                zero = scalar_arg(dtype, default, pname)
        per_block = BLOCK * params["unroll"]
        cap = GRID_MAX   # one block per BLOCK*UNROLL vectors (an exact grid, see BLOCK)
        k = (m.kernel(TEMPLATE, dev, **params).name, per_block, params["vec"], zero, cap)
        cache.kernels[key] = k
    return k[0], k[1]


def fill_span(dtype: CudaDataType) -> int:
    """Elements one block of fill.cu.j2 stores per step: a 16-byte vector per thread."""
    return FILL_BLOCK * _vec(DT.UINT8 if dtype is DT.BOOL else dtype)


def fill_grid(n: int, dtype: CudaDataType) -> int:
    """Blocks for fill.cu.j2 over n elements: an exact grid, one 16-byte vector per thread
    (as BLOCK's sweep found best for the other elementwise kernels)."""
    return min(-(-n // fill_span(dtype)) or 1, GRID_MAX)


def launch_grid(items: int, per_block: int) -> int:
    """Blocks for `items` work items (vectors or elements), per_block per block-step: an
    exact grid (see BLOCK), within the 2^31 - 1 grid limit."""
    blocks = -(-items // per_block) or 1
    return min(blocks, GRID_MAX)


# -- scalar operands ------------------------------------------------------------------------
def scalar_arg(dtype: CudaDataType, value: Any, what: str) -> Any:
    """A Python scalar in the tensor's dtype, as the kernel argument: float (rounded to the
    dtype first, as NumPy converts a Python float) or int (range-checked)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool):
        value = int(value)
    if not isinstance(value, (int, float)):
        raise InvalidArgumentError(
            f"{what} must be a CudaTensor or a real number, got {type(value).__name__}")
    if dtype.is_floating:
        try:
            v = float(value)
        except OverflowError:
            raise InvalidArgumentError(
                f"{what} = {value} does not fit {dtype.name_str}") from None
        if dtype is DT.FLOAT64:
            return v
        with np.errstate(over="ignore"):
            if dtype is DT.FLOAT32:
                return float(np.float32(v))
            if dtype is DT.FLOAT16:
                return float(np.float16(v))
            return float(from_bfloat16_bits(to_bfloat16_bits(np.array([v], np.float32)))[0])
    if isinstance(value, float):
        if not value.is_integer():
            raise DTypeMismatchError(
                f"{what} = {value!r} is not an integer, but the tensor is {dtype.name_str} "
                f"(scalars take the tensor's dtype)")
        value = int(value)
    lo, hi = INT_RANGE[dtype]
    if not lo <= value <= hi:
        raise InvalidArgumentError(f"{what} = {value} is out of range for {dtype.name_str} "
                                   f"({lo}..{hi})")
    return value

