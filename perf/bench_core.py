"""Core runtime overheads against bare PyCUDA, in one run on the GPU machine.

    python perf/bench_core.py [--out results.json]

Measures (medians): pinned host->device and device->host rate through copy_to_device /
copy_from_device against bare pinned memcpy_htod / memcpy_dtoh; pageable copies (our staged
path against the driver's own); pool allocate+free of 1 MiB from Python against a bare
DeviceMemoryPool; an empty kernel through launch_kernel (profiling off) against a bare
prepared_call. Goals (issue 2): copy ratio >= 0.95, pool <= 3 us, launch <= 8 us.

`cuda-backend report --preset host` times the same pool allocate + free of 1 MiB and
empty-kernel launch, against PyTorch and CuPy; this script keeps the bare-PyCUDA floors and
the copies against the driver's own.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def median_time(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--copy-mib", type=int, default=256)
    args = ap.parse_args()

    import pycuda.driver as drv
    import pycuda.tools
    import cuda_backend as cb
    from cuda_backend import CudaDataType as DT

    b = cb.get_cuda_backend()
    assert b.is_available, b.fallback_reason
    dev = b.devices[0]
    res = {"device": dev.name, "versions": b.versions()}
    b.set_device(0)

    # -- copies ------------------------------------------------------------------
    nbytes = args.copy_mib << 20
    n = nbytes // 4
    pinned = b.pinned_empty((n,), np.float32)
    pinned[:] = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    t = b.empty((n,), DT.FLOAT32)
    ptr = t.ptr
    for _ in range(3):
        drv.memcpy_htod(ptr, pinned); b.copy_to_device(pinned, t)
        drv.memcpy_dtoh(pinned, ptr); b.copy_from_device(t, pinned)
    R = 15
    bare_h2d = median_time(lambda: drv.memcpy_htod(ptr, pinned), R)
    ours_h2d = median_time(lambda: b.copy_to_device(pinned, t), R)
    bare_d2h = median_time(lambda: drv.memcpy_dtoh(pinned, ptr), R)
    ours_d2h = median_time(lambda: b.copy_from_device(t, pinned), R)
    ev_h2d = statistics.median([b.copy_to_device(pinned, t) for _ in range(R)])
    res["pinned"] = {
        "bytes": nbytes,
        "bare_htod_gbps": nbytes / bare_h2d / 1e9, "ours_htod_gbps": nbytes / ours_h2d / 1e9,
        "bare_dtoh_gbps": nbytes / bare_d2h / 1e9, "ours_dtoh_gbps": nbytes / ours_d2h / 1e9,
        "htod_ratio": bare_h2d / ours_h2d, "dtoh_ratio": bare_d2h / ours_d2h,
        "ours_htod_event_ms": ev_h2d,
    }
    pageable = np.array(pinned)  # ordinary memory
    out_pg = np.empty_like(pageable)
    R2 = 7
    bare_pg_h2d = median_time(lambda: drv.memcpy_htod(ptr, pageable), R2)
    bare_pg_d2h = median_time(lambda: drv.memcpy_dtoh(out_pg, ptr), R2)
    staged = {}
    for chunk_mib in (8, 16, 32):
        b.transfers.staging_chunk = chunk_mib << 20
        b.copy_to_device(pageable, t)
        staged[chunk_mib] = (median_time(lambda: b.copy_to_device(pageable, t), R2),
                             median_time(lambda: b.copy_from_device(t, out_pg), R2))
    assert np.array_equal(out_pg, pageable)
    res["pageable"] = {
        "bare_htod_gbps": nbytes / bare_pg_h2d / 1e9, "bare_dtoh_gbps": nbytes / bare_pg_d2h / 1e9,
        "staged": {str(k): {"htod_gbps": nbytes / v[0] / 1e9, "dtoh_gbps": nbytes / v[1] / 1e9}
                   for k, v in staged.items()},
    }
    b.transfers.staging_chunk = 16 << 20
    t.free()
    del pinned

    # -- pool ----------------------------------------------------------------------
    pool = b.memory_pools[0]
    raw = pycuda.tools.DeviceMemoryPool()
    MiB = 1 << 20
    N = 20000

    def ours_pool():
        for _ in range(N):
            b.free_memory(b.allocate_memory(MiB))

    def ours_block():
        for _ in range(N):
            pool.release(pool.allocate(MiB))

    def bare_pool():
        for _ in range(N):
            raw.allocate(MiB).free()
    ours_pool(); bare_pool(); ours_block()
    res["pool_1mib_us"] = {
        "allocate_memory+free_memory": median_time(ours_pool, 7) / N * 1e6,
        "pool.allocate+release": median_time(ours_block, 7) / N * 1e6,
        "bare DeviceMemoryPool": median_time(bare_pool, 7) / N * 1e6,
    }
    raw.stop_holding()

    # -- launch ----------------------------------------------------------------------
    gen = cb.get_kernel_generator()
    k = gen.get_kernel("empty.cu.j2")
    out = b.empty((1,), DT.FLOAT32)
    optr = out.ptr
    f = k.function
    L = 2000

    def ours_launch():
        for _ in range(L):
            b.launch_kernel(k.name, (1,), out, 1, block_size=(32,))
        drv.Context.synchronize()

    def ours_launch_ptr():
        for _ in range(L):
            b.launch_kernel(k.name, (1,), optr, 1, block_size=(32,))
        drv.Context.synchronize()

    def bare_launch():
        for _ in range(L):
            f.prepared_call((1, 1), (32, 1, 1), optr, 1)
        drv.Context.synchronize()
    for fn in (ours_launch, bare_launch, ours_launch_ptr):
        fn()
    res["launch_us"] = {
        "launch_kernel(tensor)": median_time(ours_launch, 9) / L * 1e6,
        "launch_kernel(int ptr)": median_time(ours_launch_ptr, 9) / L * 1e6,
        "bare prepared_call": median_time(bare_launch, 9) / L * 1e6,
    }
    out.free()

    p = res["pinned"]
    print(f"device: {dev.name}")
    print(f"pinned htod: ours {p['ours_htod_gbps']:.2f} GB/s vs bare {p['bare_htod_gbps']:.2f} "
          f"-> ratio {p['htod_ratio']:.3f} (goal >= 0.95)")
    print(f"pinned dtoh: ours {p['ours_dtoh_gbps']:.2f} GB/s vs bare {p['bare_dtoh_gbps']:.2f} "
          f"-> ratio {p['dtoh_ratio']:.3f} (goal >= 0.95)")
    pg = res["pageable"]
    print(f"pageable bare: htod {pg['bare_htod_gbps']:.2f} GB/s, dtoh {pg['bare_dtoh_gbps']:.2f} GB/s")
    for c, v in pg["staged"].items():
        print(f"  ours, staging chunk {c} MiB: htod {v['htod_gbps']:.2f} GB/s, "
              f"dtoh (driver path) {v['dtoh_gbps']:.2f} GB/s")
    for name, v in res["pool_1mib_us"].items():
        print(f"pool 1 MiB {name}: {v:.2f} us (goal <= 3)")
    for name, v in res["launch_us"].items():
        print(f"launch {name}: {v:.2f} us (goal <= 8)")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
