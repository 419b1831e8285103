"""The autotuner with a stand-in backend whose "GPU" times are set by the test: the fastest
config wins, a config that fails to compile, whose launch the device refuses or that runs out
of memory loses, a kernel fault stops the tuning with its message, the timing goes through
the package's primitive (performance/timing.py, L2 flushed before each sample), choices are
kept in memory and on disk (atomically written JSON), and a repeated call does not time
again."""
from __future__ import annotations

import contextlib
import json
import types

import pytest

from cuda_backend.autotune import Autotuner
from cuda_backend.errors import (CudaBackendError, CudaOutOfMemoryError,
                                 KernelCompilationError, KernelLaunchError,
                                 LaunchConfigurationError, driver_failure)
from cuda_backend.performance import timing


class _DriverError(Exception):
    """Stands in for pycuda.driver.Error."""


class _Clock:
    """Fake driver: events read a clock that run(cfg) advances by the config's cost; a
    `fault` set by run is raised by the next synchronize, as the driver reports an
    asynchronous kernel fault."""

    Error = _DriverError

    def __init__(self):
        self.now = 0.0
        self.fault = None
        self.memsets = 0
        self.allocated = []
        self.freed = 0
        self.alloc_error = None
        drv = self

        def synchronize():
            if drv.fault is not None:
                raise drv.fault

        class Event:
            def record(self, stream=None):
                self.t = drv.now

            def synchronize(self):
                synchronize()

            def time_since(self, other):
                return self.t - other.t

        class Allocation(int):
            def free(self):
                drv.freed += 1

        def mem_alloc(nbytes):
            if drv.alloc_error is not None:
                raise drv.alloc_error
            drv.allocated.append(nbytes)
            return Allocation(4096)

        def memset_d32_async(ptr, value, count):
            drv.memsets += 1

        self.Event = Event
        self.Context = types.SimpleNamespace(synchronize=synchronize)
        self.mem_alloc = mem_alloc
        self.memset_d32_async = memset_d32_async


class _Backend:
    is_available = True

    def __init__(self):
        self.drv = _Clock()
        self.devices = [types.SimpleNamespace(name="Fake GPU", l2_cache_size=50 << 20)]

    @contextlib.contextmanager
    def activate(self, device_id):
        yield

    def allocate_memory(self, size, device_id=None):   # the pool: the autotuner must not use it
        raise AssertionError("the autotuner's flush buffer must not come from the pool")


CANDS = [{"tile": 32}, {"tile": 64}, {"tile": 128}]
COST = {32: 3.0, 64: 1.0, 128: 2.0}


@pytest.fixture(autouse=True)
def _no_repeat_cap(monkeypatch):
    monkeypatch.delenv("CUDA_BACKEND_AUTOTUNE_REPEATS", raising=False)


def make(tmp_path):
    b = _Backend()
    calls = []

    def run(cfg):
        calls.append(cfg["tile"])
        cost = COST[cfg["tile"]]
        if cost is None:
            raise LaunchConfigurationError("block of 2048 threads is over the device limit")
        if isinstance(cost, Exception):
            raise cost
        if callable(cost):
            cost = cost(b)
        b.drv.now += cost

    return Autotuner(b, path=str(tmp_path / "tune.json")), run, calls


def test_fastest_wins_and_is_remembered(tmp_path):
    tuner, run, calls = make(tmp_path)
    assert tuner.pick("op", ("f32", "large"), CANDS, run) == {"tile": 64}
    timed = len(calls)
    assert timed == 3 * 4           # warm-up + 3 repeats per candidate
    choice = tuner.pick("op", ("f32", "large"), CANDS, run)
    assert choice == {"tile": 64} and len(calls) == timed      # no second timing
    choice["tile"] = 1                                          # callers get a copy
    assert tuner.pick("op", ("f32", "large"), CANDS, run) == {"tile": 64}
    doc = json.loads((tmp_path / "tune.json").read_text())
    (key, entry), = doc["choices"].items()
    assert "Fake GPU|op|" in key and entry["config"] == {"tile": 64}


def test_saved_choice_is_used_by_a_new_tuner(tmp_path):
    tuner, run, calls = make(tmp_path)
    tuner.pick("op", "medium", CANDS, run)
    fresh, run2, calls2 = make(tmp_path)
    assert fresh.pick("op", "medium", CANDS, run2) == {"tile": 64} and calls2 == []


