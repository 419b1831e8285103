"""Flash attention forward: `flash_attention(m, q, k, v, scale, causal)` for CudaML.

q (batch, heads, seq_q, head_dim), k and v (batch, heads, seq_kv, head_dim); the result has
q's shape and dtype. softmax(scale * q kᵀ) v with scale defaulting to 1/sqrt(head_dim);
causal masks key j for query i when j > i (top-left aligned, as PyTorch's
scaled_dot_product_attention(is_causal=True)). One kernel (`flash_attention.cu.j2`) streams
K/V tiles through shared memory with an online softmax, so device memory holds only q, k, v
and the output (no seq x seq matrix, no workspace). float16 / bfloat16 run on tensor cores
with float32 accumulation and softmax; float32 runs on tensor cores in the 3xTF32 split
(float32-level accuracy, ~1e-6 relative at any key length: each key tile is summed in fresh
tensor-core accumulators and added to the output in round-to-nearest float FMAs, since the
MMA's own accumulation truncates and would bias a sum over thousands of keys).
head_dim 64 and 128 are the fast paths; any head_dim up to 256 is padded in shared memory.
seq_kv == 0 gives zeros (an empty sum). return_lse=True also returns each query row's
log-sum-exp (float32, natural log, from the kernel's running max and sum), which
ops/attention_backward.py takes to recompute the probabilities.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from ..dtypes import CudaDataType
from ..errors import DTypeMismatchError, InvalidArgumentError, ShapeMismatchError
from ..kernels import dtype_params
from ..tensor import CudaTensor
from . import common
from .elementwise_kernels import FILL_BLOCK, fill_grid

DT = CudaDataType
TEMPLATE = "flash_attention.cu.j2"
FILL_TEMPLATE = "fill.cu.j2"
TMA_TEMPLATE = "flash_attention_tma.cu.j2"   # Hopper, 16-bit: ops/attention_tma.py
TEMPLATES = (TEMPLATE, FILL_TEMPLATE, TMA_TEMPLATE)   # fill: the output of no keys
DTYPES = (DT.FLOAT32, DT.FLOAT16, DT.BFLOAT16)
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634
LSE_PLAN = "flash_attention_lse"   # the plan key's name for return_lse=True


def _cfg(hd: int, bc: int, nw: int, q_regs: bool, min_blocks: int,
         wm: int = 1) -> Dict[str, Any]:
    """A kernel config: nw warps of 16 * wm query rows each (block rows 16 * wm * nw), K/V
    tiles of bc keys, Q fragments in registers or not, a __launch_bounds__ blocks hint."""
    return {"hd": hd, "bc": bc, "nw": nw, "wm": wm, "q_regs": q_regs, "min_blocks": min_blocks}


# Configs by padded head_dim; the first is the default, the autotuner picks among the rest.
# wm=2 (32 query rows per warp, FlashAttention-2's split) halves the K/V fragment loads per
# tensor-core op and, with 128 rows per block, the K/V traffic from L2 per query.
HALF_CONFIGS = {
    64: [_cfg(64, 64, 4, True, 3), _cfg(64, 128, 4, True, 2), _cfg(64, 64, 8, True, 1),
         _cfg(64, 64, 4, True, 2, wm=2)],
    128: [_cfg(128, 32, 4, False, 2, wm=2), _cfg(128, 64, 4, False, 2, wm=2),
          _cfg(128, 64, 4, True, 2), _cfg(128, 32, 4, True, 2), _cfg(128, 64, 8, True, 1)],
    256: [_cfg(256, 32, 4, False, 1)],
}
# float32 sums each key tile's P V in fresh MMA accumulators (see the template), which holds the
# tile's P split in registers: hd64 bc32 takes min_blocks=3 to keep its 3 blocks per SM (166
# registers, no spills; with 2 ptxas would use 193).
F32_CONFIGS = {
    64: [_cfg(64, 64, 4, False, 2), _cfg(64, 32, 4, False, 3)],
    128: [_cfg(128, 32, 4, False, 2), _cfg(128, 64, 4, False, 1), _cfg(128, 32, 8, False, 1),
          _cfg(128, 16, 4, False, 3)],
    256: [_cfg(256, 32, 4, False, 1)],
}


def configs(dtype: CudaDataType, hd: int) -> List[Dict[str, Any]]:
    """The candidate configs for a dtype and padded head_dim."""
    table = F32_CONFIGS if dtype is DT.FLOAT32 else HALF_CONFIGS
    return [dict(c) for c in table[hd]]


candidates = configs   # the registry's contract name: the configs the autotuner times


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set this module renders (CI renders and compiles each)."""
    out = []
    for dt in DTYPES:
        table = F32_CONFIGS if dt is DT.FLOAT32 else HALF_CONFIGS
        for cfgs in table.values():
            out += [{**dtype_params(dt), **c} for c in cfgs]
    from . import attention_tma
    tma = [attention_tma.params(c, dt, hd) for dt in (DT.FLOAT16, DT.BFLOAT16)
           for table in (attention_tma.CONFIGS, attention_tma.ALTERNATES)
           for hd, cfgs in table.items() for c in cfgs]
    return {TEMPLATE: out, TMA_TEMPLATE: tma}


