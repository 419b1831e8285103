"""`TensorOperators`, the part of CudaTensor (tensor.py) that calls into CudaMath: the
arithmetic operators, the Python scalar conversions, and the shape methods (reshape, view,
permute, transpose, astype, T, indexing, to, numpy), each on the CudaMath of the tensor's
backend (tensor_math.py). Comparisons stay in tensor.py, beside `__hash__`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Tuple

import numpy as np

from .dtypes import CudaDataType
from .errors import DTypeMismatchError, InvalidArgumentError
from .tensor_math import backend_of, math_of

if TYPE_CHECKING:
    from .tensor import CudaTensor

_INTEGERS = frozenset((CudaDataType.INT32, CudaDataType.INT64, CudaDataType.UINT8))


class TensorOperators:
    """CudaTensor's operators and conversions (a mixin: CudaTensor holds the state)."""

    __slots__ = ()
    if TYPE_CHECKING:
        shape: Tuple[int, ...]
        dtype: CudaDataType
        device_id: int
        size: int

        def check_alive(self) -> "CudaTensor": ...

    # -- operators (CudaMath) -----------------------------------------------------
    # Makes NumPy return NotImplemented from `ndarray + tensor`, so that Python calls
    # __radd__, instead of NumPy treating the tensor as an object and making an object array.
    __array_ufunc__ = None

    def __add__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = host_operand(other, "+")
        return math_of(self).add(self, other)

    def __radd__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = host_operand(other, "+")
        return math_of(self).add(other, self)

    def __sub__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = host_operand(other, "-")
        return math_of(self).subtract(self, other)

    def __rsub__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = host_operand(other, "-")
        return math_of(self).subtract(other, self)

    def __mul__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = host_operand(other, "*")
        return math_of(self).multiply(self, other)

    def __rmul__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = host_operand(other, "*")
        return math_of(self).multiply(other, self)

    def __truediv__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = host_operand(other, "/")
        return math_of(self).divide(self, other)

    def __rtruediv__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = host_operand(other, "/")
        return math_of(self).divide(other, self)

    def __pow__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = host_operand(other, "**")
        return math_of(self).power(self, other)

    def __rpow__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = host_operand(other, "**")
        return math_of(self).power(other, self)

    def __matmul__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = host_operand(other, "@")
        return math_of(self).matrix_multiply(self, other)

    def __rmatmul__(self, other: Any) -> "CudaTensor":
        if isinstance(other, np.ndarray):
            other = host_operand(other, "@")
        return math_of(self).matrix_multiply(other, self)

    def __neg__(self) -> "CudaTensor":
        return math_of(self).negative(self)

    # -- Python scalars (NumPy's rules; each reads the one element back from the device) -----
    def _require_one_element(self, what: str, hint: str = "") -> None:
        if self.size != 1:
            raise InvalidArgumentError(
                f"{what} needs a one-element tensor, got shape {self.shape} ({self.size} "
                f"elements){hint}")

    def item(self) -> Any:
        """The value of a one-element tensor as a Python float, int or bool."""
        self._require_one_element("item()", "; use to_numpy() for the values")
        return math_of(self).to_numpy(self).reshape(-1)[0].item()

    def __float__(self) -> float:
        self._require_one_element("float()")
        return float(self.item())

    def __int__(self) -> int:
        """int() of the one element (a float truncates toward zero, as NumPy's)."""
        self._require_one_element("int()")
        return int(self.item())

    def __index__(self) -> int:
        """A one-element integer tensor as an index (range(t), list[t], operator.index);
        DTypeMismatchError (a TypeError, as the protocol asks) for anything else."""
        if self.dtype not in _INTEGERS or self.size != 1:
            raise DTypeMismatchError(
                f"only a one-element integer tensor (int32, int64, uint8) converts to an "
                f"index, got a {self.dtype.name_str} tensor of shape {self.shape} "
                f"({self.size} elements)")
        return int(self.item())

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        """Refused: device memory is not copied to the host implicitly (np.asarray would
        otherwise walk the tensor element by element through __getitem__)."""
        raise InvalidArgumentError(
            "a CudaTensor is not converted to a NumPy array implicitly; use tensor.numpy() "
            "(or CudaMath.to_numpy)")

    # -- shapes and indexing (CudaMath.reshape, permute, getitem, astype) ------------------
    def __getitem__(self, key: Any) -> "CudaTensor":
        """NumPy basic indexing (a view where the result is contiguous, else a copy); an int
        tensor key takes along axis 0."""
        return math_of(self).getitem(self, key)

    def __iter__(self) -> Any:
        """The sub-tensors along axis 0 (views), as NumPy iterates; a 0-d tensor raises."""
        if not self.shape:
            raise TypeError("iteration over a 0-d tensor")
        return (self[i] for i in range(self.shape[0]))

    def reshape(self, *shape: Any) -> "CudaTensor":
        """A view of a new shape: t.reshape(2, 3) or t.reshape((2, 3)); one dim may be -1."""
        return math_of(self).reshape(self, _shape_args(shape))

    def view(self, *shape: Any) -> "CudaTensor":
        """reshape (PyTorch's name)."""
        return math_of(self).view(self, _shape_args(shape))

    def permute(self, *axes: Any) -> "CudaTensor":
        """t.permute(2, 0, 1) or t.permute((2, 0, 1)): a new tensor with the axes reordered."""
        return math_of(self).permute(self, _shape_args(axes))

    def transpose(self, *axes: Any) -> "CudaTensor":
        """NumPy's: t.transpose() reverses the axes; t.transpose(1, 0, 2) permutes them."""
        return math_of(self).transpose(self, _shape_args(axes) if axes else None)

    def astype(self, dtype: Any) -> "CudaTensor":
        """A new tensor converted to dtype (NumPy's astype)."""
        return math_of(self).astype(self, dtype)

    @property
    def T(self) -> "CudaTensor":
        """Transpose of a 2-D tensor (last two axes of a 3-D one), as a new tensor."""
        return math_of(self).matrix_transpose(self)

    def to(self, device_id: int) -> "CudaTensor":
        """A copy on another device (peer-to-peer when possible); self if already there."""
        if device_id == self.device_id:
            return self.check_alive()
        return backend_of(self).copy_to_tensor_device(self, device_id)

    def numpy(self) -> np.ndarray:
        """A host copy (bfloat16 as ml_dtypes.bfloat16; `.astype(np.float32)` widens it)."""
        return math_of(self).to_numpy(self)


def host_operand(array: np.ndarray, op: str) -> Any:
    """A NumPy operand of a tensor operator: a 0-d array is its scalar; any other array
    raises, since operators never copy host arrays to the device implicitly."""
    if array.ndim == 0:
        return array[()]
    raise DTypeMismatchError(
        f"unsupported operand for {op}: a NumPy array of shape {array.shape} and a "
        f"CudaTensor (host arrays are not copied to the device implicitly); convert the "
        f"array with from_numpy() first")


def _shape_args(args: Tuple[Any, ...]) -> Any:
    """A method's *args as one shape / axes: f(2, 3) and f((2, 3)) both give (2, 3)."""
    if len(args) == 1 and not isinstance(args[0], (int, np.integer)):
        a = args[0]
        return tuple(a) if isinstance(a, list) else a
    return tuple(args)
