"""The bounds check of take, gather and scatter_add (ops/indexing.py's module doc,
"Bounds"): the indices' checks, the device-side check kernel that sets an error slot
(`launch_check`, cuda_backend/device_errors.py), the launch of a main kernel behind it
(`checked_launch`), and the fallback's host-side equivalent (`host_indices`, `raise_bounds`).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from ..device_errors import LATER
from ..errors import (DTypeMismatchError, GraphCaptureError, IndexOutOfRangeError,
                      InvalidArgumentError)
from ..tensor import CudaTensor
from . import common
from .indexing_kernels import (CHECK_BLOCK, CHECK_MAX_BLOCKS, CHECK_UNROLL, DT, INDEX_DTYPES,
                               TEMPLATE, check_params)


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


def check_grid(n: int) -> int:
    """Blocks of the bounds check over n indices (its flag words)."""
    return max(1, min(-(-n // (CHECK_BLOCK * CHECK_UNROLL)), CHECK_MAX_BLOCKS))


def prepared_check(m: Any, idx: CudaTensor, dev: int) -> Any:
    """The check kernel's PreparedLaunch over indices like idx on dev (a plan's bounds check
    before its main launch)."""
    backend = m.backend
    return backend.prepare_launch(
        backend.get_kernel(m.kernel(TEMPLATE, dev, **check_params(idx.dtype)).name, dev),
        (check_grid(idx.size), 1, 1), (CHECK_BLOCK, 1, 1), 0, dev)


def refuse_capture(what: str, dev: int, check_bounds: bool) -> None:
    """GraphCaptureError when a bounds-checked call is made inside a capture (the host waits
    for its check); called before anything is allocated, so the capture's pool is untouched."""
    if check_bounds:
        from ..streams import capturing
        if capturing(dev):
            raise GraphCaptureError(
                f"{what} with check_bounds=True cannot be recorded into a CUDA graph (the host "
                f"waits for its bounds check); pass check_bounds=False inside the capture")


def bounds_slot(m: Any, what: str, ax: int, size: int) -> int:
    """The device pointer of the error slot (device_errors.py) of what's bounds check over an
    axis ax of this size: the check kernel sets it, the next synchronizing call raises."""
    message = _bounds_message(what, ax, size) + LATER
    return m.backend.error_slot(("bounds", what, ax, size),
                                lambda detail: IndexOutOfRangeError(message))


def launch_check(m: Any, idx: CudaTensor, size: int, what: str, ax: int,
                 prepared: Any = None) -> None:
    """Queue the check of idx against [-size, size) on the current stream (prepared: a
    per-call plan's launch of the check kernel over indices like idx); nothing waits for it."""
    dev = idx.device_id
    refuse_capture(what, dev, True)
    slot = bounds_slot(m, what, ax, size)
    n = idx.size
    if prepared is not None:
        prepared(slot, idx._ptr, n, size)
        return
    name = m.kernel(TEMPLATE, dev, **check_params(idx.dtype)).name
    m.backend.launch_kernel(name, (check_grid(n), 1, 1), slot, idx, n, size,
                            block_size=(CHECK_BLOCK, 1, 1), device_id=dev)


def host_indices(idx: np.ndarray, size: int, check_bounds: bool, what: str,
                 ax: int) -> Tuple[np.ndarray, np.ndarray]:
    """Fallback: (indices wrapped into [0, size) with bad ones at 0, mask of the bad ones)."""
    j = idx.astype(np.int64)
    j = np.where(j < 0, j + size, j)
    bad = (j < 0) | (j >= size)
    return np.where(bad, 0, j), bad


def raise_bounds(what: str, ax: int, size: int) -> None:
    raise IndexOutOfRangeError(_bounds_message(what, ax, size))


def checked_launch(m: Any, what: str, idx: CudaTensor, size: int, ax: int, check: Any,
                   out: Optional[CudaTensor], free_out: bool, launch: Any, *args: Any,
                   **kwargs: Any) -> None:
    """launch(*args, **kwargs) queued behind the bounds check of idx (launch_check) when
    check is True or a plan's prepared check (None or False: no check); out freed when the
    check cannot be queued, and when the launch raises if free_out."""
    if check is not None and check is not False:
        try:
            launch_check(m, idx, size, what, ax, None if check is True else check)
        except BaseException:
            if out is not None:
                out.free()
            raise
    try:
        launch(*args, **kwargs)
    except BaseException:
        if free_out and out is not None:
            out.free()
        raise
