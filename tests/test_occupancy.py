"""occupancy.blocks_per_sm against the CUDA occupancy calculator (cuda_occupancy.h, the
arithmetic PyCUDA's OccupancyRecord copies), and each op's launch sizing against the
hand-written formulas it replaced, on an H100 / H200's limits (CPU only)."""
import itertools
from types import SimpleNamespace

import pytest

from cuda_backend import occupancy
from cuda_backend.devices import CudaDeviceInfo
from cuda_backend.dtypes import CudaDataType
from cuda_backend.ops import matmul as mm, matmul_configs as mc
from cuda_backend.ops import layer_norm_plans as lp
from cuda_backend.ops import normalization_common as nc
from cuda_backend.ops import reduction_config as rcfg
from cuda_backend.ops import softmax as sm
from cuda_backend.ops import transpose as tr

# H100 / H200: 228 KiB shared memory per SM, 1 KiB reserved per block, 64K registers,
# 2048 threads and 32 blocks per SM
H100 = CudaDeviceInfo(device_id=0, name="stub H100", compute_capability=(9, 0),
                      memory_total=80 << 30, multiprocessor_count=132,
                      shared_memory_per_block_optin=227 * 1024,
                      shared_memory_per_multiprocessor=228 * 1024,
                      registers_per_block=65536, registers_per_multiprocessor=65536,
                      max_threads_per_multiprocessor=2048, max_blocks_per_multiprocessor=32,
                      reserved_shared_memory_per_block=1024)


