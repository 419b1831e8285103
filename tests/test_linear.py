"""fused_linear_gelu and sketched_linear against float64 NumPy, on the GPU and in fallback.

fused_linear_gelu is one kernel (matmul.linear: the matmul kernels with b_trans and the
bias + GELU epilogue), or for M <= 64 possibly the skinny split-K kernel and its reduce (which
adds the bias and applies GELU: matmul.SKINNY_F32) or on sm_90+ one cluster kernel
(matmul.CLUSTER_F32), both tested at the end. GPU tests (marked `gpu`) poison the output
first and bound ||out - ref|| by the GEMM error scale || |x| |W|ᵀ + |b| ||, as
tests/test_matmul.py does; the launch-recording tests run anywhere and check what would be
launched.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
from helpers import RecordingMath, poisoned, tuned_math

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend.cuda_ml import CudaML
from cuda_backend.kernels import KernelGenerator
from cuda_backend.ops import common, matmul as mm
from cuda_backend.ops import linear as lin

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def ml(backend, tmp_path_factory):
    """A CudaML on its own CudaMath (autotuner in a temporary file); on a GPU the linear
    kernels are compiled up front, in parallel."""
    m = tuned_math(backend, tmp_path_factory)
    if m.gpu:
        jobs = [(t, p) for t, sets in mm.template_variants().items() for p in sets
                if ("b_trans" in p or p.get("kind") == "splitk_epilogue")
                and mm.runs_here(m, t)]
        jobs += [(mm.SKINNY_TEMPLATE, p) for p in lin.template_variants()[mm.SKINNY_TEMPLATE]
                 if mm.runs_here(m, mm.SKINNY_TEMPLATE)]
        common.compile_all(m, jobs, None, 16, mm.compile_kernel)
    return CudaML(m)


def gelu_tanh(z):
    return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))


TOL = {DT.FLOAT32: 1e-5, DT.FLOAT64: 1e-12, DT.FLOAT16: 2e-2, DT.BFLOAT16: 2e-2}


def rel(out, ref):
    return np.linalg.norm(out.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30)


@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16])
@pytest.mark.parametrize("shape", [((1, 1), 1), ((7, 13), 5), ((3, 5, 33), 17), ((64, 128), 96)])
def test_fused_linear_gelu(ml, dtype, shape):
    m = ml.math
    (x_shape, out_features) = shape
    rng = np.random.default_rng(1555)
    x = rng.standard_normal(x_shape)
    w = rng.standard_normal((out_features, x_shape[-1])) / np.sqrt(x_shape[-1])
    b = rng.standard_normal(out_features)
    tx, tw, tb = (m.from_numpy(v.astype(np.float32), dtype=dtype) for v in (x, w, b))
    xr, wr, br = (m.to_numpy(t).astype(np.float64) for t in (tx, tw, tb))  # rounded inputs
    y = ml.fused_linear_gelu(tx, tw, tb)
    assert y.shape == x_shape[:-1] + (out_features,) and y.dtype is dtype
    ref = gelu_tanh(xr @ wr.T + br)
    out = m.to_numpy(y)
    assert np.isfinite(out).all() and rel(out, ref) < TOL[dtype] * max(1, np.sqrt(x_shape[-1]))
    y2 = ml.fused_linear_gelu(tx, tw)  # no bias
    assert rel(m.to_numpy(y2), gelu_tanh(xr @ wr.T)) < TOL[dtype] * max(1, np.sqrt(x_shape[-1]))


def test_fused_linear_gelu_errors(ml):
    m = ml.math
    x = m.from_numpy(np.ones((4, 8), np.float32))
    w = m.from_numpy(np.ones((3, 7), np.float32))
    with pytest.raises(cb.ShapeMismatchError, match=r"\(4, 8\).*\(3, 7\)"):
        ml.fused_linear_gelu(x, w)
    w = m.from_numpy(np.ones((3, 8), np.float32))
    with pytest.raises(cb.ShapeMismatchError, match="bias"):
        ml.fused_linear_gelu(x, w, m.from_numpy(np.ones(4, np.float32)))
    with pytest.raises(cb.DTypeMismatchError):
        ml.fused_linear_gelu(x, m.from_numpy(np.ones((3, 8), np.float64)))
    before = m.backend.memory_pools[0].get_stats()["active_memory"]
    with pytest.raises(cb.ShapeMismatchError):
        ml.fused_linear_gelu(x, m.from_numpy(np.ones((3, 9), np.float32)))
    assert m.backend.memory_pools[0].get_stats()["active_memory"] <= before + 256


@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT64])
@pytest.mark.parametrize("dims", [(1, 1, 1, 1, 1), (5, 7, 4, 3, 2), (33, 64, 48, 4, 16)])
def test_sketched_linear(ml, dtype, dims):
    m = ml.math
    batch, inf, outf, terms, rank = dims
    rng = np.random.default_rng(1758)
    U, V = ml.sketched_linear_params(inf, outf, terms, rank, dtype=dtype, seed=int(rng.integers(1 << 30)))
    assert U.shape == (terms, inf, rank) and V.shape == (terms, rank, outf)
    x = rng.standard_normal((batch, inf))
    b = rng.standard_normal(outf)
    tx, tb = m.from_numpy(x.astype(dtype.numpy_dtype)), m.from_numpy(b.astype(dtype.numpy_dtype))
    y = ml.sketched_linear(tx, U, V, tb)
    Uh, Vh = m.to_numpy(U).astype(np.float64), m.to_numpy(V).astype(np.float64)
    ref = sum(x @ Uh[i] @ Vh[i] for i in range(terms)) / terms + b
    assert y.shape == (batch, outf)
    assert rel(m.to_numpy(y), ref) < TOL[dtype] * 10


def test_sketched_linear_errors(ml):
    m = ml.math
    U, V = ml.sketched_linear_params(8, 4, 2, 3, seed=0)
    with pytest.raises(cb.ShapeMismatchError, match="in_features=8"):
        ml.sketched_linear(m.from_numpy(np.ones((2, 7), np.float32)), U, V)
    with pytest.raises(cb.ShapeMismatchError, match="num_terms"):
        ml.sketched_linear(m.from_numpy(np.ones((2, 8), np.float32)), U,
                           m.from_numpy(np.ones((3, 3, 4), np.float32)))
    with pytest.raises(cb.InvalidArgumentError, match="low_rank"):
        ml.sketched_linear_params(8, 4, 2, 0)


# -- the one-kernel linear layer (matmul.linear) ----------------------------------------------
# (dtype, precision, bound on ||out - ref|| / || |x| |W|ᵀ + |b| ||): the GEMM bounds of
# tests/test_matmul.py; GELU's slope is at most 1.13 and the output rounding is below them.
FAMS = {
    "fp32": (DT.FLOAT32, None, 2e-6),
    "ieee": (DT.FLOAT32, "ieee", 2e-6),
    "tf32": (DT.FLOAT32, "tf32", 1.5e-3),
    "fp64": (DT.FLOAT64, None, 1e-14),
    "fp16": (DT.FLOAT16, None, 1e-2),
    "bf16": (DT.BFLOAT16, None, 1e-2),
}
# (x shape, out_features): 1x1, K not a multiple of 4 or 8, tails past 128-wide tiles, leading
# batch dimensions, 1-D x, vector-aligned K and N, one large case.
LINEAR_SHAPES = [((1, 1), 1), ((7, 13), 5), ((129, 127), 131), ((3, 5, 33), 65), ((33,), 17),
                 ((1, 300), 1), ((64, 200), 72), ((2, 70, 130), 36), ((512, 1024), 768)]


def _inputs(m, rng, dtype, x_shape, n, with_bias=True):
    """Device x, W (n, K), bias (or None) and their rounded float64 values."""
    k = x_shape[-1]
    host = [rng.standard_normal(x_shape), rng.standard_normal((n, k)) / np.sqrt(max(k, 1)),
            rng.standard_normal(n)]
    work = np.float64 if dtype is DT.FLOAT64 else np.float32
    dev = [m.from_numpy(v.astype(work), dtype=dtype) for v in host]
    r64 = [m.to_numpy(t).astype(np.float64) for t in dev]
    if not with_bias:
        dev[2], r64[2] = None, np.zeros(n)
    return dev, r64


def _reference(xr, wr, br, gelu=True):
    """(epilogue(x Wᵀ + b), |x| |W|ᵀ + |b|) in float64."""
    z = xr @ wr.T + br
    return (gelu_tanh(z) if gelu else z), np.abs(xr) @ np.abs(wr).T + np.abs(br)


def _err(out, ref, scale):
    out = np.asarray(out, np.float64)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), "non-finite output (unwritten or NaN elements)"
    denom = np.linalg.norm(scale)
    return np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0)


@gpu
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("fam", list(FAMS))
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_fused_linear_gelu(ml, fam, shape, with_bias):
    """The public op (leading dimensions flattened, one launch) on odd shapes. Its output
    comes from the pool: a freed block of the same size is poisoned first, which the pool
    hands out again, so elements the kernel misses show up as NaN."""
    m = ml.math
    dtype, prec, bound = FAMS[fam]
    x_shape, n = shape
    (tx, tw, tb), (xr, wr, br) = _inputs(m, np.random.default_rng(8019), dtype, x_shape, n, with_bias)
    poisoned(m, x_shape[:-1] + (n,), dtype).free()
    y = lin.fused_linear_gelu(m, tx, tw, tb, precision=prec)
    assert y.shape == x_shape[:-1] + (n,) and y.dtype is dtype
    ref, scale = _reference(xr, wr, br)
    err = _err(m.to_numpy(y), ref, scale)
    assert err <= bound, f"{fam} {x_shape} x W({n}, {x_shape[-1]}): {err:.3g} > {bound:.3g}"


@gpu
@pytest.mark.parametrize("fam", list(FAMS))
def test_gpu_linear_every_config(ml, fam):
    """Every config the linear path may pick, vector and element loads, with and without a
    bias, into a poisoned output: a fast-but-wrong config can never win the autotuner."""
    m = ml.math
    dtype, prec, bound = FAMS[fam]
    family, _ = mm.linear_family(dtype, prec)
    rng = np.random.default_rng(754)
    dev = m.backend.current_device
    n_vec = 130 if dtype is DT.FLOAT64 else 136
    for vec, (M, K, N) in ((True, (131, 264, n_vec)), (False, (131, 197, 133))):
        (tx, tw, tb), (xr, wr, br) = _inputs(m, rng, dtype, (M, K), N)
        p = mm.Plan(1, M, N, K, 0, 0, (M, N))
        for cfg in mm.linear_configs(dtype, prec, vec):
            for bias in (tb, None):
                out = poisoned(m, (M, N), dtype)
                assert mm.is_vec_ok(tx, tw, out, p) is vec
                mm.run_config(m, mm.config_template(cfg, family), cfg, tx, tw, out, p, dtype,
                              vec, dev,
                              epilogue="bias_gelu", bias=bias)
                ref, scale = _reference(xr, wr, br if bias is not None else np.zeros(N))
                err = _err(m.to_numpy(out), ref, scale)
                assert err <= bound, (cfg, vec, bias is not None, err)
                out.free()


@gpu
@pytest.mark.parametrize("fam", list(FAMS))
def test_gpu_linear_bias_epilogue_and_empty_k(ml, fam):
    """epilogue='bias' (no GELU) into a poisoned out=, and K == 0 (GELU of the bias)."""
    m = ml.math
    dtype, prec, bound = FAMS[fam]
    rng = np.random.default_rng(107)
    (tx, tw, tb), (xr, wr, br) = _inputs(m, rng, dtype, (37, 45), 29)
    out = poisoned(m, (37, 29), dtype)
    assert mm.linear(m, tx, tw, tb, "bias", prec, out=out) is out
    ref, scale = _reference(xr, wr, br, gelu=False)
    assert _err(m.to_numpy(out), ref, scale) <= bound
    (tx, tw, tb), (xr, wr, br) = _inputs(m, rng, dtype, (5, 0), 7)
    y = mm.linear(m, tx, tw, tb, "bias_gelu", prec, out=poisoned(m, (5, 7), dtype))
    ref = np.broadcast_to(gelu_tanh(br), (5, 7))
    assert _err(m.to_numpy(y), ref, np.abs(ref) + 1e-3) <= max(bound, 4e-3)


@gpu
def test_gpu_fused_fp32_is_float32_accurate(ml):
    """The default float32 path (3xTF32 or CUDA cores) and precision='ieee' (CUDA cores) are
    float32-accurate; precision='tf32' really uses TF32."""
    m = ml.math
    (tx, tw, tb), (xr, wr, br) = _inputs(m, np.random.default_rng(6788), DT.FLOAT32, (256, 1024), 256)
    ref, _ = _reference(xr, wr, br)
    e32 = _err(m.to_numpy(lin.fused_linear_gelu(m, tx, tw, tb)), ref, ref)
    eie = _err(m.to_numpy(lin.fused_linear_gelu(m, tx, tw, tb, precision="ieee")), ref, ref)
    etf = _err(m.to_numpy(lin.fused_linear_gelu(m, tx, tw, tb, precision="tf32")), ref, ref)
    assert e32 < 1e-5 and eie < 1e-5 and 3e-5 < etf < 2e-3, (e32, eie, etf)


@gpu
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16])
def test_gpu_fused_linear_gelu_is_one_launch(ml, dtype):
    """After the first call (which autotunes), a call is exactly one kernel launch: no
    transpose, no split-K reduction, no separate bias or GELU pass; unless the autotuner
    chose a skinny split-K config (float32, M <= 64), which is that kernel and its reduce
    (with the bias and GELU): two. A cluster config (float32, M <= 64, sm_90+) is one."""
    m = ml.math
    backend = m.backend
    rng = np.random.default_rng(9009)
    for x_shape, n in (((3, 40, 96), 200), ((8, 2048), 256)):
        (tx, tw, tb), _ = _inputs(m, rng, dtype, x_shape, n)
        for bias in (tb, None):
            ml.fused_linear_gelu(tx, tw, bias).free()
            rows = int(np.prod(x_shape[:-1]))
            p = mm.Plan(1, rows, n, x_shape[-1], 0, 0, (rows, n))
            hits = [v for k, v in mm.memo(m).items()
                    if k[:2] == ("linear", p) and k[2] is dtype and k[-1] == "bias_gelu"]
            skinny = bool(hits) and bool(hits[0][1].get("skinny"))
            backend.enable_profiling = True
            try:
                backend.profiler.reset()
                y = ml.fused_linear_gelu(tx, tw, bias)
                stats = backend.profiler.kernel_stats()
            finally:
                backend.enable_profiling = False
            assert sum(s["total_executions"] for s in stats.values()) == 1 + skinny, stats
            family = ("matmul_simt", "matmul_mma", "matmul_skinny") if dtype is DT.FLOAT32 \
                else ("matmul_simt",) if dtype is DT.FLOAT64 else ("matmul_mma",)
            assert all(name.startswith(family) for name in stats), stats
            assert np.isfinite(m.to_numpy(y)).all()


# -- anywhere: fallback accuracy, argument checks, and what the GPU branch launches ----------
@pytest.fixture
def fm(backend):
    if backend.is_available:
        pytest.skip("fallback-mode tests run where this process has no GPU")
    return CudaML()


@pytest.mark.parametrize("dtype, bound", [(DT.FLOAT32, 1e-7), (DT.FLOAT64, 1e-15),
                                          (DT.FLOAT16, 1e-3), (DT.BFLOAT16, 8e-3)])
def test_fallback_is_float64_accurate(fm, dtype, bound):
    """Fallback: float64 math, then one rounding to the dtype."""
    m = fm.math
    (tx, tw, tb), (xr, wr, br) = _inputs(m, np.random.default_rng(4404), dtype, (3, 7, 300), 45)
    ref, _ = _reference(xr, wr, br)
    out = m.to_numpy(fm.fused_linear_gelu(tx, tw, tb)).astype(np.float64)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < bound


def test_fallback_tf32_rounds_inputs(fm):
    m = fm.math
    (tx, tw, tb), (xr, wr, br) = _inputs(m, np.random.default_rng(4626), DT.FLOAT32, (16, 256), 8)
    rx = mm.round_tf32(xr.astype(np.float32)).astype(np.float64)
    rw = mm.round_tf32(wr.astype(np.float32)).astype(np.float64)
    ref, _ = _reference(rx, rw, br)
    got = m.to_numpy(lin.fused_linear_gelu(m, tx, tw, tb, precision="tf32"))
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-6


def test_linear_argument_errors(ml):
    m = ml.math
    x = m.from_numpy(np.ones((4, 8), np.float32))
    w = m.from_numpy(np.ones((3, 8), np.float32))
    with pytest.raises(cb.InvalidArgumentError, match="epilogue"):
        mm.linear(m, x, w, epilogue="gelu")
    with pytest.raises(cb.InvalidArgumentError, match="float32 operands only"):
        mm.linear(m, m.from_numpy(np.ones((4, 8))), m.from_numpy(np.ones((3, 8))),
                  precision="tf32")
    with pytest.raises(cb.ShapeMismatchError, match=r"\(2, 4, 8\)"):
        mm.linear(m, m.from_numpy(np.ones((2, 4, 8), np.float32)), w)
    with pytest.raises(cb.ShapeMismatchError, match="bias"):
        mm.linear(m, x, w, m.from_numpy(np.ones(4, np.float32)))
    with pytest.raises(cb.ShapeMismatchError, match="out must be"):
        mm.linear(m, x, w, out=m.create_tensor((4, 4)))
    with pytest.raises(cb.InvalidArgumentError, match="precision must be"):
        lin.fused_linear_gelu(m, x, w, precision="fp16")


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("fam", list(FAMS))
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 13, 5), (129, 127, 131), (64, 200, 72),
                                   (8, 2048, 256), (8192, 4096, 4096)])
def test_linear_launches_one_kernel_with_its_arguments(fam, shape, with_bias):
    """The GPU branch against a recording backend: after the autotuning call, one launch of
    a b_trans + bias_gelu kernel of the family's linear configs, with x, W, out, bias (or a
    null pointer), M, N, K, and a grid covering the output."""
    m = RecordingMath()
    dtype, prec, _ = FAMS[fam]
    M, K, N = shape
    x, w = m.backend.empty((M, K), dtype), m.backend.empty((N, K), dtype)
    b = m.backend.empty((N,), dtype) if with_bias else None
    y = mm.linear(m, x, w, b, "bias_gelu", prec)
    m.backend.launches.clear()
    assert mm.linear(m, x, w, b, "bias_gelu", prec, out=y) is y
    assert len(m.backend.launches) == 1
    k, grid, smem, values = m.backend.launches[0]
    family, _ = mm.linear_family(dtype, prec)
    vw = 16 // dtype.itemsize
    vec = K % vw == 0 and N % vw == 0
    assert k.params["vec"] is vec
    assert k.params["b_trans"] is True and k.params["epilogue"] == "bias_gelu"
    cfg = next(c for c in mm.linear_configs(dtype, prec, vec)
               if all(k.params.get(key) == v for key, v in c.items())
               and k.template == mm.config_template(c, family))
    template = k.template
    assert values[:7] == [x.ptr, w.ptr, y.ptr, b.ptr if with_bias else 0, M, N, K]
    assert grid == (-(-M // cfg["bm"]) * -(-N // cfg["bn"]), 1, 1)
    if template == mm.MMA_TEMPLATE:
        assert smem == cfg["stages"] * (cfg["bm"] + cfg["bn"]) * cfg["bk"] * dtype.itemsize
    else:
        assert values[7:] == [0, 0, 1, K]   # no batch strides, batch 1, one K chunk


def test_fused_linear_gelu_launch_flattens_leading_dims():
    m = RecordingMath()
    x = m.backend.empty((3, 5, 33), DT.FLOAT16)
    w, b = m.backend.empty((65, 33), DT.FLOAT16), m.backend.empty((65,), DT.FLOAT16)
    y = lin.fused_linear_gelu(m, x, w, b)
    assert y.shape == (3, 5, 65) and y.dtype is DT.FLOAT16
    m.backend.launches.clear()
    lin.fused_linear_gelu(m, x, w, b)
    assert len(m.backend.launches) == 1
    assert m.backend.launches[0][3][4:7] == [15, 65, 33]


def test_linear_variants_are_the_configs_it_launches():
    """template_variants lists exactly the linear kernels the op can launch (bias_gelu), and
    keeps the matmul variant list short (the cluster kernel's: tests/test_matmul.py
    test_cluster_variants_are_the_configs)."""
    variants = mm.template_variants()
    linear = {(t, tuple(sorted(p.items()))) for t, sets in variants.items() for p in sets
              if "b_trans" in p and p.get("kind") != "skinny" and t != mm.SKINNY_TEMPLATE}
    want = set()
    for dtype, prec, _ in FAMS.values():
        family, _ = mm.linear_family(dtype, prec)
        for vec in (True, False):
            for cfg in mm.linear_configs(dtype, prec, vec):
                template = mm.config_template(cfg, family)
                want.add((template, tuple(sorted(
                    mm.linear_params(template, dtype, cfg, vec, "bias_gelu").items()))))
    assert linear == want
    assert sum(len(v) for t, v in variants.items()
               if t not in (mm.SKINNY_TEMPLATE, mm.WGMMA16_TEMPLATE, mm.TMA16_TEMPLATE)) <= 104
    # the skinny split-K kernels: float32, both B layouts (matmul's (K, N), the weight's
    # (N, K)), both alignments, and the linear layer's reduce with bias + GELU
    skinny = {tuple(sorted(p.items())) for p in variants[mm.SIMT_TEMPLATE]
              if p.get("kind") == "skinny"}
    assert skinny == {tuple(sorted(mm.skinny_params(DT.FLOAT32, c, vec, bt).items()))
                      for c in mm.SKINNY_F32 for vec in (True, False) for bt in (True, False)}
    assert mm.splitk_epilogue_params(DT.FLOAT32, "bias_gelu") in variants[mm.SIMT_TEMPLATE]


# -- property test (issue 7's fuzzing: the linear-layer family) -------------------------------
from hypothesis import given, settings, strategies as st  # noqa: E402
from fuzzing import examples  # noqa: E402


@settings(max_examples=examples(30), deadline=None)
@given(lead=st.lists(st.integers(1, 9), min_size=0, max_size=2), k=st.integers(1, 150),
       n=st.integers(1, 150), fam=st.sampled_from(list(FAMS)), with_bias=st.booleans(),
       terms=st.integers(1, 4), rank=st.integers(1, 24), seed=st.integers(0, 2**32 - 1))
def test_property_linear(ml, lead, k, n, fam, with_bias, terms, rank, seed):
    """fused_linear_gelu on random leading dims, K and N (tails of every tile), every family,
    with and without a bias; and sketched_linear on random terms and rank, against float64."""
    m = ml.math
    dtype, prec, bound = FAMS[fam]
    rng = np.random.default_rng(seed)
    x_shape = tuple(lead) + (k,)
    (tx, tw, tb), (xr, wr, br) = _inputs(m, rng, dtype, x_shape, n, with_bias)
    y = lin.fused_linear_gelu(m, tx, tw, tb, precision=prec)
    ref, scale = _reference(xr, wr, br)
    assert _err(m.to_numpy(y), ref, scale) <= bound
    if prec is None:   # the sketched layer: composed from matmul, so the same GEMM bound
        rows = int(np.prod(lead)) if lead else 1
        work = np.float64 if dtype is DT.FLOAT64 else np.float32
        x2 = rng.standard_normal((rows, k))
        U = rng.standard_normal((terms, k, rank)) / np.sqrt(k)
        V = rng.standard_normal((terms, rank, n)) / np.sqrt(rank)
        dx, dU, dV = (m.from_numpy(v.astype(work), dtype=dtype) for v in (x2, U, V))
        xr2, Ur, Vr = (m.to_numpy(t).astype(np.float64) for t in (dx, dU, dV))
        bias = tb if with_bias else None
        out = lin.sketched_linear(m, dx, dU, dV, bias)
        ref2 = sum((xr2 @ Ur[i]) @ Vr[i] for i in range(terms)) / terms + br
        scale2 = sum((np.abs(xr2) @ np.abs(Ur[i])) @ np.abs(Vr[i]) for i in range(terms)) \
            / terms + np.abs(br)
        tol = 4 * bound if dtype in (DT.FLOAT16, DT.BFLOAT16) else 2 * bound
        assert _err(m.to_numpy(out), ref2, scale2) <= tol


def test_kc_linear_configs():
    """The k-contiguous multistage configs (kc, measured slower on the H200 and kept out of
    the candidate lists): float32 linear layer only, vec only; shared memory stages * (bm + bn) * (bk + 4) * 4 within the
    opt-in limit at min_blocks; copies tiling the block; rows an odd number of 16-byte units."""
    kc = mm.LINEAR_SIMT_F32_KC
    assert len(kc) >= 2 and all(c.get("kc") for c in kc)
    assert not any(c.get("kc") for c in mm.linear_configs(DT.FLOAT32, None, False))
    gemm = mm.all_configs(DT.FLOAT32, None) + mm.SIMT_F32_EXTRA
    gen = KernelGenerator(backend=object())
    for c in kc:
        assert c not in gemm and c not in mm.SCALAR_OK and c["stages"] >= 2
        threads = (c["bm"] // c["tm"]) * (c["bn"] // c["tn"])
        smem = mm.simt_smem(c, 4, True)
        assert smem == c["stages"] * (c["bm"] + c["bn"]) * (c["bk"] + 4) * 4
        assert smem * c["min_blocks"] <= 227 * 1024
        assert ((c["bk"] + 4) // 4) % 2 == 1 and threads % (c["bk"] // 4) == 0
        assert c["bm"] % (threads // (c["bk"] // 4)) == 0
        params = mm.linear_params(mm.SIMT_TEMPLATE, DT.FLOAT32, c, True, "bias_gelu")
        _, src = gen.render_kernel(mm.SIMT_TEMPLATE, **params)
        assert "#define KS (BK + 4)" in src and "cp.async.cg.shared.global" in src
        assert "cp_async4_row" not in src


# -- 3xTF32 (x3): the float32 linear layer's tensor-core configs --------------------------------
def test_x3_linear_configs_are_float32_default_candidates():
    """The 3xTF32 configs sit in the default float32 linear lists (16-byte loads only), never
    in precision='ieee' (CUDA cores), TF32 or other dtypes (the plain GEMM's float32 default
    has its own: tests/test_matmul.py); each renders, for both alignments, with the split
    and acc_s, and names the mma template."""
    x3 = mm.LINEAR_MMA_F32X3
    assert x3 and all(c.get("x3") for c in x3)
    default_vec = mm.linear_configs(DT.FLOAT32, None, True)
    assert [c for c in default_vec if c.get("x3")] and all(c in x3 for c in default_vec
                                                            if c.get("x3"))
    assert not any(c.get("x3") for c in mm.linear_configs(DT.FLOAT32, None, False))
    for dtype, prec, _ in FAMS.values():
        if prec is not None or dtype is not DT.FLOAT32:
            for vec in (True, False):
                assert not any(c.get("x3") for c in mm.linear_configs(dtype, prec, vec))
        if prec is not None or dtype is not DT.FLOAT32:
            assert not any(c.get("x3") for c in mm.all_configs(dtype, prec))
    for c in x3:
        assert mm.config_template(c, mm.SIMT_TEMPLATE) == mm.MMA_TEMPLATE
    gen = KernelGenerator(backend=object())
    for c in x3:
        assert not c["frag_pipe"] and "tf32_trunc_a" not in c
        for vec in (True, False):
            params = mm.linear_params(mm.MMA_TEMPLATE, DT.FLOAT32, c, vec, "bias_gelu")
            _, src = gen.render_kernel(mm.MMA_TEMPLATE, **params)
            assert "split_tf32(" in src and "acc_s[i][j][q]" in src and "#error" not in src


def test_precision_ieee_is_accepted_and_named():
    assert mm.normalize_precision("IEEE", DT.FLOAT32) == "ieee"
    assert mm.op_name(mm.SIMT_TEMPLATE, DT.FLOAT32, None, True) != \
        mm.op_name(mm.SIMT_TEMPLATE, DT.FLOAT32, "ieee", True)
    with pytest.raises(cb.InvalidArgumentError, match="'ieee'"):
        mm.normalize_precision("fast", DT.FLOAT32)


@gpu
@pytest.mark.parametrize("cfg", mm.LINEAR_MMA_F32X3[:2],
                         ids=lambda c: "x3_{bm}x{bn}x{bk}_w{wm}x{wn}".format(**c))
def test_gpu_linear_x3_inf_nan(ml, cfg):
    """Infinite and NaN inputs reach the output as in a float32 product (NumPy's result),
    not as the NaN of inf - inf in the split; the finite rows stay accurate."""
    m = ml.math
    rng = np.random.default_rng(9723)
    M, K, N = 64, 128, 64
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (np.abs(rng.standard_normal((N, K))) / np.sqrt(K)).astype(np.float32)
    x[3, 5], x[7, :] = np.inf, 0.0
    x[7, 9], x[11, 2] = -np.inf, np.nan
    tx, tw = m.from_numpy(x), m.from_numpy(w)
    out = poisoned(m, (M, N), DT.FLOAT32)
    dev = m.backend.current_device
    mm.run_config(m, mm.MMA_TEMPLATE, cfg, tx, tw, out, mm.Plan(1, M, N, K, 0, 0, (M, N)),
                  DT.FLOAT32, True, dev, epilogue="bias", bias=None)
    got = m.to_numpy(out).astype(np.float64)
    with np.errstate(all="ignore"):
        ref = x.astype(np.float64) @ w.astype(np.float64).T
    special = [3, 7, 11]
    assert np.array_equal(np.isnan(got[special]), np.isnan(ref[special]))
    assert np.array_equal(got[special][np.isinf(ref[special])],
                          ref[special][np.isinf(ref[special])])
    finite = np.setdiff1d(np.arange(M), special)
    scale = np.abs(x[finite]).astype(np.float64) @ np.abs(w).astype(np.float64).T
    assert _err(got[finite], ref[finite], scale) <= 2e-6
    out.free()


@gpu
@pytest.mark.parametrize("cfg", mm.LINEAR_MMA_F32X3,
                         ids=lambda c: "x3_{bm}x{bn}x{bk}_w{wm}x{wn}_s{stages}".format(**c))
def test_gpu_linear_x3_configs(ml, cfg):
    """Every 3xTF32 config through run_config (bias + GELU, with and without a bias) into a
    poisoned output, on odd shapes (element loads) and an aligned one (vec), within the
    float32 bound: float32-level accuracy on tensor cores."""
    m = ml.math
    dtype, _, bound = FAMS["fp32"]
    rng = np.random.default_rng(8423)
    dev = m.backend.current_device
    for M, K, N in ((77, 300, 129), (256, 384, 512), (131, 264, 136), (5, 4096, 72)):
        (tx, tw, tb), (xr, wr, br) = _inputs(m, rng, dtype, (M, K), N)
        p = mm.Plan(1, M, N, K, 0, 0, (M, N))
        for bias in (tb, None):
            out = poisoned(m, (M, N), dtype)
            vec = mm.is_vec_ok(tx, tw, out, p)   # 77x300x129: element loads; else vec
            mm.run_config(m, mm.MMA_TEMPLATE, cfg, tx, tw, out, p, dtype, vec, dev,
                          epilogue="bias_gelu", bias=bias)
            ref, scale = _reference(xr, wr, br if bias is not None else np.zeros(N))
            err = _err(m.to_numpy(out), ref, scale)
            assert err <= bound, (cfg, (M, K, N), vec, bias is not None, err)
            out.free()


def _no_general_path(*args, **kwargs):
    raise AssertionError("the general path ran where the per-call plan should have")


@gpu
@pytest.mark.parametrize("fam", list(FAMS))
def test_gpu_fused_linear_gelu_plan_path(ml, fam, monkeypatch):
    """fused_linear_gelu twice per shape on fresh random inputs: the first call takes the
    general path (it makes the plan), the second the plan (run_config made to raise); both
    within the family's bound, the output from a pool block poisoned first."""
    m = ml.math
    dtype, prec, bound = FAMS[fam]
    rng = np.random.default_rng(903)
    for x_shape, n, with_bias in (((129, 127), 131, True), ((3, 5, 33), 65, False),
                                  ((33,), 17, True), ((64, 200), 72, True)):
        for second in (False, True):
            (tx, tw, tb), (xr, wr, br) = _inputs(m, rng, dtype, x_shape, n, with_bias)
            key = lin._linear_key(tx, tw, tb, prec)
            if not second:
                m.plans.pop(key, None)
            poisoned(m, x_shape[:-1] + (n,), dtype).free()
            with monkeypatch.context() as mp:
                if second:
                    mp.setattr("cuda_backend.ops.matmul_launch.run_config", _no_general_path)
                y = ml.fused_linear_gelu(tx, tw, tb, precision=prec)
            assert key in m.plans
            assert y.shape == x_shape[:-1] + (n,) and y.dtype is dtype
            ref, scale = _reference(xr, wr, br)
            err = _err(m.to_numpy(y), ref, scale)
            assert err <= bound, f"{fam} {x_shape} x W({n}) (plan: {second}): {err:.3g}"


@gpu
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT64])
@pytest.mark.parametrize("dims", [(5, 7, 4, 3, 2), (33, 64, 48, 4, 16)])
def test_gpu_sketched_linear_plan_path(ml, dtype, dims, monkeypatch):
    """sketched_linear twice on fresh random inputs: the general path (it makes the plan),
    then the plan (its products through their matmul plans: m.matrix_multiply and
    run_config made to raise); both within test_sketched_linear's bound."""
    m = ml.math
    batch, inf, outf, terms, rank = dims
    rng = np.random.default_rng(1858)
    for second in (False, True):
        U, V = ml.sketched_linear_params(inf, outf, terms, rank, dtype=dtype,
                                         seed=int(rng.integers(1 << 30)))
        x, b = rng.standard_normal((batch, inf)), rng.standard_normal(outf)
        tx = m.from_numpy(x.astype(dtype.numpy_dtype))
        tb = m.from_numpy(b.astype(dtype.numpy_dtype))
        key = lin._sketched_key(tx, U, V, tb)
        if not second:
            m.plans.pop(key, None)
        with monkeypatch.context() as mp:
            if second:
                mp.setattr(m, "matrix_multiply", _no_general_path)
                mp.setattr("cuda_backend.ops.matmul_launch.run_config", _no_general_path)
            y = ml.sketched_linear(tx, U, V, tb)
        assert key in m.plans
        Uh, Vh = m.to_numpy(U).astype(np.float64), m.to_numpy(V).astype(np.float64)
        xr = m.to_numpy(tx).astype(np.float64)
        ref = sum(xr @ Uh[i] @ Vh[i] for i in range(terms)) / terms + b
        assert y.shape == (batch, outf)
        assert rel(m.to_numpy(y), ref) < TOL[dtype] * 10


