"""Matmul per-call plans (ops/common.py remember_plan): the launches `run_config` makes for a
call's memoized config, prepared once (PreparedLaunch) and replayed by later calls of the same
shapes with the operands' pointers; the split-K workspace and the wgmma kernels' B copies come
from the pool per call."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from ..dtypes import CudaDataType
from ..tensor import CudaTensor
from . import common
from .matmul_configs import WGMMA16_STANDIN, tma_standin
from .matmul_kernels import (GRAD_EPILOGUE, MMA_TEMPLATE, REDUCE_BLOCK, SIMT_TEMPLATE,
                             TMA16_TEMPLATE, WGMMA16_LD, WGMMA16_TEMPLATE, WGMMA16_THREADS,
                             WGMMA_TEMPLATE, config_template, has_wgmma, splitk_reduce_params,
                             tma16_params, wgmma16_ld, wgmma16_params, wgmma_params, wgmma_smem)
from .matmul_launch import (cached_kernel, cluster_setup, config_key, memo, skinny_setup,
                            tiled_kernel)
from .matmul_pad import (operand_layout, pad_a_launches, pad_b_launches, planes_of,
                         prepared_copies)
from .matmul_shapes import Plan
from .matmul_splitk import split_chunk
from .matmul_tma16 import tma16_runner, tma16_shape_ok

DT = CudaDataType

# A plan of matmul (key: "matmul", both shapes, dtypes and devices, the precision as given) or
# of fused_linear_gelu (ops/linear.py) allocates the result and runs the launches run_config
# makes for the config `launch` memoized, as PreparedLaunches. That config depends on vec (the
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
        hit = memo(m).get(config_key(p, dtype, prec, dev, vec, epilogue, a_trans))
        if hit is not None:
            runners[vec] = config_runner(m, hit[0], hit[1], p, dtype, vec, dev, epilogue,
                                         a_trans)


def _op_plan(m: Any, p: Plan, dtype: CudaDataType, dev: int, shape: Tuple[int, ...],
             a_trans: bool = False) -> Any:
    """plan(a, b, bias, grad=None, dst=None): the result (of `shape`; from the pool, or
    dst, an out= tensor that fits and overlaps neither operand) and the runner of the call's
    alignment class; None where the general path must run."""
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
             grad: Optional[CudaTensor] = None,
             dst: Optional[CudaTensor] = None) -> Optional[CudaTensor]:
        pa, pb = a._ptr, b._ptr
        if pa is None or pb is None or a.stream is not None or b.stream is not None:
            return None
        pbias = 0 if bias is None else bias._ptr
        pg = 0 if grad is None else grad._ptr
        if pbias is None or pg is None or (bias is not None and bias.stream is not None) \
                or (grad is not None and grad.stream is not None):
            return None
        if dst is None:
            out = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
            pc = out._ptr
        else:   # out=: the general path checks (and raises) for anything but a fit
            pc = dst._ptr
            if pc is None or dst.stream is not None or dst.dtype is not dtype or \
                    dst.device_id != dev or dst.shape != shape or \
                    (pa < pc + nbytes and pc < pa + a.nbytes) or \
                    (pb < pc + nbytes and pc < pb + b.nbytes):
                return None
            out = dst
        run = get(shape_vec and not (pa | pb | pc) & 15)
        if run is None:
            if dst is None:
                out.free()
            return None
        if grad is None:
            run(pa, pb, pc, pbias)
        else:
            run(pa, pb, pc, pbias, pg)
        return out

    plan.runners = runners  # type: ignore[attr-defined]  # (read by the tests: the sub-launches)
    return plan


def config_runner(m: Any, template: str, cfg: Dict[str, Any], p: Plan, dtype: CudaDataType,
                  vec: bool, dev: int, epilogue: Optional[str] = None,
                  a_trans: bool = False) -> Any:
    """run(pa, pb, pc, pbias, pg=0): run_config's launches of one config (pointers as ints;
    pbias 0 for no bias; pg: G of the bias_gelu_grad epilogue), as PreparedLaunches: the
    same kernels, grids and arguments, the split-K workspace and the wgmma B copy taken from
    the pool and given back after the launches."""
    if cfg.get("skinny"):
        return _skinny_runner(m, cfg, p, dtype, vec, dev, epilogue)
    if cfg.get("cluster"):
        return _cluster_runner(m, cfg, p, dtype, vec, dev, epilogue)
    info = m.backend.get_device_info(dev)
    max_z = info.max_grid_dims[2]
    splits = None
    if "split" in cfg:
        cfg = dict(cfg)
        splits = max(1, min(cfg.pop("split"), max_z // max(1, p.batch)))
    template = config_template(cfg, template)
    if template == TMA16_TEMPLATE:
        return _tma16_runner(m, cfg, p, dtype, vec, dev, info, epilogue, a_trans)
    if template == WGMMA16_TEMPLATE:
        return _wgmma16_runner(m, cfg, p, dtype, vec, dev, info, epilogue, a_trans)
    if template == WGMMA_TEMPLATE:
        return _wgmma_runner(m, cfg, p, dev, max_z)
    tiles = -(-p.M // cfg["bm"]) * -(-p.N // cfg["bn"])
    kernel, threads, smem, kchunk, splits = tiled_kernel(m, template, cfg, p, dtype, vec, dev,
                                                         info, splits, epilogue, a_trans)
    if kchunk and splits > 1:
        return _split_runner(m, kernel, tiles, threads, smem, cfg["bk"], p, dtype, dev, info,
                             splits)
    return _chunks_runner(m, kernel, tiles, threads, smem, p, dtype, dev, max_z, kchunk,
                          epilogue)


def _split_runner(m: Any, kernel: Any, tiles: int, threads: int, smem: int, bk: int, p: Plan,
                  dtype: CudaDataType, dev: int, info: Any, splits: int) -> Any:
    """_run_split's launches: the split-K GEMM into a pool block, splitk_reduce into C."""
    backend = m.backend
    prep, get = backend.prepare_launch, backend.get_kernel
    M, N, K, sa, sb, batch = p.M, p.N, p.K, p.stride_a, p.stride_b, p.batch
    chunk, splits = split_chunk(K, bk, splits)
    wbytes = splits * batch * M * N * dtype.itemsize
    gemm = prep(get(kernel.name, dev), (tiles, 1, batch * splits), (threads, 1, 1), smem, dev)
    red = cached_kernel(m, SIMT_TEMPLATE, dev, splitk_reduce_params(dtype))
    n = batch * M * N
    grid = common.grid_1d(n, REDUCE_BLOCK, info.multiprocessor_count, waves=4)
    reduce = prep(get(red.name, dev), (grid, 1, 1), (REDUCE_BLOCK, 1, 1), 0, dev)

    def run_split(pa: int, pb: int, pc: int, pw: int) -> None:
        gemm(pa, pb, pw, M, N, K, sa, sb, batch, chunk)
        reduce(pw, pc, n, splits)
    return _with_workspace(m, dev, wbytes, run_split)


