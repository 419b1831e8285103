"""A small reverse-mode autograd tape over CudaMath / CudaML.

    from cuda_backend.autograd import Tensor, tensor
    w = tensor(np.ones((3, 2), np.float32), requires_grad=True)
    loss = (tensor(x) @ w).relu().sum()
    loss.backward()                 # w.grad: a CudaTensor of w's shape

Each op's result `Tensor` points at the `Function` that made it (`_ctx`); a Function holds its
parent Tensors and the CudaTensors its backward needs (`save`). `backward()` sorts the
Functions reachable from the loss (parents first), runs them in reverse, sums the gradients
arriving at one tensor with `CudaMath.add`, and releases each Function (its saved tensors and
parents) as soon as its backward has run, so the pool is back to the parameters, their
gradients and what the caller still holds. Under `no_grad()` (or when no input requires a
gradient) nothing is recorded. The tape lives only in these references: an exception in the
middle of a forward leaves nothing behind once its traceback is dropped.

Gradients flow through the existing backward ops (relu_backward, linear_backward,
flash_attention_backward, ...) on the device; nothing is computed on the host. Broadcasting
binary ops sum the gradient over the broadcast axes (`unbroadcast`). `autocast(dtype)` makes
the layers of `nn` compute matrix products, convolutions and attention in dtype (bfloat16 or
float16) from float32 parameters, as torch.autocast does; norms, softmax and losses run in
float32.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from .dtypes import CudaDataType
from .errors import DTypeMismatchError, InvalidArgumentError, ShapeMismatchError
from .ops.common import normalize_axes
from .tensor import CudaTensor

DT = CudaDataType
_local = threading.local()
_apis: Any = None


def apis() -> Tuple[Any, Any]:
    """(CudaMath, CudaML) of the process-wide backend, the ones every Function calls."""
    global _apis
    if _apis is None:
        from .cuda_ml import get_cuda_ml
        ml = get_cuda_ml()
        _apis = (ml.math, ml)
    return _apis


# -- modes ------------------------------------------------------------------------------------
def is_grad_enabled() -> bool:
    return _local.__dict__.get("grad", True)


class no_grad:
    """`with no_grad():` ops compute without recording anything (evaluation, sampling)."""

    def __enter__(self) -> "no_grad":
        self._prev = is_grad_enabled()
        _local.grad = False
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.grad = self._prev


def compute_dtype() -> Optional[CudaDataType]:
    """The dtype `autocast` asks the layers to compute in, None outside it."""
    return _local.__dict__.get("autocast")


class autocast:
    """`with autocast("bfloat16"):` the nn layers cast float32 parameters and inputs to dtype
    for their matrix products, convolutions and attention (the parameters stay float32)."""

    def __init__(self, dtype: Any = DT.BFLOAT16) -> None:
        self.dtype = None if dtype is None else DT.from_any(dtype)
        if self.dtype not in (None, DT.BFLOAT16, DT.FLOAT16, DT.FLOAT32):
            raise InvalidArgumentError(
                f"autocast takes bfloat16, float16 or float32, got {self.dtype.name_str}")

    def __enter__(self) -> "autocast":
        self._prev = compute_dtype()
        _local.autocast = None if self.dtype is DT.FLOAT32 else self.dtype
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.autocast = self._prev


# -- the tape ---------------------------------------------------------------------------------
class Tensor:
    """A CudaTensor (`data`) with an optional gradient (`grad`, a CudaTensor) and the Function
    that made it (`_ctx`, None for leaves and for results made without recording)."""

    __slots__ = ("data", "grad", "requires_grad", "_ctx", "_index", "__weakref__")

    def __init__(self, data: CudaTensor, requires_grad: bool = False) -> None:
        if not isinstance(data, CudaTensor):
            raise InvalidArgumentError(
                f"Tensor wraps a CudaTensor, got {type(data).__name__} (use "
                f"autograd.tensor(array) for host data)")
        self.data = data
        self.grad: Optional[CudaTensor] = None
        self.requires_grad = bool(requires_grad)
        self._ctx: Optional[Function] = None
        self._index = 0

    # -- properties and host access
    @property
    def shape(self) -> Tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> CudaDataType:
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return self.data.size

    @property
    def is_leaf(self) -> bool:
        return self._ctx is None

    def numpy(self) -> np.ndarray:
        return apis()[0].to_numpy(self.data)

    def item(self) -> float:
        if self.size != 1:
            raise InvalidArgumentError(f"item() needs a one-element tensor, got shape {self.shape}")
        return float(self.numpy().reshape(()))

    def detach(self) -> "Tensor":
        """The same data, outside the tape."""
        return Tensor(self.data)

    def __repr__(self) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype.name_str}{grad})"

    # -- backward
    def backward(self, grad: Optional[Union[CudaTensor, "Tensor"]] = None) -> None:
        """Accumulate d self / d leaf into every leaf's `.grad` that requires one; the tape
        below self is released as it is walked. grad defaults to 1 for a one-element self."""
        if not self.requires_grad:
            raise InvalidArgumentError(
                "backward() on a tensor that does not require grad: no input of the ops that "
                "made it had requires_grad=True, or it was computed under no_grad()")
        m = apis()[0]
        if grad is None:
            if self.size != 1:
                raise InvalidArgumentError(
                    f"backward() without a gradient needs a one-element tensor (a loss), got "
                    f"shape {self.shape}; pass grad= of that shape")
            grad = m.ones(self.shape, self.dtype, self.data.device_id)
        grad = grad.data if isinstance(grad, Tensor) else grad
        _check_grad(grad, self, "backward(grad=)")
        if self._ctx is None:
            _accumulate(m, self, grad)
            return
        root, self._ctx = self._ctx, None
        order = _topo(root)
        pending: Dict[Function, List[Optional[CudaTensor]]] = {root: [None] * root.n_out}
        pending[root][self._index] = grad
        try:
            for fn in reversed(order):
                grads = pending.pop(fn, None)
                if grads is None:       # no gradient reaches it (only non-differentiable uses)
                    continue
                if fn.parents is None:
                    raise InvalidArgumentError(
                        "backward() through a graph that was already released: every "
                        "backward() frees the tape it walked; run the forward again")
                for i, g in enumerate(grads):
                    if g is None:       # an unused output of a multi-output Function
                        shape, dtype = fn.out_meta[i]
                        grads[i] = m.zeros(shape, dtype, fn.device_id)
                parents = fn.parents
                results = fn.backward(*grads)
                if not isinstance(results, tuple):
                    results = (results,)
                del grads
                fn.release()
                for p, g in zip(parents, results):
                    if g is None or not p.requires_grad:
                        continue
                    _check_grad(g, p, type(fn).__name__ + ".backward")
                    if p._ctx is None:
                        _accumulate(m, p, g)
                    else:
                        slots = pending.setdefault(p._ctx, [None] * p._ctx.n_out)
                        acc = slots[p._index]
                        slots[p._index] = g if acc is None else m.add(acc, g)
        finally:
            for fn in order:            # what an error left unwalked goes too
                fn.release()

    # -- operators
    def __add__(self, other: Any) -> "Tensor":
        return add(self, other)

    def __radd__(self, other: Any) -> "Tensor":
        return add(other, self)

    def __sub__(self, other: Any) -> "Tensor":
        return sub(self, other)

    def __rsub__(self, other: Any) -> "Tensor":
        return sub(other, self)

    def __mul__(self, other: Any) -> "Tensor":
        return mul(self, other)

    def __rmul__(self, other: Any) -> "Tensor":
        return mul(other, self)

    def __truediv__(self, other: Any) -> "Tensor":
        return div(self, other)

    def __neg__(self) -> "Tensor":
        return Neg.apply(self)

    def __matmul__(self, other: "Tensor") -> "Tensor":
        return matmul(self, other)

    def sum(self, axis: Any = None, keepdims: bool = False) -> "Tensor":
        return Sum.apply(self, axis=axis, keepdims=keepdims)

    def mean(self, axis: Any = None, keepdims: bool = False) -> "Tensor":
        return Sum.apply(self, axis=axis, keepdims=keepdims, mean=True)

    def reshape(self, *shape: Any) -> "Tensor":
        return reshape(self, shape[0] if len(shape) == 1 else shape)

    def permute(self, *axes: Any) -> "Tensor":
        return Permute.apply(self, tuple(axes[0]) if len(axes) == 1 else tuple(axes))

    def astype(self, dtype: Any) -> "Tensor":
        return astype(self, dtype)

    def relu(self) -> "Tensor":
        return Relu.apply(self)

    def gelu(self, approximate: str = "tanh") -> "Tensor":
        return Gelu.apply(self, approximate)

    def sigmoid(self) -> "Tensor":
        return Sigmoid.apply(self)

    def tanh(self) -> "Tensor":
        return Tanh.apply(self)

    def exp(self) -> "Tensor":
        return Exp.apply(self)

    def log(self) -> "Tensor":
        return Log.apply(self)

    def softmax(self) -> "Tensor":
        return Softmax.apply(self)

    def log_softmax(self) -> "Tensor":
        return LogSoftmax.apply(self)


def tensor(values: Any, requires_grad: bool = False, dtype: Any = None,
           device_id: int = 0) -> Tensor:
    """A Tensor holding a copy of host values (dtype= converts, e.g. to bfloat16)."""
    return Tensor(apis()[0].from_numpy(np.asarray(values), device_id, dtype), requires_grad)


def _check_grad(g: Any, t: Tensor, what: str) -> None:
    if not isinstance(g, CudaTensor):
        raise InvalidArgumentError(f"{what}: a gradient must be a CudaTensor, got "
                                   f"{type(g).__name__}")
    if g.shape != t.shape:
        raise ShapeMismatchError(f"{what}: gradient of shape {g.shape} for a tensor of shape "
                                 f"{t.shape}")
    if g.dtype is not t.dtype:
        raise DTypeMismatchError(f"{what}: gradient of dtype {g.dtype.name_str} for a tensor "
                                 f"of dtype {t.dtype.name_str}")


def _accumulate(m: Any, leaf: Tensor, g: CudaTensor) -> None:
    """leaf.grad += g. Out of place: g may be shared (an add passes one gradient to both
    inputs), so no gradient is ever written after it was handed out."""
    leaf.grad = g if leaf.grad is None else m.add(leaf.grad, g)


def _topo(root: "Function") -> List["Function"]:
    """The Functions reachable from root, each after every Function it reads from."""
    order: List[Function] = []
    visited = set()
    stack: List[Tuple[Function, bool]] = [(root, False)]
    while stack:
        fn, expanded = stack.pop()
        if expanded:
            order.append(fn)
            continue
        if fn in visited:
            continue
        visited.add(fn)
        stack.append((fn, True))
        for p in fn.parents or ():
            c = p._ctx
            if c is not None and c not in visited:
                stack.append((c, False))
    return order


class Function:
    """One recorded op. Subclasses define forward(*args) on CudaTensors (Tensor arguments
    arrive as their `.data`; others as given), calling `self.save(...)` for what backward
    needs, and backward(*grad_outputs) returning one gradient (or None) per Tensor argument,
    in order. `self.needs[i]`: whether the i-th Tensor argument wants its gradient."""

    # (class-level defaults: a Function is made per op call, so its creation stays cheap)
    parents: Optional[Tuple[Tensor, ...]] = None
    saved: Tuple[Any, ...] = ()
    owned: Tuple[CudaTensor, ...] = ()
    needs: Tuple[bool, ...] = ()
    n_out = 1
    out_meta: Tuple[Tuple[Tuple[int, ...], CudaDataType], ...] = ()
    device_id = 0

    def save(self, *values: Any) -> None:
        self.saved = values

    def own(self, *tensors: CudaTensor) -> None:
        """Tensors this Function made for its backward alone: freed at release."""
        self.owned = tensors

    def release(self) -> None:
        """Drop the saved tensors and the parents; free the owned ones now."""
        for t in self.owned:
            t.free()
        self.owned = ()
        self.saved = ()
        self.parents = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def backward(self, *grads: Any, **kwargs: Any) -> Any:
        # (typed *Any, **Any so that each subclass names its own grad parameters)
        raise NotImplementedError

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        parents = []
        data = []
        record = False
        for a in args:
            if isinstance(a, Tensor):
                parents.append(a)
                data.append(a.data)
                record = record or a.requires_grad
            else:
                data.append(a)
        record = record and _local.__dict__.get("grad", True)
        fn = cls()
        fn.needs = tuple(p.requires_grad for p in parents) if record else \
            (False,) * len(parents)
        out = fn.forward(*data, **kwargs)
        if type(out) is not tuple:
            res = Tensor(out, record)
            if record:
                fn.parents = tuple(parents)
                res._ctx = fn
            return res
        results = tuple(Tensor(o, record) for o in out)
        if record:
            fn.parents = tuple(parents)
            fn.n_out = len(out)
            fn.out_meta = tuple((o.shape, o.dtype) for o in out)
            fn.device_id = out[0].device_id
            for i, t in enumerate(results):
                t._ctx, t._index = fn, i
        return results


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
    def forward(self, a: Any, b: Any) -> CudaTensor:
        self.save(getattr(a, "shape", None), getattr(b, "shape", None))
        return apis()[0].add(a, b)

    def backward(self, g: CudaTensor) -> tuple:
        m = apis()[0]
        return tuple(unbroadcast(m, g, s) for s in self.saved if s is not None)


class Sub(Function):
    def forward(self, a: Any, b: Any) -> CudaTensor:
        self.save(getattr(a, "shape", None), getattr(b, "shape", None))
        return apis()[0].subtract(a, b)

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


class Exp(Function):
    def forward(self, x: CudaTensor) -> CudaTensor:
        y = apis()[0].exp(x)
        self.save(y)
        return y

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[0].multiply(g, self.saved[0])


class Log(Function):
    def forward(self, x: CudaTensor) -> CudaTensor:
        self.save(x)
        return apis()[0].log(x)

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[0].divide(g, self.saved[0])


class Relu(Function):
    def forward(self, x: CudaTensor) -> CudaTensor:
        self.save(x)
        return apis()[0].relu(x)

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[1].relu_backward(g, self.saved[0])


class Gelu(Function):
    def forward(self, x: CudaTensor, approximate: str = "tanh") -> CudaTensor:
        self.save(x, approximate)
        return apis()[1].gelu(x, approximate)

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[1].gelu_backward(g, *self.saved)


class Sigmoid(Function):
    def forward(self, x: CudaTensor) -> CudaTensor:
        y = apis()[0].sigmoid(x)
        self.save(y)
        return y

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[1].sigmoid_backward(g, self.saved[0])


class Tanh(Function):
    def forward(self, x: CudaTensor) -> CudaTensor:
        y = apis()[0].tanh(x)
        self.save(y)
        return y

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[1].tanh_backward(g, self.saved[0])


class Softmax(Function):
    """Over the last axis."""

    def forward(self, x: CudaTensor) -> CudaTensor:
        y = apis()[0].softmax(x)
        self.save(y)
        return y

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[1].softmax_backward(g, self.saved[0])


class LogSoftmax(Function):
    """Over the last axis."""

    def forward(self, x: CudaTensor) -> CudaTensor:
        y = apis()[0].log_softmax(x)
        self.save(y)
        return y

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[1].log_softmax_backward(g, self.saved[0])


# -- shapes and reductions --------------------------------------------------------------------
class Reshape(Function):
    def forward(self, x: CudaTensor, shape: Any) -> CudaTensor:
        self.save(x.shape)
        return apis()[0].reshape(x, shape)

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[0].reshape(g, self.saved[0])


class Permute(Function):
    def forward(self, x: CudaTensor, axes: Tuple[int, ...]) -> CudaTensor:
        self.save(tuple(int(i) for i in np.argsort(axes)))   # the inverse permutation
        return apis()[0].permute(x, axes)

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[0].permute(g, self.saved[0])


class Astype(Function):
    def forward(self, x: CudaTensor, dtype: CudaDataType) -> CudaTensor:
        self.save(x.dtype)
        return apis()[0].astype(x, dtype)

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[0].astype(g, self.saved[0])


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


# -- layers -----------------------------------------------------------------------------------
def _rows(m: Any, x: CudaTensor) -> CudaTensor:
    """x as a 2-D (rows, last dim) view."""
    return x if x.ndim == 2 else m.reshape(x, (-1, x.shape[-1]))


class MatMul(Function):
    def forward(self, a: CudaTensor, b: CudaTensor, precision: Optional[str] = None) -> CudaTensor:
        self.save(a, b, precision)
        return apis()[0].matrix_multiply(a, b, precision)

    def backward(self, g: CudaTensor) -> tuple:
        return apis()[1].matmul_backward(g, *self.saved)


def matmul(a: Tensor, b: Tensor, precision: Optional[str] = None) -> Tensor:
    return MatMul.apply(*_promote(a, b), precision)


class Linear(Function):
    """y = x Wᵀ + b over x's last axis (x of any rank >= 2); gelu=True: GELU(y) fused
    (fused_linear_gelu, whose backward recomputes x Wᵀ + b rather than saving it)."""

    def forward(self, x: CudaTensor, w: CudaTensor, b: Optional[CudaTensor] = None,
                gelu: bool = False, precision: Optional[str] = None) -> CudaTensor:
        m, ml = apis()
        x2 = _rows(m, x)
        self.save(x2, w, b, gelu, precision, x.shape)
        y = ml.fused_linear_gelu(x2, w, b, precision) if gelu else \
            ml.linear(x2, w, b, precision)
        return y if x.ndim == 2 else m.reshape(y, x.shape[:-1] + (w.shape[0],))

    def backward(self, g: CudaTensor) -> tuple:
        m, ml = apis()
        x2, w, b, gelu, precision, shape = self.saved
        g2 = _rows(m, g)
        if gelu:
            dx, dw, db = ml.fused_linear_gelu_backward(g2, x2, w, b, precision)
        else:
            dx, dw, db = ml.linear_backward(g2, x2, w, b is not None, precision)
        dx = dx if len(shape) == 2 else m.reshape(dx, shape)
        return (dx, dw) if b is None else (dx, dw, db)


def linear(x: Tensor, w: Tensor, b: Optional[Tensor] = None, gelu: bool = False,
           precision: Optional[str] = None) -> Tensor:
    return Linear.apply(x, w, b, gelu, precision)


class Embedding(Function):
    """weight[ids] (take along axis 0); the gradient scatter-adds rows back."""

    def forward(self, w: CudaTensor, ids: CudaTensor, check: bool = True) -> CudaTensor:
        self.save(ids, w.shape, w.dtype)
        return apis()[0].take(w, ids, axis=0, check_bounds=check)

    def backward(self, g: CudaTensor) -> CudaTensor:
        m = apis()[0]
        ids, shape, dtype = self.saved
        dw = m.zeros(shape, dtype, g.device_id)
        return m.scatter_add(dw, ids, g, axis=0, check_bounds=False)


class LayerNorm(Function):
    def forward(self, x: CudaTensor, w: Optional[CudaTensor], b: Optional[CudaTensor],
                eps: float = 1e-5) -> CudaTensor:
        self.save(x, w, b is not None, eps)
        return apis()[1].layer_norm(x, w, b, eps)

    def backward(self, g: CudaTensor) -> tuple:
        x, w, has_b, eps = self.saved
        dx, dw, db = apis()[1].layer_norm_backward(g, x, w, eps)
        return (dx,) + ((dw,) if w is not None else ()) + ((db,) if has_b else ())


class BatchNorm(Function):
    """batch_norm per channel (axis 1); in training it updates the running statistics in
    place, as the forward op does."""

    def forward(self, x: CudaTensor, gamma: CudaTensor, beta: CudaTensor, mean: CudaTensor,
                var: CudaTensor, training: bool, momentum: float, eps: float) -> CudaTensor:
        self.save(x, gamma, eps, training, None if training else mean,
                  None if training else var)
        return apis()[1].batch_norm(x, gamma, beta, mean, var, eps, training, momentum)

    def backward(self, g: CudaTensor) -> tuple:
        x, gamma, eps, training, mean, var = self.saved
        return apis()[1].batch_norm_backward(g, x, gamma, eps, training, mean, var)


class Conv2d(Function):
    def forward(self, x: CudaTensor, w: CudaTensor, b: Optional[CudaTensor], config: Any,
                precision: Optional[str] = None) -> CudaTensor:
        self.save(x, w, b is not None, config, precision)
        return apis()[1].conv2d(x, w, config, b, precision)

    def backward(self, g: CudaTensor) -> tuple:
        x, w, has_b, config, precision = self.saved
        dx, dw, db = apis()[1].conv2d_backward(g, x, w, config, has_b, precision)
        return (dx, dw, db) if has_b else (dx, dw)


class Pool2d(Function):
    def forward(self, x: CudaTensor, kind: str, pool_size: Any, stride: Any = None,
                padding: Any = (0, 0)) -> CudaTensor:
        self.save(x, kind, pool_size, stride, padding)
        ml = apis()[1]
        op = ml.max_pool2d if kind == "max" else ml.avg_pool2d
        return op(x, pool_size, stride, padding)

    def backward(self, g: CudaTensor) -> CudaTensor:
        x, kind, pool_size, stride, padding = self.saved
        ml = apis()[1]
        op = ml.max_pool2d_backward if kind == "max" else ml.avg_pool2d_backward
        return op(g, x, pool_size, stride, padding)


class Dropout(Function):
    """Dropout with a given seed: the backward regenerates the same mask from it."""

    def forward(self, x: CudaTensor, keep_prob: float, seed: int) -> CudaTensor:
        self.save(keep_prob, seed)
        return apis()[1].dropout(x, keep_prob, seed)

    def backward(self, g: CudaTensor) -> CudaTensor:
        return apis()[1].dropout_backward(g, *self.saved)


class Attention(Function):
    """flash_attention over (batch, heads, seq, head_dim); the log-sum-exp rows it returns are
    kept for the backward only (and not computed when nothing is recorded)."""

    def forward(self, q: CudaTensor, k: CudaTensor, v: CudaTensor,
                scale: Optional[float] = None, causal: bool = False) -> CudaTensor:
        ml = apis()[1]
        if not any(self.needs):
            return ml.flash_attention(q, k, v, scale, causal)
        out, lse = ml.flash_attention(q, k, v, scale, causal, return_lse=True)
        self.save(q, k, v, out, lse, scale, causal)
        self.own(lse)
        return out

    def backward(self, g: CudaTensor) -> tuple:
        return apis()[1].flash_attention_backward(g, *self.saved)


def attention(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None,
              causal: bool = False) -> Tensor:
    return Attention.apply(q, k, v, scale, causal)


class CrossEntropy(Function):
    """The fused cross-entropy of logits (..., C) against labels (...,), mean or sum."""

    def forward(self, logits: CudaTensor, labels: CudaTensor, reduction: str = "mean",
                ignore_index: int = -100, check: bool = True) -> CudaTensor:
        m, ml = apis()
        x2 = _rows(m, logits)
        y = labels if labels.ndim == 1 else m.reshape(labels, (-1,))
        self.save(x2, y, reduction, ignore_index, logits.shape)
        return ml.cross_entropy(x2, y, reduction, ignore_index, check)

    def backward(self, g: CudaTensor) -> CudaTensor:
        m, ml = apis()
        x2, y, reduction, ignore_index, shape = self.saved
        dx = ml.cross_entropy_backward(x2, y, g, reduction, ignore_index, False)
        return dx if len(shape) == 2 else m.reshape(dx, shape)


def capturing(device_id: int) -> bool:
    """Whether this thread is recording a CUDA graph on the device: ops that would read a flag
    back from the device (label and index checks) skip it then."""
    from .streams import capturing as is_capturing
    return is_capturing(device_id)
