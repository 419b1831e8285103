"""Standalone check and timing of templates/matmul_tma16.cu.j2 (float16 / bfloat16 GEMM on
Hopper: TMA-fed shared-memory ring, one producer and two consumer warpgroups on wgmma,
persistent grid) against torch.matmul. Needs an sm_90 GPU, PyCUDA, torch, jinja2, numpy and
nvcc; the tensor maps are encoded with NVIDIA's cuda-bindings (`cuda.bindings.driver`) when
installed, else through ctypes on the driver library (libcuda.so.1) itself, and with both
(bytes compared) when both work. Does not import cuda_backend.

For each dtype and tile config it renders the template with jinja2, compiles every variant
in parallel with nvcc (compute_90a / sm_90a, ptxas -v: registers and spills printed), runs
it at 1023x1025x1000 (M, N not multiples of the tile, N odd so B is given with a padded row
stride of 1032, K not a multiple of 64: the tensor maps' zero fill does every edge), 77x200x37
(one k-tile, a partial tile only), 4096^3, 8192^3, 8192x8192x1024 and 16384x1024x4096, checks
it against a float64 reference (torch on the GPU), and times it and torch.matmul (same
inputs, 16-bit out) with CUDA events, L2 flushed before each call, median of --reps.

Error bound (checked element by element). The inputs are the 16-bit values themselves, so the
reference from them in float64 is exact to ~2^-53 and the input rounding is no part of the
error. A product of two bfloat16 (8-bit significands) or float16 (11-bit) values has at most
22 significant bits, so it is exact in float32 and in the tensor core's product. The only
error is then the float32 accumulation of K terms (K - 1 additions, plus one for the bias):
each addition's result |s| <= sum_k |a_ik b_kj| =: S_ij and errs by at most one float32 ulp of
it, 2^-23 |s| (truncating the aligned addends, which Fasi, Higham, Mikaitis and Pranesh,
"Numerical behavior of NVIDIA tensor cores", PeerJ Comput. Sci. 7:e330 (2021), observed on
V100 / T4 / A100 tensor cores, costs at most one ulp, twice round-to-nearest's half ulp; that
Hopper's wgmma does no worse is an assumption this script tests), so

    |C_ij - ref_ij| <= K * 2^-23 * S_ij            (float32 out)
                      + u_out * |ref_ij|           (16-bit out: u_out = 2^-8 bf16, 2^-11 f16)

S = |A| @ |B| is computed in float64 too. A bound of K * 2^-8 * S is far looser: it exceeds
even the error of rounding float32 inputs to bfloat16 before multiplying (each product then
errs by at most about 2 * 2^-8 of its size, so the sum by 2^-7 * S). The ratio err / (K 2^-8 S)
is printed for comparison, as is the normalized error err / (2^-24 S).
A second, gross check: ||C - ref||_F / ||ref||_F below 1e-3 (float32 out) or 2e-2 (16-bit out)
catches layout faults that a per-element bound on large S could let through.

Floor: 2 M N K / 989 TF/s (H100 SXM dense 16-bit peak): 0.139 ms at 4096^3, 8192x8192x1024
and 16384x1024x4096, 1.112 ms at 8192^3. Target: >= 0.9 x torch.matmul at 4096^3 and 8192^3,
>= 0.8 x at 8192x8192x1024 and 16384x1024x4096.

Kernel parameters. The launch goes through PyCUDA's Function._launch_kernel, i.e.
cuLaunchKernel with one CU_LAUNCH_PARAM_BUFFER_POINTER buffer laid out as the kernel's
parameter area. That layout is NOT "natural alignment from offset 0": the area starts at
c[0x0][0x210] on sm_90 and ptxas aligns each parameter's absolute address, so the
alignas(128) CUtensorMap of CUDA 13's cuda.h lands at offset 0x70 (0x30 with CUDA 12's
alignas(64)). The offsets are read from the cubin (EIATTR_KPARAM_INFO records of
.nv.info.<kernel>, plus EIATTR_CBANK_PARAM_SIZE) and, where the driver has it (12.4+),
cross-checked with cuFuncGetParamInfo; the buffer is packed at those offsets to the full size.
(The first version packed at 0 / 128 / 256 ...: the kernel then read M, N, K past the
276-byte buffer, computed no tiles and exited at once; the driver accepted the short buffer.)

Launch errors: the first launch of each config at each size runs on its own stream, polled
with a deadline (--timeout, default 20 s), then Context.synchronize() in a try/except: a
launch error, a fault (sticky: the run stops) or a hang (the run stops) is printed.

--debug: before the normal run, compiles every config with the template's debug=1 (a
mapped pinned-host buffer of progress words as one more kernel parameter) and runs it once at
--debug-size (default 256x256x128) with a 5-second watchdog, printing blocks 0 .. 3's words
(DEBUG_WORDS) and the check; a hang prints the words written so far and stops the run.
--debug-only skips the normal run.

Usage: python perf/tma16_check.py [--dtypes bfloat16 float16]
       [--configs 128:256:4 128:128:5 256:128:4] (bm:bn:stages)
       [--sizes 1023x1025x1000 77x200x37 4096 8192 8192x8192x1024 16384x1024x4096]
       [--reps 20] [--tmap auto|bindings|ctypes] [--sms N] [--timeout 20]
       [--debug [--debug-size 256x256x128] [--debug-only]]   (exits 1 when a check fails,
       3 on a hang, 4 on a fault)
"""
from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import os
import re
import struct
import subprocess
import sys
import tempfile
import time

