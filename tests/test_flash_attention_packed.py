"""flash_attention_packed and its backward (cuda_backend/ops/attention_packed.py): q, k, v
read in place from a fused (batch, seq, 3 * heads * head_dim) projection.

GPU tests (marked `gpu`) compare with the unpacked ops on the same data, permuted: the forward
runs the same arithmetic in the same config (the autotuner's choice is per shape class), so it
must agree bitwise; so must dk and dv (deterministic sums); dq's float32 sums are added by
atomics in arrival order, so it may differ by the reordering of its key-block partial sums
(<= n_blocks * 2^-24 of the largest row sum) plus one rounding to the dtype. They also check
against the float64 reference within the unpacked tests' bounds. The rest run anywhere: the
NumPy fallback, errors, and a NumPy emulation of the kernels' layout addressing.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import tuned_math

from cuda_backend import CudaDataType as DT
from cuda_backend.cuda_ml import CudaML
from cuda_backend.ops import attention as fa
from cuda_backend.ops import attention_packed as ap

gpu = pytest.mark.gpu
DTYPES = [DT.FLOAT32, DT.FLOAT16, DT.BFLOAT16]
BOUNDS = {DT.FLOAT32: 1e-5, DT.FLOAT16: 1e-2, DT.BFLOAT16: 1e-2}   # test_flash_attention's
EPS = {DT.FLOAT32: 2.0**-24, DT.FLOAT16: 2.0**-11, DT.BFLOAT16: 2.0**-8}

# (batch, seq, heads, head_dim): odd lengths, every padded head_dim class
SHAPES = [
    (1, 1, 1, 64),
    (2, 7, 3, 40),       # ld * 4 = 480 bytes: the vector path for float32
    (1, 77, 12, 64),
    (2, 130, 3, 128),
    (1, 130, 1, 16),
    (2, 77, 3, 20),      # float16 / bfloat16: 3 * 20 * 2 = 120-byte rows, the element path
    (1, 33, 2, 200),     # head_dim over 128 (the CUDA-core backward)
]
SHAPE_IDS = ["x".join(str(v) for v in s) for s in SHAPES]


@pytest.fixture(scope="module")
def m(backend, tmp_path_factory):
    return tuned_math(backend, tmp_path_factory)


@pytest.fixture(scope="module")
def ml(m):
    return CudaML(m)


def make(m, rng, shape, dtype):
    t = m.from_numpy(rng.standard_normal(shape).astype(np.float32), dtype=dtype)
    return t, m.to_numpy(t).astype(np.float64)


def heads_of(x, heads):
    """(B, T, C) -> contiguous (B, H, T, D)."""
    B, T, C = x.shape
    return np.ascontiguousarray(x.reshape(B, T, heads, C // heads).transpose(0, 2, 1, 3))


def unpacked(m, qkv_host, heads, dtype):
    """q, k, v as contiguous device tensors (the permute the packed op avoids)."""
    return [m.from_numpy(np.ascontiguousarray(a).astype(np.float32), dtype=dtype)
            for a in ap.unpack(qkv_host, heads)]


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape
    assert np.isfinite(out).all()
    denom = np.linalg.norm(ref)
    return np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0)


# -- GPU ------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name_str)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_packed_matches_unpacked(m, ml, shape, dtype, causal):
    B, T, H, D = shape
    rng = np.random.default_rng(hash((shape, dtype.name_str, causal)) % 2**32)
    qkv, qkv_h = make(m, rng, (B, T, 3 * H * D), dtype)
    g, g_h = make(m, rng, (B, T, H * D), dtype)
    out, lse = ml.flash_attention_packed(qkv, H, causal=causal, return_lse=True)
    q, k, v = unpacked(m, qkv_h, H, dtype)
    out_u, lse_u = ml.flash_attention(q, k, v, causal=causal, return_lse=True)
    o_h = m.to_numpy(out)
    assert out.shape == (B, T, H * D) and lse.shape == (B, H, T)
    np.testing.assert_array_equal(o_h, ap.pack(m.to_numpy(out_u)))
    np.testing.assert_array_equal(m.to_numpy(lse), m.to_numpy(lse_u))
    ref = ap.reference(qkv_h, H, 1 / math.sqrt(D), causal)
    assert rel_err(o_h, ref) <= BOUNDS[dtype]

    dqkv = m.to_numpy(ml.flash_attention_packed_backward(g, qkv, out, lse, H, causal=causal))
    go = m.from_numpy(heads_of(g_h, H).astype(np.float32), dtype=dtype)
    grads = [m.to_numpy(t).astype(np.float64)
             for t in ml.flash_attention_backward(go, q, k, v, out_u, lse_u, causal=causal)]
    want = np.stack([ap.pack(x) for x in grads], axis=2).reshape(B, T, 3 * H * D)
    C = H * D
    got = dqkv.astype(np.float64)
    np.testing.assert_array_equal(got[..., C:], want[..., C:])   # dk, dv: deterministic
    # dq: reordered float32 sums of ceil(T / 16) key-block partials, then one rounding
    blocks = -(-T // 16)
    bound = EPS[dtype] * np.abs(want[..., :C]) * 2 + \
        blocks * 2.0**-23 * np.abs(want[..., :C]).max(initial=0.0) * 4
    assert (np.abs(got[..., :C] - want[..., :C]) <= bound).all()
    if dtype is DT.FLOAT32:
        ref_g = ap.reference_backward(g_h, qkv_h, H, 1 / math.sqrt(D), causal)
        assert rel_err(got, ref_g) <= 1e-5


@gpu
def test_packed_public_plan_repeats(m, ml):
    """The second call (the per-call plan) gives the first call's result."""
    rng = np.random.default_rng(5)
    qkv, _ = make(m, rng, (2, 77, 3 * 3 * 64), DT.FLOAT16)
    a = m.to_numpy(ml.flash_attention_packed(qkv, 3, causal=True))
    b, lse = ml.flash_attention_packed(qkv, 3, causal=True, return_lse=True)
    c = m.to_numpy(ml.flash_attention_packed(qkv, 3, causal=True))
    np.testing.assert_array_equal(a, m.to_numpy(b))
    np.testing.assert_array_equal(a, c)


