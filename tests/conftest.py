"""Shared test setup: skip `gpu` / `multigpu` tests where they cannot run; the `backend` fixture.

The markers themselves are declared in pyproject.toml.
"""
import pytest
from hypothesis import settings

from cuda_backend.driver import load_driver

# Property tests take their example counts from tests/fuzzing.py: CUDA_BACKEND_FUZZ=full runs
# 200+ per family (the fuzzing run), =sanitize keeps compute-sanitizer runs short.
settings.register_profile("ci", deadline=None)
settings.load_profile("ci")


def pytest_collection_modifyitems(config, items):
    needs_gpu = [it for it in items
                 if it.get_closest_marker("gpu") or it.get_closest_marker("multigpu")]
    if not needs_gpu:
        return
    drv, reason = load_driver()
    gpu_count = drv.Device.count() if drv is not None else 0
    for item in needs_gpu:
        if drv is None:
            item.add_marker(pytest.mark.skip(reason=reason))
        elif item.get_closest_marker("multigpu") and gpu_count < 2:
            item.add_marker(pytest.mark.skip(
                reason=f"needs 2 or more CUDA GPUs, found {gpu_count}"))


@pytest.fixture(scope="session")
def backend():
    """The process-wide backend (fallback mode without PyCUDA or a GPU)."""
    from cuda_backend import get_cuda_backend
    return get_cuda_backend()
