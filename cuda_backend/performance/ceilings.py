"""The device's ceilings that each case is compared against.

Memory: measured in the same run by a large device-to-device copy, counting bytes read plus
bytes written (2 x size / time); the copy is >= 8x the L2 size so the cache holds none of it.
In fallback mode the same is done with a host memcpy (np.copyto).

Compute (peak FLOP/s, from the device's reported SM count and maximum clock):
    FP32 peak = SMs x clock x 2 (an FMA is 2 FLOPs) x FP32 lanes per SM
    FP64 peak = SMs x clock x 2 x FP64 lanes per SM
    tensor-core peak = SMs x clock x dense tensor FLOPs per clock per SM (per input type)
Lanes and tensor rates per SM come from NVIDIA's architecture whitepapers; e.g. sm_90 (H100,
H200): 128 FP32 lanes, 64 FP64 lanes, 4096 FP16/BF16, 2048 TF32 and 256 FP64 tensor FLOPs per
clock per SM (132 SMs x 1.98 GHz x 2 x 128 = 66.9 TFLOP/s FP32). The reported clock is the
maximum boost clock, so these are upper bounds (tensor-core work usually runs a little lower).
Architectures missing from the tables get no compute ceiling rather than a guess.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np

from .timing import HostTimer, stats

# FP32 and FP64 lanes (FMA units) per SM, by compute capability.
FP32_LANES: Dict[Tuple[int, int], int] = {
    (6, 0): 64, (6, 1): 128, (6, 2): 128, (7, 0): 64, (7, 2): 64, (7, 5): 64,
    (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128, (9, 0): 128,
}
FP64_LANES: Dict[Tuple[int, int], int] = {(6, 0): 32, (7, 0): 32, (8, 0): 32, (9, 0): 64}
# Dense tensor-core FLOPs per clock per SM.
TENSOR_FLOPS_PER_CLOCK: Dict[Tuple[int, int], Dict[str, int]] = {
    (8, 0): {"fp16_tensor": 2048, "bf16_tensor": 2048, "tf32_tensor": 1024, "fp64_tensor": 128},
    (9, 0): {"fp16_tensor": 4096, "bf16_tensor": 4096, "tf32_tensor": 2048, "fp64_tensor": 256},
}


def compute_peaks(info: Any) -> Dict[str, Dict[str, Any]]:
    """{unit: {"gflops": peak or None, "formula": how it was computed}} for the device."""
    cc = tuple(info.compute_capability)
    sms, clock_hz = info.multiprocessor_count, info.clock_rate_khz * 1e3
    peaks: Dict[str, Dict[str, Any]] = {}
    if cc == (0, 0) or clock_hz <= 0:
        reason = "no GPU (fallback mode): the host CPU's peak is not modelled"
        for unit in ("fp32", "fp64"):
            peaks[unit] = {"gflops": None, "formula": reason}
        return peaks
    head = f"{sms} SMs x {clock_hz / 1e9:.3f} GHz"
    for unit, table in (("fp32", FP32_LANES), ("fp64", FP64_LANES)):
        lanes = table.get(cc)
        if lanes is None:
            peaks[unit] = {"gflops": None,
                           "formula": f"{unit} lanes per SM not known for sm_{cc[0]}{cc[1]}"}
        else:
            peaks[unit] = {"gflops": sms * clock_hz * 2 * lanes / 1e9,
                           "formula": f"{head} x 2 x {lanes} {unit.upper()} lanes/SM"}
    for unit, per_clock in TENSOR_FLOPS_PER_CLOCK.get(cc, {}).items():
        peaks[unit] = {"gflops": sms * clock_hz * per_clock / 1e9,
                       "formula": f"{head} x {per_clock} dense FLOPs/clock/SM"}
    return peaks


def copy_size(backend: Any, device_id: int, quick: bool) -> int:
    """Bytes for the bandwidth copy: >= 8x L2 and >= 1 GiB (2 GiB in a full run), within a
    quarter of device memory; a copy that size takes well under a millisecond on a GPU."""
    if not backend.is_available:
        return (32 << 20) if quick else (256 << 20)
    info = backend.devices[device_id]
    want = max(8 * info.l2_cache_size, (1 << 30) if quick else (2 << 30))
    return int(min(want, info.memory_total // 4))


def measure_copy_bandwidth(backend: Any, timer: Any, device_id: int, quick: bool,
                           iterations: int) -> Dict[str, Any]:
    """Median GB/s of a large copy (bytes read + written) and how it was measured."""
    nbytes = copy_size(backend, device_id, quick)
    if backend.is_available:
        src = backend.allocate_memory(nbytes, device_id)
        dst = None
        try:
            dst = backend.allocate_memory(nbytes, device_id)
            samples = timer.time(
                lambda: backend.copy_device_to_device(dst, src, nbytes, device_id=device_id),
                warmup=2, iterations=iterations, flush=False)
        finally:
            backend.free_memory(src, device_id)
            if dst is not None:
                backend.free_memory(dst, device_id)
        method = "device-to-device copy (copy_device_to_device), CUDA events"
    else:
        n = nbytes // 4
        src_h = np.ones(n, np.float32)
        dst_h = np.empty_like(src_h)
        samples = HostTimer().time(lambda: np.copyto(dst_h, src_h), warmup=1,
                                   iterations=iterations)
        method = "host memcpy (np.copyto), host clock: fallback mode has no device"
    st = stats(samples)
    if st is None:
        raise ValueError("the copy bandwidth could not be measured: no copy was timed")
    gbps = 2 * nbytes / (st["median"] * 1e-3) / 1e9 if st["median"] > 0 else None
    return {"gbps": gbps, "bytes": nbytes, "time_ms": st,
            "method": method + "; counts bytes read + bytes written"}


def measure(backend: Any, timer: Any, device_id: int, quick: bool,
            iterations: int) -> Dict[str, Any]:
    """All ceilings: measured memory bandwidth and the compute peaks."""
    info = backend.devices[device_id]
    bw = measure_copy_bandwidth(backend, timer, device_id, quick, iterations)
    return {
        "memory_bandwidth_gbps": bw["gbps"],
        "memory_bandwidth": bw,
        "theoretical_bandwidth_gbps": (round(info.theoretical_bandwidth_gbps, 1)
                                       if backend.is_available else None),
        "compute": compute_peaks(info),
    }


def compute_peak(ceilings: Dict[str, Any], unit: Optional[str]) -> Optional[float]:
    """The GFLOP/s peak of a unit ('fp32', 'tf32_tensor', ...) or None when not known."""
    if unit is None:
        return None
    entry = ceilings.get("compute", {}).get(unit)
    return entry.get("gflops") if entry else None
