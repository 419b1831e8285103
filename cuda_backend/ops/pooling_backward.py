"""Gradients of max_pool2d and avg_pool2d (`templates/pool2d_backward.cu.j2`): dx of an NCHW
input from the gradient g of the pooled output, with the forward's semantics (ops/pooling.py:
stride defaults to the window, padding at most half of it, output floor((H + 2p - k) / s) + 1).

max: each g goes to the element the forward picked, recomputed from the forward's input x
with the forward's rule (PyTorch's indices): the first maximum in row-major window order, the
last NaN of a window holding one, the first element of a window of -inf. avg: g / (kh * kw)
to every element of its window (padding counted in the divisor, count_include_pad=True).

A gather, without atomics: every element of dx is written once by one thread, summing in a
fixed order (windows by ascending (oh, ow), as PyTorch's backward kernels), so results are
deterministic. Three kernels (`choose` picks one):
- "2x2": the 2x2 stride-2 unpadded window with W % vec == 0 and aligned pointers: two input
  rows per item in 16-byte vectors (x read once, g once, dx written once);
- "tile" (max, overlapping windows such as 3x3 stride 2): a block computes each window
  touching its tile once into shared memory, then gathers;
- "direct": anything else, one row segment of vec elements per item (max recomputes the
  argmax of each window touching the segment).
Sums are in float32 (double for float64); half types round once on store. The per-call plan
of a shape, dtype, device and window (`m.plans[("max_pool2d_backward", g.shape, x.shape,
dtype, device, pool_size, stride, padding)]`, avg alike) allocates dx and launches. Fallback
mode computes `reference` in float64 and rounds once.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..kernels import dtype_params
from ..tensor import CudaTensor, pool_tensor
from . import common
from .pooling import fast_divisor, output_shape, pair

TEMPLATE = "pool2d_backward.cu.j2"
TEMPLATES = (TEMPLATE,)
BLOCK = 256
MAX_WINDOWS = 2048   # windows a tile may need (shared memory: 2048 * (2 + sizeof(acc)) bytes)
KINDS = ("max", "avg")
MODES = {"max": ("2x2", "tile", "direct"), "avg": ("2x2", "direct")}
PUBLIC = {"max": "max_pool2d_backward", "avg": "avg_pool2d_backward"}
DTYPES = common.FLOATS
Pair = Union[int, Tuple[int, int]]
_GRID_CAP = 2**31 - 1


def _vec(dtype: CudaDataType) -> int:
    return 16 // dtype.itemsize


def kernel_params(kind: str, dtype: CudaDataType, mode: str) -> Dict[str, Any]:
    """The template parameters of one kernel."""
    params = {**dtype_params(dtype), "kind": kind, "mode": mode, "vec": _vec(dtype),
              "block_size": BLOCK}
    if mode == "tile":
        params["max_windows"] = MAX_WINDOWS
    return params


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every mode of each kind for every float dtype."""
    return {TEMPLATE: [kernel_params(k, dt, mode) for k in KINDS for dt in DTYPES
                       for mode in MODES[k]]}


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every pooling-gradient kernel in parallel threads (nvcc runs in
    subprocesses); returns how many were compiled (0 in fallback mode)."""
    jobs = [(TEMPLATE, p) for p in template_variants()[TEMPLATE]]
    return common.compile_all(m, jobs, device_id, workers)


# -- parameters ---------------------------------------------------------------------------
def window(pool_size: Pair, stride: Optional[Pair], padding: Pair,
           op: str) -> Tuple[Tuple[int, int], Tuple[int, int], Tuple[int, int]]:
    """(k, s, p) as pairs, checked as the forward checks them."""
    k = pair(pool_size, "pool_size", 1)
    s = k if stride is None else pair(stride, "stride", 1)
    p = pair(padding, "padding", 0)
    if 2 * p[0] > k[0] or 2 * p[1] > k[1]:
        raise InvalidArgumentError(f"{op}: padding {p} must be at most half of pool_size {k}")
    return k, s, p


def _plain(v: Any) -> bool:
    """v is an int or a tuple of two ints (not bools, floats or NumPy scalars): a window
    parameter that may key a plan (an equal float or bool must reach the checks)."""
    t = type(v)
    return t is int or (t is tuple and len(v) == 2 and type(v[0]) is int
                        and type(v[1]) is int)


# -- reference (float64 NumPy) --------------------------------------------------------------
def max_choice(x: np.ndarray, k: Tuple[int, int], s: Tuple[int, int],
               p: Tuple[int, int]) -> np.ndarray:
    """For each output window, the offset i * kw + j (in the padded window) of the element
    the forward picks: the last NaN if the window holds one, else the first element equal to
    the window's max among the real (unpadded) ones; shape (N, C, OH, OW)."""
    n, c, h, w = x.shape
    _, _, oh, ow = output_shape(x.shape, k, s, p)
    a = np.asarray(x, np.float64)
    padded = np.full((n, c, h + 2 * p[0], w + 2 * p[1]), -np.inf)
    padded[:, :, p[0]:p[0] + h, p[1]:p[1] + w] = a
    real = np.zeros(padded.shape[2:], bool)
    real[p[0]:p[0] + h, p[1]:p[1] + w] = True
    best = np.full((n, c, oh, ow), -np.inf)
    choice = np.full((n, c, oh, ow), -1, np.int64)
    has_nan = np.zeros((n, c, oh, ow), bool)
    for i in range(k[0]):       # row-major window order, as the kernels scan
        for j in range(k[1]):
            rows = slice(i, i + s[0] * (oh - 1) + 1, s[0])
            cols = slice(j, j + s[1] * (ow - 1) + 1, s[1])
            v = padded[:, :, rows, cols]
            ok = real[rows, cols][None, None]
            nan = np.isnan(v) & ok
            first = ok & (choice < 0)                  # the window's first real element
            better = ok & ~has_nan & (v > best)
            take = nan | first | better
            best = np.where(take & ~nan, v, best)
            choice = np.where(take, i * k[1] + j, choice)
            has_nan |= nan
    return choice


