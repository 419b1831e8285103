"""Layers, containers and losses over the autograd tape (`cuda_backend.autograd`).

    from cuda_backend import nn
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    loss = nn.cross_entropy(model(x), labels)      # x: an autograd Tensor, labels: int CudaTensor
    loss.backward()

A `Module` finds its parameters (`Parameter`), buffers (the names in `buffer_names`) and
sub-modules among its attributes, in the order they were set; parameter names follow
PyTorch's (`0.weight`, `blocks.1.attn.qkv.bias`), so a `state_dict` loads into the same model
written in PyTorch. Initial values follow PyTorch's default initializations, drawn from this
module's NumPy generator (`manual_seed`). Under `autograd.autocast(dtype)` Linear, Conv2d and
attention compute in dtype from float32 parameters; LayerNorm, BatchNorm2d and the losses
compute in float32 (or the input's wider dtype), as torch.autocast does.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional, Tuple, cast, overload

import numpy as np

from . import autograd as ag
from .autograd import Tensor, apis, astype, capturing, compute_dtype
from .dtypes import CudaDataType
from .errors import InvalidArgumentError, ShapeMismatchError
from .tensor import CudaTensor

DT = CudaDataType
_rng = np.random.default_rng(0)


def manual_seed(seed: int) -> None:
    """Seed the generator that initial weights and dropout seeds are drawn from."""
    global _rng
    _rng = np.random.default_rng(seed)


class Parameter(Tensor):
    """A leaf Tensor that requires a gradient: what optimizers update."""

    __slots__ = ()

    def __init__(self, data: CudaTensor) -> None:
        super().__init__(data, requires_grad=True)


def parameter(values: np.ndarray) -> Parameter:
    return Parameter(apis()[0].from_numpy(np.ascontiguousarray(values, np.float32)))


def _uniform(bound: float, shape: Tuple[int, ...]) -> Parameter:
    return parameter(_rng.uniform(-bound, bound, shape))


@overload
def _cast(x: Tensor, dtype: Optional[CudaDataType]) -> Tensor: ...


@overload
def _cast(x: Optional[Tensor], dtype: Optional[CudaDataType]) -> Optional[Tensor]: ...


def _cast(x: Optional[Tensor], dtype: Optional[CudaDataType]) -> Optional[Tensor]:
    return x if x is None or dtype is None else astype(x, dtype)


def _wide(x: Tensor) -> Tensor:
    """x in float32 when it is a half type (norms and losses compute in float32 or wider)."""
    return astype(x, DT.FLOAT32) if x.dtype.itemsize < 4 else x


def _data(t: Any) -> Any:
    return t.data if isinstance(t, Tensor) else t


# -- modules ----------------------------------------------------------------------------------
class Module:
    """Base of layers: parameters, buffers and children are found among the attributes."""

    buffer_names: Tuple[str, ...] = ()
    training = True

    def forward(self, *args: Any) -> Any:
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def children(self) -> Iterator[Tuple[str, "Module"]]:
        for name, value in vars(self).items():
            if isinstance(value, Module):
                yield name, value
            elif isinstance(value, (list, tuple)):
                for i, v in enumerate(value):
                    if isinstance(v, Module):
                        yield f"{name}.{i}" if name != "_layers" else str(i), v

    def named_parameters(self, prefix: str = "") -> Iterator[Tuple[str, Parameter]]:
        for name, value in vars(self).items():
            if isinstance(value, Parameter):
                yield prefix + name, value
        for name, child in self.children():
            yield from child.named_parameters(prefix + name + ".")

    def parameters(self) -> List[Parameter]:
        return [p for _, p in self.named_parameters()]

    def named_buffers(self, prefix: str = "") -> Iterator[Tuple[str, CudaTensor]]:
        for name in self.buffer_names:
            yield prefix + name, getattr(self, name)
        for name, child in self.children():
            yield from child.named_buffers(prefix + name + ".")

    def modules(self) -> Iterator["Module"]:
        yield self
        for _, child in self.children():
            yield from child.modules()

    def train(self, mode: bool = True) -> "Module":
        for mod in self.modules():
            mod.training = bool(mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    # -- state
    def state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """Parameters and buffers as host arrays, by PyTorch-style name."""
        m = apis()[0]
        out: "OrderedDict[str, np.ndarray]" = OrderedDict()
        for name, p in self.named_parameters():
            out[name] = m.to_numpy(p.data)
        for name, b in self.named_buffers():
            out[name] = m.to_numpy(b)
        return out

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        """Copy values into the existing parameters and buffers (their memory stays where it
        is, so optimizers and captured graphs keep pointing at it)."""
        m = apis()[0]
        targets = {n: p.data for n, p in self.named_parameters()}
        targets.update(self.named_buffers())
        if strict:
            missing = sorted(set(targets) - set(state))
            unexpected = sorted(set(state) - set(targets))
            if missing or unexpected:
                raise InvalidArgumentError(
                    f"load_state_dict: missing keys {missing}, unexpected keys {unexpected} "
                    f"(pass strict=False to load the keys both have)")
        for name, t in targets.items():
            if name not in state:
                continue
            value = np.asarray(state[name])
            if value.shape != t.shape:
                raise ShapeMismatchError(
                    f"load_state_dict: {name} has shape {value.shape} in the state, "
                    f"{t.shape} in the model")
            host = value.astype(np.float32 if t.dtype is DT.BFLOAT16 else t.dtype.numpy_dtype)
            if t.dtype is DT.BFLOAT16:
                src = m.from_numpy(host, t.device_id, DT.BFLOAT16)
                m.backend.copy_device_to_device(t, src)
            else:
                m.backend.copy_to_device(np.ascontiguousarray(host), t)

    def save(self, path: str) -> None:
        """state_dict() to an .npz file."""
        state: Dict[str, Any] = self.state_dict()   # (Any: savez's stubs type its options)
        np.savez(path, **state)

    def load(self, path: str, strict: bool = True) -> None:
        with np.load(path) as f:
            self.load_state_dict({k: f[k] for k in f.files}, strict)


class Sequential(Module):
    """Modules applied in order; their names are their positions ("0", "1", ...)."""

    def __init__(self, *layers: Module) -> None:
        self._layers = list(layers)

    def __getitem__(self, i: int) -> Module:
        return self._layers[i]

    def __len__(self) -> int:
        return len(self._layers)

    def forward(self, x: Any) -> Any:
        for layer in self._layers:
            x = layer(x)
        return x


class Linear(Module):
    """y = x Wᵀ + b, W (out_features, in_features); gelu=True fuses a GELU (tanh form) into
    the same kernel (fused_linear_gelu)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gelu: bool = False, precision: Optional[str] = None) -> None:
        bound = 1.0 / math.sqrt(in_features) if in_features else 0.0
        self.weight = _uniform(bound, (out_features, in_features))
        self.bias = _uniform(bound, (out_features,)) if bias else None
        self.gelu = gelu
        self.precision = precision

    def forward(self, x: Tensor) -> Tensor:
        dt = compute_dtype()
        return ag.linear(_cast(x, dt), _cast(self.weight, dt), _cast(self.bias, dt),
                         self.gelu, self.precision)


