"""conv2d (cuda_backend/ops/conv2d.py): geometry, dtypes, precisions, groups, errors.

GPU tests (marked `gpu`) compare against a float64 NumPy reference on fresh random inputs
with the output poisoned (NaN) first, through the public CudaML.conv2d and through every
tile config of every kernel family. The rest run anywhere: the error rules, the config
lists, the launches a recording backend sees, and the NumPy fallback (in-process where this
process has no GPU, and in a subprocess with CUDA_BACKEND_FALLBACK=1 everywhere).

float32 at the default precision may run 3xTF32 (x3) or SIMT; its elementwise bound
(`f32_bound`) is derived from the arithmetic: with u = 2^-24 and d = R*S*ceil(Cg/8)*8 the
terms behind one output counted in mma k-steps of 8, |out - ref| <= (2d + 24) u (|x| ⊛ |w|
+ |b|): the tensor core's truncating float32 accumulation (at most 2u of the partial sum per
add; the SIMT FMA chain's rounding, u per add, is inside it), 20u per 3xTF32 product (the
dropped small x small, 2^-22, and the two small parts the mma truncates, 2^-21 each), and
the last adds (the cross-term sum, the bias). TF32 (2^-11 per operand) exceeds it.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from fuzzing import examples
from helpers import RecordingMath, call_through_plan, check_finite, poisoned, tuned_math
from hypothesis import strategies as st

from cuda_backend import (CudaDataType as DT, DTypeMismatchError, InvalidArgumentError,
                          ShapeMismatchError)
from cuda_backend.cuda_ml import ConvolutionConfig, CudaML
from cuda_backend.compiler import arg_format, kernel_signature
from cuda_backend.kernels import KernelGenerator
from cuda_backend.launch import normalize_dims
from cuda_backend.ops import conv2d as cv
from cuda_backend.ops import conv2d_configs as cc
from cuda_backend.ops import conv2d_geometry as geo
from cuda_backend.ops import conv2d_launch as cl

gpu = pytest.mark.gpu
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (dtype, precision) families.
FAMILIES = {
    "fp32": (DT.FLOAT32, None),
    "ieee": (DT.FLOAT32, "ieee"),
    "tf32": (DT.FLOAT32, "tf32"),
    "fp16": (DT.FLOAT16, None),
    "bf16": (DT.BFLOAT16, None),
}


def bound(fam: str, crs: int) -> float:
    """Norm-wise relative error bound: FP32 grows like sqrt(reduction length)."""
    if fam in ("fp32", "ieee"):
        return 1e-5 * math.sqrt(max(crs, 1))
    return 1e-3 if fam == "tf32" else 1e-2


# (input shape, kernel shape, stride, padding, dilation, groups)
CASES = [
    ((2, 3, 17, 19), (5, 3, 3, 3), (2, 2), (1, 1), (2, 2), 1),       # odd, few out channels
    ((2, 3, 17, 19), (16, 3, 3, 3), (2, 2), (1, 1), (2, 2), 1),      # odd, GEMM path, C=3
    ((2, 16, 7, 9), (24, 16, 1, 1), (1, 1), (0, 0), (1, 1), 1),      # 1x1
    ((1, 8, 13, 11), (16, 8, 5, 5), (1, 1), (2, 2), (1, 1), 1),      # 5x5
    ((2, 12, 9, 11), (40, 6, 3, 3), (2, 1), (1, 2), (1, 2), 2),      # groups=2, mixed geometry
    ((2, 16, 15, 15), (16, 1, 3, 3), (1, 1), (1, 1), (1, 1), 16),    # depthwise
    ((1, 8, 10, 10), (16, 1, 3, 3), (2, 2), (1, 0), (1, 1), 8),      # depthwise, multiplier 2
    ((1, 9, 20, 21), (130, 9, 3, 1), (1, 1), (1, 0), (1, 1), 1),     # R != S, K past 128
    ((3, 20, 6, 7), (36, 20, 2, 2), (3, 2), (0, 1), (2, 1), 1),      # even kernel, stride 3
    ((1, 1, 12, 12), (8, 1, 3, 3), (1, 1), (1, 1), (1, 1), 1),       # one input channel
    ((2, 24, 5, 5), (48, 8, 3, 3), (1, 1), (2, 2), (2, 2), 3),       # groups=3, big padding
]
CASE_IDS = [f"{x}x{w}s{s}p{p}d{d}g{g}" for x, w, s, p, d, g in CASES]


# -- helpers ---------------------------------------------------------------------------------
def ref_conv(x, w, b, stride, padding, dilation, groups):
    """Straightforward float64 F.conv2d: pad, then per group and tap a tensordot."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    P = (H + 2 * ph - dh * (R - 1) - 1) // sh + 1
    Q = (W + 2 * pw - dw * (S - 1) - 1) // sw + 1
    xp = np.zeros((N, C, H + 2 * ph, W + 2 * pw))
    xp[:, :, ph:ph + H, pw:pw + W] = x
    out = np.zeros((N, K, P, Q))
    Kg = K // groups
    for g in range(groups):
        xs = xp[:, g * Cg:(g + 1) * Cg]
        for r in range(R):
            for s in range(S):
                patch = xs[:, :, r * dh:r * dh + sh * (P - 1) + 1:sh,
                           s * dw:s * dw + sw * (Q - 1) + 1:sw]
                out[:, g * Kg:(g + 1) * Kg] += np.tensordot(
                    w[g * Kg:(g + 1) * Kg, :, r, s], patch, axes=([1], [1])).transpose(1, 0, 2, 3)
    if b is not None:
        out += np.asarray(b, np.float64).reshape(1, K, 1, 1)
    return out


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), "non-finite output (unwritten or NaN elements)"
    denom = np.linalg.norm(ref)
    return np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0)


U = 2.0**-24


def f32_bound(xh, wh, bh, case):
    """Per-element bound of float32 at the default precision, SIMT or 3xTF32 (the module
    docstring): (2d + 24) u (|x| ⊛ |w| + |b|), d = R*S*ceil(Cg/8)*8."""
    _, ws, s, p, d, g = case
    depth = ws[2] * ws[3] * -(-ws[1] // 8) * 8
    mag = ref_conv(np.abs(xh), np.abs(wh), None if bh is None else np.abs(bh), s, p, d, g)
    return (2 * depth + 24) * U * mag + 1e-30


def make(m, rng, shape, dtype):
    """A device tensor of fresh normal values and its (rounded) host copy."""
    t = m.from_numpy(rng.standard_normal(shape).astype(np.float32), dtype=dtype)
    return t, m.to_numpy(t)


def config_of(case):
    _, w, s, p, d, g = case
    return ConvolutionConfig(kernel_size=w[2:], stride=s, padding=p, dilation=d, groups=g)


def run_case(m, fam, case, rng, with_bias=True, poison=True):
    """conv2d on the device (through out= into a poisoned tensor) vs the float64 reference."""
    dtype, prec = FAMILIES[fam]
    xs, ws, s, p, d, g = case
    x, xh = make(m, rng, xs, dtype)
    w, wh = make(m, rng, ws, dtype)
    b, bh = make(m, rng, (ws[0],), dtype) if with_bias else (None, None)
    geom = geo.plan(xs, ws, config_of(case))
    out = poisoned(m, geom.out_shape, dtype) if poison else None
    res = cv.conv2d(m, x, w, config_of(case), b, prec, out=out)
    assert res.shape == geom.out_shape and res.dtype is dtype
    if out is not None:
        assert res is out
    ref = ref_conv(xh, wh, bh, s, p, d, g)
    err = rel_err(m.to_numpy(res), ref)
    assert err <= bound(fam, ws[1] * ws[2] * ws[3]), f"{fam} {case}: relative error {err:.3g}"
    return err


@pytest.fixture(scope="module")
def m(backend, tmp_path_factory):
    """A CudaMath whose autotuner writes to a temporary file; kernels compiled up front."""
    cm = tuned_math(backend, tmp_path_factory)
    if cm.gpu:
        cv.warm_up(cm, workers=16)
    return cm


@pytest.fixture(scope="module")
def ml(m):
    return CudaML(m)


# -- GPU ----------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("fam", list(FAMILIES))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_conv2d_cases(m, fam, case):
    run_case(m, fam, case, np.random.default_rng(514))


@gpu
@pytest.mark.parametrize("fam", list(FAMILIES))
@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[5], CASES[7]],
                         ids=[CASE_IDS[1], CASE_IDS[4], CASE_IDS[5], CASE_IDS[7]])
