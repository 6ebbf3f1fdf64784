"""The magnitude sketch (docs/SEMANTICS.md, "Sketch"): exact binning, quantiles, encoding."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from mergepipe_db.core import sketch
from mergepipe_db.errors import UnsupportedDtypeError


def exact_bin(x: float) -> int:
    """The spec's bin of a float32 value, by exact rational arithmetic (no floating-point log)."""
    if math.isnan(x) or math.isinf(x):
        return sketch.NBINS - 1
    x = abs(x)
    if x == 0:
        return 0
    x4 = Fraction(x) ** 4
    m = x4.numerator.bit_length() - x4.denominator.bit_length()  # floor(log2(x4)) is m or m - 1
    if Fraction(2) ** m > x4:
        m -= 1
    return min(max(m + 161, 1), sketch.NBINS - 1)


def f32(values) -> torch.Tensor:
    return torch.tensor(np.asarray(values, dtype=np.float32))


def heavy_tailed(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.distributions.StudentT(2.0).sample((n,)) if seed % 2 else torch.randn(n, generator=g)
    x = t * torch.exp(2.0 * torch.randn(n, generator=g)) * 1e-3
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    return x.abs()


def test_constants_and_edges() -> None:
    assert sketch.NBINS == 4 * (40 + 16) + 1 == 225
    e = sketch.bin_edges()
    assert e.shape == (sketch.NBINS,) and e[0] == 0.0 and e[1] == 2.0**-149
    assert (np.diff(e) > 0).all()
    assert e[161] == 1.0 and e[165] == 2.0 and e[157] == 0.5
    last = np.float32(e[sketch.NBINS - 1])  # the smallest float32 >= 2^(63/4)
    assert Fraction(float(last)) ** 4 >= 2**63 > Fraction(float(np.nextafter(last, np.float32(0)))) ** 4
    # every edge is a float32 value and the smallest one of its bin
    assert (e.astype(np.float32).astype(np.float64) == e).all()
    e[5] = 123.0  # a copy: the module's edges are untouched
    assert sketch.bin_edges()[5] != 123.0


def test_binning_is_exact_at_every_edge() -> None:
    e = sketch.bin_edges()[1:].astype(np.float32)
    below = np.nextafter(e, np.float32(0))
    above = np.nextafter(e, np.float32(np.inf))
    values = np.concatenate([e, below, above])
    got = sketch.bin_index(f32(values)).numpy()
    want = [exact_bin(float(v)) for v in values]
    assert got.tolist() == want
    assert sketch.bin_index(f32(e)).numpy().tolist() == list(range(1, sketch.NBINS))


def test_binning_exact_on_random_bit_patterns() -> None:
    g = np.random.default_rng(0)
    bits = np.concatenate([
        g.integers(0, 0x7F800000, 20000, dtype=np.int64),  # every finite positive float32, uniformly by bits
        g.integers(0x2A000000, 0x48000000, 20000, dtype=np.int64),  # 2^-43 .. 2^17: the bins' range
        np.arange(0, 40),  # zero and the smallest subnormals
    ]).astype(np.int32)
    x = bits.view(np.float32)
    got = sketch.bin_index(torch.from_numpy(x.copy())).numpy()
    assert got.tolist() == [exact_bin(float(v)) for v in x]
    h = sketch.histogram(torch.from_numpy(x.copy()))
    assert (h == np.bincount(got, minlength=sketch.NBINS)).all()


def test_special_values() -> None:
    x = f32([0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1.0, -1.0, 2.0**16,
             2.0**-40, 1e-45, 3.0e38])
    assert sketch.bin_index(x).tolist() == [0, 0, 224, 224, 224, 224, 161, 161, 224, 1, 1, 224]
    h = sketch.histogram(x)
    assert h[0] == 2 and h[224] == 6 and h[161] == 2 and h[1] == 2 and h.sum() == x.numel()
    assert sketch.histogram(torch.zeros(0)).sum() == 0
    assert sketch.histogram(torch.zeros(3, 0, 4)).shape == (sketch.NBINS,)
    # other float dtypes are upcast exactly; integers are refused
    b = torch.randn(1000).to(torch.bfloat16)
    assert (sketch.histogram(b) == sketch.histogram(b.float())).all()
    with pytest.raises(UnsupportedDtypeError):
        sketch.histogram(torch.arange(5))


def test_block_histograms_sum_to_tensor_histogram() -> None:
    x = heavy_tailed(200_003, 1)  # spans several internal chunks, odd length
    cuts = [0, 1, 17, 65_536, 65_537, 140_000, 200_003]
    blocks = [sketch.histogram(x[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    total = sketch.histogram(x)
    assert (sum(blocks) == total).all()
    assert total.sum() == x.numel() and total.dtype == np.int64
    assert (total == np.bincount(sketch.bin_index(x).numpy(), minlength=sketch.NBINS)).all()


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_kth_largest_lies_in_the_located_bin(seed: int) -> None:
    x = heavy_tailed(50_000, seed)
    h = sketch.histogram(x)
    desc = torch.sort(x, descending=True).values
    e = sketch.bin_edges()
    rng = np.random.default_rng(seed)
    ks = sorted({1, 2, 50_000, 49_999, 2500, *rng.integers(1, 50_001, 60).tolist()})
    for k in ks:
        true = float(desc[k - 1])
        b, above = sketch.locate_kth_largest(h, k)
        assert sketch.bin_index(f32([true])).item() == b
        assert above < k <= above + h[b]
        lb = sketch.lower_bound_kth_largest(h, k)
        assert lb == e[b] and lb <= true
        est = sketch.kth_largest(h, k)
        if b == 0:
            assert est == 0.0 == true
        elif 1 < b < sketch.NBINS - 1:
            assert abs(est / true - 1) < 2 ** 0.25 - 1  # inside the same quarter-octave bin
        assert sketch.kth_smallest(h, x.numel() - k + 1) == est


def test_interpolation_error_is_small() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.exp(torch.rand(200_000, generator=g) * 20 - 15)  # log-uniform: interpolation is unbiased
    h = sketch.histogram(x)
    desc = torch.sort(x, descending=True).values
    errs = [abs(sketch.kth_largest(h, k) / float(desc[k - 1]) - 1) for k in range(1000, 200_000, 3917)]
    assert np.median(errs) < 0.003 and max(errs) < 0.03
    y = torch.randn(200_000, generator=g).abs()  # smooth but not log-uniform
    hy = sketch.histogram(y)
    dy = torch.sort(y, descending=True).values
    errs = [abs(sketch.kth_largest(hy, k) / float(dy[k - 1]) - 1) for k in range(1000, 200_000, 3917)]
    assert np.median(errs) < 0.02 and max(errs) < 0.1


def test_quantile_edge_cases() -> None:
    h = sketch.histogram(f32([0.0, 0.0, 1.0, 4.0]))
    assert sketch.kth_largest(h, 0) == math.inf and sketch.kth_largest(h, -3) == math.inf
    assert sketch.kth_largest(h, 5) == 0.0
    assert sketch.kth_largest(h, 3) == 0.0 and sketch.kth_largest(h, 4) == 0.0
    assert 4.0 <= sketch.kth_largest(h, 1) < 4.0 * 2**0.25
    assert sketch.kth_smallest(h, 0) == -math.inf and sketch.kth_smallest(h, 5) == math.inf
    assert sketch.kth_smallest(h, 1) == 0.0
    assert sketch.lower_bound_kth_largest(h, 0) == math.inf
    assert sketch.lower_bound_kth_largest(h, 9) == 0.0
    assert sketch.lower_bound_kth_largest(h, 2) == 1.0
    empty = np.zeros(sketch.NBINS, dtype=np.int64)
    assert sketch.kth_largest(empty, 1) == 0.0
    with pytest.raises(ValueError):
        sketch.locate_kth_largest(h, 0)
    with pytest.raises(ValueError):
        sketch.kth_largest(np.zeros(10), 1)


def test_encode_decode_round_trip() -> None:
    rng = np.random.default_rng(1)
    for _ in range(20):
        h = np.zeros(sketch.NBINS, dtype=np.int64)
        idx = rng.choice(sketch.NBINS, size=int(rng.integers(0, 40)), replace=False)
        h[idx] = rng.integers(1, 10**6, idx.size)
        blob = sketch.encode(h)
        assert isinstance(blob, bytes) and len(blob) == 1 + 6 * idx.size
        back = sketch.decode(blob)
        assert back.dtype == np.int64 and (back == h).all()
        assert (sketch.decode(memoryview(blob)) == h).all()
    real = sketch.histogram(heavy_tailed(10_000, 5))
    assert (sketch.decode(sketch.encode(real)) == real).all()
    big = np.zeros(sketch.NBINS, dtype=np.int64)
    big[[0, 7, 224]] = [2**40, 1, 2**33]
    assert (sketch.decode(sketch.encode(big)) == big).all()
    assert sketch.decode(sketch.encode(np.zeros(sketch.NBINS, dtype=np.int64))).sum() == 0


_MALFORMED = [b"", b"\x07", b"\x01\x00", b"\x01" + bytes([250, 0, 1, 0, 0, 0]),
              b"\x01" + bytes([5, 0, 1, 0, 0, 0]) * 2, b"\x02" + bytes([3, 0]) + (2**63).to_bytes(8, "little")]


@pytest.mark.parametrize("blob", _MALFORMED)
def test_decode_rejects_malformed(blob: bytes) -> None:
    with pytest.raises(ValueError):
        sketch.decode(blob)


def test_decode_sum_is_the_sum_of_the_decoded_histograms() -> None:
    """Decoded together (both versions, empty histograms, blobs whose first bin is below the previous blob's
    last), the group sums equal those of `decode`, blob by blob."""
    rng = np.random.default_rng(3)
    blobs, groups = [], []
    for i in range(300):
        h = np.zeros(sketch.NBINS, dtype=np.int64)
        idx = rng.choice(sketch.NBINS, size=int(rng.integers(0, 30)), replace=False)
        h[idx] = rng.integers(1, 10**6, idx.size) * (2**33 if i % 7 == 0 else 1)  # some need version 2
        blobs.append(sketch.encode(h) if i % 5 else memoryview(sketch.encode(h)))
        groups.append(int(rng.integers(0, 9)))
    want = np.zeros((9, sketch.NBINS), dtype=np.int64)
    for blob, g in zip(blobs, groups):
        want[g] += sketch.decode(blob)
    assert {bytes(b)[0] for b in blobs} == {1, 2}
    assert (sketch.decode_sum(blobs, np.array(groups), 9) == want).all()
    assert sketch.decode_sum([], np.zeros(0, np.int64), 2).shape == (2, sketch.NBINS)


@pytest.mark.parametrize("blob", _MALFORMED)
def test_decode_sum_rejects_what_decode_rejects(blob: bytes) -> None:
    good = sketch.encode(np.arange(sketch.NBINS, dtype=np.int64))
    with pytest.raises(ValueError):
        sketch.decode_sum([good, blob, good], np.zeros(3, np.int64), 1)


def test_encode_rejects_bad_histograms() -> None:
    with pytest.raises(ValueError):
        sketch.encode(np.zeros(3, dtype=np.int64))
    h = np.zeros(sketch.NBINS, dtype=np.int64)
    h[3] = -1
    with pytest.raises(ValueError):
        sketch.encode(h)
