"""Flash attention read straight from a fused QKV projection, and its gradient.

`flash_attention_packed(m, qkv, heads, ...)`: qkv (batch, seq, 3 * C), C = heads * head_dim,
holds q, k, v as the column blocks [0, C), [C, 2C), [2C, 3C) of each row, each split into
heads of head_dim (exactly qkv.reshape(batch, seq, 3, heads, head_dim)); the result is
(batch, seq, C), the (batch, heads, seq, head_dim) attention permuted to (batch, seq, heads,
head_dim). `flash_attention_packed_backward` gives dqkv (batch, seq, 3 * C) in the same
layout. The kernels are flash_attention's and flash_attention_backward's, with the per-group
layout arguments of their templates (attention.packed_problem): no permute copy of q, k, v,
the output or the gradients, as PyTorch's SDPA reads strided views. Same configs and the same
autotuned choice per shape class as the unpacked ops; fallback mode runs their float64
references on the permuted arrays.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple, cast

import numpy as np

from ..dtypes import CudaDataType
from ..errors import DTypeMismatchError, InvalidArgumentError, ShapeMismatchError
from ..tensor import CudaTensor
from . import attention, attention_backward, common

DT = CudaDataType
NAME = "flash_attention_packed"
BACKWARD = "flash_attention_packed_backward"


def unpack(qkv: np.ndarray, heads: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v (batch, heads, seq, head_dim) of a (batch, seq, 3 * C) host array."""
    B, T, C3 = qkv.shape
    parts = qkv.reshape(B, T, 3, heads, C3 // (3 * heads)).transpose(2, 0, 3, 1, 4)
    return parts[0], parts[1], parts[2]


def pack(x: np.ndarray) -> np.ndarray:
    """(batch, heads, seq, head_dim) -> (batch, seq, heads * head_dim)."""
    B, H, T, D = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * D)


def reference(qkv: Any, heads: int, scale: float, causal: bool,
              return_lse: bool = False) -> Any:
    """float64 packed attention: (batch, seq, C), with return_lse also lse (batch, heads,
    seq)."""
    q, k, v = unpack(np.asarray(qkv, np.float64), heads)
    out, lse = attention.reference(q, k, v, scale, causal, return_lse=True)
    return (pack(out), lse) if return_lse else pack(out)


def reference_backward(grad_out: Any, qkv: Any, heads: int, scale: float, causal: bool,
                       out: Any = None, lse: Any = None) -> np.ndarray:
    """float64 dqkv (batch, seq, 3 * C) for the upstream gradient grad_out (batch, seq, C)."""
    qkv = np.asarray(qkv, np.float64)
    B, T, C3 = qkv.shape
    D = C3 // (3 * heads)
    q, k, v = unpack(qkv, heads)

    def heads_of(x: Any) -> np.ndarray:
        return np.asarray(x, np.float64).reshape(B, T, heads, D).transpose(0, 2, 1, 3)

    grads = attention_backward.reference(heads_of(grad_out), q, k, v, scale, causal,
                                         None if out is None else heads_of(out), lse)
    return np.stack([pack(gr) for gr in grads], axis=2).reshape(B, T, C3)


# -- checks --------------------------------------------------------------------------------
def check_qkv(qkv: Any, heads: Any, op: str) -> Tuple[CudaDataType, int, int, int]:
    """A live 3-D (batch, seq, 3 * heads * head_dim) tensor of a supported dtype, heads a
    positive int, head_dim <= 256; returns (dtype, batch, seq, head_dim)."""
    common.check_tensor(qkv, "qkv")
    if qkv.ndim != 3:
        raise InvalidArgumentError(
            f"{op} needs a 3-D (batch, seq, 3 * heads * head_dim) qkv, got shape {qkv.shape}")
    if isinstance(heads, bool) or not isinstance(heads, (int, np.integer)) or heads < 1:
        raise InvalidArgumentError(f"{op}: heads must be a positive int, got {heads!r}")
    B, T, C3 = qkv.shape
    if C3 % (3 * int(heads)):
        raise ShapeMismatchError(
            f"{op}: qkv's last dimension {C3} is not divisible by 3 * heads = {3 * heads} "
            f"(expected 3 * heads * head_dim)")
    common.require_dtype(qkv, attention.DTYPES, op)
    D = C3 // (3 * int(heads))
    if D > attention.MAX_HEAD_DIM:
        raise InvalidArgumentError(
            f"{op} supports head_dim up to {attention.MAX_HEAD_DIM}, got head_dim {D} "
            f"(qkv {qkv.shape}, heads {heads})")
    if too_long(T, C3):
        raise InvalidArgumentError(
            f"{op}: sequence too long for 32-bit indexing (qkv {qkv.shape})")
    return qkv.dtype, B, T, D


