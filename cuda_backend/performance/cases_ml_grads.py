"""The gradient CudaML cases' pieces (performance/cases_ml.py's ML_OPS): per gradient family
the inputs at scale s, the float64 NumPy references and the PyTorch peers (autograd or the
aten backward op, the forward done once outside the timed call). The forward cases' pieces
are cases_ml_forward.py's.
"""
from __future__ import annotations

from typing import Any, List

import numpy as np

from .cases_math import softmax, between
from .cases_ml_forward import F, aten_of, conv2d_nchw, gelu_tanh_grad, normal


# -- pooling and dropout gradients (ops/pooling_backward.py, ops/dropout.py) ---------------
def pool_grad_inputs(k: int, stride: int, pad: int):
    """(upstream gradient of the pooled shape, the forward's input of images' shape)."""
    def make(rng: np.random.Generator, s: int) -> List[np.ndarray]:
        x = normal(rng, (8, 64, s, s))
        o = (s + 2 * pad - k) // stride + 1
        return [normal(rng, (8, 64, o, o)), x]
    return make


def pool_grad(kind: str, k: int, stride: int, pad: int):
    """d pool / d x times g, by window offsets: max routes g to the window's first maximum
    (inputs hold no NaN), avg spreads g / k^2 (padding counted)."""
    def grad(xp: Any, g: Any, x: Any) -> Any:
        n, c, h, w = x.shape
        o = g.shape[2]
        xpad = xp.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=-np.inf)
        span = stride * (o - 1) + 1
        offsets = [(i, j) for i in range(k) for j in range(k)]
        if kind == "max":
            best = xp.full(g.shape, -np.inf, dtype=x.dtype)
            pick = xp.zeros(g.shape, dtype=np.int64)
            for t, (i, j) in enumerate(offsets):
                v = xpad[:, :, i:i + span:stride, j:j + span:stride]
                pick = xp.where(v > best, t, pick)
                best = xp.maximum(best, v)
        dpad = xp.zeros(xpad.shape, dtype=g.dtype)
        for t, (i, j) in enumerate(offsets):
            part = xp.where(pick == t, g, 0) if kind == "max" else g / (k * k)
            dpad[:, :, i:i + span:stride, j:j + span:stride] += part
        return dpad[:, :, pad:pad + h, pad:pad + w]
    return grad


def torch_max_pool2d_backward(k: int, stride: int, pad: int):
    """aten.max_pool2d_with_indices_backward, the forward with indices done once outside the
    timed call."""
    def factory(T: Any, g: Any, x: Any):
        win = ([k, k], [stride, stride], [pad, pad], [1, 1], False)
        idx = aten_of(T).max_pool2d_with_indices(x, *win)[1]
        return lambda: aten_of(T).max_pool2d_with_indices_backward(g, x, *win, idx)
    return factory


def dropout_grad_inputs(rng: np.random.Generator, s: int) -> List[np.ndarray]:
    """(upstream gradient of images' shape, the uint8 mask dropout(x, 0.5, seed=1234) drew:
    the peers' operand; ours regenerates it from the seed)."""
    from ..ops.dropout import host_mask
    g = normal(rng, (8, 64, s, s))
    return [g, host_mask(g.size, 0.5, 1234).reshape(g.shape).astype(np.uint8)]


def torch_dropout_backward(T: Any, g: Any, mask: Any):
    """aten.native_dropout_backward on the bool mask (converted outside the timed call)."""
    keep = mask.bool()
    return lambda: aten_of(T).native_dropout_backward(g, keep, 2.0)


