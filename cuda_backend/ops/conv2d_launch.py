"""conv2d's launches. The general path: the repacks of the operands into pool workspaces
(`conv2d_prep.cu.j2`), each kernel family's launch over the whole output (`run_direct`,
`run_simt`, `run_mma`), and `launch`, which picks the tile config per geometry (the
autotuner, once; memoized on m) and runs it. The per-call plan (ops/common.py
remember_plan): `fast_plan` prepares the same launches, with the same arguments, once per
key (`plan_key`) and replays them with workspaces taken from the pool directly;
`cached_plan` looks a plan up (here and in ops/conv2d_backward.py).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ..dtypes import CudaDataType
from ..kernels import dtype_params
from ..tensor import CudaTensor, pool_tensor
from . import common
from .conv2d_configs import (DIRECT_TEMPLATE, DIRECT_VQ, MMA_TEMPLATE, PREP_TEMPLATE,
                             SIMT_TEMPLATE, choose, config_family, family, padded_channels,
                             timed_whole, x3_fits)
from .conv2d_geometry import Geometry

DT = CudaDataType


def get_kernel(m: Any, template: str, dev: int, params: Dict[str, Any]) -> Any:
    """m.kernel(template, dev, **params), memoized on m (ops/common.py memo_kernel)."""
    return common.memo_kernel(m, "_conv2d_kernels", template, dev, params)


def launch(m: Any, x: CudaTensor, w: CudaTensor, bias: Optional[CudaTensor], g: Geometry,
           dtype: CudaDataType, prec: Optional[str], out: CudaTensor,
           dev: int) -> Optional[Dict[str, Any]]:
    """The launches of one convolution; returns the tile config used (None: direct)."""
    fam = family(g, dtype, prec)
    if fam == "direct":
        run_direct(m, x, w, bias, g, out, dev)
        return None
    memo = m.__dict__.setdefault("_conv2d_configs", {})
    mkey = (g, dtype, prec, dev)
    cfg = memo.get(mkey)
    if fam == "simt" and timed_whole(g, dtype, prec):
        # SIMT with 3xTF32 or KCRS configs: each timed whole, with the repacks its kernel
        # needs
        def run_any(c: Dict[str, Any]) -> None:
            run_config(m, c, x, w, bias, g, out, dev)
        if cfg is None:
            op = "conv2d_x3simt" if x3_fits(g, dtype, prec) else "conv2d_kcrs"
            cfg = memo[mkey] = choose(m, op, g, dtype, prec, run_any, dev)
        run_any(cfg)
        return cfg
    with workspaces(m, fam, x, w, g, dev) as (xa, wt):
        # the candidates timed on the same repacked operands (the TMA configs take the mma
        # ones' repacks)
        def run(c: Dict[str, int]) -> None:
            run_repacked(m, c, xa, wt, bias, g, out, dev)
        if cfg is None:
            cfg = memo[mkey] = choose(m, f"conv2d_{fam}", g, dtype, prec, run, dev)
        run(cfg)
    return cfg


def run_config(m: Any, cfg: Dict[str, Any], x: CudaTensor, w: CudaTensor,
               bias: Optional[CudaTensor], g: Geometry, out: CudaTensor, dev: int) -> None:
    """One tile config (SIMT or mma, any dtype it renders for) over the whole output, with
    the repacks its kernel needs; the workspaces go back to the pool after the launch."""
    with workspaces(m, config_family(cfg), x, w, g, dev, bool(cfg.get("kcrs"))) as (xa, wt):
        run_repacked(m, cfg, xa, wt, bias, g, out, dev)


def run_repacked(m: Any, cfg: Dict[str, Any], xa: CudaTensor, wt: CudaTensor,
                 bias: Optional[CudaTensor], g: Geometry, out: CudaTensor, dev: int) -> None:
    """One tile config over the whole output from its family's repacked operands
    (workspaces): run_simt, run_mma or the TMA kernel (ops/conv2d_tma.py)."""
    fam = config_family(cfg)
    if fam == "tma":
        from .conv2d_tma import run_tma
        run_tma(m, cfg, xa, wt, bias, g, out, dev, m.__dict__.setdefault("_conv2d_kernels", {}))
        return
    (run_simt if fam == "simt" else run_mma)(m, cfg, xa, wt, bias, g, out, dev)


@contextlib.contextmanager
def workspaces(m: Any, fam: str, x: CudaTensor, w: CudaTensor, g: Geometry,
               dev: int, kcrs: bool = False) -> Iterator[Tuple[CudaTensor, CudaTensor]]:
    """(input, filter) as the family's kernel reads them: 'simt' x and the filter from
    prepare_weight_simt (kcrs: as given), 'mma' both from the prepare_*_mma functions. The
    repacked ones are pool workspaces, freed on exit (back to the pool; later work on this
    stream is ordered after the launch)."""
    if fam == "simt" and kcrs:
        yield x, w
        return
    if fam == "simt":
        wt = prepare_weight_simt(m, w, g, dev)
        try:
            yield x, wt
        finally:
            wt.free()
        return
    xt = prepare_input_mma(m, x, g, dev)
    try:
        wt = prepare_weight_mma(m, w, g, dev)
        try:
            yield xt, wt
        finally:
            wt.free()
    finally:
        xt.free()


def device_grid_1d(m: Any, n: int, dev: int, block: int = 256) -> int:
    """common.grid_1d for the device's multiprocessor count."""
    sms = m.backend.get_device_info(dev).multiprocessor_count
    return common.grid_1d(n, block, sms)


