"""Typed errors raised by cuda_backend.

Every error says what was wrong and what was expected. The classes also derive from the
built-in exception a Python user would catch for the same mistake (ValueError, TypeError,
MemoryError, KeyError), so generic handlers keep working.
"""
from __future__ import annotations

from typing import AbstractSet, Optional, Sequence


class CudaBackendError(Exception):
    """Base class of every error cuda_backend raises on purpose."""


class CudaNotAvailableError(CudaBackendError, RuntimeError):
    """A GPU-only feature was asked for while the backend runs in fallback mode."""


class InvalidDeviceError(CudaBackendError, ValueError):
    """A device id outside the range of enumerated GPUs."""

    def __init__(self, device_id: object, device_count: int):
        if device_count == 0:
            valid = "no GPU is available (fallback mode has only the host, device 0)"
        else:
            valid = f"valid device ids are 0..{device_count - 1}"
        super().__init__(f"invalid device id {device_id!r}: {valid}")
        self.device_id = device_id
        self.device_count = device_count


class InvalidArgumentError(CudaBackendError, ValueError):
    """A malformed argument: a negative size, a bad option value, an unknown name."""


class DeviceMismatchError(CudaBackendError, ValueError):
    """Operands live on different devices."""


class ShapeMismatchError(CudaBackendError, ValueError):
    """Operand shapes do not fit together."""


class DTypeMismatchError(CudaBackendError, TypeError):
    """An operand has the wrong or an unsupported dtype."""


class TensorFreedError(CudaBackendError, RuntimeError):
    """A tensor was used after `free()`."""


class InvalidPointerError(CudaBackendError, KeyError):
    """`free_memory` got a pointer the pool did not hand out, or one already freed."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class CudaOutOfMemoryError(CudaBackendError, MemoryError):
    """A device allocation failed after freeing cached blocks and retrying."""

    def __init__(self, requested: int, device_id: int, in_use: int, cached: int,
                 limit: Optional[int], reason: str = "the device is out of memory"):
        lim = "none" if limit is None else _fmt_bytes(limit)
        super().__init__(
            f"CUDA out of memory on device {device_id}: tried to allocate "
            f"{_fmt_bytes(requested)} ({requested} bytes); {reason}. "
            f"In use by the pool: {_fmt_bytes(in_use)}, cached free blocks: {_fmt_bytes(cached)}, "
            f"pool limit: {lim}.")
        self.requested = requested
        self.device_id = device_id
        self.in_use = in_use
        self.cached = cached
        self.limit = limit


class KernelCompilationError(CudaBackendError, RuntimeError):
    """nvcc rejected a kernel. Carries the command line, the compiler log and the source."""

    def __init__(self, kernel_name: str, log: str, source: str,
                 command_line: Optional[Sequence[str]] = None):
        numbered = number_source_lines(source, _error_lines(log))
        cmd = " ".join(command_line) if command_line else "(unknown)"
        super().__init__(
            f"Failed to compile CUDA kernel '{kernel_name}'\n"
            f"command: {cmd}\n"
            f"--- compiler output ---\n{log.strip()}\n"
            f"--- source (lines the compiler named are marked '>>') ---\n{numbered}")
        self.kernel_name = kernel_name
        self.log = log
        self.source = source
        self.command_line = list(command_line) if command_line else []


class KernelNotFoundError(CudaBackendError, KeyError):
    """`launch_kernel` or `get_kernel` was given a name that was never compiled."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class LaunchConfigurationError(CudaBackendError, ValueError):
    """Block, grid or shared memory over the device's limits, or malformed launch arguments."""


class KernelLaunchError(CudaBackendError, RuntimeError):
    """The driver refused a launch or a kernel faulted; after a fault the context is unusable."""


FAULT_WORDS = ("illegal", "launch failed", "misaligned", "exception", "trap",
                "unspecified launch", "hardware stack error", "illegal instruction")


def driver_failure(what: str, exc: Exception, device_id: int) -> "KernelLaunchError":
    """Turn a driver error into KernelLaunchError; a kernel fault says the context is gone."""
    text = str(exc)
    if any(w in text.lower() for w in FAULT_WORDS):
        hint = (f" A kernel faulted on device {device_id}: its CUDA context is no longer "
                f"usable in this process (every later call on it fails); restart the process.")
    else:
        hint = ""
    return KernelLaunchError(f"{what} failed: {text}.{hint}")


class TransferError(CudaBackendError, ValueError):
    """A host/device copy whose size or dtype does not match its destination."""


def _fmt_bytes(n: int) -> str:
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    value = float(n)
    for unit in units:
        if abs(value) < 1024 or unit == units[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"


def _error_lines(log: str) -> set:
    """Line numbers that nvcc's messages point at (`kernel.cu(12): error ...`)."""
    import re
    return {int(m) for m in re.findall(r"\.cu\((\d+)\)", log)}


def number_source_lines(source: str, marked: AbstractSet[int] = frozenset()) -> str:
    """The source with 1-based line numbers, marking the lines in `marked`."""
    lines = source.splitlines()
    width = len(str(len(lines)))
    out = []
    for i, line in enumerate(lines, 1):
        mark = ">>" if i in marked else "  "
        out.append(f"{mark}{i:>{width}} | {line}")
    return "\n".join(out)


class GraphCaptureError(CudaBackendError, RuntimeError):
    """A call that cannot be recorded into a CUDA graph was made while capturing, or the
    capture failed."""


class InvalidIndexError(CudaBackendError, IndexError):
    """An index NumPy rejects with IndexError: too many indices for the tensor's dimensions,
    a second Ellipsis, a float or other non-index object in a key."""


class IndexOutOfRangeError(InvalidIndexError):
    """An integer index outside [-size, size) of its axis: a key of `tensor[...]`, or an
    element of the indices of take / gather / scatter_add (those are checked on the device,
    by a flag the kernel sets, when check_bounds=True)."""
