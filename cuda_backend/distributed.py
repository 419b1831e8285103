"""Data parallelism across processes (and hosts) with MPI through mpi4py (extra `mpi`).

One rank per GPU: the device is chosen from the rank's index among the ranks of its host.
Collectives take CudaTensors. When the MPI library reports CUDA support, device buffers are
handed to MPI directly; otherwise they are staged through page-locked host buffers.
"""
from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from .backend import get_cuda_backend
from .errors import CudaNotAvailableError, InvalidArgumentError
from .tensor import CudaTensor


def _mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise CudaNotAvailableError(
            f"cuda_backend.distributed needs mpi4py (pip install 'cuda-backend[mpi]'): {exc}") from None
    return MPI


def mpi_cuda_aware() -> bool:
    """True if the MPI library says it can take device pointers."""
    MPI = _mpi()
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:
            return False
    return False


class Communicator:
    """An MPI communicator bound to this rank's GPU."""

    def __init__(self, comm: Any = None, cuda_aware: Optional[bool] = None) -> None:
        MPI = _mpi()
        self.MPI = MPI
        self.comm = comm or MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = local.Get_rank()
        self.local_size = local.Get_size()
        local.Free()
        self.backend = get_cuda_backend()
        count = max(self.backend.device_count, 1)
        self.device_id = self.local_rank % count
        self.backend.set_device(self.device_id)
        self.cuda_aware = mpi_cuda_aware() if cuda_aware is None else cuda_aware
        if not self.backend.is_available:
            self.cuda_aware = False

    def _ops(self, op: str) -> Any:
        table = {"sum": self.MPI.SUM, "max": self.MPI.MAX, "min": self.MPI.MIN,
                 "mean": self.MPI.SUM}
        if op not in table:
            raise InvalidArgumentError(f"op must be sum, max, min or mean, got {op!r}")
        return table[op]

    def _host(self, t: CudaTensor) -> np.ndarray:
        buf = self.backend.pinned_empty(t.shape, t.dtype)
        if t.size:
            self.backend.copy_from_device(t, buf)
        return buf

    def all_reduce(self, tensor: CudaTensor, op: str = "sum") -> CudaTensor:
        """Reduce tensor over all ranks, in place; every rank ends with the result."""
        tensor.check_alive()
        mpi_op = self._ops(op)
        if self.cuda_aware:
            self.backend.synchronize(tensor.device_id)
            self.comm.Allreduce(self.MPI.IN_PLACE, tensor, op=mpi_op)
        else:
            buf = self._host(tensor)
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=mpi_op)
            if tensor.size:
                self.backend.copy_to_device(buf, tensor)
        if op == "mean":
            from .cuda_math import get_cuda_math
            from .ops import elementwise as ew
            ew.binary(get_cuda_math(), "multiply", tensor, 1.0 / self.size, out=tensor)
        return tensor

    def broadcast(self, tensor: CudaTensor, root: int = 0) -> CudaTensor:
        """Copy root's tensor into every rank's tensor (same shape and dtype), in place."""
        tensor.check_alive()
        if self.cuda_aware:
            self.backend.synchronize(tensor.device_id)
            self.comm.Bcast(tensor, root=root)
        else:
            buf = self._host(tensor)
            self.comm.Bcast(buf, root=root)
            if tensor.size:
                self.backend.copy_to_device(buf, tensor)
        return tensor

    def gather(self, tensor: CudaTensor, root: int = 0) -> Optional[List[np.ndarray]]:
        """Every rank's tensor as host arrays on root (None elsewhere)."""
        tensor.check_alive()
        host = np.array(self._host(tensor))
        return self.comm.gather(host, root=root)

    def barrier(self) -> None:
        self.comm.Barrier()
