"""Fused cross-entropy over logits (N, C) and integer labels (N,), and its gradient with respect
to the logits, with PyTorch's semantics (F.cross_entropy without class weights or label
smoothing): the loss of row r is logsumexp(logits[r]) - logits[r, labels[r]]; a row whose label
equals ignore_index has loss 0 and a zero gradient and is left out of the mean's count (the
mean over zero counted rows is NaN, 0 / 0, as in PyTorch); reduction "mean", "sum" or "none".

Kernels, `templates/cross_entropy.cu.j2`, float dtypes (float32 math for half types, double
for float64), labels int32 or int64:
- forward: one pass over each row (a running max and sum of exp(x - max) per lane, merged
  across the row's lanes) writing the row's loss as log(sum) + (max - x[label]), which keeps
  large logits (1e4 offsets in float16 and bfloat16 too) exact to the dtype's rounding;
  mode "warp" (1-32 lanes per row, K <= 32 * vec * 4) or "block" (one block per row). For
  "mean" and "sum" a one-block "finish" kernel then sums the per-row losses (float32 or
  double, fixed order) and counts the rows: 2 launches; "none" is 1.
- backward: dlogits = (softmax(x) - onehot(label)) * scale per row, one kernel per call
  ("mean" first runs the one-block kernel that counts the rows into the scale): modes "warp"
  and "block" keep the row in registers (1 read + 1 write), "loop" for rows over
  512 * 4 * vec elements (8K float32) reads it twice. scale = grad_loss (a Python number;
  for "sum" also a tensor of shape () or (1,), for "none" a tensor of shape (N,)), divided
  by the count for "mean".

Labels out of range: a label outside [0, C) that is not ignore_index is an error
(InvalidArgumentError naming the first such row and its label), as NumPy indexing and
PyTorch raise. The kernels report such rows through a device flag (an int32 pair zeroed by
an 8-byte asynchronous memset before the launch); after the launch the host reads it back
with a synchronizing 8-byte device-to-host copy. The cost: the call waits for its kernels
(it is no longer asynchronous: the host cannot queue more work behind it), one memset and
one small copy more per call (about what a small to_numpy costs; not yet measured for this
op), and the call cannot be captured in a CUDA graph (a synchronous copy). check_labels=False
skips the flag, the memset and the wait: such rows then give a NaN loss (and a NaN gradient
row), so a "mean" or "sum" turns NaN. Fallback mode computes `reference` in float64 and
rounds once.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..dtypes import CudaDataType
from ..errors import (DeviceMismatchError, DTypeMismatchError, InvalidArgumentError,
                      ShapeMismatchError)
from ..kernels import accumulator_type
from ..tensor import CudaTensor, pool_tensor
from . import common
from .reduction import host_result

DT = CudaDataType
TEMPLATE = "cross_entropy.cu.j2"
TEMPLATES = (TEMPLATE,)
REDUCTIONS = ("mean", "sum", "none")
LABEL_DTYPES = (DT.INT32, DT.INT64)
WARP_BLOCK = 256                  # threads per block in warp mode (forward and backward)
FWD_WARP_VECS = 4                 # forward warp mode for rows of <= 32 * vec * 4 elements
FWD_BLOCKS = (128, 512, 1024)     # forward block mode: the fewest threads with <= 4 vectors
BWD_WARP_NV = (4, 8)              # backward warp mode: 16-byte vectors per lane
# backward block mode (threads, nv); 1024 x 4 spilled float64 at 1024 threads' 64 registers
BWD_BLOCK_CONFIGS = ((128, 4), (256, 4), (512, 4))
LOOP_BLOCK = 1024                 # backward loop mode
FINISH_BLOCK = 1024               # the one-block finish kernel
_prepared: "weakref.WeakKeyDictionary[Any, Dict[tuple, Dict[str, Any]]]" = \
    weakref.WeakKeyDictionary()


def _acc_dtype(dtype: CudaDataType) -> CudaDataType:
    return DT.FLOAT64 if dtype is DT.FLOAT64 else DT.FLOAT32


def kernel_params(dtype: CudaDataType, kind: str, mode: str = "", block: int = 0,
                  nv: int = 0) -> Dict[str, Any]:
    """Template parameters: kind "forward" (mode "warp" / "block" with block threads),
    "backward" (mode "warp" with nv, "block" with block threads and nv, "loop"), "finish"."""
    if kind == "finish":
        size = FINISH_BLOCK
    elif mode == "warp":
        size = WARP_BLOCK
    elif mode == "loop":
        size = LOOP_BLOCK
    else:
        size = block
    params = {"dtype": dtype.name_str, "ctype": dtype.c_type, "acc": accumulator_type(dtype),
              "kind": kind, "vec": 16 // dtype.itemsize, "block_size": size}
    if kind != "finish":
        params["mode"] = mode
    if kind == "backward" and mode != "loop":
        params["nv"] = nv
    return params


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Per float dtype: forward warp and block sizes, backward warp sizes, block configs and
    loop, and finish."""
    sets = []
    for dt in common.FLOATS:
        sets.append(kernel_params(dt, "forward", "warp"))
        sets += [kernel_params(dt, "forward", "block", b) for b in FWD_BLOCKS]
        sets += [kernel_params(dt, "backward", "warp", nv=nv) for nv in BWD_WARP_NV]
        sets += [kernel_params(dt, "backward", "block", b, nv) for b, nv in BWD_BLOCK_CONFIGS]
        sets.append(kernel_params(dt, "backward", "loop"))
        sets.append(kernel_params(dt, "finish"))
    return {TEMPLATE: sets}


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every variant in parallel threads; 0 in fallback mode."""
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets]
    return common.compile_all(m, jobs, device_id, workers)


# -- reference ------------------------------------------------------------------------------
def reference(op: str, logits: Any, labels: Any, reduction: str = "mean",
              ignore_index: int = -100, grad_loss: Any = 1.0) -> np.ndarray:
    """float64 NumPy of op "cross_entropy" (the loss) or "cross_entropy_backward" (dlogits,
    for the upstream gradient grad_loss: a number, or an array of shape (N,) for "none").
    Rows with a label outside [0, C) that is not ignore_index give NaN (the ops raise)."""
    x = np.asarray(logits, dtype=np.float64)
    lab = np.asarray(labels).astype(np.int64)
    N, C = x.shape
    valid = lab != ignore_index
    bad = valid & ((lab < 0) | (lab >= C))
    ok = valid & ~bad
    rows = np.arange(N)
    with np.errstate(all="ignore"):
        mx = np.max(x, axis=1) if C else np.full(N, -np.inf)
        z = x - mx[:, None]
        s = np.sum(np.exp(z), axis=1)
        if op == "cross_entropy":
            xl = x[rows, np.clip(lab, 0, max(C - 1, 0))] if N else np.zeros(0)
            loss = np.where(ok, np.log(s) + (mx - xl), np.where(bad, np.nan, 0.0))
            if reduction == "none":
                return loss
            total = np.sum(loss)
            if reduction == "sum":
                return np.asarray(total, dtype=np.float64)
            return np.asarray(total / np.float64(np.count_nonzero(valid)), dtype=np.float64)
        if op != "cross_entropy_backward":
            raise InvalidArgumentError(f"unknown op {op!r}")
        p = np.exp(z) / s[:, None]
        p[rows[ok], lab[ok]] -= 1.0
        g = np.asarray(grad_loss, dtype=np.float64)
        scale = np.broadcast_to(g.reshape(-1) if reduction == "none" else g.reshape(()),
                                (N,)).astype(np.float64)
        if reduction == "mean":
            scale = scale / np.float64(np.count_nonzero(valid))
        dx = np.where(ok[:, None], p * scale[:, None], np.where(bad[:, None], np.nan, 0.0))
    return np.asarray(dx, dtype=np.float64).reshape(N, C)


# -- plans ----------------------------------------------------------------------------------
def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def forward_plan(K: int, itemsize: int) -> Dict[str, Any]:
    """{"mode", "threads", "group", "nv"} of the forward for rows of K: warp mode (about 2
    vectors per lane) for K <= 32 * vec * FWD_WARP_VECS, else one block per row of the fewest
    FWD_BLOCKS threads with at most 4 vectors each (1024 for longer rows)."""
    vec = 16 // itemsize
    if K <= 32 * vec * FWD_WARP_VECS:
        return {"mode": "warp", "threads": WARP_BLOCK, "nv": 0,
                "group": min(32, _pow2_at_least(-(-K // (vec * 2))))}
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


def _bwd_warp(K: int, vec: int) -> List[Dict[str, Any]]:
    return [{"mode": "warp", "nv": nv, "threads": WARP_BLOCK,
             "group": min(32, _pow2_at_least(-(-K // (vec * nv))))}
            for nv in BWD_WARP_NV if K <= 32 * vec * nv]


def _bwd_block(K: int, vec: int) -> List[Dict[str, Any]]:
    return [{"mode": "block", "nv": nv, "threads": b, "group": 0}
            for b, nv in BWD_BLOCK_CONFIGS if b * nv * vec >= K]


def backward_plan(K: int, itemsize: int) -> Dict[str, Any]:
    """Backward for rows of K: warp mode with the fewest vectors per lane holding the row,
    else the block config of least capacity holding it, else loop."""
    vec = 16 // itemsize
    ps = _bwd_warp(K, vec) + _bwd_block(K, vec)
    return ps[0] if ps else {"mode": "loop", "nv": 0, "threads": LOOP_BLOCK, "group": 0}


def backward_candidates(K: int, itemsize: int) -> List[Dict[str, Any]]:
    """Every backward plan able to run rows of K, the rule's first."""
    vec = 16 // itemsize
    out = [backward_plan(K, itemsize)]
    for p in _bwd_warp(K, vec) + _bwd_block(K, vec) + \
            [{"mode": "loop", "nv": 0, "threads": LOOP_BLOCK, "group": 0}]:
        if p not in out:
            out.append(p)
    return out


