"""softmax / log_softmax over the last axis against a stable float64 NumPy reference: every
float dtype, short (warp), register-block, shared-memory and online rows, every candidate
plan around the modes' boundaries, -inf/+inf/NaN rows, huge values, poisoned outputs,
misaligned pointers, errors; GPU tests are marked `gpu`, the rest run in whatever mode the
backend is in (fallback here) and test the mode planning."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend.cuda_math import CudaMath
from cuda_backend.ops import softmax as sm
from cuda_backend.tensor import CudaTensor

FLOATS = [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16]
SHAPES = [(1, 1), (3, 7), (5, 1023), (2, 3, 1025), (4, 4097), (64, 33000)]
# (rtol, atol) for softmax and for log_softmax (whose values grow with |x - max|)
TOL = {DT.FLOAT32: (1e-5, 1e-7), DT.FLOAT64: (1e-12, 1e-15), DT.FLOAT16: (1e-2, 1e-3),
       DT.BFLOAT16: (1e-2, 4e-3)}


@pytest.fixture(scope="module")
def m():
    return CudaMath()


def host_dtype(dtype):
    return np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype


def reference(a, log):
    """Stable float64 softmax: exp(x - max) / sum, log: (x - max) - log(sum)."""
    a = a.astype(np.float64)
    with np.errstate(all="ignore"):
        z = a - np.max(a, axis=-1, keepdims=True)
        s = np.sum(np.exp(z), axis=-1, keepdims=True)
        return z - np.log(s) if log else np.exp(z) / s


def check(out, a, dtype, log, what=""):
    ref = reference(a, log)
    out = out.astype(np.float64)
    assert out.shape == ref.shape
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref), err_msg=what)
    ok = np.isfinite(ref)
    np.testing.assert_array_equal(out[~ok], ref[~ok], err_msg=what)
    assert_close(out[ok], ref[ok], dtype, log, what)


def assert_close(out, ref, dtype, log, what=""):
    """|out - ref| <= rtol |ref| + atol; log-softmax values carry an absolute error that
    grows with |x - max|, so they get rtol |ref| more slack."""
    rtol, atol = TOL[dtype]
    bound = rtol * np.abs(ref) + (atol * 100 + rtol * np.abs(ref) if log else atol)
    err = np.abs(out - ref)
    bad = err > bound
    assert not np.any(bad), (what, int(bad.sum()), float(np.max(err - bound)))


def make(m, shape, dtype, rng, scale=3.0):
    t = m.from_numpy((rng.standard_normal(shape) * scale).astype(host_dtype(dtype)), dtype=dtype)
    return t, m.to_numpy(t)


def poisoned(m, shape, dtype):
    return m.from_numpy(np.full(shape, np.nan, host_dtype(dtype)), dtype=dtype)


# -- GPU -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_matches_numpy(m, dtype, log):
    rng = np.random.default_rng(620)
    shapes = SHAPES + [(7, 128), (9, 129), (33, 512), (6, 1024), (5, 2048), (3, 61000)]
    for shape in shapes:
        x, a = make(m, shape, dtype, rng)
        out = poisoned(m, shape, dtype)
        got = sm.softmax(m, x, log=log, out=out)
        assert got is out
        h = m.to_numpy(out)
        assert np.all(np.isfinite(h)), shape
        check(h, a, dtype, log, str(shape))
        if not log:
            np.testing.assert_allclose(h.astype(np.float64).sum(-1), 1.0,
                                       rtol=TOL[dtype][0] * 10 + 1e-6)
        x.free(), out.free()


@pytest.mark.gpu
@pytest.mark.large
@pytest.mark.parametrize("shape", [(65536, 1024), (8192, 4096)])
def test_large_float32(m, shape):
    rng = np.random.default_rng(4658)
    x, a = make(m, shape, DT.FLOAT32, rng)
    check(m.to_numpy(m.softmax(x)), a, DT.FLOAT32, False)
    check(m.to_numpy(m.log_softmax(x)), a, DT.FLOAT32, True)
    x.free()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_online_rows_longer_than_shared_memory(m, dtype):
    """Rows over ~227 KB take the two-read online path."""
    rng = np.random.default_rng(7653)
    K = (240 * 1024) // dtype.itemsize + 5
    assert sm.plan(K, dtype.itemsize, 227 * 1024)["mode"] == "online"
    x, a = make(m, (3, K), dtype, rng)
    for log in (False, True):
        check(m.to_numpy(sm.softmax(m, x, log=log)), a, dtype, log, f"K={K}")
    x.free()


BIG = {DT.FLOAT32: 3e38, DT.FLOAT64: 1e300, DT.FLOAT16: 6e4, DT.BFLOAT16: 3e38}


def special_rows(dtype, K, rng):
    """Rows: all -inf, one +inf, one NaN, every other -inf, huge values, one -inf."""
    a = rng.standard_normal((6, K))
    a[0, :] = -np.inf
    a[1, K // 2] = np.inf
    a[2, K - 1] = np.nan
    a[3, ::2] = -np.inf
    a[4, :] = BIG[dtype] * (1 - 0.05 * np.abs(a[4, :]) / (1 + np.abs(a[4, :])))
    a[5, 0] = -np.inf
    return a.astype(host_dtype(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
@pytest.mark.parametrize("K", [5, 300, 1023, 5000, 70000])
def test_special_values_like_numpy(m, dtype, K):
    """-inf rows -> NaN, +inf -> NaN row, NaN -> NaN row, -inf elements -> 0 (log: -inf),
    huge values do not overflow."""
    rng = np.random.default_rng(2982)
    x = m.from_numpy(special_rows(dtype, K, rng), dtype=dtype)
    h = m.to_numpy(x)
    for log in (False, True):
        out = m.to_numpy(sm.softmax(m, x, log=log)).astype(np.float64)
        ref = reference(h, log)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref), err_msg=f"log={log}")
        assert np.all(np.isnan(out[:3])), "rows of -inf only, with +inf or with NaN are NaN"
        assert not np.any(np.isnan(out[3:]))
        if log:
            assert np.all(np.isneginf(out[3, ::2])) and np.isneginf(out[5, 0])
        else:
            assert np.all(out[3, ::2] == 0) and out[5, 0] == 0
        ok = np.isfinite(ref)
        assert_close(out[ok], ref[ok], dtype, log, f"K={K} log={log}")
    x.free()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_misaligned_pointers(m, dtype):
    """Input and output one element past a 16-byte boundary (wrapped slices): every mode."""
    rng = np.random.default_rng(9473)
    for shape in [(3, 7), (5, 64), (4, 1000), (3, 4097), (2, 70000)]:
        n = int(np.prod(shape))
        base, b = make(m, (n + 1,), dtype, rng)
        x = CudaTensor(shape, dtype, base.device_id, base.ptr + dtype.itemsize, owner=base)
        a = b[1:].reshape(shape)
        obase = poisoned(m, (n + 2,), dtype)
        for shift in (1, 2):  # out congruent with x, and not
            out = CudaTensor(shape, dtype, obase.device_id, obase.ptr + shift * dtype.itemsize,
                             owner=obase)
            check(m.to_numpy(sm.softmax(m, x, out=out)), a, dtype, False, f"{shape} {shift}")
        base.free(), obase.free()


LIMIT = 227 * 1024 - 1024  # the smem limit plan() gets on Hopper


def boundary_lengths(itemsize):
    """Row lengths at and around every mode and block-config boundary, plus primes."""
    vec = 16 // itemsize
    caps = {32 * vec * sm.WARP_NV[-1]} | {blk * nv * vec for blk, nv, _ in sm.BLOCK_CONFIGS}
    ks = {1, 2, 3, 997, 1031, 2053, 4099, 8191, 16381}
    for c in caps:
        ks |= {c - 1, c, c + 1}
    return sorted(k for k in ks if k <= 1024 * 4 * vec + 1)


def run_candidate(m, p, x, log, out, max_grid=None):
    """One candidate plan, launched directly; max_grid caps a persistent grid so that each
    block loops over several rows (both prefetch buffers, odd and even row counts)."""
    q = sm.prepare(m, p, x.dtype, x.device_id)
    if max_grid is not None and q["max_grid"]:
        q["max_grid"] = max_grid
    sm.launch(m, q, x, out, log)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_every_candidate_at_boundaries(m, dtype):
    """Every plan `candidates` offers, at K = boundary - 1, boundary, boundary + 1 and primes,
    against float64 NumPy; outputs poisoned; persistent plans with 1, 2 and 3 blocks over 7
    rows; softmax and log_softmax."""
    rng = np.random.default_rng(820)
    for K in boundary_lengths(dtype.itemsize):
        x, a = make(m, (7, K), dtype, rng)
        for p in sm.candidates(K, dtype.itemsize, LIMIT):
            for log in (False, True):
                for max_grid in ((1, 2, 3) if p["prefetch"] else (None,)):
                    out = poisoned(m, (7, K), dtype)
                    run_candidate(m, p, x, log, out, max_grid)
                    check(m.to_numpy(out), a, dtype, log, f"K={K} {p} log={log} grid={max_grid}")
                    out.free()
        x.free()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_block_configs_misaligned_and_special(m, dtype):
    """Each block config at its full and near-empty capacity, with x one element past a
    16-byte boundary and out congruent with it (vectors after a head) or not (the scalar
    path), on rows holding -inf / +inf / NaN / huge values."""
    rng = np.random.default_rng(784)
    vec = 16 // dtype.itemsize
    for blk, nv, pf in sm.BLOCK_CONFIGS:
        p = {"mode": "block", "nv": nv, "group": 0, "threads": blk, "smem": 0, "prefetch": int(pf)}
        cap = blk * nv * vec
        for K in (cap, cap - 3, cap // 2 + 1):
            h = special_rows(dtype, K, rng)
            n = h.size
            base = m.from_numpy(np.concatenate([[0.0], h.ravel()]).astype(host_dtype(dtype)),
                                dtype=dtype)
            x = CudaTensor(h.shape, dtype, base.device_id, base.ptr + dtype.itemsize, owner=base)
            a = m.to_numpy(base)[1:].reshape(h.shape)
            obase = poisoned(m, (n + 2,), dtype)
            for shift in (1, 2):
                out = CudaTensor(h.shape, dtype, obase.device_id,
                                 obase.ptr + shift * dtype.itemsize, owner=obase)
                for log in (False, True):
                    run_candidate(m, p, x, log, out, max_grid=2)
                    o = m.to_numpy(out).astype(np.float64)
                    ref = reference(a, log)
                    what = f"{p} K={K} shift={shift} log={log}"
                    np.testing.assert_array_equal(np.isnan(o), np.isnan(ref), err_msg=what)
                    assert np.all(np.isnan(o[:3])), what
                    ok = np.isfinite(ref)
                    np.testing.assert_array_equal(o[~ok], ref[~ok], err_msg=what)
                    assert_close(o[ok], ref[ok], dtype, log, what)
            base.free(), obase.free()


@pytest.mark.gpu
@pytest.mark.large
@pytest.mark.parametrize("shape", [(4096, 8192), (1024, 16384), (2000, 4096)])
def test_large_block_rows_float32(m, shape):
    """The targets of block mode through the public path, and persistent plans over many
    rows at their real grid."""
    rng = np.random.default_rng(7128)
    x, a = make(m, shape, DT.FLOAT32, rng)
    check(m.to_numpy(m.softmax(x)), a, DT.FLOAT32, False, str(shape))
    for p in sm.candidates(shape[1], 4, LIMIT):
        if p["prefetch"]:
            out = poisoned(m, shape, DT.FLOAT32)
            check(m.to_numpy(run_candidate(m, p, x, True, out)), a, DT.FLOAT32, True,
                  f"{shape} {p}")
            out.free()
    x.free()


@pytest.mark.gpu
@settings(max_examples=examples(40), deadline=None)
@given(rows=st.integers(1, 50), K=st.integers(1, 6000), log=st.booleans(),
       dtype=st.sampled_from(FLOATS), scale=st.sampled_from([0.1, 3.0, 30.0]))
def test_property_rows(m, rows, K, log, dtype, scale):
    rng = np.random.default_rng(6720)
    x, a = make(m, (rows, K), dtype, rng, scale)
    check(m.to_numpy(sm.softmax(m, x, log=log)), a, dtype, log, f"{rows}x{K}")
    x.free()


# -- any mode: API, errors, edge shapes ----------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name_str)
def test_api_small(m, dtype):
    rng = np.random.default_rng(60)
    for shape in [(1, 1), (3, 7), (2, 3, 33), (7,)]:
        x, a = make(m, shape, dtype, rng)
        for log, fn in ((False, m.softmax), (True, m.log_softmax)):
            r = fn(x)
            assert r.shape == shape and r.dtype is dtype
            check(m.to_numpy(r), a, dtype, log, str(shape))


def test_edge_shapes(m):
    assert m.softmax(m.create_tensor((0, 5))).shape == (0, 5)
    assert m.log_softmax(m.create_tensor((3, 0), DT.FLOAT16)).shape == (3, 0)
    one = m.from_numpy(np.array(4.0, np.float32))
    assert m.softmax(one).shape == () and float(m.to_numpy(m.softmax(one))) == 1.0
    assert float(m.to_numpy(m.log_softmax(one))) == 0.0
    row = m.from_numpy(np.array([[-np.inf, -np.inf], [1.0, -np.inf]], np.float32))
    out = m.to_numpy(m.softmax(row))
    assert np.all(np.isnan(out[0])) and out[1].tolist() == [1.0, 0.0]


def test_errors(m):
    x = m.from_numpy(np.ones((3, 4), np.float32))
    for dtype in (DT.INT32, DT.INT64, DT.UINT8, DT.BOOL):
        with pytest.raises(cb.DTypeMismatchError,
                           match=f"softmax does not support {dtype.name_str}"):
            m.softmax(m.create_tensor((2, 2), dtype))
    with pytest.raises(cb.DTypeMismatchError, match="log_softmax does not support int32"):
        m.log_softmax(m.create_tensor((2, 2), DT.INT32))
    with pytest.raises(cb.DTypeMismatchError, match="out has dtype float64, expected float32"):
        sm.softmax(m, x, out=m.create_tensor((3, 4), DT.FLOAT64))
    with pytest.raises(cb.ShapeMismatchError, match=r"out has shape \(4, 3\), expected \(3, 4\)"):
        sm.softmax(m, x, out=m.create_tensor((4, 3)))
    with pytest.raises(cb.InvalidArgumentError, match="must be a CudaTensor"):
        m.softmax(np.ones((2, 2)))
    x.free()
    with pytest.raises(cb.TensorFreedError):
        m.softmax(x)
    with pytest.raises(cb.TensorFreedError):
        m.log_softmax(x)


def test_plan_few_rows():
    """Warp mode that would launch fewer WARP_BLOCK blocks than SMs: WARP_SMALL_BLOCK
    threads (the same group and nv), float64 smem mode; more rows or no row count: as
    before; modes other than warp never change."""
    limit = LIMIT
    base = sm.plan(256, 4, limit)
    assert base["threads"] == sm.WARP_BLOCK and base["group"] == 16
    assert sm.few_rows(256, 4, 16 * 131, 132) and not sm.few_rows(256, 4, 16 * 132, 132)
    assert sm.plan(256, 4, limit, 16 * 131, 132) == dict(base, threads=sm.WARP_SMALL_BLOCK)
    assert sm.plan(256, 4, limit, 16 * 132, 132) == base
    assert sm.plan(256, 8, limit, 256, 132)["mode"] == "smem"
    assert sm.plan(256, 8, limit, 8 * 132, 132)["mode"] == "warp"
    assert sm.plan(4096, 4, limit, 4, 132) == sm.plan(4096, 4, limit)       # block mode
    assert not sm.few_rows(4096, 4, 4, 132)


def test_plan_modes():
    limit = LIMIT
    assert sm.plan(1, 4, limit) == {"mode": "warp", "nv": 4, "group": 1, "threads": 256,
                                    "smem": 0, "prefetch": 0}
    assert sm.plan(7, 4, limit)["group"] == 1       # one lane holds 16 elements
    assert sm.plan(64, 4, limit)["group"] == 4      # 4 vectors per lane in flight
    p = sm.plan(512, 4, limit)
    assert p["nv"] == 4 and p["group"] == 32
    assert sm.plan(513, 4, limit)["nv"] == 8
    p = sm.plan(1024, 4, limit)
    assert p["mode"] == "warp" and p["nv"] == 8 and p["group"] == 32
    assert sm.plan(2048, 2, limit)["mode"] == "warp"
    # block mode: BLOCK_NV vectors per thread on the fewest threads holding the row
    assert sm.plan(1025, 4, limit) == {"mode": "block", "nv": 4, "group": 0, "threads": 128,
                                       "smem": 0, "prefetch": 0}
    assert sm.plan(4096, 4, limit)["threads"] == 256
    assert sm.plan(4097, 4, limit)["threads"] == 512
    assert sm.plan(8192, 4, limit)["threads"] == 512
    assert sm.plan(16384, 4, limit)["threads"] == 1024
    assert sm.plan(4096, 2, limit)["threads"] == 128
    assert sm.plan(4096, 8, limit)["threads"] == 512
    assert sm.plan(16385, 4, limit) == {"mode": "smem", "nv": 0, "group": 0, "threads": 1024,
                                        "smem": 16389 * 4, "prefetch": 0}
    assert sm.plan(33000, 4, limit)["threads"] == 1024
    assert sm.plan(60000, 4, limit)["mode"] == "online"
    for K in range(1, 3000, 7):
        for itemsize in (2, 4, 8):
            p = sm.plan(K, itemsize, limit)
            if p["mode"] == "warp":  # every element has a register slot
                assert p["group"] * (16 // itemsize) * p["nv"] >= K and p["group"] <= 32
                assert p["nv"] in sm.WARP_NV


def test_candidates_hold_the_row():
    """Each candidate can run K (block mode: capacity >= K, more than half used), the rule's
    plan comes first, no duplicates; 4096 float32 offers both block sizes with and without
    prefetch, then smem and online."""
    for itemsize in (2, 4, 8):
        vec = 16 // itemsize
        for K in boundary_lengths(itemsize) + [20000, 70000]:
            cands = sm.candidates(K, itemsize, LIMIT)
            assert cands[0] == sm.plan(K, itemsize, LIMIT)
            assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)
            for c in cands:
                if c["mode"] == "block":
                    cap = c["threads"] * c["nv"] * vec
                    assert K <= cap < 2 * K
                    assert (c["threads"], c["nv"], bool(c["prefetch"])) in sm.BLOCK_CONFIGS
                elif c["mode"] == "warp":
                    assert K <= 32 * vec * sm.WARP_NV[-1]
            assert cands[-1]["mode"] == "online"
    got = [(c["mode"], c["threads"], c["nv"], c["prefetch"]) for c in sm.candidates(4096, 4, LIMIT)]
    assert got == [("block", 256, 4, 0), ("block", 512, 2, 0), ("block", 256, 4, 1),
                   ("block", 512, 2, 1), ("smem", 256, 0, 0), ("online", 512, 0, 0)]


def test_block_register_budget():
    """Resident blocks per SM fit the register file for the data slots (x2 with prefetch)."""
    for dt in FLOATS:
        for blk, nv, pf in sm.BLOCK_CONFIGS:
            mb = sm.block_min_blocks(dt, blk, nv, pf)
            assert 1 <= mb <= 2048 // blk
            assert 65536 // (blk * mb) >= 4 * nv * (2 if pf else 1) + 16


def test_template_variants():
    sets = sm.template_variants()["softmax.cu.j2"]
    assert len(sets) == 4 * (2 * len(sm.WARP_NV) + len(sm.BLOCK_CONFIGS) + 2)
    assert {p["block_size"] for p in sets if p["mode"] == "warp"} == {
        sm.WARP_BLOCK, sm.WARP_SMALL_BLOCK}
    assert {p["mode"] for p in sets} == {"warp", "block", "smem", "online"}
    assert all("prefetch" in p and "nv" in p for p in sets if p["mode"] == "block")