# -- GEMM gradients (ops/matmul_backward.py): "rows 32s": x (32 s, 8 s), W (32 s, 8 s), at
# s = 128 the (4096, 1024) layer of 4096 outputs; "batch 32": x (32, 8 s), W (32 s, 8 s), at
# s = 128 the batch-32 MLP layer 1024 -> 4096 -------------------------------------------------
def layer_grad_inputs(rows: Any, bias: bool = False):
    """(upstream gradient (rows, 32 s), x (rows, 8 s), W (32 s, 8 s)[, b (32 s)]); rows an int
    or a function of s."""
    def make(rng: np.random.Generator, s: int) -> List[np.ndarray]:
        n = rows(s) if callable(rows) else rows
        out_f, in_f = 32 * s, 8 * s
        out = [normal(rng, (n, out_f)), normal(rng, (n, in_f)),
               normal(rng, (out_f, in_f), 1 / np.sqrt(in_f))]
        return out + [normal(rng, out_f)] if bias else out
    return make


def matmul_grad_inputs(rows: Any):
    """(upstream gradient (rows, 32 s), a (rows, 8 s), b (8 s, 32 s)); rows as above."""
    def make(rng: np.random.Generator, s: int) -> List[np.ndarray]:
        n = rows(s) if callable(rows) else rows
        return [normal(rng, (n, 32 * s)), normal(rng, (n, 8 * s)),
                normal(rng, (8 * s, 32 * s), 1 / np.sqrt(8 * s))]
    return make


def linear_grads(xp: Any, g: Any, x: Any, w: Any) -> Any:
    return g @ w, g.T @ x, g.sum(axis=0)


def fused_linear_gelu_grads(xp: Any, g: Any, x: Any, w: Any, b: Any) -> Any:
    dz = gelu_tanh_grad(xp, g, x @ w.T + b)
    return dz @ w, dz.T @ x, dz.sum(axis=0)


def torch_layer_backward(gelu: bool):
    """PyTorch autograd of F.linear (then GELU, tanh form, with gelu=True): the gradients of
    x, W and b for the upstream gradient, the forward done once outside the timed call."""
    def factory(T: Any, g: Any, x: Any, w: Any, b: Any = None):
        xr, wr = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        br = (T.zeros(w.shape[0], dtype=x.dtype, device=x.device) if b is None
              else b.detach()).requires_grad_(True)
        y = F(T).linear(xr, wr, br)
        if gelu:
            y = F(T).gelu(y, approximate="tanh")
        return lambda: T.autograd.grad(y, (xr, wr, br), g, retain_graph=True)
    return factory


def torch_matmul_backward(T: Any, g: Any, a: Any, b: Any):
    """PyTorch autograd of torch.matmul: the gradients of a and b (two GEMMs), the forward
    done once outside the timed call."""
    ar, br = a.detach().requires_grad_(True), b.detach().requires_grad_(True)
    y = T.matmul(ar, br)
    return lambda: T.autograd.grad(y, (ar, br), g, retain_graph=True)


# -- conv2d gradients (ops/conv2d_backward.py): the conv2d case's 3x3 pad 1 layer on images --
def conv_grad_inputs(rng: np.random.Generator, s: int) -> List[np.ndarray]:
    """(upstream gradient (8, 64, s, s), the forward's input (8, 64, s, s), its filters)."""
    return [normal(rng, (8, 64, s, s)), normal(rng, (8, 64, s, s)),
            normal(rng, (64, 64, 3, 3), 1 / 24)]


def conv2d_dgrad_nchw(xp: Any, g: Any, x: Any, w: Any) -> Any:
    """grad_input of the 3x3 pad 1 convolution: g correlated with the flipped, transposed
    filters (pad 1 again)."""
    return conv2d_nchw(xp, g, xp.ascontiguousarray(w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)))


def conv2d_wgrad_nchw(xp: Any, g: Any, x: Any, w: Any) -> Any:
    """grad_kernel of the 3x3 pad 1 convolution: per tap, g contracted with the shifted input
    over (n, p, q)."""
    ho, wo = g.shape[2], g.shape[3]
    xpad = xp.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = xp.zeros(w.shape, dtype=x.dtype)
    for i in range(w.shape[2]):
        for j in range(w.shape[3]):
            out[:, :, i, j] = xp.tensordot(g, xpad[:, :, i:i + ho, j:j + wo],
                                           axes=([0, 2, 3], [0, 2, 3]))
    return out


