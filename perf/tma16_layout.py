"""NumPy emulation of templates/matmul_tma16.cu.j2's bookkeeping, run on the CPU.

It replays, with the template's own formulas:
(1) the mbarrier ring: one producer thread and two consumer warpgroups (4 warps each) under
    random interleavings, with the TMA loads and the wgmma batches completing asynchronously
    at random later times. Each barrier is modelled as the PTX ISA describes it (pending
    arrivals, transaction bytes, phase completes when both reach zero; try_wait.parity P
    succeeds iff the current phase's parity differs from P). It checks that every wait
    succeeds exactly when the phase it means has completed (no parity aliasing: the barrier
    is never two phases ahead of, or behind, a waiter), that a slot is never overwritten
    while a wgmma batch may still read it, that every batch reads the k-tile it should, and
    that the run ends with no deadlock;
(2) the persistent tile loop: blocks b, b + grid, ... with tile_origin's grouped order cover
    every tile exactly once;
(3) the shared-memory layout: TMA's SWIZZLE_128B boxes (out-of-bounds zero fill) read back
    through the kernel's wgmma descriptors (the canonical 128-byte-swizzle layouts of the PTX
    ISA's "Matrix Descriptor" section, as perf/wgmma16_layout.py models them) give exactly
    each consumer's A rows and the B tile, for every k-step and slot;
(4) the 16-bit epilogue: the wgmma D fragment, the quad transpose by shuffles and the
    16-byte stores (edge spans and misaligned C: the paired stores) write every element of
    C exactly once with its value, bm 128 / 256, bn 128 / 256, with and without bias.
It checks the kernel against these models, not against the hardware: perf/tma16_check.py
does that.

Usage: python perf/tma16_layout.py  (prints OK, exits 1 on a mismatch)
"""
from __future__ import annotations

import sys

import numpy as np

ROW = 128
BK = 64


# -- (1) the mbarrier ring ----------------------------------------------------------------

