"""Matmul tile configs: the measured tables (SIMT, mma.sync 16-bit and TF32, wgmma TF32 and
16-bit, 3xTF32, the linear layer's subsets) and which of them a call may choose from
(`candidates`, per dtype, precision, shape class and alignment). The numbers behind each table
are in its comments and perf/NOTES.md; perf/sweep_matmul.py times them all."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..dtypes import CudaDataType
from .matmul_kernels import MMA_TEMPLATE, SIMT_TEMPLATE

DT = CudaDataType


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


def _wgmma(bm: int, bn: int, stages: int, min_blocks: int) -> Dict[str, Any]:
    """wgmma TF32 tile config (matmul_wgmma.cu.j2; bk is 32): bm / 64 warpgroups, each
    m64 x bn; the "wgmma" key names the template (config_template)."""
    return {"bm": bm, "bn": bn, "stages": stages, "min_blocks": min_blocks, "wgmma": True}


def _wgmma16(bn: int, stages: int, min_blocks: int) -> Dict[str, Any]:
    """16-bit wgmma tile config (matmul_wgmma16.cu.j2; bm 128, bk 64): two warpgroups, each
    m64 x bn; the "wgmma16" key names the template (config_template)."""
    return {"bm": 128, "bn": bn, "stages": stages, "min_blocks": min_blocks, "wgmma16": True}


def _tma16(bm: int, bn: int, stages: int) -> Dict[str, Any]:
    """TMA-fed warp-specialized 16-bit GEMM config (matmul_tma16.cu.j2; bk 64, 384 threads:
    one producer and two consumer warpgroups, persistent grid); the "tma16" key names the
    template (config_template), group_m the tile rows sharing a B strip in L2."""
    return {"bm": bm, "bn": bn, "stages": stages, "group_m": 8, "tma16": True}


def _dmma(bm: int, bn: int, bk: int, wm: int, wn: int, stages: int,
          min_blocks: int) -> Dict[str, Any]:
    """Float64 tensor-core tile config (matmul_dmma.cu.j2, mma.m16n8k16.f64: sm_90+); the
    "dmma" key names the template (config_template)."""
    return {"bm": bm, "bn": bn, "bk": bk, "wm": wm, "wn": wn, "stages": stages,
            "min_blocks": min_blocks, "dmma": True}


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
# DMMA, float64 on the tensor cores (Hopper; timed beside the SIMT ones, which stay for the
# devices without mma.m16n8k16.f64 and the A-transposed GEMM). Registers on sm_90 (vec / not),
# and ms on an H100 (perf/NOTES.md "Matmul, float64 on DMMA"): 4096^3 3.08 / 3.27 / 3.74,
# 2048^3 0.39 / 0.41 / 0.48, 1000^3 0.102 / 0.058 / 0.067; 8192x64x8192 32x64 0.26.
DM_128x128x16 = _dmma(128, 128, 16, 32, 64, 3, 1)  # 256 threads, 248 / 250 regs, 102 KB
DM_64x64x16 = _dmma(64, 64, 16, 32, 32, 4, 2)      # 128 threads, 198 / 198 regs, 68 KB
DM_128x64x16 = _dmma(128, 64, 16, 32, 32, 3, 1)    # 256 threads, 192 / 200 regs, 78 KB
DM_32x64x16 = _dmma(32, 64, 16, 16, 32, 4, 2)      # 128 threads, 130 / 126 regs, 50 KB
SIMT_F64 = {
    "large": [DM_128x128x16, DM_64x64x16, DM_128x64x16, D_128x64x8, D_64x64x8],
    "medium": [DM_64x64x16, DM_128x128x16, DM_128x64x16, D_64x64x8, D_128x64x8],
    "skinny": [DM_32x64x16, DM_64x64x16, D_64x64x8, D_32x64x8],
    "small": [D_32x64x8, DM_32x64x16],
}
# mma.sync, 16-bit inputs: threads = (bm / wm) * (bn / wn) * 32; 64x64 warp tiles.
H_256x128x64 = _mma(256, 128, 64, 64, 64, 3, 1)  # 256 threads, 144 KB
H_256x128x32 = _mma(256, 128, 32, 64, 64, 3, 1)  # 256 threads, 72 KB
H_128x256x64 = _mma(128, 256, 64, 64, 64, 3, 1)  # 256 threads, 144 KB
H_128x128x32 = _mma(128, 128, 32, 64, 64, 4, 2)  # 128 threads, 64 KB
H_64x64x32 = _mma(64, 64, 32, 32, 32, 4, 4)      # 128 threads, 32 KB
# wgmma, 16-bit inputs (Hopper only; matrix_multiply's plain GEMM, wgmma16_ok; A is read in
# place where K % 8 == 0 and B where N % 8 == 0 (each 16-byte aligned), else copied into rows
# padded to 8, ops/matmul_pad.py): both operands from shared memory, float32 accumulation.
# Measured on an H100 against torch.matmul (cuBLAS), ratio = torch time / ours, float32 /
# 16-bit output (the template rendered and timed on its own, CUDA events, L2 flushed before
# each call):
#                         1023x1025x1000   4096^3        8192^3
#   bf16 128x128 s3      1.84 / 1.96      0.66 / 0.64   0.68 / 0.60
#   f16  128x128 s3      1.25 / 1.35      0.59 / 0.59   0.62 / 0.60
#   f16  128x256 s4      1.19 / 1.25      0.68 / 0.66   0.72 / 0.64
# (mma.sync: 0.58-0.60 at 8192^3, 0.13-0.14 at 1023x1025x997). Untuned (the autotuner off:
# the first candidate) large shapes take 128x256 s4, medium and unaligned ones 128x128 s3.
# Dynamic shared bytes in comments (wgmma_smem).
W16_128x128_s3 = _wgmma16(128, 3, 2)     # 256 thr, 99328 B: 2 blocks per SM
W16_128x256_s4 = _wgmma16(256, 4, 1)     # 256 thr, 197632 B
# TMA + wgmma, 16-bit inputs (Hopper only; matrix_multiply's plain GEMM of one matrix where
# K % 8 == 0, N % 8 == 0 and A, B, C are 16-byte aligned, ops/matmul_tma16.py tma16_usable):
# the tensor memory accelerator fills a shared-memory ring, two consumer warpgroups run
# wgmma from it, persistent grid of min(tiles, SMs) blocks. Measured on an H100 against
# torch.matmul (cuBLAS), ratio = torch time / ours, float32 / 16-bit output (the template
# rendered and timed on its own by perf/tma16_check.py, CUDA events, L2 flushed):
#                    4096^3               8192^3
#   128x256 s4      0.91 / 0.88-0.89     0.96-0.97 / 0.92-0.93
#   256x128 s4      0.90 / 0.85          0.85-0.87 / 0.83-0.84
#   128x128 s5      0.76-0.79 / 0.72-0.74   0.88-0.90 / 0.75-0.77
# 168 registers (setmaxnreg: producer 40, consumers 232), no spills; dynamic shared bytes
# (tma16_smem) in comments. Untuned, large aligned shapes take 128x256 s4 first.
T16_128x256_s4 = _tma16(128, 256, 4)     # 384 thr, 197632 B
T16_256x128_s4 = _tma16(256, 128, 4)     # 384 thr, 197632 B
T16_128x128_s5 = _tma16(128, 128, 5)     # 384 thr, 164864 B
# 128x64 tiles: twice the blocks of 128x128 where those leave SMs idle (1024^2 outputs: 64
# tiles on 132 SMs). H100, GPU time L2 flushed, us, 128x64 s6-s7 / 128x128 s5 / torch
# (perf/NOTES.md "Matmul, mid sizes on TMA"): float16 1024^3 9.4-10.0 / 11.4 / 9.5, 768^3
# 8.2-8.7 / 10.1 / 8.1, 1024x1024x4096 21.1-22.4 / 25.5 / 18.4; TF32 1024^3 18.9 / 22.0 /
# 17.3. At 2048^3 and 1000^3 the 128x128 tiles stay faster (the autotuner times both).
T16_128x64_s6 = _tma16(128, 64, 6)       # 384 thr, 149504 B
T16_128x64_s7 = _tma16(128, 64, 7)       # 384 thr, 174080 B
# 128x192 tiles: 1536^2 outputs are 144 tiles of 128x128 (two waves on 132 SMs, the second
# nearly empty) but 96 of 128x192 (one wave). H200, GPU time L2 flushed, us, 128x192 s4 /
# best other config / torch at 1536^3: float16 18.2 / 22.0 / 14.8, TF32 37.1 / 43.8 / 37.7
# (perf/NOTES.md "Matmul, mid sizes on TMA"); at 2048^3 it is the slowest TMA config, so
# the autotuner's key splits 1025-1536 from 1537-2048 (matmul_shapes.tune_key).
T16_128x192_s4 = _tma16(128, 192, 4)     # 384 thr, 165888 B
MMA_F16 = {
    "large": [T16_128x256_s4, T16_256x128_s4, T16_128x128_s5, W16_128x256_s4, W16_128x128_s3,
              H_256x128x64, H_256x128x32, H_128x256x64, H_128x128x32],
    "medium": [W16_128x128_s3, T16_128x128_s5, T16_128x64_s6, T16_128x192_s4, H_128x128x32,
               H_64x64x32],
    "skinny": [H_64x64x32, H_128x128x32, W16_128x128_s3],
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
# TMA + wgmma TF32 (the TMA configs above: matmul_tma16.cu.j2 renders TF32 for float32; where
# K % 4 == 0 and A, C are 16-byte aligned, one matrix; B transposed into Bt first, as for
# the wgmma configs; ops/matmul_tma16.py tma16_usable).
MMA_TF32 = {
    "large": [T16_128x256_s4, T16_256x128_s4, T16_128x128_s5, W_128x128_s3, W_128x256_s4,
              W_128x256_s3, W_64x128_s3, W_128x128_s4, T_128x256x32, T_256x128x32,
              T_128x128x32],
    "medium": [W_128x128_s3, W_64x128_s3, T16_128x128_s5, T16_128x256_s4, T16_128x64_s7,
               T16_128x192_s4, T_128x128x32, T_64x64x16],
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
# (The 16-bit wgmma configs: K % 8 != 0, N % 8 != 0 and misaligned operands go through A's
# and B's padded copies, ops/matmul_pad.py; their kernel is the same for both alignment
# classes. Large unaligned shapes time both, 128x256 s4 first as for aligned ones.)
SCALAR_OK = (S_128x256x8_16x8_q2, S_128x64x8_q2, S_64x128x8_q2, S_64x64x8_q2, S_32x64x16,
             D_128x64x8, D_64x64x8, D_32x64x8, DM_128x128x16, DM_128x64x16, DM_64x64x16,
             DM_32x64x16,
             H_128x128x32, H_64x64x32, T_128x128x32, T_64x64x16, W16_128x256_s4,
             W16_128x128_s3)
# The config a 16-bit wgmma one gives way to where a call cannot take it (the output not
# 4-byte aligned, no sm_90a, an epilogue or A given transposed): in every 16-bit table
# (GEMM, linear layer, A-transposed) and rendered for both alignments.
WGMMA16_STANDIN = H_128x128x32
# The config a TMA one gives way to where a call cannot take it (a batch, K or N not a multiple
# of 8, an operand or the output not 16-byte aligned, no sm_90a, an epilogue, A transposed):
# the 16-bit wgmma kernel, itself giving way to WGMMA16_STANDIN where it must.
TMA16_STANDIN = W16_128x128_s3
# ... and for TF32 (float32): the mma.sync TF32 kernel, which takes every alignment.
TMA_TF32_STANDIN = T_128x128x32


def tma_standin(dtype: CudaDataType) -> Dict[str, Any]:
    """The config a TMA one gives way to for this dtype (TMA16_STANDIN, TMA_TF32_STANDIN)."""
    return TMA_TF32_STANDIN if dtype is DT.FLOAT32 else TMA16_STANDIN
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


# A family's tables by _slot: float64, TF32, float32 "ieee", float32's default, 16-bit.
_FAMILY_TEMPLATES = (SIMT_TEMPLATE, MMA_TEMPLATE, SIMT_TEMPLATE, SIMT_TEMPLATE, MMA_TEMPLATE)
_GEMM_TABLES = (SIMT_F64, MMA_TF32, SIMT_F32, F32_DEFAULT, MMA_F16)
_LINEAR_TABLES = (LINEAR_SIMT_F64, LINEAR_MMA_TF32, LINEAR_SIMT_F32, LINEAR_F32, LINEAR_MMA_F16)


def _slot(dtype: CudaDataType, precision: Optional[str]) -> int:
    """The index of a dtype and precision in the family tables above."""
    if dtype is DT.FLOAT64:
        return 0
    if dtype is DT.FLOAT32:
        if precision == "tf32":
            return 1
        return 2 if precision == "ieee" else 3
    return 4


def gemm_family(dtype: CudaDataType, precision: Optional[str]) -> Tuple[str, Dict[str, list]]:
    """(template, candidate lists by class) for a dtype and precision."""
    slot = _slot(dtype, precision)
    return _FAMILY_TEMPLATES[slot], _GEMM_TABLES[slot]


def linear_family(dtype: CudaDataType, precision: Optional[str]) -> Tuple[str, Dict[str, list]]:
    """(template, candidate lists by class) of the one-kernel linear layer."""
    slot = _slot(dtype, precision)
    return _FAMILY_TEMPLATES[slot], _LINEAR_TABLES[slot]


def family(dtype: CudaDataType, precision: Optional[str],
           linear: bool = False) -> Tuple[str, Dict[str, list]]:
    """(template, candidate lists by class) of the GEMM (linear=True: of the one-kernel
    linear layer) for a dtype and normalized precision."""
    return (linear_family if linear else gemm_family)(dtype, precision)


def candidates(dtype: CudaDataType, precision: Optional[str], shape_class: str,
               vec: bool, linear: bool = False) -> List[Dict[str, int]]:
    """The tile configs the autotuner chooses from for this dtype, precision and class
    (linear=True: those of the one-kernel linear layer)."""
    _, table = (linear_family if linear else gemm_family)(dtype, precision)
    cands = list(table[shape_class])
    if not vec:
        cands = [c for c in cands if c in SCALAR_OK] or [table["small"][0]]
    return cands


def all_configs(dtype: CudaDataType, precision: Optional[str]) -> List[Dict[str, int]]:
    """Every distinct config of a family (used by tests and the config sweep)."""
    _, table = gemm_family(dtype, precision)
    out: List[Dict[str, int]] = []
    for cands in table.values():
        for c in cands:
            if c not in out:
                out.append(c)
    return out


def linear_configs(dtype: CudaDataType, precision: Optional[str],
                   vec: bool) -> List[Dict[str, Any]]:
    """Every config the linear layer may launch for a family and alignment."""
    out: List[Dict[str, Any]] = []
    _, table = linear_family(dtype, precision)
    for cls in table:
        for c in candidates(dtype, precision, cls, vec, linear=True):
            if c not in out:
                out.append(c)
    return out


def has_tn_kernel(dtype: CudaDataType, precision: Optional[str]) -> bool:
    """An a_trans kernel exists for the family: SIMT (float32 on CUDA cores, float64), the
    float32 default's 3xTF32 and the 16-bit mma; TF32 transposes A first."""
    return not (dtype is DT.FLOAT32 and precision == "tf32")


def tn_configs(dtype: CudaDataType, precision: Optional[str],
               vec: bool) -> List[Dict[str, Any]]:
    """Every config the A-transposed GEMM may launch for a family and alignment: the GEMM's
    own (no wgmma, TF32 or 16-bit, no skinny); none where the family has no a_trans kernel."""
    if not has_tn_kernel(dtype, precision):
        return []
    out: List[Dict[str, Any]] = []
    for c in all_configs(dtype, precision):
        if not (c.get("wgmma") or c.get("wgmma16") or c.get("tma16") or c.get("dmma")) and \
                (vec or c in SCALAR_OK) and c not in out:
            out.append(c)
    return out
