"""Launches compiled kernels: argument conversion, limit checks, optional timing."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Tuple, Type

import numpy as np

from .compiler import CudaKernel
from .memory_streams import record_stream
from . import streams as _streams
from .tensor import CudaTensor
from .errors import LaunchConfigurationError, driver_failure

if TYPE_CHECKING:
    from .profiling import Profiler

_FLOAT_CODES = frozenset("fd")
_INT_CODES = frozenset("iIqQhHbB?")
VALIDATED_MAX = 1024  # launch configurations remembered per kernel as already checked


def normalize_dims(dims: Any, what: str) -> Tuple[int, int, int]:
    """(x,), (x, y), (x, y, z) or x -> a 3-tuple of positive ints."""
    if isinstance(dims, (int, np.integer)) and not isinstance(dims, bool):
        dims = (int(dims),)
    try:
        dims = tuple(int(d) for d in dims)
    except (TypeError, ValueError):
        raise LaunchConfigurationError(
            f"{what} must be an int or a tuple of 1 to 3 ints, got {dims!r}") from None
    if not 1 <= len(dims) <= 3:
        raise LaunchConfigurationError(f"{what} must have 1 to 3 dimensions, got {dims!r}")
    if any(d < 1 for d in dims):
        raise LaunchConfigurationError(f"{what} dimensions must be >= 1, got {dims!r}")
    return dims + (1,) * (3 - len(dims))


def check_limits(kernel: CudaKernel, info: Any, grid: Tuple[int, int, int],
                 block: Tuple[int, int, int], shared_mem: int) -> None:
    """Raise LaunchConfigurationError naming the first device or kernel limit exceeded."""
    threads = block[0] * block[1] * block[2]
    if threads > info.max_threads_per_block:
        raise LaunchConfigurationError(
            f"kernel '{kernel.name}': block {block} has {threads} threads, over the device "
            f"limit of {info.max_threads_per_block} threads per block")
    for axis, (b, lim) in enumerate(zip(block, info.max_block_dims)):
        if b > lim:
            raise LaunchConfigurationError(
                f"kernel '{kernel.name}': block dimension {'xyz'[axis]}={b} is over the "
                f"device limit of {lim}")
    for axis, (g, lim) in enumerate(zip(grid, info.max_grid_dims)):
        if g > lim:
            raise LaunchConfigurationError(
                f"kernel '{kernel.name}': grid dimension {'xyz'[axis]}={g} is over the "
                f"device limit of {lim}")
    if threads > kernel.max_threads_per_block:
        raise LaunchConfigurationError(
            f"kernel '{kernel.name}': block of {threads} threads is over this kernel's "
            f"limit of {kernel.max_threads_per_block} threads per block (it uses "
            f"{kernel.num_regs} registers per thread)")
    if shared_mem < 0:
        raise LaunchConfigurationError(
            f"kernel '{kernel.name}': shared_mem must be >= 0, got {shared_mem}")
    total_shared = kernel.static_shared_bytes + shared_mem
    if total_shared > info.shared_memory_per_block_optin:
        raise LaunchConfigurationError(
            f"kernel '{kernel.name}': {shared_mem} bytes of dynamic shared memory plus "
            f"{kernel.static_shared_bytes} static is over the device limit of "
            f"{info.shared_memory_per_block_optin} bytes per block (opt-in maximum)")


class PreparedLaunch:
    """One launch of a kernel with its grid, block, shared memory and argument layout fixed
    and checked against the device once; a call packs the arguments (pointers as ints,
    floats, ints, in the kernel's order) and launches, nothing else. Made by
    `Launcher.prepare` (or `CudaBackend.prepare_launch`) once per op and shape class; callers
    check `Launcher.direct(device_id)` first, which says whether a direct launch is right now
    (the device's context current in this thread, no `with stream:` block, no profiling),
    and take the general path otherwise."""

    __slots__ = ("kernel", "device_id", "grid", "block", "shared_mem", "pack", "launch_fn",
                 "_error", "_what")

    def __init__(self, launcher: "Launcher", kernel: CudaKernel, device_id: int, grid: Any,
                 block: Any, shared_mem: int = 0) -> None:
        self.kernel, self.device_id, self.shared_mem = kernel, device_id, int(shared_mem)
        self.grid, self.block = launcher.validate(kernel, device_id, grid, block, shared_mem)
        self.pack = launcher.packer(kernel.arg_format)
        self.launch_fn = kernel.function._launch_kernel
        self._error = launcher.driver_error
        self._what = f"launch of kernel '{kernel.name}'"

    def __call__(self, *args: Any) -> None:
        try:
            self.launch_fn(self.grid, self.block, self.pack(*args), self.shared_mem, None)
        except self._error as exc:
            raise driver_failure(self._what, exc, self.device_id) from None

    def launch_packed(self, buf: bytes, stream: Any = None) -> None:
        """This launch with an argument buffer the caller packed as the kernel's parameter
        area (for parameters `pack` cannot place, e.g. CUtensorMaps at the offsets
        cuFuncGetParamInfo gives), on `stream` (a PyCUDA stream; None: the legacy default)."""
        try:
            self.launch_fn(self.grid, self.block, buf, self.shared_mem, stream)
        except self._error as exc:
            raise driver_failure(self._what, exc, self.device_id) from None

    def split_pack(self, leading: int, *rest: Any) -> Optional[Tuple[Callable[..., bytes],
                                                                      bytes]]:
        """(pack of the first `leading` arguments, the bytes of `rest` after them): the launch
        buffer of (*lead, *rest) is pack(*lead) + bytes, the rest packed once. None where
        the leading arguments' bytes are not a whole number of 8-byte words (the rest's
        alignment would depend on them) or a sample does not pack to the same bytes as the
        whole; the bytes are PyCUDA's (tests/test_host_path.py compares them with the
        general path's)."""
        import struct
        fmt = self.kernel.arg_format
        lead_fmt = fmt[:leading]
        if len(fmt) != leading + len(rest) or struct.calcsize(lead_fmt) % 8:
            return None
        head = struct.Struct(lead_fmt).pack
        sample = tuple(1.5 if c in _FLOAT_CODES else i + 1 for i, c in enumerate(lead_fmt))
        tail = self.pack(*((0,) * leading), *rest)[struct.calcsize(lead_fmt):]
        return (head, tail) if head(*sample) + tail == self.pack(*sample, *rest) else None

    def bind(self, leading: int, *rest: Any) -> Callable[..., None]:
        """This launch with every argument after the first `leading` fixed to `rest`: a call
        takes the leading ones and packs only those (split_pack), or everything where
        split_pack cannot split."""
        split = self.split_pack(leading, *rest)
        if split is None:
            full = self

            def run_full(*lead: Any) -> None:
                full(*lead, *rest)
            return run_full
        head, tail = split
        launch_fn, grid, block, shared = self.launch_fn, self.grid, self.block, self.shared_mem
        error, what, dev = self._error, self._what, self.device_id

        def run(*lead: Any) -> None:
            try:
                launch_fn(grid, block, head(*lead) + tail, shared, None)
            except error as exc:
                raise driver_failure(what, exc, dev) from None
        return run


class Launcher:
    """launch_kernel: the per-call path is kept to dict lookups, one pack and the launch."""

    def __init__(self, drv: Any, compiler: Any, contexts: Any, devices: Sequence[Any]) -> None:
        from pycuda._pvt_struct import pack
        self._drv = drv
        self._pack = pack
        self._compiler = compiler
        self._kernels = compiler._by_name  # (device_id, name) -> CudaKernel, shared
        self._contexts = contexts
        self._devices = devices
        self.profiler: Optional[Profiler] = None  # set by the backend when profiling is on
        self._packers: dict = {}
        self._ctx_local = contexts.local_state

    @property
    def driver_error(self) -> Type[Exception]:
        return self._drv.Error

    def direct(self, device_id: int) -> bool:
        """Whether a PreparedLaunch on device_id may launch directly now: the device's
        context is current in this thread, no `with stream:` block is open, profiling is off.
        (Thread-local attributes read through __dict__: a missing one costs no exception.)"""
        if self.profiler is not None or _streams.local_state.__dict__.get("stack"):
            return False
        st = self._ctx_local.__dict__.get("state")
        return st is not None and bool(st.stack) and st.stack[-1][0] == device_id

    def prepare(self, kernel: CudaKernel, device_id: int, grid: Any, block: Any,
                shared_mem: int = 0) -> PreparedLaunch:
        """A PreparedLaunch of `kernel` (checked against the device's limits now)."""
        return PreparedLaunch(self, kernel, device_id, grid, block, shared_mem)

    def packer(self, fmt: str) -> Any:
        """A function packing arguments of format `fmt` into a launch buffer: a compiled
        `struct.Struct(fmt).pack` where it gives PyCUDA's bytes (checked on a sample), else
        PyCUDA's own packer."""
        packer = self._packers.get(fmt)
        if packer is None:
            import struct
            sample = tuple(1.5 if c in _FLOAT_CODES else i + 1 for i, c in enumerate(fmt))
            try:
                fast = struct.Struct(fmt).pack
                packer = fast if fast(*sample) == self._pack(fmt, *sample) else None
            except struct.error:
                packer = None
            if packer is None:
                pack = self._pack

                def packer(*args: Any) -> bytes:
                    return pack(fmt, *args)
            self._packers[fmt] = packer
        return packer

    def validate(self, kernel: CudaKernel, device_id: int, grid_size: Any, block_size: Any,
                 shared_mem: int) -> tuple:
        """(grid, block) as 3-tuples after the device-limit checks (cached per kernel)."""
        try:
            dims = kernel.validated.get((grid_size, block_size, shared_mem))
        except TypeError:
            dims = None
        if dims is None:
            dims = self._validate(kernel, device_id, grid_size, block_size, shared_mem)
        return dims

    def launch(self, kernel_name: str, grid_size: Any, args: Sequence[Any],
               block_size: Any = (256, 1, 1), shared_mem: int = 0, stream: Any = None,
               device_id: Optional[int] = None) -> float:
        top = self._contexts.top_device()
        if device_id is None:
            device_id = 0 if top is None else top
        kernel = self._kernels.get((device_id, kernel_name))
        if kernel is None:
            kernel = self._compiler.get(kernel_name, device_id)
        try:
            dims = kernel.validated.get((grid_size, block_size, shared_mem))
        except TypeError:  # unhashable (lists)
            dims = None
        if dims is None:
            dims = self._validate(kernel, device_id, grid_size, block_size, shared_mem)
        fmt = kernel.arg_format
        if len(args) != len(fmt):
            raise LaunchConfigurationError(
                f"kernel '{kernel_name}' takes {len(fmt)} arguments (format '{fmt}'), "
                f"got {len(args)}")
        if stream is None:
            if _streams._local.__dict__.get("stack"):
                stream = _streams.current_pycuda_stream(device_id)
        elif not isinstance(stream, self._drv.Stream):
            stream = getattr(stream, "pycuda_stream", stream)
        values = []
        for i, a in enumerate(args):
            t = type(a)
            if t is int:
                values.append(a)
            elif t is CudaTensor:
                p = a._ptr
                values.append(p if p is not None else a.ptr)
                if a.stream is not stream:
                    record_stream(a, stream)   # stream order of its pool block (memory.py)
            elif t is float and fmt[i] in _FLOAT_CODES:
                values.append(a)
            else:
                values.append(_convert(a, fmt[i], i, kernel_name))
        try:
            buf = self._pack(fmt, *values)
        except Exception as exc:
            raise _pack_error(kernel, args, exc) from None
        if self.profiler is None:
            if top == device_id:
                return self._send(kernel, device_id, dims, buf, shared_mem, stream)
            with self._contexts.activate(device_id):
                return self._send(kernel, device_id, dims, buf, shared_mem, stream)
        return self._timed_launch(kernel, device_id, dims, buf, shared_mem, stream)

    def _send(self, kernel: CudaKernel, device_id: int, dims: tuple, buf: bytes,
              shared_mem: int, stream: Any) -> float:
        """One untimed launch of a packed argument buffer in the current context (0.0, the
        time launch() reports untimed); a driver error becomes the typed error."""
        try:
            kernel.function._launch_kernel(dims[0], dims[1], buf, shared_mem, stream)
        except self._drv.Error as exc:
            raise driver_failure(f"launch of kernel '{kernel.name}'", exc, device_id) from None
        return 0.0

    def _timed_launch(self, kernel: CudaKernel, device_id: int, dims: tuple, buf: bytes,
                      shared_mem: int, stream: Any) -> float:
        drv = self._drv
        with self._contexts.activate(device_id):
            start, end = drv.Event(), drv.Event()
            t0 = time.perf_counter()
            try:
                start.record(stream)
                kernel.function._launch_kernel(dims[0], dims[1], buf, shared_mem, stream)
                end.record(stream)
                end.synchronize()
            except drv.Error as exc:
                raise driver_failure(f"launch of kernel '{kernel.name}'", exc,
                                     device_id) from None
            ms = end.time_since(start)
        assert self.profiler is not None    # (launch() times only while profiling)
        self.profiler.record_kernel(kernel.name, ms, device_id, t0, dims[0], dims[1], shared_mem)
        return ms

    def _validate(self, kernel: CudaKernel, device_id: int, grid_size: Any, block_size: Any,
                  shared_mem: int) -> tuple:
        grid = normalize_dims(grid_size, "grid_size")
        block = normalize_dims(block_size, "block_size")
        if not isinstance(shared_mem, (int, np.integer)) or isinstance(shared_mem, bool):
            raise LaunchConfigurationError(f"shared_mem must be an int, got {shared_mem!r}")
        info = self._devices[device_id]
        check_limits(kernel, info, grid, block, int(shared_mem))
        if kernel.static_shared_bytes + shared_mem > 48 * 1024 and \
                shared_mem > kernel.max_dynamic_shared_bytes:
            with self._contexts.activate(device_id):
                kernel.function.set_attribute(
                    self._drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, int(shared_mem))
            kernel.max_dynamic_shared_bytes = int(shared_mem)
        dims = (grid, block)
        validated = kernel.validated
        if len(validated) >= VALIDATED_MAX:  # one entry per grid: per problem size
            validated.clear()
        try:
            validated[(grid_size, block_size, shared_mem)] = dims
        except TypeError:
            pass
        return dims


def _convert(arg: Any, code: str, index: int, kernel_name: str) -> Any:
    """Turn one launch argument into what struct.pack wants for its declared code."""
    if code == "P":
        if hasattr(arg, "ptr") and not isinstance(arg, (int, float)):
            return arg.ptr  # CudaTensor (raises if freed)
        cai = getattr(arg, "__cuda_array_interface__", None)
        if cai is not None:
            return cai["data"][0]
        try:
            return int(arg)  # PyCUDA allocations, raw pointers
        except (TypeError, ValueError):
            raise LaunchConfigurationError(
                f"kernel '{kernel_name}' argument {index}: expected a device pointer "
                f"(CudaTensor, int or allocation), got {type(arg).__name__}") from None
    if isinstance(arg, np.generic):
        arg = arg.item()
    if code in _INT_CODES and isinstance(arg, float):
        if not arg.is_integer():
            raise LaunchConfigurationError(
                f"kernel '{kernel_name}' argument {index}: an integer parameter got "
                f"non-integral {arg!r}")
        return int(arg)
    if code in _FLOAT_CODES and isinstance(arg, (int, bool)):
        return float(arg)
    return arg


def _pack_error(kernel: CudaKernel, args: Sequence[Any], exc: Exception) -> Exception:
    kinds = ", ".join(type(a).__name__ for a in args)
    return LaunchConfigurationError(
        f"kernel '{kernel.name}': arguments ({kinds}) do not match its parameters "
        f"(format '{kernel.arg_format}'): {exc}")
