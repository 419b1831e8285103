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
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..kernels import dtype_params
from ..tensor import CudaTensor, pool_tensor
from . import common
from . import conv2d as fwd
from .conv2d import Geometry

DT = CudaDataType
DGRAD_TEMPLATE = "conv2d_dgrad.cu.j2"
WGRAD_TEMPLATE = "conv2d_wgrad.cu.j2"
WGRAD_X3_TEMPLATE = "conv2d_wgrad_mma.cu.j2"
AUX_TEMPLATE = "conv2d_grad_aux.cu.j2"
# the forward's templates run the stride-1 data gradient on tensor cores (see above)
TEMPLATES = (DGRAD_TEMPLATE, WGRAD_TEMPLATE, WGRAD_X3_TEMPLATE, AUX_TEMPLATE) + fwd.TEMPLATES
DTYPES = fwd.DTYPES
HALF = (DT.FLOAT16, DT.BFLOAT16)
INT_MAX = 2**31 - 1
AUX_BLOCK = 256
WORKSPACE_CAP = 256 << 20      # bytes of wgrad partials at most (fewer splits beyond)
MIN_SPLIT_TILES = 32           # k-tiles (of bk pixels) per wgrad split at least
X3_MAX_CHUNK = 4096            # pixels per 3xTF32 wgrad split at most (workspace cap first)


def _wg(bm: int, bn: int, bk: int, tm: int, tn: int, stages: int,
        min_blocks: int) -> Dict[str, int]:
    return {"bm": bm, "bn": bn, "bk": bk, "tm": tm, "tn": tn, "stages": stages,
            "min_blocks": min_blocks}


def _wx(bm: int, bn: int, bk: int, wm: int, wn: int, stages: int,
        min_blocks: int) -> Dict[str, int]:
    return {"bm": bm, "bn": bn, "bk": bk, "wm": wm, "wn": wn, "stages": stages,
            "min_blocks": min_blocks}


# -- tile configs ------------------------------------------------------------------------
# dgrad (the forward's SIMT configs): threads = (bm / tm) * (bn / tn) * slices over GEMM
# (pixels, C/groups).
_dg = fwd.simt_config
D_128x128x8 = _dg(128, 128, 8, 8, 8, 1, 4, 2)     # 256 threads, 33 KB
D_128x128x16 = _dg(128, 128, 16, 8, 8, 1, 3, 2)   # 256 threads, 50 KB
D_128x64x8 = _dg(128, 64, 8, 8, 8, 1, 4, 3)       # 128 threads, 25 KB
D_64x64x8s2 = _dg(64, 64, 8, 8, 8, 2, 3, 3)       # 64 threads x 2 k-slices, 26 KB
D_64x32x8s2 = _dg(64, 32, 8, 4, 4, 2, 3, 4)       # 128 threads x 2 k-slices, 20 KB
D_32x32x8s4 = _dg(32, 32, 8, 4, 4, 4, 3, 4)       # 64 threads x 4 k-slices, 27 KB
DGRAD_CONFIGS = (D_128x128x8, D_128x128x16, D_128x64x8, D_64x64x8s2, D_64x32x8s2,
                 D_32x32x8s4)
