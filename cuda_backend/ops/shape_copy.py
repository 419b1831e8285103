"""The copies of the shape ops: one kernel template, `strided_copy.cu.j2`, its parameters, the
launches a copy takes and their per-call plans, and "convert" (astype) with its NumPy model.
ops/shape.py's ops and ops/indexing.py use them; ops/shape_layouts.py computes the layouts.

"gather": out[i] = in[offset + sum_k c_k(i) * stride_k] over up to 8 dims (after merging
dims both sides traverse the same way), coordinates found with FastDiv (32-bit where every
count is under 2^32, else 64-bit), 64-bit strides (negative for reversed slices, 0 for
broadcast dims), 16-byte items when the innermost input stride is 1 (or 0) and the
pointers allow; output strides too. "cat": concatenate / stack / split of contiguous
pieces side by side along one axis, one launch per 8 pieces (plan_cat, cat_plan,
split_plan), items as wide as the pointers and sizes allow (up to 16 bytes). "tile": a
32 x 32 shared-memory transpose for permutations that move the innermost axis (reads and
writes both coalesced), any batch dims around it; a plain (batched) 2-D transpose of 2-, 4- or 8-byte elements goes to
transpose.cu.j2's autotuned kernels instead (ops/transpose.py). "convert": astype between
every pair of dtypes. Fallback mode runs the same layouts (offsets and strides) through
NumPy's as_strided.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..dtypes import CudaDataType, from_bfloat16_bits, to_bfloat16_bits
from ..errors import InvalidArgumentError
from ..tensor import CudaTensor, pool_tensor
from .shape_layouts import collapse, contiguous_strides, dims_args, fast_divisor, pad

DT = CudaDataType
TEMPLATE = "strided_copy.cu.j2"
BLOCK = 128           # threads per block of "gather" and "convert"
TILE_BLOCK = 256      # "tile": 32 x 8 threads
TILE = 32
MAX_DIMS = 8          # dims one "gather" launch covers (after merging)
MAX_ND_FIXED = 5      # gathers of up to this many dims get a render for their ndim (nd)
GATHER_ITEMS = 4      # items a "gather" thread moves per step (strided_copy.cu.j2 GU)
MAX_BATCH = 6         # batch dims around a "tile" launch's two
MAX_GRID = 2**31 - 1
MAX_PIECES = 8        # pieces one "cat" launch moves
_ALIAS = {2: DT.FLOAT16, 4: DT.INT32, 8: DT.INT64}   # transpose.cu.j2 dtype per element size


# -- template parameters ------------------------------------------------------------------------
def copy_params(kind: str, elem: int, index: int, ndim: int = 0) -> Dict[str, Any]:
    """Parameters of a "gather" or "tile" render for elements of `elem` bytes; a gather's
    `nd` is its launch's ndim where that is at most MAX_ND_FIXED (0: any)."""
    if kind == "tile":
        return {"kind": kind, "elem": elem, "index": index, "block_size": TILE_BLOCK}
    return {"kind": kind, "elem": elem, "index": index, "block_size": BLOCK,
            "nd": ndim if ndim <= MAX_ND_FIXED else 0}


def cat_params(unit: int, index: int) -> Dict[str, Any]:
    """Parameters of a "cat" render moving `unit` bytes per work item."""
    return {"kind": "cat", "unit": unit, "index": index, "block_size": BLOCK}


def _storage_ctype(dtype: CudaDataType) -> str:
    return "unsigned char" if dtype is DT.BOOL else dtype.c_type


def convert_params(src: CudaDataType, dst: CudaDataType) -> Dict[str, Any]:
    """Parameters of the "convert" render from src to dst."""
    return {"kind": "convert", "src": src.name_str, "dst": dst.name_str,
            "src_ctype": _storage_ctype(src), "dst_ctype": _storage_ctype(dst),
            "block_size": BLOCK}


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


def grid_blocks(items: int, per_block: int) -> int:
    """A 1-D grid of per_block items a block over items (at least 1, at most MAX_GRID)."""
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
    args = [items, len(sizes), mode, int(out_contig)] + dims_args(inner_first, bits, MAX_DIMS) \
        + pad(si[::-1], MAX_DIMS) + pad(so[::-1], MAX_DIMS)
    return Launch(TEMPLATE, copy_params("gather", itemsize, bits, len(sizes)),
                  grid_blocks(items, BLOCK * GATHER_ITEMS), (BLOCK, 1, 1), args)


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
    args += dims_args([sizes[d] for d in batch], bits, MAX_BATCH)
    args += pad([si[d] for d in batch], MAX_BATCH) + pad([so[d] for d in batch], MAX_BATCH)
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


