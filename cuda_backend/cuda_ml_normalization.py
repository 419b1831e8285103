"""`NormalizationOps`, the part of CudaML (cuda_ml.py) that normalizes: batch_norm and
layer_norm (ops/normalization.py), their gradients (ops/normalization_backward.py), and
softmax / log_softmax over the last axis (CudaMath's) with their gradients
(ops/softmax_backward.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Optional, Tuple

from .tensor import CudaTensor

if TYPE_CHECKING:
    from .cuda_math import CudaMath


class NormalizationOps:
    """CudaML's normalizations and softmax (a mixin: CudaML holds `math`)."""

    math: CudaMath
    # the ops, bound once on first use by the methods below (absent until then)
    _op_batch_norm: ClassVar[Any]
    _op_layer_norm: ClassVar[Any]
    _op_layer_norm_backward: ClassVar[Any]
    _op_batch_norm_backward: ClassVar[Any]

    # -- normalization --------------------------------------------------------------------
    def batch_norm(self, input: CudaTensor, gamma: CudaTensor, beta: CudaTensor,
                   mean: CudaTensor, var: CudaTensor, eps: float = 1e-5,
                   training: bool = False, momentum: float = 0.1) -> CudaTensor:
        """Batch norm over N(,H,W) per channel. Inference uses mean/var; training=True uses
        the batch statistics and updates mean/var in place (running averages)."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = NormalizationOps._op_batch_norm
        except AttributeError:
            from .ops.normalization import batch_norm as op
            NormalizationOps._op_batch_norm = staticmethod(op)
        return op(self.math, input, gamma, beta, mean, var, eps, training, momentum)

    def layer_norm(self, x: CudaTensor, weight: Optional[CudaTensor],
                   bias: Optional[CudaTensor], eps: float = 1e-5) -> CudaTensor:
        """Layer norm over the last dimension."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = NormalizationOps._op_layer_norm
        except AttributeError:
            from .ops.normalization import layer_norm as op
            NormalizationOps._op_layer_norm = staticmethod(op)
        return op(self.math, x, weight, bias, eps)

    def layer_norm_backward(self, grad_out: CudaTensor, x: CudaTensor,
                            weight: Optional[CudaTensor] = None, eps: float = 1e-5
                            ) -> Tuple[CudaTensor, Optional[CudaTensor], CudaTensor]:
        """(grad_x, grad_weight, grad_bias) of layer_norm(x, weight, bias, eps) for the
        gradient grad_out of its output; the row statistics are recomputed from x.
        grad_weight is None when weight is None; grad_bias (D,) is always returned.
        Deterministic (no atomics)."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = NormalizationOps._op_layer_norm_backward
        except AttributeError:
            from .ops.normalization_backward import layer_norm_backward as op
            NormalizationOps._op_layer_norm_backward = staticmethod(op)
        return op(self.math, grad_out, x, weight, eps)

    def batch_norm_backward(self, grad_out: CudaTensor, input: CudaTensor, gamma: CudaTensor,
                            eps: float = 1e-5, training: bool = True,
                            running_mean: Optional[CudaTensor] = None,
                            running_var: Optional[CudaTensor] = None
                            ) -> Tuple[CudaTensor, CudaTensor, CudaTensor]:
        """(grad_input, grad_gamma, grad_beta) of batch_norm for the gradient grad_out of its
        output, per channel (axis 1): training=True with the batch statistics recomputed
        from input (biased variance), training=False with running_mean and running_var
        (required then). Deterministic (no atomics)."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = NormalizationOps._op_batch_norm_backward
        except AttributeError:
            from .ops.normalization_backward import batch_norm_backward as op
            NormalizationOps._op_batch_norm_backward = staticmethod(op)
        return op(self.math, grad_out, input, gamma, eps, training, running_mean, running_var)

    # -- softmax over the last axis (CudaMath's) and its gradients --------------------------
    def softmax(self, tensor: CudaTensor) -> CudaTensor:
        return self.math.softmax(tensor)

    def log_softmax(self, tensor: CudaTensor) -> CudaTensor:
        return self.math.log_softmax(tensor)

    def softmax_backward(self, grad_out: CudaTensor, y: CudaTensor) -> CudaTensor:
        """The gradient of softmax over the last axis with respect to its input:
        y * (grad_out - sum(grad_out * y, -1)), from softmax's output y."""
        m = self.math
        if type(grad_out) is CudaTensor:
            fast = m.plans.get(("softmax_backward", grad_out.shape, grad_out.dtype,
                                grad_out.device_id, False))
            if fast is not None:
                res = fast(grad_out, y)
                if res is not None:
                    return res
        from .ops import softmax_backward
        return softmax_backward.backward(m, grad_out, y, log=False)

    def log_softmax_backward(self, grad_out: CudaTensor, y: CudaTensor) -> CudaTensor:
        """The gradient of log_softmax over the last axis with respect to its input:
        grad_out - exp(y) * sum(grad_out, -1), from log_softmax's output y."""
        m = self.math
        if type(grad_out) is CudaTensor:
            fast = m.plans.get(("softmax_backward", grad_out.shape, grad_out.dtype,
                                grad_out.device_id, True))
            if fast is not None:
                res = fast(grad_out, y)
                if res is not None:
                    return res
        from .ops import softmax_backward
        return softmax_backward.backward(m, grad_out, y, log=True)
