"""Reductions: sum, mean, max, min over any axes, and argmax.

Result dtypes follow NumPy where the backend can represent them: float inputs keep their
dtype (float16/bfloat16/float32 accumulate in float32, float64 in double); int32 and int64
sums return int64 (NumPy's int32 sum is int64); int means return float64; int max/min keep
the input dtype; argmax returns int64. max/min/argmax propagate NaN like NumPy (argmax
returns the first NaN). Empty reductions: sum gives 0, mean gives NaN (without NumPy's
warning), max/min/argmax raise InvalidArgumentError.

Kernels (all deterministic: a fixed summation order for a given shape and device):
- `reduce.cu.j2`, contiguous rows ([rows][R], the reduced axes innermost; a full reduction
  is one row): a group of 1-32 lanes per short row, or one block per row with 16-byte loads,
  several loads in flight per thread and, when there are few rows, several blocks per row
  whose partials the last block to finish folds (atomic ticket), all in one launch.
- `reduce_axis.cu.j2`, a middle axis ([outer][R][inner]): threads map to inner columns for
  coalesced (16-byte where aligned) loads and walk R; few columns split R over blocks the
  same way.
Reductions over several non-adjacent axes run as successive single-axis passes, innermost
reduced axis first; the intermediates have the pass's result dtype (float16/bfloat16
intermediates are rounded to the input dtype).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..dtypes import CudaDataType, to_bfloat16_bits
from ..errors import InvalidArgumentError, ShapeMismatchError, DTypeMismatchError
from ..tensor import CudaTensor
from . import common
from .reduction_config import (AXIS_TEMPLATE, ROWS_TEMPLATE, kernel_params, reduced_shape,
                               result_dtype)
from .reduction_passes import gpu_reduce

OPS = ("sum", "mean", "max", "min")
SUPPORTED = common.FLOATS + (CudaDataType.INT32, CudaDataType.INT64)
TEMPLATES = (ROWS_TEMPLATE, AXIS_TEMPLATE)

_NUMPY_OPS: Dict[str, Callable[..., Any]] = {"sum": np.sum, "mean": np.mean, "max": np.max,
                                             "min": np.min}


# -- the contract -----------------------------------------------------------------------
def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set this module renders: each supported dtype x kernel op, per template."""
    sets: List[Dict[str, Any]] = []
    for dt in SUPPORTED:
        for op in ("sum", "mean", "max", "min", "argmax"):
            params = kernel_params(dt, op)
            if params not in sets:
                sets.append(params)
    return {ROWS_TEMPLATE: [dict(p) for p in sets], AXIS_TEMPLATE: [dict(p) for p in sets]}


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every reduction variant in parallel threads (nvcc runs in subprocesses);
    returns how many were compiled (0 in fallback mode). Later calls find them memoized."""
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets]
    return common.compile_all(m, jobs, device_id, workers)


def reference(op: str, x: Any, axis: Any = None, keepdims: bool = False) -> np.ndarray:
    """op ("sum", "mean", "max", "min" or "argmax") over axis in float64 NumPy (argmax: the
    int64 index of the first maximum, one axis or the flattened array)."""
    a = np.asarray(x, dtype=np.float64)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        if op == "argmax":
            return np.asarray(np.argmax(a, axis=axis, keepdims=bool(keepdims)), np.int64)
        fn = _NUMPY_OPS[op]
        return np.asarray(fn(a, axis=axis, keepdims=bool(keepdims)), dtype=np.float64)


# -- public API ----------------------------------------------------------------------------
def reduce(m: Any, op: str, x: CudaTensor, axis: Any = None, keepdims: bool = False,
           out: Optional[CudaTensor] = None) -> CudaTensor:
    """op ("sum", "mean", "max", "min") over `axis` (None: all, an int or a tuple), like
    NumPy's; `out` (optional) must have the result's shape, dtype and device."""
    if out is None and type(x) is CudaTensor:
        key = _plan_key(_NAMES.get(op) if type(op) is str else None, x, axis, keepdims)
        res = _run_plan(m, key, x)
        if res is not None:
            return res
    else:
        key = None
    if op not in OPS:
        raise InvalidArgumentError(f"unknown reduction '{op}'; expected one of {', '.join(OPS)}")
    x = common.check_tensor(x, "tensor")
    common.require_dtype(x, SUPPORTED, f"reduce_{op}")
    if not (axis is None or isinstance(axis, (int, np.integer, tuple, list))):
        # (normalize_axes would try to iterate it and raise a plain TypeError)
        raise InvalidArgumentError(f"axis must be an int, a tuple of ints or None, got {axis!r}")
    axes = common.normalize_axes(axis, x.ndim)
    count = math.prod(x.shape[a] for a in axes)
    if count == 0 and op in ("max", "min"):
        raise InvalidArgumentError(
            f"zero-size reduction: reduce_{op} over axes {axes} of a tensor of shape {x.shape} "
            f"has no identity")
    dtype = result_dtype(x.dtype, op)
    shape = reduced_shape(x.shape, axes, bool(keepdims))
    _check_out(out, shape, dtype, x, f"reduce_{op}")
    if not m.gpu or count == 0 or x.size == 0:
        values = _host_reduce(m, op, x, axes, bool(keepdims)) if x.size else \
            np.full(shape, 0 if op == "sum" else np.nan, dtype=_host_dtype(dtype))
        return host_result(m, values, dtype, x.device_id, out)
    return gpu_reduce(m, op, x, axes, shape, dtype, count, out, key)


def argmax(m: Any, x: CudaTensor, axis: Optional[int] = None, keepdims: bool = False,
           out: Optional[CudaTensor] = None) -> CudaTensor:
    """Index (int64) of the first maximum over the flattened tensor (axis None) or one axis;
    NaN counts as the maximum, like NumPy."""
    key = None
    if out is None and type(x) is CudaTensor:
        key = _plan_key("argmax", x, axis, keepdims)
        res = _run_plan(m, key, x)
        if res is not None:
            return res
    x = common.check_tensor(x, "tensor")
    common.require_dtype(x, SUPPORTED, "argmax")
    if (axis is not None and not isinstance(axis, (int, np.integer))) or isinstance(axis, bool):
        raise InvalidArgumentError(f"argmax takes one axis (an int) or None, got {axis!r}")
    axes = common.normalize_axes(axis, x.ndim)
    count = math.prod(x.shape[a] for a in axes)
    if count == 0:
        raise InvalidArgumentError(
            f"zero-size reduction: argmax over axes {axes} of a tensor of shape {x.shape} "
            f"has no identity (attempt to get argmax of an empty sequence)")
    if axis is None:
        shape = (1,) * x.ndim if keepdims else ()
    else:
        shape = reduced_shape(x.shape, axes, bool(keepdims))
    _check_out(out, shape, CudaDataType.INT64, x, "argmax")
    if not m.gpu or x.size == 0:
        if x.size:
            a = common.host_array(m, x)
            values = np.argmax(a, axis=None if axis is None else int(axis),
                               keepdims=bool(keepdims))
        else:
            values = np.zeros(shape, np.int64)
        return host_result(m, np.asarray(values).reshape(shape), CudaDataType.INT64,
                            x.device_id, out)
    return gpu_reduce(m, "argmax", x, axes, shape, CudaDataType.INT64, count, out, key)


# -- per-call plans (ops/common.py remember_plan) -------------------------------------------
_NAMES = {op: "reduce_" + op for op in OPS}   # op -> the public name that starts a plan key


def _plan_key(name: Optional[str], x: CudaTensor, axis: Any, keepdims: Any) -> Optional[tuple]:
    """The key of the per-call plan of `name` ("reduce_sum", ..., "argmax") on x, or None
    where the call takes the general path: axis must be None, an int or a tuple of ints and
    keepdims a bool (other values that compare and hash equal to these, 1.0 or True for 1,
    must meet the general path's checks). With the shape in the key, equal keys mean equal
    normalized axes (axis=-1 and axis=1 just keep two plans)."""
    if name is None or type(keepdims) is not bool:
        return None
    if axis is not None and type(axis) is not int:
        if type(axis) is not tuple:
            return None
        for a in axis:
            if type(a) is not int:
                return None
    return (name, x.shape, x.dtype, axis, keepdims, x.device_id)


def _run_plan(m: Any, key: Optional[tuple], x: CudaTensor) -> Optional[CudaTensor]:
    """The result of the per-call plan under key for x, or None: no key, no plan made yet,
    no direct launch on x's device, or the plan stepped aside (the general path runs)."""
    if key is not None:
        fast = m.plans.get(key)
        if fast is not None and m.backend.direct_launch(x.device_id):
            return fast(x)
    return None


# -- checks and host side ------------------------------------------------------------------
def _check_out(out: Optional[CudaTensor], shape: Tuple[int, ...], dtype: CudaDataType,
               x: CudaTensor, what: str) -> None:
    if out is None:
        return
    common.check_tensor(out, "out")
    common.same_device(x, out)
    if out.dtype is not dtype:
        raise DTypeMismatchError(
            f"{what}: out has dtype {out.dtype.name_str}, but the result of {x.dtype.name_str} "
            f"input is {dtype.name_str}")
    if out.shape != shape:
        raise ShapeMismatchError(f"{what}: out has shape {out.shape}, the result has shape {shape}")


def _host_dtype(dtype: CudaDataType) -> np.dtype:
    return np.dtype(np.float32) if dtype is CudaDataType.BFLOAT16 else dtype.numpy_dtype


def _host_reduce(m: Any, op: str, x: CudaTensor, axes: Tuple[int, ...],
                 keepdims: bool) -> np.ndarray:
    """Fallback: the same reduction in NumPy (halves accumulate in float32, like the kernels)."""
    a = common.host_array(m, x)
    if x.dtype is CudaDataType.FLOAT16:
        a = a.astype(np.float32)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        fn = _NUMPY_OPS[op]
        r = fn(a, axis=axes, keepdims=keepdims)
    return np.asarray(r).astype(_host_dtype(result_dtype(x.dtype, op)))


def host_result(m: Any, values: np.ndarray, dtype: CudaDataType, dev: int,
                 out: Optional[CudaTensor]) -> CudaTensor:
    """values (host) as a new tensor, or written into out."""
    values = np.asarray(values)
    if out is None:
        return common.from_host(m, values, dtype, dev)
    if out.size:
        if dtype is CudaDataType.BFLOAT16:
            host = to_bfloat16_bits(values.astype(np.float32)).reshape(out.shape)
        else:
            host = np.ascontiguousarray(values, dtype=dtype.numpy_dtype).reshape(out.shape)
        m.backend.copy_to_device(host, out)
    return out
