"""Kernel generator: Jinja2 templates in `templates/` rendered into CUDA C, then compiled.

Templates are found through the package (`cuda_backend/templates`, a link to the top-level
`templates/` in a checkout, real files in an installed wheel), so the same code loads them
in both places. Rendering uses StrictUndefined: a missing parameter is an error, never an
empty string in the source.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
import math
import re
import threading
from typing import Any, Dict, List, Optional, Tuple

import jinja2

from .dtypes import CudaDataType
from .errors import InvalidArgumentError
from .process_wide import ProcessWide

# Every parameter set the package renders, by template: the CI renders and compiles all.
_FLOAT_TYPES = [CudaDataType.FLOAT32, CudaDataType.FLOAT64, CudaDataType.FLOAT16,
                CudaDataType.BFLOAT16]


def accumulator_type(dtype: CudaDataType) -> str:
    """C type sums are kept in: double for float64, float for the rest of the floats."""
    if dtype is CudaDataType.FLOAT64:
        return "double"
    if dtype.is_floating:
        return "float"
    return "long long" if dtype is CudaDataType.INT64 else "int"


def dtype_params(dtype: CudaDataType) -> Dict[str, str]:
    return {"dtype": dtype.name_str, "ctype": dtype.c_type, "acc": accumulator_type(dtype)}


def template_variants() -> Dict[str, List[Dict[str, Any]]]:
    """Template name -> the parameter sets used by the package (without kernel_name)."""
    variants: Dict[str, List[Dict[str, Any]]] = {"empty.cu.j2": [{}]}
    fill = []
    for dt in list(CudaDataType):
        if dt is CudaDataType.BOOL:
            continue
        fill.append({**dtype_params(dt), "block_size": 256})
    variants["fill.cu.j2"] = fill
    mm = []
    for dt in _FLOAT_TYPES:
        for tile in (8, 16, 32):
            mm.append({**dtype_params(dt), "use_tiled": True, "tile_size": tile})
        mm.append({**dtype_params(dt), "use_tiled": False, "tile_size": 16})
    variants["matmul.cu.j2"] = mm
    # Each op family of the registry (registry.FAMILIES) lists the parameter sets it renders.
    from . import registry
    for module in registry.family_modules():
        for template, sets in module.template_variants().items():
            variants.setdefault(template, []).extend(sets)
    return variants


# Templates whose parameter sets are listed here rather than by an op family: the launch-
# overhead kernel, the documented API's matmul generator, and fill (elementwise, matmul and
# attention render it).
KERNEL_TEMPLATES = ("empty.cu.j2", "fill.cu.j2", "matmul.cu.j2")

# A template that needs an architecture-specific target (Hopper's wgmma: sm_90a) says so on
# the first line of its header comment, `{#- arch: sm_90a ...`; the others build for the
# device's own arch.
_ARCH_LINE = re.compile(r"\{#-?\s*arch:\s*(sm_\w+)")


@functools.lru_cache(maxsize=None)
def template_arch(template_name: str) -> Optional[str]:
    """The target a template declares in its header (`{#- arch: sm_90a`), or None."""
    try:
        with (templates_path() / template_name).open("r", encoding="utf-8") as f:
            first = f.readline()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    match = _ARCH_LINE.match(first)
    return match.group(1) if match else None


def __getattr__(name: str) -> Any:
    """TEMPLATE_ARCH: {template: arch} of the templates that declare one (computed)."""
    if name == "TEMPLATE_ARCH":
        names = (t.name for t in templates_path().iterdir()
                 if t.name.endswith(".j2") and not t.name.startswith("_"))
        return {t: a for t in sorted(names) if (a := template_arch(t)) is not None}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def templates_path() -> Any:
    """The folder holding the `*.cu.j2` templates, through the installed package."""
    return importlib.resources.files("cuda_backend") / "templates"


def kernel_name_for(template_name: str, params: Dict[str, Any]) -> str:
    """A C identifier unique to (template, params), e.g. 'matmul_float32_3fa1c2d4'."""
    base = template_name.split(".")[0]
    tag = params.get("dtype", "")
    digest = hashlib.sha1(json.dumps(params, sort_keys=True, default=str)
                          .encode()).hexdigest()[:8]
    return "_".join(x for x in (base, str(tag), digest) if x)


class TemplateParameterError(InvalidArgumentError, jinja2.UndefinedError):
    """A template was rendered without a parameter it uses."""


class KernelGenerator:
    """Renders templates and memoizes compiled kernels per device and parameters."""

    def __init__(self, backend: Any = None) -> None:
        self._backend = backend
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(templates_path())),
            undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
            trim_blocks=False, lstrip_blocks=False, autoescape=False)
        self._compiled: Dict[tuple, Any] = {}
        self._lock = threading.Lock()

    @property
    def backend(self) -> Any:
        if self._backend is None:
            from .backend import get_cuda_backend
            self._backend = get_cuda_backend()
        return self._backend

    def list_templates(self) -> List[str]:
        """Public templates (partials start with '_')."""
        return sorted(t for t in self.env.list_templates(extensions=["j2"])
                      if not t.startswith("_"))

    def render(self, template_name: str, **params: Any) -> str:
        """Render a template; missing parameters raise jinja2.UndefinedError."""
        try:
            template = self.env.get_template(template_name)
        except jinja2.TemplateNotFound:
            raise InvalidArgumentError(
                f"unknown template '{template_name}' (templates: "
                f"{', '.join(self.list_templates())})") from None
        try:
            return template.render(**params)
        except jinja2.UndefinedError as exc:
            raise TemplateParameterError(
                f"template '{template_name}' needs a parameter that was not given: "
                f"{exc.message} (given: {', '.join(sorted(params)) or 'none'})") from None

    def render_kernel(self, template_name: str, **params: Any) -> Tuple[str, str]:
        """(kernel_name, source) with a kernel name derived from the parameters."""
        name = params.pop("kernel_name", None) or kernel_name_for(template_name, params)
        return name, self.render(template_name, kernel_name=name, **params)

    def get_kernel(self, template_name: str, device_id: Optional[int] = None,
                   options: Tuple[str, ...] = (), **params: Any) -> Any:
        """Render + compile once per (device, template, params); returns a CudaKernel."""
        backend = self.backend
        if device_id is None:
            device_id = backend.current_device
        key = (device_id, template_name, tuple(options),
               json.dumps(params, sort_keys=True, default=str))
        kernel = self._compiled.get(key)
        if kernel is None:
            name, source = self.render_kernel(template_name, **params)
            kernel = backend.compile_kernel(name, source, options=list(options),
                                            device_id=device_id,
                                            arch=template_arch(template_name))
            with self._lock:
                self._compiled[key] = kernel
        return kernel

    # -- the documented API (../shared/seeds/001_097e3d6e2f3c2394.txt) -------------
    def generate_matrix_multiply_kernel(self, dtype: Any = CudaDataType.FLOAT32,
                                        use_tiled: bool = True, tile_size: int = 32,
                                        kernel_name: str = "optimized_matmul") -> str:
        """CUDA source of a matmul kernel named kernel_name (args: A, B, C, M, N, K)."""
        dtype = CudaDataType.from_any(dtype)
        if dtype not in _FLOAT_TYPES:
            raise InvalidArgumentError(
                f"matrix multiply supports float32, float64, float16, bfloat16; got "
                f"{dtype.name_str}")
        if tile_size not in (8, 16, 32):
            raise InvalidArgumentError(f"tile_size must be 8, 16 or 32, got {tile_size}")
        return self.render("matmul.cu.j2", kernel_name=kernel_name, use_tiled=bool(use_tiled),
                           tile_size=int(tile_size), **dtype_params(dtype))

    def optimize_kernel_parameters(self, op_name: str, problem_size: Any,
                                   device_id: Optional[int] = None
                                   ) -> Tuple[Tuple[int, int, int], Tuple[int, int, int]]:
        """(block, grid) for an operation from the device's limits and a simple occupancy
        model: 2-D tiles for matrix ops, enough blocks to fill every SM for 1-D ops."""
        info = self._device_info(device_id)
        if isinstance(problem_size, int):
            problem_size = (problem_size,)
        dims = tuple(int(x) for x in problem_size)
        if any(d < 0 for d in dims) or not dims:
            raise InvalidArgumentError(f"problem_size must be non-negative ints, got {problem_size}")
        if op_name in ("matrix_multiply", "matmul", "matrix_transpose", "transpose", "conv2d"):
            m = dims[0]
            n = dims[1] if len(dims) > 1 else dims[0]
            tile = 32 if info.max_threads_per_block >= 1024 else 16
            if m * n < 128 * 128:
                tile = 16
            block = (tile, tile, 1)
            grid = (max(1, math.ceil(n / tile)), max(1, math.ceil(m / tile)), 1)
            return block, grid
        n = 1
        for d in dims:
            n *= d
        threads = min(256, info.max_threads_per_block)
        blocks_per_sm = max(1, info.max_threads_per_multiprocessor // threads)
        full = max(1, math.ceil(n / threads))
        grid_x = min(full, info.multiprocessor_count * blocks_per_sm * 4, info.max_grid_dims[0])
        return (threads, 1, 1), (max(1, grid_x), 1, 1)

    def _device_info(self, device_id: Optional[int]) -> Any:
        backend = self.backend
        return backend.get_device_info(backend.current_device if device_id is None else device_id)


_generator = ProcessWide(KernelGenerator)


def get_kernel_generator() -> KernelGenerator:
    """The process-wide kernel generator."""
    return _generator.get()
