"""The DLPack ABI as this backend meets it (dlpack.h): the device and dtype codes, the
structs of the legacy and versioned capsules, the mapping to CudaDataType, the Python C API
calls on capsules (our own ctypes prototypes), and what export (dlpack.py) and import
(dlpack_import.py) share: the lock over export counts and releases, device names in errors,
and `ReleasedWhenCollected`, the base of the objects that end an export or an import.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Tuple

import numpy as np

from .dtypes import CudaDataType
from .errors import InvalidArgumentError

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
TO_DL = {DT.FLOAT32: (KDL_FLOAT, 32), DT.FLOAT64: (KDL_FLOAT, 64), DT.FLOAT16: (KDL_FLOAT, 16),
         DT.BFLOAT16: (KDL_BFLOAT, 16), DT.INT32: (KDL_INT, 32), DT.INT64: (KDL_INT, 64),
         DT.UINT8: (KDL_UINT, 8), DT.BOOL: (KDL_BOOL, 8)}
FROM_DL = {v: k for k, v in TO_DL.items()}
SUPPORTED = ", ".join(f"{dt.name_str} (code {c}, {b} bits)" for dt, (c, b) in TO_DL.items())


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
capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))
capsule_name = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object)(("PyCapsule_GetName", _api))
capsule_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_void_p)(
    ("PyCapsule_SetName", _api))
DELETER = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)   # a producer's deleter, called with the GIL

# PyCapsule_SetName keeps the pointer it is given, and the capsule (and its producer's
# destructor, which compares the name) may outlive this module at interpreter exit: the
# names are buffers that are never freed (one reference leaked on purpose).
USED = {False: ctypes.create_string_buffer(b"used_dltensor"),
        True: ctypes.create_string_buffer(b"used_dltensor_versioned")}
_api.Py_IncRef(ctypes.py_object(USED))
CAPSULE_TYPE = type(np.empty(0).__dlpack__())
LOCK = threading.RLock()   # (re-entrant: a finalizer may run while it is held)


def device_pair(value: Any, what: str) -> Tuple[int, int]:
    try:
        kind, ordinal = value
        pair = (int(kind), int(ordinal))
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"{what} must be a (device type, device id) pair of ints, got {value!r}") from None
    return pair


def describe_device(device: Tuple[int, int]) -> str:
    return f"{_DEVICE_NAMES.get(device[0], 'device type ' + str(device[0]))}:{device[1]}"


class ReleasedWhenCollected:
    """An owner whose release() also runs when it is garbage-collected (an export's holder,
    an import's owner); release() must be safe to call more than once."""

    __slots__ = ()

    def release(self) -> None:
        raise NotImplementedError

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:   # at interpreter exit this module may be half torn down
            pass
