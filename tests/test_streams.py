"""Streams, events and the `with stream:` default on one GPU."""
from __future__ import annotations

import numpy as np
import pytest

from cuda_backend import CudaDataType as DT

pytestmark = pytest.mark.gpu


def test_stream_default_for_ops_and_events(backend):
    from cuda_backend.cuda_math import get_cuda_math
    m = get_cuda_math()
    rng = np.random.default_rng(9596)
    a_h = rng.standard_normal(1 << 20).astype(np.float32)
    s1, s2 = backend.stream(), backend.stream()
    a = m.from_numpy(a_h)
    with s1:
        b = m.multiply(a, 3.0)   # issued on s1
        done = s1.record_event()
    s2.wait_event(done)
    with s2:
        c = m.add(b, 1.0)        # waits for s1's work through the event
    s2.synchronize()
    # the kernels round a * 3 to float32 before adding 1: the same two float32 steps here
    np.testing.assert_array_equal(m.to_numpy(c), (a_h * np.float32(3.0)) + np.float32(1.0))
    start, end = backend.event(), backend.event()
    start.record(s1)
    with s1:
        m.exp(a)
    end.record(s1)
    end.synchronize()
    assert start.elapsed_ms(end) > 0


def test_async_pipeline_matches_serial(backend):
    from cuda_backend.cuda_math import get_cuda_math
    m = get_cuda_math()
    n, chunks = 1 << 18, 4
    host_in = backend.pinned_empty((chunks * n,), np.float32)
    host_in[:] = np.random.default_rng(5638).standard_normal(host_in.shape)
    host_out = backend.pinned_empty((chunks * n,), np.float32)
    streams = [backend.stream() for _ in range(2)]
    bufs = [backend.empty((n,), DT.FLOAT32) for _ in range(2)]
    outs = []
    for i in range(chunks):
        s = streams[i % 2]
        with s:
            backend.copy_to_device_async(host_in[i * n:(i + 1) * n], bufs[i % 2], s)
            y = m.multiply(bufs[i % 2], 2.0)
            backend.copy_from_device_async(y, host_out[i * n:(i + 1) * n], s)
            outs.append(y)
    for s in streams:
        s.synchronize()
    np.testing.assert_array_equal(host_out, host_in * 2)
