"""Fused optimizer steps in place (`templates/optimizers.cu.j2`): SGD (momentum, Nesterov,
weight decay) and Adam/AdamW with bias correction, one kernel per step.

Parameters and gradients share a dtype: float32 or float64, or float16/bfloat16 with float32
optimizer buffers (the update is computed in float32 and rounded once into the parameter).
Buffers of float32/float64 parameters have the parameter's dtype. SGD's momentum buffer is
initialized from the gradient on the first step, as PyTorch.

The step count comes from one of two places. Without `state.step_count` it is the host's
`state.step` (the steps taken so far), which every call advances by one after its launch;
the launch carries the values derived from it (SGD's first-step flag, Adam's bias
corrections), so a CUDA graph recording the call would replay that step's values forever.
With `state.step_count`, a one-element int32 tensor (`STEP_DTYPE`) on the parameters' device
holding t >= 1, the number of the step being taken, the kernel reads t on the device and
`state.step` is left alone; `advance_steps` adds one to any number of such counts in one
launch, before the updates that read them. A graph recording advance_steps and the updates
then takes step t, t + 1, ... on its replays, as the eager calls would (optim.py keeps one
count per parameter this way, PyTorch's `capturable=True`).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..dtypes import CudaDataType
from ..errors import (DeviceMismatchError, DTypeMismatchError, InvalidArgumentError,
                      ShapeMismatchError)
from ..kernels import dtype_params
from ..tensor import CudaTensor
from . import common

DT = CudaDataType
TEMPLATE = "optimizers.cu.j2"
TEMPLATES = (TEMPLATE,)
BLOCK = 256
DTYPES = common.FLOATS
STEP_DTYPE = DT.INT32   # the device step counts (exact to 2**31 - 1 steps)
_INF = math.inf


def state_dtype(dtype: CudaDataType) -> CudaDataType:
    """The dtype optimizer buffers must have for parameters of this dtype."""
    return DT.FLOAT64 if dtype is DT.FLOAT64 else DT.FLOAT32


def _vec(dtype: CudaDataType) -> int:
    return 16 // dtype.itemsize


def _params(dtype: CudaDataType, opt: str) -> Dict[str, Any]:
    return {**dtype_params(dtype), "state_ctype": state_dtype(dtype).c_type, "opt": opt,
            "block_size": BLOCK, "vec": _vec(dtype)}


COUNT_PARAMS: Dict[str, Any] = {"opt": "count", "block_size": BLOCK}


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    return {TEMPLATE: [_params(dt, opt) for opt in ("sgd", "adam") for dt in DTYPES] +
            [dict(COUNT_PARAMS)]}


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every optimizer variant in parallel threads (nvcc runs in subprocesses);
    returns how many were compiled (0 in fallback mode)."""
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets]
    return common.compile_all(m, jobs, device_id, workers)


def reference(opt: str, state: Any, params: Any, grads: Any, *buffers: Any) -> tuple:
    """One step in float64 NumPy, PyTorch's semantics, for an OptimizerState `state` (not
    advanced): opt "sgd" with buffers (momentum,) or none -> (params, momentum or None);
    "adam" with buffers (m, v) -> (params, m, v), bias-corrected at step state.step + 1
    (the host count: state.step_count is not read)."""
    p = np.asarray(params, dtype=np.float64)
    g = np.asarray(grads, dtype=np.float64)
    bufs = [None if b is None else np.asarray(b, dtype=np.float64) for b in buffers]
    lr, wd = float(state.learning_rate), float(getattr(state, "weight_decay", 0.0))
    if opt == "sgd":
        mom = float(getattr(state, "momentum", 0.0))
        g = g + wd * p
        b = bufs[0] if bufs else None
        if b is not None:
            b = g.copy() if int(state.step) == 0 else mom * b + g
            g = g + mom * b if getattr(state, "nesterov", False) else b
        return p - lr * g, b
    if opt == "adam":
        b1, b2, eps = float(state.beta1), float(state.beta2), float(state.epsilon)
        t = int(state.step) + 1
        mb, vb = bufs
        assert mb is not None and vb is not None, "adam takes buffers (m, v)"
        if getattr(state, "decoupled", False):
            p = p * (1.0 - lr * wd)
        else:
            g = g + wd * p
        mb = b1 * mb + (1.0 - b1) * g
        vb = b2 * vb + (1.0 - b2) * g * g
        p = p - lr * (mb / (1.0 - b1 ** t)) / (np.sqrt(vb / (1.0 - b2 ** t)) + eps)
        return p, mb, vb
    raise InvalidArgumentError(f"unknown optimizer {opt!r}: 'sgd' or 'adam'")


