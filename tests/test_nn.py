"""Layers, optimizers and the training examples (cuda_backend/nn.py, optim.py, examples/).

Bounds:
- Finite differences of float64 models (FD_TOL): the derivation in tests/test_autograd.py.
  The models here are tiny (a few dozen weights of magnitude ~1), so it applies unchanged.
- float32 blocks (convolution, attention: no float64 kernels) against central differences of
  a float64 NumPy forward: first-order rounding analysis. A float32 sum of n products errs by
  at most gamma_n * sum|terms|, gamma_n = n u / (1 - n u), u = 2^-24; each backward formula's
  sum|terms| is the same formula on magnitudes (|g|, |w|, ...), computed in float64 below
  (`conv_bound`, `attention_bound`), with the forward's own rounding carried into it.
  Central differences of the float64 forward add h^2 |f'''| / 6 + u64 F / h < 1e-9 there.
- Against PyTorch (when importable): our float32 gradient against PyTorch's float64 one may
  differ by 4x PyTorch's own float32 error (the same sums in another order: the same bound,
  reached differently) plus 4 u |ref|, which covers the places where that error is zero.
Tests that need a backward op another module provides skip while it does not exist yet.
"""
from __future__ import annotations

import gc
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import fd_grad

from cuda_backend import autograd as ag
from cuda_backend import nn, optim
from cuda_backend.autograd import Tensor, no_grad, tensor
from cuda_backend.dtypes import CudaDataType as DT
from cuda_backend.errors import (CudaBackendError, InvalidArgumentError,
                                 ShapeMismatchError)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H = 1e-5
FD_TOL = 1e-6
U32 = 2.0**-24


@pytest.fixture(scope="module")
def m(backend):
    return ag.apis()[0]


@pytest.fixture(scope="module")
def ml(backend):
    return ag.apis()[1]


def needs(*names):
    missing = [n for n in names if not hasattr(ag.apis()[1], n)]
    if missing:
        pytest.skip(f"backward op not available yet: {', '.join(missing)}")


def gamma(n):
    return n * U32 / (1 - n * U32)


def host(m, t):
    return np.asarray(m.to_numpy(t.data if isinstance(t, Tensor) else t), np.float64)


def to_float64(m, model):
    """The model's parameters and buffers converted to float64 in place."""
    for p in model.parameters():
        p.data = m.astype(p.data, DT.FLOAT64)
    for mod in model.modules():
        for name in mod.buffer_names:
            setattr(mod, name, m.astype(getattr(mod, name), DT.FLOAT64))
    return model


def fd_check_model(m, model, loss_of, inputs=()):
    """Our float64 gradients of every parameter (and of the leaf inputs) against central
    differences of loss_of() with the values set on the device."""
    params = model.parameters() + list(inputs)
    for p in params:
        p.grad = None
    loss_of().backward()
    for i, p in enumerate(params):
        values = host(m, p)
        got = host(m, p.grad)
        ref = np.zeros_like(values)
        for idx in np.ndindex(values.shape):
            old = values[idx]
            for sign in (1, -1):
                values[idx] = old + sign * H
                m.backend.copy_to_device(values, p.data)
                with no_grad():
                    ref[idx] += sign * loss_of().item() / (2 * H)
            values[idx] = old
            m.backend.copy_to_device(values, p.data)
        np.testing.assert_allclose(got, ref, rtol=FD_TOL, atol=FD_TOL, err_msg=f"param {i}")


def labels(m, rng, n, classes):
    return m.from_numpy(rng.integers(0, classes, n).astype(np.int64))


# -- modules -------------------------------------------------------------------------------
def test_parameter_names_follow_pytorch(m):
    class Net(nn.Module):
        def __init__(self):
            self.body = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.LayerNorm(4))
            self.blocks = [nn.BatchNorm2d(2), nn.Linear(4, 2, bias=False)]
    names = [n for n, _ in Net().named_parameters()]
    assert names == ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias",
                     "blocks.0.weight", "blocks.0.bias", "blocks.1.weight"]
    assert [n for n, _ in Net().named_buffers()] == ["blocks.0.running_mean",
                                                      "blocks.0.running_var"]


