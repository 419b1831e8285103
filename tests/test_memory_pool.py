"""MemoryPool statistics, limits, pointer API and the OOM ladder over a fake allocator."""
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cuda_backend import (CudaBackendError, CudaOutOfMemoryError, InvalidArgumentError,
                          InvalidPointerError)
from cuda_backend.memory import HostBinnedPool, MemoryPool
from cuda_backend.memory_host import LARGE_BLOCK, round_to_bin, round_to_fine_bin


class FakeAllocator:
    """`size -> (buffer, pointer)` with distinct fake pointers; can be told to fail."""

    def __init__(self) -> None:
        self.next_ptr = 0x10000
        self.fail_next = 0        # fail this many calls, then succeed
        self.always_fail = False
        self.calls = []           # sizes asked for (successful or not)
        self.failures = 0

    def __call__(self, size: int):
        self.calls.append(size)
        if self.always_fail or self.fail_next > 0:
            self.fail_next = max(self.fail_next - 1, 0)
            self.failures += 1
            raise MemoryError(f"fake allocator: out of memory for {size} bytes")
        ptr = self.next_ptr
        self.next_ptr += size + 0x1000
        return bytearray(0), ptr


def make_pool(device_total: int = 1 << 30, device_id: int = 0):
    alloc = FakeAllocator()
    return MemoryPool(device_id, HostBinnedPool(alloc), device_total=device_total), alloc


def stats(pool):
    return pool.get_stats()


def test_round_to_bin():
    assert round_to_bin(1) == 256 and round_to_bin(256) == 256
    assert round_to_bin(257) == 320
    assert round_to_bin(1000) == 1024
    assert round_to_bin(1 << 20) == 1 << 20
    for n in (300, 1234, 99999, 12345678):
        b = round_to_bin(n)
        assert n <= b < n * 1.25 + 1


def test_fresh_pool_stats():
    pool, _ = make_pool()
    s = stats(pool)
    assert s == {"total_allocated": 0, "active_memory": 0, "peak_allocated": 0,
                 "allocation_count": 0, "active_blocks": 0, "cached_bytes": 0, "free_count": 0,
                 "n_free_blocks": 0, "hits": 0, "misses": 0, "oom_retries": 0, "limit": 0}


def test_allocate_free_cycles_stats():
    pool, alloc = make_pool()
    a = pool.allocate(1000)   # bin 1024
    b = pool.allocate(3000)   # bin 3072
    assert a.size == 1024 and b.size == 3072 and int(a) != int(b)
    s = stats(pool)
    assert s["active_memory"] == 4096 and s["peak_allocated"] == 4096
    assert s["total_allocated"] == 4000 and s["allocation_count"] == 2
    assert s["misses"] == 2 and s["hits"] == 0 and s["active_blocks"] == 2
    assert pool.used_bytes() == 4096 and pool.total_bytes() == 4096 and pool.free_bytes() == 0

    pool.release(a)
    pool.release(b)
    s = stats(pool)
    assert s["active_memory"] == 0 and s["peak_allocated"] == 4096
    assert s["free_count"] == 2 and s["cached_bytes"] == 4096 and s["n_free_blocks"] == 2
    assert pool.used_bytes() == 0 and pool.total_bytes() == 4096
    assert pool.free_bytes() == 4096 and pool.n_free_blocks() == 2

    # same bins again: served from the cache, the allocator is not called
    for cycle in range(3):
        x = pool.allocate(1000)
        y = pool.allocate(2900)  # also bin 3072
        pool.release(x)
        pool.release(y)
    assert len(alloc.calls) == 2
    s = stats(pool)
    assert s["hits"] == 6 and s["misses"] == 2
    assert s["allocation_count"] == 8 and s["free_count"] == 8
    assert s["active_memory"] == 0 and s["peak_allocated"] == 4096
    assert s["total_allocated"] == 4000 + 3 * 3900

    # a new bin is a miss and raises the peak
    big = pool.allocate(10_000)
    assert stats(pool)["misses"] == 3
    assert stats(pool)["peak_allocated"] == big.size
    big.free()   # freed directly, not through release(): still counted as freed
    assert stats(pool)["free_count"] == 9
    assert stats(pool)["active_memory"] == 0


