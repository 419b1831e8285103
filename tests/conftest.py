"""Shared test setup: skip `gpu` / `multigpu` tests where they cannot run; leave `slow` tests
out of the default run (`--runslow` adds them); one summary line per skip reason; the
`backend` fixture.

The markers themselves are declared in pyproject.toml.
"""
import collections
import os
import tempfile

import pytest
from hypothesis import settings

from cuda_backend.driver import load_driver

# Property tests take their example counts from tests/fuzzing.py: CUDA_BACKEND_FUZZ=full runs
# 200+ per family (the fuzzing run), =sanitize keeps compute-sanitizer runs short.
settings.register_profile("ci", deadline=None)
settings.load_profile("ci")

# tests/helpers.py: the helpers several test files share; their asserts report like a test's.
pytest.register_assert_rewrite("helpers")


def _autotune_file_of_this_run() -> str:
    """The tests' own autotuning choices, one folder per run (the xdist workers of a run share
    it): picks timed under the suite's parallel load must not reach the user's file, where a
    later `cuda-backend report` would reuse them (perf/NOTES.md "Full reports" S17)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    uid = os.getuid() if hasattr(os, "getuid") else 0
    folder = os.path.join(tempfile.gettempdir(), f"cuda_backend-tests-{uid}-{run}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return os.path.join(folder, "autotune.json")


os.environ["CUDA_BACKEND_AUTOTUNE_PATH"] = _autotune_file_of_this_run()


# Tests at full sizes (4096^2 matmul, 2^26-element reductions, 8192x4096 rows, seq 16384
# attention...) carry `@pytest.mark.large` so the sanitizer runs can leave them out:
# racecheck and synccheck check hazards inside a block, and every kernel config these run is
# also run by a small, odd-sized test in the same file (the "every config" tests).


SLOW_LEFT_OUT = pytest.StashKey[int]()


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the tests marked `slow` (every template variant through "
                          "nvcc, the wheel build, the long pool state machine); the default "
                          "run leaves them out unless an -m expression or their node id "
                          "names them")


def _named_ids(config):
    """Node ids given on the command line (`tests/x.py::test`), relative to the rootdir."""
    ids = []
    for arg in config.args:
        if "::" in arg:
            path, rest = arg.split("::", 1)
            rel = os.path.relpath(os.path.abspath(path), str(config.rootpath))
            ids.append(rel.replace(os.sep, "/") + "::" + rest)
    return ids


def _leave_out_slow(config, items):
    """Deselect `slow` tests unless --runslow, an -m expression (it selects exactly what it
    says) or an explicit node id asks for them."""
    if config.getoption("--runslow") or config.option.markexpr:
        return
    named = _named_ids(config)
    keep, slow = [], []
    for item in items:
        explicit = any(item.nodeid == n or item.nodeid.startswith((n + "[", n + "::"))
                       for n in named)
        (slow if item.get_closest_marker("slow") and not explicit else keep).append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = keep
    config.stash[SLOW_LEFT_OUT] = len(slow)


def pytest_collection_modifyitems(config, items):
    _leave_out_slow(config, items)
    needs_gpu = [it for it in items
                 if it.get_closest_marker("gpu") or it.get_closest_marker("multigpu")]
    if not needs_gpu:
        return
    drv, reason = load_driver()
    gpu_count = drv.Device.count() if drv is not None else 0
    for item in needs_gpu:
        if drv is None:
            item.add_marker(pytest.mark.skip(reason=reason))
        elif item.get_closest_marker("multigpu") and gpu_count < 2:
            item.add_marker(pytest.mark.skip(
                reason=f"needs 2 or more CUDA GPUs, found {gpu_count}"))


@pytest.fixture(scope="session")
def backend():
    """The process-wide backend (fallback mode without PyCUDA or a GPU)."""
    from cuda_backend import get_cuda_backend
    return get_cuda_backend()


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Skips counted once per reason (not one line per test), and how to run what the
    default run left out."""
    skipped = terminalreporter.stats.get("skipped", [])
    if skipped:
        reasons = collections.Counter(_skip_reason(r) for r in skipped)
        terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason")
        for reason, n in reasons.most_common():
            terminalreporter.write_line(f"{n:>6}  {reason}")
    left_out = config.stash.get(SLOW_LEFT_OUT, 0)
    if left_out:
        what = "test left out (--runslow runs it)" if left_out == 1 else \
            "tests left out (--runslow runs them)"
        terminalreporter.write_line(f"{left_out} slow {what}")
