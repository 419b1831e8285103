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
  fixed order (double). Block mode prefetches on the 16-byte path: each thread copies its
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
  into per-block partials), "finalize" (one warp per channel adds the partials in double in
  a fixed order: grad_gamma, grad_beta and the channel's coefficients), "apply" (grad_input
  = A g + B (x - mean) + Dc, rows from the last one down so the first blocks find pass 1's
  last reads in L2). training=False (the running statistics): grad_input = g gamma rstd in
  one pass ("eval", which also sums g and g (x - mean)), then "finalize".
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
import weakref
from typing import Any, Dict, List, Optional, Tuple, cast

import numpy as np

from .. import occupancy
from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..kernels import dtype_params
from ..tensor import CudaTensor, pool_tensor
from . import common
from .normalization import DT, DTYPES, nc_block
from .pooling import fast_divisor

LN_TEMPLATE = "layer_norm_backward.cu.j2"
BN_TEMPLATE = "batch_norm_backward.cu.j2"
TEMPLATES = (LN_TEMPLATE, BN_TEMPLATE)

# layer norm: warp mode (a power of two <= 32 lanes per row, 256-thread blocks); block mode
# (threads per row, threads per block), each with and without prefetch (the rule takes it);
# loop mode's kernels; the finalize block (32 x 32).
LN_WARP_BLOCK = 256
LN_BLOCK_CONFIGS = ((64, 512), (128, 512), (256, 512), (512, 512), (1024, 1024))
LN_STAGES = 2                  # prefetch: shared-memory stages per thread (this row, the next)
LN_ROWSTATS_BLOCK = 512
LN_APPLY_BLOCK = 256
LN_APPLY_BLOCKS_PER_SM = 4     # apply's splits: about one resident wave
LN_FINAL_BLOCK = (32, 32, 1)
# batch norm: threads per block; the passes' blocks per SM (about one resident wave of
# looping blocks); rows in flight per thread ("nc": 2, as the template) and items ("ncs": 4)
BN_BLOCK = 256
BN_PASS_BLOCKS_PER_SM = 4
BN_UNROLL = {"nc": 2, "ncs": 4}
BN_FINAL_CHANNELS = BN_BLOCK // 32   # finalize: one warp per channel
_prepared: "weakref.WeakKeyDictionary[Any, Dict[tuple, Dict[str, Any]]]" = \
    weakref.WeakKeyDictionary()


def _vec(dtype: CudaDataType) -> int:
    return 16 // dtype.itemsize


def _acc_dtype(dtype: CudaDataType) -> CudaDataType:
    return DT.FLOAT64 if dtype is DT.FLOAT64 else DT.FLOAT32


# -- template parameter sets ---------------------------------------------------------------
def ln_warp_nvs(dtype: CudaDataType) -> Tuple[int, ...]:
    """16-byte vectors per lane in warp mode (8-element vectors of the 16-bit types: one)."""
    return (1,) if dtype.itemsize == 2 else (1, 2)


def ln_block_nv(dtype: CudaDataType) -> int:
    """16-byte vectors per thread in block mode: 8 elements (4 for float64), within the 64
    registers of 1024 resident threads per SM without spills."""
    return 1 if dtype.itemsize == 2 else 2


