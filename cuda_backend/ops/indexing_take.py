"""take (np.take: the embedding lookup) and gather (np.take_along_axis), the row-copy
"take_rows" and N-d "gather" kernels of indexing.cu.j2, with their per-call plans; their
semantics, the row copy's floor and the bounds check are ops/indexing.py's module doc.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..errors import IndexOutOfRangeError, InvalidArgumentError, ShapeMismatchError
from ..tensor import CudaTensor, pool_tensor
from . import common
from .indexing_bounds import (bounds_slot, checked_indices, host_indices, launch_or_free,
                              raise_bounds, refuse_capture)
from .indexing_kernels import (BLOCK, ROW_BLOCK, ROW_BLOCKS_PER_SM, ROW_RESIDENT, ROW_UNROLL,
                               TEMPLATE, UNITS, check_dims, gather_params, take_rows_params)
from .shape_layouts import one_axis
from .shape_copy import MAX_DIMS, grid_blocks, record
from .shape_layouts import collapse, contiguous_strides, dims_args, fast_divisor, make_view, pad


def _plan_key(what: str, x: CudaTensor, idx: CudaTensor, axis: Any,
              check_bounds: Any) -> Optional[tuple]:
    """The plan key of take or gather (`what`; ops/common.py remember_plan) for operands
    like x and idx: shapes, dtypes, x's device, the axis and the bounds flag as given; None
    where no plan applies (an axis that is not an int, a flag that is not a bool)."""
    if type(axis) is not int or type(check_bounds) is not bool:
        return None
    return (what, x.shape, x.dtype, idx.shape, idx.dtype, x.device_id, axis, check_bounds)


def _planned(m: Any, what: str, x: Any, indices: Any, axis: Any,
             check_bounds: Any) -> Optional[CudaTensor]:
    """take's or gather's result from its per-call plan, or None (the general path then
    runs): no plan for these operands, or the plan declined (its run checks the rest)."""
    if type(x) is not CudaTensor or type(indices) is not CudaTensor:
        return None
    key = _plan_key(what, x, indices, axis, check_bounds)
    fast = m.plans.get(key) if key is not None else None
    return fast(x, indices) if fast is not None else None


def _operands(x: Any, indices: Any, what: str) -> Tuple[CudaTensor, CudaTensor]:
    """take's or gather's (tensor, indices) after the operand checks: live tensors, integer
    indices, one device."""
    x = common.check_tensor(x, "tensor")
    idx = checked_indices(indices, what)
    common.same_device(x, idx)
    return x, idx


def _result(m: Any, what: str, x: CudaTensor, idx: CudaTensor, shape: Tuple[int, ...],
            size: int, ax: int, check_bounds: bool) -> CudaTensor:
    """take's or gather's result, allocated once the call can go on: IndexOutOfRangeError
    for indices into an empty axis, GraphCaptureError for a bounds-checked call inside a
    capture (refuse_capture)."""
    if size == 0 and idx.size:
        raise IndexOutOfRangeError(f"{what}: cannot take from axis {ax} of size 0")
    refuse_capture(what, x.device_id, check_bounds)
    return m.backend.empty(shape, x.dtype, x.device_id)


def _host_take_indices(idx: CudaTensor, size: int, check_bounds: bool, what: str, ax: int,
                       out: CudaTensor) -> Tuple[np.ndarray, np.ndarray]:
    """Fallback: host_indices of idx, raising IndexOutOfRangeError (out freed first) for an
    index out of range when check_bounds."""
    j, bad = host_indices(idx.host_view, size, check_bounds, what, ax)
    if check_bounds and bad.any():
        out.free()
        raise_bounds(what, ax, size)
    return j, bad


def gather_layouts(shape: Tuple[int, ...], s_src: List[int], s_idx: List[int], ax_size: int,
                   ax_stride: int, itemsize: int, what: str) -> List[Optional[Tuple[int, tuple]]]:
    """The "gather" kernel's (items, arguments after out, x, idx) over out (contiguous, of
    shape): [element-wise (mode 0), 16-byte vectors (mode 1) or None where the layout allows
    none]; mode 1 also needs the source and result pointers 16-byte aligned."""
    sizes, (ss, si) = collapse(shape, s_src, s_idx)
    check_dims(len(sizes), shape, what)
    w = 16 // itemsize
    out: List[Optional[Tuple[int, tuple]]] = []
    for mode in (0, 1):
        if mode:
            if not (w > 1 and ss[-1] == 1 and si[-1] == 0 and sizes[-1] % w == 0 and
                    ax_stride % w == 0 and all(s % w == 0 for s in ss[:-1])):
                out.append(None)
                break
            sizes, ss = sizes[:-1] + [sizes[-1] // w], ss[:-1] + [w]
        items = math.prod(sizes)
        out.append((items, (items, ax_size, ax_stride, len(sizes), mode) +
                    tuple(dims_args(sizes[::-1], 64, MAX_DIMS) + pad(ss[::-1], MAX_DIMS) +
                          pad(si[::-1], MAX_DIMS))))
    return out


def _gather_launch(m: Any, what: str, x: CudaTensor, idx: CudaTensor, out: CudaTensor,
                   layouts: List[Optional[Tuple[int, tuple]]], ax_size: int,
                   check_bounds: bool, ax: int) -> CudaTensor:
    """The "gather" kernel over out (one of gather_layouts) and the bounds check."""
    dev = x.device_id
    vec = layouts[1]
    if vec is None or (x.ptr | out.ptr) % 16:
        vec = layouts[0]
    assert vec is not None    # (mode 0: every layout has one)
    items, args = vec
    name = m.kernel(TEMPLATE, dev, **gather_params(x.dtype.itemsize, idx.dtype)).name
    record(dev, x, idx)
    slot = bounds_slot(m, what, ax, ax_size) if check_bounds else 0   # (the kernel's check)
    m.backend.launch_kernel(name, grid_blocks(items, BLOCK), out, x, idx, *args, slot,
                            block_size=(BLOCK, 1, 1), device_id=dev)
    return out


def take(m: Any, x: CudaTensor, indices: Any, axis: Optional[int] = 0,
         check_bounds: bool = True) -> CudaTensor:
    """np.take(x, indices, axis): out.shape = x.shape[:axis] + indices.shape +
    x.shape[axis+1:] (axis=None: from the flattened x). See the module doc for bounds."""
    planned = _planned(m, "take", x, indices, axis, check_bounds)
    if planned is not None:
        return planned
    x, idx = _operands(x, indices, "take")
    if axis is None:
        x = make_view(x, (x.size,))
        axis = 0
    if x.ndim == 0:
        raise InvalidArgumentError("take needs a tensor of at least 1 dimension (or axis=None)")
    ax = one_axis(axis, x.ndim, "take")
    size = x.shape[ax]
    shape = x.shape[:ax] + idx.shape + x.shape[ax + 1:]
    out = _result(m, "take", x, idx, shape, size, ax, check_bounds)
    if out.size == 0:
        return out
    if not m.gpu:
        j, bad = _host_take_indices(idx, size, check_bounds, "take", ax, out)
        res = np.take(x.host_view, j, axis=ax)
        if bad.any():
            mask = bad.reshape((1,) * ax + idx.shape + (1,) * (x.ndim - ax - 1))
            res = np.where(mask, np.zeros((), res.dtype), res)
        out.host_view[...] = res
        return out
    dev = x.device_id
    geo = take_geometry(x.shape, ax, idx.size, x.dtype.itemsize, x.ptr, out.ptr,
                        m.backend.get_device_info(dev).multiprocessor_count)
    name = m.kernel(TEMPLATE, dev, **take_rows_params(geo["unit"], idx.dtype)).name
    record(dev, x, idx)
    # the row copy checks its own indices (take_rows' err: no check kernel)
    slot = bounds_slot(m, "take", ax, size) if check_bounds else 0
    launch_or_free(out, m.backend.launch_kernel, name, geo["grid"], out, x, idx, *geo["args"],
                   slot, block_size=(ROW_BLOCK, 1, 1), device_id=dev)
    key = _plan_key("take", x, idx, axis, check_bounds)
    if key is not None and key not in m.plans:
        common.remember_plan(m, key, _take_plan(m, x, idx, ax, check_bounds))
    return out


def row_unit(row_bytes: int, *ptrs: int) -> int:
    """The widest of UNITS dividing a row's bytes and every pointer (16: 16-byte vectors)."""
    for u in UNITS:
        if row_bytes % u == 0 and not any(p % u for p in ptrs):
            return u
    return 1