def test_initialization_follows_pytorch_bounds(m):
    nn.manual_seed(3)
    lin = nn.Linear(50, 20)
    conv = nn.Conv2d(4, 6, 3, groups=2)
    w = host(m, lin.weight)
    assert w.shape == (20, 50) and np.abs(w).max() <= 1 / np.sqrt(50)
    assert host(m, conv.weight).shape == (6, 2, 3, 3)
    assert np.abs(host(m, conv.bias)).max() <= 1 / np.sqrt(18)


def test_state_dict_save_load_round_trip(m, tmp_path):
    nn.manual_seed(1)
    a = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm2d(4), nn.LayerNorm(4))
    m.backend.copy_to_device(np.arange(4, dtype=np.float32), a[1].running_mean)
    nn.manual_seed(2)
    b = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm2d(4), nn.LayerNorm(4))
    path = str(tmp_path / "model.npz")
    a.save(path)
    ptr = b[0].weight.data.ptr
    b.load(path)
    assert b[0].weight.data.ptr == ptr                  # loaded in place
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
    with pytest.raises(InvalidArgumentError, match="missing keys"):
        b.load_state_dict({k: v for k, v in sa.items() if k != "0.bias"})
    with pytest.raises(InvalidArgumentError, match="unexpected keys"):
        b.load_state_dict({**sa, "extra": np.zeros(1)})
    with pytest.raises(ShapeMismatchError, match="0.weight"):
        b.load_state_dict({**sa, "0.weight": np.zeros((4, 6))})
    b.load_state_dict({"0.bias": np.ones(4)}, strict=False)
    np.testing.assert_array_equal(b.state_dict()["0.bias"], np.ones(4))


def test_train_eval_and_dropout(m):
    nn.manual_seed(0)
    model = nn.Sequential(nn.Dropout(0.5), nn.ReLU())
    x = tensor(np.ones((4, 8), np.float32))
    assert all(mod.training for mod in model.modules())
    y = host(m, model(x))
    assert set(np.unique(y)) <= {0.0, 2.0}
    model.eval()
    assert not any(mod.training for mod in model.modules())
    assert model(x) is not None and np.array_equal(host(m, model(x)), np.ones((4, 8)))
    with pytest.raises(InvalidArgumentError):
        nn.Dropout(1.0)
    with pytest.raises(InvalidArgumentError):
        nn.MultiheadSelfAttention(10, 3)


def test_dropout_gradient_uses_the_forward_mask(m):
    needs("dropout_backward")
    x = tensor(np.linspace(-1, 1, 40).reshape(5, 8), requires_grad=True)
    y = ag.Dropout.apply(x, 0.7, 12345)
    (y * 3.0).sum().backward()
    out, g = host(m, y), host(m, x.grad)
    kept = out != 0
    np.testing.assert_allclose(g[kept], 3.0 / 0.7, rtol=1e-15)
    assert np.all(g[~kept] == 0)


# -- float64 models against finite differences -------------------------------------------------
def test_mlp_gradients_fd(m):
    needs("linear", "linear_backward", "fused_linear_gelu_backward")
    rng = np.random.default_rng(10)
    nn.manual_seed(10)
    model = to_float64(m, nn.Sequential(nn.Linear(5, 6, gelu=True), nn.Linear(6, 4),
                                        nn.ReLU(), nn.Linear(4, 3)))
    x = tensor(rng.standard_normal((7, 5)), requires_grad=True)
    y = labels(m, rng, 7, 3)
    fd_check_model(m, model, lambda: nn.cross_entropy(model(x), y), [x])


def test_norm_and_pooling_gradients_fd(m):
    needs("batch_norm_backward", "layer_norm_backward", "max_pool2d_backward",
          "avg_pool2d_backward", "linear_backward")
    rng = np.random.default_rng(11)
    nn.manual_seed(11)
    model = to_float64(m, nn.Sequential(
        nn.BatchNorm2d(3), nn.MaxPool2d(2, stride=1), nn.AvgPool2d(2, padding=1),
        nn.Flatten(), nn.Linear(3 * 3 * 3, 6), nn.LayerNorm(6), nn.Linear(6, 4)))
    x = tensor(rng.standard_normal((2, 3, 5, 6)), requires_grad=True)
    y = labels(m, rng, 2, 4)
    fd_check_model(m, model, lambda: nn.cross_entropy(model(x), y), [x])


