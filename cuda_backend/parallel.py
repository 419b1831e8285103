"""Data parallelism across the GPUs of one host: scatter, gather, broadcast, all_reduce and
data_parallel. Copies go peer-to-peer when the devices allow it (enabled once per pair)."""
from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from .backend import get_cuda_backend
from .errors import InvalidArgumentError, ShapeMismatchError
from .tensor import CudaTensor


def _math() -> Any:
    from .cuda_math import get_cuda_math
    return get_cuda_math()


def _view(t: CudaTensor, start: int, count: int) -> CudaTensor:
    """A 1-D view of count elements of t from element start (keeps t alive)."""
    return CudaTensor((count,), t.dtype, t.device_id, t.ptr + start * t.dtype.itemsize, owner=t)


def _split_sizes(n: int, parts: int) -> List[int]:
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def scatter(array: Any, devices: Sequence[int], axis: int = 0) -> List[CudaTensor]:
    """Split a host array into len(devices) nearly equal parts along axis, one per device."""
    if not devices:
        raise InvalidArgumentError("scatter needs at least one device")
    m = _math()
    parts = np.array_split(np.asarray(array), len(devices), axis=axis)
    return [m.from_numpy(np.ascontiguousarray(p), device_id=d) for p, d in zip(parts, devices)]


def gather(tensors: Sequence[CudaTensor], axis: int = 0,
           device_id: Optional[int] = None) -> CudaTensor:
    """Concatenate tensors (from any devices) along axis into one tensor on device_id
    (default: the first tensor's device). axis 0 is copied device-to-device."""
    if not tensors:
        raise InvalidArgumentError("gather needs at least one tensor")
    b = get_cuda_backend()
    first = tensors[0]
    dev = first.device_id if device_id is None else device_id
    nd = first.ndim
    ax = axis % nd if nd else 0
    for t in tensors[1:]:
        if t.dtype is not first.dtype or t.ndim != nd or \
                t.shape[:ax] + t.shape[ax + 1:] != first.shape[:ax] + first.shape[ax + 1:]:
            raise ShapeMismatchError(
                f"gather along axis {axis}: shapes {first.shape} ({first.dtype.name_str}) and "
                f"{t.shape} ({t.dtype.name_str}) do not fit together")
    if ax != 0:
        m = _math()
        host = np.concatenate([m.to_numpy(t) for t in tensors], axis=ax)
        return m.from_numpy(host, device_id=dev, dtype=first.dtype)
    shape = (sum(t.shape[0] for t in tensors),) + first.shape[1:]
    out = b.empty(shape, first.dtype, dev)
    offset = 0
    for t in tensors:
        if t.size:
            part = _view(out, offset, t.size)
            src = t.to(dev) if t.device_id != dev else t
            b.copy_device_to_device(part, src, t.nbytes)
            offset += t.size
    return out


def broadcast(tensor: CudaTensor, devices: Sequence[int]) -> List[CudaTensor]:
    """A copy of tensor on every device (the tensor itself where it already lives)."""
    return [tensor if d == tensor.device_id else tensor.to(d) for d in devices]


def _all_reduce_operands(tensors: Sequence[CudaTensor], op: str) -> List[CudaTensor]:
    """all_reduce's checks: a known op, one tensor per device, equal shapes and dtypes."""
    if op not in ("sum", "max", "min", "mean"):
        raise InvalidArgumentError(f"op must be sum, max, min or mean, got {op!r}")
    tensors = list(tensors)
    if not tensors:
        raise InvalidArgumentError("all_reduce needs at least one tensor")
    first = tensors[0]
    devs = [t.device_id for t in tensors]
    if len(set(devs)) != len(devs):
        raise InvalidArgumentError(f"all_reduce needs one tensor per device, got devices {devs}")
    for t in tensors[1:]:
        if t.shape != first.shape or t.dtype is not first.dtype:
            raise ShapeMismatchError(
                f"all_reduce needs equal shapes and dtypes: {first.shape} "
                f"({first.dtype.name_str}) vs {t.shape} ({t.dtype.name_str})")
    return tensors


def all_reduce(tensors: Sequence[CudaTensor], op: str = "sum") -> List[CudaTensor]:
    """Reduce same-shape tensors living on different devices, in place, so each holds the
    result. Ring algorithm: reduce-scatter then all-gather, one stream per device, peer
    copies ordered by events, so every link is busy at once."""
    tensors = _all_reduce_operands(tensors, op)
    first = tensors[0]
    devs = [t.device_id for t in tensors]
    n = len(tensors)
    m = _math()
    from .ops import elementwise as ew
    binop = {"sum": "add", "mean": "add", "max": "maximum", "min": "minimum"}[op]
    if n > 1 and first.size:
        b = get_cuda_backend()
        for i in range(n):
            for j in range(n):
                if i != j:
                    b.enable_peer_access(devs[i], devs[j])
        sizes = _split_sizes(first.size, n)
        starts = [sum(sizes[:i]) for i in range(n)]
        streams = [b.stream(d) for d in devs]
        tmp = [b.empty((max(sizes),), first.dtype, d) for d in devs]
        events = [None] * n

        def step(r: int, chunk: int, reduce: bool) -> Any:
            src = (r - 1) % n
            dst_t, src_t = tensors[r], tensors[src]
            count = sizes[chunk]
            if events[src] is not None:
                streams[r].wait_event(events[src])
            target = _view(tmp[r], 0, count) if reduce else _view(dst_t, starts[chunk], count)
            with b.activate(devs[r]):
                b.drv.memcpy_peer_async(target.ptr, src_t.ptr + starts[chunk] * first.dtype.itemsize,
                                         count * first.dtype.itemsize,
                                         b.context(devs[r]), b.context(devs[src]),
                                         streams[r].pycuda_stream)
            if reduce:
                mine = _view(dst_t, starts[chunk], count)
                with streams[r]:
                    ew.binary(m, binop, mine, target, out=mine)
            return streams[r].record_event()

        for k in range(n - 1):  # reduce-scatter: device r ends owning chunk (r + 1) % n
            new = [step(r, (r - k - 1) % n, True) for r in range(n)]
            events = new
        for k in range(n - 1):  # all-gather the reduced chunks around the ring
            new = [step(r, (r - k) % n, False) for r in range(n)]
            events = new
        for s in streams:
            s.synchronize()
        for t in tmp:
            t.free()
    if op == "mean":
        for t in tensors:
            ew.binary(m, "multiply", t, 1.0 / n, out=t)
    return tensors


def data_parallel(fn: Callable[[Any], Any], inputs: Sequence[Any],
                  devices: Sequence[int]) -> List[Any]:
    """Run fn(input_i) with devices[i] current, one host thread per device, concurrently;
    returns the results in order (the first exception is re-raised)."""
    if len(inputs) != len(devices):
        raise InvalidArgumentError(
            f"data_parallel got {len(inputs)} inputs for {len(devices)} devices")
    b = get_cuda_backend()
    results: List[Any] = [None] * len(inputs)
    errors: List[BaseException] = []

    def run(i: int) -> None:
        try:
            with b.device(devices[i]):
                results[i] = fn(inputs[i])
                b.synchronize(devices[i])
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
