"""`CudaTensor`: a C-contiguous n-d array in device memory (or host memory in fallback mode)."""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import numpy as np

from .dtypes import CudaDataType
from .errors import DTypeMismatchError, InvalidArgumentError, TensorFreedError
from .memory import StreamBlock
from .tensor_math import math_of
from .tensor_operators import TensorOperators, host_operand


_SHAPES: dict = {}  # tuples of ints already checked (keeps the allocation path short)


def normalize_shape(shape: Any) -> Tuple[int, ...]:
    """An int or a sequence of non-negative ints -> a tuple, with a clear error otherwise."""
    if type(shape) is tuple:
        hit = _SHAPES.get(shape)
        if hit is not None:
            # (2.0, 3) and (True, 3) are equal to (2, 3) and (1, 3) as dict keys
            for s in shape:
                if type(s) is not int:
                    break
            else:
                return hit
    key = shape if type(shape) is tuple else None
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (int(shape),)
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    if dims is None or any(isinstance(s, bool) or not isinstance(s, (int, np.integer))
                           for s in dims):
        raise InvalidArgumentError(f"shape must be an int or a tuple of ints, got {shape!r}")
    shape = tuple(int(s) for s in dims)
    if any(s < 0 for s in shape):
        raise InvalidArgumentError(f"shape dimensions must be >= 0, got {shape}")
    if key is not None and all(type(s) is int for s in key):
        if len(_SHAPES) > 4096:
            _SHAPES.clear()
        _SHAPES[key] = shape
    return shape