def test_embedding_and_eval_batch_norm_gradients_fd(m):
    needs("batch_norm_backward", "layer_norm_backward", "linear_backward")
    rng = np.random.default_rng(12)
    nn.manual_seed(12)
    emb = nn.Embedding(6, 4)
    norm = nn.LayerNorm(4)
    bn = nn.BatchNorm2d(3)
    head = nn.Linear(4, 5)
    model = nn.Sequential(emb, norm, head)
    to_float64(m, model)
    to_float64(m, bn)
    m.backend.copy_to_device(np.array([0.5, -1.0, 2.0]), bn.running_mean)
    m.backend.copy_to_device(np.array([0.5, 2.0, 1.5]), bn.running_var)
    bn.eval()
    ids = m.from_numpy(np.array([[1, 4, 4], [0, 5, 1]], np.int64))    # repeated ids
    z = tensor(rng.standard_normal((2, 3, 2, 2)), requires_grad=True)
    y = m.from_numpy(np.array([0, 3, 2, 4, 1, 1], np.int64))

    def loss():
        h = model[2](model[1](model[0](ids)))                   # (2, 3, 5)
        return nn.cross_entropy(h, y) + (bn(z) * bn(z)).mean()
    fd_check_model(m, nn.Sequential(model, bn), loss, [z])


# -- float32 blocks against float64 references ---------------------------------------------------
def conv_ref(x, w, b, pad):
    """float64 cross-correlation, stride 1."""
    from numpy.lib.stride_tricks import sliding_window_view
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    win = sliding_window_view(xp, w.shape[2:], axis=(2, 3))       # N C P Q R S
    return np.einsum("ncpqrs,kcrs->nkpq", win, w) + b[None, :, None, None]


