"""Comparisons, where, take / gather (embedding lookup) and scatter_add (its backward), NumPy
names and semantics, through one template, `indexing.cu.j2`.

- equal, not_equal, less, less_equal, greater, greater_equal: bool tensors, NumPy broadcasting;
  operands are tensors of one dtype or a tensor and a Python scalar (converted to the tensor's
  dtype first, as the elementwise ops do: an int tensor refuses a fractional scalar). Half
  types compare exactly in float; NaN compares unequal to everything.
- where(cond, a, b): cond a bool tensor; a and b tensors of one dtype or scalars (at least one
  a tensor); all three broadcast.
- take(t, indices, axis=0): np.take (int32 / int64 indices of any shape; negative ones count
  from the end; axis=None takes from the flattened tensor); an embedding lookup is
  take(weight, token_ids). gather(t, indices, axis): np.take_along_axis (indices as many dims
  as t, broadcast against it off the axis; torch.gather's layout).
- scatter_add(target, indices, src, axis=0): take's adjoint, in place on target (returned):
  np.add.at(target, (:, ..., indices), src) with src.shape == target.shape[:axis] +
  indices.shape + target.shape[axis+1:] (the embedding backward: scatter_add(grad_weight,
  token_ids, grad_out)). One atomicAdd per element: float results depend on the order in
  which the adds land (not deterministic run to run; each result is within the usual
  summation bound of count * eps * sum |terms|); int32 / int64 results are exact (wrapping).
  float16 / bfloat16 add in their own precision (each add rounded). Dtypes: float32, float64,
  float16, bfloat16, int32, int64.

Bounds: the host cannot read device indices cheaply, so the kernels check them: an index
outside [-size, size) of the axis writes 0 (take, gather) or adds nothing (scatter_add) and
sets a device flag. With check_bounds=True (the default) the flag is a fresh 4-byte tensor
set to 0 first (one fill launch), read back after the launch (a synchronous 4-byte copy: the
call waits for the kernel, and cannot be recorded in a CUDA graph), and a set flag raises
IndexOutOfRangeError (an IndexError, as NumPy). With check_bounds=False nothing is read back:
no synchronization, and out-of-range indices give zeros / no add, silently. After an
IndexOutOfRangeError from scatter_add, target holds the adds of the in-range indices.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple, cast

import numpy as np

from ..dtypes import CudaDataType, to_bfloat16_bits
from ..errors import (DTypeMismatchError, IndexOutOfRangeError, InvalidArgumentError,
                      ShapeMismatchError)
from ..kernels import dtype_params
from ..tensor import CudaTensor
from . import common
from .shape import (MAX_DIMS, _dims_args, _grid, _one_axis, _pad, collapse,
                    contiguous_strides, make_view, record)

DT = CudaDataType
TEMPLATE = "indexing.cu.j2"
TEMPLATES = (TEMPLATE,)
BLOCK = 128
COMPARE_OPS = ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal")
INDEX_DTYPES = (DT.INT32, DT.INT64)
SCATTER_DTYPES = common.FLOATS + (DT.INT32, DT.INT64)
ELEMS = (1, 2, 4, 8)
_NP_COMPARE = {"equal": np.equal, "not_equal": np.not_equal, "less": np.less,
               "less_equal": np.less_equal, "greater": np.greater,
               "greater_equal": np.greater_equal}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# -- template parameters ------------------------------------------------------------------------
def compare_params(op: str, dtype: CudaDataType) -> Dict[str, Any]:
    p = dtype_params(dtype)
    if dtype is DT.BOOL:
        p["ctype"] = "unsigned char"
    return {"kind": "map", "op": op, **p, "block_size": BLOCK}


def where_params(elem: int) -> Dict[str, Any]:
    return {"kind": "map", "op": "where", "elem": elem, "block_size": BLOCK}


def gather_params(elem: int, index_dtype: CudaDataType) -> Dict[str, Any]:
    return {"kind": "gather", "elem": elem, "index_dtype": index_dtype.name_str,
            "block_size": BLOCK}


def scatter_params(dtype: CudaDataType, index_dtype: CudaDataType) -> Dict[str, Any]:
    return {"kind": "scatter_add", **dtype_params(dtype), "index_dtype": index_dtype.name_str,
            "block_size": BLOCK}


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Comparisons per op and dtype, where and gather per element size (gather per index
    dtype too), scatter_add per dtype and index dtype."""
    sets = [compare_params(op, dt) for op in COMPARE_OPS for dt in DT]
    sets += [where_params(e) for e in ELEMS]
    sets += [gather_params(e, i) for e in ELEMS for i in INDEX_DTYPES]
    sets += [scatter_params(d, i) for d in SCATTER_DTYPES for i in INDEX_DTYPES]
    return {TEMPLATE: sets}


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every variant in parallel threads; returns how many (0 in fallback mode)."""
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets]
    return common.compile_all(m, jobs, device_id, workers)


def reference(op: str, *args: Any, **kwargs: Any) -> np.ndarray:
    """The op in NumPy, float inputs in float64: a comparison op (a, b), "where" (cond, a, b),
    "take" (x, indices, axis=0), "gather" (x, indices, axis: take_along_axis),
    "scatter_add" (target, indices, src, axis=0: np.add.at on a copy of target)."""
    def f64(a: Any) -> Any:
        a = np.asarray(a)
        return a.astype(np.float64) if a.dtype.kind == "f" else a
    vals = [f64(a) for a in args]
    if op in _NP_COMPARE:
        return _NP_COMPARE[op](*vals)
    if op == "where":
        return np.where(*vals)
    if op == "take":
        return np.take(vals[0], vals[1], axis=kwargs.get("axis", 0))
    if op == "gather":
        return np.take_along_axis(vals[0], vals[1], axis=kwargs["axis"])
    if op == "scatter_add":
        target, idx, src = vals
        target = target.copy()
        ax = kwargs.get("axis", 0) % target.ndim
        np.add.at(target, (slice(None),) * ax + (idx,), src)
        return target
    raise InvalidArgumentError(f"unknown indexing op {op!r}")


# -- helpers ------------------------------------------------------------------------------------
def _operand(v: Any, what: str) -> Any:
    """A tensor operand checked, a 0-d NumPy array as its scalar; other arrays refused."""
    if isinstance(v, CudaTensor):
        return common.check_tensor(v, what)
    if isinstance(v, np.ndarray):
        if v.ndim == 0:
            return v[()]
        raise DTypeMismatchError(
            f"{what}: a NumPy array of shape {v.shape} (host arrays are not copied to the "
            f"device implicitly); convert it with from_numpy() first")
    return v


def _bcast_strides(shape: Tuple[int, ...], t_shape: Tuple[int, ...]) -> List[int]:
    """Element strides of a contiguous tensor of t_shape read broadcast to shape."""
    ts = contiguous_strides(t_shape)
    nd, k = len(shape), len(t_shape)
    out = [0] * nd
    for i in range(1, k + 1):
        if t_shape[-i] != 1:
            out[-i] = ts[-i]
    return out


def _check_dims(nd: int, shape: Tuple[int, ...], what: str) -> None:
    if nd > MAX_DIMS:
        raise InvalidArgumentError(
            f"{what}: {nd} dims after merging those that can be merged; at most {MAX_DIMS} "
            f"are supported (shape {shape})")


def _scalar_for(dtype: CudaDataType, value: Any, what: str) -> Any:
    from .elementwise import scalar_arg
    if dtype is DT.BOOL:
        v = scalar_arg(DT.INT64, value, what)
        if v not in (0, 1):
            raise InvalidArgumentError(f"{what} = {value} is not a bool (0 or 1)")
        return v
    return scalar_arg(dtype, value, what)


def _storage_value(dtype: CudaDataType, v: Any) -> np.ndarray:
    """A converted scalar as a 0-d array of the tensor's storage dtype (bfloat16: bits)."""
    if dtype is DT.BFLOAT16:
        return to_bfloat16_bits(np.array([v], np.float32)).reshape(())
    with np.errstate(all="ignore"):
        return np.array(v, dtype=dtype.numpy_dtype)


