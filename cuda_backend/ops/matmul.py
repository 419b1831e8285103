"""Matrix multiply: `matmul(m, a, b, precision, out)` for CudaMath.matrix_multiply.

The kernel families, all templated:
- `matmul_simt.cu.j2`: true FP32 (float32's "ieee", beside 3xTF32 in its default) and FP64
  on CUDA cores; register-tiled
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
- `matmul_wgmma.cu.j2`: TF32 on Hopper's warpgroup tensor cores (wgmma, sm_90a) for
  precision="tf32" where K is a multiple of 4: B is first transposed to (N, K) and rounded to
  TF32 (transpose.transpose_tf32) into a pool block, since wgmma reads a TF32 B only K-major.
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
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .. import occupancy
from ..dtypes import CudaDataType, to_bfloat16_bits
from ..errors import DTypeMismatchError, InvalidArgumentError, ShapeMismatchError
from ..kernels import dtype_params
from ..tensor import CudaTensor
from . import common

DT = CudaDataType
SIMT_TEMPLATE = "matmul_simt.cu.j2"
MMA_TEMPLATE = "matmul_mma.cu.j2"
WGMMA_TEMPLATE = "matmul_wgmma.cu.j2"
SKINNY_TEMPLATE = "matmul_skinny.cu.j2"
FILL_TEMPLATE = "fill.cu.j2"
# the registry's contract: fill for K == 0, transpose.cu.j2 (ops/transpose.py) for wgmma's B
TEMPLATES = (SIMT_TEMPLATE, MMA_TEMPLATE, WGMMA_TEMPLATE, SKINNY_TEMPLATE, FILL_TEMPLATE,
             "transpose.cu.j2")
REDUCE_BLOCK = 256

# "ieee": float32 on CUDA cores only, where the default may choose 3xTF32 (GEMMs, linear layer)
_PRECISIONS = {None: None, "fp32": "fp32", "highest": "fp32", "ieee": "ieee", "tf32": "tf32"}


def _simt(bm: int, bn: int, bk: int, tm: int, tn: int, wtm: int, min_blocks: int,
          qa: int = 0, stages: int = 0, kc: int = 0) -> Dict[str, Any]:
    """SIMT tile config; qa > 0: quarter-warp lane layout (qa rows x 8 / qa columns of the
    warp's lane grid per 8 lanes), 0: row-major lanes; stages >= 2: the multistage cp.async
    loader (float32 and vec only; GEMM and linear layer), 0: the register-staged one;
    kc (linear layer only, multistage): x and W tiles k-contiguous in shared memory (16-byte
    copies, no transposing). The "kc" key is present only when set."""
    cfg: Dict[str, Any] = {"bm": bm, "bn": bn, "bk": bk, "tm": tm, "tn": tn, "wtm": wtm,
                           "qa": qa, "stages": stages, "min_blocks": min_blocks}
    if kc:
        cfg["kc"] = kc
    return cfg


def simt_smem(cfg: Dict[str, Any], esize: int = 4, b_trans: bool = False) -> int:
    """Dynamic shared memory of a SIMT config's launch (0: static, the 2-buffer loader);
    b_trans (the linear layer): B's k-major tile rows are padded by 4 like A's; kc: both
    tiles k-contiguous, rows of bk + 4."""
    stages = cfg.get("stages", 0)
    if cfg.get("kc"):
        return stages * (cfg["bm"] + cfg["bn"]) * (cfg["bk"] + 4) * esize
    bn = cfg["bn"] + (4 if b_trans else 0)
    return stages * cfg["bk"] * (cfg["bm"] + 4 + bn) * esize if stages else 0


def _wgmma(bm: int, bn: int, stages: int, min_blocks: int) -> Dict[str, Any]:
    """wgmma TF32 tile config (matmul_wgmma.cu.j2; bk is 32): bm / 64 warpgroups, each
    m64 x bn; the "wgmma" key names the template (config_template)."""
    return {"bm": bm, "bn": bn, "stages": stages, "min_blocks": min_blocks, "wgmma": True}


def wgmma_smem(cfg: Dict[str, Any]) -> int:
    """Dynamic shared memory of a wgmma config: the ring plus 1 KB to align it to 1024."""
    return cfg["stages"] * (cfg["bm"] + cfg["bn"]) * 128 + 1024


def _mma(bm: int, bn: int, bk: int, wm: int, wn: int, stages: int,
         min_blocks: int, frag_pipe: bool = True, trunc_a: bool = False,
         x3: bool = False) -> Dict[str, Any]:
    """mma.sync tile config; trunc_a (TF32 only): A's fragments go to the mma unrounded
    (truncated to TF32, relative error < 2^-10 instead of <= 2^-11; B stays rounded), one
    integer add less per A fragment register; x3 (float32 only): 3xTF32, each operand split
    into two TF32 parts and three mma per fragment pair (float32-level accuracy). Each key
    is present only when set."""
    cfg: Dict[str, Any] = {"bm": bm, "bn": bn, "bk": bk, "wm": wm, "wn": wn, "stages": stages,
                           "frag_pipe": frag_pipe, "min_blocks": min_blocks}
    if trunc_a:
        cfg["tf32_trunc_a"] = True
    if x3:
        cfg["x3"] = True
    return cfg


# -- tile configs ------------------------------------------------------------------------
# SIMT, float32. Threads = (bm / tm) * (bn / tn); warp tile = (wtm * tm) x ((32 / wtm) * tn).
# A 16-byte shared load is served per quarter-warp (8 lanes, 128 bytes); quarter-warps that
# read the same addresses share a wavefront. Row-major lanes on a 4 x 8 lane grid put one
# row in each quarter: A fragment loads take 4 wavefronts, B's 1 (ncu: ~3 per load on the
# 16x8 tile). qa=2 (2 rows x 4 columns per quarter) gives 2 and 2: per k step 12 wavefronts
# instead of 18 on 16x8, 8 instead of 10 on 8x8. qa=4 gives 1 and 4 (also 12 on 16x8).
S_128x128x8_16x8 = _simt(128, 128, 8, 16, 8, 4, 2)   # 128 threads, row-major lanes (old best)
S_256x128x8_16x8 = _simt(256, 128, 8, 16, 8, 4, 1)   # 256 threads, row-major lanes
S_64x128x16 = _simt(64, 128, 16, 8, 8, 4, 2)         # 128 threads, 8x8 per thread
S_128x64x8 = _simt(128, 64, 8, 8, 8, 8, 2)           # 128 threads, 8x8 per thread
S_64x64x8 = _simt(64, 64, 8, 8, 4, 4, 4)             # 128 threads, 8x4 per thread
S_64x64x16 = _simt(64, 64, 16, 4, 4, 4, 2)           # 256 threads, 4x4 per thread
S_32x64x16 = _simt(32, 64, 16, 4, 4, 4, 4)           # 128 threads (small / skinny)
S_128x128x8_16x8_q2 = _simt(128, 128, 8, 16, 8, 4, 2, 2)   # 128 threads
S_128x128x8_16x8_q4 = _simt(128, 128, 8, 16, 8, 4, 2, 4)   # 128 threads
S_128x128x8_8x8_q2 = _simt(128, 128, 8, 8, 8, 4, 2, 2)     # 256 threads, warp 32x64
S_128x256x8_16x8_q2 = _simt(128, 256, 8, 16, 8, 4, 1, 2)   # 256 threads, warp 64x64
S_128x64x8_q2 = _simt(128, 64, 8, 8, 8, 4, 2, 2)           # 128 threads, warp 32x64
S_64x128x8_q2 = _simt(64, 128, 8, 8, 8, 4, 2, 2)           # 128 threads, warp 32x64
S_64x64x8_q2 = _simt(64, 64, 8, 8, 4, 4, 4, 2)             # 128 threads, 8x4, warp 32x32
# Multistage (stages >= 2): cp.async ring of `stages` bk = 16 tiles in dynamic shared memory,
# one barrier per tile, no staging registers (vec float32 only; ptxas sm_90: registers,
# dynamic shared bytes per block, no spills). In the linear layer (B as (N, K), bias_gelu)
# B is copied transposed like A (4-byte copies, rows padded by 4; interior tiles without
# predicates): 64x128 and 128x64 130 regs, 38400 B; 128x128 249 regs, 50688 B; per 16-deep
# tile of 64x128 ~1164 instructions (1024 FFMA), as the GEMM's 1165.
S_128x128x16_16x8_s3 = _simt(128, 128, 16, 16, 8, 4, 2, 0, 3)  # 128 thr, 255 regs, 49920 B
S_128x128x16_8x8_s3 = _simt(128, 128, 16, 8, 8, 4, 2, 2, 3)    # 256 thr, 128 regs, 49920 B
S_128x64x16_s3 = _simt(128, 64, 16, 8, 8, 4, 3, 2, 3)          # 128 thr, 151 regs, 37632 B
S_64x128x16_s3 = _simt(64, 128, 16, 8, 8, 4, 3, 2, 3)             # 128 thr, 149 regs, 37632 B
# Swept on the H200 (perf/NOTES.md, matrix_multiply, S3): the multistage 64x128x16 is the fastest at
# 4096^3 (0.93x cuBLAS), 8192^3 (0.96x) and, split 6, 64x8192x8192 (0.98x).
SIMT_F32 = {
    "large": [S_64x128x16_s3, S_128x128x16_16x8_s3, S_128x128x8_16x8, S_128x256x8_16x8_q2],
    "medium": [S_64x128x16_s3, S_128x64x16_s3, S_128x64x8_q2, S_64x64x8_q2, S_32x64x16],
    "skinny": [S_64x128x16_s3, S_64x64x8_q2, S_64x128x8_q2, S_32x64x16],
    "small": [S_32x64x16],
}
# Earlier SIMT float32 configs, no longer candidates (perf/sweep_matmul.py times them as
# baselines).
SIMT_F32_OLD = [S_256x128x8_16x8, S_64x128x16, S_128x64x8, S_64x64x8, S_64x64x16,
                S_128x128x8_16x8_q4, S_128x128x8_8x8_q2]
# More multistage configs, not candidates (CI does not compile them): the sweep times them.
S_128x128x16_16x8_s4 = _simt(128, 128, 16, 16, 8, 4, 2, 0, 4)     # 255 regs, 66560 B
S_128x128x16_16x8_q2_s3 = _simt(128, 128, 16, 16, 8, 4, 2, 2, 3)  # 255 regs, 49920 B
S_128x256x16_16x8_s3 = _simt(128, 256, 16, 16, 8, 4, 1, 2, 3)     # 256 thr, 255 regs, 74496 B
SIMT_F32_EXTRA = [S_128x128x16_16x8_s4, S_128x128x16_16x8_q2_s3, S_128x256x16_16x8_s3,
                  S_128x128x16_8x8_s3, S_128x128x8_16x8_q2]
# SIMT, float64 (8-byte elements: half the tile depth keeps static shared memory < 48 KB).
D_128x64x8 = _simt(128, 64, 8, 8, 4, 8, 1)       # 256 threads
D_64x64x8 = _simt(64, 64, 8, 8, 4, 4, 2)         # 128 threads
D_32x64x8 = _simt(32, 64, 8, 4, 4, 4, 4)         # 128 threads
SIMT_F64 = {
    "large": [D_128x64x8, D_64x64x8],
    "medium": [D_64x64x8, D_128x64x8],
    "skinny": [D_64x64x8, D_32x64x8],
    "small": [D_32x64x8],
}
# mma.sync, 16-bit inputs: threads = (bm / wm) * (bn / wn) * 32; 64x64 warp tiles.
H_256x128x64 = _mma(256, 128, 64, 64, 64, 3, 1)  # 256 threads, 144 KB
H_256x128x32 = _mma(256, 128, 32, 64, 64, 3, 1)  # 256 threads, 72 KB
H_128x256x64 = _mma(128, 256, 64, 64, 64, 3, 1)  # 256 threads, 144 KB
H_128x128x32 = _mma(128, 128, 32, 64, 64, 4, 2)  # 128 threads, 64 KB
H_64x64x32 = _mma(64, 64, 32, 32, 32, 4, 4)      # 128 threads, 32 KB
MMA_F16 = {
    "large": [H_256x128x64, H_256x128x32, H_128x256x64, H_128x128x32],
    "medium": [H_128x128x32, H_64x64x32],
    "skinny": [H_64x64x32, H_128x128x32],
    "small": [H_64x64x32],
}
# mma.sync, TF32. B fragments are 16-byte shared loads (n permuted inside the warp tile)
# and the rounding is one integer add per fragment register (ptxas drops the mask: the mma
# reads only the TF32 bits), so 64x64 warp tiles fit without fragment double buffering
# (ptxas: 216-218 registers, no spills), one barrier per bk = 32 tile. The tile copy is
# branch-free and issued after the first fragment loads, so it interleaves with the mma
# (per 32-deep tile of 256x128: 370 instructions, 128 HMMA; it was 461 with the copy's
# address arithmetic redone per chunk in front of the first mma).
T_128x256x32 = _mma(128, 256, 32, 64, 64, 3, 1, False)  # 256 threads, 144 KB, 216 regs
T_256x128x32 = _mma(256, 128, 32, 64, 64, 3, 1, False)  # 256 threads, 144 KB, 218 regs
T_128x128x32 = _mma(128, 128, 32, 64, 64, 3, 2, False)  # 128 threads, 96 KB, 216 regs
T_128x128x16_w8 = _mma(128, 128, 16, 32, 64, 4, 1)      # 256 threads, 64 KB, pipelined
T_64x64x16 = _mma(64, 64, 16, 32, 32, 4, 4)             # 128 threads, 32 KB
# wgmma (Hopper only; where K % 4 == 0 and the operands allow 16-byte loads): ptxas sm_90a
# registers, no spills; dynamic shared bytes in comments. Each waits for its wgmma batch
# before the next tile (see the template), so two resident blocks per SM hide each other's
# barrier; 128x256 runs one per SM with the larger tile instead.
W_128x128_s3 = _wgmma(128, 128, 3, 2)    # 256 thr, 126 regs, 99328 B: 2 blocks per SM
W_128x128_s4 = _wgmma(128, 128, 4, 1)    # 256 thr, 126 regs, 132096 B
W_128x256_s4 = _wgmma(128, 256, 4, 1)    # 256 thr, 186 regs, 197632 B
W_128x256_s3 = _wgmma(128, 256, 3, 1)    # 256 thr, 186 regs, 148480 B
W_64x128_s3 = _wgmma(64, 128, 3, 3)      # 128 thr, 126 regs, 74752 B: 3 blocks per SM
W_64x256_s4 = _wgmma(64, 256, 4, 1)      # 128 thr, 186 regs, 164864 B
MMA_TF32 = {
    "large": [W_128x128_s3, W_128x256_s4, W_128x256_s3, W_64x128_s3, W_128x128_s4,
              T_128x256x32, T_256x128x32, T_128x128x32],
    "medium": [W_128x128_s3, W_64x128_s3, T_128x128x32, T_64x64x16],
    "skinny": [W_64x128_s3, T_64x64x16, T_128x128x32],
    "small": [T_64x64x16],
}
# More TF32 configs, not candidates (CI does not compile them): perf/sweep_matmul.py times
# them as well, to decide what the tables should hold.
T_128x256x32_s4 = _mma(128, 256, 32, 64, 64, 4, 1, False)   # 192 KB, 216 regs
T_128x256x16_s4 = _mma(128, 256, 16, 64, 64, 4, 1)          # 96 KB, pipelined, 248 regs
T_128x128x16 = _mma(128, 128, 16, 64, 64, 4, 2, False)      # the earlier 64x64-warp config
# A truncated instead of rounded (trunc_a; 306 instead of 370 instructions per 32-deep tile
# of 256x128, 220 regs): timed to see what the 64 adds per tile cost.
T_256x128x32_ta = _mma(256, 128, 32, 64, 64, 3, 1, False, trunc_a=True)
T_128x256x32_ta = _mma(128, 256, 32, 64, 64, 3, 1, False, trunc_a=True)
T_128x128x32_ta = _mma(128, 128, 32, 64, 64, 3, 2, False, trunc_a=True)
T_128x256x16_s4_ta = _mma(128, 256, 16, 64, 64, 4, 1, trunc_a=True)   # 250 regs
MMA_TF32_EXTRA = [T_128x256x32_s4, T_128x256x16_s4, T_128x128x16, T_256x128x32_ta,
                  T_128x256x32_ta, T_128x128x32_ta, T_128x256x16_s4_ta, T_128x128x16_w8,
                  W_64x256_s4]
# Linear layer only (kc: x and W both (rows, K) row-major, so both tiles are stored
# k-contiguous, rows of bk + 4 floats, by 16-byte cp.async: per 16-deep tile of 64x128 on
# 128 threads 6 LDGSTS.128 per thread instead of 24 4-byte copies; fragments one LDS.128
# per owned row of x / of W per 4 k, 64 LDS.128 per 1024 FFMA; the thread owns interleaved
# rows / columns (stride wtm / 32 / wtm), so each fragment load of a warp reads consecutive
# rows: conflict-free, one wavefront). ptxas sm_90 with bias_gelu, no spills:
# kc=2 (fragments loaded per 4-k group): 168 regs (3 blocks per SM), kc=1 (W's fragments
# prefetched a group ahead): 248 regs (2 blocks per SM). Dynamic shared bytes in comments.
L_64x128x16_kc = _simt(64, 128, 16, 8, 8, 4, 3, 2, 3, kc=2)      # 168 regs, 46080 B
L_64x128x16_kc_s4 = _simt(64, 128, 16, 8, 8, 4, 3, 2, 4, kc=2)   # 168 regs, 61440 B
L_64x128x16_kc1 = _simt(64, 128, 16, 8, 8, 4, 2, 2, 3, kc=1)     # 248 regs, 46080 B
L_64x128x32_kc = _simt(64, 128, 32, 8, 8, 4, 2, 2, 3, kc=2)      # 168 regs, 82944 B
L_128x64x16_kc = _simt(128, 64, 16, 8, 8, 4, 3, 2, 3, kc=2)      # 168 regs, 46080 B
# Configs also rendered for unaligned operands (element loads need more registers; the
# rest would spill or gain nothing there: 16x8 on 128 threads spills 88 bytes, 8x8 on 256
# threads with 2 blocks per SM 84).
SCALAR_OK = (S_128x256x8_16x8_q2, S_128x64x8_q2, S_64x128x8_q2, S_64x64x8_q2, S_32x64x16,
             D_128x64x8, D_64x64x8, D_32x64x8,
             H_128x128x32, H_64x64x32, T_128x128x32, T_64x64x16)
# The one-kernel linear layer (x @ Wᵀ with an epilogue) chooses from these subsets of the
# GEMM tables: the best configs of each class, without split-K, few enough that rendering
# them for every family keeps the variant list short.
# float32: the k-contiguous multistage configs (L_*_kc, above) first, then the multistage
# 128x128 with B (N, K) copied transposed like A (4-byte cp.async; 6.48 ms at 8192x4096x4096
# on the H200, where the 64x128 of that kind was slower), the register-staged 128x256 q2
# kept for large unaligned operands (multistage needs vec).
LINEAR_SIMT_F32 = {
    "large": [S_128x128x16_16x8_s3, S_128x256x8_16x8_q2],
    "medium": [S_128x128x16_16x8_s3, S_64x64x8_q2],
    "skinny": [S_64x64x8_q2, S_32x64x16],
    "small": [S_32x64x16],
}
# The k-contiguous linear configs (kc): correct on the H200 but slower there than the
# transposing 128x128x16 s3 for 8192x4096x4096 (the autotuner chose the latter, 6.46 ms;
# perf/NOTES.md, Linear layers, S3); not candidates, rendered by the tests and kept for sweeps.
LINEAR_SIMT_F32_KC = [L_64x128x16_kc, L_64x128x16_kc1, L_64x128x16_kc_s4, L_64x128x32_kc,
                      L_128x64x16_kc]
LINEAR_SIMT_F64 = {"large": [D_64x64x8], "medium": [D_64x64x8], "skinny": [D_32x64x8],
                   "small": [D_32x64x8]}
LINEAR_MMA_F16 = {
    "large": [H_256x128x64, H_128x256x64, H_256x128x32, H_128x128x32],
    "medium": [H_128x128x32, H_64x64x32],
    "skinny": [H_64x64x32],
    "small": [H_64x64x32],
}
LINEAR_MMA_TF32 = {
    "large": [T_256x128x32, T_128x128x32],
    "medium": [T_128x128x32, T_64x64x16],
    "skinny": [T_64x64x16],
    "small": [T_64x64x16],
}
# 3xTF32 (x3) for the float32 linear layer: float32-level accuracy on tensor cores (x and W
# split into two TF32 parts each, a_s b_b + a_b b_s into a second accumulator set, a_b b_b
# into the first: 3 HMMA per fragment pair, 2 x 64 accumulators per thread on a 32x64 or
# 64x32 warp tile, fragments loaded per k-step). ptxas sm_90 with bias_gelu, vec: registers,
# no spills, in comments (dynamic shared bytes: stages * (bm + bn) * bk * 4). Measured on the
# H200 at 8192x4096x4096 (perf/NOTES.md, Linear layers, S4): 3.86-3.93 ms (the 16x8 s3 SIMT: 6.53,
# matrix_multiply + gelu 5.82, torch FP32 linear 5.47), error 7.9e-6 vs float64 (SIMT 1.8e-6).
X_128x128x32_w32x64 = _mma(128, 128, 32, 32, 64, 3, 1, False, x3=True)   # 256 thr, 96 KB
X_128x128x32_w64x32 = _mma(128, 128, 32, 64, 32, 3, 1, False, x3=True)   # 256 thr, 96 KB
X_128x128x16_w32x64_s4 = _mma(128, 128, 16, 32, 64, 4, 1, False, x3=True)  # 256 thr, 64 KB
X_64x128x32_w32x64 = _mma(64, 128, 32, 32, 64, 3, 2, False, x3=True)     # 128 thr, 72 KB
X_128x64x32_w64x32 = _mma(128, 64, 32, 64, 32, 3, 2, False, x3=True)     # 128 thr, 72 KB
LINEAR_MMA_F32X3 = [X_128x128x32_w32x64, X_128x128x32_w64x32, X_128x128x16_w32x64_s4,
                    X_64x128x32_w32x64, X_128x64x32_w64x32]
# The float32 linear layer's default (precision None / "fp32"): the 3xTF32 configs where
# the operands allow 16-byte loads (they are not rendered for element loads), the SIMT ones
# after them (the only ones left for unaligned operands); precision="ieee" keeps the SIMT
# list alone.
LINEAR_F32 = {
    "large": [X_128x128x32_w64x32, X_64x128x32_w32x64, X_128x128x32_w32x64,
              S_128x128x16_16x8_s3, S_128x256x8_16x8_q2],
    "medium": [X_64x128x32_w32x64, X_128x64x32_w64x32, S_128x128x16_16x8_s3, S_64x64x8_q2],
    "skinny": [X_64x128x32_w32x64, S_64x64x8_q2, S_32x64x16],
    "small": [S_32x64x16],
}
# The float32 GEMM's default (precision None / "fp32": matrix_multiply and matmul_tn, whose
# A given as (K, M) the a_trans x3 kernel reads with m permuted like B's n): 3xTF32 configs
# where the operands allow 16-byte loads, the SIMT ones after them (alone for unaligned
# operands and tiny work); "ieee" keeps SIMT_F32 alone. Without an epilogue the x3 kernels
# split K like the SIMT ones (x3_split_options: wave quantization of outputs with few tiles,
# e.g. dW = Gᵀ X of 3072 x 768 over 8192 rows: 144 tiles of 128 x 128 on 132 SMs).
X3_GEMM = [X_128x128x32_w64x32, X_64x128x32_w32x64, X_128x64x32_w64x32]
F32_DEFAULT = {
    "large": [X_128x128x32_w64x32, X_64x128x32_w32x64] + SIMT_F32["large"],
    "medium": [X_64x128x32_w32x64, X_128x64x32_w64x32] + SIMT_F32["medium"],
    "skinny": [X_64x128x32_w32x64] + SIMT_F32["skinny"],
    "small": list(SIMT_F32["small"]),
}
EPILOGUES = ("bias", "bias_gelu")
# the backward's epilogue: G * GELU'(x Wᵀ + b), G (M, N) given as `grad`
GRAD_EPILOGUE = "bias_gelu_grad"


# -- skinny M: split-K over many blocks (kind "skinny" of matmul_simt.cu.j2) ------------------
def _skinny(mt: int, bn: int, bk: int, tn: int, stages: int, min_blocks: int) -> Dict[str, Any]:
    """Skinny-M split-K config: a block takes mt rows (all of a small M), bn columns and a K
    slice (the autotuned "split" count); bn / tn threads, thread t owning columns
    t + threads j (j < tn) for all mt rows (mt x tn FP32 accumulators); bk-deep tiles in a
    `stages`-deep cp.async ring. The "skinny" key marks the kind (not a template
    parameter)."""
    return {"skinny": True, "mt": mt, "bn": bn, "bk": bk, "tn": tn, "stages": stages,
            "min_blocks": min_blocks}


# With M <= 64 rows the output has M x N elements: 128-wide tiles give N / 128 blocks, each
# walking all of K, so the one-tile kernels leave most SMs idle. These split K over blocks
# (each reads its slice of the weight once, coalesced 16-byte cp.async, x's slice too) and
# write float32 partials to a workspace; a second kernel sums them in a fixed order (no
# atomics: deterministic) and, for the linear layer, adds the bias and applies GELU.
# True FP32 FMA on CUDA cores (the float32 default and precision="ieee"). ptxas sm_90, no
# spills: registers with B as (N, K) / (K, N); dynamic shared bytes in comments.
K_32x256x16_t2 = _skinny(32, 256, 16, 2, 4, 2)   # 128 thr, 252 / 221 regs, 92160 / 75776 B
K_32x128x32_t1 = _skinny(32, 128, 32, 1, 4, 2)   # 128 thr, 158 / 156 regs, 92160 / 83968 B
SKINNY_F32 = [K_32x256x16_t2, K_32x128x32_t1]
SKINNY_MAX_M = 64      # offered where M <= this (and K >= SKINNY_MIN_K), batch 1
SKINNY_MIN_K = 256
SKINNY_MIN_CHUNK = 32  # a block's K slice is at least this long
SKINNY_WAVES = (1, 2, 4)   # split counts timed: about this many blocks per SM


def _family(dtype: CudaDataType, precision: Optional[str]) -> Tuple[str, Dict[str, list]]:
    """(template, candidate lists by class) for a dtype and precision."""
    if dtype is DT.FLOAT64:
        return SIMT_TEMPLATE, SIMT_F64
    if dtype is DT.FLOAT32:
        if precision == "tf32":
            return MMA_TEMPLATE, MMA_TF32
        return SIMT_TEMPLATE, SIMT_F32 if precision == "ieee" else F32_DEFAULT
    return MMA_TEMPLATE, MMA_F16


def _linear_family(dtype: CudaDataType, precision: Optional[str]) -> Tuple[str, Dict[str, list]]:
    """(template, candidate lists by class) of the one-kernel linear layer."""
    template, _ = _family(dtype, precision)
    if dtype is DT.FLOAT64:
        return template, LINEAR_SIMT_F64
    if dtype is DT.FLOAT32:
        if precision == "tf32":
            return template, LINEAR_MMA_TF32
        return template, LINEAR_SIMT_F32 if precision == "ieee" else LINEAR_F32
    return template, LINEAR_MMA_F16


def family(dtype: CudaDataType, precision: Optional[str],
           linear: bool = False) -> Tuple[str, Dict[str, list]]:
    """(template, candidate lists by class) of the GEMM (linear=True: of the one-kernel
    linear layer) for a dtype and normalized precision."""
    return (_linear_family if linear else _family)(dtype, precision)


def config_template(cfg: Dict[str, Any], family_template: str) -> str:
    """The template a config renders: its family's, mma for a 3xTF32 config (x3), which
    sits in the float32 default lists (GEMM and linear layer) beside SIMT ones, wgmma for a
    wgmma one, the cluster kernel for a cluster one."""
    if cfg.get("wgmma"):
        return WGMMA_TEMPLATE
    if cfg.get("cluster"):
        return SKINNY_TEMPLATE
    if cfg.get("skinny"):
        return SIMT_TEMPLATE
    return MMA_TEMPLATE if cfg.get("x3") else family_template


def has_wgmma(info: Any) -> bool:
    """The device runs sm_90a code (Hopper: compute capability 9.0)."""
    return tuple(getattr(info, "compute_capability", (0, 0))) == (9, 0)


def has_clusters(info: Any) -> bool:
    """The device launches thread-block clusters (compute capability >= 9.0), which the
    cluster configs' kernel (matmul_skinny.cu.j2, __cluster_dims__) needs."""
    return tuple(getattr(info, "compute_capability", (0, 0))) >= (9, 0)


def template_runs_on(template: str, info: Any) -> bool:
    """The device can run the template's kernels (warm-ups skip the others): wgmma needs
    sm_90a, the cluster kernel compute capability >= 9.0; the rest run anywhere."""
    if template == WGMMA_TEMPLATE:
        return has_wgmma(info)
    if template == SKINNY_TEMPLATE:
        return has_clusters(info)
    return True


def wgmma_ok(a: CudaTensor, p: Plan) -> bool:
    """The wgmma kernel's operand rules: K a multiple of 4, A 16-byte aligned (B is its own
    transposed copy, the output is stored with bounds checks)."""
    return p.K % 4 == 0 and a.ptr % 16 == 0


def candidates(dtype: CudaDataType, precision: Optional[str], shape_class: str,
               vec: bool, linear: bool = False) -> List[Dict[str, int]]:
    """The tile configs the autotuner chooses from for this dtype, precision and class
    (linear=True: those of the one-kernel linear layer)."""
    _, table = (_linear_family if linear else _family)(dtype, precision)
    cands = list(table[shape_class])
    if not vec:
        cands = [c for c in cands if c in SCALAR_OK] or [table["small"][0]]
    return cands


def all_configs(dtype: CudaDataType, precision: Optional[str]) -> List[Dict[str, int]]:
    """Every distinct config of a family (used by tests and the config sweep)."""
    _, table = _family(dtype, precision)
    out: List[Dict[str, int]] = []
    for cands in table.values():
        for c in cands:
            if c not in out:
                out.append(c)
    return out


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Every parameter set this module renders (CI renders and compiles each)."""
    simt: List[Dict[str, Any]] = []
    mma: List[Dict[str, Any]] = []
    wgmma: List[Dict[str, Any]] = []
    for dt in (DT.FLOAT32, DT.FLOAT64):
        # (float32's default holds the x3 GEMM kernels too: mma, 16-byte loads only)
        for cfg in all_configs(dt, None):
            template = config_template(cfg, SIMT_TEMPLATE)
            for vec in (True, False):
                if vec or cfg in SCALAR_OK:
                    (simt if template == SIMT_TEMPLATE else mma).append(
                        kernel_params(template, dt, cfg, vec))
        simt.append({**dtype_params(dt), "kind": "splitk_reduce", "block_size": REDUCE_BLOCK})
    for dt, prec in ((DT.FLOAT32, "tf32"), (DT.FLOAT16, None), (DT.BFLOAT16, None)):
        for cfg in all_configs(dt, prec):
            if cfg.get("wgmma"):
                wgmma.append(wgmma_params(cfg))
                continue
            for vec in (True, False):
                if vec or cfg in SCALAR_OK:
                    mma.append({**dtype_params(dt), **cfg, "vec": vec})
    # the one-kernel linear layer: only its own configs, with the bias + GELU epilogue
    for dt, prec in ((DT.FLOAT32, None), (DT.FLOAT64, None), (DT.FLOAT32, "tf32"),
                     (DT.FLOAT16, None), (DT.BFLOAT16, None)):
        family, _ = _linear_family(dt, prec)
        for vec in (True, False):
            for cfg in linear_configs(dt, prec, vec):
                template = config_template(cfg, family)
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
            SKINNY_TEMPLATE: cluster}


def wgmma_params(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Template parameters of a wgmma config (float32 in and out)."""
    return {**dtype_params(DT.FLOAT32), "bm": cfg["bm"], "bn": cfg["bn"],
            "stages": cfg["stages"], "min_blocks": cfg["min_blocks"]}


def linear_configs(dtype: CudaDataType, precision: Optional[str],
                   vec: bool) -> List[Dict[str, Any]]:
    """Every config the linear layer may launch for a family and alignment."""
    out: List[Dict[str, Any]] = []
    _, table = _linear_family(dtype, precision)
    for cls in table:
        for c in candidates(dtype, precision, cls, vec, linear=True):
            if c not in out:
                out.append(c)
    return out


def linear_params(template: str, dtype: CudaDataType, cfg: Dict[str, Any], vec: bool,
                  epilogue: str) -> Dict[str, Any]:
    """Template parameters of the linear-layer kernel (B given as (N, K), an epilogue; SIMT:
    kc always given, 0 where the config has none)."""
    params = {**dtype_params(dtype), **cfg, "vec": vec, "a_trans": False, "b_trans": True,
              "epilogue": epilogue}
    if template == SIMT_TEMPLATE:
        return {"kind": "gemm", "kc": 0, **params}
    return params


def tn_params(template: str, dtype: CudaDataType, cfg: Dict[str, Any],
              vec: bool) -> Dict[str, Any]:
    """Template parameters of the A-transposed GEMM (A given as (K, M), B as (K, N), no
    epilogue; a "split" key is not one: dropped)."""
    params = {**dtype_params(dtype), **cfg, "vec": vec, "a_trans": True, "b_trans": False,
              "epilogue": "none"}
    params.pop("split", None)
    if template == SIMT_TEMPLATE:
        return {"kind": "gemm", "kc": 0, **params}
    return params


def has_tn_kernel(dtype: CudaDataType, precision: Optional[str]) -> bool:
    """An a_trans kernel exists for the family: SIMT (float32 on CUDA cores, float64), the
    float32 default's 3xTF32 and the 16-bit mma; TF32 transposes A first."""
    return not (dtype is DT.FLOAT32 and precision == "tf32")


def tn_configs(dtype: CudaDataType, precision: Optional[str],
               vec: bool) -> List[Dict[str, Any]]:
    """Every config the A-transposed GEMM may launch for a family and alignment: the GEMM's
    own (no wgmma, no skinny); none where the family has no a_trans kernel."""
    if not has_tn_kernel(dtype, precision):
        return []
    out: List[Dict[str, Any]] = []
    for c in all_configs(dtype, precision):
        if not c.get("wgmma") and (vec or c in SCALAR_OK) and c not in out:
            out.append(c)
    return out


def kernel_params(template: str, dtype: CudaDataType, cfg: Dict[str, Any], vec: bool,
                  epilogue: Optional[str] = None, a_trans: bool = False) -> Dict[str, Any]:
    """Template parameters of a tiled config's kernel: the plain GEMM, the A-transposed one
    or the linear layer's (epilogue)."""
    if a_trans:
        return tn_params(template, dtype, cfg, vec)
    if epilogue is not None:
        return linear_params(template, dtype, cfg, vec, epilogue)
    if template == SIMT_TEMPLATE:
        return simt_params(dtype, cfg, vec)
    params = {**dtype_params(dtype), **cfg, "vec": vec}
    params.pop("split", None)
    return params


def takes_k_chunk(template: str, cfg: Dict[str, Any], epilogue: Optional[str] = None) -> bool:
    """The config's kernel takes (batch, k_chunk) after the batch strides and splits K: the
    SIMT GEMM and the x3 GEMMs (3xTF32 without an epilogue: matmul_mma.cu.j2's rule)."""
    return template == SIMT_TEMPLATE or (template == MMA_TEMPLATE and bool(cfg.get("x3"))
                                         and epilogue is None)


# -- skinny M (split-K over blocks) --------------------------------------------------------------
def skinny_configs(dtype: CudaDataType, precision: Optional[str]) -> List[Dict[str, Any]]:
    """The skinny-M split-K configs of a family: float32 on CUDA cores (precision None,
    "fp32", "ieee"); none for TF32 and the other dtypes."""
    if dtype is DT.FLOAT32 and precision != "tf32":
        return list(SKINNY_F32)
    return []


def skinny_params(dtype: CudaDataType, cfg: Dict[str, Any], vec: bool,
                  b_trans: bool) -> Dict[str, Any]:
    """Template parameters of a skinny config (b_trans: B given as (N, K), the linear
    layer's weight; "skinny" and "split" are not parameters)."""
    params = {**dtype_params(dtype), "kind": "skinny", **cfg, "vec": vec, "b_trans": b_trans}
    params.pop("skinny", None)
    params.pop("split", None)
    return params


def splitk_epilogue_params(dtype: CudaDataType, epilogue: str) -> Dict[str, Any]:
    """Template parameters of the split-K reduce that adds the bias and applies the linear
    layer's epilogue ('bias' / 'bias_gelu')."""
    return {**dtype_params(dtype), "kind": "splitk_epilogue", "block_size": REDUCE_BLOCK,
            "epilogue": epilogue}


def skinny_threads(cfg: Dict[str, Any]) -> int:
    return cfg["bn"] // cfg["tn"]


def skinny_smem(cfg: Dict[str, Any], b_trans: bool, esize: int = 4) -> int:
    """Dynamic shared memory of a skinny launch: per stage A's mt x (bk + 4) tile and B's,
    bn x (bk + 4) with b_trans (k-contiguous rows), bk x bn without."""
    ks = cfg["bk"] + 4
    w = cfg["bn"] * ks if b_trans else cfg["bk"] * cfg["bn"]
    return cfg["stages"] * (cfg["mt"] * ks + w) * esize


def skinny_tiles(cfg: Dict[str, Any], p: Plan) -> Tuple[int, int]:
    """(row tiles, column tiles) of a skinny launch; grid x = their product, the row tile
    fastest (blocks that read the same slice of B run together)."""
    return -(-p.M // cfg["mt"]), -(-p.N // cfg["bn"])


def skinny_chunk(cfg: Dict[str, Any], K: int, splits: int) -> Tuple[int, int]:
    """(k_chunk, effective splits) for a requested split count: the K slice of a block is a
    whole number of bk-deep tiles (at least one), and every split's slice is non-empty."""
    chunk = -(-K // max(1, splits))
    chunk = max(1, -(-chunk // cfg["bk"])) * cfg["bk"]
    return chunk, max(1, -(-K // chunk))


def skinny_blocks(cfg: Dict[str, Any], p: Plan,
                  splits: int) -> List[Tuple[int, int, int, int, int, int, int]]:
    """The kernel's index math, block by block: (split, m0, m1, n0, n1, k0, k1) per block
    (blockIdx.x = n-tile * tiles_m + m-tile, blockIdx.y = split), the block writing
    work[split][m0:m1][n0:n1] = A[m0:m1, k0:k1] @ B[k0:k1, n0:n1] (for tests)."""
    chunk, s = skinny_chunk(cfg, p.K, splits)
    tiles_m, tiles_n = skinny_tiles(cfg, p)
    out = []
    for y in range(s):
        k0 = y * chunk
        k1 = min(p.K, k0 + chunk)
        for x in range(tiles_m * tiles_n):
            m0 = (x % tiles_m) * cfg["mt"]
            n0 = (x // tiles_m) * cfg["bn"]
            out.append((y, m0, min(p.M, m0 + cfg["mt"]), n0, min(p.N, n0 + cfg["bn"]),
                        k0, k1))
    return out


def skinny_split_options(cfg: Dict[str, Any], p: Plan, sm_count: int,
                         max_y: int = 65535) -> List[int]:
    """Split counts to time for a skinny config: about SKINNY_WAVES blocks per SM, slices of
    at least SKINNY_MIN_CHUNK (rounded to whole tiles), one per effective split, > 1."""
    tiles_m, tiles_n = skinny_tiles(cfg, p)
    most = max(1, min(p.K // SKINNY_MIN_CHUNK, max_y))
    out: List[int] = []
    for waves in SKINNY_WAVES:
        s = min(-(-waves * sm_count // (tiles_m * tiles_n)), most)
        eff = skinny_chunk(cfg, p.K, s)[1]
        if eff > 1 and eff not in out:
            out.append(eff)
    return out


def skinny_candidates(dtype: CudaDataType, precision: Optional[str], p: Plan, sm_count: int,
                      max_y: int = 65535) -> List[Dict[str, Any]]:
    """The autotuner's (skinny config, split) candidates for a call, beside the family's
    own: only for M <= SKINNY_MAX_M, K >= SKINNY_MIN_K, batch 1, float32 on CUDA cores."""
    if p.batch != 1 or not 1 <= p.M <= SKINNY_MAX_M or p.K < SKINNY_MIN_K:
        return []
    return [{**c, "split": s} for c in skinny_configs(dtype, precision)
            for s in skinny_split_options(c, p, sm_count, max_y)]


# -- skinny M, split-K inside a thread-block cluster (matmul_skinny.cu.j2) ---------------------
def _cluster(bn: int, tr: int, tc: int, kw: int, splits: int, bk: int = 32, stages: int = 4,
             min_blocks: int = 1) -> Dict[str, Any]:
    """Cluster split-K config: a block takes 32 rows, bn columns and one of `splits` K slices
    (the cluster size along grid y: the slices' partial tiles are summed in the cluster's
    shared memory, no workspace); each lane a tr x tc accumulator tile, kw warp groups
    splitting each bk-deep tile's k; a `stages`-deep cp.async ring. Every key but "cluster"
    (the kind) is a template parameter: the split count is compiled in."""
    return {"cluster": True, "bn": bn, "tr": tr, "tc": tc, "kw": kw, "bk": bk,
            "stages": stages, "splits": splits, "min_blocks": min_blocks}


# One launch per GEMM for M <= 64: the split-K kernel of SKINNY_F32 without its reduce (a
# second launch and splits x M x N partials through memory). (tr, tc, kw) per lane and warp
# group: threads = 32 (32 / 4 tr) (bn / 8 tc) kw, 128 to 512; CLUSTER_F32 holds every
# bn x tile x split count (the cluster size is compiled in), the calls get the split counts
# near one wave of blocks (cluster_split_choices). Timed on an H100 (cold L2): linear
# 32x1024 -> 4096 + GELU 19.1 us (bn 64, 2 splits, 8x4 kw 4) against the split-K + reduce's
# 24.6, 32x1024 -> 1024 11.8 (bn 64, 8 splits, 4x4 kw 1) against 15.5, matmul
# 32x1024 @ 1024x4096 17.2 against 20.0; 32x4096 -> 1024 at parity (24.3 / 24.2). ptxas
# sm_90, no spills: 87-168 registers, 252 for bn 64 8x8 kw 4 with B (N, K) (128 threads).
CLUSTER_TILES = ((4, 4, 1), (4, 4, 2), (8, 4, 2), (8, 4, 4), (8, 8, 4))
CLUSTER_SPLITS = (1, 2, 4, 8)
CLUSTER_F32 = [_cluster(bn, tr, tc, kw, s) for bn in (64, 128) for tr, tc, kw in CLUSTER_TILES
               for s in CLUSTER_SPLITS]
# Element copies (K, or N of a (K, N) B, not whole 16-byte vectors, or a misaligned pointer):
# the 128-thread bn 64 tiles only, so the rarely fast unaligned case adds few variants.
CLUSTER_F32_SCALAR = [c for c in CLUSTER_F32 if c["bn"] == 64 and
                      (c["tr"], c["tc"], c["kw"]) in ((4, 4, 1), (8, 4, 2))]
CLUSTER_ROWS = 32   # rows per block (MT in the template)


def cluster_configs(vec: bool) -> List[Dict[str, Any]]:
    """The cluster configs rendered for an alignment class (vec: 16-byte copies)."""
    return list(CLUSTER_F32 if vec else CLUSTER_F32_SCALAR)


def cluster_params(dtype: CudaDataType, cfg: Dict[str, Any], vec: bool, b_trans: bool,
                   epilogue: str) -> Dict[str, Any]:
    """Template parameters of a cluster config: B as (N, K) with b_trans (the linear layer's
    weight), the epilogue "none" (matrix_multiply), "bias", "bias_gelu" or
    "bias_gelu_grad" ("cluster" is the kind, not a parameter)."""
    params = {**dtype_params(dtype), **cfg, "vec": vec, "b_trans": b_trans,
              "epilogue": epilogue}
    params.pop("cluster", None)
    return params


def cluster_threads(cfg: Dict[str, Any]) -> int:
    """Threads of a cluster config's block: 32 x (32 / 4 tr) x (bn / 8 tc) x kw."""
    return 32 * (CLUSTER_ROWS // (4 * cfg["tr"])) * (cfg["bn"] // (8 * cfg["tc"])) * cfg["kw"]


def cluster_smem(cfg: Dict[str, Any], b_trans: bool, esize: int = 4) -> int:
    """Dynamic shared memory of a cluster launch: per stage x's 32 x (bk + 4) tile and B's,
    bn x (bk + 4) with b_trans (k-contiguous rows), bk x bn without."""
    ks = cfg["bk"] + 4
    w = cfg["bn"] * ks if b_trans else cfg["bk"] * cfg["bn"]
    return cfg["stages"] * (CLUSTER_ROWS * ks + w) * esize


def cluster_tiles(cfg: Dict[str, Any], p: Plan) -> Tuple[int, int]:
    """(row tiles, column tiles) of a cluster launch: grid x = their product (the row tile
    fastest), grid y = the split count."""
    return -(-p.M // CLUSTER_ROWS), -(-p.N // cfg["bn"])


def cluster_chunk(cfg: Dict[str, Any], K: int) -> int:
    """The K slice of one block (the kernel's k_chunk): ceil(K / splits) rounded up to whole
    bk-deep tiles; the last slices may be short or empty."""
    chunk = -(-K // cfg["splits"])
    return -(-chunk // cfg["bk"]) * cfg["bk"]


def cluster_split_choices(bn: int, bk: int, p: Plan, sm_count: int) -> Tuple[int, ...]:
    """The split counts timed for a column tile width and tile depth, among those of
    CLUSTER_SPLITS whose K slices are all non-empty: the largest whose blocks (tiles x
    splits) fit one wave of SMs (else the smallest) and the next larger one (the H100's best
    configs all ran near one wave)."""
    tiles = -(-p.M // CLUSTER_ROWS) * -(-p.N // bn)
    usable = [s for s in CLUSTER_SPLITS
              if (s - 1) * cluster_chunk({"splits": s, "bk": bk}, p.K) < p.K]
    fit = [s for s in usable if tiles * s <= sm_count]
    lo = max(fit) if fit else usable[0]
    return tuple(s for s in usable if s >= lo)[:2]


def cluster_candidates(dtype: CudaDataType, precision: Optional[str], p: Plan, sm_count: int,
                       compute_capability: Tuple[int, int], vec: bool) -> List[Dict[str, Any]]:
    """The autotuner's cluster configs for a call, beside the family's own and the skinny
    split-K ones: where those are offered (M <= SKINNY_MAX_M, K >= SKINNY_MIN_K, batch 1,
    float32 on CUDA cores) on a device with clusters, at cluster_split_choices' counts; for
    element copies (not vec) only CLUSTER_F32_SCALAR's."""
    if dtype is not DT.FLOAT32 or precision == "tf32" or tuple(compute_capability) < (9, 0):
        return []
    if p.batch != 1 or not 1 <= p.M <= SKINNY_MAX_M or p.K < SKINNY_MIN_K:
        return []
    return [c for c in cluster_configs(vec)
            if c["splits"] in cluster_split_choices(c["bn"], c["bk"], p, sm_count)]


def cluster_blocks(cfg: Dict[str, Any], p: Plan) -> List[Tuple[int, int, int, int, int, int,
                                                                int, int]]:
    """The kernel's block index math (for tests): per block (blockIdx.x, blockIdx.y) the
    rows [m0, m1), columns [n0, n1) and K slice [k0, k1) it multiplies (k1 <= k0: none)
    and the rows [r0, r1) of the tile it sums over the cluster and stores."""
    chunk = cluster_chunk(cfg, p.K)
    tiles_m, tiles_n = cluster_tiles(cfg, p)
    part = CLUSTER_ROWS // cfg["splits"]
    out = []
    for x in range(tiles_m * tiles_n):
        m0 = (x % tiles_m) * CLUSTER_ROWS
        n0 = (x // tiles_m) * cfg["bn"]
        rows = min(CLUSTER_ROWS, p.M - m0)
        for y in range(cfg["splits"]):
            k0 = y * chunk
            out.append((m0, m0 + rows, n0, min(p.N, n0 + cfg["bn"]), k0, min(p.K, k0 + chunk),
                        m0 + min(rows, y * part), m0 + min(rows, (y + 1) * part)))
    return out


# -- shapes -------------------------------------------------------------------------------
class Plan(NamedTuple):
    """Validated geometry of one matmul: (batch, M, N, K), batch strides, output shape."""

    batch: int
    M: int
    N: int
    K: int
    stride_a: int
    stride_b: int
    out_shape: Tuple[int, ...]


def plan_shapes(a_shape: Sequence[int], b_shape: Sequence[int]) -> Plan:
    """NumPy matmul shape rules, restricted to batches that are full or broadcast (all 1)."""
    return _plan(tuple(a_shape), tuple(b_shape))


@functools.lru_cache(maxsize=4096)
def _plan(a_shape: Tuple[int, ...], b_shape: Tuple[int, ...]) -> Plan:
    if len(a_shape) == 0 or len(b_shape) == 0:
        raise InvalidArgumentError(
            f"matmul needs operands with at least 1 dimension, got shapes {a_shape} and "
            f"{b_shape} (use multiply for scalars)")
    a2 = (1,) + a_shape if len(a_shape) == 1 else a_shape
    b2 = b_shape + (1,) if len(b_shape) == 1 else b_shape
    if a2[-1] != b2[-2]:
        raise ShapeMismatchError(
            f"matmul: inner dimensions differ: a has shape {a_shape} (K={a2[-1]}) and b has "
            f"shape {b_shape} (K={b2[-2]}); a's last dimension must equal b's "
            f"{'only' if len(b_shape) == 1 else 'second-to-last'} dimension")
    M, K, N = a2[-2], a2[-1], b2[-1]
    a_batch, b_batch = a2[:-2], b2[:-2]
    try:
        batch_shape = common.broadcast_shapes(a_batch, b_batch)
    except ShapeMismatchError as exc:
        raise ShapeMismatchError(
            f"matmul: batch dimensions of a {a_shape} and b {b_shape} do not broadcast: "
            f"{exc}") from None
    batch = math.prod(batch_shape)
    strides = []
    for name, shp, mat in (("a", a_shape, M * K), ("b", b_shape, K * N)):
        own = (shp[:-2] if len(shp) > 2 else ())
        padded = (1,) * (len(batch_shape) - len(own)) + own
        if all(d == 1 for d in padded):
            strides.append(0)
        elif padded == batch_shape:
            strides.append(mat)
        else:
            raise InvalidArgumentError(
                f"matmul: batch dimensions of shapes {a_shape} and {b_shape} broadcast to "
                f"{batch_shape}, but {name}'s batch {own} is neither all of it nor all ones "
                f"(partial batch broadcasting is not supported; expand {name} first)")
    out_shape = batch_shape + ((M,) if len(a_shape) > 1 else ()) + \
        ((N,) if len(b_shape) > 1 else ())
    return Plan(batch, M, N, K, strides[0], strides[1], out_shape)


def normalize_precision(precision: Any, dtype: CudaDataType) -> Optional[str]:
    """None / 'fp32' / 'highest' -> float32-level arithmetic of the dtype (float32: 3xTF32 or
    CUDA cores); 'ieee' -> CUDA cores only; 'tf32' -> TF32 (float32 only)."""
    key = precision.lower() if isinstance(precision, str) else precision
    if not (key is None or isinstance(key, str)) or key not in _PRECISIONS:
        raise InvalidArgumentError(
            f"precision must be None, 'fp32' (alias 'highest'), 'ieee' or 'tf32', got "
            f"{precision!r}")
    prec = _PRECISIONS[key]
    if prec == "tf32" and dtype is not DT.FLOAT32:
        raise InvalidArgumentError(
            f"precision='tf32' applies to float32 operands only, got {dtype.name_str}")
    return prec


def shape_class(p: Plan, sm_count: int) -> str:
    """'small' (tiny work), 'skinny' (M or N <= 64), 'large' (>= 2 waves of 128x128 tiles),
    else 'medium'."""
    work = p.batch * p.M * p.N * p.K
    if work <= 256 * 256 * 256:
        return "small"
    if min(p.M, p.N) <= 64:
        return "skinny"
    tiles = p.batch * -(-p.M // 128) * -(-p.N // 128)
    return "large" if tiles >= 2 * sm_count else "medium"


def _bucket(x: int) -> int:
    return max(0, int(x) - 1).bit_length()


# -- entry point ----------------------------------------------------------------------------
def matmul(m: Any, a: CudaTensor, b: CudaTensor, precision: Optional[str] = None,
           out: Optional[CudaTensor] = None) -> CudaTensor:
    """a @ b with NumPy's matmul shape rules (batch: full or broadcast). float32 is
    float32-accurate by default (3xTF32 tensor-core or CUDA-core configs, the faster timed),
    precision='ieee' CUDA cores only, 'tf32' TF32; float16/bfloat16 use tensor cores with
    float32 accumulation; float64 runs on CUDA cores. out= (optional) receives the result."""
    if out is None and type(a) is CudaTensor and type(b) is CudaTensor and \
            (precision is None or type(precision) is str):
        plans = getattr(m, "plans", None)
        fast = None if plans is None else plans.get(
            ("matmul", a.shape, b.shape, a.dtype, b.dtype, a.device_id, b.device_id, precision))
        if fast is not None and m.backend.direct_launch(a.device_id):
            res = fast(a, b, None)
            if res is not None:
                return res
    common.check_tensor(a, "a")
    common.check_tensor(b, "b")
    dtype = common.same_dtype(a, b)
    common.require_dtype(a, common.FLOATS, "matmul")
    prec = normalize_precision(precision, dtype)
    dev = common.same_device(a, b)
    p = plan_shapes(a.shape, b.shape)
    if out is not None:
        _check_out(out, a, b, dtype, dev, p)
    else:
        out = m.backend.empty(p.out_shape, dtype, dev)
    if out.size == 0:
        return out
    if not m.gpu:
        _fallback(m, a, b, out, p, prec)
        return out
    if p.K == 0:
        _fill_zero(m, out, dev)
        return out
    vec = _launch(m, a, b, out, p, dtype, prec, dev)
    if type(a) is CudaTensor and type(b) is CudaTensor and \
            (precision is None or type(precision) is str):
        remember(m, ("matmul", a.shape, b.shape, dtype, dtype, dev, dev, precision), p, dtype,
                 prec, dev, vec, p.out_shape)
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
    if out.nbytes:
        lo, hi = out.ptr, out.ptr + out.nbytes
        for name, t in (("a", a), ("b", b)):
            if t.nbytes and t.ptr < hi and lo < t.ptr + t.nbytes:
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
        if out.nbytes:
            named: Tuple[Tuple[str, Optional[CudaTensor]], ...] = (
                ("x", x), ("weight", weight), ("bias", bias), ("grad", grad))
            for name, opnd in named:
                if opnd is not None and opnd.nbytes and opnd.ptr < out.ptr + out.nbytes \
                        and out.ptr < opnd.ptr + opnd.nbytes:
                    raise InvalidArgumentError(
                        f"out overlaps operand {name}; use a separate tensor")
    if out.size == 0:
        return out
    if not m.gpu:
        _linear_fallback(m, x, weight, bias, out, epilogue, prec, grad)
        return out
    _launch(m, x, weight, out, p, dtype, prec, dev, epilogue=epilogue, bias=bias, grad=grad)
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


def matmul_tn(m: Any, a: CudaTensor, b: CudaTensor, precision: Optional[str] = None,
              out: Optional[CudaTensor] = None) -> CudaTensor:
    """aᵀ @ b for a given as (..., K, M) and b as (..., K, N) -> (..., M, N) (batches full or
    broadcast, as matmul's), without a transposed copy of a: the a_trans kernels read its
    tiles along M (split-K as the GEMM's, for a long K such as a batch of rows). Precision
    as matmul's (float32: 3xTF32 or CUDA cores by default, 'ieee' CUDA cores only); TF32
    transposes a into a pool block first and runs the plain GEMM."""
    if out is None and type(a) is CudaTensor and type(b) is CudaTensor and \
            (precision is None or type(precision) is str):
        plans = getattr(m, "plans", None)
        fast = None if plans is None else plans.get(
            ("matmul_tn", a.shape, b.shape, a.dtype, b.dtype, a.device_id, b.device_id,
             precision))
        if fast is not None and m.backend.direct_launch(a.device_id):
            res = fast(a, b, None)
            if res is not None:
                return res
    dtype, prec, dev = _check_pair(a, b, precision, "matmul_tn")
    p = plan_shapes(_swapped(a.shape), b.shape)
    if out is not None:
        _check_out(out, a, b, dtype, dev, p)
    else:
        out = m.backend.empty(p.out_shape, dtype, dev)
    if out.size == 0:
        return out
    if not m.gpu:
        _fallback(m, a, b, out, p, prec, a_trans=True)
        return out
    if p.K == 0:
        _fill_zero(m, out, dev)
        return out
    if not has_tn_kernel(dtype, prec):
        from . import transpose as tr
        at = tr.transpose(m, a)   # (..., M, K) in a pool block
        try:
            _launch(m, at, b, out, p, dtype, prec, dev)
        finally:
            at.free()   # back to the pool; later work on this stream is ordered after
        return out
    vec = _launch(m, a, b, out, p, dtype, prec, dev, a_trans=True)
    if type(a) is CudaTensor and type(b) is CudaTensor and \
            (precision is None or type(precision) is str):
        remember(m, ("matmul_tn", a.shape, b.shape, dtype, dtype, dev, dev, precision), p,
                 dtype, prec, dev, vec, p.out_shape, a_trans=True)
    return out


def matmul_nt(m: Any, a: CudaTensor, b: CudaTensor, precision: Optional[str] = None,
              out: Optional[CudaTensor] = None) -> CudaTensor:
    """a @ bᵀ for a given as (..., M, K) and b as (..., N, K) -> (..., M, N) (batches full or
    broadcast, as matmul's), without a transposed copy of b: the linear-layer kernels
    (b_trans, a null bias; one K split; the skinny split-K and cluster ones for few rows).
    Precision as the linear layer's: float32 is float32-accurate by default (3xTF32 or CUDA
    cores, LINEAR_F32), 'ieee' CUDA cores only, 'tf32' TF32."""
    if out is None and type(a) is CudaTensor and type(b) is CudaTensor and \
            (precision is None or type(precision) is str):
        plans = getattr(m, "plans", None)
        fast = None if plans is None else plans.get(
            ("matmul_nt", a.shape, b.shape, a.dtype, b.dtype, a.device_id, b.device_id,
             precision))
        if fast is not None and m.backend.direct_launch(a.device_id):
            res = fast(a, b, None)
            if res is not None:
                return res
    dtype, prec, dev = _check_pair(a, b, precision, "matmul_nt")
    p = plan_shapes(a.shape, _swapped(b.shape))
    if out is not None:
        _check_out(out, a, b, dtype, dev, p)
    else:
        out = m.backend.empty(p.out_shape, dtype, dev)
    if out.size == 0:
        return out
    if not m.gpu:
        _fallback(m, a, b, out, p, prec, b_trans=True)
        return out
    if p.K == 0:
        _fill_zero(m, out, dev)
        return out
    vec = _launch(m, a, b, out, p, dtype, prec, dev, epilogue="bias")
    if type(a) is CudaTensor and type(b) is CudaTensor and \
            (precision is None or type(precision) is str):
        remember(m, ("matmul_nt", a.shape, b.shape, dtype, dtype, dev, dev, precision), p,
                 dtype, prec, dev, vec, p.out_shape, "bias")
    return out


# -- fallback (NumPy) ------------------------------------------------------------------------
def _round_tf32(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest TF32 value, ties away from zero (what cvt.rna.tf32.f32 does)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    finite = np.isfinite(x)
    rounded = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(finite, rounded, x).astype(np.float32)


def _fallback(m: Any, a: CudaTensor, b: CudaTensor, out: CudaTensor, p: Plan,
              prec: Optional[str], a_trans: bool = False, b_trans: bool = False) -> None:
    """out = a @ b in NumPy (a_trans / b_trans: that operand given transposed, its last two
    axes swapped here)."""
    work = np.float64 if out.dtype is DT.FLOAT64 else np.float32
    ah = common.host_array(m, a).astype(work, copy=False)
    bh = common.host_array(m, b).astype(work, copy=False)
    if a_trans:
        ah = np.swapaxes(ah, -1, -2)
    if b_trans:
        bh = np.swapaxes(bh, -1, -2)
    if prec == "tf32":
        ah, bh = _round_tf32(ah), _round_tf32(bh)
    if p.K == 0:
        res = np.zeros(p.out_shape, work)
    else:
        with np.errstate(all="ignore"):  # NaN/inf operands, as on the GPU
            res = np.matmul(ah, bh).reshape(p.out_shape)
    if out.dtype is DT.BFLOAT16:
        host = to_bfloat16_bits(res.astype(np.float32)).reshape(p.out_shape)
    else:
        host = np.ascontiguousarray(res, dtype=out.dtype.numpy_dtype)
    m.backend.copy_to_device(host, out)


def reference(a: Any, b: Any) -> np.ndarray:
    """a @ b in float64 NumPy (2-D, or batched 3-D with a broadcast batch)."""
    with np.errstate(all="ignore"):
        return np.matmul(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))


def gelu_tanh(z: np.ndarray) -> np.ndarray:
    """0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))), written as the kernels compute it."""
    with np.errstate(all="ignore"):
        return z / (1.0 + np.exp(-1.5957691216057308 * (z + 0.044715 * z * z * z)))


def gelu_tanh_grad(z: np.ndarray) -> np.ndarray:
    """d gelu_tanh(z) / dz, written as the kernels compute it: s + z s (1 - s) u',
    s = sigmoid(u), u = 2 sqrt(2/pi) (z + 0.044715 z^3), 1 - s as sigmoid(-u), the second
    term 0 where s (1 - s) is."""
    with np.errstate(all="ignore"):
        z2 = z * z
        u = 1.5957691216057308 * z * (1.0 + 0.044715 * z2)
        s = 1.0 / (1.0 + np.exp(-u))
        q = 1.0 / (1.0 + np.exp(u))
        sq = s * q
        du = 1.5957691216057308 * (1.0 + 0.134145 * z2)
        return s + np.where(sq == 0, 0.0, z * sq * du)


def _linear_fallback(m: Any, x: CudaTensor, w: CudaTensor, bias: Optional[CudaTensor],
                     out: CudaTensor, epilogue: str, prec: Optional[str],
                     grad: Optional[CudaTensor] = None) -> None:
    xh = common.host_array(m, x).astype(np.float32 if prec == "tf32" else np.float64)
    wh = common.host_array(m, w).astype(xh.dtype)
    if prec == "tf32":
        xh, wh = _round_tf32(xh), _round_tf32(wh)
    with np.errstate(all="ignore"):
        res = xh.astype(np.float64) @ wh.astype(np.float64).T
        if bias is not None:
            res = res + common.host_array(m, bias).astype(np.float64)
    if epilogue == "bias_gelu":
        res = gelu_tanh(res)
    elif epilogue == GRAD_EPILOGUE:
        with np.errstate(all="ignore"):
            assert grad is not None, "the gradient epilogue reads G"
            res = common.host_array(m, grad).astype(np.float64) * gelu_tanh_grad(res)
    if out.dtype is DT.BFLOAT16:
        host = to_bfloat16_bits(res.astype(np.float32)).reshape(out.shape)
    else:
        host = np.ascontiguousarray(res, dtype=out.dtype.numpy_dtype)
    m.backend.copy_to_device(host, out)


# -- GPU ------------------------------------------------------------------------------------
def _fill_zero(m: Any, out: CudaTensor, dev: int) -> None:
    """out[:] = 0 with the seed's fill kernel (K == 0: an empty sum)."""
    kernel = _kernel(m, FILL_TEMPLATE, dev, {**dtype_params(out.dtype), "block_size": 256})
    sms = m.backend.get_device_info(dev).multiprocessor_count
    grid = common.grid_1d(out.size, 256, sms)
    m.backend.launch_kernel(kernel.name, (grid, 1, 1), out, 0.0, out.size,
                            block_size=(256, 1, 1), device_id=dev)


def is_vec_ok(a: CudaTensor, b: CudaTensor, out: CudaTensor, p: Plan,
              a_trans: bool = False) -> bool:
    """16-byte loads/stores are legal: K (M where A is given as (K, M)) and N whole vectors,
    every pointer 16-byte aligned."""
    vw = 16 // out.dtype.itemsize
    return ((p.M if a_trans else p.K) % vw == 0 and p.N % vw == 0
            and a.ptr % 16 == 0 and b.ptr % 16 == 0 and out.ptr % 16 == 0)


# Per-CudaMath memo: (plan, dtype, precision, device, vec) -> (template, config), and
# (template, device, params) -> kernel, so a repeated call skips the autotuner's lookup and
# the generator's JSON key (tens of microseconds of Python per call otherwise).
_memo: "weakref.WeakKeyDictionary[Any, Dict[Any, Any]]" = weakref.WeakKeyDictionary()


def _cache(m: Any) -> Dict[Any, Any]:
    c = _memo.get(m)
    if c is None:
        c = _memo[m] = {}
    return c


def _kernel(m: Any, template: str, dev: int, params: Dict[str, Any]) -> Any:
    """m.kernel(template, dev, **params), memoized by the parameter items."""
    cache = _cache(m)
    key = (template, dev, tuple(sorted(params.items())))
    k = cache.get(key)
    if k is None:
        k = cache[key] = m.kernel(template, dev, **params)
    return k


def compile_kernel(m: Any, template: str, dev: int, params: Dict[str, Any]) -> Any:
    """The memoized kernel getter of this module (common.compile_all's `get`)."""
    return _kernel(m, template, dev, params)


def config_key(p: Plan, dtype: CudaDataType, prec: Optional[str], dev: int, vec: bool,
               epilogue: Optional[str] = None, a_trans: bool = False) -> tuple:
    """The per-CudaMath memo key of a call's chosen config (_launch, remember)."""
    if a_trans:
        return ("tn", p, dtype, prec, dev, vec)
    if epilogue is None:
        return (p, dtype, prec, dev, vec)
    return ("linear", p, dtype, prec, dev, vec, epilogue)


def _launch(m: Any, a: CudaTensor, b: CudaTensor, out: CudaTensor, p: Plan,
            dtype: CudaDataType, prec: Optional[str], dev: int, epilogue: Optional[str] = None,
            bias: Optional[CudaTensor] = None, a_trans: bool = False,
            grad: Optional[CudaTensor] = None) -> bool:
    """Launch the call's (autotuned) config; returns vec (the plan's alignment class).
    a_trans: A given as (K, M) (the GEMM's configs, split-K included; no wgmma, no skinny).
    The float32 default's GEMM candidates are (config, split) pairs of x3 and SIMT configs."""
    vec = is_vec_ok(a, b, out, p, a_trans)
    cache = _cache(m)
    key = config_key(p, dtype, prec, dev, vec, epilogue, a_trans)
    hit = cache.get(key)
    if hit is None:
        sms = m.backend.get_device_info(dev).multiprocessor_count
        cls = shape_class(p, sms)
        is_linear = epilogue is not None
        template, _ = _family(dtype, prec)
        cands = candidates(dtype, prec, cls, vec, linear=is_linear)
        if a_trans or not (has_wgmma(m.backend.get_device_info(dev)) and wgmma_ok(a, p)):
            cands = [c for c in cands if not c.get("wgmma")] or \
                [c for c in _family(dtype, prec)[1]["small"] if not c.get("wgmma")]
        if template == SIMT_TEMPLATE and not is_linear:
            # (config, split) pairs: split-K counts are measured, not only modelled
            info = m.backend.get_device_info(dev)
            max_z = info.max_grid_dims[2]

            def per_sm(c: Dict[str, Any]) -> int:   # (SIMT configs; x3: x3_split_options)
                kern = _kernel(m, SIMT_TEMPLATE, dev,
                               kernel_params(SIMT_TEMPLATE, dtype, c, vec, a_trans=a_trans))
                return blocks_per_sm(c, getattr(kern, "num_regs", 0), info, dtype.itemsize,
                                     getattr(kern, "static_shared_bytes", 0))

            cands = split_candidates(cands, p, cls, sms, max_z, per_sm)
        if template == SIMT_TEMPLATE and not a_trans:
            # small M: the skinny split-K configs too, each at its split counts, and on sm_90+
            # the cluster ones (timed against the family's own, never forced)
            info = m.backend.get_device_info(dev)
            cands = cands + skinny_candidates(dtype, prec, p, sms, info.max_grid_dims[1]) + \
                cluster_candidates(dtype, prec, p, sms,
                                   getattr(info, "compute_capability", (0, 0)), vec)
        op = _op_name(template, dtype, prec, is_linear) + ("_at" if a_trans else "") + \
            ("_gelugrad" if epilogue == GRAD_EPILOGUE else "")
        shape_key = tune_key(p, cls, vec, prec)

        def run(c: Dict[str, int]) -> None:
            run_config(m, config_template(c, template), c, a, b, out, p, dtype, vec, dev,
                       epilogue=epilogue, bias=bias, a_trans=a_trans, grad=grad)

        # 10 timed runs each: with 3, clock and power swings on 8192^3 tensor-core runs
        # picked a config 20% slower than the best (seen on an H200).
        cfg = m.autotuner.pick(op, shape_key, cands, run, device_id=dev, repeats=10) \
            if len(cands) > 1 else cands[0]
        hit = cache[key] = (config_template(cfg, template), cfg)
    run_config(m, hit[0], hit[1], a, b, out, p, dtype, vec, dev, epilogue=epilogue, bias=bias,
               a_trans=a_trans, grad=grad)
    return vec


def tune_key(p: Plan, shape_cls: str, vec: bool, prec: Optional[str]) -> List[Any]:
    """The autotuner's shape class of a call. TF32 adds the batch's bucket: the wgmma
    configs first transpose every B plane, and batches over the grid's z limit take several
    launches, so a choice timed at one batch does not carry to a much larger one."""
    key: List[Any] = [shape_cls, vec, _bucket(p.M), _bucket(p.N), _bucket(p.K), p.batch > 1]
    if prec == "tf32":
        key.append(_bucket(p.batch))
    return key


def _op_name(template: str, dtype: CudaDataType, prec: Optional[str], linear: bool) -> str:
    """The autotuner's name for a candidate set (each distinct set has its own choices)."""
    if dtype is DT.FLOAT32 and prec in (None, "fp32"):
        # 3xTF32 and SIMT configs (LINEAR_F32, F32_DEFAULT)
        return "linear_x3simt_float32" if linear else "matmul_x3simt_float32"
    kind = "simt" if template == SIMT_TEMPLATE else "mma"
    return f"{'linear' if linear else 'matmul'}_{kind}_{dtype.name_str}" \
           f"{'_tf32' if prec == 'tf32' else ''}"


def blocks_per_sm(cfg: Dict[str, int], regs: int = 0, info: Any = None, esize: int = 4,
                  static_smem: int = 0) -> int:
    """Resident blocks of a SIMT config per SM (occupancy.blocks_per_sm on the device's
    limits, info None: Hopper's) for its compiled registers and static shared memory plus
    the multistage loader's dynamic shared memory; regs = 0: the config's
    __launch_bounds__ minimum."""
    if regs <= 0:
        return cfg["min_blocks"]
    threads = (cfg["bm"] // cfg["tm"]) * (cfg["bn"] // cfg["tn"])
    return occupancy.blocks_per_sm(occupancy.KernelResources(regs, static_smem), info, threads,
                                   simt_smem(cfg, esize))


def simt_params(dtype: CudaDataType, cfg: Dict[str, Any], vec: bool) -> Dict[str, Any]:
    """Template parameters of a SIMT GEMM config (a "split" key is not one: dropped)."""
    params = {**dtype_params(dtype), **cfg, "vec": vec, "kind": "gemm"}
    params.pop("split", None)
    return params


# Split-K counts the autotuner times besides the modelled one, where split-K is in play;
# for M <= SKINNY_MAX_M (few output tiles) also SPLIT_TRIES_SMALL_M, with K chunks >= 128.
SPLIT_TRIES = (1, 2, 3, 4, 6, 8)
SPLIT_TRIES_SMALL_M = (12, 16)


def effective_split(cfg: Dict[str, Any], K: int, splits: int) -> int:
    """The number of K chunks run_config launches for a requested split count."""
    chunk = -(-K // max(1, splits))
    chunk = -(-chunk // cfg["bk"]) * cfg["bk"]
    return -(-K // chunk)


def split_options(cfg: Dict[str, Any], p: Plan, shape_cls: str, sm_count: int,
                  max_z: int = 65535, per_sm: int = 0) -> List[int]:
    """Split-K counts to time for a SIMT config: the modelled one (split_count) first; where
    split-K is in play (K >= 512 and a skinny / medium / small class, a modelled split > 1,
    or fewer blocks than 2 waves) also SPLIT_TRIES, capped by K // 256, 16 and
    max_z // batch, one per effective split; for M <= SKINNY_MAX_M (N / bn blocks or so per
    split) also SPLIT_TRIES_SMALL_M, capped by K // 128 instead of K // 256."""
    per_sm = per_sm or cfg["min_blocks"]
    modelled = split_count(cfg, p, sm_count, max_z, per_sm)
    blocks = p.batch * -(-p.M // cfg["bm"]) * -(-p.N // cfg["bn"])
    in_play = p.K >= 512 and (shape_cls in ("skinny", "medium", "small") or modelled > 1
                              or blocks < 2 * sm_count * per_sm)
    if not in_play:
        return [modelled]
    small_m = p.M <= SKINNY_MAX_M
    most = max(1, min(p.K // (128 if small_m else 256), 16, max_z // max(1, p.batch)))
    tries = SPLIT_TRIES + (SPLIT_TRIES_SMALL_M if small_m else ())
    out: List[int] = []
    for s in (modelled,) + tries:
        if s <= most:
            eff = effective_split(cfg, p.K, s)
            if eff not in out:
                out.append(eff)
    return out


def split_candidates(cands: Sequence[Dict[str, Any]], p: Plan, shape_cls: str,
                     sm_count: int, max_z: int = 65535,
                     per_sm: Any = None) -> List[Dict[str, Any]]:
    """The autotuner's (config, split) candidates of the GEMM: each SIMT config with a
    "split" key per split_options count, each x3 one per x3_split_options count (run_config
    takes it out before rendering). per_sm(cfg): a SIMT config's resident blocks per SM
    (None: the configs' min_blocks)."""
    out: List[Dict[str, Any]] = []
    for c in cands:
        if c.get("x3"):
            splits = x3_split_options(c, p, sm_count, max_z)
        else:
            ps = per_sm(c) if per_sm is not None else 0
            splits = split_options(c, p, shape_cls, sm_count, max_z, ps)
        for s in splits:
            out.append({**c, "split": s})
    return out


# The x3 GEMMs' split-K model: one SM's 3xTF32 rate (the linear layer's x3 kernels held
# 213 TF/s of mma.sync on the H200, 3 mma per product over 132 SMs), the split counts
# modelled, the shortest K slice.
X3_SM_FLOPS = 213e12 / 3 / 132
X3_SPLITS = tuple(range(2, 17))
X3_MIN_CHUNK = 256


def x3_split_time(cfg: Dict[str, Any], p: Plan, sm_count: int, splits: int) -> float:
    """Modelled seconds of an x3 GEMM config at a split count: the busiest SM runs
    ceil(blocks / (SMs x min_blocks)) waves of min_blocks blocks sharing its tensor cores,
    each over (K slice + 64) k, plus for splits > 1 the partials written and summed
    (2 x splits x batch M N words at ~3 TB/s, + 4 us for the reduce's launch)."""
    chunk = -(-p.K // splits)
    chunk = -(-chunk // cfg["bk"]) * cfg["bk"]
    per_sm = cfg["min_blocks"]
    blocks = p.batch * -(-p.M // cfg["bm"]) * -(-p.N // cfg["bn"]) * splits
    waves = -(-blocks // (sm_count * per_sm))
    t = waves * per_sm * 2.0 * cfg["bm"] * cfg["bn"] * (chunk + 64) / X3_SM_FLOPS
    if splits > 1:
        t += 2.0 * splits * p.batch * p.M * p.N * 4 / 3e12 + 4e-6
    return t


def x3_split_options(cfg: Dict[str, Any], p: Plan, sm_count: int,
                     max_z: int = 65535) -> List[int]:
    """Split-K counts to time for an x3 GEMM config: 1 (no workspace), then at most two
    effective counts of X3_SPLITS (K slices >= X3_MIN_CHUNK, splits x batch <= max_z) that
    x3_split_time puts >= 3 % below one split, the fastest first: outputs of few tiles
    (wave quantization) or few blocks."""
    most = max(1, min(p.K // X3_MIN_CHUNK, max(X3_SPLITS), max_z // max(1, p.batch)))
    t1 = x3_split_time(cfg, p, sm_count, 1)
    timed: List[Tuple[float, int]] = []
    for s in X3_SPLITS:
        if s > most:
            break
        eff = effective_split(cfg, p.K, s)
        if eff > 1 and all(eff != e for _, e in timed):
            timed.append((x3_split_time(cfg, p, sm_count, eff), eff))
    return [1] + [e for t, e in sorted(timed)[:2] if t < 0.97 * t1]


def split_count(cfg: Dict[str, int], p: Plan, sm_count: int, max_z: int = 65535,
                per_sm: int = 0) -> int:
    """Split-K factor for the SIMT kernel (chunks >= 256 of K, at most 16): the one with the
    least modelled time. Model: the busiest SM runs ceil(blocks / SMs) blocks of
    (K / splits + 64) k-steps each, at full rate from 8 resident warps on (less below), plus
    the reduce pass (partials written and read: 2 * splits * M * N words at ~3 TB/s, +4 us).
    per_sm: resident blocks per SM (0: the config's min_blocks)."""
    if p.K < 512:
        return 1
    per_sm = per_sm or cfg["min_blocks"]
    threads = (cfg["bm"] // cfg["tm"]) * (cfg["bn"] // cfg["tn"])
    blocks = p.batch * -(-p.M // cfg["bm"]) * -(-p.N // cfg["bn"])
    most = min(p.K // 256, 16, max(1, max_z // p.batch))
    # seconds per k-step of one block at the SM's full FFMA rate (~60 % of 256 flop/clk/SM
    # at 1.98 GHz); the model's absolute scale only matters against the reduce cost
    step_s = 2.0 * cfg["bm"] * cfg["bn"] / (0.6 * 256 * 1.98e9)
    best, best_t = 1, float("inf")
    for s in range(1, max(1, most) + 1):
        chunk = -(-p.K // s)
        chunk = -(-chunk // cfg["bk"]) * cfg["bk"]
        s_eff = -(-p.K // chunk)
        if s_eff != s:
            continue
        n_max = -(-blocks * s // sm_count)
        warps = min(n_max, per_sm) * threads // 32
        rate = min(1.0, warps / 8.0)
        t = n_max * (chunk + 64) * step_s / rate
        if s > 1:
            t += 2.0 * s * p.batch * p.M * p.N * 4 / 3e12 + 4e-6
        if t < best_t * 0.97:   # a split must win by 3 % (the model is rough)
            best, best_t = s, t
    return best


def run_config(m: Any, template: str, cfg: Dict[str, int], a: CudaTensor, b: CudaTensor,
               out: CudaTensor, p: Plan, dtype: CudaDataType, vec: bool, dev: int,
               splits: Optional[int] = None, epilogue: Optional[str] = None,
               bias: Optional[CudaTensor] = None, a_trans: bool = False,
               grad: Optional[CudaTensor] = None) -> None:
    """Launch one config over the whole problem (split-K and batch chunking included).
    epilogue ('bias' / 'bias_gelu' / 'bias_gelu_grad' with grad): the linear-layer kernel
    instead, b given as (N, K) and bias (N,) or None, in one launch (no split-K); a skinny
    config (batch 1): its split-K kernel and the reduce that sums the partials (and adds the
    bias, applies the epilogue), splits (or the config's "split") the K slices. a_trans: a
    given as (K, M) (the SIMT and 16-bit mma kernels; no epilogue). A cluster config: its
    one launch, at its own split count (`splits`, if given, must equal it)."""
    backend = m.backend
    if cfg.get("cluster"):
        if splits is not None and splits != cfg["splits"]:
            raise InvalidArgumentError(
                f"a cluster config runs at its own split count (the cluster size, "
                f"{cfg['splits']}), got splits={splits}")
        _run_cluster(m, cfg, a, b, out, p, dtype, vec, dev, epilogue, bias, grad)
        return
    info = backend.get_device_info(dev)
    max_z = info.max_grid_dims[2]
    if cfg.get("skinny"):   # split-K over blocks, then the reduce (with the epilogue)
        cfg = dict(cfg)
        tuned = cfg.pop("split", None)
        _run_skinny(m, cfg, a, b, out, p, dtype, vec, dev, tuned if splits is None else splits,
                    epilogue, bias, grad)
        return
    if "split" in cfg:   # the autotuner's (config, split) pair: not a template parameter
        cfg = dict(cfg)
        tuned = cfg.pop("split")
        if splits is None:
            # chosen for a shape bucket: batch (hence the grid's z) may differ in it
            splits = max(1, min(tuned, max_z // max(1, p.batch)))
    tiles = -(-p.M // cfg["bm"]) * -(-p.N // cfg["bn"])
    if tiles > info.max_grid_dims[0]:
        raise InvalidArgumentError(f"matmul output {p.M}x{p.N} needs too many tiles ({tiles})")
    template = config_template(cfg, template)   # (an x3 config given with the family's)
    if template == WGMMA_TEMPLATE:
        _run_wgmma(m, cfg, a, b, out, p, dev, max_z)
        return
    params = kernel_params(template, dtype, cfg, vec, epilogue, a_trans)
    if epilogue is not None:
        splits = 1
    esize = dtype.itemsize

    def extra(b0: int) -> Tuple[Any, ...]:
        """The epilogue's arguments for the batch chunk from b0: the bias (a null pointer
        adds nothing), G at the chunk's first matrix."""
        if epilogue is None:
            return ()
        if epilogue != GRAD_EPILOGUE:
            return (0 if bias is None else bias,)
        assert grad is not None, "the gradient epilogue reads G"
        return (0 if bias is None else bias,
                grad if b0 == 0 else grad.ptr + b0 * p.M * p.N * esize)
    if template == SIMT_TEMPLATE:
        kernel = _kernel(m, SIMT_TEMPLATE, dev, params)
        threads = (cfg["bm"] // cfg["tm"]) * (cfg["bn"] // cfg["tn"])
        smem = simt_smem(cfg, esize, epilogue is not None)   # multistage: dynamic
        if splits is None:
            splits = split_count(cfg, p, info.multiprocessor_count, max_z,
                                 blocks_per_sm(cfg, getattr(kernel, "num_regs", 0), info,
                                               esize, getattr(kernel, "static_shared_bytes", 0)))
    else:
        kernel = _kernel(m, MMA_TEMPLATE, dev, params)
        threads = (cfg["bm"] // cfg["wm"]) * (cfg["bn"] // cfg["wn"]) * 32
        smem = cfg["stages"] * (cfg["bm"] * cfg["bk"] + cfg["bk"] * cfg["bn"]) * esize
    kchunk = takes_k_chunk(template, cfg, epilogue)
    if kchunk:
        # split-K puts batch x splits on the grid's z in one launch
        splits = max(1, min(splits or 1, max_z // max(1, p.batch)))
        if splits > 1:
            _run_split(m, kernel.name, cfg["bk"], tiles, threads, smem, a, b, out, p, dtype,
                       dev, splits)
            return
    for b0 in range(0, p.batch, max_z):
        nb = min(max_z, p.batch - b0)
        pa, pb, pc = _offsets(a, b, out, p, b0, esize)
        backend.launch_kernel(kernel.name, (tiles, 1, nb), pa, pb, pc, *extra(b0), p.M, p.N,
                              p.K, p.stride_a, p.stride_b, *((nb, p.K) if kchunk else ()),
                              block_size=(threads, 1, 1), shared_mem=smem, device_id=dev)


def _run_split(m: Any, kernel_name: str, bk: int, tiles: int, threads: int, smem: int,
               a: CudaTensor, b: CudaTensor, out: CudaTensor, p: Plan, dtype: CudaDataType,
               dev: int, splits: int) -> None:
    """A split-K GEMM (the SIMT or x3 kernel, its K slices whole bk-deep tiles): partials
    work[split][batch][M][N] in a pool block, then splitk_reduce sums them in split order
    into out; the block goes back to the pool after the launches."""
    backend = m.backend
    info = backend.get_device_info(dev)
    chunk = -(-p.K // splits)
    chunk = -(-chunk // bk) * bk
    splits = -(-p.K // chunk)
    work = backend.empty((splits * p.batch * p.M * p.N,), dtype, dev)
    try:
        backend.launch_kernel(kernel_name, (tiles, 1, p.batch * splits), a, b, work,
                              p.M, p.N, p.K, p.stride_a, p.stride_b, p.batch, chunk,
                              block_size=(threads, 1, 1), shared_mem=smem, device_id=dev)
        red = _kernel(m, SIMT_TEMPLATE, dev, {"kind": "splitk_reduce",
                                              "block_size": REDUCE_BLOCK,
                                              **dtype_params(dtype)})
        n = p.batch * p.M * p.N
        grid = common.grid_1d(n, REDUCE_BLOCK, info.multiprocessor_count, waves=4)
        backend.launch_kernel(red.name, (grid, 1, 1), work, out, n, splits,
                              block_size=(REDUCE_BLOCK, 1, 1), device_id=dev)
    finally:
        work.free()  # back to the pool; later work on this stream is ordered after


def _run_wgmma(m: Any, cfg: Dict[str, Any], a: CudaTensor, b: CudaTensor, out: CudaTensor,
               p: Plan, dev: int, max_z: int) -> None:
    """B (K, N) -> Bt (N, K) rounded to TF32 in a pool block (one plane when B is broadcast),
    then the wgmma kernel over every batch chunk; Bt goes back to the pool after the launches
    (later work on the stream is ordered after them)."""
    from . import transpose as tr
    backend = m.backend
    planes = 1 if p.stride_b == 0 else p.batch
    bt = backend.empty((planes * p.N * p.K,), DT.FLOAT32, dev)
    try:
        tr.transpose_tf32(m, b, bt, planes, p.K, p.N, dev)
        kernel = _kernel(m, WGMMA_TEMPLATE, dev, wgmma_params(cfg))
        threads = cfg["bm"] // 64 * 128
        tiles = -(-p.M // cfg["bm"]) * -(-p.N // cfg["bn"])
        stride_bt = 0 if p.stride_b == 0 else p.N * p.K
        for b0 in range(0, p.batch, max_z):
            nb = min(max_z, p.batch - b0)
            pa = a if b0 == 0 else a.ptr + b0 * p.stride_a * 4
            pb = bt if b0 == 0 else bt.ptr + b0 * stride_bt * 4
            pc = out if b0 == 0 else out.ptr + b0 * p.M * p.N * 4
            backend.launch_kernel(kernel.name, (tiles, 1, nb), pa, pb, pc, p.M, p.N, p.K,
                                  p.stride_a, stride_bt, block_size=(threads, 1, 1),
                                  shared_mem=wgmma_smem(cfg), device_id=dev)
    finally:
        bt.free()


def _offsets(a: CudaTensor, b: CudaTensor, out: CudaTensor, p: Plan, b0: int,
             esize: int) -> Tuple[Any, Any, Any]:
    """Operands for batch chunk starting at b0 (the tensors themselves for the first)."""
    if b0 == 0:
        return a, b, out
    return (a.ptr + b0 * p.stride_a * esize, b.ptr + b0 * p.stride_b * esize,
            out.ptr + b0 * p.M * p.N * esize)


def _skinny_setup(m: Any, cfg: Dict[str, Any], p: Plan, dtype: CudaDataType, vec: bool,
                  dev: int, splits: Optional[int], epilogue: Optional[str]) -> Dict[str, Any]:
    """What a skinny config's launches need: the two kernels, grids, the K chunk and the
    effective split count, the workspace size."""
    if dtype is not DT.FLOAT32:
        raise InvalidArgumentError(f"skinny configs are float32 only, got {dtype.name_str}")
    if p.batch != 1:
        raise InvalidArgumentError(f"skinny configs take one matrix, got a batch of {p.batch}")
    info = m.backend.get_device_info(dev)
    max_x, max_y = info.max_grid_dims[0], info.max_grid_dims[1]
    sms = info.multiprocessor_count
    if splits is None:
        opts = skinny_split_options(cfg, p, sms, max_y)
        splits = opts[0] if opts else 1
    chunk, s = skinny_chunk(cfg, p.K, max(1, min(splits, max_y)))
    tiles_m, tiles_n = skinny_tiles(cfg, p)
    if tiles_m * tiles_n > max_x:
        raise InvalidArgumentError(f"matmul output {p.M}x{p.N} needs too many tiles")
    b_trans = epilogue is not None
    n = p.M * p.N
    if epilogue is None:
        red = {"kind": "splitk_reduce", "block_size": REDUCE_BLOCK, **dtype_params(dtype)}
    else:
        red = splitk_epilogue_params(dtype, epilogue)
    return {"kernel": _kernel(m, SIMT_TEMPLATE, dev, skinny_params(dtype, cfg, vec, b_trans)),
            "grid": (tiles_m * tiles_n, s, 1), "threads": skinny_threads(cfg),
            "smem": skinny_smem(cfg, b_trans, dtype.itemsize), "chunk": chunk, "splits": s,
            "n": n, "work_elems": s * n, "reduce": _kernel(m, SIMT_TEMPLATE, dev, red),
            "reduce_grid": common.grid_1d(n, REDUCE_BLOCK, sms, waves=4)}


def _run_skinny(m: Any, cfg: Dict[str, Any], a: CudaTensor, b: CudaTensor, out: CudaTensor,
                p: Plan, dtype: CudaDataType, vec: bool, dev: int, splits: Optional[int],
                epilogue: Optional[str], bias: Optional[CudaTensor],
                grad: Optional[CudaTensor] = None) -> None:
    """A skinny config: the split-K kernel writes float32 partials work[split][M][N] (a pool
    block), then splitk_reduce (matmul) or splitk_epilogue (linear: + bias, GELU, or
    G * GELU' with grad) sums them in split order into out; the block goes back to the pool
    after the launches."""
    backend = m.backend
    s = _skinny_setup(m, cfg, p, dtype, vec, dev, splits, epilogue)
    work = backend.empty((s["work_elems"],), DT.FLOAT32, dev)
    try:
        backend.launch_kernel(s["kernel"].name, s["grid"], a, b, work, p.M, p.N, p.K,
                              s["chunk"], block_size=(s["threads"], 1, 1),
                              shared_mem=s["smem"], device_id=dev)
        tail: Tuple[Any, ...]
        if epilogue is None:
            tail = (s["n"], s["splits"])
        elif epilogue == GRAD_EPILOGUE:
            tail = (0 if bias is None else bias, grad, s["n"], p.N, s["splits"])
        else:
            tail = (0 if bias is None else bias, s["n"], p.N, s["splits"])
        backend.launch_kernel(s["reduce"].name, (s["reduce_grid"], 1, 1), work, out, *tail,
                              block_size=(REDUCE_BLOCK, 1, 1), device_id=dev)
    finally:
        work.free()  # back to the pool; later work on this stream is ordered after


def _skinny_runner(m: Any, cfg: Dict[str, Any], p: Plan, dtype: CudaDataType, vec: bool,
                   dev: int, epilogue: Optional[str]) -> Any:
    """_run_skinny's launches as PreparedLaunches: run(pa, pb, pc, pbias, pg=0)."""
    backend = m.backend
    prep, get = backend.prepare_launch, backend.get_kernel
    cfg = dict(cfg)
    s = _skinny_setup(m, cfg, p, dtype, vec, dev, cfg.pop("split", None), epilogue)
    gemm = prep(get(s["kernel"].name, dev), s["grid"], (s["threads"], 1, 1), s["smem"], dev)
    reduce = prep(get(s["reduce"].name, dev), (s["reduce_grid"], 1, 1), (REDUCE_BLOCK, 1, 1),
                  0, dev)
    M, N, K, chunk, n, splits = p.M, p.N, p.K, s["chunk"], s["n"], s["splits"]
    wbytes = s["work_elems"] * 4
    pool = backend.memory_pools[dev]
    alloc, release = pool.allocate_current, pool.release
    linear = epilogue is not None
    with_grad = epilogue == GRAD_EPILOGUE

    def run(pa: int, pb: int, pc: int, pbias: int, pg: int = 0) -> None:
        block = alloc(wbytes)
        try:
            pw = int(block)
            gemm(pa, pb, pw, M, N, K, chunk)
            if with_grad:
                reduce(pw, pc, pbias, pg, n, N, splits)
            elif linear:
                reduce(pw, pc, pbias, n, N, splits)
            else:
                reduce(pw, pc, n, splits)
        finally:
            release(block)   # as work.free(): the pool is stream-ordered
    return run


def _cluster_setup(m: Any, cfg: Dict[str, Any], p: Plan, dtype: CudaDataType, vec: bool,
                   dev: int, epilogue: Optional[str]) -> Dict[str, Any]:
    """What a cluster config's launch needs: the kernel (B as (N, K) where there is an
    epilogue: the linear layer), grid, threads, dynamic shared memory and the K slice."""
    if dtype is not DT.FLOAT32:
        raise InvalidArgumentError(f"cluster configs are float32 only, got {dtype.name_str}")
    if p.batch != 1:
        raise InvalidArgumentError(f"cluster configs take one matrix, got a batch of {p.batch}")
    info = m.backend.get_device_info(dev)
    if not has_clusters(info):
        raise InvalidArgumentError(
            f"cluster configs need thread-block clusters (compute capability >= 9.0); device "
            f"{dev} has {tuple(getattr(info, 'compute_capability', (0, 0)))}")
    tiles_m, tiles_n = cluster_tiles(cfg, p)
    if tiles_m * tiles_n > info.max_grid_dims[0]:
        raise InvalidArgumentError(f"matmul output {p.M}x{p.N} needs too many tiles")
    b_trans = epilogue is not None
    params = cluster_params(dtype, cfg, vec, b_trans, "none" if epilogue is None else epilogue)
    return {"kernel": _kernel(m, SKINNY_TEMPLATE, dev, params),
            "grid": (tiles_m * tiles_n, cfg["splits"], 1), "threads": cluster_threads(cfg),
            "smem": cluster_smem(cfg, b_trans, dtype.itemsize), "chunk": cluster_chunk(cfg, p.K)}


def _run_cluster(m: Any, cfg: Dict[str, Any], a: CudaTensor, b: CudaTensor, out: CudaTensor,
                 p: Plan, dtype: CudaDataType, vec: bool, dev: int, epilogue: Optional[str],
                 bias: Optional[CudaTensor], grad: Optional[CudaTensor] = None) -> None:
    """A cluster config: one launch, (A, B, C, bias or 0, [G,] M, N, K, k_chunk); the
    cluster sums the K slices and applies the epilogue (matrix_multiply: none)."""
    s = _cluster_setup(m, cfg, p, dtype, vec, dev, epilogue)
    extra = (grad,) if epilogue == GRAD_EPILOGUE else ()
    m.backend.launch_kernel(s["kernel"].name, s["grid"], a, b, out,
                            0 if bias is None else bias, *extra, p.M, p.N, p.K, s["chunk"],
                            block_size=(s["threads"], 1, 1), shared_mem=s["smem"],
                            device_id=dev)


def _cluster_runner(m: Any, cfg: Dict[str, Any], p: Plan, dtype: CudaDataType, vec: bool,
                    dev: int, epilogue: Optional[str]) -> Any:
    """_run_cluster's launch as a PreparedLaunch: run(pa, pb, pc, pbias, pg=0)."""
    backend = m.backend
    s = _cluster_setup(m, cfg, p, dtype, vec, dev, epilogue)
    go = backend.prepare_launch(backend.get_kernel(s["kernel"].name, dev), s["grid"],
                                (s["threads"], 1, 1), s["smem"], dev)
    M, N, K, chunk = p.M, p.N, p.K, s["chunk"]
    if epilogue == GRAD_EPILOGUE:
        def run_grad(pa: int, pb: int, pc: int, pbias: int, pg: int = 0) -> None:
            go(pa, pb, pc, pbias, pg, M, N, K, chunk)
        return run_grad

    def run(pa: int, pb: int, pc: int, pbias: int, pg: int = 0) -> None:
        go(pa, pb, pc, pbias, M, N, K, chunk)
    return run


# -- per-call plans (ops/common.py remember_plan) ---------------------------------------------
# A plan of matmul (key: "matmul", both shapes, dtypes and devices, the precision as given) or
# of fused_linear_gelu (ops/linear.py) allocates the result and runs the launches run_config
# makes for the config _launch memoized, as PreparedLaunches. That config depends on vec (the
# operands' and result's alignment), so a plan holds one runner per vec seen by the general
# path and returns None (general path) for another. Operands last used on another stream
# (tensor.stream set) take the general path too, which records their use on this one.

def remember(m: Any, key: tuple, p: Plan, dtype: CudaDataType, prec: Optional[str], dev: int,
             vec: bool, shape: Tuple[int, ...], epilogue: Optional[str] = None,
             a_trans: bool = False) -> None:
    """After a general-path call of key with alignment class vec: make sure key's plan has
    the runner for vec (the plan made on first use)."""
    plans = getattr(m, "plans", None)
    if plans is None or not m.gpu or not hasattr(m.backend, "prepare_launch"):
        return
    plan = plans.get(key)
    runners = getattr(plan, "runners", None)
    if runners is None:
        plan = common.remember_plan(m, key, _op_plan(m, p, dtype, dev, shape, a_trans))
        runners = plan.runners
    if vec not in runners:
        hit = _cache(m).get(config_key(p, dtype, prec, dev, vec, epilogue, a_trans))
        if hit is not None:
            runners[vec] = _runner(m, hit[0], hit[1], p, dtype, vec, dev, epilogue, a_trans)


def _op_plan(m: Any, p: Plan, dtype: CudaDataType, dev: int, shape: Tuple[int, ...],
             a_trans: bool = False) -> Any:
    """plan(a, b, bias, grad=None): the result (of `shape`) from the pool and the runner of
    the call's alignment class; None where the general path must run."""
    from ..tensor import pool_tensor
    pool = m.backend.memory_pools[dev]
    alloc = pool.allocate_current
    size = p.batch * p.M * p.N
    nbytes = size * dtype.itemsize
    vw = 16 // dtype.itemsize
    shape_vec = (p.M if a_trans else p.K) % vw == 0 and p.N % vw == 0
    runners: Dict[bool, Any] = {}
    get = runners.get

    def plan(a: CudaTensor, b: CudaTensor, bias: Optional[CudaTensor],
             grad: Optional[CudaTensor] = None) -> Optional[CudaTensor]:
        pa, pb = a._ptr, b._ptr
        if pa is None or pb is None or a.stream is not None or b.stream is not None:
            return None
        if bias is None:
            pbias = 0
        else:
            pbias = bias._ptr
            if pbias is None or bias.stream is not None:
                return None
        if grad is None:
            pg = 0
        else:
            pg = grad._ptr
            if pg is None or grad.stream is not None:
                return None
        out = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        pc = out._ptr
        run = get(shape_vec and not (pa | pb | pc) & 15)
        if run is None:
            out.free()
            return None
        if grad is None:
            run(pa, pb, pc, pbias)
        else:
            run(pa, pb, pc, pbias, pg)
        return out

    plan.runners = runners  # type: ignore[attr-defined]  # (read by the tests: the sub-launches)
    return plan


def _runner(m: Any, template: str, cfg: Dict[str, Any], p: Plan, dtype: CudaDataType,
            vec: bool, dev: int, epilogue: Optional[str] = None, a_trans: bool = False) -> Any:
    """run(pa, pb, pc, pbias, pg=0): run_config's launches of one config (pointers as ints;
    pbias 0 for no bias; pg: G of the bias_gelu_grad epilogue), as PreparedLaunches: the
    same kernels, grids and arguments, the split-K workspace and the wgmma B copy taken from
    the pool and given back after the launches."""
    if cfg.get("skinny"):
        return _skinny_runner(m, cfg, p, dtype, vec, dev, epilogue)
    if cfg.get("cluster"):
        return _cluster_runner(m, cfg, p, dtype, vec, dev, epilogue)
    backend = m.backend
    info = backend.get_device_info(dev)
    max_z = info.max_grid_dims[2]
    splits = None
    if "split" in cfg:
        cfg = dict(cfg)
        splits = max(1, min(cfg.pop("split"), max_z // max(1, p.batch)))
    template = config_template(cfg, template)
    if template == WGMMA_TEMPLATE:
        return _wgmma_runner(m, cfg, p, dev, max_z)
    prep, get = backend.prepare_launch, backend.get_kernel
    esize = dtype.itemsize
    M, N, K, sa, sb, batch = p.M, p.N, p.K, p.stride_a, p.stride_b, p.batch
    tiles = -(-M // cfg["bm"]) * -(-N // cfg["bn"])
    params = kernel_params(template, dtype, cfg, vec, epilogue, a_trans)
    if epilogue is not None:
        splits = 1
    if template == SIMT_TEMPLATE:
        kernel = _kernel(m, SIMT_TEMPLATE, dev, params)
        threads = (cfg["bm"] // cfg["tm"]) * (cfg["bn"] // cfg["tn"])
        smem = simt_smem(cfg, esize, epilogue is not None)
        if splits is None:
            splits = split_count(cfg, p, info.multiprocessor_count, max_z,
                                 blocks_per_sm(cfg, getattr(kernel, "num_regs", 0), info,
                                               esize, getattr(kernel, "static_shared_bytes", 0)))
    else:
        kernel = _kernel(m, MMA_TEMPLATE, dev, params)
        threads = (cfg["bm"] // cfg["wm"]) * (cfg["bn"] // cfg["wn"]) * 32
        smem = cfg["stages"] * (cfg["bm"] * cfg["bk"] + cfg["bk"] * cfg["bn"]) * esize
    kchunk = takes_k_chunk(template, cfg, epilogue)
    if kchunk:
        splits = max(1, min(splits or 1, max_z // max(1, batch)))
        if splits > 1:
            chunk = -(-K // splits)
            chunk = -(-chunk // cfg["bk"]) * cfg["bk"]
            splits = -(-K // chunk)
            wbytes = splits * batch * M * N * esize
            gemm = prep(get(kernel.name, dev), (tiles, 1, batch * splits), (threads, 1, 1),
                        smem, dev)
            red = _kernel(m, SIMT_TEMPLATE, dev, {"kind": "splitk_reduce",
                                                  "block_size": REDUCE_BLOCK,
                                                  **dtype_params(dtype)})
            n = batch * M * N
            grid = common.grid_1d(n, REDUCE_BLOCK, info.multiprocessor_count, waves=4)
            reduce = prep(get(red.name, dev), (grid, 1, 1), (REDUCE_BLOCK, 1, 1), 0, dev)
            pool = backend.memory_pools[dev]
            alloc, release = pool.allocate_current, pool.release

            def run_split(pa: int, pb: int, pc: int, pbias: int, pg: int = 0) -> None:
                block = alloc(wbytes)
                try:
                    pw = int(block)
                    gemm(pa, pb, pw, M, N, K, sa, sb, batch, chunk)
                    reduce(pw, pc, n, splits)
                finally:
                    release(block)   # as work.free(): the pool is stream-ordered
            return run_split
    kernel = get(kernel.name, dev)
    chunks = []
    for b0 in range(0, batch, max_z):
        nb = min(max_z, batch - b0)
        tail = (M, N, K, sa, sb, nb, K) if kchunk else (M, N, K, sa, sb)
        chunks.append((prep(kernel, (tiles, 1, nb), (threads, 1, 1), smem, dev),
                       b0 * sa * esize, b0 * sb * esize, b0 * M * N * esize, tail))
    if len(chunks) == 1:
        go, _, _, _, tail = chunks[0]
        if epilogue is None:
            def run(pa: int, pb: int, pc: int, pbias: int, pg: int = 0) -> None:
                go(pa, pb, pc, *tail)
        elif epilogue == GRAD_EPILOGUE:
            def run(pa: int, pb: int, pc: int, pbias: int, pg: int = 0) -> None:
                go(pa, pb, pc, pbias, pg, *tail)
        else:
            def run(pa: int, pb: int, pc: int, pbias: int, pg: int = 0) -> None:
                go(pa, pb, pc, pbias, *tail)
        return run

    def run_chunks(pa: int, pb: int, pc: int, pbias: int, pg: int = 0) -> None:
        for go, oa, ob, oc, tail in chunks:
            if epilogue is None:
                go(pa + oa, pb + ob, pc + oc, *tail)
            elif epilogue == GRAD_EPILOGUE:
                go(pa + oa, pb + ob, pc + oc, pbias, pg + oc, *tail)
            else:
                go(pa + oa, pb + ob, pc + oc, pbias, *tail)
    return run_chunks


def _wgmma_runner(m: Any, cfg: Dict[str, Any], p: Plan, dev: int, max_z: int) -> Any:
    """_run_wgmma's launches: B transposed and rounded into a pool block (the transpose's
    config from its access width, which depends on the pointers: per call), the wgmma
    kernel over the batch chunks, the block given back."""
    from . import transpose as tr
    backend = m.backend
    prep, get = backend.prepare_launch, backend.get_kernel
    M, N, K, sa = p.M, p.N, p.K, p.stride_a
    planes = 1 if p.stride_b == 0 else p.batch
    btbytes = planes * N * K * 4
    kernel = get(_kernel(m, WGMMA_TEMPLATE, dev, wgmma_params(cfg)).name, dev)
    threads = cfg["bm"] // 64 * 128
    tiles = -(-M // cfg["bm"]) * -(-N // cfg["bn"])
    stride_bt = 0 if p.stride_b == 0 else N * K
    chunks = []
    for b0 in range(0, p.batch, max_z):
        nb = min(max_z, p.batch - b0)
        chunks.append((prep(kernel, (tiles, 1, nb), (threads, 1, 1), wgmma_smem(cfg), dev),
                       b0 * sa * 4, b0 * stride_bt * 4, b0 * M * N * 4, (M, N, K, sa, stride_bt)))
    shape16, shape8 = K % 4 == 0 and N % 4 == 0, K % 2 == 0 and N % 2 == 0
    transposes: Dict[int, list] = {}   # access width -> [(launch, plane offset, args)]
    t_max_z = tr.max_grid_z(m, dev)
    plane = K * N * 4

    def transpose_launches(vb: int, pb: int, pbt: int) -> list:
        tcfg = tr.candidates(DT.FLOAT32, K, N, pb, pbt)[0]   # transpose_tf32's choice
        params = {**tr.config_params(DT.FLOAT32, tcfg), "round_tf32": True}
        tk = get(m.kernel(tr.TEMPLATE, dev, **params).name, dev)
        out = [(prep(tk, grid, (tcfg["threads"], 1, 1), 0, dev), b0 * plane,
                (K, N, tcfg["group"]))
               for b0, grid in tr.launch_grids(tcfg, planes, K, N, t_max_z)]
        if tcfg["vec_bytes"] == vb:   # (always: vb is vec_width's rule)
            transposes[vb] = out
        return out

    pool = backend.memory_pools[dev]
    alloc, release = pool.allocate_current, pool.release

    def run(pa: int, pb: int, pc: int, pbias: int) -> None:
        block = alloc(btbytes)
        try:
            pbt = int(block)
            both = pb | pbt
            vb = 16 if shape16 and not both & 15 else (8 if shape8 and not both & 7 else 4)
            launches = transposes.get(vb) or transpose_launches(vb, pb, pbt)
            for go, off, args in launches:
                go(pb + off, pbt + off, *args)
            for go, oa, obt, oc, tail in chunks:
                go(pa + oa, pbt + obt, pc + oc, *tail)
        finally:
            release(block)   # as bt.free(): the pool is stream-ordered
    return run


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8,
            dtypes: Sequence[CudaDataType] = tuple(common.FLOATS)) -> int:
    """Compile every matmul variant for the dtypes in parallel threads (nvcc runs in
    subprocesses); returns how many were compiled. Later calls find them memoized."""
    names = {d.name_str for d in dtypes}
    jobs = [(t, params) for t, sets in template_variants().items() for params in sets
            if params["dtype"] in names and runs_here(m, t, device_id)]
    return common.compile_all(m, jobs, device_id, workers, _kernel)


def runs_here(m: Any, template: str, device_id: Optional[int] = None) -> bool:
    """The device (None: the current one) runs the template's kernels (template_runs_on);
    False for the wgmma and cluster kernels where the backend has no device info (stand-ins,
    fallback mode)."""
    if template not in (WGMMA_TEMPLATE, SKINNY_TEMPLATE):
        return True
    info = getattr(m.backend, "get_device_info", None)   # (absent on stand-in backends)
    if not m.gpu or info is None:
        return False
    dev = m.backend.current_device if device_id is None else device_id
    return template_runs_on(template, info(dev))
