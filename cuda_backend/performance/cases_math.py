"""The CudaMath cases: one OpDef per operation and variant (vector and matrix families).

vector sizes are element counts of 1-D tensors; matrix sizes are n for n x n operands.
Inputs are drawn so each problem is well conditioned (positive values for log/sqrt and for
reductions, divisors away from zero), so an error above the threshold means a wrong kernel.
"""
from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from .cases import OpDef

# CudaMath methods that are tensor plumbing, not operations to benchmark (to_device moves a
# tensor between GPUs: perf/bench_multigpu.py measures that).
NON_OPS = ("create_tensor", "from_numpy", "to_numpy", "free_tensor", "from_cuda_array",
           "kernel", "benchmark_operations", "to_device", "from_dlpack")
EXTRA_DTYPES = ("float32", "float64", "float16", "bfloat16")


# -- inputs (drawn in float32: fast at 2^26 elements, exact in every case dtype) ---------
F32 = np.float32


def normal(k: int = 1):
    return lambda rng, n: [rng.standard_normal(n, dtype=F32) for _ in range(k)]


def uniform(lo: float, hi: float, k: int = 1):
    return lambda rng, n: [between(rng, lo, hi, n) for _ in range(k)]


def between(rng: np.random.Generator, lo: float, hi: float, shape: Any) -> np.ndarray:
    return (lo + (hi - lo) * rng.random(shape, dtype=F32)).astype(F32)


def summable(rng: np.random.Generator, n: int) -> List[np.ndarray]:
    """uniform [0, 1) scaled so the total stays <= 2^14: a float16/bfloat16 sum of 2^26
    elements must not overflow (float16's largest value is 65504)."""
    return [between(rng, 0.0, min(1.0, 2.0 ** 14 / max(n, 1)), n)]


def divisor_pair(rng: np.random.Generator, n: int) -> List[np.ndarray]:
    sign = np.where(rng.random(n, dtype=F32) < 0.5, F32(-1), F32(1))
    return [rng.standard_normal(n, dtype=F32), sign * between(rng, 0.5, 2.0, n)]


def power_pair(rng: np.random.Generator, n: int) -> List[np.ndarray]:
    return [between(rng, 0.5, 2.0, n), between(rng, -2.0, 2.0, n)]


def square(k: int = 1, lo: Optional[float] = None, hi: Optional[float] = None):
    def make(rng: np.random.Generator, n: int) -> List[np.ndarray]:
        if lo is None or hi is None:
            return [rng.standard_normal((n, n), dtype=F32) for _ in range(k)]
        return [between(rng, lo, hi, (n, n)) for _ in range(k)]
    return make


def row_broadcast(rng: np.random.Generator, n: int) -> List[np.ndarray]:
    return [rng.standard_normal((n, n), dtype=F32), rng.standard_normal(n, dtype=F32)]


def batched(rng: np.random.Generator, n: int) -> List[np.ndarray]:
    return [rng.standard_normal((4, n, n), dtype=F32) for _ in range(2)]


def skinny(rng: np.random.Generator, n: int) -> List[np.ndarray]:
    """(3, 4n+1) @ (4n+1, n): three rows, an odd inner length (n = 1024: K = 4097)."""
    k = 4 * n + 1
    return [rng.standard_normal((3, k), dtype=F32), rng.standard_normal((k, n), dtype=F32)]


# -- counts and checks ----------------------------------------------------------------
def elements(shapes) -> float:
    return float(max(int(np.prod(s)) for s in shapes))


def per_element(k: float):
    return lambda shapes: k * elements(shapes)


def matmul_flops(shapes) -> float:
    a, b = shapes
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def write_only(in_bytes: int, out_bytes: int) -> int:
    return out_bytes


