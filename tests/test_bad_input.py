"""Bad-input table (README.md, Guarantees: typed errors, pools usable after errors): wrong
calls across the API, each raising the documented typed error (a subclass of
CudaBackendError) whose message names the problem; after each the pool's active bytes and
blocks are what they were before the call, and the backend still computes a correct result.

Rows run in whatever mode the backend is in (NumPy fallback without a GPU). Rows that need a
compiled kernel or the driver are marked `gpu`, rows about fallback mode itself skip on a GPU,
rows that need two GPUs are marked `multigpu`. Rows flagged `isolate` run in a subprocess:
the bug they guard against (a copy to an unknown raw pointer in fallback mode) would kill the
interpreter, not only fail the row.

Run one row: python -m pytest tests/test_bad_input.py -k "memory/free_memory-unknown-pointer"
"""
from __future__ import annotations

import gc
import math
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Type, Union

import numpy as np
import pytest

from cuda_backend import (CudaBackendError, CudaNotAvailableError, CudaOutOfMemoryError,
                          CudaTensor, DeviceMismatchError, DTypeMismatchError, InvalidArgumentError,
                          InvalidDeviceError, InvalidPointerError, KernelCompilationError,
                          KernelNotFoundError, LaunchConfigurationError, ShapeMismatchError,
                          TensorFreedError, TransferError)
from cuda_backend.cuda_ml import ActivationType, ConvolutionConfig, OptimizerState
from cuda_backend.errors import IndexOutOfRangeError, InvalidIndexError
from cuda_backend.driver import load_driver

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = load_driver()[0] is not None  # the mode the `backend` fixture will be in

gpu = pytest.mark.gpu
multigpu = pytest.mark.multigpu
fallback_only = pytest.mark.skipif(GPU, reason="about fallback mode (a GPU is present)")


SAXPY = r'''
extern "C" __global__ void saxpy_badinput(float* y, const float* x, float a, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
'''
BROKEN = 'extern "C" __global__ void broken_badinput(float* x)\n{\n    x[0] = undefined_name;\n}\n'


# -- the environment each row gets --------------------------------------------------------
class Env:
    """backend (b), CudaMath (m), CudaML (ml), the pool of device 0, and tensor helpers."""

    def __init__(self, backend: Any) -> None:
        from cuda_backend.cuda_math import get_cuda_math
        from cuda_backend.cuda_ml import get_cuda_ml
        self.b = backend
        self.m = get_cuda_math()
        self.ml = get_cuda_ml()
        self.pool = backend.memory_pools[0]
        # one past the last device: 1 in fallback mode (only the host, device 0)
        self.bad_dev = max(backend.device_count, 1)

    def t(self, shape: Any, dtype: Any = np.float32, device_id: int = 0,
          value: float = 1.0) -> CudaTensor:
        return self.m.from_numpy(np.full(shape, value, dtype=dtype), device_id=device_id)

    def freed(self, shape: Any = 4, dtype: Any = np.float32) -> CudaTensor:
        t = self.t(shape, dtype)
        t.free()
        return t

    def saxpy(self) -> str:
        self.b.compile_kernel("saxpy_badinput", SAXPY)
        return "saxpy_badinput"


@dataclass
class Bad:
    id: str
    error: Union[Type[BaseException], Tuple[Type[BaseException], ...]]
    match: str                               # regex searched in str(error)
    call: Callable[..., Any]                 # call(env, **operands): the wrong call
    setup: Optional[Callable[[Env], Dict[str, Any]]] = None  # operands, made before the call
    marks: Tuple[Any, ...] = ()
    isolate: bool = False                    # run in a subprocess (the bug crashes the process)
    # a good call before the pool is first measured: what the op keeps once made (ticket
    # counters, as a cache) is not the row's
    warm: Optional[Callable[[Env], None]] = None


ROWS = []


def row(id: str, error: Any, match: str, call: Callable[..., Any],
        setup: Optional[Callable[[Env], Dict[str, Any]]] = None, marks: Any = (),
        isolate: bool = False, warm: Optional[Callable[[Env], None]] = None) -> None:
    marks = marks if isinstance(marks, tuple) else (marks,)
    ROWS.append(Bad(id, error, match, call, setup, marks, isolate, warm))


def _found_on_device(e: Env, result: Any, free: bool = True) -> None:
    """A call whose bad input the GPU finds (cuda_backend/device_errors.py): it returned, so
    its result is freed (unless it is an operand) and the next synchronizing call raises;
    in fallback mode the call itself raised before this runs."""
    for t in (result if isinstance(result, tuple) else (result,)) if free else ():
        t.free()
    e.b.synchronize()


def _ce_warm(e: Env) -> None:
    """One good cross_entropy "mean" call: its one-launch form keeps a ticket counter per
    device and stream (ops/cross_entropy_plans.py COUNTERS), made by the first such call."""
    x, good = e.t((3, 5)), e.m.from_numpy(np.zeros(3, np.int64))
    e.ml.cross_entropy(x, good).free()
    for t in (x, good):
        t.free()
    e.b.synchronize()


class _DeviceArray:
    """What CuPy or PyTorch export for a device array: a pointer this process cannot read."""
    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0xDEAD0000, False),
                                "version": 3, "strides": None, "stream": 1}


# -- devices ------------------------------------------------------------------------------
row("device/empty-device-id-out-of-range", InvalidDeviceError, r"invalid device id \d+",
    lambda e: e.b.empty(4, device_id=e.bad_dev))
row("device/empty-negative-device-id", InvalidDeviceError, r"invalid device id -1",
    lambda e: e.b.empty(4, device_id=-1))
row("device/set_device-out-of-range", InvalidDeviceError, r"invalid device id \d+",
    lambda e: e.b.set_device(e.bad_dev))
row("device/set_device-string", InvalidDeviceError, r"invalid device id '0'",
    lambda e: e.b.set_device("0"))
row("device/with-device-block-out-of-range", InvalidDeviceError, r"invalid device id \d+",
    lambda e: _with_device(e, e.bad_dev))
row("device/get_device_info-out-of-range", InvalidDeviceError, r"invalid device id \d+",
    lambda e: e.b.get_device_info(e.bad_dev))
row("device/from_numpy-device-out-of-range", InvalidDeviceError, r"invalid device id \d+",
    lambda e: e.m.from_numpy(np.ones(3, np.float32), device_id=e.bad_dev))
row("device/tensor.to-out-of-range", InvalidDeviceError, r"invalid device id \d+",
    lambda e, a: a.to(e.bad_dev), setup=lambda e: dict(a=e.t(3)))
row("device/synchronize-out-of-range", InvalidDeviceError, r"invalid device id \d+",
    lambda e: e.b.synchronize(e.bad_dev))
row("device/add-operands-on-two-gpus", DeviceMismatchError, r"different devices: cuda:0 and cuda:1",
    lambda e, a, b: e.m.add(a, b), setup=lambda e: dict(a=e.t(8), b=e.t(8, device_id=1)),
    marks=multigpu)
row("device/context-out-of-range", InvalidDeviceError, r"invalid device id \d+",
    lambda e: e.b.context(e.bad_dev), marks=gpu)

