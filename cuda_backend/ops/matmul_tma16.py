"""Matmul launches of the TMA kernel (templates/matmul_tma16.cu.j2, float16 / bfloat16, and TF32
for float32 with precision="tf32", B then transposed into Bt first): which calls it takes
(`tma16_usable`), its parameter layout (read once per compiled kernel), its tensor maps
(encoded per call, the last few kept per launch site) and its launches: the general path's
(`run_tma16`, from matmul_launch.run_config) and the per-call plan's (`tma16_runner`, from
matmul_plans.config_runner). The kernel takes two CUtensorMaps by value, so its argument
buffer is packed at the offsets cuFuncGetParamInfo gives (tensor_maps.pack_params) and sent
with PreparedLaunch.launch_packed."""
from __future__ import annotations

import struct
from typing import Any, Callable, Dict, Optional, Tuple

from .. import streams, tensor_maps
from ..dtypes import CudaDataType
from ..memory_streams import record_stream
from ..tensor import CudaTensor
from .matmul_kernels import TMA16_THREADS, has_wgmma, wgmma_smem
from .matmul_shapes import Plan

DT = CudaDataType
TMA16_LD = 8        # 16-bit: K and N multiples of 8 elements (16-byte row strides for TMA)
MAPS_KEPT = 8       # tensor maps kept per launch site (MapCache)


def k_tile(dtype: CudaDataType) -> int:
    """The kernel's k-tile: one 128-byte swizzle row (64 16-bit elements, 32 float32)."""
    return 128 // dtype.itemsize


def tma16_shape_ok(dtype: CudaDataType, p: Plan) -> bool:
    """The shapes the TMA kernel takes: one matrix (no batch), M, N, K >= 1; float16 /
    bfloat16 with K and N multiples of 8 (A's and B's row strides multiples of 16 bytes),
    float32 (TF32) with K a multiple of 4 (A's and Bt's)."""
    if p.batch != 1 or min(p.M, p.N, p.K) < 1:
        return False
    if dtype is DT.FLOAT32:
        return p.K % 4 == 0
    return dtype in (DT.FLOAT16, DT.BFLOAT16) and p.K % TMA16_LD == 0 and \
        p.N % TMA16_LD == 0


def tma16_usable(info: Any, dtype: CudaDataType, a: Any, b: Any, out: Any, p: Plan,
                 epilogue: Optional[str] = None, a_trans: bool = False) -> bool:
    """A call the TMA kernel takes: an sm_90a device, the plain GEMM (no epilogue, A as
    (M, K), B as (K, N)), tma16_shape_ok, A, B and C 16-byte aligned (TMA's global
    addresses; C's paired stores), C in the input dtype or float32. (A float32 call is a
    TF32 one: the TMA configs are in the TF32 tables only.)"""
    return epilogue is None and not a_trans and has_wgmma(info) and \
        tma16_shape_ok(dtype, p) and not (a.ptr | b.ptr | out.ptr) & 15 and \
        out.dtype in (dtype, DT.FLOAT32)


class MapCache:
    """The tensor maps of the last MAPS_KEPT (pointer, dtype, shape, box) seen by one launch
    site: repeated calls on the same buffers skip the encode."""

    __slots__ = ("maps",)

    def __init__(self) -> None:
        self.maps: Dict[tuple, bytes] = {}

    def get(self, ptr: int, dtype: CudaDataType, rows: int, cols: int, box_rows: int,
            box_cols: int) -> bytes:
        """The map of a row-major (rows, cols) matrix at ptr (dense rows), boxes of
        box_rows x box_cols, 128-byte swizzle (tensor_maps.encode_2d); float32 (the TF32
        kernel's) rounded to TF32 as it is copied."""
        key = (ptr, dtype, rows, cols, box_rows, box_cols)
        tmap = self.maps.get(key)
        if tmap is None:
            tmap = tensor_maps.encode_2d(ptr, dtype, rows, cols, cols * dtype.itemsize,
                                         box_rows, box_cols, round_tf32=dtype is DT.FLOAT32)
            if len(self.maps) >= MAPS_KEPT:
                del self.maps[next(iter(self.maps))]   # the oldest
            self.maps[key] = tmap
        return tmap


def probe_cubin(m: Any, kernel_name: str, params: Dict[str, Any],
                template: str = "matmul_tma16.cu.j2") -> bytes:
    """A cubin of the template's probe (the kernel's parameter list, an empty body) under
    the kernel's name: what tensor_maps.param_layout loads a second time where PyCUDA's
    Function has no handle."""
    import pycuda.compiler
    source = m.generator.render(template, kernel_name=kernel_name, **dict(params, probe=1))
    cubin: bytes = pycuda.compiler.compile(source, arch="compute_90a", code="sm_90a",
                                           no_extern_c=True, cache_dir=False)
    return cubin


def kernel_layout(m: Any, kernel: Any, params: Dict[str, Any], dev: int,
                  cache: Dict[Any, Any],
                  template: str = "matmul_tma16.cu.j2") -> tensor_maps.ParamLayout:
    """The compiled kernel's parameter layout, read once (cached in `cache` by its name and
    device) in the device's context (template: the one it was rendered from, for the
    probe)."""
    key = ("tma16_layout", kernel.name, dev)
    layout = cache.get(key)
    if layout is None:
        with m.backend.activate(dev):
            if getattr(kernel.function, "handle", None):
                layout = tensor_maps.param_layout(kernel)
            else:
                layout = tensor_maps.param_layout(kernel, probe_cubin(m, kernel.name, params,
                                                                      template))
        cache[key] = layout
    return layout


