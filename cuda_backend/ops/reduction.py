"""Reductions: sum, mean, max, min over any axes, and argmax.

Result dtypes follow NumPy where the backend can represent them: float inputs keep their
dtype (float16/bfloat16/float32 accumulate in float32, float64 in double); int32 and int64
sums return int64 (NumPy's int32 sum is int64); int means return float64; int max/min keep
the input dtype; argmax returns int64. max/min/argmax propagate NaN like NumPy (argmax
returns the first NaN). Empty reductions: sum gives 0, mean gives NaN (without NumPy's
warning), max/min/argmax raise InvalidArgumentError.

Kernels (all deterministic: a fixed summation order for a given shape and device):
- `reduce.cu.j2`, contiguous rows ([rows][R], the reduced axes innermost; a full reduction
  is one row): a group of 1-32 lanes per short row, or one block per row with 16-byte loads,
  several loads in flight per thread and, when there are few rows, several blocks per row
  whose partials the last block to finish folds (atomic ticket), all in one launch.
- `reduce_axis.cu.j2`, a middle axis ([outer][R][inner]): threads map to inner columns for
  coalesced (16-byte where aligned) loads and walk R; few columns split R over blocks the
  same way.
Reductions over several non-adjacent axes run as successive single-axis passes, innermost
reduced axis first; the intermediates have the pass's result dtype (float16/bfloat16
intermediates are rounded to the input dtype).
"""
from __future__ import annotations

import math
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import occupancy
from ..dtypes import CudaDataType, to_bfloat16_bits
from ..errors import InvalidArgumentError, ShapeMismatchError, DTypeMismatchError
from ..kernels import accumulator_type
from ..streams import current_pycuda_stream
from ..tensor import CudaTensor, pool_tensor
from . import common

OPS = ("sum", "mean", "max", "min")
SUPPORTED = common.FLOATS + (CudaDataType.INT32, CudaDataType.INT64)
BLOCK = 256            # threads per block of both kernels
UNROLL = 4             # 16-byte loads in flight per thread
MAX_SPLIT_GROUPS = 4096  # ticket counters kept per device (rows or tile groups of a split launch)
# Split launches use at most this many blocks per SM (fewer if fewer fit): a 2^28 float32 sum
# on an H200 took 0.2604 / 0.2512 / 0.2543 / 0.2542 ms with 2 / 3 / 4 / 5 blocks per SM.
SPLIT_BLOCKS_PER_SM = 3
ROWS_TEMPLATE = "reduce.cu.j2"
AXIS_TEMPLATE = "reduce_axis.cu.j2"
TEMPLATES = (ROWS_TEMPLATE, AXIS_TEMPLATE)

_INT_ACC = {CudaDataType.INT32: "int", CudaDataType.INT64: "long long"}
_NUMPY_OPS: Dict[str, Callable[..., Any]] = {"sum": np.sum, "mean": np.mean, "max": np.max,
                                             "min": np.min}


# -- dtypes and template parameters --------------------------------------------------------
def kernel_config(dtype: CudaDataType, op: str) -> Tuple[str, str, CudaDataType]:
    """(kernel op, accumulator C type, result dtype) of `op` ("sum", "mean", "max", "min",
    "argmax") on `dtype`."""
    if op == "argmax":
        acc = _INT_ACC.get(dtype) or accumulator_type(dtype)
        return "argmax", acc, CudaDataType.INT64
    if dtype.is_floating:
        return ("sum" if op == "mean" else op), accumulator_type(dtype), dtype
    if op == "sum":
        return "sum", "long long", CudaDataType.INT64
    if op == "mean":
        return "sum", "double", CudaDataType.FLOAT64
    return op, _INT_ACC[dtype], dtype


def kernel_params(dtype: CudaDataType, op: str) -> Dict[str, Any]:
    """Template parameters (both templates take the same) for `op` on `dtype`."""
    kop, acc, out_dtype = kernel_config(dtype, op)
    # Register budgets that compile without spills (ptxas's own choice spilled the int32
    # mean): 5 blocks of 256 per SM (<= 48 registers), argmax's (value, index) pairs 3.
    return {"dtype": dtype.name_str, "ctype": dtype.c_type, "acc": acc,
            "out_ctype": out_dtype.c_type, "op": kop, "block_size": BLOCK,
            "min_blocks": 3 if kop == "argmax" else 5, "unroll": UNROLL}


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set this module renders: each supported dtype x kernel op, per template."""
    sets: List[Dict[str, Any]] = []
    for dt in SUPPORTED:
        for op in ("sum", "mean", "max", "min", "argmax"):
            params = kernel_params(dt, op)
            if params not in sets:
                sets.append(params)
    return {ROWS_TEMPLATE: [dict(p) for p in sets], AXIS_TEMPLATE: [dict(p) for p in sets]}


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every reduction variant in parallel threads (nvcc runs in subprocesses);
    returns how many were compiled (0 in fallback mode). Later calls find them memoized."""
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets]
    return common.compile_all(m, jobs, device_id, workers)