def test_free_all_blocks_and_reset_peak():
    pool, _ = make_pool()
    blocks = [pool.allocate(n) for n in (100, 5000, 70_000)]
    for blk in blocks:
        pool.release(blk)
    assert pool.n_free_blocks() == 3 and pool.free_bytes() > 0
    pool.free_all_blocks()
    assert pool.n_free_blocks() == 0 and pool.free_bytes() == 0 and pool.total_bytes() == 0
    assert stats(pool)["cached_bytes"] == 0
    assert stats(pool)["peak_allocated"] > 0
    pool.reset_peak_stats()
    assert stats(pool)["peak_allocated"] == 0
    x = pool.allocate(100)
    assert stats(pool)["peak_allocated"] == x.size


def test_set_limit_size_and_fraction():
    pool, _ = make_pool(device_total=1 << 20)
    assert pool.get_limit() == 0
    pool.set_limit(size=4096)
    assert pool.get_limit() == 4096 and stats(pool)["limit"] == 4096
    pool.set_limit(fraction=0.5)
    assert pool.get_limit() == 1 << 19
    pool.set_limit()
    assert pool.get_limit() == 0
    pool.set_limit(size=0)
    assert pool.get_limit() == 0
    for kwargs in ({"size": -1}, {"fraction": 1.5}, {"fraction": -0.1},
                   {"size": 10, "fraction": 0.1}):
        with pytest.raises(InvalidArgumentError):
            pool.set_limit(**kwargs)
    assert pool.get_limit() == 0


def test_request_over_limit_raises_quickly():
    pool, alloc = make_pool()
    pool.set_limit(size=64 * 1024)
    keep = pool.allocate(32 * 1024)
    calls = len(alloc.calls)
    t0 = time.perf_counter()
    with pytest.raises(CudaOutOfMemoryError) as info:
        pool.allocate(40_000)
    assert time.perf_counter() - t0 < 0.5
    err = info.value
    msg = str(err)
    assert isinstance(err, MemoryError) and isinstance(err, CudaBackendError)
    assert "65536 bytes" in msg and "64.00 KiB" in msg          # the limit
    assert "(40000 bytes)" in msg                                # the request
    assert "set_limit" in msg
    assert err.requested == 40_000 and err.limit == 65536 and err.device_id == 0
    assert len(alloc.calls) == calls, "the allocator must not be asked past the limit"
    # the pool is unchanged and still works
    assert stats(pool)["active_memory"] == keep.size
    ok = pool.allocate(16 * 1024)
    assert stats(pool)["active_memory"] == keep.size + ok.size


def test_limit_counts_cached_blocks_and_frees_them_first():
    pool, _ = make_pool()
    pool.set_limit(size=8192)
    a = pool.allocate(4096)
    pool.release(a)             # 4096 cached
    assert pool.total_bytes() == 4096
    b = pool.allocate(6000)     # bin 6144: 4096 cached + 6144 > limit -> cache freed, fits
    assert pool.n_free_blocks() == 0 and pool.total_bytes() == b.size
    with pytest.raises(CudaOutOfMemoryError):
        pool.allocate(4096)     # 6144 in use + 4096 > 8192
    assert stats(pool)["active_memory"] == b.size


def test_oom_ladder_free_cached_and_retry():
    pool, alloc = make_pool()
    held = pool.allocate(10_000)
    pool.release(held)
    assert pool.n_free_blocks() == 1
    alloc.fail_next = 1
    blk = pool.allocate(50_000)   # another bin: the allocator fails once
    assert blk.size == round_to_bin(50_000)
    s = stats(pool)
    assert s["oom_retries"] == 1
    assert alloc.failures == 1
    assert s["n_free_blocks"] == 0 and s["cached_bytes"] == 0, "cached blocks were freed"
    assert s["active_memory"] == blk.size
    assert s["allocation_count"] == 2


def test_oom_retry_counts_as_a_miss():
    pool, alloc = make_pool()
    alloc.fail_next = 1
    pool.allocate(1000)
    assert stats(pool)["misses"] == 1 and stats(pool)["hits"] == 0


def test_oom_always_failing_raises_typed_error():
    pool, alloc = make_pool(device_id=3)
    live = pool.allocate(2048)
    cached = pool.allocate(512)
    pool.release(cached)
    alloc.always_fail = True
    with pytest.raises(CudaOutOfMemoryError) as info:
        pool.allocate(1_000_000)
    err = info.value
    msg = str(err)
    assert isinstance(err, MemoryError)
    assert "(1000000 bytes)" in msg and "tried to allocate" in msg
    assert "device 3" in msg
    assert "In use by the pool: 2.00 KiB" in msg
    assert "cached free blocks: 0 B" in msg   # the ladder freed them before giving up
    assert "even after freeing cached blocks" in msg
    assert err.requested == 1_000_000 and err.in_use == 2048 and err.device_id == 3
    assert alloc.failures == 2, "tried once, freed the cache, retried once"
    assert stats(pool)["oom_retries"] == 1
    assert stats(pool)["active_memory"] == live.size
    # the pool recovers as soon as the allocator does
    alloc.always_fail = False
    again = pool.allocate(1_000_000)
    assert stats(pool)["active_memory"] == live.size + again.size


