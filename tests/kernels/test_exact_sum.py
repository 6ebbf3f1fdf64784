"""`kernels.exact_sum` against `math.fsum` (an independent exact summation) on float32 values: zeros of both signs,
subnormals, the largest finite values, cancellation, many elements, any split into parts; inf and NaN as numpy's
float64 sum gives them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mergepipe_db.kernels import exact_sum
from mergepipe_db.kernels.exact_sum import ExactSum


def fsum32(x: np.ndarray) -> float:
    return math.fsum(np.asarray(x, np.float32).astype(np.float64).tolist())


def of(x: np.ndarray, parts: int = 1) -> float:
    s = ExactSum()
    for p in np.array_split(np.asarray(x, np.float32), parts):
        s.add_array(p)
    return s.value()


def wild(rng: np.random.Generator, n: int) -> np.ndarray:
    """Every exponent, both signs, zeros, subnormals, the extremes."""
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32).copy()
    x[~np.isfinite(x)] = np.float32(3.4028235e38)
    x[rng.random(n) < 0.05] = 0.0
    x[rng.random(n) < 0.05] = -0.0
    sub = rng.random(n) < 0.1
    x[sub] = (rng.integers(1, 1 << 23, int(sub.sum())).astype(np.uint32)).view(np.float32)  # subnormals
    return x


@pytest.mark.parametrize("seed", range(8))
def test_equals_fsum_on_random_float32(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 3000))
    x = wild(rng, n)
    want = fsum32(x)
    assert of(x) == want
    assert of(x, parts=5) == want  # any split
    assert of(rng.permutation(x)) == want  # any order
    y = np.abs(rng.standard_normal(n) * np.exp(rng.uniform(-40, 40, n))).astype(np.float32)
    assert of(y) == fsum32(y)


def test_cancellation_subnormals_extremes_and_many() -> None:
    big = np.float32(3.4028235e38)
    tiny = np.float32(1e-45)  # the smallest subnormal
    cases = [
        np.array([], np.float32),
        np.array([0.0, -0.0], np.float32),
        np.array([big, big, -big, tiny], np.float32),  # 2^128-ish partial sums, then cancellation to a subnormal
        np.array([1.0, 2**-24, 2**-24], np.float32),  # each addition alone would round away
        np.array([tiny] * 1000 + [1.0], np.float32),
        np.full(3_000_001, np.float32(0.1)),
        np.full(100_003, big),  # beyond float32, exact in float64
    ]
    for x in cases:
        assert of(x) == fsum32(x), x[:4]
    assert of(np.array([tiny, tiny], np.float32)) == 2 * 1.401298464324817e-45


def test_spill_keeps_it_exact(monkeypatch) -> None:
    """The bins move into a Python int before they could overflow (forced here every 1,000 values)."""
    monkeypatch.setattr(exact_sum, "SPILL_EVERY", 1000)
    rng = np.random.default_rng(3)
    x = wild(rng, 25_000)
    assert of(x) == fsum32(x)
    s = ExactSum()
    for p in np.array_split(x, 60):
        s.add_array(p)
    assert s.value() == fsum32(x)


def test_inf_and_nan_as_numpy_float64_sum() -> None:
    """NaN, or +inf with -inf: NaN; otherwise the infinity (numpy's float64 sum does the same)."""
    inf, nan = np.float32(np.inf), np.float32(np.nan)
    for x in ([1.0, inf], [-inf, 2.0], [inf, -inf], [nan, 1.0], [inf, nan], [0.0, -inf, -inf]):
        a = np.array(x, np.float32)
        with np.errstate(invalid="ignore"):
            want = float(np.sum(a, dtype=np.float64))
        got = of(a)
        assert (math.isnan(got) and math.isnan(want)) or got == want, (x, got, want)


def test_two_sums_together_round_once() -> None:
    """`value_with`: the kept and the dropped |Δ| of a mask, summed apart, give the exact total."""
    rng = np.random.default_rng(11)
    x = wild(rng, 20_000)
    keep = rng.random(x.size) < 0.5
    a, b = ExactSum(), ExactSum()
    a.add_array(x[keep])
    b.add_array(x[~keep])
    assert a.value_with(b) == fsum32(x)
    assert a.value() == fsum32(x[keep])
    b.add_array(np.array([np.inf], np.float32))
    assert a.value_with(b) == math.inf
    a.add_array(np.array([-np.inf], np.float32))
    assert math.isnan(a.value_with(b))
