"""GEMM gradients: `matmul_backward` (matrix_multiply), `linear_backward` (x Wᵀ + b) and
`fused_linear_gelu_backward` (GELU(x Wᵀ + b), tanh form), without a transposed copy of any
operand.

Each gradient is a GEMM with one operand read transposed, in the matmul kernels' own modes
(ops/matmul.py): for y = x Wᵀ + b with output gradient G,
- grad_x = G @ W: a plain GEMM (W (out, in) is B as (K, N));
- grad_W = Gᵀ @ x: `matmul.matmul_tn`, G read as A given (K, M) (a_trans: its tiles loaded
  along M; split-K over the rows when they are many and the output is small);
- grad_b = the column sums of G (reduction.reduce over axis 0).
fused_linear_gelu_backward first recomputes z = x Wᵀ + b in the linear-layer kernel whose
epilogue reads G and writes dZ = G * GELU'(z) (`bias_gelu_grad`: z is never stored), then
the three above with dZ for G. matmul_backward: grad_a = G @ bᵀ (`matmul.matmul_nt`: the
linear-layer kernels, b as (N, K)), grad_b = aᵀ @ G (matmul_tn); an operand broadcast over
the batch gets its gradient summed over it: b's as one GEMM over the stacked rows
(aᵀ (K, batch M) @ G (batch M, N)), a's as the batched products summed by a reduction.

Precision: float32 is float32-accurate by default, as matrix_multiply and fused_linear_gelu:
every GEMM (the three above and the recompute) times 3xTF32 tensor-core configs beside the
CUDA-core ones where the operands allow 16-byte loads (grad_W's a_trans x3 kernel reads G
along M, its rows permuted in the warp tile, and splits K over the rows like the SIMT one);
precision="ieee" keeps CUDA cores; precision="tf32" uses TF32, for which there is no a_trans
kernel in use: A is transposed into a pool block first (ops/transpose.py), an extra read and
write of G (or a). Every op
keeps a per-call plan (`m.plans`, ops/common.py remember_plan) made after a first general
call. Fallback mode runs the same steps through the matmul, linear-layer and reduction
fallbacks (NumPy), each result rounded to the dtype.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..tensor import CudaTensor
from . import common
from . import matmul as mm
from .linear import LINEAR_FAMILIES   # every linear-layer family (the recompute's epilogue)

DT = CudaDataType
TEMPLATES = (mm.SIMT_TEMPLATE, mm.MMA_TEMPLATE, mm.WGMMA_TEMPLATE, mm.FILL_TEMPLATE,
             "transpose.cu.j2", "reduce.cu.j2", "reduce_axis.cu.j2")
# (dtype, precision) of the families with an a_trans kernel (TF32 transposes A first)
TN_FAMILIES = ((DT.FLOAT32, None), (DT.FLOAT64, None), (DT.FLOAT16, None), (DT.BFLOAT16, None))
Grads = Tuple[CudaTensor, CudaTensor, Optional[CudaTensor]]


# -- the contract -------------------------------------------------------------------------
def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """The kernels only the gradients use: the A-transposed GEMM of every config the a_trans
    families may launch (both alignments), the linear kernels with the bias_gelu_grad
    epilogue (every linear config of every family), and the skinny split-K reduce with it.
    (matmul_nt's bias-only linear kernels are ops/linear.py's.)"""
    out: Dict[str, List[Dict[str, Any]]] = {mm.SIMT_TEMPLATE: [], mm.MMA_TEMPLATE: []}
    for dt, prec in TN_FAMILIES:
        family, _ = mm.family(dt, prec)
        for vec in (True, False):
            for cfg in mm.tn_configs(dt, prec, vec):
                template = mm.config_template(cfg, family)   # (float32's x3: mma)
                out[template].append(mm.tn_params(template, dt, cfg, vec))
    for dt, prec in LINEAR_FAMILIES:
        family, _ = mm.family(dt, prec, linear=True)
        for vec in (True, False):
            for cfg in mm.linear_configs(dt, prec, vec):
                template = mm.config_template(cfg, family)
                out[template].append(mm.linear_params(template, dt, cfg, vec,
                                                      mm.GRAD_EPILOGUE))
    out[mm.SIMT_TEMPLATE].append(mm.splitk_epilogue_params(DT.FLOAT32, mm.GRAD_EPILOGUE))
    return out


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile the gradients' own kernels (template_variants) in parallel threads; returns
    how many were compiled (0 in fallback mode). The plain GEMM, the bias-only linear
    kernels and the reductions are their families' (matmul, linear, reduction warm_up)."""
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets]
    return common.compile_all(m, jobs, device_id, workers, mm.compile_kernel)


