"""The autograd rules of the layers: linear (and linear + GELU), embedding, layer and batch
norm, conv2d, pooling, dropout, attention and cross-entropy. Each is a `Function`
(autograd_tape) over the fused forward op of CudaML and its `<op>_backward` (README "API");
`nn` builds its modules on them (in the dtype `autocast` asks for, cast before they run).
"""
from __future__ import annotations

from typing import Any, Optional

from .autograd_tape import Function, Tensor, apis
from .tensor import CudaTensor


def _rows(m: Any, x: CudaTensor) -> CudaTensor:
    """x as a 2-D (rows, last dim) view."""
    return x if x.ndim == 2 else m.reshape(x, (-1, x.shape[-1]))


class Linear(Function):
    """y = x Wᵀ + b over x's last axis (x of any rank >= 2); gelu=True: GELU(y) fused
    (fused_linear_gelu, whose backward recomputes x Wᵀ + b rather than saving it)."""

    def forward(self, x: CudaTensor, w: CudaTensor, b: Optional[CudaTensor] = None,
                gelu: bool = False, precision: Optional[str] = None) -> CudaTensor:
        m, ml = apis()
        x2 = _rows(m, x)
        self.save(x2, w, b, gelu, precision, x.shape)
        y = ml.fused_linear_gelu(x2, w, b, precision) if gelu else \
            ml.linear(x2, w, b, precision)
        return y if x.ndim == 2 else m.reshape(y, x.shape[:-1] + (w.shape[0],))

    def backward(self, g: CudaTensor) -> tuple:
        m, ml = apis()
        x2, w, b, gelu, precision, shape = self.saved
        g2 = _rows(m, g)
        if gelu:
            dx, dw, db = ml.fused_linear_gelu_backward(g2, x2, w, b, precision)
        else:
            dx, dw, db = ml.linear_backward(g2, x2, w, b is not None, precision)
        dx = dx if len(shape) == 2 else m.reshape(dx, shape)
        return (dx, dw) if b is None else (dx, dw, db)


def linear(x: Tensor, w: Tensor, b: Optional[Tensor] = None, gelu: bool = False,
           precision: Optional[str] = None) -> Tensor:
    return Linear.apply(x, w, b, gelu, precision)


class Embedding(Function):
    """weight[ids] (take along axis 0); the gradient scatter-adds rows back."""

    def forward(self, w: CudaTensor, ids: CudaTensor, check: bool = True) -> CudaTensor:
        self.save(ids, w.shape, w.dtype)
        return apis()[0].take(w, ids, axis=0, check_bounds=check)

    def backward(self, g: CudaTensor) -> CudaTensor:
        m = apis()[0]
        ids, shape, dtype = self.saved
        dw = m.zeros(shape, dtype, g.device_id)
        return m.scatter_add(dw, ids, g, axis=0, check_bounds=False)


class LayerNorm(Function):
    def forward(self, x: CudaTensor, w: Optional[CudaTensor], b: Optional[CudaTensor],
                eps: float = 1e-5) -> CudaTensor:
        self.save(x, w, b is not None, eps)
        return apis()[1].layer_norm(x, w, b, eps)

    def backward(self, g: CudaTensor) -> tuple:
        x, w, has_b, eps = self.saved
        dx, dw, db = apis()[1].layer_norm_backward(g, x, w, eps)
        return (dx,) + ((dw,) if w is not None else ()) + ((db,) if has_b else ())


class BatchNorm(Function):
    """batch_norm per channel (axis 1); in training it updates the running statistics in
    place, as the forward op does."""

    def forward(self, x: CudaTensor, gamma: CudaTensor, beta: CudaTensor, mean: CudaTensor,
                var: CudaTensor, training: bool, momentum: float, eps: float) -> CudaTensor:
        self.save(x, gamma, eps, training, None if training else mean,
                  None if training else var)
        return apis()[1].batch_norm(x, gamma, beta, mean, var, eps, training, momentum)

    def backward(self, g: CudaTensor) -> tuple:
        x, gamma, eps, training, mean, var = self.saved
        return apis()[1].batch_norm_backward(g, x, gamma, eps, training, mean, var)


