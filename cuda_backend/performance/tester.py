"""`CudaPerformanceTester`: runs every case, then writes results.json, charts, summary.md
and index.html under `output_dir/<device-slug>/` (the documented API's class, extended).

    tester = CudaPerformanceTester(TestConfiguration(quick=True))
    summary = tester.run_comprehensive_benchmark()
    tester.print_summary_report(summary)

Operations are discovered on CudaMath (and CudaML when it can be imported): one with no
case in the tables is listed in the report, never silently left out. Ctrl-C stops the run
and the report is written with the cases measured so far (`interrupted: true`).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..backend import get_cuda_backend
from ..profiling import nvtx_range
from . import cases_math, cases_ml, render, schema
from .cases import Case, Context, Prepared, discover, known_names, opdef_cases, select
from .cases_system import system_cases
from .cases_training import training_cases
from .ceilings import compute_peaks, measure
from .config import FAMILIES, TestConfiguration
from .peers import load_peers
from .presets import pick
from .progress import Progress
from .runner import CaseRunner, context_dead, new_record
from .timing import make_long_flush_timer, make_timer


class CudaPerformanceTester:
    """Benchmarks the backend on one device and writes the report.

    `math` and `ml` default to get_cuda_math() and cuda_ml.get_cuda_ml(); pass objects to
    benchmark another instance (tests use this)."""

    def __init__(self, config: Optional[TestConfiguration] = None, math: Any = None,
                 ml: Any = None, backend: Any = None) -> None:
        self.config = config or TestConfiguration()
        self.backend = backend or getattr(math, "backend", None) or get_cuda_backend()
        self._math, self._ml = math, ml
        self.output_path: Optional[Path] = None
        self._flush = "not started"
        self._warnings: List[str] = []

    # -- the run ------------------------------------------------------------------------
    def run_comprehensive_benchmark(self) -> Dict[str, Any]:
        """Measure every selected case; write the outputs; return the results document."""
        cfg, backend = self.config, self.backend
        started = time.time()
        dev = cfg.device_id
        info = backend.get_device_info(dev)
        apis = self._load_apis()
        cases, coverage, failed = self._plan(apis)
        peers = load_peers(cfg.peers, backend.is_available, dev)
        if cfg.profile:
            backend.profiler.reset()
            backend.enable_profiling = True
        ctx = Context(backend, apis["math"], apis["ml"], apis["ml_module"], dev,
                      np.random.default_rng(), cfg.quick)
        records: List[Dict[str, Any]] = list(failed)
        ceilings: Dict[str, Any] = {"memory_bandwidth_gbps": None, "memory_bandwidth": {},
                                    "compute": compute_peaks(info)}
        interrupted = False
        timer = None
        self._flush, self._warnings = "not started", []
        bar = Progress(len(cases), cfg.progress)
        try:
            with backend.device(dev), _sigterm_as_interrupt():
                timer = make_long_flush_timer(backend, dev) if cfg.flush_l2 else \
                    make_timer(backend, dev, False)
                self._flush = timer.flush_description()
                ceilings = measure(backend, timer, dev, cfg.quick, max(3, cfg.iterations))
                runner = CaseRunner(ctx, timer, peers, cfg, ceilings)
                dead: Optional[str] = None
                for case in cases:
                    bar.step(case.id)
                    if dead is not None:
                        records.append(_not_run(case, dead))
                        continue
                    with nvtx_range(case.id, enabled=cfg.profile):  # Nsight Systems' view
                        rec = runner.run(case)
                    records.append(rec)
                    if context_dead(rec.get("error")):
                        dead = rec["id"]
                        self._warnings.append(
                            f"the GPU context faulted (first seen in {dead}: {rec['error']}); "
                            f"the cases after it were not run: rerun them with --ops")
        except KeyboardInterrupt:
            interrupted = True
        finally:
            bar.close()
            if timer is not None:
                try:
                    timer.close()
                except Exception as exc:  # e.g. a faulted context cannot free
                    self._warnings.append(f"timer cleanup failed: {type(exc).__name__}: {exc}")
        doc = self._document(info, ceilings, peers, coverage, records, interrupted,
                             started, timer)
        doc["warnings"] += self._warnings
        self._write(doc)
        return doc

    def print_summary_report(self, summary: Dict[str, Any]) -> None:
        """Print the report's tables (the same as summary.md) to the terminal."""
        print(render.to_text(summary))
        outputs = summary.get("outputs") or {}
        if outputs.get("directory"):
            print(f"report written to {outputs['directory']}/")
            for line in textwrap.wrap(", ".join(outputs.get("files", [])),
                                      render.TERMINAL_WIDTH - 2):
                print("  " + line)
            if "trace.json" in outputs.get("files", []):
                print("  trace.json: open it in https://ui.perfetto.dev or chrome://tracing")

    # -- planning -----------------------------------------------------------------------
    def planned_cases(self) -> List[Case]:
        """The cases a run with this configuration would measure, in order (nothing runs;
        `report --list`). ValueError for an unknown operation."""
        return self._plan(self._load_apis())[0]

    def _load_apis(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"math": self._math, "math_error": None, "ml": self._ml,
                               "ml_module": None, "ml_error": None, "ml_missing": None}
        if out["math"] is None:
            try:
                from ..cuda_math import get_cuda_math
                out["math"] = get_cuda_math()
            except Exception as exc:
                out["math_error"] = f"{type(exc).__name__}: {exc}"
        if self._ml is not None:
            out["ml_module"] = importlib.import_module(type(self._ml).__module__)
            return out
        if importlib.util.find_spec("cuda_backend.cuda_ml") is None:
            out["ml_missing"] = "cuda_backend.cuda_ml does not exist in this version"
            return out
        try:
            mod = importlib.import_module("cuda_backend.cuda_ml")
            out["ml"], out["ml_module"] = mod.get_cuda_ml(), mod
        except Exception as exc:
            out["ml_error"] = f"{type(exc).__name__}: {exc}"
        return out

    def _check_operations(self, apis: Dict[str, Any]) -> None:
        """ValueError when `operations` names something no case has (a 'family/op' or id
        prefix passes: select() matches it or nothing)."""
        wanted, gpu = self.config.operations, self.backend.is_available
        if not wanted:
            return
        tables = cases_math.MATH_OPS + cases_ml.ML_OPS
        listed = system_cases([4], gpu, True) + training_cases(gpu)
        all_names = set(FAMILIES) | {d.op for d in tables} | set(known_names(listed))
        variants = {f"{d.op}[{d.variant}]" for d in tables} | {f"{c.op}[{c.variant}]"
                                                                for c in listed}
        unknown = sorted(set(wanted) - all_names - variants - self._discovered_names(apis))
        unknown = [w for w in unknown if "/" not in w]
        if unknown:
            raise ValueError(f"unknown operation(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(all_names))}")

    def _plan(self, apis: Dict[str, Any]) -> Tuple[List[Case], Dict[str, Any], List[Dict]]:
        """(cases to run, coverage, records of APIs that failed to load)."""
        cfg, gpu = self.config, self.backend.is_available
        self._check_operations(apis)
        wanted = cfg.operations
        cases: List[Case] = []
        coverage: Dict[str, Any] = {}
        failed: List[Dict[str, Any]] = []
        api_sets = [("CudaMath", apis["math"], apis["math_error"], None, cases_math.MATH_OPS,
                     cases_math.NON_OPS, ("vector", "matrix")),
                    ("CudaML", apis["ml"], apis["ml_error"], apis["ml_missing"],
                     cases_ml.ML_OPS, cases_ml.NON_OPS, ("ml",))]
        math_ops = set()
        for api, obj, error, missing, table, non_ops, fams in api_sets:
            if obj is None:
                if missing:
                    coverage[api] = missing
                elif error and (not wanted or set(wanted) & (set(fams) | {d.op for d in table})):
                    coverage[api] = f"could not be loaded: {error}"
                    failed.append(_load_failure(api, fams[0], error))
                continue
            ops = discover(type(obj), non_ops)
            if api == "CudaMath":
                math_ops = set(ops)
            table = [d for d in table if d.op in ops]
            planned: List[Case] = []
            for fam in fams:
                planned += opdef_cases([d for d in table if d.family == fam],
                                       cfg.sizes_for(fam), cfg.quick)
            planned = self._select(planned)
            cases += planned
            for op in ops:
                ids = [c.id for c in planned if c.op == op]
                if ids:
                    coverage[f"{api}.{op}"] = ids
                elif wanted and op not in wanted:
                    continue
                elif api == "CudaML" and op in math_ops:
                    coverage[f"{api}.{op}"] = f"same operation as CudaMath.{op}"
                elif not any(d.op == op for d in table):
                    where = "cases_math" if api == "CudaMath" else "cases_ml"
                    coverage[f"{api}.{op}"] = (f"no benchmark case defined: add an OpDef "
                                               f"to {where}.py")
        system = self._select(system_cases(cfg.sizes_for("transfers"), gpu, cfg.quick))
        cases = system + cases  # the runtime paths first: an op that faults cannot hide them
        for c in system:
            coverage.setdefault(f"backend.{c.op}", []).append(c.id)
        # training steps last: the whole nn stack (examples' models) after every op alone
        no_nn = apis["ml_missing"] or apis["ml_error"] or apis["math_error"]
        training = self._select(
            training_cases(gpu, no_nn and f"needs cuda_backend.cuda_ml: {no_nn}"))
        cases += training
        for c in training:
            coverage.setdefault(f"nn.{c.op}", []).append(c.id)
        return cases, coverage, failed

    def _select(self, cases: List[Case]) -> List[Case]:
        """The cases `operations` names, then those of the preset."""
        cases = select(cases, self.config.operations)
        return pick(cases, self.config.preset) if self.config.preset else cases

    @staticmethod
    def _discovered_names(apis: Dict[str, Any]) -> set:
        names = set()
        for key, non_ops in (("math", cases_math.NON_OPS), ("ml", cases_ml.NON_OPS)):
            if apis[key] is not None:
                names |= set(discover(type(apis[key]), non_ops))
        return names

    # -- the document ---------------------------------------------------------------------
    def _document(self, info: Any, ceilings: Dict[str, Any], peers: Dict[str, Any],
                  coverage: Dict[str, Any], records: List[Dict[str, Any]], interrupted: bool,
                  started: float, timer: Any) -> Dict[str, Any]:
        backend, cfg = self.backend, self.config
        fallback = not backend.is_available
        banner = None
        if fallback:
            banner = (f"FALLBACK MODE: no GPU was used ({backend.fallback_reason}). 'Ours' ran "
                      f"on the host through NumPy and was timed with the host clock: these "
                      f"numbers say nothing about GPU performance.")
        counts = {"total": len(records)}
        for s in ("passed", "failed", "skipped"):
            counts[s] = sum(1 for r in records if r["status"] == s)
        versions = dict(backend.versions())
        versions["matplotlib"] = _version("matplotlib")
        for name, p in peers.items():
            if p.name != "numpy":
                versions[name] = p.version
        device = info.to_dict()
        device.update(slug=device_slug(info.name), compute_capability=list(
            info.compute_capability), measured_bandwidth_gbps=ceilings["memory_bandwidth_gbps"])
        flush = self._flush
        doc = {
            "schema_version": schema.SCHEMA_VERSION,
            "banner": banner,
            "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "duration_s": round(time.time() - started, 2),
            "fallback_mode": fallback,
            "fallback_reason": backend.fallback_reason,
            "device": device,
            "ceilings": ceilings,
            "versions": versions,
            "git_commit": git_commit(),
            "configuration": cfg.to_dict(),
            "timing": {"timer": getattr(timer, "kind", None), "l2_flush": flush,
                       "description": _timing_text(fallback, flush, cfg)},
            "peers": {n: p.describe() for n, p in peers.items()},
            "coverage": coverage,
            "interrupted": interrupted,
            "counts": counts,
            "cases": records,
            "warnings": [],
        }
        return _clean(doc)

    def _write(self, doc: Dict[str, Any]) -> None:
        cfg = self.config
        if not (cfg.save_results or cfg.enable_plots or cfg.profile):
            doc["outputs"] = None
            return
        out = Path(cfg.output_dir) / doc["device"]["slug"]
        out.mkdir(parents=True, exist_ok=True)
        self.output_path = out
        files: List[str] = []
        charts: List[str] = []
        if cfg.enable_plots:
            from .charts import make_charts
            charts, err = make_charts(doc, str(out))
            files += charts
            if err:
                doc["warnings"].append(err)
        if cfg.profile:
            self.backend.export_performance_report(str(out / "profile_stats.json"))
            self.backend.export_chrome_trace(str(out / "trace.json"))
            files += ["profile_stats.json", "trace.json"]
            self.backend.enable_profiling = False
            profiler = getattr(self.backend, "profiler", None)
            if profiler is not None and not profiler.trace_events():
                doc["warnings"].append(
                    "--profile wrote an empty trace (trace.json has no events): "
                    + ("fallback mode runs no kernels or device copies, so there was nothing "
                       "to trace" if doc["fallback_mode"] else
                       "no launch or copy was recorded"))
        if cfg.save_results:
            files += ["results.json", "results.schema.json", "summary.md", "index.html"]
        doc["outputs"] = {"directory": str(out), "files": files, "charts": charts}
        problems = schema.validate(doc)
        if problems:
            doc["warnings"].append("results.json does not match its schema: "
                                   + "; ".join(problems[:5]))
        if cfg.save_results:
            _write_text(out / "results.json", json.dumps(doc, indent=1, allow_nan=False))
            _write_text(out / "results.schema.json", json.dumps(schema.SCHEMA, indent=1))
            _write_text(out / "summary.md", render.to_markdown(doc, charts))
            _write_text(out / "index.html", render.to_html(doc, charts))
            from .reports_readme import write_readme  # here: the module also runs as a script
            write_readme(out.parent)


