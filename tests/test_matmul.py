"""Matrix multiply (cuda_backend/ops/matmul.py): shapes, dtypes, precisions, errors.

GPU tests (marked `gpu`) compare against float64 NumPy on fresh random inputs with the
output poisoned (NaN) first, and check every tile config the autotuner may pick. The rest
run anywhere: shape/precision rules, config lists, and fallback mode where this process has
no GPU.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from fuzzing import examples
from hypothesis import strategies as st

from cuda_backend import (CudaDataType as DT, CudaTensor, DTypeMismatchError,
                          InvalidArgumentError, ShapeMismatchError, TensorFreedError)
from cuda_backend.dtypes import to_bfloat16_bits
from cuda_backend.ops import matmul as mm
from cuda_backend.ops import common

gpu = pytest.mark.gpu

# (dtype, precision) families and bounds on ||out - ref|| / || |A| @ |B| || (the GEMM error
# bound's own scale, so single outputs that cancel to ~0 cannot fail by chance). With
# random normal data FP32 lands near 1e-7 at any K and TF32 near 4e-4 / sqrt(K); the
# norm-wise ||out - ref|| / ||ref|| checks below separate the two at large K. "fp32" (the
# default) may run 3xTF32 (elementwise error <= (gamma(K, 2^-23) + 3 2^-22) |A||B|, see
# tests/test_matmul_backward.py): its accumulation truncates, a bias growing ~K/24 2^-23
# relative to the output, sqrt(K)/15 2^-23 on this metric: ~5e-7 at K = 4096, under 2e-6.
FAMILIES = {
    "fp32": (DT.FLOAT32, None, 2e-6),
    "tf32": (DT.FLOAT32, "tf32", 1.5e-3),
    "fp64": (DT.FLOAT64, None, 1e-14),
    "fp16": (DT.FLOAT16, None, 1e-2),
    "bf16": (DT.BFLOAT16, None, 1e-2),
}
SHAPES = [(1, 1, 1), (1, 300, 1), (7, 13, 5), (67, 131, 45), (128, 128, 128),
          (129, 127, 131), (64, 8, 200), (200, 24, 64), (3000, 1000, 40), (40, 1000, 3000),
          (1, 2048, 700), (700, 2048, 1)]


def _math(backend):
    from cuda_backend.autotune import Autotuner
    from cuda_backend.cuda_math import CudaMath
    m = CudaMath(backend)
    return m, Autotuner


@pytest.fixture(scope="module")
def m(backend, tmp_path_factory):
    """A CudaMath whose autotuner writes to a temporary file; kernels compiled up front."""
    cm, Autotuner = _math(backend)
    cm._autotuner = Autotuner(backend, path=str(tmp_path_factory.mktemp("tune") / "t.json"))
    if cm.gpu:
        mm.warm_up(cm, workers=16)
    return cm


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float64 if dtype is DT.FLOAT64 else np.float32)


def to_dev(m, values, dtype):
    return m.from_numpy(values, dtype=dtype)


def poisoned(m, shape, dtype):
    out = m.create_tensor(shape, dtype)
    if out.size:
        if dtype is DT.BFLOAT16:
            host = np.full(shape, 0x7FC0, np.uint16)
        else:
            host = np.full(shape, np.nan, dtype.numpy_dtype)
        m.backend.copy_to_device(host, out)
    return out


def rel_err(out, ref, scale=None):
    """||out - ref|| / ||scale|| (scale defaults to ref: the norm-wise relative error)."""
    ref = np.asarray(ref, np.float64)
    out = np.asarray(out, np.float64)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), "non-finite output (unwritten or NaN elements)"
    denom = np.linalg.norm(ref if scale is None else scale)
    return np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0)


def reference(m, a, b):
    """(A @ B, |A| @ |B|) in float64 from the device's (rounded) inputs."""
    a64 = m.to_numpy(a).astype(np.float64)
    b64 = m.to_numpy(b).astype(np.float64)
    return np.matmul(a64, b64), np.matmul(np.abs(a64), np.abs(b64))


def check(m, fam, a_shape, b_shape, rng, out_poison=True):
    """a @ b on the device against float64 NumPy of the (rounded) device inputs."""
    dtype, prec, bound = FAMILIES[fam]
    a = to_dev(m, rand(rng, a_shape, dtype), dtype)
    b = to_dev(m, rand(rng, b_shape, dtype), dtype)
    ref, scale = reference(m, a, b)
    out = poisoned(m, ref.shape, dtype) if out_poison else None
    res = mm.matmul(m, a, b, prec, out=out)
    assert res.shape == ref.shape and res.dtype is dtype
    if out is not None:
        assert res is out
    err = rel_err(m.to_numpy(res), ref, scale)
    assert err <= bound, f"{fam} {a_shape}@{b_shape}: relative error {err:.3g} > {bound:.3g}"
    return err


# -- anywhere: shape rules, precision, config lists ---------------------------------------
def test_plan_shapes_2d_batched_broadcast_and_1d():
    p = mm.plan_shapes((5, 7), (7, 3))
    assert (p.batch, p.M, p.N, p.K, p.out_shape) == (1, 5, 3, 7, (5, 3))
    p = mm.plan_shapes((4, 5, 7), (4, 7, 3))
    assert (p.batch, p.stride_a, p.stride_b, p.out_shape) == (4, 35, 21, (4, 5, 3))
    p = mm.plan_shapes((4, 5, 7), (7, 3))
    assert (p.stride_a, p.stride_b, p.out_shape) == (35, 0, (4, 5, 3))
    p = mm.plan_shapes((1, 5, 7), (4, 7, 3))
    assert (p.stride_a, p.stride_b, p.out_shape) == (0, 21, (4, 5, 3))
    p = mm.plan_shapes((5, 7), (4, 7, 3))
    assert (p.stride_a, p.stride_b, p.out_shape) == (0, 21, (4, 5, 3))
    assert mm.plan_shapes((7,), (7, 3)).out_shape == (3,)
    assert mm.plan_shapes((5, 7), (7,)).out_shape == (5,)
    assert mm.plan_shapes((7,), (7,)).out_shape == ()
    assert mm.plan_shapes((2, 3, 5, 7), (7, 4)).out_shape == (2, 3, 5, 4)
    assert mm.plan_shapes((0, 7), (7, 3)).out_shape == (0, 3)
    assert mm.plan_shapes((5, 0), (0, 3)).K == 0


def test_plan_shapes_errors_name_both_shapes():
    with pytest.raises(ShapeMismatchError, match=r"\(5, 7\).*\(6, 3\)"):
        mm.plan_shapes((5, 7), (6, 3))
    with pytest.raises(ShapeMismatchError, match=r"\(2, 5, 7\).*\(2, 8, 3\)"):
        mm.plan_shapes((2, 5, 7), (2, 8, 3))
    with pytest.raises(ShapeMismatchError, match=r"\(2, 5, 7\).*\(3, 7, 3\)"):
        mm.plan_shapes((2, 5, 7), (3, 7, 3))
    with pytest.raises(InvalidArgumentError, match="at least 1 dimension"):
        mm.plan_shapes((), (3, 3))
    with pytest.raises(InvalidArgumentError, match="partial batch"):
        mm.plan_shapes((2, 1, 5, 7), (1, 3, 7, 4))


@pytest.mark.parametrize("prec, want", [(None, None), ("fp32", "fp32"), ("highest", "fp32"),
                                        ("TF32", "tf32"), ("tf32", "tf32")])
def test_precision_names(prec, want):
    assert mm.normalize_precision(prec, DT.FLOAT32) == want


@pytest.mark.parametrize("prec", ["fp16", "medium", "", 3, True])
def test_bad_precision_raises(prec):
    with pytest.raises(InvalidArgumentError, match="precision must be"):
        mm.normalize_precision(prec, DT.FLOAT32)


def test_tf32_only_for_float32():
    with pytest.raises(InvalidArgumentError, match="float32 operands only"):
        mm.normalize_precision("tf32", DT.FLOAT64)


def test_template_variants_cover_every_candidate():
    variants = mm.template_variants()
    keys = {t: [tuple(sorted(p.items())) for p in sets] for t, sets in variants.items()}
    # (the cluster kernel's variants are counted by test_cluster_variants_are_the_configs, the
    # 16-bit wgmma kernel's by test_wgmma16_configs_render_for_sm_90a, the TMA kernel's by
    # test_tma16_configs_render_for_sm_90a)
    assert 20 <= sum(len(v) for t, v in keys.items()
                     if t not in (mm.SKINNY_TEMPLATE, mm.WGMMA16_TEMPLATE,
                                  mm.TMA16_TEMPLATE)) <= 104
    from cuda_backend.kernels import dtype_params
    for dt, prec in ((DT.FLOAT32, None), (DT.FLOAT32, "ieee"), (DT.FLOAT64, None),
                     (DT.FLOAT32, "tf32"), (DT.FLOAT16, None), (DT.BFLOAT16, None)):
        family, table = mm.gemm_family(dt, prec)
        for cls in table:
            for vec in (True, False):
                for cfg in mm.candidates(dt, prec, cls, vec):
                    if cfg.get("tma16"):
                        params = mm.tma16_params(dt, cfg)
                        assert tuple(sorted(params.items())) in keys[mm.TMA16_TEMPLATE]
                        continue
                    if cfg.get("wgmma16"):
                        params = mm.wgmma16_params(dt, cfg)
                        assert tuple(sorted(params.items())) in keys[mm.WGMMA16_TEMPLATE]
                        continue
                    if cfg.get("wgmma"):
                        params = mm.wgmma_params(cfg)
                        assert tuple(sorted(params.items())) in keys[mm.WGMMA_TEMPLATE]
                        continue
                    template = mm.config_template(cfg, family)   # (x3: mma, vec only)
                    assert vec or not cfg.get("x3")
                    assert template == mm.DMMA_TEMPLATE if cfg.get("dmma") else True
                    params = {**dtype_params(dt), **cfg, "vec": vec}
                    if template == mm.SIMT_TEMPLATE:
                        params["kind"] = "gemm"
                    assert tuple(sorted(params.items())) in keys[template], params


