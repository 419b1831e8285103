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
from helpers import call_through_plan, check_finite as check, make, tuned_math

from cuda_backend import (CudaDataType as DT, DTypeMismatchError, InvalidArgumentError,
                          ShapeMismatchError, TensorFreedError)
from cuda_backend.cuda_ml import ConvolutionConfig, CudaML
from cuda_backend.driver import load_driver
from cuda_backend.dtypes import from_bfloat16_bits, to_bfloat16_bits
from cuda_backend.ops import conv2d as cv
from cuda_backend.ops import conv2d_backward as cb

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
    return cv.plan(case[0], case[1], config_of(case))


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


def wgrad_depth(g, cfgs=None):
    """Sequential adds behind a grad_kernel element: a split's pixels, then the splits in
    order; the largest over the configs (default: the autotuner's candidates)."""
    cfgs = cfgs or cb.candidates(g, sm_count(), "wgrad")
    return max(sum(cb.wgrad_split(g, c, sm_count())[::-1]) for c in cfgs)


def bias_depth(g):
    """Sequential adds behind a grad_bias element: a thread's share of a chunk (4 running sums
    over its rows, up to 3 more per row in the tail loop), 2 to join them, 5 + 3 shuffle
    levels, then the chunks in order."""
    chunks, chunk = cb.bias_chunks(g, sm_count())
    rows = -(-chunk // (g.P * g.Q)) + 1
    return -(-chunk // 256) + 3 * rows + 10 + chunks


def depths(g):
    """Terms summed in sequence behind one output: dgrad (a slice's tiles, then the slices),
    wgrad, bias (see the helpers above)."""
    return g.Kg * g.R * g.S + 8, wgrad_depth(g), bias_depth(g)


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
    if not GPU or cb.dgrad_path(g, dtype, prec) != "forward":
        return False
    g2 = cv.plan(g.out_shape, (g.C, g.Kg, g.R, g.S), ConvolutionConfig(
        kernel_size=(g.R, g.S), padding=(g.dh * (g.R - 1) - g.ph, g.dw * (g.S - 1) - g.pw),
        dilation=(g.dh, g.dw), groups=g.groups))
    return cv.family(g2, dtype, prec) == "mma"


def bounds(go, x, w, case, dtype, prec, d_wg=None, mma=None):
    """(references, per-element bounds) of (grad_input, grad_kernel, grad_bias) for these
    stored operands; d_wg: wgrad's depth when one config is run; mma: whether dgrad runs on
    tensor cores (default: as the op chooses)."""
    g = geometry(case)
    refs = ref_backward(go, x, w, *case[2:])
    mags = ref_backward(np.abs(go), np.abs(x), np.abs(w), *case[2:])
    d_dg, d_wg_any, d_b = depths(g)
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
    for cfg in cb.DGRAD_CONFIGS:
        tx, ty = cfg["bn"] // cfg["tn"], cfg["bm"] // cfg["tm"]
        st = tx * ty
        wx = min(tx, 8)
        assert st % 32 == 0 and tx % wx == 0 and ty % (32 // wx) == 0
        assert st % cfg["bm"] == 0 and cfg["bk"] % (st // cfg["bm"]) == 0
        assert cb.dgrad_threads(cfg) <= 256 and cb.dgrad_shared_bytes(cfg) <= 227 * 1024
    for cfg in cb.WGRAD_CONFIGS:
        tx, ty = cfg["bn"] // cfg["tn"], cfg["bm"] // cfg["tm"]
        threads, wx = tx * ty, min(tx, 8)
        mq = threads // cfg["bk"]
        assert threads % 32 == 0 and tx % wx == 0 and ty % (32 // wx) == 0
        assert cfg["bk"] % 8 == 0 and (threads // 32) % (cfg["bk"] // 8) == 0
        assert cfg["bm"] % mq == 0 and cfg["bn"] % mq == 0 and mq % 4 == 0
        assert cb.wgrad_shared_bytes(cfg) <= 227 * 1024
    variants = cb.template_variants()
    assert len(variants[cb.DGRAD_TEMPLATE]) == 3 * len(cb.DGRAD_CONFIGS)
    assert len(variants[cb.WGRAD_TEMPLATE]) == len(cb.WGRAD_CONFIGS)
    assert {p["kind"] for p in variants[cb.AUX_TEMPLATE]} == set(cb.AUX_KINDS)
    for case in CASES + [((32, 64, 128, 128), (128, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1)]:
        g = geometry(case)
        for sms in (1, 7, 132):
            assert all(c in cb.DGRAD_CONFIGS for c in cb.candidates(g, sms, "dgrad"))
            for c in cb.candidates(g, sms, "wgrad"):
                assert {k: v for k, v in c.items() if k != "waves"} in cb.WGRAD_CONFIGS
                splits, chunk = cb.wgrad_split(g, c, sms)
                L = g.N * g.P * g.Q
                assert chunk % c["bk"] == 0 and splits * chunk >= L > (splits - 1) * chunk
            chunks, chunk = cb.bias_chunks(g, sms)
            assert chunks * chunk >= g.N * g.P * g.Q > (chunks - 1) * chunk and chunks <= 65535


def test_phase_taps_against_brute_force():
    for stride in range(1, 5):
        for dil in range(1, 4):
            for size in range(1, 7):
                for a in range(stride):
                    taps = [r for r in range(size) if (a - r * dil) % stride == 0]
                    r0, step, out_step, count = cb.phase_taps(a, stride, dil, size)
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
            r0, rstep, pstep, Rv = cb.phase_taps(ah, g.sh, g.dh, g.R)
            s0, sstep, qstep, Sv = cb.phase_taps(aw, g.sw, g.dw, g.S)
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
    for cfg in (cb.W_16x64x8, cb.W_128x128x8):
        bk = cfg["bk"]
        dn, dp = bk // PQ, (bk - bk // PQ * PQ) // g.Q
        dq = bk - dn * PQ - dp * g.Q
        splits, chunk = cb.wgrad_split(g, {**cfg, "waves": 4}, 132)
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
    assert cb.dgrad_path(g1, DT.FLOAT32, None) == "forward"     # the direct kernel
    assert cb.dgrad_path(g3, DT.FLOAT32, None) == "simt"
    assert cb.dgrad_path(g3, DT.FLOAT32, "tf32") == "forward"
    assert cb.dgrad_path(g3, DT.BFLOAT16, None) == "forward"
    assert cb.dgrad_path(g2, DT.FLOAT16, None) == "simt"
    assert cb.dgrad_path(g4, DT.FLOAT16, None) == "simt"


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
    monkeypatch.setattr(cb, "MIN_SPLIT_TILES", 1)
    dtype, prec = FAMILIES[fam]
    rng = np.random.default_rng(7)
    g = geometry(case)
    runs = [("dgrad", c, None) for c in cb.DGRAD_CONFIGS] + \
        [("wgrad", None, {**c, "waves": wv}) for c in cb.WGRAD_CONFIGS for wv in (1, 2, 4)]
    for ints in (True, False):
        (go, hgo), (x, hx), (w, hw) = operands(m, rng, case, dtype, ints)
        for part, dcfg, wcfg in runs:
            refs, bds = bounds(hgo, hx, hw, case, dtype, None,
                               wgrad_depth(g, [wcfg]) if wcfg else None, mma=False)
            prog = cb.build_program(m, g, dtype, prec, 0, (part,), dcfg, wcfg)
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
