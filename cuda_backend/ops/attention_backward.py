"""Flash attention backward: `flash_attention_backward(m, grad_out, q, k, v, out, lse, scale,
causal)` for CudaML, returning (grad_q, grad_k, grad_v).

The forward (ops/attention.py, return_lse=True) gives out and lse (float32 (batch, heads,
seq_q), natural log). FlashAttention-2's backward, three launches per call:
1. prep (`flash_attention_backward_prep.cu.j2`, stage "delta"): delta_i = rowsum(dO_i * O_i)
   and lse2_i = lse_i log2(e) in float32, rows padded to a multiple of SQ_PAD (+inf, 0), and
   the float32 dQ accumulator (batch*heads, seq_q, hd) zeroed;
2. the main kernel (`flash_attention_backward.cu.j2`), one block per (head, tile of keys):
   it recomputes P = exp(scale q kᵀ - lse) per query tile, keeps dV += Pᵀ dO and dK +=
   dSᵀ Q (dS = P ∘ (dO vᵀ - delta)) in registers, and adds dS K into the dQ accumulator;
3. post (stage "dq"): dQ = scale * accumulator, rounded once to the dtype.
dQ by atomics (float32 red.global.add in L2), not by a second pass over the keys per query
tile: that pass recomputes S and dP (3 of the 5 GEMMs again, ~1.4x the FLOPs), far above the
15 % a deterministic variant may cost. So dQ's float32 sums are taken in arrival order (run to
run differences of a few float32 ulps before the final rounding); dK and dV are
deterministic.
float16 / bfloat16 with head_dim up to 128 run on tensor cores (mma.sync m16n8k16, float32
accumulation; P and dS rounded to the 16-bit type before the products, as the forward rounds
P); float32 with head_dim up to 128 too (path "tf32": the five GEMMs as m16n8k8 TF32 MMAs in
the forward's 3xTF32 split, ~2^-21 per product; P and dS float32; each tile's sums in fresh
accumulators, so the truncating MMA sums do not grow with the sequence); head_dim over 128
runs the CUDA-core path (float32 math).
float32 floor and prediction (H100 SXM; 3xTF32 = 3 TF32 MMAs per product, dense TF32 peak
~495 TFLOP/s, mma.sync ~60 % of it): (8, 12, 1024, 64) causal is 3.2e10 FLOP, 9.7e10 TF32
FLOP: floor 0.2 ms; predicted 1.0-1.3 ms (the forward's float32 reaches ~97 TF32-TFLOP/s;
the backward ~75-95 with its splits and dQ atomics) against 1.13 ms of PyTorch's
fmha_cutlassB_f32 (2.4 ms on the CUDA-core path). (4, 16, 4096, 128) full is 1.4e12 FLOP,
4.1e12 TF32 FLOP: floor 8.3 ms; predicted 55-70 ms (one block of 8 warps per SM, dK and dV
in 128 registers per thread, 60 bytes of spills), causal half; PyTorch at the ~28 TFLOP/s
it reaches above: ~48 ms full, ~24 ms causal: that shape may stay behind.
Causal (top-left aligned, j > i masked): query tiles wholly before a block's keys are not
visited. Memory: the outputs, the dQ accumulator (4 * batch*heads*seq_q*hd bytes) and 8
bytes per padded query row. Fallback mode computes `reference` in float64.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..dtypes import CudaDataType
from ..errors import (DTypeMismatchError, InvalidArgumentError, ShapeMismatchError)
from ..kernels import dtype_params
from ..tensor import CudaTensor
from . import attention, common

DT = CudaDataType
NAME = "flash_attention_backward"
TEMPLATE = "flash_attention_backward.cu.j2"
PREP_TEMPLATE = "flash_attention_backward_prep.cu.j2"
TEMPLATES = (TEMPLATE, PREP_TEMPLATE)
DTYPES = attention.DTYPES
MAX_HEAD_DIM = attention.MAX_HEAD_DIM
LOG2E = attention.LOG2E
PREP_THREADS = 256
PREP_ROWS = PREP_THREADS // 32   # rows per block of the prep kernels (one warp each)
SQ_PAD = 128                     # lse2 / delta rows padded to this (every bm divides it)


def _cfg(path: str, hd: int, bm: int, nw: int, min_blocks: int) -> Dict[str, Any]:
    """A main-kernel config: path "mma" / "tf32" (16 * nw keys per block) or "simt" (32
    keys), bm query rows per tile, nw warps, a __launch_bounds__ blocks hint."""
    return {"path": path, "hd": hd, "bm": bm, "nw": nw, "min_blocks": min_blocks}


# Tensor-core configs by padded head_dim (16-bit types); the first is the default, the
# autotuner picks among them. Registers: dK and dV (hd / 4 floats each per thread) plus S^T
# and dP^T (bm / 4 each) stay under 255; 2 blocks per SM fit the shared memory of hd 128 at
# nw 4 (105 KiB each), nw 8 has 128 keys per block (half the dQ atomics of nw 4).
MMA_CONFIGS = {
    64: [_cfg("mma", 64, 64, 4, 2), _cfg("mma", 64, 128, 4, 2), _cfg("mma", 64, 64, 8, 1)],
    128: [_cfg("mma", 128, 64, 8, 1), _cfg("mma", 128, 64, 4, 2)],
}
# float32 tensor-core configs (3xTF32) by padded head_dim. Shared memory (float tiles):
# hd 64 at bm 64, nw 4 is 113 KiB, two blocks fill the SM's 228 KiB exactly; bm 32 (73 KiB)
# fits three. hd 128 keeps dK and dV (128 floats per thread) in registers: bm 32, one block.
TF32_CONFIGS = {
    64: [_cfg("tf32", 64, 64, 4, 2), _cfg("tf32", 64, 32, 4, 2), _cfg("tf32", 64, 64, 8, 1)],
    128: [_cfg("tf32", 128, 32, 8, 1), _cfg("tf32", 128, 32, 4, 1)],
}
# CUDA-core configs (16-bit types and float32 with head_dim over 128), 32 keys per block.
SIMT_CONFIGS = {
    64: [_cfg("simt", 64, 32, 8, 2)],
    128: [_cfg("simt", 128, 32, 8, 2)],
    256: [_cfg("simt", 256, 32, 8, 1)],
}


def configs(dtype: CudaDataType, hd: int) -> List[Dict[str, Any]]:
    """The candidate configs for a dtype and padded head_dim (64, 128 or 256)."""
    table = TF32_CONFIGS if dtype is DT.FLOAT32 else MMA_CONFIGS
    return [dict(c) for c in table.get(hd, SIMT_CONFIGS[hd])]


candidates = configs   # the registry's contract name: the configs the autotuner times


def padded_head_dim(d: int) -> int:
    """The kernels' head_dim: 64, 128 or 256 (as the forward's)."""
    return attention.padded_head_dim(d)


def block_keys(cfg: Dict[str, Any]) -> int:
    """Keys per block: 16 per warp on tensor cores, one per lane on CUDA cores."""
    return 32 if cfg["path"] == "simt" else 16 * cfg["nw"]


def shared_bytes(cfg: Dict[str, Any]) -> int:
    """Dynamic shared memory of a main-kernel config (the template's header)."""
    hd, bm = cfg["hd"], cfg["bm"]
    if cfg["path"] == "mma":
        bn = block_keys(cfg)
        return (2 * bn + 4 * bm) * hd * 2 + bn * bm * 2 + 16 * bm
    if cfg["path"] == "tf32":
        bn = block_keys(cfg)
        return (2 * bn + 4 * bm) * hd * 4 + bn * bm * 4 + 16 * bm
    return ((64 + 2 * bm) * (hd + 1) + 2 * bm * 33 + 2 * bm) * 4


def kernel_params(dtype: CudaDataType, cfg: Dict[str, Any]) -> Dict[str, Any]:
    return {**dtype_params(dtype), **cfg}


def prep_params(dtype: CudaDataType, stage: str) -> Dict[str, Any]:
    return {**dtype_params(dtype), "stage": stage}


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set this module renders (CI renders and compiles each)."""
    main, prep = [], []
    for dt in DTYPES:
        for hd in (64, 128, 256):
            main += [kernel_params(dt, c) for c in configs(dt, hd)]
        prep += [prep_params(dt, "delta"), prep_params(dt, "dq")]
    return {TEMPLATE: main, PREP_TEMPLATE: prep}


def _kernel(m: Any, template: str, dev: int, params: Dict[str, Any]) -> Any:
    """m.kernel(template, dev, **params), memoized on m (ops/common.py memo_kernel)."""
    return common.memo_kernel(m, "_attention_bwd_kernels", template, dev, params)


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every variant in parallel threads; 0 in fallback mode."""
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets]
    return common.compile_all(m, jobs, device_id, workers, _kernel)


