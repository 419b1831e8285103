"""DLPack import: `from_dlpack(obj)`, zero-copy where a tensor can share the producer's
memory (dlpack.py's module doc, "Import"): the stream handshake with the producer, the
DLTensor read and checked through ctypes before the capsule is consumed, and the
`DLPackImport` owner that calls the producer's deleter exactly once; a copy where the memory
cannot be shared (strides, read-only, host memory on a GPU backend) or copy=True asks.
"""
from __future__ import annotations

import ctypes
import math
from typing import Any, Optional, Tuple

import numpy as np

from .dlpack_abi import (CAPSULE_TYPE, DELETER, FLAG_READ_ONLY, FROM_DL, KDL_CPU, KDL_CUDA,
                         KDL_CUDA_HOST, KDL_CUDA_MANAGED, LOCK, MAX_NDIM, MAX_VERSION,
                         SUPPORTED, USED, DLManagedTensor, DLManagedTensorVersioned, DLTensor,
                         ReleasedWhenCollected, capsule_is_valid, capsule_name,
                         capsule_pointer, capsule_set_name, describe_device, device_pair)
from .dtypes import CudaDataType
from .errors import (CudaNotAvailableError, DTypeMismatchError, InvalidArgumentError,
                     InvalidDeviceError)
from .ops.shape_layouts import is_contiguous
from .tensor import CudaTensor


# -- import ------------------------------------------------------------------------------------
class DLPackImport(ReleasedWhenCollected):
    """The owner of an imported tensor's memory: calls the producer's deleter exactly once,
    when release() is called or this object goes. Keeps the producer object alive too."""

    __slots__ = ("_managed", "_deleter", "producer", "__array_interface__", "__weakref__")
    __array_interface__: dict   # set only when NumPy is to read host memory through it

    def __init__(self, managed: int, deleter: Optional[int], producer: Any) -> None:
        self._managed: Optional[int] = managed
        self._deleter = deleter
        self.producer = producer

    def release(self) -> None:
        with LOCK:
            managed, self._managed = self._managed, None
        if managed and self._deleter:
            DELETER(self._deleter)(managed)
        self.producer = None


class _Layout:
    """A DLTensor's fields, read and checked."""

    __slots__ = ("data", "device", "dtype", "shape", "strides", "read_only", "size")
    data: int
    device: Tuple[int, int]
    dtype: CudaDataType
    shape: Tuple[int, ...]
    strides: Optional[Tuple[int, ...]]
    read_only: bool
    size: int


def from_dlpack(obj: Any, *, copy: Optional[bool] = None, backend: Any = None) -> CudaTensor:
    """A CudaTensor on the memory of a DLPack producer (an object with `__dlpack__`, or a
    capsule), without copying.

    Device memory becomes a device tensor, and host memory a fallback-mode tensor, on the
    same memory; the tensor keeps obj alive and calls the producer's deleter when it goes.
    This thread's current stream on the producer's device is passed as `stream=`, so work
    issued after this call sees the producer's pending writes (a bare capsule has no such
    handshake). A copy is made, and the producer released at once, only where a tensor
    cannot share the memory: strides that are not C-contiguous (size-1 and empty dims aside),
    a read-only export (DLPack 1.x's flag), host memory on a GPU backend (copied to the
    current device); copy=True always copies, copy=False raises instead of copying.
    """
    if copy is not None and type(copy) is not bool:
        raise InvalidArgumentError(f"from_dlpack: copy must be None, True or False, got {copy!r}")
    if backend is None:
        from .backend import get_cuda_backend
        backend = get_cuda_backend()
    if type(obj) is CAPSULE_TYPE:
        capsule, producer = obj, None
    else:
        capsule, producer = _capsule_of(obj, backend), obj
    return _consume(capsule, producer, backend, copy)


def _capsule_of(obj: Any, backend: Any) -> Any:
    """obj.__dlpack__(stream=this thread's current stream on obj's device, max_version)."""
    export_fn = getattr(obj, "__dlpack__", None)
    if export_fn is None:
        raise InvalidArgumentError(
            f"from_dlpack needs an object with __dlpack__ (a DLPack producer: a PyTorch, "
            f"CuPy, JAX or NumPy array) or a DLPack capsule, got {type(obj).__name__}")
    stream = None
    device_fn = getattr(obj, "__dlpack_device__", None)
    if device_fn is not None:
        kind, ordinal = device_pair(device_fn(), "__dlpack_device__()")
        if kind in (KDL_CUDA, KDL_CUDA_MANAGED):
            _check_cuda_device(backend, kind, ordinal, f"{type(obj).__name__} given")
            from .streams import current_pycuda_stream
            current = current_pycuda_stream(ordinal)
            stream = 1 if current is None else int(current.handle)
    try:
        capsule = export_fn(stream=stream, max_version=MAX_VERSION)
    except TypeError:      # a producer older than DLPack 1.0's keywords
        capsule = export_fn(stream=stream)
    if type(capsule) is not CAPSULE_TYPE:
        raise InvalidArgumentError(
            f"{type(obj).__name__}.__dlpack__() returned a {type(capsule).__name__}, not a "
            f"DLPack capsule")
    return capsule


