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

Import. `from_dlpack(obj)` asks obj for a capsule with this thread's current stream on obj's
device (`__dlpack__(stream=...)`: the producer orders it after its pending writes), reads the
DLTensor through ctypes, checks everything before it consumes the capsule (renames it
"used_dltensor[_versioned]"; a capsule rejected with an error is left to its producer's
destructor), and wraps the memory in a CudaTensor whose owner calls the producer's deleter
exactly once when the tensor goes (free() or garbage collection).
"""
from __future__ import annotations

import ctypes
import math
import threading
from typing import Any, List, Optional, Tuple

import numpy as np

from .dtypes import CudaDataType
from .errors import (CudaNotAvailableError, DTypeMismatchError, InvalidArgumentError,
                     InvalidDeviceError)
from .ops.shape import is_contiguous
from .tensor import CudaTensor, release_storage

# DLDeviceType values this module meets (dlpack.h)
KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED = 1, 2, 3, 13
_DEVICE_NAMES = {1: "kDLCPU", 2: "kDLCUDA", 3: "kDLCUDAHost", 4: "kDLOpenCL", 7: "kDLVulkan",
                 8: "kDLMetal", 9: "kDLVPI", 10: "kDLROCM", 11: "kDLROCMHost", 12: "kDLExtDev",
                 13: "kDLCUDAManaged", 14: "kDLOneAPI", 15: "kDLWebGPU", 16: "kDLHexagon"}
# DLDataTypeCode values
KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT, KDL_BOOL = 0, 1, 2, 4, 6
FLAG_READ_ONLY, FLAG_IS_COPIED = 1, 2
MAX_VERSION = (1, 0)   # what from_dlpack asks producers for: the 1.x layout
MAX_NDIM = 64

DT = CudaDataType
_TO_DL = {DT.FLOAT32: (KDL_FLOAT, 32), DT.FLOAT64: (KDL_FLOAT, 64), DT.FLOAT16: (KDL_FLOAT, 16),
          DT.BFLOAT16: (KDL_BFLOAT, 16), DT.INT32: (KDL_INT, 32), DT.INT64: (KDL_INT, 64),
          DT.UINT8: (KDL_UINT, 8), DT.BOOL: (KDL_BOOL, 8)}
_FROM_DL = {v: k for k, v in _TO_DL.items()}
_SUPPORTED = ", ".join(f"{dt.name_str} (code {c}, {b} bits)" for dt, (c, b) in _TO_DL.items())


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    """The legacy ("dltensor") capsule's struct; deleter is a function pointer."""
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    """The versioned ("dltensor_versioned", DLPack >= 1.0) capsule's struct."""
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", DLTensor)]


# The C API calls, through prototypes of our own (PYFUNCTYPE: the GIL stays held and a Python
# error the call sets is raised), so that no other user of ctypes.pythonapi is affected.
_api = ctypes.pythonapi
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object)(("PyCapsule_GetName", _api))
_capsule_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_void_p)(
    ("PyCapsule_SetName", _api))
_DELETER = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)   # a producer's deleter, called with the GIL

# PyCapsule_SetName keeps the pointer it is given, and the capsule (and its producer's
# destructor, which compares the name) may outlive this module at interpreter exit: the
# names are buffers that are never freed (one reference leaked on purpose).
_USED = {False: ctypes.create_string_buffer(b"used_dltensor"),
         True: ctypes.create_string_buffer(b"used_dltensor_versioned")}
_api.Py_IncRef(ctypes.py_object(_USED))
_CAPSULE_TYPE = type(np.empty(0).__dlpack__())
_lock = threading.RLock()   # (re-entrant: a finalizer may run while it is held)


# -- export ------------------------------------------------------------------------------------
class _Export:
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
        with _lock:
            for c in chain:
                c._exports += 1
        self.tensors = chain

    def __del__(self) -> None:
        try:
            self._release()
        except Exception:   # at interpreter exit this module may be half torn down
            pass

    def _release(self) -> None:
        chain, self.tensors = self.tensors, []
        done: List[CudaTensor] = []
        with _lock:
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
    target = own if dl_device is None else _device_pair(dl_device, "__dlpack__: dl_device")
    flags = 0
    if target != own:
        if target != (KDL_CPU, 0) or t.on_host:
            raise DLPackExportError(
                f"__dlpack__: cannot export a tensor on {_describe(own)} to "
                f"{_describe(target)}: only a host copy ((1, 0), kDLCPU) can be made")
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
    address = _capsule_pointer(capsule, name)
    if versioned:
        managed: Any = DLManagedTensorVersioned.from_address(address)
        managed.flags |= flags
    else:
        managed = DLManagedTensor.from_address(address)
    dl = managed.dl_tensor
    dl.device.device_type, dl.device.device_id = device
    dl.dtype.code, dl.dtype.bits = _TO_DL[dtype]
    dl.dtype.lanes = 1
    if ptr == 0:
        dl.data = None             # an empty device tensor: NumPy put a host address there
    return capsule


