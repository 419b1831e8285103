"""Stream order of the memory pool, split reductions and the CUDA array interface; frees from
finalizers. The pool logic runs on the CPU with fake streams and events; the GPU tests run the
same operations on real streams against NumPy."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cuda_backend import CudaOutOfMemoryError
from cuda_backend.memory import HostBinnedPool, MemoryPool, StreamBlock
from cuda_backend.driver import load_driver

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = load_driver()[0] is not None


class FakeEvents:
    """Events whose completion the test decides: record() returns a new event, not done."""

    def __init__(self) -> None:
        self.recorded = []    # (stream, event)
        self.waited = 0

    def record(self, stream):
        ev = {"stream": stream, "done": False}
        self.recorded.append((stream, ev))
        return ev

    def query(self, ev):
        return ev["done"]

    def wait(self, ev):
        self.waited += 1
        ev["done"] = True

    def recycle(self, ev):
        pass

    def finish(self, stream=None):
        """Every event recorded so far (on one stream, or on all) completes."""
        for s, ev in self.recorded:
            if stream is None or s is stream:
                ev["done"] = True


class Fake:
    """A tensor-like holder of a pool block, as CudaTensor is for record_use()."""

    def __init__(self, block, nbytes):
        self._block, self.nbytes = block, nbytes


def fake_allocator():
    state = {"next": 0x10000, "fail": 0}

    def alloc(size):
        if state["fail"]:
            state["fail"] -= 1
            raise MemoryError("fake: out of memory")
        ptr = state["next"]
        state["next"] += size + 0x1000
        return bytearray(0), ptr
    return alloc, state


def make_pool():
    alloc, state = fake_allocator()
    ev = FakeEvents()
    return MemoryPool(0, HostBinnedPool(alloc), device_total=1 << 30, events=ev), ev, state


S1, S2 = object(), object()   # two streams


def test_free_is_reusable_at_once_on_its_stream_only():
    pool, ev, _ = make_pool()
    a = pool.allocate(1000, stream=S1)
    assert isinstance(a, StreamBlock) and a.stream is S1
    ptr = int(a)
    pool.release(a)
    assert [s for s, _ in ev.recorded] == [S1]      # an event on the freeing stream
    # the same stream takes it back at once (its later work is ordered after the free) ...
    b = pool.allocate(1000, stream=S1)
    assert int(b) == ptr
    pool.release(b)
    # ... another stream and the legacy default stream do not, until the event completes
    c = pool.allocate(1000, stream=S2)
    d = pool.allocate(1000, stream=None)
    assert ptr not in (int(c), int(d))
    ev.finish(S1)
    e = pool.allocate(1000, stream=S2)
    assert int(e) == ptr
    for blk in (c, d, e):
        pool.release(blk)


def test_block_used_on_another_stream_waits_for_both():
    pool, ev, _ = make_pool()
    a = pool.allocate(4096, stream=S1)
    t = Fake(a, 4096)
    pool.record_use(t, S2)             # a launch on S2 read it
    ptr = int(a)
    pool.release(t._block)
    assert {id(s) for s, _ in ev.recorded} == {id(S1), id(S2)}
    # not even S1 may take it back: S2's reads are not ordered before S1's next writes
    held = [pool.allocate(4096, stream=stream) for stream in (S1, S2, None)]
    assert ptr not in [int(blk) for blk in held]
    ev.finish(S1)
    held.append(pool.allocate(4096, stream=None))
    assert int(held[-1]) != ptr
    ev.finish(S2)
    assert int(pool.allocate(4096, stream=S2)) == ptr


def test_legacy_block_used_on_a_stream_is_wrapped():
    pool, ev, _ = make_pool()
    a = pool.allocate(512, stream=None)
    assert not isinstance(a, StreamBlock)   # default stream only: freed at once
    t = Fake(a, 512)
    pool.record_use(t, None)
    assert t._block is a
    pool.record_use(t, S1)
    assert isinstance(t._block, StreamBlock) and t._block.uses == {S1}
    ptr = int(a)
    pool.release(t._block)
    held = pool.allocate(512, stream=None)
    assert int(held) != ptr
    ev.finish()
    assert int(pool.allocate(512, stream=None)) == ptr


def test_stats_count_waiting_blocks_as_cached():
    pool, ev, _ = make_pool()
    blocks = [pool.allocate(1000, stream=S1) for _ in range(3)]
    assert pool.get_stats()["active_memory"] == 3 * 1024
    for b in blocks:
        pool.release(b)
    s = pool.get_stats()
    assert s["active_memory"] == 0 and s["active_blocks"] == 0
    assert s["cached_bytes"] == 3 * 1024 and s["n_free_blocks"] == 3
    assert pool.used_bytes() == 0 and pool.free_bytes() == 3 * 1024
    # a hit on the stream's own free list counts as a hit
    hits = s["hits"]
    pool.release(pool.allocate(1000, stream=S1))
    assert pool.get_stats()["hits"] == hits + 1
    pool.free_all_blocks()               # waits for the events, then frees everything
    s = pool.get_stats()
    assert ev.waited >= 3 and s["cached_bytes"] == 0 and s["n_free_blocks"] == 0
    assert pool.total_bytes() == 0


def test_garbage_collected_stream_block_is_stream_ordered():
    pool, ev, _ = make_pool()
    a = pool.allocate(2048, stream=S1)
    ptr = int(a)
    del a                                 # no free(): the finalizer queues it the same way
    assert [s for s, _ in ev.recorded] == [S1]
    other = pool.allocate(2048, stream=S2)
    assert int(other) != ptr
    assert int(pool.allocate(2048, stream=S1)) == ptr


def test_out_of_memory_waits_for_stream_frees():
    pool, ev, state = make_pool()
    a = pool.allocate(1 << 20, stream=S1)
    pool.release(a)
    state["fail"] = 1                     # the next underlying allocation fails once
    b = pool.allocate(1 << 16, stream=S2)  # the ladder waits for S1's free, frees, retries
    assert ev.waited >= 1 and pool.get_stats()["oom_retries"] == 1
    pool.release(b)
    state["fail"] = 2
    with pytest.raises(CudaOutOfMemoryError):
        pool.allocate(1 << 22, stream=S2)
    assert pool.allocate(100, stream=S2) is not None   # usable after the error


# -- frees from finalizers ------------------------------------------------------------------
DEADLOCK = r'''
import gc
import numpy as np
from cuda_backend.memory import HostBinnedPool, MemoryPool

state = {"fail": 0, "calls": 0}

def allocator(size):
    """A host allocator during which the garbage collector runs, as it may during any
    allocation made while the pool's lock is held; it can also fail (out of memory)."""
    state["calls"] += 1
    make_garbage()
    gc.collect()
    if state["fail"]:
        state["fail"] -= 1
        raise MemoryError("fake: out of memory")
    buf = np.empty(size, np.uint8)
    return buf, int(buf.ctypes.data)

