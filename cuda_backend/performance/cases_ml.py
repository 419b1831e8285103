"""The CudaML cases (ml family), used when `cuda_backend.cuda_ml` can be imported.

Sizes are a scale s: images are (8, 64, s, s), layer-norm rows s*s/2 x 1024, attention
(2, 8, 8s, 64), optimizer vectors 64*s*s parameters. Signatures follow the documented API
(../shared/seeds/001_097e3d6e2f3c2394.txt: `conv2d(input, kernel, ConvolutionConfig)`,
`activation(x, ActivationType.X)`, ...). To
benchmark a new CudaML operation, add an OpDef to ML_OPS.
"""
from __future__ import annotations

from typing import Any, List

import numpy as np

from .cases import OpDef
from .cases_math import F32, _sigmoid, _softmax, between, per_element

# CudaML methods that are not operations (sketched_linear_params draws random weights).
NON_OPS = ("math", "backend", "sketched_linear_params")
ML = "ml"
TENSOR = ("float32", "float16", "bfloat16")
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
    return _softmax(xp, s) @ v


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
    p = _softmax(xp, x)
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


def images(extra: int = 0):
    def make(rng: np.random.Generator, s: int) -> List[np.ndarray]:
        x = [normal(rng, (8, 64, s, s))]
        if extra == 1:  # conv filters, scaled so outputs stay O(1)
            x.append(normal(rng, (64, 64, 3, 3), 1 / 24))
        if extra == 4:  # batch-norm gamma, beta, mean, var
            x += [between(rng, 0.5, 1.5, 64), normal(rng, 64), normal(rng, 64, 0.1),
                  between(rng, 0.5, 2.0, 64)]
        return x
    return make


