"""Standalone check and timing of templates/matmul_wgmma16.cu.j2 (float16 / bfloat16 GEMM on
Hopper wgmma, both operands from shared memory) against torch.matmul. Needs an sm_90 GPU,
PyCUDA, torch, jinja2 and nvcc; does not import cuda_backend.

For each dtype and tile config it renders the template with jinja2, compiles it for sm_90a
(pycuda SourceModule, arch compute_90a, code sm_90a), runs it at 1023x1025x1000 (every
edge predicate: M, N not multiples of the tile, N odd so B is given with a padded row stride,
K not a multiple of 64), 4096^3 and 8192^3, checks it against a float64 reference (torch on
the GPU), and times it and torch.matmul (same inputs, 16-bit out) with CUDA events, L2 flushed
before each call.

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

Usage: python perf/wgmma16_check.py [--dtypes bfloat16 float16] [--configs 128:4:1 256:4:1]
       [--sizes 1023x1025x1000 4096 8192] [--reps 20]   (exits 1 when a check fails)
"""
from __future__ import annotations

import argparse
import os
import sys

import jinja2
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATES = os.path.join(HERE, "..", "templates")
CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
TDTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16}
U_OUT = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
BM = 128


def render(dtype: str, bn: int, stages: int, min_blocks: int, out: str, epilogue: str,
           name: str) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    ctype = CTYPE[dtype]
    return env.get_template("matmul_wgmma16.cu.j2").render(
        kernel_name=name, dtype=dtype, ctype=ctype, acc="float",
        out_ctype="float" if out == "float32" else ctype, epilogue=epilogue,
        bm=BM, bn=bn, stages=stages, min_blocks=min_blocks)


def smem_bytes(bn: int, stages: int) -> int:
    return stages * (BM * 128 + bn * 128) + 1024