# -- comparisons ---------------------------------------------------------------------------------
def compare(m: Any, op: str, a: Any, b: Any) -> CudaTensor:
    """op(a, b) elementwise with broadcasting: a bool tensor."""
    if op not in _NP_COMPARE:
        raise InvalidArgumentError(f"unknown comparison {op!r}; expected one of "
                                   f"{', '.join(COMPARE_OPS)}")
    a, b = _operand(a, "a"), _operand(b, "b")
    ta, tb = isinstance(a, CudaTensor), isinstance(b, CudaTensor)
    if not (ta or tb):
        raise InvalidArgumentError(f"{op} needs at least one CudaTensor operand")
    if ta and tb:
        common.same_device(a, b)
        common.same_dtype(a, b)
    t = a if ta else b
    dtype, dev = t.dtype, t.device_id
    va = 0 if ta else _scalar_for(dtype, a, "a")
    vb = 0 if tb else _scalar_for(dtype, b, "b")
    shape = common.broadcast_shapes(a.shape if ta else (), b.shape if tb else ())
    out = m.backend.empty(shape, DT.BOOL, dev)
    n = out.size
    if not n:
        return out
    if not m.gpu:
        ct = np.float64 if dtype is DT.FLOAT64 else (np.float32 if dtype.is_floating else None)
        x = common.host_array(m, a) if ta else np.asarray(va, ct or dtype.numpy_dtype)
        y = common.host_array(m, b) if tb else np.asarray(vb, ct or dtype.numpy_dtype)
        out.host_view[...] = _NP_COMPARE[op](x, y)
        return out
    sa = _bcast_strides(shape, a.shape) if ta else [0] * len(shape)
    sb = _bcast_strides(shape, b.shape) if tb else [0] * len(shape)
    sizes, (sa, sb) = collapse(shape, sa, sb)
    _check_dims(len(sizes), shape, op)
    mode = (0 if ta else 1) | (0 if tb else 2)
    name = m.kernel(TEMPLATE, dev, **compare_params(op, dtype)).name
    record(dev, *[x for x in (a, b) if isinstance(x, CudaTensor)])
    args = [n, len(sizes), mode] + _dims_args(sizes[::-1], 64, MAX_DIMS) + \
        _pad(sa[::-1], MAX_DIMS) + _pad(sb[::-1], MAX_DIMS)
    m.backend.launch_kernel(name, _grid(n, BLOCK), out, a if ta else 0, b if tb else 0,
                            va, vb, *args, block_size=(BLOCK, 1, 1), device_id=dev)
    return out


