"""Matrix transpose (2-D, or the last two axes of a 3-D tensor) through a shared-memory tile.

Two kernels (`transpose.cu.j2`): "tile" moves one element per access (32 x block_rows
threads); "vec" moves 16- or 8-byte vectors on both sides (each thread transposes sv x sv
sub-blocks in registers) when rows and cols are multiples of the vector's elements and both
pointers are aligned, else single elements, and orders its blocks in bands of `group` tile
rows. Large problems are autotuned among the candidates (`candidates`), small ones take a
fixed config. The batch goes on the grid's z, split into launches of at most 65535 planes
(`launch_grids`).
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .. import occupancy
from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..kernels import dtype_params
from ..tensor import CudaTensor, pool_tensor
from . import common
from .reduction import host_result

TEMPLATE = "transpose.cu.j2"
TEMPLATES = (TEMPLATE,)
DTYPES = (CudaDataType.FLOAT32, CudaDataType.FLOAT64, CudaDataType.FLOAT16,
          CudaDataType.BFLOAT16, CudaDataType.INT32, CudaDataType.INT64)
CONFIGS = ({"kernel": "tile", "tile": 32, "block_rows": 8},
           {"kernel": "tile", "tile": 64, "block_rows": 8},
           {"kernel": "tile", "tile": 64, "block_rows": 16})
# "vec" kernel (tile, threads) per element size and bytes per access; the first is the default
VEC_CONFIGS = {
    (4, 16): ((64, 256), (64, 128), (32, 64)),
    (4, 8): ((64, 256),),
    (4, 4): ((64, 256), (32, 256)),
    (2, 16): ((64, 64), (128, 256)),
    (2, 8): ((64, 256),),
    (2, 2): ((64, 256),),
    (8, 16): ((32, 256), (64, 256)),
    (8, 8): ((32, 256), (64, 256)),
}
MAX_GRID_Z = 65535   # planes per launch where the device's limit is unknown
GROUP = 16        # default band height (tile rows) of the "vec" kernel's block order
MAX_MIN_BLOCKS = 16   # the "vec" kernel's __launch_bounds__ minimum blocks, at most
# candidate lists already compiled, per CudaMath: (device, dtype, access width)
_compiled: "weakref.WeakKeyDictionary[Any, set]" = weakref.WeakKeyDictionary()


def vec_params(dtype: CudaDataType, vec_bytes: int, tile: int, threads: int) -> Dict[str, Any]:
    """Template parameters of one "vec" kernel."""
    return {**dtype_params(dtype), "kernel": "vec", "tile": tile, "vec_bytes": vec_bytes,
            "threads": threads, "min_blocks": _vec_min_blocks(dtype, vec_bytes, tile, threads)}


@functools.lru_cache(maxsize=None)
def _vec_min_blocks(dtype: CudaDataType, vec_bytes: int, tile: int, threads: int) -> int:
    """Resident blocks per SM (at most MAX_MIN_BLOCKS) as the threads, the shared memory of
    the tile and the registers allow (occupancy.blocks_per_sm, Hopper's limits): the loaded
    sub-blocks (passes x sv vectors) plus 32 working registers (48 for the 8 x 8 sub-blocks
    of 16-bit types); every variant compiles spill-free."""
    sv = vec_bytes // dtype.itemsize
    pad = 1 if sv == 1 else 0
    smem = tile * (tile + pad) * dtype.itemsize
    passes = (tile // sv) ** 2 // threads
    regs = passes * sv * max(1, vec_bytes // 4) + (48 if sv == 8 else 32)
    return min(MAX_MIN_BLOCKS, occupancy.blocks_per_sm(occupancy.KernelResources(regs, smem),
                                                       None, threads))


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    sets = []
    for dt in DTYPES:
        sets += [{**dtype_params(dt), **cfg} for cfg in CONFIGS]
        for (size, vb), tiles in VEC_CONFIGS.items():
            if size == dt.itemsize:
                sets += [vec_params(dt, vb, tile, threads) for tile, threads in tiles]
    # transpose_tf32: the default (first) "vec" config of each float32 access width, rounding
    for (size, vb), tiles in VEC_CONFIGS.items():
        if size == 4:
            tile, threads = tiles[0]
            sets.append({**vec_params(CudaDataType.FLOAT32, vb, tile, threads),
                         "round_tf32": True})
    return {TEMPLATE: sets}


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every transpose variant in parallel threads (nvcc runs in subprocesses);
    returns how many were compiled (0 in fallback mode). Later calls find them memoized."""
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets]
    return common.compile_all(m, jobs, device_id, workers)


def reference(x: Any) -> np.ndarray:
    """The transpose of the last two axes, in float64."""
    return np.ascontiguousarray(np.swapaxes(np.asarray(x, dtype=np.float64), -1, -2))


def vec_width(dtype: CudaDataType, rows: int, cols: int, *ptrs: int) -> int:
    """The widest access (16, 8 or the element size, bytes) the "vec" kernel may use."""
    for vb in (16, 8):
        sv = vb // dtype.itemsize
        if vb > dtype.itemsize and rows % sv == 0 and cols % sv == 0 and \
                all(p % vb == 0 for p in ptrs):
            return vb
    return dtype.itemsize


