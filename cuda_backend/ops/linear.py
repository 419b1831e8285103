"""Linear layers: `fused_linear_gelu` (y = GELU(x Wᵀ + b)) and the seed's sketched low-rank
layer `sketched_linear` (y = (1/T) Σᵢ (x Uᵢ) Vᵢ + b).

fused_linear_gelu is one kernel launch: the matmul kernels rendered to read the weight as
(out, in) and to add the bias and apply GELU in their store stage (`matmul.linear`).
sketched_linear is composed from the matmul, elementwise and reduction kernels.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..tensor import CudaTensor
from . import common


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """No templates of its own: the matmul module lists the linear-layer kernels."""
    return {}


def _check_linear(x: CudaTensor, weight: CudaTensor, bias: Optional[CudaTensor]) -> None:
    common.check_tensor(x, "x"), common.check_tensor(weight, "weight")
    if weight.ndim != 2:
        raise ShapeMismatchError(f"weight must be (out_features, in_features), got {weight.shape}")
    if x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ShapeMismatchError(
            f"x of shape {x.shape} does not match weight of shape {weight.shape}: x's last "
            f"dimension must equal in_features = {weight.shape[1]}")
    if bias is not None:
        common.check_tensor(bias, "bias")
        if bias.shape != (weight.shape[0],):
            raise ShapeMismatchError(
                f"bias must have shape ({weight.shape[0]},), got {bias.shape}")
    common.same_device(*(t for t in (x, weight, bias) if t is not None))
    common.same_dtype(*(t for t in (x, weight, bias) if t is not None))
    common.require_dtype(x, common.FLOATS, "fused_linear_gelu")


def fused_linear_gelu(m: Any, x: CudaTensor, weight: CudaTensor,
                      bias: Optional[CudaTensor] = None,
                      precision: Optional[str] = None) -> CudaTensor:
    """GELU (tanh approximation) of x Wᵀ + b in one kernel launch; x (..., in), weight
    (out, in) -> (..., out). float32 is float32-accurate: 3xTF32 on tensor cores or CUDA-core
    FMA, whichever the autotuner times faster; precision='ieee' keeps CUDA cores and
    precision='tf32' uses TF32."""
    from . import matmul as mm
    _check_linear(x, weight, bias)
    lead = x.shape[:-1]
    rows = int(np.prod(lead)) if lead else 1
    x2 = _reshaped(x, (rows, x.shape[-1]))
    y = mm.linear(m, x2, weight, bias, "bias_gelu", precision)
    return _reshaped(y, lead + (weight.shape[0],))


def _reshaped(t: CudaTensor, shape: Tuple[int, ...]) -> CudaTensor:
    """The same memory under another C-contiguous shape (no copy)."""
    if int(np.prod(shape)) != t.size:
        raise ShapeMismatchError(f"cannot view {t.shape} as {shape}")
    if shape == t.shape:
        return t
    view = CudaTensor(shape, t.dtype, t.device_id, t.ptr, owner=t)
    view._host = None if t._host is None else t._host.reshape(shape)
    view.on_host = t.on_host
    return view


def sketched_linear(m: Any, x: CudaTensor, U: CudaTensor, V: CudaTensor,
                    bias: Optional[CudaTensor] = None) -> CudaTensor:
    """y = (1/num_terms) Σᵢ (x Uᵢ) Vᵢ + b for x (batch, in), U (terms, in, rank),
    V (terms, rank, out), bias (out,)."""
    from . import elementwise as ew
    from . import reduction as red
    for t, name in ((x, "x"), (U, "U"), (V, "V")):
        common.check_tensor(t, name)
    if U.ndim != 3 or V.ndim != 3 or U.shape[0] != V.shape[0] or U.shape[2] != V.shape[1]:
        raise ShapeMismatchError(
            f"U must be (num_terms, in, rank) and V (num_terms, rank, out) with matching "
            f"terms and rank; got U {U.shape} and V {V.shape}")
    if x.ndim != 2 or x.shape[1] != U.shape[1]:
        raise ShapeMismatchError(
            f"x must be (batch, in_features={U.shape[1]}), got {x.shape}")
    if bias is not None:
        common.check_tensor(bias, "bias")
        if bias.shape != (V.shape[2],):
            raise ShapeMismatchError(f"bias must have shape ({V.shape[2]},), got {bias.shape}")
    tensors = [t for t in (x, U, V, bias) if t is not None]
    common.same_device(*tensors)
    common.same_dtype(*tensors)
    common.require_dtype(x, common.FLOATS, "sketched_linear")
    terms = U.shape[0]
    xu = m.matrix_multiply(x, U)          # (terms, batch, rank): x broadcast over the batch
    try:
        xuv = m.matrix_multiply(xu, V)    # (terms, batch, out)
    finally:
        xu.free()
    try:
        y = red.reduce(m, "sum", xuv, axis=0)
    finally:
        xuv.free()
    ew.binary(m, "multiply", y, 1.0 / terms, out=y)
    if bias is not None:
        ew.binary(m, "add", y, bias, out=y)
    return y


def sketched_linear_params(m: Any, in_features: int, out_features: int, num_terms: int,
                           low_rank: int, dtype: Any = "float32",
                           seed: Optional[int] = None) -> Tuple[CudaTensor, CudaTensor]:
    """U (terms, in, rank) and V (terms, rank, out) drawn like SKLinear's sketches: scaled
    Gaussians so that E[(x U)(V)] keeps the variance of a dense layer of the same size."""
    for v, name in ((in_features, "in_features"), (out_features, "out_features"),
                    (num_terms, "num_terms"), (low_rank, "low_rank")):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
    dt = CudaDataType.from_any(dtype)
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((num_terms, in_features, low_rank)) / np.sqrt(low_rank)
    v = rng.standard_normal((num_terms, low_rank, out_features)) / np.sqrt(in_features)
    dev = m.backend.current_device
    return common.from_host(m, u, dt, dev), common.from_host(m, v, dt, dev)