def rows(rng: np.random.Generator, s: int) -> List[np.ndarray]:
    return [normal(rng, (max(s * s // 2, 1), 1024)), between(rng, 0.5, 1.5, 1024),
            normal(rng, 1024)]


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
            x = _sigmoid(np, x).astype(F32)
        elif kind == "tanh":
            x = np.tanh(x).astype(F32)
        return [g, x]
    return make


def softmax_grad_rows(log: bool):
    """(upstream gradient, softmax or log_softmax output) of rows s*s/2 x 1024."""
    def make(rng: np.random.Generator, s: int) -> List[np.ndarray]:
        n = max(s * s // 2, 1)
        y = _softmax(np, normal(rng, (n, 1024)).astype(np.float64), log=log).astype(F32)
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


def _F(T: Any) -> Any:
    return T.nn.functional


def _act(name: str):
    return lambda c, x: c.ml.activation(x, getattr(c.ml_module.ActivationType, name))


def _opt_state(c: Any, **kw: Any) -> Any:
    return c.ml_module.OptimizerState(**kw)


def _aten(T: Any) -> Any:
    return T.ops.aten


def torch_cross_entropy_backward(T: Any, x: Any, labels: Any):
    """PyTorch's backward of F.cross_entropy as autograd runs it (nll_loss_backward, then
    log_softmax_backward), the forward done once outside the timed call."""
    xr = x.detach().requires_grad_(True)
    loss = _F(T).cross_entropy(xr, labels)
    return lambda: T.autograd.grad(loss, xr, retain_graph=True)[0]


ML_OPS: List[OpDef] = [
    OpDef("conv2d", ML, images(1),
          lambda c, x, w: c.ml.conv2d(x, w, c.ml_module.ConvolutionConfig(
              kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))),
          cpu=conv2d_nchw, torch=lambda T, x, w: _F(T).conv2d(x, w, padding=1), cupy=False,
          api="CudaML", variant="3x3 pad 1",
          flops=lambda sh: 2.0 * np.prod(sh[0]) * sh[1][0] * 9),
    OpDef("activation", ML, images(), _act("RELU"), cpu=lambda xp, x: xp.maximum(x, 0),
          torch=lambda T, x: T.relu(x), api="CudaML", variant="RELU",
          flops=per_element(1)),
    OpDef("activation", ML, images(), _act("GELU"), cpu=gelu_tanh,
          torch=lambda T, x: _F(T).gelu(x, approximate="tanh"), api="CudaML",
          variant="GELU", flops=per_element(8)),
    OpDef("activation", ML, images(), _act("SILU"), cpu=lambda xp, x: x * _sigmoid(xp, x),
          torch=lambda T, x: _F(T).silu(x), api="CudaML", variant="SILU",
          flops=per_element(5)),
    OpDef("gelu", ML, images(), lambda c, x: c.ml.gelu(x, approximate="tanh"), cpu=gelu_tanh,
          torch=lambda T, x: _F(T).gelu(x, approximate="tanh"), api="CudaML",
          dtypes=TENSOR, flops=per_element(8)),
    OpDef("max_pool2d", ML, images(), lambda c, x: c.ml.max_pool2d(x, (2, 2)),
          cpu=lambda xp, x: pool2x2(x, "max"), torch=lambda T, x: _F(T).max_pool2d(x, 2),
          api="CudaML", variant="2x2", flops=per_element(1)),
    OpDef("avg_pool2d", ML, images(), lambda c, x: c.ml.avg_pool2d(x, (2, 2)),
          cpu=lambda xp, x: pool2x2(x, "mean"), torch=lambda T, x: _F(T).avg_pool2d(x, 2),
          api="CudaML", variant="2x2", flops=per_element(1)),
    OpDef("batch_norm", ML, images(4),
          lambda c, x, g, b, m, v: c.ml.batch_norm(x, g, b, m, v), cpu=batch_norm,
          torch=lambda T, x, g, b, m, v: _F(T).batch_norm(x, m, v, g, b, training=False,
                                                           eps=1e-5),
          api="CudaML", variant="inference", flops=per_element(4)),
    OpDef("layer_norm", ML, rows, lambda c, x, w, b: c.ml.layer_norm(x, w, b),
          cpu=layer_norm, torch=lambda T, x, w, b: _F(T).layer_norm(x, (x.shape[-1],), w, b,
                                                                     eps=1e-5),
          api="CudaML", dtypes=TENSOR, flops=per_element(8)),
    OpDef("dropout", ML, images(), lambda c, x: c.ml.dropout(x, keep_prob=0.5, seed=1234),
          cpu=lambda xp, x: x * (xp.random.random(x.shape) < 0.5) / 0.5,
          reference=lambda xp, x: x, torch=lambda T, x: _F(T).dropout(x, 0.5, training=True),
          check=dropout_check, api="CudaML", variant="keep 0.5", flops=per_element(2)),
    OpDef("adam_update", ML, optimizer_state(4),
          lambda c, p, g, m, v: c.ml.adam_update(p, g, m, v, _opt_state(c, learning_rate=1e-3)),
          cpu=adam, torch_factory=torch_optimizer("adam"), result_inputs=(0, 2, 3),
          bytes_fn=lambda i, o: i * 7 // 4, api="CudaML", flops=per_element(15)),
    OpDef("sgd_update", ML, optimizer_state(3),
          lambda c, p, g, b: c.ml.sgd_update(p, g, b, _opt_state(c, learning_rate=0.01,
                                                                  momentum=0.9)),
          cpu=sgd, torch_factory=torch_optimizer("sgd"), result_inputs=(0, 2),
          bytes_fn=lambda i, o: i * 5 // 3, api="CudaML", variant="momentum 0.9",
          flops=per_element(4)),
    OpDef("flash_attention", ML, qkv, lambda c, q, k, v: c.ml.flash_attention(q, k, v),
          cpu=attention, torch=lambda T, q, k, v: _F(T).scaled_dot_product_attention(q, k, v),
          api="CudaML", dtypes=TENSOR, compute_unit="tensor",
          flops=lambda sh: 4.0 * sh[0][0] * sh[0][1] * sh[0][2] ** 2 * sh[0][3]),
    OpDef("flash_attention", ML, qkv,
          lambda c, q, k, v: c.ml.flash_attention(q, k, v, causal=True),
          cpu=lambda xp, q, k, v: attention(xp, q, k, v, causal=True),
          torch=lambda T, q, k, v: _F(T).scaled_dot_product_attention(q, k, v, is_causal=True),
          api="CudaML", variant="causal", dtypes=TENSOR, compute_unit="tensor",
          flops=lambda sh: 2.0 * sh[0][0] * sh[0][1] * sh[0][2] ** 2 * sh[0][3]),
    OpDef("fused_linear_gelu", ML, linear,
          lambda c, x, w, b: c.ml.fused_linear_gelu(x, w, b),
          cpu=lambda xp, x, w, b: gelu_tanh(xp, x @ w.T + b),
          torch=lambda T, x, w, b: _F(T).gelu(_F(T).linear(x, w, b), approximate="tanh"),
          api="CudaML", variant="GELU tanh", flops=lambda sh: 2.0 * sh[0][0] * sh[0][1] * sh[1][0]),
    OpDef("sketched_linear", ML, sketch, lambda c, x, u, v: c.ml.sketched_linear(x, u, v),
          cpu=sketched, torch=lambda T, x, u, v: ((x @ u) @ v).mean(dim=0), api="CudaML",
          variant="4 terms rank 32",
          flops=lambda sh: 2.0 * sh[1][0] * sh[0][0] * sh[1][2] * (sh[1][1] + sh[2][2])),
    # gradients (ops/activation_backward.py, softmax_backward.py, cross_entropy.py)
    OpDef("relu_backward", ML, grad_pair(), lambda c, g, x: c.ml.relu_backward(g, x),
          cpu=lambda xp, g, x: xp.where(x <= 0, 0, g),
          torch=lambda T, g, x: _aten(T).threshold_backward(g, x, 0), api="CudaML",
          dtypes=TENSOR, flops=per_element(1)),
    OpDef("leaky_relu_backward", ML, grad_pair(),
          lambda c, g, x: c.ml.leaky_relu_backward(g, x),
          cpu=lambda xp, g, x: xp.where(x > 0, g, g * 0.01),
          torch=lambda T, g, x: _aten(T).leaky_relu_backward(g, x, 0.01, False), api="CudaML",
          flops=per_element(2)),
    OpDef("elu_backward", ML, grad_pair(), lambda c, g, x: c.ml.elu_backward(g, x),
          cpu=lambda xp, g, x: xp.where(x <= 0, g * xp.exp(x), g),
          torch=lambda T, g, x: _aten(T).elu_backward(g, 1.0, 1, 1, False, x), api="CudaML",
          flops=per_element(4)),
    OpDef("gelu_backward", ML, grad_pair(), lambda c, g, x: c.ml.gelu_backward(g, x),
          cpu=gelu_tanh_grad,
          torch=lambda T, g, x: _aten(T).gelu_backward(g, x, approximate="tanh"),
          api="CudaML", variant="tanh", dtypes=TENSOR, flops=per_element(20)),
    OpDef("sigmoid_backward", ML, grad_pair("sigmoid"),
          lambda c, g, y: c.ml.sigmoid_backward(g, y), cpu=lambda xp, g, y: g * (1.0 - y) * y,
          torch=lambda T, g, y: _aten(T).sigmoid_backward(g, y), api="CudaML",
          flops=per_element(3)),
    OpDef("tanh_backward", ML, grad_pair("tanh"), lambda c, g, y: c.ml.tanh_backward(g, y),
          cpu=lambda xp, g, y: g * (1.0 - y * y),
          torch=lambda T, g, y: _aten(T).tanh_backward(g, y), api="CudaML",
          flops=per_element(3)),
    OpDef("softmax_backward", ML, softmax_grad_rows(False),
          lambda c, g, y: c.ml.softmax_backward(g, y),
          cpu=lambda xp, g, y: y * (g - (g * y).sum(axis=-1, keepdims=True)),
          torch=lambda T, g, y: _aten(T)._softmax_backward_data(g, y, -1, y.dtype),
          api="CudaML", dtypes=TENSOR, flops=per_element(4)),
    OpDef("log_softmax_backward", ML, softmax_grad_rows(True),
          lambda c, g, y: c.ml.log_softmax_backward(g, y),
          cpu=lambda xp, g, y: g - xp.exp(y) * g.sum(axis=-1, keepdims=True),
          torch=lambda T, g, y: _aten(T)._log_softmax_backward_data(g, y, -1, y.dtype),
          api="CudaML", flops=per_element(4)),
    OpDef("cross_entropy", ML, logits_labels, lambda c, x, t: c.ml.cross_entropy(x, t),
          cpu=cross_entropy_loss, torch=lambda T, x, t: _F(T).cross_entropy(x, t),
          api="CudaML", variant="mean", cupy=False, dtypes=TENSOR, flops=per_element(5)),
    OpDef("cross_entropy_backward", ML, logits_labels,
          lambda c, x, t: c.ml.cross_entropy_backward(x, t), cpu=cross_entropy_grad,
          torch_factory=torch_cross_entropy_backward, api="CudaML", variant="mean",
          cupy=False, dtypes=TENSOR, flops=per_element(5)),
]