def too_long(seq: int, row: int) -> bool:
    """Whether the kernels' 32-bit row offsets (rows of `row` elements) could overflow."""
    return max(seq, 256) * max(row, 1) >= 2**31


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(f"{name} must be a bool, got {value!r}")
    return bool(value)


# -- forward -------------------------------------------------------------------------------
def flash_attention_packed(m: Any, qkv: CudaTensor, heads: int, scale: Optional[float] = None,
                           causal: bool = False, return_lse: bool = False) -> Any:
    """Attention of the q, k, v packed in qkv (batch, seq, 3 * C): out (batch, seq, C), with
    return_lse (out, lse), lse float32 (batch, heads, seq) as flash_attention's."""
    if type(qkv) is CudaTensor and type(heads) is int and type(causal) is bool and \
            type(return_lse) is bool and (scale is None or type(scale) is float):
        plans = getattr(m, "plans", None)
        fast = None if plans is None else plans.get(
            (NAME, qkv.shape, heads, qkv.dtype, qkv.device_id, scale is None, causal,
             return_lse))
        if fast is not None and m.backend.direct_launch(qkv.device_id):
            res = fast(qkv, scale)
            if res is not None:
                return res
    dtype, B, T, D = check_qkv(qkv, heads, NAME)
    heads = int(heads)
    sc = attention.resolve_scale(scale, D)
    causal = check_bool(causal, "causal")
    return_lse = check_bool(return_lse, "return_lse")
    dev = qkv.device_id
    out = m.backend.empty((B, T, heads * D), dtype, dev)
    lse = None
    try:
        if return_lse:
            lse = m.backend.empty((B, heads, T), DT.FLOAT32, dev)
        if not m.gpu:
            res = reference(common.host_array(m, qkv), heads, sc, causal, return_lse=True)
            common.write_host(m, res[0], out)
            if lse is not None:
                common.write_host(m, res[1], lse)
            return (out, lse) if return_lse else out
        if T == 0 or B == 0:
            return (out, lse) if return_lse else out
        p = attention.packed_problem(B, T, heads, D)
        launch = _launcher(m, qkv, out, p, sc, causal)
        cfg = attention.pick_config(m, dtype, dev, p, causal, lambda c: launch(c, lse))
        launch(cfg, lse)
    except BaseException:
        out.free()   # nothing leaks from a failed launch
        if lse is not None:
            lse.free()
        raise
    if type(heads) is int and type(scale) in (type(None), float) and \
            getattr(m, "plans", None) is not None and hasattr(m.backend, "prepare_launch"):
        common.remember_plan(m, (NAME, qkv.shape, heads, dtype, dev, scale is None, causal,
                                 return_lse), _fast_plan(m, cfg, qkv, p, causal, return_lse))
    return (out, lse) if return_lse else out


def _launcher(m: Any, qkv: CudaTensor, out: CudaTensor, p: attention.Problem, sc: float,
              causal: bool) -> Any:
    """launch(cfg, lse): attention.run_config of the packed problem (k, v as pointers)."""
    step = p.heads * p.d * qkv.dtype.itemsize

    def launch(cfg: Any, lse: Optional[CudaTensor]) -> None:
        attention.run_config(m, cfg, qkv, qkv.ptr + step, qkv.ptr + 2 * step, out, sc, causal,
                             lse, p)
    return launch


