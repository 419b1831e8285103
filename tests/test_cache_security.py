"""Caches: the compiled-kernel disk cache and the autotune file are trusted only in a folder
this user owns and nobody else can write to (else bypassed, with one warning per folder), and
a cached cubin only when the same holds for its file; both are written atomically (a
temporary file renamed into place); a corrupt cached cubin is recompiled and rewritten; the
launch-validation cache per kernel is bounded.

Everything here but the `gpu` test runs on the CPU: folders are tmp folders, another user is
simulated by changing the uid os.stat reports, and PyCUDA's `compile`/`module_from_buffer`
and the launcher's device are stand-ins.
"""
from __future__ import annotations

import builtins
import contextlib
import json
import os
import stat
import subprocess
import sys
import textwrap
import types
import warnings

import pytest

from cuda_backend import compiler
from cuda_backend.autotune import Autotuner
from cuda_backend.compiler import CudaKernel, KernelCompiler, check_cache_dir, check_cache_file


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    """No cache variables from the caller's environment, a per-user cache folder under
    tmp_path, and no warnings already given."""
    for var in ("CUDA_BACKEND_CACHE_DIR", "PYCUDA_CACHE_DIR", "CUDA_BACKEND_AUTOTUNE_REPEATS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(compiler, "_warned_paths", set())


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _owned_by_another_user(monkeypatch, *paths) -> None:
    """os.stat reports paths as owned by a uid that is not this process's."""
    real = os.stat
    targets = {os.path.abspath(p) for p in paths}

    def fake_stat(path, *args, **kwargs):
        st = real(path, *args, **kwargs)
        if os.path.abspath(os.fspath(path)) in targets:
            fields = list(st[:10])
            fields[4] = os.getuid() + 1000          # st_uid
            return os.stat_result(fields)
        return st

    monkeypatch.setattr(os, "stat", fake_stat)


def _shared(path, mode=0o777):
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    return path


# -- check_cache_dir ----------------------------------------------------------------------------
def test_a_missing_folder_is_created_private(tmp_path):
    path = tmp_path / "a" / "cache"
    assert check_cache_dir(str(path)) is None
    assert _mode(path) == 0o700


def test_an_existing_private_folder_is_trusted(tmp_path):
    assert check_cache_dir(str(_shared(tmp_path / "c", 0o755))) is None
    assert check_cache_dir(str(_shared(tmp_path / "d", 0o700))) is None


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o722], ids=oct)
def test_a_folder_others_can_write_to_is_refused(tmp_path, mode):
    reason = check_cache_dir(str(_shared(tmp_path / "shared", mode)))
    assert reason is not None and "other users can write to it" in reason
    assert oct(mode)[2:] in reason


def test_a_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    path = _shared(tmp_path / "theirs", 0o700)
    _owned_by_another_user(monkeypatch, path)
    reason = check_cache_dir(str(path))
    assert reason is not None and f"owned by uid {os.getuid() + 1000}" in reason


def test_a_file_in_place_of_the_folder_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    assert check_cache_dir(str(tmp_path / "file")) is not None


def test_check_cache_file(tmp_path, monkeypatch):
    f = tmp_path / "f.json"
    assert check_cache_file(str(f)) is None                    # missing: nothing to distrust
    f.write_text("{}")
    os.chmod(f, 0o600)
    assert check_cache_file(str(f)) is None
    os.chmod(f, 0o666)
    assert "other users can write" in check_cache_file(str(f))
    os.chmod(f, 0o600)
    _owned_by_another_user(monkeypatch, f)
    assert "owned by uid" in check_cache_file(str(f))


# -- the compiled-kernel cache -----------------------------------------------------------------
class _Error(Exception):
    pass


class _LogicError(_Error):
    pass


class _CompileError(_Error):
    pass


NVCC = "Cuda compilation tools, release 13.0, V13.0.48"


