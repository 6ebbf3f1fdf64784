"""Breadcrumbs' cut points through a sampled bracket (`kernels.kth_select`): always the sorted |Δ|'s k-th
largest, whether the bracket holds it, misses it, or has no room for what it holds; and the 16-lane packing
it keeps candidates with (`compress.pack_between`)."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from mergepipe_db.kernels import compress
from mergepipe_db.kernels import kth_select as S

N = S.SELECT_MIN + 12_345


def _abs_delta(b: np.ndarray, x: np.ndarray) -> np.ndarray:
    """|widen(x) − b| in numpy (x BF16 patterns or float32)."""
    wide = (x.astype(np.uint32) << 16).view(np.float32) if x.dtype == np.uint16 else x
    return np.abs(wide - b)


def _family_like(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """θ₀ and a BF16 θ_k as a fine-tune gives them: most Δ exactly 0, the others few distinct values (ties)."""
    rng = np.random.default_rng(seed)
    b16 = ((rng.standard_normal(n) * 0.02).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    b = (b16.astype(np.uint32) << 16).view(np.float32)
    x32 = b + (rng.standard_normal(n) * 0.002).astype(np.float32)
    x = (x32.view(np.uint32) >> 16).astype(np.uint16)
    same = rng.random(n) < 0.8
    x[same] = b16[same]
    return b, x


def _continuous(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """θ₀ and a float32 θ_k: every |Δ| distinct."""
    rng = np.random.default_rng(seed)
    b = rng.standard_normal(n).astype(np.float32)
    return b, b + rng.standard_normal(n).astype(np.float32)


def _want(d: np.ndarray, read: np.ndarray, ks: list[int]) -> list[float]:
    full = np.where(read, d, np.float32(0.0))
    desc = np.sort(full)[::-1]
    return [float(desc[k - 1]) for k in ks]


@pytest.mark.parametrize("kind", ["family", "continuous"])
@pytest.mark.parametrize("part", [False, True])
def test_sampled_select_is_the_sorted_value(kind: str, part: bool, monkeypatch) -> None:
    """The k-th largest of the sorted |Δ| (unread rows: 0) for k at the ends, inside, on zeros and beyond the
    rows read, from the bracket alone: the radix select is not called."""
    n = N + (N // 2 if part else 0)
    b, x = _family_like(n, 3) if kind == "family" else _continuous(n, 4)
    ranges = np.array([[0, n]], np.int64) if not part else np.array([[5, N // 2], [N - 100, n - 7]], np.int64)
    read = np.zeros(n, np.bool_)
    for s0, e0 in ranges:
        read[s0:e0] = True
    n_read = int(read.sum())
    assert n_read >= S.SELECT_MIN
    d = _abs_delta(b, x)
    calls = []
    monkeypatch.setattr(S, "kth_largest_abs_deltas", lambda *a: calls.append(a))
    for ks in ([1, n], [n // 100, n - n // 10 + 1], [n // 2, n // 3], [n_read // 7, n_read], [min(n_read + 1, n), 2]):
        assert S.kth_largest_abs_deltas_sampled(b, x, ranges, n, ks) == _want(d, read, ks), ks
    assert not calls


def test_a_missed_bracket_and_a_spilled_one_fall_back_to_the_radix(monkeypatch) -> None:
    """Where the sample misleads, the radix select answers, with the sorted value: the largest values all off
    the sampled positions (the bracket misses), and a narrow band of distinct values off them inside the bracket
    (more between lo and hi than the room made for them: spilled)."""
    m = S.SAMPLE
    n = m * 128  # sampled positions: the multiples of 128
    b = np.zeros(n, np.float32)
    on_sample = np.zeros(n, np.bool_)
    on_sample[::128] = True
    rng = np.random.default_rng(5)
    radix = []
    real = S.kth_largest_abs_deltas
    monkeypatch.setattr(S, "kth_largest_abs_deltas", lambda *a: radix.append(1) or real(*a))
    ranges = np.array([[0, n]], np.int64)

    x = rng.random(n).astype(np.float32)  # missed: ten times larger values, none sampled
    big = np.flatnonzero(~on_sample)[rng.permutation(n - m)[: n // 10]]
    x[big] += 10.0
    ks = [n // 20, n // 2]
    assert S.kth_largest_abs_deltas_sampled(b, x, ranges, n, ks) == _want(np.abs(x), np.ones(n, np.bool_), ks)
    assert radix == [1]

    x = (1.0 + rng.random(n)).astype(np.float32)  # spilled: a band of distinct values around the median
    band = 1.5 + (np.arange(n - m) % 4000).astype(np.float32) * np.float32(2**-23)
    x[~on_sample] = band
    ks = [n // 2 + 17]
    want = _want(np.abs(x), np.ones(n, np.bool_), ks)
    lo, hi = S.sampled_bracket(np.sort(x[on_sample].view(np.uint32)), n, ks[0])
    assert lo < np.float32(want[0]).view(np.uint32) < hi  # the bracket holds it, with the band between
    assert S.kth_largest_abs_deltas_sampled(b, x, ranges, n, ks) == want
    assert radix == [1, 1]


def test_inf_or_nan_read_gives_none() -> None:
    b, x = _family_like(N, 6)
    ranges = np.array([[0, N]], np.int64)
    for bad in (0x7FC0, 0x7F80, 0xFF80):
        y = x.copy()
        y[N - 3] = bad
        assert S.kth_largest_abs_deltas_sampled(b, y, ranges, N, [N // 100, N - N // 10]) is None


@numba.njit
def _pack(src: np.ndarray, lo: np.uint32, hi: np.uint32, out: np.ndarray, m: int) -> int:
    return compress.pack_between(src, src.shape[0], lo, hi, out, m)


@pytest.mark.parametrize("n", [0, 5, 16, 17, 1000])
def test_pack_between_keeps_the_keys_strictly_inside_in_order(n: int) -> None:
    rng = np.random.default_rng(n)
    src = rng.integers(0, 64, n).astype(np.uint32)
    if n:
        src[-1] = 40  # the tail's last key kept
    lo, hi = np.uint32(20), np.uint32(45)
    out = np.full(7 + n + compress.SLACK, 999, np.uint32)
    c = _pack(src, lo, hi, out, 7)
    want = src[(src > lo) & (src < hi)]
    assert c == want.size and np.array_equal(out[7:7 + c], want)
    assert (out[:7] == 999).all()