class Conv2d(Function):
    def forward(self, x: CudaTensor, w: CudaTensor, b: Optional[CudaTensor], config: Any,
                precision: Optional[str] = None) -> CudaTensor:
        self.save(x, w, b is not None, config, precision)
        return apis()[1].conv2d(x, w, config, b, precision)

    def backward(self, g: CudaTensor) -> tuple:
        x, w, has_b, config, precision = self.saved
        dx, dw, db = apis()[1].conv2d_backward(g, x, w, config, has_b, precision)
        return (dx, dw, db) if has_b else (dx, dw)


class Pool2d(Function):
    def forward(self, x: CudaTensor, kind: str, pool_size: Any, stride: Any = None,
                padding: Any = (0, 0)) -> CudaTensor:
        self.save(x, kind, pool_size, stride, padding)
        ml = apis()[1]
        op = ml.max_pool2d if kind == "max" else ml.avg_pool2d
        return op(x, pool_size, stride, padding)

    def backward(self, g: CudaTensor) -> CudaTensor:
        x, kind, pool_size, stride, padding = self.saved
        ml = apis()[1]
        op = ml.max_pool2d_backward if kind == "max" else ml.avg_pool2d_backward
        return op(g, x, pool_size, stride, padding)


class Dropout(Function):
    """Dropout with a given seed: the backward regenerates the same mask from it."""

    def forward(self, x: CudaTensor, keep_prob: float, seed: int) -> CudaTensor:
        self.save(keep_prob, seed)
        return apis()[1].dropout(x, keep_prob, seed)

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[1].dropout_backward(g, *self.saved)


class Attention(Function):
    """flash_attention over (batch, heads, seq, head_dim); the log-sum-exp rows it returns are
    kept for the backward only (and not computed when nothing is recorded)."""

    def forward(self, q: CudaTensor, k: CudaTensor, v: CudaTensor,
                scale: Optional[float] = None, causal: bool = False) -> CudaTensor:
        ml = apis()[1]
        if not any(self.needs):
            return ml.flash_attention(q, k, v, scale, causal)
        out, lse = ml.flash_attention(q, k, v, scale, causal, return_lse=True)
        self.save(q, k, v, out, lse, scale, causal)
        self.own(lse)
        return out

    def backward(self, g: CudaTensor) -> tuple:
        return apis()[1].flash_attention_backward(g, *self.saved)


def attention(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None,
              causal: bool = False) -> Tensor:
    return Attention.apply(q, k, v, scale, causal)


class PackedAttention(Function):
    """flash_attention_packed: self-attention read from a fused (batch, seq, 3 * dim) q|k|v
    projection and written as (batch, seq, dim), so neither the heads split nor their merge
    is a copy (nor their gradients: the backward writes d(qkv) in the projection's layout)."""

    def forward(self, qkv: CudaTensor, heads: int, scale: Optional[float] = None,
                causal: bool = False) -> CudaTensor:
        ml = apis()[1]
        if not any(self.needs):
            return ml.flash_attention_packed(qkv, heads, scale, causal)
        out, lse = ml.flash_attention_packed(qkv, heads, scale, causal, return_lse=True)
        self.save(qkv, out, lse, heads, scale, causal)
        self.own(lse)
        return out

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[1].flash_attention_packed_backward(g, *self.saved)


def packed_attention(qkv: Tensor, heads: int, scale: Optional[float] = None,
                     causal: bool = False) -> Tensor:
    return PackedAttention.apply(qkv, heads, scale, causal)


class CrossEntropy(Function):
    """The fused cross-entropy of logits (..., C) against labels (...,), mean or sum; the
    forward keeps each row's (max, sum) so that the backward reads the logits once."""

    def forward(self, logits: CudaTensor, labels: CudaTensor, reduction: str = "mean",
                ignore_index: int = -100, check: bool = True) -> CudaTensor:
        m, ml = apis()
        x2 = _rows(m, logits)
        y = labels if labels.ndim == 1 else m.reshape(labels, (-1,))
        if not any(self.needs):
            return ml.cross_entropy(x2, y, reduction, ignore_index, check)
        loss, stats = ml.cross_entropy(x2, y, reduction, ignore_index, check,
                                       return_row_stats=True)
        self.save(x2, y, reduction, ignore_index, logits.shape, stats)
        self.own(stats)
        return loss

    def backward(self, g: CudaTensor) -> CudaTensor:
        m, ml = apis()
        x2, y, reduction, ignore_index, shape, stats = self.saved
        dx = ml.cross_entropy_backward(x2, y, g, reduction, ignore_index, False, stats)
        return dx if len(shape) == 2 else m.reshape(dx, shape)
