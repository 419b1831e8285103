"""scatter_add (np.add.at along an axis, in place; the embedding backward): the bounds-checked
launch of indexing.cu.j2's scatter kernel, its per-call plan and the fallback's np.add.at.
Part of the "indexing" family: ops/indexing.py re-exports it (see its module doc for the
bounds check and the atomics' order).
"""
from __future__ import annotations

import math
from typing import Any, Tuple, cast

import numpy as np

from ..errors import IndexOutOfRangeError, InvalidArgumentError, ShapeMismatchError
from ..tensor import CudaTensor
from . import common
from .indexing_bounds import (bounds_slot, checked_indices, host_indices, raise_bounds,
                              refuse_capture)
from .indexing_kernels import (BLOCK, SCATTER_DTYPES, TEMPLATE, check_dims, scatter_params)
from .shape_copy import MAX_DIMS, grid_blocks, record
from .shape_layouts import collapse, contiguous_strides, dims_args, one_axis, pad


# -- scatter_add --------------------------------------------------------------------------------
def _host_scatter_add(m: Any, target: CudaTensor, idx: CudaTensor, src: CudaTensor, ax: int,
                      size: int, check_bounds: bool) -> CudaTensor:
    """scatter_add in fallback mode: np.add.at on the host copies (bad indices add nothing
    and raise after the good ones were added, as the GPU path's check does)."""
    j, bad = host_indices(idx.host_view, size, check_bounds, "scatter_add", ax)
    vals = common.host_array(m, src)
    if bad.any():
        mask = bad.reshape((1,) * ax + idx.shape + (1,) * (target.ndim - ax - 1))
        vals = np.where(mask, np.zeros((), vals.dtype), vals)
    acc = common.host_array(m, target).copy()
    with np.errstate(all="ignore"):
        np.add.at(acc, cast(Any, (slice(None),) * ax + (j,)), vals)
    from .elementwise_host import store_host
    store_host(m, acc, target)
    if check_bounds and bad.any():
        raise_bounds("scatter_add", ax, size)
    return target


def scatter_add(m: Any, target: CudaTensor, indices: Any, src: CudaTensor, axis: int = 0,
                check_bounds: bool = True) -> CudaTensor:
    """np.add.at(target, (:,) * axis + (indices,), src), in place; returns target."""
    if type(target) is CudaTensor and type(indices) is CudaTensor and type(axis) is int and \
            type(check_bounds) is bool:
        fast = m.plans.get(("scatter_add", target.shape, target.dtype, indices.shape,
                            indices.dtype, target.device_id, axis, check_bounds))
        if fast is not None and fast(target, indices, src):
            return target
    target = common.check_tensor(target, "target")
    idx = checked_indices(indices, "scatter_add")
    src = common.check_tensor(src, "src")
    common.same_device(target, idx, src)
    common.require_dtype(target, SCATTER_DTYPES, "scatter_add")
    common.same_dtype(target, src)
    if target.ndim == 0:
        raise InvalidArgumentError("scatter_add needs a target of at least 1 dimension")
    ax = one_axis(axis, target.ndim, "scatter_add")
    expected = target.shape[:ax] + idx.shape + target.shape[ax + 1:]
    if src.shape != expected:
        raise ShapeMismatchError(
            f"scatter_add: src has shape {src.shape}, expected target.shape[:axis] + "
            f"indices.shape + target.shape[axis+1:] = {expected}")
    size = target.shape[ax]
    if src.size == 0:
        return target
    if size == 0:
        raise IndexOutOfRangeError(f"scatter_add: cannot add into axis {ax} of size 0")
    if not m.gpu:
        return _host_scatter_add(m, target, idx, src, ax, size, check_bounds)
    dev = target.device_id
    ts, ids = contiguous_strides(target.shape), contiguous_strides(idx.shape)
    k = idx.ndim
    s_t = ts[:ax] + [0] * k + ts[ax + 1:]
    s_i = [0] * ax + ids + [0] * (target.ndim - ax - 1)
    sizes, (st, si) = collapse(src.shape, s_t, s_i)
    check_dims(len(sizes), src.shape, "scatter_add")
    n = src.size
    name = m.kernel(TEMPLATE, dev, **scatter_params(target.dtype, idx.dtype)).name
    refuse_capture("scatter_add", dev, check_bounds)
    record(dev, target, idx, src)
    args = [n, size, ts[ax], len(sizes)] + dims_args(sizes[::-1], 64, MAX_DIMS) + \
        pad(st[::-1], MAX_DIMS) + pad(si[::-1], MAX_DIMS)
    slot = bounds_slot(m, "scatter_add", ax, size) if check_bounds else 0   # (the kernel's)
    m.backend.launch_kernel(name, grid_blocks(n, BLOCK), target, src, idx, *args, slot,
                            block_size=(BLOCK, 1, 1), device_id=dev)
    if type(axis) is int and type(check_bounds) is bool:
        key = ("scatter_add", target.shape, target.dtype, idx.shape, idx.dtype, dev, axis,
               check_bounds)
        if key not in m.plans:
            common.remember_plan(m, key, _scatter_plan(m, name, target, idx, src.shape, ax,
                                                       tuple(args), check_bounds))
    return target


def _scatter_plan(m: Any, name: str, target: CudaTensor, idx: CudaTensor,
                  src_shape: Tuple[int, ...], ax: int, args: tuple, check_bounds: bool) -> Any:
    """The per-call plan of scatter_add into targets shaped like this one (ops/common.py
    remember_plan): run(target, indices, src) -> True once the adds are queued (and, with
    check_bounds, the indices checked), False (the general path then runs, with its errors)
    unless every operand is live, on the plan's device and on no stream, and src of the
    plan's shape and dtype."""
    backend = m.backend
    dev, shape, dtype = target.device_id, target.shape, target.dtype
    size, n = shape[ax], math.prod(src_shape)
    go = backend.prepare_launch(backend.get_kernel(name, dev), (grid_blocks(n, BLOCK), 1, 1),
                                (BLOCK, 1, 1), 0, dev)
    slot = bounds_slot(m, "scatter_add", ax, size) if check_bounds else 0
    direct = backend.direct_launch
    plan_pointer = common.plan_pointer

    def run(target: CudaTensor, indices: CudaTensor, src: Any) -> bool:
        pt = plan_pointer(target, shape, dtype, dev)
        ps = plan_pointer(src, src_shape, dtype, dev)
        pi = indices._ptr
        if pt is None or ps is None or pi is None or indices.device_id != dev or \
                indices.stream is not None or not direct(dev):
            return False
        refuse_capture("scatter_add", dev, check_bounds)
        go(pt, ps, pi, *args, slot)
        return True
    return run