class Barrier:
    """An mbarrier: expected arrivals per phase, pending arrivals and transaction bytes."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.pending = count
        self.tx = 0
        self.completed = 0          # phases completed so far; the current phase's number

    def _maybe_complete(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.count

    def arrive(self) -> None:
        assert self.pending > 0
        self.pending -= 1
        self._maybe_complete()

    def arrive_expect_tx(self, nbytes: int) -> None:
        self.tx += nbytes            # expect_tx, then the arrival (one instruction)
        self.arrive()

    def complete_tx(self, nbytes: int) -> None:
        self.tx -= nbytes
        assert self.tx >= 0
        self._maybe_complete()

    def try_wait_parity(self, parity: int) -> bool:
        return (self.completed & 1) != parity


def ring_run(stages: int, ktiles: int, ntiles: int, rng: np.random.Generator) -> None:
    """One random interleaving of the producer, 2 consumer warpgroups and the async units."""
    stage_bytes = 1000
    full = [Barrier(1) for _ in range(stages)]
    empty = [Barrier(2 * 4) for _ in range(stages)]
    slot_data = [None] * stages           # (tile, kt) the slot holds
    readers = [set() for _ in range(stages)]  # in-flight batches reading the slot
    uses_p = [0] * stages                 # producer: uses of each slot so far
    async_ops: list = []                  # pending TMA / wgmma completions

    # producer state (the template's loop, flattened over tiles and k-tiles)
    prod = {"i": 0, "stage": 0, "phase": 0}
    total = ntiles * ktiles

    cons = []
    for w in range(2):
        cons.append({"i": 0, "stage": 0, "phase": 0, "state": "wait_full", "prev": 0,
                     "batches": [], "uses": [0] * stages, "to_arrive": [], "done": False,
                     "id": w})

    def producer_step() -> bool:
        if prod["i"] >= total:
            return False
        s, ph = prod["stage"], prod["phase"]
        i_use = uses_p[s]
        ok = empty[s].try_wait_parity(ph ^ 1)
        # the i-th use of a slot needs i releases (phases) of its empty barrier, exactly
        assert ok == (empty[s].completed == i_use), (ok, empty[s].completed, i_use)
        assert ok or empty[s].completed == i_use - 1
        if not ok:
            return False
        assert not readers[s], "slot overwritten while a wgmma batch may read it"
        full[s].arrive_expect_tx(stage_bytes)
        tile, kt = divmod(prod["i"], ktiles)
        # A box and bn / 64 B boxes: split the bytes over 3 completions in any order
        for part in (400, 300, 300):
            async_ops.append(("tma", s, (tile, kt), part))
        slot_data[s] = None               # being written
        uses_p[s] += 1
        prod["i"] += 1
        prod["stage"] += 1
        if prod["stage"] == stages:
            prod["stage"], prod["phase"] = 0, ph ^ 1
        return True

    def consumer_step(c: dict) -> bool:
        if c["done"]:
            return False
        if c["to_arrive"]:                # lanes 0 of the 4 warps arrive one at a time
            s = c["to_arrive"].pop(int(rng.integers(len(c["to_arrive"]))))
            empty[s].arrive()
            return True
        tile, kt = divmod(c["i"], ktiles)
        if c["state"] == "wait_full":
            s, ph = c["stage"], c["phase"]
            ok = full[s].try_wait_parity(ph)
            i_use = c["uses"][s]
            assert ok == (full[s].completed == i_use + 1), (ok, full[s].completed, i_use)
            assert ok or full[s].completed == i_use
            if not ok:
                return False
            assert slot_data[s] == (tile, kt), (slot_data[s], tile, kt)
            b = {"slot": s, "want": (tile, kt), "done": False, "c": c["id"]}
            readers[s].add(id(b))
            c["batches"].append(b)
            async_ops.append(("mma", b))
            c["uses"][s] += 1
            c["state"] = "wait1"
            return True
        if c["state"] == "wait1":             # wgmma.wait_group 1, release the previous slot
            # all but the newest committed group complete (the ISA's wait_group N)
            if any(not b["done"] for b in c["batches"][:-1]):
                return False
            if kt > 0:
                c["to_arrive"] += [c["prev"]] * 4
            c["prev"] = c["stage"]
            c["stage"] += 1
            if c["stage"] == stages:
                c["stage"], c["phase"] = 0, c["phase"] ^ 1
            c["i"] += 1
            c["state"] = "wait0" if kt == ktiles - 1 else "wait_full"
            return True
        if c["state"] == "wait0":             # after the tile: wait_group 0, release its last
            if any(not b["done"] for b in c["batches"]):
                return False
            c["batches"] = []
            c["to_arrive"] += [c["prev"]] * 4
            c["state"] = "flush" if c["i"] >= total else "wait_full"
            return True
        if c["state"] == "flush":
            c["done"] = not c["to_arrive"]
            return True
        raise AssertionError(c["state"])

    def async_step() -> bool:
        if not async_ops:
            return False
        op = async_ops.pop(int(rng.integers(len(async_ops))))
        if op[0] == "tma":
            _, s, data, part = op
            # the bytes land before the barrier's transaction count drops
            if slot_data[s] is None or slot_data[s] == data:
                slot_data[s] = data
            assert not readers[s]
            full[s].complete_tx(part)
        else:
            b = op[1]
            # the batch reads its slot somewhere before it completes: check it still holds
            # the k-tile it was issued for
            assert slot_data[b["slot"]] == b["want"], (slot_data[b["slot"]], b["want"])
            b["done"] = True
            readers[b["slot"]].discard(id(b))
        return True

    actors = [producer_step, lambda: consumer_step(cons[0]), lambda: consumer_step(cons[1]),
              async_step]
    idle = 0
    while True:
        order = rng.permutation(len(actors))
        progressed = False
        for a in order:
            if actors[a]():
                progressed = True
                break
        if not progressed:
            idle += 1
            if all(c["done"] for c in cons) and not async_ops and prod["i"] == total:
                break
            raise AssertionError("deadlock: nothing can progress")
    for s in range(stages):
        # every use of every slot was released once by each of the 8 consumer warps
        assert empty[s].completed == uses_p[s], (s, empty[s].completed, uses_p[s])
        assert full[s].completed == uses_p[s]


# -- (2) the persistent tile loop ---------------------------------------------------------

def tile_origin(t: int, tiles_m: int, tiles_n: int, group_m: int, bm: int,
                bn: int) -> tuple:
    per_group = group_m * tiles_n
    first_m = (t // per_group) * group_m
    group_rows = min(tiles_m - first_m, group_m)
    return (first_m + (t % per_group) % group_rows) * bm, ((t % per_group) // group_rows) * bn


def tiles_ok(M: int, N: int, bm: int, bn: int, group_m: int, grid: int) -> bool:
    tiles_m, tiles_n = -(-M // bm), -(-N // bn)
    seen = []
    for b in range(grid):
        for t in range(b, tiles_m * tiles_n, grid):
            seen.append(tile_origin(t, tiles_m, tiles_n, group_m, bm, bn))
    want = sorted((i * bm, j * bn) for i in range(tiles_m) for j in range(tiles_n))
    return sorted(seen) == want


# -- (3) TMA boxes read through the wgmma descriptors -------------------------------------

def desc(addr: int, lbo: int, sbo: int) -> int:
    """The template's smem_desc."""
    return ((addr & 0x3FFFF) >> 4) | (((lbo >> 4) & 0x3FFF) << 16) \
        | (((sbo >> 4) & 0x3FFF) << 32) | (1 << 62)


