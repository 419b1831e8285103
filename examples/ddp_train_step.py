"""Data-parallel training of a linear model with MPI: `mpirun -np 2 python examples/ddp_train_step.py`.

Each rank holds a shard of the data on its GPU, computes the mean-squared-error gradient
there, all-reduces it (mean over ranks) and applies the same SGD step, so the parameters stay
identical on every rank. Prints the loss from rank 0 and checks the parameters agree.
"""
from __future__ import annotations

import sys

import numpy as np

from cuda_backend.cuda_math import get_cuda_math
from cuda_backend.distributed import Communicator


def main(steps: int = 20, n_per_rank: int = 4096, features: int = 64, lr: float = 0.1) -> int:
    comm = Communicator()
    m = get_cuda_math()
    rng = np.random.default_rng(1234 + comm.rank)  # each rank its own shard
    true_w = np.random.default_rng(0).standard_normal((features, 1)).astype(np.float32)
    x_host = rng.standard_normal((n_per_rank, features)).astype(np.float32)
    y_host = x_host @ true_w + 0.01 * rng.standard_normal((n_per_rank, 1)).astype(np.float32)
    x = m.from_numpy(x_host, device_id=comm.device_id)
    xt = m.matrix_transpose(x)
    y = m.from_numpy(y_host, device_id=comm.device_id)
    w = m.from_numpy(np.zeros((features, 1), np.float32), device_id=comm.device_id)
    comm.broadcast(w, root=0)
    for step in range(steps):
        residual = m.subtract(m.matrix_multiply(x, w), y)          # (n, 1)
        grad = m.multiply(m.matrix_multiply(xt, residual), 2.0 / n_per_rank)
        comm.all_reduce(grad, op="mean")
        w_new = m.subtract(w, m.multiply(grad, lr))
        w.free()
        w = w_new
        loss = float(m.to_numpy(m.reduce_mean(m.multiply(residual, residual))))
        if comm.rank == 0 and step % 5 == 0:
            print(f"step {step}: local loss {loss:.5f}")
    weights = comm.gather(w, root=0)
    if comm.rank == 0:
        same = all(np.array_equal(weights[0], wi) for wi in weights)
        err = float(np.abs(weights[0] - true_w).max())
        print(f"ranks {comm.size}, devices per host {comm.local_size}, cuda-aware MPI "
              f"{comm.cuda_aware}: parameters identical on every rank: {same}; "
              f"max |w - w_true| = {err:.4f}")
        return 0 if same and err < 0.05 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
