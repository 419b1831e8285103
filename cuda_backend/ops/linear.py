"""Linear layers: `linear` (y = x Wᵀ + b), `fused_linear_gelu` (y = GELU(x Wᵀ + b)) and the
documented API's sketched low-rank layer `sketched_linear` (y = (1/T) Σᵢ (x Uᵢ) Vᵢ + b).

linear is the same one-kernel launch as fused_linear_gelu with the bias epilogue alone
(`matmul.linear(..., "bias")`); its gradients are ops/matmul_backward.py's.

fused_linear_gelu is one kernel launch: the matmul kernels rendered to read the weight as
(out, in) and to add the bias and apply GELU in their store stage (`matmul.linear`). With few
rows (M <= 64, float32 on CUDA cores) the autotuner also times the skinny split-K configs
(matmul.SKINNY_F32: K sliced over many blocks, float32 partials in a workspace, then one
reduce that sums them in a fixed order, adds the bias and applies GELU: two launches) and, on
devices with thread-block clusters (sm_90+), the cluster configs (matmul.CLUSTER_F32: the K
slices summed inside a cluster, then the bias and GELU: one launch), so that a batch-32 layer
reads its weight at close to memory bandwidth.
sketched_linear is composed from the matmul, elementwise and reduction kernels.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..tensor import CudaTensor
from . import common


# The templates fused_linear_gelu's kernel is rendered from (by matmul.linear; sketched_linear
# launches the matmul, reduction and elementwise ops' kernels).
TEMPLATES = ("matmul_simt.cu.j2", "matmul_mma.cu.j2", "matmul_skinny.cu.j2")
# (dtype, precision) of every linear-layer family: float32's default (3xTF32 or CUDA cores,
# which holds 'ieee''s CUDA-core list), float64, TF32 and the 16-bit types
LINEAR_FAMILIES = ((CudaDataType.FLOAT32, None), (CudaDataType.FLOAT64, None),
                   (CudaDataType.FLOAT32, "tf32"), (CudaDataType.FLOAT16, None),
                   (CudaDataType.BFLOAT16, None))


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """The plain linear layer's kernels (the bias epilogue alone: `linear`, and
    matmul_backward's a @ bᵀ, matmul.matmul_nt): every linear config of every family, both
    alignments, and the skinny split-K reduce with the bias; and the cluster kernel's
    weight-layout (b_trans) variants with "bias" and with "bias_gelu_grad" (the recompute
    of fused_linear_gelu_backward, which runs through matmul.linear). The bias + GELU ones
    are the matmul module's."""
    from . import matmul as mm
    out: Dict[str, List[Dict[str, Any]]] = {mm.SIMT_TEMPLATE: [], mm.MMA_TEMPLATE: []}
    for dt, prec in LINEAR_FAMILIES:
        family, _ = mm.linear_family(dt, prec)
        for vec in (True, False):
            for cfg in mm.linear_configs(dt, prec, vec):
                template = mm.config_template(cfg, family)
                out[template].append(mm.linear_params(template, dt, cfg, vec, "bias"))
    out[mm.SIMT_TEMPLATE].append(mm.splitk_epilogue_params(CudaDataType.FLOAT32, "bias"))
    out[mm.SKINNY_TEMPLATE] = [
        mm.cluster_params(CudaDataType.FLOAT32, cfg, vec, True, epilogue)
        for vec in (True, False) for cfg in mm.cluster_configs(vec)
        for epilogue in ("bias", mm.GRAD_EPILOGUE)]
    return out


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every linear-layer kernel (matmul's variants with B read as (N, K), the
    split-K reduce with the epilogue, and the ones listed here) in parallel threads, the
    cluster kernel only where the device has clusters; returns how many were compiled (0 in
    fallback mode)."""
    from . import matmul as mm
    jobs = [(t, p) for t, sets in mm.template_variants().items() for p in sets
            if p.get("b_trans") or p.get("kind") == "splitk_epilogue"]
    jobs += [(t, p) for t, sets in template_variants().items() for p in sets]
    jobs = [(t, p) for t, p in jobs if mm.runs_here(m, t, device_id)]
    return common.compile_all(m, jobs, device_id, workers, mm.compile_kernel)


def candidates(dtype: CudaDataType, precision: Optional[str], vec: bool) -> List[Dict[str, Any]]:
    """The configs fused_linear_gelu's autotuner chooses from (matmul.linear_configs)."""
    from . import matmul as mm
    return mm.linear_configs(dtype, precision, vec)