def decode(d: int) -> dict:
    return {"start": (d & 0x3FFF) << 4, "lbo": ((d >> 16) & 0x3FFF) << 4,
            "sbo": ((d >> 32) & 0x3FFF) << 4, "base_offset": (d >> 49) & 7,
            "layout": (d >> 62) & 3}


def swz128(addr: np.ndarray) -> np.ndarray:
    """128-byte swizzle: 16-byte chunk bits 4-6 XOR row-in-period bits 7-9."""
    return addr ^ (((addr >> 7) & 7) << 4)


def read_kmajor(smem: np.ndarray, d: int, rows: int, k: int) -> np.ndarray:
    f = decode(d)
    assert f["layout"] == 1 and f["base_offset"] == 0
    m = np.arange(rows)[:, None]
    kk = np.arange(k)[None, :]
    addr = f["start"] + (m // 8) * f["sbo"] + (m % 8) * 128 + kk * 2
    return smem[swz128(addr) // 2]


def read_mnmajor(smem: np.ndarray, d: int, k: int, n: int) -> np.ndarray:
    f = decode(d)
    assert f["layout"] == 1 and f["base_offset"] == 0
    kk = np.arange(k)[:, None]
    nn = np.arange(n)[None, :]
    addr = f["start"] + (nn // 64) * f["lbo"] + (nn % 64) * 2 + (kk // 8) * f["sbo"] \
        + (kk % 8) * 128
    return smem[swz128(addr) // 2]


def tma_box(smem: np.ndarray, dst: int, G: np.ndarray, c0: int, c1: int, rows: int) -> None:
    """cp.async.bulk.tensor.2d with SWIZZLE_128B: box {64, rows} of G (dims {cols, rows},
    innermost first) at coordinates (c0, c1) into a 1024-aligned dst; zeros out of bounds."""
    assert dst % 1024 == 0
    R, Cn = G.shape
    r = np.arange(rows)[:, None]
    c = np.arange(64)[None, :]
    gr, gc = c1 + r, c0 + c
    inside = (gr < R) & (gc < Cn)
    val = np.where(inside, G[np.minimum(gr, R - 1), np.minimum(gc, Cn - 1)], 0)
    addr = dst + r * ROW + c * 2
    smem[swz128(addr) // 2] = val


def layout_ok(bm: int, bn: int, stages: int, M: int, N: int, K: int,
              rng: np.random.Generator) -> bool:
    A = rng.integers(1, 65535, size=(M, K), dtype=np.uint16)   # distinct-ish element ids
    B = rng.integers(1, 65535, size=(K, N), dtype=np.uint16)
    a_bytes, b_bytes = bm * ROW, bn * ROW
    stage_bytes = a_bytes + b_bytes
    s_base = 5 * 1024
    smem = np.full((s_base + stages * stage_bytes) // 2, 0xDEAD, np.uint16)
    tiles_m, tiles_n = -(-M // bm), -(-N // bn)
    mi = bm // 128
    ok = True
    for t in range(tiles_m * tiles_n):
        m0, n0 = tile_origin(t, tiles_m, tiles_n, 8, bm, bn)
        for kt in range(-(-K // BK)):
            stage = int(rng.integers(stages))
            sa = s_base + stage * stage_bytes
            tma_box(smem, sa, A, kt * BK, m0, bm)
            for j in range(bn // 64):
                tma_box(smem, sa + a_bytes + j * BK * ROW, B, n0 + 64 * j, kt * BK, BK)
            Az = np.zeros((bm, BK), np.uint16)
            ra, ca = min(M, m0 + bm) - m0, min(K, kt * BK + BK) - kt * BK
            Az[:ra, :ca] = A[m0:m0 + ra, kt * BK:kt * BK + ca]
            Bz = np.zeros((BK, bn), np.uint16)
            rb, cb = min(K, kt * BK + BK) - kt * BK, min(N, n0 + bn) - n0
            Bz[:rb, :cb] = B[kt * BK:kt * BK + rb, n0:n0 + cb]
            off = stage * stage_bytes
            b_desc0 = desc(s_base + a_bytes, BK * ROW, 1024)
            for cw in range(2):
                for i in range(mi):
                    a_desc0 = desc(s_base + (cw * (bm // 2) + 64 * i) * ROW, 16, 1024)
                    for kk in range(4):
                        a = read_kmajor(smem, a_desc0 + ((off + kk * 32) >> 4), 64, 16)
                        b = read_mnmajor(smem, b_desc0 + ((off + kk * 16 * ROW) >> 4), 16, bn)
                        r0 = cw * (bm // 2) + 64 * i
                        ok &= bool((a == Az[r0:r0 + 64, kk * 16:kk * 16 + 16]).all())
                        ok &= bool((b == Bz[kk * 16:kk * 16 + 16]).all())
    return ok


def fragments_ok(bm: int, bn: int) -> bool:
    """Epilogue: every (row, col) of the tile is stored by exactly one (consumer, thread, i,
    j, h, q), the template's row / column formulas."""
    count = np.zeros((bm, bn), np.int32)
    for cw in range(2):
        for tid in range(128):
            lane, warp = tid % 32, tid // 32
            for i in range(bm // 128):
                for j in range(bn // 8):
                    for h in range(2):
                        r = cw * (bm // 2) + 64 * i + warp * 16 + (lane >> 2) + h * 8
                        for q in range(2):
                            count[r, (lane & 3) * 2 + j * 8 + q] += 1
    return bool((count == 1).all())


def pack2(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """pack_out2 per lane: two float32 values rounded to float16, lo in the low half."""
    pair = np.stack([lo.astype(np.float16), hi.astype(np.float16)], axis=-1)
    return np.ascontiguousarray(pair).view(np.uint32)[..., 0]


def epilogue16_ok(bm: int, bn: int, M: int, N: int, aligned: bool, with_bias: bool,
                  rng: np.random.Generator) -> bool:
    """The 16-bit epilogue over every tile of an M x N C: accumulators taken from a random
    float32 product through the wgmma D fragment (thread t: d[4 j + 2 h + e] at row
    16 (t / 32) + (t % 32) / 4 + 8 h, column 8 j + 2 (t % 4) + e), then, per 16-column span,
    the template's quad transpose (__shfl_xor_sync over 32 lanes at once) and 16-byte
    stores, or its paired / single stores at the edge and for misaligned C (aligned False).
    Checks every element of C is written exactly once with float16(acc + bias), that
    nothing outside C is written, and that each 16-byte store is 16-byte aligned (C's base
    being so) and each paired store 4-byte aligned."""
    mi, tiles_m, tiles_n = bm // 128, -(-M // bm), -(-N // bn)
    D = rng.standard_normal((tiles_m * bm, tiles_n * bn)).astype(np.float32)
    bias = (rng.standard_normal(tiles_n * bn).astype(np.float32) if with_bias
            else np.zeros(tiles_n * bn, np.float32))
    want = (D[:M, :N] + bias[:N]).astype(np.float16)
    C = np.zeros((M, N), np.float16)
    count = np.zeros((M, N), np.int32)
    flat = C.reshape(-1)
    cflat = count.reshape(-1)
    vec16 = N % 8 == 0 and aligned
    pair = N % 2 == 0
    lane = np.arange(32)
    q = lane & 3
    q0, q1 = (q & 1) != 0, (q & 2) != 0
    ok = True

    def shfl_xor(v: np.ndarray, m: int) -> np.ndarray:
        return v[lane ^ m]

    def write(r: int, c: int, vals: np.ndarray) -> bool:
        if not (0 <= r < M and 0 <= c and c + len(vals) <= N):
            return False
        flat[r * N + c:r * N + c + len(vals)] = vals
        cflat[r * N + c:r * N + c + len(vals)] += 1
        return True

    for tm in range(tiles_m):
        for tn in range(tiles_n):
            m0, n0 = tm * bm, tn * bn
            for cw in range(2):
                for warp in range(4):
                    acc = np.zeros((mi, bn // 2, 32), np.float32)   # acc[i][idx] per lane
                    for i in range(mi):
                        for j in range(bn // 8):
                            for h in range(2):
                                for e in range(2):
                                    row = (m0 + cw * (bm // 2) + 64 * i + 16 * warp
                                           + lane // 4 + 8 * h)
                                    col = n0 + 8 * j + 2 * q + e
                                    acc[i, 4 * j + 2 * h + e] = D[row, col]
                    for s in range(bn // 16):
                        cs = n0 + 16 * s
                        bb = np.zeros((2, 2, 32), np.float32)
                        for g in range(2):
                            c = cs + 8 * g + 2 * q
                            bb[g, 0] = np.where(c < N, bias[np.minimum(c, len(bias) - 1)], 0)
                            bb[g, 1] = np.where(c + 1 < N,
                                                bias[np.minimum(c + 1, len(bias) - 1)], 0)
                        for i in range(mi):
                            if vec16 and cs + 16 <= N:
                                w = [None] * 4
                                for k in range(4):
                                    g, h = k & 1, k >> 1
                                    w[k] = pack2(acc[i, 8 * s + 4 * g + 2 * h] + bb[g, 0],
                                                 acc[i, 8 * s + 4 * g + 2 * h + 1] + bb[g, 1])
                                x0 = shfl_xor(np.where(q0, w[0], w[1]), 1)
                                x1 = shfl_xor(np.where(q0, w[2], w[3]), 1)
                                w = [np.where(q0, x0, w[0]), np.where(q0, w[1], x0),
                                     np.where(q0, x1, w[2]), np.where(q0, w[3], x1)]
                                x0 = shfl_xor(np.where(q1, w[0], w[2]), 2)
                                x1 = shfl_xor(np.where(q1, w[1], w[3]), 2)
                                w = [np.where(q1, x0, w[0]), np.where(q1, x1, w[1]),
                                     np.where(q1, w[2], x0), np.where(q1, w[3], x1)]
                                words = np.stack(w, axis=1)             # (32 lanes, 4)
                                for ln in range(32):
                                    r = (m0 + cw * (bm // 2) + 64 * i + warp * 16 + (ln >> 2)
                                         + 8 * (q[ln] >> 1))
                                    if r < M:
                                        c = cs + 8 * (q[ln] & 1)
                                        ok &= (r * N + c) * 2 % 16 == 0
                                        ok &= write(r, c, words[ln].view(np.float16))
                            else:
                                for g in range(2):
                                    for h in range(2):
                                        v0 = acc[i, 8 * s + 4 * g + 2 * h] + bb[g, 0]
                                        v1 = acc[i, 8 * s + 4 * g + 2 * h + 1] + bb[g, 1]
                                        for ln in range(32):
                                            c = cs + 8 * g + 2 * q[ln]
                                            r = (m0 + cw * (bm // 2) + 64 * i + warp * 16
                                                 + (ln >> 2) + h * 8)
                                            if r >= M:
                                                continue
                                            vals = np.array([v0[ln], v1[ln]]).astype(np.float16)
                                            if pair:
                                                if c < N:
                                                    ok &= (r * N + c) * 2 % 4 == 0
                                                    ok &= write(r, c, vals)
                                            else:
                                                if c < N:
                                                    ok &= write(r, c, vals[:1])
                                                if c + 1 < N:
                                                    ok &= write(r, c + 1, vals[1:])
    ok &= bool((count == 1).all())
    ok &= bool((C.view(np.uint16) == want.view(np.uint16)).all())
    return bool(ok)


def main() -> int:
    rng = np.random.default_rng(0)
    ok = True
    runs = 0
    for stages in (3, 4, 5):
        for ktiles, ntiles in ((13, 3), (1, 5), (2, 4), (stages, 2)):
            for _ in range(60):
                ring_run(stages, ktiles, ntiles, rng)
                runs += 1
    print(f"ring: {runs} random interleavings (stages 3-5, 13/1/2/stages k-tiles): OK")
    for M, N, bm, bn, grid in ((1023, 1025, 128, 256, 132), (4096, 4096, 128, 256, 132),
                               (16384, 1024, 256, 128, 132), (300, 5000, 128, 128, 7),
                               (8192, 8192, 128, 256, 132)):
        good = tiles_ok(M, N, bm, bn, 8, grid)
        ok &= good
        print(f"tiles {M}x{N} bm {bm} bn {bn} grid {grid}: {'OK' if good else 'FAIL'}")
    for bm, bn, stages, M, N, K in ((128, 256, 4, 200, 300, 150), (128, 128, 5, 131, 129, 70),
                                    (256, 128, 4, 300, 130, 200)):
        good = layout_ok(bm, bn, stages, M, N, K, rng) and fragments_ok(bm, bn)
        ok &= good
        print(f"layout bm {bm} bn {bn} stages {stages} at {M}x{N}x{K}: "
              f"{'OK' if good else 'FAIL'}")
    for bm, bn in ((128, 128), (128, 256), (256, 128), (256, 256)):
        for M, N, aligned, with_bias in ((200, 264, True, True), (131, 520, True, False),
                                         (70, 136, False, True), (65, 131, True, True),
                                         (bm, 2 * bn, True, False)):
            good = epilogue16_ok(bm, bn, M, N, aligned, with_bias, rng)
            ok &= good
            print(f"16-bit epilogue bm {bm} bn {bn} at {M}x{N} aligned {aligned} "
                  f"bias {with_bias}: {'OK' if good else 'FAIL'}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
