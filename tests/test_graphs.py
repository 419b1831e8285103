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


def test_graph_reuses_the_best_fitting_freed_block():
    """A request with no freed block of its own size takes the smallest freed block at most
    1/4 larger, which goes back under its own size when freed; a smaller request does not."""
    pool = fake_pool()
    S = object()
    graph = pool.begin_graph(S)
    big = pool.allocate(10000, stream=S)             # a 10240-byte block
    ptr = int(big)
    big.free()
    small = pool.allocate(1000, stream=S)            # 1024: far smaller, a block of its own
    assert int(small) != ptr
    fit = pool.allocate(9000, stream=S)              # 9216 <= 10240 <= 9216 * 5 / 4
    assert int(fit) == ptr and fit.size == 10240
    fit.free()
    again = pool.allocate(10000, stream=S)           # back under 10240
    assert int(again) == ptr
    used = pool.get_stats()["active_memory"]
    pool.end_graph(graph)
    assert used == 10240 + 1024
    for t in (small, again):
        t.free()
    pool.release_graph(graph)
    assert pool.get_stats()["active_memory"] == 0


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


# -- optimizer steps in a graph (device step counts, ops/optimizers.py and optim.py) ------------
def opt_operands(m, rng, n, dtype=np.float32):
    """Parameters, gradient, momentum / first-moment and second-moment buffers of n
    elements, and a step count at 0."""
    p = m.from_numpy(rng.standard_normal(n).astype(dtype))
    g = m.from_numpy(rng.standard_normal(n).astype(dtype))
    mb, vb = (m.from_numpy(np.zeros(n, dtype)) for _ in range(2))
    return [p, g, mb, vb, m.from_numpy(np.zeros(1, np.int32))]


@gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: d.__name__)
def test_optimizer_updates_replay_their_device_steps(backend, mml, dtype):
    """advance_steps, an SGD update with Nesterov momentum (its first step read from the
    device) and an AdamW update (bias corrections of the device's step), recorded from step 0
    and replayed 5 times with a new gradient copied in before each: the parameters, buffers
    and counts equal 5 eager steps bit for bit (the same kernels on the same values)."""
    from cuda_backend.cuda_ml import OptimizerState
    from cuda_backend.ops import optimizers as opt
    m, ml = mml
    rng = np.random.default_rng(81)
    n = 1001
    grads = [rng.standard_normal(n).astype(dtype) for _ in range(5)]
    runs = []
    for graph in (False, True):
        r = np.random.default_rng(82)
        sgd = opt_operands(m, r, n, dtype)
        adam = opt_operands(m, r, n, dtype)
        s_sgd = OptimizerState(learning_rate=0.05, momentum=0.9, nesterov=True,
                               step_count=sgd[4])
        s_adam = OptimizerState(learning_rate=1e-2, weight_decay=0.1, decoupled=True,
                                step_count=adam[4])

        def step():
            opt.advance_steps(m, sgd[4])
            opt.advance_steps(m, adam[4])
            ml.sgd_update(sgd[0], sgd[1], sgd[2], s_sgd)
            ml.adam_update(adam[0], adam[1], adam[2], adam[3], s_adam)
        if graph:
            warm = opt_operands(m, r, n, dtype)             # compile outside the capture
            opt.advance_steps(m, warm[4])
            ml.sgd_update(warm[0], warm[1], warm[2],
                          OptimizerState(learning_rate=0.05, step_count=warm[4]))
            ml.adam_update(*warm[:4], OptimizerState(learning_rate=0.05, step_count=warm[4]))
            backend.synchronize()
            with backend.capture() as g:
                step()
        for k in range(5):
            backend.copy_to_device(grads[k], sgd[1])
            backend.copy_to_device(grads[k], adam[1])
            if graph:
                g.replay()
                g.synchronize()
            else:
                step()
        assert s_sgd.step == s_adam.step == 0
        runs.append([m.to_numpy(t) for t in sgd + adam])
        if graph:
            g.free()
    assert runs[1][4].tolist() == runs[1][9].tolist() == [5]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def optim_params(m, rng):
    from cuda_backend import nn
    return [nn.Parameter(m.from_numpy(rng.standard_normal(s).astype(np.float32)))
            for s in ((33, 7), (5,), (4, 1, 3))]


