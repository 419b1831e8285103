"""Compiles CUDA C with PyCUDA's `compile` (nvcc to a cubin), loads it with
`module_from_buffer`, and caches the result.

Two caches: in memory per (device, source hash, options, arch), so a repeat compile in the
process never reaches nvcc; on disk, our own: `<sha256>.cubin` files keyed by the source,
options, arch/code, nvcc's version and PyCUDA's, in `CUDA_BACKEND_CACHE_DIR`, else
`${XDG_CACHE_HOME:-~/.cache}/cuda_backend/kernels` (PyCUDA's own cache is not used). A cubin
found there is loaded and run as is, so the folder is used only when this user owns it and
nobody else can write to it (`check_cache_dir`), and each file only when the same holds for
it (`check_cache_file`); otherwise kernels are compiled without it, with a warning. Entries
are written to a temporary file in the folder and renamed into place (`os.replace`), so a
reader sees a whole cubin or none; one that fails to load anyway is recompiled and
rewritten. Headers are not hashed: only those of the toolkit (covered by nvcc's version)
are expected. Kernels must be declared `extern "C"`: sources are compiled with
`no_extern_c=True` so they may include C++ headers.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import re
import stat
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .errors import InvalidArgumentError, KernelCompilationError, KernelNotFoundError

# C parameter type -> struct format char used by PyCUDA's prepared calls.
_SCALAR_FORMATS = {
    "int": "i", "signed": "i", "signed int": "i", "int32_t": "i",
    "unsigned": "I", "unsigned int": "I", "uint32_t": "I",
    "long long": "q", "long long int": "q", "int64_t": "q", "long": "q", "ptrdiff_t": "q",
    "unsigned long long": "Q", "unsigned long long int": "Q", "uint64_t": "Q",
    "size_t": "Q", "unsigned long": "Q",
    "short": "h", "int16_t": "h", "unsigned short": "H", "uint16_t": "H",
    "__half": "H", "half": "H", "__nv_bfloat16": "H",
    "char": "b", "signed char": "b", "int8_t": "b",
    "unsigned char": "B", "uint8_t": "B", "bool": "?",
    "float": "f", "double": "d",
}
# launch attributes between __global__ and the name: __launch_bounds__(...), __cluster_dims__(...)
_LAUNCH_BOUNDS = r"(?:(?:__launch_bounds__|__cluster_dims__)\s*\((?:[^()]|\([^()]*\))*\)\s*)*"
_QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict",
               "__grid_constant__", "struct"}


def check_cache_dir(path: str) -> Optional[str]:
    """Why the folder `path` must not be trusted with cached code or settings, or None when it
    can be: this user owns it and neither group nor others may write to it. A missing folder
    is created with mode 0700."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as exc:
        return f"it cannot be created or read ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    return _not_private(st)