def test_another_candidate_list_is_timed_again(tmp_path):
    tuner, run, calls = make(tmp_path)
    tuner.pick("op", "c", CANDS, run)
    n = len(calls)
    assert tuner.pick("op", "c", CANDS[:1] + CANDS[2:], run) == {"tile": 128}
    assert len(calls) > n


def test_a_failing_config_loses(tmp_path, monkeypatch):
    monkeypatch.setitem(COST, 64, None)
    tuner, run, _ = make(tmp_path)
    assert tuner.pick("op", "x", CANDS, run) == {"tile": 128}


def test_every_config_failing_is_a_typed_error(tmp_path, monkeypatch):
    for t in COST:
        monkeypatch.setitem(COST, t, None)
    tuner, run, _ = make(tmp_path)
    with pytest.raises(CudaBackendError, match="every candidate"):
        tuner.pick("op", "x", CANDS, run)


def test_unhashable_shape_class_still_works(tmp_path):
    tuner, run, calls = make(tmp_path)
    assert tuner.pick("op", ["list", 1], CANDS, run) == {"tile": 64}
    n = len(calls)
    assert tuner.pick("op", ["list", 1], CANDS, run) == {"tile": 64} and len(calls) == n


def test_repeat_cap_from_the_environment(tmp_path, monkeypatch):
    """CUDA_BACKEND_AUTOTUNE_REPEATS=1 (sanitizer runs): each candidate runs warm-up + 1."""
    monkeypatch.setenv("CUDA_BACKEND_AUTOTUNE_REPEATS", "1")
    tuner, run, calls = make(tmp_path)
    assert tuner.pick("op", "cls", CANDS, run, repeats=10) == {"tile": 64}
    assert len(calls) == 3 * 2


# -- errors: losing candidates, faults that stop the tuning ----------------------------------
_FAULT = "cuLaunchKernel failed: an illegal memory access was encountered"


@pytest.mark.parametrize("error", [
    KernelCompilationError("matmul_64", "kernel.cu(3): error: identifier undefined", "x"),
    LaunchConfigurationError("kernel 'k': 99000 bytes of dynamic shared memory is over"),
    driver_failure("launch of kernel 'k'",
                   _DriverError("cuLaunchKernel failed: too many resources requested for "
                                "launch"), 0),
    _DriverError("cuLaunchKernel failed: out of resources"),
    CudaOutOfMemoryError(1 << 30, 0, 0, 0, None),
], ids=["compile", "launch-config", "too-many-resources", "raw-out-of-resources", "oom"])
def test_compile_resource_and_memory_errors_lose(tmp_path, monkeypatch, error):
    """The failing candidate loses; the others are timed (warm-up + 3 each) and the best wins."""
    monkeypatch.setitem(COST, 64, error)
    tuner, run, calls = make(tmp_path)
    assert tuner.pick("op", "x", CANDS, run) == {"tile": 128}
    assert calls.count(32) == 4 and calls.count(128) == 4 and calls.count(64) == 1
    entry, = json.loads((tmp_path / "tune.json").read_text())["choices"].values()
    assert entry["all_ms"]['{"tile": 64}'] == float("inf")


def test_every_failure_is_named_when_all_lose(tmp_path, monkeypatch):
    monkeypatch.setitem(COST, 32, KernelCompilationError("k32", "error: bad", "src"))
    monkeypatch.setitem(COST, 64, None)
    monkeypatch.setitem(COST, 128, CudaOutOfMemoryError(1 << 30, 0, 0, 0, None))
    tuner, run, _ = make(tmp_path)
    with pytest.raises(CudaBackendError, match="every candidate") as info:
        tuner.pick("op", "x", CANDS, run)
    text = str(info.value)
    assert "Failed to compile CUDA kernel 'k32'" in text and "over the device limit" in text
    assert "CUDA out of memory" in text


