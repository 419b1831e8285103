"""The kernels of indexing.cu.j2: their launch constants, each kind's template parameters
and the dims limit of the N-d walks, shared by ops/indexing.py (comparisons, where,
scatter_add and the family contract), ops/indexing_take.py (take, gather) and
ops/indexing_bounds.py (the bounds check), so that none of them imports another for them.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError
from ..kernels import dtype_params
from . import common
from .shape_copy import MAX_DIMS

DT = CudaDataType
TEMPLATE = "indexing.cu.j2"
BLOCK = 128
COMPARE_OPS = ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal")
INDEX_DTYPES = (DT.INT32, DT.INT64)
SCATTER_DTYPES = common.FLOATS + (DT.INT32, DT.INT64)
ELEMS = (1, 2, 4, 8)
# take: rows copied in units of UNITS bytes (the widest dividing the row and both pointers) by
# ROW_BLOCK-thread blocks, ROW_UNROLL units per thread in flight (as the template), about
# ROW_BLOCKS_PER_SM blocks per SM for a few long rows (grid y splits each row)
UNITS = (16, 8, 4, 2, 1)
ROW_BLOCK = 256
ROW_UNROLL = 4
ROW_BLOCKS_PER_SM = 8
ROW_RESIDENT = 5   # take_rows blocks per SM the template's __launch_bounds__ guarantees


# -- template parameters ------------------------------------------------------------------------
def compare_params(op: str, dtype: CudaDataType) -> Dict[str, Any]:
    p = dtype_params(dtype)
    if dtype is DT.BOOL:
        p["ctype"] = "unsigned char"
    return {"kind": "map", "op": op, **p, "block_size": BLOCK}


def compare_flat_params(op: str, dtype: CudaDataType) -> Dict[str, Any]:
    """The comparison of two contiguous tensors of one shape (no broadcasting)."""
    return {**compare_params(op, dtype), "kind": "compare_flat", "vec": 16 // dtype.itemsize}


def where_flat_params(elem: int) -> Dict[str, Any]:
    """where of three contiguous tensors of one shape (no broadcasting, no scalar)."""
    return {"kind": "where_flat", "elem": elem, "block_size": BLOCK}


def flat_items(n: int, dtype: CudaDataType) -> int:
    """A flat kernel's (compare_flat, where_flat) work items over n elements of dtype: its
    16-byte vectors (the grid)."""
    return -(-n // (16 // dtype.itemsize))


def where_params(elem: int) -> Dict[str, Any]:
    return {"kind": "map", "op": "where", "elem": elem, "block_size": BLOCK}


def gather_params(elem: int, index_dtype: CudaDataType) -> Dict[str, Any]:
    return {"kind": "gather", "elem": elem, "index_dtype": index_dtype.name_str,
            "block_size": BLOCK}


def take_rows_params(unit: int, index_dtype: CudaDataType) -> Dict[str, Any]:
    return {"kind": "take_rows", "unit": unit, "index_dtype": index_dtype.name_str,
            "block_size": ROW_BLOCK}


def scatter_params(dtype: CudaDataType, index_dtype: CudaDataType) -> Dict[str, Any]:
    return {"kind": "scatter_add", **dtype_params(dtype), "index_dtype": index_dtype.name_str,
            "block_size": BLOCK}


def check_dims(nd: int, shape: Tuple[int, ...], what: str) -> None:
    if nd > MAX_DIMS:
        raise InvalidArgumentError(
            f"{what}: {nd} dims after merging those that can be merged; at most {MAX_DIMS} "
            f"are supported (shape {shape})")