def candidates(dtype: CudaDataType, precision: Optional[str], vec: bool,
               kind: str = "tn") -> List[Dict[str, Any]]:
    """The configs the autotuner chooses from: kind "tn" (the A-transposed GEMM: the GEMM's
    configs, float32's default x3 ones included, [] for TF32, which transposes A first) or
    "gelu_grad" (the recompute: the linear layer's configs)."""
    if kind == "tn":
        return mm.tn_configs(dtype, precision, vec)
    if kind == "gelu_grad":
        return mm.linear_configs(dtype, precision, vec)
    raise InvalidArgumentError(f"kind must be 'tn' or 'gelu_grad', got {kind!r}")


def reference(op: str, grad_out: Any, *args: Any, bias: Any = None,
              has_bias: bool = True) -> Tuple[Optional[np.ndarray], ...]:
    """float64 NumPy of op's gradients:
    "matmul_backward" (grad_out, a, b) -> (grad_a, grad_b), NumPy's matmul shapes (1-D
      operands, broadcast batches summed);
    "linear_backward" (grad_out, x, weight) -> (grad_x, grad_weight, grad_bias or None with
      has_bias=False);
    "fused_linear_gelu_backward" (grad_out, x, weight, bias=) -> the same, through
      dZ = grad_out * GELU'(x Wᵀ + b) (tanh form; grad_bias None without a bias)."""
    g = np.asarray(grad_out, dtype=np.float64)
    f64 = [np.asarray(v, dtype=np.float64) for v in args]
    g2: np.ndarray
    with np.errstate(all="ignore"):
        if op == "matmul_backward":
            a, b = f64
            a2 = a[None, :] if a.ndim == 1 else a
            b2 = b[:, None] if b.ndim == 1 else b
            out_nd = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]) + \
                (a2.shape[-2], b2.shape[-1])
            g2 = g.reshape(out_nd)
            ga = np.matmul(g2, np.swapaxes(b2, -1, -2))
            gb = np.matmul(np.swapaxes(a2, -1, -2), g2)
            return _sum_to(ga, a2.shape).reshape(a.shape), _sum_to(gb, b2.shape).reshape(b.shape)
        if op in ("linear_backward", "fused_linear_gelu_backward"):
            x, w = f64
            rows = int(np.prod(x.shape[:-1]))
            x2, g2 = x.reshape(rows, x.shape[-1]), g.reshape(rows, w.shape[0])
            with_bias = has_bias
            if op == "fused_linear_gelu_backward":
                b64 = 0.0 if bias is None else np.asarray(bias, dtype=np.float64)
                g2 = g2 * mm.gelu_tanh_grad(x2 @ w.T + b64)
                with_bias = bias is not None
            return ((g2 @ w).reshape(x.shape), g2.T @ x2,
                    g2.sum(axis=0) if with_bias else None)
    raise InvalidArgumentError(
        f"unknown op {op!r}: 'matmul_backward', 'linear_backward' or "
        f"'fused_linear_gelu_backward'")


def _sum_to(v: np.ndarray, shape: Tuple[int, ...]) -> np.ndarray:
    """v summed over the leading axes that `shape` broadcasts (NumPy's rule, reversed)."""
    lead = v.ndim - len(shape)
    v = v.sum(axis=tuple(range(lead))) if lead else v
    axes = tuple(i for i, d in enumerate(shape) if d == 1 and v.shape[i] != 1)
    return v.sum(axis=axes, keepdims=True) if axes else v


# -- helpers ------------------------------------------------------------------------------
def _view(t: CudaTensor, shape: Tuple[int, ...]) -> CudaTensor:
    """The same memory under another C-contiguous shape of as many elements (no copy)."""
    if shape == t.shape:
        return t
    view = CudaTensor(shape, t.dtype, t.device_id, t.ptr, owner=t)
    view._host = None if t._host is None else t._host.reshape(shape)
    view.on_host = t.on_host
    view.stream = t.stream
    return view


