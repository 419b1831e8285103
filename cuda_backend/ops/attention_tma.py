"""flash_attention's float16 / bfloat16 forward on Hopper's TMA + wgmma
(templates/flash_attention_tma.cu.j2): which calls it takes (`usable`), its configs, tensor
maps (3-d over the contiguous (batch * heads, seq, head_dim) q, k, v, boxes of 64 of
head_dim) and launch. The kernel takes three CUtensorMaps by value, so the argument buffer
is packed at the offsets cuFuncGetParamInfo gives (ops/matmul_tma16.py kernel_layout) and
sent with PreparedLaunch.launch_packed."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

from .. import streams, tensor_maps
from ..dtypes import CudaDataType
from ..kernels import dtype_params, template_arch
from ..memory_streams import record_stream
from ..tensor import CudaTensor
from . import common
from .matmul_kernels import has_wgmma
from .matmul_tma16 import kernel_layout

DT = CudaDataType
TEMPLATE = "flash_attention_tma.cu.j2"
ARG_TYPES = "128s128s128sPPiifi"
BQ = 128            # query rows per block
THREADS = 384
MAPS_KEPT = 8
# keys per tile, ring depth and turn-taking by head_dim (227 KB of shared memory at most;
# perf/NOTES.md, "Attention on TMA: overlap and ping-pong" and "the softmax's instructions")
CONFIGS: Dict[int, List[Dict[str, Any]]] = {
    64: [{"hd": 64, "bkv": 128, "stages": 3, "tma": True}],
    128: [{"hd": 128, "bkv": 128, "stages": 3, "tma": True}],
}
# configs measured slower at every shape timed (not offered to the autotuner): the sweep
# (perf/sweep_attention.py) times them and the tests run them, so the template's other
# paths (64 keys per tile, no turn-taking) stay correct
ALTERNATES: Dict[int, List[Dict[str, Any]]] = {
    64: [{"hd": 64, "bkv": 64, "stages": 4, "pingpong": 0, "tma": True}],
    128: [{"hd": 128, "bkv": 128, "stages": 3, "pingpong": 0, "tma": True}],
}


def usable(info: Any, q: CudaTensor, k: CudaTensor, v: CudaTensor) -> bool:
    """A call the kernel takes: an sm_90a device, float16 / bfloat16, q (b, h, sq, d) and
    k, v (b, h, skv, d) contiguous with d 64 or 128, 16-byte aligned, skv >= 1."""
    return has_wgmma(info) and q.dtype in (DT.FLOAT16, DT.BFLOAT16) and q.ndim == 4 and \
        q.shape[3] in (64, 128) and k.shape == v.shape and k.shape[:2] == q.shape[:2] and \
        k.shape[3] == q.shape[3] and k.shape[2] >= 1 and q.shape[2] >= 1 and \
        not (q.ptr | k.ptr | v.ptr) & 15


def params(cfg: Dict[str, Any], dtype: CudaDataType, hd: int) -> Dict[str, Any]:
    return {**dtype_params(dtype), "hd": hd, "bkv": cfg["bkv"], "stages": cfg["stages"],
            "pingpong": cfg.get("pingpong", 1)}


def shared_bytes(cfg: Dict[str, Any], hd: int) -> int:
    """Q's tile, the K / V ring and 1 KB of alignment slack."""
    return BQ * hd * 2 + cfg["stages"] * 2 * cfg["bkv"] * hd * 2 + 1024


def kernel(m: Any, dev: int, p: Dict[str, Any], cache: Dict[Any, Any]) -> Any:
    """The kernel of template parameters p compiled for sm_90a with ARG_TYPES (the compiler
    cannot derive a format for CUtensorMap parameters), memoized in cache."""
    key = ("fa_tma_kernel", tuple(sorted(p.items())), dev)
    k = cache.get(key)
    if k is None:
        name, source = m.generator.render_kernel(TEMPLATE, **p)
        k = cache[key] = m.backend.compile_kernel(name, source, device_id=dev,
                                                  arch=template_arch(TEMPLATE),
                                                  arg_types=ARG_TYPES)
    return k


def _site(m: Any, cfg: Dict[str, Any], dtype: CudaDataType, hd: int, dev: int,
          cache: Dict[Any, Any]) -> Tuple[Any, Any]:
    """(kernel, parameter layout) of a config, made once per device in cache."""
    key = ("fa_tma_site", cfg["bkv"], cfg["stages"], cfg.get("pingpong", 1), dtype, hd, dev)
    site = cache.get(key)
    if site is None:
        p = params(cfg, dtype, hd)
        k = kernel(m, dev, p, cache)
        site = cache[key] = (k, kernel_layout(m, k, p, dev, cache, TEMPLATE))
    return site


