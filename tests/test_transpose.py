"""matrix_transpose against NumPy: every dtype, odd shapes, batches, errors, fallback."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend.cuda_math import CudaMath
from cuda_backend.ops import transpose as tr

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
    rng = np.random.default_rng()
    x, ref = make(m, shape, dtype, rng)
    out_shape = shape[:-2] + (shape[-1], shape[-2])
    out = m.from_numpy(np.full(out_shape, np.nan if dtype.is_floating else -7,
                               np.float32 if dtype is DT.BFLOAT16 else dtype.numpy_dtype),
                       dtype=dtype)  # poison
    batch = shape[0] if len(shape) == 3 else 1
    tr._launch(m, dict(cfg), x, out, batch, shape[-2], shape[-1])
    np.testing.assert_array_equal(m.to_numpy(out), np.swapaxes(ref, -1, -2))
    x.free(); out.free()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4097), (3, 1025, 2049)])
def test_transpose_large_autotuned(m, shape):
    rng = np.random.default_rng()
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
    x, ref = make(m, shape, dtype, np.random.default_rng())
    np.testing.assert_array_equal(m.to_numpy(m.matrix_transpose(x)), np.swapaxes(ref, -1, -2))


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


def test_transpose_zero_size_and_host_path(m):
    x = m.from_numpy(np.ones((0, 3), np.float32))
    y = m.matrix_transpose(x)
    assert y.shape == (3, 0)
    rng = np.random.default_rng()
    x, ref = make(m, (5, 9), DT.FLOAT32, rng)
    np.testing.assert_array_equal(m.to_numpy(m.matrix_transpose(x)), ref.T)