def _fast_plan(m: Any, cfg: Any, qkv: CudaTensor, p: attention.Problem, causal: bool,
               with_lse: bool) -> Any:
    """The per-call plan (ops/common.py remember_plan) for a qkv shaped like this one: the
    result (and lse) from the pool and run_config's launch, prepared; vec / pair per call
    from the pointers, as run_config decides them."""
    dtype, dev = qkv.dtype, qkv.device_id
    B, T, C3 = qkv.shape
    D, C = p.d, C3 // 3
    kernel = attention.compiled_kernel(m, dtype, dev, cfg)
    blocks = p.bh * -(-T // attention.block_rows(cfg))
    go = m.backend.prepare_launch(kernel, (blocks, 1, 1), (32 * cfg["nw"], 1, 1),
                                  attention.shared_bytes(cfg, dtype), dev)
    outputs = common.output_maker(m, dev, (B, T, C), dtype, (B, p.heads, T), with_lse)
    step = C * dtype.itemsize
    d_vec = D % (16 // dtype.itemsize) == 0 and p.aligned("q,kv", 16, dtype.itemsize)
    d_pair = D % 2 == 0 and p.aligned("o", 2, 1)
    layout = p.args()
    default = float(attention.resolve_scale(None, D) * attention.LOG2E)
    flag = int(causal)
    isfinite = math.isfinite

    def run(qkv: CudaTensor, scale: Optional[float]) -> Any:
        pq = qkv._ptr
        if pq is None or qkv.stream is not None:
            return None
        if scale is None:
            sc = default
        elif isfinite(scale):
            sc = scale * attention.LOG2E
        else:
            return None   # the general path's error
        return outputs(lambda po, plse: go(
            pq, pq + step, pq + 2 * step, po, plse, T, T, D, sc, flag,
            int(d_vec and not (pq | step) & 15), int(d_pair and not po & 7), *layout))
    return run


# -- backward ------------------------------------------------------------------------------

def _check_backward(grad_out: Any, qkv: Any, out: Any, lse: Any,
                    heads: Any) -> Tuple[CudaDataType, int, int, int]:
    """flash_attention_packed_backward's operand checks (typed errors); returns (dtype,
    batch, seq, head_dim) of qkv."""
    dtype, B, T, D = check_qkv(qkv, heads, BACKWARD)
    heads = int(heads)
    for name, t in (("grad_out", grad_out), ("out", out), ("lse", lse)):
        common.check_tensor(t, name)
    C = heads * D
    for name, t in (("grad_out", grad_out), ("out", out)):
        if t.shape != (B, T, C):
            raise ShapeMismatchError(
                f"{BACKWARD}: {name} has shape {t.shape}, expected (batch, seq, heads * "
                f"head_dim) = {(B, T, C)}")
    if lse.shape != (B, heads, T):
        raise ShapeMismatchError(
            f"{BACKWARD}: lse has shape {lse.shape}, expected (batch, heads, seq) = "
            f"{(B, heads, T)} (flash_attention_packed(..., return_lse=True) gives it)")
    common.same_dtype(qkv, grad_out, out)
    if lse.dtype is not DT.FLOAT32:
        raise DTypeMismatchError(
            f"{BACKWARD}: lse has dtype {lse.dtype.name_str}, expected float32 (as "
            f"flash_attention_packed(..., return_lse=True) gives it)")
    common.same_device(qkv, grad_out, out, lse)
    return dtype, B, T, D


def flash_attention_packed_backward(m: Any, grad_out: CudaTensor, qkv: CudaTensor,
                                    out: CudaTensor, lse: CudaTensor, heads: int,
                                    scale: Optional[float] = None,
                                    causal: bool = False) -> CudaTensor:
    """dqkv (batch, seq, 3 * C) of flash_attention_packed for the gradient grad_out (batch,
    seq, C) of its output, from its out and lse (return_lse=True); dq, dk, dv are written
    into their column blocks by the kernels."""
    res = _planned_backward(m, grad_out, qkv, out, lse, heads, scale, causal)
    if res is not None:
        return res
    dtype, B, T, D = _check_backward(grad_out, qkv, out, lse, heads)
    heads = int(heads)
    C = heads * D
    sc = attention.resolve_scale(scale, D)
    causal = check_bool(causal, "causal")
    dev = qkv.device_id
    if not m.gpu:
        host = reference_backward(common.host_array(m, grad_out), common.host_array(m, qkv),
                                  heads, sc, causal, common.host_array(m, out),
                                  common.host_array(m, lse))
        return common.from_host(m, host, dtype, dev)
    if qkv.size == 0 or T == 0:
        return m.zeros(qkv.shape, dtype, dev)
    dqkv = m.backend.empty(qkv.shape, dtype, dev)
    try:
        p = attention.packed_problem(B, T, heads, D)
        step = C * dtype.itemsize
        k, v = qkv.ptr + step, qkv.ptr + 2 * step
        grads = (dqkv, dqkv.ptr + step, dqkv.ptr + 2 * step)

        def run(cfg: Any) -> None:
            attention_backward.run_config(m, cfg, grad_out, qkv, k, v, out, lse, grads, sc,
                                          causal, p)

        cfg = attention_backward.pick_config(m, dtype, dev, p, causal, run)
        run(cfg)
    except BaseException:
        dqkv.free()   # nothing leaks from a failed launch
        raise
    if type(heads) is int and type(scale) in (type(None), float) and \
            getattr(m, "plans", None) is not None and hasattr(m.backend, "prepare_launch"):
        common.remember_plan(m, (BACKWARD, qkv.shape, heads, dtype, dev, scale is None, causal),
                             _backward_plan(m, cfg, qkv, p, causal))
    return dqkv


def _planned_backward(m: Any, grad_out: Any, qkv: Any, out: Any, lse: Any, heads: Any,
                      scale: Any, causal: Any) -> Optional[CudaTensor]:
    """dqkv from the per-call plan of this call's key, or None (no plan, or one that leaves
    the call to the general path)."""
    if type(qkv) is not CudaTensor or type(heads) is not int or type(causal) is not bool or \
            not (scale is None or type(scale) is float):
        return None
    plans = getattr(m, "plans", None)
    fast = None if plans is None else plans.get(
        (BACKWARD, qkv.shape, heads, qkv.dtype, qkv.device_id, scale is None, causal))
    if fast is None or not m.backend.direct_launch(qkv.device_id):
        return None
    return cast(Optional[CudaTensor], fast(grad_out, qkv, out, lse, scale))


def _backward_plan(m: Any, cfg: Any, qkv: CudaTensor, p: attention.Problem,
                   causal: bool) -> Any:
    """The per-call plan (ops/common.py remember_plan) of the backward for a qkv shaped like
    this one: run(grad_out, qkv, out, lse, scale) checks what the key does not fix (types,
    shapes, dtypes, devices, live, no stream; None: the general path runs and raises), takes
    dqkv from the pool and makes attention_backward.prepared_launches' launches."""
    from ..tensor import pool_tensor
    dtype, dev, shape = qkv.dtype, qkv.device_id, qkv.shape
    B, T, C3 = shape
    C = C3 // 3
    o_shape, lse_shape = (B, T, C), (B, p.heads, T)
    go = attention_backward.prepared_launches(m, cfg, p, dtype, dev, causal)
    pool = m.backend.memory_pools[dev]
    alloc = pool.allocate_current
    size, nbytes, step = qkv.size, qkv.nbytes, C * dtype.itemsize
    f32 = DT.FLOAT32
    default = attention.resolve_scale(None, p.d)

    def run(g: Any, qkv: CudaTensor, o: Any, lse: Any, scale: Optional[float]) -> Any:
        if type(g) is not CudaTensor or type(o) is not CudaTensor or \
                type(lse) is not CudaTensor:
            return None
        pg, pq, po, pl = g._ptr, qkv._ptr, o._ptr, lse._ptr
        if pg is None or pq is None or po is None or pl is None:
            return None
        if g.shape != o_shape or o.shape != o_shape or lse.shape != lse_shape or \
                g.dtype is not dtype or o.dtype is not dtype or lse.dtype is not f32 or \
                g.device_id != dev or o.device_id != dev or lse.device_id != dev:
            return None
        if qkv.stream is not None or g.stream is not None or o.stream is not None or \
                lse.stream is not None:
            return None
        sc = attention_backward.plan_scale(scale, default)
        if sc is None:
            return None   # the general path's error
        dqkv = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        try:
            pd = dqkv._ptr
            go(pg, pq, pq + step, pq + 2 * step, po, pl, pd, pd + step, pd + 2 * step, sc)
        except BaseException:
            dqkv.free()   # nothing leaks from a failed launch
            raise
        return dqkv
    return run