class CudaTensor(TensorOperators):
    """Device array: shape, dtype, device, and a pool block it owns (or an owner it keeps alive).

    Use `free()` (or `with tensor:`) to give memory back early; any use afterwards raises
    TensorFreedError. Exports DLPack (`__dlpack__`, zero-copy, bfloat16 included; see
    dlpack.py) and `__cuda_array_interface__` v3 for CuPy, PyTorch, JAX, Numba and NumPy.
    """

    __slots__ = ("shape", "dtype", "device_id", "_block", "_ptr", "_pool", "_owner",
                 "_host", "stream", "size", "nbytes", "on_host", "_exports", "__weakref__")
    shape: Tuple[int, ...]
    dtype: CudaDataType
    device_id: int
    _ptr: int                  # None once freed (free())
    _block: Any
    _pool: Any
    _owner: Any
    _host: Optional[np.ndarray]
    stream: Any
    size: int
    nbytes: int
    on_host: bool
    _exports: int

    def __init__(self, shape: Tuple[int, ...], dtype: CudaDataType, device_id: int,
                 ptr: int, block: Any = None, pool: Any = None, owner: Any = None,
                 host: Optional[np.ndarray] = None) -> None:
        shape = tuple(shape)
        size = math.prod(shape)
        _set_slots(self, shape, dtype, device_id, ptr, block, pool, owner, host, None, size,
                   size * dtype.itemsize)

    # -- basic properties ---------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def strides(self) -> Tuple[int, ...]:
        strides, acc = [], self.dtype.itemsize
        for s in reversed(self.shape):
            strides.append(acc)
            acc *= max(s, 1)
        return tuple(reversed(strides))

    @property
    def is_contiguous(self) -> bool:
        return True

    @property
    def is_freed(self) -> bool:
        return self._ptr is None

    @property
    def ptr(self) -> int:
        """Device pointer (raises TensorFreedError after free())."""
        ptr = self._ptr
        if ptr is None:
            raise TensorFreedError(
                f"tensor of shape {self.shape} ({self.dtype.name_str}) on device "
                f"{self.device_id} was freed and cannot be used")
        return ptr

    def check_alive(self) -> "CudaTensor":
        self.ptr
        return self

    @property
    def host_view(self) -> np.ndarray:
        """Fallback mode only: the NumPy array that holds the data."""
        self.check_alive()
        if self._host is None:
            raise InvalidArgumentError("host_view exists only for fallback-mode tensors")
        return self._host

    # -- lifetime -----------------------------------------------------------------
    def free(self) -> None:
        """Return the memory to the pool now; a second free is a no-op. The tensor is unusable
        at once; while a DLPack consumer still holds an export of it (or of a view of it),
        the memory goes back when that consumer releases the export instead."""
        if self._ptr is None:
            return
        # None marks a freed tensor (typed int: the readers run check_alive() or test for None)
        self._ptr = None    # type: ignore[assignment]
        if self._exports:
            self._host = None
            return
        release_storage(self)

    def __enter__(self) -> "CudaTensor":
        return self.check_alive()

    def __exit__(self, *exc: Any) -> None:
        self.free()

    # -- interop ------------------------------------------------------------------
    def __dlpack__(self, *, stream: Optional[int] = None,
                   max_version: Optional[Tuple[int, int]] = None,
                   dl_device: Optional[Tuple[int, int]] = None,
                   copy: Optional[bool] = None) -> Any:
        """A DLPack capsule of this tensor's memory, no copy (the Python array API protocol:
        `torch.from_dlpack(t)`, `cupy.from_dlpack(t)`, `jax.dlpack.from_dlpack(t)`, and
        `np.from_dlpack(t)` for fallback-mode tensors, which export host memory).

        stream: the consumer's stream on this device (None or 1: the legacy default stream,
        2: the per-thread one, -1: no ordering); it waits for the work queued on this
        tensor. max_version >= (1, 0) gives a versioned capsule, else a legacy one. The memory
        stays alive until the consumer releases it, even across free(). dl_device=(1, 0)
        (kDLCPU) exports a host copy; copy=True a copy, copy=False never copies."""
        from .dlpack import export
        return export(self, stream, max_version, dl_device, copy)

    def __dlpack_device__(self) -> Tuple[int, int]:
        """(kDLCUDA = 2, device id), or (kDLCPU = 1, 0) for a fallback-mode tensor."""
        return (1, 0) if self.on_host else (2, self.device_id)

    @property
    def __cuda_array_interface__(self) -> dict:
        """Version 3, with the stream our work on this tensor was last issued to (1: the
        legacy default stream): a consumer orders its reads after that stream."""
        if self.on_host:
            raise InvalidArgumentError(
                "fallback-mode tensors live in host memory and have no "
                "__cuda_array_interface__; use to_numpy()")
        stream = 1 if self.stream is None else int(getattr(self.stream, "handle", self.stream))
        return {
            "shape": self.shape,
            "typestr": self.dtype.typestr,
            "data": (self.ptr if self.size else 0, False),
            "strides": None,
            "descr": [("", self.dtype.typestr)],
            "version": 3,
            "stream": stream,
        }

    @classmethod
    def from_cuda_array(cls, obj: Any, device_id: Optional[int] = None,
                        backend: Any = None, dtype: Any = None) -> "CudaTensor":
        """Wrap any object exporting `__cuda_array_interface__` without copying.

        The tensor keeps `obj` alive; `free()` drops that reference and frees nothing. When
        the exporter names a stream, work issued after this call (on this thread's current
        stream) waits for the work already queued there, as the interface's version 3 asks.
        The opaque typestr '<V2' is read as bfloat16 when a PyTorch or CuPy array exports it
        (their bfloat16) or when `dtype="bfloat16"` says so; otherwise dtype= must agree with
        the typestr. (`from_dlpack` carries bfloat16 without either.)
        """
        cai = getattr(obj, "__cuda_array_interface__", None)
        if cai is None:
            raise InvalidArgumentError(
                f"{type(obj).__name__} does not export __cuda_array_interface__")
        if backend is None:
            from .backend import get_cuda_backend
            backend = get_cuda_backend()
        if not backend.is_available:
            from .errors import CudaNotAvailableError
            raise CudaNotAvailableError(
                f"from_cuda_array cannot wrap the device memory of a {type(obj).__name__} in "
                f"fallback mode ({backend.fallback_reason}): tensors there live in host "
                f"memory; copy it to the host and use from_numpy")
        shape = tuple(int(s) for s in cai["shape"])
        dtype = interface_dtype(obj, cai["typestr"], dtype)
        strides = cai.get("strides")
        if strides is not None:
            expected, acc = [], dtype.itemsize
            for s in reversed(shape):
                expected.append(acc)
                acc *= max(s, 1)
            if tuple(int(x) for x in strides) != tuple(reversed(expected)) and \
                    int(np.prod(shape)) > 1:
                raise InvalidArgumentError(
                    f"only C-contiguous arrays can be wrapped without a copy; got strides "
                    f"{tuple(strides)} for shape {shape}")
        if cai.get("mask") is not None:
            raise InvalidArgumentError("masked arrays cannot be wrapped")
        ptr = int(cai["data"][0])
        if device_id is None:
            device_id = pointer_device(ptr)
        t = cls(shape, dtype, device_id, ptr, owner=obj)
        stream = cai.get("stream")
        if stream is not None:
            if isinstance(stream, bool) or not isinstance(stream, int) or stream == 0:
                raise InvalidArgumentError(
                    f"__cuda_array_interface__ stream must be None or a nonzero int stream "
                    f"handle (1: legacy default, 2: per-thread default), got {stream!r}")
            backend.wait_for_foreign_stream(stream, device_id)
        return t

    # -- comparisons (CudaMath.equal, less, ...: bool tensors, broadcasting) ----------------
    # Defining __eq__ would drop the default hash: tensors stay hashable by identity.
    __hash__ = object.__hash__

    def _compare(self, op: str, other: Any, symbol: str) -> Any:
        if isinstance(other, np.ndarray):
            other = host_operand(other, symbol)
        if not isinstance(other, (CudaTensor, int, float, np.number, np.bool_)):
            return NotImplemented
        return getattr(math_of(self), op)(self, other)

    def __eq__(self, other: Any) -> Any:  # type: ignore[override]
        return self._compare("equal", other, "==")

    def __ne__(self, other: Any) -> Any:  # type: ignore[override]
        return self._compare("not_equal", other, "!=")

    def __lt__(self, other: Any) -> Any:
        return self._compare("less", other, "<")

    def __le__(self, other: Any) -> Any:
        return self._compare("less_equal", other, "<=")

    def __gt__(self, other: Any) -> Any:
        return self._compare("greater", other, ">")

    def __ge__(self, other: Any) -> Any:
        return self._compare("greater_equal", other, ">=")

    def __bool__(self) -> bool:
        """NumPy's rule: only a one-element tensor has a truth value (read back from the
        device); `tensor in list` and `if tensor:` on others raise."""
        if self.size != 1:
            raise InvalidArgumentError(
                f"the truth value of a tensor of shape {self.shape} is ambiguous (only "
                f"one-element tensors have one)")
        return bool(self.item())

    # -- display ------------------------------------------------------------------
    def __repr__(self) -> str:
        state = ", freed" if self._ptr is None else ""
        where = "host" if self.on_host else f"cuda:{self.device_id}"
        return (f"CudaTensor(shape={self.shape}, dtype={self.dtype.name_str}, "
                f"device={where}{state})")

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]