# -- memory and pools ---------------------------------------------------------------------
row("memory/allocate_memory-negative", InvalidArgumentError, r"allocation size must be >= 0 bytes, got -1",
    lambda e: e.b.allocate_memory(-1))
row("memory/allocate_memory-float", InvalidArgumentError, r"allocation size must be a non-negative int, got 1\.5",
    lambda e: e.b.allocate_memory(1.5))
row("memory/free_memory-unknown-pointer", InvalidPointerError, r"pointer 0xdead0 was not allocated",
    lambda e: e.b.free_memory(0xDEAD0))
row("memory/free_memory-double-free", InvalidPointerError, r"was not allocated .* or was already freed",
    lambda e, p: e.b.free_memory(p),
    setup=lambda e: dict(p=_allocated_then_freed(e)))
row("memory/free_memory-None", InvalidPointerError, r"pointer None",
    lambda e: e.b.free_memory(None))
row("memory/set_limit-fraction-2", InvalidArgumentError, r"fraction must be in \[0, 1\], got 2",
    lambda e: e.pool.set_limit(fraction=2))
row("memory/set_limit-negative-size", InvalidArgumentError, r"limit must be >= 0 bytes, got -5",
    lambda e: e.pool.set_limit(size=-5))
row("memory/set_limit-size-and-fraction", InvalidArgumentError, r"give size or fraction, not both",
    lambda e: e.pool.set_limit(size=1 << 20, fraction=0.5))
row("memory/set_limit-string-size", InvalidArgumentError, r"limit must be .*got '10'",
    lambda e: e.pool.set_limit(size="10"))
row("memory/empty-negative-dim", InvalidArgumentError, r"shape dimensions must be >= 0, got \(2, -3\)",
    lambda e: e.b.empty((2, -3)))
row("memory/create_tensor-negative-size", InvalidArgumentError, r"shape dimensions must be >= 0, got \(-3,\)",
    lambda e: e.m.create_tensor(-3))
row("memory/empty-not-a-shape", InvalidArgumentError, r"shape must be an int or a tuple of ints, got 'abc'",
    lambda e: e.b.empty("abc"))
row("memory/empty-float-dimension", InvalidArgumentError, r"shape must be an int or a tuple of ints, got \(2\.7, 3\)",
    lambda e: e.b.empty((2.7, 3)))
row("memory/pinned_empty-negative", InvalidArgumentError, r"shape dimensions must be >= 0",
    lambda e: e.b.pinned_empty(-1))
row("memory/empty-float-dimension-after-the-int-shape", InvalidArgumentError,
    r"shape must be an int or a tuple of ints, got \(2\.0, 3\)",
    lambda e, a: e.b.empty((2.0, 3)), setup=lambda e: dict(a=e.b.empty((2, 3))))
row("memory/zeros-bool-dimension-after-the-int-shape", InvalidArgumentError,
    r"shape must be an int or a tuple of ints, got \(True, 3\)",
    lambda e, a: e.m.zeros((True, 3)), setup=lambda e: dict(a=e.m.zeros((1, 3))))
row("memory/empty-bytes-over-64-bits", InvalidArgumentError,
    r"float32 tensor of shape \(2147483648, 2147483648\) needs 18446744073709551616 bytes, "
    r"over the largest size a tensor can have \(2\*\*63 - 1 bytes\)",
    lambda e: e.b.empty((2 ** 31, 2 ** 31)))
row("memory/zeros-over-device-memory", CudaOutOfMemoryError,
    r"tried to allocate .* \(4611686018427387904 bytes\); a float32 tensor of shape "
    r"\(1099511627776, 1048576\) is larger than the device's total memory of \d+ bytes",
    lambda e: e.m.zeros((2 ** 40, 2 ** 20)))

# -- dtypes -------------------------------------------------------------------------------
row("dtype/create_tensor-complex64", DTypeMismatchError, r"unsupported dtype 'complex64'",
    lambda e: e.m.create_tensor(3, dtype="complex64"))
row("dtype/from_numpy-strings", DTypeMismatchError, r"unsupported dtype dtype\('<U1'\)",
    lambda e: e.m.from_numpy(np.array(["a", "b"])))
row("dtype/add-float32-float64", DTypeMismatchError, r"mixed dtypes float32 and float64",
    lambda e, a, b: e.m.add(a, b), setup=lambda e: dict(a=e.t(3), b=e.t(3, np.float64)))
row("dtype/divide-int32", DTypeMismatchError, r"divide does not support int32",
    lambda e, a: e.m.divide(a, a), setup=lambda e: dict(a=e.t(3, np.int32)))
row("dtype/exp-int32", DTypeMismatchError, r"exp does not support int32",
    lambda e, a: e.m.exp(a), setup=lambda e: dict(a=e.t(3, np.int32)))
row("dtype/softmax-int64", DTypeMismatchError, r"softmax does not support int64",
    lambda e, a: e.m.softmax(a), setup=lambda e: dict(a=e.t((2, 3), np.int64)))
row("dtype/reduce_sum-uint8", DTypeMismatchError, r"reduce_sum does not support uint8",
    lambda e, a: e.m.reduce_sum(a), setup=lambda e: dict(a=e.t(3, np.uint8)))
row("dtype/matmul-int32", DTypeMismatchError, r"matmul does not support int32",
    lambda e, a: e.m.matrix_multiply(a, a), setup=lambda e: dict(a=e.t((2, 2), np.int32)))
row("dtype/add-int32-fractional-scalar", DTypeMismatchError, r"b = 1\.5 is not an integer",
    lambda e, a: e.m.add(a, 1.5), setup=lambda e: dict(a=e.t(3, np.int32)))
row("dtype/flash_attention-float64", DTypeMismatchError, r"flash_attention does not support float64",
    lambda e, q: e.ml.flash_attention(q, q, q), setup=lambda e: dict(q=e.t((1, 1, 4, 8), np.float64)))
row("dtype/layer_norm-weight-float64", DTypeMismatchError, r"mixed dtypes float32 and float64",
    lambda e, x, w: e.ml.layer_norm(x, w, None),
    setup=lambda e: dict(x=e.t((2, 4)), w=e.t(4, np.float64)))
row("dtype/adam-m_buffer-float64", DTypeMismatchError, r"m_buffer has dtype float64, expected float32",
    lambda e, p, mb: e.ml.adam_update(p, p, mb, p, OptimizerState(0.1)),
    setup=lambda e: dict(p=e.t(4), mb=e.t(4, np.float64)))
row("dtype/copy_to_device-host-dtype", DTypeMismatchError, r"host array dtype float64 does not match the tensor's float32",
    lambda e, a: e.b.copy_to_device(np.ones(4), a), setup=lambda e: dict(a=e.t(4)))
row("dtype/cross_entropy-float-labels", DTypeMismatchError, r"cross_entropy: labels must be int32 or int64 class indices, got float32",
    lambda e, x, t: e.ml.cross_entropy(x, t), setup=lambda e: dict(x=e.t((3, 5)), t=e.t(3)))
