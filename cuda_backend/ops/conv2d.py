"""2-D convolution (PyTorch's F.conv2d: cross-correlation), NCHW input, KCRS filters.

Three kernel families, all templated:
- `conv2d_simt.cu.j2`: true FP32 as a register-tiled implicit GEMM on CUDA cores (GEMM
  M = N*P*Q, N = K/groups, K = Cg*R*S), the input patches gathered on the fly from NCHW, the
  filter repacked once per call by `conv2d_prep.cu.j2` (weight_rsck).
- `conv2d_mma.cu.j2`: tensor cores through mma.sync with float32 accumulators: TF32 for
  float32 with precision="tf32", 3xTF32 (x3: float32-level accuracy) for float32 at the
  default precision, float16 / bfloat16. The input is repacked to NHWC (each group's
  channels padded to 16 bytes) and the filter to [K][R*S][Cgp] so that every k-tile row is
  whole 16-byte cp.async chunks; the workspaces go back to the pool after the launch.
- `conv2d_direct.cu.j2`: depthwise and thin grouped convolutions (fewer than 8 output
  channels per group, or one input channel per group), where a GEMM tile would be mostly
  zeros; also float16 / bfloat16 with float32 accumulation.

float32 precisions: None / "fp32" / "highest" (the default): float32-level accuracy, the
autotuner timing the SIMT configs and, where the 3xTF32 ones fit (`x3_fits`), those too, each
with its repacks; "ieee": CUDA cores only (SIMT); "tf32": TF32 tensor cores.

Tile configs per family are short lists; the Autotuner times them once per (device, shape
class) and keeps the fastest. `conv2d(..., out=...)` (internal) writes into a given tensor.

The parts: ops/conv2d_geometry.py (`Geometry`, `plan`; the precision names are common.py's),
conv2d_configs.py (templates, tile configs and their choice), conv2d_launch.py (the launches:
the general path and the per-call plan); this module holds the entry point, its checks, the
float64 reference and the op family's contract (registry.CONTRACT).
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
from .conv2d_configs import (DIRECT_TEMPLATE, DIRECT_VQ, DTYPES, F16_CONFIGS, MMA_TEMPLATE,
                             KCRS_CONFIGS, PREP_TEMPLATE, SIMT_CONFIGS, SIMT_TEMPLATE,
                             TF32_CONFIGS, X3_CONFIGS)
from .conv2d_configs import candidates  # noqa: F401  (registry.CONTRACT of an autotuned family)
from .conv2d_geometry import Geometry, plan
from .conv2d_launch import cached_plan, fast_plan, get_kernel, launch, plan_key

DT = CudaDataType
TEMPLATES = (SIMT_TEMPLATE, MMA_TEMPLATE, PREP_TEMPLATE, DIRECT_TEMPLATE)
INT_MAX = 2**31 - 1


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set this module renders (CI renders and compiles each)."""
    f32 = dtype_params(DT.FLOAT32)
    simt = [{**f32, **cfg} for cfg in SIMT_CONFIGS + KCRS_CONFIGS]
    mma = [{**f32, **cfg} for cfg in TF32_CONFIGS + X3_CONFIGS]
    for dt in (DT.FLOAT16, DT.BFLOAT16):
        mma += [{**dtype_params(dt), **cfg} for cfg in F16_CONFIGS]
    prep = [{**f32, "kind": "weight_rsck"}]
    for dt in DTYPES:
        prep += [{**dtype_params(dt), "kind": "weight_krsc"},
                 {**dtype_params(dt), "kind": "input_nhwc"}]
    direct = [{**dtype_params(dt), "vq": DIRECT_VQ} for dt in DTYPES]
    return {SIMT_TEMPLATE: simt, MMA_TEMPLATE: mma, PREP_TEMPLATE: prep,
            DIRECT_TEMPLATE: direct}


# -- entry point ----------------------------------------------------------------------------
def conv2d(m: Any, x: CudaTensor, w: CudaTensor, config: Any,
           bias: Optional[CudaTensor] = None, precision: Optional[str] = None,
           out: Optional[CudaTensor] = None) -> CudaTensor:
    """F.conv2d(x, w, bias, stride, padding, dilation, groups) -> (N, K, P, Q).

    float32 is float32-accurate (SIMT or 3xTF32, the autotuner's pick; 'ieee': SIMT only)
    unless precision='tf32'; float16 / bfloat16 use tensor cores (or the direct kernel) with
    float32 accumulation. out= receives the result.
    """
    if out is None and type(x) is CudaTensor and type(w) is CudaTensor:
        # the per-call plan (ops/conv2d_launch.py)
        fast = cached_plan(m, plan_key, x, w, config, bias is None, precision)
        if fast is not None and m.backend.direct_launch(x.device_id):
            res = fast(x, w, bias)
            if res is not None:
                return res
    common.check_tensor(x, "input")
    common.check_tensor(w, "kernel")
    if bias is not None:
        common.check_tensor(bias, "bias")
    geom, dtype, prec, dev = _validate(m, x, w, config, bias, precision)
    owned = out is None
    if out is None:     # (owned)
        out = m.backend.empty(geom.out_shape, dtype, dev)
    else:
        _check_out(out, geom, dtype, dev, [t for t in (x, w, bias) if t is not None])
    if out.size == 0:
        return out
    try:
        if not m.gpu:
            _fallback(m, x, w, bias, geom, prec, out)
            return out
        cfg = launch(m, x, w, bias, geom, dtype, prec, out, dev)
    except BaseException:
        if owned:
            out.free()  # nothing leaks from a failed launch
        raise
    if owned:
        from ..cuda_ml import ConvolutionConfig
        if type(config) is ConvolutionConfig and (precision is None or
                                                  type(precision) is str):
            key = plan_key(x, w, config, bias is None, precision)
            if key not in m.plans:
                common.remember_plan(m, key, fast_plan(m, geom, dtype, prec, dev,
                                                       bias is not None, cfg))
    return out


