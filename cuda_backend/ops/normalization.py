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

import functools
import math
import weakref
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .. import occupancy
from ..dtypes import CudaDataType, to_bfloat16_bits
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..kernels import dtype_params
from ..tensor import CudaTensor, pool_tensor
from . import common
from .pooling import fast_divisor

DT = CudaDataType
DTYPES = common.FLOATS
BN_TEMPLATE = "batch_norm.cu.j2"
LN_TEMPLATE = "layer_norm.cu.j2"
TEMPLATES = (BN_TEMPLATE, LN_TEMPLATE)
BLOCK = 256
UNROLL = 4            # rows (nc) or items (ncs) per thread in the normalize kernels
STATS_BLOCKS_PER_SM = 4  # statistics pass: about one resident wave of looping blocks

# layer_norm register configs (threads_per_row, vpt, block_size), by capacity in vectors.
LN_VEC_CONFIGS = ((32, 1, 256), (32, 2, 256), (32, 4, 256), (32, 8, 256),
                  (128, 4, 128), (128, 8, 128), (256, 2, 256), (256, 4, 256), (256, 8, 256),
                  (512, 2, 512), (512, 4, 512), (512, 8, 512), (1024, 2, 1024),
                  (1024, 4, 1024), (1024, 8, 1024))
# the same kernel, persistent with next-row prefetch (block per row only)
LN_PREFETCH_CONFIGS = ((128, 4, 128), (256, 2, 256), (256, 4, 256), (512, 2, 512),
                       (512, 4, 512), (1024, 2, 1024))
LN_SCALAR_CONFIGS = ((32, 4, 256), (256, 4, 256), (1024, 8, 1024))
LN_LOOP_BLOCK = 512
LN_PERSIST_WAVES = 1  # persistent grid: this many times the resident blocks per SM
LN_WORK_REGS = 24     # registers besides the row's vectors (block per row; float64: next)
LN_WORK_REGS_F64 = 32
# layer_norm candidate lists already compiled, per CudaMath: (device, dtype, D, use_vec)
_ln_compiled: "weakref.WeakKeyDictionary[Any, set]" = weakref.WeakKeyDictionary()


def _vec(dtype: CudaDataType) -> int:
    return 16 // dtype.itemsize


# -- template parameter sets ---------------------------------------------------------------
def _bn_params(dtype: CudaDataType, kernel: str, layout: str = "",
               mode: str = "") -> Dict[str, Any]:
    """batch_norm.cu.j2 parameters: only the keys the kernel's branch of the template uses."""
    p: Dict[str, Any] = {**dtype_params(dtype), "kernel": kernel, "block_size": BLOCK}
    if kernel != "finalize":
        p.update(layout=layout, vec=_vec(dtype))
    if kernel == "normalize":
        p["mode"] = mode
    return p


