"""Kernel signature parsing, argument formats and compile-error formatting (no GPU needed)."""
import os
import shutil
import subprocess

import pytest

from cuda_backend import CudaBackendError, InvalidArgumentError, KernelCompilationError
from cuda_backend.compiler import arg_format, declared_kernels, kernel_signature
from cuda_backend.errors import number_source_lines


def fmt(source: str, name: str = "k") -> str:
    params = kernel_signature(source, name)
    assert params is not None, f"kernel {name} not found"
    return arg_format(source, name, params)


def one(param: str, prelude: str = "") -> str:
    return fmt(f'{prelude}\nextern "C" __global__ void k({param}) {{}}\n')


# -- kernel_signature ------------------------------------------------------------------------

def test_signature_basic_and_multiline():
    src = '''
extern "C" __global__
void
axpy(
    const float* __restrict__ x,
    float* y,
    float alpha,
    long long n)
{ }
'''
    assert kernel_signature(src, "axpy") == [
        "const float* __restrict__ x", "float* y", "float alpha", "long long n"]


def test_signature_empty_and_void_params():
    assert kernel_signature('__global__ void e() {}', "e") == []
    assert kernel_signature('__global__ void e(void) {}', "e") == []
    assert fmt('__global__ void e() {}', "e") == ""


def test_signature_absent_names():
    src = '__global__ void kk(int n) {}\n__device__ void dev(int n) {}\nvoid host_fn(int n) {}'
    assert kernel_signature(src, "k") is None          # no prefix match
    assert kernel_signature(src, "dev") is None        # not __global__
    assert kernel_signature(src, "host_fn") is None
    assert kernel_signature(src, "kk") == ["int n"]


@pytest.mark.parametrize("decl", [
    '__global__ void __launch_bounds__(256) k(float* out, int n)',
    '__global__ void __launch_bounds__(256, 2) k(float* out, int n)',
    '__global__ void __launch_bounds__(TILE * TILE) k(float* out, int n)',
    '__global__ __launch_bounds__(128) void k(float* out, int n)',
    '__global__ __launch_bounds__(1024, 1) void k(float* out, int n)',
    'extern "C" __global__ void __launch_bounds__(256)\nk(float* out, int n)',
    'extern "C"   __global__   void   k ( float* out , int n )',
])
def test_launch_bounds_forms(decl):
    src = decl + " {}\n"
    assert kernel_signature(src, "k") == ["float* out", "int n"]
    assert declared_kernels(src) == ["k"]
    assert fmt(src) == "Pi"


def test_comments_are_ignored():
    src = '''
// __global__ void commented_out(int x) {}
/* __global__ void block_commented(double y) {}
   spanning lines */
extern "C" __global__ void k(float* a, /* int skipped, */ int n  // trailing, comment
                             , double d /* , char c */)
{ }
'''
    assert declared_kernels(src) == ["k"]
    assert kernel_signature(src, "commented_out") is None
    assert kernel_signature(src, "block_commented") is None
    assert kernel_signature(src, "k") == ["float* a", "int n", "double d"]
    assert fmt(src) == "Pid"


def test_declared_kernels_in_order():
    src = '''
template <typename T> __global__ void tmpl(T* x) {}
extern "C" __global__ void first(int n) {}
__device__ float helper(float x) { return x; }
extern "C" __global__ void __launch_bounds__(64) second(float* p) {}
__global__ __launch_bounds__(32, 4) void third() {}
'''
    assert declared_kernels(src) == ["tmpl", "first", "second", "third"]
    assert declared_kernels("int main() { return 0; }") == []


# -- arg_format ------------------------------------------------------------------------------

@pytest.mark.parametrize("param, code", [
    ("float* p", "P"), ("const float* __restrict__ p", "P"), ("double *p", "P"),
    ("int** pp", "P"), ("__half* h", "P"), ("void* raw", "P"), ("const __nv_bfloat16 *b", "P"),
    ("int n", "i"), ("const int n", "i"), ("signed n", "i"), ("int32_t n", "i"),
    ("unsigned n", "I"), ("unsigned int n", "I"), ("uint32_t n", "I"),
    ("long long n", "q"), ("long long int n", "q"), ("int64_t n", "q"), ("ptrdiff_t n", "q"),
    ("unsigned long long n", "Q"), ("uint64_t n", "Q"), ("size_t n", "Q"),
    ("const size_t n", "Q"), ("volatile size_t n", "Q"),
    ("float x", "f"), ("const float x", "f"), ("double x", "d"),
    ("__half h", "H"), ("half h", "H"), ("__nv_bfloat16 b", "H"),
    ("short s", "h"), ("unsigned short s", "H"), ("char c", "b"), ("unsigned char c", "B"),
    ("uint8_t c", "B"), ("bool flag", "?"),
])
def test_arg_format_scalars_and_pointers(param, code):
    assert one(param) == code


