"""cuda_backend: a small GPU backend on PyCUDA, with Jinja2-templated CUDA kernels.

    from cuda_backend import get_cuda_backend
    backend = get_cuda_backend()
"""
__version__ = "0.1.0"

from .dtypes import CudaDataType, from_bfloat16_bits, to_bfloat16_bits  # noqa: E402
from .errors import (CudaBackendError, CudaNotAvailableError, CudaOutOfMemoryError,  # noqa: E402
                     DeviceMismatchError, DTypeMismatchError, GraphCaptureError,
                     InvalidArgumentError,
                     InvalidDeviceError, InvalidPointerError, KernelCompilationError,
                     KernelLaunchError, KernelNotFoundError, LaunchConfigurationError,
                     ShapeMismatchError, TensorFreedError, TransferError)
from .errors import IndexOutOfRangeError, InvalidIndexError  # noqa: E402
from .devices import CudaDeviceInfo  # noqa: E402
from .tensor import CudaTensor  # noqa: E402
from .backend import CudaBackend, get_cuda_backend, FALLBACK_MESSAGE  # noqa: E402
from .kernels import KernelGenerator, get_kernel_generator  # noqa: E402
from .dlpack_import import from_dlpack  # noqa: E402

__all__ = [
    "__version__", "CudaBackend", "get_cuda_backend", "CudaTensor", "CudaDataType",
    "CudaDeviceInfo", "KernelGenerator", "get_kernel_generator", "FALLBACK_MESSAGE",
    "to_bfloat16_bits", "from_bfloat16_bits",
    "CudaBackendError", "CudaNotAvailableError", "CudaOutOfMemoryError", "DeviceMismatchError",
    "DTypeMismatchError", "GraphCaptureError", "InvalidArgumentError", "InvalidDeviceError", "InvalidPointerError",
    "KernelCompilationError", "KernelLaunchError", "KernelNotFoundError",
    "LaunchConfigurationError", "ShapeMismatchError", "TensorFreedError", "TransferError",
    "InvalidIndexError", "IndexOutOfRangeError",
    "from_dlpack",
]


def __getattr__(name: str):  # the training modules load on first use, not at import
    if name in ("autograd", "nn", "optim"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
