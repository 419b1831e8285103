"""Tensor maps (CUtensorMap) for kernels that load through Hopper's tensor memory accelerator,
and the parameter layout of kernels that take them.

`encode_2d` encodes a 2-D tiled map with cuTensorMapEncodeTiled: through NVIDIA's cuda-bindings
(`cuda.bindings.driver`) when importable, else through ctypes on the driver library PyCUDA
loaded (libcuda.so.1); both give the same 128 bytes (compared on an H100 by
perf/tma16_check.py). `param_layout` reads a kernel's parameter offsets with
cuFuncGetParamInfo (driver 12.4+): a CUtensorMap parameter is alignas(128) in CUDA 13's
cuda.h and ptxas aligns its absolute constant-bank address, so the offsets are not those of
natural alignment from 0 and a launch buffer must be packed at the queried ones
(`pack_params`)."""
from __future__ import annotations

import ctypes
import struct
from typing import Any, Callable, Optional, Sequence, Tuple

from .dtypes import CudaDataType
from .errors import (CudaNotAvailableError, InvalidArgumentError, KernelLaunchError,
                     LaunchConfigurationError)

DT = CudaDataType
MAP_BYTES = 128
# CUtensorMapDataType values (cuda.h)
DATA_TYPES = {DT.FLOAT16: 6, DT.FLOAT32: 7, DT.BFLOAT16: 9}
TFLOAT32 = 11   # float32 in memory, rounded to TF32 (to nearest) as the box is copied
INTERLEAVE_NONE, SWIZZLE_NONE, SWIZZLE_128B, L2_PROMOTION_256B, OOB_FILL_ZERO = 0, 0, 3, 3, 0
BOX_MAX = 256            # elements per box dimension
SWIZZLE_SPAN = 128       # bytes of a box's inner dimension under the 128-byte swizzle

# (offsets and sizes of the parameters in order, total bytes of the parameter area)
ParamLayout = Tuple[Tuple[Tuple[int, int], ...], int]
# encoder(ptr, data type code, dims, strides, box, swizzle) -> 128 bytes; innermost first
Encoder = Callable[[int, int, Tuple[int, ...], Tuple[int, ...], Tuple[int, ...], int], bytes]

_chosen: list = []     # the encoder get_encoder() chose, once per process
_driver: list = []     # the ctypes driver library, once loaded


def driver_library() -> Any:
    """libcuda.so.1 through ctypes (the library PyCUDA already loaded); a typed error where
    it cannot be opened."""
    if not _driver:
        try:
            _driver.append(ctypes.CDLL("libcuda.so.1"))
        except OSError as exc:
            raise CudaNotAvailableError(
                f"the CUDA driver library libcuda.so.1 cannot be loaded ({exc}): tensor maps "
                f"and kernel parameter layouts need it") from None
    return _driver[0]


def ctypes_encoder(lib: Any) -> Encoder:
    """An encoder calling lib.cuTensorMapEncodeTiled through ctypes (the map written into a
    64-byte aligned buffer, as the driver requires)."""
    f = lib.cuTensorMapEncodeTiled
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                  ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                  ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                  ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]

    def encode(ptr: int, code: int, dims: Tuple[int, ...], strides: Tuple[int, ...],
               box: Tuple[int, ...], swizzle: int) -> bytes:
        raw = (ctypes.c_uint8 * (MAP_BYTES + 64))()
        addr = ctypes.addressof(raw)
        addr += (-addr) % 64
        n = len(dims)
        err = f(ctypes.c_void_p(addr), code, n, ctypes.c_void_p(ptr),
                (ctypes.c_uint64 * n)(*dims), (ctypes.c_uint64 * (n - 1))(*strides),
                (ctypes.c_uint32 * n)(*box), (ctypes.c_uint32 * n)(*([1] * n)),
                INTERLEAVE_NONE, swizzle, L2_PROMOTION_256B, OOB_FILL_ZERO)
        if err != 0:
            raise InvalidArgumentError(
                f"cuTensorMapEncodeTiled (ctypes) failed with CUresult {err} for dims {dims}, "
                f"strides {strides} bytes, box {box}, address {ptr:#x}: expected a 16-byte "
                f"aligned address and strides that are multiples of 16 bytes")
        return ctypes.string_at(addr, MAP_BYTES)
    return encode


