"""NumPy emulation of templates/matmul_wgmma16.cu.j2's shared-memory layout, run on the CPU.

It replays, with the template's own formulas, (1) the cp.async loader of one ring slot (which
thread writes which 16-byte chunk where, the src-size of each chunk at the matrix edges),
(2) the wgmma descriptors the kernel builds (start address, LBO, SBO, swizzle mode), decoded
and read back through the canonical 128-byte-swizzle layouts of the PTX ISA's "Matrix
Descriptor" section as CUTLASS writes them (cute/atom/mma_traits_sm90_gmma.hpp, make_gmma_desc:
K-major ((8, m):(128 B, SBO)) x (64 elts contiguous); MN-major ((64 elts, m):(2 B, LBO)) x
((8, k):(128 B, SBO)); the swizzle XORs address bits 4-6 with bits 7-9), and checks that every
wgmma m64n{bn}k16 of a k-tile reads exactly the A and B sub-matrices it should. It checks the
kernel against that reading model, not against the hardware: perf/wgmma16_check.py does that.

Usage: python perf/wgmma16_layout.py  (exits 1 on a mismatch)
"""
from __future__ import annotations

import sys

import numpy as np

BM, BK, ROW = 128, 64, 128
THREADS = 256
B_ATOM = BK * ROW


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
    """(rows x k) 16-bit matrix read through a K-major 128B-swizzle descriptor."""
    f = decode(d)
    assert f["layout"] == 1 and f["base_offset"] == 0
    m = np.arange(rows)[:, None]
    kk = np.arange(k)[None, :]
    addr = f["start"] + (m // 8) * f["sbo"] + (m % 8) * 128 + kk * 2
    return smem[swz128(addr) // 2]


def read_mnmajor(smem: np.ndarray, d: int, k: int, n: int) -> np.ndarray:
    """(k x n) 16-bit matrix read through an MN-major 128B-swizzle descriptor (trans-b 1)."""
    f = decode(d)
    assert f["layout"] == 1 and f["base_offset"] == 0
    kk = np.arange(k)[:, None]
    nn = np.arange(n)[None, :]
    addr = f["start"] + (nn // 64) * f["lbo"] + (nn % 64) * 2 + (kk // 8) * f["sbo"] \
        + (kk % 8) * 128
    return smem[swz128(addr) // 2]


def load_slot(bn: int, A: np.ndarray, B: np.ndarray, M: int, N: int, K: int,
              m0: int, n0: int, k0: int, stage_bytes: int, s_base: int, stage: int,
              smem: np.ndarray, writes: np.ndarray) -> list:
    """The template's load_tile for one slot: returns the per-warp chunk lists (for banks)."""
    lda, ldb = A.shape[1], B.shape[1]
    sa0 = s_base + stage * stage_bytes
    sb0 = sa0 + BM * ROW
    chunks = []  # (tid, dst byte address)
    a_iters, a_rstep = BM * 8 // THREADS, THREADS // 8
    b_cpr = bn // 8
    b_rstep = THREADS // b_cpr
    b_iters = BK // b_rstep
    assert b_rstep % 8 == 0
    for tid in range(THREADS):
        a_ch, a_row0 = tid % 8, tid // 8
        a_dst0 = a_row0 * ROW + ((a_ch ^ (a_row0 & 7)) * 16)
        abytes = max(0, min(16, (K - a_ch * 8 - k0) * 2))
        for i in range(a_iters):
            r = m0 + a_row0 + i * a_rstep
            nbytes = abytes if r < M else 0
            dst = sa0 + a_dst0 + i * a_rstep * ROW
            col = k0 + a_ch * 8
            src = np.zeros(8, np.uint16)
            if nbytes:
                assert (r * lda + col) % 8 == 0 and col + nbytes // 2 <= lda
                src[:nbytes // 2] = A[r, col:col + nbytes // 2]
            smem[dst // 2:dst // 2 + 8] = src
            writes[dst // 2:dst // 2 + 8] += 1
            chunks.append((tid, dst))
        b_ch, b_row0 = tid % b_cpr, tid // b_cpr
        b_dst0 = (b_ch // 8) * B_ATOM + b_row0 * ROW + (((b_ch % 8) ^ (b_row0 & 7)) * 16)
        b_bytes = max(0, min(16, (N - n0 - b_ch * 8) * 2))
        krem = K - k0 - b_row0
        for i in range(b_iters):
            nbytes = b_bytes if i * b_rstep < krem else 0
            dst = sb0 + b_dst0 + i * b_rstep * ROW
            k = k0 + b_row0 + i * b_rstep
            col = n0 + b_ch * 8
            src = np.zeros(8, np.uint16)
            if nbytes:
                assert (k * ldb + col) % 8 == 0 and col + nbytes // 2 <= ldb
                src[:nbytes // 2] = B[k, col:col + nbytes // 2]
            smem[dst // 2:dst // 2 + 8] = src
            writes[dst // 2:dst // 2 + 8] += 1
            chunks.append((tid, dst))
    return chunks


def bank_phases_ok(chunks: list) -> bool:
    """Each group of 8 consecutive threads issuing one iteration's 16-byte chunks (one
    128-byte shared-memory wavefront) covers all 32 banks once."""
    by_tid: dict = {}
    for tid, dst in chunks:
        by_tid.setdefault(tid, []).append(dst)
    n_iter = len(by_tid[0])
    for it in range(n_iter):
        for g in range(0, THREADS, 8):
            banks = set()
            for t in range(g, g + 8):
                d = by_tid[t][it]
                banks.update(((d + 4 * w) // 4) % 32 for w in range(4))
            if len(banks) != 32:
                return False
    return True


def check(bn: int, M: int, N: int, K: int, m0: int, n0: int, k0: int, stage: int,
          stages: int, rng: np.random.Generator) -> bool:
    lda = (K + 7) // 8 * 8
    ldb = (N + 7) // 8 * 8
    # element ids (nonzero, distinct mod 2^16 within a tile) stand in for the 16-bit values
    A = rng.integers(1, 65535, size=(M, lda), dtype=np.uint16)
    B = rng.integers(1, 65535, size=(K, ldb), dtype=np.uint16)
    stage_bytes = BM * ROW + bn // 64 * B_ATOM
    s_base = 3 * 1024                       # any 1024-byte boundary (the kernel rounds up)
    smem = np.full((s_base + stages * stage_bytes) // 2, 0xDEAD, np.uint16)
    writes = np.zeros_like(smem, dtype=np.int32)
    chunks = load_slot(bn, A, B, M, N, K, m0, n0, k0, stage_bytes, s_base, stage, smem, writes)
    ok = True
    lo, hi = (s_base + stage * stage_bytes) // 2, (s_base + (stage + 1) * stage_bytes) // 2
    cover = bool((writes[lo:hi] == 1).all() and writes[:lo].sum() == 0 and writes[hi:].sum() == 0)
    banks = bank_phases_ok(chunks)
    # logical tiles, zero outside the matrix (what the kernel must multiply)
    Az = np.zeros((BM, BK), np.uint16)
    ra, ca = min(M, m0 + BM) - m0, max(0, min(K, k0 + BK) - k0)
    Az[:ra, :ca] = A[m0:m0 + ra, k0:k0 + ca]
    Bz = np.zeros((BK, bn), np.uint16)
    rb, cb = max(0, min(K, k0 + BK) - k0), max(0, min(N, n0 + bn) - n0)
    Bz[:rb, :cb] = B[k0:k0 + rb, n0:n0 + cb]
    a_desc0 = [desc(s_base + wg * 64 * ROW, 16, 1024) for wg in range(2)]
    b_desc0 = desc(s_base + BM * ROW, B_ATOM, 1024)
    reads = True
    off = stage * stage_bytes
    for wg in range(2):
        for kk in range(4):
            da = a_desc0[wg] + ((off + kk * 32) >> 4)
            db = b_desc0 + ((off + kk * 16 * ROW) >> 4)
            ga = read_kmajor(smem, da, 64, 16)
            gb = read_mnmajor(smem, db, 16, bn)
            reads &= bool((ga == Az[wg * 64:(wg + 1) * 64, kk * 16:(kk + 1) * 16]).all())
            reads &= bool((gb == Bz[kk * 16:(kk + 1) * 16, :]).all())
    # accumulator fragments: each (row, col) of the 64 x bn warpgroup tile exactly once
    hits = np.zeros((64, bn), np.int32)
    for t in range(128):
        w, lane = t // 32, t % 32
        for j in range(bn // 8):
            for q in range(4):
                hits[16 * w + lane // 4 + 8 * (q >= 2), 8 * j + 2 * (lane % 4) + (q & 1)] += 1
    frag = bool((hits == 1).all())
    ok = cover and banks and reads and frag
    print(f"bn={bn} M={M} N={N} K={K} tile (m0={m0}, n0={n0}, k0={k0}) slot {stage}/{stages}: "
          f"slot written once={cover} conflict-free chunk writes={banks} "
          f"8 wgmma reads (2 warpgroups x 4 k-steps) match={reads} fragments={frag}")
    return ok


def main() -> int:
    rng = np.random.default_rng(0)
    for bn in (128, 256):
        stage_bytes = BM * ROW + bn // 64 * B_ATOM
        print(f"bn={bn}: slot {stage_bytes} B (A {BM * ROW}, B {bn // 64} atoms x {B_ATOM})")
        for wg in range(2):
            for kk in (0, 1, 3):
                d = desc(3 * 1024 + stage_bytes + wg * 64 * ROW, 16, 1024) + (kk * 32 >> 4)
                print(f"  A desc wg {wg} slot 1 kk {kk}: {d:#018x} {decode(d)}")
        for kk in (0, 1, 3):
            d = desc(3 * 1024 + stage_bytes + BM * ROW, B_ATOM, 1024) + (kk * 2048 >> 4)
            print(f"  B desc slot 1 kk {kk}: {d:#018x} {decode(d)}")
    ok = True
    for bn, stages in ((128, 4), (256, 4)):
        ok &= check(bn, 512, 512, 512, 128, 256, 64, 1, stages, rng)          # interior
        ok &= check(bn, 1023, 1025, 1000, 896, 1024 - (1024 % bn), 960, 3, stages, rng)  # edges
        ok &= check(bn, 1023, 1025, 1000, 0, 0, 0, 0, stages, rng)              # first tile
        ok &= check(bn, 200, 77, 43, 128, 0, 0, 2, stages, rng)                 # K < 64
    print("layout emulation:", "OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
