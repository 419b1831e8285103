"""Performance tester and report: `cuda-backend report`, or in Python

    from cuda_backend.test_cuda_performance import CudaPerformanceTester, TestConfiguration

Modules: config (TestConfiguration), cases* (what is measured), timing (CUDA events, L2
flush), ceilings (bandwidth and peak FLOP/s), peers (NumPy, CuPy, PyTorch), runner (one
case), schema (results.json format), charts, render (markdown, HTML, terminal), tester.
"""
from .config import TestConfiguration
from .tester import CudaPerformanceTester

__all__ = ["CudaPerformanceTester", "TestConfiguration"]
