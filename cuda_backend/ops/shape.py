"""Shape ops, NumPy names and semantics: reshape / view, permute / transpose, basic slicing
(`tensor[a:b, ..., c]`), concatenate, stack, split, broadcast_to and astype.

Tensors are C-contiguous, so:
- reshape / view never copy: the result is a new CudaTensor on the same memory that keeps its
  base alive (owner=). So are the results of slicing that are contiguous in memory (leading-
  axis slices, integer indices on leading axes), the pieces of split along such an axis, and a
  permute that only moves size-1 axes. A view shares the base's memory: writes through one
  show in the other. Two caveats of views, as the tensor class stands: `base.free()` frees the
  memory under its views (free views, not bases, or let them be collected), and a view used
  in a `with stream:` block orders the pool block on that stream only through ops of this
  module (other ops record the view, which owns no block: keep the base alive until that
  stream's work is done).
- everything else is a copy through one kernel template, `strided_copy.cu.j2`: "gather"
  (any strided layout), "tile" (permutations that move the innermost axis; plain 2-D
  transposes go to transpose.cu.j2), "cat" (concatenate, stack and split pieces side by
  side: one launch per 8 pieces) and "convert" (astype), planned and launched by
  ops/shape_copy.py; ops/shape_layouts.py computes the layouts and makes the views.

astype follows NumPy's astype (a new tensor, also for the same dtype): bfloat16 rounds to
nearest even from float32 (float64 first to float32, as from_numpy converts), float16 to
nearest even; float to int truncates toward zero, and where NumPy is undefined (NaN, values
out of range) NaN gives 0 and others saturate to the int32 / int64 range (uint8: through
int64, then modulo 256, which is NumPy's result for values in range); to bool: x != 0.
Fallback mode runs the same layouts (offsets and strides) through NumPy's as_strided.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple, cast

import numpy as np

from ..dtypes import CudaDataType, from_bfloat16_bits
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..tensor import CudaTensor, device_view, normalize_shape
from . import common
from .shape_copy import (BLOCK, MAX_ND_FIXED, TEMPLATE, cat_params, convert_host,
                         convert_params, copy_into, copy_params, copy_plan, grid_blocks,
                         plan_cat, record, run_cat, split_plan, strided_copy)
from .shape_join import concatenate, stack  # noqa: F401  (entries of this family)
from .shape_layouts import (contiguous_strides, index_int, is_contiguous, make_view, one_axis,
                            parse_key)

DT = CudaDataType
TEMPLATES = (TEMPLATE,)
ELEMS = (1, 2, 4, 8)
INDEX_BITS = (32, 64)
CAT_UNITS = (1, 2, 4, 8, 16)


# -- the family contract (registry.CONTRACT) ----------------------------------------------
def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """gather and tile per element size and index width, cat per unit and index width;
    convert per ordered dtype pair."""
    sets = [copy_params("gather", e, i, nd) for e in ELEMS for i in INDEX_BITS
            for nd in range(MAX_ND_FIXED + 1)]
    sets += [copy_params("tile", e, i) for e in ELEMS for i in INDEX_BITS]
    sets += [cat_params(u, i) for u in CAT_UNITS for i in INDEX_BITS]
    sets += [convert_params(s, d) for s in DT for d in DT if s is not d]
    return {TEMPLATE: sets}


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every variant in parallel threads; returns how many (0 in fallback mode)."""
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets]
    return common.compile_all(m, jobs, device_id, workers)


def reference(op: str, x: Any, *args: Any, **kwargs: Any) -> Any:
    """The op in NumPy on float64 values (ints and bools kept): "reshape", "view",
    "permute", "transpose", "getitem" (args: the key), "concatenate" / "stack" (x: the
    sequence of arrays), "split", "broadcast_to", "astype" (to a NumPy dtype; bfloat16:
    the float32 values rounded to it)."""
    def f64(a: Any) -> np.ndarray:
        a = np.asarray(a)
        return a.astype(np.float64) if a.dtype.kind == "f" else a
    if op in ("concatenate", "stack"):
        return getattr(np, op)([f64(a) for a in x], *args, **kwargs)
    a = f64(x)
    if op in ("reshape", "view"):
        return a.reshape(*args)
    if op == "permute":
        return np.ascontiguousarray(np.transpose(a, *args))
    if op == "transpose":
        return np.ascontiguousarray(np.transpose(a, *args, **kwargs))
    if op == "getitem":
        return np.array(a[args[0]])
    if op == "split":
        return [np.ascontiguousarray(p) for p in np.split(a, *args, **kwargs)]
    if op == "broadcast_to":
        return np.array(np.broadcast_to(a, *args))
    if op == "astype":
        dst = DT.from_any(args[0])
        src = DT.FLOAT64 if a.dtype.kind == "f" else DT.from_any(a.dtype)
        raw = convert_host(a, src, dst)
        return from_bfloat16_bits(raw).reshape(a.shape) if dst is DT.BFLOAT16 else raw
    raise InvalidArgumentError(f"unknown shape op {op!r}")