# -- skinny M: split-K over blocks (matmul.SKINNY_F32) -----------------------------------------
# The brief's odd shapes: M rows in {1, 7, 32, 63}, K in {5, 1000, 4097}, N in {3, 1025} (element
# loads: N or K not a multiple of 4), and aligned ones (16-byte copies), MLP shapes among them.
SKINNY_ODD = [(M, K, N) for M in (1, 7, 32, 63) for K in (5, 1000, 4097) for N in (3, 1025)]
SKINNY_ALIGNED = [(32, 1024, 4096), (32, 1024, 1024), (1, 1000, 1024), (63, 4096, 260),
                  (7, 256, 36)]
# linear layers with few output tiles (mm.few_tiles): several 32-row tiles per column tile
SKINNY_FEW_TILES = [(131, 300, 257), (128, 512, 512)]


def test_skinny_candidates_for_small_m_only():
    """The float32 linear layer (default and 'ieee') is offered the skinny split-K configs
    for M <= 64 with K >= 256, each at split counts > 1 that are their own effective count;
    never for larger M, short K, TF32 or the other dtypes."""
    for prec in (None, "ieee"):
        for M, K, N in ((1, 1024, 4096), (32, 1024, 4096), (32, 4096, 1024), (32, 1024, 1024),
                        (64, 8192, 8192), (8, 2048, 256), (32, 256, 3)):
            p = mm.Plan(1, M, N, K, 0, 0, (M, N))
            cands = mm.skinny_candidates(DT.FLOAT32, prec, p, 132)
            assert cands, (prec, M, K, N)
            assert {tuple(sorted((k, v) for k, v in c.items() if k != "split"))
                    for c in cands} <= {tuple(sorted(c.items())) for c in mm.SKINNY_F32}
            for c in cands:
                chunk, eff = mm.skinny_chunk(c, K, c["split"])
                assert c["split"] == eff > 1 and chunk % c["bk"] == 0
                assert chunk >= min(mm.SKINNY_MIN_CHUNK, K)
        for M, K, N in ((65, 1024, 4096), (128, 4096, 1024), (8192, 4096, 4096), (32, 255, 4096),
                        (32, 5, 1025)):
            assert mm.skinny_candidates(DT.FLOAT32, prec, mm.Plan(1, M, N, K, 0, 0, (M, N)),
                                        132) == []
    p = mm.Plan(1, 32, 4096, 1024, 0, 0, (32, 4096))
    for dtype, prec in ((DT.FLOAT32, "tf32"), (DT.FLOAT64, None), (DT.FLOAT16, None),
                        (DT.BFLOAT16, None)):
        assert mm.skinny_candidates(dtype, prec, p, 132) == []
    assert mm.skinny_candidates(DT.FLOAT32, None, p._replace(batch=2), 132) == []


