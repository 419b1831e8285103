"""2-D max and average pooling of NCHW tensors (`templates/pool2d.cu.j2`).

Semantics follow PyTorch (ceil_mode=False): output size floor((H + 2p - k) / s) + 1, stride
defaults to the window, padding at most half the window; max pooling pads with -inf and
propagates NaN, average pooling counts the padding in the divisor (count_include_pad=True).

Two kernels: the 2x2 stride-2 unpadded window (the common downsampling layer) reads each
input row pair with 16-byte loads and writes vec/2 outputs per item; every other window
takes the generic kernel (one output per thread, window clipped to the input).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..kernels import dtype_params
from ..tensor import CudaTensor, pool_tensor
from . import common

TEMPLATE = "pool2d.cu.j2"
TEMPLATES = (TEMPLATE,)
BLOCK = 256
KINDS = ("max", "avg")
_OP_NAME = {"max": "max_pool2d", "avg": "avg_pool2d"}  # the plans' key: the public name
DTYPES = common.FLOATS
Pair = Union[int, Tuple[int, int]]


def _vec(dtype: CudaDataType) -> int:
    return 16 // dtype.itemsize


def _params(kind: str, dtype: CudaDataType, fast: bool) -> Dict[str, Any]:
    return {**dtype_params(dtype), "kind": kind, "window": 2 if fast else 0,
            "vec": _vec(dtype) if fast else 1, "block_size": BLOCK}


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    return {TEMPLATE: [_params(k, dt, fast) for k in KINDS for dt in DTYPES
                       for fast in (False, True)]}


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every pooling variant in parallel threads (nvcc runs in subprocesses);
    returns how many were compiled (0 in fallback mode). Later calls find them memoized."""
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets]
    return common.compile_all(m, jobs, device_id, workers)


def reference(x: Any, kind: str, pool_size: Pair, stride: Optional[Pair] = None,
              padding: Pair = (0, 0)) -> np.ndarray:
    """kind ("max" or "avg") pooling of an NCHW array in float64 (the fallback's math: max
    pads with -inf, avg counts padding in the divisor); stride defaults to pool_size."""
    k = pair(pool_size, "pool_size", 1)
    s = k if stride is None else pair(stride, "stride", 1)
    p = pair(padding, "padding", 0)
    return _host_pool(kind, np.asarray(x, dtype=np.float64), k, s, p, CudaDataType.FLOAT64)


