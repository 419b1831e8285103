"""GEMM gradients: `matmul_backward` (matrix_multiply), `linear_backward` (x Wᵀ + b) and
`fused_linear_gelu_backward` (GELU(x Wᵀ + b), tanh form), without a transposed copy of any
operand.

Each gradient is a GEMM with one operand read transposed, in the matmul kernels' own modes
(ops/matmul.py): for y = x Wᵀ + b with output gradient G,
- grad_x = G @ W: a plain GEMM (W (out, in) is B as (K, N));
- grad_W = Gᵀ @ x: `matmul.matmul_tn`, G read as A given (K, M) (a_trans: its tiles loaded
  along M; split-K over the rows when they are many and the output is small);
- grad_b = the column sums of G (reduction.reduce over axis 0).
fused_linear_gelu_backward first recomputes z = x Wᵀ + b in the linear-layer kernel whose
epilogue reads G and writes dZ = G * GELU'(z) (`bias_gelu_grad`: z is never stored), then
the three above with dZ for G. matmul_backward: grad_a = G @ bᵀ (`matmul.matmul_nt`: the
linear-layer kernels, b as (N, K)), grad_b = aᵀ @ G (matmul_tn); an operand broadcast over
the batch gets its gradient summed over it: b's as one GEMM over the stacked rows
(aᵀ (K, batch M) @ G (batch M, N)), a's as the batched products summed by a reduction.

Precision: float32 is float32-accurate by default, as matrix_multiply and fused_linear_gelu:
every GEMM (the three above and the recompute) times 3xTF32 tensor-core configs beside the
CUDA-core ones where the operands allow 16-byte loads (grad_W's a_trans x3 kernel reads G
along M, its rows permuted in the warp tile, and splits K over the rows like the SIMT one);
precision="ieee" keeps CUDA cores; precision="tf32" uses TF32, for which there is no a_trans
kernel in use: A is transposed into a pool block first (ops/transpose.py), an extra read and
write of G (or a). Every op
keeps a per-call plan (`m.plans`, ops/common.py remember_plan) made after a first general
call. Fallback mode runs the same steps through the matmul, linear-layer and reduction
fallbacks (NumPy), each result rounded to the dtype.

This module holds the family contract and matmul_backward; the linear layers' gradients are
ops/matmul_backward_layers.py's, the pieces both compose ops/matmul_backward_steps.py's.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..tensor import CudaTensor
from . import common
from . import matmul as mm
from . import matmul_grouped as grouped
from .linear import LINEAR_FAMILIES   # every linear-layer family (the recompute's epilogue)
from .matmul_backward_layers import (  # noqa: F401  (the linear layers' gradients: CudaML's)
    fused_linear_gelu_backward, linear_backward)
from .matmul_backward_steps import free_all, plan_ok, plan_step, run_plan, view

DT = CudaDataType
# (grad_x = G @ W is the plain GEMM: on Hopper its 16-bit calls may run the TMA or wgmma16
# kernel, B padded by strided_copy.cu.j2)
TEMPLATES = (mm.SIMT_TEMPLATE, mm.MMA_TEMPLATE, mm.WGMMA_TEMPLATE, mm.WGMMA16_TEMPLATE,
             mm.TMA16_TEMPLATE, mm.FILL_TEMPLATE, "transpose.cu.j2", "strided_copy.cu.j2",
             "reduce.cu.j2", "reduce_axis.cu.j2", grouped.TEMPLATE)
# (dtype, precision) of the families with an a_trans kernel (TF32 transposes A first)
TN_FAMILIES = ((DT.FLOAT32, None), (DT.FLOAT64, None), (DT.FLOAT16, None), (DT.BFLOAT16, None))


# -- the contract -------------------------------------------------------------------------
def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """The kernels only the gradients use: the A-transposed GEMM of every config the a_trans
    families may launch (both alignments), the linear kernels with the bias_gelu_grad
    epilogue (every linear config of every family), the skinny split-K reduce with it, and
    the grouped small GEMMs (ops/matmul_grouped.py).
    (matmul_nt's bias-only linear kernels are ops/linear.py's.)"""
    out: Dict[str, List[Dict[str, Any]]] = {mm.SIMT_TEMPLATE: [], mm.MMA_TEMPLATE: []}
    for dt, prec in TN_FAMILIES:
        family, _ = mm.family(dt, prec)
        for vec in (True, False):
            for cfg in mm.tn_configs(dt, prec, vec):
                template = mm.config_template(cfg, family)   # (float32's x3: mma)
                out[template].append(mm.tn_params(template, dt, cfg, vec))
    for dt, prec in LINEAR_FAMILIES:
        family, _ = mm.family(dt, prec, linear=True)
        for vec in (True, False):
            for cfg in mm.linear_configs(dt, prec, vec):
                template = mm.config_template(cfg, family)
                out[template].append(mm.linear_params(template, dt, cfg, vec,
                                                      mm.GRAD_EPILOGUE))
    out[mm.SIMT_TEMPLATE].append(mm.splitk_epilogue_params(DT.FLOAT32, mm.GRAD_EPILOGUE))
    out[grouped.TEMPLATE] = grouped.template_variants()
    return out


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile the gradients' own kernels (template_variants) in parallel threads; returns
    how many were compiled (0 in fallback mode). The plain GEMM, the bias-only linear
    kernels and the reductions are their families' (matmul, linear, reduction warm_up)."""
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets]
    return common.compile_all(m, jobs, device_id, workers, mm.compile_kernel)


