"""The per-module warm-up helpers (compile every variant in threads) call each module's
kernel getter correctly. A stand-in CudaMath records the calls, so this runs without a GPU."""
from __future__ import annotations

import pytest
from helpers import StandInMath

from cuda_backend.ops import attention, conv2d, elementwise, matmul


@pytest.mark.parametrize("warm", [matmul.warm_up, attention.warm_up, conv2d.warm_up,
                                  elementwise.precompile],
                         ids=["matmul", "attention", "conv2d", "elementwise"])
def test_warm_up_compiles_every_job(warm):
    m = StandInMath()
    n = warm(m, workers=4)
    assert n > 0
    assert len(m.calls) == n
    assert all(dev == 0 for _, dev, _ in m.calls)
    assert all(t.endswith(".cu.j2") for t, _, _ in m.calls)
