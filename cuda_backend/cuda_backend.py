"""The documented API's module path for the backend (../shared/seeds/001_097e3d6e2f3c2394.txt,
with `cuda_backend` as the import root): `from cuda_backend.cuda_backend import get_cuda_backend`.
"""
from .backend import FALLBACK_MESSAGE, CudaBackend, get_cuda_backend  # noqa: F401
from .devices import CudaDeviceInfo  # noqa: F401
from .dtypes import CudaDataType  # noqa: F401
from .tensor import CudaTensor  # noqa: F401
