"""matrix_transpose against NumPy: every dtype, every config of both kernels (16-byte, 8-byte
and single-element accesses, block orders), odd shapes around the tile and vector edges,
batches, misaligned views, errors, fallback."""
from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples
from helpers import spy_plan, view_past_aligned

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend.cuda_math import CudaMath
from cuda_backend.ops import transpose as tr
from cuda_backend.tensor import CudaTensor

SHAPES = [(1, 1), (1, 7), (7, 1), (13, 17), (31, 33), (32, 32), (63, 65), (64, 64),
          (129, 257), (1000, 3), (2, 5, 7), (3, 64, 65)]
DTYPES = [DT.FLOAT32, DT.FLOAT64, DT.FLOAT16, DT.BFLOAT16, DT.INT32, DT.INT64]


def make(m, shape, dtype, rng):
    if dtype.is_floating:
        values = rng.standard_normal(shape)
    else:
        values = rng.integers(-1000, 1000, size=shape)
    t = m.from_numpy(values.astype(np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype),
                     dtype=dtype)
    return t, m.to_numpy(t)


@pytest.fixture(scope="module")
def m():
    return CudaMath()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cfg", tr.CONFIGS)
def test_transpose_every_config(m, shape, dtype, cfg):
    rng = np.random.default_rng(4173)
    x, ref = make(m, shape, dtype, rng)
    out_shape = shape[:-2] + (shape[-1], shape[-2])
    out = m.from_numpy(np.full(out_shape, np.nan if dtype.is_floating else -7,
                               np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype),
                       dtype=dtype)  # poison
    batch = shape[0] if len(shape) == 3 else 1
    tr._launch(m, dict(cfg), x, out, batch, shape[-2], shape[-1])
    np.testing.assert_array_equal(m.to_numpy(out), np.swapaxes(ref, -1, -2))
    x.free(); out.free()


def poison(m, shape, dtype):
    return m.from_numpy(np.full(shape, np.nan if dtype.is_floating else -7,
                                np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype),
                        dtype=dtype)


def vec_cases():
    """(dtype, config) for every "vec" kernel variant the module renders."""
    out = []
    for dt in DTYPES:
        for (size, vb), tiles in tr.VEC_CONFIGS.items():
            if size == dt.itemsize:
                for tile, threads in tiles:
                    out.append((dt, {"kernel": "vec", "vec_bytes": vb, "tile": tile,
                                     "threads": threads, "group": tr.GROUP}))
    return out


def vec_shapes(sv, tile):
    """Shapes (multiples of sv where sv > 1) at and around the tile edge, several tiles with
    partial ones, a batch, and primes (times sv)."""
    shapes = [(sv, sv), (tile - sv, tile), (tile, tile + sv), (2 * tile + sv, tile - sv),
              (sv * 3, sv * 61), (sv * 67, sv * 5), (2, tile + sv, 3 * tile - sv)]
    if sv == 1:
        shapes += [(1, 1), (13, 17), (tile + 1, 2 * tile - 1), (3, 31, 67), (97, 1)]
    return shapes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, cfg", vec_cases(),
                         ids=[f"{d.name_str}-{c['vec_bytes']}B-t{c['tile']}-n{c['threads']}"
                              for d, c in vec_cases()])
def test_vec_kernel_every_variant(m, dtype, cfg):
    """Each "vec" variant, band orders 0 (row-major), 1, 3 and the default, against NumPy;
    outputs poisoned."""
    rng = np.random.default_rng(895)
    sv = cfg["vec_bytes"] // dtype.itemsize
    for shape in vec_shapes(sv, cfg["tile"]):
        x, ref = make(m, shape, dtype, rng)
        out_shape = shape[:-2] + (shape[-1], shape[-2])
        batch = shape[0] if len(shape) == 3 else 1
        for group in (0, 1, 3, tr.GROUP):
            out = poison(m, out_shape, dtype)
            tr._launch(m, dict(cfg, group=group), x, out, batch, shape[-2], shape[-1])
            np.testing.assert_array_equal(m.to_numpy(out), np.swapaxes(ref, -1, -2),
                                          err_msg=f"{shape} {cfg} group={group}")
            out.free()
        x.free()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name_str)
