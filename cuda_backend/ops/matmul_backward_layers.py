"""The linear layers' gradients: `linear_backward` (y = x Wᵀ + b) and
`fused_linear_gelu_backward` (y = GELU(x Wᵀ + b), tanh form: dZ from one recompute of z
whose epilogue reads G), their operand checks and per-call plans. The GEMMs and the
precision rules are ops/matmul_backward.py's module doc.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

from ..errors import InvalidArgumentError, ShapeMismatchError
from ..tensor import CudaTensor
from . import common
from . import matmul as mm
from . import matmul_grouped as grouped
from .matmul_backward_steps import Grads, free_all, plan_ok, plan_step, run_plan, view


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
    common.normalize_precision(precision, dtype)
    dims = _layer_shapes(name, g, xt, w)
    if bias is not None and bias.shape != (w.shape[0],):
        raise ShapeMismatchError(
            f"{name}: bias must have shape ({w.shape[0]},), got {bias.shape}")
    return dims


# -- linear layers --------------------------------------------------------------------------
def linear_backward(m: Any, grad_out: CudaTensor, x: CudaTensor, weight: CudaTensor,
                    has_bias: bool = True, precision: Optional[str] = None) -> Grads:
    """The gradients of y = x Wᵀ + b (x (..., in), weight (out, in), grad_out (..., out)):
    (grad_x = G W, grad_weight = Gᵀ x, grad_bias = the column sums of G, or None with
    has_bias=False). float32 is float32-accurate by default (3xTF32 or CUDA cores),
    precision="ieee" CUDA cores only, "tf32" TF32."""
    key = layer_plan_key("linear_backward", grad_out, x, weight, has_bias, precision)
    res = run_plan(m, key, grad_out, x, weight)
    if res is not None:
        return res
    _check_bool(has_bias, "has_bias")
    rows, in_f, out_f = _check_layer("linear_backward", grad_out, x, weight, None, precision)
    g2 = view(grad_out, (rows, out_f))
    x2 = view(x, (rows, in_f))
    res = _layer_grads(m, g2, x2, weight, has_bias, precision, x.shape)
    if key is not None and plan_ok(m):
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
    res = run_plan(m, key, grad_out, x, weight, bias)
    if res is not None:
        return res
    rows, in_f, out_f = _check_layer("fused_linear_gelu_backward", grad_out, x, weight, bias,
                                     precision)
    g2 = view(grad_out, (rows, out_f))
    x2 = view(x, (rows, in_f))
    dz = mm.linear(m, x2, weight, bias, mm.GRAD_EPILOGUE, precision, grad=g2)
    try:
        res = _layer_grads(m, dz, x2, weight, bias is not None, precision, x.shape)
        if key is not None and plan_ok(m) and dz.size:
            # the recompute's plan (matmul.remember): dZ's allocation and the launch of the
            # config mm.linear memoized for this alignment class
            dtype, dev = x.dtype, x.device_id
            p = mm.Plan(1, rows, out_f, in_f, 0, 0, (rows, out_f))
            mm.remember(m, _recompute_key(key), p, dtype,
                        common.normalize_precision(precision, dtype), dev,
                        mm.is_vec_ok(x2, weight, dz, p), p.out_shape, mm.GRAD_EPILOGUE)
    finally:
        dz.free()   # back to the pool; the launches reading it are ordered before reuse
    if key is not None and plan_ok(m):
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
    rows, out_f = g2.shape
    grp = grouped.for_products(m, g2.dtype, g2.device_id, precision,
                               grouped.linear_products(rows, w.shape[1], out_f),
                               (rows, out_f) if with_bias else (0, 0))
    if grp is not None:
        return _grouped_grads(m, grp, g2, x2, w, with_bias, x_shape)
    gx = gw = None
    try:
        gx = mm.matmul(m, g2, w, precision)
        gw = mm.matmul_tn(m, g2, x2, precision)
        gb = red.reduce(m, "sum", g2, axis=0) if with_bias else None
    except BaseException:
        free_all(gx, gw)
        raise
    return view(gx, x_shape), gw, gb


def _grouped_grads(m: Any, grp: grouped.Grouped, g2: CudaTensor, x2: CudaTensor,
                   w: CudaTensor, with_bias: bool, x_shape: Tuple[int, ...]) -> Grads:
    """_layer_grads in one grouped launch (ops/matmul_grouped.py)."""
    backend, dt, dev = m.backend, g2.dtype, g2.device_id
    out_f, in_f = w.shape
    gx = gw = gb = None
    try:
        gx = backend.empty((g2.shape[0], in_f), dt, dev)
        gw = backend.empty((out_f, in_f), dt, dev)
        gb = backend.empty((out_f,), dt, dev) if with_bias else None
        grp.launch(m, (g2, w, gx, g2, x2, gw, g2 if with_bias else 0,
                       gb if gb is not None else 0))
    except BaseException:
        free_all(gx, gw, gb)
        raise
    return view(gx, x_shape), gw, gb


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
    grp = grouped.for_products(m, dt, dev, precision,
                               grouped.linear_products(rows, in_f, out_f),
                               (rows, out_f) if with_bias else (0, 0))
    if grp is not None:
        return _grouped_layer_plan(m, grp, fused, key, g2s, x2s, with_bias, x_shape)
    grad_in = plan_step(m, ("matmul", g2s, ws, dt, dt, dev, dev, precision),
                        lambda m_, a, b: mm.matmul(m_, a, b, precision))
    grad_w = plan_step(m, ("matmul_tn", g2s, x2s, dt, dt, dev, dev, precision),
                       lambda m_, a, b: mm.matmul_tn(m_, a, b, precision))
    recompute = m.plans.get(_recompute_key(key)) if fused else None

    def plan(g: CudaTensor, x: CudaTensor, w: CudaTensor,
             b: Optional[CudaTensor] = None) -> Optional[Grads]:
        if g._ptr is None or x._ptr is None:
            return None   # (the general path raises TensorFreedError)
        g2 = view(g, g2s)
        x2 = view(x, x2s)
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
            free_all(gx, gw)
            raise
        finally:
            if fused:
                dz.free()
        return view(gx, x_shape), gw, gb
    return plan


def _grouped_layer_plan(m: Any, grp: grouped.Grouped, fused: bool, key: tuple,
                        g2s: Tuple[int, int], x2s: Tuple[int, int], with_bias: bool,
                        x_shape: Tuple[int, ...]) -> Any:
    """_layer_plan where one grouped launch makes the three gradients (the general path's
    launch: _grouped_grads), after the recompute's plan for the fused layer."""
    run = grp.prepared(m)
    rows, out_f = g2s
    in_f = x2s[1]
    shapes = [(rows, in_f), (out_f, in_f)] + ([(out_f,)] if with_bias else [])
    new = grouped.outputs_maker(m, grp.dev, grp.dtype, shapes)
    recompute = m.plans.get(_recompute_key(key)) if fused else None

    def plan(g: CudaTensor, x: CudaTensor, w: CudaTensor,
             b: Optional[CudaTensor] = None) -> Optional[Grads]:
        px, pw = x._ptr, w._ptr
        if g._ptr is None or px is None or pw is None or x.stream is not None \
                or w.stream is not None or g.stream is not None:
            return None   # (the general path raises TensorFreedError, or orders the streams)
        dz = g
        if fused:
            if recompute is None:
                return None
            dz = recompute(view(x, x2s), w, b, view(g, g2s))
            if dz is None:
                return None
        try:
            outs = new()
            pz = dz._ptr
            gb = outs[2] if with_bias else None
            try:
                run(pz, pw, outs[0]._ptr, pz, px, outs[1]._ptr, pz if with_bias else 0,
                    gb._ptr if gb is not None else 0)
            except BaseException:
                free_all(*outs)
                raise
        finally:
            if fused:
                dz.free()
        return view(outs[0], x_shape), outs[1], gb
    return plan