_new = object.__new__


def release_storage(t: CudaTensor) -> None:
    """free()'s second half: give t's block back to its pool (or drop what keeps its memory
    alive). dlpack.py calls it when the last export of a tensor freed meanwhile goes."""
    block, pool = t._block, t._pool
    t._block = t._pool = t._owner = t._host = None
    if block is not None:
        if pool is not None:
            pool.release(block)
        else:
            block.free()


def interface_dtype(obj: Any, typestr: Any, dtype: Any) -> CudaDataType:
    """The dtype of a __cuda_array_interface__ typestr: '<V2' (an opaque 2-byte type) is
    PyTorch's and CuPy's bfloat16 (ml_dtypes.bfloat16's typestr), else needs dtype=."""
    wanted = None if dtype is None else CudaDataType.from_any(dtype)
    if isinstance(typestr, str) and typestr.lstrip("<>|=").upper() == "V2":
        module = type(obj).__module__.partition(".")[0]
        if wanted is CudaDataType.BFLOAT16 or (wanted is None and module in ("torch", "cupy")):
            return CudaDataType.BFLOAT16
        raise DTypeMismatchError(
            f"a {type(obj).__name__} exports the opaque typestr {typestr!r} (2-byte elements of "
            f"unknown type); pass dtype='bfloat16' if they are bfloat16"
            + ("" if wanted is None else f" (dtype={wanted.name_str} does not fit it)"))
    try:
        found = CudaDataType.from_typestr(typestr)
    except DTypeMismatchError:
        raise
    except TypeError:    # np.dtype() rejects it
        raise DTypeMismatchError(
            f"unsupported __cuda_array_interface__ typestr {typestr!r} from a "
            f"{type(obj).__name__}") from None
    if wanted is not None and wanted is not found:
        raise DTypeMismatchError(
            f"dtype={wanted.name_str} was given, but the {type(obj).__name__} exports "
            f"{found.name_str} (typestr {typestr!r}); dtype= only names the type of an "
            f"opaque typestr ('<V2': bfloat16)")
    return found