def candidates(kind: str, K: int, itemsize: int) -> List[Dict[str, Any]]:
    """Every plan of kind "forward" or "backward" able to run rows of K elements."""
    return forward_candidates(K, itemsize) if kind == "forward" else \
        backward_candidates(K, itemsize)


def prepare(m: Any, kind: str, p: Optional[Dict[str, Any]], dtype: CudaDataType,
            dev: int) -> Dict[str, Any]:
    """A plan (None for "finish") with its compiled kernel's name."""
    if kind == "finish":
        return {"mode": "", "threads": FINISH_BLOCK, "group": 0, "nv": 0,
                "kernel": m.kernel(TEMPLATE, dev, **kernel_params(dtype, "finish")).name}
    assert p is not None, "a forward/backward plan"
    params = kernel_params(dtype, kind, p["mode"], p["threads"], p["nv"])
    return dict(p, kernel=m.kernel(TEMPLATE, dev, **params).name)


def _prepared_for(m: Any, kind: str, dtype: CudaDataType, K: int, dev: int) -> Dict[str, Any]:
    """The rule's prepared plan of kind for (dtype, K, device), memoized per CudaMath."""
    per = _prepared.get(m)
    if per is None:
        per = _prepared.setdefault(m, {})
    key = (kind, dev, dtype, K if kind != "finish" else 0)
    q = per.get(key)
    if q is None:
        p = None if kind == "finish" else (forward_plan if kind == "forward" else
                                           backward_plan)(K, dtype.itemsize)
        q = prepare(m, kind, p, dtype, dev)
        if len(per) >= 4096:
            per.clear()
        per[key] = q
    return q