def _bias_args(bias: Optional[CudaTensor]) -> Tuple[Any, int]:
    return (bias, 1) if bias is not None else (0, 0)


def run_direct(m: Any, x: CudaTensor, w: CudaTensor, bias: Optional[CudaTensor], g: Geometry,
               out: CudaTensor, dev: int) -> None:
    """The direct kernel over the whole output."""
    kernel = get_kernel(m, DIRECT_TEMPLATE, dev, {**dtype_params(x.dtype), "vq": DIRECT_VQ})
    total = g.N * g.K * g.P * -(-g.Q // DIRECT_VQ)
    b, has_bias = _bias_args(bias)
    m.backend.launch_kernel(kernel.name, (device_grid_1d(m, total, dev), 1, 1), x, w, b, out,
                            has_bias, g.C, g.H, g.W, g.Cg, g.Kg, g.K, g.P, g.Q, g.R, g.S,
                            g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, total,
                            block_size=(256, 1, 1), device_id=dev)


def prepare_weight_simt(m: Any, w: CudaTensor, g: Geometry, dev: int) -> CudaTensor:
    """Filter -> [G][R*S][Cg][Kgp] float32 (Kgp = Kg rounded up to 4, zero-filled)."""
    kgp = -(-g.Kg // 4) * 4
    wt = m.backend.empty((g.groups * g.R * g.S * g.Cg * kgp,), w.dtype, dev)
    try:
        kernel = get_kernel(m, PREP_TEMPLATE, dev,
                            {**dtype_params(w.dtype), "kind": "weight_rsck"})
        total = wt.size
        m.backend.launch_kernel(kernel.name, (device_grid_1d(m, total, dev), 1, 1), w, wt, g.Kg,
                                g.Cg, g.R * g.S, kgp, total, block_size=(256, 1, 1),
                                device_id=dev)
    except BaseException:
        wt.free()
        raise
    return wt


def run_simt(m: Any, cfg: Dict[str, int], x: CudaTensor, wt: CudaTensor,
             bias: Optional[CudaTensor], g: Geometry, out: CudaTensor, dev: int) -> None:
    """One SIMT config over the whole output (wt from prepare_weight_simt)."""
    kernel = get_kernel(m, SIMT_TEMPLATE, dev, {**dtype_params(DT.FLOAT32), **cfg})
    threads = (cfg["bm"] // cfg["tm"]) * (cfg["bn"] // cfg["tn"]) * cfg["slices"]
    grid = (-(-g.M // cfg["bm"]), -(-g.Kg // cfg["bn"]), g.groups)
    kgp = -(-g.Kg // 4) * 4
    b, has_bias = _bias_args(bias)
    out_vec = int(out.ptr % 16 == 0)
    m.backend.launch_kernel(kernel.name, grid, x, wt, b, out, has_bias, out_vec, g.C, g.H,
                            g.W, g.Cg, g.Kg, kgp, g.K, g.P, g.Q, g.R, g.S, g.sh, g.sw, g.ph,
                            g.pw, g.dh, g.dw, g.M, block_size=(threads, 1, 1), device_id=dev)


def prepare_input_mma(m: Any, x: CudaTensor, g: Geometry, dev: int) -> CudaTensor:
    """Input -> NHWC with each group's channels padded to Cgp (zeros), in x's dtype."""
    cgp = padded_channels(g, x.dtype)
    ct = g.groups * cgp
    hw = g.H * g.W
    xt = m.backend.empty((g.N * hw * ct,), x.dtype, dev)
    try:
        kernel = get_kernel(m, PREP_TEMPLATE, dev, {**dtype_params(x.dtype), "kind": "input_nhwc"})
        max_z = m.backend.get_device_info(dev).max_grid_dims[2]
        es = x.dtype.itemsize
        for n0 in range(0, g.N, max_z):
            nb = min(max_z, g.N - n0)
            src = x if n0 == 0 else x.ptr + n0 * g.C * hw * es
            dst = xt if n0 == 0 else xt.ptr + n0 * hw * ct * es
            m.backend.launch_kernel(kernel.name, (-(-hw // 32), -(-ct // 32), nb), src, dst,
                                    g.C, hw, g.Cg, cgp, ct, block_size=(32, 8, 1),
                                    device_id=dev)
    except BaseException:
        xt.free()
        raise
    return xt


def prepare_weight_mma(m: Any, w: CudaTensor, g: Geometry, dev: int) -> CudaTensor:
    """Filter -> [K][R*S][Cgp] (channels padded to 16 bytes with zeros), in w's dtype."""
    cgp = padded_channels(g, w.dtype)
    wt = m.backend.empty((g.K * g.R * g.S * cgp,), w.dtype, dev)
    try:
        kernel = get_kernel(m, PREP_TEMPLATE, dev,
                            {**dtype_params(w.dtype), "kind": "weight_krsc"})
        total = wt.size
        m.backend.launch_kernel(kernel.name, (device_grid_1d(m, total, dev), 1, 1), w, wt, g.Cg,
                                g.R * g.S, cgp, total, block_size=(256, 1, 1), device_id=dev)
    except BaseException:
        wt.free()
        raise
    return wt


def mma_shared_bytes(cfg: Dict[str, int], dtype: CudaDataType) -> int:
    return cfg["stages"] * (cfg["bm"] + cfg["bn"]) * cfg["bk"] * dtype.itemsize


def run_mma(m: Any, cfg: Dict[str, int], xt: CudaTensor, wt: CudaTensor,
            bias: Optional[CudaTensor], g: Geometry, out: CudaTensor, dev: int) -> None:
    """One mma config over the whole output (xt, wt from the prepare_*_mma functions)."""
    dtype = out.dtype
    kernel = get_kernel(m, MMA_TEMPLATE, dev, {**dtype_params(dtype), **cfg})
    threads = (cfg["bm"] // cfg["wm"]) * (cfg["bn"] // cfg["wn"]) * 32
    grid = (-(-g.M // cfg["bm"]), -(-g.Kg // cfg["bn"]), g.groups)
    cgp = padded_channels(g, dtype)
    b, has_bias = _bias_args(bias)
    m.backend.launch_kernel(kernel.name, grid, xt, wt, b, out, has_bias, g.H, g.W,
                            g.groups * cgp, cgp, g.Kg, g.K, g.P, g.Q, g.R, g.S, g.sh, g.sw,
                            g.ph, g.pw, g.dh, g.dw, g.M, block_size=(threads, 1, 1),
                            shared_mem=mma_shared_bytes(cfg, dtype), device_id=dev)


# -- the per-call plan -----------------------------------------------------------------------
def cached_plan(m: Any, key: Callable[..., tuple], *key_args: Any) -> Any:
    """The per-call plan remembered on m under key(*key_args), or None: none yet, or the key
    cannot be made (not a config, unhashable fields: the general path's checks run)."""
    try:
        return m.plans.get(key(*key_args))
    except (AttributeError, TypeError):
        return None


def plan_key(x: CudaTensor, w: CudaTensor, config: Any, no_bias: bool,
             precision: Any) -> tuple:
    """The plan cache key of a conv2d: the operands' shapes, dtypes and devices, the
    config's type and fields, bias presence (the bias itself is checked by the plan) and
    precision as given."""
    return ("conv2d", x.shape, x.dtype, x.device_id, w.shape, w.dtype, w.device_id,
            type(config), config.kernel_size, config.stride, config.padding, config.dilation,
            config.groups, no_bias, precision)


def fast_plan(m: Any, g: Geometry, dtype: CudaDataType, prec: Optional[str], dev: int,
              has_bias: bool, cfg: Optional[Dict[str, int]]) -> Any:
    """The per-call plan of conv2d for one key (ops/common.py remember_plan), made after
    the general path has launched (so after the autotuner's pick, cfg): the bias checked as
    the general path would (a mismatch returns None: the general path raises), the result
    allocated, and the general path's launches prepared, with its temporaries: direct one
    launch; simt the filter repack into wt, the GEMM (out_vec from the result's pointer),
    wt released; mma the input repack into xt (one launch per max-grid-z images), the filter
    repack into wt, the GEMM, wt and xt released. A failed launch frees the result, as
    conv2d does."""
    geo = (g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, g.M)
    fam = family(g, dtype, prec)
    if fam == "direct":
        go, args = _direct_launch(m, g, dtype, dev, geo)
        return _run_source(m, g, dtype, dev, has_bias, fam, go, args)
    assert cfg is not None
    fam = config_family(cfg)   # float32's candidates hold both (x3_fits)
    if fam == "simt":
        wprep, wargs, wt_bytes, go, args = _simt_launches(m, g, dtype, dev, cfg, geo)
        if cfg.get("kcrs"):   # the filter as given: the GEMM alone
            return _run_source(m, g, dtype, dev, has_bias, "kcrs", go, args)
        return _run_source(m, g, dtype, dev, has_bias, fam, go, args, wprep, wargs, wt_bytes)
    iprep, iargs, xt_bytes, wprep, wargs, wt_bytes, go, args = _mma_launches(m, g, dtype, dev,
                                                                             cfg, fam, geo)
    return _run_source(m, g, dtype, dev, has_bias, fam, go, args, wprep, wargs, wt_bytes,
                       iprep, iargs, xt_bytes)


def _direct_launch(m: Any, g: Geometry, dtype: CudaDataType, dev: int,
                   geo: Tuple[int, ...]) -> Tuple[Any, Tuple[int, ...]]:
    """fast_plan's direct kernel, prepared, and its arguments after (x, w, bias, out,
    has_bias), as run_direct launches it."""
    prep = m.backend.prepare_launch
    total = g.N * g.K * g.P * -(-g.Q // DIRECT_VQ)
    go = prep(get_kernel(m, DIRECT_TEMPLATE, dev, {**dtype_params(dtype), "vq": DIRECT_VQ}),
              (device_grid_1d(m, total, dev), 1, 1), (256, 1, 1), 0, dev)
    args = (g.C, g.H, g.W, g.Cg, g.Kg, g.K, g.P, g.Q, g.R, g.S, *geo[:-1], total)
    return go, args


def _simt_launches(m: Any, g: Geometry, dtype: CudaDataType, dev: int, cfg: Dict[str, int],
                   geo: Tuple[int, ...]) -> Tuple[Any, Tuple[int, ...], int, Any,
                                                  Tuple[int, ...]]:
    """fast_plan's SIMT launches, prepared as prepare_weight_simt and run_simt make them: the
    filter repack (its arguments after (w, wt), wt's bytes), then the GEMM (its arguments
    after (x, wt, bias, out, has_bias, out_vec))."""
    prep, es = m.backend.prepare_launch, dtype.itemsize
    kgp = -(-g.Kg // 4) * 4
    wt_size = g.groups * g.R * g.S * g.Cg * kgp
    wt_bytes = wt_size * es
    wprep = prep(get_kernel(m, PREP_TEMPLATE, dev, {**dtype_params(dtype),
                                                    "kind": "weight_rsck"}),
                 (device_grid_1d(m, wt_size, dev), 1, 1), (256, 1, 1), 0, dev)
    wargs = (g.Kg, g.Cg, g.R * g.S, kgp, wt_size)
    threads = (cfg["bm"] // cfg["tm"]) * (cfg["bn"] // cfg["tn"]) * cfg["slices"]
    go = prep(get_kernel(m, SIMT_TEMPLATE, dev, {**dtype_params(DT.FLOAT32), **cfg}),
              (-(-g.M // cfg["bm"]), -(-g.Kg // cfg["bn"]), g.groups), (threads, 1, 1), 0,
              dev)
    args = (g.C, g.H, g.W, g.Cg, g.Kg, kgp, g.K, g.P, g.Q, g.R, g.S, *geo)
    return wprep, wargs, wt_bytes, go, args


def _mma_launches(m: Any, g: Geometry, dtype: CudaDataType, dev: int, cfg: Dict[str, int],
                  fam: str, geo: Tuple[int, ...]) -> Tuple[List[Tuple[Any, int, int]],
                                                           Tuple[int, ...], int, Any,
                                                           Tuple[int, ...], int, Any,
                                                           Tuple[int, ...]]:
    """fast_plan's mma and TMA launches, prepared as the prepare_*_mma functions and
    run_repacked make them: the input repack (per max-grid-z images: the launch and the x
    and xt byte offsets; its arguments, xt's bytes), the filter repack (its arguments, wt's
    bytes), then the GEMM and its arguments (TMA: ops/conv2d_tma.py's launch, none)."""
    prep, es = m.backend.prepare_launch, dtype.itemsize
    cgp = padded_channels(g, dtype)
    ct, hw = g.groups * cgp, g.H * g.W
    xt_bytes = g.N * hw * ct * es
    ikernel = get_kernel(m, PREP_TEMPLATE, dev, {**dtype_params(dtype), "kind": "input_nhwc"})
    max_z = m.backend.get_device_info(dev).max_grid_dims[2]
    iprep = [(prep(ikernel, (-(-hw // 32), -(-ct // 32), min(max_z, g.N - n0)), (32, 8, 1),
                   0, dev), n0 * g.C * hw * es, n0 * hw * ct * es)
             for n0 in range(0, g.N, max_z)]
    iargs = (g.C, hw, g.Cg, cgp, ct)
    wt_size = g.K * g.R * g.S * cgp
    wt_bytes = wt_size * es
    wprep = prep(get_kernel(m, PREP_TEMPLATE, dev, {**dtype_params(dtype),
                                                    "kind": "weight_krsc"}),
                 (device_grid_1d(m, wt_size, dev), 1, 1), (256, 1, 1), 0, dev)
    wargs = (g.Cg, g.R * g.S, cgp, wt_size)
    go: Any
    args: Tuple[int, ...]
    if fam == "tma":    # (the mma repacks, then ops/conv2d_tma.py's launch)
        from .conv2d_tma import runner
        tma = runner(m, cfg, g, dtype, dev, m.__dict__.setdefault("_conv2d_kernels", {}))

        def go(pxt: int, pwt: int, pb: int, po: int, *_: Any) -> None:
            tma(pxt, pwt, pb, po)
        args = ()
    else:
        threads = (cfg["bm"] // cfg["wm"]) * (cfg["bn"] // cfg["wn"]) * 32
        go = prep(get_kernel(m, MMA_TEMPLATE, dev, {**dtype_params(dtype), **cfg}),
                  (-(-g.M // cfg["bm"]), -(-g.Kg // cfg["bn"]), g.groups),
                  (threads, 1, 1), mma_shared_bytes(cfg, dtype), dev)
        args = (g.H, g.W, ct, cgp, g.Kg, g.K, g.P, g.Q, g.R, g.S, *geo)
    return iprep, iargs, xt_bytes, wprep, wargs, wt_bytes, go, args


def _run_source(m: Any, g: Geometry, dtype: CudaDataType, dev: int, has_bias: bool, fam: str,
                go: Any, args: Tuple[int, ...], wprep: Any = None, wargs: Tuple[int, ...] = (),
                wt_bytes: int = 0, iprep: Sequence[Tuple[Any, int, int]] = (),
                iargs: Tuple[int, ...] = (),
                xt_bytes: int = 0) -> Callable[..., Optional[CudaTensor]]:
    """run(x, w, bias) for fast_plan: None where the general path must run (freed or
    streamed operands, a bias it would reject), else the result from the pool after fam's
    prepared launches (mma: iprep into xt; mma and simt: wprep into wt; then go; direct and
    kcrs: go alone), their temporaries released."""
    size = g.N * g.K * g.P * g.Q
    nbytes = size * dtype.itemsize
    out_shape = g.out_shape
    kshape = (g.K,)
    pool = m.backend.memory_pools[dev]
    alloc, release = pool.allocate_current, pool.release
    hb = int(has_bias)

    def run(x: CudaTensor, w: CudaTensor, bias: Any) -> Optional[CudaTensor]:
        px, pw = x._ptr, w._ptr
        if px is None or pw is None or x.stream is not None or w.stream is not None:
            return None
        pb = common.plan_pointer(bias, kshape, dtype, dev) if has_bias else 0
        if pb is None:
            return None
        out = pool_tensor(out_shape, dtype, dev, alloc(nbytes), pool, size, nbytes)
        po = out._ptr
        try:
            if fam == "direct":
                go(px, pw, pb, po, hb, *args)
            elif fam == "kcrs":
                go(px, pw, pb, po, hb, int(po % 16 == 0), *args)
            elif fam == "simt":
                wt = alloc(wt_bytes)
                try:
                    pwt = int(wt)
                    wprep(pw, pwt, *wargs)
                    go(px, pwt, pb, po, hb, int(po % 16 == 0), *args)
                finally:
                    release(wt)  # as the general path's wt.free()
            else:
                xt = alloc(xt_bytes)
                try:
                    pxt = int(xt)
                    for ilaunch, x_off, xt_off in iprep:
                        ilaunch(px + x_off, pxt + xt_off, *iargs)
                    wt = alloc(wt_bytes)
                    try:
                        pwt = int(wt)
                        wprep(pw, pwt, *wargs)
                        go(pxt, pwt, pb, po, hb, *args)
                    finally:
                        release(wt)
                finally:
                    release(xt)
        except BaseException:
            out.free()  # nothing leaks from a failed launch
            raise
        return out
    return run
