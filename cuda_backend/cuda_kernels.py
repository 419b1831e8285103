"""The seed's module path for the kernel generator: `from cuda_backend.cuda_kernels import
get_kernel_generator`."""
from .dtypes import CudaDataType  # noqa: F401
from .kernels import KernelGenerator, get_kernel_generator  # noqa: F401
