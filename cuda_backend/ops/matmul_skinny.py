"""Matmul for few rows (M <= 64): the skinny split-K configs (K sliced over many blocks, then a
reduce) and the cluster configs (K sliced over the blocks of one thread-block cluster, summed
in distributed shared memory: one launch), with their template parameters, block geometry and
the (config, split) candidates the autotuner times beside the family's own. The launches are
in matmul_launch.py."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..dtypes import CudaDataType
from ..kernels import dtype_params
from .matmul_shapes import Plan

DT = CudaDataType


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
# ... and to the linear layers (whose own kernels do not split K) up to this M where the
# output is few 128 x 128 tiles (at most a quarter of the SMs): 128 x 512 -> 512 is 4 tiles,
# 52 us of float32 GELU-gradient recompute on 4 blocks against PyTorch's 13 us GEMM (H200,
# perf/NOTES.md "Linear layers" S21)
SKINNY_FEW_TILES_MAX_M = 512
SKINNY_MIN_K = 256
SKINNY_MIN_CHUNK = 32  # a block's K slice is at least this long
SKINNY_WAVES = (1, 2, 4)   # split counts timed: about this many blocks per SM


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


def skinny_threads(cfg: Dict[str, Any]) -> int:
    return cfg["bn"] // cfg["tn"]


def skinny_smem(cfg: Dict[str, Any], b_trans: bool, esize: int = 4) -> int:
    """Dynamic shared memory of a skinny launch: per stage A's mt x (bk + 4) tile and B's,
    bn x (bk + 4) with b_trans (k-contiguous rows), bk x bn without."""
    return _ring_smem(cfg, cfg["mt"], b_trans, esize)


def _ring_smem(cfg: Dict[str, Any], rows: int, b_trans: bool, esize: int) -> int:
    """The cp.async ring of a skinny or cluster launch: `stages` x (A's rows x (bk + 4) tile
    + B's, bn x (bk + 4) with b_trans, bk x bn without)."""
    ks = cfg["bk"] + 4
    w = cfg["bn"] * ks if b_trans else cfg["bk"] * cfg["bn"]
    return cfg["stages"] * (rows * ks + w) * esize


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


def few_tiles(p: Plan, sm_count: int) -> bool:
    """The output is at most SKINNY_FEW_TILES_MAX_M rows and sm_count / 4 tiles of 128 x 128."""
    return p.M <= SKINNY_FEW_TILES_MAX_M and \
        4 * -(-p.M // 128) * -(-p.N // 128) <= sm_count


def skinny_candidates(dtype: CudaDataType, precision: Optional[str], p: Plan, sm_count: int,
                      max_y: int = 65535, linear: bool = False) -> List[Dict[str, Any]]:
    """The autotuner's (skinny config, split) candidates for a call, beside the family's
    own: only for M <= SKINNY_MAX_M (linear=True, the linear layers: or few output tiles,
    `few_tiles`), K >= SKINNY_MIN_K, batch 1, float32 on CUDA cores."""
    small_m = 1 <= p.M <= SKINNY_MAX_M or (linear and p.M >= 1 and few_tiles(p, sm_count))
    if p.batch != 1 or not small_m or p.K < SKINNY_MIN_K:
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
# bn x tile x split count (the cluster size is compiled in; bn 32 with CLUSTER_NARROW_TILES
# only), the calls get the split counts near one wave of blocks (cluster_split_choices).
# Timed on an H100 (cold L2): linear 32x1024 -> 4096 + GELU 19.1 us (bn 64, 2 splits, 8x4
# kw 4) against the split-K + reduce's 24.6, 32x1024 -> 1024 11.8 (bn 64, 8 splits, 4x4
# kw 1) against 15.5, matmul 32x1024 @ 1024x4096 17.2 against 20.0; 32x4096 -> 1024 at
# parity (24.3 / 24.2). ptxas sm_90, no spills: 87-168 registers, 252 for bn 64 8x8 kw 4
# with B (N, K) (128 threads); bn 32: 96-122.
CLUSTER_TILES = ((4, 4, 1), (4, 4, 2), (8, 4, 2), (8, 4, 4), (8, 8, 4))
CLUSTER_SPLITS = (1, 2, 4, 8)
# 32-column tiles (two of the tiles, 128 threads): where N is small and K large, twice the
# column tiles at the same split count (the MLP's 32x4096 @ 4096x1024: 256 blocks in clusters
# of 8 at 20.0-20.1 us against bn 64's 22.3 on an H100, perf/NOTES.md "Matmul, skinny M" S14).
CLUSTER_NARROW_TILES = ((4, 4, 2), (8, 4, 4))
CLUSTER_F32 = [_cluster(bn, tr, tc, kw, s)
               for bn, tiles in ((32, CLUSTER_NARROW_TILES), (64, CLUSTER_TILES),
                                 (128, CLUSTER_TILES))
               for tr, tc, kw in tiles for s in CLUSTER_SPLITS]
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
    return _ring_smem(cfg, CLUSTER_ROWS, b_trans, esize)


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