def test_oom_message_reports_cached_bytes_when_not_freed():
    pool, alloc = make_pool()
    pool.set_limit(size=1024)
    blk = pool.allocate(512)
    pool.release(blk)           # 512 cached
    with pytest.raises(CudaOutOfMemoryError) as info:
        pool.allocate(2048)
    assert "cached free blocks:" in str(info.value)
    assert "pool limit: 1.00 KiB" in str(info.value)


def test_pointer_api():
    pool, _ = make_pool()
    assert pool.allocate_memory(0) == 0
    pool.free_memory(0)  # freeing the null pointer is a no-op
    p = pool.allocate_memory(1000)
    q = pool.allocate_memory(1000)
    assert p and q and p != q
    assert stats(pool)["active_memory"] == 2048
    pool.free_memory(p)
    assert stats(pool)["active_memory"] == 1024
    with pytest.raises(InvalidPointerError) as info:
        pool.free_memory(p)   # double free
    assert f"0x{p:x}" in str(info.value)
    assert isinstance(info.value, KeyError)
    assert str(info.value).startswith("pointer 0x")  # not KeyError's repr() quoting
    with pytest.raises(InvalidPointerError, match="0xdeadbeef"):
        pool.free_memory(0xDEADBEEF)
    assert stats(pool)["active_memory"] == 1024
    r = pool.allocate_memory(1000)  # reuses p's cached block
    assert r == p
    pool.free_memory(q)
    pool.free_memory(r)
    assert stats(pool)["active_memory"] == 0


@pytest.mark.parametrize("bad", [-1, -4096, 1.5, "10", None, True])
def test_bad_sizes_raise_invalid_argument(bad):
    pool, _ = make_pool()
    keep = pool.allocate(100)
    with pytest.raises(InvalidArgumentError) as info:
        pool.allocate(bad)
    assert repr(bad) in str(info.value)  # the message names the bad value
    with pytest.raises(InvalidArgumentError):
        pool.allocate_memory(bad)
    assert stats(pool)["active_memory"] == keep.size
    assert stats(pool)["allocation_count"] == 1
    assert pool.allocate(100).size == 256


def test_size_zero_block_and_numpy_sizes():
    import numpy as np
    pool, _ = make_pool()
    blk = pool.allocate(0)       # a real (minimum-size) block, so it has a pointer
    assert blk.size == 256 and int(blk) != 0
    blk2 = pool.allocate(np.int64(300))
    assert blk2.size == 320


# -- property tests ------------------------------------------------------------------------

class PoolMachine(RuleBasedStateMachine):
    """Random allocate / release / pointer / failure sequences keep the books balanced."""

    def __init__(self):
        super().__init__()
        self.pool, self.alloc = make_pool()
        self.blocks = []     # live blocks from allocate()
        self.ptrs = {}       # live pointers from allocate_memory() -> size
        self.peak = 0

    def live_bytes(self):
        return sum(b.size for b in self.blocks) + sum(self.ptrs.values())

    @rule(size=st.integers(min_value=0, max_value=1 << 20))
    def allocate(self, size):
        blk = self.pool.allocate(size)
        assert blk.size >= size
        self.blocks.append(blk)
        self.peak = max(self.peak, self.live_bytes())

    @rule(size=st.integers(min_value=1, max_value=1 << 16))
    def allocate_pointer(self, size):
        ptr = self.pool.allocate_memory(size)
        assert ptr not in self.ptrs
        self.ptrs[ptr] = round_to_bin(size)
        self.peak = max(self.peak, self.live_bytes())

    @rule(size=st.integers(min_value=1, max_value=1 << 20), always=st.booleans())
    def allocate_under_failure(self, size, always):
        before = self.live_bytes()
        if always:
            self.alloc.always_fail = True
        else:
            self.alloc.fail_next = 1
        try:
            blk = self.pool.allocate(size)
        except CudaOutOfMemoryError as exc:
            assert exc.requested == size
        else:
            self.blocks.append(blk)
        finally:
            self.alloc.always_fail = False
            self.alloc.fail_next = 0
        assert self.pool.used_bytes() >= before
        self.peak = max(self.peak, self.live_bytes())

    @precondition(lambda self: self.blocks)
    @rule(index=st.integers(min_value=0), direct=st.booleans())
    def release(self, index, direct):
        blk = self.blocks.pop(index % len(self.blocks))
        if direct:
            blk.free()
        else:
            self.pool.release(blk)

    @precondition(lambda self: self.ptrs)
    @rule(index=st.integers(min_value=0))
    def free_pointer(self, index):
        ptr = sorted(self.ptrs)[index % len(self.ptrs)]
        del self.ptrs[ptr]
        self.pool.free_memory(ptr)
        with pytest.raises(InvalidPointerError):
            self.pool.free_memory(ptr)

    @rule()
    def free_all_blocks(self):
        self.pool.free_all_blocks()
        assert self.pool.n_free_blocks() == 0

    @invariant()
    def books_balance(self):
        s = self.pool.get_stats()
        assert s["active_memory"] == self.live_bytes()
        assert s["active_blocks"] == len(self.blocks) + len(self.ptrs)
        assert s["free_count"] == s["allocation_count"] - s["active_blocks"]
        assert s["hits"] + s["misses"] == s["allocation_count"]
        assert s["peak_allocated"] == self.peak
        assert s["cached_bytes"] == self.pool.total_bytes() - self.pool.used_bytes() >= 0
        assert s["n_free_blocks"] == self.pool.n_free_blocks()


