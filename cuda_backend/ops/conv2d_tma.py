"""conv2d on the TMA + wgmma kernel (templates/matmul_tma16.cu.j2 rendered with conv=1), float32
with precision="tf32", float16 and bfloat16: an implicit GEMM whose A tile (BM output columns
of one output row, one 128-byte row of input channels of one filter tap (r, s)) is one 4-d
box of the NHWC input (prepare_input_mma's layout: channels padded to Cgp), the padding read
as zeros by the tensor map (negative and past-the-end coordinates), and whose B tile is a
3-d box of the KRSC filter (prepare_weight_mma's); float32's maps of type TFLOAT32 (the copy
rounds to TF32). Taken where `usable` says (Hopper, one group, column stride 1, output rows
of 64 columns or more); the kernel writes NCHW with the bias. The argument buffer is packed at the offsets
cuFuncGetParamInfo gives (ops/matmul_tma16.py kernel_layout) and sent with
PreparedLaunch.launch_packed."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from .. import streams, tensor_maps
from ..dtypes import CudaDataType
from ..memory_streams import record_stream
from ..tensor import CudaTensor
from .conv2d_configs import padded_channels
from .conv2d_geometry import Geometry
from .matmul_kernels import TMA16_THREADS, compile_tma16, has_wgmma, tma16_params, wgmma_smem
from .matmul_tma16 import kernel_layout

DT = CudaDataType
MIN_Q = 64          # with a row stride: output rows narrower waste most of a tile
MAPS_KEPT = 8


def usable(g: Geometry, dtype: CudaDataType, prec: Optional[str], info: Any) -> bool:
    """The convolutions the TMA kernel takes: an sm_90a device, float32 with precision
    "tf32", float16 or bfloat16, one group, column stride 1 (a box's columns are consecutive
    input columns), and Q >= MIN_Q or row stride 1 (then a tile takes whole output rows:
    tile_rows)."""
    return has_wgmma(info) and ((dtype is DT.FLOAT32 and prec == "tf32") or
                                dtype in (DT.FLOAT16, DT.BFLOAT16)) and \
        g.groups == 1 and g.sw == 1 and (g.Q >= MIN_Q or g.sh == 1)


def tile_rows(g: Geometry, bm: int) -> int:
    """Output rows per tile: as many whole rows as bm holds where at least two fit and the
    row stride is 1 (consecutive input rows: one box), else 1 (bm columns of one row)."""
    return bm // g.Q if g.sh == 1 and 2 * g.Q <= bm else 1


def k_tile(dtype: CudaDataType) -> int:
    """Input channels per k-tile: one 128-byte row (32 float32, 64 16-bit)."""
    return 128 // dtype.itemsize


def params(cfg: Dict[str, Any], dtype: CudaDataType) -> Dict[str, Any]:
    """Template parameters of a TMA conv config for dtype (output in dtype)."""
    return {**tma16_params(dtype, cfg, dtype), "epilogue": "bias", "conv": 1}


def kernel(m: Any, cfg: Dict[str, Any], dtype: CudaDataType, dev: int,
           cache: Dict[Any, Any]) -> Any:
    """The compiled kernel of a config, memoized in cache."""
    key = ("conv_tma_kernel", cfg["bm"], cfg["bn"], cfg["stages"], dtype, dev)
    k = cache.get(key)
    if k is None:
        k = cache[key] = compile_tma16(m, dev, params(cfg, dtype))
    return k


def _maps(g: Geometry, cfg: Dict[str, Any], dtype: CudaDataType, pxt: int,
          pwt: int) -> Tuple[bytes, bytes]:
    """(A's map over the NHWC input at pxt, B's over the KRSC filter at pwt)."""
    cgp, es, bk = padded_channels(g, dtype), dtype.itemsize, k_tile(dtype)
    row = g.W * cgp * es
    rows = tile_rows(g, cfg["bm"])
    box = (bk, g.Q, rows, 1) if rows > 1 else (bk, cfg["bm"], 1, 1)
    tm_a = tensor_maps.encode_tiled(pxt, dtype, (cgp, g.W, g.H, g.N),
                                    (cgp * es, row, row * g.H), box, round_tf32=True)
    rs = g.R * g.S
    tm_b = tensor_maps.encode_tiled(pwt, dtype, (cgp, rs, g.K), (cgp * es, rs * cgp * es),
                                    (bk, 1, cfg["bn"]), round_tf32=True)
    return tm_a, tm_b


def runner(m: Any, cfg: Dict[str, Any], g: Geometry, dtype: CudaDataType, dev: int,
           cache: Dict[Any, Any]) -> Callable[..., None]:
    """launch(pxt, pwt, pbias, pout, stream=None): the kernel over the whole output, from
    device pointers (pbias 0: no bias); the tensor maps of the last MAPS_KEPT (pxt, pwt)
    pairs kept. Made once per (config, geometry, device) in cache."""
    key = ("conv_tma_site", cfg["bm"], cfg["bn"], cfg["stages"], g, dtype, dev)
    site = cache.get(key)
    if site is not None:
        return site
    k = kernel(m, cfg, dtype, dev, cache)
    layout = kernel_layout(m, k, params(cfg, dtype), dev, cache)
    rows = tile_rows(g, cfg["bm"])
    per_image = -(-g.P // rows) * (1 if rows > 1 else -(-g.Q // cfg["bm"]))
    tiles = g.N * per_image * -(-g.K // cfg["bn"])
    sms = m.backend.get_device_info(dev).multiprocessor_count
    prepared = m.backend.prepare_launch(k, (max(1, min(tiles, sms)), 1, 1),
                                        (TMA16_THREADS, 1, 1), wgmma_smem(cfg), dev)
    cchunks = -(-padded_channels(g, dtype) // k_tile(dtype))
    ints = (g.N, g.P, g.Q, g.K, cchunks, g.R, g.S, g.sh, g.ph, g.pw, g.dh, g.dw, rows)
    base = tensor_maps.pack_params([("128s", bytes(128)), ("128s", bytes(128)), ("Q", 0),
                                    ("Q", 0)] + [("i", v) for v in ints], layout)
    (oa, _), (ob, _), (oc, _), (obias, _) = layout[0][:4]
    maps: Dict[Tuple[int, int], Tuple[bytes, bytes]] = {}
    go = prepared.launch_packed

    def launch(pxt: int, pwt: int, pbias: int, pout: int, stream: Any = None) -> None:
        pair = maps.get((pxt, pwt))
        if pair is None:
            if len(maps) >= MAPS_KEPT:
                del maps[next(iter(maps))]
            pair = maps[(pxt, pwt)] = _maps(g, cfg, dtype, pxt, pwt)
        buf = bytearray(base)
        buf[oa:oa + 128], buf[ob:ob + 128] = pair
        buf[oc:oc + 8] = pout.to_bytes(8, "little")
        buf[obias:obias + 8] = pbias.to_bytes(8, "little")
        go(bytes(buf), stream)
    cache[key] = launch
    return launch


def run_tma(m: Any, cfg: Dict[str, Any], xt: CudaTensor, wt: CudaTensor,
            bias: Optional[CudaTensor], g: Geometry, out: CudaTensor, dev: int,
            cache: Dict[Any, Any]) -> None:
    """The general path's launch (xt, wt from prepare_input_mma / prepare_weight_mma) in
    the device's context on the current stream, the operands' use recorded on it as
    Launcher.launch records it."""
    launch = runner(m, cfg, g, out.dtype, dev, cache)
    with m.backend.activate(dev):
        stream = streams.current_pycuda_stream(dev)
        for t in (xt, wt, bias, out):
            if type(t) is CudaTensor and t.stream is not stream:
                record_stream(t, stream)
        launch(xt.ptr, wt.ptr, 0 if bias is None else bias.ptr, out.ptr, stream)