def _grid(p: Dict[str, Any], rows: int) -> int:
    if p["mode"] == "warp":
        return -(-rows // (WARP_BLOCK // p["group"]))
    return rows if p["mode"] else 1


def launch_forward(m: Any, p: Dict[str, Any], x: CudaTensor, labels: CudaTensor, loss: Any,
                   loss_acc: bool, flag: Any, ignore_index: int) -> None:
    """One forward launch of a prepared plan: per-row losses into loss (acc type when
    loss_acc, else x's dtype); flag: an int32 (2,) tensor zeroed before, or 0."""
    N, K = x.shape
    vec_ok = int(K % (16 // x.dtype.itemsize) == 0 and not (x.ptr & 15))
    m.backend.launch_kernel(p["kernel"], (_grid(p, N), 1, 1), x, labels,
                            int(labels.dtype is DT.INT64), loss, int(bool(loss_acc)), flag, N,
                            K, ignore_index, p["group"], vec_ok,
                            block_size=(p["threads"], 1, 1), device_id=x.device_id)


def launch_backward(m: Any, p: Dict[str, Any], x: CudaTensor, labels: CudaTensor,
                    dx: CudaTensor, grad: Any, grad_stride: int, gmul: float, scale: Any,
                    flag: Any, ignore_index: int) -> None:
    """One backward launch of a prepared plan (grad, scale, flag: tensors or 0)."""
    N, K = x.shape
    vec_ok = int(K % (16 // x.dtype.itemsize) == 0 and not ((x.ptr | dx.ptr) & 15))
    m.backend.launch_kernel(p["kernel"], (_grid(p, N), 1, 1), x, labels,
                            int(labels.dtype is DT.INT64), dx, grad, grad_stride, gmul, scale,
                            flag, N, K, ignore_index, p["group"], vec_ok,
                            block_size=(p["threads"], 1, 1), device_id=x.device_id)


def _launch_finish(m: Any, p: Dict[str, Any], rowloss: Any, labels: CudaTensor, N: int,
                   ignore_index: int, mean: bool, op: int, out: Any, grad: Any, gmul: float,
                   scale_out: Any, dev: int) -> None:
    m.backend.launch_kernel(p["kernel"], (1, 1, 1), rowloss, labels,
                            int(labels.dtype is DT.INT64), N, ignore_index, int(mean), op, out,
                            grad, gmul, scale_out, block_size=(FINISH_BLOCK, 1, 1),
                            device_id=dev)


# -- checks -----------------------------------------------------------------------------------
def _check(name: str, logits: Any, labels: Any, reduction: Any, ignore_index: Any,
           check_labels: Any) -> Tuple[int, int, int]:
    """(N, C, device) after the operand checks every call makes."""
    x = common.check_tensor(logits, "logits")
    lab = common.check_tensor(labels, "labels")
    common.require_dtype(x, common.FLOATS, name)
    if lab.dtype not in LABEL_DTYPES:
        raise DTypeMismatchError(
            f"{name}: labels must be int32 or int64 class indices, got {lab.dtype.name_str}")
    dev = common.same_device(x, lab)
    if x.ndim != 2:
        raise ShapeMismatchError(f"{name}: logits must be 2-D (N, C), got shape {x.shape}")
    N, C = x.shape
    if C < 1:
        raise ShapeMismatchError(f"{name}: logits need at least one class, got shape {x.shape}")
    if lab.shape != (N,):
        raise ShapeMismatchError(
            f"{name}: labels must have shape ({N},) for logits of shape {x.shape}, got "
            f"{lab.shape}")
    if type(reduction) is not str or reduction not in REDUCTIONS:
        raise InvalidArgumentError(
            f"{name}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)) or \
            not -2**63 <= int(ignore_index) < 2**63:
        raise InvalidArgumentError(
            f"{name}: ignore_index must be an int (a 64-bit label value), got {ignore_index!r}")
    if not isinstance(check_labels, (bool, np.bool_)):
        raise InvalidArgumentError(f"{name}: check_labels must be a bool, got {check_labels!r}")
    return N, C, dev


def _bad_label_error(name: str, row: int, label: int, count: int, C: int,
                     ignore_index: int) -> InvalidArgumentError:
    more = f" ({count} rows have one)" if count > 1 else ""
    return InvalidArgumentError(
        f"{name}: label {label} in row {row} is out of range [0, {C}) and is not ignore_index "
        f"({ignore_index}){more}")


def _host_check_labels(name: str, lab: np.ndarray, C: int, ignore_index: int) -> None:
    lab = lab.astype(np.int64)
    bad = (lab != ignore_index) & ((lab < 0) | (lab >= C))
    if bad.any():
        rows = np.flatnonzero(bad)
        raise _bad_label_error(name, int(rows[0]), int(lab[rows[0]]), len(rows), C,
                               ignore_index)


def _new_flag(m: Any, dev: int) -> CudaTensor:
    """An int32 (2,) device flag, zeroed on the current stream (an async memset)."""
    f = m.backend.empty((2,), DT.INT32, dev)
    m.backend.memset_async(f, 0)
    return f


def _check_flag(m: Any, flag: CudaTensor, name: str, labels: CudaTensor, C: int,
                ignore_index: int, results: Tuple[Any, ...]) -> None:
    """Read the flag back (waits for the kernels), free it; when a row was flagged, free
    results and raise naming the first such row and its label."""
    h = np.zeros(2, np.int32)
    try:
        m.backend.copy_from_device(flag, h)
    finally:
        flag.free()
    count = int(h[0])
    if not count:
        return
    for t in results:
        if t is not None:
            t.free()
    row = ~int(h[1].view(np.uint32)) & 0xFFFFFFFF
    label = int(common.host_array(m, labels)[row])
    raise _bad_label_error(name, row, label, count, C, ignore_index)


def _host_dtype(dtype: CudaDataType) -> Any:
    return np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype


def _host_out(m: Any, values: np.ndarray, dtype: CudaDataType, dev: int) -> CudaTensor:
    with np.errstate(over="ignore", invalid="ignore"):
        return host_result(m, np.asarray(values).astype(_host_dtype(dtype)), dtype, dev, None)


# -- the ops -----------------------------------------------------------------------------------
def cross_entropy(m: Any, logits: CudaTensor, labels: CudaTensor, reduction: str = "mean",
                  ignore_index: int = -100, check_labels: bool = True) -> CudaTensor:
    """The cross-entropy loss of logits (N, C) against labels (N,) (int32 or int64): shape
    () for "mean" and "sum", (N,) for "none", in the logits' dtype."""
    if type(logits) is CudaTensor and type(labels) is CudaTensor and \
            type(ignore_index) is int and type(reduction) is str and type(check_labels) is bool:
        fast = m.plans.get(("cross_entropy", logits.shape, logits.dtype, labels.dtype,
                            logits.device_id, reduction, ignore_index, check_labels))
        if fast is not None:
            res = fast(logits, labels)
            if res is not None:
                return res
    name = "cross_entropy"
    N, C, dev = _check(name, logits, labels, reduction, ignore_index, check_labels)
    ignore_index = int(ignore_index)
    dtype = logits.dtype
    if not m.gpu or N == 0:
        lab = common.host_array(m, labels)
        if check_labels:
            _host_check_labels(name, lab, C, ignore_index)
        values = reference(name, common.host_array(m, logits), lab, reduction, ignore_index)
        return _host_out(m, values, dtype, dev)
    pf = _prepared_for(m, "forward", dtype, C, dev)
    flag = _new_flag(m, dev) if check_labels else None
    if reduction == "none":
        out = m.backend.empty((N,), dtype, dev)
        buf = None
    else:
        buf = m.backend.empty((N,), _acc_dtype(dtype), dev)
        out = m.backend.empty((), dtype, dev)
    launch_forward(m, pf, logits, labels, buf if buf is not None else out, buf is not None,
                   flag if flag is not None else 0, ignore_index)
    if buf is not None:
        pfin = _prepared_for(m, "finish", dtype, 0, dev)
        _launch_finish(m, pfin, buf, labels, N, ignore_index, reduction == "mean", 0, out, 0,
                       0.0, 0, dev)
        buf.free()   # stream-ordered: reused only after the finish kernel
    if flag is not None:
        _check_flag(m, flag, name, labels, C, ignore_index, (out,))
    key = ("cross_entropy", logits.shape, dtype, labels.dtype, dev, reduction, ignore_index,
           bool(check_labels))
    if key not in m.plans:
        common.remember_plan(m, key, _fast_forward(m, logits, labels.dtype, reduction,
                                                   ignore_index, bool(check_labels)))
    return out


def _fast_forward(m: Any, x: CudaTensor, ldt: CudaDataType, reduction: str, ignore_index: int,
                  check: bool) -> Any:
    """The per-call plan of cross_entropy for logits shaped like x and labels of dtype ldt:
    run(logits, labels) -> the loss, or None (the general path then runs)."""
    backend = m.backend
    dev, dtype = x.device_id, x.dtype
    N, C = x.shape
    pf = _prepared_for(m, "forward", dtype, C, dev)
    go = backend.prepare_launch(backend.get_kernel(pf["kernel"], dev), (_grid(pf, N), 1, 1),
                                (pf["threads"], 1, 1), 0, dev)
    fin = None
    if reduction != "none":
        pfin = _prepared_for(m, "finish", dtype, 0, dev)
        fin = backend.prepare_launch(backend.get_kernel(pfin["kernel"], dev), (1, 1, 1),
                                     (FINISH_BLOCK, 1, 1), 0, dev)
    pool = backend.memory_pools[dev]
    alloc = pool.allocate_current
    direct = backend.direct_launch
    adt = _acc_dtype(dtype)
    label64 = int(ldt is DT.INT64)
    kvec = C % (16 // dtype.itemsize) == 0
    group, mean = pf["group"], int(reduction == "mean")
    isz, asz = dtype.itemsize, adt.itemsize

    def run(x: CudaTensor, labels: CudaTensor) -> Optional[CudaTensor]:
        px, pl = x._ptr, labels._ptr
        if px is None or pl is None or labels.shape != (N,) or labels.device_id != dev or \
                not direct(dev):
            return None
        flag = _new_flag(m, dev) if check else None
        pflag = flag._ptr if flag is not None else 0
        vec_ok = int(kvec and not (px & 15))
        if fin is None:
            out = pool_tensor((N,), dtype, dev, alloc(N * isz), pool, N, N * isz)
            go(px, pl, label64, out._ptr, 0, pflag, N, C, ignore_index,
               group, vec_ok)
        else:
            buf = pool_tensor((N,), adt, dev, alloc(N * asz), pool, N, N * asz)
            out = pool_tensor((), dtype, dev, alloc(isz), pool, 1, isz)
            go(px, pl, label64, buf._ptr, 1, pflag, N, C, ignore_index,
               group, vec_ok)
            fin(buf._ptr, pl, label64, N, ignore_index, mean, 0, out._ptr, 0, 0.0, 0)
            buf.free()
        if flag is not None:    # (check)
            _check_flag(m, flag, "cross_entropy", labels, C, ignore_index, (out,))
        return out
    return run


def _check_grad(name: str, grad_loss: Any, reduction: str, N: int, dtype: CudaDataType,
                dev: int) -> Tuple[Optional[CudaTensor], float]:
    """(grad tensor or None, gmul): a Python number (any reduction), or a tensor of the
    logits' dtype and device: shape (N,) for "none", () or (1,) for "mean" and "sum"."""
    if isinstance(grad_loss, CudaTensor):
        grad_loss.check_alive()
        if grad_loss.dtype is not dtype:
            raise DTypeMismatchError(
                f"{name}: grad_loss has dtype {grad_loss.dtype.name_str}, expected the "
                f"logits' {dtype.name_str}")
        if grad_loss.device_id != dev:
            raise DeviceMismatchError(
                f"{name}: grad_loss is on cuda:{grad_loss.device_id}, the logits on cuda:{dev}")
        want = ((N,),) if reduction == "none" else ((), (1,))
        if grad_loss.shape not in want:
            raise ShapeMismatchError(
                f"{name}: grad_loss has shape {grad_loss.shape}, expected "
                f"{' or '.join(str(w) for w in want)} for reduction={reduction!r}")
        return grad_loss, 1.0
    if isinstance(grad_loss, bool) or not isinstance(grad_loss, (int, float, np.integer,
                                                                   np.floating)):
        raise InvalidArgumentError(
            f"{name}: grad_loss must be a real number or a CudaTensor, got "
            f"{type(grad_loss).__name__}")
    return None, float(grad_loss)


def cross_entropy_backward(m: Any, logits: CudaTensor, labels: CudaTensor,
                           grad_loss: Any = 1.0, reduction: str = "mean",
                           ignore_index: int = -100, check_labels: bool = True) -> CudaTensor:
    """d(loss)/d(logits), (N, C) in the logits' dtype, for the upstream gradient grad_loss of
    the loss cross_entropy(logits, labels, reduction, ignore_index) returned."""
    if type(logits) is CudaTensor and type(labels) is CudaTensor and \
            type(ignore_index) is int and type(grad_loss) is float and \
            type(reduction) is str and type(check_labels) is bool:
        fast = m.plans.get(("cross_entropy_backward", logits.shape, logits.dtype, labels.dtype,
                            logits.device_id, reduction, ignore_index, check_labels))
        if fast is not None:
            res = fast(logits, labels, grad_loss)
            if res is not None:
                return res
    name = "cross_entropy_backward"
    N, C, dev = _check(name, logits, labels, reduction, ignore_index, check_labels)
    ignore_index = int(ignore_index)
    dtype = logits.dtype
    grad, gmul = _check_grad(name, grad_loss, reduction, N, dtype, dev)
    if not m.gpu or N == 0:
        lab = common.host_array(m, labels)
        if check_labels:
            _host_check_labels(name, lab, C, ignore_index)
        g = gmul if grad is None else common.host_array(m, grad).astype(np.float64)
        values = reference(name, common.host_array(m, logits), lab, reduction, ignore_index, g)
        return _host_out(m, values, dtype, dev)
    pb = _prepared_for(m, "backward", dtype, C, dev)
    flag = _new_flag(m, dev) if check_labels else None
    dx = m.backend.empty((N, C), dtype, dev)
    scale = None
    if reduction == "mean":
        scale = m.backend.empty((1,), _acc_dtype(dtype), dev)
        pfin = _prepared_for(m, "finish", dtype, 0, dev)
        _launch_finish(m, pfin, 0, labels, N, ignore_index, True, 1, 0,
                       grad if grad is not None else 0, gmul, scale, dev)
        launch_backward(m, pb, logits, labels, dx, 0, 0, 0.0, scale,
                        flag if flag is not None else 0, ignore_index)
        scale.free()
    else:
        launch_backward(m, pb, logits, labels, dx, grad if grad is not None else 0,
                        1 if reduction == "none" else 0, gmul, 0,
                        flag if flag is not None else 0, ignore_index)
    if flag is not None:
        _check_flag(m, flag, name, labels, C, ignore_index, (dx,))
    if grad is None:
        key = ("cross_entropy_backward", logits.shape, dtype, labels.dtype, dev, reduction,
               ignore_index, bool(check_labels))
        if key not in m.plans:
            common.remember_plan(m, key, _fast_backward(m, logits, labels.dtype, reduction,
                                                        ignore_index, bool(check_labels)))
    return dx


def _fast_backward(m: Any, x: CudaTensor, ldt: CudaDataType, reduction: str,
                   ignore_index: int, check: bool) -> Any:
    """The per-call plan of cross_entropy_backward for logits shaped like x, labels of dtype
    ldt and a Python float grad_loss: run(logits, labels, grad_loss) -> dlogits or None."""
    backend = m.backend
    dev, dtype = x.device_id, x.dtype
    N, C = x.shape
    pb = _prepared_for(m, "backward", dtype, C, dev)
    go = backend.prepare_launch(backend.get_kernel(pb["kernel"], dev), (_grid(pb, N), 1, 1),
                                (pb["threads"], 1, 1), 0, dev)
    fin = None
    if reduction == "mean":
        pfin = _prepared_for(m, "finish", dtype, 0, dev)
        fin = backend.prepare_launch(backend.get_kernel(pfin["kernel"], dev), (1, 1, 1),
                                     (FINISH_BLOCK, 1, 1), 0, dev)
    pool = backend.memory_pools[dev]
    alloc = pool.allocate_current
    direct = backend.direct_launch
    adt = _acc_dtype(dtype)
    label64 = int(ldt is DT.INT64)
    kvec = C % (16 // dtype.itemsize) == 0
    group, size, nbytes = pb["group"], N * C, N * C * dtype.itemsize

    def run(x: CudaTensor, labels: CudaTensor, gmul: float) -> Optional[CudaTensor]:
        px, pl = x._ptr, labels._ptr
        if px is None or pl is None or labels.shape != (N,) or labels.device_id != dev or \
                not direct(dev):
            return None
        flag = _new_flag(m, dev) if check else None
        pflag = flag._ptr if flag is not None else 0
        dx = pool_tensor((N, C), dtype, dev, alloc(nbytes), pool, size, nbytes)
        pd = dx._ptr
        vec_ok = int(kvec and not ((px | pd) & 15))
        if fin is not None:
            sc = pool_tensor((1,), adt, dev, alloc(adt.itemsize), pool, 1, adt.itemsize)
            fin(0, pl, label64, N, ignore_index, 1, 1, 0, 0, gmul, sc._ptr)
            go(px, pl, label64, pd, 0, 0, 0.0, sc._ptr, pflag, N, C, ignore_index, group,
               vec_ok)
            sc.free()
        else:
            go(px, pl, label64, pd, 0, 0, gmul, 0, pflag, N, C, ignore_index, group, vec_ok)
        if flag is not None:    # (check)
            _check_flag(m, flag, "cross_entropy_backward", labels, C, ignore_index, (dx,))
        return dx
    return run
