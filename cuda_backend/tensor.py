"""`CudaTensor`: a C-contiguous n-d array in device memory (or host memory in fallback mode)."""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import numpy as np

from .dtypes import CudaDataType
from .errors import DTypeMismatchError, InvalidArgumentError, TensorFreedError
from .memory import StreamBlock


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


class CudaTensor:
    """Device array: shape, dtype, device, and a pool block it owns (or an owner it keeps alive).

    Use `free()` (or `with tensor:`) to give memory back early; any use afterwards raises
    TensorFreedError. Exports DLPack (`__dlpack__`, zero-copy, bfloat16 included; see
    dlpack.py) and `__cuda_array_interface__` v3 for CuPy, PyTorch, JAX, Numba and NumPy.
    """

    __slots__ = ("shape", "dtype", "device_id", "_block", "_ptr", "_pool", "_owner",
                 "_host", "stream", "size", "nbytes", "on_host", "_exports", "__weakref__")

    def __init__(self, shape: Tuple[int, ...], dtype: CudaDataType, device_id: int,
                 ptr: int, block: Any = None, pool: Any = None, owner: Any = None,
                 host: Optional[np.ndarray] = None) -> None:
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device_id = device_id
        self._ptr = ptr
        self._block = block
        self._pool = pool
        self._owner = owner
        self._host = host
        self.on_host = host is not None  # fallback mode: the data lives in host memory
        self.stream = None  # the stream it was last used on; None: the legacy default stream
        self.size = size = math.prod(self.shape)
        self.nbytes = size * dtype.itemsize
        self._exports = 0   # DLPack exports a consumer still holds (dlpack.py)

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

    # -- operators (CudaMath) -----------------------------------------------------
    # Makes NumPy return NotImplemented from `ndarray + tensor`, so that Python calls
    # __radd__, instead of NumPy treating the tensor as an object and making an object array.
    __array_ufunc__ = None

    def __add__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = _host_operand(other, "+")
        return _math_of(self).add(self, other)

    def __radd__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = _host_operand(other, "+")
        return _math_of(self).add(other, self)

    def __sub__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = _host_operand(other, "-")
        return _math_of(self).subtract(self, other)

    def __rsub__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = _host_operand(other, "-")
        return _math_of(self).subtract(other, self)

    def __mul__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = _host_operand(other, "*")
        return _math_of(self).multiply(self, other)

    def __rmul__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = _host_operand(other, "*")
        return _math_of(self).multiply(other, self)

    def __truediv__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = _host_operand(other, "/")
        return _math_of(self).divide(self, other)

    def __rtruediv__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = _host_operand(other, "/")
        return _math_of(self).divide(other, self)

    def __pow__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = _host_operand(other, "**")
        return _math_of(self).power(self, other)

    def __rpow__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = _host_operand(other, "**")
        return _math_of(self).power(other, self)

    def __matmul__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = _host_operand(other, "@")
        return _math_of(self).matrix_multiply(self, other)

    def __rmatmul__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = _host_operand(other, "@")
        return _math_of(self).matrix_multiply(other, self)

    def __neg__(self) -> "CudaTensor":
        return _math_of(self).negative(self)

    # -- comparisons (CudaMath.equal, less, ...: bool tensors, broadcasting) ----------------
    # Defining __eq__ would drop the default hash: tensors stay hashable by identity.
    __hash__ = object.__hash__

    def _compare(self, op: str, other: Any, symbol: str) -> Any:
        if isinstance(other, np.ndarray):
            other = _host_operand(other, symbol)
        if not isinstance(other, (CudaTensor, int, float, np.number, np.bool_)):
            return NotImplemented
        return getattr(_math_of(self), op)(self, other)

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

    # -- Python scalars (NumPy's rules; each reads the one element back from the device) -----
    def item(self) -> Any:
        """The value of a one-element tensor as a Python float, int or bool."""
        if self.size != 1:
            raise InvalidArgumentError(
                f"item() needs a one-element tensor, got shape {self.shape} ({self.size} "
                f"elements); use to_numpy() for the values")
        return _math_of(self).to_numpy(self).reshape(-1)[0].item()

    def __float__(self) -> float:
        if self.size != 1:
            raise InvalidArgumentError(
                f"float() needs a one-element tensor, got shape {self.shape} ({self.size} "
                f"elements)")
        return float(self.item())

    def __int__(self) -> int:
        """int() of the one element (a float truncates toward zero, as NumPy's)."""
        if self.size != 1:
            raise InvalidArgumentError(
                f"int() needs a one-element tensor, got shape {self.shape} ({self.size} "
                f"elements)")
        return int(self.item())

    def __index__(self) -> int:
        """A one-element integer tensor as an index (range(t), list[t], operator.index);
        DTypeMismatchError (a TypeError, as the protocol asks) for anything else."""
        if self.dtype not in _INTEGERS or self.size != 1:
            raise DTypeMismatchError(
                f"only a one-element integer tensor (int32, int64, uint8) converts to an "
                f"index, got a {self.dtype.name_str} tensor of shape {self.shape} "
                f"({self.size} elements)")
        return int(self.item())

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        """Refused: device memory is not copied to the host implicitly (np.asarray would
        otherwise walk the tensor element by element through __getitem__)."""
        raise InvalidArgumentError(
            "a CudaTensor is not converted to a NumPy array implicitly; use tensor.numpy() "
            "(or CudaMath.to_numpy)")

    # -- shapes and indexing (CudaMath.reshape, permute, getitem, astype) ------------------
    def __getitem__(self, key: Any) -> "CudaTensor":
        """NumPy basic indexing (a view where the result is contiguous, else a copy); an int
        tensor key takes along axis 0."""
        return _math_of(self).getitem(self, key)

    def __iter__(self) -> Any:
        """The sub-tensors along axis 0 (views), as NumPy iterates; a 0-d tensor raises."""
        if not self.shape:
            raise TypeError("iteration over a 0-d tensor")
        return (self[i] for i in range(self.shape[0]))

    def reshape(self, *shape: Any) -> "CudaTensor":
        """A view of a new shape: t.reshape(2, 3) or t.reshape((2, 3)); one dim may be -1."""
        return _math_of(self).reshape(self, _shape_args(shape))

    def view(self, *shape: Any) -> "CudaTensor":
        """reshape (PyTorch's name)."""
        return _math_of(self).view(self, _shape_args(shape))

    def permute(self, *axes: Any) -> "CudaTensor":
        """t.permute(2, 0, 1) or t.permute((2, 0, 1)): a new tensor with the axes reordered."""
        return _math_of(self).permute(self, _shape_args(axes))

    def transpose(self, *axes: Any) -> "CudaTensor":
        """NumPy's: t.transpose() reverses the axes; t.transpose(1, 0, 2) permutes them."""
        return _math_of(self).transpose(self, _shape_args(axes) if axes else None)

    def astype(self, dtype: Any) -> "CudaTensor":
        """A new tensor converted to dtype (NumPy's astype)."""
        return _math_of(self).astype(self, dtype)

    @property
    def T(self) -> "CudaTensor":
        """Transpose of a 2-D tensor (last two axes of a 3-D one), as a new tensor."""
        return _math_of(self).matrix_transpose(self)

    def to(self, device_id: int) -> "CudaTensor":
        """A copy on another device (peer-to-peer when possible); self if already there."""
        if device_id == self.device_id:
            return self.check_alive()
        return _backend_of(self).copy_to_tensor_device(self, device_id)

    def numpy(self) -> np.ndarray:
        """A host copy (bfloat16 as ml_dtypes.bfloat16; `.astype(np.float32)` widens it)."""
        return _math_of(self).to_numpy(self)

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
_INTEGERS = frozenset((CudaDataType.INT32, CudaDataType.INT64, CudaDataType.UINT8))


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
    t.shape = shape
    t.dtype = dtype
    t.device_id = device_id
    t._ptr = int(block)
    t._block = block
    t._pool = pool
    t._owner = None
    t._host = None
    t.on_host = False
    t.stream = block.stream if type(block) is StreamBlock else None
    t.size = size
    t.nbytes = nbytes
    t._exports = 0
    return t