@pytest.mark.parametrize("where", ["launch", "synchronize"])
def test_a_fault_stops_the_tuning_with_its_message(tmp_path, monkeypatch, where):
    """A fault raised by the launch (KernelLaunchError from driver_failure) or surfacing at
    the timer's synchronize (a raw driver error): no later candidate runs, nothing is saved,
    and the error names the candidate, the fault and the lost context."""
    if where == "launch":
        monkeypatch.setitem(COST, 64, driver_failure("launch of kernel 'k'",
                                                      _DriverError(_FAULT), 0))
    else:
        def faults(b):
            b.drv.fault = _DriverError("cuCtxSynchronize failed: an illegal memory access "
                                        "was encountered")
            return 1.0
        monkeypatch.setitem(COST, 64, faults)
    tuner, run, calls = make(tmp_path)
    with pytest.raises(KernelLaunchError) as info:
        tuner.pick("op", "cls", CANDS, run)
    text = str(info.value)
    assert "illegal memory access" in text and "{'tile': 64}" in text
    assert "no longer usable" in text and "tuning stopped" in text
    assert 128 not in calls and calls.count(64) == 1
    assert not (tmp_path / "tune.json").exists()
    assert tuner.backend.drv.freed == 1              # the flush buffer is given back


def test_a_launch_error_that_is_no_resource_error_stops_too(tmp_path, monkeypatch):
    monkeypatch.setitem(COST, 32, driver_failure(
        "launch of kernel 'k'", _DriverError("cuLaunchKernel failed: invalid resource handle"), 0))
    tuner, run, calls = make(tmp_path)
    with pytest.raises(KernelLaunchError, match="invalid resource handle"):
        tuner.pick("op", "cls", CANDS, run)
    assert calls == [32]


def test_a_python_error_in_run_propagates_unchanged(tmp_path, monkeypatch):
    monkeypatch.setitem(COST, 32, TypeError("run() got a bad argument"))
    tuner, run, calls = make(tmp_path)
    with pytest.raises(TypeError, match="bad argument"):
        tuner.pick("op", "cls", CANDS, run)
    assert calls == [32]


# -- the timing primitive ---------------------------------------------------------------------
def test_timing_goes_through_the_primitive(tmp_path, monkeypatch):
    """make_timer is asked for a flushing timer outside the pool; each candidate is one
    median_ms call (warm-up 1, `repeats` samples); the timer is closed."""
    made, timed = [], []
    medians = {32: 5.0, 64: 7.0, 128: 0.5}

    class FakeTimer:
        closed = False

        def median_ms(self, fn, warmup, iterations, **kw):
            timed.append((warmup, iterations))
            fn()
            return medians[calls[-1]]

        def close(self):
            FakeTimer.closed = True

    def fake_make_timer(backend, device_id, flush_l2, **kw):
        made.append((device_id, flush_l2, kw))
        return FakeTimer()

    monkeypatch.setattr(timing, "make_timer", fake_make_timer)
    tuner, run, calls = make(tmp_path)
    assert tuner.pick("op", "cls", CANDS, run, repeats=5) == {"tile": 128}
    assert made == [(0, True, {"pool": False, "min_flush_bytes": timing.LONG_FLUSH_BYTES})]
    assert timed == [(1, 5)] * 3 and FakeTimer.closed


def test_the_l2_is_flushed_before_each_sample(tmp_path):
    tuner, run, calls = make(tmp_path)
    tuner.pick("op", "cls", CANDS, run)
    drv = tuner.backend.drv
    assert drv.memsets == 3 * 3                       # 3 candidates x 3 samples
    # LONG_FLUSH_BYTES (over 2 x L2 here), from the driver
    assert drv.allocated == [max(timing.LONG_FLUSH_BYTES, 100 << 20)] and drv.freed == 1


def test_device_timer_protocol():
    """Per sample: flush, gap, start event, `calls` calls, end event; ms per call."""
    b = _Backend()
    drv, order = b.drv, []
    memset = drv.memset_d32_async
    drv.memset_d32_async = lambda *a: (order.append("flush"), memset(*a))

    def fn():
        order.append("call")
        drv.now += 2.0

    timer = timing.DeviceTimer(b, 0, True, min_flush_bytes=256 << 20,
                               gap=lambda: order.append("gap"), pool=False)
    assert timer.flush_bytes == 256 << 20
    assert timer.time(fn, warmup=1, iterations=2, calls=3) == [2.0, 2.0]
    assert order == ["call"] + ["flush", "gap", "call", "call", "call"] * 2
    assert timer.median_ms(fn, warmup=0, iterations=1, flush=False) == 2.0
    timer.close()
    assert drv.freed == 1


def test_no_memory_for_the_flush_buffer_times_without_it(tmp_path):
    tuner, run, calls = make(tmp_path)
    tuner.backend.drv.alloc_error = _DriverError("cuMemAlloc failed: out of memory")
    assert tuner.pick("op", "cls", CANDS, run) == {"tile": 64}
    assert tuner.backend.drv.memsets == 0 and len(calls) == 3 * 4


