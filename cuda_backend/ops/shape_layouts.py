"""Element layouts of C-contiguous tensors, and the views on them: strides, the dims a copy
can merge, FastDiv divisors and the kernel arguments built from them, NumPy basic-indexing keys
as (shape, strides, offset), and `make_view`, the one place a view is made. No kernel here:
ops/shape.py's ops, ops/shape_copy.py's launches and ops/indexing.py's kernels use them.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import IndexOutOfRangeError, InvalidArgumentError, InvalidIndexError
from ..tensor import CudaTensor


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


def dims_args(sizes_inner_first: Sequence[int], bits: int, count: int) -> List[int]:
    """The FastDiv triples of `count` dims (sizes innermost first; 1 past the last), flat."""
    out: List[int] = []
    for k in range(count):
        out += fast_divisor(sizes_inner_first[k] if k < len(sizes_inner_first) else 1, bits)
    return out


def pad(values: Sequence[int], count: int) -> List[int]:
    """values with zeros appended up to count (a kernel's fixed-size array argument)."""
    return list(values) + [0] * (count - len(values))


# -- slicing ----------------------------------------------------------------------------------
def index_int(v: Any) -> Optional[int]:
    """v as an int where it is a Python or NumPy integer (bools are not), else None."""
    if isinstance(v, (bool, np.bool_)):
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    return None


def _indexed_dims(key: Tuple[Any, ...]) -> int:
    """The first pass of parse_key: how many dims the key's ints and slices index; raises for
    a second ellipsis and for an index of any other kind."""
    n_ellipsis = sum(1 for k in key if k is Ellipsis)
    if n_ellipsis > 1:
        raise InvalidIndexError("an index can only have a single ellipsis ('...')")
    used = 0
    for k in key:
        if k is None or k is Ellipsis:
            continue
        if isinstance(k, slice) or index_int(k) is not None:
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
    return used


def parse_key(shape: Tuple[int, ...], key: Any) -> Tuple[Tuple[int, ...], List[int], int]:
    """NumPy basic indexing of a C-contiguous array of `shape` by key (ints, slices, None,
    Ellipsis): (result shape, element strides, element offset)."""
    if not isinstance(key, tuple):
        key = (key,)
    used = _indexed_dims(key)
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
            i = index_int(k)
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


def one_axis(axis: Any, ndim: int, what: str) -> int:
    """axis as 0..ndim-1 (negative counts from the end); `what` names the op in errors."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise InvalidArgumentError(f"{what}: axis must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise InvalidArgumentError(
            f"{what}: axis {axis} is out of range for a tensor of {ndim} dimensions "
            f"(valid: {-ndim}..{ndim - 1})")
    return int(axis) % ndim
