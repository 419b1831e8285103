"""Elementwise operations: binary ops with NumPy broadcasting, unary ops and activations,
fill and copy; the entry points and the op family's registry contract.

Kernels come from `templates/elementwise.cu.j2`, one render per (kind, op, dtype)
(`elementwise_kernels`: the op tables, render parameters and compiled kernels):
- "binary": same-shape contiguous operands, or a tensor and a Python scalar (the scalar is a
  kernel argument), with 16-byte vector loads/stores, UNROLL vectors in flight per thread and
  a scalar tail; unaligned pointers (wrapped arrays at odd offsets) take a scalar path.
- "broadcast": different shapes (`elementwise_broadcast`: collapsed dims, launches under
  2^31 elements, 16-byte accesses for rows that allow them).
- "unary": one contiguous input, an optional float parameter `alpha` passed as an argument.

The per-call path is kept lean for small tensors: kernels are memoized in a dict on the
CudaMath instance, the grid is integer math, nothing is autotuned per call, and the common
call (same-shape tensors, new output, kernel compiled before) skips straight to the launch
(`elementwise_plans`). Half types compute in float32 and round once on store; Python scalars
take the tensor's dtype (rounded to it first, as NumPy does). Without a GPU the same ops run
in NumPy (`elementwise_host`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..kernels import dtype_params
from ..tensor import CudaTensor
from . import common
from .elementwise_broadcast import broadcast_launch, collapse
from .elementwise_host import (NP_BINARY, binary_host, compute_type, host_values, np_unary,
                               store_host)
from .elementwise_kernels import (ALPHA_OPS, BINARY_OPS, BLOCK_DIMS, COMMUTATIVE, DT, FILL_BLOCK,
                                  TEMPLATE, UNARY_OPS, DeviceCache, device_cache, fill_grid,
                                  kernel_name, kernel_params, launch_grid, scalar_arg)
from .elementwise_plans import (make_copy_plan, make_fill_plan, make_full_plan,
                                remember_launch_plan)

TEMPLATES = (TEMPLATE, "fill.cu.j2")   # the registry's contract (fill's sets: kernels.py)


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set this module renders. fill() uses fill.cu.j2 with the parameter
    sets kernels.template_variants() already lists, so they are not repeated here."""
    out = []
    for op, dtypes in BINARY_OPS.items():
        for dt in dtypes:
            out.append(kernel_params("binary", op, dt))
            out.append(kernel_params("broadcast", op, dt))
    for op, (dtypes, _) in UNARY_OPS.items():
        for dt in dtypes:
            out.append(kernel_params("unary", op, dt))
    return {TEMPLATE: out}


# -- operand checks ---------------------------------------------------------------------------
def _output(m: Any, out: Optional[CudaTensor], shape: Tuple[int, ...], dtype: CudaDataType,
            dev: int) -> CudaTensor:
    """The given out= tensor after checks, else a new one (allocated only after the inputs
    were validated, so errors leak nothing)."""
    if out is None:
        return m.backend.empty(shape, dtype, dev)
    common.check_tensor(out, "out")
    if out.shape != shape:
        raise ShapeMismatchError(f"out has shape {out.shape}, expected the result shape {shape}")
    common.check_dtype_device(out, "out", dtype, dtype.name_str, dev, "but the operands are")
    return out


# -- binary ---------------------------------------------------------------------------------
def binary(m: Any, op: str, a: Any, b: Any, out: Optional[CudaTensor] = None) -> CudaTensor:
    """op(a, b) elementwise with NumPy broadcasting; a and b are CudaTensors or Python/NumPy
    scalars (at least one tensor). The result has the tensors' dtype. `out`, if given, must
    have the result's shape, dtype and device (it may be an input of that same shape)."""
    if type(a) is CudaTensor and type(b) is CudaTensor:
        # Fast path for small calls: a plan made by an earlier call of this op, dtype and
        # device (so op and dtype were validated) checks the rest and launches, or says no;
        # operands of different shapes: the broadcast plan of the two shapes (out= too).
        try:
            if a.shape != b.shape:
                plan = m.ew_bcast_plans.get((op, a.shape, b.shape, a.dtype._name_,
                                              a.device_id))
                res = None if plan is None else plan(a, b, out)
            elif out is None:
                plan = m.ew_binary_plans.get((op, a.dtype._name_, a.device_id))
                res = None if plan is None else plan(a, b)
            else:
                res = None
        except AttributeError:
            res = None
        if res is not None:
            return res
    elif out is None and (type(a) is CudaTensor or type(b) is CudaTensor):
        # tensor op Python scalar, either side: the scalar plan (it converts the scalar)
        t, sc, mode = (a, b, 1) if type(a) is CudaTensor else (b, a, 2)
        try:
            plan = m.ew_scalar_plans.get((op, t.dtype._name_, t.device_id))
        except AttributeError:
            plan = None
        if plan is not None and (type(sc) is float or type(sc) is int):
            res = plan(t, sc, mode)
            if res is not None:
                return res
    dev, dtype, shape, mode, sv = _binary_operands(op, a, b)
    res = _output(m, out, shape, dtype, dev)
    n = res.size
    if n == 0:
        return res
    if not m.gpu:
        return binary_host(m, op, a, b, sv, mode, res)
    cache = device_cache(m, dev)
    if mode == 0 and a.shape != b.shape:
        dims = collapse(shape, a.shape, b.shape)
        if dims is not None:
            return broadcast_launch(m, cache, op, dtype, dev, res, a, b, dims, remember=True)
    return _binary_launch(m, cache, op, dtype, dev, res, a, b, sv, mode, out)


