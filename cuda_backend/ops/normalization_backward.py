"""Layer normalization and batch normalization backward (`templates/layer_norm_backward.cu.j2`,
`templates/batch_norm_backward.cu.j2`): the gradients of ops/normalization.py's forwards with
respect to the input and the affine parameters. The statistics are recomputed from the input
(no saved mean or rstd needed), as the forward computes them: the mean and the biased
variance, rstd = 1 / sqrt(var + eps), xhat = (x - mean) * rstd.

layer_norm_backward(grad_out, x, weight=None, eps) over the last axis (D), rows = size / D:
  grad_x = rstd * (g*w - mean(g*w) - xhat * mean(g*w * xhat)) per row, grad_weight = sum over
  rows of g * xhat (None without weight), grad_bias = sum over rows of g.
  Rows that fit in registers (D <= 8192 float32 / float16 / bfloat16, 4096 float64) take one
  persistent kernel ("rows": warp per row up to 256 float32 elements, else TPR threads per
  row) that reads x and g once and writes grad_x once; each thread adds g * xhat and g of its
  columns into the block's shared-memory sums, which end as one partial row per block
  (float32, float64 for float64), and a "finalize" kernel adds those rows per column in a
  fixed order (double); where blocks x D <= 8192 the rows kernel's last block (by a ticket)
  adds them itself, in the same way: one launch (perf/NOTES.md, "Per-call host cost" S15).
  Block mode prefetches on the 16-byte path: each thread copies its
  share of the next trip's row into shared memory (cp.async, two stages) before working on
  this one's, so an SM keeps 1024 threads x 64 bytes of loads in flight through the
  reductions and the stores; without it an SM's loads stop whenever all its blocks are
  between a load and the next (measured: 51.3 us for 8192 x 1024 float32 on H100, 0.66 of
  copy). The stages cost no registers (the kernel keeps its 64 and 2 blocks of 512 threads
  per SM) but 64 KiB of shared memory per 512-thread block (128 KiB for 1024 threads: a
  device whose opt-in shared memory per block cannot hold it runs the plain kernel). Longer
  rows take "rowstats" (per-row mean, rstd and the two row means, reading x twice, the
  second mostly from L2, and g once) and "apply" (grad_x and the column partials, a second
  read of x and g), then "finalize".
batch_norm_backward(grad_out, input, gamma, eps, training, running_mean, running_var) for
  (N, C), (N, C, L), (N, C, H, W): grad_beta = sum g, grad_gamma = sum g * xhat per channel;
  training (batch statistics): grad_input = gamma rstd (g - grad_beta / M - xhat grad_gamma
  / M), M = N * L or N * H * W, in two passes: "reduce" (shifted sums of x, x^2, g, g x per channel
  into per-block partials; the last block of each channel group to finish, by an atomic
  ticket, adds the group's partials in double in a fixed order, one warp per channel:
  grad_gamma, grad_beta and the channel's coefficients), "apply" (grad_input = A g + B (x -
  mean) + Dc, rows from the last one down so the first blocks find pass 1's last reads in
  L2). training=False (the running statistics): grad_input = g gamma rstd in one pass
  ("eval", which also sums g and g (x - mean) and finalizes the same way): one launch.
No float atomics: every sum runs in an order fixed by the shape and the device's SM count,
so a repeat call gives the same bits. Half types compute in float32 and round once; the
parameter gradients round once from double. Fallback mode computes `reference` in float64
and rounds once.

Floor (bytes / copy bandwidth, bytes = read x + read grad_out + write grad_x, plus the
parameter traffic: the weight or gamma, grad_weight and grad_bias, and the partial sums,
written once and read once: layer norm grid x 2 x D x 4 bytes, grid <= the resident blocks,
2 per SM of 512 threads in block mode, 4 of 256 in warp mode):
- layer_norm_backward, register rows: that floor; target >= 0.85 x copy bandwidth for large
  inputs (rows >> the grid, so the partials are a few percent of x). Longer rows read x and
  g twice: floor 5/3 of that. 8192 x 1024 float32 on H100 (copy 2954 GB/s): 3 x 32 MiB +
  2.2 MB of partials (264 blocks; mostly in L2) = 34.8 us; the fixed costs on top are the
  first trip's exposed load (~1 us), the block's sum tree and partial row (~1 us) and the
  finalize launch (~2 us: 8.25 partial rows per thread, loaded 8 at a time). Prediction,
  before a GPU run: 39-43 us (0.80-0.88 of copy; target <= 40 us), was 51.3 us.
- batch_norm_backward, training=False: one pass, the same floor and target.
- batch_norm_backward, training=True: pass 2 needs the per-channel sums of pass 1, so x and g
  are read twice: the 3-unit floor holds only while x and g fit in L2 together (pass 2 reads
  them from L2, last-read first); beyond L2 (50 MB on H100) the DRAM floor is 5 units,
  3/5 of the 3-unit figure (the report's ml/batch_norm_backward case measures it).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple, cast

import numpy as np

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..tensor import CudaTensor
from . import common
from .batch_norm_backward_plans import (BN_TEMPLATE, bn_call_plan, bn_general, bn_geometry,
                                        bn_kernels, bn_launch, bn_params)
from .layer_norm_backward_plans import (LN_FINAL_BLOCK, LN_TEMPLATE, ln_call_plan, ln_launch,
                                        ln_params, ln_prepared, ln_row_plans)
from .normalization_common import DT, DTYPES, bn_layout, vec_width

TEMPLATES = (LN_TEMPLATE, BN_TEMPLATE)


# -- the family contract (registry.CONTRACT) ------------------------------------------
def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set layer_norm_backward and batch_norm_backward render."""
    ln, bn = [], []
    for dt in DTYPES:
        for plan in ln_row_plans(dt):
            for aligned in (True, False):
                for fused in (False, True):
                    p = ln_params(dt, "rows", plan, aligned, fused)
                    if p not in ln:   # (an element-path kernel is the same with or without)
                        ln.append(p)
        for kernel in ("rowstats", "apply", "finalize"):
            ln.append(ln_params(dt, kernel))
        for kernel in ("reduce", "eval", "apply"):
            for layout in ("nc", "ncs"):
                bn.append(bn_params(dt, kernel, layout))
                if kernel == "reduce" and layout == "ncs":
                    bn.append(bn_params(dt, kernel, layout, True))
    return {LN_TEMPLATE: ln, BN_TEMPLATE: bn}


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every variant in parallel threads (nvcc runs in subprocesses); returns how
    many were compiled (0 in fallback mode)."""
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets]
    return common.compile_all(m, jobs, device_id, workers)


# -- float64 references ----------------------------------------------------------------------
def reference(op: str, grad_out: Any, x: Any, *params: Any, eps: float = 1e-5,
              training: bool = True) -> Tuple[np.ndarray, Optional[np.ndarray], np.ndarray]:
    """float64 NumPy of op "layer_norm" (params: weight or None, or nothing): (grad_x,
    grad_weight (None without weight), grad_bias); or "batch_norm" (params: gamma, then for
    training=False running_mean and running_var): (grad_input, grad_gamma, grad_beta)."""
    g = np.asarray(grad_out, dtype=np.float64)
    a = np.asarray(x, dtype=np.float64)
    vals = [None if v is None else np.asarray(v, dtype=np.float64) for v in params]
    with np.errstate(all="ignore"):
        if op == "layer_norm":
            weight = (vals + [None])[0]
            D = a.shape[-1]
            if a.size == 0:
                zeros = np.zeros(D)
                return np.zeros(a.shape), (None if weight is None else zeros), zeros.copy()
            mu = a.mean(axis=-1, keepdims=True)
            d = a - mu
            rstd = 1.0 / np.sqrt((d * d).mean(axis=-1, keepdims=True) + eps)
            xhat = d * rstd
            gw = g if weight is None else g * weight
            dx = rstd * (gw - gw.mean(axis=-1, keepdims=True)
                         - xhat * (gw * xhat).mean(axis=-1, keepdims=True))
            g2, xh2 = g.reshape(-1, D), xhat.reshape(-1, D)
            dw = None if weight is None else (g2 * xh2).sum(axis=0)
            return dx, dw, g2.sum(axis=0)
        if op == "batch_norm":
            gamma = vals[0]
            C = a.shape[1]
            shape = (1, C) + (1,) * (a.ndim - 2)
            axes = (0,) + tuple(range(2, a.ndim))
            count = a.size // max(C, 1)
            if training:
                mean, var = a.mean(axis=axes), a.var(axis=axes)
            else:
                mean, var = vals[1], vals[2]
            rstd = 1.0 / np.sqrt(var + eps)
            xhat = (a - mean.reshape(shape)) * rstd.reshape(shape)
            db = g.sum(axis=axes)
            dg = (g * xhat).sum(axis=axes)
            scale = (gamma * rstd).reshape(shape)
            if training:
                dx = scale * (g - db.reshape(shape) / count - xhat * dg.reshape(shape) / count)
            else:
                dx = scale * g
            return dx, dg, db
    raise InvalidArgumentError(f"unknown normalization {op!r}: 'layer_norm' or 'batch_norm'")


# -- checks --------------------------------------------------------------------------------
def _real(value: Any, name: str, op: str) -> float:
    """eps: a finite real number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(f"{op}: {name} must be a real number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise InvalidArgumentError(f"{op}: {name} must be a finite number >= 0, got {value!r}")
    return v


def _param(t: Any, name: str, n: int, what: str, op: str) -> CudaTensor:
    """A live tensor of shape (n,) (n: the size of the input's `what`)."""
    common.check_tensor(t, name)
    if t.shape != (n,):
        raise ShapeMismatchError(
            f"{op}: {name} has shape {t.shape}, expected ({n},) for {what}")
    return t


def _same_shape(g: CudaTensor, x: CudaTensor, xname: str, op: str) -> None:
    if g.shape != x.shape:
        raise ShapeMismatchError(
            f"{op}: grad_out has shape {g.shape} and {xname} has shape {x.shape}; they must "
            f"have the same shape")


def _host_out(m: Any, values: np.ndarray, dtype: CudaDataType, dev: int) -> CudaTensor:
    """float64 values rounded once to dtype, in a new tensor."""
    with np.errstate(over="ignore", invalid="ignore"):
        host = np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype
        return common.from_host(m, np.asarray(values).astype(host), dtype, dev)


# -- layer norm ------------------------------------------------------------------------------
def layer_norm_backward(m: Any, grad_out: CudaTensor, x: CudaTensor,
                        weight: Optional[CudaTensor] = None, eps: float = 1e-5
                        ) -> Tuple[CudaTensor, Optional[CudaTensor], CudaTensor]:
    """(grad_x, grad_weight (None when weight is None), grad_bias) of layer_norm(x, weight,
    bias, eps) over the last axis, for the gradient grad_out of its output; grad_weight and
    grad_bias have shape (D,), all in x's dtype."""
    if type(x) is CudaTensor and type(eps) is float:
        # the per-call plan (ops/common.py remember_plan); float eps only, so that no
        # equal-valued bool reaches it unchecked
        key = ("layer_norm_backward", x.shape, x.dtype, x.device_id, eps, weight is None)
        direct = m.backend.direct_launch(x.device_id)
        res = common.planned(m, key, grad_out, x, weight) if direct else None
        if res is not None:
            return res
    op = "layer_norm_backward"
    g = common.check_tensor(grad_out, "grad_out")
    common.check_tensor(x, "x")
    if x.ndim < 1:
        raise InvalidArgumentError(f"{op} needs x with at least 1 dimension, got shape {x.shape}")
    D = x.shape[-1]
    tensors = [g, x]
    if weight is not None:
        tensors.append(_param(weight, "weight", D, f"the last dimension of x of shape {x.shape}",
                              op))
    common.require_dtype(x, DTYPES, op)
    dtype = common.same_dtype(*tensors)
    dev = common.same_device(*tensors)
    _same_shape(g, x, "x", op)
    eps = _real(eps, "eps", op)
    if D >= 2**31 - 2**16:
        raise InvalidArgumentError(f"{op} supports rows under 2^31 elements, got {D}")
    if not m.gpu:
        w = None if weight is None else common.host_array(m, weight)
        dx, dw, db = reference("layer_norm", common.host_array(m, g), common.host_array(m, x),
                               w, eps=eps)
        return (_host_out(m, dx, dtype, dev),
                None if dw is None else _host_out(m, dw, dtype, dev), _host_out(m, db, dtype, dev))
    dx = m.backend.empty(x.shape, dtype, dev)
    db = m.backend.empty((D,), dtype, dev)
    dw = m.backend.empty((D,), dtype, dev) if weight is not None else None
    if D == 0:
        return dx, dw, db
    vec = vec_width(dtype)
    ptrs = [g.ptr, x.ptr, dx.ptr] + ([weight.ptr] if weight is not None else [])
    aligned = D % vec == 0 and not any(p & 15 for p in ptrs)
    q = ln_prepared(m, dtype, D, dev, aligned)
    if x.size == 0:   # no rows: grad_weight and grad_bias are sums over nothing
        m.backend.launch_kernel(q["final"], (-(-D // 32), 1, 1), 0, 0, D,
                                dw if dw is not None else 0, db, block_size=LN_FINAL_BLOCK,
                                device_id=dev)
        return dx, dw, db
    ln_launch(m, q, g, x, weight, dx, dw, db, eps)
    key = ("layer_norm_backward", x.shape, dtype, dev, eps, weight is None)
    if key not in m.plans:
        common.remember_plan(m, key, ln_call_plan(m, x, weight is not None, eps))
    return dx, dw, db


# -- batch norm ------------------------------------------------------------------------------
def batch_norm_backward(m: Any, grad_out: CudaTensor, input: CudaTensor, gamma: CudaTensor,
                        eps: float = 1e-5, training: bool = True,
                        running_mean: Optional[CudaTensor] = None,
                        running_var: Optional[CudaTensor] = None
                        ) -> Tuple[CudaTensor, CudaTensor, CudaTensor]:
    """(grad_input, grad_gamma, grad_beta) of batch_norm(input, gamma, beta, ...) per channel
    (axis 1), for the gradient grad_out of its output: training=True with the batch
    statistics (biased variance), training=False with running_mean and running_var (both
    required then). grad_gamma and grad_beta have shape (C,), all in the input's dtype."""
    if type(input) is CudaTensor and type(eps) is float and type(training) is bool:
        key = ("batch_norm_backward", input.shape, input.dtype, input.device_id, eps, training)
        direct = m.backend.direct_launch(input.device_id)
        res = common.planned(m, key, grad_out, input, gamma, running_mean,
                             running_var) if direct else None
        if res is not None:
            return res
    g, x, training, eps, dtype, dev = _bn_checks(grad_out, input, gamma, eps, training,
                                                 running_mean, running_var)
    if not m.gpu:
        params = [common.host_array(m, gamma)]
        if not training:   # (checked above: both given)
            params += [common.host_array(m, cast(CudaTensor, running_mean)),
                       common.host_array(m, cast(CudaTensor, running_var))]
        dx, dg, dbeta = reference("batch_norm", common.host_array(m, g), common.host_array(m, x),
                                  *params, eps=eps, training=training)
        return (_host_out(m, dx, dtype, dev), _host_out(m, cast(np.ndarray, dg), dtype, dev),
                _host_out(m, dbeta, dtype, dev))
    N, C, S, count, layout, vec, can_vec = bn_layout(x.shape, dtype)
    ks = bn_kernels(m, dtype, layout, training, dev) if C else {}
    sms = int(m.backend.get_device_info(dev).multiprocessor_count)
    if C == 0 or count == 0:
        dx = m.backend.empty(x.shape, dtype, dev)
        dgamma = m.backend.empty((C,), dtype, dev)
        dbeta = m.backend.empty((C,), dtype, dev)
        if C:   # inference on an empty batch: the pass over nothing writes the zeros
            bn_launch(m, ks, bn_geometry(layout, 0, C, 1, 0, vec, sms), training, g, x, dx,
                      gamma, running_mean, running_var, dgamma, dbeta, eps, 0, C, 1, 0)
        return dx, dgamma, dbeta
    res = bn_general(m, ks, training, g, x, gamma, running_mean, running_var, eps, sms)
    key = ("batch_norm_backward", x.shape, dtype, dev, eps, training)
    if key not in m.plans:
        common.remember_plan(m, key, bn_call_plan(m, ks, x, training, eps, sms))
    return res


def _bn_checks(grad_out: Any, input: Any, gamma: Any, eps: Any, training: Any,
               running_mean: Optional[CudaTensor], running_var: Optional[CudaTensor]
               ) -> Tuple[CudaTensor, CudaTensor, bool, float, CudaDataType, int]:
    """batch_norm_backward's argument checks, in order: (grad_out, input, training as a
    bool, eps, the dtype, the device)."""
    op = "batch_norm_backward"
    g = common.check_tensor(grad_out, "grad_out")
    x = common.check_tensor(input, "input")
    if x.ndim not in (2, 3, 4):
        raise InvalidArgumentError(
            f"{op} needs an (N, C), (N, C, L) or (N, C, H, W) input, got shape {x.shape}")
    if not isinstance(training, (bool, np.bool_)):
        raise InvalidArgumentError(f"{op}: training must be a bool, got {training!r}")
    training = bool(training)
    C = x.shape[1]
    what = f"the {C} channels of the input of shape {x.shape}"
    tensors = [g, x, _param(gamma, "gamma", C, what, op)]
    if not training and (running_mean is None or running_var is None):
        raise InvalidArgumentError(
            f"{op} with training=False normalizes with the running statistics: pass "
            f"running_mean and running_var (tensors of shape ({C},))")
    for t, name in ((running_mean, "running_mean"), (running_var, "running_var")):
        if t is not None:
            tensors.append(_param(t, name, C, what, op))
    common.require_dtype(x, DTYPES, op)
    dtype = common.same_dtype(*tensors)
    dev = common.same_device(*tensors)
    _same_shape(g, x, "input", op)
    eps = _real(eps, "eps", op)
    count = bn_layout(x.shape, x.dtype)[3]     # values per channel
    if training and C > 0 and count <= 1:
        raise InvalidArgumentError(
            f"{op} with training=True needs more than 1 value per channel, got input shape "
            f"{x.shape} ({count} per channel)")
    return g, x, training, eps, dtype, dev
