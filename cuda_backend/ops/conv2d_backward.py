"""Gradients of conv2d (ops/conv2d.py): grad_input (dgrad), grad_kernel (wgrad), grad_bias.

`conv2d_backward(m, grad_out, x, w, config, has_bias, precision)` returns the three for
`conv2d(x, w, config, bias, precision)`: every stride, padding, dilation and groups the
forward accepts; float32, float16 and bfloat16.

- dgrad, `conv2d_dgrad.cu.j2`: an implicit GEMM over (input pixels of one stride phase) x
  (C/groups) with reduction (K/groups)*R*S, true FP32 on CUDA cores, cp.async multistage
  tiles. grad_out is gathered with the inverse mapping p = (h + ph - r*dh) / sh; the pixels
  are split into the sh*sw stride phases so that each block runs over the filter taps that
  reach its phase only (no zero-upsampled tensor, no predicated-off multiply-adds).
  Where the forward's tensor-core kernels fit (stride 1 with float16 / bfloat16, or
  precision="tf32", or float32 at the default precision where its 3xTF32 configs fit:
  conv2d.x3_fits, the autotuner choosing between them and its SIMT ones) or its direct
  kernel does (fewer than 8 input channels per group), the data gradient at stride 1 is
  conv2d(grad_out, flipped filter) with padding dilation*(kernel - 1) - padding, run by
  ops/conv2d.py; precision="ieee" keeps the dgrad kernel.
- wgrad, `conv2d_wgrad.cu.j2`: an implicit GEMM (K/groups) x ((C/groups)*R*S) with
  reduction N*P*Q, true FP32; the long reduction is split over blocks (float32 partial tiles)
  and `conv2d_grad_aux.cu.j2` (splitk_sum) adds the splits in a fixed order: deterministic,
  no float atomics. float32 at precision None / "fp32" / "tf32" where `wgrad_x3_fits`: the
  same GEMM on tensor cores, `conv2d_wgrad_mma.cu.j2` (3xTF32, float32-level accuracy, both
  operands gathered from NCHW; configs WGRAD_X3_CONFIGS), timed by the autotuner beside the
  SIMT configs; its splits are at most X3_MAX_CHUNK pixels (the mma's accumulation
  truncates: shorter sums in the accumulators, the rest in splitk_sum's rounded adds).
  precision="ieee" and float16 / bfloat16 keep the SIMT kernel.
- grad_bias: the sum of grad_out over N, P, Q, in float32 partials per (channel, chunk)
  (bias_partial) added in order by splitk_sum.
float16 / bfloat16 operands go to the CUDA-core GEMMs as float32 copies (to_float, and the
filter repack converts); results round once to the dtype. precision="tf32" lets the stride-1
data gradient run on TF32 tensor cores; wgrad, the bias and strided dgrad stay true FP32
(allowed: TF32 is a permission, not a promise of rounding). Tile configs are short lists
timed once per shape class by the Autotuner (wgrad's with the number of splits, from
waves of blocks per SM). Each geometry's launches are built once into a `Program`
(kernels, grids, workspaces); the per-call plan of a key (`m.plans[("conv2d_backward", ...)]`,
made after a first general call) runs it with prepared launches. output_mask (as
aten.convolution_backward's) leaves out the gradients not needed. Fallback mode computes
`reference` in float64 (exact for every precision) and rounds once.

Floor and target (the models issue): at (32,64,128,128) x (128,64,3,3), padding 1, each of
dgrad and wgrad is 2*N*K*C*R*S*P*Q = 77.3 GFLOP; at the measured FP32 peak of about 51
TFLOP/s on the H100's CUDA cores (about 60 on the H200) that is 1.52 ms (1.29 ms on the
H200), and the target is 0.8x cuDNN's float32 time for each. Extra memory traffic on that
shape: wgrad's partials (about 105 splits x 295 KB written and read once) and the bias sum
(one read of grad_out, 268 MB, about 0.1 ms). 3xTF32 wgrad there: 3 mma per product, 232
GFLOP of TF32 mma.sync: 0.47 ms at the H100's dense TF32 peak (~495 TFLOP/s), 1.09 ms at the
~213 TFLOP/s mma.sync rate the 3xTF32 linear layer measured (perf/NOTES.md); with the
gather's integer work and 128 splits of 4096 pixels (38 MB of partials) predicted 1.2-1.4 ms,
target <= 1.87 ms (0.8x cuDNN's 1.498).

The parts: ops/conv2d_backward_configs.py (templates, tile configs, grids, splits and the
candidates), conv2d_backward_program.py (the programs of launches, the autotuner's picks and
the per-call plan); this module holds the entry point, its checks, the float64 reference and
the op family's contract (registry.CONTRACT).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..kernels import dtype_params
from ..tensor import CudaTensor
from . import common
from .common import normalize_precision
from . import conv2d as fwd
from .conv2d_backward_configs import (AUX_KINDS, AUX_TEMPLATE, DGRAD_CONFIGS,
                                      DGRAD_KCRS_CONFIGS, DGRAD_TEMPLATE, HALF, INT_MAX,
                                      WGRAD_CONFIGS, WGRAD_TEMPLATE, WGRAD_X3_CONFIGS,
                                      WGRAD_X3_TEMPLATE)
from .conv2d_backward_configs import candidates  # noqa: F401  (registry.CONTRACT, autotuned)
from .conv2d_backward_program import get_kernel, make_plan, program
from .conv2d_configs import DTYPES
from .conv2d_geometry import Geometry, plan
from .conv2d_launch import cached_plan

DT = CudaDataType
# the forward's templates run the stride-1 data gradient on tensor cores (see above)
TEMPLATES = (DGRAD_TEMPLATE, WGRAD_TEMPLATE, WGRAD_X3_TEMPLATE, AUX_TEMPLATE) + fwd.TEMPLATES


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set this module renders: dgrad per grad_input dtype and config (the
    KCRS ones for float32), wgrad per config, SIMT and 3xTF32 (float32 operands and
    partials), the auxiliary kernels per dtype."""
    dgrad = [{**dtype_params(dt), **cfg} for dt in DTYPES for cfg in DGRAD_CONFIGS] + \
        [{**dtype_params(DT.FLOAT32), **cfg} for cfg in DGRAD_KCRS_CONFIGS]
    wgrad = [{**dtype_params(DT.FLOAT32), **cfg} for cfg in WGRAD_CONFIGS]
    wgrad_x3 = [{**dtype_params(DT.FLOAT32), **cfg} for cfg in WGRAD_X3_CONFIGS]
    aux = []
    for dt in DTYPES:
        for kind in AUX_KINDS:
            if kind == "to_float" and dt not in HALF:
                continue
            aux.append({**dtype_params(dt), "kind": kind})
    return {DGRAD_TEMPLATE: dgrad, WGRAD_TEMPLATE: wgrad, WGRAD_X3_TEMPLATE: wgrad_x3,
            AUX_TEMPLATE: aux}

