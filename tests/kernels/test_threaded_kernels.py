"""The merge kernels on numba's threads (`kernels.merge`, the ``*_par`` drivers) give the serial kernels' bits,
whatever the number of threads: elementwise outputs byte for byte, exact sums and histograms as integers."""

from __future__ import annotations

import contextlib

import numba
import numpy as np
import pytest

from mergepipe_db.kernels import exact_sum
from mergepipe_db.kernels import merge as K

SIZES = [1, 4097, (1 << 17) + 5, 3 * (1 << 17) + 12345, (1 << 21) + 7]


@contextlib.contextmanager
def threads(n: int):
    before = numba.get_num_threads()
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        numba.set_num_threads(before)


def operands(n: int, seed: int, specials: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(θ₀ float32, θ_k as BF16 patterns, uniforms) with zeros, ties, and (``specials``) NaN and ±inf."""
    rng = np.random.default_rng(seed)
    b = (rng.standard_normal(n) * 0.02).astype(np.float32)
    x32 = b + (rng.standard_normal(n) * 0.002).astype(np.float32)
    x32[rng.random(n) < 0.05] = 0.0
    x = (x32.view(np.uint32) >> 16).astype(np.uint16)
    x[rng.random(n) < 0.05] = (b[: 1].view(np.uint32) >> 16).astype(np.uint16)[0]
    if specials and n > 10:
        x[3], x[7], x[n // 2] = 0x7FC0, 0x7F80, 0xFF80  # NaN, +inf, -inf
    u = rng.random(n, dtype=np.float32)
    return b, x, u


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("della", [False, True])
@pytest.mark.parametrize("specials", [False, True])
def test_random_keep_mask_and_exact_sums(n: int, della: bool, specials: bool) -> None:
    b, x, u = operands(n, n, specials)
    p = (np.random.default_rng(1).random(n, dtype=np.float32) if della else np.array([0.3], np.float32))
    step = 1 if della else 0
    keep0 = np.zeros(n, np.bool_)
    acc0 = [np.zeros(exact_sum.SIZE, np.int64) for _ in range(2)]
    K.random_keep(keep0, b, x, u, p, step, True, acc0[0], acc0[1])
    for t in (1, 2):
        keep = np.zeros(n, np.bool_)
        acc = [np.zeros(exact_sum.SIZE, np.int64) for _ in range(2)]
        with threads(t):
            K.random_keep_par(keep, b, x, u, p, step, True, acc[0], acc[1])
        assert np.array_equal(keep, keep0)
        for a, a0 in zip(acc, acc0):  # the same exact value (bins may split it differently)
            assert repr(exact_sum.value(a)) == repr(exact_sum.value(a0))
            assert np.array_equal(a[exact_sum.LANES * exact_sum.BINS:], a0[exact_sum.LANES * exact_sum.BINS:])


@pytest.mark.parametrize("n", SIZES)
def test_elementwise_drivers(n: int) -> None:
    b, x, u = operands(n, n + 1)
    keep = u < np.float32(0.4)
    p = np.random.default_rng(2).random(n, dtype=np.float32) + np.float32(0.1)
    mixed0 = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    for t in (1, 2):
        with threads(t):
            for mode in (0, 1, 2):
                for step, pp in ((0, p[:1]), (1, p)):
                    want, got = mixed0.copy(), mixed0.copy()
                    K.masked_delta_span(want, b, x, keep, pp, step, mode, np.float32(1.7), np.float32(0.3))
                    K.masked_delta_span_par(got, b, x, keep, pp, step, mode, np.float32(1.7), np.float32(0.3))
                    assert want.tobytes() == got.tobytes()
            want, got = mixed0.copy(), mixed0.copy()
            K.dare_delta_span(want, b, x, u, np.float32(0.3), np.float32(0.7))
            K.dare_delta_span_par(got, b, x, u, np.float32(0.3), np.float32(0.7))
            assert want.tobytes() == got.tobytes()
            for band, test_lo in ((False, True), (True, True), (True, False)):
                want, got = np.empty(n, np.float32), np.empty(n, np.float32)
                f0 = K.masked_delta(want, b, x, np.float32(1e-3), np.float32(4e-3), test_lo, band, np.float32(0.5))
                f1 = K.masked_delta_par(got, b, x, np.float32(1e-3), np.float32(4e-3), test_lo, band,
                                        np.float32(0.5))
                assert want.tobytes() == got.tobytes() and f0 == f1
            fin = operands(n, n + 2, specials=False)
            want, got = np.empty(n, np.float32), np.empty(n, np.float32)
            assert K.masked_delta(want, fin[0], fin[1], np.float32(0), np.float32(1), True, True, np.float32(1))
            assert K.masked_delta_par(got, fin[0], fin[1], np.float32(0), np.float32(1), True, True, np.float32(1))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("weights", [False, True])
def test_ties_sum_drivers(n: int, weights: bool) -> None:
    b, x, u = operands(n, n + 4)
    keep = u < np.float32(0.5)
    p = np.array([0.5], np.float32)
    rng = np.random.default_rng(5)
    start = [rng.standard_normal(n).astype(np.float32) for _ in range(5)]
    for t in (1, 2):
        with threads(t):
            for init in (False, True):
                want, got = [a.copy() for a in start], [a.copy() for a in start]
                K.ties_masked_span(*want, b, x, keep, p, 0, 2, np.float32(1), np.float32(0.6), weights, init)
                K.ties_masked_span_par(*got, b, x, keep, p, 0, 2, np.float32(1), np.float32(0.6), weights, init)
                assert [a.tobytes() for a in want] == [a.tobytes() for a in got]
                want, got = [a.copy() for a in start], [a.copy() for a in start]
                K.ties_dare_span(*want, b, x, u, np.float32(0.4), np.float32(0.6), weights, init)
                K.ties_dare_span_par(*got, b, x, u, np.float32(0.4), np.float32(0.6), weights, init)
                assert [a.tobytes() for a in want] == [a.tobytes() for a in got]


@pytest.mark.parametrize("n", SIZES)
def test_absdelta_and_radix_histograms(n: int) -> None:
    b, x, _u = operands(n, n + 6)
    ranges = np.array([[0, n]], np.int64) if n < 100 else np.array([[0, n // 3], [n // 2, n]], np.int64)
    n_read = int((ranges[:, 1] - ranges[:, 0]).sum())
    want, got = np.empty(n_read, np.float32), np.empty(n_read, np.float32)
    K.absdelta(want, b, x, ranges)
    for t in (1, 2):
        with threads(t):
            got[:] = -1.0
            K.absdelta_par(got, b, x, ranges)
            assert want.tobytes() == got.tobytes()
            bits = want.view(np.uint32)
            h0, h1 = np.zeros(K.RADIX_BINS, np.int64), np.zeros(K.RADIX_BINS, np.int64)
            K.radix_count_high(bits, h0)
            K.radix_count_high_par(bits, h1)
            assert np.array_equal(h0, h1)
            top = np.flatnonzero(h0)
            prefixes = np.array([top[len(top) // 3], top[-1]], np.uint32)
            l0, l1 = np.zeros((2, K.RADIX_BINS), np.int64), np.zeros((2, K.RADIX_BINS), np.int64)
            K.radix_count_low(bits, prefixes, l0)
            K.radix_count_low_par(bits, prefixes, l1)
            assert np.array_equal(l0, l1) and l0.sum() > 0


@pytest.mark.parametrize("n", [5, 4097, (1 << 20) * 3 + 5])
@pytest.mark.parametrize("part", [False, True])
def test_kth_largest_abs_deltas_is_the_sorted_value(n: int, part: bool) -> None:
    """Breadcrumbs' two cut points straight from the stored values: the k-th largest of the sorted |Δ| (BF16
    experts: many ties, and zeros), for k at the ends and inside, with (``part``) some rows not read, whose Δ is
    0 (their stored bytes are garbage here); None when some |Δ| read is inf or NaN."""
    b, x, _u = operands(n, n + 8, specials=False)
    ranges = np.array([[0, n]], np.int64)
    if part and n > 10:
        ranges = np.array([[1, n // 3], [n // 2, n - 2]], np.int64)
    d = np.zeros(n, np.float32)
    read = np.zeros(n, np.bool_)
    for s0, e0 in ranges:
        d[s0:e0] = np.abs((x[s0:e0].astype(np.uint32) << 16).view(np.float32) - b[s0:e0])
        read[s0:e0] = True
    x[~read] = 0x7FC0  # NaN off the ranges: never looked at
    desc = np.sort(d)[::-1]
    ks = sorted({1, 2, max(1, n // 100), n // 2 + 1, n - n // 10, n})
    for t in (1, 2):
        with threads(t):
            for i in range(len(ks) - 1):
                got = K.kth_largest_abs_deltas(b, x, ranges, n, [ks[i], ks[-1 - i]])
                assert got == [float(desc[ks[i] - 1]), float(desc[ks[-1 - i] - 1])]
    x[int(ranges[0, 0]) + 1] = 0x7FC0  # a NaN Δ read
    assert K.kth_largest_abs_deltas(b, x, ranges, n, [1, n]) is None
    x[int(ranges[0, 0]) + 1] = 0x7F80  # an infinite one
    assert K.kth_largest_abs_deltas(b, x, ranges, n, [1]) is None


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("weights", [False, True])
def test_ties_add_terms_is_numpys_combine(n: int, weights: bool) -> None:
    """`TiesFold._combine`'s numpy form on finite terms (signed zeros among them), against the fused kernel."""
    rng = np.random.default_rng(n + 9)
    D = (rng.standard_normal(n) * 0.01).astype(np.float32)
    D[rng.random(n) < 0.2] = 0.0
    D[rng.random(n) < 0.1] = -0.0
    start = [np.abs(rng.standard_normal(n)).astype(np.float32) * s for s in (1, 1, -1, 1, 1)]
    start[0] = rng.standard_normal(n).astype(np.float32)
    w = np.float32(-0.7)
    want = [a.copy() for a in start]
    want[0] += D
    want[1] += np.maximum(D, 0.0)
    want[2] += np.minimum(D, 0.0)
    if weights:
        want[3] += (D > 0).astype(np.float32) * w
        want[4] += (D < 0).astype(np.float32) * w
    for t in (1, 2):
        got = [a.copy() for a in start]
        with threads(t):
            K.ties_add_terms(*got, D, w, weights)
        assert [a.tobytes() for a in got] == [a.tobytes() for a in want]