def test_skinny_candidates_for_few_tiles_in_linear_layers():
    """The linear layers (linear=True), whose own kernels do not split K, get the skinny
    configs for larger M too where the output is few 128 x 128 tiles (a quarter of the SMs
    at most) and M <= SKINNY_FEW_TILES_MAX_M; the plain GEMM (which splits K itself) not."""
    for M, K, N in ((128, 512, 512), (512, 1024, 1024), (300, 256, 129), (65, 1024, 4096)):
        p = mm.Plan(1, M, N, K, 0, 0, (M, N))
        assert mm.few_tiles(p, 132)
        got = mm.skinny_candidates(DT.FLOAT32, None, p, 132, linear=True)
        assert got and all(c["skinny"] for c in got)
        assert mm.skinny_candidates(DT.FLOAT32, None, p, 132) == []
        assert mm.skinny_candidates(DT.FLOAT32, "tf32", p, 132, linear=True) == []
    for M, K, N in ((513, 1024, 1024), (256, 1024, 4096), (128, 255, 512)):
        p = mm.Plan(1, M, N, K, 0, 0, (M, N))
        assert mm.skinny_candidates(DT.FLOAT32, None, p, 132, linear=True) == []


@pytest.mark.parametrize("cfg", mm.SKINNY_F32, ids=lambda c: "{mt}x{bn}x{bk}_t{tn}".format(**c))
def test_skinny_index_math_against_numpy(cfg):
    """The kernel's block index math (matmul.skinny_blocks: row tile fastest in grid x,
    split in grid y, K slices of whole tiles): every (split, m, n) of the workspace written
    by exactly one block, the slices of a split partition K in order, and the partials
    summed in split order plus bias, through GELU, give the float64 linear layer."""
    rng = np.random.default_rng(5)
    for M, K, N in SKINNY_ODD + SKINNY_ALIGNED[2:] + [(65, 300, 257), (130, 64, 33)]:
        x = rng.standard_normal((M, K))
        w = rng.standard_normal((N, K)) / np.sqrt(K)
        b = rng.standard_normal(N)
        p = mm.Plan(1, M, N, K, 0, 0, (M, N))
        for splits in sorted({1, 3} | set(mm.skinny_split_options(cfg, p, 132))):
            chunk, s = mm.skinny_chunk(cfg, K, splits)
            blocks = mm.skinny_blocks(cfg, p, splits)
            tiles_m, tiles_n = mm.skinny_tiles(cfg, p)
            assert len(blocks) == s * tiles_m * tiles_n
            work = np.zeros((s, M, N))
            hits = np.zeros((s, M, N), np.int64)
            slices = {}
            for y, m0, m1, n0, n1, k0, k1 in blocks:
                assert 0 <= k0 < k1 <= K and k0 == y * chunk and m1 - m0 <= cfg["mt"]
                assert slices.setdefault(y, (k0, k1)) == (k0, k1)
                work[y, m0:m1, n0:n1] = x[m0:m1, k0:k1] @ w[n0:n1, k0:k1].T
                hits[y, m0:m1, n0:n1] += 1
            assert (hits == 1).all()
            # the splits' K slices partition [0, K) in order
            ends = [slices[y] for y in range(s)]
            assert ends[0][0] == 0 and ends[-1][1] == K
            assert all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
            total = work[0].copy()
            for y in range(1, s):
                total += work[y]
            np.testing.assert_allclose(mm.gelu_tanh(total + b),
                                       lin.reference("fused_linear_gelu", x, w, bias=b),
                                       rtol=1e-10, atol=1e-12)


