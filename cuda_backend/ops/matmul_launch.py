"""Matmul launches, the general path: the per-CudaMath memo of compiled kernels and chosen configs,
the autotuned choice of a call's config (`launch`), and `run_config`, which launches one
config over the whole problem (split-K and its reduce, batch chunks, the wgmma B copies, the
TMA kernel (matmul_tma16.py), the skinny and cluster kernels). matmul_plans.py replays the same
launches as PreparedLaunches."""
from __future__ import annotations

import weakref
from typing import Any, Dict, Optional, Tuple

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError
from ..kernels import dtype_params
from ..tensor import CudaTensor
from . import common
from .elementwise_kernels import FILL_BLOCK, fill_grid
from .matmul_configs import WGMMA16_STANDIN, candidates, gemm_family, tma_standin
from .matmul_kernels import (DMMA_TEMPLATE, FILL_TEMPLATE, GRAD_EPILOGUE, MMA_TEMPLATE,
                             REDUCE_BLOCK, SIMT_TEMPLATE, SKINNY_TEMPLATE, TMA16_TEMPLATE,
                             WGMMA16_TEMPLATE, WGMMA16_THREADS, WGMMA_TEMPLATE, blocks_per_sm,
                             compile_tma16, config_template, dmma_smem, has_clusters, has_wgmma,
                             kernel_params, simt_smem, splitk_epilogue_params,
                             splitk_reduce_params, takes_k_chunk, template_runs_on,
                             tma16_params, wgmma16_b_direct, wgmma16_ok, wgmma16_params,
                             wgmma_ok, wgmma_params, wgmma_smem)
from .matmul_pad import (free_all, operand_layout, pad_a_launches, pad_b_launches, planes_of,
                         run_copies, wgmma16_a_direct)
from .matmul_shapes import Plan, is_vec_ok, shape_class, tune_key
from .matmul_skinny import (cluster_candidates, cluster_chunk, cluster_params, cluster_smem,
                            cluster_threads, cluster_tiles, skinny_candidates, skinny_chunk,
                            skinny_params, skinny_smem, skinny_split_options, skinny_threads,
                            skinny_tiles)
from .matmul_splitk import split_candidates, split_chunk, split_count
from .matmul_tma16 import run_tma16, tma16_usable

DT = CudaDataType


def fill_zero(m: Any, out: CudaTensor, dev: int) -> None:
    """out[:] = 0 with fill.cu.j2's kernel (K == 0: an empty sum)."""
    kernel = cached_kernel(m, FILL_TEMPLATE, dev, {**dtype_params(out.dtype),
                                                   "block_size": FILL_BLOCK})
    m.backend.launch_kernel(kernel.name, (fill_grid(out.size, out.dtype), 1, 1), out,
                            0.0, out.size, block_size=(FILL_BLOCK, 1, 1), device_id=dev)


# Per-CudaMath memo: (plan, dtype, precision, device, vec) -> (template, config), and
# (template, device, params) -> kernel, so a repeated call skips the autotuner's lookup and
# the generator's JSON key (tens of microseconds of Python per call otherwise).
_memo: "weakref.WeakKeyDictionary[Any, Dict[Any, Any]]" = weakref.WeakKeyDictionary()


def memo(m: Any) -> Dict[Any, Any]:
    """m's memo (above), made on first use."""
    c = _memo.get(m)
    if c is None:
        c = _memo[m] = {}
    return c


def cached_kernel(m: Any, template: str, dev: int, params: Dict[str, Any]) -> Any:
    """m.kernel(template, dev, **params) (the TMA kernel: compile_tma16), memoized by the
    parameter items."""
    cache = memo(m)
    key = (template, dev, tuple(sorted(params.items())))
    k = cache.get(key)
    if k is None:
        k = cache[key] = compile_tma16(m, dev, params) if template == TMA16_TEMPLATE else \
            m.kernel(template, dev, **params)
    return k


def compile_kernel(m: Any, template: str, dev: int, params: Dict[str, Any]) -> Any:
    """The memoized kernel getter of this module (common.compile_all's `get`)."""
    return cached_kernel(m, template, dev, params)


def config_key(p: Plan, dtype: CudaDataType, prec: Optional[str], dev: int, vec: bool,
               epilogue: Optional[str] = None, a_trans: bool = False) -> tuple:
    """The per-CudaMath memo key of a call's chosen config (launch, remember)."""
    if a_trans:
        return ("tn", p, dtype, prec, dev, vec)
    if epilogue is None:
        return (p, dtype, prec, dev, vec)
    return ("linear", p, dtype, prec, dev, vec, epilogue)