def reference(op: str, x: Any, axis: Any = None, keepdims: bool = False) -> np.ndarray:
    """op ("sum", "mean", "max", "min" or "argmax") over axis in float64 NumPy (argmax: the
    int64 index of the first maximum, one axis or the flattened array)."""
    a = np.asarray(x, dtype=np.float64)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        if op == "argmax":
            return np.asarray(np.argmax(a, axis=axis, keepdims=bool(keepdims)), np.int64)
        fn = _NUMPY_OPS[op]
        return np.asarray(fn(a, axis=axis, keepdims=bool(keepdims)), dtype=np.float64)


def result_dtype(dtype: CudaDataType, op: str) -> CudaDataType:
    return kernel_config(dtype, op)[2]


# -- shapes --------------------------------------------------------------------------------
def reduced_shape(shape: Sequence[int], axes: Sequence[int], keepdims: bool) -> Tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else s for i, s in enumerate(shape))
    return tuple(s for i, s in enumerate(shape) if i not in axes)


def collapse(shape: Sequence[int], axes: Sequence[int]) -> List[List[Any]]:
    """[[size, reduced], ...]: the shape with size-1 dims dropped and neighbours of the same
    kind merged, so the reduced axes form as few contiguous runs as the layout allows."""
    segs: List[List[Any]] = []
    for i, s in enumerate(shape):
        if s == 1:
            continue
        red = i in axes
        if segs and segs[-1][1] == red:
            segs[-1][0] *= s
        else:
            segs.append([s, red])
    return segs


def plan_passes(shape: Sequence[int], axes: Sequence[int]) -> List[Tuple[int, int, int]]:
    """[(outer, R, inner), ...]: single-axis passes, innermost reduced run first. A
    reduction of nothing (no axes, or only size-1 axes) is one pass with R == 1."""
    segs = collapse(shape, axes)
    passes = []
    while True:
        red = [i for i, (_, r) in enumerate(segs) if r]
        if not red:
            break
        k = red[-1]
        outer = math.prod(s for s, _ in segs[:k])
        inner = math.prod(s for s, _ in segs[k + 1:])
        passes.append((outer, segs[k][0], inner))
        rest = segs[:k] + segs[k + 1:]
        segs = []
        for s, r in rest:
            if segs and segs[-1][1] == r:
                segs[-1][0] *= s
            else:
                segs.append([s, r])
    if not passes:
        passes.append((math.prod(shape), 1, 1))
    return passes


# -- launch sizing -------------------------------------------------------------------------
def _pow2ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# Blocks of `threads` threads one SM holds at once (the name tests and tools use)
resident_blocks = occupancy.blocks_per_sm