def candidates(dtype: CudaDataType, rows: int, cols: int, *ptrs: int) -> List[Dict[str, Any]]:
    """Every config able to run this transpose: the "vec" kernel at the widest access (each
    tile, default group), at 8 bytes where 16 is possible, in row-major block order, then
    the "tile" configs. The first is the default."""
    vb = vec_width(dtype, rows, cols, *ptrs)
    out: List[Dict[str, Any]] = [{"kernel": "vec", "vec_bytes": vb, "tile": t, "threads": n,
                                  "group": GROUP} for t, n in VEC_CONFIGS[(dtype.itemsize, vb)]]
    if vb == 16 and dtype.itemsize < 8:
        t, n = VEC_CONFIGS[(dtype.itemsize, 8)][0]
        out.append({"kernel": "vec", "vec_bytes": 8, "tile": t, "threads": n, "group": GROUP})
    out.append(dict(out[0], group=0))
    return out + [dict(c) for c in CONFIGS]


def transpose(m: Any, x: CudaTensor, out: Optional[CudaTensor] = None) -> CudaTensor:
    """(rows, cols) -> (cols, rows); (batch, rows, cols) -> (batch, cols, rows)."""
    if out is None and type(x) is CudaTensor:
        key = ("matrix_transpose", x.shape, x.dtype, x.device_id)
        res = common.planned(m, key, x) if m.backend.direct_launch(x.device_id) else None
        if res is not None:
            return res
    common.check_tensor(x, "tensor")
    if x.ndim not in (2, 3):
        raise InvalidArgumentError(
            f"matrix_transpose needs a 2-D or 3-D tensor, got shape {x.shape}")
    common.require_dtype(x, DTYPES, "matrix_transpose")
    batch = x.shape[0] if x.ndim == 3 else 1
    rows, cols = x.shape[-2], x.shape[-1]
    shape = x.shape[:-2] + (cols, rows)
    if out is not None:
        common.check_tensor(out, "out")
        if out.shape != shape or out.dtype is not x.dtype:
            raise ShapeMismatchError(
                f"out has shape {out.shape} ({out.dtype.name_str}), expected {shape} "
                f"({x.dtype.name_str})")
        common.same_device(x, out)
    if not m.gpu:
        return host_result(m, np.swapaxes(common.host_array(m, x), -1, -2), x.dtype,
                           x.device_id, out)
    dev = x.device_id
    out, new = common.result_tensor(m, out, shape, x.dtype, dev)
    if x.size == 0:
        return out
    if rows * cols >= 2**31:
        raise InvalidArgumentError(
            f"matrix_transpose supports planes under 2^31 elements, got {rows}x{cols}")
    cfg = pick(m, x, out, batch, rows, cols)
    _launch(m, cfg, x, out, batch, rows, cols)
    if new:
        common.remember_plan(m, ("matrix_transpose", x.shape, x.dtype, dev),
                             _fast_plan(m, x, shape, batch, rows, cols,
                                        vec_width(x.dtype, rows, cols, x.ptr, out.ptr), cfg))
    return out


