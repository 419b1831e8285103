"""Skinny-M float32 GEMMs (the batch-32 MLP): every candidate the autotuner times, the public
ops and PyTorch, on the GPU.

    python3 perf/bench_skinny.py [--reps 20] [--cases linear:32x4096x1024,matmul:32x4096x1024]
                                 [--every-cluster] [--out skinny.json]

Cases: linear MxNxK is y = GELU(x Wᵀ + b), x (M, K), W (N, K); matmul MxKxN is (M, K) @ (K, N).
Default: linear 32x4096x1024 (the MLP's first layer), 32x1024x4096, 32x1024x1024; matmul
32x4096x1024 (the MLP's second layer), 32x1024x4096, 32x1024x1024. Per case, each candidate
of the float32 default path as `_launch` builds the list (linear: 3xTF32 and SIMT one-kernel
configs, then the skinny split-K ones, `matmul.skinny_candidates`; matmul: the SIMT
(config, split) pairs, then the skinny ones; both then, on sm_90+, the one-launch cluster
configs, `matmul.cluster_candidates`, or with --every-cluster every config of
`matmul.CLUSTER_F32`, to check the split counts the candidates keep) runs through
`matmul.run_config` into a NaN-poisoned output, is checked against float64 torch (rel_err =
max |out - ref| / max |ref|, every row), and timed: `cold` = median of CUDA-event samples
with the L2 flushed before each (the autotuner's timing: W comes from DRAM), `warm` =
back-to-back calls (no flush; W may sit in L2). Then the public op (autotuned on a first
call outside the timing; `*` marks the config it chose) allocating its result, and torch
(TF32 off), both cold and warm; finally the MLP forward (fused_linear_gelu 1024 -> 4096 + b,
matrix_multiply @ (4096, 1024), softmax) against torch's, warm. Floors printed per case:
weight bytes / 3.35 TB/s and 2 M N K / 67 TFLOP/s (H100 SXM FP32). Needs PyCUDA and
PyTorch on a GPU (torch imported lazily).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DEFAULT_CASES = ("linear:32x4096x1024,linear:32x1024x4096,linear:32x1024x1024,"
                 "matmul:32x4096x1024,matmul:32x1024x4096,matmul:32x1024x1024")


def label(cfg: Dict[str, Any]) -> str:
    """A short name for any matmul config (cluster, skinny, SIMT, mma / 3xTF32, wgmma)."""
    split = f" split {cfg['split']}" if "split" in cfg else ""
    if cfg.get("cluster"):
        return f"cluster 32x{cfg['bn']}x{cfg['bk']} {cfg['tr']}x{cfg['tc']} kw{cfg['kw']} " \
               f"s{cfg['stages']} splits {cfg['splits']}"
    if cfg.get("skinny"):
        return f"skinny {cfg['mt']}x{cfg['bn']}x{cfg['bk']} t{cfg['tn']} s{cfg['stages']}{split}"
    if "tm" in cfg:
        return f"simt {cfg['bm']}x{cfg['bn']}x{cfg['bk']} t{cfg['tm']}x{cfg['tn']}" \
               f"{' s%d' % cfg['stages'] if cfg.get('stages') else ''}{split}"
    if cfg.get("wgmma"):
        return f"wgmma {cfg['bm']}x{cfg['bn']} s{cfg['stages']}"
    return f"{'x3' if cfg.get('x3') else 'mma'} {cfg['bm']}x{cfg['bn']}x{cfg['bk']} " \
           f"w{cfg['wm']}x{cfg['wn']} s{cfg['stages']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--every-cluster", action="store_true",
                    help="time every cluster config (all split counts), not only the "
                         "candidates the autotuner gets")
    ap.add_argument("--out")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    import cuda_backend as cb
    from cuda_backend import CudaDataType as DT, CudaTensor
    from cuda_backend.autotune import Autotuner
    from cuda_backend.cuda_math import CudaMath
    from cuda_backend.cuda_ml import CudaML
    from cuda_backend.ops import linear as lin
    from cuda_backend.ops import matmul as mm
    from cuda_backend.performance.timing import DeviceTimer
    from cuda_backend.profiling import write_json_atomic

    backend = cb.get_cuda_backend()
    assert backend.is_available, backend.fallback_reason
    backend.set_device(0)
    m = CudaMath(backend)
    m._autotuner = Autotuner(backend, path=os.path.join(tempfile.mkdtemp(), "tune.json"))
    ml = CudaML(m)
    torch.cuda.init()
    torch.backends.cuda.matmul.allow_tf32 = False
    info = backend.get_device_info(0)
    sms, max_y, max_z = info.multiprocessor_count, info.max_grid_dims[1], info.max_grid_dims[2]
    t0 = time.perf_counter()
    n_compiled = mm.warm_up(m, 0, workers=16, dtypes=(DT.FLOAT32,))
    print(f"device {info.name} ({sms} SMs): compiled {n_compiled} float32 matmul kernels in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    cold = DeviceTimer(backend, 0, flush_l2=True)
    warm = DeviceTimer(backend, 0, flush_l2=False)
    R = max(3, args.reps)

    def times(fn: Any, release: Any = None) -> Dict[str, float]:
        kw = {"release": release} if release is not None else {}
        c = cold.median_ms(fn, warmup=2, iterations=R, **kw)
        samples = warm.time(fn, warmup=3, iterations=R, flush=False, calls=20, **kw)
        return {"cold_ms": c, "warm_ms": statistics.median(samples)}

    def wrap(t: "torch.Tensor") -> CudaTensor:
        return CudaTensor(tuple(t.shape), DT.FLOAT32, 0, t.data_ptr(), owner=t)

    res: Dict[str, Any] = {"device": info.name, "torch": torch.__version__, "reps": R,
                           "timing": {"cold": cold.flush_description(),
                                      "warm": "back to back, 20 calls per sample"},
                           "cases": []}
    print(f"{'case':<22} {'variant':<40} {'cold ms':>9} {'warm ms':>9} {'vs torch':>8} "
          f"{'rel_err':>8}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in args.cases.split(","):
        kind, dims = case.split(":")
        if kind == "linear":
            M, N, K = (int(v) for v in dims.split("x"))
            x = torch.randn(M, K, device="cuda", generator=gen)
            w = torch.randn(N, K, device="cuda", generator=gen) / K ** 0.5
            bias = torch.randn(N, device="cuda", generator=gen)
            ref = F.gelu(x.double() @ w.double().t() + bias.double(), approximate="tanh")
            theirs = lambda: F.gelu(F.linear(x, w, bias), approximate="tanh")  # noqa: E731
        else:
            M, K, N = (int(v) for v in dims.split("x"))
            x = torch.randn(M, K, device="cuda", generator=gen)
            w = torch.randn(K, N, device="cuda", generator=gen) / K ** 0.5
            bias = None
            ref = x.double() @ w.double()
            theirs = lambda: torch.matmul(x, w)  # noqa: E731
        y = torch.empty(M, N, device="cuda")
        cx, cw, cy = wrap(x), wrap(w), wrap(y)
        cb_ = None if bias is None else wrap(bias)
        p = mm.Plan(1, M, N, K, 0, 0, (M, N))
        vec = mm.is_vec_ok(cx, cw, cy, p)
        cls = mm.shape_class(p, sms)
        family, _ = mm.gemm_family(DT.FLOAT32, None)
        if kind == "linear":
            cands = mm.candidates(DT.FLOAT32, None, cls, vec, linear=True)
        else:
            def per_sm(c: Dict[str, Any]) -> int:
                k = mm.cached_kernel(m, mm.SIMT_TEMPLATE, 0, mm.simt_params(DT.FLOAT32, c, vec))
                return mm.blocks_per_sm(c, k.num_regs, info, 4, k.static_shared_bytes)
            cands = mm.split_candidates(mm.candidates(DT.FLOAT32, None, cls, vec), p, cls,
                                        sms, max_z, per_sm)
        cands = cands + mm.skinny_candidates(DT.FLOAT32, None, p, sms, max_y)
        cc = tuple(info.compute_capability)
        if args.every_cluster and mm.has_clusters(info):
            cands = cands + mm.cluster_configs(vec)
        else:
            cands = cands + mm.cluster_candidates(DT.FLOAT32, None, p, sms, cc, vec)
        wbytes = w.numel() * 4
        floor_mem = wbytes / 3.35e12 * 1e3
        floor_fma = 2.0 * M * N * K / 67e12 * 1e3
        t_torch = times(theirs)
        entry: Dict[str, Any] = {"case": case, "class": cls, "vec": vec, "torch": t_torch,
                                 "floor_ms": {"weight_bytes": floor_mem, "fp32_flops": floor_fma},
                                 "configs": []}
        name = f"{kind} {dims}"
        print(f"{name:<22} floors: weight {wbytes / 2**20:.0f} MiB {floor_mem * 1e3:.1f} us, "
              f"FP32 {floor_fma * 1e3:.1f} us; class {cls}, vec {vec}", flush=True)

        def show(variant: str, t: Dict[str, float], err: Any = None) -> None:
            e = "" if err is None else f"{err:8.1e}"
            print(f"{'':<22} {variant:<40} {t['cold_ms']:9.4f} {t['warm_ms']:9.4f} "
                  f"{t_torch['cold_ms'] / t['cold_ms']:8.2f} {e}", flush=True)

        def run_cfg(c: Dict[str, Any]) -> None:
            if kind == "linear":
                mm.run_config(m, mm.config_template(c, family), c, cx, cw, cy, p, DT.FLOAT32,
                              vec, 0, epilogue="bias_gelu", bias=cb_)
            else:
                mm.run_config(m, mm.config_template(c, family), c, cx, cw, cy, p, DT.FLOAT32,
                              vec, 0)

        # the public op first: it autotunes over the same candidates (outside the timing)
        if kind == "linear":
            mm.linear(m, cx, cw, cb_, "bias_gelu", out=cy)
            hit = mm.memo(m).get(("linear", p, DT.FLOAT32, None, 0, vec, "bias_gelu"))
            public = lambda: lin.fused_linear_gelu(m, cx, cw, cb_)  # noqa: E731
        else:
            mm.matmul(m, cx, cw, out=cy)
            hit = mm.memo(m).get((p, DT.FLOAT32, None, 0, vec))
            public = lambda: m.matrix_multiply(cx, cw)  # noqa: E731
        chosen = hit[1] if hit else None
        for c in cands:
            row: Dict[str, Any] = {"variant": label(c), "chosen": c == chosen}
            try:
                y.fill_(float("nan"))
                run_cfg(c)
                torch.cuda.synchronize()
                row["rel_err"] = float((y.double() - ref).abs().max() / ref.abs().max())
                row.update(times(lambda c=c: run_cfg(c)))
                show(("* " if row["chosen"] else "  ") + row["variant"], row, row["rel_err"])
            except Exception as exc:  # report and go on
                row["error"] = f"{type(exc).__name__}: {exc}"
                print(f"{'':<22}   {row['variant']:<40} FAILED {row['error']}", flush=True)
            entry["configs"].append(row)
        entry["public"] = times(public, lambda r: r.free())
        entry["chosen"] = chosen and label(chosen)
        show(f"public {kind} [{entry['chosen']}]", entry["public"])
        show("torch", t_torch)
        res["cases"].append(entry)
        if args.out:
            write_json_atomic(args.out, res)

    # the MLP forward of perf/bench_host_path.py (warm: back to back)
    x = torch.randn(32, 1024, device="cuda", generator=gen)
    w1 = torch.randn(4096, 1024, device="cuda", generator=gen) / 32.0
    b1 = torch.randn(4096, device="cuda", generator=gen)
    w2 = torch.randn(4096, 1024, device="cuda", generator=gen) / 64.0
    cx, cw1, cb1, cw2 = wrap(x), wrap(w1), wrap(b1), wrap(w2)

    def mlp_ours() -> Any:
        h = ml.fused_linear_gelu(cx, cw1, cb1)
        y2 = m.matrix_multiply(h, cw2)
        h.free()
        out = m.softmax(y2)
        y2.free()
        return out

    def mlp_torch() -> Any:
        return torch.softmax(F.gelu(F.linear(x, w1, b1), approximate="tanh") @ w2, dim=-1)
    mlp_ours().free()
    ref = torch.softmax(F.gelu(x.double() @ w1.double().t() + b1.double(),
                               approximate="tanh") @ w2.double(), dim=-1)
    got = mlp_ours()
    err = float((torch.from_numpy(m.to_numpy(got)).cuda().double() - ref).abs().max()
                / ref.abs().max())
    got.free()
    ours_t, torch_t = times(mlp_ours, lambda r: r.free()), times(mlp_torch)
    res["mlp"] = {"ours": ours_t, "torch": torch_t, "rel_err": err}
    print(f"{'MLP forward':<22} {'ours (cold / warm)':<40} {ours_t['cold_ms']:9.4f} "
          f"{ours_t['warm_ms']:9.4f} {torch_t['warm_ms'] / ours_t['warm_ms']:8.2f} {err:8.1e}")
    print(f"{'':<22} {'torch':<40} {torch_t['cold_ms']:9.4f} {torch_t['warm_ms']:9.4f}")
    cold.close()
    warm.close()
    if args.out:
        write_json_atomic(args.out, res)


if __name__ == "__main__":
    main()