def _validate(m: Any, x: CudaTensor, w: CudaTensor, config: Any, bias: Optional[CudaTensor],
              precision: Any) -> Tuple[Geometry, CudaDataType, Optional[str], int]:
    """(geometry, dtype, precision, device) after every check; remembered on m by everything
    the checks read (shapes, dtypes, devices, config, precision), so a repeated call skips
    them."""
    try:
        key: Any = (x.shape, w.shape, x.dtype, w.dtype, x.device_id, w.device_id, config,
                    precision, None if bias is None else (bias.shape, bias.dtype,
                                                          bias.device_id))
        hash(key)
    except TypeError:  # an unhashable config or precision: validate every time
        key = None
    memo = m.__dict__.setdefault("_conv2d_plans", {})
    hit = memo.get(key) if key is not None else None
    if hit is not None:
        return hit
    tensors = [x, w] + ([bias] if bias is not None else [])
    geom = plan(x.shape, w.shape, config, None if bias is None else bias.shape)
    dtype = common.same_dtype(*tensors)
    common.require_dtype(x, DTYPES, "conv2d")
    prec = normalize_precision(precision, dtype)
    dev = common.same_device(*tensors)
    if m.gpu:
        _check_limits(geom)
    result = (geom, dtype, prec, dev)
    if key is not None and len(memo) < 4096:
        memo[key] = result
    return result


def _check_out(out: Any, geom: Geometry, dtype: CudaDataType, dev: int,
               tensors: List[CudaTensor]) -> None:
    common.check_tensor(out, "out")
    if out.dtype is not dtype:
        raise DTypeMismatchError(
            f"out has dtype {out.dtype.name_str}, expected {dtype.name_str} (the operands')")
    if tuple(out.shape) != geom.out_shape:
        raise ShapeMismatchError(f"out has shape {out.shape}, expected {geom.out_shape}")
    common.same_device(tensors[0], out)
    if out.nbytes:
        lo, hi = out.ptr, out.ptr + out.nbytes
        for t in tensors:
            if t.nbytes and t.ptr < hi and lo < t.ptr + t.nbytes:
                raise InvalidArgumentError("out overlaps an operand; use a separate tensor")


def _check_limits(g: Geometry) -> None:
    """32-bit index arithmetic inside the kernels: refuse what would overflow it."""
    cgp = -(-max(g.Cg, 1) // 8) * 8
    for what, value in (("output pixels N*P*Q", g.M), ("input pixels N*H*W", g.N * g.H * g.W),
                        ("filter elements K*R*S*Cg (padded)", g.K * g.R * g.S * cgp),
                        ("per-image input elements C*H*W", g.C * g.H * g.W)):
        if value > INT_MAX:
            raise InvalidArgumentError(
                f"conv2d: {what} = {value} is over 2^31 - 1; split the batch")


# -- fallback (NumPy) ------------------------------------------------------------------------
def _round_tf32(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest TF32 value, ties away from zero (what cvt.rna.tf32.f32 does)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(np.isfinite(x), rounded, x).astype(np.float32)


def reference(x: np.ndarray, w: np.ndarray, bias: Optional[np.ndarray], g: Geometry) -> np.ndarray:
    """float64 cross-correlation with stride/padding/dilation/groups (the fallback's math)."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    xp = np.pad(x, ((0, 0), (0, 0), (g.ph, g.ph), (g.pw, g.pw)))
    G, Cg, Kg = g.groups, g.Cg, g.Kg
    xg = xp.reshape(g.N, G, Cg, xp.shape[2], xp.shape[3])
    wg = w.reshape(G, Kg, Cg, g.R, g.S)
    out = np.zeros((g.N, G, Kg, g.P, g.Q), np.float64)
    for r in range(g.R):
        h0 = r * g.dh
        for s in range(g.S):
            w0 = s * g.dw
            patch = xg[:, :, :, h0:h0 + g.sh * (g.P - 1) + 1:g.sh,
                       w0:w0 + g.sw * (g.Q - 1) + 1:g.sw]
            out += np.einsum("ngcpq,gkc->ngkpq", patch, wg[:, :, :, r, s])
    out = out.reshape(g.out_shape)
    if bias is not None:
        out += np.asarray(bias, np.float64).reshape(1, g.K, 1, 1)
    return out


def _fallback(m: Any, x: CudaTensor, w: CudaTensor, bias: Optional[CudaTensor], g: Geometry,
              prec: Optional[str], out: CudaTensor) -> None:
    xh = common.host_array(m, x)
    wh = common.host_array(m, w)
    if prec == "tf32":
        xh, wh = _round_tf32(xh), _round_tf32(wh)
    bh = None if bias is None else common.host_array(m, bias)
    res = reference(xh, wh, bh, g)
    common.write_host(m, res, out)


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8,
            dtypes: Sequence[CudaDataType] = DTYPES) -> int:
    """Compile every conv2d variant for the dtypes in parallel threads (nvcc runs in
    subprocesses); returns how many were compiled. Later calls find them memoized."""
    names = {d.name_str for d in dtypes}
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets
            if p["dtype"] in names]
    return common.compile_all(m, jobs, device_id, workers, get_kernel)
