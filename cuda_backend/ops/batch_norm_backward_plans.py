"""Batch normalization backward's kernels (`templates/batch_norm_backward.cu.j2`): their
parameters, the launch geometry of an input shape, the compiled kernels of a (dtype, layout,
mode), the ticket counters of the passes' fused finalize, the general path's launches and the
per-call plan that replays them. ops/normalization_backward.py's batch_norm_backward checks
the arguments and calls these; its docstring has the passes and the floor.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from ..dtypes import CudaDataType
from ..kernels import dtype_params
from ..streams import current_pycuda_stream
from ..tensor import CudaTensor, pool_tensor
from . import common
from .batch_norm_plans import nc_block
from .common import acc_dtype
from .normalization_common import bn_layout, grad_pointers, prepared, vec_width
from .pooling import fast_divisor

BN_TEMPLATE = "batch_norm_backward.cu.j2"
# batch norm: threads per block; the passes' blocks per SM (about one resident wave of
# looping blocks); rows in flight per thread ("nc": 2, as the template) and items ("ncs": 4)
BN_BLOCK = 256
BN_PASS_BLOCKS_PER_SM = 4
BN_UNROLL = {"nc": 2, "ncs": 4}
BN_MIN_COUNTERS = 1024   # ticket counters made at least, per device and stream
BN_INLINE_MAX = 1 << 20   # grad_input and the workspace up to this many bytes: one block
BN_FUSE_MAX = 8192   # training, "ncs": planes x batch up to this: one fused launch


# -- template parameter sets ---------------------------------------------------------------
def bn_params(dtype: CudaDataType, kernel: str, layout: str,
              fused: bool = False) -> Dict[str, Any]:
    """batch_norm_backward.cu.j2 parameters: kernel "reduce" (fused, "ncs" only: the pass
    that computes grad_input itself), "eval" or "apply" with a layout ("nc" or "ncs")."""
    p = {**dtype_params(dtype), "kernel": kernel, "block_size": BN_BLOCK, "layout": layout,
         "vec": vec_width(dtype)}
    if kernel == "reduce":
        p["fused"] = bool(fused)
    return p


# -- ticket counters (one per channel group, grid x) -----------------------------------------
COUNTERS = common.TicketCounters(BN_MIN_COUNTERS)


def bn_counters(m: Any, dev: int, stream: Any, groups: int) -> CudaTensor:
    """At least `groups` ticket counters for the passes on one device and stream."""
    return COUNTERS.get(m, dev, stream, groups)


# -- geometry, kernels, launches ------------------------------------------------------------
def bn_geometry(layout: str, N: int, C: int, S: int, vec_ok: int, vec: int,
                sms: int, fuse: bool = False) -> Dict[str, Any]:
    """Launch sizes of batch_norm_backward for one shape (count N * S > 0) and vec_ok: the
    passes' ("reduce", "eval") grid, block, splits, chunk and `terms` (the most elements one
    thread adds into one sum), and "apply"'s grid and block. N = 0 (an empty batch) gives one
    split of nothing. fuse (training, "ncs" layout): where a channel holds at most
    BN_FUSE_MAX elements, one split, and "fused": the pass computes grad_input itself (no
    "apply"). The "nc" layout never fuses: one block per channel group over every row was
    slower than two launches (perf/NOTES.md, "Per-call host cost" S15)."""
    w = vec if vec_ok else 1
    SW = S // w if layout == "ncs" else 1
    if layout == "nc":
        bx, by = nc_block(C // w, BN_BLOCK)
        gx = -(-(C // w) // bx)
        splits = max(1, min(-(-N // by), -(-(sms * BN_PASS_BLOCKS_PER_SM) // gx), 65535))
        gy = max(1, min(-(-N // (by * BN_UNROLL["nc"])), 65535))
        return {"grid": (gx, splits, 1), "block": (bx, by, 1), "splits": splits, "chunk": 0,
                "SW": SW, "terms": -(-N // (splits * by)), "apply_grid": (gx, gy, 1),
                "apply_block": (bx, by, 1), "fused": False}
    per_channel = N * SW
    fused = fuse and N * S <= BN_FUSE_MAX
    splits = 1 if fused else max(1, min(-(-per_channel // (BN_BLOCK * BN_UNROLL["ncs"])),
                                        -(-(sms * BN_PASS_BLOCKS_PER_SM) // C), 65535))
    chunk = max(1, -(-per_channel // splits))
    splits = max(1, -(-per_channel // chunk))   # no empty split
    items = N * C * SW
    grid = max(1, min(-(-items // (BN_BLOCK * BN_UNROLL["ncs"])), 2**31 - 1))
    return {"grid": (C, splits, 1), "block": (BN_BLOCK, 1, 1), "splits": splits,
            "chunk": chunk, "SW": SW, "terms": -(-chunk // BN_BLOCK) * w,
            "apply_grid": (grid, 1, 1), "apply_block": (BN_BLOCK, 1, 1), "fused": fused}


def bn_kernels(m: Any, dtype: CudaDataType, layout: str, training: bool,
               dev: int) -> Dict[str, str]:
    """Compiled kernel names of one (dtype, layout, mode), memoized per CudaMath."""
    def compile_them() -> Dict[str, Any]:
        k = m.kernel
        if training:
            ks = {"pass": k(BN_TEMPLATE, dev, **bn_params(dtype, "reduce", layout)).name,
                  "apply": k(BN_TEMPLATE, dev, **bn_params(dtype, "apply", layout)).name}
            if layout == "ncs":
                ks["fused"] = k(BN_TEMPLATE, dev, **bn_params(dtype, "reduce", layout, True)).name
            return ks
        return {"pass": k(BN_TEMPLATE, dev, **bn_params(dtype, "eval", layout)).name}
    return prepared(m, ("bn", dev, dtype, layout, training), compile_them)


def bn_args(geo: Dict[str, Any], N: int, C: int, S: int, vec_ok: int
            ) -> Tuple[tuple, tuple]:
    """The trailing arguments of the passes and of "apply"."""
    SW = geo["SW"]
    sw_div = fast_divisor(SW)
    pass_tail = (N, C, S, *sw_div, geo["chunk"], vec_ok)
    apply_tail = (N, C, N * C * SW, *sw_div, *fast_divisor(C)[1:], vec_ok)
    return pass_tail, apply_tail


def bn_ws_bytes(geo: Dict[str, Any], C: int, training: bool, adt: CudaDataType
                ) -> Tuple[int, int]:
    """(offset of the coefficients, bytes) of the workspace: the partials [splits][C][4 or
    2], then for training the per-channel coefficients [C][4], in the accumulation type."""
    coef_at = geo["splits"] * C * (4 if training else 2) * adt.itemsize
    return coef_at, coef_at + (C * 4 * adt.itemsize if training else 0)


def bn_inline_at(nbytes: int, ws_bytes: int) -> int:
    """Where the workspace starts inside grad_input's block (its bytes rounded up to 256),
    or 0 where it takes a block of its own: grad_input empty, or both over BN_INLINE_MAX
    together (large inputs: one more allocation is nothing next to their kernels, and a
    workspace kept as long as grad_input would be)."""
    at = -(-nbytes // 256) * 256
    return at if nbytes and at + ws_bytes <= BN_INLINE_MAX else 0


def bn_general(m: Any, ks: Dict[str, str], training: bool, g: CudaTensor, x: CudaTensor,
               gamma: CudaTensor, mean: Optional[CudaTensor], var: Optional[CudaTensor],
               eps: float, sms: int) -> Tuple[CudaTensor, CudaTensor, CudaTensor]:
    """The general path for a batch of N * S > 0 values per channel: the results allocated
    (grad_input's block holding the workspace too when small: bn_inline_at, sized for the
    larger of the two vec_ok variants, as the per-call plan does) and launched."""
    dev, dtype, shape = x.device_id, x.dtype, x.shape
    N, C, S, count, layout, vec, can_vec = bn_layout(shape, dtype)
    geos = [bn_geometry(layout, N, C, S, ok, vec, sms, training)
            for ok in ((0, 1) if can_vec else (0,))]
    adt = acc_dtype(dtype)
    ws_max = max(bn_ws_bytes(geo, C, training, adt)[1] for geo in geos)
    at = bn_inline_at(x.nbytes, ws_max)
    pool = m.backend.memory_pools[dev]
    if at:
        dx = pool_tensor(shape, dtype, dev, pool.allocate(at + ws_max), pool, x.size, x.nbytes)
    else:
        dx = m.backend.empty(shape, dtype, dev)
    dgamma = m.backend.empty((C,), dtype, dev)
    dbeta = m.backend.empty((C,), dtype, dev)
    vec_ok = int(can_vec and not ((g.ptr | x.ptr | dx.ptr) & 15))
    bn_launch(m, ks, geos[vec_ok], training, g, x, dx, gamma, mean, var, dgamma, dbeta, eps,
              N, C, S, vec_ok, dx.ptr + at if at else 0)
    return dx, dgamma, dbeta


def bn_launch(m: Any, ks: Dict[str, str], geo: Dict[str, Any], training: bool,
              g: CudaTensor, x: CudaTensor, dx: CudaTensor, gamma: CudaTensor,
              mean: Optional[CudaTensor], var: Optional[CudaTensor], dgamma: CudaTensor,
              dbeta: CudaTensor, eps: float, N: int, C: int, S: int, vec_ok: int,
              ws_at: int = 0) -> None:
    """The general path's launches: the pass, whose channel groups' last blocks finalize
    (grad_gamma, grad_beta and, for training, the per-channel coefficients), then for
    training "apply" (or, geometry "fused", the pass computes grad_input itself); the
    workspace (partials, then the coefficients) at ws_at, else a
    block of its own freed after them (stream-ordered)."""
    dev, adt = x.device_id, acc_dtype(x.dtype)
    pass_tail, apply_tail = bn_args(geo, N, C, S, vec_ok)
    counters = bn_counters(m, dev, current_pycuda_stream(dev), geo["grid"][0])
    coef_at, ws_bytes = bn_ws_bytes(geo, C, training, adt)
    ws = None if ws_at else m.backend.empty((ws_bytes // adt.itemsize,), adt, dev)
    launch = m.backend.launch_kernel
    try:
        parts = ws_at or ws.ptr   # type: ignore[union-attr]
        if training:
            coef = parts + coef_at
            fused = geo["fused"]
            launch(ks["fused" if fused else "pass"], geo["grid"], x, g, dx if fused else 0,
                   gamma, 0, 0, eps, parts, counters, dgamma, dbeta, coef, *pass_tail,
                   block_size=geo["block"], device_id=dev)
            if not fused:
                launch(ks["apply"], geo["apply_grid"], coef, x, g, dx, *apply_tail,
                       block_size=geo["apply_block"], device_id=dev)
        else:
            launch(ks["pass"], geo["grid"], x, g, dx, gamma, mean, var, eps, parts, counters,
                   dgamma, dbeta, 0, *pass_tail, block_size=geo["block"], device_id=dev)
    finally:
        if ws is not None:
            ws.free()


# -- the per-call plan ---------------------------------------------------------------------
def bn_call_plan(m: Any, ks: Dict[str, str], x: CudaTensor, training: bool, eps: float,
                 sms: int) -> Any:
    """The per-call plan of batch_norm_backward on inputs shaped like x (ops/common.py
    remember_plan): grad_out, gamma and the running statistics checked as the general path
    would (a mismatch returns None: the general path raises), the results and the workspace
    allocated, the general path's launches prepared for both values of vec_ok (it depends on
    the pointers and changes the geometry, not the kernels)."""
    dev, shape, dtype = x.device_id, x.shape, x.dtype
    size, nbytes = x.size, x.nbytes
    N, C, S, count, layout, vec, can_vec = bn_layout(shape, dtype)
    cshape, cbytes = (C,), C * dtype.itemsize
    variants, groups = _bn_variants(m, ks, training, dev, dtype, layout, N, C, S, vec,
                                    can_vec, sms)
    at, dx_bytes = _bn_dx_block(nbytes, variants)
    pool = m.backend.memory_pools[dev]
    alloc, release = pool.allocate_current, pool.release
    direct = m.backend.direct_launch
    counters = _bn_counter_source(m, dev, groups)

    def run(g: Any, x: CudaTensor, gamma: Any, mean: Any, var: Any) -> Any:
        ptrs = grad_pointers(g, x, shape, dtype, dev, direct)
        if ptrs is None:
            return None
        pg, px = ptrs
        if not _bn_params_ok(training, gamma, mean, var, cshape, dtype, dev):
            return None
        dx = pool_tensor(shape, dtype, dev, alloc(dx_bytes), pool, size, nbytes)
        dgamma = pool_tensor(cshape, dtype, dev, alloc(cbytes), pool, C, cbytes)
        dbeta = pool_tensor(cshape, dtype, dev, alloc(cbytes), pool, C, cbytes)
        pdx = dx._ptr
        first, pass_tail, second, apply_tail, coef_at, ws_bytes = \
            variants[1 if can_vec and not (pg | px | pdx) & 15 else 0]
        ws = None if at else alloc(ws_bytes)
        try:
            parts = pdx + at if ws is None else int(ws)
            if training:
                coef = parts + coef_at
                first(px, pg, 0 if second else pdx, gamma._ptr, 0, 0, eps, parts, counters(),
                      dgamma._ptr, dbeta._ptr, coef, *pass_tail)
                if second is not None:
                    second(coef, px, pg, pdx, *apply_tail)
            else:
                first(px, pg, pdx, gamma._ptr, mean._ptr, var._ptr, eps, parts, counters(),
                      dgamma._ptr, dbeta._ptr, 0, *pass_tail)
        finally:
            if ws is not None:
                release(ws)   # as ws.free() in the general path: stream-ordered
        return dx, dgamma, dbeta
    return run


def _bn_params_ok(training: bool, gamma: Any, mean: Any, var: Any, cshape: Tuple[int, ...],
                  dtype: CudaDataType, dev: int) -> bool:
    """bn_call_plan's check of gamma and the running statistics as the general path checks
    them (False: the general path runs and raises): training needs gamma (the statistics,
    unused, must still be tensors of gamma's kind where given); inference all three."""
    plan_pointer = common.plan_pointer
    if training:
        if plan_pointer(gamma, cshape, dtype, dev) is None:
            return False
        for t in (mean, var):
            if t is not None and (type(t) is not CudaTensor or t.shape != cshape or
                                  t.dtype is not dtype or t.device_id != dev or
                                  t._ptr is None):
                return False
        return True
    return not (mean is None or var is None or plan_pointer(gamma, cshape, dtype, dev) is None
                or plan_pointer(mean, cshape, dtype, dev) is None or
                plan_pointer(var, cshape, dtype, dev) is None)


def _bn_variants(m: Any, ks: Dict[str, str], training: bool, dev: int, dtype: CudaDataType,
                 layout: str, N: int, C: int, S: int, vec: int, can_vec: bool,
                 sms: int) -> Tuple[List[tuple], int]:
    """bn_call_plan's prepared launches by vec_ok: (pass, its tail, apply or None (eval, or
    a fused pass), its tail, coefficients' offset, workspace bytes), and the most channel
    groups (ticket counters) of any variant's pass."""
    backend = m.backend
    adt = acc_dtype(dtype)
    prep, get = backend.prepare_launch, backend.get_kernel
    variants = []
    groups = 1
    for vec_ok in ((0, 1) if can_vec else (0,)):
        geo = bn_geometry(layout, N, C, S, vec_ok, vec, sms, training)
        pass_tail, apply_tail = bn_args(geo, N, C, S, vec_ok)
        first = prep(get(ks["fused" if geo.get("fused") and training else "pass"], dev),
                     geo["grid"], geo["block"], 0, dev)
        second: Any = prep(get(ks["apply"], dev), geo["apply_grid"], geo["apply_block"], 0,
                           dev) if training and not geo["fused"] else None
        coef_at, ws_bytes = bn_ws_bytes(geo, C, training, adt)
        variants.append((first, pass_tail, second, apply_tail, coef_at, ws_bytes))
        groups = max(groups, geo["grid"][0])
    return variants, groups


def _bn_dx_block(nbytes: int, variants: List[tuple]) -> Tuple[int, int]:
    """(where the workspace starts inside grad_input's block, or 0, and that block's bytes)
    for the largest variant's workspace, as bn_general places it (bn_inline_at)."""
    ws_max = max(v[5] for v in variants)
    at = bn_inline_at(nbytes, ws_max)
    return at, at + ws_max if at else nbytes


def _bn_counter_source(m: Any, dev: int, groups: int) -> Callable[[], int]:
    """counters() for bn_call_plan's run: the pointer of at least `groups` ticket counters
    for direct launches (no stream block open)."""
    return COUNTERS.source(m, dev, groups)