def _copy_of(t: CudaTensor) -> CudaTensor:
    """copy=True: a new tensor with t's contents (a device copy on the current stream)."""
    from .tensor import math_for
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


def _device_pair(value: Any, what: str) -> Tuple[int, int]:
    try:
        kind, ordinal = value
        pair = (int(kind), int(ordinal))
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"{what} must be a (device type, device id) pair of ints, got {value!r}") from None
    return pair


def _describe(device: Tuple[int, int]) -> str:
    return f"{_DEVICE_NAMES.get(device[0], 'device type ' + str(device[0]))}:{device[1]}"


# -- import ------------------------------------------------------------------------------------
class DLPackImport:
    """The owner of an imported tensor's memory: calls the producer's deleter exactly once,
    when release() is called or this object goes. Keeps the producer object alive too."""

    __slots__ = ("_managed", "_deleter", "producer", "__array_interface__", "__weakref__")
    __array_interface__: dict   # set only when NumPy is to read host memory through it

    def __init__(self, managed: int, deleter: Optional[int], producer: Any) -> None:
        self._managed: Optional[int] = managed
        self._deleter = deleter
        self.producer = producer

    def release(self) -> None:
        with _lock:
            managed, self._managed = self._managed, None
        if managed and self._deleter:
            _DELETER(self._deleter)(managed)
        self.producer = None

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:   # at interpreter exit this module may be half torn down
            pass


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
    if type(obj) is _CAPSULE_TYPE:
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
        kind, ordinal = _device_pair(device_fn(), "__dlpack_device__()")
        if kind in (KDL_CUDA, KDL_CUDA_MANAGED):
            _check_cuda_device(backend, kind, ordinal, f"{type(obj).__name__} given")
            from .streams import current_pycuda_stream
            current = current_pycuda_stream(ordinal)
            stream = 1 if current is None else int(current.handle)
    try:
        capsule = export_fn(stream=stream, max_version=MAX_VERSION)
    except TypeError:      # a producer older than DLPack 1.0's keywords
        capsule = export_fn(stream=stream)
    if type(capsule) is not _CAPSULE_TYPE:
        raise InvalidArgumentError(
            f"{type(obj).__name__}.__dlpack__() returned a {type(capsule).__name__}, not a "
            f"DLPack capsule")
    return capsule


def _check_cuda_device(backend: Any, kind: int, ordinal: int, what: str) -> None:
    if not backend.is_available:
        raise CudaNotAvailableError(
            f"from_dlpack: the {what} is in CUDA memory ({_describe((kind, ordinal))}), but the "
            f"backend is in fallback mode ({backend.fallback_reason}); copy it to the host "
            f"first (e.g. np.from_dlpack(x, device='cpu') or x.cpu())")
    if not 0 <= ordinal < backend.device_count:
        raise InvalidDeviceError(ordinal, backend.device_count)


def _consume(capsule: Any, producer: Any, backend: Any, copy: Optional[bool]) -> CudaTensor:
    if _capsule_is_valid(capsule, b"dltensor_versioned"):
        versioned = True
        address = _capsule_pointer(capsule, b"dltensor_versioned")
        managed: Any = DLManagedTensorVersioned.from_address(address)
        if managed.version.major != 1:
            raise InvalidArgumentError(
                f"from_dlpack: the capsule is DLPack {managed.version.major}."
                f"{managed.version.minor}; this backend reads DLPack 1.x")
        flags = int(managed.flags)
    elif _capsule_is_valid(capsule, b"dltensor"):
        versioned = False
        address = _capsule_pointer(capsule, b"dltensor")
        managed = DLManagedTensor.from_address(address)
        flags = 0
    else:
        raw = _capsule_name(capsule)
        name = None if not raw else ctypes.string_at(raw)
        if name in (b"used_dltensor", b"used_dltensor_versioned"):
            raise InvalidArgumentError(
                "from_dlpack: this DLPack capsule was already consumed (a capsule can be "
                "imported once); ask the producer for a new one")
        raise InvalidArgumentError(
            f"from_dlpack: a capsule named {name!r} is not a DLPack capsule (expected "
            f"'dltensor' or 'dltensor_versioned')")
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
            f"from_dlpack: memory on {_describe(lay.device)} is not supported (expected "
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
    _capsule_set_name(capsule, ctypes.addressof(_USED[versioned]))
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
    dtype = _FROM_DL.get((code, bits))
    if dtype is None or lanes != 1:
        raise DTypeMismatchError(
            f"from_dlpack: unsupported DLPack dtype (code {code}, {bits} bits, {lanes} lanes); "
            f"supported, one lane each: {_SUPPORTED}")
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
    from .ops.shape import contiguous_strides, strided_copy
    from .streams import current_pycuda_stream
    from .tensor import math_for
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
