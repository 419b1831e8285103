"""The op registry: one table from every public operation to where it lives.

Each public method of `CudaMath` and `CudaML` that computes has an `OpEntry` in `OPS` (key
"CudaMath.add", "CudaML.conv2d", ...): the op family module in `cuda_backend/ops/` that
implements it, the templates its kernels are rendered from, the test file that checks it and
the report cases (`performance/cases_math.py`, `cases_ml.py`; "family/op", as
`cuda-backend report --operations` selects them) that time it. Public methods that are tensor
plumbing rather than operations are in `NON_OPS`, with the reason. tests/test_registry.py
walks both against the classes, the op modules, the templates, the tests and the report.

Every family module exposes the same contract (`CONTRACT`):
- `TEMPLATES`: the template files it renders (shared ones, e.g. fill.cu.j2, included);
- `template_variants()`: {template: [parameter sets]} it lists for rendering and the CI's
  compile (kernels.template_variants() gathers them through `family_modules()`);
- `warm_up(m, device_id=None, workers=8) -> int`: compiles what first calls need, in threads;
- `reference(...)`: the family's op(s) in float64 NumPy;
- `candidates(...)`, in the families that autotune (`AUTOTUNED`): the configs timed.
This module is data only: it imports no op module until `family_module` is called.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class OpEntry:
    """One public operation: `owner.name` is implemented by ops/<family>.py."""

    name: str                    # the method name
    owner: str                   # "CudaMath" or "CudaML"
    family: str                  # module name in cuda_backend/ops/
    templates: Tuple[str, ...]   # templates its kernels come from (() for a plain copy)
    test: str                    # test file, relative to the repository root
    report: Tuple[str, ...]      # report cases timing it: "family/op" of an OpDef

    @property
    def key(self) -> str:
        return f"{self.owner}.{self.name}"


# The op families, in the order kernels.template_variants() gathers their parameter sets.
FAMILIES = ("elementwise", "reduction", "softmax", "transpose", "matmul", "pooling",
            "normalization", "dropout", "optimizers", "conv2d", "attention", "linear",
            "activation_backward", "softmax_backward", "cross_entropy", "shape", "indexing",
            "attention_backward",
            "conv2d_backward",
            "pooling_backward",
            "matmul_backward",
            "normalization_backward")
# Names every family module defines; `candidates` too where the family autotunes.
CONTRACT = ("TEMPLATES", "template_variants", "warm_up", "reference")
AUTOTUNED = ("softmax", "transpose", "matmul", "normalization", "conv2d", "attention", "linear",
             "attention_backward",
             "conv2d_backward",
             "softmax_backward", "cross_entropy", "matmul_backward")

_EW = ("elementwise.cu.j2",)
_FILL = ("fill.cu.j2",)
_REDUCE = ("reduce.cu.j2", "reduce_axis.cu.j2")
_MM = ("matmul_simt.cu.j2", "matmul_mma.cu.j2", "matmul_skinny.cu.j2")
# the 16-bit wgmma GEMM (sm_90a) and the strided copy that pads its B's rows (ops/shape_copy.py),
# the TMA-fed 16-bit GEMM (sm_90a, ops/matmul_tma16.py)
_WGMMA16 = ("matmul_wgmma16.cu.j2", "strided_copy.cu.j2", "matmul_tma16.cu.j2")
_CONV = ("conv2d_simt.cu.j2", "conv2d_mma.cu.j2", "conv2d_prep.cu.j2", "conv2d_direct.cu.j2",
         "matmul_tma16.cu.j2")   # (the TMA kernel: ops/conv2d_tma.py)
_T_EW = "tests/test_elementwise.py"
_STRIDED = ("strided_copy.cu.j2",)
_T_SHAPE = "tests/test_shape_ops.py"
_IX = ("indexing.cu.j2",)
_T_IX = "tests/test_indexing.py"


def _math(name: str, family: str, templates: Tuple[str, ...], test: str,
          *report: str) -> OpEntry:
    return OpEntry(name, "CudaMath", family, templates, test, report)


def _ml(name: str, family: str, templates: Tuple[str, ...], test: str,
        *report: str) -> OpEntry:
    return OpEntry(name, "CudaML", family, templates, test, report)


_ENTRIES: List[OpEntry] = [
    # CudaMath: tensors filled or copied
    _math("fill", "elementwise", _FILL, _T_EW, "vector/fill"),
    _math("zeros", "elementwise", _FILL, _T_EW, "vector/zeros"),
    _math("ones", "elementwise", _FILL, _T_EW, "vector/ones"),
    _math("copy", "elementwise", (), _T_EW, "vector/copy"),   # a device-to-device copy
    # CudaMath: elementwise
    _math("vector_add", "elementwise", _EW, _T_EW, "vector/vector_add"),
    _math("add", "elementwise", _EW, _T_EW, "vector/add", "matrix/add"),
    *[_math(op, "elementwise", _EW, _T_EW, f"vector/{op}")
      for op in ("subtract", "multiply", "divide", "maximum", "minimum", "power",
                 "exp", "log", "sqrt", "abs", "tanh", "negative", "relu", "sigmoid")],
    # CudaMath: reductions
    *[_math(op, "reduction", _REDUCE, "tests/test_reduce.py", f"vector/{op}", f"matrix/{op}")
      for op in ("reduce_sum", "reduce_max", "reduce_min", "reduce_mean", "argmax")],
    *[_math(op, "softmax", ("softmax.cu.j2",), "tests/test_softmax.py", f"matrix/{op}")
      for op in ("softmax", "log_softmax")],
    # CudaMath: matrices (matmul: fill.cu.j2 for K == 0, transpose.cu.j2 for wgmma's B)
    _math("matrix_transpose", "transpose", ("transpose.cu.j2",), "tests/test_transpose.py",
          "matrix/matrix_transpose"),
    _math("matrix_multiply", "matmul", _MM + ("matmul_wgmma.cu.j2", "matmul_dmma.cu.j2")
          + _FILL + ("transpose.cu.j2",) + _WGMMA16, "tests/test_matmul.py",
          "matrix/matrix_multiply"),
    # CudaMath: shapes (views: no kernel; permute's plain 2-D transposes: transpose.cu.j2)
    _math("reshape", "shape", (), _T_SHAPE, "matrix/reshape"),
    _math("view", "shape", (), _T_SHAPE, "matrix/view"),
    _math("permute", "shape", _STRIDED + ("transpose.cu.j2",), _T_SHAPE, "matrix/permute"),
    _math("transpose", "shape", _STRIDED + ("transpose.cu.j2",), _T_SHAPE, "matrix/transpose"),
    *[_math(op, "shape", _STRIDED, _T_SHAPE, f"matrix/{op}")
      for op in ("getitem", "concatenate", "stack", "split", "broadcast_to", "astype")],
    # CudaMath: comparisons and indexing
    *[_math(op, "indexing", _IX, _T_IX, f"matrix/{op}")
      for op in ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal",
                 "where", "take", "gather", "scatter_add")],
    # CudaML
    _ml("conv2d", "conv2d", _CONV, "tests/test_conv2d.py", "ml/conv2d"),
    _ml("activation", "elementwise", _EW, _T_EW, "ml/activation"),
    _ml("gelu", "elementwise", _EW, _T_EW, "ml/gelu"),
    _ml("max_pool2d", "pooling", ("pool2d.cu.j2",), "tests/test_pooling.py", "ml/max_pool2d"),
    _ml("avg_pool2d", "pooling", ("pool2d.cu.j2",), "tests/test_pooling.py", "ml/avg_pool2d"),
    _ml("batch_norm", "normalization", ("batch_norm.cu.j2",), "tests/test_batch_norm.py",
        "ml/batch_norm"),
    _ml("layer_norm", "normalization", ("layer_norm.cu.j2",), "tests/test_layer_norm.py",
        "ml/layer_norm"),
    # CudaML.softmax / log_softmax are CudaMath's: the report times them there
    _ml("softmax", "softmax", ("softmax.cu.j2",), "tests/test_softmax.py", "matrix/softmax"),
    _ml("log_softmax", "softmax", ("softmax.cu.j2",), "tests/test_softmax.py",
        "matrix/log_softmax"),
    _ml("dropout", "dropout", ("dropout.cu.j2",), "tests/test_dropout.py", "ml/dropout"),
    # dropout_backward: the forward's kernel on grad_out, the mask regenerated from the seed
    _ml("dropout_backward", "dropout", ("dropout.cu.j2",), "tests/test_dropout.py",
        "ml/dropout_backward"),
    _ml("sgd_update", "optimizers", ("optimizers.cu.j2",), "tests/test_optimizers.py",
        "ml/sgd_update"),
    _ml("adam_update", "optimizers", ("optimizers.cu.j2",), "tests/test_optimizers.py",
        "ml/adam_update"),
    # fused_linear_gelu: the matmul kernels with a bias + GELU epilogue (matmul.linear);
    # sketched_linear composes matmul, a reduction and elementwise ops
    _ml("fused_linear_gelu", "linear", _MM, "tests/test_linear.py", "ml/fused_linear_gelu"),
    _ml("flash_attention", "attention", ("flash_attention.cu.j2", "flash_attention_tma.cu.j2")
        + _FILL,
        "tests/test_flash_attention.py", "ml/flash_attention"),
    _ml("sketched_linear", "linear", _MM + ("matmul_dmma.cu.j2",) + _REDUCE + _EW,
        "tests/test_linear.py", "ml/sketched_linear"),
    # gradients (models, part 1): activations, softmax / log_softmax, fused cross-entropy
    *[_ml(f"{op}_backward", "activation_backward", ("activation_backward.cu.j2",),
          "tests/test_backward.py", f"ml/{op}_backward")
      for op in ("relu", "leaky_relu", "elu", "gelu", "sigmoid", "tanh")],
    *[_ml(op, "softmax_backward", ("softmax_backward.cu.j2",), "tests/test_backward.py",
          f"ml/{op}") for op in ("softmax_backward", "log_softmax_backward")],
    *[_ml(op, "cross_entropy", ("cross_entropy.cu.j2",), "tests/test_backward.py", f"ml/{op}")
      for op in ("cross_entropy", "cross_entropy_backward")],
    # the plain linear layer (matmul.linear, the bias epilogue alone) and the GEMM gradients:
    # the matmul kernels (a_trans, b_trans, the bias_gelu_grad epilogue), wgmma and
    # transpose.cu.j2 for TF32's transposed A, the reductions for bias and batch sums
    _ml("linear", "linear", _MM, "tests/test_matmul_backward.py", "ml/linear"),
    *[_ml(op, "matmul_backward", _MM + ("matmul_wgmma.cu.j2", "matmul_dmma.cu.j2") + _FILL
          + ("transpose.cu.j2",) + _REDUCE + _WGMMA16 + ("matmul_grouped.cu.j2",),
          "tests/test_matmul_backward.py", f"ml/{op}")
      for op in ("matmul_backward", "linear_backward", "fused_linear_gelu_backward")],
    *[_ml(f"{kind}_pool2d_backward", "pooling_backward", ("pool2d_backward.cu.j2",),
          "tests/test_pooling_backward.py", f"ml/{kind}_pool2d_backward")
      for kind in ("max", "avg")],
    # conv2d gradients: dgrad / wgrad GEMMs and their auxiliary kernels; the forward's
    # kernels run the stride-1 data gradient as conv2d(grad_out, flipped filter)
    _ml("conv2d_backward", "conv2d_backward", ("conv2d_dgrad.cu.j2", "conv2d_wgrad.cu.j2",
                                                "conv2d_wgrad_mma.cu.j2",
                                                "conv2d_grad_aux.cu.j2") + _CONV,
        "tests/test_conv2d_backward.py", "ml/conv2d_backward"),
    # attention gradients: a prep kernel (delta, lse2, the dQ accumulator zeroed), the main
    # kernel (dK, dV; dQ by atomics), the same prep template's dQ stage
    _ml("flash_attention_backward", "attention_backward",
        ("flash_attention_backward.cu.j2", "flash_attention_backward_prep.cu.j2"),
        "tests/test_attention_backward.py", "ml/flash_attention_backward"),
    # attention straight from a fused (batch, seq, 3 * C) projection: the same kernels
    _ml("flash_attention_packed", "attention", ("flash_attention.cu.j2",) + _FILL,
        "tests/test_flash_attention_packed.py", "ml/flash_attention_packed"),
    _ml("flash_attention_packed_backward", "attention_backward",
        ("flash_attention_backward.cu.j2", "flash_attention_backward_prep.cu.j2"),
        "tests/test_flash_attention_packed.py", "ml/flash_attention_packed_backward"),
    # normalization gradients: statistics recomputed, per-block partial sums, fixed-order finish
    _ml("layer_norm_backward", "normalization_backward", ("layer_norm_backward.cu.j2",),
        "tests/test_normalization_backward.py", "ml/layer_norm_backward"),
    _ml("batch_norm_backward", "normalization_backward", ("batch_norm_backward.cu.j2",),
        "tests/test_normalization_backward.py", "ml/batch_norm_backward"),
]

OPS: Dict[str, OpEntry] = {e.key: e for e in _ENTRIES}

# Public methods that are not operations: {"Class.method": why}.
NON_OPS: Dict[str, str] = {
    "CudaMath.create_tensor": "allocates an uninitialized tensor (no kernel)",
    "CudaMath.from_numpy": "host-to-device copy (transfers; the report's transfers cases)",
    "CudaMath.to_numpy": "device-to-host copy (transfers; the report's transfers cases)",
    "CudaMath.free_tensor": "returns memory to the pool",
    "CudaMath.from_cuda_array": "wraps another library's device array without copying",
    "CudaMath.from_dlpack": "wraps a DLPack producer's memory without copying (dlpack.py)",
    "CudaMath.to_device": "copies a tensor to another GPU (perf/bench_multigpu.py times it)",
    "CudaMath.kernel": "the compiled-kernel accessor the op modules use",
    "CudaMath.benchmark_operations": "the documented API's benchmark runner over the operations",
    "CudaML.sketched_linear_params": "draws random sketch weights on the host (no kernel)",
}


def entries(family: Optional[str] = None, owner: Optional[str] = None) -> List[OpEntry]:
    """The OPS entries, optionally of one family and/or one owner class."""
    return [e for e in OPS.values()
            if (family is None or e.family == family) and (owner is None or e.owner == owner)]


def family_module(family: str) -> ModuleType:
    """cuda_backend.ops.<family> (imported on first use)."""
    if family not in FAMILIES:
        raise KeyError(f"unknown op family {family!r}; families: {', '.join(FAMILIES)}")
    return importlib.import_module(f"cuda_backend.ops.{family}")


def family_modules() -> List[ModuleType]:
    """Every family module, in FAMILIES order."""
    return [family_module(f) for f in FAMILIES]


def templates_of(family: str) -> Tuple[str, ...]:
    """The templates a family renders (its module's TEMPLATES)."""
    return tuple(family_module(family).TEMPLATES)
