"""Autotuner: times a small set of kernel configs once per (device, op, shape class) and
keeps the winner in memory and in a JSON file (written atomically).

A config is a dict of template parameters (hashable once frozen). Candidates are timed by
the package's timing primitive (cuda_backend/performance/timing.py: warm-up, an L2 flush
before each sample, CUDA events around it, the median). A candidate that fails to compile,
whose launch configuration the device refuses (too many threads, registers or shared memory:
out of resources) or that runs out of memory scores infinity and loses; any other error (a
kernel fault: illegal address, misaligned access, ...) stops the tuning at once and is raised
with its message, since after a fault the GPU context is unusable and every later candidate
would fail too. Set `CUDA_BACKEND_AUTOTUNE=0` to
skip timing and take the first candidate; `CUDA_BACKEND_AUTOTUNE_PATH` moves the file;
`CUDA_BACKEND_AUTOTUNE_REPEATS=n` caps the timed runs per candidate (perf/sanitize.sh sets 1:
under compute-sanitizer every candidate still runs, at a fraction of the instrumented time).

The file picks the kernels that run, so it is read and written only when this user owns it
and its folder and nobody else can write to them (else the choices stay in memory, with a
warning); a file that is not a version-1 JSON object is ignored, with a warning, and
replaced at the next save.
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

from .compiler import check_cache_dir, check_cache_file, warn_untrusted
from .errors import (CudaBackendError, KernelCompilationError, KernelLaunchError,
                     LaunchConfigurationError, FAULT_WORDS, driver_failure)
from .profiling import write_json_atomic

logger = logging.getLogger("cuda_backend")

# Driver messages of a launch the device refuses for this config (registers, threads or shared
# memory over its limits) or of memory it cannot allocate: the candidate loses.
_RESOURCE_WORDS = ("out of resources", "too many resources", "invalid configuration",
                   "out of memory")


def default_path() -> str:
    path = os.environ.get("CUDA_BACKEND_AUTOTUNE_PATH")
    if path:
        return path
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cuda_backend", "autotune.json")


def config_key(config: Dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)


def _signature(op: str, shape_class: Any, device_id: int,
               candidates: Sequence[Dict[str, Any]]) -> Optional[tuple]:
    """A hashable stand-in for the choice's key, or None when a value is unhashable."""
    try:
        sig = (op, device_id, shape_class,
               tuple(tuple(sorted(c.items())) for c in candidates))
        hash(sig)
        return sig
    except TypeError:
        return None


def _loses(exc: Exception) -> bool:
    """Whether a candidate's error only makes it lose (compile, launch configuration, device
    resources, out of memory) rather than stopping the tuning (a fault, anything else)."""
    if isinstance(exc, (KernelCompilationError, LaunchConfigurationError, MemoryError)):
        return True
    if isinstance(exc, KernelLaunchError):
        text = str(exc).lower()
        return (not any(w in text for w in FAULT_WORDS)
                and any(w in text for w in _RESOURCE_WORDS))
    return False


def _stopped(err: KernelLaunchError, cfg: Any, what: str, device_id: int) -> KernelLaunchError:
    """The error that stops the tuning: err's message after the candidate's name, with the
    warning that the context is gone when it is a fault (driver_failure's messages have it)."""
    text = str(err)
    if any(w in text.lower() for w in FAULT_WORDS) and "no longer usable" not in text:
        text += (f" A kernel faulted on device {device_id}: its CUDA context is no longer "
                 f"usable in this process (every later call on it fails); restart the process.")
    return KernelLaunchError(
        f"autotuner: candidate {cfg} of {what} failed with an error that is not a compile, "
        f"launch-configuration, resource or out-of-memory error, so the tuning stopped "
        f"there: {text}")


def _digest(candidates: Sequence[Dict[str, Any]]) -> str:
    import hashlib
    text = json.dumps([config_key(c) for c in candidates])
    return hashlib.sha1(text.encode()).hexdigest()[:10]