def launch(m: Any, a: CudaTensor, b: CudaTensor, out: CudaTensor, p: Plan,
           dtype: CudaDataType, prec: Optional[str], dev: int, epilogue: Optional[str] = None,
           bias: Optional[CudaTensor] = None, a_trans: bool = False,
           grad: Optional[CudaTensor] = None) -> bool:
    """Launch the call's (autotuned) config; returns vec (the plan's alignment class).
    a_trans: A given as (K, M) (the GEMM's configs, split-K included; no wgmma, no skinny).
    The float32 default's GEMM candidates are (config, split) pairs of x3 and SIMT configs;
    16-bit ones include the TMA and wgmma16 configs where the call can take them
    (tma16_usable, wgmma16_usable)."""
    vec = is_vec_ok(a, b, out, p, a_trans)
    cache = memo(m)
    key = config_key(p, dtype, prec, dev, vec, epilogue, a_trans)
    hit = cache.get(key)
    if hit is None:
        sms = m.backend.get_device_info(dev).multiprocessor_count
        cls = shape_class(p, sms)
        is_linear = epilogue is not None
        template, _ = gemm_family(dtype, prec)
        cands = _call_candidates(m, a, b, out, p, dtype, prec, dev, vec, epilogue, a_trans,
                                 template, cls, sms)
        op = op_name(template, dtype, prec, is_linear) + ("_at" if a_trans else "") + \
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


def _call_candidates(m: Any, a: CudaTensor, b: CudaTensor, out: CudaTensor, p: Plan,
                     dtype: CudaDataType, prec: Optional[str], dev: int, vec: bool,
                     epilogue: Optional[str], a_trans: bool, template: str, cls: str,
                     sms: int) -> list:
    """launch's candidates for the autotuner: the family's configs for the shape class less
    those this device or these operands cannot take (wgmma, TMA, wgmma16: their stand-ins
    where none is left; DMMA only for the plain GEMM on compute capability >= 9.0), then for
    SIMT the split-K pairs and the skinny and cluster configs."""
    is_linear = epilogue is not None
    cands = candidates(dtype, prec, cls, vec, linear=is_linear)
    info = m.backend.get_device_info(dev)
    if a_trans or not (has_wgmma(info) and wgmma_ok(a, p)):
        cands = [c for c in cands if not c.get("wgmma")] or \
            [c for c in gemm_family(dtype, prec)[1]["small"] if not c.get("wgmma")]
    if not tma16_usable(info, dtype, a, b, out, p, epilogue, a_trans):
        cands = [c for c in cands if not c.get("tma16")] or [tma_standin(dtype)]
    if not wgmma16_usable(info, dtype, a, out, p, epilogue, a_trans):
        cands = [c for c in cands if not c.get("wgmma16")] or [WGMMA16_STANDIN]
    if a_trans or is_linear or not template_runs_on(DMMA_TEMPLATE, info):
        cands = [c for c in cands if not c.get("dmma")] or \
            [c for c in gemm_family(dtype, prec)[1]["small"] if not c.get("dmma")]
    if template == SIMT_TEMPLATE and not is_linear:
        # (config, split) pairs: split-K counts are measured, not only modelled
        info = m.backend.get_device_info(dev)
        max_z = info.max_grid_dims[2]

        def per_sm(c: Dict[str, Any]) -> int:   # (SIMT configs; x3: x3_split_options)
            kern = cached_kernel(m, SIMT_TEMPLATE, dev,
                                 kernel_params(SIMT_TEMPLATE, dtype, c, vec, a_trans=a_trans))
            return blocks_per_sm(c, getattr(kern, "num_regs", 0), info, dtype.itemsize,
                                 getattr(kern, "static_shared_bytes", 0))

        cands = split_candidates(cands, p, cls, sms, max_z, per_sm)
    if template == SIMT_TEMPLATE and not a_trans:
        # small M: the skinny split-K configs too, each at its split counts, and on sm_90+
        # the cluster ones (timed against the family's own, never forced)
        info = m.backend.get_device_info(dev)
        cands = cands + skinny_candidates(dtype, prec, p, sms, info.max_grid_dims[1],
                                          is_linear) + \
            cluster_candidates(dtype, prec, p, sms,
                               getattr(info, "compute_capability", (0, 0)), vec)
    return cands


