"""`NormalizationOps`, the part of CudaML (cuda_ml.py) that normalizes: batch_norm and
layer_norm (ops/normalization.py), their gradients (ops/normalization_backward.py), and
softmax / log_softmax over the last axis (CudaMath's) with their gradients
(ops/softmax_backward.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Tuple

from .ops import common
from .ops.common import LazyOp, named_method
from .tensor import CudaTensor

if TYPE_CHECKING:
    from .cuda_math import CudaMath


def _softmax_gradient(name: str, log: bool, doc: str
                      ) -> Callable[[NormalizationOps, CudaTensor, CudaTensor], CudaTensor]:
    """NormalizationOps.<name>: softmax_backward (log=False) or log_softmax_backward
    (log=True), through the per-call plan ops/softmax_backward.py made for (shape, dtype,
    device, log), else its general path."""
    def method(self: NormalizationOps, grad_out: CudaTensor, y: CudaTensor) -> CudaTensor:
        m = self.math
        if type(grad_out) is CudaTensor:
            key = ("softmax_backward", grad_out.shape, grad_out.dtype, grad_out.device_id, log)
            res = common.planned(m, key, grad_out, y)
            if res is not None:
                return res
        from .ops import softmax_backward
        return softmax_backward.backward(m, grad_out, y, log=log)
    return named_method(method, "NormalizationOps", name, doc)


class NormalizationOps:
    """CudaML's normalizations and softmax (a mixin: CudaML holds `math`)."""

    math: CudaMath

    # -- normalization --------------------------------------------------------------------
    _op_batch_norm = LazyOp("normalization", "batch_norm")

    def batch_norm(self, input: CudaTensor, gamma: CudaTensor, beta: CudaTensor,
                   mean: CudaTensor, var: CudaTensor, eps: float = 1e-5,
                   training: bool = False, momentum: float = 0.1) -> CudaTensor:
        """Batch norm over N(,H,W) per channel. Inference uses mean/var; training=True uses
        the batch statistics and updates mean/var in place (running averages)."""
        return self._op_batch_norm(self.math, input, gamma, beta, mean, var, eps, training,
                                   momentum)

    _op_layer_norm = LazyOp("normalization", "layer_norm")

    def layer_norm(self, x: CudaTensor, weight: Optional[CudaTensor],
                   bias: Optional[CudaTensor], eps: float = 1e-5) -> CudaTensor:
        """Layer norm over the last dimension."""
        return self._op_layer_norm(self.math, x, weight, bias, eps)

    _op_layer_norm_backward = LazyOp("normalization_backward", "layer_norm_backward")

    def layer_norm_backward(self, grad_out: CudaTensor, x: CudaTensor,
                            weight: Optional[CudaTensor] = None, eps: float = 1e-5
                            ) -> Tuple[CudaTensor, Optional[CudaTensor], CudaTensor]:
        """(grad_x, grad_weight, grad_bias) of layer_norm(x, weight, bias, eps) for the
        gradient grad_out of its output; the row statistics are recomputed from x.
        grad_weight is None when weight is None; grad_bias (D,) is always returned.
        Deterministic (no atomics)."""
        return self._op_layer_norm_backward(self.math, grad_out, x, weight, eps)

    _op_batch_norm_backward = LazyOp("normalization_backward", "batch_norm_backward")

    def batch_norm_backward(self, grad_out: CudaTensor, input: CudaTensor, gamma: CudaTensor,
                            eps: float = 1e-5, training: bool = True,
                            running_mean: Optional[CudaTensor] = None,
                            running_var: Optional[CudaTensor] = None
                            ) -> Tuple[CudaTensor, CudaTensor, CudaTensor]:
        """(grad_input, grad_gamma, grad_beta) of batch_norm for the gradient grad_out of its
        output, per channel (axis 1): training=True with the batch statistics recomputed
        from input (biased variance), training=False with running_mean and running_var
        (required then). Deterministic (no atomics)."""
        return self._op_batch_norm_backward(self.math, grad_out, input, gamma, eps, training,
                                            running_mean, running_var)

    # -- softmax over the last axis (CudaMath's) and its gradients --------------------------
    def softmax(self, tensor: CudaTensor) -> CudaTensor:
        return self.math.softmax(tensor)

    def log_softmax(self, tensor: CudaTensor) -> CudaTensor:
        return self.math.log_softmax(tensor)

    softmax_backward = _softmax_gradient(
        "softmax_backward", False,
        "The gradient of softmax over the last axis with respect to its input:\n"
        "y * (grad_out - sum(grad_out * y, -1)), from softmax's output y.")
    log_softmax_backward = _softmax_gradient(
        "log_softmax_backward", True,
        "The gradient of log_softmax over the last axis with respect to its input:\n"
        "grad_out - exp(y) * sum(grad_out, -1), from log_softmax's output y.")
