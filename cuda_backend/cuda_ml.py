"""`CudaML`: neural-network operations and optimizers on the GPU (NumPy in fallback mode).

The methods validate their arguments and hand off to one module per family in
`cuda_backend/ops/` (conv2d, pooling, normalization, dropout, optimizers, attention, linear);
activations are elementwise kernels shared with CudaMath.
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import numpy as np

from .cuda_math import CudaMath, get_cuda_math
from .errors import InvalidArgumentError
from .tensor import CudaTensor

Pair = Union[int, Tuple[int, int]]


def _pair(value: Pair, name: str, minimum: int) -> Tuple[int, int]:
    from .ops.pooling import _pair as strict_pair  # rejects floats and bools, same messages
    return strict_pair(value, name, minimum)


class ActivationType(enum.Enum):
    """Activations `CudaML.activation` applies elementwise."""

    RELU = "relu"
    SIGMOID = "sigmoid"
    TANH = "tanh"
    GELU = "gelu"              # tanh approximation
    GELU_EXACT = "gelu_exact"  # 0.5 x (1 + erf(x / sqrt 2))
    LEAKY_RELU = "leaky_relu"  # alpha (default 0.01)
    ELU = "elu"                # alpha (default 1.0)
    SILU = "silu"


@dataclass(frozen=True)
class ConvolutionConfig:
    """conv2d geometry (NCHW input, KCRS filters); ints are expanded to pairs."""

    kernel_size: Pair
    stride: Pair = (1, 1)
    padding: Pair = (0, 0)
    dilation: Pair = (1, 1)
    groups: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel_size", _pair(self.kernel_size, "kernel_size", 1))
        object.__setattr__(self, "stride", _pair(self.stride, "stride", 1))
        object.__setattr__(self, "padding", _pair(self.padding, "padding", 0))
        object.__setattr__(self, "dilation", _pair(self.dilation, "dilation", 1))
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 1:
            raise InvalidArgumentError(f"groups must be an int >= 1, got {self.groups!r}")


@dataclass
class OptimizerState:
    """Hyper-parameters and the step counter shared by sgd_update and adam_update."""

    learning_rate: float
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    weight_decay: float = 0.0
    step: int = 0
    nesterov: bool = False
    decoupled: bool = False  # AdamW: weight decay applied to the weights, not the gradient


class CudaML:
    """Neural-network operations over CudaMath tensors."""

    def __init__(self, math: Optional[CudaMath] = None) -> None:
        self.math = math or get_cuda_math()

    @property
    def backend(self) -> Any:
        return self.math.backend

    # -- convolution ---------------------------------------------------------------------
    def conv2d(self, input: CudaTensor, kernel: CudaTensor, config: ConvolutionConfig,
               bias: Optional[CudaTensor] = None, precision: Optional[str] = None) -> CudaTensor:
        """2-D cross-correlation, NCHW ⊛ KCRS -> NKPQ, with stride/padding/dilation/groups.

        float32 is true FP32 by default; precision="tf32" opts into TF32 tensor cores.
        """
        from .ops import conv2d
        return conv2d.conv2d(self.math, input, kernel, config, bias, precision)

    # -- activations ----------------------------------------------------------------------
    def activation(self, tensor: CudaTensor, activation_type: ActivationType,
                   alpha: Optional[float] = None) -> CudaTensor:
        """Elementwise activation; alpha applies to LEAKY_RELU (0.01) and ELU (1.0)."""
        from .ops import elementwise
        if not isinstance(activation_type, ActivationType):
            raise InvalidArgumentError(
                f"activation_type must be an ActivationType, got {activation_type!r}")
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(
                alpha, (int, float, np.integer, np.floating))):
            raise InvalidArgumentError(f"alpha must be a real number or None, got {alpha!r}")
        params = {}
        if activation_type is ActivationType.LEAKY_RELU:
            params["alpha"] = 0.01 if alpha is None else float(alpha)
        elif activation_type is ActivationType.ELU:
            params["alpha"] = 1.0 if alpha is None else float(alpha)
        return elementwise.unary(self.math, activation_type.value, tensor, **params)

    def gelu(self, tensor: CudaTensor, approximate: str = "tanh") -> CudaTensor:
        """GELU; approximate="tanh" (default) or "none" for the exact erf form."""
        if approximate not in ("tanh", "none"):
            raise InvalidArgumentError(
                f"approximate must be 'tanh' or 'none', got {approximate!r}")
        kind = ActivationType.GELU if approximate == "tanh" else ActivationType.GELU_EXACT
        return self.activation(tensor, kind)

    # -- pooling ------------------------------------------------------------------------
    def max_pool2d(self, tensor: CudaTensor, pool_size: Pair, stride: Optional[Pair] = None,
                   padding: Pair = (0, 0)) -> CudaTensor:
        """Max over windows of an NCHW tensor (stride defaults to pool_size)."""
        from .ops import pooling
        return pooling.pool2d(self.math, "max", tensor, pool_size, stride, padding)

    def avg_pool2d(self, tensor: CudaTensor, pool_size: Pair, stride: Optional[Pair] = None,
                   padding: Pair = (0, 0)) -> CudaTensor:
        """Mean over windows (padding counted in the divisor, as PyTorch's default)."""
        from .ops import pooling
        return pooling.pool2d(self.math, "avg", tensor, pool_size, stride, padding)

    # -- normalization --------------------------------------------------------------------
    def batch_norm(self, input: CudaTensor, gamma: CudaTensor, beta: CudaTensor,
                   mean: CudaTensor, var: CudaTensor, eps: float = 1e-5,
                   training: bool = False, momentum: float = 0.1) -> CudaTensor:
        """Batch norm over N(,H,W) per channel. Inference uses mean/var; training=True uses
        the batch statistics and updates mean/var in place (running averages)."""
        from .ops import normalization
        return normalization.batch_norm(self.math, input, gamma, beta, mean, var, eps,
                                        training, momentum)

    def layer_norm(self, x: CudaTensor, weight: Optional[CudaTensor],
                   bias: Optional[CudaTensor], eps: float = 1e-5) -> CudaTensor:
        """Layer norm over the last dimension."""
        from .ops import normalization
        return normalization.layer_norm(self.math, x, weight, bias, eps)

    def softmax(self, tensor: CudaTensor) -> CudaTensor:
        return self.math.softmax(tensor)

    def log_softmax(self, tensor: CudaTensor) -> CudaTensor:
        return self.math.log_softmax(tensor)

    # -- regularization -------------------------------------------------------------------
    def dropout(self, tensor: CudaTensor, keep_prob: float = 0.5, seed: Optional[int] = None,
                return_mask: bool = False) -> Any:
        """Zero each element with probability 1-keep_prob and scale the rest by 1/keep_prob.

        Counter-based RNG: the same seed gives the same mask. Returns the output, or
        (output, mask) with return_mask=True (mask is uint8).
        """
        from .ops import dropout
        return dropout.dropout(self.math, tensor, keep_prob, seed, return_mask)

    # -- optimizers -----------------------------------------------------------------------
    def sgd_update(self, params: CudaTensor, gradients: CudaTensor,
                   momentum: Optional[CudaTensor], optimizer_state: OptimizerState) -> None:
        """One fused SGD step in place (momentum buffer optional; Nesterov and weight decay)."""
        from .ops import optimizers
        optimizers.sgd_update(self.math, params, gradients, momentum, optimizer_state)

    def adam_update(self, params: CudaTensor, gradients: CudaTensor, m_buffer: CudaTensor,
                    v_buffer: CudaTensor, optimizer_state: OptimizerState) -> None:
        """One fused Adam/AdamW step in place, with bias correction; advances state.step."""
        from .ops import optimizers
        optimizers.adam_update(self.math, params, gradients, m_buffer, v_buffer,
                               optimizer_state)

    # -- layers ---------------------------------------------------------------------------
    def fused_linear_gelu(self, x: CudaTensor, weight: CudaTensor,
                          bias: Optional[CudaTensor] = None,
                          precision: Optional[str] = None) -> CudaTensor:
        """GELU(x Wᵀ + b) in one kernel; weight is (out_features, in_features). float32 is
        float32-accurate (3xTF32 on tensor cores where faster, else CUDA cores);
        precision="ieee" keeps CUDA cores, precision="tf32" uses TF32."""
        from .ops import linear
        return linear.fused_linear_gelu(self.math, x, weight, bias, precision)

    def flash_attention(self, q: CudaTensor, k: CudaTensor, v: CudaTensor,
                        scale: Optional[float] = None, causal: bool = False) -> CudaTensor:
        """softmax(q kᵀ · scale) v for (batch, heads, seq, head_dim), never forming seq×seq."""
        from .ops import attention
        return attention.flash_attention(self.math, q, k, v, scale, causal)

    def sketched_linear(self, x: CudaTensor, U: CudaTensor, V: CudaTensor,
                        bias: Optional[CudaTensor] = None) -> CudaTensor:
        """y = (1/num_terms) Σᵢ (x Uᵢ) Vᵢ + b, U (terms, in, rank), V (terms, rank, out)."""
        from .ops import linear
        return linear.sketched_linear(self.math, x, U, V, bias)

    def sketched_linear_params(self, in_features: int, out_features: int, num_terms: int,
                               low_rank: int, dtype: Any = "float32",
                               seed: Optional[int] = None) -> Tuple[CudaTensor, CudaTensor]:
        """Draw U, V as the seed's SKLinear(in_features, out_features, num_terms, low_rank)."""
        from .ops import linear
        return linear.sketched_linear_params(self.math, in_features, out_features, num_terms,
                                             low_rank, dtype, seed)


_ml: Optional[CudaML] = None
_ml_lock = threading.Lock()


def get_cuda_ml() -> CudaML:
    """The CudaML instance for the process-wide backend."""
    global _ml
    if _ml is None:
        with _ml_lock:
            if _ml is None:
                _ml = CudaML(get_cuda_math())
    return _ml
