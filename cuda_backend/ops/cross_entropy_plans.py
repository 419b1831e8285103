"""Cross-entropy kernel plans and launches (`templates/cross_entropy.cu.j2`): which mode, block
size and vectors per lane run rows of K logits, the compiled kernel of a plan, and one launch
function per kernel kind. `ops/cross_entropy.py` holds the ops that use them."""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional

from ..dtypes import CudaDataType
from ..kernels import accumulator_type
from ..tensor import CudaTensor
from . import common

DT = CudaDataType
TEMPLATE = "cross_entropy.cu.j2"
WARP_BLOCK = 256                  # threads per block in warp mode (forward and backward)
FWD_WARP_VECS = 4                 # forward warp mode for rows of <= 32 * vec * 4 elements
FWD_BLOCKS = (128, 512, 1024)     # forward block mode: the fewest threads with <= 4 vectors
BWD_WARP_NV = (4, 8)              # backward warp mode: 16-byte vectors per lane
# backward block mode (threads, nv); 1024 x 4 spilled float64 at 1024 threads' 64 registers
BWD_BLOCK_CONFIGS = ((128, 4), (256, 4), (512, 4))
LOOP_BLOCK = 1024                 # backward loop mode
STATS_BLOCK = 256                 # backward from the forward's row statistics
STATS_NV = (1, 4)                 # its items (a 16-byte vector per thread each) per block
FINISH_BLOCK = 1024               # the one-block finish kernel
# the forward sums its own losses (last block, "fused") for rows <= FUSE_ROWS_PER_THREAD x
# its threads (four of the tail's steps of 4 loads) and logits of <= FUSE_MAX_BYTES (the
# fused kernels take 46-66 registers, the unfused 24-66: larger problems keep the occupancy)
FUSE_ROWS_PER_THREAD = 16
FUSE_MAX_BYTES = 1 << 22
# the backward counts the mean's rows in every block ("fused") for blocks x rows <= this
COUNT_FUSE_MAX = 1 << 18
MAX_GRID = 2**31 - 1
COUNTERS = common.TicketCounters(1)   # the fused forward's ticket, per device and stream
_prepared: "weakref.WeakKeyDictionary[Any, Dict[tuple, Dict[str, Any]]]" = \
    weakref.WeakKeyDictionary()