# wgrad: threads = (bm / tm) * (bn / tn) over GEMM (K/groups, C/groups*R*S).
W_128x128x8 = _wg(128, 128, 8, 8, 8, 4, 2)        # 256 threads, 33 KB
W_128x64x8 = _wg(128, 64, 8, 8, 8, 4, 3)          # 128 threads, 25 KB
W_64x128x8 = _wg(64, 128, 8, 8, 8, 4, 3)          # 128 threads, 25 KB
W_64x64x8 = _wg(64, 64, 8, 8, 8, 4, 4)            # 64 threads, 17 KB
W_32x64x8 = _wg(32, 64, 8, 4, 8, 4, 4)            # 64 threads, 14 KB
W_16x64x8 = _wg(16, 64, 8, 4, 4, 4, 4)            # 64 threads, 12 KB
WGRAD_CONFIGS = (W_128x128x8, W_128x64x8, W_64x128x8, W_64x64x8, W_32x64x8, W_16x64x8)
# wgrad on tensor cores, 3xTF32 (conv2d_wgrad_mma.cu.j2): threads = (bm / wm) * (bn / wn) *
# 32; two accumulator sets, so warp tiles of 64 x 32 or 32 x 64 at most. ptxas sm_90 (CUDA
# 13.0), no spills: registers in the comments; shared = stages * (bm + bn) * bk * 4 + bn * 16.
WX_128x128x32 = _wx(128, 128, 32, 64, 32, 3, 1)   # 256 threads, 234 regs, 98 KB
WX_128x128x16 = _wx(128, 128, 16, 64, 32, 4, 1)   # 256 threads, 230 regs, 66 KB
WX_128x64x32 = _wx(128, 64, 32, 64, 32, 3, 2)     # 128 threads, 238 regs, 73 KB
WX_64x128x32 = _wx(64, 128, 32, 32, 64, 3, 2)     # 128 threads, 228 regs, 74 KB
WX_64x64x32 = _wx(64, 64, 32, 32, 32, 4, 2)       # 128 threads, 160 regs, 66 KB
WX_32x64x32 = _wx(32, 64, 32, 32, 32, 4, 4)       # 64 threads, 162 regs, 50 KB
WGRAD_X3_CONFIGS = (WX_128x128x32, WX_128x128x16, WX_128x64x32, WX_64x128x32, WX_64x64x32,
                    WX_32x64x32)
AUX_KINDS = ("weight_rskc", "weight_flip", "to_float", "splitk_sum", "bias_partial")


