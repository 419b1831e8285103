"""Softmax and log-softmax backward over the last axis (any leading dims), float dtypes:
dx = y * (g - sum(g * y)) for softmax and dx = g - exp(y) * sum(g) for log_softmax, where g is
the gradient of the forward's output and y that output.

One launch of `softmax_backward.cu.j2` per call, in one of three modes chosen from the row
length K (`plan`, a fixed rule; `candidates` lists every mode able to run K):
- "warp": K <= 32 * vec * 4 (512 float32): 1-32 lanes per row keep g and y in registers:
  one read of g and y, one write of dx.
- "block": K up to 1024 * 2 * vec (8K float32): one block per row keeps them in registers:
  one read, one write.
- "loop": longer rows: the sum from one read, a second read (mostly from L2) to write.
Rows whose length is a multiple of 16 bytes with 16-byte aligned pointers move in 16-byte
vectors, others one element per access (coalesced). Sums in float32 (double for float64),
in a fixed order; half types round once on store. The per-call plan of a shape, dtype and
device (`m.plans[("softmax_backward", shape, dtype, device, log)]`) allocates dx and
launches. Fallback mode computes `reference` in float64 and rounds once.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional

import numpy as np

from ..dtypes import CudaDataType
from ..kernels import accumulator_type
from ..tensor import CudaTensor, pool_tensor
from . import common
from .reduction import host_result

TEMPLATE = "softmax_backward.cu.j2"
TEMPLATES = (TEMPLATE,)
WARP_BLOCK = 256       # threads per block in warp mode
LOOP_BLOCK = 1024      # threads per block in loop mode
WARP_NV = (2, 4)       # 16-byte vectors of g and of y per lane in warp mode
# block mode (threads, nv), in order of capacity threads * nv * vec; each compiles without
# spills (ptxas -v; 1024 x 4 spilled float64 and the 16-bit types at 1024 threads' 64 registers)
BLOCK_CONFIGS = ((128, 2), (256, 2), (512, 2), (1024, 2))
_plans: "weakref.WeakKeyDictionary[Any, Dict[tuple, Dict[str, Any]]]" = \
    weakref.WeakKeyDictionary()


def kernel_params(dtype: CudaDataType, mode: str, nv: int = 0, block: int = 0) -> Dict[str, Any]:
    """Template parameters of one mode ("warp" with nv, "block" with block threads and nv,
    "loop")."""
    size = {"warp": WARP_BLOCK, "loop": LOOP_BLOCK}.get(mode, block)
    params = {"dtype": dtype.name_str, "ctype": dtype.c_type, "acc": accumulator_type(dtype),
              "mode": mode, "vec": 16 // dtype.itemsize, "block_size": size}
    if mode != "loop":
        params["nv"] = nv
    return params


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Per float dtype: the warp sizes, the block configs and loop."""
    sets = []
    for dt in common.FLOATS:
        sets += [kernel_params(dt, "warp", nv) for nv in WARP_NV]
        sets += [kernel_params(dt, "block", nv, blk) for blk, nv in BLOCK_CONFIGS]
        sets.append(kernel_params(dt, "loop"))
    return {TEMPLATE: sets}


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every variant in parallel threads; 0 in fallback mode."""
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets]
    return common.compile_all(m, jobs, device_id, workers)


def reference(grad_out: Any, y: Any, log: bool = False) -> np.ndarray:
    """float64 softmax backward (log_softmax backward with log=True) over the last axis, from
    the forward's output y."""
    g = np.asarray(grad_out, dtype=np.float64)
    yy = np.asarray(y, dtype=np.float64)
    with np.errstate(all="ignore"):
        if log:
            return g - np.exp(yy) * np.sum(g, axis=-1, keepdims=True)
        return yy * (g - np.sum(g * yy, axis=-1, keepdims=True))


