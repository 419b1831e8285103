"""`ActivationGradients`, the part of CudaML (cuda_ml.py) that differentiates the activations:
relu_backward ... gelu_backward, each one kernel of ops/activation_backward.py, through the
per-call plan of (op, dtype, device) that the first general call makes. Also the GELU
`approximate` names (`GELU_OPS`) that CudaML.gelu and gelu_backward both accept.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

from .errors import InvalidArgumentError
from .ops import common
from .ops.common import LazyOp
from .tensor import CudaTensor

if TYPE_CHECKING:
    from .cuda_math import CudaMath

# gelu's and gelu_backward's `approximate` -> the elementwise op: "tanh" (the default) or "none"
# (the exact erf form)
GELU_OPS: Dict[str, str] = {"tanh": "gelu", "none": "gelu_exact"}


def approximate_error(approximate: Any) -> InvalidArgumentError:
    """The error of an `approximate` that GELU_OPS does not name."""
    return InvalidArgumentError(f"approximate must be 'tanh' or 'none', got {approximate!r}")


class ActivationGradients:
    """CudaML's activation gradients (a mixin: CudaML holds `math`)."""

    math: CudaMath

    _op_act_backward = LazyOp("activation_backward", "backward")

    def _activation_backward(self, op: str, grad_out: CudaTensor, v: CudaTensor,
                             alpha: Any = None) -> CudaTensor:
        m = self.math
        if type(grad_out) is CudaTensor:
            # the per-call plan of (op, dtype, device), made by a first general call
            key = (op + "_backward", grad_out.dtype, grad_out.device_id)
            res = common.planned(m, key, grad_out, v, alpha)
            if res is not None:
                return res
        return self._op_act_backward(m, op, grad_out, v, alpha)

    def relu_backward(self, grad_out: CudaTensor, x: CudaTensor) -> CudaTensor:
        """d relu(x) / dx * grad_out: grad_out where x > 0, else 0 (0 at x == 0, as
        PyTorch's threshold_backward); x is relu's input."""
        return self._activation_backward("relu", grad_out, x)

    def leaky_relu_backward(self, grad_out: CudaTensor, x: CudaTensor,
                            alpha: Optional[float] = None) -> CudaTensor:
        """grad_out where x > 0, else alpha * grad_out (alpha defaults to 0.01)."""
        return self._activation_backward("leaky_relu", grad_out, x, alpha)

    def elu_backward(self, grad_out: CudaTensor, x: CudaTensor,
                     alpha: Optional[float] = None) -> CudaTensor:
        """grad_out where x > 0, else alpha * exp(x) * grad_out (alpha defaults to 1.0)."""
        return self._activation_backward("elu", grad_out, x, alpha)

    def sigmoid_backward(self, grad_out: CudaTensor, y: CudaTensor) -> CudaTensor:
        """grad_out * y * (1 - y), from sigmoid's output y."""
        return self._activation_backward("sigmoid", grad_out, y)

    def tanh_backward(self, grad_out: CudaTensor, y: CudaTensor) -> CudaTensor:
        """grad_out * (1 - y^2), from tanh's output y."""
        return self._activation_backward("tanh", grad_out, y)

    def gelu_backward(self, grad_out: CudaTensor, x: CudaTensor,
                      approximate: str = "tanh") -> CudaTensor:
        """The exact derivative of gelu(x, approximate) ("tanh" or "none") times grad_out;
        x is gelu's input."""
        try:
            op = GELU_OPS[approximate]
        except (KeyError, TypeError):
            raise approximate_error(approximate) from None
        return self._activation_backward(op, grad_out, x)
