"""Activation gradients: dx = op'(x) * grad_out for relu, leaky_relu, elu, gelu (tanh form and
exact), from the forward's input x, and for sigmoid and tanh from the forward's output y.

One kernel per (op, dtype), `templates/activation_backward.cu.j2`: an elementwise kernel over
two same-shape contiguous operands (16-byte vectors when every pointer is 16-byte aligned,
else one element per access), float dtypes, half types computing in float32 and rounding
once. The formulas follow PyTorch's at the edges (relu's gradient is 0 at x == 0; NaN
inputs as its kernels) and are written without cancellation where the obvious form has it
(gelu: 1 - sigmoid(z) as sigmoid(-z); gelu_exact: erfc). The per-call plan of an op, dtype
and device (`m.plans[("<op>_backward", dtype, device)]`, made after a first general call)
checks the operands and launches. Fallback mode computes `reference` in float64 and rounds
once to the dtype.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError
from ..kernels import dtype_params
from ..tensor import CudaTensor
from . import common

TEMPLATE = "activation_backward.cu.j2"
TEMPLATES = (TEMPLATE,)
BLOCK = 256
# op -> (the second operand: the forward's input "x" or output "y", default alpha or None)
OPS: Dict[str, Tuple[str, Optional[float]]] = {
    "relu": ("x", None), "leaky_relu": ("x", 0.01), "elu": ("x", 1.0), "gelu": ("x", None),
    "gelu_exact": ("x", None), "sigmoid": ("y", None), "tanh": ("y", None),
}
# the public method of each op (gelu_exact is gelu_backward(approximate="none"))
PUBLIC = {op: f"{op}_backward" for op in OPS}
PUBLIC["gelu_exact"] = "gelu_backward"
K2 = 1.5957691216057308   # 2 sqrt(2 / pi): z = K2 (x + 0.044715 x^3)
_BLOCK_DIMS = (BLOCK, 1, 1)


def kernel_params(op: str, dtype: CudaDataType) -> Dict[str, Any]:
    return {"op": op, **dtype_params(dtype), "block_size": BLOCK, "vec": 16 // dtype.itemsize}


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every op for every float dtype."""
    return {TEMPLATE: [kernel_params(op, dt) for op in OPS for dt in common.FLOATS]}


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every activation-gradient kernel for one device (0 in fallback mode)."""
    jobs = [(TEMPLATE, p) for p in template_variants()[TEMPLATE]]
    return common.compile_all(m, jobs, device_id, workers)


_erfc = np.frompyfunc(math.erfc, 1, 1)


def reference(op: str, grad_out: Any, v: Any, alpha: Optional[float] = None) -> np.ndarray:
    """float64 NumPy of op's gradient: grad_out and v (x, or y for sigmoid/tanh), same shape;
    alpha defaults as in OPS. The kernels' formulas (see the template)."""
    if op not in OPS:
        raise InvalidArgumentError(f"unknown activation {op!r}; expected one of {', '.join(OPS)}")
    g = np.asarray(grad_out, dtype=np.float64)
    x = np.asarray(v, dtype=np.float64)
    a = float(OPS[op][1] or 0.0) if alpha is None else float(alpha)
    with np.errstate(all="ignore"):
        if op == "relu":
            r = np.where(x <= 0, 0.0, g)
        elif op == "leaky_relu":
            r = np.where(x > 0, g, g * a)
        elif op == "elu":
            r = np.where(x <= 0, g * a * np.exp(x), g)
        elif op == "sigmoid":
            r = g * (1.0 - x) * x
        elif op == "tanh":
            r = g * (1.0 - x * x)
        elif op == "gelu":
            x2 = x * x
            z = K2 * x * (1.0 + 0.044715 * x2)
            s = 1.0 / (1.0 + np.exp(-z))
            q = 1.0 / (1.0 + np.exp(z))
            sq = s * q
            dz = K2 * (1.0 + 0.134145 * x2)
            r = g * (s + np.where(sq == 0, 0.0, x * sq * dz))
        else:  # gelu_exact
            cdf = 0.5 * np.asarray(_erfc(x * -0.7071067811865476), dtype=np.float64)
            pdf = 0.3989422804014327 * np.exp(-0.5 * x * x)
            r = g * (cdf + np.where(pdf == 0, 0.0, x * pdf))
    return np.asarray(r, dtype=np.float64).reshape(np.broadcast_shapes(g.shape, x.shape))


# -- kernels ------------------------------------------------------------------------------
def _kernel(m: Any, op: str, dtype: CudaDataType, dev: int) -> str:
    """The compiled kernel's name, memoized per CudaMath."""
    names = m.__dict__.get("_act_backward_kernels")
    if names is None:
        names = m.__dict__.setdefault("_act_backward_kernels", {})
    key = (op, dtype, dev)
    name = names.get(key)
    if name is None:
        name = names[key] = m.kernel(TEMPLATE, dev, **kernel_params(op, dtype)).name
    return name