# -- plans ---------------------------------------------------------------------------------
def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _warp_plans(K: int, vec: int) -> List[Dict[str, Any]]:
    out = []
    for nv in WARP_NV:
        if K <= 32 * vec * nv:
            out.append({"mode": "warp", "nv": nv, "threads": WARP_BLOCK,
                        "group": min(32, _pow2_at_least(-(-K // (vec * nv))))})
    return out


def _block_plans(K: int, vec: int) -> List[Dict[str, Any]]:
    return [{"mode": "block", "nv": nv, "threads": blk, "group": 0}
            for blk, nv in BLOCK_CONFIGS if blk * nv * vec >= K]


def _loop_plan() -> Dict[str, Any]:
    return {"mode": "loop", "nv": 0, "threads": LOOP_BLOCK, "group": 0}


def plan(K: int, itemsize: int) -> Dict[str, Any]:
    """{"mode", "nv", "threads", "group"} for rows of K elements: warp mode with the fewest
    vectors per lane that hold the row, else the block config of least capacity that holds
    it, else loop."""
    vec = 16 // itemsize
    for p in _warp_plans(K, vec) + _block_plans(K, vec):
        return p
    return _loop_plan()


def candidates(K: int, itemsize: int) -> List[Dict[str, Any]]:
    """Every plan able to run rows of K elements, the rule's first."""
    vec = 16 // itemsize
    out = [plan(K, itemsize)]
    for p in _warp_plans(K, vec) + _block_plans(K, vec) + [_loop_plan()]:
        if p not in out:
            out.append(p)
    return out


def prepare(m: Any, p: Dict[str, Any], dtype: CudaDataType, dev: int) -> Dict[str, Any]:
    """The plan with its compiled kernel's name."""
    params = kernel_params(dtype, p["mode"], p["nv"], p["threads"])
    return dict(p, kernel=m.kernel(TEMPLATE, dev, **params).name)


def _grid(p: Dict[str, Any], rows: int) -> int:
    if p["mode"] == "warp":
        return -(-rows // (WARP_BLOCK // p["group"]))
    return rows


def launch(m: Any, p: Dict[str, Any], g: CudaTensor, y: CudaTensor, dx: CudaTensor,
           log: bool) -> None:
    """One launch of a prepared plan over the rows of g and y (same shape) into dx."""
    K = g.shape[-1] if g.ndim else 1
    rows = g.size // K
    vec_ok = int(K % (16 // g.dtype.itemsize) == 0 and not ((g.ptr | y.ptr | dx.ptr) & 15))
    m.backend.launch_kernel(p["kernel"], (_grid(p, rows), 1, 1), g, y, dx, rows, K, p["group"],
                            vec_ok, int(bool(log)), block_size=(p["threads"], 1, 1),
                            device_id=g.device_id)


# -- the op ---------------------------------------------------------------------------------
def backward(m: Any, grad_out: CudaTensor, y: CudaTensor, log: bool = False) -> CudaTensor:
    """The gradient of softmax (log_softmax with log=True) over the last axis with respect to
    its input, from the gradient of its output and the output y (same shape, dtype, device);
    a 0-d tensor is one row of one element."""
    name = "log_softmax_backward" if log else "softmax_backward"
    g, yy, dtype, dev = common.grad_operands(grad_out, y, "y", name)
    if not m.gpu or g.size == 0:
        values = reference(common.host_array(m, g), common.host_array(m, yy), log) \
            if g.size else np.empty(g.shape, np.float32)
        host = np.float32 if dtype is CudaDataType.BFLOAT16 else dtype.numpy_dtype
        with np.errstate(over="ignore", invalid="ignore"):
            return host_result(m, values.astype(host), dtype, dev, None)
    K = g.shape[-1] if g.ndim else 1
    plans = _plans.get(m)
    if plans is None:
        plans = _plans.setdefault(m, {})
    key = (dev, dtype, K)
    p = plans.get(key)
    if p is None:  # once per CudaMath, device, dtype and row length
        p = prepare(m, plan(K, dtype.itemsize), dtype, dev)
        if len(plans) >= 4096:
            plans.clear()
        plans[key] = p
    dx = m.backend.empty(g.shape, dtype, dev)
    launch(m, p, g, yy, dx, log)
    fkey = ("softmax_backward", g.shape, dtype, dev, bool(log))
    if fkey not in m.plans:
        common.remember_plan(m, fkey, _fast_plan(m, p, g, log))
    return dx


def _fast_plan(m: Any, p: Dict[str, Any], g: CudaTensor, log: bool) -> Any:
    """The per-call plan for operands shaped like g: run(g, y) allocates dx and launches
    once; None (the general path then runs) for a y that is not a live tensor of g's shape,
    dtype and device, or when no direct launch is right now."""
    dev, shape, dtype = g.device_id, g.shape, g.dtype
    K = shape[-1] if g.ndim else 1
    rows, size, nbytes = g.size // K, g.size, g.nbytes
    vec = 16 // dtype.itemsize
    kernel = m.backend.get_kernel(p["kernel"], dev)
    go = m.backend.prepare_launch(kernel, (_grid(p, rows), 1, 1), (p["threads"], 1, 1), 0, dev)
    pool, alloc, direct = common.plan_memory(m, dev)
    group, flag, kvec = p["group"], int(bool(log)), K % vec == 0

    def run(g: CudaTensor, y: Any) -> Optional[CudaTensor]:
        # g's shape, dtype and device are the plan's key
        if type(y) is not CudaTensor:
            return None
        pg, py = g._ptr, y._ptr
        if pg is None or py is None or y.shape != shape or y.dtype is not dtype or \
                y.device_id != dev or not direct(dev):
            return None
        dx = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        pd = dx._ptr
        go(pg, py, pd, rows, K, group, int(kvec and not ((pg | py | pd) & 15)), flag)
        return dx
    return run
