"""Helpers every op module uses: operand checks, precision names, broadcasting, launch sizing,
host fallback; and how CudaMath's and CudaML's methods reach their ops (LazyOp, named_method)."""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple, TypeVar

import numpy as np

from ..dtypes import CudaDataType, from_bfloat16_bits, to_bfloat16_bits
from ..errors import (DeviceMismatchError, DTypeMismatchError, InvalidArgumentError,
                      ShapeMismatchError)
from ..tensor import CudaTensor, pool_tensor

FLOATS = (CudaDataType.FLOAT32, CudaDataType.FLOAT64, CudaDataType.FLOAT16,
          CudaDataType.BFLOAT16)


def check_tensor(t: Any, what: str = "operand") -> CudaTensor:
    """t must be a live CudaTensor."""
    if not isinstance(t, CudaTensor):
        raise InvalidArgumentError(
            f"{what} must be a CudaTensor, got {type(t).__name__} (use from_numpy first)")
    t.check_alive()
    return t


def same_device(*tensors: CudaTensor) -> int:
    """The common device of the operands; raises naming both devices otherwise."""
    dev = tensors[0].device_id
    for t in tensors[1:]:
        if t.device_id != dev:
            raise DeviceMismatchError(
                f"operands are on different devices: cuda:{dev} and cuda:{t.device_id}; "
                f"move one with tensor.to(device_id) first")
    return dev


def same_dtype(*tensors: CudaTensor) -> CudaDataType:
    """Tensors of one op must share a dtype (no implicit promotion between tensors)."""
    dt = tensors[0].dtype
    for t in tensors[1:]:
        if t.dtype is not dt:
            raise DTypeMismatchError(
                f"mixed dtypes {dt.name_str} and {t.dtype.name_str}: tensors of one operation "
                f"must share a dtype (only Python scalars are converted to the tensor's dtype)")
    return dt


def check_out(out: Any, x: CudaTensor, shape: Tuple[int, ...]) -> None:
    """An op's out= must be a live CudaTensor of the result's shape and x's dtype, on x's
    device."""
    check_tensor(out, "out")
    if out.shape != shape or out.dtype is not x.dtype:
        raise ShapeMismatchError(
            f"out has shape {out.shape} ({out.dtype.name_str}), expected {shape} "
            f"({x.dtype.name_str})")
    same_device(x, out)


def check_dtype_device(t: CudaTensor, label: str, dtype: CudaDataType, expected: str,
                       dev: int, others: str) -> None:
    """DTypeMismatchError "<label> has dtype D, expected <expected>" unless t is of dtype,
    DeviceMismatchError "<label> is on cuda:T, <others> on cuda:<dev>" unless it is on dev."""
    if t.dtype is not dtype:
        raise DTypeMismatchError(f"{label} has dtype {t.dtype.name_str}, expected {expected}")
    if t.device_id != dev:
        raise DeviceMismatchError(f"{label} is on cuda:{t.device_id}, {others} on cuda:{dev}")


def result_tensor(m: Any, out: Optional[CudaTensor], shape: Tuple[int, ...],
                  dtype: CudaDataType, dev: int) -> Tuple[CudaTensor, bool]:
    """(out, False) when the caller gave one (checked already), else (a new tensor, True)."""
    if out is not None:
        return out, False
    return m.backend.empty(shape, dtype, dev), True


def grad_operands(grad_out: Any, v: Any, vname: str,
                  name: str) -> Tuple[CudaTensor, CudaTensor, CudaDataType, int]:
    """An element-wise backward op's (grad_out, v, dtype, device) after the checks: live
    tensors (v named vname in errors) of one floating dtype, device and shape."""
    g = check_tensor(grad_out, "grad_out")
    x = check_tensor(v, vname)
    require_dtype(g, FLOATS, name)
    dtype = same_dtype(g, x)
    dev = same_device(g, x)
    if g.shape != x.shape:
        raise ShapeMismatchError(
            f"{name}: grad_out has shape {g.shape} and {vname} has shape {x.shape}; they must "
            f"have the same shape")
    return g, x, dtype, dev


def require_dtype(t: CudaTensor, allowed: Iterable[CudaDataType], op: str) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        names = ", ".join(d.name_str for d in allowed)
        raise DTypeMismatchError(f"{op} does not support {t.dtype.name_str}; supported: {names}")