row("dtype/cross_entropy_backward-float-labels", DTypeMismatchError, r"cross_entropy_backward: labels must be int32 or int64",
    lambda e, x, t: e.ml.cross_entropy_backward(x, t), setup=lambda e: dict(x=e.t((3, 5)), t=e.t(3, np.float64)))
row("dtype/tanh_backward-float32-float64", DTypeMismatchError, r"mixed dtypes float32 and float64",
    lambda e, g, y: e.ml.tanh_backward(g, y), setup=lambda e: dict(g=e.t(4), y=e.t(4, np.float64)))

# -- shapes -------------------------------------------------------------------------------
row("shape/add-not-broadcastable", ShapeMismatchError, r"shapes \(3,\) and \(4,\) cannot be broadcast",
    lambda e, a, b: e.m.add(a, b), setup=lambda e: dict(a=e.t(3), b=e.t(4)))
row("shape/vector_add-unequal", ShapeMismatchError, r"vector_add needs equal shapes, got \(3,\) and \(1,\)",
    lambda e, a, b: e.m.vector_add(a, b), setup=lambda e: dict(a=e.t(3), b=e.t(1)))
row("shape/matmul-inner-dimensions", ShapeMismatchError, r"inner dimensions differ: a has shape \(2, 3\)",
    lambda e, a, b: e.m.matrix_multiply(a, b), setup=lambda e: dict(a=e.t((2, 3)), b=e.t((4, 5))))
row("shape/matmul-batch-not-broadcastable", ShapeMismatchError, r"batch dimensions of a \(2, 2, 3\) and b \(3, 3, 2\)",
    lambda e, a, b: e.m.matrix_multiply(a, b), setup=lambda e: dict(a=e.t((2, 2, 3)), b=e.t((3, 3, 2))))
row("shape/matmul-0d-operand", InvalidArgumentError, r"at least 1 dimension",
    lambda e, a, b: e.m.matrix_multiply(a, b), setup=lambda e: dict(a=e.t(()), b=e.t((2, 2))))
row("shape/transpose-1d", InvalidArgumentError, r"matrix_transpose needs a 2-D or 3-D tensor, got shape \(5,\)",
    lambda e, a: e.m.matrix_transpose(a), setup=lambda e: dict(a=e.t(5)))
row("shape/copy_to_device-size", TransferError, r"shape \(5,\) \(5 elements\) does not match the tensor of shape \(4,\)",
    lambda e, a: e.b.copy_to_device(np.ones(5, np.float32), a), setup=lambda e: dict(a=e.t(4)))
row("shape/from_numpy-ragged-list", InvalidArgumentError, r"from_numpy.*(inhomogeneous|ragged)",
    lambda e: e.m.from_numpy([[1.0, 2.0], [3.0]]))
row("shape/max_pool2d-3d-input", InvalidArgumentError, r"max_pool2d needs a 4-D NCHW tensor, got shape \(1, 4, 4\)",
    lambda e, x: e.ml.max_pool2d(x, 2), setup=lambda e: dict(x=e.t((1, 4, 4))))
row("shape/avg_pool2d-window-larger-than-input", ShapeMismatchError, r"pool window \(3, 3\) .* does not fit the input",
    lambda e, x: e.ml.avg_pool2d(x, 3), setup=lambda e: dict(x=e.t((1, 1, 2, 2))))
row("shape/fused_linear_gelu-in-features", ShapeMismatchError, r"x's last dimension must equal in_features = 5",
    lambda e, x, w: e.ml.fused_linear_gelu(x, w), setup=lambda e: dict(x=e.t((2, 3)), w=e.t((4, 5))))
row("shape/sgd-gradients", ShapeMismatchError, r"gradients have shape \(3,\), params have shape \(4,\)",
    lambda e, p, g: e.ml.sgd_update(p, g, None, OptimizerState(0.1)),
    setup=lambda e: dict(p=e.t(4), g=e.t(3)))
row("shape/relu_backward-grad-x", ShapeMismatchError, r"relu_backward: grad_out has shape \(2, 3\) and x has shape \(3, 2\)",
    lambda e, g, x: e.ml.relu_backward(g, x), setup=lambda e: dict(g=e.t((2, 3)), x=e.t((3, 2))))
row("shape/gelu_backward-grad-x", ShapeMismatchError, r"gelu_backward: grad_out has shape \(4,\) and x has shape \(5,\)",
    lambda e, g, x: e.ml.gelu_backward(g, x, approximate="none"), setup=lambda e: dict(g=e.t(4), x=e.t(5)))
row("shape/softmax_backward-grad-y", ShapeMismatchError, r"softmax_backward: grad_out has shape \(2, 3\) and y has shape \(2, 4\)",
    lambda e, g, y: e.ml.softmax_backward(g, y), setup=lambda e: dict(g=e.t((2, 3)), y=e.t((2, 4))))
row("shape/cross_entropy-labels-rows", ShapeMismatchError, r"labels must have shape \(3,\) for logits of shape \(3, 5\), got \(4,\)",
    lambda e, x, t: e.ml.cross_entropy(x, t), setup=lambda e: dict(x=e.t((3, 5)), t=e.t(4, np.int64, value=0)))
row("shape/cross_entropy_backward-grad_loss-none", ShapeMismatchError, r"grad_loss has shape \(2,\), expected \(3,\) for reduction='none'",
    lambda e, x, t, g: e.ml.cross_entropy_backward(x, t, g, reduction="none"),
    setup=lambda e: dict(x=e.t((3, 5)), t=e.t(3, np.int32, value=0), g=e.t(2)))

# -- axes ---------------------------------------------------------------------------------
row("axis/reduce_sum-out-of-range", InvalidArgumentError, r"axis 2 is out of range for a tensor of 2 dimensions",
    lambda e, a: e.m.reduce_sum(a, axis=2), setup=lambda e: dict(a=e.t((2, 3))))
row("axis/reduce_mean-negative-out-of-range", InvalidArgumentError, r"axis -3 is out of range",
    lambda e, a: e.m.reduce_mean(a, axis=-3), setup=lambda e: dict(a=e.t((2, 3))))
row("axis/reduce_sum-repeated", InvalidArgumentError, r"repeated axis in \(0, -2\)",
    lambda e, a: e.m.reduce_sum(a, axis=(0, -2)), setup=lambda e: dict(a=e.t((2, 3))))
row("axis/reduce_sum-float-axis", InvalidArgumentError, r"axis must be an int, a tuple of ints or None, got 1\.5",
    lambda e, a: e.m.reduce_sum(a, axis=1.5), setup=lambda e: dict(a=e.t((2, 3))))
row("axis/argmax-tuple-axis", InvalidArgumentError, r"argmax takes one axis \(an int\) or None, got \(0, 1\)",
    lambda e, a: e.m.argmax(a, axis=(0, 1)), setup=lambda e: dict(a=e.t((2, 3))))
row("axis/argmax-out-of-range", InvalidArgumentError, r"axis 5 is out of range",
    lambda e, a: e.m.argmax(a, axis=5), setup=lambda e: dict(a=e.t((2, 3))))
row("axis/reduce_max-zero-size", InvalidArgumentError, r"zero-size reduction: reduce_max",
    lambda e, a: e.m.reduce_max(a), setup=lambda e: dict(a=e.t((0, 3))))