def check_cache_file(path: str) -> Optional[str]:
    """check_cache_dir for a file in a trusted folder: None when it does not exist."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"it cannot be read ({exc.strerror or exc})"
    return _not_private(st)


def _not_private(st: os.stat_result) -> Optional[str]:
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"other users can write to it (mode {stat.S_IMODE(st.st_mode):#o}); "
                f"make it private with chmod go-w")
    return None


_warned_paths: set = set()


def warn_untrusted(path: str, reason: str, what: str) -> None:
    """Warn, once per process per path, that `what` does not use `path`, and why."""
    if path in _warned_paths:
        return
    _warned_paths.add(path)
    warnings.warn(f"cuda_backend: not using {path!r} for {what}: {reason}", RuntimeWarning,
                  stacklevel=3)


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def kernel_signature(source: str, kernel_name: str) -> Optional[List[str]]:
    """The C parameter list of `kernel_name` in source, or None if it is not declared there."""
    pattern = re.compile(
        r"__global__\s+" + _LAUNCH_BOUNDS + r"void\s+" + _LAUNCH_BOUNDS
        + re.escape(kernel_name) + r"\s*\(([^)]*)\)", re.S)
    m = pattern.search(_strip_comments(source))
    if m is None:
        return None
    params = [p.strip() for p in m.group(1).split(",")]
    return [p for p in params if p and p != "void"]


def declared_kernels(source: str) -> List[str]:
    return re.findall(r"__global__\s+" + _LAUNCH_BOUNDS + r"void\s+" + _LAUNCH_BOUNDS
                      + r"(\w+)\s*\(", _strip_comments(source))


def _strip_comments(source: str) -> str:
    source = re.sub(r"/\*.*?\*/", " ", source, flags=re.S)
    return re.sub(r"//[^\n]*", "", source)


def _aliases(source: str) -> Dict[str, str]:
    """typedef/using aliases of scalar types, so `T` resolves to `float`."""
    out = {}
    source = _strip_comments(source)
    for m in re.finditer(r"typedef\s+([\w\s*]+?)\s*(\w+)\s*;", source):
        out[m.group(2)] = " ".join(m.group(1).replace("*", " * ").split())
    for m in re.finditer(r"using\s+(\w+)\s*=\s*([\w\s*]+?)\s*;", source):
        out[m.group(1)] = " ".join(m.group(2).replace("*", " * ").split())
    return out


def arg_format(source: str, kernel_name: str, params: Sequence[str]) -> str:
    """Struct format for the parameters: 'P' for pointers, the scalar's code otherwise."""
    aliases = _aliases(source)
    fmt = []
    for p in params:
        if "*" in p or "[" in p:
            fmt.append("P")
            continue
        words = [w for w in p.replace("&", " ").split() if w not in _QUALIFIERS]
        whole = " ".join(words)
        if whole in _SCALAR_FORMATS or whole in aliases:
            ctype = whole  # an unnamed parameter
        else:
            ctype = " ".join(words[:-1]) if len(words) > 1 else (words[0] if words else "")
        for _ in range(4):
            ctype = aliases.get(ctype, ctype)
        if "*" in ctype:
            fmt.append("P")
            continue
        code = _SCALAR_FORMATS.get(ctype)
        if code is None:
            raise InvalidArgumentError(
                f"kernel '{kernel_name}': cannot pass parameter '{p}' by value "
                f"(type '{ctype}' is not a supported scalar); pass arg_types= to "
                f"compile_kernel, e.g. 'PPi'")
        fmt.append(code)
    return "".join(fmt)


@dataclass
class CudaKernel:
    """A compiled kernel: the PyCUDA function, prepared, and what launches need to check."""

    name: str
    device_id: int
    function: Any
    arg_format: str
    source: str
    options: Tuple[str, ...]
    arch: str
    module: Any = field(repr=False, default=None)
    max_threads_per_block: int = 1024
    num_regs: int = 0
    static_shared_bytes: int = 0
    local_bytes: int = 0
    max_dynamic_shared_bytes: int = 48 * 1024
    validated: Dict[tuple, Tuple[Tuple[int, int, int], Tuple[int, int, int]]] = field(
        default_factory=dict, repr=False)

    @property
    def nargs(self) -> int:
        return len(self.arg_format)