def _maps(dtype: CudaDataType, hd: int, bkv: int, bh: int, sq: int, skv: int, pq: int,
          pk: int, pv: int) -> Tuple[bytes, bytes, bytes]:
    def enc(ptr: int, seq: int, rows: int) -> bytes:
        return tensor_maps.encode_tiled(ptr, dtype, (hd, seq, bh), (hd * 2, seq * hd * 2),
                                        (64, rows, 1))
    return enc(pq, sq, BQ), enc(pk, skv, bkv), enc(pv, skv, 64)


def launcher(m: Any, cfg: Dict[str, Any], q_shape: Tuple[int, ...], seq_kv: int,
             dtype: CudaDataType, dev: int, cache: Dict[Any, Any]) -> Any:
    """launch(pq, pk, pv, po, plse, scale, causal, stream=None) for contiguous operands of
    these shapes (plse 0: no lse), made once per (config, shapes, device) in cache; the
    tensor maps of the last MAPS_KEPT pointer triples kept."""
    b, h, sq, hd = q_shape
    key = ("fa_tma_launch", cfg["bkv"], cfg["stages"], cfg.get("pingpong", 1), dtype, q_shape,
           seq_kv, dev)
    go = cache.get(key)
    if go is not None:
        return go
    k, layout = _site(m, cfg, dtype, hd, dev, cache)
    prepared = m.backend.prepare_launch(k, (-(-sq // BQ), b * h, 1), (THREADS, 1, 1),
                                        shared_bytes(cfg, hd), dev)
    send = prepared.launch_packed
    maps: Dict[tuple, Tuple[bytes, bytes, bytes]] = {}
    log2e = math.log2(math.e)

    def launch(pq: int, pk: int, pv: int, po: int, plse: int, scale: float, causal: bool,
               stream: Any = None) -> None:
        tms = maps.get((pq, pk, pv))
        if tms is None:
            if len(maps) >= MAPS_KEPT:
                del maps[next(iter(maps))]
            tms = maps[(pq, pk, pv)] = _maps(dtype, hd, cfg["bkv"], b * h, sq, seq_kv, pq, pk,
                                             pv)
        send(tensor_maps.pack_params(
            [("128s", tms[0]), ("128s", tms[1]), ("128s", tms[2]), ("Q", po), ("Q", plse),
             ("i", sq), ("i", seq_kv), ("f", scale * log2e), ("i", int(causal))], layout),
             stream)
    go = cache[key] = launch
    return go


def run(m: Any, cfg: Dict[str, Any], q: CudaTensor, k: CudaTensor, v: CudaTensor,
        out: CudaTensor, lse: Optional[CudaTensor], scale: float, causal: bool,
        cache: Dict[Any, Any]) -> None:
    """One launch over every (batch, head) and query tile (a call `usable` takes), in the
    device's context on the current stream; out (and lse, float32 (b, h, sq)) written."""
    dev = q.device_id
    launch = launcher(m, cfg, q.shape, k.shape[2], q.dtype, dev, cache)
    with m.backend.activate(dev):
        stream = streams.current_pycuda_stream(dev)
        for t in (q, k, v, out, lse):
            if type(t) is CudaTensor and t.stream is not stream:
                record_stream(t, stream)
        launch(q.ptr, k.ptr, v.ptr, out.ptr, 0 if lse is None else lse.ptr, scale, causal,
               stream)


def plan(m: Any, cfg: Dict[str, Any], q: CudaTensor, k: CudaTensor, causal: bool,
         with_lse: bool) -> Any:
    """ops/attention.py's per-call plan for a TMA config (`launcher`): run(q, k, v, scale)
    -> out (with_lse: (out, lse)), or None for operands it cannot take (not 16-byte
    aligned, on a stream, freed; a scale that is not finite: the general path's error)."""
    dtype, dev, shape = q.dtype, q.device_id, q.shape
    B, Hh, Sq, D = shape
    launch = launcher(m, cfg, shape, k.shape[2], dtype, dev,
                      m.__dict__.setdefault("_attention_kernels", {}))
    outputs = common.output_maker(m, dev, shape, dtype, (B, Hh, Sq), with_lse)
    default = 1.0 / math.sqrt(D)

    def run(q: CudaTensor, k: CudaTensor, v: CudaTensor, scale: Optional[float]) -> Any:
        pq, pk, pv = q._ptr, k._ptr, v._ptr
        if pq is None or pk is None or pv is None or (pq | pk | pv) & 15 or \
                q.stream is not None or k.stream is not None or v.stream is not None or \
                not (scale is None or math.isfinite(scale)):
            return None
        sc = default if scale is None else scale
        return outputs(lambda po, plse: launch(pq, pk, pv, po, plse, sc, causal))
    return run