@functools.lru_cache(maxsize=None)
def _ln_min_blocks(dtype: CudaDataType, tpr: int, vpt: int, block: int, vec: int,
                   prefetch: bool) -> int:
    """Resident blocks per SM the kernel's register budget allows (__launch_bounds__).
    Warp-per-row and looping kernels keep their measured 1024 threads per SM; block-per-row
    ones take as many blocks as the register file holds for their vectors (x2 with prefetch)
    plus the working registers (occupancy.blocks_per_sm, Hopper's limits). All compile
    spill-free."""
    if tpr == 32 or vpt == 0:
        return 1 if block >= 1024 else 1024 // block
    words = vpt * max(1, vec * dtype.itemsize // 4) * (2 if prefetch else 1)
    need = words + (LN_WORK_REGS_F64 if dtype is DT.FLOAT64 else LN_WORK_REGS)
    return occupancy.blocks_per_sm(occupancy.KernelResources(need), None, block)


def _ln_params(dtype: CudaDataType, tpr: int, vpt: int, block: int, vec: int,
               prefetch: bool = False) -> Dict[str, Any]:
    return {**dtype_params(dtype), "threads_per_row": tpr, "vpt": vpt, "vec": vec,
            "block_size": block,
            "min_blocks": _ln_min_blocks(dtype, tpr, vpt, block, vec, prefetch),
            "prefetch": bool(prefetch)}


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set batch_norm and layer_norm render."""
    bn, ln = [], []
    for dt in DTYPES:
        for layout in ("nc", "ncs"):
            for mode in ("infer", "train"):
                bn.append(_bn_params(dt, "normalize", layout, mode))
            bn.append(_bn_params(dt, "stats", layout))
        bn.append(_bn_params(dt, "finalize"))
        for tpr, vpt, block in LN_VEC_CONFIGS:
            ln.append(_ln_params(dt, tpr, vpt, block, _vec(dt)))
        for tpr, vpt, block in LN_PREFETCH_CONFIGS:
            ln.append(_ln_params(dt, tpr, vpt, block, _vec(dt), True))
        for tpr, vpt, block in LN_SCALAR_CONFIGS:
            ln.append(_ln_params(dt, tpr, vpt, block, 1))
        for vec in (_vec(dt), 1):
            ln.append(_ln_params(dt, LN_LOOP_BLOCK, 0, LN_LOOP_BLOCK, vec))
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
        fast = m.plans.get(("batch_norm", x.shape, x.dtype, x.device_id, eps, momentum,
                            training))
        if fast is not None and m.backend.direct_launch(x.device_id):
            res = fast(x, gamma, beta, mean, var)
            if res is not None:
                return res
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
    N = x.shape[0]
    S = int(np.prod(x.shape[2:], dtype=np.int64)) if x.ndim > 2 else 1
    count = N * S
    if training and C > 0 and count <= 1:
        raise InvalidArgumentError(
            f"batch_norm training needs more than 1 value per channel, got input shape "
            f"{x.shape} ({count} per channel)")
    if out is not None:
        _check_out(out, x)
    if not m.gpu:
        return _bn_host(m, x, gamma, beta, mean, var, eps, training, momentum, out)
    owned = out is None
    if out is None:     # (owned)
        out = m.backend.empty(x.shape, x.dtype, dev)
    if x.size == 0:
        return out
    layout = "nc" if S == 1 else "ncs"
    vec = _vec(x.dtype)
    aligned = x.ptr % 16 == 0 and out.ptr % 16 == 0
    vec_ok = int(aligned and (C % vec == 0 if layout == "nc" else S % vec == 0))
    sm = m.backend.get_device_info(dev).multiprocessor_count
    geo = _bn_geometry(layout, N, C, S, vec_ok, vec, sm)
    tail = geo["tail"]
    if not training:
        kernel = m.kernel(BN_TEMPLATE, dev, **_bn_params(x.dtype, "normalize", layout, "infer"))
        m.backend.launch_kernel(kernel.name, geo["grid"], x, out, gamma, beta, mean, var, eps,
                                *tail, block_size=geo["block"], device_id=dev)
    else:
        acc_itemsize = 8 if x.dtype is DT.FLOAT64 else 4
        acc_dtype = DT.FLOAT64 if x.dtype is DT.FLOAT64 else DT.FLOAT32
        splits = geo["splits"]
        ws = m.backend.empty(((splits * 2 + 2) * C,), acc_dtype, dev)
        try:
            base = ws.ptr
            partials = base
            ws_mean = base + splits * 2 * C * acc_itemsize
            ws_scale = ws_mean + C * acc_itemsize
            stats = m.kernel(BN_TEMPLATE, dev, **_bn_params(x.dtype, "stats", layout))
            m.backend.launch_kernel(stats.name, geo["stats_grid"], x, partials,
                                    *geo["stats_args"], block_size=geo["stats_block"],
                                    device_id=dev)
            fin = m.kernel(BN_TEMPLATE, dev, **_bn_params(x.dtype, "finalize"))
            m.backend.launch_kernel(fin.name, (-(-C // BLOCK), 1, 1), x, partials, splits, C,
                                    1 if layout == "nc" else S, count, gamma, mean, var,
                                    ws_mean, ws_scale, eps, momentum, block_size=(BLOCK, 1, 1),
                                    device_id=dev)
            norm = m.kernel(BN_TEMPLATE, dev, **_bn_params(x.dtype, "normalize", layout,
                                                           "train"))
            m.backend.launch_kernel(norm.name, geo["grid"], x, out, ws_mean, ws_scale, beta,
                                    *tail, block_size=geo["block"], device_id=dev)
        finally:
            ws.free()  # stream-ordered: a later allocation's kernels run after these
    if owned and type(training) is bool:
        key = ("batch_norm", x.shape, x.dtype, dev, eps, momentum, training)
        if key not in m.plans:
            common.remember_plan(m, key, _bn_plan(m, x, eps, momentum, bool(training), sm))
    return out


def _bn_geometry(layout: str, N: int, C: int, S: int, vec_ok: int, vec: int,
                 sm: int) -> Dict[str, Any]:
    """The launch sizes of batch_norm for one input shape and vec_ok: the normalize kernel's
    grid, block and trailing arguments (N, C, items, S/W and C as FastDiv, vec_ok), the
    statistics pass's grid, block, splits and arguments after (x, partials)."""
    w = vec if vec_ok else 1
    SW = S // w if layout == "ncs" else 1  # items per plane ("nc": vectors run along C)
    tail = (N, C, N * C * SW, *fast_divisor(SW), *fast_divisor(C)[1:], vec_ok)
    grid, block = _normalize_geometry(layout, N, C, S, w)
    if layout == "nc":
        bx, by = nc_block(C // w)
        gx = -(-(C // w) // bx)
        splits = max(1, min(-(-N // by), -(-(sm * STATS_BLOCKS_PER_SM) // gx), 65535))
        stats_grid, stats_block = (gx, splits, 1), (bx, by, 1)
        chunk = 0
    else:
        per_channel = N * SW
        splits = max(1, min(-(-per_channel // (BLOCK * UNROLL)),
                            -(-(sm * STATS_BLOCKS_PER_SM) // C), 65535))
        chunk = -(-per_channel // splits)
        splits = -(-per_channel // chunk)  # no empty split
        stats_grid, stats_block = (C, splits, 1), (BLOCK, 1, 1)
    return {"tail": tail, "grid": grid, "block": block, "splits": splits,
            "stats_grid": stats_grid, "stats_block": stats_block,
            "stats_args": (N, C, S, *fast_divisor(SW), chunk, vec_ok)}


def _bn_plan(m: Any, x: CudaTensor, eps: float, momentum: float, training: bool,
             sm: int) -> Any:
    """The per-call plan of batch_norm on inputs shaped like x (ops/common.py
    remember_plan): gamma, beta and the running statistics checked as the general path
    would (a mismatch returns None: the general path raises), the result allocated, and the
    general path's launches prepared for both values of vec_ok (it depends on the pointers
    and changes the geometry, not the kernels): inference one launch; training the
    statistics pass, the finalize (which updates the running mean and variance in place)
    and the normalize pass, with the workspace allocated before and released after them as
    the general path does."""
    dev, shape, dtype = x.device_id, x.shape, x.dtype
    size, nbytes = x.size, x.nbytes
    N, C = shape[0], shape[1]
    S = int(np.prod(shape[2:], dtype=np.int64)) if len(shape) > 2 else 1
    count = N * S
    layout = "nc" if S == 1 else "ncs"
    vec = _vec(dtype)
    can_vec = C % vec == 0 if layout == "nc" else S % vec == 0
    cshape = (C,)
    acc_itemsize = 8 if dtype is DT.FLOAT64 else 4
    prep, bk = m.backend.prepare_launch, m.kernel
    norm = bk(BN_TEMPLATE, dev, **_bn_params(dtype, "normalize", layout,
                                             "train" if training else "infer"))
    if training:
        stats = bk(BN_TEMPLATE, dev, **_bn_params(dtype, "stats", layout))
        fin = prep(bk(BN_TEMPLATE, dev, **_bn_params(dtype, "finalize")),
                   (-(-C // BLOCK), 1, 1), (BLOCK, 1, 1), 0, dev)
    variants = []  # by vec_ok: (normalize, its tail, stats, its args, splits, ws bytes)
    for vec_ok in ((0, 1) if can_vec else (0,)):
        geo = _bn_geometry(layout, N, C, S, vec_ok, vec, sm)
        go = prep(norm, geo["grid"], geo["block"], 0, dev)
        if training:
            splits = geo["splits"]
            variants.append((go, geo["tail"], prep(stats, geo["stats_grid"],
                                                   geo["stats_block"], 0, dev),
                             geo["stats_args"], splits, (splits * 2 + 2) * C * acc_itemsize))
        else:
            variants.append((go, geo["tail"], None, (), 0, 0))
    pool = m.backend.memory_pools[dev]
    alloc, release = pool.allocate_current, pool.release
    S_fin = 1 if layout == "nc" else S
    c_bytes = C * acc_itemsize

    def run(x: CudaTensor, gamma: Any, beta: Any, mean: Any, var: Any) -> Optional[CudaTensor]:
        px = x._ptr
        if px is None or x.stream is not None:
            return None
        for t in (gamma, beta, mean, var):
            if type(t) is not CudaTensor or t.shape != cshape or t.dtype is not dtype or \
                    t.device_id != dev or t.stream is not None or t._ptr is None:
                return None
        out = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        po = out._ptr
        go, tail, stats_go, stats_args, splits, ws_bytes = \
            variants[1 if can_vec and not (px | po) & 15 else 0]
        if not training:
            go(px, po, gamma._ptr, beta._ptr, mean._ptr, var._ptr, eps, *tail)
            return out
        ws = alloc(ws_bytes)
        try:
            base = int(ws)
            ws_mean = base + splits * 2 * c_bytes
            ws_scale = ws_mean + c_bytes
            stats_go(px, base, *stats_args)
            fin(px, base, splits, C, S_fin, count, gamma._ptr, mean._ptr, var._ptr, ws_mean,
                ws_scale, eps, momentum)
            go(px, po, ws_mean, ws_scale, beta._ptr, *tail)
        finally:
            release(ws)  # as ws.free() in the general path
        return out
    return run


def nc_block(columns: int, block: int = BLOCK) -> Tuple[int, int]:
    """(bx, by) with bx*by = block: bx threads across the column vectors (a power of two,
    at least a warp), by rows (also ops/normalization_backward.py's)."""
    bx = 32
    while bx < columns and bx < block:
        bx *= 2
    return bx, block // bx


def _normalize_geometry(layout: str, N: int, C: int, S: int,
                        w: int) -> Tuple[Tuple[int, int, int], Tuple[int, int, int]]:
    """(grid, block) of the normalize kernel: "nc" one block per (bx column vectors,
    by * UNROLL rows); "ncs" one UNROLL-item step per thread. Many short blocks rather than
    a few long ones, so no partly filled last wave of long blocks."""
    if layout == "nc":
        bx, by = nc_block(C // w)
        gx = -(-(C // w) // bx)
        gy = max(1, min(-(-N // (by * UNROLL)), 65535))
        return (gx, gy, 1), (bx, by, 1)
    items = N * C * (S // w)
    grid = max(1, min(-(-items // (BLOCK * UNROLL)), 2**31 - 1))
    return (grid, 1, 1), (BLOCK, 1, 1)


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
        write_host(m, (1 - momentum) * rm + momentum * mu, mean)
        write_host(m, (1 - momentum) * rv + momentum * v * n / (n - 1), var)
        scale = (g.astype(np.float64) / np.sqrt(v + eps)).astype(work)
        y = (a - mu.astype(work).reshape(bshape)) * scale.reshape(bshape) + b.reshape(bshape)
    else:
        mu = common.host_array(m, mean).astype(work)
        v = common.host_array(m, var).astype(work)
        scale = g / np.sqrt(v + work(eps))
        y = (a - mu.reshape(bshape)) * scale.reshape(bshape) + b.reshape(bshape)
    if out is None:
        return common.from_host(m, y, x.dtype, x.device_id)
    write_host(m, y, out)
    return out


# -- layer norm ----------------------------------------------------------------------------
def layer_norm(m: Any, x: CudaTensor, weight: Optional[CudaTensor],
               bias: Optional[CudaTensor], eps: float = 1e-5,
               out: Optional[CudaTensor] = None) -> CudaTensor:
    """Layer normalization over the last axis; weight/bias (D,) or None."""
    if out is None and type(x) is CudaTensor and type(eps) is float:
        # the per-call plan (ops/common.py remember_plan); float eps only, so that no
        # equal-valued bool reaches it unchecked
        fast = m.plans.get(("layer_norm", x.shape, x.dtype, x.device_id, eps, weight is None,
                            bias is None))
        if fast is not None and m.backend.direct_launch(x.device_id):
            res = fast(x, weight, bias)
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
        _check_out(out, x)
    if not m.gpu:
        return _ln_host(m, x, weight, bias, eps, out)
    owned = out is None
    if out is None:     # (owned)
        out = m.backend.empty(x.shape, x.dtype, dev)
    if x.size == 0:
        return out
    rows = x.size // D
    vec = _vec(x.dtype)
    ptrs = [x.ptr, out.ptr] + [t.ptr for t in (weight, bias) if t is not None]
    use_vec = D % vec == 0 and all(p % 16 == 0 for p in ptrs)
    cfg = _ln_pick(m, x, out, weight, bias, rows, D, eps, use_vec)
    _ln_launch(m, cfg, x, out, weight, bias, rows, D, eps)
    if owned:
        key = ("layer_norm", x.shape, x.dtype, dev, eps, weight is None, bias is None)
        plan = m.plans.get(key)
        if not hasattr(plan, "variants"):
            plan = common.remember_plan(m, key, _ln_plan(m, x, weight is not None,
                                                         bias is not None, eps))
        if use_vec not in plan.variants:  # the config the autotuner picked, if it did
            kernel, grid, block = _ln_geometry(m, cfg, x.dtype, dev, rows)
            plan.variants[use_vec] = m.backend.prepare_launch(kernel, (grid, 1, 1),
                                                              (block, 1, 1), 0, dev)
    return out


def _ln_plan(m: Any, x: CudaTensor, has_weight: bool, has_bias: bool, eps: float) -> Any:
    """The per-call plan of layer_norm on inputs shaped like x (ops/common.py
    remember_plan): weight/bias checked as the general path would (a mismatch returns None:
    the general path raises), the result allocated, one prepared launch. Which config runs
    depends on the pointers (use_vec, computed as layer_norm does): `variants` maps use_vec
    to the launch the general path chose for it, and a use_vec not seen yet returns None
    (the general path launches it and adds it)."""
    dev, shape, dtype = x.device_id, x.shape, x.dtype
    size, nbytes = x.size, x.nbytes
    D = shape[-1]
    rows, inv_d, vec = size // D, 1.0 / D, _vec(dtype)
    vec_rows = D % vec == 0
    dshape = (D,)
    pool = m.backend.memory_pools[dev]
    alloc = pool.allocate_current
    variants: Dict[bool, Any] = {}

    def run(x: CudaTensor, weight: Any, bias: Any) -> Optional[CudaTensor]:
        px = x._ptr
        if px is None or x.stream is not None:
            return None
        pw = common.plan_pointer(weight, dshape, dtype, dev) if has_weight else 0
        pb = common.plan_pointer(bias, dshape, dtype, dev) if has_bias else 0
        if pw is None or pb is None:
            return None
        out = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        po = out._ptr
        go = variants.get(vec_rows and not (px | po | pw | pb) & 15)
        if go is None:
            out.free()
            return None
        go(px, po, pw, pb, rows, D, inv_d, eps)
        return out
    run.variants = variants  # type: ignore[attr-defined]
    return run


LnConfig = Tuple[int, int, int, int, int]  # threads_per_row, vpt, block, vec, prefetch


def _ln_candidates(D: int, dtype: CudaDataType, use_vec: bool) -> List[LnConfig]:
    """(threads_per_row, vpt, block, vec, prefetch) configs able to hold a row of D, the
    tightest capacity only (plain before prefetch); the looping kernel when none can."""
    vec = _vec(dtype) if use_vec else 1
    configs = [(tpr, vpt, blk, 0) for tpr, vpt, blk in
               (LN_VEC_CONFIGS if use_vec else LN_SCALAR_CONFIGS)]
    if use_vec:
        configs += [(tpr, vpt, blk, 1) for tpr, vpt, blk in LN_PREFETCH_CONFIGS]
    fits = [c for c in configs if c[0] * c[1] * vec >= D]
    if not fits:
        return [(LN_LOOP_BLOCK, 0, LN_LOOP_BLOCK, vec, 0)]
    tightest = min(tpr * vpt for tpr, vpt, _, _ in fits)
    return [(tpr, vpt, blk, vec, pf) for tpr, vpt, blk, pf in fits if tpr * vpt == tightest]


candidates = _ln_candidates   # the registry's contract name: layer_norm's autotuned configs


def _ln_pick(m: Any, x: CudaTensor, out: CudaTensor, weight: Optional[CudaTensor],
             bias: Optional[CudaTensor], rows: int, D: int, eps: float,
             use_vec: bool) -> LnConfig:
    """The config for this row length: autotuned among equally tight ones for large inputs."""
    cands = _ln_candidates(D, x.dtype, use_vec)
    if len(cands) == 1 or x.size < 1 << 22:
        return cands[0]
    names = ("threads_per_row", "vpt", "block", "vec", "prefetch")
    keys = [dict(zip(names, c)) for c in cands]
    size_class = (x.dtype.name_str, D, "large" if x.size >= 1 << 25 else "medium")
    done = _ln_compiled.setdefault(m, set())
    if (x.device_id, x.dtype, D, use_vec) not in done:  # compile them all at once
        common.compile_all(m, [(LN_TEMPLATE, _ln_params(x.dtype, tpr, vpt, blk, vec, bool(pf)))
                               for tpr, vpt, blk, vec, pf in cands], x.device_id)
        done.add((x.device_id, x.dtype, D, use_vec))
    best = m.autotuner.pick("layer_norm", size_class, keys,
                            lambda k: _ln_launch(m, tuple(k[n] for n in names), x, out, weight,
                                                 bias, rows, D, eps),
                            device_id=x.device_id)
    return tuple(best[n] for n in names)


def _ln_launch(m: Any, cfg: LnConfig, x: CudaTensor, out: CudaTensor,
               weight: Optional[CudaTensor], bias: Optional[CudaTensor], rows: int, D: int,
               eps: float, max_grid: int = 0) -> None:
    """One launch of cfg; max_grid (tests) caps a persistent grid below its default of
    resident blocks per SM x SMs x LN_PERSIST_WAVES."""
    dev = x.device_id
    kernel, grid, block = _ln_geometry(m, cfg, x.dtype, dev, rows, max_grid)
    m.backend.launch_kernel(kernel.name, (grid, 1, 1), x, out,
                            weight if weight is not None else 0,
                            bias if bias is not None else 0, rows, D, 1.0 / D, eps,
                            block_size=(block, 1, 1), device_id=dev)


def _ln_geometry(m: Any, cfg: LnConfig, dtype: CudaDataType, dev: int, rows: int,
                 max_grid: int = 0) -> Tuple[Any, int, int]:
    """(compiled kernel, grid, block size) of one layer_norm launch of cfg over rows."""
    tpr, vpt, block, vec, prefetch = cfg
    params = _ln_params(dtype, tpr, vpt, block, vec, bool(prefetch))
    kernel = m.kernel(LN_TEMPLATE, dev, **params)
    rows_per_block = block // tpr
    grid = -(-rows // rows_per_block)
    if prefetch:
        sms = int(m.backend.get_device_info(dev).multiprocessor_count)
        grid = min(grid, max_grid or sms * params["min_blocks"] * LN_PERSIST_WAVES)
    if grid > 2**31 - 1:
        raise InvalidArgumentError(f"layer_norm supports under 2^31 row blocks, got {rows} rows")
    return kernel, grid, block


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
    write_host(m, y, out)
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


def _check_out(out: CudaTensor, x: CudaTensor) -> None:
    common.check_tensor(out, "out")
    if out.shape != x.shape or out.dtype is not x.dtype:
        raise ShapeMismatchError(
            f"out has shape {out.shape} ({out.dtype.name_str}), expected {x.shape} "
            f"({x.dtype.name_str})")
    common.same_device(x, out)


def write_host(m: Any, values: np.ndarray, t: CudaTensor) -> None:
    """Store values (any float type) into t, rounding once to its dtype."""
    values = np.asarray(values).reshape(t.shape)
    if t.dtype is DT.BFLOAT16:
        host = to_bfloat16_bits(values.astype(np.float32)).reshape(t.shape)
    else:
        host = np.ascontiguousarray(values, dtype=t.dtype.numpy_dtype)
    if t.nbytes:
        m.backend.copy_to_device(host, t)
