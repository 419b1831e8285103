"""Row-wise ops and transpose: every kernel variant timed directly, against PyTorch and the
copy bandwidth.

    python3 perf/sweep_rows.py [--out sweep_rows.json] [--reps 20] [--only softmax,transpose]

For softmax / log_softmax, layer_norm and matrix_transpose at the target shapes it times every
candidate the op module offers (launched directly, bypassing its rule or autotuner; transpose
also at other block orders), the default path (the public call), PyTorch's equivalent and a
device-to-device copy of the same bytes. Every kernel is compiled first, in parallel threads.

Timing: `cuda_backend.performance.timing.DeviceTimer` (CUDA events around single calls, median
of --reps after warm-up) with the L2 flushed before each call, two ways, each long enough
(>= 256 MiB of GPU work) to hide the Python launch overhead behind it:
  memset: the flush buffer is written (the project's protocol); L2 then holds dirty lines of
          it, which are written back during the timed call.
  clean:  the same, then a second buffer is read (a reduction), so L2 holds clean lines only.
Each variant's output (first poisoned with NaN bits) is compared with a NumPy float64
reference: rel_err = max |out - ref| / max |ref| (transpose: exact equality, rel_err 0).

Columns: ms and GB/s (bytes read + written once) under the memset flush, the fraction of the
2 GiB copy bandwidth and of a copy of the same bytes under the same flush, torch_ms / ms, the
same two under the clean flush, rel_err, registers per thread of the kernel. `*` marks the
variant the default path chose. The last lines summarize each case: the default path's choice
and the fastest variant. --out writes JSON after every case.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cuda_backend import CudaDataType as DT  # noqa: E402
from cuda_backend.ops import common  # noqa: E402
from cuda_backend.ops import normalization as nm  # noqa: E402
from cuda_backend.ops import layer_norm_plans as lp  # noqa: E402
from cuda_backend.ops import softmax as sm  # noqa: E402
from cuda_backend.ops import transpose as tr  # noqa: E402
from cuda_backend.performance.timing import DeviceTimer  # noqa: E402
from cuda_backend.profiling import write_json_atomic  # noqa: E402

FLUSH_BYTES = 256 << 20
COPY_BYTES = 1 << 31
EPS = 1e-5
TOL = {"float32": 1e-5, "bfloat16": 1e-2}
SOFTMAX = [((8192, 4096), DT.FLOAT32), ((65536, 1024), DT.FLOAT32), ((4096, 8192), DT.FLOAT32),
           ((1024, 16384), DT.FLOAT32), ((8192, 4096), DT.BFLOAT16)]
LAYER_NORM = [((8192, 4096), DT.FLOAT32), ((65536, 1024), DT.FLOAT32),
              ((8192, 4096), DT.BFLOAT16)]
TRANSPOSE = [((8192, 8192), DT.FLOAT32), ((4096, 4096), DT.FLOAT32), ((8191, 8193), DT.FLOAT32),
             ((8192, 8192), DT.BFLOAT16)]
EXTRA_GROUPS = (4, 64)  # transpose block orders timed besides the candidates' (GROUP and 0)
HOST_THREADS = max(1, min(16, os.cpu_count() or 1))


class FlushTimer(DeviceTimer):
    """DeviceTimer with a flush of >= 256 MiB (memset); clean=True also reads a second
    buffer of that size, so that L2 holds no dirty lines when the timed call starts."""

    def __init__(self, m: Any, clean: bool) -> None:
        b = m.backend
        super().__init__(b, 0, flush_l2=True, min_flush_bytes=FLUSH_BYTES)
        self._m = m
        self._read = b.empty((self.flush_bytes // 4,), DT.FLOAT32, 0) if clean else None

    def flush(self) -> None:
        super().flush()
        if self._read is not None:
            self._m.reduce_max(self._read).free()

    def flush_description(self) -> str:
        what = f"memset of {self.flush_bytes >> 20} MiB"
        return what + (f", then a read of another {self.flush_bytes >> 20} MiB"
                       if self._read is not None else "") + " before each timed call"

    def close(self) -> None:
        super().close()
        if self._read is not None:
            self._read.free()
            self._read = None


class Variant:
    """One way to compute a case: launch() writes into the case's preallocated output."""

    def __init__(self, name: str, launch: Callable[[], Any], jobs: List[Tuple[str, dict]],
                 default: bool = False) -> None:
        self.name, self.launch, self.jobs, self.default = name, launch, jobs, default


