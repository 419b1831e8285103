"""conv2d_backward's launches: each backward geometry's kernels, grids and workspaces built once
into a `Program` (`build_program`, from the configs of ops/conv2d_backward_configs.py), the
autotuner's pick of the dgrad and wgrad configs, each timed as a whole part (`program`,
memoized on m), and the per-call plan that runs a program with prepared launches
(`make_plan`). The stride-1 data gradient through the forward is a step that calls
ops/conv2d.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..dtypes import CudaDataType
from ..kernels import dtype_params
from ..tensor import CudaTensor, pool_tensor
from . import common
from . import conv2d as fwd
from .conv2d_backward_configs import (AUX_BLOCK, AUX_TEMPLATE, DGRAD_TEMPLATE, HALF,
                                      bias_chunks, candidates, dgrad_grid, dgrad_path,
                                      dgrad_shared_bytes, dgrad_threads, dgrad_tiles_pp,
                                      shape_key, tile_params, wgrad_grid, wgrad_is_x3,
                                      wgrad_shared_bytes, wgrad_split, wgrad_template,
                                      wgrad_threads)
from .conv2d_geometry import Geometry

DT = CudaDataType


def get_kernel(m: Any, template: str, dev: int, params: Dict[str, Any]) -> Any:
    """m.kernel(template, dev, **params), memoized on m (ops/common.py memo_kernel)."""
    return common.memo_kernel(m, "_conv2d_bwd_kernels", template, dev, params)


# -- GPU: programs of launches -----------------------------------------------------------------
@dataclass
class _Launch:
    """One kernel launch: arguments are values, or names of the program's tensors ("go",
    "x", "w", outputs and workspaces), or ("vec", name, ok): 1 where ok and that tensor's
    pointer is 16-byte aligned."""

    name: str
    grid: Tuple[int, int, int]
    block: Tuple[int, int, int]
    smem: int
    args: Tuple[Any, ...]
    prepared: Any


@dataclass
class _Forward:
    """The stride-1 data gradient through ops/conv2d.py: conv2d(go, wf, config2) -> gi."""

    config: Any
    precision: Optional[str]


class Program:
    """The launches of one backward geometry (dtype, precision, device, parts, configs) and
    the tensors they need; `run` allocates, launches and frees the workspaces. Built once
    per key on the general path; the per-call plan runs the same program directly."""

    def __init__(self, m: Any, g: Geometry, dtype: CudaDataType, prec: Optional[str],
                 dev: int) -> None:
        self.m, self.g, self.dtype, self.prec, self.dev = m, g, dtype, prec, dev
        self.outputs: List[Tuple[str, Tuple[int, ...], CudaDataType]] = []
        self.work: List[Tuple[str, Tuple[int, ...], CudaDataType]] = []
        self.steps: List[Any] = []
        info = m.backend.get_device_info(dev)
        self.sms = info.multiprocessor_count

    def tensor(self, name: str, shape: Tuple[int, ...], dtype: CudaDataType,
               output: bool = False) -> str:
        (self.outputs if output else self.work).append((name, tuple(shape), dtype))
        return name

    def launch(self, template: str, params: Dict[str, Any], grid: Tuple[int, int, int],
               block: Tuple[int, int, int], smem: int, *args: Any) -> None:
        kernel = get_kernel(self.m, template, self.dev, params)
        prepared = self.m.backend.prepare_launch(kernel, grid, block, smem, self.dev)
        self.steps.append(_Launch(kernel.name, grid, block, smem, args, prepared))

    def aux(self, kind: str, dtype: CudaDataType, total: int, *args: Any) -> None:
        """A grid-stride auxiliary kernel over `total` items."""
        grid = (common.grid_1d(total, AUX_BLOCK, self.sms), 1, 1)
        self.launch(AUX_TEMPLATE, {**dtype_params(dtype), "kind": kind}, grid,
                    (AUX_BLOCK, 1, 1), 0, *args)

    def run(self, m: Any, go: CudaTensor, x: CudaTensor, w: CudaTensor,
            direct: bool) -> Tuple[Optional[CudaTensor], Optional[CudaTensor],
                                   Optional[CudaTensor]]:
        """Allocate the outputs and workspaces, launch every step, free the workspaces;
        direct: prepared launches on the legacy default stream (the plan's path), else
        launch_kernel (streams, profiling). A failure frees everything it allocated."""
        backend = m.backend
        named: Dict[str, Any] = {"go": go, "x": x, "w": w}
        made: List[CudaTensor] = []
        work: List[CudaTensor] = []
        if direct:
            pool = backend.memory_pools[self.dev]
            alloc = pool.allocate_current
        try:
            for names, into in ((self.outputs, made), (self.work, work)):
                for name, shape, dt in names:
                    size = math.prod(shape)
                    nbytes = size * dt.itemsize
                    if direct and nbytes:
                        t = pool_tensor(shape, dt, self.dev, alloc(nbytes), pool, size, nbytes)
                    else:
                        t = backend.empty(shape, dt, self.dev)
                    into.append(t)
                    named[name] = t
            for step in self.steps:
                if type(step) is _Forward:
                    gi = fwd.conv2d(m, named["go"], named["wf"], step.config, None,
                                    step.precision)
                    made.append(gi)
                    named["gi"] = gi
                    continue
                args = []
                for a in step.args:
                    if type(a) is str:
                        a = named[a]
                        args.append(a._ptr if direct else a)
                    elif type(a) is tuple:
                        args.append(int(a[2] and named[a[1]].ptr % 16 == 0))
                    else:
                        args.append(a)
                if direct:
                    step.prepared(*args)
                else:
                    backend.launch_kernel(step.name, step.grid, *args, block_size=step.block,
                                          shared_mem=step.smem, device_id=self.dev)
        except BaseException:
            for t in made:
                t.free()   # nothing leaks from a failed launch
            raise
        finally:
            for t in work:
                t.free()   # back to the pool; later work on this stream is ordered after it
        return named.get("gi"), named.get("gw"), named.get("gb")


def build_program(m: Any, g: Geometry, dtype: CudaDataType, prec: Optional[str], dev: int,
                  parts: Sequence[str], dcfg: Any = None,
                  wcfg: Optional[Dict[str, Any]] = None) -> Program:
    """The program of `parts` ("dgrad", "wgrad", "bias"): dcfg is a dgrad config or
    "forward", wcfg a wgrad candidate (SIMT or 3xTF32, with its waves). The autotuner
    times these per candidate; the tests run every config through them."""
    p = Program(m, g, dtype, prec, dev)
    K, CRS = g.K, g.Cg * g.R * g.S
    go_size, x_size = g.N * K * g.P * g.Q, g.N * g.C * g.H * g.W
    dgrad = "dgrad" in parts and x_size > 0
    wgrad = "wgrad" in parts and K * CRS > 0
    half = dtype in HALF
    need_gof = go_size > 0 and half and ((dgrad and dcfg != "forward") or wgrad)
    if "dgrad" in parts and not dgrad:
        p.tensor("gi", (g.N, g.C, g.H, g.W), dtype, output=True)
    if "wgrad" in parts:
        p.tensor("gw", (K, g.Cg, g.R, g.S), dtype, output=True)
    if "bias" in parts:
        p.tensor("gb", (K,), dtype, output=True)
    gof = "go"
    if need_gof:
        gof = p.tensor("gof", (go_size,), DT.FLOAT32)
        p.aux("to_float", dtype, go_size, "go", gof, go_size)
    if dgrad:
        _dgrad_steps(p, g, dtype, prec, dcfg, gof)
    if wgrad:
        assert wcfg is not None
        _wgrad_steps(p, g, dtype, wcfg, gof)
    if "bias" in parts and K > 0:
        _bias_steps(p, g, dtype)
    return p


def _dgrad_steps(p: Program, g: Geometry, dtype: CudaDataType, prec: Optional[str], dcfg: Any,
                 gof: str) -> None:
    """build_program's data gradient (x not empty): dcfg "forward" flips the weights for the
    stride-1 conv2d through the forward; a dgrad config repacks them (RSKC, float32) for its
    kernel, which reads grad_out as gof ("go", or its float32 copy)."""
    G, Cg, Kg, K, RS = g.groups, g.Cg, g.Kg, g.K, g.R * g.S
    if dcfg == "forward":
        from ..cuda_ml import ConvolutionConfig
        p.tensor("wf", (g.C, Kg, g.R, g.S), dtype)
        total = g.C * Kg * RS
        if total:
            p.aux("weight_flip", dtype, total, "w", "wf", Kg, Cg, g.R, g.S, total)
        cfg2 = ConvolutionConfig(kernel_size=(g.R, g.S), stride=1,
                                 padding=(g.dh * (g.R - 1) - g.ph, g.dw * (g.S - 1) - g.pw),
                                 dilation=(g.dh, g.dw), groups=G)
        p.steps.append(_Forward(cfg2, prec))
        return
    p.tensor("gi", (g.N, g.C, g.H, g.W), dtype, output=True)
    cgp = -(-Cg // 4) * 4
    wt = "w"          # a KCRS config reads the (float32) filter as given
    if not dcfg.get("kcrs"):
        wt_size = G * RS * Kg * cgp
        wt = p.tensor("wt", (max(wt_size, 1),), DT.FLOAT32)
        if wt_size:
            p.aux("weight_rskc", dtype, wt_size, "w", wt, Kg, Cg, RS, cgp, wt_size)
    grid = dgrad_grid(g, dcfg)
    geo = (g.sh, g.sw, g.ph, g.pw, g.dh, g.dw)
    vec = dtype is DT.FLOAT32 and (g.sh, g.sw) == (1, 1) and (g.H * g.W) % 4 == 0
    p.launch(DGRAD_TEMPLATE, {**dtype_params(dtype), **dcfg}, grid,
             (dgrad_threads(dcfg), 1, 1), dgrad_shared_bytes(dcfg), gof, wt,
             "gi", ("vec", "gi", vec), g.N, g.C, g.H, g.W, Cg, Kg, cgp, K, g.P, g.Q,
             g.R, g.S, *geo, dgrad_tiles_pp(g, dcfg["bm"]))


def _wgrad_steps(p: Program, g: Geometry, dtype: CudaDataType, wcfg: Dict[str, Any],
                 gof: str) -> None:
    """build_program's weight gradient (K * Cg * R * S > 0): x as float32 for the 16-bit
    types, the wgrad kernel over its K splits into gw directly (one split, float32) or into
    a workspace that splitk_sum adds up into gw."""
    Cg, Kg, K = g.Cg, g.Kg, g.K
    CRS = Cg * g.R * g.S
    x_size = g.N * g.C * g.H * g.W
    geo = (g.sh, g.sw, g.ph, g.pw, g.dh, g.dw)
    xf = "x"
    if dtype in HALF and x_size:
        xf = p.tensor("xf", (x_size,), DT.FLOAT32)
        p.aux("to_float", dtype, x_size, "x", xf, x_size)
    splits, chunk = wgrad_split(g, wcfg, p.sms)
    direct_out = splits == 1 and dtype is DT.FLOAT32
    out = "gw" if direct_out else p.tensor("ws", (splits * K * CRS,), DT.FLOAT32)
    cfg = tile_params(wcfg)
    mt, nt = -(-Kg // cfg["bm"]), -(-CRS // cfg["bn"])
    p.launch(wgrad_template(cfg), {**dtype_params(DT.FLOAT32), **cfg},
             wgrad_grid(g, cfg, splits), (wgrad_threads(cfg), 1, 1),
             wgrad_shared_bytes(cfg), gof, xf, out, ("vec", out, CRS % 4 == 0), g.N,
             g.C, g.H, g.W, Cg, Kg, K, g.P, g.Q, g.R, g.S, *geo, chunk, mt, nt, K * CRS)
    if not direct_out:
        p.aux("splitk_sum", dtype, K * CRS, out, "gw", K * CRS, splits)


def _bias_steps(p: Program, g: Geometry, dtype: CudaDataType) -> None:
    """build_program's bias gradient (K > 0): per-chunk partial sums of grad_out into gb
    directly (one chunk, float32) or into a workspace that splitk_sum adds up into gb."""
    K = g.K
    chunks, chunk = bias_chunks(g, p.sms)
    direct_out = chunks == 1 and dtype is DT.FLOAT32
    out = "gb" if direct_out else p.tensor("wsb", (chunks * K,), DT.FLOAT32)
    L = g.N * g.P * g.Q
    p.launch(AUX_TEMPLATE, {**dtype_params(dtype), "kind": "bias_partial"}, (K, chunks, 1),
             (AUX_BLOCK, 1, 1), 0, "go", out, K, g.P * g.Q, L, chunk)
    if not direct_out:
        p.aux("splitk_sum", dtype, K, out, "gb", K, chunks)


def program(m: Any, go: CudaTensor, x: CudaTensor, w: CudaTensor, g: Geometry,
            dtype: CudaDataType, prec: Optional[str], dev: int,
            parts: Tuple[str, ...]) -> Program:
    """The program of this geometry and parts, memoized on m; the first call picks the
    dgrad and wgrad configs (the autotuner times each candidate on these operands)."""
    memo = m.__dict__.setdefault("_conv2d_bwd_programs", {})
    key = (g, dtype, prec, dev, parts)
    prog = memo.get(key)
    if prog is not None:
        return prog
    sms = m.backend.get_device_info(dev).multiprocessor_count
    dcfg: Any = None
    wcfg = None
    work = g.N * g.C * g.H * g.W * g.K > 0   # else the parts only write zeros (or nothing)
    if "dgrad" in parts:
        dcfg = dgrad_path(g, dtype, prec)
        if dcfg == "simt":
            cands = candidates(g, sms, "dgrad", dtype)
            dcfg = _choose(m, "conv2d_dgrad", g, dtype, "dgrad", cands, go, x, w, dev,
                           prec) if work else cands[0]
    if "wgrad" in parts:
        cands = candidates(g, sms, "wgrad", dtype, prec)
        op = "conv2d_wgrad_x3" if wgrad_is_x3(cands[0]) else "conv2d_wgrad"
        wcfg = _choose(m, op, g, dtype, "wgrad", cands, go, x, w, dev,
                       prec) if work else cands[0]
    prog = build_program(m, g, dtype, prec, dev, parts, dcfg, wcfg)
    if len(memo) >= 1024:
        memo.clear()
    memo[key] = prog
    return prog


def _choose(m: Any, op: str, g: Geometry, dtype: CudaDataType, kind: str,
            cands: List[Dict[str, Any]], go: CudaTensor, x: CudaTensor, w: CudaTensor,
            dev: int, prec: Optional[str]) -> Dict[str, Any]:
    """The autotuner's pick among the candidates, each timed as the whole dgrad or wgrad
    part (its conversions, repack, GEMM and split-K sum) on the call's operands."""
    if len(cands) == 1:
        return cands[0]
    progs: Dict[str, Program] = {}

    def run(cfg: Dict[str, Any]) -> None:
        key = repr(sorted(cfg.items()))
        prog = progs.get(key)
        if prog is None:
            prog = progs[key] = build_program(m, g, dtype, prec, dev, (kind,),
                                              cfg if kind == "dgrad" else None,
                                              cfg if kind == "wgrad" else None)
        for t in prog.run(m, go, x, w, direct=False):
            if t is not None:
                t.free()
    return m.autotuner.pick(op, shape_key(g, dtype, kind), cands, run, device_id=dev)


def make_plan(m: Any, prog: Program) -> Any:
    """The per-call plan of one key (ops/common.py remember_plan): the program run with
    prepared launches when the three operands are live and were last used on the legacy
    default stream (else None: the general path runs)."""
    def plan(go: CudaTensor, x: Any, w: Any) -> Any:
        if type(x) is not CudaTensor or type(w) is not CudaTensor:
            return None
        if go._ptr is None or x._ptr is None or w._ptr is None or go.stream is not None or \
                x.stream is not None or w.stream is not None:
            return None
        return prog.run(m, go, x, w, direct=True)
    return plan
