"""CudaML compute-bound operations against PyTorch (cuDNN, SDPA) on the same GPU.

    python perf/bench_ml_compute.py [--out results.json] [--quick] [--reps N]

conv2d (true FP32, TF32, bfloat16, depthwise) and flash attention (float32, float16,
bfloat16; causal and not). The peer's TF32 switches are set explicitly for every case
(torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32) and recorded
with it; cudnn.benchmark is on so cuDNN runs its fastest algorithm. Each time is the median
of CUDA-event timings of single calls after warm-up (our first call also autotunes), taken by
the package's timing primitive (cuda_backend/performance/timing.py, no L2 flush, a GPU spin
queued before each start event, for ours and PyTorch's alike). Every
case also checks our output against PyTorch's (norm-wise relative difference). The table is
printed last; --out writes everything as JSON.

`cuda-backend report --preset compute` times the float32 3x3 conv2d and flash attention
(float32, float16, bfloat16; causal and not) against PyTorch; this script keeps TF32, bf16,
depthwise and 1x1 conv2d, and its own shapes.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench_math import gpu_gap


def event_median(timer, fn, reps, warmup=3):
    """Median ms of single calls of fn (ours or torch's: one context, one default stream)
    from the timing primitive; the timer queues gpu_gap before each start event."""
    return timer.median_ms(fn, warmup=warmup, iterations=reps, flush=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="smaller shapes, fewer reps")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from cuda_backend import CudaDataType as DT
    from cuda_backend.cuda_ml import ConvolutionConfig, get_cuda_ml
    from cuda_backend.performance.timing import DeviceTimer

    ml = get_cuda_ml()
    m = ml.math
    b = m.backend
    assert b.is_available, b.fallback_reason
    dev = b.devices[0]
    torch.backends.cudnn.benchmark = True
    timer = DeviceTimer(b, 0, flush_l2=False, gap=gpu_gap)
    reps = 5 if args.quick else args.reps
    rng = np.random.default_rng()
    tdt = {DT.FLOAT32: torch.float32, DT.FLOAT16: torch.float16, DT.BFLOAT16: torch.bfloat16}

    def pair(shape, dtype):
        host = rng.standard_normal(shape).astype(np.float32)
        ours = m.from_numpy(host, dtype=dtype)
        theirs = torch.from_numpy(host).cuda().to(tdt[dtype])
        return ours, theirs

    def set_tf32(on: bool) -> dict:
        torch.backends.cudnn.allow_tf32 = on
        torch.backends.cuda.matmul.allow_tf32 = on
        return {"cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
                "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32}

    def rel_diff(ours, theirs) -> float:
        a = m.to_numpy(ours).astype(np.float64)
        t = theirs.float().cpu().numpy().astype(np.float64)
        return float(np.linalg.norm(a - t) / max(np.linalg.norm(t), 1e-30))

    rows = []

    def record(group, name, shape, flops, ours_fn, torch_fn, tf32, goal, check):
        try:
            out = ours_fn()
            diff = check(out)
            out.free()
            ms = event_median(timer, lambda: ours_fn().free(), reps)
        except Exception as exc:  # report and go on
            print(f"{group} {name} {shape}: FAILED {type(exc).__name__}: {exc}")
            rows.append({"group": group, "case": name, "shape": shape, "error": str(exc)})
            return
        tms = event_median(timer, torch_fn, reps)
        row = {"group": group, "case": name, "shape": shape, "ms": ms, "torch_ms": tms,
               "tflops": flops / (ms * 1e-3) / 1e12, "torch_tflops": flops / (tms * 1e-3) / 1e12,
               "vs_torch": tms / ms, "goal": goal, "torch_tf32": tf32, "max_rel_diff": diff}
        kind, target = goal
        row["meets_goal"] = (tms / ms >= target) if kind == "ratio>=" else (ms / tms <= target)
        rows.append(row)
        print(f"  {group:<5} {name:<22} {shape:<34} ours {ms:8.3f} ms  torch {tms:8.3f} ms  "
              f"x{tms / ms:5.2f}  diff {diff:.2e}", flush=True)

    # -- conv2d ----------------------------------------------------------------------------
    big_n = 8 if args.quick else 32
    conv_cases = [
        ("fp32 3x3", (big_n, 64, 128, 128), (128, 64, 3, 3), 1, 1, DT.FLOAT32, None,
         ("ratio>=", 0.8)),
        ("tf32 3x3", (big_n, 64, 128, 128), (128, 64, 3, 3), 1, 1, DT.FLOAT32, "tf32",
         ("ratio>=", 0.5)),
        ("fp32 3x3 small", (1, 32, 64, 64), (32, 32, 3, 3), 1, 1, DT.FLOAT32, None,
         ("time<=x", 2.0)),
        ("bf16 3x3", (big_n, 64, 128, 128), (128, 64, 3, 3), 1, 1, DT.BFLOAT16, None,
         ("ratio>=", 0.5)),
        ("fp32 depthwise 3x3", (big_n, 64, 128, 128), (64, 1, 3, 3), 1, 64, DT.FLOAT32, None,
         ("ratio>=", 0.5)),
        ("fp32 1x1", (big_n, 256, 32, 32), (256, 256, 1, 1), 0, 1, DT.FLOAT32, None,
         ("ratio>=", 0.5)),
    ]
    print(f"device {dev.name}; torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    for name, xs, ws, pad, groups, dtype, prec, goal in conv_cases:
        tf32 = set_tf32(prec == "tf32")
        x, tx = pair(xs, dtype)
        w, tw = pair(ws, dtype)
        cfg = ConvolutionConfig(ws[2:], padding=pad, groups=groups)
        P = xs[2] + 2 * pad - ws[2] + 1
        Q = xs[3] + 2 * pad - ws[3] + 1
        flops = 2 * xs[0] * ws[0] * P * Q * ws[1] * ws[2] * ws[3]

        def ours(x=x, w=w, cfg=cfg, prec=prec):
            return ml.conv2d(x, w, cfg, precision=prec)

        def theirs(tx=tx, tw=tw, pad=pad, groups=groups):
            return F.conv2d(tx, tw, padding=pad, groups=groups)

        ref = theirs()
        record("conv", name, f"{xs}*{ws}", flops, ours, theirs, tf32, goal,
               lambda out, ref=ref: rel_diff(out, ref))
        x.free(), w.free()
        del tx, tw, ref
        torch.cuda.empty_cache()

    # -- flash attention -------------------------------------------------------------------
    set_tf32(False)
    tf32 = set_tf32(False)
    long_b = 1 if args.quick else 4
    att_shapes = [(long_b, 16, 4096, 128), (4, 8, 512, 64)]
    for dtype in (DT.BFLOAT16, DT.FLOAT16, DT.FLOAT32):
        goal = ("ratio>=", 0.8 if dtype is DT.FLOAT32 else 0.5)
        for shape in att_shapes:
            q, tq = pair(shape, dtype)
            k, tk = pair(shape, dtype)
            v, tv = pair(shape, dtype)
            for causal in (False, True):
                B, H, S, D = shape
                flops = 4 * B * H * S * S * D // (2 if causal else 1)

                def ours(q=q, k=k, v=v, causal=causal):
                    return ml.flash_attention(q, k, v, causal=causal)

                def theirs(tq=tq, tk=tk, tv=tv, causal=causal):
                    return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

                ref = theirs()
                record("attn", f"{dtype.name_str}{' causal' if causal else ''}", str(shape),
                       flops, ours, theirs, tf32, goal, lambda out, ref=ref: rel_diff(out, ref))
                del ref
            q.free(), k.free(), v.free()
            del tq, tk, tv
            torch.cuda.empty_cache()

    res = {"device": dev.name, "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "cudnn_benchmark": True, "reps": reps,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cases": rows}
    print()
    print(f"{'op':<5} {'case':<22} {'shape':<34} {'ours ms':>9} {'torch ms':>9} {'TFLOP/s':>8} "
          f"{'torch':>7} {'x torch':>7} {'goal':>10} {'met':>4} {'peer tf32':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['group']:<5} {r['case']:<22} {r['shape']:<34} FAILED: {r['error'][:60]}")
            continue
        kind, target = r["goal"]
        goal = f">={target}x" if kind == "ratio>=" else f"<={target}x t"
        print(f"{r['group']:<5} {r['case']:<22} {r['shape']:<34} {r['ms']:>9.3f} "
              f"{r['torch_ms']:>9.3f} {r['tflops']:>8.1f} {r['torch_tflops']:>7.1f} "
              f"{r['vs_torch']:>7.2f} {goal:>10} {'yes' if r['meets_goal'] else 'NO':>4} "
              f"{str(r['torch_tf32']['cudnn.allow_tf32']):>9}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