def bindings_encoder(cu: Any) -> Encoder:
    """An encoder calling cuda.bindings.driver.cuTensorMapEncodeTiled (module `cu`)."""
    def encode(ptr: int, code: int, dims: Tuple[int, ...], strides: Tuple[int, ...],
               box: Tuple[int, ...], swizzle: int) -> bytes:
        n = len(dims)
        enums = (cu.CUtensorMapInterleave(INTERLEAVE_NONE), cu.CUtensorMapSwizzle(swizzle),
                 cu.CUtensorMapL2promotion(L2_PROMOTION_256B),
                 cu.CUtensorMapFloatOOBfill(OOB_FILL_ZERO))
        dt = cu.CUtensorMapDataType(code)
        try:
            res = cu.cuTensorMapEncodeTiled(dt, n, ptr, list(dims), list(strides), list(box),
                                            [1] * n, *enums)
        except TypeError:   # versions that want the wrapped integer types
            res = cu.cuTensorMapEncodeTiled(
                dt, n, ptr, [cu.cuuint64_t(d) for d in dims],
                [cu.cuuint64_t(s) for s in strides], [cu.cuuint32_t(b) for b in box],
                [cu.cuuint32_t(1)] * n, *enums)
        err, tmap = res[0], res[1]
        if err != cu.CUresult.CUDA_SUCCESS:
            raise InvalidArgumentError(
                f"cuTensorMapEncodeTiled (cuda.bindings) failed with {err} for dims {dims}, "
                f"strides {strides} bytes, box {box}, address {ptr:#x}: expected a 16-byte "
                f"aligned address and strides that are multiples of 16 bytes")
        return ctypes.string_at(int(tmap.getPtr()), MAP_BYTES)
    return encode


def get_encoder() -> Encoder:
    """The process's encoder: cuda.bindings where importable, else ctypes on libcuda.so.1;
    CudaNotAvailableError naming both where neither works."""
    if _chosen:
        return _chosen[0]
    why = []
    try:
        from cuda.bindings import driver as cu   # optional: the `tensor-maps` extra
        if not hasattr(cu, "cuTensorMapEncodeTiled"):
            raise ImportError("cuda.bindings.driver has no cuTensorMapEncodeTiled")
        _chosen.append(bindings_encoder(cu))
        return _chosen[0]
    except ImportError as exc:
        why.append(f"cuda.bindings is not importable ({exc})")
    try:
        _chosen.append(ctypes_encoder(driver_library()))
        return _chosen[0]
    except (CudaNotAvailableError, AttributeError) as exc:
        why.append(f"libcuda.so.1 has no usable cuTensorMapEncodeTiled ({exc})")
    raise CudaNotAvailableError(
        "no way to encode a tensor map (cuTensorMapEncodeTiled, CUDA 12+ driver): "
        + "; ".join(why) + ". Install the `cuda-bindings` package or a CUDA 12+ driver")


def clear_encoder() -> None:
    """Forget the chosen encoder: the next get_encoder() chooses again (tests; a process that
    installed cuda-bindings after its first encode)."""
    _chosen.clear()


def encode_2d(ptr: int, dtype: CudaDataType, rows: int, cols: int, row_stride_bytes: int,
              box_rows: int, box_cols: int, swizzle128: bool = True,
              round_tf32: bool = False) -> bytes:
    """The 128 bytes of a 2-D tiled tensor map over a row-major (rows, cols) matrix at device
    address ptr: boxes of box_rows x box_cols elements, 128-byte swizzle (swizzle128) or
    none, L2 promotion 256 bytes, out-of-bounds elements read as zeros. round_tf32 (float32
    only): the copy rounds each value to TF32 (to nearest; tests/test_matmul.py
    test_gpu_tma_tf32_rounds_a measures it)."""
    code = TFLOAT32 if round_tf32 and dtype is DT.FLOAT32 else DATA_TYPES.get(dtype)
    if code is None:
        raise InvalidArgumentError(
            f"tensor maps here take float16, bfloat16 or float32, got {dtype.name_str}")
    if rows < 1 or cols < 1:
        raise InvalidArgumentError(f"a tensor map needs rows, cols >= 1, got {rows} x {cols}")
    if ptr % 16 or row_stride_bytes % 16 or row_stride_bytes < cols * dtype.itemsize:
        raise InvalidArgumentError(
            f"a tensor map needs a 16-byte aligned address and a row stride that is a "
            f"multiple of 16 bytes and at least a row ({cols * dtype.itemsize} bytes), got "
            f"address {ptr:#x}, row stride {row_stride_bytes}")
    if not (1 <= box_rows <= BOX_MAX and 1 <= box_cols <= BOX_MAX) or \
            (swizzle128 and box_cols * dtype.itemsize > SWIZZLE_SPAN):
        raise InvalidArgumentError(
            f"a tensor map box has 1 to {BOX_MAX} elements per dimension and, under the "
            f"128-byte swizzle, at most {SWIZZLE_SPAN} bytes per row; got {box_rows} x "
            f"{box_cols} of {dtype.name_str}")
    return get_encoder()(ptr, code, (cols, rows), (row_stride_bytes,), (box_cols, box_rows),
                         SWIZZLE_128B if swizzle128 else SWIZZLE_NONE)


