"""Fused cross-entropy over logits (N, C) and integer labels (N,), and its gradient with respect
to the logits, with PyTorch's semantics (F.cross_entropy without class weights or label
smoothing): the loss of row r is logsumexp(logits[r]) - logits[r, labels[r]]; a row whose label
equals ignore_index has loss 0 and a zero gradient and is left out of the mean's count (the
mean over zero counted rows is NaN, 0 / 0, as in PyTorch); reduction "mean", "sum" or "none".

Kernels, `templates/cross_entropy.cu.j2`, float dtypes (float32 math for half types, double
for float64), labels int32 or int64:
- forward: one pass over each row (a running max and sum of exp(x - max) per lane, merged
  across the row's lanes) writing the row's loss as log(sum) + (max - x[label]), which keeps
  large logits (1e4 offsets in float16 and bfloat16 too) exact to the dtype's rounding;
  mode "warp" (1-32 lanes per row, K <= 32 * vec * 4) or "block" (one block per row). For
  "mean" and "sum" the per-row losses are then summed (float32 or double, fixed order) and
  the rows counted by one block: the forward's last block (a ticket) for up to 32 rows per
  thread (16 for float64), else a one-block "finish" kernel (2 launches).
- backward: dlogits = (softmax(x) - onehot(label)) * scale per row, one kernel per call
  ("mean" has each block count the rows where blocks x rows <= 2^18, else first runs the
  one-block kernel that counts them into the scale): modes "warp"
  and "block" keep the row in registers (1 read + 1 write), "loop" for rows over
  512 * 4 * vec elements (8K float32) reads it twice. scale = grad_loss (a Python number;
  for "sum" also a tensor of shape () or (1,), for "none" a tensor of shape (N,)), divided
  by the count for "mean".

Labels out of range: a label outside [0, C) that is not ignore_index is an error
(InvalidArgumentError naming such a row), as NumPy indexing and PyTorch raise. The kernels
find it and set the call's error slot (cuda_backend/device_errors.py: page-locked host memory
mapped into the device); the call returns at once and the next synchronizing call
(synchronize, to_numpy, item, ...) raises, as PyTorch's device-side checks do; in fallback
mode the call itself raises. Nothing waits, so the check costs nothing on the device and the
checked call can be queued behind others. check_labels=False skips it: such rows then give a
NaN loss (and a NaN gradient row), so a "mean" or "sum" turns NaN. Fallback mode computes
`reference` in float64 and
rounds once.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError
from ..streams import current_pycuda_stream
from ..tensor import CudaTensor, pool_tensor
from . import common
from .common import acc_dtype
from .cross_entropy_checks import (check_grad, check_operands, check_row_stats,
                                   host_check_labels, label_slot)
from .cross_entropy_plans import (BWD_BLOCK_CONFIGS, BWD_WARP_NV, COUNTERS, FINISH_BLOCK,
                                  FWD_BLOCKS, MAX_GRID, STATS_NV, TEMPLATE,
                                  backward_candidates, backward_fuses, forward_candidates,
                                  forward_fuses, grid, kernel_params, launch_backward,
                                  launch_finish, launch_forward, prepared_for,
                                  stats_candidates, stats_chunks)
from .reduction import host_result

DT = CudaDataType
TEMPLATES = (TEMPLATE,)


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Per float dtype: forward warp and block sizes, backward warp sizes, block configs,
    loop and stats, each unfused and fused, and finish."""
    sets = []
    for dt in common.FLOATS:
        for f in (False, True):
            sets.append(kernel_params(dt, "forward", "warp", fused=f))
            sets += [kernel_params(dt, "forward", "block", b, fused=f) for b in FWD_BLOCKS]
            sets += [kernel_params(dt, "backward", "warp", nv=nv, fused=f)
                     for nv in BWD_WARP_NV]
            sets += [kernel_params(dt, "backward", "block", b, nv, f)
                     for b, nv in BWD_BLOCK_CONFIGS]
            sets.append(kernel_params(dt, "backward", "loop", fused=f))
            sets += [kernel_params(dt, "backward", "stats", nv=nv, fused=f) for nv in STATS_NV]
        sets.append(kernel_params(dt, "finish"))
    return {TEMPLATE: sets}


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every variant in parallel threads; 0 in fallback mode."""
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets]
    return common.compile_all(m, jobs, device_id, workers)


def candidates(kind: str, K: int, itemsize: int) -> List[Dict[str, Any]]:
    """Every plan of kind "forward", "backward" or "stats" (the backward from the forward's
    row statistics) able to run rows of K elements."""
    return {"forward": forward_candidates, "backward": backward_candidates,
            "stats": stats_candidates}[kind](K, itemsize)


# -- reference ------------------------------------------------------------------------------
def reference(op: str, logits: Any, labels: Any, reduction: str = "mean",
              ignore_index: int = -100, grad_loss: Any = 1.0) -> np.ndarray:
    """float64 NumPy of op "cross_entropy" (the loss) or "cross_entropy_backward" (dlogits,
    for the upstream gradient grad_loss: a number, or an array of shape (N,) for "none").
    Rows with a label outside [0, C) that is not ignore_index give NaN (the ops raise)."""
    x = np.asarray(logits, dtype=np.float64)
    lab = np.asarray(labels).astype(np.int64)
    N, C = x.shape
    valid = lab != ignore_index
    bad = valid & ((lab < 0) | (lab >= C))
    ok = valid & ~bad
    rows = np.arange(N)
    with np.errstate(all="ignore"):
        mx = np.max(x, axis=1) if C else np.full(N, -np.inf)
        z = x - mx[:, None]
        s = np.sum(np.exp(z), axis=1)
        if op == "cross_entropy":
            xl = x[rows, np.clip(lab, 0, max(C - 1, 0))] if N else np.zeros(0)
            loss = np.where(ok, np.log(s) + (mx - xl), np.where(bad, np.nan, 0.0))
            if reduction == "none":
                return loss
            total = np.sum(loss)
            if reduction == "sum":
                return np.asarray(total, dtype=np.float64)
            return np.asarray(total / np.float64(np.count_nonzero(valid)), dtype=np.float64)
        if op != "cross_entropy_backward":
            raise InvalidArgumentError(f"unknown op {op!r}")
        p = np.exp(z) / s[:, None]
        p[rows[ok], lab[ok]] -= 1.0
        g = np.asarray(grad_loss, dtype=np.float64)
        scale = np.broadcast_to(g.reshape(-1) if reduction == "none" else g.reshape(()),
                                (N,)).astype(np.float64)
        if reduction == "mean":
            scale = scale / np.float64(np.count_nonzero(valid))
        dx = np.where(ok[:, None], p * scale[:, None], np.where(bad[:, None], np.nan, 0.0))
    return np.asarray(dx, dtype=np.float64).reshape(N, C)


def _host_dtype(dtype: CudaDataType) -> Any:
    return np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype


def _host_out(m: Any, values: np.ndarray, dtype: CudaDataType, dev: int) -> CudaTensor:
    with np.errstate(over="ignore", invalid="ignore"):
        return host_result(m, np.asarray(values).astype(_host_dtype(dtype)), dtype, dev, None)


def host_row_stats(x: np.ndarray) -> np.ndarray:
    """float64 (N, 2): each row's max and sum of exp(x - max) (what the forward saves)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(all="ignore"):
        mx = np.max(x, axis=1) if x.shape[1] else np.full(x.shape[0], -np.inf)
        return np.stack([mx, np.sum(np.exp(x - mx[:, None]), axis=1)], axis=1)