def median_ms(timer: FlushTimer, fn: Callable[[], Any], reps: int) -> float:
    return timer.median_ms(fn, warmup=3, iterations=reps)


def by_rows(fn: Callable[..., Any], *arrays: np.ndarray) -> List[Any]:
    """fn over matching row chunks of the arrays, in threads (NumPy releases the GIL)."""
    n = arrays[0].shape[0]
    step = -(-n // HOST_THREADS)
    with ThreadPoolExecutor(HOST_THREADS) as pool:
        return list(pool.map(lambda i: fn(*(a[i:i + step] for a in arrays)), range(0, n, step)))


def max_abs_diff(out: np.ndarray, ref: np.ndarray) -> float:
    if not np.isfinite(out).all():  # the references here are finite
        return float("inf")
    d = np.subtract(out, ref, dtype=np.float64)
    return float(np.abs(d, out=d).max())


def rel_err(out: np.ndarray, ref: np.ndarray, scale: float) -> float:
    """max |out - ref| / scale, scale = max |ref|; inf where out is not finite."""
    return max(by_rows(max_abs_diff, out, ref)) / scale


def host_values(shape: Tuple[int, ...], dtype: DT, seed: int) -> np.ndarray:
    """Standard normal float32 values exactly representable in dtype."""
    a = np.empty(shape, np.float32)
    seeds = iter(np.random.SeedSequence(seed).spawn(HOST_THREADS + 1))

    def fill(chunk: np.ndarray) -> None:
        np.random.default_rng(next(seeds)).standard_normal(chunk.shape, np.float32, out=chunk)
        if dtype is DT.BFLOAT16:
            from cuda_backend.dtypes import from_bfloat16_bits, to_bfloat16_bits
            chunk[...] = from_bfloat16_bits(to_bfloat16_bits(chunk)).reshape(chunk.shape)
    by_rows(fill, a.reshape(-1, shape[-1]))
    return a


def softmax_refs(a: np.ndarray) -> Dict[bool, np.ndarray]:
    """float64 softmax and log_softmax of the rows of a."""
    sm_ref, log_ref = np.empty(a.shape), np.empty(a.shape)

    def rows(x: np.ndarray, s_out: np.ndarray, l_out: np.ndarray) -> None:
        z = x.astype(np.float64)
        z -= z.max(axis=-1, keepdims=True)
        np.exp(z, out=s_out)
        s = s_out.sum(axis=-1, keepdims=True)
        s_out /= s
        np.subtract(z, np.log(s), out=l_out)
    by_rows(rows, a, sm_ref, log_ref)
    return {False: sm_ref, True: log_ref}


def layer_norm_ref(a: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float64 layer norm of the rows of a (biased variance, EPS)."""
    ref = np.empty(a.shape)

    def rows(x: np.ndarray, out: np.ndarray) -> None:
        z = x.astype(np.float64)
        z -= z.mean(axis=-1, keepdims=True)
        out[...] = z / np.sqrt((z * z).mean(axis=-1, keepdims=True) + EPS) * w + b
    by_rows(rows, a, ref)
    return ref


def transposed(a: np.ndarray) -> np.ndarray:
    """A contiguous copy of a.T."""
    out = np.empty(a.shape[::-1], a.dtype)

    def copy(o: np.ndarray, x: np.ndarray) -> None:
        o[...] = x
    by_rows(copy, out, a.T)
    return out


def summarize(cases: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per (op, shape, dtype): the variant the default path chose and the fastest one
    (memset flush), with their fractions of copy bandwidth and ratios to torch."""
    out: Dict[str, Dict[str, Any]] = {}
    for row in cases:
        if "error" in row or row["variant"] in ("torch", "copy of the same bytes",
                                                 "default path"):
            continue
        key = f"{row['op']} {row['shape']} {row['dtype']}"
        r = out.setdefault(key, {"best_ms": float("inf"), "chosen": "", "max_rel_err": 0.0})
        r["max_rel_err"] = max(r["max_rel_err"], row["rel_err"])
        for tag, hit in (("best", row["ms_memset"] < r["best_ms"]), ("chosen", row["chosen"])):
            if hit:
                r.update({tag: row["variant"], f"{tag}_ms": row["ms_memset"],
                          f"{tag}_copy": row["frac_copy_memset"],
                          f"{tag}_same": row["frac_same_copy_memset"],
                          f"{tag}_torch": row["vs_torch_memset"],
                          f"{tag}_copy_clean": row["frac_copy_clean"],
                          f"{tag}_torch_clean": row["vs_torch_clean"]})
    return {k: r for k, r in out.items() if r["chosen"]}


def torch_dtype(dtype: DT) -> Any:
    import torch
    return {DT.FLOAT32: torch.float32, DT.BFLOAT16: torch.bfloat16}[dtype]


# -- variants per op (the kernels' template jobs are compiled up front) --------------------
def softmax_variants(m: Any, x: Any, out: Any, log: bool, limit: int) -> List[Variant]:
    K = x.shape[-1]
    cands = sm.candidates(K, x.dtype.itemsize, limit)
    out_vars = []
    for i, p in enumerate(cands):
        params = sm.kernel_params(x.dtype, p["mode"], p["nv"], p["threads"], bool(p["prefetch"]))
        name = p["mode"] + (f" {p['threads']}x{p['nv']}" if p["mode"] == "block" else "") + \
            (" prefetch" if p["prefetch"] else "") + \
            (f" nv={p['nv']} group={p['group']}" if p["mode"] == "warp" else "")

        def launch(p: Dict[str, int] = p) -> None:
            sm.launch(m, sm.prepare(m, p, x.dtype, x.device_id), x, out, log)
        out_vars.append(Variant(name, launch, [(sm.TEMPLATE, params)], default=i == 0))
    out_vars.append(Variant("default path", lambda: sm.softmax(m, x, log=log, out=out), []))
    return out_vars


def ln_variants(m: Any, x: Any, w: Any, b: Any, out: Any) -> List[Variant]:
    rows, D = x.shape
    out_vars = []
    for cfg in lp.ln_candidates(D, x.dtype, True):
        tpr, vpt, blk, vec, pf = cfg
        params = lp.ln_params(x.dtype, tpr, vpt, blk, vec, bool(pf))
        name = f"tpr={tpr} vpt={vpt} block={blk}" + (" prefetch" if pf else "")

        def launch(cfg: Tuple[int, ...] = cfg) -> None:
            lp.ln_launch(m, cfg, x, out, w, b, rows, D, EPS)
        out_vars.append(Variant(name, launch, [(lp.LN_TEMPLATE, params)]))
    out_vars.append(Variant("default path", lambda: nm.layer_norm(m, x, w, b, EPS, out=out), []))
    return out_vars


def tr_name(cfg: Dict[str, int]) -> str:
    if cfg["kernel"] == "tile":
        return f"tile {cfg['tile']}x{cfg['block_rows']}"
    return f"vec {cfg['vec_bytes']}B tile={cfg['tile']} threads={cfg['threads']} " \
        f"group={cfg['group']}"


def tr_variants(m: Any, x: Any, out: Any) -> List[Variant]:
    rows, cols = x.shape
    cands = tr.candidates(x.dtype, rows, cols, x.ptr, out.ptr)
    cands += [dict(cands[0], group=g) for g in EXTRA_GROUPS]
    out_vars = []
    for cfg in cands:
        def launch(cfg: Dict[str, int] = cfg) -> None:
            tr._launch(m, cfg, x, out, 1, rows, cols)
        out_vars.append(Variant(tr_name(cfg), launch,
                                [(tr.TEMPLATE, tr.config_params(x.dtype, cfg))]))
    out_vars.append(Variant("default path", lambda: tr.transpose(m, x, out=out), []))
    return out_vars


def compile_jobs(m: Any, limit: int, only: List[str]) -> List[Tuple[str, dict]]:
    """Every kernel the sweep launches (alignment as for fresh, 256-byte aligned tensors)."""
    jobs = []
    if "softmax" in only:
        for (rows, K), dt in SOFTMAX:
            for p in sm.candidates(K, dt.itemsize, limit):
                jobs.append((sm.TEMPLATE, sm.kernel_params(dt, p["mode"], p["nv"], p["threads"],
                                                           bool(p["prefetch"]))))
    if "layer_norm" in only:
        for (rows, D), dt in LAYER_NORM:
            for tpr, vpt, blk, vec, pf in lp.ln_candidates(D, dt, True):
                jobs.append((lp.LN_TEMPLATE, lp.ln_params(dt, tpr, vpt, blk, vec, bool(pf))))
    if "transpose" in only:
        for (rows, cols), dt in TRANSPOSE:
            for cfg in tr.candidates(dt, rows, cols, 0, 0):
                jobs.append((tr.TEMPLATE, tr.config_params(dt, cfg)))
    unique = {}
    for t, p in jobs:
        unique[(t, tuple(sorted(p.items())))] = (t, p)
    return list(unique.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", default="softmax,layer_norm,transpose",
                    help="comma-separated subset of softmax,layer_norm,transpose")
    args = ap.parse_args()
    only = args.only.split(",")
    t_start = time.perf_counter()

    import pycuda.driver as drv
    import torch
    import torch.nn.functional as F
    from cuda_backend.cuda_math import get_cuda_math

    m = get_cuda_math()
    b = m.backend
    assert b.is_available, b.fallback_reason
    info = b.get_device_info(0)
    limit = int(info.shared_memory_per_block_optin) - 1024
    R = max(20, args.reps)

    jobs = compile_jobs(m, limit, only)
    t0 = time.perf_counter()
    common.compile_all(m, jobs, 0, workers=max(4, min(32, os.cpu_count() or 4)))
    compile_s = time.perf_counter() - t0
    print(f"device {info.name}: compiled {len(jobs)} kernels in {compile_s:.1f} s", flush=True)

    timers = {"memset": FlushTimer(m, clean=False), "clean": FlushTimer(m, clean=True)}
    src, dst = b.allocate_memory(COPY_BYTES), b.allocate_memory(COPY_BYTES)
    copy_ms = {k: median_ms(t, lambda: b.copy_device_to_device(dst, src, COPY_BYTES), R)
               for k, t in timers.items()}
    copy_gbps = {k: 2 * COPY_BYTES / (v * 1e-3) / 1e9 for k, v in copy_ms.items()}
    tsrc = torch.empty(COPY_BYTES // 4, device="cuda")
    tdst = torch.empty_like(tsrc)
    tcopy_ms = median_ms(timers["memset"], lambda: tdst.copy_(tsrc), R)
    tsrc = tdst = None
    res: Dict[str, Any] = {
        "device": info.name, "torch": torch.__version__, "reps": R, "compile_s": compile_s,
        "compiled_kernels": len(jobs), "copy_gbps": copy_gbps,
        "torch_copy_gbps": 2 * COPY_BYTES / (tcopy_ms * 1e-3) / 1e9,
        "timing": {k: t.flush_description() for k, t in timers.items()},
        "rel_err": "max |out - ref| / max |ref| against NumPy float64", "cases": []}
    print(f"copy bandwidth (2 GiB, read + write): {copy_gbps['memset']:.0f} GB/s memset flush, "
          f"{copy_gbps['clean']:.0f} GB/s clean flush; torch copy_ {res['torch_copy_gbps']:.0f}"
          f" GB/s", flush=True)
    print(f"{'op':<12} {'shape':>11} {'dtype':>8}  {'variant':<40} {'ms':>8} {'GB/s':>6} "
          f"{'copy':>5} {'same':>5} {'torch':>5} {'ms_cln':>8} {'copy':>5} {'torch':>5} "
          f"{'rel_err':>8} {'regs':>4}", flush=True)

    seed = iter(range(1000))

    def derive(row: Dict[str, Any], moved: int, torch_ms: Dict[str, float],
               same: Dict[str, float]) -> None:
        """GB/s, fractions of the copies and ratio to torch from the row's ms per flush."""
        for k in timers:
            ms = row[f"ms_{k}"]
            row[f"gbps_{k}"] = moved / (ms * 1e-3) / 1e9
            row[f"frac_copy_{k}"] = row[f"gbps_{k}"] / copy_gbps[k]
            row[f"frac_same_copy_{k}"] = same[k] / ms
            row[f"vs_torch_{k}"] = torch_ms[k] / ms

    def show(row: Dict[str, Any], dtype: DT) -> None:
        if "error" in row:
            print(f"{row['op']:<12} {row['shape']:>11} {dtype.name_str:>8}  "
                  f"{row['variant']:<40} FAILED {row['error']}", flush=True)
            return
        err = row.get("rel_err")
        err_s = f"{err:8.1e}" if err is not None else " " * 8
        bad = "  BAD" if err is not None and not err <= TOL[dtype.name_str] else ""
        print(f"{row['op']:<12} {row['shape']:>11} {dtype.name_str:>8} "
              f"{'*' if row.get('chosen') else ' '}{row['variant']:<40} "
              f"{row['ms_memset']:8.4f} {row['gbps_memset']:6.0f} "
              f"{row['frac_copy_memset']:5.2f} {row['frac_same_copy_memset']:5.2f} "
              f"{row['vs_torch_memset']:5.2f} {row['ms_clean']:8.4f} "
              f"{row['frac_copy_clean']:5.2f} {row['vs_torch_clean']:5.2f} {err_s} "
              f"{row.get('regs', ''):>4}{bad}", flush=True)

    def run_case(op: str, shape: Tuple[int, int], dtype: DT, x: Any, out: Any,
                 variants: List[Variant], ref: np.ndarray, torch_fn: Callable[[], Any],
                 chosen: Callable[[], str]) -> None:
        """Check and time every variant, torch and a same-size copy; print and record."""
        moved = x.nbytes + out.nbytes
        scale = max(abs(float(ref.max())), abs(float(ref.min())), 1e-300)
        base = {"op": op, "shape": "x".join(map(str, shape)), "dtype": dtype.name_str}
        torch_ms = {k: median_ms(t, torch_fn, R) for k, t in timers.items()}
        same = {k: median_ms(t, lambda: b.copy_device_to_device(dst, src, x.nbytes), R)
                for k, t in timers.items()}
        rows_out = []
        for v in variants:
            row: Dict[str, Any] = dict(base, variant=v.name)
            rows_out.append(row)
            try:
                with b.activate(0):
                    drv.memset_d8(out.ptr, 0xFF, out.nbytes)  # NaN bits in every float type
                v.launch()
                got = m.to_numpy(out)
                same_bits = op == "transpose" and all(by_rows(np.array_equal, got, ref))
                row["rel_err"] = 0.0 if same_bits else rel_err(got, ref, scale)
                got = None
                for k, t in timers.items():
                    row[f"ms_{k}"] = median_ms(t, v.launch, R)
            except Exception as exc:  # report and go on
                row["error"] = f"{type(exc).__name__}: {exc}"
                continue
            if v.jobs:
                kern = m.kernel(v.jobs[0][0], 0, **v.jobs[0][1])
                row["regs"], row["local_bytes"] = kern.num_regs, kern.local_bytes
            derive(row, moved, torch_ms, same)
        pick = chosen()
        for row, v in zip(rows_out, variants):
            row["chosen"] = v.name == pick
        for name, ms in (("torch", torch_ms), ("copy of the same bytes", same)):
            row = dict(base, variant=name, **{f"ms_{k}": ms[k] for k in timers})
            derive(row, moved, torch_ms, same)
            rows_out.append(row)
        for row in rows_out:
            show(row, dtype)
        res["cases"].extend(rows_out)
        if args.out:
            write_json_atomic(args.out, res)

    if "softmax" in only:
        for shape, dtype in SOFTMAX:
            a = host_values(shape, dtype, next(seed))
            x = m.from_numpy(a, dtype=dtype)
            tx = torch.from_numpy(a).cuda().to(torch_dtype(dtype))
            out = b.empty(shape, dtype, 0)
            refs = softmax_refs(a)
            for log in (False, True):
                vs = softmax_variants(m, x, out, log, limit)
                rule = next(v.name for v in vs if v.default)
                run_case("log_softmax" if log else "softmax", shape, dtype, x, out, vs,
                         refs[log], (lambda tx=tx, log=log: torch.log_softmax(tx, -1) if log
                                     else torch.softmax(tx, -1)),
                         lambda rule=rule: rule)
            x.free(), out.free()
            del tx, refs, a

    if "layer_norm" in only:
        for shape, dtype in LAYER_NORM:
            rows, D = shape
            a = host_values(shape, dtype, next(seed))
            wv, bv = host_values((D,), dtype, next(seed)), host_values((D,), dtype, next(seed))
            x, w, bb = (m.from_numpy(v, dtype=dtype) for v in (a, wv, bv))
            tx, tw, tb = (torch.from_numpy(v).cuda().to(torch_dtype(dtype)) for v in (a, wv, bv))
            out = b.empty(shape, dtype, 0)
            ref = layer_norm_ref(a, wv.astype(np.float64), bv.astype(np.float64))
            vs = ln_variants(m, x, w, bb, out)

            def chosen(x: Any = x, out: Any = out, w: Any = w, bb: Any = bb) -> str:
                cfg = lp.ln_pick(m, x, out, w, bb, rows, D, EPS, True)
                tpr, vpt, blk, _, pf = cfg
                return f"tpr={tpr} vpt={vpt} block={blk}" + (" prefetch" if pf else "")
            run_case("layer_norm", shape, dtype, x, out, vs, ref,
                     lambda tx=tx, tw=tw, tb=tb, D=D: F.layer_norm(tx, (D,), tw, tb, EPS),
                     chosen)
            for t in (x, w, bb, out):
                t.free()
            del tx, tw, tb, ref, a

    if "transpose" in only:
        for shape, dtype in TRANSPOSE:
            a = host_values(shape, dtype, next(seed))
            x = m.from_numpy(a, dtype=dtype)
            tx = torch.from_numpy(a).cuda().to(torch_dtype(dtype))
            out = b.empty(shape[::-1], dtype, 0)
            vs = tr_variants(m, x, out)
            run_case("transpose", shape, dtype, x, out, vs, transposed(a),
                     lambda tx=tx: tx.t().contiguous(),
                     lambda x=x, out=out, shape=shape: tr_name(
                         tr.pick(m, x, out, 1, shape[0], shape[1])))
            x.free(), out.free()
            del tx, a

    b.free_memory(src), b.free_memory(dst)
    for t in timers.values():
        t.close()
    res["summary"] = summarize(res["cases"])
    res["wall_s"] = time.perf_counter() - t_start
    print("\nsummary: the default path's choice (*) and the fastest variant; x copy = fraction "
          "of the 2 GiB copy bandwidth, x same = of a copy of the same bytes, x torch = "
          "torch_ms / ms; memset | clean flush")
    for key, r in res["summary"].items():
        print(f"{key:<31} *{r['chosen']:<38} {r['chosen_ms']:7.4f} ms x copy {r['chosen_copy']:.2f}"
              f" x same {r['chosen_same']:.2f} x torch {r['chosen_torch']:.2f} | clean x copy "
              f"{r['chosen_copy_clean']:.2f} x torch {r['chosen_torch_clean']:.2f}")
        print(f"{'':<31}  {r['best']:<38} {r['best_ms']:7.4f} ms x copy {r['best_copy']:.2f}"
              f" x same {r['best_same']:.2f} x torch {r['best_torch']:.2f} | max rel_err "
              f"{r['max_rel_err']:.1e}")
    print(f"wall {res['wall_s']:.1f} s")
    if args.out:
        write_json_atomic(args.out, res)


if __name__ == "__main__":
    main()
