"""Layer normalization backward's kernels (`templates/layer_norm_backward.cu.j2`): the
register plans that hold a row ("warp" and "block" mode, with or without the prefetch stages)
and "loop" mode for longer rows, their parameters and shared memory, the plan the rule picks
for a row length, prepared per device, its launches (the register plans' rows kernel sums
its partials itself where there are few: one launch instead of two), and the per-call plan
that replays them.
ops/normalization_backward.py's layer_norm_backward checks the arguments and calls these; its
docstring has the design and the floor.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from .. import occupancy
from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError
from ..kernels import dtype_params
from ..streams import current_pycuda_stream
from ..tensor import CudaTensor, pool_tensor
from . import common
from .common import acc_dtype
from .normalization_common import grad_pointers, prepared, vec_width

LN_TEMPLATE = "layer_norm_backward.cu.j2"
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
LN_FUSE_MAX = 8192             # partials (blocks x D) the rows kernel's last block adds itself
LN_FUSE_MAX_D = 2048           # and rows up to this long (at 4096 two launches were faster)
LN_COUNTERS = common.TicketCounters(64)   # the fused rows kernel's ticket, per stream


# -- template parameter sets ---------------------------------------------------------------
def ln_warp_nvs(dtype: CudaDataType) -> Tuple[int, ...]:
    """16-byte vectors per lane in warp mode (8-element vectors of the 16-bit types: one)."""
    return (1,) if dtype.itemsize == 2 else (1, 2)


def ln_block_nv(dtype: CudaDataType) -> int:
    """16-byte vectors per thread in block mode: 8 elements (4 for float64), within the 64
    registers of 1024 resident threads per SM without spills."""
    return 1 if dtype.itemsize == 2 else 2


def ln_params(dtype: CudaDataType, kernel: str, plan: Optional[Dict[str, Any]] = None,
              aligned: bool = True, fused: bool = False) -> Dict[str, Any]:
    """layer_norm_backward.cu.j2 parameters of kernel "rows" (for a plan of mode "warp" or
    "block", aligned or not, its partials summed by a "finalize" launch or, fused, by its
    own last block), "rowstats", "apply" or "finalize"."""
    p: Dict[str, Any] = {**dtype_params(dtype), "kernel": kernel}
    if kernel == "rows":
        if plan is None or plan["mode"] not in ("warp", "block"):
            raise InvalidArgumentError(
                f"kernel 'rows' needs a register plan (mode 'warp' or 'block'), got {plan!r}")
        p.update(mode=plan["mode"], nv=plan["nv"], vec=vec_width(dtype), aligned=bool(aligned),
                 block_size=plan["block"], min_blocks=max(1, 1024 // plan["block"]),
                 prefetch=ln_prefetches(plan, aligned), fused=bool(fused))
        if plan["mode"] == "block":
            p["threads_per_row"] = plan["tpr"]
    elif kernel == "rowstats":
        p.update(vec=vec_width(dtype), block_size=LN_ROWSTATS_BLOCK)
    elif kernel == "apply":
        p.update(vec=vec_width(dtype), block_size=LN_APPLY_BLOCK)
    else:
        p["block_size"] = LN_FINAL_BLOCK[0] * LN_FINAL_BLOCK[1]
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
    need = rpb * 2 * ln_capacity(plan, dtype) * acc_dtype(dtype).itemsize + \
        ln_stage_bytes(plan, True) + 1024
    return need <= int(getattr(info, "shared_memory_per_block_optin", 0))


def ln_row_plans(dtype: CudaDataType) -> List[Dict[str, Any]]:
    """Every register plan of a dtype (warp plans with 32 lanes per row)."""
    out = [{"mode": "warp", "nv": nv, "tpr": 32, "block": LN_WARP_BLOCK, "prefetch": False}
           for nv in ln_warp_nvs(dtype)]
    out += [{"mode": "block", "nv": ln_block_nv(dtype), "tpr": tpr, "block": blk,
             "prefetch": pf} for tpr, blk in LN_BLOCK_CONFIGS for pf in (True, False)]
    return out


# -- plans ----------------------------------------------------------------------------------
def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _ln_warp(D: int, dtype: CudaDataType) -> List[Dict[str, Any]]:
    vec = vec_width(dtype)
    return [{"mode": "warp", "nv": nv, "block": LN_WARP_BLOCK,
             "tpr": min(32, _pow2_at_least(-(-D // (vec * nv)))), "prefetch": False}
            for nv in ln_warp_nvs(dtype) if D <= 32 * vec * nv]


def _ln_block(D: int, dtype: CudaDataType) -> List[Dict[str, Any]]:
    """Block configs holding rows of D, least capacity first, each with prefetch first."""
    nv, vec = ln_block_nv(dtype), vec_width(dtype)
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
    return plan["tpr"] * plan["nv"] * vec_width(dtype)


def ln_prepare(m: Any, plan: Dict[str, Any], dtype: CudaDataType, D: int, dev: int,
               aligned: bool) -> Dict[str, Any]:
    """The plan with what its launches need: compiled kernel names, the rows kernel's shared
    memory and resident blocks on this device (register plans; "rows_fused": the same with
    its finalize fused), the finalize kernel."""
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
    fused = m.kernel(LN_TEMPLATE, dev, **ln_params(dtype, "rows", plan, aligned, True))
    rpb = plan["block"] // plan["tpr"]
    smem = rpb * 2 * ln_capacity(plan, dtype) * acc_dtype(dtype).itemsize + \
        ln_stage_bytes(plan, aligned)
    q.update(rows=kernel.name, rows_fused=fused.name, smem=smem, rpb=rpb,
             resident=q["sms"] * occupancy.blocks_per_sm(kernel, info, plan["block"], smem))
    return q


def ln_prepared(m: Any, dtype: CudaDataType, D: int, dev: int, aligned: bool) -> Dict[str, Any]:
    """The rule's prepared plan for (device, dtype, D, aligned), memoized per CudaMath."""
    return prepared(m, ("ln", dev, dtype, D, aligned),
                    lambda: ln_prepare(m, ln_plan(D, dtype), dtype, D, dev, aligned))