def broadcast_shapes(a: Sequence[int], b: Sequence[int]) -> Tuple[int, ...]:
    """NumPy's broadcasting rule, with an error naming both shapes."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x != y and x != 1 and y != 1:
            raise ShapeMismatchError(
                f"shapes {tuple(a)} and {tuple(b)} cannot be broadcast together "
                f"(dimension -{i}: {x} vs {y})")
        out.append(max(x, y) if x != 0 and y != 0 else 0)
    return tuple(reversed(out))


def normalize_axes(axis: Any, ndim: int) -> Tuple[int, ...]:
    """axis (None, int or tuple) -> sorted tuple of non-negative axes; errors name the range."""
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, (int, np.integer)):
        axes = (axis,)
    else:
        try:
            axes = tuple(axis)
        except TypeError:
            raise InvalidArgumentError(
                f"axis must be an int, a tuple of ints or None, got {axis!r}") from None
    out = []
    for ax in axes:
        if isinstance(ax, bool) or not isinstance(ax, (int, np.integer)):
            raise InvalidArgumentError(f"axis must be an int, a tuple of ints or None, got {axis!r}")
        if not -ndim <= ax < ndim:
            raise InvalidArgumentError(
                f"axis {ax} is out of range for a tensor of {ndim} dimensions "
                f"(valid: {-ndim}..{ndim - 1})" if ndim else
                f"axis {ax} is out of range for a 0-d tensor")
        out.append(int(ax) % ndim)
    if len(set(out)) != len(out):
        raise InvalidArgumentError(f"repeated axis in {axis!r}")
    return tuple(sorted(out))


# None / "fp32": float32-level accuracy (float32: SIMT or 3xTF32, the autotuner's pick); "ieee":
# CUDA cores only; "tf32": TF32 tensor cores (float32 only). The GEMMs, the linear layers and
# conv2d with its gradients take these names.
PRECISIONS = {None: None, "fp32": "fp32", "highest": "fp32", "ieee": "ieee", "tf32": "tf32"}
PRECISION_NAMES = "None, 'fp32' (alias 'highest'), 'ieee' or 'tf32'"


def normalize_precision(precision: Any, dtype: CudaDataType) -> Optional[str]:
    """None / 'fp32' / 'highest' -> float32-level accuracy (float32: SIMT or 3xTF32);
    'ieee' -> CUDA cores only for float32; 'tf32' -> TF32 (float32 only)."""
    key = precision.lower() if isinstance(precision, str) else precision
    if not (key is None or isinstance(key, str)) or key not in PRECISIONS:
        raise InvalidArgumentError(
            f"precision must be {PRECISION_NAMES}, got {precision!r}")
    prec = PRECISIONS[key]
    if prec == "tf32" and dtype is not CudaDataType.FLOAT32:
        raise InvalidArgumentError(
            f"precision='tf32' applies to float32 operands only, got {dtype.name_str}")
    return prec


def grid_1d(n: int, block: int, sm_count: int, waves: int = 8) -> int:
    """Blocks for a grid-stride loop over n items: enough to fill every SM, no more."""
    need = (n + block - 1) // block
    return max(1, min(need, sm_count * waves))


# -- host side ------------------------------------------------------------------------
def acc_dtype(dtype: CudaDataType) -> CudaDataType:
    """The dtype kernels accumulate in: float64 for float64, else float32."""
    return CudaDataType.FLOAT64 if dtype is CudaDataType.FLOAT64 else CudaDataType.FLOAT32


def size_bucket(x: int) -> int:
    """An autotuner key's octave of a size: 1 for 1, then 2 for 2, 3 for 3-4, 4 for 5-8, ..."""
    return max(0, int(x) - 1).bit_length()


def half_octave_bucket(x: int) -> int:
    """size_bucket with each octave split in two (1025-1536, 1537-2048): for output sizes
    whose tile counts, hence wave quantization, differ within an octave (1536^2 and 2048^2
    GEMMs pick different tiles, perf/NOTES.md "Matmul, mid sizes on TMA")."""
    v = max(0, int(x) - 1)
    n = v.bit_length()
    return 2 * n + ((v >> (n - 2)) & 1 if n >= 2 else 0)


def host_array(m: Any, t: CudaTensor) -> np.ndarray:
    """The tensor's values as a NumPy array (bfloat16 widened to float32)."""
    a = m.backend.to_host(t)
    if t.dtype is CudaDataType.BFLOAT16:
        return from_bfloat16_bits(a).reshape(t.shape)
    return a


def from_host(m: Any, values: np.ndarray, dtype: CudaDataType, device_id: int) -> CudaTensor:
    """A new tensor holding values converted to dtype (bfloat16 rounded to nearest even)."""
    if type(values) is not np.ndarray:
        values = np.asarray(values)
    if dtype is CudaDataType.BFLOAT16:
        host = to_bfloat16_bits(values.astype(np.float32)).reshape(values.shape)
    else:
        nd = dtype.numpy_dtype
        host = values if values.dtype is nd and values.flags.c_contiguous else \
            np.ascontiguousarray(values, dtype=nd)
    backend = m.backend
    if type(device_id) is int and backend.direct_launch(device_id):
        # device_id's context is current in this thread, so it is a valid device; the
        # array's shape is a tuple of non-negative ints
        out = backend.empty_checked(values.shape, dtype, device_id)
        if out.nbytes and backend.transfers.direct_htod(host, out) is None:
            backend.copy_to_device(host, out)     # (direct_htod: copy_to_device's fast path)
        return out
    out = backend.empty(values.shape, dtype, device_id)
    if out.nbytes:
        backend.copy_to_device(host, out)
    return out


