"""The op registry (cuda_backend/registry.py) against what it describes: every public CudaMath /
CudaML method is an op or a listed non-op; each op's family module keeps the contract; its
templates render; its test file and report cases exist; each family's float64 reference
agrees with the op (fallback mode)."""
from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
from helpers import StandInMath

from cuda_backend import kernels, registry
from cuda_backend.compiler import declared_kernels
from cuda_backend.cuda_math import CudaMath
from cuda_backend.cuda_ml import ActivationType, ConvolutionConfig, CudaML, OptimizerState
from cuda_backend.driver import load_driver
from cuda_backend.kernels import KernelGenerator, template_variants
from cuda_backend.performance import cases_math, cases_ml

REPO = Path(__file__).resolve().parents[1]
GEN = KernelGenerator(backend=object())   # rendering never touches the backend
VARIANTS = template_variants()
CLASSES = {"CudaMath": CudaMath, "CudaML": CudaML}
REPORT_CASES = {f"{d.family}/{d.op}" for d in cases_math.MATH_OPS + cases_ml.ML_OPS}


def public_methods(cls):
    """Public callables of an API class (properties left out), as the report discovers them."""
    return sorted(name for name, value in inspect.getmembers(cls)
                  if not name.startswith("_") and not isinstance(value, property)
                  and callable(value))


# -- the table against the classes ------------------------------------------------------
@pytest.mark.parametrize("owner", sorted(CLASSES))
def test_every_public_method_is_an_op_or_a_non_op(owner):
    names = {f"{owner}.{n}" for n in public_methods(CLASSES[owner])}
    missing = sorted(names - set(registry.OPS) - set(registry.NON_OPS))
    assert not missing, f"add an OpEntry to registry.OPS (or a NON_OPS reason): {missing}"
    listed = {k for k in list(registry.OPS) + list(registry.NON_OPS) if k.startswith(owner + ".")}
    assert not sorted(listed - names), "registry names a method the class does not have"


def test_ops_and_non_ops_are_disjoint_and_keyed_by_owner():
    assert not set(registry.OPS) & set(registry.NON_OPS)
    for key, e in registry.OPS.items():
        assert key == e.key == f"{e.owner}.{e.name}" and e.owner in CLASSES
    assert all(reason for reason in registry.NON_OPS.values())


def test_non_ops_agree_with_the_report():
    """The report's discover() leaves out the same methods (NON_OPS there also lists
    attributes that are not public callables of the class)."""
    for owner, report_non_ops in (("CudaMath", cases_math.NON_OPS),
                                  ("CudaML", cases_ml.NON_OPS)):
        ours = {k.split(".", 1)[1] for k in registry.NON_OPS if k.startswith(owner + ".")}
        callables = set(public_methods(CLASSES[owner]))
        assert ours == set(report_non_ops) & callables, owner


# -- the family modules ------------------------------------------------------------------
def test_families_are_the_entries_families():
    assert set(registry.FAMILIES) == {e.family for e in registry.OPS.values()}
    assert len(set(registry.FAMILIES)) == len(registry.FAMILIES)
    assert set(registry.AUTOTUNED) <= set(registry.FAMILIES)


@pytest.mark.parametrize("family", registry.FAMILIES)
def test_family_module_keeps_the_contract(family):
    mod = registry.family_module(family)
    for name in registry.CONTRACT:
        assert hasattr(mod, name), f"ops/{family}.py has no {name}"
    if family in registry.AUTOTUNED:
        assert callable(getattr(mod, "candidates", None)), f"ops/{family}.py: candidates"
    assert isinstance(mod.TEMPLATES, tuple) and all(isinstance(t, str) for t in mod.TEMPLATES)
    assert set(mod.template_variants()) <= set(mod.TEMPLATES)
    used = set()
    for e in registry.entries(family):
        used |= set(e.templates)
    assert set(mod.TEMPLATES) <= used, "a template the family's ops do not render"
    sig = inspect.signature(mod.warm_up)
    params = list(sig.parameters.values())
    assert [p.name for p in params[:3]] == ["m", "device_id", "workers"]
    assert params[1].default is None and params[2].default == 8
    assert callable(mod.reference)