def argmax_check(out, ref, inputs):
    """argmax may pick any maximal element: compare the values at our and NumPy's indices."""
    x = inputs[0]
    ours = np.asarray(out).astype(np.int64)
    theirs = np.asarray(ref).astype(np.int64)
    if ours.shape != theirs.shape:
        return float("inf"), float("inf"), f"output shape {ours.shape} != {theirs.shape}"
    if np.any(ours < 0) or np.any(ours >= x.shape[-1] if x.ndim > 1 else ours >= x.size):
        return float("inf"), float("inf"), "index out of range"
    if x.ndim == 1:
        err = abs(float(x[int(ours)]) - float(x[int(theirs)]))
    else:
        va = np.take_along_axis(x, ours[:, None], axis=-1)
        vb = np.take_along_axis(x, theirs[:, None], axis=-1)
        err = float(np.max(np.abs(va - vb)))
    scale = float(np.max(np.abs(x))) or 1.0
    return err, err / scale, None


def _fill(a: Any, v: float) -> Any:
    a.fill(v)
    return a


def softmax(xp: Any, x: Any, log: bool = False) -> Any:
    z = x - x.max(axis=-1, keepdims=True)
    if log:
        return z - xp.log(xp.exp(z).sum(axis=-1, keepdims=True))
    e = xp.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def sigmoid(xp: Any, x: Any) -> Any:
    return 1.0 / (1.0 + xp.exp(-x))


V, M = "vector", "matrix"
T32 = ("float32",)
ALL = EXTRA_DTYPES


def _binary(op: str, np_name: str, inputs=normal(2), dtypes=T32, torch_name=None):
    return OpDef(op, V, inputs, lambda c, a, b: getattr(c.math, op)(a, b),
                 cpu=lambda xp, a, b: getattr(xp, np_name)(a, b),
                 torch=lambda T, a, b: getattr(T, torch_name or np_name)(a, b),
                 dtypes=dtypes, flops=per_element(1))


def _unary(op: str, cpu, torch, inputs=normal(1), dtypes=T32, flops=1.0, tol=1.0):
    return OpDef(op, V, inputs, lambda c, x: getattr(c.math, op)(x), cpu=cpu, torch=torch,
                 dtypes=dtypes, flops=per_element(flops), tol_scale=tol)


def _reduce(op: str, np_name: str, torch_fn, family=V, axis=None, inputs=summable,
            dtypes=T32):
    variant = "" if axis is None else f"axis={axis}"
    kwargs = {} if axis is None else {"axis": axis}
    return OpDef(op, family, inputs if family == V else square(1, 0.0, 1.0),
                 lambda c, x: getattr(c.math, op)(x, **kwargs),
                 cpu=lambda xp, x: getattr(xp, np_name)(x, **kwargs),
                 torch=torch_fn, variant=variant, dtypes=dtypes, flops=per_element(1))


