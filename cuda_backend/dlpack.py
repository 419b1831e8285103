"""DLPack both ways: `CudaTensor.__dlpack__` / `__dlpack_device__` export and `from_dlpack`
imports, zero-copy, with the stream handshake of the Python array API standard.

Export. The capsule and its C-level lifetime come from NumPy: a NumPy array is made over the
tensor's memory (through `__array_interface__`, which never reads the memory) and its own
`__dlpack__` builds the DLManagedTensor(Versioned); we then set the device (kDLCUDA and the
device id), the dtype code (kDLBfloat for bfloat16, kDLBool for bool: NumPy's storage dtypes
are uint16 and uint8) and the flags. So the capsule's destructor and the consumer's deleter
are NumPy's C functions (they save a pending exception, take the GIL, and do nothing once the
interpreter is finalized) rather than ctypes callbacks, which cannot do either. The array
keeps an `_Export` alive, which keeps the tensor (and the tensors it is a view of) alive and
counts itself in their `_exports`, so that `free()` meanwhile defers the memory's return to
the moment the consumer calls the deleter.

Import (dlpack_import.py). `from_dlpack(obj)` asks obj for a capsule with this thread's
current stream on obj's device (`__dlpack__(stream=...)`: the producer orders it after its
pending writes), reads the DLTensor through ctypes, checks everything before it consumes the
capsule (renames it "used_dltensor[_versioned]"; a capsule rejected with an error is left to
its producer's destructor), and wraps the memory in a CudaTensor whose owner calls the
producer's deleter exactly once when the tensor goes (free() or garbage collection). The
DLPack structs and codes both sides read are dlpack_abi.py's.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

from .dlpack_abi import (DT, FLAG_IS_COPIED, KDL_CPU, KDL_CUDA, LOCK, TO_DL,
                         DLManagedTensor, DLManagedTensorVersioned, ReleasedWhenCollected,
                         capsule_pointer, describe_device, device_pair)
from .dtypes import CudaDataType
from .errors import InvalidArgumentError
from .tensor import CudaTensor, release_storage


# -- export ------------------------------------------------------------------------------------
class _Export(ReleasedWhenCollected):
    """What a NumPy array over an exported tensor's memory holds (its base): the tensor, and
    a count in `_exports` of it and of every tensor it is a view of, so that their free()
    leaves the memory to the consumer's release (this object's end)."""

    __slots__ = ("__array_interface__", "tensors", "__weakref__")

    def __init__(self, t: CudaTensor, ptr: int, typestr: str) -> None:
        self.__array_interface__ = {"data": (ptr, False), "shape": t.shape,
                                    "typestr": typestr, "version": 3}
        chain: List[CudaTensor] = []
        obj: Any = t
        while isinstance(obj, CudaTensor) and len(chain) < 64:
            chain.append(obj)
            obj = obj._owner
        with LOCK:
            for c in chain:
                c._exports += 1
        self.tensors = chain

    def release(self) -> None:
        chain, self.tensors = self.tensors, []
        done: List[CudaTensor] = []
        with LOCK:
            for c in chain:
                c._exports -= 1
                if c._exports == 0 and c._ptr is None:
                    done.append(c)       # freed while exported: its memory goes back now
        for c in done:
            release_storage(c)


def export(t: CudaTensor, stream: Any = None, max_version: Any = None, dl_device: Any = None,
           copy: Optional[bool] = None) -> Any:
    """CudaTensor.__dlpack__: a "dltensor" or "dltensor_versioned" capsule of t's memory."""
    t.check_alive()
    max_version = _max_version(max_version)
    versioned = max_version is not None and max_version[0] >= 1
    if copy is not None and type(copy) is not bool:
        raise InvalidArgumentError(f"__dlpack__: copy must be None, True or False, got {copy!r}")
    own = (KDL_CPU, 0) if t.on_host else (KDL_CUDA, t.device_id)
    target = own if dl_device is None else device_pair(dl_device, "__dlpack__: dl_device")
    flags = 0
    if target != own:
        if target != (KDL_CPU, 0) or t.on_host:
            raise DLPackExportError(
                f"__dlpack__: cannot export a tensor on {describe_device(own)} to "
                f"{describe_device(target)}: only a host copy ((1, 0), kDLCPU) can be made")
        if copy is False:
            raise DLPackExportError(
                "__dlpack__: dl_device=(1, 0) (the host) needs a copy of this device tensor, "
                "and copy=False forbids one")
        _check_stream(stream, on_host=True)
        host = _backend(t).to_host(t)   # the storage dtype: bfloat16 as its bits
        holder: object = _Host(host)
        return _capsule(holder, host.ctypes.data, (KDL_CPU, 0), t.dtype, max_version,
                        versioned, FLAG_IS_COPIED)
    _check_stream(stream, t.on_host)
    src = t
    if copy:
        src = _copy_of(t)
        flags |= FLAG_IS_COPIED
    if not t.on_host and stream != -1:
        _order_consumer(src, 1 if stream is None else int(stream))
    ptr = src.host_view.ctypes.data if t.on_host else src.ptr
    holder = _Export(src, ptr, _storage_typestr(src.dtype))
    return _capsule(holder, ptr, own, src.dtype, max_version, versioned, flags)


