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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..dtypes import CudaDataType, to_bfloat16_bits
from ..errors import DTypeMismatchError, InvalidArgumentError, ShapeMismatchError
from ..kernels import dtype_params
from ..tensor import CudaTensor, pool_tensor
from . import common

DT = CudaDataType
SIMT_TEMPLATE = "conv2d_simt.cu.j2"
MMA_TEMPLATE = "conv2d_mma.cu.j2"
PREP_TEMPLATE = "conv2d_prep.cu.j2"
DIRECT_TEMPLATE = "conv2d_direct.cu.j2"
TEMPLATES = (SIMT_TEMPLATE, MMA_TEMPLATE, PREP_TEMPLATE, DIRECT_TEMPLATE)
DTYPES = (DT.FLOAT32, DT.FLOAT16, DT.BFLOAT16)
DIRECT_VQ = 4
INT_MAX = 2**31 - 1

# None / "fp32": float32-level accuracy (SIMT or 3xTF32, the autotuner's pick); "ieee": CUDA
# cores only; "tf32": TF32 tensor cores (float32 only)
_PRECISIONS = {None: None, "fp32": "fp32", "highest": "fp32", "ieee": "ieee", "tf32": "tf32"}
PRECISION_NAMES = "None, 'fp32' (alias 'highest'), 'ieee' or 'tf32'"


def simt_config(bm: int, bn: int, bk: int, tm: int, tn: int, slices: int, stages: int,
                min_blocks: int) -> Dict[str, int]:
    """A CUDA-core implicit-GEMM tile config (also ops/conv2d_backward.py's dgrad's)."""
    return {"bm": bm, "bn": bn, "bk": bk, "tm": tm, "tn": tn, "slices": slices,
            "stages": stages, "min_blocks": min_blocks}


def _mma(bm: int, bn: int, bk: int, wm: int, wn: int, stages: int, min_blocks: int,
         x3: bool = False) -> Dict[str, Any]:
    return {"bm": bm, "bn": bn, "bk": bk, "wm": wm, "wn": wn, "stages": stages,
            "min_blocks": min_blocks, "x3": x3}


# -- tile configs ------------------------------------------------------------------------
# SIMT: threads = (bm / tm) * (bn / tn) * slices; shared = slices * stages * bk * (bm + bn) * 4.
S_128x128x8 = simt_config(128, 128, 8, 8, 8, 1, 4, 2)    # 256 threads, 32 KB
S_128x128x16 = simt_config(128, 128, 16, 8, 8, 1, 3, 2)  # 256 threads, 48 KB
S_128x64x8 = simt_config(128, 64, 8, 8, 8, 1, 3, 3)      # 128 threads, 18 KB
S_64x64x8s2 = simt_config(64, 64, 8, 8, 8, 2, 3, 3)      # 64 threads x 2 k-slices, 24 KB
S_64x32x8s2 = simt_config(64, 32, 8, 4, 4, 2, 3, 4)      # 128 threads x 2 k-slices, 18 KB
S_32x32x8s4 = simt_config(32, 32, 8, 4, 4, 4, 3, 4)      # 64 threads x 4 k-slices, 24 KB
SIMT_CONFIGS = (S_128x128x8, S_128x128x16, S_128x64x8, S_64x64x8s2, S_64x32x8s2, S_32x32x8s4)