def dgrad_threads(cfg: Dict[str, int]) -> int:
    return (cfg["bm"] // cfg["tm"]) * (cfg["bn"] // cfg["tn"]) * cfg.get("slices", 1)


def dgrad_shared_bytes(cfg: Dict[str, int]) -> int:
    """Dynamic shared memory of a dgrad config: the slices' rings, or their reduction."""
    ring = cfg["slices"] * cfg["stages"] * cfg["bk"] * (cfg["bm"] + cfg["bn"] + 8)
    red = (cfg["slices"] - 1) * cfg["tm"] * cfg["tn"] * (dgrad_threads(cfg) // cfg["slices"])
    return 4 * max(ring, red)


def wgrad_is_x3(cfg: Dict[str, Any]) -> bool:
    """Whether a wgrad config (or candidate) is a 3xTF32 one (conv2d_wgrad_mma.cu.j2)."""
    return "wm" in cfg


def wgrad_template(cfg: Dict[str, Any]) -> str:
    return WGRAD_X3_TEMPLATE if wgrad_is_x3(cfg) else WGRAD_TEMPLATE


def wgrad_threads(cfg: Dict[str, Any]) -> int:
    if wgrad_is_x3(cfg):
        return (cfg["bm"] // cfg["wm"]) * (cfg["bn"] // cfg["wn"]) * 32
    return (cfg["bm"] // cfg["tm"]) * (cfg["bn"] // cfg["tn"])


def wgrad_shared_bytes(cfg: Dict[str, Any]) -> int:
    """Dynamic shared memory of a wgrad config (the 3xTF32 kernel's table is static)."""
    if wgrad_is_x3(cfg):
        return 4 * cfg["stages"] * cfg["bk"] * (cfg["bm"] + cfg["bn"])
    return 4 * cfg["stages"] * cfg["bk"] * (cfg["bm"] + cfg["bn"] + 8)


def _tile_params(cfg: Dict[str, Any]) -> Dict[str, int]:
    """A candidate without its launch-only keys (wgrad's waves): the template parameters."""
    return {k: v for k, v in cfg.items() if k != "waves"}


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set this module renders: dgrad per grad_input dtype and config, wgrad
    per config, SIMT and 3xTF32 (float32 operands and partials), the auxiliary kernels per
    dtype."""
    dgrad = [{**dtype_params(dt), **cfg} for dt in DTYPES for cfg in DGRAD_CONFIGS]
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


def _kernel(m: Any, template: str, dev: int, params: Dict[str, Any]) -> Any:
    """m.kernel(template, dev, **params), memoized on m (ops/common.py memo_kernel)."""
    return common.memo_kernel(m, "_conv2d_bwd_kernels", template, dev, params)


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8,
            dtypes: Sequence[CudaDataType] = DTYPES) -> int:
    """Compile this module's kernels for the dtypes in parallel threads (wgrad's float32
    kernels serve every dtype); returns how many were compiled (0 in fallback mode). The
    forward's kernels, which the stride-1 data gradient may use, warm with ops/conv2d.py."""
    names = {d.name_str for d in dtypes}
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets
            if p["dtype"] in names or t == WGRAD_TEMPLATE]
    return common.compile_all(m, jobs, device_id, workers, _kernel)


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


# -- geometry helpers (shared with the tests' emulation of the kernels' index math) ----------
def phase_taps(a: int, stride: int, dil: int, size: int) -> Tuple[int, int, int, int]:
    """For the pixels with (h + pad) % stride == a: (first valid tap r0, tap step, output-row
    step per tap, number of valid taps); r0 == size when no tap reaches the phase."""
    r0 = next((r for r in range(min(size, stride)) if (a - r * dil) % stride == 0), size)
    gcd = math.gcd(stride, dil)
    step, out_step = stride // gcd, dil // gcd
    count = -(-(size - r0) // step) if r0 < size else 0
    return r0, step, out_step, count


def dgrad_tiles_pp(g: Geometry, bm: int) -> int:
    """Tiles per stride phase in the dgrad grid (of the largest phase)."""
    return max(1, -(-g.N * -(-g.H // g.sh) * -(-g.W // g.sw) // bm))


def dgrad_grid(g: Geometry, cfg: Dict[str, int]) -> Tuple[int, int, int]:
    return (g.sh * g.sw * dgrad_tiles_pp(g, cfg["bm"]), -(-g.Cg // cfg["bn"]), g.groups)


def wgrad_split(g: Geometry, cfg: Dict[str, Any], sm_count: int) -> Tuple[int, int]:
    """(splits, chunk): the pixels N*P*Q in `splits` chunks of `chunk` (a multiple of bk),
    enough blocks for cfg["waves"] waves of min_blocks blocks per SM, at least
    MIN_SPLIT_TILES k-tiles per split and at most WORKSPACE_CAP bytes of partials; a 3xTF32
    config also takes enough splits for at most X3_MAX_CHUNK pixels each, as far as the
    workspace cap allows."""
    bk = cfg["bk"]
    L = g.N * g.P * g.Q
    if L == 0:
        return 1, bk
    tiles = -(-g.Kg // cfg["bm"]) * -(-(g.Cg * g.R * g.S) // cfg["bn"]) * g.groups
    want = (cfg.get("waves", 2) * sm_count * cfg["min_blocks"]) // max(tiles, 1)
    by_len = L // (bk * MIN_SPLIT_TILES)
    by_mem = WORKSPACE_CAP // max(1, 4 * g.K * g.Cg * g.R * g.S)
    splits = max(1, min(want, by_len, by_mem))
    if wgrad_is_x3(cfg):
        splits = max(splits, min(-(-L // X3_MAX_CHUNK), by_mem))
    chunk = -(-L // (splits * bk)) * bk
    return -(-L // chunk), chunk


def wgrad_grid(g: Geometry, cfg: Dict[str, Any], splits: int) -> Tuple[int, int, int]:
    mt, nt = -(-g.Kg // cfg["bm"]), -(-(g.Cg * g.R * g.S) // cfg["bn"])
    return (splits * mt * nt, 1, g.groups)


def bias_chunks(g: Geometry, sm_count: int) -> Tuple[int, int]:
    """(chunks, chunk) of the N*P*Q pixels for the bias sums: about 4 blocks per SM over
    the K channels, each at least 4096 pixels."""
    L = g.N * g.P * g.Q
    if L == 0:
        return 1, 1
    chunks = max(1, min(-(-4 * sm_count // max(g.K, 1)), -(-L // 4096), 65535))
    chunk = -(-L // chunks)
    return -(-L // chunk), chunk


def dgrad_path(g: Geometry, dtype: CudaDataType, prec: Optional[str]) -> str:
    """'forward' (conv2d of grad_out with the flipped filter, ops/conv2d.py) or 'simt'."""
    ph2, pw2 = g.dh * (g.R - 1) - g.ph, g.dw * (g.S - 1) - g.pw
    if (g.sh, g.sw) != (1, 1) or ph2 < 0 or pw2 < 0:
        return "simt"
    if dtype is not DT.FLOAT32 or prec == "tf32" or g.Cg < 8:
        return "forward"
    # float32 at the default precision: the forward's autotuner may pick 3xTF32 ("ieee":
    # the dgrad kernel); g2 is the forward's geometry (grad_out in, the flipped filter)
    g2 = Geometry(g.N, g.K, g.P, g.Q, g.C, g.R, g.S, g.groups, 1, 1, ph2, pw2, g.dh, g.dw,
                  g.H, g.W)
    if fwd.x3_fits(g2, dtype, prec):
        return "forward"
    return "simt"


def _bucket(v: int) -> int:
    return max(0, int(v) - 1).bit_length()


def wgrad_x3_fits(g: Geometry, dtype: CudaDataType, prec: Optional[str]) -> bool:
    """Whether the 3xTF32 wgrad configs are candidates: float32 at precision None / "fp32" /
    "tf32" (not "ieee"), with the kernel's int32 offsets in range (its B-row table holds
    c*H*W + dr*W + ds, |dr| <= H + ph)."""
    return (dtype is DT.FLOAT32 and prec in (None, "fp32", "tf32") and
            g.Cg * g.H * g.W + (g.H + g.ph + 1) * g.W + g.pw + 1 <= INT_MAX and
            g.H + 2 * g.ph + 1 <= 2**30 and g.W + 2 * g.pw + 1 <= 2**30)


def candidates(g: Geometry, sm_count: int, kind: str = "dgrad",
               dtype: Optional[CudaDataType] = None,
               prec: Optional[str] = None) -> List[Dict[str, Any]]:
    """The configs the autotuner chooses from. dgrad: by input channels per group (GEMM N),
    then by how many blocks the large tile gives (two waves or more keep it). wgrad: by
    output channels per group (GEMM M), each with the waves its splits aim at; given the
    dtype and precision, the 3xTF32 configs first where `wgrad_x3_fits` (without them: the
    SIMT list alone)."""
    if kind == "dgrad":
        if g.Cg <= 32:
            return [D_64x32x8s2, D_32x32x8s4]
        if g.Cg <= 64:
            return [D_128x64x8, D_64x64x8s2, D_64x32x8s2]
        grid = dgrad_grid(g, D_128x128x8)
        if grid[0] * grid[1] * grid[2] >= 2 * sm_count:
            return [D_128x128x8, D_128x128x16, D_128x64x8]
        return [D_128x64x8, D_64x64x8s2, D_128x128x8]
    if kind != "wgrad":
        raise InvalidArgumentError(f"kind must be 'dgrad' or 'wgrad', got {kind!r}")
    if g.Kg <= 16:
        cfgs = [W_16x64x8, W_32x64x8]
    elif g.Kg <= 32:
        cfgs = [W_32x64x8, W_64x64x8]
    elif g.Kg <= 64:
        cfgs = [W_64x128x8, W_64x64x8, W_128x64x8]
    else:
        cfgs = [W_128x128x8, W_128x64x8, W_64x128x8]
    simt = [{**cfgs[0], "waves": 2}, {**cfgs[0], "waves": 4}] + \
        [{**c, "waves": 2} for c in cfgs[1:]]
    if dtype is None or not wgrad_x3_fits(g, dtype, prec):
        return simt
    if g.Kg <= 32:
        x3 = [WX_32x64x32, WX_64x64x32]
    elif g.Kg <= 64:
        x3 = [WX_64x128x32, WX_64x64x32]
    else:
        x3 = [WX_128x128x32, WX_128x64x32, WX_128x128x16]
    return [{**c, "waves": 2} for c in x3] + simt


def shape_key(g: Geometry, dtype: CudaDataType, kind: str) -> List[Any]:
    """The autotuner's shape class: powers of two of the GEMM sizes, groups > 1, stride."""
    if kind == "dgrad":
        return [dtype.name_str, _bucket(g.N * g.H * g.W), _bucket(g.Cg),
                _bucket(g.Kg * g.R * g.S), g.groups > 1, (g.sh, g.sw) != (1, 1)]
    return [_bucket(g.Kg), _bucket(g.Cg * g.R * g.S), _bucket(g.N * g.P * g.Q), g.groups > 1]


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
        try:  # the per-call plan (ops/common.py remember_plan)
            fast = m.plans.get(_plan_key(grad_out, x, w, config, has_bias, precision,
                                         output_mask))
        except (AttributeError, TypeError):  # not a config, unhashable fields: the checks
            fast = None
        if fast is not None and m.backend.direct_launch(grad_out.device_id):
            res = fast(grad_out, x, w)
            if res is not None:
                return res
    g, dtype, prec, dev = _validate(m, grad_out, x, w, config, precision)
    parts = _parts(has_bias, output_mask)
    if not m.gpu:
        return _fallback(m, grad_out, x, w, g, parts, dtype, dev)
    prog = _program(m, grad_out, x, w, g, dtype, prec, dev, parts)
    res = prog.run(m, grad_out, x, w, direct=False)
    from ..cuda_ml import ConvolutionConfig
    if type(config) is ConvolutionConfig and (precision is None or type(precision) is str):
        key = _plan_key(grad_out, x, w, config, has_bias, precision, output_mask)
        if key not in m.plans:
            common.remember_plan(m, key, _make_plan(m, prog))
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
    g = fwd.plan(x.shape, w.shape, config)
    if tuple(go.shape) != g.out_shape:
        raise ShapeMismatchError(
            f"conv2d_backward: grad_out has shape {tuple(go.shape)}, but conv2d of an input "
            f"of shape {tuple(x.shape)} with a kernel of shape {tuple(w.shape)} and this "
            f"config gives {g.out_shape}")
    dtype = common.same_dtype(go, x, w)
    common.require_dtype(x, DTYPES, "conv2d_backward")
    prec = fwd.normalize_precision(precision, dtype)
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


# -- GPU: programs of launches -----------------------------------------------------------------
@dataclass
class _Launch:
    """One kernel launch: arguments are values, or names of the program's tensors ("go",
    "x", "w", outputs and workspaces), or ("vec", name, ok): 1 where ok and that tensor's
    pointer is 16-byte aligned."""

    name: str
    grid: Tuple[int, int, int]
    block: Tuple[int, int, int]
    smem: int
    args: Tuple[Any, ...]
    prepared: Any


@dataclass
class _Forward:
    """The stride-1 data gradient through ops/conv2d.py: conv2d(go, wf, config2) -> gi."""

    config: Any
    precision: Optional[str]


class Program:
    """The launches of one backward geometry (dtype, precision, device, parts, configs) and
    the tensors they need; `run` allocates, launches and frees the workspaces. Built once
    per key on the general path; the per-call plan runs the same program directly."""

    def __init__(self, m: Any, g: Geometry, dtype: CudaDataType, prec: Optional[str],
                 dev: int) -> None:
        self.m, self.g, self.dtype, self.prec, self.dev = m, g, dtype, prec, dev
        self.outputs: List[Tuple[str, Tuple[int, ...], CudaDataType]] = []
        self.work: List[Tuple[str, Tuple[int, ...], CudaDataType]] = []
        self.steps: List[Any] = []
        info = m.backend.get_device_info(dev)
        self.sms = info.multiprocessor_count

    def tensor(self, name: str, shape: Tuple[int, ...], dtype: CudaDataType,
               output: bool = False) -> str:
        (self.outputs if output else self.work).append((name, tuple(shape), dtype))
        return name

    def launch(self, template: str, params: Dict[str, Any], grid: Tuple[int, int, int],
               block: Tuple[int, int, int], smem: int, *args: Any) -> None:
        kernel = _kernel(self.m, template, self.dev, params)
        prepared = self.m.backend.prepare_launch(kernel, grid, block, smem, self.dev)
        self.steps.append(_Launch(kernel.name, grid, block, smem, args, prepared))

    def aux(self, kind: str, dtype: CudaDataType, total: int, *args: Any) -> None:
        """A grid-stride auxiliary kernel over `total` items."""
        grid = (common.grid_1d(total, AUX_BLOCK, self.sms), 1, 1)
        self.launch(AUX_TEMPLATE, {**dtype_params(dtype), "kind": kind}, grid,
                    (AUX_BLOCK, 1, 1), 0, *args)

    def run(self, m: Any, go: CudaTensor, x: CudaTensor, w: CudaTensor,
            direct: bool) -> Tuple[Optional[CudaTensor], Optional[CudaTensor],
                                   Optional[CudaTensor]]:
        """Allocate the outputs and workspaces, launch every step, free the workspaces;
        direct: prepared launches on the legacy default stream (the plan's path), else
        launch_kernel (streams, profiling). A failure frees everything it allocated."""
        backend = m.backend
        named: Dict[str, Any] = {"go": go, "x": x, "w": w}
        made: List[CudaTensor] = []
        work: List[CudaTensor] = []
        if direct:
            pool = backend.memory_pools[self.dev]
            alloc = pool.allocate_current
        try:
            for names, into in ((self.outputs, made), (self.work, work)):
                for name, shape, dt in names:
                    size = math.prod(shape)
                    nbytes = size * dt.itemsize
                    if direct and nbytes:
                        t = pool_tensor(shape, dt, self.dev, alloc(nbytes), pool, size, nbytes)
                    else:
                        t = backend.empty(shape, dt, self.dev)
                    into.append(t)
                    named[name] = t
            for step in self.steps:
                if type(step) is _Forward:
                    gi = fwd.conv2d(m, named["go"], named["wf"], step.config, None,
                                    step.precision)
                    made.append(gi)
                    named["gi"] = gi
                    continue
                args = []
                for a in step.args:
                    if type(a) is str:
                        a = named[a]
                        args.append(a._ptr if direct else a)
                    elif type(a) is tuple:
                        args.append(int(a[2] and named[a[1]].ptr % 16 == 0))
                    else:
                        args.append(a)
                if direct:
                    step.prepared(*args)
                else:
                    backend.launch_kernel(step.name, step.grid, *args, block_size=step.block,
                                          shared_mem=step.smem, device_id=self.dev)
        except BaseException:
            for t in made:
                t.free()   # nothing leaks from a failed launch
            raise
        finally:
            for t in work:
                t.free()   # back to the pool; later work on this stream is ordered after it
        return named.get("gi"), named.get("gw"), named.get("gb")


def build_program(m: Any, g: Geometry, dtype: CudaDataType, prec: Optional[str], dev: int,
                  parts: Sequence[str], dcfg: Any = None,
                  wcfg: Optional[Dict[str, Any]] = None) -> Program:
    """The program of `parts` ("dgrad", "wgrad", "bias"): dcfg is a dgrad config or
    "forward", wcfg a wgrad candidate (SIMT or 3xTF32, with its waves). The autotuner
    times these per candidate; the tests run every config through them."""
    p = Program(m, g, dtype, prec, dev)
    G, Cg, Kg, K, RS = g.groups, g.Cg, g.Kg, g.K, g.R * g.S
    CRS = Cg * RS
    go_size, x_size = g.N * K * g.P * g.Q, g.N * g.C * g.H * g.W
    geo = (g.sh, g.sw, g.ph, g.pw, g.dh, g.dw)
    dgrad = "dgrad" in parts and x_size > 0
    wgrad = "wgrad" in parts and K * CRS > 0
    half = dtype in HALF
    need_gof = go_size > 0 and half and ((dgrad and dcfg != "forward") or wgrad)
    if "dgrad" in parts and not dgrad:
        p.tensor("gi", (g.N, g.C, g.H, g.W), dtype, output=True)
    if "wgrad" in parts:
        p.tensor("gw", (K, Cg, g.R, g.S), dtype, output=True)
    if "bias" in parts:
        p.tensor("gb", (K,), dtype, output=True)
    gof = "go"
    if need_gof:
        gof = p.tensor("gof", (go_size,), DT.FLOAT32)
        p.aux("to_float", dtype, go_size, "go", gof, go_size)
    if dgrad and dcfg == "forward":
        from ..cuda_ml import ConvolutionConfig
        p.tensor("wf", (g.C, Kg, g.R, g.S), dtype)
        total = g.C * Kg * RS
        if total:
            p.aux("weight_flip", dtype, total, "w", "wf", Kg, Cg, g.R, g.S, total)
        cfg2 = ConvolutionConfig(kernel_size=(g.R, g.S), stride=1,
                                 padding=(g.dh * (g.R - 1) - g.ph, g.dw * (g.S - 1) - g.pw),
                                 dilation=(g.dh, g.dw), groups=G)
        p.steps.append(_Forward(cfg2, prec))
    elif dgrad:
        p.tensor("gi", (g.N, g.C, g.H, g.W), dtype, output=True)
        cgp = -(-Cg // 4) * 4
        wt_size = G * RS * Kg * cgp
        p.tensor("wt", (max(wt_size, 1),), DT.FLOAT32)
        if wt_size:
            p.aux("weight_rskc", dtype, wt_size, "w", "wt", Kg, Cg, RS, cgp, wt_size)
        grid = dgrad_grid(g, dcfg)
        vec = dtype is DT.FLOAT32 and (g.sh, g.sw) == (1, 1) and (g.H * g.W) % 4 == 0
        p.launch(DGRAD_TEMPLATE, {**dtype_params(dtype), **dcfg}, grid,
                 (dgrad_threads(dcfg), 1, 1), dgrad_shared_bytes(dcfg), gof, "wt",
                 "gi", ("vec", "gi", vec), g.N, g.C, g.H, g.W, Cg, Kg, cgp, K, g.P, g.Q,
                 g.R, g.S, *geo, dgrad_tiles_pp(g, dcfg["bm"]))
    if wgrad:
        assert wcfg is not None
        xf = "x"
        if half and x_size:
            xf = p.tensor("xf", (x_size,), DT.FLOAT32)
            p.aux("to_float", dtype, x_size, "x", xf, x_size)
        splits, chunk = wgrad_split(g, wcfg, p.sms)
        direct_out = splits == 1 and dtype is DT.FLOAT32
        out = "gw" if direct_out else p.tensor("ws", (splits * K * CRS,), DT.FLOAT32)
        cfg = _tile_params(wcfg)
        mt, nt = -(-Kg // cfg["bm"]), -(-CRS // cfg["bn"])
        p.launch(wgrad_template(cfg), {**dtype_params(DT.FLOAT32), **cfg},
                 wgrad_grid(g, cfg, splits), (wgrad_threads(cfg), 1, 1),
                 wgrad_shared_bytes(cfg), gof, xf, out, ("vec", out, CRS % 4 == 0), g.N,
                 g.C, g.H, g.W, Cg, Kg, K, g.P, g.Q, g.R, g.S, *geo, chunk, mt, nt, K * CRS)
        if not direct_out:
            p.aux("splitk_sum", dtype, K * CRS, out, "gw", K * CRS, splits)
    if "bias" in parts and K > 0:
        chunks, chunk = bias_chunks(g, p.sms)
        direct_out = chunks == 1 and dtype is DT.FLOAT32
        out = "gb" if direct_out else p.tensor("wsb", (chunks * K,), DT.FLOAT32)
        L = g.N * g.P * g.Q
        p.launch(AUX_TEMPLATE, {**dtype_params(dtype), "kind": "bias_partial"}, (K, chunks, 1),
                 (AUX_BLOCK, 1, 1), 0, "go", out, K, g.P * g.Q, L, chunk)
        if not direct_out:
            p.aux("splitk_sum", dtype, K, out, "gb", K, chunks)
    return p


def _program(m: Any, go: CudaTensor, x: CudaTensor, w: CudaTensor, g: Geometry,
             dtype: CudaDataType, prec: Optional[str], dev: int,
             parts: Tuple[str, ...]) -> Program:
    """The program of this geometry and parts, memoized on m; the first call picks the
    dgrad and wgrad configs (the autotuner times each candidate on these operands)."""
    memo = m.__dict__.setdefault("_conv2d_bwd_programs", {})
    key = (g, dtype, prec, dev, parts)
    prog = memo.get(key)
    if prog is not None:
        return prog
    sms = m.backend.get_device_info(dev).multiprocessor_count
    dcfg: Any = None
    wcfg = None
    work = g.N * g.C * g.H * g.W * g.K > 0   # else the parts only write zeros (or nothing)
    if "dgrad" in parts:
        dcfg = dgrad_path(g, dtype, prec)
        if dcfg == "simt":
            cands = candidates(g, sms, "dgrad")
            dcfg = _choose(m, "conv2d_dgrad", g, dtype, "dgrad", cands, go, x, w, dev,
                           prec) if work else cands[0]
    if "wgrad" in parts:
        cands = candidates(g, sms, "wgrad", dtype, prec)
        op = "conv2d_wgrad_x3" if wgrad_is_x3(cands[0]) else "conv2d_wgrad"
        wcfg = _choose(m, op, g, dtype, "wgrad", cands, go, x, w, dev,
                       prec) if work else cands[0]
    prog = build_program(m, g, dtype, prec, dev, parts, dcfg, wcfg)
    if len(memo) >= 1024:
        memo.clear()
    memo[key] = prog
    return prog


def _choose(m: Any, op: str, g: Geometry, dtype: CudaDataType, kind: str,
            cands: List[Dict[str, Any]], go: CudaTensor, x: CudaTensor, w: CudaTensor,
            dev: int, prec: Optional[str]) -> Dict[str, Any]:
    """The autotuner's pick among the candidates, each timed as the whole dgrad or wgrad
    part (its conversions, repack, GEMM and split-K sum) on the call's operands."""
    if len(cands) == 1:
        return cands[0]
    progs: Dict[str, Program] = {}

    def run(cfg: Dict[str, Any]) -> None:
        key = repr(sorted(cfg.items()))
        prog = progs.get(key)
        if prog is None:
            prog = progs[key] = build_program(m, g, dtype, prec, dev, (kind,),
                                              cfg if kind == "dgrad" else None,
                                              cfg if kind == "wgrad" else None)
        for t in prog.run(m, go, x, w, direct=False):
            if t is not None:
                t.free()
    return m.autotuner.pick(op, shape_key(g, dtype, kind), cands, run, device_id=dev)


def _make_plan(m: Any, prog: Program) -> Any:
    """The per-call plan of one key (ops/common.py remember_plan): the program run with
    prepared launches when the three operands are live and were last used on the legacy
    default stream (else None: the general path runs)."""
    def plan(go: CudaTensor, x: Any, w: Any) -> Any:
        if type(x) is not CudaTensor or type(w) is not CudaTensor:
            return None
        if go._ptr is None or x._ptr is None or w._ptr is None or go.stream is not None or \
                x.stream is not None or w.stream is not None:
            return None
        return prog.run(m, go, x, w, direct=True)
    return plan
