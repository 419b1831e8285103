"""Peers the tester compares against: NumPy on the CPU (the speed-up baseline), and CuPy and
PyTorch on the same GPU. A peer that cannot be imported, or has no GPU, is skipped and the
reason is recorded; it never stops the run.

Each case gives a NumPy-style function (used for NumPy and CuPy) and a PyTorch function; the
peer converts the case's host inputs (already rounded to the case dtype) to its own arrays on
the device. GPU peers are timed with the same CUDA events and L2 flush as our operations (they
share the device's primary context and its legacy default stream).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Iterator, Optional, Sequence

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
GPU_PEERS = ("cupy", "torch")
KNOWN_PEERS = ("numpy",) + GPU_PEERS


class PeerUnsupported(Exception):
    """The peer has no equivalent for this case (a dtype or setting it lacks)."""


class Peer:
    """One comparison library; `available` False comes with a `reason`."""

    def __init__(self, name: str, module: Any = None, reason: Optional[str] = None,
                 device_id: int = 0) -> None:
        self.name = name
        self.module = module
        self.reason = reason
        self.device_id = device_id

    @property
    def available(self) -> bool:
        return self.module is not None

    @property
    def on_gpu(self) -> bool:
        return self.name in GPU_PEERS

    @property
    def version(self) -> Optional[str]:
        return getattr(self.module, "__version__", None) if self.module else None

    def describe(self) -> Dict[str, Any]:
        return {"available": self.available, "version": self.version, "reason": self.reason,
                "device": "gpu" if self.on_gpu else "cpu"}

    # -- arrays ---------------------------------------------------------------------
    def array(self, host: np.ndarray, dtype: str) -> Any:
        """The peer's array holding host (values already representable in dtype)."""
        if self.name == "numpy":  # no bfloat16, and float16 is emulated (slow): use float32
            cpu = "float32" if dtype in ("bfloat16", "float16") else dtype
            return np.ascontiguousarray(host, dtype=_np_dtype(host, cpu))
        if self.name == "cupy":
            values = np.ascontiguousarray(host, _np_dtype(host, dtype))
            with self.module.cuda.Device(self.device_id):
                if dtype == "bfloat16" and host.dtype.kind == "f":
                    return _cupy_bfloat16(self.module, values)
                return self.module.asarray(values)
        torch = self.module
        t = torch.from_numpy(np.ascontiguousarray(host))
        tdt = getattr(torch, dtype) if host.dtype.kind == "f" else t.dtype
        return t.to(device=f"cuda:{self.device_id}", dtype=tdt)

    def synchronize(self) -> None:
        if self.name == "cupy":
            self.module.cuda.Device(self.device_id).synchronize()
        elif self.name == "torch":
            self.module.cuda.synchronize(self.device_id)

    def release_memory(self) -> None:
        """Give cached device memory back so our pool has room for the next case."""
        if self.name == "cupy":
            self.module.get_default_memory_pool().free_all_blocks()
        elif self.name == "torch":
            self.module.cuda.empty_cache()

    @contextlib.contextmanager
    def settings(self, precision: Optional[str]) -> Iterator[Dict[str, Any]]:
        """Set the peer's matmul precision to match ours for the case; yields what was set."""
        if self.name == "torch":
            b = self.module.backends
            old = (b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32)
            tf32 = precision == "tf32"
            b.cuda.matmul.allow_tf32 = b.cudnn.allow_tf32 = tf32
            try:
                yield {"torch.backends.cuda.matmul.allow_tf32": tf32,
                       "torch.backends.cudnn.allow_tf32": tf32}
            finally:
                b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32 = old
        elif self.name == "cupy":
            cupy_tf32 = os.environ.get("CUPY_TF32", "0") == "1"
            if precision is not None and (precision == "tf32") != cupy_tf32:
                raise PeerUnsupported(
                    f"CuPy's TF32 mode is fixed at import by CUPY_TF32 "
                    f"(={int(cupy_tf32)}), which does not match precision={precision}")
            yield {"CUPY_TF32": cupy_tf32} if precision is not None else {}
        else:
            yield {}


def _np_dtype(host: np.ndarray, dtype: str) -> Any:
    """Floating inputs take the case dtype (bfloat16: ml_dtypes'); integer inputs (indices)
    keep theirs."""
    if host.dtype.kind != "f":
        return host.dtype
    return BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)


def _cupy_bfloat16(cupy: Any, values: np.ndarray) -> Any:
    """A CuPy bfloat16 array of ml_dtypes.bfloat16 values, where this CuPy has bfloat16
    (it takes the ml_dtypes dtype); PeerUnsupported where it has not."""
    try:
        out = cupy.asarray(values)
    except (TypeError, ValueError, NotImplementedError) as exc:
        raise PeerUnsupported(
            f"CuPy {getattr(cupy, '__version__', '?')} has no bfloat16 arrays "
            f"({type(exc).__name__}: {exc})") from None
    if out.dtype != BFLOAT16:
        raise PeerUnsupported(
            f"CuPy {getattr(cupy, '__version__', '?')} made a {out.dtype} array of bfloat16 "
            f"values: it has no bfloat16")
    return out


def load_peers(names: Sequence[str], gpu: bool, device_id: int = 0) -> Dict[str, Peer]:
    """name -> Peer for each requested peer; unknown names raise ValueError."""
    peers: Dict[str, Peer] = {}
    for name in names:
        if name not in KNOWN_PEERS:
            raise ValueError(f"unknown peer {name!r} (known: {', '.join(KNOWN_PEERS)})")
        peers[name] = _load(name, gpu, device_id)
    return peers


def _load(name: str, gpu: bool, device_id: int) -> Peer:
    if name == "numpy":
        return Peer("numpy", np)
    if not gpu:
        return Peer(name, reason="fallback mode: no GPU to run it on")
    try:
        module = __import__(name)
    except Exception as exc:  # ImportError, or a broken CUDA install raising anything
        return Peer(name, reason=f"not importable ({type(exc).__name__}: {exc})")
    try:
        if name == "cupy":
            count = module.cuda.runtime.getDeviceCount()
        else:
            count = module.cuda.device_count() if module.cuda.is_available() else 0
    except Exception as exc:
        return Peer(name, reason=f"cannot reach the GPU ({type(exc).__name__}: {exc})")
    if count <= device_id:
        return Peer(name, reason=f"sees {count} GPUs, needs device {device_id}")
    return Peer(name, module, device_id=device_id)