@dataclass(frozen=True)
class Problem:
    """An attention call as the kernels see it: bh matrices (heads per batch entry) of seq_q
    query and seq_kv key rows of d, and the (sb, sh, ld) layout, in elements, of each tensor
    group (flash_attention.cu.j2's header): q (q, dq), kv (k, v, dk, dv), o (out, grad_out)."""

    bh: int
    heads: int
    seq_q: int
    seq_kv: int
    d: int
    q: Tuple[int, int, int]
    kv: Tuple[int, int, int]
    o: Tuple[int, int, int]

    def args(self) -> Tuple[int, ...]:
        """The kernels' trailing layout arguments: heads, then (sb, sh, ld) of q, kv, o."""
        return (self.heads, *self.q, *self.kv, *self.o)

    def aligned(self, groups: str, nbytes: int, itemsize: int) -> bool:
        """Whether every sb, sh, ld of the named groups ("q", "kv", "o") is a whole number of
        nbytes (with d, what the 16-byte vector loads and 2-element stores need)."""
        return all(x * itemsize % nbytes == 0
                   for g in groups.split(",") for x in getattr(self, g))


def contiguous_problem(q_shape: Tuple[int, ...], k_shape: Tuple[int, ...]) -> Problem:
    """The trivial layout of contiguous (batch, heads, seq, d) q, k, v: heads 1, sb seq * d."""
    B, H, Sq, D = q_shape
    Skv = k_shape[2]
    return Problem(B * H, 1, Sq, Skv, D, (Sq * D, 0, D), (Skv * D, 0, D), (Sq * D, 0, D))


def packed_problem(batch: int, seq: int, heads: int, d: int) -> Problem:
    """q, k, v read in place from a (batch, seq, 3 * heads * d) projection (its column blocks
    [0, C), [C, 2C), [2C, 3C), C = heads * d), out and grad_out (batch, seq, C)."""
    c = heads * d
    qkv = (seq * 3 * c, d, 3 * c)
    return Problem(batch * heads, heads, seq, seq, d, qkv, qkv, (seq * c, d, c))


def padded_head_dim(d: int) -> int:
    """The kernel's head_dim: 64, 128 or 256 (d <= that, the rest zero-filled)."""
    return 64 if d <= 64 else (128 if d <= 128 else 256)


def block_rows(cfg: Dict[str, Any]) -> int:
    """Query rows per block: nw warps of 16 * wm rows."""
    return 16 * cfg.get("wm", 1) * cfg["nw"]


def shared_bytes(cfg: Dict[str, Any], dtype: CudaDataType) -> int:
    """Q tile, plus two K and two V tiles (double buffered)."""
    return (block_rows(cfg) + 4 * cfg["bc"]) * cfg["hd"] * dtype.itemsize


