"""The autograd tape (cuda_backend/autograd.py): gradients of composed ops against float64
central finite differences, broadcasting, accumulation, the tape's memory, no_grad, errors.

Finite differences: for a float64 f the central difference (f(x+h) - f(x-h)) / 2h differs
from f'(x) by at most h^2 max|f'''| / 6 (truncation) plus eps_f / h, where eps_f <= c u64 F
is the rounding of one evaluation of f (u64 = 2^-53, F the sum of the magnitudes of the terms
f adds, c the depth of its sums). Here inputs and weights are of magnitude ~1 and f adds at
most a few hundred terms, so |f'''| <= 1e2 and c F <= 1e4: with h = 1e-5 the truncation is
<= 1.7e-9 and the rounding <= 1e4 * 1.1e-16 / 1e-5 = 1.1e-7. FD_TOL = 1e-6 (absolute, and
relative to the gradient) holds that with margin, while a wrong gradient (a missing term, a
transposed operand, a wrong broadcast sum) is off by O(1). The tape's own float64 gradient
rounds near u64.

Tests that need a backward op another module provides skip while it does not exist yet
(reason "backward op not available yet"); ops exercised here are CudaMath's and CudaML's
(NumPy in fallback mode, kernels on a GPU).
"""
from __future__ import annotations

import gc

import numpy as np
import pytest
from helpers import fd_grad

from cuda_backend import autograd as ag
from cuda_backend.autograd import Tensor, no_grad, tensor
from cuda_backend.errors import InvalidArgumentError, ShapeMismatchError

H = 1e-5
FD_TOL = 1e-6


@pytest.fixture(scope="module")
def m(backend):
    return ag.apis()[0]


@pytest.fixture(scope="module")
def ml(backend):
    return ag.apis()[1]


def needs(ml, *names):
    missing = [n for n in names if not hasattr(ml, n)]
    if missing:
        pytest.skip(f"backward op not available yet: {', '.join(missing)}")


def leaf(values):
    return tensor(np.asarray(values, np.float64), requires_grad=True)


def check_grads(build, arrays):
    """build(*Tensors) -> a scalar Tensor; our gradients against finite differences of the
    same float64 ops run without recording."""
    leaves = [leaf(a) for a in arrays]
    loss = build(*leaves)
    loss.backward()

    def f(*values):
        with no_grad():
            return build(*[tensor(v) for v in values]).item()
    host = [np.array(a, np.float64) for a in arrays]
    for i, t in enumerate(leaves):
        ref = fd_grad(f, host, i, H)
        got = np.zeros_like(ref) if t.grad is None else ag.apis()[0].to_numpy(t.grad)
        np.testing.assert_allclose(got, ref, rtol=FD_TOL, atol=FD_TOL, err_msg=f"input {i}")


def rand(rng, *shape):
    return rng.standard_normal(shape)


# -- gradients against finite differences ---------------------------------------------------
def test_elementwise_broadcasting_gradients(m):
    rng = np.random.default_rng(1)
    R = rand(rng, 3, 5, 7)
    r = tensor(R)

    def build(a, b, c):
        # a (3,5,7), b (5,1) broadcast on two axes, c (7,) on two leading axes
        y = (a * b + c) / (2.0 + c * c) - b
        return (y.tanh() * r).sum() + (1.0 - a).exp().mean() + (a * a + 1.0).log().sum()
    check_grads(build, [rand(rng, 3, 5, 7), rand(rng, 5, 1), rand(rng, 7)])


def test_reductions_and_shapes_gradients(m):
    rng = np.random.default_rng(2)
    R = tensor(rand(rng, 4, 3))

    def build(a):
        s = a.reshape(2, 3, 4).permute(2, 0, 1)             # (4, 2, 3)
        t = s.sum(axis=1) * R + s.mean(axis=(0, 2), keepdims=True).sum()
        return (t.sigmoid() * t).sum() + -(a.sum(axis=0).softmax() * R.sum(axis=1)).sum()
    check_grads(build, [rand(rng, 6, 4)])


def test_log_softmax_and_cross_entropy_gradients(m, ml):
    rng = np.random.default_rng(3)
    labels = m.from_numpy(np.array([0, 4, 2, -100, 1], np.int64))
    R = tensor(rand(rng, 5, 6))

    def build(x):
        ce = ag.CrossEntropy.apply(x, labels, "mean", -100, True)
        return ce + (x.log_softmax() * R).sum() * 0.1
    check_grads(build, [rand(rng, 5, 6) * 3])


