"""Shared test setup: skip `gpu` / `multigpu` tests where they cannot run; the `backend` fixture.

The markers themselves are declared in pyproject.toml.
"""
import os

import pytest
from hypothesis import settings

from cuda_backend.driver import load_driver

# Property tests take their example counts from tests/fuzzing.py: CUDA_BACKEND_FUZZ=full runs
# 200+ per family (the fuzzing run), =sanitize keeps compute-sanitizer runs short.
settings.register_profile("ci", deadline=None)
settings.load_profile("ci")

# tests/helpers.py: the helpers several test files share; their asserts report like a test's.
pytest.register_assert_rewrite("helpers")


# Tests at full sizes (4096^2 matmul, 2^26-element reductions, 8192x4096 rows, seq 16384
# attention...) carry `@pytest.mark.large` so the sanitizer runs can leave them out:
# racecheck and synccheck check hazards inside a block, and every kernel config these run is
# also run by a small, odd-sized test in the same file (the "every config" tests).
# The one test still marked by name, below: test_matmul.py was left out when the marks moved
# onto the tests (it was being edited); once its mark is on the test, drop LARGE and _mark_large.
LARGE = {
    "test_matmul.py": {"test_gpu_fp32_4096_is_true_fp32"},
}


def _mark_large(items):
    for item in items:
        names = LARGE.get(os.path.basename(str(item.fspath)), ())
        if getattr(item, "originalname", item.name) in names:
            item.add_marker(pytest.mark.large)


def pytest_collection_modifyitems(config, items):
    _mark_large(items)
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
