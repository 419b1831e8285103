"""The reductions' GPU launches: the single-axis passes of one reduction (`gpu_reduce`), each
pass sized once per shape and kept in the CudaMath's plan cache, the per-call plan of the same
launches (ops/common.py remember_plan), and the ticket counters of split launches, one set
per device and stream. The sizing is ops/reduction_config.py's; the ops are ops/reduction.py's.
"""
from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Tuple

from .. import occupancy
from ..dtypes import CudaDataType
from ..streams import current_pycuda_stream
from ..tensor import CudaTensor, pool_tensor
from . import common
from .reduction_config import (AXIS_TEMPLATE, BLOCK, MAX_SPLIT_GROUPS, ROWS_TEMPLATE,
                               SPLIT_BLOCKS_PER_SM, axis_config, kernel_params, plan_passes,
                               result_dtype, rows_config)


# -- per-stream ticket counters of split launches ----------------------------------------------
COUNTERS = common.TicketCounters(MAX_SPLIT_GROUPS)


def gpu_reduce(m: Any, op: str, x: CudaTensor, axes: Tuple[int, ...], shape: Tuple[int, ...],
                dtype: CudaDataType, count: int, out: Optional[CudaTensor],
                key: Optional[tuple] = None) -> CudaTensor:
    """The passes over x; with `key` (a new result, see reduction._plan_key), the per-call plan of
    the same launches is kept in m.plans afterwards."""
    dev = x.device_id
    passes = plan_passes(x.shape, axes)
    if out is None:
        out = m.backend.empty(shape, dtype, dev)
    else:
        key = None
    steps = []
    cur = x
    for n, (outer, R, inner) in enumerate(passes):
        last = n == len(passes) - 1
        # Earlier passes of a mean are sums; only the last one divides by the full count.
        pop = op if last or op != "mean" else "sum"
        pdtype = result_dtype(cur.dtype, pop)
        target = out if last else m.backend.empty((outer * inner,), pdtype, dev)
        divisor = float(count) if (last and op == "mean") else 1.0
        steps.append((pop, cur.dtype, outer, R, inner, divisor,
                      0 if last else target.nbytes))
        try:
            _launch_pass(m, dev, pop, cur, target, outer, R, inner, divisor)
        except BaseException:
            if not last:
                target.free()
            raise
        finally:
            if cur is not x:
                cur.free()
        cur = target
    if key is not None:
        common.remember_plan(m, key, _fast_plan(m, dev, shape, dtype, steps))
    return out


def _fast_plan(m: Any, dev: int, shape: Tuple[int, ...], dtype: CudaDataType,
               steps: List[tuple]) -> Any:
    """The per-call plan of one reduction (ops/common.py remember_plan): the result's
    allocation, then per pass (op, input dtype, outer, R, inner, divisor, intermediate
    bytes or 0 for the last) what gpu_reduce and _launch_pass do: the intermediate's and
    the partials' allocations, one PreparedLaunch, the frees in the same order. A pass over
    a middle axis sizes by its input's 16-byte alignment: both variants are prepared on
    first use."""
    pool = m.backend.memory_pools[dev]
    alloc, release = pool.allocate_current, pool.release
    size = math.prod(shape)
    nbytes = size * dtype.itemsize
    variant = _variant_source(m, dev)
    plan_steps = _plan_steps(variant, steps)
    ticket_counters = _ticket_counter_source(m, dev)

    def run(x: CudaTensor) -> Optional[CudaTensor]:
        px = x._ptr
        if px is None or x.stream is not None:   # (the launcher would record_stream it)
            return None
        res = pool_tensor(shape, dtype, dev, alloc(nbytes, None), pool, size, nbytes)
        cur, cur_block = px, None
        for variants, spec, divisor, tmp_bytes in plan_steps:
            aligned = cur % 16 == 0
            v = variants.get(aligned)
            if v is None:
                v = variants[aligned] = variant(*spec, aligned)
            go, part_bytes, args = v
            try:
                if tmp_bytes:
                    target_block = alloc(tmp_bytes, None)
                    target = int(target_block)
                else:
                    target_block, target = None, res._ptr
                try:
                    if part_bytes:
                        part = alloc(part_bytes, None)
                        try:
                            go(cur, target, int(part), ticket_counters(), *args, divisor)
                        finally:
                            release(part)   # stream-ordered (memory.py)
                    else:
                        go(cur, target, 0, 0, *args, divisor)
                except BaseException:
                    if target_block is not None:
                        release(target_block)
                    raise
            finally:
                if cur_block is not None:
                    release(cur_block)
            cur, cur_block = target, target_block
        return res
    return run


def _variant_source(m: Any, dev: int) -> Callable[..., tuple]:
    """variant(op, dtype, outer, R, inner, aligned) for _fast_plan: one pass's PreparedLaunch,
    partials bytes (at least 16, or 0 without partials) and integer arguments."""
    backend = m.backend

    def variant(pop: str, pdtype: CudaDataType, outer: int, R: int, inner: int,
                aligned: bool) -> tuple:
        p = _pass_for(m, dev, pop, pdtype, outer, R, inner, aligned)
        go = backend.prepare_launch(backend.get_kernel(p.name, dev), p.grid, p.block, 0, dev)
        return go, max(p.part_bytes, 16) if p.part_bytes else 0, p.args
    return variant