def _host_forward(m: Any, logits: CudaTensor, labels: CudaTensor, reduction: str,
                  ignore_index: int, check_labels: bool, return_row_stats: bool) -> Any:
    """cross_entropy in fallback mode (or for no rows): float64 reference, rounded once."""
    name = "cross_entropy"
    C, dtype, dev = logits.shape[1], logits.dtype, logits.device_id
    lab = common.host_array(m, labels)
    if check_labels:
        host_check_labels(name, lab, C, ignore_index)
    x = common.host_array(m, logits)
    loss = _host_out(m, reference(name, x, lab, reduction, ignore_index), dtype, dev)
    if not return_row_stats:
        return loss
    adt = acc_dtype(dtype)
    return loss, host_result(m, host_row_stats(x).astype(adt.numpy_dtype), adt, dev, None)


# -- the ops -----------------------------------------------------------------------------------
def cross_entropy(m: Any, logits: CudaTensor, labels: CudaTensor, reduction: str = "mean",
                  ignore_index: int = -100, check_labels: bool = True,
                  return_row_stats: bool = False
                  ) -> Union[CudaTensor, Tuple[CudaTensor, CudaTensor]]:
    """The cross-entropy loss of logits (N, C) against labels (N,) (int32 or int64): shape
    () for "mean" and "sum", (N,) for "none", in the logits' dtype. With return_row_stats,
    (loss, row_stats): row_stats (N, 2) holds each row's max and sum of exp(x - max)
    (float32, float64 for float64 logits), which cross_entropy_backward(..., row_stats=)
    takes to read the logits once instead of recomputing them."""
    if type(logits) is CudaTensor and type(labels) is CudaTensor and \
            type(ignore_index) is int and type(reduction) is str and \
            type(check_labels) is bool and type(return_row_stats) is bool:
        key = ("cross_entropy", logits.shape, logits.dtype, labels.dtype, logits.device_id,
               reduction, ignore_index, check_labels, return_row_stats)
        res = common.planned(m, key, logits, labels)
        if res is not None:
            return res
    name = "cross_entropy"
    N, C, dev = check_operands(name, logits, labels, reduction, ignore_index, check_labels)
    if not isinstance(return_row_stats, (bool, np.bool_)):
        raise InvalidArgumentError(
            f"{name}: return_row_stats must be a bool, got {return_row_stats!r}")
    ignore_index = int(ignore_index)
    dtype = logits.dtype
    if not m.gpu or N == 0:
        return _host_forward(m, logits, labels, reduction, ignore_index, check_labels,
                             return_row_stats)
    pf = prepared_for(m, "forward", dtype, C, dev)
    flag = label_slot(m, name, C, ignore_index) if check_labels else 0
    stats = m.backend.empty((N, 2), acc_dtype(dtype), dev) if return_row_stats else None
    if reduction == "none":
        out = m.backend.empty((N,), dtype, dev)
        buf = None
    else:
        buf = m.backend.empty((N,), acc_dtype(dtype), dev)
        out = m.backend.empty((), dtype, dev)
    pstats = stats if stats is not None else 0
    if buf is not None and forward_fuses(pf, N, C, dtype.itemsize):
        pf = prepared_for(m, "forward", dtype, C, dev, True)
        counter = COUNTERS.get(m, dev, current_pycuda_stream(dev), 1)
        launch_forward(m, pf, logits, labels, buf, True, flag, pstats, ignore_index,
                       (counter, out, int(reduction == "mean")))
        buf.free()   # stream-ordered: reused only after the launch
    elif buf is not None:
        launch_forward(m, pf, logits, labels, buf, True, flag, pstats, ignore_index)
        pfin = prepared_for(m, "finish", dtype, 0, dev)
        launch_finish(m, pfin, buf, labels, N, ignore_index, reduction == "mean", 0, out, 0,
                      0.0, 0, dev)
        buf.free()   # stream-ordered: reused only after the finish kernel
    else:
        launch_forward(m, pf, logits, labels, out, False, flag, pstats, ignore_index)
    key = ("cross_entropy", logits.shape, dtype, labels.dtype, dev, reduction, ignore_index,
           bool(check_labels), bool(return_row_stats))
    if key not in m.plans:
        common.remember_plan(m, key, _fast_forward(m, logits, labels.dtype, reduction,
                                                   ignore_index, bool(check_labels),
                                                   bool(return_row_stats)))
    return (out, stats) if stats is not None else out


