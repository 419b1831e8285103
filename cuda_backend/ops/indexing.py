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
check_bounds=False 19-21 us (0.80-0.90 of copy); check_bounds=True the same (the copy checks
its indices, device_errors.py).

Bounds: an index outside [-size, size) of the axis writes 0 (take, gather) or adds nothing
(scatter_add). With check_bounds=True (the default) it is an IndexOutOfRangeError (an
IndexError, as NumPy), found on the device and raised by the next synchronizing call
(synchronize, to_numpy, item, a stream's or event's synchronize), as PyTorch's device-side
checks do but without losing the context: the kernel that reads an index checks it and sets
the call's error slot in mapped host memory (cuda_backend/device_errors.py). Nothing waits
and nothing more runs, so a checked call costs the device what an unchecked one does. In
fallback mode the call itself raises. check_bounds=False skips the check: capturable in a CUDA graph (check_bounds=True
raises GraphCaptureError while capturing), and out-of-range indices give zeros / no add,
silently. After the error from scatter_add, target holds the adds of the in-range indices.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, cast

import numpy as np

from ..dtypes import CudaDataType, to_bfloat16_bits
from ..errors import DTypeMismatchError, InvalidArgumentError
from ..tensor import CudaTensor
from . import common
from .indexing_kernels import (BLOCK, COMPARE_OPS, ELEMS, INDEX_DTYPES,
                               SCATTER_DTYPES, TEMPLATE, UNITS, check_dims,
                               compare_flat_params, compare_params, flat_items, gather_params,
                               scatter_params, take_rows_params, where_flat_params,
                               where_params)
from .indexing_scatter import scatter_add  # noqa: F401  (ops' entries, as CudaMath calls them)
from .indexing_take import gather, take  # noqa: F401
from .shape_copy import MAX_DIMS, grid_blocks, record
from .shape_layouts import collapse, contiguous_strides, dims_args, pad

DT = CudaDataType
TEMPLATES = (TEMPLATE,)
_NP_COMPARE = {"equal": np.equal, "not_equal": np.not_equal, "less": np.less,
               "less_equal": np.less_equal, "greater": np.greater,
               "greater_equal": np.greater_equal}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# -- the contract -------------------------------------------------------------------------------
