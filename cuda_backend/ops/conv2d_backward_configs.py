"""conv2d_backward's kernels and tile configs: the template names, the dgrad and wgrad config
tables, each config's threads, shared memory and grid, the splits of the long reductions
(wgrad's split-K, the bias sums), the data-gradient route (`dgrad_path`), and the candidates
the autotuner times (`candidates`, `shape_key`). Pure functions of the geometry (also the
tests' emulation of the kernels' index math); ops/conv2d_backward_program.py builds the
launches from them.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError
from . import common
from . import conv2d_configs as fc
from .conv2d_geometry import Geometry

DT = CudaDataType
DGRAD_TEMPLATE = "conv2d_dgrad.cu.j2"
WGRAD_TEMPLATE = "conv2d_wgrad.cu.j2"
WGRAD_X3_TEMPLATE = "conv2d_wgrad_mma.cu.j2"
AUX_TEMPLATE = "conv2d_grad_aux.cu.j2"
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
# dgrad: the forward's SIMT tiles (ops/conv2d_configs.py), D_128x64x8 with a 4-stage ring;
# threads = (bm / tm) * (bn / tn) * slices over GEMM (pixels, C/groups).
D_128x128x8 = fc.S_128x128x8                      # 256 threads, 33 KB
D_128x128x16 = fc.S_128x128x16                    # 256 threads, 50 KB
D_128x64x8 = {**fc.S_128x64x8, "stages": 4}       # 128 threads, 25 KB
D_64x64x8s2 = fc.S_64x64x8s2                      # 64 threads x 2 k-slices, 26 KB
D_64x32x8s2 = fc.S_64x32x8s2                      # 128 threads x 2 k-slices, 20 KB
D_32x32x8s4 = fc.S_32x32x8s4                      # 64 threads x 4 k-slices, 27 KB
DGRAD_CONFIGS = (D_128x128x8, D_128x128x16, D_128x64x8, D_64x64x8s2, D_64x32x8s2,
                 D_32x32x8s4)
# the small tiles reading a float32 filter as given (no weight_rskc launch), where
# dgrad_kcrs_fits: each candidate is timed as the whole part, its repack included
DGRAD_KCRS_CONFIGS = tuple(dict(c, kcrs=True) for c in (D_64x64x8s2, D_64x32x8s2, D_32x32x8s4))
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


def tile_params(cfg: Dict[str, Any]) -> Dict[str, int]:
    """A candidate without its launch-only keys (wgrad's waves): the template parameters."""
    return {k: v for k, v in cfg.items() if k != "waves"}



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
    """'forward' (conv2d of grad_out with the flipped filter, ops/conv2d.py) or 'simt' (the
    dgrad kernel; on small float32 problems also reading the filter as given)."""
    ph2, pw2 = g.dh * (g.R - 1) - g.ph, g.dw * (g.S - 1) - g.pw
    if (g.sh, g.sw) != (1, 1) or ph2 < 0 or pw2 < 0:
        return "simt"
    if dtype is not DT.FLOAT32 or prec == "tf32" or g.Cg < 8:
        return "forward"
    if dgrad_kcrs_fits(g, dtype):   # small: its KCRS configs need no filter launch at all
        return "simt"
    # float32 at the default precision: the forward's autotuner may pick 3xTF32 ("ieee":
    # the dgrad kernel); g2 is the forward's geometry (grad_out in, the flipped filter)
    g2 = Geometry(g.N, g.K, g.P, g.Q, g.C, g.R, g.S, g.groups, 1, 1, ph2, pw2, g.dh, g.dw,
                  g.H, g.W)
    if fc.x3_fits(g2, dtype, prec):
        return "forward"
    return "simt"



def wgrad_x3_fits(g: Geometry, dtype: CudaDataType, prec: Optional[str]) -> bool:
    """Whether the 3xTF32 wgrad configs are candidates: float32 at precision None / "fp32" /
    "tf32" (not "ieee"), with the kernel's int32 offsets in range (its B-row table holds
    c*H*W + dr*W + ds, |dr| <= H + ph)."""
    return (dtype is DT.FLOAT32 and prec in (None, "fp32", "tf32") and
            g.Cg * g.H * g.W + (g.H + g.ph + 1) * g.W + g.pw + 1 <= INT_MAX and
            g.H + 2 * g.ph + 1 <= 2**30 and g.W + 2 * g.pw + 1 <= 2**30)


def dgrad_kcrs_fits(g: Geometry, dtype: CudaDataType) -> bool:
    """Whether the dgrad candidates include DGRAD_KCRS_CONFIGS: a float32 filter and a small
    problem (pixels N*H*W <= fc.KCRS_MAX_M, Cg <= 64, Kg*R*S <= fc.KCRS_MAX_CRS: the
    forward's KCRS bounds, its GEMM's M, N and depth), where the repack launch is a good
    part of the time."""
    return (dtype is DT.FLOAT32 and g.N * g.H * g.W <= fc.KCRS_MAX_M and g.Cg <= 64 and
            g.Kg * g.R * g.S <= fc.KCRS_MAX_CRS)


def _dgrad_candidates(g: Geometry, sm_count: int) -> List[Dict[str, Any]]:
    if g.Cg <= 32:
        return [D_64x32x8s2, D_32x32x8s4]
    if g.Cg <= 64:
        return [D_128x64x8, D_64x64x8s2, D_64x32x8s2]
    grid = dgrad_grid(g, D_128x128x8)
    if grid[0] * grid[1] * grid[2] >= 2 * sm_count:
        return [D_128x128x8, D_128x128x16, D_128x64x8]
    return [D_128x64x8, D_64x64x8s2, D_128x128x8]


def candidates(g: Geometry, sm_count: int, kind: str = "dgrad",
               dtype: Optional[CudaDataType] = None,
               prec: Optional[str] = None) -> List[Dict[str, Any]]:
    """The configs the autotuner chooses from. dgrad: by input channels per group (GEMM N),
    then by how many blocks the large tile gives (two waves or more keep it); given the
    dtype, also their KCRS versions where `dgrad_kcrs_fits`. wgrad: by output channels per
    group (GEMM M), each with the waves its splits aim at; given the dtype and precision,
    the 3xTF32 configs first where `wgrad_x3_fits` (without them: the SIMT list alone)."""
    if kind == "dgrad":
        out = _dgrad_candidates(g, sm_count)
        if dtype is not None and dgrad_kcrs_fits(g, dtype):
            out += [dict(c, kcrs=True) for c in out if dict(c, kcrs=True) in DGRAD_KCRS_CONFIGS]
        return out
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
    bucket = common.size_bucket
    if kind == "dgrad":
        return [dtype.name_str, bucket(g.N * g.H * g.W), bucket(g.Cg),
                bucket(g.Kg * g.R * g.S), g.groups > 1, (g.sh, g.sw) != (1, 1)]
    return [bucket(g.Kg), bucket(g.Cg * g.R * g.S), bucket(g.N * g.P * g.Q), g.groups > 1]
