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