def test_every_template_belongs_to_a_family_or_kernels():
    claimed = set(kernels.KERNEL_TEMPLATES)
    for family in registry.FAMILIES:
        claimed |= set(registry.templates_of(family))
    assert claimed == set(GEN.list_templates())


def test_kernels_gathers_the_families_variants():
    assert not hasattr(kernels, "OP_MODULES")
    expected = set(kernels.KERNEL_TEMPLATES)
    for mod in registry.family_modules():
        expected |= set(mod.template_variants())
    assert set(VARIANTS) == expected


def test_templates_declare_their_arch():
    assert kernels.template_arch("matmul_wgmma.cu.j2") == "sm_90a"
    assert kernels.template_arch("matmul_wgmma16.cu.j2") == "sm_90a"
    assert kernels.template_arch("matmul_mma.cu.j2") is None
    assert kernels.template_arch("no_such.cu.j2") is None
    assert kernels.template_arch("matmul_tma16.cu.j2") == "sm_90a"
    assert kernels.template_arch("flash_attention_tma.cu.j2") == "sm_90a"
    assert kernels.TEMPLATE_ARCH == {"matmul_wgmma.cu.j2": "sm_90a",
                                     "matmul_wgmma16.cu.j2": "sm_90a",
                                     "matmul_tma16.cu.j2": "sm_90a",
                                     "flash_attention_tma.cu.j2": "sm_90a"}


# -- warm_up with a stand-in CudaMath (records the kernels asked for) -----------------------
@pytest.mark.parametrize("family", registry.FAMILIES)
def test_warm_up_compiles_the_family_templates(family):
    mod = registry.family_module(family)
    m = StandInMath()
    n = mod.warm_up(m, workers=4)
    assert n > 0 and len(m.calls) == n
    assert {t for t, _, _ in m.calls} <= set(mod.TEMPLATES)
    assert all(dev == 0 for _, dev, _ in m.calls)
    assert mod.warm_up(StandInMath(gpu=False)) == 0


# -- each entry ------------------------------------------------------------------------------
@pytest.mark.parametrize("key", sorted(registry.OPS))
def test_entry(key):
    e = registry.OPS[key]
    assert callable(getattr(CLASSES[e.owner], e.name))
    assert e.family in registry.FAMILIES
    for t in e.templates:
        assert VARIANTS.get(t), f"{key}: template {t} has no parameter sets"
        name, source = GEN.render_kernel(t, **dict(VARIANTS[t][0]))
        assert declared_kernels(source) == [name]
    assert (REPO / e.test).is_file(), e.test
    assert e.report, f"{key}: no report case"
    for case in e.report:
        assert case in REPORT_CASES, f"{key}: no report case {case} in cases_math/cases_ml"


# -- references against the ops (fallback mode: the ops compute in NumPy) ---------------------
fallback_only = pytest.mark.skipif(load_driver()[0] is not None,
                                   reason="fallback-mode comparison; the ops' GPU tests check "
                                          "the kernels")
RNG = np.random.default_rng(7)
X, Y = RNG.standard_normal((2, 3, 6))
POS = RNG.uniform(0.5, 2.0, (3, 6))
IMG = RNG.standard_normal((2, 4, 6, 6))
CONV_W = RNG.standard_normal((3, 4, 3, 3)) / 6
CH = [RNG.uniform(0.5, 1.5, 4), RNG.standard_normal(4), RNG.standard_normal(4) * 0.1,
      RNG.uniform(0.5, 2.0, 4)]
