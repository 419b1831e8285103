"""Matmul kernels: the templates (SIMT, mma.sync, wgmma TF32 and 16-bit, TMA 16-bit, cluster),
the template a tile config renders (`config_template`), the template parameters of each kernel
kind, whether a device runs a template, which operands a kernel takes (`wgmma_ok`,
`wgmma16_ok`), and a config's launch resources (shared memory, resident blocks). Shared by the
launches (matmul_launch.py, matmul_plans.py, matmul_tma16.py) and the variant list
(ops/matmul.py)."""
from __future__ import annotations

from typing import Any, Dict, Optional

from .. import occupancy
from ..dtypes import CudaDataType
from ..kernels import dtype_params, template_arch
from ..tensor import CudaTensor
from .matmul_shapes import Plan

DT = CudaDataType
SIMT_TEMPLATE = "matmul_simt.cu.j2"
MMA_TEMPLATE = "matmul_mma.cu.j2"
DMMA_TEMPLATE = "matmul_dmma.cu.j2"   # float64 on the FP64 tensor cores (sm_90+)
WGMMA_TEMPLATE = "matmul_wgmma.cu.j2"
WGMMA16_TEMPLATE = "matmul_wgmma16.cu.j2"
WGMMA16_THREADS = 256   # two warpgroups (bm 128) per block
WGMMA16_LD = 8          # the 16-bit wgmma kernel's row strides: multiples of 8 elements
TMA16_TEMPLATE = "matmul_tma16.cu.j2"
TMA16_THREADS = 384     # a producer and two consumer warpgroups per block
# The TMA kernel's parameters as PyCUDA's prepare() records them (two CUtensorMaps, C, M, N,
# K): never packed by struct (launch.PreparedLaunch.__call__), whose natural alignment from 0
# is not the kernel's layout: its launches pack at the offsets tensor_maps.param_layout reads
# (launch_packed).
TMA16_ARG_TYPES = "128s128sPiii"
TMA_CONV_ARG_TYPES = "128s128sPP" + "i" * 13   # the conv=1 signature (ops/conv2d_tma.py)
SKINNY_TEMPLATE = "matmul_skinny.cu.j2"
FILL_TEMPLATE = "fill.cu.j2"
# the linear layer's epilogues (matmul.linear)
EPILOGUES = ("bias", "bias_gelu")
# the backward's epilogue: G * GELU'(x Wᵀ + b), G (M, N) given as `grad`
GRAD_EPILOGUE = "bias_gelu_grad"
REDUCE_BLOCK = 256   # threads per block of the split-K reduce kernels


def simt_smem(cfg: Dict[str, Any], esize: int = 4, b_trans: bool = False) -> int:
    """Dynamic shared memory of a SIMT config's launch (0: static, the 2-buffer loader);
    b_trans (the linear layer): B's k-major tile rows are padded by 4 like A's; kc: both
    tiles k-contiguous, rows of bk + 4."""
    stages = cfg.get("stages", 0)
    if cfg.get("kc"):
        return stages * (cfg["bm"] + cfg["bn"]) * (cfg["bk"] + 4) * esize
    bn = cfg["bn"] + (4 if b_trans else 0)
    return stages * cfg["bk"] * (cfg["bm"] + 4 + bn) * esize if stages else 0


def wgmma_smem(cfg: Dict[str, Any]) -> int:
    """Dynamic shared memory of a wgmma config (TF32, 16-bit or TMA 16-bit: 128-byte rows of
    bm + bn per ring slot): the ring plus 1 KB to align it to 1024."""
    return cfg["stages"] * (cfg["bm"] + cfg["bn"]) * 128 + 1024


def dmma_smem(cfg: Dict[str, Any]) -> int:
    """Dynamic shared memory of a DMMA config: the ring of A tiles (rows of bk + 2 doubles)
    and B tiles (matmul_dmma.cu.j2)."""
    return cfg["stages"] * (cfg["bm"] * (cfg["bk"] + 2) + cfg["bk"] * cfg["bn"]) * 8


def config_template(cfg: Dict[str, Any], family_template: str) -> str:
    """The template a config renders: its family's, mma for a 3xTF32 config (x3), which
    sits in the float32 default lists (GEMM and linear layer) beside SIMT ones, DMMA for a
    float64 tensor-core one (beside the float64 SIMT ones), wgmma for a wgmma one (TF32 or
    16-bit), the cluster kernel for a cluster one."""
    if cfg.get("dmma"):
        return DMMA_TEMPLATE
    if cfg.get("tma16"):
        return TMA16_TEMPLATE
    if cfg.get("wgmma16"):
        return WGMMA16_TEMPLATE
    if cfg.get("wgmma"):
        return WGMMA_TEMPLATE
    if cfg.get("cluster"):
        return SKINNY_TEMPLATE
    if cfg.get("skinny"):
        return SIMT_TEMPLATE
    return MMA_TEMPLATE if cfg.get("x3") else family_template


