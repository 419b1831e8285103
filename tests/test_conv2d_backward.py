"""conv2d_backward (cuda_backend/ops/conv2d_backward.py): grad_input, grad_kernel and grad_bias
of conv2d against float64 references written here (grad_input by its definition as a sum
over the output pixels each input pixel reaches, grad_kernel by tensordot with the shifted
input), the forward's adjoint identity, float64 finite differences of the forward, and
PyTorch's autograd when torch is importable.

Bounds are derived from the arithmetic: every output is a sum of products of operands the
dtype holds exactly (float16 and bfloat16 products are exact in float32); with u = 2^-24 the
float32 accumulation of d terms in sequence errs by at most d u (sum of |terms|) (round to
nearest; 2 d u for the tensor-core paths, whose accumulation may truncate), TF32 operands
add 2^-10 (sum of |terms|) (each rounded with 2^-11 relative error), and the one rounding
of the result to the dtype adds u_out |result|. The depth d: dgrad K/groups*R*S (+ 8 for the
slices' sums), wgrad N*P*Q plus the splits (at most N*P*Q / 8 + 1), the bias N*P*Q + 16.
float32 wgrad on tensor cores (3xTF32, conv2d_wgrad_mma.cu.j2) has its own coefficient,
x3_depth: a split's truncating mma accumulation, the splits' adds and the split products'
3.001 * 2^-22 each (test_x3_split_error).
Small-integer operands make every product and partial sum exact, so there the result must
equal the reference exactly: that catches a single misplaced term at any size.
Tests marked `gpu` run every dgrad and wgrad config (wgrad with forced splits), the
per-call plan, determinism, the issue's shape and recovery after bad input; the rest run in
whatever mode the backend is in (the NumPy fallback without a GPU).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import (RecordingMath, call_through_plan, check_finite as check, defined_int, make,
                     tuned_math)

from cuda_backend import (CudaDataType as DT, DTypeMismatchError, InvalidArgumentError,
                          ShapeMismatchError, TensorFreedError)
from cuda_backend.cuda_ml import ConvolutionConfig, CudaML
from cuda_backend.driver import load_driver
from cuda_backend.kernels import KernelGenerator, dtype_params
from cuda_backend.dtypes import from_bfloat16_bits, to_bfloat16_bits
from cuda_backend.ops import conv2d as cv
from cuda_backend.ops import conv2d_backward as cb
from cuda_backend.ops import conv2d_backward_configs as bc
from cuda_backend.ops import conv2d_backward_program as bp
from cuda_backend.ops import conv2d_configs as cc
from cuda_backend.ops import conv2d_geometry as geo

gpu = pytest.mark.gpu
GPU = load_driver()[0] is not None
# (dtype, precision)
FAMILIES = {"fp32": (DT.FLOAT32, None), "tf32": (DT.FLOAT32, "tf32"),
            "fp16": (DT.FLOAT16, None), "bf16": (DT.BFLOAT16, None)}
U = 2.0**-24
U_OUT = {DT.FLOAT32: 2.0**-24, DT.FLOAT16: 2.0**-11, DT.BFLOAT16: 2.0**-8}
ATOL = {DT.FLOAT32: 1e-30, DT.FLOAT16: 2.0**-25, DT.BFLOAT16: 1e-30}
TF32_PRODUCT = 2.0**-10 * 1.01   # (1 + 2^-11)^2 - 1, rounded up

# (input shape, kernel shape, stride, padding, dilation, groups): odd sizes, every kernel
# shape class, strides 1-3 (phases no tap reaches), dilation 2, groups, padding = extent
CASES = [
    ((2, 3, 7, 9), (5, 3, 3, 3), (2, 2), (1, 1), (2, 2), 1),
    ((3, 5, 11, 10), (7, 5, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((1, 5, 6, 5), (7, 5, 1, 1), (3, 3), (0, 0), (1, 1), 1),
    ((1, 4, 9, 8), (6, 4, 5, 3), (2, 3), (2, 1), (1, 1), 1),
    ((2, 6, 7, 8), (4, 3, 3, 3), (2, 1), (1, 2), (1, 2), 2),
    ((1, 4, 10, 11), (4, 1, 3, 3), (3, 2), (3, 3), (1, 1), 4),
    ((3, 9, 5, 6), (12, 3, 2, 2), (3, 2), (0, 1), (2, 1), 3),
    ((1, 2, 5, 5), (3, 2, 3, 3), (1, 1), (3, 3), (1, 1), 1),
    ((2, 10, 12, 13), (9, 10, 3, 3), (2, 2), (1, 1), (1, 1), 1),
    ((5, 4, 3, 3), (5, 4, 3, 3), (1, 1), (0, 0), (1, 1), 1),
    ((1, 40, 6, 5), (70, 40, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((2, 24, 9, 7), (34, 12, 5, 3), (1, 1), (2, 1), (1, 1), 2),
    ((2, 16, 8, 9), (24, 16, 1, 1), (1, 1), (0, 0), (1, 1), 1),
]
CASE_IDS = [f"{x}x{w}s{s}p{p}d{d}g{g}" for x, w, s, p, d, g in CASES]


def config_of(case):
    _, w, s, p, d, g = case
    return ConvolutionConfig(kernel_size=w[2:], stride=s, padding=p, dilation=d, groups=g)


def geometry(case):
    return geo.plan(case[0], case[1], config_of(case))


# -- the test's own float64 references -------------------------------------------------------
def ref_forward(x, w, stride, padding, dilation, groups):
    """F.conv2d in float64 by its definition (pad, then per group and tap a tensordot)."""
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    P = (H + 2 * ph - dh * (R - 1) - 1) // sh + 1
    Q = (W + 2 * pw - dw * (S - 1) - 1) // sw + 1
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    out = np.zeros((N, K, P, Q))
    Kg = K // groups
    for g in range(groups):
        for r in range(R):
            for s in range(S):
                patch = xp[:, g * Cg:(g + 1) * Cg, r * dh:r * dh + sh * (P - 1) + 1:sh,
                           s * dw:s * dw + sw * (Q - 1) + 1:sw]
                out[:, g * Kg:(g + 1) * Kg] += np.tensordot(
                    w[g * Kg:(g + 1) * Kg, :, r, s], patch, axes=([1], [1])).transpose(1, 0, 2, 3)
    return out


def ref_backward(go, x, w, stride, padding, dilation, groups):
    """(grad_input, grad_kernel, grad_bias) in float64: grad_input[n, c, h, w] sums
    grad_out[n, k, p, q] w[k, c, r, s] over the (k, r, s) with h = p sh - ph + r dh and
    w = q sw - pw + s dw for some output pixel (p, q); grad_kernel[k, c, r, s] is grad_out
    contracted over (n, p, q) with the input at those pixels (zero in the padding)."""
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    P, Q = go.shape[2:]
    Kg = K // groups
    gi = np.zeros((N, C, H, W))
    gw = np.zeros(w.shape)
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    for g in range(groups):
        ks, cs = slice(g * Kg, (g + 1) * Kg), slice(g * Cg, (g + 1) * Cg)
        for r in range(R):
            for s in range(S):
                for h in range(H):
                    tp = h + ph - r * dh
                    if tp % sh or not 0 <= tp // sh < P:
                        continue
                    for wc in range(W):
                        tq = wc + pw - s * dw
                        if tq % sw or not 0 <= tq // sw < Q:
                            continue
                        gi[:, cs, h, wc] += go[:, ks, tp // sh, tq // sw] @ w[ks, :, r, s]
                patch = xp[:, cs, r * dh:r * dh + sh * (P - 1) + 1:sh,
                           s * dw:s * dw + sw * (Q - 1) + 1:sw]
                gw[ks, :, r, s] = np.tensordot(go[:, ks], patch, axes=([0, 2, 3], [0, 2, 3]))
    return gi, gw, go.sum(axis=(0, 2, 3))


def sm_count():
    """The device's SMs (the split sizes depend on them); 132 in fallback mode."""
    if not GPU:
        return 132
    from cuda_backend import get_cuda_backend
    return get_cuda_backend().get_device_info(0).multiprocessor_count


# 3xTF32: |ab - (a_b b_b + a_s b_b + a_b b_s)| <= (3 + 2^-10) 2^-22 |ab| (test_x3_split_error),
# in units of u
X3_PRODUCT = 3.001 * 2.0**-22 / U


def x3_depth(g, cfg):
    """The grad_kernel bound's coefficient of sum |terms| in units of u for a 3xTF32
    config: a split's chunk pixels take chunk / 8 m16n8k8 mma per accumulator, each adding 9
    terms (8 exact products and the accumulator) with truncation, at most 2u of the running
    magnitude each: 2.25 chunk; the cross terms' accumulator, 2^-10 as large, 0.0044 chunk;
    acc + acc_s one rounded add, splitk_sum one per split; X3_PRODUCT per product."""
    splits, chunk = bc.wgrad_split(g, cfg, sm_count())
    return 2.26 * chunk + splits + 1 + X3_PRODUCT


