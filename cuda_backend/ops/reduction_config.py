"""The reductions' kernel configuration: result and accumulator dtypes, the template
parameters of reduce.cu.j2 and reduce_axis.cu.j2, the single-axis passes a reduction runs as,
and each pass's launch sizing. Pure functions of shapes, dtypes and device limits, shared by
ops/reduction.py (the ops) and ops/reduction_passes.py (their launches), and checked without
a GPU by tests/test_reduce.py and tests/test_occupancy.py.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

from .. import occupancy
from ..dtypes import CudaDataType
from ..kernels import accumulator_type

BLOCK = 256            # threads per block of both kernels
UNROLL = 4             # 16-byte loads in flight per thread
MAX_SPLIT_GROUPS = 4096  # ticket counters kept per device (rows or tile groups of a split launch)
# Split launches use at most this many blocks per SM (fewer if fewer fit): a 2^28 float32 sum
# on an H200 took 0.2604 / 0.2512 / 0.2543 / 0.2542 ms with 2 / 3 / 4 / 5 blocks per SM.
SPLIT_BLOCKS_PER_SM = 3
# A row split over fewer blocks than this runs on one: the split's ticket and second read of
# the partials cost ~2 us (H200 report: 4096 float64, two splits, 6.62 us against 4.54 for
# 4096 float32 on one block and 6.21 for 65536 float64 on 32 splits).
MIN_SPLITS = 3
ROWS_TEMPLATE = "reduce.cu.j2"
AXIS_TEMPLATE = "reduce_axis.cu.j2"

_INT_ACC = {CudaDataType.INT32: "int", CudaDataType.INT64: "long long"}


# -- dtypes and template parameters --------------------------------------------------------
def kernel_config(dtype: CudaDataType, op: str) -> Tuple[str, str, CudaDataType]:
    """(kernel op, accumulator C type, result dtype) of `op` ("sum", "mean", "max", "min",
    "argmax") on `dtype`."""
    if op == "argmax":
        acc = _INT_ACC.get(dtype) or accumulator_type(dtype)
        return "argmax", acc, CudaDataType.INT64
    if dtype.is_floating:
        return ("sum" if op == "mean" else op), accumulator_type(dtype), dtype
    if op == "sum":
        return "sum", "long long", CudaDataType.INT64
    if op == "mean":
        return "sum", "double", CudaDataType.FLOAT64
    return op, _INT_ACC[dtype], dtype


def kernel_params(dtype: CudaDataType, op: str) -> Dict[str, Any]:
    """Template parameters (both templates take the same) for `op` on `dtype`."""
    kop, acc, out_dtype = kernel_config(dtype, op)
    # Register budgets that compile without spills (ptxas's own choice spilled the int32
    # mean): 5 blocks of 256 per SM (<= 48 registers), argmax's (value, index) pairs 3.
    return {"dtype": dtype.name_str, "ctype": dtype.c_type, "acc": acc,
            "out_ctype": out_dtype.c_type, "op": kop, "block_size": BLOCK,
            "min_blocks": 3 if kop == "argmax" else 5, "unroll": UNROLL}


def result_dtype(dtype: CudaDataType, op: str) -> CudaDataType:
    return kernel_config(dtype, op)[2]


# -- shapes --------------------------------------------------------------------------------
def reduced_shape(shape: Sequence[int], axes: Sequence[int], keepdims: bool) -> Tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else s for i, s in enumerate(shape))
    return tuple(s for i, s in enumerate(shape) if i not in axes)


def collapse(shape: Sequence[int], axes: Sequence[int]) -> List[List[Any]]:
    """[[size, reduced], ...]: the shape with size-1 dims dropped and neighbours of the same
    kind merged, so the reduced axes form as few contiguous runs as the layout allows."""
    segs: List[List[Any]] = []
    for i, s in enumerate(shape):
        if s == 1:
            continue
        red = i in axes
        if segs and segs[-1][1] == red:
            segs[-1][0] *= s
        else:
            segs.append([s, red])
    return segs


def plan_passes(shape: Sequence[int], axes: Sequence[int]) -> List[Tuple[int, int, int]]:
    """[(outer, R, inner), ...]: single-axis passes, innermost reduced run first. A
    reduction of nothing (no axes, or only size-1 axes) is one pass with R == 1."""
    segs = collapse(shape, axes)
    passes = []
    while True:
        red = [i for i, (_, r) in enumerate(segs) if r]
        if not red:
            break
        k = red[-1]
        outer = math.prod(s for s, _ in segs[:k])
        inner = math.prod(s for s, _ in segs[k + 1:])
        passes.append((outer, segs[k][0], inner))
        rest = segs[:k] + segs[k + 1:]
        segs = []
        for s, r in rest:
            if segs and segs[-1][1] == r:
                segs[-1][0] *= s
            else:
                segs.append([s, r])
    if not passes:
        passes.append((math.prod(shape), 1, 1))
    return passes


# -- launch sizing -------------------------------------------------------------------------
def _pow2ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# Blocks of `threads` threads one SM holds at once (the name tests and tools use)
resident_blocks = occupancy.blocks_per_sm


def rows_config(rows: int, R: int, itemsize: int, wave: int) -> Tuple[int, int, int]:
    """(group, splits, grid) for reduce.cu.j2: `wave` is how many blocks a split launch may
    use (all at once on the GPU). Short rows get 1-32 lanes each; long rows a block, split
    over several blocks when there are too few rows to fill the GPU."""
    vec = 16 // itemsize
    if R <= 32 * vec * 8:
        # about UNROLL vectors per lane: that many 16-byte loads in flight per thread
        group = min(32, _pow2ceil(-(-R // (vec * UNROLL))))
        return group, 1, -(-rows // (BLOCK // group))
    splits = 1
    if rows <= min(wave // 2, MAX_SPLIT_GROUPS):
        # at most one wave of blocks: a second, partial wave would idle most SMs
        nvec = R // vec
        splits = max(1, min(wave // rows, nvec // (BLOCK * UNROLL)))
        if splits < MIN_SPLITS:
            splits = 1
    return BLOCK, splits, rows * splits


def axis_config(outer: int, R: int, inner: int, itemsize: int, aligned: bool,
                wave: int) -> Dict[str, int]:
    """Launch sizing for reduce_axis.cu.j2: block (bx, by), tiles, splits, rows per split,
    vec_on; threads in x take 16-byte column vectors when inner allows."""
    vec = 16 // itemsize
    vec_on = int(aligned and inner % vec == 0)
    w = vec if vec_on else 1
    ncols = -(-inner // w)
    bx = min(32, _pow2ceil(ncols))
    by = max(1, min(BLOCK // bx, _pow2ceil(R)))
    tiles = -(-ncols // bx)
    groups = outer * tiles
    splits = 1
    if groups <= min(wave // 2, MAX_SPLIT_GROUPS):
        splits = max(1, min(wave // groups, R // (by * 8), 65535))
    rows_per_split = max(1, -(-R // splits))
    splits = max(1, -(-R // rows_per_split))
    return {"bx": bx, "by": by, "tiles": tiles, "groups": groups, "splits": splits,
            "rows_per_split": rows_per_split, "vec_on": vec_on, "width": bx * w}
