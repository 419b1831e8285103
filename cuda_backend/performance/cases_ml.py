"""The CudaML cases (ml family), used when `cuda_backend.cuda_ml` can be imported.

Sizes are a scale s: images are (8, 64, s, s) (and, in the variants ending " N=3" and
" N=64", (3, 64, s, s) and (64, 32, s, s)), layer-norm rows s*s/2 x 1024 (and 1000), attention
(2, 8, 8s, 64), optimizer vectors 64*s*s parameters. Signatures follow the documented API
(README "API": `conv2d(input, kernel, ConvolutionConfig)`, `activation(x, ActivationType.X)`,
...). To benchmark a new CudaML operation, add an OpDef to ML_OPS; its references, inputs and
PyTorch peer go in cases_ml_forward.py (a forward op) or cases_ml_grads.py (a gradient).
"""
from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from .cases import OpDef
from .cases_math import sigmoid, per_element
from .cases_ml_forward import (F, adam, aten_of, attention, batch_norm, conv2d_nchw,
                               cross_entropy_grad, cross_entropy_loss, dropout_check, gelu_tanh,
                               gelu_tanh_grad, grad_pair, images, layer_norm, linear,
                               logits_labels, optimizer_state, pool2x2, qkv, rows, rows_of, sgd,
                               sketch, sketched, softmax_grad_rows,
                               torch_cross_entropy_backward, torch_optimizer)
from .cases_ml_grads import (attention_grad_inputs, attention_grad_q, batch_norm_grad,
                             conv2d_dgrad_nchw, conv2d_wgrad_nchw, conv_grad_inputs,
                             dropout_grad_inputs, fused_linear_gelu_grads, layer_grad_inputs,
                             layer_norm_grad, linear_grads, matmul_grad_inputs, norm_grad_images,
                             norm_grad_rows, ours_attention_backward, ours_conv2d_backward,
                             pool_grad, pool_grad_inputs, torch_attention_backward,
                             torch_batch_norm_backward, torch_conv2d_backward,
                             torch_dropout_backward, torch_layer_backward,
                             torch_layer_norm_backward, torch_matmul_backward,
                             torch_max_pool2d_backward)
from .cases_ml_attention_packed import (packed_attention, packed_grad, packed_grad_inputs,
                                        packed_qkv, ours_packed_backward,
                                        torch_packed_attention, torch_packed_backward)

# CudaML methods that are not operations (sketched_linear_params draws random weights).
NON_OPS = ("math", "backend", "sketched_linear_params")
ML = "ml"
TENSOR = ("float32", "float16", "bfloat16")


def _act(name: str):
    return lambda c, x: c.ml.activation(x, getattr(c.ml_module.ActivationType, name))


def _opt_state(c: Any, **kw: Any) -> Any:
    return c.ml_module.OptimizerState(**kw)


# (variant, rows, min_size): the layer-sized cases from s = 32 on (the quick run's s = 16
# keeps the batch-32 ones: in fallback mode the others and their references take seconds)
GRAD_SHAPES = (("rows 32s", lambda s: 32 * s, 32), ("batch 32", 32, 0))


def _gemms(n: int):
    """n GEMMs of the layer's size (rows x in x out, from the shapes of g and x)."""
    return lambda sh: 2.0 * n * sh[0][0] * sh[0][1] * sh[1][1]


def _conv_flops(n: int):
    """n convolutions' worth: 2 * N * K * C * 9 * H * W from the input and filter shapes."""
    return lambda sh: 2.0 * n * np.prod(sh[1]) * sh[2][0] * 9


def _attention_grad_flops(causal: bool):
    """5 GEMMs of 2 B H T^2 D (S recomputed, dP, dV, dK, dQ): 10 B H T^2 D, 2.5x the forward's
    4 B H T^2 D; half of it causal."""
    return lambda sh: (5.0 if causal else 10.0) * sh[0][0] * sh[0][1] * sh[0][2] ** 2 * sh[0][3]


# The images ops' extra batches, for `report --preset odd` (performance/presets.py) at
# 56x56 and 224x224: (variant suffix, batch, channels, max_size); N=64 stops at s = 64 (its
# float64 NumPy conv2d reference at s = 224 would take tens of seconds).
IMAGE_BATCHES = ((" N=3", 3, 64, None), (" N=64", 64, 32, 64))


def _conv2d(suffix: str = "", batch: int = 8, channels: int = 64,
            max_size: Optional[int] = None) -> OpDef:
    return OpDef("conv2d", ML, images(1, batch, channels),
                 lambda c, x, w: c.ml.conv2d(x, w, c.ml_module.ConvolutionConfig(
                     kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))),
                 cpu=conv2d_nchw, torch=lambda T, x, w: F(T).conv2d(x, w, padding=1),
                 cupy=False, api="CudaML", variant="3x3 pad 1" + suffix,
                 flops=lambda sh: 2.0 * np.prod(sh[0]) * sh[1][0] * 9, max_size=max_size)