def _check_cuda_device(backend: Any, kind: int, ordinal: int, what: str) -> None:
    if not backend.is_available:
        raise CudaNotAvailableError(
            f"from_dlpack: the {what} is in CUDA memory ({describe_device((kind, ordinal))}), "
            f"but the backend is in fallback mode ({backend.fallback_reason}); copy it to the "
            f"host first (e.g. np.from_dlpack(x, device='cpu') or x.cpu())")
    if not 0 <= ordinal < backend.device_count:
        raise InvalidDeviceError(ordinal, backend.device_count)


def _open(capsule: Any) -> Tuple[bool, int, Any, int]:
    """(versioned, address, managed struct, flags) of a DLPack capsule not yet consumed."""
    if capsule_is_valid(capsule, b"dltensor_versioned"):
        versioned = True
        address = capsule_pointer(capsule, b"dltensor_versioned")
        managed: Any = DLManagedTensorVersioned.from_address(address)
        if managed.version.major != 1:
            raise InvalidArgumentError(
                f"from_dlpack: the capsule is DLPack {managed.version.major}."
                f"{managed.version.minor}; this backend reads DLPack 1.x")
        flags = int(managed.flags)
    elif capsule_is_valid(capsule, b"dltensor"):
        versioned = False
        address = capsule_pointer(capsule, b"dltensor")
        managed = DLManagedTensor.from_address(address)
        flags = 0
    else:
        raw = capsule_name(capsule)
        name = None if not raw else ctypes.string_at(raw)
        if name in (b"used_dltensor", b"used_dltensor_versioned"):
            raise InvalidArgumentError(
                "from_dlpack: this DLPack capsule was already consumed (a capsule can be "
                "imported once); ask the producer for a new one")
        raise InvalidArgumentError(
            f"from_dlpack: a capsule named {name!r} is not a DLPack capsule (expected "
            f"'dltensor' or 'dltensor_versioned')")
    return versioned, address, managed, flags


def _consume(capsule: Any, producer: Any, backend: Any, copy: Optional[bool]) -> CudaTensor:
    versioned, address, managed, flags = _open(capsule)
    lay = _read(managed.dl_tensor, flags)
    deleter = managed.deleter
    on_gpu = backend.is_available
    kind, ordinal = lay.device
    if kind in (KDL_CUDA, KDL_CUDA_MANAGED):
        _check_cuda_device(backend, kind, ordinal, "capsule's tensor")
        host_memory = False
    elif kind in (KDL_CPU, KDL_CUDA_HOST):
        host_memory = True
    else:
        raise InvalidArgumentError(
            f"from_dlpack: memory on {describe_device(lay.device)} is not supported (expected "
            f"kDLCUDA, kDLCUDAManaged, kDLCPU or kDLCUDAHost)")
    contiguous = lay.strides is None or _contiguous(lay.shape, lay.strides)
    reasons = []
    if not contiguous:
        reasons.append(f"its strides {lay.strides} (elements) are not C-contiguous for shape "
                       f"{lay.shape}, and tensors are C-contiguous")
    if lay.read_only:
        reasons.append("the producer marked it read-only, and tensors are writable")
    if host_memory and on_gpu:
        reasons.append("it is host memory and the backend's tensors are in device memory")
    if reasons and copy is False:
        raise InvalidArgumentError("from_dlpack(copy=False): a copy is needed: " +
                                   "; ".join(reasons))
    # everything is checked: consume the capsule (from here on we own the deleter's call)
    capsule_set_name(capsule, ctypes.addressof(USED[versioned]))
    owner = DLPackImport(address, deleter, producer)
    if reasons or copy:
        try:
            return _copied(lay, owner, backend, host_memory)
        finally:
            owner.release()
    if host_memory:
        owner.__array_interface__ = _interface(lay, strided=False)
        host = np.asarray(owner) if lay.size else np.empty(lay.shape, lay.dtype.numpy_dtype)
        t = CudaTensor(lay.shape, lay.dtype, 0, lay.data or 0, owner=owner, host=host)
        t._pool = backend.memory_pools[0]   # its operators use this backend; owns no block
        return t
    from .streams import current_pycuda_stream
    t = CudaTensor(lay.shape, lay.dtype, ordinal, lay.data or 0, owner=owner)
    t._pool = backend.memory_pools[ordinal]
    t.stream = current_pycuda_stream(ordinal)   # the stream the producer ordered
    return t


