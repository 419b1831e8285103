"""Every public template renders with every parameter set the package uses, and compiles."""
import concurrent.futures
import os
import shutil
import subprocess

import jinja2
import pytest

from cuda_backend import (CudaDataType, CudaDeviceInfo, DTypeMismatchError,
                          InvalidArgumentError, KernelGenerator)
from cuda_backend.compiler import arg_format, declared_kernels, kernel_signature
from cuda_backend.kernels import TEMPLATE_ARCH, template_variants

GEN = KernelGenerator(backend=object())  # rendering never touches the backend
TEMPLATES = GEN.list_templates()
VARIANTS = template_variants()
CASES = [(t, i, params) for t in TEMPLATES for i, params in enumerate(VARIANTS.get(t, []))]
CASE_IDS = [f"{t}-{i}" for t, i, _ in CASES]


def test_public_templates_are_listed_and_have_variants():
    assert TEMPLATES, "no templates found"
    assert not any(t.startswith("_") for t in TEMPLATES)
    assert {"empty.cu.j2", "fill.cu.j2", "matmul.cu.j2"} <= set(TEMPLATES)
    # every public template is exercised by at least one parameter set, and vice versa
    assert set(VARIANTS) == set(TEMPLATES)
    for t in TEMPLATES:
        assert VARIANTS[t], t


@pytest.mark.parametrize("template", TEMPLATES + ["_common.cuh.j2"])
def test_template_starts_with_params_comment(template):
    source, _, _ = GEN.env.loader.get_source(GEN.env, template)
    assert source.startswith("{#-"), template
    comment = source[:source.index("#}")]
    assert "Params:" in comment
    if not template.startswith("_"):
        assert "kernel_name" in comment
    # every key of every parameter set is documented in that comment
    for params in VARIANTS.get(template, []):
        for key in params:
            assert key in comment, (template, key)


# Templates whose kernels take CUtensorMap parameters, which the compiler cannot format: the
# package compiles them with these arg_types (ops/matmul_kernels.py TMA16_ARG_TYPES) and
# packs their launches at the offsets the driver reports (tensor_maps.param_layout).
EXPLICIT_ARG_TYPES = {"matmul_tma16.cu.j2": "128s128sPiii",
                      "flash_attention_tma.cu.j2": "128s128s128sPPiifi"}   # attention_tma.ARG_TYPES


@pytest.mark.parametrize("template, index, params", CASES, ids=CASE_IDS)
def test_renders_and_declares_the_kernel(template, index, params):
    name, source = GEN.render_kernel(template, **dict(params))
    assert name.isidentifier()
    assert "Undefined" not in source and "{{" not in source and "{%" not in source
    assert declared_kernels(source) == [name]
    assert 'extern "C" __global__' in source
    sig = kernel_signature(source, name)
    assert sig, sig
    if template in EXPLICIT_ARG_TYPES:
        # tensor maps first (128 bytes each in PyCUDA's prepare() spelling), then scalars
        maps = [p for p in sig if "CUtensorMap" in p]
        assert sig[:len(maps)] == maps and maps
        assert EXPLICIT_ARG_TYPES[template] == \
            "128s" * len(maps) + arg_format(source, name, sig[len(maps):])
    else:
        fmt = arg_format(source, name, sig)  # every parameter has a launchable format
        assert len(fmt) == len(sig)
    if "ctype" in params:
        assert params["ctype"] in source
    # an explicit kernel_name is used as given
    src2 = GEN.render(template, kernel_name="my_kernel_x", **params)
    assert declared_kernels(src2) == ["my_kernel_x"]


# Parameters a template documents as optional (with a default): leaving one out is legal.
OPTIONAL = {"matmul_mma.cu.j2": {"x3", "tf32_trunc_a"}, "transpose.cu.j2": {"round_tf32"},
            "conv2d_simt.cu.j2": {"kcrs"}, "conv2d_dgrad.cu.j2": {"kcrs"}}


@pytest.mark.parametrize("template, index, params", CASES, ids=CASE_IDS)
def test_missing_param_raises_undefined_error(template, index, params):
    full = dict(params, kernel_name="k")
    for key in full:
        if key in OPTIONAL.get(template, ()):
            continue
        partial = {k: v for k, v in full.items() if k != key}
        with pytest.raises(jinja2.UndefinedError):
            GEN.render(template, **partial)


def test_unknown_template_is_a_typed_error():
    with pytest.raises(InvalidArgumentError, match="unknown template 'nope.cu.j2'"):
        GEN.render("nope.cu.j2")


def test_kernel_names_are_unique_per_param_set():
    names = {}
    for template, _, params in CASES:
        name, _ = GEN.render_kernel(template, **dict(params))
        assert name not in names, (name, params, names.get(name))
        names[name] = (template, params)
        # deterministic: the same params give the same name
        assert GEN.render_kernel(template, **dict(params))[0] == name
    assert len(names) == len(CASES)


def test_render_kernel_does_not_mutate_params():
    params = dict(VARIANTS["fill.cu.j2"][0], kernel_name="explicit_name")
    name, _ = GEN.render_kernel("fill.cu.j2", **params)
    assert name == "explicit_name"
    assert params["kernel_name"] == "explicit_name"