# mma.sync TF32 (4-byte elements): threads = (bm / wm) * (bn / wn) * 32.
T_128x128x32 = _mma(128, 128, 32, 64, 32, 4, 1)  # 256 threads, 128 KB
T_128x128x32s3 = _mma(128, 128, 32, 64, 32, 3, 2)  # 256 threads, 96 KB, 2 blocks/SM
T_128x64x32 = _mma(128, 64, 32, 64, 32, 4, 2)    # 128 threads, 96 KB
T_64x64x16 = _mma(64, 64, 16, 32, 32, 4, 4)      # 128 threads, 32 KB
T_64x32x16 = _mma(64, 32, 16, 32, 32, 4, 4)      # 64 threads, 24 KB
TF32_CONFIGS = (T_128x128x32, T_128x128x32s3, T_128x64x32, T_64x64x16, T_64x32x16)
# mma.sync 3xTF32 (float32 at the default precision): two accumulator sets, so warp tiles of
# 64 x 32 or 32 x 64 at most and register-limited occupancy. ptxas sm_90 (CUDA 13.0), no
# spills: registers in the comments.
X_128x128x32 = _mma(128, 128, 32, 64, 32, 3, 1, True)    # 256 threads, 96 KB, 232 regs
X_128x128x32s4 = _mma(128, 128, 32, 32, 64, 4, 1, True)  # 256 threads, 128 KB, 232 regs
X_128x64x32 = _mma(128, 64, 32, 64, 32, 3, 2, True)      # 128 threads, 72 KB, 244 regs
X_64x64x16 = _mma(64, 64, 16, 32, 32, 4, 3, True)        # 128 threads, 32 KB, 144 regs
X_64x32x16 = _mma(64, 32, 16, 32, 32, 4, 4, True)        # 64 threads, 24 KB, 152 regs
X3_CONFIGS = (X_128x128x32, X_128x128x32s4, X_128x64x32, X_64x64x16, X_64x32x16)
X3_MIN_CHANNELS = 13   # x3 is offered from Cgp = 16 (one whole k-tile of the 16-deep configs)
# mma.sync float16 / bfloat16.
H_128x128x64 = _mma(128, 128, 64, 64, 32, 3, 2)  # 256 threads, 96 KB, 2 blocks/SM
H_128x128x32 = _mma(128, 128, 32, 64, 32, 4, 2)  # 256 threads, 64 KB
H_128x64x32 = _mma(128, 64, 32, 64, 32, 4, 2)    # 128 threads, 48 KB
H_64x64x32 = _mma(64, 64, 32, 32, 32, 4, 4)      # 128 threads, 32 KB
H_64x32x32 = _mma(64, 32, 32, 32, 32, 4, 4)      # 64 threads, 24 KB
F16_CONFIGS = (H_128x128x64, H_128x128x32, H_128x64x32, H_64x64x32, H_64x32x32)


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set this module renders (CI renders and compiles each)."""
    f32 = dtype_params(DT.FLOAT32)
    simt = [{**f32, **cfg} for cfg in SIMT_CONFIGS]
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


# -- geometry -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Geometry:
    """Validated sizes of one convolution (PyTorch's names: N C H W, K C/g R S, N K P Q)."""

    N: int
    C: int
    H: int
    W: int
    K: int
    R: int
    S: int
    groups: int
    sh: int
    sw: int
    ph: int
    pw: int
    dh: int
    dw: int
    P: int
    Q: int

    @property
    def Cg(self) -> int:
        return self.C // self.groups

    @property
    def Kg(self) -> int:
        return self.K // self.groups

    @property
    def M(self) -> int:
        return self.N * self.P * self.Q

    @property
    def out_shape(self) -> Tuple[int, int, int, int]:
        return (self.N, self.K, self.P, self.Q)

    @property
    def flops(self) -> int:
        return 2 * self.M * self.K * self.Cg * self.R * self.S


def _config_fields(config: Any) -> Tuple[Tuple[int, int], Tuple[int, int], Tuple[int, int],
                                         Tuple[int, int], int]:
    try:
        return (tuple(config.kernel_size), tuple(config.stride), tuple(config.padding),
                tuple(config.dilation), config.groups)
    except (AttributeError, TypeError):
        raise InvalidArgumentError(
            f"config must be a ConvolutionConfig, got {type(config).__name__}") from None


def plan(x_shape: Tuple[int, ...], w_shape: Tuple[int, ...], config: Any,
         bias_shape: Optional[Tuple[int, ...]] = None) -> Geometry:
    """Check shapes against the config and compute the output size (PyTorch's rules)."""
    x_shape, w_shape = tuple(x_shape), tuple(w_shape)
    if len(x_shape) != 4:
        raise InvalidArgumentError(
            f"conv2d input must be 4-D (N, C, H, W), got shape {x_shape}")
    if len(w_shape) != 4:
        raise InvalidArgumentError(
            f"conv2d kernel must be 4-D (K, C/groups, R, S), got shape {w_shape}")
    ksize, stride, padding, dilation, groups = _config_fields(config)
    N, C, H, W = x_shape
    K, Cg, R, S = w_shape
    if (R, S) != ksize:
        raise ShapeMismatchError(
            f"conv2d kernel of shape {w_shape} has spatial size {(R, S)}, but "
            f"config.kernel_size is {ksize}")
    if C % groups or K % groups:
        raise InvalidArgumentError(
            f"groups={groups} must divide both the input channels ({C}, input shape "
            f"{x_shape}) and the output channels ({K}, kernel shape {w_shape})")
    if Cg * groups != C:
        raise ShapeMismatchError(
            f"conv2d channel mismatch: input of shape {x_shape} has {C} channels, but the "
            f"kernel of shape {w_shape} expects {Cg} x groups={groups} = {Cg * groups}")
    sh, sw = stride
    ph, pw = padding
    dh, dw = dilation
    eff = (dh * (R - 1) + 1, dw * (S - 1) + 1)
    if ph > eff[0] or pw > eff[1]:
        raise InvalidArgumentError(
            f"conv2d padding {padding} is larger than the kernel {ksize} (dilated extent "
            f"{eff}); input shape {x_shape}")
    P = (H + 2 * ph - eff[0]) // sh + 1
    Q = (W + 2 * pw - eff[1]) // sw + 1
    if P <= 0 or Q <= 0:
        raise InvalidArgumentError(
            f"conv2d output size {(P, Q)} is not positive: input {x_shape} (H, W = {(H, W)}), "
            f"padding {padding}, kernel {ksize} with dilation {dilation} (extent {eff}), "
            f"stride {stride}")
    if bias_shape is not None and tuple(bias_shape) != (K,):
        raise ShapeMismatchError(
            f"conv2d bias must have shape ({K},) for a kernel of shape {w_shape}, got "
            f"{tuple(bias_shape)}")
    return Geometry(N, C, H, W, K, R, S, groups, sh, sw, ph, pw, dh, dw, P, Q)


def normalize_precision(precision: Any, dtype: CudaDataType) -> Optional[str]:
    """None / 'fp32' / 'highest' -> float32-level accuracy (float32: SIMT or 3xTF32);
    'ieee' -> CUDA cores only for float32; 'tf32' -> TF32 (float32 only)."""
    key = precision.lower() if isinstance(precision, str) else precision
    if not (key is None or isinstance(key, str)) or key not in _PRECISIONS:
        raise InvalidArgumentError(
            f"precision must be {PRECISION_NAMES}, got {precision!r}")
    prec = _PRECISIONS[key]
    if prec == "tf32" and dtype is not DT.FLOAT32:
        raise InvalidArgumentError(
            f"precision='tf32' applies to float32 operands only, got {dtype.name_str}")
    return prec


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
        try:  # the per-call plan (ops/common.py remember_plan)
            fast = m.plans.get(_plan_key(x, w, config, bias is None, precision))
        except (AttributeError, TypeError):  # not a config, unhashable fields: the checks
            fast = None
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
        cfg = _launch(m, x, w, bias, geom, dtype, prec, out, dev)
    except BaseException:
        if owned:
            out.free()  # nothing leaks from a failed launch
        raise
    if owned:
        from ..cuda_ml import ConvolutionConfig
        if type(config) is ConvolutionConfig and (precision is None or
                                                  type(precision) is str):
            key = _plan_key(x, w, config, bias is None, precision)
            if key not in m.plans:
                common.remember_plan(m, key, _fast_plan(m, geom, dtype, prec, dev,
                                                        bias is not None, cfg))
    return out


def _plan_key(x: CudaTensor, w: CudaTensor, config: Any, no_bias: bool,
              precision: Any) -> tuple:
    """The plan cache key of a conv2d: the operands' shapes, dtypes and devices, the
    config's type and fields, bias presence (the bias itself is checked by the plan) and
    precision as given."""
    return ("conv2d", x.shape, x.dtype, x.device_id, w.shape, w.dtype, w.device_id,
            type(config), config.kernel_size, config.stride, config.padding, config.dilation,
            config.groups, no_bias, precision)


def _fast_plan(m: Any, g: Geometry, dtype: CudaDataType, prec: Optional[str], dev: int,
               has_bias: bool, cfg: Optional[Dict[str, int]]) -> Any:
    """The per-call plan of conv2d for one key (ops/common.py remember_plan), made after
    the general path has launched (so after the autotuner's pick, cfg): the bias checked as
    the general path would (a mismatch returns None: the general path raises), the result
    allocated, and the general path's launches prepared, with its temporaries: direct one
    launch; simt the filter repack into wt, the GEMM (out_vec from the result's pointer),
    wt released; mma the input repack into xt (one launch per max-grid-z images), the filter
    repack into wt, the GEMM, wt and xt released. A failed launch frees the result, as
    conv2d does."""
    size = g.N * g.K * g.P * g.Q
    nbytes = size * dtype.itemsize
    out_shape, es = g.out_shape, dtype.itemsize
    kshape = (g.K,)
    prep = m.backend.prepare_launch
    pool = m.backend.memory_pools[dev]
    alloc, release = pool.allocate_current, pool.release
    hb = int(has_bias)
    geo = (g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, g.M)
    fam = family(g, dtype, prec)
    if fam != "direct":
        assert cfg is not None
        fam = config_family(cfg)   # float32's candidates hold both (x3_fits)
    args: Tuple[int, ...]
    wargs: Tuple[int, ...]
    if fam == "direct":
        total = g.N * g.K * g.P * -(-g.Q // DIRECT_VQ)
        go = prep(_kernel(m, DIRECT_TEMPLATE, dev, {**dtype_params(dtype), "vq": DIRECT_VQ}),
                  (_grid_1d(m, total, dev), 1, 1), (256, 1, 1), 0, dev)
        args = (g.C, g.H, g.W, g.Cg, g.Kg, g.K, g.P, g.Q, g.R, g.S, *geo[:-1], total)
    elif fam == "simt":
        kgp = -(-g.Kg // 4) * 4
        wt_size = g.groups * g.R * g.S * g.Cg * kgp
        wt_bytes = wt_size * es
        wprep = prep(_kernel(m, PREP_TEMPLATE, dev, {**dtype_params(dtype),
                                                     "kind": "weight_rsck"}),
                     (_grid_1d(m, wt_size, dev), 1, 1), (256, 1, 1), 0, dev)
        wargs = (g.Kg, g.Cg, g.R * g.S, kgp, wt_size)
        assert cfg is not None
        threads = (cfg["bm"] // cfg["tm"]) * (cfg["bn"] // cfg["tn"]) * cfg["slices"]
        go = prep(_kernel(m, SIMT_TEMPLATE, dev, {**dtype_params(DT.FLOAT32), **cfg}),
                  (-(-g.M // cfg["bm"]), -(-g.Kg // cfg["bn"]), g.groups), (threads, 1, 1), 0,
                  dev)
        args = (g.C, g.H, g.W, g.Cg, g.Kg, kgp, g.K, g.P, g.Q, g.R, g.S, *geo)
    else:
        cgp = padded_channels(g, dtype)
        ct, hw = g.groups * cgp, g.H * g.W
        xt_bytes = g.N * hw * ct * es
        ikernel = _kernel(m, PREP_TEMPLATE, dev, {**dtype_params(dtype), "kind": "input_nhwc"})
        max_z = m.backend.get_device_info(dev).max_grid_dims[2]
        iprep = [(prep(ikernel, (-(-hw // 32), -(-ct // 32), min(max_z, g.N - n0)), (32, 8, 1),
                       0, dev), n0 * g.C * hw * es, n0 * hw * ct * es)
                 for n0 in range(0, g.N, max_z)]
        iargs = (g.C, hw, g.Cg, cgp, ct)
        wt_size = g.K * g.R * g.S * cgp
        wt_bytes = wt_size * es
        wprep = prep(_kernel(m, PREP_TEMPLATE, dev, {**dtype_params(dtype),
                                                     "kind": "weight_krsc"}),
                     (_grid_1d(m, wt_size, dev), 1, 1), (256, 1, 1), 0, dev)
        wargs = (g.Cg, g.R * g.S, cgp, wt_size)
        assert cfg is not None
        threads = (cfg["bm"] // cfg["wm"]) * (cfg["bn"] // cfg["wn"]) * 32
        go = prep(_kernel(m, MMA_TEMPLATE, dev, {**dtype_params(dtype), **cfg}),
                  (-(-g.M // cfg["bm"]), -(-g.Kg // cfg["bn"]), g.groups), (threads, 1, 1),
                  mma_shared_bytes(cfg, dtype), dev)
        args = (g.H, g.W, ct, cgp, g.Kg, g.K, g.P, g.Q, g.R, g.S, *geo)

    def run(x: CudaTensor, w: CudaTensor, bias: Any) -> Optional[CudaTensor]:
        px, pw = x._ptr, w._ptr
        if px is None or pw is None or x.stream is not None or w.stream is not None:
            return None
        pb = common.plan_pointer(bias, kshape, dtype, dev) if has_bias else 0
        if pb is None:
            return None
        out = pool_tensor(out_shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        po = out._ptr
        try:
            if fam == "direct":
                go(px, pw, pb, po, hb, *args)
            elif fam == "simt":
                wt = alloc(wt_bytes)
                try:
                    pwt = int(wt)
                    wprep(pw, pwt, *wargs)
                    go(px, pwt, pb, po, hb, int(po % 16 == 0), *args)
                finally:
                    release(wt)  # as the general path's wt.free()
            else:
                xt = alloc(xt_bytes)
                try:
                    pxt = int(xt)
                    for ilaunch, x_off, xt_off in iprep:
                        ilaunch(px + x_off, pxt + xt_off, *iargs)
                    wt = alloc(wt_bytes)
                    try:
                        pwt = int(wt)
                        wprep(pw, pwt, *wargs)
                        go(pxt, pwt, pb, po, hb, *args)
                    finally:
                        release(wt)
                finally:
                    release(xt)
        except BaseException:
            out.free()  # nothing leaks from a failed launch
            raise
        return out
    return run


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
    _write_host(m, out, res)


def _write_host(m: Any, out: CudaTensor, values: np.ndarray) -> None:
    if out.dtype is DT.BFLOAT16:
        host = to_bfloat16_bits(values.astype(np.float32)).reshape(out.shape)
    else:
        host = np.ascontiguousarray(values, dtype=out.dtype.numpy_dtype)
    m.backend.copy_to_device(host, out)


# -- GPU ------------------------------------------------------------------------------------
def family(g: Geometry, dtype: CudaDataType, prec: Optional[str]) -> str:
    """'direct', 'simt' or 'mma' for this convolution ('simt': float32 except TF32, whose
    candidates include the 3xTF32 mma configs where `x3_fits`)."""
    if g.Kg < 8 or g.Cg <= 1 or g.H * g.W == 0:
        return "direct"
    if dtype is DT.FLOAT32 and prec != "tf32":
        return "simt"
    return "mma"


def x3_fits(g: Geometry, dtype: CudaDataType, prec: Optional[str]) -> bool:
    """Whether the autotuner also times the 3xTF32 configs: float32 at the default precision
    (not 'ieee', not 'tf32'), the GEMM kernels (not direct), and Cg >= X3_MIN_CHANNELS (with
    fewer, the channel padding of the mma's k-tiles would multiply 3x the work again)."""
    return (dtype is DT.FLOAT32 and prec in (None, "fp32") and
            family(g, dtype, prec) == "simt" and g.Cg >= X3_MIN_CHANNELS)


def config_family(cfg: Dict[str, Any]) -> str:
    """'mma' or 'simt': which kernel (and repacks) a tile config runs."""
    return "mma" if "wm" in cfg else "simt"


def padded_channels(g: Geometry, dtype: CudaDataType) -> int:
    """Cg rounded up to whole 16-byte chunks (the mma kernel's channel stride per group)."""
    epc = 16 // dtype.itemsize
    return -(-g.Cg // epc) * epc


def _tiles(g: Geometry, cfg: Dict[str, int]) -> int:
    return -(-g.M // cfg["bm"]) * -(-g.Kg // cfg["bn"]) * g.groups


def candidates(g: Geometry, dtype: CudaDataType, prec: Optional[str],
               sm_count: int) -> List[Dict[str, Any]]:
    """The tile configs the autotuner chooses from: by output channels per group, then by
    how many blocks the large tile would give (two waves or more keep the large tiles);
    float32 at the default precision: the SIMT configs, then where `x3_fits` the 3xTF32
    ones (each timed with its own repacks: the fastest wins)."""
    fam = family(g, dtype, prec)
    if fam == "simt":
        if g.Kg <= 32:
            simt = [S_64x32x8s2, S_32x32x8s4]
        elif g.Kg <= 64:
            simt = [S_128x64x8, S_64x64x8s2, S_64x32x8s2]
        elif _tiles(g, S_128x128x8) >= 2 * sm_count:
            simt = [S_128x128x8, S_128x128x16, S_128x64x8]
        else:
            simt = [S_128x64x8, S_64x64x8s2, S_128x128x8]
        return simt + (_mma_candidates(g, dtype, X3_CONFIGS, sm_count)
                       if x3_fits(g, dtype, prec) else [])
    return _mma_candidates(g, dtype, TF32_CONFIGS if dtype is DT.FLOAT32 else F16_CONFIGS,
                           sm_count)


def _mma_candidates(g: Geometry, dtype: CudaDataType, table: Sequence[Dict[str, Any]],
                    sm_count: int) -> List[Dict[str, Any]]:
    """The mma configs of one table (big, big2, mid, small, thin) for this geometry, those
    whose k-tile fits the padded channels (else the shallowest)."""
    big, big2, mid, small, thin = table
    if g.Kg <= 32:
        cands = [thin, small]
    elif g.Kg <= 64:
        cands = [mid, small]
    elif _tiles(g, big) >= 2 * sm_count:
        cands = [big, big2, mid]
    else:
        cands = [mid, small, big]
    cgp = padded_channels(g, dtype)
    fitting = [c for c in cands if c["bk"] <= cgp]
    return fitting or [min(cands, key=lambda c: c["bk"])]


def _bucket(v: int) -> int:
    return max(0, int(v) - 1).bit_length()


def _kernel(m: Any, template: str, dev: int, params: Dict[str, Any]) -> Any:
    """m.kernel(template, dev, **params), memoized on m (ops/common.py memo_kernel)."""
    return common.memo_kernel(m, "_conv2d_kernels", template, dev, params)


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8,
            dtypes: Sequence[CudaDataType] = DTYPES) -> int:
    """Compile every conv2d variant for the dtypes in parallel threads (nvcc runs in
    subprocesses); returns how many were compiled. Later calls find them memoized."""
    names = {d.name_str for d in dtypes}
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets
            if p["dtype"] in names]
    return common.compile_all(m, jobs, device_id, workers, _kernel)


def shape_key(g: Geometry, dtype: CudaDataType, prec: Optional[str]) -> List[Any]:
    """The autotuner's shape class: powers of two of the GEMM sizes, and groups > 1."""
    return [dtype.name_str, prec or "fp32", _bucket(g.M), _bucket(g.Kg),
            _bucket(g.Cg * g.R * g.S), g.groups > 1]


def _launch(m: Any, x: CudaTensor, w: CudaTensor, bias: Optional[CudaTensor], g: Geometry,
            dtype: CudaDataType, prec: Optional[str], out: CudaTensor,
            dev: int) -> Optional[Dict[str, Any]]:
    """The launches of one convolution; returns the tile config used (None: direct)."""
    fam = family(g, dtype, prec)
    if fam == "direct":
        run_direct(m, x, w, bias, g, out, dev)
        return None
    memo = m.__dict__.setdefault("_conv2d_configs", {})
    mkey = (g, dtype, prec, dev)
    cfg = memo.get(mkey)
    if fam == "simt" and x3_fits(g, dtype, prec):
        # SIMT and 3xTF32 configs: each timed whole, with the repacks its kernel needs
        def run_any(c: Dict[str, Any]) -> None:
            run_config(m, c, x, w, bias, g, out, dev)
        if cfg is None:
            cfg = memo[mkey] = _choose(m, "conv2d_x3simt", g, dtype, prec, run_any, dev)
        run_any(cfg)
        return cfg
    if fam == "simt":
        wt = prepare_weight_simt(m, w, g, dev)
        try:
            def run(c: Dict[str, int]) -> None:
                run_simt(m, c, x, wt, bias, g, out, dev)
            if cfg is None:
                cfg = memo[mkey] = _choose(m, "conv2d_simt", g, dtype, prec, run, dev)
            run(cfg)
        finally:
            wt.free()
        return cfg
    xt = prepare_input_mma(m, x, g, dev)
    try:
        wt = prepare_weight_mma(m, w, g, dev)
        try:
            def run(c: Dict[str, int]) -> None:
                run_mma(m, c, xt, wt, bias, g, out, dev)
            if cfg is None:
                cfg = memo[mkey] = _choose(m, "conv2d_mma", g, dtype, prec, run, dev)
            run(cfg)
        finally:
            wt.free()
    finally:
        xt.free()  # back to the pool; later work on this stream is ordered after the launch
    return cfg


def run_config(m: Any, cfg: Dict[str, Any], x: CudaTensor, w: CudaTensor,
               bias: Optional[CudaTensor], g: Geometry, out: CudaTensor, dev: int) -> None:
    """One tile config (SIMT or mma, any dtype it renders for) over the whole output, with
    the repacks its kernel needs; the workspaces go back to the pool after the launch."""
    if config_family(cfg) == "simt":
        wt = prepare_weight_simt(m, w, g, dev)
        try:
            run_simt(m, cfg, x, wt, bias, g, out, dev)
        finally:
            wt.free()
        return
    xt = prepare_input_mma(m, x, g, dev)
    try:
        wt = prepare_weight_mma(m, w, g, dev)
        try:
            run_mma(m, cfg, xt, wt, bias, g, out, dev)
        finally:
            wt.free()
    finally:
        xt.free()


def _choose(m: Any, op: str, g: Geometry, dtype: CudaDataType, prec: Optional[str],
            run: Any, dev: int) -> Dict[str, Any]:
    """The tile config for this geometry: the autotuner's pick among the candidates."""
    info = m.backend.get_device_info(dev)
    if g.groups > info.max_grid_dims[2] or -(-g.Kg // 32) > info.max_grid_dims[1]:
        raise InvalidArgumentError(
            f"conv2d: groups={g.groups} with {g.Kg} output channels per group is over the "
            f"grid limits {info.max_grid_dims}")
    cands = candidates(g, dtype, prec, info.multiprocessor_count)
    if len(cands) == 1:
        return cands[0]
    return m.autotuner.pick(op, shape_key(g, dtype, prec), cands, run, device_id=dev)


def _grid_1d(m: Any, n: int, dev: int, block: int = 256) -> int:
    sms = m.backend.get_device_info(dev).multiprocessor_count
    return common.grid_1d(n, block, sms)


def _bias_args(bias: Optional[CudaTensor]) -> Tuple[Any, int]:
    return (bias, 1) if bias is not None else (0, 0)


def run_direct(m: Any, x: CudaTensor, w: CudaTensor, bias: Optional[CudaTensor], g: Geometry,
               out: CudaTensor, dev: int) -> None:
    """The direct kernel over the whole output."""
    kernel = _kernel(m, DIRECT_TEMPLATE, dev, {**dtype_params(x.dtype), "vq": DIRECT_VQ})
    total = g.N * g.K * g.P * -(-g.Q // DIRECT_VQ)
    b, has_bias = _bias_args(bias)
    m.backend.launch_kernel(kernel.name, (_grid_1d(m, total, dev), 1, 1), x, w, b, out,
                            has_bias, g.C, g.H, g.W, g.Cg, g.Kg, g.K, g.P, g.Q, g.R, g.S,
                            g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, total,
                            block_size=(256, 1, 1), device_id=dev)


def prepare_weight_simt(m: Any, w: CudaTensor, g: Geometry, dev: int) -> CudaTensor:
    """Filter -> [G][R*S][Cg][Kgp] float32 (Kgp = Kg rounded up to 4, zero-filled)."""
    kgp = -(-g.Kg // 4) * 4
    wt = m.backend.empty((g.groups * g.R * g.S * g.Cg * kgp,), w.dtype, dev)
    try:
        kernel = _kernel(m, PREP_TEMPLATE, dev, {**dtype_params(w.dtype), "kind": "weight_rsck"})
        total = wt.size
        m.backend.launch_kernel(kernel.name, (_grid_1d(m, total, dev), 1, 1), w, wt, g.Kg,
                                g.Cg, g.R * g.S, kgp, total, block_size=(256, 1, 1),
                                device_id=dev)
    except BaseException:
        wt.free()
        raise
    return wt


def run_simt(m: Any, cfg: Dict[str, int], x: CudaTensor, wt: CudaTensor,
             bias: Optional[CudaTensor], g: Geometry, out: CudaTensor, dev: int) -> None:
    """One SIMT config over the whole output (wt from prepare_weight_simt)."""
    kernel = _kernel(m, SIMT_TEMPLATE, dev, {**dtype_params(DT.FLOAT32), **cfg})
    threads = (cfg["bm"] // cfg["tm"]) * (cfg["bn"] // cfg["tn"]) * cfg["slices"]
    grid = (-(-g.M // cfg["bm"]), -(-g.Kg // cfg["bn"]), g.groups)
    kgp = -(-g.Kg // 4) * 4
    b, has_bias = _bias_args(bias)
    out_vec = int(out.ptr % 16 == 0)
    m.backend.launch_kernel(kernel.name, grid, x, wt, b, out, has_bias, out_vec, g.C, g.H,
                            g.W, g.Cg, g.Kg, kgp, g.K, g.P, g.Q, g.R, g.S, g.sh, g.sw, g.ph,
                            g.pw, g.dh, g.dw, g.M, block_size=(threads, 1, 1), device_id=dev)


def prepare_input_mma(m: Any, x: CudaTensor, g: Geometry, dev: int) -> CudaTensor:
    """Input -> NHWC with each group's channels padded to Cgp (zeros), in x's dtype."""
    cgp = padded_channels(g, x.dtype)
    ct = g.groups * cgp
    hw = g.H * g.W
    xt = m.backend.empty((g.N * hw * ct,), x.dtype, dev)
    try:
        kernel = _kernel(m, PREP_TEMPLATE, dev, {**dtype_params(x.dtype), "kind": "input_nhwc"})
        max_z = m.backend.get_device_info(dev).max_grid_dims[2]
        es = x.dtype.itemsize
        for n0 in range(0, g.N, max_z):
            nb = min(max_z, g.N - n0)
            src = x if n0 == 0 else x.ptr + n0 * g.C * hw * es
            dst = xt if n0 == 0 else xt.ptr + n0 * hw * ct * es
            m.backend.launch_kernel(kernel.name, (-(-hw // 32), -(-ct // 32), nb), src, dst,
                                    g.C, hw, g.Cg, cgp, ct, block_size=(32, 8, 1),
                                    device_id=dev)
    except BaseException:
        xt.free()
        raise
    return xt


def prepare_weight_mma(m: Any, w: CudaTensor, g: Geometry, dev: int) -> CudaTensor:
    """Filter -> [K][R*S][Cgp] (channels padded to 16 bytes with zeros), in w's dtype."""
    cgp = padded_channels(g, w.dtype)
    wt = m.backend.empty((g.K * g.R * g.S * cgp,), w.dtype, dev)
    try:
        kernel = _kernel(m, PREP_TEMPLATE, dev, {**dtype_params(w.dtype), "kind": "weight_krsc"})
        total = wt.size
        m.backend.launch_kernel(kernel.name, (_grid_1d(m, total, dev), 1, 1), w, wt, g.Cg,
                                g.R * g.S, cgp, total, block_size=(256, 1, 1), device_id=dev)
    except BaseException:
        wt.free()
        raise
    return wt


def mma_shared_bytes(cfg: Dict[str, int], dtype: CudaDataType) -> int:
    return cfg["stages"] * (cfg["bm"] + cfg["bn"]) * cfg["bk"] * dtype.itemsize


def run_mma(m: Any, cfg: Dict[str, int], xt: CudaTensor, wt: CudaTensor,
            bias: Optional[CudaTensor], g: Geometry, out: CudaTensor, dev: int) -> None:
    """One mma config over the whole output (xt, wt from the prepare_*_mma functions)."""
    dtype = out.dtype
    kernel = _kernel(m, MMA_TEMPLATE, dev, {**dtype_params(dtype), **cfg})
    threads = (cfg["bm"] // cfg["wm"]) * (cfg["bn"] // cfg["wn"]) * 32
    grid = (-(-g.M // cfg["bm"]), -(-g.Kg // cfg["bn"]), g.groups)
    cgp = padded_channels(g, dtype)
    b, has_bias = _bias_args(bias)
    m.backend.launch_kernel(kernel.name, grid, xt, wt, b, out, has_bias, g.H, g.W,
                            g.groups * cgp, cgp, g.Kg, g.K, g.P, g.Q, g.R, g.S, g.sh, g.sw,
                            g.ph, g.pw, g.dh, g.dw, g.M, block_size=(threads, 1, 1),
                            shared_mem=mma_shared_bytes(cfg, dtype), device_id=dev)
