"""Host <-> device copies and their timing.

A copy on the legacy default stream with profiling off is one synchronous driver call
(cuMemcpyHtoD / cuMemcpyDtoH: the host waits for it, pinned or pageable), timed by the wall
clock; a copy on a stream (given, or a `with stream:` block's) or with profiling on is queued
between two CUDA events and waits for the end event, and the events give its milliseconds
(the profiler records those). `direct_htod` / `direct_dtoh` are the per-call fast path of
`CudaBackend.copy_to_device` / `copy_from_device` for a tensor and a matching host array.

Page-locked host arrays go straight to the DMA engine. Large pageable host-to-device copies
are staged through two page-locked buffers from the backend's `PageLockedMemoryPool`, so the
host copy of one chunk overlaps the DMA of the previous one. Device-to-host copies into
pageable memory use the driver's own path, which measured faster than staging (perf/NOTES.md).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, List, Optional

import numpy as np

from .errors import TransferError, driver_failure

if TYPE_CHECKING:
    from .profiling import Profiler

STAGING_THRESHOLD = 32 << 20  # bytes; below this the driver's own pageable path is used
STAGING_CHUNK = 16 << 20


def is_pinned(array: np.ndarray) -> bool:
    """True if the array's memory is page-locked by PyCUDA (pagelocked_empty, the pools,
    register_host_memory)."""
    obj: Any = array
    for _ in range(8):
        obj = getattr(obj, "base", None)
        if obj is None:
            return False
        name = type(obj).__name__
        if "HostAllocation" in name or "HostMemory" in name or "HostPointer" in name:
            return True
    return False


def host_contiguous(array: Any) -> np.ndarray:
    """C-contiguous, native-endian view or copy of a host array."""
    a = np.asarray(array)
    if a.dtype.byteorder not in ("=", "|"):
        a = a.astype(a.dtype.newbyteorder("="))
    return a if a.flags.c_contiguous else np.array(a, order="C")


def bf16_from_host(m: Any, array: Any, dtype: Any, device_id: Optional[int],
                   bits: bool = False) -> Any:
    """CudaMath.from_numpy's bfloat16 tensors: an ml_dtypes.bfloat16 array, or with bits=True
    a uint16 array of bit patterns, is copied as it is (no rounding, NaN payloads kept); other
    arrays are rounded to bfloat16 (nearest even). A uint16 array without bits=True raises:
    whether its numbers or its bits are meant cannot be told."""
    from .dtypes import BFLOAT16_NUMPY, CudaDataType
    from .errors import DTypeMismatchError
    bf16 = CudaDataType.BFLOAT16
    if bits:
        if dtype is not None and CudaDataType.from_any(dtype) is not bf16:
            raise DTypeMismatchError(
                f"from_numpy(bits=True) makes a bfloat16 tensor from uint16 bit patterns; "
                f"dtype={dtype!r} contradicts it (leave dtype out)")
        raw = np.asarray(array)
        if raw.dtype != np.uint16:
            raise DTypeMismatchError(
                f"from_numpy(bits=True) takes a uint16 array of bfloat16 bit patterns, got "
                f"{raw.dtype}")
    elif array.dtype == BFLOAT16_NUMPY:
        raw = array.view(np.uint16)
    elif array.dtype == np.uint16:
        raise DTypeMismatchError(
            "from_numpy got a uint16 array for a bfloat16 tensor: its numbers would be "
            "rounded to bfloat16 (1 -> 1.0), not taken as bit patterns; pass bits=True for "
            "bit patterns, or an array of the values (ml_dtypes.bfloat16 or float32, e.g. "
            "from_bfloat16_bits(bits))")
    else:
        from .ops import common
        dev = m.backend.current_device if device_id is None else device_id
        return common.from_host(m, array, bf16, dev)
    host = host_contiguous(raw)
    out = m.backend.empty(host.shape, bf16, device_id)
    if out.nbytes:
        m.backend.copy_to_device(host, out)
    return out


class TransferEngine:
    """copy_to_device / copy_from_device / copy_device_to_device with event timing."""

    def __init__(self, drv: Any, contexts: Any, pinned_pool: Any) -> None:
        self._drv = drv
        self._contexts = contexts
        self._pinned = pinned_pool
        self.profiler: Optional[Profiler] = None
        self.staging_threshold = STAGING_THRESHOLD
        self.staging_chunk = STAGING_CHUNK

    # -- helpers ------------------------------------------------------------------
    def _wall(self, kind: str, nbytes: int, device_id: int, work) -> float:
        """Run a synchronous copy (the host waits for it) on the legacy default stream with
        profiling off: no events, the wall clock gives the milliseconds."""
        with self._contexts.activate(device_id):
            return self._clocked(kind, nbytes, device_id, work)

    def _clocked(self, kind: str, nbytes: int, device_id: int, work: Any, *args: Any) -> float:
        """work(*args), a synchronous copy in the current context, timed by the wall clock
        (milliseconds); a driver error becomes the typed error naming the copy."""
        t0 = time.perf_counter()
        try:
            work(*args)
        except self._drv.Error as exc:
            raise driver_failure(f"{kind} copy of {nbytes} bytes on device {device_id}",
                                 exc, device_id) from None
        return (time.perf_counter() - t0) * 1e3

    def direct_htod(self, host: Any, tensor: Any) -> Optional[float]:
        """copy_to_device's common call: `host` (a NumPy array) into the live tensor `tensor`,
        the caller having checked `Launcher.direct(tensor.device_id)` (its context current,
        no `with stream:` block, profiling off). One synchronous cuMemcpyHtoD, timed by the
        wall clock; None when the call is not that case (the general path then checks and
        copies: freed tensor, other dtype or size, non-contiguous, empty, staged size)."""
        ptr = tensor._ptr
        nbytes = host.nbytes
        hd, nd = host.dtype, tensor.dtype.numpy_dtype
        if ptr is None or not nbytes or (hd is not nd and hd != nd) or \
                host.size != tensor.size or nbytes >= self.staging_threshold or \
                self.profiler is not None or not host.flags.c_contiguous:
            return None
        return self._clocked("htod", nbytes, tensor.device_id, self._drv.memcpy_htod, ptr, host)

    def direct_dtoh(self, tensor: Any, host: Any) -> Optional[float]:
        """copy_from_device's common call, as direct_htod: one synchronous cuMemcpyDtoH into a
        writeable C-contiguous host array of the tensor's dtype and size; None otherwise."""
        ptr = tensor._ptr
        nbytes = host.nbytes
        hd, nd = host.dtype, tensor.dtype.numpy_dtype
        if ptr is None or not nbytes or (hd is not nd and hd != nd) or \
                host.size != tensor.size or self.profiler is not None:
            return None
        flags = host.flags
        if not flags.c_contiguous or not flags.writeable:
            return None
        return self._clocked("dtoh", nbytes, tensor.device_id, self._drv.memcpy_dtoh, host, ptr)

    def _timed(self, kind: str, nbytes: int, device_id: int, stream: Any, work) -> float:
        drv = self._drv
        with self._contexts.activate(device_id):
            start, end = drv.Event(), drv.Event()
            t0 = time.perf_counter()
            start.record(stream)
            try:
                work()
                end.record(stream)
                end.synchronize()
            except drv.Error as exc:
                raise driver_failure(f"{kind} copy of {nbytes} bytes on device {device_id}",
                                     exc, device_id) from None
            ms = end.time_since(start)
        if self.profiler is not None:
            self.profiler.record_transfer(kind, nbytes, ms, device_id, t0)
        return ms

    # -- host to device -----------------------------------------------------------
    def to_device(self, host: np.ndarray, dst_ptr: int, device_id: int, stream: Any = None,
                  capacity: Optional[int] = None) -> float:
        nbytes = host.nbytes
        if capacity is not None and nbytes > capacity:
            raise TransferError(
                f"host array of {nbytes} bytes does not fit the destination of {capacity} bytes")
        if nbytes == 0:
            return 0.0
        drv = self._drv
        if stream is None and self.profiler is None and nbytes < self.staging_threshold:
            # synchronous for pinned and pageable memory alike: no events needed
            return self._wall("htod", nbytes, device_id, lambda: drv.memcpy_htod(dst_ptr, host))
        if is_pinned(host):
            def work():
                drv.memcpy_htod_async(dst_ptr, host, stream)
        elif nbytes >= self.staging_threshold:
            def work():
                self._staged_htod(host, dst_ptr, stream)
        else:
            def work():
                drv.memcpy_htod(dst_ptr, host) if stream is None else \
                    drv.memcpy_htod_async(dst_ptr, host, stream)
        return self._timed("htod", nbytes, device_id, stream, work)

    def _staged_htod(self, host: np.ndarray, dst_ptr: int, stream: Any) -> None:
        drv = self._drv
        src = host.reshape(-1).view(np.uint8)
        chunk = self.staging_chunk
        own_stream = stream or drv.Stream()
        bufs = [self._pinned.empty((chunk,), np.uint8) for _ in range(2)]
        done: List[Any] = [None, None]      # (driver events)
        for i, off in enumerate(range(0, src.size, chunk)):
            n = min(chunk, src.size - off)
            slot = i & 1
            if done[slot] is not None:
                done[slot].synchronize()
            np.copyto(bufs[slot][:n], src[off:off + n])
            drv.memcpy_htod_async(dst_ptr + off, bufs[slot][:n], own_stream)
            ev = drv.Event()
            ev.record(own_stream)
            done[slot] = ev
        for ev in done:
            if ev is not None:
                ev.synchronize()

    # -- device to host -----------------------------------------------------------
    def from_device(self, host: np.ndarray, src_ptr: int, device_id: int, stream: Any = None,
                    capacity: Optional[int] = None) -> float:
        nbytes = host.nbytes
        if capacity is not None and nbytes > capacity:
            raise TransferError(
                f"host array of {nbytes} bytes is larger than the device source of "
                f"{capacity} bytes")
        if not host.flags.c_contiguous or not host.flags.writeable:
            raise TransferError("copy_from_device needs a writeable C-contiguous host array")
        if nbytes == 0:
            return 0.0
        drv = self._drv
        if stream is None and self.profiler is None:
            # returns once the copy is done, pinned or pageable: no events needed
            return self._wall("dtoh", nbytes, device_id, lambda: drv.memcpy_dtoh(host, src_ptr))
        if is_pinned(host) or stream is not None:
            def work():
                drv.memcpy_dtoh_async(host, src_ptr, stream)
        else:
            def work():
                drv.memcpy_dtoh(host, src_ptr)
        return self._timed("dtoh", nbytes, device_id, stream, work)

    # -- device to device ---------------------------------------------------------
    def device_to_device(self, dst_ptr: int, src_ptr: int, nbytes: int, device_id: int,
                         stream: Any = None) -> float:
        if nbytes == 0:
            return 0.0
        drv = self._drv

        def work():
            drv.memcpy_dtod_async(dst_ptr, src_ptr, nbytes, stream)
        return self._timed("dtod", nbytes, device_id, stream, work)

    # -- device to device, across GPUs ----------------------------------------------
    def peer(self, dst_ptr: int, dst_device: int, src_ptr: int, src_device: int, nbytes: int,
             peer_ok: bool, stream: Any = None) -> float:
        """Copy between devices: directly when peer access is enabled, else via the host."""
        if nbytes == 0:
            return 0.0
        drv = self._drv
        if peer_ok:
            dst_ctx = self._contexts.context(dst_device)
            src_ctx = self._contexts.context(src_device)

            def work():
                drv.memcpy_peer_async(dst_ptr, src_ptr, nbytes, dst_ctx, src_ctx, stream)
            return self._timed("peer", nbytes, dst_device, stream, work)
        staging = self._pinned.empty((nbytes,), np.uint8)
        with self._contexts.activate(src_device):
            ms = self._timed("dtoh", nbytes, src_device, None,
                             lambda: drv.memcpy_dtoh(staging, src_ptr))
        return ms + self._timed("htod", nbytes, dst_device, stream,
                                lambda: drv.memcpy_htod_async(dst_ptr, staging, stream))