def torch_conv2d_backward(mask: Any):
    """aten.convolution_backward of the 3x3 pad 1 layer with output_mask (cuDNN's TF32 as the
    case's precision: off for float32)."""
    def factory(T: Any, g: Any, x: Any, w: Any):
        return lambda: aten_of(T).convolution_backward(g, x, w, None, [1, 1], [1, 1], [1, 1],
                                                     False, [0, 0], 1, list(mask))
    return factory


def ours_conv2d_backward(part: Any):
    """CudaML.conv2d_backward (part None: grad_input and grad_kernel), or one gradient alone
    through the op module's output_mask, as the peer's mask computes it."""
    def call(c: Any, g: Any, x: Any, w: Any) -> Any:
        cfg = c.ml_module.ConvolutionConfig(kernel_size=(3, 3), padding=(1, 1))
        if part is None:
            return c.ml.conv2d_backward(g, x, w, cfg)
        from ..ops.conv2d_backward import conv2d_backward
        mask = (part == 0, part == 1, False)
        return conv2d_backward(c.ml.math, g, x, w, cfg, output_mask=mask)[part]
    return call


# -- attention gradients (ops/attention_backward.py): (max(1, s / 32), min(16, s^2 / 64), 32 s,
# 128): at s = 128 (4, 16, 4096, 128), at s = 32 (1, 16, 1024, 128); smaller s
# have fewer heads too (s = 8: one), so that quick runs stay quick -----------------------------
def attention_grad_inputs(rng: np.random.Generator, s: int) -> List[np.ndarray]:
    """(upstream gradient, q, k, v), all (max(1, s // 32), min(16, s * s // 64), 32 s, 128)."""
    shape = (max(1, s // 32), min(16, max(1, s * s // 64)), 32 * s, 128)
    return [normal(rng, shape) for _ in range(4)]


def attention_grad_q(causal: bool):
    """grad_q of softmax(q kᵀ / sqrt(d) [causal]) v for the upstream gradient g, the forward
    recomputed, one batch entry and 4 heads at a time (memory 4 x seq x seq per matrix)."""
    def grad(xp: Any, g: Any, q: Any, k: Any, v: Any) -> Any:
        scale = 1.0 / np.sqrt(q.shape[-1])
        out = xp.zeros(q.shape, dtype=q.dtype)
        n = q.shape[2]
        mask = xp.triu(xp.ones((n, k.shape[2]), dtype=bool), 1) if causal else None
        for b in range(q.shape[0]):
            for h in range(0, q.shape[1], 4):
                qs, ks, vs, gs = (t[b, h:h + 4] for t in (q, k, v, g))
                s = (qs @ xp.swapaxes(ks, -1, -2)) * scale
                if causal:
                    s = xp.where(mask, -xp.inf, s)
                p = softmax(xp, s)
                dp = gs @ xp.swapaxes(vs, -1, -2)
                ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
                out[b, h:h + 4] = (ds @ ks) * scale
        return out
    return grad


# the forward's (out, lse) per q of a case, made by its first call (kept until q is collected)
_ATTENTION_SAVED: dict = {}


def ours_attention_backward(causal: bool):
    """CudaML.flash_attention_backward of (g, q, k, v), the forward (flash_attention with
    return_lse) done once outside the timed calls."""
    import weakref

    def call(c: Any, g: Any, q: Any, k: Any, v: Any) -> Any:
        key = (id(q), causal)
        hit = _ATTENTION_SAVED.get(key)
        if hit is None or hit[0]() is not q:
            out, lse = c.ml.flash_attention(q, k, v, causal=causal, return_lse=True)
            hit = _ATTENTION_SAVED[key] = (weakref.ref(q), out, lse)
            weakref.finalize(q, _ATTENTION_SAVED.pop, key, None)   # the pool reclaims them
        return c.ml.flash_attention_backward(g, q, k, v, hit[1], hit[2], causal=causal)
    return call


def torch_attention_backward(causal: bool):
    """PyTorch autograd of F.scaled_dot_product_attention (its flash backward where it
    applies): the gradients of q, k and v, the forward done once outside the timed call."""
    def factory(T: Any, g: Any, q: Any, k: Any, v: Any):
        qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
        y = F(T).scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
        return lambda: T.autograd.grad(y, (qr, kr, vr), g, retain_graph=True)
    return factory


# normalization gradients (ops/normalization_backward.py): inputs, references, PyTorch peers
def norm_grad_rows(rng: np.random.Generator, s: int) -> List[np.ndarray]:
    """(upstream gradient, x, weight) of layer-norm rows s*s/2 x 1024."""
    n = max(s * s // 2, 1)
    return [normal(rng, (n, 1024)), normal(rng, (n, 1024)), between(rng, 0.5, 1.5, 1024)]


def norm_grad_images(running: bool):
    """(upstream gradient, input, gamma[, running mean, running var]) of images' shape."""
    def make(rng: np.random.Generator, s: int) -> List[np.ndarray]:
        out = [normal(rng, (8, 64, s, s)), normal(rng, (8, 64, s, s)),
               between(rng, 0.5, 1.5, 64)]
        if running:
            out += [normal(rng, 64, 0.1), between(rng, 0.5, 2.0, 64)]
        return out
    return make


def layer_norm_grad(xp: Any, g: Any, x: Any, w: Any) -> Any:
    """d layer_norm(x, w, b) / dx times g (eps 1e-5)."""
    d = x - x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / xp.sqrt((d * d).mean(axis=-1, keepdims=True) + 1e-5)
    xhat, gw = d * rstd, g * w
    return rstd * (gw - gw.mean(axis=-1, keepdims=True)
                   - xhat * (gw * xhat).mean(axis=-1, keepdims=True))


def batch_norm_grad(xp: Any, g: Any, x: Any, gamma: Any, mean: Any = None,
                    var: Any = None) -> Any:
    """d batch_norm / d input times g (NCHW, eps 1e-5): batch statistics without mean and
    var (training), else those (inference)."""
    sh, axes = (1, -1, 1, 1), (0, 2, 3)
    training = mean is None
    if training:
        mean, var = x.mean(axis=axes), x.var(axis=axes)
    rstd = (1.0 / xp.sqrt(var + 1e-5)).reshape(sh)
    scale = gamma.reshape(sh) * rstd
    if not training:
        return g * scale
    xhat = (x - mean.reshape(sh)) * rstd
    n = x.size // x.shape[1]
    return scale * (g - g.sum(axis=axes).reshape(sh) / n
                    - xhat * (g * xhat).sum(axis=axes).reshape(sh) / n)


def torch_layer_norm_backward(T: Any, g: Any, x: Any, w: Any):
    """aten.native_layer_norm_backward, the forward (its mean and rstd) done once outside
    the timed call; all three gradients."""
    aten = aten_of(T)
    b = T.zeros_like(w)
    _, mean, rstd = aten.native_layer_norm(x, [x.shape[-1]], w, b, 1e-5)
    return lambda: aten.native_layer_norm_backward(g, x, [x.shape[-1]], mean, rstd, w, b,
                                                   [True, True, True])


def torch_batch_norm_backward(T: Any, g: Any, x: Any, gamma: Any, *running: Any):
    """aten.native_batch_norm_backward, the forward (its saved statistics) done once outside
    the timed call; training without running statistics, inference with them."""
    aten = aten_of(T)
    training = not running
    rm, rv = running if running else (None, None)
    beta = T.zeros_like(gamma)
    _, save_mean, save_invstd = aten.native_batch_norm(
        x, gamma, beta, None if training else rm.clone(), None if training else rv.clone(),
        training, 0.1, 1e-5)
    return lambda: aten.native_batch_norm_backward(g, x, gamma, rm, rv, save_mean, save_invstd,
                                                   training, 1e-5, [True, True, True])