def where(m: Any, cond: Any, a: Any, b: Any) -> CudaTensor:
    """np.where(cond, a, b): cond a bool tensor, a / b tensors of one dtype or scalars."""
    cond = _operand(cond, "cond")
    if not isinstance(cond, CudaTensor):
        raise InvalidArgumentError(f"where: cond must be a bool CudaTensor, got "
                                   f"{type(cond).__name__}")
    if cond.dtype is not DT.BOOL:
        raise DTypeMismatchError(
            f"where: cond must be a bool tensor, got {cond.dtype.name_str} (compare first, "
            f"e.g. not_equal(cond, 0))")
    a, b = _operand(a, "a"), _operand(b, "b")
    ta, tb = isinstance(a, CudaTensor), isinstance(b, CudaTensor)
    if not (ta or tb):
        raise InvalidArgumentError("where needs a or b to be a CudaTensor (the result takes "
                                   "its dtype)")
    tensors = [cond] + [x for x in (a, b) if isinstance(x, CudaTensor)]
    common.same_device(*tensors)
    if ta and tb:
        common.same_dtype(a, b)
    t = a if ta else b
    dtype, dev = t.dtype, t.device_id
    va = None if ta else _storage_value(dtype, _scalar_for(dtype, a, "a"))
    vb = None if tb else _storage_value(dtype, _scalar_for(dtype, b, "b"))
    shape = common.broadcast_shapes(cond.shape, common.broadcast_shapes(
        a.shape if ta else (), b.shape if tb else ()))
    out = m.backend.empty(shape, dtype, dev)
    n = out.size
    if not n:
        return out
    if not m.gpu:
        x: Any = a.host_view if ta else va
        y: Any = b.host_view if tb else vb
        out.host_view[...] = np.where(cond.host_view, x, y)
        return out
    sc = _bcast_strides(shape, cond.shape)
    sa = _bcast_strides(shape, a.shape) if ta else [0] * len(shape)
    sb = _bcast_strides(shape, b.shape) if tb else [0] * len(shape)
    sizes, (sc, sa, sb) = collapse(shape, sc, sa, sb)
    _check_dims(len(sizes), shape, "where")
    mode = (0 if ta else 1) | (0 if tb else 2)
    unsigned = _UNSIGNED[dtype.itemsize]
    bits_a = 0 if ta else int(cast(np.ndarray, va).view(unsigned))
    bits_b = 0 if tb else int(cast(np.ndarray, vb).view(unsigned))
    name = m.kernel(TEMPLATE, dev, **where_params(dtype.itemsize)).name
    record(dev, *tensors)
    args = [n, len(sizes), mode] + _dims_args(sizes[::-1], 64, MAX_DIMS) + \
        _pad(sc[::-1], MAX_DIMS) + _pad(sa[::-1], MAX_DIMS) + _pad(sb[::-1], MAX_DIMS)
    m.backend.launch_kernel(name, _grid(n, BLOCK), out, cond, a if ta else 0, b if tb else 0,
                            bits_a, bits_b, *args, block_size=(BLOCK, 1, 1), device_id=dev)
    return out


