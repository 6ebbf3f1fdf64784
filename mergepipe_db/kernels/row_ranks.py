"""DELLA's keep probabilities: the rank of each |Δ| along dim 1 of a block (a stable ascending sort: ties in index
order, NaN after everything, as ``np.argsort(kind="stable")`` orders them), then MergeKit's float32 formula.

A stable LSD radix sort of each column's |Δ| bit patterns (non-negative float32 order is their bit order; every
NaN is given one pattern above +inf, so NaNs tie and keep index order), 8 bits a pass, skipping a pass where all
keys share the byte (the sign and most exponent bits of a fine-tune's Δ): O(n) a column instead of a comparison
sort, and no index arrays of the whole block. Zero Δ (often most of a column of a BF16 fine-tune) rank first
in index order, so only the others are sorted. Δ comes from θ₀ and the expert's stored values as each column
is read, and each p from a table by rank (the formula's n values, computed once).
"""

from __future__ import annotations

import numba
import numpy as np

from mergepipe_db.kernels.float_bits import f32_to_bits, widen

__all__ = ["della_probabilities"]

_NAN_KEY = np.uint32(0x7FC00000)
_ABS = np.uint32(0x7FFFFFFF)
_INF = np.uint32(0x7F800000)


@numba.njit(cache=True, nogil=True)
def _column(out: np.ndarray, b: np.ndarray, x: np.ndarray, n: int, table: np.ndarray,
            keys: np.ndarray, idx: np.ndarray, keys2: np.ndarray, idx2: np.ndarray, count: np.ndarray) -> None:
    """out[j] = table[rank of |Δ_j|] for the n elements of one column (views of it, strided where it is),
    Δ = widen(x) − b, rank the position in the stable ascending order of the keys. Zero keys (Δ = ±0, often
    most of a column of a BF16 fine-tune) come first in index order, so their ranks are counted as they are
    met; only the others are sorted, packed in index order (the work arrays hold n each; `count` 4 × 256: the
    four bytes' histograms, counted in one pass, which a permutation leaves as they are)."""
    # unsigned counts: numba wraps a signed index that may be negative, a compare and a select per access
    zeros_u = np.uint64(0)
    m_u = np.uint64(0)
    one = np.uint64(1)
    for j in range(n):  # branch-free: every key is written, the packed count moves on past the nonzero ones
        bits = f32_to_bits(widen(x[j]) - b[j]) & _ABS
        k = _NAN_KEY if bits > _INF else bits
        nonzero = np.uint64(k != np.uint32(0))
        out[j] = table[zeros_u]  # a nonzero key's is written again below
        keys[m_u] = k
        idx[m_u] = j
        m_u += nonzero
        zeros_u += one - nonzero
    zeros, m = np.int64(zeros_u), np.int64(m_u)
    if m == 0:
        return
    count[:] = 0
    for j in range(m):
        k = keys[j]
        count[0, k & np.uint32(0xFF)] += 1
        count[1, (k >> np.uint32(8)) & np.uint32(0xFF)] += 1
        count[2, (k >> np.uint32(16)) & np.uint32(0xFF)] += 1
        count[3, k >> np.uint32(24)] += 1
    src_k, src_i, dst_k, dst_i = keys, idx, keys2, idx2
    for byte in range(4):
        sh = np.uint32(8 * byte)
        c = count[byte]
        if c[(src_k[0] >> sh) & np.uint32(0xFF)] == m:
            continue  # every key has this byte: the order stays
        total = 0
        for v in range(256):
            t = c[v]
            c[v] = total
            total += t
        for j in range(m):
            k = src_k[j]
            v = (k >> sh) & np.uint32(0xFF)
            o = c[v]
            dst_k[o] = k
            dst_i[o] = src_i[j]
            c[v] = o + 1
        src_k, src_i, dst_k, dst_i = dst_k, dst_i, src_k, src_i
    for pos in range(m):
        out[src_i[pos]] = table[zeros + pos]


@numba.njit(cache=True, nogil=True)
def _rank_table(n: int, eps: np.float32, low: np.float32) -> np.ndarray:
    """table[r] = p of rank r: (r / float32(n − 1) clipped to [0, 1], 0 when n = 1) · 2 · ε + low, in float32."""
    two = np.float32(2.0)
    denom = np.float32(n - 1)
    table = np.empty(n, np.float32)
    for r in range(n):
        rn = np.float32(r) / denom if n > 1 else np.float32(0.0)
        rn = min(max(rn, np.float32(0.0)), np.float32(1.0))
        table[r] = (rn * two) * eps + low
    return table


@numba.njit(cache=True, nogil=True, parallel=True)
def _probabilities(out: np.ndarray, b: np.ndarray, x: np.ndarray, R: int, n: int, C: int, eps: np.float32,
                   low: np.float32) -> None:
    """The R·C columns (independent rankings) in contiguous chunks on numba's threads, each chunk with its
    own work arrays: the bits do not depend on the number of threads."""
    table = _rank_table(n, eps, low)
    columns = R * C
    chunks = min(columns, 64)
    for t in numba.prange(chunks):
        keys = np.empty(n, np.uint32)
        keys2 = np.empty(n, np.uint32)
        idx = np.empty(n, np.int32)
        idx2 = np.empty(n, np.int32)
        count = np.empty((4, 256), np.int32)
        for col in range(columns * t // chunks, columns * (t + 1) // chunks):
            # the column as views from index 0 (numba wraps an index that may be negative, element by element)
            first = (col // C) * n * C + col % C
            last = first + (n - 1) * C + 1
            _column(out[first:last:C], b[first:last:C], x[first:last:C], n, table, keys, idx, keys2, idx2, count)


def della_probabilities(base: np.ndarray, raw: np.ndarray, shape: tuple[int, ...], rows: int, d: float, eps: float
                        ) -> np.ndarray:
    """The keep probabilities (float32, flat) of one block, Δ = widen(raw) − base (flat: θ₀ as float32 and the
    expert's stored values, or +0.0 and Δ itself): the block viewed as ``(rows, *shape[1:])`` (a 0-d or 1-d
    tensor: one row of all its elements), rank along dim 1, then p = (rank / float32(n − 1) clipped to [0, 1],
    0 when n = 1) · 2 · float32(ε) + float32(d − ε), in float32."""
    b, x = base.reshape(-1), raw.reshape(-1)
    if len(shape) <= 1:
        R, n, C = 1, b.shape[0], 1
    else:
        R, n = rows, int(shape[1])
        C = int(np.prod(shape[2:], dtype=np.int64)) if len(shape) > 2 else 1
    out = np.empty(b.shape[0], np.float32)
    if b.shape[0] == 0 or n == 0:
        return out
    _probabilities(out, b, x, R, n, C, np.float32(eps), np.float32(d - eps))
    return out