def _read(dl: DLTensor, flags: int) -> _Layout:
    """A DLTensor's fields, checked before anything is consumed."""
    lay = _Layout()
    ndim = int(dl.ndim)
    if not 0 <= ndim <= MAX_NDIM:
        raise InvalidArgumentError(f"from_dlpack: ndim {ndim} is out of range (0..{MAX_NDIM})")
    if ndim and not dl.shape:
        raise InvalidArgumentError(f"from_dlpack: a {ndim}-d DLTensor with a NULL shape")
    shape = tuple(int(dl.shape[i]) for i in range(ndim))
    if any(s < 0 for s in shape):
        raise InvalidArgumentError(f"from_dlpack: negative dimension in shape {shape}")
    code, bits, lanes = int(dl.dtype.code), int(dl.dtype.bits), int(dl.dtype.lanes)
    dtype = FROM_DL.get((code, bits))
    if dtype is None or lanes != 1:
        raise DTypeMismatchError(
            f"from_dlpack: unsupported DLPack dtype (code {code}, {bits} bits, {lanes} lanes); "
            f"supported, one lane each: {SUPPORTED}")
    lay.size = math.prod(shape)
    lay.shape, lay.dtype = shape, dtype
    lay.strides = tuple(int(dl.strides[i]) for i in range(ndim)) if dl.strides else None
    data = dl.data
    if lay.size and not data:
        raise InvalidArgumentError(
            f"from_dlpack: a DLTensor of shape {shape} with a NULL data pointer")
    lay.data = (data or 0) + int(dl.byte_offset) if lay.size else (data or 0)
    lay.device = (int(dl.device.device_type), int(dl.device.device_id))
    lay.read_only = bool(flags & FLAG_READ_ONLY)
    return lay


def _contiguous(shape: Tuple[int, ...], strides: Tuple[int, ...]) -> bool:
    """Whether element strides walk memory C-contiguously (size-1 dims aside; empty: yes)."""
    return math.prod(shape) == 0 or is_contiguous(shape, strides)


def _interface(lay: _Layout, strided: bool = True) -> dict:
    """An __array_interface__ over the producer's host memory (element 0 at lay.data), with
    its strides, or C-contiguous (strided=False: they are, size-1 dims aside)."""
    item = lay.dtype.itemsize
    strides = None if lay.strides is None or not strided else \
        tuple(s * item for s in lay.strides)
    return {"data": (lay.data, False), "shape": lay.shape, "strides": strides,
            "typestr": lay.dtype.numpy_dtype.str, "version": 3}


def _copied(lay: _Layout, owner: DLPackImport, backend: Any, host_memory: bool) -> CudaTensor:
    """A new C-contiguous tensor with the producer's contents, made before owner's release."""
    if lay.size == 0:
        return backend.empty(lay.shape, lay.dtype, None if host_memory else lay.device[1])
    if host_memory:
        owner.__array_interface__ = _interface(lay)
        view = np.asarray(owner)
        if backend.is_available:
            out = backend.empty(lay.shape, lay.dtype, None)
            backend.copy_to_device(np.ascontiguousarray(view), out)   # synchronous
            return out
        out = backend.empty(lay.shape, lay.dtype, 0)
        out.host_view[...] = view
        return out
    from .ops.shape_copy import strided_copy
    from .ops.shape_layouts import contiguous_strides
    from .streams import current_pycuda_stream
    from .tensor_math import math_for
    dev = lay.device[1]
    strides = lay.strides or tuple(contiguous_strides(lay.shape))
    low = sum((n - 1) * s for n, s in zip(lay.shape, strides) if s < 0)
    high = sum((n - 1) * s for n, s in zip(lay.shape, strides) if s > 0)
    item = lay.dtype.itemsize
    storage = CudaTensor((high - low + 1,), lay.dtype, dev, lay.data + low * item, owner=owner)
    out = backend.empty(lay.shape, lay.dtype, dev)
    strided_copy(math_for(backend), storage, -low, strides, out, 0,
                 contiguous_strides(lay.shape), lay.shape)
    stream = current_pycuda_stream(dev)      # the copy's stream: done before the release
    if stream is None:
        backend.synchronize(dev)
    else:
        with backend.activate(dev):
            stream.synchronize()
    return out
