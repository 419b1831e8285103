"""dropout: the Philox-4x32-10 generator against the Random123 known-answer vectors (NumPy and
the template's C code), the kernel's mask bit for bit against the NumPy generator (aligned,
misaligned and tail paths), the kept fraction within 3 sigma over 2^24+ elements,
reproducibility per seed, scaling, errors. GPU tests are marked `gpu`; the rest run in
whatever mode the backend is in (fallback here)."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples
from helpers import call_through_plan

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend.cuda_math import CudaMath
from cuda_backend.cuda_ml import CudaML
from cuda_backend.kernels import KernelGenerator
from cuda_backend.ops import dropout as dr
from cuda_backend.tensor import CudaTensor

FLOATS = [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16]
# Random123 kat_vectors, philox4x32 with 10 rounds: counter (4 words), key (2), result (4)
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.fixture(scope="module")
def m():
    return CudaMath()


def host_dtype(dtype):
    return np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype


def make(m, n, dtype, rng):
    t = m.from_numpy(rng.standard_normal(n).astype(host_dtype(dtype)) + 2.0, dtype=dtype)
    return t, m.to_numpy(t).astype(np.float64)


def check_values(out, a, keep, p, dtype, what=""):
    """out = a / p where kept, 0 where dropped; the scale is rounded once to the dtype."""
    out = out.astype(np.float64)
    ref = np.where(keep, a / p, 0.0)
    rtol = {DT.FLOAT32: 2e-7, DT.FLOAT64: 1e-15, DT.FLOAT16: 1e-3, DT.BFLOAT16: 8e-3}[dtype]
    np.testing.assert_array_equal(out[~keep], 0.0, err_msg=what)
    np.testing.assert_allclose(out[keep], ref[keep], rtol=rtol, err_msg=what)


# -- the generator ------------------------------------------------------------------------
def test_philox_numpy_known_answers():
    for ctr, key, want in KAT:
        got = dr.philox4x32_10_raw(*ctr, *key)
        assert tuple(int(v) for v in got) == want


def test_philox_template_known_answers(tmp_path):
    """The template's philox4x32_10 is __host__ __device__: compile it for the host with
    nvcc and check the known answers (no GPU needed)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    gen = KernelGenerator(backend=object())
    _, src = gen.render_kernel("dropout.cu.j2", **dr._params(DT.FLOAT32))
    calls = "\n".join(
        f"    philox4x32_10({', '.join(hex(c) + 'u' for c in ctr)}, "
        f"{', '.join(hex(k) + 'u' for k in key)}, r);\n"
        f'    printf("%08x %08x %08x %08x\\n", r[0], r[1], r[2], r[3]);'
        for ctr, key, _ in KAT)
    main = f"#include <cstdio>\n{src}\nint main() {{\n    unsigned int r[4];\n{calls}\n" \
           f"    return 0;\n}}\n"
    cu = tmp_path / "philox_kat.cu"
    cu.write_text(main)
    exe = tmp_path / "philox_kat"
    build = subprocess.run([nvcc, "-arch=sm_90", "-o", str(exe), str(cu)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    lines = run.stdout.split()
    want = [f"{w:08x}" for _, _, res in KAT for w in res]
    assert lines == want


def test_mask_layout_and_statistics():
    """Element i uses word i % 4 of counter i / 4; the kept fraction is near keep_prob."""
    seed = 0x123456789ABCDEF0
    n = 1 << 18
    words = dr.philox4x32_10(np.arange(n // 4, dtype=np.uint64), seed).reshape(-1)
    for p in (0.1, 0.5, 0.9):
        keep = dr.host_mask(n, p, seed)
        np.testing.assert_array_equal(keep, words.astype(np.uint64) < dr.threshold_for(p))
        sigma = np.sqrt(n * p * (1 - p))
        assert abs(keep.sum() - n * p) < 4 * sigma
    assert dr.threshold_for(1.0) == 1 << 32
    assert dr.threshold_for(0.5) == 1 << 31
    assert dr.threshold_for(1e-12) == 1
    # a tail shorter than a counter block is the prefix of the longer mask
    np.testing.assert_array_equal(dr.host_mask(7, 0.5, 9), dr.host_mask(16, 0.5, 9)[:7])


# -- GPU -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("return_mask", [False, True], ids=["out", "mask"])
def test_second_call_takes_the_plan(m, dtype, return_mask):
    """CudaML.dropout twice on fresh inputs of odd shapes with fresh seeds: the second call
    goes through the plan the first made (the seed is its argument), and both give the NumPy
    generator's mask and values."""
    ml = CudaML(m)
    rng = np.random.default_rng(24)
    for shape in [(1001,), (3, 7, 5), (17, 129)]:
        n = int(np.prod(shape))
        key = ("dropout", shape, dtype, 0, 0.7, return_mask)
        m.plans.pop(key, None)
        for second in (False, True):
            x = m.from_numpy(rng.standard_normal(shape).astype(host_dtype(dtype)) + 2.0,
                             dtype=dtype)
            a = m.to_numpy(x).astype(np.float64).reshape(-1)
            seed = int(rng.integers(0, 2**63))
            call = lambda: ml.dropout(x, 0.7, seed, return_mask)  # noqa: E731
            res = call_through_plan(m, key, call) if second else call()
            assert key in m.plans
            y, mk = res if return_mask else (res, None)
            keep = dr.host_mask(n, 0.7, seed)
            assert y.shape == shape
            if mk is not None:
                np.testing.assert_array_equal(m.to_numpy(mk).reshape(-1), keep.astype(np.uint8))
            check_values(m.to_numpy(y).reshape(-1), a, keep, 0.7, dtype,
                         f"{shape} second={second}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_mask_matches_numpy_generator(m, dtype):
    """The kernel reproduces the NumPy generator bit for bit: tails of every length, chunk
    boundaries, several probabilities and 64-bit seeds; outputs are poisoned first."""
    rng = np.random.default_rng(6334)
    for n in [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 1000, 1001, 4099, (1 << 20) + 3]:
        x, a = make(m, n, dtype, rng)
        for p in (0.1, 0.5, 0.9):
            seed = int(rng.integers(0, 2**63)) * 2 + 1
            out = m.from_numpy(np.full(n, np.nan, host_dtype(dtype)), dtype=dtype)
            mask = m.from_numpy(np.full(n, 7, np.uint8))
            dr.dropout(m, x, p, seed, True, out=out, mask=mask)
            keep = dr.host_mask(n, p, seed)
            got = m.to_numpy(mask)
            np.testing.assert_array_equal(got, keep.astype(np.uint8), err_msg=f"n={n} p={p}")
            check_values(m.to_numpy(out), a, keep, p, dtype, f"n={n} p={p}")
            out.free(), mask.free()
        x.free()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_misaligned_gives_the_same_mask(m, dtype):
    """Element-by-element path (a view one element off 16-byte alignment): the mask depends
    only on (seed, index)."""
    rng = np.random.default_rng(1290)
    n = 4099
    base, b = make(m, n + 1, dtype, rng)
    x = CudaTensor((n,), dtype, base.device_id, base.ptr + dtype.itemsize, owner=base)
    y, mask = dr.dropout(m, x, 0.3, 77, True)
    keep = dr.host_mask(n, 0.3, 77)
    np.testing.assert_array_equal(m.to_numpy(mask), keep.astype(np.uint8))
    check_values(m.to_numpy(y), b[1:], keep, 0.3, dtype)
    y2 = dr.dropout(m, x, 0.3, 77)  # without a mask: same output
    np.testing.assert_array_equal(m.to_numpy(y2), m.to_numpy(y))
    base.free()


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.5, 0.9, 0.2])
def test_statistics_and_seeds(m, p):
    """Over 2^24 + 3 elements the kept fraction is within 3 sigma of keep_prob; the same
    seed gives the same mask, another seed (or seed=None) a different one."""
    ml = CudaML(m)
    n = (1 << 24) + 3
    x = m.from_numpy(np.ones(n, np.float32))
    y1, m1 = ml.dropout(x, keep_prob=p, seed=2024, return_mask=True)
    k1 = m.to_numpy(m1)
    sigma = np.sqrt(n * p * (1 - p))
    assert abs(int(k1.sum()) - n * p) < 3 * sigma, (int(k1.sum()), n * p, sigma)
    assert set(np.unique(k1)) <= {0, 1} and m1.dtype is DT.UINT8
    np.testing.assert_array_equal(m.to_numpy(y1), np.where(k1 == 1, np.float32(1 / p), 0))
    _, m2 = ml.dropout(x, keep_prob=p, seed=2024, return_mask=True)
    np.testing.assert_array_equal(m.to_numpy(m2), k1)
    _, m3 = ml.dropout(x, keep_prob=p, seed=2025, return_mask=True)
    k3 = m.to_numpy(m3)
    assert (k3 != k1).mean() > 0.5 * 2 * p * (1 - p)  # independent masks differ that often
    _, m4 = ml.dropout(x, keep_prob=p, return_mask=True)
    _, m5 = ml.dropout(x, keep_prob=p, return_mask=True)
    assert not np.array_equal(m.to_numpy(m4), m.to_numpy(m5))
    # neighbouring elements are not correlated (lanes of one counter, and counters)
    a = k1[: n - 1].astype(np.float64)
    c = np.corrcoef(a[:-1], a[1:])[0, 1]
    assert abs(c) < 5 / np.sqrt(n)
    for t in (x, y1, m1, m2, m3, m4, m5):
        t.free()


@pytest.mark.gpu
def test_nan_inputs_stay_nan_when_dropped(m):
    """x * mask * scale, as PyTorch: a dropped NaN stays NaN, a dropped finite value is 0."""
    n = 4096
    a = np.full(n, np.nan, np.float32)
    x = m.from_numpy(a)
    y = m.to_numpy(dr.dropout(m, x, 0.5, 5))
    assert np.isnan(y).all()


@pytest.mark.gpu
@settings(max_examples=examples(40), deadline=None)
@given(n=st.integers(1, 5000), p=st.floats(0.01, 1.0), seed=st.integers(0, 2**64 - 1),
       dtype=st.sampled_from(FLOATS))
def test_property(m, n, p, seed, dtype):
    x, a = make(m, n, dtype, np.random.default_rng(5282))
    y, mask = dr.dropout(m, x, p, seed, True)
    keep = dr.host_mask(n, p, seed) if p < 1.0 else np.ones(n, bool)
    np.testing.assert_array_equal(m.to_numpy(mask), keep.astype(np.uint8))
    check_values(m.to_numpy(y), a, keep, p, dtype)
    x.free(), y.free(), mask.free()


# -- any mode (fallback here) ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_api_reproducible(m, dtype):
    ml = CudaML(m)
    rng = np.random.default_rng(1206)
    x, a = make(m, 105, dtype, rng)
    y, mask = ml.dropout(x, keep_prob=0.7, seed=11, return_mask=True)
    keep = dr.host_mask(105, 0.7, 11)
    np.testing.assert_array_equal(m.to_numpy(mask), keep.astype(np.uint8))
    check_values(m.to_numpy(y), a, keep, 0.7, dtype)
    np.testing.assert_array_equal(m.to_numpy(ml.dropout(x, 0.7, 11)), m.to_numpy(y))


def test_shapes_are_kept(m):
    x = m.from_numpy(np.random.default_rng(5841).standard_normal((3, 5, 7)).astype(np.float32))
    y, mask = dr.dropout(m, x, 0.5, 1, True)
    assert y.shape == (3, 5, 7) and mask.shape == (3, 5, 7)
    keep = dr.host_mask(105, 0.5, 1).reshape(3, 5, 7)
    np.testing.assert_array_equal(m.to_numpy(mask), keep.astype(np.uint8))


def test_keep_prob_one_is_a_copy(m):
    a = np.random.default_rng(53).standard_normal(37).astype(np.float32)
    x = m.from_numpy(a)
    y, mask = dr.dropout(m, x, 1.0, None, True)
    assert y is not x
    np.testing.assert_array_equal(m.to_numpy(y), a)
    np.testing.assert_array_equal(m.to_numpy(mask), np.ones(37, np.uint8))
    np.testing.assert_array_equal(m.to_numpy(dr.dropout(m, x, 1)), a)


def test_zero_size(m):
    x = m.from_numpy(np.ones((0, 4), np.float32))
    y, mask = dr.dropout(m, x, 0.5, 3, True)
    assert y.shape == (0, 4) and mask.shape == (0, 4)


def test_errors(m):
    x = m.from_numpy(np.ones(8, np.float32))
    for bad in (0, 0.0, -0.1, 1.5, float("nan"), float("inf")):
        with pytest.raises(cb.InvalidArgumentError, match=r"keep_prob must be in \(0, 1\]"):
            dr.dropout(m, x, bad)
    for bad in ("0.5", None, True):
        with pytest.raises(cb.InvalidArgumentError, match="keep_prob"):
            dr.dropout(m, x, bad)
    for bad in (1.5, "7", True):
        with pytest.raises(cb.InvalidArgumentError, match="seed"):
            dr.dropout(m, x, 0.5, bad)
    with pytest.raises(cb.DTypeMismatchError, match="int32"):
        dr.dropout(m, m.from_numpy(np.ones(4, np.int32)), 0.5)
    with pytest.raises(cb.InvalidArgumentError, match="CudaTensor"):
        dr.dropout(m, np.ones(4, np.float32), 0.5)
    with pytest.raises(cb.InvalidArgumentError, match=r"keep_prob"):
        CudaML(m).dropout(x, keep_prob=2.0)


def test_keep_prob_below_what_the_32_bit_threshold_represents_is_refused(m):
    """The threshold round(keep_prob * 2^32) is off by up to 0.5, so the realized keep
    probability (and the output's mean, scaled by 1 / keep_prob) is off by up to
    0.5 / (keep_prob * 2^32) relatively: keep_prob >= 5000 / 2^32 keeps that under 1e-4.
    (keep_prob=1e-11 kept 2.3e-10 of the elements while scaling by 1e11.)"""
    x = m.from_numpy(np.ones(8, np.float32))
    assert dr.MIN_KEEP_PROB == 5000 / 2**32
    for bad in (1e-11, 2.0**-32, 1e-7, np.nextafter(dr.MIN_KEEP_PROB, 0)):
        with pytest.raises(cb.InvalidArgumentError,
                           match=r"keep_prob must be >= 1\.1641532182693481e-06 \(5000 / 2\*\*32"):
            dr.dropout(m, x, bad)
    rng = np.random.default_rng(5)
    accepted = np.concatenate([[dr.MIN_KEEP_PROB, np.nextafter(dr.MIN_KEEP_PROB, 1), 0.5, 1.0],
                               10 ** rng.uniform(np.log10(dr.MIN_KEEP_PROB), 0, 2000)])
    for p in accepted:
        assert abs(dr.threshold_for(p) / 2**32 - p) <= 1e-4 * p, p
    for p in accepted[:3]:
        y = dr.dropout(m, x, float(p), seed=3)
        assert y.shape == x.shape


def test_negative_and_large_seeds_wrap_to_64_bits(m):
    x = m.from_numpy(np.ones(64, np.float32))
    _, a = dr.dropout(m, x, 0.5, -1, True)
    _, b = dr.dropout(m, x, 0.5, 2**64 - 1, True)
    np.testing.assert_array_equal(m.to_numpy(a), m.to_numpy(b))


# -- dropout_backward ---------------------------------------------------------------------
def expected_backward(g, keep, p, dtype):
    """grad_out * (keep ? 1/keep_prob : 0) as the kernel computes it: in float32 (float64
    for float64) with the scale rounded to that type, then rounded once to the dtype."""
    work = np.float64 if dtype is DT.FLOAT64 else np.float32
    with np.errstate(invalid="ignore"):
        v = g.astype(work) * np.where(keep, work(1.0 / p), work(0))
    if dtype is DT.BFLOAT16:
        return cb.from_bfloat16_bits(cb.to_bfloat16_bits(v)).astype(np.float64)
    return v.astype(dtype.numpy_dtype).astype(np.float64)


def same_bits(a, b, what=""):
    """Equal values, NaN where NaN, and the same sign of zero (a NaN's sign is the
    platform's: the GPU's default NaN is positive, x86's negative)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_array_equal(a, b, err_msg=what)
    num = ~np.isnan(a)
    np.testing.assert_array_equal(np.signbit(a[num]), np.signbit(b[num]), err_msg=what)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_backward_is_grad_times_the_forward_mask(m, dtype):
    """dropout_backward(g, p, seed) = g * mask / p bit for bit, the mask being the one
    dropout(x, p, seed, return_mask=True) returned (odd shapes, several probabilities and
    64-bit seeds, keep_prob 1), and equal to dropout(g, p, seed)."""
    ml = CudaML(m)
    rng = np.random.default_rng(31)
    for shape in [(1,), (7,), (3, 5, 7), (17, 129), (2, 3, 4, 5)]:
        for p in (0.1, 0.5, 0.9, 1.0):
            seed = int(rng.integers(0, 2**63)) * 2 + 1
            x, _ = make(m, int(np.prod(shape)), dtype, rng)
            x = m.reshape(x, shape)
            g = m.from_numpy(rng.standard_normal(shape).astype(host_dtype(dtype)), dtype=dtype)
            hg = m.to_numpy(g).astype(np.float64)
            _, mask = ml.dropout(x, p, seed, return_mask=True)
            keep = m.to_numpy(mask).astype(bool)
            dx = ml.dropout_backward(g, p, seed)
            assert dx.shape == shape and dx.dtype is dtype
            got = m.to_numpy(dx).astype(np.float64)
            what = f"{shape} p={p}"
            same_bits(got, expected_backward(hg, keep, p, dtype), what)
            assert np.all(got[~keep] == 0), what
            same_bits(got, m.to_numpy(ml.dropout(g, p, seed)).astype(np.float64), what)


def test_backward_nan_and_inf_gradients(m):
    """A dropped NaN or inf gradient gives NaN (g * 0, as PyTorch's grad * mask * scale); a
    kept one stays NaN or inf."""
    ml = CudaML(m)
    n = 64
    g = np.tile(np.array([np.nan, np.inf, -np.inf, 1.5], np.float32), n // 4)
    keep = dr.host_mask(n, 0.5, 9)
    got = m.to_numpy(ml.dropout_backward(m.from_numpy(g), 0.5, 9)).astype(np.float64)
    same_bits(got, expected_backward(g.astype(np.float64), keep, 0.5, DT.FLOAT32))
    assert np.isnan(got[~keep & ~np.isfinite(g)]).all()


def test_backward_against_torch(m):
    """torch.ops.aten.native_dropout_backward(grad, mask, 1 / keep_prob) on the forward's
    mask, float32 and float64 on the CPU: the same bits."""
    torch = pytest.importorskip("torch")
    ml = CudaML(m)
    rng = np.random.default_rng(32)
    for dtype, tdt in ((DT.FLOAT32, torch.float32), (DT.FLOAT64, torch.float64)):
        for p in (0.3, 0.5, 0.8):
            g = rng.standard_normal((5, 33)).astype(dtype.numpy_dtype)
            keep = dr.host_mask(g.size, p, 77).reshape(g.shape)
            want = torch.ops.aten.native_dropout_backward(
                torch.from_numpy(g).to(tdt), torch.from_numpy(keep), 1.0 / p).numpy()
            got = m.to_numpy(ml.dropout_backward(m.from_numpy(g), p, 77))
            same_bits(got, want, f"{dtype.name_str} p={p}")


def test_backward_zero_size_and_plain_seed_types(m):
    ml = CudaML(m)
    assert ml.dropout_backward(m.from_numpy(np.ones((0, 4), np.float32)), 0.5, 3).shape == (0, 4)
    g = m.from_numpy(np.ones(16, np.float32))
    a = m.to_numpy(ml.dropout_backward(g, 0.5, 5))
    same_bits(m.to_numpy(ml.dropout_backward(g, np.float64(0.5), np.int64(5))), a)
    same_bits(m.to_numpy(ml.dropout_backward(g, 0.5, 5 + 2**64)), a)   # wraps as forward


def test_backward_errors(m):
    ml = CudaML(m)
    g = m.from_numpy(np.ones(8, np.float32))
    for bad in (None, 1.5, "7", True):
        with pytest.raises(cb.InvalidArgumentError,
                           match=r"dropout_backward needs the seed the forward dropout drew"):
            ml.dropout_backward(g, 0.5, bad)
    for bad in (0, 1.5, float("nan"), "0.5", None):
        with pytest.raises(cb.InvalidArgumentError, match="keep_prob"):
            ml.dropout_backward(g, bad, 1)
    with pytest.raises(cb.DTypeMismatchError, match="dropout_backward does not support int32"):
        ml.dropout_backward(m.from_numpy(np.ones(4, np.int32)), 0.5, 1)
    with pytest.raises(cb.InvalidArgumentError, match="grad_out must be a CudaTensor"):
        ml.dropout_backward(np.ones(4, np.float32), 0.5, 1)
    f = m.from_numpy(np.ones(4, np.float32))
    f.free()
    with pytest.raises(cb.TensorFreedError):
        ml.dropout_backward(f, 0.5, 1)
    assert m.to_numpy(ml.dropout_backward(g, 0.5, 1)).shape == (8,)   # still usable


BACKWARD_STUB_SCRIPT = r'''
    ml = CudaML(m)
    rng = np.random.default_rng(0)
    for shape, dt in (((1024,), np.float32), ((3, 333), np.float16), ((7,), np.float64)):
        G = m.from_numpy(rng.standard_normal(shape).astype(dt))
        for keep in (0.5, 0.9):
            # the forward's launch on G (no mask), then the backward's general path and plan
            m.plans.pop(("dropout", G.shape, G.dtype, 0, keep, False), None)
            launches.clear()
            ml.dropout(G, keep, 12345).free()
            forward = list(launches)
            key = ("dropout_backward", G.shape, G.dtype, 0, keep)
            m.plans.pop(key, None)
            launches.clear()
            r1 = ml.dropout_backward(G, keep, 12345)
            assert launches == forward and key in m.plans
            want = slots(r1)
            r1.free()
            plan, seen = m.plans[key], []
            m.plans[key] = lambda *a: seen.append(plan(*a)) or seen[-1]
            launches.clear()
            r2 = ml.dropout_backward(G, keep, 12345)
            m.plans[key] = plan
            assert len(seen) == 1 and seen[0] is not None and launches == forward
            like_general(r2, want)
    # seeds the plan must not take: None (the backward needs the forward's), bool, NumPy
    G = m.from_numpy(np.ones(1024, np.float32))
    ml.dropout_backward(G, 0.5, 1)
    for bad in (None, True, 1.0):
        with pytest.raises(InvalidArgumentError, match="needs the seed"):
            ml.dropout_backward(G, 0.5, bad)
    launches.clear()
    ml.dropout_backward(G, 0.5, np.int64(1))
    assert len(launches) == 1
    print("OK")
'''


def test_backward_plan_on_a_stubbed_driver():
    """With PyCUDA replaced by perf/bench_host_path.py's stubs (tests/test_host_path.py's
    harness): dropout_backward launches exactly the forward's kernel launch on grad_out,
    through its general path and through the plan that makes, and a seed of None, a bool or
    a float raises even with a plan in place."""
    from test_host_path import BACKEND, STUBS, run_script, script
    run_script(script(STUBS, "\n    from cuda_backend.cuda_ml import CudaML\n    from "
                      "cuda_backend.errors import InvalidArgumentError\n", BACKEND,
                      BACKWARD_STUB_SCRIPT))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_gpu_backward_takes_the_plan(m, dtype):
    """dropout_backward twice on fresh gradients of odd shapes with fresh seeds: the second
    call goes through the plan the first made (the seed is its argument); both are g times
    the forward kernel's mask over keep_prob, bit for bit."""
    ml = CudaML(m)
    rng = np.random.default_rng(33)
    for shape in [(1001,), (3, 7, 5), (17, 129), ((1 << 20) + 3,)]:
        n = int(np.prod(shape))
        key = ("dropout_backward", shape, dtype, 0, 0.7)
        m.plans.pop(key, None)
        for second in (False, True):
            g = m.from_numpy(rng.standard_normal(shape).astype(host_dtype(dtype)), dtype=dtype)
            hg = m.to_numpy(g).astype(np.float64)
            seed = int(rng.integers(0, 2**63))
            x = m.from_numpy(np.ones(shape, host_dtype(dtype)), dtype=dtype)
            _, mask = ml.dropout(x, 0.7, seed, return_mask=True)
            keep = m.to_numpy(mask).astype(bool)
            np.testing.assert_array_equal(keep.reshape(-1), dr.host_mask(n, 0.7, seed))
            call = lambda: ml.dropout_backward(g, 0.7, seed)  # noqa: E731
            dx = call_through_plan(m, key, call) if second else call()
            assert key in m.plans
            same_bits(m.to_numpy(dx), expected_backward(hg, keep, 0.7, dtype),
                      f"{shape} second={second}")
            for t in (g, x, mask, dx):
                t.free()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_gpu_backward_misaligned_gradient(m, dtype):
    """A gradient one element past 16-byte alignment (the element path): the same mask."""
    ml = CudaML(m)
    rng = np.random.default_rng(34)
    n = 4099
    base, b = make(m, n + 1, dtype, rng)
    g = CudaTensor((n,), dtype, base.device_id, base.ptr + dtype.itemsize, owner=base)
    got = m.to_numpy(ml.dropout_backward(g, 0.3, 77))
    same_bits(got, expected_backward(b[1:], dr.host_mask(n, 0.3, 77), 0.3, dtype))
    base.free()


def test_template_variants():
    v = dr.template_variants()["dropout.cu.j2"]
    assert [p["dtype"] for p in v] == [d.name_str for d in FLOATS]
    assert all(p["vec"] * DT.from_any(p["dtype"]).itemsize == 16 for p in v)

