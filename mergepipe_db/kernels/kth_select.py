"""Breadcrumbs' cut points, the k-th largest |Δ| of a tensor, in one pass over its stored values (numba).

The radix select (`merge.kth_largest_abs_deltas`) reads every |Δ| twice and counts each into a histogram.
Here a sample of |Δ| patterns, evenly spaced over the rows read, brackets each k-th largest between two of its
values, ``lo <= v_k <= hi``, with a margin of four standard deviations of the sample's rank; then one pass,
on numba's threads, counts the patterns above ``hi``, equal to ``hi``, equal to ``lo`` and keeps those strictly
between (rare: a fraction of a percent of the tensor). The k-th largest is then ``hi``, ``lo`` or a selection
among the kept ones. The sample only decides how fast: where it misleads (the k-th outside the bracket, or more
patterns between than room was made for) the radix select runs instead, so the result is always the exact
k-th largest, the same value as the sort's. |Δ| patterns are `merge.absdelta_bits_tile`'s; non-negative
float32 patterns order as unsigned integers.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from mergepipe_db.kernels.compress import SLACK, pack_between
from mergepipe_db.kernels.float_bits import f32_to_bits, widen
from mergepipe_db.kernels.merge import absdelta_bits_tile, kth_largest_abs_deltas

__all__ = ["SAMPLE", "SELECT_MIN", "kth_largest_abs_deltas_sampled", "sampled_bracket"]

SAMPLE = 16384  #: |Δ| patterns sampled to bracket the cut points
SELECT_MIN = 1 << 20  #: elements read from which the sampled bracket runs (below, the radix select costs as little)
_PIECE = 1 << 20  # elements per piece of the counting pass: each piece counts and keeps into its own slots
_TILE = 1024  # |Δ| patterns formed a tile at a time (a loop that vectorizes), then compared
_NONFINITE = np.uint32(0x7F800000)  # +inf's pattern; every NaN's |Δ| pattern is above it
_RANK_BINS = 4096  # `_rank_between`'s histogram
_MARGIN_SIGMAS = 4.0  # the bracket's margin, in standard deviations of the k-th's rank in the sample
_ABOVE, _EQ_HI, _BETWEEN, _EQ_LO, _SPILLED = 0, 1, 2, 3, 4  # the counts of one piece and cut
_MISSED = object()  # `_select`'s answer where the bracket missed a cut point or had no room for what it held


@numba.njit(cache=True, nogil=True)
def _sample_patterns(base: np.ndarray, raw: np.ndarray, spans: np.ndarray, n_read: int, out: np.ndarray) -> None:
    """out[i] = the |Δ| pattern at position ``n_read * i // len(out)`` of the rows read (`spans` laid end to
    end)."""
    m = out.shape[0]
    span = 0
    before = 0  # elements read in the spans before `span`
    for i in range(m):
        pos = n_read * i // m
        while pos >= before + spans[span, 1] - spans[span, 0]:
            before += spans[span, 1] - spans[span, 0]
            span += 1
        g = spans[span, 0] + pos - before
        out[i] = f32_to_bits(abs(widen(raw[g]) - base[g]))


@numba.njit(cache=True, nogil=True, parallel=True)
def _bracket_counts(base: np.ndarray, raw: np.ndarray, pieces: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                    kept: np.ndarray, room: int, counts: np.ndarray, nonfinite: np.ndarray) -> None:
    """For piece p (elements pieces[p] of the flat tensor) and cut j: counts[p, j] = the |Δ| patterns above
    hi[j], equal to hi[j], strictly between lo[j] and hi[j], and equal to lo[j] (0 where lo[j] = hi[j]), then
    1 where some of those between were not kept; those between kept, tile by tile while a tile's worth of
    `room` is left, at kept[j, p·(room + SLACK):] (packed 16 lanes at a time: `compress.pack_between`);
    nonfinite[p] = the patterns of inf or NaN. Pieces on
    numba's threads."""
    nk = lo.shape[0]
    for p in numba.prange(pieces.shape[0]):
        tile = np.empty(_TILE, np.uint32)
        bad = 0
        for j in range(nk):
            for c in range(5):
                counts[p, j, c] = 0
        for t0 in range(pieces[p, 0], pieces[p, 1], _TILE):
            m = min(_TILE, pieces[p, 1] - t0)
            v = tile[:m]
            absdelta_bits_tile(v, base[t0:t0 + m], raw[t0:t0 + m])
            top = np.uint32(0)
            for i in range(m):
                top = max(top, v[i])
            bad += top >= _NONFINITE
            for j in range(nk):
                h, lw = hi[j], lo[j]
                # a tile's counts in uint32 (m <= _TILE), one loop for all of them: the loop vectorizes
                above, eq_hi, eq_lo = np.uint32(0), np.uint32(0), np.uint32(0)
                if lw == h:
                    for i in range(m):
                        above += np.uint32(1) if v[i] > h else np.uint32(0)
                        eq_hi += np.uint32(1) if v[i] == h else np.uint32(0)
                else:
                    for i in range(m):
                        above += np.uint32(1) if v[i] > h else np.uint32(0)
                        eq_hi += np.uint32(1) if v[i] == h else np.uint32(0)
                        eq_lo += np.uint32(1) if v[i] == lw else np.uint32(0)
                counts[p, j, _ABOVE] += above
                counts[p, j, _EQ_HI] += eq_hi
                counts[p, j, _EQ_LO] += eq_lo
                if lw == h:
                    continue
                if h - lw < 2:
                    continue  # no pattern lies strictly between
                n = counts[p, j, _BETWEEN]
                if n + m <= room:
                    n += pack_between(v, m, lw, h, kept[j], p * (room + SLACK) + n)
                else:  # no room left: only counted (the caller then selects by the radix)
                    counts[p, j, _SPILLED] = 1
                    for i in range(m):
                        n += (v[i] > lw) & (v[i] < h)
                counts[p, j, _BETWEEN] = n
        nonfinite[p] = bad