# -- concatenate / split of contiguous pieces: "cat" -------------------------------------------
class CatLaunch:
    """One "cat" launch: its template parameters, grid, the pieces it moves (indices into
    the pieces' list, at most MAX_PIECES), the byte offset of its group's first column in
    the whole tensor and the arguments after the nine pointers."""

    __slots__ = ("params", "grid", "pieces", "one_off", "args")

    def __init__(self, params: Dict[str, Any], grid: int, pieces: Sequence[int], one_off: int,
                 args: Sequence[Any]) -> None:
        self.params, self.grid, self.pieces = params, grid, tuple(pieces)
        self.one_off, self.args = one_off, tuple(args)


def cat_unit(*values: int) -> int:
    """The widest power of two up to 16 (bytes) dividing every value (addresses, sizes)."""
    unit = 16
    for v in values:
        while v % unit:
            unit //= 2
    return unit


def plan_cat(rows: int, piece_bytes: Sequence[int], piece_addrs: Sequence[int],
             one_addr: int, split: bool, row_bytes: Optional[int] = None) -> List[CatLaunch]:
    """The "cat" launches between one contiguous tensor viewed as `rows` rows of row_bytes
    (default: the pieces' sum; one_addr: the first piece's column of row 0) and pieces
    holding piece_bytes[k] (> 0) bytes of each row, side by side in order: concatenate
    (the pieces into the one) or split (the one into the pieces). One launch per group of
    MAX_PIECES pieces."""
    if row_bytes is None:
        row_bytes = sum(piece_bytes)
    unit = cat_unit(one_addr, row_bytes, *piece_bytes, *piece_addrs)
    inners = [b // unit for b in piece_bytes]
    ostride = row_bytes // unit
    bits = _index_bits(rows * ostride, rows, ostride)
    params = cat_params(unit, bits)
    out: List[CatLaunch] = []
    col = 0
    for g0 in range(0, len(inners), MAX_PIECES):
        group = list(range(g0, min(g0 + MAX_PIECES, len(inners))))
        widths = [inners[k] for k in group]
        gw = sum(widths)
        offs = [sum(widths[:k]) for k in range(1, MAX_PIECES)]
        offs = [o if k + 1 < len(widths) else gw for k, o in enumerate(offs)]
        items = rows * gw
        args = [items, int(split), *fast_divisor(gw, bits), ostride] + \
            pad(widths, MAX_PIECES) + offs
        out.append(CatLaunch(params, grid_blocks(items, BLOCK), group, col * unit, args))
        col += gw
    return out


def run_cat(m: Any, dev: int, launches: Sequence[CatLaunch], piece_addrs: Sequence[int],
            one_addr: int) -> None:
    """Launch plan_cat's launches on these addresses (the pieces' and the one tensor's)."""
    launch = m.backend.launch_kernel
    for L in launches:
        name = m.kernel(TEMPLATE, dev, **L.params).name
        ptrs = pad([piece_addrs[k] for k in L.pieces], MAX_PIECES)
        launch(name, L.grid, one_addr + L.one_off, *ptrs, *L.args, block_size=(BLOCK, 1, 1),
               device_id=dev)


def prepare_cat(m: Any, dev: int, launches: Sequence[CatLaunch]) -> List[Tuple[Any, ...]]:
    """plan_cat's launches prepared for a per-call plan: (prepared launch, piece indices,
    one_off, arguments) each."""
    backend = m.backend
    return [(backend.prepare_launch(m.kernel(TEMPLATE, dev, **L.params), L.grid,
                                    (BLOCK, 1, 1), 0, dev), L.pieces, L.one_off, L.args)
            for L in launches]


def cat_plan(m: Any, dev: int, launches: Sequence[CatLaunch], sources: Sequence[int],
             src_addrs: Sequence[int], shape: Tuple[int, ...], dtype: CudaDataType,
             dst_addr: int) -> Any:
    """The per-call plan of concatenate by "cat" launches: sources[k] is the index in the
    call's list of the k-th piece (src_addrs[k] its address at the first call);
    run(tensors) -> the result, or None (general path) where a piece is freed, on a stream,
    of another dtype or device, or not at its first call's address modulo 16 (the unit
    follows the alignment)."""
    pool = m.backend.memory_pools[dev]
    alloc = pool.allocate_current
    size = math.prod(shape)
    nbytes = size * dtype.itemsize
    da = dst_addr % 16
    checks = [(i, a % 16) for i, a in zip(sources, src_addrs)]
    # each launch with its constant arguments packed once (PreparedLaunch.bind)
    prepared = [(go.bind(1 + MAX_PIECES, *args), [sources[k] for k in pieces], one_off)
                for go, pieces, one_off, args in prepare_cat(m, dev, launches)]
    zeros = [(0,) * (MAX_PIECES - len(idx)) for _, idx, _ in prepared]

    def run(srcs: Any) -> Optional[CudaTensor]:
        for i, sa in checks:
            t = srcs[i]
            px = t._ptr
            if px is None or t.stream is not None or t.dtype is not dtype or \
                    t.device_id != dev or px % 16 != sa:
                return None
        out = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        po = out._ptr
        if po % 16 != da:
            out.free()
            return None
        for (go, idx, one_off), z in zip(prepared, zeros):
            go(po + one_off, *[srcs[i]._ptr for i in idx], *z)
        return out
    return run


def split_plan(m: Any, dev: int, launches: Sequence[CatLaunch], shapes: Sequence[Tuple[int, ...]],
               dtype: CudaDataType, src_addr: int, src_base: int,
               dst_addrs: Sequence[int]) -> Any:
    """The per-call plan of split by "cat" launches into new tensors of `shapes` (every one
    non-empty): run(x) -> the pieces, or None (general path) where x is freed, on a stream
    or not at its first call's address modulo 16, or a piece not at its first call's
    address modulo 16. src_base: bytes from x's pointer to the first piece's column."""
    pool = m.backend.memory_pools[dev]
    alloc = pool.allocate_current
    sizes = [math.prod(s) for s in shapes]
    outs_at = [(s, n, n * dtype.itemsize, a % 16) for s, n, a in zip(shapes, sizes, dst_addrs)]
    sa = (src_addr + src_base) % 16
    prepared = [(go, idx, one_off, args, (0,) * (MAX_PIECES - len(idx)))
                for go, idx, one_off, args in prepare_cat(m, dev, launches)]

    def run(x: CudaTensor) -> Optional[List[CudaTensor]]:
        px = x._ptr
        if px is None or x.stream is not None or (px + src_base) % 16 != sa:
            return None
        px += src_base
        outs = []
        for shape, size, nbytes, da in outs_at:
            out = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
            outs.append(out)
            if out._ptr % 16 != da:
                for o in reversed(outs):
                    o.free()
                return None
        for go, idx, one_off, args, z in prepared:
            go(px + one_off, *[outs[k]._ptr for k in idx], *z, *args)
        return outs
    return run


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
    """Launch a copy's launches (plan_copy's) from src_addr to dst_addr."""
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
    item = src.dtype.itemsize
    copy_into(m, src, src_off * item, in_strides, dst, dst_off * item, out_strides, shape)


def copy_into(m: Any, src: CudaTensor, src_base: int, in_strides: Sequence[int],
              dst: CudaTensor, dst_base: int, out_strides: Sequence[int],
              shape: Sequence[int]) -> List[Launch]:
    """strided_copy's launches on the GPU (bases in bytes from each tensor's pointer, a
    non-empty shape), returned for a per-call plan (copy_plan)."""
    dev = src.device_id
    s_addr, d_addr = src.ptr + src_base, dst.ptr + dst_base
    launches = plan_copy(m, dev, src.dtype, shape, in_strides, out_strides, s_addr, d_addr)
    record(dev, src, dst)
    run_launches(m, dev, launches, s_addr, d_addr)
    return launches


def copy_plan(m: Any, dev: int, launches: List[Launch], shape: Tuple[int, ...],
               dtype: CudaDataType, src_addr: int, dst_addr: int, src_base: int = 0) -> Any:
    """The per-call plan (ops/common.py remember_plan) of a copy into a new tensor: the
    allocation and the prepared launches made for sources and results at these addresses
    modulo 16 (the launches' access widths follow the alignment); other alignments return
    None (the general path). src_base: bytes from the source tensor's pointer to the copy's
    first element (a slice's offset)."""
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
        if px is None or x.stream is not None or (px + src_base) % 16 != sa:
            return None
        px += src_base
        out = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        po = out._ptr
        if po % 16 != da:
            out.free()
            return None
        for so, do, go, args in prepared:
            go(px + so, po + do, *args)
        return out
    return run


# -- astype's conversion in NumPy ----------------------------------------------------------------
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
