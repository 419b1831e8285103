"""concatenate and stack (NumPy's semantics): pieces joined in one "cat" launch per 8 of
them (templates/strided_copy.cu.j2, ops/shape_copy.py plan_cat / run_cat), other layouts
through per-piece strided copies, each with its per-call plan (ops/common.py remember_plan).
Part of the "shape" family: ops/shape.py re-exports them.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional

import numpy as np

from ..errors import InvalidArgumentError, ShapeMismatchError
from ..tensor import CudaTensor
from . import common
from .shape_copy import cat_plan, plan_cat, record, run_cat, strided_copy
from .shape_layouts import contiguous_strides, make_view, one_axis


def _tensor_list(tensors: Any, what: str) -> List[CudaTensor]:
    if isinstance(tensors, CudaTensor) or not isinstance(tensors, (list, tuple)):
        raise InvalidArgumentError(
            f"{what} takes a list or tuple of CudaTensors, got {type(tensors).__name__}")
    if not tensors:
        raise InvalidArgumentError(f"{what} needs at least one tensor")
    out = [common.check_tensor(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    common.same_device(*out)
    common.same_dtype(*out)
    return out


def concatenate(m: Any, tensors: Any, axis: Optional[int] = 0) -> CudaTensor:
    """np.concatenate: tensors of one dtype whose shapes agree except along axis (None:
    flattened first); one "cat" launch per 8 non-empty inputs (the result as rows of the
    dims before axis, each input a contiguous run of every row)."""
    key = _concat_key(m, tensors, axis)
    if key is not None:
        res = common.planned(m, key, tensors) if m.backend.direct_launch(key[3]) else None
        if res is not None:
            return res
    ts = _tensor_list(tensors, "concatenate")
    if axis is None:
        ts = [make_view(t, (t.size,)) for t in ts]
        axis = 0
    nd = ts[0].ndim
    if nd == 0:
        raise ShapeMismatchError("zero-dimensional tensors cannot be concatenated")
    for i, t in enumerate(ts[1:], 1):
        if t.ndim != nd:
            raise ShapeMismatchError(
                f"concatenate: all the input tensors must have the same number of dimensions, "
                f"but the tensor at index 0 has {nd} dimension(s) and the tensor at index {i} "
                f"has {t.ndim} dimension(s)")
    ax = one_axis(axis, nd, "concatenate")
    first = ts[0].shape
    for i, t in enumerate(ts[1:], 1):
        for d in range(nd):
            if d != ax and t.shape[d] != first[d]:
                raise ShapeMismatchError(
                    f"concatenate: all the input tensor dimensions except for the "
                    f"concatenation axis must match exactly, but along dimension {d}, the "
                    f"tensor at index 0 has size {first[d]} and the tensor at index {i} has "
                    f"size {t.shape[d]}")
    shape = first[:ax] + (sum(t.shape[ax] for t in ts),) + first[ax + 1:]
    out = m.backend.empty(shape, ts[0].dtype, ts[0].device_id)
    if out.size == 0:
        return out
    ostr = contiguous_strides(shape)
    if not m.gpu:
        off = 0
        for t in ts:
            strided_copy(m, t, 0, contiguous_strides(t.shape), out, off * ostr[ax], ostr,
                         t.shape)
            off += t.shape[ax]
        return out
    dev, dtype = out.device_id, out.dtype
    rows = math.prod(shape[:ax])
    sources = [i for i, t in enumerate(ts) if t.size]
    pieces = [ts[i] for i in sources]
    addrs = [t.ptr for t in pieces]
    launches = plan_cat(rows, [t.size // rows * dtype.itemsize for t in pieces], addrs,
                        out.ptr, False)
    record(dev, out, *pieces)
    run_cat(m, dev, launches, addrs, out.ptr)
    if key is not None:
        common.remember_plan(m, key, cat_plan(m, dev, launches, sources, addrs, shape, dtype,
                                              out.ptr))
    return out


def _concat_key(m: Any, tensors: Any, axis: Any) -> Optional[tuple]:
    """concatenate's plan key (every input's shape, the first's dtype and device, the axis),
    or None: no plan for this call (not a list or tuple of CudaTensors, axis not an int)."""
    if not m.gpu or type(axis) is not int or type(tensors) not in (list, tuple) or \
            not tensors:
        return None
    shapes = []
    for t in tensors:
        if type(t) is not CudaTensor:
            return None
        shapes.append(t.shape)
    t0 = tensors[0]
    return ("concatenate", tuple(shapes), t0.dtype, t0.device_id, axis)


def stack(m: Any, tensors: Any, axis: int = 0) -> CudaTensor:
    """np.stack: tensors of one shape and dtype joined along a new axis (concatenate of
    views with a size-1 axis there; a per-call plan runs concatenate's plan on the inputs
    themselves, whose pointers those views share)."""
    key = _concat_key(m, tensors, axis)
    if key is not None:
        key = ("stack",) + key[1:]
        res = common.planned(m, key, tensors) if m.backend.direct_launch(key[3]) else None
        if res is not None:
            return res
    ts = _tensor_list(tensors, "stack")
    shape = ts[0].shape
    for i, t in enumerate(ts[1:], 1):
        if t.shape != shape:
            raise ShapeMismatchError(
                f"stack: all input tensors must have the same shape, but the tensor at index 0 "
                f"has shape {shape} and the tensor at index {i} has shape {t.shape}")
    ax = one_axis(axis, len(shape) + 1, "stack")
    new = shape[:ax] + (1,) + shape[ax:]
    views = [make_view(t, new) for t in ts]
    out = concatenate(m, views, ax)
    if key is not None:
        copies = m.plans.get(_concat_key(m, views, ax))
        if copies is not None:
            common.remember_plan(m, key, copies)
    return out
