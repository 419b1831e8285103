"""CudaML memory-bound operations (pooling, batch/layer norm, dropout, optimizer steps) against
PyTorch and the device's copy bandwidth.

    python perf/bench_ml.py [--out results.json] [--quick] [--reps N]

One run measures the device-to-device copy bandwidth (bytes read + written, a 2 GiB copy),
then for each case our median time and PyTorch's (the package's timing primitive,
cuda_backend/performance/timing.py: CUDA events around single calls after warm-up; before
each timed call a 256 MiB memset and a GPU spin are queued, which evict the inputs from the
50-60 MB L2 and keeps the GPU busy while Python enqueues the call, so the interval is GPU
time), the GB/s for the bytes the operation must move (listed per case: e.g. batch_norm
training reads its input twice), the fraction of copy bandwidth, and torch_ms / our_ms (> 1:
we are faster). PyTorch's TF32 switches are set explicitly (off: these operations do no
matmul, but the settings are recorded with the results). Each case also compares our output
with PyTorch's (norm-wise relative difference; dropout: kept fraction). The table is printed
last; --out writes everything as JSON.

`cuda-backend report --preset bandwidth` also times the 2x2 poolings, inference batch norm,
layer norm, dropout and the Adam and SGD steps against PyTorch (at s = 128); this script keeps
max pooling 3x3 s2 p1, training batch norm, AdamW, dropout with its mask and its own sizes.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from bench_math import gpu_gap

FLUSH_BYTES = 256 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from cuda_backend import CudaDataType as DT
    from cuda_backend.cuda_ml import OptimizerState, get_cuda_ml
    from cuda_backend.performance.timing import DeviceTimer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    ml = get_cuda_ml()
    m = ml.math
    b = m.backend
    assert b.is_available, b.fallback_reason
    dev = b.devices[0]
    R = args.reps
    # ours and torch's calls alike (one context, one default stream): a >= 256 MiB memset,
    # then gpu_gap, before each timed call
    timer = DeviceTimer(b, 0, flush_l2=True, min_flush_bytes=FLUSH_BYTES, gap=gpu_gap)

    def median_ms(fn, warmup=3):
        return timer.median_ms(fn, warmup=warmup, iterations=R)

    # copy bandwidth (bytes read + written), through the backend's dtod copy and torch's
    nbytes = 1 << 31
    src, dst = b.allocate_memory(nbytes), b.allocate_memory(nbytes)
    copy_ms = median_ms(lambda: b.copy_device_to_device(dst, src, nbytes))
    b.free_memory(src), b.free_memory(dst)
    tsrc = torch.empty(nbytes // 4, device="cuda")
    tdst = torch.empty_like(tsrc)
    tcopy_ms = median_ms(lambda: tdst.copy_(tsrc))
    tsrc = tdst = None  # give the 4 GiB back to torch's cache
    copy_gbps = 2 * nbytes / (copy_ms * 1e-3) / 1e9
    res = {"device": dev.name, "copy_gbps": copy_gbps,
           "torch_copy_gbps": 2 * nbytes / (tcopy_ms * 1e-3) / 1e9,
           "torch": torch.__version__,
           "torch_settings": {"cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                              "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
                              "cudnn.benchmark": torch.backends.cudnn.benchmark,
                              "cudnn.version": torch.backends.cudnn.version()},
           "timing": "CUDA-event median of single calls, 256 MiB memset queued before each",
           "cases": []}
    print(f"device {dev.name}: copy bandwidth {copy_gbps:.0f} GB/s (torch copy_ "
          f"{res['torch_copy_gbps']:.0f} GB/s); torch {torch.__version__} "
          f"{res['torch_settings']}")

    rng = np.random.default_rng()

    def pair(shape, dtype=np.float32, scale=1.0, offset=0.0):
        a = (rng.standard_normal(shape) * scale + offset).astype(dtype)
        return m.from_numpy(a), torch.from_numpy(a).cuda()

    def rel(ours, theirs):
        o = m.to_numpy(ours).astype(np.float64).ravel()
        t = theirs.detach().float().cpu().numpy().astype(np.float64).ravel()
        return float(np.linalg.norm(o - t) / max(np.linalg.norm(t), 1e-300))

    cases = []  # (op, shape, ours, theirs, bytes moved, check -> str)

    # -- pooling ------------------------------------------------------------------------
    img = (8, 64, 128, 128) if args.quick else (32, 64, 128, 128)
    x, tx = pair(img)
    n_img = int(np.prod(img))
    for kind in ("max", "avg"):
        ours = (lambda kind=kind: ml.max_pool2d(x, (2, 2)) if kind == "max"
                else ml.avg_pool2d(x, (2, 2)))
        theirs = (lambda kind=kind: F.max_pool2d(tx, 2) if kind == "max"
                  else F.avg_pool2d(tx, 2))
        cases.append((f"{kind}_pool2d 2x2", "x".join(map(str, img)), ours, theirs,
                      4 * (n_img + n_img // 4), lambda o, t: f"rel {rel(o, t):.1e}"))
    img3 = (8, 64, 112, 112) if args.quick else (32, 64, 112, 112)
    x3, tx3 = pair(img3)
    n3 = int(np.prod(img3))
    cases.append(("max_pool2d 3x3 s2 p1", "x".join(map(str, img3)),
                  lambda: ml.max_pool2d(x3, 3, 2, 1), lambda: F.max_pool2d(tx3, 3, 2, 1),
                  4 * (n3 + n3 // 4), lambda o, t: f"rel {rel(o, t):.1e}"))

    # -- normalization ---------------------------------------------------------------------
    rows, cols = (2048, 4096) if args.quick else (8192, 4096)
    for shape in [(rows, cols), img]:
        C = shape[1]
        xb, txb = pair(shape, offset=0.5)
        g, tg = pair((C,), scale=0.5, offset=1.0)
        be, tbe = pair((C,))
        mu, tmu = pair((C,), scale=0.1)
        va = np.abs(rng.standard_normal(C).astype(np.float32)) + 0.5
        var, tvar = m.from_numpy(va), torch.from_numpy(va).cuda()
        n = int(np.prod(shape))
        label = "x".join(map(str, shape))
        cases.append(("batch_norm infer", label,
                      lambda xb=xb, g=g, be=be, mu=mu, var=var: ml.batch_norm(xb, g, be, mu, var),
                      lambda txb=txb, tg=tg, tbe=tbe, tmu=tmu, tvar=tvar: F.batch_norm(
                          txb, tmu, tvar, tg, tbe, training=False, eps=1e-5),
                      8 * n, lambda o, t: f"rel {rel(o, t):.1e}"))
        # training: statistics read + normalize read + write (running stats drift, harmless)
        cases.append(("batch_norm train", label,
                      lambda xb=xb, g=g, be=be, mu=mu, var=var: ml.batch_norm(
                          xb, g, be, mu, var, training=True, momentum=0.1),
                      lambda txb=txb, tg=tg, tbe=tbe, tmu=tmu, tvar=tvar: F.batch_norm(
                          txb, tmu, tvar, tg, tbe, training=True, momentum=0.1, eps=1e-5),
                      12 * n, lambda o, t: f"rel {rel(o, t):.1e}"))
    for (r, c), dt, tdt in [((rows, cols), np.float32, None), ((rows * 8, cols // 4),
                                                                np.float32, None),
                            ((rows, cols), np.float32, torch.bfloat16)]:
        if tdt is None:
            xl, txl = pair((r, c), offset=0.3)
            w, tw = pair((c,), offset=1.0)
            bb, tbb = pair((c,))
            item = 4
        else:
            a = rng.standard_normal((r, c)).astype(np.float32)
            xl, txl = m.from_numpy(a, dtype=DT.BFLOAT16), torch.from_numpy(a).cuda().to(tdt)
            wa = rng.standard_normal(c).astype(np.float32) + 1
            w, tw = m.from_numpy(wa, dtype=DT.BFLOAT16), torch.from_numpy(wa).cuda().to(tdt)
            ba = rng.standard_normal(c).astype(np.float32)
            bb, tbb = m.from_numpy(ba, dtype=DT.BFLOAT16), torch.from_numpy(ba).cuda().to(tdt)
            item = 2
        cases.append((f"layer_norm {'bf16' if tdt is not None else 'f32'}", f"{r}x{c}",
                      lambda xl=xl, w=w, bb=bb: ml.layer_norm(xl, w, bb),
                      lambda txl=txl, tw=tw, tbb=tbb, c=c: F.layer_norm(txl, (c,), tw, tbb, 1e-5),
                      2 * item * r * c, lambda o, t: f"rel {rel(o, t):.1e}"))

    # -- dropout ---------------------------------------------------------------------------
    nd = 1 << (24 if args.quick else 28)
    xd, txd = pair((nd,))
    keep_check = (lambda o, t: f"kept {float((m.to_numpy(o) != 0).mean()):.4f} vs torch "
                  f"{float((t != 0).float().mean().item()):.4f}")
    cases.append(("dropout keep 0.5", f"{nd}", lambda: ml.dropout(xd, 0.5, seed=1234),
                  lambda: F.dropout(txd, 0.5, training=True), 8 * nd, keep_check))
    def dropout_with_mask():
        y, mask = ml.dropout(xd, 0.5, seed=1234, return_mask=True)
        mask.free()
        return y

    cases.append(("dropout +mask", f"{nd}", dropout_with_mask,
                  lambda: F.dropout(txd, 0.5, training=True), 9 * nd, keep_check))

    # -- optimizers (in place) -------------------------------------------------------------
    npar = 1 << (22 if args.quick else 26)
    p0 = rng.standard_normal(npar).astype(np.float32)
    g0 = (rng.standard_normal(npar) * 0.1).astype(np.float32)
    optim_cases = []
    for name, kind in [("adam_update", "adam"), ("adamw_update", "adamw"),
                       ("sgd_update momentum", "sgd")]:
        p, gr = m.from_numpy(p0), m.from_numpy(g0)
        tp = torch.nn.Parameter(torch.from_numpy(p0).cuda())
        tp.grad = torch.from_numpy(g0).cuda()
        if kind == "sgd":
            buf = m.from_numpy(np.zeros(npar, np.float32))
            state = OptimizerState(learning_rate=1e-3, momentum=0.9)
            try:
                topt = torch.optim.SGD([tp], lr=1e-3, momentum=0.9, fused=True)
            except (TypeError, RuntimeError):
                topt = torch.optim.SGD([tp], lr=1e-3, momentum=0.9, foreach=True)
            ours = (lambda p=p, gr=gr, buf=buf, state=state: ml.sgd_update(p, gr, buf, state))
            moved = 20 * npar  # read p, g, buf; write p, buf
        else:
            mb = m.from_numpy(np.zeros(npar, np.float32))
            vb = m.from_numpy(np.zeros(npar, np.float32))
            wd = 0.01 if kind == "adamw" else 0.0
            state = OptimizerState(learning_rate=1e-3, weight_decay=wd,
                                   decoupled=kind == "adamw")
            cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
            topt = cls([tp], lr=1e-3, weight_decay=wd, fused=True)
            ours = (lambda p=p, gr=gr, mb=mb, vb=vb, state=state:
                    ml.adam_update(p, gr, mb, vb, state))
            moved = 28 * npar  # read p, g, m, v; write p, m, v
        check = (lambda o, t, p=p, tp=tp: f"param rel {rel(p, tp):.1e} (after the same steps)")
        optim_cases.append((name, f"{npar}", ours, topt.step, moved, check))

    rows_out = []

    def record(name, shape, ms, tms, moved, note):
        gbps = moved / (ms * 1e-3) / 1e9
        row = {"op": name, "shape": shape, "ms": ms, "torch_ms": tms, "bytes": moved,
               "gbps": gbps, "frac_copy_bw": gbps / copy_gbps, "vs_torch": tms / ms,
               "check": note}
        rows_out.append(row)
        print(f"  {name} {shape}: {ms:.4f} ms ({gbps:.0f} GB/s), torch {tms:.4f} ms; {note}",
              flush=True)

    for name, shape, ours, theirs, moved, check in cases:
        try:
            out = ours()
            note = check(out, theirs())
            out.free()
            ms = median_ms(lambda ours=ours: ours().free())
        except Exception as exc:  # report and go on
            print(f"{name} {shape}: FAILED {type(exc).__name__}: {exc}")
            continue
        tms = median_ms(theirs)
        record(name, shape, ms, tms, moved, note)
    for name, shape, ours, theirs, moved, check in optim_cases:
        try:
            ours()  # both take the same first step (same p, g), then the timed ones
            theirs()
            torch.cuda.synchronize()
            note = check(None, None)
            ms = median_ms(ours)
        except Exception as exc:
            print(f"{name} {shape}: FAILED {type(exc).__name__}: {exc}")
            continue
        tms = median_ms(theirs)
        record(name, shape, ms, tms, moved, note)
    res["cases"] = rows_out
    timer.close()

    print(f"{'op':<22} {'shape':>16} {'ours ms':>9} {'torch ms':>9} {'GB/s':>7} "
          f"{'of copy':>7} {'vs torch':>8}  check")
    for r in rows_out:
        print(f"{r['op']:<22} {r['shape']:>16} {r['ms']:>9.4f} {r['torch_ms']:>9.4f} "
              f"{r['gbps']:>7.0f} {r['frac_copy_bw']:>7.2f} {r['vs_torch']:>8.2f}  {r['check']}")
    print(f"copy bandwidth {copy_gbps:.0f} GB/s on {dev.name}; torch TF32 "
          f"matmul={res['torch_settings']['cuda.matmul.allow_tf32']} "
          f"cudnn={res['torch_settings']['cudnn.allow_tf32']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