def _skinny_recording_math(pick_skinny):
    """A RecordingMath whose autotuner records the candidates and picks the first skinny
    one (pick_skinny) or the first."""
    m = RecordingMath()
    m.seen = []

    def pick(op, key, cands, run, device_id=0, repeats=3):
        m.seen.append((op, list(cands)))
        for c in cands:
            run(c)
        sk = [c for c in cands if c.get("skinny")]
        return dict(sk[0] if pick_skinny and sk else cands[0])
    m.autotuner = types.SimpleNamespace(pick=pick)
    return m


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("fam", ["fp32", "ieee"])
@pytest.mark.parametrize("shape", [(32, 1024, 4096), (32, 1024, 1024), (7, 1000, 1025),
                                   (63, 4097, 3)])
def test_linear_skinny_launches(fam, shape, with_bias):
    """The GPU branch against a recording backend, the skinny config chosen: the split-K
    kernel (b_trans, vec by alignment) over (row tiles x column tiles, splits), x, W and the
    workspace, M, N, K, the K chunk, its dynamic shared memory; then the reduce with the
    bias (or a null pointer) and GELU over the same workspace into y, M * N elements, N,
    the split count. M over SKINNY_FEW_TILES_MAX_M gets no skinny candidate."""
    dtype, prec, _ = FAMS[fam]
    M, K, N = shape
    m = _skinny_recording_math(True)
    x, w = m.backend.empty((M, K), dtype), m.backend.empty((N, K), dtype)
    b = m.backend.empty((N,), dtype) if with_bias else None
    y = mm.linear(m, x, w, b, "bias_gelu", prec)
    (_, cands), = m.seen
    assert [c for c in cands if c.get("skinny")] == \
        mm.skinny_candidates(dtype, prec, mm.Plan(1, M, N, K, 0, 0, (M, N)), 132, linear=True)
    cfg = next(c for c in cands if c.get("skinny"))
    m.backend.launches.clear()
    assert mm.linear(m, x, w, b, "bias_gelu", prec, out=y) is y
    (k1, grid1, smem1, v1), (k2, grid2, smem2, v2) = m.backend.launches
    vec = K % 4 == 0 and N % 4 == 0
    assert k1.params == mm.skinny_params(dtype, cfg, vec, True)
    chunk, s = mm.skinny_chunk(cfg, K, cfg["split"])
    tiles_m, tiles_n = mm.skinny_tiles(cfg, mm.Plan(1, M, N, K, 0, 0, (M, N)))
    assert grid1 == (tiles_m * tiles_n, s, 1) and smem1 == mm.skinny_smem(cfg, True)
    assert v1[:2] == [x.ptr, w.ptr] and v1[3:] == [M, N, K, chunk]
    assert k2.params == mm.splitk_epilogue_params(dtype, "bias_gelu") and smem2 == 0
    assert v2 == [v1[2], y.ptr, b.ptr if with_bias else 0, M * N, N, s]
    # the same call shape with M over SKINNY_FEW_TILES_MAX_M: no skinny candidate
    m2 = _skinny_recording_math(True)
    big = mm.SKINNY_FEW_TILES_MAX_M + 1
    mm.linear(m2, m2.backend.empty((big, K), dtype), m2.backend.empty((N, K), dtype), None,
              "bias_gelu", prec)
    assert not any(c.get("skinny") for _, cands in m2.seen for c in cands)