LIN_W, LIN_B = RNG.standard_normal((5, 6)) / 3, RNG.standard_normal(5)
Q, K, V = RNG.standard_normal((3, 1, 2, 5, 8))
U, VV = RNG.standard_normal((3, 6, 2)), RNG.standard_normal((3, 2, 4))
P, G, MB = RNG.standard_normal((3, 10))
VB = RNG.uniform(0.0, 0.1, 10)


def _ref(family):
    return registry.family_module(family).reference


def _sgd(m, ml, t):
    p, state = t(P), OptimizerState(learning_rate=0.1, momentum=0.9, step=1)
    ml.sgd_update(p, t(G), t(MB), state)
    return p


def _adam(m, ml, t):
    p, state = t(P), OptimizerState(learning_rate=0.01, step=2, weight_decay=0.1)
    ml.adam_update(p, t(G), t(MB), t(VB), state)
    return p


_CONV_CFG = ConvolutionConfig(kernel_size=3, padding=1)
# key -> (dtype, ours(m, ml, tensor), reference()) with the family's reference; float32 where
# the op has no float64 (inputs rounded to float32 first, for the reference too)
F32 = "float32"
F64 = "float64"


def _r32(a):
    return np.asarray(a, np.float32).astype(np.float64)


SAMPLES = {
    "CudaMath.fill": (F64, lambda m, ml, t: m.fill(t(X), 1.5), lambda: np.full(X.shape, 1.5)),
    "CudaMath.zeros": (F64, lambda m, ml, t: m.zeros(X.shape, F64), lambda: np.zeros(X.shape)),
    "CudaMath.ones": (F64, lambda m, ml, t: m.ones(X.shape, F64), lambda: np.ones(X.shape)),
    "CudaMath.copy": (F64, lambda m, ml, t: m.copy(t(X)), lambda: X),
    "CudaMath.vector_add": (F64, lambda m, ml, t: m.vector_add(t(X), t(Y)),
                            lambda: _ref("elementwise")("add", X, Y)),
    "CudaMath.softmax": (F64, lambda m, ml, t: m.softmax(t(X)), lambda: _ref("softmax")(X)),
    "CudaMath.log_softmax": (F64, lambda m, ml, t: m.log_softmax(t(X)),
                             lambda: _ref("softmax")(X, log=True)),
    "CudaMath.matrix_transpose": (F64, lambda m, ml, t: m.matrix_transpose(t(X)),
                                  lambda: _ref("transpose")(X)),
    "CudaMath.matrix_multiply": (F64, lambda m, ml, t: m.matrix_multiply(t(X), t(Y.T)),
                                 lambda: _ref("matmul")(X, Y.T)),
    "CudaML.conv2d": (F32, lambda m, ml, t: ml.conv2d(t(IMG), t(CONV_W), _CONV_CFG),
                      lambda: _ref("conv2d")(_r32(IMG), _r32(CONV_W), None, registry.family_module(
                          "conv2d").plan(IMG.shape, CONV_W.shape, _CONV_CFG))),
    "CudaML.activation": (F64, lambda m, ml, t: ml.activation(t(X), ActivationType.ELU),
                          lambda: _ref("elementwise")("elu", X)),
    "CudaML.gelu": (F64, lambda m, ml, t: ml.gelu(t(X)), lambda: _ref("elementwise")("gelu", X)),
    "CudaML.max_pool2d": (F64, lambda m, ml, t: ml.max_pool2d(t(IMG), 2, padding=1),
                          lambda: _ref("pooling")(IMG, "max", 2, padding=1)),
    "CudaML.avg_pool2d": (F64, lambda m, ml, t: ml.avg_pool2d(t(IMG), 3, stride=2),
                          lambda: _ref("pooling")(IMG, "avg", 3, 2)),
    "CudaML.batch_norm": (F64, lambda m, ml, t: ml.batch_norm(t(IMG), *map(t, CH)),
                          lambda: _ref("normalization")("batch_norm", IMG, *CH)),
    "CudaML.layer_norm": (F64, lambda m, ml, t: ml.layer_norm(t(X), t(X[0]), t(Y[0])),
                          lambda: _ref("normalization")("layer_norm", X, X[0], Y[0])),
    "CudaML.softmax": (F64, lambda m, ml, t: ml.softmax(t(X)), lambda: _ref("softmax")(X)),
    "CudaML.log_softmax": (F64, lambda m, ml, t: ml.log_softmax(t(X)),
                           lambda: _ref("softmax")(X, log=True)),
    "CudaML.dropout": (F64, lambda m, ml, t: ml.dropout(t(X), 0.6, seed=11),
                       lambda: _ref("dropout")(X, 0.6, 11)),
    "CudaML.sgd_update": (F64, _sgd, lambda: _ref("optimizers")(
        "sgd", OptimizerState(learning_rate=0.1, momentum=0.9, step=1), P, G, MB)[0]),
    "CudaML.adam_update": (F64, _adam, lambda: _ref("optimizers")(
        "adam", OptimizerState(learning_rate=0.01, step=2, weight_decay=0.1), P, G, MB, VB)[0]),
    "CudaML.fused_linear_gelu": (F64, lambda m, ml, t: ml.fused_linear_gelu(
        t(X), t(LIN_W), t(LIN_B)), lambda: _ref("linear")("fused_linear_gelu", X, LIN_W,
                                                           bias=LIN_B)),
    "CudaML.flash_attention": (F32, lambda m, ml, t: ml.flash_attention(t(Q), t(K), t(V)),
                               lambda: _ref("attention")(_r32(Q), _r32(K), _r32(V),
                                                         1 / np.sqrt(8), False)),
    "CudaML.sketched_linear": (F64, lambda m, ml, t: ml.sketched_linear(t(X), t(U), t(VV)),
                               lambda: _ref("linear")("sketched_linear", X, U, VV)),
}
_BINARY_INPUTS = {"divide": (X, POS), "power": (POS, Y)}
for _op in ("add", "subtract", "multiply", "divide", "maximum", "minimum", "power"):
    _a, _b = _BINARY_INPUTS.get(_op, (X, Y))
    SAMPLES[f"CudaMath.{_op}"] = (
        F64, lambda m, ml, t, op=_op, a=_a, b=_b: getattr(m, op)(t(a), t(b)),
        lambda op=_op, a=_a, b=_b: _ref("elementwise")(op, a, b))
