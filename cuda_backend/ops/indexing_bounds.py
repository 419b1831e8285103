"""The bounds check of take, gather and scatter_add (ops/indexing.py's module doc,
"Bounds"): the indices' checks, the error slot their kernels set for an index out of range
(`bounds_slot`, cuda_backend/device_errors.py), and the fallback's host-side equivalent
(`host_indices`, `raise_bounds`).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from ..device_errors import LATER
from ..errors import (DTypeMismatchError, GraphCaptureError, IndexOutOfRangeError,
                      InvalidArgumentError)
from ..tensor import CudaTensor
from . import common
from .indexing_kernels import INDEX_DTYPES


def checked_indices(indices: Any, what: str) -> CudaTensor:
    if not isinstance(indices, CudaTensor):
        raise InvalidArgumentError(
            f"{what}: indices must be an int32 or int64 CudaTensor, got "
            f"{type(indices).__name__} (use from_numpy first)")
    common.check_tensor(indices, "indices")
    if indices.dtype not in INDEX_DTYPES:
        raise DTypeMismatchError(
            f"{what}: indices must be int32 or int64, got {indices.dtype.name_str}")
    return indices


def _bounds_message(what: str, ax: int, size: int) -> str:
    return (f"{what}: an index is out of bounds for axis {ax} with size {size} (indices must "
            f"be in [{-size}, {size}))")


def refuse_capture(what: str, dev: int, check_bounds: bool) -> None:
    """GraphCaptureError when a bounds-checked call is made inside a capture (captures take
    the unchecked calls only, as they always have; the device-side check itself could be
    replayed: device_errors.py); called before anything is allocated or recorded, so the
    capture's pool is untouched."""
    if check_bounds:
        from ..streams import capturing
        if capturing(dev):
            raise GraphCaptureError(
                f"{what} with check_bounds=True is not recorded into CUDA graphs; pass "
                f"check_bounds=False inside the capture")


def bounds_slot(m: Any, what: str, ax: int, size: int) -> int:
    """The device pointer of the error slot (device_errors.py) of what's bounds check over an
    axis ax of this size: the kernel reading the indices sets it, the next synchronizing call
    raises."""
    message = _bounds_message(what, ax, size) + LATER
    return m.backend.error_slot(("bounds", what, ax, size),
                                lambda detail: IndexOutOfRangeError(message))


def host_indices(idx: np.ndarray, size: int, check_bounds: bool, what: str,
                 ax: int) -> Tuple[np.ndarray, np.ndarray]:
    """Fallback: (indices wrapped into [0, size) with bad ones at 0, mask of the bad ones)."""
    j = idx.astype(np.int64)
    j = np.where(j < 0, j + size, j)
    bad = (j < 0) | (j >= size)
    return np.where(bad, 0, j), bad


def raise_bounds(what: str, ax: int, size: int) -> None:
    raise IndexOutOfRangeError(_bounds_message(what, ax, size))


def launch_or_free(out: Optional[CudaTensor], launch: Any, *args: Any, **kwargs: Any) -> None:
    """launch(*args, **kwargs); out (when given) freed when the launch raises."""
    try:
        launch(*args, **kwargs)
    except BaseException:
        if out is not None:
            out.free()
        raise