class KernelCompiler:
    """compile_kernel + the kernel registry by name, per device."""

    def __init__(self, drv: Any, contexts: Any, devices: Sequence[Any]) -> None:
        self._drv = drv
        self._contexts = contexts
        self._devices = devices
        self._lock = threading.RLock()
        self._cache: Dict[tuple, CudaKernel] = {}
        self._modules: Dict[tuple, Any] = {}
        self._by_name: Dict[Tuple[int, str], CudaKernel] = {}
        self._recipes: Dict[str, tuple] = {}  # name -> (source, options, arch, arg_types)
        self.compile_count = 0   # modules built by nvcc
        self.cache_hits = 0      # compiles answered from memory
        self.disk_hits = 0       # modules loaded from the disk cache (nvcc not run)

    @staticmethod
    def default_cache_dir() -> str:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                ".cache")
        return os.path.join(base, "cuda_backend", "kernels")

    @classmethod
    def cache_dir(cls) -> Optional[str]:
        """The disk cache's folder: CUDA_BACKEND_CACHE_DIR, else the per-user default, when
        it passes `check_cache_dir`; None (no disk cache, with one warning) when not."""
        path = os.environ.get("CUDA_BACKEND_CACHE_DIR") or cls.default_cache_dir()
        reason = check_cache_dir(path)
        if reason is not None:
            warn_untrusted(path, reason, "the compiled-kernel cache (compiling without it)")
            return None
        return path

    @staticmethod
    def cache_key(source: str, options: Sequence[str], arch: str, code: Optional[str],
                  nvcc_version: str, pycuda_version: str) -> str:
        h = hashlib.sha256()
        for part in (source, "\0".join(options), arch, code or "", nvcc_version,
                     pycuda_version):
            data = part.encode("utf-8")
            h.update(len(data).to_bytes(8, "little") + data)   # unambiguous boundaries
        return h.hexdigest()

    def _cache_path(self, pycuda_compiler: Any, source: str, options: Tuple[str, ...],
                    arch: str, code: Optional[str]) -> Optional[str]:
        """Where this module's cubin lives in the disk cache, or None without one."""
        if getattr(self._drv, "CUDA_DEBUGGING", False):
            return None          # PyCUDA adds -g -G and keeps its files: not cached
        try:
            nvcc_version = pycuda_compiler.get_nvcc_version("nvcc")
            pycuda_version = importlib.import_module("pycuda").VERSION_TEXT
        except Exception:        # no nvcc: compiling will say so
            return None
        folder = self.cache_dir()
        if folder is None:
            return None
        key = self.cache_key(source, options, arch, code, nvcc_version, pycuda_version)
        return os.path.join(folder, key + ".cubin")

    @staticmethod
    def _read_cached(path: str) -> Optional[bytes]:
        """The cubin at path, or None when there is none or it may not be trusted (then
        with one warning)."""
        reason = check_cache_file(path)
        if reason is not None:
            warn_untrusted(path, reason, "the compiled-kernel cache (recompiling)")
            return None
        try:
            with open(path, "rb") as f:
                return f.read() or None
        except OSError:
            return None

    @staticmethod
    def _write_cached(path: str, cubin: bytes) -> None:
        """Write cubin to a temporary file (mode 0600) in path's folder and rename it to
        path: a reader sees the old file or the whole new one. Failures are not fatal."""
        folder, name = os.path.split(path)
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + name + ".", suffix=".tmp")
        except OSError:
            return
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(cubin)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def default_arch(self, device_id: int) -> str:
        return self._devices[device_id].arch

    def compile(self, kernel_name: str, source: str, options: Optional[Sequence[str]] = None,
                device_id: int = 0, arch: Optional[str] = None,
                arg_types: Optional[str] = None) -> CudaKernel:
        """Compile (or fetch from cache) `kernel_name` from source for one device."""
        options = tuple(options or ())
        arch = arch or self.default_arch(device_id)
        key = (device_id, source_hash(source), options, arch, kernel_name)
        with self._lock:
            kernel = self._cache.get(key)
            if kernel is not None:
                self.cache_hits += 1
                self._by_name[(device_id, kernel_name)] = kernel
                return kernel
        params = kernel_signature(source, kernel_name)
        if params is None:
            found = ", ".join(declared_kernels(source)) or "none"
            raise KernelNotFoundError(
                f"kernel '{kernel_name}' is not declared as a __global__ function in its "
                f"source (kernels declared there: {found})")
        fmt = arg_types if arg_types is not None else arg_format(source, kernel_name, params)
        module_key = key[:4]
        module = self._modules.get(module_key)
        if module is None:
            module = self._build(kernel_name, source, options, device_id, arch)
            with self._lock:
                self._modules[module_key] = module
        else:
            self.cache_hits += 1
        with self._contexts.activate(device_id):
            try:
                func = module.get_function(kernel_name)
            except self._drv.LogicError as exc:
                raise KernelNotFoundError(
                    f"kernel '{kernel_name}' is not exported by the compiled module ({exc}); "
                    f"declare it extern \"C\" so its name is not mangled") from None
            func.prepare(fmt)
            A = self._drv.function_attribute
            kernel = CudaKernel(
                name=kernel_name, device_id=device_id, function=func, arg_format=fmt,
                source=source, options=options, arch=arch, module=module,
                max_threads_per_block=func.get_attribute(A.MAX_THREADS_PER_BLOCK),
                num_regs=func.get_attribute(A.NUM_REGS),
                static_shared_bytes=func.get_attribute(A.SHARED_SIZE_BYTES),
                local_bytes=func.get_attribute(A.LOCAL_SIZE_BYTES),
                max_dynamic_shared_bytes=func.get_attribute(A.MAX_DYNAMIC_SHARED_SIZE_BYTES))
        with self._lock:
            self._cache[key] = kernel
            self._by_name[(device_id, kernel_name)] = kernel
            self._recipes[kernel_name] = (source, options, arch if arch != self.default_arch(
                device_id) else None, arg_types)
        return kernel

    def _build(self, kernel_name: str, source: str, options: Tuple[str, ...], device_id: int,
               arch: str) -> Any:
        pycuda_compiler = importlib.import_module("pycuda.compiler")
        code = None
        nvcc_arch = arch
        if arch.endswith("a") and arch.startswith("sm_"):
            # `-arch sm_90a` alone also runs a plain sm_90 pass that rejects wgmma.
            nvcc_arch, code = "compute_" + arch[3:], arch
        path = self._cache_path(pycuda_compiler, source, options, nvcc_arch, code)
        load_errors = (self._drv.LogicError, getattr(self._drv, "Error", self._drv.LogicError))
        with self._contexts.activate(device_id):
            cubin = self._read_cached(path) if path else None
            if cubin is not None:
                try:
                    module = self._drv.module_from_buffer(cubin)
                except load_errors:
                    pass         # a corrupt entry: compiled again and rewritten below
                else:
                    self.disk_hits += 1
                    return module
            try:
                cubin = pycuda_compiler.compile(source, options=list(options), arch=nvcc_arch,
                                                code=code, no_extern_c=True, cache_dir=False)
            except self._drv.CompileError as exc:
                log = "\n".join(x for x in (getattr(exc, "stdout", ""), getattr(exc, "stderr", ""))
                                if x) or str(exc)
                raise KernelCompilationError(kernel_name, log, source,
                                             getattr(exc, "command_line", None)) from None
            module = self._drv.module_from_buffer(cubin)
        self.compile_count += 1
        if path:
            self._write_cached(path, cubin)
        return module

    def get(self, kernel_name: str, device_id: int) -> CudaKernel:
        """The kernel compiled under this name for this device; compiled on demand from the
        recipe if it was compiled for another device first."""
        kernel = self._by_name.get((device_id, kernel_name))
        if kernel is not None:
            return kernel
        recipe = self._recipes.get(kernel_name)
        if recipe is None:
            known = sorted({name for _, name in self._by_name})
            raise KernelNotFoundError(
                f"unknown kernel '{kernel_name}': compile it with compile_kernel first "
                f"(compiled kernels: {', '.join(known) or 'none'})")
        source, options, arch, arg_types = recipe
        return self.compile(kernel_name, source, options, device_id, arch, arg_types)

    def names(self) -> List[str]:
        return sorted({name for _, name in self._by_name})

    def clear(self) -> None:
        """Drop every module (their memory is released when the last reference goes)."""
        with self._lock:
            self._cache.clear()
            self._modules.clear()
            self._by_name.clear()
