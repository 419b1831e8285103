"""The elementwise broadcast path: binary operands of different shapes, in launches of
`templates/elementwise.cu.j2`'s "broadcast" kernel.

Dims are collapsed where both operands broadcast the same way (`collapse`); a launch covers
at most MAX_BCAST_DIMS of them and fewer than LAUNCH_LIMIT (2^31) elements, so the kernel
decomposes output indices with 32-bit division; larger outputs are cut by element count into
a few launches with pointer offsets (`broadcast_plan`, checked on the CPU by
tests/test_elementwise.py, which emulates the kernel's index math). Rows whose innermost dim is
a multiple of the vector width (bias adds) still use 16-byte accesses.
"""
from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

from ..dtypes import CudaDataType
from ..tensor import CudaTensor
from .elementwise_kernels import BLOCK_DIMS, DeviceCache, kernel_name, launch_grid
from .elementwise_plans import remember_broadcast_plan

MAX_BCAST_DIMS = 6
LAUNCH_LIMIT = 2**31   # a broadcast launch stays under this many elements (32-bit division)
CHUNK = 2**30          # piece of an innermost row longer than that (keeps 16-byte alignment)


def collapse(shape: Tuple[int, ...], a_shape: Tuple[int, ...],
             b_shape: Tuple[int, ...]) -> Optional[List[Tuple[int, int, int]]]:
    """(size, a stride, b stride) per dim, outermost first, in elements, after dropping
    size-1 dims and merging neighbours that both operands traverse the same way. None when
    both operands turn out to be contiguous over the same elements (same-shape path)."""
    nd = len(shape)
    dims: List[Tuple[int, int, int]] = []
    strides = []
    for s in (a_shape, b_shape):
        s = (1,) * (nd - len(s)) + tuple(s)
        st, acc = [0] * nd, 1
        for d in range(nd - 1, -1, -1):
            st[d] = acc if s[d] != 1 else 0
            acc *= s[d]
        strides.append(st)
    for d in range(nd):
        if shape[d] == 1:
            continue
        size, x, y = shape[d], strides[0][d], strides[1][d]
        if dims:
            ps, px, py = dims[-1]
            if px == x * size and py == y * size:
                dims[-1] = (ps * size, x, y)
                continue
        dims.append((size, x, y))
    if not dims or (len(dims) == 1 and dims[0][1] == 1 and dims[0][2] == 1):
        return None
    return dims