def test_skinny_rejects_other_dtypes_and_batches():
    m = RecordingMath()
    cfg = {**mm.SKINNY_F32[0], "split": 2}
    x, w = m.backend.empty((8, 512), DT.FLOAT64), m.backend.empty((64, 512), DT.FLOAT64)
    out = m.backend.empty((8, 64), DT.FLOAT64)
    p = mm.Plan(1, 8, 64, 512, 0, 0, (8, 64))
    with pytest.raises(cb.InvalidArgumentError, match="float32 only"):
        mm.run_config(m, mm.SIMT_TEMPLATE, cfg, x, w, out, p, DT.FLOAT64, True, 0,
                      epilogue="bias_gelu")
    with pytest.raises(cb.InvalidArgumentError, match="batch"):
        mm.run_config(m, mm.SIMT_TEMPLATE, cfg, x, w, out, p._replace(batch=2), DT.FLOAT32,
                      True, 0)
    assert m.backend.launches == []


def _skinny_splits(cfg, p):
    """Split counts a GPU test runs a skinny config at: 1, 3 and the autotuner's."""
    return sorted({1, 3} | set(mm.skinny_split_options(cfg, p, 132)))


@gpu
@pytest.mark.parametrize("fam", ["fp32", "ieee"])
@pytest.mark.parametrize("cfg", mm.SKINNY_F32, ids=lambda c: "{mt}x{bn}x{bk}_t{tn}".format(**c))
def test_gpu_linear_skinny_configs(ml, cfg, fam):
    """Every skinny config through run_config (the split-K kernel and the bias + GELU reduce)
    with and without a bias, on the odd shapes (element copies) and aligned ones (16-byte
    copies), at split counts 1, 3 and the autotuner's, into a poisoned output, within the
    float32 bound of the linear layer; the same call twice gives the same bits
    (deterministic: fixed summation order, no atomics)."""
    m = ml.math
    dtype, prec, bound = FAMS[fam]
    rng = np.random.default_rng(8664)
    dev = m.backend.current_device
    for M, K, N in SKINNY_ODD + SKINNY_ALIGNED + SKINNY_FEW_TILES:
        (tx, tw, tb), (xr, wr, br) = _inputs(m, rng, dtype, (M, K), N)
        p = mm.Plan(1, M, N, K, 0, 0, (M, N))
        refs = {True: _reference(xr, wr, br), False: _reference(xr, wr, np.zeros(N))}
        for splits in _skinny_splits(cfg, p):
            for bias in (tb, None):
                out = poisoned(m, (M, N), dtype)
                vec = mm.is_vec_ok(tx, tw, out, p)
                assert vec is (K % 4 == 0 and N % 4 == 0)   # (the odd shapes: not)
                mm.run_config(m, mm.SIMT_TEMPLATE, cfg, tx, tw, out, p, dtype, vec, dev,
                              splits=splits, epilogue="bias_gelu", bias=bias)
                ref, scale = refs[bias is not None]
                got = m.to_numpy(out)
                err = _err(got, ref, scale)
                assert err <= bound, (cfg, (M, K, N), splits, vec, bias is not None, err)
                if splits == 3 and bias is not None:
                    again = poisoned(m, (M, N), dtype)
                    mm.run_config(m, mm.SIMT_TEMPLATE, {**cfg, "split": splits}, tx, tw, again,
                                  p, dtype, vec, dev, epilogue="bias_gelu", bias=bias)
                    assert np.array_equal(m.to_numpy(again), got)
                    again.free()
                out.free()