import jinja2
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATES = os.path.join(HERE, "..", "templates")
CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
TDTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16}
U_OUT = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
TMAP_DTYPE = {"float16": 6, "bfloat16": 9}        # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / BFLOAT16
SWIZZLE_128B, L2_256B, OOB_ZERO, INTERLEAVE_NONE = 3, 3, 0, 0
THREADS = 384
SMEM_LIMIT = 232448                               # 227 KB per block on sm_90
STATIC_SMEM = 1024                                # the barriers, padded (ptxas -v)
VARIANTS = (("float32", "none"), ("same", "bias"))
DBG_BLOCKS, DBG_WORDS = 4, 32                     # as the template's debug=1 defines them
# word index -> meaning (templates/matmul_tma16.cu.j2, DBG() calls)
DEBUG_WORDS = {
    0: "entered (0xc0de0001)", 1: "M", 2: "N", 3: "K", 4: "tiles", 5: "ktiles",
    6: "tiles assigned to this block", 7: "gridDim.x", 8: "tm_a word 0 (kernel's view)",
    9: "tm_b word 0 (kernel's view)", 10: "tm_a word 8 (kernel's view)", 11: "smem ring base",
    12: "barriers initialized (past __syncthreads)", 13: "producer entered (elected lane + 1)",
    14: "producer k-tiles issued", 15: "producer loop done",
    16: "consumer 0 entered (after setmaxnreg.inc)", 17: "consumer 0 passed full wait of k-tile 0",
    18: "consumer 0 k-tiles consumed", 19: "consumer 0 epilogues reached",
    20: "consumer 0 acc[0][0] of its first tile (float)",
    22: "consumer 1 entered (after setmaxnreg.inc)", 23: "consumer 1 passed full wait of k-tile 0",
    24: "consumer 1 k-tiles consumed", 25: "consumer 1 epilogues reached",
    26: "consumer 1 acc[0][0] of its first tile (float)",
}


def render(dtype: str, bm: int, bn: int, stages: int, out: str, epilogue: str,
           name: str, debug: int = 0) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    ctype = CTYPE[dtype]
    return env.get_template("matmul_tma16.cu.j2").render(
        kernel_name=name, dtype=dtype, ctype=ctype, acc="float",
        out_ctype="float" if out == "float32" else ctype, epilogue=epilogue,
        bm=bm, bn=bn, stages=stages, group_m=8, debug=debug)


def smem_bytes(bm: int, bn: int, stages: int) -> int:
    return stages * (bm + bn) * 128 + 1024


def nvcc_cubin(src: str, workdir: str, name: str) -> tuple:
    """Compiles src for sm_90a; returns (cubin bytes, ptxas -v summary)."""
    cu = os.path.join(workdir, name + ".cu")
    cubin = os.path.join(workdir, name + ".cubin")
    with open(cu, "w") as f:
        f.write(src)
    r = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-cubin",
                        "-std=c++17", "-Xptxas", "-v", "-o", cubin, cu],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"nvcc failed for {name}:\n{r.stderr[-4000:]}")
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    info = f"{regs.group(1) if regs else '?'} regs, spills " \
           f"{spills.group(1) + '/' + spills.group(2) if spills else '?'} B (store/load)"
    with open(cubin, "rb") as f:
        return f.read(), info