def _finish_launch(m: Any, dtype: CudaDataType, dev: int) -> Any:
    """The one-block "finish" kernel's PreparedLaunch for logits of dtype on dev (the plans'
    reduction of the row losses, or the mean's scale before the backward pass)."""
    pfin = prepared_for(m, "finish", dtype, 0, dev)
    return m.backend.prepare_launch(m.backend.get_kernel(pfin["kernel"], dev), (1, 1, 1),
                                    (FINISH_BLOCK, 1, 1), 0, dev)


def _fast_forward(m: Any, x: CudaTensor, ldt: CudaDataType, reduction: str, ignore_index: int,
                  check: bool, with_stats: bool) -> Any:
    """The per-call plan of cross_entropy for logits shaped like x and labels of dtype ldt:
    run(logits, labels) -> the loss (and row statistics), or None (the general path then
    runs)."""
    backend = m.backend
    dev, dtype = x.device_id, x.dtype
    N, C = x.shape
    pf = prepared_for(m, "forward", dtype, C, dev)
    fused = reduction != "none" and forward_fuses(pf, N, C, dtype.itemsize)
    if fused:
        pf = prepared_for(m, "forward", dtype, C, dev, True)
    go = backend.prepare_launch(backend.get_kernel(pf["kernel"], dev), (grid(pf, N), 1, 1),
                                (pf["threads"], 1, 1), 0, dev)
    fin = _finish_launch(m, dtype, dev) if reduction != "none" and not fused else None
    counter = COUNTERS.source(m, dev, 1) if fused else None
    pool, alloc, direct = common.plan_memory(m, dev)
    adt = acc_dtype(dtype)
    label64 = int(ldt is DT.INT64)
    kvec = C % (16 // dtype.itemsize) == 0
    group, mean = pf["group"], int(reduction == "mean")
    isz, asz = dtype.itemsize, adt.itemsize
    pflag = label_slot(m, "cross_entropy", C, ignore_index) if check else 0

    def run(x: CudaTensor, labels: CudaTensor) -> Any:
        px, pl = x._ptr, labels._ptr
        if px is None or pl is None or labels.shape != (N,) or labels.device_id != dev or \
                not direct(dev):
            return None
        stats = pool_tensor((N, 2), adt, dev, alloc(2 * N * asz), pool, 2 * N, 2 * N * asz) \
            if with_stats else None
        pstats = stats._ptr if stats is not None else 0
        vec_ok = int(kvec and not (px & 15))
        if counter is not None:
            buf = pool_tensor((N,), adt, dev, alloc(N * asz), pool, N, N * asz)
            out = pool_tensor((), dtype, dev, alloc(isz), pool, 1, isz)
            go(px, pl, label64, buf._ptr, 1, pflag, pstats, N, C, ignore_index, group, vec_ok,
               counter(), out._ptr, mean)
            buf.free()
        elif fin is None:
            out = pool_tensor((N,), dtype, dev, alloc(N * isz), pool, N, N * isz)
            go(px, pl, label64, out._ptr, 0, pflag, pstats, N, C, ignore_index, group, vec_ok)
        else:
            buf = pool_tensor((N,), adt, dev, alloc(N * asz), pool, N, N * asz)
            out = pool_tensor((), dtype, dev, alloc(isz), pool, 1, isz)
            go(px, pl, label64, buf._ptr, 1, pflag, pstats, N, C, ignore_index, group, vec_ok)
            fin(buf._ptr, pl, label64, N, ignore_index, mean, 0, out._ptr, 0, 0.0, 0)
            buf.free()
        return (out, stats) if stats is not None else out
    return run


def cross_entropy_backward(m: Any, logits: CudaTensor, labels: CudaTensor,
                           grad_loss: Any = 1.0, reduction: str = "mean",
                           ignore_index: int = -100, check_labels: bool = True,
                           row_stats: Optional[CudaTensor] = None) -> CudaTensor:
    """d(loss)/d(logits), (N, C) in the logits' dtype, for the upstream gradient grad_loss of
    the loss cross_entropy(logits, labels, reduction, ignore_index) returned. row_stats: the
    forward's (cross_entropy(..., return_row_stats=True)) for these logits, or None (then
    each row's max and sum are recomputed: long rows read the logits twice)."""
    if type(logits) is CudaTensor and type(labels) is CudaTensor and \
            type(ignore_index) is int and type(grad_loss) is float and \
            type(reduction) is str and type(check_labels) is bool:
        key = ("cross_entropy_backward", logits.shape, logits.dtype, labels.dtype,
               logits.device_id, reduction, ignore_index, check_labels, row_stats is not None)
        res = common.planned(m, key, logits, labels, grad_loss, row_stats)
        if res is not None:
            return res
    name = "cross_entropy_backward"
    N, C, dev = check_operands(name, logits, labels, reduction, ignore_index, check_labels)
    ignore_index = int(ignore_index)
    dtype = logits.dtype
    grad, gmul = check_grad(name, grad_loss, reduction, N, dtype, dev)
    stats = check_row_stats(name, row_stats, N, dtype, dev)
    if not m.gpu or N == 0:
        lab = common.host_array(m, labels)
        if check_labels:
            host_check_labels(name, lab, C, ignore_index)
        g = gmul if grad is None else common.host_array(m, grad).astype(np.float64)
        values = reference(name, common.host_array(m, logits), lab, reduction, ignore_index, g)
        return _host_out(m, values, dtype, dev)
    use_stats = stats is not None
    pb = prepared_for(m, "stats" if use_stats else "backward", dtype, C, dev)
    if use_stats and N * stats_chunks(pb, C, dtype.itemsize) > MAX_GRID:
        pb, use_stats = prepared_for(m, "backward", dtype, C, dev), False
    pflag = label_slot(m, name, C, ignore_index) if check_labels else 0
    dx = m.backend.empty((N, C), dtype, dev)
    pstats = stats if use_stats else None
    kind = "stats" if use_stats else "backward"
    if reduction == "mean" and backward_fuses(pb, N, C, dtype.itemsize):
        pb = prepared_for(m, kind, dtype, C, dev, True)
        launch_backward(m, pb, logits, labels, dx, grad if grad is not None else 0, 0, gmul, 0,
                        pflag, ignore_index, pstats)
    elif reduction == "mean":
        scale = m.backend.empty((1,), acc_dtype(dtype), dev)
        pfin = prepared_for(m, "finish", dtype, 0, dev)
        launch_finish(m, pfin, 0, labels, N, ignore_index, True, 1, 0,
                      grad if grad is not None else 0, gmul, scale, dev)
        launch_backward(m, pb, logits, labels, dx, 0, 0, 0.0, scale, pflag, ignore_index,
                        pstats)
        scale.free()
    else:
        launch_backward(m, pb, logits, labels, dx, grad if grad is not None else 0,
                        1 if reduction == "none" else 0, gmul, 0, pflag, ignore_index, pstats)
    if grad is None and use_stats == (stats is not None):
        key = ("cross_entropy_backward", logits.shape, dtype, labels.dtype, dev, reduction,
               ignore_index, bool(check_labels), use_stats)
        if key not in m.plans:
            common.remember_plan(m, key, _fast_backward(m, logits, labels.dtype, reduction,
                                                        ignore_index, bool(check_labels),
                                                        use_stats))
    return dx


def _fast_backward(m: Any, x: CudaTensor, ldt: CudaDataType, reduction: str,
                   ignore_index: int, check: bool, with_stats: bool) -> Any:
    """The per-call plan of cross_entropy_backward for logits shaped like x, labels of dtype
    ldt, a Python float grad_loss and row_stats (when with_stats) or None:
    run(logits, labels, grad_loss, row_stats) -> dlogits or None."""
    backend = m.backend
    dev, dtype = x.device_id, x.dtype
    N, C = x.shape
    isz = dtype.itemsize
    kind = "stats" if with_stats else "backward"
    pb = prepared_for(m, kind, dtype, C, dev)
    fused = reduction == "mean" and backward_fuses(pb, N, C, isz)
    if fused:   # each block counts the mean's rows: the kernel takes gmul as (sum) does
        pb = prepared_for(m, kind, dtype, C, dev, True)
    go = backend.prepare_launch(backend.get_kernel(pb["kernel"], dev),
                                (grid(pb, N, C, isz), 1, 1), (pb["threads"], 1, 1), 0, dev)
    fin = _finish_launch(m, dtype, dev) if reduction == "mean" and not fused else None
    pool, alloc, direct = common.plan_memory(m, dev)
    adt = acc_dtype(dtype)
    label64 = int(ldt is DT.INT64)
    kvec = C % (16 // isz) == 0
    last = stats_chunks(pb, C, isz) if with_stats else pb["group"]
    size, nbytes = N * C, N * C * isz
    pflag = label_slot(m, "cross_entropy_backward", C, ignore_index) if check else 0

    def run(x: CudaTensor, labels: CudaTensor, gmul: float,
            row_stats: Optional[CudaTensor]) -> Optional[CudaTensor]:
        px, pl = x._ptr, labels._ptr
        ps = common.plan_pointer(row_stats, (N, 2), adt, dev) if with_stats else 0
        if px is None or pl is None or ps is None or labels.shape != (N,) or \
                labels.device_id != dev or not direct(dev):
            return None
        dx = pool_tensor((N, C), dtype, dev, alloc(nbytes), pool, size, nbytes)
        pd = dx._ptr
        vec_ok = int(kvec and not ((px | pd) & 15))
        mid = (ps, last) if with_stats else (last,)
        if fin is not None:
            sc = pool_tensor((1,), adt, dev, alloc(adt.itemsize), pool, 1, adt.itemsize)
            fin(0, pl, label64, N, ignore_index, 1, 1, 0, 0, gmul, sc._ptr)
            go(px, pl, label64, pd, 0, 0, 0.0, sc._ptr, pflag, N, C, ignore_index, *mid,
               vec_ok)
            sc.free()
        else:
            go(px, pl, label64, pd, 0, 0, gmul, 0, pflag, N, C, ignore_index, *mid, vec_ok)
        return dx
    return run
