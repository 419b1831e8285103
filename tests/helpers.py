"""Helpers shared by several test files: watching a per-call plan (ops/common.py
remember_plan) take a call, a view one element past an aligned pointer, and a stand-in
CudaMath for the warm-up helpers. conftest.py has pytest rewrite this module's asserts."""
from __future__ import annotations

import contextlib
import math
import threading
from types import SimpleNamespace

from cuda_backend.tensor import CudaTensor


def call_through_plan(m, key, call):
    """call() with m.plans[key] (the per-call plan an earlier call made, ops/common.py
    remember_plan) wrapped to record what it returns: it must have run and taken the call."""
    plan = m.plans[key]
    seen = []
    m.plans[key] = lambda *args: seen.append(plan(*args)) or seen[-1]
    try:
        res = call()
    finally:
        m.plans[key] = plan
    assert len(seen) == 1 and seen[0] is not None and seen[0] is not False, key
    return res


def spy_plan(m, key):
    """Replace the one-operand plan under key by one that notes whether it gave the result;
    returns that list of notes."""
    plan, taken = m.plans[key], []

    def spy(x):
        res = plan(x)
        taken.append(res is not None)
        return res
    m.plans[key] = spy
    return taken


def view_past_aligned(m, make, shape, dtype, rng):
    """A view of `shape` one element past an aligned pointer (a narrower access width):
    (the view, the tensor it views, which the caller frees, the view's host values).
    make(m, shape, dtype, rng) -> (tensor, host values) is the test file's own."""
    base, host = make(m, (math.prod(shape) + 1,), dtype, rng)
    x = CudaTensor(shape, dtype, base.device_id, base.ptr + dtype.itemsize, owner=base)
    return x, base, host[1:].reshape(shape)


# -- a stand-in CudaMath for the warm-up helpers (records the kernels asked for) -------------
class StandInBackend:
    current_device = 0

    @contextlib.contextmanager
    def device(self, device_id):
        yield device_id


class StandInMath:
    """Only what compile_all, warm_up and the kernel getters touch: gpu, backend, kernel();
    `calls` holds (template, device_id, sorted parameter names) per kernel asked for."""

    def __init__(self, gpu=True):
        self.gpu = gpu
        self.backend = StandInBackend()
        self.calls = []
        self._lock = threading.Lock()

    def kernel(self, template, device_id, **params):
        with self._lock:
            self.calls.append((template, device_id, tuple(sorted(params))))
        return SimpleNamespace(name="k")