for _op in ("exp", "log", "sqrt", "abs", "tanh", "negative", "relu", "sigmoid"):
    _a = POS if _op in ("log", "sqrt") else X
    SAMPLES[f"CudaMath.{_op}"] = (F64, lambda m, ml, t, op=_op, a=_a: getattr(m, op)(t(a)),
                                  lambda op=_op, a=_a: _ref("elementwise")(op, a))
for _op in ("sum", "max", "min", "mean"):
    SAMPLES[f"CudaMath.reduce_{_op}"] = (
        F64, lambda m, ml, t, op=_op: getattr(m, f"reduce_{op}")(t(IMG), axis=(0, 2)),
        lambda op=_op: _ref("reduction")(op, IMG, axis=(0, 2)))
SAMPLES["CudaMath.argmax"] = (F64, lambda m, ml, t: m.argmax(t(X), axis=1),
                              lambda: _ref("reduction")("argmax", X, axis=1))
# shapes and indexing: int64 indices into X's last axis (size 6), with repeats and negatives
_IDX = np.array([[2, 0], [5, -4]])
_GIDX = np.array([[0, 5, -1, 2]])
_SRC = RNG.standard_normal(X.shape[:1] + _IDX.shape)
_KEY = (1, slice(None, None, -2), Ellipsis, slice(1, 5, 3))
RX, RY = np.round(X), np.round(Y[0])
SAMPLES.update({
    "CudaMath.reshape": (F64, lambda m, ml, t: m.reshape(t(X), (3, -1)),
                         lambda: _ref("shape")("reshape", X, (3, -1))),
    "CudaMath.view": (F64, lambda m, ml, t: m.view(t(X), (9, 2)),
                      lambda: _ref("shape")("view", X, (9, 2))),
    "CudaMath.permute": (F64, lambda m, ml, t: m.permute(t(IMG), (2, 0, 3, 1)),
                         lambda: _ref("shape")("permute", IMG, (2, 0, 3, 1))),
    "CudaMath.transpose": (F64, lambda m, ml, t: m.transpose(t(X)),
                           lambda: _ref("shape")("transpose", X)),
    "CudaMath.getitem": (F64, lambda m, ml, t: m.getitem(t(IMG), _KEY),
                         lambda: _ref("shape")("getitem", IMG, _KEY)),
    "CudaMath.concatenate": (F64, lambda m, ml, t: m.concatenate([t(X), t(Y)], axis=1),
                             lambda: _ref("shape")("concatenate", [X, Y], axis=1)),
    "CudaMath.stack": (F64, lambda m, ml, t: m.stack([t(X), t(Y)], axis=-1),
                       lambda: _ref("shape")("stack", [X, Y], axis=-1)),
    "CudaMath.split": (F64, lambda m, ml, t: m.split(t(X), 3, axis=1)[1],
                       lambda: _ref("shape")("split", X, 3, axis=1)[1]),
    "CudaMath.broadcast_to": (F64, lambda m, ml, t: m.broadcast_to(t(X[0, :1]), (2, 3, 6)),
                              lambda: _ref("shape")("broadcast_to", X[0, :1], (2, 3, 6))),
    "CudaMath.astype": (F64, lambda m, ml, t: m.astype(t(X * 4), "int32"),
                        lambda: _ref("shape")("astype", X * 4, "int32").astype(np.float64)),
    "CudaMath.where": (F64, lambda m, ml, t: m.where(m.greater(t(X), 0.0), t(X), t(Y[0])),
                       lambda: _ref("indexing")("where", X > 0, X, Y[0])),
    "CudaMath.take": (F64, lambda m, ml, t: m.take(t(X), m.from_numpy(_IDX), axis=1),
                      lambda: _ref("indexing")("take", X, _IDX, axis=1)),
    "CudaMath.gather": (F64, lambda m, ml, t: m.gather(t(X), m.from_numpy(_GIDX), axis=1),
                        lambda: _ref("indexing")("gather", X, _GIDX, axis=1)),
    "CudaMath.scatter_add": (F64, lambda m, ml, t: m.scatter_add(
        t(X), m.from_numpy(_IDX), t(_SRC), axis=1),
        lambda: _ref("indexing")("scatter_add", X, _IDX, _SRC, axis=1)),
})
for _op in ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal"):
    SAMPLES[f"CudaMath.{_op}"] = (
        F64, lambda m, ml, t, op=_op: getattr(m, op)(t(RX), t(RY)),
        lambda op=_op: _ref("indexing")(op, RX, RY).astype(np.float64))
