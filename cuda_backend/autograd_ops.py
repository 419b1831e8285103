"""The autograd rules of the tensor ops: arithmetic with broadcasting (the gradient summed
back over the broadcast axes, `unbroadcast`), the unary ops and activations, shape changes,
sums and means, and the matrix product. Each is a `Function` (autograd_tape) whose backward
calls the device's backward ops (relu_backward, matmul_backward, ...); nothing is computed on
the host. Two float Tensors of different dtypes meet in the wider one, as in PyTorch.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

from .autograd_tape import Function, Tensor, apis
from .dtypes import CudaDataType
from .errors import InvalidArgumentError
from .ops.common import normalize_axes
from .tensor import CudaTensor

DT = CudaDataType


# -- broadcasting -----------------------------------------------------------------------------
def unbroadcast(m: Any, g: CudaTensor, shape: Tuple[int, ...]) -> CudaTensor:
    """g (the broadcast result's gradient) summed over the axes broadcasting added or
    stretched, reshaped to `shape`."""
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape)
                                      if s == 1 and g.shape[lead + i] != 1)
    return m.reshape(m.reduce_sum(g, axis=axes), shape) if axes else m.reshape(g, shape)


def _promote(a: Any, b: Any) -> Tuple[Any, Any]:
    """Two float Tensors of different dtypes: the narrower cast to the wider (as PyTorch
    promotes a float32 residual plus a bfloat16 branch)."""
    if isinstance(a, Tensor) and isinstance(b, Tensor) and a.dtype is not b.dtype:
        if a.dtype.itemsize < b.dtype.itemsize:
            a = astype(a, b.dtype)
        elif b.dtype.itemsize < a.dtype.itemsize:
            b = astype(b, a.dtype)
    return a, b


def _scalar(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _operands(a: Any, b: Any, op: str) -> Tuple[Any, Any]:
    for x in (a, b):
        if not isinstance(x, Tensor) and not _scalar(x):
            raise InvalidArgumentError(
                f"{op}: operands are Tensors or Python numbers, got {type(x).__name__}")
    return _promote(a, b)


class Add(Function):
    """a + b; Sub, a - b, shares its forward (the op named by `op`, the operands' shapes
    saved for unbroadcast)."""

    op = "add"

    def forward(self, a: Any, b: Any) -> CudaTensor:
        self.save(getattr(a, "shape", None), getattr(b, "shape", None))
        return getattr(apis()[0], self.op)(a, b)

    def backward(self, g: CudaTensor) -> tuple:
        m = apis()[0]
        return tuple(unbroadcast(m, g, s) for s in self.saved if s is not None)


class Sub(Add):
    op = "subtract"

    def backward(self, g: CudaTensor) -> tuple:
        m = apis()[0]
        sa, sb = self.saved
        out: List[Optional[CudaTensor]] = [] if sa is None else [unbroadcast(m, g, sa)]
        if sb is not None:
            out.append(unbroadcast(m, m.negative(g), sb) if self.needs[-1] else None)
        return tuple(out)


class Mul(Function):
    def forward(self, a: Any, b: Any) -> CudaTensor:
        self.save(a, b)
        return apis()[0].multiply(a, b)

    def backward(self, g: CudaTensor) -> tuple:
        m = apis()[0]
        a, b = self.saved
        out, i = [], 0
        for x, other in ((a, b), (b, a)):
            if isinstance(x, CudaTensor):
                out.append(unbroadcast(m, m.multiply(g, other), x.shape) if self.needs[i]
                           else None)
                i += 1
        return tuple(out)


class Div(Function):
    def forward(self, a: Any, b: Any) -> CudaTensor:
        m = apis()[0]
        out = m.divide(a, b)
        self.save(a, b, out)
        return out

    def backward(self, g: CudaTensor) -> tuple:
        m = apis()[0]
        a, b, out = self.saved
        res = []
        if isinstance(a, CudaTensor):
            res.append(unbroadcast(m, m.divide(g, b), a.shape) if self.needs[0] else None)
        if isinstance(b, CudaTensor):       # d(a/b)/db = -out / b
            res.append(unbroadcast(m, m.negative(m.divide(m.multiply(g, out), b)), b.shape)
                       if self.needs[-1] else None)
        return tuple(res)


def add(a: Any, b: Any) -> Tensor:
    return Add.apply(*_operands(a, b, "add"))


def sub(a: Any, b: Any) -> Tensor:
    return Sub.apply(*_operands(a, b, "subtract"))


def mul(a: Any, b: Any) -> Tensor:
    return Mul.apply(*_operands(a, b, "multiply"))


def div(a: Any, b: Any) -> Tensor:
    return Div.apply(*_operands(a, b, "divide"))


# -- unary ------------------------------------------------------------------------------------
class Neg(Function):
    def forward(self, x: CudaTensor) -> CudaTensor:
        return apis()[0].negative(x)

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[0].negative(g)


class Gelu(Function):
    def forward(self, x: CudaTensor, approximate: str = "tanh") -> CudaTensor:
        self.save(x, approximate)
        return apis()[1].gelu(x, approximate)

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[1].gelu_backward(g, *self.saved)


class Unary(Function):
    """y = CudaMath.<op>(x), whose gradient CudaML.<op>_backward(g, v) takes v, the output y
    (saves_output) or the input x."""

    op = ""
    saves_output = True

    def forward(self, x: CudaTensor) -> CudaTensor:
        y = getattr(apis()[0], self.op)(x)
        self.save(y if self.saves_output else x)
        return y

    def backward(self, g: CudaTensor) -> CudaTensor:
        return getattr(apis()[1], self.op + "_backward")(g, self.saved[0])


class Exp(Unary):
    op = "exp"

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[0].multiply(g, self.saved[0])


class Log(Unary):
    op, saves_output = "log", False

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[0].divide(g, self.saved[0])


class Relu(Unary):
    op, saves_output = "relu", False


class Sigmoid(Unary):
    op = "sigmoid"


class Tanh(Unary):
    op = "tanh"


class Softmax(Unary):
    """Over the last axis."""

    op = "softmax"


class LogSoftmax(Unary):
    """Over the last axis."""

    op = "log_softmax"


# -- shapes and reductions --------------------------------------------------------------------
class Reversible(Function):
    """y = CudaMath.<op>(x, arg), whose gradient is <op>(g, undo(x, arg)): the argument that
    takes y's shape or dtype back to x's."""

    op = ""

    def undo(self, x: CudaTensor, arg: Any) -> Any:
        raise NotImplementedError

    def forward(self, x: CudaTensor, arg: Any) -> CudaTensor:
        self.save(self.undo(x, arg))
        return getattr(apis()[0], self.op)(x, arg)

    def backward(self, g: CudaTensor) -> CudaTensor:
        return getattr(apis()[0], self.op)(g, self.saved[0])


class Reshape(Reversible):
    op = "reshape"

    def undo(self, x: CudaTensor, shape: Any) -> Tuple[int, ...]:
        return x.shape


class Permute(Reversible):
    op = "permute"

    def undo(self, x: CudaTensor, axes: Tuple[int, ...]) -> Tuple[int, ...]:
        return tuple(int(i) for i in np.argsort(axes))   # the inverse permutation


class Astype(Reversible):
    op = "astype"

    def undo(self, x: CudaTensor, dtype: CudaDataType) -> CudaDataType:
        return x.dtype


class Sum(Function):
    """reduce_sum (mean=True: reduce_mean) over axis; the gradient is broadcast back."""

    def forward(self, x: CudaTensor, axis: Any = None, keepdims: bool = False,
                mean: bool = False) -> CudaTensor:
        m = apis()[0]
        axes = normalize_axes(axis, x.ndim)
        count = int(np.prod([x.shape[a] for a in axes])) if axes else 1
        self.save(x.shape, tuple(1 if i in axes else s for i, s in enumerate(x.shape)),
                  1.0 / count if mean and count else None)
        out = m.reduce_mean(x, axis, keepdims) if mean else m.reduce_sum(x, axis, keepdims)
        if out.dtype is not x.dtype:        # (sums of half types come back in float32)
            out = m.astype(out, x.dtype)
        return out

    def backward(self, g: CudaTensor) -> CudaTensor:
        m = apis()[0]
        shape, kept, scale = self.saved
        if scale is not None:
            g = m.multiply(g, scale)
        return m.broadcast_to(m.reshape(g, kept), shape)


class Unbind(Function):
    """The slices x[0], x[1], ... along the first axis (views), as separate outputs."""

    def forward(self, x: CudaTensor) -> tuple:
        m = apis()[0]
        return tuple(m.getitem(x, i) for i in range(x.shape[0]))

    def backward(self, *grads: CudaTensor) -> CudaTensor:
        return apis()[0].stack(list(grads), axis=0)


def reshape(x: Tensor, shape: Any) -> Tensor:
    return Reshape.apply(x, shape)


def astype(x: Tensor, dtype: Any) -> Tensor:
    """x converted to dtype (the gradient converted back); x itself when it has it."""
    dtype = DT.from_any(dtype)
    return x if x.dtype is dtype else Astype.apply(x, dtype)


def unbind(x: Tensor) -> Tuple[Tensor, ...]:
    return Unbind.apply(x)


# -- matrix product ---------------------------------------------------------------------------
class MatMul(Function):
    def forward(self, a: CudaTensor, b: CudaTensor, precision: Optional[str] = None) -> CudaTensor:
        self.save(a, b, precision)
        return apis()[0].matrix_multiply(a, b, precision)

    def backward(self, g: CudaTensor) -> tuple:
        return apis()[1].matmul_backward(g, *self.saved)


def matmul(a: Tensor, b: Tensor, precision: Optional[str] = None) -> Tensor:
    return MatMul.apply(*_promote(a, b), precision)