# -- nvcc ------------------------------------------------------------------------------------

def _compile(workdir: str, template: str, index: int, params: dict):
    name, source = GEN.render_kernel(template, **dict(params))
    base = os.path.join(workdir, f"{template.split('.')[0]}_{index}")
    with open(base + ".cu", "w") as f:
        f.write(source)
    arch = TEMPLATE_ARCH.get(template, "sm_90")
    # an "a" target (wgmma) through -gencode: `-arch=sm_90a` also runs a plain sm_90 pass
    target = [f"-gencode=arch=compute_{arch[3:]},code={arch}"] if arch.endswith("a") else \
        [f"-arch={arch}"]
    proc = subprocess.run(["nvcc", *target, "-cubin", "-o", base + ".cubin", base + ".cu"],
                          capture_output=True, text=True, timeout=300)
    cubin = b""
    if proc.returncode == 0:
        with open(base + ".cubin", "rb") as f:
            cubin = f.read()
    return name, proc, cubin


# The compile check, one test per template and chunk so `pytest -n auto` (pytest-xdist) can
# spread it: each template's first variant in the default run (seconds), the other variants
# in chunks of COMPILE_CHUNK marked `slow` (minutes on two cores; --runslow).
COMPILE_CHUNK = 16


def _compile_chunks():
    out = []
    for t in TEMPLATES:
        variants = list(enumerate(VARIANTS.get(t, [])))
        out.append(pytest.param(t, variants[:1], id=f"{t}-0"))
        for s in range(1, len(variants), COMPILE_CHUNK):
            chunk = variants[s:s + COMPILE_CHUNK]
            out.append(pytest.param(t, chunk, id=f"{t}-{chunk[0][0]}-{chunk[-1][0]}",
                                    marks=pytest.mark.slow))
    return out


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("template, variants", _compile_chunks())
def test_variants_compile_cleanly_with_nvcc(template, variants, tmp_path):
    # one nvcc at a time under xdist (its workers already fill the cores), else a few threads
    workers = 1 if os.environ.get("PYTEST_XDIST_WORKER") else min(4, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda iv: _compile(str(tmp_path), template, *iv), variants))
    failures = []
    for (index, params), (name, proc, cubin) in zip(variants, results):
        if proc.returncode != 0 or proc.stdout.strip() or proc.stderr.strip():
            failures.append(f"{template} #{index} {params} (rc={proc.returncode}):\n"
                            f"{proc.stdout}{proc.stderr}")
            continue
        # extern "C": the symbol is the plain name, not a C++-mangled one
        assert name.encode() in cubin, (template, index)
        assert f"_Z{len(name)}{name}".encode() not in cubin, (template, index)
    assert not failures, "\n\n".join(failures)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_tma16_variants_compile_without_spills(tmp_path):
    """The TMA kernel's listed variants, their float32-output twins (run_config's out) and
    the layout probe compile for sm_90a without a warning, a spill or a stack frame; the
    probe keeps the kernel's parameter list."""
    from cuda_backend.ops import matmul as mm
    sets = list(VARIANTS["matmul_tma16.cu.j2"])
    sets += [dict(p, out_ctype="float") for p in sets]
    sets.append(dict(sets[0], probe=1))
    assert mm.TMA16_ARG_TYPES == EXPLICIT_ARG_TYPES["matmul_tma16.cu.j2"]

    def build(ip):
        i, params = ip
        name, source = GEN.render_kernel("matmul_tma16.cu.j2", **dict(params))
        base = os.path.join(str(tmp_path), f"tma16_{i}")
        with open(base + ".cu", "w") as f:
            f.write(source)
        proc = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-cubin",
                               "-Xptxas", "-v", "-o", base + ".cubin", base + ".cu"],
                              capture_output=True, text=True, timeout=300)
        return name, source, proc
    workers = 1 if os.environ.get("PYTEST_XDIST_WORKER") else min(4, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(build, enumerate(sets)))
    sig0 = kernel_signature(results[0][1], results[0][0])
    for (name, source, proc), params in zip(results, sets):
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "warning" not in log.lower(), (params, log)
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in log, log
        if params.get("probe"):
            assert kernel_signature(source, name) == sig0


def test_compile_chunks_cover_every_variant_once():
    seen = [(p.values[0], i) for p in _compile_chunks() for i, _ in p.values[1]]
    assert sorted(seen) == sorted((t, i) for t, i, _ in CASES)


# -- the documented generator API ---------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", CudaDataType.FLOAT64, "half", "bf16"])
@pytest.mark.parametrize("tile", [8, 16, 32])
@pytest.mark.parametrize("tiled", [True, False])
def test_generate_matrix_multiply_kernel(dtype, tile, tiled):
    src = GEN.generate_matrix_multiply_kernel(dtype, use_tiled=tiled, tile_size=tile)
    assert declared_kernels(src) == ["optimized_matmul"]
    assert f"#define TILE {tile}" in src
    assert CudaDataType.from_any(dtype).c_type in src
    assert ("__shared__" in src) is tiled
    sig = kernel_signature(src, "optimized_matmul")
    assert arg_format(src, "optimized_matmul", sig) == "PPPiii"
    named = GEN.generate_matrix_multiply_kernel(dtype, tile_size=tile, kernel_name="mm2")
    assert declared_kernels(named) == ["mm2"]