# gradients: activations (sigmoid / tanh from their outputs), softmax, cross-entropy
_BRNG = np.random.default_rng(13)
_LOGITS = _BRNG.standard_normal((5, 7)) * 3
_LABELS = np.array([0, 6, -100, 3, 2])
_SIG, _TANH = 1 / (1 + np.exp(-X)), np.tanh(X)
for _op, _v in (("relu", X), ("leaky_relu", X), ("elu", X), ("gelu", X), ("sigmoid", _SIG),
                ("tanh", _TANH)):
    SAMPLES[f"CudaML.{_op}_backward"] = (
        F64, lambda m, ml, t, op=_op, v=_v: getattr(ml, f"{op}_backward")(t(Y), t(v)),
        lambda op=_op, v=_v: _ref("activation_backward")(op, Y, v))
SAMPLES.update({
    "CudaML.softmax_backward": (F64, lambda m, ml, t: ml.softmax_backward(t(Y), t(_SIG)),
                                lambda: _ref("softmax_backward")(Y, _SIG)),
    "CudaML.log_softmax_backward": (
        F64, lambda m, ml, t: ml.log_softmax_backward(t(Y), t(-_SIG)),
        lambda: _ref("softmax_backward")(Y, -_SIG, log=True)),
    "CudaML.cross_entropy": (
        F64, lambda m, ml, t: ml.cross_entropy(t(_LOGITS), m.from_numpy(_LABELS)),
        lambda: _ref("cross_entropy")("cross_entropy", _LOGITS, _LABELS)),
    "CudaML.cross_entropy_backward": (
        F64, lambda m, ml, t: ml.cross_entropy_backward(t(_LOGITS), m.from_numpy(_LABELS), 0.5,
                                                        reduction="sum"),
        lambda: _ref("cross_entropy")("cross_entropy_backward", _LOGITS, _LABELS, "sum",
                                      grad_loss=0.5)),
})

