"""CudaMath memory-bound operations against PyTorch and the device's copy bandwidth.

    python perf/bench_math.py [--out results.json] [--quick]

One run measures: the device-to-device copy bandwidth (bytes read + written, a 2 GiB copy);
then for each case our median time (the package's timing primitive,
cuda_backend/performance/timing.py: CUDA events around single calls after warm-up, the start
event queued behind a GPU spin so that host overhead is not timed: see gpu_gap) and torch's
(the same events and spin), the achieved
GB/s (the bytes the operation must move), its fraction of the copy bandwidth and the ratio
torch_time / our_time (>1 means we are faster). Inputs are 1 GiB+ so the 50-60 MB L2 holds
no useful part of them; small cases rotate among several input sets.

`cuda-backend report --preset bandwidth` times these operations against PyTorch at the
report's largest sizes (2^26 elements, 4096 x 4096), the L2 flushed; this script keeps the
1 GiB+ inputs, the (65536, 1024) and (8192, 4096) softmax rows and the vector_add wall time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


GAP_CYCLES = 400_000   # ~0.2 ms of GPU spin at ~2 GHz: longer than any call's host overhead


def gpu_gap() -> None:
    """Keep the GPU busy (a spin kernel on the default stream) while the host queues the
    start event and the call: the events then time the GPU work, not the Python before the
    launch, for ours and PyTorch alike."""
    import torch
    torch.cuda._sleep(GAP_CYCLES)


def event_median(timer, fn, reps):
    """Median ms of single calls of fn (ours or torch's: one context, one default stream)
    from the timing primitive, after one warm-up call; no L2 flush (the inputs are far
    larger than L2); the timer queues gpu_gap before each start event."""
    return timer.median_ms(fn, warmup=1, iterations=reps, flush=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()

    import pycuda.driver as drv
    import torch
    from cuda_backend.cuda_math import get_cuda_math
    from cuda_backend.performance.timing import DeviceTimer

    m = get_cuda_math()
    b = m.backend
    assert b.is_available, b.fallback_reason
    dev = b.devices[0]
    timer = DeviceTimer(b, 0, flush_l2=False, gap=gpu_gap)
    sync = drv.Context.synchronize
    tsync = torch.cuda.synchronize
    R = args.reps

    # copy bandwidth, through the backend's dtod copy (bytes read + written)
    nbytes = 1 << 31
    src = b.allocate_memory(nbytes)
    dst = b.allocate_memory(nbytes)
    copy_ms = event_median(timer, lambda: b.copy_device_to_device(dst, src, nbytes), R)
    b.free_memory(src); b.free_memory(dst)
    tsrc = torch.empty(nbytes // 4, device="cuda")
    tdst = torch.empty_like(tsrc)
    tcopy_ms = event_median(timer, lambda: tdst.copy_(tsrc), R)
    del tsrc, tdst
    copy_gbps = 2 * nbytes / (copy_ms * 1e-3) / 1e9
    res = {"device": dev.name, "copy_gbps": copy_gbps,
           "torch_copy_gbps": 2 * nbytes / (tcopy_ms * 1e-3) / 1e9, "cases": []}
    print(f"device {dev.name}: copy bandwidth {copy_gbps:.0f} GB/s (torch copy_ "
          f"{res['torch_copy_gbps']:.0f} GB/s)")

    rng = np.random.default_rng()

    def tensor_pair(shape):
        x = rng.standard_normal(shape, dtype=np.float32)
        return m.from_numpy(x), torch.from_numpy(x).cuda()

    N = 1 << (24 if args.quick else 28)
    x, tx = tensor_pair((N,))
    y, ty = tensor_pair((N,))
    sq = 1 << (12 if args.quick else 14)
    cases = [
        ("add", f"{N}", lambda: m.add(x, y), lambda: tx + ty, 12 * N),
        ("multiply scalar", f"{N}", lambda: m.multiply(x, 2.5), lambda: tx * 2.5, 8 * N),
        ("exp", f"{N}", lambda: m.exp(x), lambda: torch.exp(tx), 8 * N),
        ("relu", f"{N}", lambda: m.relu(x), lambda: torch.relu(tx), 8 * N),
        ("sigmoid", f"{N}", lambda: m.sigmoid(x), lambda: torch.sigmoid(tx), 8 * N),
        ("reduce_sum full", f"{N}", lambda: m.reduce_sum(x), lambda: tx.sum(), 4 * N),
    ]
    x2, tx2 = tensor_pair((sq, N // sq))
    cases += [
        ("reduce_sum last axis", f"{sq}x{N // sq}", lambda: m.reduce_sum(x2, axis=-1),
         lambda: tx2.sum(dim=-1), 4 * N),
        ("reduce_sum axis 0", f"{sq}x{N // sq}", lambda: m.reduce_sum(x2, axis=0),
         lambda: tx2.sum(dim=0), 4 * N),
        ("reduce_max last axis", f"{sq}x{N // sq}", lambda: m.reduce_max(x2, axis=-1),
         lambda: tx2.amax(dim=-1), 4 * N),
    ]
    t = 8192 if not args.quick else 2048
    xt, txt = tensor_pair((t, t))
    cases.append(("matrix_transpose", f"{t}x{t}", lambda: m.matrix_transpose(xt),
                  lambda: txt.t().contiguous(), 8 * t * t))
    for rows, cols in ([(65536, 1024), (8192, 4096)] if not args.quick else [(4096, 1024)]):
        xs, txs = tensor_pair((rows, cols))
        cases.append(("softmax", f"{rows}x{cols}", (lambda xs=xs: m.softmax(xs)),
                      (lambda txs=txs: torch.softmax(txs, dim=-1)), 8 * rows * cols))
        cases.append(("log_softmax", f"{rows}x{cols}", (lambda xs=xs: m.log_softmax(xs)),
                      (lambda txs=txs: torch.log_softmax(txs, dim=-1)), 8 * rows * cols))

    rows_out = []
    for name, shape, ours, theirs, moved in cases:
        def ours_free(ours=ours):
            out = ours()
            out.free()
        try:
            ms = event_median(timer, ours_free, R)
        except Exception as exc:  # report and go on
            print(f"{name} {shape}: FAILED {type(exc).__name__}: {exc}")
            continue
        tms = event_median(timer, theirs, R)
        gbps = moved / (ms * 1e-3) / 1e9
        row = {"op": name, "shape": shape, "ms": ms, "torch_ms": tms, "gbps": gbps,
               "frac_copy_bw": gbps / copy_gbps, "vs_torch": tms / ms}
        rows_out.append(row)
    res["cases"] = rows_out

    # small vector_add: Python call -> result ready, wall time
    a1, ta1 = tensor_pair((1024,))
    b1, tb1 = tensor_pair((1024,))
    def wall(fn, syncfn, reps=2000):
        for _ in range(50):
            fn(); syncfn()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            syncfn()
            samples.append(time.perf_counter() - t0)
            del out
        return statistics.median(samples) * 1e6
    ours_small = wall(lambda: m.vector_add(a1, b1), sync)
    torch_small = wall(lambda: ta1 + tb1, tsync)
    res["vector_add_1024_wall_us"] = {"ours": ours_small, "torch": torch_small}

    print(f"{'op':<22} {'shape':>14} {'ours ms':>9} {'torch ms':>9} {'GB/s':>7} "
          f"{'of copy':>7} {'vs torch':>8}")
    for r in rows_out:
        print(f"{r['op']:<22} {r['shape']:>14} {r['ms']:>9.4f} {r['torch_ms']:>9.4f} "
              f"{r['gbps']:>7.0f} {r['frac_copy_bw']:>7.2f} {r['vs_torch']:>8.2f}")
    print(f"vector_add 1024 wall: ours {ours_small:.1f} us, torch {torch_small:.1f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