class TestPoolMachine(PoolMachine.TestCase):
    """The state machine in the default run: a few short sequences."""

    settings = settings(max_examples=10, stateful_step_count=20, deadline=None)


@pytest.mark.slow
class TestPoolMachineLong(PoolMachine.TestCase):
    """60 sequences of up to 30 steps (seconds; --runslow)."""

    settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# -- the large pool (requests of LARGE_BLOCK bytes or more, finer bins) -------------------------
def make_split_pool(device_total: int = 1 << 34):
    small, large = FakeAllocator(), FakeAllocator()
    pool = MemoryPool(0, HostBinnedPool(small), device_total=device_total,
                      large=HostBinnedPool(large, rounding=round_to_fine_bin))
    return pool, small, large


def test_round_to_fine_bin():
    assert round_to_fine_bin(1) == 256 and round_to_fine_bin(LARGE_BLOCK) == LARGE_BLOCK
    for n in (LARGE_BLOCK + 1, 72 << 20, 1646821376, 3 * 10**9 + 7):
        b = round_to_fine_bin(n)
        assert n <= b <= n + n / 16 and b % 256 == 0
    # the GPT-2-small logits (8192 x 50257 float32): 1600 MiB, not the 3-bit bins' 1792
    assert round_to_fine_bin(8192 * 50257 * 4) == 1600 << 20
    assert round_to_bin(8192 * 50257 * 4) == 1792 << 20


def test_large_requests_take_the_large_pool():
    pool, small, large = make_split_pool()
    n = 72 << 20                                   # 3-bit bins: 80 MiB; finer ones: 72
    a = pool.allocate(n)
    b = pool.allocate(1000)
    assert large.calls == [72 << 20] and small.calls == [1024]
    s = stats(pool)
    assert s["active_memory"] == (72 << 20) + 1024 and s["peak_allocated"] == s["active_memory"]
    assert s["active_blocks"] == 2 and s["misses"] == 2
    a.free()
    s = stats(pool)
    assert s["cached_bytes"] == 72 << 20 and s["n_free_blocks"] == 1
    assert s["peak_allocated"] == (72 << 20) + 1024
    c = pool.allocate(n - 5)                       # the same fine bin: a hit, no new block
    assert large.calls == [72 << 20] and stats(pool)["hits"] == 1
    assert pool.total_bytes() == (72 << 20) + 1024
    c.free()
    b.free()
    pool.free_all_blocks()
    assert pool.total_bytes() == 0 and stats(pool)["n_free_blocks"] == 0


def test_large_pool_limit_and_oom_ladder():
    pool, small, large = make_split_pool()
    pool.set_limit(100 << 20)
    keep = pool.allocate(64 << 20)
    with pytest.raises(CudaOutOfMemoryError):
        pool.allocate(40 << 20)                    # 64 + 40 MiB over the 100 MiB limit
    assert stats(pool)["active_memory"] == 64 << 20
    keep.free()
    pool.set_limit(0)
    cached = pool.allocate(40 << 20)
    cached.free()                                  # 40 MiB cached in the large pool
    large.fail_next = 1                            # the next new block fails once: the ladder
    again = pool.allocate(48 << 20)                # frees the cached blocks and retries
    assert stats(pool)["oom_retries"] == 1 and again is not None
    again.free()