# -- reshape / view ---------------------------------------------------------------------------
def _target_shape(x: CudaTensor, shape: Any, what: str) -> Tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise InvalidArgumentError(
            f"{what}: shape must be an int or a tuple of ints, got {shape!r}") from None
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in dims):
        raise InvalidArgumentError(f"{what}: shape must be an int or a tuple of ints, got "
                                   f"{shape!r}")
    dims = tuple(int(s) for s in dims)
    unknown = [i for i, s in enumerate(dims) if s == -1]
    if any(s < -1 for s in dims):
        raise InvalidArgumentError(f"{what}: shape dimensions must be >= 0 (or one -1), got "
                                   f"{dims}")
    if len(unknown) > 1:
        raise InvalidArgumentError(f"{what}: only one dimension can be -1, got {dims}")
    known = math.prod(s for s in dims if s != -1)
    if unknown:
        if known == 0 or x.size % known:
            raise ShapeMismatchError(
                f"cannot {what} a tensor of shape {x.shape} ({x.size} elements) into shape "
                f"{dims}")
        dims = dims[:unknown[0]] + (x.size // known,) + dims[unknown[0] + 1:]
    elif known != x.size:
        raise ShapeMismatchError(
            f"cannot {what} a tensor of shape {x.shape} ({x.size} elements) into shape {dims} "
            f"({known} elements)")
    return normalize_shape(dims)


# (x.shape, requested shape) -> the target shape, for requests that are an int or a tuple of
# ints (a float or a bool is equal to an int as a dict key: the fast path checks the types)
_TARGETS: Dict[tuple, Tuple[int, ...]] = {}


def reshape(m: Any, x: CudaTensor, shape: Any, what: str = "reshape") -> CudaTensor:
    """x with a new shape of as many elements (one dim may be -1: inferred); no copy. A device
    tensor's reshape to a request seen before is a lookup and the view's slots."""
    if type(x) is CudaTensor and x._host is None and x._ptr is not None:
        kind = type(shape)
        if kind is tuple:
            for s in shape:
                if type(s) is not int:
                    break
            else:
                hit = _TARGETS.get((x.shape, shape))
                if hit is not None:
                    return device_view(x, hit)
        elif kind is int:
            hit = _TARGETS.get((x.shape, shape))
            if hit is not None:
                return device_view(x, hit)
    x = common.check_tensor(x, "tensor")
    target = _target_shape(x, shape, what)
    if (type(shape) is int or (type(shape) is tuple and
                               all(type(s) is int for s in shape))) and not x.on_host:
        if len(_TARGETS) >= 4096:
            _TARGETS.clear()
        _TARGETS[(x.shape, shape)] = target
    return make_view(x, target)


# -- permute / transpose ------------------------------------------------------------------------
def _axes_permutation(axes: Any, ndim: int, what: str) -> Tuple[int, ...]:
    try:
        ax = tuple(axes)
    except TypeError:
        raise InvalidArgumentError(f"{what}: axes must be a sequence of ints, got {axes!r}") \
            from None
    if any(isinstance(a, bool) or not isinstance(a, (int, np.integer)) for a in ax):
        raise InvalidArgumentError(f"{what}: axes must be a sequence of ints, got {axes!r}")
    if len(ax) != ndim:
        raise InvalidArgumentError(
            f"{what}: axes {ax} don't match a tensor of {ndim} dimensions (give a "
            f"permutation of 0..{ndim - 1})")
    out = [one_axis(a, ndim, what) for a in ax]     # (ints: checked above)
    if len(set(out)) != ndim:
        raise InvalidArgumentError(f"{what}: repeated axis in {ax}")
    return tuple(out)


def permute(m: Any, x: CudaTensor, axes: Any, what: str = "permute") -> CudaTensor:
    """x with its axes reordered (out.shape[i] = x.shape[axes[i]]), as a new contiguous
    tensor; a view when the order leaves the memory layout unchanged."""
    if type(x) is CudaTensor and type(axes) is tuple:
        key = ("permute", x.shape, x.dtype, axes, x.device_id)
        res = common.planned(m, key, x) if m.backend.direct_launch(x.device_id) else None
        if res is not None:
            return res
    x = common.check_tensor(x, "tensor")
    perm = _axes_permutation(axes, x.ndim, what)
    shape = tuple(x.shape[a] for a in perm)
    xs = contiguous_strides(x.shape)
    in_strides = [xs[a] for a in perm]
    if is_contiguous(shape, in_strides):
        return make_view(x, shape)
    out = m.backend.empty(shape, x.dtype, x.device_id)
    if out.size == 0:
        return out
    if not m.gpu:
        strided_copy(m, x, 0, in_strides, out, 0, contiguous_strides(shape), shape)
        return out
    dev = x.device_id
    launches = copy_into(m, x, 0, in_strides, out, 0, contiguous_strides(shape), shape)
    if type(axes) is tuple:
        common.remember_plan(m, ("permute", x.shape, x.dtype, axes, dev),
                             copy_plan(m, dev, launches, shape, x.dtype, x.ptr, out.ptr))
    return out


def transpose(m: Any, x: CudaTensor, axes: Any = None) -> CudaTensor:
    """NumPy's transpose: axes reversed by default, else permute(x, axes)."""
    x = common.check_tensor(x, "tensor")
    if axes is None:
        axes = tuple(range(x.ndim - 1, -1, -1))
    return permute(m, x, axes, "transpose")


# -- slicing ----------------------------------------------------------------------------------
def getitem(m: Any, x: CudaTensor, key: Any) -> CudaTensor:
    """x[key], NumPy basic indexing (ints, slices with any step, None, Ellipsis; out-of-range
    slice bounds are clipped, an integer out of range raises IndexOutOfRangeError; integers
    drop their dim): a view when the result is contiguous in memory, else a copy. A key that
    is one int32/int64 CudaTensor is take(x, key, axis=0)."""
    tok = key_token(key) if type(x) is CudaTensor and m.gpu else None
    if tok is not None:
        res = common.planned(m, ("getitem", x.shape, x.dtype, x.device_id, tok), x)
        if res is not None:
            return res
    x = common.check_tensor(x, "tensor")
    if isinstance(key, CudaTensor):
        from . import indexing
        return indexing.take(m, x, key, 0)
    shape, strides, offset = parse_key(x.shape, key)
    if math.prod(shape) == 0:
        return m.backend.empty(shape, x.dtype, x.device_id)
    dev, dtype = x.device_id, x.dtype
    if is_contiguous(shape, strides):
        if tok is not None:
            common.remember_plan(m, ("getitem", x.shape, dtype, dev, tok),
                                 lambda t: make_view(t, shape, offset))
        return make_view(x, shape, offset)
    out = m.backend.empty(shape, dtype, dev)
    if not m.gpu:
        strided_copy(m, x, offset, strides, out, 0, contiguous_strides(shape), shape)
        return out
    base = offset * dtype.itemsize
    launches = copy_into(m, x, base, strides, out, 0, contiguous_strides(shape), shape)
    if tok is not None:
        copy = copy_plan(m, dev, launches, shape, dtype, x.ptr + base, out.ptr, base)
        direct = m.backend.direct_launch
        common.remember_plan(m, ("getitem", x.shape, dtype, dev, tok),
                             lambda t: copy(t) if direct(dev) else None)
    return out


def key_token(key: Any) -> Any:
    """A hashable stand-in of a basic-indexing key made of ints, slices of ints, None and
    Ellipsis (getitem's plan key), or None for any other key (no plan)."""
    parts = key if type(key) is tuple else (key,)
    out: List[Any] = []
    for k in parts:
        if type(k) is int or k is None or k is Ellipsis:
            out.append(k)
        elif type(k) is slice:
            a, b, c = k.start, k.stop, k.step
            if not ((a is None or type(a) is int) and (b is None or type(b) is int) and
                    (c is None or type(c) is int)):
                return None
            out.append(("s", a, b, c))
        else:
            return None
    return tuple(out)


# -- split ------------------------------------------------------------------------------------
def split(m: Any, x: CudaTensor, indices_or_sections: Any, axis: int = 0) -> List[CudaTensor]:
    """np.split: `sections` equal pieces along axis (the size must divide), or pieces between
    the given indices (slice semantics: clipped, negative counts from the end). Pieces that are
    contiguous in memory (along a leading axis) are views; copies of pieces side by side
    are made by one "cat" launch per 8 pieces."""
    key = _split_key(x, indices_or_sections, axis) if m.gpu else None
    if key is not None:
        res = common.planned(m, key, x)
        if res is not None:
            return cast(List[CudaTensor], res)
    x = common.check_tensor(x, "tensor")
    if x.ndim == 0:
        raise InvalidArgumentError("split needs a tensor of at least 1 dimension, got a 0-d one")
    ax = one_axis(axis, x.ndim, "split")
    n = x.shape[ax]
    sections = index_int(indices_or_sections)
    if sections is not None:
        if sections <= 0:
            raise InvalidArgumentError(f"split: number of sections must be >= 1, got {sections}")
        if n % sections:
            raise ShapeMismatchError(
                f"split of axis {ax} (size {n}) into {sections} sections does not result in an "
                f"equal division")
        bounds = [i * (n // sections) for i in range(sections + 1)]
    else:
        try:
            points = [index_int(i) for i in indices_or_sections]
        except TypeError:
            points = [None]
        if any(p is None for p in points):
            raise InvalidArgumentError(
                f"split: indices_or_sections must be an int or a sequence of ints, got "
                f"{indices_or_sections!r}")
        bounds = [0] + cast(List[int], points) + [n]   # (no None: checked above)
    spans = [slice(bounds[i], bounds[i + 1]).indices(n)[:2] for i in range(len(bounds) - 1)]
    pieces = _split_copy(m, x, ax, spans, key)
    if pieces is not None:
        return pieces
    pre = (slice(None),) * ax
    return [getitem(m, x, pre + (slice(bounds[i], bounds[i + 1]),))
            for i in range(len(bounds) - 1)]


def _split_key(x: Any, sections: Any, axis: Any) -> Optional[tuple]:
    """split's plan key (shape, dtype, device, the sections or indices, the axis), or None:
    no plan for this call (arguments not plain ints or a tuple / list of them)."""
    if type(x) is not CudaTensor or type(axis) is not int:
        return None
    kind = type(sections)
    if kind is int:
        tok: Any = sections
    elif kind is tuple or kind is list:
        for s in sections:
            if type(s) is not int:
                return None
        tok = (kind is list, tuple(sections))
    else:
        return None
    return ("split", x.shape, x.dtype, x.device_id, axis, tok)


def _split_copy(m: Any, x: CudaTensor, ax: int, spans: List[Tuple[int, int]],
                key: Optional[tuple]) -> Optional[List[CudaTensor]]:
    """The pieces of split by "cat" launches (one per 8 pieces) where they are copies (rows
    before axis > 1), at least two are non-empty and those follow one another along axis;
    None otherwise (getitem per piece: views, or copies of overlapping pieces)."""
    rows = math.prod(x.shape[:ax])
    full = [(a, b) for a, b in spans if b > a]
    if not m.gpu or rows <= 1 or len(full) < 2 or \
            any(full[i][1] != full[i + 1][0] for i in range(len(full) - 1)):
        return None
    dev, dtype = x.device_id, x.dtype
    inner = math.prod(x.shape[ax + 1:]) * dtype.itemsize
    shapes = [x.shape[:ax] + (max(b - a, 0),) + x.shape[ax + 1:] for a, b in spans]
    outs = [m.backend.empty(s, dtype, dev) for s in shapes]
    pieces = [o for o in outs if o.size]
    base = full[0][0] * inner
    addrs = [o.ptr for o in pieces]
    launches = plan_cat(rows, [(b - a) * inner for a, b in full], addrs, x.ptr + base, True,
                        x.shape[ax] * inner)
    record(dev, x, *pieces)
    run_cat(m, dev, launches, addrs, x.ptr + base)
    if key is not None and len(pieces) == len(outs):
        copy = split_plan(m, dev, launches, shapes, dtype, x.ptr, base, addrs)
        direct = m.backend.direct_launch
        common.remember_plan(m, key, lambda t: copy(t) if direct(dev) else None)
    return outs


# -- concatenate / stack: ops/shape_join.py (re-exported above: the family module holds every
# entry of the registry's "shape" family)


# -- broadcast_to -----------------------------------------------------------------------------------
def broadcast_to(m: Any, x: CudaTensor, shape: Any) -> CudaTensor:
    """np.broadcast_to, materialized (tensors are contiguous): a new tensor of shape."""
    if type(x) is CudaTensor and type(shape) is tuple and m.gpu:
        res = common.planned(m, ("broadcast_to", x.shape, x.dtype, x.device_id, shape), x)
        if res is not None:
            return res
    x = common.check_tensor(x, "tensor")
    key_shape = shape
    shape = normalize_shape(shape)
    nd = len(shape)
    if nd < x.ndim:
        raise ShapeMismatchError(
            f"cannot broadcast a tensor of shape {x.shape} to shape {shape}: fewer dimensions")
    xs = contiguous_strides(x.shape)
    strides = [0] * nd
    for i in range(1, x.ndim + 1):
        have, want = x.shape[-i], shape[-i]
        if have == want:
            strides[-i] = xs[-i]
        elif have != 1:
            raise ShapeMismatchError(
                f"cannot broadcast a tensor of shape {x.shape} to shape {shape} (dimension "
                f"-{i}: {have} vs {want})")
    out = m.backend.empty(shape, x.dtype, x.device_id)
    if not m.gpu or out.size == 0:
        strided_copy(m, x, 0, strides, out, 0, contiguous_strides(shape), shape)
        return out
    dev = x.device_id
    launches = copy_into(m, x, 0, strides, out, 0, contiguous_strides(shape), shape)
    if type(key_shape) is tuple:
        copy = copy_plan(m, dev, launches, shape, x.dtype, x.ptr, out.ptr)
        direct = m.backend.direct_launch
        common.remember_plan(m, ("broadcast_to", x.shape, x.dtype, dev, key_shape),
                             lambda t: copy(t) if direct(dev) else None)
    return out


# -- astype -----------------------------------------------------------------------------------
def astype(m: Any, x: CudaTensor, dtype: Any) -> CudaTensor:
    """A new tensor of x's values converted to dtype (NumPy's astype; see the module doc)."""
    if type(x) is CudaTensor and m.gpu and (type(dtype) is str or type(dtype) is CudaDataType):
        res = common.planned(m, ("astype", x.shape, x.dtype, dtype, x.device_id), x)
        if res is not None:
            return res
    x = common.check_tensor(x, "tensor")
    dst = CudaDataType.from_any(dtype)
    if dst is x.dtype:
        return m.copy(x)
    dev = x.device_id
    out = m.backend.empty(x.shape, dst, dev)
    n = x.size
    if not n:
        return out
    if not m.gpu:
        out.host_view[...] = convert_host(x.host_view, x.dtype, dst)
        return out
    params = convert_params(x.dtype, dst)
    g = 16 // max(x.dtype.itemsize, dst.itemsize)
    vec = int(not (x.ptr | out.ptr) % 16)
    name = m.kernel(TEMPLATE, dev, **params).name
    grid = grid_blocks(n // g if vec else n, BLOCK)
    m.backend.launch_kernel(name, grid, x, out, n, vec, block_size=(BLOCK, 1, 1),
                            device_id=dev)
    if type(dtype) is str or type(dtype) is CudaDataType:
        common.remember_plan(m, ("astype", x.shape, x.dtype, dtype, dev),
                             _astype_plan(m, name, x, dst, g))
    return out


def _astype_plan(m: Any, name: str, x: CudaTensor, dst: CudaDataType, g: int) -> Any:
    """astype's per-call plan for tensors like x into dst (ops/common.py remember_plan):
    run(x) -> the converted tensor, or None (general path: freed, on a stream, no direct
    launch); the vectorized launch where both pointers are 16-byte aligned, as the general
    path chooses."""
    from ..tensor import pool_tensor
    backend = m.backend
    shape, src, dev, n = x.shape, x.dtype, x.device_id, x.size
    nbytes = n * dst.itemsize
    kernel = backend.get_kernel(name, dev)
    by_vec = [backend.prepare_launch(kernel, (grid_blocks(n, BLOCK), 1, 1), (BLOCK, 1, 1), 0,
                                     dev),
              backend.prepare_launch(kernel, (grid_blocks(n // g, BLOCK), 1, 1), (BLOCK, 1, 1),
                                     0, dev)]
    pool, alloc, direct = common.plan_memory(m, dev)
    plan_pointer = common.plan_pointer

    def run(t: CudaTensor) -> Optional[CudaTensor]:
        px = plan_pointer(t, shape, src, dev)
        if px is None or not direct(dev):
            return None
        out = pool_tensor(shape, dst, dev, alloc(nbytes, None), pool, n, nbytes)
        po = out._ptr
        vec = int(not (px | po) % 16)
        by_vec[vec](px, po, n, vec)
        return out
    return run