def broadcast_launch(m: Any, cache: DeviceCache, op: str, dtype: CudaDataType, dev: int,
                     res: CudaTensor, a: CudaTensor, b: CudaTensor,
                     dims: List[Tuple[int, int, int]], remember: bool = False) -> CudaTensor:
    """Launch the broadcast kernel once per entry of the plan; remember: when that was one
    launch with 16-byte aligned pointers, keep its per-call plan (elementwise_plans)."""
    name, per_block = kernel_name(m, cache, dev, "broadcast", op, dtype)
    vec = 16 // dtype.itemsize
    launch = m.backend.launch_kernel
    count, first = 0, None
    for args in broadcast_plan(dims, dtype.itemsize, res.ptr, a.ptr, b.ptr):
        grid = launch_grid(args[3] // vec if args[5] else args[3], per_block)
        launch(name, grid, *args, block_size=BLOCK_DIMS, device_id=dev)
        count, first = count + 1, args
    if remember and count == 1 and first is not None and not ((res.ptr | a.ptr | b.ptr) & 15):
        remember_broadcast_plan(m, op, a, b, res, name, per_block, first)
    return res


def broadcast_plan(dims: List[Tuple[int, int, int]], itemsize: int, po: int, pa: int,
                   pb: int, limit: int = 0, chunk: int = 0) -> Iterator[tuple]:
    """Kernel arguments (out, a, b, n, ndim, vectorize, 6 sizes, 6 a strides, 6 b strides)
    of each launch for collapsed dims (outermost first), made one launch at a time (host
    memory O(ndim)). A launch covers fewer than `limit` (2^31) elements, as the kernel's
    index math is 32-bit: the innermost dims whole, at most 6, and the next one (where 6
    are not reached) in equal runs of as many indices as fit, and dims further out with
    pointer offsets. An innermost dim of `limit` or more goes in pieces of `chunk`
    elements, which keeps 16-byte alignment. Up to 6 collapsed dims thus take fewer than
    3 * elements / (limit - 1) + 1 launches (for chunk >= limit / 2); more dims, one per
    index of the dims beyond 6. (limit, chunk: smaller values for tests.)"""
    first, even, pieces, run = _launch_cut(dims, limit or LAUNCH_LIMIT, chunk or CHUNK)
    top_size, top_a, top_b = dims[first]           # the dim cut into runs
    inner = dims[first:][::-1]                     # innermost first, as the kernel wants
    outer = dims[:first]
    step = _prod(d[0] for d in inner[:-1])         # output elements per index of it
    row = step * top_size                          # output elements per outer index
    vec = 16 // itemsize
    pad = MAX_BCAST_DIMS - len(inner)
    sa = [d[1] for d in inner] + [0] * pad
    sb = [d[2] for d in inner] + [0] * pad
    vec_strides = all(x % vec == 0 for x in sa[1:]) and all(x % vec == 0 for x in sb[1:])
    idx = [0] * len(outer)
    for r in range(_prod(d[0] for d in outer)):
        oa = sum(i * d[1] for i, d in zip(idx, outer))
        ob = sum(i * d[2] for i, d in zip(idx, outer))
        for j in range(pieces):
            if even:
                start = j * top_size // pieces
                count = (j + 1) * top_size // pieces - start
            else:
                start = j * run
                count = min(run, top_size - start)
            sizes = [d[0] for d in inner[:-1]] + [count] + [1] * pad
            p_o = po + (r * row + start * step) * itemsize
            p_a = pa + (oa + start * top_a) * itemsize
            p_b = pb + (ob + start * top_b) * itemsize
            vectorize = sizes[0] % vec == 0 and vec_strides and not (p_o & 15) and \
                (sa[0] == 0 or not (p_a & 15)) and (sb[0] == 0 or not (p_b & 15))
            yield (p_o, p_a, p_b, step * count, len(inner), int(vectorize), *sizes, *sa, *sb)
        for d in range(len(outer) - 1, -1, -1):   # odometer over the outer dims
            idx[d] += 1
            if idx[d] < outer[d][0]:
                break
            idx[d] = 0


def _launch_cut(dims: List[Tuple[int, int, int]], limit: int,
                chunk: int) -> Tuple[int, bool, int, int]:
    """broadcast_plan's cut: (first, even, pieces, run). dims[first] is each launch's
    outermost dim, taken in `pieces` runs of its indices, as equal as can be (even) or of
    `run` indices, the last shorter (one run, or an innermost dim in runs of `chunk`); the
    dims inside it go whole: at most 6, under `limit` elements."""
    k, n = 0, 1                                    # innermost dims covered whole, elements
    for size, _, _ in reversed(dims):
        if k == MAX_BCAST_DIMS or n * size >= limit:
            break
        n *= size
        k += 1
    first = len(dims) - k                          # the launch's outermost dim
    split = k < MAX_BCAST_DIMS and first > 0       # the next dim goes in too, in runs
    if split:
        first -= 1
    top_size = dims[first][0]
    even = split and k > 0
    run = 0
    if even:       # `pieces` runs of at most (limit - 1) // n indices, as equal as can be
        pieces = -(-top_size // ((limit - 1) // n))
    else:          # one run, or an innermost dim in runs of `chunk`
        run = min(chunk, limit - 1) if k == 0 else top_size
        pieces = -(-top_size // run)
    return first, even, pieces, run


def _prod(xs: Any) -> int:
    p = 1
    for x in xs:
        p *= x
    return p