@gpu
def test_gpu_linear_skinny_bias_epilogue(ml):
    """epilogue='bias' (no GELU) through the skinny configs."""
    m = ml.math
    dtype, _, bound = FAMS["fp32"]
    rng = np.random.default_rng(9508)
    dev = m.backend.current_device
    for M, K, N in ((7, 1000, 1025), (32, 1024, 1024)):
        (tx, tw, tb), (xr, wr, br) = _inputs(m, rng, dtype, (M, K), N)
        p = mm.Plan(1, M, N, K, 0, 0, (M, N))
        for cfg in mm.SKINNY_F32:
            out = poisoned(m, (M, N), dtype)
            mm.run_config(m, mm.SIMT_TEMPLATE, cfg, tx, tw, out, p, dtype,
                          mm.is_vec_ok(tx, tw, out, p), dev, splits=5, epilogue="bias", bias=tb)
            ref, scale = _reference(xr, wr, br, gelu=False)
            assert _err(m.to_numpy(out), ref, scale) <= bound, (cfg, (M, K, N))
            out.free()


@gpu
@pytest.mark.parametrize("fam", ["fp32", "ieee"])
def test_gpu_linear_skinny_public_and_plan_path(ml, fam, monkeypatch):
    """The MLP's layers (batch 32: 1024 -> 4096 and 1024 -> 1024, with a bias) through the
    public fused_linear_gelu (autotuned: whichever config it measures fastest), then with
    each skinny config made the call's choice: the general path once (it makes the plan),
    then the plan (run_config made to raise); all within the float32 bound."""
    m = ml.math
    dtype, prec, bound = FAMS[fam]
    rng = np.random.default_rng(8345)
    dev = m.backend.current_device
    for M, K, N in ((32, 1024, 4096), (32, 1024, 1024)):
        (tx, tw, tb), (xr, wr, br) = _inputs(m, rng, dtype, (M, K), N)
        ref, scale = _reference(xr, wr, br)
        poisoned(m, (M, N), dtype).free()
        y = lin.fused_linear_gelu(m, tx, tw, tb, precision=prec)
        assert _err(m.to_numpy(y), ref, scale) <= bound
        y.free()
        p = mm.Plan(1, M, N, K, 0, 0, (M, N))
        ckey = ("linear", p, dtype, mm.normalize_precision(prec, dtype), dev, True, "bias_gelu")
        key = lin._linear_key(tx, tw, tb, prec)
        for cfg in mm.skinny_candidates(dtype, prec, p, 132)[::2]:
            mm.memo(m)[ckey] = (mm.SIMT_TEMPLATE, cfg)
            m.plans.pop(key, None)
            for second in (False, True):
                poisoned(m, (M, N), dtype).free()
                with monkeypatch.context() as mp:
                    if second:
                        mp.setattr("cuda_backend.ops.matmul_launch.run_config", _no_general_path)
                    y = lin.fused_linear_gelu(m, tx, tw, tb, precision=prec)
                assert key in m.plans
                err = _err(m.to_numpy(y), ref, scale)
                assert err <= bound, (cfg, (M, K, N), second, err)
                y.free()
        mm.memo(m).pop(ckey, None)
        m.plans.pop(key, None)