def wgmma16_usable(info: Any, dtype: CudaDataType, a: Any, out: Any, p: Plan,
                   epilogue: Optional[str] = None, a_trans: bool = False) -> bool:
    """A call the 16-bit wgmma kernel takes: an sm_90a device, the plain GEMM (no epilogue,
    A not transposed) and the operand rules of wgmma16_ok (A and B are copied where they
    must be, matmul_pad)."""
    return epilogue is None and not a_trans and has_wgmma(info) and \
        wgmma16_ok(dtype, a, out, p)


def op_name(template: str, dtype: CudaDataType, prec: Optional[str], linear: bool) -> str:
    """The autotuner's name for a candidate set (each distinct set has its own choices)."""
    if dtype is DT.FLOAT32 and prec in (None, "fp32"):
        # 3xTF32 and SIMT configs (LINEAR_F32, F32_DEFAULT)
        return "linear_x3simt_float32" if linear else "matmul_x3simt_float32"
    kind = "simt" if template == SIMT_TEMPLATE else "mma"
    return f"{'linear' if linear else 'matmul'}_{kind}_{dtype.name_str}" \
           f"{'_tf32' if prec == 'tf32' else ''}"


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
    if cfg.get("cluster"):
        if splits is not None and splits != cfg["splits"]:
            raise InvalidArgumentError(
                f"a cluster config runs at its own split count (the cluster size, "
                f"{cfg['splits']}), got splits={splits}")
        _run_cluster(m, cfg, a, b, out, p, dtype, vec, dev, epilogue, bias, grad)
        return
    info = m.backend.get_device_info(dev)
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
    if template == TMA16_TEMPLATE:
        if tma16_usable(info, dtype, a, b, out, p, epilogue, a_trans):
            params = tma16_params(dtype, cfg, out.dtype)
            run_tma16(m, cached_kernel(m, TMA16_TEMPLATE, dev, params), params, cfg, a, b, out,
                      p, dtype, dev, memo(m))
            return
        if dtype is DT.FLOAT32:   # (declined, TF32: the mma.sync TF32 kernel)
            run_config(m, MMA_TEMPLATE, tma_standin(dtype), a, b, out, p, dtype, vec, dev,
                       epilogue=epilogue, bias=bias, a_trans=a_trans, grad=grad)
            return
        # (declined: the 16-bit wgmma kernel, which gives way to mma.sync where it must)
        template, cfg = WGMMA16_TEMPLATE, tma_standin(dtype)
    if template == WGMMA16_TEMPLATE:
        _run_wgmma16_or_standin(m, cfg, a, b, out, p, dtype, vec, dev, info, max_z, epilogue,
                                bias, a_trans, grad)
        return
    if template == WGMMA_TEMPLATE:
        _run_wgmma(m, cfg, a, b, out, p, dev, max_z)
        return
    _run_tiled(m, template, cfg, a, b, out, p, dtype, vec, dev, info, tiles, splits, epilogue,
               bias, a_trans, grad)


def _run_wgmma16_or_standin(m: Any, cfg: Dict[str, int], a: CudaTensor, b: CudaTensor,
                            out: CudaTensor, p: Plan, dtype: CudaDataType, vec: bool, dev: int,
                            info: Any, max_z: int, epilogue: Optional[str],
                            bias: Optional[CudaTensor], a_trans: bool,
                            grad: Optional[CudaTensor]) -> None:
    """run_config's 16-bit wgmma config: the kernel where the call can take it, else the
    mma.sync stand-in (a config memoized for this shape and alignment class whose pointers
    or device it cannot take: never a wrong result)."""
    if not wgmma16_usable(info, dtype, a, out, p, epilogue, a_trans):
        run_config(m, MMA_TEMPLATE, WGMMA16_STANDIN, a, b, out, p, dtype, vec, dev,
                   epilogue=epilogue, bias=bias, a_trans=a_trans, grad=grad)
        return
    _run_wgmma16(m, cfg, a, b, out, p, dtype, dev, max_z)