def wgrad_depth(g, cfgs=None, dtype=DT.FLOAT32, prec=None):
    """The grad_kernel bound's coefficient of sum |terms| in units of u, the largest over
    the configs (default: the autotuner's candidates for dtype and precision): SIMT, the
    sequential adds behind an element (a split's pixels, then the splits in order);
    3xTF32, x3_depth."""
    cfgs = cfgs or bc.candidates(g, sm_count(), "wgrad", dtype, prec)
    return max(x3_depth(g, c) if bc.wgrad_is_x3(c) else
               sum(bc.wgrad_split(g, c, sm_count())[::-1]) for c in cfgs)


def bias_depth(g):
    """Sequential adds behind a grad_bias element: a thread's share of a chunk (4 running sums
    over its rows, up to 3 more per row in the tail loop), 2 to join them, 5 + 3 shuffle
    levels, then the chunks in order."""
    chunks, chunk = bc.bias_chunks(g, sm_count())
    rows = -(-chunk // (g.P * g.Q)) + 1
    return -(-chunk // 256) + 3 * rows + 10 + chunks


def depths(g, dtype=DT.FLOAT32, prec=None):
    """Terms summed in sequence behind one output: dgrad (a slice's tiles, then the slices),
    wgrad (the candidates' for dtype and precision), bias (see the helpers above)."""
    return g.Kg * g.R * g.S + 8, wgrad_depth(g, None, dtype, prec), bias_depth(g)


def stored(values, dtype):
    """float64 values rounded once to dtype (round to nearest even), as the kernels store."""
    v = np.asarray(values, np.float64)
    if dtype is DT.BFLOAT16:
        return from_bfloat16_bits(to_bfloat16_bits(v.astype(np.float32))).reshape(v.shape) \
            .astype(np.float64)
    return v.astype(dtype.numpy_dtype).astype(np.float64)


def uses_tensor_cores(g, dtype, prec):
    """Whether the data gradient runs on the forward's mma kernel (its accumulation may
    truncate: 2u per add) and, with TF32, rounds its operands."""
    if not GPU or bc.dgrad_path(g, dtype, prec) != "forward":
        return False
    g2 = geo.plan(g.out_shape, (g.C, g.Kg, g.R, g.S), ConvolutionConfig(
        kernel_size=(g.R, g.S), padding=(g.dh * (g.R - 1) - g.ph, g.dw * (g.S - 1) - g.pw),
        dilation=(g.dh, g.dw), groups=g.groups))
    return cc.family(g2, dtype, prec) == "mma"


def bounds(go, x, w, case, dtype, prec, d_wg=None, mma=None):
    """(references, per-element bounds) of (grad_input, grad_kernel, grad_bias) for these
    stored operands; d_wg: wgrad's depth when one config is run; mma: whether dgrad runs on
    tensor cores (default: as the op chooses)."""
    g = geometry(case)
    refs = ref_backward(go, x, w, *case[2:])
    mags = ref_backward(np.abs(go), np.abs(x), np.abs(w), *case[2:])
    d_dg, d_wg_any, d_b = depths(g, dtype, prec)
    d_wg = d_wg or d_wg_any
    mma = uses_tensor_cores(g, dtype, prec) if mma is None else mma
    c_dg = (2 * d_dg * U + (TF32_PRODUCT if prec == "tf32" else 0.0)) if mma else d_dg * U
    out = []
    for ref, mag, c in zip(refs, mags, (c_dg, d_wg * U, d_b * U)):
        out.append(U_OUT[dtype] * np.abs(ref) + c * mag + ATOL[dtype])
    return refs, out


# -- fixtures and helpers -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def apis(backend, tmp_path_factory):
    """CudaMath (its autotuner writing to a temporary file) and CudaML."""
    m = tuned_math(backend, tmp_path_factory)
    if m.gpu:
        cb.warm_up(m, workers=16)   # every variant compiled once, in parallel
    return m, CudaML(m)


def operands(m, rng, case, dtype, ints=False):
    """grad_out, input and kernel tensors of the case with their stored values: normal draws,
    or small integers (exact sums: |values| <= 2 for the input and kernel, <= 1 for grad_out)."""
    g = geometry(case)
    shapes = (g.out_shape, case[0], case[1])
    if ints:
        vals = [rng.integers(-1, 2, shapes[0]), rng.integers(-2, 3, shapes[1]),
                rng.integers(-2, 3, shapes[2])]
    else:
        vals = [rng.standard_normal(s) for s in shapes]
    return [make(m, v, dtype) for v in vals]


def free(*ts):
    for t in ts:
        if t is not None:
            t.free()


# -- references (float64, any mode) ------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_module_reference_and_adjoint(case):
    """The module's reference equals the definition here, and both are the forward's
    adjoint: <grad_out, conv(x, w)> = <grad_input, x> = <grad_kernel, w>."""
    rng = np.random.default_rng(1)
    g = geometry(case)
    go, x, w = (rng.standard_normal(s) for s in (g.out_shape, case[0], case[1]))
    mine = ref_backward(go, x, w, *case[2:])
    theirs = cb.reference(go, x, w, g, has_bias=True)
    for a, b in zip(mine, theirs):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)
    y = ref_forward(x, w, *case[2:])
    np.testing.assert_allclose(cv.reference(x, w, None, g), y, rtol=1e-12, atol=1e-12)
    inner = (go * y).sum()
    assert math.isclose((mine[0] * x).sum(), inner, rel_tol=1e-12, abs_tol=1e-9)
    assert math.isclose((mine[1] * w).sum(), inner, rel_tol=1e-12, abs_tol=1e-9)
    assert cb.reference(go, x, w, g)[2] is None


# -- the op, any mode ---------------------------------------------------------------------------
@pytest.mark.parametrize("fam", list(FAMILIES))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gradients(apis, case, fam):
    """All three gradients within the derived bounds (normal operands) and exact (small
    integers), every dtype and precision."""
    m, ml = apis
    dtype, prec = FAMILIES[fam]
    rng = np.random.default_rng(2)
    for ints in (False, True):
        (go, hgo), (x, hx), (w, hw) = operands(m, rng, case, dtype, ints)
        gi, gw, gb = ml.conv2d_backward(go, x, w, config_of(case), True, prec)
        assert gi.dtype is dtype and gw.dtype is dtype and gb.dtype is dtype
        refs, bds = bounds(hgo, hx, hw, case, dtype, prec)
        for got, ref, bd, what in zip((gi, gw, gb), refs, bds, ("dgrad", "wgrad", "bias")):
            if ints:
                np.testing.assert_array_equal(m.to_numpy(got).astype(np.float64),
                                              stored(ref, dtype), err_msg=f"{fam} {what} ints")
            else:
                check(m.to_numpy(got), ref, bd, f"{fam} {what}")
        free(go, x, w, gi, gw, gb)


def test_output_mask_and_no_bias(apis):
    """has_bias=False gives None; output_mask computes only what it names, the same values."""
    m, ml = apis
    case = CASES[0]
    rng = np.random.default_rng(3)
    (go, _), (x, _), (w, _) = operands(m, rng, case, DT.FLOAT32)
    cfg = config_of(case)
    full = ml.conv2d_backward(go, x, w, cfg, True)
    gi, gw, gb = ml.conv2d_backward(go, x, w, cfg)
    assert gb is None
    for i, mask in enumerate([(True, False, False), (False, True, False), (False, False, True)]):
        res = cb.conv2d_backward(m, go, x, w, cfg, True, None, output_mask=mask)
        assert [r is not None for r in res] == list(mask)
        np.testing.assert_array_equal(m.to_numpy(res[i]), m.to_numpy(full[i]))
        free(*res)
    assert cb.conv2d_backward(m, go, x, w, cfg, False, None, (False, False, True)) == \
        (None, None, None)
    free(go, x, w, gi, gw, *full)


def test_empty_extents(apis):
    """N = 0: empty grad_input, zero grad_kernel and grad_bias; K = 0 and C = 0 likewise."""
    m, ml = apis
    z = lambda shape: m.from_numpy(np.zeros(shape, np.float32))  # noqa: E731
    gi, gw, gb = ml.conv2d_backward(z((0, 4, 5, 5)), z((0, 3, 7, 7)), z((4, 3, 3, 3)),
                                    ConvolutionConfig(3), True)
    assert gi.shape == (0, 3, 7, 7) and not m.to_numpy(gw).any() and not m.to_numpy(gb).any()
    gi2, gw2, gb2 = ml.conv2d_backward(z((2, 0, 5, 5)), z((2, 3, 7, 7)), z((0, 3, 3, 3)),
                                       ConvolutionConfig(3), True)
    assert gi2.shape == (2, 3, 7, 7) and not m.to_numpy(gi2).any()
    assert gw2.shape == (0, 3, 3, 3) and gb2.shape == (0,)
    free(gi, gw, gb, gi2, gw2, gb2)


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[4], CASES[6]],
                         ids=[CASE_IDS[i] for i in (0, 3, 4, 6)])