class Autotuner:
    """pick(op, shape_class, candidates, run) -> the fastest config."""

    def __init__(self, backend: Any, path: Optional[str] = None) -> None:
        self.backend = backend
        self.path = path or default_path()
        self._lock = threading.Lock()
        self._choices: Dict[str, Dict[str, Any]] = {}
        # per-call fast path: (op, device, shape class, candidates as tuples) -> choice, so a
        # repeated call skips the JSON key and digest (~50-100 µs of Python)
        self._memo: Dict[Any, Dict[str, Any]] = {}
        self._loaded = False
        self._trust: Optional[bool] = None
        self.enabled = os.environ.get("CUDA_BACKEND_AUTOTUNE", "1") not in ("0", "")
        cap = os.environ.get("CUDA_BACKEND_AUTOTUNE_REPEATS", "")
        self.max_repeats = max(1, int(cap)) if cap.strip().isdigit() else None

    def _trusted(self) -> bool:
        """Whether the file may be read and written (see the module docstring); warns once
        when not."""
        if self._trust is None:
            folder = os.path.dirname(os.path.abspath(self.path))
            reason = check_cache_dir(folder)
            if reason is None:
                reason = check_cache_file(self.path)
            if reason is not None:
                warn_untrusted(self.path, reason, "autotuning choices (keeping them in memory)")
            self._trust = reason is None
        return self._trust

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        if not self._trusted():
            return
        try:
            with open(self.path) as f:
                doc = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            doc = exc
        if isinstance(doc, Exception):
            problem = f"it cannot be read as JSON: {doc}"
        elif not isinstance(doc, dict):
            problem = f"its JSON is {type(doc).__name__} {json.dumps(doc)[:40]}"
        elif doc.get("version") != 1 or not isinstance(doc.get("choices"), dict):
            problem = (f"its version is {doc.get('version')!r} and its choices a "
                       f"{type(doc.get('choices')).__name__}")
        else:
            problem = None
        if problem is not None:
            warnings.warn(f"cuda_backend: ignoring the autotune file {self.path!r}: {problem}, "
                          f"expected an object with version 1 and a choices object; it is "
                          f"replaced at the next save", RuntimeWarning, stacklevel=4)
            return
        choices = doc["choices"]
        self._choices.update({k: v for k, v in choices.items()
                              if isinstance(v, dict) and isinstance(v.get("config"), dict)})

    def _key(self, op: str, shape_class: Any, device_id: int) -> str:
        name = self.backend.devices[device_id].name
        return f"{name}|{op}|{json.dumps(shape_class, default=str)}"

    def pick(self, op: str, shape_class: Any, candidates: Sequence[Dict[str, Any]],
             run: Callable[[Dict[str, Any]], None], device_id: int = 0,
             repeats: int = 3) -> Dict[str, Any]:
        """The best candidate for this (device, op, shape class); times them on first use.

        run(config) must launch the work once (asynchronously is fine).
        """
        if not candidates:
            raise CudaBackendError(f"autotuner: no candidates for {op}")
        if len(candidates) == 1 or not self.enabled or not self.backend.is_available:
            return dict(candidates[0])
        sig = _signature(op, shape_class, device_id, candidates)
        memo = self._memo.get(sig) if sig is not None else None
        if memo is not None:
            return dict(memo)
        from .streams import capturing
        if capturing(device_id):
            from .errors import GraphCaptureError
            raise GraphCaptureError(
                f"the first call of {op} for shape class {shape_class} times its candidate "
                f"kernels, which cannot be recorded into a CUDA graph: call it once before "
                f"capturing")
        choice = self._pick(op, shape_class, candidates, run, device_id, repeats)
        if sig is not None:
            self._memo[sig] = choice
        return dict(choice)

    def _pick(self, op: str, shape_class: Any, candidates: Sequence[Dict[str, Any]],
              run: Callable[[Dict[str, Any]], None], device_id: int,
              repeats: int) -> Dict[str, Any]:
        """pick() without the in-memory fast path: the saved choice, or time them all."""
        # The candidate list is part of the key: a choice saved for another list is stale.
        key = self._key(op, shape_class, device_id) + "|" + _digest(candidates)
        with self._lock:
            self._load()
            hit = self._choices.get(key)
        if hit is not None:
            wanted = hit["config"]
            for c in candidates:
                if config_key(c) == config_key(wanted):
                    return dict(c)
        if self.max_repeats is not None:
            repeats = min(repeats, self.max_repeats)
        failures: List[str] = []
        timings = self._time_all(candidates, run, device_id, repeats,
                                 what=f"{op} {shape_class}", failures=failures)
        best = min(range(len(candidates)), key=lambda i: timings[i])
        if math.isinf(timings[best]):
            raise CudaBackendError(
                f"autotuner: every candidate for {op} {shape_class} failed; "
                + "; ".join(failures))
        entry = {"config": dict(candidates[best]), "ms": timings[best],
                 "all_ms": {config_key(c): t for c, t in zip(candidates, timings)}}
        with self._lock:
            self._choices[key] = entry
            self._save()
        logger.debug("autotune %s %s -> %s (%.4f ms)", op, shape_class, candidates[best],
                     timings[best])
        return dict(candidates[best])

    def _time_all(self, candidates: Sequence[Dict[str, Any]], run: Callable, device_id: int,
                  repeats: int, what: str = "",
                  failures: Optional[List[str]] = None) -> List[float]:
        """Median ms of each candidate (1 warm-up, `repeats` samples, the L2 flushed before
        each), infinity for one that loses (see `_loses`); any other error stops here."""
        from .performance import timing
        timer = self._timer(timing, device_id)
        out: List[float] = []
        raised = True
        try:
            for cfg in candidates:
                try:
                    out.append(timer.median_ms(lambda: run(cfg), warmup=1, iterations=repeats))
                except Exception as exc:
                    err = self._as_cuda_error(exc, cfg, device_id)
                    if not _loses(err):
                        if not isinstance(err, KernelLaunchError):
                            raise          # not a CUDA error (a bug in run): as it was
                        raise _stopped(err, cfg, what, device_id) from exc
                    logger.debug("autotune %s: config %s loses: %s", what, cfg, err)
                    if failures is not None:
                        failures.append(f"{cfg}: {type(err).__name__}: "
                                        f"{str(err).splitlines()[0] if str(err) else ''}")
                    out.append(float("inf"))
            raised = False
        finally:
            try:
                timer.close()
            except Exception as exc:
                if not raised:   # after a fault, freeing the flush buffer fails too
                    raise
                logger.debug("autotune: timer cleanup after an error failed: %s", exc)
        return out

    def _timer(self, timing: Any, device_id: int) -> Any:
        """The timing primitive with the long L2 flush (timing.LONG_FLUSH_BYTES: a
        candidate's host work stays out of its time), else 2 x L2, whose buffer comes from
        the driver, not the pool (the op's first call must not show it in the pool's peak);
        without memory for either, no flush."""
        try:
            return timing.make_long_flush_timer(self.backend, device_id, pool=False)
        except Exception as exc:
            if not timing.out_of_memory(exc):
                raise
            logger.debug("autotune: no memory for a flush buffer (%s)", exc)
        logger.debug("autotune: timing with a warm L2")
        return timing.make_timer(self.backend, device_id, False)

    def _as_cuda_error(self, exc: Exception, cfg: Any, device_id: int) -> Exception:
        """A raw driver error (a synchronize or event of the timer) as KernelLaunchError."""
        drv_error = getattr(self.backend.drv, "Error", None)
        if isinstance(drv_error, type) and isinstance(exc, drv_error):
            return driver_failure(f"autotuning candidate {cfg}", exc, device_id)
        return exc

    def _save(self) -> None:
        if not self._trusted():
            return
        doc = {"version": 1, "choices": self._choices}
        try:
            write_json_atomic(self.path, doc, private=True)
        except OSError as exc:
            logger.debug("autotune: cannot write %s: %s", self.path, exc)

    def choices(self) -> Dict[str, Dict[str, Any]]:
        with self._lock:
            self._load()
            return dict(self._choices)