def grid_size(m: Any, cfg: Dict[str, Any], p: Plan, dev: int) -> int:
    """The persistent grid: min(tiles, SMs) blocks."""
    tiles = -(-p.M // cfg["bm"]) * -(-p.N // cfg["bn"])
    return max(1, min(tiles, m.backend.get_device_info(dev).multiprocessor_count))


def packer(layout: tensor_maps.ParamLayout, p: Plan) -> Callable[[bytes, bytes, int], bytes]:
    """pack(tm_a, tm_b, pc) -> the kernel's argument buffer (tm_a, tm_b, C, M, N, K at the
    layout's offsets); M, N, K packed once."""
    base = tensor_maps.pack_params(
        [("128s", bytes(128)), ("128s", bytes(128)), ("Q", 0), ("i", p.M), ("i", p.N),
         ("i", p.K)], layout)
    (oa, _), (ob, _), (oc, _) = layout[0][:3]
    c_at = struct.Struct("<Q").pack_into

    def pack(tm_a: bytes, tm_b: bytes, pc: int) -> bytes:
        buf = bytearray(base)
        buf[oa:oa + 128] = tm_a
        buf[ob:ob + 128] = tm_b
        c_at(buf, oc, pc)
        return bytes(buf)
    return pack


def launch_site(m: Any, kernel: Any, params: Dict[str, Any], cfg: Dict[str, Any], p: Plan,
                dev: int, cache: Dict[Any, Any]) -> Tuple[Any, Callable, MapCache]:
    """(PreparedLaunch, pack, MapCache) of the kernel for this shape, made once per
    (kernel, shape, device) in `cache`: grid_size blocks of 384 threads, wgmma_smem bytes of
    dynamic shared memory (the opt-in attribute set where over 48 KiB)."""
    key = ("tma16_site", kernel.name, dev, p.M, p.N, p.K)
    site = cache.get(key)
    if site is None:
        layout = kernel_layout(m, kernel, params, dev, cache)
        prepared = m.backend.prepare_launch(kernel, (grid_size(m, cfg, p, dev), 1, 1),
                                            (TMA16_THREADS, 1, 1), wgmma_smem(cfg), dev)
        site = cache[key] = (prepared, packer(layout, p), MapCache())
    return site


def b_map(maps: MapCache, pb: int, dtype: CudaDataType, p: Plan, bn: int) -> bytes:
    """B's tensor map: 16-bit B (K, N) in boxes of 64 x 64 (k, n); TF32's Bt (N, K) at pb in
    boxes of bn x 32 (n, k)."""
    bk = k_tile(dtype)
    if dtype is DT.FLOAT32:
        return maps.get(pb, dtype, p.N, p.K, bn, bk)
    return maps.get(pb, dtype, p.K, p.N, bk, bk)


def run_tma16(m: Any, kernel: Any, params: Dict[str, Any], cfg: Dict[str, Any],
              a: CudaTensor, b: CudaTensor, out: CudaTensor, p: Plan, dtype: CudaDataType,
              dev: int, cache: Dict[Any, Any]) -> None:
    """The general path's launch (a call tma16_usable takes): tensor maps of A (box bm x the
    k-tile) and of B (b_map; TF32: Bt = B transposed and rounded to TF32 into a pool block
    first, given back after the launch), the buffer packed at the kernel's offsets, launched
    in the device's context on the current stream (a `with stream:` block's, else the legacy
    default), the operands' use recorded on it as Launcher.launch records it."""
    prepared, pack, maps = launch_site(m, kernel, params, cfg, p, dev, cache)
    bt = None
    if dtype is DT.FLOAT32:
        from . import transpose
        bt = m.backend.empty((p.N * p.K,), dtype, dev)
    try:
        if bt is not None:
            transpose.transpose_tf32(m, b, bt, 1, p.K, p.N, dev)
        buf = pack(maps.get(a.ptr, dtype, p.M, p.K, cfg["bm"], k_tile(dtype)),
                   b_map(maps, (b if bt is None else bt).ptr, dtype, p, cfg["bn"]), out.ptr)
        with m.backend.activate(dev):
            stream = streams.current_pycuda_stream(dev)
            for t in (a, b, out):
                if type(t) is CudaTensor and t.stream is not stream:
                    record_stream(t, stream)
            prepared.launch_packed(buf, stream)
    finally:
        if bt is not None:
            bt.free()   # back to the pool: later work on the stream is ordered after


def tma16_runner(m: Any, kernel: Any, params: Dict[str, Any], cfg: Dict[str, Any], p: Plan,
                 dtype: CudaDataType, dev: int, cache: Dict[Any, Any],
                 standin: Callable[[], Any]) -> Any:
    """run(pa, pb, pc, pbias, pg=0): the per-call plan's launch (the device's context
    current, the legacy default stream: plans run only then); pointers the kernel cannot
    take (not 16-byte aligned) run standin()'s runner, made on first use. TF32: pb is Bt's
    (the caller transposes B)."""
    prepared, pack, maps = launch_site(m, kernel, params, cfg, p, dev, cache)
    go = prepared.launch_packed
    get = maps.get
    M, K, bm, bn, bk = p.M, p.K, cfg["bm"], cfg["bn"], k_tile(dtype)
    made: list = []

    def run(pa: int, pb: int, pc: int, pbias: int, pg: int = 0) -> None:
        if (pa | pb | pc) & 15:
            if not made:
                made.append(standin())
            made[0](pa, pb, pc, pbias, pg)
            return
        go(pack(get(pa, dtype, M, K, bm, bk), b_map(maps, pb, dtype, p, bn), pc))
    return run
