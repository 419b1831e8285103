"""The seed's module path for the backend: `from cuda_backend.cuda_backend import get_cuda_backend`."""
from .backend import FALLBACK_MESSAGE, CudaBackend, get_cuda_backend  # noqa: F401
from .devices import CudaDeviceInfo  # noqa: F401
from .dtypes import CudaDataType  # noqa: F401
from .tensor import CudaTensor  # noqa: F401