def test_candidates_and_misaligned_views(m, dtype):
    """Every candidate for aligned, 8-byte-only and odd shapes, and views one element past
    an aligned pointer (the access width drops to what the pointers allow)."""
    rng = np.random.default_rng(1737)
    for shape in [(64, 128), (130, 66), (63, 65), (2, 96, 32)]:
        x, ref = make(m, shape, dtype, rng)
        out_shape = shape[:-2] + (shape[-1], shape[-2])
        batch = shape[0] if len(shape) == 3 else 1
        out = poison(m, out_shape, dtype)
        for cfg in tr.candidates(dtype, shape[-2], shape[-1], x.ptr, out.ptr):
            out2 = poison(m, out_shape, dtype)
            tr._launch(m, cfg, x, out2, batch, shape[-2], shape[-1])
            np.testing.assert_array_equal(m.to_numpy(out2), np.swapaxes(ref, -1, -2),
                                          err_msg=f"{shape} {cfg}")
            out2.free()
        out.free(), x.free()
    for shape in [(64, 64), (8, 24)]:
        n = shape[0] * shape[1]
        base, b = make(m, (n + 1,), dtype, rng)
        x = CudaTensor(shape, dtype, base.device_id, base.ptr + dtype.itemsize, owner=base)
        obase = poison(m, (n + 1,), dtype)
        out = CudaTensor(shape[::-1], dtype, obase.device_id, obase.ptr + dtype.itemsize,
                         owner=obase)
        assert tr.vec_width(dtype, *shape, x.ptr, out.ptr) < 16
        tr.transpose(m, x, out=out)
        np.testing.assert_array_equal(m.to_numpy(out), b[1:].reshape(shape).T)
        base.free(), obase.free()


@pytest.mark.gpu
@pytest.mark.large
@pytest.mark.parametrize("dtype, shape", [
    (DT.FLOAT32, (4096, 4096)), (DT.FLOAT32, (4095, 4097)), (DT.BFLOAT16, (4096, 4096)),
    (DT.FLOAT64, (2, 1024, 2048))])
def test_transpose_large_every_candidate(m, dtype, shape):
    """Large planes (many bands of tiles) through every candidate and the autotuned path."""
    rng = np.random.default_rng(275)
    x, ref = make(m, shape, dtype, rng)
    want = np.ascontiguousarray(np.swapaxes(ref, -1, -2))
    out_shape = shape[:-2] + (shape[-1], shape[-2])
    batch = shape[0] if len(shape) == 3 else 1
    pois = poison(m, out_shape, dtype)
    out = m.create_tensor(out_shape, dtype)
    for cfg in tr.candidates(dtype, shape[-2], shape[-1], x.ptr, out.ptr):
        m.backend.copy_device_to_device(out, pois)
        tr._launch(m, cfg, x, out, batch, shape[-2], shape[-1])
        np.testing.assert_array_equal(m.to_numpy(out), want, err_msg=str(cfg))
    np.testing.assert_array_equal(m.to_numpy(m.matrix_transpose(x)), want)
    x.free(), out.free(), pois.free()


@pytest.mark.gpu
@pytest.mark.large
@pytest.mark.parametrize("shape", [(4096, 4097), (3, 1025, 2049)])
def test_transpose_large_autotuned(m, shape):
    rng = np.random.default_rng(4578)
    x, ref = make(m, shape, DT.FLOAT32, rng)
    y = m.matrix_transpose(x)
    assert y.shape == shape[:-2] + (shape[-1], shape[-2])
    np.testing.assert_array_equal(m.to_numpy(y), np.swapaxes(ref, -1, -2))
    z = y.T if hasattr(y, "T") else m.matrix_transpose(y)
    np.testing.assert_array_equal(m.to_numpy(z), ref)


@pytest.mark.gpu
@settings(max_examples=examples(40), deadline=None)
@given(rows=st.integers(0, 200), cols=st.integers(0, 200), batch=st.integers(0, 3),
       dtype=st.sampled_from(DTYPES))
def test_transpose_property(m, rows, cols, batch, dtype):
    shape = (batch, rows, cols) if batch else (rows, cols)
    x, ref = make(m, shape, dtype, np.random.default_rng(5659))
    np.testing.assert_array_equal(m.to_numpy(m.matrix_transpose(x)), np.swapaxes(ref, -1, -2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.BFLOAT16, DT.INT64], ids=lambda d: d.name_str)