def test_second_call_takes_the_plan(ml, fam, case):
    """CudaML.conv2d twice on fresh inputs of odd shapes, with and without bias: the second
    call goes through the plan the first made (after the autotuner's pick: the repacks into
    their workspaces, the GEMM or the direct kernel), and both match the reference."""
    m = ml.math
    dtype, prec = FAMILIES[fam]
    rng = np.random.default_rng(26)
    xs, ws, s, p, d, g = case
    cfg = config_of(case)
    for with_bias in (True, False):
        key = ("conv2d", xs, dtype, 0, ws, dtype, 0, ConvolutionConfig, cfg.kernel_size,
               cfg.stride, cfg.padding, cfg.dilation, cfg.groups, not with_bias, prec)
        m.plans.pop(key, None)
        for second in (False, True):
            x, xh = make(m, rng, xs, dtype)
            w, wh = make(m, rng, ws, dtype)
            b, bh = make(m, rng, (ws[0],), dtype) if with_bias else (None, None)
            call = lambda: ml.conv2d(x, w, cfg, b, prec)  # noqa: E731
            y = call_through_plan(m, key, call) if second else call()
            assert key in m.plans
            err = rel_err(m.to_numpy(y), ref_conv(xh, wh, bh, s, p, d, g))
            assert err <= bound(fam, ws[1] * ws[2] * ws[3]), (fam, case, with_bias, second, err)


@gpu
@pytest.mark.parametrize("fam", ["fp32", "bf16"])
def test_conv2d_without_bias_through_cudaml(ml, fam):
    dtype, prec = FAMILIES[fam]
    rng = np.random.default_rng(5806)
    case = CASES[4]
    x, xh = make(ml.math, rng, case[0], dtype)
    w, wh = make(ml.math, rng, case[1], dtype)
    y = ml.conv2d(x, w, config_of(case), precision=prec)
    err = rel_err(ml.math.to_numpy(y), ref_conv(xh, wh, None, *case[2:]))
    assert err <= bound(fam, 6 * 9)


def _family_configs():
    out = []
    for cfg in cc.SIMT_CONFIGS + cc.KCRS_CONFIGS:
        out.append(("fp32", cfg))
    for cfg in cc.TF32_CONFIGS:
        out.append(("tf32", cfg))
    for fam in ("fp16", "bf16"):
        for cfg in cc.F16_CONFIGS:
            out.append((fam, cfg))
    return out


CONFIG_SHAPES = [  # M, Kg, Cg not multiples of any tile; stride, padding, dilation, groups
    ((2, 20, 13, 15), (72, 10, 3, 3), (1, 2), (1, 2), (2, 1), 2),
    ((1, 40, 17, 9), (136, 40, 1, 3), (1, 1), (0, 1), (1, 1), 1),
]


@gpu
@pytest.mark.parametrize("fam, cfg", _family_configs(),
                         ids=[f"{f}-{'x'.join(str(v) for v in c.values())}"
                              for f, c in _family_configs()])
@pytest.mark.parametrize("case", CONFIG_SHAPES, ids=["grouped", "wide"])
def test_every_tile_config(m, fam, cfg, case):
    """Each config the autotuner may pick, launched directly on a poisoned output."""
    dtype, prec = FAMILIES[fam]
    rng = np.random.default_rng(2008)
    xs, ws, s, p, d, g = case
    x, xh = make(m, rng, xs, dtype)
    w, wh = make(m, rng, ws, dtype)
    b, bh = make(m, rng, (ws[0],), dtype)
    geom = geo.plan(xs, ws, config_of(case))
    out = poisoned(m, geom.out_shape, dtype)
    dev = x.device_id
    if fam == "fp32" and cfg.get("kcrs"):     # the filter as given
        cl.run_simt(m, cfg, x, w, b, geom, out, dev)
    elif fam == "fp32":
        wt = cl.prepare_weight_simt(m, w, geom, dev)
        cl.run_simt(m, cfg, x, wt, b, geom, out, dev)
        wt.free()
    else:
        xt = cl.prepare_input_mma(m, x, geom, dev)
        wt = cl.prepare_weight_mma(m, w, geom, dev)
        cl.run_mma(m, cfg, xt, wt, b, geom, out, dev)
        xt.free()
        wt.free()
    err = rel_err(m.to_numpy(out), ref_conv(xh, wh, bh, s, p, d, g))
    assert err <= bound(fam, ws[1] * ws[2] * ws[3]), f"{fam} {cfg}: relative error {err:.3g}"