def calculator(regs, threads, smem, sm_smem=228 * 1024, reserve=1024, sm_regs=65536,
               sm_threads=2048, sm_blocks=32, smem_unit=128, parts=4):
    """cudaOccMaxActiveBlocksPerMultiprocessor, Hopper branch, written out independently
    (launchable configurations only)."""
    warps = -(-threads // 32)
    by_warps = (sm_threads // 32) // warps
    if regs:
        per_warp = -(-regs * 32 // 256) * 256             # register allocation unit 256
        by_regs = (sm_regs // parts // per_warp) * parts // warps
    else:
        by_regs = 1 << 30
    alloc = -(-(smem + reserve) // smem_unit) * smem_unit
    by_smem = sm_smem // alloc if alloc else 1 << 30
    return min(by_warps, by_regs, by_smem, sm_blocks)


def occupancy_record(regs, threads, smem):
    """PyCUDA's OccupancyRecord ("warp" register allocation) on Hopper's limits, with the
    allocation units and the per-block reserve of today's calculator."""
    alloc_warps = -(-threads // 32)
    limits = [32, 64 // alloc_warps]
    if regs:
        limits.append(65536 // (alloc_warps * -(-regs * 32 // 256) * 256))
    limits.append((228 * 1024) // (-(-(smem + 1024) // 128) * 128))
    return min(limits)


def K(regs, static=0):
    return SimpleNamespace(num_regs=regs, static_shared_bytes=static)


@pytest.mark.parametrize("regs,threads,smem,want", [
    (32, 256, 0, 8),            # threads
    (40, 256, 0, 6),            # 1280 registers a warp
    (64, 256, 0, 4),
    (128, 128, 0, 4),
    (255, 128, 0, 2),           # 8192 registers a warp
    (16, 32, 0, 32),            # block limit
    (40, 96, 0, 16),            # 12 warps per sub-partition (not 65536 // 3840 = 17)
    (32, 256, 48 * 1024, 4),    # 49152 + 1024 reserved
    (32, 128, 100 * 1024, 2),
    (32, 32, 7000, 28),         # 8024 -> 8064 (128-byte unit)
    (0, 1024, 0, 2),            # no register limit
])
def test_known_values(regs, threads, smem, want):
    assert occupancy.blocks_per_sm(K(regs), H100, threads, smem) == want
    assert occupancy.blocks_per_sm(K(regs, smem), H100, threads) == want   # static == dynamic
    assert calculator(regs, threads, smem) == want


def test_matches_the_calculator_and_occupancy_record():
    for regs, threads, smem in itertools.product(
            (0, 16, 24, 32, 40, 48, 56, 64, 72, 80, 96, 128, 168, 200, 255),
            (32, 64, 96, 128, 192, 256, 384, 512, 768, 1024),
            (0, 1, 1000, 4096, 12345, 32 * 1024, 48 * 1024, 100 * 1024, 200 * 1024)):
        if regs * 32 * -(-threads // 32) > 65536:
            continue   # not launchable
        want = calculator(regs, threads, smem)
        if want == 0:
            continue
        got = occupancy.blocks_per_sm(K(regs), H100, threads, smem)
        assert got == want, (regs, threads, smem)
        assert occupancy.blocks_per_sm(K(regs), None, threads, smem) == want   # defaults
        if (threads // 32) % 4 == 0:   # whole sub-partitions: OccupancyRecord agrees
            assert got == occupancy_record(regs, threads, smem), (regs, threads, smem)


def test_reads_the_device_limits():
    k = K(32)
    assert occupancy.blocks_per_sm(k, H100, 256) == 8
    small = CudaDeviceInfo(device_id=1, name="stub", compute_capability=(7, 5),
                           memory_total=1 << 30, multiprocessor_count=4,
                           max_threads_per_multiprocessor=1024,
                           max_blocks_per_multiprocessor=16,
                           shared_memory_per_multiprocessor=64 * 1024,
                           reserved_shared_memory_per_block=0)
    assert occupancy.blocks_per_sm(k, small, 256) == 4                       # threads
    assert occupancy.blocks_per_sm(k, small, 32) == 16                       # blocks
    assert occupancy.blocks_per_sm(k, small, 64, 20 * 1024) == 3             # smem
    assert occupancy.blocks_per_sm(k, small, 32, 100) == 16                  # 256-byte unit
    half = CudaDeviceInfo(device_id=2, name="stub", compute_capability=(9, 0),
                          memory_total=1 << 30, multiprocessor_count=4,
                          registers_per_multiprocessor=32768)
    assert occupancy.blocks_per_sm(K(64), half, 256) == 2                    # registers
    assert occupancy.blocks_per_sm(K(64), H100, 256) == 4
    # unknown fields (0, or absent on a stand-in) take Hopper's values; never below 1
    bare = CudaDeviceInfo(device_id=3, name="host", compute_capability=(0, 0),
                          memory_total=0, multiprocessor_count=1)
    assert occupancy.blocks_per_sm(K(40), bare, 256, 48 * 1024) == \
        occupancy.blocks_per_sm(K(40), H100, 256, 48 * 1024) == 4
    assert occupancy.blocks_per_sm(K(40), SimpleNamespace(), 256) == 6
    assert occupancy.blocks_per_sm(K(64), H100, 1024, 200 * 1024) == 1


# -- the hand-written formulas it replaced ------------------------------------------------
def old_min_blocks(block, need):   # softmax.block_min_blocks / layer_norm_plans.ln_min_blocks
    best = 1
    for blocks in range(1, 2048 // block + 1):
        if (65536 // (block * blocks)) // 8 * 8 >= min(need, 255):
            best = blocks
    return best


def old_softmax(dtype, block, nv, prefetch):
    data = 4 * nv * (2 if prefetch else 1)
    if dtype is CudaDataType.FLOAT64:
        need = data + 36
    elif dtype is CudaDataType.FLOAT32:
        need = data + (24 if prefetch else 16)
    else:
        need = data + (40 if prefetch else 24)
    return old_min_blocks(block, need)


def test_softmax_min_blocks_unchanged():
    for dt in sm.common.FLOATS:
        for block, nv, prefetch in sm.BLOCK_CONFIGS:
            assert sm.block_min_blocks(dt, block, nv, prefetch) == \
                old_softmax(dt, block, nv, prefetch)


def test_layer_norm_min_blocks_unchanged():
    configs = [(c, True, False) for c in lp.LN_VEC_CONFIGS] + \
        [(c, True, True) for c in lp.LN_PREFETCH_CONFIGS] + \
        [(c, False, False) for c in lp.LN_SCALAR_CONFIGS] + \
        [((lp.LN_LOOP_BLOCK, 0, lp.LN_LOOP_BLOCK), v, False) for v in (True, False)]
    for dt in nc.DTYPES:
        for (tpr, vpt, block), use_vec, prefetch in configs:
            if block == 64:   # added after the helper; the old formula missed the register
                continue      # file's split into sub-partitions, which decides them
            vec = nc.vec_width(dt) if use_vec else 1
            if tpr == 32 or vpt == 0:
                want = 1 if block >= 1024 else 1024 // block
            else:
                words = vpt * max(1, vec * dt.itemsize // 4) * (2 if prefetch else 1)
                want = old_min_blocks(block, words + (lp.LN_WORK_REGS_F64
                                                      if dt is CudaDataType.FLOAT64
                                                      else lp.LN_WORK_REGS))
            assert lp.ln_min_blocks(dt, tpr, vpt, block, vec, prefetch) == want


def test_transpose_min_blocks_unchanged():
    for dt in tr.DTYPES:
        for (size, vb), tiles in tr.VEC_CONFIGS.items():
            if size != dt.itemsize:
                continue
            for tile, threads in tiles:
                sv = vb // dt.itemsize
                smem = tile * (tile + (1 if sv == 1 else 0)) * dt.itemsize
                passes = (tile // sv) ** 2 // threads
                regs = -(-(passes * sv * max(1, vb // 4) + (48 if sv == 8 else 32)) // 8) * 8
                old = max(1, min(2048 // threads, 227 * 1024 // smem, 16,
                                 65536 // (threads * regs)))
                assert tr._vec_min_blocks(dt, vb, tile, threads) == old, (dt, vb, tile)


def _simt_configs():
    return [v for k, v in vars(mc).items() if k[:2] in ("S_", "D_") and isinstance(v, dict)
            and "tm" in v]


def old_matmul(cfg, regs):
    threads = (cfg["bm"] // cfg["tm"]) * (cfg["bn"] // cfg["tn"])
    if regs <= 0:
        return cfg["min_blocks"]
    per_warp = -(-regs * 32 // 256) * 256
    smem = mm.simt_smem(cfg)
    by_smem = 233472 // (smem + 1024) if smem else 32
    return max(1, min(65536 // (per_warp * (threads // 32)), 2048 // threads, 32, by_smem))


def test_matmul_blocks_per_sm_and_split_unchanged():
    cfgs = _simt_configs()
    assert len(cfgs) > 10
    plans = [mm.Plan(1, 128, 128, 1 << 16, 0, 0, (128, 128)),
             mm.Plan(1, 512, 512, 8192, 0, 0, (512, 512)),
             mm.Plan(4, 64, 1024, 4096, 0, 0, (4, 64, 1024))]
    for cfg in cfgs:
        for regs in [0] + list(range(16, 256, 8)) + [255]:
            old = old_matmul(cfg, regs)
            assert mm.blocks_per_sm(cfg, regs) == old, (cfg, regs)
            assert mm.blocks_per_sm(cfg, regs, H100, 4) == old, (cfg, regs)
        for p in plans:
            assert mm.split_count(cfg, p, 132, 65535, mm.blocks_per_sm(cfg, 96, H100)) == \
                mm.split_count(cfg, p, 132, 65535, old_matmul(cfg, 96))
    # float64 multistage shared memory counts 8-byte elements (the old rule took 4)
    for cfg in cfgs:
        if cfg.get("stages"):
            threads = (cfg["bm"] // cfg["tm"]) * (cfg["bn"] // cfg["tn"])
            assert mm.blocks_per_sm(cfg, 64, H100, 8) == \
                calculator(64, threads, mm.simt_smem(cfg, 8))


def old_resident(regs, static, threads, info):
    regs = max(int(regs or 32), 1)
    warps = (threads + 31) // 32
    per_warp = ((regs * 32 + 255) // 256) * 256
    by_regs = int(info.registers_per_block or 65536) // (per_warp * warps)
    by_threads = int(info.max_threads_per_multiprocessor) // threads
    sm_total = int(info.shared_memory_per_multiprocessor or 228 * 1024)
    by_smem = sm_total // (static + 1024) if static else 32
    return max(1, min(by_regs, by_threads, by_smem, 32))


def test_reduction_waves_and_grids_unchanged():
    bare = CudaDeviceInfo(device_id=0, name="stub H100", compute_capability=(9, 0),
                          memory_total=80 << 30, multiprocessor_count=132)
    threads = {rcfg.BLOCK}
    axis_shapes = [(1, 13, 17, 4, True), (1, 1 << 20, 3, 4, True), (3, 5, 7, 8, True),
                   (1, 4096, 4096, 4, True), (1 << 16, 3, 64, 2, True), (7, 100, 12, 4, False),
                   (1, 2, 1 << 22, 4, True), (5, 999, 1, 4, True)]
    for shape in axis_shapes:
        c = rcfg.axis_config(*shape, 0)
        threads.add(c["bx"] * c["by"])
    for info in (H100, bare):
        for regs, static, t in itertools.product((0, 16, 32, 40, 64, 96, 128), (0, 2048, 16384),
                                                 sorted(threads)):
            old = old_resident(regs, static, t, info)
            new = rcfg.resident_blocks(K(regs, static), info, t)
            # the old rule ignored the register file's 4 sub-partitions (blocks of 1-3 warps
            # and 5-7: 40 registers x 64 threads fit 24 blocks, not 25) and the 128-byte unit
            assert new == calculator(regs, t, static), (regs, static, t)
            if (t // 32) % 4 == 0:
                assert new == old, (regs, static, t)
            # the split launches' wave (at most SPLIT_BLOCKS_PER_SM a SM) and grids: unchanged
            old_wave = 132 * min(rcfg.SPLIT_BLOCKS_PER_SM, old)
            wave = 132 * min(rcfg.SPLIT_BLOCKS_PER_SM, new)
            for rows, R in [(1, 1 << 28), (64, 1 << 16), (1000, 7), (3, 1025)]:
                assert rcfg.rows_config(rows, R, 4, wave) == rcfg.rows_config(rows, R, 4, old_wave)
            for shape in axis_shapes:
                assert rcfg.axis_config(*shape, wave) == rcfg.axis_config(*shape, old_wave)