def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Comparisons per op and dtype (broadcasting, and two tensors of one shape), where
    (broadcasting, and three tensors of one shape) and gather per element size (gather per
    index dtype too), take's row copy per unit and index dtype, scatter_add per dtype and
    index dtype."""
    sets = [compare_params(op, dt) for op in COMPARE_OPS for dt in DT]
    sets += [compare_flat_params(op, dt) for op in COMPARE_OPS for dt in DT]
    sets += [where_params(e) for e in ELEMS]
    sets += [where_flat_params(e) for e in ELEMS]
    sets += [gather_params(e, i) for e in ELEMS for i in INDEX_DTYPES]
    sets += [take_rows_params(u, i) for u in UNITS for i in INDEX_DTYPES]
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




def _scalar_for(dtype: CudaDataType, value: Any, what: str) -> Any:
    from .elementwise_kernels import scalar_arg
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
def _plan_key(name: str, op: str, a: Any, b: Any, t: CudaTensor,
              cond: Optional[CudaTensor] = None) -> tuple:
    """The per-call plan key of compare / where: the tensors' shapes (None for a scalar
    operand), the dtype and the device."""
    return (name, op, cond.shape if cond is not None else None,
            a.shape if type(a) is CudaTensor else None,
            b.shape if type(b) is CudaTensor else None, t.dtype, t.device_id)


def _planned(m: Any, key: tuple, cond: Any, a: Any, b: Any) -> Optional[CudaTensor]:
    """The result through the per-call plan of key, or None (no plan, or it steps aside)."""
    plan = m.plans.get(key) if m.gpu else None
    return None if plan is None else plan(cond, a, b)


def compare(m: Any, op: str, a: Any, b: Any) -> CudaTensor:
    """op(a, b) elementwise with broadcasting: a bool tensor."""
    t0 = a if type(a) is CudaTensor else b
    if type(t0) is CudaTensor:
        res = _planned(m, _plan_key("compare", op, a, b, t0), None, a, b)
        if res is not None:
            return res
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
    if ta and tb and a.shape == b.shape:   # two tensors of one shape: the flat kernel
        return _compare_flat(m, op, a, b, out)
    sa = _bcast_strides(shape, a.shape) if ta else [0] * len(shape)
    sb = _bcast_strides(shape, b.shape) if tb else [0] * len(shape)
    sizes, (sa, sb) = collapse(shape, sa, sb)
    check_dims(len(sizes), shape, op)
    mode = (0 if ta else 1) | (0 if tb else 2)
    name = m.kernel(TEMPLATE, dev, **compare_params(op, dtype)).name
    record(dev, *[x for x in (a, b) if isinstance(x, CudaTensor)])
    args = [n, len(sizes), mode] + dims_args(sizes[::-1], 64, MAX_DIMS) + \
        pad(sa[::-1], MAX_DIMS) + pad(sb[::-1], MAX_DIMS)
    m.backend.launch_kernel(name, grid_blocks(n, BLOCK), out, a if ta else 0, b if tb else 0,
                            va, vb, *args, block_size=(BLOCK, 1, 1), device_id=dev)
    key = _plan_key("compare", op, a, b, t)
    if key not in m.plans:
        common.remember_plan(m, key, _launch_plan(m, name, out, None, a, b, tuple(args),
                                                  lambda v, what: _scalar_for(dtype, v, what)))
    return out


def _compare_flat(m: Any, op: str, a: CudaTensor, b: CudaTensor, out: CudaTensor) -> CudaTensor:
    """op(a, b) of two (contiguous) tensors of one shape into out: the four-argument kernel,
    and its per-call plan."""
    dev, n = out.device_id, out.size
    name = m.kernel(TEMPLATE, dev, **compare_flat_params(op, a.dtype)).name
    record(dev, a, b)
    m.backend.launch_kernel(name, grid_blocks(flat_items(n, a.dtype), BLOCK), out, a, b,
                            n, block_size=(BLOCK, 1, 1), device_id=dev)
    key = _plan_key("compare", op, a, b, a)
    if key not in m.plans:
        common.remember_plan(m, key, _flat_plan(m, name, out, a.dtype, False))
    return out


def _where_flat(m: Any, cond: CudaTensor, a: CudaTensor, b: CudaTensor,
                out: CudaTensor) -> CudaTensor:
    """where of three (contiguous) tensors of out's shape into out: the five-argument
    kernel, and its per-call plan."""
    dev, n = out.device_id, out.size
    name = m.kernel(TEMPLATE, dev, **where_flat_params(a.dtype.itemsize)).name
    record(dev, cond, a, b)
    m.backend.launch_kernel(name, grid_blocks(flat_items(n, a.dtype), BLOCK), out, cond, a, b,
                            n, block_size=(BLOCK, 1, 1), device_id=dev)
    key = _plan_key("where", "", a, b, a, cond)
    if key not in m.plans:
        common.remember_plan(m, key, _flat_plan(m, name, out, a.dtype, True))
    return out


def _flat_plan(m: Any, name: str, res: CudaTensor, dtype: CudaDataType, where: bool) -> Any:
    """The per-call plan (ops/common.py remember_plan) of a comparison of two tensors of
    res's shape (where: of where over three): run(cond, a, b) -> the result, or None (general
    path) unless each is a live tensor of the plan's shape, dtype (cond: bool) and device on no
    stream."""
    from ..tensor import pool_tensor
    backend = m.backend
    shape, rdt, dev = res.shape, res.dtype, res.device_id
    n, nbytes = res.size, res.nbytes
    go = backend.prepare_launch(backend.get_kernel(name, dev),
                                (grid_blocks(flat_items(n, dtype), BLOCK), 1, 1),
                                (BLOCK, 1, 1), 0, dev)
    pool, alloc, direct = common.plan_memory(m, dev)
    plan_pointer = common.plan_pointer

    def run(c: Any, a: Any, b: Any) -> Optional[CudaTensor]:
        pa, pb = plan_pointer(a, shape, dtype, dev), plan_pointer(b, shape, dtype, dev)
        pc = plan_pointer(c, shape, DT.BOOL, dev) if where else 0
        if pa is None or pb is None or pc is None or not direct(dev):
            return None
        out = pool_tensor(shape, rdt, dev, alloc(nbytes, None), pool, n, nbytes)
        if where:
            go(out._ptr, pc, pa, pb, n)
        else:
            go(out._ptr, pa, pb, n)
        return out
    return run


def where(m: Any, cond: Any, a: Any, b: Any) -> CudaTensor:
    """np.where(cond, a, b): cond a bool tensor, a / b tensors of one dtype or scalars."""
    t0 = a if type(a) is CudaTensor else b
    if type(cond) is CudaTensor and type(t0) is CudaTensor:
        res = _planned(m, _plan_key("where", "", a, b, t0, cond), cond, a, b)
        if res is not None:
            return res
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
    if ta and tb and cond.shape == a.shape == b.shape:   # three of one shape: the flat kernel
        return _where_flat(m, cond, a, b, out)
    return _where_broadcast(m, cond, a, b, out, va, vb, tensors)


def _where_broadcast(m: Any, cond: CudaTensor, a: Any, b: Any, out: CudaTensor, va: Any,
                     vb: Any, tensors: List[CudaTensor]) -> CudaTensor:
    """where with broadcasting into out (a scalar a or b given as its storage value va or
    vb): the N-d kernel over the collapsed dims, and its per-call plan."""
    ta, tb = isinstance(a, CudaTensor), isinstance(b, CudaTensor)
    shape, dtype, dev, n = out.shape, out.dtype, out.device_id, out.size
    t = a if ta else b
    sc = _bcast_strides(shape, cond.shape)
    sa = _bcast_strides(shape, a.shape) if ta else [0] * len(shape)
    sb = _bcast_strides(shape, b.shape) if tb else [0] * len(shape)
    sizes, (sc, sa, sb) = collapse(shape, sc, sa, sb)
    check_dims(len(sizes), shape, "where")
    mode = (0 if ta else 1) | (0 if tb else 2)
    unsigned = _UNSIGNED[dtype.itemsize]
    bits_a = 0 if ta else int(cast(np.ndarray, va).view(unsigned))
    bits_b = 0 if tb else int(cast(np.ndarray, vb).view(unsigned))
    name = m.kernel(TEMPLATE, dev, **where_params(dtype.itemsize)).name
    record(dev, *tensors)
    args = [n, len(sizes), mode] + dims_args(sizes[::-1], 64, MAX_DIMS) + \
        pad(sc[::-1], MAX_DIMS) + pad(sa[::-1], MAX_DIMS) + pad(sb[::-1], MAX_DIMS)
    m.backend.launch_kernel(name, grid_blocks(n, BLOCK), out, cond, a if ta else 0, b if tb else 0,
                            bits_a, bits_b, *args, block_size=(BLOCK, 1, 1), device_id=dev)
    key = _plan_key("where", "", a, b, t, cond)
    if key not in m.plans:
        def bits(v: Any, what: str) -> int:
            return int(_storage_value(dtype, _scalar_for(dtype, v, what)).view(unsigned))
        common.remember_plan(m, key, _launch_plan(m, name, out, cond, a, b, tuple(args), bits))
    return out


def _launch_plan(m: Any, name: str, res: CudaTensor, cond: Optional[CudaTensor], a: Any,
                 b: Any, args: tuple, convert: Any) -> Any:
    """The per-call plan (ops/common.py remember_plan) of compare (cond None) or where for
    operands like these: run(cond, a, b) -> the result, or None (general path) unless every
    tensor is live, of the plan's shape, dtype and device, on no stream, and each scalar an
    int or a float; scalars are converted by convert(value, what) as the general path does
    (its errors), the last few conversions kept."""
    from ..tensor import pool_tensor
    backend = m.backend
    shape, rdt, dev = res.shape, res.dtype, res.device_id
    n, nbytes = res.size, res.nbytes
    t = a if isinstance(a, CudaTensor) else b
    dtype = t.dtype
    a_shape = a.shape if isinstance(a, CudaTensor) else None
    b_shape = b.shape if isinstance(b, CudaTensor) else None
    c_shape = cond.shape if cond is not None else None
    go = backend.prepare_launch(backend.get_kernel(name, dev), (grid_blocks(n, BLOCK), 1, 1),
                                (BLOCK, 1, 1), 0, dev).bind(5 if cond is None else 6, *args)
    pool, alloc, direct = common.plan_memory(m, dev)
    plan_pointer = common.plan_pointer
    BOOL = DT.BOOL
    seen: Dict[tuple, Any] = {}

    def scalar(v: Any, what: str) -> Any:
        k = (type(v), v)
        c = seen.get(k)
        if c is None:
            if len(seen) >= 64:
                seen.clear()
            c = seen[k] = convert(v, what)
        return c

    def run(c: Any, a: Any, b: Any) -> Optional[CudaTensor]:
        pa: Optional[int]
        pb: Optional[int]
        if a_shape is None:
            pa, va = 0, scalar(a, "a") if type(a) is float or type(a) is int else None
        else:
            pa, va = plan_pointer(a, a_shape, dtype, dev), 0
        if b_shape is None:
            pb, vb = 0, scalar(b, "b") if type(b) is float or type(b) is int else None
        else:
            pb, vb = plan_pointer(b, b_shape, dtype, dev), 0
        pc = 0 if c_shape is None else plan_pointer(c, c_shape, BOOL, dev)
        if pa is None or pb is None or pc is None or va is None or vb is None or \
                not direct(dev):
            return None
        out = pool_tensor(shape, rdt, dev, alloc(nbytes, None), pool, n, nbytes)
        if c_shape is None:
            go(out._ptr, pa, pb, va, vb)
        else:
            go(out._ptr, pc, pa, pb, va, vb)
        return out
    return run