# 3xTF32: odd shapes (M, Kg, Cg of no tile multiple) of every geometry class: the brief's
# 3x3 pad 1 with C=5 (channels padded to 8, under one k-tile) and K=7, stride 2, dilation 2,
# groups 2, 1x1, 1x3 with Kg past 128.
X3_SHAPES = [
    ((3, 5, 17, 17), (7, 5, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((2, 16, 15, 13), (20, 16, 3, 3), (2, 2), (1, 1), (1, 1), 1),
    ((2, 13, 12, 11), (24, 13, 3, 3), (1, 1), (2, 2), (2, 2), 1),
    ((2, 34, 9, 11), (40, 17, 3, 3), (1, 1), (1, 1), (1, 1), 2),
    ((2, 24, 7, 9), (36, 24, 1, 1), (1, 1), (0, 0), (1, 1), 1),
    ((1, 40, 17, 9), (136, 40, 1, 3), (1, 1), (0, 1), (1, 1), 1),
]
X3_IDS = ["c5k7", "stride2", "dilation2", "groups2", "1x1", "wide"]


def _x3_id(c):
    return "x3_{bm}x{bn}x{bk}_w{wm}x{wn}_s{stages}".format(**c)


@gpu
@pytest.mark.parametrize("cfg", cc.X3_CONFIGS, ids=_x3_id)
def test_x3_every_config_odd_shapes(m, cfg):
    """Each 3xTF32 config through run_config (the repacks, the kernel, the workspaces back
    to the pool) into a poisoned output, with and without a bias, on every X3_SHAPES case:
    every element within f32_bound."""
    rng = np.random.default_rng(31)
    dev = m.backend.current_device
    pool = m.backend.memory_pools[dev]
    for case in X3_SHAPES:
        xs, ws, s, p, d, g = case
        geom = geo.plan(xs, ws, config_of(case))
        x, xh = make(m, rng, xs, DT.FLOAT32)
        w, wh = make(m, rng, ws, DT.FLOAT32)
        b, bh = make(m, rng, (ws[0],), DT.FLOAT32)
        for bias, bias_h in ((b, bh), (None, None)):
            out = poisoned(m, geom.out_shape, DT.FLOAT32)
            before = pool.get_stats()["active_memory"]
            cl.run_config(m, cfg, x, w, bias, geom, out, dev)
            assert pool.get_stats()["active_memory"] == before
            check_finite(m.to_numpy(out), ref_conv(xh, wh, bias_h, s, p, d, g),
                         f32_bound(xh, wh, bias_h, case), (cfg, case, bias is not None))
            out.free()
        for t in (x, w, b):
            t.free()


@gpu
def test_x3_bound_separates_tf32(m):
    """f32_bound is tight enough to tell: the TF32 config of the same tile breaks it on
    this data, its 3xTF32 twin keeps it."""
    case = X3_SHAPES[3]
    rng = np.random.default_rng(32)
    xs, ws, s, p, d, g = case
    geom = geo.plan(xs, ws, config_of(case))
    x, xh = make(m, rng, xs, DT.FLOAT32)
    w, wh = make(m, rng, ws, DT.FLOAT32)
    ref, bd = ref_conv(xh, wh, None, s, p, d, g), f32_bound(xh, wh, None, case)
    dev = m.backend.current_device
    errs = {}
    for cfg in (cc.T_64x64x16, cc.X_64x64x16):
        out = poisoned(m, geom.out_shape, DT.FLOAT32)
        cl.run_config(m, cfg, x, w, None, geom, out, dev)
        errs[cfg["x3"]] = np.abs(m.to_numpy(out).astype(np.float64) - ref) / bd
        out.free()
    assert errs[True].max() <= 1 < errs[False].max(), (errs[True].max(), errs[False].max())


@gpu
@pytest.mark.parametrize("cfg", cc.X3_CONFIGS, ids=_x3_id)
def test_x3_forced_through_candidates_and_plan(ml, cfg, monkeypatch):
    """CudaML.conv2d at the default precision with the candidate list forced to one 3xTF32
    config, on the X3_SHAPES cases where x3 fits: the first call takes the general path
    (run_config), the second the per-call plan (its mma branch: the repacks into pool
    blocks, the x3 kernel); both within f32_bound."""
    m = ml.math
    monkeypatch.setattr(cc, "candidates", lambda *args: [cfg])
    picks = m.__dict__.setdefault("_conv2d_configs", {})
    rng = np.random.default_rng(33)
    try:
        for case in X3_SHAPES:
            xs, ws, s, p, d, g = case
            conf = config_of(case)
            if not cc.x3_fits(geo.plan(xs, ws, conf), DT.FLOAT32, None):
                continue
            picks.clear()
            for with_bias in (True, False):
                key = ("conv2d", xs, DT.FLOAT32, 0, ws, DT.FLOAT32, 0, ConvolutionConfig,
                       conf.kernel_size, conf.stride, conf.padding, conf.dilation, conf.groups,
                       not with_bias, None)
                m.plans.pop(key, None)
                for second in (False, True):
                    x, xh = make(m, rng, xs, DT.FLOAT32)
                    w, wh = make(m, rng, ws, DT.FLOAT32)
                    b, bh = make(m, rng, (ws[0],), DT.FLOAT32) if with_bias else (None, None)
                    call = lambda: ml.conv2d(x, w, conf, b)  # noqa: E731
                    y = call_through_plan(m, key, call) if second else call()
                    assert list(picks.values()) == [cfg]
                    check_finite(m.to_numpy(y), ref_conv(xh, wh, bh, s, p, d, g),
                                 f32_bound(xh, wh, bh, case), (cfg, case, with_bias, second))
                m.plans.pop(key, None)
    finally:
        picks.clear()   # the forced picks are not the autotuner's


@gpu
def test_x3_infinities_and_nans(m):
    """Infinite and NaN inputs reach the outputs as in float64 (NumPy's result): the split's
    inf - inf does not turn an infinite output into NaN, and a NaN whose payload carries the
    split's rounding add into the sign bit (0x7FFFFFFF, the GPU's own NaN) stays NaN; one
    special value per image, so no output mixes them; the other outputs within f32_bound."""
    case = X3_SHAPES[3]
    xs, ws, s, p, d, g = case
    rng = np.random.default_rng(34)
    xh = rng.standard_normal((4,) + xs[1:]).astype(np.float32)
    wh = rng.standard_normal(ws).astype(np.float32)
    nan_gpu = np.array([0x7FFFFFFF], np.uint32).view(np.float32)[0]
    xh[0, 3, 4, 5] = np.inf
    xh[1, 20, 2, 2] = -np.inf
    xh[2, 7, 8, 10] = nan_gpu
    xh[3, 30, 0, 0] = np.nan
    geom = geo.plan(xh.shape, ws, config_of(case))
    x, w = m.from_numpy(xh), m.from_numpy(wh)
    case4 = (xh.shape,) + case[1:]
    with np.errstate(all="ignore"):
        ref = ref_conv(xh, wh, None, s, p, d, g)
    dev = m.backend.current_device
    for cfg in (cc.X_128x64x32, cc.X_64x32x16):
        out = poisoned(m, geom.out_shape, DT.FLOAT32)
        cl.run_config(m, cfg, x, w, None, geom, out, dev)
        got = m.to_numpy(out).astype(np.float64)
        out.free()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=str(cfg))
        inf = np.isinf(ref)
        assert inf.any() and np.isnan(ref).any()
        np.testing.assert_array_equal(got[inf], ref[inf], err_msg=str(cfg))
        fin = np.isfinite(ref)
        clean = np.where(np.isfinite(xh), xh, 0).astype(np.float64)
        bd = f32_bound(clean, wh.astype(np.float64), None, case4)
        assert (np.abs(got[fin] - ref[fin]) <= bd[fin]).all(), cfg
    x.free()
    w.free()


@gpu
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_direct_kernel_every_dtype(m, fam):
    """Depthwise goes to the direct kernel in every dtype (tf32 stays exact there)."""
    case = ((2, 32, 33, 31), (32, 1, 3, 3), (2, 1), (1, 1), (1, 2), 32)
    geom = geo.plan(case[0], case[1], config_of(case))
    assert cc.family(geom, FAMILIES[fam][0], FAMILIES[fam][1]) == "direct"
    run_case(m, fam, case, np.random.default_rng(4905))


@gpu
@pytest.mark.large
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_medium_resnet_layer(m, fam):
    """(8, 64, 64, 64) * (128, 64, 3, 3), padding 1: the large-tile configs, autotuned."""
    case = ((8, 64, 64, 64), (128, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1)
    run_case(m, fam, case, np.random.default_rng(8492))


@gpu
@pytest.mark.parametrize("fam", ["fp32", "tf32"])
def test_small_benchmark_shape(m, fam):
    case = ((1, 32, 64, 64), (32, 32, 3, 3), (1, 1), (1, 1), (1, 1), 1)
    run_case(m, fam, case, np.random.default_rng(7090))


@gpu
def test_tf32_is_not_exact_and_fp32_is(m):
    """precision='tf32' really rounds the operands; 'ieee' keeps FP32 accuracy on CUDA
    cores, the default float32-level accuracy (SIMT or 3xTF32: within f32_bound; norm-wise
    far below TF32's ~3e-4)."""
    rng = np.random.default_rng(1593)
    case = ((2, 64, 16, 16), (64, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1)
    eieee = run_case(m, "ieee", case, rng)
    etf = run_case(m, "tf32", case, rng)
    assert eieee < 2e-6 < etf
    x, xh = make(m, rng, case[0], DT.FLOAT32)
    w, wh = make(m, rng, case[1], DT.FLOAT32)
    y = cv.conv2d(m, x, w, config_of(case))
    check_finite(m.to_numpy(y), ref_conv(xh, wh, None, *case[2:]),
                 f32_bound(xh, wh, None, case), "default")
    assert rel_err(m.to_numpy(y), ref_conv(xh, wh, None, *case[2:])) < etf / 20


@gpu
def test_zero_sizes(m, ml):
    rng = np.random.default_rng(6059)
    x = m.from_numpy(np.zeros((0, 4, 5, 5), np.float32))
    w, _ = make(m, rng, (8, 4, 3, 3), DT.FLOAT32)
    y = ml.conv2d(x, w, ConvolutionConfig(3))
    assert y.shape == (0, 8, 3, 3)
    # no input channels: the output is the bias
    x = m.from_numpy(np.zeros((2, 0, 5, 5), np.float32))
    w = m.from_numpy(np.zeros((8, 0, 3, 3), np.float32))
    b, bh = make(m, rng, (8,), DT.FLOAT32)
    y = ml.conv2d(x, w, ConvolutionConfig(3, padding=1), b)
    np.testing.assert_array_equal(m.to_numpy(y), np.broadcast_to(bh.reshape(1, 8, 1, 1),
                                                                  (2, 8, 5, 5)))


@gpu
@pytest.mark.parametrize("fam", ["fp32", "bf16"])
def test_workspaces_go_back_to_the_pool(m, fam):
    """The repacked operands are freed: once the output is freed too, the pool's active
    memory is back where it started."""
    dtype, prec = FAMILIES[fam]
    rng = np.random.default_rng(9241)
    case = ((2, 16, 20, 20), (32, 16, 3, 3), (1, 1), (1, 1), (1, 1), 1)
    x, _ = make(m, rng, case[0], dtype)
    w, _ = make(m, rng, case[1], dtype)
    pool = m.backend.memory_pools[x.device_id]
    before = pool.get_stats()["active_memory"]
    y = cv.conv2d(m, x, w, config_of(case), None, prec)
    assert pool.get_stats()["active_memory"] > before
    y.free()
    assert pool.get_stats()["active_memory"] == before


@gpu
@settings(max_examples=examples(25), deadline=None)
@given(n=st.integers(1, 2), groups=st.integers(1, 3), cg=st.integers(1, 9),
       kg=st.integers(1, 20), h=st.integers(1, 14), w=st.integers(1, 14),
       r=st.integers(1, 4), s=st.integers(1, 4), sh=st.integers(1, 3), sw=st.integers(1, 3),
       dh=st.integers(1, 2), dw=st.integers(1, 2), fam=st.sampled_from(list(FAMILIES)),
       data=st.data())
def test_conv2d_property(m, n, groups, cg, kg, h, w, r, s, sh, sw, dh, dw, fam, data):
    ph = data.draw(st.integers(0, dh * (r - 1) + 1))
    pw = data.draw(st.integers(0, dw * (s - 1) + 1))
    assume(h + 2 * ph - dh * (r - 1) - 1 >= 0 and w + 2 * pw - dw * (s - 1) - 1 >= 0)
    case = ((n, cg * groups, h, w), (kg * groups, cg, r, s), (sh, sw), (ph, pw), (dh, dw),
            groups)
    run_case(m, fam, case, np.random.default_rng(2618), with_bias=data.draw(st.booleans()))


# -- anywhere: rules, errors, configs, fallback -----------------------------------------------
def test_reference_matches_brute_force():
    """The test reference itself, against explicit loops over every output element."""
    rng = np.random.default_rng(2671)
    x = rng.standard_normal((2, 4, 6, 7))
    w = rng.standard_normal((6, 2, 3, 2))
    b = rng.standard_normal(6)
    stride, pad, dil, groups = (2, 1), (1, 2), (1, 2), 2
    ref = ref_conv(x, w, b, stride, pad, dil, groups)
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    brute = np.zeros_like(ref)
    for n, k, p, q in np.ndindex(*ref.shape):
        g = k // (K // groups)
        acc = b[k]
        for c in range(Cg):
            for i in range(R):
                for j in range(S):
                    ih = p * stride[0] - pad[0] + i * dil[0]
                    iw = q * stride[1] - pad[1] + j * dil[1]
                    if 0 <= ih < H and 0 <= iw < W:
                        acc += x[n, g * Cg + c, ih, iw] * w[k, c, i, j]
        brute[n, k, p, q] = acc
    np.testing.assert_allclose(ref, brute, rtol=1e-12, atol=1e-12)
    g = geo.plan(x.shape, w.shape, ConvolutionConfig((3, 2), stride, pad, dil, groups))
    np.testing.assert_allclose(cv.reference(x, w, b, g), brute, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES[:6], ids=CASE_IDS[:6])
def test_conv2d_small_cases_in_this_process(ml, case):
    """Fallback mode here (NumPy); on a GPU machine the same call runs the kernels."""
    rng = np.random.default_rng(6464)
    x, xh = make(ml.math, rng, case[0], DT.FLOAT32)
    w, wh = make(ml.math, rng, case[1], DT.FLOAT32)
    b, bh = make(ml.math, rng, (case[1][0],), DT.FLOAT32)
    y = ml.conv2d(x, w, config_of(case), b)
    assert y.shape == geo.plan(case[0], case[1], config_of(case)).out_shape
    assert rel_err(ml.math.to_numpy(y), ref_conv(xh, wh, bh, *case[2:])) <= 1e-5 * math.sqrt(
        case[1][1] * case[1][2] * case[1][3])
    y16 = ml.conv2d(ml.math.from_numpy(xh, dtype=DT.BFLOAT16),
                    ml.math.from_numpy(wh, dtype=DT.BFLOAT16), config_of(case))
    assert y16.dtype is DT.BFLOAT16
    assert rel_err(ml.math.to_numpy(y16), ref_conv(xh, wh, None, *case[2:])) <= 2e-2


def test_output_size_follows_pytorch():
    g = geo.plan((1, 3, 17, 19), (5, 3, 3, 3), ConvolutionConfig(3, 2, 1, 2))
    assert g.out_shape == (1, 5, (17 + 2 - 4 - 1) // 2 + 1, (19 + 2 - 4 - 1) // 2 + 1)
    assert (g.M, g.Cg, g.Kg) == (g.P * g.Q, 3, 5)
    g = geo.plan((2, 6, 8, 8), (4, 3, 2, 2), ConvolutionConfig(2, 1, 0, 1, 2))
    assert g.out_shape == (2, 4, 7, 7)


def test_errors_name_shapes_and_leak_nothing(ml):
    m = ml.math

    def t(shape, dtype=np.float32):
        return m.from_numpy(np.ones(shape, dtype))

    x, w = t((2, 4, 8, 8)), t((6, 4, 3, 3))
    x2d, w3d, w_half_c, w1x1 = t((8, 8)), t((6, 4, 3)), t((6, 2, 3, 3)), t((6, 4, 1, 1))
    x_small, w_f16 = t((1, 4, 2, 2)), t((6, 4, 3, 3), np.float16)
    x64, w64 = t((2, 4, 8, 8), np.float64), t((6, 4, 3, 3), np.float64)
    x16 = m.from_numpy(np.ones((2, 4, 8, 8)), dtype=DT.FLOAT16)
    b5 = t((5,))
    pool = m.backend.memory_pools[x.device_id]
    before = pool.get_stats()["active_memory"]
    bad_calls = [
        (InvalidArgumentError, r"input must be 4-D.*\(8, 8\)",
         lambda: ml.conv2d(x2d, w, ConvolutionConfig(3))),
        (InvalidArgumentError, r"kernel must be 4-D.*\(6, 4, 3\)",
         lambda: ml.conv2d(x, w3d, ConvolutionConfig(3))),
        (ShapeMismatchError, r"\(2, 4, 8, 8\).*\(6, 2, 3, 3\)",
         lambda: ml.conv2d(x, w_half_c, ConvolutionConfig(3))),
        (InvalidArgumentError, r"groups=3 must divide",
         lambda: ml.conv2d(x, w, ConvolutionConfig(3, groups=3))),
        (InvalidArgumentError, r"padding \(3, 3\) is larger than the kernel \(1, 1\)",
         lambda: ml.conv2d(x, w1x1, ConvolutionConfig(1, padding=3))),
        (InvalidArgumentError, r"output size .* not positive",
         lambda: ml.conv2d(x_small, w, ConvolutionConfig(3))),
        (DTypeMismatchError, r"float32 and float16",
         lambda: ml.conv2d(x, w_f16, ConvolutionConfig(3))),
        (DTypeMismatchError, r"conv2d does not support float64",
         lambda: ml.conv2d(x64, w64, ConvolutionConfig(3))),
        (InvalidArgumentError,
         r"precision must be None, 'fp32' \(alias 'highest'\), 'ieee' or 'tf32', got 'fp8'",
         lambda: ml.conv2d(x, w, ConvolutionConfig(3), precision="fp8")),
        (InvalidArgumentError, r"precision must be .*'ieee'.*got 3",
         lambda: ml.conv2d(x, w, ConvolutionConfig(3), precision=3)),
        (InvalidArgumentError, r"tf32.*float32 operands only",
         lambda: ml.conv2d(x16, w_f16, ConvolutionConfig(3), precision="tf32")),
        (ShapeMismatchError, r"spatial size \(3, 3\).*kernel_size is \(5, 5\)",
         lambda: ml.conv2d(x, w, ConvolutionConfig(5))),
        (ShapeMismatchError, r"bias must have shape \(6,\)",
         lambda: ml.conv2d(x, w, ConvolutionConfig(3), b5)),
        (InvalidArgumentError, r"ConvolutionConfig", lambda: ml.conv2d(x, w, (3, 3))),
        (InvalidArgumentError, r"CudaTensor",
         lambda: ml.conv2d(np.ones((2, 4, 8, 8)), w, ConvolutionConfig(3))),
    ]
    for err, pattern, call in bad_calls:
        with pytest.raises(err, match=pattern):
            call()
    assert pool.get_stats()["active_memory"] == before, "an error path leaked a pool block"
    with pytest.raises(InvalidArgumentError, match="groups must be an int >= 1"):
        ConvolutionConfig(3, groups=0)
    x.free()
    with pytest.raises(Exception, match="freed"):
        ml.conv2d(x, w, ConvolutionConfig(3))


def test_config_lists_and_variants():
    variants = cv.template_variants()
    simt = variants[cc.SIMT_TEMPLATE]
    mma = variants[cc.MMA_TEMPLATE]
    assert len(simt) == len(cc.SIMT_CONFIGS) + len(cc.KCRS_CONFIGS)
    assert all(dict(c, kcrs=True) in cc.KCRS_CONFIGS for c in (cc.S_64x64x8s2, cc.S_32x32x8s4))
    assert len(mma) == len(cc.TF32_CONFIGS) + len(cc.X3_CONFIGS) + 2 * len(cc.F16_CONFIGS)
    assert [p["x3"] for p in mma].count(True) == len(cc.X3_CONFIGS)
    assert all(p["dtype"] == "float32" for p in mma if p["x3"])
    for cfg in cc.SIMT_CONFIGS + cc.KCRS_CONFIGS:
        threads = cfg["bm"] // cfg["tm"] * (cfg["bn"] // cfg["tn"]) * cfg["slices"]
        assert threads % 32 == 0 and threads <= 256
    for cfg in cc.TF32_CONFIGS + cc.X3_CONFIGS + cc.F16_CONFIGS:
        assert cl.mma_shared_bytes(cfg, DT.FLOAT32) <= 227 * 1024
    for cfg in cc.X3_CONFIGS:   # two accumulator sets: warp tiles of 2048 outputs at most
        assert cfg["x3"] and cfg["wm"] * cfg["wn"] <= 2048
    # every candidate the chooser can return is a rendered variant
    for xs, ws, s, p, d, g in CASES + CONFIG_SHAPES:
        geom = geo.plan(xs, ws, ConvolutionConfig(ws[2:], s, p, d, g))
        for fam, (dtype, prec) in FAMILIES.items():
            if cc.family(geom, dtype, prec) == "direct":
                continue
            for cfg in cc.candidates(geom, dtype, prec, 132):
                table = cc.SIMT_CONFIGS if cc.family(geom, dtype, prec) == "simt" else (
                    cc.TF32_CONFIGS if dtype is DT.FLOAT32 else cc.F16_CONFIGS)
                if cc.x3_fits(geom, dtype, prec):
                    table += cc.X3_CONFIGS
                if cc.kcrs_fits(geom, dtype, prec):
                    table += cc.KCRS_CONFIGS
                assert cfg in table


def test_kcrs_configs_offered_for_small_simt_problems():
    """The configs that read the filter as given join the SIMT candidates of small problems
    only (M <= KCRS_MAX_M, Kg <= 64, Cg * R * S <= KCRS_MAX_CRS), as variants of the small configs offered there, and
    make the autotuner time each candidate whole (timed_whole)."""
    small = geo.plan((1, 8, 16, 16), (8, 8, 3, 3), ConvolutionConfig(3, padding=1))
    cands = cc.candidates(small, DT.FLOAT32, None, 132)
    assert cc.kcrs_fits(small, DT.FLOAT32, None) and cc.timed_whole(small, DT.FLOAT32, None)
    assert cands == [cc.S_64x32x8s2, cc.S_32x32x8s4, dict(cc.S_64x32x8s2, kcrs=True),
                     dict(cc.S_32x32x8s4, kcrs=True)]
    mid = geo.plan((2, 16, 28, 28), (64, 16, 3, 3), ConvolutionConfig(3, padding=1))
    assert [c for c in cc.candidates(mid, DT.FLOAT32, "ieee", 132) if c.get("kcrs")] == \
        [dict(cc.S_64x64x8s2, kcrs=True), dict(cc.S_64x32x8s2, kcrs=True)]
    for xs, ws in (((8, 16, 64, 64), (8, 16, 3, 3)), ((1, 64, 8, 8), (128, 64, 3, 3)),
                   ((1, 64, 8, 8), (64, 64, 3, 3))):
        big = geo.plan(xs, ws, ConvolutionConfig(3, padding=1))   # M, Kg or Cg*R*S too large
        assert not cc.kcrs_fits(big, DT.FLOAT32, None)
        assert not any(c.get("kcrs") for c in cc.candidates(big, DT.FLOAT32, None, 132))
    assert not cc.kcrs_fits(small, DT.FLOAT32, "tf32") and \
        not cc.kcrs_fits(small, DT.FLOAT16, None)


def test_family_choice():
    big = geo.plan((32, 64, 128, 128), (128, 64, 3, 3), ConvolutionConfig(3, padding=1))
    assert cc.family(big, DT.FLOAT32, None) == "simt"
    assert cc.family(big, DT.FLOAT32, "tf32") == "mma"
    assert cc.family(big, DT.BFLOAT16, None) == "mma"
    assert cc.family(big, DT.FLOAT32, "ieee") == "simt"
    default = cc.candidates(big, DT.FLOAT32, None, 132)
    assert default[:3] == cc.candidates(big, DT.FLOAT32, "ieee", 132) == \
        [cc.S_128x128x8, cc.S_128x128x16, cc.S_128x64x8]
    assert default[3:] == [cc.X_128x128x32, cc.X_128x128x32s4, cc.X_128x64x32]
    assert cc.candidates(big, DT.FLOAT32, "fp32", 132) == default
    assert cc.candidates(big, DT.FLOAT32, "tf32", 132) == \
        [cc.T_128x128x32, cc.T_128x128x32s3, cc.T_128x64x32]
    dw = geo.plan((2, 32, 8, 8), (32, 1, 3, 3), ConvolutionConfig(3, groups=32))
    assert cc.family(dw, DT.FLOAT16, None) == "direct"
    small = geo.plan((1, 32, 64, 64), (32, 32, 3, 3), ConvolutionConfig(3, padding=1))
    assert all(c["bn"] == 32 for c in cc.candidates(small, DT.FLOAT32, "ieee", 132))


def _recording_math():
    """A RecordingMath on a device of compute capability 9.0 for conv2d. The mma kernels'
    threads come from their THREADS define; conv2d_prep.cu.j2 has none (blocks of 256
    threads, 32 x 8 for input_nhwc) and conv2d_simt.cu.j2's holds a C comment, so theirs
    are set here (256; (bm / tm) * (bn / tn) * slices), and every block is compared
    flattened."""
    m = RecordingMath((9, 0))
    kernel, launch = m.kernel, m.backend.launch_kernel

    def kernel_of(template, device_id, **params):
        if template == cc.MMA_TEMPLATE:
            return kernel(template, device_id, **params)
        name, src = m.generator.render_kernel(template, **params)
        threads = 256 if template == cc.PREP_TEMPLATE else \
            params["bm"] // params["tm"] * (params["bn"] // params["tn"]) * params["slices"]
        k = SimpleNamespace(name=name, template=template, params=params, threads=threads,
                            fmt=arg_format(src, name, kernel_signature(src, name)))
        m.backend.kernels[name] = k
        return k

    def launch_flat(name, grid, *args, block_size=(256, 1, 1), **kwargs):
        threads = math.prod(normalize_dims(block_size, "block"))
        return launch(name, grid, *args, block_size=(threads, 1, 1), **kwargs)
    m.kernel, m.backend.launch_kernel = kernel_of, launch_flat
    return m


def _recorded_conv(prec, case):
    """cv.conv2d on _recording_math() into a given output: (the autotuner's op and
    candidates, the launches of a call with the memoized pick, the geometry, the operands)."""
    m = _recording_math()
    xs, ws = case[0], case[1]
    x, w = m.backend.empty(xs, DT.FLOAT32), m.backend.empty(ws, DT.FLOAT32)
    geom = geo.plan(xs, ws, config_of(case))
    out = m.backend.empty(geom.out_shape, DT.FLOAT32)
    assert cv.conv2d(m, x, w, config_of(case), None, prec, out=out) is out
    picked = m.picked
    m.backend.launches.clear()
    cv.conv2d(m, x, w, config_of(case), None, prec, out=out)   # the memoized pick
    return picked, list(m.backend.launches), geom, (x, w, out)


@pytest.mark.parametrize("prec", [None, "fp32", "HIGHEST", "ieee"])
def test_x3_offered_at_the_default_precision_only(prec):
    """float32 at the default precision ('fp32', 'highest') times the 3xTF32 configs beside
    the SIMT ones, each run whole (an x3 candidate: the input and filter repacks, then the
    x3 kernel with its threads, grid and dynamic shared memory); 'ieee' times SIMT only.
    The recording backend checks every launch against its kernel's format and threads."""
    case = ((2, 80, 9, 11), (160, 40, 3, 3), (1, 1), (1, 1), (1, 1), 2)
    (op, cands), launches, geom, (x, w, out) = _recorded_conv(prec, case)
    x3 = [c for c in cands if c.get("x3")]
    if prec == "ieee":
        assert op == "conv2d_simt" and not x3 and all("tm" in c for c in cands)
        assert {k.template for k, *_ in launches} == {cc.PREP_TEMPLATE, cc.SIMT_TEMPLATE}
        return
    assert op == "conv2d_x3simt" and x3 == [cc.X_128x64x32, cc.X_64x64x16, cc.X_128x128x32]
    assert cands[:len(cands) - len(x3)] == cc.candidates(geom, DT.FLOAT32, "ieee", 132)
    # a call with an x3 config: what run_config launches
    m = _recording_math()
    cl.run_config(m, cc.X_128x64x32, x, w, None, geom, out, 0)
    (ki, *_), (kw, *_), (k, grid, smem, values) = m.backend.launches
    assert ki.params["kind"] == "input_nhwc" and kw.params["kind"] == "weight_krsc"
    assert k.template == cc.MMA_TEMPLATE and k.params["x3"] is True
    assert k.params == {**cv.dtype_params(DT.FLOAT32), **cc.X_128x64x32}
    assert k.threads == 128 and smem == cl.mma_shared_bytes(cc.X_128x64x32, DT.FLOAT32)
    assert grid == (-(-geom.M // 128), -(-geom.Kg // 64), 2)
    cgp = cc.padded_channels(geom, DT.FLOAT32)
    assert cgp == 40 and values[3:] == [out.ptr, 0, 9, 11, 2 * cgp, cgp, 80, 160, geom.P,
                                        geom.Q, 3, 3, 1, 1, 1, 1, 1, 1, geom.M]
    # channels padded to 20 (Cg = 17): the 32-deep k-tiles drop out, the 16-deep one stays
    thin = geo.plan((2, 34, 9, 11), (160, 17, 3, 3), ConvolutionConfig(3, padding=1, groups=2))
    assert [c for c in cc.candidates(thin, DT.FLOAT32, None, 132) if c.get("x3")] == \
        [cc.X_64x64x16]


def test_x3_fits_and_the_dgrad_routing():
    """x3_fits: float32, precision None / 'fp32', the GEMM family, Cg >= 13. The stride-1
    data gradient of float32 at the default precision runs through the forward where the
    forward's x3 fits (its Cg is the layer's K/groups) and the problem is not small
    (dgrad_kcrs_fits), else the dgrad kernel; 'ieee' keeps
    the dgrad kernel; tf32 and the half types go through the forward as before."""
    from cuda_backend.ops import conv2d_backward_configs as bc
    conf = ConvolutionConfig(3, padding=1)
    big = geo.plan((32, 64, 128, 128), (128, 64, 3, 3), conf)
    assert cc.x3_fits(big, DT.FLOAT32, None) and cc.x3_fits(big, DT.FLOAT32, "fp32")
    for dtype, prec in ((DT.FLOAT32, "ieee"), (DT.FLOAT32, "tf32"), (DT.FLOAT16, None),
                        (DT.BFLOAT16, None)):
        assert not cc.x3_fits(big, dtype, prec)
    assert not cc.x3_fits(geo.plan((1, 12, 8, 8), (16, 12, 3, 3), conf), DT.FLOAT32, None)
    assert cc.x3_fits(geo.plan((1, 13, 8, 8), (16, 13, 3, 3), conf), DT.FLOAT32, None)
    assert not cc.x3_fits(geo.plan((1, 32, 8, 8), (32, 1, 3, 3), ConvolutionConfig(
        3, padding=1, groups=32)), DT.FLOAT32, None)          # depthwise: direct
    assert bc.dgrad_path(big, DT.FLOAT32, None) == "forward"
    assert bc.dgrad_path(big, DT.FLOAT32, "fp32") == "forward"
    assert bc.dgrad_path(big, DT.FLOAT32, "ieee") == "simt"
    assert bc.dgrad_path(big, DT.FLOAT32, "tf32") == "forward"
    thin_k = geo.plan((2, 64, 9, 9), (12, 64, 3, 3), conf)      # forward's Cg = 12: no x3
    assert bc.dgrad_path(thin_k, DT.FLOAT32, None) == "simt"
    odd = geo.plan((2, 9, 9, 7), (26, 9, 3, 1), ConvolutionConfig((3, 1), padding=(2, 0),
                                                                 dilation=(2, 1)))
    assert bc.dgrad_path(odd, DT.FLOAT32, None) == "simt"    # small: bc.dgrad_kcrs_fits
    assert bc.dgrad_kcrs_fits(odd, DT.FLOAT32)
    wide = geo.plan((2, 9, 9, 7), (40, 9, 3, 3), ConvolutionConfig(3, padding=2, dilation=2))
    assert not bc.dgrad_kcrs_fits(wide, DT.FLOAT32)         # Kg * R * S = 360
    assert bc.dgrad_path(wide, DT.FLOAT32, None) == "forward"
    strided = geo.plan((2, 64, 9, 9), (128, 64, 3, 3), ConvolutionConfig(3, 2, 1))
    assert bc.dgrad_path(strided, DT.FLOAT32, None) == "simt"


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("cuobjdump") is None,
                    reason="nvcc / cuobjdump not on PATH")
def test_sass_tensor_cores_and_no_local_memory():
    """The mma variants assemble to HMMA; the large tiles keep everything in registers."""
    gen = KernelGenerator(backend=object())
    picks = [(cc.MMA_TEMPLATE, {**cv.dtype_params(DT.FLOAT32), **cc.T_128x128x32}),
             (cc.MMA_TEMPLATE, {**cv.dtype_params(DT.FLOAT32), **cc.X_128x128x32}),
             (cc.MMA_TEMPLATE, {**cv.dtype_params(DT.BFLOAT16), **cc.H_128x128x64}),
             (cc.SIMT_TEMPLATE, {**cv.dtype_params(DT.FLOAT32), **cc.S_128x128x8})]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (template, params) in enumerate(picks):
            name, src = gen.render_kernel(template, **params)
            cu, cubin = os.path.join(tmp, f"k{i}.cu"), os.path.join(tmp, f"k{i}.cubin")
            with open(cu, "w") as f:
                f.write(src)
            subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", cubin, cu], check=True,
                           capture_output=True, timeout=300)
            sass = subprocess.run(["cuobjdump", "-sass", cubin], check=True,
                                  capture_output=True, text=True).stdout
            assert ("HMMA" in sass) == (template == cc.MMA_TEMPLATE), name
            assert "LDL" not in sass and "STL" not in sass, name


FALLBACK_SCRIPT = textwrap.dedent(r'''
    import sys
    import numpy as np
    from cuda_backend.cuda_ml import ConvolutionConfig, get_cuda_ml
    from cuda_backend import CudaDataType as DT
    ml = get_cuda_ml()
    assert not ml.math.gpu, "expected fallback mode"
    data = np.load(sys.argv[1])
    cfg = ConvolutionConfig(3, stride=(2, 1), padding=1, dilation=(1, 2), groups=2)
    out = {}
    for dt, prec in ((DT.FLOAT32, None), (DT.FLOAT32, "ieee"), (DT.FLOAT32, "tf32"),
                     (DT.BFLOAT16, None)):
        args = [ml.math.from_numpy(data[k], dtype=dt) for k in ("x", "w", "b")]
        y = ml.conv2d(args[0], args[1], cfg, args[2], precision=prec)
        out[f"{dt.name_str}_{prec}"] = ml.math.to_numpy(y).astype(np.float32)
    np.savez(sys.argv[2], **out)
''')


def test_fallback_mode_subprocess(tmp_path):
    """CUDA_BACKEND_FALLBACK=1: the NumPy path of every family against the reference."""
    rng = np.random.default_rng(3582)
    x = rng.standard_normal((2, 4, 9, 8)).astype(np.float32)
    w = rng.standard_normal((6, 2, 3, 3)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x, w=w, b=b)
    env = dict(os.environ, CUDA_BACKEND_FALLBACK="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT, str(tmp_path / "in.npz"),
                           str(tmp_path / "out.npz")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = np.load(tmp_path / "out.npz")
    ref = ref_conv(x, w, b, (2, 1), (1, 1), (1, 2), 2)
    assert res["float32_None"].shape == ref.shape == (2, 6, 5, 6)
    assert rel_err(res["float32_None"], ref) <= 1e-6
    assert rel_err(res["float32_ieee"], ref) <= 1e-6
    assert rel_err(res["float32_tf32"], ref) <= 1e-3
    assert rel_err(res["bfloat16_None"], ref) <= 2e-2


# -- TF32 on the TMA + wgmma kernel (ops/conv2d_tma.py) -------------------------------------
TMA_SHAPES = [
    ((2, 3, 9, 70), (5, 3, 3, 3), (2, 1), (1, 1), (1, 1), 1),        # C=3, K=5, stride_h 2
    ((1, 40, 5, 130), (130, 40, 3, 3), (1, 1), (2, 1), (2, 1), 1),   # 2 chunks, K past 128
    ((2, 16, 4, 64), (32, 16, 1, 1), (1, 1), (0, 0), (1, 1), 1),     # 1x1, Q = 64
    ((1, 8, 7, 100), (16, 8, 5, 5), (1, 1), (2, 2), (1, 1), 1),      # 5x5, padding 2
    ((2, 16, 13, 28), (24, 16, 3, 3), (1, 1), (1, 1), (1, 1), 1),    # 4 rows a tile, P % 4
    ((1, 8, 9, 9), (16, 8, 3, 3), (1, 1), (0, 0), (1, 1), 1),        # one tile past P
]


def tma_bound(xh, wh, bh, case, dtype, ref):
    """Per element, the TMA kernel's arithmetic: float32 (TF32) x and w rounded to TF32 by
    the tensor maps' copies (2^-11 each); 16-bit ones exact (their products exact in
    float32); d = R*S*ceil(Cgp/k)*k float32 additions and the bias's; a 16-bit output
    rounded once (u = 2^-11 float16, 2^-8 bfloat16):
        (1 + u) (r + (d + 2) 2^-23) (|x| ⊛ |w| + |b|) + u |ref|, r = 2^-10 + 2^-22 (TF32)."""
    _, ws, s, p, d, g = case
    k = 32 if dtype is DT.FLOAT32 else 64
    depth = ws[2] * ws[3] * -(-ws[1] // k) * k
    r = 2.0 ** -10 + 2.0 ** -22 if dtype is DT.FLOAT32 else 0.0
    u = {DT.FLOAT32: 0.0, DT.FLOAT16: 2.0 ** -11, DT.BFLOAT16: 2.0 ** -8}[dtype]
    mag = ref_conv(np.abs(xh), np.abs(wh), None if bh is None else np.abs(bh), s, p, d, g)
    return (1 + u) * (r + (depth + 2) * 2.0 ** -23) * mag + u * np.abs(ref) + 1e-30


def test_tma_conv_candidates_and_render():
    """The TMA configs are offered for TF32, float16 and bfloat16 convolutions of one group,
    column stride 1 and Q >= 64 on sm_90 only (128 x 256 first past 128 output channels),
    and render the 4-d / 3-d box loads without #error (16-bit: B K-major, no transpose)."""
    info = SimpleNamespace(compute_capability=(9, 0))
    g = geo.plan((2, 16, 8, 64), (200, 16, 3, 3), ConvolutionConfig(3, padding=1))
    assert cc.tma_candidates(g, DT.FLOAT32, "tf32", info) == [cc.C_TMA_128x256_s4,
                                                              cc.C_TMA_128x128_s5]
    small_k = geo.plan((2, 16, 8, 64), (64, 16, 3, 3), ConvolutionConfig(3, padding=1))
    assert cc.tma_candidates(small_k, DT.FLOAT32, "tf32", info) == [cc.C_TMA_128x64_s7]
    mid_k = geo.plan((2, 16, 8, 64), (65, 16, 3, 3), ConvolutionConfig(3, padding=1))
    assert cc.tma_candidates(mid_k, DT.FLOAT32, "tf32", info) == [cc.C_TMA_128x128_s5]
    assert cc.config_family(cc.C_TMA_128x128_s5) == "tma"
    from cuda_backend.ops import conv2d_tma
    q28 = geo.plan((2, 16, 13, 28), (24, 16, 3, 3), ConvolutionConfig(3, padding=1))
    assert cc.tma_candidates(q28, DT.FLOAT32, "tf32", info) == [cc.C_TMA_128x64_s7]
    assert [conv2d_tma.tile_rows(geom, 128) for geom in (q28, g, small_k)] == [4, 2, 2]
    assert conv2d_tma.tile_rows(geo.plan((2, 16, 8, 140), (64, 16, 3, 3),
                                         ConvolutionConfig(3, padding=1)), 128) == 1
    for dt in (DT.FLOAT16, DT.BFLOAT16):
        assert cc.tma_candidates(small_k, dt, None, info) == [cc.C_TMA_128x64_s7]
    for geom, dt, prec, inf in (
            (g, DT.FLOAT32, None, info), (g, DT.FLOAT32, "ieee", info),
            (g, DT.FLOAT32, "tf32", SimpleNamespace(compute_capability=(8, 0))),
            (geo.plan((2, 16, 8, 63), (64, 16, 3, 3), ConvolutionConfig(3, stride=(2, 1),
                                                                       padding=1)),
             DT.FLOAT32, "tf32", info),
            (geo.plan((2, 16, 8, 140), (64, 16, 3, 3), ConvolutionConfig(3, stride=2)),
             DT.FLOAT32, "tf32", info),
            (geo.plan((2, 16, 8, 64), (64, 8, 3, 3), ConvolutionConfig(3, padding=1,
                                                                       groups=2)),
             DT.FLOAT32, "tf32", info)):
        assert cc.tma_candidates(geom, dt, prec, inf) == []
    gen = KernelGenerator(backend=object())
    for cfg in cc.TMA_CONFIGS:
        for dt, mma in ((DT.FLOAT32, "k8.f32.tf32.tf32"), (DT.FLOAT16, "k16.f32.f16.f16"),
                        (DT.BFLOAT16, "k16.f32.bf16.bf16")):
            _, src = gen.render_kernel("matmul_tma16.cu.j2", **conv2d_tma.params(cfg, dt))
            assert "#error" not in src and "cp.async.bulk.tensor.4d" in src and \
                "cp.async.bulk.tensor.3d" in src and f"m64n{cfg['bn']}{mma}" in src
            assert ("p, 1, 1;" if dt is DT.FLOAT32 else "p, 1, 1, 0, 0;") in src


def _need_hopper(m):
    from cuda_backend.ops.matmul_kernels import has_wgmma
    if not has_wgmma(m.backend.get_device_info(m.backend.current_device)):
        pytest.skip("the TMA kernel needs a Hopper GPU (sm_90a)")


TMA_FAMS = {"tf32": (DT.FLOAT32, "tf32"), "fp16": (DT.FLOAT16, None),
            "bf16": (DT.BFLOAT16, None)}


@gpu
@pytest.mark.parametrize("fam", list(TMA_FAMS))
@pytest.mark.parametrize("cfg", cc.TMA_CONFIGS, ids=lambda c: "tma_{bm}x{bn}_s{stages}".format(**c))
def test_tma_conv_every_config(m, cfg, fam):
    """Each TMA config through run_config (the mma repacks, the kernel, the workspaces back
    to the pool) into a poisoned output, with and without a bias, on every TMA_SHAPES case
    (partial channel chunks, output channels and output rows; padding, dilation, row
    stride): every element within tma_bound."""
    _need_hopper(m)
    dtype, _ = TMA_FAMS[fam]
    rng = np.random.default_rng(32)
    dev = m.backend.current_device
    pool = m.backend.memory_pools[dev]
    for case in TMA_SHAPES:
        xs, ws, s, p, d, g = case
        geom = geo.plan(xs, ws, config_of(case))
        x, xh = make(m, rng, xs, dtype)
        w, wh = make(m, rng, ws, dtype)
        b, bh = make(m, rng, (ws[0],), dtype)
        for bias, bias_h in ((b, bh), (None, None)):
            out = poisoned(m, geom.out_shape, dtype)
            before = pool.get_stats()["active_memory"]
            cl.run_config(m, cfg, x, w, bias, geom, out, dev)
            assert pool.get_stats()["active_memory"] == before
            ref = ref_conv(xh, wh, bias_h, s, p, d, g)
            check_finite(m.to_numpy(out), ref, tma_bound(xh, wh, bias_h, case, dtype, ref),
                         (cfg, fam, case, bias is not None))
            out.free()
        for t in (x, w, b):
            t.free()


@gpu
@pytest.mark.parametrize("cfg", cc.TMA_CONFIGS, ids=lambda c: "tma_{bm}x{bn}_s{stages}".format(**c))
def test_tma_conv_public_and_plan_path(ml, cfg, monkeypatch):
    """conv2d(precision="tf32") with a TMA config memoized as the geometry's choice: the
    general path, then the per-call plan (launch made to raise), with a bias; both within
    tma_bound."""
    m = ml.math
    _need_hopper(m)
    rng = np.random.default_rng(33)
    dev = m.backend.current_device
    case = TMA_SHAPES[1]
    xs, ws, s, p, d, g = case
    conf = config_of(case)
    geom = geo.plan(xs, ws, conf)
    x, xh = make(m, rng, xs, DT.FLOAT32)
    w, wh = make(m, rng, ws, DT.FLOAT32)
    b, bh = make(m, rng, (ws[0],), DT.FLOAT32)
    m.__dict__.setdefault("_conv2d_configs", {})[(geom, DT.FLOAT32, "tf32", dev)] = cfg
    key = cl.plan_key(x, w, conf, False, "tf32")
    m.plans.pop(key, None)
    ref = ref_conv(xh, wh, bh, s, p, d, g)
    bnd = tma_bound(xh, wh, bh, case, DT.FLOAT32, ref)
    for second in (False, True):
        with monkeypatch.context() as mp:
            if second:
                mp.setattr("cuda_backend.ops.conv2d.launch", _no_launch)
            out = ml.conv2d(x, w, conf, b, precision="tf32")
        assert key in m.plans
        check_finite(m.to_numpy(out), ref, bnd, (cfg, second))
        out.free()
    m.plans.pop(key, None)
    m._conv2d_configs.pop((geom, DT.FLOAT32, "tf32", dev), None)
    for t in (x, w, b):
        t.free()


def _no_launch(*args, **kwargs):
    raise AssertionError("the general path ran where the per-call plan should have")