# -- freed tensors ------------------------------------------------------------------------
FREED = r"tensor of shape \(4,\) \(float32\) on device 0 was freed"
row("freed/add", TensorFreedError, FREED,
    lambda e, a, f: e.m.add(a, f), setup=lambda e: dict(a=e.t(4), f=e.freed()))
row("freed/to_numpy", TensorFreedError, FREED,
    lambda e, f: e.m.to_numpy(f), setup=lambda e: dict(f=e.freed()))
row("freed/reduce_sum", TensorFreedError, FREED,
    lambda e, f: e.m.reduce_sum(f), setup=lambda e: dict(f=e.freed()))
row("freed/softmax", TensorFreedError, FREED,
    lambda e, f: e.m.softmax(f), setup=lambda e: dict(f=e.freed()))
row("freed/matmul", TensorFreedError, r"tensor of shape \(2, 2\) \(float32\) on device 0 was freed",
    lambda e, a, f: e.m.matrix_multiply(a, f), setup=lambda e: dict(a=e.t((2, 2)), f=e.freed((2, 2))))
row("freed/copy_to_device-destination", TensorFreedError, FREED,
    lambda e, f: e.b.copy_to_device(np.ones(4, np.float32), f), setup=lambda e: dict(f=e.freed()))
row("freed/conv2d-kernel", TensorFreedError, r"tensor of shape \(1, 1, 3, 3\) \(float32\) on device 0 was freed",
    lambda e, x, w: e.ml.conv2d(x, w, ConvolutionConfig(3)),
    setup=lambda e: dict(x=e.t((1, 1, 5, 5)), w=e.freed((1, 1, 3, 3))))

# -- operand types ------------------------------------------------------------------------
row("operand/add-string", InvalidArgumentError, r"b must be a CudaTensor or a real number, got str",
    lambda e, a: e.m.add(a, "1"), setup=lambda e: dict(a=e.t(3)))
row("operand/add-two-scalars", InvalidArgumentError, r"add needs at least one CudaTensor operand",
    lambda e: e.m.add(1.0, 2.0))
row("operand/exp-numpy-array", InvalidArgumentError, r"x must be a CudaTensor, got ndarray",
    lambda e: e.m.exp(np.ones(3, np.float32)))
row("operand/free_tensor-numpy-array", InvalidArgumentError, r"expected a CudaTensor, got ndarray",
    lambda e: e.m.free_tensor(np.ones(3)))
row("operand/numpy-array-plus-tensor", DTypeMismatchError,
    r"unsupported operand for \+: a NumPy array of shape \(3,\) and a CudaTensor .*"
    r"convert the array with from_numpy\(\) first",
    lambda e, a: np.ones(3, np.float32) + a, setup=lambda e: dict(a=e.t(3)))
row("operand/tensor-times-numpy-array", DTypeMismatchError,
    r"unsupported operand for \*: a NumPy array of shape \(3,\) .*from_numpy\(\)",
    lambda e, a: a * np.ones(3, np.float32), setup=lambda e: dict(a=e.t(3)))
row("operand/numpy-matrix-at-tensor", DTypeMismatchError,
    r"unsupported operand for @: a NumPy array of shape \(2, 2\) .*from_numpy\(\)",
    lambda e, a: np.ones((2, 2), np.float32) @ a, setup=lambda e: dict(a=e.t((2, 2))))
row("operand/add-int32-scalar-out-of-range", InvalidArgumentError, r"b = 1099511627776 is out of range for int32",
    lambda e, a: e.m.add(a, 2 ** 40), setup=lambda e: dict(a=e.t(3, np.int32)))
row("operand/copy_from_device-into-list", TransferError, r"needs a NumPy array to write into, got list",
    lambda e, a: e.b.copy_from_device(a, [0.0] * 4), setup=lambda e: dict(a=e.t(4)))
row("operand/copy_from_device-read-only", TransferError, r"needs a writeable host array",
    lambda e, a: e.b.copy_from_device(a, _read_only(np.zeros(4, np.float32))),
    setup=lambda e: dict(a=e.t(4)))
row("transfer/copy_to_device-unknown-raw-pointer", (TransferError, InvalidPointerError),
    r"pointer 0x12345 was not allocated",
    lambda e: e.b.copy_to_device(np.ones(4, np.float32), 0x12345),
    marks=fallback_only,
    isolate=True)
row("transfer/async-copy-pageable", TransferError, r"needs page-locked host memory",
    lambda e, a: e.b.copy_to_device_async(np.ones(4, np.float32), a, None),
    setup=lambda e: dict(a=e.t(4)), marks=gpu)
row("transfer/copy_device_to_device-negative-nbytes", TransferError,
    r"nbytes must be a non-negative int number of bytes, got -4096",
    lambda e, a, b: e.b.copy_device_to_device(a, b, -4096),
    setup=lambda e: dict(a=e.t(1024), b=e.t(1024)), isolate=True)
row("transfer/copy_from_device_async-into-immutable-bytes", TransferError,
    r"needs a writeable host array \(this one is read-only",
    lambda e, a: e.b.copy_from_device_async(a, np.frombuffer(bytes(16), np.float32), None),
    setup=lambda e: dict(a=e.t(4)), isolate=True)
row("transfer/from_cuda_array-in-fallback-mode", CudaNotAvailableError,
    r"cannot wrap the device memory of a _DeviceArray in fallback mode",
    lambda e: e.m.from_cuda_array(_DeviceArray()), marks=fallback_only, isolate=True)

# -- configs and hyper-parameters ----------------------------------------------------------
row("config/ConvolutionConfig-negative-stride", InvalidArgumentError, r"stride must be >= 1, got \(-1, -1\)",
    lambda e: ConvolutionConfig(3, stride=-1))
row("config/ConvolutionConfig-zero-kernel", InvalidArgumentError, r"kernel_size must be >= 1, got \(0, 0\)",
    lambda e: ConvolutionConfig(0))
row("config/ConvolutionConfig-groups-0", InvalidArgumentError, r"groups must be an int >= 1, got 0",
    lambda e: ConvolutionConfig(3, groups=0))
row("config/ConvolutionConfig-float-kernel", InvalidArgumentError, r"kernel_size must be an int or a pair of ints",
    lambda e: ConvolutionConfig((2.5, 3)))
row("config/conv2d-channel-mismatch", ShapeMismatchError, r"channel mismatch: input of shape \(1, 3, 5, 5\) has 3 channels",
    lambda e, x, w: e.ml.conv2d(x, w, ConvolutionConfig(3)),
    setup=lambda e: dict(x=e.t((1, 3, 5, 5)), w=e.t((4, 2, 3, 3))))
row("config/conv2d-kernel-size-mismatch", ShapeMismatchError, r"config.kernel_size is \(2, 2\)",
    lambda e, x, w: e.ml.conv2d(x, w, ConvolutionConfig(2)),
    setup=lambda e: dict(x=e.t((1, 1, 5, 5)), w=e.t((1, 1, 3, 3))))
