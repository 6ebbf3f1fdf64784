"""`torch.topk`'s choice of the k largest, reproduced (numba): sce's mask among variances tied at its cut.

On CPU, ``torch.topk(x, k)`` of a 1-D float32 tensor with ``k * 64 > numel`` puts (value, index) pairs in a
vector and calls libstdc++'s ``std::nth_element`` on them at ``k - 1``, with the comparison "x is NaN and y is
not, or x > y"; the indices in the first k places are its answer. Where values tie at the k-th largest, which of
them land in those places is that algorithm's doing, not the values'. `select_k_largest` runs the same
algorithm, step for step (introselect: median of three moved to the front, the unguarded partition, insertion
sort below four elements), on one 64-bit key per element, the value's pattern above its index; a long range's
partition makes the same swaps in the same order a block at a time, without unpredictable branches
(`_partition_blocks`: 1.75× faster on sce's variances). Comparing the keys' top halves is comparing the values,
as long as they are non-negative float32 (their patterns order as unsigned integers) and every NaN has the one
pattern (NaNs tie with each other and sit above +inf, as in the comparison). So the same places end up holding
the same indices, the choice among ties included.

What is not reproduced is left to torch (the caller's fallback), each found before the mask is written: ``k * 64
<= numel`` (torch streams the values through a heap instead), a value with its sign bit set, more than 2^32
elements, and the introselect reaching its depth limit (libstdc++ turns to a heap select there: rare, it needs
pivots that keep missing).
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["depth_limit", "select_k_largest", "torch_topk_mask"]

_NAN_KEY = np.uint64(0x7FC00000)  # the one pattern every NaN's key carries
_INF = np.uint64(0x7F800000)
_SIGN = np.uint64(0x80000000)
_LOW = np.uint64(0xFFFFFFFF)
_BLOCK = 256  # places a block of `_partition_blocks` scans from one end
_SHIFT = np.uint64(32)


@numba.njit(cache=True, nogil=True, parallel=True)
def _make_keys(bits: np.ndarray, keys: np.ndarray) -> bool:
    """keys[i] = (pattern of bits[i], NaN as one pattern) << 32 | i; False when a number has its sign bit set
    (-0.0 included): not a magnitude, keys then incomplete."""
    n = bits.shape[0]
    signed = 0
    for i in numba.prange(n):
        b = np.uint64(bits[i])
        if (b & ~_SIGN) > _INF:
            b = _NAN_KEY
        elif b & _SIGN:
            signed += 1
        keys[i] = (b << _SHIFT) | np.uint64(i)
    return signed == 0


@numba.njit(cache=True, nogil=True)
def _partition_from(keys: np.ndarray, i: int, j: int, above: np.uint64, below: np.uint64) -> int:
    """libstdc++'s unguarded partition loop from the state (i, j) (at the start first + 1 and last): a key at or
    above `above` (a value larger than the pivot's) stops no left scan, one below `below` (smaller) no right
    scan; the two stopped keys are swapped until the scans cross. Returns where the left scan stopped last."""
    while True:
        while keys[i] >= above:
            i += 1
        j -= 1
        while keys[j] < below:
            j -= 1
        if i >= j:
            return i
        keys[i], keys[j] = keys[j], keys[i]
        i += 1


@numba.njit(cache=True, nogil=True)
def _partition_blocks(keys: np.ndarray, first: int, last: int, above: np.uint64, below: np.uint64,
                      lbuf: np.ndarray, rbuf: np.ndarray) -> int:
    """`_partition_from(keys, first + 1, last, ...)`, the same swaps without its unpredictable branches.

    That loop swaps the t-th key from the left that stops a left scan with the t-th from the right that stops
    a right scan, as long as the first lies before the second. Here the not yet scanned range is taken a block
    at a time from either end: the stopping places of a block are listed without branches, and listed pairs
    are swapped while both ends have some; a pair so listed always lies in order (every place scanned from the
    left precedes every place scanned from the right), so these are the loop's first swaps, in its order. When
    the range is used up, the loop itself goes on from its state after the last swap (its left scan just past
    the last left place, its right one at the last right place), through the crossing."""
    i, j = first + 1, last  # the loop's state after the swaps made so far
    lo, hi = first + 1, last  # not yet scanned
    nl = sl = nr = sr = 0  # listed, and swapped, places of each side
    while True:
        if sl == nl:
            if lo == hi:
                break
            m = min(_BLOCK, hi - lo)
            nl = sl = 0
            for p in range(lo, lo + m):
                lbuf[nl] = p
                nl += keys[p] < above
            lo += m
        if sr == nr:
            if lo == hi:
                break
            m = min(_BLOCK, hi - lo)
            nr = sr = 0
            for p in range(hi - 1, hi - 1 - m, -1):
                rbuf[nr] = p
                nr += keys[p] >= below
            hi -= m
        c = min(nl - sl, nr - sr)
        if c:
            for t in range(c):
                a, b = lbuf[sl + t], rbuf[sr + t]
                keys[a], keys[b] = keys[b], keys[a]
            i, j = lbuf[sl + c - 1] + 1, rbuf[sr + c - 1]
            sl += c
            sr += c
    return _partition_from(keys, i, j, above, below)


@numba.njit(cache=True, nogil=True)
def select_k_largest(keys: np.ndarray, nth: int, depth_limit: int) -> bool:
    """libstdc++'s ``std::nth_element(keys, keys + nth, keys + n, greater-by-top-half)``: afterwards no key in
    ``keys[:nth]`` has a smaller top half than ``keys[nth]``, no key after it a larger one, and every key is
    where libstdc++ would have put it. `depth_limit` is its partition budget, ``2 * floor(log2(n))``. False,
    with the keys part-way, when that budget runs out (libstdc++ then heap-selects: not reproduced here)."""
    first = 0
    last = keys.shape[0]
    if last == 0 or nth >= last:
        return True
    depth = depth_limit
    lbuf = np.empty(_BLOCK, np.int64)
    rbuf = np.empty(_BLOCK, np.int64)
    while last - first > 3:
        if depth == 0:
            return False
        depth -= 1
        # the median of keys[first + 1], keys[mid], keys[last - 1] (in libstdc++'s order of comparisons) to first
        a, b, c = first + 1, first + (last - first) // 2, last - 1
        ha, hb, hc = keys[a] >> _SHIFT, keys[b] >> _SHIFT, keys[c] >> _SHIFT
        if ha > hb:
            m = b if hb > hc else (c if ha > hc else a)
        elif ha > hc:
            m = a
        else:
            m = c if hb > hc else b
        keys[first], keys[m] = keys[m], keys[first]
        top = keys[first] >> _SHIFT
        above = (top + np.uint64(1)) << _SHIFT  # key >= above: its value is larger than the pivot's
        below = top << _SHIFT  # key < below: its value is smaller
        # the unguarded partition of [first + 1, last) around keys[first]
        if last - first > 2 * _BLOCK:
            i = _partition_blocks(keys, first, last, above, below, lbuf, rbuf)
        else:
            i = _partition_from(keys, first + 1, last, above, below)
        if i <= nth:
            first = i
        else:
            last = i
    for i in range(first + 1, last):  # insertion sort, larger first
        v = keys[i]
        hv = v >> _SHIFT
        if hv > keys[first] >> _SHIFT:
            for j in range(i, first, -1):
                keys[j] = keys[j - 1]
            keys[first] = v
        else:
            j = i
            while hv > keys[j - 1] >> _SHIFT:
                keys[j] = keys[j - 1]
                j -= 1
            keys[j] = v
    return True


@numba.njit(cache=True, nogil=True, parallel=True)
def _mark(keys: np.ndarray, k: int, keep: np.ndarray) -> None:
    """keep = 0, then 1 at the indices the first k keys carry."""
    for i in numba.prange(keep.shape[0]):
        keep[i] = 0
    for i in numba.prange(k):
        keep[keys[i] & _LOW] = 1


def depth_limit(n: int) -> int:
    """libstdc++'s introselect budget for n elements: ``2 * floor(log2(n))``."""
    return 2 * (n.bit_length() - 1) if n > 0 else 0


def torch_topk_mask(values: np.ndarray, k: int, keep: np.ndarray, keys: np.ndarray,
                    depth: int | None = None) -> bool:
    """keep[i] = 1 where i is among ``torch.topk(torch.from_numpy(values), k).indices``, else 0, for 1-D
    float32 `values` of magnitudes and 1 <= k <= numel; `keys` a uint64 buffer of at least numel. False, `keep`
    not written, where torch's choice is not reproduced here (the module's docstring); the caller asks torch.
    `depth` replaces the introselect's budget (tests)."""
    n = values.shape[0]
    if not 1 <= k <= n or k * 64 <= n or n >= 1 << 32:
        return False
    keys = keys[:n]
    if not _make_keys(values.view(np.uint32), keys):
        return False
    if not select_k_largest(keys, k - 1, depth_limit(n) if depth is None else depth):
        return False
    _mark(keys, k, keep)
    return True