# -- helpers --------------------------------------------------------------------------------
@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (e.g. from `timeout`) stops the run like Ctrl-C, so the partial report is
    still written. Only the main thread can install signal handlers; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _never_built(ctx: Context) -> Prepared:
    """The build of a placeholder Case that records a failure; it is never run."""
    raise RuntimeError("a placeholder case is never built")


def _load_failure(api: str, family: str, error: str) -> Dict[str, Any]:
    case = Case(family, f"{api} (import)", api, "", "", 0, build=_never_built)
    rec = new_record(case)
    rec.update(status="failed", phase="prepare",
               error=f"{api} could not be loaded, so none of its operations ran: {error}")
    return rec


def _not_run(case: Case, dead: str) -> Dict[str, Any]:
    rec = new_record(case)
    rec["reason"] = (f"not run: the GPU context faulted in or before {dead}, so no later call "
                     f"can run in this process (rerun with --ops)")
    return rec


def _timing_text(fallback: bool, flush: str, cfg: TestConfiguration) -> str:
    how = ("host clock (perf_counter) around each call" if fallback else
           "CUDA events around each call on the default stream")
    return (f"{how}; {cfg.warmup} warm-up + {cfg.iterations} timed calls per case; L2 flush: "
            f"{flush}; CPU NumPy timed with the host clock"
            + ("; profiling on (launches synchronize: times include the profiler)"
               if cfg.profile else ""))


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (the report's folder name)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def git_commit() -> Optional[str]:
    """HEAD of the checkout this package runs from ('+dirty' with local changes), or None.
    CUDA_BACKEND_GIT_COMMIT names it instead (a copy of the tree on a remote GPU machine)."""
    named = os.environ.get("CUDA_BACKEND_GIT_COMMIT")
    if named:
        return named
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _version(module: str) -> Optional[str]:
    try:
        return importlib.import_module(module).__version__
    except Exception:
        return None


def _clean(x: Any) -> Any:
    """JSON-safe copy: tuples to lists, NumPy scalars to Python, inf/nan to None."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