def test_configs_are_consistent():
    for cfg in mm.all_configs(DT.FLOAT32, "ieee") + mm.all_configs(DT.FLOAT64, None):
        if cfg.get("dmma"):   # (matmul_dmma.cu.j2's static_asserts; 227 KB per block)
            assert cfg["bm"] % cfg["wm"] == 0 and cfg["bn"] % cfg["wn"] == 0
            assert cfg["wm"] % 16 == 0 and cfg["wn"] % 8 == 0 and cfg["bk"] % 16 == 0
            assert cfg["bn"] % 16 == 0 and cfg["stages"] >= 2
            threads = (cfg["bm"] // cfg["wm"]) * (cfg["bn"] // cfg["wn"]) * 32
            assert threads <= 1024
            assert mm.dmma_smem(cfg) * cfg["min_blocks"] <= 227 * 1024
            continue
        threads = (cfg["bm"] // cfg["tm"]) * (cfg["bn"] // cfg["tn"])
        assert threads % 32 == 0 and threads <= 1024
        warp_m, warp_n = cfg["wtm"] * cfg["tm"], (32 // cfg["wtm"]) * cfg["tn"]
        assert cfg["bm"] % warp_m == 0 and cfg["bn"] % warp_n == 0
    # float32's default: the SIMT configs ("ieee") and the x3 GEMM ones, mma configs
    x3 = [c for c in mm.all_configs(DT.FLOAT32, None) if c.get("x3")]
    assert x3 == mm.X3_GEMM and all(c in mm.LINEAR_MMA_F32X3 for c in x3)
    assert [c for c in mm.all_configs(DT.FLOAT32, None) if not c.get("x3")] == \
        mm.all_configs(DT.FLOAT32, "ieee")
    for dt, prec in ((DT.FLOAT32, "tf32"), (DT.FLOAT16, None), (DT.FLOAT32, None)):
        for cfg in mm.all_configs(dt, prec):
            if dt is DT.FLOAT32 and prec is None and not cfg.get("x3"):
                continue
            if cfg.get("wgmma"):
                assert cfg["bm"] in (64, 128) and cfg["bn"] % 16 == 0 and cfg["bn"] <= 256
                assert mm.wgmma_smem(cfg) <= 227 * 1024 and cfg["stages"] >= 2
                continue
            if cfg.get("tma16"):   # (the template's static_asserts: 227 KB per block)
                assert (cfg["bm"], cfg["bn"]) in ((128, 64), (128, 128), (128, 192), (128, 256),
                                                  (256, 128))
                assert 3 <= cfg["stages"] <= 7 and cfg["group_m"] >= 1
                assert mm.wgmma_smem(cfg) + 1024 <= 227 * 1024
                continue
            if cfg.get("wgmma16"):   # (the template's static_asserts; 228 KB per SM)
                assert cfg["bm"] == 128 and cfg["bn"] in (128, 256) and cfg["stages"] >= 3
                assert mm.wgmma_smem(cfg) <= 227 * 1024
                assert (mm.wgmma_smem(cfg) + 1024) * cfg["min_blocks"] <= 228 * 1024
                continue
            smem = cfg["stages"] * (cfg["bm"] + cfg["bn"]) * cfg["bk"] * dt.itemsize
            assert smem <= 227 * 1024
            assert cfg["bm"] % cfg["wm"] == 0 and cfg["bn"] % cfg["wn"] == 0
            if cfg["frag_pipe"]:
                assert cfg["stages"] >= 3 and (cfg["bk"] // (8 if dt.itemsize == 4 else 16)) % 2 == 0


def test_dmma_configs_are_float64_plain_gemm_candidates():
    """The DMMA configs (matmul_dmma.cu.j2) are float64 GEMM candidates in every shape class,
    rendered for both alignments, never an A-transposed or linear-layer config, split as
    the x3 GEMMs, and run only where compute capability >= 9.0 (mma.m16n8k16.f64)."""
    from types import SimpleNamespace
    dm = [c for c in mm.all_configs(DT.FLOAT64, None) if c.get("dmma")]
    assert dm and all(mm.config_template(c, mm.SIMT_TEMPLATE) == mm.DMMA_TEMPLATE for c in dm)
    assert all(c in mm.SCALAR_OK for c in dm)
    for cls in ("large", "medium", "skinny", "small"):
        assert any(c.get("dmma") for c in mm.candidates(DT.FLOAT64, None, cls, True))
    assert not any(c.get("dmma") for c in mm.tn_configs(DT.FLOAT64, None, True))
    assert not any(c.get("dmma") for c in mm.linear_configs(DT.FLOAT64, None, True))
    assert not any(c.get("dmma") for dt in (DT.FLOAT32, DT.FLOAT16, DT.BFLOAT16)
                   for c in mm.all_configs(dt, None))
    p = mm.plan_shapes((512, 512), (512, 512))
    pairs = mm.split_candidates(dm, p, "large", 132)   # (config, split) as the x3 ones
    assert all(c.get("split", 0) >= 1 for c in pairs)
    assert [{k: v for k, v in c.items() if k != "split"} for c in pairs if c["split"] == 1] == dm
    assert all(mm.takes_k_chunk(mm.DMMA_TEMPLATE, c) for c in dm)
    assert mm.template_runs_on(mm.DMMA_TEMPLATE, SimpleNamespace(compute_capability=(9, 0)))
    assert not mm.template_runs_on(mm.DMMA_TEMPLATE, SimpleNamespace(compute_capability=(8, 0)))
    for c in dm:
        assert mm.dmma_smem(c) == c["stages"] * (c["bm"] * (c["bk"] + 2) + c["bk"] * c["bn"]) * 8


def test_shape_class_and_split_count():
    p = mm.plan_shapes((4096, 4096), (4096, 4096))
    assert mm.shape_class(p, 132) == "large"
    assert mm.split_count(mm.S_128x128x8_16x8, p, 132) == 1
    p = mm.plan_shapes((8192, 8192), (8192, 64))
    assert mm.shape_class(p, 132) == "skinny"
    s = mm.split_count(mm.S_64x64x8, p, 132)
    assert 2 <= s <= 16
    assert mm.shape_class(mm.plan_shapes((1000, 1000), (1000, 1000)), 132) == "medium"
    assert mm.shape_class(mm.plan_shapes((7, 13), (13, 5)), 132) == "small"


def test_split_candidates_expand_where_split_k_is_in_play():
    """The SIMT GEMM's autotuner candidates are (config, split) pairs: the modelled split
    first, then 1, 2, 3, 4, 6, 8 capped by K // 256, 16 and max_z // batch, one per
    effective split; where split-K is out of play only the modelled count."""
    for shape, cls_want in ((((1000, 1000), (1000, 1000)), "medium"),
                            (((64, 8192), (8192, 8192)), "skinny"),
                            (((1023, 1025), (1025, 997)), "medium")):
        p = mm.plan_shapes(*shape)
        cls = mm.shape_class(p, 132)
        assert cls == cls_want
        for vec in (True, False):
            cands = mm.candidates(DT.FLOAT32, "ieee", cls, vec)
            pairs = mm.split_candidates(cands, p, cls, 132)
            for c in cands:
                splits = [x["split"] for x in pairs if {k: v for k, v in x.items()
                                                        if k != "split"} == c]
                assert splits[0] == mm.split_count(c, p, 132)
                assert len(splits) > 1 and 1 in splits
                assert len(set(mm.effective_split(c, p.K, s) for s in splits)) == len(splits)
                assert max(splits) <= min(p.K // 256, 16)
    p = mm.plan_shapes((1000, 1000), (1000, 1000))
    assert {x["split"] for x in mm.split_candidates([mm.S_128x64x8_q2], p, "medium", 132)} \
        == {1, 2, 3}
    # max_z // batch caps the count (split z and batch share the grid's z)
    p = mm.plan_shapes((3, 300, 8192), (3, 8192, 300))
    assert max(mm.split_options(mm.S_64x64x8_q2, p, "medium", 132, max_z=6)) <= 2
    # 4096^3 fills the GPU: no split-K, one candidate per config (x3 ones too)
    p = mm.plan_shapes((4096, 4096), (4096, 4096))
    cands = mm.candidates(DT.FLOAT32, None, "large", True)
    assert any(c.get("x3") for c in cands)
    assert mm.split_candidates(cands, p, "large", 132) == [{**c, "split": 1} for c in cands]
    # K < 512: never split
    p = mm.plan_shapes((64, 500), (500, 64))
    assert mm.split_options(mm.S_32x64x16, p, "small", 132) == [1]


def test_split_key_is_not_a_template_parameter():
    """run_config takes the autotuner's "split" out before rendering: the kernel is the
    config's own, template_variants is unchanged, and the split count is the launched one."""
    import types
    launches, rendered = [], []

    class Backend:
        def get_device_info(self, dev):
            return types.SimpleNamespace(multiprocessor_count=132,
                                         max_grid_dims=(2**31 - 1, 65535, 65535))

        def launch_kernel(self, name, grid, *args, block_size=None, shared_mem=0,
                          device_id=0):
            launches.append((name, grid, args, shared_mem))

        def empty(self, shape, dtype, dev):
            return types.SimpleNamespace(free=lambda: None, shape=shape)

    class Math:
        backend = Backend()

        def kernel(self, template, dev, **params):
            rendered.append(params)
            return types.SimpleNamespace(name=f"k{len(rendered)}", num_regs=128)

    before = mm.template_variants()
    m = Math()
    p = mm.plan_shapes((1000, 1000), (1000, 1000))
    keys = {tuple(sorted(v.items())) for v in before[mm.SIMT_TEMPLATE]}
    for cfg in (mm.S_128x64x8_q2, mm.S_128x64x16_s3):
        for split in (1, 3):
            launches.clear()
            mm.run_config(m, mm.SIMT_TEMPLATE, {**cfg, "split": split}, "a", "b", "out", p,
                          DT.FLOAT32, True, 0)
            gemm = [r for r in rendered if r.get("kind") == "gemm"]
            assert all("split" not in r for r in gemm)
            assert tuple(sorted(mm.simt_params(DT.FLOAT32, cfg, True).items())) in keys
            grid, smem = launches[0][1], launches[0][3]
            assert grid[2] == split
            assert smem == mm.simt_smem(cfg) and (smem > 0) == (cfg["stages"] > 0)
            assert len(launches) == (2 if split > 1 else 1)   # + the split-K reduce
    assert mm.template_variants() == before


def test_tf32_tune_key_has_the_batch_bucket():
    """TF32 choices are keyed by the batch's bucket as well (a choice timed at batch 2 is
    not reused at 70000); the other families' keys are unchanged."""
    p2 = mm.plan_shapes((2, 512, 512), (2, 512, 512))
    pbig = mm.plan_shapes((70000, 512, 512), (70000, 512, 512))
    assert mm.tune_key(p2, "large", True, "tf32") != mm.tune_key(pbig, "large", True, "tf32")
    for prec in (None, "fp32"):
        assert mm.tune_key(p2, "large", True, prec) == mm.tune_key(pbig, "large", True, prec) \
            == ["large", True, 19, 19, 9, True]


def test_tune_key_splits_output_octaves_in_half():
    """M and N are keyed by half octaves, K by octaves: 1536^2 and 2048^2 outputs choose
    their tiles apart (128x192 fills one wave at 1536^2 and is the slowest at 2048^2),
    1000 and 1024 share a choice, and K from 1025 to 2048 shares one."""
    def key(M, N, K):
        return mm.tune_key(mm.plan_shapes((M, K), (K, N)), "medium", True, None)
    assert key(1536, 1536, 1536) != key(2048, 2048, 2048)
    assert key(1536, 1536, 1536) != key(1536, 2048, 1536) != key(2048, 1536, 1536)
    assert key(1000, 1000, 1000) == key(1024, 1024, 1024)
    assert key(1536, 1536, 1100) == key(1536, 1536, 2048)
    for x in range(1, 5000):   # monotone, and one size's bucket differs from its octave's
        assert common.half_octave_bucket(x) <= common.half_octave_bucket(x + 1)
        assert common.half_octave_bucket(x) // 2 == common.size_bucket(x)


def test_run_config_batch_over_grid_z():
    """70000 matrices on a stand-in backend (grid z limit 65535): SIMT with split-K asked
    for, mma and wgmma (with its B transpose) launch with grid z within the limit, the
    launches of each kernel cover the batch once, later ones at offset matrices."""
    import types
    launches = []

    class Backend:
        def get_device_info(self, dev):
            return types.SimpleNamespace(multiprocessor_count=132,
                                         max_grid_dims=(2**31 - 1, 65535, 65535))

        def launch_kernel(self, name, grid, *args, block_size=None, shared_mem=0,
                          device_id=0):
            launches.append((name, grid, args))

        def empty(self, shape, dtype, dev):
            return types.SimpleNamespace(free=lambda: None, shape=shape, ptr=8 << 40)

    class Math:
        backend = Backend()

        def kernel(self, template, dev, **params):
            return types.SimpleNamespace(name=template, num_regs=128)

    a, b, out = (types.SimpleNamespace(ptr=k << 40) for k in (1, 2, 4))
    for template, cfg, (M, K, N), splits in (
            (mm.SIMT_TEMPLATE, mm.S_32x64x16, (3, 1024, 6), 3),
            (mm.MMA_TEMPLATE, mm.T_64x64x16, (3, 8, 6), None),
            (mm.WGMMA_TEMPLATE, mm.W_64x128_s3, (3, 8, 6), None)):
        p = mm.plan_shapes((70000, M, K), (70000, K, N))
        launches.clear()
        mm.run_config(Math(), template, cfg, a, b, out, p, DT.FLOAT32, True, 0, splits=splits)
        assert all(g[2] <= 65535 for _, g, _ in launches)
        gemm = [(g, args) for name, g, args in launches if name == template]
        assert [g[2] for g, _ in gemm] == [65535, 70000 - 65535]
        a1, b1, c1 = gemm[1][1][:3]
        b_base, b_stride = (8 << 40, N * K) if template == mm.WGMMA_TEMPLATE else \
            (b.ptr, p.stride_b)
        assert (a1, b1, c1) == (a.ptr + 65535 * M * K * 4, b_base + 65535 * b_stride * 4,
                                out.ptr + 65535 * M * N * 4)
        if template == mm.WGMMA_TEMPLATE:   # B's planes transposed first, in two launches
            tr = [g[2] for name, g, _ in launches if name != template]
            assert tr == [65535, 70000 - 65535]


def test_multistage_configs():
    """Multistage SIMT configs: vec float32 only (never unaligned; the GEMM and the linear
    layer), shared memory within the opt-in limit, copies tiling the block."""
    ms = [c for c in mm.all_configs(DT.FLOAT32, "ieee") + mm.SIMT_F32_EXTRA if c["stages"]]
    assert len(ms) >= 3 and any(c in mm.SIMT_F32["large"] for c in ms)
    assert mm.SIMT_F32["large"][0]["stages"]      # the swept winner comes first
    for c in ms:
        assert c not in mm.SCALAR_OK
        # the linear layer (b_trans) pads B's k-major rows like A's
        assert mm.simt_smem(c, 4, True) == c["stages"] * c["bk"] * (c["bm"] + c["bn"] + 8) * 4
        assert mm.simt_smem(c, 4, True) * c["min_blocks"] <= 227 * 1024
        threads = (c["bm"] // c["tm"]) * (c["bn"] // c["tn"])
        assert c["bk"] % 8 == 0 and (threads // 32) % (c["bk"] // 8) == 0
        assert mm.simt_smem(c) == c["stages"] * c["bk"] * (c["bm"] + 4 + c["bn"]) * 4
        assert mm.simt_smem(c) * c["min_blocks"] <= 227 * 1024
    for vec in (True, False):
        for cls in mm.SIMT_F32:
            cands = mm.candidates(DT.FLOAT32, "ieee", cls, vec)
            assert cands
            if not vec:
                assert not any(c.get("stages") for c in cands)


def test_round_tf32_matches_rna():
    x = np.array([1.0, 1.0 + 2**-11, 1.0 + 2**-10 + 2**-11, -1.0 - 2**-11, np.inf, 3e38],
                 np.float32)
    r = mm.round_tf32(x)
    assert r[0] == 1.0 and r[1] == 1.0 + 2**-10 and r[2] == 1.0 + 2**-9
    assert r[3] == -1.0 - 2**-10 and np.isinf(r[4]) and np.isfinite(r[5])
    assert (r.view(np.uint32)[np.isfinite(r)] & 0x1FFF == 0).all()


# -- fallback mode (this process has no GPU) -----------------------------------------------
@pytest.fixture
def fm(backend):
    if backend.is_available:
        pytest.skip("fallback-mode tests run where this process has no GPU")
    cm, _ = _math(backend)
    return cm


@pytest.mark.parametrize("fam", list(FAMILIES))
@pytest.mark.parametrize("a_shape, b_shape", [((7, 13), (13, 5)), ((3, 4, 6), (6, 2)),
                                              ((1, 4, 6), (3, 6, 2)), ((6,), (6, 2)),
                                              ((4, 6), (6,))])
def test_fallback_matches_numpy(fm, fam, a_shape, b_shape):
    check(fm, fam, a_shape, b_shape, np.random.default_rng(5681))


def test_fallback_tf32_rounds_inputs(fm):
    rng = np.random.default_rng(9882)
    av, bv = rand(rng, (16, 64), DT.FLOAT32), rand(rng, (64, 8), DT.FLOAT32)
    a, b = fm.from_numpy(av), fm.from_numpy(bv)
    ref = mm.round_tf32(av).astype(np.float64) @ mm.round_tf32(bv).astype(np.float64)
    got = fm.to_numpy(mm.matmul(fm, a, b, "tf32"))
    assert rel_err(got, ref) < 1e-5
    assert rel_err(fm.to_numpy(mm.matmul(fm, a, b)), av.astype(np.float64) @ bv) < 1e-5


def test_fallback_errors_and_zero_sizes(fm):
    a = fm.from_numpy(np.ones((3, 4), np.float32))
    with pytest.raises(ShapeMismatchError, match=r"\(3, 4\).*\(3, 4\)"):
        mm.matmul(fm, a, a)
    with pytest.raises(DTypeMismatchError, match="float32 and float64"):
        mm.matmul(fm, a, fm.from_numpy(np.ones((4, 2))))
    with pytest.raises(InvalidArgumentError, match="precision"):
        mm.matmul(fm, a, fm.from_numpy(np.ones((4, 2), np.float32)), precision="bf16")
    z = mm.matmul(fm, fm.from_numpy(np.ones((3, 0), np.float32)),
                  fm.from_numpy(np.ones((0, 5), np.float32)))
    assert z.shape == (3, 5) and (fm.to_numpy(z) == 0).all()
    assert mm.matmul(fm, fm.from_numpy(np.ones((0, 4), np.float32)),
                     fm.from_numpy(np.ones((4, 5), np.float32))).shape == (0, 5)


# -- GPU -------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("fam", list(FAMILIES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_shapes(m, fam, shape):
    M, K, N = shape
    check(m, fam, (M, K), (K, N), np.random.default_rng(6377))


@gpu
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_gpu_1000_cubed(m, fam):
    check(m, fam, (1000, 1000), (1000, 1000), np.random.default_rng(6677))


@gpu
@pytest.mark.large
def test_gpu_fp32_4096_is_true_fp32(m):
    """4096^3 float32 default path (3xTF32 or CUDA cores), checked on sampled rows: error
    far below TF32's."""
    rng = np.random.default_rng(1057)
    av = rand(rng, (4096, 4096), DT.FLOAT32)
    bv = rand(rng, (4096, 4096), DT.FLOAT32)
    a, b = m.from_numpy(av), m.from_numpy(bv)
    out = poisoned(m, (4096, 4096), DT.FLOAT32)
    mm.matmul(m, a, b, out=out)
    got = m.to_numpy(out)
    assert np.isfinite(got).all()
    rows = rng.choice(4096, 96, replace=False)
    ref = av[rows].astype(np.float64) @ bv.astype(np.float64)
    err = rel_err(got[rows], ref)
    assert err < 2e-5, err   # ~1.5e-6 on CUDA cores, ~8e-6 3xTF32; TF32 would give ~3e-4


@gpu
@pytest.mark.parametrize("fam", list(FAMILIES))
@pytest.mark.parametrize("a_shape, b_shape", [
    ((3, 67, 45), (3, 45, 29)), ((3, 67, 45), (45, 29)), ((1, 67, 45), (3, 45, 29)),
    ((67, 45), (3, 45, 29)), ((2, 3, 33, 17), (17, 40)), ((45,), (45, 29)),
    ((67, 45), (45,)), ((45,), (45,)), ((5, 130, 260), (5, 260, 136))])
def test_gpu_batched_and_broadcast(m, fam, a_shape, b_shape):
    check(m, fam, a_shape, b_shape, np.random.default_rng(2736))


@gpu
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_gpu_misaligned_pointers(m, fam):
    """Operands and output starting one element past a 16-byte boundary take the scalar path."""
    dtype, prec, bound = FAMILIES[fam]
    rng = np.random.default_rng(5210)
    M, K, N = 70, 136, 72   # vector-friendly sizes, so only the pointers are misaligned

    def shifted(shape, values=None):
        size = int(np.prod(shape))
        base = m.create_tensor((size + 8,), dtype)
        t = CudaTensor(shape, dtype, base.device_id, base.ptr + dtype.itemsize, owner=base)
        if values is not None:
            host = to_bfloat16_bits(values) if dtype is DT.BFLOAT16 else \
                values.astype(dtype.numpy_dtype)
            m.backend.copy_to_device(np.ascontiguousarray(host).reshape(shape), t)
        return t
    av, bv = rand(rng, (M, K), dtype), rand(rng, (K, N), dtype)
    a, b = shifted((M, K), av), shifted((K, N), bv)
    assert not mm.is_vec_ok(a, b, a, mm.plan_shapes(a.shape, b.shape))
    out = shifted((M, N))
    poison = np.full((M, N), 0x7FC0, np.uint16) if dtype is DT.BFLOAT16 else \
        np.full((M, N), np.nan, dtype.numpy_dtype)
    m.backend.copy_to_device(poison, out)
    mm.matmul(m, a, b, prec, out=out)
    ref, scale = reference(m, a, b)
    assert rel_err(m.to_numpy(out), ref, scale) <= bound


@gpu
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_gpu_every_candidate_config_is_correct(m, fam):
    """Every tile config the autotuner can pick, aligned (vec) and not, with split-K forced
    for the SIMT kernels, on odd shapes: a fast-but-wrong config can never win."""
    dtype, prec, bound = FAMILIES[fam]
    template, _ = mm.gemm_family(dtype, prec)
    rng = np.random.default_rng(7634)
    dev = m.backend.current_device
    n_vec = 130 if dtype is DT.FLOAT64 else 136   # N % 4 == 2 for float64's 2-wide vectors
    for vec, (M, K, N) in ((True, (131, 264, n_vec)), (False, (131, 197, 133))):
        av, bv = rand(rng, (3, M, K), dtype), rand(rng, (K, N), dtype)
        a, b = to_dev(m, av, dtype), to_dev(m, bv, dtype)
        ref, scale = reference(m, a, b)
        p = mm.plan_shapes(a.shape, b.shape)
        cfgs = [c for c in mm.all_configs(dtype, prec) if vec or c in mm.SCALAR_OK]
        if not mm.has_wgmma(m.backend.get_device_info(dev)):
            cfgs = [c for c in cfgs if not c.get("wgmma")]
        if not mm.runs_here(m, mm.DMMA_TEMPLATE, dev):
            cfgs = [c for c in cfgs if not c.get("dmma")]
        for cfg in cfgs:
            for splits in ((1, 3) if template == mm.SIMT_TEMPLATE or cfg.get("dmma")
                           else (None,)):
                out = poisoned(m, ref.shape, dtype)
                assert mm.is_vec_ok(a, b, out, p) is vec
                mm.run_config(m, mm.config_template(cfg, template), cfg, a, b, out, p, dtype,
                              vec, dev, splits=splits)
                err = rel_err(m.to_numpy(out), ref, scale)
                assert err <= bound, (cfg, vec, splits, err)


@gpu
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_gpu_zero_sizes(m, fam):
    dtype, prec, _ = FAMILIES[fam]
    rng = np.random.default_rng(8488)
    a = to_dev(m, rand(rng, (5, 0), dtype), dtype)
    b = to_dev(m, rand(rng, (0, 7), dtype), dtype)
    out = poisoned(m, (5, 7), dtype)
    assert mm.matmul(m, a, b, prec, out=out) is out
    assert (m.to_numpy(out) == 0).all()
    z = mm.matmul(m, to_dev(m, rand(rng, (0, 4), dtype), dtype),
                  to_dev(m, rand(rng, (4, 6), dtype), dtype), prec)
    assert z.shape == (0, 6) and m.to_numpy(z).shape == (0, 6)
    z = mm.matmul(m, to_dev(m, rand(rng, (3, 4), dtype), dtype),
                  to_dev(m, rand(rng, (0, 4, 6), dtype), dtype), prec)
    assert z.shape == (0, 3, 6)


@gpu
def test_gpu_errors(m):
    rng = np.random.default_rng(1653)
    a = to_dev(m, rand(rng, (5, 7), DT.FLOAT32), DT.FLOAT32)
    b = to_dev(m, rand(rng, (6, 3), DT.FLOAT32), DT.FLOAT32)
    with pytest.raises(ShapeMismatchError, match=r"\(5, 7\).*\(6, 3\)"):
        m.matrix_multiply(a, b)
    c = to_dev(m, rand(rng, (7, 3), DT.FLOAT64), DT.FLOAT64)
    with pytest.raises(DTypeMismatchError, match="float32 and float64"):
        m.matrix_multiply(a, c)
    b2 = to_dev(m, rand(rng, (7, 3), DT.FLOAT32), DT.FLOAT32)
    for bad in ("fp16", "medium", 1):
        with pytest.raises(InvalidArgumentError, match="precision must be"):
            m.matrix_multiply(a, b2, precision=bad)
    with pytest.raises(InvalidArgumentError, match="float32 operands only"):
        mm.matmul(m, c, to_dev(m, rand(rng, (3, 4), DT.FLOAT64), DT.FLOAT64), "tf32")
    ints = m.from_numpy(np.ones((7, 3), np.int32))
    with pytest.raises(DTypeMismatchError):
        m.matrix_multiply(m.from_numpy(np.ones((5, 7), np.int32)), ints)
    with pytest.raises(InvalidArgumentError, match="CudaTensor"):
        m.matrix_multiply(np.ones((5, 7), np.float32), b2)
    with pytest.raises(ShapeMismatchError, match="out has shape"):
        mm.matmul(m, a, b2, out=m.create_tensor((5, 4)))
    with pytest.raises(InvalidArgumentError, match="overlaps"):
        sq = to_dev(m, rand(rng, (7, 7), DT.FLOAT32), DT.FLOAT32)
        mm.matmul(m, sq, sq, out=sq)
    dead = to_dev(m, rand(rng, (7, 3), DT.FLOAT32), DT.FLOAT32)
    dead.free()
    with pytest.raises(TensorFreedError):
        m.matrix_multiply(a, dead)
    with pytest.raises(InvalidArgumentError, match="at least 1 dimension"):
        m.matrix_multiply(to_dev(m, np.float32(2.0).reshape(()), DT.FLOAT32), b2)


@gpu
def test_gpu_fp32_default_differs_from_tf32(m):
    """The default float32 path is float32-accurate (3xTF32 or CUDA cores); precision='tf32'
    really uses TF32."""
    rng = np.random.default_rng(9376)
    av, bv = rand(rng, (256, 1024), DT.FLOAT32), rand(rng, (1024, 256), DT.FLOAT32)
    a, b = m.from_numpy(av), m.from_numpy(bv)
    ref = av.astype(np.float64) @ bv.astype(np.float64)
    e32 = rel_err(m.to_numpy(m.matrix_multiply(a, b)), ref)
    etf = rel_err(m.to_numpy(m.matrix_multiply(a, b, precision="tf32")), ref)
    assert e32 < 1e-5 and 5e-5 < etf < 1e-3, (e32, etf)


@gpu
@settings(max_examples=examples(30), deadline=None)
@given(M=st.integers(1, 300), K=st.integers(1, 300), N=st.integers(1, 300),
       fam=st.sampled_from(list(FAMILIES)), batch=st.sampled_from([0, 1, 3]))
def test_gpu_property_random_shapes(m, M, K, N, fam, batch):
    a_shape = (batch, M, K) if batch else (M, K)
    check(m, fam, a_shape, (K, N), np.random.default_rng(2191))


@gpu
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_gpu_batch_over_grid_z(m, fam):
    """70000 matrices, more than the grid's z holds: the public path with a full and a
    broadcast B, and every config element loads allow, against float64 NumPy within the
    family's bound."""
    dtype, prec, bound = FAMILIES[fam]
    rng = np.random.default_rng(70000)
    check(m, fam, (70000, 3, 5), (70000, 5, 2), rng)
    check(m, fam, (70000, 3, 5), (5, 2), rng)
    template, _ = mm.gemm_family(dtype, prec)
    dev = m.backend.current_device
    a = to_dev(m, rand(rng, (70000, 3, 5), dtype), dtype)
    b = to_dev(m, rand(rng, (70000, 5, 2), dtype), dtype)
    ref, scale = reference(m, a, b)
    p = mm.plan_shapes(a.shape, b.shape)
    for cfg in [c for c in mm.all_configs(dtype, prec) if c in mm.SCALAR_OK and
                (not c.get("dmma") or mm.runs_here(m, mm.DMMA_TEMPLATE, dev))]:
        out = poisoned(m, ref.shape, dtype)
        assert not mm.is_vec_ok(a, b, out, p)
        mm.run_config(m, mm.config_template(cfg, template), cfg, a, b, out, p, dtype, False,
                      dev)
        err = rel_err(m.to_numpy(out), ref, scale)
        assert err <= bound, (cfg, err)
        out.free()


# -- wgmma (Hopper) TF32 ----------------------------------------------------------------------
def test_wgmma_configs_render_for_sm_90a():
    """Each wgmma config is a TF32 candidate, renders without #error, and is built for
    sm_90a (kernels.TEMPLATE_ARCH); the transpose variants include the TF32-rounding one."""
    from cuda_backend.kernels import TEMPLATE_ARCH, KernelGenerator
    gen = KernelGenerator(backend=object())
    w = [c for c in mm.all_configs(DT.FLOAT32, "tf32") if c.get("wgmma")]
    assert w and TEMPLATE_ARCH[mm.WGMMA_TEMPLATE] == "sm_90a"
    assert not any(c.get("wgmma") for dt, prec in ((DT.FLOAT32, None), (DT.FLOAT16, None))
                   for c in mm.all_configs(dt, prec))
    for c in w:
        _, src = gen.render_kernel(mm.WGMMA_TEMPLATE, **mm.wgmma_params(c))
        assert f"m64n{c['bn']}k8.f32.tf32.tf32" in src and "#error" not in src
        assert "fence.proxy.async.shared::cta" in src
    from cuda_backend.ops import transpose as tr
    assert any(p.get("round_tf32") for p in tr.template_variants()[tr.TEMPLATE])


@gpu
@pytest.mark.parametrize("shape", [(1, 4, 1), (77, 36, 129), (131, 264, 136), (64, 4096, 72),
                                   (3, 130, 300, 33), (2, 257, 1000, 515)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_wgmma_configs(m, shape):
    """Every wgmma config through run_config (B transposed and rounded, then the kernel)
    into a poisoned output: odd M and N (tails of every tile), K = 4, batches, a broadcast
    B; the result equals the TF32 product of rounded inputs within float32 accumulation
    error, far inside the TF32 bound."""
    dev = m.backend.current_device
    if not mm.has_wgmma(m.backend.get_device_info(dev)):
        pytest.skip("wgmma needs a Hopper GPU (sm_90a)")
    rng = np.random.default_rng(4671)
    *batch, M, K, N = shape
    av = rand(rng, tuple(batch) + (M, K), DT.FLOAT32)
    bv = rand(rng, (K, N), DT.FLOAT32)
    a, b = to_dev(m, av, DT.FLOAT32), to_dev(m, bv, DT.FLOAT32)
    p = mm.plan_shapes(a.shape, b.shape)
    ra = mm.round_tf32(m.to_numpy(a)).astype(np.float64)
    rb = mm.round_tf32(m.to_numpy(b)).astype(np.float64)
    ref = ra @ rb
    scale = np.abs(ra) @ np.abs(rb)
    for cfg in [c for c in mm.all_configs(DT.FLOAT32, "tf32") if c.get("wgmma")] + \
            [mm.W_64x256_s4]:
        out = poisoned(m, ref.shape, DT.FLOAT32)
        mm.run_config(m, mm.WGMMA_TEMPLATE, cfg, a, b, out, p, DT.FLOAT32, True, dev)
        err = rel_err(m.to_numpy(out), ref, scale)
        assert err <= 2e-6, (cfg, shape, err)
        out.free()


@gpu
def test_gpu_wgmma_batched_b_and_public_path(m):
    """A full batch of B planes (each transposed on its own) through the wgmma kernel, and
    the public matrix_multiply(precision='tf32') at 1024^2 x 512 within the TF32 bound."""
    dev = m.backend.current_device
    if not mm.has_wgmma(m.backend.get_device_info(dev)):
        pytest.skip("wgmma needs a Hopper GPU (sm_90a)")
    rng = np.random.default_rng(3577)
    av, bv = rand(rng, (3, 65, 132), DT.FLOAT32), rand(rng, (3, 132, 70), DT.FLOAT32)
    a, b = to_dev(m, av, DT.FLOAT32), to_dev(m, bv, DT.FLOAT32)
    p = mm.plan_shapes(a.shape, b.shape)
    ref = mm.round_tf32(av).astype(np.float64) @ mm.round_tf32(bv).astype(np.float64)
    out = poisoned(m, ref.shape, DT.FLOAT32)
    mm.run_config(m, mm.WGMMA_TEMPLATE, mm.W_128x128_s3, a, b, out, p, DT.FLOAT32, True, dev)
    assert rel_err(m.to_numpy(out), ref, np.abs(ref) + 1e-3) <= 2e-6
    av, bv = rand(rng, (1024, 512), DT.FLOAT32), rand(rng, (512, 1024), DT.FLOAT32)
    got = m.to_numpy(m.matrix_multiply(to_dev(m, av, DT.FLOAT32), to_dev(m, bv, DT.FLOAT32),
                                       precision="tf32"))
    ref = av.astype(np.float64) @ bv.astype(np.float64)
    assert rel_err(got, ref, np.abs(av) @ np.abs(bv)) <= 1.5e-3


@gpu
def test_gpu_wgmma_batch_over_grid_z(m):
    """Every wgmma config on 70000 matrices, B full (70000 planes transposed) and
    broadcast, within float32 accumulation error of the TF32 product of the rounded inputs
    (the bound of test_gpu_wgmma_configs)."""
    dev = m.backend.current_device
    if not mm.has_wgmma(m.backend.get_device_info(dev)):
        pytest.skip("wgmma needs a Hopper GPU (sm_90a)")
    rng = np.random.default_rng(70001)
    for b_shape in ((70000, 8, 6), (8, 6)):
        a = to_dev(m, rand(rng, (70000, 3, 8), DT.FLOAT32), DT.FLOAT32)
        b = to_dev(m, rand(rng, b_shape, DT.FLOAT32), DT.FLOAT32)
        p = mm.plan_shapes(a.shape, b.shape)
        assert mm.wgmma_ok(a, p)
        ra = mm.round_tf32(m.to_numpy(a)).astype(np.float64)
        rb = mm.round_tf32(m.to_numpy(b)).astype(np.float64)
        ref, scale = ra @ rb, np.abs(ra) @ np.abs(rb)
        for cfg in [c for c in mm.all_configs(DT.FLOAT32, "tf32") if c.get("wgmma")]:
            out = poisoned(m, ref.shape, DT.FLOAT32)
            mm.run_config(m, mm.WGMMA_TEMPLATE, cfg, a, b, out, p, DT.FLOAT32, True, dev)
            err = rel_err(m.to_numpy(out), ref, scale)
            assert err <= 2e-6, (cfg, b_shape, err)
            out.free()


def _no_general_path(*args, **kwargs):
    raise AssertionError("the general path ran where the per-call plan should have")


@gpu
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_gpu_plan_path(m, fam, monkeypatch):
    """matrix_multiply twice per shape on fresh random inputs: the first call takes the
    general path (autotuning, then the plan is made), the second the plan (run_config made
    to raise); both within the family's bound. Odd shapes, a broadcast and a full batch,
    split-K sizes, 1-D, and a TF32 size of the wgmma classes; the result comes from a pool
    block poisoned (NaN) first."""
    dtype, prec, bound = FAMILIES[fam]
    rng = np.random.default_rng(9785)
    dev = m.backend.current_device
    for a_shape, b_shape in (((67, 45), (45, 29)), ((3, 33, 17), (17, 40)),
                             ((3, 130, 132), (3, 132, 70)), ((40, 1000), (1000, 30)),
                             ((45,), (45, 29)), ((2, 257, 516), (516, 300))):
        key = ("matmul", a_shape, b_shape, dtype, dtype, dev, dev, prec)
        m.plans.pop(key, None)
        for second in (False, True):
            a = to_dev(m, rand(rng, a_shape, dtype), dtype)
            b = to_dev(m, rand(rng, b_shape, dtype), dtype)
            ref, scale = reference(m, a, b)
            poisoned(m, ref.shape, dtype).free()
            with monkeypatch.context() as mp:
                if second:
                    mp.setattr("cuda_backend.ops.matmul_launch.run_config", _no_general_path)
                res = m.matrix_multiply(a, b, precision=prec)
            assert key in m.plans
            assert res.shape == ref.shape and res.dtype is dtype
            err = rel_err(m.to_numpy(res), ref, scale)
            assert err <= bound, f"{fam} {a_shape}@{b_shape} (plan: {second}): {err:.3g}"


# -- skinny M: split-K over blocks (matmul.SKINNY_F32) and the small-M split counts ------------
SKINNY_ODD = [(M, K, N) for M in (1, 7, 32, 63) for K in (5, 1000, 4097) for N in (3, 1025)]
SKINNY_ALIGNED = [(32, 4096, 1024), (32, 1024, 1024), (32, 1024, 4096), (1, 1000, 1024),
                  (63, 4096, 260), (7, 256, 36)]


def test_small_m_split_options_reach_more_blocks():
    """For M <= 64 the SIMT GEMM's split-K counts go up to 16 with K chunks >= 128 (one 32- or
    64-row tile of a 32 x 1024 output has 16 blocks per split); larger M keeps K // 256."""
    for (M, K, N), least in (((32, 1024, 1024), 8), ((32, 4096, 1024), 16), ((64, 2048, 512), 16)):
        p = mm.plan_shapes((M, K), (K, N))
        cls = mm.shape_class(p, 132)
        for c in mm.candidates(DT.FLOAT32, "ieee", cls, True):
            opts = mm.split_options(c, p, cls, 132)
            assert max(opts) >= least and max(opts) <= min(K // 128, 16), (c, opts)
            assert len(set(mm.effective_split(c, K, s) for s in opts)) == len(opts)
    p = mm.plan_shapes((65, 1024), (1024, 1024))
    for c in mm.candidates(DT.FLOAT32, "ieee", mm.shape_class(p, 132), True):
        assert max(mm.split_options(c, p, mm.shape_class(p, 132), 132)) <= 1024 // 256


class _SkinnyRecorder:
    """A CudaMath stand-in recording launches (kernel params, grid, shared memory, values;
    block shapes in `blocks`) and the autotuner's candidates; the autotuner picks the first
    candidate of `kind` ("skinny" or "cluster") if asked. cc: the device's compute
    capability (None: the device info has none, as before clusters)."""
    gpu = True

    def __init__(self, pick_skinny, cc=None, kind="skinny"):
        import types
        from cuda_backend.kernels import KernelGenerator
        rec = self
        self.launches, self.seen, self.kernels, self.blocks = [], [], {}, []
        self.generator = KernelGenerator(backend=object())
        self.next_ptr = 1 << 20
        extra = {} if cc is None else {"compute_capability": cc}

        class Backend:
            def get_device_info(self, dev):
                return types.SimpleNamespace(multiprocessor_count=132,
                                             max_grid_dims=(2**31 - 1, 65535, 65535), **extra)

            def empty(self, shape, dtype, dev=0):
                t = CudaTensor(tuple(shape), DT.from_any(dtype), 0, rec.next_ptr)
                rec.next_ptr += (t.nbytes // 256 + 2) * 256
                return t

            def launch_kernel(self, name, grid, *args, block_size=None, shared_mem=0,
                              device_id=0):
                values = [a.ptr if isinstance(a, CudaTensor) else a for a in args]
                rec.launches.append((rec.kernels[name], grid, shared_mem, values))
                rec.blocks.append(block_size)

        def pick(op, key, cands, run, device_id=0, repeats=3):
            rec.seen.append(list(cands))
            sk = [c for c in cands if c.get(kind)]
            return dict(sk[0] if pick_skinny and sk else cands[0])
        self.backend = Backend()
        self.autotuner = types.SimpleNamespace(pick=pick)

    def kernel(self, template, dev, **params):
        import types
        name, _ = self.generator.render_kernel(template, **dict(params))
        self.kernels[name] = params
        return types.SimpleNamespace(name=name, num_regs=128)


@pytest.mark.parametrize("shape", [(32, 4096, 1024), (32, 1024, 4096), (7, 1000, 1025),
                                   (63, 4097, 3)])
def test_matmul_skinny_candidates_and_launches(shape):
    """matrix_multiply's candidates for M <= 64: the SIMT (config, split) pairs and the skinny
    ones (matmul.skinny_candidates); with a skinny one chosen, its kernel (B as (K, N), vec by
    alignment) over (row tiles x column tiles, splits) with A, B, the workspace, M, N, K and
    the K chunk, then splitk_reduce of that workspace into out. M = 128: none skinny."""
    M, K, N = shape
    m = _SkinnyRecorder(True)
    a, b = m.backend.empty((M, K), DT.FLOAT32), m.backend.empty((K, N), DT.FLOAT32)
    out = mm.matmul(m, a, b)
    (cands,) = m.seen
    p = mm.plan_shapes((M, K), (K, N))
    sk = [c for c in cands if c.get("skinny")]
    assert sk == mm.skinny_candidates(DT.FLOAT32, None, p, 132) and sk
    assert all("bm" in c for c in cands if not c.get("skinny"))
    m.launches.clear()
    mm.matmul(m, a, b, out=out)
    (k1, grid1, smem1, v1), (k2, grid2, smem2, v2) = m.launches
    cfg = sk[0]
    vec = K % 4 == 0 and N % 4 == 0
    assert k1 == mm.skinny_params(DT.FLOAT32, cfg, vec, False)
    chunk, s = mm.skinny_chunk(cfg, K, cfg["split"])
    tiles_m, tiles_n = mm.skinny_tiles(cfg, p)
    assert grid1 == (tiles_m * tiles_n, s, 1) and smem1 == mm.skinny_smem(cfg, False)
    assert v1[:2] == [a.ptr, b.ptr] and v1[3:] == [M, N, K, chunk]
    assert k2["kind"] == "splitk_reduce" and v2 == [v1[2], out.ptr, M * N, s]
    m2 = _SkinnyRecorder(True)
    mm.matmul(m2, m2.backend.empty((128, K), DT.FLOAT32), m2.backend.empty((K, N), DT.FLOAT32))
    assert not any(c.get("skinny") for cands in m2.seen for c in cands)
    # TF32 and float64: no skinny candidates either
    for dtype, prec in ((DT.FLOAT32, "tf32"), (DT.FLOAT64, None)):
        assert mm.skinny_candidates(dtype, prec, p, 132) == []


def test_skinny_variants_render_for_both_layouts():
    """Each skinny variant renders without #error, names its layout's loads (16-byte copies
    only with vec) and its ring depth; the splitk_epilogue variant applies GELU."""
    from cuda_backend.kernels import KernelGenerator
    gen = KernelGenerator(backend=object())
    sets = [p for p in mm.template_variants()[mm.SIMT_TEMPLATE] if p["kind"] == "skinny"]
    assert len(sets) == 4 * len(mm.SKINNY_F32)
    for params in sets:
        _, src = gen.render_kernel(mm.SIMT_TEMPLATE, **params)
        assert "#error" not in src and f"#define STAGES {params['stages']}" in src
        assert ("cp_async16(dst, " in src) is params["vec"]
        assert ("cp_async4(dst + 4 * e, " in src) is not params["vec"]
        assert ("#define W_STAGE (BN * KS)" in src) is params["b_trans"]
    _, src = gen.render_kernel(mm.SIMT_TEMPLATE,
                               **mm.splitk_epilogue_params(DT.FLOAT32, "bias_gelu"))
    assert "gelu_tanh(s)" in src and "#error" not in src


@gpu
@pytest.mark.parametrize("cfg", mm.SKINNY_F32, ids=lambda c: "{mt}x{bn}x{bk}_t{tn}".format(**c))
def test_gpu_skinny_configs(m, cfg):
    """Every skinny config through run_config (split-K kernel, then splitk_reduce) on the odd
    shapes (element copies) and aligned ones (16-byte copies), at split counts 1, 3 and the
    autotuner's, into a poisoned output, within the float32 bound; the same call twice gives
    the same bits (fixed summation order, no atomics)."""
    dtype, prec, bound = FAMILIES["fp32"]
    rng = np.random.default_rng(4457)
    dev = m.backend.current_device
    for M, K, N in SKINNY_ODD + SKINNY_ALIGNED:
        a = to_dev(m, rand(rng, (M, K), dtype), dtype)
        b = to_dev(m, rand(rng, (K, N), dtype), dtype)
        ref, scale = reference(m, a, b)
        p = mm.plan_shapes(a.shape, b.shape)
        for splits in sorted({1, 3} | set(mm.skinny_split_options(cfg, p, 132))):
            out = poisoned(m, ref.shape, dtype)
            vec = mm.is_vec_ok(a, b, out, p)
            assert vec is ((M, K, N) in SKINNY_ALIGNED)
            mm.run_config(m, mm.SIMT_TEMPLATE, cfg, a, b, out, p, dtype, vec, dev,
                          splits=splits)
            got = m.to_numpy(out)
            err = rel_err(got, ref, scale)
            assert err <= bound, (cfg, (M, K, N), splits, vec, err)
            if splits == 3:
                again = poisoned(m, ref.shape, dtype)
                mm.run_config(m, mm.SIMT_TEMPLATE, {**cfg, "split": 3}, a, b, again, p, dtype,
                              vec, dev)
                assert np.array_equal(m.to_numpy(again), got)
                again.free()
            out.free()


@gpu
def test_gpu_skinny_public_and_plan_path(m, monkeypatch):
    """The MLP's second layer (32 x 4096 @ 4096 x 1024) and 32 x 1024 @ 1024 x 1024 through
    the public matrix_multiply (autotuned among the SIMT splits and the skinny configs),
    then with each skinny candidate made the call's choice: the general path (it makes the
    plan), then the plan (run_config made to raise); all within the float32 bound."""
    dtype, prec, bound = FAMILIES["fp32"]
    rng = np.random.default_rng(1056)
    dev = m.backend.current_device
    for M, K, N in ((32, 4096, 1024), (32, 1024, 1024)):
        a = to_dev(m, rand(rng, (M, K), dtype), dtype)
        b = to_dev(m, rand(rng, (K, N), dtype), dtype)
        ref, scale = reference(m, a, b)
        poisoned(m, ref.shape, dtype).free()
        res = m.matrix_multiply(a, b)
        assert rel_err(m.to_numpy(res), ref, scale) <= bound
        res.free()
        p = mm.plan_shapes(a.shape, b.shape)
        ckey = (p, dtype, None, dev, True)
        key = ("matmul", a.shape, b.shape, dtype, dtype, dev, dev, None)
        for cfg in mm.skinny_candidates(dtype, None, p, 132)[::2]:
            mm.memo(m)[ckey] = (mm.SIMT_TEMPLATE, cfg)
            m.plans.pop(key, None)
            for second in (False, True):
                poisoned(m, ref.shape, dtype).free()
                with monkeypatch.context() as mp:
                    if second:
                        mp.setattr("cuda_backend.ops.matmul_launch.run_config", _no_general_path)
                    res = m.matrix_multiply(a, b)
                assert key in m.plans
                err = rel_err(m.to_numpy(res), ref, scale)
                assert err <= bound, (cfg, (M, K, N), second, err)
                res.free()
        mm.memo(m).pop(ckey, None)
        m.plans.pop(key, None)


def test_skinny_plan_runner_launches():
    """The per-call plan of a skinny choice (mm.config_runner): a pool block for the partials,
    the split-K kernel and the reduce (splitk_reduce for matmul; splitk_epilogue with the
    bias pointer for the linear layer) as prepared launches with run_config's grids and
    arguments, the block released after them."""
    import types
    calls = []

    class Pool:
        def allocate_current(self, n):
            calls.append(("alloc", n))
            return 1 << 30

        def release(self, block):
            calls.append(("release", block))

    class Backend:
        memory_pools = {0: Pool()}

        def get_device_info(self, dev):
            return types.SimpleNamespace(multiprocessor_count=132,
                                         max_grid_dims=(2**31 - 1, 65535, 65535))

        def get_kernel(self, name, dev):
            return name

        def prepare_launch(self, kernel, grid, block, smem, dev):
            return lambda *args: calls.append((kernel, grid, block, smem, args))

    class Math:
        backend = Backend()

        def kernel(self, template, dev, **params):
            return types.SimpleNamespace(name=f"{params['kind']}{params.get('b_trans', '')}")

    p = mm.Plan(1, 32, 1024, 4096, 0, 0, (32, 1024))
    for cfg in mm.skinny_candidates(DT.FLOAT32, None, p, 132):
        chunk, s = mm.skinny_chunk(cfg, p.K, cfg["split"])
        tiles_m, tiles_n = mm.skinny_tiles(cfg, p)
        for epilogue in (None, "bias_gelu"):
            calls.clear()
            run = mm.config_runner(Math(), mm.SIMT_TEMPLATE, cfg, p, DT.FLOAT32, True, 0, epilogue)
            run(1 << 20, 2 << 20, 3 << 20, 0 if epilogue is None else 4 << 20)
            b_trans = epilogue is not None
            reduce_args = (1 << 30, 3 << 20, 32 * 1024, s) if epilogue is None else \
                (1 << 30, 3 << 20, 4 << 20, 32 * 1024, 1024, s)
            assert calls == [
                ("alloc", s * 32 * 1024 * 4),
                (f"skinny{b_trans}", (tiles_m * tiles_n, s, 1), (mm.skinny_threads(cfg), 1, 1),
                 mm.skinny_smem(cfg, b_trans), (1 << 20, 2 << 20, 1 << 30, 32, 1024, 4096, chunk)),
                ("splitk_reduce" if epilogue is None else "splitk_epilogue",
                 (mm.common.grid_1d(32 * 1024, mm.REDUCE_BLOCK, 132, waves=4), 1, 1),
                 (mm.REDUCE_BLOCK, 1, 1), 0, reduce_args),
                ("release", 1 << 30)]


# -- skinny M, split-K inside a thread-block cluster (matmul.CLUSTER_F32, matmul_skinny.cu.j2) --
HOPPER = (9, 0)
# 16-byte copies: odd M (one and two row tiles), N a multiple of 4 but of no tile width, K a
# multiple of 4 but of no slice (bk x splits), and the MLP's shapes; element copies: SKINNY_ODD
# (N 3 or 1025, K 5, 1000 or 4097: B (K, N) rows or K not whole vectors).
CLUSTER_ALIGNED = [(1, 1000, 1028), (7, 4100, 260), (33, 260, 36), (63, 1024, 4100),
                   (64, 2052, 132), (32, 4096, 1024), (32, 1024, 4096)]


# the index-math emulation's shapes: 1, 2 and 5 row tiles, partial column tiles, K of no
# slice multiple, trailing empty slices (K 5), M = 1
CLUSTER_INDEX_SHAPES = [(1, 5, 3), (7, 1000, 260), (32, 4097, 129), (33, 260, 36),
                        (63, 1024, 200), (64, 2052, 132), (65, 300, 257), (130, 64, 33)]


def _cluster_id(c):
    return "bn{bn}_{tr}x{tc}_kw{kw}_s{splits}".format(**c)


def _need_clusters(m):
    info = m.backend.get_device_info(m.backend.current_device)
    if not mm.has_clusters(info):
        pytest.skip("the cluster kernel needs compute capability >= 9.0 (thread-block clusters)")


def test_cluster_configs_are_consistent():
    """Each cluster config meets the template's static_asserts and the device's limits:
    threads a multiple of 32 (128-512); the ring holds the kw partial tiles of 32 x (bn + 4)
    floats; k groups split evenly over kw; rows of bk + 4 an odd number of 16-byte units;
    32 rows split evenly over the cluster (at most 8 blocks, the portable size); dynamic
    shared memory <= 227 KB. The element-copy configs are a subset."""
    assert len(mm.CLUSTER_F32) == (2 * len(mm.CLUSTER_TILES) + len(mm.CLUSTER_NARROW_TILES)) \
        * len(mm.CLUSTER_SPLITS)
    for c in mm.CLUSTER_F32:
        threads = mm.cluster_threads(c)
        assert threads % 32 == 0 and 128 <= threads <= 512, c
        assert c["bn"] % (8 * c["tc"]) == 0 and 32 % (4 * c["tr"]) == 0
        assert (c["bk"] // 4) % c["kw"] == 0 and ((c["bk"] + 4) // 4) % 2 == 1
        assert c["splits"] in (1, 2, 4, 8) and 32 % c["splits"] == 0 and c["stages"] >= 2
        for b_trans in (True, False):
            smem = mm.cluster_smem(c, b_trans)
            assert c["kw"] * 32 * (c["bn"] + 4) * 4 <= smem <= 227 * 1024, (c, b_trans)
    assert mm.CLUSTER_F32_SCALAR and all(c in mm.CLUSTER_F32 for c in mm.CLUSTER_F32_SCALAR)
    assert mm.cluster_configs(True) == mm.CLUSTER_F32
    assert mm.cluster_configs(False) == mm.CLUSTER_F32_SCALAR


def test_cluster_variants_are_the_configs():
    """The cluster kernel's variants, matmul's (B (K, N) without an epilogue; the weight
    (N, K) with bias + GELU) and the linear module's (bias; bias_gelu_grad), are every
    config of each alignment class in each layout, once; each renders one kernel without
    #error, its cluster size compiled in (no cluster for one split), its copy width and
    its B layout."""
    from cuda_backend.compiler import kernel_signature
    from cuda_backend.kernels import KernelGenerator
    from cuda_backend.ops import linear as lin
    got = mm.template_variants()[mm.SKINNY_TEMPLATE] + lin.template_variants()[mm.SKINNY_TEMPLATE]
    layouts = ((False, "none"), (True, "bias"), (True, "bias_gelu"), (True, mm.GRAD_EPILOGUE))
    want = [mm.cluster_params(DT.FLOAT32, c, vec, bt, epi) for vec in (True, False)
            for c in mm.cluster_configs(vec) for bt, epi in layouts]
    key = lambda p: tuple(sorted(p.items()))  # noqa: E731
    assert sorted(map(key, got)) == sorted(map(key, want))
    assert len(got) == len(set(map(key, got))) == 4 * (len(mm.CLUSTER_F32) +
                                                       len(mm.CLUSTER_F32_SCALAR))
    gen = KernelGenerator(backend=object())
    for params in got:
        assert "cluster" not in params
        name, src = gen.render_kernel(mm.SKINNY_TEMPLATE, **params)
        assert "#error" not in src and f"#define SPLITS {params['splits']}\n" in src
        assert ("__cluster_dims__(1, SPLITS, 1)" in src) is (params["splits"] > 1)
        assert ("cp_async16(dst, " in src) is params["vec"]
        assert ("#define W_STAGE (BN * KS)" in src) is params["b_trans"]
        # A, B, C, bias, [G,] M, N, K, k_chunk
        sig = kernel_signature(src, name)
        assert len(sig) == 8 + (params["epilogue"] == mm.GRAD_EPILOGUE), sig


CLUSTER_BN_TILES = sorted({(c["bn"], (c["tr"], c["tc"], c["kw"])) for c in mm.CLUSTER_F32})


@pytest.mark.parametrize("bn,tile", CLUSTER_BN_TILES,
                         ids=lambda v: str(v) if isinstance(v, int) else "{}x{}_kw{}".format(*v))
def test_cluster_lane_math_against_numpy(bn, tile):
    """The kernel's lane index math in NumPy: warp w is (k group w / (WR WN), row group,
    column group), lane (rg, cg) owns rows row0 + 4 i and columns col0 + 8 j (B (N, K)) or
    col0 + 32 (j / 4) + j % 4 (B (K, N)) and multiplies k groups g kw + its k group: over a
    block every (k group, row, column) of a tile is multiplied once, and every partial-tile
    slot (k group, row, column) stored once. Then one bk-deep tile through shared memory:
    the cp.async chunks' placement (x and W k-contiguous, rows of bk + 4; B (K, N) k-rows of
    bn) read back by the lanes' fragment loads, the k groups' partial tiles summed, give the
    tile's product."""
    tr, tc, kw = tile
    cfg = next(c for c in mm.CLUSTER_F32 if c["bn"] == bn and (c["tr"], c["tc"], c["kw"]) == tile)
    bk = cfg["bk"]
    wr_n, wn_n = 32 // (4 * tr), bn // (8 * tc)
    threads = mm.cluster_threads(cfg)
    assert threads == 32 * wr_n * wn_n * kw
    for b_trans in (True, False):
        mults = np.zeros((bk // 4, 32, bn), np.int64)
        stores = np.zeros((kw, 32, bn), np.int64)
        for tid in range(threads):
            warp, lane = divmod(tid, 32)
            group, wr, wc = warp // (wr_n * wn_n), (warp // wn_n) % wr_n, warp % wn_n
            rg, cg = lane >> 3, lane & 7
            rows = [wr * 4 * tr + rg + 4 * i for i in range(tr)]
            if b_trans:
                cols = [wc * 8 * tc + cg + 8 * j for j in range(tc)]
            else:
                cols = [wc * 8 * tc + cg * 4 + 32 * (j // 4) + j % 4 for j in range(tc)]
            for g in range(bk // 4 // kw):
                mults[g * kw + group][np.ix_(rows, cols)] += 1
            stores[group][np.ix_(rows, cols)] += 1
        assert (mults == 1).all() and (stores == 1).all(), (cfg, b_trans)
        _check_cluster_tile_through_smem(cfg, b_trans)


def _check_cluster_tile_through_smem(cfg, b_trans):
    """One bk-deep tile of x (32 x bk) and B (bn x bk as W, or bk x bn) placed in shared
    memory by load_tile's chunk index math, multiplied by every lane's fragment loads
    (load_frag / fma_frag), its partial tile stored at (k group, row, COL(j)) and summed
    over the k groups: the float64 product of the tile."""
    tr, tc, kw, bn, bk = cfg["tr"], cfg["tc"], cfg["kw"], cfg["bn"], cfg["bk"]
    ks, ch = bk + 4, bk // 4
    wr_n, wn_n = 32 // (4 * tr), bn // (8 * tc)
    rng = np.random.default_rng(bn + 10 * tr + 100 * tc + 1000 * kw)
    x = rng.standard_normal((32, bk))
    w = rng.standard_normal((bn, bk) if b_trans else (bk, bn))
    xs = np.full(32 * ks, np.nan)
    for q in range(32 * ch):                       # X_CHUNKS
        r, kc = q // ch, 4 * (q % ch)
        xs[r * ks + kc:r * ks + kc + 4] = x[r, kc:kc + 4]
    if b_trans:
        ws = np.full(bn * ks, np.nan)
        for q in range(bn * ch):                   # W_CHUNKS: Ws[n][k]
            r, kc = q // ch, 4 * (q % ch)
            ws[r * ks + kc:r * ks + kc + 4] = w[r, kc:kc + 4]
    else:
        ws = np.full(bk * bn, np.nan)
        for q in range(bk * (bn // 4)):            # W_CHUNKS: Ws[k][n]
            r, n = q // (bn // 4), 4 * (q % (bn // 4))
            ws[r * bn + n:r * bn + n + 4] = w[r, n:n + 4]
    red_ld = bn + 4
    part = np.full((kw * 32) * red_ld, np.nan)
    for tid in range(mm.cluster_threads(cfg)):
        warp, lane = divmod(tid, 32)
        group, wr, wc = warp // (wr_n * wn_n), (warp // wn_n) % wr_n, warp % wn_n
        rg, cg = lane >> 3, lane & 7
        row0 = wr * 4 * tr + rg
        if b_trans:
            col0 = wc * 8 * tc + cg
            cols = [col0 + 8 * j for j in range(tc)]
        else:
            col0 = wc * 8 * tc + cg * 4
            cols = [col0 + 32 * (j // 4) + j % 4 for j in range(tc)]
        acc = np.zeros((tr, tc))
        for g in range(bk // 4 // kw):
            kg = g * kw + group
            xv = np.array([xs[(row0 + 4 * i) * ks + 4 * kg:][:4] for i in range(tr)])
            if b_trans:
                wv = np.array([ws[cols[j] * ks + 4 * kg:][:4] for j in range(tc)])   # [j][k]
            else:
                wv = np.array([[ws[(4 * kg + kk) * bn + col0 + 32 * h:][:4]
                                for h in range(tc // 4)] for kk in range(4)])
                wv = wv.reshape(4, tc).T                                           # [j][k]
            acc += xv @ wv.T
        for i in range(tr):
            for j in range(tc):
                part[(group * 32 + row0 + 4 * i) * red_ld + cols[j]] = acc[i, j]
    tile = part.reshape(kw, 32, red_ld)[:, :, :bn].sum(axis=0)
    np.testing.assert_allclose(tile, x @ (w.T if b_trans else w), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bn", [32, 64, 128])
@pytest.mark.parametrize("splits", mm.CLUSTER_SPLITS)
def test_cluster_block_math_against_numpy(bn, splits):
    """The kernel's block index math (matmul.cluster_blocks) in NumPy: the output tiles once
    per K slice, the slices (whole bk-deep tiles) partitioning K in rank order, trailing ones
    possibly empty; a cluster's ranks store disjoint rows that make up the tile. Summed in
    that order, the float64 product."""
    cfg = next(c for c in mm.CLUSTER_F32 if c["bn"] == bn and c["splits"] == splits)
    bk = cfg["bk"]
    rng = np.random.default_rng(11)
    for M, K, N in CLUSTER_INDEX_SHAPES:
        a, b = rng.standard_normal((M, K)), rng.standard_normal((K, N))
        p = mm.plan_shapes((M, K), (K, N))
        chunk = mm.cluster_chunk(cfg, K)
        assert chunk % bk == 0 and splits * chunk >= K
        out = np.zeros((M, N))
        hits = np.zeros((M, N), np.int64)
        tiles = {}
        blocks = mm.cluster_blocks(cfg, p)
        assert len(blocks) == np.prod(mm.cluster_tiles(cfg, p)) * splits
        for m0, m1, n0, n1, k0, k1, r0, r1 in blocks:
            assert m0 % 32 == 0 and n0 % bn == 0 and m1 - m0 <= 32 and n1 - n0 <= bn
            tiles.setdefault((m0, n0), []).append((k0, k1, r0, r1))
        for (m0, n0), parts in tiles.items():
            assert len(parts) == splits
            m1, n1 = min(M, m0 + 32), min(N, n0 + bn)
            ends = [(min(k0, K), max(min(k0, K), k1)) for k0, k1, _, _ in parts]
            assert ends[0][0] == 0 and ends[-1][1] == K
            assert all(x[1] == y[0] for x, y in zip(ends, ends[1:]))
            tile = np.zeros((m1 - m0, n1 - n0))
            for k0, k1, _, _ in parts:   # the fixed order: ranks (within: k groups)
                if k1 > k0:
                    tile += a[m0:m1, k0:k1] @ b[k0:k1, n0:n1]
            stored = [(r0, r1) for _, _, r0, r1 in parts]
            assert stored[0][0] == m0 and stored[-1][1] == m1
            assert all(x[1] == y[0] for x, y in zip(stored, stored[1:]))
            for r0, r1 in stored:
                out[r0:r1, n0:n1] = tile[r0 - m0:r1 - m0]
                hits[r0:r1, n0:n1] += 1
        assert (hits == 1).all()
        np.testing.assert_allclose(out, a @ b, rtol=1e-10, atol=1e-10)


def test_cluster_candidates_where_offered():
    """Offered for float32 on CUDA cores (default, 'fp32', 'ieee') with M <= 64, K >= 256,
    batch 1, on compute capability >= 9.0 only; per bn at the split counts near one wave of
    132 SMs (the largest whose blocks fit, then the next), never one with an empty K slice;
    element copies get CLUSTER_F32_SCALAR's only. Every candidate is a listed variant."""
    variants = {tuple(sorted(v.items())) for v in mm.template_variants()[mm.SKINNY_TEMPLATE]}
    for (M, K, N), want in (((32, 1024, 4096), {32: (1, 2), 64: (2, 4), 128: (4, 8)}),
                            ((32, 1024, 1024), {32: (4, 8), 64: (8,), 128: (8,)}),
                            ((64, 1024, 1024), {32: (2, 4), 64: (4, 8), 128: (8,)}),
                            ((1, 256, 16384), {32: (1, 2), 64: (1, 2), 128: (1, 2)}),
                            ((32, 257, 1024), {32: (2,), 64: (2,), 128: (2,)}),
                            ((7, 4097, 3), {32: (8,), 64: (8,), 128: (8,)})):
        p = mm.Plan(1, M, N, K, 0, 0, (M, N))
        for bn, splits in want.items():
            assert mm.cluster_split_choices(bn, 32, p, 132) == splits, ((M, K, N), bn)
        for prec in (None, "fp32", "ieee"):
            for vec in (True, False):
                for cc in (HOPPER, (10, 0)):
                    cands = mm.cluster_candidates(DT.FLOAT32, prec, p, 132, cc, vec)
                    assert cands == [c for c in mm.cluster_configs(vec)
                                     if c["splits"] in want[c["bn"]]], ((M, K, N), prec, vec)
                    for c in cands:
                        assert (c["splits"] - 1) * mm.cluster_chunk(c, K) < K
                        assert tuple(sorted(mm.cluster_params(
                            DT.FLOAT32, c, vec, False, "none").items())) in variants
                assert mm.cluster_candidates(DT.FLOAT32, prec, p, 132, (8, 9), vec) == []
    p = mm.Plan(1, 32, 4096, 1024, 0, 0, (32, 4096))
    for dtype, prec in ((DT.FLOAT32, "tf32"), (DT.FLOAT64, None), (DT.FLOAT16, None),
                        (DT.BFLOAT16, None)):
        assert mm.cluster_candidates(dtype, prec, p, 132, HOPPER, True) == []
    for q in (p._replace(batch=2), p._replace(M=65), p._replace(K=255), p._replace(M=0)):
        assert mm.cluster_candidates(DT.FLOAT32, None, q, 132, HOPPER, True) == []


@pytest.mark.parametrize("shape", [(32, 4096, 1024), (32, 1024, 4096), (7, 1000, 1025),
                                   (63, 4097, 3), (64, 1024, 1028)])
def test_matmul_cluster_candidates_and_launch(shape):
    """On a device with clusters, matrix_multiply's candidates for M <= 64 are the SIMT
    (config, split) pairs, the skinny ones and the cluster ones (vec by alignment); with a
    cluster one chosen a call is one launch of its kernel (B as (K, N), no epilogue) over
    (row tiles x column tiles, splits), its threads and dynamic shared memory, with A, B,
    out, a null bias, M, N, K and the K chunk. Compute capability 8.0: no cluster one."""
    M, K, N = shape
    m = _SkinnyRecorder(True, cc=HOPPER, kind="cluster")
    a, b = m.backend.empty((M, K), DT.FLOAT32), m.backend.empty((K, N), DT.FLOAT32)
    out = mm.matmul(m, a, b)
    (cands,) = m.seen
    p = mm.plan_shapes((M, K), (K, N))
    vec = K % 4 == 0 and N % 4 == 0
    cl = [c for c in cands if c.get("cluster")]
    assert cl == mm.cluster_candidates(DT.FLOAT32, None, p, 132, HOPPER, vec) and cl
    assert [c for c in cands if c.get("skinny")] == mm.skinny_candidates(DT.FLOAT32, None, p, 132)
    m.launches.clear()
    m.blocks.clear()
    assert mm.matmul(m, a, b, out=out) is out
    (k1, grid1, smem1, v1), = m.launches
    cfg = cl[0]
    assert k1 == mm.cluster_params(DT.FLOAT32, cfg, vec, False, "none")
    tiles_m, tiles_n = mm.cluster_tiles(cfg, p)
    assert grid1 == (tiles_m * tiles_n, cfg["splits"], 1)
    assert smem1 == mm.cluster_smem(cfg, False) and m.blocks == [(mm.cluster_threads(cfg), 1, 1)]
    assert v1 == [a.ptr, b.ptr, out.ptr, 0, M, N, K, mm.cluster_chunk(cfg, K)]
    m2 = _SkinnyRecorder(True, cc=(8, 0), kind="cluster")
    mm.matmul(m2, m2.backend.empty((M, K), DT.FLOAT32), m2.backend.empty((K, N), DT.FLOAT32))
    assert m2.seen and not any(c.get("cluster") for cands in m2.seen for c in cands)


def test_cluster_plan_runner_launches():
    """The per-call plan of a cluster choice (mm.config_runner): one prepared launch with
    run_config's grid, threads, shared memory and arguments (the bias pointer, and G for
    bias_gelu_grad), no workspace."""
    import types
    calls = []

    class Backend:
        memory_pools = {0: None}   # (a cluster runner takes no pool block)

        def get_device_info(self, dev):
            return types.SimpleNamespace(multiprocessor_count=132, compute_capability=HOPPER,
                                         max_grid_dims=(2**31 - 1, 65535, 65535))

        def get_kernel(self, name, dev):
            return name

        def prepare_launch(self, kernel, grid, block, smem, dev):
            return lambda *args: calls.append((kernel, grid, block, smem, args))

    class Math:
        backend = Backend()

        def kernel(self, template, dev, **params):
            assert template == mm.SKINNY_TEMPLATE
            return types.SimpleNamespace(name=f"{params['epilogue']}{params['b_trans']}")

    p = mm.Plan(1, 33, 1028, 4100, 0, 0, (33, 1028))
    cands = mm.cluster_candidates(DT.FLOAT32, None, p, 132, HOPPER, True)
    assert cands
    for cfg in cands:
        tiles_m, tiles_n = mm.cluster_tiles(cfg, p)
        chunk = mm.cluster_chunk(cfg, p.K)
        for epilogue in (None, "bias", "bias_gelu", mm.GRAD_EPILOGUE):
            calls.clear()
            run = mm.config_runner(Math(), mm.SKINNY_TEMPLATE, cfg, p, DT.FLOAT32, True, 0,
                                   epilogue)
            run(1 << 20, 2 << 20, 3 << 20, 0 if epilogue is None else 4 << 20, 5 << 20)
            b_trans = epilogue is not None
            g = (5 << 20,) if epilogue == mm.GRAD_EPILOGUE else ()
            grid = (tiles_m * tiles_n, cfg["splits"], 1)
            assert calls == [(f"{epilogue or 'none'}{b_trans}", grid,
                              (mm.cluster_threads(cfg), 1, 1), mm.cluster_smem(cfg, b_trans),
                              (1 << 20, 2 << 20, 3 << 20, 0 if epilogue is None else 4 << 20)
                              + g + (33, 1028, 4100, chunk))]


def test_cluster_configs_reject_what_they_cannot_run():
    """run_config of a cluster config: float32 only, one matrix, a device with clusters,
    and its own split count; each a typed error before any launch."""
    cfg = mm.cluster_candidates(DT.FLOAT32, None, mm.Plan(1, 8, 64, 512, 0, 0, (8, 64)), 132,
                                HOPPER, True)[0]
    for cc, dtype, batch, splits, match in ((HOPPER, DT.FLOAT64, 1, None, "float32 only"),
                                            (HOPPER, DT.FLOAT32, 2, None, "batch of 2"),
                                            ((8, 6), DT.FLOAT32, 1, None, "compute capability"),
                                            (HOPPER, DT.FLOAT32, 1, cfg["splits"] + 1,
                                             "own split count")):
        m = _SkinnyRecorder(True, cc=cc)
        a, b = m.backend.empty((8, 512), dtype), m.backend.empty((512, 64), dtype)
        out = m.backend.empty((8, 64), dtype)
        p = mm.Plan(batch, 8, 64, 512, 0, 0, (8, 64))
        with pytest.raises(InvalidArgumentError, match=match):
            mm.run_config(m, mm.SKINNY_TEMPLATE, cfg, a, b, out, p, dtype, True, 0,
                          splits=splits)
        assert m.launches == []


@gpu
@pytest.mark.parametrize("cfg", mm.CLUSTER_F32, ids=_cluster_id)
def test_gpu_cluster_configs(m, cfg):
    """Every cluster config through run_config (one launch) into a poisoned output: 16-byte
    copies on the aligned odd shapes, and for the element-copy configs the odd shapes (N or K
    not whole vectors) too, within the float32 bound of the skinny tests; the same call twice
    gives the same bits (a fixed summation order)."""
    _need_clusters(m)
    dtype, prec, bound = FAMILIES["fp32"]
    rng = np.random.default_rng(31)
    dev = m.backend.current_device
    shapes = CLUSTER_ALIGNED + (SKINNY_ODD if cfg in mm.CLUSTER_F32_SCALAR else [])
    for M, K, N in shapes:
        a = to_dev(m, rand(rng, (M, K), dtype), dtype)
        b = to_dev(m, rand(rng, (K, N), dtype), dtype)
        ref, scale = reference(m, a, b)
        p = mm.plan_shapes(a.shape, b.shape)
        out = poisoned(m, ref.shape, dtype)
        vec = mm.is_vec_ok(a, b, out, p)
        assert vec is ((M, K, N) in CLUSTER_ALIGNED)
        mm.run_config(m, mm.SKINNY_TEMPLATE, cfg, a, b, out, p, dtype, vec, dev)
        got = m.to_numpy(out)
        err = rel_err(got, ref, scale)
        assert err <= bound, (cfg, (M, K, N), vec, err)
        again = poisoned(m, ref.shape, dtype)
        mm.run_config(m, mm.SKINNY_TEMPLATE, cfg, a, b, again, p, dtype, vec, dev)
        assert np.array_equal(m.to_numpy(again), got), (cfg, (M, K, N))
        for t in (out, again, a, b):
            t.free()


@gpu
def test_gpu_cluster_public_and_plan_path(m, monkeypatch):
    """The MLP's second layer (32 x 4096 @ 4096 x 1024), 32 x 1024 @ 1024 x 4096 and an odd
    aligned shape through the public matrix_multiply (autotuned among the SIMT splits, the
    skinny and the cluster configs), then with each cluster candidate made the call's
    choice: the general path (it makes the plan), then the plan (run_config made to raise);
    all within the float32 bound."""
    _need_clusters(m)
    dtype, prec, bound = FAMILIES["fp32"]
    rng = np.random.default_rng(32)
    dev = m.backend.current_device
    info = m.backend.get_device_info(dev)
    for M, K, N in ((32, 4096, 1024), (32, 1024, 4096), (33, 1000, 260)):
        a = to_dev(m, rand(rng, (M, K), dtype), dtype)
        b = to_dev(m, rand(rng, (K, N), dtype), dtype)
        ref, scale = reference(m, a, b)
        poisoned(m, ref.shape, dtype).free()
        res = m.matrix_multiply(a, b)
        assert rel_err(m.to_numpy(res), ref, scale) <= bound
        res.free()
        p = mm.plan_shapes(a.shape, b.shape)
        ckey = (p, dtype, None, dev, True)
        key = ("matmul", a.shape, b.shape, dtype, dtype, dev, dev, None)
        cands = mm.cluster_candidates(dtype, None, p, info.multiprocessor_count,
                                      info.compute_capability, True)
        assert cands
        for cfg in cands:
            mm.memo(m)[ckey] = (mm.SKINNY_TEMPLATE, cfg)
            m.plans.pop(key, None)
            for second in (False, True):
                poisoned(m, ref.shape, dtype).free()
                with monkeypatch.context() as mp:
                    if second:
                        mp.setattr("cuda_backend.ops.matmul_launch.run_config", _no_general_path)
                    res = m.matrix_multiply(a, b)
                assert key in m.plans
                err = rel_err(m.to_numpy(res), ref, scale)
                assert err <= bound, (cfg, (M, K, N), second, err)
                res.free()
        mm.memo(m).pop(ckey, None)
        m.plans.pop(key, None)


# -- wgmma (Hopper) float16 / bfloat16: matmul_wgmma16.cu.j2 ------------------------------------
W16 = [mm.W16_128x256_s4, mm.W16_128x128_s3]   # (all_configs' order)
FAMS16 = {"fp16": DT.FLOAT16, "bf16": DT.BFLOAT16}


def _w16_id(c):
    return "bn{bn}_s{stages}_b{min_blocks}".format(**c)


def test_wgmma16_configs_render_for_sm_90a():
    """The 16-bit wgmma configs are candidates of float16 and bfloat16 only (matrix_multiply's
    GEMM table; not the linear layer's, not the A-transposed GEMM's), listed once per dtype,
    rendered without #error with the dtype's wgmma instruction, built for sm_90a."""
    from cuda_backend.kernels import TEMPLATE_ARCH, KernelGenerator
    gen = KernelGenerator(backend=object())
    assert TEMPLATE_ARCH[mm.WGMMA16_TEMPLATE] == "sm_90a"
    for dt in (DT.FLOAT16, DT.BFLOAT16):
        assert [c for c in mm.all_configs(dt, None) if c.get("wgmma16")] == W16
        assert not any(c.get("wgmma16") for vec in (True, False)
                       for c in mm.linear_configs(dt, None, vec) + mm.tn_configs(dt, None, vec))
        assert mm.WGMMA16_STANDIN in mm.linear_configs(dt, None, False)
        assert mm.WGMMA16_STANDIN in mm.tn_configs(dt, None, False)
    for dt, prec in ((DT.FLOAT32, None), (DT.FLOAT32, "tf32"), (DT.FLOAT32, "ieee"),
                     (DT.FLOAT64, None)):
        assert not any(c.get("wgmma16") for c in mm.all_configs(dt, prec))
    sets = mm.template_variants()[mm.WGMMA16_TEMPLATE]
    assert sets == [mm.wgmma16_params(dt, c) for dt in (DT.FLOAT16, DT.BFLOAT16) for c in W16]
    for params in sets:
        _, src = gen.render_kernel(mm.WGMMA16_TEMPLATE, **params)
        wt = "f16" if params["dtype"] == "float16" else "bf16"
        assert f"m64n{params['bn']}k16.f32.{wt}.{wt}" in src and "#error" not in src
        assert f"#define STAGES {params['stages']}" in src
        assert f"__launch_bounds__(THREADS, {params['min_blocks']})" in src


def test_wgmma16_default_order():
    """Untuned (the first candidate): large aligned shapes take the TMA kernel (128x256 s4),
    then the wgmma16 ones (128x256 s4 first), then mma.sync; large unaligned ones (K or N
    % 8, misaligned pointers: the padded copies) wgmma16 128x256 s4, then 128x128 s3, then
    mma.sync; medium ones, aligned or not, wgmma16 128x128 s3; skinny and small shapes keep
    mma.sync first."""
    for dt in (DT.FLOAT16, DT.BFLOAT16):
        large = mm.candidates(dt, None, "large", True)
        kinds = ["tma16" if c.get("tma16") else "wgmma16" if c.get("wgmma16") else "mma"
                 for c in large]
        assert kinds == sorted(kinds, key=["tma16", "wgmma16", "mma"].index)
        assert large[0] == mm.T16_128x256_s4
        assert [c for c in large if c.get("wgmma16")][0] == mm.W16_128x256_s4
        assert mm.candidates(dt, None, "medium", True)[0] == mm.W16_128x128_s3
        assert mm.candidates(dt, None, "large", False) == \
            [mm.W16_128x256_s4, mm.W16_128x128_s3, mm.WGMMA16_STANDIN]
        assert mm.candidates(dt, None, "medium", False)[0] == mm.W16_128x128_s3
        assert not mm.candidates(dt, None, "skinny", True)[0].get("wgmma16")
        assert not any(c.get("wgmma16") for vec in (True, False)
                       for c in mm.candidates(dt, None, "small", vec))


def _w16_recorder(cc=HOPPER):
    """A recording CudaMath whose autotuner picks the first wgmma16 candidate, if any."""
    return _SkinnyRecorder(True, cc=cc, kind="wgmma16")


@pytest.mark.parametrize("fam", list(FAMS16))
@pytest.mark.parametrize("a_shape, b_shape", [
    ((1023, 1000), (1000, 1025)),            # medium, N odd: B copied into padded rows
    ((4096, 4096), (4096, 4096)),            # large, B read in place
    ((3, 130, 296), (296, 200)),             # a batch, B broadcast (one plane), N % 8 == 0
    ((3, 130, 296), (3, 296, 201)),          # a batch, B full (three padded planes)
    ((4099, 8), (8, 1025))])                 # large, K = 8: one partial k-tile, N odd
def test_matmul_wgmma16_candidates_and_launch(fam, a_shape, b_shape):
    """On sm_90 the 16-bit GEMM times the wgmma16 configs beside the mma.sync ones where
    K % 8 == 0; the chosen one launches its kernel over (tiles, 1, batch) with 256 threads,
    wgmma_smem bytes and (A, B, C, M, N, K, lda, ldb, stride_a, stride_b); where N % 8 != 0,
    B's planes are first copied into a pool block of rows padded to 8 (a strided copy, the
    kernel's B then that block with ldb = wgmma16_ld(N))."""
    dtype = FAMS16[fam]
    m = _w16_recorder()
    a, b = m.backend.empty(a_shape, dtype), m.backend.empty(b_shape, dtype)
    out = mm.matmul(m, a, b)
    p = mm.plan_shapes(a_shape, b_shape)
    (cands,) = m.seen
    cls = mm.shape_class(p, 132)
    assert cands[0] == mm.candidates(dtype, None, cls, mm.is_vec_ok(a, b, out, p))[0]
    w = [c for c in cands if c.get("wgmma16")]
    assert w and all(c in W16 for c in w)
    cfg = w[0]
    m.launches.clear()
    m.blocks.clear()
    mm.matmul(m, a, b, out=out)
    tiles = -(-p.M // cfg["bm"]) * -(-p.N // cfg["bn"])
    gemm = [(k, g, s, v) for k, g, s, v in m.launches if "out_ctype" in k]
    assert len(gemm) == 1
    k, grid, smem, values = gemm[0]
    assert k == mm.wgmma16_params(dtype, cfg) and smem == mm.wgmma_smem(cfg)
    assert grid == (tiles, 1, p.batch) and m.blocks[-1] == (256, 1, 1)
    direct = p.N % 8 == 0
    ldb = p.N if direct else mm.wgmma16_ld(p.N)
    sb = 0 if p.stride_b == 0 else p.K * ldb
    assert values[0] == a.ptr and values[2] == out.ptr
    assert values[3:] == [p.M, p.N, p.K, p.K, ldb, p.stride_a, sb]
    if direct:
        assert len(m.launches) == 1 and values[1] == b.ptr
        return
    (copy_k, _, _, copy_v), _ = m.launches
    assert copy_k["kind"] == "gather" and copy_v[0] == b.ptr and copy_v[1] == values[1]


@pytest.mark.parametrize("fam", list(FAMS16))
def test_wgmma16_not_offered_where_it_cannot_run(fam):
    """No wgmma16 candidate for an output not 4-byte aligned, a device other than sm_90, or
    the layouts the kernel does not read: the linear layer (weight (N, K)), matmul_nt,
    matmul_tn. K % 8 != 0 and a misaligned A are offered (A's padded copy, matmul_pad)."""
    dtype = FAMS16[fam]

    def offered(m):
        return any(c.get("wgmma16") for cands in m.seen for c in cands)

    def shifted(m, shape):
        base = m.backend.empty((int(np.prod(shape)) + 8,), dtype)
        return CudaTensor(shape, dtype, 0, base.ptr + 2, owner=base)

    m = _w16_recorder()
    mm.matmul(m, m.backend.empty((1023, 1000), dtype), m.backend.empty((1000, 1025), dtype))
    assert offered(m)                                         # (the control)
    for cc, (M, K, N) in ((HOPPER, (1023, 1001, 1025)), (HOPPER, (1023, 996, 1024)),
                          ((8, 0), (1023, 1000, 1024)), ((10, 0), (1023, 1000, 1024)),
                          ((8, 0), (1023, 997, 1025))):
        m = _w16_recorder(cc)
        mm.matmul(m, m.backend.empty((M, K), dtype), m.backend.empty((K, N), dtype))
        assert m.seen and offered(m) == (cc == HOPPER), (cc, K)
    # (one recorder per call: a second call of the same shapes and alignment class would
    # take the first one's memoized choice, test_wgmma16_run_config_gives_way_to_the_standin)
    m = _w16_recorder()
    mm.matmul(m, shifted(m, (1023, 1000)), m.backend.empty((1000, 1024), dtype))
    assert m.seen and offered(m)
    m = _w16_recorder()
    mm.matmul(m, m.backend.empty((1023, 1000), dtype), m.backend.empty((1000, 1024), dtype),
              out=shifted(m, (1023, 1024)))
    assert m.seen and not offered(m)
    for call in (lambda m, x, w: mm.linear(m, x, w, m.backend.empty((1024,), dtype), "bias"),
                 lambda m, x, w: mm.matmul_nt(m, x, w),
                 lambda m, x, w: mm.matmul_tn(m, m.backend.empty((1000, 1023), dtype),
                                              m.backend.empty((1000, 1024), dtype))):
        m = _w16_recorder()
        call(m, m.backend.empty((1023, 1000), dtype), m.backend.empty((1024, 1000), dtype))
        assert m.seen and not offered(m)


@pytest.mark.parametrize("fam", list(FAMS16))
def test_wgmma16_run_config_gives_way_to_the_standin(fam):
    """run_config of a wgmma16 config on a call it cannot take (a memoized choice for this
    shape and alignment class meeting an output not 4-byte aligned, or another device)
    launches WGMMA16_STANDIN's mma.sync kernel instead: never the wgmma16 kernel on bad
    operands (a misaligned A is copied, test_wgmma16_pads_a_run_config)."""
    dtype = FAMS16[fam]
    M, K, N = 131, 264, 133
    p = mm.plan_shapes((M, K), (K, N))
    for cc, a_off, o_off in ((HOPPER, 0, 2), (HOPPER, 2, 6), ((8, 0), 0, 0), ((8, 0), 2, 0)):
        m = _w16_recorder(cc)
        base_a = m.backend.empty((M * K + 8,), dtype)
        base_o = m.backend.empty((M * N + 8,), dtype)
        a = CudaTensor((M, K), dtype, 0, base_a.ptr + a_off, owner=base_a)
        out = CudaTensor((M, N), dtype, 0, base_o.ptr + o_off, owner=base_o)
        b = m.backend.empty((K, N), dtype)
        for cfg in W16:
            m.launches.clear()
            mm.run_config(m, mm.WGMMA16_TEMPLATE, cfg, a, b, out, p, dtype, False, 0)
            assert [k for k, *_ in m.launches] == \
                [mm.kernel_params(mm.MMA_TEMPLATE, dtype, mm.WGMMA16_STANDIN, False)]
    m = _w16_recorder()   # (the control: aligned A and output run the wgmma16 kernel)
    a, out = m.backend.empty((M, K), dtype), m.backend.empty((M, N), dtype)
    mm.run_config(m, mm.WGMMA16_TEMPLATE, mm.W16_128x128_s3, a, m.backend.empty((K, N), dtype),
                  out, p, dtype, False, 0)
    assert m.launches[-1][0] == mm.wgmma16_params(dtype, mm.W16_128x128_s3)


def test_wgmma16_pad_copy_layout_against_numpy():
    """The strided copy of B that pad_b_launches plans, its launch arguments decoded and run
    in NumPy (the gather kernel: out[sum c_k so_k] = in[sum c_k si_k], sizes and strides
    innermost first): every plane's (K, N) lands in rows of wgmma16_ld(N), the rest of each
    row untouched; element copies (mode 0), whatever B's address."""
    import types
    m = types.SimpleNamespace()
    rng = np.random.default_rng(6120)
    for planes, K, N in ((1, 8, 1), (1, 40, 129), (3, 296, 33), (2, 1000, 515), (4, 16, 8)):
        p = mm.Plan(planes, 5, N, K, 5 * K, 0 if planes == 1 else K * N, (5, N))
        ld = mm.wgmma16_ld(N)
        assert ld % 8 == 0 and N <= ld < N + 8
        for src_addr in (2, 16 * 7 + 6):
            (launch,) = mm.pad_b_launches(m, 0, DT.FLOAT16, planes, p, src_addr, 1 << 20)
            args = list(launch.args)
            items, nd, mode = args[0], args[1], args[2]
            assert mode == 0 and launch.params["kind"] == "gather"
            sizes = [args[4 + 3 * k] for k in range(nd)][::-1]
            si, so = args[28:28 + nd][::-1], args[36:36 + nd][::-1]
            assert items == int(np.prod(sizes)) == planes * K * N
            src = rng.standard_normal(planes * K * N)
            dst = np.full(planes * K * ld, np.nan)
            idx = np.indices(sizes).reshape(nd, -1)
            dst[np.tensordot(so, idx, 1)] = src[np.tensordot(si, idx, 1)]
            got = dst.reshape(planes, K, ld)
            assert (got[:, :, :N] == src.reshape(planes, K, N)).all()
            assert np.isnan(got[:, :, N:]).all()


def test_wgmma16_plan_runner_launches():
    """The per-call plan of a wgmma16 choice (mm.config_runner): B read in place (one
    prepared launch, run_config's grid, threads, shared memory and arguments) where N % 8 == 0
    and B's pointer is 16-byte aligned; else its padded copy in a pool block, then the kernel
    on that block, the block released; A misaligned: A's padded copy (lda wgmma16_ld(K)) in
    a block of its own, first; the output not 4-byte aligned: the stand-in's launch."""
    import types
    calls = []

    class Pool:
        def allocate_current(self, nbytes):   # (9 << 30, then 10 << 30 in one run)
            calls.append(("alloc", nbytes))
            return (9 + sum(c[0] == "alloc" for c in calls) - 1) << 30

        def release(self, block):
            calls.append(("release", block))

    class Backend:
        memory_pools = {0: Pool()}

        def get_device_info(self, dev):
            return types.SimpleNamespace(multiprocessor_count=132, compute_capability=HOPPER,
                                         max_grid_dims=(2**31 - 1, 65535, 65535))

        def get_kernel(self, name, dev):
            return name

        def prepare_launch(self, kernel, grid, block, smem, dev):
            return lambda *args: calls.append((kernel, grid, block, smem, args))

    class Math:
        backend = Backend()

        def kernel(self, template, dev, **params):
            return types.SimpleNamespace(name=template, num_regs=128)

    for dtype in (DT.FLOAT16, DT.BFLOAT16):
        for (batch, M, K, N, sb) in ((1, 1023, 1000, 1024, 0), (3, 130, 296, 33, 296 * 33),
                                     (2, 257, 8, 515, 0)):
            p = mm.Plan(batch, M, N, K, M * K, sb, (batch, M, N))
            for cfg in W16:
                tiles = -(-M // cfg["bm"]) * -(-N // cfg["bn"])
                run = mm.config_runner(Math(), mm.WGMMA16_TEMPLATE, cfg, p, dtype, False, 0)
                smem = mm.wgmma_smem(cfg)
                for pb in (2 << 20, (2 << 20) + 2):
                    calls.clear()
                    run(1 << 20, pb, 3 << 20, 0)
                    if N % 8 == 0 and pb % 16 == 0:
                        assert calls == [(mm.WGMMA16_TEMPLATE, (tiles, 1, batch), (256, 1, 1),
                                          smem, (1 << 20, pb, 3 << 20, M, N, K, K, N, M * K,
                                                 sb))]
                        continue
                    ld = mm.wgmma16_ld(N)
                    planes = 1 if sb == 0 else batch
                    alloc, copy, gemm, release = calls
                    assert alloc == ("alloc", planes * K * ld * 2)
                    assert copy[0] == "strided_copy.cu.j2" and copy[4][:2] == (pb, 9 << 30)
                    assert gemm == (mm.WGMMA16_TEMPLATE, (tiles, 1, batch), (256, 1, 1), smem,
                                    (1 << 20, 9 << 30, 3 << 20, M, N, K, K, ld, M * K,
                                     0 if sb == 0 else K * ld))
                    assert release == ("release", 9 << 30)
                pa = (1 << 20) + 2
                calls.clear()
                run(pa, 2 << 20, 3 << 20, 0)
                lda, ld = mm.wgmma16_ld(K), mm.wgmma16_ld(N)
                direct_b = N % 8 == 0
                names = ["alloc", "strided_copy.cu.j2"] + \
                    ([] if direct_b else ["alloc", "strided_copy.cu.j2"]) + \
                    [mm.WGMMA16_TEMPLATE, "release"] + ([] if direct_b else ["release"])
                assert [c[0] for c in calls] == names
                assert calls[0] == ("alloc", batch * M * lda * 2)   # (A never broadcast here)
                assert calls[1][4][:2] == (pa, 9 << 30)
                assert calls[-2 if direct_b else -3] == (
                    mm.WGMMA16_TEMPLATE, (tiles, 1, batch), (256, 1, 1), smem,
                    (9 << 30, (2 << 20) if direct_b else 10 << 30, 3 << 20, M, N, K, lda,
                     N if direct_b else ld, M * lda,
                     0 if sb == 0 else K * (N if direct_b else ld)))
                assert [c[1] for c in calls if c[0] == "release"] == \
                    [9 << 30] + ([] if direct_b else [10 << 30])
                calls.clear()
                run(1 << 20, 2 << 20, (3 << 20) + 2, 0)
                assert [c[0] for c in calls] == [mm.MMA_TEMPLATE]
                assert calls[0][4][:3] == (1 << 20, 2 << 20, (3 << 20) + 2)


# K % 8 != 0 or A misaligned: A's padded copy (ops/matmul_pad.py). (M, K, N, batch of A, of B)
PAD_A_SHAPES = [((1023, 997), (997, 1025)), ((65, 7), (7, 33)), ((1, 9), (9, 5)),
                ((4, 1), (1, 8)), ((3, 130, 9), (3, 9, 201)), ((130, 7), (3, 7, 40)),
                ((2, 33, 997), (997, 64))]


@pytest.mark.parametrize("fam", list(FAMS16))
@pytest.mark.parametrize("a_shape, b_shape", PAD_A_SHAPES + [((131, 264), (264, 136))],
                         ids=lambda s: "x".join(map(str, s)))
def test_wgmma16_pads_a_run_config(fam, a_shape, b_shape):
    """run_config of each wgmma16 config where K % 8 != 0 (and, last, K % 8 == 0 with A two
    bytes off its 16-byte boundary): A's planes (one where A is broadcast) copied first into
    a pool block of rows wgmma16_ld(K) (a strided element copy from A), B's into rows of
    wgmma16_ld(N) where N % 8 != 0, then the kernel on the copies with the real M, N, K, the
    padded row strides and the copies' plane strides."""
    dtype = FAMS16[fam]
    p = mm.plan_shapes(a_shape, b_shape)
    for cfg in W16:
        m = _w16_recorder()
        if p.K % 8:
            a = m.backend.empty(a_shape, dtype)
        else:
            base = m.backend.empty((int(np.prod(a_shape)) + 8,), dtype)
            a = CudaTensor(a_shape, dtype, 0, base.ptr + 2, owner=base)
        b, out = m.backend.empty(b_shape, dtype), m.backend.empty(p.out_shape, dtype)
        assert not mm.wgmma16_a_direct(a.ptr, p) and mm.wgmma16_usable(
            m.backend.get_device_info(0), dtype, a, out, p)
        mm.run_config(m, mm.WGMMA16_TEMPLATE, cfg, a, b, out, p, dtype, False, 0)
        lda, ldb = mm.wgmma16_ld(p.K), (p.N if p.N % 8 == 0 else mm.wgmma16_ld(p.N))
        copies, (gemm,) = m.launches[:-1], m.launches[-1:]
        assert len(copies) == (1 if p.N % 8 == 0 else 2)
        k, grid, smem, values = gemm
        tiles = -(-p.M // cfg["bm"]) * -(-p.N // cfg["bn"])
        assert k == mm.wgmma16_params(dtype, cfg) and smem == mm.wgmma_smem(cfg)
        assert grid == (tiles, 1, p.batch)
        assert values[2:] == [out.ptr, p.M, p.N, p.K, lda, ldb,
                              0 if p.stride_a == 0 else p.M * lda,
                              0 if p.stride_b == 0 else p.K * ldb]
        copy_k, _, _, copy_v = copies[0]
        assert copy_k["kind"] == "gather" and copy_v[:2] == [a.ptr, values[0]]
        assert copy_v[2] == (1 if p.stride_a == 0 else p.batch) * p.M * p.K   # items
        assert copy_v[4] == 0   # element copies (mode 0)
        if p.N % 8:
            assert copies[1][3][:2] == [b.ptr, values[1]]
        else:
            assert values[1] == b.ptr


def test_wgmma16_pad_a_copy_layout_against_numpy():
    """The strided copy of A that pad_a_launches plans, its launch arguments decoded and run
    in NumPy (as test_wgmma16_pad_copy_layout_against_numpy): every plane's (M, K) lands in
    rows of wgmma16_ld(K), the rest of each row untouched; element copies whatever A's
    address (K % 8 != 0, or A misaligned where K % 8 == 0)."""
    import types
    m = types.SimpleNamespace()
    rng = np.random.default_rng(9970)
    for planes, M, K in ((1, 1, 1), (1, 65, 7), (3, 130, 9), (2, 33, 997), (1, 5, 16),
                         (4, 7, 8)):
        p = mm.Plan(planes, M, 5, K, 0 if planes == 1 else M * K, 5 * K, (M, 5))
        ld = mm.wgmma16_ld(K)
        assert ld % 8 == 0 and K <= ld < K + 8
        for src_addr in ((2, 16 * 7 + 6) if K % 8 == 0 else (2, 16 * 7 + 6, 1 << 20)):
            (launch,) = mm.pad_a_launches(m, 0, DT.BFLOAT16, planes, p, src_addr, 1 << 21)
            args = list(launch.args)
            items, nd, mode = args[0], args[1], args[2]
            assert mode == 0 and launch.params["kind"] == "gather"
            sizes = [args[4 + 3 * k] for k in range(nd)][::-1]
            si, so = args[28:28 + nd][::-1], args[36:36 + nd][::-1]
            assert items == int(np.prod(sizes)) == planes * M * K
            src = rng.standard_normal(planes * M * K)
            dst = np.full(planes * M * ld, np.nan)
            idx = np.indices(sizes).reshape(nd, -1)
            dst[np.tensordot(so, idx, 1)] = src[np.tensordot(si, idx, 1)]
            got = dst.reshape(planes, M, ld)
            assert (got[:, :, :K] == src.reshape(planes, M, K)).all()
            assert np.isnan(got[:, :, K:]).all()


class _PlanRecorder(_SkinnyRecorder):
    """_w16_recorder's recording CudaMath with the per-call plan's backend calls as well:
    prepared launches record into `launches` / `blocks` as launch_kernel does, pool blocks
    come from distinct addresses and their allocations and releases are recorded."""

    def __init__(self):
        super().__init__(True, cc=HOPPER, kind="wgmma16")
        rec = self
        self.pool_calls = []

        class Pool:
            def allocate_current(self, nbytes):
                rec.pool_calls.append(("alloc", nbytes))
                return (40 + len(rec.pool_calls)) << 30

            def release(self, block):
                rec.pool_calls.append(("release", block))

        def prepare_launch(kernel, grid, block, smem, dev):
            def go(*args):
                rec.launches.append((rec.kernels[kernel], grid, smem, list(args)))
                rec.blocks.append(block)
            return go
        self.backend.memory_pools = {0: Pool()}
        self.backend.get_kernel = lambda name, dev: name
        self.backend.prepare_launch = prepare_launch
        empty = self.backend.empty
        self.empties = []

        def recorded_empty(shape, dtype, dev=0):
            t = empty(shape, dtype, dev)
            rec.empties.append(t.ptr)
            return t
        self.backend.empty = recorded_empty


@pytest.mark.parametrize("fam", list(FAMS16))
@pytest.mark.parametrize("a_shape, b_shape", PAD_A_SHAPES + [((131, 264), (264, 136))],
                         ids=lambda s: "x".join(map(str, s)))
def test_wgmma16_plan_replays_padded_launches(fam, a_shape, b_shape):
    """Where A (and B) are padded, the per-call plan of each wgmma16 config (config_runner)
    makes exactly run_config's launches: the same kernels, grids, blocks, shared memory and
    arguments, the general path's pool tensors matched to the plan's pool blocks (allocated
    in the same order, A's first, each released after the launches); and A misaligned with
    K % 8 == 0 likewise."""
    dtype = FAMS16[fam]
    p = mm.plan_shapes(a_shape, b_shape)
    for cfg in W16:
        m = _PlanRecorder()
        a, b = m.backend.empty(a_shape, dtype), m.backend.empty(b_shape, dtype)
        if p.K % 8 == 0:   # (A two bytes off its boundary)
            a = CudaTensor(a_shape, dtype, 0, a.ptr + 2, owner=a)
        out = m.backend.empty(p.out_shape, dtype)
        m.launches.clear(), m.blocks.clear(), m.empties.clear()
        mm.run_config(m, mm.WGMMA16_TEMPLATE, cfg, a, b, out, p, dtype, False, 0)
        general = (list(m.launches), list(m.blocks))
        names = {a.ptr: "A", b.ptr: "B", out.ptr: "C"}
        names.update({ptr: f"block{i}" for i, ptr in enumerate(m.empties)})
        run = mm.config_runner(m, mm.WGMMA16_TEMPLATE, cfg, p, dtype, False, 0)
        m.launches.clear(), m.blocks.clear()
        run(a.ptr, b.ptr, out.ptr, 0)
        allocs = [addr for kind, addr in
                  ((c[0], (40 + i + 1) << 30) for i, c in enumerate(m.pool_calls))
                  if kind == "alloc"]
        plan_names = {a.ptr: "A", b.ptr: "B", out.ptr: "C"}
        plan_names.update({ptr: f"block{i}" for i, ptr in enumerate(allocs)})
        assert len(allocs) == len(m.empties) == (1 if p.N % 8 == 0 else 2)
        assert [c[1] for c in m.pool_calls if c[0] == "release"] == allocs

        def named(launches, table):
            return [(k, g, s, [table.get(v, v) for v in vals]) for k, g, s, vals in launches]
        assert named(m.launches, plan_names) == named(general[0], names)
        assert m.blocks == general[1]


def _need_wgmma16(m):
    if not mm.has_wgmma(m.backend.get_device_info(m.backend.current_device)):
        pytest.skip("wgmma needs a Hopper GPU (sm_90a)")


def _check_wgmma16(m, out, ref, scale, K, dtype, what):
    """The family's bound on ||out - ref|| / || |A| @ |B| || and the elementwise one of the
    16-bit GEMM with float32 accumulation: each product of two 16-bit values is exact in
    float32, each of the K - 1 additions errs by at most one float32 ulp of a partial sum
    (<= S = |A| @ |B|: 2^-23 S, allowing a truncating tensor-core adder), the rounding to
    the output dtype by u |C| (u = 2^-11 float16, 2^-8 bfloat16; |C| <= |ref| + K 2^-23 S),
    and the float64 reference's own K 2^-52 S:
        |out - ref| <= K 2^-23 S (1 + u) + u |ref| + K 2^-52 S."""
    got = m.to_numpy(out).astype(np.float64)
    bound = FAMILIES["fp16" if dtype is DT.FLOAT16 else "bf16"][2]
    err = rel_err(got, ref, scale)
    assert err <= bound, (what, err)
    u = 2.0 ** -11 if dtype is DT.FLOAT16 else 2.0 ** -8
    elem = K * 2.0 ** -23 * scale * (1 + u) + u * np.abs(ref) + K * 2.0 ** -52 * scale
    worst = np.max(np.abs(got - ref) - elem)
    assert worst <= 0, (what, float(np.max(np.abs(got - ref) / (elem + 1e-300))))


@gpu
@pytest.mark.parametrize("fam", list(FAMS16))
@pytest.mark.parametrize("a_shape, b_shape", [
    ((1, 8), (8, 1)), ((77, 40), (40, 129)), ((131, 264), (264, 136)),
    ((3, 130, 296), (296, 33)), ((3, 130, 296), (3, 296, 200)), ((2, 257, 1000), (1000, 515)),
    ((1023, 1000), (1000, 1025)), ((64, 4096), (4096, 72))],
    ids=lambda s: "x".join(map(str, s)))
def test_gpu_wgmma16_configs(m, fam, a_shape, b_shape):
    """Every wgmma16 config through run_config into a poisoned output: M and N of no tile
    width, N odd (B's padded copy), K = 8 x odd (partial k-tiles), batches with B broadcast
    and full; within the family's bound and the 16-bit GEMM's elementwise one
    (_check_wgmma16). The operands meet wgmma16_ok, so the kernel itself runs."""
    _need_wgmma16(m)
    dtype = FAMS16[fam]
    rng = np.random.default_rng(4672)
    dev = m.backend.current_device
    a = to_dev(m, rand(rng, a_shape, dtype), dtype)
    b = to_dev(m, rand(rng, b_shape, dtype), dtype)
    ref, scale = reference(m, a, b)
    p = mm.plan_shapes(a.shape, b.shape)
    for cfg in W16:
        out = poisoned(m, ref.shape, dtype)
        assert mm.wgmma16_ok(dtype, a, out, p)
        vec = mm.is_vec_ok(a, b, out, p)
        mm.run_config(m, mm.WGMMA16_TEMPLATE, cfg, a, b, out, p, dtype, vec, dev)
        _check_wgmma16(m, out, ref, scale, p.K, dtype, (cfg, a_shape, b_shape))
        out.free()


@gpu
@pytest.mark.parametrize("fam", list(FAMS16))
def test_gpu_wgmma16_batch_over_grid_z(m, fam):
    """Every wgmma16 config on 70000 matrices (two launches over the grid's z), B full
    (70000 padded planes) and broadcast, N = 6 and 8."""
    _need_wgmma16(m)
    dtype = FAMS16[fam]
    rng = np.random.default_rng(70016)
    dev = m.backend.current_device
    for b_shape in ((70000, 8, 6), (8, 6), (70000, 16, 8)):
        K = b_shape[-2]
        a = to_dev(m, rand(rng, (70000, 3, K), dtype), dtype)
        b = to_dev(m, rand(rng, b_shape, dtype), dtype)
        ref, scale = reference(m, a, b)
        p = mm.plan_shapes(a.shape, b.shape)
        for cfg in W16:
            out = poisoned(m, ref.shape, dtype)
            mm.run_config(m, mm.WGMMA16_TEMPLATE, cfg, a, b, out, p, dtype,
                          mm.is_vec_ok(a, b, out, p), dev)
            _check_wgmma16(m, out, ref, scale, K, dtype, (cfg, b_shape))
            out.free()


def _memoized_public_and_plan_path(m, monkeypatch, dtype, prec, template, cfgs, check, seed,
                                   shapes=((1023, 1000, 1025), (300, 296, 512))):
    """matrix_multiply(precision=prec) with each of cfgs (of `template`) memoized as the
    call's choice (both alignment classes), at each (M, K, N) of shapes: the
    general path, then the per-call plan (run_config made to raise); then A one element
    past its 16-byte boundary, the plan dropped first: the general path
    (run_config's stand-in) and the plan (its runner's stand-in); each result checked by
    check(res, ref, scale, K, what)."""
    rng = np.random.default_rng(seed)
    dev = m.backend.current_device
    for (M, K, N) in shapes:
        av, bv = rand(rng, (M, K), dtype), rand(rng, (K, N), dtype)
        a, b = to_dev(m, av, dtype), to_dev(m, bv, dtype)
        ref, scale = reference(m, a, b)
        base = m.create_tensor((M * K + 8,), dtype)
        a_off = CudaTensor((M, K), dtype, base.device_id, base.ptr + dtype.itemsize, owner=base)
        m.backend.copy_to_device(m.to_numpy(a) if dtype is not DT.BFLOAT16 else
                                 to_bfloat16_bits(m.to_numpy(a)), a_off)
        p = mm.plan_shapes(a.shape, b.shape)
        key = ("matmul", a.shape, b.shape, dtype, dtype, dev, dev, prec)
        for cfg in cfgs:
            for vec in (True, False):
                mm.memo(m)[(p, dtype, prec, dev, vec)] = (template, cfg)
            m.plans.pop(key, None)
            for x, second in ((a, False), (a, True), (a_off, False), (a_off, True)):
                if x is a_off and not second:
                    m.plans.pop(key, None)
                poisoned(m, ref.shape, dtype).free()
                with monkeypatch.context() as mp:
                    if second:
                        mp.setattr("cuda_backend.ops.matmul_launch.run_config", _no_general_path)
                    res = m.matrix_multiply(x, b, precision=prec)
                assert key in m.plans
                check(res, ref, scale, K, (cfg, (M, K, N), second))
                res.free()
        for vec in (True, False):
            mm.memo(m).pop((p, dtype, prec, dev, vec), None)
        m.plans.pop(key, None)
        base.free()


@gpu
@pytest.mark.parametrize("fam", list(FAMS16))
def test_gpu_wgmma16_public_and_plan_path(m, fam, monkeypatch):
    """_memoized_public_and_plan_path over the wgmma16 configs: aligned (N % 8 == 0) and
    not (N odd: the padded copy), A off its boundary: the stand-ins; all within the
    bounds."""
    _need_wgmma16(m)
    dtype = FAMS16[fam]
    _memoized_public_and_plan_path(
        m, monkeypatch, dtype, None, mm.WGMMA16_TEMPLATE, W16,
        lambda res, ref, scale, K, what: _check_wgmma16(m, res, ref, scale, K, dtype, what),
        9786)


@gpu
@pytest.mark.parametrize("fam", list(FAMS16))
@pytest.mark.parametrize("a_shape, b_shape", PAD_A_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_wgmma16_padded_a_configs(m, fam, a_shape, b_shape):
    """Every wgmma16 config through run_config at K in {1, 7, 9, 997} (A's padded copy; the
    kernel reads k < K of its rows, the rest zero-filled in shared memory), M and N odd,
    batches with A broadcast and full, into a poisoned output; within _check_wgmma16's
    bounds."""
    _need_wgmma16(m)
    dtype = FAMS16[fam]
    rng = np.random.default_rng(997)
    dev = m.backend.current_device
    a = to_dev(m, rand(rng, a_shape, dtype), dtype)
    b = to_dev(m, rand(rng, b_shape, dtype), dtype)
    ref, scale = reference(m, a, b)
    p = mm.plan_shapes(a.shape, b.shape)
    for cfg in W16:
        out = poisoned(m, ref.shape, dtype)
        mm.run_config(m, mm.WGMMA16_TEMPLATE, cfg, a, b, out, p, dtype,
                      mm.is_vec_ok(a, b, out, p), dev)
        _check_wgmma16(m, out, ref, scale, p.K, dtype, (cfg, a_shape, b_shape))
        out.free()


@gpu
@pytest.mark.parametrize("fam", list(FAMS16))
def test_gpu_wgmma16_padded_a_public_and_plan_path(m, fam, monkeypatch):
    """matrix_multiply at K % 8 != 0 (1023x997x1025, 65x7x33, 1x9x5) with each wgmma16
    config memoized as the call's choice: the general path, then the per-call plan
    (run_config made to raise), both through A's padded copy; then the autotuner's own
    choice, twice; all within _check_wgmma16's bounds."""
    _need_wgmma16(m)
    dtype = FAMS16[fam]
    rng = np.random.default_rng(1025)
    dev = m.backend.current_device
    for (M, K, N) in ((1023, 997, 1025), (65, 7, 33), (1, 9, 5)):
        a = to_dev(m, rand(rng, (M, K), dtype), dtype)
        b = to_dev(m, rand(rng, (K, N), dtype), dtype)
        ref, scale = reference(m, a, b)
        p = mm.plan_shapes(a.shape, b.shape)
        key = ("matmul", a.shape, b.shape, dtype, dtype, dev, dev, None)
        for cfg in W16 + [None]:
            for vec in (True, False):
                if cfg is None:
                    mm.memo(m).pop((p, dtype, None, dev, vec), None)
                else:
                    mm.memo(m)[(p, dtype, None, dev, vec)] = (mm.WGMMA16_TEMPLATE, cfg)
            m.plans.pop(key, None)
            for second in (False, True):
                poisoned(m, ref.shape, dtype).free()
                with monkeypatch.context() as mp:
                    if second:
                        mp.setattr("cuda_backend.ops.matmul_launch.run_config", _no_general_path)
                    res = m.matrix_multiply(a, b)
                assert key in m.plans
                _check_wgmma16(m, res, ref, scale, K, dtype, (cfg, (M, K, N), second))
                res.free()
        for vec in (True, False):
            mm.memo(m).pop((p, dtype, None, dev, vec), None)
        m.plans.pop(key, None)


# -- TMA + wgmma (Hopper) float16 / bfloat16: matmul_tma16.cu.j2 --------------------------------
T16 = [mm.T16_128x256_s4, mm.T16_256x128_s4, mm.T16_128x128_s5]   # (the large class's order)
# every TMA config of a family, in all_configs' order
T16_ALL = {DT.FLOAT16: T16 + [mm.T16_128x64_s6, mm.T16_128x192_s4],
           DT.BFLOAT16: T16 + [mm.T16_128x64_s6, mm.T16_128x192_s4],
           DT.FLOAT32: T16 + [mm.T16_128x64_s7, mm.T16_128x192_s4]}
# The parameter layout of the kernel without bias as the H100 reported it (CUDA 13: the maps
# alignas(128) from c[0x0][0x210]): tm_a, tm_b, C, M, N, K; 0x184 bytes.
H100_LAYOUT = (((0x70, 128), (0xF0, 128), (0x170, 8), (0x178, 4), (0x17C, 4), (0x180, 4)),
               0x184)


def fake_map(ptr, code, dims, strides, box, swizzle):
    """A stand-in encoder's 128 bytes: its arguments, packed (tests read them back)."""
    import struct
    return struct.pack("<QI2Q1Q2I I", ptr, code, *dims, *strides, *box, swizzle).ljust(128, b"\0")


def read_fake_map(raw):
    import struct
    ptr, code, d0, d1, s0, b0, b1, sw = struct.unpack_from("<QI2Q1Q2I I", raw)
    return ptr, code, (d0, d1), (s0,), (b0, b1), sw


class _T16Recorder(_SkinnyRecorder):
    """_SkinnyRecorder picking the first TMA candidate, with the backend calls the TMA path
    makes: compile_kernel (recorded: name -> arch, arg_types), activate, prepare_launch (its
    launch_packed recorded in `packed`: kernel name, grid, block, shared memory, buffer)."""

    def __init__(self, cc=HOPPER):
        import contextlib
        import types
        super().__init__(True, cc=cc, kind="tma16")
        rec = self
        self.compiled, self.packed = {}, []
        backend = self.backend

        def compile_kernel(name, source, options=None, device_id=None, arch=None,
                           arg_types=None):
            rec.compiled[name] = (arch, arg_types)
            return types.SimpleNamespace(name=name, function=types.SimpleNamespace())

        class Prepared:
            def __init__(self, kernel, grid, block, smem):
                self.what = (kernel.name, grid, block, smem)

            def launch_packed(self, buf, stream=None):
                rec.packed.append(self.what + (buf,))

            def __call__(self, *args):   # (a stand-in's runner)
                rec.packed.append(self.what + (args,))

        backend.compile_kernel = compile_kernel
        backend.activate = lambda dev: contextlib.nullcontext()
        backend.prepare_launch = lambda k, g, b, s, d: Prepared(k, g, b, s)
        backend.get_kernel = lambda name, dev: types.SimpleNamespace(name=name)
        backend.memory_pools = {0: types.SimpleNamespace(allocate_current=lambda n: 9 << 30,
                                                         release=lambda block: None)}


@pytest.fixture
def t16_stubs(monkeypatch):
    """The layout query answers H100_LAYOUT, the encoder is fake_map (calls counted)."""
    from cuda_backend import tensor_maps
    from cuda_backend.ops import matmul_tma16
    calls = []

    def encoder(*args):
        calls.append(args)
        return fake_map(*args)
    monkeypatch.setattr(matmul_tma16, "kernel_layout", lambda *a: H100_LAYOUT)
    monkeypatch.setattr(tensor_maps, "get_encoder", lambda: encoder)
    return calls


def _check_packed(buf, dtype, cfg, a_ptr, b_ptr, c_ptr, M, N, K):
    """The buffer holds tm_a, tm_b, C, M, N, K at H100_LAYOUT's offsets, its size."""
    import struct
    (oa, _), (ob, _), (oc, _), (om, _), (on, _), (ok, _) = H100_LAYOUT[0]
    assert len(buf) == H100_LAYOUT[1]
    code = 6 if dtype is DT.FLOAT16 else 9
    assert read_fake_map(buf[oa:oa + 128]) == (a_ptr, code, (K, M), (K * 2,), (64, cfg["bm"]), 3)
    assert read_fake_map(buf[ob:ob + 128]) == (b_ptr, code, (N, K), (N * 2,), (64, 64), 3)
    assert struct.unpack_from("<Q", buf, oc)[0] == c_ptr
    assert [struct.unpack_from("<i", buf, o)[0] for o in (om, on, ok)] == [M, N, K]
    assert not any(buf[:oa]) and not any(buf[oa + 128:ob])   # (padding left zero)


def test_tma16_configs_render_for_sm_90a():
    """The TMA configs are candidates of the float16, bfloat16 and TF32 GEMMs only (not the
    linear layer's, not the A-transposed GEMM's, no other family), listed once per dtype
    with the input dtype's output, rendered without #error for sm_90a with the dtype's
    wgmma (TF32: k8, B's K-major descriptor, one B load per slot)."""
    from cuda_backend.kernels import TEMPLATE_ARCH, KernelGenerator
    gen = KernelGenerator(backend=object())
    assert TEMPLATE_ARCH[mm.TMA16_TEMPLATE] == "sm_90a"
    for dt, prec in ((DT.FLOAT16, None), (DT.BFLOAT16, None), (DT.FLOAT32, "tf32")):
        assert [c for c in mm.all_configs(dt, prec) if c.get("tma16")] == T16_ALL[dt]
        assert not any(c.get("tma16") for vec in (True, False)
                       for c in mm.linear_configs(dt, prec, vec) + mm.tn_configs(dt, prec, vec)
                       + mm.candidates(dt, prec, "large", False))
    for dt, prec in ((DT.FLOAT32, None), (DT.FLOAT32, "ieee"), (DT.FLOAT64, None)):
        assert not any(c.get("tma16") for c in mm.all_configs(dt, prec))
    sets = mm.template_variants()[mm.TMA16_TEMPLATE]
    assert sets == [mm.tma16_params(dt, c) for dt in (DT.FLOAT32, DT.FLOAT16, DT.BFLOAT16)
                    for c in T16_ALL[dt]]
    for params in sets:
        assert params["out_ctype"] == params["ctype"]
        _, src = gen.render_kernel(mm.TMA16_TEMPLATE, **params)
        wt, k = {"float16": ("f16", 16), "bfloat16": ("bf16", 16),
                 "float32": ("tf32", 8)}[params["dtype"]]
        assert f"m64n{params['bn']}k{k}.f32.{wt}.{wt}" in src and "#error" not in src
        assert f"#define BM {params['bm']}" in src and f"#define STAGES {params['stages']}" in src
        assert f"#define BK {128 // (4 if wt == 'tf32' else 2)} " in src
    assert mm.tma16_params(DT.FLOAT16, T16[0], DT.FLOAT32)["out_ctype"] == "float"
    assert mm.TMA16_STANDIN == mm.W16_128x128_s3 and mm.TMA16_THREADS == 384
    assert mm.tma_standin(DT.FLOAT32) == mm.T_128x128x32 in mm.SCALAR_OK
    assert mm.tma_standin(DT.BFLOAT16) == mm.TMA16_STANDIN


@pytest.mark.parametrize("fam", list(FAMS16))
@pytest.mark.parametrize("M, K, N", [(4096, 4096, 4096), (1023, 1000, 1032), (4099, 8, 1024),
                                     (2049, 40, 2056)])
def test_matmul_tma16_candidates_and_packed_launch(fam, M, K, N, t16_stubs):
    """On sm_90 a 16-bit GEMM of one aligned matrix (K, N multiples of 8) times the TMA
    configs of its class first (large: all three, then wgmma16, then mma.sync; medium: 128x128
    s5, 128x64 s6 and 128x192 s4 after wgmma16's); the chosen one compiles for sm_90a with TMA16_ARG_TYPES and launches
    min(tiles, 132) blocks of 384 threads, wgmma_smem bytes, its buffer packed at the kernel's
    offsets: A's map (dims (K, M), box (64, bm)), B's (dims (N, K), box (64, 64)), C, M, N, K.
    Later calls on the same buffers encode nothing."""
    dtype = FAMS16[fam]
    m = _T16Recorder()
    a, b = m.backend.empty((M, K), dtype), m.backend.empty((K, N), dtype)
    out = mm.matmul(m, a, b)
    p = mm.plan_shapes((M, K), (K, N))
    (cands,) = m.seen
    cls = mm.shape_class(p, 132)
    assert cands == mm.candidates(dtype, None, cls, True)
    t = [c for c in cands if c.get("tma16")]
    assert t == ([c for c in T16] if cls == "large" else
                 [mm.T16_128x128_s5, mm.T16_128x64_s6, mm.T16_128x192_s4])
    if cls == "large":
        assert cands[:3] == T16 and cands[3].get("wgmma16")
    cfg = t[0]
    m.packed.clear()
    m.launches.clear()
    t16_stubs.clear()
    for _ in range(2):
        mm.matmul(m, a, b, out=out)
    assert not m.launches and len(m.packed) == 2 and not t16_stubs   # (the first call's maps)
    name, grid, block, smem, buf = m.packed[0]
    assert m.compiled[name] == ("sm_90a", mm.TMA16_ARG_TYPES)
    tiles = -(-M // cfg["bm"]) * -(-N // cfg["bn"])
    assert grid == (min(tiles, 132), 1, 1) and block == (384, 1, 1)
    assert smem == mm.wgmma_smem(cfg)
    _check_packed(buf, dtype, cfg, a.ptr, b.ptr, out.ptr, M, N, K)
    assert m.packed[1][4] == buf


@pytest.mark.parametrize("fam", list(FAMS16))
def test_tma16_not_offered_where_it_cannot_run(fam, t16_stubs):
    """No TMA candidate for a batch, K or N not a multiple of 8, A, B or the output not
    16-byte aligned (though 8-byte aligned), a device other than sm_90, or the layouts the
    kernel does not read (the linear layer, matmul_nt, matmul_tn); the wgmma16 ones stay
    where they can run."""
    dtype = FAMS16[fam]

    def offered(m, kind="tma16"):
        return any(c.get(kind) for cands in m.seen for c in cands)

    def shifted(m, shape, by=4):
        base = m.backend.empty((int(np.prod(shape)) + 8,), dtype)
        return CudaTensor(shape, dtype, 0, base.ptr + 2 * by, owner=base)

    M, K, N = 1023, 1000, 1032
    m = _T16Recorder()
    mm.matmul(m, m.backend.empty((M, K), dtype), m.backend.empty((K, N), dtype))
    assert offered(m)                                         # (the control)
    for cc, a_shape, b_shape in ((HOPPER, (3, 130, 296), (296, 200)),
                                 (HOPPER, (3, 130, 296), (3, 296, 200)),
                                 (HOPPER, (M, 1001), (1001, N)), (HOPPER, (M, 996), (996, 1028)),
                                 (HOPPER, (M, K), (K, 1025)), ((8, 0), (M, K), (K, N)),
                                 ((10, 0), (M, K), (K, N))):
        m = _T16Recorder(cc)
        mm.matmul(m, m.backend.empty(a_shape, dtype), m.backend.empty(b_shape, dtype))
        assert m.seen and not offered(m), (cc, a_shape, b_shape)
    for which in ("a", "b", "out"):
        m = _T16Recorder()
        a = shifted(m, (M, K)) if which == "a" else m.backend.empty((M, K), dtype)
        b = shifted(m, (K, N)) if which == "b" else m.backend.empty((K, N), dtype)
        out = shifted(m, (M, N)) if which == "out" else None
        mm.matmul(m, a, b, out=out)
        assert m.seen and not offered(m), which
    for call in (lambda m, x, w: mm.linear(m, x, w, m.backend.empty((N,), dtype), "bias"),
                 lambda m, x, w: mm.matmul_nt(m, x, w),
                 lambda m, x, w: mm.matmul_tn(m, m.backend.empty((K, M), dtype),
                                              m.backend.empty((K, N), dtype))):
        m = _T16Recorder()
        call(m, m.backend.empty((M, K), dtype), m.backend.empty((N, K), dtype))
        assert m.seen and not offered(m)


@pytest.mark.parametrize("fam", list(FAMS16))
def test_tma16_run_config_gives_way_to_wgmma16(fam, t16_stubs):
    """run_config of a TMA config on a call it cannot take (a memoized choice meeting other
    pointers, a batch, another device) launches TMA16_STANDIN's wgmma16 kernel (or, where
    that cannot run either, its mma.sync stand-in): never the TMA kernel on bad operands. A
    float32 output is the kernel's other variant."""
    dtype = FAMS16[fam]
    M, K, N = 131, 264, 136
    p = mm.plan_shapes((M, K), (K, N))
    for cc, a_off, b_off, o_off, want in ((HOPPER, 0, 0, 8, "wgmma16"),
                                          (HOPPER, 0, 8, 0, "wgmma16"),
                                          (HOPPER, 8, 0, 0, "wgmma16"),
                                          (HOPPER, 2, 0, 0, "wgmma16"),
                                          (HOPPER, 0, 0, 2, "mma"), ((8, 0), 0, 0, 0, "mma")):
        m = _T16Recorder(cc)
        base_a = m.backend.empty((M * K + 8,), dtype)
        base_b = m.backend.empty((K * N + 8,), dtype)
        base_o = m.backend.empty((M * N + 8,), dtype)
        a = CudaTensor((M, K), dtype, 0, base_a.ptr + a_off, owner=base_a)
        b = CudaTensor((K, N), dtype, 0, base_b.ptr + b_off, owner=base_b)
        out = CudaTensor((M, N), dtype, 0, base_o.ptr + o_off, owner=base_o)
        for cfg in T16_ALL[dtype]:
            m.launches.clear()
            mm.run_config(m, mm.TMA16_TEMPLATE, cfg, a, b, out, p, dtype, False, 0)
            assert not m.packed
            k = m.launches[-1][0]   # (after A's, B's padded copies where misaligned)
            assert k == (mm.wgmma16_params(dtype, mm.TMA16_STANDIN) if want == "wgmma16" else
                         mm.kernel_params(mm.MMA_TEMPLATE, dtype, mm.WGMMA16_STANDIN, False))
    m = _T16Recorder()
    pb = mm.plan_shapes((2, M, K), (K, N))
    mm.run_config(m, mm.TMA16_TEMPLATE, T16[0], m.backend.empty((2, M, K), dtype),
                  m.backend.empty((K, N), dtype), m.backend.empty((2, M, N), dtype), pb, dtype,
                  True, 0)
    assert not m.packed and m.launches[-1][0] == mm.wgmma16_params(dtype, mm.TMA16_STANDIN)
    for out_dtype in (dtype, DT.FLOAT32):   # (the control: both outputs)
        m = _T16Recorder()
        a, b = m.backend.empty((M, K), dtype), m.backend.empty((K, N), dtype)
        out = m.backend.empty((M, N), out_dtype)
        mm.run_config(m, mm.TMA16_TEMPLATE, T16[2], a, b, out, p, dtype, True, 0)
        (name, grid, block, smem, buf), = m.packed
        assert grid == (4, 1, 1) and not m.launches   # (2 x 2 tiles of 128 x 128)
        _check_packed(buf, dtype, T16[2], a.ptr, b.ptr, out.ptr, M, N, K)
        params = mm.tma16_params(dtype, T16[2], out_dtype)
        assert name == m.generator.render_kernel(mm.TMA16_TEMPLATE, **params)[0]


@pytest.mark.parametrize("fam", list(FAMS16))
def test_tma16_plan_runner_launches(fam, t16_stubs):
    """The per-call plan of a TMA choice (mm.config_runner): one packed launch per call, the
    maps of the call's pointers (encoded once per pointer pair while it is among the last
    few); pointers not 16-byte aligned run the stand-in's runner; a plan of shapes the kernel
    cannot take (a batch, N % 8) is the stand-in's runner outright."""
    dtype = FAMS16[fam]
    M, K, N = 1023, 1000, 1032
    p = mm.plan_shapes((M, K), (K, N))
    for cfg in T16_ALL[dtype]:
        m = _T16Recorder()
        run = mm.config_runner(m, mm.TMA16_TEMPLATE, cfg, p, dtype, True, 0)
        t16_stubs.clear()
        for pa in (1 << 20, 5 << 20, 1 << 20):
            m.packed.clear()
            run(pa, 2 << 20, 3 << 20, 0)
            (name, grid, block, smem, buf), = m.packed
            assert block == (384, 1, 1) and smem == mm.wgmma_smem(cfg)
            _check_packed(buf, dtype, cfg, pa, 2 << 20, 3 << 20, M, N, K)
        assert len(t16_stubs) == 3     # (two As, one B; the third call's maps cached)
        m.packed.clear()
        run(1 << 20, 2 << 20, (3 << 20) + 8, 0)   # (C 8 bytes off: the wgmma16 kernel's)
        (name, *_, args), = m.packed
        assert isinstance(args, tuple) and args[:3] == (1 << 20, 2 << 20, (3 << 20) + 8)
        assert name == m.generator.render_kernel(
            mm.WGMMA16_TEMPLATE, **mm.wgmma16_params(dtype, mm.TMA16_STANDIN))[0]
    for shapes in (((2, M, K), (K, N)), ((M, K), (K, 1028))):
        m = _T16Recorder()
        pp = mm.plan_shapes(*shapes)
        run = mm.config_runner(m, mm.TMA16_TEMPLATE, T16[0], pp, dtype, True, 0)
        run(1 << 20, 2 << 20, 3 << 20, 0)
        assert m.packed and all(isinstance(x[-1], tuple) for x in m.packed)


def test_tensor_maps_ctypes_encoder_arguments():
    """tensor_maps.ctypes_encoder calls cuTensorMapEncodeTiled with the map's 64-byte aligned
    address, the data type, rank 2, the address, dims / strides / box innermost first, unit
    element strides, no interleave, the swizzle, 256-byte L2 promotion, zero fill, and returns
    the 128 bytes the driver wrote; a failing CUresult is a typed error."""
    import ctypes
    from cuda_backend import tensor_maps
    seen = []

    def encode(out, code, rank, ptr, dims, strides, box, elem, *enums):
        addr = out.value
        seen.append((addr % 64, code, rank, ptr.value, list(dims[:2]), [strides[0]],
                     list(box[:2]), list(elem[:2]), enums))
        ctypes.memmove(addr, bytes(range(128)), 128)
        return 0 if ptr.value != 0xBAD0 else 1
    lib = type("Lib", (), {})()
    lib.cuTensorMapEncodeTiled = encode
    enc = tensor_maps.ctypes_encoder(lib)
    assert enc(0x7000, 9, (1000, 1023), (2000,), (64, 128), 3) == bytes(range(128))
    assert seen == [(0, 9, 2, 0x7000, [1000, 1023], [2000], [64, 128], [1, 1], (0, 3, 3, 0))]
    with pytest.raises(InvalidArgumentError, match="CUresult 1"):
        enc(0xBAD0, 6, (8, 8), (16,), (8, 8), 0)


def test_tensor_maps_encode_2d_checks_and_order(monkeypatch):
    """encode_2d gives the encoder dims (cols, rows), the row stride, box (box_cols,
    box_rows), the dtype's code and the swizzle; bad geometry is a typed error before any
    driver call; with neither cuda.bindings nor libcuda.so.1, CudaNotAvailableError names
    both."""
    import sys
    from cuda_backend import tensor_maps
    from cuda_backend.errors import CudaNotAvailableError
    calls = []
    monkeypatch.setattr(tensor_maps, "get_encoder",
                        lambda: lambda *a: calls.append(a) or bytes(128))
    assert tensor_maps.encode_2d(0x1000, DT.BFLOAT16, 1023, 1000, 2000, 128, 64) == bytes(128)
    tensor_maps.encode_2d(0x1000, DT.FLOAT16, 3, 8, 16, 64, 64, swizzle128=False)
    tensor_maps.encode_2d(0x1000, DT.FLOAT32, 3, 8, 32, 64, 8, round_tf32=True)
    tensor_maps.encode_2d(0x1000, DT.FLOAT32, 3, 8, 32, 64, 8)
    tensor_maps.encode_2d(0x1000, DT.FLOAT16, 3, 8, 16, 64, 8, round_tf32=True)
    assert calls == [(0x1000, 9, (1000, 1023), (2000,), (64, 128), 3),
                     (0x1000, 6, (8, 3), (16,), (64, 64), 0),
                     (0x1000, 11, (8, 3), (32,), (8, 64), 3),    # TFLOAT32: rounds as copied
                     (0x1000, 7, (8, 3), (32,), (8, 64), 3),
                     (0x1000, 6, (8, 3), (16,), (8, 64), 3)]     # (16-bit: no TF32 rounding)
    for bad in ((0x1008, DT.FLOAT16, 8, 8, 16, 8, 8), (0x1000, DT.FLOAT16, 8, 8, 24, 8, 8),
                (0x1000, DT.FLOAT16, 8, 16, 16, 8, 8), (0x1000, DT.FLOAT16, 0, 8, 16, 8, 8),
                (0x1000, DT.FLOAT16, 8, 8, 16, 8, 128), (0x1000, DT.FLOAT16, 8, 8, 16, 300, 8),
                (0x1000, DT.FLOAT64, 8, 8, 64, 8, 8)):
        with pytest.raises(InvalidArgumentError):
            tensor_maps.encode_2d(*bad)
    assert len(calls) == 5
    monkeypatch.undo()

    def no_driver():
        raise CudaNotAvailableError("libcuda.so.1 cannot be loaded (test)")
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setattr(tensor_maps, "driver_library", no_driver)
    tensor_maps.clear_encoder()
    try:
        with pytest.raises(CudaNotAvailableError, match="cuda.bindings.*libcuda"):
            tensor_maps.get_encoder()
    finally:
        tensor_maps.clear_encoder()


def test_tensor_maps_param_layout_and_pack():
    """param_layout reads cuFuncGetParamInfo until it fails, on PyCUDA's Function handle
    where there is one (a kernel without one and no cubin is a typed error); pack_params
    puts each field at its offset and checks the count and the sizes."""
    import types
    from cuda_backend import tensor_maps
    from cuda_backend.errors import CudaNotAvailableError, LaunchConfigurationError
    offsets = [o for o, _ in H100_LAYOUT[0]]
    sizes = [s for _, s in H100_LAYOUT[0]]

    def info(func, i, off, size):
        assert func.value == 0x1234
        if i >= len(offsets):
            return 1
        off._obj.value, size._obj.value = offsets[i], sizes[i]
        return 0
    lib = types.SimpleNamespace(cuFuncGetParamInfo=info)
    assert tensor_maps.function_layout(lib, 0x1234) == H100_LAYOUT
    kernel = types.SimpleNamespace(name="k", function=types.SimpleNamespace())
    orig = tensor_maps.driver_library
    try:
        tensor_maps.driver_library = lambda: lib
        assert tensor_maps.param_layout(
            types.SimpleNamespace(name="k", function=types.SimpleNamespace(handle=0x1234))) \
            == H100_LAYOUT
        with pytest.raises(CudaNotAvailableError, match="handle"):
            tensor_maps.param_layout(kernel)
    finally:
        tensor_maps.driver_library = orig
    fields = [("128s", b"a" * 128), ("128s", b"b" * 128), ("Q", 7), ("i", 1), ("i", 2),
              ("i", 3)]
    buf = tensor_maps.pack_params(fields, H100_LAYOUT)
    assert len(buf) == 0x184 and buf[0x70:0xF0] == b"a" * 128 and buf[0xF0:0x170] == b"b" * 128
    assert buf[0x170:0x184] == (7).to_bytes(8, "little") + b"\1\0\0\0\2\0\0\0\3\0\0\0"
    with pytest.raises(LaunchConfigurationError, match="6 parameters"):
        tensor_maps.pack_params(fields[:5], H100_LAYOUT)
    with pytest.raises(LaunchConfigurationError, match="parameter 2"):
        tensor_maps.pack_params(fields[:2] + [("i", 7)] + fields[3:], H100_LAYOUT)


def _check_tma16(m, out, ref, scale, K, dtype, what):
    """_check_wgmma16's bounds, the output's rounding u that of out's dtype (0 for float32:
    the accumulator is stored as it is):
        |out - ref| <= K 2^-23 S (1 + u) + u |ref| + K 2^-52 S."""
    got = m.to_numpy(out).astype(np.float64)
    bound = FAMILIES["fp16" if dtype is DT.FLOAT16 else "bf16"][2]
    err = rel_err(got, ref, scale)
    assert err <= bound, (what, err)
    u = {DT.FLOAT16: 2.0 ** -11, DT.BFLOAT16: 2.0 ** -8, DT.FLOAT32: 0.0}[out.dtype]
    elem = K * 2.0 ** -23 * scale * (1 + u) + u * np.abs(ref) + K * 2.0 ** -52 * scale
    worst = np.max(np.abs(got - ref) - elem)
    assert worst <= 0, (what, float(np.max(np.abs(got - ref) / (elem + 1e-300))))


@gpu
@pytest.mark.parametrize("fam", list(FAMS16))
@pytest.mark.parametrize("M, K, N", [
    (1, 8, 8), (1, 1000, 1032), (77, 40, 136), (131, 264, 136), (257, 24, 520),
    (1023, 1000, 1032), (2049, 1000, 2056)], ids=lambda s: str(s))
def test_gpu_tma16_configs(m, fam, M, K, N):
    """Every TMA config through run_config into a poisoned output of the input dtype and of
    float32: M and N of no tile width (M = 1 too), N a multiple of 8, K = 8 x odd (K < 64: one
    partial k-tile, zero-filled by the tensor map), more tiles than SMs (2049 x 2056: the
    persistent loop); within the bounds of _check_tma16. The operands meet tma16_usable, so
    the kernel itself runs."""
    _need_wgmma16(m)
    dtype = FAMS16[fam]
    rng = np.random.default_rng(1616)
    dev = m.backend.current_device
    a = to_dev(m, rand(rng, (M, K), dtype), dtype)
    b = to_dev(m, rand(rng, (K, N), dtype), dtype)
    ref, scale = reference(m, a, b)
    p = mm.plan_shapes(a.shape, b.shape)
    info = m.backend.get_device_info(dev)
    for cfg in T16_ALL[dtype]:
        for out_dtype in (dtype, DT.FLOAT32):
            out = poisoned(m, ref.shape, out_dtype)
            assert mm.tma16_usable(info, dtype, a, b, out, p)
            mm.run_config(m, mm.TMA16_TEMPLATE, cfg, a, b, out, p, dtype, True, dev)
            _check_tma16(m, out, ref, scale, K, dtype, (cfg, out_dtype.name_str, M, K, N))
            out.free()


@gpu
@pytest.mark.parametrize("fam", list(FAMS16))
def test_gpu_tma16_public_and_plan_path(m, fam, monkeypatch):
    """_memoized_public_and_plan_path over the TMA configs (16-bit) at shapes the TMA kernel
    takes (N % 8 == 0), A off its boundary: the stand-ins; all within the bounds."""
    _need_wgmma16(m)
    dtype = FAMS16[fam]
    _memoized_public_and_plan_path(
        m, monkeypatch, dtype, None, mm.TMA16_TEMPLATE, T16_ALL[dtype],
        lambda res, ref, scale, K, what: _check_tma16(m, res, ref, scale, K, dtype, what),
        1617, shapes=((1023, 1000, 1032), (300, 296, 512)))


@gpu
@pytest.mark.parametrize("fam", list(FAMS16))
@pytest.mark.parametrize("M, K, N", [(1000, 64, 1032), (200, 72, 264)], ids=lambda s: str(s))
def test_gpu_tma16_epilogue_store_paths(m, fam, M, K, N):
    """The 16-bit epilogue's store paths, N a multiple of 8 but not of 16, M and N of no
    tile width: C 16-byte aligned (16-byte stores inside N, paired stores for the span
    across N) through run_config, then C 4 bytes past a 16-byte boundary (paired stores
    only; tma16_usable declines it, so run_tma16 directly). Each C is a view into a
    poisoned buffer with 0 (then 2) elements before it and 16 after: every element within
    the bounds of _check_tma16, no element outside C written."""
    _need_wgmma16(m)
    from cuda_backend.ops import matmul_tma16
    dtype = FAMS16[fam]
    rng = np.random.default_rng(1618)
    dev = m.backend.current_device
    a = to_dev(m, rand(rng, (M, K), dtype), dtype)
    b = to_dev(m, rand(rng, (K, N), dtype), dtype)
    ref, scale = reference(m, a, b)
    p = mm.plan_shapes(a.shape, b.shape)
    info = m.backend.get_device_info(dev)
    for cfg in T16_ALL[dtype]:
        for lead in (0, 2):
            base = poisoned(m, (lead + M * N + 16,), dtype)
            out = CudaTensor((M, N), dtype, base.device_id, base.ptr + lead * dtype.itemsize,
                             owner=base)
            if lead == 0:
                assert mm.tma16_usable(info, dtype, a, b, out, p)
                mm.run_config(m, mm.TMA16_TEMPLATE, cfg, a, b, out, p, dtype, True, dev)
            else:
                assert not mm.tma16_usable(info, dtype, a, b, out, p)
                params = mm.tma16_params(dtype, cfg, dtype)
                matmul_tma16.run_tma16(m, mm.cached_kernel(m, mm.TMA16_TEMPLATE, dev, params),
                                       params, cfg, a, b, out, p, dtype, dev, mm.memo(m))
            _check_tma16(m, out, ref, scale, K, dtype, (cfg, lead, M, K, N))
            whole = m.to_numpy(base).astype(np.float64)
            assert np.isnan(whole[:lead]).all() and np.isnan(whole[lead + M * N:]).all(), \
                (cfg, lead, M, K, N)
            base.free()


# -- TMA + wgmma TF32: matmul_tma16.cu.j2 for float32 with precision="tf32" ------------------
def _tf32_operands(m, seed, M, K, N):
    """(dtype, device, a, b, float64 reference, scale) of a float32 (M, K) @ (K, N) on fresh
    random inputs, for the TF32 tests on Hopper (skipped elsewhere)."""
    _need_wgmma16(m)
    dtype = DT.FLOAT32
    rng = np.random.default_rng(seed)
    a = to_dev(m, rand(rng, (M, K), dtype), dtype)
    b = to_dev(m, rand(rng, (K, N), dtype), dtype)
    ref, scale = reference(m, a, b)
    return dtype, m.backend.current_device, a, b, ref, scale


def _check_tma_tf32(m, out, ref, scale, K, what):
    """The TF32 family's bound on ||out - ref|| / || |A| @ |B| ||, and elementwise: A
    rounded to TF32 by the tensor map's copy and Bt by the transpose (each <= 2^-11 of the
    value, test_gpu_tma_tf32_rounds_a), K float32 additions:
        |out - ref| <= (2^-11 + 2^-11 + 2^-22 + K 2^-23) S + K 2^-52 S."""
    got = m.to_numpy(out).astype(np.float64)
    err = rel_err(got, ref, scale)
    assert err <= FAMILIES["tf32"][2], (what, err)
    elem = (2.0 ** -10 + 2.0 ** -22 + K * 2.0 ** -23 + K * 2.0 ** -52) * scale
    worst = np.max(np.abs(got - ref) - elem)
    assert worst <= 0, (what, float(np.max(np.abs(got - ref) / (elem + 1e-300))))


@gpu
@pytest.mark.parametrize("M, K, N", [
    (1, 4, 1), (1, 1000, 1031), (77, 36, 129), (131, 260, 136), (257, 12, 513),
    (1023, 1000, 1025), (2049, 1004, 2056)], ids=lambda s: str(s))
def test_gpu_tma_tf32_configs(m, M, K, N):
    """Every TMA config through run_config as TF32 (float32 operands; B transposed and
    rounded into Bt first) into a poisoned float32 output: M and N of no tile width (odd N:
    the element stores), K = 4 x odd (partial k-tiles zero-filled by the tensor maps), more
    tiles than SMs (the persistent loop); within _check_tma_tf32's bounds."""
    dtype, dev, a, b, ref, scale = _tf32_operands(m, 3232, M, K, N)
    p = mm.plan_shapes(a.shape, b.shape)
    info = m.backend.get_device_info(dev)
    for cfg in T16_ALL[dtype]:
        out = poisoned(m, ref.shape, dtype)
        assert mm.tma16_usable(info, dtype, a, b, out, p)
        mm.run_config(m, mm.TMA16_TEMPLATE, cfg, a, b, out, p, dtype, True, dev)
        _check_tma_tf32(m, out, ref, scale, K, (cfg, M, K, N))
        out.free()


@gpu
def test_gpu_tma_tf32_public_and_plan_path(m, monkeypatch):
    """_memoized_public_and_plan_path over the TMA configs as TF32 (precision="tf32"): the
    stand-ins (mma.sync TF32) for A off its boundary; K not a multiple of 4 is not offered
    the TMA configs at all (tma16_shape_ok); all within _check_tma_tf32's bounds."""
    _need_wgmma16(m)
    assert not mm.tma16_shape_ok(DT.FLOAT32, mm.plan_shapes((64, 66), (66, 64)))
    # (N a multiple of 4: an odd N runs as the padded GEMM, test_gpu_tf32_unaligned_padded)
    _memoized_public_and_plan_path(
        m, monkeypatch, DT.FLOAT32, "tf32", mm.TMA16_TEMPLATE, T16_ALL[DT.FLOAT32],
        lambda res, ref, scale, K, what: _check_tma_tf32(m, res, ref, scale, K, what), 3233,
        shapes=((1023, 1000, 1028), (300, 296, 512)))


@gpu
@pytest.mark.parametrize("M, K, N", [
    (1023, 997, 1025), (300, 257, 300), (260, 300, 259), (517, 63, 1001), (77, 5, 131)],
    ids=lambda s: str(s))
def test_gpu_tf32_unaligned_padded(m, M, K, N, monkeypatch):
    """precision="tf32" with K or N not a multiple of 4 past the small class (Hopper): the
    operands copied into zero-filled rows of K and N rounded up to 4 (matmul_pad), the call
    tuned and run as that aligned GEMM (its memo entry is the padded shape's), C's first N
    columns copied out. First call the general path, second the per-call plan (run_config
    made to raise), then A one float past its 16-byte boundary (the plan declines it where
    A is read in place: general path); each within _check_tma_tf32's bounds for the real
    K. The small shape keeps its own path (no padded entry)."""
    dtype, dev, a, b, ref, scale = _tf32_operands(m, 3234, M, K, N)
    base = m.create_tensor((M * K + 8,), dtype)
    a_off = CudaTensor((M, K), dtype, dev, base.ptr + 4, owner=base)
    m.backend.copy_to_device(m.to_numpy(a), a_off)
    kp, np_ = -(-K // 4) * 4, -(-N // 4) * 4
    padded = mm.plan_shapes((M, kp), (kp, np_))
    big = M * N * K > 256 ** 3
    key = ("matmul", (M, K), (K, N), dtype, dtype, dev, dev, "tf32")
    m.plans.pop(key, None)
    for x, second in ((a, False), (a, True), (a_off, False)):
        poisoned(m, ref.shape, dtype).free()
        with monkeypatch.context() as mp:
            if second and big:
                mp.setattr("cuda_backend.ops.matmul_launch.run_config", _no_general_path)
            res = m.matrix_multiply(x, b, precision="tf32")
        _check_tma_tf32(m, res, ref, scale, K, ((M, K, N), second, x is a_off))
        res.free()
        entries = [k for k in mm.memo(m) if type(k) is tuple and len(k) == 5 and
                   k[0] == padded and k[2] == "tf32"]
        assert bool(entries) == big, (M, K, N)
        if big:
            assert key in m.plans, (M, K, N)
    base.free()


@gpu
def test_gpu_tma_tf32_rounds_a(m):
    """The TF32 kernel's A reaches the tensor cores rounded to TF32 to nearest (the tensor
    map's TFLOAT32 type), not truncated: with B = ones in row 0, C[r, :] = round(A[r, 0]):
    1 + 3 2^-12 -> 1 + 2^-10, 1 + 2^-12 -> 1, 1 + 5 2^-13 -> 1 + 2^-10, -(1 + 3 2^-12) ->
    -(1 + 2^-10); B's values are TF32 already (the transpose rounds them too)."""
    _need_wgmma16(m)
    dtype = DT.FLOAT32
    dev = m.backend.current_device
    A = np.zeros((128, 128), np.float32)
    vals = [1 + 3 * 2.0 ** -12, 1 + 2.0 ** -12, 1 + 5 * 2.0 ** -13, -(1 + 3 * 2.0 ** -12)]
    want = [1 + 2.0 ** -10, 1.0, 1 + 2.0 ** -10, -(1 + 2.0 ** -10)]
    A[:4, 0] = vals
    B = np.zeros((128, 136), np.float32)
    B[0, :] = 1.0
    a, b = to_dev(m, A, dtype), to_dev(m, B, dtype)
    p = mm.plan_shapes(a.shape, b.shape)
    for cfg in T16_ALL[dtype]:
        out = poisoned(m, (128, 136), dtype)
        mm.run_config(m, mm.TMA16_TEMPLATE, cfg, a, b, out, p, dtype, True, dev)
        c = m.to_numpy(out)
        assert c[:4, 0].tolist() == want and (c[:4] == c[:4, :1]).all(), (cfg, c[:4, 0])
        assert not c[4:].any()
        out.free()
