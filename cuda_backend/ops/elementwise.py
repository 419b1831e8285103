"""Elementwise operations: binary ops with NumPy broadcasting, unary ops and activations,
fill and copy.

Kernels come from `templates/elementwise.cu.j2`, one render per (kind, op, dtype):
- "binary": same-shape contiguous operands, or a tensor and a Python scalar (the scalar is a
  kernel argument), with 16-byte vector loads/stores, UNROLL vectors in flight per thread and
  a scalar tail; unaligned pointers (wrapped arrays at odd offsets) take a scalar path.
- "broadcast": different shapes. Dims are collapsed where both operands broadcast the same
  way; a launch covers at most 6 of them and fewer than 2^31 elements (larger outputs are
  cut by element count into a few launches with pointer offsets, `_broadcast_plan`), so the
  kernel decomposes output indices with 32-bit division; rows whose innermost dim is a
  multiple of the vector width (bias adds) still use 16-byte accesses.
- "unary": one contiguous input, an optional float parameter `alpha` passed as an argument.

The per-call path is kept lean for small tensors: kernels are memoized in a dict on the
CudaMath instance, the grid is integer math, nothing is autotuned per call, and the common
call (same-shape tensors, new output, kernel compiled before) skips straight to the launch.
Half types compute in float32 and round once on store; Python scalars take the tensor's
dtype (rounded to it first, as NumPy does).
"""
from __future__ import annotations

import math
import struct
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..dtypes import CudaDataType, from_bfloat16_bits, to_bfloat16_bits
from ..errors import (DeviceMismatchError, DTypeMismatchError, InvalidArgumentError,
                      ShapeMismatchError)
from ..kernels import dtype_params
from ..tensor import CudaTensor
from . import common

DT = CudaDataType
FLOATS = common.FLOATS
INTS = (DT.INT32, DT.INT64)
ALL = FLOATS + INTS

TEMPLATE = "elementwise.cu.j2"
TEMPLATES = (TEMPLATE, "fill.cu.j2")   # the registry's contract (fill's sets: kernels.py)
# Launch shape, from a sweep on an H200 (2^28 float32; block x unroll, exact grid vs capped
# grid-stride): 128 threads, one 16-byte vector per operand per thread and an exact grid ran
# add/multiply-by-scalar/exp at 1.00/1.02/1.01x PyTorch; 256x4 at 0.99/0.96/0.96x; capping
# the grid at 2 or 8 waves cost 5-10%.
BLOCK = 128          # threads per block
UNROLL = 1           # 16-byte vectors per operand per thread per loop step
FILL_BLOCK = 256     # fill.cu.j2's block size (the parameter sets kernels.py lists)
MAX_BCAST_DIMS = 6
_LAUNCH_LIMIT = 2**31   # a broadcast launch stays under this many elements (32-bit division)
_CHUNK = 2**30          # piece of an innermost row longer than that (keeps 16-byte alignment)

# op -> dtypes it supports
BINARY_OPS: Dict[str, Tuple[CudaDataType, ...]] = {
    "add": ALL, "subtract": ALL, "multiply": ALL, "divide": FLOATS,
    "maximum": ALL, "minimum": ALL, "power": FLOATS,
}
COMMUTATIVE = frozenset({"add", "multiply", "maximum", "minimum"})

# op -> (dtypes, {parameter: default}); a parameter is passed to the kernel as `alpha`.
UNARY_OPS: Dict[str, Tuple[Tuple[CudaDataType, ...], Dict[str, float]]] = {
    "exp": (FLOATS, {}), "log": (FLOATS, {}), "sqrt": (FLOATS, {}), "tanh": (FLOATS, {}),
    "abs": (ALL, {}), "negative": (ALL, {}), "relu": (FLOATS, {}), "sigmoid": (FLOATS, {}),
    "silu": (FLOATS, {}), "gelu": (FLOATS, {}), "gelu_exact": (FLOATS, {}),
    "leaky_relu": (FLOATS, {"alpha": 0.01}), "elu": (FLOATS, {"alpha": 1.0}),
}

# unary ops with a parameter: their plan takes it per call, plan(x, alpha=default)
ALPHA_OPS = frozenset(op for op, (_, p) in UNARY_OPS.items() if p)

_BLOCK_DIMS = (BLOCK, 1, 1)
_INT_RANGE = {DT.INT32: (-2**31, 2**31 - 1), DT.INT64: (-2**63, 2**63 - 1),
              DT.UINT8: (0, 255), DT.BOOL: (0, 1)}


def _vec(dtype: CudaDataType) -> int:
    """Elements per 16-byte vector."""
    return 16 // dtype.itemsize


def _unroll(op: str, dtype: CudaDataType) -> int:
    """Vectors in flight per thread: UNROLL, except float64 (2; power 1), where the slow paths
    of the math functions are subroutine calls and ptxas spills a few registers around them
    at other counts (seen with -Xptxas -v: exp and sigmoid at 1, divide at 4, power at 2)."""
    if dtype is DT.FLOAT64:
        return 1 if op == "power" else 2
    return UNROLL