# -- take / gather ---------------------------------------------------------------------------------
def _indices(indices: Any, what: str) -> CudaTensor:
    if not isinstance(indices, CudaTensor):
        raise InvalidArgumentError(
            f"{what}: indices must be an int32 or int64 CudaTensor, got "
            f"{type(indices).__name__} (use from_numpy first)")
    common.check_tensor(indices, "indices")
    if indices.dtype not in INDEX_DTYPES:
        raise DTypeMismatchError(
            f"{what}: indices must be int32 or int64, got {indices.dtype.name_str}")
    return indices


def _flag(m: Any, check_bounds: bool, dev: int) -> Optional[CudaTensor]:
    return m.zeros((1,), DT.INT32, dev) if check_bounds else None


def _raise_if_flagged(m: Any, flag: Optional[CudaTensor], what: str, ax: int, size: int,
                      out: Optional[CudaTensor] = None) -> None:
    """Read the bounds flag (a synchronous copy); raise when set (out freed first)."""
    if flag is None:
        return
    try:
        bad = int(m.to_numpy(flag)[0])
    finally:
        flag.free()
    if bad:
        if out is not None:
            out.free()
        raise IndexOutOfRangeError(
            f"{what}: an index is out of bounds for axis {ax} with size {size} (indices must "
            f"be in [{-size}, {size}))")


def _host_indices(idx: np.ndarray, size: int, check_bounds: bool, what: str,
                  ax: int) -> Tuple[np.ndarray, np.ndarray]:
    """Fallback: (indices wrapped into [0, size) with bad ones at 0, mask of the bad ones)."""
    j = idx.astype(np.int64)
    j = np.where(j < 0, j + size, j)
    bad = (j < 0) | (j >= size)
    return np.where(bad, 0, j), bad


