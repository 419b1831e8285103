"""`CudaMath`: tensor math on the GPU, NumPy underneath in fallback mode.

The public methods check their operands and hand off to one module per operation family
in `cuda_backend/ops/` (elementwise, reduction, softmax, transpose, matmul), each of which
renders its template in `templates/`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple, Union

import numpy as np

from .backend import CudaBackend, get_cuda_backend
from .dlpack_import import from_dlpack as dlpack_import
from .dtypes import CudaDataType, from_host_dtype
from .errors import InvalidArgumentError
from .process_wide import ProcessWide
from .kernels import KernelGenerator
from .ops import common
from .ops import elementwise as ew
from .ops import indexing as ix
from .ops import matmul as mm
from .ops import reduction as red
from .ops import shape as sh
from .ops import softmax as sm
from .ops import transpose as tr
from .tensor import CudaTensor
from .tensor_math import register_math, set_math_factory
from .transfers import bf16_from_host

Operand = Union[CudaTensor, int, float]
_BF16 = CudaDataType.BFLOAT16   # (an Enum member's class attribute lookup costs ~0.3 us)
Axis = Union[None, int, Tuple[int, ...]]


# -- CudaMath's one-line methods, one per op of a family (tables in the class) ---------------
def _binary(op: str) -> Callable[[CudaMath, Operand, Operand], CudaTensor]:
    def method(self: CudaMath, a: Operand, b: Operand) -> CudaTensor:
        # the common calls: binary()'s plans, looked up here (one call less)
        if type(a) is CudaTensor:
            if type(b) is CudaTensor:
                plan = self.ew_binary_plans.get((op, a.dtype._name_, a.device_id)) \
                    if a.shape == b.shape else None
                res = None if plan is None else plan(a, b)
            elif type(b) is float or type(b) is int:
                plan = self.ew_scalar_plans.get((op, a.dtype._name_, a.device_id))
                res = None if plan is None else plan(a, b, 1)
            else:
                res = None
            if res is not None:
                return res
        return ew.binary(self, op, a, b)
    return common.named_method(method, "CudaMath", op,
                               f"{op}(a, b) elementwise with NumPy broadcasting; a and b "
                               f"tensors of one dtype or scalars (ops/elementwise.py).")


def _unary(op: str) -> Callable[[CudaMath, CudaTensor], CudaTensor]:
    def method(self: CudaMath, x: CudaTensor) -> CudaTensor:
        return ew.unary(self, op, x)
    return common.named_method(method, "CudaMath", op,
                               f"{op}(x) elementwise (ops/elementwise.py).")


def _reduce(op: str) -> Callable[[CudaMath, CudaTensor, Axis, bool], CudaTensor]:
    def method(self: CudaMath, tensor: CudaTensor, axis: Axis = None,
               keepdims: bool = False) -> CudaTensor:
        return red.reduce(self, op, tensor, axis, keepdims)
    return common.named_method(method, "CudaMath", f"reduce_{op}",
                               f"The {op} over the flattened tensor or the axes given "
                               f"(ops/reduction.py).")


def _compare(op: str, doc: str = "") -> Callable[[CudaMath, Operand, Operand], CudaTensor]:
    def method(self: CudaMath, a: Operand, b: Operand) -> CudaTensor:
        return ix.compare(self, op, a, b)
    return common.named_method(method, "CudaMath", op,
                               doc or f"{op}(a, b) elementwise with NumPy broadcasting: a "
                                      f"bool tensor (ops/indexing.py).")


class CudaMath:
    """Tensors and math operations on the backend's devices."""

    def __init__(self, backend: Optional[CudaBackend] = None) -> None:
        self.backend = backend or get_cuda_backend()
        self.generator = KernelGenerator(self.backend)
        self._autotuner: Any = None         # an autotune.Autotuner, made on first use
        self.ew_binary_plans: dict = {}   # elementwise per-call plans (ops/elementwise.py)
        self.ew_unary_plans: dict = {}
        self.ew_scalar_plans: dict = {}
        self.plans: dict = {}   # per-call plans of the other ops: ops/common.py `plan_for`
        register_math(self.backend, self)   # the backend's tensors' operators use the first

    @property
    def gpu(self) -> bool:
        """True when operations run on a GPU, False in NumPy fallback mode."""
        return self.backend.is_available

    @property
    def autotuner(self) -> Any:
        if self._autotuner is None:
            from .autotune import Autotuner
            self._autotuner = Autotuner(self.backend)
        return self._autotuner

    def kernel(self, template: str, device_id: int, **params: Any) -> Any:
        """Compiled kernel for a template and parameters (memoized per device)."""
        return self.generator.get_kernel(template, device_id=device_id, **params)

    # -- tensors ----------------------------------------------------------------------
    def create_tensor(self, shape: Any, dtype: Any = CudaDataType.FLOAT32,
                      device_id: Optional[int] = None) -> CudaTensor:
        """An uninitialized tensor on the current device (or device_id)."""
        return self.backend.empty(shape, CudaDataType.from_any(dtype), device_id)

    def from_numpy(self, array: Any, device_id: Optional[int] = 0,
                   dtype: Any = None, bits: bool = False) -> CudaTensor:
        """Copy a host array to a new tensor; dtype= converts (e.g. to bfloat16). An
        ml_dtypes.bfloat16 array makes a bfloat16 tensor as it is; bits=True takes a uint16
        array as bfloat16 bit patterns (a uint16 array with dtype="bfloat16" raises: its
        numbers would be converted, not its bits)."""
        if bits:
            return bf16_from_host(self, array, dtype, device_id, bits=True)
        if type(array) is np.ndarray and dtype is None:
            a = array     # the common call: the array's dtype, remembered
            target = from_host_dtype(a.dtype)
        else:
            try:
                a = np.asarray(array)
            except (TypeError, ValueError) as exc:
                raise InvalidArgumentError(
                    f"from_numpy cannot make an array of the {type(array).__name__} given: "
                    f"{exc}") from None
            target = CudaDataType.from_any(dtype if dtype is not None else a.dtype)
        if target is _BF16:
            return bf16_from_host(self, a, dtype, device_id)
        dev = self.backend.current_device if device_id is None else device_id
        return common.from_host(self, a, target, dev)

    def to_numpy(self, tensor: CudaTensor) -> np.ndarray:
        """A host copy; bfloat16 comes back as ml_dtypes.bfloat16 (the same bits; NumPy
        arithmetic on it; `.astype(np.float32)` widens it exactly)."""
        if type(tensor) is CudaTensor and tensor.dtype is not CudaDataType.BFLOAT16:
            return self.backend.to_host(tensor)   # (it raises TensorFreedError when freed)
        t = common.check_tensor(tensor, "tensor")
        return self.backend.to_host(t).view(t.dtype.array_dtype)

    def free_tensor(self, tensor: CudaTensor) -> None:
        """Give the tensor's memory back to its pool now."""
        if not isinstance(tensor, CudaTensor):
            raise InvalidArgumentError(f"expected a CudaTensor, got {type(tensor).__name__}")
        tensor.free()

    def from_cuda_array(self, obj: Any, dtype: Any = None) -> CudaTensor:
        """Wrap a CuPy/PyTorch/Numba device array without copying (dtype="bfloat16" reads
        an opaque '<V2' typestr as bfloat16; PyTorch's and CuPy's are read so anyway)."""
        return CudaTensor.from_cuda_array(obj, backend=self.backend, dtype=dtype)

    def from_dlpack(self, obj: Any, copy: Optional[bool] = None) -> CudaTensor:
        """A tensor on a DLPack producer's memory (PyTorch, CuPy, JAX, NumPy arrays, or a
        capsule), zero-copy, stream-ordered; see dlpack_import.from_dlpack for when it copies."""
        return dlpack_import(obj, copy=copy, backend=self.backend)

    def to_device(self, tensor: CudaTensor, device_id: int) -> CudaTensor:
        """A copy of tensor on device_id (peer-to-peer when the devices allow)."""
        return common.check_tensor(tensor, "tensor").to(device_id)

    def fill(self, tensor: CudaTensor, value: Union[int, float]) -> CudaTensor:
        """Set every element to value, in place; returns the tensor."""
        if type(tensor) is CudaTensor:
            # the common call: the plan an earlier fill of this dtype and device made
            plan = self.plans.get(("fill", tensor.dtype, tensor.device_id))
            if plan is not None and plan(tensor, value) is not None:
                return tensor
        return ew.fill(self, common.check_tensor(tensor), value)

    def zeros(self, shape: Any, dtype: Any = CudaDataType.FLOAT32,
              device_id: Optional[int] = None) -> CudaTensor:
        if type(dtype) is CudaDataType and (device_id is None or type(device_id) is int):
            # the common call: one allocation and one fill launch (ew.full's plan)
            plan = self.plans.get(("zeros", dtype, device_id))
            if plan is not None:
                res = plan(shape)
                if res is not None:
                    return res
        return ew.full(self, "zeros", shape, dtype, device_id, 0)

    def ones(self, shape: Any, dtype: Any = CudaDataType.FLOAT32,
             device_id: Optional[int] = None) -> CudaTensor:
        if type(dtype) is CudaDataType and (device_id is None or type(device_id) is int):
            plan = self.plans.get(("ones", dtype, device_id))    # as zeros()
            if plan is not None:
                res = plan(shape)
                if res is not None:
                    return res
        return ew.full(self, "ones", shape, dtype, device_id, 1)

    def copy(self, tensor: CudaTensor) -> CudaTensor:
        """A new tensor with the same contents: a device-to-device copy queued on the
        current stream (asynchronous, as the ops' kernels are)."""
        if type(tensor) is CudaTensor:
            plan = self.plans.get(("copy", tensor.dtype, tensor.device_id))   # ew.copy's
            if plan is not None:
                res = plan(tensor)
                if res is not None:
                    return res
        return ew.copy(self, common.check_tensor(tensor))

    # -- elementwise --------------------------------------------------------------------
    def vector_add(self, a: CudaTensor, b: CudaTensor) -> CudaTensor:
        """a + b for same-shape tensors (the documented API); `add` broadcasts."""
        if type(a) is CudaTensor and type(b) is CudaTensor:
            # the common call: binary()'s plan, looked up here (one call less)
            plan = self.ew_binary_plans.get(("add", a.dtype._name_, a.device_id))
            if plan is not None:
                res = plan(a, b)
                if res is not None:
                    return res
            if a.shape == b.shape:
                return ew.binary(self, "add", a, b)   # binary checks liveness, dtype, device
        common.check_tensor(a, "a"), common.check_tensor(b, "b")
        if a.shape != b.shape:
            from .errors import ShapeMismatchError
            raise ShapeMismatchError(
                f"vector_add needs equal shapes, got {a.shape} and {b.shape} "
                f"(use add() for broadcasting)")
        return ew.binary(self, "add", a, b)

    add, subtract, multiply, divide, maximum, minimum, power = map(_binary, (
        "add", "subtract", "multiply", "divide", "maximum", "minimum", "power"))
    exp, log, sqrt, abs, tanh, negative, relu, sigmoid = map(_unary, (
        "exp", "log", "sqrt", "abs", "tanh", "negative", "relu", "sigmoid"))

    # -- reductions ---------------------------------------------------------------------
    reduce_sum, reduce_max, reduce_min, reduce_mean = map(_reduce, (
        "sum", "max", "min", "mean"))

    def argmax(self, tensor: CudaTensor, axis: Optional[int] = None,
               keepdims: bool = False) -> CudaTensor:
        """Index of the first maximum (int64), over the flattened tensor or one axis."""
        return red.argmax(self, tensor, axis, keepdims)

    def softmax(self, tensor: CudaTensor) -> CudaTensor:
        """Softmax over the last axis."""
        return sm.softmax(self, tensor, log=False)

    def log_softmax(self, tensor: CudaTensor) -> CudaTensor:
        """log(softmax(x)) over the last axis, computed stably."""
        return sm.softmax(self, tensor, log=True)

    # -- matrices -----------------------------------------------------------------------
    def matrix_transpose(self, tensor: CudaTensor) -> CudaTensor:
        """Transpose of a 2-D tensor (or of the last two axes of a 3-D one)."""
        return tr.transpose(self, tensor)

    def matrix_multiply(self, a: CudaTensor, b: CudaTensor,
                        precision: Optional[str] = None) -> CudaTensor:
        """a @ b for 2-D, or batched 3-D (B,M,K)@(B,K,N) with a broadcast batch.

        float32 by default times 3xTF32 tensor-core configs (float32-level error) beside the
        CUDA-core ones and keeps the faster; "ieee": CUDA cores only; "tf32": TF32 tensor cores.
        float16/bfloat16 use tensor cores with float32 accumulation.
        """
        return mm.matmul(self, a, b, precision)

    # -- shapes (ops/shape.py): views where the layout allows, else strided copies --------
    def reshape(self, tensor: CudaTensor, shape: Any) -> CudaTensor:
        """The tensor with a new shape of as many elements (one dim may be -1): a view on the
        same memory (no copy), keeping the tensor alive."""
        return sh.reshape(self, tensor, shape)

    def view(self, tensor: CudaTensor, shape: Any) -> CudaTensor:
        """reshape (PyTorch's name): a view on the same memory."""
        return sh.reshape(self, tensor, shape, "view")

    def permute(self, tensor: CudaTensor, axes: Sequence[int]) -> CudaTensor:
        """The axes reordered (out.shape[i] = tensor.shape[axes[i]]), as a new contiguous
        tensor (a view when only size-1 axes move)."""
        return sh.permute(self, tensor, tuple(axes) if type(axes) is list else axes)

    def transpose(self, tensor: CudaTensor, axes: Optional[Sequence[int]] = None) -> CudaTensor:
        """NumPy's transpose: axes reversed by default, else permute(tensor, axes)."""
        return sh.transpose(self, tensor, tuple(axes) if type(axes) is list else axes)

    def getitem(self, tensor: CudaTensor, key: Any) -> CudaTensor:
        """tensor[key]: NumPy basic indexing (ints, slices with steps, None, Ellipsis); a view
        when the result is contiguous in memory, else a copy. An int tensor key: take."""
        return sh.getitem(self, tensor, key)

    def concatenate(self, tensors: Sequence[CudaTensor], axis: Optional[int] = 0) -> CudaTensor:
        """np.concatenate of tensors of one dtype along axis (None: flattened)."""
        return sh.concatenate(self, tensors, axis)

    def stack(self, tensors: Sequence[CudaTensor], axis: int = 0) -> CudaTensor:
        """np.stack: tensors of one shape joined along a new axis."""
        return sh.stack(self, tensors, axis)

    def split(self, tensor: CudaTensor, indices_or_sections: Any,
              axis: int = 0) -> list:
        """np.split: a list of pieces along axis (views where contiguous, else copies)."""
        return sh.split(self, tensor, indices_or_sections, axis)

    def broadcast_to(self, tensor: CudaTensor, shape: Any) -> CudaTensor:
        """np.broadcast_to, materialized as a new tensor."""
        return sh.broadcast_to(self, tensor, shape)

    def astype(self, tensor: CudaTensor, dtype: Any) -> CudaTensor:
        """A new tensor converted to dtype (NumPy's astype; see ops/shape.py)."""
        return sh.astype(self, tensor, dtype)

    # -- comparisons and indexing (ops/indexing.py) ---------------------------------------
    equal = _compare("equal", "a == b elementwise with broadcasting: a bool tensor.")
    not_equal, less, less_equal, greater, greater_equal = map(_compare, (
        "not_equal", "less", "less_equal", "greater", "greater_equal"))

    def where(self, cond: CudaTensor, a: Operand, b: Operand) -> CudaTensor:
        """np.where(cond, a, b): cond a bool tensor; a, b tensors of one dtype or scalars."""
        return ix.where(self, cond, a, b)

    def take(self, tensor: CudaTensor, indices: CudaTensor, axis: Optional[int] = 0,
             check_bounds: bool = True) -> CudaTensor:
        """np.take by int32/int64 indices (an embedding lookup: take(weight, ids)). With
        check_bounds (default) an out-of-range index is an IndexOutOfRangeError, found by the
        copy itself and raised by the next synchronizing call (see ops/indexing.py)."""
        return ix.take(self, tensor, indices, axis, check_bounds)

    def gather(self, tensor: CudaTensor, indices: CudaTensor, axis: Optional[int],
               check_bounds: bool = True) -> CudaTensor:
        """np.take_along_axis (torch.gather's layout); bounds as take."""
        return ix.gather(self, tensor, indices, axis, check_bounds)

    def scatter_add(self, target: CudaTensor, indices: CudaTensor, src: CudaTensor,
                    axis: int = 0, check_bounds: bool = True) -> CudaTensor:
        """np.add.at(target, (:,) * axis + (indices,), src) in place (take's adjoint: the
        embedding backward); returns target. Float results vary run to run in rounding
        (atomic adds in any order); bounds as take."""
        return ix.scatter_add(self, target, indices, src, axis, check_bounds)

    # -- benchmarks ---------------------------------------------------------------------
    def benchmark_operations(self, sizes: Sequence[Tuple[int, ...]],
                             iterations: int = 20) -> dict:
        """{operation: {size: {"average_time_ms", "gflops" or "gbps", ...}}} (the documented
        API's format)."""
        from .math_benchmark import benchmark_operations
        return benchmark_operations(self, sizes, iterations)


def _math_for_backend(backend: CudaBackend) -> CudaMath:
    """The factory tensor operators call for a backend no CudaMath was made for yet: the
    process backend gets get_cuda_math()'s, any other a new CudaMath (each registers)."""
    from .backend import is_process_backend
    if is_process_backend(backend):
        return get_cuda_math()
    return CudaMath(backend)


set_math_factory(_math_for_backend)

_math = ProcessWide(lambda: CudaMath(get_cuda_backend()))


def get_cuda_math() -> CudaMath:
    """The CudaMath instance for the process-wide backend."""
    return _math.get()
