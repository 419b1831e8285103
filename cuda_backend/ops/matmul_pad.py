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
the general path's (matmul_launch._run_wgmma16) launches exactly."""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

from ..dtypes import CudaDataType
from .matmul_kernels import WGMMA16_LD, wgmma16_ld
from .matmul_shapes import Plan


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