def reference(op: str, x: Any, *weights: Any, bias: Any = None) -> np.ndarray:
    """float64 NumPy of op "linear" (x, weight): x Wᵀ + b, "fused_linear_gelu" (x, weight):
    GELU (tanh form) of x Wᵀ + b, or "sketched_linear" (x, U, V): the mean over terms of
    (x Uᵢ) Vᵢ, + b."""
    f64 = [np.asarray(a, dtype=np.float64) for a in (x,) + weights]
    b = 0.0 if bias is None else np.asarray(bias, dtype=np.float64)
    if op == "linear":
        xh, w = f64
        return xh @ w.T + b
    if op == "fused_linear_gelu":
        xh, w = f64
        z = xh @ w.T + b
        return 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z ** 3)))
    if op == "sketched_linear":
        xh, U, V = f64
        return np.matmul(np.matmul(xh, U), V).mean(axis=0) + b
    raise InvalidArgumentError(
        f"unknown linear op {op!r}: 'linear', 'fused_linear_gelu' or 'sketched_linear'")


def _check_linear(x: CudaTensor, weight: CudaTensor, bias: Optional[CudaTensor],
                  name: str = "fused_linear_gelu") -> None:
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
    common.require_dtype(x, common.FLOATS, name)


def linear(m: Any, x: CudaTensor, weight: CudaTensor, bias: Optional[CudaTensor] = None,
           precision: Optional[str] = None) -> CudaTensor:
    """x Wᵀ + b in one kernel launch (for few rows possibly a split-K kernel and its reduce);
    x (..., in), weight (out, in) (PyTorch's layout, read as it is) -> (..., out). Precision
    as fused_linear_gelu's."""
    return _layer(m, x, weight, bias, precision, "linear", "bias")


def fused_linear_gelu(m: Any, x: CudaTensor, weight: CudaTensor,
                      bias: Optional[CudaTensor] = None,
                      precision: Optional[str] = None) -> CudaTensor:
    """GELU (tanh approximation) of x Wᵀ + b in one kernel launch (for few rows possibly a
    split-K kernel and its reduce); x (..., in), weight (out, in) -> (..., out). float32 is
    float32-accurate: 3xTF32 on tensor cores or CUDA-core FMA, whichever the autotuner times
    faster; precision='ieee' keeps CUDA cores and precision='tf32' uses TF32."""
    return _layer(m, x, weight, bias, precision, "fused_linear_gelu", "bias_gelu")


def _layer(m: Any, x: CudaTensor, weight: CudaTensor, bias: Optional[CudaTensor],
           precision: Optional[str], name: str, epilogue: str) -> CudaTensor:
    """epilogue(x Wᵀ + b) for x (..., in): the plan of `name` (its key: _linear_key), else
    the checks, matmul.linear on x viewed as (rows, in), and the plan made."""
    key = _linear_key(x, weight, bias, precision, name)
    if key is not None:
        plans = getattr(m, "plans", None)
        fast = None if plans is None else plans.get(key)
        if fast is not None and m.backend.direct_launch(x.device_id):
            res = fast(x, weight, bias)
            if res is not None:
                return res
    from . import matmul as mm
    _check_linear(x, weight, bias, name)
    lead = x.shape[:-1]
    rows = int(np.prod(lead)) if lead else 1
    x2 = _reshaped(x, (rows, x.shape[-1]))
    y = mm.linear(m, x2, weight, bias, epilogue, precision)
    if key is not None and y.size and m.gpu:
        # the plan (matmul.remember): y's allocation with the result's shape and the launch
        # of the config mm.linear memoized for this alignment class
        N = weight.shape[0]
        p = mm.Plan(1, rows, N, x.shape[-1], 0, 0, (rows, N))
        mm.remember(m, key, p, x.dtype, common.normalize_precision(precision, x.dtype),
                    x.device_id, mm.is_vec_ok(x2, weight, y, p), lead + (N,), epilogue)
    return _reshaped(y, lead + (weight.shape[0],))


