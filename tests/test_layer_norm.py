"""layer_norm over the last axis against a float64 NumPy reference: every float dtype, row
lengths around every register capacity (warp-per-row, block-per-row, persistent prefetching
blocks, looping kernel), with and without weight/bias, every configuration of the register
kernel, poisoned outputs, misaligned pointers, errors. GPU tests are marked `gpu`; the rest
run in whatever mode the backend is in (fallback here)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples
from helpers import call_through_plan

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend.cuda_math import CudaMath
from cuda_backend.cuda_ml import CudaML
from cuda_backend.ops import normalization as nm
from cuda_backend.ops import layer_norm_plans as lp
from cuda_backend.tensor import CudaTensor

FLOATS = [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16]
# per element: |out - ref| <= RTOL * (|x_hat w| + |b| + |w| (1 + |mean| / std)) with
# x_hat = (x - mean) / std: the last term is the row mean's rounding, seen through 1 / std
RTOL = {DT.FLOAT32: 1e-5, DT.FLOAT64: 1e-12, DT.FLOAT16: 2e-3, DT.BFLOAT16: 1e-2}
# float16 results below 2^-14 are subnormal: spaced 2^-24 apart whatever their size
FLOOR = {DT.FLOAT32: 1e-300, DT.FLOAT64: 1e-300, DT.FLOAT16: 2.0**-24, DT.BFLOAT16: 1e-300}
DIMS = [1, 2, 3, 5, 8, 31, 32, 127, 128, 129, 255, 256, 512, 513, 1000, 1023, 1024, 1025,
        2048, 3000, 4096, 4097, 8192, 12288, 16384, 32768, 40000, 70001]


@pytest.fixture(scope="module")
def m():
    return CudaMath()


def host_dtype(dtype):
    return np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype


def to_dev(m, values, dtype):
    t = m.from_numpy(np.asarray(values).astype(host_dtype(dtype)), dtype=dtype)
    return t, m.to_numpy(t).astype(np.float64)


def check(out, a, w, b, eps, dtype, what=""):
    mu = a.mean(axis=-1, keepdims=True)
    sd = np.sqrt(a.var(axis=-1, keepdims=True) + eps)
    xhat = (a - mu) / sd
    wv = np.ones(a.shape[-1]) if w is None else w
    bv = np.zeros(a.shape[-1]) if b is None else b
    ref = xhat * wv + bv
    bound = RTOL[dtype] * (np.abs(xhat * wv) + np.abs(bv) + np.abs(wv) * (1 + np.abs(mu) / sd)) \
        + FLOOR[dtype]
    out = out.astype(np.float64)
    assert out.shape == ref.shape, what
    assert np.all(np.isfinite(out)), what
    err = np.abs(out - ref)
    bad = err > bound
    assert not bad.any(), (what, int(bad.sum()), float(np.max(err / bound)))


def case(m, rows, D, dtype, rng, affine=(True, True), eps=1e-5, offset=0.5, cfg=None,
         max_grid=0):
    shape = rows + (D,) if isinstance(rows, tuple) else (rows, D)
    x, a = to_dev(m, rng.standard_normal(shape) * 2 + offset, dtype)
    wt, w = to_dev(m, rng.standard_normal(D), dtype) if affine[0] else (None, None)
    bt, b = to_dev(m, rng.standard_normal(D), dtype) if affine[1] else (None, None)
    out = m.from_numpy(np.full(shape, np.nan, host_dtype(dtype)), dtype=dtype)  # poison
    if cfg is None:
        nm.layer_norm(m, x, wt, bt, eps, out=out)
    else:
        lp.ln_launch(m, cfg, x, out, wt, bt, x.size // D, D, eps, max_grid)
    check(m.to_numpy(out), a, w, b, eps, dtype,
          f"{shape} {dtype.name_str} {affine} {cfg} grid<={max_grid}")
    for t in (x, wt, bt, out):
        if t is not None:
            t.free()


# -- GPU -------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_second_call_takes_the_plan(m, dtype):
    """CudaML.layer_norm twice on fresh inputs of odd shapes: the second call goes through
    the plan the first made, and both match the reference."""
    ml = CudaML(m)
    rng = np.random.default_rng(21)
    for shape, affine in (((7, 3, 129), (True, True)), ((5, 1000), (False, True)),
                          ((3, 4097), (True, False)), ((11, 33), (False, False))):
        D = shape[-1]
        key = ("layer_norm", shape, dtype, 0, 1e-5, not affine[0], not affine[1])
        m.plans.pop(key, None)
        for second in (False, True):
            x, a = to_dev(m, rng.standard_normal(shape) * 2 + 0.5, dtype)
            wt, w = to_dev(m, rng.standard_normal(D), dtype) if affine[0] else (None, None)
            bt, b = to_dev(m, rng.standard_normal(D), dtype) if affine[1] else (None, None)
            call = lambda: ml.layer_norm(x, wt, bt)  # noqa: E731
            y = call_through_plan(m, key, call) if second else call()
            assert key in m.plans
            check(m.to_numpy(y), a, w, b, 1e-5, dtype, f"{shape} {affine} second={second}")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_matches_numpy(m, dtype):
    rng = np.random.default_rng(9715)
    for D in DIMS:
        rows = max(1, min(37, (1 << 21) // D))
        case(m, rows, D, dtype, rng)
    for affine in [(False, False), (True, False), (False, True)]:
        case(m, (2, 3), 129, dtype, rng, affine)
        case(m, 9, 4096, dtype, rng, affine)


@pytest.mark.gpu
@pytest.mark.parametrize("vec", [True, False], ids=["vec", "scalar"])
def test_every_register_config_float32(m, vec):
    """Each (threads_per_row, vpt, block) configuration at full, partial and 1-vector rows."""
    rng = np.random.default_rng(1192)
    configs = lp.LN_VEC_CONFIGS if vec else lp.LN_SCALAR_CONFIGS
    v = 4 if vec else 1
    for tpr, vpt, block in configs:
        cap = tpr * vpt * v
        for D in sorted({cap, cap - v, cap // 2 + v, v}):
            case(m, 5, D, DT.FLOAT32, rng, cfg=(tpr, vpt, block, v, 0))
    for D in [v, 1000 * v, 9001 * v]:  # the looping kernel
        case(m, 3, D, DT.FLOAT32, rng, cfg=(lp.LN_LOOP_BLOCK, 0, lp.LN_LOOP_BLOCK, v, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_prefetch_configs(m, dtype):
    """Each persistent prefetching config at capacity - 1 vector, capacity and just over half
    of it, with 1, 2 and 3 blocks looping over 7 rows (both register sets, odd and even row
    counts per block), with and without weight and bias, and at its real grid over a little
    more than two rows per block."""
    rng = np.random.default_rng(2470)
    v = 16 // dtype.itemsize
    sms = m.backend.get_device_info(0).multiprocessor_count
    for tpr, vpt, block in lp.LN_PREFETCH_CONFIGS:
        cap = tpr * vpt * v
        cfg = (tpr, vpt, block, v, 1)
        for D in (cap - v, cap, cap // 2 + v):
            for grid in (1, 2, 3):
                case(m, 7, D, dtype, rng, cfg=cfg, max_grid=grid)
        case(m, 7, cap, dtype, rng, affine=(False, False), cfg=cfg, max_grid=2)
        case(m, 7, cap, dtype, rng, affine=(True, False), cfg=cfg, max_grid=3)
        resident = sms * lp.ln_params(dtype, tpr, vpt, block, v, True)["min_blocks"]
        case(m, 2 * resident + 1, cap - v, dtype, rng, cfg=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_every_candidate_at_boundaries(m, dtype):
    """Every candidate `ln_candidates` offers, at D = capacity - 1 vector, capacity,
    capacity + 1 vector of each block-per-row config (and primes, scalar configs)."""
    rng = np.random.default_rng(2272)
    v = 16 // dtype.itemsize
    dims = {1031, 4099, 8191}
    for tpr, vpt, _ in lp.LN_VEC_CONFIGS + lp.LN_PREFETCH_CONFIGS:
        if tpr > 32:
            cap = tpr * vpt * v
            dims |= {cap - v, cap, cap + v}
    for D in sorted(dims):
        use_vec = D % v == 0
        for cfg in lp.ln_candidates(D, dtype, use_vec):
            case(m, 5, D, dtype, rng, cfg=cfg, max_grid=2)


@pytest.mark.gpu
@pytest.mark.large
@pytest.mark.parametrize("shape", [(8192, 4096), (65536, 1024), (4, 262144)])
def test_large_float32(m, shape):
    case(m, shape[0], shape[1], DT.FLOAT32, np.random.default_rng(7057))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_misaligned_pointers(m, dtype):
    """x and out one element past a 16-byte boundary (wrapped views): the scalar kernels."""
    rng = np.random.default_rng(1209)
    for rows, D in [(3, 64), (5, 1000), (2, 4096), (2, 50000)]:
        n = rows * D
        base, bb = to_dev(m, rng.standard_normal(n + 1), dtype)
        x = CudaTensor((rows, D), dtype, base.device_id, base.ptr + dtype.itemsize, owner=base)
        obase = m.from_numpy(np.full(n + 1, np.nan, host_dtype(dtype)), dtype=dtype)
        out = CudaTensor((rows, D), dtype, obase.device_id, obase.ptr + dtype.itemsize,
                         owner=obase)
        wt, w = to_dev(m, rng.standard_normal(D), dtype)
        nm.layer_norm(m, x, wt, None, 1e-5, out=out)
        check(m.to_numpy(out), bb[1:].reshape(rows, D), w, None, 1e-5, dtype, f"{rows}x{D}")
        base.free(), obase.free(), wt.free()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT16], ids=lambda d: d.name_str)
def test_constant_rows_and_large_offsets(m, dtype):
    """A constant row has variance 0: y = bias exactly (no NaN); rows far from zero mean."""
    rng = np.random.default_rng(8160)
    D = 1024
    a = np.full((3, D), 7.25)
    x, _ = to_dev(m, a, dtype)
    bt, b = to_dev(m, rng.standard_normal(D), dtype)
    y = m.to_numpy(nm.layer_norm(m, x, None, bt, 1e-5)).astype(np.float64)
    np.testing.assert_allclose(y, np.broadcast_to(b, (3, D)), rtol=RTOL[dtype])
    case(m, 7, 2048, dtype, rng, offset=30.0)


@pytest.mark.gpu
@settings(max_examples=examples(40), deadline=None)
@given(rows=st.integers(1, 40), D=st.integers(1, 20000), dtype=st.sampled_from(FLOATS),
       affine=st.tuples(st.booleans(), st.booleans()),
       eps=st.sampled_from([1e-5, 1e-3, 0.5]))
def test_property(m, rows, D, dtype, affine, eps):
    case(m, rows, D, dtype, np.random.default_rng(7448), affine, eps)


# -- any mode (fallback here) ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_api_small(m, dtype):
    ml = CudaML(m)
    rng = np.random.default_rng(2593)
    for shape in [(1, 1), (3, 7), (2, 3, 129)]:
        D = shape[-1]
        x, a = to_dev(m, rng.standard_normal(shape), dtype)
        wt, w = to_dev(m, rng.standard_normal(D), dtype)
        bt, b = to_dev(m, rng.standard_normal(D), dtype)
        check(m.to_numpy(ml.layer_norm(x, wt, bt)), a, w, b, 1e-5, dtype, str(shape))
        check(m.to_numpy(ml.layer_norm(x, None, None, eps=1e-3)), a, None, None, 1e-3, dtype)


def test_candidates():
    """The register config chosen holds the row, and the tightest one is chosen."""
    for dtype in FLOATS:
        vec = 16 // dtype.itemsize
        for D in [1, vec, 100 * vec, 4096, 8192, 32768, 1 << 20]:
            for use_vec in (True, False):
                if use_vec and D % vec:
                    continue
                cands = lp.ln_candidates(D, dtype, use_vec)
                for tpr, vpt, block, v, pf in cands:
                    assert v == (vec if use_vec else 1)
                    assert vpt == 0 or tpr * vpt * v >= D
                    assert block % tpr == 0
                    assert not pf or (tpr == block and use_vec)
    assert lp.ln_candidates(4096, DT.FLOAT32, True) == [
        (128, 8, 128, 4, 0), (256, 4, 256, 4, 0), (512, 2, 512, 4, 0), (1024, 1, 1024, 4, 0),
        (256, 4, 256, 4, 1), (512, 2, 512, 4, 1)]
    assert lp.ln_candidates(1024, DT.FLOAT32, True) == [
        (32, 8, 256, 4, 0), (64, 4, 64, 4, 0), (128, 2, 128, 4, 0), (256, 1, 256, 4, 0)]
    assert lp.ln_candidates(4096, DT.BFLOAT16, True) == [
        (128, 4, 128, 8, 0), (256, 2, 256, 8, 0), (512, 1, 512, 8, 0), (128, 4, 128, 8, 1),
        (256, 2, 256, 8, 1)]
    assert lp.ln_candidates(1 << 20, DT.FLOAT32, True)[0][1] == 0


def test_small_inputs_pick_by_rows():
    """Under the autotuning size: block per row, 1 vector a thread under 1024 rows, 2 under
    4096, 4 beyond; 64-thread blocks only with 1 vector, a 1024-thread block with 1 vector
    only under 256 rows; warp per row where no block-per-row config holds the row with that
    few vectors; prefetching configs never (they need the autotuner's choice)."""
    def pick(D, dtype, rows):
        return lp.ln_small_pick(lp.ln_candidates(D, dtype, True), rows)
    assert [pick(1024, DT.FLOAT32, r)[:3] for r in (64, 1023, 1024, 4095, 4096)] == [
        (256, 1, 256), (256, 1, 256), (128, 2, 128), (128, 2, 128), (32, 8, 256)]
    assert pick(4096, DT.FLOAT32, 255)[:2] == (1024, 1)
    assert pick(4096, DT.FLOAT32, 256)[:2] == (512, 2)
    assert pick(8192, DT.FLOAT32, 64)[:2] == (1024, 2)
    assert pick(256, DT.FLOAT32, 512)[:3] == (64, 1, 64)
    assert pick(256, DT.FLOAT32, 2048)[:3] == (32, 2, 256)     # warp per row
    assert pick(768, DT.BFLOAT16, 2048)[:3] == (32, 4, 256)    # not 64 threads x 2
    assert pick(256, DT.BFLOAT16, 64)[:3] == (32, 1, 256)      # the only candidate
    for dtype in FLOATS:
        v = 16 // dtype.itemsize
        for D in (v, 100 * v, 1000, 4096, 8192, 12288):
            for rows in (1, 300, 3000, 30000):
                tpr, vpt, block, vec, pf = pick(D, dtype, rows)
                assert tpr * vpt * vec >= D and not pf and block % tpr == 0


def test_register_budgets():
    """Warp-per-row and looping kernels keep 1024 threads per SM; block-per-row ones fit
    their vectors (x2 with prefetch) in the register file; prefetch only with one row per
    block."""
    for dt in FLOATS:
        v = 16 // dt.itemsize
        for tpr, vpt, block in lp.LN_VEC_CONFIGS:
            p = lp.ln_params(dt, tpr, vpt, block, v)
            if tpr == 32:
                assert p["min_blocks"] == 1024 // block
            else:
                assert 65536 // (block * p["min_blocks"]) >= vpt * 4 + 16
        for tpr, vpt, block in lp.LN_PREFETCH_CONFIGS:
            assert tpr == block
            p = lp.ln_params(dt, tpr, vpt, block, v, True)
            assert p["prefetch"] and 65536 // (block * p["min_blocks"]) >= 2 * vpt * 4 + 16


def test_zero_size(m):
    for shape in [(0, 5), (3, 0), (2, 0, 4)]:
        x = m.from_numpy(np.ones(shape, np.float32))
        assert nm.layer_norm(m, x, None, None).shape == shape


def test_errors(m):
    x = m.from_numpy(np.ones((4, 6), np.float32))
    w5 = m.from_numpy(np.ones(5, np.float32))
    with pytest.raises(cb.ShapeMismatchError, match=r"weight has shape \(5,\).*\(6,\).*\(4, 6\)"):
        nm.layer_norm(m, x, w5, None)
    with pytest.raises(cb.ShapeMismatchError, match=r"bias has shape \(5,\)"):
        nm.layer_norm(m, x, None, w5)
    w64 = m.from_numpy(np.ones(6, np.float64))
    with pytest.raises(cb.DTypeMismatchError, match="float32 and float64"):
        nm.layer_norm(m, x, w64, None)
    with pytest.raises(cb.InvalidArgumentError, match="at least 1 dimension"):
        nm.layer_norm(m, m.from_numpy(np.array(1.0, np.float32)), None, None)
    with pytest.raises(cb.DTypeMismatchError, match="int64"):
        nm.layer_norm(m, m.from_numpy(np.ones((2, 2), np.int64)), None, None)
    with pytest.raises(cb.InvalidArgumentError, match="eps"):
        nm.layer_norm(m, x, None, None, eps=float("inf"))
    with pytest.raises(cb.InvalidArgumentError, match="CudaTensor"):
        nm.layer_norm(m, x, np.ones(6), None)