def _free(*tensors: Optional[CudaTensor]) -> None:
    for t in tensors:
        if t is not None:
            t.free()


def _check_bool(v: Any, name: str) -> bool:
    if type(v) is not bool:
        raise InvalidArgumentError(f"{name} must be True or False, got {v!r}")
    return v


def _layer_shapes(name: str, g: CudaTensor, x: CudaTensor,
                  w: CudaTensor) -> Tuple[int, int, int]:
    """(rows, in, out) of a linear layer's gradient call: weight (out, in), x (..., in),
    grad_out (..., out) with x's leading dimensions."""
    if w.ndim != 2:
        raise ShapeMismatchError(
            f"{name}: weight must be (out_features, in_features), got {w.shape}")
    out_f, in_f = w.shape
    if x.ndim < 1 or x.shape[-1] != in_f:
        raise ShapeMismatchError(
            f"{name}: x of shape {x.shape} does not match weight of shape {w.shape}: x's last "
            f"dimension must equal in_features = {in_f}")
    want = x.shape[:-1] + (out_f,)
    if g.shape != want:
        raise ShapeMismatchError(
            f"{name}: grad_out has shape {g.shape}, expected {want} (x's leading dimensions "
            f"{x.shape[:-1]} and out_features = {out_f})")
    return math.prod(x.shape[:-1]), in_f, out_f


def _check_layer(name: str, grad_out: Any, x: Any, weight: Any, bias: Any,
                 precision: Any) -> Tuple[int, int, int]:
    """The operands of a linear layer's gradient: live float tensors of one dtype and
    device, the shapes of _layer_shapes, bias (out,) or None, a known precision."""
    g = common.check_tensor(grad_out, "grad_out")
    xt = common.check_tensor(x, "x")
    w = common.check_tensor(weight, "weight")
    ops = [g, xt, w]
    if bias is not None:
        ops.append(common.check_tensor(bias, "bias"))
    dtype = common.same_dtype(*ops)
    common.require_dtype(g, common.FLOATS, name)
    common.same_device(*ops)
    mm.normalize_precision(precision, dtype)
    dims = _layer_shapes(name, g, xt, w)
    if bias is not None and bias.shape != (w.shape[0],):
        raise ShapeMismatchError(
            f"{name}: bias must have shape ({w.shape[0]},), got {bias.shape}")
    return dims


def _plan_ok(m: Any) -> bool:
    plans = getattr(m, "plans", None)
    return plans is not None and m.gpu and hasattr(m.backend, "prepare_launch")


def _sub(m: Any, key: tuple, general: Callable) -> Callable:
    """A step of a composed plan: the plan under key (a matmul / matmul_tn / matmul_nt
    plan, taking (a, b, None)) where one was made, else the general function."""
    plan = m.plans.get(key)
    if plan is not None:
        return plan

    def call(a: CudaTensor, b: CudaTensor, _: Any) -> Optional[CudaTensor]:
        return general(m, a, b)
    return call


# -- linear layers --------------------------------------------------------------------------
def linear_backward(m: Any, grad_out: CudaTensor, x: CudaTensor, weight: CudaTensor,
                    has_bias: bool = True, precision: Optional[str] = None) -> Grads:
    """The gradients of y = x Wᵀ + b (x (..., in), weight (out, in), grad_out (..., out)):
    (grad_x = G W, grad_weight = Gᵀ x, grad_bias = the column sums of G, or None with
    has_bias=False). float32 is float32-accurate by default (3xTF32 or CUDA cores),
    precision="ieee" CUDA cores only, "tf32" TF32."""
    key = layer_plan_key("linear_backward", grad_out, x, weight, has_bias, precision)
    if key is not None:
        fast = getattr(m, "plans", {}).get(key)
        if fast is not None and m.backend.direct_launch(grad_out.device_id):
            res = fast(grad_out, x, weight)
            if res is not None:
                return res
    _check_bool(has_bias, "has_bias")
    rows, in_f, out_f = _check_layer("linear_backward", grad_out, x, weight, None, precision)
    g2 = _view(grad_out, (rows, out_f))
    x2 = _view(x, (rows, in_f))
    res = _layer_grads(m, g2, x2, weight, has_bias, precision, x.shape)
    if key is not None and _plan_ok(m):
        common.remember_plan(m, key, _layer_plan(m, key, rows, in_f, out_f, has_bias,
                                                 precision, x.shape))
    return res


