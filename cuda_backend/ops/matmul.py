"""Matrix multiply: `matmul(m, a, b, precision, out)` for CudaMath.matrix_multiply.

The kernel families, all templated:
- `matmul_simt.cu.j2`: true FP32 (float32's "ieee", beside 3xTF32 in its default) and FP64
  on CUDA cores (the A-transposed and linear-layer float64 kernels, the plain GEMM's split-K
  shapes and devices without DMMA); register-tiled
  GEMM with a split-K mode (partial products in a workspace, then `splitk_reduce`) so that
  skinny and small outputs still fill every SM; and for float32 with few rows (M <= 64,
  SKINNY_F32) a skinny-M split-K kernel (all M rows per block, K sliced over many blocks,
  B or the linear layer's weight read once by 16-byte cp.async) whose partials
  `splitk_reduce` or, for the linear layer, `splitk_epilogue` (+ bias, GELU) sums in a
  fixed order.
- `matmul_mma.cu.j2`: tensor cores through mma.sync with float32 accumulators: TF32 for
  float32 with precision="tf32", float16 / bfloat16 (output in the input dtype), and 3xTF32
  (x3: float32-level accuracy) in float32's default (precision None / "fp32", F32_DEFAULT,
  LINEAR_F32): the autotuner times the x3 configs beside the SIMT ones where the operands
  allow 16-byte loads; the x3 GEMMs split K as the SIMT one does (x3_split_options).
- `matmul_dmma.cu.j2`: float64 on the FP64 tensor cores (mma.m16n8k16.f64, compute
  capability >= 9.0) for matrix_multiply's plain GEMM: timed beside the SIMT configs
  (SIMT_F64), split-K as the x3 GEMMs (x3_split_options at the DMMA rate), no epilogue.
- `matmul_wgmma.cu.j2`: TF32 on Hopper's warpgroup tensor cores (wgmma, sm_90a) for
  precision="tf32" where K is a multiple of 4: B is first transposed to (N, K) and rounded to
  TF32 (transpose.transpose_tf32) into a pool block, since wgmma reads a TF32 B only K-major.
- `matmul_wgmma16.cu.j2`: float16 / bfloat16 on Hopper's wgmma (sm_90a), both operands from
  shared memory, for matrix_multiply's plain GEMM (no epilogue, A not transposed, the output
  4-byte aligned: wgmma16_ok); A is read in place where K % 8 == 0 and it is 16-byte aligned,
  B where N % 8 == 0 and it is 16-byte aligned, each otherwise first copied into rows padded
  to 8 (strided_copy.cu.j2, a pool block; matmul_pad), the kernel given the real K and N.
  Timed beside the mma.sync configs (MMA_F16); a call it cannot take runs
  WGMMA16_STANDIN instead. The linear layers (B given as (N, K)) and matmul_nt / matmul_tn
  keep mma.sync: the kernel reads B only as (K, N) and A only as (M, K).
- `matmul_tma16.cu.j2`: float16 / bfloat16 on Hopper, warp-specialized: the tensor memory
  accelerator (TMA) fills a shared-memory ring from tensor maps (tensor_maps.py), two
  consumer warpgroups run wgmma from it, persistent grid; for matrix_multiply's plain GEMM
  of one matrix where K and N are multiples of 8 and A, B and C are 16-byte aligned
  (matmul_tma16.tma16_usable). Timed first among the large shapes' candidates and beside
  the wgmma16 ones for medium shapes, with 128x64 tiles there too (MMA_F16; TF32: MMA_TF32);
  a call it cannot take runs TMA16_STANDIN (the wgmma16 kernel) instead.
- `matmul_skinny.cu.j2`: true FP32 for M <= 64 on devices with thread-block clusters (compute
  capability >= 9.0): split-K over the blocks of one cluster, whose partial tiles are summed
  through distributed shared memory in a fixed order, the epilogue applied there: one launch,
  no workspace (CLUSTER_F32, cluster_candidates), timed beside the split-K configs above.

Each family has a short list of tile configs per shape class; the Autotuner times them once
per (device, class) and keeps the fastest. `vec` (16-byte loads) is chosen per call from the
operands' alignment and is part of the class, never tuned. Shapes: (M,K)@(K,N), batched
(...,M,K)@(...,K,N) where each operand's batch is either the full broadcast batch or all
ones (stride 0), and NumPy's 1-D rules (a 1-D operand gains and then loses a unit dimension).

`linear(m, x, weight, bias, epilogue)`: epilogue(x @ weightᵀ + bias) in one launch of the
same kernels, rendered with b_trans (the (N, K) weight is read along K, no transpose) and a
bias / bias+GELU epilogue in the store stage (these never split K: the epilogue needs whole
sums); for M <= 64 the autotuner also times the skinny split-K configs, whose reduce kernel
adds the bias and applies the epilogue after summing (two launches), and on sm_90+ the
cluster configs (one launch, the epilogue after the in-cluster sum). The epilogue
"bias_gelu_grad" (with `grad`, the layer's output gradient G) writes G * GELU'(x Wᵀ + b)
instead: the gradient at the pre-activation, z never stored (ops/matmul_backward.py).

Operand layouts for the gradients (ops/matmul_backward.py), without a transposed copy:
`matmul_nt(m, a, b)` = a @ bᵀ for b given as (..., N, K) (the linear kernels, b_trans, no
bias; float32's default their 3xTF32 and SIMT configs), `matmul_tn(m, a, b)` = aᵀ @ b for a
given as (..., K, M) (a_trans: the SIMT, 3xTF32 and 16-bit mma kernels load A's tiles along
M; split-K as the GEMM's). TF32 has no a_trans kernel in use: a is first transposed into a
pool block (ops/transpose.py), then the plain GEMM runs (its wgmma configs included).

This module holds the ops, their checks and the registry's contract; the family's other
modules: matmul_shapes (Plan, shape rules, precision, shape class), matmul_kernels (templates,
template parameters, launch resources), matmul_configs (the tile tables and `candidates`),
matmul_skinny (the skinny split-K and cluster configs for M <= 64), matmul_splitk (split-K
counts), matmul_launch (the memo, the autotuned choice, `run_config`), matmul_tma16 (the TMA
kernel's launches), matmul_plans (per-call plans) and matmul_fallback (NumPy).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..dtypes import CudaDataType
from ..errors import DTypeMismatchError, InvalidArgumentError, ShapeMismatchError
from ..kernels import dtype_params
from ..tensor import CudaTensor
from . import common
from .common import normalize_precision
from .matmul_configs import (SCALAR_OK, all_configs, has_tn_kernel, linear_configs,
                             linear_family)
from .matmul_configs import candidates  # noqa: F401  (registry.CONTRACT of an autotuned family)
from .matmul_fallback import fallback, linear_fallback
from .matmul_kernels import (DMMA_TEMPLATE, EPILOGUES, FILL_TEMPLATE, GRAD_EPILOGUE, MMA_TEMPLATE,
                             REDUCE_BLOCK,
                             SIMT_TEMPLATE, SKINNY_TEMPLATE, TMA16_TEMPLATE, WGMMA16_TEMPLATE,
                             WGMMA_TEMPLATE, config_template, kernel_params, linear_params,
                             splitk_epilogue_params, template_runs_on, tma16_params,
                             wgmma16_params, wgmma_params)
from .matmul_launch import cached_kernel, fill_zero, launch
from .matmul_plans import remember
from .matmul_shapes import Plan, plan_shapes
from .matmul_skinny import cluster_configs, cluster_params, skinny_configs, skinny_params

# Re-exports: tests/, perf/, ops/linear.py and ops/matmul_backward.py reach the family's names as
# `matmul.<name>` (about 800 uses); each is defined in the module it is imported from here.
from .matmul_configs import (  # noqa: F401
    D_64x64x8, H_64x64x32, LINEAR_MMA_F32X3, LINEAR_SIMT_F32_KC, SIMT_F32, SIMT_F32_EXTRA,
    S_128x128x8_16x8, S_128x64x16_s3, S_128x64x8_q2, S_32x64x16, S_64x64x8, S_64x64x8_q2,
    T16_128x128_s5, T16_128x192_s4, T16_128x256_s4, T16_128x64_s6, T16_128x64_s7,
    T16_256x128_s4, T_128x128x32, T_64x64x16, TMA16_STANDIN, W16_128x128_s3, W16_128x256_s4,
    W_128x128_s3, W_64x128_s3, W_64x256_s4, WGMMA16_STANDIN,
    X3_GEMM, X_64x128x32_w32x64, family, gemm_family, tma_standin, tn_configs)
from .matmul_fallback import gelu_tanh, gelu_tanh_grad, round_tf32  # noqa: F401
from .matmul_kernels import (  # noqa: F401
    TMA16_ARG_TYPES, TMA16_THREADS, blocks_per_sm, dmma_smem, has_clusters, has_wgmma,
    simt_params, simt_smem, takes_k_chunk, tn_params, wgmma16_b_direct, wgmma16_ld, wgmma16_ok,
    wgmma_ok, wgmma_smem)
from .matmul_launch import (  # noqa: F401
    compile_kernel, memo, op_name, run_config, wgmma16_usable)
from .matmul_pad import (pad_a_launches, pad_b_launches, run_tf32_padded,  # noqa: F401
                         tf32_pad_shape, tf32_padded_plan, wgmma16_a_direct)
from .matmul_plans import config_runner  # noqa: F401
from .matmul_shapes import is_vec_ok, shape_class, tune_key  # noqa: F401
from .matmul_skinny import (  # noqa: F401
    CLUSTER_F32, CLUSTER_F32_SCALAR, CLUSTER_NARROW_TILES, CLUSTER_SPLITS, CLUSTER_TILES,
    SKINNY_F32, SKINNY_FEW_TILES_MAX_M, SKINNY_MIN_CHUNK,
    cluster_blocks, cluster_candidates, cluster_chunk, cluster_smem, cluster_split_choices,
    cluster_threads, cluster_tiles, few_tiles, skinny_blocks, skinny_candidates, skinny_chunk,
    skinny_smem, skinny_split_options, skinny_threads, skinny_tiles)
from .matmul_splitk import (  # noqa: F401
    X3_MIN_CHUNK, effective_split, split_candidates, split_count, split_options,
    x3_split_options, x3_split_time)
from .matmul_tma16 import tma16_shape_ok, tma16_usable  # noqa: F401

DT = CudaDataType
# the registry's contract: fill for K == 0, transpose.cu.j2 (ops/transpose.py) for wgmma's B,
# strided_copy.cu.j2 (ops/shape_copy.py) for the 16-bit wgmma's padded B
TEMPLATES = (SIMT_TEMPLATE, MMA_TEMPLATE, DMMA_TEMPLATE, WGMMA_TEMPLATE, WGMMA16_TEMPLATE,
             TMA16_TEMPLATE, SKINNY_TEMPLATE, FILL_TEMPLATE, "transpose.cu.j2",
             "strided_copy.cu.j2")


def matmul(m: Any, a: CudaTensor, b: CudaTensor, precision: Optional[str] = None,
           out: Optional[CudaTensor] = None) -> CudaTensor:
    """a @ b with NumPy's matmul shape rules (batch: full or broadcast). float32 is
    float32-accurate by default (3xTF32 tensor-core or CUDA-core configs, the faster timed),
    precision='ieee' CUDA cores only, 'tf32' TF32; float16/bfloat16 use tensor cores with
    float32 accumulation; float64 on the FP64 tensor cores (compute capability >= 9.0) or
    CUDA cores, the faster timed. out= (optional) receives the result."""
    if out is None or type(out) is CudaTensor:
        res = _planned(m, "matmul", a, b, precision, out)
        if res is not None:
            return res
    common.check_tensor(a, "a")
    common.check_tensor(b, "b")
    dtype = common.same_dtype(a, b)
    common.require_dtype(a, common.FLOATS, "matmul")
    prec = normalize_precision(precision, dtype)
    dev = common.same_device(a, b)
    p = plan_shapes(a.shape, b.shape)
    out, done = _general_out(m, a, b, out, p, dtype, prec, dev)
    if done:
        return out
    pad = tf32_pad_shape(m, a, b, p, dtype, prec, dev) if m.gpu else None
    if pad is not None:
        run_tf32_padded(m, a, b, out, p, pad[0], pad[1], prec, dev)
        plan = tf32_padded_plan(m, p, pad[0], pad[1], prec, dev) \
            if type(a) is CudaTensor and type(b) is CudaTensor else None
        if plan is not None:
            common.remember_plan(m, ("matmul", a.shape, b.shape, dtype, dtype, dev, dev,
                                     precision), plan)
        return out
    vec = launch(m, a, b, out, p, dtype, prec, dev)
    _remember(m, "matmul", a, b, precision, p, dtype, prec, dev, vec)
    return out


def _check_out(out: Any, a: CudaTensor, b: CudaTensor, dtype: CudaDataType, dev: int,
               p: Plan) -> None:
    common.check_tensor(out, "out")
    if out.dtype is not dtype:
        raise DTypeMismatchError(
            f"out has dtype {out.dtype.name_str}, expected {dtype.name_str} (the operands')")
    if tuple(out.shape) != p.out_shape:
        raise ShapeMismatchError(
            f"out has shape {out.shape}, expected {p.out_shape} for {a.shape} @ {b.shape}")
    common.same_device(a, out)
    _check_no_overlap(out, (("a", a), ("b", b)))


def _check_no_overlap(out: CudaTensor,
                      named: Sequence[Tuple[str, Optional[CudaTensor]]]) -> None:
    """InvalidArgumentError where out shares memory with one of the (name, operand) given."""
    if out.nbytes:
        lo, hi = out.ptr, out.ptr + out.nbytes
        for name, t in named:
            if t is not None and t.nbytes and t.ptr < hi and lo < t.ptr + t.nbytes:
                raise InvalidArgumentError(f"out overlaps operand {name}; use a separate tensor")


def linear(m: Any, x: CudaTensor, weight: CudaTensor, bias: Optional[CudaTensor] = None,
           epilogue: str = "bias_gelu", precision: Optional[str] = None,
           out: Optional[CudaTensor] = None, grad: Optional[CudaTensor] = None) -> CudaTensor:
    """epilogue(x @ weightᵀ + bias) in one kernel launch: x (M, K), weight (N, K) row-major
    (a PyTorch Linear weight, read as it is), bias (N,) or None; epilogue 'bias' or
    'bias_gelu' (GELU, tanh form, applied in the accumulator type), or 'bias_gelu_grad'
    with grad (M, N): grad * GELU'(x Wᵀ + b), the gradient of a bias + GELU layer at its
    pre-activation. float32 is float32-accurate (3xTF32 or CUDA cores, LINEAR_F32); 'ieee':
    CUDA cores only; 'tf32': TF32. Fallback: float64 NumPy, rounded to the dtype."""
    for t, name in ((x, "x"), (weight, "weight")):
        common.check_tensor(t, name)
    if bias is not None:
        common.check_tensor(bias, "bias")
    if epilogue not in EPILOGUES and epilogue != GRAD_EPILOGUE:
        raise InvalidArgumentError(
            f"epilogue must be one of {', '.join(EPILOGUES + (GRAD_EPILOGUE,))}, got "
            f"{epilogue!r}")
    if (grad is not None) != (epilogue == GRAD_EPILOGUE):
        raise InvalidArgumentError(
            f"linear: grad is given with epilogue {GRAD_EPILOGUE!r} and only then (epilogue "
            f"{epilogue!r}, grad {'given' if grad is not None else 'None'})")
    if grad is not None:
        common.check_tensor(grad, "grad")
    operands = [t for t in (x, weight, bias, grad) if t is not None]
    dtype = common.same_dtype(*operands)
    common.require_dtype(x, common.FLOATS, "linear")
    prec = normalize_precision(precision, dtype)
    dev = common.same_device(*operands)
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ShapeMismatchError(
            f"linear: x must be (M, K) and weight (N, K) with the same K, got x {x.shape} "
            f"and weight {weight.shape}")
    (M, K), N = x.shape, weight.shape[0]
    if bias is not None and bias.shape != (N,):
        raise ShapeMismatchError(f"linear: bias must have shape ({N},), got {bias.shape}")
    if grad is not None and grad.shape != (M, N):
        raise ShapeMismatchError(
            f"linear: grad must have the output's shape ({M}, {N}), got {grad.shape}")
    p = Plan(1, M, N, K, 0, 0, (M, N))
    if out is None:
        out = m.backend.empty((M, N), dtype, dev)
    else:
        common.check_tensor(out, "out")
        if out.dtype is not dtype or tuple(out.shape) != (M, N):
            raise ShapeMismatchError(
                f"out must be ({M}, {N}) {dtype.name_str}, got {out.shape} {out.dtype.name_str}")
        common.same_device(x, out)
        _check_no_overlap(out, (("x", x), ("weight", weight), ("bias", bias), ("grad", grad)))
    if out.size == 0:
        return out
    if not m.gpu:
        linear_fallback(m, x, weight, bias, out, epilogue, prec, grad)
        return out
    launch(m, x, weight, out, p, dtype, prec, dev, epilogue=epilogue, bias=bias, grad=grad)
    return out


def _check_pair(a: CudaTensor, b: CudaTensor, precision: Any,
                what: str) -> Tuple[CudaDataType, Optional[str], int]:
    """(dtype, precision, device) of two live float operands of one dtype and device, each
    with at least 2 dimensions."""
    common.check_tensor(a, "a")
    common.check_tensor(b, "b")
    dtype = common.same_dtype(a, b)
    common.require_dtype(a, common.FLOATS, what)
    prec = normalize_precision(precision, dtype)
    dev = common.same_device(a, b)
    if a.ndim < 2 or b.ndim < 2:
        raise ShapeMismatchError(
            f"{what} needs operands with at least 2 dimensions, got shapes {a.shape} and "
            f"{b.shape}")
    return dtype, prec, dev


def _swapped(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    return tuple(shape[:-2]) + (shape[-1], shape[-2])


def _planned(m: Any, op: str, a: CudaTensor, b: CudaTensor, precision: Any,
             out: Optional[CudaTensor] = None) -> Optional[CudaTensor]:
    """The result of op's per-call plan for these operands (matmul_plans.remember made it),
    written into out where given; None where the general path must run."""
    if type(a) is CudaTensor and type(b) is CudaTensor and \
            (precision is None or type(precision) is str):
        plans = getattr(m, "plans", None)
        fast = None if plans is None else plans.get(
            (op, a.shape, b.shape, a.dtype, b.dtype, a.device_id, b.device_id, precision))
        if fast is not None and m.backend.direct_launch(a.device_id):
            return fast(a, b, None) if out is None else fast(a, b, None, dst=out)
    return None


def _general_out(m: Any, a: CudaTensor, b: CudaTensor, out: Optional[CudaTensor], p: Plan,
                 dtype: CudaDataType, prec: Optional[str], dev: int, a_trans: bool = False,
                 b_trans: bool = False) -> Tuple[CudaTensor, bool]:
    """(result, done) of a general-path GEMM call: out checked (or a new tensor), done where
    nothing is left to launch: an empty result, fallback mode (NumPy), K == 0 (zeros)."""
    if out is not None:
        _check_out(out, a, b, dtype, dev, p)
    else:
        out = m.backend.empty(p.out_shape, dtype, dev)
    if out.size == 0:
        return out, True
    if not m.gpu:
        fallback(m, a, b, out, p, prec, a_trans=a_trans, b_trans=b_trans)
        return out, True
    if p.K == 0:
        fill_zero(m, out, dev)
        return out, True
    return out, False


def _remember(m: Any, op: str, a: CudaTensor, b: CudaTensor, precision: Any, p: Plan,
              dtype: CudaDataType, prec: Optional[str], dev: int, vec: bool,
              epilogue: Optional[str] = None, a_trans: bool = False) -> None:
    """After a general-path call of op: its per-call plan (matmul_plans.remember), where one
    may serve it (CudaTensor operands, the precision None or a str)."""
    if type(a) is CudaTensor and type(b) is CudaTensor and \
            (precision is None or type(precision) is str):
        remember(m, (op, a.shape, b.shape, dtype, dtype, dev, dev, precision), p, dtype, prec,
                 dev, vec, p.out_shape, epilogue, a_trans)


def matmul_tn(m: Any, a: CudaTensor, b: CudaTensor, precision: Optional[str] = None,
              out: Optional[CudaTensor] = None) -> CudaTensor:
    """aᵀ @ b for a given as (..., K, M) and b as (..., K, N) -> (..., M, N) (batches full or
    broadcast, as matmul's), without a transposed copy of a: the a_trans kernels read its
    tiles along M (split-K as the GEMM's, for a long K such as a batch of rows). Precision
    as matmul's (float32: 3xTF32 or CUDA cores by default, 'ieee' CUDA cores only); TF32
    transposes a into a pool block first and runs the plain GEMM."""
    if out is None:
        res = _planned(m, "matmul_tn", a, b, precision)
        if res is not None:
            return res
    dtype, prec, dev = _check_pair(a, b, precision, "matmul_tn")
    p = plan_shapes(_swapped(a.shape), b.shape)
    out, done = _general_out(m, a, b, out, p, dtype, prec, dev, a_trans=True)
    if done:
        return out
    if not has_tn_kernel(dtype, prec):
        from . import transpose as tr
        at = tr.transpose(m, a)   # (..., M, K) in a pool block
        try:
            launch(m, at, b, out, p, dtype, prec, dev)
        finally:
            at.free()   # back to the pool; later work on this stream is ordered after
        return out
    vec = launch(m, a, b, out, p, dtype, prec, dev, a_trans=True)
    _remember(m, "matmul_tn", a, b, precision, p, dtype, prec, dev, vec, a_trans=True)
    return out


def matmul_nt(m: Any, a: CudaTensor, b: CudaTensor, precision: Optional[str] = None,
              out: Optional[CudaTensor] = None) -> CudaTensor:
    """a @ bᵀ for a given as (..., M, K) and b as (..., N, K) -> (..., M, N) (batches full or
    broadcast, as matmul's), without a transposed copy of b: the linear-layer kernels
    (b_trans, a null bias; one K split; the skinny split-K and cluster ones for few rows).
    Precision as the linear layer's: float32 is float32-accurate by default (3xTF32 or CUDA
    cores, LINEAR_F32), 'ieee' CUDA cores only, 'tf32' TF32."""
    if out is None:
        res = _planned(m, "matmul_nt", a, b, precision)
        if res is not None:
            return res
    dtype, prec, dev = _check_pair(a, b, precision, "matmul_nt")
    p = plan_shapes(a.shape, _swapped(b.shape))
    out, done = _general_out(m, a, b, out, p, dtype, prec, dev, b_trans=True)
    if done:
        return out
    vec = launch(m, a, b, out, p, dtype, prec, dev, epilogue="bias")
    _remember(m, "matmul_nt", a, b, precision, p, dtype, prec, dev, vec, "bias")
    return out


def reference(a: Any, b: Any) -> np.ndarray:
    """a @ b in float64 NumPy (2-D, or batched 3-D with a broadcast batch)."""
    with np.errstate(all="ignore"):
        return np.matmul(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set this module renders (CI renders and compiles each)."""
    simt: List[Dict[str, Any]] = []
    mma: List[Dict[str, Any]] = []
    wgmma: List[Dict[str, Any]] = []
    wgmma16: List[Dict[str, Any]] = []
    tma16: List[Dict[str, Any]] = []
    dmma: List[Dict[str, Any]] = []
    for dt in (DT.FLOAT32, DT.FLOAT64):
        # (float32's default holds the x3 GEMM kernels too: mma, 16-byte loads only;
        # float64's the DMMA ones)
        for cfg in all_configs(dt, None):
            template = config_template(cfg, SIMT_TEMPLATE)
            for vec in (True, False):
                if vec or cfg in SCALAR_OK:
                    {SIMT_TEMPLATE: simt, DMMA_TEMPLATE: dmma}.get(template, mma).append(
                        kernel_params(template, dt, cfg, vec))
        simt.append({**dtype_params(dt), "kind": "splitk_reduce", "block_size": REDUCE_BLOCK})
    for dt, prec in ((DT.FLOAT32, "tf32"), (DT.FLOAT16, None), (DT.BFLOAT16, None)):
        for cfg in all_configs(dt, prec):
            if cfg.get("tma16"):   # (matrix_multiply's output: the input dtype)
                tma16.append(tma16_params(dt, cfg))
                continue
            if cfg.get("wgmma16"):
                wgmma16.append(wgmma16_params(dt, cfg))
                continue
            if cfg.get("wgmma"):
                wgmma.append(wgmma_params(cfg))
                continue
            for vec in (True, False):
                if vec or cfg in SCALAR_OK:
                    mma.append({**dtype_params(dt), **cfg, "vec": vec})
    # the one-kernel linear layer: only its own configs, with the bias + GELU epilogue
    for dt, prec in ((DT.FLOAT32, None), (DT.FLOAT64, None), (DT.FLOAT32, "tf32"),
                     (DT.FLOAT16, None), (DT.BFLOAT16, None)):
        family_template, _ = linear_family(dt, prec)
        for vec in (True, False):
            for cfg in linear_configs(dt, prec, vec):
                template = config_template(cfg, family_template)
                params = linear_params(template, dt, cfg, vec, "bias_gelu")
                (simt if template == SIMT_TEMPLATE else mma).append(params)
    # skinny M (split-K over blocks): matrix_multiply's B (K, N) and the linear layer's
    # weight (N, K), both alignments, and the linear layer's reduce with bias + GELU
    for cfg in skinny_configs(DT.FLOAT32, None):
        for b_trans in (True, False):
            for vec in (True, False):
                simt.append(skinny_params(DT.FLOAT32, cfg, vec, b_trans))
    simt.append(splitk_epilogue_params(DT.FLOAT32, "bias_gelu"))
    # the cluster kernel: matrix_multiply's B (K, N) and the linear layer's weight (N, K) with
    # bias + GELU (its "bias" and "bias_gelu_grad" kernels are ops/linear.py's)
    cluster = [cluster_params(DT.FLOAT32, cfg, vec, b_trans, epilogue)
               for vec in (True, False) for cfg in cluster_configs(vec)
               for b_trans, epilogue in ((False, "none"), (True, "bias_gelu"))]
    return {SIMT_TEMPLATE: simt, MMA_TEMPLATE: mma, WGMMA_TEMPLATE: wgmma,
            WGMMA16_TEMPLATE: wgmma16, TMA16_TEMPLATE: tma16, SKINNY_TEMPLATE: cluster,
            DMMA_TEMPLATE: dmma}


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8,
            dtypes: Sequence[CudaDataType] = tuple(common.FLOATS)) -> int:
    """Compile every matmul variant for the dtypes in parallel threads (nvcc runs in
    subprocesses); returns how many were compiled. Later calls find them memoized."""
    names = {d.name_str for d in dtypes}
    jobs = [(t, params) for t, sets in template_variants().items() for params in sets
            if params["dtype"] in names and runs_here(m, t, device_id)]
    return common.compile_all(m, jobs, device_id, workers, cached_kernel)


def runs_here(m: Any, template: str, device_id: Optional[int] = None) -> bool:
    """The device (None: the current one) runs the template's kernels (template_runs_on);
    False for the wgmma (TF32, 16-bit, TMA), cluster and DMMA kernels where the backend has
    no device info (stand-ins, fallback mode)."""
    if template not in (WGMMA_TEMPLATE, WGMMA16_TEMPLATE, TMA16_TEMPLATE, SKINNY_TEMPLATE,
                        DMMA_TEMPLATE):
        return True
    info = getattr(m.backend, "get_device_info", None)   # (absent on stand-in backends)
    if not m.gpu or info is None:
        return False
    dev = m.backend.current_device if device_id is None else device_id
    return template_runs_on(template, info(dev))
