"""Batch normalization's kernels (`templates/batch_norm.cu.j2`): their parameters, the launch
geometry of an input shape, the general path's launches and the per-call plan that replays
them. ops/normalization.py's batch_norm checks the arguments and calls these;
ops/batch_norm_backward_plans.py shares nc_block.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..dtypes import CudaDataType
from ..kernels import dtype_params
from ..tensor import CudaTensor, pool_tensor
from . import common
from .normalization_common import DT, bn_layout, vec_width
from .pooling import fast_divisor

BN_TEMPLATE = "batch_norm.cu.j2"
BLOCK = 256
UNROLL = 4            # rows (nc) or items (ncs) per thread in the normalize kernels
STATS_BLOCKS_PER_SM = 4  # statistics pass: about one resident wave of looping blocks
BN_FUSE_MAX = 8192  # training, "ncs": N * S up to this per channel: one fused launch
# normalize "ncs": items a thread moves, by the blocks that makes per SM (perf/NOTES.md
# "Normalization" S18): 1 while that is at most 2 blocks per SM, 2 while at most 4, else UNROLL
ITEMS_BY_WAVES = ((1, 2), (2, 4))


# -- template parameters ---------------------------------------------------------------
def bn_params(dtype: CudaDataType, kernel: str, layout: str = "",
              mode: str = "") -> Dict[str, Any]:
    """batch_norm.cu.j2 parameters: only the keys the kernel's branch of the template uses."""
    p: Dict[str, Any] = {**dtype_params(dtype), "kernel": kernel, "block_size": BLOCK}
    if kernel != "finalize":
        p.update(layout=layout, vec=vec_width(dtype))
    if kernel == "normalize":
        p["mode"] = mode
    return p