def _pool2d(op: str, suffix: str = "", batch: int = 8, channels: int = 64,
            max_size: Optional[int] = None) -> OpDef:
    """max_pool2d or avg_pool2d, 2x2 (the same name in CudaML and torch.nn.functional)."""
    reduce = "max" if op == "max_pool2d" else "mean"
    return OpDef(op, ML, images(0, batch, channels), lambda c, x: getattr(c.ml, op)(x, (2, 2)),
                 cpu=lambda xp, x: pool2x2(x, reduce),
                 torch=lambda T, x: getattr(F(T), op)(x, 2), api="CudaML",
                 variant="2x2" + suffix, flops=per_element(1), max_size=max_size)


def _batch_norm(suffix: str = "", batch: int = 8, channels: int = 64,
                max_size: Optional[int] = None) -> OpDef:
    return OpDef("batch_norm", ML, images(4, batch, channels),
                 lambda c, x, g, b, m, v: c.ml.batch_norm(x, g, b, m, v), cpu=batch_norm,
                 torch=lambda T, x, g, b, m, v: F(T).batch_norm(x, m, v, g, b, training=False,
                                                                  eps=1e-5),
                 api="CudaML", variant="inference" + suffix, flops=per_element(4),
                 max_size=max_size)


def _image_ops(suffix: str, batch: int, channels: int, max_size: Optional[int]) -> List[OpDef]:
    """conv2d, both poolings and batch_norm on (batch, channels, s, s) images."""
    return [_conv2d(suffix, batch, channels, max_size),
            *[_pool2d(op, suffix, batch, channels, max_size)
              for op in ("max_pool2d", "avg_pool2d")],
            _batch_norm(suffix, batch, channels, max_size)]


def _layer_norm(inputs: Any, variant: str = "") -> OpDef:
    return OpDef("layer_norm", ML, inputs, lambda c, x, w, b: c.ml.layer_norm(x, w, b),
                 cpu=layer_norm, torch=lambda T, x, w, b: F(T).layer_norm(
                     x, (x.shape[-1],), w, b, eps=1e-5),
                 api="CudaML", variant=variant, dtypes=TENSOR, flops=per_element(8))