row("config/conv2d-not-a-config", InvalidArgumentError, r"config must be a ConvolutionConfig, got dict",
    lambda e, x, w: e.ml.conv2d(x, w, {"kernel_size": 3}),
    setup=lambda e: dict(x=e.t((1, 1, 5, 5)), w=e.t((1, 1, 3, 3))))
row("config/conv2d-precision-string", InvalidArgumentError, r"precision must be None, 'fp32' .* got 'fp8'",
    lambda e, x, w: e.ml.conv2d(x, w, ConvolutionConfig(3), precision="fp8"),
    setup=lambda e: dict(x=e.t((1, 1, 5, 5)), w=e.t((1, 1, 3, 3))))
row("config/conv2d-bias-shape", ShapeMismatchError, r"bias must have shape \(2,\) .* got \(3,\)",
    lambda e, x, w, bias: e.ml.conv2d(x, w, ConvolutionConfig(3), bias=bias),
    setup=lambda e: dict(x=e.t((1, 1, 5, 5)), w=e.t((2, 1, 3, 3)), bias=e.t(3)))
row("config/conv2d-padding-over-kernel", InvalidArgumentError, r"padding \(4, 4\) is larger than the kernel \(3, 3\)",
    lambda e, x, w: e.ml.conv2d(x, w, ConvolutionConfig(3, padding=4)),
    setup=lambda e: dict(x=e.t((1, 1, 5, 5)), w=e.t((1, 1, 3, 3))))
row("config/max_pool2d-padding-over-half-window", InvalidArgumentError, r"padding \(2, 2\) must be at most half of pool_size \(2, 2\)",
    lambda e, x: e.ml.max_pool2d(x, 2, padding=2), setup=lambda e: dict(x=e.t((1, 1, 4, 4))))
row("config/avg_pool2d-zero-stride", InvalidArgumentError, r"stride must be >= 1, got \(0, 0\)",
    lambda e, x: e.ml.avg_pool2d(x, 2, stride=0), setup=lambda e: dict(x=e.t((1, 1, 4, 4))))
row("config/dropout-keep_prob-0", InvalidArgumentError, r"keep_prob must be in \(0, 1\], got 0",
    lambda e, x: e.ml.dropout(x, keep_prob=0), setup=lambda e: dict(x=e.t(8)))
row("config/dropout-keep_prob-1.5", InvalidArgumentError, r"keep_prob must be in \(0, 1\], got 1\.5",
    lambda e, x: e.ml.dropout(x, keep_prob=1.5), setup=lambda e: dict(x=e.t(8)))
row("config/dropout-keep_prob-nan", InvalidArgumentError, r"keep_prob must be in \(0, 1\], got nan",
    lambda e, x: e.ml.dropout(x, keep_prob=math.nan), setup=lambda e: dict(x=e.t(8)))
row("config/dropout-keep_prob-1e-11", InvalidArgumentError,
    r"keep_prob must be >= 1\.1641532182693481e-06 \(5000 / 2\*\*32\), got 1e-11: the 32-bit "
    r"keep threshold .* = 1 keeps a fraction 2\.32831e-10",
    lambda e, x: e.ml.dropout(x, keep_prob=1e-11), setup=lambda e: dict(x=e.t(8)))
row("config/dropout-seed-string", InvalidArgumentError, r"seed must be an int or None, got 'abc'",
    lambda e, x: e.ml.dropout(x, seed="abc"), setup=lambda e: dict(x=e.t(8)))
row("config/matmul-precision-string", InvalidArgumentError, r"precision must be None, 'fp32' .* got 'fp8'",
    lambda e, a: e.m.matrix_multiply(a, a, precision="fp8"), setup=lambda e: dict(a=e.t((2, 2))))
row("config/matmul-tf32-float64", InvalidArgumentError, r"precision='tf32' applies to float32 operands only, got float64",
    lambda e, a: e.m.matrix_multiply(a, a, precision="tf32"),
    setup=lambda e: dict(a=e.t((2, 2), np.float64)))
row("config/flash_attention-head_dim-300", InvalidArgumentError, r"head_dim up to 256, got head_dim 300",
    lambda e, q: e.ml.flash_attention(q, q, q), setup=lambda e: dict(q=e.t((1, 1, 2, 300))))
row("config/flash_attention-q-k-head_dim", ShapeMismatchError, r"q and k must share head_dim",
    lambda e, q, k: e.ml.flash_attention(q, k, k),
    setup=lambda e: dict(q=e.t((1, 2, 4, 8)), k=e.t((1, 2, 4, 16))))
row("config/flash_attention-k-v-shapes", ShapeMismatchError, r"k and v must have the same shape",
    lambda e, q, v: e.ml.flash_attention(q, q, v),
    setup=lambda e: dict(q=e.t((1, 2, 4, 8)), v=e.t((1, 2, 5, 8))))
row("config/flash_attention-3d", InvalidArgumentError, r"needs 4-D .* got q of shape \(2, 4, 8\)",
    lambda e, q: e.ml.flash_attention(q, q, q), setup=lambda e: dict(q=e.t((2, 4, 8))))
row("config/flash_attention-infinite-scale", InvalidArgumentError, r"scale must be finite, got inf",
    lambda e, q: e.ml.flash_attention(q, q, q, scale=math.inf),
    setup=lambda e: dict(q=e.t((1, 1, 4, 8))))
row("config/flash_attention_packed-2d", InvalidArgumentError, r"needs a 3-D .* got shape \(4, 24\)",
    lambda e, x: e.ml.flash_attention_packed(x, 2), setup=lambda e: dict(x=e.t((4, 24))))
row("config/flash_attention_packed-columns", ShapeMismatchError, r"last dimension 20 is not divisible by 3 \* heads = 6",
    lambda e, x: e.ml.flash_attention_packed(x, 2), setup=lambda e: dict(x=e.t((1, 4, 20))))
row("config/flash_attention_packed-heads-0", InvalidArgumentError, r"heads must be a positive int, got 0",
    lambda e, x: e.ml.flash_attention_packed(x, 0), setup=lambda e: dict(x=e.t((1, 4, 24))))
row("config/flash_attention_packed-head_dim-300", InvalidArgumentError, r"head_dim up to 256, got head_dim 300",
    lambda e, x: e.ml.flash_attention_packed(x, 1), setup=lambda e: dict(x=e.t((1, 2, 900))))
row("dtype/flash_attention_packed-float64", DTypeMismatchError, r"flash_attention_packed does not support float64",
    lambda e, x: e.ml.flash_attention_packed(x, 2), setup=lambda e: dict(x=e.t((1, 4, 24), np.float64)))
row("config/flash_attention_packed-infinite-scale", InvalidArgumentError, r"scale must be finite, got inf",
    lambda e, x: e.ml.flash_attention_packed(x, 2, scale=math.inf), setup=lambda e: dict(x=e.t((1, 4, 24))))
row("config/flash_attention_packed_backward-grad-shape", ShapeMismatchError, r"grad_out has shape \(1, 4, 6\), expected .* \(1, 4, 8\)",
    lambda e, x, g, o, l: e.ml.flash_attention_packed_backward(g, x, o, l, 2),
    setup=lambda e: dict(x=e.t((1, 4, 24)), g=e.t((1, 4, 6)), o=e.t((1, 4, 8)), l=e.t((1, 2, 4))))