def _plan_steps(variant: Callable[..., tuple], steps: List[tuple]) -> List[tuple]:
    """_fast_plan's passes: (variants by input alignment, the pass's spec, divisor,
    intermediate bytes); a rows pass (inner 1) is prepared now for both alignments, a
    middle-axis pass per alignment on first use."""
    plan_steps = []
    for pop, pdtype, outer, R, inner, divisor, tmp_bytes in steps:
        if inner == 1:   # rows: the sizing does not depend on alignment
            v = variant(pop, pdtype, outer, R, inner, True)
            variants = {True: v, False: v}
        else:
            variants = {}
        plan_steps.append((variants, (pop, pdtype, outer, R, inner), divisor, tmp_bytes))
    return plan_steps


def _ticket_counter_source(m: Any, dev: int) -> Callable[[], int]:
    """ticket_counters() for _fast_plan's run: this device's counters for direct launches
    (no stream), made again once evicted (freed)."""
    counters: List[Any] = [None]

    def ticket_counters() -> int:
        t = counters[0]
        if t is None or t._ptr is None:   # evicted (freed) ones are made again
            t = counters[0] = COUNTERS.get(m, dev, None)
        return t._ptr
    return ticket_counters


class _Pass:
    """A planned launch: kernel, grid, block, the integer arguments and the partials size."""

    __slots__ = ("name", "grid", "block", "args", "part_bytes")

    def __init__(self, name: str, grid: Tuple[int, int, int], block: Tuple[int, int, int],
                 args: Tuple[int, ...], part_bytes: int) -> None:
        self.name, self.grid, self.block, self.args, self.part_bytes = \
            name, grid, block, args, part_bytes


def _pass_for(m: Any, dev: int, op: str, dtype: CudaDataType, outer: int, R: int, inner: int,
              aligned: bool) -> _Pass:
    """The sizing of one pass, kept in the CudaMath's plan cache (m.plans, under
    "reduce_pass": ops/common.py) per device, dtype, op, shape and input alignment."""
    key = ("reduce_pass", dev, dtype, op, outer, R, inner, aligned)
    p = m.plans.get(key)
    if p is None:
        p = common.remember_plan(m, key, _plan_pass(m, dev, op, dtype, outer, R, inner,
                                                     aligned))
    return p


def _launch_pass(m: Any, dev: int, op: str, x: CudaTensor, out: CudaTensor, outer: int, R: int,
                 inner: int, divisor: float) -> None:
    """One single-axis pass: out[outer][inner] = op over R of x[outer][R][inner]. The
    sizing is planned once per shape (_pass_for)."""
    p = _pass_for(m, dev, op, x.dtype, outer, R, inner, x.ptr % 16 == 0)
    part = _partials(m, dev, p.part_bytes) if p.part_bytes else None
    try:
        m.backend.launch_kernel(
            p.name, p.grid, x, out, 0 if part is None else part,
            0 if part is None else COUNTERS.get(m, dev, current_pycuda_stream(dev)),
            *p.args, divisor, block_size=p.block, device_id=dev)
    finally:
        if part is not None:
            part.free()  # stream-ordered (memory.py): reused only after this kernel


def _plan_pass(m: Any, dev: int, op: str, dtype: CudaDataType, outer: int, R: int, inner: int,
               aligned: bool) -> _Pass:
    params = kernel_params(dtype, op)
    acc_bytes = 16 if op == "argmax" else (8 if params["acc"] in ("double", "long long") else 4)
    info = m.backend.get_device_info(dev)
    itemsize = dtype.itemsize
    if inner == 1:
        kernel = m.kernel(ROWS_TEMPLATE, dev, **params)
        wave = info.multiprocessor_count * min(SPLIT_BLOCKS_PER_SM,
                                               occupancy.blocks_per_sm(kernel, info, BLOCK))
        group, splits, grid = rows_config(outer, R, itemsize, wave)
        return _Pass(kernel.name, (grid, 1, 1), (BLOCK, 1, 1), (outer, R, group, splits),
                     outer * splits * acc_bytes if splits > 1 else 0)
    kernel = m.kernel(AXIS_TEMPLATE, dev, **params)
    cfg = axis_config(outer, R, inner, itemsize, aligned, 0)
    wave = info.multiprocessor_count * min(SPLIT_BLOCKS_PER_SM,
                                           occupancy.blocks_per_sm(kernel, info,
                                                                   cfg["bx"] * cfg["by"]))
    cfg = axis_config(outer, R, inner, itemsize, aligned, wave)
    splits = cfg["splits"]
    return _Pass(kernel.name, (cfg["groups"], splits, 1), (cfg["bx"], cfg["by"], 1),
                 (outer, R, inner, cfg["tiles"], splits, cfg["rows_per_split"], cfg["vec_on"]),
                 cfg["groups"] * splits * cfg["width"] * acc_bytes if splits > 1 else 0)


def _partials(m: Any, dev: int, nbytes: int) -> CudaTensor:
    return m.backend.empty((max(nbytes, 16),), CudaDataType.UINT8, dev)
