"""The seed's module path for the performance tester:

    from cuda_backend.test_cuda_performance import CudaPerformanceTester, TestConfiguration

(It lives in cuda_backend/performance/; this module only re-exports it.)
"""
from .performance import CudaPerformanceTester, TestConfiguration  # noqa: F401

__all__ = ["CudaPerformanceTester", "TestConfiguration"]