def pair(value: Any, name: str, minimum: int) -> Tuple[int, int]:
    """An int or a pair of ints, each >= minimum, as a pair (also the backward's and
    CudaML's rule and messages)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value, value)
    try:
        a, b = value
        if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in (a, b)):
            raise TypeError
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"{name} must be an int or a pair of ints, got {value!r}") from None
    a, b = int(a), int(b)
    if a < minimum or b < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {(a, b)}")
    return a, b


def output_shape(shape: Tuple[int, ...], k: Tuple[int, int], s: Tuple[int, int],
                 p: Tuple[int, int]) -> Tuple[int, int, int, int]:
    """(N, C, OH, OW) for an NCHW input; raises when the window does not fit."""
    n, c, h, w = shape
    oh = (h + 2 * p[0] - k[0]) // s[0] + 1
    ow = (w + 2 * p[1] - k[1]) // s[1] + 1
    if oh < 1 or ow < 1:
        raise ShapeMismatchError(
            f"pool window {k} with padding {p} does not fit the input of shape {shape} "
            f"(output would be {max(oh, 0)}x{max(ow, 0)})")
    return n, c, oh, ow


def pool2d(m: Any, kind: str, x: CudaTensor, pool_size: Pair, stride: Optional[Pair] = None,
           padding: Pair = (0, 0), out: Optional[CudaTensor] = None) -> CudaTensor:
    """Max ("max") or average ("avg") pooling of an NCHW tensor; out= (internal, tests)
    receives the result instead of a new tensor."""
    if out is None and type(x) is CudaTensor and \
            (type(pool_size) is int or _plain(pool_size)) and \
            (stride is None or type(stride) is int or _plain(stride)) and \
            (type(padding) is int or _plain(padding)):
        # the per-call plan (ops/common.py remember_plan): int or (int, int) window, stride
        # and padding only (no equal-valued float or bool reaches it unchecked)
        key = (_OP_NAME.get(kind), x.shape, x.dtype, x.device_id, pool_size, stride, padding)
        res = common.planned(m, key, x) if m.backend.direct_launch(x.device_id) else None
        if res is not None:
            return res
    op, k, s, p, shape = _checked(kind, x, pool_size, stride, padding)
    if out is not None:
        common.check_out(out, x, shape)
    if not m.gpu:
        values = _host_pool(kind, common.host_array(m, x), k, s, p, x.dtype)
        if out is None:
            return common.from_host(m, values, x.dtype, x.device_id)
        common.write_host(m, values, out)
        return out
    dev = x.device_id
    out, owned = common.result_tensor(m, out, shape, x.dtype, dev)
    if out.size == 0:
        return out
    vec = _vec(x.dtype)
    fast = (k == (2, 2) and s == (2, 2) and p == (0, 0) and x.shape[3] % vec == 0
            and x.ptr % 16 == 0 and out.ptr % (vec // 2 * x.dtype.itemsize) == 0)
    kernel = m.kernel(TEMPLATE, dev, **_params(kind, x.dtype, fast))
    grid, args = _launch_args(x.shape, shape, k, s, p, vec, fast)
    m.backend.launch_kernel(kernel.name, grid, x, out, *args, block_size=(BLOCK, 1, 1),
                            device_id=dev)
    if owned and _plain(pool_size) and (stride is None or _plain(stride)) and _plain(padding):
        key = (op, x.shape, x.dtype, dev, pool_size, stride, padding)
        plan = m.plans.get(key)
        if not hasattr(plan, "variants"):
            plan = common.remember_plan(m, key, _fast_plan(m, x, shape, k, s, p))
        if fast not in plan.variants:
            plan.variants[fast] = (m.backend.prepare_launch(kernel, grid, (BLOCK, 1, 1), 0,
                                                            dev), args)
    return out


def _checked(kind: str, x: CudaTensor, pool_size: Pair, stride: Optional[Pair],
             padding: Pair) -> Tuple[str, Tuple[int, int], Tuple[int, int], Tuple[int, int],
                                     Tuple[int, int, int, int]]:
    """pool2d's checks: (op name, window, stride, padding as pairs, output shape)."""
    if kind not in KINDS:
        raise InvalidArgumentError(f"pool kind must be 'max' or 'avg', got {kind!r}")
    op = f"{kind}_pool2d"
    common.check_tensor(x, "tensor")
    if x.ndim != 4:
        raise InvalidArgumentError(f"{op} needs a 4-D NCHW tensor, got shape {x.shape}")
    common.require_dtype(x, DTYPES, op)
    if x.shape[2] == 0 or x.shape[3] == 0:
        raise InvalidArgumentError(
            f"{op} needs non-empty spatial dimensions, got shape {x.shape}")
    k = pair(pool_size, "pool_size", 1)
    s = k if stride is None else pair(stride, "stride", 1)
    p = pair(padding, "padding", 0)
    if 2 * p[0] > k[0] or 2 * p[1] > k[1]:
        raise InvalidArgumentError(
            f"{op}: padding {p} must be at most half of pool_size {k}")
    shape = output_shape(x.shape, k, s, p)
    return op, k, s, p, shape


def _plain(v: Any) -> bool:
    """v is an int or a tuple of two ints (not bools, floats or NumPy scalars): a pool
    parameter that may key a plan (an equal float or bool must reach the checks)."""
    t = type(v)
    return t is int or (t is tuple and len(v) == 2 and type(v[0]) is int
                        and type(v[1]) is int)