def _gather_launch(m: Any, what: str, x: CudaTensor, idx: CudaTensor, out: CudaTensor,
                   shape: Tuple[int, ...], s_src: List[int], s_idx: List[int], ax_size: int,
                   ax_stride: int, check_bounds: bool, ax: int) -> CudaTensor:
    """The "gather" kernel over out (contiguous, of shape) and the bounds check."""
    dev = x.device_id
    itemsize = x.dtype.itemsize
    sizes, (ss, si) = collapse(shape, s_src, s_idx)
    _check_dims(len(sizes), shape, what)
    w = 16 // itemsize
    mode = 0
    if w > 1 and ss[-1] == 1 and si[-1] == 0 and sizes[-1] % w == 0 and ax_stride % w == 0 \
            and all(s % w == 0 for s in ss[:-1]) and not (x.ptr | out.ptr) % 16:
        mode = 1
        sizes[-1] //= w
        ss[-1] = w
    items = math.prod(sizes)
    flag = _flag(m, check_bounds, dev)
    name = m.kernel(TEMPLATE, dev, **gather_params(itemsize, idx.dtype)).name
    record(dev, x, idx)
    args = [items, ax_size, ax_stride, len(sizes), mode] + \
        _dims_args(sizes[::-1], 64, MAX_DIMS) + _pad(ss[::-1], MAX_DIMS) + \
        _pad(si[::-1], MAX_DIMS)
    try:
        m.backend.launch_kernel(name, _grid(items, BLOCK), out, x, idx,
                                flag if flag is not None else 0, *args,
                                block_size=(BLOCK, 1, 1), device_id=dev)
    except BaseException:
        if flag is not None:
            flag.free()
        raise
    _raise_if_flagged(m, flag, what, ax, ax_size, out)
    return out


def take(m: Any, x: CudaTensor, indices: Any, axis: Optional[int] = 0,
         check_bounds: bool = True) -> CudaTensor:
    """np.take(x, indices, axis): out.shape = x.shape[:axis] + indices.shape +
    x.shape[axis+1:] (axis=None: from the flattened x). See the module doc for bounds."""
    x = common.check_tensor(x, "tensor")
    idx = _indices(indices, "take")
    common.same_device(x, idx)
    if axis is None:
        x = make_view(x, (x.size,))
        axis = 0
    if x.ndim == 0:
        raise InvalidArgumentError("take needs a tensor of at least 1 dimension (or axis=None)")
    ax = _one_axis(axis, x.ndim, "take")
    size = x.shape[ax]
    shape = x.shape[:ax] + idx.shape + x.shape[ax + 1:]
    if size == 0 and idx.size:
        raise IndexOutOfRangeError(f"take: cannot take from axis {ax} of size 0")
    out = m.backend.empty(shape, x.dtype, x.device_id)
    if out.size == 0:
        return out
    if not m.gpu:
        j, bad = _host_indices(idx.host_view, size, check_bounds, "take", ax)
        if check_bounds and bad.any():
            out.free()
            _raise_bounds("take", ax, size)
        res = np.take(x.host_view, j, axis=ax)
        if bad.any():
            mask = bad.reshape((1,) * ax + idx.shape + (1,) * (x.ndim - ax - 1))
            res = np.where(mask, np.zeros((), res.dtype), res)
        out.host_view[...] = res
        return out
    xs = contiguous_strides(x.shape)
    ids = contiguous_strides(idx.shape)
    k = idx.ndim
    s_src = xs[:ax] + [0] * k + xs[ax + 1:]
    s_idx = [0] * ax + ids + [0] * (x.ndim - ax - 1)
    return _gather_launch(m, "take", x, idx, out, shape, s_src, s_idx, size, xs[ax],
                          check_bounds, ax)


def _raise_bounds(what: str, ax: int, size: int) -> None:
    raise IndexOutOfRangeError(
        f"{what}: an index is out of bounds for axis {ax} with size {size} (indices must be "
        f"in [{-size}, {size}))")