def _grid(n: int, aligned: bool, vec: int) -> int:
    """One thread per 16-byte vector (aligned) or element; the kernel is grid-stride."""
    items = n // vec if aligned else n
    return max(1, min(-(-items // BLOCK), 2**31 - 1))


def _alpha(op: str, dtype: CudaDataType, alpha: Any) -> float:
    """The kernel's alpha: the op's parameter (default when None) rounded to the dtype as a
    Python scalar is for the forward activation; 0.0 for ops without one."""
    default = OPS[op][1]
    if default is None:
        if alpha is not None:
            raise InvalidArgumentError(f"{PUBLIC[op]} takes no alpha, got {alpha!r}")
        return 0.0
    if alpha is None:
        alpha = default
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(f"alpha must be a real number, got {alpha!r}")
    from .elementwise_kernels import scalar_arg
    return float(scalar_arg(dtype, alpha, "alpha"))


def backward(m: Any, op: str, grad_out: CudaTensor, v: CudaTensor,
             alpha: Any = None) -> CudaTensor:
    """The gradient of activation `op` with respect to its input: grad_out and v (the
    forward's input x, or output y for sigmoid and tanh) of one shape, dtype and device."""
    spec = OPS.get(op)
    if spec is None:
        raise InvalidArgumentError(f"unknown activation {op!r}; expected one of {', '.join(OPS)}")
    name, vname = PUBLIC[op], spec[0]
    g, x, dtype, dev = common.grad_operands(grad_out, v, vname, name)
    a = _alpha(op, dtype, alpha)
    res = m.backend.empty(g.shape, dtype, dev)
    n = res.size
    if n == 0:
        return res
    if not m.gpu:
        values = reference(op, common.host_array(m, g), common.host_array(m, x), a)
        return _store(m, values, res)
    kname = _kernel(m, op, dtype, dev)
    vec = 16 // dtype.itemsize
    aligned = not ((res.ptr | g.ptr | x.ptr) & 15)
    m.backend.launch_kernel(kname, (_grid(n, aligned, vec), 1, 1), res, g, x, n, a,
                            block_size=_BLOCK_DIMS, device_id=dev)
    key = plan_key(op, dtype, dev)
    if key not in m.plans:
        plan = _make_plan(m, op, dtype, dev, kname)
        if plan is not None:
            common.remember_plan(m, key, plan)
    return res


def plan_key(op: str, dtype: CudaDataType, dev: int) -> tuple:
    """The m.plans key of an op's per-call plan ("gelu_exact_backward" for the exact GELU)."""
    return (op + "_backward", dtype, dev)


def _make_plan(m: Any, op: str, dtype: CudaDataType, dev: int,
               kname: str) -> Optional[Callable]:
    """plan(grad_out, v, alpha) -> the result, or None (then the general path runs) when the
    call is not the common one: v not a live tensor of grad_out's shape, dtype and device,
    an empty tensor, alpha that is not None or a float, or no direct launch now."""
    from ..driver import load_driver
    from ..errors import driver_failure
    from ..tensor import pool_tensor
    backend = m.backend
    kernel = backend.get_kernel(kname, dev)
    prepared = backend.prepare_launch(kernel, (1, 1, 1), _BLOCK_DIMS, 0, dev)
    pack, launch, block = prepared.pack, prepared.launch_fn, prepared.block
    cap = min(2**31 - 1, backend.get_device_info(dev).max_grid_dims[0])
    direct = backend.direct_launch
    pool = backend.memory_pools[dev]
    alloc = pool.allocate_current
    drv_error = load_driver()[0].Error
    what = f"launch of kernel '{kname}'"
    vec = 16 // dtype.itemsize
    has_alpha = OPS[op][1] is not None
    default = _alpha(op, dtype, None)

    def plan(g: CudaTensor, v: Any, alpha: Any = None) -> Optional[CudaTensor]:
        # g.dtype is dtype and g.device_id == dev: the plan's key says so
        if type(v) is not CudaTensor:
            return None
        pg, pv, shape = g._ptr, v._ptr, g.shape
        n = g.size
        if pg is None or pv is None or v.dtype is not dtype or v.device_id != dev or \
                v.shape != shape or not n or not direct(dev):
            return None
        if alpha is None:
            a = default
        elif has_alpha and type(alpha) is float:
            a = _alpha(op, dtype, alpha)
        else:
            return None
        nbytes = g.nbytes
        res = pool_tensor(shape, dtype, dev, alloc(nbytes, None), pool, n, nbytes)
        po = res._ptr
        items = n // vec if not ((po | pg | pv) & 15) else n
        grid = -(-items // BLOCK) or 1
        try:
            launch((grid if grid < cap else cap, 1, 1), block, pack(po, pg, pv, n, a), 0, None)
        except drv_error as exc:
            raise driver_failure(what, exc, dev) from None
        return res
    return plan


def _store(m: Any, values: np.ndarray, res: CudaTensor) -> CudaTensor:
    """Fallback: float64 values rounded once into res."""
    from .elementwise_host import store_host
    return store_host(m, values, res)