def reference(kind: str, grad_out: Any, x: Any, pool_size: Pair, stride: Optional[Pair] = None,
              padding: Pair = (0, 0)) -> np.ndarray:
    """dx of kind ("max" or "avg") pooling in float64: grad_out of the output's shape, x the
    forward's input (avg uses its shape only)."""
    if kind not in KINDS:
        raise InvalidArgumentError(f"pool kind must be 'max' or 'avg', got {kind!r}")
    k, s, p = window(pool_size, stride, padding, PUBLIC[kind])
    x = np.asarray(x)
    g = np.asarray(grad_out, np.float64)
    shape = output_shape(x.shape, k, s, p)
    if g.shape != shape:
        raise ShapeMismatchError(f"grad_out has shape {g.shape}, expected {shape}")
    n, c, h, w = x.shape
    _, _, oh, ow = shape
    dpad = np.zeros((n, c, h + 2 * p[0], w + 2 * p[1]))
    choice = max_choice(x, k, s, p) if kind == "max" else None
    with np.errstate(invalid="ignore"):
        for i in range(k[0]):
            for j in range(k[1]):
                rows = slice(i, i + s[0] * (oh - 1) + 1, s[0])
                cols = slice(j, j + s[1] * (ow - 1) + 1, s[1])
                if choice is None:
                    dpad[:, :, rows, cols] += g
                else:
                    dpad[:, :, rows, cols] += np.where(choice == i * k[1] + j, g, 0.0)
        dx = dpad[:, :, p[0]:p[0] + h, p[1]:p[1] + w]
        if kind == "avg":
            dx = dx / (k[0] * k[1])
    return np.ascontiguousarray(dx)