# -- kernel parameter layout -----------------------------------------------------------------

EIATTR_KPARAM_INFO, EIATTR_CBANK_PARAM_SIZE, EIFMT_SVAL = 0x17, 0x19, 4


def cubin_param_layout(cubin: bytes, name: str) -> tuple:
    """([(offset, size) by ordinal], total size) from the cubin's .nv.info.<name> section."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise RuntimeError("not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    stro = secs[shstrndx][4]
    want = (".nv.info." + name).encode()
    params, total = {}, None
    for sname, _typ, _flags, _addr, off, size in secs:
        if cubin[stro + sname:cubin.index(b"\0", stro + sname)] != want:
            continue
        q = off
        while q + 4 <= off + size:
            fmt, attr = cubin[q], cubin[q + 1]
            if fmt == EIFMT_SVAL:
                n, = struct.unpack_from("<H", cubin, q + 2)
                if attr == EIATTR_KPARAM_INFO:
                    _idx, ordinal, poff, flags = struct.unpack_from("<IHHI", cubin, q + 4)
                    params[ordinal] = (poff, flags >> 18)
                q += 4 + n
            else:                                 # NVAL / BVAL / HVAL: 4 bytes
                if attr == EIATTR_CBANK_PARAM_SIZE:
                    total, = struct.unpack_from("<H", cubin, q + 2)
                q += 4
    if not params or sorted(params) != list(range(len(params))):
        raise RuntimeError(f"no complete EIATTR_KPARAM_INFO for {name}: {params}")
    layout = [params[i] for i in range(len(params))]
    end = max(o + z for o, z in layout)
    return layout, (total if total is not None else end)


def driver_param_layout(cubin: bytes, name: str):
    """[(offset, size)] from cuFuncGetParamInfo (driver 12.4+) on a second load of the cubin
    in the current context, or a string saying why not."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        f_info = lib.cuFuncGetParamInfo
    except (OSError, AttributeError) as e:
        return f"cuFuncGetParamInfo unavailable ({e})"
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    buf = ctypes.create_string_buffer(cubin, len(cubin))
    err = lib.cuModuleLoadData(ctypes.byref(mod), buf)
    if err != 0:
        return f"cuModuleLoadData: CUresult {err}"
    try:
        err = lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode())
        if err != 0:
            return f"cuModuleGetFunction: CUresult {err}"
        f_info.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                           ctypes.POINTER(ctypes.c_size_t)]
        out = []
        for i in range(64):
            o, z = ctypes.c_size_t(), ctypes.c_size_t()
            if f_info(fn, i, ctypes.byref(o), ctypes.byref(z)) != 0:
                break
            out.append((o.value, z.value))
        return out
    finally:
        lib.cuModuleUnload(mod)


# -- tensor maps ----------------------------------------------------------------------------