def test_relu_gelu_gradients(m):
    rng = np.random.default_rng(4)
    x = rand(rng, 9, 5)
    x[np.abs(x) < 1e-3] = 0.5            # no value within h of relu's kink
    R = tensor(rand(rng, 9, 5))

    def build(a):
        return ((a.relu() + a.gelu("tanh") + a.gelu("none")) * R).sum()
    check_grads(build, [x])


def test_matmul_and_linear_gradients(m, ml):
    needs(ml, "linear", "linear_backward", "matmul_backward")
    rng = np.random.default_rng(5)
    R = tensor(rand(rng, 2, 3, 4))

    def build(x, w, b, a2):
        y = ag.linear(x, w, b)                     # x (2, 3, 5) -> (2, 3, 4)
        z = ag.matmul(y.reshape(6, 4), a2)         # (6, 4) @ (4, 4)
        return (z.reshape(2, 3, 4) * R).sum()
    check_grads(build, [rand(rng, 2, 3, 5), rand(rng, 4, 5), rand(rng, 4), rand(rng, 4, 4)])


def test_fused_linear_gelu_gradients(m, ml):
    needs(ml, "fused_linear_gelu_backward")
    rng = np.random.default_rng(6)
    R = tensor(rand(rng, 7, 3))

    def build(x, w, b):
        return (ag.linear(x, w, b, gelu=True) * R).sum()
    check_grads(build, [rand(rng, 7, 5), rand(rng, 3, 5), rand(rng, 3)])


def test_unbind_uses_zeros_for_unused_outputs(m):
    rng = np.random.default_rng(7)

    def build(a):
        p, q, _ = ag.unbind(a)
        return (p * q).sum() + p.sum()
    check_grads(build, [rand(rng, 3, 2, 5)])


# -- the tape -----------------------------------------------------------------------------------
def test_a_tensor_used_twice_gets_both_contributions(m):
    a = leaf([1.0, 2.0, 3.0])
    y = (a * a + a * 3.0).sum()                         # dy/da = 2a + 3
    y.backward()
    np.testing.assert_array_equal(m.to_numpy(a.grad), [5.0, 7.0, 9.0])


def test_shared_gradient_is_never_written_after_it_was_handed_out(m):
    """add gives one gradient object to both inputs; later contributions to one of them must
    not change the other's."""
    a, b = leaf([1.0, 1.0]), leaf([2.0, 2.0])
    y = (a + b) + a * 4.0
    y.sum().backward()
    np.testing.assert_array_equal(m.to_numpy(a.grad), [5.0, 5.0])
    np.testing.assert_array_equal(m.to_numpy(b.grad), [1.0, 1.0])


def test_gradients_accumulate_across_backward_calls(m):
    a = leaf([1.0, -2.0])
    for _ in range(3):
        (a * a).sum().backward()
    np.testing.assert_array_equal(m.to_numpy(a.grad), [6.0, -12.0])


def test_no_grad_records_nothing(m):
    a = leaf([1.0, 2.0])
    with no_grad():
        y = (a * 2.0).exp().sum()
    assert not y.requires_grad and y.is_leaf
    with pytest.raises(InvalidArgumentError, match="does not require grad"):
        y.backward()
    assert ag.is_grad_enabled()


def test_no_grad_is_restored_after_an_exception(m):
    with pytest.raises(ShapeMismatchError):
        with no_grad():
            leaf([1.0, 2.0]) + leaf([1.0, 2.0, 3.0])
    assert ag.is_grad_enabled()


def test_backward_twice_through_a_released_graph_raises(m):
    a = leaf([1.0, 2.0])
    h = a * a
    loss = h.sum()
    loss.backward()
    assert loss.is_leaf
    with pytest.raises(InvalidArgumentError, match="already released"):
        h.sum().backward()


def test_bad_backward_arguments_raise(m):
    a = leaf([1.0, 2.0])
    with pytest.raises(InvalidArgumentError, match="one-element"):
        (a * 2.0).backward()
    with pytest.raises(ShapeMismatchError):
        (a * 2.0).backward(m.from_numpy(np.ones(3)))
    with pytest.raises(InvalidArgumentError, match="CudaTensor"):
        Tensor(np.ones(3))
    with pytest.raises(InvalidArgumentError, match="operands"):
        a + "x"