def has_wgmma(info: Any) -> bool:
    """The device runs sm_90a code (Hopper: compute capability 9.0)."""
    return tuple(getattr(info, "compute_capability", (0, 0))) == (9, 0)


def has_clusters(info: Any) -> bool:
    """The device launches thread-block clusters (compute capability >= 9.0), which the
    cluster configs' kernel (matmul_skinny.cu.j2, __cluster_dims__) needs."""
    return tuple(getattr(info, "compute_capability", (0, 0))) >= (9, 0)


def template_runs_on(template: str, info: Any) -> bool:
    """The device can run the template's kernels (warm-ups skip the others): wgmma needs
    sm_90a, the cluster kernel and DMMA (mma.m16n8k16.f64) compute capability >= 9.0; the
    rest run anywhere."""
    if template in (WGMMA_TEMPLATE, WGMMA16_TEMPLATE, TMA16_TEMPLATE):
        return has_wgmma(info)
    if template in (SKINNY_TEMPLATE, DMMA_TEMPLATE):
        return has_clusters(info)
    return True


def wgmma_ok(a: CudaTensor, p: Plan) -> bool:
    """The wgmma kernel's operand rules: K a multiple of 4, A 16-byte aligned (B is its own
    transposed copy, the output is stored with bounds checks)."""
    return p.K % 4 == 0 and a.ptr % 16 == 0


def wgmma16_ok(dtype: CudaDataType, a: CudaTensor, out: CudaTensor, p: Plan) -> bool:
    """The 16-bit wgmma kernel's operand rules, A and B aside (read in place where K, N and
    their pointers allow 16-byte chunks, else copied into padded rows: matmul_pad): float16
    or bfloat16, the output 4-byte aligned (paired stores where N is even)."""
    return dtype in (DT.FLOAT16, DT.BFLOAT16) and out.ptr % 4 == 0


def wgmma16_b_direct(pb: int, p: Plan) -> bool:
    """B (K, N) at address pb is read in place by the 16-bit wgmma kernel (N a multiple of 8,
    16-byte aligned); otherwise it is first copied into rows padded to wgmma16_ld(N)."""
    return p.N % WGMMA16_LD == 0 and pb % 16 == 0


