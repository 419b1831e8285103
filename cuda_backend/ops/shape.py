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
- everything else is a copy through one kernel template, `strided_copy.cu.j2`:
  "gather": out[i] = in[offset + sum_k c_k(i) * stride_k] over up to 8 dims (after merging
  dims both sides traverse the same way), coordinates found with FastDiv (32-bit where every
  count is under 2^32, else 64-bit), 64-bit strides (negative for reversed slices, 0 for
  broadcast dims), 16-byte items when the innermost input stride is 1 (or 0) and the
  pointers allow; output strides too, so concatenate / stack write each input into the
  output at an offset (one launch per input). "tile": a 32 x 32 shared-memory transpose for
  permutations that move the innermost axis (reads and writes both coalesced), any batch
  dims around it; a plain (batched) 2-D transpose of 2-, 4- or 8-byte elements goes to
  transpose.cu.j2's autotuned kernels instead (ops/transpose.py). "convert": astype between
  every pair of dtypes.

astype follows NumPy's astype (a new tensor, also for the same dtype): bfloat16 rounds to
nearest even from float32 (float64 first to float32, as from_numpy converts), float16 to
nearest even; float to int truncates toward zero, and where NumPy is undefined (NaN, values
out of range) NaN gives 0 and others saturate to the int32 / int64 range (uint8: through
int64, then modulo 256, which is NumPy's result for values in range); to bool: x != 0.
Fallback mode runs the same layouts (offsets and strides) through NumPy's as_strided.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import numpy as np

from ..dtypes import CudaDataType, from_bfloat16_bits, to_bfloat16_bits
from ..errors import (IndexOutOfRangeError, InvalidArgumentError, InvalidIndexError,
                      ShapeMismatchError)
from ..tensor import CudaTensor, normalize_shape, pool_tensor
from . import common

DT = CudaDataType
TEMPLATE = "strided_copy.cu.j2"
TEMPLATES = (TEMPLATE,)
BLOCK = 128           # threads per block of "gather" and "convert"
TILE_BLOCK = 256      # "tile": 32 x 8 threads
TILE = 32
MAX_DIMS = 8          # dims one "gather" launch covers (after merging)
MAX_BATCH = 6         # batch dims around a "tile" launch's two
ELEMS = (1, 2, 4, 8)
INDEX_BITS = (32, 64)
MAX_GRID = 2**31 - 1
_ALIAS = {2: DT.FLOAT16, 4: DT.INT32, 8: DT.INT64}   # transpose.cu.j2 dtype per element size
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# -- template parameters ------------------------------------------------------------------------
def copy_params(kind: str, elem: int, index: int) -> Dict[str, Any]:
    """Parameters of a "gather" or "tile" render for elements of `elem` bytes."""
    return {"kind": kind, "elem": elem, "index": index,
            "block_size": TILE_BLOCK if kind == "tile" else BLOCK}


def _storage_ctype(dtype: CudaDataType) -> str:
    return "unsigned char" if dtype is DT.BOOL else dtype.c_type


def convert_params(src: CudaDataType, dst: CudaDataType) -> Dict[str, Any]:
    """Parameters of the "convert" render from src to dst."""
    return {"kind": "convert", "src": src.name_str, "dst": dst.name_str,
            "src_ctype": _storage_ctype(src), "dst_ctype": _storage_ctype(dst),
            "block_size": BLOCK}


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """gather and tile per element size and index width; convert per ordered dtype pair."""
    sets = [copy_params(k, e, i) for k in ("gather", "tile") for e in ELEMS for i in INDEX_BITS]
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


# -- layouts --------------------------------------------------------------------------------
def contiguous_strides(shape: Sequence[int]) -> List[int]:
    """C-contiguous element strides of shape."""
    out, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        out[d] = acc
        acc *= max(shape[d], 1)
    return out


def is_contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether (shape, strides) walks memory C-contiguously (size-1 dims ignored)."""
    acc = 1
    for size, st in zip(reversed(shape), reversed(strides)):
        if size == 1:
            continue
        if st != acc:
            return False
        acc *= size
    return True


def collapse(shape: Sequence[int], *strides: Sequence[int]) -> Tuple[List[int], List[List[int]]]:
    """Merge the dims of an iteration space (outermost first) that every operand traverses
    the same way, dropping size-1 dims: (sizes, [strides per operand]); at least one dim."""
    dims: List[Tuple[int, List[int]]] = []
    for d, size in enumerate(shape):
        if size == 1:
            continue
        ss = [s[d] for s in strides]
        if dims:
            psize, ps = dims[-1]
            if all(p == x * size for p, x in zip(ps, ss)):
                dims[-1] = (psize * size, ss)
                continue
        dims.append((size, ss))
    if not dims:
        return [1], [[1] for _ in strides]
    return [d[0] for d in dims], [[d[1][k] for d in dims] for k in range(len(strides))]


def fast_divisor(d: int, bits: int = 64) -> Tuple[int, int, int]:
    """(d, m, l) for FastDiv (_strided.cuh.j2): q = n / d computed as
    (t + ((n - t) >> min(l, 1))) >> max(l - 1, 0), t = mulhi(m, n), exact for every
    n < 2^bits (Granlund and Montgomery, PLDI'94, fig. 4.1)."""
    if d < 1:
        raise InvalidArgumentError(f"divisor must be >= 1, got {d}")
    l = (d - 1).bit_length()
    m = ((1 << bits) * ((1 << l) - d)) // d + 1
    return d, m, l


def _dims_args(sizes_inner_first: Sequence[int], bits: int, count: int) -> List[int]:
    out: List[int] = []
    for k in range(count):
        out += fast_divisor(sizes_inner_first[k] if k < len(sizes_inner_first) else 1, bits)
    return out


def _pad(values: Sequence[int], count: int) -> List[int]:
    return list(values) + [0] * (count - len(values))


# -- launches ---------------------------------------------------------------------------------
class Launch:
    """One kernel launch of a copy: kernel (template parameters or a compiled name), grid,
    block, byte offsets of its source and destination from the copy's base addresses, and
    the arguments after the two pointers."""

    __slots__ = ("template", "params", "grid", "block", "src_off", "dst_off", "args")

    def __init__(self, template: str, params: Dict[str, Any], grid: Any, block: Tuple[int, ...],
                 args: Sequence[Any], src_off: int = 0, dst_off: int = 0) -> None:
        self.template, self.params, self.grid, self.block = template, params, grid, block
        self.args, self.src_off, self.dst_off = tuple(args), src_off, dst_off


def _grid(items: int, per_block: int) -> int:
    return max(1, min(-(-items // per_block), MAX_GRID))


def plan_copy(m: Any, dev: int, dtype: CudaDataType, shape: Sequence[int],
              in_strides: Sequence[int], out_strides: Sequence[int], src_addr: int,
              dst_addr: int) -> List[Launch]:
    """The launches of dst[out layout] = src[in layout] for one iteration shape (element
    strides, addresses of element 0 of each layout). Empty for an empty shape."""
    if math.prod(shape) == 0:
        return []
    sizes, (si, so) = collapse(shape, in_strides, out_strides)
    nd = len(sizes)
    if nd > MAX_DIMS:
        raise InvalidArgumentError(
            f"the copy has {nd} dims after merging those that can be merged; at most "
            f"{MAX_DIMS} are supported (shape {tuple(shape)})")
    itemsize = dtype.itemsize
    if nd >= 2 and so[-1] == 1 and si[-1] not in (0, 1) and 1 in si[:-1]:
        a = nd - 2 - si[-2::-1].index(1)          # the last dim the input walks contiguously
        tr_launches = _transpose_launches(m, dev, dtype, sizes, si, so, a, src_addr, dst_addr)
        if tr_launches is not None:
            return tr_launches
        return [_tile_launch(itemsize, sizes, si, so, a)]
    return [_gather_launch(itemsize, sizes, si, so, src_addr, dst_addr)]


def _index_bits(*counts: int) -> int:
    return 32 if max(counts) < 2**32 - 64 else 64


def _gather_launch(itemsize: int, sizes: List[int], si: List[int], so: List[int],
                   src_addr: int, dst_addr: int) -> Launch:
    w = 16 // itemsize
    mode = 0
    n0, others = sizes[-1], range(len(sizes) - 1)
    if w > 1 and so[-1] == 1 and n0 % w == 0 and dst_addr % 16 == 0 and \
            all(so[k] % w == 0 for k in others):
        if si[-1] == 1 and src_addr % 16 == 0 and all(si[k] % w == 0 for k in others):
            mode = 1
        elif si[-1] == 0:
            mode = 2
    sizes, si, so = list(sizes), list(si), list(so)
    if mode:
        sizes[-1] //= w
        si[-1] *= w
        so[-1] = w
    items = math.prod(sizes)
    unit = w if mode else 1
    out_contig = so == [unit * s for s in contiguous_strides(sizes)]
    bits = _index_bits(items, *sizes)
    inner_first = sizes[::-1]
    args = [items, len(sizes), mode, int(out_contig)] + _dims_args(inner_first, bits, MAX_DIMS) \
        + _pad(si[::-1], MAX_DIMS) + _pad(so[::-1], MAX_DIMS)
    return Launch(TEMPLATE, copy_params("gather", itemsize, bits), _grid(items, BLOCK),
                  (BLOCK, 1, 1), args)


def _tile_launch(itemsize: int, sizes: List[int], si: List[int], so: List[int],
                 a: int) -> Launch:
    nd = len(sizes)
    b = nd - 1
    A, B = sizes[a], sizes[b]
    tiles_a, tiles_b = -(-A // TILE), -(-B // TILE)
    batch = [d for d in range(nd - 1, -1, -1) if d not in (a, b)]      # innermost first
    if len(batch) > MAX_BATCH:
        raise InvalidArgumentError(f"a transposing copy of {nd} merged dims: at most "
                                   f"{MAX_BATCH + 2} are supported")
    count = math.prod(sizes[d] for d in batch)
    n_tiles = tiles_a * tiles_b * count
    bits = _index_bits(n_tiles, A + TILE, B + TILE, *(sizes[d] for d in batch))
    args = [n_tiles, A, B, si[b], so[a], *fast_divisor(tiles_a, bits),
            *fast_divisor(tiles_a * tiles_b, bits), len(batch)]
    args += _dims_args([sizes[d] for d in batch], bits, MAX_BATCH)
    args += _pad([si[d] for d in batch], MAX_BATCH) + _pad([so[d] for d in batch], MAX_BATCH)
    return Launch(TEMPLATE, copy_params("tile", itemsize, bits), min(n_tiles, MAX_GRID),
                  (TILE, TILE_BLOCK // TILE, 1), args)


def _transpose_launches(m: Any, dev: int, dtype: CudaDataType, sizes: List[int],
                        si: List[int], so: List[int], a: int, src_addr: int,
                        dst_addr: int) -> Optional[List[Launch]]:
    """A (batched) transpose of whole contiguous planes into a contiguous output, done by
    transpose.cu.j2 (autotuned, as matrix_transpose): 2-, 4- and 8-byte elements, planes
    under 2^31 elements. None when the layout is not that."""
    from . import transpose as tr
    alias = _ALIAS.get(dtype.itemsize)
    nd = len(sizes)
    if alias is None or so != contiguous_strides(sizes):
        return None
    if nd == 2 and a == 0 and si[1] == sizes[0]:
        batch, rows, cols = 1, sizes[1], sizes[0]
    elif nd == 3 and a == 1 and si[2] == sizes[1] and si[0] == sizes[1] * sizes[2]:
        batch, rows, cols = sizes[0], sizes[2], sizes[1]
    else:
        return None
    if rows * cols >= 2**31:
        return None
    n = batch * rows * cols
    x = CudaTensor((n,), alias, dev, src_addr)      # aliases of the bits, for tr's picker
    out = CudaTensor((n,), alias, dev, dst_addr)
    cfg = tr.pick(m, x, out, batch, rows, cols)
    params = tr.config_params(alias, cfg)
    extra: Tuple[int, ...]
    if cfg["kernel"] == "tile":
        block, extra = (32, cfg["block_rows"], 1), ()
    else:
        block, extra = (cfg["threads"], 1, 1), (cfg["group"],)
    plane = rows * cols * dtype.itemsize
    return [Launch(tr.TEMPLATE, params, grid, block, (rows, cols, *extra), b0 * plane,
                   b0 * plane)
            for b0, grid in tr.launch_grids(cfg, batch, rows, cols, tr.max_grid_z(m, dev))]


def record(dev: int, *tensors: CudaTensor) -> None:
    """Note the current stream's use of tensors passed to launches as raw addresses (and of
    the tensors views keep alive), as the launcher does for tensor arguments."""
    from ..memory import record_stream
    from ..streams import current_pycuda_stream
    stream = current_pycuda_stream(dev)
    for t in tensors:
        while isinstance(t, CudaTensor):
            if t.stream is not stream:
                record_stream(t, stream)
            t = t._owner


def run_launches(m: Any, dev: int, launches: Sequence[Launch], src_addr: int,
                 dst_addr: int) -> None:
    launch = m.backend.launch_kernel
    for L in launches:
        name = m.kernel(L.template, dev, **L.params).name
        launch(name, L.grid, src_addr + L.src_off, dst_addr + L.dst_off, *L.args,
               block_size=L.block, device_id=dev)


def _host_layout(t: CudaTensor, offset: int, strides: Sequence[int],
                 shape: Sequence[int]) -> np.ndarray:
    """Fallback: the elements of t's storage at offset + sum c_k * strides_k (a view)."""
    flat = t.host_view.reshape(-1)
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(flat[offset:], tuple(shape),
                                           tuple(s * item for s in strides))


def strided_copy(m: Any, src: CudaTensor, src_off: int, in_strides: Sequence[int],
                 dst: CudaTensor, dst_off: int, out_strides: Sequence[int],
                 shape: Sequence[int]) -> None:
    """dst[dst_off + sum c_k * out_strides_k] = src[src_off + sum c_k * in_strides_k] for
    every coordinate c of shape (offsets and strides in elements; src and dst of one
    dtype, on one device, not overlapping)."""
    if math.prod(shape) == 0:
        return
    if not m.gpu:
        _host_layout(dst, dst_off, out_strides, shape)[...] = \
            _host_layout(src, src_off, in_strides, shape)
        return
    dev = src.device_id
    item = src.dtype.itemsize
    s_addr, d_addr = src.ptr + src_off * item, dst.ptr + dst_off * item
    launches = plan_copy(m, dev, src.dtype, shape, in_strides, out_strides, s_addr, d_addr)
    record(dev, src, dst)
    run_launches(m, dev, launches, s_addr, d_addr)


# -- views ------------------------------------------------------------------------------------
def make_view(x: CudaTensor, shape: Tuple[int, ...], offset: int = 0) -> CudaTensor:
    """A tensor of `shape` on x's memory from element `offset` (contiguous), keeping x alive."""
    x.check_alive()
    host = None
    if x.on_host:
        assert x._host is not None      # (on_host says so)
        n = math.prod(shape)
        flat = x._host.reshape(-1)[offset:offset + n]
        try:
            host = flat.reshape(shape)
        except ValueError:   # NumPy caps the product of the other dims even when empty
            host = np.empty((0,) * len(shape), flat.dtype)
    t = CudaTensor(shape, x.dtype, x.device_id, x._ptr + offset * x.dtype.itemsize, owner=x,
                   host=host)
    t._pool = x._pool           # its operators use x's backend; owns no block
    t.stream = x.stream
    return t


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


def reshape(m: Any, x: CudaTensor, shape: Any, what: str = "reshape") -> CudaTensor:
    """x with a new shape of as many elements (one dim may be -1: inferred); no copy."""
    x = common.check_tensor(x, "tensor")
    return make_view(x, _target_shape(x, shape, what))


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
    out = []
    for a in ax:
        if not -ndim <= a < ndim:
            raise InvalidArgumentError(
                f"{what}: axis {a} is out of range for a tensor of {ndim} dimensions "
                f"(valid: {-ndim}..{ndim - 1})")
        out.append(int(a) % ndim)
    if len(set(out)) != ndim:
        raise InvalidArgumentError(f"{what}: repeated axis in {ax}")
    return tuple(out)


def permute(m: Any, x: CudaTensor, axes: Any, what: str = "permute") -> CudaTensor:
    """x with its axes reordered (out.shape[i] = x.shape[axes[i]]), as a new contiguous
    tensor; a view when the order leaves the memory layout unchanged."""
    if type(x) is CudaTensor and type(axes) is tuple:
        plan = m.plans.get(("permute", x.shape, x.dtype, axes, x.device_id))
        if plan is not None and m.backend.direct_launch(x.device_id):
            res = plan(x)
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
    launches = plan_copy(m, dev, x.dtype, shape, in_strides, contiguous_strides(shape), x.ptr,
                         out.ptr)
    record(dev, x, out)
    run_launches(m, dev, launches, x.ptr, out.ptr)
    if type(axes) is tuple:
        common.remember_plan(m, ("permute", x.shape, x.dtype, axes, dev),
                             _copy_plan(m, dev, launches, shape, x.dtype, x.ptr, out.ptr))
    return out


def transpose(m: Any, x: CudaTensor, axes: Any = None) -> CudaTensor:
    """NumPy's transpose: axes reversed by default, else permute(x, axes)."""
    x = common.check_tensor(x, "tensor")
    if axes is None:
        axes = tuple(range(x.ndim - 1, -1, -1))
    return permute(m, x, axes, "transpose")


def _copy_plan(m: Any, dev: int, launches: List[Launch], shape: Tuple[int, ...],
               dtype: CudaDataType, src_addr: int, dst_addr: int) -> Any:
    """The per-call plan (ops/common.py remember_plan) of a copy into a new tensor: the
    allocation and the prepared launches made for sources and results at these addresses
    modulo 16 (the launches' access widths follow the alignment); other alignments return
    None (the general path)."""
    backend = m.backend
    pool = backend.memory_pools[dev]
    alloc = pool.allocate_current
    size = math.prod(shape)
    nbytes = size * dtype.itemsize
    sa, da = src_addr % 16, dst_addr % 16
    prepared = [(L.src_off, L.dst_off,
                 backend.prepare_launch(m.kernel(L.template, dev, **L.params), L.grid, L.block,
                                        0, dev), L.args) for L in launches]

    def run(x: CudaTensor) -> Optional[CudaTensor]:
        px = x._ptr
        if px is None or x.stream is not None or px % 16 != sa:
            return None
        out = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        po = out._ptr
        if po % 16 != da:
            out.free()
            return None
        for so, do, go, args in prepared:
            go(px + so, po + do, *args)
        return out
    return run


# -- slicing ----------------------------------------------------------------------------------
def _index_int(v: Any) -> Optional[int]:
    if isinstance(v, (bool, np.bool_)):
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    return None


def parse_key(shape: Tuple[int, ...], key: Any) -> Tuple[Tuple[int, ...], List[int], int]:
    """NumPy basic indexing of a C-contiguous array of `shape` by key (ints, slices, None,
    Ellipsis): (result shape, element strides, element offset)."""
    if not isinstance(key, tuple):
        key = (key,)
    n_ellipsis = sum(1 for k in key if k is Ellipsis)
    if n_ellipsis > 1:
        raise InvalidIndexError("an index can only have a single ellipsis ('...')")
    used = 0
    for k in key:
        if k is None or k is Ellipsis:
            continue
        if isinstance(k, slice) or _index_int(k) is not None:
            used += 1
            continue
        if isinstance(k, CudaTensor):
            raise InvalidIndexError(
                "a CudaTensor index must be the whole key (tensor[indices] takes along axis "
                "0); use take() or gather() for other axes")
        raise InvalidIndexError(
            f"only integers, slices (`:`), ellipsis (`...`) and None are valid indices, got "
            f"{type(k).__name__} {k!r}" + (" (boolean masks: use where())" if isinstance(
                k, (bool, np.bool_)) else ""))
    ndim = len(shape)
    if used > ndim:
        raise InvalidIndexError(f"too many indices for tensor: tensor is {ndim}-dimensional, "
                                f"but {used} were indexed")
    strides = contiguous_strides(shape)
    out_shape: List[int] = []
    out_strides: List[int] = []
    offset, d = 0, 0
    for k in key:
        if k is None:
            out_shape.append(1)
            out_strides.append(0)
        elif k is Ellipsis:
            for _ in range(ndim - used):
                out_shape.append(shape[d])
                out_strides.append(strides[d])
                d += 1
        elif isinstance(k, slice):
            try:
                start, stop, step = k.indices(shape[d])
            except TypeError:
                raise InvalidIndexError(
                    f"slice indices must be integers or None, got {k!r}") from None
            except ValueError as exc:       # step 0
                raise InvalidArgumentError(f"{exc} (in {k!r})") from None
            length = len(range(start, stop, step))
            if length:
                offset += start * strides[d]
            out_shape.append(length)
            out_strides.append(step * strides[d])
            d += 1
        else:
            i = _index_int(k)
            assert i is not None            # (the first pass let only ints through)
            size = shape[d]
            if not -size <= i < size:
                raise IndexOutOfRangeError(
                    f"index {i} is out of bounds for axis {d} with size {size}")
            offset += (i % size) * strides[d]
            d += 1
    while d < ndim:                          # dims the key leaves out: whole
        out_shape.append(shape[d])
        out_strides.append(strides[d])
        d += 1
    return tuple(out_shape), out_strides, offset


def getitem(m: Any, x: CudaTensor, key: Any) -> CudaTensor:
    """x[key], NumPy basic indexing (ints, slices with any step, None, Ellipsis; out-of-range
    slice bounds are clipped, an integer out of range raises IndexOutOfRangeError; integers
    drop their dim): a view when the result is contiguous in memory, else a copy. A key that
    is one int32/int64 CudaTensor is take(x, key, axis=0)."""
    x = common.check_tensor(x, "tensor")
    if isinstance(key, CudaTensor):
        from . import indexing
        return indexing.take(m, x, key, 0)
    shape, strides, offset = parse_key(x.shape, key)
    if math.prod(shape) == 0:
        return m.backend.empty(shape, x.dtype, x.device_id)
    if is_contiguous(shape, strides):
        return make_view(x, shape, offset)
    out = m.backend.empty(shape, x.dtype, x.device_id)
    strided_copy(m, x, offset, strides, out, 0, contiguous_strides(shape), shape)
    return out


def split(m: Any, x: CudaTensor, indices_or_sections: Any, axis: int = 0) -> List[CudaTensor]:
    """np.split: `sections` equal pieces along axis (the size must divide), or pieces between
    the given indices (slice semantics: clipped, negative counts from the end). Pieces that are
    contiguous in memory (along a leading axis) are views."""
    x = common.check_tensor(x, "tensor")
    if x.ndim == 0:
        raise InvalidArgumentError("split needs a tensor of at least 1 dimension, got a 0-d one")
    ax = _one_axis(axis, x.ndim, "split")
    n = x.shape[ax]
    sections = _index_int(indices_or_sections)
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
            points = [_index_int(i) for i in indices_or_sections]
        except TypeError:
            points = [None]
        if any(p is None for p in points):
            raise InvalidArgumentError(
                f"split: indices_or_sections must be an int or a sequence of ints, got "
                f"{indices_or_sections!r}")
        bounds = [0] + cast(List[int], points) + [n]   # (no None: checked above)
    pre = (slice(None),) * ax
    return [getitem(m, x, pre + (slice(bounds[i], bounds[i + 1]),))
            for i in range(len(bounds) - 1)]


def _one_axis(axis: Any, ndim: int, what: str) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise InvalidArgumentError(f"{what}: axis must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise InvalidArgumentError(
            f"{what}: axis {axis} is out of range for a tensor of {ndim} dimensions "
            f"(valid: {-ndim}..{ndim - 1})")
    return int(axis) % ndim


# -- concatenate / stack / broadcast_to ------------------------------------------------------------
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
    flattened first); one copy launch per non-empty input, into the result at its offset."""
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
    ax = _one_axis(axis, nd, "concatenate")
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
    off = 0
    for t in ts:
        if t.size:
            strided_copy(m, t, 0, contiguous_strides(t.shape), out, off * ostr[ax], ostr,
                         t.shape)
        off += t.shape[ax]
    return out


def stack(m: Any, tensors: Any, axis: int = 0) -> CudaTensor:
    """np.stack: tensors of one shape and dtype joined along a new axis."""
    ts = _tensor_list(tensors, "stack")
    shape = ts[0].shape
    for i, t in enumerate(ts[1:], 1):
        if t.shape != shape:
            raise ShapeMismatchError(
                f"stack: all input tensors must have the same shape, but the tensor at index 0 "
                f"has shape {shape} and the tensor at index {i} has shape {t.shape}")
    ax = _one_axis(axis, len(shape) + 1, "stack")
    new = shape[:ax] + (1,) + shape[ax:]
    return concatenate(m, [make_view(t, new) for t in ts], ax)


def broadcast_to(m: Any, x: CudaTensor, shape: Any) -> CudaTensor:
    """np.broadcast_to, materialized (tensors are contiguous): a new tensor of shape."""
    x = common.check_tensor(x, "tensor")
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
    strided_copy(m, x, 0, strides, out, 0, contiguous_strides(shape), shape)
    return out


# -- astype -----------------------------------------------------------------------------------
def astype(m: Any, x: CudaTensor, dtype: Any) -> CudaTensor:
    """A new tensor of x's values converted to dtype (NumPy's astype; see the module doc)."""
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
    grid = _grid(n // g if vec else n, BLOCK)
    m.backend.launch_kernel(name, grid, x, out, n, vec, block_size=(BLOCK, 1, 1),
                            device_id=dev)
    return out


_I32 = (-2**31, 2**31 - 1)


def convert_host(raw: np.ndarray, src: CudaDataType, dst: CudaDataType) -> np.ndarray:
    """The "convert" kernel in NumPy: storage values of src (bfloat16 as uint16 bits) ->
    storage values of dst."""
    if src is DT.BFLOAT16:
        v = from_bfloat16_bits(raw).reshape(np.shape(raw))
    elif src is DT.BOOL:
        v = np.asarray(raw) != 0
    else:
        v = np.asarray(raw)
    with np.errstate(all="ignore"):
        if dst is DT.BOOL:
            return v != 0
        if dst is DT.BFLOAT16:
            return to_bfloat16_bits(v.astype(np.float32)).reshape(v.shape)
        if dst is DT.FLOAT16:
            if src is DT.FLOAT64:
                return v.astype(np.float16)
            return v.astype(np.float32).astype(np.float16)
        if dst in (DT.FLOAT32, DT.FLOAT64):
            return v.astype(dst.numpy_dtype)
        if src.is_floating:
            t = np.trunc(v.astype(np.float64))
            nan = np.isnan(t)
            if dst is DT.INT32:
                r = np.clip(np.where(nan, 0.0, t), *_I32).astype(np.int32)
                return r
            big = t >= 2.0**63
            r = np.where(nan | big, 0.0, np.maximum(t, -2.0**63)).astype(np.int64)
            r[big] = 2**63 - 1
            return r.astype(dst.numpy_dtype)     # uint8: modulo 256
        return v.astype(dst.numpy_dtype)         # integers wrap, bool 0 / 1