def write_host(m: Any, values: np.ndarray, t: CudaTensor) -> None:
    """Store values (any float type) into t, rounding once to its dtype."""
    values = np.asarray(values).reshape(t.shape)
    if t.dtype is CudaDataType.BFLOAT16:
        host = to_bfloat16_bits(values.astype(np.float32)).reshape(t.shape)
    else:
        host = np.ascontiguousarray(values, dtype=t.dtype.numpy_dtype)
    if t.nbytes:
        m.backend.copy_to_device(host, t)


def scalar_for(dtype: CudaDataType, value: Any) -> Any:
    """A Python scalar converted for a kernel's value argument of this dtype."""
    if isinstance(value, (np.generic,)):
        value = value.item()
    if isinstance(value, bool):
        value = int(value)
    if not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"expected a Python number, got {type(value).__name__}")
    return float(value) if dtype.is_floating else int(value)


def compile_all(m: Any, jobs: Sequence[Tuple[str, dict]], device_id: Optional[int] = None,
                workers: int = 8, get: Any = None) -> int:
    """Compile (template, params) jobs in parallel threads (nvcc runs in subprocesses, so
    threads overlap) so that first calls pay no compile latency. Returns how many; 0 in
    fallback mode. get(m, template, device, params) is the op module's memoizing getter
    (default: m.kernel)."""
    if not m.gpu:
        return 0
    from concurrent.futures import ThreadPoolExecutor
    dev = m.backend.current_device if device_id is None else device_id
    if get is None:
        def get(m: Any, template: str, d: int, params: dict) -> Any:
            return m.kernel(template, d, **params)

    def one(job: Tuple[str, dict]) -> None:
        with m.backend.device(dev):
            get(m, job[0], dev, job[1])

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        list(pool.map(one, jobs))
    return len(jobs)


def memo_kernel(m: Any, cache: str, template: str, dev: int, params: Dict[str, Any]) -> Any:
    """m.kernel(template, dev, **params), memoized on m (in its attribute `cache`, one per op
    module) by the parameter items: skips the generator's JSON key on the per-call path."""
    memo = m.__dict__.setdefault(cache, {})
    key = (template, dev, tuple(sorted(params.items())))
    k = memo.get(key)
    if k is None:
        k = memo[key] = m.kernel(template, dev, **params)
    return k


# -- per-call plans -----------------------------------------------------------------------
MAX_PLANS = 4096   # per CudaMath; the cache is cleared when it would grow past this


def remember_plan(m: Any, key: tuple, plan: Any) -> Any:
    """Keep `plan` in the CudaMath's plan cache under `key` (a tuple starting with the op's
    public name, then whatever decides the launches: shapes, dtypes, device, options).

    A plan is made by an op's general path after it has checked its operands and launched
    once; it is a callable taking the operands (and out=) that allocates its result and calls
    `PreparedLaunch`es, returning None when the call is not one it can take (then the
    general path runs). The op's entry runs it through `planned` (only when
    `m.backend.direct_launch(device)` is True, unless the plan checks that itself)."""
    plans = m.plans
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = plan
    return plan


def planned(m: Any, key: tuple, *args: Any) -> Any:
    """What the per-call plan kept under key returns for args: the op's result, or None where
    there is no plan or the plan leaves this call to the general path."""
    plan = m.plans.get(key)
    return None if plan is None else plan(*args)


def output_maker(m: Any, dev: int, shape: Tuple[int, ...], dtype: CudaDataType,
                 second_shape: Tuple[int, ...], with_second: bool) -> Callable[..., Any]:
    """outputs(launch) for a per-call plan with an optional second, float32 output (the
    attention plans' lse): the result (and with_second that one, of second_shape) from
    dev's pool, launch(result pointer, second pointer or 0), then the result or both; a
    failed launch gives both back, as the general path does."""
    pool = m.backend.memory_pools[dev]
    alloc = pool.allocate_current
    size, lsize = math.prod(shape), math.prod(second_shape)
    nbytes = size * dtype.itemsize

    def outputs(launch: Callable[[int, int], None]) -> Any:
        out = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        lse = None
        try:
            if with_second:
                lse = pool_tensor(second_shape, CudaDataType.FLOAT32, dev, alloc(4 * lsize), pool, lsize,
                                  4 * lsize)
            launch(out._ptr, 0 if lse is None else lse._ptr)
        except BaseException:
            out.free()
            if lse is not None:
                lse.free()
            raise
        return (out, lse) if with_second else out
    return outputs