def take_geometry(shape: Tuple[int, ...], ax: int, nidx: int, itemsize: int, src_ptr: int,
                  out_ptr: int, sms: int) -> Dict[str, Any]:
    """The "take_rows" launch of np.take(x of shape, nidx indices, axis ax) (nidx >= 1, a
    non-empty result): {"unit", "lanes", "grid", "args"} (args: the kernel's after out, src,
    idx). lanes: the fewest (a power of two <= ROW_BLOCK) whose ROW_UNROLL units each cover
    the row; grid x = the rows / rows per block, at most one resident wave (every block
    takes the same number of trips; the kernel loads a trip's index one trip ahead); grid y
    splits each row when that leaves fewer than ROW_BLOCKS_PER_SM blocks per SM and a lane
    more than one step."""
    outer = math.prod(shape[:ax])
    size = shape[ax]
    row_bytes = math.prod(shape[ax + 1:]) * itemsize
    unit = row_unit(row_bytes, src_ptr, out_ptr)
    row_units = row_bytes // unit
    lanes = min(ROW_BLOCK, 1 << max(0, -(-row_units // ROW_UNROLL) - 1).bit_length())
    n_rows = outer * nidx
    row_blocks = -(-n_rows // (ROW_BLOCK // lanes))
    trips = -(-row_blocks // (sms * ROW_RESIDENT))   # one resident wave, even trips
    gx = max(1, min(-(-row_blocks // trips), 2**31 - 1))
    steps = -(-row_units // (lanes * ROW_UNROLL))
    gy = max(1, min(steps, 65535, -(-(sms * ROW_BLOCKS_PER_SM) // gx)))
    d, mul, shift = fast_divisor(nidx)
    return {"unit": unit, "lanes": lanes, "grid": (gx, gy, 1),
            "args": (n_rows, size, row_units, d, mul, shift, lanes)}


def _take_plan(m: Any, x: CudaTensor, idx: CudaTensor, ax: int, check_bounds: bool) -> Any:
    """The per-call plan of take for x and indices shaped like these (ops/common.py
    remember_plan): run(x, indices) -> the result, or None (the general path then runs) when
    an operand is freed or on a stream, or a pointer does not allow the widest unit of the
    row (the plan's)."""
    backend = m.backend
    dev, shape, dtype, ishape = x.device_id, x.shape, x.dtype, idx.shape
    geo = take_geometry(shape, ax, idx.size, dtype.itemsize, 0, 0,
                        backend.get_device_info(dev).multiprocessor_count)
    oshape = shape[:ax] + ishape + shape[ax + 1:]
    n_out = math.prod(oshape)
    nbytes = n_out * dtype.itemsize
    size, unit = shape[ax], geo["unit"]
    rows = backend.prepare_launch(
        backend.get_kernel(m.kernel(TEMPLATE, dev, **take_rows_params(unit, idx.dtype)).name,
                           dev), geo["grid"], (ROW_BLOCK, 1, 1), 0, dev)
    args = (*geo["args"], bounds_slot(m, "take", ax, size) if check_bounds else 0)
    pool, alloc, direct = common.plan_memory(m, dev)

    def run(x: CudaTensor, indices: Any) -> Optional[CudaTensor]:
        px, pi = x._ptr, indices._ptr
        if px is None or pi is None or indices.device_id != dev or x.stream is not None or \
                indices.stream is not None or px % unit or not direct(dev):
            return None
        refuse_capture("take", dev, check_bounds)
        out = pool_tensor(oshape, dtype, dev, alloc(nbytes), pool, n_out, nbytes)
        if out._ptr % unit:
            out.free()
            return None
        launch_or_free(out, rows, out._ptr, px, pi, *args)
        return out
    return run


def gather(m: Any, x: CudaTensor, indices: Any, axis: Optional[int],
           check_bounds: bool = True) -> CudaTensor:
    """np.take_along_axis(x, indices, axis): indices has x's number of dims and broadcasts
    against x off the axis; out[..., i, ...] = x[..., indices[..., i, ...], ...]."""
    planned = _planned(m, "gather", x, indices, axis, check_bounds)
    if planned is not None:
        return planned
    x, idx = _operands(x, indices, "gather")
    if axis is None:
        if idx.ndim != 1:
            raise ShapeMismatchError(f"gather with axis=None needs 1-d indices, got shape "
                                     f"{idx.shape}")
        x = make_view(x, (x.size,))
        axis = 0
    if idx.ndim != x.ndim:
        raise ShapeMismatchError(
            f"gather: indices must have as many dimensions as the tensor ({x.ndim}), got "
            f"{idx.ndim} (shape {idx.shape})")
    if x.ndim == 0:
        raise InvalidArgumentError("gather needs a tensor of at least 1 dimension")
    ax = one_axis(axis, x.ndim, "gather")
    shape: Any = []          # the result's dimensions, then their tuple
    for d in range(x.ndim):
        if d == ax:
            shape.append(idx.shape[d])
            continue
        p, q = x.shape[d], idx.shape[d]
        if p != q and p != 1 and q != 1:
            raise ShapeMismatchError(
                f"gather: the tensor {x.shape} and indices {idx.shape} do not broadcast off "
                f"axis {ax} (dimension {d}: {p} vs {q})")
        shape.append(max(p, q) if p and q else 0)
    shape = tuple(shape)
    size = x.shape[ax]
    out = _result(m, "gather", x, idx, shape, size, ax, check_bounds)
    if out.size == 0:
        return out
    if not m.gpu:
        j, bad = _host_take_indices(idx, size, check_bounds, "gather", ax, out)
        bshape = list(shape)
        bshape[ax] = size
        src = np.broadcast_to(x.host_view, tuple(bshape))
        jshape = list(shape)
        res = np.take_along_axis(src, np.broadcast_to(j, tuple(jshape)), axis=ax)
        if bad.any():
            res = np.where(np.broadcast_to(bad, shape), np.zeros((), res.dtype), res)
        out.host_view[...] = res
        return out
    xs, ids = contiguous_strides(x.shape), contiguous_strides(idx.shape)
    s_src = [xs[d] if (d != ax and x.shape[d] == shape[d] and shape[d] != 1) else 0
             for d in range(x.ndim)]
    s_idx = [ids[d] if idx.shape[d] == shape[d] and shape[d] != 1 else 0
             for d in range(x.ndim)]
    layouts = gather_layouts(shape, s_src, s_idx, size, xs[ax], x.dtype.itemsize, "gather")
    _gather_launch(m, "gather", x, idx, out, layouts, size, check_bounds, ax)
    key = _plan_key("gather", x, idx, axis, check_bounds)
    if key is not None and key not in m.plans:
        common.remember_plan(m, key, _gather_plan(m, x, idx, shape, layouts, ax, check_bounds))
    return out


def _gather_plan(m: Any, x: CudaTensor, idx: CudaTensor, shape: Tuple[int, ...],
                 layouts: List[Optional[Tuple[int, tuple]]], ax: int, check_bounds: bool) -> Any:
    """The per-call plan of gather for x and indices shaped like these (ops/common.py
    remember_plan): run(x, indices) -> the result, or None (the general path then runs) when
    an operand is freed, on another device or on a stream; the vectorized launch where the
    source and the result are 16-byte aligned, as the general path chooses."""
    backend = m.backend
    dev, dtype = x.device_id, x.dtype
    size = x.shape[ax]
    n_out = math.prod(shape)
    nbytes = n_out * dtype.itemsize
    kernel = backend.get_kernel(m.kernel(TEMPLATE, dev, **gather_params(dtype.itemsize,
                                                                        idx.dtype)).name, dev)
    by_vec = [(backend.prepare_launch(kernel, (grid_blocks(lay[0], BLOCK), 1, 1),
                                      (BLOCK, 1, 1), 0, dev), lay[1])
              for lay in layouts if lay is not None]
    by_vec.append(by_vec[-1])   # [mode 0, mode 1 or mode 0 again, ...]: by alignment
    slot = bounds_slot(m, "gather", ax, size) if check_bounds else 0   # (the kernel's check)
    pool, alloc, direct = common.plan_memory(m, dev)

    def run(x: CudaTensor, indices: Any) -> Optional[CudaTensor]:
        px, pi = x._ptr, indices._ptr
        if px is None or pi is None or indices.device_id != dev or x.stream is not None or \
                indices.stream is not None or not direct(dev):
            return None
        refuse_capture("gather", dev, check_bounds)
        out = pool_tensor(shape, dtype, dev, alloc(nbytes, None), pool, n_out, nbytes)
        po = out._ptr
        go, args = by_vec[0 if (px | po) % 16 else 1]
        launch_or_free(out, go, po, px, pi, *args, slot)
        return out
    return run