# -- anywhere ---------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fallback_api(m, ml, causal):
    """The public API in fallback mode (on a GPU: the kernels) against the float64 reference
    of the permuted arrays; float32 bounds of the unpacked tests."""
    B, T, H, D = 2, 9, 3, 8
    rng = np.random.default_rng(11)
    qkv, qkv_h = make(m, rng, (B, T, 3 * H * D), DT.FLOAT32)
    g, g_h = make(m, rng, (B, T, H * D), DT.FLOAT32)
    out, lse = ml.flash_attention_packed(qkv, H, causal=causal, return_lse=True)
    q, k, v = ap.unpack(qkv_h, H)
    ref, ref_lse = fa.reference(q, k, v, 1 / math.sqrt(D), causal, return_lse=True)
    assert rel_err(m.to_numpy(out), ap.pack(ref)) <= 1e-5
    assert rel_err(m.to_numpy(lse), ref_lse) <= 1e-5
    only = ml.flash_attention_packed(qkv, H, causal=causal)
    assert only.shape == (B, T, H * D)
    dqkv = ml.flash_attention_packed_backward(g, qkv, out, lse, H, causal=causal)
    assert dqkv.shape == qkv.shape and dqkv.dtype is DT.FLOAT32
    assert rel_err(m.to_numpy(dqkv), ap.reference_backward(g_h, qkv_h, H, 1 / math.sqrt(D),
                                                           causal)) <= 1e-5