def tiled_kernel(m: Any, template: str, cfg: Dict[str, Any], p: Plan, dtype: CudaDataType,
                 vec: bool, dev: int, info: Any, splits: Optional[int],
                 epilogue: Optional[str] = None,
                 a_trans: bool = False) -> Tuple[Any, int, int, bool, int]:
    """(kernel, threads, dynamic shared memory, takes_k_chunk, K splits) of a SIMT or mma
    config's launch: splits as given, else (SIMT) split_count's for the kernel's resident
    blocks per SM, 1 with an epilogue, capped so that batch x splits fits the grid's z; 1
    where the kernel does not split K (run_config, matmul_plans.config_runner)."""
    max_z = info.max_grid_dims[2]
    params = kernel_params(template, dtype, cfg, vec, epilogue, a_trans)
    if epilogue is not None:
        splits = 1
    esize = dtype.itemsize
    if template == SIMT_TEMPLATE:
        kernel = cached_kernel(m, SIMT_TEMPLATE, dev, params)
        threads = (cfg["bm"] // cfg["tm"]) * (cfg["bn"] // cfg["tn"])
        smem = simt_smem(cfg, esize, epilogue is not None)   # multistage: dynamic
        if splits is None:
            splits = split_count(cfg, p, info.multiprocessor_count, max_z,
                                 blocks_per_sm(cfg, getattr(kernel, "num_regs", 0), info,
                                               esize, getattr(kernel, "static_shared_bytes", 0)))
    else:   # mma.sync: matmul_mma.cu.j2 or (float64) matmul_dmma.cu.j2
        kernel = cached_kernel(m, template, dev, params)
        threads = (cfg["bm"] // cfg["wm"]) * (cfg["bn"] // cfg["wn"]) * 32
        smem = dmma_smem(cfg) if template == DMMA_TEMPLATE else \
            cfg["stages"] * (cfg["bm"] * cfg["bk"] + cfg["bk"] * cfg["bn"]) * esize
    kchunk = takes_k_chunk(template, cfg, epilogue)
    if not kchunk:
        return kernel, threads, smem, False, 1
    # split-K puts batch x splits on the grid's z in one launch
    return kernel, threads, smem, True, max(1, min(splits or 1, max_z // max(1, p.batch)))


def _run_tiled(m: Any, template: str, cfg: Dict[str, Any], a: CudaTensor, b: CudaTensor,
               out: CudaTensor, p: Plan, dtype: CudaDataType, vec: bool, dev: int, info: Any,
               tiles: int, splits: Optional[int], epilogue: Optional[str],
               bias: Optional[CudaTensor], a_trans: bool, grad: Optional[CudaTensor]) -> None:
    """run_config's SIMT and mma launches: split-K (_run_split), else one launch per batch
    chunk of at most the grid's z limit, the epilogue's arguments after the operands."""
    max_z = info.max_grid_dims[2]
    esize = dtype.itemsize
    kernel, threads, smem, kchunk, splits = tiled_kernel(m, template, cfg, p, dtype, vec, dev,
                                                         info, splits, epilogue, a_trans)
    if kchunk and splits > 1:
        _run_split(m, kernel.name, cfg["bk"], tiles, threads, smem, a, b, out, p, dtype, dev,
                   splits)
        return

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
    for b0 in range(0, p.batch, max_z):
        nb = min(max_z, p.batch - b0)
        pa, pb, pc = _offsets(a, b, out, p, b0, esize)
        m.backend.launch_kernel(kernel.name, (tiles, 1, nb), pa, pb, pc, *extra(b0), p.M, p.N,
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
    chunk, splits = split_chunk(p.K, bk, splits)
    work = backend.empty((splits * p.batch * p.M * p.N,), dtype, dev)
    try:
        backend.launch_kernel(kernel_name, (tiles, 1, p.batch * splits), a, b, work,
                              p.M, p.N, p.K, p.stride_a, p.stride_b, p.batch, chunk,
                              block_size=(threads, 1, 1), shared_mem=smem, device_id=dev)
        red = cached_kernel(m, SIMT_TEMPLATE, dev, splitk_reduce_params(dtype))
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
        kernel = cached_kernel(m, WGMMA_TEMPLATE, dev, wgmma_params(cfg))
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


def _run_wgmma16(m: Any, cfg: Dict[str, Any], a: CudaTensor, b: CudaTensor, out: CudaTensor,
                 p: Plan, dtype: CudaDataType, dev: int, max_z: int) -> None:
    """The 16-bit wgmma kernel over every batch chunk: (A, B, C, M, N, K, lda, ldb, stride_a,
    stride_b), A and B each read in place (wgmma16_a_direct, wgmma16_b_direct) or from its
    padded copy in a pool block (matmul_pad), the blocks given back after the launches
    (later work on the stream is ordered after them)."""
    backend = m.backend
    esize = dtype.itemsize
    direct_a, direct_b = wgmma16_a_direct(a.ptr, p), wgmma16_b_direct(b.ptr, p)
    lda, ldb, stride_a, stride_b = operand_layout(p, direct_a, direct_b)
    ap = bp = None
    try:
        src_a, src_b = a, b
        if not direct_a:
            planes = planes_of(p.stride_a, p)
            ap = src_a = backend.empty((planes * p.M * lda,), dtype, dev)
            run_copies(m, dev, pad_a_launches(m, dev, dtype, planes, p, a.ptr, ap.ptr), a, ap)
        if not direct_b:
            planes = planes_of(p.stride_b, p)
            bp = src_b = backend.empty((planes * p.K * ldb,), dtype, dev)
            run_copies(m, dev, pad_b_launches(m, dev, dtype, planes, p, b.ptr, bp.ptr), b, bp)
        kernel = cached_kernel(m, WGMMA16_TEMPLATE, dev, wgmma16_params(dtype, cfg))
        tiles = -(-p.M // cfg["bm"]) * -(-p.N // cfg["bn"])
        for b0 in range(0, p.batch, max_z):
            nb = min(max_z, p.batch - b0)
            pa = src_a if b0 == 0 else src_a.ptr + b0 * stride_a * esize
            pb = src_b if b0 == 0 else src_b.ptr + b0 * stride_b * esize
            pc = out if b0 == 0 else out.ptr + b0 * p.M * p.N * esize
            backend.launch_kernel(kernel.name, (tiles, 1, nb), pa, pb, pc, p.M, p.N, p.K, lda,
                                  ldb, stride_a, stride_b, block_size=(WGMMA16_THREADS, 1, 1),
                                  shared_mem=wgmma_smem(cfg), device_id=dev)
    finally:
        free_all(ap, bp)


def _offsets(a: CudaTensor, b: CudaTensor, out: CudaTensor, p: Plan, b0: int,
             esize: int) -> Tuple[Any, Any, Any]:
    """Operands for batch chunk starting at b0 (the tensors themselves for the first)."""
    if b0 == 0:
        return a, b, out
    return (a.ptr + b0 * p.stride_a * esize, b.ptr + b0 * p.stride_b * esize,
            out.ptr + b0 * p.M * p.N * esize)


def skinny_setup(m: Any, cfg: Dict[str, Any], p: Plan, dtype: CudaDataType, vec: bool,
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
        red = splitk_reduce_params(dtype)
    else:
        red = splitk_epilogue_params(dtype, epilogue)
    kernel = cached_kernel(m, SIMT_TEMPLATE, dev, skinny_params(dtype, cfg, vec, b_trans))
    return {"kernel": kernel,
            "grid": (tiles_m * tiles_n, s, 1), "threads": skinny_threads(cfg),
            "smem": skinny_smem(cfg, b_trans, dtype.itemsize), "chunk": chunk, "splits": s,
            "n": n, "work_elems": s * n, "reduce": cached_kernel(m, SIMT_TEMPLATE, dev, red),
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
    s = skinny_setup(m, cfg, p, dtype, vec, dev, splits, epilogue)
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


def cluster_setup(m: Any, cfg: Dict[str, Any], p: Plan, dtype: CudaDataType, vec: bool,
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
    return {"kernel": cached_kernel(m, SKINNY_TEMPLATE, dev, params),
            "grid": (tiles_m * tiles_n, cfg["splits"], 1), "threads": cluster_threads(cfg),
            "smem": cluster_smem(cfg, b_trans, dtype.itemsize), "chunk": cluster_chunk(cfg, p.K)}


def _run_cluster(m: Any, cfg: Dict[str, Any], a: CudaTensor, b: CudaTensor, out: CudaTensor,
                 p: Plan, dtype: CudaDataType, vec: bool, dev: int, epilogue: Optional[str],
                 bias: Optional[CudaTensor], grad: Optional[CudaTensor] = None) -> None:
    """A cluster config: one launch, (A, B, C, bias or 0, [G,] M, N, K, k_chunk); the
    cluster sums the K slices and applies the epilogue (matrix_multiply: none)."""
    s = cluster_setup(m, cfg, p, dtype, vec, dev, epilogue)
    extra = (grad,) if epilogue == GRAD_EPILOGUE else ()
    m.backend.launch_kernel(s["kernel"].name, s["grid"], a, b, out,
                            0 if bias is None else bias, *extra, p.M, p.N, p.K, s["chunk"],
                            block_size=(s["threads"], 1, 1), shared_mem=s["smem"],
                            device_id=dev)