# -- geometry ------------------------------------------------------------------------------
def bn_geometry(layout: str, N: int, C: int, S: int, vec_ok: int, vec: int,
                sm: int, fuse: bool = False) -> Dict[str, Any]:
    """The launch sizes of batch_norm for one input shape and vec_ok: the normalize kernel's
    grid, block and trailing arguments (N, C, items, S/W and C as FastDiv, vec_ok), the
    statistics pass's grid, block, splits and arguments after (x, partials). fuse
    (training): for "ncs" with N * S <= BN_FUSE_MAX, one split and "fused": the "fused"
    kernel (grid (C), the stats pass's block) does the three passes; "fused_args" its
    arguments after the running statistics' update (N, C, S, S/W as FastDiv, vec_ok)."""
    w = vec if vec_ok else 1
    SW = S // w if layout == "ncs" else 1  # items per plane ("nc": vectors run along C)
    tail = (N, C, N * C * SW, *fast_divisor(SW), *fast_divisor(C)[1:], vec_ok)
    grid, block = _normalize_geometry(layout, N, C, S, w, sm)
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
        if fuse and N * S <= BN_FUSE_MAX:
            splits = 1
        chunk = -(-per_channel // splits)
        splits = -(-per_channel // chunk)  # no empty split
        stats_grid, stats_block = (C, splits, 1), (BLOCK, 1, 1)
    return {"tail": tail, "grid": grid, "block": block, "splits": splits,
            "stats_grid": stats_grid, "stats_block": stats_block,
            "stats_args": (N, C, S, *fast_divisor(SW), chunk, vec_ok),
            "fused": fuse and layout == "ncs" and N * S <= BN_FUSE_MAX,
            "fused_args": (N, C, S, *fast_divisor(SW), vec_ok)}


def nc_block(columns: int, block: int = BLOCK) -> Tuple[int, int]:
    """(bx, by) with bx*by = block: bx threads across the column vectors (a power of two,
    at least a warp), by rows (also ops/batch_norm_backward_plans.py's)."""
    bx = 32
    while bx < columns and bx < block:
        bx *= 2
    return bx, block // bx


def _normalize_geometry(layout: str, N: int, C: int, S: int, w: int,
                        sm: int) -> Tuple[Tuple[int, int, int], Tuple[int, int, int]]:
    """(grid, block) of the normalize kernel: "nc" one block per (bx column vectors,
    by * UNROLL rows); "ncs" one UNROLL-item step per thread. Many short blocks rather than
    a few long ones, so no partly filled last wave of long blocks; small inputs move fewer
    items a thread (ITEMS_BY_WAVES), so that they still spread over the SMs."""
    if layout == "nc":
        bx, by = nc_block(C // w)
        gx = -(-(C // w) // bx)
        gy = max(1, min(-(-N // (by * UNROLL)), 65535))
        return (gx, gy, 1), (bx, by, 1)
    items = N * C * (S // w)
    grid = -(-items // (BLOCK * UNROLL))
    for per_thread, waves in ITEMS_BY_WAVES:
        if -(-items // (BLOCK * per_thread)) <= waves * sm:
            grid = -(-items // (BLOCK * per_thread))
            break
    return (max(1, min(grid, 2**31 - 1)), 1, 1), (BLOCK, 1, 1)


# -- launches and the per-call plan ------------------------------------------------------
def bn_launch(m: Any, geo: Dict[str, Any], layout: str, training: bool, x: CudaTensor,
              out: CudaTensor, gamma: CudaTensor, beta: CudaTensor, mean: CudaTensor,
              var: CudaTensor, eps: float, momentum: float, C: int, S: int, count: int) -> None:
    """The general path's launches (geo: bn_geometry's): inference one normalize pass;
    training the statistics pass, the finalize (which updates the running mean and variance
    in place) and the normalize pass with the workspace freed after them, or the one
    "fused" kernel (geometry "fused"), which needs none."""
    dev, tail = x.device_id, geo["tail"]
    if not training:
        kernel = m.kernel(BN_TEMPLATE, dev, **bn_params(x.dtype, "normalize", layout, "infer"))
        m.backend.launch_kernel(kernel.name, geo["grid"], x, out, gamma, beta, mean, var, eps,
                                *tail, block_size=geo["block"], device_id=dev)
    elif geo["fused"]:
        fused = m.kernel(BN_TEMPLATE, dev, **bn_params(x.dtype, "fused", layout))
        m.backend.launch_kernel(fused.name, (C, 1, 1), x, out, gamma, beta, mean, var, eps,
                                momentum, *geo["fused_args"], block_size=(BLOCK, 1, 1),
                                device_id=dev)
    else:
        acc_itemsize = 8 if x.dtype is DT.FLOAT64 else 4
        splits = geo["splits"]
        ws = m.backend.empty(((splits * 2 + 2) * C,), common.acc_dtype(x.dtype), dev)
        try:
            base = ws.ptr
            partials = base
            ws_mean = base + splits * 2 * C * acc_itemsize
            ws_scale = ws_mean + C * acc_itemsize
            stats = m.kernel(BN_TEMPLATE, dev, **bn_params(x.dtype, "stats", layout))
            m.backend.launch_kernel(stats.name, geo["stats_grid"], x, partials,
                                    *geo["stats_args"], block_size=geo["stats_block"],
                                    device_id=dev)
            fin = m.kernel(BN_TEMPLATE, dev, **bn_params(x.dtype, "finalize"))
            m.backend.launch_kernel(fin.name, (-(-C // BLOCK), 1, 1), x, partials, splits, C,
                                    1 if layout == "nc" else S, count, gamma, mean, var,
                                    ws_mean, ws_scale, eps, momentum, block_size=(BLOCK, 1, 1),
                                    device_id=dev)
            norm = m.kernel(BN_TEMPLATE, dev, **bn_params(x.dtype, "normalize", layout,
                                                          "train"))
            m.backend.launch_kernel(norm.name, geo["grid"], x, out, ws_mean, ws_scale, beta,
                                    *tail, block_size=geo["block"], device_id=dev)
        finally:
            ws.free()  # stream-ordered: a later allocation's kernels run after these


def bn_call_plan(m: Any, x: CudaTensor, eps: float, momentum: float, training: bool,
                 sm: int) -> Any:
    """The per-call plan of batch_norm on inputs shaped like x (ops/common.py
    remember_plan): gamma, beta and the running statistics checked as the general path
    would (a mismatch returns None: the general path raises), the result allocated, and the
    general path's launches prepared for both values of vec_ok (it depends on the pointers
    and changes the geometry, not the kernels): inference one launch; training the
    statistics pass, the finalize (which updates the running mean and variance in place)
    and the normalize pass, with the workspace allocated before and released after them as
    the general path does, or the fused kernel alone."""
    dev, shape, dtype = x.device_id, x.shape, x.dtype
    size, nbytes = x.size, x.nbytes
    N, C, S, count, layout, vec, can_vec = bn_layout(shape, dtype)
    cshape = (C,)
    acc_itemsize = 8 if dtype is DT.FLOAT64 else 4
    fin, variants = _bn_variants(m, training, dev, dtype, layout, N, C, S, vec, can_vec, sm,
                                 acc_itemsize)
    pool = m.backend.memory_pools[dev]
    alloc, release = pool.allocate_current, pool.release
    S_fin = 1 if layout == "nc" else S
    c_bytes = C * acc_itemsize

    def run(x: CudaTensor, gamma: Any, beta: Any, mean: Any, var: Any) -> Optional[CudaTensor]:
        px = x._ptr
        if px is None or x.stream is not None:
            return None
        for t in (gamma, beta, mean, var):
            if common.plan_pointer(t, cshape, dtype, dev) is None:
                return None
        out = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        po = out._ptr
        go, tail, stats_go, stats_args, splits, ws_bytes = \
            variants[1 if can_vec and not (px | po) & 15 else 0]
        if not training:
            go(px, po, gamma._ptr, beta._ptr, mean._ptr, var._ptr, eps, *tail)
            return out
        if stats_go is None:   # the fused kernel (go), its arguments in tail; no workspace
            go(px, po, gamma._ptr, beta._ptr, mean._ptr, var._ptr, eps, momentum, *tail)
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


def _bn_variants(m: Any, training: bool, dev: int, dtype: CudaDataType, layout: str, N: int,
                 C: int, S: int, vec: int, can_vec: bool, sm: int,
                 acc_itemsize: int) -> Tuple[Any, List[tuple]]:
    """bn_call_plan's prepared launches: the finalize (training; else None) and by vec_ok
    (normalize, its tail, stats or None, its args, splits, workspace bytes); a fused
    training variant is (the fused kernel, its arguments after momentum, None, (), 1, 0)."""
    prep, bk = m.backend.prepare_launch, m.kernel
    norm = bk(BN_TEMPLATE, dev, **bn_params(dtype, "normalize", layout,
                                            "train" if training else "infer"))
    fin = None
    if training:
        stats = bk(BN_TEMPLATE, dev, **bn_params(dtype, "stats", layout))
        fin = prep(bk(BN_TEMPLATE, dev, **bn_params(dtype, "finalize")),
                   (-(-C // BLOCK), 1, 1), (BLOCK, 1, 1), 0, dev)
    variants = []
    for vec_ok in ((0, 1) if can_vec else (0,)):
        geo = bn_geometry(layout, N, C, S, vec_ok, vec, sm, training)
        if geo["fused"]:
            fused = bk(BN_TEMPLATE, dev, **bn_params(dtype, "fused", layout))
            variants.append((prep(fused, (C, 1, 1), (BLOCK, 1, 1), 0, dev),
                             geo["fused_args"], None, (), 1, 0))
            continue
        go = prep(norm, geo["grid"], geo["block"], 0, dev)
        if training:
            splits = geo["splits"]
            variants.append((go, geo["tail"], prep(stats, geo["stats_grid"],
                                                   geo["stats_block"], 0, dev),
                             geo["stats_args"], splits, (splits * 2 + 2) * C * acc_itemsize))
        else:
            variants.append((go, geo["tail"], None, (), 0, 0))
    return fin, variants
