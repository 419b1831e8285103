"""The operand copies of the 16-bit wgmma kernel (templates/matmul_wgmma16.cu.j2), whose rows
must start on 16-byte boundaries (row strides multiples of WGMMA16_LD elements, pointers
16-byte aligned): A's planes (M, K) are copied into rows of wgmma16_ld(K) elements where
K % 8 != 0 or A is misaligned, B's planes (K, N) into rows of wgmma16_ld(N) where N % 8 != 0
or B is misaligned. The kernel is then given the real K and N with the padded row strides:
its copies into shared memory read only k < K of A's rows and n < N of B's (the 16-byte
chunk that crosses K or N by a short cp.async src-size, the rest zero-filled, rows k >= K of
B zero-filled), so the padding columns are never read and the copies leave them unwritten.

The copies are strided copies (ops/shape_copy.py) of element width: with K (N) not a multiple
of 8, or the source misaligned, plan_copy chooses element items whatever the addresses, so
the per-call plan (matmul_plans) prepares them once with a stand-in address and replays
the general path's (matmul_launch._run_wgmma16) launches exactly.

TF32 with K or N not a multiple of 4 (rows the TMA, wgmma and vector kernels cannot read)
runs as the aligned GEMM of A' (M, Kp) and B' (Kp, Np), zero-filled copies (Kp, Np: K, N
rounded up to 4; the zeros add exact zeros), into C' (M, Np) whose first N columns are
copied out; the copies are element copies made from stand-in addresses too, so the
general path (run_tf32_padded) and the plan (tf32_padded_plan) launch the same ones."""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

from ..dtypes import CudaDataType
from ..tensor import CudaTensor, pool_tensor
from .matmul_kernels import WGMMA16_LD, has_wgmma, wgmma16_ld
from .matmul_shapes import Plan, plan_shapes

F32 = CudaDataType.FLOAT32
F32_STANDIN = 4     # a float32 address off 16 bytes: plan_copy picks element items


def wgmma16_a_direct(pa: int, p: Plan) -> bool:
    """A (M, K) at address pa is read in place by the 16-bit wgmma kernel (K a multiple of 8,
    16-byte aligned); otherwise it is first copied into rows of wgmma16_ld(K)."""
    return p.K % WGMMA16_LD == 0 and pa % 16 == 0


def pad_a_launches(m: Any, dev: int, dtype: CudaDataType, planes: int, p: Plan, src_addr: int,
                   dst_addr: int) -> list:
    """The strided copies (ops/shape_copy.py) of A's planes (M, K) into rows of
    wgmma16_ld(K) elements: (planes x M, K) rows, the padding columns left unwritten."""
    from . import shape_copy
    ld = wgmma16_ld(p.K)
    return shape_copy.plan_copy(m, dev, dtype, (planes, p.M, p.K), (p.M * p.K, p.K, 1),
                                (p.M * ld, ld, 1), src_addr, dst_addr)


def pad_b_launches(m: Any, dev: int, dtype: CudaDataType, planes: int, p: Plan, src_addr: int,
                   dst_addr: int) -> list:
    """The strided copies (ops/shape_copy.py) of B's planes (K, N) into rows of
    wgmma16_ld(N) elements: (planes x K, N) rows, the padding columns left unwritten (the
    kernel reads only N of each row)."""
    from . import shape_copy
    ld = wgmma16_ld(p.N)
    return shape_copy.plan_copy(m, dev, dtype, (planes, p.K, p.N), (p.K * p.N, p.N, 1),
                                (p.K * ld, ld, 1), src_addr, dst_addr)


def operand_layout(p: Plan, direct_a: bool, direct_b: bool) -> Tuple[int, int, int, int]:
    """(lda, ldb, stride_a, stride_b) of the kernel's launch: each operand's own where it is
    read in place, its padded copy's otherwise (one plane where the operand is broadcast)."""
    lda = p.K if direct_a else wgmma16_ld(p.K)
    ldb = p.N if direct_b else wgmma16_ld(p.N)
    stride_a = 0 if p.stride_a == 0 else p.M * lda
    stride_b = 0 if p.stride_b == 0 else p.K * ldb
    return lda, ldb, stride_a, stride_b


def planes_of(stride: int, p: Plan) -> int:
    """The planes an operand's copy holds: one where it is broadcast (batch stride 0)."""
    return 1 if stride == 0 else p.batch


def run_copies(m: Any, dev: int, launches: list, src: Any, dst: Any) -> None:
    """The general path's launches of a padded copy from src to dst (tensors; their pointers
    plus the offsets of a launch past the first), kernels from matmul_launch's memo."""
    from .matmul_launch import cached_kernel
    for c in launches:
        kname = cached_kernel(m, c.template, dev, c.params).name
        m.backend.launch_kernel(kname, c.grid, src if c.src_off == 0 else src.ptr + c.src_off,
                                dst if c.dst_off == 0 else dst.ptr + c.dst_off, *c.args,
                                block_size=c.block, device_id=dev)


def prepared_copies(m: Any, dev: int, launches: list) -> List[Tuple[Any, int, int, tuple]]:
    """[(PreparedLaunch, src offset, dst offset, args)] of a padded copy's launches, for a
    per-call plan: go(src + so, dst + do, *args)."""
    from .matmul_launch import cached_kernel
    backend = m.backend
    out = []
    for c in launches:
        kernel = backend.get_kernel(cached_kernel(m, c.template, dev, c.params).name, dev)
        out.append((backend.prepare_launch(kernel, c.grid, c.block, 0, dev), c.src_off,
                    c.dst_off, c.args))
    return out