def avgpool2(z):
    N, K, P, Q = z.shape
    z = z[:, :, :P // 2 * 2, :Q // 2 * 2]
    return z.reshape(N, K, P // 2, 2, Q // 2, 2).mean(axis=(3, 5))


def test_conv_block_gradients_against_float64(m):
    needs("conv2d_backward", "avg_pool2d_backward")
    from cuda_backend.cuda_ml import ConvolutionConfig
    rng = np.random.default_rng(13)
    X, W, B, R = (rng.standard_normal(s).astype(np.float32) for s in
                  ((2, 3, 7, 6), (4, 3, 3, 3), (4,), (2, 4, 3, 3)))
    X64, W64, B64, R64 = (a.astype(np.float64) for a in (X, W, B, R))
    x, w, b = (tensor(a, requires_grad=True) for a in (X, W, B))
    z = ag.Conv2d.apply(x, w, b, ConvolutionConfig(3, padding=1))
    (ag.Pool2d.apply(z.relu(), "avg", 2) * tensor(R)).sum().backward()

    def f(x_, w_, b_):
        return float((avgpool2(np.maximum(conv_ref(x_, w_, b_, 1), 0)) * R64).sum())
    refs = [fd_grad(f, [X64.copy(), W64.copy(), B64.copy()], i, H) for i in range(3)]
    # the bound: z's rounding must not flip a ReLU, then gamma_n * sum|terms| per gradient
    z64 = conv_ref(X64, W64, B64, 1)
    z_err = gamma(3 * 9 + 1) * conv_ref(np.abs(X64), np.abs(W64), np.abs(B64), 1)
    assert np.all(np.abs(z64) > 2 * z_err), "test data: a pre-activation within rounding of 0"
    gz = np.zeros_like(z64)                                         # |d loss / d z|
    gz[:, :, :6, :6] = np.repeat(np.repeat(np.abs(R64) / 4, 2, axis=2), 2, axis=3)
    gz *= z64 > 0
    f_abs = [lambda x_, w_, b_: float((conv_ref(x_, np.abs(W64), np.abs(b_), 1) * gz).sum()),
             lambda x_, w_, b_: float((conv_ref(np.abs(X64), w_, 0 * b_, 1) * gz).sum()),
             lambda x_, w_, b_: float((conv_ref(0 * X64, 0 * w_, b_, 1) * gz).sum())]
    lengths = [4 * 9, 2 * 7 * 6, 2 * 7 * 6]                      # K R S; N P Q; N P Q
    for t, ref, fa, n, name in zip((x, w, b), refs, f_abs, lengths, ("dx", "dw", "db")):
        mag = fd_grad(fa, [X64.copy(), W64.copy(), B64.copy()], ("dx", "dw", "db").index(name),
                      H)
        bound = gamma(n) * np.abs(mag) + 1e-9
        err = np.abs(host(m, t.grad) - ref)
        assert np.all(err <= bound), (name, float((err / bound).max()))


def attention_bound(q, k, v, dout, scale, causal):
    """First-order rounding bound of float32 flash attention's dq, dk, dv (float64 inputs):
    each sum of n products errs by gamma_n * sum|terms|, the forward's errors carried along."""
    T, D = q.shape[-2:]
    s = scale * q @ np.swapaxes(k, -1, -2)
    mask = np.triu(np.ones((T, T), bool), 1) if causal else np.zeros((T, T), bool)
    s = np.where(mask, -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p @ v
    aq, ak, av, ad = np.abs(q), np.abs(k), np.abs(v), np.abs(dout)
    e_s = np.where(mask, 0, gamma(D) * scale * aq @ np.swapaxes(ak, -1, -2))
    e_p = p * (e_s + (p * e_s).sum(-1, keepdims=True)) + gamma(T + 4) * p
    e_o = gamma(T) * p @ av + e_p @ av
    dp = dout @ np.swapaxes(v, -1, -2)
    di = (dout * o).sum(-1, keepdims=True)
    e_dp = gamma(D) * ad @ np.swapaxes(av, -1, -2)
    e_di = gamma(D) * (ad * np.abs(o)).sum(-1, keepdims=True) + (ad * e_o).sum(-1, keepdims=True)
    ds = p * (dp - di)
    e_ds = e_p * np.abs(dp - di) + p * (e_dp + e_di) + U32 * np.abs(ds)
    e_dq = scale * (gamma(T) * np.abs(ds) @ ak + e_ds @ ak)
    e_dk = scale * (gamma(T) * np.swapaxes(np.abs(ds), -1, -2) @ aq +
                    np.swapaxes(e_ds, -1, -2) @ aq)
    e_dv = gamma(T) * np.swapaxes(p, -1, -2) @ ad + np.swapaxes(e_p, -1, -2) @ ad
    return e_dq, e_dk, e_dv


@pytest.mark.parametrize("causal", [False, True])
def test_attention_gradients_against_float64(m, causal):
    needs("flash_attention_backward")
    from cuda_backend.ops.attention import reference
    rng = np.random.default_rng(14)
    shape = (2, 3, 7, 5)
    Q, K, V, R = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    arrays = [a.astype(np.float64) for a in (Q, K, V)]
    scale = 5 ** -0.5
    leaves = [tensor(a, requires_grad=True) for a in (Q, K, V)]
    (ag.attention(*leaves, None, causal) * tensor(R)).sum().backward()

    def f(q_, k_, v_):
        return float((reference(q_, k_, v_, scale, causal) * R).sum())
    bounds = attention_bound(*arrays, R.astype(np.float64), scale, causal)
    for i, (t, bound) in enumerate(zip(leaves, bounds)):
        ref = fd_grad(f, [a.copy() for a in arrays], i, H)
        err = np.abs(host(m, t.grad) - ref)
        assert np.all(err <= bound + 1e-9), ("dq dk dv".split()[i], float((err / bound).max()))


# -- against PyTorch autograd -----------------------------------------------------------------
def torch_grads(torch, tmodel, state, inputs, loss_of, dtype):
    tmodel = tmodel.to(dtype)
    tmodel.load_state_dict({k: torch.tensor(v, dtype=dtype) for k, v in state.items()},
                           strict=False)
    xs = [torch.tensor(a, dtype=dtype, requires_grad=True) if a.dtype.kind == "f"
          else torch.tensor(a) for a in inputs]
    loss_of(tmodel, *xs).backward()
    grads = {n: p.grad.double().numpy() for n, p in tmodel.named_parameters()}
    grads.update({f"input{i}": x.grad.double().numpy() for i, x in enumerate(xs)
                  if x.grad is not None})
    return grads


def compare_with_torch(m, model, tmodel_fn, inputs, ours_loss, torch_loss):
    torch = pytest.importorskip("torch")
    state = model.state_dict()
    leaves = [tensor(a, requires_grad=True) if a.dtype.kind == "f" else m.from_numpy(a)
              for a in inputs]
    ours_loss(*leaves).backward()
    ours = {n: host(m, p.grad) for n, p in model.named_parameters()}
    ours.update({f"input{i}": host(m, t.grad) for i, t in enumerate(leaves)
                 if isinstance(t, Tensor)})
    t64 = torch_grads(torch, tmodel_fn(), state, inputs, torch_loss, torch.float64)
    t32 = torch_grads(torch, tmodel_fn(), state, inputs, torch_loss, torch.float32)
    assert set(ours) == set(t64)
    for name in ours:
        err = np.abs(ours[name] - t64[name]).max()
        allowed = 4 * np.abs(t32[name] - t64[name]).max() + 4 * U32 * np.abs(t64[name]).max()
        assert err <= allowed, (name, err, allowed)


def test_mlp_against_pytorch(m):
    needs("linear_backward")
    rng = np.random.default_rng(20)
    nn.manual_seed(20)
    model = nn.Sequential(nn.Linear(33, 65), nn.ReLU(), nn.Linear(65, 9))
    x = rng.standard_normal((17, 33)).astype(np.float32)
    y = rng.integers(0, 9, 17).astype(np.int64)

    def tmodel():
        import torch
        return torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.ReLU(),
                                   torch.nn.Linear(65, 9))
    compare_with_torch(m, model, tmodel, [x, y],
                       lambda x_, y_: nn.cross_entropy(model(x_), y_),
                       lambda tm, x_, y_: __import__("torch").nn.functional.cross_entropy(
                           tm(x_), y_))


def test_conv_block_against_pytorch(m):
    needs("conv2d_backward", "batch_norm_backward", "max_pool2d_backward", "linear_backward")
    rng = np.random.default_rng(21)
    nn.manual_seed(21)
    model = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.BatchNorm2d(5), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(5 * 3 * 4, 4))
    x = rng.standard_normal((3, 3, 7, 9)).astype(np.float32)
    y = rng.integers(0, 4, 3).astype(np.int64)

    def tmodel():
        import torch.nn as tnn
        return tnn.Sequential(tnn.Conv2d(3, 5, 3, padding=1), tnn.BatchNorm2d(5), tnn.ReLU(),
                              tnn.MaxPool2d(2), tnn.Flatten(), tnn.Linear(5 * 3 * 4, 4))
    compare_with_torch(m, model, tmodel, [x, y],
                       lambda x_, y_: nn.cross_entropy(model(x_), y_),
                       lambda tm, x_, y_: __import__("torch").nn.functional.cross_entropy(
                           tm(x_), y_))


def test_attention_block_against_pytorch(m):
    needs("flash_attention_backward", "layer_norm_backward", "linear_backward",
          "fused_linear_gelu_backward")
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_gpt
    rng = np.random.default_rng(22)
    nn.manual_seed(22)
    B, T, C, Hh = 2, 9, 16, 4
    block = train_gpt.Block(C, Hh)
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    R = rng.standard_normal((B, T, C)).astype(np.float32)

    def tmodel():
        return train_gpt.torch_build(5, T, C, Hh, 1).blocks[0]
    compare_with_torch(m, block, tmodel, [x, R],
                       lambda x_, r_: (block(x_) * r_).sum(),
                       lambda tm, x_, r_: (tm(x_) * r_).sum())


# -- memory, exceptions, mixed precision -----------------------------------------------------------
def active(backend):
    gc.collect()
    return backend.memory_pools[0].get_stats()["active_memory"]


def test_training_step_memory_back_to_baseline(m, backend):
    needs("linear_backward", "fused_linear_gelu_backward")
    rng = np.random.default_rng(30)
    nn.manual_seed(30)
    model = nn.Sequential(nn.Linear(40, 300, gelu=True), nn.Linear(300, 300), nn.ReLU(),
                          nn.Linear(300, 7))
    opt = optim.Adam(model.parameters(), 1e-3)
    x = tensor(rng.standard_normal((64, 40)).astype(np.float32))
    y = labels(m, rng, 64, 7)

    def step():
        opt.zero_grad()
        loss = nn.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()
    step()                                   # the optimizer's buffers exist from here on
    opt.zero_grad()
    base = active(backend)
    for _ in range(3):
        step()
        opt.zero_grad()
        assert active(backend) == base


def test_a_training_step_after_an_exception_mid_forward(m, backend):
    needs("linear_backward")
    rng = np.random.default_rng(31)
    nn.manual_seed(31)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    state = model.state_dict()
    x = tensor(rng.standard_normal((5, 6)).astype(np.float32))
    y = labels(m, rng, 5, 3)
    base = active(backend)
    with pytest.raises(CudaBackendError):
        h = model[1](model[0](x))
        model[2](h.reshape(8, 5))                # wrong shape for the last layer
    del h
    assert active(backend) == base
    opt = optim.SGD(model.parameters(), 0.1)
    nn.cross_entropy(model(x), y).backward()
    opt.step()
    nn.manual_seed(31)
    fresh = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    fresh.load_state_dict(state)
    nn.cross_entropy(fresh(x), y).backward()
    optim.SGD(fresh.parameters(), 0.1).step()
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        np.testing.assert_array_equal(a, b, err_msg=n)


def test_autocast_dtypes(m):
    needs("linear_backward", "layer_norm_backward")
    rng = np.random.default_rng(32)
    nn.manual_seed(32)
    lin, norm = nn.Linear(8, 6), nn.LayerNorm(6)
    x = tensor(rng.standard_normal((4, 8)).astype(np.float32))
    with ag.autocast("bfloat16"):
        h = lin(x)
        z = norm(h)
        loss = nn.cross_entropy(z, labels(m, rng, 4, 6))
    assert (h.dtype, z.dtype, loss.dtype) == (DT.BFLOAT16, DT.FLOAT32, DT.FLOAT32)
    loss.backward()
    assert all(p.grad.dtype is DT.FLOAT32 for p in lin.parameters() + norm.parameters())


# -- optimizers --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sgd", "sgd_nesterov", "adam", "adamw"])
def test_optimizers_follow_the_reference(m, kind):
    from cuda_backend.ops.optimizers import reference
    rng = np.random.default_rng(40)
    P = rng.standard_normal((3, 5))
    p = nn.Parameter(m.from_numpy(P))
    if kind.startswith("sgd"):
        opt = optim.SGD([p], 0.1, momentum=0.9, weight_decay=0.01,
                        nesterov=kind == "sgd_nesterov")
    else:
        opt = (optim.Adam if kind == "adam" else optim.AdamW)([p], 0.01, weight_decay=0.1)
    ref, bufs = P.copy(), None
    for step in range(4):
        G = rng.standard_normal((3, 5))
        p.grad = m.from_numpy(G)
        opt.step()
        st = opt.state[id(p)][0]
        shadow = type(st)(**{**st.__dict__, "step": step})
        if kind.startswith("sgd"):
            ref, bufs = reference("sgd", shadow, ref, G,
                                  np.zeros_like(P) if bufs is None else bufs)
        else:
            if bufs is None:
                bufs = (np.zeros_like(P), np.zeros_like(P))
            ref, m1, v1 = reference("adam", shadow, ref, G, *bufs)
            bufs = (m1, v1)
        np.testing.assert_allclose(host(m, p), ref, rtol=1e-12, atol=1e-14)
    opt.zero_grad()
    assert p.grad is None
    with pytest.raises(InvalidArgumentError):
        optim.SGD([], 0.1)
    with pytest.raises(InvalidArgumentError):
        optim.SGD([tensor(P)], 0.1)


def test_loss_scaler_skips_non_finite_steps(m):
    p = nn.Parameter(m.from_numpy(np.ones(3, np.float32)))
    opt = optim.SGD([p], 1.0)
    scaler = optim.LossScaler(init_scale=8.0, growth_interval=2)
    p.grad = m.from_numpy(np.array([8.0, np.inf, 0.0], np.float32))
    assert not scaler.step(opt)
    assert scaler.scale_value == 4.0 and p.grad is None
    np.testing.assert_array_equal(host(m, p), [1, 1, 1])
    for _ in range(2):
        loss = scaler.scale((p * 2.0).sum())
        loss.backward()
        assert scaler.step(opt)
        opt.zero_grad()
    np.testing.assert_array_equal(host(m, p), [-3, -3, -3])      # two steps of -2
    assert scaler.scale_value == 8.0


def test_captured_step_needs_a_gpu_in_fallback_mode(m):
    if m.gpu:
        pytest.skip("fallback mode only")
    p = nn.Parameter(m.from_numpy(np.ones(3, np.float32)))
    opt = optim.SGD([p], 0.1)

    def fb():
        loss = (p * p).sum()
        loss.backward()
        return loss
    step = optim.CapturedStep(fb, opt, warmup=1)
    step()
    with pytest.raises(CudaBackendError):
        step()
    with pytest.raises(InvalidArgumentError):
        optim.CapturedStep(fb, opt, warmup=0)


@pytest.mark.gpu
@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
def test_captured_step_replays_the_eager_steps(m, opt_kind):
    """The same kernels on the same data in the same order: the graph's losses and
    parameters equal the eager run's exactly."""
    needs("linear_backward", "fused_linear_gelu_backward")
    rng = np.random.default_rng(50)
    data = [(rng.standard_normal((32, 64)).astype(np.float32),
             rng.integers(0, 10, 32).astype(np.int64)) for _ in range(6)]
    runs = []
    for graph in (False, True):
        nn.manual_seed(50)
        model = nn.Sequential(nn.Linear(64, 128, gelu=True), nn.Linear(128, 10))
        opt = optim.SGD(model.parameters(), 0.1, momentum=0.9) if opt_kind == "sgd" else \
            optim.AdamW(model.parameters(), 1e-3)
        x, y = m.from_numpy(data[0][0]), m.from_numpy(data[0][1])

        def fb():
            loss = nn.cross_entropy(model(Tensor(x)), y)
            loss.backward()
            return loss
        step = optim.CapturedStep(fb, opt, warmup=2) if graph else None
        losses = []
        for xs, ys in data:
            m.backend.copy_to_device(xs, x)
            m.backend.copy_to_device(ys, y)
            if graph:
                losses.append(step().item())
            else:
                opt.zero_grad()
                losses.append(fb().item())
                opt.step()
        runs.append((losses, model.state_dict()))
        if graph:
            step.free()
    assert runs[0][0] == runs[1][0]
    for k in runs[0][1]:
        np.testing.assert_array_equal(runs[0][1][k], runs[1][1][k], err_msg=k)


# -- the examples --------------------------------------------------------------------------------
EXAMPLES = {
    "train_mlp.py": ("linear_backward", "fused_linear_gelu_backward"),
    "train_cnn.py": ("conv2d_backward", "batch_norm_backward", "max_pool2d_backward",
                     "avg_pool2d_backward", "linear_backward"),
    "train_gpt.py": ("flash_attention_backward", "layer_norm_backward", "linear_backward",
                     "fused_linear_gelu_backward"),
}


def run_example(name, *args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args],
                         capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs(backend, name):
    needs(*EXAMPLES[name])
    out = run_example(name, "--steps", "3", "--log-every", "1",
                      *(("--sample", "20") if name == "train_gpt.py" else ()))
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 3 and all(np.isfinite(losses)), out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_matches_pytorch(backend, name):
    """--compare over a few steps: float32 curves within 1 % of PyTorch's (the issue's
    target at 200 steps; over 5 steps the gap is rounding alone)."""
    pytest.importorskip("torch")
    needs(*EXAMPLES[name])
    out = run_example(name, "--steps", "5", "--compare",
                      *(("--sample", "0") if name == "train_gpt.py" else ()))
    gap = float(re.search(r"largest relative gap of the curves (\S+)", out).group(1))
    assert gap < 0.01, out
