"""Softmax and log-softmax over the last axis (any leading dims), float dtypes.

Numerically stable (the row max is subtracted first) and NumPy-compatible at the edges: a
row of all -inf, a row holding +inf or a row holding NaN gives NaN everywhere (what
exp(x - max) / sum gives in NumPy); -inf elements of an otherwise finite row give 0 (log:
-inf). float16/bfloat16 compute in float32, float64 in double.

One kernel launch, `softmax.cu.j2`, in one of three modes chosen from the row length K:
- "warp": rows of K <= 32 * vec * 8 elements (1024 float32) kept in registers by 1-32 lanes
  per row: 1 read + 1 write.
- "smem": longer rows that fit in shared memory (~56K float32 on Hopper), one block per row:
  1 read + 1 write.
- "online": longer still: running max and rescaled sum in one read, then a second read to
  write: 2 reads + 1 write.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional

import numpy as np

from ..dtypes import CudaDataType
from ..errors import DTypeMismatchError, ShapeMismatchError
from ..kernels import accumulator_type
from ..tensor import CudaTensor
from . import common
from .reduction import _host_result

TEMPLATE = "softmax.cu.j2"
WARP_BLOCK = 256        # threads per block in warp mode
SMEM_BLOCK = 1024       # most threads per block in smem mode
ONLINE_BLOCK = 512      # threads per block in online mode (1024 would cap double at 64 regs)
WARP_NV = (4, 8)        # register-cached vectors per lane that warp mode is compiled for
# launch plans per CudaMath: (device, dtype, K) -> plan() + kernel name
_plans: "weakref.WeakKeyDictionary[Any, Dict[tuple, Dict[str, Any]]]" = \
    weakref.WeakKeyDictionary()


def kernel_params(dtype: CudaDataType, mode: str, nv: int = 0) -> Dict[str, Any]:
    """Template parameters for one mode ("warp" with nv vectors per lane, "smem", "online")."""
    block = {"warp": WARP_BLOCK, "smem": SMEM_BLOCK, "online": ONLINE_BLOCK}[mode]
    # Register budgets that compile without spills (ptxas's own choice spilled some):
    # warp mode float32 4 blocks/SM (<= 64 registers), float64 and nv=4 halves 3 (<= 80),
    # nv=8 halves 2; smem mode 2 blocks of 1024 (<= 32 registers: full occupancy).
    min_blocks = 1
    if mode == "warp":
        if dtype is CudaDataType.FLOAT32:
            min_blocks = 4
        elif dtype is CudaDataType.FLOAT64 or nv <= 4:
            min_blocks = 3
        else:
            min_blocks = 2
    elif mode == "smem":
        min_blocks = 2
    params = {"dtype": dtype.name_str, "ctype": dtype.c_type, "acc": accumulator_type(dtype),
              "mode": mode, "vec": 16 // dtype.itemsize, "block_size": block,
              "min_blocks": min_blocks}
    if mode == "warp":
        params["nv"] = nv
    return params


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set this module renders: 3 warp sizes + smem + online per float dtype."""
    sets = []
    for dt in common.FLOATS:
        sets += [kernel_params(dt, "warp", nv) for nv in WARP_NV]
        sets += [kernel_params(dt, "smem"), kernel_params(dt, "online")]
    return {TEMPLATE: sets}


def plan(K: int, itemsize: int, smem_limit: int) -> Dict[str, int]:
    """Mode and launch sizing for rows of K elements: {"mode", "nv", "group", "threads",
    "smem"}. smem_limit: the dynamic shared memory one block may use."""
    vec = 16 // itemsize
    if K <= 32 * vec * WARP_NV[-1]:
        nv = next(n for n in WARP_NV if K <= 32 * vec * n)
        group = min(32, 1 << max(0, -(-K // (vec * nv)) - 1).bit_length())
        return {"mode": "warp", "nv": nv, "group": group, "threads": WARP_BLOCK, "smem": 0}
    smem = (K + vec) * itemsize
    threads = min(SMEM_BLOCK, max(128, 1 << (-(-K // (vec * 4)) - 1).bit_length()))
    if smem <= smem_limit:
        return {"mode": "smem", "nv": 0, "group": 0, "threads": threads, "smem": smem}
    return {"mode": "online", "nv": 0, "group": 0, "threads": ONLINE_BLOCK, "smem": 0}


def softmax(m: Any, x: CudaTensor, log: bool = False,
            out: Optional[CudaTensor] = None) -> CudaTensor:
    """softmax(x) (or log_softmax with log=True) over the last axis; a 0-d tensor is one row
    of one element. `out` (optional) must match x's shape, dtype and device."""
    what = "log_softmax" if log else "softmax"
    x = common.check_tensor(x, "tensor")
    common.require_dtype(x, common.FLOATS, what)
    if out is not None:
        common.check_tensor(out, "out")
        common.same_device(x, out)
        if out.dtype is not x.dtype:
            raise DTypeMismatchError(
                f"{what}: out has dtype {out.dtype.name_str}, expected {x.dtype.name_str}")
        if out.shape != x.shape:
            raise ShapeMismatchError(f"{what}: out has shape {out.shape}, expected {x.shape}")
    if not m.gpu or x.size == 0:
        values = _host_softmax(common.host_array(m, x), log) if x.size else \
            np.empty(x.shape, np.float32)
        host_dtype = np.float32 if x.dtype is CudaDataType.BFLOAT16 else x.dtype.numpy_dtype
        return _host_result(m, values.astype(host_dtype), x.dtype, x.device_id, out)

    dev = x.device_id
    K = x.shape[-1] if x.ndim else 1
    rows = x.size // K
    plans = _plans.get(m)
    if plans is None:
        plans = _plans.setdefault(m, {})
    key = (dev, x.dtype, K)
    p = plans.get(key)
    if p is None:  # planned once per CudaMath, device, dtype and row length
        info = m.backend.get_device_info(dev)
        p = plan(K, x.dtype.itemsize, int(info.shared_memory_per_block_optin) - 1024)
        p["kernel"] = m.kernel(TEMPLATE, dev, **kernel_params(x.dtype, p["mode"], p["nv"])).name
        if len(plans) >= 4096:
            plans.clear()
        plans[key] = p
    if out is None:
        out = m.backend.empty(x.shape, x.dtype, dev)
    if p["mode"] == "warp":
        vec_ok = int(K % (16 // x.dtype.itemsize) == 0 and x.ptr % 16 == 0 and out.ptr % 16 == 0)
        grid = -(-rows // (WARP_BLOCK // p["group"]))
    else:  # rows are moved head / 16-byte body / tail, which needs x and y congruent
        vec_ok = int((x.ptr - out.ptr) % 16 == 0 and x.ptr % x.dtype.itemsize == 0)
        grid = rows
    m.backend.launch_kernel(p["kernel"], (grid, 1, 1), x, out, rows, K, p["group"], vec_ok,
                            int(bool(log)), block_size=(p["threads"], 1, 1),
                            shared_mem=p["smem"], device_id=dev)
    return out


def _host_softmax(a: np.ndarray, log: bool) -> np.ndarray:
    """Fallback: the stable formula in float64 (NaN rows where the kernels give NaN)."""
    shape = a.shape
    a = a.astype(np.float64).reshape(shape if a.ndim else (1,))
    with np.errstate(all="ignore"):
        mx = np.max(a, axis=-1, keepdims=True)
        z = a - mx
        s = np.sum(np.exp(z), axis=-1, keepdims=True)
        r = z - np.log(s) if log else np.exp(z) / s
    return r.reshape(shape)
