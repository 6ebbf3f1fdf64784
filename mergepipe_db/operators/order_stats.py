"""Order statistics of |Δ| for the magnitude trims (TIES, breadcrumbs): the exact k-th largest by radix select,
and `Magnitudes`, which answers from the rows read or, under a partial read, from the catalog's |Δ| sketch.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from mergepipe_db.core import sketch
from mergepipe_db.operators.base import kernels

__all__ = ["EDGES", "LAST_BIN", "RADIX_SMALL", "Magnitudes", "Scratch", "count_prefixes", "kth_largest_bits",
           "kth_largest_exact"]

#: the sketch's bin edges (the smallest value of each bin), and its last bin (NaN sits there too)
EDGES = sketch.bin_edges()
LAST_BIN = sketch.LAST_BIN


class Scratch(Protocol):
    """What order statistics need of an operator: its reused buffers (`MergeOperator.scratch`)."""

    def scratch(self, name: str, n: int, dtype: Any = ...) -> np.ndarray: ...


RADIX_SMALL = 4096  # at or below this many elements a sort is cheaper than a radix select's histograms


def _high_counts(bits: np.ndarray, cache: dict[str, np.ndarray] | None) -> np.ndarray:
    """The histogram of the top 16 bits of `bits` (cached in ``cache``); ValueError on a sign bit set."""
    h1 = None if cache is None else cache.get("h1")
    if h1 is None:
        kern = kernels()
        h1 = np.zeros(kern.RADIX_BINS, dtype=np.int64)
        kern.radix_count_high_par(bits, h1)
        if h1[kern.RADIX_BINS >> 1 :].any():
            raise ValueError("kth_largest_exact: a value has its sign bit set (not a magnitude)")
        if cache is not None:
            cache["h1"] = h1
    return h1


def kth_largest_exact(a: np.ndarray, k: int, op: Scratch, cache: dict[str, np.ndarray] | None = None,
                       ) -> float:
    """The k-th largest (1 <= k <= numel) of a 1-D float32 array of magnitudes, NaN counted largest.

    Radix select on the bit patterns (non-negative float32 order = uint32 order, NaN above inf), by the
    numba kernels: one pass counts the top 16 bits and locates the k-th largest's prefix, a second counts
    the low 16 bits of the elements with that prefix. Equal to ``torch.sort(a, descending=True).values[k-1]``
    without sorting, topk, selecting elements or temporaries. ``cache`` keeps the first histogram for
    further queries on the same ``a``, and the second ones `count_prefixes` made. ValueError when ``a``
    holds a value with its sign bit set (-0.0, a negative number, a negative NaN): not a magnitude.
    """
    n = a.size
    if n <= RADIX_SMALL:
        return float(np.sort(a)[n - k])  # ascending, NaN last: the k-th largest with NaN largest
    return float(np.array([kth_largest_bits(a, k, op, cache)], np.uint32).view(np.float32)[0])


def kth_largest_bits(a: np.ndarray, k: int, op: Scratch, cache: dict[str, np.ndarray] | None = None) -> int:
    """The bit pattern of `kth_largest_exact`'s value (1 <= k <= numel), as an int; NaNs ordered by pattern.
    ValueError when a value has its sign bit set (the radix path; a short array is sorted as patterns)."""
    n = a.size
    if n <= RADIX_SMALL:
        return int(np.sort(a.view(np.uint32))[n - k])
    kern = kernels()
    bits = a.view(np.uint32)
    hi, above = kern.locate_from_top(_high_counts(bits, cache), k)
    h2 = None if cache is None else cache.get(f"low:{hi}")
    if h2 is None:
        h2 = op.scratch("radix_low", kern.RADIX_BINS, np.int64)
        h2[:] = 0
        kern.radix_count_low_par(bits, np.array([hi], np.uint32), h2.reshape(1, -1))
    low, _ = kern.locate_from_top(h2, k - above)
    return (int(hi) << 16) | int(low)


def count_prefixes(a: np.ndarray, ks: list[int], cache: dict[str, np.ndarray]) -> None:
    """Make the second histograms of `kth_largest_exact` for every k of `ks` (1 <= k <= numel) at once, two
    prefixes a pass, into ``cache``: breadcrumbs' two cut points then cost one pass over ``a``, not two."""
    if a.size <= RADIX_SMALL:
        return
    kern = kernels()
    bits = a.view(np.uint32)
    h1 = _high_counts(bits, cache)
    todo = sorted({int(kern.locate_from_top(h1, k)[0]) for k in ks} - {int(key[4:]) for key in cache
                                                                          if key.startswith("low:")})
    for i in range(0, len(todo), 2):
        pair = todo[i : i + 2]
        h = np.zeros((len(pair), kern.RADIX_BINS), np.int64)
        kern.radix_count_low_par(bits, np.array(pair, np.uint32), h)
        for p, row in zip(pair, h):
            cache[f"low:{p}"] = row


