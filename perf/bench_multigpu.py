"""Streams and multi-GPU: copy/compute overlap, a matmul split over GPUs, all_reduce bandwidth.

    python perf/bench_multigpu.py [--out results.json]

1. Overlap (one GPU): a chunked pipeline (copy chunk i+1 in while computing on chunk i and
   copying chunk i-1 out) over 2 streams vs the same work serially on one stream. Compute per
   chunk is sized to about the copy time (balanced). Goal: pipelined <= 0.6 x serial.
2. (2+ GPUs) matmul 16384x8192 @ 8192x8192 split by rows over every GPU vs one GPU, from
   device-resident inputs, end to end. Goal >= 1.8x on 2 GPUs.
3. (2+ GPUs) all_reduce of 256 MiB float32 per GPU vs the measured peer-copy bandwidth.
   Goal >= 0.7x (algorithm bandwidth = bytes per GPU / time).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    import pycuda.driver as drv
    from cuda_backend import CudaDataType as DT, parallel
    from cuda_backend.cuda_math import get_cuda_math

    m = get_cuda_math()
    b = m.backend
    res = {"device": b.devices[0].name, "gpus": b.device_count}

    # 1. overlap -------------------------------------------------------------------
    n, chunks, reps = 1 << 24, 16, 24
    host_in = b.pinned_empty((chunks, n), np.float32)
    host_in[:] = 1.0
    host_out = b.pinned_empty((chunks, n), np.float32)
    bufs = [b.empty((n,), DT.FLOAT32) for _ in range(3)]
    outs = [b.empty((n,), DT.FLOAT32) for _ in range(3)]
    from cuda_backend.ops import elementwise as ew

    def compute(x, y):
        ew.binary(m, "multiply", x, 1.0001, out=y)
        for _ in range(reps - 1):
            ew.unary(m, "tanh", y, out=y)

    def run(streams):
        for i in range(chunks):
            s = streams[i % len(streams)]
            with s:
                b.copy_to_device_async(host_in[i], bufs[i % 3], s)
                compute(bufs[i % 3], outs[i % 3])
                b.copy_from_device_async(outs[i % 3], host_out[i], s)
        for s in streams:
            s.synchronize()

    one = [b.stream()]
    two = [b.stream(), b.stream(), b.stream()]
    # balance: time one chunk's copy in vs compute
    e0, e1, e2 = drv.Event(), drv.Event(), drv.Event()
    ps = one[0].pycuda_stream
    compute(bufs[0], outs[0]); b.synchronize()   # compile and load the kernels first
    e0.record(ps); b.copy_to_device_async(host_in[0], bufs[0], one[0]); e1.record(ps)
    with one[0]:
        compute(bufs[0], outs[0])
    e2.record(ps); e2.synchronize()
    copy_ms, comp_ms = e1.time_since(e0), e2.time_since(e1)
    run(one); run(two)
    t0 = time.perf_counter(); run(one); serial = time.perf_counter() - t0
    t0 = time.perf_counter(); run(two); piped = time.perf_counter() - t0
    res["overlap"] = {"chunk_copy_ms": copy_ms, "chunk_compute_ms": comp_ms,
                      "serial_ms": serial * 1e3, "pipelined_ms": piped * 1e3,
                      "ratio": piped / serial}
    print(f"overlap: copy {copy_ms:.2f} ms, compute {comp_ms:.2f} ms per chunk; serial "
          f"{serial*1e3:.1f} ms, pipelined {piped*1e3:.1f} ms -> {piped/serial:.2f} (goal <= 0.6)")

    if b.device_count >= 2:
        devs = list(range(b.device_count))
        # 2. matmul split ---------------------------------------------------------------
        M, K, N = 16384, 8192, 8192
        rng = np.random.default_rng()
        a = rng.standard_normal((M, K), dtype=np.float32)
        w = rng.standard_normal((K, N), dtype=np.float32)
        a_full = m.from_numpy(a, device_id=0)
        w0 = m.from_numpy(w, device_id=0)
        shards = parallel.scatter(a, devs)
        ws = parallel.broadcast(w0, devs)
        m.matrix_multiply(a_full, w0).free()
        parallel.data_parallel(lambda p: m.matrix_multiply(*p), list(zip(shards, ws)), devs)
        b.synchronize()
        def best_of(fn, n=3):
            times = []
            for _ in range(n):
                t0 = time.perf_counter(); fn(); b.synchronize()
                times.append(time.perf_counter() - t0)
            return min(times)
        one_gpu = best_of(lambda: m.matrix_multiply(a_full, w0).free())
        multi = best_of(lambda: [c.free() for c in parallel.data_parallel(
            lambda p: m.matrix_multiply(*p), list(zip(shards, ws)), devs)])
        res["matmul_split"] = {"one_gpu_ms": one_gpu * 1e3, "multi_gpu_ms": multi * 1e3,
                               "speedup": one_gpu / multi}
        print(f"matmul {M}x{K}@{K}x{N}: 1 GPU {one_gpu*1e3:.1f} ms, {len(devs)} GPUs "
              f"{multi*1e3:.1f} ms -> {one_gpu/multi:.2f}x (goal >= 1.8)")
        # 3. all_reduce -----------------------------------------------------------------
        nbytes = 256 << 20
        src = m.from_numpy(np.ones(nbytes // 4, np.float32), device_id=0)
        t0 = time.perf_counter()
        for _ in range(5):
            x = src.to(1); x.free()
        b.synchronize()
        peer_gbps = 5 * nbytes / (time.perf_counter() - t0) / 1e9
        ts = [m.from_numpy(np.full(nbytes // 4, float(d + 1), np.float32), device_id=d)
              for d in devs]
        parallel.all_reduce(ts)
        t0 = time.perf_counter()
        for _ in range(5):
            parallel.all_reduce(ts)
        b.synchronize()
        ar = (time.perf_counter() - t0) / 5
        algbw = nbytes / ar / 1e9
        res["all_reduce"] = {"bytes": nbytes, "ms": ar * 1e3, "algbw_gbps": algbw,
                             "peer_copy_gbps": peer_gbps, "ratio": algbw / peer_gbps}
        print(f"all_reduce 256 MiB: {ar*1e3:.2f} ms, {algbw:.0f} GB/s vs peer copy "
              f"{peer_gbps:.0f} GB/s -> {algbw/peer_gbps:.2f} (goal >= 0.7)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