@gpu
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_captured_optimizer_step_replays_equal_eager_steps(backend, mml, kind):
    """optim's step() captured after one eager step (its buffers made), with the second
    parameter never given a gradient (its count and state untouched: two runs of counts),
    replayed 5 times with new gradients copied in: parameters, buffers and step counts equal
    5 more eager steps bit for bit."""
    from cuda_backend import optim
    m, ml = mml
    rng = np.random.default_rng(83)
    grads = [[rng.standard_normal(s).astype(np.float32) for s in ((33, 7), (5,), (4, 1, 3))]
             for _ in range(6)]
    runs = []
    for graph in (False, True):
        params = optim_params(m, np.random.default_rng(84))
        o = optim.SGD(params, 0.05, momentum=0.9, nesterov=True) if kind == "sgd" else \
            (optim.Adam if kind == "adam" else optim.AdamW)(params, 1e-2, weight_decay=0.1)
        for i, p in enumerate(params):
            p.grad = None if i == 1 else m.from_numpy(grads[0][i])
        o.step()
        backend.synchronize()
        if graph:
            with backend.capture() as g:
                o.step()
        for k in range(1, 6):
            for i, p in enumerate(params):
                if i != 1:
                    backend.copy_to_device(grads[k][i], p.grad)
            if graph:
                g.replay()
                g.synchronize()
            else:
                o.step()
        assert [o.steps(p) for p in params] == [6, 0, 6]
        runs.append(([m.to_numpy(p.data) for p in params], o.state_dict()))
        if graph:
            g.free()
    for a, b in zip(runs[0][0], runs[1][0]):
        np.testing.assert_array_equal(a, b)
    assert set(runs[0][1]) == set(runs[1][1])
    for k in runs[0][1]:
        np.testing.assert_array_equal(runs[0][1][k], runs[1][1][k], err_msg=k)


@gpu
def test_a_first_optimizer_step_cannot_be_captured(backend, mml):
    """step() before any eager step would record the making of its buffers: it raises
    GraphCaptureError, the capture's memory goes back, and an eager step works after."""
    from cuda_backend import optim
    m, ml = mml
    params = optim_params(m, np.random.default_rng(85))
    for p in params:
        p.grad = m.from_numpy(np.ones(p.shape, np.float32))
    o = optim.Adam(params, 1e-2)
    pool = backend.memory_pools[0]
    backend.synchronize()
    used = pool.used_bytes()
    with pytest.raises(GraphCaptureError, match="take one eager step"):
        with backend.capture():
            o.step()
    backend.synchronize()
    assert pool.used_bytes() == used and not o.state
    before = [m.to_numpy(p.data) for p in params]
    o.step()
    assert [o.steps(p) for p in params] == [1, 1, 1]
    for p, b in zip(params, before):
        # Adam's first step: -lr g / (|g| + eps) = -lr (1 - 1e-8), rounded once into p
        # and once in the host's difference: within 1 ulp of max |p| each
        atol = 2 * float(np.spacing(np.abs(b).max() + 1e-2)) + 1e-9
        np.testing.assert_allclose(m.to_numpy(p.data) - b, -1e-2, rtol=0, atol=atol)


@gpu
def test_captured_step_refuses_a_changed_learning_rate(backend, mml):
    """A CapturedStep replays the learning rate it recorded: after optimizer.lr changes the
    next call raises GraphCaptureError; free() and the next call captures the new one."""
    from cuda_backend import optim
    from cuda_backend.autograd import Tensor
    m, ml = mml
    params = optim_params(m, np.random.default_rng(86))
    o = optim.Adam(params, 1e-2)

    def fb():
        loss = sum(((p * p).sum() for p in params[1:]), (params[0] * params[0]).sum())
        loss.backward()
        return loss
    step = optim.CapturedStep(fb, o, warmup=1)
    step()
    step()                                  # captured and replayed
    assert step.graph is not None and isinstance(step.loss, Tensor)
    o.lr = 5e-3
    with pytest.raises(GraphCaptureError, match="learning rate changed from 0.01 to 0.005"):
        step()
    step.free()
    step()                                  # captures anew, with lr 5e-3
    step.graph.synchronize()
    assert step.lr == 5e-3 and [o.steps(p) for p in params] == [3, 3, 3]
    step.free()