def candidates(dtype: CudaDataType, precision: Optional[str], vec: bool,
               kind: str = "tn") -> List[Dict[str, Any]]:
    """The configs the autotuner chooses from: kind "tn" (the A-transposed GEMM: the GEMM's
    configs, float32's default x3 ones included, [] for TF32, which transposes A first) or
    "gelu_grad" (the recompute: the linear layer's configs)."""
    if kind == "tn":
        return mm.tn_configs(dtype, precision, vec)
    if kind == "gelu_grad":
        return mm.linear_configs(dtype, precision, vec)
    raise InvalidArgumentError(f"kind must be 'tn' or 'gelu_grad', got {kind!r}")


def reference(op: str, grad_out: Any, *args: Any, bias: Any = None,
              has_bias: bool = True) -> Tuple[Optional[np.ndarray], ...]:
    """float64 NumPy of op's gradients:
    "matmul_backward" (grad_out, a, b) -> (grad_a, grad_b), NumPy's matmul shapes (1-D
      operands, broadcast batches summed);
    "linear_backward" (grad_out, x, weight) -> (grad_x, grad_weight, grad_bias or None with
      has_bias=False);
    "fused_linear_gelu_backward" (grad_out, x, weight, bias=) -> the same, through
      dZ = grad_out * GELU'(x Wᵀ + b) (tanh form; grad_bias None without a bias)."""
    g = np.asarray(grad_out, dtype=np.float64)
    f64 = [np.asarray(v, dtype=np.float64) for v in args]
    g2: np.ndarray
    with np.errstate(all="ignore"):
        if op == "matmul_backward":
            a, b = f64
            a2 = a[None, :] if a.ndim == 1 else a
            b2 = b[:, None] if b.ndim == 1 else b
            out_nd = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]) + \
                (a2.shape[-2], b2.shape[-1])
            g2 = g.reshape(out_nd)
            ga = np.matmul(g2, np.swapaxes(b2, -1, -2))
            gb = np.matmul(np.swapaxes(a2, -1, -2), g2)
            return _sum_to(ga, a2.shape).reshape(a.shape), _sum_to(gb, b2.shape).reshape(b.shape)
        if op in ("linear_backward", "fused_linear_gelu_backward"):
            x, w = f64
            rows = int(np.prod(x.shape[:-1]))
            x2, g2 = x.reshape(rows, x.shape[-1]), g.reshape(rows, w.shape[0])
            with_bias = has_bias
            if op == "fused_linear_gelu_backward":
                b64 = 0.0 if bias is None else np.asarray(bias, dtype=np.float64)
                g2 = g2 * mm.gelu_tanh_grad(x2 @ w.T + b64)
                with_bias = bias is not None
            return ((g2 @ w).reshape(x.shape), g2.T @ x2,
                    g2.sum(axis=0) if with_bias else None)
    raise InvalidArgumentError(
        f"unknown op {op!r}: 'matmul_backward', 'linear_backward' or "
        f"'fused_linear_gelu_backward'")


