"""Exit (README.md, Guarantees: clean exit): the interpreter exits after exceptions without
CUDA or context errors. Each scenario runs in a subprocess that creates tensors and compiles kernels
through math operations, then ends badly (an uncaught exception, KeyboardInterrupt, a real
SIGINT in the middle of work, sys.exit inside `with backend.device(0):`, a worker thread that
used the backend and finished or raised, tensors kept alive by a reference cycle until the
final collection); the exit status is the expected one and stderr has no PyCUDA, context-stack,
driver or finalization messages.

The scenarios run in fallback mode too (there the check is about Python-level errors at exit:
atexit handlers, __del__ during finalization); on a GPU they exercise context and pool teardown.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from cuda_backend import FALLBACK_MESSAGE
from cuda_backend.driver import load_driver

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 180
GPU = load_driver()[0] is not None  # the mode the subprocesses will be in

# Package bug (fallback mode): a fallback pool block gives itself back in a Python __del__
# (memory_host._HostBlock.__del__). A KeyboardInterrupt that arrives while such a block is being
# collected is raised inside __del__, where CPython can only print "Exception ignored in" and
# drop it: Ctrl-C is lost (the program keeps running) and the block's bytes stay counted as
# active for good. test_interrupt_while_tensors_are_collected shows it deterministically.
FORBIDDEN = ("PyCUDA", "context stack", "CUDA_ERROR", "cuModuleUnload", "cuMemFree",
             "Exception ignored", "Fatal Python error", "Segmentation fault", "Aborted",
             "terminate called", "dead context")

PRELUDE = textwrap.dedent("""
    import sys, threading
    import numpy as np
    import cuda_backend as cb
    from cuda_backend.cuda_math import get_cuda_math
    b = cb.get_cuda_backend()
    m = get_cuda_math()

    def work():
        # tensors, and (on a GPU) kernels compiled by the math operations that make them
        x = m.from_numpy(np.arange(64, dtype=np.float32).reshape(8, 8))
        y = m.add(x, 1.0)
        z = m.matrix_multiply(x, y)
        s = m.softmax(z)
        r = m.reduce_sum(s, axis=1)
        t = m.matrix_transpose(x)
        a = m.argmax(m.exp(m.multiply(x, 0.01)))
        assert abs(float(m.to_numpy(r).sum()) - 8.0) < 1e-4
        return [x, y, z, s, r, t, a]
