"""The forward CudaML cases' pieces (performance/cases_ml.py's ML_OPS): the NumPy (and CuPy)
references, the input draws at scale s, and the PyTorch peers; cases_ml_grads.py has the
gradients'. cases_training.py builds its float64 models from these references too.
"""
from __future__ import annotations

from typing import Any, List

import numpy as np

from .cases_math import F32, sigmoid, softmax, between

SQRT_2_OVER_PI = float(np.sqrt(2.0 / np.pi))


# -- NumPy (and CuPy) references ------------------------------------------------------
def gelu_tanh(xp: Any, x: Any) -> Any:
    return 0.5 * x * (1.0 + xp.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def conv2d_nchw(xp: Any, x: Any, w: Any, pad: int = 1) -> Any:
    """Stride-1 convolution as a sum over filter taps of (K,C) x (C, N*Ho*Wo) products."""
    n, c, h, wd = x.shape
    k, _, r, s = w.shape
    ho, wo = h + 2 * pad - r + 1, wd + 2 * pad - s + 1
    xp_ = xp.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    out = xp.zeros((k, n, ho, wo), dtype=x.dtype)
    for i in range(r):
        for j in range(s):
            out += xp.tensordot(w[:, :, i, j], xp_[:, :, i:i + ho, j:j + wo], axes=([1], [1]))
    return xp.ascontiguousarray(out.transpose(1, 0, 2, 3))


def pool2x2(x: Any, reduce: str) -> Any:
    n, c, h, w = x.shape
    v = x[:, :, :h // 2 * 2, :w // 2 * 2].reshape(n, c, h // 2, 2, w // 2, 2)
    return getattr(v, reduce)(axis=(3, 5))


def batch_norm(xp: Any, x: Any, gamma: Any, beta: Any, mean: Any, var: Any) -> Any:
    sh = (1, -1, 1, 1)
    return (x - mean.reshape(sh)) / xp.sqrt(var.reshape(sh) + 1e-5) * gamma.reshape(sh) \
        + beta.reshape(sh)


def layer_norm(xp: Any, x: Any, w: Any, b: Any) -> Any:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / xp.sqrt(var + 1e-5) * w + b


def attention(xp: Any, q: Any, k: Any, v: Any, causal: bool = False) -> Any:
    scale = 1.0 / np.sqrt(q.shape[-1])
    s = (q @ xp.swapaxes(k, -1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = xp.where(xp.tril(xp.ones((n, n), dtype=bool)), s, -xp.inf)
    return softmax(xp, s) @ v


def adam(xp: Any, p: Any, g: Any, m: Any, v: Any, lr: float = 1e-3, b1: float = 0.9,
         b2: float = 0.999, eps: float = 1e-8, t: int = 1) -> Any:
    """One Adam step (PyTorch's semantics, bias-corrected), in place."""
    m *= b1
    m += (1 - b1) * g
    v *= b2
    v += (1 - b2) * g * g
    p -= lr * (m / (1 - b1 ** t)) / (xp.sqrt(v / (1 - b2 ** t)) + eps)
    return p


def sgd(xp: Any, p: Any, g: Any, buf: Any, lr: float = 0.01, momentum: float = 0.9) -> Any:
    """One SGD-with-momentum step (PyTorch's semantics, no dampening), in place."""
    buf *= momentum
    buf += g
    p -= lr * buf
    return p


def sketched(xp: Any, x: Any, u: Any, v: Any) -> Any:
    return ((x @ u) @ v).mean(axis=0)


def gelu_tanh_grad(xp: Any, g: Any, x: Any) -> Any:
    """d gelu_tanh(x) / dx * g (PyTorch's formula)."""
    t = xp.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))
    return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI
                * (1.0 + 3 * 0.044715 * x * x))


def cross_entropy_loss(xp: Any, x: Any, labels: Any) -> Any:
    """The mean cross-entropy (every label in range, none ignored)."""
    m = x.max(axis=-1, keepdims=True)
    lse = xp.log(xp.exp(x - m).sum(axis=-1)) + m[:, 0]
    return (lse - xp.take_along_axis(x, labels[:, None], axis=-1)[:, 0]).mean()


def cross_entropy_grad(xp: Any, x: Any, labels: Any) -> Any:
    """d mean cross-entropy / d x."""
    p = softmax(xp, x)
    p[xp.arange(x.shape[0]), labels] -= 1.0
    return p / x.shape[0]


def dropout_check(out, ref, inputs):
    """Every element is 0 or x/keep_prob, and the kept fraction is within 6 sigma of 0.5."""
    x = inputs[0]
    out = np.asarray(out, np.float64)
    if out.shape != x.shape:
        return float("inf"), float("inf"), f"output shape {out.shape} != {x.shape}"
    kept = out != 0
    err = float(np.max(np.abs(out[kept] - x[kept] / 0.5))) if kept.any() else 0.0
    rel = err / (float(np.max(np.abs(x))) / 0.5)
    frac, n = float(kept.mean()), x.size
    if abs(frac - 0.5) > 6 * np.sqrt(0.25 / n) + 1.0 / n:
        return err, rel, f"kept fraction {frac:.4f} is not within 6 sigma of keep_prob 0.5"
    return err, rel, None


# -- inputs (float32 draws; see cases_math) -----------------------------------------
def normal(rng: np.random.Generator, shape: Any, scale: float = 1.0) -> np.ndarray:
    x = rng.standard_normal(shape, dtype=F32)
    return x if scale == 1.0 else (x * F32(scale)).astype(F32)


def images(extra: int = 0, batch: int = 8, channels: int = 64):
    """(batch, channels, s, s) images, and what the op takes with them (`extra`)."""
    def make(rng: np.random.Generator, s: int) -> List[np.ndarray]:
        c = channels
        x = [normal(rng, (batch, c, s, s))]
        if extra == 1:  # conv filters (c -> c), scaled so outputs stay O(1): 1/sqrt(9c)
            x.append(normal(rng, (c, c, 3, 3), 1 / float(np.sqrt(9 * c))))
        if extra == 4:  # batch-norm gamma, beta, mean, var
            x += [between(rng, 0.5, 1.5, c), normal(rng, c), normal(rng, c, 0.1),
                  between(rng, 0.5, 2.0, c)]
        return x
    return make


def rows_of(width: int):
    """Layer-norm inputs: s*s/2 rows of `width`, the weight and the bias."""
    def make(rng: np.random.Generator, s: int) -> List[np.ndarray]:
        return [normal(rng, (max(s * s // 2, 1), width)), between(rng, 0.5, 1.5, width),
                normal(rng, width)]
    return make


rows = rows_of(1024)


def qkv(rng: np.random.Generator, s: int) -> List[np.ndarray]:
    return [normal(rng, (2, 8, 8 * s, 64)) for _ in range(3)]


def optimizer_state(k: int):
    def make(rng: np.random.Generator, s: int) -> List[np.ndarray]:
        n = 64 * s * s
        if k == 3:  # SGD: a zero momentum buffer, where "b = g on the first step" (PyTorch)
            return [normal(rng, n), normal(rng, n), np.zeros(n, F32)]  # and b = m*b + g agree
        out = [normal(rng, n), normal(rng, n), normal(rng, n, 0.1)]
        if k == 4:
            out.append(between(rng, 0.0, 0.1, n))
        return out
    return make


def grad_pair(kind: str = "x"):
    """(upstream gradient, the forward's input x or output y) of images' shape."""
    def make(rng: np.random.Generator, s: int) -> List[np.ndarray]:
        g, x = normal(rng, (8, 64, s, s)), normal(rng, (8, 64, s, s))
        if kind == "sigmoid":
            x = sigmoid(np, x).astype(F32)
        elif kind == "tanh":
            x = np.tanh(x).astype(F32)
        return [g, x]
    return make


def softmax_grad_rows(log: bool):
    """(upstream gradient, softmax or log_softmax output) of rows s*s/2 x 1024."""
    def make(rng: np.random.Generator, s: int) -> List[np.ndarray]:
        n = max(s * s // 2, 1)
        y = softmax(np, normal(rng, (n, 1024)).astype(np.float64), log=log).astype(F32)
        return [normal(rng, (n, 1024)), y]
    return make


def logits_labels(rng: np.random.Generator, s: int) -> List[np.ndarray]:
    """Logits s*s/2 x 1000 (scale 3) and int64 labels in range."""
    n = max(s * s // 2, 1)
    return [normal(rng, (n, 1000), 3.0), rng.integers(0, 1000, n).astype(np.int64)]


def linear(rng: np.random.Generator, s: int) -> List[np.ndarray]:
    return [normal(rng, (8 * s, 1024)), normal(rng, (1024, 1024), 1 / 32), normal(rng, 1024)]


def sketch(rng: np.random.Generator, s: int) -> List[np.ndarray]:
    return [normal(rng, (8 * s, 256)), normal(rng, (4, 256, 32), 1 / 16),
            normal(rng, (4, 32, 256), 1 / 6)]


# -- PyTorch peers --------------------------------------------------------------------
def torch_optimizer(kind: str):
    def factory(T: Any, p: Any, g: Any, *state: Any):
        param = T.nn.Parameter(p)
        param.grad = g
        if kind == "adam":
            opt = T.optim.Adam([param], lr=1e-3, fused=True)
        else:
            opt = T.optim.SGD([param], lr=0.01, momentum=0.9, fused=True)
        return opt.step
    return factory



def F(T: Any) -> Any:
    return T.nn.functional


def aten_of(T: Any) -> Any:
    return T.ops.aten


def torch_cross_entropy_backward(T: Any, x: Any, labels: Any):
    """PyTorch's backward of F.cross_entropy as autograd runs it (nll_loss_backward, then
    log_softmax_backward), the forward done once outside the timed call."""
    xr = x.detach().requires_grad_(True)
    loss = F(T).cross_entropy(xr, labels)
    return lambda: T.autograd.grad(loss, xr, retain_graph=True)[0]