def _sum_to(v: np.ndarray, shape: Tuple[int, ...]) -> np.ndarray:
    """v summed over the leading axes that `shape` broadcasts (NumPy's rule, reversed)."""
    lead = v.ndim - len(shape)
    v = v.sum(axis=tuple(range(lead))) if lead else v
    axes = tuple(i for i, d in enumerate(shape) if d == 1 and v.shape[i] != 1)
    return v.sum(axis=axes, keepdims=True) if axes else v


# -- matrix multiply ------------------------------------------------------------------------
def matmul_backward(m: Any, grad_out: CudaTensor, a: CudaTensor, b: CudaTensor,
                    precision: Optional[str] = None) -> Tuple[CudaTensor, CudaTensor]:
    """The gradients of matrix_multiply(a, b) (NumPy's matmul shapes: 2-D, batched with full
    or broadcast batches, 1-D operands): (grad_a = G bᵀ, grad_b = aᵀ G), each of its
    operand's shape; an operand broadcast over the batch gets the sum over the batch.
    float32 is float32-accurate by default (3xTF32 or CUDA cores), precision="ieee" CUDA
    cores only, "tf32" TF32."""
    key = matmul_plan_key(grad_out, a, b, precision)
    res = run_plan(m, key, grad_out, a, b)
    if res is not None:
        return res
    g = common.check_tensor(grad_out, "grad_out")
    common.check_tensor(a, "a")
    common.check_tensor(b, "b")
    dtype = common.same_dtype(g, a, b)
    common.require_dtype(g, common.FLOATS, "matmul_backward")
    common.same_device(g, a, b)
    common.normalize_precision(precision, dtype)
    p = mm.plan_shapes(a.shape, b.shape)
    if g.shape != p.out_shape:
        raise ShapeMismatchError(
            f"matmul_backward: grad_out has shape {g.shape}, expected {p.out_shape} (the "
            f"shape of a {a.shape} @ b {b.shape})")
    steps = _mm_steps(p)
    res = _mm_run(m, steps, g, a, b, precision)
    if key is not None and plan_ok(m):
        common.remember_plan(m, key, _mm_plan(m, steps, precision, key))
    return res


def _mm_steps(p: mm.Plan) -> Dict[str, Any]:
    """The views and products of matmul_backward for a plan: grad_a = G (batch, M, N) @ b
    (Bb, K, N)ᵀ (batched; summed over the batch where a is broadcast), grad_b = a (Ba, M, K)ᵀ
    @ G (batched), or, where b is broadcast, a (batch M, K)ᵀ @ G (batch M, N)."""
    B, M, N, K = p.batch, p.M, p.N, p.K
    full_a, full_b = p.stride_a != 0, p.stride_b != 0
    g3: Tuple[int, ...]
    a_shape: Tuple[int, ...]
    b_shape: Tuple[int, ...]
    gb_a: Tuple[int, ...]
    gb_g: Tuple[int, ...]
    if B == 1:
        g3 = (M, N)
        a_shape, b_shape = (M, K), (K, N)
        sum_a = False
        gb_a, gb_g = (M, K), (M, N)
    else:
        g3 = (B, M, N)
        a_shape = (B, M, K) if full_a else (M, K)
        b_shape = (B, K, N) if full_b else (K, N)
        sum_a = not full_a          # (then b is full: a broadcast batch needs one)
        if full_b:
            gb_a, gb_g = a_shape, g3
        else:                       # one GEMM over the stacked rows of a full a
            gb_a, gb_g = (B * M, K), (B * M, N)
    return {"g": g3, "a": a_shape, "b": b_shape, "sum_a": sum_a, "gb_a": gb_a, "gb_g": gb_g,
            "grouped": grouped.matmul_products(M, N, K) if B == 1 else None}