""")

SCENARIOS = {
    # name: (body, expected exit statuses, text stderr must contain)
    "uncaught-exception": ("""
        keep = work()
        raise RuntimeError("boom after tensors and kernels")
    """, (1,), "RuntimeError: boom after tensors and kernels"),
    "exception-inside-device-block": ("""
        keep = work()
        with b.device(0):
            more = work()
            raise ValueError("boom inside the device block")
    """, (1,), "ValueError: boom inside the device block"),
    "exception-with-freed-and-live-tensors": ("""
        keep = work()
        for t in keep[:3]:
            t.free()
        pending = [m.add(keep[3], keep[3]) for _ in range(10)]
        raise KeyError("boom with half the tensors freed")
    """, (1,), "KeyError: 'boom with half the tensors freed'"),
    "keyboard-interrupt": ("""
        keep = work()
        raise KeyboardInterrupt
    """, (-signal.SIGINT, 128 + signal.SIGINT), "KeyboardInterrupt"),
    "sys-exit-3-in-device-block": ("""
        keep = work()
        with b.device(0):
            more = work()
            sys.exit(3)
    """, (3,), ""),
    "worker-thread-finished": ("""
        out = []
        def worker():
            b.set_device(0)
            out.append(work())
            with b.device(0):
                out.append(work())
        th = threading.Thread(target=worker)
        th.start()
        th.join(120)
        assert not th.is_alive() and len(out) == 2
        keep = work()
    """, (0,), ""),
    "worker-thread-raised": ("""
        def worker():
            kept = work()
            raise RuntimeError("boom in the worker")
        th = threading.Thread(target=worker)
        th.start()
        th.join(120)
        keep = work()
    """, (0,), "RuntimeError: boom in the worker"),
    "worker-thread-finished-then-main-raises": ("""
        results = []
        ths = [threading.Thread(target=lambda: results.append(work())) for _ in range(4)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(120)
        raise RuntimeError("boom after the workers")
    """, (1,), "RuntimeError: boom after the workers"),
    "tensors-in-a-reference-cycle": ("""
        class Holder:
            pass
        h = Holder()
        h.me = h                 # only the final collection frees these tensors
        h.tensors = work()
        del h
        keep = work()
        raise RuntimeError("boom with a cycle pending")
    """, (1,), "RuntimeError: boom with a cycle pending"),
}


def run_py(code: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=timeout)


def unexpected_stderr(stderr: str) -> list:
    """Lines of stderr with a forbidden message (the fallback-mode notice excepted)."""
    lines = [ln for ln in stderr.splitlines() if FALLBACK_MESSAGE not in ln]
    return [ln for ln in lines if any(bad in ln for bad in FORBIDDEN)]


def check_exit(r: subprocess.CompletedProcess, statuses, must_contain: str, name: str) -> None:
    report = f"{name}: exit status {r.returncode}\n--- stdout ---\n{r.stdout[-2000:]}" \
             f"\n--- stderr ---\n{r.stderr[-4000:]}"
    assert r.returncode in statuses, report
    assert not unexpected_stderr(r.stderr), report
    if must_contain:
        assert must_contain in r.stderr, report
        # exactly the one expected traceback, nothing printed after it at exit
        assert r.stderr.count("Traceback (most recent call last)") == 1, report
        assert r.stderr.rstrip().endswith(must_contain), report
    else:
        assert "Traceback" not in r.stderr, report


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_exit_after_errors_is_clean(name):
    body, statuses, must_contain = SCENARIOS[name]
    r = run_py(PRELUDE + textwrap.dedent(body))
    check_exit(r, statuses, must_contain, name)


def test_sigint_in_the_middle_of_work():
    """A real Ctrl-C while operations run: KeyboardInterrupt, and a clean exit."""
    # A child inherits an ignored SIGINT (pytest started with SIGINT ignored: `nohup`, a
    # background job of a non-interactive shell, some CI runners), and Python then installs no
    # KeyboardInterrupt handler. The child first installs the handler Python's startup gives a
    # program whose SIGINT is not ignored, as when started from a terminal.
    code = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n" \
        + PRELUDE + textwrap.dedent("""
        keep = work()
        print("READY", flush=True)
        while True:
            keep = work()
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    watchdog = threading.Timer(TIMEOUT_S, p.kill)  # never wait forever for "READY"
    watchdog.start()
    try:
        line = p.stdout.readline()
        assert line.strip() == "READY", p.stderr.read()
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            pytest.fail(f"the process ignored SIGINT and kept running:\n{err[-3000:]}")
    except BaseException:
        p.kill()
        p.communicate()
        raise
    finally:
        watchdog.cancel()
    r = subprocess.CompletedProcess(p.args, p.returncode, line + out, err)
    check_exit(r, (-signal.SIGINT, 128 + signal.SIGINT), "KeyboardInterrupt", "SIGINT")


@pytest.mark.gpu
def test_exception_inside_a_stream_block():
    """Work queued on a non-default stream, then an exception inside `with stream:`."""
    code = PRELUDE + textwrap.dedent("""
        keep = work()
        with b.stream() as s:
            more = [work() for _ in range(5)]
            raise RuntimeError("boom inside the stream block")
    """)
    check_exit(run_py(code), (1,), "RuntimeError: boom inside the stream block", "stream")


def test_interrupt_while_tensors_are_collected():
    """A KeyboardInterrupt (here from a timer signal) that arrives while a list of tensors is
    being freed must reach the program, and leave the pool's accounting right."""
    code = PRELUDE + textwrap.dedent("""
        import signal, time
        tensors = [m.create_tensor(4) for _ in range(100_000)]
        signal.signal(signal.SIGALRM, signal.default_int_handler)
        signal.setitimer(signal.ITIMER_REAL, 0.02)   # fires while the list is being freed
        del tensors
        time.sleep(1.5)                              # or here, if freeing was faster
        print("INTERRUPT LOST; active bytes:",
              b.memory_pools[0].get_stats()["active_memory"], flush=True)
    """)
    r = run_py(code)
    check_exit(r, (-signal.SIGINT, 128 + signal.SIGINT), "KeyboardInterrupt", "interrupt")
