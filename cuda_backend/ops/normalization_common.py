"""What the normalization modules share, forward and backward, batch norm and layer norm: the
dtypes they take, the 16-byte vector width, the accumulator dtype, the batch-norm layout of an
input shape, the per-CudaMath memo of what the backward ops prepare, and the pointer checks of
a gradient's per-call plan. ops/normalization.py and ops/normalization_backward.py hold the
ops; their plan modules (ops/batch_norm_plans.py, ops/layer_norm_plans.py and the two
*_backward_plans.py) use these. No kernel here.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from ..dtypes import CudaDataType
from ..tensor import CudaTensor
from . import common

DT = CudaDataType
DTYPES = common.FLOATS
_prepared: "weakref.WeakKeyDictionary[Any, Dict[tuple, Dict[str, Any]]]" = \
    weakref.WeakKeyDictionary()


def vec_width(dtype: CudaDataType) -> int:
    """Elements of dtype in a 16-byte vector."""
    return 16 // dtype.itemsize


def bn_layout(shape: Sequence[int], dtype: CudaDataType
              ) -> Tuple[int, int, int, int, str, int, bool]:
    """(N, C, S, count, layout, vec, can_vec) of a batch-norm input of shape (N, C, ...): S
    the size of the dims after C (1 for (N, C)), count = N * S values per channel, layout "nc"
    (S == 1: vectors run along C) or "ncs" (along S), vec the 16-byte vector width and
    can_vec whether C ("nc") or S ("ncs") is a whole number of vectors."""
    N, C = shape[0], shape[1]
    S = int(np.prod(shape[2:], dtype=np.int64)) if len(shape) > 2 else 1
    count = N * S
    layout = "nc" if S == 1 else "ncs"
    vec = vec_width(dtype)
    can_vec = C % vec == 0 if layout == "nc" else S % vec == 0
    return N, C, S, count, layout, vec, can_vec


def prepared(m: Any, key: tuple, make: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """What a backward op prepared for key (compiled kernel names, a register plan) on the
    CudaMath m: make() on the first call, memoized per CudaMath (cleared past 4096 keys)."""
    per = _prepared.get(m)
    if per is None:
        per = _prepared.setdefault(m, {})
    q = per.get(key)
    if q is None:
        q = make()
        if len(per) >= 4096:
            per.clear()
        per[key] = q
    return q


def grad_pointers(g: Any, x: CudaTensor, shape: Tuple[int, ...], dtype: CudaDataType,
                  dev: int, direct: Callable[[int], bool]) -> Optional[Tuple[int, int]]:
    """The pointers (grad_out, x) a gradient's per-call plan (ops/common.py remember_plan)
    launches with, or None where the general path must run: grad_out not a live CudaTensor
    of the plan's shape, dtype and device, either tensor on a stream, or no direct launch."""
    if type(g) is not CudaTensor:
        return None
    pg, px = g._ptr, x._ptr
    if pg is None or px is None or g.shape != shape or g.dtype is not dtype or \
            g.device_id != dev or g.stream is not None or x.stream is not None or \
            not direct(dev):
        return None
    return pg, px