def _mm_run(m: Any, st: Dict[str, Any], g: CudaTensor, a: CudaTensor, b: CudaTensor,
            precision: Optional[str]) -> Tuple[CudaTensor, CudaTensor]:
    """The two products (and the batch sum) of matmul_backward; results already made are
    freed if a later step raises."""
    from . import reduction as red
    if st["grouped"] is not None:
        grp = grouped.for_products(m, g.dtype, g.device_id, precision, st["grouped"])
        if grp is not None:
            ga, gb = m.backend.empty(st["a"], g.dtype, g.device_id), None
            try:
                gb = m.backend.empty(st["b"], g.dtype, g.device_id)
                grp.launch(m, (g, b, ga, a, g, gb, 0, 0))
            except BaseException:
                free_all(ga, gb)
                raise
            return view(ga, a.shape), view(gb, b.shape)
    ga = gb = work = None
    try:
        work = mm.matmul_nt(m, view(g, st["g"]), view(b, st["b"]), precision)
        if st["sum_a"]:
            ga = red.reduce(m, "sum", work, axis=0)
            work.free()
        else:
            ga = work
        work = None
        gb = mm.matmul_tn(m, view(a, st["gb_a"]), view(g, st["gb_g"]), precision)
    except BaseException:
        free_all(work, ga, gb)
        raise
    return view(ga, a.shape), view(gb, b.shape)


def matmul_plan_key(g: Any, a: Any, b: Any, precision: Any) -> Optional[tuple]:
    """matmul_backward's plan key: every operand's shape, dtype and device, and the precision
    as given; None where no plan applies."""
    if type(g) is not CudaTensor or type(a) is not CudaTensor or type(b) is not CudaTensor \
            or not (precision is None or type(precision) is str):
        return None
    return ("matmul_backward", g.shape, a.shape, b.shape, g.dtype, a.dtype, b.dtype,
            g.device_id, a.device_id, b.device_id, precision)


def _mm_plan(m: Any, st: Dict[str, Any], precision: Optional[str], key: tuple) -> Any:
    """The per-call plan of matmul_backward: its steps through the plans of matmul_nt and
    matmul_tn its first call made (the batch sum through reduction.reduce, which looks up
    its own); None (general path) where a step steps aside."""
    from . import reduction as red
    dt, dev = key[4], key[7]
    if st["grouped"] is not None:
        grp = grouped.for_products(m, dt, dev, precision, st["grouped"])
        if grp is not None:
            return _mm_grouped_plan(m, grp, st)
    nt = plan_step(m, ("matmul_nt", st["g"], st["b"], dt, dt, dev, dev, precision),
                   lambda m_, x, y: mm.matmul_nt(m_, x, y, precision))
    tn = plan_step(m, ("matmul_tn", st["gb_a"], st["gb_g"], dt, dt, dev, dev, precision),
                   lambda m_, x, y: mm.matmul_tn(m_, x, y, precision))
    g3, b3, gba, gbg, sum_a = st["g"], st["b"], st["gb_a"], st["gb_g"], st["sum_a"]

    def plan(g: CudaTensor, a: CudaTensor, b: CudaTensor) -> Optional[Tuple[CudaTensor, ...]]:
        if g._ptr is None or a._ptr is None or b._ptr is None:
            return None   # (the general path raises TensorFreedError)
        work = nt(view(g, g3), view(b, b3), None)
        if work is None:
            return None
        ga = None
        try:
            if sum_a:
                ga = red.reduce(m, "sum", work, axis=0)
                work.free()
            else:
                ga = work
            work = None
            gb = tn(view(a, gba), view(g, gbg), None)
        except BaseException:
            free_all(work, ga)
            raise
        if gb is None:
            ga.free()
            return None
        return view(ga, a.shape), view(gb, b.shape)
    return plan


def _mm_grouped_plan(m: Any, grp: grouped.Grouped, st: Dict[str, Any]) -> Any:
    """matmul_backward's per-call plan where one grouped launch makes both gradients (the
    general path's launch: _mm_run)."""
    run = grp.prepared(m)
    new = grouped.outputs_maker(m, grp.dev, grp.dtype, (st["a"], st["b"]))

    def plan(g: CudaTensor, a: CudaTensor, b: CudaTensor) -> Optional[Tuple[CudaTensor, ...]]:
        pg, pa, pb = g._ptr, a._ptr, b._ptr
        if pg is None or pa is None or pb is None or g.stream is not None \
                or a.stream is not None or b.stream is not None:
            return None   # (the general path raises TensorFreedError, or orders the streams)
        ga, gb = new()
        try:
            run(pg, pb, ga._ptr, pa, pg, gb._ptr, 0, 0)
        except BaseException:
            free_all(ga, gb)
            raise
        return view(ga, a.shape), view(gb, b.shape)
    return plan