def test_batch_over_grid_z(m, dtype):
    """70000 planes, more than the grid's z holds, through the public (autotuned) path and
    every candidate, outputs poisoned; float32 also through transpose_tf32 (rounded)."""
    rng = np.random.default_rng(70000)
    shape = (70000, 3, 5) if dtype is DT.FLOAT32 else (70000, 4, 6)
    x, ref = make(m, shape, dtype, rng)
    want = np.swapaxes(ref, -1, -2)
    np.testing.assert_array_equal(m.to_numpy(m.matrix_transpose(x)), want)
    for cfg in tr.candidates(dtype, shape[1], shape[2], x.ptr, 0):
        out = poison(m, want.shape, dtype)
        assert out.ptr % 16 == 0
        tr._launch(m, cfg, x, out, *shape)
        np.testing.assert_array_equal(m.to_numpy(out), want, err_msg=str(cfg))
        out.free()
    if dtype is DT.FLOAT32:
        from cuda_backend.ops.matmul_fallback import round_tf32
        out = poison(m, want.shape, dtype)
        tr.transpose_tf32(m, x, out, *shape, x.device_id)
        np.testing.assert_array_equal(m.to_numpy(out), round_tf32(want))
        out.free()
    x.free()


def test_launch_grids_split_the_batch():
    """Each config's launches: grid z within the limit, the planes covered once in order,
    x and y as one launch of the whole batch would have them."""
    for cfg in tr.candidates(DT.FLOAT32, 70, 130, 0, 0) + tr.candidates(DT.FLOAT32, 3, 5, 0, 0):
        one = tr.launch_grids(cfg, 1, 70, 130)
        for batch, max_z in ((70000, 65535), (65535, 65535), (65536, 65535), (20, 7), (1, 7)):
            grids = tr.launch_grids(cfg, batch, 70, 130, max_z)
            assert [b0 for b0, _ in grids] == list(range(0, batch, max_z))
            assert all(1 <= g[2] <= max_z and g[:2] == one[0][1][:2] for _, g in grids)
            assert sum(g[2] for _, g in grids) == batch
        assert [g[2] for _, g in tr.launch_grids(cfg, 70000, 3, 5)] == [65535, 70000 - 65535]


def test_launches_past_grid_z_offset_the_planes():
    """_launch and transpose_tf32 with 70000 planes on a stand-in backend (grid z limit
    65535): two launches, the second at plane 65535 of both operands."""
    launches = []

    class Backend:
        def get_device_info(self, dev):
            return types.SimpleNamespace(max_grid_dims=(2**31 - 1, 65535, 65535))

        def launch_kernel(self, name, grid, *args, block_size=None, device_id=0):
            launches.append((grid, args))

    class Math:
        backend = Backend()

        def kernel(self, template, dev, **params):
            return types.SimpleNamespace(name="k")

    x = types.SimpleNamespace(ptr=1 << 20, device_id=0, dtype=DT.FLOAT32)
    out = types.SimpleNamespace(ptr=1 << 30, device_id=0, dtype=DT.FLOAT32)
    skip = 65535 * 3 * 5 * 4
    for cfg in tr.candidates(DT.FLOAT32, 3, 5, x.ptr, out.ptr):
        launches.clear()
        tr._launch(Math(), cfg, x, out, 70000, 3, 5)
        assert [g[2] for g, _ in launches] == [65535, 70000 - 65535]
        assert launches[0][1][:2] == (x, out)
        assert launches[1][1][:2] == (x.ptr + skip, out.ptr + skip)
    launches.clear()
    tr.transpose_tf32(Math(), x.ptr, out.ptr, 70000, 3, 5, 0)
    assert [g[2] for g, _ in launches] == [65535, 70000 - 65535]
    assert [a[:2] for _, a in launches] == [(x.ptr, out.ptr), (x.ptr + skip, out.ptr + skip)]


def test_transpose_errors(m):
    x = m.from_numpy(np.ones(5, np.float32))
    with pytest.raises(cb.InvalidArgumentError, match="2-D or 3-D"):
        m.matrix_transpose(x)
    b = m.from_numpy(np.ones((2, 2), np.bool_))
    with pytest.raises(cb.DTypeMismatchError, match="bool"):
        m.matrix_transpose(b)
    y = m.from_numpy(np.ones((2, 3), np.float32))
    y.free()
    with pytest.raises(cb.TensorFreedError):
        m.matrix_transpose(y)
    with pytest.raises(cb.InvalidArgumentError, match="CudaTensor"):
        m.matrix_transpose(np.ones((2, 2)))