class Conv2d(Module):
    """2-D convolution of NCHW input with (out, in / groups, kh, kw) weights."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1,
                 padding: Any = 0, dilation: Any = 1, groups: int = 1, bias: bool = True,
                 precision: Optional[str] = None) -> None:
        from .cuda_ml import ConvolutionConfig
        self.config = ConvolutionConfig(kernel_size, stride, padding, dilation, groups)
        kh, kw = cast(Tuple[int, int], self.config.kernel_size)   # (a pair once made)
        fan_in = in_channels // groups * kh * kw
        bound = 1.0 / math.sqrt(fan_in) if fan_in else 0.0
        self.weight = _uniform(bound, (out_channels, in_channels // groups, kh, kw))
        self.bias = _uniform(bound, (out_channels,)) if bias else None
        self.precision = precision

    def forward(self, x: Tensor) -> Tensor:
        dt = compute_dtype()
        return ag.Conv2d.apply(_cast(x, dt), _cast(self.weight, dt), _cast(self.bias, dt),
                               self.config, self.precision)


class LayerNorm(Module):
    """Normalization over the last axis (float32 under autocast)."""

    def __init__(self, dim: int, eps: float = 1e-5, elementwise_affine: bool = True) -> None:
        self.eps = float(eps)
        self.weight = parameter(np.ones(dim)) if elementwise_affine else None
        self.bias = parameter(np.zeros(dim)) if elementwise_affine else None

    def forward(self, x: Tensor) -> Tensor:
        x = _wide(x)
        w = _cast(self.weight, x.dtype)
        return ag.LayerNorm.apply(x, w, _cast(self.bias, x.dtype), self.eps)


class BatchNorm2d(Module):
    """Batch normalization per channel of NCHW input: batch statistics in training (the
    running averages updated in place), the running ones in eval (float32 under autocast)."""

    buffer_names = ("running_mean", "running_var")

    def __init__(self, channels: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        m = apis()[0]
        self.eps, self.momentum = float(eps), float(momentum)
        self.weight = parameter(np.ones(channels))
        self.bias = parameter(np.zeros(channels))
        self.running_mean = m.from_numpy(np.zeros(channels, np.float32))
        self.running_var = m.from_numpy(np.ones(channels, np.float32))

    def forward(self, x: Tensor) -> Tensor:
        x = _wide(x)
        return ag.BatchNorm.apply(x, self.weight, self.bias, self.running_mean,
                                  self.running_var, self.training, self.momentum, self.eps)


class Dropout(Module):
    """Zero each element with probability p in training (a new seed per call); identity in
    eval and for p == 0."""

    def __init__(self, p: float = 0.5) -> None:
        if not 0.0 <= p < 1.0:
            raise InvalidArgumentError(f"dropout probability must be in [0, 1), got {p!r}")
        self.p = float(p)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        return ag.Dropout.apply(x, 1.0 - self.p, int(_rng.integers(0, 2**63)))


class Embedding(Module):
    """Rows of a (num_embeddings, dim) table by int ids; the output is float32 (cast after the
    lookup under autocast, so the gradient is summed in float32)."""

    def __init__(self, num_embeddings: int, dim: int, check_bounds: bool = True) -> None:
        self.weight = parameter(_rng.standard_normal((num_embeddings, dim)))
        self.check_bounds = check_bounds

    def forward(self, ids: Any) -> Tensor:
        ids = _data(ids)
        check = self.check_bounds and not capturing(ids.device_id)
        return ag.Embedding.apply(self.weight, ids, check)


class MultiheadSelfAttention(Module):
    """Self-attention over (batch, seq, dim): one qkv projection, flash_attention_packed over
    its heads (causal by default), an output projection."""

    def __init__(self, dim: int, heads: int, causal: bool = True, bias: bool = True) -> None:
        if dim % heads:
            raise InvalidArgumentError(f"dim {dim} is not a multiple of heads {heads}")
        self.heads, self.causal = heads, causal
        self.qkv = Linear(dim, 3 * dim, bias)
        self.proj = Linear(dim, dim, bias)

    def forward(self, x: Tensor) -> Tensor:
        # q, k, v are read from the projection's (B, T, 3, H, D) layout in place and the
        # output written as (B, T, H, D): no heads split or merge copies (perf/NOTES.md S9)
        return self.proj(ag.packed_attention(self.qkv(x), self.heads, None, self.causal))


class GELU(Module):
    def __init__(self, approximate: str = "tanh") -> None:
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return x.gelu(self.approximate)


class ReLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.relu()


class Flatten(Module):
    """(N, ...) -> (N, everything else)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.reshape(x.shape[0], -1)


