"""Which CudaMath a tensor's operators run on: the registry of one CudaMath per backend
(`register_math`, `set_math_factory`, `math_for`) and the per-call lookup of a tensor's
(`math_of`, `backend_of`), kept apart from tensor.py so that CudaTensor needs no import of
cuda_math. tests/test_tensor_ownership.py checks which backend's math an operator uses.
"""
from __future__ import annotations

from typing import Any, Optional

# -- the math a tensor's operators use ------------------------------------------------------
# A tensor's operators (a + b, a @ b, a.T, -a, .numpy(), .to()) run on the backend that made
# it: its pool's `owner` (set by CudaBackend), else (no pool: from_cuda_array wrappers,
# zero-size tensors) the process backend. The CudaMath for a backend is the first one made
# for it (CudaMath.__init__ calls register_math), else one the factory that cuda_math
# registers at import makes on first use; so neither this module nor tensor.py imports
# cuda_math (this one loads the module by name only if an operator runs before anything
# imported it).
# A plain dict, keyed by identity: weak keys would not free anything here, since each value
# (a CudaMath) holds its key (math.backend), and atexit holds every backend's shutdown.
_MATHS: dict = {}
_math_factory: Optional[Any] = None


def register_math(backend: Any, math_: Any) -> None:
    """Make math_ the CudaMath of backend's tensors, unless one already is (first wins)."""
    _MATHS.setdefault(backend, math_)


def set_math_factory(factory: Any) -> None:
    """factory(backend) -> a CudaMath for it (called by cuda_math at import)."""
    global _math_factory
    _math_factory = factory


def math_of(t: Any) -> Any:
    """The CudaMath of t's backend (the operators' per-call path: two lookups)."""
    pool = t._pool
    if pool is not None:
        m = _MATHS.get(pool.owner)
        if m is not None:
            return m
    return math_for(backend_of(t))


def backend_of(t: Any) -> Any:
    """The backend whose pool t's memory came from, else the process backend."""
    pool = t._pool
    backend = None if pool is None else pool.owner
    if backend is None:
        t.check_alive()   # a freed tensor: the error the operation would raise, no backend
        from .backend import get_cuda_backend
        backend = get_cuda_backend()
    return backend


def math_for(backend: Any) -> Any:
    """The CudaMath registered for backend, made (and registered) on first use."""
    m = _MATHS.get(backend)
    if m is None:
        if _math_factory is None:
            # cuda_math registers the factory when imported; nothing imported it yet
            import importlib
            importlib.import_module(__package__ + ".cuda_math")
        m = _MATHS.get(backend)
        if m is None:
            assert _math_factory is not None    # (importing cuda_math registered it)
            _math_factory(backend)   # CudaMath.__init__ registers it (or a racing one won)
            m = _MATHS[backend]
    return m