# -- kernels and their launches ------------------------------------------------------------
def tile_shape(w: int, dtype: CudaDataType) -> Tuple[int, int, int]:
    """(segs_log2, TH, TW) of the tile kernel for rows of w elements: 2^segs_log2 segments of
    vec columns per tile row (up to 32, no more than the row needs), BLOCK / that rows."""
    vec = _vec(dtype)
    segs = -(-w // vec)
    log2 = min(5, (segs - 1).bit_length())
    return log2, BLOCK >> log2, vec << log2


def _tile_fits(x_shape: Tuple[int, ...], k: Tuple[int, int], s: Tuple[int, int],
               out_hw: Tuple[int, int], dtype: CudaDataType) -> bool:
    """The windows a tile may need fit MAX_WINDOWS, and the tile is at least half used
    (small images take the direct kernel)."""
    h, w = x_shape[2], x_shape[3]
    log2, th, tw = tile_shape(w, dtype)
    nh = min(out_hw[0], (th + k[0] - 2) // s[0] + 1)
    nw = min(out_hw[1], (tw + k[1] - 2) // s[1] + 1)
    used = min(h, th) * min(-(-w // _vec(dtype)), 1 << log2)
    return nh * nw <= MAX_WINDOWS and 2 * used >= BLOCK


def modes(kind: str, x_shape: Tuple[int, ...], k: Tuple[int, int], s: Tuple[int, int],
          p: Tuple[int, int], dtype: CudaDataType) -> List[str]:
    """The modes able to run this window on this shape (2x2 also needs aligned pointers:
    `two_by_two_aligned`), in order of preference."""
    out = []
    if k == (2, 2) and s == (2, 2) and p == (0, 0) and x_shape[3] % _vec(dtype) == 0:
        out.append("2x2")
    if kind == "max":
        _, _, oh, ow = output_shape(x_shape, k, s, p)
        overlapping = k[0] > s[0] or k[1] > s[1]
        if overlapping and _tile_fits(x_shape, k, s, (oh, ow), dtype):
            out.append("tile")
    out.append("direct")
    return out


def two_by_two_aligned(kind: str, dtype: CudaDataType, px: int, pg: int, pd: int) -> bool:
    """The 2x2 kernel's pointer alignment: x (max) and dx 16-byte, g vec/2 elements."""
    g_align = _vec(dtype) // 2 * dtype.itemsize
    return not (pd & 15) and not (pg % g_align) and (kind == "avg" or not (px & 15))


def choose(kind: str, x_shape: Tuple[int, ...], k: Tuple[int, int], s: Tuple[int, int],
           p: Tuple[int, int], dtype: CudaDataType, aligned_2x2: bool) -> str:
    """The mode a call takes: 2x2 where it runs, then tile (overlapping max windows whose
    tile fits), else direct."""
    for mode in modes(kind, x_shape, k, s, p, dtype):
        if mode != "2x2" or aligned_2x2:
            return mode
    return "direct"


def launch_args(mode: str, x_shape: Tuple[int, ...], k: Tuple[int, int], s: Tuple[int, int],
                p: Tuple[int, int], dtype: CudaDataType) -> Tuple[int, tuple]:
    """(grid, the kernel arguments after x, g, dx) of one mode; direct and tile take one more,
    `aligned` (W % vec == 0 and dx 16-byte aligned), which the caller appends."""
    n, c, h, w = x_shape
    _, _, oh, ow = output_shape(x_shape, k, s, p)
    vec = _vec(dtype)
    planes = n * c
    if mode == "2x2":
        hr, wv = -(-h // 2), w // vec
        total = planes * hr * wv
        return (_grid(total), (total, h, w, *fast_divisor(wv), *fast_divisor(hr), oh))
    win = (oh, ow, k[0], k[1], s[0], s[1], p[0], p[1])
    if mode == "tile":
        log2, th, tw = tile_shape(w, dtype)
        ty, tx = -(-h // th), -(-w // tw)
        tiles = planes * ty * tx
        return (max(1, min(tiles, _GRID_CAP)),
                (tiles, h, w, *fast_divisor(tx), *fast_divisor(ty), *win, log2))
    segw = -(-w // vec)
    total = planes * h * segw
    return _grid(total), (total, h, w, *fast_divisor(segw), *fast_divisor(h), *win)


def _grid(items: int) -> int:
    """One item per thread; the kernels' grid-stride loops cover what the cap leaves."""
    return max(1, min(-(-items // BLOCK), _GRID_CAP))


def _kernel(m: Any, kind: str, dtype: CudaDataType, mode: str, dev: int) -> Any:
    return m.kernel(TEMPLATE, dev, **kernel_params(kind, dtype, mode))


def launch(m: Any, kind: str, mode: str, grad_out: CudaTensor, x: CudaTensor, dx: CudaTensor,
           k: Tuple[int, int], s: Tuple[int, int], p: Tuple[int, int]) -> None:
    """Launch one mode's kernel on checked operands (dx: x's shape); raises when the mode
    cannot run this shape, window or these pointers (tests run every mode with it)."""
    dtype, dev = x.dtype, x.device_id
    if mode not in modes(kind, x.shape, k, s, p, dtype) or (
            mode == "2x2" and not two_by_two_aligned(kind, dtype, x.ptr, grad_out.ptr, dx.ptr)):
        raise InvalidArgumentError(
            f"{PUBLIC[kind]}: mode {mode!r} cannot run input {x.shape} with window {k}, "
            f"stride {s}, padding {p} ({dtype.name_str}); it can run: "
            f"{', '.join(modes(kind, x.shape, k, s, p, dtype))}")
    kernel = _kernel(m, kind, dtype, mode, dev)
    grid, args = launch_args(mode, x.shape, k, s, p, dtype)
    if mode != "2x2":
        args = (*args, int(x.shape[3] % _vec(dtype) == 0 and not dx.ptr & 15))
    m.backend.launch_kernel(kernel.name, grid, x, grad_out, dx, *args,
                            block_size=(BLOCK, 1, 1), device_id=dev)


# -- the op -------------------------------------------------------------------------------
def pool2d_backward(m: Any, kind: str, grad_out: CudaTensor, x: CudaTensor, pool_size: Pair,
                    stride: Optional[Pair] = None, padding: Pair = (0, 0)) -> CudaTensor:
    """dx of kind ("max" or "avg") pooling: grad_out of the forward's output shape, x the
    forward's input (NCHW; avg reads only its shape, dtype and device)."""
    if type(grad_out) is CudaTensor and type(x) is CudaTensor and _plain(pool_size) and \
            (stride is None or _plain(stride)) and _plain(padding):
        # the per-call plan (ops/common.py remember_plan): int or (int, int) window
        # parameters only (an equal-valued float or bool, 2.0 or True, must reach the checks)
        key = (PUBLIC.get(kind), grad_out.shape, x.shape, grad_out.dtype, grad_out.device_id,
               pool_size, stride, padding)
        direct = m.backend.direct_launch(grad_out.device_id)
        res = common.planned(m, key, grad_out, x) if direct else None
        if res is not None:
            return res
    if kind not in KINDS:
        raise InvalidArgumentError(f"pool kind must be 'max' or 'avg', got {kind!r}")
    op = PUBLIC[kind]
    g = common.check_tensor(grad_out, "grad_out")
    common.check_tensor(x, "input")
    if x.ndim != 4:
        raise InvalidArgumentError(f"{op} needs the forward's 4-D NCHW input, got shape "
                                   f"{x.shape}")
    common.require_dtype(g, DTYPES, op)
    dtype = common.same_dtype(g, x)
    dev = common.same_device(g, x)
    if x.shape[2] == 0 or x.shape[3] == 0:
        raise InvalidArgumentError(
            f"{op} needs non-empty spatial dimensions, got input shape {x.shape}")
    k, s, p = window(pool_size, stride, padding, op)
    shape = output_shape(x.shape, k, s, p)
    if g.shape != shape:
        raise ShapeMismatchError(
            f"{op}: grad_out has shape {g.shape}, expected {shape}: the output shape of "
            f"{kind}_pool2d on input {x.shape} with pool_size {k}, stride {s}, padding {p}")
    if not m.gpu:
        hx = common.host_array(m, x) if kind == "max" else np.empty(x.shape, np.float32)
        values = reference(kind, common.host_array(m, g), hx, k, s, p)
        return common.from_host(m, values, dtype, dev)
    dx = m.backend.empty(x.shape, dtype, dev)
    if dx.size == 0:
        return dx
    two = two_by_two_aligned(kind, dtype, x.ptr, g.ptr, dx.ptr)
    mode = choose(kind, x.shape, k, s, p, dtype, two)
    launch(m, kind, mode, g, x, dx, k, s, p)
    if _plain(pool_size) and (stride is None or _plain(stride)) and _plain(padding):
        key = (op, g.shape, x.shape, dtype, dev, pool_size, stride, padding)
        plan = m.plans.get(key)
        if not hasattr(plan, "variants"):
            plan = common.remember_plan(m, key, _fast_plan(m, kind, x, k, s, p))
        if mode not in plan.variants:
            kernel = _kernel(m, kind, dtype, mode, dev)
            grid, args = launch_args(mode, x.shape, k, s, p, dtype)
            plan.variants[mode] = (m.backend.prepare_launch(kernel, grid, (BLOCK, 1, 1), 0,
                                                            dev), args)
    return dx


def _fast_plan(m: Any, kind: str, x: CudaTensor, k: Tuple[int, int], s: Tuple[int, int],
               p: Tuple[int, int]) -> Any:
    """The per-call plan for operands shaped like the first call's (ops/common.py
    remember_plan): x checked against the key's dtype and device, dx allocated, the mode
    chosen as pool2d_backward chooses it (from the pointers' alignment for 2x2), and the
    launch the general path prepared for that mode (`variants`); a mode not seen yet returns
    None (the general path launches it and adds it)."""
    dev, dtype, shape = x.device_id, x.dtype, x.shape
    size, nbytes = x.size, x.nbytes
    vec = _vec(dtype)
    row_vectors = shape[3] % vec == 0
    mode_list = modes(kind, shape, k, s, p, dtype)
    can_2x2 = "2x2" in mode_list
    other = choose(kind, shape, k, s, p, dtype, False)
    g_align = vec // 2 * dtype.itemsize
    max_kind = kind == "max"
    pool = m.backend.memory_pools[dev]
    alloc = pool.allocate_current
    variants: Dict[str, Any] = {}

    def run(g: CudaTensor, x: CudaTensor) -> Optional[CudaTensor]:
        # g's shape, dtype and device and x's shape are the plan's key
        pg, px = g._ptr, x._ptr
        if pg is None or px is None or g.stream is not None or x.stream is not None or \
                x.dtype is not dtype or x.device_id != dev:
            return None
        dx = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        pd = dx._ptr
        two = can_2x2 and not (pd & 15) and not (pg % g_align) and \
            not (max_kind and px & 15)
        v = variants.get("2x2" if two else other)
        if v is None:
            dx.free()
            return None
        if two:
            v[0](px, pg, pd, *v[1])
        else:
            v[0](px, pg, pd, *v[1], int(row_vectors and not pd & 15))
        return dx
    run.variants = variants  # type: ignore[attr-defined]
    return run
