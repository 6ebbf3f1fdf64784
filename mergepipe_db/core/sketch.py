"""The magnitude sketch: a fixed log-scale histogram of |Δ| (docs/SEMANTICS.md, "Sketch").

Bin 0 counts exact zeros; a value ``x > 0`` goes to ``clamp(floor(4*log2(x)) + 161, 1, NBINS-1)``: four bins
per octave from 2^-40 to 2^16, everything below in bin 1, everything from 2^15.75 up (and inf, NaN) in the
last bin. Binning is exact for every float32 value: ``floor(4*log2(x)) + 48`` is the binary exponent of
``y**4``, ``y = x * 2**12``, computed as two float32 squarings. That map is monotone in x, depends only on
the mantissa while ``y**4`` stays normal (x in [2^-40, 2^16]; outside it the bins are clamped anyway), and
the three in-octave edges 2^(1/4), 2^(1/2), 2^(3/4) and their float32 predecessors land on the right side
(the tests check every edge of every octave). Consequently, for float32 ``x``, ``bin(x) >= j`` if and only
if ``x >= bin_edges()[j]``. Exact zeros are counted apart (tiny values underflow to exponent 0 as well).

Block histograms sum to the tensor histogram (the counts are exact), so the k-th largest |Δ| of a whole
tensor can be located in its bin without reading the tensor, and estimated inside the bin.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

from mergepipe_db.errors import UnsupportedDtypeError

if TYPE_CHECKING:
    import torch

__all__ = [
    "BINS_PER_OCTAVE",
    "LAST_BIN",
    "MAX_EXP",
    "MIN_EXP",
    "NBINS",
    "ZERO_BIN",
    "bin_edges",
    "bin_index",
    "decode",
    "encode",
    "histogram",
    "kth_largest",
    "kth_smallest",
    "locate_kth_largest",
    "lower_bound_kth_largest",
]

BINS_PER_OCTAVE = 4
MIN_EXP = -40
MAX_EXP = 16
NBINS = BINS_PER_OCTAVE * (MAX_EXP - MIN_EXP) + 1  # 225
ZERO_BIN = 0
LAST_BIN = NBINS - 1
#: bin = floor(4*log2(x)) + BIN_OFFSET, clamped to [1, LAST_BIN]
BIN_OFFSET = BINS_PER_OCTAVE * -MIN_EXP + 1  # 161

_CHUNK = 1 << 16  # elements per step of `histogram` (keeps the scratch in cache)
CODE_SCALE = 4096.0  # 2^12: keeps y**4 normal for x in [2^-40, 2^16]
F32_EXP_BIAS = 127

# float32 exponent field E of (x * 2^12)**4 (0..255) -> bin; E == 0 holds exact zeros and tiny values.
_CODE_TO_BIN = np.clip(np.arange(256, dtype=np.int64) - F32_EXP_BIAS - 48 + BIN_OFFSET, 1, LAST_BIN)

# encode/decode: version byte, then sorted (bin, count) pairs of the non-empty bins, little-endian.
_PAIR32 = np.dtype([("bin", "<u2"), ("count", "<u4")])
_PAIR64 = np.dtype([("bin", "<u2"), ("count", "<u8")])
_VERSIONS = {1: _PAIR32, 2: _PAIR64}


def _float32_ceil_pow2_quarter(m: int) -> float:
    """The smallest float32 value >= 2^(m/4), computed exactly (integer/rational arithmetic)."""
    target = Fraction(2) ** m  # compare x**4 >= 2**m exactly
    c = np.float32(2.0 ** (m / 4))
    while Fraction(float(c)) ** 4 < target:
        c = np.nextafter(c, np.float32(np.inf))
    while True:
        below = np.nextafter(c, np.float32(0))
        if Fraction(float(below)) ** 4 >= target:
            c = below
        else:
            return float(c)


def _make_edges() -> np.ndarray:
    edges = np.zeros(NBINS, dtype=np.float64)
    edges[1] = float(np.float32(2.0**-149))  # the smallest positive float32: bin >= 1 <=> x > 0
    for j in range(2, NBINS):
        edges[j] = _float32_ceil_pow2_quarter(j - BIN_OFFSET)
    return edges


_EDGES = _make_edges()
_EDGES.setflags(write=False)


def bin_edges() -> np.ndarray:
    """float64 array (NBINS,): the smallest float32 value of each bin (bin 0 = [0, 0], edge 0.0).

    For a float32 ``x >= 0``: ``bin(x) >= j`` iff ``x >= edges[j]``, so ``edges[j]`` is a guaranteed lower
    bound for anything in bin j. (NaN sits in the last bin but compares false.)
    """
    return _EDGES.copy()


def _nominal_range(b: int) -> tuple[float, float]:
    """Nominal [lower, upper) of bin b >= 1 for interpolation (bin 1 and the last bin are clamped wider)."""
    lo = 2.0 ** ((b - BIN_OFFSET) / BINS_PER_OCTAVE)
    return lo, lo * 2.0 ** (1.0 / BINS_PER_OCTAVE)


def _as_float32_flat(abs_delta: torch.Tensor) -> torch.Tensor:
    import torch

    if not (abs_delta.is_floating_point()):
        raise UnsupportedDtypeError(f"a magnitude sketch needs floating-point data, got {abs_delta.dtype}")
    flat = abs_delta.detach().reshape(-1)
    if flat.dtype != torch.float32:
        flat = flat.to(torch.float32)
    return flat


def _codes(chunk: torch.Tensor, fbuf: torch.Tensor, ibuf: torch.Tensor) -> torch.Tensor:
    """float32 exponent field of (chunk * 2^12)**4 (int32, 0..255), computed in the scratch buffers."""
    import torch

    m = chunk.numel()
    y = torch.mul(chunk, CODE_SCALE, out=fbuf[:m])
    y.mul_(y)
    y.mul_(y)
    codes = torch.bitwise_right_shift(y.view(torch.int32), 23, out=ibuf[:m])
    codes.bitwise_and_(0xFF)  # a NaN may carry a sign bit
    return codes


def bin_index(abs_delta: torch.Tensor) -> torch.Tensor:
    """The sketch bin (int64, same shape) of every element of ``abs_delta`` (taken by magnitude)."""
    import torch

    flat = _as_float32_flat(abs_delta)
    n = flat.numel()
    codes = _codes(flat, torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.int32))
    bins = torch.from_numpy(_CODE_TO_BIN)[codes.long()]
    bins.masked_fill_(flat == 0, ZERO_BIN)
    return bins.reshape(abs_delta.shape)


def histogram(abs_delta: torch.Tensor) -> np.ndarray:
    """int64 counts (NBINS,) of ``abs_delta`` (any shape, floating point; values taken by magnitude).

    Zeros go to bin 0; NaN and inf go to the last bin. Exact; vectorized in chunks of 64 Ki elements.
    """
    import torch

    flat = _as_float32_flat(abs_delta)
    n = flat.numel()
    code_counts = torch.zeros(256, dtype=torch.int64)
    zeros = 0
    if n:
        step = min(n, _CHUNK)
        fbuf = torch.empty(step, dtype=torch.float32)
        ibuf = torch.empty(step, dtype=torch.int32)
        for s in range(0, n, step):
            chunk = flat[s : s + step]
            counts = torch.bincount(_codes(chunk, fbuf, ibuf), minlength=256)
            if int(counts[0]):
                zeros += chunk.numel() - int(torch.count_nonzero(chunk))
            code_counts += counts
    hist = np.zeros(NBINS, dtype=np.int64)
    np.add.at(hist, _CODE_TO_BIN, code_counts.numpy())
    hist[1] -= zeros
    hist[ZERO_BIN] = zeros
    return hist


def _check_hist(hist: np.ndarray) -> np.ndarray:
    h = np.asarray(hist)
    if h.shape != (NBINS,):
        raise ValueError(f"a sketch histogram has {NBINS} bins, got shape {h.shape}")
    return h.astype(np.int64, copy=False)


def locate_kth_largest(hist: np.ndarray, k: int) -> tuple[int, int]:
    """(bin, count above it) of the k-th largest value, 1 <= k <= total: bins above hold
    ``count`` < k values and ``count + hist[bin] >= k``. Exact (counts only)."""
    h = _check_hist(hist)
    total = int(h.sum())
    if not 1 <= k <= total:
        raise ValueError(f"k={k} outside 1..{total}")
    from_top = np.cumsum(h[::-1])
    i = int(np.searchsorted(from_top, k, side="left"))
    b = LAST_BIN - i
    return b, int(from_top[i]) - int(h[b])


def _interpolate(b: int, count: int, r: int) -> float:
    """The r-th largest (1-based) of `count` values spread log-uniformly over bin b."""
    if b == ZERO_BIN:
        return 0.0
    lo, hi = _nominal_range(b)
    frac = (count - r + 0.5) / count
    return lo * (hi / lo) ** frac


def kth_largest(hist: np.ndarray, k: int) -> float:
    """Estimate of the k-th largest value (1-based) from a histogram.

    The bin is located exactly from the counts; inside it the value is interpolated geometrically
    (the count's values taken as log-uniform over the bin). ``k <= 0`` gives inf, ``k > total`` 0.0.
    """
    h = _check_hist(hist)
    total = int(h.sum())
    if k <= 0:
        return math.inf
    if k > total:
        return 0.0
    b, above = locate_kth_largest(h, k)
    return _interpolate(b, int(h[b]), k - above)


def kth_smallest(hist: np.ndarray, k: int) -> float:
    """Estimate of the k-th smallest value: the (total-k+1)-th largest. ``k <= 0`` gives -inf,
    ``k > total`` gives inf."""
    h = _check_hist(hist)
    total = int(h.sum())
    if k <= 0:
        return -math.inf
    if k > total:
        return math.inf
    return kth_largest(h, total - k + 1)


def lower_bound_kth_largest(hist: np.ndarray, k: int) -> float:
    """A guaranteed lower bound of the k-th largest value: the smallest float32 of its bin.

    ``k <= 0`` gives inf (the TIES threshold for k = 0), ``k > total`` 0.0. A block whose max |Δ| is
    below this value holds nothing that reaches the k-th largest.
    """
    h = _check_hist(hist)
    if k <= 0:
        return math.inf
    if k > int(h.sum()):
        return 0.0
    b, _ = locate_kth_largest(h, k)
    return float(_EDGES[b])


def encode(hist: np.ndarray) -> bytes:
    """Compact bytes: a version byte, then (bin uint16, count uint32 or uint64) of the non-empty bins."""
    h = _check_hist(hist)
    if (h < 0).any():
        raise ValueError("a sketch histogram cannot hold negative counts")
    nz = np.flatnonzero(h)
    version = 1 if (nz.size == 0 or int(h[nz].max()) < 2**32) else 2
    pairs = np.empty(nz.size, dtype=_VERSIONS[version])
    pairs["bin"] = nz
    pairs["count"] = h[nz]
    return bytes([version]) + pairs.tobytes()


def decode_sum(blobs: list[bytes], groups: np.ndarray, n_groups: int) -> np.ndarray:
    """(n_groups, NBINS) int64: row g is the sum of the histograms `decode` gives for the blobs with
    ``groups[i] == g``, checked as `decode` checks each (ValueError on the first malformed one); decoded
    together, for the thousands of block sketches of a tensor family at once."""
    if any(not raw or raw[0] not in _VERSIONS for raw in blobs):
        raise ValueError("malformed sketch: unknown or missing version byte")
    out = np.zeros((n_groups, NBINS), dtype=np.int64)
    for version, dt in _VERSIONS.items():
        pick = [i for i, raw in enumerate(blobs) if raw and raw[0] == version]
        if not pick:
            continue
        bodies = [bytes(blobs[i])[1:] for i in pick]
        sizes = np.array([len(b) for b in bodies], dtype=np.int64)
        if (sizes % dt.itemsize).any():
            bad = int(sizes[np.flatnonzero(sizes % dt.itemsize)[0]])
            raise ValueError(f"malformed sketch: {bad} payload bytes is not a multiple of {dt.itemsize}")
        pairs = np.frombuffer(b"".join(bodies), dtype=dt)
        owner = np.repeat(np.asarray(groups, dtype=np.int64)[pick], sizes // dt.itemsize)
        starts = np.concatenate([[0], np.cumsum(sizes // dt.itemsize)[:-1]])
        first = np.zeros(pairs.size, dtype=np.bool_)  # each blob's first pair: no order to its predecessor
        first[starts[starts < pairs.size]] = True
        bins = pairs["bin"].astype(np.int64)
        if bins.size and (bins.max() >= NBINS or ((np.diff(bins) <= 0) & ~first[1:]).any()):
            raise ValueError("malformed sketch: bins out of range or not strictly increasing")
        counts = pairs["count"]
        if counts.dtype == np.uint64 and bins.size and int(counts.max()) >= 2**63:
            raise ValueError("malformed sketch: count out of range")
        np.add.at(out, (owner, bins), counts.astype(np.int64))
    return out


def decode(data: bytes) -> np.ndarray:
    """The int64 histogram (NBINS,) encoded by `encode`; ValueError on malformed bytes."""
    raw = bytes(data)
    if not raw or raw[0] not in _VERSIONS:
        raise ValueError("malformed sketch: unknown or missing version byte")
    dt = _VERSIONS[raw[0]]
    body = raw[1:]
    if len(body) % dt.itemsize:
        raise ValueError(f"malformed sketch: {len(body)} payload bytes is not a multiple of {dt.itemsize}")
    pairs = np.frombuffer(body, dtype=dt)
    bins = pairs["bin"].astype(np.int64)
    if bins.size and (bins.max() >= NBINS or (np.diff(bins) <= 0).any()):
        raise ValueError("malformed sketch: bins out of range or not strictly increasing")
    counts = pairs["count"]
    if counts.dtype == np.uint64 and bins.size and int(counts.max()) >= 2**63:
        raise ValueError("malformed sketch: count out of range")
    hist = np.zeros(NBINS, dtype=np.int64)
    hist[bins] = counts.astype(np.int64)
    return hist