def fused_linear_gelu_backward(m: Any, grad_out: CudaTensor, x: CudaTensor,
                               weight: CudaTensor, bias: Optional[CudaTensor] = None,
                               precision: Optional[str] = None) -> Grads:
    """The gradients of y = GELU(x Wᵀ + b) (tanh form, fused_linear_gelu): dZ = G GELU'(z)
    from one recompute of z = x Wᵀ + b whose epilogue reads G (z is never stored), then
    (grad_x = dZ W, grad_weight = dZᵀ x, grad_bias = the column sums of dZ, None without a
    bias). The recompute runs as fused_linear_gelu, the gradient GEMMs as matrix_multiply
    (float32-accurate by default: 3xTF32 or CUDA cores; "ieee": CUDA cores); "tf32": TF32."""
    key = layer_plan_key("fused_linear_gelu_backward", grad_out, x, weight, bias, precision)
    if key is not None:
        fast = getattr(m, "plans", {}).get(key)
        if fast is not None and m.backend.direct_launch(grad_out.device_id):
            res = fast(grad_out, x, weight, bias)
            if res is not None:
                return res
    rows, in_f, out_f = _check_layer("fused_linear_gelu_backward", grad_out, x, weight, bias,
                                     precision)
    g2 = _view(grad_out, (rows, out_f))
    x2 = _view(x, (rows, in_f))
    dz = mm.linear(m, x2, weight, bias, mm.GRAD_EPILOGUE, precision, grad=g2)
    try:
        res = _layer_grads(m, dz, x2, weight, bias is not None, precision, x.shape)
        if key is not None and _plan_ok(m) and dz.size:
            # the recompute's plan (matmul.remember): dZ's allocation and the launch of the
            # config mm.linear memoized for this alignment class
            dtype, dev = x.dtype, x.device_id
            p = mm.Plan(1, rows, out_f, in_f, 0, 0, (rows, out_f))
            mm.remember(m, _recompute_key(key), p, dtype,
                        mm.normalize_precision(precision, dtype), dev,
                        mm.is_vec_ok(x2, weight, dz, p), p.out_shape, mm.GRAD_EPILOGUE)
    finally:
        dz.free()   # back to the pool; the launches reading it are ordered before reuse
    if key is not None and _plan_ok(m):
        common.remember_plan(m, key, _layer_plan(m, key, rows, in_f, out_f, bias is not None,
                                                 precision, x.shape))
    return res


def _recompute_key(key: tuple) -> tuple:
    """The m.plans key of fused_linear_gelu_backward's recompute (dZ from x, W, b and G),
    from the op's own key."""
    return ("bias_gelu_grad",) + key[1:]


def _layer_grads(m: Any, g2: CudaTensor, x2: CudaTensor, w: CudaTensor, with_bias: bool,
                 precision: Optional[str], x_shape: Tuple[int, ...]) -> Grads:
    """(g2 W viewed as x_shape, g2ᵀ x2, the column sums of g2 or None); results already
    made are freed if a later step raises."""
    from . import reduction as red
    gx = gw = None
    try:
        gx = mm.matmul(m, g2, w, precision)
        gw = mm.matmul_tn(m, g2, x2, precision)
        gb = red.reduce(m, "sum", g2, axis=0) if with_bias else None
    except BaseException:
        _free(gx, gw)
        raise
    return _view(gx, x_shape), gw, gb


def layer_plan_key(name: str, g: Any, x: Any, w: Any, bias: Any,
                   precision: Any) -> Optional[tuple]:
    """The plan key of a linear layer's gradient: every operand's shape, dtype and device,
    the bias (linear_backward: has_bias, a bool; fused: the bias tensor's shape, dtype and
    device, or None) and the precision as given; None where no plan applies."""
    if type(g) is not CudaTensor or type(x) is not CudaTensor or type(w) is not CudaTensor \
            or not (precision is None or type(precision) is str):
        return None
    if type(bias) is bool or bias is None:
        b: Any = bias
    elif type(bias) is CudaTensor:
        b = (bias.shape, bias.dtype, bias.device_id)
    else:
        return None
    return (name, g.shape, x.shape, w.shape, g.dtype, x.dtype, w.dtype, g.device_id,
            x.device_id, w.device_id, b, precision)


