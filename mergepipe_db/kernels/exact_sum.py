"""Exactly rounded sums of float32 values: what ``math.fsum`` gives on their float64 values, whatever the order
in which they are added or how they are split (blocks, tiles, chunks).

A superaccumulator: a float32 is an integer mantissa M (< 2^24, the implicit bit included) times
2^(max(e, 1) - 150), e its biased exponent. Values are taken a tile (`TILE`) at a time: those whose exponent
is within `SPAN64` of the tile's largest are multiples of 2^(base - 150) below 2^(base - 150 + 42), so their
float64 sum is exact in any order (24 + 18 + 11 bits: every partial sum is an integer multiple below 2^53), in
a loop that vectorizes; that total, as an integer, is then deposited into the int64 bins (one per exponent
step, `BINS`) as three 24-bit pieces; the rare smaller nonzero values, and tiles holding an inf or NaN, are
added one by one (±M into the bin of their exponent). Each addition to a bin is below 2^24, so 2^39 of them fit:
`ExactSum` moves the bins into a Python int before `SPILL_EVERY` values have been added. The final value is
that integer over 2^150, one correctly rounded division (CPython's int true division).

inf and NaN are counted apart, and end the sum as numpy's ``np.sum(..., dtype=float64)`` does: NaN if a NaN or
both infinities were added, else the infinity added. The kernels add with `add`, inlined into theirs
(`kernels/merge.py`; LLVM inlines it: numba's own IR inlining, ``inline="always"``, dropped the second of two
calls in one loop). numba's on-disk cache of `merge.random_keep` does not notice edits here: after changing
this file, delete mergepipe_db/kernels/__pycache__/merge.*.nb* (a fresh install has no cache).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from mergepipe_db.kernels.float_bits import f32_to_bits

__all__ = ["BINS", "LANES", "SIZE", "TILE", "ExactSum", "accumulate", "add", "add_split", "add_split_top", "value"]

BINS = 288  #: exponent steps: a float32's (0..254) and those of a tile total's upper pieces (up to 274)
LANES = 1  #: copies of the bins (`add`'s lane): the tile path needs no more
_NAN, _PINF, _NINF = LANES * BINS, LANES * BINS + 1, LANES * BINS + 2
SIZE = LANES * BINS + 3  #: int64 words of one accumulator: LANES × BINS mantissa sums, then NaN, +inf, -inf counts
SPILL_EVERY = 1 << 37  #: values added before the bins are moved into a Python int (each adds at most twice)
TILE = 2048  #: values summed in one int64 before they reach the bins
SPAN64 = 18  #: exponents below a tile's largest that its float64 sums take exactly (2^(24 + 18 + 11) = 2^53)


@numba.njit(cache=True, nogil=True)
def add(acc: np.ndarray, lane: int, v: np.float32) -> None:
    """acc += v exactly (``lane`` in [0, LANES): any; neighbours in different lanes run faster)."""
    bits = f32_to_bits(v)
    e = (bits >> np.uint32(23)) & np.uint32(0xFF)
    m = bits & np.uint32(0x7FFFFF)
    if e == np.uint32(0xFF):
        if m != np.uint32(0):
            acc[_NAN] += 1
        elif bits >> np.uint32(31):
            acc[_NINF] += 1
        else:
            acc[_PINF] += 1
        return
    big = np.int64(m | (np.uint32(0x800000) if e != np.uint32(0) else np.uint32(0)))
    neg = np.int64(bits >> np.uint32(31))
    acc[lane * BINS + np.int64(e)] += (big ^ -neg) + neg


@numba.njit(cache=True, nogil=True)
def _deposit(acc: np.ndarray, base: int, total: np.int64) -> None:
    """acc += total · 2^(base - 150) (|total| < 2^63): three pieces below 2^24 into bins base, base + 24, base + 48."""
    neg = total < 0
    mag = -total if neg else total
    for j in range(3):
        piece = (mag >> np.int64(24 * j)) & np.int64(0xFFFFFF)
        if piece != 0:
            acc[base + 24 * j] += -piece if neg else piece


@numba.njit(cache=True, nogil=True, fastmath={"reassoc"})
def _tile_sums(a: np.ndarray, flag: np.ndarray, low: np.uint32) -> tuple[float, float, int]:
    """(Σ a[flag], Σ a[~flag], how many were left out) over the values whose magnitude pattern is at least
    `low`, in float64. Exact in any order (see `add_split`), so the sums may be reassociated ("reassoc":
    the loop vectorizes); nothing else in this function can be reassociated or contracted."""
    s_in = 0.0
    s_out = 0.0
    missed = 0
    for i in range(a.shape[0]):
        mag = f32_to_bits(a[i]) & np.uint32(0x7FFFFFFF)
        ok = (mag >= low) | (mag == np.uint32(0))  # a zero adds nothing, whatever its exponent
        v = np.float64(a[i]) if ok else 0.0
        f = flag[i]
        s_in += v if f else 0.0
        s_out += 0.0 if f else v
        missed += not ok
    return s_in, s_out, missed


@numba.njit(cache=True, nogil=True)
def add_split(acc_in: np.ndarray, acc_out: np.ndarray, a: np.ndarray, flag: np.ndarray) -> None:
    """acc_in += Σ a[flag], acc_out += Σ a[~flag], exactly (at most `TILE` values; the two may be one array).

    The tile's values within `SPAN64` exponents of its largest are multiples of 2^(base - 150) below
    2^(base - 150 + 42), so any partial sum of at most 2^11 of them is an integer multiple of it below 2^53:
    their float64 sum is exact in any order (`_tile_sums`), and is deposited as that integer. The smaller ones
    (rare) are added one by one; zeros (common: BF16 elements a fine-tune left unchanged) add nothing and are
    skipped."""
    top = np.uint32(0)
    for i in range(a.shape[0]):
        top = max(top, f32_to_bits(a[i]) & np.uint32(0x7FFFFFFF))
    add_split_top(acc_in, acc_out, a, flag, top)


@numba.njit(cache=True, nogil=True)
def add_split_top(acc_in: np.ndarray, acc_out: np.ndarray, a: np.ndarray, flag: np.ndarray, top: np.uint32) -> None:
    """`add_split` given ``top``, the largest magnitude bit pattern of `a` (a kernel that makes `a` finds it in
    the same loop)."""
    n = a.shape[0]
    e_top = np.int64(top >> np.uint32(23))
    if e_top == 255:  # an inf or NaN: one by one
        for i in range(n):
            add(acc_in if flag[i] else acc_out, 0, a[i])
        return
    base = max(max(e_top, np.int64(1)) - SPAN64, np.int64(1))
    low = np.uint32(base << 23) if base > 1 else np.uint32(0)  # below it: exponent < base (not subnormal at 1)
    s_in, s_out, missed = _tile_sums(a, flag, low)
    if missed:
        for i in range(n):
            mag = f32_to_bits(a[i]) & np.uint32(0x7FFFFFFF)
            if np.uint32(0) < mag < low:
                add(acc_in if flag[i] else acc_out, 0, a[i])
    unit = np.float64(2.0) ** np.float64(150 - base)  # an exact power of two: the sums become integers
    _deposit(acc_in, base, np.int64(s_in * unit))
    _deposit(acc_out, base, np.int64(s_out * unit))


@numba.njit(cache=True, nogil=True)
def accumulate(acc: np.ndarray, x: np.ndarray) -> None:
    """acc += Σ x exactly (x: flat float32)."""
    flag = np.ones(TILE, np.bool_)
    for t0 in range(0, x.shape[0], TILE):
        m = min(TILE, x.shape[0] - t0)
        add_split(acc, acc, x[t0:t0 + m], flag[:m])


def _bins_int(acc: np.ndarray) -> int:
    """The bins' total in units of 2^-150 (a Python int)."""
    per_exp = acc[: LANES * BINS].reshape(LANES, BINS)
    total = 0
    for e in np.flatnonzero(per_exp.any(axis=0)):
        total += int(per_exp[:, e].astype(object).sum()) << max(int(e), 1)
    return total