class Magnitudes:
    """|Δ| of the rows read for one expert and tensor, and order statistics of the whole tensor's |Δ|.

    Positions follow a descending sort with NaN first (torch's order): ``desc(k)`` is the k-th largest.
    Exact mode (``hist is None``: full selection, or no sketch): the tensor is the rows read plus zeros
    for the rest; `kth_largest_exact` finds the value. Sketch mode (partial selection): the catalog
    histogram locates the bin; when every element of that bin was read the value is still exact (its rank
    among the rows read is known), otherwise it is interpolated inside the bin (`sketch.kth_largest`).
    """

    def __init__(self, a: np.ndarray, n_total: int, hist: np.ndarray | None, op: Scratch) -> None:
        self.a = a
        self.n = n_total
        self.hist = hist
        self._op = op
        self._nan_read: int | None = None
        self._cache: dict[str, np.ndarray] = {}

    def nan_read(self) -> int:
        if self._nan_read is None:
            kern = kernels()

            self._nan_read = int(kern.count_nan(self.a))
        return self._nan_read

    def _count_ge(self, v: float) -> int:
        """Read elements with |Δ| >= v (NaN not counted)."""
        kern = kernels()

        return int(kern.count_ge(self.a, np.float32(v)))

    def _desc_sketch(self, k: int) -> float | None:
        """Exact k-th largest from the sketch's counts when every element of its bin was read, else None."""
        hist = self.hist
        assert hist is not None
        b, above = sketch.locate_kth_largest(hist, k)
        if b == sketch.ZERO_BIN:
            return 0.0
        r = k - above  # rank inside bin b (NaN first in the last bin)
        ge_lo = self._count_ge(float(EDGES[b]))
        if b == LAST_BIN:
            in_bin, read_above = ge_lo + self.nan_read(), 0
        else:
            read_above = self._count_ge(float(EDGES[b + 1]))
            in_bin = ge_lo - read_above
            read_above += self.nan_read()
        if in_bin != int(hist[b]):
            return None
        return kth_largest_exact(self.a, read_above + r, self._op, self._cache)

    def prepare(self, ks: list[int]) -> None:
        """Let `desc` answer each k of `ks` (the positions it will be asked) with fewer passes: in exact mode the
        second radix histograms of all of them are made in one pass (`count_prefixes`)."""
        if self.hist is None:
            count_prefixes(self.a, [k for k in ks if 1 <= k <= self.a.size], self._cache)

    def desc(self, k: int) -> float:
        """The k-th largest |Δ| of the whole tensor (1 <= k <= n), NaN counted largest."""
        if self.hist is None:
            return kth_largest_exact(self.a, k, self._op, self._cache) if k <= self.a.size else 0.0
        exact = self._desc_sketch(k) if int(self.hist.sum()) == self.n else None
        if exact is not None:
            return exact
        return float(np.float32(sketch.kth_largest(self.hist, k)))

    def nan_total(self) -> int | None:
        """NaN count of the whole tensor if known (0 or more), else None."""
        if self.hist is None or self.nan_read():
            return self.nan_read()
        if int(self.hist[LAST_BIN]) == 0 or self._count_ge(float(EDGES[LAST_BIN])) == int(self.hist[LAST_BIN]):
            return 0
        return None

    def topk_min(self, k: int) -> float:
        """``torch.topk(|Δ|.flatten(), k).values.min()`` (+inf for k == 0): NaN if any NaN. When a partial
        read cannot tell (NaN would sit in the sketch's last bin, not wholly read), NaN is left out."""
        if k <= 0:
            return math.inf
        if self.nan_total():
            return math.nan
        return self.desc(k)

    def bottomk_max(self, k: int) -> float:
        """``torch.topk(|Δ|.flatten(), k, largest=False).values.max()`` (-inf for k == 0)."""
        if k <= 0:
            return -math.inf
        return self.desc(self.n - k + 1)