def _layer_plan(m: Any, key: tuple, rows: int, in_f: int, out_f: int, with_bias: bool,
                precision: Optional[str], x_shape: Tuple[int, ...]) -> Any:
    """The per-call plan of linear_backward (key[0] "linear_backward") or
    fused_linear_gelu_backward: the general path's steps without its checks, through the
    plans its first call made (the recompute's, matmul's, matmul_tn's); the reduction's own
    plan is looked up by reduction.reduce. None (general path) where a step steps aside."""
    from . import reduction as red
    fused = key[0] == "fused_linear_gelu_backward"
    dt, dev = key[4], key[7]
    g2s, x2s, ws = (rows, out_f), (rows, in_f), (out_f, in_f)
    grad_in = _sub(m, ("matmul", g2s, ws, dt, dt, dev, dev, precision),
                   lambda m_, a, b: mm.matmul(m_, a, b, precision))
    grad_w = _sub(m, ("matmul_tn", g2s, x2s, dt, dt, dev, dev, precision),
                  lambda m_, a, b: mm.matmul_tn(m_, a, b, precision))
    recompute = m.plans.get(_recompute_key(key)) if fused else None

    def plan(g: CudaTensor, x: CudaTensor, w: CudaTensor,
             b: Optional[CudaTensor] = None) -> Optional[Grads]:
        if g._ptr is None or x._ptr is None:
            return None   # (the general path raises TensorFreedError)
        g2 = _view(g, g2s)
        x2 = _view(x, x2s)
        if fused:
            if recompute is None:
                return None
            dz = recompute(x2, w, b, g2)
            if dz is None:
                return None
        else:
            dz = g2
        gx = gw = None
        try:
            gx = grad_in(dz, w, None)
            if gx is None:
                return None
            gw = grad_w(dz, x2, None)
            if gw is None:
                gx.free()
                return None
            gb = red.reduce(m, "sum", dz, axis=0) if with_bias else None
        except BaseException:
            _free(gx, gw)
            raise
        finally:
            if fused:
                dz.free()
        return _view(gx, x_shape), gw, gb
    return plan


# -- matrix multiply ------------------------------------------------------------------------
def matmul_backward(m: Any, grad_out: CudaTensor, a: CudaTensor, b: CudaTensor,
                    precision: Optional[str] = None) -> Tuple[CudaTensor, CudaTensor]:
    """The gradients of matrix_multiply(a, b) (NumPy's matmul shapes: 2-D, batched with full
    or broadcast batches, 1-D operands): (grad_a = G bᵀ, grad_b = aᵀ G), each of its
    operand's shape; an operand broadcast over the batch gets the sum over the batch.
    float32 is float32-accurate by default (3xTF32 or CUDA cores), precision="ieee" CUDA
    cores only, "tf32" TF32."""
    key = matmul_plan_key(grad_out, a, b, precision)
    if key is not None:
        fast = getattr(m, "plans", {}).get(key)
        if fast is not None and m.backend.direct_launch(grad_out.device_id):
            res = fast(grad_out, a, b)
            if res is not None:
                return res
    g = common.check_tensor(grad_out, "grad_out")
    common.check_tensor(a, "a")
    common.check_tensor(b, "b")
    dtype = common.same_dtype(g, a, b)
    common.require_dtype(g, common.FLOATS, "matmul_backward")
    common.same_device(g, a, b)
    mm.normalize_precision(precision, dtype)
    p = mm.plan_shapes(a.shape, b.shape)
    if g.shape != p.out_shape:
        raise ShapeMismatchError(
            f"matmul_backward: grad_out has shape {g.shape}, expected {p.out_shape} (the "
            f"shape of a {a.shape} @ b {b.shape})")
    steps = _mm_steps(p)
    res = _mm_run(m, steps, g, a, b, precision)
    if key is not None and _plan_ok(m):
        common.remember_plan(m, key, _mm_plan(m, steps, precision, key))
    return res