def free_all(*blocks: Optional[Any]) -> None:
    """Give the copies' pool blocks back (stream-ordered: later work waits for the launches)."""
    for block in blocks:
        if block is not None:
            block.free()


def tf32_pad_shape(m: Any, a: CudaTensor, b: CudaTensor, p: Plan, dtype: CudaDataType,
                   prec: Optional[str], dev: int) -> Optional[Tuple[int, int]]:
    """(Kp, Np) for a TF32 product of 2-d operands past the small class (M N K > 256³) with
    K or N not a multiple of 4 on a wgmma device; None for any other call."""
    if dtype is not F32 or prec != "tf32" or a.ndim != 2 or b.ndim != 2 or \
            (p.K % 4 == 0 and p.N % 4 == 0) or p.M * p.N * p.K <= 256 ** 3 or \
            not has_wgmma(m.backend.get_device_info(dev)):
        return None
    return -(-p.K // 4) * 4, -(-p.N // 4) * 4


def _tf32_copies(m: Any, dev: int, p: Plan, kp: int, np_: int) -> Tuple[list, list, list]:
    """The element copies of A into (M, Kp) rows (none where Kp == K), of B into (Kp, Np)
    rows, and of C' (M, Np) into C (none where Np == N)."""
    from . import shape_copy

    def copy(rows: int, cols: int, ld_in: int, ld_out: int) -> list:
        return shape_copy.plan_copy(m, dev, F32, (1, rows, cols), (rows * ld_in, ld_in, 1),
                                    (rows * ld_out, ld_out, 1), F32_STANDIN, 0)
    M, N, K = p.M, p.N, p.K
    return (copy(M, K, K, kp) if kp != K else [], copy(K, N, N, np_),
            copy(M, N, np_, N) if np_ != N else [])


def run_tf32_padded(m: Any, a: CudaTensor, b: CudaTensor, out: CudaTensor, p: Plan, kp: int,
                    np_: int, prec: Optional[str], dev: int) -> None:
    """The general path of a tf32_pad_shape call: A' (where Kp != K), B' and C' (where
    Np != N) as zero-filled pool blocks, the aligned GEMM launched (autotuned as that
    shape), C' copied into out; the blocks given back (stream-ordered)."""
    from .matmul_launch import launch
    backend = m.backend
    ca, cb, cc = _tf32_copies(m, dev, p, kp, np_)
    ap = backend.empty((p.M, kp), F32, dev) if ca else a
    bp = backend.empty((kp, np_), F32, dev)
    op = backend.empty((p.M, np_), F32, dev) if cc else out
    try:
        for src, dst, copies in ((a, ap, ca), (b, bp, cb)):
            if copies:
                backend.memset_async(dst, 0)
                run_copies(m, dev, copies, src, dst)
        launch(m, ap, bp, op, plan_shapes(ap.shape, bp.shape), F32, prec, dev)
        if cc:
            run_copies(m, dev, cc, op, out)
    finally:
        for t in (ap, bp, op):
            if t is not a and t is not out:
                t.free()


def tf32_padded_plan(m: Any, p: Plan, kp: int, np_: int, prec: Optional[str],
                     dev: int) -> Optional[Any]:
    """plan(a, b, bias, dst=None) of a tf32_pad_shape call, after its general path:
    run_tf32_padded's blocks from the pool, memsets and copies, and the runner of the aligned
    GEMM's memoized config (vector class: the blocks are aligned); None where none is
    memoized. The plan declines (None: general path) operands on a stream, a bias, an out=
    tensor (dst), or an A read in place (Kp == K) off 16 bytes."""
    from .matmul_launch import config_key, memo
    from .matmul_plans import config_runner
    pp = plan_shapes((p.M, kp), (kp, np_))
    hit = memo(m).get(config_key(pp, F32, prec, dev, True))
    if hit is None:
        return None
    gemm = config_runner(m, hit[0], hit[1], pp, F32, True, dev)
    ca, cb, cc = (prepared_copies(m, dev, c) for c in _tf32_copies(m, dev, p, kp, np_))
    backend = m.backend
    pool = backend.memory_pools[dev]
    alloc, memset = pool.allocate_current, backend.memset_async
    M, N = p.M, p.N
    shapes = ((M, kp), (kp, np_), (M, np_), (M, N))
    sizes = [r * c for r, c in shapes]

    def block(i: int) -> CudaTensor:
        return pool_tensor(shapes[i], F32, dev, alloc(sizes[i] * 4), pool, sizes[i],
                           sizes[i] * 4)

    def plan(a: CudaTensor, b: CudaTensor, bias: Optional[CudaTensor],
             dst: Optional[CudaTensor] = None) -> Optional[CudaTensor]:
        pa, pb = a._ptr, b._ptr
        if pa is None or pb is None or a.stream is not None or b.stream is not None or \
                bias is not None or dst is not None or (not ca and pa & 15):
            return None
        out = block(3)
        made = []
        try:
            for src, i, copies in ((pa, 0, ca), (pb, 1, cb)):
                if copies:
                    t = block(i)
                    made.append(t)
                    memset(t, 0)
                    for go, so, do, args in copies:
                        go(src + so, t._ptr + do, *args)
            pc = out._ptr
            if cc:
                made.append(block(2))
                pc = made[-1]._ptr
            gemm(made[0]._ptr if ca else pa, made[1 if ca else 0]._ptr, pc, 0)
            for go, so, do, args in cc:
                go(pc + so, out._ptr + do, *args)
        except BaseException:
            out.free()
            raise
        finally:
            for t in made:
                t.free()
        return out
    return plan
