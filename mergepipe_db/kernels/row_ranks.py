"""DELLA's keep probabilities: the rank of each |Δ| along dim 1 of a block (a stable ascending sort: ties in index
order, NaN after everything, as ``np.argsort(kind="stable")`` orders them), then MergeKit's float32 formula.

Each column's keys are the |Δ| bit patterns (non-negative float32 order is their bit order; every NaN is given
one pattern above +inf, so NaNs tie and keep index order), computed in a loop that vectorizes and then split
16 at a time (`compress`). Zero Δ (often most of a column of a BF16 fine-tune) rank first in index order. The
nonzero keys of a BF16 fine-tune take few values (multiples of a few units in the last place): they are
ranked by value (a small hash table counts each, the distinct values are sorted, ranks dealt in index order).
Otherwise a stable LSD radix sort, 8 bits a pass, skipping a pass where all keys share the byte: O(n) a column
either way, and no index arrays of the whole block. Δ comes from θ₀ and the expert's stored values as each
column is read, and each p from a table by rank (the formula's n values, computed once).
"""

from __future__ import annotations

import numba
import numpy as np

from mergepipe_db.kernels import exact_sum
from mergepipe_db.kernels import torch_rand as mt19937
from mergepipe_db.kernels.compress import SLACK, split_nonzero_ranks
from mergepipe_db.kernels.float_bits import f32_to_bits, widen
from mergepipe_db.kernels.merge import absdelta_top, pack_bits

__all__ = ["della_keep_blocks", "della_probabilities"]

_BLOCK_CHUNKS = 16  # `della_keep_blocks`' chunks of blocks at most (numba cannot cache a kernel that asks its threads)

_NAN_KEY = np.uint32(0x7FC00000)
_ABS = np.uint32(0x7FFFFFFF)
_INF = np.uint32(0x7F800000)