pool = MemoryPool(0, HostBinnedPool(allocator), device_total=1 << 30)

class Holder:
    """In a reference cycle; its finalizer frees a pool block."""
    def __init__(self, block):
        self.block, self.me = block, self
    def __del__(self):
        pool.release(self.block)

spare = []

def make_garbage():
    if spare:
        Holder(spare.pop())

spare.extend(pool.allocate(256) for _ in range(400))   # blocks for the Holders to free
state["calls"] = 0

for i in range(200):
    pool.release(pool.allocate(256 * (1 + i % 7)))
    if {oom}:
        pool.free_all_blocks()
        state["fail"] = 1                      # the ladder collects garbage, then retries
        pool.release(pool.allocate(1 << 20))
print("ok", pool.get_stats()["oom_retries"])
'''


@pytest.mark.parametrize("oom", [False, True], ids=["allocation", "oom-ladder"])
def test_finalizer_that_frees_a_block_does_not_deadlock(oom):
    """A finalizer runs while this thread holds the pool's lock (the garbage collector runs
    inside the allocation, or the out-of-memory ladder collects) and frees a block of the
    same pool: with a lock taken by release() the process hung."""
    code = DEADLOCK.replace("{oom}", str(oom))
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, cwd=REPO)
    except subprocess.TimeoutExpired:
        pytest.fail("the process hung: a finalizer's free waited for the pool's lock")
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout.split()
    assert out[0] == "ok" and int(out[1]) == (200 if oom else 0)


# -- on the GPU -----------------------------------------------------------------------------
gpu = pytest.mark.gpu


@gpu
def test_split_reductions_on_two_streams(backend):
    """Split reductions of 2^27 elements issued back to back on two streams run at the same
    time: each needs its own ticket counters and partials (one shared set gave a wrong or
    unwritten sum in 198 of 200 pairs). The kernels are deterministic, so every concurrent
    result equals the one computed alone on the default stream."""
    from cuda_backend.cuda_math import get_cuda_math
    m = get_cuda_math()
    rng = np.random.default_rng(13)
    n = 1 << 27
    xs = [m.from_numpy(rng.standard_normal(n, dtype=np.float32)) for _ in range(2)]
    ys = [m.from_numpy(rng.standard_normal((1 << 16, 512), dtype=np.float32))
          for _ in range(2)]                                  # axis-0 sums split too
    alone = [(float(m.to_numpy(m.reduce_sum(x))), m.to_numpy(m.reduce_sum(y, axis=0)))
             for x, y in zip(xs, ys)]
    streams = [backend.stream(), backend.stream()]
    wrong = 0
    for _ in range(50):
        outs = []
        for x, s in zip(xs, streams):
            with s:
                outs.append(m.reduce_sum(x))
        for y, s in zip(ys, streams):
            with s:
                outs.append(m.reduce_sum(y, axis=0))
        for s in streams:
            s.synchronize()
        wrong += sum(float(m.to_numpy(o)) != a[0] for o, a in zip(outs[:2], alone))
        wrong += sum(not np.array_equal(m.to_numpy(o), a[1]) for o, a in zip(outs[2:], alone))
    assert wrong == 0, f"{wrong} of 200 concurrent sums differ from the serial ones"


@gpu
def test_freed_tensor_is_not_reused_by_another_stream_early(backend):
    """A tensor written on s1 and freed at once: a new allocation on s2 must not get its
    block while s1's work is queued (s1 is held back behind a long kernel)."""
    from cuda_backend.cuda_math import get_cuda_math
    m = get_cuda_math()
    n = 1 << 24
    big = m.from_numpy(np.ones(n, np.float32))
    s1, s2 = backend.stream(), backend.stream()
    bad = 0
    for trial in range(20):
        with s1:
            for _ in range(8):                      # keep s1 busy for a while
                m.exp(big).free()
            t = m.multiply(big, 2.0)                # written on s1 ...
            r = m.reduce_sum(t)
            t.free()                                # ... freed while s1 still runs
        with s2:
            u = m.fill(m.create_tensor((n,), "float32"), 5.0)   # must not land on t's block
        s1.synchronize()
        s2.synchronize()
        bad += float(m.to_numpy(r)) != 2.0 * n
        u.free()
    assert bad == 0


@gpu
def test_cuda_array_interface_exports_our_stream(backend):
    from cuda_backend.cuda_math import get_cuda_math
    m = get_cuda_math()
    x = m.from_numpy(np.arange(10, dtype=np.float32))
    assert x.__cuda_array_interface__["stream"] == 1        # legacy default stream
    s = backend.stream()
    with s:
        y = m.add(x, 1.0)
    assert y.__cuda_array_interface__["stream"] == s.handle
    s.synchronize()


@gpu
def test_cuda_array_interface_import_waits_for_the_producer(backend):
    """A CuPy array written on a CuPy stream, wrapped while that work is queued: our ops
    must see the written values (the wrap orders our stream after the exporter's)."""
    cp = pytest.importorskip("cupy")
    from cuda_backend.cuda_math import get_cuda_math
    m = get_cuda_math()
    n = 1 << 24
    bad = 0
    for trial in range(10):
        with cp.cuda.Stream(non_blocking=True) as cs:
            a = cp.zeros(n, cp.float32)
            for _ in range(20):
                a = cp.sin(a) * 0 + 1                   # slow-ish chain ending in ones
            assert a.__cuda_array_interface__["stream"] == cs.ptr
            t = m.from_cuda_array(a)
            total = m.reduce_sum(t)
        bad += float(m.to_numpy(total)) != float(n)
        cs.synchronize()
    assert bad == 0


# -- 4 streams x 1,000 random operations ------------------------------------------------------
STRESS_STREAMS = 4
STRESS_OPS = 1_000      # per stream
EPS32 = float(np.finfo(np.float32).eps)


def stress_cases(m, ml, rng):
    """name -> (make inputs (host arrays), run on tensors, float64 reference, (rtol, atol) or
    None). Integer-valued inputs where the op is exact in float32 (sums stay below 2^24, TF32
    keeps integers below 2^11): those compare exactly; the others get the float32 bounds of
    their own test files (test_softmax.py, test_elementwise.py) or the one named with them.
    Shapes are chosen to take the temporaries' paths: split reductions (partials and ticket
    counters), split-K and TF32 matmul (workspace, transposed B), conv2d (transposed filter),
    batch-norm training (workspace)."""
    from cuda_backend.cuda_ml import ConvolutionConfig

    def ints(shape, lo=-1, hi=1):
        return rng.integers(lo, hi + 1, shape).astype(np.float32)

    def normal(shape):
        return rng.standard_normal(shape).astype(np.float32)

    conv = ConvolutionConfig(kernel_size=3, padding=1)

    def softmax_ref(x):
        z = np.exp(x - x.max(axis=-1, keepdims=True))
        return z / z.sum(axis=-1, keepdims=True)

    def layer_norm_ref(x):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)

    def attention_ref(q, k, v):
        s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
        return softmax_ref(s) @ v

    def conv_ref(x, w):
        n, c, h, wd = x.shape
        xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
        out = np.zeros((n, w.shape[0], h, wd))
        for r in range(3):
            for s in range(3):
                out += np.einsum("nchw,kc->nkhw", xp[:, :, r:r + h, s:s + wd], w[:, :, r, s])
        return out

    def pool_ref(x):
        n, c, h, w = x.shape
        return x[:, :, :h // 2 * 2, :w // 2 * 2].reshape(n, c, h // 2, 2, w // 2, 2).max((3, 5))

    def bn_ref(x):
        mu = x.mean((0, 2, 3), keepdims=True)
        return (x - mu) / np.sqrt(x.var((0, 2, 3), keepdims=True) + 1e-5)

    return {
        "add": (lambda: [ints(1 << 22, -100, 100), ints(1 << 22, -100, 100)],
                lambda t: m.add(*t), lambda a: a[0] + a[1], None),
        "sum_split": (lambda: [ints(1 << 24)], lambda t: m.reduce_sum(t[0]),
                      lambda a: a[0].sum(), None),
        "sum_axis0_split": (lambda: [ints((8192, 48))], lambda t: m.reduce_sum(t[0], axis=0),
                            lambda a: a[0].sum(0), None),
        "max_rows": (lambda: [normal((300, 1001))], lambda t: m.reduce_max(t[0], axis=1),
                     lambda a: a[0].max(1), None),
        "matmul_split_k": (lambda: [ints((16, 8192)), ints((8192, 24))],
                           lambda t: m.matrix_multiply(*t), lambda a: a[0] @ a[1], None),
        "matmul_tf32": (lambda: [ints((192, 256), -3, 3), ints((256, 160), -3, 3)],
                        lambda t: m.matrix_multiply(*t, precision="tf32"),
                        lambda a: a[0] @ a[1], None),
        # one grouped launch (ops/matmul_grouped.py): grad_W over 1,000 rows in 8 K splits,
        # its tiles summed by the last split's block (per-stream ticket counters)
        "linear_backward_grouped": (lambda: [ints((1000, 40), -3, 3), ints((1000, 24), -3, 3),
                                             ints((40, 24), -3, 3)],
                                    lambda t: _grad_weight(ml, *t), lambda a: a[0].T @ a[1],
                                    None),
        "transpose": (lambda: [normal((999, 1001))], lambda t: m.matrix_transpose(t[0]),
                      lambda a: a[0].T, None),
        "conv2d": (lambda: [ints((2, 8, 33, 35), -2, 2), ints((16, 8, 3, 3), -2, 2)],
                   lambda t: ml.conv2d(t[0], t[1], conv), lambda a: conv_ref(*a), None),
        "max_pool2d": (lambda: [normal((2, 8, 57, 55))], lambda t: ml.max_pool2d(t[0], 2),
                       lambda a: pool_ref(a[0]), None),
        "softmax": (lambda: [normal((257, 1000))], lambda t: m.softmax(t[0]),
                    lambda a: softmax_ref(a[0]), (1e-5, 1e-7)),
        "gelu": (lambda: [normal(100_003)], lambda t: ml.gelu(t[0]),
                 lambda a: 0.5 * a[0] * (1 + np.tanh(0.7978845608028654 * (
                     a[0] + 0.044715 * a[0] ** 3))), (1e-5, 1e-30)),
        # normalizations and attention: O(1) outputs from sums of n O(1) terms (n = 1,000
        # per row, 2,668 per channel, 200 keys) and one division: n eps absolute
        "layer_norm": (lambda: [normal((129, 1000))],
                       lambda t: ml.layer_norm(t[0], None, None), lambda a: layer_norm_ref(a[0]),
                       (0, 1000 * EPS32)),
        "batch_norm_train": (lambda: [normal((4, 6, 23, 29))],
                             lambda t: _bn_train(m, ml, t[0]), lambda a: bn_ref(a[0]),
                             (0, 4 * 23 * 29 * EPS32)),
        "flash_attention": (lambda: [normal((1, 2, 200, 64)) for _ in range(3)],
                            lambda t: ml.flash_attention(*t), lambda a: attention_ref(*a),
                            (0, 200 * EPS32)),
    }


def _grad_weight(ml, g, x, w):
    gx, gw, gb = ml.linear_backward(g, x, w)
    gx.free()
    gb.free()
    return gw


def _bn_train(m, ml, x):
    c = x.shape[1]
    g, b = m.from_numpy(np.ones(c, np.float32)), m.from_numpy(np.zeros(c, np.float32))
    rm, rv = m.from_numpy(np.zeros(c, np.float32)), m.from_numpy(np.ones(c, np.float32))
    out = ml.batch_norm(x, g, b, rm, rv, training=True)
    for t in (g, b, rm, rv):
        t.free()
    return out


@gpu
def test_four_streams_random_ops_match_numpy(backend):
    """4 streams x 1,000 random operations of every family, issued from one thread in a
    random interleaving while the GPU runs behind: every result equals the same operation's
    result on the default stream (the kernels are deterministic), which matches NumPy (exactly
    on integer inputs, else within the bound given per case). Inputs are freed and reallocated
    as the run goes, so that blocks move between streams."""
    from cuda_backend.cuda_math import get_cuda_math
    from cuda_backend.cuda_ml import CudaML
    m = get_cuda_math()
    ml = CudaML(m)
    rng = np.random.default_rng(20261124)
    cases = stress_cases(m, ml, rng)
    names = sorted(cases)
    streams = [backend.stream() for _ in range(STRESS_STREAMS)]
    # per stream and case: host inputs, device inputs, the default-stream result (checked)
    state = []
    for s in streams:
        per = {}
        for name in names:
            make, run, ref, bound = cases[name]
            host = make()
            dev_in = [m.from_numpy(h) for h in host]
            serial = m.to_numpy(run(dev_in))       # default stream; autotunes and compiles
            expect = ref([h.astype(np.float64) for h in host])
            if bound is None:
                assert np.array_equal(serial, expect), name
            else:
                excess = np.abs(serial - expect) - (bound[0] * np.abs(expect) + bound[1])
                assert excess.max() <= 0, (name, float(excess.max()), bound)
            per[name] = [host, dev_in, serial]
        state.append(per)
    wrong, pending = [], []

    def check():
        for s in streams:
            s.synchronize()
        for i, name, out in pending:
            got = m.to_numpy(out)
            if not np.array_equal(got, state[i][name][2]):
                wrong.append((i, name))
            out.free()
        pending.clear()

    order = rng.permutation(np.repeat(np.arange(STRESS_STREAMS), STRESS_OPS))
    for k, i in enumerate(order):
        name = names[int(rng.integers(len(names)))]
        host, dev_in, _ = state[i][name]
        with streams[i]:
            if rng.random() < 0.1:      # reallocate an input on this stream: blocks move
                j = int(rng.integers(len(dev_in)))
                fresh = m.create_tensor(host[j].shape, "float32")
                backend.copy_device_to_device(fresh, dev_in[j], stream=streams[i])
                dev_in[j].free()
                dev_in[j] = fresh
            out = cases[name][1](dev_in)
            if rng.random() < 0.5:      # half the results are read on the same stream
                pending.append((i, name, m.copy(out)))
                out.free()
            else:
                pending.append((i, name, out))
        if len(pending) >= 400:
            check()
    check()
    assert wrong == [], f"{len(wrong)} wrong results, first: {wrong[:5]}"