# -- checks ---------------------------------------------------------------------------------
def check_inputs(q: Any, k: Any, v: Any) -> CudaDataType:
    """Tensors, 4-D, same dtype/device, matching shapes, head_dim <= 256; returns the dtype."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        common.check_tensor(t, name)
        if t.ndim != 4:
            raise InvalidArgumentError(
                f"flash_attention needs 4-D (batch, heads, seq, head_dim) tensors, got {name} "
                f"of shape {t.shape}")
    shapes = match_shapes(q, k, v, "flash_attention")
    dtype = common.same_dtype(q, k, v)
    common.require_dtype(q, DTYPES, "flash_attention")
    common.same_device(q, k, v)
    if q.shape[3] > MAX_HEAD_DIM:
        raise InvalidArgumentError(
            f"flash_attention supports head_dim up to {MAX_HEAD_DIM}, got head_dim "
            f"{q.shape[3]} ({shapes})")
    return dtype


def match_shapes(q: CudaTensor, k: CudaTensor, v: CudaTensor, op: str) -> str:
    """Raise ShapeMismatchError unless k and v have one shape sharing q's (batch, heads) and
    head_dim (all 4-D); returns the shapes as the error messages name them."""
    shapes = f"q {q.shape}, k {k.shape}, v {v.shape}"
    if k.shape != v.shape:
        raise ShapeMismatchError(f"{op}: k and v must have the same shape; got {shapes}")
    if q.shape[:2] != k.shape[:2]:
        raise ShapeMismatchError(f"{op}: q, k and v must share (batch, heads); got {shapes}")
    if q.shape[3] != k.shape[3]:
        raise ShapeMismatchError(f"{op}: q and k must share head_dim; got {shapes}")
    return shapes


def resolve_scale(scale: Any, d: int) -> float:
    """The scale a call uses: 1/sqrt(d) for None, else a finite real number (checked)."""
    if scale is None:
        return 1.0 / math.sqrt(d) if d > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise InvalidArgumentError(f"scale must be a real number or None, got {scale!r}")
    value = float(scale)
    if not math.isfinite(value):
        raise InvalidArgumentError(f"scale must be finite, got {scale!r}")
    return value


# -- entry point ----------------------------------------------------------------------------
def flash_attention(m: Any, q: CudaTensor, k: CudaTensor, v: CudaTensor,
                    scale: Optional[float] = None, causal: bool = False,
                    out: Optional[CudaTensor] = None, return_lse: bool = False) -> Any:
    """softmax(scale * q kᵀ [+ causal mask]) v; out= (internal) receives the result. With
    return_lse, (result, lse): lse float32 (batch, heads, seq_q), the natural log of each
    row's sum of exp(scale q·k) over its keys (-inf with no keys), for the backward."""
    if out is None and type(q) is CudaTensor and type(k) is CudaTensor and \
            type(v) is CudaTensor and type(causal) is bool and \
            (scale is None or type(scale) is float) and type(return_lse) is bool:
        plans = getattr(m, "plans", None)
        fast = None if plans is None else plans.get(
            (LSE_PLAN if return_lse else "flash_attention", q.shape, k.shape, v.shape, q.dtype,
             k.dtype, v.dtype, q.device_id, k.device_id, v.device_id, scale is None, causal))
        if fast is not None and m.backend.direct_launch(q.device_id):
            res = fast(q, k, v, scale)
            if res is not None:
                return res
    dtype = check_inputs(q, k, v)
    B, Hh, Sq, D = q.shape
    Skv = k.shape[2]
    sc = resolve_scale(scale, D)
    if not isinstance(causal, (bool, np.bool_)):
        raise InvalidArgumentError(f"causal must be a bool, got {causal!r}")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise InvalidArgumentError(f"return_lse must be a bool, got {return_lse!r}")
    return_lse = bool(return_lse)
    if m.gpu and (max(Sq, Skv) * D >= 2**31 or B * Hh * -(-Sq // 16) >= 2**31):
        raise InvalidArgumentError(
            f"flash_attention: sequence too long for 32-bit indexing ({q.shape}, {k.shape})")
    dev = q.device_id
    owned = out is None
    if out is None:     # (owned)
        out = m.backend.empty(q.shape, dtype, dev)
    else:
        _check_out(out, q, k, v)
    lse = None
    try:
        if return_lse:
            lse = m.backend.empty((B, Hh, Sq), DT.FLOAT32, dev)
        if out.size == 0 and (lse is None or lse.size == 0):
            return (out, lse) if return_lse else out
        cfg = _compute(m, q, k, v, out, sc, bool(causal), lse)
    except BaseException:
        if owned:
            out.free()  # nothing leaks from a failed launch
        if lse is not None:
            lse.free()
        raise
    if cfg is not None and type(q) is CudaTensor and type(k) is CudaTensor and \
            type(v) is CudaTensor and type(causal) is bool and \
            (scale is None or type(scale) is float) and \
            getattr(m, "plans", None) is not None and hasattr(m.backend, "prepare_launch"):
        common.remember_plan(
            m, (LSE_PLAN if return_lse else "flash_attention", q.shape, k.shape, v.shape,
                dtype, dtype, dtype, dev, dev, dev, scale is None, causal),
            _fast_plan(m, cfg, q, k, causal, return_lse))
    return (out, lse) if return_lse else out


def _fast_plan(m: Any, cfg: Dict[str, Any], q: CudaTensor, k: CudaTensor,
               causal: bool, with_lse: bool = False) -> Any:
    """The per-call plan (ops/common.py remember_plan) of flash_attention on operands shaped
    like q, k (v as k) with this causal flag, after the general path chose cfg: the result
    (and with_lse the lse) from the pool and run_config's launch, prepared; scale (None or
    a float, as the key says) and the pointer-dependent vec / pair flags per call, as
    run_config computes them."""
    dtype, dev = q.dtype, q.device_id
    shape = q.shape
    B, Hh, Sq, D = shape
    Skv = k.shape[2]
    if cfg.get("tma"):
        from . import attention_tma
        return attention_tma.plan(m, cfg, q, k, causal, with_lse)
    kernel = m.backend.get_kernel(_kernel(m, TEMPLATE, dev, {**dtype_params(dtype), **cfg}).name,
                                  dev)
    blocks = B * Hh * -(-Sq // block_rows(cfg))
    go = m.backend.prepare_launch(kernel, (blocks, 1, 1), (32 * cfg["nw"], 1, 1),
                                  shared_bytes(cfg, dtype), dev)
    outputs = common.output_maker(m, dev, shape, dtype, (B, Hh, Sq), with_lse)
    d_vec, d_pair = D % (16 // dtype.itemsize) == 0, D % 2 == 0
    layout = contiguous_problem(shape, k.shape).args()
    scaled = float(resolve_scale(None, D) * LOG2E)
    flag = int(causal)
    isfinite = math.isfinite

    def run(q: CudaTensor, k: CudaTensor, v: CudaTensor, scale: Optional[float]) -> Any:
        """out, or with_lse (out, lse) with the log-sum-exp written too."""
        pq, pk, pv = q._ptr, k._ptr, v._ptr
        if pq is None or pk is None or pv is None or q.stream is not None or \
                k.stream is not None or v.stream is not None:
            return None
        if scale is None:
            sc = scaled
        elif isfinite(scale):
            sc = scale * LOG2E   # float(scale * LOG2E), as run_config
        else:
            return None   # the general path's error
        return outputs(lambda po, plse: go(
            pq, pk, pv, po, plse, Sq, Skv, D, sc, flag, int(d_vec and not (pq | pk | pv) & 15),
            int(d_pair and not po & 7), *layout))
    return run


def _compute(m: Any, q: CudaTensor, k: CudaTensor, v: CudaTensor, out: CudaTensor,
             sc: float, causal: bool, lse: Optional[CudaTensor] = None
             ) -> Optional[Dict[str, Any]]:
    """Fill out (and lse): NumPy in fallback mode, zeros (lse -inf) for no keys, else the
    autotuned kernel (its config returned; None for the other two)."""
    dtype, dev = q.dtype, q.device_id
    B, Hh, Sq, D = q.shape
    Skv = k.shape[2]
    if not m.gpu:
        res = reference(common.host_array(m, q), common.host_array(m, k),
                        common.host_array(m, v), sc, causal, return_lse=lse is not None)
        if lse is None:
            common.write_host(m, res, out)
        else:
            common.write_host(m, res[0], out)
            common.write_host(m, res[1], lse)
        return None
    if Skv == 0:
        if out.size:
            _fill_zero(m, out, dev)
        if lse is not None and lse.size:
            _fill_zero(m, lse, dev, -math.inf)
        return None
    from . import attention_tma as tma
    usable = tma.usable(m.backend.get_device_info(dev), q, k, v)

    def run(cfg: Dict[str, Any]) -> None:
        if cfg.get("tma"):
            tma.run(m, cfg, q, k, v, out, lse, sc, causal,
                    m.__dict__.setdefault("_attention_kernels", {}))
        else:
            run_config(m, cfg, q, k, v, out, sc, causal, lse)

    cfg = pick_config(m, dtype, dev, contiguous_problem(q.shape, k.shape), causal, run,
                      tma.CONFIGS.get(D, []) if usable else [])
    if cfg.get("tma") and not usable:   # (a choice of this shape class for other operands)
        cfg = configs(dtype, padded_head_dim(D))[0]
    run(cfg)
    return cfg


def pick_config(m: Any, dtype: CudaDataType, dev: int, p: Problem, causal: bool,
                run: Callable[[Dict[str, Any]], None],
                extra: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    """The forward's config for a problem (shape_class_choice over `configs`, and `extra`:
    the TMA kernel's, ops/attention_tma.py, where the call can take it)."""
    hd = padded_head_dim(p.d)
    cands = configs(dtype, hd) + [dict(c) for c in extra or []]
    return shape_class_choice(m, "flash_attention", cands, dtype, hd, dev, p, causal, run)


def shape_class_choice(m: Any, op: str, cands: List[Dict[str, Any]], dtype: CudaDataType,
                       hd: int, dev: int, p: Problem, causal: bool,
                       run: Callable[[Dict[str, Any]], None]) -> Dict[str, Any]:
    """The candidate for a problem's shape class (dtype, padded head_dim hd, causal, bucketed
    seq_q, seq_kv and batch*heads; any layout), autotuned once per op and device with run."""
    if len(cands) == 1:
        return cands[0]
    bucket = common.size_bucket
    key = [dtype.name_str, hd, causal, bucket(p.seq_q), bucket(p.seq_kv), bucket(p.bh)]
    memo = m.__dict__.setdefault("_attention_choices", {})
    mkey = (op, dev, tuple(key))
    cfg = memo.get(mkey)
    if cfg is None:
        cfg = memo[mkey] = m.autotuner.pick(op, key, cands, run, device_id=dev)
    return cfg



def _kernel(m: Any, template: str, dev: int, params: Dict[str, Any]) -> Any:
    """m.kernel(template, dev, **params), memoized on m (ops/common.py memo_kernel)."""
    return common.memo_kernel(m, "_attention_kernels", template, dev, params)


def compiled_kernel(m: Any, dtype: CudaDataType, dev: int, cfg: Dict[str, Any]) -> Any:
    """The forward kernel of a config (compiled once, memoized), as the plans launch it."""
    return m.backend.get_kernel(_kernel(m, TEMPLATE, dev, {**dtype_params(dtype), **cfg}).name,
                                dev)


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every flash-attention variant in parallel threads (nvcc runs in
    subprocesses); returns how many were compiled. Later calls find them memoized."""
    from . import attention_tma
    from .matmul_kernels import has_wgmma
    info = getattr(m.backend, "get_device_info", None)   # (absent on stand-in backends)
    hopper = m.gpu and info is not None and has_wgmma(
        info(m.backend.current_device if device_id is None else device_id))
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets
            if t != TMA_TEMPLATE or hopper]

    def get(m: Any, template: str, dev: int, params: Dict[str, Any]) -> Any:
        if template == TMA_TEMPLATE:
            return attention_tma.kernel(m, dev, params,
                                        m.__dict__.setdefault("_attention_kernels", {}))
        return _kernel(m, template, dev, params)
    return common.compile_all(m, jobs, device_id, workers, get)


def _check_out(out: Any, q: CudaTensor, k: CudaTensor, v: CudaTensor) -> None:
    common.check_tensor(out, "out")
    if out.dtype is not q.dtype:
        raise DTypeMismatchError(
            f"out has dtype {out.dtype.name_str}, expected {q.dtype.name_str}")
    if tuple(out.shape) != tuple(q.shape):
        raise ShapeMismatchError(f"out has shape {out.shape}, expected {q.shape}")
    common.same_device(q, out)
    if out.nbytes:
        lo, hi = out.ptr, out.ptr + out.nbytes
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.nbytes and t.ptr < hi and lo < t.ptr + t.nbytes:
                raise InvalidArgumentError(f"out overlaps {name}; use a separate tensor")


Operand = Union[CudaTensor, int]   # a tensor or a device pointer into one (packed q, k, v)


def pointer(t: Operand) -> int:
    """The device address of an operand."""
    return t if isinstance(t, int) else t.ptr


def run_config(m: Any, cfg: Dict[str, Any], q: CudaTensor, k: Operand, v: Operand,
               out: Operand, scale: float, causal: bool,
               lse: Optional[CudaTensor] = None, problem: Optional[Problem] = None) -> None:
    """Launch one config over the whole problem (writing lse too when given); problem: the
    layout (default: contiguous q, k, v, out), where k, v, out may be pointers."""
    dtype = q.dtype
    dev = q.device_id
    if problem is not None:
        p = problem
    elif isinstance(k, CudaTensor):
        p = contiguous_problem(q.shape, k.shape)
    else:
        raise InvalidArgumentError("run_config: pointer operands need their problem (layout)")
    D = p.d
    if padded_head_dim(D) > cfg["hd"]:
        raise InvalidArgumentError(f"config hd={cfg['hd']} is too small for head_dim {D}")
    kernel = _kernel(m, TEMPLATE, dev, {**dtype_params(dtype), **cfg})
    br = block_rows(cfg)
    blocks = p.bh * -(-p.seq_q // br)
    epc = 16 // dtype.itemsize
    vec = int(D % epc == 0 and all(pointer(t) % 16 == 0 for t in (q, k, v)) and
              p.aligned("q,kv", 16, dtype.itemsize))
    pair = int(D % 2 == 0 and pointer(out) % 8 == 0 and p.aligned("o", 2, 1))
    m.backend.launch_kernel(kernel.name, (blocks, 1, 1), q, k, v, out,
                            0 if lse is None else lse, p.seq_q, p.seq_kv, D,
                            float(scale * LOG2E), int(causal), vec, pair, *p.args(),
                            block_size=(32 * cfg["nw"], 1, 1),
                            shared_mem=shared_bytes(cfg, dtype), device_id=dev)


def _fill_zero(m: Any, out: CudaTensor, dev: int, value: float = 0.0) -> None:
    kernel = _kernel(m, FILL_TEMPLATE, dev, {**dtype_params(out.dtype),
                                             "block_size": FILL_BLOCK})
    m.backend.launch_kernel(kernel.name, (fill_grid(out.size, out.dtype), 1, 1), out,
                            value, out.size, block_size=(FILL_BLOCK, 1, 1), device_id=dev)


# -- fallback (NumPy) ------------------------------------------------------------------------
def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, causal: bool,
              chunk: int = 1024, return_lse: bool = False) -> Any:
    """float64 attention, computed in row chunks so memory stays O(chunk x seq_kv); with
    return_lse, (out, lse): lse (batch, heads, seq_q) the log of each row's sum of
    exp(scale q·k) over its keys (-inf with none)."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    Sq, Skv = q.shape[2], k.shape[2]
    out = np.zeros(q.shape, np.float64)
    lse = np.full(q.shape[:3], -np.inf)
    if Skv == 0:
        return (out, lse) if return_lse else out
    for i0 in range(0, Sq, chunk):
        i1 = min(Sq, i0 + chunk)
        s = np.matmul(q[:, :, i0:i1], np.swapaxes(k, -1, -2)) * scale
        if causal:
            rows = np.arange(i0, i1)[:, None]
            cols = np.arange(Skv)[None, :]
            s = np.where(cols > rows, -np.inf, s)
        mx = s.max(axis=-1, keepdims=True)
        s -= mx
        p = np.exp(s)
        total = p.sum(axis=-1, keepdims=True)
        p /= total
        out[:, :, i0:i1] = np.matmul(p, v)
        lse[:, :, i0:i1] = (mx + np.log(total))[..., 0]
    return (out, lse) if return_lse else out
