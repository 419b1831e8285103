"""The documented API's module path for the kernel generator (../shared/seeds/
001_097e3d6e2f3c2394.txt, with `cuda_backend` as the import root):
`from cuda_backend.cuda_kernels import get_kernel_generator`."""
from .dtypes import CudaDataType  # noqa: F401
from .kernels import KernelGenerator, get_kernel_generator  # noqa: F401
