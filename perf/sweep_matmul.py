"""Matmul: every candidate tile config timed directly, against the default path and PyTorch.

    python3 perf/sweep_matmul.py [--family fp32[,tf32,fp16,bf16]] [--shapes 4096,1000,...]
                                 [--reps 10] [--no-old] [--out sweep_matmul.json]
    python3 perf/sweep_matmul.py --linear [--linear-shape 8192x4096x4096] [--reps 10]
                                 [--out sweep_linear.json]

--linear: the float32 linear layer y = GELU(x Wᵀ + b) (x M x K, W N x K, --linear-shape
MxNxK): every 3xTF32 config (`matmul.LINEAR_MMA_F32X3`, sweep-only) and every float32 SIMT
linear candidate, each through `matmul.run_config` with epilogue="bias_gelu"; the public
`fused_linear_gelu` (autotuned first, outside the timing); `matrix_multiply` (W transposed
beforehand, not timed) + `gelu` (fp32 SIMT, no bias); torch F.gelu(F.linear(x, W, b),
approximate="tanh") with TF32 off. rel_err as below, against float64 GELU(x Wᵀ + b).

For each family and target shape (M x K x N: 4096^3, 8192^3, 1000^3, 8192x64x8192,
64x8192x8192, 1023x1025x997) it times every config of the family's tables (all shape
classes, not only the shape's own: a config of another class may win), for fp32 also the
earlier configs (`SIMT_F32_OLD`, baselines) and the multistage ones outside the tables
(`SIMT_F32_EXTRA`), for tf32 the configs outside the tables (`MMA_TF32_EXTRA`; --no-old
drops them), each launched directly through `matmul.run_config` with the modelled split
count (SIMT), and for shapes where split-K is in play also at other split counts (those the
autotuner tries, `matmul.split_options`, and EXTRA_SPLITS); then the default public path
(`CudaMath.matrix_multiply`, autotuned on its first call, outside the timing) and
`torch.matmul` (TF32 off for fp32, on for tf32), all in the same process.

Timing: `cuda_backend.performance.timing.DeviceTimer` (CUDA events around single calls, an
L2 flush by memset before each, median of --reps after warm-up). Every kernel is compiled
first, in parallel threads. Each output is first poisoned (NaN bits), then checked against a
NumPy float64 reference on sampled rows (64 evenly spaced rows, all rows when M <= 1100):
rel_err = max |out - ref| / max |ref|.

Columns: config (bm x bn x bk, per-thread tm x tn, wtm, qa lane layout, s<stages> for the
multistage loader, min_blocks), split count, ms, TFLOP/s, torch_ms / ms, rel_err, registers
per thread (local bytes if any). `*` marks the (config, split) the default path chose (the
autotuner picks the split too); `!` a split other than the modelled one. Each shape
ends with a summary line: torch, default path, best config, and the goal. --out writes JSON
after every shape. Needs PyCUDA and PyTorch on a GPU machine (torch is imported lazily, so
--help works anywhere).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cuda_backend import CudaDataType as DT  # noqa: E402
from cuda_backend.kernels import dtype_params  # noqa: E402
from cuda_backend.ops import common  # noqa: E402
from cuda_backend.ops import matmul as mm, matmul_configs as mc  # noqa: E402
from cuda_backend.performance.timing import DeviceTimer  # noqa: E402
from cuda_backend.profiling import write_json_atomic  # noqa: E402

SHAPES = {  # name -> (M, K, N)
    "4096": (4096, 4096, 4096), "8192": (8192, 8192, 8192), "1000": (1000, 1000, 1000),
    "8192x64x8192": (8192, 64, 8192), "64x8192x8192": (64, 8192, 8192),
    "1023x1025x997": (1023, 1025, 997)}
FAMILIES = {  # name -> (dtype, precision, rel_err tolerance)
    "fp32": (DT.FLOAT32, None, 1e-4), "tf32": (DT.FLOAT32, "tf32", 1e-2),
    "fp16": (DT.FLOAT16, None, 1e-2), "bf16": (DT.BFLOAT16, None, 5e-2)}
GOALS = {"fp32": {"4096": 0.85, "8192": 0.85}, "tf32": {"4096": 0.5, "8192": 0.5},
         "fp16": {"8192": 0.5}, "bf16": {"8192": 0.5}}
DEFAULT_GOAL = {"fp32": 0.7, "tf32": 0.5, "fp16": 0.5, "bf16": 0.5}
EXTRA_SPLITS = (1, 2, 3, 4, 6, 8)   # also timed where the op's split count is > 1 or could be
SAMPLE_ROWS = 64
HOST_THREADS = max(1, min(16, os.cpu_count() or 1))


def cfg_name(cfg: Dict[str, Any]) -> str:
    if cfg.get("skinny"):
        return f"skinny {cfg['mt']}x{cfg['bn']}x{cfg['bk']} t{cfg['tn']} s{cfg['stages']}"
    if cfg.get("wgmma"):
        return f"wgmma {cfg['bm']}x{cfg['bn']}x32 s{cfg['stages']} b{cfg['min_blocks']}"
    if "tm" in cfg:
        return f"{cfg['bm']}x{cfg['bn']}x{cfg['bk']} t{cfg['tm']}x{cfg['tn']} w{cfg['wtm']} " \
               f"q{cfg['qa']}{' s%d' % cfg['stages'] if cfg.get('stages') else ''} " \
               f"b{cfg['min_blocks']}"
    return f"{cfg['bm']}x{cfg['bn']}x{cfg['bk']} w{cfg['wm']}x{cfg['wn']} s{cfg['stages']}" \
           f"{'' if cfg.get('frag_pipe', True) else ' nopipe'}" \
           f"{' truncA' if cfg.get('tf32_trunc_a') else ''}{' x3' if cfg.get('x3') else ''}" \
           f" b{cfg['min_blocks']}"


def kernel_params(template: str, dtype: DT, cfg: Dict[str, Any], vec: bool) -> Dict[str, Any]:
    if cfg.get("wgmma"):
        return mm.wgmma_params(cfg)
    if template == mm.SIMT_TEMPLATE:
        return mm.simt_params(dtype, cfg, vec)
    return {**dtype_params(dtype), **cfg, "vec": vec}


def host_values(shape: Tuple[int, ...], dtype: DT, seed: int) -> np.ndarray:
    """Uniform [-1, 1) float32 values exactly representable in dtype."""
    a = np.random.default_rng(seed).uniform(-1, 1, size=shape).astype(np.float32)
    if dtype is DT.BFLOAT16:
        from cuda_backend.dtypes import from_bfloat16_bits, to_bfloat16_bits
        a = from_bfloat16_bits(to_bfloat16_bits(a)).reshape(shape).astype(np.float32)
    elif dtype is DT.FLOAT16:
        a = a.astype(np.float16).astype(np.float32)
    return a


def sample_rows(M: int) -> np.ndarray:
    if M <= 1100:
        return np.arange(M)
    return np.unique(np.linspace(0, M - 1, SAMPLE_ROWS).astype(np.int64))


def reference(a: np.ndarray, b: np.ndarray, rows: np.ndarray, prec: Optional[str]) -> np.ndarray:
    """float64 (a[rows] @ b), with TF32-rounded inputs for tf32."""
    ar, bb = a[rows], b
    if prec == "tf32":
        ar, bb = mm.round_tf32(ar), mm.round_tf32(bb)
    bb = bb.astype(np.float64)
    step = -(-len(rows) // HOST_THREADS)
    with ThreadPoolExecutor(HOST_THREADS) as pool:
        parts = list(pool.map(lambda i: ar[i:i + step].astype(np.float64) @ bb,
                              range(0, len(rows), step)))
    return np.concatenate(parts)


def read_rows(m: Any, out: Any, rows: np.ndarray, N: int, dtype: DT) -> np.ndarray:
    """The sampled rows of a (M, N) device tensor, as float64."""
    import pycuda.driver as drv
    raw = np.empty((len(rows), N), np.uint16 if dtype.itemsize == 2 else np.float32)
    with m.backend.activate(0):
        if len(rows) and np.array_equal(rows, np.arange(rows[-1] + 1)):
            drv.memcpy_dtoh(raw, out.ptr)
        else:
            for i, r in enumerate(rows):
                drv.memcpy_dtoh(raw[i], out.ptr + int(r) * N * dtype.itemsize)
    if dtype is DT.BFLOAT16:
        from cuda_backend.dtypes import from_bfloat16_bits
        return from_bfloat16_bits(raw).reshape(raw.shape).astype(np.float64)
    if dtype is DT.FLOAT16:
        return raw.view(np.float16).astype(np.float64)
    return raw.astype(np.float64)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    if not np.isfinite(got).all():
        return float("inf")
    scale = max(float(np.abs(ref).max()), 1e-300)
    return float(np.abs(got - ref).max()) / scale


def family_configs(fam: str, old: bool) -> Tuple[str, List[Dict[str, Any]]]:
    dtype, prec, _ = FAMILIES[fam]
    template, _ = mm.gemm_family(dtype, prec)
    # the 16-bit wgmma and TMA configs launch through their own paths (their kernels are
    # timed by perf/wgmma16_check.py and perf/tma16_check.py, and through matrix_multiply by
    # perf/bench_matmul.py): the sweep times the family template's configs
    cfgs = [c for c in mm.all_configs(dtype, prec) if not (c.get("wgmma16") or c.get("tma16"))]
    extras = {"fp32": ("SIMT_F32_OLD", "SIMT_F32_EXTRA"), "tf32": ("MMA_TF32_EXTRA",)}
    if old:
        for name in extras.get(fam, ()):
            cfgs += [c for c in getattr(mc, name, []) if c not in cfgs]
    return template, cfgs


def usable(cfg: Dict[str, Any], vec: bool) -> bool:
    return vec or cfg in mm.SCALAR_OK   # (wgmma configs are not in SCALAR_OK: vec only)


def linear_sweep(args: Any) -> None:
    """--linear: the float32 linear layer, 3xTF32 and SIMT configs against the public op,
    matmul + gelu and torch (see the module docstring)."""
    import torch
    import torch.nn.functional as F
    from cuda_backend import CudaTensor
    from cuda_backend.cuda_math import get_cuda_math
    from cuda_backend.ops import elementwise as ew, elementwise_kernels as ewk
    from cuda_backend.ops import linear as lin

    t_start = time.perf_counter()
    m = get_cuda_math()
    b = m.backend
    assert b.is_available, b.fallback_reason
    info = b.get_device_info(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    M, N, K = (int(v) for v in args.linear_shape.split("x"))
    dtype = DT.FLOAT32
    R = max(3, args.reps)
    vec = K % 4 == 0 and N % 4 == 0
    x3 = list(mm.LINEAR_MMA_F32X3)
    simt = mm.linear_configs(dtype, "ieee", vec)   # the CUDA-core configs
    cfgs = [(mm.MMA_TEMPLATE, c) for c in x3 if vec or c in mm.SCALAR_OK] + \
        [(mm.SIMT_TEMPLATE, c) for c in simt]
    jobs = [(t, mm.linear_params(t, dtype, c, vec, "bias_gelu")) for t, c in cfgs]
    p_mm = mm.plan_shapes((M, K), (K, N))
    cls = mm.shape_class(p_mm, info.multiprocessor_count)
    for c in mm.candidates(dtype, None, cls, vec):   # matrix_multiply's candidates
        jobs.append((mm.SIMT_TEMPLATE, mm.simt_params(dtype, c, vec)))
    jobs.append((mm.SIMT_TEMPLATE, {"kind": "splitk_reduce", "block_size": mm.REDUCE_BLOCK,
                                    **dtype_params(dtype)}))
    jobs.append((ewk.TEMPLATE, ewk.kernel_params("unary", "gelu", dtype)))
    t0 = time.perf_counter()
    common.compile_all(m, jobs, 0, max(4, min(32, os.cpu_count() or 4)), mm.cached_kernel)
    compile_s = time.perf_counter() - t0
    print(f"device {info.name}: linear x ({M}, {K}) W ({N}, {K}) float32; compiled "
          f"{len(jobs)} kernels in {compile_s:.1f} s", flush=True)

    xh = host_values((M, K), dtype, 1)
    wh = host_values((N, K), dtype, 2) / np.float32(np.sqrt(K))
    bh = host_values((N,), dtype, 3)
    x = torch.from_numpy(xh).cuda()
    w = torch.from_numpy(wh).cuda()
    bias = torch.from_numpy(bh).cuda()
    wt = w.t().contiguous()
    y = torch.empty(M, N, device="cuda", dtype=torch.float32)

    def wrap(t: "torch.Tensor") -> Any:
        return CudaTensor(tuple(t.shape), dtype, 0, t.data_ptr(), owner=t)

    cx, cw, cb, cwt, cy = (wrap(t) for t in (x, w, bias, wt, y))
    rows = sample_rows(M)
    z = reference(xh, wh.T, rows, None) + bh.astype(np.float64)
    ref = mm.gelu_tanh(z)
    p = mm.Plan(1, M, N, K, 0, 0, (M, N))
    flop = 2.0 * M * N * K
    timer = DeviceTimer(b, 0, flush_l2=True)
    torch.cuda.synchronize()

    def med(fn: Any, release: Any = None) -> float:
        kw = {"release": release} if release is not None else {}
        return timer.median_ms(fn, warmup=2, iterations=R, **kw)

    def theirs() -> None:
        F.gelu(F.linear(x, w, bias), approximate="tanh")
    torch_ms = med(theirs)
    res: Dict[str, Any] = {"device": info.name, "torch": torch.__version__, "reps": R,
                           "M": M, "N": N, "K": K, "vec": vec, "compile_s": compile_s,
                           "timing": timer.flush_description(), "torch_ms": torch_ms,
                           "rel_err": "max |out - ref| / max |ref| on sampled rows, NumPy "
                                      "float64 GELU(x W^T + b)", "rows": []}
    print(f"{'variant':<44} {'ms':>9} {'TF/s':>7} {'torch':>6} {'rel_err':>8} {'regs':>4}",
          flush=True)

    def check_and_time(name: str, launch: Any, extra: Dict[str, Any], want: np.ndarray,
                       release: Any = None) -> None:
        row: Dict[str, Any] = {"variant": name, **extra}
        try:
            y.fill_(float("nan"))
            torch.cuda.synchronize()
            launch()
            torch.cuda.synchronize()
            got = y[torch.from_numpy(rows).cuda()].double().cpu().numpy()
            row["rel_err"] = rel_err(got, want)
            row["ms"] = med(launch, release)
            row["tflops"] = flop / (row["ms"] * 1e-3) / 1e12
            row["vs_torch"] = torch_ms / row["ms"]
            regs = str(row.get("regs", ""))
            if row.get("local_bytes"):
                regs += f"+{row['local_bytes']}L"
            bad = "  BAD" if not row["rel_err"] <= FAMILIES["fp32"][2] else ""
            print(f"{name:<44} {row['ms']:9.4f} {row['tflops']:7.1f} {row['vs_torch']:6.2f} "
                  f"{row['rel_err']:8.1e} {regs:>4}{bad}", flush=True)
        except Exception as exc:  # report and go on
            row["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{name:<44} FAILED {row['error']}", flush=True)
        res["rows"].append(row)
        if args.out:
            write_json_atomic(args.out, res)

    for template, cfg in cfgs:
        params = mm.linear_params(template, dtype, cfg, vec, "bias_gelu")
        kern = mm.cached_kernel(m, template, 0, params)
        tag = "x3 " if cfg.get("x3") else "simt "
        check_and_time(tag + cfg_name(cfg), lambda t=template, c=cfg: mm.run_config(
            m, t, c, cx, cw, cy, p, dtype, vec, 0, epilogue="bias_gelu", bias=cb),
            {"config": dict(cfg), "regs": kern.num_regs, "local_bytes": kern.local_bytes},
            ref)
    mm.linear(m, cx, cw, cb, "bias_gelu", out=cy)   # autotunes, outside the timing
    hit = mm.memo(m).get(("linear", p, dtype, None, 0, vec, "bias_gelu"))
    mm.linear(m, cx, cw, cb, "bias_gelu", "ieee", out=cy)
    hit_ieee = mm.memo(m).get(("linear", p, dtype, "ieee", 0, vec, "bias_gelu"))
    res["public_ieee_chosen"] = hit_ieee and cfg_name(hit_ieee[1])
    check_and_time(f"public linear ieee (out=) [{res['public_ieee_chosen']}]",
                   lambda: mm.linear(m, cx, cw, cb, "bias_gelu", "ieee", out=cy), {}, ref)
    res["public_chosen"] = hit and cfg_name(hit[1])
    check_and_time(f"public linear (out=) [{res['public_chosen']}]", lambda: mm.linear(
        m, cx, cw, cb, "bias_gelu", out=cy), {}, ref)
    public_ms = med(lambda: lin.fused_linear_gelu(m, cx, cw, cb), lambda r: r.free())
    print(f"{'public fused_linear_gelu (allocating)':<44} {public_ms:9.4f}", flush=True)
    res["public_ms"] = public_ms

    def mm_gelu() -> None:
        mm.matmul(m, cx, cwt, out=cy)
        ew.unary(m, "gelu", cy, out=cy)
    mm_gelu()   # autotunes the GEMM
    check_and_time("matrix_multiply + gelu (fp32 SIMT, no bias)", mm_gelu, {},
                   mm.gelu_tanh(z - bh.astype(np.float64)))
    ok = [r for r in res["rows"] if "ms" in r and "config" in r]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    res["best"] = best and best["variant"]
    res["wall_s"] = time.perf_counter() - t_start
    print(f"== linear {M}x{N}x{K}: torch {torch_ms:.4f} ms | public {public_ms:.4f} ms | best "
          f"{res['best']} {best['ms'] if best else float('nan'):.4f} ms | wall "
          f"{res['wall_s']:.1f} s", flush=True)
    timer.close()
    if args.out:
        for r in res["rows"]:
            r.pop("config", None)
        write_json_atomic(args.out, res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="fp32", help="comma-separated: fp32,tf32,fp16,bf16")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"comma-separated subset of {','.join(SHAPES)}")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-old", action="store_true",
                    help="skip the configs outside the tables (SIMT_F32_OLD, "
                         "MMA_TF32_EXTRA)")
    ap.add_argument("--no-splits", action="store_true",
                    help="time each SIMT config at the op's split count only")
    ap.add_argument("--linear", action="store_true",
                    help="the float32 linear layer instead: 3xTF32 and SIMT configs, the "
                         "public op, matmul + gelu, torch")
    ap.add_argument("--linear-shape", default="8192x4096x4096", help="MxNxK for --linear")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.linear:
        linear_sweep(args)
        return
    fams = args.family.split(",")
    shapes = args.shapes.split(",")
    for f in fams:
        if f not in FAMILIES:
            ap.error(f"unknown family {f!r}")
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}")
    t_start = time.perf_counter()

    import torch
    from cuda_backend.cuda_math import get_cuda_math

    m = get_cuda_math()
    b = m.backend
    assert b.is_available, b.fallback_reason
    info = b.get_device_info(0)
    sms = info.multiprocessor_count
    max_z = info.max_grid_dims[2]
    R = max(3, args.reps)

    # -- compile every kernel first (aligned, fresh tensors: vec unless N or K forbid it)
    jobs: List[Tuple[str, Dict[str, Any]]] = []
    for fam in fams:
        dtype, prec, _ = FAMILIES[fam]
        template, cfgs = family_configs(fam, not args.no_old)
        vw = 16 // dtype.itemsize
        for s in shapes:
            M, K, N = SHAPES[s]
            vec = K % vw == 0 and N % vw == 0
            jobs += [(mm.config_template(c, template), kernel_params(template, dtype, c, vec))
                     for c in cfgs if usable(c, vec)]
        if template == mm.SIMT_TEMPLATE:
            jobs.append((mm.SIMT_TEMPLATE, {"kind": "splitk_reduce",
                                            "block_size": mm.REDUCE_BLOCK,
                                            **dtype_params(dtype)}))
    unique = {(t, tuple(sorted(p.items()))): (t, p) for t, p in jobs}
    jobs = list(unique.values())
    t0 = time.perf_counter()
    common.compile_all(m, jobs, 0, max(4, min(32, os.cpu_count() or 4)), mm.cached_kernel)
    compile_s = time.perf_counter() - t0
    print(f"device {info.name} ({sms} SMs): compiled {len(jobs)} kernels in {compile_s:.1f} s",
          flush=True)

    timer = DeviceTimer(b, 0, flush_l2=True)
    res: Dict[str, Any] = {"device": info.name, "torch": torch.__version__, "reps": R,
                           "compile_s": compile_s, "timing": timer.flush_description(),
                           "rel_err": "max |out - ref| / max |ref| on sampled rows, "
                                      "NumPy float64", "cases": [], "summary": []}

    def med(fn: Any, release: Any = None) -> float:
        kw = {"release": release} if release is not None else {}
        return timer.median_ms(fn, warmup=2, iterations=R, **kw)

    print(f"{'family':<6} {'shape':<14} {'config':<34} {'split':>5} {'ms':>9} {'TF/s':>7} "
          f"{'torch':>6} {'rel_err':>8} {'regs':>4}", flush=True)
    seed = 0
    for fam in fams:
        dtype, prec, tol = FAMILIES[fam]
        template, cfgs = family_configs(fam, not args.no_old)
        tdt = {DT.FLOAT32: torch.float32, DT.FLOAT16: torch.float16,
               DT.BFLOAT16: torch.bfloat16}[dtype]
        torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
        torch.backends.cudnn.allow_tf32 = prec == "tf32"
        for s in shapes:
            M, K, N = SHAPES[s]
            flop = 2.0 * M * N * K
            seed += 1
            ah, bh = host_values((M, K), dtype, seed), host_values((K, N), dtype, seed + 1000)
            a, bt = m.from_numpy(ah, dtype=dtype), m.from_numpy(bh, dtype=dtype)
            out = b.empty((M, N), dtype, 0)
            p = mm.plan_shapes(a.shape, bt.shape)
            vec = mm.is_vec_ok(a, bt, out, p)
            rows = sample_rows(M)
            ref = reference(ah, bh, rows, prec)
            ta = torch.from_numpy(ah).cuda().to(tdt)
            tb = torch.from_numpy(bh).cuda().to(tdt)
            torch_ms = med(lambda: torch.matmul(ta, tb))
            cls = mm.shape_class(p, sms)
            base = {"family": fam, "shape": f"{M}x{K}x{N}", "class": cls, "vec": vec}
            rows_out: List[Dict[str, Any]] = []

            def check_and_time(name: str, launch: Any, extra: Dict[str, Any],
                               release: Any = None) -> Dict[str, Any]:
                row = dict(base, variant=name, **extra)
                try:
                    with b.activate(0):
                        import pycuda.driver as drv
                        drv.memset_d8(out.ptr, 0xFF, out.nbytes)   # NaN bits
                    launch()
                    row["rel_err"] = rel_err(read_rows(m, out, rows, N, dtype), ref)
                    row["ms"] = med(launch, release)
                    row["tflops"] = flop / (row["ms"] * 1e-3) / 1e12
                    row["vs_torch"] = torch_ms / row["ms"]
                except Exception as exc:  # report and go on
                    row["error"] = f"{type(exc).__name__}: {exc}"
                show(row)
                rows_out.append(row)
                return row

            def show(row: Dict[str, Any]) -> None:
                mark = "*" if row.get("chosen") else ("!" if row.get("other_split") else " ")
                head = f"{fam:<6} {base['shape']:<14}{mark}{row['variant']:<34} " \
                       f"{row.get('split', ''):>5}"
                if "error" in row:
                    print(f"{head} FAILED {row['error']}", flush=True)
                    return
                bad = "  BAD" if not row["rel_err"] <= tol else ""
                regs = row.get("regs", "")
                if row.get("local_bytes"):
                    regs = f"{regs}+{row['local_bytes']}L"
                print(f"{head} {row['ms']:9.4f} {row['tflops']:7.1f} {row['vs_torch']:6.2f} "
                      f"{row['rel_err']:8.1e} {regs:>4}{bad}", flush=True)

            # the default path first: its autotuning happens here, outside the timing
            def default_launch() -> None:
                mm.matmul(m, a, bt, prec, out=out)
            default_launch()
            hit = mm.memo(m).get((p, dtype, prec, 0, vec))
            chosen = dict(hit[1]) if hit else None
            chosen_split = chosen.pop("split", None) if chosen else None
            check_and_time("default path (matmul, out=)", default_launch, {})
            # the public call allocates its result (pool) each time; checked above via out=
            public_ms = med(lambda: m.matrix_multiply(a, bt, prec), lambda r: r.free())
            for cfg in cfgs:
                if not usable(cfg, vec):
                    continue
                params = kernel_params(template, dtype, cfg, vec)
                kern = mm.cached_kernel(m, mm.config_template(cfg, template), 0, params)
                extra = {"config": cfg, "regs": kern.num_regs, "local_bytes": kern.local_bytes,
                         "chosen": cfg == chosen}
                if template != mm.SIMT_TEMPLATE:
                    check_and_time(cfg_name(cfg), lambda cfg=cfg: mm.run_config(
                        m, mm.config_template(cfg, template), cfg, a, bt, out, p, dtype, vec,
                        0), extra)
                    continue
                op_split = mm.split_count(cfg, p, sms, max_z,
                                          mm.blocks_per_sm(cfg, kern.num_regs)) \
                    if hasattr(mm, "blocks_per_sm") else mm.split_count(cfg, p, sms, max_z)
                splits = [op_split]
                if not args.no_splits:
                    tuned = mm.split_options(cfg, p, cls, sms, max_z,
                                             mm.blocks_per_sm(cfg, kern.num_regs)) \
                        if hasattr(mm, "split_options") else []
                    more = list(tuned)
                    if K >= 512 and p.batch * -(-M // cfg["bm"]) * -(-N // cfg["bn"]) < 4 * sms:
                        more += [s_ for s_ in EXTRA_SPLITS if s_ <= max(1, K // 256)]
                    for s_ in more:
                        if all(mm.effective_split(cfg, K, s_) != mm.effective_split(cfg, K, t)
                               for t in splits):
                            splits.append(s_)
                if extra["chosen"] and chosen_split and all(
                        mm.effective_split(cfg, K, chosen_split) != mm.effective_split(cfg, K, t)
                        for t in splits):
                    splits.append(chosen_split)
                for sp in splits:
                    is_chosen = extra["chosen"] and (chosen_split is None or mm.effective_split(
                        cfg, K, sp) == mm.effective_split(cfg, K, chosen_split))
                    check_and_time(cfg_name(cfg), lambda cfg=cfg, sp=sp: mm.run_config(
                        m, template, cfg, a, bt, out, p, dtype, vec, 0, splits=sp),
                        dict(extra, split=sp, other_split=sp != op_split, chosen=is_chosen))
            ok = [r for r in rows_out if "ms" in r]
            cands = [r for r in ok if "config" in r]
            best = min(cands, key=lambda r: r["ms"]) if cands else None
            best_op = min((r for r in cands if not r.get("other_split")),
                          key=lambda r: r["ms"], default=None)
            dflt = next((r for r in ok if r["variant"].startswith("default path (matmul")),
                        None)
            goal = GOALS.get(fam, {}).get(s, DEFAULT_GOAL[fam])
            summ = {"family": fam, "shape": base["shape"], "class": cls, "vec": vec,
                    "torch_ms": torch_ms, "torch_tflops": flop / (torch_ms * 1e-3) / 1e12,
                    "goal": goal,
                    "default_ms": dflt and dflt["ms"], "default_vs_torch": dflt and
                    dflt["vs_torch"], "public_ms": public_ms,
                    "chosen": chosen and (cfg_name(chosen) + (
                        f" split {chosen_split}" if chosen_split else "")),
                    "best": best and f"{best['variant']} split {best.get('split', '-')}",
                    "best_ms": best and best["ms"], "best_vs_torch": best and best["vs_torch"],
                    "best_at_op_split": best_op and
                    f"{best_op['variant']} split {best_op.get('split', '-')}",
                    "max_rel_err": max((r["rel_err"] for r in ok), default=None)}
            for r in rows_out:
                r.pop("config", None)
            res["cases"].extend(rows_out)
            res["summary"].append(summ)
            print(f"== {fam} {base['shape']} ({cls}, vec={int(vec)}): torch {torch_ms:.4f} ms "
                  f"({summ['torch_tflops']:.1f} TF/s) | default "
                  f"{summ['default_ms'] or float('nan'):.4f} ms x{summ['default_vs_torch'] or 0:.2f}"
                  f" [{summ['chosen']}] public {summ['public_ms'] or float('nan'):.4f} ms | best "
                  f"{summ['best']} {summ['best_ms'] or float('nan'):.4f} ms "
                  f"x{summ['best_vs_torch'] or 0:.2f} | goal x{goal} | max rel_err "
                  f"{summ['max_rel_err'] if summ['max_rel_err'] is not None else float('nan'):.1e}",
                  flush=True)
            for t in (a, bt, out):
                t.free()
            ta = tb = None
            torch.cuda.empty_cache()
            if args.out:
                write_json_atomic(args.out, res)
    timer.close()
    res["wall_s"] = time.perf_counter() - t_start
    print(f"wall {res['wall_s']:.1f} s")
    if args.out:
        write_json_atomic(args.out, res)


if __name__ == "__main__":
    main()
