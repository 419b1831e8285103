"""Runs one Case: build, check against the reference, time ours, the CPU and the peers, and
derive throughput and ceiling fractions. Every failure is caught and recorded with its
message (the run goes on); KeyboardInterrupt passes through after cleanup.
"""
from __future__ import annotations

import traceback
from typing import Any, Dict, Optional

from .cases import Case, Context, Prepared, compare
from .ceilings import compute_peak
from .peers import Peer, PeerUnsupported
from .timing import HostTimer, stats


# Driver errors after which the process's CUDA context is unusable.
FATAL_ERRORS = ("illegal memory access", "no longer usable", "unspecified launch failure",
                "misaligned address", "illegal instruction", "ILLEGAL_ADDRESS",
                "launch timed out", "hardware stack error")


def context_dead(error: Optional[str]) -> bool:
    """Whether a case's error means every later GPU call in this process will fail."""
    return error is not None and any(m in error for m in FATAL_ERRORS)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _release_for(prep: Prepared):
    """Free outputs that are new tensors (not an input returned by an in-place op)."""
    keep = {id(t) for t in prep.tensors}

    def release(out: Any) -> None:
        items = out if isinstance(out, (tuple, list)) else (out,)
        for o in items:
            if hasattr(o, "free") and id(o) not in keep:
                o.free()
    return release


def _nbytes(out: Any) -> int:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return sum(int(getattr(o, "nbytes", 0)) for o in items)


def new_record(case: Case) -> Dict[str, Any]:
    return {
        "id": case.id, "family": case.family, "op": case.op, "api": case.api,
        "variant": case.variant, "dtype": case.dtype, "size": case.size, "shapes": [],
        "precision": case.precision, "status": "skipped", "error": None, "phase": None,
        "reason": case.skip_reason, "timer": None, "l2_flushed": False, "time_ms": None,
        "cpu_time_ms": None, "speedup_vs_cpu": None, "bytes": None, "flops": None,
        "gbps": None, "gflops": None, "arithmetic_intensity": None,
        "fraction_of_bandwidth": None, "compute_unit": case.compute_unit,
        "fraction_of_compute": None, "accuracy": None, "peers": {}, "notes": [],
    }


