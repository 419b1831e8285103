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

take runs one row-copy kernel ("take_rows"): x seen as [outer][size][row] (row: the dims
after the axis), each output row a copy of one source row, by a group of threads in units of
16 bytes (8, 4, 2, 1 when the row's bytes or a pointer allow no wider), the index read once
per row; gather (take_along_axis) and scatter_add walk their N-d iteration space per element.
Floor of an embedding lookup (bytes = read the rows + write them): 2 x 8192 x 768 x 4 = 50 MB
is 17.0 us at the 2954 GB/s of an H100's copy; target >= 0.85 of copy (<= 20 us). A generic
per-element N-d gather (one 16-byte item per thread, its index re-read per item, a
46-argument launch) followed by a synchronous read of a bounds flag measured 74.9 us there
(PyTorch emb[idx]: 22.8 us). Here 64 lanes copy a 3 KiB row (3 vectors each, loads before
stores), 4 rows per 256-thread block, 5 blocks per SM (48 registers): up to 60 KiB of loads
in flight per SM, 2048 blocks in about 3 waves. Prediction, before a GPU run:
check_bounds=False 19-21 us (0.80-0.90 of copy); check_bounds=True 3-5 us more (the check
kernel over 64 KiB of indices and the flag copy, in front of the row copy).

Bounds: an index outside [-size, size) of the axis writes 0 (take, gather) or adds nothing
(scatter_add). With check_bounds=True (the default) it raises IndexOutOfRangeError (an
IndexError, as NumPy) from the call itself, which needs the host to see the device's
indices: a small "check" kernel reads the indices first (1024 indices per block and step, at
most 512 blocks, one flag word each, written whether set or not: nothing to zero first), an
asynchronous copy brings the
words to page-locked host memory and an event marks it; the main kernel is queued behind it
and the host waits for that event only. So the wait is not a round trip behind the copy of
the data: the host is back while the main kernel runs (it can queue the next work), and the
device's cost is the check kernel and a tiny copy (a few us) in front of the main kernel.
Raising later ("at the next synchronizing call") would cost nothing on the device but move
the error away from the call that caused it (and tests/test_bad_input.py expects it from
take); a device-side assert (PyTorch's) kills the context. check_bounds=False skips all of
it: no wait, capturable in a CUDA graph (check_bounds=True raises GraphCaptureError while
capturing), and out-of-range indices give zeros / no add, silently. After an
IndexOutOfRangeError from scatter_add, target holds the adds of the in-range indices (the
kernel was queued; stream order makes them visible).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple, cast

import numpy as np

from ..dtypes import CudaDataType, to_bfloat16_bits
from ..errors import (DTypeMismatchError, GraphCaptureError, IndexOutOfRangeError,
                      InvalidArgumentError, ShapeMismatchError, driver_failure)
from ..kernels import dtype_params
from ..tensor import CudaTensor, pool_tensor
from . import common
from .shape import (MAX_DIMS, _dims_args, _grid, _one_axis, _pad, collapse,
                    contiguous_strides, fast_divisor, make_view, record)

DT = CudaDataType
TEMPLATE = "indexing.cu.j2"
TEMPLATES = (TEMPLATE,)
BLOCK = 128
COMPARE_OPS = ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal")
INDEX_DTYPES = (DT.INT32, DT.INT64)
SCATTER_DTYPES = common.FLOATS + (DT.INT32, DT.INT64)
ELEMS = (1, 2, 4, 8)
# take: rows copied in units of UNITS bytes (the widest dividing the row and both pointers) by
# ROW_BLOCK-thread blocks, ROW_UNROLL units per thread in flight (as the template), about
# ROW_BLOCKS_PER_SM blocks per SM for a few long rows (grid y splits each row)
UNITS = (16, 8, 4, 2, 1)
ROW_BLOCK = 256
ROW_UNROLL = 4
ROW_BLOCKS_PER_SM = 8
# the bounds check: blocks of CHECK_BLOCK threads, CHECK_UNROLL indices each per step, at most
# CHECK_MAX_BLOCKS flag words read back
CHECK_BLOCK = 256
CHECK_UNROLL = 4
CHECK_MAX_BLOCKS = 512
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


def take_rows_params(unit: int, index_dtype: CudaDataType) -> Dict[str, Any]:
    return {"kind": "take_rows", "unit": unit, "index_dtype": index_dtype.name_str,
            "block_size": ROW_BLOCK}


def check_params(index_dtype: CudaDataType) -> Dict[str, Any]:
    return {"kind": "check", "index_dtype": index_dtype.name_str, "block_size": CHECK_BLOCK}


def scatter_params(dtype: CudaDataType, index_dtype: CudaDataType) -> Dict[str, Any]:
    return {"kind": "scatter_add", **dtype_params(dtype), "index_dtype": index_dtype.name_str,
            "block_size": BLOCK}


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Comparisons per op and dtype, where and gather per element size (gather per index
    dtype too), take's row copy per unit and index dtype, the bounds check per index dtype,
    scatter_add per dtype and index dtype."""
    sets = [compare_params(op, dt) for op in COMPARE_OPS for dt in DT]
    sets += [where_params(e) for e in ELEMS]
    sets += [gather_params(e, i) for e in ELEMS for i in INDEX_DTYPES]
    sets += [take_rows_params(u, i) for u in UNITS for i in INDEX_DTYPES]
    sets += [check_params(i) for i in INDEX_DTYPES]
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


def _bounds_message(what: str, ax: int, size: int) -> str:
    return (f"{what}: an index is out of bounds for axis {ax} with size {size} (indices must "
            f"be in [{-size}, {size}))")


def check_grid(n: int) -> int:
    """Blocks of the bounds check over n indices (its flag words)."""
    return max(1, min(-(-n // (CHECK_BLOCK * CHECK_UNROLL)), CHECK_MAX_BLOCKS))


def refuse_capture(what: str, dev: int, check_bounds: bool) -> None:
    """GraphCaptureError when a bounds-checked call is made inside a capture (the host waits
    for its check); called before anything is allocated, so the capture's pool is untouched."""
    if check_bounds:
        from ..streams import capturing
        if capturing(dev):
            raise GraphCaptureError(
                f"{what} with check_bounds=True cannot be recorded into a CUDA graph (the host "
                f"waits for its bounds check); pass check_bounds=False inside the capture")


class BoundsCheck:
    """The bounds check of one call, before its main kernel (see the module doc): the check
    kernel writes a flag word per block, an asynchronous copy brings them to page-locked host
    memory and an event marks the copy; the caller then queues its main kernel and calls
    finish(), which waits for the event only (not for the main kernel) and raises."""

    __slots__ = ("host", "event", "device_id", "_error")

    def __init__(self, m: Any, idx: CudaTensor, size: int, what: str,
                 prepared: Any = None) -> None:
        from ..driver import load_driver
        from ..streams import current_stream
        dev = self.device_id = idx.device_id
        refuse_capture(what, dev, True)
        backend = m.backend
        n = idx.size
        grid = check_grid(n)
        self._error = load_driver()[0].Error
        self.event = backend.event(dev, timing=False)
        self.host = backend.pinned_empty((grid,), np.int32)
        flags = backend.empty((grid,), DT.INT32, dev)
        try:
            if prepared is not None:   # a per-call plan's launch of the check over n indices
                prepared(flags._ptr, idx._ptr, n, size)
            else:
                name = m.kernel(TEMPLATE, dev, **check_params(idx.dtype)).name
                backend.launch_kernel(name, (grid, 1, 1), flags, idx, n, size,
                                      block_size=(CHECK_BLOCK, 1, 1), device_id=dev)
            backend.copy_from_device_async(flags, self.host, None, dev)
            self.event.record(current_stream(dev))
        finally:
            flags.free()   # stream-ordered: reused only after the copy

    def abandon(self) -> None:
        """Wait for the copy without checking (the call failed before finish): the host
        buffer goes back to its pool only once nothing writes into it."""
        try:
            self.event.synchronize()
        except self._error:
            pass

    def finish(self, what: str, ax: int, size: int, out: Optional[CudaTensor] = None) -> None:
        """Wait for the flags (the main kernel may still run); raise IndexOutOfRangeError
        when one is set, out freed first."""
        try:
            self.event.synchronize()
        except self._error as exc:
            raise driver_failure(f"{what}: the bounds check", exc, self.device_id) from None
        if self.host.any():
            if out is not None:
                out.free()
            raise IndexOutOfRangeError(_bounds_message(what, ax, size))


def _start_check(m: Any, idx: CudaTensor, size: int, what: str, check_bounds: bool,
                 out: Optional[CudaTensor] = None, prepared: Any = None) -> Optional[BoundsCheck]:
    """A started BoundsCheck when asked for (None otherwise); out is freed when it cannot
    start (e.g. GraphCaptureError)."""
    if not check_bounds:
        return None
    try:
        return BoundsCheck(m, idx, size, what, prepared)
    except BaseException:
        if out is not None:
            out.free()
        raise


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
    name = m.kernel(TEMPLATE, dev, **gather_params(itemsize, idx.dtype)).name
    record(dev, x, idx)
    args = [items, ax_size, ax_stride, len(sizes), mode] + \
        _dims_args(sizes[::-1], 64, MAX_DIMS) + _pad(ss[::-1], MAX_DIMS) + \
        _pad(si[::-1], MAX_DIMS)
    check = _start_check(m, idx, ax_size, what, check_bounds, out)
    try:
        m.backend.launch_kernel(name, _grid(items, BLOCK), out, x, idx, *args,
                                block_size=(BLOCK, 1, 1), device_id=dev)
    except BaseException:
        if check is not None:
            check.abandon()
        raise
    if check is not None:
        check.finish(what, ax, ax_size, out)
    return out


def take(m: Any, x: CudaTensor, indices: Any, axis: Optional[int] = 0,
         check_bounds: bool = True) -> CudaTensor:
    """np.take(x, indices, axis): out.shape = x.shape[:axis] + indices.shape +
    x.shape[axis+1:] (axis=None: from the flattened x). See the module doc for bounds."""
    if type(x) is CudaTensor and type(indices) is CudaTensor and type(axis) is int and \
            type(check_bounds) is bool:
        fast = m.plans.get(("take", x.shape, x.dtype, indices.shape, indices.dtype,
                            x.device_id, axis, check_bounds))
        if fast is not None and m.backend.direct_launch(x.device_id):
            res = fast(x, indices)
            if res is not None:
                return res
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
    refuse_capture("take", x.device_id, check_bounds)
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
    dev = x.device_id
    geo = take_geometry(x.shape, ax, idx.size, x.dtype.itemsize, x.ptr, out.ptr,
                        m.backend.get_device_info(dev).multiprocessor_count)
    name = m.kernel(TEMPLATE, dev, **take_rows_params(geo["unit"], idx.dtype)).name
    record(dev, x, idx)
    check = _start_check(m, idx, size, "take", check_bounds, out)
    try:
        m.backend.launch_kernel(name, geo["grid"], out, x, idx, *geo["args"],
                                block_size=(ROW_BLOCK, 1, 1), device_id=dev)
    except BaseException:
        if check is not None:
            check.abandon()
        out.free()
        raise
    if check is not None:
        check.finish("take", ax, size, out)
    if type(axis) is int and type(check_bounds) is bool:
        key = ("take", x.shape, x.dtype, idx.shape, idx.dtype, dev, axis, check_bounds)
        if key not in m.plans:
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
    the row; grid x = the rows / rows per block; grid y splits each row when that leaves
    fewer than ROW_BLOCKS_PER_SM blocks per SM and a lane more than one step."""
    outer = math.prod(shape[:ax])
    size = shape[ax]
    row_bytes = math.prod(shape[ax + 1:]) * itemsize
    unit = row_unit(row_bytes, src_ptr, out_ptr)
    row_units = row_bytes // unit
    lanes = min(ROW_BLOCK, 1 << max(0, -(-row_units // ROW_UNROLL) - 1).bit_length())
    n_rows = outer * nidx
    gx = max(1, min(-(-n_rows // (ROW_BLOCK // lanes)), 2**31 - 1))
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
    checker = backend.prepare_launch(
        backend.get_kernel(m.kernel(TEMPLATE, dev, **check_params(idx.dtype)).name, dev),
        (check_grid(idx.size), 1, 1), (CHECK_BLOCK, 1, 1), 0, dev) if check_bounds else None
    args = geo["args"]
    pool = backend.memory_pools[dev]
    alloc = pool.allocate_current
    direct = backend.direct_launch

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
        check = _start_check(m, indices, size, "take", check_bounds, out, checker)
        try:
            rows(out._ptr, px, pi, *args)
        except BaseException:
            if check is not None:
                check.abandon()
            out.free()
            raise
        if check is not None:
            check.finish("take", ax, size, out)
        return out
    return run


def _raise_bounds(what: str, ax: int, size: int) -> None:
    raise IndexOutOfRangeError(_bounds_message(what, ax, size))


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
    refuse_capture("gather", x.device_id, check_bounds)
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
    name = m.kernel(TEMPLATE, dev, **scatter_params(target.dtype, idx.dtype)).name
    record(dev, target, idx, src)
    args = [n, size, ts[ax], len(sizes)] + _dims_args(sizes[::-1], 64, MAX_DIMS) + \
        _pad(st[::-1], MAX_DIMS) + _pad(si[::-1], MAX_DIMS)
    check = _start_check(m, idx, size, "scatter_add", check_bounds)
    try:
        m.backend.launch_kernel(name, _grid(n, BLOCK), target, src, idx, *args,
                                block_size=(BLOCK, 1, 1), device_id=dev)
    except BaseException:
        if check is not None:
            check.abandon()
        raise
    if check is not None:
        check.finish("scatter_add", ax, size)
    return target