def value(acc: np.ndarray, carry: int = 0) -> float:
    """The exactly rounded float64 of an accumulator (plus ``carry``, in units of 2^-150)."""
    nan, pinf, ninf = int(acc[_NAN]), int(acc[_PINF]), int(acc[_NINF])
    if nan or (pinf and ninf):
        return math.nan
    if pinf:
        return math.inf
    if ninf:
        return -math.inf
    return (carry + _bins_int(acc)) / (1 << 150)


class ExactSum:
    """A running exact sum of float32 values: `acc` for the kernels, `added` the caller's count of values
    added to it (see `reserve`)."""

    def __init__(self) -> None:
        self.acc = np.zeros(SIZE, np.int64)
        self._carry = 0
        self._since_spill = 0

    def reserve(self, n: int) -> np.ndarray:
        """The accumulator, ready for n more values (the bins are spilled first when they might overflow)."""
        if self._since_spill + n > SPILL_EVERY:
            self._carry += _bins_int(self.acc)
            self.acc[: LANES * BINS] = 0
            self._since_spill = 0
        self._since_spill += n
        return self.acc

    def add_array(self, x: np.ndarray) -> None:
        """Add the float32 values of `x`."""
        flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        for s in range(0, flat.shape[0], SPILL_EVERY):
            part = flat[s : s + SPILL_EVERY]
            accumulate(self.reserve(part.shape[0]), part)

    def value(self) -> float:
        """The exactly rounded float64 of the sum so far."""
        return value(self.acc, self._carry)

    def value_with(self, other: ExactSum) -> float:
        """The exactly rounded float64 of this sum plus `other` (both exact: one rounding)."""
        both = np.zeros(SIZE, np.int64)
        both[LANES * BINS:] = self.acc[LANES * BINS:] + other.acc[LANES * BINS:]  # NaN, inf counts
        return value(both, self._carry + other._carry + _bins_int(self.acc) + _bins_int(other.acc))