# -- checks --------------------------------------------------------------------------------
def _hyper(state: Any, name: str, minimum: Optional[float] = None,
           below: Optional[float] = None) -> float:
    if not hasattr(state, name):
        raise InvalidArgumentError(
            f"optimizer_state must be an OptimizerState (missing '{name}'), got "
            f"{type(state).__name__}")
    value = getattr(state, name)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(f"optimizer_state.{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or (minimum is not None and v < minimum) or \
            (below is not None and v >= below):
        lo = f" >= {minimum}" if minimum is not None else ""
        hi = f" and < {below}" if below is not None else ""
        raise InvalidArgumentError(
            f"optimizer_state.{name} must be finite{lo}{hi}, got {value!r}")
    return v


def _step(state: Any) -> int:
    step = getattr(state, "step", None)
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise InvalidArgumentError(f"optimizer_state.step must be an int >= 0, got {step!r}")
    return int(step)


def _device_count(state: Any, dev: int, op: str) -> Optional[CudaTensor]:
    """state.step_count checked (None when the state has none): a live one-element int32
    tensor on the parameters' device."""
    count = getattr(state, "step_count", None)
    if count is None:
        return None
    common.check_tensor(count, "optimizer_state.step_count")
    if count.dtype is not STEP_DTYPE:
        raise DTypeMismatchError(
            f"{op}: optimizer_state.step_count has dtype {count.dtype.name_str}, expected "
            f"{STEP_DTYPE.name_str} (one step count)")
    if count.size != 1:
        raise ShapeMismatchError(
            f"{op}: optimizer_state.step_count has shape {count.shape}, expected one element "
            f"(the step being taken)")
    if count.device_id != dev:
        raise DeviceMismatchError(
            f"{op}: optimizer_state.step_count is on cuda:{count.device_id}, the parameters "
            f"on cuda:{dev}; the count must be on the parameters' device")
    return count


def _host_count(m: Any, count: CudaTensor, op: str) -> int:
    """The step t a device count holds, read on the host (fallback mode: the host's own
    memory); t < 1 means advance_steps did not run before the update."""
    t = int(common.host_array(m, count).reshape(-1)[0])
    if t < 1:
        raise InvalidArgumentError(
            f"{op}: optimizer_state.step_count holds {t}, expected the step being taken "
            f"(>= 1): call advance_steps on the counts before the updates")
    return t


def _check(params: CudaTensor, grads: CudaTensor, buffers: Dict[str, Optional[CudaTensor]],
           op: str) -> int:
    common.check_tensor(params, "params")
    common.check_tensor(grads, "gradients")
    common.require_dtype(params, DTYPES, op)
    if grads.shape != params.shape:
        raise ShapeMismatchError(
            f"{op}: gradients have shape {grads.shape}, params have shape {params.shape}")
    common.same_dtype(params, grads)
    want = state_dtype(params.dtype)
    tensors = [params, grads]
    for name, t in buffers.items():
        if t is None:
            continue
        common.check_tensor(t, name)
        if t.shape != params.shape:
            raise ShapeMismatchError(
                f"{op}: {name} has shape {t.shape}, params have shape {params.shape}")
        if t.dtype is not want:
            raise DTypeMismatchError(
                f"{op}: {name} has dtype {t.dtype.name_str}, expected {want.name_str} for "
                f"{params.dtype.name_str} params")
        tensors.append(t)
    return common.same_device(*tensors)


def _aligned(*tensors: Optional[CudaTensor]) -> int:
    return int(all(t.ptr % 16 == 0 for t in tensors if t is not None))


def _grid(n: int, vec: int) -> int:
    """One vec-element item per thread (many short blocks: no partial last wave)."""
    items = -(-n // vec)
    return max(1, min(-(-items // BLOCK), 2**31 - 1))


# -- step counts ---------------------------------------------------------------------------
def advance_steps(m: Any, counts: CudaTensor) -> None:
    """counts += 1, in one launch whatever their number: the int32 step counts of the
    parameters one optimizer step updates (each the `step_count` of their OptimizerState),
    advanced before the updates read them. Recorded into a CUDA graph, each replay advances
    them again."""
    common.check_tensor(counts, "step counts")
    if counts.dtype is not STEP_DTYPE:
        raise DTypeMismatchError(
            f"advance_steps: the step counts have dtype {counts.dtype.name_str}, expected "
            f"{STEP_DTYPE.name_str}")
    n = counts.size
    if n == 0:
        return
    if n > 2**31 - 1:
        raise InvalidArgumentError(
            f"advance_steps: {n} step counts, more than the kernel's int index holds "
            f"(2**31 - 1)")
    if not m.gpu:
        view = counts.host_view
        view += 1
        return
    dev = counts.device_id
    grid = min(-(-n // BLOCK), 1024)
    launches = m.__dict__.setdefault("_advance_steps_launches", {})
    key = (dev, grid)
    go = launches.get(key)
    if go is not None and counts.stream is None and m.backend.direct_launch(dev):
        go(counts._ptr, n)
        return
    kernel = common.memo_kernel(m, "_optimizer_kernels", TEMPLATE, dev, COUNT_PARAMS)
    m.backend.launch_kernel(kernel.name, grid, counts, n, block_size=(BLOCK, 1, 1),
                            device_id=dev)
    if go is None:
        launches[key] = m.backend.prepare_launch(kernel, (grid, 1, 1), (BLOCK, 1, 1), 0, dev)


# -- SGD -----------------------------------------------------------------------------------
def sgd_update(m: Any, params: CudaTensor, grads: CudaTensor,
               momentum_buf: Optional[CudaTensor], state: Any) -> None:
    """p -= lr * g with g = grad + wd * p, through the momentum buffer when one is given
    (b = g on the first step, else momentum * b + g; Nesterov uses g + momentum * b). The
    first step: t == 1 on the device with state.step_count, else state.step == 0 (which the
    call then advances)."""
    if type(params) is CudaTensor:  # the per-call plan (ops/common.py remember_plan)
        fast = m.plans.get(("sgd_update", params.shape, params.dtype, params.device_id,
                            momentum_buf is None))
        if fast is not None and m.backend.direct_launch(params.device_id) and \
                fast(params, grads, momentum_buf, state):
            return
    dev = _check(params, grads, {"momentum": momentum_buf}, "sgd_update")
    lr = _hyper(state, "learning_rate", 0.0)
    momentum = _hyper(state, "momentum", 0.0)
    wd = _hyper(state, "weight_decay", 0.0)
    count = _device_count(state, dev, "sgd_update")
    step = _step(state) if count is None else 0
    nesterov = bool(getattr(state, "nesterov", False))
    if nesterov and (momentum_buf is None or momentum <= 0.0):
        raise InvalidArgumentError(
            "sgd_update: Nesterov momentum needs a momentum buffer and momentum > 0 "
            f"(got {'no buffer' if momentum_buf is None else f'momentum={momentum}'})")
    first = step == 0
    n = params.size
    if n and not m.gpu:
        if count is not None:
            first = _host_count(m, count, "sgd_update") == 1
        _sgd_host(m, params, grads, momentum_buf, lr, momentum, wd, nesterov, first)
    elif n:
        kernel = m.kernel(TEMPLATE, dev, **_params(params.dtype, "sgd"))
        m.backend.launch_kernel(
            kernel.name, _grid(n, _vec(params.dtype)), params, grads,
            momentum_buf if momentum_buf is not None else 0, n, lr, momentum, wd,
            int(nesterov), int(first), _aligned(params, grads, momentum_buf),
            count if count is not None else 0, block_size=(BLOCK, 1, 1), device_id=dev)
        key = ("sgd_update", params.shape, params.dtype, dev, momentum_buf is None)
        if key not in m.plans:
            common.remember_plan(m, key, _sgd_plan(m, params, momentum_buf is not None,
                                                   kernel))
    if count is None:
        state.step = step + 1


def _live(t: Any, shape: tuple, dtype: CudaDataType, dev: int) -> bool:
    """t is a live CudaTensor of this shape, dtype and device, last used on the legacy
    stream (what a plan may launch on without the general path's checks)."""
    return type(t) is CudaTensor and t.shape == shape and t.dtype is dtype and \
        t.device_id == dev and t.stream is None and t._ptr is not None


def _count_pointer(state: Any, dev: int) -> Optional[int]:
    """For a plan: the pointer of state.step_count, 0 without one, None when the general
    path must check it (not a live one-element int32 CudaTensor of dev on the legacy
    stream)."""
    count = getattr(state, "step_count", None)
    if count is None:
        return 0
    if type(count) is not CudaTensor or count.size != 1 or count.dtype is not STEP_DTYPE or \
            count.device_id != dev or count.stream is not None or count._ptr is None:
        return None
    return count._ptr


def _plan_step(state: Any, dev: int) -> Tuple[Optional[int], int]:
    """For a plan: (state.step_count's pointer (_count_pointer: 0 without one), the step to
    launch with: state.step, or 0 with a count, which the kernel reads instead); (None, 0)
    where the general path must check them (no state.step, a count _count_pointer refuses,
    or without a count a step that is not an int >= 0)."""
    try:
        step = state.step
    except AttributeError:
        return None, 0
    pc = _count_pointer(state, dev)
    if pc is None:
        return None, 0
    if pc:
        return pc, 0
    if type(step) is not int or step < 0:
        return None, 0
    return 0, step


def _sgd_plan(m: Any, params: CudaTensor, has_buf: bool, kernel: Any) -> Any:
    """The per-call plan of sgd_update on params shaped like these (ops/common.py
    remember_plan): the operands and hyper-parameters checked as the general path would,
    with only floats (an int step) taken (anything else returns None: the general path
    checks and raises), the flags and `aligned` computed as there, one prepared launch,
    then state.step advanced. Returns True when it ran."""
    dev, shape, dtype = params.device_id, params.shape, params.dtype
    sdt = state_dtype(dtype)
    n = params.size
    go = m.backend.prepare_launch(kernel, (_grid(n, _vec(dtype)), 1, 1), (BLOCK, 1, 1), 0, dev)

    def run(params: CudaTensor, grads: Any, buf: Any, state: Any) -> bool:
        if params.stream is not None or params._ptr is None or \
                not _live(grads, shape, dtype, dev):
            return False
        pb = 0
        if has_buf:
            if not _live(buf, shape, sdt, dev):
                return False
            pb = buf._ptr
        pc, step = _plan_step(state, dev)   # (with a count: the kernel's first-step flag)
        if pc is None:
            return False
        try:
            lr, mom, wd = state.learning_rate, state.momentum, state.weight_decay
            nesterov = state.nesterov
        except AttributeError:
            return False
        if type(lr) is not float or type(mom) is not float or type(wd) is not float or \
                not (0.0 <= lr < _INF and 0.0 <= mom < _INF and 0.0 <= wd < _INF):
            return False
        nesterov = bool(nesterov)
        if nesterov and (not has_buf or mom <= 0.0):
            return False
        pp, pg = params._ptr, grads._ptr
        go(pp, pg, pb, n, lr, mom, wd, int(nesterov), int(step == 0),
           int(not (pp | pg | pb) & 15), pc)
        if not pc:
            state.step = step + 1
        return True
    return run


def _sgd_host(m: Any, params: CudaTensor, grads: CudaTensor, buf: Optional[CudaTensor],
              lr: float, momentum: float, wd: float, nesterov: bool, first: bool) -> None:
    work: Any = np.float64 if params.dtype is DT.FLOAT64 else np.float32   # (a scalar type)
    p = common.host_array(m, params).astype(work)
    g = common.host_array(m, grads).astype(work)
    lr, momentum, wd = work(lr), work(momentum), work(wd)
    g = g + wd * p
    if buf is not None:
        b = g if first else momentum * common.host_array(m, buf).astype(work) + g
        _write(m, b, buf)
        g = g + momentum * b if nesterov else b
    _write(m, p - lr * g, params)


# -- Adam ----------------------------------------------------------------------------------
def adam_update(m: Any, params: CudaTensor, grads: CudaTensor, m_buf: CudaTensor,
                v_buf: CudaTensor, state: Any) -> None:
    """One Adam (or AdamW with state.decoupled) step with bias correction, in place: at step
    t = state.step_count's value on the device when the state has one, else state.step + 1
    (and state.step advanced)."""
    if type(params) is CudaTensor:  # the per-call plan (ops/common.py remember_plan)
        fast = m.plans.get(("adam_update", params.shape, params.dtype, params.device_id))
        if fast is not None and m.backend.direct_launch(params.device_id) and \
                fast(params, grads, m_buf, v_buf, state):
            return
    if m_buf is None or v_buf is None:
        raise InvalidArgumentError("adam_update needs both m_buffer and v_buffer")
    dev = _check(params, grads, {"m_buffer": m_buf, "v_buffer": v_buf}, "adam_update")
    lr = _hyper(state, "learning_rate", 0.0)
    beta1 = _hyper(state, "beta1", 0.0, 1.0)
    beta2 = _hyper(state, "beta2", 0.0, 1.0)
    eps = _hyper(state, "epsilon", 0.0)
    wd = _hyper(state, "weight_decay", 0.0)
    decoupled = bool(getattr(state, "decoupled", False))
    count = _device_count(state, dev, "adam_update")
    n = params.size
    t = _step(state) + 1 if count is None else \
        _host_count(m, count, "adam_update") if n and not m.gpu else 1
    step_size, inv_bc2_sqrt = _corrections(lr, beta1, beta2, t)
    if n and not m.gpu:
        _adam_host(m, params, grads, m_buf, v_buf, beta1, beta2, eps, wd, decoupled,
                   1.0 - lr * wd, step_size, inv_bc2_sqrt)
    elif n:
        kernel = m.kernel(TEMPLATE, dev, **_params(params.dtype, "adam"))
        m.backend.launch_kernel(
            kernel.name, _grid(n, _vec(params.dtype)), params, grads, m_buf, v_buf, n, beta1,
            1.0 - beta1, beta2, 1.0 - beta2, eps, wd, 1.0 - lr * wd, int(decoupled), step_size,
            inv_bc2_sqrt, _aligned(params, grads, m_buf, v_buf),
            count if count is not None else 0, lr, beta1, beta2, block_size=(BLOCK, 1, 1),
            device_id=dev)
        key = ("adam_update", params.shape, params.dtype, dev)
        if key not in m.plans:
            common.remember_plan(m, key, _adam_plan(m, params, kernel))
    if count is None:
        state.step = t


def _corrections(lr: float, beta1: float, beta2: float, t: int) -> tuple:
    """(step_size, inv_bc2_sqrt) of step t in double: lr / (1 - beta1^t), 1 / sqrt(1 -
    beta2^t) (the kernel's device-count path computes them by this formula)."""
    return lr / (1.0 - beta1 ** t), 1.0 / math.sqrt(1.0 - beta2 ** t)


def _adam_plan(m: Any, params: CudaTensor, kernel: Any) -> Any:
    """The per-call plan of adam_update on params shaped like these (ops/common.py
    remember_plan), as _sgd_plan: the same checks and scalars as adam_update (float
    hyper-parameters, an int step or a device step count; anything else returns None), one
    prepared launch, then state.step advanced (without a device count). Returns True when
    it ran."""
    dev, shape, dtype = params.device_id, params.shape, params.dtype
    sdt = state_dtype(dtype)
    n = params.size
    go = m.backend.prepare_launch(kernel, (_grid(n, _vec(dtype)), 1, 1), (BLOCK, 1, 1), 0, dev)
    sqrt = math.sqrt

    def run(params: CudaTensor, grads: Any, m_buf: Any, v_buf: Any, state: Any) -> bool:
        if params.stream is not None or params._ptr is None or \
                not _live(grads, shape, dtype, dev) or not _live(m_buf, shape, sdt, dev) or \
                not _live(v_buf, shape, sdt, dev):
            return False
        pc, step = _plan_step(state, dev)   # (with a count: the kernel's corrections)
        if pc is None:
            return False
        try:
            lr, beta1, beta2 = state.learning_rate, state.beta1, state.beta2
            eps, wd = state.epsilon, state.weight_decay
            decoupled = state.decoupled
        except AttributeError:
            return False
        if type(lr) is not float or type(beta1) is not float or type(beta2) is not float or \
                type(eps) is not float or type(wd) is not float or \
                not (0.0 <= lr < _INF and 0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0 and
                     0.0 <= eps < _INF and 0.0 <= wd < _INF):
            return False
        t = step + 1
        bc1 = 1.0 - beta1 ** t
        step_size = lr / bc1
        inv_bc2_sqrt = 1.0 / sqrt(1.0 - beta2 ** t)
        pp, pg, pm, pv = params._ptr, grads._ptr, m_buf._ptr, v_buf._ptr
        go(pp, pg, pm, pv, n, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, wd, 1.0 - lr * wd,
           int(bool(decoupled)), step_size, inv_bc2_sqrt, int(not (pp | pg | pm | pv) & 15),
           pc, lr, beta1, beta2)
        if not pc:
            state.step = t
        return True
    return run


def _adam_host(m: Any, params: CudaTensor, grads: CudaTensor, m_buf: CudaTensor,
               v_buf: CudaTensor, beta1: float, beta2: float, eps: float, wd: float,
               decoupled: bool, decay: float, step_size: float, inv_bc2_sqrt: float) -> None:
    """The kernel's arithmetic in NumPy: the working precision, with the same scalars."""
    work: Any = np.float64 if params.dtype is DT.FLOAT64 else np.float32   # (a scalar type)
    p = common.host_array(m, params).astype(work)
    g = common.host_array(m, grads).astype(work)
    mv = common.host_array(m, m_buf).astype(work)
    vv = common.host_array(m, v_buf).astype(work)
    b1, omb1, b2, omb2 = (work(x) for x in (beta1, 1.0 - beta1, beta2, 1.0 - beta2))
    eps, wd, decay = work(eps), work(wd), work(decay)
    step_size, inv_bc2_sqrt = work(step_size), work(inv_bc2_sqrt)
    if decoupled:
        p = p * decay
    else:
        g = g + wd * p
    mv = b1 * mv + omb1 * g
    vv = b2 * vv + omb2 * g * g
    p = p - step_size * mv / (np.sqrt(vv) * inv_bc2_sqrt + eps)
    _write(m, mv, m_buf)
    _write(m, vv, v_buf)
    _write(m, p, params)


def _write(m: Any, values: np.ndarray, t: CudaTensor) -> None:
    from .common import write_host
    write_host(m, values, t)