def kernel_params(dtype: CudaDataType, kind: str, mode: str = "", block: int = 0,
                  nv: int = 0, fused: bool = False) -> Dict[str, Any]:
    """Template parameters: kind "forward" (mode "warp" / "block" with block threads),
    "backward" (mode "warp" with nv, "block" with block threads and nv, "loop", "stats"
    with nv), "finish"; fused: the forward's sum, or the backward's mean count, in the
    kernel (the template's header)."""
    if kind == "finish":
        size = FINISH_BLOCK
    elif mode == "warp":
        size = WARP_BLOCK
    elif mode == "loop":
        size = LOOP_BLOCK
    elif mode == "stats":
        size = STATS_BLOCK
    else:
        size = block
    params = {"dtype": dtype.name_str, "ctype": dtype.c_type, "acc": accumulator_type(dtype),
              "kind": kind, "vec": 16 // dtype.itemsize, "block_size": size}
    if kind != "finish":
        params["mode"] = mode
        params["fused"] = bool(fused)
    if kind == "backward" and mode != "loop":
        params["nv"] = nv
    return params


def pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def forward_plan(K: int, itemsize: int) -> Dict[str, Any]:
    """{"mode", "threads", "group", "nv"} of the forward for rows of K: warp mode (about 2
    vectors per lane) for K <= 32 * vec * FWD_WARP_VECS, else one block per row of the fewest
    FWD_BLOCKS threads with at most 4 vectors each (1024 for longer rows)."""
    vec = 16 // itemsize
    if K <= 32 * vec * FWD_WARP_VECS:
        return {"mode": "warp", "threads": WARP_BLOCK, "nv": 0,
                "group": min(32, pow2_at_least(-(-K // (vec * 2))))}
    threads = next((b for b in FWD_BLOCKS if K <= b * vec * 4), FWD_BLOCKS[-1])
    return {"mode": "block", "threads": threads, "group": 0, "nv": 0}


def forward_candidates(K: int, itemsize: int) -> List[Dict[str, Any]]:
    """Every forward plan able to run K (all are: the lanes loop), the rule's first."""
    out = [forward_plan(K, itemsize)]
    for p in [{"mode": "warp", "threads": WARP_BLOCK, "nv": 0, "group": 32}] + \
            [{"mode": "block", "threads": b, "group": 0, "nv": 0} for b in FWD_BLOCKS]:
        if p not in out:
            out.append(p)
    return out


def bwd_warp(K: int, vec: int) -> List[Dict[str, Any]]:
    return [{"mode": "warp", "nv": nv, "threads": WARP_BLOCK,
             "group": min(32, pow2_at_least(-(-K // (vec * nv))))}
            for nv in BWD_WARP_NV if K <= 32 * vec * nv]


def bwd_block(K: int, vec: int) -> List[Dict[str, Any]]:
    return [{"mode": "block", "nv": nv, "threads": b, "group": 0}
            for b, nv in BWD_BLOCK_CONFIGS if b * nv * vec >= K]


def backward_plan(K: int, itemsize: int) -> Dict[str, Any]:
    """Backward for rows of K: warp mode with the fewest vectors per lane holding the row,
    else the block config of least capacity holding it, else loop."""
    vec = 16 // itemsize
    ps = bwd_warp(K, vec) + bwd_block(K, vec)
    return ps[0] if ps else {"mode": "loop", "nv": 0, "threads": LOOP_BLOCK, "group": 0}


def backward_candidates(K: int, itemsize: int) -> List[Dict[str, Any]]:
    """Every backward plan able to run rows of K, the rule's first."""
    vec = 16 // itemsize
    out = [backward_plan(K, itemsize)]
    for p in bwd_warp(K, vec) + bwd_block(K, vec) + \
            [{"mode": "loop", "nv": 0, "threads": LOOP_BLOCK, "group": 0}]:
        if p not in out:
            out.append(p)
    return out


def stats_plan(K: int, itemsize: int) -> Dict[str, Any]:
    """Backward from the forward's row statistics: blocks of STATS_BLOCK threads over items of
    STATS_BLOCK * vec elements of a row (a 16-byte vector per thread), nv = 4 items per block
    (4 loads in flight per thread; short rows: 4 rows per block)."""
    return {"mode": "stats", "nv": STATS_NV[-1], "threads": STATS_BLOCK, "group": 0}


def stats_candidates(K: int, itemsize: int) -> List[Dict[str, Any]]:
    """Every stats plan, the rule's first."""
    out = [stats_plan(K, itemsize)]
    for nv in STATS_NV:
        p = {"mode": "stats", "nv": nv, "threads": STATS_BLOCK, "group": 0}
        if p not in out:
            out.append(p)
    return out


def stats_chunks(p: Dict[str, Any], K: int, itemsize: int) -> int:
    """Items per row of a stats plan (the kernel's `chunks`)."""
    return -(-K // (p["threads"] * (16 // itemsize)))


def prepare(m: Any, kind: str, p: Optional[Dict[str, Any]], dtype: CudaDataType,
            dev: int, fused: bool = False) -> Dict[str, Any]:
    """A plan (None for "finish") with its compiled kernel's name (fused: see
    kernel_params)."""
    if kind == "finish":
        return {"mode": "", "threads": FINISH_BLOCK, "group": 0, "nv": 0,
                "kernel": m.kernel(TEMPLATE, dev, **kernel_params(dtype, "finish")).name}
    assert p is not None, "a forward/backward plan"
    params = kernel_params(dtype, kind, p["mode"], p["threads"], p["nv"], fused)
    return dict(p, kernel=m.kernel(TEMPLATE, dev, **params).name)


_RULES = {"forward": forward_plan, "backward": backward_plan, "stats": stats_plan}


def prepared_for(m: Any, kind: str, dtype: CudaDataType, K: int, dev: int,
                 fused: bool = False) -> Dict[str, Any]:
    """The rule's prepared plan of kind ("forward", "backward", "stats" or "finish") for
    (dtype, K, device, fused), memoized per CudaMath."""
    per = _prepared.get(m)
    if per is None:
        per = _prepared.setdefault(m, {})
    key = (kind, dev, dtype, K if kind != "finish" else 0, fused)
    q = per.get(key)
    if q is None:
        p = None if kind == "finish" else _RULES[kind](K, dtype.itemsize)
        q = prepare(m, "backward" if kind == "stats" else kind, p, dtype, dev, fused)
        if len(per) >= 4096:
            per.clear()
        per[key] = q
    return q


def forward_fuses(p: Dict[str, Any], rows: int, K: int, itemsize: int) -> bool:
    """Whether the forward of plan p over rows of K sums its own losses (see
    FUSE_ROWS_PER_THREAD)."""
    return rows <= FUSE_ROWS_PER_THREAD * p["threads"] and rows * K * itemsize <= FUSE_MAX_BYTES


def backward_fuses(p: Dict[str, Any], rows: int, K: int, itemsize: int) -> bool:
    """Whether the "mean" backward of plan p counts its rows in every block (see
    COUNT_FUSE_MAX)."""
    return grid(p, rows, K, itemsize) * rows <= COUNT_FUSE_MAX


def grid(p: Dict[str, Any], rows: int, K: int = 0, itemsize: int = 4) -> int:
    """Blocks of a plan's launch over rows (of K elements of itemsize bytes: stats plans)."""
    if p["mode"] == "warp":
        return -(-rows // (WARP_BLOCK // p["group"]))
    if p["mode"] == "stats":
        return -(-rows * stats_chunks(p, K, itemsize) // p["nv"])
    return rows if p["mode"] else 1


def launch_forward(m: Any, p: Dict[str, Any], x: CudaTensor, labels: CudaTensor, loss: Any,
                   loss_acc: bool, flag: Any, stats: Any, ignore_index: int,
                   fused: tuple = ()) -> None:
    """One forward launch of a prepared plan: per-row losses into loss (acc type when
    loss_acc, else x's dtype); flag: an int32 (2,) tensor zeroed before, or 0; stats: an
    (N, 2) acc tensor for each row's (max, sum of exp(x - max)), or 0; fused: a fused plan's
    (ticket counter, out, mean)."""
    N, K = x.shape
    vec_ok = int(K % (16 // x.dtype.itemsize) == 0 and not (x.ptr & 15))
    m.backend.launch_kernel(p["kernel"], (grid(p, N), 1, 1), x, labels,
                            int(labels.dtype is DT.INT64), loss, int(bool(loss_acc)), flag,
                            stats, N, K, ignore_index, p["group"], vec_ok, *fused,
                            block_size=(p["threads"], 1, 1), device_id=x.device_id)


def launch_backward(m: Any, p: Dict[str, Any], x: CudaTensor, labels: CudaTensor,
                    dx: CudaTensor, grad: Any, grad_stride: int, gmul: float, scale: Any,
                    flag: Any, ignore_index: int, stats: Any = None) -> None:
    """One backward launch of a prepared plan (grad, scale, flag: tensors or 0); a stats
    plan also takes the forward's (N, 2) row statistics."""
    N, K = x.shape
    isz = x.dtype.itemsize
    vec_ok = int(K % (16 // isz) == 0 and not ((x.ptr | dx.ptr) & 15))
    last = (stats, stats_chunks(p, K, isz)) if p["mode"] == "stats" else (p["group"],)
    m.backend.launch_kernel(p["kernel"], (grid(p, N, K, isz), 1, 1), x, labels,
                            int(labels.dtype is DT.INT64), dx, grad, grad_stride, gmul, scale,
                            flag, N, K, ignore_index, *last, vec_ok,
                            block_size=(p["threads"], 1, 1), device_id=x.device_id)


def launch_finish(m: Any, p: Dict[str, Any], rowloss: Any, labels: CudaTensor, N: int,
                  ignore_index: int, mean: bool, op: int, out: Any, grad: Any, gmul: float,
                  scale_out: Any, dev: int) -> None:
    """The one-block kernel: op 0 sums (mean: averages) rowloss into out, op 1 writes the
    mean's backward scale into scale_out."""
    m.backend.launch_kernel(p["kernel"], (1, 1, 1), rowloss, labels,
                            int(labels.dtype is DT.INT64), N, ignore_index, int(mean), op, out,
                            grad, gmul, scale_out, block_size=(FINISH_BLOCK, 1, 1),
                            device_id=dev)
