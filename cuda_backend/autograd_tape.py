"""The autograd tape: `Tensor` (a CudaTensor with a gradient and the Function that made it),
`Function` (one recorded op: forward, saved tensors, backward), the backward walk, and the
thread-local modes (`no_grad`, `autocast`) that decide what is recorded and in which dtype.

Each op's result `Tensor` points at the `Function` that made it (`_ctx`); a Function holds an
`Edge` per parent (the parent's Function, output index, shape and dtype, not its data: an
intermediate result is freed as soon as nothing but the tape refers to it, as in PyTorch) or
the parent itself when it is a leaf, and the CudaTensors its backward needs (`save`). `backward()` sorts the
Functions reachable from the loss (parents first), runs them in reverse, sums the gradients
arriving at one tensor with `CudaMath.add`, and releases each Function (its saved tensors and
parents) as soon as its backward has run, so the pool is back to the parameters, their
gradients and what the caller still holds. Under `no_grad()` (or when no input requires a
gradient) nothing is recorded. The tape lives only in these references: an exception in the
middle of a forward leaves nothing behind once its traceback is dropped.

The op-by-op rules (Function subclasses) are in `autograd_ops` and `autograd_layers`;
Tensor's operators and methods call `autograd_ops`, imported at the end of this module since
its rules subclass `Function` (either module may be imported first).
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from .dtypes import CudaDataType
from .errors import DTypeMismatchError, InvalidArgumentError, ShapeMismatchError
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


def capturing(device_id: int) -> bool:
    """Whether this thread is recording a CUDA graph on the device: ops that would read a flag
    back from the device (label and index checks) skip it then."""
    from .streams import capturing as is_capturing
    return is_capturing(device_id)


# -- the tape ---------------------------------------------------------------------------------
def _of_data(name: str) -> Any:
    """A read-only Tensor property: the attribute `name` of its CudaTensor `data`."""
    return property(lambda self: getattr(self.data, name), doc=f"data.{name}")


def _unary(rule: str) -> Any:
    """A Tensor method applying the autograd_ops Function `rule` to the tensor."""
    def method(self: "Tensor") -> "Tensor":
        return getattr(autograd_ops, rule).apply(self)
    return method


def _operator(name: str, reflected: bool = False) -> Any:
    """Tensor's binary operator calling autograd_ops.<name>(self, other) (reflected: (other,
    self)); the function is looked up per call, autograd_ops being imported last."""
    def operator(self: "Tensor", other: Any) -> "Tensor":
        fn = getattr(autograd_ops, name)
        return fn(other, self) if reflected else fn(self, other)
    return operator


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
    shape = _of_data("shape")
    dtype = _of_data("dtype")
    ndim = _of_data("ndim")
    size = _of_data("size")

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
    __add__ = _operator("add")
    __radd__ = _operator("add", reflected=True)
    __sub__ = _operator("sub")
    __rsub__ = _operator("sub", reflected=True)
    __mul__ = _operator("mul")
    __rmul__ = _operator("mul", reflected=True)
    __truediv__ = _operator("div")
    __matmul__ = _operator("matmul")

    def __neg__(self) -> "Tensor":
        return autograd_ops.Neg.apply(self)

    def sum(self, axis: Any = None, keepdims: bool = False) -> "Tensor":
        return autograd_ops.Sum.apply(self, axis=axis, keepdims=keepdims)

    def mean(self, axis: Any = None, keepdims: bool = False) -> "Tensor":
        return autograd_ops.Sum.apply(self, axis=axis, keepdims=keepdims, mean=True)

    def reshape(self, *shape: Any) -> "Tensor":
        return autograd_ops.reshape(self, shape[0] if len(shape) == 1 else shape)

    def permute(self, *axes: Any) -> "Tensor":
        return autograd_ops.Permute.apply(self,
                                          tuple(axes[0]) if len(axes) == 1 else tuple(axes))

    def astype(self, dtype: Any) -> "Tensor":
        return autograd_ops.astype(self, dtype)

    relu = _unary("Relu")
    sigmoid = _unary("Sigmoid")
    tanh = _unary("Tanh")
    exp = _unary("Exp")
    log = _unary("Log")
    softmax = _unary("Softmax")
    log_softmax = _unary("LogSoftmax")

    def gelu(self, approximate: str = "tanh") -> "Tensor":
        return autograd_ops.Gelu.apply(self, approximate)


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


class Edge:
    """A non-leaf parent as the tape sees it: what routes and checks its gradient (the
    Function that made it and which output it was, its shape and dtype), without its data
    (tests/test_autograd.py checks that intermediates are freed during the forward)."""

    __slots__ = ("_ctx", "_index", "shape", "dtype")
    requires_grad = True

    def __init__(self, t: Tensor) -> None:
        self._ctx, self._index = t._ctx, t._index
        self.shape, self.dtype = t.data.shape, t.data.dtype


class _Constant:
    """A parent that takes no gradient (a leaf without requires_grad)."""

    __slots__ = ()
    requires_grad = False
    _ctx = None


_CONSTANT = _Constant()


def _edges(parents: List[Tensor]) -> Tuple[Any, ...]:
    """What a Function keeps of its parents: leaves that take a gradient as they are (it
    accumulates into them), recorded results as Edges, other leaves as nothing."""
    return tuple(Edge(p) if p._ctx is not None else p if p.requires_grad else _CONSTANT
                 for p in parents)


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
    parents: Optional[Tuple[Any, ...]] = None     # leaf Tensors and Edges
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
                fn.parents = _edges(parents)
                res._ctx = fn
            return res
        results = tuple(Tensor(o, record) for o in out)
        if record:
            fn.parents = _edges(parents)
            fn.n_out = len(out)
            fn.out_meta = tuple((o.shape, o.dtype) for o in out)
            fn.device_id = out[0].device_id
            for i, t in enumerate(results):
                t._ctx, t._index = fn, i
        return results


from . import autograd_ops  # noqa: E402  (last: its rules subclass Function, see the docstring)
