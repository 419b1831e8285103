"""Matmul fallback mode: the GEMM (plain, A or B given transposed) and the linear layer with its
epilogues in NumPy, as the kernels compute them (TF32 rounding, tanh-form GELU and its
derivative), the result copied into the output tensor."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..dtypes import CudaDataType, to_bfloat16_bits
from ..tensor import CudaTensor
from . import common
from .matmul_kernels import GRAD_EPILOGUE
from .matmul_shapes import Plan

DT = CudaDataType


def round_tf32(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest TF32 value, ties away from zero (what cvt.rna.tf32.f32 does)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    finite = np.isfinite(x)
    rounded = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(finite, rounded, x).astype(np.float32)


def fallback(m: Any, a: CudaTensor, b: CudaTensor, out: CudaTensor, p: Plan,
             prec: Optional[str], a_trans: bool = False, b_trans: bool = False) -> None:
    """out = a @ b in NumPy (a_trans / b_trans: that operand given transposed, its last two
    axes swapped here)."""
    work = np.float64 if out.dtype is DT.FLOAT64 else np.float32
    ah = common.host_array(m, a).astype(work, copy=False)
    bh = common.host_array(m, b).astype(work, copy=False)
    if a_trans:
        ah = np.swapaxes(ah, -1, -2)
    if b_trans:
        bh = np.swapaxes(bh, -1, -2)
    if prec == "tf32":
        ah, bh = round_tf32(ah), round_tf32(bh)
    if p.K == 0:
        res = np.zeros(p.out_shape, work)
    else:
        with np.errstate(all="ignore"):  # NaN/inf operands, as on the GPU
            res = np.matmul(ah, bh).reshape(p.out_shape)
    _store(m, res, out)


def gelu_tanh(z: np.ndarray) -> np.ndarray:
    """0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))), written as the kernels compute it."""
    with np.errstate(all="ignore"):
        return z / (1.0 + np.exp(-1.5957691216057308 * (z + 0.044715 * z * z * z)))


def gelu_tanh_grad(z: np.ndarray) -> np.ndarray:
    """d gelu_tanh(z) / dz, written as the kernels compute it: s + z s (1 - s) u',
    s = sigmoid(u), u = 2 sqrt(2/pi) (z + 0.044715 z^3), 1 - s as sigmoid(-u), the second
    term 0 where s (1 - s) is."""
    with np.errstate(all="ignore"):
        z2 = z * z
        u = 1.5957691216057308 * z * (1.0 + 0.044715 * z2)
        s = 1.0 / (1.0 + np.exp(-u))
        q = 1.0 / (1.0 + np.exp(u))
        sq = s * q
        du = 1.5957691216057308 * (1.0 + 0.134145 * z2)
        return s + np.where(sq == 0, 0.0, z * sq * du)


def linear_fallback(m: Any, x: CudaTensor, w: CudaTensor, bias: Optional[CudaTensor],
                    out: CudaTensor, epilogue: str, prec: Optional[str],
                    grad: Optional[CudaTensor] = None) -> None:
    xh = common.host_array(m, x).astype(np.float32 if prec == "tf32" else np.float64)
    wh = common.host_array(m, w).astype(xh.dtype)
    if prec == "tf32":
        xh, wh = round_tf32(xh), round_tf32(wh)
    with np.errstate(all="ignore"):
        res = xh.astype(np.float64) @ wh.astype(np.float64).T
        if bias is not None:
            res = res + common.host_array(m, bias).astype(np.float64)
    if epilogue == "bias_gelu":
        res = gelu_tanh(res)
    elif epilogue == GRAD_EPILOGUE:
        with np.errstate(all="ignore"):
            assert grad is not None, "the gradient epilogue reads G"
            res = common.host_array(m, grad).astype(np.float64) * gelu_tanh_grad(res)
    _store(m, res, out)


def _store(m: Any, res: np.ndarray, out: CudaTensor) -> None:
    """Copy a float64 / float32 host result into out, rounded once to out's dtype."""
    if out.dtype is DT.BFLOAT16:
        host = to_bfloat16_bits(res.astype(np.float32)).reshape(out.shape)
    else:
        host = np.ascontiguousarray(res, dtype=out.dtype.numpy_dtype)
    m.backend.copy_to_device(host, out)
