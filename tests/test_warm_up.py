"""The per-module warm-up helpers (compile every variant in threads) call each module's
kernel getter correctly. A stand-in CudaMath records the calls, so this runs without a GPU."""
from __future__ import annotations

import contextlib
import threading

import pytest

from cuda_backend.ops import attention, conv2d, elementwise, matmul


class _Backend:
    current_device = 0

    @contextlib.contextmanager
    def device(self, device_id):
        yield device_id


class _Math:
    """Only what compile_all and the getters touch: gpu, backend, kernel()."""
    gpu = True

    def __init__(self):
        self.backend = _Backend()
        self.calls = []
        self._lock = threading.Lock()

    def kernel(self, template, device_id, **params):
        with self._lock:
            self.calls.append((template, device_id, tuple(sorted(params))))
        return object()


@pytest.mark.parametrize("warm", [matmul.warm_up, attention.warm_up, conv2d.warm_up,
                                  elementwise.precompile],
                         ids=["matmul", "attention", "conv2d", "elementwise"])
def test_warm_up_compiles_every_job(warm):
    m = _Math()
    n = warm(m, workers=4)
    assert n > 0
    assert len(m.calls) == n
    assert all(dev == 0 for _, dev, _ in m.calls)
    assert all(t.endswith(".cu.j2") for t, _, _ in m.calls)
