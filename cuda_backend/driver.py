"""Loads PyCUDA's driver module once and says why not when it cannot.

Set `CUDA_BACKEND_FALLBACK=1` to force fallback mode on a machine that has a GPU.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Tuple

_cached: Optional[Tuple[Any, Optional[str]]] = None


def load_driver() -> Tuple[Any, Optional[str]]:
    """Return `(pycuda.driver, None)`, or `(None, reason)` when the GPU path is unavailable."""
    global _cached
    if _cached is not None:
        return _cached
    if os.environ.get("CUDA_BACKEND_FALLBACK", "") not in ("", "0"):
        _cached = (None, "CUDA_BACKEND_FALLBACK is set")
        return _cached
    try:
        import pycuda.driver as drv
    except Exception as exc:  # ImportError, or a broken build raising OSError
        _cached = (None, f"PyCUDA cannot be imported ({exc})")
        return _cached
    try:
        drv.init()
        count = drv.Device.count()
    except Exception as exc:
        _cached = (None, f"the CUDA driver cannot initialize ({exc})")
        return _cached
    if count == 0:
        _cached = (None, "no CUDA GPU was found")
        return _cached
    _cached = (drv, None)
    return _cached


def pycuda_version() -> Optional[str]:
    try:
        import pycuda
        return pycuda.VERSION_TEXT
    except Exception:
        return None


def stream_wait_stream(waiter: int, producer: int) -> None:
    """Make work issued to stream handle `waiter` after this call wait for the work already
    queued on stream handle `producer` (1: legacy default, 2: per-thread default), through
    an event. Driver calls PyCUDA does not wrap for foreign handles; the caller makes the
    right context current."""
    import ctypes
    lib = ctypes.CDLL("libcuda.so.1")
    ev = ctypes.c_void_p()
    disable_timing = 2
    res = lib.cuEventCreate(ctypes.byref(ev), ctypes.c_uint(disable_timing))
    if res == 0:
        try:
            res = lib.cuEventRecord(ev, ctypes.c_void_p(producer))
            if res == 0:
                res = lib.cuStreamWaitEvent(ctypes.c_void_p(waiter), ev, ctypes.c_uint(0))
        finally:
            lib.cuEventDestroy_v2(ev)
    if res != 0:
        from .errors import TransferError
        raise TransferError(
            f"cannot order stream 0x{waiter:x} after the exporter's stream 0x{producer:x} "
            f"(CUDA driver error {res}): the stream handle in __cuda_array_interface__ is "
            f"not a live stream of this device's context")