def gather(m: Any, x: CudaTensor, indices: Any, axis: Optional[int],
           check_bounds: bool = True) -> CudaTensor:
    """np.take_along_axis(x, indices, axis): indices has x's number of dims and broadcasts
    against x off the axis; out[..., i, ...] = x[..., indices[..., i, ...], ...]."""
    x = common.check_tensor(x, "tensor")
    idx = _indices(indices, "gather")
    common.same_device(x, idx)
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
    ax = _one_axis(axis, x.ndim, "gather")
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
    if size == 0 and idx.size:
        raise IndexOutOfRangeError(f"gather: cannot take from axis {ax} of size 0")
    out = m.backend.empty(shape, x.dtype, x.device_id)
    if out.size == 0:
        return out
    if not m.gpu:
        j, bad = _host_indices(idx.host_view, size, check_bounds, "gather", ax)
        if check_bounds and bad.any():
            out.free()
            _raise_bounds("gather", ax, size)
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
    return _gather_launch(m, "gather", x, idx, out, shape, s_src, s_idx, size, xs[ax],
                          check_bounds, ax)


# -- scatter_add --------------------------------------------------------------------------------
def scatter_add(m: Any, target: CudaTensor, indices: Any, src: CudaTensor, axis: int = 0,
                check_bounds: bool = True) -> CudaTensor:
    """np.add.at(target, (:,) * axis + (indices,), src), in place; returns target."""
    target = common.check_tensor(target, "target")
    idx = _indices(indices, "scatter_add")
    src = common.check_tensor(src, "src")
    common.same_device(target, idx, src)
    common.require_dtype(target, SCATTER_DTYPES, "scatter_add")
    common.same_dtype(target, src)
    if target.ndim == 0:
        raise InvalidArgumentError("scatter_add needs a target of at least 1 dimension")
    ax = _one_axis(axis, target.ndim, "scatter_add")
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
        j, bad = _host_indices(idx.host_view, size, check_bounds, "scatter_add", ax)
        vals = common.host_array(m, src)
        if bad.any():
            mask = bad.reshape((1,) * ax + idx.shape + (1,) * (target.ndim - ax - 1))
            vals = np.where(mask, np.zeros((), vals.dtype), vals)
        acc = common.host_array(m, target).copy()
        with np.errstate(all="ignore"):
            np.add.at(acc, cast(Any, (slice(None),) * ax + (j,)), vals)
        from .elementwise import store_host
        store_host(m, acc, target)
        if check_bounds and bad.any():
            _raise_bounds("scatter_add", ax, size)
        return target
    dev = target.device_id
    ts, ids = contiguous_strides(target.shape), contiguous_strides(idx.shape)
    k = idx.ndim
    s_t = ts[:ax] + [0] * k + ts[ax + 1:]
    s_i = [0] * ax + ids + [0] * (target.ndim - ax - 1)
    sizes, (st, si) = collapse(src.shape, s_t, s_i)
    _check_dims(len(sizes), src.shape, "scatter_add")
    n = src.size
    flag = _flag(m, check_bounds, dev)
    name = m.kernel(TEMPLATE, dev, **scatter_params(target.dtype, idx.dtype)).name
    record(dev, target, idx, src)
    args = [n, size, ts[ax], len(sizes)] + _dims_args(sizes[::-1], 64, MAX_DIMS) + \
        _pad(st[::-1], MAX_DIMS) + _pad(si[::-1], MAX_DIMS)
    try:
        m.backend.launch_kernel(name, _grid(n, BLOCK), target, src, idx,
                                flag if flag is not None else 0, *args,
                                block_size=(BLOCK, 1, 1), device_id=dev)
    except BaseException:
        if flag is not None:
            flag.free()
        raise
    _raise_if_flagged(m, flag, "scatter_add", ax, size)
    return target