@pytest.mark.parametrize("dtype", [CudaDataType.INT32, "int64", "uint8", "bool"])
def test_generate_matrix_multiply_rejects_non_float(dtype):
    with pytest.raises(InvalidArgumentError, match="float32, float64, float16, bfloat16"):
        GEN.generate_matrix_multiply_kernel(dtype)


def test_generate_matrix_multiply_rejects_unknown_dtype():
    with pytest.raises(DTypeMismatchError):
        GEN.generate_matrix_multiply_kernel("complex64")


@pytest.mark.parametrize("tile", [0, 4, 12, 64, -16])
def test_generate_matrix_multiply_rejects_bad_tile(tile):
    with pytest.raises(InvalidArgumentError, match=f"tile_size must be 8, 16 or 32, got {tile}"):
        GEN.generate_matrix_multiply_kernel(tile_size=tile)


class StubBackend:
    """Just what optimize_kernel_parameters reads."""

    def __init__(self, info: CudaDeviceInfo) -> None:
        self.info = info
        self.current_device = info.device_id
        self.asked = []

    def get_device_info(self, device_id):
        self.asked.append(device_id)
        return self.info


H100 = CudaDeviceInfo(device_id=0, name="stub H100", compute_capability=(9, 0),
                      memory_total=80 << 30, multiprocessor_count=132)
SMALL = CudaDeviceInfo(device_id=1, name="stub small", compute_capability=(7, 5),
                       memory_total=4 << 30, multiprocessor_count=4, max_threads_per_block=512,
                       max_threads_per_multiprocessor=1024, max_grid_dims=(100, 65535, 65535))


def _check_sane(info, block, grid):
    assert len(block) == 3 and len(grid) == 3
    assert all(isinstance(x, int) and x >= 1 for x in block + grid)
    assert block[0] * block[1] * block[2] <= info.max_threads_per_block
    assert all(b <= lim for b, lim in zip(block, info.max_block_dims))
    assert all(g <= lim for g, lim in zip(grid, info.max_grid_dims))


@pytest.mark.parametrize("info", [H100, SMALL], ids=["h100", "small"])
@pytest.mark.parametrize("m, n", [(1, 1), (100, 37), (1024, 1024), (4096, 333)])
def test_optimize_matmul_parameters_cover_the_output(info, m, n):
    stub = StubBackend(info)
    block, grid = KernelGenerator(backend=stub).optimize_kernel_parameters("matrix_multiply",
                                                                           (m, n))
    _check_sane(info, block, grid)
    assert block[0] == block[1] and block[2] == 1 and grid[2] == 1
    assert block[0] * grid[0] >= n and block[1] * grid[1] >= m
    # no fully idle row or column of blocks
    assert block[0] * (grid[0] - 1) < n and block[1] * (grid[1] - 1) < m
    assert stub.asked == [info.device_id]


def test_optimize_matmul_tile_depends_on_size_and_device():
    gen = KernelGenerator(backend=StubBackend(H100))
    assert gen.optimize_kernel_parameters("matmul", (1024, 1024)) == ((32, 32, 1), (32, 32, 1))
    assert gen.optimize_kernel_parameters("matmul", (64, 64)) == ((16, 16, 1), (4, 4, 1))
    small = KernelGenerator(backend=StubBackend(SMALL))
    assert small.optimize_kernel_parameters("matmul", (1024, 1024))[0] == (16, 16, 1)


@pytest.mark.parametrize("info", [H100, SMALL], ids=["h100", "small"])
@pytest.mark.parametrize("n", [0, 1, 255, 257, 10_000, 10**8])
def test_optimize_elementwise_parameters(info, n):
    block, grid = KernelGenerator(backend=StubBackend(info)).optimize_kernel_parameters(
        "elementwise_add", n)
    _check_sane(info, block, grid)
    assert block[1] == block[2] == grid[1] == grid[2] == 1
    assert block[0] % info.warp_size == 0
    threads = block[0] * grid[0]
    # either one thread per element, or a grid-stride grid that fills every SM
    assert threads >= n or grid[0] >= min(info.multiprocessor_count, info.max_grid_dims[0])
    # never more blocks than there is work for
    assert grid[0] == 1 or block[0] * (grid[0] - 1) < max(n, 1)


def test_optimize_uses_the_given_device_and_rejects_bad_sizes():
    stub = StubBackend(H100)
    gen = KernelGenerator(backend=stub)
    gen.optimize_kernel_parameters("relu", (10, 10), device_id=0)
    assert stub.asked == [0]
    for bad in [(-1,), (), (4, -2)]:
        with pytest.raises(InvalidArgumentError):
            gen.optimize_kernel_parameters("matmul", bad)