@numba.njit(cache=True, nogil=True)
def _sorted(keys: np.ndarray, idx: np.ndarray, keys2: np.ndarray, idx2: np.ndarray, m: int, count: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """The m packed (key, index) pairs in the stable ascending order of the keys: (keys, indices), the first m of
    either the pair (keys, idx) or (keys2, idx2). A stable LSD radix sort, 8 bits a pass, a pass skipped where
    every key has the byte (`count` 4 × 256: the four bytes' histograms, counted in one pass, which a
    permutation leaves as they are)."""
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
    return src_k, src_i


_SLOTS = 256  # the hash table of `_deal_by_value`: at most half of it used
_HASH = np.uint32(0x9E3779B1)  # Fibonacci hashing: a key's slot is the top 8 bits of key · _HASH


@numba.njit(cache=True, nogil=True)
def _deal_by_value(keys: np.ndarray, idx: np.ndarray, m: int, start: int, table: np.ndarray, out: np.ndarray,
                   slot: np.ndarray, value: np.ndarray, count: np.ndarray, by_key: np.ndarray) -> bool:
    """out[idx[i]] = table[rank] for the m packed nonzero keys (index order) without sorting them, when they
    take few values (a BF16 fine-tune's |Δ| in a row: multiples of a few units in the last place), rank =
    `start` + the rank of keys[i] among them, ties in index order. Each distinct key gets a slot of a small
    hash table (`value`, `count`: `_SLOTS` each, zero on entry and on return; `slot`: m) and, as it is first
    seen, a place in `by_key` (`_SLOTS`: key · 256 + slot, the keys distinct); those are sorted by key (an
    insertion sort: a few dozen of them), each slot's first rank follows the count of the smaller keys, and
    the ranks are dealt in index order.
    False, with nothing written to `out`, when the keys take more than a quarter of m values (or `_SLOTS` / 2):
    sorting them all is then cheaper."""
    mask = np.uint32(_SLOTS - 1)
    one = np.uint64(1)
    empty = np.uint32(0)  # no nonzero key
    distinct = 0
    most = min(_SLOTS // 2, max(16, m // 4))  # more distinct keys than this: sorting them all is cheaper
    ok = True
    for i in range(m):
        k = keys[i]
        h = np.uint32(k * _HASH) >> np.uint32(24)  # the product's low 32 bits (numba widens it to 64)
        while value[h] != k and value[h] != empty:
            h = (h + np.uint32(1)) & mask
        if value[h] == empty:
            value[h] = k
            by_key[distinct] = (np.uint64(k) << np.uint64(8)) | np.uint64(h)
            distinct += 1
            if distinct > most:
                ok = False
                break
        slot[i] = h
        count[h] += one
    used = by_key[:distinct]
    low = np.uint64(_SLOTS - 1)
    if ok:
        for a in range(1, distinct):  # ascending key order
            v = used[a]
            j = a - 1
            while j >= 0 and used[j] > v:
                used[j + 1] = used[j]
                j -= 1
            used[j + 1] = v
        below = np.uint64(start)
        for a in range(distinct):  # count[h] becomes the slot's next rank
            h = used[a] & low
            t = count[h]
            count[h] = below
            below += t
        for i in range(m):
            h = slot[i]
            out[idx[i]] = table[count[h]]
            count[h] += one
    for a in range(distinct):
        h = used[a] & low
        value[h] = empty
        count[h] = 0
    return ok


@numba.njit(cache=True, nogil=True)
def _work(n: int) -> tuple[np.ndarray, ...]:
    """One thread's work arrays for columns of n elements (`_column`)."""
    # unsigned indices and ranks: numba wraps a signed index that may be negative, a compare and a select per access
    return (np.empty(n, np.uint32), np.empty(n + SLACK, np.uint32), np.empty(n + SLACK, np.uint32),
            np.empty(n, np.float32), np.empty(n, np.uint32), np.empty(n, np.uint32), np.empty(n, np.uint32),
            np.zeros(_SLOTS, np.uint32), np.zeros(_SLOTS, np.uint64), np.empty((4, 256), np.int32),
            np.empty(_SLOTS, np.uint64))


@numba.njit(cache=True, nogil=True)
def _column(out: np.ndarray, b: np.ndarray, x: np.ndarray, n: int, table: np.ndarray,
            work: tuple[np.ndarray, ...]) -> None:
    """out[j] = table[rank of |Δ_j|] for the n elements of one column (views of it, strided where it is),
    Δ = widen(x) − b, rank the position in the stable ascending order of the keys.

    Every key first (a loop that vectorizes), then split into the zero and the nonzero ones (`compress`). The
    zero keys (Δ = ±0, often most of a column of a BF16 fine-tune) rank first in index order: their p are
    dealt as they are split (into a row of the thread's own where `out` is strided). The m nonzero keys are
    ranked by value when they take few (`_deal_by_value`), else sorted (`_sorted`)."""
    full, keys, idx, dealt, keys2, idx2, slot, value, slot_count, count, by_key = work
    for j in range(n):
        bits = f32_to_bits(widen(x[j]) - b[j]) & _ABS
        full[j] = _NAN_KEY if bits > _INF else bits
    if out.strides[0] == out.itemsize:
        m, zeros = split_nonzero_ranks(full, n, keys, idx, table, out)
    else:  # a strided column: its zero keys' p dealt into the thread's own row first
        m, zeros = split_nonzero_ranks(full, n, keys, idx, table, dealt)
        for j in range(n):
            out[j] = dealt[j]
    if m == 0:
        return
    if _deal_by_value(keys, idx, m, zeros, table, out, slot, value, slot_count, by_key):
        return
    src_k, src_i = _sorted(keys, idx, keys2, idx2, m, count)
    for pos in range(m):
        out[src_i[pos]] = table[zeros + pos]


@numba.njit(cache=True, nogil=True)
def _rank_table(n: int, eps: np.float32, low: np.float32) -> np.ndarray:
    """table[r] = p of rank r: (r / float32(n − 1) clipped to [0, 1], 0 when n = 1) · 2 · ε + low, in float32
    (non-decreasing in r)."""
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
        work = _work(n)
        for col in range(columns * t // chunks, columns * (t + 1) // chunks):
            # the column as views from index 0 (numba wraps an index that may be negative, element by element)
            first = (col // C) * n * C + col % C
            last = first + (n - 1) * C + 1
            _column(out[first:last:C], b[first:last:C], x[first:last:C], n, table, work)


def _layout(numel: int, shape: tuple[int, ...], rows: int) -> tuple[int, int, int]:
    """(R, n, C): a block of `rows` rows of a tensor of `shape` seen as R × n × C, ranked along n (a 0-d or
    1-d tensor: one row of all its elements)."""
    if len(shape) <= 1:
        return 1, numel, 1
    return rows, int(shape[1]), int(np.prod(shape[2:], dtype=np.int64)) if len(shape) > 2 else 1


def della_probabilities(base: np.ndarray, raw: np.ndarray, shape: tuple[int, ...], rows: int, d: float, eps: float
                        ) -> np.ndarray:
    """The keep probabilities (float32, flat) of one block, Δ = widen(raw) − base (flat: θ₀ as float32 and the
    expert's stored values, or +0.0 and Δ itself): the block viewed as ``(rows, *shape[1:])`` (a 0-d or 1-d
    tensor: one row of all its elements), rank along dim 1, then p = (rank / float32(n − 1) clipped to [0, 1],
    0 when n = 1) · 2 · float32(ε) + float32(d − ε), in float32."""
    b, x = base.reshape(-1), raw.reshape(-1)
    R, n, C = _layout(b.shape[0], shape, rows)
    out = np.empty(b.shape[0], np.float32)
    if b.shape[0] == 0 or n == 0:
        return out
    _probabilities(out, b, x, R, n, C, np.float32(eps), np.float32(d - eps))
    return out



@numba.njit(cache=True, nogil=True, parallel=True)
def della_keep_blocks(keep: np.ndarray, bits: np.ndarray, offsets: np.ndarray, b: np.ndarray, x: np.ndarray,
                      spans: np.ndarray, seeds: np.ndarray, n: int, eps: np.float32, low: np.float32, l1: bool,
                      acc_kept: np.ndarray, acc_dropped: np.ndarray) -> None:
    """DELLA's mask of several blocks of a 2-D tensor (rows of n elements), a row at a time: block j (elements
    spans[j] = [start, end) of the flat tensor, whole rows) gets keep = u < p, p each element's keep probability
    by the rank of its |Δ| in its row (`_column`, the table of `_rank_table(n, eps, low)`), u the block's own
    stream (seed ``seeds[j]``, `mt19937`, drawn a twist at a time and handed out row by row), and with ``l1``
    the exact sums (`exact_sum`) of the kept and of the dropped |Δ| while the row is in cache. The mask goes
    into `keep` (bool, indexed by element) or, where `bits` is not empty, packed into `bits` instead
    (`merge.pack_bits`, block j's from byte offsets[j]: a row's last flags wait for the next row's to fill
    their byte). The same mask and sums as `della_probabilities`, then ``torch.rand`` of the block and
    `merge.random_keep`, without the probabilities or the uniforms in memory; blocks in contiguous chunks on
    numba's threads, each chunk's sums in its own accumulators, added after (exact: the same for any thread
    count)."""
    nbk = spans.shape[0]
    c = max(1, min(_BLOCK_CHUNKS, nbk))
    parts = np.zeros((c, 2, acc_kept.shape[0]), np.int64)
    table = _rank_table(n, eps, low)
    W = mt19937.STATE_WORDS
    T = exact_sum.TILE
    packed = bits.shape[0] > 0
    for t in numba.prange(c):
        work = _work(n)
        state = np.empty(W, np.uint32)
        twist = np.empty(W, np.float32)  # the uniforms of the stream's current twist, handed out from `pos`
        p = np.empty(n, np.float32)
        u = np.empty(n, np.float32)
        a = np.empty(T, np.float32)
        words = np.empty(n // 8 + 2, np.uint64)  # packing: the flags not yet packed, then a row's
        flags = words.view(np.bool_)
        for j in range(nbk * t // c, nbk * (t + 1) // c):
            mt19937.stream_start(state, seeds[j])
            pos = W
            o = offsets[j] if packed else 0  # the next byte of the block's packed mask
            waiting = 0  # flags waiting for a whole byte
            for s0 in range(spans[j, 0], spans[j, 1], n):
                _column(p, b[s0:s0 + n], x[s0:s0 + n], n, table, work)
                pos = mt19937.stream_fill(u, state, twist, pos)
                kp = flags[waiting:waiting + n] if packed else keep[s0:s0 + n]
                for i in range(n):
                    kp[i] = u[i] < p[i]
                if l1:
                    for t0 in range(0, n, T):
                        m = min(T, n - t0)
                        top = absdelta_top(a, x[s0 + t0:s0 + t0 + m], b[s0 + t0:s0 + t0 + m])
                        exact_sum.add_split_top(parts[t, 0], parts[t, 1], a[:m], kp[t0:t0 + m], top)
                if packed:
                    whole = (waiting + n) // 8
                    pack_bits(bits, o, words, 8 * whole)
                    o += whole
                    rest = waiting + n - 8 * whole
                    for i in range(rest):
                        flags[i] = flags[8 * whole + i]
                    waiting = rest
            if waiting:
                pack_bits(bits, o, words, waiting)
    for t in range(c):
        acc_kept += parts[t, 0]
        acc_dropped += parts[t, 1]