class MaxPool2d(Module):
    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0) -> None:
        self.args = (kernel_size, stride, padding)

    def forward(self, x: Tensor) -> Tensor:
        return ag.Pool2d.apply(x, "max", *self.args)


class AvgPool2d(Module):
    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0) -> None:
        self.args = (kernel_size, stride, padding)

    def forward(self, x: Tensor) -> Tensor:
        return ag.Pool2d.apply(x, "avg", *self.args)


# -- losses -----------------------------------------------------------------------------------
def cross_entropy(logits: Tensor, labels: Any, ignore_index: int = -100,
                  reduction: str = "mean", check_labels: bool = True) -> Tensor:
    """Mean (or summed) cross-entropy of logits (..., C) against int labels (...), computed in
    float32. check_labels=False skips the label range check (a device read-back); it is
    skipped anyway while a CUDA graph is being captured."""
    labels = _data(labels)
    check = check_labels and not capturing(labels.device_id)
    return ag.CrossEntropy.apply(_wide(logits), labels, reduction, ignore_index, check)


def mse_loss(pred: Tensor, target: Any) -> Tensor:
    """mean((pred - target)^2), in float32."""
    target = target if isinstance(target, Tensor) else Tensor(target)
    d = _wide(pred) - _wide(target)
    return (d * d).mean()