MATH_OPS: List[OpDef] = [
    # vector family: elementwise
    OpDef("vector_add", V, normal(2), lambda c, a, b: c.math.vector_add(a, b),
          cpu=lambda xp, a, b: a + b, torch=lambda T, a, b: a + b, dtypes=ALL,
          flops=per_element(1)),
    _binary("add", "add", dtypes=ALL),
    _binary("subtract", "subtract"),
    _binary("multiply", "multiply"),
    OpDef("multiply", V, normal(1), lambda c, a: c.math.multiply(a, 2.5),
          cpu=lambda xp, a: a * 2.5, torch=lambda T, a: a * 2.5, variant="scalar",
          flops=per_element(1)),
    _binary("divide", "divide", inputs=divisor_pair),
    _binary("maximum", "maximum"),
    _binary("minimum", "minimum"),
    _binary("power", "power", inputs=power_pair, torch_name="pow"),
    _unary("exp", lambda xp, x: xp.exp(x), lambda T, x: T.exp(x), dtypes=ALL),
    _unary("log", lambda xp, x: xp.log(x), lambda T, x: T.log(x), inputs=uniform(0.1, 10.0)),
    _unary("sqrt", lambda xp, x: xp.sqrt(x), lambda T, x: T.sqrt(x),
           inputs=uniform(0.1, 10.0)),
    _unary("abs", lambda xp, x: xp.abs(x), lambda T, x: T.abs(x)),
    _unary("tanh", lambda xp, x: xp.tanh(x), lambda T, x: T.tanh(x)),
    _unary("negative", lambda xp, x: -x, lambda T, x: -x),
    _unary("relu", lambda xp, x: xp.maximum(x, 0), lambda T, x: T.relu(x), dtypes=ALL),
    _unary("sigmoid", sigmoid, lambda T, x: T.sigmoid(x), flops=4.0),
    OpDef("fill", V, normal(1), lambda c, x: c.math.fill(x, 1.5),
          cpu=lambda xp, x: _fill(x, 1.5), torch=lambda T, x: x.fill_(1.5),
          bytes_fn=write_only),
    OpDef("zeros", V, normal(1), lambda c, x: c.math.zeros(x.shape, x.dtype, x.device_id),
          cpu=lambda xp, x: xp.zeros(x.shape, x.dtype),
          torch=lambda T, x: T.zeros(x.shape, dtype=x.dtype, device=x.device),
          bytes_fn=write_only),
    OpDef("ones", V, normal(1), lambda c, x: c.math.ones(x.shape, x.dtype, x.device_id),
          cpu=lambda xp, x: xp.ones(x.shape, x.dtype),
          torch=lambda T, x: T.ones(x.shape, dtype=x.dtype, device=x.device),
          bytes_fn=write_only),
    OpDef("copy", V, normal(1), lambda c, x: c.math.copy(x), cpu=lambda xp, x: x.copy(),
          torch=lambda T, x: x.clone()),
    # vector family: full reductions
    _reduce("reduce_sum", "sum", lambda T, x: x.sum(), dtypes=ALL),
    _reduce("reduce_max", "max", lambda T, x: x.max()),
    _reduce("reduce_min", "min", lambda T, x: x.min()),
    _reduce("reduce_mean", "mean", lambda T, x: x.mean()),
    OpDef("argmax", V, normal(1), lambda c, x: c.math.argmax(x),
          cpu=lambda xp, x: xp.argmax(x), torch=lambda T, x: x.argmax(), check=argmax_check,
          flops=per_element(1)),
    # matrix family
    OpDef("matrix_multiply", M, square(2), lambda c, a, b: c.math.matrix_multiply(a, b),
          cpu=lambda xp, a, b: a @ b, torch=lambda T, a, b: a @ b, dtypes=ALL,
          flops=matmul_flops, compute_unit="tensor"),
    OpDef("matrix_multiply", M, square(2),
          lambda c, a, b: c.math.matrix_multiply(a, b, precision="tf32"),
          cpu=lambda xp, a, b: a @ b, torch=lambda T, a, b: a @ b, variant="tf32",
          precision="tf32", compute_unit="tf32_tensor", flops=matmul_flops,
          quick_dtypes=("float32",)),
    OpDef("matrix_multiply", M, batched, lambda c, a, b: c.math.matrix_multiply(a, b),
          cpu=lambda xp, a, b: a @ b, torch=lambda T, a, b: a @ b, variant="batched 4",
          flops=matmul_flops, quick_dtypes=(), max_size=1024),
    OpDef("matrix_multiply", M, skinny, lambda c, a, b: c.math.matrix_multiply(a, b),
          cpu=lambda xp, a, b: a @ b, torch=lambda T, a, b: a @ b,
          variant="skinny (3,4n+1)@(4n+1,n)", flops=matmul_flops),
    OpDef("matrix_transpose", M, square(1), lambda c, x: c.math.matrix_transpose(x),
          cpu=lambda xp, x: xp.ascontiguousarray(x.T),
          torch=lambda T, x: x.t().contiguous()),
    OpDef("add", M, row_broadcast, lambda c, a, b: c.math.add(a, b),
          cpu=lambda xp, a, b: a + b, torch=lambda T, a, b: a + b, variant="row broadcast",
          flops=per_element(1)),
    OpDef("softmax", M, square(1), lambda c, x: c.math.softmax(x), cpu=softmax,
          torch=lambda T, x: T.softmax(x, dim=-1), dtypes=ALL, flops=per_element(5)),
    OpDef("log_softmax", M, square(1), lambda c, x: c.math.log_softmax(x),
          cpu=lambda xp, x: softmax(xp, x, log=True),
          torch=lambda T, x: T.log_softmax(x, dim=-1), flops=per_element(5)),
    _reduce("reduce_sum", "sum", lambda T, x: x.sum(dim=-1), family=M, axis=-1),
    _reduce("reduce_sum", "sum", lambda T, x: x.sum(dim=0), family=M, axis=0),
    _reduce("reduce_max", "max", lambda T, x: x.amax(dim=-1), family=M, axis=-1),
    _reduce("reduce_mean", "mean", lambda T, x: x.mean(dim=0), family=M, axis=0),
    _reduce("reduce_min", "min", lambda T, x: x.amin(dim=-1), family=M, axis=-1),
    OpDef("argmax", M, square(1), lambda c, x: c.math.argmax(x, axis=-1),
          cpu=lambda xp, x: xp.argmax(x, axis=-1), torch=lambda T, x: x.argmax(dim=-1),
          variant="axis=-1", check=argmax_check, flops=per_element(1)),
]