def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8,
            dtypes: Sequence[CudaDataType] = DTYPES) -> int:
    """Compile this module's kernels for the dtypes in parallel threads (wgrad's float32
    kernels serve every dtype); returns how many were compiled (0 in fallback mode). The
    forward's kernels, which the stride-1 data gradient may use, warm with ops/conv2d.py."""
    names = {d.name_str for d in dtypes}
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets
            if p["dtype"] in names or t == WGRAD_TEMPLATE]
    return common.compile_all(m, jobs, device_id, workers, get_kernel)


# -- the float64 reference -------------------------------------------------------------------
def reference(grad_out: Any, x: Any, w: Any, g: Geometry, has_bias: bool = False
              ) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """(grad_input, grad_kernel, grad_bias or None) in float64 for conv2d.reference's
    cross-correlation with geometry g (conv2d.plan): per filter tap, grad_input is the
    adjoint's scatter of grad_out through the filter, grad_kernel the contraction of grad_out
    with the tap's input patch."""
    go = np.asarray(grad_out, np.float64)
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    G, Cg, Kg = g.groups, g.Cg, g.Kg
    xp = np.pad(x, ((0, 0), (0, 0), (g.ph, g.ph), (g.pw, g.pw)))
    xg = xp.reshape(g.N, G, Cg, xp.shape[2], xp.shape[3])
    gog = go.reshape(g.N, G, Kg, g.P, g.Q)
    wg = w.reshape(G, Kg, Cg, g.R, g.S)
    gxp = np.zeros_like(xg)
    gw = np.zeros((G, Kg, Cg, g.R, g.S), np.float64)
    npq = g.N * g.P * g.Q
    # per group, grad_out as a (Kg, N*P*Q) matrix: each tap is then two BLAS products
    got = [np.ascontiguousarray(gog[:, gi].transpose(1, 0, 2, 3)).reshape(Kg, npq)
           for gi in range(G)]
    for r in range(g.R):
        h0 = r * g.dh
        hs = slice(h0, h0 + g.sh * (g.P - 1) + 1, g.sh)
        for s in range(g.S):
            w0 = s * g.dw
            ws = slice(w0, w0 + g.sw * (g.Q - 1) + 1, g.sw)
            for gi in range(G):
                patch = np.ascontiguousarray(xg[:, gi, :, hs, ws].transpose(1, 0, 2, 3))
                gw[gi, :, :, r, s] = got[gi] @ patch.reshape(Cg, npq).T
                gxp[:, gi, :, hs, ws] += (wg[gi, :, :, r, s].T @ got[gi]).reshape(
                    Cg, g.N, g.P, g.Q).transpose(1, 0, 2, 3)
    gx = gxp[:, :, :, g.ph:g.ph + g.H, g.pw:g.pw + g.W].reshape(g.N, g.C, g.H, g.W)
    gb = go.sum(axis=(0, 2, 3)) if has_bias else None
    return np.ascontiguousarray(gx), gw.reshape(g.K, Cg, g.R, g.S), gb