def _params(kind: str, op: str, dtype: CudaDataType) -> Dict[str, Any]:
    return {"kind": kind, "op": op, **dtype_params(dtype), "block_size": BLOCK,
            "vec": _vec(dtype), "unroll": _unroll(op, dtype)}


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set this module renders. fill() uses fill.cu.j2 with the parameter
    sets kernels.template_variants() already lists, so they are not repeated here."""
    out = []
    for op, dtypes in BINARY_OPS.items():
        for dt in dtypes:
            out.append(_params("binary", op, dt))
            out.append(_params("broadcast", op, dt))
    for op, (dtypes, _) in UNARY_OPS.items():
        for dt in dtypes:
            out.append(_params("unary", op, dt))
    return {TEMPLATE: out}


# -- kernels and launch sizing --------------------------------------------------------------
class _DeviceCache:
    """Per (CudaMath, device): compiled kernels by (kind, op, dtype) and the SM count."""

    __slots__ = ("kernels", "sm_count")

    def __init__(self, sm_count: int) -> None:
        self.kernels: Dict[tuple, Any] = {}
        self.sm_count = sm_count


def _cache(m: Any, dev: int) -> _DeviceCache:
    caches = m.__dict__.get("_elementwise_cache")
    if caches is None:
        caches = m.__dict__.setdefault("_elementwise_cache", {})
    c = caches.get(dev)
    if c is None:
        c = caches.setdefault(dev, _DeviceCache(
            m.backend.get_device_info(dev).multiprocessor_count))
    return c


def _kernel_name(m: Any, cache: _DeviceCache, dev: int, kind: str, op: str,
                 dtype: CudaDataType) -> Tuple[str, int]:
    """(compiled kernel name, items per block-step) for one render; memoized as
    (name, items per block-step, elements per 16-byte vector, the op's default scalar)."""
    key = (kind, op, dtype)
    k = cache.kernels.get(key)
    if k is None:
        params = _params(kind, op, dtype)
        zero: Any = 0.0 if dtype.is_floating else 0
        if kind == "unary":
            for pname, default in UNARY_OPS[op][1].items():
                zero = scalar_arg(dtype, default, pname)
        per_block = BLOCK * params["unroll"]
        cap = 2**31 - 1   # one block per BLOCK*UNROLL vectors (an exact grid, see BLOCK)
        k = (m.kernel(TEMPLATE, dev, **params).name, per_block, params["vec"], zero, cap)
        cache.kernels[key] = k
    return k[0], k[1]


# -- per-call plans ---------------------------------------------------------------------------
# A plan is a closure made once per (CudaMath, kind, op, dtype, device) after the general path
# launched that kernel: it holds the kernel's launch function, a compiled struct packer for its
# arguments, the launch block (validated then), the pool and what the grid needs, so that a
# repeat call costs the operand checks, one allocation and the launch. It returns None, and
# the general path runs, whenever anything is not the common case: operands that differ in
# shape, dtype or device, a freed operand, an empty tensor, the device's context not current
# in this thread, a `with stream:` block, or profiling on.

def _remember_plan(m: Any, attr: str, key: tuple, kind: str, op: str, dtype: CudaDataType,
                   dev: int) -> None:
    plans = m.__dict__.get(attr)
    if plans is None:
        plans = m.__dict__.setdefault(attr, {})
    if key not in plans:
        plan = _make_plan(m, kind, op, dtype, dev)
        if plan is not None:
            plans[key] = plan


def _make_plan(m: Any, kind: str, op: str, dtype: CudaDataType, dev: int) -> Optional[Callable]:
    """The plan of one (kind, op, dtype, device), on the backend's public launch API: a
    PreparedLaunch gives the kernel's launch function, argument packer and validated block
    (the grid is the only per-call launch value: it follows the element count and the
    pointers' alignment, and stays under the cap checked here); `direct_launch` says when a
    direct launch is right; the pool's `allocate_current` allocates."""
    backend = m.backend
    if not m.gpu:
        return None
    from ..driver import load_driver
    from ..errors import driver_failure
    from ..tensor import pool_tensor
    name, per_block, vec, zero, cap = _cache(m, dev).kernels[
        ("binary" if kind == "scalar" else kind, op, dtype)]
    kernel = backend.get_kernel(name, dev)
    prepared = backend.prepare_launch(kernel, (1, 1, 1), _BLOCK_DIMS, 0, dev)
    cap = min(cap, backend.get_device_info(dev).max_grid_dims[0])
    pack, launch, block = prepared.pack, prepared.launch_fn, prepared.block
    direct = backend.direct_launch
    pool = backend.memory_pools[dev]
    alloc = pool.allocate_current    # stream None: direct() says no `with stream:` block
    drv_error = load_driver()[0].Error
    what = f"launch of kernel '{name}'"

    if kind == "binary":
        def binary_plan(a: CudaTensor, b: CudaTensor) -> Optional[CudaTensor]:
            # a.dtype is dtype and a.device_id == dev: the plan's key says so
            pa, pb, shape = a._ptr, b._ptr, a.shape
            n = a.size
            if pa is None or pb is None or b.dtype is not dtype or b.device_id != dev or \
                    b.shape != shape or not n or not direct(dev):
                return None
            nbytes = a.nbytes
            res = pool_tensor(shape, dtype, dev, alloc(nbytes, None), pool, n, nbytes)
            po = res._ptr
            grid = -(-(n // vec if not ((po | pa | pb) & 15) else n) // per_block) or 1
            try:
                launch((grid if grid < cap else cap, 1, 1), block, pack(po, pa, pb, zero, n, 0),
                       0, None)
            except drv_error as exc:
                raise driver_failure(what, exc, dev) from None
            return res
        return binary_plan

    if kind == "scalar":
        # The scalar in the tensor's dtype as scalar_arg() makes it: floats rounded to float32
        # or float16 by the struct codes (round to nearest even, as NumPy; a value that
        # overflows raises, and the general path makes it inf); ints range-checked.
        commutes = op in COMMUTATIVE
        hi: Any     # (None with lo for floats, then unread)
        if dtype.is_floating:
            code = {DT.FLOAT32: "f", DT.FLOAT16: "e"}.get(dtype)
            rnd = struct.Struct(code) if code else None
            lo = hi = None
        else:
            rnd = None
            lo, hi = _INT_RANGE[dtype]

        def scalar_plan(t: CudaTensor, s: Any, mode: int) -> Optional[CudaTensor]:
            # t.dtype is dtype and t.device_id == dev; s is a float or an int (not a bool)
            pt = t._ptr
            n = t.size
            if pt is None or not n or not direct(dev):
                return None
            if lo is None:
                try:
                    v = float(s)
                    if rnd is not None:
                        v = rnd.unpack(rnd.pack(v))[0]
                except OverflowError:
                    return None
            elif type(s) is int and lo <= s <= hi:
                v = s
            else:
                return None
            nbytes = t.nbytes
            res = pool_tensor(t.shape, dtype, dev, alloc(nbytes, None), pool, n, nbytes)
            po = res._ptr
            grid = -(-(n // vec if not ((po | pt) & 15) else n) // per_block) or 1
            if mode == 1 or commutes:
                buf = pack(po, pt, 0, v, n, 1)
            else:
                buf = pack(po, 0, pt, v, n, 2)
            try:
                launch((grid if grid < cap else cap, 1, 1), block, buf, 0, None)
            except drv_error as exc:
                raise driver_failure(what, exc, dev) from None
            return res
        return scalar_plan

    if op in ALPHA_OPS:
        # the parameter per call, converted as scalar_arg() converts it (a value the plan
        # cannot convert exactly that way, e.g. one that overflows, goes the general way);
        # an operand last used on another stream goes the general way too (record_stream)
        conv = _plan_scalar(dtype)
        default = float(UNARY_OPS[op][1]["alpha"])

        def alpha_plan(x: CudaTensor, alpha: Any = default) -> Optional[CudaTensor]:
            px = x._ptr
            n = x.size
            if px is None or not n or x.stream is not None or not direct(dev):
                return None
            a = conv(alpha)
            if a is None:
                return None
            nbytes = x.nbytes
            res = pool_tensor(x.shape, dtype, dev, alloc(nbytes, None), pool, n, nbytes)
            po = res._ptr
            grid = -(-(n // vec if not ((po | px) & 15) else n) // per_block) or 1
            try:
                launch((grid if grid < cap else cap, 1, 1), block, pack(po, px, n, a), 0, None)
            except drv_error as exc:
                raise driver_failure(what, exc, dev) from None
            return res
        return alpha_plan

    def plan(x: CudaTensor) -> Optional[CudaTensor]:   # unary
        px = x._ptr
        n = x.size
        if px is None or not n or not direct(dev):
            return None
        nbytes = x.nbytes
        res = pool_tensor(x.shape, dtype, dev, alloc(nbytes, None), pool, n, nbytes)
        po = res._ptr
        grid = -(-(n // vec if not ((po | px) & 15) else n) // per_block) or 1
        try:
            launch((grid if grid < cap else cap, 1, 1), block, pack(po, px, n, zero), 0, None)
        except drv_error as exc:
            raise driver_failure(what, exc, dev) from None
        return res
    return plan


_F32 = struct.Struct("f")
_F16 = struct.Struct("e")
_U32 = struct.Struct("I")


def _plan_scalar(dtype: CudaDataType) -> Callable[[Any], Any]:
    """For the plans: a function giving what scalar_arg(dtype, value) gives for a Python float
    or int value, or None where it leaves the value to the general path (bools, NumPy
    scalars, non-integral or out-of-range values for int dtypes, values that overflow the
    dtype, NaN for bfloat16). Floats round to float32 or float16 by the struct codes (round
    to nearest even from the double, as NumPy); bfloat16 rounds to float32, then to nearest
    even on the upper 16 bits, as to_bfloat16_bits."""
    if dtype.is_floating:
        def conv(value: Any) -> Any:
            t = type(value)
            if t is not float and t is not int:
                return None
            try:
                v = float(value)
                if dtype is DT.FLOAT32:
                    return _F32.unpack(_F32.pack(v))[0]
                if dtype is DT.FLOAT16:
                    return _F16.unpack(_F16.pack(v))[0]
                if dtype is DT.FLOAT64:
                    return v
                if v != v:
                    return None
                u = _U32.unpack(_F32.pack(v))[0]
            except OverflowError:
                return None
            u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
            return _F32.unpack(_U32.pack(u))[0]
        return conv
    lo, hi = _INT_RANGE[DT.INT64 if dtype is DT.BOOL else dtype]
    as_bool = dtype is DT.BOOL

    def conv_int(value: Any) -> Any:
        if type(value) is not int or not lo <= value <= hi:
            return None
        return int(bool(value)) if as_bool else value
    return conv_int


def _fill_setup(m: Any, dtype: CudaDataType, dev: int) -> tuple:
    """(packer, launch function, block, grid cap) of fill.cu.j2 for dtype (bool: its uint8
    storage), compiled by an earlier general-path fill."""
    kdt = DT.UINT8 if dtype is DT.BOOL else dtype
    cache = _cache(m, dev)
    backend = m.backend
    kernel = backend.get_kernel(cache.kernels[("fill", "", kdt)][0], dev)
    prepared = backend.prepare_launch(kernel, (1, 1, 1), (FILL_BLOCK, 1, 1), 0, dev)
    cap = min(cache.sm_count * 8, backend.get_device_info(dev).max_grid_dims[0])  # grid_1d's
    return prepared.pack, prepared.launch_fn, prepared.block, cap, \
        f"launch of kernel '{kernel.name}'"


def _make_fill_plan(m: Any, dtype: CudaDataType, dev: int) -> Optional[Callable]:
    """fill()'s plan for (dtype, device): plan(tensor, value) -> tensor, or None (the
    general path then runs) for a freed or empty tensor, one last used on another stream,
    a value _plan_scalar leaves to the general path, or when no direct launch is right."""
    if not m.gpu:
        return None
    from ..driver import load_driver
    from ..errors import driver_failure
    pack, launch, block, cap, what = _fill_setup(m, dtype, dev)
    conv = _plan_scalar(dtype)
    direct = m.backend.direct_launch
    drv_error = load_driver()[0].Error

    def plan(t: CudaTensor, value: Any) -> Optional[CudaTensor]:
        # t.dtype is dtype and t.device_id == dev: the plan's key says so
        pt = t._ptr
        n = t.size
        if pt is None or not n or t.stream is not None or not direct(dev):
            return None
        v = conv(value)
        if v is None:
            return None
        grid = -(-n // FILL_BLOCK)
        try:
            launch((grid if grid < cap else cap, 1, 1), block, pack(pt, v, n), 0, None)
        except drv_error as exc:
            raise driver_failure(what, exc, dev) from None
        return t
    return plan


def _make_full_plan(m: Any, dtype: CudaDataType, dev: int, value: Any) -> Optional[Callable]:
    """zeros()/ones()'s plan for (dtype, device): plan(shape) -> a new tensor filled with
    value: one allocation and one fill launch; None (the general path then runs) for an
    empty or over-1-GiB shape or when no direct launch is right. A bad shape raises
    normalize_shape's error, as the general path does."""
    if not m.gpu:
        return None
    from ..driver import load_driver
    from ..errors import driver_failure
    from ..tensor import normalize_shape, pool_tensor
    if dtype is DT.BOOL:
        v = int(bool(scalar_arg(DT.INT64, value, "value")))
    else:
        v = scalar_arg(dtype, value, "value")
    pack, launch, block, cap, what = _fill_setup(m, dtype, dev)
    itemsize = dtype.itemsize
    direct = m.backend.direct_launch
    pool = m.backend.memory_pools[dev]
    alloc = pool.allocate_current    # stream None: direct() says no `with stream:` block
    drv_error = load_driver()[0].Error
    prod = math.prod

    def plan(shape: Any) -> Optional[CudaTensor]:
        if not direct(dev):
            return None
        shape = normalize_shape(shape)
        n = prod(shape)
        nbytes = n * itemsize
        if not n or nbytes > 1 << 30:
            return None
        t = pool_tensor(shape, dtype, dev, alloc(nbytes, None), pool, n, nbytes)
        grid = -(-n // FILL_BLOCK)
        try:
            launch((grid if grid < cap else cap, 1, 1), block, pack(t._ptr, v, n), 0, None)
        except drv_error as exc:
            raise driver_failure(what, exc, dev) from None
        return t
    plan.device = dev   # type: ignore[attr-defined]  # (a function attribute, read by full())
    return plan


def _make_copy_plan(m: Any, dtype: CudaDataType, dev: int) -> Optional[Callable]:
    """copy()'s plan for (dtype, device): plan(x) -> a new tensor and one cuMemcpyDtoDAsync
    on the legacy default stream; None for a freed or empty tensor, one last used on another
    stream, or when no direct launch is right."""
    if not m.gpu:
        return None
    from ..driver import load_driver
    from ..errors import driver_failure
    from ..tensor import pool_tensor
    drv = load_driver()[0]
    memcpy, drv_error = drv.memcpy_dtod_async, drv.Error
    direct = m.backend.direct_launch
    pool = m.backend.memory_pools[dev]
    alloc = pool.allocate_current

    def plan(x: CudaTensor) -> Optional[CudaTensor]:
        px = x._ptr
        n = x.size
        if px is None or not n or x.stream is not None or not direct(dev):
            return None
        nbytes = x.nbytes
        res = pool_tensor(x.shape, dtype, dev, alloc(nbytes, None), pool, n, nbytes)
        try:
            memcpy(res._ptr, px, nbytes)
        except drv_error as exc:
            raise driver_failure(f"device-to-device copy of {nbytes} bytes on device {dev}",
                                 exc, dev) from None
        return res
    return plan


def _grid(items: int, per_block: int) -> int:
    """Blocks for `items` work items (vectors or elements), per_block per block-step: an
    exact grid (see BLOCK), within the 2^31 - 1 grid limit."""
    blocks = -(-items // per_block) or 1
    return min(blocks, 2**31 - 1)


# -- operand checks ---------------------------------------------------------------------------
def scalar_arg(dtype: CudaDataType, value: Any, what: str) -> Any:
    """A Python scalar in the tensor's dtype, as the kernel argument: float (rounded to the
    dtype first, as NumPy converts a Python float) or int (range-checked)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool):
        value = int(value)
    if not isinstance(value, (int, float)):
        raise InvalidArgumentError(
            f"{what} must be a CudaTensor or a real number, got {type(value).__name__}")
    if dtype.is_floating:
        try:
            v = float(value)
        except OverflowError:
            raise InvalidArgumentError(
                f"{what} = {value} does not fit {dtype.name_str}") from None
        if dtype is DT.FLOAT64:
            return v
        with np.errstate(over="ignore"):
            if dtype is DT.FLOAT32:
                return float(np.float32(v))
            if dtype is DT.FLOAT16:
                return float(np.float16(v))
            return float(from_bfloat16_bits(to_bfloat16_bits(np.array([v], np.float32)))[0])
    if isinstance(value, float):
        if not value.is_integer():
            raise DTypeMismatchError(
                f"{what} = {value!r} is not an integer, but the tensor is {dtype.name_str} "
                f"(scalars take the tensor's dtype)")
        value = int(value)
    lo, hi = _INT_RANGE[dtype]
    if not lo <= value <= hi:
        raise InvalidArgumentError(f"{what} = {value} is out of range for {dtype.name_str} "
                                   f"({lo}..{hi})")
    return value


def _output(m: Any, out: Optional[CudaTensor], shape: Tuple[int, ...], dtype: CudaDataType,
            dev: int) -> CudaTensor:
    """The given out= tensor after checks, else a new one (allocated only after the inputs
    were validated, so errors leak nothing)."""
    if out is None:
        return m.backend.empty(shape, dtype, dev)
    common.check_tensor(out, "out")
    if out.shape != shape:
        raise ShapeMismatchError(f"out has shape {out.shape}, expected the result shape {shape}")
    if out.dtype is not dtype:
        raise DTypeMismatchError(
            f"out has dtype {out.dtype.name_str}, expected {dtype.name_str}")
    if out.device_id != dev:
        raise DeviceMismatchError(
            f"out is on cuda:{out.device_id}, but the operands are on cuda:{dev}")
    return out


# -- host (fallback) computation ----------------------------------------------------------
def _compute_type(dtype: CudaDataType) -> np.dtype:
    """The NumPy type the op computes in, as on the GPU (half types in float32)."""
    if dtype in (DT.FLOAT16, DT.BFLOAT16):
        return np.dtype(np.float32)
    return dtype.numpy_dtype


def _host(m: Any, t: CudaTensor) -> np.ndarray:
    return common.host_array(m, t).astype(_compute_type(t.dtype), copy=False)


def store_host(m: Any, values: np.ndarray, out: CudaTensor) -> CudaTensor:
    """Write computed values into out, rounding once to its dtype."""
    values = np.asarray(values).reshape(out.shape)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf, as the GPU rounds
        if out.dtype is DT.BFLOAT16:
            host = to_bfloat16_bits(values.astype(np.float32)).reshape(out.shape)
        else:
            host = np.ascontiguousarray(values, dtype=out.dtype.numpy_dtype)
    m.backend.copy_to_device(host, out)
    return out


_NP_BINARY: Dict[str, Callable] = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": np.divide,
    "maximum": np.maximum, "minimum": np.minimum, "power": np.power,
}

_erfc = np.frompyfunc(math.erfc, 1, 1)


def _np_unary(op: str, x: np.ndarray, alpha: float) -> np.ndarray:
    """The unary ops in NumPy, with the formulas the kernels use."""
    t = x.dtype.type
    one = t(1)
    if op == "exp":
        return np.exp(x)
    if op == "log":
        return np.log(x)
    if op == "sqrt":
        return np.sqrt(x)
    if op == "abs":
        return np.abs(x)
    if op == "tanh":
        return np.tanh(x)
    if op == "negative":
        return np.negative(x)
    if op == "relu":
        return np.where(x < 0, t(0), x)
    if op == "sigmoid":
        return one / (one + np.exp(-x))
    if op == "silu":
        return x / (one + np.exp(-x))
    if op == "gelu":
        return x / (one + np.exp(t(-1.5957691216057308) * (x + t(0.044715) * x * x * x)))
    if op == "gelu_exact":
        # np.asarray: frompyfunc gives a plain float (no .astype) for a 0-d input
        erfc = np.asarray(_erfc(x * t(-0.7071067811865476)), dtype=np.float64).astype(x.dtype)
        return np.asarray(t(0.5) * x * erfc, dtype=x.dtype)
    if op == "leaky_relu":
        return np.where(x > 0, x, t(alpha) * x)
    if op == "elu":
        return np.where(x > 0, x, t(alpha) * np.expm1(x))
    raise InvalidArgumentError(f"unknown unary op {op!r}")


# -- binary ---------------------------------------------------------------------------------
def binary(m: Any, op: str, a: Any, b: Any, out: Optional[CudaTensor] = None) -> CudaTensor:
    """op(a, b) elementwise with NumPy broadcasting; a and b are CudaTensors or Python/NumPy
    scalars (at least one tensor). The result has the tensors' dtype. `out`, if given, must
    have the result's shape, dtype and device (it may be an input of that same shape)."""
    if out is None and type(a) is CudaTensor and type(b) is CudaTensor:
        # Fast path for small calls: a plan made by an earlier call of this op, dtype and
        # device (so op and dtype were validated) checks the rest and launches, or says no.
        try:
            plan = m._ew_binary_plans.get((op, a.dtype._name_, a.device_id))
        except AttributeError:
            plan = None
        if plan is not None:
            res = plan(a, b)
            if res is not None:
                return res
    elif out is None and (type(a) is CudaTensor or type(b) is CudaTensor):
        # tensor op Python scalar, either side: the scalar plan (it converts the scalar)
        t, sc, mode = (a, b, 1) if type(a) is CudaTensor else (b, a, 2)
        try:
            plan = m._ew_scalar_plans.get((op, t.dtype._name_, t.device_id))
        except AttributeError:
            plan = None
        if plan is not None and (type(sc) is float or type(sc) is int):
            res = plan(t, sc, mode)
            if res is not None:
                return res
    dtypes = BINARY_OPS.get(op)
    if dtypes is None:
        raise InvalidArgumentError(
            f"unknown binary op {op!r}; expected one of {', '.join(BINARY_OPS)}")
    ta, tb = isinstance(a, CudaTensor), isinstance(b, CudaTensor)
    if ta and tb:
        a.check_alive()
        b.check_alive()
        dev = common.same_device(a, b)
        dtype = common.same_dtype(a, b)
        shape = a.shape if a.shape == b.shape else common.broadcast_shapes(a.shape, b.shape)
        mode = 0
    elif ta:
        a.check_alive()
        dev, dtype, shape, mode = a.device_id, a.dtype, a.shape, 1
    elif tb:
        b.check_alive()
        dev, dtype, shape, mode = b.device_id, b.dtype, b.shape, 2
    else:
        raise InvalidArgumentError(
            f"{op} needs at least one CudaTensor operand, got {type(a).__name__} and "
            f"{type(b).__name__}")
    if dtype not in dtypes:
        common.require_dtype(a if ta else b, dtypes, op)
    if mode == 1:
        sv = scalar_arg(dtype, b, "b")
    elif mode == 2:
        sv = scalar_arg(dtype, a, "a")
    else:
        sv = 0.0 if dtype.is_floating else 0
    res = _output(m, out, shape, dtype, dev)
    n = res.size
    if n == 0:
        return res
    if not m.gpu:
        return _binary_host(m, op, a, b, sv, mode, res)
    cache = _cache(m, dev)
    if mode == 0 and a.shape != b.shape:
        dims = _collapse(shape, a.shape, b.shape)
        if dims is not None:
            return _broadcast_launch(m, cache, op, dtype, dev, res, a, b, dims)
    if mode == 2 and op in COMMUTATIVE:
        a, b, mode = b, a, 1
    name, per_block = _kernel_name(m, cache, dev, "binary", op, dtype)
    vec = 16 // dtype.itemsize
    if mode == 0:
        aligned = not ((res._ptr | a._ptr | b._ptr) & 15)
        args = (res, a, b, sv, n, 0)
    elif mode == 1:
        aligned = not ((res._ptr | a._ptr) & 15)
        args = (res, a, 0, sv, n, 1)
    else:
        aligned = not ((res._ptr | b._ptr) & 15)
        args = (res, 0, b, sv, n, 2)
    grid = _grid(n // vec if aligned else n, per_block)
    m.backend.launch_kernel(name, grid, *args, block_size=_BLOCK_DIMS, device_id=dev)
    if out is None:
        if mode == 0:
            _remember_plan(m, "_ew_binary_plans", (op, dtype._name_, dev), "binary", op,
                           dtype, dev)
        elif dtype is not DT.BFLOAT16:
            _remember_plan(m, "_ew_scalar_plans", (op, dtype._name_, dev), "scalar", op,
                           dtype, dev)
    return res


def _binary_host(m: Any, op: str, a: Any, b: Any, sv: Any, mode: int,
                 res: CudaTensor) -> CudaTensor:
    """Fallback: the same op in NumPy, in the GPU's compute type, rounded once."""
    ct = _compute_type(res.dtype)
    x = _host(m, a) if mode != 2 else np.asarray(sv, dtype=ct)
    y = _host(m, b) if mode != 1 else np.asarray(sv, dtype=ct)
    with np.errstate(all="ignore"):
        values = _NP_BINARY[op](x, y)
    return store_host(m, np.broadcast_to(values, res.shape), res)


def _collapse(shape: Tuple[int, ...], a_shape: Tuple[int, ...],
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


def _broadcast_launch(m: Any, cache: _DeviceCache, op: str, dtype: CudaDataType, dev: int,
                      res: CudaTensor, a: CudaTensor, b: CudaTensor,
                      dims: List[Tuple[int, int, int]]) -> CudaTensor:
    """Launch the broadcast kernel once per entry of the plan."""
    name, per_block = _kernel_name(m, cache, dev, "broadcast", op, dtype)
    vec = 16 // dtype.itemsize
    launch = m.backend.launch_kernel
    for args in _broadcast_plan(dims, dtype.itemsize, res.ptr, a.ptr, b.ptr):
        grid = _grid(args[3] // vec if args[5] else args[3], per_block)
        launch(name, grid, *args, block_size=_BLOCK_DIMS, device_id=dev)
    return res


def _broadcast_plan(dims: List[Tuple[int, int, int]], itemsize: int, po: int, pa: int,
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
    limit, chunk = limit or _LAUNCH_LIMIT, chunk or _CHUNK
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
    top_size, top_a, top_b = dims[first]           # the dim cut into runs
    even = split and k > 0
    if even:       # `pieces` runs of at most (limit - 1) // n indices, as equal as can be
        pieces = -(-top_size // ((limit - 1) // n))
    else:          # one run, or an innermost dim in runs of `chunk`
        run = min(chunk, limit - 1) if k == 0 else top_size
        pieces = -(-top_size // run)
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


def _prod(xs: Any) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


# -- unary ----------------------------------------------------------------------------------
def unary(m: Any, op: str, x: CudaTensor, out: Optional[CudaTensor] = None,
          **params: Any) -> CudaTensor:
    """op(x) elementwise. Ops with a parameter (leaky_relu, elu: alpha) take it by keyword,
    with PyTorch's default when omitted. `out` as for binary()."""
    if out is None and type(x) is CudaTensor:
        # Fast path, as in binary(); an op with a parameter passes a float one to its plan.
        try:
            plan = m._ew_unary_plans.get((op, x.dtype._name_, x.device_id))
        except AttributeError:
            plan = None
        if plan is not None:
            if not params:
                res = plan(x)
            elif op in ALPHA_OPS and len(params) == 1 and type(params.get("alpha")) is float:
                res = plan(x, params["alpha"])
            else:
                res = None
            if res is not None:
                return res
    spec = UNARY_OPS.get(op)
    if spec is None:
        raise InvalidArgumentError(
            f"unknown unary op {op!r}; expected one of {', '.join(UNARY_OPS)}")
    dtypes, defaults = spec
    common.check_tensor(x, "x")
    unknown = set(params) - set(defaults)
    if unknown:
        raise InvalidArgumentError(
            f"{op} got unexpected parameter(s) {', '.join(sorted(unknown))}; it takes "
            f"{', '.join(defaults) or 'none'}")
    if x.dtype not in dtypes:
        common.require_dtype(x, dtypes, op)
    alpha: Any = 0.0 if x.dtype.is_floating else 0
    for key, default in defaults.items():
        alpha = scalar_arg(x.dtype, params.get(key, default), key)
    res = _output(m, out, x.shape, x.dtype, x.device_id)
    n = res.size
    if n == 0:
        return res
    if not m.gpu:
        with np.errstate(all="ignore"):
            values = _np_unary(op, _host(m, x), alpha)
        return store_host(m, values, res)
    dev = x.device_id
    cache = _cache(m, dev)
    name, per_block = _kernel_name(m, cache, dev, "unary", op, x.dtype)
    aligned = not ((res._ptr | x._ptr) & 15)
    grid = _grid(n // (16 // x.dtype.itemsize) if aligned else n, per_block)
    m.backend.launch_kernel(name, grid, res, x, n, alpha, block_size=_BLOCK_DIMS,
                            device_id=dev)
    if out is None and (not params or op in ALPHA_OPS):
        _remember_plan(m, "_ew_unary_plans", (op, x.dtype._name_, dev), "unary", op, x.dtype,
                       dev)
    return res


# -- fill and copy --------------------------------------------------------------------------
def fill(m: Any, tensor: CudaTensor, value: Any) -> CudaTensor:
    """Set every element of tensor to value, in place (fill.cu.j2); returns the tensor.
    The value takes the tensor's dtype (an int tensor refuses a non-integral value)."""
    common.check_tensor(tensor, "tensor")
    dtype = tensor.dtype
    if dtype is DT.BOOL:
        v = scalar_arg(DT.INT64, value, "value")
        v = int(bool(v))
        dtype = DT.UINT8            # same storage: one byte, 0 or 1
    else:
        v = scalar_arg(dtype, value, "value")
    n = tensor.size
    if n == 0:
        return tensor
    if not m.gpu:
        return store_host(m, np.full(tensor.shape, v, dtype=_compute_type(dtype)), tensor)
    dev = tensor.device_id
    cache = _cache(m, dev)
    key: Tuple[Any, ...] = ("fill", "", dtype)
    entry = cache.kernels.get(key)
    if entry is None:
        entry = (m.kernel("fill.cu.j2", dev, **dtype_params(dtype),
                          block_size=FILL_BLOCK).name, FILL_BLOCK)
        cache.kernels[key] = entry
    name = entry[0]
    grid = common.grid_1d(n, FILL_BLOCK, cache.sm_count)
    m.backend.launch_kernel(name, grid, tensor, v, n, block_size=(FILL_BLOCK, 1, 1),
                            device_id=dev)
    key = ("fill", tensor.dtype, dev)       # CudaMath.fill looks it up
    if key not in m.plans:
        plan = _make_fill_plan(m, tensor.dtype, dev)
        if plan is not None:
            common.remember_plan(m, key, plan)
    return tensor


def full(m: Any, name: str, shape: Any, dtype: Any, device_id: Any, value: Any) -> CudaTensor:
    """zeros/ones (`name`): a new tensor of shape filled with value, through create_tensor
    and fill; then remembers the plan m.plans[(name, dtype, device_id)] (dtype a
    CudaDataType, device_id an int or None: the current device, which the plan's direct
    launch check pins to the device it was made for) that CudaMath.zeros/ones call first."""
    t = m.fill(m.create_tensor(shape, dtype, device_id), value)
    if m.gpu and t.size and type(dtype) is CudaDataType and \
            (device_id is None or type(device_id) is int):
        key = (name, dtype, device_id)
        old = m.plans.get(key)
        if old is None or old.device != t.device_id:
            plan = _make_full_plan(m, dtype, t.device_id, value)
            if plan is not None:
                common.remember_plan(m, key, plan)
    return t


def copy(m: Any, x: CudaTensor) -> CudaTensor:
    """A new tensor with x's contents: an asynchronous device-to-device copy on x's device,
    queued on the current stream (a `with stream:` block's, else the legacy default stream),
    as a kernel would be. With profiling on, the backend's timed copy (recorded as a dtod
    transfer; it waits for the copy)."""
    common.check_tensor(x, "tensor")
    backend = m.backend
    res = backend.empty(x.shape, x.dtype, x.device_id)
    nbytes = x.nbytes
    if not nbytes:
        return res
    if not m.gpu or backend.enable_profiling:
        backend.copy_device_to_device(res, x, nbytes)
        return res
    from ..driver import load_driver
    from ..errors import driver_failure
    from ..memory import record_stream
    from ..streams import current_pycuda_stream
    dev = x.device_id
    stream = current_pycuda_stream(dev)
    for t in (x, res):
        if t.stream is not stream:
            record_stream(t, stream)     # stream order of its pool block (memory.py)
    drv = load_driver()[0]
    with backend.activate(dev):
        try:
            drv.memcpy_dtod_async(res._ptr, x._ptr, nbytes, stream)
        except drv.Error as exc:
            raise driver_failure(f"device-to-device copy of {nbytes} bytes on device {dev}",
                                 exc, dev) from None
    key = ("copy", x.dtype, dev)            # CudaMath.copy looks it up
    if key not in m.plans:
        plan = _make_copy_plan(m, x.dtype, dev)
        if plan is not None:
            common.remember_plan(m, key, plan)
    return res


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every elementwise and fill kernel for one device (default: the current one)
    now, `workers` at a time (nvcc runs as a subprocess, so threads overlap), so that first
    calls pay no compile latency. Returns the number of kernels; 0 in fallback mode."""
    jobs = [(TEMPLATE, p) for p in template_variants()[TEMPLATE]]
    jobs += [("fill.cu.j2", {**dtype_params(dt), "block_size": FILL_BLOCK})
             for dt in DT if dt is not DT.BOOL]
    return common.compile_all(m, jobs, device_id, workers)


precompile = warm_up   # the former name (tests/test_elementwise.py, tests/test_warm_up.py)


def reference(op: str, *operands: Any, alpha: Optional[float] = None) -> np.ndarray:
    """float64 NumPy of a binary op (two operands, arrays or scalars, broadcast) or a unary
    op (one operand; alpha defaults as in UNARY_OPS), with the kernels' formulas."""
    args = [np.asarray(a, dtype=np.float64) for a in operands]
    with np.errstate(all="ignore"):
        if op in BINARY_OPS:
            return np.asarray(_NP_BINARY[op](*args), dtype=np.float64)
        if op not in UNARY_OPS:
            raise InvalidArgumentError(f"unknown elementwise op {op!r}")
        a = UNARY_OPS[op][1].get("alpha", 0.0) if alpha is None else float(alpha)
        return np.asarray(_np_unary(op, args[0], a), dtype=np.float64)
