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
        idx = _aten(T).max_pool2d_with_indices(x, *win)[1]
        return lambda: _aten(T).max_pool2d_with_indices_backward(g, x, *win, idx)
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
    return lambda: _aten(T).native_dropout_backward(g, keep, 2.0)


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
        y = _F(T).linear(xr, wr, br)
        if gelu:
            y = _F(T).gelu(y, approximate="tanh")
        return lambda: T.autograd.grad(y, (xr, wr, br), g, retain_graph=True)
    return factory


def torch_matmul_backward(T: Any, g: Any, a: Any, b: Any):
    """PyTorch autograd of torch.matmul: the gradients of a and b (two GEMMs), the forward
    done once outside the timed call."""
    ar, br = a.detach().requires_grad_(True), b.detach().requires_grad_(True)
    y = T.matmul(ar, br)
    return lambda: T.autograd.grad(y, (ar, br), g, retain_graph=True)


# (variant, rows, min_size): the layer-sized cases from s = 32 on (the quick run's s = 16
# keeps the batch-32 ones: in fallback mode the others and their references take seconds)
GRAD_SHAPES = (("rows 32s", lambda s: 32 * s, 32), ("batch 32", 32, 0))


def _gemms(n: int):
    """n GEMMs of the layer's size (rows x in x out, from the shapes of g and x)."""
    return lambda sh: 2.0 * n * sh[0][0] * sh[0][1] * sh[1][1]


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
        return lambda: _aten(T).convolution_backward(g, x, w, None, [1, 1], [1, 1], [1, 1],
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


def _conv_flops(n: int):
    """n convolutions' worth: 2 * N * K * C * 9 * H * W from the input and filter shapes."""
    return lambda sh: 2.0 * n * np.prod(sh[1]) * sh[2][0] * 9


# -- attention gradients (ops/attention_backward.py): (max(1, s / 32), min(16, s^2 / 64), 32 s,
# 128): at s = 128 the (4, 16, 4096, 128), at s = 32 (1, 16, 1024, 128); smaller s
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
                p = _softmax(xp, s)
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
        y = _F(T).scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
        return lambda: T.autograd.grad(y, (qr, kr, vr), g, retain_graph=True)
    return factory


def _attention_grad_flops(causal: bool):
    """5 GEMMs of 2 B H T^2 D (S recomputed, dP, dV, dK, dQ): 10 B H T^2 D, 2.5x the forward's
    4 B H T^2 D; half of it causal."""
    return lambda sh: (5.0 if causal else 10.0) * sh[0][0] * sh[0][1] * sh[0][2] ** 2 * sh[0][3]



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
    aten = _aten(T)
    b = T.zeros_like(w)
    _, mean, rstd = aten.native_layer_norm(x, [x.shape[-1]], w, b, 1e-5)
    return lambda: aten.native_layer_norm_backward(g, x, [x.shape[-1]], mean, rstd, w, b,
                                                   [True, True, True])


def torch_batch_norm_backward(T: Any, g: Any, x: Any, gamma: Any, *running: Any):
    """aten.native_batch_norm_backward, the forward (its saved statistics) done once outside
    the timed call; training without running statistics, inference with them."""
    aten = _aten(T)
    training = not running
    rm, rv = running if running else (None, None)
    beta = T.zeros_like(gamma)
    _, save_mean, save_invstd = aten.native_batch_norm(
        x, gamma, beta, None if training else rm.clone(), None if training else rv.clone(),
        training, 0.1, 1e-5)
    return lambda: aten.native_batch_norm_backward(g, x, gamma, rm, rv, save_mean, save_invstd,
                                                   training, 1e-5, [True, True, True])

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
    OpDef("linear", ML, linear, lambda c, x, w, b: c.ml.linear(x, w, b),
          cpu=lambda xp, x, w, b: x @ w.T + b, torch=lambda T, x, w, b: _F(T).linear(x, w, b),
          api="CudaML", flops=lambda sh: 2.0 * sh[0][0] * sh[0][1] * sh[1][0]),
    # GEMM gradients: the report checks the first result (grad_x / grad_a); flops count the
    # GEMMs run (fused: the recompute too, three where PyTorch runs two)
    *[OpDef("linear_backward", ML, layer_grad_inputs(rows),
            lambda c, g, x, w: c.ml.linear_backward(g, x, w), cpu=linear_grads,
            torch_factory=torch_layer_backward(False), api="CudaML", variant=variant,
            cupy=False, dtypes=TENSOR, flops=_gemms(2), min_size=min_size)
      for variant, rows, min_size in GRAD_SHAPES],
    *[OpDef("fused_linear_gelu_backward", ML, layer_grad_inputs(rows, bias=True),
            lambda c, g, x, w, b: c.ml.fused_linear_gelu_backward(g, x, w, b),
            cpu=fused_linear_gelu_grads, torch_factory=torch_layer_backward(True),
            api="CudaML", variant=variant, cupy=False, dtypes=TENSOR, flops=_gemms(3),
            min_size=min_size)
      for variant, rows, min_size in GRAD_SHAPES],
    *[OpDef("matmul_backward", ML, matmul_grad_inputs(rows),
            lambda c, g, a, b: c.ml.matmul_backward(g, a, b),
            cpu=lambda xp, g, a, b: (g @ b.T, a.T @ g), torch_factory=torch_matmul_backward,
            api="CudaML", variant=variant, cupy=False, dtypes=TENSOR, flops=_gemms(2),
            min_size=min_size)
      for variant, rows, min_size in GRAD_SHAPES],
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
    OpDef("max_pool2d_backward", ML, pool_grad_inputs(2, 2, 0),
          lambda c, g, x: c.ml.max_pool2d_backward(g, x, 2), cpu=pool_grad("max", 2, 2, 0),
          torch_factory=torch_max_pool2d_backward(2, 2, 0), api="CudaML", variant="2x2",
          cupy=False, dtypes=TENSOR, flops=per_element(1)),
    OpDef("max_pool2d_backward", ML, pool_grad_inputs(3, 2, 1),
          lambda c, g, x: c.ml.max_pool2d_backward(g, x, 3, 2, 1),
          cpu=pool_grad("max", 3, 2, 1), torch_factory=torch_max_pool2d_backward(3, 2, 1),
          api="CudaML", variant="3x3 s2 p1", cupy=False, flops=per_element(3)),
    # avg reads g only (x gives the shape): bytes = g + dx = in_bytes
    OpDef("avg_pool2d_backward", ML, pool_grad_inputs(2, 2, 0),
          lambda c, g, x: c.ml.avg_pool2d_backward(g, x, 2), cpu=pool_grad("avg", 2, 2, 0),
          torch=lambda T, g, x: _aten(T).avg_pool2d_backward(g, x, [2, 2], [2, 2], [0, 0],
                                                             False, True, None),
          api="CudaML", variant="2x2", cupy=False, dtypes=TENSOR, bytes_fn=lambda i, o: i,
          flops=per_element(1)),
    # ours reads g and writes dx (the mask input is the peers'): bytes = 2 * out
    OpDef("dropout_backward", ML, dropout_grad_inputs,
          lambda c, g, mask: c.ml.dropout_backward(g, 0.5, 1234),
          cpu=lambda xp, g, mask: g * mask * 2.0, torch_factory=torch_dropout_backward,
          api="CudaML", variant="keep 0.5", cupy=False, dtypes=TENSOR,
          bytes_fn=lambda i, o: 2 * o, flops=per_element(1)),
    # conv2d gradients: the report checks the first result (grad_input, grad_kernel alone)
    OpDef("conv2d_backward", ML, conv_grad_inputs, ours_conv2d_backward(None),
          cpu=lambda xp, g, x, w: (conv2d_dgrad_nchw(xp, g, x, w),
                                   conv2d_wgrad_nchw(xp, g, x, w)),
          torch_factory=torch_conv2d_backward((True, True, False)), api="CudaML",
          variant="3x3 pad 1", cupy=False, dtypes=TENSOR, flops=_conv_flops(2)),
    OpDef("conv2d_backward", ML, conv_grad_inputs, ours_conv2d_backward(0),
          cpu=conv2d_dgrad_nchw, torch_factory=torch_conv2d_backward((True, False, False)),
          api="CudaML", variant="dgrad 3x3 pad 1", cupy=False, flops=_conv_flops(1)),
    OpDef("conv2d_backward", ML, conv_grad_inputs, ours_conv2d_backward(1),
          cpu=conv2d_wgrad_nchw, torch_factory=torch_conv2d_backward((False, True, False)),
          api="CudaML", variant="wgrad 3x3 pad 1", cupy=False, flops=_conv_flops(1)),
    # attention gradients: the report checks the first result, grad_q
    OpDef("flash_attention_backward", ML, attention_grad_inputs, ours_attention_backward(False),
          cpu=attention_grad_q(False), torch_factory=torch_attention_backward(False),
          api="CudaML", cupy=False, dtypes=TENSOR, compute_unit="tensor",
          flops=_attention_grad_flops(False)),
    OpDef("flash_attention_backward", ML, attention_grad_inputs, ours_attention_backward(True),
          cpu=attention_grad_q(True), torch_factory=torch_attention_backward(True),
          api="CudaML", variant="causal", cupy=False, dtypes=TENSOR, compute_unit="tensor",
          flops=_attention_grad_flops(True)),
    # normalization gradients: the report checks the first result (grad_x / grad_input);
    # bytes = inputs + outputs (x, grad_out, grad_x and the parameters), the floor's
    OpDef("layer_norm_backward", ML, norm_grad_rows,
          lambda c, g, x, w: c.ml.layer_norm_backward(g, x, w), cpu=layer_norm_grad,
          torch_factory=torch_layer_norm_backward, api="CudaML", dtypes=TENSOR,
          flops=per_element(12)),
    OpDef("batch_norm_backward", ML, norm_grad_images(False),
          lambda c, g, x, gamma: c.ml.batch_norm_backward(g, x, gamma),
          cpu=batch_norm_grad, torch_factory=torch_batch_norm_backward, api="CudaML",
          variant="training", dtypes=TENSOR, flops=per_element(12)),
    OpDef("batch_norm_backward", ML, norm_grad_images(True),
          lambda c, g, x, gamma, rm, rv: c.ml.batch_norm_backward(
              g, x, gamma, training=False, running_mean=rm, running_var=rv),
          cpu=batch_norm_grad, torch_factory=torch_batch_norm_backward, api="CudaML",
          variant="inference", flops=per_element(4)),
]