def _with_workspace(m: Any, dev: int, nbytes: int, body: Callable[[int, int, int, int], None]
                    ) -> Callable[..., None]:
    """run(pa, pb, pc, pbias, pg=0): body(pa, pb, pc, pw) with pw a pool block of nbytes,
    given back after the launches body makes (as a workspace's free(): the pool is
    stream-ordered)."""
    pool = m.backend.memory_pools[dev]
    alloc, release = pool.allocate_current, pool.release

    def run(pa: int, pb: int, pc: int, pbias: int, pg: int = 0) -> None:
        block = alloc(nbytes)
        try:
            body(pa, pb, pc, int(block))
        finally:
            release(block)
    return run


def _chunks_runner(m: Any, kernel: Any, tiles: int, threads: int, smem: int, p: Plan,
                   dtype: CudaDataType, dev: int, max_z: int, kchunk: bool,
                   epilogue: Optional[str]) -> Any:
    """_run_tiled's launches without split-K: one per batch chunk of at most max_z matrices
    (a run without the chunk offsets where there is one), the epilogue's arguments after
    the operands."""
    prep = m.backend.prepare_launch
    esize = dtype.itemsize
    M, N, K, sa, sb, batch = p.M, p.N, p.K, p.stride_a, p.stride_b, p.batch
    kernel = m.backend.get_kernel(kernel.name, dev)
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


