"""Dropout with a counter-based RNG (`templates/dropout.cu.j2`).

Element i is kept when word i % 4 of Philox-4x32-10(counter = i / 4, key = seed) is below
round(keep_prob * 2^32); kept values are scaled by 1 / keep_prob, dropped ones multiplied by
0 (so NaN/inf inputs stay NaN, as PyTorch's x * mask * scale). The mask depends only on the
seed and the element index, never on the launch geometry, and `philox4x32_10` below is the
same generator in NumPy: the fallback (and the tests) reproduce the kernel bit for bit.
`dropout_backward(grad_out, keep_prob, seed)` runs the same kernel on grad_out: the mask is
regenerated from the seed rather than kept, and the result is bit for bit grad_out times the
forward's mask times 1 / keep_prob.
"""
from __future__ import annotations

import secrets
from typing import Any, Dict, List, Literal, Optional, Tuple, Union, overload

import numpy as np

from ..dtypes import CudaDataType
from ..errors import InvalidArgumentError
from ..kernels import dtype_params
from ..tensor import CudaTensor, pool_tensor
from . import common

TEMPLATE = "dropout.cu.j2"
TEMPLATES = (TEMPLATE,)
BLOCK = 256
DTYPES = common.FLOATS
M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)


def _vec(dtype: CudaDataType) -> int:
    return 16 // dtype.itemsize


def _params(dtype: CudaDataType) -> Dict[str, Any]:
    return {**dtype_params(dtype), "vec": _vec(dtype), "block_size": BLOCK}


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    return {TEMPLATE: [_params(dt) for dt in DTYPES]}


def warm_up(m: Any, device_id: Optional[int] = None, workers: int = 8) -> int:
    """Compile every dropout variant in parallel threads (nvcc runs in subprocesses);
    returns how many were compiled (0 in fallback mode)."""
    jobs = [(t, p) for t, sets in template_variants().items() for p in sets]
    return common.compile_all(m, jobs, device_id, workers)