def pool_bytes(backend):
    gc.collect()
    return backend.memory_pools[0].get_stats()["active_memory"]


def test_tape_memory_back_to_baseline_after_backward(m, backend):
    """After backward() only the loss and the leaves' gradients remain of the step: every
    activation, saved tensor and intermediate gradient went back to the pool."""
    rng = np.random.default_rng(8)
    w1, w2 = leaf(rand(rng, 1, 512)), leaf(rand(rng, 512))
    x = tensor(rand(rng, 256, 512))

    def step():
        h = (x * w1 * 0.1).tanh()
        return ((h + w2).sigmoid() * h.sum(axis=1, keepdims=True)).log_softmax().mean()
    loss = step()                  # first: the kernels' and plans' own persistent buffers
    loss.backward()
    w1.grad = w2.grad = None
    del loss
    base = pool_bytes(backend)
    loss = step()
    assert pool_bytes(backend) > base + 256 * 512 * 8       # the activations are alive
    loss.backward()
    after = pool_bytes(backend)
    copies = [m.copy(w1.grad), m.copy(w2.grad), m.copy(loss.data)]
    expected = pool_bytes(backend) - after                  # what those three occupy
    del copies
    assert after - base == expected
    w1.grad = w2.grad = None
    del loss
    assert pool_bytes(backend) == base


def test_intermediates_no_backward_needs_are_freed_during_the_forward(m, backend):
    """The tape keeps what the backward needs, not every result: of ((x + w) + w) + w (sums
    save no tensor) only the final result stays allocated, and the gradient is still 3."""
    rng = np.random.default_rng(10)
    w = leaf(rand(rng, 256, 512))
    x = tensor(rand(rng, 256, 512))

    def forward():
        return ((x + w) + w) + w
    forward()                      # the plans' own buffers first
    base = pool_bytes(backend)
    out = forward()
    held = pool_bytes(backend) - base
    one = m.copy(out.data)
    single = pool_bytes(backend) - base - held              # what one such result occupies
    del one
    assert held == single
    out.backward(m.ones(out.shape, out.dtype))
    np.testing.assert_array_equal(m.to_numpy(w.grad), np.full((256, 512), 3.0))


def test_a_step_after_an_exception_mid_forward_works(m, backend):
    rng = np.random.default_rng(9)
    W = rand(rng, 5, 5)
    w = leaf(W)
    x = tensor(rand(rng, 3, 5))
    bad = tensor(rand(rng, 4))
    base = pool_bytes(backend)
    with pytest.raises(ShapeMismatchError):
        h = (x * 2.0 + w.sum(axis=0)).tanh()
        (h + bad).sum()                                     # fails in the middle of the forward
    del h
    assert pool_bytes(backend) == base                      # nothing of the failed step left
    (x * w.sum(axis=0)).tanh().sum().backward()
    ref = leaf(W)
    (x * ref.sum(axis=0)).tanh().sum().backward()
    np.testing.assert_array_equal(m.to_numpy(w.grad), m.to_numpy(ref.grad))


def test_a_step_after_an_exception_mid_backward_works(m, backend):
    """A backward that raises still releases its tape."""
    a = leaf([1.0, 2.0, 3.0])

    class Broken(ag.Function):
        def forward(self, x):
            self.save(x)
            return ag.apis()[0].copy(x)

        def backward(self, g):
            raise ShapeMismatchError("broken on purpose")
    base = pool_bytes(backend)
    y = Broken.apply((a * 2.0).exp()).sum()
    with pytest.raises(ShapeMismatchError, match="on purpose"):
        y.backward()
    del y
    assert pool_bytes(backend) == base and a.grad is None
    (a * a).sum().backward()
    np.testing.assert_array_equal(m.to_numpy(a.grad), [2.0, 4.0, 6.0])


def test_autocast_casts_and_promotes(m):
    with ag.autocast("bfloat16"):
        assert ag.compute_dtype().name_str == "bfloat16"
    assert ag.compute_dtype() is None
    a = tensor(np.ones(4, np.float32), requires_grad=True)
    b = ag.astype(tensor(np.full(4, 2.0, np.float32), requires_grad=True), "bfloat16")
    y = a + b                                               # float32 + bfloat16 -> float32
    assert y.dtype.name_str == "float32"
    y.sum().backward()
    assert a.grad.dtype.name_str == "float32"
    with pytest.raises(InvalidArgumentError):
        ag.autocast("int32")