class TensorMapEncoder:
    """cuTensorMapEncodeTiled through cuda.bindings or ctypes; encode() returns 128 bytes."""

    def __init__(self, how: str) -> None:
        self.cu = None
        self.lib = None
        self.notes = []
        if how in ("auto", "bindings"):
            try:
                from cuda.bindings import driver as cu
                if not hasattr(cu, "cuTensorMapEncodeTiled"):
                    raise ImportError("cuda.bindings.driver has no cuTensorMapEncodeTiled")
                self.cu = cu
            except ImportError as e:
                self.notes.append(f"cuda.bindings unavailable ({e})")
                if how == "bindings":
                    raise SystemExit("--tmap bindings: cuda.bindings.driver is not importable: "
                                     "pip install cuda-bindings, or use --tmap ctypes")
        if how in ("auto", "ctypes"):
            try:
                lib = ctypes.CDLL("libcuda.so.1")
                f = lib.cuTensorMapEncodeTiled
                f.restype = ctypes.c_int
                f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                              ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                              ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                              ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
                self.lib = lib
            except (OSError, AttributeError) as e:
                self.notes.append(f"ctypes libcuda.so.1 cuTensorMapEncodeTiled unavailable ({e})")
        if self.cu is None and self.lib is None:
            raise SystemExit("no way to encode a tensor map: " + "; ".join(self.notes))
        self.compared = False

    def _bindings(self, dtype, ptr, dims, strides, box) -> bytes:
        cu = self.cu
        enum_dt = cu.CUtensorMapDataType(TMAP_DTYPE[dtype])
        enums = (cu.CUtensorMapInterleave(INTERLEAVE_NONE), cu.CUtensorMapSwizzle(SWIZZLE_128B),
                 cu.CUtensorMapL2promotion(L2_256B), cu.CUtensorMapFloatOOBfill(OOB_ZERO))
        try:
            res = cu.cuTensorMapEncodeTiled(enum_dt, len(dims), ptr, list(dims), list(strides),
                                            list(box), [1] * len(dims), *enums)
        except TypeError:                         # wrapped integer types wanted
            res = cu.cuTensorMapEncodeTiled(
                enum_dt, len(dims), ptr, [cu.cuuint64_t(d) for d in dims],
                [cu.cuuint64_t(s) for s in strides], [cu.cuuint32_t(b) for b in box],
                [cu.cuuint32_t(1)] * len(dims), *enums)
        err, tm = res[0], res[1]
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuTensorMapEncodeTiled (cuda.bindings): {err} for dims {dims} "
                               f"strides {strides} box {box}")
        return ctypes.string_at(int(tm.getPtr()), 128)

    def _ctypes(self, dtype, ptr, dims, strides, box) -> bytes:
        raw = (ctypes.c_uint8 * 192)()
        addr = ctypes.addressof(raw)
        addr += (-addr) % 64                      # the map must be 64-byte aligned
        n = len(dims)
        err = self.lib.cuTensorMapEncodeTiled(
            ctypes.c_void_p(addr), TMAP_DTYPE[dtype], n, ctypes.c_void_p(ptr),
            (ctypes.c_uint64 * n)(*dims), (ctypes.c_uint64 * (n - 1))(*strides),
            (ctypes.c_uint32 * n)(*box), (ctypes.c_uint32 * n)(*([1] * n)),
            INTERLEAVE_NONE, SWIZZLE_128B, L2_256B, OOB_ZERO)
        if err != 0:
            raise RuntimeError(f"cuTensorMapEncodeTiled (ctypes): CUresult {err} for dims {dims} "
                               f"strides {strides} box {box}")
        return ctypes.string_at(addr, 128)

    def encode(self, dtype: str, ptr: int, dims: tuple, strides: tuple, box: tuple) -> bytes:
        if self.cu is not None:
            b = self._bindings(dtype, ptr, dims, strides, box)
            if self.lib is not None and not self.compared:
                c = self._ctypes(dtype, ptr, dims, strides, box)
                self.compared = True
                print(f"tensor map: cuda.bindings and ctypes bytes "
                      f"{'identical' if b == c else 'DIFFER (using cuda.bindings)'}")
            return b
        return self._ctypes(dtype, ptr, dims, strides, box)

    def name(self) -> str:
        return "cuda.bindings" if self.cu is not None else "ctypes libcuda.so.1"


def pack_args(fields: list, layout: list, total: int) -> bytes:
    """Kernel parameter buffer: field i at the kernel's offset of parameter i, `total` bytes."""
    if len(fields) != len(layout):
        raise RuntimeError(f"{len(fields)} arguments for {len(layout)} kernel parameters")
    buf = bytearray(total)
    for i, ((fmt, value), (off, size)) in enumerate(zip(fields, layout)):
        if struct.calcsize("<" + fmt) != size:
            raise RuntimeError(f"parameter {i}: {struct.calcsize('<' + fmt)} bytes given, "
                               f"the kernel's is {size}")
        struct.pack_into("<" + fmt, buf, off, value)
    return bytes(buf)