# -- skinny M, split-K inside a thread-block cluster (matmul.CLUSTER_F32) ----------------------
# 16-byte copies (K and N whole vectors): odd M (one and two row tiles), N of no tile width, K
# of no slice multiple, and the MLP's layers; the element-copy configs also run SKINNY_ODD.
CLUSTER_ALIGNED = [(1, 1000, 1028), (7, 4100, 260), (33, 260, 36), (63, 1024, 4100),
                   (64, 2052, 132), (32, 1024, 4096), (32, 4096, 1024), (32, 1024, 1024)]
HOPPER = (9, 0)


def _cluster_id(c):
    return "bn{bn}_{tr}x{tc}_kw{kw}_s{splits}".format(**c)


def _cluster_recording_math(cc=HOPPER):
    """A RecordingMath on a device of compute capability cc whose autotuner runs every
    candidate (each launch checked against its kernel's format and threads), records them
    and picks the first cluster one (else the first)."""
    m = RecordingMath(cc)
    m.seen = []

    def pick(op, key, cands, run, device_id=0, repeats=3):
        m.seen.append((op, list(cands)))
        for c in cands:
            run(c)
        cl = [c for c in cands if c.get("cluster")]
        return dict(cl[0] if cl else cands[0])
    m.autotuner = types.SimpleNamespace(pick=pick)
    return m


@pytest.mark.parametrize("epilogue", ["bias_gelu", "bias", mm.GRAD_EPILOGUE])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("fam", ["fp32", "ieee"])
@pytest.mark.parametrize("shape", [(32, 1024, 4096), (32, 1024, 1024), (7, 1000, 1025),
                                   (63, 4097, 3), (64, 4100, 132)])
def test_linear_cluster_launches(fam, shape, with_bias, epilogue):
    """The GPU branch against a recording backend on a device with clusters, a cluster
    config chosen: the linear layer's candidates end with matmul.cluster_candidates (vec by
    alignment), and a call is one launch of its kernel (b_trans, the epilogue) over
    (row tiles x column tiles, splits), its threads (the rendered THREADS) and dynamic
    shared memory, with x, W, y, the bias (or a null pointer), G for bias_gelu_grad, M, N,
    K and the K chunk. Compute capability 8.0: no cluster candidate."""
    dtype, prec, _ = FAMS[fam]
    M, K, N = shape
    m = _cluster_recording_math()
    x, w = m.backend.empty((M, K), dtype), m.backend.empty((N, K), dtype)
    b = m.backend.empty((N,), dtype) if with_bias else None
    g = m.backend.empty((M, N), dtype) if epilogue == mm.GRAD_EPILOGUE else None
    y = mm.linear(m, x, w, b, epilogue, prec, grad=g)
    (_, cands), = m.seen
    p = mm.Plan(1, M, N, K, 0, 0, (M, N))
    vec = K % 4 == 0 and N % 4 == 0
    cl = [c for c in cands if c.get("cluster")]
    assert cl == mm.cluster_candidates(dtype, prec, p, 132, HOPPER, vec) and cl
    m.backend.launches.clear()
    assert mm.linear(m, x, w, b, epilogue, prec, out=y, grad=g) is y
    (k, grid, smem, values), = m.backend.launches
    cfg = cl[0]
    assert k.template == mm.SKINNY_TEMPLATE
    assert k.params == mm.cluster_params(dtype, cfg, vec, True, epilogue)
    tiles_m, tiles_n = mm.cluster_tiles(cfg, p)
    assert grid == (tiles_m * tiles_n, cfg["splits"], 1)
    assert smem == mm.cluster_smem(cfg, True) and k.threads == mm.cluster_threads(cfg)
    assert values == [x.ptr, w.ptr, y.ptr, b.ptr if with_bias else 0] + \
        ([g.ptr] if g is not None else []) + [M, N, K, mm.cluster_chunk(cfg, K)]
    m2 = _cluster_recording_math((8, 0))
    mm.linear(m2, m2.backend.empty((M, K), dtype), m2.backend.empty((N, K), dtype), b,
              epilogue, prec, grad=g)
    assert m2.seen and not any(c.get("cluster") for _, cs in m2.seen for c in cs)


def test_matmul_nt_offers_the_cluster_bias_kernel():
    """matmul_nt (the gradients' a @ bᵀ: the linear kernels with the bias epilogue, no bias,
    true FP32) is offered the cluster configs too: one launch of the b_trans "bias" kernel
    with a null bias."""
    m = _cluster_recording_math()
    a, b = m.backend.empty((32, 1024), DT.FLOAT32), m.backend.empty((4096, 1024), DT.FLOAT32)
    out = mm.matmul_nt(m, a, b)
    (op, cands), = m.seen
    p = mm.Plan(1, 32, 4096, 1024, 0, 0, (32, 4096))
    assert [c for c in cands if c.get("cluster")] == \
        mm.cluster_candidates(DT.FLOAT32, "ieee", p, 132, HOPPER, True)
    m.backend.launches.clear()
    mm.matmul_nt(m, a, b, out=out)
    (k, _, _, values), = m.backend.launches
    assert k.params["b_trans"] is True and k.params["epilogue"] == "bias"
    assert k.template == mm.SKINNY_TEMPLATE and values[:4] == [a.ptr, b.ptr, out.ptr, 0]


def _need_clusters(m):
    if not mm.has_clusters(m.backend.get_device_info(m.backend.current_device)):
        pytest.skip("the cluster kernel needs compute capability >= 9.0 (thread-block clusters)")