# -- entry point ----------------------------------------------------------------------------
def conv2d_backward(m: Any, grad_out: CudaTensor, x: CudaTensor, w: CudaTensor, config: Any,
                    has_bias: bool = False, precision: Optional[str] = None,
                    output_mask: Optional[Tuple[bool, bool, bool]] = None
                    ) -> Tuple[Optional[CudaTensor], Optional[CudaTensor], Optional[CudaTensor]]:
    """(grad_input, grad_kernel, grad_bias) of conv2d(x, w, config, bias, precision) for
    grad_out = d loss / d output, shape (N, K, P, Q); grad_bias only when has_bias.
    output_mask (aten.convolution_backward's): which of the three to compute, None for all;
    the others come back as None."""
    if type(grad_out) is CudaTensor:
        # the per-call plan (ops/conv2d_backward_program.py make_plan)
        fast = cached_plan(m, _plan_key, grad_out, x, w, config, has_bias, precision,
                           output_mask)
        if fast is not None and m.backend.direct_launch(grad_out.device_id):
            res = fast(grad_out, x, w)
            if res is not None:
                return res
                return res
    g, dtype, prec, dev = _validate(m, grad_out, x, w, config, precision)
    parts = _parts(has_bias, output_mask)
    if not m.gpu:
        return _fallback(m, grad_out, x, w, g, parts, dtype, dev)
    prog = program(m, grad_out, x, w, g, dtype, prec, dev, parts)
    res = prog.run(m, grad_out, x, w, direct=False)
    from ..cuda_ml import ConvolutionConfig
    if type(config) is ConvolutionConfig and (precision is None or type(precision) is str):
        key = _plan_key(grad_out, x, w, config, has_bias, precision, output_mask)
        if key not in m.plans:
            common.remember_plan(m, key, make_plan(m, prog))
    return res