class Kernel:
    def __init__(self, drv, cubin, info, dtype, bm, bn, stages, out, epilogue, name, sms):
        self.drv, self.bm, self.bn, self.stages = drv, bm, bn, stages
        self.dtype, self.out, self.epilogue, self.sms = dtype, out, epilogue, sms
        self.layout, self.param_bytes = cubin_param_layout(cubin, name)
        d = driver_param_layout(cubin, name)
        lay = " ".join(f"{o:#x}" for o, _ in self.layout)
        if isinstance(d, str):
            self.param_note = f"params at {lay}, {self.param_bytes} B (cubin; driver: {d})"
        elif d == self.layout:
            self.param_note = f"params at {lay}, {self.param_bytes} B (cubin = driver)"
        else:
            self.param_note = (f"params at {lay} (cubin) but the driver says "
                               f"{' '.join(f'{o:#x}' for o, _ in d)}: using the driver's")
            self.layout = d
            self.param_bytes = max(self.param_bytes, max(o + z for o, z in d))
        self.mod = drv.module_from_buffer(cubin)
        self.fn = self.mod.get_function(name)
        self.smem = smem_bytes(bm, bn, stages)
        self.fn.set_attribute(drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem)
        self.regs = self.fn.get_attribute(drv.function_attribute.NUM_REGS)
        self.local = self.fn.get_attribute(drv.function_attribute.LOCAL_SIZE_BYTES)
        self.info = info

    def prepare(self, enc: TensorMapEncoder, A, B, c, bias, M, N, K, lda, ldb, dbg=None):
        """The launch (grid, argument buffer) for these operands, built once; dbg: the device
        address of the debug words (debug=1 kernels only)."""
        tm_a = enc.encode(self.dtype, A.data_ptr(), (K, M), (lda * 2,), (64, self.bm))
        tm_b = enc.encode(self.dtype, B.data_ptr(), (N, K), (ldb * 2,), (64, 64))
        fields = [("128s", tm_a), ("128s", tm_b), ("Q", c.data_ptr())]
        if self.epilogue == "bias":
            fields.append(("Q", bias.data_ptr() if bias is not None else 0))
        fields += [("i", M), ("i", N), ("i", K)]
        if dbg is not None:
            fields.append(("Q", dbg))
        tiles = -(-M // self.bm) * -(-N // self.bn)
        grid = (max(1, min(tiles, self.sms)), 1, 1)
        self.last_maps = (tm_a, tm_b)
        return grid, pack_args(fields, self.layout, self.param_bytes)

    def launch(self, prepared, stream=None) -> None:
        grid, buf = prepared
        self.fn._launch_kernel(grid, (THREADS, 1, 1), buf, self.smem, stream)


def checked_launch(drv, k: Kernel, prepared, timeout: float):
    """Launches on a fresh stream, polls it until `timeout` seconds, synchronizes the context;
    None when the kernel finished cleanly, else ("launch" | "hung" | "fault", message)."""
    torch.cuda.synchronize()                      # the operands are ready
    stream = drv.Stream()
    try:
        k.launch(prepared, stream)
    except drv.Error as e:
        return "launch", f"launch error: {type(e).__name__}: {e}"
    deadline = time.time() + timeout
    try:
        while not stream.is_done():
            if time.time() > deadline:
                return "hung", f"hung: not done after {timeout:.0f} s"
            time.sleep(0.001)
        drv.Context.synchronize()
    except drv.Error as e:
        return "fault", f"error at stream query / Context.synchronize(): {type(e).__name__}: {e}"
    return None


def stop(code: int, msg: str) -> None:
    """A hang or a fault leaves the context unusable: print and leave without cleanup."""
    print(msg, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def print_debug(words: np.ndarray, blocks: int, k: Kernel) -> None:
    w = words.reshape(DBG_BLOCKS, DBG_WORDS)
    tm_a, tm_b = k.last_maps
    host = {8: struct.unpack_from("<I", tm_a, 0)[0], 9: struct.unpack_from("<I", tm_b, 0)[0],
            10: struct.unpack_from("<I", tm_a, 32)[0]}
    for b in range(min(blocks, DBG_BLOCKS)):
        if b == 0:
            print("    block 0:")
            for i, what in DEBUG_WORDS.items():
                v = int(w[b, i])
                txt = f"{v:#010x}" if i in (0, 8, 9, 10, 11) else str(v)
                if i in (20, 26):
                    txt = f"{struct.unpack('<f', struct.pack('<I', v))[0]:.6g}"
                if i in host:
                    txt += f"  (host bytes {host[i]:#010x}: " \
                           f"{'same' if host[i] == v else 'DIFFERENT'})"
                print(f"      [{i:2d}] {what:48s} {txt}")
        else:
            print(f"    block {b}: " + " ".join(f"{i}:{int(w[b, i])}" for i in
                                                (0, 1, 2, 3, 4, 5, 6, 12, 14, 15, 17, 18, 19,
                                                 23, 24, 25)))


def operands(dtype, M, N, K, gen):
    """A (M, lda) and B (K, ldb) with lda, ldb multiples of 8 (padding zeroed), views a, b."""
    t = TDTYPE[dtype]
    lda, ldb = (K + 7) // 8 * 8, (N + 7) // 8 * 8
    A = torch.zeros(M, lda, dtype=t, device="cuda")
    B = torch.zeros(K, ldb, dtype=t, device="cuda")
    A[:, :K] = torch.randn(M, K, generator=gen, device="cuda").to(t)
    B[:, :N] = torch.randn(K, N, generator=gen, device="cuda").to(t)
    return A, B, A[:, :K], B[:, :N], lda, ldb


def check(c, ref, S, dtype, out, K, has_bias) -> tuple:
    err = (c.double() - ref).abs()
    nk = K + (1 if has_bias else 0)
    bound = nk * 2.0 ** -23 * S
    if out != "float32":
        bound = bound + U_OUT[dtype] * ref.abs()
    tiny = torch.finfo(torch.float64).tiny
    ratio = float((err / (bound + tiny)).max())
    norm24 = float((err / (2.0 ** -24 * S + tiny)).max())
    loose = float((err / (K * 2.0 ** -8 * S + tiny)).max())
    fro = float(torch.linalg.norm(c.double() - ref) / torch.linalg.norm(ref))
    finite = bool(torch.isfinite(c).all())
    gross = 1e-3 if out == "float32" else 2e-2
    ok = finite and ratio <= 1.0 and fro < gross
    return ok, ratio, norm24, loose, fro, finite


def time_ms(fn, flush, reps: int) -> float:
    times = []
    for _ in range(reps):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return float(np.median(times))


def run_debug(args, drv, built, configs, enc, sms, gen) -> bool:
    """The debug=1 kernels once each at --debug-size with a 5-second watchdog."""
    parts = [int(x) for x in args.debug_size.split("x")]
    M, N, K = tuple(parts) if len(parts) == 3 else (parts[0],) * 3
    try:                                          # mapped pinned host memory: readable live
        words = drv.pagelocked_zeros(DBG_BLOCKS * DBG_WORDS, np.uint32,
                                     mem_flags=drv.host_alloc_flags.DEVICEMAP)
        dptr = int(words.base.get_device_pointer())
    except drv.Error as e:                        # torch's pinned memory: the same pointer (UVA)
        print(f"debug words: PyCUDA DEVICEMAP failed ({e}), using torch pinned memory")
        pinned = torch.zeros(DBG_BLOCKS * DBG_WORDS, dtype=torch.int32, pin_memory=True)
        words, dptr = pinned.numpy().view(np.uint32), pinned.data_ptr()
    all_ok = True
    for dtype in args.dtypes:
        A, B, a, b, lda, ldb = operands(dtype, M, N, K, gen)
        bias = torch.randn(N, generator=gen, device="cuda").to(TDTYPE[dtype])
        ad, bd = a.double(), b.double()
        ref, S = ad @ bd, ad.abs() @ bd.abs()
        for (bm, bn, stages) in configs:
            for out, epi in VARIANTS:
                name, (cubin, info) = built[dtype, bm, bn, stages, out, epi, "dbg"]
                k = Kernel(drv, cubin, info, dtype, bm, bn, stages, out, epi, name, sms)
                out_t = torch.float32 if out == "float32" else TDTYPE[dtype]
                c = torch.full((M, N), float("nan"), dtype=out_t, device="cuda")
                prep = k.prepare(enc, A, B, c, bias if epi == "bias" else None, M, N, K,
                                 lda, ldb, dbg=dptr)
                words[:] = 0
                print(f"\n== debug {dtype} {M}x{N}x{K} bm {bm} bn {bn} st {stages} out={out} "
                      f"{epi}: grid {prep[0][0]}, {k.param_note}; ptxas {info}")
                bad = checked_launch(drv, k, prep, 5.0)
                print_debug(words, prep[0][0], k)
                if bad is not None:
                    all_ok = False
                    if bad[0] == "launch":
                        print(f"  FAIL {bad[1]}")
                        continue
                    stop(3 if bad[0] == "hung" else 4,
                         f"  FAIL {bad[1]}\nrun stopped (the context is unusable)")
                if epi == "bias":
                    r, s_ = ref + bias.double(), S + bias.double().abs()
                else:
                    r, s_ = ref, S
                ok, ratio, n24, loose, fro, fin = check(c, r, s_, dtype, out, K, epi == "bias")
                all_ok &= ok
                print(f"  {'OK  ' if ok else 'FAIL'} err/bound {ratio:.3g}  err/(2^-24 S) "
                      f"{n24:.3g}  rel_fro {fro:.2e}{'' if fin else '  NON-FINITE'}")
    return all_ok


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    p.add_argument("--configs", nargs="+", default=["128:256:4", "128:128:5", "256:128:4"],
                   help="bm:bn:stages")
    p.add_argument("--sizes", nargs="+", default=["1023x1025x1000", "77x200x37", "4096", "8192",
                                                  "8192x8192x1024", "16384x1024x4096"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tmap", choices=["auto", "bindings", "ctypes"], default="auto")
    p.add_argument("--sms", type=int, default=0, help="persistent grid size (0: the SM count)")
    p.add_argument("--timeout", type=float, default=20.0,
                   help="seconds before a checked launch counts as hung")
    p.add_argument("--debug", action="store_true",
                   help="first run the debug=1 kernels once at --debug-size, 5 s watchdog")
    p.add_argument("--debug-size", default="256x256x128")
    p.add_argument("--debug-only", action="store_true", help="--debug, then stop")
    args = p.parse_args()
    args.debug = args.debug or args.debug_only
    t_start = time.time()

    configs = []
    for cfg in args.configs:
        bm, bn, stages = (int(x) for x in cfg.split(":"))
        if smem_bytes(bm, bn, stages) + STATIC_SMEM > SMEM_LIMIT:
            print(f"skip {cfg}: {smem_bytes(bm, bn, stages) + STATIC_SMEM} B of shared memory "
                  f"> {SMEM_LIMIT}")
            continue
        if bm == 256 and bn == 256:
            print(f"skip {cfg}: bm 256 takes bn 128 only")
            continue
        configs.append((bm, bn, stages))
    sizes = []
    for s in args.sizes:
        parts = [int(x) for x in s.split("x")]
        sizes.append(tuple(parts) if len(parts) == 3 else (parts[0],) * 3)

    # compile every variant in parallel before touching the GPU
    jobs = {}
    workdir = tempfile.mkdtemp(prefix="tma16_")
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as ex:
        for dtype in args.dtypes:
            for (bm, bn, stages) in configs:
                for out, epi in VARIANTS:
                    name = f"tma16_{dtype}_{bm}_{bn}_{stages}_{out}_{epi}"
                    src = render(dtype, bm, bn, stages, out, epi, name)
                    jobs[dtype, bm, bn, stages, out, epi] = (name, ex.submit(nvcc_cubin, src,
                                                                             workdir, name))
                    if args.debug:
                        dname = name + "_dbg"
                        dsrc = render(dtype, bm, bn, stages, out, epi, dname, debug=1)
                        jobs[dtype, bm, bn, stages, out, epi, "dbg"] = (
                            dname, ex.submit(nvcc_cubin, dsrc, workdir, dname))
        built = {k: (name, f.result()) for k, (name, f) in jobs.items()}
    print(f"compiled {len(built)} kernels in {time.time() - t_start:.1f} s")

    torch.cuda.init()
    torch.empty(1, device="cuda")                 # creates the primary context
    import pycuda.driver as drv
    drv.init()
    ctx = drv.Device(torch.cuda.current_device()).retain_primary_context()
    ctx.push()                                    # PyCUDA shares torch's context and stream 0

    cap = torch.cuda.get_device_capability()
    print(f"device: {torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}, torch {torch.__version__}")
    if cap != (9, 0):
        print("needs sm_90 (wgmma, TMA)")
        ctx.pop()
        return 2
    sms = args.sms or torch.cuda.get_device_properties(0).multi_processor_count
    enc = TensorMapEncoder(args.tmap)
    print(f"tensor maps via {enc.name()}" + (f" ({'; '.join(enc.notes)})" if enc.notes else ""))
    flush = torch.empty(512 * 2 ** 20, dtype=torch.uint8, device="cuda")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)

    all_ok = True
    try:
        if args.debug:
            all_ok &= run_debug(args, drv, built, configs, enc, sms, gen)
            print()
        for dtype in ([] if args.debug_only else args.dtypes):
            kerns = {}
            for (bm, bn, stages) in configs:
                for out, epi in VARIANTS:
                    name, (cubin, info) = built[dtype, bm, bn, stages, out, epi]
                    k = Kernel(drv, cubin, info, dtype, bm, bn, stages, out, epi, name, sms)
                    kerns[bm, bn, stages, out, epi] = k
                    print(f"{dtype} bm {bm} bn {bn} stages {stages} out={out} {epi}: "
                          f"ptxas {info}; loaded: {k.regs} regs, local {k.local} B, "
                          f"{k.smem} B dynamic shared; {k.param_note}")
            for (M, N, K) in sizes:
                A, B, a, b, lda, ldb = operands(dtype, M, N, K, gen)
                bias = torch.randn(N, generator=gen, device="cuda").to(TDTYPE[dtype])
                ad, bd = a.double(), b.double()
                ref = ad @ bd
                S = ad.abs() @ bd.abs()
                del ad, bd
                edge = (M, N, K) == sizes[0] or max(M, N, K) < 512
                print(f"\n== {dtype} {M}x{N}x{K}")
                for (bm, bn, stages, out, epi), k in kerns.items():
                    with_bias = epi == "bias" and edge   # the bias at the small shapes only
                    out_t = torch.float32 if out == "float32" else TDTYPE[dtype]
                    c = torch.full((M, N), float("nan"), dtype=out_t, device="cuda")
                    prep = k.prepare(enc, A, B, c, bias if with_bias else None,
                                     M, N, K, lda, ldb)
                    bad = checked_launch(drv, k, prep, args.timeout)
                    tag = (f"  bm {bm} bn {bn} st {stages} out={out:7s} "
                           f"{'bias' if with_bias else 'none'}")
                    if bad is not None:
                        all_ok = False
                        if bad[0] == "launch":
                            print(f"{tag}: FAIL {bad[1]}")
                            del c
                            continue
                        stop(3 if bad[0] == "hung" else 4,
                             f"{tag}: FAIL {bad[1]}\nrun stopped (the context is unusable)")
                    if with_bias:
                        r, s_ = ref + bias.double(), S + bias.double().abs()
                    else:
                        r, s_ = ref, S
                    ok, ratio, n24, loose, fro, fin = check(c, r, s_, dtype, out, K, with_bias)
                    all_ok &= ok
                    print(f"{tag}: "
                          f"{'OK  ' if ok else 'FAIL'} err/bound {ratio:.3g}  "
                          f"err/(2^-24 S) {n24:.3g}  err/(K 2^-8 S) {loose:.2e}  "
                          f"rel_fro {fro:.2e}{'' if fin else '  NON-FINITE'}")
                    del c
                del ref, S
                if max(M, N, K) < 2048:
                    del A, B, a, b
                    continue
                flops = 2.0 * M * N * K
                t_ref = time_ms(lambda: torch.matmul(a, b), flush, args.reps)
                print(f"  torch.matmul: {t_ref:.4f} ms {flops / t_ref / 1e9:.0f} TF/s "
                      f"(floor {flops / 989e12 * 1e3:.4f} ms at 989 TF/s)")
                for (bm, bn, stages, out, epi), k in kerns.items():
                    out_t = torch.float32 if out == "float32" else TDTYPE[dtype]
                    c = torch.empty(M, N, dtype=out_t, device="cuda")
                    prep = k.prepare(enc, A, B, c, None, M, N, K, lda, ldb)
                    t = time_ms(lambda: k.launch(prep), flush, args.reps)
                    fast = t < flops / 989e12 * 1e3 * 0.98
                    all_ok &= not fast
                    print(f"  bm {bm} bn {bn} st {stages} out={out:7s}: {t:.4f} ms "
                          f"{flops / t / 1e9:.0f} TF/s  ratio vs torch {t_ref / t:.2f}"
                          f"{'  IMPLAUSIBLE: faster than the 989 TF/s floor' if fast else ''}")
                    del c
                del A, B, a, b
    finally:
        ctx.pop()
    print(f"\nall checks: {'OK' if all_ok else 'FAILED'} ({time.time() - t_start:.0f} s)")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
