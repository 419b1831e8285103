"""`TrainingOps`, the part of CudaML (cuda_ml.py) that only training calls: the loss
(cross_entropy and its gradient, ops/cross_entropy.py), dropout and its gradient
(ops/dropout.py), and the fused optimizer steps sgd_update / adam_update (ops/optimizers.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from .ops.common import LazyOp
from .tensor import CudaTensor

if TYPE_CHECKING:
    from .cuda_math import CudaMath
    from .cuda_ml import OptimizerState


class TrainingOps:
    """CudaML's loss, dropout and optimizer steps (a mixin: CudaML holds `math`)."""

    math: CudaMath

    # -- losses ---------------------------------------------------------------------------
    _op_cross_entropy = LazyOp("cross_entropy", "cross_entropy")

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
        return self._op_cross_entropy(self.math, logits, labels, reduction, ignore_index,
                                      check_labels, return_row_stats)

    _op_cross_entropy_backward = LazyOp("cross_entropy", "cross_entropy_backward")

    def cross_entropy_backward(self, logits: CudaTensor, labels: CudaTensor,
                               grad_loss: Any = 1.0, reduction: str = "mean",
                               ignore_index: int = -100, check_labels: bool = True,
                               row_stats: Optional[CudaTensor] = None) -> CudaTensor:
        """d loss / d logits, (N, C): (softmax(logits) - onehot(labels)) * grad_loss per row
        (divided by the count of rows not ignored for "mean"; 0 for ignored rows). grad_loss:
        a number, or a tensor (shape () or (1,) for "mean"/"sum", (N,) for "none").
        Labels are checked as in cross_entropy. row_stats: the forward's (see
        cross_entropy's return_row_stats) for these logits: one read of them, not two."""
        return self._op_cross_entropy_backward(self.math, logits, labels, grad_loss, reduction,
                                               ignore_index, check_labels, row_stats)

    # -- regularization -------------------------------------------------------------------
    _op_dropout = LazyOp("dropout", "dropout")

    def dropout(self, tensor: CudaTensor, keep_prob: float = 0.5, seed: Optional[int] = None,
                return_mask: bool = False) -> Any:
        """Zero each element with probability 1-keep_prob and scale the rest by 1/keep_prob.

        Counter-based RNG: the same seed gives the same mask. Returns the output, or
        (output, mask) with return_mask=True (mask is uint8).
        """
        return self._op_dropout(self.math, tensor, keep_prob, seed, return_mask)

    _op_dropout_backward = LazyOp("dropout", "dropout_backward")

    def dropout_backward(self, grad_out: CudaTensor, keep_prob: float, seed: int) -> CudaTensor:
        """grad_out times the mask `dropout(x, keep_prob, seed)` drew, divided by keep_prob:
        the mask regenerated from the seed (element i of grad_out pairs with element i of
        x, so grad_out has x's element count)."""
        return self._op_dropout_backward(self.math, grad_out, keep_prob, seed)

    # -- optimizers -----------------------------------------------------------------------
    _op_sgd_update = LazyOp("optimizers", "sgd_update")

    def sgd_update(self, params: CudaTensor, gradients: CudaTensor,
                   momentum: Optional[CudaTensor], optimizer_state: OptimizerState) -> None:
        """One fused SGD step in place (momentum buffer optional; Nesterov and weight decay)."""
        self._op_sgd_update(self.math, params, gradients, momentum, optimizer_state)

    _op_adam_update = LazyOp("optimizers", "adam_update")

    def adam_update(self, params: CudaTensor, gradients: CudaTensor, m_buffer: CudaTensor,
                    v_buffer: CudaTensor, optimizer_state: OptimizerState) -> None:
        """One fused Adam/AdamW step in place, with bias correction; advances state.step."""
        self._op_adam_update(self.math, params, gradients, m_buffer, v_buffer, optimizer_state)
