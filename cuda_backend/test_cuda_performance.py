"""The documented API's module path for the performance tester (../shared/seeds/
001_097e3d6e2f3c2394.txt, with `cuda_backend` as the import root):

    from cuda_backend.test_cuda_performance import CudaPerformanceTester, TestConfiguration

(It lives in cuda_backend/performance/; this module only re-exports it.)
"""
from .performance import CudaPerformanceTester, TestConfiguration  # noqa: F401

__all__ = ["CudaPerformanceTester", "TestConfiguration"]