def rows_config(rows: int, R: int, itemsize: int, wave: int) -> Tuple[int, int, int]:
    """(group, splits, grid) for reduce.cu.j2: `wave` is how many blocks a split launch may
    use (all at once on the GPU). Short rows get 1-32 lanes each; long rows a block, split
    over several blocks when there are too few rows to fill the GPU."""
    vec = 16 // itemsize
    if R <= 32 * vec * 8:
        # about UNROLL vectors per lane: that many 16-byte loads in flight per thread
        group = min(32, _pow2ceil(-(-R // (vec * UNROLL))))
        return group, 1, -(-rows // (BLOCK // group))
    splits = 1
    if rows <= min(wave // 2, MAX_SPLIT_GROUPS):
        # at most one wave of blocks: a second, partial wave would idle most SMs
        nvec = R // vec
        splits = max(1, min(wave // rows, nvec // (BLOCK * UNROLL)))
    return BLOCK, splits, rows * splits


def axis_config(outer: int, R: int, inner: int, itemsize: int, aligned: bool,
                wave: int) -> Dict[str, int]:
    """Launch sizing for reduce_axis.cu.j2: block (bx, by), tiles, splits, rows per split,
    vec_on; threads in x take 16-byte column vectors when inner allows."""
    vec = 16 // itemsize
    vec_on = int(aligned and inner % vec == 0)
    w = vec if vec_on else 1
    ncols = -(-inner // w)
    bx = min(32, _pow2ceil(ncols))
    by = max(1, min(BLOCK // bx, _pow2ceil(R)))
    tiles = -(-ncols // bx)
    groups = outer * tiles
    splits = 1
    if groups <= min(wave // 2, MAX_SPLIT_GROUPS):
        splits = max(1, min(wave // groups, R // (by * 8), 65535))
    rows_per_split = max(1, -(-R // splits))
    splits = max(1, -(-R // rows_per_split))
    return {"bx": bx, "by": by, "tiles": tiles, "groups": groups, "splits": splits,
            "rows_per_split": rows_per_split, "vec_on": vec_on, "width": bx * w}


# -- per-stream ticket counters --------------------------------------------------------------
_counters: "weakref.WeakKeyDictionary[Any, Dict[tuple, CudaTensor]]" = weakref.WeakKeyDictionary()
_counters_lock = threading.Lock()
MAX_COUNTER_STREAMS = 64   # counter blocks kept per backend; the oldest goes beyond that


def _ticket_counters(m: Any, dev: int, stream: Any) -> CudaTensor:
    """MAX_SPLIT_GROUPS zeroed uint32 counters for split launches on one device and stream,
    made once and kept: every split launch leaves the counters it used at 0 again, so
    launches in one stream's order never need them cleared. Two streams get two sets (one set
    shared by concurrent launches gave wrong sums: tests/test_stream_order.py). The key holds
    the PyCUDA stream itself, so its handle cannot be reused while its counters exist."""
    key = (dev, stream)
    with _counters_lock:
        per = _counters.get(m.backend)
        if per is None:
            per = _counters[m.backend] = {}
        t = per.get(key)
        if t is None or t.is_freed:
            if len(per) >= MAX_COUNTER_STREAMS:
                per.pop(next(iter(per))).free()   # stream-ordered: see memory.py
            t = m.backend.empty((MAX_SPLIT_GROUPS,), CudaDataType.INT32, dev)
            m.backend.memset_async(t, 0, stream)    # an async memset: capturable
            per[key] = t
        return t


# -- public API ----------------------------------------------------------------------------
def reduce(m: Any, op: str, x: CudaTensor, axis: Any = None, keepdims: bool = False,
           out: Optional[CudaTensor] = None) -> CudaTensor:
    """op ("sum", "mean", "max", "min") over `axis` (None: all, an int or a tuple), like
    NumPy's; `out` (optional) must have the result's shape, dtype and device."""
    if out is None and type(x) is CudaTensor:
        key = _plan_key(_NAMES.get(op) if type(op) is str else None, x, axis, keepdims)
        if key is not None:
            fast = m.plans.get(key)
            if fast is not None and m.backend.direct_launch(x.device_id):
                res = fast(x)
                if res is not None:
                    return res
    else:
        key = None
    if op not in OPS:
        raise InvalidArgumentError(f"unknown reduction '{op}'; expected one of {', '.join(OPS)}")
    x = common.check_tensor(x, "tensor")
    common.require_dtype(x, SUPPORTED, f"reduce_{op}")
    if not (axis is None or isinstance(axis, (int, np.integer, tuple, list))):
        # (normalize_axes would try to iterate it and raise a plain TypeError)
        raise InvalidArgumentError(f"axis must be an int, a tuple of ints or None, got {axis!r}")
    axes = common.normalize_axes(axis, x.ndim)
    count = math.prod(x.shape[a] for a in axes)
    if count == 0 and op in ("max", "min"):
        raise InvalidArgumentError(
            f"zero-size reduction: reduce_{op} over axes {axes} of a tensor of shape {x.shape} "
            f"has no identity")
    dtype = result_dtype(x.dtype, op)
    shape = reduced_shape(x.shape, axes, bool(keepdims))
    _check_out(out, shape, dtype, x, f"reduce_{op}")
    if not m.gpu or count == 0 or x.size == 0:
        values = _host_reduce(m, op, x, axes, bool(keepdims)) if x.size else \
            np.full(shape, 0 if op == "sum" else np.nan, dtype=_host_dtype(dtype))
        return host_result(m, values, dtype, x.device_id, out)
    return _gpu_reduce(m, op, x, axes, shape, dtype, count, out, key)


def argmax(m: Any, x: CudaTensor, axis: Optional[int] = None, keepdims: bool = False,
           out: Optional[CudaTensor] = None) -> CudaTensor:
    """Index (int64) of the first maximum over the flattened tensor (axis None) or one axis;
    NaN counts as the maximum, like NumPy."""
    key = None
    if out is None and type(x) is CudaTensor:
        key = _plan_key("argmax", x, axis, keepdims)
        if key is not None:
            fast = m.plans.get(key)
            if fast is not None and m.backend.direct_launch(x.device_id):
                res = fast(x)
                if res is not None:
                    return res
    x = common.check_tensor(x, "tensor")
    common.require_dtype(x, SUPPORTED, "argmax")
    if (axis is not None and not isinstance(axis, (int, np.integer))) or isinstance(axis, bool):
        raise InvalidArgumentError(f"argmax takes one axis (an int) or None, got {axis!r}")
    axes = common.normalize_axes(axis, x.ndim)
    count = math.prod(x.shape[a] for a in axes)
    if count == 0:
        raise InvalidArgumentError(
            f"zero-size reduction: argmax over axes {axes} of a tensor of shape {x.shape} "
            f"has no identity (attempt to get argmax of an empty sequence)")
    if axis is None:
        shape = (1,) * x.ndim if keepdims else ()
    else:
        shape = reduced_shape(x.shape, axes, bool(keepdims))
    _check_out(out, shape, CudaDataType.INT64, x, "argmax")
    if not m.gpu or x.size == 0:
        if x.size:
            a = common.host_array(m, x)
            values = np.argmax(a, axis=None if axis is None else int(axis),
                               keepdims=bool(keepdims))
        else:
            values = np.zeros(shape, np.int64)
        return host_result(m, np.asarray(values).reshape(shape), CudaDataType.INT64,
                            x.device_id, out)
    return _gpu_reduce(m, "argmax", x, axes, shape, CudaDataType.INT64, count, out, key)


# -- per-call plans (ops/common.py remember_plan) -------------------------------------------
_NAMES = {op: "reduce_" + op for op in OPS}   # op -> the public name that starts a plan key


def _plan_key(name: Optional[str], x: CudaTensor, axis: Any, keepdims: Any) -> Optional[tuple]:
    """The key of the per-call plan of `name` ("reduce_sum", ..., "argmax") on x, or None
    where the call takes the general path: axis must be None, an int or a tuple of ints and
    keepdims a bool (other values that compare and hash equal to these, 1.0 or True for 1,
    must meet the general path's checks). With the shape in the key, equal keys mean equal
    normalized axes (axis=-1 and axis=1 just keep two plans)."""
    if name is None or type(keepdims) is not bool:
        return None
    if axis is not None and type(axis) is not int:
        if type(axis) is not tuple:
            return None
        for a in axis:
            if type(a) is not int:
                return None
    return (name, x.shape, x.dtype, axis, keepdims, x.device_id)


# -- GPU path ------------------------------------------------------------------------------
def _gpu_reduce(m: Any, op: str, x: CudaTensor, axes: Tuple[int, ...], shape: Tuple[int, ...],
                dtype: CudaDataType, count: int, out: Optional[CudaTensor],
                key: Optional[tuple] = None) -> CudaTensor:
    """The passes over x; with `key` (a new result, see _plan_key), the per-call plan of
    the same launches is kept in m.plans afterwards."""
    dev = x.device_id
    passes = plan_passes(x.shape, axes)
    if out is None:
        out = m.backend.empty(shape, dtype, dev)
    else:
        key = None
    steps = []
    cur = x
    for n, (outer, R, inner) in enumerate(passes):
        last = n == len(passes) - 1
        # Earlier passes of a mean are sums; only the last one divides by the full count.
        pop = op if last or op != "mean" else "sum"
        pdtype = result_dtype(cur.dtype, pop)
        target = out if last else m.backend.empty((outer * inner,), pdtype, dev)
        divisor = float(count) if (last and op == "mean") else 1.0
        steps.append((pop, cur.dtype, outer, R, inner, divisor,
                      0 if last else target.nbytes))
        try:
            _launch_pass(m, dev, pop, cur, target, outer, R, inner, divisor)
        except BaseException:
            if not last:
                target.free()
            raise
        finally:
            if cur is not x:
                cur.free()
        cur = target
    if key is not None:
        common.remember_plan(m, key, _fast_plan(m, dev, shape, dtype, steps))
    return out


def _fast_plan(m: Any, dev: int, shape: Tuple[int, ...], dtype: CudaDataType,
               steps: List[tuple]) -> Any:
    """The per-call plan of one reduction (ops/common.py remember_plan): the result's
    allocation, then per pass (op, input dtype, outer, R, inner, divisor, intermediate
    bytes or 0 for the last) what _gpu_reduce and _launch_pass do: the intermediate's and
    the partials' allocations, one PreparedLaunch, the frees in the same order. A pass over
    a middle axis sizes by its input's 16-byte alignment: both variants are prepared on
    first use."""
    backend = m.backend
    pool = backend.memory_pools[dev]
    alloc, release = pool.allocate_current, pool.release
    size = math.prod(shape)
    nbytes = size * dtype.itemsize
    counters: List[Any] = [None]

    def variant(pop: str, pdtype: CudaDataType, outer: int, R: int, inner: int,
                aligned: bool) -> tuple:
        p = _pass_for(m, dev, pop, pdtype, outer, R, inner, aligned)
        go = backend.prepare_launch(backend.get_kernel(p.name, dev), p.grid, p.block, 0, dev)
        return go, max(p.part_bytes, 16) if p.part_bytes else 0, p.args

    plan_steps = []
    for pop, pdtype, outer, R, inner, divisor, tmp_bytes in steps:
        if inner == 1:   # rows: the sizing does not depend on alignment
            v = variant(pop, pdtype, outer, R, inner, True)
            variants = {True: v, False: v}
        else:
            variants = {}
        plan_steps.append((variants, (pop, pdtype, outer, R, inner), divisor, tmp_bytes))

    def ticket_counters() -> int:
        t = counters[0]
        if t is None or t._ptr is None:   # evicted (freed) ones are made again
            t = counters[0] = _ticket_counters(m, dev, None)
        return t._ptr

    def run(x: CudaTensor) -> Optional[CudaTensor]:
        px = x._ptr
        if px is None or x.stream is not None:   # (the launcher would record_stream it)
            return None
        res = pool_tensor(shape, dtype, dev, alloc(nbytes, None), pool, size, nbytes)
        cur, cur_block = px, None
        for variants, spec, divisor, tmp_bytes in plan_steps:
            aligned = cur % 16 == 0
            v = variants.get(aligned)
            if v is None:
                v = variants[aligned] = variant(*spec, aligned)
            go, part_bytes, args = v
            try:
                if tmp_bytes:
                    target_block = alloc(tmp_bytes, None)
                    target = int(target_block)
                else:
                    target_block, target = None, res._ptr
                try:
                    if part_bytes:
                        part = alloc(part_bytes, None)
                        try:
                            go(cur, target, int(part), ticket_counters(), *args, divisor)
                        finally:
                            release(part)   # stream-ordered (memory.py)
                    else:
                        go(cur, target, 0, 0, *args, divisor)
                except BaseException:
                    if target_block is not None:
                        release(target_block)
                    raise
            finally:
                if cur_block is not None:
                    release(cur_block)
            cur, cur_block = target, target_block
        return res
    return run


class _Pass:
    """A planned launch: kernel, grid, block, the integer arguments and the partials size."""

    __slots__ = ("name", "grid", "block", "args", "part_bytes")

    def __init__(self, name: str, grid: Tuple[int, int, int], block: Tuple[int, int, int],
                 args: Tuple[int, ...], part_bytes: int) -> None:
        self.name, self.grid, self.block, self.args, self.part_bytes = \
            name, grid, block, args, part_bytes


def _pass_for(m: Any, dev: int, op: str, dtype: CudaDataType, outer: int, R: int, inner: int,
              aligned: bool) -> _Pass:
    """The sizing of one pass, kept in the CudaMath's plan cache (m.plans, under
    "reduce_pass": ops/common.py) per device, dtype, op, shape and input alignment."""
    key = ("reduce_pass", dev, dtype, op, outer, R, inner, aligned)
    p = m.plans.get(key)
    if p is None:
        p = common.remember_plan(m, key, _plan_pass(m, dev, op, dtype, outer, R, inner,
                                                     aligned))
    return p


def _launch_pass(m: Any, dev: int, op: str, x: CudaTensor, out: CudaTensor, outer: int, R: int,
                 inner: int, divisor: float) -> None:
    """One single-axis pass: out[outer][inner] = op over R of x[outer][R][inner]. The
    sizing is planned once per shape (_pass_for)."""
    p = _pass_for(m, dev, op, x.dtype, outer, R, inner, x.ptr % 16 == 0)
    part = _partials(m, dev, p.part_bytes) if p.part_bytes else None
    try:
        m.backend.launch_kernel(
            p.name, p.grid, x, out, 0 if part is None else part,
            0 if part is None else _ticket_counters(m, dev, current_pycuda_stream(dev)),
            *p.args, divisor, block_size=p.block, device_id=dev)
    finally:
        if part is not None:
            part.free()  # stream-ordered (memory.py): reused only after this kernel


def _plan_pass(m: Any, dev: int, op: str, dtype: CudaDataType, outer: int, R: int, inner: int,
               aligned: bool) -> _Pass:
    params = kernel_params(dtype, op)
    acc_bytes = 16 if op == "argmax" else (8 if params["acc"] in ("double", "long long") else 4)
    info = m.backend.get_device_info(dev)
    itemsize = dtype.itemsize
    if inner == 1:
        kernel = m.kernel(ROWS_TEMPLATE, dev, **params)
        wave = info.multiprocessor_count * min(SPLIT_BLOCKS_PER_SM,
                                               occupancy.blocks_per_sm(kernel, info, BLOCK))
        group, splits, grid = rows_config(outer, R, itemsize, wave)
        return _Pass(kernel.name, (grid, 1, 1), (BLOCK, 1, 1), (outer, R, group, splits),
                     outer * splits * acc_bytes if splits > 1 else 0)
    kernel = m.kernel(AXIS_TEMPLATE, dev, **params)
    cfg = axis_config(outer, R, inner, itemsize, aligned, 0)
    wave = info.multiprocessor_count * min(SPLIT_BLOCKS_PER_SM,
                                           occupancy.blocks_per_sm(kernel, info,
                                                                   cfg["bx"] * cfg["by"]))
    cfg = axis_config(outer, R, inner, itemsize, aligned, wave)
    splits = cfg["splits"]
    return _Pass(kernel.name, (cfg["groups"], splits, 1), (cfg["bx"], cfg["by"], 1),
                 (outer, R, inner, cfg["tiles"], splits, cfg["rows_per_split"], cfg["vec_on"]),
                 cfg["groups"] * splits * cfg["width"] * acc_bytes if splits > 1 else 0)


def _partials(m: Any, dev: int, nbytes: int) -> CudaTensor:
    return m.backend.empty((max(nbytes, 16),), CudaDataType.UINT8, dev)


# -- checks and host side ------------------------------------------------------------------
def _check_out(out: Optional[CudaTensor], shape: Tuple[int, ...], dtype: CudaDataType,
               x: CudaTensor, what: str) -> None:
    if out is None:
        return
    common.check_tensor(out, "out")
    common.same_device(x, out)
    if out.dtype is not dtype:
        raise DTypeMismatchError(
            f"{what}: out has dtype {out.dtype.name_str}, but the result of {x.dtype.name_str} "
            f"input is {dtype.name_str}")
    if out.shape != shape:
        raise ShapeMismatchError(f"{what}: out has shape {out.shape}, the result has shape {shape}")


def _host_dtype(dtype: CudaDataType) -> np.dtype:
    return np.dtype(np.float32) if dtype is CudaDataType.BFLOAT16 else dtype.numpy_dtype


def _host_reduce(m: Any, op: str, x: CudaTensor, axes: Tuple[int, ...],
                 keepdims: bool) -> np.ndarray:
    """Fallback: the same reduction in NumPy (halves accumulate in float32, like the kernels)."""
    a = common.host_array(m, x)
    if x.dtype is CudaDataType.FLOAT16:
        a = a.astype(np.float32)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        fn = _NUMPY_OPS[op]
        r = fn(a, axis=axes, keepdims=keepdims)
    return np.asarray(r).astype(_host_dtype(result_dtype(x.dtype, op)))


def host_result(m: Any, values: np.ndarray, dtype: CudaDataType, dev: int,
                 out: Optional[CudaTensor]) -> CudaTensor:
    """values (host) as a new tensor, or written into out."""
    values = np.asarray(values)
    if out is None:
        return common.from_host(m, values, dtype, dev)
    if out.size:
        if dtype is CudaDataType.BFLOAT16:
            host = to_bfloat16_bits(values.astype(np.float32)).reshape(out.shape)
        else:
            host = np.ascontiguousarray(values, dtype=dtype.numpy_dtype).reshape(out.shape)
        m.backend.copy_to_device(host, out)
    return out