def _host_operand(array: np.ndarray, op: str) -> Any:
    """A NumPy operand of a tensor operator: a 0-d array is its scalar; any other array
    raises, since operators never copy host arrays to the device implicitly."""
    if array.ndim == 0:
        return array[()]
    raise DTypeMismatchError(
        f"unsupported operand for {op}: a NumPy array of shape {array.shape} and a "
        f"CudaTensor (host arrays are not copied to the device implicitly); convert the "
        f"array with from_numpy() first")


# -- the math a tensor's operators use ------------------------------------------------------
# A tensor's operators (a + b, a @ b, a.T, -a, .numpy(), .to()) run on the backend that made
# it: its pool's `owner` (set by CudaBackend), else (no pool: from_cuda_array wrappers,
# zero-size tensors) the process backend. The CudaMath for a backend is the first one made
# for it (CudaMath.__init__ calls register_math), else one the factory that cuda_math
# registers at import makes on first use; so this module has no import of cuda_math (it
# loads the module by name only if an operator runs before anything imported it).
# A plain dict, keyed by identity: weak keys would not free anything here, since each value
# (a CudaMath) holds its key (math.backend), and atexit holds every backend's shutdown.
_MATHS: dict = {}
_math_factory: Optional[Any] = None


def register_math(backend: Any, math_: Any) -> None:
    """Make math_ the CudaMath of backend's tensors, unless one already is (first wins)."""
    _MATHS.setdefault(backend, math_)


def set_math_factory(factory: Any) -> None:
    """factory(backend) -> a CudaMath for it (called by cuda_math at import)."""
    global _math_factory
    _math_factory = factory


def _math_of(t: CudaTensor) -> Any:
    """The CudaMath of t's backend (the operators' per-call path: two lookups)."""
    pool = t._pool
    if pool is not None:
        m = _MATHS.get(pool.owner)
        if m is not None:
            return m
    return math_for(_backend_of(t))


def _backend_of(t: CudaTensor) -> Any:
    """The backend whose pool t's memory came from, else the process backend."""
    pool = t._pool
    backend = None if pool is None else pool.owner
    if backend is None:
        t.check_alive()   # a freed tensor: the error the operation would raise, no backend
        from .backend import get_cuda_backend
        backend = get_cuda_backend()
    return backend


def math_for(backend: Any) -> Any:
    """The CudaMath registered for backend, made (and registered) on first use."""
    m = _MATHS.get(backend)
    if m is None:
        if _math_factory is None:
            # cuda_math registers the factory when imported; nothing imported it yet
            import importlib
            importlib.import_module(__package__ + ".cuda_math")
        m = _MATHS.get(backend)
        if m is None:
            assert _math_factory is not None    # (importing cuda_math registered it)
            _math_factory(backend)   # CudaMath.__init__ registers it (or a racing one won)
            m = _MATHS[backend]
    return m


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


def _shape_args(args: Tuple[Any, ...]) -> Any:
    """A method's *args as one shape / axes: f(2, 3) and f((2, 3)) both give (2, 3)."""
    if len(args) == 1 and not isinstance(args[0], (int, np.integer)):
        a = args[0]
        return tuple(a) if isinstance(a, list) else a
    return tuple(args)