class Kernel:
    def __init__(self, drv, SourceModule, dtype, bn, stages, min_blocks, out, epilogue):
        self.drv, self.bn, self.stages, self.out, self.epilogue = drv, bn, stages, out, epilogue
        name = f"wgmma16_{dtype}_{bn}_{stages}_{min_blocks}_{out}_{epilogue}"
        src = render(dtype, bn, stages, min_blocks, out, epilogue, name)
        # arch compute_90a + code sm_90a, as cuda_backend/compiler.py does: `-arch sm_90a`
        # alone also runs a plain sm_90 pass that rejects wgmma
        self.mod = SourceModule(src, arch="compute_90a", code="sm_90a", no_extern_c=True,
                                options=["-std=c++17"])
        self.fn = self.mod.get_function(name)
        self.smem = smem_bytes(bn, stages)
        self.fn.set_attribute(drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem)
        self.regs = self.fn.get_attribute(drv.function_attribute.NUM_REGS)

    def __call__(self, a, b, c, bias, M, N, K, lda, ldb):
        grid = ((M + BM - 1) // BM * ((N + self.bn - 1) // self.bn), 1, 1)
        args = [np.uintp(a.data_ptr()), np.uintp(b.data_ptr()), np.uintp(c.data_ptr())]
        if self.epilogue == "bias":
            args.append(np.uintp(bias.data_ptr() if bias is not None else 0))
        args += [np.int32(M), np.int32(N), np.int32(K), np.int32(lda), np.int32(ldb),
                 np.int64(0), np.int64(0)]
        self.fn(*args, block=(256, 1, 1), grid=grid, shared=self.smem)


def operands(dtype, M, N, K, gen):
    """A (M, lda) and B (K, ldb) with lda, ldb multiples of 8 (padding zeroed), views a, b."""
    t = TDTYPE[dtype]
    lda, ldb = (K + 7) // 8 * 8, (N + 7) // 8 * 8
    A = torch.zeros(M, lda, dtype=t, device="cuda")
    B = torch.zeros(K, ldb, dtype=t, device="cuda")
    A[:, :K] = torch.randn(M, K, generator=gen, device="cuda").to(t)
    B[:, :N] = torch.randn(K, N, generator=gen, device="cuda").to(t)
    return A, B, A[:, :K], B[:, :N], lda, ldb


def check(k: Kernel, dtype, M, N, K, gen, with_bias: bool) -> tuple:
    A, B, a, b, lda, ldb = operands(dtype, M, N, K, gen)
    bias = torch.randn(N, generator=gen, device="cuda").to(TDTYPE[dtype]) if with_bias else None
    out_t = torch.float32 if k.out == "float32" else TDTYPE[dtype]
    c = torch.full((M, N), float("nan"), dtype=out_t, device="cuda")
    k(A, B, c, bias, M, N, K, lda, ldb)
    torch.cuda.synchronize()
    ad, bd = a.double(), b.double()
    ref = ad @ bd
    S = ad.abs() @ bd.abs()
    if bias is not None:
        ref += bias.double()
        S += bias.double().abs()
    err = (c.double() - ref).abs()
    nk = K + (1 if bias is not None else 0)
    bound = nk * 2.0 ** -23 * S
    if k.out != "float32":
        bound += U_OUT[dtype] * ref.abs()
    tiny = torch.finfo(torch.float64).tiny
    ratio = float((err / (bound + tiny)).max())
    norm24 = float((err / (2.0 ** -24 * S + tiny)).max())
    loose = float((err / (K * 2.0 ** -8 * S + tiny)).max())
    fro = float(torch.linalg.norm(c.double() - ref) / torch.linalg.norm(ref))
    finite = bool(torch.isfinite(c).all())
    gross = 1e-3 if k.out == "float32" else 2e-2
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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    p.add_argument("--configs", nargs="+", default=["128:4:1", "128:6:1", "128:3:2", "256:4:1"],
                   help="bn:stages:min_blocks")
    p.add_argument("--sizes", nargs="+", default=["1023x1025x1000", "4096", "8192"])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()

    torch.cuda.init()
    torch.empty(1, device="cuda")                 # creates the primary context
    import pycuda.driver as drv
    drv.init()
    ctx = drv.Device(torch.cuda.current_device()).retain_primary_context()
    ctx.push()                                    # PyCUDA shares torch's context and stream 0
    from pycuda.compiler import SourceModule

    cap = torch.cuda.get_device_capability()
    print(f"device: {torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}, torch {torch.__version__}")
    if cap != (9, 0):
        print("needs sm_90 (wgmma)")
        return 2
    flush = torch.empty(512 * 2 ** 20, dtype=torch.uint8, device="cuda")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    sizes = []
    for s in args.sizes:
        parts = [int(x) for x in s.split("x")]
        sizes.append(tuple(parts) if len(parts) == 3 else (parts[0],) * 3)

    all_ok = True
    try:
        for dtype in args.dtypes:
            for cfg in args.configs:
                bn, stages, mb = (int(x) for x in cfg.split(":"))
                kerns = {}
                for out in ("float32", "same"):
                    for epi in ("none", "bias"):
                        kerns[out, epi] = Kernel(drv, SourceModule, dtype, bn, stages, mb,
                                                 out, epi)
                k0 = kerns["float32", "none"]
                print(f"\n== {dtype} bm 128 bn {bn} stages {stages} min_blocks {mb}: "
                      f"{k0.regs} regs, {k0.smem} B shared")
                for (M, N, K) in sizes:
                    for (out, epi), k in kerns.items():
                        if (M, N, K) != sizes[0] and epi == "bias":
                            continue              # the bias at the edge shape only
                        ok, ratio, n24, loose, fro, fin = check(k, dtype, M, N, K, gen,
                                                                epi == "bias")
                        all_ok &= ok
                        print(f"  {M}x{N}x{K} out={out:8s} {epi:4s}: "
                              f"{'OK  ' if ok else 'FAIL'} err/bound {ratio:.3g}  "
                              f"err/(2^-24 S) {n24:.3g}  err/(K 2^-8 S) {loose:.2e}  "
                              f"rel_fro {fro:.2e}{'' if fin else '  NON-FINITE'}")
                    A, B, a, b, lda, ldb = operands(dtype, M, N, K, gen)
                    flops = 2.0 * M * N * K
                    t_ref = time_ms(lambda: torch.matmul(a, b), flush, args.reps)
                    line = f"  {M}x{N}x{K} torch.matmul {t_ref:.4f} ms " \
                           f"{flops / t_ref / 1e9:.0f} TF/s"
                    for out in ("float32", "same"):
                        k = kerns[out, "none"]
                        c = torch.empty(M, N, device="cuda",
                                        dtype=torch.float32 if out == "float32" else TDTYPE[dtype])
                        t = time_ms(lambda: k(A, B, c, None, M, N, K, lda, ldb), flush, args.reps)
                        line += f" | out={out}: {t:.4f} ms {flops / t / 1e9:.0f} TF/s " \
                                f"ratio {t_ref / t:.2f}"
                    print(line)
                    del A, B, a, b
    finally:
        ctx.pop()
    print("\nall checks:", "OK" if all_ok else "FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