def _gelu_grad_reference(g, x, w, b):
    """(dZ = G GELU'(x Wᵀ + b) in float64, its elementwise bound for a true-FP32 recompute):
    tests/test_matmul_backward.py's derivation (z's GEMM error gamma(depth(K)) |x| |W|ᵀ, the
    bias added in float32, GELU'' at most L, GELU''s own evaluation, one rounding on
    store), with u = 2^-24 and no operand rounding (CUDA-core FMA)."""
    import test_matmul_backward as tmb
    z = x @ w.T + b
    d1, terms, au = tmb.gelu_grad_parts(z)
    ref = g * d1
    u_acc, u_prod = tmb.arith(DT.FLOAT32, "ieee")
    dz_err = (tmb.gamma(tmb.depth(x.shape[1]), u_acc) + u_prod) * \
        (np.abs(x) @ np.abs(w).T + np.abs(b)) + u_acc * np.abs(z)
    bound = np.abs(g) * (tmb.L_GELU2 * dz_err + (16 * au + 24) * 2.0**-24 * terms) + \
        tmb.U_OUT[DT.FLOAT32] * np.abs(ref) + tmb.ATOL[DT.FLOAT32]
    return ref, bound


@gpu
@pytest.mark.parametrize("cfg", mm.CLUSTER_F32, ids=_cluster_id)
def test_gpu_linear_cluster_configs(ml, cfg):
    """Every cluster config through run_config (one launch) into a poisoned output, on the
    aligned odd shapes (16-byte copies) and, for the element-copy configs, the odd ones:
    bias + GELU and the bias alone, with and without a bias, within the float32 bound of
    the skinny tests; bias_gelu_grad (the backward's recompute) against
    _gelu_grad_reference's elementwise bound; the same call twice gives the same bits."""
    m = ml.math
    _need_clusters(m)
    import test_matmul_backward as tmb
    dtype, prec, bound = FAMS["fp32"]
    rng = np.random.default_rng(41)
    dev = m.backend.current_device
    shapes = CLUSTER_ALIGNED + (SKINNY_ODD if cfg in mm.CLUSTER_F32_SCALAR else [])
    for M, K, N in shapes:
        (tg, tx, tw, tb), (g, xr, wr, br) = tmb.layer_inputs(m, rng, dtype, (M, K), N)
        p = mm.Plan(1, M, N, K, 0, 0, (M, N))
        for epilogue in ("bias_gelu", "bias"):
            for bias in (tb, None):
                out = poisoned(m, (M, N), dtype)
                vec = mm.is_vec_ok(tx, tw, out, p)
                assert vec is ((M, K, N) in CLUSTER_ALIGNED)
                mm.run_config(m, mm.SKINNY_TEMPLATE, cfg, tx, tw, out, p, dtype, vec, dev,
                              epilogue=epilogue, bias=bias)
                ref, scale = _reference(xr, wr, br if bias is not None else np.zeros(N),
                                        gelu=epilogue == "bias_gelu")
                got = m.to_numpy(out)
                err = _err(got, ref, scale)
                assert err <= bound, (cfg, (M, K, N), epilogue, bias is not None, err)
                if epilogue == "bias_gelu" and bias is not None:
                    again = poisoned(m, (M, N), dtype)
                    mm.run_config(m, mm.SKINNY_TEMPLATE, cfg, tx, tw, again, p, dtype, vec,
                                  dev, epilogue=epilogue, bias=bias)
                    assert np.array_equal(m.to_numpy(again), got), (cfg, (M, K, N))
                    again.free()
                out.free()
        for bias in (tb, None):
            out = poisoned(m, (M, N), dtype)
            mm.run_config(m, mm.SKINNY_TEMPLATE, cfg, tx, tw, out, p, dtype,
                          mm.is_vec_ok(tx, tw, out, p), dev, epilogue=mm.GRAD_EPILOGUE,
                          bias=bias, grad=tg)
            ref, gbound = _gelu_grad_reference(g, xr, wr, br if bias is not None else 0.0)
            tmb.check(m.to_numpy(out).astype(np.float64), ref, gbound,
                      f"{cfg} {(M, K, N)} grad bias={bias is not None}")
            out.free()
        for t in (tg, tx, tw, tb):
            t.free()


@gpu
@pytest.mark.parametrize("fam", ["fp32", "ieee"])
def test_gpu_linear_cluster_public_and_plan_path(ml, fam, monkeypatch):
    """The MLP's layers (batch 32: 1024 -> 4096, 1024 -> 1024, 4096 -> 1024, with a bias)
    through the public fused_linear_gelu (autotuned among every candidate, the cluster ones
    included), then with each cluster candidate made the call's choice: the general path
    once (it makes the plan), then the plan (run_config made to raise); all within the
    float32 bound."""
    m = ml.math
    _need_clusters(m)
    dtype, prec, bound = FAMS[fam]
    rng = np.random.default_rng(42)
    dev = m.backend.current_device
    info = m.backend.get_device_info(dev)
    for M, K, N in ((32, 1024, 4096), (32, 1024, 1024), (32, 4096, 1024)):
        (tx, tw, tb), (xr, wr, br) = _inputs(m, rng, dtype, (M, K), N)
        ref, scale = _reference(xr, wr, br)
        poisoned(m, (M, N), dtype).free()
        y = lin.fused_linear_gelu(m, tx, tw, tb, precision=prec)
        assert _err(m.to_numpy(y), ref, scale) <= bound
        y.free()
        p = mm.Plan(1, M, N, K, 0, 0, (M, N))
        pn = mm.normalize_precision(prec, dtype)
        ckey = ("linear", p, dtype, pn, dev, True, "bias_gelu")
        key = lin._linear_key(tx, tw, tb, prec)
        cands = mm.cluster_candidates(dtype, pn, p, info.multiprocessor_count,
                                      info.compute_capability, True)
        assert cands
        for cfg in cands:
            mm.memo(m)[ckey] = (mm.SKINNY_TEMPLATE, cfg)
            m.plans.pop(key, None)
            for second in (False, True):
                poisoned(m, (M, N), dtype).free()
                with monkeypatch.context() as mp:
                    if second:
                        mp.setattr("cuda_backend.ops.matmul_launch.run_config", _no_general_path)
                    y = lin.fused_linear_gelu(m, tx, tw, tb, precision=prec)
                assert key in m.plans
                err = _err(m.to_numpy(y), ref, scale)
                assert err <= bound, (cfg, (M, K, N), second, err)
                y.free()
        mm.memo(m).pop(ckey, None)
        m.plans.pop(key, None)


@gpu
def test_gpu_gelu_backward_cluster_recompute_plan_path(ml, monkeypatch):
    """fused_linear_gelu_backward at batch 32 (1024 -> 4096) with each cluster config made
    its recompute's choice (bias_gelu_grad): the general path (it makes the plans), then
    the plans (run_config made to raise); the gradients within
    tests/test_matmul_backward.py's derived bounds."""
    m = ml.math
    _need_clusters(m)
    import test_matmul_backward as tmb
    from cuda_backend.ops import matmul_backward_layers as mbl
    dtype = DT.FLOAT32
    rng = np.random.default_rng(43)
    dev = m.backend.current_device
    info = m.backend.get_device_info(dev)
    M, K, N = 32, 1024, 4096
    (tg, tx, tw, tb), (g, x, w, b) = tmb.layer_inputs(m, rng, dtype, (M, K), N)
    refs, bounds = tmb.layer_bounds(g, x, w, b, dtype, None, True)
    p = mm.Plan(1, M, N, K, 0, 0, (M, N))
    ckey = ("linear", p, dtype, None, dev, True, mm.GRAD_EPILOGUE)
    key = mbl.layer_plan_key("fused_linear_gelu_backward", tg, tx, tw, tb, None)
    for cfg in mm.cluster_candidates(dtype, None, p, info.multiprocessor_count,
                                     info.compute_capability, True):
        mm.memo(m)[ckey] = (mm.SKINNY_TEMPLATE, cfg)
        m.plans.pop(key, None)
        m.plans.pop(("bias_gelu_grad",) + key[1:], None)
        for second in (False, True):
            with monkeypatch.context() as mp:
                if second:
                    mp.setattr("cuda_backend.ops.matmul_launch.run_config", _no_general_path)
                res = ml.fused_linear_gelu_backward(tg, tx, tw, tb)
            assert key in m.plans
            for got, ref, bd in zip(res, refs, bounds):
                tmb.check(m.to_numpy(got).astype(np.float64), ref, bd, f"{cfg} {second}")
                got.free()
    mm.memo(m).pop(ckey, None)
