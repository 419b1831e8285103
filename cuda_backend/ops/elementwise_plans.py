"""The elementwise per-call plans: the fast path of binary, tensor-scalar, unary, fill,
zeros/ones and copy calls that repeat an earlier call's (op, dtype, device).

A plan is a closure made once per (CudaMath, kind, op, dtype, device) after the general path
(`elementwise`) launched that kernel: it holds the kernel's launch function, a compiled struct
packer for its arguments, the launch block (validated then), the pool and what the grid
needs, so that a repeat call costs the operand checks, one allocation and the launch. It
returns None, and the general path runs, whenever anything is not the common case: operands
that differ in shape, dtype or device, a freed operand, an empty tensor, the device's context
not current in this thread, a `with stream:` block, or profiling on. tests/test_host_path.py
checks every plan against the general path on any machine (PyCUDA stubbed).
"""
from __future__ import annotations

import math
import struct
from typing import Any, Callable, Optional, Tuple

from ..dtypes import CudaDataType
from ..tensor import CudaTensor
from . import common
from .elementwise_kernels import (ALPHA_OPS, BLOCK_DIMS, COMMUTATIVE, DT, FILL_BLOCK, GRID_MAX,
                                  INT_RANGE, UNARY_OPS, device_cache, fill_span, launch_grid,
                                  scalar_arg)

MAX_BCAST_PLANS = 1024   # per CudaMath; the broadcast plans are cleared past this


def remember_launch_plan(m: Any, attr: str, key: tuple, kind: str, op: str,
                         dtype: CudaDataType, dev: int) -> None:
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
    if not m.gpu:
        return None
    start, zero = _launcher(m, kind, op, dtype, dev)
    direct = m.backend.direct_launch
    if kind == "binary":
        return _binary_plan(start, zero, dtype, dev, direct)
    if kind == "scalar":
        return _scalar_plan(start, op, dtype, dev, direct)
    if op in ALPHA_OPS:
        return _alpha_plan(start, op, dtype, dev, direct)
    return _unary_plan(start, zero, dev, direct)