class CaseRunner:
    """Measures cases with one timer, one set of peers and the run's ceilings."""

    def __init__(self, ctx: Context, timer: Any, peers: Dict[str, Peer], config: Any,
                 ceilings: Dict[str, Any]) -> None:
        self.ctx, self.timer, self.peers = ctx, timer, peers
        self.config, self.ceilings = config, ceilings

    def run(self, case: Case) -> Dict[str, Any]:
        rec = new_record(case)
        if case.skip_reason:
            return rec
        prep: Optional[Prepared] = None
        phase = "prepare"
        try:
            prep = case.build(self.ctx)
            rec["shapes"] = [list(h.shape) for h in prep.host_inputs]
            rec["notes"] += prep.notes
            phase = "run"
            out_bytes = self._accuracy(case, prep, rec)
            phase = "timing"
            self._time_ours(prep, rec)
            rec["bytes"] = self._bytes(prep, out_bytes)
            rec["flops"] = prep.flops
            phase = "cpu"
            self._time_cpu(prep, rec)
            phase = "peers"
            self._time_peers(case, prep, rec)
            self._derive(rec)
            acc = rec["accuracy"]
            rec["status"] = "failed" if acc is not None and not acc["passed"] else "passed"
            if rec["status"] == "failed":
                rec["error"] = acc["message"]
                rec["phase"] = "accuracy"
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            rec["status"], rec["phase"] = "failed", phase
            rec["error"] = _error(exc)
            rec["traceback"] = traceback.format_exc(limit=6)
        finally:
            if prep is not None:
                try:
                    prep.free()
                except Exception as exc:  # a failed free must not hide the case's result
                    rec["notes"].append(f"cleanup failed: {_error(exc)}")
        return rec

    # -- steps -----------------------------------------------------------------------
    def _accuracy(self, case: Case, prep: Prepared, rec: Dict[str, Any]) -> int:
        """Run once, compare with the float64 reference; returns the output's bytes."""
        threshold = case.threshold(self.config.max_error_threshold)
        if prep.verify is not None:
            prep.call()
            abs_err, rel, msg = prep.verify()
            ref_name = prep.verify_reference or "the source data (exact copy expected)"
            out_bytes = 0
        elif prep.reference is not None:
            if prep.result is None:
                raise TypeError("the case has a reference but no way to read its result "
                                "(Prepared.result is None)")
            out = prep.call()
            try:
                host = prep.result(out)
                out_bytes = _nbytes(out)
            finally:
                _release_for(prep)(out)
            ref = prep.reference()
            checker = prep.check or (lambda o, r, i: compare(o, r))
            abs_err, rel, msg = checker(host, ref, prep.host_inputs)
            ref_name = "NumPy float64 on the same (dtype-rounded) inputs"
        else:
            return 0
        passed = msg is None and rel <= threshold
        if msg is None and not passed:
            msg = (f"max relative error {rel:.3g} is above the threshold {threshold:.3g} "
                   f"(max abs error {abs_err:.3g})")
        rec["accuracy"] = {"max_abs_error": _finite(abs_err), "max_rel_error": _finite(rel),
                           "threshold": threshold, "passed": passed, "message": msg,
                           "reference": ref_name}
        return out_bytes

    def _time_ours(self, prep: Prepared, rec: Dict[str, Any]) -> None:
        cfg, timer = self.config, self.timer
        if prep.mode == "overhead":
            samples = timer.time_batched(prep.call, prep.batch_calls, cfg.iterations)
            rec["timer"] = "host_clock"
            rec["notes"].append(f"time per call, averaged over {prep.batch_calls} calls")
        else:
            flush = prep.mode == "kernel" and cfg.flush_l2
            samples = timer.time(prep.call, cfg.warmup, cfg.iterations, _release_for(prep),
                                 flush=flush)
            rec["timer"] = timer.kind
            rec["l2_flushed"] = bool(flush and getattr(timer, "flush_bytes", 0))
        rec["time_ms"] = stats(samples)

    def _bytes(self, prep: Prepared, out_bytes: int) -> Optional[int]:
        if prep.bytes_fn is not None:
            return int(prep.bytes_fn(prep.in_bytes, out_bytes))
        total = prep.in_bytes + out_bytes
        return total or None

    def _time_cpu(self, prep: Prepared, rec: Dict[str, Any]) -> None:
        peer = self.peers.get("numpy")
        if peer is None or prep.cpu_fn is None:
            return
        arrays = [peer.array(h, rec["dtype"]) for h in prep.host_inputs]
        fn = prep.cpu_fn
        samples = HostTimer().time(lambda: fn(peer.module, *arrays), 1, self.config.iterations,
                                   budget_s=self.config.cpu_time_budget_s)
        rec["cpu_time_ms"] = stats(samples)

    def _time_peers(self, case: Case, prep: Prepared, rec: Dict[str, Any]) -> None:
        ours = rec["time_ms"]["median"]
        for name, peer in self.peers.items():
            if not peer.on_gpu:
                continue
            if not peer.available:
                rec["peers"][name] = {"skipped": peer.reason}
                continue
            try:
                rec["peers"][name] = self._time_peer(case, prep, peer, ours)
            except PeerUnsupported as exc:
                rec["peers"][name] = {"skipped": str(exc)}
            except KeyboardInterrupt:
                raise
            except Exception as exc:
                rec["peers"][name] = {"error": _error(exc)}
            finally:
                try:
                    peer.release_memory()
                except Exception:
                    pass

    def _time_peer(self, case: Case, prep: Prepared, peer: Peer, ours: float) -> Dict[str, Any]:
        cfg, timer = self.config, self.timer
        with peer.settings(case.precision) as settings:
            if peer.name in prep.peer_factories:
                fn = prep.peer_factories[peer.name](peer.module)
            elif peer.name == "torch" and prep.torch_factory is not None:
                arrays = [peer.array(h, case.dtype) for h in prep.host_inputs]
                fn = prep.torch_factory(peer.module, *arrays)
            elif peer.name == "cupy" and prep.cupy_fn is not None:
                arrays = [peer.array(h, case.dtype) for h in prep.host_inputs]
                cupy_fn, mod = prep.cupy_fn, peer.module
                fn = lambda: cupy_fn(mod, *arrays)  # noqa: E731
            else:
                raise PeerUnsupported("no equivalent operation is defined for this peer")
            if prep.mode == "overhead":
                samples = timer.time_batched(fn, prep.batch_calls, cfg.iterations)
            else:
                samples = timer.time(fn, cfg.warmup, cfg.iterations,
                                     flush=prep.mode == "kernel" and cfg.flush_l2)
        st = stats(samples)
        if st is None:
            raise PeerUnsupported("the peer's timer returned no samples")
        ratio = st["median"] / ours if ours > 0 else None
        return {"time_ms": st, "ratio": ratio, "settings": settings}

    def _derive(self, rec: Dict[str, Any]) -> None:
        """GB/s, GFLOP/s, intensity, ceiling fractions and the CPU speed-up."""
        med = rec["time_ms"]["median"]
        if med <= 0:
            return
        sec = med * 1e-3
        bw = self.ceilings.get("memory_bandwidth_gbps")
        if rec["bytes"]:
            rec["gbps"] = rec["bytes"] / sec / 1e9
            # host<->device copies are bound by the link, not by device memory; in fallback
            # mode the "device" is host memory behind CPU caches: no meaningful fraction
            on_gpu = getattr(self.ctx.backend, "is_available", True)
            if bw and on_gpu and (rec["family"] != "transfers"
                                  or rec["op"] == "copy_device_to_device"):
                rec["fraction_of_bandwidth"] = rec["gbps"] / bw
        if rec["flops"]:
            rec["gflops"] = rec["flops"] / sec / 1e9
            peak = compute_peak(self.ceilings, rec["compute_unit"])
            rec["fraction_of_compute"] = rec["gflops"] / peak if peak else None
            if rec["bytes"]:
                rec["arithmetic_intensity"] = rec["flops"] / rec["bytes"]
        cpu = rec["cpu_time_ms"]
        if cpu and cpu["median"] > 0:
            rec["speedup_vs_cpu"] = cpu["median"] / med


def _finite(x: float) -> Optional[float]:
    """JSON has no inf/nan: those become None (the message says why)."""
    return float(x) if x == x and abs(x) != float("inf") else None