# -- reference -----------------------------------------------------------------------------
def reference(grad_out: Any, q: Any, k: Any, v: Any, scale: float, causal: bool,
              out: Any = None, lse: Any = None, chunk: int = 512
              ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 (dq, dk, dv) of softmax(scale q kᵀ [causal]) v for the upstream gradient
    grad_out, in query chunks (memory O(chunk x seq_kv)): P = exp(scale q kᵀ - lse),
    dv = Pᵀ dO, dS = P ∘ (dO vᵀ - rowsum(dO ∘ out)), dq = scale dS k, dk = scale dSᵀ q.
    out and lse default to the exact forward's (the kernels take the ones given)."""
    g, q, k, v = (np.asarray(a, np.float64) for a in (grad_out, q, k, v))
    Sq, Skv = q.shape[2], k.shape[2]
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    if Skv == 0 or Sq == 0:
        return dq, dk, dv
    if out is None or lse is None:
        fo, fl = attention.reference(q, k, v, scale, causal, return_lse=True)
        out = fo if out is None else out
        lse = fl if lse is None else lse
    out = np.asarray(out, np.float64)
    lse = np.asarray(lse, np.float64)
    kt = np.swapaxes(k, -1, -2)
    with np.errstate(over="ignore", invalid="ignore"):
        for i0 in range(0, Sq, chunk):
            i1 = min(Sq, i0 + chunk)
            s = np.matmul(q[:, :, i0:i1], kt) * scale - lse[:, :, i0:i1, None]
            p = np.exp(s)
            if causal:
                p = np.where(np.arange(Skv)[None, :] > np.arange(i0, i1)[:, None], 0.0, p)
            gi = g[:, :, i0:i1]
            dv += np.matmul(np.swapaxes(p, -1, -2), gi)
            delta = np.sum(gi * out[:, :, i0:i1], axis=-1, keepdims=True)
            ds = p * (np.matmul(gi, np.swapaxes(v, -1, -2)) - delta)
            dq[:, :, i0:i1] = scale * np.matmul(ds, k)
            dk += scale * np.matmul(np.swapaxes(ds, -1, -2), q[:, :, i0:i1])
    return dq, dk, dv


# -- checks --------------------------------------------------------------------------------
def check_inputs(grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any) -> CudaDataType:
    """Live tensors; q, k, v, grad_out, out 4-D of one supported dtype, grad_out and out of
    q's shape, k and v alike sharing q's (batch, heads) and head_dim <= 256; lse float32 of
    shape q.shape[:3]; one device. Returns the dtype."""
    named = (("grad_out", grad_out), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse))
    for name, t in named:
        common.check_tensor(t, name)
    for name, t in named[:5]:
        if t.ndim != 4:
            raise InvalidArgumentError(
                f"{NAME} needs 4-D (batch, heads, seq, head_dim) tensors, got {name} of "
                f"shape {t.shape}")
    shapes = attention.match_shapes(q, k, v, NAME)
    for name, t in (("grad_out", grad_out), ("out", out)):
        if t.shape != q.shape:
            raise ShapeMismatchError(
                f"{NAME}: {name} has shape {t.shape}, expected q's shape {q.shape}")
    if lse.shape != q.shape[:3]:
        raise ShapeMismatchError(
            f"{NAME}: lse has shape {lse.shape}, expected (batch, heads, seq_q) = "
            f"{q.shape[:3]} (flash_attention(..., return_lse=True) gives it)")
    dtype = common.same_dtype(q, k, v, grad_out, out)
    common.require_dtype(q, DTYPES, NAME)
    if lse.dtype is not DT.FLOAT32:
        raise DTypeMismatchError(
            f"{NAME}: lse has dtype {lse.dtype.name_str}, expected float32 (as "
            f"flash_attention(..., return_lse=True) gives it)")
    common.same_device(grad_out, q, k, v, out, lse)
    if q.shape[3] > MAX_HEAD_DIM:
        raise InvalidArgumentError(
            f"{NAME} supports head_dim up to {MAX_HEAD_DIM}, got head_dim {q.shape[3]} "
            f"({shapes})")
    return dtype