def encode_tiled(ptr: int, dtype: CudaDataType, dims: Sequence[int],
                 strides_bytes: Sequence[int], box: Sequence[int],
                 round_tf32: bool = False) -> bytes:
    """The 128 bytes of a tiled tensor map of rank len(dims) (2 to 5) at device address ptr:
    dims innermost first (dims[0] contiguous), strides_bytes those of dims[1:], boxes of
    `box` elements, 128-byte swizzle (box[0] at most 128 bytes), L2 promotion 256 bytes,
    out-of-bounds elements (negative coordinates too) read as zeros; round_tf32 as in
    encode_2d."""
    code = TFLOAT32 if round_tf32 and dtype is DT.FLOAT32 else DATA_TYPES.get(dtype)
    if code is None:
        raise InvalidArgumentError(
            f"tensor maps here take float16, bfloat16 or float32, got {dtype.name_str}")
    dims, strides, box = tuple(dims), tuple(strides_bytes), tuple(box)
    if not 2 <= len(dims) <= 5 or len(strides) != len(dims) - 1 or len(box) != len(dims) or \
            min(dims) < 1:
        raise InvalidArgumentError(
            f"a tiled tensor map takes 2 to 5 dims >= 1, one stride fewer and a box per dim; "
            f"got dims {dims}, strides {strides}, box {box}")
    if ptr % 16 or any(st % 16 for st in strides):
        raise InvalidArgumentError(
            f"a tensor map needs a 16-byte aligned address and strides that are multiples of "
            f"16 bytes, got address {ptr:#x}, strides {strides}")
    if not all(1 <= b <= BOX_MAX for b in box) or box[0] * dtype.itemsize > SWIZZLE_SPAN:
        raise InvalidArgumentError(
            f"a tensor map box has 1 to {BOX_MAX} elements per dimension and, under the "
            f"128-byte swizzle, at most {SWIZZLE_SPAN} bytes in its innermost one; got {box}")
    return get_encoder()(ptr, code, dims, strides, box, SWIZZLE_128B)


def function_layout(lib: Any, func: int) -> ParamLayout:
    """cuFuncGetParamInfo over every parameter of the CUfunction `func` (driver 12.4+)."""
    try:
        info = lib.cuFuncGetParamInfo
    except AttributeError:
        raise CudaNotAvailableError(
            "the driver has no cuFuncGetParamInfo (CUDA 12.4+ drivers): the parameter layout "
            "of a kernel taking tensor maps cannot be read") from None
    info.restype = ctypes.c_int
    info.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                     ctypes.POINTER(ctypes.c_size_t)]
    out = []
    for i in range(256):
        off, size = ctypes.c_size_t(), ctypes.c_size_t()
        if info(ctypes.c_void_p(func), i, ctypes.byref(off), ctypes.byref(size)) != 0:
            break
        out.append((int(off.value), int(size.value)))
    if not out:
        raise KernelLaunchError(f"cuFuncGetParamInfo gave no parameter for function {func:#x}")
    return tuple(out), max(o + s for o, s in out)


def cubin_layout(lib: Any, cubin: bytes, name: str) -> ParamLayout:
    """function_layout of kernel `name` of a cubin loaded a second time, through ctypes, in
    the current context (unloaded after the query)."""
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    buf = ctypes.create_string_buffer(cubin, len(cubin))
    err = lib.cuModuleLoadData(ctypes.byref(mod), buf)
    if err != 0:
        raise KernelLaunchError(f"cuModuleLoadData of {name}'s cubin failed: CUresult {err} "
                                f"(a current context is needed)")
    try:
        err = lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode())
        if err != 0:
            raise KernelLaunchError(f"cuModuleGetFunction({name!r}) failed: CUresult {err}")
        return function_layout(lib, int(fn.value or 0))
    finally:
        lib.cuModuleUnload(mod)


def param_layout(kernel: Any, cubin: Optional[bytes] = None) -> ParamLayout:
    """The parameter layout of a compiled kernel (compiler.CudaKernel): cuFuncGetParamInfo on
    its function handle (PyCUDA's Function `handle`, where the installed PyCUDA has one),
    else on the kernel of the same name in `cubin` (a build of the same signature) loaded a
    second time; the device's context must be current."""
    lib = driver_library()
    handle = getattr(getattr(kernel, "function", None), "handle", None)
    if handle:
        return function_layout(lib, int(handle))
    if cubin is None:
        raise CudaNotAvailableError(
            f"kernel '{kernel.name}': its parameter layout needs its CUfunction handle (this "
            f"PyCUDA's Function has no `handle`) or a cubin of the same signature")
    return cubin_layout(lib, cubin, kernel.name)


def pack_params(fields: Sequence[Tuple[str, Any]], layout: ParamLayout) -> bytes:
    """A launch buffer of layout's size with field i (struct format, value) at parameter i's
    offset; a typed error where the count or a size differs from the kernel's."""
    offsets, total = layout
    if len(fields) != len(offsets):
        raise LaunchConfigurationError(
            f"{len(fields)} arguments packed for a kernel of {len(offsets)} parameters")
    buf = bytearray(total)
    for i, ((fmt, value), (off, size)) in enumerate(zip(fields, offsets)):
        if struct.calcsize("<" + fmt) != size:
            raise LaunchConfigurationError(
                f"parameter {i}: {struct.calcsize('<' + fmt)} bytes given ('{fmt}'), the "
                f"kernel's is {size} bytes")
        struct.pack_into("<" + fmt, buf, off, value)
    return bytes(buf)