@numba.njit(cache=True, nogil=True)
def _rank_between(kept: np.ndarray, stride: int, counts: np.ndarray, lo: np.uint32, hi: np.uint32, r: int
                  ) -> np.uint32:
    """The r-th smallest (0-based) of the patterns kept between lo and hi: piece p's counts[p] of them at
    kept[p·stride:]. A histogram of (v − lo − 1)'s top bits (`_RANK_BINS` bins) finds the r-th's bin; only
    that bin's patterns are then collected and sorted."""
    span = np.int64(hi) - np.int64(lo) - 1  # the patterns lie in [lo + 1, lo + span]
    shift = 0
    while (span - 1) >> shift >= _RANK_BINS:
        shift += 1
    hist = np.zeros(_RANK_BINS, np.int64)
    low = np.int64(lo) + 1
    for p in range(counts.shape[0]):
        for i in range(p * stride, p * stride + counts[p]):
            hist[(np.int64(kept[i]) - low) >> shift] += 1
    below = 0
    target = 0
    for target in range(_RANK_BINS):
        if below + hist[target] > r:
            break
        below += hist[target]
    chosen = np.empty(hist[target], np.uint32)
    n = 0
    for p in range(counts.shape[0]):
        for i in range(p * stride, p * stride + counts[p]):
            if (np.int64(kept[i]) - low) >> shift == target:
                chosen[n] = kept[i]
                n += 1
    chosen.sort()
    return chosen[r - below]


def sampled_bracket(sorted_sample: np.ndarray, n_read: int, k: int) -> tuple[int, int]:
    """(lo, hi): the |Δ| patterns of the ascending `sorted_sample` (of the n_read patterns read) that bracket the
    k-th largest (1 <= k <= n_read) with a margin of `_MARGIN_SIGMAS` standard deviations of its rank; hi is
    0xFFFFFFFF (above every |Δ|) where the margin reaches past the sample's top, lo is 0 past its bottom."""
    m = sorted_sample.shape[0]
    q = k / n_read
    rank = q * m - 1  # the k-th largest's expected 0-based place from the top of the sample
    margin = _MARGIN_SIGMAS * math.sqrt(m * q * (1.0 - q)) + 2.0
    top, bottom = math.floor(rank - margin), math.ceil(rank + margin)
    hi = int(sorted_sample[m - 1 - top]) if top >= 0 else 0xFFFFFFFF
    lo = int(sorted_sample[m - 1 - bottom]) if bottom < m else 0
    return lo, hi


