"""Benchmark cases: what one measurement builds, calls, checks and counts.

An `OpDef` describes one API operation generically (how to make inputs for a size, how to
call ours, the NumPy/CuPy and PyTorch equivalents, bytes and FLOPs); `cases_math.py` and
`cases_ml.py` hold the tables, `cases_system.py` the copies, pool and launch cases,
`cases_training.py` the training steps of the examples' models. Adding an
operation to the report is adding one OpDef to a table. `plan()` turns the tables into the
list of `Case`s for a configuration, and `discover()` lists the API's operations so that one
without a case shows up in the report instead of being silently left out.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..dtypes import from_bfloat16_bits, to_bfloat16_bits

# Error thresholds are max_error_threshold x this scale (x the case's tol_scale).
DTYPE_SCALE = {"float64": 1e-4, "float32": 1.0, "float16": 100.0, "bfloat16": 200.0}
PRECISION_SCALE = {"tf32": 50.0}


@dataclass
class Context:
    """What case builders need: the APIs, the backend, a random generator, the device."""

    backend: Any
    math: Any
    ml: Any
    ml_module: Any
    device_id: int
    rng: np.random.Generator
    quick: bool


@dataclass
class Prepared:
    """A case ready to run. `call()` runs our operation once and returns its output."""

    call: Callable[[], Any]
    tensors: List[Any] = field(default_factory=list)     # ours, freed after the case
    host_inputs: List[np.ndarray] = field(default_factory=list)
    reference: Optional[Callable[[], np.ndarray]] = None  # float64
    result: Optional[Callable[[Any], np.ndarray]] = None
    check: Optional[Callable[[np.ndarray, np.ndarray, List[np.ndarray]],
                             Tuple[float, float, Optional[str]]]] = None
    verify: Optional[Callable[[], Tuple[float, float, Optional[str]]]] = None
    verify_reference: Optional[str] = None                 # what verify compares with
    cpu_fn: Optional[Callable[..., Any]] = None           # (np, *arrays)
    cupy_fn: Optional[Callable[..., Any]] = None          # (cupy, *arrays)
    torch_factory: Optional[Callable[..., Callable[[], Any]]] = None  # (torch, *tensors)
    peer_factories: Dict[str, Callable[[Any], Callable[[], Any]]] = field(default_factory=dict)
    in_bytes: int = 0
    bytes_fn: Optional[Callable[[int, int], int]] = None  # (in_bytes, out_bytes) -> bytes
    flops: Optional[float] = None
    mode: str = "kernel"        # kernel | copy (events, no flush) | overhead (host, batched)
    #                             | step (a training step: events, no flush, as in a loop)
    batch_calls: int = 1
    cleanup: List[Callable[[], None]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def free(self) -> None:
        for t in self.tensors:
            if hasattr(t, "free"):
                t.free()
        for fn in self.cleanup:
            fn()
        self.tensors, self.cleanup = [], []


@dataclass(frozen=True)
class OpDef:
    """One API operation, generically. Functions take host arrays/tensors in input order."""

    op: str
    family: str
    inputs: Callable[[np.random.Generator, int], List[np.ndarray]]
    call: Callable[..., Any]                       # (ctx, *our tensors) -> output
    cpu: Optional[Callable[..., Any]] = None       # (xp, *arrays): NumPy, and CuPy if cupy
    torch: Optional[Callable[..., Any]] = None     # (torch, *tensors) -> output
    torch_factory: Optional[Callable[..., Callable[[], Any]]] = None
    reference: Optional[Callable[..., Any]] = None  # (np, *float64 arrays); default cpu
    variant: str = ""
    api: str = "CudaMath"
    cupy: bool = True
    dtypes: Tuple[str, ...] = ("float32",)          # full runs
    quick_dtypes: Tuple[str, ...] = ("float32",)
    precision: Optional[str] = None
    compute_unit: Optional[str] = None              # default: fp64 for float64, else fp32
    flops: Optional[Callable[[List[Tuple[int, ...]]], float]] = None  # from input shapes
    bytes_fn: Optional[Callable[[int, int], int]] = None
    check: Optional[Callable[..., Tuple[float, float, Optional[str]]]] = None
    result_inputs: Optional[Tuple[int, ...]] = None  # in-place ops: which inputs hold results
    tol_scale: float = 1.0
    max_size: Optional[int] = None                  # skip sizes above this (CPU reference cost)
    min_size: int = 0


@dataclass
class Case:
    """One measurement: an operation (or a runtime path) at one size and dtype."""

    family: str
    op: str
    api: str
    variant: str
    dtype: str
    size: int
    build: Callable[[Context], Prepared]
    precision: Optional[str] = None
    compute_unit: Optional[str] = None
    tol_scale: float = 1.0
    skip_reason: Optional[str] = None

    @property
    def id(self) -> str:
        v = f"[{self.variant}]" if self.variant else ""
        return f"{self.family}/{self.op}{v}/{self.size}/{self.dtype}"

    def threshold(self, base: float) -> float:
        scale = PRECISION_SCALE.get(self.precision or "", DTYPE_SCALE.get(self.dtype, 1.0))
        return base * scale * self.tol_scale


# -- host values -----------------------------------------------------------------------
def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """Float inputs rounded to dtype, held compactly: float64 for float64 cases, else float32
    (float16 and bfloat16 values are exact in float32). The reference upcasts to float64."""
    if x.dtype.kind != "f":
        return x
    if dtype == "float64":
        return x.astype(np.float64)
    if dtype == "bfloat16":
        return from_bfloat16_bits(to_bfloat16_bits(x.astype(np.float32))).reshape(x.shape)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    return x.astype(np.float32, copy=False)


def to_float64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def compare(out: np.ndarray, ref: np.ndarray) -> Tuple[float, float, Optional[str]]:
    """(max |out - ref|, that / max |ref|, message or None). Shapes must match."""
    out, ref = to_float64(out), to_float64(ref)
    if out.shape != ref.shape:
        return float("inf"), float("inf"), f"output shape {out.shape} != reference {ref.shape}"
    if out.size == 0:
        return 0.0, 0.0, None
    if not np.all(np.isfinite(out)):
        bad = int(np.size(out) - np.count_nonzero(np.isfinite(out)))
        return float("inf"), float("inf"), f"{bad} non-finite values in the output"
    abs_err = float(np.max(np.abs(out - ref)))
    scale = float(np.max(np.abs(ref)))
    rel = abs_err / scale if scale > 0 else abs_err
    return abs_err, rel, None


# -- the generic builder for OpDef cases ------------------------------------------------
def _tensor(ctx: Context, host: np.ndarray, dtype: str) -> Any:
    m = ctx.math if ctx.math is not None else ctx.ml.math
    if host.dtype.kind == "f":
        return m.from_numpy(host, device_id=ctx.device_id, dtype=dtype)
    return m.from_numpy(host, device_id=ctx.device_id)


def _to_host(ctx: Context, t: Any) -> np.ndarray:
    m = ctx.math if ctx.math is not None else ctx.ml.math
    if isinstance(t, (tuple, list)):
        t = t[0]
    return to_float64(m.to_numpy(t))


def build_opdef(opdef: OpDef, size: int, dtype: str) -> Callable[[Context], Prepared]:
    """The builder of one OpDef case: inputs for `size`, rounded to `dtype`."""

    def build(ctx: Context) -> Prepared:
        masters = opdef.inputs(ctx.rng, size)
        host = [round_to(x, dtype) for x in masters]
        prep = Prepared(call=lambda: None, host_inputs=host)
        for h in host:
            prep.tensors.append(_tensor(ctx, h, dtype))
        ts = list(prep.tensors)
        prep.call = lambda: opdef.call(ctx, *ts)
        ref_fn = opdef.reference or opdef.cpu
        if ref_fn is not None:
            prep.reference = lambda: _reference(ref_fn, host, opdef.result_inputs)
        if opdef.result_inputs is not None:
            idx = opdef.result_inputs
            prep.result = lambda _out: np.concatenate(
                [_to_host(ctx, ts[i]).ravel() for i in idx])
        else:
            prep.result = lambda out: _to_host(ctx, out)
        prep.check = opdef.check
        prep.cpu_fn = opdef.cpu
        prep.cupy_fn = opdef.cpu if opdef.cupy else None
        torch_fn = opdef.torch
        prep.torch_factory = opdef.torch_factory or (
            (lambda T, *a: (lambda: torch_fn(T, *a))) if torch_fn is not None else None)
        prep.in_bytes = sum(int(t.nbytes) for t in ts)
        prep.bytes_fn = opdef.bytes_fn
        if opdef.flops is not None:
            prep.flops = float(opdef.flops([h.shape for h in host]))
        if dtype in ("bfloat16", "float16") and opdef.cpu is not None:
            prep.notes.append(f"NumPy has no fast {dtype}: the CPU time is for float32")
        return prep

    return build


def _reference(fn: Callable[..., Any], host: List[np.ndarray],
               result_inputs: Optional[Tuple[int, ...]]) -> np.ndarray:
    arrays = [h.astype(np.float64) if h.dtype.kind == "f" else h.copy() for h in host]
    out = fn(np, *arrays)
    if result_inputs is not None:
        return np.concatenate([to_float64(arrays[i]).ravel() for i in result_inputs])
    if isinstance(out, (tuple, list)):
        out = out[0]
    return to_float64(out)


# -- planning -------------------------------------------------------------------------
TENSOR_UNITS = {"float16": "fp16_tensor", "bfloat16": "bf16_tensor", "float64": "fp64_tensor",
                "float32": "fp32"}


def compute_unit(declared: Optional[str], dtype: str) -> str:
    """The compute ceiling a case is held to. 'tensor' means the tensor cores' for 16-bit
    and float64 inputs (matrix_multiply's float64 runs on DMMA on Hopper: the device's FP64
    ceiling is the tensor one), CUDA cores' for float32 unless the op says otherwise (e.g.
    'tf32_tensor'); without 'tensor', fp64 or fp32 CUDA cores."""
    if declared == "tensor":
        return TENSOR_UNITS.get(dtype, "fp32")
    return declared or ("fp64" if dtype == "float64" else "fp32")


def opdef_cases(table: Sequence[OpDef], sizes: Sequence[int], quick: bool) -> List[Case]:
    cases = []
    for d in table:
        for size in sizes:
            if (d.max_size is not None and size > d.max_size) or size < d.min_size:
                continue
            for dtype in (d.quick_dtypes if quick else d.dtypes):
                unit = compute_unit(d.compute_unit, dtype)
                cases.append(Case(d.family, d.op, d.api, d.variant, dtype, size,
                                  build_opdef(d, size, dtype), precision=d.precision,
                                  compute_unit=unit, tol_scale=d.tol_scale))
    return cases


def discover(cls: Any, non_ops: Sequence[str]) -> List[str]:
    """Public methods of an API class that are operations (not tensor plumbing)."""
    names = []
    for name, value in inspect.getmembers(cls):
        if name.startswith("_") or name in non_ops or isinstance(value, property):
            continue
        if callable(value):
            names.append(name)
    return sorted(names)


def matches(case: Case, wanted: Collection[str]) -> bool:
    """Whether `wanted` names the case: its op, family, 'family/op', 'op[variant]' or a
    prefix of its id."""
    keys = {case.op, case.family, f"{case.family}/{case.op}", f"{case.op}[{case.variant}]"}
    return bool(keys & set(wanted)) or any(case.id.startswith(w) for w in wanted)


def select(cases: List[Case], operations: Optional[Sequence[str]]) -> List[Case]:
    """Cases whose op, family, 'family/op' or id prefix is named in `operations`."""
    if not operations:
        return cases
    wanted = set(operations)
    return [c for c in cases if matches(c, wanted)]


def known_names(cases: List[Case]) -> List[str]:
    return sorted({c.op for c in cases} | {c.family for c in cases})