def test_vec_width_and_candidates():
    """Access width from shape and pointers; candidate lists start with the default."""
    F32, BF16, F64 = DT.FLOAT32, DT.BFLOAT16, DT.FLOAT64
    assert tr.vec_width(F32, 8192, 8192, 0, 1 << 20) == 16
    assert tr.vec_width(F32, 8190, 8194, 0, 256) == 8
    assert tr.vec_width(F32, 8191, 8193, 0, 256) == 4
    assert tr.vec_width(F32, 64, 64, 4, 256) == 4
    assert tr.vec_width(F32, 64, 64, 8, 256) == 8
    assert tr.vec_width(BF16, 64, 64, 0, 0) == 16
    assert tr.vec_width(BF16, 60, 64, 0, 0) == 8
    assert tr.vec_width(F64, 64, 64, 0, 0) == 16
    assert tr.vec_width(F64, 63, 64, 0, 0) == 8
    c = tr.candidates(F32, 8192, 8192, 0, 0)
    assert c[0] == {"kernel": "vec", "vec_bytes": 16, "tile": 64, "threads": 256,
                    "group": tr.GROUP}
    assert {"kernel": "vec", "vec_bytes": 8, "tile": 64, "threads": 256,
            "group": tr.GROUP} in c
    assert dict(c[0], group=0) in c
    assert [x for x in c if x["kernel"] == "tile"] == [dict(x) for x in tr.CONFIGS]
    assert all(x["vec_bytes"] == 4 for x in tr.candidates(F32, 7, 9, 0, 0) if x["kernel"] == "vec")
    for dt in DTYPES:
        for shape in [(64, 64), (63, 65), (6, 10)]:
            for cfg in tr.candidates(dt, *shape, 0, 0):
                p = tr.config_params(dt, cfg)
                if cfg["kernel"] == "vec":
                    sv = cfg["vec_bytes"] // dt.itemsize
                    assert shape[0] % sv == 0 and shape[1] % sv == 0
                    assert (cfg["tile"] // sv) ** 2 % cfg["threads"] == 0
                    assert 1 <= p["min_blocks"] <= 16


def test_transpose_zero_size_and_host_path(m):
    x = m.from_numpy(np.ones((0, 3), np.float32))
    y = m.matrix_transpose(x)
    assert y.shape == (3, 0)
    rng = np.random.default_rng(9802)
    x, ref = make(m, (5, 9), DT.FLOAT32, rng)
    np.testing.assert_array_equal(m.to_numpy(m.matrix_transpose(x)), ref.T)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DT.FLOAT32, DT.FLOAT16, DT.FLOAT64, DT.INT32],
                         ids=lambda d: d.name_str)
def test_plan_path_matches_numpy(m, dtype):
    """Per-call plans (ops/common.py): each shape twice on fresh random inputs, the first
    through the general path (which keeps the plan), the second through m.plans, then a
    view one element past an aligned pointer (a narrower access width, configured on first
    use); every result against NumPy. An autotuned size too."""
    rng = np.random.default_rng(1764)
    for shape in [(37, 53), (64, 64), (3, 40, 24), (1000, 3), (2, 96, 32), (1023, 1031)]:
        key = ("matrix_transpose", shape, dtype, 0)
        m.plans.pop(key, None)
        for i in range(3):
            base = None
            if i < 2:
                x, ref = make(m, shape, dtype, rng)
            else:
                x, base, ref = view_past_aligned(m, make, shape, dtype, rng)
            if i:
                assert key in m.plans, key
                assert m.backend.direct_launch(x.device_id)
                plan = m.plans[key]
                taken = spy_plan(m, key)
            out = m.matrix_transpose(x)
            if i:
                assert taken == [True], (key, i)   # the plan gave the result
                m.plans[key] = plan
            np.testing.assert_array_equal(m.to_numpy(out), np.swapaxes(ref, -1, -2),
                                          err_msg=f"{shape} call {i}")
            out.free(), x.free()
            if base is not None:
                base.free()