def plan_memory(m: Any, dev: int) -> Tuple[Any, Any, Any]:
    """A per-call plan's (pool, alloc, direct), bound once when the plan is made: dev's
    memory pool, its allocate_current (a result block in the current stream's order) and
    backend.direct_launch (whether a PreparedLaunch may run directly now)."""
    pool = m.backend.memory_pools[dev]
    return pool, pool.allocate_current, m.backend.direct_launch


def plan_pointer(t: Any, shape: Tuple[int, ...], dtype: CudaDataType, dev: int) -> Optional[int]:
    """t's device pointer when t is a live CudaTensor of this shape, dtype and device on the
    default stream (an optional operand as a per-call plan was made for), else None."""
    if type(t) is not CudaTensor or t.shape != shape or t.dtype is not dtype or \
            t.device_id != dev or t.stream is not None:
        return None
    return t._ptr


def is_scalar(x: Any) -> bool:
    return isinstance(x, (int, float, bool, np.number, np.bool_)) and not isinstance(x, CudaTensor)


def maybe(t: Optional[CudaTensor]) -> Optional[CudaTensor]:
    return None if t is None else check_tensor(t)


class TicketCounters:
    """Zeroed uint32 ticket counters of one op's split launches (a last-block-done ticket per
    group), one set per backend, device and stream, made once and kept (grown by doubling to
    the count asked for): every launch leaves the counters it used at 0 again, so launches in
    one stream's order never need them cleared. Two streams get two sets (one set shared by
    concurrent launches gave wrong sums: tests/test_stream_order.py); each op keeps its own
    instance, so one op growing its set never frees another's. The key holds the PyCUDA
    stream itself, so its handle cannot be reused while its counters exist."""

    MAX_STREAMS = 64   # sets kept per backend; the oldest goes beyond that

    def __init__(self, minimum: int) -> None:
        import threading
        import weakref
        self.minimum = minimum
        self._sets: "weakref.WeakKeyDictionary[Any, Dict[tuple, CudaTensor]]" = \
            weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def held(self) -> list:
        """Every counter set kept now (tests read their sizes and pointers)."""
        with self._lock:
            return [t for per in self._sets.values() for t in per.values()]

    def get(self, m: Any, dev: int, stream: Any, count: int = 0) -> CudaTensor:
        """At least max(count, minimum) counters for launches on (dev, stream)."""
        key = (dev, stream)
        with self._lock:
            per = self._sets.get(m.backend)
            if per is None:
                per = self._sets[m.backend] = {}
            t = per.get(key)
            if t is None or t.is_freed or t.size < count:
                n = self.minimum if t is None or t.is_freed else t.size
                while n < count:
                    n *= 2
                if t is not None:
                    per.pop(key)
                    t.free()   # stream-ordered (memory.py): reused after the launches queued
                elif len(per) >= self.MAX_STREAMS:
                    per.pop(next(iter(per))).free()
                t = m.backend.empty((n,), CudaDataType.INT32, dev)
                m.backend.memset_async(t, 0, stream)    # an async memset: capturable
                per[key] = t
            return t

    def source(self, m: Any, dev: int, count: int) -> Callable[[], int]:
        """For a per-call plan's direct launches (no `with stream:` block): a function giving
        the pointer of at least `count` counters on (dev, the legacy default stream),
        fetched again once grown or evicted (freed)."""
        held = [self.get(m, dev, None, count)]

        def pointer() -> int:
            t = held[0]
            if t._ptr is None:
                t = held[0] = self.get(m, dev, None, count)
            return t._ptr
        return pointer


# -- the public methods' binding to their op --------------------------------------------------
class LazyOp:
    """A class attribute standing for the op function ops/<module>.<name>, which CudaML's
    methods call: the first access imports it and puts it on the class in this descriptor's
    place (a staticmethod), so later calls cost a class attribute lookup where a per-call
    `from .ops import` would cost ~0.5 us, and importing cuda_ml imports no op module."""

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name

    def __set_name__(self, owner: type, attr: str) -> None:
        self.owner = owner
        self.attr = attr

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        import importlib
        fn = getattr(importlib.import_module(f".{self.module}", __package__), self.name)
        setattr(self.owner, self.attr, staticmethod(fn))
        return fn


Method = TypeVar("Method", bound=Callable)


def named_method(fn: Method, owner: str, name: str, doc: str) -> Method:
    """fn, a method that a factory made for the class `owner` (one per op of a table), named
    owner.name as help() and tracebacks show it, and documented by doc."""
    fn.__name__ = name
    fn.__qualname__ = f"{owner}.{name}"
    fn.__doc__ = doc
    return fn