def pool_tensor(shape: Tuple[int, ...], dtype: CudaDataType, device_id: int, block: Any,
                pool: Any, size: int, nbytes: int) -> CudaTensor:
    """A device tensor owning `block` of `pool`, for the allocation fast paths: shape is a
    valid tuple, size and nbytes are its element and byte counts, block is live. Sets every
    slot as __init__ does (tests/test_elementwise.py checks that they agree), without its
    conversions and arithmetic."""
    t = _new(CudaTensor)
    _set_slots(t, shape, dtype, device_id, int(block), block, pool, None, None,
               block.stream if type(block) is StreamBlock else None, size, nbytes)
    return t


def _set_slots(t: CudaTensor, shape: Tuple[int, ...], dtype: CudaDataType, device_id: int,
               ptr: int, block: Any, pool: Any, owner: Any, host: Optional[np.ndarray],
               stream: Any, size: int, nbytes: int) -> None:
    """Every slot of a new CudaTensor (CudaTensor.__init__ and pool_tensor)."""
    t.shape = shape
    t.dtype = dtype
    t.device_id = device_id
    t._ptr = ptr
    t._block = block
    t._pool = pool
    t._owner = owner
    t._host = host
    t.on_host = host is not None  # fallback mode: the data lives in host memory
    t.stream = stream   # the stream it was last used on; None: the legacy default stream
    t.size = size
    t.nbytes = nbytes
    t._exports = 0      # DLPack exports a consumer still holds (dlpack.py)


def device_view(x: CudaTensor, shape: Tuple[int, ...]) -> CudaTensor:
    """A view of shape (a valid tuple of x.size elements) on all of x's device memory,
    keeping x alive, for the reshape fast path: the slots ops/shape_layouts.make_view's
    CudaTensor(..., owner=x) sets for a device tensor (tests/test_shape_ops.py compares
    them), without __init__'s conversions and arithmetic. x is live and not on the host."""
    t = _new(CudaTensor)
    t.shape = shape
    t.dtype = x.dtype
    t.device_id = x.device_id
    t._ptr = x._ptr
    t._block = None
    t._pool = x._pool
    t._owner = x
    t._host = None
    t.on_host = False
    t.stream = x.stream
    t.size = x.size
    t.nbytes = x.nbytes
    t._exports = 0
    return t


def pointer_device(ptr: int) -> int:
    """The device ordinal a device pointer belongs to (CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)."""
    import ctypes
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        ordinal = ctypes.c_int(-1)
        res = lib.cuPointerGetAttribute(ctypes.byref(ordinal), ctypes.c_int(9),
                                        ctypes.c_uint64(ptr))
        if res == 0 and ordinal.value >= 0:
            return ordinal.value
    except OSError:
        pass
    return 0


def check_dtype(tensor: CudaTensor, expected: CudaDataType, what: str = "tensor") -> None:
    if tensor.dtype is not expected:
        raise DTypeMismatchError(
            f"{what} has dtype {tensor.dtype.name_str}, expected {expected.name_str}")