def test_arg_format_whole_signature():
    src = '''
extern "C" __global__ void k(const float* a, float* b, int n, unsigned m, long long q,
                             size_t s, float f, double d, __half h) {}
'''
    assert fmt(src) == "PPiIqQfdH"


@pytest.mark.parametrize("prelude, param, code", [
    ("typedef float scalar_t;", "scalar_t x", "f"),
    ("typedef unsigned int  uint_alias ;", "uint_alias x", "I"),
    ("typedef long long index_t;", "const index_t n", "q"),
    ("using index_t = size_t;", "index_t n", "Q"),
    ("using acc_t = double;", "acc_t a", "d"),
    ("typedef float scalar_t;\ntypedef scalar_t real_t;", "real_t x", "f"),   # chained
    ("using A = __half; using B = A;", "B x", "H"),
    ("typedef float scalar_t;", "scalar_t* p", "P"),
])
def test_arg_format_aliases(prelude, param, code):
    assert one(param, prelude) == code


@pytest.mark.parametrize("prelude, param", [
    ("struct Params { int a; float b; };", "Params p"),
    ("struct Params { int a; float b; };", "struct Params p"),
    ("", "float2 v"),
    ("", "int4 v"),
    ("typedef struct { int a; } S;", "S s"),
])
def test_by_value_struct_raises(prelude, param):
    src = f'{prelude}\nextern "C" __global__ void k(float* out, {param}) {{}}\n'
    with pytest.raises(InvalidArgumentError) as info:
        fmt(src)
    msg = str(info.value)
    assert "kernel 'k'" in msg and param in msg and "arg_types" in msg
    assert isinstance(info.value, ValueError)


def test_pointer_typedef_is_a_pointer():
    assert one("fptr p", "typedef float* fptr;") == "P"


def test_array_parameter_is_a_pointer():
    assert one("float x[]") == "P"


def test_unnamed_multiword_parameter():
    assert fmt('extern "C" __global__ void k(float*, unsigned char) {}') == "PB"


def test_commented_out_typedef_is_ignored():
    assert one("real_t x", "typedef float real_t; // typedef double real_t;") == "f"


def test_launch_bounds_with_nested_parentheses():
    src = 'extern "C" __global__ void __launch_bounds__((TILE) * (TILE)) k(int n) {}'
    assert declared_kernels(src) == ["k"]
    assert kernel_signature(src, "k") == ["int n"]


# -- KernelCompilationError ------------------------------------------------------------------

SOURCE = """extern "C" __global__ void broken(float* out)
{
    out[0] = undefined_thing;
    int unused = 0
}
"""


def test_compilation_error_format():
    log = ('kernel.cu(3): error: identifier "undefined_thing" is undefined\n'
           'kernel.cu(5): error: expected a ";"\n\n'
           '2 errors detected in the compilation of "kernel.cu".\n')
    err = KernelCompilationError("broken", log, SOURCE, ["nvcc", "--cubin", "-arch", "sm_90"])
    msg = str(err)
    assert msg.startswith("Failed to compile CUDA kernel 'broken'")
    assert "command: nvcc --cubin -arch sm_90" in msg
    assert log.strip() in msg
    lines = msg.splitlines()
    assert ">>3 |     out[0] = undefined_thing;" in lines
    assert ">>5 | }" in lines
    assert "  1 | extern \"C\" __global__ void broken(float* out)" in lines
    assert "  4 |     int unused = 0" in lines
    assert sum(line.startswith(">>") for line in lines) == 2
    assert err.kernel_name == "broken" and err.log == log and err.source == SOURCE
    assert err.command_line == ["nvcc", "--cubin", "-arch", "sm_90"]
    assert isinstance(err, RuntimeError) and isinstance(err, CudaBackendError)


def test_compilation_error_full_paths_and_no_command():
    source = "\n".join(f"line {i}" for i in range(1, 13))
    log = "/tmp/tmpab12cd/kernel.cu(10): warning #177-D: variable declared but never used\n" \
          "/tmp/tmpab12cd/kernel.cu(12): error: oops"
    msg = str(KernelCompilationError("k12", log, source))
    assert "command: (unknown)" in msg
    assert ">>10 | line 10" in msg.splitlines()
    assert ">>12 | line 12" in msg.splitlines()
    assert "   9 | line 9" in msg.splitlines()      # width 2 numbers, two-space mark
    assert "   1 | line 1" in msg.splitlines()


def test_number_source_lines():
    assert number_source_lines("a\nb\nc", {2}) == "  1 | a\n>>2 | b\n  3 | c"
    assert number_source_lines("") == ""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_real_nvcc_log_marks_the_failing_line(tmp_path):
    path = tmp_path / "kernel.cu"
    path.write_text(SOURCE)
    proc = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", os.devnull, "kernel.cu"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    assert "kernel.cu(3)" in log
    msg = str(KernelCompilationError("broken", log, SOURCE))
    assert ">>3 |     out[0] = undefined_thing;" in msg.splitlines()
    assert "undefined_thing" in msg.split("--- source")[0]