def test_without_memory_for_the_long_flush_the_l2_sized_one_is_used(tmp_path):
    tuner, run, calls = make(tmp_path)
    drv = tuner.backend.drv
    alloc = drv.mem_alloc

    def small_only(nbytes):
        if nbytes > 100 << 20:
            raise _DriverError("cuMemAlloc failed: out of memory")
        return alloc(nbytes)
    drv.mem_alloc = small_only
    assert tuner.pick("op", "cls", CANDS, run) == {"tile": 64}
    assert drv.allocated == [100 << 20] and drv.memsets == 3 * 3 and drv.freed == 1


def test_the_reports_long_flush_timer_takes_its_buffer_from_the_pool_or_the_l2_size():
    """performance/tester.py times with make_long_flush_timer(pool=True): the long flush's
    buffer from the pool (the report's pool), 2 x L2 where the pool has no room for it, and
    a failure other than out-of-memory raises."""
    b = _Backend()
    asked = []

    def allocate(size, device_id=None):
        asked.append(size)
        if size > b.room:
            raise MemoryError(f"out of memory: {size} bytes")
        return 0x1000
    b.allocate_memory, b.free_memory = allocate, lambda ptr, dev=None: None
    b.room = 1 << 40
    timer = timing.make_long_flush_timer(b, 0)
    assert timer.flush_bytes == timing.LONG_FLUSH_BYTES and asked == [timing.LONG_FLUSH_BYTES]
    assert "512 MiB" in timer.flush_description()
    b.room, asked[:] = 200 << 20, []
    timer = timing.make_long_flush_timer(b, 0)
    assert timer.flush_bytes == 100 << 20 and asked == [timing.LONG_FLUSH_BYTES, 100 << 20]

    def broken(size, device_id=None):
        raise ValueError("not an allocation failure")
    b.allocate_memory = broken
    with pytest.raises(ValueError, match="not an allocation failure"):
        timing.make_long_flush_timer(b, 0)


def test_the_tests_autotune_into_a_folder_of_their_own():
    """tests/conftest.py: choices timed under the suite's parallel load stay out of the
    user's file (~/.cache/cuda_backend/autotune.json), in a private folder of this run."""
    import os
    import tempfile
    from cuda_backend.autotune import default_path
    path = default_path()
    folder = os.path.dirname(path)
    assert os.path.dirname(folder) == tempfile.gettempdir()
    assert os.path.basename(folder).startswith("cuda_backend-tests-")
    assert os.stat(folder).st_mode & 0o077 == 0      # trusted: the autotuner writes it


# -- a damaged file: ignored with a warning, then replaced ------------------------------------
@pytest.mark.parametrize("text", ["null", "[]", '"a string"', "42", "{truncated",
                                  '{"version": 2, "choices": {}}', '{"version": 1, "choices": []}'],
                         ids=["null", "list", "string", "number", "truncated", "version-2",
                              "choices-list"])
def test_a_file_that_is_not_a_version_1_object_is_ignored_and_rewritten(tmp_path, text):
    (tmp_path / "tune.json").write_text(text)
    tuner, run, calls = make(tmp_path)
    with pytest.warns(RuntimeWarning, match=r"ignoring the autotune file .*tune\.json"):
        assert tuner.pick("op", "cls", CANDS, run) == {"tile": 64}
    assert len(calls) == 3 * 4                                  # timed, as with no file
    doc = json.loads((tmp_path / "tune.json").read_text())
    (entry,) = doc["choices"].values()
    assert doc["version"] == 1 and entry["config"] == {"tile": 64}


def test_malformed_entries_are_dropped(tmp_path):
    """An entry under the very key of a choice that is not {"config": {...}} is timed again
    instead of failing in the lookup."""
    from cuda_backend.autotune import _digest
    key = f"Fake GPU|op|{json.dumps('cls')}|{_digest(CANDS)}"
    for bad in ("x", None, {"config": "tile"}, {"ms": 1.0}):
        (tmp_path / "tune.json").write_text(json.dumps({"version": 1, "choices": {key: bad}}))
        tuner, run, calls = make(tmp_path)
        assert tuner.pick("op", "cls", CANDS, run) == {"tile": 64} and len(calls) == 3 * 4
        assert json.loads((tmp_path / "tune.json").read_text())["choices"][key]["config"] == \
            {"tile": 64}