def kth_largest_abs_deltas_sampled(base: np.ndarray, raw: np.ndarray, ranges: np.ndarray, n_total: int,
                                   ks: list[int]) -> list[float] | None:
    """`merge.kth_largest_abs_deltas` (the same values, None when some |Δ| read is inf or NaN), in one pass
    through a sampled bracket where at least `SELECT_MIN` elements were read, else (and wherever the bracket
    misses) by that radix select."""
    spans = np.array([(int(s0), int(e0)) for s0, e0 in ranges if e0 > s0], np.int64).reshape(-1, 2)
    n_read = int((spans[:, 1] - spans[:, 0]).sum())
    if n_read < SELECT_MIN:
        return kth_largest_abs_deltas(base, raw, ranges, n_total, ks)
    found = _select(base, raw, spans, n_read, ks)
    if found is _MISSED:
        return kth_largest_abs_deltas(base, raw, ranges, n_total, ks)
    return found  # type: ignore[return-value]


def _select(base: np.ndarray, raw: np.ndarray, spans: np.ndarray, n_read: int, ks: list[int]) -> object:
    """The k-th largest |Δ| for each k of `ks` through the sampled bracket, None (an inf or NaN read), or
    `_MISSED`. A k beyond the n_read elements read is +0.0: the unread elements' |Δ|, below every other."""
    sample = np.empty(min(SAMPLE, n_read), np.uint32)
    _sample_patterns(base, raw, spans, n_read, sample)
    sample.sort()
    cuts = [k for k in dict.fromkeys(ks) if k <= n_read]
    if not cuts:
        return _MISSED
    brackets = [sampled_bracket(sample, n_read, k) for k in cuts]
    pieces = np.array([(a, min(a + _PIECE, int(e0))) for s0, e0 in spans for a in range(int(s0), int(e0), _PIECE)],
                      np.int64).reshape(-1, 2)
    # room in each piece for half as many again as the sample has the whole tensor hold between lo and hi (a
    # piece of rows may hold most of them), and a tile more: a tile is kept only where it fits whole
    between = max((max(0, int(np.searchsorted(sample, hi, "left") - np.searchsorted(sample, lo, "right")))
                   for lo, hi in brackets), default=0)
    room = 3 * between * n_read // (2 * sample.shape[0]) + 2 * _TILE
    lo = np.array([b[0] for b in brackets], np.uint32)
    hi = np.array([b[1] for b in brackets], np.uint32)
    kept = np.empty((len(cuts), pieces.shape[0] * (room + SLACK)), np.uint32)
    counts = np.empty((pieces.shape[0], len(cuts), 5), np.int64)
    nonfinite = np.empty(pieces.shape[0], np.int64)
    _bracket_counts(base, raw, pieces, lo, hi, kept, room, counts, nonfinite)
    if nonfinite.any():
        return None
    found: dict[int, int] = {}
    for j, k in enumerate(cuts):
        above, eq_hi, between_n, eq_lo, _ = (int(c) for c in counts[:, j].sum(axis=0))
        if k <= above:
            return _MISSED
        if k <= above + eq_hi:
            found[k] = int(hi[j])
        elif k <= above + eq_hi + between_n:
            if counts[:, j, _SPILLED].any():
                return _MISSED
            r = between_n - (k - above - eq_hi)  # its place in ascending order
            found[k] = int(_rank_between(kept[j], room + SLACK, counts[:, j, _BETWEEN].copy(), lo[j], hi[j], r))
        elif k <= above + eq_hi + between_n + eq_lo:
            found[k] = int(lo[j])
        else:
            return _MISSED
    keys = np.array([found.get(k, 0) for k in ks], np.uint32)
    return [float(v) for v in keys.view(np.float32)]