def _launch_args(in_shape: Tuple[int, ...], shape: Tuple[int, ...], k: Tuple[int, int],
                 s: Tuple[int, int], p: Tuple[int, int], vec: int,
                 fast: bool) -> Tuple[int, tuple]:
    """(grid, the arguments after x and out) of the 2x2 kernel (fast) or the generic one."""
    n, c, h, w = in_shape
    oh, ow = shape[2], shape[3]
    if fast:
        total = n * c * oh * (w // vec)
        return _grid(total), (total, h, w, *fast_divisor(oh), *fast_divisor(w // vec))
    total = n * c * oh * ow
    return _grid(total), (total, h, w, *fast_divisor(oh), *fast_divisor(ow), k[0], k[1],
                          s[0], s[1], p[0], p[1])


def _fast_plan(m: Any, x: CudaTensor, shape: Tuple[int, ...], k: Tuple[int, int],
               s: Tuple[int, int], p: Tuple[int, int]) -> Any:
    """The per-call plan of pooling on inputs shaped like x (ops/common.py remember_plan):
    the result's allocation and one prepared launch. The 2x2 kernel is taken as pool2d
    takes it, from the pointers' alignment: `variants` maps that choice to the launch the
    general path made for it, and a choice not seen yet returns None (the general path
    launches it and adds it)."""
    dev, dtype = x.device_id, x.dtype
    size = shape[0] * shape[1] * shape[2] * shape[3]
    nbytes = size * dtype.itemsize
    vec = _vec(dtype)
    two_by_two = k == (2, 2) and s == (2, 2) and p == (0, 0) and x.shape[3] % vec == 0
    out_align = vec // 2 * dtype.itemsize
    pool = m.backend.memory_pools[dev]
    alloc = pool.allocate_current
    variants: Dict[bool, Any] = {}

    def run(x: CudaTensor) -> Optional[CudaTensor]:
        px = x._ptr
        if px is None or x.stream is not None:
            return None
        out = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        po = out._ptr
        v = variants.get(two_by_two and px % 16 == 0 and po % out_align == 0)
        if v is None:
            out.free()
            return None
        v[0](px, po, *v[1])
        return out
    run.variants = variants  # type: ignore[attr-defined]
    return run


def fast_divisor(d: int) -> Tuple[int, int, int]:
    """(d, m, l) for the templates' FastDiv: q = n / d computed as
    (t + ((n - t) >> min(l, 1))) >> max(l - 1, 0) with t = mulhi64(m, n), exact for every
    n < 2^64 (Granlund and Montgomery, PLDI'94, fig. 4.1)."""
    if d < 1:
        raise InvalidArgumentError(f"divisor must be >= 1, got {d}")
    l = (d - 1).bit_length()  # ceil(log2 d)
    m = ((1 << 64) * ((1 << l) - d)) // d + 1
    return d, m, l


def _grid(items: int) -> int:
    """One item per thread (many short blocks: no partial last wave of long ones); the
    kernel's grid-stride loop covers what a 2^31-1 block grid cannot."""
    return max(1, min(-(-items // BLOCK), 2**31 - 1))


# -- host (fallback) -----------------------------------------------------------------------
def _host_pool(kind: str, a: np.ndarray, k: Tuple[int, int], s: Tuple[int, int],
               p: Tuple[int, int], dtype: CudaDataType) -> np.ndarray:
    """The pooling in NumPy, computed in float32 for half types (as the kernel does)."""
    work = np.float64 if dtype is CudaDataType.FLOAT64 else np.float32
    a = a.astype(work, copy=False)
    fill = -np.inf if kind == "max" else 0.0
    padded = np.pad(a, ((0, 0), (0, 0), (p[0], p[0]), (p[1], p[1])), constant_values=fill)
    win = np.lib.stride_tricks.sliding_window_view(padded, k, axis=(2, 3))
    _, _, oh, ow = output_shape(a.shape, k, s, p)
    win = win[:, :, ::s[0], ::s[1]][:, :, :oh, :ow]
    with np.errstate(invalid="ignore"):  # inf - inf in a window is NaN, as on the GPU
        if kind == "max":
            return win.max(axis=(4, 5))
        return win.sum(axis=(4, 5)) / work(k[0] * k[1])