def test_finite_differences(apis, case):
    """Central differences in float64 of L(x, w, b) = sum(grad_out * (conv(x, w) + b)) at a
    few coordinates of x, w and b (L is linear in each, so the differences are exact up to
    rounding, below 1e-9 here) against the op in float32 on float32 operands."""
    m, ml = apis
    rng = np.random.default_rng(4)
    (go, hgo), (x, hx), (w, hw) = operands(m, rng, case, DT.FLOAT32)
    gi, gw, gb = (m.to_numpy(t).astype(np.float64)
                  for t in ml.conv2d_backward(go, x, w, config_of(case), True))
    _, (bi, bw, bb) = bounds(hgo, hx, hw, case, DT.FLOAT32, None)

    def loss(xv, wv, bv):
        return float((hgo * (ref_forward(xv, wv, *case[2:]) + bv.reshape(1, -1, 1, 1))).sum())

    eps = 0.5
    hb = np.zeros(case[1][0])
    for arr, grad, bd, which in ((hx, gi, bi, 0), (hw, gw, bw, 1), (hb, gb, bb, 2)):
        for idx in map(tuple, rng.integers(0, arr.shape, (5, arr.ndim))):
            args = [hx, hw, hb]
            plus, minus = arr.copy(), arr.copy()
            plus[idx] += eps
            minus[idx] -= eps
            args[which] = plus
            lp = loss(*args)
            args[which] = minus
            fd = (lp - loss(*args)) / (2 * eps)
            assert abs(fd - grad[idx]) <= bd[idx] + 1e-9, (which, idx, fd, grad[idx])
    free(go, x, w)


def test_against_torch_autograd(apis):
    """PyTorch's float64 autograd of F.conv2d (with bias) on the same float32 operands."""
    torch = pytest.importorskip("torch")
    m, ml = apis
    rng = np.random.default_rng(5)
    for case in (CASES[0], CASES[4], CASES[6], CASES[11]):
        (go, hgo), (x, hx), (w, hw) = operands(m, rng, case, DT.FLOAT32)
        xt = torch.tensor(hx, requires_grad=True)
        wt = torch.tensor(hw, requires_grad=True)
        bt = torch.zeros(case[1][0], dtype=torch.float64, requires_grad=True)
        _, s, p, d, gr = case[1:]
        y = torch.nn.functional.conv2d(xt, wt, bt, s, p, d, gr)
        y.backward(torch.tensor(hgo))
        ours = ml.conv2d_backward(go, x, w, config_of(case), True)
        _, bds = bounds(hgo, hx, hw, case, DT.FLOAT32, None)
        for got, t, bd in zip(ours, (xt, wt, bt), bds):
            want = t.grad.numpy()
            check(m.to_numpy(got), want, 2 * bd + 1e-12 * np.abs(want), str(case))
        free(go, x, w, *ours)


def test_bad_input_raises_typed_errors(apis):
    """Wrong grad_out shape, mixed or unsupported dtypes, a freed tensor, bad flags: typed
    errors naming what was wrong; nothing leaks and the next call works."""
    m, ml = apis
    t = lambda shape, dt=np.float32: m.from_numpy(np.ones(shape, dt))  # noqa: E731
    x, w, go = t((2, 4, 8, 8)), t((6, 4, 3, 3)), t((2, 6, 6, 6))
    cfg = ConvolutionConfig(3)
    go_bad, go16 = t((2, 6, 8, 8)), m.from_numpy(np.ones((2, 6, 6, 6)), dtype=DT.FLOAT16)
    x64, w64, go64 = t((2, 4, 8, 8), np.float64), t((6, 4, 3, 3), np.float64), \
        t((2, 6, 6, 6), np.float64)
    x16 = m.from_numpy(np.ones((2, 4, 8, 8)), dtype=DT.FLOAT16)
    w16 = m.from_numpy(np.ones((6, 4, 3, 3)), dtype=DT.FLOAT16)
    pool = m.backend.memory_pools[x.device_id]
    before = pool.get_stats()["active_memory"]
    bad_calls = [
        (ShapeMismatchError, r"grad_out has shape \(2, 6, 8, 8\).*gives \(2, 6, 6, 6\)",
         lambda: ml.conv2d_backward(go_bad, x, w, cfg)),
        (DTypeMismatchError, r"float16 and float32|float32 and float16",
         lambda: ml.conv2d_backward(go16, x, w, cfg)),
        (DTypeMismatchError, r"conv2d_backward does not support float64",
         lambda: ml.conv2d_backward(go64, x64, w64, cfg)),
        (ShapeMismatchError, r"kernel_size is \(5, 5\)",
         lambda: ml.conv2d_backward(go, x, w, ConvolutionConfig(5))),
        (InvalidArgumentError, r"ConvolutionConfig", lambda: ml.conv2d_backward(go, x, w, 3)),
        (InvalidArgumentError, r"has_bias must be a bool",
         lambda: ml.conv2d_backward(go, x, w, cfg, has_bias=1)),
        (InvalidArgumentError, r"precision must be",
         lambda: ml.conv2d_backward(go, x, w, cfg, precision="fp8")),
        (InvalidArgumentError, r"tf32.*float32 operands only",
         lambda: ml.conv2d_backward(go16, x16, w16, cfg, precision="tf32")),
        (InvalidArgumentError, r"output_mask must be",
         lambda: cb.conv2d_backward(m, go, x, w, cfg, output_mask=(True, False))),
        (InvalidArgumentError, r"grad_out must be a CudaTensor",
         lambda: ml.conv2d_backward(np.ones((2, 6, 6, 6)), x, w, cfg)),
    ]
    for err, pattern, call in bad_calls:
        with pytest.raises(err, match=pattern):
            call()
    assert pool.get_stats()["active_memory"] == before, "an error path leaked a pool block"
    go2 = t((2, 6, 6, 6))
    go2.free()
    with pytest.raises(TensorFreedError, match="freed"):
        ml.conv2d_backward(go2, x, w, cfg)
    gi, gw, gb = ml.conv2d_backward(go, x, w, cfg, True)   # the pool is still usable
    assert m.to_numpy(gb).tolist() == [72.0] * 6
    free(gi, gw, gb, x, w, go, go_bad, go16, x64, w64, go64, x16, w16)