def _binary_operands(op: str, a: Any,
                     b: Any) -> Tuple[int, CudaDataType, Tuple[int, ...], int, Any]:
    """(device, dtype, result shape, mode, scalar argument) of binary(op, a, b) after the
    checks: mode 0 two tensors, 1 tensor op scalar, 2 scalar op tensor (the scalar converted
    to the tensor's dtype; 0 of the dtype for mode 0)."""
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
    return dev, dtype, shape, mode, sv


def _binary_launch(m: Any, cache: DeviceCache, op: str, dtype: CudaDataType, dev: int,
                   res: CudaTensor, a: Any, b: Any, sv: Any, mode: int,
                   out: Optional[CudaTensor]) -> CudaTensor:
    """The same-shape or tensor-scalar launch of binary() into res (n > 0 elements); then,
    for a new output, the call's plan (`elementwise_plans`)."""
    n = res.size
    if mode == 2 and op in COMMUTATIVE:
        a, b, mode = b, a, 1
    name, per_block = kernel_name(m, cache, dev, "binary", op, dtype)
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
    grid = launch_grid(n // vec if aligned else n, per_block)
    m.backend.launch_kernel(name, grid, *args, block_size=BLOCK_DIMS, device_id=dev)
    if out is None:
        if mode == 0:
            remember_launch_plan(m, "ew_binary_plans", (op, dtype._name_, dev), "binary", op,
                                 dtype, dev)
        elif dtype is not DT.BFLOAT16:
            remember_launch_plan(m, "ew_scalar_plans", (op, dtype._name_, dev), "scalar", op,
                                 dtype, dev)
    return res


# -- unary ----------------------------------------------------------------------------------
def unary(m: Any, op: str, x: CudaTensor, out: Optional[CudaTensor] = None,
          **params: Any) -> CudaTensor:
    """op(x) elementwise. Ops with a parameter (leaky_relu, elu: alpha) take it by keyword,
    with PyTorch's default when omitted. `out` as for binary()."""
    if out is None and type(x) is CudaTensor:
        # Fast path, as in binary(); an op with a parameter passes a float one to its plan.
        try:
            plan = m.ew_unary_plans.get((op, x.dtype._name_, x.device_id))
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
            values = np_unary(op, host_values(m, x), alpha)
        return store_host(m, values, res)
    dev = x.device_id
    cache = device_cache(m, dev)
    name, per_block = kernel_name(m, cache, dev, "unary", op, x.dtype)
    aligned = not ((res._ptr | x._ptr) & 15)
    grid = launch_grid(n // (16 // x.dtype.itemsize) if aligned else n, per_block)
    m.backend.launch_kernel(name, grid, res, x, n, alpha, block_size=BLOCK_DIMS,
                            device_id=dev)
    if out is None and (not params or op in ALPHA_OPS):
        remember_launch_plan(m, "ew_unary_plans", (op, x.dtype._name_, dev), "unary", op,
                             x.dtype, dev)
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
        return store_host(m, np.full(tensor.shape, v, dtype=compute_type(dtype)), tensor)
    dev = tensor.device_id
    cache = device_cache(m, dev)
    key: Tuple[Any, ...] = ("fill", "", dtype)
    entry = cache.kernels.get(key)
    if entry is None:
        entry = (m.kernel("fill.cu.j2", dev, **dtype_params(dtype),
                          block_size=FILL_BLOCK).name, FILL_BLOCK)
        cache.kernels[key] = entry
    name = entry[0]
    m.backend.launch_kernel(name, fill_grid(n, dtype), tensor, v, n,
                            block_size=(FILL_BLOCK, 1, 1), device_id=dev)
    _remember(m, ("fill", tensor.dtype, dev), make_fill_plan)   # CudaMath.fill looks it up
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
            plan = make_full_plan(m, dtype, t.device_id, value)
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
    _remember(m, ("copy", x.dtype, dev), make_copy_plan)        # CudaMath.copy looks it up
    return res


def _remember(m: Any, key: Tuple[str, CudaDataType, int], make: Callable) -> None:
    """m.plans[key] = make(m, dtype, device) for key (op, dtype, device), unless it has one or
    make gives None (`elementwise_plans`)."""
    if key not in m.plans:
        plan = make(m, key[1], key[2])
        if plan is not None:
            common.remember_plan(m, key, plan)


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
            return np.asarray(NP_BINARY[op](*args), dtype=np.float64)
        if op not in UNARY_OPS:
            raise InvalidArgumentError(f"unknown elementwise op {op!r}")
        a = UNARY_OPS[op][1].get("alpha", 0.0) if alpha is None else float(alpha)
        return np.asarray(np_unary(op, args[0], a), dtype=np.float64)
