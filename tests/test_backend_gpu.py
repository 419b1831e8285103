"""Core runtime on a real GPU: devices, contexts, pools, copies, compilation, launches,
profiling, interop and clean exit. Marked `gpu`; skipped without PyCUDA or a GPU."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import cuda_backend as cb
from cuda_backend import CudaDataType as DT

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_py(code: str, env=None, timeout=120):
    e = dict(os.environ)
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=e, timeout=timeout)


def fresh(shape, dtype, rng):
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -1000), min(info.max, 1000), size=shape).astype(dtype)


# -- devices and contexts ---------------------------------------------------------------
def test_devices_enumerated(backend):
    assert backend.is_available and backend.device_count >= 1
    for i, d in enumerate(backend.devices):
        assert d.device_id == i and d.name
        assert d.compute_capability >= (3, 0)
        assert d.memory_total > 2**30 and d.multiprocessor_count > 0
        assert d.max_threads_per_block >= 512 and d.warp_size == 32
        assert d.shared_memory_per_block_optin >= d.shared_memory_per_block > 0
        assert d.l2_cache_size > 0 and d.memory_bus_width_bits > 0
        assert d.theoretical_bandwidth_gbps > 100
        assert d.pci_bus_id
        assert backend.get_device_info(i) is d


def test_invalid_device_names_range(backend):
    with pytest.raises(cb.InvalidDeviceError, match=r"0\.\.%d" % (backend.device_count - 1)):
        backend.set_device(backend.device_count)
    with pytest.raises(cb.InvalidDeviceError):
        backend.get_device_info(-1)


def test_primary_context_is_shared_with_driver(backend):
    import pycuda.driver as drv
    ctx = backend.context(0)
    primary = drv.Device(0).retain_primary_context()
    try:
        assert ctx.handle == primary.handle
    finally:
        primary.detach()


def test_device_context_manager_restores_even_on_error(backend):
    backend.set_device(0)
    last = backend.device_count - 1
    with pytest.raises(RuntimeError):
        with backend.device(last):
            assert backend.current_device == last
            raise RuntimeError("boom")
    assert backend.current_device == 0


def test_threads_switch_devices_independently(backend):
    errors, results = [], {}

    def work(tid):
        try:
            dev = tid % backend.device_count
            backend.set_device(dev)
            rng = np.random.default_rng(tid)
            for _ in range(20):
                a = rng.standard_normal(1000).astype(np.float32)
                t = backend.to_device(a, device_id=dev)
                back = backend.to_host(t)
                t.free()
                assert np.array_equal(a, back)
            results[tid] = backend.current_device
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert all(results[i] == i % backend.device_count for i in range(8))


# -- memory pools -------------------------------------------------------------------
def test_pool_stats_after_cycles(backend):
    pool = backend.memory_pools[0]
    pool.free_all_blocks()
    pool.reset_counters()
    start_active = pool.get_stats()["active_memory"]
    # live blocks of other tests keep their bins' rounding as "free" bytes (the pool counts
    # requested sizes as active, bin sizes as managed): what free_all_blocks leaves
    start_slack = pool.free_bytes()
    ptrs = [backend.allocate_memory(1 << 20) for _ in range(4)]
    s = pool.get_stats()
    assert s["active_memory"] - start_active >= 4 << 20
    assert s["allocation_count"] == 4 and s["misses"] == 4 and s["hits"] == 0
    for p in ptrs:
        backend.free_memory(p)
    s = pool.get_stats()
    assert s["active_memory"] == start_active
    assert s["peak_allocated"] >= start_active + (4 << 20)
    assert s["cached_bytes"] >= 4 << 20 and s["n_free_blocks"] >= 4
    for _ in range(3):
        backend.free_memory(backend.allocate_memory(1 << 20))
    s = pool.get_stats()
    assert s["hits"] == 3 and s["free_count"] == 7
    with pytest.raises(cb.InvalidPointerError, match="0x"):
        backend.free_memory(ptrs[0])
    pool.free_all_blocks()
    assert pool.n_free_blocks() == 0 and pool.free_bytes() == start_slack


def test_pool_oom_ladder_and_limit(backend):
    pool = backend.memory_pools[0]
    with pytest.raises(cb.CudaOutOfMemoryError) as info:
        backend.allocate_memory(backend.devices[0].memory_total * 4)
    msg = str(info.value)
    assert "device 0" in msg and "tried to allocate" in msg and "In use" in msg
    assert isinstance(info.value, MemoryError)
    assert pool.get_stats()["oom_retries"] >= 1
    pool.set_limit(size=64 << 20)
    try:
        with pytest.raises(cb.CudaOutOfMemoryError, match="limit"):
            backend.allocate_memory(128 << 20)
        backend.free_memory(backend.allocate_memory(1 << 20))  # still usable
    finally:
        pool.set_limit()
    assert pool.get_limit() == 0


@pytest.mark.exclusive
def test_allocate_until_the_device_is_full(backend):
    """Fill the device in 1 GiB blocks: a typed error with the numbers; freed blocks kept in
    the pool's cache are released and retried for a larger request; after freeing, the pool
    allocates again. Needs the GPU to itself (marker `exclusive`)."""
    pool = backend.memory_pools[0]
    pool.free_all_blocks()
    gib = 1 << 30
    ptrs = []
    try:
        with pytest.raises(cb.CudaOutOfMemoryError) as info:
            for _ in range(backend.devices[0].memory_total // gib + 2):
                ptrs.append(backend.allocate_memory(gib))
        msg = str(info.value)
        assert len(ptrs) >= 4, msg
        assert f"tried to allocate 1.00 GiB ({gib} bytes)" in msg, msg
        assert "In use by the pool" in msg and "cached free blocks" in msg, msg
        # two blocks back to the pool's cache: the driver still holds them, so a 2 GiB
        # request succeeds only by releasing cached blocks and retrying
        for p in (ptrs.pop(), ptrs.pop()):
            backend.free_memory(p)
        ptrs.append(backend.allocate_memory(2 * gib))
        # a tensor in a reference cycle holds 1 GiB until garbage collection: the request
        # succeeds through the ladder (PyCUDA's pool frees its cached blocks and retries,
        # then ours collects garbage and retries; tests/test_memory_pool.py covers each step)
        backend.free_memory(ptrs.pop(0))
        pool.free_all_blocks()
        gc.disable()
        try:
            t = backend.empty((gib // 4,), DT.FLOAT32)
            cycle = [t]
            cycle.append(cycle)
            del t, cycle
            ptrs.append(backend.allocate_memory(gib))
        finally:
            gc.enable()
    finally:
        for p in ptrs:
            backend.free_memory(p)
        pool.free_all_blocks()
    p = backend.allocate_memory(gib)          # usable again
    backend.free_memory(p)
    x = np.arange(1000, dtype=np.float32)
    assert np.array_equal(backend.to_host(backend.to_device(x)), x)


# -- copies -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32, np.int64,
                                   np.uint8, np.bool_])
@pytest.mark.parametrize("n", [1, 7, 1000003])
def test_copy_round_trip(backend, dtype, n):
    rng = np.random.default_rng(7380)
    a = fresh((n,), dtype, rng)
    t = backend.empty((n,), dtype)
    ms_in = backend.copy_to_device(a, t)
    out = np.empty_like(a)
    ms_out = backend.copy_from_device(t, out)
    t.free()
    assert np.array_equal(a, out)
    assert ms_in > 0 and ms_out > 0


def test_copy_bfloat16_and_large_staged(backend):
    rng = np.random.default_rng(2786)
    x = rng.standard_normal(3_000_001).astype(np.float32)
    bits = cb.to_bfloat16_bits(x)
    t = backend.empty(x.shape, DT.BFLOAT16)
    backend.copy_to_device(bits, t)
    assert np.array_equal(backend.to_host(t), bits)
    t.free()
    big = rng.standard_normal((5000, 3001)).astype(np.float32)  # 60 MB, staged path
    tb = backend.to_device(big)
    assert np.array_equal(backend.to_host(tb), big)
    tb.free()


def test_copy_noncontiguous_and_byteswapped(backend):
    rng = np.random.default_rng(9838)
    a = rng.standard_normal((64, 33)).astype(np.float32)
    t = backend.to_device(a.T)  # Fortran-ordered view
    assert np.array_equal(backend.to_host(t), a.T)
    b = a.astype(">f4")
    t2 = backend.to_device(b)
    assert np.array_equal(backend.to_host(t2), a)
    t.free(); t2.free()


def test_copy_mismatch_raises_before_copy(backend):
    t = backend.empty((10,), DT.FLOAT32)
    with pytest.raises(cb.TransferError, match="shape"):
        backend.copy_to_device(np.zeros(11, np.float32), t)
    with pytest.raises(cb.DTypeMismatchError, match="float64"):
        backend.copy_to_device(np.zeros(10, np.float64), t)
    ptr = backend.allocate_memory(400)
    with pytest.raises(cb.TransferError):
        backend.copy_to_device(np.zeros(1000, np.float32), ptr)
    backend.free_memory(ptr)
    t.free()
    with pytest.raises(cb.TensorFreedError):
        backend.copy_to_device(np.zeros(10, np.float32), t)


def test_pinned_copies(backend):
    h = backend.pinned_empty((1 << 20,), np.float32)
    h[:] = np.random.default_rng(7425).standard_normal(h.shape)
    t = backend.empty(h.shape, DT.FLOAT32)
    assert backend.copy_to_device(h, t) > 0
    h2 = backend.pinned_empty((1 << 20,), np.float32)
    backend.copy_from_device(t, h2)
    assert np.array_equal(h, h2)
    t.free()


def test_async_copies_on_a_stream(backend):
    stream = backend.create_stream()
    h = backend.pinned_empty((4096,), np.float32)
    h[:] = np.random.default_rng(4092).standard_normal(h.shape)
    t = backend.empty(h.shape, DT.FLOAT32)
    backend.copy_to_device_async(h, t, stream)
    back = backend.pinned_empty((4096,), np.float32)
    backend.copy_from_device_async(t, back, stream)
    stream.synchronize()
    assert np.array_equal(h, back)
    assert t.__cuda_array_interface__["stream"] == stream.handle
    with pytest.raises(cb.TransferError, match="page-locked"):
        backend.copy_to_device_async(np.ones(4096, np.float32), t, stream)
    t.free()


# -- compilation and launches ---------------------------------------------------------
SAXPY = r'''
extern "C" __global__ void saxpy_test(float* y, const float* x, float a, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
'''


def test_compile_and_launch_saxpy(backend):
    backend.compile_kernel("saxpy_test", SAXPY)
    rng = np.random.default_rng(3229)
    n = 100_003
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    tx, ty = backend.to_device(x), backend.to_device(y)
    backend.launch_kernel("saxpy_test", ((n + 255) // 256,), ty, tx, 2.5, n, block_size=(256,))
    np.testing.assert_allclose(backend.to_host(ty), 2.5 * x.astype(np.float64) + y, rtol=1e-6)
    # ints and floats are converted to the declared types
    backend.launch_kernel("saxpy_test", (n + 255) // 256, ty, tx, 1, float(n))
    tx.free(); ty.free()


def test_compile_cache_hit_does_not_call_nvcc(backend, monkeypatch):
    import pycuda.compiler
    calls = []
    real = pycuda.compiler.compile_plain
    monkeypatch.setattr(pycuda.compiler, "compile_plain",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    src = SAXPY.replace("saxpy_test", "saxpy_cache_probe")
    k1 = backend.compile_kernel("saxpy_cache_probe", src)
    n_after_first = len(calls)
    k2 = backend.compile_kernel("saxpy_cache_probe", src)
    assert k1 is k2 and len(calls) == n_after_first


def test_disk_cache_across_processes(tmp_path):
    code = f'''
        import pycuda.compiler, cuda_backend as cb
        calls = []
        real = pycuda.compiler.call_capture_output
        pycuda.compiler.call_capture_output = lambda cmd, *a, **k: (
            calls.append(cmd) or real(cmd, *a, **k))
        b = cb.get_cuda_backend()
        b.compile_kernel("disk_probe", {SAXPY.replace("saxpy_test", "disk_probe")!r})
        print("NVCC_COMPILES", sum(1 for c in calls if "--cubin" in c))
    '''
    env = {"CUDA_BACKEND_CACHE_DIR": str(tmp_path)}
    first = run_py(code, env)
    second = run_py(code, env)
    assert first.returncode == 0, first.stderr
    assert "NVCC_COMPILES 1" in first.stdout
    assert "NVCC_COMPILES 0" in second.stdout, second.stdout + second.stderr


def test_compile_for_sm_90a(backend):
    if backend.devices[0].compute_capability != (9, 0):
        pytest.skip("sm_90a needs a Hopper GPU")
    src = SAXPY.replace("saxpy_test", "saxpy_90a")
    k = backend.compile_kernel("saxpy_90a", src, arch="sm_90a")
    assert k.arch == "sm_90a"
    x = backend.to_device(np.ones(32, np.float32))
    backend.launch_kernel("saxpy_90a", (1,), x, x, 1.0, 32, block_size=(32,))
    assert np.array_equal(backend.to_host(x), np.full(32, 2.0, np.float32))
    x.free()


def test_compile_error_message(backend):
    bad = 'extern "C" __global__ void broken(float* x)\n{\n    x[0] = undefined_name;\n}\n'
    with pytest.raises(cb.KernelCompilationError) as info:
        backend.compile_kernel("broken", bad)
    msg = str(info.value)
    assert msg.startswith("Failed to compile CUDA kernel 'broken'")
    assert "undefined_name" in msg and ">>3 |" in msg and "nvcc" in msg


def test_unknown_kernel_and_launch_limits(backend):
    with pytest.raises(cb.KernelNotFoundError, match="no_such_kernel"):
        backend.launch_kernel("no_such_kernel", (1,))
    backend.compile_kernel("saxpy_test", SAXPY)
    t = backend.empty((4,), DT.FLOAT32)
    info = backend.devices[0]
    with pytest.raises(cb.LaunchConfigurationError, match="threads per block"):
        backend.launch_kernel("saxpy_test", (1,), t, t, 1.0, 4, block_size=(2048,))
    with pytest.raises(cb.LaunchConfigurationError, match="grid dimension y"):
        backend.launch_kernel("saxpy_test", (1, info.max_grid_dims[1] + 1), t, t, 1.0, 4)
    with pytest.raises(cb.LaunchConfigurationError, match="shared memory"):
        backend.launch_kernel("saxpy_test", (1,), t, t, 1.0, 4,
                              shared_mem=info.shared_memory_per_block_optin + 1)
    with pytest.raises(cb.LaunchConfigurationError, match="takes 4 arguments"):
        backend.launch_kernel("saxpy_test", (1,), t, t, 1.0)
    with pytest.raises(cb.LaunchConfigurationError, match="non-integral"):
        backend.launch_kernel("saxpy_test", (1,), t, t, 1.0, 4.5)
    t.free()
    with pytest.raises(cb.TensorFreedError):
        backend.launch_kernel("saxpy_test", (1,), t, t, 1.0, 4)
    # the backend still works after every error
    backend.launch_kernel("saxpy_test", (1,), *(2 * [backend.to_device(np.ones(4, np.float32))]),
                          1.0, 4)


@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16])
@pytest.mark.parametrize("tiled,tile", [(True, 8), (True, 16), (True, 32), (False, 16)])
def test_generated_matmul_matches_numpy(backend, dtype, tiled, tile):
    gen = cb.get_kernel_generator()
    kernel = gen.get_kernel("matmul.cu.j2", use_tiled=tiled, tile_size=tile,
                            **cb.kernels.dtype_params(dtype))
    rng = np.random.default_rng(6645)
    M, K, N = 67, 131, 45
    a = rng.standard_normal((M, K))
    b = rng.standard_normal((K, N))
    if dtype is DT.BFLOAT16:
        ha, hb = cb.to_bfloat16_bits(a), cb.to_bfloat16_bits(b)
        a, b = cb.from_bfloat16_bits(ha), cb.from_bfloat16_bits(hb)
    else:
        ha, hb = a.astype(dtype.numpy_dtype), b.astype(dtype.numpy_dtype)
        a, b = ha, hb
    ta, tb = backend.empty((M, K), dtype), backend.empty((K, N), dtype)
    backend.copy_to_device(ha, ta); backend.copy_to_device(hb, tb)
    tc = backend.empty((M, N), dtype)
    backend.copy_to_device(np.full((M, N), 0xFFFF if dtype.itemsize == 2 else 0,
                                   dtype.numpy_dtype) if dtype is DT.BFLOAT16 else
                           np.full((M, N), np.nan, dtype.numpy_dtype), tc)  # poison
    block, grid = (tile, tile, 1), ((N + tile - 1) // tile, (M + tile - 1) // tile, 1)
    backend.launch_kernel(kernel.name, grid, ta, tb, tc, M, N, K, block_size=block)
    out = backend.to_host(tc)
    if dtype is DT.BFLOAT16:
        out = cb.from_bfloat16_bits(out)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    rel = np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref)
    tol = {DT.FLOAT32: 1e-5 * np.sqrt(K), DT.FLOAT64: 1e-12, DT.FLOAT16: 1e-2,
           DT.BFLOAT16: 1e-2}[dtype]
    assert np.isfinite(out).all() and rel < tol
    for t in (ta, tb, tc):
        t.free()


def test_seed_kernel_optimization_example(backend):
    gen = cb.get_kernel_generator()
    src = gen.generate_matrix_multiply_kernel(dtype=DT.FLOAT32, use_tiled=True, tile_size=32)
    backend.compile_kernel("optimized_matmul", src)
    block, grid = gen.optimize_kernel_parameters("matrix_multiply", (1024, 1024, 1024))
    assert block == (32, 32, 1) and grid == (32, 32, 1)


# -- profiling ------------------------------------------------------------------------
def test_profiling_stats_and_export(backend, tmp_path):
    backend.enable_profiling = True
    try:
        backend.profiler.reset()
        backend.compile_kernel("saxpy_test", SAXPY)
        x = backend.to_device(np.ones(1 << 16, np.float32))
        ms = backend.launch_kernel("saxpy_test", (256,), x, x, 2.0, 1 << 16)
        assert ms > 0
        backend.to_host(x)
        x.free()
        stats = backend.get_performance_stats()
        k = stats["kernel_execution_times"]["saxpy_test"]
        assert k["total_executions"] == 1 and k["min_ms"] <= k["average_ms"] <= k["max_ms"]
        for kind in ("htod", "dtoh"):
            t = stats["memory_transfer_times"][kind]
            assert t["count"] >= 1 and t["total_bytes"] >= 1 << 18 and t["average_gbps"] > 0
        path = backend.export_performance_report(str(tmp_path / "r.json"))
        doc = json.load(open(path))
        assert doc["devices"][0]["name"] == backend.devices[0].name
        assert doc["versions"]["pycuda"] and doc["versions"]["cuda_driver"]
        assert "saxpy_test" in doc["kernel_execution_times"]
        trace = json.load(open(backend.export_chrome_trace(str(tmp_path / "trace.json"))))
        names = {e["name"] for e in trace["traceEvents"]}
        assert "saxpy_test" in names and "memcpy htod" in names
        assert all(e["ph"] == "X" and e["dur"] >= 0 for e in trace["traceEvents"])
    finally:
        backend.enable_profiling = False
    assert backend.launch_kernel("saxpy_test", (1,), backend.to_device(np.ones(4, np.float32)),
                                 backend.to_device(np.ones(4, np.float32)), 1.0, 4) == 0.0


# -- interop --------------------------------------------------------------------------
def test_cupy_interop_zero_copy(backend):
    cp = pytest.importorskip("cupy")
    t = backend.to_device(np.arange(10, dtype=np.float32))
    view = cp.asarray(t)
    view[3] = 42.0
    cp.cuda.runtime.deviceSynchronize()
    assert backend.to_host(t)[3] == 42.0
    c = cp.arange(6, dtype=cp.float64).reshape(2, 3)
    w = cb.CudaTensor.from_cuda_array(c)
    assert w.shape == (2, 3) and w.dtype is DT.FLOAT64
    backend.copy_to_device(np.full((2, 3), 7.0), w)
    assert float(c[1, 2]) == 7.0
    t.free()


def test_torch_interop_zero_copy(backend):
    torch = pytest.importorskip("torch")
    t = backend.to_device(np.arange(8, dtype=np.int32))
    tt = torch.as_tensor(t, device="cuda")
    tt[0] = -5
    torch.cuda.synchronize()
    assert backend.to_host(t)[0] == -5
    src = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    w = cb.CudaTensor.from_cuda_array(src)
    assert w.shape == (3, 4) and w.device_id == src.device.index
    backend.copy_to_device(np.ones((3, 4), np.float32), w)
    assert float(src.sum()) == 12.0
    t.free()


# -- exit -----------------------------------------------------------------------------
@pytest.mark.parametrize("scenario", ["normal", "exception", "thread", "profiled"])
def test_clean_exit(scenario):
    body = {
        "normal": "t = b.to_device(np.ones(100, np.float32)); b.set_device(0)",
        "exception": "t = b.to_device(np.ones(100, np.float32)); raise ValueError('boom')",
        "thread": textwrap.dedent("""
            import threading
            def w():
                b.set_device(0)
                x = b.to_device(np.ones(100, np.float32))
                b.to_host(x)
            th = threading.Thread(target=w); th.start(); th.join()
            t = b.to_device(np.ones(100, np.float32))
        """),
        "profiled": "b.enable_profiling = True; t = b.to_device(np.ones(100, np.float32)); "
                    "b.compile_kernel('k', 'extern \"C\" __global__ void k(float* x) {}'); "
                    "b.launch_kernel('k', (1,), t)",
    }[scenario]
    code = "import numpy as np, cuda_backend as cb\nb = cb.get_cuda_backend()\n" + body
    r = run_py(code)
    if scenario == "exception":
        assert r.returncode == 1 and "ValueError: boom" in r.stderr
    else:
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    for bad in ("context stack", "PyCUDA WARNING", "PyCUDA ERROR", "CUDA_ERROR", "abort"):
        assert bad not in r.stderr, r.stderr


@pytest.mark.planted_fault
def test_kernel_fault_reports_dead_context():
    code = r'''
        import sys, numpy as np, cuda_backend as cb
        b = cb.get_cuda_backend()
        src = 'extern "C" __global__ void oob(const float* x, float* y) { y[0] = x[1LL << 40]; }'
        b.compile_kernel("oob", src)
        x = b.to_device(np.ones(4, np.float32))
        try:
            b.launch_kernel("oob", (1,), x, x, block_size=(1,))
            b.synchronize()
        except cb.KernelLaunchError as exc:
            print("ERROR:", exc)
            sys.exit(3)
        sys.exit(0)
    '''
    r = run_py(code, timeout=120)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "no longer usable" in r.stdout and "illegal" in r.stdout.lower()


# -- the host<->device fast path (transfers.py direct_htod / direct_dtoh) ------------------
def test_small_copies_fast_path_round_trip(backend):
    """copy_to_device / copy_from_device / to_device / to_host and CudaMath.from_numpy /
    to_numpy on the legacy stream with profiling off (one synchronous driver copy, wall-clock
    ms, no events): exact round trips for every dtype, pageable and pinned host arrays, raw
    pointers, non-contiguous and byte-swapped arrays; a second call of each gives the same
    data (the first may take the general path); the returned ms are positive."""
    from cuda_backend.cuda_math import CudaMath
    m = CudaMath(backend)
    rng = np.random.default_rng(5)
    for dtype in (np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.bool_):
        for n in (1, 7, 1024, 100_003):
            for _ in range(2):
                a = fresh((n,), dtype, rng)
                t = m.from_numpy(a)
                assert np.array_equal(m.to_numpy(t), a)
                b = fresh((n,), dtype, rng)
                assert backend.copy_to_device(b, t) > 0
                out = np.empty_like(b)
                assert backend.copy_from_device(t, out) > 0
                assert np.array_equal(out, b)
                t2 = backend.to_device(a.reshape(1, n))
                assert np.array_equal(backend.to_host(t2), a.reshape(1, n))
                t.free(), t2.free()
    h = backend.pinned_empty((4096,), np.float32)
    h[:] = rng.standard_normal(4096)
    t = backend.empty((4096,), DT.FLOAT32)
    backend.copy_to_device(h, t)
    h2 = backend.pinned_empty((4096,), np.float32)
    backend.copy_from_device(t, h2)                 # synchronous: ready on return
    assert np.array_equal(h, h2)
    ptr = backend.allocate_memory(4096 * 4)
    backend.copy_to_device(h, ptr)
    back = np.empty(4096, np.float32)
    backend.copy_from_device(ptr, back)
    assert np.array_equal(back, h)
    backend.free_memory(ptr)
    wide = rng.standard_normal((64, 2)).astype(np.float32)
    t3 = backend.empty((64,), DT.FLOAT32)
    backend.copy_to_device(wide[:, 1], t3)          # strided: the general path
    col = np.zeros((64, 2), np.float32)[:, 0]
    backend.copy_from_device(t3, col)
    assert np.array_equal(col, wide[:, 1])
    assert np.array_equal(m.to_numpy(m.from_numpy(wide.astype(">f4"))), wide)
    bf = m.from_numpy(wide, dtype=DT.BFLOAT16)
    np.testing.assert_allclose(m.to_numpy(bf), wide, rtol=1e-2)
    t.free(), t3.free(), bf.free()


def test_small_copies_on_a_stream_and_profiled(backend):
    """A copy inside `with stream:` stays on that stream (ordered after the stream's kernels;
    copy_from_device returns after them), copy() queues its device copy there; with profiling
    on the copies are timed with events and recorded."""
    from cuda_backend.cuda_math import CudaMath
    m = CudaMath(backend)
    n = 1 << 22
    x = m.from_numpy(np.zeros(n, np.float32))
    m.fill(x, 0.0), m.fill(x, 0.0)                 # the fill plan exists
    stream = backend.stream()
    out = np.empty(n, np.float32)
    for i in range(3):
        with stream:
            m.fill(x, float(i + 1))                 # queued on the stream
            y = m.copy(x)
            backend.copy_from_device(y, out)        # on the stream: waits for both
        assert (out == i + 1).all()
        with stream:
            backend.copy_to_device(np.full(n, 7.0, np.float32), x)
            z = m.multiply(x, 2.0)
            got = m.to_numpy(z)
        assert (got == 14.0).all()
        y.free(), z.free()
    backend.enable_profiling = True
    try:
        backend.profiler.reset()
        t = m.from_numpy(np.ones(4096, np.float32))
        m.to_numpy(t)
        stats = backend.get_performance_stats()["memory_transfer_times"]
        assert stats["htod"]["count"] >= 1 and stats["dtoh"]["count"] >= 1
    finally:
        backend.enable_profiling = False
    x.free()