def _bt_runner(m: Any, p: Plan, dev: int, launch: Callable[..., None]) -> Any:
    """run(pa, pb, pc, pbias, pg=0): B (K, N) transposed and rounded to TF32 into a pool
    block Bt (N, K) (transpose_tf32's launches; its config follows the access width, which
    depends on the pointers: per call), then launch(pa, pbt, pc, 0) (no bias: the GEMM's
    own), the block given back (_with_workspace)."""
    from . import transpose as tr
    backend = m.backend
    prep, get = backend.prepare_launch, backend.get_kernel
    N, K = p.N, p.K
    planes = 1 if p.stride_b == 0 else p.batch
    btbytes = planes * N * K * 4
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

    def run(pa: int, pb: int, pc: int, pbt: int) -> None:
        both = pb | pbt
        vb = 16 if shape16 and not both & 15 else (8 if shape8 and not both & 7 else 4)
        launches = transposes.get(vb) or transpose_launches(vb, pb, pbt)
        for go, off, args in launches:
            go(pb + off, pbt + off, *args)
        launch(pa, pbt, pc, 0)
    return _with_workspace(m, dev, btbytes, run)


def _wgmma_runner(m: Any, cfg: Dict[str, Any], p: Plan, dev: int, max_z: int) -> Any:
    """_run_wgmma's launches: B transposed and rounded into a pool block (_bt_runner), the
    wgmma kernel over the batch chunks."""
    prep, get = m.backend.prepare_launch, m.backend.get_kernel
    M, N, K, sa = p.M, p.N, p.K, p.stride_a
    kernel = get(cached_kernel(m, WGMMA_TEMPLATE, dev, wgmma_params(cfg)).name, dev)
    threads = cfg["bm"] // 64 * 128
    tiles = -(-M // cfg["bm"]) * -(-N // cfg["bn"])
    stride_bt = 0 if p.stride_b == 0 else N * K
    chunks = []
    for b0 in range(0, p.batch, max_z):
        nb = min(max_z, p.batch - b0)
        chunks.append((prep(kernel, (tiles, 1, nb), (threads, 1, 1), wgmma_smem(cfg), dev),
                       b0 * sa * 4, b0 * stride_bt * 4, b0 * M * N * 4, (M, N, K, sa, stride_bt)))

    def launch(pa: int, pbt: int, pc: int, pbias: int) -> None:
        for go, oa, obt, oc, tail in chunks:
            go(pa + oa, pbt + obt, pc + oc, *tail)
    return _bt_runner(m, p, dev, launch)


def _wgmma16_runner(m: Any, cfg: Dict[str, Any], p: Plan, dtype: CudaDataType, vec: bool,
                    dev: int, info: Any, epilogue: Optional[str], a_trans: bool) -> Any:
    """_run_wgmma16's launches: A's and B's padded copies into pool blocks where they cannot
    be read in place (K % 8, N % 8, or per call their pointers: matmul_pad), the kernel over
    the batch chunks, the blocks given back; per call, an output the kernel cannot take (not
    4-byte aligned) runs WGMMA16_STANDIN's runner instead, as run_config does."""
    if epilogue is not None or a_trans or not has_wgmma(info) or dtype.itemsize != 2:
        return config_runner(m, MMA_TEMPLATE, WGMMA16_STANDIN, p, dtype, vec, dev, epilogue,
                             a_trans)
    standin = _wgmma16_standin(m, p, dtype, vec, dev)
    backend = m.backend
    M, N, K, esize = p.M, p.N, p.K, dtype.itemsize
    chunks = _wgmma16_chunks(m, cfg, p, dtype, dev, info)
    # the kernel's launches by (A read in place, B read in place), made on first use
    gemms: Dict[Tuple[bool, bool], list] = {}
    # (a copy runs only where K % 8 (N % 8) or A's (B's) pointer is off: element copies,
    # whose launches do not depend on the addresses)
    copies_a = prepared_copies(m, dev, pad_a_launches(m, dev, dtype, planes_of(p.stride_a, p),
                                                      p, 2, 0))
    copies_b = prepared_copies(m, dev, pad_b_launches(m, dev, dtype, planes_of(p.stride_b, p),
                                                      p, 2, 0))
    abytes = planes_of(p.stride_a, p) * M * wgmma16_ld(K) * esize
    bbytes = planes_of(p.stride_b, p) * K * wgmma16_ld(N) * esize
    k_ok, n_ok = K % WGMMA16_LD == 0, N % WGMMA16_LD == 0
    pool = backend.memory_pools[dev]
    alloc, release = pool.allocate_current, pool.release

    def run(pa: int, pb: int, pc: int, pbias: int, pg: int = 0) -> None:
        if pc & 3:
            standin(pa, pb, pc, pbias, pg)
            return
        direct_a, direct_b = k_ok and not pa & 15, n_ok and not pb & 15
        launches = gemms.get((direct_a, direct_b))
        if launches is None:
            launches = gemms[(direct_a, direct_b)] = chunks(direct_a, direct_b)
        if direct_a and direct_b:
            for go, oa, ob, oc, tail in launches:
                go(pa + oa, pb + ob, pc + oc, *tail)
            return
        block_a = block_b = None
        try:
            if not direct_a:
                block_a = alloc(abytes)
                src, pa = pa, int(block_a)
                for go, so, do, args in copies_a:
                    go(src + so, pa + do, *args)
            if not direct_b:
                block_b = alloc(bbytes)
                src, pb = pb, int(block_b)
                for go, so, do, args in copies_b:
                    go(src + so, pb + do, *args)
            for go, oa, ob, oc, tail in launches:
                go(pa + oa, pb + ob, pc + oc, *tail)
        finally:
            # as the general path's free(): the pool is stream-ordered
            for block in (block_a, block_b):
                if block is not None:
                    release(block)
    return run


def _wgmma16_standin(m: Any, p: Plan, dtype: CudaDataType, vec: bool,
                     dev: int) -> Callable[..., None]:
    """_wgmma16_runner's stand-in for an output the kernel cannot take: WGMMA16_STANDIN's
    runner, made on first use."""
    made: list = []

    def standin(pa: int, pb: int, pc: int, pbias: int, pg: int = 0) -> None:
        if not made:
            made.append(config_runner(m, MMA_TEMPLATE, WGMMA16_STANDIN, p, dtype, vec, dev))
        made[0](pa, pb, pc, pbias, pg)
    return standin


def _wgmma16_chunks(m: Any, cfg: Dict[str, Any], p: Plan, dtype: CudaDataType, dev: int,
                    info: Any) -> Callable[[bool, bool], list]:
    """chunks(direct_a, direct_b) for _wgmma16_runner: the wgmma16 kernel's prepared launches
    over the batch chunks, with their offsets and arguments, for A and B read in place or
    from their padded copies (the kernel compiled now)."""
    backend = m.backend
    prep, get = backend.prepare_launch, backend.get_kernel
    M, N, K, esize = p.M, p.N, p.K, dtype.itemsize
    max_z = info.max_grid_dims[2]
    kernel = get(cached_kernel(m, WGMMA16_TEMPLATE, dev, wgmma16_params(dtype, cfg)).name, dev)
    tiles = -(-M // cfg["bm"]) * -(-N // cfg["bn"])

    def chunks(direct_a: bool, direct_b: bool) -> list:
        lda, ldb, sa, sb = operand_layout(p, direct_a, direct_b)
        return [(prep(kernel, (tiles, 1, nb), (WGMMA16_THREADS, 1, 1), wgmma_smem(cfg), dev),
                 b0 * sa * esize, b0 * sb * esize, b0 * M * N * esize,
                 (M, N, K, lda, ldb, sa, sb))
                for b0, nb in ((b0, min(max_z, p.batch - b0)) for b0 in range(0, p.batch, max_z))]
    return chunks


def _tma16_runner(m: Any, cfg: Dict[str, Any], p: Plan, dtype: CudaDataType, vec: bool,
                  dev: int, info: Any, epilogue: Optional[str], a_trans: bool) -> Any:
    """run_config's TMA launch (matmul_tma16.tma16_runner; TF32: behind B's transpose,
    _bt_runner); a call it cannot take at these shapes runs the standin's runner
    (tma_standin: the 16-bit wgmma one, TF32's mma.sync one), and so do (per call) pointers
    it cannot take."""
    tf32 = dtype is DT.FLOAT32

    def standin() -> Any:
        return config_runner(m, MMA_TEMPLATE if tf32 else WGMMA16_TEMPLATE, tma_standin(dtype),
                             p, dtype, vec, dev, epilogue, a_trans)
    if epilogue is not None or a_trans or not has_wgmma(info) or not tma16_shape_ok(dtype, p):
        return standin()
    params = tma16_params(dtype, cfg)
    kernel = cached_kernel(m, TMA16_TEMPLATE, dev, params)
    run = tma16_runner(m, kernel, params, cfg, p, dtype, dev, memo(m), standin)
    if not tf32:
        return run
    made: list = []
    through_bt = _bt_runner(m, p, dev, run)

    def run_tf32(pa: int, pb: int, pc: int, pbias: int, pg: int = 0) -> None:
        if (pa | pc) & 15:     # (Bt, a pool block, is aligned; A and C must be too)
            if not made:
                made.append(standin())
            made[0](pa, pb, pc, pbias, pg)
            return
        through_bt(pa, pb, pc, pbias)
    return run_tf32


def _skinny_runner(m: Any, cfg: Dict[str, Any], p: Plan, dtype: CudaDataType, vec: bool,
                   dev: int, epilogue: Optional[str]) -> Any:
    """_run_skinny's launches as PreparedLaunches: run(pa, pb, pc, pbias, pg=0)."""
    backend = m.backend
    cfg = dict(cfg)
    s = skinny_setup(m, cfg, p, dtype, vec, dev, cfg.pop("split", None), epilogue)
    gemm = _prepared(m, s, dev)
    reduce = backend.prepare_launch(backend.get_kernel(s["reduce"].name, dev),
                                    (s["reduce_grid"], 1, 1), (REDUCE_BLOCK, 1, 1), 0, dev)
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


def _cluster_runner(m: Any, cfg: Dict[str, Any], p: Plan, dtype: CudaDataType, vec: bool,
                    dev: int, epilogue: Optional[str]) -> Any:
    """_run_cluster's launch as a PreparedLaunch: run(pa, pb, pc, pbias, pg=0)."""
    s = cluster_setup(m, cfg, p, dtype, vec, dev, epilogue)
    go = _prepared(m, s, dev)
    M, N, K, chunk = p.M, p.N, p.K, s["chunk"]
    if epilogue == GRAD_EPILOGUE:
        def run_grad(pa: int, pb: int, pc: int, pbias: int, pg: int = 0) -> None:
            go(pa, pb, pc, pbias, pg, M, N, K, chunk)
        return run_grad

    def run(pa: int, pb: int, pc: int, pbias: int, pg: int = 0) -> None:
        go(pa, pb, pc, pbias, M, N, K, chunk)
    return run


def _prepared(m: Any, s: Dict[str, Any], dev: int) -> Any:
    """The PreparedLaunch of the main kernel of skinny_setup's or cluster_setup's `s`."""
    backend = m.backend
    return backend.prepare_launch(backend.get_kernel(s["kernel"].name, dev), s["grid"],
                                  (s["threads"], 1, 1), s["smem"], dev)