def _fast_plan(m: Any, x: CudaTensor, shape: Tuple[int, ...], batch: int, rows: int,
               cols: int, vb: int, cfg: Dict[str, Any]) -> Any:
    """The per-call plan of transposes of tensors shaped like x (ops/common.py
    remember_plan): the result's allocation and the PreparedLaunches of the config the
    general path chose (autotuned or default) for the access width `vb` those pointers
    allowed. The width follows the pointers' alignment, so it is found per call; a width
    not seen yet gets its config as the general path would (pick, with this call's
    tensors) and its launches prepared then."""
    backend = m.backend
    dev, dtype = x.device_id, x.dtype
    pool = backend.memory_pools[dev]
    alloc = pool.allocate_current
    size, nbytes, itemsize = x.size, x.nbytes, dtype.itemsize
    plane = rows * cols * itemsize
    # the widths vec_width may give, as far as the shape decides: 16, 8 (when wider than an
    # element and rows, cols are multiples of their vectors), then the element size
    widths = [vb for vb in (16, 8) if vb > itemsize and rows % (vb // itemsize) == 0 and
              cols % (vb // itemsize) == 0]
    max_z = max_grid_z(m, dev)

    def prepare(cfg: Dict[str, Any]) -> List[tuple]:
        kernel = m.kernel(TEMPLATE, dev, **config_params(dtype, cfg))
        extra: Tuple[int, ...]
        if cfg["kernel"] == "tile":
            block, extra = (32, cfg["block_rows"], 1), ()
        else:
            block, extra = (cfg["threads"], 1, 1), (cfg["group"],)
        return [(b0 * plane, backend.prepare_launch(kernel, grid, block, 0, dev), extra)
                for b0, grid in launch_grids(cfg, batch, rows, cols, max_z)]

    by_width = {vb: prepare(cfg)}

    def run(x: CudaTensor) -> Optional[CudaTensor]:
        px = x._ptr
        if px is None or x.stream is not None:   # (the launcher would record_stream it)
            return None
        out = pool_tensor(shape, dtype, dev, alloc(nbytes, None), pool, size, nbytes)
        po = out._ptr
        both = px | po
        w = itemsize
        for vb in widths:
            if not both % vb:
                w = vb
                break
        launches = by_width.get(w)
        if launches is None:
            launches = by_width[w] = prepare(pick(m, x, out, batch, rows, cols))
        for off, go, extra in launches:
            go(px + off, po + off, rows, cols, *extra)
        return out
    return run


def config_params(dtype: CudaDataType, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The template parameters of a config from `candidates` or CONFIGS."""
    if cfg["kernel"] == "tile":
        return {**dtype_params(dtype), "kernel": "tile", "tile": cfg["tile"],
                "block_rows": cfg["block_rows"]}
    return vec_params(dtype, cfg["vec_bytes"], cfg["tile"], cfg["threads"])


def launch_grids(cfg: Dict[str, Any], batch: int, rows: int, cols: int,
                 max_z: int = MAX_GRID_Z) -> List[Tuple[int, Tuple[int, int, int]]]:
    """(first plane, grid) of each launch of a config: the planes go on the grid's z, at
    most max_z of them per launch (later launches start at an offset plane)."""
    tile = cfg["tile"]
    tc, trows = -(-cols // tile), -(-rows // tile)
    xy = (tc, trows) if cfg["kernel"] == "tile" else (tc * trows, 1)
    return [(b0, (*xy, min(max_z, batch - b0))) for b0 in range(0, batch, max_z)]


def _launch(m: Any, cfg: Dict[str, Any], x: CudaTensor, out: CudaTensor, batch: int,
            rows: int, cols: int) -> None:
    """One config from `candidates` (or CONFIGS) over x into out."""
    dev = x.device_id
    kernel = m.kernel(TEMPLATE, dev, **config_params(x.dtype, cfg))
    extra: Tuple[int, ...]
    if cfg["kernel"] == "tile":
        block, extra = (32, cfg["block_rows"], 1), ()
    else:
        block, extra = (cfg["threads"], 1, 1), (cfg["group"],)
    plane = rows * cols * x.dtype.itemsize
    for b0, grid in launch_grids(cfg, batch, rows, cols, max_grid_z(m, dev)):
        src, dst = (x, out) if b0 == 0 else (x.ptr + b0 * plane, out.ptr + b0 * plane)
        m.backend.launch_kernel(kernel.name, grid, src, dst, rows, cols, *extra,
                                block_size=block, device_id=dev)


def max_grid_z(m: Any, dev: int) -> int:
    """The device's grid z limit (stand-in backends without device info: MAX_GRID_Z)."""
    info = getattr(m.backend, "get_device_info", None)
    return info(dev).max_grid_dims[2] if info is not None else MAX_GRID_Z


def transpose_tf32(m: Any, x: Any, out: Any, batch: int, rows: int, cols: int,
                   device_id: int) -> None:
    """out[b] = round_tf32(x[b])ᵀ for float32 planes (rows, cols) given as tensors or device
    pointers: the wgmma TF32 matmul's B operand, K-major and rounded like its A fragments.
    The default "vec" config at the widest legal access, untimed."""
    xp, op = int(getattr(x, "ptr", x)), int(getattr(out, "ptr", out))
    cfg = candidates(CudaDataType.FLOAT32, rows, cols, xp, op)[0]
    params = {**config_params(CudaDataType.FLOAT32, cfg), "round_tf32": True}
    kernel = m.kernel(TEMPLATE, device_id, **params)
    plane = rows * cols * 4
    for b0, grid in launch_grids(cfg, batch, rows, cols, max_grid_z(m, device_id)):
        src, dst = (x, out) if b0 == 0 else (xp + b0 * plane, op + b0 * plane)
        m.backend.launch_kernel(kernel.name, grid, src, dst, rows, cols, cfg["group"],
                                block_size=(cfg["threads"], 1, 1), device_id=device_id)


def pick(m: Any, x: CudaTensor, out: CudaTensor, batch: int, rows: int,
          cols: int) -> Dict[str, Any]:
    """Autotuned config per (dtype, access width, size class); small problems take the
    default "vec" config untimed."""
    cands = candidates(x.dtype, rows, cols, x.ptr, out.ptr)
    if rows * cols * batch < 1 << 20:
        return cands[0]
    size_class = (x.dtype.name_str, cands[0]["vec_bytes"],
                  "large" if rows * cols * batch >= 1 << 24 else "medium")
    done = _compiled.setdefault(m, set())
    if (x.device_id, size_class[:2]) not in done:  # the first timing compiles them all at once
        common.compile_all(m, [(TEMPLATE, config_params(x.dtype, c)) for c in cands],
                           x.device_id)
        done.add((x.device_id, size_class[:2]))
    return m.autotuner.pick("matrix_transpose", size_class, cands,
                            lambda cfg: _launch(m, cfg, x, out, batch, rows, cols),
                            device_id=x.device_id)
