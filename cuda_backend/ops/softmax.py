"""Softmax and log-softmax over the last axis (any leading dims), float dtypes.

Numerically stable (the row max is subtracted first) and NumPy-compatible at the edges: a
row of all -inf, a row holding +inf or a row holding NaN gives NaN everywhere (what
exp(x - max) / sum gives in NumPy); -inf elements of an otherwise finite row give 0 (log:
-inf). float16/bfloat16 compute in float32, float64 in double.

One kernel launch, `softmax.cu.j2`, in one of four modes chosen from the row length K:
- "warp": rows of K <= 32 * vec * 8 elements (1024 float32) kept in registers by 1-32 lanes
  per row: 1 read + 1 write.
- "block": rows of K <= 1024 * 4 * vec elements (16K float32) kept in registers across a
  block of 128-1024 threads, nv 16-byte vectors per thread: 1 read + 1 write. Optionally
  persistent (a few blocks per SM loop over rows, prefetching the next row).
- "smem": longer rows that fit in shared memory (~56K float32 on Hopper), one block per row:
  1 read + 1 write.
- "online": longer still: running max and rescaled sum in one read, then a second read to
  write: 2 reads + 1 write.
`plan` is the fixed rule; `candidates` lists every mode and configuration able to run a row
length (perf/sweep_rows.py times them all).
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional

import numpy as np

from .. import occupancy
from ..dtypes import CudaDataType
from ..errors import DTypeMismatchError, ShapeMismatchError
from ..kernels import accumulator_type
from ..tensor import CudaTensor, pool_tensor
from . import common
from .reduction import host_result

TEMPLATE = "softmax.cu.j2"
TEMPLATES = (TEMPLATE,)
WARP_BLOCK = 256        # threads per block in warp mode
# Few rows (warp mode would launch fewer WARP_BLOCK blocks than the device has SMs): warp
# mode on WARP_SMALL_BLOCK threads, and float64 one block per row in smem mode, where that
# fits (perf/NOTES.md "Softmax" S18).
WARP_SMALL_BLOCK = 128
SMEM_BLOCK = 1024       # most threads per block in smem mode
ONLINE_BLOCK = 512      # threads per block in online mode (1024 would cap double at 64 regs)
WARP_NV = (4, 8)        # register-cached vectors per lane that warp mode is compiled for
# block mode (threads, nv, prefetch); the rule prefers nv == BLOCK_NV and BLOCK_PREFETCH
BLOCK_CONFIGS = ((128, 4, False), (256, 2, False), (256, 4, False), (512, 2, False),
                 (512, 4, False), (1024, 2, False), (1024, 4, False),
                 (256, 2, True), (256, 4, True), (512, 2, True), (512, 4, True),
                 (1024, 2, True))
BLOCK_NV = 4
BLOCK_PREFETCH = False
PERSIST_WAVES = 1       # persistent grid: this many times the resident blocks per SM
# launch plans per CudaMath: (device, dtype, K) -> plan() + kernel name
_plans: "weakref.WeakKeyDictionary[Any, Dict[tuple, Dict[str, Any]]]" = \
    weakref.WeakKeyDictionary()


def block_min_blocks(dtype: CudaDataType, block: int, nv: int, prefetch: bool) -> int:
    """Resident blocks per SM a block-mode kernel is compiled for: as many as the register
    file allows (occupancy.blocks_per_sm, Hopper's limits) for its 16-byte slots plus the
    working registers (float32 16, with prefetch 24; 16-bit types 24, with prefetch 40;
    float64 36). Every variant compiles spill-free (checked with ptxas -v)."""
    data = 4 * nv * (2 if prefetch else 1)
    if dtype is CudaDataType.FLOAT64:
        need = data + 36
    elif dtype is CudaDataType.FLOAT32:
        need = data + (24 if prefetch else 16)
    else:
        need = data + (40 if prefetch else 24)
    return occupancy.blocks_per_sm(occupancy.KernelResources(need), None, block)


def kernel_params(dtype: CudaDataType, mode: str, nv: int = 0, block: int = 0,
                  prefetch: bool = False) -> Dict[str, Any]:
    """Template parameters for one mode ("warp" with nv vectors per lane on WARP_BLOCK
    threads, or block threads where given, "block" with block threads, nv vectors per
    thread and prefetch, "smem", "online")."""
    if mode == "block" or (mode == "warp" and block):
        size = block
    else:
        size = {"warp": WARP_BLOCK, "smem": SMEM_BLOCK, "online": ONLINE_BLOCK}[mode]
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
        min_blocks = min_blocks * WARP_BLOCK // size   # the same registers per thread
    elif mode == "smem":
        min_blocks = 2
    elif mode == "block":
        min_blocks = block_min_blocks(dtype, block, nv, prefetch)
    params = {"dtype": dtype.name_str, "ctype": dtype.c_type, "acc": accumulator_type(dtype),
              "mode": mode, "vec": 16 // dtype.itemsize, "block_size": size,
              "min_blocks": min_blocks}
    if mode in ("warp", "block"):
        params["nv"] = nv
    if mode == "block":
        params["prefetch"] = bool(prefetch)
    return params


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set this module renders: per float dtype 2 warp sizes, the block
    configs, smem and online."""
    sets = []
    for dt in common.FLOATS:
        sets += [kernel_params(dt, "warp", nv, blk) for nv in WARP_NV
                 for blk in (0, WARP_SMALL_BLOCK)]
        sets += [kernel_params(dt, "block", nv, blk, pf) for blk, nv, pf in BLOCK_CONFIGS]
        sets += [kernel_params(dt, "smem"), kernel_params(dt, "online")]
    return {TEMPLATE: sets}


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every softmax variant in parallel threads (nvcc runs in subprocesses);
    returns how many were compiled (0 in fallback mode). Later calls find them memoized."""
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets]
    return common.compile_all(m, jobs, device_id, workers)


def reference(x: Any, log: bool = False) -> np.ndarray:
    """float64 softmax (log_softmax with log=True) over the last axis (the fallback's math)."""
    return _host_softmax(np.asarray(x), bool(log))


def _warp_plan(K: int, vec: int) -> Optional[Dict[str, Any]]:
    if K > 32 * vec * WARP_NV[-1]:
        return None
    nv = next(n for n in WARP_NV if K <= 32 * vec * n)
    group = min(32, 1 << max(0, -(-K // (vec * nv)) - 1).bit_length())
    return {"mode": "warp", "nv": nv, "group": group, "threads": WARP_BLOCK, "smem": 0,
            "prefetch": 0}


def _block_plans(K: int, vec: int) -> List[Dict[str, Any]]:
    """Block-mode configs whose capacity holds K with more than half of it used."""
    out = []
    for blk, nv, pf in BLOCK_CONFIGS:
        cap = blk * nv * vec
        if cap >= K and 2 * K > cap:
            out.append({"mode": "block", "nv": nv, "group": 0, "threads": blk, "smem": 0,
                        "prefetch": int(pf)})
    return out


def _smem_plan(K: int, itemsize: int, smem_limit: int) -> Optional[Dict[str, Any]]:
    vec = 16 // itemsize
    smem = (K + vec) * itemsize
    if smem > smem_limit:
        return None
    threads = min(SMEM_BLOCK, max(128, 1 << (-(-K // (vec * 4)) - 1).bit_length()))
    return {"mode": "smem", "nv": 0, "group": 0, "threads": threads, "smem": smem,
            "prefetch": 0}


def _online_plan() -> Dict[str, Any]:
    return {"mode": "online", "nv": 0, "group": 0, "threads": ONLINE_BLOCK, "smem": 0,
            "prefetch": 0}


def few_rows(K: int, itemsize: int, rows: int, sms: int) -> bool:
    """Whether rows of K would run in warp mode on fewer WARP_BLOCK blocks than sms."""
    p = _warp_plan(K, 16 // itemsize)
    return p is not None and -(-rows // (WARP_BLOCK // p["group"])) < sms


def plan(K: int, itemsize: int, smem_limit: int, rows: int = 0,
         sms: int = 0) -> Dict[str, Any]:
    """Mode and launch sizing for rows of K elements: {"mode", "nv", "group", "threads",
    "smem", "prefetch"}. smem_limit: the dynamic shared memory one block may use. The rule:
    warp mode when the row fits a warp; else block mode on the fewest threads that hold the
    row with BLOCK_NV vectors per thread and BLOCK_PREFETCH (or the first config that holds
    it); else smem, else online. With rows and sms (the device's SMs) given, warp mode for
    few rows takes WARP_SMALL_BLOCK threads (float64: smem mode)."""
    vec = 16 // itemsize
    p = _warp_plan(K, vec)
    if p is not None:
        if few_rows(K, itemsize, rows, sms):
            small = _smem_plan(K, itemsize, smem_limit) if itemsize == 8 else None
            return small or dict(p, threads=WARP_SMALL_BLOCK)
        return p
    blocks = _block_plans(K, vec)
    if blocks:
        preferred = [b for b in blocks
                     if b["nv"] == BLOCK_NV and b["prefetch"] == int(BLOCK_PREFETCH)]
        return (preferred or blocks)[0]
    return _smem_plan(K, itemsize, smem_limit) or _online_plan()


def candidates(K: int, itemsize: int, smem_limit: int) -> List[Dict[str, Any]]:
    """Every plan able to run rows of K elements (the rule's choice first; warp mode on both
    block sizes)."""
    vec = 16 // itemsize
    out = [plan(K, itemsize, smem_limit)]
    warp = _warp_plan(K, vec)
    small = None if warp is None else dict(warp, threads=WARP_SMALL_BLOCK)
    for p in [warp, small] + _block_plans(K, vec) + \
            [_smem_plan(K, itemsize, smem_limit), _online_plan()]:
        if p is not None and p not in out:
            out.append(p)
    return out


def softmax(m: Any, x: CudaTensor, log: bool = False,
            out: Optional[CudaTensor] = None) -> CudaTensor:
    """softmax(x) (or log_softmax with log=True) over the last axis; a 0-d tensor is one row
    of one element. `out` (optional) must match x's shape, dtype and device."""
    if out is None and type(x) is CudaTensor:
        fast = ("softmax", x.shape, x.dtype, x.device_id, log)
        res = common.planned(m, fast, x) if m.backend.direct_launch(x.device_id) else None
        if res is not None:
            return res
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
        return host_result(m, values.astype(host_dtype), x.dtype, x.device_id, out)

    dev = x.device_id
    K = x.shape[-1] if x.ndim else 1
    plans = _plans.get(m)
    if plans is None:
        plans = _plans.setdefault(m, {})
    rows = x.size // K
    info = m.backend.get_device_info(dev)
    sms = int(info.multiprocessor_count)
    key = (dev, x.dtype, K, few_rows(K, x.dtype.itemsize, rows, sms))
    p = plans.get(key)
    if p is None:  # planned once per CudaMath, device, dtype, row length and few_rows
        p = prepare(m, plan(K, x.dtype.itemsize, int(info.shared_memory_per_block_optin) - 1024,
                            rows, sms), x.dtype, dev)
        if len(plans) >= 4096:
            plans.clear()
        plans[key] = p
    if out is None:
        out = m.backend.empty(x.shape, x.dtype, dev)
        launch(m, p, x, out, log)
        common.remember_plan(m, ("softmax", x.shape, x.dtype, dev, log),
                             _fast_plan(m, p, x, log))
        return out
    launch(m, p, x, out, log)
    return out


def _fast_plan(m: Any, p: Dict[str, Any], x: CudaTensor, log: bool) -> Any:
    """The per-call plan of softmax on tensors shaped like x (ops/common.py remember_plan):
    the result's allocation and one prepared launch; vec_ok from the pointers as launch()."""
    dev, shape, dtype = x.device_id, x.shape, x.dtype
    K = shape[-1] if x.ndim else 1
    rows, size, nbytes = x.size // K, x.size, x.nbytes
    itemsize, vec = dtype.itemsize, 16 // dtype.itemsize
    if p["mode"] == "warp":
        grid = -(-rows // (p["threads"] // p["group"]))
    else:
        grid = min(rows, p["max_grid"]) if p["max_grid"] else rows
    kernel = m.backend.get_kernel(p["kernel"], dev)
    go = m.backend.prepare_launch(kernel, (grid, 1, 1), (p["threads"], 1, 1), p["smem"], dev)
    pool = m.backend.memory_pools[dev]
    alloc = pool.allocate_current
    group, flag, warp = p["group"], int(bool(log)), p["mode"] == "warp"

    def run(x: CudaTensor) -> Optional[CudaTensor]:
        px = x._ptr
        if px is None:
            return None
        out = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        po = out._ptr
        if warp:
            vec_ok = int(K % vec == 0 and not (px | po) & 15)
        else:
            vec_ok = int((px - po) % 16 == 0 and px % itemsize == 0)
        go(px, po, rows, K, group, vec_ok, flag)
        return out
    return run


def prepare(m: Any, p: Dict[str, Any], dtype: CudaDataType, dev: int) -> Dict[str, Any]:
    """The plan with its compiled kernel's name and, for persistent block mode, the grid
    size cap (resident blocks per SM x SMs x PERSIST_WAVES)."""
    block = 0 if p["mode"] == "warp" and p["threads"] == WARP_BLOCK else p["threads"]
    params = kernel_params(dtype, p["mode"], p["nv"], block, bool(p["prefetch"]))
    q: Dict[str, Any] = dict(p, kernel=m.kernel(TEMPLATE, dev, **params).name, max_grid=0)
    if p["prefetch"]:
        sms = int(m.backend.get_device_info(dev).multiprocessor_count)
        q["max_grid"] = sms * params["min_blocks"] * PERSIST_WAVES
    return q


def launch(m: Any, p: Dict[str, Any], x: CudaTensor, out: CudaTensor, log: bool) -> None:
    """One launch of a prepared plan over x's rows into out (same shape and dtype)."""
    K = x.shape[-1] if x.ndim else 1
    rows = x.size // K
    if p["mode"] == "warp":
        vec_ok = int(K % (16 // x.dtype.itemsize) == 0 and x.ptr % 16 == 0 and out.ptr % 16 == 0)
        grid = -(-rows // (p["threads"] // p["group"]))
    else:  # rows are moved head / 16-byte body / tail, which needs x and y congruent
        vec_ok = int((x.ptr - out.ptr) % 16 == 0 and x.ptr % x.dtype.itemsize == 0)
        grid = min(rows, p["max_grid"]) if p["max_grid"] else rows
    m.backend.launch_kernel(p["kernel"], (grid, 1, 1), x, out, rows, K, p["group"], vec_ok,
                            int(bool(log)), block_size=(p["threads"], 1, 1),
                            shared_mem=p["smem"], device_id=x.device_id)


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
