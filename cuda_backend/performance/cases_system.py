"""The transfers family: host<->device copies (pageable and pinned, both directions), a
device-to-device copy, pool allocation and kernel launch overhead, through the backend's
public calls. Sizes are bytes per copy; pool and launch cases are per call.
"""
from __future__ import annotations

from typing import Any, List

import numpy as np

from ..dtypes import CudaDataType
from .cases import Case, Context, Prepared

T = "transfers"
POOL_BYTES = 1 << 20
# The per-call host-cost cases (timed on the host clock, batched): `report --preset host`.
HOST_COST_OPS = ("allocate_memory", "launch_kernel")


def _random(ctx: Context, n: int, pinned: bool) -> np.ndarray:
    host = ctx.backend.pinned_empty((n,), np.float32) if pinned else np.empty(n, np.float32)
    host[:] = ctx.rng.standard_normal(n, dtype=np.float32)
    return host


def _equal(a: np.ndarray, b: np.ndarray):
    err = float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0
    scale = float(np.max(np.abs(b))) if b.size else 1.0
    return err, err / (scale or 1.0), None


def _h2d(nbytes: int, pinned: bool):
    def build(ctx: Context) -> Prepared:
        b, n = ctx.backend, nbytes // 4
        host = _random(ctx, n, pinned)
        dst = b.empty((n,), CudaDataType.FLOAT32, ctx.device_id)
        prep = Prepared(call=lambda: b.copy_to_device(host, dst), tensors=[dst], mode="copy",
                        in_bytes=nbytes, bytes_fn=lambda i, o: i)
        prep.verify = lambda: _equal(b.to_host(dst), host)
        prep.peer_factories = {
            "torch": lambda tm: _torch_copy(tm, host, pinned, to_device=True, dev=ctx.device_id),
            "cupy": lambda cp: _cupy_copy(cp, host, pinned, to_device=True),
        }
        return prep
    return build


def _d2h(nbytes: int, pinned: bool):
    def build(ctx: Context) -> Prepared:
        b, n = ctx.backend, nbytes // 4
        values = _random(ctx, n, False)
        src = b.to_device(values, ctx.device_id)
        host = b.pinned_empty((n,), np.float32) if pinned else np.empty(n, np.float32)
        prep = Prepared(call=lambda: b.copy_from_device(src, host), tensors=[src], mode="copy",
                        in_bytes=nbytes, bytes_fn=lambda i, o: i)

        def verify():
            b.copy_from_device(src, host)
            return _equal(host, values)
        prep.verify = verify
        prep.peer_factories = {
            "torch": lambda tm: _torch_copy(tm, values, pinned, to_device=False,
                                            dev=ctx.device_id),
            "cupy": lambda cp: _cupy_copy(cp, values, pinned, to_device=False),
        }
        return prep
    return build


def _torch_copy(tm: Any, values: np.ndarray, pinned: bool, to_device: bool, dev: int):
    host = tm.from_numpy(values.copy())
    if pinned:
        host = host.pin_memory()
    gpu = tm.empty(host.shape, dtype=host.dtype, device=f"cuda:{dev}")
    return (lambda: gpu.copy_(host)) if to_device else (lambda: host.copy_(gpu))


def _cupy_copy(cp: Any, values: np.ndarray, pinned: bool, to_device: bool):
    if pinned:
        import cupyx
        host = cupyx.empty_pinned(values.shape, values.dtype)
        host[...] = values
    else:
        host = values.copy()
    gpu = cp.empty(values.shape, values.dtype)
    return (lambda: gpu.set(host)) if to_device else (lambda: gpu.get(out=host))


def _dtod(nbytes: int):
    def build(ctx: Context) -> Prepared:
        b, n = ctx.backend, nbytes // 4
        values = _random(ctx, n, False)
        src = b.to_device(values, ctx.device_id)
        dst = b.empty((n,), CudaDataType.FLOAT32, ctx.device_id)
        prep = Prepared(call=lambda: b.copy_device_to_device(dst, src), tensors=[src, dst],
                        in_bytes=nbytes, bytes_fn=lambda i, o: 2 * i)
        prep.verify = lambda: _equal(b.to_host(dst), values)
        prep.cpu_fn = lambda xp, x: x.copy()
        prep.host_inputs = [values]
        prep.peer_factories = {"torch": lambda tm: _torch_dtod(tm, n, ctx.device_id),
                               "cupy": lambda cp: _cupy_dtod(cp, n)}
        return prep
    return build


def _torch_dtod(tm: Any, n: int, dev: int):
    a = tm.empty(n, device=f"cuda:{dev}")
    out = tm.empty_like(a)
    return lambda: out.copy_(a)


def _cupy_dtod(cp: Any, n: int):
    a = cp.empty(n, cp.float32)
    out = cp.empty_like(a)
    return lambda: cp.copyto(out, a)


def _pool(calls: int):
    def build(ctx: Context) -> Prepared:
        b, dev = ctx.backend, ctx.device_id
        prep = Prepared(call=lambda: b.free_memory(b.allocate_memory(POOL_BYTES, dev), dev),
                        mode="overhead", batch_calls=calls)
        prep.peer_factories = {
            "torch": lambda tm: (lambda: tm.empty(POOL_BYTES, dtype=tm.uint8,
                                                  device=f"cuda:{dev}")),
            "cupy": lambda cp: (lambda: cp.cuda.alloc(POOL_BYTES)),
        }
        return prep
    return build


def _launch(calls: int):
    def build(ctx: Context) -> Prepared:
        from ..kernels import get_kernel_generator
        b, dev = ctx.backend, ctx.device_id
        k = get_kernel_generator().get_kernel("empty.cu.j2", device_id=dev)
        buf = b.empty((1,), CudaDataType.FLOAT32, dev)
        name = k.name
        return Prepared(call=lambda: b.launch_kernel(name, (1,), buf, 1, block_size=(32,),
                                                     device_id=dev),
                        tensors=[buf], mode="overhead", batch_calls=calls,
                        notes=["no peer has an equivalent empty-kernel launch here"])
    return build


def system_cases(sizes: List[int], gpu: bool, quick: bool) -> List[Case]:
    cases: List[Case] = []
    for nbytes in sizes:
        nbytes = max(4, nbytes // 4 * 4)
        for pinned in (False, True):
            v = "pinned" if pinned else "pageable"
            cases.append(Case(T, "copy_to_device", "backend", v, "float32", nbytes,
                              _h2d(nbytes, pinned)))
            cases.append(Case(T, "copy_from_device", "backend", v, "float32", nbytes,
                              _d2h(nbytes, pinned)))
        cases.append(Case(T, "copy_device_to_device", "backend", "", "float32", nbytes,
                          _dtod(nbytes)))
    calls = 200 if quick else 2000
    cases.append(Case(T, "allocate_memory", "backend", "1 MiB + free_memory", "uint8",
                      POOL_BYTES, _pool(calls)))
    cases.append(Case(T, "launch_kernel", "backend", "empty kernel", "float32", 1,
                      _launch(calls),
                      skip_reason=None if gpu else "needs a GPU: fallback mode has no kernels"))
    return cases