row("config/flash_attention_packed_backward-lse-shape", ShapeMismatchError, r"lse has shape \(1, 4, 2\), expected",
    lambda e, x, o, l: e.ml.flash_attention_packed_backward(o, x, o, l, 2),
    setup=lambda e: dict(x=e.t((1, 4, 24)), o=e.t((1, 4, 8)), l=e.t((1, 4, 2))))
row("config/batch_norm-gamma-shape", ShapeMismatchError, r"gamma has shape \(2,\), expected \(3,\)",
    lambda e, x, g, c: e.ml.batch_norm(x, g, c, c, c),
    setup=lambda e: dict(x=e.t((2, 3, 4)), g=e.t(2), c=e.t(3)))
row("config/batch_norm-negative-eps", InvalidArgumentError, r"eps must be a finite number >= 0\.0, got -1",
    lambda e, x, c: e.ml.batch_norm(x, c, c, c, c, eps=-1.0),
    setup=lambda e: dict(x=e.t((2, 3)), c=e.t(3)))
row("config/batch_norm-training-one-value", InvalidArgumentError, r"training needs more than 1 value per channel",
    lambda e, x, c: e.ml.batch_norm(x, c, c, c, c, training=True),
    setup=lambda e: dict(x=e.t((1, 3)), c=e.t(3)))
row("config/layer_norm-weight-shape", ShapeMismatchError, r"weight has shape \(3,\), expected \(4,\)",
    lambda e, x, w: e.ml.layer_norm(x, w, None), setup=lambda e: dict(x=e.t((2, 4)), w=e.t(3)))
row("config/layer_norm-nan-eps", InvalidArgumentError, r"eps must be a finite number >= 0\.0, got nan",
    lambda e, x: e.ml.layer_norm(x, None, None, eps=math.nan), setup=lambda e: dict(x=e.t((2, 4))))
row("config/activation-string-type", InvalidArgumentError, r"activation_type must be an ActivationType, got 'relu'",
    lambda e, x: e.ml.activation(x, "relu"), setup=lambda e: dict(x=e.t(3)))
row("config/leaky_relu-non-number-alpha", InvalidArgumentError, r"alpha must be .*real number",
    lambda e, x: e.ml.activation(x, ActivationType.LEAKY_RELU, alpha="abc"),
    setup=lambda e: dict(x=e.t(3)))
row("config/gelu-approximate", InvalidArgumentError, r"approximate must be 'tanh' or 'none', got 'fast'",
    lambda e, x: e.ml.gelu(x, approximate="fast"), setup=lambda e: dict(x=e.t(3)))
row("config/cross_entropy-reduction", InvalidArgumentError, r"reduction must be 'mean', 'sum' or 'none', got 'avg'",
    lambda e, x, t: e.ml.cross_entropy(x, t, reduction="avg"),
    setup=lambda e: dict(x=e.t((3, 5)), t=e.t(3, np.int64, value=0)))
row("config/cross_entropy_backward-reduction", InvalidArgumentError, r"reduction must be 'mean', 'sum' or 'none', got 'batchmean'",
    lambda e, x, t: e.ml.cross_entropy_backward(x, t, reduction="batchmean"),
    setup=lambda e: dict(x=e.t((3, 5)), t=e.t(3, np.int64, value=0)))
row("value/cross_entropy-label-out-of-range", InvalidArgumentError, r"label (5 )?in row 1 is out of range \[0, 5\) and is not ignore_index \(-100\)",
    lambda e, x, t: _found_on_device(e, e.ml.cross_entropy(x, t)),
    setup=lambda e: dict(x=e.t((3, 5)), t=e.m.from_numpy(np.array([0, 5, -100], np.int64))),
    warm=_ce_warm)
row("value/cross_entropy-label-out-of-range-none", InvalidArgumentError, r"label (-3 )?in row [02] is out of range \[0, 5\)",
    lambda e, x, t: _found_on_device(e, e.ml.cross_entropy(x, t, reduction="none")),
    setup=lambda e: dict(x=e.t((3, 5)), t=e.m.from_numpy(np.array([-3, 2, 9], np.int32))))
row("value/cross_entropy_backward-label-out-of-range", InvalidArgumentError, r"cross_entropy_backward: (the )?label (7 )?in row 2 is out of range \[0, 5\)",
    lambda e, x, t: _found_on_device(e, e.ml.cross_entropy_backward(x, t)),
    setup=lambda e: dict(x=e.t((3, 5)), t=e.m.from_numpy(np.array([0, 1, 7], np.int64))))
row("config/sgd-negative-learning-rate", InvalidArgumentError, r"learning_rate must be finite >= 0\.0, got -1",
    lambda e, p: e.ml.sgd_update(p, p, None, OptimizerState(-1.0)), setup=lambda e: dict(p=e.t(4)))
row("config/adam-beta1-1", InvalidArgumentError, r"beta1 must be finite >= 0\.0 and < 1\.0, got 1\.0",
    lambda e, p: e.ml.adam_update(p, p, p, p, OptimizerState(0.1, beta1=1.0)),
    setup=lambda e: dict(p=e.t(4)))
row("config/adam-negative-step", InvalidArgumentError, r"step must be an int >= 0, got -1",
    lambda e, p: e.ml.adam_update(p, p, p, p, OptimizerState(0.1, step=-1)),
    setup=lambda e: dict(p=e.t(4)))
row("config/sketched_linear_params-negative", InvalidArgumentError, r"in_features must be an int >= 1, got -1",
    lambda e: e.ml.sketched_linear_params(-1, 2, 2, 2))

# -- shapes and indexing (ops/shape.py, ops/indexing.py; out-of-range slices are clipped, as in
# NumPy, not errors: tests/test_shape_ops.py) ----------------------------------------------------
row("shape/reshape-wrong-size", ShapeMismatchError,
    r"cannot reshape a tensor of shape \(2, 3\) \(6 elements\) into shape \(4,\)",
    lambda e, a: e.m.reshape(a, (4,)), setup=lambda e: dict(a=e.t((2, 3))))
row("shape/reshape-two-unknown-dims", InvalidArgumentError, r"only one dimension can be -1",
    lambda e, a: e.m.reshape(a, (-1, -1)), setup=lambda e: dict(a=e.t((2, 3))))
row("axis/permute-not-a-permutation", InvalidArgumentError, r"permute: repeated axis in \(0, 0\)",
    lambda e, a: e.m.permute(a, (0, 0)), setup=lambda e: dict(a=e.t((2, 3))))
row("axis/transpose-axes-length", InvalidArgumentError,
    r"axes \(1, 0, 2\) don't match a tensor of 2 dimensions",
    lambda e, a: e.m.transpose(a, (1, 0, 2)), setup=lambda e: dict(a=e.t((2, 3))))
row("axis/concatenate-out-of-range", InvalidArgumentError,
    r"concatenate: axis 2 is out of range for a tensor of 2 dimensions",
    lambda e, a: e.m.concatenate([a, a], axis=2), setup=lambda e: dict(a=e.t((2, 3))))