def _launcher(m: Any, kind: str, op: str, dtype: CudaDataType,
              dev: int) -> Tuple[Callable[..., CudaTensor], Any]:
    """(start, the op's default scalar) for one (kind, op, dtype, device): start(shape, n,
    nbytes, ptrs, a, b, s, mode) allocates the result and launches the kernel over its n
    elements, on 16-byte vectors where the result's pointer and `ptrs` (the operands'
    pointers, or-ed) are aligned; it returns the result. The kernel's arguments: binary and
    scalar kinds (out, a, b, s, n, mode), unary (out, a, n, s: x and alpha; b, mode unused).
    (Fixed parameters: *args cost ~0.15 us a call in perf/bench_host_path.py --stub.)"""
    backend = m.backend
    from ..driver import load_driver
    from ..errors import driver_failure
    from ..tensor import pool_tensor
    name, per_block, vec, zero, cap = device_cache(m, dev).kernels[
        ("binary" if kind == "scalar" else kind, op, dtype)]
    kernel = backend.get_kernel(name, dev)
    prepared = backend.prepare_launch(kernel, (1, 1, 1), BLOCK_DIMS, 0, dev)
    cap = min(cap, backend.get_device_info(dev).max_grid_dims[0])
    pack, launch, block = prepared.pack, prepared.launch_fn, prepared.block
    pool = backend.memory_pools[dev]
    alloc = pool.allocate_current    # stream None: direct() says no `with stream:` block
    drv_error = load_driver()[0].Error
    what = f"launch of kernel '{name}'"
    binary_args = kind != "unary"

    def start(shape: Any, n: int, nbytes: int, ptrs: int, a: int, b: int, s: Any,
              mode: int) -> CudaTensor:
        res = pool_tensor(shape, dtype, dev, alloc(nbytes, None), pool, n, nbytes)
        po = res._ptr
        grid = -(-(n // vec if not ((po | ptrs) & 15) else n) // per_block) or 1
        buf = pack(po, a, b, s, n, mode) if binary_args else pack(po, a, n, s)
        try:
            launch((grid if grid < cap else cap, 1, 1), block, buf, 0, None)
        except drv_error as exc:
            raise driver_failure(what, exc, dev) from None
        return res
    return start, zero


def _binary_plan(start: Callable, zero: Any, dtype: CudaDataType, dev: int,
                 direct: Callable) -> Callable:
    def binary_plan(a: CudaTensor, b: CudaTensor) -> Optional[CudaTensor]:
        # a.dtype is dtype and a.device_id == dev: the plan's key says so
        pa, pb, shape = a._ptr, b._ptr, a.shape
        n = a.size
        if pa is None or pb is None or b.dtype is not dtype or b.device_id != dev or \
                b.shape != shape or not n or not direct(dev):
            return None
        return start(shape, n, a.nbytes, pa | pb, pa, pb, zero, 0)
    return binary_plan


def _scalar_plan(start: Callable, op: str, dtype: CudaDataType, dev: int,
                 direct: Callable) -> Callable:
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
        lo, hi = INT_RANGE[dtype]

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
        if mode == 1 or commutes:
            return start(t.shape, n, t.nbytes, pt, pt, 0, v, 1)
        return start(t.shape, n, t.nbytes, pt, 0, pt, v, 2)
    return scalar_plan


def _alpha_plan(start: Callable, op: str, dtype: CudaDataType, dev: int,
                direct: Callable) -> Callable:
    # the parameter per call, converted as scalar_arg() converts it (a value the plan
    # cannot convert exactly that way, e.g. one that overflows, goes the general way);
    # an operand last used on another stream goes the general way too (record_stream)
    conv = _plan_scalar(dtype)
    default = float(UNARY_OPS[op][1]["alpha"])

    def alpha_plan(x: CudaTensor, alpha: Any = default) -> Optional[CudaTensor]:
        px = x._ptr
        n = x.size
        usable = px is not None and n and x.stream is None and direct(dev)
        a = conv(alpha) if usable else None
        return None if a is None else start(x.shape, n, x.nbytes, px, px, 0, a, 0)
    return alpha_plan


def _unary_plan(start: Callable, zero: Any, dev: int, direct: Callable) -> Callable:
    def plan(x: CudaTensor) -> Optional[CudaTensor]:   # unary
        px = x._ptr
        n = x.size
        if px is None or not n or not direct(dev):
            return None
        return start(x.shape, n, x.nbytes, px, px, 0, zero, 0)
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
    lo, hi = INT_RANGE[DT.INT64 if dtype is DT.BOOL else dtype]
    as_bool = dtype is DT.BOOL

    def conv_int(value: Any) -> Any:
        if type(value) is not int or not lo <= value <= hi:
            return None
        return int(bool(value)) if as_bool else value
    return conv_int


def _fill_setup(m: Any, dtype: CudaDataType, dev: int) -> tuple:
    """(packer, launch function, block, grid cap, elements per block-step, what) of
    fill.cu.j2 for dtype (bool: its uint8 storage), compiled by an earlier general-path
    fill."""
    kdt = DT.UINT8 if dtype is DT.BOOL else dtype
    cache = device_cache(m, dev)
    backend = m.backend
    kernel = backend.get_kernel(cache.kernels[("fill", "", kdt)][0], dev)
    prepared = backend.prepare_launch(kernel, (1, 1, 1), (FILL_BLOCK, 1, 1), 0, dev)
    cap = min(GRID_MAX, backend.get_device_info(dev).max_grid_dims[0])   # fill_grid's
    return prepared.pack, prepared.launch_fn, prepared.block, cap, fill_span(kdt), \
        f"launch of kernel '{kernel.name}'"


def make_fill_plan(m: Any, dtype: CudaDataType, dev: int) -> Optional[Callable]:
    """fill()'s plan for (dtype, device): plan(tensor, value) -> tensor, or None (the
    general path then runs) for a freed or empty tensor, one last used on another stream,
    a value _plan_scalar leaves to the general path, or when no direct launch is right."""
    if not m.gpu:
        return None
    from ..driver import load_driver
    from ..errors import driver_failure
    pack, launch, block, cap, span, what = _fill_setup(m, dtype, dev)
    conv = _plan_scalar(dtype)
    direct = m.backend.direct_launch
    drv_error = load_driver()[0].Error

    def plan(t: CudaTensor, value: Any) -> Optional[CudaTensor]:
        # t.dtype is dtype and t.device_id == dev: the plan's key says so
        pt = t._ptr
        n = t.size
        v = conv(value) if pt is not None and n and t.stream is None and direct(dev) else None
        if v is None:
            return None
        grid = -(-n // span)    # fill_grid's
        try:
            launch((grid if grid < cap else cap, 1, 1), block, pack(pt, v, n), 0, None)
        except drv_error as exc:
            raise driver_failure(what, exc, dev) from None
        return t
    return plan


def make_full_plan(m: Any, dtype: CudaDataType, dev: int, value: Any) -> Optional[Callable]:
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
    pack, launch, block, cap, span, what = _fill_setup(m, dtype, dev)
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
        grid = -(-n // span)    # fill_grid's
        try:
            launch((grid if grid < cap else cap, 1, 1), block, pack(t._ptr, v, n), 0, None)
        except drv_error as exc:
            raise driver_failure(what, exc, dev) from None
        return t
    plan.device = dev   # type: ignore[attr-defined]  # (a function attribute, read by full())
    return plan


def make_copy_plan(m: Any, dtype: CudaDataType, dev: int) -> Optional[Callable]:
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


def remember_broadcast_plan(m: Any, op: str, a: CudaTensor, b: CudaTensor, res: CudaTensor,
                            name: str, per_block: int, args: tuple) -> None:
    """After binary()'s general path broadcast a and b in one launch (`args`: its kernel
    arguments, made with every pointer 16-byte aligned; into a new tensor or out=): keep the
    plan of that (op, shapes, dtype, device) in m.ew_bcast_plans."""
    plans = m.__dict__.get("ew_bcast_plans")
    if plans is None:
        plans = m.__dict__.setdefault("ew_bcast_plans", {})
    if len(plans) >= MAX_BCAST_PLANS:
        plans.clear()
    key = (op, a.shape, b.shape, res.dtype._name_, res.device_id)
    if key not in plans:
        plans[key] = _broadcast_plan(m, res, name, per_block, args)


def _broadcast_plan(m: Any, res: CudaTensor, name: str, per_block: int,
                    args: tuple) -> Callable:
    """broadcast_plan(a, b, out=None) -> the result (a new tensor, or out), or None (general
    path): the one launch of the broadcast kernel with the call's pointers. The kernel arguments after the pointers (n,
    ndim, vectorize, sizes, strides) are the first call's; where a pointer is not 16-byte
    aligned the launch takes them with vectorize 0 and the element grid, as
    elementwise_broadcast.broadcast_plan would."""
    from ..driver import load_driver
    from ..errors import driver_failure
    from ..tensor import pool_tensor
    backend = m.backend
    shape, dtype, dev = res.shape, res.dtype, res.device_id
    n, nbytes = res.size, res.nbytes
    vec = 16 // dtype.itemsize
    prepared = backend.prepare_launch(backend.get_kernel(name, dev), (1, 1, 1), BLOCK_DIMS, 0,
                                      dev)
    launch, block = prepared.launch_fn, prepared.block
    rest = args[3:]
    rest_scalar = rest[:2] + (0,) + rest[3:]
    # the arguments after the three pointers packed once per variant (PreparedLaunch.split_pack)
    split, split_scalar = prepared.split_pack(3, *rest), prepared.split_pack(3, *rest_scalar)
    if split is None or split_scalar is None:
        full = prepared.pack
        split = (lambda *p: full(*p, *rest), b"")
        split_scalar = (lambda *p: full(*p, *rest_scalar), b"")
    head, tail = split
    head_scalar, tail_scalar = split_scalar
    grid = (launch_grid(n // vec if rest[2] else n, per_block), 1, 1)
    grid_scalar = (launch_grid(n, per_block), 1, 1)
    # (alloc's stream None: direct() says no `with stream:` block)
    pool, alloc, direct = common.plan_memory(m, dev)
    drv_error = load_driver()[0].Error
    what = f"launch of kernel '{name}'"

    def broadcast_plan(a: CudaTensor, b: CudaTensor,
                       out: Optional[CudaTensor] = None) -> Optional[CudaTensor]:
        # the key fixes op, both shapes, a's dtype and device
        pa, pb = a._ptr, b._ptr
        if pa is None or pb is None or b.dtype is not dtype or b.device_id != dev or \
                not direct(dev):
            return None
        if out is None:
            out = pool_tensor(shape, dtype, dev, alloc(nbytes, None), pool, n, nbytes)
        elif type(out) is not CudaTensor or out._ptr is None or out.shape != shape or \
                out.dtype is not dtype or out.device_id != dev:
            return None   # the general path's checks and errors
        po = out._ptr
        if (po | pa | pb) & 15:
            buf, g = head_scalar(po, pa, pb) + tail_scalar, grid_scalar
        else:
            buf, g = head(po, pa, pb) + tail, grid
        try:
            launch(g, block, buf, 0, None)
        except drv_error as exc:
            raise driver_failure(what, exc, dev) from None
        return out
    return broadcast_plan
