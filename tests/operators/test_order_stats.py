"""Order statistics of |Δ| (`operators/order_stats.py`) and the breadcrumbs band kernel against plain numpy:
the radix select equals ``np.sort`` (NaN last, so NaN counts largest) for every k, edge values included."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mergepipe_db.kernels import merge as kern
from mergepipe_db.operators import ExpertParams, make_operator, order_stats
from mergepipe_db.operators.base import MergeOperator


def _op() -> MergeOperator:
    return make_operator("ties", [ExpertParams("a")])


def _magnitudes(rng: np.random.Generator, n: int, case: int) -> np.ndarray:
    """Non-negative float32 values with zeros, duplicates, one shared 16-bit prefix, subnormals, inf, NaN."""
    a = np.abs(rng.standard_normal(n) * np.exp(rng.uniform(-20, 20, n))).astype(np.float32)
    a[rng.random(n) < 0.3] = 0.0
    dup = rng.random(n) < 0.2
    a[dup] = rng.choice(a[:50], int(dup.sum()))  # many duplicates
    same = rng.random(n) < 0.2  # one top-16-bit prefix, differing low bits: the second pass decides
    a[same] = (np.uint32(0x3F81_0000) | rng.integers(0, 1 << 16, int(same.sum()), dtype=np.uint32)).view(np.float32)
    a[rng.random(n) < 0.02] = np.float32(1e-42)  # subnormal
    if case >= 1:
        a[rng.integers(0, n, 5)] = np.inf
    if case >= 2:  # NaN of several patterns, all with the sign bit clear (magnitudes)
        pats = np.array([0x7FC0_0000, 0x7F80_0001, 0x7FFF_FFFF, 0x7F81_0000], np.uint32)
        a[rng.integers(0, n, 7)] = rng.choice(pats, 7).view(np.float32)
    if case == 3:
        a[:] = 0.0
    if case == 4:
        a[:] = np.float32(np.nan)
    return a


@pytest.mark.parametrize("case", range(5))
@pytest.mark.parametrize("small", [0, 4096])
def test_kth_largest_exact_equals_np_sort(monkeypatch, case: int, small: int) -> None:
    """Every k from a spread including 1 and n, several sizes, with and without the cached first histogram."""
    monkeypatch.setattr(order_stats, "RADIX_SMALL", small)
    rng = np.random.default_rng(100 + case)
    op = _op()
    for n in (1, 2, 4097, 30011) + ((300_007,) if case == 2 else ()):  # and once on interleaved counter rows
        a = _magnitudes(rng, n, case)
        asc = np.sort(a)  # NaN last: asc[n - k] is the k-th largest with NaN largest
        ks = sorted({1, min(2, n), n // 3 or 1, n // 2 or 1, n - 1 or 1, n, *rng.integers(1, n + 1, 20).tolist()})
        cache: dict[str, np.ndarray] = {}
        prepared: dict[str, np.ndarray] = {}
        order_stats.count_prefixes(a, ks[:5], prepared)  # the second histograms of several k made at once
        for k in ks:
            want = asc[n - k]
            for c in (cache, None, prepared):
                got = order_stats.kth_largest_exact(a, k, op, c)
                if np.isnan(want):  # which NaN pattern is "largest" is no order's business: a NaN
                    assert math.isnan(got), (n, k, got)
                else:
                    assert np.float32(got).view(np.uint32) == want.view(np.uint32), (n, k, got, want)


def test_kth_largest_exact_refuses_a_negative_value() -> None:
    """The radix order is the magnitudes' order only without the sign bit: such an input is refused."""
    a = np.ones(10_000, np.float32)
    a[77] = -0.0
    with pytest.raises(ValueError, match="sign bit"):
        order_stats.kth_largest_exact(a, 5, _op())


