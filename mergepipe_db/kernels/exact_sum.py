"""Exactly rounded sums of float32 values: what ``math.fsum`` gives on their float64 values, whatever the order
in which they are added or how they are split (blocks, tiles, chunks).

A superaccumulator: a float32 is an integer mantissa M (< 2^24, the implicit bit included) times
2^(max(e, 1) - 150), e its biased exponent. Each value adds ±M to an int64 bin of its exponent (256 bins, per
lane: `LANES` interleaved copies break the dependency between neighbours of the same exponent). 2^39 additions
fit in a bin, so `ExactSum` moves the bins into a Python int before 2^38 values have been added (`SPILL_EVERY`).
The final value is that integer over 2^150, one correctly rounded division (CPython's int true division).

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

__all__ = ["BINS", "LANES", "SIZE", "ExactSum", "accumulate", "add", "value"]

BINS = 256
LANES = 4
_NAN, _PINF, _NINF = LANES * BINS, LANES * BINS + 1, LANES * BINS + 2
SIZE = LANES * BINS + 3  #: int64 words of one accumulator: LANES × BINS mantissa sums, then NaN, +inf, -inf counts
SPILL_EVERY = 1 << 38  #: values added to the bins before they are moved into a Python int


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
def accumulate(acc: np.ndarray, x: np.ndarray) -> None:
    """acc += Σ x exactly (x: flat float32)."""
    n = x.shape[0]
    n4 = n - n % LANES
    for i in range(0, n4, LANES):
        add(acc, 0, x[i])
        add(acc, 1, x[i + 1])
        add(acc, 2, x[i + 2])
        add(acc, 3, x[i + 3])
    for i in range(n4, n):
        add(acc, 0, x[i])


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
