"""The elementwise ops on the host, for fallback mode (no GPU): NumPy with the kernels'
formulas, in the GPU's compute type (half types in float32), rounded once on store as the
kernels round; `reference()` in `elementwise` uses the same formulas in float64.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict

import numpy as np

from ..dtypes import CudaDataType, to_bfloat16_bits
from ..errors import InvalidArgumentError
from ..tensor import CudaTensor
from . import common

DT = CudaDataType


def compute_type(dtype: CudaDataType) -> np.dtype:
    """The NumPy type the op computes in, as on the GPU (half types in float32)."""
    if dtype in (DT.FLOAT16, DT.BFLOAT16):
        return np.dtype(np.float32)
    return dtype.numpy_dtype


def host_values(m: Any, t: CudaTensor) -> np.ndarray:
    return common.host_array(m, t).astype(compute_type(t.dtype), copy=False)


def store_host(m: Any, values: np.ndarray, out: CudaTensor) -> CudaTensor:
    """Write computed values into out, rounding once to its dtype."""
    values = np.asarray(values).reshape(out.shape)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf, as the GPU rounds
        if out.dtype is DT.BFLOAT16:
            host = to_bfloat16_bits(values.astype(np.float32)).reshape(out.shape)
        else:
            host = np.ascontiguousarray(values, dtype=out.dtype.numpy_dtype)
    m.backend.copy_to_device(host, out)
    return out


NP_BINARY: Dict[str, Callable] = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": np.divide,
    "maximum": np.maximum, "minimum": np.minimum, "power": np.power,
}

# the unary ops that are one NumPy function; np_unary writes the others out
NP_UNARY: Dict[str, Callable] = {
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "abs": np.abs, "tanh": np.tanh,
    "negative": np.negative,
}

_erfc = np.frompyfunc(math.erfc, 1, 1)


def np_unary(op: str, x: np.ndarray, alpha: float) -> np.ndarray:
    """The unary ops in NumPy, with the formulas the kernels use."""
    plain = NP_UNARY.get(op)
    if plain is not None:
        return plain(x)
    t = x.dtype.type
    one = t(1)
    if op == "relu":
        return np.where(x < 0, t(0), x)
    if op == "sigmoid":
        return one / (one + np.exp(-x))
    if op == "silu":
        return x / (one + np.exp(-x))
    if op == "gelu":
        return x / (one + np.exp(t(-1.5957691216057308) * (x + t(0.044715) * x * x * x)))
    if op == "gelu_exact":
        # np.asarray: frompyfunc gives a plain float (no .astype) for a 0-d input
        erfc = np.asarray(_erfc(x * t(-0.7071067811865476)), dtype=np.float64).astype(x.dtype)
        return np.asarray(t(0.5) * x * erfc, dtype=x.dtype)
    if op == "leaky_relu":
        return np.where(x > 0, x, t(alpha) * x)
    if op == "elu":
        return np.where(x > 0, x, t(alpha) * np.expm1(x))
    raise InvalidArgumentError(f"unknown unary op {op!r}")


def binary_host(m: Any, op: str, a: Any, b: Any, sv: Any, mode: int,
                res: CudaTensor) -> CudaTensor:
    """Fallback: the same op in NumPy, in the GPU's compute type, rounded once."""
    ct = compute_type(res.dtype)
    x = host_values(m, a) if mode != 2 else np.asarray(sv, dtype=ct)
    y = host_values(m, b) if mode != 1 else np.asarray(sv, dtype=ct)
    with np.errstate(all="ignore"):
        values = NP_BINARY[op](x, y)
    return store_host(m, np.broadcast_to(values, res.shape), res)