@pytest.mark.parametrize("n", [10_001, (1 << 18) + 7])  # one counter row; interleaved rows and a tail
def test_radix_kernels_match_numpy(n: int) -> None:
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 1 << 31, n, dtype=np.uint32)
    bits[:3000] = bits[0]  # a run of one value (the interleaved counters)
    bits[3000:60000] = (bits[3000:60000] & 0xFFFF) | (bits[1] & 0xFFFF0000)  # a crowded prefix
    for p in (int(bits[0] >> 16), int(bits[1] >> 16), int(bits[-1] >> 16), 0x7FFF):
        h = np.full(kern.RADIX_BINS, 2, np.int64)  # added to
        kern.radix_count_high(bits, h)
        assert np.array_equal(h - 2, np.bincount(bits >> 16, minlength=kern.RADIX_BINS))
        for pair in ([p], [p, int(bits[2] >> 16)], [p, 0x7FFE]):  # one prefix, or two in one pass
            if len(set(pair)) < len(pair):
                continue
            h2 = np.full((len(pair), kern.RADIX_BINS), 3, np.int64)
            kern.radix_count_low(bits, np.array(pair, np.uint32), h2)
            for row, q in zip(h2, pair):
                want = np.bincount(bits[(bits >> 16) == q] & 0xFFFF, minlength=kern.RADIX_BINS)
                assert np.array_equal(row - 3, want)
    counts = rng.integers(0, 3, 50)
    top = np.cumsum(counts[::-1])
    for k in range(1, int(counts.sum()) + 1):
        i = int(np.searchsorted(top, k))
        assert kern.locate_from_top(counts, k) == (49 - i, int(top[i]) - int(counts[49 - i]))
    a = _magnitudes(rng, 5000, 2)
    for v in (0.0, 1e-42, 1.0, np.inf):
        assert kern.count_ge(a, np.float32(v)) == int(np.count_nonzero(a >= np.float32(v)))
    assert kern.count_nan(a) == int(np.isnan(a).sum())


@pytest.mark.parametrize("raw_dtype", ["bf16", "f32"])
def test_masked_delta_is_the_literal_formula(raw_dtype: str) -> None:
    """where(keep, Δ, 0.0) * w for the band lo < |Δ| < hi (with and without lo) and the TIES trim |Δ| >= lo,
    bit for bit up to the sign of zeros (they only meet +0.0-started sums), and the finite flag."""
    rng = np.random.default_rng(9)
    n = 20_000
    base = rng.standard_normal(n).astype(np.float32)
    theta = (base + rng.standard_normal(n).astype(np.float32) * np.float32(0.01))
    theta[:2000] = base[:2000]  # Δ = 0
    theta[5], theta[6], base[7] = np.inf, np.nan, -np.inf
    if raw_dtype == "bf16":
        raw = (theta.view(np.uint32) >> 16).astype(np.uint16)
        th = (raw.astype(np.uint32) << 16).view(np.float32)
    else:
        raw, th = theta, theta
    d = th - base
    a = np.abs(d)
    srt = np.sort(a[np.isfinite(a)])
    lo, hi = srt[2500], srt[-200]  # cut points are elements of |Δ|, as breadcrumbs' are: the ends decide
    w = np.float32(0.3)
    for test_lo, band in ((True, True), (False, True), (True, False)):
        if band:
            keep = (a < hi) & ((a > lo) if test_lo else True)
        else:
            keep = a >= lo
        want = np.where(keep, d, np.float32(0.0)) * w
        for span in (slice(0, n), slice(10, n)):  # with and without the inf/NaN
            out = np.empty(want[span].size, np.float32)
            finite = kern.masked_delta(out, base[span], raw[span], lo, hi, test_lo, band, w)
            assert finite == bool(np.isfinite(want[span]).all())
            same = (out == want[span]) | (np.isnan(out) & np.isnan(want[span]))
            assert same.all()
            assert np.array_equal(np.isnan(out), np.isnan(want[span]))
            nz = want[span] != 0
            assert np.array_equal(out[nz].view(np.uint32), want[span][nz].view(np.uint32))


def test_breadcrumbs_cut_points_from_magnitudes_equal_sorting() -> None:
    """`Magnitudes.topk_min` / `bottomk_max` (breadcrumbs' hi and lo, exact mode) against a sort of |Δ|."""
    rng = np.random.default_rng(4)
    op = _op()
    a = _magnitudes(rng, 50_000, 1)
    mags = order_stats.Magnitudes(a, a.size, None, op)
    asc = np.sort(a)
    for k in (1, 500, 4500, 49_999, 50_000):
        assert mags.topk_min(k) == float(asc[a.size - k])
        assert mags.bottomk_max(k) == float(asc[k - 1])
    assert mags.topk_min(0) == math.inf and mags.bottomk_max(0) == -math.inf
    a[3] = np.nan
    mags = order_stats.Magnitudes(a, a.size, None, op)
    assert mags.nan_read() == 1 and math.isnan(mags.topk_min(10))
