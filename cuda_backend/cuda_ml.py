"""`CudaML`: neural-network operations and optimizers on the GPU (NumPy in fallback mode).

The methods validate their arguments and hand off to one module per family in
`cuda_backend/ops/` (conv2d, pooling, normalization, dropout, optimizers, attention, linear);
activations are elementwise kernels shared with CudaMath.

This module holds CudaML's argument types (`ActivationType`, `ConvolutionConfig`,
`OptimizerState`) and the ops that take them or `Pair`: conv2d, the activations, pooling. The
other methods come from one mixin per group: cuda_ml_activations.py (activation gradients),
cuda_ml_normalization.py (norms, softmax), cuda_ml_training.py (loss, dropout, optimizer
steps), cuda_ml_linear.py (linear layers, GEMM gradients, attention).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import numpy as np

from .cuda_math import CudaMath, get_cuda_math
from .cuda_ml_activations import GELU_OPS, ActivationGradients, approximate_error
from .cuda_ml_linear import LinearOps
from .cuda_ml_normalization import NormalizationOps
from .cuda_ml_training import TrainingOps
from .errors import InvalidArgumentError
from .process_wide import ProcessWide
from .ops.common import LazyOp
from .tensor import CudaTensor

Pair = Union[int, Tuple[int, int]]


def _pair(value: Pair, name: str, minimum: int) -> Tuple[int, int]:
    from .ops.pooling import pair as strict_pair  # rejects floats and bools, same messages
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
    # a one-element int32 tensor holding the step being taken, read on the device instead of
    # `step` (a CUDA graph of the update then replays later steps; ops/optimizers.py)
    step_count: Optional[CudaTensor] = None


class CudaML(ActivationGradients, NormalizationOps, TrainingOps, LinearOps):
    """Neural-network operations over CudaMath tensors."""

    def __init__(self, math: Optional[CudaMath] = None) -> None:
        self.math = math or get_cuda_math()

    @property
    def backend(self) -> Any:
        return self.math.backend

    # -- convolution ---------------------------------------------------------------------
    _op_conv2d = LazyOp("conv2d", "conv2d")

    def conv2d(self, input: CudaTensor, kernel: CudaTensor, config: ConvolutionConfig,
               bias: Optional[CudaTensor] = None, precision: Optional[str] = None) -> CudaTensor:
        """2-D cross-correlation, NCHW ⊛ KCRS -> NKPQ, with stride/padding/dilation/groups.

        float32 is float32-accurate by default (CUDA cores or 3xTF32 tensor cores, the
        autotuner's pick); precision="ieee" keeps CUDA cores, "tf32" opts into TF32.
        """
        return self._op_conv2d(self.math, input, kernel, config, bias, precision)

    _op_conv2d_backward = LazyOp("conv2d_backward", "conv2d_backward")

    def conv2d_backward(self, grad_out: CudaTensor, input: CudaTensor, kernel: CudaTensor,
                        config: ConvolutionConfig, has_bias: bool = False,
                        precision: Optional[str] = None) -> Any:
        """The gradients of conv2d(input, kernel, config, bias, precision) for grad_out (the
        output's shape): (grad_input, grad_kernel, grad_bias, or None without has_bias),
        every stride/padding/dilation/groups the forward takes. float32 is float32-accurate
        by default (the stride-1 input gradient may use 3xTF32 tensor cores, "ieee" keeps
        CUDA cores); precision="tf32" lets it use TF32 tensor cores."""
        return self._op_conv2d_backward(self.math, grad_out, input, kernel, config, has_bias,
                                        precision)

    # -- activations ----------------------------------------------------------------------
    _op_unary = LazyOp("elementwise", "unary")

    def activation(self, tensor: CudaTensor, activation_type: ActivationType,
                   alpha: Optional[float] = None) -> CudaTensor:
        """Elementwise activation; alpha applies to LEAKY_RELU (0.01) and ELU (1.0)."""
        if type(tensor) is CudaTensor and (alpha is None or type(alpha) is float) and \
                type(activation_type) is ActivationType:
            # the common call: elementwise.unary()'s plan, looked up here (as gelu() does);
            # LEAKY_RELU and ELU pass alpha (a float) to it as a launch argument
            op = activation_type._value_
            plan = self.math.ew_unary_plans.get((op, tensor.dtype._name_, tensor.device_id))
            if plan is not None:
                if activation_type is ActivationType.LEAKY_RELU:
                    res = plan(tensor, 0.01 if alpha is None else alpha)
                elif activation_type is ActivationType.ELU:
                    res = plan(tensor, 1.0 if alpha is None else alpha)
                else:
                    res = plan(tensor)
                if res is not None:
                    return res
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
        return self._op_unary(self.math, activation_type._value_, tensor, **params)

    def gelu(self, tensor: CudaTensor, approximate: str = "tanh") -> CudaTensor:
        """GELU; approximate="tanh" (default) or "none" for the exact erf form."""
        try:
            op = GELU_OPS[approximate]
        except (KeyError, TypeError):
            raise approximate_error(approximate) from None
        m = self.math
        if type(tensor) is CudaTensor:
            # the common call: elementwise.unary()'s plan, looked up here (as
            # CudaMath.vector_add does add's): no activation() layer, no Enum .value
            plan = m.ew_unary_plans.get((op, tensor.dtype._name_, tensor.device_id))
            if plan is not None:
                res = plan(tensor)
                if res is not None:
                    return res
        return self._op_unary(m, op, tensor)

    # -- pooling ------------------------------------------------------------------------
    _op_pool2d = LazyOp("pooling", "pool2d")

    def max_pool2d(self, tensor: CudaTensor, pool_size: Pair, stride: Optional[Pair] = None,
                   padding: Pair = (0, 0)) -> CudaTensor:
        """Max over windows of an NCHW tensor (stride defaults to pool_size)."""
        return self._op_pool2d(self.math, "max", tensor, pool_size, stride, padding)

    def avg_pool2d(self, tensor: CudaTensor, pool_size: Pair, stride: Optional[Pair] = None,
                   padding: Pair = (0, 0)) -> CudaTensor:
        """Mean over windows (padding counted in the divisor, as PyTorch's default)."""
        return self._op_pool2d(self.math, "avg", tensor, pool_size, stride, padding)

    _op_pool2d_backward = LazyOp("pooling_backward", "pool2d_backward")

    def max_pool2d_backward(self, grad_out: CudaTensor, input: CudaTensor, pool_size: Pair,
                            stride: Optional[Pair] = None,
                            padding: Pair = (0, 0)) -> CudaTensor:
        """d max_pool2d(input, ...) / d input times grad_out: each window's gradient goes to
        the element the forward picked (first maximum, last NaN, as PyTorch's indices);
        input is the forward's, grad_out of its output shape. Deterministic (no atomics)."""
        return self._op_pool2d_backward(self.math, "max", grad_out, input, pool_size, stride,
                                        padding)

    def avg_pool2d_backward(self, grad_out: CudaTensor, input: CudaTensor, pool_size: Pair,
                            stride: Optional[Pair] = None,
                            padding: Pair = (0, 0)) -> CudaTensor:
        """d avg_pool2d(input, ...) / d input times grad_out: grad_out / (kh * kw) to every
        element of each window (padding counted, as the forward); input gives the shape,
        dtype and device only."""
        return self._op_pool2d_backward(self.math, "avg", grad_out, input, pool_size, stride,
                                        padding)


_ml = ProcessWide(lambda: CudaML(get_cuda_math()))


def get_cuda_ml() -> CudaML:
    """The CudaML instance for the process-wide backend."""
    return _ml.get()
