"""Two small GEMMs and a column sum in one launch (templates/matmul_grouped.cu.j2): the
gradients of matrix_multiply (grad_a = G bᵀ, grad_b = aᵀ G) and of a linear layer (grad_x =
G W, grad_W = Gᵀ x, grad_b = the column sums of G) on small inputs. There each launch's host
cost (the driver's ~4.5-5 µs on the H200 hosts, perf/NOTES.md "Per-call host cost") is most
of a product's time, so one launch in place of two or three is most of the call's cost.

`choose` says when (every product small: few k tiles per split, a bounded total of
multiply-adds) and how (the block tile, each product's K splits); `Grouped` runs one
choice, through the general launcher (any stream: the ops' general paths) or a bound
PreparedLaunch (the per-call plans). The kernel reads both operands through strides, so
the transposed operands of a gradient are read in place.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..dtypes import CudaDataType
from ..kernels import dtype_params
from ..streams import current_pycuda_stream
from ..tensor import CudaTensor, pool_tensor
from . import common
from .matmul_launch import compile_kernel

TEMPLATE = "matmul_grouped.cu.j2"
TEMPLATES = (TEMPLATE,)
BK = 32                  # the template's tile depth
BLOCK = 256              # threads per block (the template's NT)
# square block tiles, largest first (64 renders too, but a long-K product over few rows,
# e.g. grad_x of 32 x 1024 -> 1024, runs half-empty 64-row tiles through all its splits:
# 31.8 µs against 19.6 with 32, perf/NOTES.md "Per-call host cost", S21)
TILES = (32, 16)
MAX_ITERS = 4            # k tiles per split
MAX_SPLITS = 16
# multiply-adds of all products together: beyond these, the separate launches' tensor-core
# kernels (16-bit; float32's 3xTF32) gain more GPU time than one launch saves of host time
# (perf/NOTES.md "Per-call host cost", S21)
MAX_MACS = 1 << 27
MAX_MACS_16 = 1 << 23
MAX_SUM_ROWS = MAX_ITERS * MAX_SPLITS * BK   # the column sums' rows (as a K: 2,048)
COUNTERS = common.TicketCounters(256)


def template_variants() -> List[Dict[str, Any]]:
    """Every grouped kernel a call may launch: each float dtype, tile, with and without the
    column sums."""
    return [{**dtype_params(dt), "bm": bm, "bk": BK, "colsum": colsum}
            for dt in common.FLOATS for bm in TILES for colsum in (False, True)]


class Product(NamedTuple):
    """C (M x N, row-major) = A B, A's element (m, k) at a[m * sam + k * sak], B's (k, n) at
    b[k * sbk + n * sbn]."""
    M: int
    N: int
    K: int
    sam: int
    sak: int
    sbk: int
    sbn: int


def matmul_products(M: int, N: int, K: int) -> Tuple[Product, Product]:
    """matmul_backward's products for a (M, K) @ b (K, N), G (M, N): grad_a = G bᵀ (M x K
    over N), grad_b = aᵀ G (K x N over M)."""
    return (Product(M, K, N, N, 1, 1, N), Product(K, N, M, 1, K, N, 1))


def linear_products(rows: int, in_f: int, out_f: int) -> Tuple[Product, Product]:
    """A linear layer's products for x (rows, in), W (out, in), G (rows, out): grad_x = G W
    (rows x in over out), grad_W = Gᵀ x (out x in over rows)."""
    return (Product(rows, in_f, out_f, out_f, 1, in_f, 1),
            Product(out_f, in_f, rows, 1, out_f, in_f, 1))


class Config(NamedTuple):
    """A launch: block tile bm, per product (splits, kchunk, tiles_n, first block, ws
    offset, counter offset), the column sums' first block, the grid, the workspace's acc_t
    elements and the ticket counters it needs."""
    bm: int
    jobs: Tuple[Tuple[int, int, int, int, int, int], ...]
    sum_first: int
    blocks: int
    ws_elems: int
    counters: int


def _splits(K: int) -> Tuple[int, int]:
    """(splits, kchunk) of a product's K: at most MAX_ITERS k tiles per split."""
    iters = -(-K // BK)
    splits = min(MAX_SPLITS, -(-iters // MAX_ITERS))
    return splits, -(-iters // splits) * BK


def _layout(products: Sequence[Product], bm: int, sum_cols: int) -> Config:
    jobs: List[Tuple[int, int, int, int, int, int]] = []
    first = ws = cnt = 0
    for p in products:
        splits, kchunk = _splits(p.K)
        tiles_n = -(-p.N // bm)
        tiles = -(-p.M // bm) * tiles_n
        jobs.append((splits, kchunk, tiles_n, first, ws, cnt))
        first += tiles * splits
        if splits > 1:
            ws += tiles * splits * bm * bm
            cnt += tiles
    return Config(bm, tuple(jobs), first, first + -(-sum_cols // 32), ws, cnt)


def choose(products: Sequence[Product], sum_rows: int, sum_cols: int,
           sm_count: int, max_macs: int = MAX_MACS) -> Optional[Config]:
    """The launch of these products (and sum_cols column sums over sum_rows rows, 0: none),
    or None where one launch does not pay: an empty or large product (over MAX_ITERS *
    MAX_SPLITS k tiles, or more than max_macs multiply-adds in all), or over MAX_SUM_ROWS
    rows to sum. The tile is the largest whose grid still fills the SMs (else the smallest)."""
    if any(min(p.M, p.N, p.K) < 1 for p in products) or sum_rows > MAX_SUM_ROWS:
        return None
    if sum(p.M * p.N * p.K for p in products) > max_macs:
        return None
    if any(-(-p.K // BK) > MAX_ITERS * MAX_SPLITS for p in products):
        return None
    cfg = None
    for bm in TILES:
        cfg = _layout(products, bm, sum_cols)
        if cfg.sum_first >= sm_count:
            break
    assert cfg is not None
    if cfg.ws_elems >= 2 ** 31 or cfg.blocks >= 2 ** 31:
        return None
    return cfg


def use_for(m: Any, dtype: CudaDataType, precision: Optional[str]) -> bool:
    """Whether grouped launches may serve a call: on a GPU, any float dtype, every
    precision but TF32 (which asks for the tensor cores; the kernel's FP32 / FP64 FMA is
    as accurate as the other precisions ask)."""
    return bool(m.gpu) and common.normalize_precision(precision, dtype) != "tf32"


class Grouped:
    """One choice compiled and its integer arguments packed: `launch` (the general path, on
    the current stream) and `prepared` (a per-call plan's launch, pointers only)."""

    def __init__(self, m: Any, dtype: CudaDataType, dev: int, cfg: Config,
                 products: Sequence[Product], sums: Tuple[int, int]) -> None:
        params = {**dtype_params(dtype), "bm": cfg.bm, "bk": BK, "colsum": sums[1] > 0}
        # (the parameter sets of template_variants: warm_up compiles these)
        self.kernel = compile_kernel(m, TEMPLATE, dev, params)
        self.cfg, self.dtype, self.dev = cfg, dtype, dev
        ints: List[int] = []
        for i, (p, job) in enumerate(zip(products, cfg.jobs)):
            splits, kchunk, tiles_n, first, ws_off, cnt_off = job
            ints += [p.M, p.N, p.K, p.sam, p.sak, p.sbk, p.sbn, tiles_n, splits, kchunk]
            ints += ([first] if i else []) + [ws_off, cnt_off]   # (product 0 starts at 0)
        self.ints = tuple(ints) + (sums[0], sums[1], cfg.sum_first)
        acc = common.acc_dtype(dtype)
        self.acc, self.ws_bytes = acc, cfg.ws_elems * acc.itemsize

    def launch(self, m: Any, ptrs: Sequence[Any]) -> None:
        """The launch on the current stream: ptrs (a0, b0, c0, a1, b1, c1, g, sums; tensors or
        0), with a workspace from the pool (freed after it, stream-ordered) and this
        stream's ticket counters."""
        backend, dev = m.backend, self.dev
        ws = backend.empty((max(1, self.cfg.ws_elems),), self.acc, dev) if self.ws_bytes \
            else None
        try:
            counters = COUNTERS.get(m, dev, current_pycuda_stream(dev), self.cfg.counters) \
                if self.cfg.counters else 0
            backend.launch_kernel(self.kernel.name, (self.cfg.blocks, 1, 1), *ptrs,
                                  ws if ws is not None else 0, counters, *self.ints,
                                  block_size=(BLOCK, 1, 1), device_id=dev)
        finally:
            if ws is not None:
                ws.free()

    def prepared(self, m: Any) -> Callable[..., None]:
        """run(a0, b0, c0, a1, b1, c1, g, sums) as ints, on the legacy default stream (a
        per-call plan checks `direct_launch` first), the workspace from the pool."""
        dev = self.dev
        bound = m.backend.prepare_launch(self.kernel, (self.cfg.blocks, 1, 1), (BLOCK, 1, 1), 0,
                                         dev).bind(10, *self.ints)
        counters = COUNTERS.source(m, dev, self.cfg.counters) if self.cfg.counters \
            else (lambda: 0)
        ws_bytes = self.ws_bytes
        if not ws_bytes:
            def run(*ptrs: int) -> None:
                bound(*ptrs, 0, counters())
            return run
        pool = m.backend.memory_pools[dev]
        alloc, release = pool.allocate_current, pool.release

        def run_ws(*ptrs: int) -> None:
            ws = alloc(ws_bytes)
            try:
                bound(*ptrs, int(ws), counters())
            finally:
                release(ws)   # stream-ordered, as ws.free() in `launch`
        return run_ws


def outputs_maker(m: Any, dev: int, dtype: CudaDataType,
                  shapes: Sequence[Tuple[int, ...]]) -> Callable[[], List[CudaTensor]]:
    """new() -> fresh pool tensors of these shapes (a per-call plan's results)."""
    pool = m.backend.memory_pools[dev]
    alloc = pool.allocate_current
    sizes = [(s, math.prod(s), math.prod(s) * dtype.itemsize) for s in shapes]

    def new() -> List[CudaTensor]:
        out: List[CudaTensor] = []
        try:
            for shape, size, nbytes in sizes:
                out.append(pool_tensor(shape, dtype, dev, alloc(nbytes), pool, size, nbytes))
        except BaseException:
            for t in out:
                t.free()
            raise
        return out
    return new


def for_products(m: Any, dtype: CudaDataType, dev: int, precision: Optional[str],
                 products: Sequence[Product], sums: Tuple[int, int] = (0, 0)
                 ) -> Optional[Grouped]:
    """The grouped launch of these products (and column sums (rows, cols)) where one serves
    the call (use_for, choose), else None: the op's separate launches run."""
    if not use_for(m, dtype, precision):
        return None
    cfg = choose(products, sums[0], sums[1],
                 m.backend.get_device_info(dev).multiprocessor_count,
                 MAX_MACS_16 if dtype.itemsize == 2 else MAX_MACS)
    return None if cfg is None else Grouped(m, dtype, dev, cfg, products, sums)