row("shape/concatenate-mismatched", ShapeMismatchError,
    r"along dimension 1, the tensor at index 0 has size 3 and the tensor at index 1 has size 4",
    lambda e, a, b: e.m.concatenate([a, b], axis=0),
    setup=lambda e: dict(a=e.t((2, 3)), b=e.t((2, 4))))
row("dtype/concatenate-mixed", DTypeMismatchError, r"mixed dtypes float32 and int32",
    lambda e, a, b: e.m.concatenate([a, b]), setup=lambda e: dict(a=e.t(3), b=e.t(3, np.int32)))
row("shape/split-unequal", ShapeMismatchError, r"does not result in an equal division",
    lambda e, a: e.m.split(a, 4, axis=1), setup=lambda e: dict(a=e.t((2, 6))))
row("shape/broadcast_to-incompatible", ShapeMismatchError,
    r"cannot broadcast a tensor of shape \(3,\) to shape \(2, 4\)",
    lambda e, a: e.m.broadcast_to(a, (2, 4)), setup=lambda e: dict(a=e.t(3)))
row("index/getitem-int-out-of-range", IndexOutOfRangeError,
    r"index 3 is out of bounds for axis 1 with size 3",
    lambda e, a: a[0, 3], setup=lambda e: dict(a=e.t((2, 3))))
row("index/getitem-too-many-indices", InvalidIndexError,
    r"too many indices for tensor: tensor is 2-dimensional, but 3 were indexed",
    lambda e, a: a[0, 0, 0], setup=lambda e: dict(a=e.t((2, 3))))
row("index/getitem-float", InvalidIndexError, r"only integers, slices .* got float 1\.5",
    lambda e, a: a[1.5], setup=lambda e: dict(a=e.t((2, 3))))
row("dtype/take-float-indices", DTypeMismatchError, r"take: indices must be int32 or int64, got float32",
    lambda e, a, i: e.m.take(a, i), setup=lambda e: dict(a=e.t((4, 2)), i=e.t(3)))
row("index/take-out-of-range", (IndexOutOfRangeError, IndexError),
    r"take: an index is out of bounds for axis 0 with size 4 \(indices must be in \[-4, 4\)\)",
    lambda e, a, i: _found_on_device(e, e.m.take(a, i, axis=0)),
    setup=lambda e: dict(a=e.t((4, 2)), i=e.m.from_numpy(np.array([1, 4, 0], np.int64))))
row("index/gather-out-of-range", IndexOutOfRangeError, r"gather: an index is out of bounds for axis 1",
    lambda e, a, i: _found_on_device(e, e.m.gather(a, i, axis=1)),
    setup=lambda e: dict(a=e.t((4, 2)), i=e.m.from_numpy(np.full((4, 1), -3, np.int32))))
row("index/scatter_add-out-of-range", IndexOutOfRangeError, r"scatter_add: an index is out of bounds",
    lambda e, t, i, s: _found_on_device(e, e.m.scatter_add(t, i, s), free=False),
    setup=lambda e: dict(t=e.t((3, 2)), i=e.m.from_numpy(np.array([0, 7], np.int64)),
                         s=e.t((2, 2))))
row("shape/scatter_add-src-shape", ShapeMismatchError, r"scatter_add: src has shape \(3, 2\)",
    lambda e, t, i, s: e.m.scatter_add(t, i, s),
    setup=lambda e: dict(t=e.t((3, 2)), i=e.m.from_numpy(np.array([0, 1], np.int64)),
                         s=e.t((3, 2))))
row("dtype/where-cond-not-bool", DTypeMismatchError, r"where: cond must be a bool tensor, got float32",
    lambda e, a: e.m.where(a, a, a), setup=lambda e: dict(a=e.t(3)))
row("shape/less-not-broadcastable", ShapeMismatchError, r"shapes \(3,\) and \(4,\) cannot be broadcast",
    lambda e, a, b: e.m.less(a, b), setup=lambda e: dict(a=e.t(3), b=e.t(4)))

# -- templates, kernels and launches ---------------------------------------------------------
row("template/unknown-template", InvalidArgumentError, r"unknown template 'no_such_template\.cu\.j2'",
    lambda e: e.m.kernel("no_such_template.cu.j2", 0))
row("template/missing-parameter", InvalidArgumentError, r"fill\.cu\.j2.*'dtype' is undefined",
    lambda e: e.m.generator.render("fill.cu.j2"))
row("template/generate_matmul-tile-7", InvalidArgumentError, r"tile_size must be 8, 16 or 32, got 7",
    lambda e: e.m.generator.generate_matrix_multiply_kernel(tile_size=7))
row("template/optimize_kernel_parameters-negative", InvalidArgumentError, r"problem_size must be non-negative ints",
    lambda e: e.m.generator.optimize_kernel_parameters("add", (-1,)))
row("kernel/launch-unknown-name", KernelNotFoundError, r"unknown kernel 'no_such_kernel_badinput'",
    lambda e: e.b.launch_kernel("no_such_kernel_badinput", (1,)), marks=gpu)
row("kernel/get_kernel-unknown-name", KernelNotFoundError, r"unknown kernel 'no_such_kernel_badinput'",
    lambda e: e.b.get_kernel("no_such_kernel_badinput"), marks=gpu)
row("kernel/does-not-compile", KernelCompilationError, r"Failed to compile CUDA kernel 'broken_badinput'(.|\n)*undefined_name",
    lambda e: e.b.compile_kernel("broken_badinput", BROKEN), marks=gpu)
row("kernel/name-not-declared", KernelNotFoundError, r"kernel 'not_declared' is not declared as a __global__",
    lambda e: e.b.compile_kernel("not_declared", SAXPY), marks=gpu)
row("launch/block-over-threads-per-block", LaunchConfigurationError, r"block \(2048, 1, 1\) has 2048 threads, over the device limit",
    lambda e, k, t: e.b.launch_kernel(k, (1,), t, t, 1.0, 4, block_size=(2048,)),
    setup=lambda e: dict(k=e.saxpy(), t=e.t(4)), marks=gpu)
row("launch/grid-y-over-limit", LaunchConfigurationError, r"grid dimension y=\d+ is over the device limit",
    lambda e, k, t: e.b.launch_kernel(k, (1, e.b.devices[0].max_grid_dims[1] + 1), t, t, 1.0, 4),
    setup=lambda e: dict(k=e.saxpy(), t=e.t(4)), marks=gpu)
row("launch/shared-memory-over-limit", LaunchConfigurationError, r"dynamic shared memory .* over the device limit",
    lambda e, k, t: e.b.launch_kernel(k, (1,), t, t, 1.0, 4,
                                      shared_mem=e.b.devices[0].shared_memory_per_block_optin + 1),
    setup=lambda e: dict(k=e.saxpy(), t=e.t(4)), marks=gpu)
row("launch/zero-block-dimension", LaunchConfigurationError, r"block_size dimensions must be >= 1",
    lambda e, k, t: e.b.launch_kernel(k, (1,), t, t, 1.0, 4, block_size=(0,)),
    setup=lambda e: dict(k=e.saxpy(), t=e.t(4)), marks=gpu)