def _mm_steps(p: mm.Plan) -> Dict[str, Any]:
    """The views and products of matmul_backward for a plan: grad_a = G (batch, M, N) @ b
    (Bb, K, N)ᵀ (batched; summed over the batch where a is broadcast), grad_b = a (Ba, M, K)ᵀ
    @ G (batched), or, where b is broadcast, a (batch M, K)ᵀ @ G (batch M, N)."""
    B, M, N, K = p.batch, p.M, p.N, p.K
    full_a, full_b = p.stride_a != 0, p.stride_b != 0
    g3: Tuple[int, ...]
    a_shape: Tuple[int, ...]
    b_shape: Tuple[int, ...]
    gb_a: Tuple[int, ...]
    gb_g: Tuple[int, ...]
    if B == 1:
        g3 = (M, N)
        a_shape, b_shape = (M, K), (K, N)
        sum_a = False
        gb_a, gb_g = (M, K), (M, N)
    else:
        g3 = (B, M, N)
        a_shape = (B, M, K) if full_a else (M, K)
        b_shape = (B, K, N) if full_b else (K, N)
        sum_a = not full_a          # (then b is full: a broadcast batch needs one)
        if full_b:
            gb_a, gb_g = a_shape, g3
        else:                       # one GEMM over the stacked rows of a full a
            gb_a, gb_g = (B * M, K), (B * M, N)
    return {"g": g3, "a": a_shape, "b": b_shape, "sum_a": sum_a, "gb_a": gb_a, "gb_g": gb_g}


def _mm_run(m: Any, st: Dict[str, Any], g: CudaTensor, a: CudaTensor, b: CudaTensor,
            precision: Optional[str]) -> Tuple[CudaTensor, CudaTensor]:
    """The two products (and the batch sum) of matmul_backward; results already made are
    freed if a later step raises."""
    from . import reduction as red
    ga = gb = work = None
    try:
        work = mm.matmul_nt(m, _view(g, st["g"]), _view(b, st["b"]), precision)
        if st["sum_a"]:
            ga = red.reduce(m, "sum", work, axis=0)
            work.free()
        else:
            ga = work
        work = None
        gb = mm.matmul_tn(m, _view(a, st["gb_a"]), _view(g, st["gb_g"]), precision)
    except BaseException:
        _free(work, ga, gb)
        raise
    return _view(ga, a.shape), _view(gb, b.shape)


def matmul_plan_key(g: Any, a: Any, b: Any, precision: Any) -> Optional[tuple]:
    """matmul_backward's plan key: every operand's shape, dtype and device, and the precision
    as given; None where no plan applies."""
    if type(g) is not CudaTensor or type(a) is not CudaTensor or type(b) is not CudaTensor \
            or not (precision is None or type(precision) is str):
        return None
    return ("matmul_backward", g.shape, a.shape, b.shape, g.dtype, a.dtype, b.dtype,
            g.device_id, a.device_id, b.device_id, precision)


def _mm_plan(m: Any, st: Dict[str, Any], precision: Optional[str], key: tuple) -> Any:
    """The per-call plan of matmul_backward: its steps through the plans of matmul_nt and
    matmul_tn its first call made (the batch sum through reduction.reduce, which looks up
    its own); None (general path) where a step steps aside."""
    from . import reduction as red
    dt, dev = key[4], key[7]
    nt = _sub(m, ("matmul_nt", st["g"], st["b"], dt, dt, dev, dev, precision),
              lambda m_, x, y: mm.matmul_nt(m_, x, y, precision))
    tn = _sub(m, ("matmul_tn", st["gb_a"], st["gb_g"], dt, dt, dev, dev, precision),
              lambda m_, x, y: mm.matmul_tn(m_, x, y, precision))
    g3, b3, gba, gbg, sum_a = st["g"], st["b"], st["gb_a"], st["gb_g"], st["sum_a"]

    def plan(g: CudaTensor, a: CudaTensor, b: CudaTensor) -> Optional[Tuple[CudaTensor, ...]]:
        if g._ptr is None or a._ptr is None or b._ptr is None:
            return None   # (the general path raises TensorFreedError)
        work = nt(_view(g, g3), _view(b, b3), None)
        if work is None:
            return None
        ga = None
        try:
            if sum_a:
                ga = red.reduce(m, "sum", work, axis=0)
                work.free()
            else:
                ga = work
            work = None
            gb = tn(_view(a, gba), _view(g, gbg), None)
        except BaseException:
            _free(work, ga)
            raise
        if gb is None:
            ga.free()
            return None
        return _view(ga, a.shape), _view(gb, b.shape)
    return plan
