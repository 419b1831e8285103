"""The bounds check of take, gather and scatter_add (ops/indexing.py's module doc,
"Bounds"): the indices' checks, the device-side check kernel read back through page-locked
memory (`BoundsCheck`), the launch of a main kernel behind it (`checked_launch`), and the
fallback's host-side equivalent (`host_indices`, `raise_bounds`).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from ..errors import (DTypeMismatchError, GraphCaptureError, IndexOutOfRangeError,
                      InvalidArgumentError, driver_failure)
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


class BoundsCheck:
    """The bounds check of one call, before its main kernel (see the module doc): the check
    kernel writes a flag word per block, an asynchronous copy brings them to page-locked host
    memory and an event marks the copy; the caller then queues its main kernel and calls
    finish(), which waits for the event only (not for the main kernel) and raises."""

    __slots__ = ("host", "event", "device_id", "_error")

    def __init__(self, m: Any, idx: CudaTensor, size: int, what: str,
                 prepared: Any = None) -> None:
        from ..driver import load_driver
        from ..streams import current_stream
        dev = self.device_id = idx.device_id
        refuse_capture(what, dev, True)
        backend = m.backend
        n = idx.size
        grid = check_grid(n)
        self._error = load_driver()[0].Error
        self.event = backend.event(dev, timing=False)
        self.host = backend.pinned_empty((grid,), np.int32)
        flags = backend.empty((grid,), DT.INT32, dev)
        try:
            if prepared is not None:   # a per-call plan's launch of the check over n indices
                prepared(flags._ptr, idx._ptr, n, size)
            else:
                name = m.kernel(TEMPLATE, dev, **check_params(idx.dtype)).name
                backend.launch_kernel(name, (grid, 1, 1), flags, idx, n, size,
                                      block_size=(CHECK_BLOCK, 1, 1), device_id=dev)
            backend.copy_from_device_async(flags, self.host, None, dev)
            self.event.record(current_stream(dev))
        finally:
            flags.free()   # stream-ordered: reused only after the copy

    def abandon(self) -> None:
        """Wait for the copy without checking (the call failed before finish): the host
        buffer goes back to its pool only once nothing writes into it."""
        try:
            self.event.synchronize()
        except self._error:
            pass

    def finish(self, what: str, ax: int, size: int, out: Optional[CudaTensor] = None) -> None:
        """Wait for the flags (the main kernel may still run); raise IndexOutOfRangeError
        when one is set, out freed first."""
        try:
            self.event.synchronize()
        except self._error as exc:
            raise driver_failure(f"{what}: the bounds check", exc, self.device_id) from None
        if self.host.any():
            if out is not None:
                out.free()
            raise IndexOutOfRangeError(_bounds_message(what, ax, size))


def start_check(m: Any, idx: CudaTensor, size: int, what: str, check_bounds: bool,
                out: Optional[CudaTensor] = None, prepared: Any = None) -> Optional[BoundsCheck]:
    """A started BoundsCheck when asked for (None otherwise); out is freed when it cannot
    start (e.g. GraphCaptureError)."""
    if not check_bounds:
        return None
    try:
        return BoundsCheck(m, idx, size, what, prepared)
    except BaseException:
        if out is not None:
            out.free()
        raise


def host_indices(idx: np.ndarray, size: int, check_bounds: bool, what: str,
                 ax: int) -> Tuple[np.ndarray, np.ndarray]:
    """Fallback: (indices wrapped into [0, size) with bad ones at 0, mask of the bad ones)."""
    j = idx.astype(np.int64)
    j = np.where(j < 0, j + size, j)
    bad = (j < 0) | (j >= size)
    return np.where(bad, 0, j), bad


def raise_bounds(what: str, ax: int, size: int) -> None:
    raise IndexOutOfRangeError(_bounds_message(what, ax, size))


def checked_launch(m: Any, what: str, idx: CudaTensor, size: int, ax: int,
                   check_bounds: bool, out: Optional[CudaTensor], free_out: bool,
                   launch: Any, *args: Any, **kwargs: Any) -> None:
    """launch(*args, **kwargs) queued behind the bounds check of idx when check_bounds
    (start_check), then the check's finish (IndexOutOfRangeError, out freed first); when the
    launch raises, the check is abandoned and out freed if free_out."""
    check = start_check(m, idx, size, what, check_bounds, out)
    run_checked(check, what, ax, size, out, free_out, launch, *args, **kwargs)


def run_checked(check: Optional[BoundsCheck], what: str, ax: int, size: int,
                out: Optional[CudaTensor], free_out: bool, launch: Any, *args: Any,
                **kwargs: Any) -> None:
    """launch(*args, **kwargs) behind a started check (or None), then the check's finish;
    when the launch raises, the check is abandoned and out freed if free_out (the general
    paths through checked_launch, the per-call plans with their prepared check)."""
    try:
        launch(*args, **kwargs)
    except BaseException:
        if check is not None:
            check.abandon()
        if free_out and out is not None:
            out.free()
        raise
    if check is not None:
        check.finish(what, ax, size, out)
