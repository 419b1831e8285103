"""`CudaML`: neural-network operations and optimizers on the GPU (NumPy in fallback mode).

The methods validate their arguments and hand off to one module per family in
`cuda_backend/ops/` (conv2d, pooling, normalization, dropout, optimizers, attention, linear);
activations are elementwise kernels shared with CudaMath.
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Tuple, Union

import numpy as np

from .cuda_math import CudaMath, get_cuda_math
from .errors import InvalidArgumentError
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


class CudaML:
    """Neural-network operations over CudaMath tensors."""

    # the ops, bound once on first use by the methods below (absent until then)
    _op_conv2d: ClassVar[Any]
    _op_conv2d_backward: ClassVar[Any]
    _op_unary: ClassVar[Any]
    _op_act_backward: ClassVar[Any]
    _op_pool2d: ClassVar[Any]
    _op_pool2d_backward: ClassVar[Any]
    _op_batch_norm: ClassVar[Any]
    _op_layer_norm: ClassVar[Any]
    _op_layer_norm_backward: ClassVar[Any]
    _op_batch_norm_backward: ClassVar[Any]
    _op_cross_entropy: ClassVar[Any]
    _op_cross_entropy_backward: ClassVar[Any]
    _op_dropout: ClassVar[Any]
    _op_dropout_backward: ClassVar[Any]
    _op_sgd_update: ClassVar[Any]
    _op_adam_update: ClassVar[Any]
    _op_linear: ClassVar[Any]
    _op_linear_backward: ClassVar[Any]
    _op_fused_linear_gelu_backward: ClassVar[Any]
    _op_matmul_backward: ClassVar[Any]
    _op_flash_attention: ClassVar[Any]
    _op_flash_attention_backward: ClassVar[Any]

    def __init__(self, math: Optional[CudaMath] = None) -> None:
        self.math = math or get_cuda_math()

    @property
    def backend(self) -> Any:
        return self.math.backend

    # -- convolution ---------------------------------------------------------------------
    def conv2d(self, input: CudaTensor, kernel: CudaTensor, config: ConvolutionConfig,
               bias: Optional[CudaTensor] = None, precision: Optional[str] = None) -> CudaTensor:
        """2-D cross-correlation, NCHW ⊛ KCRS -> NKPQ, with stride/padding/dilation/groups.

        float32 is float32-accurate by default (CUDA cores or 3xTF32 tensor cores, the
        autotuner's pick); precision="ieee" keeps CUDA cores, "tf32" opts into TF32.
        """
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_conv2d
        except AttributeError:
            from .ops.conv2d import conv2d as op
            CudaML._op_conv2d = staticmethod(op)
        return op(self.math, input, kernel, config, bias, precision)

    def conv2d_backward(self, grad_out: CudaTensor, input: CudaTensor, kernel: CudaTensor,
                        config: ConvolutionConfig, has_bias: bool = False,
                        precision: Optional[str] = None) -> Any:
        """The gradients of conv2d(input, kernel, config, bias, precision) for grad_out (the
        output's shape): (grad_input, grad_kernel, grad_bias, or None without has_bias),
        every stride/padding/dilation/groups the forward takes. float32 is float32-accurate
        by default (the stride-1 input gradient may use 3xTF32 tensor cores, "ieee" keeps
        CUDA cores); precision="tf32" lets it use TF32 tensor cores."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_conv2d_backward
        except AttributeError:
            from .ops.conv2d_backward import conv2d_backward as op
            CudaML._op_conv2d_backward = staticmethod(op)
        return op(self.math, grad_out, input, kernel, config, has_bias, precision)

    # -- activations ----------------------------------------------------------------------
    def activation(self, tensor: CudaTensor, activation_type: ActivationType,
                   alpha: Optional[float] = None) -> CudaTensor:
        """Elementwise activation; alpha applies to LEAKY_RELU (0.01) and ELU (1.0)."""
        if type(tensor) is CudaTensor and (alpha is None or type(alpha) is float) and \
                type(activation_type) is ActivationType:
            # the common call: elementwise.unary()'s plan, looked up here (as gelu() does);
            # LEAKY_RELU and ELU pass alpha (a float) to it as a launch argument
            op = activation_type._value_
            plan = self.math._ew_unary_plans.get((op, tensor.dtype._name_, tensor.device_id))
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
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            unary = CudaML._op_unary
        except AttributeError:
            from .ops.elementwise import unary
            CudaML._op_unary = staticmethod(unary)
        return unary(self.math, activation_type._value_, tensor, **params)

    def gelu(self, tensor: CudaTensor, approximate: str = "tanh") -> CudaTensor:
        """GELU; approximate="tanh" (default) or "none" for the exact erf form."""
        if approximate == "tanh":
            op = "gelu"
        elif approximate == "none":
            op = "gelu_exact"
        else:
            raise InvalidArgumentError(
                f"approximate must be 'tanh' or 'none', got {approximate!r}")
        m = self.math
        if type(tensor) is CudaTensor:
            # the common call: elementwise.unary()'s plan, looked up here (as
            # CudaMath.vector_add does add's): no activation() layer, no Enum .value
            plan = m._ew_unary_plans.get((op, tensor.dtype._name_, tensor.device_id))
            if plan is not None:
                res = plan(tensor)
                if res is not None:
                    return res
        try:
            unary = CudaML._op_unary
        except AttributeError:
            from .ops.elementwise import unary
            CudaML._op_unary = staticmethod(unary)
        return unary(m, op, tensor)

    # -- activation gradients (ops/activation_backward.py) ---------------------------------
    def _activation_backward(self, op: str, grad_out: CudaTensor, v: CudaTensor,
                             alpha: Any = None) -> CudaTensor:
        m = self.math
        if type(grad_out) is CudaTensor:
            # the per-call plan of (op, dtype, device), made by a first general call
            plan = m.plans.get((op + "_backward", grad_out.dtype, grad_out.device_id))
            if plan is not None:
                res = plan(grad_out, v, alpha)
                if res is not None:
                    return res
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op_fn = CudaML._op_act_backward
        except AttributeError:
            from .ops.activation_backward import backward as op_fn
            CudaML._op_act_backward = staticmethod(op_fn)
        return op_fn(m, op, grad_out, v, alpha)

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
        if approximate == "tanh":
            op = "gelu"
        elif approximate == "none":
            op = "gelu_exact"
        else:
            raise InvalidArgumentError(
                f"approximate must be 'tanh' or 'none', got {approximate!r}")
        return self._activation_backward(op, grad_out, x)

    # -- pooling ------------------------------------------------------------------------
    def max_pool2d(self, tensor: CudaTensor, pool_size: Pair, stride: Optional[Pair] = None,
                   padding: Pair = (0, 0)) -> CudaTensor:
        """Max over windows of an NCHW tensor (stride defaults to pool_size)."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_pool2d
        except AttributeError:
            from .ops.pooling import pool2d as op
            CudaML._op_pool2d = staticmethod(op)
        return op(self.math, "max", tensor, pool_size, stride, padding)

    def avg_pool2d(self, tensor: CudaTensor, pool_size: Pair, stride: Optional[Pair] = None,
                   padding: Pair = (0, 0)) -> CudaTensor:
        """Mean over windows (padding counted in the divisor, as PyTorch's default)."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_pool2d
        except AttributeError:
            from .ops.pooling import pool2d as op
            CudaML._op_pool2d = staticmethod(op)
        return op(self.math, "avg", tensor, pool_size, stride, padding)

    def max_pool2d_backward(self, grad_out: CudaTensor, input: CudaTensor, pool_size: Pair,
                            stride: Optional[Pair] = None,
                            padding: Pair = (0, 0)) -> CudaTensor:
        """d max_pool2d(input, ...) / d input times grad_out: each window's gradient goes to
        the element the forward picked (first maximum, last NaN, as PyTorch's indices);
        input is the forward's, grad_out of its output shape. Deterministic (no atomics)."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_pool2d_backward
        except AttributeError:
            from .ops.pooling_backward import pool2d_backward as op
            CudaML._op_pool2d_backward = staticmethod(op)
        return op(self.math, "max", grad_out, input, pool_size, stride, padding)

    def avg_pool2d_backward(self, grad_out: CudaTensor, input: CudaTensor, pool_size: Pair,
                            stride: Optional[Pair] = None,
                            padding: Pair = (0, 0)) -> CudaTensor:
        """d avg_pool2d(input, ...) / d input times grad_out: grad_out / (kh * kw) to every
        element of each window (padding counted, as the forward); input gives the shape,
        dtype and device only."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_pool2d_backward
        except AttributeError:
            from .ops.pooling_backward import pool2d_backward as op
            CudaML._op_pool2d_backward = staticmethod(op)
        return op(self.math, "avg", grad_out, input, pool_size, stride, padding)

    # -- normalization --------------------------------------------------------------------
    def batch_norm(self, input: CudaTensor, gamma: CudaTensor, beta: CudaTensor,
                   mean: CudaTensor, var: CudaTensor, eps: float = 1e-5,
                   training: bool = False, momentum: float = 0.1) -> CudaTensor:
        """Batch norm over N(,H,W) per channel. Inference uses mean/var; training=True uses
        the batch statistics and updates mean/var in place (running averages)."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_batch_norm
        except AttributeError:
            from .ops.normalization import batch_norm as op
            CudaML._op_batch_norm = staticmethod(op)
        return op(self.math, input, gamma, beta, mean, var, eps, training, momentum)

    def layer_norm(self, x: CudaTensor, weight: Optional[CudaTensor],
                   bias: Optional[CudaTensor], eps: float = 1e-5) -> CudaTensor:
        """Layer norm over the last dimension."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_layer_norm
        except AttributeError:
            from .ops.normalization import layer_norm as op
            CudaML._op_layer_norm = staticmethod(op)
        return op(self.math, x, weight, bias, eps)

    def layer_norm_backward(self, grad_out: CudaTensor, x: CudaTensor,
                            weight: Optional[CudaTensor] = None, eps: float = 1e-5
                            ) -> Tuple[CudaTensor, Optional[CudaTensor], CudaTensor]:
        """(grad_x, grad_weight, grad_bias) of layer_norm(x, weight, bias, eps) for the
        gradient grad_out of its output; the row statistics are recomputed from x.
        grad_weight is None when weight is None; grad_bias (D,) is always returned.
        Deterministic (no atomics)."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_layer_norm_backward
        except AttributeError:
            from .ops.normalization_backward import layer_norm_backward as op
            CudaML._op_layer_norm_backward = staticmethod(op)
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
            op = CudaML._op_batch_norm_backward
        except AttributeError:
            from .ops.normalization_backward import batch_norm_backward as op
            CudaML._op_batch_norm_backward = staticmethod(op)
        return op(self.math, grad_out, input, gamma, eps, training, running_mean, running_var)

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

    # -- losses ---------------------------------------------------------------------------
    def cross_entropy(self, logits: CudaTensor, labels: CudaTensor, reduction: str = "mean",
                      ignore_index: int = -100, check_labels: bool = True,
                      return_row_stats: bool = False) -> Any:
        """Fused cross-entropy of logits (N, C) against int32/int64 labels (N,), PyTorch's
        semantics: per row logsumexp - logit[label]; rows labelled ignore_index give 0 and
        leave the mean's count; reduction "mean" (shape (), NaN over zero counted rows),
        "sum" or "none" (shape (N,)). A label outside [0, C) other than ignore_index raises
        InvalidArgumentError: a device flag read back after the kernels, which makes the
        call wait for them; check_labels=False skips that (such rows give NaN).
        return_row_stats=True returns (loss, row_stats): each row's max and sum of
        exp(x - max), (N, 2), for cross_entropy_backward(..., row_stats=) to read the
        logits once."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_cross_entropy
        except AttributeError:
            from .ops.cross_entropy import cross_entropy as op
            CudaML._op_cross_entropy = staticmethod(op)
        return op(self.math, logits, labels, reduction, ignore_index, check_labels,
                  return_row_stats)

    def cross_entropy_backward(self, logits: CudaTensor, labels: CudaTensor,
                               grad_loss: Any = 1.0, reduction: str = "mean",
                               ignore_index: int = -100, check_labels: bool = True,
                               row_stats: Optional[CudaTensor] = None) -> CudaTensor:
        """d loss / d logits, (N, C): (softmax(logits) - onehot(labels)) * grad_loss per row
        (divided by the count of rows not ignored for "mean"; 0 for ignored rows). grad_loss:
        a number, or a tensor (shape () or (1,) for "mean"/"sum", (N,) for "none").
        Labels are checked as in cross_entropy. row_stats: the forward's (see
        cross_entropy's return_row_stats) for these logits: one read of them, not two."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_cross_entropy_backward
        except AttributeError:
            from .ops.cross_entropy import cross_entropy_backward as op
            CudaML._op_cross_entropy_backward = staticmethod(op)
        return op(self.math, logits, labels, grad_loss, reduction, ignore_index, check_labels,
                  row_stats)

    # -- regularization -------------------------------------------------------------------
    def dropout(self, tensor: CudaTensor, keep_prob: float = 0.5, seed: Optional[int] = None,
                return_mask: bool = False) -> Any:
        """Zero each element with probability 1-keep_prob and scale the rest by 1/keep_prob.

        Counter-based RNG: the same seed gives the same mask. Returns the output, or
        (output, mask) with return_mask=True (mask is uint8).
        """
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_dropout
        except AttributeError:
            from .ops.dropout import dropout as op
            CudaML._op_dropout = staticmethod(op)
        return op(self.math, tensor, keep_prob, seed, return_mask)

    def dropout_backward(self, grad_out: CudaTensor, keep_prob: float, seed: int) -> CudaTensor:
        """grad_out times the mask `dropout(x, keep_prob, seed)` drew, divided by keep_prob:
        the mask regenerated from the seed (element i of grad_out pairs with element i of
        x, so grad_out has x's element count)."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_dropout_backward
        except AttributeError:
            from .ops.dropout import dropout_backward as op
            CudaML._op_dropout_backward = staticmethod(op)
        return op(self.math, grad_out, keep_prob, seed)

    # -- optimizers -----------------------------------------------------------------------
    def sgd_update(self, params: CudaTensor, gradients: CudaTensor,
                   momentum: Optional[CudaTensor], optimizer_state: OptimizerState) -> None:
        """One fused SGD step in place (momentum buffer optional; Nesterov and weight decay)."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_sgd_update
        except AttributeError:
            from .ops.optimizers import sgd_update as op
            CudaML._op_sgd_update = staticmethod(op)
        op(self.math, params, gradients, momentum, optimizer_state)

    def adam_update(self, params: CudaTensor, gradients: CudaTensor, m_buffer: CudaTensor,
                    v_buffer: CudaTensor, optimizer_state: OptimizerState) -> None:
        """One fused Adam/AdamW step in place, with bias correction; advances state.step."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_adam_update
        except AttributeError:
            from .ops.optimizers import adam_update as op
            CudaML._op_adam_update = staticmethod(op)
        op(self.math, params, gradients, m_buffer, v_buffer, optimizer_state)

    # -- layers ---------------------------------------------------------------------------
    def fused_linear_gelu(self, x: CudaTensor, weight: CudaTensor,
                          bias: Optional[CudaTensor] = None,
                          precision: Optional[str] = None) -> CudaTensor:
        """GELU(x Wᵀ + b) in one kernel; weight is (out_features, in_features). float32 is
        float32-accurate (3xTF32 on tensor cores where faster, else CUDA cores);
        precision="ieee" keeps CUDA cores, precision="tf32" uses TF32."""
        m = self.math
        if type(x) is CudaTensor and type(weight) is CudaTensor and \
                (precision is None or type(precision) is str):
            # the plan of ops/linear.py fused_linear_gelu (its key: _linear_key), looked up
            # here too so that a repeated call skips the import and a call
            b: Union[None, bool, Tuple[Tuple[int, ...], Any, int]]
            if bias is None:
                b = None
            elif type(bias) is CudaTensor:
                b = (bias.shape, bias.dtype, bias.device_id)
            else:
                b = False
            plans = getattr(m, "plans", None)
            fast = None if plans is None or b is False else plans.get(
                ("fused_linear_gelu", x.shape, weight.shape, x.dtype, weight.dtype,
                 x.device_id, weight.device_id, b, precision))
            if fast is not None and m.backend.direct_launch(x.device_id):
                res = fast(x, weight, bias)
                if res is not None:
                    return res
        from .ops import linear
        return linear.fused_linear_gelu(m, x, weight, bias, precision)

    def linear(self, x: CudaTensor, weight: CudaTensor, bias: Optional[CudaTensor] = None,
               precision: Optional[str] = None) -> CudaTensor:
        """x Wᵀ + b in one kernel (the bias added in its store stage); weight is
        (out_features, in_features), x (..., in_features). Precision as fused_linear_gelu."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_linear
        except AttributeError:
            from .ops.linear import linear as op
            CudaML._op_linear = staticmethod(op)
        return op(self.math, x, weight, bias, precision)

    # -- GEMM gradients (ops/matmul_backward.py) -------------------------------------------
    def linear_backward(self, grad_out: CudaTensor, x: CudaTensor, weight: CudaTensor,
                        has_bias: bool = True, precision: Optional[str] = None) -> Any:
        """The gradients of linear(x, weight, bias): (grad_x = grad_out W, grad_weight =
        grad_outᵀ x, grad_bias = grad_out's column sums, or None with has_bias=False), no
        transposed copy. float32 as matrix_multiply (3xTF32 or CUDA cores, the faster;
        "ieee": CUDA cores only); precision="tf32" uses TF32."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_linear_backward
        except AttributeError:
            from .ops.matmul_backward import linear_backward as op
            CudaML._op_linear_backward = staticmethod(op)
        return op(self.math, grad_out, x, weight, has_bias, precision)

    def fused_linear_gelu_backward(self, grad_out: CudaTensor, x: CudaTensor,
                                   weight: CudaTensor, bias: Optional[CudaTensor] = None,
                                   precision: Optional[str] = None) -> Any:
        """The gradients of fused_linear_gelu(x, weight, bias): (grad_x, grad_weight,
        grad_bias or None), through dZ = grad_out * GELU'(x Wᵀ + b) from one recompute whose
        epilogue applies the derivative (no pre-activation stored)."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_fused_linear_gelu_backward
        except AttributeError:
            from .ops.matmul_backward import fused_linear_gelu_backward as op
            CudaML._op_fused_linear_gelu_backward = staticmethod(op)
        return op(self.math, grad_out, x, weight, bias, precision)

    def matmul_backward(self, grad_out: CudaTensor, a: CudaTensor, b: CudaTensor,
                        precision: Optional[str] = None) -> Any:
        """The gradients of matrix_multiply(a, b): (grad_a = grad_out bᵀ, grad_b =
        aᵀ grad_out), of a's and b's shapes (a broadcast batch summed), no transposed copy.
        float32 as matrix_multiply (3xTF32 or CUDA cores, the faster; "ieee": CUDA cores
        only); precision="tf32" uses TF32."""
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_matmul_backward
        except AttributeError:
            from .ops.matmul_backward import matmul_backward as op
            CudaML._op_matmul_backward = staticmethod(op)
        return op(self.math, grad_out, a, b, precision)

    def flash_attention(self, q: CudaTensor, k: CudaTensor, v: CudaTensor,
                        scale: Optional[float] = None, causal: bool = False,
                        return_lse: bool = False) -> Any:
        """softmax(q kᵀ · scale) v for (batch, heads, seq, head_dim), never forming seq×seq.
        return_lse=True gives (out, lse): lse float32 (batch, heads, seq_q), the natural log
        of each row's sum of exp(scale q·k) (-inf without keys), for flash_attention_backward."""
        m = self.math
        if return_lse is not False:   # ops/attention.py looks up its plan ("flash_attention_lse")
            try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
                op = CudaML._op_flash_attention
            except AttributeError:
                from .ops.attention import flash_attention as op
                CudaML._op_flash_attention = staticmethod(op)
            return op(m, q, k, v, scale, causal, return_lse=return_lse)
        if type(causal) is bool and (scale is None or type(scale) is float) and \
                type(q) is CudaTensor and type(k) is CudaTensor and type(v) is CudaTensor:
            # the plan of ops/attention.py flash_attention (same key), looked up here too so
            # that a repeated call skips the import and a call
            plans = getattr(m, "plans", None)
            fast = None if plans is None else plans.get(
                ("flash_attention", q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
                 q.device_id, k.device_id, v.device_id, scale is None, causal))
            if fast is not None and m.backend.direct_launch(q.device_id):
                res = fast(q, k, v, scale)
                if res is not None:
                    return res
        from .ops import attention
        return attention.flash_attention(m, q, k, v, scale, causal)

    def flash_attention_backward(self, grad_out: CudaTensor, q: CudaTensor, k: CudaTensor,
                                 v: CudaTensor, out: CudaTensor, lse: CudaTensor,
                                 scale: Optional[float] = None,
                                 causal: bool = False) -> Tuple[CudaTensor, CudaTensor,
                                                                CudaTensor]:
        """(grad_q, grad_k, grad_v) of flash_attention for the gradient grad_out of its
        output, from the forward's out and lse (flash_attention(..., return_lse=True));
        scale and causal as given to the forward."""
        m = self.math
        if type(causal) is bool and (scale is None or type(scale) is float) and \
                type(q) is CudaTensor and type(k) is CudaTensor:
            # the plan of ops/attention_backward.py (its plan_key), looked up here too
            fast = m.plans.get(("flash_attention_backward", q.shape, k.shape, q.dtype,
                                q.device_id, scale is None, causal))
            if fast is not None and m.backend.direct_launch(q.device_id):
                res = fast(grad_out, q, k, v, out, lse, scale)
                if res is not None:
                    return res
        try:  # the op, bound once: a per-call `from .ops import` costs ~0.5 us
            op = CudaML._op_flash_attention_backward
        except AttributeError:
            from .ops.attention_backward import flash_attention_backward as op
            CudaML._op_flash_attention_backward = staticmethod(op)
        return op(m, grad_out, q, k, v, out, lse, scale, causal)

    def sketched_linear(self, x: CudaTensor, U: CudaTensor, V: CudaTensor,
                        bias: Optional[CudaTensor] = None) -> CudaTensor:
        """y = (1/num_terms) Σᵢ (x Uᵢ) Vᵢ + b, U (terms, in, rank), V (terms, rank, out)."""
        from .ops import linear
        return linear.sketched_linear(self.math, x, U, V, bias)

    def sketched_linear_params(self, in_features: int, out_features: int, num_terms: int,
                               low_rank: int, dtype: Any = "float32",
                               seed: Optional[int] = None) -> Tuple[CudaTensor, CudaTensor]:
        """Draw U, V as SKLinear(in_features, out_features, num_terms, low_rank) does
        (../shared/seeds/004_98bf96c14fc0e5d5.txt)."""
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