def _bias_key(bias: Any) -> Any:
    """bias's part of a plan key: None (no bias), the tensor's (shape, dtype, device), or
    False where no plan applies (a bias that is neither None nor a CudaTensor)."""
    if bias is None:
        return None
    if type(bias) is CudaTensor:
        return (bias.shape, bias.dtype, bias.device_id)
    return False


def _linear_key(x: Any, weight: Any, bias: Any, precision: Any,
                name: str = "fused_linear_gelu") -> Optional[tuple]:
    """The plan key of fused_linear_gelu or linear (`name`; ops/common.py remember_plan):
    every operand's shape, dtype and device, and the precision as given; None where no plan
    applies (an operand that is not a CudaTensor, a precision that is neither None nor a
    string)."""
    if type(x) is not CudaTensor or type(weight) is not CudaTensor or \
            not (precision is None or type(precision) is str):
        return None
    b = _bias_key(bias)
    if b is False:
        return None
    return (name, x.shape, weight.shape, x.dtype, weight.dtype, x.device_id,
            weight.device_id, b, precision)


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
    key = _sketched_key(x, U, V, bias)
    if key is not None:
        plans: Any = getattr(m, "plans", None)
        fast = None if plans is None else plans.get(key)
        if fast is not None and m.backend.direct_launch(x.device_id):
            res = fast(x, U, V, bias)
            if res is not None:
                return res
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
    xu = m.matrix_multiply(x, U)          # (terms, batch, rank): x broadcast over the batch
    try:
        xuv = m.matrix_multiply(xu, V)    # (terms, batch, out)
    finally:
        xu.free()
    if key is not None and m.gpu and xuv.size and xu.size:
        dt, dev = x.dtype, x.device_id
        plans = m.plans        # m.gpu: a CudaMath, which has its plans
        mm1 = plans.get(("matmul", x.shape, U.shape, dt, dt, dev, dev, None))
        mm2 = plans.get(("matmul", xu.shape, V.shape, dt, dt, dev, dev, None))
        if mm1 is not None and mm2 is not None:
            common.remember_plan(m, key, _sketched_plan(m, mm1, mm2))
    return _mean_plus_bias(m, red, ew, xuv, bias)


def _mean_plus_bias(m: Any, red: Any, ew: Any, xuv: CudaTensor,
                    bias: Optional[CudaTensor]) -> CudaTensor:
    """mean(xuv, axis=0) (+ bias, in place: the broadcast plan takes out=), freeing xuv."""
    try:
        y = red.reduce(m, "mean", xuv, axis=0)
    finally:
        xuv.free()
    if bias is not None:
        ew.binary(m, "add", y, bias, out=y)
    return y


def _sketched_key(x: Any, U: Any, V: Any, bias: Any) -> Optional[tuple]:
    """sketched_linear's plan key: every operand's shape, dtype and device (None: no plan
    applies, an operand is not a CudaTensor)."""
    if type(x) is not CudaTensor or type(U) is not CudaTensor or type(V) is not CudaTensor:
        return None
    b = _bias_key(bias)
    if b is False:
        return None
    return ("sketched_linear", x.shape, U.shape, V.shape, x.dtype, U.dtype, V.dtype,
            x.device_id, U.device_id, V.device_id, b)


def _sketched_plan(m: Any, mm1: Any, mm2: Any) -> Any:
    """The per-call plan of sketched_linear (ops/common.py remember_plan): the general path's
    steps without its checks: the two products through their matmul plans (mm1: x @ U, mm2:
    xu @ V, as m.matrix_multiply takes them), then the same mean and bias calls. None
    (general path) where a product's plan steps aside."""
    from . import elementwise as ew
    from . import reduction as red

    def run(x: CudaTensor, U: CudaTensor, V: CudaTensor,
            bias: Optional[CudaTensor]) -> Optional[CudaTensor]:
        if bias is not None and bias._ptr is None:
            return None   # the general path's TensorFreedError, before any launch
        xu = mm1(x, U, None)
        if xu is None:
            return None
        try:
            xuv = mm2(xu, V, None)
        finally:
            xu.free()
        if xuv is None:
            return None
        return _mean_plus_bias(m, red, ew, xuv, bias)
    return run


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
