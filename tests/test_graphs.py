"""CUDA graphs: capture and replay of our ops (GPU), and the graph-owned memory of the pool
(on the CPU, with fake events)."""
from __future__ import annotations

import numpy as np
import pytest

from cuda_backend import GraphCaptureError
from cuda_backend.memory import HostBinnedPool, MemoryPool, StreamBlock

gpu = pytest.mark.gpu


class NoEvents:
    """Events that must not be recorded while `pool` captures on `stream`."""
    pool = None

    def record(self, stream):
        assert stream not in self.pool._graphs, "an event recorded on a capturing stream"
        return {}

    def query(self, ev):
        return True

    def wait(self, ev):
        pass

    def recycle(self, ev):
        pass


def fake_pool():
    state = {"next": 0x10000}

    def alloc(size):
        ptr = state["next"]
        state["next"] += size + 0x1000
        return bytearray(0), ptr
    events = NoEvents()
    events.pool = MemoryPool(0, HostBinnedPool(alloc), device_total=1 << 30, events=events)
    return events.pool


def test_graph_memory_is_reused_in_capture_and_held_until_release():
    pool = fake_pool()
    S = object()
    before = pool.get_stats()["active_memory"]
    graph = pool.begin_graph(S)
    a = pool.allocate(1000, stream=S)
    assert isinstance(a, StreamBlock) and a.graph is graph
    ptr = int(a)
    a.free()                                   # freed during the capture ...
    b = pool.allocate(1000, stream=S)          # ... and reused by it, in stream order
    assert int(b) == ptr and b.graph is graph
    c = pool.allocate(5000, stream=S)
    pool.end_graph(graph)
    c.free()                                   # freed after: replays still write it
    d = pool.allocate(5000, stream=S)
    assert int(d) != int(c)
    assert pool.get_stats()["active_memory"] - before == 1024 + 2 * 5120
    pool.release_graph(graph)                  # c goes back; b is a live tensor's block
    assert pool.get_stats()["active_memory"] - before == 1024 + 5120
    b.free()                                   # after the release: an ordinary free
    d.free()
    assert pool.get_stats()["active_memory"] == before


# -- on the GPU -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mml(backend):
    from cuda_backend.cuda_math import get_cuda_math
    from cuda_backend.cuda_ml import get_cuda_ml
    return get_cuda_math(), get_cuda_ml()


def mlp(m, ml, x, w1, b1, w2):
    h = ml.fused_linear_gelu(x, w1, b1)
    y = m.matrix_multiply(h, w2)
    h.free()                                   # a temporary freed inside the capture
    p = m.softmax(y)
    s = m.reduce_sum(y, axis=0)
    y.free()
    return p, s


def mlp_inputs(m, rng, batch=32):
    f = lambda *s: m.from_numpy((rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32))
    return f(batch, 1024), f(4096, 1024), f(4096), f(4096, 1024)


@gpu
def test_replay_matches_eager_and_follows_input_updates(backend, mml):
    m, ml = mml
    rng = np.random.default_rng(7)
    x, w1, b1, w2 = mlp_inputs(m, rng)
    eager = [m.to_numpy(t) for t in mlp(m, ml, x, w1, b1, w2)]   # compiles and autotunes
    with backend.capture() as graph:
        outs = mlp(m, ml, x, w1, b1, w2)
    graph.replay()
    graph.synchronize()
    for got, want in zip(outs, eager):
        assert np.array_equal(m.to_numpy(got), want)           # the same kernels, bit for bit
    for _ in range(3):                                         # new inputs, copied in
        new_x = (rng.standard_normal(x.shape) / 32).astype(np.float32)
        backend.copy_to_device(new_x, x)
        graph.replay()
        xe = m.from_numpy(new_x)
        want = [m.to_numpy(t) for t in mlp(m, ml, xe, w1, b1, w2)]
        for got, w in zip(outs, want):
            assert np.array_equal(m.to_numpy(got), w)
    graph.free()


UNCAPTURABLE = ["from_numpy", "to_numpy", "synchronize", "stream.synchronize",
                "first call (autotunes)"]


@gpu
@pytest.mark.parametrize("what", UNCAPTURABLE)
def test_uncapturable_calls_raise_and_leave_the_backend_usable(backend, mml, what, tmp_path):
    from cuda_backend.autotune import Autotuner
    from cuda_backend.cuda_math import CudaMath
    m, ml = mml
    a = m.from_numpy(np.arange(12, dtype=np.float32).reshape(3, 4))
    m.softmax(a)
    fresh = CudaMath(backend)                       # its autotuner has chosen nothing yet
    fresh._autotuner = Autotuner(backend, path=str(tmp_path / "tune.json"))
    big = [fresh.create_tensor(s, "float32") for s in ((256, 384), (384, 320))]
    calls = {
        "from_numpy": lambda s: m.from_numpy(np.ones(4, np.float32)),
        "to_numpy": lambda s: m.to_numpy(a),
        "synchronize": lambda s: backend.synchronize(),
        "stream.synchronize": lambda s: s.synchronize(),
        "first call (autotunes)": lambda s: fresh.matrix_multiply(*big),
    }
    pool = backend.memory_pools[0]
    backend.synchronize()
    used = pool.used_bytes()
    stream = backend.stream()
    with pytest.raises(GraphCaptureError):
        with backend.capture(stream):
            m.softmax(a).free()
            calls[what](stream)
    backend.synchronize()
    assert pool.used_bytes() == used                # the failed capture's memory is back
    with stream:                                    # the stream works again
        r = m.softmax(a)
    stream.synchronize()
    np.testing.assert_allclose(m.to_numpy(r).sum(1), 1.0, rtol=1e-6)


@gpu
def test_freeing_a_graph_returns_its_memory(backend, mml):
    m, ml = mml
    rng = np.random.default_rng(8)
    x, w1, b1, w2 = mlp_inputs(m, rng)
    for t in mlp(m, ml, x, w1, b1, w2):
        t.free()
    pool = backend.memory_pools[0]
    backend.synchronize()
    used = pool.used_bytes()
    with backend.capture() as graph:
        outs = mlp(m, ml, x, w1, b1, w2)
    assert pool.used_bytes() > used              # the graph holds its intermediates
    graph.replay()
    for t in outs:
        t.free()                                 # outputs freed while the graph lives
    graph.free()
    assert pool.used_bytes() == used