# -- shapes and indexing (ops/shape.py, ops/indexing.py) -------------------------------------
def qkv_rows(rng: np.random.Generator, n: int) -> List[np.ndarray]:
    """A transformer's fused QKV projection output (B=8, T=n/8, 3C=3*768): at n = 4096 the
    (8, 512, 2304) -> (3, 8, 12, 512, 64) head split."""
    return [rng.standard_normal((8, max(n // 8, 1), 3 * 768), dtype=F32)]


def _qkv_heads(xp: Any, x: Any) -> Any:
    return xp.ascontiguousarray(x.reshape(8, x.shape[1], 3, 12, 64).transpose(2, 0, 3, 1, 4))


def ties(k: int):
    """Small integers as floats, so that equal / less_equal see ties."""
    return lambda rng, n: [rng.integers(-3, 4, (n, n)).astype(F32) for _ in range(k)]


def where_inputs(rng: np.random.Generator, n: int) -> List[np.ndarray]:
    return [rng.random((n, n)) < 0.5, rng.standard_normal((n, n), dtype=F32),
            rng.standard_normal((n, n), dtype=F32)]


def embedding(rng: np.random.Generator, n: int) -> List[np.ndarray]:
    """A (n, 256) table and 4n int64 token ids."""
    return [rng.standard_normal((n, 256), dtype=F32), rng.integers(0, n, 4 * n)]


def embedding_grad(rng: np.random.Generator, n: int) -> List[np.ndarray]:
    """A zero (n, 256) gradient, 4n int64 token ids (repeats) and their (4n, 256) gradients."""
    return [np.zeros((n, 256), F32), rng.integers(0, n, 4 * n),
            rng.standard_normal((4 * n, 256), dtype=F32)]


def along_axis(rng: np.random.Generator, n: int) -> List[np.ndarray]:
    return [rng.standard_normal((n, n), dtype=F32), rng.integers(0, n, (n, 8))]


def _add_at(xp: Any, t: Any, i: Any, s: Any) -> Any:
    xp.add.at(t, i, s)
    return t


_SLICE = (slice(None, None, 2), slice(1, None))
_T_CMP = {"equal": "eq", "not_equal": "ne", "less": "lt", "less_equal": "le", "greater": "gt",
          "greater_equal": "ge"}
MATH_OPS += [
    OpDef("reshape", M, square(1), lambda c, x: c.math.reshape(x, (-1,)),
          cpu=lambda xp, x: x.reshape(-1), torch=lambda T, x: x.reshape(-1),
          bytes_fn=lambda i, o: 0),
    OpDef("view", M, square(1), lambda c, x: c.math.view(x, (x.shape[1], x.shape[0])),
          cpu=lambda xp, x: x.reshape(x.shape[1], x.shape[0]),
          torch=lambda T, x: x.view(x.shape[1], x.shape[0]), bytes_fn=lambda i, o: 0),
    OpDef("permute", M, square(1), lambda c, x: c.math.permute(x, (1, 0)),
          cpu=lambda xp, x: xp.ascontiguousarray(x.T),
          torch=lambda T, x: x.permute(1, 0).contiguous(), dtypes=ALL),
    OpDef("permute", M, qkv_rows,
          lambda c, x: c.math.permute(c.math.reshape(x, (8, x.shape[1], 3, 12, 64)),
                                      (2, 0, 3, 1, 4)),
          cpu=_qkv_heads, variant="qkv heads (8,n/8,2304)->(3,8,12,n/8,64)", dtypes=ALL,
          torch=lambda T, x: x.view(8, x.shape[1], 3, 12, 64).permute(2, 0, 3, 1, 4)
          .contiguous(), min_size=8),
    OpDef("transpose", M, square(1), lambda c, x: c.math.transpose(x),
          cpu=lambda xp, x: xp.ascontiguousarray(x.T), torch=lambda T, x: x.t().contiguous()),
    OpDef("getitem", M, square(1), lambda c, x: c.math.getitem(x, _SLICE),
          cpu=lambda xp, x: xp.ascontiguousarray(x[_SLICE]),
          torch=lambda T, x: x[_SLICE].contiguous(), variant="[::2, 1:]"),
    OpDef("concatenate", M, square(2), lambda c, a, b: c.math.concatenate([a, b], axis=1),
          cpu=lambda xp, a, b: xp.concatenate([a, b], axis=1),
          torch=lambda T, a, b: T.cat([a, b], dim=1), variant="axis=1"),
    OpDef("stack", M, square(2), lambda c, a, b: c.math.stack([a, b], axis=1),
          cpu=lambda xp, a, b: xp.stack([a, b], axis=1),
          torch=lambda T, a, b: T.stack([a, b], dim=1), variant="axis=1"),
    OpDef("split", M, square(1), lambda c, x: c.math.split(x, 2, axis=1),
          cpu=lambda xp, x: [xp.ascontiguousarray(p) for p in xp.split(x, 2, axis=1)],
          torch=lambda T, x: [p.contiguous() for p in T.chunk(x, 2, dim=1)],
          variant="2, axis=1"),
    OpDef("broadcast_to", M, normal(1), lambda c, v: c.math.broadcast_to(v, (v.size, v.size)),
          cpu=lambda xp, v: xp.broadcast_to(v, (v.size, v.size)).copy(),
          torch=lambda T, v: v.expand(v.numel(), v.numel()).contiguous(), variant="(n,)->(n,n)"),
    OpDef("astype", M, square(1), lambda c, x: c.math.astype(x, "float16"),
          cpu=lambda xp, x: x.astype(xp.float16), torch=lambda T, x: x.to(T.float16),
          variant="->float16", tol_scale=10.0),
    *[OpDef(op, M, ties(2), lambda c, a, b, op=op: getattr(c.math, op)(a, b),
            cpu=lambda xp, a, b, op=op: getattr(xp, op)(a, b),
            torch=lambda T, a, b, op=op: getattr(T, _T_CMP[op])(a, b))
      for op in ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal")],
    OpDef("where", M, where_inputs, lambda c, k, a, b: c.math.where(k, a, b),
          cpu=lambda xp, k, a, b: xp.where(k, a, b), torch=lambda T, k, a, b: T.where(k, a, b)),
    OpDef("take", M, embedding, lambda c, w, i: c.math.take(w, i, axis=0),
          cpu=lambda xp, w, i: xp.take(w, i, axis=0),
          torch=lambda T, w, i: T.index_select(w, 0, i), variant="embedding (n,256)[4n]"),
    OpDef("take", M, embedding, lambda c, w, i: c.math.take(w, i, axis=0, check_bounds=False),
          cpu=lambda xp, w, i: xp.take(w, i, axis=0),
          torch=lambda T, w, i: T.index_select(w, 0, i),
          variant="embedding (n,256)[4n], check_bounds=False"),
    OpDef("gather", M, along_axis, lambda c, x, i: c.math.gather(x, i, axis=1),
          cpu=lambda xp, x, i: xp.take_along_axis(x, i, axis=1),
          torch=lambda T, x, i: T.gather(x, 1, i), variant="(n,n) by (n,8), axis=1"),
    OpDef("scatter_add", M, embedding_grad,
          lambda c, t, i, s: c.math.scatter_add(t, i, s, axis=0), cpu=_add_at, cupy=False,
          torch_factory=lambda T, t, i, s: (lambda: t.index_add_(0, i, s)),
          result_inputs=(0,), variant="embedding backward (n,256) += [4n]"),
]
