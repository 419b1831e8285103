"""fused_linear_gelu and sketched_linear against float64 NumPy, on the GPU and in fallback."""
from __future__ import annotations

import numpy as np
import pytest

import cuda_backend as cb
from cuda_backend import CudaDataType as DT
from cuda_backend.cuda_ml import CudaML


@pytest.fixture(scope="module")
def ml():
    return CudaML()


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
    rng = np.random.default_rng()
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
    rng = np.random.default_rng()
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