# -- entry point ---------------------------------------------------------------------------
def plan_key(q: CudaTensor, k: CudaTensor, scale: Optional[float], causal: bool) -> tuple:
    """The m.plans key of the per-call plan for operands shaped like q and k."""
    return (NAME, q.shape, k.shape, q.dtype, q.device_id, scale is None, causal)


def flash_attention_backward(m: Any, grad_out: CudaTensor, q: CudaTensor, k: CudaTensor,
                             v: CudaTensor, out: CudaTensor, lse: CudaTensor,
                             scale: Optional[float] = None, causal: bool = False
                             ) -> Tuple[CudaTensor, CudaTensor, CudaTensor]:
    """(dq, dk, dv) of attention for the upstream gradient grad_out, from the forward's out
    and lse (flash_attention(q, k, v, scale, causal, return_lse=True))."""
    if type(q) is CudaTensor and type(k) is CudaTensor and type(causal) is bool and \
            (scale is None or type(scale) is float):
        plans = getattr(m, "plans", None)
        fast = None if plans is None else plans.get(plan_key(q, k, scale, causal))
        if fast is not None and m.backend.direct_launch(q.device_id):
            res = fast(grad_out, q, k, v, out, lse, scale)
            if res is not None:
                return res
    dtype = check_inputs(grad_out, q, k, v, out, lse)
    B, Hh, Sq, D = q.shape
    Skv = k.shape[2]
    sc = attention.resolve_scale(scale, D)
    if not isinstance(causal, (bool, np.bool_)):
        raise InvalidArgumentError(f"causal must be a bool, got {causal!r}")
    causal = bool(causal)
    if m.gpu and (max(Sq, Skv) * max(D, 1) >= 2**31 or B * Hh * -(-Skv // 16) >= 2**31):
        raise InvalidArgumentError(
            f"{NAME}: sequence too long for 32-bit indexing ({q.shape}, {k.shape})")
    dev = q.device_id
    if not m.gpu:
        host_grads = reference(common.host_array(m, grad_out), common.host_array(m, q),
                          common.host_array(m, k), common.host_array(m, v), sc, causal,
                          common.host_array(m, out), common.host_array(m, lse))
        hq, hk, hv = (common.from_host(m, a, dtype, dev) for a in host_grads)
        return hq, hk, hv
    if q.size == 0 or k.size == 0:   # no queries, no keys or no head_dim: zero gradients
        return (m.zeros(q.shape, dtype, dev), m.zeros(k.shape, dtype, dev),
                m.zeros(v.shape, dtype, dev))
    grads: List[CudaTensor] = []
    try:
        for shape in (q.shape, k.shape, v.shape):
            grads.append(m.backend.empty(shape, dtype, dev))
        cfg = _compute(m, grad_out, q, k, v, out, lse, grads, sc, causal)
    except BaseException:
        for t in grads:
            t.free()   # nothing leaks from a failed launch
        raise
    dq, dk, dv = grads
    if type(q) is CudaTensor and type(k) is CudaTensor and \
            (scale is None or type(scale) is float) and \
            getattr(m, "plans", None) is not None and hasattr(m.backend, "prepare_launch"):
        common.remember_plan(m, plan_key(q, k, scale, causal),
                             _fast_plan(m, cfg, q, k, causal))
    return dq, dk, dv


def _compute(m: Any, g: CudaTensor, q: CudaTensor, k: CudaTensor, v: CudaTensor,
             out: CudaTensor, lse: CudaTensor, grads: List[CudaTensor], sc: float,
             causal: bool) -> Dict[str, Any]:
    """Run the autotuned config into grads (dq, dk, dv); returns it."""
    def run(cfg: Dict[str, Any]) -> None:
        run_config(m, cfg, g, q, k, v, out, lse, grads, sc, causal)

    cfg = pick_config(m, q.dtype, q.device_id, attention.contiguous_problem(q.shape, k.shape),
                      causal, run)
    run(cfg)
    return cfg


def pick_config(m: Any, dtype: CudaDataType, dev: int, p: attention.Problem, causal: bool,
                run: Callable[[Dict[str, Any]], None]) -> Dict[str, Any]:
    """The backward's config for a problem (attention.shape_class_choice over `configs`)."""
    hd = padded_head_dim(p.d)
    return attention.shape_class_choice(m, NAME, configs(dtype, hd), dtype, hd, dev, p, causal,
                                        run)


def _geometry(cfg: Dict[str, Any], p: attention.Problem) -> Dict[str, int]:
    """Launch sizes: padded query rows, prep / main / post grids (blocks)."""
    bh, Sq, skv = p.bh, p.seq_q, p.seq_kv
    sq_pad = -(-Sq // SQ_PAD) * SQ_PAD
    return {"bh": bh, "sq_pad": sq_pad, "prep_rows": bh * sq_pad,
            "prep_grid": max(1, min(-(-bh * sq_pad // PREP_ROWS), 2**31 - 1)),
            "main_grid": bh * -(-skv // block_keys(cfg)),
            "post_grid": max(1, min(-(-bh * Sq // PREP_ROWS), 2**31 - 1))}


def run_config(m: Any, cfg: Dict[str, Any], g: CudaTensor, q: CudaTensor,
               k: attention.Operand, v: attention.Operand, out: CudaTensor, lse: CudaTensor,
               grads: Sequence[attention.Operand], scale: float, causal: bool,
               problem: Optional[attention.Problem] = None) -> None:
    """The three launches of one config over the whole problem into grads (dq, dk, dv); the
    workspaces come from the pool and go back after the launches (stream-ordered). problem:
    the layout (default: contiguous operands), where k, v, dk, dv may be pointers."""
    dtype, dev = q.dtype, q.device_id
    if problem is not None:
        p = problem
    elif isinstance(k, CudaTensor):
        p = attention.contiguous_problem(q.shape, k.shape)
    else:
        raise InvalidArgumentError("run_config: pointer operands need their problem (layout)")
    Sq, Skv, D = p.seq_q, p.seq_kv, p.d
    hd = cfg["hd"]
    if padded_head_dim(D) > hd:
        raise InvalidArgumentError(f"config hd={hd} is too small for head_dim {D}")
    dq, dk, dv = grads
    geo = _geometry(cfg, p)
    bh, sq_pad = geo["bh"], geo["sq_pad"]
    prep = _kernel(m, PREP_TEMPLATE, dev, prep_params(dtype, "delta"))
    main = _kernel(m, TEMPLATE, dev, kernel_params(dtype, cfg))
    post = _kernel(m, PREP_TEMPLATE, dev, prep_params(dtype, "dq"))
    ws = m.backend.empty((2 * bh * sq_pad,), DT.FLOAT32, dev)   # lse2, then delta
    acc = None
    try:
        acc = m.backend.empty((bh * Sq * hd,), DT.FLOAT32, dev)
        lse2, delta = ws.ptr, ws.ptr + 4 * bh * sq_pad
        threads = (PREP_THREADS, 1, 1)
        m.backend.launch_kernel(prep.name, (geo["prep_grid"], 1, 1), g, out, lse, lse2, delta,
                                acc, geo["prep_rows"], Sq, sq_pad, D, hd, 1, p.heads, *p.o,
                                block_size=threads, device_id=dev)
        isz = dtype.itemsize   # vec: whole 16-byte chunks per row; pair: 2-element stores
        ptr = attention.pointer
        vec = int(D * isz % 16 == 0 and all(ptr(t) % 16 == 0 for t in (q, k, v, g)) and
                  p.aligned("q,kv,o", 16, isz))
        pair = int(D % 2 == 0 and ptr(dk) % (2 * isz) == 0 and ptr(dv) % (2 * isz) == 0 and
                   p.aligned("kv", 2, 1))
        m.backend.launch_kernel(main.name, (geo["main_grid"], 1, 1), q, k, v, g, lse2, delta,
                                acc, dk, dv, Sq, Skv, D, sq_pad, float(scale * LOG2E),
                                float(scale), int(causal), vec, pair, *p.args(),
                                block_size=(32 * cfg["nw"], 1, 1),
                                shared_mem=shared_bytes(cfg), device_id=dev)
        m.backend.launch_kernel(post.name, (geo["post_grid"], 1, 1), acc, dq, bh * Sq, D, hd,
                                float(scale), Sq, p.heads, *p.q, block_size=threads,
                                device_id=dev)
    finally:
        ws.free()   # stream-ordered: reused only after these launches
        if acc is not None:
            acc.free()


def plan_scale(scale: Optional[float], default: float) -> Optional[float]:
    """A per-call plan's scale: the default for None, a finite float as given; None (the
    general path raises) otherwise."""
    if scale is None:
        return default
    return scale if math.isfinite(scale) else None


def prepared_launches(m: Any, cfg: Dict[str, Any], p: attention.Problem,
                      dtype: CudaDataType, dev: int, causal: bool) -> Callable[..., None]:
    """run_config's three launches of cfg over problem p, prepared once, for the per-call
    plans of flash_attention_backward and flash_attention_packed_backward: go(pg, pq, pk, pv,
    po, pl, pdq, pdk, pdv, scale) on raw pointers takes the workspaces from the pool (released
    after the launches, stream-ordered) and decides vec / pair from the pointers and the
    layout as run_config does."""
    backend = m.backend
    Sq, Skv, D, hd = p.seq_q, p.seq_kv, p.d, cfg["hd"]
    geo = _geometry(cfg, p)
    bh, sq_pad = geo["bh"], geo["sq_pad"]
    get = backend.get_kernel
    threads = (PREP_THREADS, 1, 1)
    prep = backend.prepare_launch(
        get(_kernel(m, PREP_TEMPLATE, dev, prep_params(dtype, "delta")).name, dev),
        (geo["prep_grid"], 1, 1), threads, 0, dev)
    main = backend.prepare_launch(get(_kernel(m, TEMPLATE, dev, kernel_params(dtype, cfg)).name,
                                      dev),
                                  (geo["main_grid"], 1, 1), (32 * cfg["nw"], 1, 1),
                                  shared_bytes(cfg), dev)
    post = backend.prepare_launch(
        get(_kernel(m, PREP_TEMPLATE, dev, prep_params(dtype, "dq")).name, dev),
        (geo["post_grid"], 1, 1), threads, 0, dev)
    pool = backend.memory_pools[dev]
    alloc, release = pool.allocate_current, pool.release
    ws_bytes, acc_bytes = 8 * bh * sq_pad, 4 * bh * Sq * hd
    delta_off = 4 * bh * sq_pad
    prep_rows, post_rows = geo["prep_rows"], bh * Sq
    isz = dtype.itemsize
    d_vec = D * isz % 16 == 0 and p.aligned("q,kv,o", 16, isz)
    d_pair = D % 2 == 0 and p.aligned("kv", 2, 1)
    pair_mask = 2 * isz - 1
    heads, layout, o_layout, q_layout = p.heads, p.args(), p.o, p.q
    flag = int(causal)

    def go(pg: int, pq: int, pk: int, pv: int, po: int, pl: int, pdq: int, pdk: int,
           pdv: int, sc: float) -> None:
        ws = alloc(ws_bytes)
        acc = None
        try:
            acc = alloc(acc_bytes)
            pw, pa = int(ws), int(acc)
            prep(pg, po, pl, pw, pw + delta_off, pa, prep_rows, Sq, sq_pad, D, hd, 1, heads,
                 *o_layout)
            main(pq, pk, pv, pg, pw, pw + delta_off, pa, pdk, pdv, Sq, Skv, D, sq_pad,
                 sc * LOG2E, sc, flag, int(d_vec and not (pq | pk | pv | pg) & 15),
                 int(d_pair and not (pdk | pdv) & pair_mask), *layout)
            post(pa, pdq, post_rows, D, hd, sc, Sq, heads, *q_layout)
        finally:
            release(ws)   # stream-ordered, in the general path's order (run_config)
            if acc is not None:
                release(acc)
    return go


def _fast_plan(m: Any, cfg: Dict[str, Any], q: CudaTensor, k: CudaTensor,
               causal: bool) -> Callable[..., Any]:
    """The per-call plan (ops/common.py remember_plan) for operands shaped like q and k with
    this causal flag, after the general path chose cfg: run(grad_out, q, k, v, out, lse,
    scale) checks the operands the key does not fix (types, shapes, dtypes, devices, live,
    no stream), takes the gradients from the pool and makes prepared_launches' launches; None
    where the general path must run (its checks and errors)."""
    from ..tensor import pool_tensor
    dtype, dev = q.dtype, q.device_id
    q_shape, k_shape = q.shape, k.shape
    lse_shape = q_shape[:3]
    go = prepared_launches(m, cfg, attention.contiguous_problem(q_shape, k_shape), dtype, dev,
                           causal)
    pool = m.backend.memory_pools[dev]
    alloc = pool.allocate_current
    q_size, q_bytes = q.size, q.nbytes
    k_size, k_bytes = k.size, k.nbytes
    f32 = DT.FLOAT32
    default = attention.resolve_scale(None, q_shape[3])

    def run(g: Any, q: CudaTensor, k: CudaTensor, v: Any, o: Any, lse: Any,
            scale: Optional[float]) -> Optional[Tuple[CudaTensor, CudaTensor, CudaTensor]]:
        # q and k: the key's shapes, dtype and device
        if type(g) is not CudaTensor or type(v) is not CudaTensor or \
                type(o) is not CudaTensor or type(lse) is not CudaTensor:
            return None
        pg, pq, pk, pv, po, pl = g._ptr, q._ptr, k._ptr, v._ptr, o._ptr, lse._ptr
        if pg is None or pq is None or pk is None or pv is None or po is None or pl is None:
            return None
        if g.shape != q_shape or o.shape != q_shape or v.shape != k_shape or \
                lse.shape != lse_shape or g.dtype is not dtype or v.dtype is not dtype or \
                o.dtype is not dtype or lse.dtype is not f32 or g.device_id != dev or \
                k.device_id != dev or v.device_id != dev or o.device_id != dev or \
                lse.device_id != dev or k.dtype is not dtype:
            return None
        if q.stream is not None or k.stream is not None or v.stream is not None or \
                g.stream is not None or o.stream is not None or lse.stream is not None:
            return None
        sc = plan_scale(scale, default)
        if sc is None:
            return None   # the general path's error
        dq = pool_tensor(q_shape, dtype, dev, alloc(q_bytes), pool, q_size, q_bytes)
        dk = dv = None
        try:
            dk = pool_tensor(k_shape, dtype, dev, alloc(k_bytes), pool, k_size, k_bytes)
            dv = pool_tensor(k_shape, dtype, dev, alloc(k_bytes), pool, k_size, k_bytes)
            go(pg, pq, pk, pv, po, pl, dq._ptr, dk._ptr, dv._ptr, sc)
        except BaseException:
            for t in (dq, dk, dv):
                if t is not None:
                    t.free()   # as the general path: nothing leaks from a failed launch
            raise
        return dq, dk, dv
    return run


