"""conv2d's kernels and tile configs: the template names, each kernel family's config table,
and the choice among them for one convolution (`family`, `x3_fits`, `candidates`, and
`choose`, the autotuner's pick by `shape_key`). Data and pure functions of the geometry; the
launches that use them are in ops/conv2d_launch.py.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError
from . import common
from .conv2d_geometry import Geometry

DT = CudaDataType
SIMT_TEMPLATE = "conv2d_simt.cu.j2"
MMA_TEMPLATE = "conv2d_mma.cu.j2"
PREP_TEMPLATE = "conv2d_prep.cu.j2"
DIRECT_TEMPLATE = "conv2d_direct.cu.j2"
DTYPES = (DT.FLOAT32, DT.FLOAT16, DT.BFLOAT16)
DIRECT_VQ = 4


def simt_config(bm: int, bn: int, bk: int, tm: int, tn: int, slices: int, stages: int,
                min_blocks: int) -> Dict[str, int]:
    """A CUDA-core implicit-GEMM tile config (ops/conv2d_backward_configs.py's dgrad uses them)."""
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
# The small SIMT configs reading the filter as given (KCRS: no repack launch); offered where
# kcrs_fits, each timed with the repacks of the others.
KCRS_CONFIGS = tuple(dict(c, kcrs=True) for c in (S_64x64x8s2, S_64x32x8s2, S_32x32x8s4))
KCRS_MAX_M = 1 << 14   # output pixels (N * P * Q) up to this, Kg <= 64 and
KCRS_MAX_CRS = 288     # Cg * R * S (the GEMM's depth) up to this: kcrs_fits

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
# TMA + wgmma, TF32 and 16-bit (templates/matmul_tma16.cu.j2 with conv=1, ops/conv2d_tma.py): a
# tile is bm
# output columns of one output row x bn output channels; 384 threads (one producer,
# two consumer warpgroups), persistent grid; the "tma" key names the kernel (config_family).
C_TMA_128x128_s5 = {"bm": 128, "bn": 128, "stages": 5, "group_m": 8, "tma": True}
C_TMA_128x256_s4 = {"bm": 128, "bn": 256, "stages": 4, "group_m": 8, "tma": True}
C_TMA_128x64_s7 = {"bm": 128, "bn": 64, "stages": 7, "group_m": 8, "tma": True}
TMA_CONFIGS = (C_TMA_128x256_s4, C_TMA_128x128_s5, C_TMA_128x64_s7)


def family(g: Geometry, dtype: CudaDataType, prec: Optional[str]) -> str:
    """'direct', 'simt' or 'mma' for this convolution ('simt': float32 except TF32, whose
    candidates include the 3xTF32 mma configs where `x3_fits`)."""
    if g.Kg < 8 or g.Cg <= 1 or g.H * g.W == 0:
        return "direct"
    if dtype is DT.FLOAT32 and prec != "tf32":
        return "simt"
    return "mma"


def kcrs_fits(g: Geometry, dtype: CudaDataType, prec: Optional[str]) -> bool:
    """Whether the autotuner also times the KCRS configs (no filter repack): the SIMT family
    on small problems (M <= KCRS_MAX_M, Kg <= 64, Cg * R * S <= KCRS_MAX_CRS), where the
    repack launch is a good part of the time; deeper filters read 4 bytes at a time lose
    more than the repack costs (perf/NOTES.md, "Per-call host cost" S15)."""
    return (family(g, dtype, prec) == "simt" and g.M <= KCRS_MAX_M and g.Kg <= 64 and
            g.Cg * g.R * g.S <= KCRS_MAX_CRS)


def x3_fits(g: Geometry, dtype: CudaDataType, prec: Optional[str]) -> bool:
    """Whether the autotuner also times the 3xTF32 configs: float32 at the default precision
    (not 'ieee', not 'tf32'), the GEMM kernels (not direct), and Cg >= X3_MIN_CHANNELS (with
    fewer, the channel padding of the mma's k-tiles would multiply 3x the work again)."""
    return (dtype is DT.FLOAT32 and prec in (None, "fp32") and
            family(g, dtype, prec) == "simt" and g.Cg >= X3_MIN_CHANNELS)


def timed_whole(g: Geometry, dtype: CudaDataType, prec: Optional[str]) -> bool:
    """Whether the candidates need different operands (3xTF32's repacks, KCRS's none), so
    each is timed with its own repacks rather than all on one repacked filter."""
    return x3_fits(g, dtype, prec) or kcrs_fits(g, dtype, prec)


def config_family(cfg: Dict[str, Any]) -> str:
    """'tma', 'mma' or 'simt': which kernel a tile config runs ('tma' takes the mma one's
    repacks: workspaces)."""
    if cfg.get("tma"):
        return "tma"
    return "mma" if "wm" in cfg else "simt"


def tma_candidates(g: Geometry, dtype: CudaDataType, prec: Optional[str],
                   info: Any) -> List[Dict[str, Any]]:
    """The TMA configs for a convolution ops/conv2d_tma.py's `usable` takes (none else):
    128 x 64 for up to 64 output channels, 128 x 128, and 128 x 256 first where there are
    more than 128."""
    from .conv2d_tma import usable
    if not usable(g, dtype, prec, info):
        return []
    if g.Kg <= 64:
        return [C_TMA_128x64_s7]
    return [C_TMA_128x256_s4, C_TMA_128x128_s5] if g.Kg > 128 else [C_TMA_128x128_s5]


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
    float32 at the default precision: the SIMT configs, where `kcrs_fits` the same small
    ones reading the filter as given, where `x3_fits` the 3xTF32 ones (each timed with its
    own repacks: the fastest wins)."""
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
        if kcrs_fits(g, dtype, prec):
            simt += [dict(c, kcrs=True) for c in simt if dict(c, kcrs=True) in KCRS_CONFIGS]
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



def shape_key(g: Geometry, dtype: CudaDataType, prec: Optional[str]) -> List[Any]:
    """The autotuner's shape class: powers of two of the GEMM sizes, and groups > 1."""
    bucket = common.size_bucket
    return [dtype.name_str, prec or "fp32", bucket(g.M), bucket(g.Kg),
            bucket(g.Cg * g.R * g.S), g.groups > 1]


def choose(m: Any, op: str, g: Geometry, dtype: CudaDataType, prec: Optional[str],
           run: Any, dev: int) -> Dict[str, Any]:
    """The tile config for this geometry: the autotuner's pick among the candidates."""
    info = m.backend.get_device_info(dev)
    if g.groups > info.max_grid_dims[2] or -(-g.Kg // 32) > info.max_grid_dims[1]:
        raise InvalidArgumentError(
            f"conv2d: groups={g.groups} with {g.Kg} output channels per group is over the "
            f"grid limits {info.max_grid_dims}")
    cands = tma_candidates(g, dtype, prec, info) + \
        candidates(g, dtype, prec, info.multiprocessor_count)
    if len(cands) == 1:
        return cands[0]
    return m.autotuner.pick(op, shape_key(g, dtype, prec), cands, run, device_id=dev)