# conv2d gradients: grad_input (the family's reference gives all three), float32 operands
_CONV_GO = np.random.default_rng(17).standard_normal((2, 3, 6, 6))
SAMPLES["CudaML.conv2d_backward"] = (
    F32, lambda m, ml, t: ml.conv2d_backward(t(_CONV_GO), t(IMG), t(CONV_W), _CONV_CFG)[0],
    lambda: _ref("conv2d_backward")(_r32(_CONV_GO), _r32(IMG), _r32(CONV_W), registry.family_module(
        "conv2d").plan(IMG.shape, CONV_W.shape, _CONV_CFG))[0])

# attention gradients: grad_q from the forward's out and lse, float32 operands
_ATT_GO = np.random.default_rng(19).standard_normal(Q.shape)


def _attention_grad_q(m, ml, t):
    q, k, v = t(Q), t(K), t(V)
    out, lse = ml.flash_attention(q, k, v, return_lse=True)
    return ml.flash_attention_backward(t(_ATT_GO), q, k, v, out, lse)[0]


SAMPLES["CudaML.flash_attention_backward"] = (
    F32, _attention_grad_q, lambda: _ref("attention_backward")(
        _r32(_ATT_GO), _r32(Q), _r32(K), _r32(V), 1 / np.sqrt(8), False)[0])

# attention from a fused (batch, seq, 3 * C) projection: Q, K, V (1, 2, 5, 8) packed, 2 heads
def _pack(a):
    return np.swapaxes(a, 1, 2).reshape(1, 5, 16)


_QKV = np.concatenate([_pack(a) for a in (Q, K, V)], axis=2)
_QKV_GO = np.random.default_rng(29).standard_normal((1, 5, 16))
SAMPLES["CudaML.flash_attention_packed"] = (
    F32, lambda m, ml, t: ml.flash_attention_packed(t(_QKV), 2),
    lambda: _pack(_ref("attention")(_r32(Q), _r32(K), _r32(V), 1 / np.sqrt(8), False)))


def _attention_packed_grad(m, ml, t):
    qkv = t(_QKV)
    out, lse = ml.flash_attention_packed(qkv, 2, return_lse=True)
    return ml.flash_attention_packed_backward(t(_QKV_GO), qkv, out, lse, 2)


SAMPLES["CudaML.flash_attention_packed_backward"] = (
    F32, _attention_packed_grad, lambda: np.concatenate([_pack(g) for g in _ref(
        "attention_backward")(np.swapaxes(_r32(_QKV_GO).reshape(1, 5, 2, 8), 1, 2), _r32(Q),
                              _r32(K), _r32(V), 1 / np.sqrt(8), False)], axis=2))


# normalization gradients: grad_x
SAMPLES["CudaML.layer_norm_backward"] = (
    F64, lambda m, ml, t: ml.layer_norm_backward(t(Y), t(X), t(X[0]))[0],
    lambda: _ref("normalization_backward")("layer_norm", Y, X, X[0])[0])