def _compiler(monkeypatch, nvcc_version=NVCC, load_error=None):
    """A KernelCompiler over stand-ins for PyCUDA's `compile` (a "cubin" that is b"CUBIN:" +
    the source; records each call) and `module_from_buffer` (records each image; raises
    LogicError for one that is not such a cubin, or load_error when given)."""
    log = types.SimpleNamespace(compiled=[], loaded=[])

    def compile(source, options, arch, code, no_extern_c, cache_dir):
        assert no_extern_c is True and cache_dir is False     # PyCUDA's cache is not used
        log.compiled.append((source, tuple(options), arch, code))
        return b"CUBIN:" + source.encode()

    def module_from_buffer(cubin):
        log.loaded.append(cubin)
        if load_error is not None:
            raise load_error
        if not cubin.startswith(b"CUBIN:"):
            raise _LogicError("cuModuleLoadDataEx failed: device kernel image is invalid")
        return ("module", cubin)

    fake = types.ModuleType("pycuda.compiler")
    fake.compile = compile
    fake.get_nvcc_version = lambda nvcc: nvcc_version
    pkg = types.ModuleType("pycuda")
    pkg.VERSION_TEXT, pkg.compiler = "2026.1", fake
    monkeypatch.setitem(sys.modules, "pycuda", pkg)
    monkeypatch.setitem(sys.modules, "pycuda.compiler", fake)
    drv = types.SimpleNamespace(Error=_Error, LogicError=_LogicError, CompileError=_CompileError,
                                module_from_buffer=module_from_buffer)
    contexts = types.SimpleNamespace(activate=lambda d: contextlib.nullcontext())
    return KernelCompiler(drv, contexts, []), log


def _entries(folder):
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _only_entry(folder):
    names = _entries(folder)
    assert len(names) == 1 and names[0].endswith(".cubin"), names
    return folder / names[0]


