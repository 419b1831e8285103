"""fused_linear_gelu (one kernel) against our composed kernels and PyTorch, on the GPU.

    python perf/bench_linear.py [--out results.json] [--reps 20] [--shape 8192x4096x4096]
        [--dtypes float32,float16,bfloat16] [--keep-tuning]

For y = GELU_tanh(x Wᵀ + b), x (M, K), W (N, K), b (N,), per dtype (float32 = true FP32):
- fused: `CudaML.fused_linear_gelu(x, W, b)`, one launch (the bias and GELU in the matmul's
  store stage, W read as it is);
- composed: our matrix_multiply with W transposed beforehand (not timed), then the bias add
  and GELU kernels in place: 3 launches, 2 extra passes over y;
- matmul+gelu: the same without the bias add (the issue's "matrix_multiply followed by gelu");
- torch: F.gelu(F.linear(x, W, b), approximate="tanh"), torch.backends.cuda.matmul.allow_tf32
  False (recorded).
Median of --reps CUDA-event samples (bench_matmul.event_times: batches of back-to-back
calls) after warm-up; the autotuners settle on the first call. TFLOP/s counts 2 M N K.
rel_err: norm-wise error of sampled rows of the fused output against float64 torch. Only the
kernels these calls can pick are compiled (in parallel) up front, so a cold run stays well
under a minute on an H200.

`cuda-backend report --preset compute` times fused_linear_gelu and linear against PyTorch at
the report's sizes; this script keeps the composed-kernel comparison and its shapes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_matmul import event_times  # noqa: E402

DTYPES = ["float32", "float16", "bfloat16"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shape", default="8192x4096x4096", help="MxNxK (x is MxK, W is NxK)")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--keep-tuning", action="store_true",
                    help="reuse the autotuner's saved choices (default: tune afresh)")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    import cuda_backend as cb
    from cuda_backend import CudaDataType as DT, CudaTensor
    from cuda_backend.cuda_math import CudaMath
    from cuda_backend.cuda_ml import CudaML
    from cuda_backend.ops import common, elementwise as ew, elementwise_kernels as ewk, matmul as mm

    backend = cb.get_cuda_backend()
    assert backend.is_available, backend.fallback_reason
    backend.set_device(0)
    m = CudaMath(backend)
    if not args.keep_tuning:
        from cuda_backend.autotune import Autotuner
        m._autotuner = Autotuner(backend, path=os.path.join(tempfile.mkdtemp(), "tune.json"))
    ml = CudaML(m)
    torch.cuda.init()
    torch.backends.cuda.matmul.allow_tf32 = False
    M, N, K = (int(v) for v in args.shape.split("x"))
    dtypes = [DT.from_any(d) for d in args.dtypes.split(",") if d]
    tdt = {DT.FLOAT32: torch.float32, DT.FLOAT16: torch.float16, DT.BFLOAT16: torch.bfloat16,
           DT.FLOAT64: torch.float64}

    # Compile what the calls below can launch: the candidates of this shape's class.
    t0 = time.perf_counter()
    p = mm.Plan(1, M, N, K, 0, 0, (M, N))
    cls = mm.shape_class(p, backend.get_device_info(0).multiprocessor_count)
    vw_ok = {d: K % (16 // d.itemsize) == 0 and N % (16 // d.itemsize) == 0 for d in dtypes}
    jobs: List[Any] = []
    for d in dtypes:
        family = mm.family(d, None)[0]
        for cfg in mm.candidates(d, None, cls, vw_ok[d], linear=True):
            t = mm.config_template(cfg, family)
            jobs.append((t, mm.kernel_params(t, d, cfg, vw_ok[d], "bias_gelu")))
        for cfg in mm.candidates(d, None, cls, vw_ok[d]):
            t = mm.config_template(cfg, family)
            jobs.append((t, mm.kernel_params(t, d, cfg, vw_ok[d])))
    common.compile_all(m, jobs, 0, 16, mm.compile_kernel)
    common.compile_all(m, [(ewk.TEMPLATE, ewk.kernel_params(kind, op, d)) for d in dtypes
                           for kind, op in (("broadcast", "add"), ("unary", "gelu"))], 0, 16)
    res: Dict[str, Any] = {
        "device": backend.devices[0].name, "versions": backend.versions(),
        "torch": torch.__version__, "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "M": M, "N": N, "K": K, "shape_class": cls, "compile_s": time.perf_counter() - t0,
        "kernels_compiled": len(jobs) + 2 * len(dtypes), "rows": []}
    print(f"device: {res['device']}; x ({M}, {K}) @ W({N}, {K})ᵀ + b; compiled "
          f"{res['kernels_compiled']} kernels in {res['compile_s']:.1f} s", flush=True)

    def wrap(t: "torch.Tensor", dt: Any) -> CudaTensor:
        return CudaTensor(tuple(t.shape), dt, 0, t.data_ptr(), owner=t)

    flop = 2.0 * M * N * K
    for d in dtypes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=tdt[d], generator=gen)
        w = (torch.randn(N, K, device="cuda", dtype=torch.float32, generator=gen)
             / K ** 0.5).to(tdt[d])
        b = torch.randn(N, device="cuda", dtype=tdt[d], generator=gen)
        wt = w.t().contiguous()
        y = torch.empty(M, N, device="cuda", dtype=tdt[d])
        cx, cw, cb_, cwt, cy = (wrap(t, d) for t in (x, w, b, wt, y))

        def fused() -> None:
            ml.fused_linear_gelu(cx, cw, cb_).free()

        def composed() -> None:
            mm.matmul(m, cx, cwt, out=cy)
            ew.binary(m, "add", cy, cb_, out=cy)
            ew.unary(m, "gelu", cy, out=cy)

        def matmul_gelu() -> None:
            mm.matmul(m, cx, cwt, out=cy)
            ew.unary(m, "gelu", cy, out=cy)

        def theirs() -> None:
            F.gelu(F.linear(x, w, b), approximate="tanh")

        # correctness of the fused kernel (first call: autotunes) on sampled rows, into a
        # NaN-poisoned output
        got = torch.full((M, N), float("nan"), device="cuda", dtype=tdt[d])
        mm.linear(m, cx, cw, cb_, "bias_gelu", out=wrap(got, d))
        torch.cuda.synchronize()
        rows = torch.randperm(M, device="cuda")[:64]
        ref = F.gelu(x[rows].double() @ w.double().t() + b.double(), approximate="tanh")
        err = float((got[rows].double() - ref).norm() / ref.norm().clamp_min(1e-300))
        finite = bool(torch.isfinite(got).all())
        del got
        composed()   # autotunes the plain matmul
        torch.cuda.synchronize()
        t: Dict[str, float] = {}
        for name, fn in (("fused", fused), ("composed", composed),
                         ("matmul_gelu", matmul_gelu), ("torch", theirs)):
            t[name] = statistics.median(event_times(fn, args.reps))
        row = {"dtype": d.name_str, **{f"{k}_ms": v for k, v in t.items()},
               "fused_tflops": flop / t["fused"] / 1e9, "torch_tflops": flop / t["torch"] / 1e9,
               "speedup_vs_composed": t["composed"] / t["fused"],
               "speedup_vs_matmul_gelu": t["matmul_gelu"] / t["fused"],
               "ratio_torch": t["torch"] / t["fused"], "rel_err": err, "finite": finite}
        res["rows"].append(row)
        print(f"{d.name_str:9s} fused {t['fused']:7.3f} ms ({row['fused_tflops']:6.1f} TF/s)  "
              f"composed {t['composed']:7.3f}  matmul+gelu {t['matmul_gelu']:7.3f}  "
              f"torch {t['torch']:7.3f} ms  err {err:.1e}{'' if finite else '  NON-FINITE'}",
              flush=True)

    res["autotune"] = m.autotuner.choices()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=2, default=str)
    print()
    print(f"{'dtype':9s} {'fused ms':>9s} {'TF/s':>7s} {'composed':>9s} {'mm+gelu':>9s} "
          f"{'torch ms':>9s} {'vs comp':>8s} {'vs mm+g':>8s} {'torch/us':>9s} {'rel err':>8s}")
    for r in res["rows"]:
        print(f"{r['dtype']:9s} {r['fused_ms']:9.3f} {r['fused_tflops']:7.1f} "
              f"{r['composed_ms']:9.3f} {r['matmul_gelu_ms']:9.3f} {r['torch_ms']:9.3f} "
              f"{r['speedup_vs_composed']:7.2f}x {r['speedup_vs_matmul_gelu']:7.2f}x "
              f"{r['ratio_torch']:9.2f} {r['rel_err']:8.1e}")
    # the configs the autotuner chose (fused kernel and the plain matmul it is compared with)
    for key, choice in sorted(res["autotune"].items()):
        if "linear_" in key or "matmul_" in key:
            print(f"  {key}: {choice.get('config')} {choice.get('ms', float('nan')):.3f} ms")


if __name__ == "__main__":
    main()