def wgmma16_ld(n: int) -> int:
    """The row stride of B's padded copy: N rounded up to a multiple of 8 elements."""
    return -(-n // WGMMA16_LD) * WGMMA16_LD


def blocks_per_sm(cfg: Dict[str, int], regs: int = 0, info: Any = None, esize: int = 4,
                  static_smem: int = 0) -> int:
    """Resident blocks of a SIMT config per SM (occupancy.blocks_per_sm on the device's
    limits, info None: Hopper's) for its compiled registers and static shared memory plus
    the multistage loader's dynamic shared memory; regs = 0: the config's
    __launch_bounds__ minimum."""
    if regs <= 0:
        return cfg["min_blocks"]
    threads = (cfg["bm"] // cfg["tm"]) * (cfg["bn"] // cfg["tn"])
    return occupancy.blocks_per_sm(occupancy.KernelResources(regs, static_smem), info, threads,
                                   simt_smem(cfg, esize))


def simt_params(dtype: CudaDataType, cfg: Dict[str, Any], vec: bool) -> Dict[str, Any]:
    """Template parameters of a SIMT GEMM config (a "split" key is not one: dropped)."""
    params = {**dtype_params(dtype), **cfg, "vec": vec, "kind": "gemm"}
    params.pop("split", None)
    return params


def kernel_params(template: str, dtype: CudaDataType, cfg: Dict[str, Any], vec: bool,
                  epilogue: Optional[str] = None, a_trans: bool = False) -> Dict[str, Any]:
    """Template parameters of a tiled config's kernel: the plain GEMM, the A-transposed one
    or the linear layer's (epilogue)."""
    if a_trans:
        return tn_params(template, dtype, cfg, vec)
    if epilogue is not None:
        return linear_params(template, dtype, cfg, vec, epilogue)
    if template == SIMT_TEMPLATE:
        return simt_params(dtype, cfg, vec)
    params = {**dtype_params(dtype), **cfg, "vec": vec}
    params.pop("split", None)
    return params


def takes_k_chunk(template: str, cfg: Dict[str, Any], epilogue: Optional[str] = None) -> bool:
    """The config's kernel takes (batch, k_chunk) after the batch strides and splits K: the
    SIMT GEMM, the DMMA GEMM and the x3 GEMMs (3xTF32 without an epilogue:
    matmul_mma.cu.j2's rule)."""
    return template in (SIMT_TEMPLATE, DMMA_TEMPLATE) or \
        (template == MMA_TEMPLATE and bool(cfg.get("x3")) and epilogue is None)


def linear_params(template: str, dtype: CudaDataType, cfg: Dict[str, Any], vec: bool,
                  epilogue: str) -> Dict[str, Any]:
    """Template parameters of the linear-layer kernel (B given as (N, K), an epilogue; SIMT:
    kc always given, 0 where the config has none)."""
    params = {**dtype_params(dtype), **cfg, "vec": vec, "a_trans": False, "b_trans": True,
              "epilogue": epilogue}
    if template == SIMT_TEMPLATE:
        return {"kind": "gemm", "kc": 0, **params}
    return params


def tn_params(template: str, dtype: CudaDataType, cfg: Dict[str, Any],
              vec: bool) -> Dict[str, Any]:
    """Template parameters of the A-transposed GEMM (A given as (K, M), B as (K, N), no
    epilogue; a "split" key is not one: dropped)."""
    params = {**dtype_params(dtype), **cfg, "vec": vec, "a_trans": True, "b_trans": False,
              "epilogue": "none"}
    params.pop("split", None)
    if template == SIMT_TEMPLATE:
        return {"kind": "gemm", "kc": 0, **params}
    return params


def wgmma_params(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Template parameters of a wgmma config (float32 in and out)."""
    return {**dtype_params(DT.FLOAT32), "bm": cfg["bm"], "bn": cfg["bn"],
            "stages": cfg["stages"], "min_blocks": cfg["min_blocks"]}


def wgmma16_params(dtype: CudaDataType, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Template parameters of a 16-bit wgmma config: float16 / bfloat16 in and out (float32
    accumulation), no epilogue."""
    return {**dtype_params(dtype), "out_ctype": dtype.c_type, "epilogue": "none",
            "bm": cfg["bm"], "bn": cfg["bn"], "stages": cfg["stages"],
            "min_blocks": cfg["min_blocks"]}


def tma16_params(dtype: CudaDataType, cfg: Dict[str, Any],
                 out_dtype: Optional[CudaDataType] = None) -> Dict[str, Any]:
    """Template parameters of a TMA 16-bit config: float16 / bfloat16 in, the output in the
    input dtype (matrix_multiply's) or float32 (out_dtype FLOAT32), no epilogue."""
    out_ctype = "float" if out_dtype is DT.FLOAT32 else dtype.c_type
    return {**dtype_params(dtype), "out_ctype": out_ctype, "epilogue": "none",
            "bm": cfg["bm"], "bn": cfg["bn"], "stages": cfg["stages"],
            "group_m": cfg["group_m"]}


def compile_tma16(m: Any, dev: int, params: Dict[str, Any]) -> Any:
    """The TMA kernel for these parameters, compiled for sm_90a with TMA16_ARG_TYPES (the
    compiler cannot derive a format for CUtensorMap parameters); the compiler caches it."""
    name, source = m.generator.render_kernel(TMA16_TEMPLATE, **dict(params))
    return m.backend.compile_kernel(name, source, device_id=dev,
                                    arch=template_arch(TMA16_TEMPLATE),
                                    arg_types=TMA_CONV_ARG_TYPES if params.get("conv") else
                                    TMA16_ARG_TYPES)


def splitk_epilogue_params(dtype: CudaDataType, epilogue: str) -> Dict[str, Any]:
    """Template parameters of the split-K reduce that adds the bias and applies the linear
    layer's epilogue ('bias' / 'bias_gelu')."""
    return {**dtype_params(dtype), "kind": "splitk_epilogue", "block_size": REDUCE_BLOCK,
            "epilogue": epilogue}


def splitk_reduce_params(dtype: CudaDataType) -> Dict[str, Any]:
    """Template parameters of the split-K reduce that sums the partials in split order."""
    return {"kind": "splitk_reduce", "block_size": REDUCE_BLOCK, **dtype_params(dtype)}
