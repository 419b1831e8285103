"""Operand checks of the cross-entropy ops (`ops/cross_entropy.py`) and the device flag through
which their kernels report labels out of range (an int32 pair: the count of such rows and
the complemented smallest row; tests/test_cross_entropy.py's bad-label rows)."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from ..device_errors import LATER
from ..dtypes import CudaDataType
from ..errors import DTypeMismatchError, InvalidArgumentError, ShapeMismatchError
from ..tensor import CudaTensor
from . import common
from .common import acc_dtype

DT = CudaDataType
REDUCTIONS = ("mean", "sum", "none")
LABEL_DTYPES = (DT.INT32, DT.INT64)


def check_operands(name: str, logits: Any, labels: Any, reduction: Any, ignore_index: Any,
                   check_labels: Any) -> Tuple[int, int, int]:
    """(N, C, device) after the operand checks every call makes."""
    x = common.check_tensor(logits, "logits")
    lab = common.check_tensor(labels, "labels")
    common.require_dtype(x, common.FLOATS, name)
    if lab.dtype not in LABEL_DTYPES:
        raise DTypeMismatchError(
            f"{name}: labels must be int32 or int64 class indices, got {lab.dtype.name_str}")
    dev = common.same_device(x, lab)
    if x.ndim != 2:
        raise ShapeMismatchError(f"{name}: logits must be 2-D (N, C), got shape {x.shape}")
    N, C = x.shape
    if C < 1:
        raise ShapeMismatchError(f"{name}: logits need at least one class, got shape {x.shape}")
    if lab.shape != (N,):
        raise ShapeMismatchError(
            f"{name}: labels must have shape ({N},) for logits of shape {x.shape}, got "
            f"{lab.shape}")
    if type(reduction) is not str or reduction not in REDUCTIONS:
        raise InvalidArgumentError(
            f"{name}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)) or \
            not -2**63 <= int(ignore_index) < 2**63:
        raise InvalidArgumentError(
            f"{name}: ignore_index must be an int (a 64-bit label value), got {ignore_index!r}")
    if not isinstance(check_labels, (bool, np.bool_)):
        raise InvalidArgumentError(f"{name}: check_labels must be a bool, got {check_labels!r}")
    return N, C, dev


def _check_side(name: str, t: CudaTensor, what: str, want: CudaDataType, expected: str,
                dev: int) -> None:
    """A side tensor of the logits (grad_loss, row_stats): live, of dtype want (`expected`
    says which in the error) and on the logits' device dev."""
    t.check_alive()
    common.check_dtype_device(t, f"{name}: {what}", want, expected, dev, "the logits")


def check_grad(name: str, grad_loss: Any, reduction: str, N: int, dtype: CudaDataType,
               dev: int) -> Tuple[Optional[CudaTensor], float]:
    """(grad tensor or None, gmul): a Python number (any reduction), or a tensor of the
    logits' dtype and device: shape (N,) for "none", () or (1,) for "mean" and "sum"."""
    if isinstance(grad_loss, CudaTensor):
        _check_side(name, grad_loss, "grad_loss", dtype, f"the logits' {dtype.name_str}", dev)
        want = ((N,),) if reduction == "none" else ((), (1,))
        if grad_loss.shape not in want:
            raise ShapeMismatchError(
                f"{name}: grad_loss has shape {grad_loss.shape}, expected "
                f"{' or '.join(str(w) for w in want)} for reduction={reduction!r}")
        return grad_loss, 1.0
    if isinstance(grad_loss, bool) or not isinstance(grad_loss, (int, float, np.integer,
                                                                   np.floating)):
        raise InvalidArgumentError(
            f"{name}: grad_loss must be a real number or a CudaTensor, got "
            f"{type(grad_loss).__name__}")
    return None, float(grad_loss)


def check_row_stats(name: str, row_stats: Any, N: int, dtype: CudaDataType,
                    dev: int) -> Optional[CudaTensor]:
    """row_stats: None, or the (N, 2) tensor cross_entropy(..., return_row_stats=True) gave
    for these logits (float32 for float32 and the half types, float64 for float64)."""
    if row_stats is None:
        return None
    if not isinstance(row_stats, CudaTensor):
        raise InvalidArgumentError(
            f"{name}: row_stats must be None or the CudaTensor cross_entropy(..., "
            f"return_row_stats=True) returned, got {type(row_stats).__name__}")
    want = acc_dtype(dtype)
    _check_side(name, row_stats, "row_stats", want,
                f"{want.name_str} for {dtype.name_str} logits", dev)
    if row_stats.shape != (N, 2):
        raise ShapeMismatchError(
            f"{name}: row_stats has shape {row_stats.shape}, expected ({N}, 2) (each row's "
            f"max and sum of exp(x - max))")
    return row_stats


def bad_label_error(name: str, row: int, label: int, count: int, C: int,
                    ignore_index: int) -> InvalidArgumentError:
    more = f" ({count} rows have one)" if count > 1 else ""
    return InvalidArgumentError(
        f"{name}: label {label} in row {row} is out of range [0, {C}) and is not ignore_index "
        f"({ignore_index}){more}")


def host_check_labels(name: str, lab: np.ndarray, C: int, ignore_index: int) -> None:
    lab = lab.astype(np.int64)
    bad = (lab != ignore_index) & ((lab < 0) | (lab >= C))
    if bad.any():
        rows = np.flatnonzero(bad)
        raise bad_label_error(name, int(rows[0]), int(lab[rows[0]]), len(rows), C,
                              ignore_index)


def label_slot(m: Any, name: str, C: int, ignore_index: int) -> int:
    """The device pointer of the error slot (device_errors.py) the kernels of name set for a
    label outside [0, C) that is not ignore_index (the slot's detail: the row); the next
    synchronizing call raises InvalidArgumentError."""
    def make_error(row: int) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"{name}: the label in row {row} is out of range [0, {C}) and is not ignore_index "
            f"({ignore_index}){LATER}")
    return m.backend.error_slot(("labels", name, C, ignore_index), make_error)
