"""Batch normalization backward's kernels (`templates/batch_norm_backward.cu.j2`): their
parameters, the launch geometry of an input shape, the compiled kernels of a (dtype, layout,
mode), the general path's launches and the per-call plan that replays them.
ops/normalization_backward.py's batch_norm_backward checks the arguments and calls these; its
docstring has the passes and the floor.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ..dtypes import CudaDataType
from ..kernels import dtype_params
from ..tensor import CudaTensor, pool_tensor
from . import common
from .batch_norm_plans import nc_block
from .normalization_common import acc_dtype, bn_layout, grad_pointers, prepared, vec_width
from .pooling import fast_divisor

BN_TEMPLATE = "batch_norm_backward.cu.j2"
# batch norm: threads per block; the passes' blocks per SM (about one resident wave of
# looping blocks); rows in flight per thread ("nc": 2, as the template) and items ("ncs": 4)
BN_BLOCK = 256
BN_PASS_BLOCKS_PER_SM = 4
BN_UNROLL = {"nc": 2, "ncs": 4}
BN_FINAL_CHANNELS = BN_BLOCK // 32   # finalize: one warp per channel


# -- template parameter sets ---------------------------------------------------------------
def bn_params(dtype: CudaDataType, kernel: str, layout: str = "",
              mode: str = "") -> Dict[str, Any]:
    """batch_norm_backward.cu.j2 parameters: kernel "reduce", "eval" or "apply" with a layout
    ("nc" or "ncs"), or "finalize" with a mode ("train" or "eval")."""
    p: Dict[str, Any] = {**dtype_params(dtype), "kernel": kernel, "block_size": BN_BLOCK}
    if kernel == "finalize":
        p["mode"] = mode
    else:
        p.update(layout=layout, vec=vec_width(dtype))
    return p


# -- geometry, kernels, launches ------------------------------------------------------------
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


def bn_kernels(m: Any, dtype: CudaDataType, layout: str, training: bool,
               dev: int) -> Dict[str, str]:
    """Compiled kernel names of one (dtype, layout, mode), memoized per CudaMath."""
    def compile_them() -> Dict[str, Any]:
        k = m.kernel
        if training:
            return {"pass": k(BN_TEMPLATE, dev, **bn_params(dtype, "reduce", layout)).name,
                    "final": k(BN_TEMPLATE, dev, **bn_params(dtype, "finalize", mode="train")).name,
                    "apply": k(BN_TEMPLATE, dev, **bn_params(dtype, "apply", layout)).name}
        return {"pass": k(BN_TEMPLATE, dev, **bn_params(dtype, "eval", layout)).name,
                "final": k(BN_TEMPLATE, dev, **bn_params(dtype, "finalize", mode="eval")).name}
    return prepared(m, ("bn", dev, dtype, layout, training), compile_them)


def bn_args(geo: Dict[str, Any], N: int, C: int, S: int, vec_ok: int
            ) -> Tuple[tuple, tuple]:
    """The trailing arguments of the passes and of "apply"."""
    SW = geo["SW"]
    sw_div = fast_divisor(SW)
    pass_tail = (N, C, S, *sw_div, geo["chunk"], vec_ok)
    apply_tail = (N, C, N * C * SW, *sw_div, *fast_divisor(C)[1:], vec_ok)
    return pass_tail, apply_tail


def bn_launch(m: Any, ks: Dict[str, str], geo: Dict[str, Any], training: bool,
              g: CudaTensor, x: CudaTensor, dx: CudaTensor, gamma: CudaTensor,
              mean: Optional[CudaTensor], var: Optional[CudaTensor], dgamma: CudaTensor,
              dbeta: CudaTensor, eps: float, N: int, C: int, S: int, count: int,
              vec_ok: int) -> None:
    """The general path's launches, with a workspace (partials, then for training the
    per-channel coefficients) freed after them (stream-ordered)."""
    dev, adt = x.device_id, acc_dtype(x.dtype)
    nsum = 4 if training else 2
    splits = geo["splits"]
    pass_tail, apply_tail = bn_args(geo, N, C, S, vec_ok)
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


# -- the per-call plan ---------------------------------------------------------------------
def bn_call_plan(m: Any, ks: Dict[str, str], x: CudaTensor, training: bool, eps: float,
                 sms: int) -> Any:
    """The per-call plan of batch_norm_backward on inputs shaped like x (ops/common.py
    remember_plan): grad_out, gamma and the running statistics checked as the general path
    would (a mismatch returns None: the general path raises), the results and the workspace
    allocated, the general path's launches prepared for both values of vec_ok (it depends on
    the pointers and changes the geometry, not the kernels)."""
    # one piece: the prepared launches and the closure that replays them share these locals
    backend = m.backend
    dev, shape, dtype = x.device_id, x.shape, x.dtype
    size, nbytes = x.size, x.nbytes
    N, C, S, count, layout, vec, can_vec = bn_layout(shape, dtype)
    cshape, cbytes = (C,), C * dtype.itemsize
    adt = acc_dtype(dtype)
    nsum = 4 if training else 2
    prep, get = backend.prepare_launch, backend.get_kernel
    final = prep(get(ks["final"], dev), (-(-C // BN_FINAL_CHANNELS), 1, 1), (BN_BLOCK, 1, 1), 0,
                 dev)
    variants = []   # by vec_ok: (pass, its tail, apply, its tail, splits, ws bytes)
    for vec_ok in ((0, 1) if can_vec else (0,)):
        geo = bn_geometry(layout, N, C, S, vec_ok, vec, sms)
        pass_tail, apply_tail = bn_args(geo, N, C, S, vec_ok)
        first = prep(get(ks["pass"], dev), geo["grid"], geo["block"], 0, dev)
        second: Any = prep(get(ks["apply"], dev), geo["apply_grid"], geo["apply_block"], 0,
                           dev) if training else None
        splits = geo["splits"]
        ws_bytes = (splits * C * nsum + (C * 4 if training else 0)) * adt.itemsize
        variants.append((first, pass_tail, second, apply_tail, splits, ws_bytes))
    pool = backend.memory_pools[dev]
    alloc, release = pool.allocate_current, pool.release
    direct = backend.direct_launch
    plan_pointer = common.plan_pointer
    kstride = 1 if S == 1 else S

    def run(g: Any, x: CudaTensor, gamma: Any, mean: Any, var: Any) -> Any:
        ptrs = grad_pointers(g, x, shape, dtype, dev, direct)
        if ptrs is None:
            return None
        pg, px = ptrs
        if training:
            if plan_pointer(gamma, cshape, dtype, dev) is None:
                return None
            if mean is not None or var is not None:   # (unused, checked as the general path)
                for t in (mean, var):
                    if t is not None and (type(t) is not CudaTensor or t.shape != cshape or
                                          t.dtype is not dtype or t.device_id != dev or
                                          t._ptr is None):
                        return None
        elif mean is None or var is None or plan_pointer(gamma, cshape, dtype, dev) is None \
                or plan_pointer(mean, cshape, dtype, dev) is None or \
                plan_pointer(var, cshape, dtype, dev) is None:
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