def ln_params(dtype: CudaDataType, kernel: str, plan: Optional[Dict[str, Any]] = None,
              aligned: bool = True) -> Dict[str, Any]:
    """layer_norm_backward.cu.j2 parameters of kernel "rows" (for a plan of mode "warp" or
    "block", aligned or not), "rowstats", "apply" or "finalize"."""
    p: Dict[str, Any] = {**dtype_params(dtype), "kernel": kernel}
    if kernel == "rows":
        if plan is None or plan["mode"] not in ("warp", "block"):
            raise InvalidArgumentError(
                f"kernel 'rows' needs a register plan (mode 'warp' or 'block'), got {plan!r}")
        p.update(mode=plan["mode"], nv=plan["nv"], vec=_vec(dtype), aligned=bool(aligned),
                 block_size=plan["block"], min_blocks=max(1, 1024 // plan["block"]),
                 prefetch=ln_prefetches(plan, aligned))
        if plan["mode"] == "block":
            p["threads_per_row"] = plan["tpr"]
    elif kernel == "rowstats":
        p.update(vec=_vec(dtype), block_size=LN_ROWSTATS_BLOCK)
    elif kernel == "apply":
        p.update(vec=_vec(dtype), block_size=LN_APPLY_BLOCK)
    else:
        p["block_size"] = LN_FINAL_BLOCK[0] * LN_FINAL_BLOCK[1]
    return p


def bn_params(dtype: CudaDataType, kernel: str, layout: str = "",
              mode: str = "") -> Dict[str, Any]:
    """batch_norm_backward.cu.j2 parameters: kernel "reduce", "eval" or "apply" with a layout
    ("nc" or "ncs"), or "finalize" with a mode ("train" or "eval")."""
    p: Dict[str, Any] = {**dtype_params(dtype), "kernel": kernel, "block_size": BN_BLOCK}
    if kernel == "finalize":
        p["mode"] = mode
    else:
        p.update(layout=layout, vec=_vec(dtype))
    return p


def ln_prefetches(plan: Dict[str, Any], aligned: bool) -> bool:
    """Whether a plan's rows kernel prefetches: block mode with prefetch, on the 16-byte
    path (cp.async moves 16-byte vectors; the element path is the plain kernel)."""
    return bool(plan.get("prefetch")) and plan["mode"] == "block" and bool(aligned)


def ln_stage_bytes(plan: Dict[str, Any], aligned: bool) -> int:
    """Dynamic shared memory of the prefetch stages (0 without prefetch): per thread,
    LN_STAGES x (x and g) x nv 16-byte vectors."""
    if not ln_prefetches(plan, aligned):
        return 0
    return LN_STAGES * 2 * plan["nv"] * plan["block"] * 16


def ln_prefetch_fits(plan: Dict[str, Any], dtype: CudaDataType, info: Any) -> bool:
    """Whether a plan's prefetch kernel fits a device: the sums plus the stages (plus 1 KiB
    for the static reduction slots) within its opt-in shared memory per block (192 KiB for
    1024-thread float32 rows: H100 and H200 take it, A100's 163 KiB does not)."""
    rpb = plan["block"] // plan["tpr"]
    need = rpb * 2 * ln_capacity(plan, dtype) * _acc_dtype(dtype).itemsize + \
        ln_stage_bytes(plan, True) + 1024
    return need <= int(getattr(info, "shared_memory_per_block_optin", 0))


def ln_row_plans(dtype: CudaDataType) -> List[Dict[str, Any]]:
    """Every register plan of a dtype (warp plans with 32 lanes per row)."""
    out = [{"mode": "warp", "nv": nv, "tpr": 32, "block": LN_WARP_BLOCK, "prefetch": False}
           for nv in ln_warp_nvs(dtype)]
    out += [{"mode": "block", "nv": ln_block_nv(dtype), "tpr": tpr, "block": blk,
             "prefetch": pf} for tpr, blk in LN_BLOCK_CONFIGS for pf in (True, False)]
    return out


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set layer_norm_backward and batch_norm_backward render."""
    ln, bn = [], []
    for dt in DTYPES:
        for plan in ln_row_plans(dt):
            for aligned in (True, False):
                p = ln_params(dt, "rows", plan, aligned)
                if p not in ln:   # (an element-path kernel is the same with or without)
                    ln.append(p)
        for kernel in ("rowstats", "apply", "finalize"):
            ln.append(ln_params(dt, kernel))
        for kernel in ("reduce", "eval", "apply"):
            for layout in ("nc", "ncs"):
                bn.append(bn_params(dt, kernel, layout))
        for mode in ("train", "eval"):
            bn.append(bn_params(dt, "finalize", mode=mode))
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


# -- layer norm: plans ----------------------------------------------------------------------
def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _ln_warp(D: int, dtype: CudaDataType) -> List[Dict[str, Any]]:
    vec = _vec(dtype)
    return [{"mode": "warp", "nv": nv, "block": LN_WARP_BLOCK,
             "tpr": min(32, _pow2_at_least(-(-D // (vec * nv)))), "prefetch": False}
            for nv in ln_warp_nvs(dtype) if D <= 32 * vec * nv]


def _ln_block(D: int, dtype: CudaDataType) -> List[Dict[str, Any]]:
    """Block configs holding rows of D, least capacity first, each with prefetch first."""
    nv, vec = ln_block_nv(dtype), _vec(dtype)
    return [{"mode": "block", "nv": nv, "tpr": tpr, "block": blk, "prefetch": pf}
            for tpr, blk in LN_BLOCK_CONFIGS if tpr * nv * vec >= D for pf in (True, False)]


LN_LOOP = {"mode": "loop", "nv": 0, "tpr": 0, "block": LN_ROWSTATS_BLOCK, "prefetch": False}


def ln_plan(D: int, dtype: CudaDataType) -> Dict[str, Any]:
    """{"mode", "nv", "tpr" (lanes per row), "block", "prefetch"} for rows of D: warp mode
    with the fewest vectors per lane that hold the row (tpr: the fewest lanes, a power of
    two), else the block config of least capacity that holds it, with prefetch, else
    "loop"."""
    ps = _ln_warp(D, dtype) + _ln_block(D, dtype)
    return ps[0] if ps else dict(LN_LOOP)


def ln_candidates(D: int, dtype: CudaDataType) -> List[Dict[str, Any]]:
    """Every plan able to run rows of D, the rule's first, "loop" last."""
    out = [ln_plan(D, dtype)]
    for p in _ln_warp(D, dtype) + _ln_block(D, dtype) + [dict(LN_LOOP)]:
        if p not in out:
            out.append(p)
    return out


def ln_capacity(plan: Dict[str, Any], dtype: CudaDataType) -> int:
    """Elements of a row a register plan's lanes hold (0 for "loop")."""
    return plan["tpr"] * plan["nv"] * _vec(dtype)


def ln_prepare(m: Any, plan: Dict[str, Any], dtype: CudaDataType, D: int, dev: int,
               aligned: bool) -> Dict[str, Any]:
    """The plan with what its launches need: compiled kernel names, the rows kernel's shared
    memory and resident blocks on this device (register plans), the finalize kernel."""
    info = m.backend.get_device_info(dev)
    q = dict(plan, sms=int(info.multiprocessor_count), aligned=bool(aligned),
             final=m.kernel(LN_TEMPLATE, dev, **ln_params(dtype, "finalize")).name)
    if plan["mode"] == "loop":
        q["rowstats"] = m.kernel(LN_TEMPLATE, dev, **ln_params(dtype, "rowstats")).name
        q["apply"] = m.kernel(LN_TEMPLATE, dev, **ln_params(dtype, "apply")).name
        return q
    if ln_prefetches(plan, aligned) and not ln_prefetch_fits(plan, dtype, info):
        plan = dict(plan, prefetch=False)   # the same rows without the stages
        q["prefetch"] = False
    kernel = m.kernel(LN_TEMPLATE, dev, **ln_params(dtype, "rows", plan, aligned))
    rpb = plan["block"] // plan["tpr"]
    smem = rpb * 2 * ln_capacity(plan, dtype) * _acc_dtype(dtype).itemsize + \
        ln_stage_bytes(plan, aligned)
    q.update(rows=kernel.name, smem=smem, rpb=rpb,
             resident=q["sms"] * occupancy.blocks_per_sm(kernel, info, plan["block"], smem))
    return q


def _ln_prepared(m: Any, dtype: CudaDataType, D: int, dev: int, aligned: bool) -> Dict[str, Any]:
    """The rule's prepared plan for (device, dtype, D, aligned), memoized per CudaMath."""
    per = _prepared.get(m)
    if per is None:
        per = _prepared.setdefault(m, {})
    key = ("ln", dev, dtype, D, aligned)
    q = per.get(key)
    if q is None:
        q = ln_prepare(m, ln_plan(D, dtype), dtype, D, dev, aligned)
        if len(per) >= 4096:
            per.clear()
        per[key] = q
    return q


def ln_geometry(q: Dict[str, Any], rows: int, D: int, vec_ok: bool,
                dtype: CudaDataType) -> Dict[str, Any]:
    """Launch sizes of a prepared plan over rows: the main kernel's grid and block, the
    partial rows it writes (nparts) and the workspace bytes (loop: the row statistics, then
    the partials)."""
    asz = _acc_dtype(dtype).itemsize
    if q["mode"] == "loop":
        w = _vec(dtype) if vec_ok else 1
        gx = -(-(D // w) // LN_APPLY_BLOCK)
        splits = max(1, min(rows, -(-(q["sms"] * LN_APPLY_BLOCKS_PER_SM) // gx), 65535))
        stats_bytes = rows * 4 * asz
        return {"stats_grid": (max(1, min(rows, 2**31 - 1)), 1, 1),
                "grid": (gx, splits, 1), "block": (LN_APPLY_BLOCK, 1, 1), "nparts": splits,
                "stats_bytes": stats_bytes, "ws_bytes": stats_bytes + splits * 2 * D * asz}
    grid = max(1, min(-(-rows // q["rpb"]), q["resident"]))
    return {"grid": (grid, 1, 1), "block": (q["block"], 1, 1), "nparts": grid,
            "stats_bytes": 0, "ws_bytes": grid * 2 * D * asz}


def ln_launch(m: Any, q: Dict[str, Any], g: CudaTensor, x: CudaTensor, w: Optional[CudaTensor],
              dx: CudaTensor, dw: Optional[CudaTensor], db: CudaTensor, eps: float) -> None:
    """The launches of a prepared plan (its `aligned` must match the pointers and D) over
    the rows of g and x into dx, dw (or None) and db, with a workspace freed after them
    (stream-ordered)."""
    D = x.shape[-1]
    rows = x.size // D
    dev, dtype = x.device_id, x.dtype
    geo = ln_geometry(q, rows, D, q["aligned"], dtype)
    launch = m.backend.launch_kernel
    wp = w if w is not None else 0
    ws = m.backend.empty((geo["ws_bytes"] // _acc_dtype(dtype).itemsize,),
                         _acc_dtype(dtype), dev)
    try:
        parts = ws.ptr + geo["stats_bytes"]
        if q["mode"] == "loop":
            vec_ok = int(q["aligned"])
            launch(q["rowstats"], geo["stats_grid"], g, x, wp, ws, rows, D, vec_ok, 1.0 / D, eps,
                   block_size=(LN_ROWSTATS_BLOCK, 1, 1), device_id=dev)
            launch(q["apply"], geo["grid"], g, x, wp, ws, dx, parts, rows, D, vec_ok,
                   block_size=geo["block"], device_id=dev)
        else:
            launch(q["rows"], geo["grid"], g, x, wp, dx, parts, rows, D, q["tpr"], 1.0 / D, eps,
                   block_size=geo["block"], shared_mem=q["smem"], device_id=dev)
        launch(q["final"], (-(-D // 32), 1, 1), parts, geo["nparts"], D,
               dw if dw is not None else 0, db, block_size=LN_FINAL_BLOCK, device_id=dev)
    finally:
        ws.free()


# -- layer norm: the op ------------------------------------------------------------------------
def layer_norm_backward(m: Any, grad_out: CudaTensor, x: CudaTensor,
                        weight: Optional[CudaTensor] = None, eps: float = 1e-5
                        ) -> Tuple[CudaTensor, Optional[CudaTensor], CudaTensor]:
    """(grad_x, grad_weight (None when weight is None), grad_bias) of layer_norm(x, weight,
    bias, eps) over the last axis, for the gradient grad_out of its output; grad_weight and
    grad_bias have shape (D,), all in x's dtype."""
    if type(x) is CudaTensor and type(eps) is float:
        # the per-call plan (ops/common.py remember_plan); float eps only, so that no
        # equal-valued bool reaches it unchecked
        fast = m.plans.get(("layer_norm_backward", x.shape, x.dtype, x.device_id, eps,
                            weight is None))
        if fast is not None and m.backend.direct_launch(x.device_id):
            res = fast(grad_out, x, weight)
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
    vec = _vec(dtype)
    ptrs = [g.ptr, x.ptr, dx.ptr] + ([weight.ptr] if weight is not None else [])
    aligned = D % vec == 0 and not any(p & 15 for p in ptrs)
    q = _ln_prepared(m, dtype, D, dev, aligned)
    if x.size == 0:   # no rows: grad_weight and grad_bias are sums over nothing
        m.backend.launch_kernel(q["final"], (-(-D // 32), 1, 1), 0, 0, D,
                                dw if dw is not None else 0, db, block_size=LN_FINAL_BLOCK,
                                device_id=dev)
        return dx, dw, db
    ln_launch(m, q, g, x, weight, dx, dw, db, eps)
    key = ("layer_norm_backward", x.shape, dtype, dev, eps, weight is None)
    if key not in m.plans:
        common.remember_plan(m, key, _ln_plan(m, x, weight is not None, eps))
    return dx, dw, db


def _ln_plan(m: Any, x: CudaTensor, has_weight: bool, eps: float) -> Any:
    """The per-call plan of layer_norm_backward on inputs shaped like x (ops/common.py
    remember_plan): grad_out and weight checked as the general path would (a mismatch returns
    None: the general path raises), the results and the workspace allocated, the general
    path's launches prepared for both alignments (aligned pointers and D % vec == 0 take the
    16-byte kernels)."""
    backend = m.backend
    dev, shape, dtype = x.device_id, x.shape, x.dtype
    size, nbytes = x.size, x.nbytes
    D = shape[-1]
    rows, inv_d, vec = size // D, 1.0 / D, _vec(dtype)
    vec_rows = D % vec == 0
    dshape, dbytes = (D,), D * dtype.itemsize
    prep = backend.prepare_launch
    variants = {}
    for aligned in ((False, True) if vec_rows else (False,)):
        q = _ln_prepared(m, dtype, D, dev, aligned)
        geo = ln_geometry(q, rows, D, aligned, dtype)
        final = prep(backend.get_kernel(q["final"], dev), (-(-D // 32), 1, 1), LN_FINAL_BLOCK,
                     0, dev)
        if q["mode"] == "loop":
            first = prep(backend.get_kernel(q["rowstats"], dev), geo["stats_grid"],
                         (LN_ROWSTATS_BLOCK, 1, 1), 0, dev)
            second = prep(backend.get_kernel(q["apply"], dev), geo["grid"], geo["block"], 0, dev)
        else:
            first = prep(backend.get_kernel(q["rows"], dev), geo["grid"], geo["block"],
                         q["smem"], dev)
            second = None
        variants[aligned] = (first, second, final, geo, q["tpr"])
    pool = backend.memory_pools[dev]
    alloc, release = pool.allocate_current, pool.release
    direct = backend.direct_launch

    def run(g: Any, x: CudaTensor, weight: Any) -> Any:
        if type(g) is not CudaTensor:
            return None
        pg, px = g._ptr, x._ptr
        if pg is None or px is None or g.shape != shape or g.dtype is not dtype or \
                g.device_id != dev or g.stream is not None or x.stream is not None or \
                not direct(dev):
            return None
        pw = common.plan_pointer(weight, dshape, dtype, dev) if has_weight else 0
        if pw is None:
            return None
        dx = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        db = pool_tensor(dshape, dtype, dev, alloc(dbytes), pool, D, dbytes)
        dw = pool_tensor(dshape, dtype, dev, alloc(dbytes), pool, D, dbytes) \
            if has_weight else None
        pdx = dx._ptr
        aligned = vec_rows and not (pg | px | pdx | pw) & 15
        first, second, final, geo, tpr = variants[aligned]
        ws = alloc(geo["ws_bytes"])
        try:
            base = int(ws)
            parts = base + geo["stats_bytes"]
            if second is not None:
                vec_ok = int(aligned)
                first(pg, px, pw, base, rows, D, vec_ok, inv_d, eps)
                second(pg, px, pw, base, pdx, parts, rows, D, vec_ok)
            else:
                first(pg, px, pw, pdx, parts, rows, D, tpr, inv_d, eps)
            final(parts, geo["nparts"], D, dw._ptr if dw is not None else 0, db._ptr)
        finally:
            release(ws)   # as ws.free() in the general path: stream-ordered
        return dx, dw, db
    return run


# -- batch norm ------------------------------------------------------------------------------
def bn_geometry(layout: str, N: int, C: int, S: int, vec_ok: int, vec: int,
                sms: int) -> Dict[str, Any]:
    """Launch sizes of batch_norm_backward for one shape (count N * S > 0) and vec_ok: the
    passes' ("reduce", "eval") grid, block, splits, chunk and `terms` (the most elements one
    thread adds into one sum), and "apply"'s grid and block."""
    w = vec if vec_ok else 1
    SW = S // w if layout == "ncs" else 1
    if layout == "nc":
        bx, by = nc_block(C // w, BN_BLOCK)
        gx = -(-(C // w) // bx)
        splits = max(1, min(-(-N // by), -(-(sms * BN_PASS_BLOCKS_PER_SM) // gx), 65535))
        gy = max(1, min(-(-N // (by * BN_UNROLL["nc"])), 65535))
        return {"grid": (gx, splits, 1), "block": (bx, by, 1), "splits": splits, "chunk": 0,
                "SW": SW, "terms": -(-N // (splits * by)), "apply_grid": (gx, gy, 1),
                "apply_block": (bx, by, 1)}
    per_channel = N * SW
    splits = max(1, min(-(-per_channel // (BN_BLOCK * BN_UNROLL["ncs"])),
                        -(-(sms * BN_PASS_BLOCKS_PER_SM) // C), 65535))
    chunk = -(-per_channel // splits)
    splits = -(-per_channel // chunk)   # no empty split
    items = N * C * SW
    grid = max(1, min(-(-items // (BN_BLOCK * BN_UNROLL["ncs"])), 2**31 - 1))
    return {"grid": (C, splits, 1), "block": (BN_BLOCK, 1, 1), "splits": splits,
            "chunk": chunk, "SW": SW, "terms": -(-chunk // BN_BLOCK) * w,
            "apply_grid": (grid, 1, 1), "apply_block": (BN_BLOCK, 1, 1)}


def _bn_kernels(m: Any, dtype: CudaDataType, layout: str, training: bool,
                dev: int) -> Dict[str, str]:
    """Compiled kernel names of one (dtype, layout, mode), memoized per CudaMath."""
    per = _prepared.get(m)
    if per is None:
        per = _prepared.setdefault(m, {})
    key = ("bn", dev, dtype, layout, training)
    q = per.get(key)
    if q is None:
        k = m.kernel
        if training:
            q = {"pass": k(BN_TEMPLATE, dev, **bn_params(dtype, "reduce", layout)).name,
                 "final": k(BN_TEMPLATE, dev, **bn_params(dtype, "finalize", mode="train")).name,
                 "apply": k(BN_TEMPLATE, dev, **bn_params(dtype, "apply", layout)).name}
        else:
            q = {"pass": k(BN_TEMPLATE, dev, **bn_params(dtype, "eval", layout)).name,
                 "final": k(BN_TEMPLATE, dev, **bn_params(dtype, "finalize", mode="eval")).name}
        if len(per) >= 4096:
            per.clear()
        per[key] = q
    return q


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
        fast = m.plans.get(("batch_norm_backward", input.shape, input.dtype, input.device_id,
                            eps, training))
        if fast is not None and m.backend.direct_launch(input.device_id):
            res = fast(grad_out, input, gamma, running_mean, running_var)
            if res is not None:
                return res
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
    N = x.shape[0]
    S = int(np.prod(x.shape[2:], dtype=np.int64)) if x.ndim > 2 else 1
    count = N * S
    if training and C > 0 and count <= 1:
        raise InvalidArgumentError(
            f"{op} with training=True needs more than 1 value per channel, got input shape "
            f"{x.shape} ({count} per channel)")
    if not m.gpu:
        params = [common.host_array(m, gamma)]
        if not training:   # (checked above: both given)
            params += [common.host_array(m, cast(CudaTensor, running_mean)),
                       common.host_array(m, cast(CudaTensor, running_var))]
        dx, dg, dbeta = reference("batch_norm", common.host_array(m, g), common.host_array(m, x),
                                  *params, eps=eps, training=training)
        return (_host_out(m, dx, dtype, dev), _host_out(m, cast(np.ndarray, dg), dtype, dev),
                _host_out(m, dbeta, dtype, dev))
    dx = m.backend.empty(x.shape, dtype, dev)
    dgamma = m.backend.empty((C,), dtype, dev)
    dbeta = m.backend.empty((C,), dtype, dev)
    if C == 0:
        return dx, dgamma, dbeta
    layout = "nc" if S == 1 else "ncs"
    ks = _bn_kernels(m, dtype, layout, training, dev)
    final_grid = (-(-C // BN_FINAL_CHANNELS), 1, 1)
    launch = m.backend.launch_kernel
    if count == 0:   # inference on an empty batch: sums over nothing
        launch(ks["final"], final_grid, 0, 0, C, running_var, eps, dgamma, dbeta,
               block_size=(BN_BLOCK, 1, 1), device_id=dev)
        return dx, dgamma, dbeta
    vec = _vec(dtype)
    aligned = not ((g.ptr | x.ptr | dx.ptr) & 15)
    vec_ok = int(aligned and (C % vec == 0 if layout == "nc" else S % vec == 0))
    sms = int(m.backend.get_device_info(dev).multiprocessor_count)
    geo = bn_geometry(layout, N, C, S, vec_ok, vec, sms)
    _bn_launch(m, ks, geo, training, g, x, dx, gamma, running_mean, running_var, dgamma, dbeta,
               eps, N, C, S, count, vec_ok)
    key = ("batch_norm_backward", x.shape, dtype, dev, eps, training)
    if key not in m.plans:
        common.remember_plan(m, key, _bn_plan(m, ks, x, training, eps, sms))
    return dx, dgamma, dbeta


def _bn_args(geo: Dict[str, Any], N: int, C: int, S: int, vec_ok: int
             ) -> Tuple[tuple, tuple]:
    """The trailing arguments of the passes and of "apply"."""
    SW = geo["SW"]
    sw_div = fast_divisor(SW)
    pass_tail = (N, C, S, *sw_div, geo["chunk"], vec_ok)
    apply_tail = (N, C, N * C * SW, *sw_div, *fast_divisor(C)[1:], vec_ok)
    return pass_tail, apply_tail


def _bn_launch(m: Any, ks: Dict[str, str], geo: Dict[str, Any], training: bool,
               g: CudaTensor, x: CudaTensor, dx: CudaTensor, gamma: CudaTensor,
               mean: Optional[CudaTensor], var: Optional[CudaTensor], dgamma: CudaTensor,
               dbeta: CudaTensor, eps: float, N: int, C: int, S: int, count: int,
               vec_ok: int) -> None:
    """The general path's launches, with a workspace (partials, then for training the
    per-channel coefficients) freed after them (stream-ordered)."""
    dev, adt = x.device_id, _acc_dtype(x.dtype)
    nsum = 4 if training else 2
    splits = geo["splits"]
    pass_tail, apply_tail = _bn_args(geo, N, C, S, vec_ok)
    ws = m.backend.empty((splits * C * nsum + (C * 4 if training else 0),), adt, dev)
    launch = m.backend.launch_kernel
    final_grid = (-(-C // BN_FINAL_CHANNELS), 1, 1)
    try:
        parts = ws.ptr
        if training:
            coef = parts + splits * C * nsum * adt.itemsize
            launch(ks["pass"], geo["grid"], x, g, 0, 0, 0, 0, 0.0, parts, *pass_tail,
                   block_size=geo["block"], device_id=dev)
            launch(ks["final"], final_grid, x, parts, splits, C, 1 if S == 1 else S, count,
                   gamma, eps, dgamma, dbeta, coef, block_size=(BN_BLOCK, 1, 1), device_id=dev)
            launch(ks["apply"], geo["apply_grid"], coef, x, g, dx, *apply_tail,
                   block_size=geo["apply_block"], device_id=dev)
        else:
            launch(ks["pass"], geo["grid"], x, g, dx, gamma, mean, var, eps, parts, *pass_tail,
                   block_size=geo["block"], device_id=dev)
            launch(ks["final"], final_grid, parts, splits, C, var, eps, dgamma, dbeta,
                   block_size=(BN_BLOCK, 1, 1), device_id=dev)
    finally:
        ws.free()


def _bn_plan(m: Any, ks: Dict[str, str], x: CudaTensor, training: bool, eps: float,
             sms: int) -> Any:
    """The per-call plan of batch_norm_backward on inputs shaped like x (ops/common.py
    remember_plan): grad_out, gamma and the running statistics checked as the general path
    would (a mismatch returns None: the general path raises), the results and the workspace
    allocated, the general path's launches prepared for both values of vec_ok (it depends on
    the pointers and changes the geometry, not the kernels)."""
    backend = m.backend
    dev, shape, dtype = x.device_id, x.shape, x.dtype
    size, nbytes = x.size, x.nbytes
    N, C = shape[0], shape[1]
    S = int(np.prod(shape[2:], dtype=np.int64)) if len(shape) > 2 else 1
    count = N * S
    layout = "nc" if S == 1 else "ncs"
    vec = _vec(dtype)
    can_vec = C % vec == 0 if layout == "nc" else S % vec == 0
    cshape, cbytes = (C,), C * dtype.itemsize
    adt = _acc_dtype(dtype)
    nsum = 4 if training else 2
    prep, get = backend.prepare_launch, backend.get_kernel
    final = prep(get(ks["final"], dev), (-(-C // BN_FINAL_CHANNELS), 1, 1), (BN_BLOCK, 1, 1), 0,
                 dev)
    variants = []   # by vec_ok: (pass, its tail, apply, its tail, splits, ws bytes)
    for vec_ok in ((0, 1) if can_vec else (0,)):
        geo = bn_geometry(layout, N, C, S, vec_ok, vec, sms)
        pass_tail, apply_tail = _bn_args(geo, N, C, S, vec_ok)
        first = prep(get(ks["pass"], dev), geo["grid"], geo["block"], 0, dev)
        second: Any = prep(get(ks["apply"], dev), geo["apply_grid"], geo["apply_block"], 0,
                           dev) if training else None
        splits = geo["splits"]
        ws_bytes = (splits * C * nsum + (C * 4 if training else 0)) * adt.itemsize
        variants.append((first, pass_tail, second, apply_tail, splits, ws_bytes))
    pool = backend.memory_pools[dev]
    alloc, release = pool.allocate_current, pool.release
    direct = backend.direct_launch
    kstride = 1 if S == 1 else S

    def run(g: Any, x: CudaTensor, gamma: Any, mean: Any, var: Any) -> Any:
        if type(g) is not CudaTensor:
            return None
        pg, px = g._ptr, x._ptr
        if pg is None or px is None or g.shape != shape or g.dtype is not dtype or \
                g.device_id != dev or g.stream is not None or x.stream is not None or \
                not direct(dev):
            return None
        stats = (gamma,) if training else (gamma, mean, var)
        if not training and (mean is None or var is None):
            return None
        for t in stats:
            if type(t) is not CudaTensor or t.shape != cshape or t.dtype is not dtype or \
                    t.device_id != dev or t.stream is not None or t._ptr is None:
                return None
        for t in ((mean, var) if training else ()):
            if t is not None and (type(t) is not CudaTensor or t.shape != cshape or
                                  t.dtype is not dtype or t.device_id != dev or
                                  t._ptr is None):
                return None
        dx = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        dgamma = pool_tensor(cshape, dtype, dev, alloc(cbytes), pool, C, cbytes)
        dbeta = pool_tensor(cshape, dtype, dev, alloc(cbytes), pool, C, cbytes)
        pdx = dx._ptr
        first, pass_tail, second, apply_tail, splits, ws_bytes = \
            variants[1 if can_vec and not (pg | px | pdx) & 15 else 0]
        ws = alloc(ws_bytes)
        try:
            parts = int(ws)
            if training:
                coef = parts + splits * C * nsum * adt.itemsize
                first(px, pg, 0, 0, 0, 0, 0.0, parts, *pass_tail)
                final(px, parts, splits, C, kstride, count, gamma._ptr, eps, dgamma._ptr,
                      dbeta._ptr, coef)
                second(coef, px, pg, pdx, *apply_tail)
            else:
                first(px, pg, pdx, gamma._ptr, mean._ptr, var._ptr, eps, parts, *pass_tail)
                final(parts, splits, C, var._ptr, eps, dgamma._ptr, dbeta._ptr)
        finally:
            release(ws)   # as ws.free() in the general path: stream-ordered
        return dx, dgamma, dbeta
    return run
