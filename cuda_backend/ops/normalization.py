"""Batch normalization and layer normalization (`templates/batch_norm.cu.j2`,
`templates/layer_norm.cu.j2`).

batch_norm: input (N, C), (N, C, L) or (N, C, H, W), per-channel gamma, beta, running mean and
variance of shape (C,), all of the input's dtype. Inference is one pass (one read, one write).
Training (PyTorch semantics) normalizes with the batch mean and biased variance and updates
the running statistics in place with the unbiased variance; it costs a statistics pass (one
read), a tiny per-channel finalize and the normalize pass (one read, one write).

layer_norm: over the last axis with optional weight and bias of shape (D,). Rows that fit in
registers are read once (warp per row up to 32*vpt vectors, block per row beyond, optionally
persistent blocks that prefetch their next row); longer rows take a looping kernel. Among the
register configs that hold a row equally tightly, the autotuner picks for large inputs.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..tensor import CudaTensor
from . import common
from .batch_norm_plans import BN_TEMPLATE, bn_call_plan, bn_geometry, bn_launch, bn_params
from .layer_norm_plans import (LN_LOOP_BLOCK, LN_PREFETCH_CONFIGS, LN_SCALAR_CONFIGS,
                               LN_TEMPLATE, LN_VEC_CONFIGS, ln_call_plan, ln_candidates,
                               ln_geometry, ln_launch, ln_params, ln_pick)
from .normalization_common import DT, DTYPES, bn_layout, vec_width

TEMPLATES = (BN_TEMPLATE, LN_TEMPLATE)


# -- the family contract (registry.CONTRACT) ------------------------------------------
def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set batch_norm and layer_norm render."""
    bn, ln = [], []
    for dt in DTYPES:
        for layout in ("nc", "ncs"):
            for mode in ("infer", "train"):
                bn.append(bn_params(dt, "normalize", layout, mode))
            bn.append(bn_params(dt, "stats", layout))
            if layout == "ncs":
                bn.append(bn_params(dt, "fused", layout))
        bn.append(bn_params(dt, "finalize"))
        for tpr, vpt, block in LN_VEC_CONFIGS:
            ln.append(ln_params(dt, tpr, vpt, block, vec_width(dt)))
        for tpr, vpt, block in LN_PREFETCH_CONFIGS:
            ln.append(ln_params(dt, tpr, vpt, block, vec_width(dt), True))
        for tpr, vpt, block in LN_SCALAR_CONFIGS:
            ln.append(ln_params(dt, tpr, vpt, block, 1))
        for vec in (vec_width(dt), 1):
            ln.append(ln_params(dt, LN_LOOP_BLOCK, 0, LN_LOOP_BLOCK, vec))
    return {BN_TEMPLATE: bn, LN_TEMPLATE: ln}


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every batch_norm and layer_norm variant in parallel threads (nvcc runs in
    subprocesses); returns how many were compiled (0 in fallback mode)."""
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets]
    return common.compile_all(m, jobs, device_id, workers)


def reference(op: str, x: Any, *params: Any, eps: float = 1e-5,
              training: bool = False) -> np.ndarray:
    """float64 NumPy of op "batch_norm", params (gamma, beta, mean, var) per channel (axis 1;
    training=True normalizes with the batch mean and biased variance, as PyTorch; the running
    statistics' update is not modelled), or "layer_norm", params (weight, bias) over the last
    axis (either None or left out)."""
    a = np.asarray(x, dtype=np.float64)
    vals = [None if v is None else np.asarray(v, dtype=np.float64) for v in params]
    with np.errstate(all="ignore"):
        if op == "batch_norm":
            gamma, beta, mean, var = vals
            shape = (1, a.shape[1]) + (1,) * (a.ndim - 2)
            if training:
                axes = (0,) + tuple(range(2, a.ndim))
                mean, var = a.mean(axis=axes), a.var(axis=axes)
            assert gamma is not None and beta is not None and mean is not None and \
                var is not None, "batch_norm takes (gamma, beta, mean, var)"
            return (a - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) \
                * gamma.reshape(shape) + beta.reshape(shape)
        if op == "layer_norm":
            weight, bias = (vals + [None, None])[:2]
            d = a - a.mean(axis=-1, keepdims=True)
            y = d / np.sqrt((d * d).mean(axis=-1, keepdims=True) + eps)
            y = y if weight is None else y * weight
            return y if bias is None else y + bias
    raise InvalidArgumentError(f"unknown normalization {op!r}: 'batch_norm' or 'layer_norm'")


candidates = ln_candidates   # the registry's contract name: layer_norm's autotuned configs


# -- batch norm ----------------------------------------------------------------------------
def batch_norm(m: Any, x: CudaTensor, gamma: CudaTensor, beta: CudaTensor, mean: CudaTensor,
               var: CudaTensor, eps: float = 1e-5, training: bool = False,
               momentum: float = 0.1, out: Optional[CudaTensor] = None) -> CudaTensor:
    """Batch normalization per channel (axis 1); see the module docstring. out= (internal,
    tests) receives the result instead of a new tensor."""
    if out is None and type(x) is CudaTensor and type(eps) is float and \
            type(momentum) is float and type(training) is bool:
        # the per-call plan (ops/common.py remember_plan); float eps and momentum only (no
        # equal-valued bool reaches it unchecked), bool training (hashable)
        key = ("batch_norm", x.shape, x.dtype, x.device_id, eps, momentum, training)
        direct = m.backend.direct_launch(x.device_id)
        res = common.planned(m, key, x, gamma, beta, mean, var) if direct else None
        if res is not None:
            return res
    dev, eps, momentum = _bn_checks(x, gamma, beta, mean, var, eps, momentum, training, out)
    if not m.gpu:
        return _bn_host(m, x, gamma, beta, mean, var, eps, training, momentum, out)
    owned = out is None
    if out is None:     # (owned)
        out = m.backend.empty(x.shape, x.dtype, dev)
    if x.size == 0:
        return out
    N, C, S, count, layout, vec, can_vec = bn_layout(x.shape, x.dtype)
    aligned = x.ptr % 16 == 0 and out.ptr % 16 == 0
    vec_ok = int(aligned and can_vec)
    sm = m.backend.get_device_info(dev).multiprocessor_count
    geo = bn_geometry(layout, N, C, S, vec_ok, vec, sm, bool(training))
    bn_launch(m, geo, layout, training, x, out, gamma, beta, mean, var, eps, momentum, C, S,
              count)
    if owned and type(training) is bool:
        key = ("batch_norm", x.shape, x.dtype, dev, eps, momentum, training)
        if key not in m.plans:
            common.remember_plan(m, key, bn_call_plan(m, x, eps, momentum, bool(training), sm))
    return out


def _bn_checks(x: CudaTensor, gamma: CudaTensor, beta: CudaTensor, mean: CudaTensor,
               var: CudaTensor, eps: Any, momentum: Any, training: Any,
               out: Optional[CudaTensor]) -> Tuple[int, float, float]:
    """batch_norm's argument checks, in order: (device, eps, momentum)."""
    common.check_tensor(x, "input")
    for t, name in ((gamma, "gamma"), (beta, "beta"), (mean, "mean"), (var, "var")):
        common.check_tensor(t, name)
    if x.ndim not in (2, 3, 4):
        raise InvalidArgumentError(
            f"batch_norm needs an (N, C), (N, C, L) or (N, C, H, W) input, got shape {x.shape}")
    C = x.shape[1]
    for t, name in ((gamma, "gamma"), (beta, "beta"), (mean, "mean"), (var, "var")):
        if t.shape != (C,):
            raise ShapeMismatchError(
                f"batch_norm: {name} has shape {t.shape}, expected ({C},) for the {C} channels "
                f"of the input of shape {x.shape}")
    common.require_dtype(x, DTYPES, "batch_norm")
    common.same_dtype(x, gamma, beta, mean, var)
    dev = common.same_device(x, gamma, beta, mean, var)
    eps = _real(eps, "eps", minimum=0.0)
    momentum = _real(momentum, "momentum")
    count = bn_layout(x.shape, x.dtype)[3]     # values per channel
    if training and C > 0 and count <= 1:
        raise InvalidArgumentError(
            f"batch_norm training needs more than 1 value per channel, got input shape "
            f"{x.shape} ({count} per channel)")
    if out is not None:
        common.check_out(out, x, x.shape)
    return dev, eps, momentum


def _bn_host(m: Any, x: CudaTensor, gamma: CudaTensor, beta: CudaTensor, mean: CudaTensor,
             var: CudaTensor, eps: float, training: bool, momentum: float,
             out: Optional[CudaTensor]) -> CudaTensor:
    work = _work_type(x.dtype)
    a = common.host_array(m, x).astype(work)
    C = x.shape[1]
    bshape = (1, C) + (1,) * (x.ndim - 2)
    g, b = (common.host_array(m, t).astype(work) for t in (gamma, beta))
    if training and a.size:
        axes = (0,) + tuple(range(2, x.ndim))
        a64 = a.astype(np.float64)
        mu = a64.mean(axis=axes)
        v = a64.var(axis=axes)
        n = a.size // max(C, 1)
        rm = common.host_array(m, mean).astype(np.float64)
        rv = common.host_array(m, var).astype(np.float64)
        common.write_host(m, (1 - momentum) * rm + momentum * mu, mean)
        common.write_host(m, (1 - momentum) * rv + momentum * v * n / (n - 1), var)
        scale = (g.astype(np.float64) / np.sqrt(v + eps)).astype(work)
        y = (a - mu.astype(work).reshape(bshape)) * scale.reshape(bshape) + b.reshape(bshape)
    else:
        mu = common.host_array(m, mean).astype(work)
        v = common.host_array(m, var).astype(work)
        scale = g / np.sqrt(v + work(eps))
        y = (a - mu.reshape(bshape)) * scale.reshape(bshape) + b.reshape(bshape)
    if out is None:
        return common.from_host(m, y, x.dtype, x.device_id)
    common.write_host(m, y, out)
    return out


# -- layer norm ----------------------------------------------------------------------------
def layer_norm(m: Any, x: CudaTensor, weight: Optional[CudaTensor],
               bias: Optional[CudaTensor], eps: float = 1e-5,
               out: Optional[CudaTensor] = None) -> CudaTensor:
    """Layer normalization over the last axis; weight/bias (D,) or None."""
    if out is None and type(x) is CudaTensor and type(eps) is float:
        # the per-call plan (ops/common.py remember_plan); float eps only, so that no
        # equal-valued bool reaches it unchecked
        key = ("layer_norm", x.shape, x.dtype, x.device_id, eps, weight is None, bias is None)
        direct = m.backend.direct_launch(x.device_id)
        res = common.planned(m, key, x, weight, bias) if direct else None
        if res is not None:
            return res
    common.check_tensor(x, "x")
    if x.ndim < 1:
        raise InvalidArgumentError(f"layer_norm needs at least 1 dimension, got shape {x.shape}")
    D = x.shape[-1]
    tensors = [x]
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t is None:
            continue
        common.check_tensor(t, name)
        if t.shape != (D,):
            raise ShapeMismatchError(
                f"layer_norm: {name} has shape {t.shape}, expected ({D},) for the last "
                f"dimension of x of shape {x.shape}")
        tensors.append(t)
    common.require_dtype(x, DTYPES, "layer_norm")
    common.same_dtype(*tensors)
    dev = common.same_device(*tensors)
    eps = _real(eps, "eps", minimum=0.0)
    if D >= 2**31 - 2**16:
        raise InvalidArgumentError(f"layer_norm supports rows under 2^31 elements, got {D}")
    if out is not None:
        common.check_out(out, x, x.shape)
    if not m.gpu:
        return _ln_host(m, x, weight, bias, eps, out)
    owned = out is None
    if out is None:     # (owned)
        out = m.backend.empty(x.shape, x.dtype, dev)
    if x.size == 0:
        return out
    rows = x.size // D
    vec = vec_width(x.dtype)
    ptrs = [x.ptr, out.ptr] + [t.ptr for t in (weight, bias) if t is not None]
    use_vec = D % vec == 0 and all(p % 16 == 0 for p in ptrs)
    cfg = ln_pick(m, x, out, weight, bias, rows, D, eps, use_vec)
    ln_launch(m, cfg, x, out, weight, bias, rows, D, eps)
    if owned:
        key = ("layer_norm", x.shape, x.dtype, dev, eps, weight is None, bias is None)
        plan = m.plans.get(key)
        if not hasattr(plan, "variants"):
            plan = common.remember_plan(m, key, ln_call_plan(m, x, weight is not None,
                                                             bias is not None, eps))
        if use_vec not in plan.variants:  # the config the autotuner picked, if it did
            kernel, grid, block = ln_geometry(m, cfg, x.dtype, dev, rows)
            plan.variants[use_vec] = m.backend.prepare_launch(kernel, (grid, 1, 1),
                                                              (block, 1, 1), 0, dev)
    return out


def _ln_host(m: Any, x: CudaTensor, weight: Optional[CudaTensor], bias: Optional[CudaTensor],
             eps: float, out: Optional[CudaTensor]) -> CudaTensor:
    work = _work_type(x.dtype)
    a = common.host_array(m, x).astype(work)
    if a.size == 0:
        y = a
    else:
        with np.errstate(all="ignore"):  # NaN/inf rows give NaN, as on the GPU
            y = _ln_rows(a, weight, bias, eps, m, work)
    if out is None:
        return common.from_host(m, y, x.dtype, x.device_id)
    common.write_host(m, y, out)
    return out


def _ln_rows(a: np.ndarray, weight: Optional[CudaTensor], bias: Optional[CudaTensor],
             eps: float, m: Any, work: Any) -> np.ndarray:
    """Layer norm of the rows of a in the working precision (the fallback)."""
    mu = a.mean(axis=-1, keepdims=True)
    d = a - mu
    var = (d * d).mean(axis=-1, keepdims=True)
    y = d / np.sqrt(var + work(eps))
    if weight is not None:
        y = y * common.host_array(m, weight).astype(work)
    if bias is not None:
        y = y + common.host_array(m, bias).astype(work)
    return y


# -- helpers -------------------------------------------------------------------------------
def _real(value: Any, name: str, minimum: Optional[float] = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or (minimum is not None and v < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise InvalidArgumentError(f"{name} must be a finite number{bound}, got {value!r}")
    return v


def _work_type(dtype: CudaDataType) -> Any:
    return np.float64 if dtype is DT.FLOAT64 else np.float32