SAMPLES["CudaML.batch_norm_backward"] = (
    F64, lambda m, ml, t: ml.batch_norm_backward(t(IMG * 0.5 + 1), t(IMG), t(CH[0]))[0],
    lambda: _ref("normalization_backward")("batch_norm", IMG * 0.5 + 1, IMG, CH[0])[0])

# pooling and dropout gradients
_PG = np.random.default_rng(23).standard_normal((2, 4, 4, 4))
SAMPLES["CudaML.max_pool2d_backward"] = (F64, lambda m, ml, t: ml.max_pool2d_backward(
    t(_PG), t(IMG), 2, padding=1), lambda: _ref("pooling_backward")("max", _PG, IMG, 2, padding=1))
SAMPLES["CudaML.avg_pool2d_backward"] = (F64, lambda m, ml, t: ml.avg_pool2d_backward(
    t(_PG[:, :, :2, :2]), t(IMG), 3, 2),
    lambda: _ref("pooling_backward")("avg", _PG[:, :, :2, :2], IMG, 3, 2))
SAMPLES["CudaML.dropout_backward"] = (F64, lambda m, ml, t: ml.dropout_backward(t(X), 0.6, 11),
                                      lambda: _ref("dropout")(X, 0.6, 11))

# GEMM gradients and the plain linear layer (ops/matmul_backward.py, ops/linear.py): X (3, 6),
# LIN_W (5, 6); the products' upstream gradients and matmul's b drawn here
_GRNG = np.random.default_rng(17)
_GY, _GM, _MB = _GRNG.standard_normal((3, 5)), _GRNG.standard_normal((3, 4)), \
    _GRNG.standard_normal((6, 4))
SAMPLES.update({
    "CudaML.linear": (F64, lambda m, ml, t: ml.linear(t(X), t(LIN_W), t(LIN_B)),
                      lambda: _ref("linear")("linear", X, LIN_W, bias=LIN_B)),
    "CudaML.linear_backward": (
        F64, lambda m, ml, t: ml.linear_backward(t(_GY), t(X), t(LIN_W))[1],
        lambda: _ref("matmul_backward")("linear_backward", _GY, X, LIN_W)[1]),
    "CudaML.fused_linear_gelu_backward": (
        F64, lambda m, ml, t: ml.fused_linear_gelu_backward(t(_GY), t(X), t(LIN_W), t(LIN_B))[0],
        lambda: _ref("matmul_backward")("fused_linear_gelu_backward", _GY, X, LIN_W,
                                        bias=LIN_B)[0]),
    "CudaML.matmul_backward": (
        F64, lambda m, ml, t: ml.matmul_backward(t(_GM), t(X), t(_MB))[1],
        lambda: _ref("matmul_backward")("matmul_backward", _GM, X, _MB)[1]),
})


def test_every_op_has_a_reference_sample():
    assert set(SAMPLES) == set(registry.OPS)


@pytest.fixture(scope="module")
def apis(backend):
    m = CudaMath(backend)
    return m, CudaML(m)


@fallback_only
@pytest.mark.parametrize("key", sorted(SAMPLES))
def test_reference_matches_the_op(apis, key):
    m, ml = apis
    dtype, ours, ref = SAMPLES[key]

    def t(a):
        return m.from_numpy(np.asarray(a, np.float64), dtype=dtype)

    out = m.to_numpy(ours(m, ml, t)).astype(np.float64)
    expected = ref()
    assert isinstance(expected, np.ndarray)
    assert expected.dtype in (np.float64, np.int64), expected.dtype
    assert out.shape == expected.shape
    tol = 1e-12 if dtype == F64 else 1e-5
    np.testing.assert_allclose(out, expected, rtol=tol, atol=tol * max(1.0, np.abs(expected).max()))
