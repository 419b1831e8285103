"""Layer normalization's kernels (`templates/layer_norm.cu.j2`): the register configs that hold
a row, their parameters and resident blocks, the candidates of a row length and the autotuned
pick among them, one launch's geometry, and the per-call plan. ops/normalization.py's
layer_norm checks the arguments and calls these.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Dict, List, Optional, Tuple

from .. import occupancy
from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError
from ..kernels import dtype_params
from ..tensor import CudaTensor, pool_tensor
from . import common
from .normalization_common import DT, vec_width

LN_TEMPLATE = "layer_norm.cu.j2"
# layer_norm register configs (threads_per_row, vpt, block_size): warp per row (8 rows a
# block), then block per row, 1 to 8 vectors a thread.
LN_VEC_CONFIGS = ((32, 1, 256), (32, 2, 256), (32, 4, 256), (32, 8, 256),
                  (64, 1, 64), (64, 2, 64), (64, 4, 64), (128, 1, 128), (128, 2, 128),
                  (128, 4, 128), (128, 8, 128), (256, 1, 256), (256, 2, 256), (256, 4, 256),
                  (256, 8, 256), (512, 1, 512), (512, 2, 512), (512, 4, 512), (512, 8, 512),
                  (1024, 1, 1024), (1024, 2, 1024), (1024, 4, 1024), (1024, 8, 1024))
# Inputs under LN_AUTOTUNE_MIN elements take ln_small_pick's config, no autotuning. From a
# sweep of rows 64-8192 x D 256-8192 (perf/NOTES.md "Normalization" S18): block per row with
# 1 vector a thread under 1024 rows, 2 under 4096, else 4 (warp per row where no block-per-
# row config holds the row with that few), 64-thread blocks only with 1 vector, 1024 x 1
# only under 256 rows.
LN_AUTOTUNE_MIN = 1 << 22
LN_SMALL_VPT = ((1024, 1), (4096, 2))   # (rows under, vectors a thread); more rows: 4
LN_WIDE_ROWS = 256    # from this many rows, 1024-thread blocks with one vector are passed over
# the same kernel, persistent with next-row prefetch (block per row only)
LN_PREFETCH_CONFIGS = ((128, 4, 128), (256, 2, 256), (256, 4, 256), (512, 2, 512),
                       (512, 4, 512), (1024, 2, 1024))
LN_SCALAR_CONFIGS = ((32, 4, 256), (256, 4, 256), (1024, 8, 1024))
LN_LOOP_BLOCK = 512
LN_PERSIST_WAVES = 1  # persistent grid: this many times the resident blocks per SM
LN_WORK_REGS = 24     # registers besides the row's vectors (block per row; float64: next)
LN_WORK_REGS_F64 = 32
# layer_norm candidate lists already compiled, per CudaMath: (device, dtype, D, use_vec)
_ln_compiled: "weakref.WeakKeyDictionary[Any, set]" = weakref.WeakKeyDictionary()


# -- template parameters ---------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def ln_min_blocks(dtype: CudaDataType, tpr: int, vpt: int, block: int, vec: int,
                  prefetch: bool) -> int:
    """Resident blocks per SM the kernel's register budget allows (__launch_bounds__).
    Warp-per-row and looping kernels keep their measured 1024 threads per SM; block-per-row
    ones take as many blocks as the register file holds for their vectors (x2 with prefetch)
    plus the working registers (occupancy.blocks_per_sm, Hopper's limits). All compile
    spill-free."""
    if tpr == 32 or vpt == 0:
        return 1 if block >= 1024 else 1024 // block
    words = vpt * max(1, vec * dtype.itemsize // 4) * (2 if prefetch else 1)
    need = words + (LN_WORK_REGS_F64 if dtype is DT.FLOAT64 else LN_WORK_REGS)
    return occupancy.blocks_per_sm(occupancy.KernelResources(need), None, block)


def ln_params(dtype: CudaDataType, tpr: int, vpt: int, block: int, vec: int,
              prefetch: bool = False) -> Dict[str, Any]:
    """layer_norm.cu.j2 parameters of one config (min_blocks: ln_min_blocks')."""
    return {**dtype_params(dtype), "threads_per_row": tpr, "vpt": vpt, "vec": vec,
            "block_size": block,
            "min_blocks": ln_min_blocks(dtype, tpr, vpt, block, vec, prefetch),
            "prefetch": bool(prefetch)}


# -- configs: candidates, the autotuned pick, one launch -------------------------------
LnConfig = Tuple[int, int, int, int, int]  # threads_per_row, vpt, block, vec, prefetch


def ln_candidates(D: int, dtype: CudaDataType, use_vec: bool) -> List[LnConfig]:
    """(threads_per_row, vpt, block, vec, prefetch) configs able to hold a row of D, the
    tightest capacity only (plain before prefetch); the looping kernel when none can."""
    vec = vec_width(dtype) if use_vec else 1
    configs = [(tpr, vpt, blk, 0) for tpr, vpt, blk in
               (LN_VEC_CONFIGS if use_vec else LN_SCALAR_CONFIGS)]
    if use_vec:
        configs += [(tpr, vpt, blk, 1) for tpr, vpt, blk in LN_PREFETCH_CONFIGS]
    fits = [c for c in configs if c[0] * c[1] * vec >= D]
    if not fits:
        return [(LN_LOOP_BLOCK, 0, LN_LOOP_BLOCK, vec, 0)]
    tightest = min(tpr * vpt for tpr, vpt, _, _ in fits)
    return [(tpr, vpt, blk, vec, pf) for tpr, vpt, blk, pf in fits if tpr * vpt == tightest]


def ln_pick(m: Any, x: CudaTensor, out: CudaTensor, weight: Optional[CudaTensor],
            bias: Optional[CudaTensor], rows: int, D: int, eps: float,
            use_vec: bool) -> LnConfig:
    """The config for this row length: autotuned among equally tight ones for large inputs."""
    cands = ln_candidates(D, x.dtype, use_vec)
    if len(cands) == 1:
        return cands[0]
    if x.size < LN_AUTOTUNE_MIN:
        return ln_small_pick(cands, rows)
    names = ("threads_per_row", "vpt", "block", "vec", "prefetch")
    keys = [dict(zip(names, c)) for c in cands]
    size_class = (x.dtype.name_str, D, "large" if x.size >= 1 << 25 else "medium")
    done = _ln_compiled.setdefault(m, set())
    if (x.device_id, x.dtype, D, use_vec) not in done:  # compile them all at once
        common.compile_all(m, [(LN_TEMPLATE, ln_params(x.dtype, tpr, vpt, blk, vec, bool(pf)))
                               for tpr, vpt, blk, vec, pf in cands], x.device_id)
        done.add((x.device_id, x.dtype, D, use_vec))
    best = m.autotuner.pick("layer_norm", size_class, keys,
                            lambda k: ln_launch(m, tuple(k[n] for n in names), x, out, weight,
                                                bias, rows, D, eps),
                            device_id=x.device_id)
    return tuple(best[n] for n in names)


def ln_small_pick(cands: List[LnConfig], rows: int) -> LnConfig:
    """The config of an input too small to autotune (LN_SMALL_VPT): the block-per-row
    candidate with the fewest vectors a thread at least the rows' target (of 128 threads or
    more from 1024 rows), else the first candidate (warp per row)."""
    want = next((v for under, v in LN_SMALL_VPT if rows < under), 4)
    narrowest = 64 if want == 1 else 128
    per_row = sorted((c for c in cands if c[0] == c[2] and c[0] >= narrowest and not c[4] and
                      c[1] >= want and not (rows >= LN_WIDE_ROWS and c[0] == 1024 and
                                            c[1] == 1)),
                     key=lambda c: c[1])
    return per_row[0] if per_row else cands[0]


def ln_launch(m: Any, cfg: LnConfig, x: CudaTensor, out: CudaTensor,
              weight: Optional[CudaTensor], bias: Optional[CudaTensor], rows: int, D: int,
              eps: float, max_grid: int = 0) -> None:
    """One launch of cfg; max_grid (tests) caps a persistent grid below its default of
    resident blocks per SM x SMs x LN_PERSIST_WAVES."""
    dev = x.device_id
    kernel, grid, block = ln_geometry(m, cfg, x.dtype, dev, rows, max_grid)
    m.backend.launch_kernel(kernel.name, (grid, 1, 1), x, out,
                            weight if weight is not None else 0,
                            bias if bias is not None else 0, rows, D, 1.0 / D, eps,
                            block_size=(block, 1, 1), device_id=dev)


def ln_geometry(m: Any, cfg: LnConfig, dtype: CudaDataType, dev: int, rows: int,
                max_grid: int = 0) -> Tuple[Any, int, int]:
    """(compiled kernel, grid, block size) of one layer_norm launch of cfg over rows."""
    tpr, vpt, block, vec, prefetch = cfg
    params = ln_params(dtype, tpr, vpt, block, vec, bool(prefetch))
    kernel = m.kernel(LN_TEMPLATE, dev, **params)
    rows_per_block = block // tpr
    grid = -(-rows // rows_per_block)
    if prefetch:
        sms = int(m.backend.get_device_info(dev).multiprocessor_count)
        grid = min(grid, max_grid or sms * params["min_blocks"] * LN_PERSIST_WAVES)
    if grid > 2**31 - 1:
        raise InvalidArgumentError(f"layer_norm supports under 2^31 row blocks, got {rows} rows")
    return kernel, grid, block


# -- the per-call plan ----------------------------------------------------------------
def ln_call_plan(m: Any, x: CudaTensor, has_weight: bool, has_bias: bool, eps: float) -> Any:
    """The per-call plan of layer_norm on inputs shaped like x (ops/common.py
    remember_plan): weight/bias checked as the general path would (a mismatch returns None:
    the general path raises), the result allocated, one prepared launch. Which config runs
    depends on the pointers (use_vec, computed as layer_norm does): `variants` maps use_vec
    to the launch the general path chose for it, and a use_vec not seen yet returns None
    (the general path launches it and adds it)."""
    dev, shape, dtype = x.device_id, x.shape, x.dtype
    size, nbytes = x.size, x.nbytes
    D = shape[-1]
    rows, inv_d, vec = size // D, 1.0 / D, vec_width(dtype)
    vec_rows = D % vec == 0
    dshape = (D,)
    pool = m.backend.memory_pools[dev]
    alloc = pool.allocate_current
    variants: Dict[bool, Any] = {}

    def run(x: CudaTensor, weight: Any, bias: Any) -> Optional[CudaTensor]:
        px = x._ptr
        if px is None or x.stream is not None:
            return None
        pw = common.plan_pointer(weight, dshape, dtype, dev) if has_weight else 0
        pb = common.plan_pointer(bias, dshape, dtype, dev) if has_bias else 0
        if pw is None or pb is None:
            return None
        out = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        po = out._ptr
        go = variants.get(vec_rows and not (px | po | pw | pb) & 15)
        if go is None:
            out.free()
            return None
        go(px, po, pw, pb, rows, D, inv_d, eps)
        return out
    run.variants = variants  # type: ignore[attr-defined]
    return run