def ln_geometry(q: Dict[str, Any], rows: int, D: int, vec_ok: bool,
                dtype: CudaDataType) -> Dict[str, Any]:
    """Launch sizes of a prepared plan over rows: the main kernel's grid and block, the
    partial rows it writes (nparts), the workspace bytes (loop: the row statistics, then
    the partials) and whether the rows kernel sums the partials itself ("fused": at most
    q's "fuse_max", default LN_FUSE_MAX, partial elements, rows up to LN_FUSE_MAX_D;
    perf/NOTES.md, "Per-call host cost" S15)."""
    asz = acc_dtype(dtype).itemsize
    if q["mode"] == "loop":
        w = vec_width(dtype) if vec_ok else 1
        gx = -(-(D // w) // LN_APPLY_BLOCK)
        splits = max(1, min(rows, -(-(q["sms"] * LN_APPLY_BLOCKS_PER_SM) // gx), 65535))
        stats_bytes = rows * 4 * asz
        return {"stats_grid": (max(1, min(rows, 2**31 - 1)), 1, 1),
                "grid": (gx, splits, 1), "block": (LN_APPLY_BLOCK, 1, 1), "nparts": splits,
                "stats_bytes": stats_bytes, "ws_bytes": stats_bytes + splits * 2 * D * asz,
                "fused": False}
    grid = max(1, min(-(-rows // q["rpb"]), q["resident"]))
    return {"grid": (grid, 1, 1), "block": (q["block"], 1, 1), "nparts": grid,
            "stats_bytes": 0, "ws_bytes": grid * 2 * D * asz,
            "fused": grid * D <= q.get("fuse_max", LN_FUSE_MAX) and D <= LN_FUSE_MAX_D}


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
    ws = m.backend.empty((geo["ws_bytes"] // acc_dtype(dtype).itemsize,),
                         acc_dtype(dtype), dev)
    try:
        parts = ws.ptr + geo["stats_bytes"]
        if q["mode"] == "loop":
            vec_ok = int(q["aligned"])
            launch(q["rowstats"], geo["stats_grid"], g, x, wp, ws, rows, D, vec_ok, 1.0 / D, eps,
                   block_size=(LN_ROWSTATS_BLOCK, 1, 1), device_id=dev)
            launch(q["apply"], geo["grid"], g, x, wp, ws, dx, parts, rows, D, vec_ok,
                   block_size=geo["block"], device_id=dev)
        elif geo["fused"]:
            counter = LN_COUNTERS.get(m, dev, current_pycuda_stream(dev), 1)
            launch(q["rows_fused"], geo["grid"], g, x, wp, dx, parts, rows, D, q["tpr"],
                   1.0 / D, eps, counter, dw if dw is not None else 0, db,
                   block_size=geo["block"], shared_mem=q["smem"], device_id=dev)
            return
        else:
            launch(q["rows"], geo["grid"], g, x, wp, dx, parts, rows, D, q["tpr"], 1.0 / D, eps,
                   block_size=geo["block"], shared_mem=q["smem"], device_id=dev)
        launch(q["final"], (-(-D // 32), 1, 1), parts, geo["nparts"], D,
               dw if dw is not None else 0, db, block_size=LN_FINAL_BLOCK, device_id=dev)
    finally:
        ws.free()


# -- the per-call plan ---------------------------------------------------------------------
def ln_call_plan(m: Any, x: CudaTensor, has_weight: bool, eps: float) -> Any:
    """The per-call plan of layer_norm_backward on inputs shaped like x (ops/common.py
    remember_plan): grad_out and weight checked as the general path would (a mismatch returns
    None: the general path raises), the results and the workspace allocated, the general
    path's launches prepared for both alignments (aligned pointers and D % vec == 0 take the
    16-byte kernels)."""
    backend = m.backend
    dev, shape, dtype = x.device_id, x.shape, x.dtype
    size, nbytes = x.size, x.nbytes
    D = shape[-1]
    rows, inv_d, vec = size // D, 1.0 / D, vec_width(dtype)
    vec_rows = D % vec == 0
    dshape, dbytes = (D,), D * dtype.itemsize
    variants = _ln_variants(m, dtype, D, dev, rows, vec_rows)
    counter = LN_COUNTERS.source(m, dev, 1) if any(v[2] is None for v in variants.values()) \
        else (lambda: 0)
    pool = backend.memory_pools[dev]
    alloc, release = pool.allocate_current, pool.release
    direct = backend.direct_launch

    def run(g: Any, x: CudaTensor, weight: Any) -> Any:
        ptrs = grad_pointers(g, x, shape, dtype, dev, direct)
        if ptrs is None:
            return None
        pg, px = ptrs
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
            pdw = dw._ptr if dw is not None else 0
            if second is not None:
                vec_ok = int(aligned)
                first(pg, px, pw, base, rows, D, vec_ok, inv_d, eps)
                second(pg, px, pw, base, pdx, parts, rows, D, vec_ok)
            elif final is None:   # the rows kernel sums its partials (geometry "fused")
                first(pg, px, pw, pdx, parts, rows, D, tpr, inv_d, eps, counter(), pdw,
                      db._ptr)
            else:
                first(pg, px, pw, pdx, parts, rows, D, tpr, inv_d, eps)
            if final is not None:
                final(parts, geo["nparts"], D, pdw, db._ptr)
        finally:
            release(ws)   # as ws.free() in the general path: stream-ordered
        return dx, dw, db
    return run


def _ln_variants(m: Any, dtype: CudaDataType, D: int, dev: int, rows: int,
                 vec_rows: bool) -> Dict[bool, tuple]:
    """ln_call_plan's prepared launches by alignment (both where D is a whole number of
    vectors): (first, second or None, final or None (fused rows), geometry, threads per
    row)."""
    backend = m.backend
    prep = backend.prepare_launch
    variants = {}
    for aligned in ((False, True) if vec_rows else (False,)):
        q = ln_prepared(m, dtype, D, dev, aligned)
        geo = ln_geometry(q, rows, D, aligned, dtype)
        final = prep(backend.get_kernel(q["final"], dev), (-(-D // 32), 1, 1), LN_FINAL_BLOCK,
                     0, dev)
        if q["mode"] == "loop":
            first = prep(backend.get_kernel(q["rowstats"], dev), geo["stats_grid"],
                         (LN_ROWSTATS_BLOCK, 1, 1), 0, dev)
            second = prep(backend.get_kernel(q["apply"], dev), geo["grid"], geo["block"], 0, dev)
        else:
            name = q["rows_fused"] if geo["fused"] else q["rows"]
            first = prep(backend.get_kernel(name, dev), geo["grid"], geo["block"], q["smem"],
                         dev)
            second = None
            if geo["fused"]:
                final = None
        variants[aligned] = (first, second, final, geo, q["tpr"])
    return variants