row("launch/wrong-argument-count", LaunchConfigurationError, r"takes 4 arguments .* got 3",
    lambda e, k, t: e.b.launch_kernel(k, (1,), t, t, 1.0),
    setup=lambda e: dict(k=e.saxpy(), t=e.t(4)), marks=gpu)
row("launch/non-integral-int-argument", LaunchConfigurationError, r"argument 3: an integer parameter got non-integral 4\.5",
    lambda e, k, t: e.b.launch_kernel(k, (1,), t, t, 1.0, 4.5),
    setup=lambda e: dict(k=e.saxpy(), t=e.t(4)), marks=gpu)
row("launch/freed-tensor-argument", TensorFreedError, FREED,
    lambda e, k, t, f: e.b.launch_kernel(k, (1,), t, f, 1.0, 4),
    setup=lambda e: dict(k=e.saxpy(), t=e.t(4), f=e.freed()), marks=gpu)
row("fallback/compile_kernel", CudaNotAvailableError, r"compile_kernel needs a CUDA GPU, but the backend is in fallback mode",
    lambda e: e.b.compile_kernel("saxpy_badinput", SAXPY), marks=fallback_only)
row("fallback/launch_kernel", CudaNotAvailableError, r"launch_kernel needs a CUDA GPU",
    lambda e: e.b.launch_kernel("saxpy_badinput", (1,)), marks=fallback_only)
row("fallback/stream", CudaNotAvailableError, r"stream needs a CUDA GPU",
    lambda e: e.b.stream(), marks=fallback_only)
row("fallback/context", CudaNotAvailableError, r"context needs a CUDA GPU",
    lambda e: e.b.context(0), marks=fallback_only)


# -- helpers used by rows -------------------------------------------------------------------
def _with_device(e: Env, device_id: Any) -> None:
    with e.b.device(device_id):
        pass


def _allocated_then_freed(e: Env) -> int:
    p = e.b.allocate_memory(64)
    e.b.free_memory(p)
    return p


def _read_only(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


ROWS_BY_ID = {r.id: r for r in ROWS}
assert len(ROWS_BY_ID) == len(ROWS), "row ids must be unique"


# -- the check ------------------------------------------------------------------------------
def _usage(pool: Any) -> Tuple[int, int]:
    s = pool.get_stats()
    return s["active_memory"], s["active_blocks"]


def _sanity(env: Env) -> None:
    """A correct small result right after the bad call."""
    a = np.array([1.5, -2.0, 3.25, 4.0], np.float32)
    b = np.array([0.5, 2.0, -1.25, 8.0], np.float32)
    x, y = env.m.from_numpy(a), env.m.from_numpy(b)
    z = env.m.add(x, y)
    try:
        np.testing.assert_array_equal(env.m.to_numpy(z), a + b)
    finally:
        for t in (x, y, z):
            t.free()


def _settled(pool: Any, expected: Tuple[int, int]) -> Tuple[int, int]:
    """Pool usage; when it differs from `expected`, again after a full garbage collection
    (so that only memory still reachable counts, at the price of a collection only then)."""
    now = _usage(pool)
    if now != expected:
        gc.collect()
        now = _usage(pool)
    return now


def check_row(bad: Bad, env: Env) -> None:
    """Run one row: the typed error and its message, pool usage unchanged, backend usable."""
    pool = env.pool
    if bad.warm:
        bad.warm(env)
    start = _usage(pool)
    limit = pool.get_limit()
    operands = bad.setup(env) if bad.setup else {}
    try:
        before = _usage(pool)
        caught: Optional[BaseException] = None
        try:
            result = bad.call(env, **operands)
        except Exception as exc:  # noqa: BLE001 - the point is to see what comes out
            caught = exc
        else:
            del result
        # What the error says, as plain values; then the error (with its traceback's frames,
        # which hold the call's locals) is dropped before the pool is measured.
        expected = bad.error if isinstance(bad.error, tuple) else (bad.error,)
        if caught is None:
            summary = None
        else:
            etype = type(caught)
            summary = (f"{etype.__module__}.{etype.__name__}", str(caught),
                       isinstance(caught, CudaBackendError), isinstance(caught, expected))
        caught = None
        after = _settled(pool, before)
    finally:
        pool.set_limit(limit)
        for v in operands.values():
            if isinstance(v, CudaTensor):
                v.free()
        operands.clear()
    names = " or ".join(t.__name__ for t in expected)
    assert summary is not None, f"{bad.id}: no error raised (expected {names})"
    name, message, typed, right_class = summary
    assert typed, f"{bad.id}: untyped {name}: {message}"
    assert right_class, f"{bad.id}: {name} (expected {names}): {message}"
    assert re.search(bad.match, message), f"{bad.id}: message {message!r} !~ {bad.match!r}"
    assert after == before, (f"{bad.id}: pool (active bytes, blocks) {before} before the call, "
                             f"{after} after")
    _sanity(env)
    end = _settled(pool, start)
    assert end == start, f"{bad.id}: pool usage {start} at the start, {end} at the end"


def _run_isolated(row_id: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("bad_input_rows", {__file__!r})
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        from cuda_backend import get_cuda_backend
        print("CHILD READY", flush=True)
        mod.check_row(mod.ROWS_BY_ID[{row_id!r}], mod.Env(get_cuda_backend()))
        print("ROW OK")
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.fixture(scope="module")
def env(backend):
    gc.collect()  # garbage of earlier tests must not be collected in the middle of a row
    return Env(backend)


@pytest.mark.parametrize("bad", [pytest.param(r, id=r.id, marks=r.marks) for r in ROWS])
def test_bad_call(env, bad):
    if bad.isolate:
        r = _run_isolated(bad.id)
        if "CHILD READY" not in r.stdout:  # the harness broke, not the row: a plain error
            raise RuntimeError(f"{bad.id}: the subprocess did not start:\n{r.stderr[-3000:]}")
        assert r.returncode == 0 and "ROW OK" in r.stdout, (
            f"{bad.id}: subprocess exited with {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}")
        return
    check_row(bad, env)


@pytest.mark.parametrize("shape", [(0, 2 ** 62), (2 ** 40, 0), (3, 0, 2 ** 31, 2 ** 31)],
                         ids=["0x2^62", "2^40x0", "3x0x2^31x2^31"])
def test_empty_tensor_whatever_the_other_dimensions(env, shape):
    """The boundary of the memory rows: a 0 in the shape makes an empty tensor however large
    the other dimensions are, and allocates nothing."""
    start = _usage(env.pool)
    for make in (env.b.empty, env.m.zeros, env.m.ones, env.m.create_tensor):
        t = make(shape)
        assert (t.shape, t.size, t.nbytes) == (shape, 0, 0)
        t.free()
    assert _settled(env.pool, start) == start


def test_table_size():
    """At least 40 distinct wrong calls, and 40 runnable in this mode; the table keeps well
    above that."""
    assert len(ROWS) >= 40
    runnable_here = [r for r in ROWS if not any(
        getattr(mk, "name", "") in ("gpu", "multigpu") for mk in r.marks)]
    assert len(runnable_here) >= 40
