"""A small reverse-mode autograd tape over CudaMath / CudaML.

    from cuda_backend.autograd import Tensor, tensor
    w = tensor(np.ones((3, 2), np.float32), requires_grad=True)
    loss = (tensor(x) @ w).relu().sum()
    loss.backward()                 # w.grad: a CudaTensor of w's shape

Each op's result `Tensor` points at the `Function` that made it; `backward()` runs the
Functions reachable from the loss in reverse and releases each one as soon as its backward
has run (`autograd_tape` says how). Under `no_grad()` (or when no input requires a gradient)
nothing is recorded.

Gradients flow through the existing backward ops (relu_backward, linear_backward,
flash_attention_backward, ...) on the device; nothing is computed on the host. Broadcasting
binary ops sum the gradient over the broadcast axes (`unbroadcast`). `autocast(dtype)` makes
the layers of `nn` compute matrix products, convolutions and attention in dtype (bfloat16 or
float16) from float32 parameters, as torch.autocast does; norms, softmax and losses run in
float32.

This module is the import path (`nn`, `optim`, the examples and user code use it); it
re-exports the names of the three modules that implement it:
- `autograd_tape`: `Tensor`, `Function`, the backward walk and the modes (`no_grad`,
  `autocast`, `capturing`);
- `autograd_ops`: the rules of the tensor ops (arithmetic, unary ops, shapes, sums, matmul);
- `autograd_layers`: the rules of the layers (linear, norms, conv2d, pooling, dropout,
  attention, cross-entropy).
"""
from __future__ import annotations

from .autograd_layers import (Attention, BatchNorm, Conv2d, CrossEntropy, Dropout, Embedding,
                              LayerNorm, Linear, PackedAttention, Pool2d, attention, linear,
                              packed_attention)
from .autograd_ops import (Add, Astype, Div, Exp, Gelu, Log, LogSoftmax, MatMul, Mul, Neg,
                           Permute, Relu, Reshape, Sigmoid, Softmax, Sub, Sum, Tanh, Unbind, add,
                           astype, div, matmul, mul, reshape, sub, unbind, unbroadcast)
from .autograd_tape import (DT, Function, Tensor, apis, autocast, capturing, compute_dtype,
                            is_grad_enabled, no_grad, tensor)

__all__ = [
    # the tape and its modes (autograd_tape)
    "DT", "Function", "Tensor", "apis", "autocast", "capturing", "compute_dtype",
    "is_grad_enabled", "no_grad", "tensor",
    # the tensor ops' rules (autograd_ops)
    "Add", "Astype", "Div", "Exp", "Gelu", "Log", "LogSoftmax", "MatMul", "Mul", "Neg",
    "Permute", "Relu", "Reshape", "Sigmoid", "Softmax", "Sub", "Sum", "Tanh", "Unbind", "add",
    "astype", "div", "matmul", "mul", "reshape", "sub", "unbind", "unbroadcast",
    # the layers' rules (autograd_layers)
    "Attention", "BatchNorm", "Conv2d", "CrossEntropy", "Dropout", "Embedding", "LayerNorm",
    "Linear", "PackedAttention", "Pool2d", "attention", "linear", "packed_attention",
]
