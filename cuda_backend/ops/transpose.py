"""Matrix transpose (2-D, or the last two axes of a 3-D tensor) through a shared-memory tile."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..kernels import dtype_params
from ..tensor import CudaTensor
from . import common

TEMPLATE = "transpose.cu.j2"
DTYPES = (CudaDataType.FLOAT32, CudaDataType.FLOAT64, CudaDataType.FLOAT16,
          CudaDataType.BFLOAT16, CudaDataType.INT32, CudaDataType.INT64)
CONFIGS = ({"tile": 32, "block_rows": 8}, {"tile": 64, "block_rows": 8},
           {"tile": 64, "block_rows": 16})


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    return {TEMPLATE: [{**dtype_params(dt), **cfg} for dt in DTYPES for cfg in CONFIGS]}


def transpose(m: Any, x: CudaTensor, out: Optional[CudaTensor] = None) -> CudaTensor:
    """(rows, cols) -> (cols, rows); (batch, rows, cols) -> (batch, cols, rows)."""
    common.check_tensor(x, "tensor")
    if x.ndim not in (2, 3):
        raise InvalidArgumentError(
            f"matrix_transpose needs a 2-D or 3-D tensor, got shape {x.shape}")
    common.require_dtype(x, DTYPES, "matrix_transpose")
    batch = x.shape[0] if x.ndim == 3 else 1
    rows, cols = x.shape[-2], x.shape[-1]
    shape = x.shape[:-2] + (cols, rows)
    if out is not None:
        common.check_tensor(out, "out")
        if out.shape != shape or out.dtype is not x.dtype:
            raise ShapeMismatchError(
                f"out has shape {out.shape} ({out.dtype.name_str}), expected {shape} "
                f"({x.dtype.name_str})")
        common.same_device(x, out)
    if not m.gpu:
        values = np.swapaxes(common.host_array(m, x), -1, -2)
        if out is None:
            return common.from_host(m, values, x.dtype, x.device_id)
        m.backend.copy_to_device(_host_bits(values, x.dtype), out)
        return out
    dev = x.device_id
    if out is None:
        out = m.backend.empty(shape, x.dtype, dev)
    if x.size == 0:
        return out
    if rows * cols >= 2**31:
        raise InvalidArgumentError(
            f"matrix_transpose supports planes under 2^31 elements, got {rows}x{cols}")
    cfg = _pick(m, x, out, batch, rows, cols)
    _launch(m, cfg, x, out, batch, rows, cols)
    return out


def _launch(m: Any, cfg: Dict[str, int], x: CudaTensor, out: CudaTensor, batch: int,
            rows: int, cols: int) -> None:
    kernel = m.kernel(TEMPLATE, x.device_id, **dtype_params(x.dtype), **cfg)
    tile = cfg["tile"]
    grid = ((cols + tile - 1) // tile, (rows + tile - 1) // tile, batch)
    m.backend.launch_kernel(kernel.name, grid, x, out, rows, cols,
                            block_size=(32, cfg["block_rows"], 1), device_id=x.device_id)


def _pick(m: Any, x: CudaTensor, out: CudaTensor, batch: int, rows: int,
          cols: int) -> Dict[str, int]:
    """Autotuned tile per (dtype, size class); small problems take the 32 tile untimed."""
    if rows * cols * batch < 1 << 20:
        return dict(CONFIGS[0])
    size_class = (x.dtype.name_str, "large" if rows * cols * batch >= 1 << 24 else "medium")
    return m.autotuner.pick("matrix_transpose", size_class, list(CONFIGS),
                            lambda cfg: _launch(m, cfg, x, out, batch, rows, cols),
                            device_id=x.device_id)


def _host_bits(values: np.ndarray, dtype: CudaDataType) -> np.ndarray:
    from ..dtypes import to_bfloat16_bits
    if dtype is CudaDataType.BFLOAT16:
        return to_bfloat16_bits(values.astype(np.float32)).reshape(values.shape)
    return np.ascontiguousarray(values, dtype=dtype.numpy_dtype)