def philox4x32_10_raw(c0: Any, c1: Any, c2: Any, c3: Any, k0: int,
                      k1: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Philox-4x32-10 of counter words (arrays of values < 2^32, held as uint64) under key
    (k0, k1): the four output words, as in Random123's philox4x32(ctr, key)."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in (c0, c1, c2, c3))
    k0, k1 = int(k0) & 0xFFFFFFFF, int(k1) & 0xFFFFFFFF
    for _ in range(10):
        p0 = np.uint64(M0) * c0
        p1 = np.uint64(M1) * c2
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK32
        c0, c1, c2, c3 = (hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0)
        k0 = (k0 + W0) & 0xFFFFFFFF
        k1 = (k1 + W1) & 0xFFFFFFFF
    return c0, c1, c2, c3


def philox4x32_10(counters: np.ndarray, seed: int) -> np.ndarray:
    """The kernel's random words: Philox-4x32-10 of counter (lo32(q), hi32(q), 0, 0) for
    each q in counters under key (lo32(seed), hi32(seed)); an (n, 4) uint32 array."""
    q = np.asarray(counters, dtype=np.uint64)
    zero = np.zeros_like(q)
    words = philox4x32_10_raw(q & _MASK32, q >> np.uint64(32), zero, zero, seed & 0xFFFFFFFF,
                              (seed >> 32) & 0xFFFFFFFF)
    return np.stack(words, axis=-1).astype(np.uint32)


# The keep threshold is round(keep_prob * 2^32), off by up to 0.5 from the exact value: the
# realized keep probability, and so the mean of the output (scaled by 1 / keep_prob), is off
# by up to 0.5 / (keep_prob * 2^32) relatively. Requiring keep_prob * 2^32 >= 5000 keeps
# that bias under 1e-4, below the sampling noise of any tensor that fits a device.
MIN_KEEP_PROB = 5000 / 2**32


def threshold_for(keep_prob: float) -> int:
    """Words below this are kept: round(keep_prob * 2^32), at least 1."""
    return max(1, min(1 << 32, int(round(keep_prob * 2.0**32))))


def host_mask(n: int, keep_prob: float, seed: int) -> np.ndarray:
    """The kernel's keep mask (bool) for n elements, computed in NumPy (chunked)."""
    out = np.empty(n, dtype=bool)
    thr = np.uint64(threshold_for(keep_prob))
    step = 1 << 22  # counters per chunk
    for start in range(0, (n + 3) // 4, step):
        q = np.arange(start, min(start + step, (n + 3) // 4), dtype=np.uint64)
        words = philox4x32_10(q, seed).reshape(-1)
        lo = start * 4
        hi = min(n, lo + words.size)
        out[lo:hi] = words[:hi - lo].astype(np.uint64) < thr
    return out


def reference(x: Any, keep_prob: float, seed: int) -> np.ndarray:
    """Dropout of x in float64 with the kernel's mask for (keep_prob, seed): kept elements
    scaled by 1/keep_prob, dropped ones times 0 (NaN and inf stay NaN)."""
    a = np.asarray(x, dtype=np.float64)
    if keep_prob >= 1.0:
        return a.copy()
    keep = host_mask(a.size, float(keep_prob), int(seed)).reshape(a.shape)
    with np.errstate(invalid="ignore"):
        return a * np.where(keep, 1.0 / keep_prob, 0.0)


def _seed(seed: Any) -> int:
    if seed is None:
        return secrets.randbits(64)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InvalidArgumentError(f"seed must be an int or None, got {seed!r}")
    return int(seed) % (1 << 64)


def _keep_prob(keep_prob: Any) -> float:
    if isinstance(keep_prob, bool) or not isinstance(keep_prob, (int, float, np.integer,
                                                                   np.floating)):
        raise InvalidArgumentError(f"keep_prob must be a number in (0, 1], got {keep_prob!r}")
    p = float(keep_prob)
    if not (0.0 < p <= 1.0):  # also rejects NaN
        raise InvalidArgumentError(f"keep_prob must be in (0, 1], got {keep_prob!r}")
    if p < MIN_KEEP_PROB:
        kept = threshold_for(p) / 2**32
        raise InvalidArgumentError(
            f"keep_prob must be >= {MIN_KEEP_PROB!r} (5000 / 2**32), got {keep_prob!r}: the "
            f"32-bit keep threshold round(keep_prob * 2**32) = {threshold_for(p)} keeps a "
            f"fraction {kept:.6g} of the elements, {abs(kept - p) / p:.2g} off relatively "
            f"(at most 1e-4 is accepted)")
    return p


def _planned(m: Any, key: tuple, x: CudaTensor, seed: Any) -> Any:
    """The per-call plan of key (ops/common.py remember_plan) run on (x, seed); None when
    there is none, launches are not direct, or it declines the call."""
    fast = m.plans.get(key)
    if fast is not None and m.backend.direct_launch(x.device_id):
        return fast(x, seed)
    return None


def _checked(x: Any, name: str, op: str, keep_prob: Any) -> float:
    """Check the tensor x (called name) and its dtype for op; returns keep_prob checked."""
    common.check_tensor(x, name)
    common.require_dtype(x, DTYPES, op)
    return _keep_prob(keep_prob)


def dropout(m: Any, x: CudaTensor, keep_prob: float = 0.5, seed: Optional[int] = None,
            return_mask: bool = False, out: Optional[CudaTensor] = None,
            mask: Optional[CudaTensor] = None) -> Union[CudaTensor, Tuple[CudaTensor, CudaTensor]]:
    """Dropout of x; returns the output, or (output, uint8 mask) with return_mask=True.
    out= / mask= (internal, tests) receive the results instead of new tensors."""
    if out is None and mask is None and type(x) is CudaTensor and type(keep_prob) is float \
            and type(return_mask) is bool:
        # the per-call plan (ops/common.py remember_plan): the seed is an argument of it,
        # not part of the key
        res = _planned(m, ("dropout", x.shape, x.dtype, x.device_id, keep_prob, return_mask),
                       x, seed)
        if res is not None:
            return res
    p = _checked(x, "tensor", "dropout", keep_prob)
    s = _seed(seed)
    for t, name, dt in ((out, "out", x.dtype), (mask, "mask", CudaDataType.UINT8)):
        if t is not None:
            common.check_tensor(t, name)
            if t.shape != x.shape or t.dtype is not dt:
                raise InvalidArgumentError(
                    f"{name} has shape {t.shape} ({t.dtype.name_str}), expected {x.shape} "
                    f"({dt.name_str})")
            common.same_device(x, t)
    key = None
    if out is None and mask is None and type(keep_prob) is float and type(return_mask) is bool:
        key = ("dropout", x.shape, x.dtype, x.device_id, keep_prob, return_mask)
    return _apply(m, x, p, s, return_mask, out, mask, key)


def dropout_backward(m: Any, grad_out: CudaTensor, keep_prob: float, seed: int) -> CudaTensor:
    """grad_out times the mask `dropout(x, keep_prob, seed)` drew, over keep_prob: the
    forward's kernel run on grad_out, which regenerates the same keep decisions (the same
    Philox words for the same seed and element index) and scales by the same 1 / keep_prob,
    so the result is grad_out * mask * scale as PyTorch's native_dropout_backward (a dropped
    NaN or inf gradient stays NaN). The seed must be the int the forward used."""
    if type(grad_out) is CudaTensor and type(keep_prob) is float and type(seed) is int:
        # the per-call plan (ops/common.py remember_plan): the seed is an argument of it
        res = _planned(m, ("dropout_backward", grad_out.shape, grad_out.dtype,
                           grad_out.device_id, keep_prob), grad_out, seed)
        if res is not None:
            return res
    p = _checked(grad_out, "grad_out", "dropout_backward", keep_prob)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InvalidArgumentError(
            f"dropout_backward needs the seed the forward dropout drew its mask with (an "
            f"int), got {seed!r}")
    key = None
    if type(keep_prob) is float:
        key = ("dropout_backward", grad_out.shape, grad_out.dtype, grad_out.device_id,
               keep_prob)
    return _apply(m, grad_out, p, _seed(seed), False, None, None, key)


@overload
def _apply(m: Any, x: CudaTensor, p: float, s: int, return_mask: Literal[False],
           out: Optional[CudaTensor], mask: Optional[CudaTensor],
           key: Optional[tuple]) -> CudaTensor: ...


@overload
def _apply(m: Any, x: CudaTensor, p: float, s: int, return_mask: bool,
           out: Optional[CudaTensor], mask: Optional[CudaTensor],
           key: Optional[tuple]) -> Union[CudaTensor, Tuple[CudaTensor, CudaTensor]]: ...


def _apply(m: Any, x: CudaTensor, p: float, s: int, return_mask: bool,
           out: Optional[CudaTensor], mask: Optional[CudaTensor],
           key: Optional[tuple]) -> Union[CudaTensor, Tuple[CudaTensor, CudaTensor]]:
    """Dropout of a checked x with keep probability p and 64-bit seed s (forward, or the
    backward on grad_out); key: the m.plans key a GPU call makes its plan under (None:
    none)."""
    dev = x.device_id
    if p == 1.0:
        y = out if out is not None else m.backend.empty(x.shape, x.dtype, dev)
        if x.nbytes:
            m.backend.copy_device_to_device(y, x, x.nbytes)
        if not return_mask:
            return y
        mk = mask if mask is not None else m.backend.empty(x.shape, CudaDataType.UINT8, dev)
        m.fill(mk, 1)
        return y, mk
    if not m.gpu:
        keep = host_mask(x.size, p, s).reshape(x.shape)
        work = np.float64 if x.dtype is CudaDataType.FLOAT64 else np.float32
        a = common.host_array(m, x).astype(work)
        scale = work(1.0 / p)
        with np.errstate(invalid="ignore"):  # inf * 0 is NaN, as on the GPU
            values = a * np.where(keep, scale, work(0))
        y = _store(m, values, x.dtype, dev, out)
        if not return_mask:
            return y
        return y, _store(m, keep.astype(np.uint8), CudaDataType.UINT8, dev, mask)
    y = out if out is not None else m.backend.empty(x.shape, x.dtype, dev)
    mk = None
    if return_mask:
        mk = mask if mask is not None else m.backend.empty(x.shape, CudaDataType.UINT8, dev)
    n = x.size
    if n:
        vec = _vec(x.dtype)
        chunk = max(4, vec)
        aligned = int(x.ptr % 16 == 0 and y.ptr % 16 == 0
                      and (mk is None or mk.ptr % chunk == 0))
        kernel = m.kernel(TEMPLATE, dev, **_params(x.dtype))
        grid = _grid(n, chunk)
        m.backend.launch_kernel(kernel.name, grid, x, y, mk if mk is not None else 0, n, s,
                                threshold_for(p), 1.0 / p, aligned,
                                block_size=(BLOCK, 1, 1), device_id=dev)
        if key is not None and key not in m.plans:
            common.remember_plan(m, key, _fast_plan(m, x, p, return_mask, kernel))
    return (y, mk) if mk is not None else y     # (mk: made when return_mask)


def _grid(n: int, chunk: int) -> int:
    """One chunk of max(4, vec) elements per thread."""
    chunks = -(-n // chunk)
    return max(1, min(-(-chunks // BLOCK), 2**31 - 1))


def _fast_plan(m: Any, x: CudaTensor, p: float, return_mask: bool, kernel: Any) -> Any:
    """The per-call plan of dropout on tensors shaped like x with keep probability p < 1
    (ops/common.py remember_plan): the seed checked and drawn as `_seed` does (anything but
    None or an int returns None: the general path checks it), the output (and mask)
    allocated, `aligned` from the pointers as dropout() computes it, one prepared launch."""
    dev, shape, dtype = x.device_id, x.shape, x.dtype
    n, nbytes = x.size, x.nbytes
    chunk = max(4, _vec(dtype))
    go = m.backend.prepare_launch(kernel, _grid(n, chunk), (BLOCK, 1, 1), 0, dev)
    thr, scale = threshold_for(p), 1.0 / p
    u8 = CudaDataType.UINT8
    pool = m.backend.memory_pools[dev]
    alloc = pool.allocate_current
    randbits = secrets.randbits
    chunk_mask = chunk - 1  # a power of two

    def run(x: CudaTensor, seed: Any) -> Any:
        px = x._ptr
        if px is None or x.stream is not None:
            return None
        if seed is None:
            s = randbits(64)
        elif type(seed) is int:
            s = seed % (1 << 64)
        else:
            return None
        y = pool_tensor(shape, dtype, dev, alloc(nbytes), pool, n, nbytes)
        py = y._ptr
        if return_mask:
            mk = pool_tensor(shape, u8, dev, alloc(n), pool, n, n)
            pm = mk._ptr
            go(px, py, pm, n, s, thr, scale, int(not (px | py) & 15 and not pm & chunk_mask))
            return y, mk
        go(px, py, 0, n, s, thr, scale, int(not (px | py) & 15))
        return y
    return run


def _store(m: Any, values: np.ndarray, dtype: CudaDataType, dev: int,
           target: Optional[CudaTensor]) -> CudaTensor:
    if target is None:
        return common.from_host(m, values, dtype, dev)
    from .common import write_host
    write_host(m, values, target)
    return target