# -- configs and index math (CPU) ---------------------------------------------------------------
def test_configs_and_candidates():
    """Every config meets its template's static_asserts and shared-memory limit; every
    candidate is a rendered variant; the split and chunk helpers cover the pixels."""
    for cfg in bc.DGRAD_CONFIGS:
        tx, ty = cfg["bn"] // cfg["tn"], cfg["bm"] // cfg["tm"]
        st = tx * ty
        wx = min(tx, 8)
        assert st % 32 == 0 and tx % wx == 0 and ty % (32 // wx) == 0
        assert st % cfg["bm"] == 0 and cfg["bk"] % (st // cfg["bm"]) == 0
        assert bc.dgrad_threads(cfg) <= 256 and bc.dgrad_shared_bytes(cfg) <= 227 * 1024
    for cfg in bc.WGRAD_CONFIGS:
        tx, ty = cfg["bn"] // cfg["tn"], cfg["bm"] // cfg["tm"]
        threads, wx = tx * ty, min(tx, 8)
        mq = threads // cfg["bk"]
        assert threads % 32 == 0 and tx % wx == 0 and ty % (32 // wx) == 0
        assert cfg["bk"] % 8 == 0 and (threads // 32) % (cfg["bk"] // 8) == 0
        assert cfg["bm"] % mq == 0 and cfg["bn"] % mq == 0 and mq % 4 == 0
        assert bc.wgrad_shared_bytes(cfg) <= 227 * 1024
    variants = cb.template_variants()
    assert len(variants[bc.DGRAD_TEMPLATE]) == 3 * len(bc.DGRAD_CONFIGS) + \
        len(bc.DGRAD_KCRS_CONFIGS)
    assert len(variants[bc.WGRAD_TEMPLATE]) == len(bc.WGRAD_CONFIGS)
    assert {p["kind"] for p in variants[bc.AUX_TEMPLATE]} == set(bc.AUX_KINDS)
    for case in CASES + [((32, 64, 128, 128), (128, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1)]:
        g = geometry(case)
        for sms in (1, 7, 132):
            assert all(c in bc.DGRAD_CONFIGS for c in bc.candidates(g, sms, "dgrad"))
            plain = bc.candidates(g, sms, "dgrad")
            for dt in (DT.FLOAT32, DT.BFLOAT16):
                cands = bc.candidates(g, sms, "dgrad", dt)
                kcrs = [c for c in cands if c.get("kcrs")]
                assert cands[:len(plain)] == plain and len(cands) == len(plain) + len(kcrs)
                assert all(c in bc.DGRAD_KCRS_CONFIGS for c in kcrs)
                assert bool(kcrs) == (bc.dgrad_kcrs_fits(g, dt) and any(
                    dict(c, kcrs=True) in bc.DGRAD_KCRS_CONFIGS for c in plain))
            for c in bc.candidates(g, sms, "wgrad"):
                assert {k: v for k, v in c.items() if k != "waves"} in bc.WGRAD_CONFIGS
                splits, chunk = bc.wgrad_split(g, c, sms)
                L = g.N * g.P * g.Q
                assert chunk % c["bk"] == 0 and splits * chunk >= L > (splits - 1) * chunk
            chunks, chunk = bc.bias_chunks(g, sms)
            assert chunks * chunk >= g.N * g.P * g.Q > (chunks - 1) * chunk and chunks <= 65535


def test_phase_taps_against_brute_force():
    for stride in range(1, 5):
        for dil in range(1, 4):
            for size in range(1, 7):
                for a in range(stride):
                    taps = [r for r in range(size) if (a - r * dil) % stride == 0]
                    r0, step, out_step, count = bc.phase_taps(a, stride, dil, size)
                    assert count == len(taps)
                    if taps:
                        assert taps == list(range(r0, size, step))
                        assert all((a - r * dil) // stride == (a - r0 * dil) // stride -
                                   j * out_step for j, r in enumerate(taps))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kernel_index_math_emulated(case):
    """The kernels' index arithmetic, transcribed: dgrad's phases (each input pixel in one
    phase; its taps and output pixels) and wgrad's pixel walk (a split's pixels advanced by
    bk with carries, no divisions), rebuild the reference's gradients."""
    rng = np.random.default_rng(6)
    g = geometry(case)
    go, x, w = (rng.standard_normal(s) for s in (g.out_shape, case[0], case[1]))
    gi_ref, gw_ref, _ = ref_backward(go, x, w, *case[2:])
    # dgrad: phase (ah, aw), pixel (i, j) of the phase -> (h, w); taps r0 + jr * step
    gi = np.full(gi_ref.shape, np.nan)
    G, Cg, Kg = g.groups, g.Cg, g.Kg
    for ah in range(g.sh):
        for aw in range(g.sw):
            ihb, iwb = (g.ph - ah + g.sh - 1) // g.sh, (g.pw - aw + g.sw - 1) // g.sw
            hl, wl = g.H - 1 + g.ph - ah, g.W - 1 + g.pw - aw
            Hph = 0 if hl < 0 else max(0, hl // g.sh - ihb + 1)
            Wph = 0 if wl < 0 else max(0, wl // g.sw - iwb + 1)
            r0, rstep, pstep, Rv = bc.phase_taps(ah, g.sh, g.dh, g.R)
            s0, sstep, qstep, Sv = bc.phase_taps(aw, g.sw, g.dw, g.S)
            pb0 = ihb + (ah - r0 * g.dh) // g.sh if Rv else 0
            qb0 = iwb + (aw - s0 * g.dw) // g.sw if Sv else 0
            for i in range(Hph):
                for j in range(Wph):
                    h, wc = g.sh * (ihb + i) + ah - g.ph, g.sw * (iwb + j) + aw - g.pw
                    assert np.isnan(gi[0, 0, h, wc])
                    acc = np.zeros((g.N, g.C))
                    for jr in range(Rv):
                        p = i + pb0 - jr * pstep
                        for js in range(Sv):
                            q = j + qb0 - js * qstep
                            if 0 <= p < g.P and 0 <= q < g.Q:
                                r, s = r0 + jr * rstep, s0 + js * sstep
                                for gg in range(G):
                                    acc[:, gg * Cg:(gg + 1) * Cg] += \
                                        go[:, gg * Kg:(gg + 1) * Kg, p, q] @ \
                                        w[gg * Kg:(gg + 1) * Kg, :, r, s]
                    gi[:, :, h, wc] = acc
    np.testing.assert_allclose(gi, gi_ref, rtol=1e-12, atol=1e-12)
    # wgrad: split chunks, each thread's pixel l = l_begin + ll advanced by bk with carries
    PQ, L = g.P * g.Q, g.N * g.P * g.Q
    xp = np.pad(x, ((0, 0), (0, 0), (g.ph, g.ph), (g.pw, g.pw)))
    for cfg in (bc.W_16x64x8, bc.W_128x128x8):
        bk = cfg["bk"]
        dn, dp = bk // PQ, (bk - bk // PQ * PQ) // g.Q
        dq = bk - dn * PQ - dp * g.Q
        splits, chunk = bc.wgrad_split(g, {**cfg, "waves": 4}, 132)
        gw = np.zeros(w.shape)
        for z in range(splits):
            l_len = min(chunk, L - z * chunk)
            for ll in range(bk):
                l = z * chunk + ll
                n, p, q = (l // PQ, l % PQ // g.Q, l % g.Q) if l < L else (0, 0, 0)
                left = l_len - ll
                while left > 0:
                    assert (n * PQ + p * g.Q + q) == z * chunk + l_len - left
                    hs = slice(p * g.sh, p * g.sh + g.dh * (g.R - 1) + 1, g.dh)
                    ws = slice(q * g.sw, q * g.sw + g.dw * (g.S - 1) + 1, g.dw)
                    for gg in range(G):
                        ks = slice(gg * Kg, (gg + 1) * Kg)
                        win = xp[n, gg * Cg:(gg + 1) * Cg, hs, ws]
                        gw[ks] += go[n, ks, p, q][:, None, None, None] * win
                    left -= bk
                    q, p, n = q + dq, p + dp, n + dn
                    if q >= g.Q:
                        q, p = q - g.Q, p + 1
                    if p >= g.P:
                        p, n = p - g.P, n + 1
        np.testing.assert_allclose(gw, gw_ref, rtol=1e-12, atol=1e-12)


def test_dgrad_paths():
    """Which data-gradient path each dtype and geometry takes."""
    g1 = geometry(CASES[1])                  # stride 1, 5 channels per group
    g2 = geometry(CASES[0])                  # stride 2
    g3 = geometry(CASES[10])                 # stride 1, 40 channels
    g4 = geometry(CASES[7])                  # padding 3 > dilation * (kernel - 1)
    assert bc.dgrad_path(g1, DT.FLOAT32, None) == "forward"     # the direct kernel
    assert bc.dgrad_path(g3, DT.FLOAT32, None) == "forward"    # the forward's 3xTF32 fits
    assert bc.dgrad_path(g3, DT.FLOAT32, "ieee") == "simt"
    assert bc.dgrad_path(g3, DT.FLOAT32, "tf32") == "forward"
    assert bc.dgrad_path(g3, DT.BFLOAT16, None) == "forward"
    assert bc.dgrad_path(g2, DT.FLOAT16, None) == "simt"
    assert bc.dgrad_path(g4, DT.FLOAT16, None) == "simt"


# -- 3xTF32 wgrad (conv2d_wgrad_mma.cu.j2): configs, split arithmetic, index math (CPU) -------
# (input, kernel, stride, padding, dilation, groups): odd sizes, every kind the kernel gathers
X3_CASES = [
    ((3, 5, 17, 17), (7, 5, 3, 3), (1, 1), (1, 1), (1, 1), 1),     # P*Q = 289, Cg*R*S = 45
    ((3, 5, 17, 17), (7, 5, 3, 3), (2, 2), (1, 1), (1, 1), 1),     # stride 2
    ((3, 5, 17, 17), (7, 5, 3, 3), (1, 1), (2, 2), (2, 2), 1),     # dilation 2
    ((3, 6, 17, 17), (8, 3, 3, 3), (1, 1), (1, 1), (1, 1), 2),     # groups 2
    ((3, 5, 17, 17), (7, 5, 1, 1), (1, 1), (0, 0), (1, 1), 1),     # 1x1
    ((2, 4, 9, 10), (9, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1),      # P*Q = 90, Cg*R*S = 36
    ((2, 3, 7, 9), (5, 3, 3, 3), (2, 2), (1, 1), (2, 2), 1),       # stride and dilation 2
    ((1, 4, 10, 11), (4, 1, 3, 3), (3, 2), (3, 3), (1, 1), 4),     # Cg = 1, padding = extent
    ((3, 33, 17, 15), (70, 33, 3, 3), (1, 1), (1, 1), (1, 1), 1),  # several row / column tiles
    ((2, 24, 9, 7), (34, 12, 5, 3), (1, 1), (2, 1), (1, 1), 2),    # 5x3, groups 2
]
X3_IDS = [f"{x}x{w}s{s}p{p}d{d}g{g}" for x, w, s, p, d, g in X3_CASES]


def x3_layout(cfg):
    """The kernel's derived sizes (its #defines) of a 3xTF32 config."""
    bm, bn, bk, wm, wn = (cfg[k] for k in ("bm", "bn", "bk", "wm", "wn"))
    nwarps = (bm // wm) * (bn // wn)
    rpw = 32 // bk
    row_step = nwarps * rpw
    period = 1 if row_step >= 8 else 8 // row_step
    return dict(nwarps=nwarps, threads=32 * nwarps, rb=4 * bk, rpw=rpw, row_step=row_step,
                a_iters=bm // row_step, b_iters=bn // row_step, period=period,
                period_bytes=period * row_step * 4 * bk)


def x3_swz(bk, r, c):
    """The template's swz(): physical 16-byte chunk of logical chunk c in shared row r."""
    return c ^ (r & 7) if bk == 32 else c ^ ((r >> 1) & 3)


def test_x3_configs_and_candidates():
    """Every 3xTF32 config meets its template's static_asserts and the shared-memory limit,
    its rendered THREADS is wgrad_threads; float32 at None / fp32 / tf32 offers the 3xTF32
    configs first, then the SIMT ones; 'ieee', the 16-bit dtypes and geometries whose
    offsets would leave int32 get the SIMT list; the splits cover the pixels with chunks of
    at most X3_MAX_CHUNK pixels (unless the workspace cap needs longer ones)."""
    gen = KernelGenerator(backend=object())
    variants = cb.template_variants()[bc.WGRAD_X3_TEMPLATE]
    assert len(variants) == len(bc.WGRAD_X3_CONFIGS)
    for cfg in bc.WGRAD_X3_CONFIGS:
        lay = x3_layout(cfg)
        assert bc.wgrad_is_x3(cfg) and bc.wgrad_template(cfg) == bc.WGRAD_X3_TEMPLATE
        assert cfg["bk"] in (16, 32) and cfg["stages"] >= 2
        assert cfg["bm"] % cfg["wm"] == 0 and cfg["bn"] % cfg["wn"] == 0
        assert cfg["wm"] % 16 == 0 and cfg["wn"] % 16 == 0
        assert cfg["bm"] % lay["row_step"] == 0 and cfg["bn"] % lay["row_step"] == 0
        assert lay["row_step"] % 8 == 0 or 8 % lay["row_step"] == 0
        assert lay["a_iters"] <= 32 and lay["threads"] <= 1024
        assert bc.wgrad_shared_bytes(cfg) + 16 * cfg["bn"] <= 227 * 1024
        assert bc.wgrad_shared_bytes(cfg) == \
            cfg["stages"] * (cfg["bm"] + cfg["bn"]) * cfg["bk"] * 4
        _, src = gen.render_kernel(bc.WGRAD_X3_TEMPLATE, **{**dtype_params(DT.FLOAT32), **cfg})
        assert defined_int(src, "THREADS") == bc.wgrad_threads(cfg) == lay["threads"]
    for case in CASES + X3_CASES + [((32, 64, 128, 128), (128, 64, 3, 3), (1, 1), (1, 1),
                                     (1, 1), 1)]:
        g = geometry(case)
        L = g.N * g.P * g.Q
        for sms in (1, 7, 132):
            simt = bc.candidates(g, sms, "wgrad")
            for dtype, prec in ((DT.FLOAT32, None), (DT.FLOAT32, "fp32"), (DT.FLOAT32, "tf32")):
                cands = bc.candidates(g, sms, "wgrad", dtype, prec)
                x3 = [c for c in cands if bc.wgrad_is_x3(c)]
                assert x3 and cands == x3 + simt
                for c in x3:
                    assert {k: v for k, v in c.items() if k != "waves"} in bc.WGRAD_X3_CONFIGS
                    splits, chunk = bc.wgrad_split(g, c, sms)
                    assert chunk % c["bk"] == 0 and splits * chunk >= L > (splits - 1) * chunk
                    assert chunk <= max(bc.X3_MAX_CHUNK, c["bk"])
            for dtype, prec in ((DT.FLOAT32, "ieee"), (DT.FLOAT16, None), (DT.BFLOAT16, None)):
                assert bc.candidates(g, sms, "wgrad", dtype, prec) == simt
    big = geo.plan((1, 2, 40000, 40000), (4, 2, 3, 3), ConvolutionConfig(3, padding=1))
    assert not bc.wgrad_x3_fits(big, DT.FLOAT32, None)       # 2 * 1.6e9 elements
    assert bc.wgrad_x3_fits(geometry(X3_CASES[0]), DT.FLOAT32, None)


def split_tf32(v):
    """The template's split_tf32 in NumPy: (big, small) float32, big = rna(v) (TF32),
    small = rna(v - big) with the float32 subtraction."""
    v = np.ascontiguousarray(v, np.float32)
    big = ((v.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    rest = v - big
    small = ((rest.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return big, small


def test_x3_split_error():
    """The product error model behind X3_PRODUCT: with a = a_b + r_a (exact), |r_a| <= 2^-11
    |a|, a_s = rna(r_a) within 2^-22 |a| of it, ab - (a_b b_b + a_s b_b + a_b b_s) =
    a_b (r_b - b_s) + b_b (r_a - a_s) + r_a r_b, at most (3 + 2^-10) 2^-22 |ab|; the three
    TF32 products are exact in float32 (11-bit significands). Random operands over 60
    binades, and small integers and 16-bit values, which split exactly (small = 0)."""
    rng = np.random.default_rng(12)
    a = (rng.standard_normal(200000) * 2.0 ** rng.uniform(-30, 30, 200000)).astype(np.float32)
    b = (rng.standard_normal(200000) * 2.0 ** rng.uniform(-30, 30, 200000)).astype(np.float32)
    (ab, as_), (bb, bs) = split_tf32(a), split_tf32(b)
    for v, big, small in ((a, ab, as_), (b, bb, bs)):
        for part in (big, small):   # TF32: the low 13 bits are zero
            assert not (part.view(np.uint32) & np.uint32(0x1FFF)).any()
        v64 = v.astype(np.float64)
        assert (np.abs(v64 - big) <= 2.0**-11 * np.abs(v64)).all()
        assert (np.abs(v64 - big - small) <= 2.0**-22 * np.abs(v64)).all()
    exact = a.astype(np.float64) * b
    terms = [ab.astype(np.float64) * bb, as_.astype(np.float64) * bb, ab.astype(np.float64) * bs]
    for t in terms:
        assert (t.astype(np.float32).astype(np.float64) == t).all()   # exact in float32
    err = np.abs(exact - sum(terms))
    assert (err <= X3_PRODUCT * U * np.abs(exact)).all()
    ints = np.arange(-300, 301, dtype=np.float32)
    half = rng.standard_normal(1000).astype(np.float16).astype(np.float32)
    for v in (ints, half):
        big, small = split_tf32(v)
        assert (big == v).all() and not small.any()


def emulate_wgrad_x3(go, x, g, cfg, splits, chunk):
    """conv2d_wgrad_mma.cu.j2 transcribed: per block (split z, row tile, column tile, group),
    the B-row table, each thread's pixel (n, p, q) advanced by bk with carries, its copies'
    shared offsets (dst[i % SWZ_PERIOD] + (i / SWZ_PERIOD) * PERIOD_BYTES) and sources, the
    zero-fills; every shared slot of a k-tile written once, each warp's copy instruction on
    32 distinct banks; the logical tiles read back through the swizzle multiplied in
    float64 into the block's partial tile, stored through the mma C layout (c0..c3 of each
    16 x 8 tile of each warp); the partials summed over the splits. Returns grad_kernel."""
    lay = x3_layout(cfg)
    bm, bn, bk, wm, wn = (cfg[k] for k in ("bm", "bn", "bk", "wm", "wn"))
    rb, row_step, period = lay["rb"], lay["row_step"], lay["period"]
    G, Cg, Kg, K, P, Q, H, W = g.groups, g.Cg, g.Kg, g.K, g.P, g.Q, g.H, g.W
    RS, PQ, HW = g.R * g.S, P * Q, H * W
    CRS, L = Cg * RS, g.N * P * Q
    mtiles, ntiles = -(-Kg // bm), -(-CRS // bn)
    gof, xf = np.asarray(go, np.float64).ravel(), np.asarray(x, np.float64).ravel()
    tid = np.arange(lay["threads"])
    lane, warp = tid & 31, tid >> 5
    ll, row0 = lane & (bk - 1), warp * lay["rpw"] + lane // bk
    dst = [(row0 + k * row_step) * rb + x3_swz(bk, row0 + k * row_step, ll >> 2) * 16 +
           (ll & 3) * 4 for k in range(period)]
    dn = bk // PQ
    dp = (bk - dn * PQ) // Q
    dq = bk - dn * PQ - dp * Q
    # logical (row, k) -> float index in a stage: A rows first, then B rows
    rows = np.arange(bm + bn)[:, None]
    kk = np.arange(bk)[None, :]
    phys = (rows * rb + x3_swz(bk, rows, kk >> 2) * 16 + (kk & 3) * 4) // 4
    # the epilogue's thread -> (row, col) map of the block tile (the mma C layout)
    er, ec = [], []
    for i in range(wm // 16):
        for j in range(wn // 8):
            for h in range(2):
                for q in range(2):
                    er.append((warp // (bn // wn)) * wm + i * 16 + (lane >> 2) + h * 8)
                    ec.append((warp % (bn // wn)) * wn + j * 8 + (lane & 3) * 2 + q)
    er, ec = np.concatenate(er), np.concatenate(ec)
    assert len(set(zip(er.tolist(), ec.tolist()))) == bm * bn == len(er)   # a bijection
    ws = np.full((splits, K * CRS), np.nan)
    for gg in range(G):
        for z in range(splits):
            l_begin = z * chunk
            l_len = min(L - l_begin, chunk)
            iters = -(-l_len // bk) if l_len > 0 else 0
            for mt in range(mtiles):
                for nt in range(ntiles):
                    m0, n0 = mt * bm, nt * bn
                    col = n0 + np.arange(bn)
                    c, rs = col // RS, col % RS
                    r, s = rs // g.S, rs % g.S
                    inside = col < CRS
                    dr = np.where(inside, r * g.dh - g.ph, -2**30)
                    ds = np.where(inside, s * g.dw - g.pw, 0)
                    off = np.where(inside, c * HW + (r * g.dh - g.ph) * W + ds, 0)
                    a_left = Kg - m0 - row0      # copies i < a_rows are inside Kg
                    a_rows = np.where(a_left <= 0, 0,
                                      np.minimum(lay["a_iters"], -(-a_left // row_step)))
                    l0 = l_begin + ll
                    ln = np.where(l0 < L, l0 // PQ, 0)
                    pq = np.where(l0 < L, l0 % PQ, 0)
                    lp, lq = pq // Q, pq % Q
                    l_left = l_len - ll
                    a_base = (gg * Kg + m0 + row0) * PQ
                    acc = np.zeros((bm, bn))
                    for _ in range(iters):
                        sm = np.zeros((bm + bn) * bk)
                        seen = np.zeros((bm + bn) * bk, int)
                        lv = l_left > 0
                        ap = a_base + ln * K * PQ + lp * Q + lq
                        ihb, iwb = lp * g.sh, lq * g.sw
                        xp = gg * Cg * HW + ln * g.C * HW + ihb * W + iwb
                        copies = []
                        a_lim = np.where(lv, a_rows, 0)
                        iwc = np.where(lv, iwb, 2**30)
                        for i in range(lay["a_iters"]):
                            ok = i < a_lim
                            copies.append((0, i, ok, ap + i * row_step * PQ, gof))
                        for i in range(lay["b_iters"]):
                            j = row0 + i * row_step
                            ok = (ihb + dr[j] >= 0) & (ihb + dr[j] < H) & \
                                (iwc + ds[j] >= 0) & (iwc + ds[j] < W)
                            copies.append((bm * rb, i, ok, xp + off[j], xf))
                        for base, i, ok, src, mem in copies:
                            assert ((src >= 0) & (src < mem.size))[ok].all(), "read outside"
                            d = base + dst[i % period] + (i // period) * lay["period_bytes"]
                            assert (d % 4 == 0).all()
                            banks = np.sort((d // 4 % 32).reshape(-1, 32), axis=1)
                            assert (np.diff(banks, axis=1) > 0).all(), "bank conflict"
                            sm[d // 4] = np.where(ok, mem[np.where(ok, src, 0)], 0.0)
                            seen[d // 4] += 1
                        assert (seen == 1).all()
                        tile = sm[phys]
                        acc += tile[:bm] @ tile[bm:].T
                        l_left = l_left - bk
                        lq, lp, ln = lq + dq, lp + dp, ln + dn
                        lp, lq = np.where(lq >= Q, lp + 1, lp), np.where(lq >= Q, lq - Q, lq)
                        ln, lp = np.where(lp >= P, ln + 1, ln), np.where(lp >= P, lp - P, lp)
                    keep = (m0 + er < Kg) & (n0 + ec < CRS)
                    rk, ck = er[keep], ec[keep]
                    ws[z, (gg * Kg + m0 + rk) * CRS + n0 + ck] = acc[rk, ck]
    assert not np.isnan(ws).any(), "a partial element no block wrote"
    return ws.sum(axis=0).reshape(K, Cg, g.R, g.S)


def test_x3_fragment_layout():
    """The ldmatrix.x4 addresses of the template (A rows wm0 + i*16 + (lane & 15), chunk
    2 ks + (lane >> 4); B rows wn0 + jp*16 + (lane & 7) + 8 (lane >> 4), chunk 2 ks +
    ((lane >> 3) & 1)) on the swizzled tiles give exactly the m16n8k8 TF32 fragments:
    a0..a3 = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4], b0, b1 = B[k=t][n=g], B[k=t+4][n=g]
    (g = lane / 4, t = lane % 4), and each 8-lane phase reads 8 distinct 16-byte bank
    groups (conflict-free). Each shared float holds its own (row, k) code here."""
    for cfg in bc.WGRAD_X3_CONFIGS:
        lay = x3_layout(cfg)
        bm, bn, bk, wm, wn = (cfg[k] for k in ("bm", "bn", "bk", "wm", "wn"))
        rb = lay["rb"]
        sm = np.zeros((bm + bn) * bk, np.int64)
        rows = np.arange(bm + bn)[:, None]
        kk = np.arange(bk)[None, :]
        sm[(rows * rb + x3_swz(bk, rows, kk >> 2) * 16 + (kk & 3) * 4) // 4] = rows * 1000 + kk
        lane = np.arange(32)
        gq, tq = lane // 4, lane % 4

        def ldsm_x4(addr):
            """Registers r0..r3 of each lane: word (T % 4) of row T / 4 of matrix q, whose
            rows lanes 8q..8q+7 address (16 bytes each)."""
            assert (addr % 16 == 0).all()
            for q in range(4):   # one phase per matrix: 8 distinct bank groups
                assert len(set((addr[8 * q:8 * q + 8] // 16 % 8).tolist())) == 8
            return [sm[addr[8 * q + gq] // 4 + tq] for q in range(4)]
        for warp in range(lay["nwarps"]):
            wm0, wn0 = (warp // (bn // wn)) * wm, (warp % (bn // wn)) * wn
            ar = wm0 + (lane & 15)
            br = wn0 + (lane & 7) + ((lane >> 4) << 3)
            for ks in range(bk // 8):
                a_off = ar * rb + x3_swz(bk, ar, ks * 2 + (lane >> 4)) * 16
                b_off = bm * rb + br * rb + x3_swz(bk, br, ks * 2 + ((lane >> 3) & 1)) * 16
                for i in range(wm // 16):
                    a = ldsm_x4(a_off + i * 16 * rb)
                    r_, k_ = wm0 + i * 16 + gq, ks * 8 + tq
                    want = [r_ * 1000 + k_, (r_ + 8) * 1000 + k_, r_ * 1000 + k_ + 4,
                            (r_ + 8) * 1000 + k_ + 4]
                    for got, exp in zip(a, want):
                        np.testing.assert_array_equal(got, exp)
                for jp in range(wn // 16):
                    b = ldsm_x4(b_off + jp * 16 * rb)
                    for half in range(2):
                        n_ = bm + wn0 + jp * 16 + half * 8 + gq
                        np.testing.assert_array_equal(b[2 * half], n_ * 1000 + ks * 8 + tq)
                        np.testing.assert_array_equal(b[2 * half + 1],
                                                      n_ * 1000 + ks * 8 + tq + 4)


@pytest.mark.parametrize("case", X3_CASES, ids=X3_IDS)
def test_x3_kernel_index_math_emulated(case, monkeypatch):
    """emulate_wgrad_x3 (every 3xTF32 config, the candidates' splits and splits of one or
    two k-tiles: chunks ending inside a k-tile and inside an image) rebuilds the reference's
    grad_kernel."""
    rng = np.random.default_rng(13)
    g = geometry(case)
    go, x, w = (rng.standard_normal(s) for s in (g.out_shape, case[0], case[1]))
    ref = ref_backward(go, x, w, *case[2:])[1]
    for cfg in bc.WGRAD_X3_CONFIGS:
        for cap in (bc.X3_MAX_CHUNK, 24):
            monkeypatch.setattr(bc, "X3_MAX_CHUNK", cap)
            splits, chunk = bc.wgrad_split(g, {**cfg, "waves": 2}, 132)
            L = g.N * g.P * g.Q
            assert splits == -(-L // chunk) and (cap > 100 or L <= max(cap, cfg["bk"]) or
                                                  splits > 1)
            got = emulate_wgrad_x3(go, x, g, cfg, splits, chunk)
            np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12,
                                       err_msg=f"{cfg} cap {cap}")


def recording_math():
    """A RecordingMath (tests/helpers.py) that also takes what conv2d_backward's general path
    touches: per-call plans, prepared launches (not used), no direct launches; the
    auxiliary kernels (no THREADS define) with their AUX_BLOCK threads."""
    m = RecordingMath()
    m.plans = {}
    m.backend.prepare_launch = lambda *args: None
    m.backend.direct_launch = lambda device_id: False
    kernel = m.kernel

    def with_aux_block(template, device_id, **params):
        if template == bc.AUX_TEMPLATE:
            params = {**params, "block_size": bc.AUX_BLOCK}
        return kernel(template, device_id, **params)
    m.kernel = with_aux_block
    return m


@pytest.mark.parametrize("case", X3_CASES, ids=X3_IDS)
def test_x3_launches_recorded(case):
    """On a recording backend: each 3xTF32 config's wgrad program launches its kernel with
    the kernel's parameter formats and THREADS (the backend checks both) and these values:
    go, x, the partials (grad_kernel itself for one split), out_vec (Cg*R*S % 4 == 0 and an
    aligned output), the geometry, chunk, the tile counts and the split stride K*Cg*R*S; a
    grid of splits * row tiles * column tiles blocks over the groups, covering Kg, Cg*R*S
    and the pixels; then splitk_sum over the splits. conv2d_backward's float32 path asks the
    autotuner about the 3xTF32 configs first ('conv2d_wgrad_x3'), 'ieee' and bfloat16 about
    the SIMT ones alone ('conv2d_wgrad')."""
    m = recording_math()
    g = geometry(case)
    CRS, L = g.Cg * g.R * g.S, g.N * g.P * g.Q
    go, x, w = (m.backend.empty(s, DT.FLOAT32) for s in (g.out_shape, case[0], case[1]))
    for cfg in bc.WGRAD_X3_CONFIGS:
        for waves in (1, 2, 4):
            wcfg = {**cfg, "waves": waves}
            m.backend.launches.clear()
            prog = bp.build_program(m, g, DT.FLOAT32, None, 0, ("wgrad",), None, wcfg)
            _, gw, _ = prog.run(m, go, x, w, direct=False)
            splits, chunk = bc.wgrad_split(g, wcfg, 132)
            mt, nt = -(-g.Kg // cfg["bm"]), -(-CRS // cfg["bn"])
            assert mt * cfg["bm"] >= g.Kg and nt * cfg["bn"] >= CRS
            assert splits * chunk >= L > (splits - 1) * chunk
            (k, grid, smem, values), *rest = m.backend.launches
            assert k.template == bc.WGRAD_X3_TEMPLATE
            assert {p: k.params[p] for p in cfg} == cfg
            assert grid == (splits * mt * nt, 1, g.groups)
            assert smem == bc.wgrad_shared_bytes(cfg)
            out = values[2]
            assert values[:2] == [go.ptr, x.ptr] and (out == gw.ptr) == (splits == 1)
            assert values[3:] == [int(CRS % 4 == 0), g.N, g.C, g.H, g.W, g.Cg, g.Kg, g.K,
                                  g.P, g.Q, g.R, g.S, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw,
                                  chunk, mt, nt, g.K * CRS]
            if splits == 1:
                assert rest == []
            else:
                (k2, _, _, v2), = rest
                assert k2.params["kind"] == "splitk_sum" and v2 == [out, gw.ptr, g.K * CRS,
                                                                    splits]
    cfg = config_of(case)
    for dtype, prec, op in ((DT.FLOAT32, None, "conv2d_wgrad_x3"),
                            (DT.FLOAT32, "tf32", "conv2d_wgrad_x3"),
                            (DT.FLOAT32, "ieee", "conv2d_wgrad"),
                            (DT.BFLOAT16, None, "conv2d_wgrad")):
        go, x, w = (m.backend.empty(s, dtype) for s in (g.out_shape, case[0], case[1]))
        m.picked = None
        _, gw, _ = cb.conv2d_backward(m, go, x, w, cfg, False, prec, (False, True, False))
        assert gw.shape == case[1] and gw.dtype is dtype
        name, cands = m.picked
        assert name == op and bc.wgrad_is_x3(cands[0]) == (op == "conv2d_wgrad_x3")
        k = next(k for k, *_ in m.backend.launches[::-1] if k.template.startswith("conv2d_wgrad"))
        assert k.template == (bc.WGRAD_X3_TEMPLATE if op.endswith("x3") else bc.WGRAD_TEMPLATE)


# -- GPU ----------------------------------------------------------------------------------------
EVERY_CONFIG_CASES = [CASES[0], CASES[3], CASES[6], CASES[8], CASES[10], CASES[11],
                      ((3, 33, 17, 15), (70, 33, 3, 3), (1, 1), (1, 1), (1, 1), 1)]


@gpu
@pytest.mark.parametrize("fam", ["fp32", "bf16"])
@pytest.mark.parametrize("case", EVERY_CONFIG_CASES,
                         ids=[f"{x}x{w}s{s}" for x, w, s, *_ in EVERY_CONFIG_CASES])
def test_gpu_every_config(apis, case, fam, monkeypatch):
    """Each dgrad config and each wgrad config (waves 1, 2, 4, splits allowed down to one
    k-tile, so small shapes split too): exact on integers, within the bounds on normals."""
    m, _ = apis
    monkeypatch.setattr(bc, "MIN_SPLIT_TILES", 1)
    dtype, prec = FAMILIES[fam]
    rng = np.random.default_rng(7)
    g = geometry(case)
    kcrs = bc.DGRAD_KCRS_CONFIGS if dtype is DT.FLOAT32 else ()
    runs = [("dgrad", c, None) for c in bc.DGRAD_CONFIGS + kcrs] + \
        [("wgrad", None, {**c, "waves": wv}) for c in bc.WGRAD_CONFIGS for wv in (1, 2, 4)]
    for ints in (True, False):
        (go, hgo), (x, hx), (w, hw) = operands(m, rng, case, dtype, ints)
        for part, dcfg, wcfg in runs:
            refs, bds = bounds(hgo, hx, hw, case, dtype, None,
                               wgrad_depth(g, [wcfg]) if wcfg else None, mma=False)
            prog = bp.build_program(m, g, dtype, prec, 0, (part,), dcfg, wcfg)
            gi, gw, _ = prog.run(m, go, x, w, direct=False)
            got, k = (gi, 0) if part == "dgrad" else (gw, 1)
            what = f"{part} {dcfg or wcfg} ints={ints}"
            if ints:
                np.testing.assert_array_equal(m.to_numpy(got).astype(np.float64),
                                              stored(refs[k], dtype), err_msg=what)
            else:
                check(m.to_numpy(got), refs[k], bds[k], what)
            free(gi, gw)
        free(go, x, w)


@gpu
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_gpu_plan_and_determinism(apis, fam):
    """The second call goes through the per-call plan; both give bit-identical results (the
    split-K and bias sums run in a fixed order)."""
    m, ml = apis
    dtype, prec = FAMILIES[fam]
    rng = np.random.default_rng(8)
    for case in (CASES[0], CASES[10], CASES[11]):
        (go, _), (x, _), (w, _) = operands(m, rng, case, dtype)
        cfg = config_of(case)
        key = ("conv2d_backward", go.shape, dtype, 0, x.shape, dtype, 0, w.shape, dtype, 0,
               ConvolutionConfig, cfg.kernel_size, cfg.stride, cfg.padding, cfg.dilation,
               cfg.groups, True, prec, None)
        m.plans.pop(key, None)
        first = ml.conv2d_backward(go, x, w, cfg, True, prec)
        assert key in m.plans
        again = call_through_plan(m, key, lambda: ml.conv2d_backward(go, x, w, cfg, True, prec))
        for a, b in zip(first, again):
            np.testing.assert_array_equal(m.to_numpy(a), m.to_numpy(b))
        free(go, x, w, *first, *again)


@gpu
@pytest.mark.large
def test_gpu_issue_shape(apis):
    """(32, 64, 128, 128) x (128, 64, 3, 3), padding 1, float32: 400 sampled elements of
    each gradient against float64 sums computed for them alone."""
    m, ml = apis
    rng = np.random.default_rng(9)
    case = ((32, 64, 128, 128), (128, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1)
    g = geometry(case)
    hgo = rng.standard_normal(g.out_shape).astype(np.float32).astype(np.float64)
    hx = rng.standard_normal(case[0]).astype(np.float32).astype(np.float64)
    hw = (rng.standard_normal(case[1]) / 24).astype(np.float32).astype(np.float64)
    go, x, w = (m.from_numpy(a.astype(np.float32)) for a in (hgo, hx, hw))
    gi, gw, gb = ml.conv2d_backward(go, x, w, config_of(case), True)
    gih, gwh, gbh = (m.to_numpy(t).astype(np.float64) for t in (gi, gw, gb))
    d_dg, d_wg, d_b = depths(g)
    gop = np.pad(hgo, ((0, 0), (0, 0), (1, 1), (1, 1)))   # grad_input: flipped taps, pad 1
    xp = np.pad(hx, ((0, 0), (0, 0), (1, 1), (1, 1)))
    for n, c, h, wc in zip(*(rng.integers(0, s, 400) for s in case[0])):
        terms = gop[n, :, h:h + 3, wc:wc + 3] * hw[:, c, ::-1, ::-1]
        ref, mag = terms.sum(), np.abs(terms).sum()
        assert abs(gih[n, c, h, wc] - ref) <= U * abs(ref) + d_dg * U * mag
    for k, c, r, s in zip(*(rng.integers(0, s, 400) for s in case[1])):
        terms = hgo[:, k] * xp[:, c, r:r + 128, s:s + 128]
        ref, mag = terms.sum(), np.abs(terms).sum()
        assert abs(gwh[k, c, r, s] - ref) <= U * abs(ref) + d_wg * U * mag
    ref = hgo.sum(axis=(0, 2, 3))
    assert (np.abs(gbh - ref) <= U * np.abs(ref) + d_b * U * np.abs(hgo).sum(axis=(0, 2, 3))).all()
    free(go, x, w, gi, gw, gb)


@gpu
def test_gpu_recovers_after_bad_input(apis):
    """A failed call (wrong grad_out shape) after a good one of the same geometry leaves the
    pool balanced and the next call's results right."""
    m, ml = apis
    case = CASES[8]
    rng = np.random.default_rng(10)
    (go, hgo), (x, hx), (w, hw) = operands(m, rng, case, DT.FLOAT32, ints=True)
    cfg = config_of(case)
    free(*ml.conv2d_backward(go, x, w, cfg, True))
    bad = m.from_numpy(np.ones((2, 9, 5, 5), np.float32))
    pool = m.backend.memory_pools[0]
    before = pool.get_stats()["active_memory"]
    with pytest.raises(ShapeMismatchError):
        ml.conv2d_backward(bad, x, w, cfg, True)
    assert pool.get_stats()["active_memory"] == before
    res = ml.conv2d_backward(go, x, w, cfg, True)
    for got, ref in zip(res, ref_backward(hgo, hx, hw, *case[2:])):
        np.testing.assert_array_equal(m.to_numpy(got).astype(np.float64), ref)
    free(go, x, w, bad, *res)


@gpu
@pytest.mark.parametrize("case", X3_CASES, ids=X3_IDS)
def test_gpu_every_x3_wgrad_config(apis, case, monkeypatch):
    """Each 3xTF32 wgrad config with waves 1, 2, 4 (splits allowed down to one k-tile), with
    the default chunk cap and with splits of at most 24 pixels: exact on small integers
    (their TF32 splits are exact), within U_OUT |ref| + x3_depth u (sum of |terms|) on
    normal draws, every element written (finite)."""
    m, _ = apis
    monkeypatch.setattr(bc, "MIN_SPLIT_TILES", 1)
    rng = np.random.default_rng(14)
    g = geometry(case)
    caps = (bc.X3_MAX_CHUNK, 24)
    for ints in (True, False):
        (go, hgo), (x, hx), (w, hw) = operands(m, rng, case, DT.FLOAT32, ints)
        ref = ref_backward(hgo, hx, hw, *case[2:])[1]
        mag = ref_backward(np.abs(hgo), np.abs(hx), np.abs(hw), *case[2:])[1]
        for cfg in bc.WGRAD_X3_CONFIGS:
            for waves in (1, 2, 4):
                for cap in caps:
                    monkeypatch.setattr(bc, "X3_MAX_CHUNK", cap)
                    wcfg = {**cfg, "waves": waves}
                    prog = bp.build_program(m, g, DT.FLOAT32, None, 0, ("wgrad",), None, wcfg)
                    _, gw, _ = prog.run(m, go, x, w, direct=False)
                    got = m.to_numpy(gw).astype(np.float64)
                    what = f"{wcfg} cap {cap} ints={ints}"
                    if ints:
                        np.testing.assert_array_equal(got, ref, err_msg=what)
                    else:
                        bound = U * np.abs(ref) + x3_depth(g, wcfg) * U * mag + \
                            ATOL[DT.FLOAT32]
                        check(got, ref, bound, what)
                    free(gw)
        free(go, x, w)


@gpu
def test_gpu_x3_wgrad_infinities(apis):
    """Infinite and NaN operands: every 3xTF32 config gives float32's answer (the big
    products' sum where it is not finite: inf, -inf or NaN as the float64 reference has
    them), the other elements exact (small integers)."""
    m, _ = apis
    case = X3_CASES[0]
    g = geometry(case)
    rng = np.random.default_rng(15)
    hgo = rng.integers(-1, 2, g.out_shape).astype(np.float64)
    hx = rng.integers(-2, 3, case[0]).astype(np.float64)
    hx[0, 1, 3, 4], hx[1, 2, 9, 9], hx[2, 4, 16, 0] = np.inf, -np.inf, np.nan
    hgo[2, 5, 8, 8] = np.inf
    go, x, w = (m.from_numpy(a.astype(np.float32)) for a in (hgo, hx, np.ones(case[1])))
    with np.errstate(invalid="ignore"):
        ref = ref_backward(hgo, hx, np.ones(case[1]), *case[2:])[1]
    assert np.isinf(ref).any() and np.isnan(ref).any() and np.isfinite(ref).any()
    for cfg in bc.WGRAD_X3_CONFIGS:
        prog = bp.build_program(m, g, DT.FLOAT32, None, 0, ("wgrad",), None,
                                {**cfg, "waves": 2})
        _, gw, _ = prog.run(m, go, x, w, direct=False)
        got = m.to_numpy(gw).astype(np.float64)
        np.testing.assert_array_equal(got, ref, err_msg=str(cfg))   # NaN where ref is NaN
        free(gw)
    free(go, x, w)


X3_DGRAD_CASES = [  # stride 1, K/groups >= 13 (the forward's 3xTF32 fits), odd sizes, and
    # K/groups * R * S > 288 (smaller ones take the dgrad kernel: bc.dgrad_kcrs_fits)
    CASES[10],
    ((2, 24, 9, 7), (40, 12, 5, 3), (1, 1), (2, 1), (1, 1), 2),
    ((2, 16, 8, 9), (296, 16, 1, 1), (1, 1), (0, 0), (1, 1), 1),
    ((3, 9, 11, 10), (33, 9, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((2, 10, 13, 12), (33, 10, 3, 3), (1, 1), (2, 2), (2, 2), 1),
    ((1, 8, 9, 11), (49, 8, 3, 2), (1, 1), (0, 1), (1, 1), 1),
]


@gpu
@pytest.mark.parametrize("forced", [False, True], ids=["tuned", "x3"])
def test_gpu_dgrad_default_precision_3xtf32(backend, tmp_path_factory, monkeypatch, forced):
    """float32 at the default precision, stride 1, where the forward's 3xTF32 configs fit:
    the data gradient runs through the forward (dgrad_path 'forward'), with the config the
    autotuner picks (tuned) or with the forward's candidates cut to its 3xTF32 ones (x3).
    Bound: the tensor-core paths' 2 d u (sum of |terms|) plus 3xTF32's 20 u per product and
    the last adds, (2 d + 24) u, with d = R*S*ceil(K/groups/8)*8 (the mma k-steps of 8);
    precision='ieee' runs the dgrad kernel, within its d u. Small integers: exact in both.
    A CudaMath of its own: the forced picks stay in its memos."""
    m = tuned_math(backend, tmp_path_factory)
    cv.warm_up(m, workers=16, dtypes=(DT.FLOAT32,))
    if forced:
        every = cc.candidates
        monkeypatch.setattr(cc, "candidates",
                            lambda *args: [c for c in every(*args) if c.get("x3")])
    rng = np.random.default_rng(11)
    for case in X3_DGRAD_CASES:
        g = geometry(case)
        assert bc.dgrad_path(g, DT.FLOAT32, None) == "forward"
        assert bc.dgrad_path(g, DT.FLOAT32, "ieee") == "simt"
        depth = g.R * g.S * -(-g.Kg // 8) * 8
        for ints in (False, True):
            (go, hgo), (x, hx), (w, hw) = operands(m, rng, case, DT.FLOAT32, ints)
            ref = ref_backward(hgo, hx, hw, *case[2:])[0]
            mag = ref_backward(np.abs(hgo), np.abs(hx), np.abs(hw), *case[2:])[0]
            for prec in (None, "ieee"):
                gi, _, _ = cb.conv2d_backward(m, go, x, w, config_of(case), False, prec,
                                              output_mask=(True, False, False))
                got = m.to_numpy(gi).astype(np.float64)
                if ints:
                    np.testing.assert_array_equal(got, ref, err_msg=f"{case} {prec} ints")
                else:
                    c = (2 * depth + 24) * U if prec is None else depths(g)[0] * U
                    check(got, ref, U * np.abs(ref) + c * mag + ATOL[DT.FLOAT32],
                          f"{case} {prec}")
                free(gi)
            free(go, x, w)
    if forced:
        picks = m.__dict__["_conv2d_configs"]
        assert picks and all(c.get("x3") for c in picks.values())