ML_OPS: List[OpDef] = [
    _conv2d(),
    OpDef("activation", ML, images(), _act("RELU"), cpu=lambda xp, x: xp.maximum(x, 0),
          torch=lambda T, x: T.relu(x), api="CudaML", variant="RELU",
          flops=per_element(1)),
    OpDef("activation", ML, images(), _act("GELU"), cpu=gelu_tanh,
          torch=lambda T, x: F(T).gelu(x, approximate="tanh"), api="CudaML",
          variant="GELU", flops=per_element(8)),
    OpDef("activation", ML, images(), _act("SILU"), cpu=lambda xp, x: x * sigmoid(xp, x),
          torch=lambda T, x: F(T).silu(x), api="CudaML", variant="SILU",
          flops=per_element(5)),
    OpDef("gelu", ML, images(), lambda c, x: c.ml.gelu(x, approximate="tanh"), cpu=gelu_tanh,
          torch=lambda T, x: F(T).gelu(x, approximate="tanh"), api="CudaML",
          dtypes=TENSOR, flops=per_element(8)),
    _pool2d("max_pool2d"),
    _pool2d("avg_pool2d"),
    _batch_norm(),
    _layer_norm(rows),
    OpDef("dropout", ML, images(), lambda c, x: c.ml.dropout(x, keep_prob=0.5, seed=1234),
          cpu=lambda xp, x: x * (xp.random.random(x.shape) < 0.5) / 0.5,
          reference=lambda xp, x: x, torch=lambda T, x: F(T).dropout(x, 0.5, training=True),
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
          cpu=attention, torch=lambda T, q, k, v: F(T).scaled_dot_product_attention(q, k, v),
          api="CudaML", dtypes=TENSOR, compute_unit="tensor",
          flops=lambda sh: 4.0 * sh[0][0] * sh[0][1] * sh[0][2] ** 2 * sh[0][3]),
    OpDef("flash_attention", ML, qkv,
          lambda c, q, k, v: c.ml.flash_attention(q, k, v, causal=True),
          cpu=lambda xp, q, k, v: attention(xp, q, k, v, causal=True),
          torch=lambda T, q, k, v: F(T).scaled_dot_product_attention(q, k, v, is_causal=True),
          api="CudaML", variant="causal", dtypes=TENSOR, compute_unit="tensor",
          flops=lambda sh: 2.0 * sh[0][0] * sh[0][1] * sh[0][2] ** 2 * sh[0][3]),
    # attention from a fused (B, T, 3C) projection: flash_attention's case, packed
    OpDef("flash_attention_packed", ML, packed_qkv,
          lambda c, qkv: c.ml.flash_attention_packed(qkv, 8), cpu=packed_attention(False),
          torch=torch_packed_attention(False), api="CudaML", dtypes=TENSOR,
          compute_unit="tensor", flops=lambda sh: 4.0 * sh[0][0] * sh[0][1] ** 2 * sh[0][2] / 3),
    OpDef("fused_linear_gelu", ML, linear,
          lambda c, x, w, b: c.ml.fused_linear_gelu(x, w, b),
          cpu=lambda xp, x, w, b: gelu_tanh(xp, x @ w.T + b),
          torch=lambda T, x, w, b: F(T).gelu(F(T).linear(x, w, b), approximate="tanh"),
          api="CudaML", variant="GELU tanh", flops=lambda sh: 2.0 * sh[0][0] * sh[0][1] * sh[1][0]),
    OpDef("linear", ML, linear, lambda c, x, w, b: c.ml.linear(x, w, b),
          cpu=lambda xp, x, w, b: x @ w.T + b, torch=lambda T, x, w, b: F(T).linear(x, w, b),
          api="CudaML", flops=lambda sh: 2.0 * sh[0][0] * sh[0][1] * sh[1][0]),
    # the shapes of --preset odd: images at N=3 and N=64, rows 1000 wide
    *[d for batch in IMAGE_BATCHES for d in _image_ops(*batch)],
    _layer_norm(rows_of(1000), "1000 wide"),
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
          torch=lambda T, g, x: aten_of(T).threshold_backward(g, x, 0), api="CudaML",
          dtypes=TENSOR, flops=per_element(1)),
    OpDef("leaky_relu_backward", ML, grad_pair(),
          lambda c, g, x: c.ml.leaky_relu_backward(g, x),
          cpu=lambda xp, g, x: xp.where(x > 0, g, g * 0.01),
          torch=lambda T, g, x: aten_of(T).leaky_relu_backward(g, x, 0.01, False), api="CudaML",
          flops=per_element(2)),
    OpDef("elu_backward", ML, grad_pair(), lambda c, g, x: c.ml.elu_backward(g, x),
          cpu=lambda xp, g, x: xp.where(x <= 0, g * xp.exp(x), g),
          torch=lambda T, g, x: aten_of(T).elu_backward(g, 1.0, 1, 1, False, x), api="CudaML",
          flops=per_element(4)),
    OpDef("gelu_backward", ML, grad_pair(), lambda c, g, x: c.ml.gelu_backward(g, x),
          cpu=gelu_tanh_grad,
          torch=lambda T, g, x: aten_of(T).gelu_backward(g, x, approximate="tanh"),
          api="CudaML", variant="tanh", dtypes=TENSOR, flops=per_element(20)),
    OpDef("sigmoid_backward", ML, grad_pair("sigmoid"),
          lambda c, g, y: c.ml.sigmoid_backward(g, y), cpu=lambda xp, g, y: g * (1.0 - y) * y,
          torch=lambda T, g, y: aten_of(T).sigmoid_backward(g, y), api="CudaML",
          flops=per_element(3)),
    OpDef("tanh_backward", ML, grad_pair("tanh"), lambda c, g, y: c.ml.tanh_backward(g, y),
          cpu=lambda xp, g, y: g * (1.0 - y * y),
          torch=lambda T, g, y: aten_of(T).tanh_backward(g, y), api="CudaML",
          flops=per_element(3)),
    OpDef("softmax_backward", ML, softmax_grad_rows(False),
          lambda c, g, y: c.ml.softmax_backward(g, y),
          cpu=lambda xp, g, y: y * (g - (g * y).sum(axis=-1, keepdims=True)),
          torch=lambda T, g, y: aten_of(T)._softmax_backward_data(g, y, -1, y.dtype),
          api="CudaML", dtypes=TENSOR, flops=per_element(4)),
    OpDef("log_softmax_backward", ML, softmax_grad_rows(True),
          lambda c, g, y: c.ml.log_softmax_backward(g, y),
          cpu=lambda xp, g, y: g - xp.exp(y) * g.sum(axis=-1, keepdims=True),
          torch=lambda T, g, y: aten_of(T)._log_softmax_backward_data(g, y, -1, y.dtype),
          api="CudaML", flops=per_element(4)),
    OpDef("cross_entropy", ML, logits_labels, lambda c, x, t: c.ml.cross_entropy(x, t),
          cpu=cross_entropy_loss, torch=lambda T, x, t: F(T).cross_entropy(x, t),
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
          torch=lambda T, g, x: aten_of(T).avg_pool2d_backward(g, x, [2, 2], [2, 2], [0, 0],
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
    OpDef("flash_attention_packed_backward", ML, packed_grad_inputs, ours_packed_backward(False),
          cpu=packed_grad(False), torch_factory=torch_packed_backward(False), api="CudaML",
          cupy=False, dtypes=TENSOR, compute_unit="tensor",
          flops=lambda sh: 10.0 * sh[0][0] * sh[0][1] ** 2 * sh[0][2]),
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