def _parts(has_bias: Any, output_mask: Any) -> Tuple[str, ...]:
    """The parts to compute ("dgrad", "wgrad", "bias") from has_bias and output_mask."""
    if not isinstance(has_bias, (bool, np.bool_)):
        raise InvalidArgumentError(f"has_bias must be a bool, got {has_bias!r}")
    mask: Tuple[Any, ...] = (True, True, True)
    if output_mask is not None:
        try:
            mask = tuple(output_mask)
        except TypeError:
            mask = ()
        if len(mask) != 3 or not all(isinstance(v, (bool, np.bool_)) for v in mask):
            raise InvalidArgumentError(
                f"output_mask must be None or three bools (grad_input, grad_kernel, "
                f"grad_bias), got {output_mask!r}")
    return tuple(p for p, on in zip(("dgrad", "wgrad", "bias"),
                                    (mask[0], mask[1], mask[2] and has_bias)) if on)


def _plan_key(go: CudaTensor, x: Any, w: Any, config: Any, has_bias: Any, precision: Any,
              output_mask: Any) -> tuple:
    """The plan cache key: the operands' shapes, dtypes and devices, the config's type and
    fields, has_bias, precision and output_mask as given."""
    return ("conv2d_backward", go.shape, go.dtype, go.device_id, x.shape, x.dtype,
            x.device_id, w.shape, w.dtype, w.device_id, type(config), config.kernel_size,
            config.stride, config.padding, config.dilation, config.groups, has_bias, precision,
            output_mask)


def _validate(m: Any, go: Any, x: Any, w: Any, config: Any,
              precision: Any) -> Tuple[Geometry, CudaDataType, Optional[str], int]:
    """(geometry, dtype, precision, device) after every check, with messages saying what
    was wrong and what was expected."""
    common.check_tensor(go, "grad_out")
    common.check_tensor(x, "input")
    common.check_tensor(w, "kernel")
    g = plan(x.shape, w.shape, config)
    if tuple(go.shape) != g.out_shape:
        raise ShapeMismatchError(
            f"conv2d_backward: grad_out has shape {tuple(go.shape)}, but conv2d of an input "
            f"of shape {tuple(x.shape)} with a kernel of shape {tuple(w.shape)} and this "
            f"config gives {g.out_shape}")
    dtype = common.same_dtype(go, x, w)
    common.require_dtype(x, DTYPES, "conv2d_backward")
    prec = normalize_precision(precision, dtype)
    dev = common.same_device(go, x, w)
    if m.gpu:
        check_limits(g)
    return g, dtype, prec, dev


def check_limits(g: Geometry) -> None:
    """32-bit index arithmetic and grid limits inside the kernels: refuse what would overflow."""
    for what, value, limit in (
            ("input pixels N*H*W", g.N * g.H * g.W, INT_MAX),
            ("per-image input elements C*H*W", g.C * g.H * g.W, INT_MAX),
            ("per-image output elements K*P*Q", g.K * g.P * g.Q, INT_MAX),
            ("output pixels N*P*Q", g.N * g.P * g.Q, INT_MAX - 64),
            ("filter elements K*C/groups*R*S", g.K * g.Cg * g.R * g.S, INT_MAX),
            ("groups", g.groups, 65535),
            ("input channels per group / 32", -(-g.Cg // 32), 65535),
            ("output channels (bias grid)", g.K, INT_MAX)):
        if value > limit:
            raise InvalidArgumentError(
                f"conv2d_backward: {what} = {value} is over the kernels' limit {limit}; "
                f"split the batch or the channels")


def _fallback(m: Any, go: CudaTensor, x: CudaTensor, w: CudaTensor, g: Geometry,
              parts: Tuple[str, ...], dtype: CudaDataType, dev: int
              ) -> Tuple[Optional[CudaTensor], Optional[CudaTensor], Optional[CudaTensor]]:
    """The parts from the float64 reference, rounded once to the dtype."""
    values = reference(common.host_array(m, go), common.host_array(m, x),
                       common.host_array(m, w), g, "bias" in parts)
    res = [common.from_host(m, v, dtype, dev) if p in parts and v is not None else None
           for p, v in zip(("dgrad", "wgrad", "bias"), values)]
    return res[0], res[1], res[2]