class DLPackExportError(InvalidArgumentError, BufferError):
    """The tensor cannot be exported as asked (the array API's BufferError)."""


class _Host:
    """The base of a host-copy export: keeps the copy alive."""

    __slots__ = ("__array_interface__", "array")

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.__array_interface__ = {"data": (array.ctypes.data, False), "shape": array.shape,
                                    "typestr": _storage_typestr_np(array.dtype), "version": 3}


def _storage_typestr(dtype: CudaDataType) -> str:
    """The NumPy typestr the export array is made with (bool as uint8: every NumPy version
    exports it; the DLPack dtype is set afterwards)."""
    return "|u1" if dtype is DT.BOOL else dtype.numpy_dtype.str


def _storage_typestr_np(dtype: np.dtype) -> str:
    return "|u1" if dtype == np.bool_ else dtype.str


def _capsule(holder: Any, ptr: int, device: Tuple[int, int], dtype: CudaDataType,
             max_version: Any, versioned: bool, flags: int) -> Any:
    """NumPy's capsule of an array over holder's memory, its device, dtype and flags set."""
    array = np.asarray(holder)
    capsule = None
    if versioned:
        try:
            capsule = array.__dlpack__(max_version=max_version)
        except TypeError:          # NumPy < 2.1 makes only legacy capsules
            versioned = False
    if capsule is None:
        capsule = array.__dlpack__()
    del array                      # the capsule holds it
    name = b"dltensor_versioned" if versioned else b"dltensor"
    address = capsule_pointer(capsule, name)
    if versioned:
        managed: Any = DLManagedTensorVersioned.from_address(address)
        managed.flags |= flags
    else:
        managed = DLManagedTensor.from_address(address)
    dl = managed.dl_tensor
    dl.device.device_type, dl.device.device_id = device
    dl.dtype.code, dl.dtype.bits = TO_DL[dtype]
    dl.dtype.lanes = 1
    if ptr == 0:
        dl.data = None             # an empty device tensor: NumPy put a host address there
    return capsule


def _copy_of(t: CudaTensor) -> CudaTensor:
    """copy=True: a new tensor with t's contents (a device copy on the current stream)."""
    from .tensor_math import math_for
    m = math_for(_backend(t))
    if t.on_host:
        out = m.backend.empty(t.shape, t.dtype, t.device_id)
        out.host_view[...] = t.host_view
        return out
    return m.copy(t)


def _backend(t: CudaTensor) -> Any:
    pool = t._pool
    if pool is not None and getattr(pool, "owner", None) is not None:
        return pool.owner
    from .backend import get_cuda_backend
    return get_cuda_backend()


def _max_version(max_version: Any) -> Optional[Tuple[int, int]]:
    """max_version as a (major, minor) tuple of ints, or None."""
    if max_version is None:
        return None
    try:
        major, minor = max_version
        ok = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                 for v in (major, minor))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise InvalidArgumentError(
            f"__dlpack__: max_version must be None or a (major, minor) tuple of ints, got "
            f"{max_version!r}")
    return int(major), int(minor)


def _check_stream(stream: Any, on_host: bool) -> None:
    if stream is None:
        return
    if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)):
        raise InvalidArgumentError(
            f"__dlpack__: stream must be None or an int (a CUDA stream handle; 1: legacy "
            f"default, 2: per-thread default, -1: no synchronization), got {stream!r}")
    if on_host and stream != -1:
        raise InvalidArgumentError(
            f"__dlpack__: this tensor is in host memory (fallback mode, or a host copy): "
            f"stream must be None or -1, got {stream}")
    if stream == 0 or stream < -1:
        raise InvalidArgumentError(
            f"__dlpack__: stream {stream} is not allowed (0 is ambiguous; use 1 for the legacy "
            f"default stream, 2 for the per-thread default stream, -1 for no synchronization)")


def _order_consumer(t: CudaTensor, consumer: int) -> None:
    """Make stream handle `consumer` wait for the work queued on the streams that last used
    t and the tensors it is a view of (events recorded on them now)."""
    from .driver import stream_wait_stream
    producers: List[int] = []
    obj: Any = t
    while isinstance(obj, CudaTensor) and len(producers) < 64:
        s = obj.stream
        handle = 1 if s is None else int(getattr(s, "handle", s))
        if handle not in producers:
            producers.append(handle)
        obj = obj._owner
    backend = _backend(t)
    with backend.activate(t.device_id):
        for handle in producers:
            if handle != consumer:
                stream_wait_stream(consumer, handle)
