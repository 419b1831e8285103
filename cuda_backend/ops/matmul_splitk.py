"""Matmul split-K: how many K slices a tiled GEMM config runs in (partials in a workspace, then
`splitk_reduce`): the modelled count of a SIMT config (`split_count`) and of a 3xTF32 one
(`x3_split_time`), and the counts the autotuner times beside it (`split_candidates`)."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from .matmul_shapes import Plan
from .matmul_skinny import SKINNY_MAX_M


# Split-K counts the autotuner times besides the modelled one, where split-K is in play;
# for M <= SKINNY_MAX_M (few output tiles) also SPLIT_TRIES_SMALL_M, with K chunks >= 128.
SPLIT_TRIES = (1, 2, 3, 4, 6, 8)
SPLIT_TRIES_SMALL_M = (12, 16)


def split_chunk(K: int, bk: int, splits: int) -> Tuple[int, int]:
    """(k_chunk, effective splits) of a split-K launch: K in slices of whole bk-deep tiles."""
    chunk = -(-K // splits)
    chunk = -(-chunk // bk) * bk
    return chunk, -(-K // chunk)


def effective_split(cfg: Dict[str, Any], K: int, splits: int) -> int:
    """The number of K chunks run_config launches for a requested split count."""
    return split_chunk(K, cfg["bk"], max(1, splits))[1]


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
    "split" key per split_options count, each x3 and DMMA one per x3_split_options count at
    the kernel's rate (run_config takes the key out before rendering). per_sm(cfg): a SIMT
    config's resident blocks per SM (None: the configs' min_blocks)."""
    out: List[Dict[str, Any]] = []
    for c in cands:
        if c.get("dmma"):
            splits = x3_split_options(c, p, sm_count, max_z, DMMA_SM_FLOPS, 8)
        elif c.get("x3"):
            splits = x3_split_options(c, p, sm_count, max_z)
        else:
            ps = per_sm(c) if per_sm is not None else 0
            splits = split_options(c, p, shape_cls, sm_count, max_z, ps)
        for s in splits:
            out.append({**c, "split": s})
    return out


# The tensor-core GEMMs' split-K model: one SM's rate, 3xTF32 (the linear layer's x3 kernels
# held 213 TF/s of mma.sync on the H200, 3 mma per product over 132 SMs) or DMMA (the float64
# GEMM's 46 TF/s at 4096^3 on the H200, perf/NOTES.md "Matmul, float64 on DMMA"), the split
# counts modelled, the shortest K slice.
X3_SM_FLOPS = 213e12 / 3 / 132
DMMA_SM_FLOPS = 46e12 / 132
X3_SPLITS = tuple(range(2, 17))
X3_MIN_CHUNK = 256


def x3_split_time(cfg: Dict[str, Any], p: Plan, sm_count: int, splits: int,
                  sm_flops: float = X3_SM_FLOPS, word: int = 4) -> float:
    """Modelled seconds of a tensor-core GEMM config (x3; DMMA at its sm_flops, 8-byte
    words) at a split count: the busiest SM runs ceil(blocks / (SMs x min_blocks)) waves of
    min_blocks blocks sharing its tensor cores, each over (K slice + 64) k at sm_flops, plus
    for splits > 1 the partials written and summed (2 x splits x batch M N words at ~3
    TB/s, + 4 us for the reduce's launch)."""
    chunk = -(-p.K // splits)
    chunk = -(-chunk // cfg["bk"]) * cfg["bk"]
    per_sm = cfg["min_blocks"]
    blocks = p.batch * -(-p.M // cfg["bm"]) * -(-p.N // cfg["bn"]) * splits
    waves = -(-blocks // (sm_count * per_sm))
    t = waves * per_sm * 2.0 * cfg["bm"] * cfg["bn"] * (chunk + 64) / sm_flops
    if splits > 1:
        t += 2.0 * splits * p.batch * p.M * p.N * word / 3e12 + 4e-6
    return t


def x3_split_options(cfg: Dict[str, Any], p: Plan, sm_count: int, max_z: int = 65535,
                     sm_flops: float = X3_SM_FLOPS, word: int = 4) -> List[int]:
    """Split-K counts to time for a tensor-core GEMM config (x3, or DMMA at its sm_flops and
    8-byte words): 1 (no workspace), then at most two effective counts of X3_SPLITS (K slices >= X3_MIN_CHUNK, splits x batch <= max_z) that
    x3_split_time puts >= 3 % below one split, the fastest first: outputs of few tiles
    (wave quantization) or few blocks."""
    most = max(1, min(p.K // X3_MIN_CHUNK, max(X3_SPLITS), max_z // max(1, p.batch)))
    t1 = x3_split_time(cfg, p, sm_count, 1, sm_flops, word)
    timed: List[Tuple[float, int]] = []
    for s in X3_SPLITS:
        if s > most:
            break
        eff = effective_split(cfg, p.K, s)
        if eff > 1 and all(eff != e for _, e in timed):
            timed.append((x3_split_time(cfg, p, sm_count, eff, sm_flops, word), eff))
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
