"""Flash attention: every candidate kernel config timed directly, against PyTorch's
scaled_dot_product_attention in the same process.

    python3 perf/sweep_attention.py [--out sweep_attention.json] [--reps 10]
                                    [--dtypes bfloat16,float16,float32] [--shapes long,short]

Cases: (batch, heads, seq, head_dim) = (4,16,4096,128) ("long") and (4,8,512,64) ("short"),
dtypes bfloat16 / float16 / float32, causal and not. Per case it times every config of
ops.attention's candidate table for that dtype and padded head_dim (launched through
ops.attention.run_config, bypassing the autotuner), on a Hopper GPU for 16-bit types every
config of ops/attention_tma.py and its ALTERNATES (attention_tma.run), the default public
path (ops.attention.flash_attention without out=, so its per-call plan from the second call
on; the first call autotunes and is warm-up) and torch SDPA (TF32 off:
torch.backends.cuda.matmul.allow_tf32 = False, so float32 SDPA is true float32), timed
before and after the variants (the faster of the two is the ratio's base). Every kernel of
the candidate table is compiled first, in parallel threads.

Timing: cuda_backend.performance.timing.DeviceTimer (CUDA events around single calls on the
legacy default stream, which torch also uses, with the L2 flushed before each call; median of
--reps after 3 warm-up calls). Checking: each variant's output, first poisoned with NaN bits,
is compared on sampled (batch, head) slices with a float64 NumPy reference: rel_err =
||out - ref|| / ||ref|| (Frobenius), the largest over the slices; BAD marks one over the
tolerance (1e-2 for 16-bit types, 3e-6 for float32) or a non-finite output.

Columns: variant (hd/bc/nw/wm/q_regs/min_blocks; `*` = the default path's choice), ms,
TFLOP/s (4 B H S^2 D, halved when causal), torch_ms / ms, rel_err, registers per thread and
local (spill) bytes. The summary gives, per case, torch's time, the default path and the
fastest config. --out writes JSON after every case. torch is imported lazily: --help works
without it.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Dict, List, Tuple

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = {"long": (4, 16, 4096, 128), "short": (4, 8, 512, 64)}
# float32: float32-level accuracy at 4096 keys (the kernel sums each key tile in fresh MMA
# accumulators; ~1e-6 modelled, torch ~7.5e-7), as tests/test_flash_attention.py checks.
TOL = {"float32": 3e-6, "float16": 1e-2, "bfloat16": 1e-2}


def cfg_name(cfg: Dict[str, Any]) -> str:
    if cfg.get("tma"):
        return f"tma hd{cfg['hd']} bkv{cfg['bkv']} st{cfg['stages']} pp{cfg.get('pingpong', 1)}"
    return (f"hd{cfg['hd']} bc{cfg['bc']} nw{cfg['nw']} wm{cfg.get('wm', 1)} "
            f"q{int(bool(cfg['q_regs']))} mb{cfg['min_blocks']}")


def slices(B: int, H: int) -> List[Tuple[int, int]]:
    """The (batch, head) slices checked: first, last, and one in the middle."""
    out = [(0, 0), (B - 1, H - 1), (B // 2, H // 2)]
    return list(dict.fromkeys(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--shapes", default="long,short", help="comma-separated subset of long,short")
    args = ap.parse_args()
    t_start = time.perf_counter()

    import pycuda.driver as drv
    import torch
    import torch.nn.functional as F
    from cuda_backend import CudaDataType as DT
    from cuda_backend.cuda_math import get_cuda_math
    from cuda_backend.kernels import dtype_params
    from cuda_backend.ops import attention as fa
    from cuda_backend.ops import attention_tma
    from cuda_backend.ops import common
    from cuda_backend.performance.timing import DeviceTimer
    from cuda_backend.profiling import write_json_atomic

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    m = get_cuda_math()
    b = m.backend
    assert b.is_available, b.fallback_reason
    info = b.get_device_info(0)
    names = {"bfloat16": DT.BFLOAT16, "float16": DT.FLOAT16, "float32": DT.FLOAT32}
    dtypes = [names[n] for n in args.dtypes.split(",")]
    shapes = [SHAPES[n] for n in args.shapes.split(",")]
    tdt = {DT.FLOAT32: torch.float32, DT.FLOAT16: torch.float16, DT.BFLOAT16: torch.bfloat16}

    # Compile every config of every case up front (memoized where run_config finds them).
    jobs = []
    for dt in dtypes:
        for shape in shapes:
            for cfg in fa.configs(dt, fa.padded_head_dim(shape[3])):
                jobs.append((fa.TEMPLATE, {**dtype_params(dt), **cfg}))
    uniq = {(t, tuple(sorted(p.items()))): (t, p) for t, p in jobs}
    t0 = time.perf_counter()
    common.compile_all(m, list(uniq.values()), 0, workers=max(4, min(32, os.cpu_count() or 4)),
                       get=fa._kernel)
    compile_s = time.perf_counter() - t0
    print(f"device {info.name}; torch {torch.__version__}; compiled {len(uniq)} kernels in "
          f"{compile_s:.1f} s", flush=True)

    timer = DeviceTimer(b, 0, flush_l2=True)
    tma_cache: Dict[Any, Any] = {}
    R = max(3, args.reps)

    def median_ms(fn: Any) -> float:
        return timer.median_ms(fn, warmup=3, iterations=R)

    res: Dict[str, Any] = {"device": info.name, "torch": torch.__version__, "reps": R,
                           "compile_s": compile_s, "timing": timer.flush_description(),
                           "torch_tf32": False, "cases": [], "summary": {}}
    print(f"{'case':<34} {'variant':<30} {'ms':>8} {'TF/s':>6} {'xtorch':>6} {'rel_err':>8} "
          f"{'regs':>4} {'lmem':>4}", flush=True)
    rng = np.random.default_rng(0)
    for shape in shapes:
        B, H, S, D = shape
        for dt in dtypes:
            host = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
            q, k, v = (m.from_numpy(a, dtype=dt) for a in host)
            # The reference uses the values as the device holds them (rounded to dt).
            qh, kh, vh = (m.to_numpy(t) for t in (q, k, v))
            tq, tk, tv = (torch.from_numpy(a).cuda().to(tdt[dt]) for a in host)
            out = b.empty(shape, dt, 0)
            sc = 1.0 / math.sqrt(D)
            for causal in (False, True):
                case = f"{dt.name_str} {'causal' if causal else 'full'} {B}x{H}x{S}x{D}"
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                picks = slices(B, H)
                refs = {p: fa.reference(qh[p][None, None], kh[p][None, None],
                                        vh[p][None, None], sc, causal)[0, 0] for p in picks}

                def check(launch: Any) -> float:
                    with b.activate(0):
                        drv.memset_d8(out.ptr, 0xFF, out.nbytes)  # NaN bits in every type
                    launch()
                    got = m.to_numpy(out)
                    worst = 0.0
                    for p, ref in refs.items():
                        o = got[p].astype(np.float64)
                        if not np.isfinite(o).all():
                            return float("inf")
                        worst = max(worst, float(np.linalg.norm(o - ref) / np.linalg.norm(ref)))
                    return worst

                def tfn() -> Any:
                    return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                tref = tfn().float().cpu().numpy()
                torch_err = max(float(np.linalg.norm(tref[p] - r) / np.linalg.norm(r))
                                for p, r in refs.items())
                del tref
                torch_before = median_ms(tfn)
                rows: List[Dict[str, Any]] = []
                variants = []
                for cfg in fa.configs(dt, fa.padded_head_dim(D)):
                    variants.append((cfg_name(cfg), cfg, (lambda cfg=cfg: fa.run_config(
                        m, cfg, q, k, v, out, sc, causal))))
                if attention_tma.usable(info, q, k, v):
                    for cfg in attention_tma.CONFIGS.get(D, []) + \
                            attention_tma.ALTERNATES.get(D, []):
                        variants.append((cfg_name(cfg), cfg, (lambda cfg=cfg: attention_tma.run(
                            m, cfg, q, k, v, out, None, sc, causal, tma_cache))))
                variants.append(("default path", None, lambda: fa.flash_attention(
                    m, q, k, v, None, causal, out=out)))
                for name, cfg, launch in variants:
                    row: Dict[str, Any] = {"case": case, "dtype": dt.name_str, "causal": causal,
                                           "shape": list(shape), "variant": name, "config": cfg}
                    try:
                        launch()  # the default path autotunes here
                        row["rel_err"] = check(launch)
                        if cfg is None:     # the public call: a new result, its plan
                            fa.flash_attention(m, q, k, v, None, causal).free()
                            row["ms"] = timer.median_ms(
                                lambda: fa.flash_attention(m, q, k, v, None, causal),
                                warmup=3, iterations=R, release=lambda o: o.free())
                        else:
                            row["ms"] = median_ms(launch)
                    except Exception as exc:  # report and go on
                        row["error"] = f"{type(exc).__name__}: {exc}"
                        rows.append(row)
                        continue
                    row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
                    row["ok"] = bool(row["rel_err"] <= TOL[dt.name_str])
                    if cfg is not None and not cfg.get("tma"):
                        kern = fa._kernel(m, fa.TEMPLATE, 0, {**dtype_params(dt), **cfg})
                        row["regs"], row["local_bytes"] = kern.num_regs, kern.local_bytes
                    rows.append(row)
                torch_after = median_ms(tfn)
                torch_ms = min(torch_before, torch_after)
                for row in rows:
                    if "ms" in row:
                        row["vs_torch"] = torch_ms / row["ms"]
                key = ("flash_attention", 0, (dt.name_str, fa.padded_head_dim(D), causal,
                                              common.size_bucket(S), common.size_bucket(S),
                                              common.size_bucket(B * H)))
                chosen = m.__dict__.get("_attention_choices", {}).get(key)
                chosen_name = cfg_name(chosen) if chosen else "?"
                rows.append({"case": case, "dtype": dt.name_str, "causal": causal,
                             "shape": list(shape), "variant": "torch SDPA", "ms": torch_ms,
                             "tflops": flops / (torch_ms * 1e-3) / 1e12, "vs_torch": 1.0,
                             "rel_err": torch_err, "before_ms": torch_before,
                             "after_ms": torch_after})
                for row in rows:
                    if "error" in row:
                        print(f"{case:<34} {row['variant']:<30} FAILED {row['error']}",
                              flush=True)
                        continue
                    star = "*" if row["variant"] == chosen_name else " "
                    bad = "" if row.get("ok", True) else "  BAD"
                    print(f"{case:<34}{star}{row['variant']:<30} {row['ms']:8.3f} "
                          f"{row['tflops']:6.1f} {row['vs_torch']:6.2f} {row['rel_err']:8.1e} "
                          f"{row.get('regs', ''):>4} {row.get('local_bytes', ''):>4}{bad}",
                          flush=True)
                good = [r for r in rows if r.get("config") and r.get("ok")]
                best = min(good, key=lambda r: r["ms"]) if good else None
                dflt = next((r for r in rows if r["variant"] == "default path" and "ms" in r),
                            None)
                res["summary"][case] = {
                    "torch_ms": torch_ms, "chosen": chosen_name,
                    "default_ms": dflt["ms"] if dflt else None,
                    "default_vs_torch": dflt["vs_torch"] if dflt else None,
                    "best": best["variant"] if best else None,
                    "best_ms": best["ms"] if best else None,
                    "best_vs_torch": best["vs_torch"] if best else None,
                    "best_tflops": best["tflops"] if best else None}
                res["cases"].extend(rows)
                if args.out:
                    write_json_atomic(args.out, res)
            for t in (q, k, v, out):
                t.free()
            tq = tk = tv = None
            torch.cuda.empty_cache()
    timer.close()
    res["wall_s"] = time.perf_counter() - t_start
    print("\nsummary: torch ms | default path (its choice) ms, x torch | fastest config ms, "
          "x torch, TF/s")
    for case, s in res["summary"].items():
        d = (f"{s['default_ms']:.3f} ms x{s['default_vs_torch']:.2f}"
             if s["default_ms"] else "failed")
        bst = (f"{s['best']:<30} {s['best_ms']:.3f} ms x{s['best_vs_torch']:.2f} "
               f"{s['best_tflops']:.0f} TF/s" if s["best"] else "none correct")
        print(f"{case:<34} torch {s['torch_ms']:.3f} | default ({s['chosen']}) {d} | best {bst}")
    print(f"wall {res['wall_s']:.1f} s")
    if args.out:
        write_json_atomic(args.out, res)


if __name__ == "__main__":
    main()