@pytest.mark.parametrize("where", ["CUDA_BACKEND_CACHE_DIR", "default"])
def test_a_shared_cache_folder_is_bypassed_with_one_warning(tmp_path, monkeypatch, where):
    """A cubin planted in a folder others can write to would run in this process: compile
    without the disk cache instead, and say so once."""
    if where == "default":
        shared = _shared(tmp_path / "xdg" / "cuda_backend" / "kernels")
    else:
        shared = _shared(tmp_path / "cuda-backend-cache")
        monkeypatch.setenv(where, str(shared))
    comp, log = _compiler(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert comp._build("k", "src", (), 0, "sm_90") == ("module", b"CUBIN:src")
    assert len(log.compiled) == 3 and comp.compile_count == 3 and comp.disk_hits == 0
    assert _entries(shared) == []                                   # nothing written there
    mine = [w for w in caught if "compiled-kernel cache" in str(w.message)]
    assert len(mine) == 1 and issubclass(mine[0].category, RuntimeWarning)
    assert str(shared) in str(mine[0].message) and "0o777" in str(mine[0].message)


def test_a_cache_folder_of_another_user_is_bypassed(tmp_path, monkeypatch):
    theirs = _shared(tmp_path / "theirs", 0o755)
    _owned_by_another_user(monkeypatch, theirs)
    monkeypatch.setenv("CUDA_BACKEND_CACHE_DIR", str(theirs))
    comp, log = _compiler(monkeypatch)
    with pytest.warns(RuntimeWarning, match="owned by uid"):
        comp._build("k", "src", (), 0, "sm_90")
    assert len(log.compiled) == 1 and _entries(theirs) == []


def test_an_entry_is_written_atomically_private_and_reused(tmp_path, monkeypatch):
    """The cubin reaches its final name only through os.replace of a temporary file in the
    same folder (never opened for writing there): a reader sees all of it or none. A new
    folder is made 0700, the file is 0600, and a second compiler (another process) loads it
    without compiling."""
    path = tmp_path / "mine" / "kernels"
    monkeypatch.setenv("CUDA_BACKEND_CACHE_DIR", str(path))
    replaced, written = [], []
    real_replace, real_os_open, real_open = os.replace, os.open, builtins.open

    def spy_replace(src, dst):
        replaced.append((os.fspath(src), os.fspath(dst)))
        real_replace(src, dst)

    def spy_os_open(file, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR):
            written.append(os.fspath(file))
        return real_os_open(file, flags, *a, **k)

    def spy_open(file, mode="r", *a, **k):
        if isinstance(file, (str, bytes, os.PathLike)) and set(mode) & set("wax+"):
            written.append(os.fspath(file))
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr(os, "replace", spy_replace)
    monkeypatch.setattr(os, "open", spy_os_open)
    monkeypatch.setattr(builtins, "open", spy_open)
    comp, log = _compiler(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert comp._build("k", "src", ("-O3",), 0, "sm_90") == ("module", b"CUBIN:src")
    final = _only_entry(path)
    assert len(final.stem) == 64                                    # <sha256>.cubin
    assert len(replaced) == 1 and replaced[0][1] == str(final)
    tmp = replaced[0][0]
    assert os.path.dirname(tmp) == str(path) and tmp != str(final) and not os.path.exists(tmp)
    assert str(final) not in written and tmp in written
    assert _mode(path) == 0o700 and _mode(final) == 0o600
    assert final.read_bytes() == b"CUBIN:src"

    again, log2 = _compiler(monkeypatch)
    assert again._build("k", "src", ("-O3",), 0, "sm_90") == ("module", b"CUBIN:src")
    assert log2.compiled == [] and again.disk_hits == 1 and again.compile_count == 0
    assert len(replaced) == 1                                       # not rewritten


def test_the_key_covers_source_options_arch_and_versions(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_BACKEND_CACHE_DIR", str(tmp_path / "c"))
    comp, log = _compiler(monkeypatch)
    comp._build("k", "src", (), 0, "sm_90")
    comp._build("k", "src2", (), 0, "sm_90")
    comp._build("k", "src", ("-O3",), 0, "sm_90")
    comp._build("k", "src", (), 0, "sm_80")
    comp._build("k", "src", (), 0, "sm_90a")                   # compute_90a + code sm_90a
    assert log.compiled[-1] == ("src", (), "compute_90a", "sm_90a")
    comp._build("k", "src", (), 0, "sm_90")                    # a disk hit
    assert len(log.compiled) == 5 and comp.disk_hits == 1
    newer, log2 = _compiler(monkeypatch, nvcc_version=NVCC.replace("13.0", "13.1"))
    newer._build("k", "src", (), 0, "sm_90")
    sys.modules["pycuda"].VERSION_TEXT = "2027.1"
    newer._build("k", "src", (), 0, "sm_90")
    assert len(log2.compiled) == 2 and newer.disk_hits == 0
    assert len(_entries(tmp_path / "c")) == 7


@pytest.mark.parametrize("who", ["their-file", "shared-file"])
def test_a_planted_cubin_is_not_loaded(tmp_path, monkeypatch, who):
    """A file at the right name that another user owns, or that others can write to, is not
    loaded: the kernel is compiled again (and the entry replaced by ours), with a warning."""
    folder = tmp_path / "c"
    monkeypatch.setenv("CUDA_BACKEND_CACHE_DIR", str(folder))
    first, _ = _compiler(monkeypatch)
    first._build("k", "src", (), 0, "sm_90")
    f = _only_entry(folder)
    f.write_bytes(b"CUBIN:planted")
    if who == "their-file":
        _owned_by_another_user(monkeypatch, f)
    else:
        os.chmod(f, 0o666)
    comp, log = _compiler(monkeypatch)
    with pytest.warns(RuntimeWarning, match=r"not using .*\.cubin.* for the compiled-kernel "
                      r"cache \(recompiling\): .*(owned by uid|other users can write)"):
        assert comp._build("k", "src", (), 0, "sm_90") == ("module", b"CUBIN:src")
    assert b"CUBIN:planted" not in log.loaded and len(log.compiled) == 1
    assert comp.disk_hits == 0 and f.read_bytes() == b"CUBIN:src" and _mode(f) == 0o600


@pytest.mark.parametrize("content", [b"", b"CUB", b"\x7fELF garbage"], ids=["empty", "short",
                                                                            "garbage"])
def test_a_corrupt_cached_file_is_recompiled_and_rewritten(tmp_path, monkeypatch, content):
    """A partial file cannot appear at the final name (written to a temporary file and
    renamed), but a corrupt one (disk error, an older writer) must not be fatal."""
    folder = tmp_path / "c"
    monkeypatch.setenv("CUDA_BACKEND_CACHE_DIR", str(folder))
    first, _ = _compiler(monkeypatch)
    first._build("k", "src", (), 0, "sm_90")
    f = _only_entry(folder)
    f.write_bytes(content)
    comp, log = _compiler(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert comp._build("k", "src", (), 0, "sm_90") == ("module", b"CUBIN:src")
    assert len(log.compiled) == 1 and comp.disk_hits == 0
    assert f.read_bytes() == b"CUBIN:src" and _entries(folder) == [f.name]
    again, log2 = _compiler(monkeypatch)
    again._build("k", "src", (), 0, "sm_90")
    assert log2.compiled == [] and again.disk_hits == 1


@pytest.mark.parametrize("xdg", [True, False], ids=["XDG_CACHE_HOME", "HOME"])
def test_without_the_variable_the_per_user_folder_is_used(tmp_path, monkeypatch, xdg):
    if xdg:
        folder = tmp_path / "xdg" / "cuda_backend" / "kernels"
    else:
        monkeypatch.delenv("XDG_CACHE_HOME")
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        folder = tmp_path / "home" / ".cache" / "cuda_backend" / "kernels"
    comp, log = _compiler(monkeypatch)
    comp._build("k", "src", (), 0, "sm_90")
    assert _only_entry(folder).read_bytes() == b"CUBIN:src" and _mode(folder) == 0o700


def test_a_compile_error_keeps_its_message_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_BACKEND_CACHE_DIR", str(tmp_path / "c"))
    comp, _ = _compiler(monkeypatch)

    def failing(source, **kw):
        exc = _CompileError("nvcc compilation of kernel.cu failed")
        exc.stdout, exc.stderr = "", 'kernel.cu(2): error: identifier "nope" is undefined'
        exc.command_line = ["nvcc", "--cubin", "-arch", "sm_90", "kernel.cu"]
        raise exc

    monkeypatch.setattr(sys.modules["pycuda.compiler"], "compile", failing)
    with pytest.raises(compiler.KernelCompilationError) as info:
        comp._build("k", "x\n  nope;\n", (), 0, "sm_90")
    msg = str(info.value)
    assert msg.startswith("Failed to compile CUDA kernel 'k'\ncommand: nvcc --cubin -arch sm_90")
    assert '"nope" is undefined' in msg and ">>2 |" in msg
    assert _entries(tmp_path / "c") == [] and comp.compile_count == 0


def test_a_fresh_cubin_that_does_not_load_still_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_BACKEND_CACHE_DIR", str(tmp_path / "c"))
    comp, log = _compiler(monkeypatch, load_error=_LogicError("out of memory"))
    with pytest.raises(_LogicError, match="out of memory"):
        comp._build("k", "src", (), 0, "sm_90")
    assert len(log.compiled) == 1 and _entries(tmp_path / "c") == []


def test_cuda_debugging_bypasses_the_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_BACKEND_CACHE_DIR", str(tmp_path / "c"))
    comp, log = _compiler(monkeypatch)
    comp._drv.CUDA_DEBUGGING = True
    comp._build("k", "src", (), 0, "sm_90")
    comp._build("k", "src", (), 0, "sm_90")
    assert len(log.compiled) == 2 and _entries(tmp_path / "c") == []


TINY = r'''
extern "C" __global__ void disk_cache_probe(float* x, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = 2.0f * x[i] + 1.0f;
}
'''


@pytest.mark.gpu
def test_gpu_second_process_loads_the_cubin_from_disk(tmp_path):
    """Two processes, one CUDA_BACKEND_CACHE_DIR: the first compiles and writes the cubin,
    the second loads it without nvcc (counters, and the file is not rewritten), and the
    kernel it loaded runs correctly."""
    code = textwrap.dedent(f'''
        import numpy as np, cuda_backend as cb
        b = cb.get_cuda_backend()
        assert b.is_available
        c = b.compiler
        before = (c.compile_count, c.disk_hits)
        b.compile_kernel("disk_cache_probe", {TINY!r})
        print("COMPILED", c.compile_count - before[0], "DISK_HITS", c.disk_hits - before[1])
        x = np.arange(1000, dtype=np.float32)
        t = b.to_device(x)
        b.launch_kernel("disk_cache_probe", (4,), t, 1000, block_size=(256,))
        assert np.array_equal(b.to_host(t), 2 * x + 1), "wrong result"
        t.free()
        print("OK")
    ''')
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, CUDA_BACKEND_CACHE_DIR=str(tmp_path / "kernels"),
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUDA_BACKEND_FALLBACK", None)

    def run():
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, timeout=300)
        assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr
        return p.stdout

    first = run()
    assert "COMPILED 1 DISK_HITS 0" in first, first
    cubins = [n for n in os.listdir(tmp_path / "kernels") if n.endswith(".cubin")]
    assert cubins, os.listdir(tmp_path / "kernels")
    mtimes = {n: os.stat(tmp_path / "kernels" / n).st_mtime_ns for n in cubins}
    assert _mode(tmp_path / "kernels") == 0o700
    assert all(_mode(tmp_path / "kernels" / n) == 0o600 for n in cubins)
    second = run()
    assert "COMPILED 0 DISK_HITS 1" in second, second
    assert {n: os.stat(tmp_path / "kernels" / n).st_mtime_ns for n in cubins} == mtimes
    assert not [n for n in os.listdir(tmp_path / "kernels") if n.endswith(".tmp")]


# -- the autotune file -------------------------------------------------------------------------
class _Clock:
    now = 0.0


class _Backend:
    """Just enough of a backend for Autotuner: events read a clock that run(cfg) advances."""

    is_available = True

    def __init__(self):
        clock = self.clock = _Clock()

        class Event:
            def record(self, stream=None):
                self.t = clock.now

            def synchronize(self):
                pass

            def time_since(self, other):
                return self.t - other.t

        class Allocation(int):      # the timer's L2-flush buffer
            def free(self):
                pass

        self.drv = types.SimpleNamespace(Event=Event, Context=types.SimpleNamespace(
            synchronize=lambda: None), mem_alloc=lambda n: Allocation(0x1000),
            memset_d32_async=lambda *a: None)
        self.devices = [types.SimpleNamespace(name="Fake GPU", l2_cache_size=50 << 20)]

    @contextlib.contextmanager
    def activate(self, device_id):
        yield


CANDS = [{"tile": 32}, {"tile": 64}]
COST = {32: 2.0, 64: 1.0}


def _tune(path):
    """(choice, number of timed runs) of a fresh Autotuner on path; tile 64 is faster."""
    b = _Backend()
    calls = []

    def run(cfg):
        calls.append(cfg)
        b.clock.now += COST[cfg["tile"]]

    return Autotuner(b, path=str(path)).pick("op", "cls", CANDS, run), len(calls)


def _planted(folder):
    """An autotune file choosing the slow tile for ("op", "cls")."""
    from cuda_backend.autotune import _digest
    key = f"Fake GPU|op|{json.dumps('cls')}|{_digest(CANDS)}"
    f = folder / "autotune.json"
    f.write_text(json.dumps({"version": 1, "choices": {key: {"config": {"tile": 32}}}}))
    return f


def test_autotune_file_is_trusted_in_a_private_folder(tmp_path):
    f = _planted(_shared(tmp_path / "mine", 0o700))
    os.chmod(f, 0o600)
    assert _tune(f) == ({"tile": 32}, 0)        # the saved choice, not timed again


@pytest.mark.parametrize("who", ["shared-folder", "shared-file", "their-folder", "their-file"])
def test_autotune_file_others_control_is_neither_read_nor_written(tmp_path, monkeypatch, who):
    folder = _shared(tmp_path / "tune", 0o777 if who == "shared-folder" else 0o700)
    f = _planted(folder)
    os.chmod(f, 0o666 if who == "shared-file" else 0o600)
    if who.startswith("their"):
        _owned_by_another_user(monkeypatch, folder if who == "their-folder" else f)
    before = f.read_text()
    with pytest.warns(RuntimeWarning, match=r"not using .*autotune\.json.* for autotuning"):
        assert _tune(f) == ({"tile": 64}, 2 * 4)  # timed here, the planted choice unused
    assert f.read_text() == before and sorted(os.listdir(folder)) == ["autotune.json"]


def test_autotune_folder_is_created_private_and_written_atomically(tmp_path, monkeypatch):
    f = tmp_path / "new" / "cuda_backend" / "autotune.json"
    replaced = []
    real_replace = os.replace

    def spy(src, dst):
        replaced.append((os.path.dirname(src), os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    assert _tune(f) == ({"tile": 64}, 2 * 4)
    assert _mode(f.parent) == 0o700 and _mode(f) & 0o077 == 0
    assert replaced == [(str(f.parent), str(f))]               # a temp file, renamed in place
    assert os.listdir(f.parent) == ["autotune.json"]
    assert _tune(f) == ({"tile": 64}, 0)


# -- the launch-validation cache ---------------------------------------------------------------
def test_launch_validation_cache_is_bounded():
    """One entry per distinct grid (a softmax over 20,000 row counts makes 20,000): the cache
    is emptied when it reaches its cap, and the newest configuration is always in it."""
    from cuda_backend import launch
    launcher = launch.Launcher.__new__(launch.Launcher)      # no PyCUDA: only _validate runs
    launcher._devices = [types.SimpleNamespace(
        max_threads_per_block=1024, max_block_dims=(1024, 1024, 64),
        max_grid_dims=(2**31 - 1, 65535, 65535), shared_memory_per_block_optin=227 * 1024)]
    kernel = CudaKernel(name="k", device_id=0, function=None, arg_format="P", source="",
                        options=(), arch="sm_90")
    for rows in range(1, 20_001):
        dims = launcher._validate(kernel, 0, (rows,), (256, 1, 1), 0)
        assert dims == ((rows, 1, 1), (256, 1, 1))
        assert len(kernel.validated) <= 1024
        assert kernel.validated[((rows,), (256, 1, 1), 0)] == dims
