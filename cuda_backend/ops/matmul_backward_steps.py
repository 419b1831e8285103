"""The pieces both GEMM-gradient paths compose (ops/matmul_backward_layers.py: the linear
layers'; ops/matmul_backward.py: matmul_backward): views without a copy, freeing the results
already made when a later step raises, and the per-call plans (ops/common.py remember_plan):
running one, and a composed plan's step through the plan a first general call made.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from ..tensor import CudaTensor

Grads = Tuple[CudaTensor, CudaTensor, Optional[CudaTensor]]


def view(t: CudaTensor, shape: Tuple[int, ...]) -> CudaTensor:
    """The same memory under another C-contiguous shape of as many elements (no copy)."""
    if shape == t.shape:
        return t
    view = CudaTensor(shape, t.dtype, t.device_id, t.ptr, owner=t)
    view._host = None if t._host is None else t._host.reshape(shape)
    view.on_host = t.on_host
    view.stream = t.stream
    return view


def free_all(*tensors: Optional[CudaTensor]) -> None:
    for t in tensors:
        if t is not None:
            t.free()


def plan_ok(m: Any) -> bool:
    plans = getattr(m, "plans", None)
    return plans is not None and m.gpu and hasattr(m.backend, "prepare_launch")


def plan_step(m: Any, key: tuple, general: Callable) -> Callable:
    """A step of a composed plan: the plan under key (a matmul / matmul_tn / matmul_nt
    plan, taking (a, b, None)) where one was made, else the general function."""
    plan = m.plans.get(key)
    if plan is not None:
        return plan

    def call(a: CudaTensor, b: CudaTensor, _: Any) -> Optional[CudaTensor]:
        return general(m, a, b)
    return call



def run_plan(m: Any, key: Optional[tuple], *args: Any) -> Any:
    """The result of the per-call plan under key for args (args[0]: grad_out, on the launch
    device), or None: no key, no plan made yet, no direct launch, or the plan stepped aside
    (the general path runs)."""
    if key is not None:
        fast = getattr(m, "plans", {}).get(key)
        if fast is not None and m.backend.direct_launch(args[0].device_id):
            return fast(*args)
    return None