def test_reference_backward_by_finite_differences():
    """reference_backward is the gradient of <g, reference(qkv)> (float64, central
    differences on a tiny shape: error O(h^2) ~ 1e-10)."""
    rng = np.random.default_rng(3)
    B, T, H, D = 1, 3, 2, 2
    qkv = rng.standard_normal((B, T, 3 * H * D))
    g = rng.standard_normal((B, T, H * D))
    sc = 0.7
    got = ap.reference_backward(g, qkv, H, sc, True)
    h = 1e-5
    num = np.zeros_like(qkv)
    for idx in np.ndindex(qkv.shape):
        e = np.zeros_like(qkv)
        e[idx] = h
        num[idx] = (np.sum(g * ap.reference(qkv + e, H, sc, True)) -
                    np.sum(g * ap.reference(qkv - e, H, sc, True))) / (2 * h)
    np.testing.assert_allclose(got, num, rtol=1e-7, atol=1e-8)


def _emulate_load(p, group, base_ptr, bh, row0, nrows, ROWS, THREADS, CPRH, EPC):
    """The element indices load_tile (templates/flash_attention*.cu.j2) reads for rows
    [row0, row0 + ROWS) of matrix bh: thread tid copies chunk column tid % CPRH of rows
    tid / CPRH + it * (THREADS / CPRH); -1 where it zero-fills."""
    sb, sh, ld = getattr(p, group)
    b = bh // p.heads
    base = base_ptr + b * sb + (bh - b * p.heads) * sh
    out = np.full((ROWS, CPRH * EPC), -1, np.int64)
    rpi = THREADS // CPRH
    for tid in range(THREADS):
        c, r0 = tid % CPRH, tid // CPRH
        for it in range(-(-ROWS // rpi)):
            row = r0 + it * rpi
            if row >= ROWS:
                break
            for e in range(EPC):
                col = c * EPC + e
                if row < nrows - row0 and col < p.d:
                    out[row, col] = base + row0 * ld + row * ld + col
    return out


def test_layout_addressing_emulated():
    """Which element of the packed buffer each thread loads for q, k, v and writes for out,
    dq, dk, dv (the kernels' formula, in NumPy) is the element qkv.reshape(B, T, 3, H, D)
    (and out.reshape(B, T, H, D)) holds."""
    B, T, H, D = 2, 37, 3, 40
    C = H * D
    p = fa.packed_problem(B, T, H, D)
    idx = np.arange(B * T * 3 * C).reshape(B, T, 3, H, D)
    oidx = np.arange(B * T * C).reshape(B, T, H, D)
    THREADS, EPC = 128, 4                 # float32, hd 64: 16 chunks per row
    CPRH = 64 // EPC
    for bh in range(B * H):
        b, h = divmod(bh, H)
        for which, (group, ptr) in enumerate((("q", 0), ("kv", C), ("kv", 2 * C))):
            for row0 in (0, 32):
                got = _emulate_load(p, group, ptr, bh, row0, T, 64, THREADS, CPRH, EPC)
                rows = min(64, T - row0)
                np.testing.assert_array_equal(got[:rows, :D], idx[b, row0:row0 + rows, which, h])
                assert (got[rows:] == -1).all() and (got[:, D:] == -1).all()
        # output rows (forward store, dk / dv stores, the dq stage): base + row * ld + col
        sb, sh, ld = p.o
        for row in (0, T - 1):
            np.testing.assert_array_equal(b * sb + h * sh + row * ld + np.arange(D),
                                          oidx[b, row, h])
        sb, sh, ld = p.q
        for which, ptr in ((0, 0), (1, C), (2, 2 * C)):
            np.testing.assert_array_equal(ptr + b * sb + h * sh + 5 * ld + np.arange(D),
                                          idx[b, 5, which, h])
    # the trivial layout: the contiguous addresses bh * seq * d + r * d
    t = fa.contiguous_problem((2, 3, 7, 16), (2, 3, 9, 16))
    assert t.heads == 1 and t.q == (7 * 16, 0, 16) and t.kv == (9 * 16, 0, 16)
    assert t.args() == (1, 112, 0, 16, 144, 0, 16, 112, 0, 16)
