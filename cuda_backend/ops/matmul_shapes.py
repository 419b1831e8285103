"""Matmul geometry: a call's validated shapes (`Plan`, NumPy's matmul shape rules), its shape
class and autotuner key, and its alignment class (`is_vec_ok`); its precision name is
`common.normalize_precision`'s. Every other matmul module plans from a `Plan`; ops/matmul.py
holds the ops that make one."""
from __future__ import annotations

import functools
import math
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

from ..errors import InvalidArgumentError, ShapeMismatchError
from ..tensor import CudaTensor
from . import common


class Plan(NamedTuple):
    """Validated geometry of one matmul: (batch, M, N, K), batch strides, output shape."""

    batch: int
    M: int
    N: int
    K: int
    stride_a: int
    stride_b: int
    out_shape: Tuple[int, ...]


def plan_shapes(a_shape: Sequence[int], b_shape: Sequence[int]) -> Plan:
    """NumPy matmul shape rules, restricted to batches that are full or broadcast (all 1)."""
    return _plan(tuple(a_shape), tuple(b_shape))


@functools.lru_cache(maxsize=4096)
def _plan(a_shape: Tuple[int, ...], b_shape: Tuple[int, ...]) -> Plan:
    if len(a_shape) == 0 or len(b_shape) == 0:
        raise InvalidArgumentError(
            f"matmul needs operands with at least 1 dimension, got shapes {a_shape} and "
            f"{b_shape} (use multiply for scalars)")
    a2 = (1,) + a_shape if len(a_shape) == 1 else a_shape
    b2 = b_shape + (1,) if len(b_shape) == 1 else b_shape
    if a2[-1] != b2[-2]:
        raise ShapeMismatchError(
            f"matmul: inner dimensions differ: a has shape {a_shape} (K={a2[-1]}) and b has "
            f"shape {b_shape} (K={b2[-2]}); a's last dimension must equal b's "
            f"{'only' if len(b_shape) == 1 else 'second-to-last'} dimension")
    M, K, N = a2[-2], a2[-1], b2[-1]
    a_batch, b_batch = a2[:-2], b2[:-2]
    try:
        batch_shape = common.broadcast_shapes(a_batch, b_batch)
    except ShapeMismatchError as exc:
        raise ShapeMismatchError(
            f"matmul: batch dimensions of a {a_shape} and b {b_shape} do not broadcast: "
            f"{exc}") from None
    batch = math.prod(batch_shape)
    strides = []
    for name, shp, mat in (("a", a_shape, M * K), ("b", b_shape, K * N)):
        own = (shp[:-2] if len(shp) > 2 else ())
        padded = (1,) * (len(batch_shape) - len(own)) + own
        if all(d == 1 for d in padded):
            strides.append(0)
        elif padded == batch_shape:
            strides.append(mat)
        else:
            raise InvalidArgumentError(
                f"matmul: batch dimensions of shapes {a_shape} and {b_shape} broadcast to "
                f"{batch_shape}, but {name}'s batch {own} is neither all of it nor all ones "
                f"(partial batch broadcasting is not supported; expand {name} first)")
    out_shape = batch_shape + ((M,) if len(a_shape) > 1 else ()) + \
        ((N,) if len(b_shape) > 1 else ())
    return Plan(batch, M, N, K, strides[0], strides[1], out_shape)


def shape_class(p: Plan, sm_count: int) -> str:
    """'small' (tiny work), 'skinny' (M or N <= 64), 'large' (>= 2 waves of 128x128 tiles),
    else 'medium'."""
    work = p.batch * p.M * p.N * p.K
    if work <= 256 * 256 * 256:
        return "small"
    if min(p.M, p.N) <= 64:
        return "skinny"
    tiles = p.batch * -(-p.M // 128) * -(-p.N // 128)
    return "large" if tiles >= 2 * sm_count else "medium"



def tune_key(p: Plan, shape_cls: str, vec: bool, prec: Optional[str]) -> List[Any]:
    """The autotuner's shape class of a call: half octaves of M and N (the tile count decides
    the wave quantization), octaves of K. TF32 adds the batch's bucket: the wgmma
    configs first transpose every B plane, and batches over the grid's z limit take several
    launches, so a choice timed at one batch does not carry to a much larger one."""
    key: List[Any] = [shape_cls, vec, common.half_octave_bucket(p.M),
                      common.half_octave_bucket(p.N), common.size_bucket(p.K), p.batch > 1]
    if prec == "tf32":
        key.append(common.size_bucket(p.batch))
    return key


def is_vec_ok(a: CudaTensor, b: CudaTensor, out: CudaTensor, p: Plan,
              a_trans: bool = False) -> bool:
    """16-byte loads/stores are legal: K (M where A is given as (K, M)) and N whole vectors,
    every pointer 16-byte aligned."""
    vw = 16 // out.dtype.itemsize
    return ((p.M if a_trans else p.K) % vw == 0 and p.N % vw == 0
            and a.ptr % 16 == 0 and b.ptr % 16 == 0 and out.ptr % 16 == 0)
