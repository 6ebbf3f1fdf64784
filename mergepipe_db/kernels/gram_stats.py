"""Inner-product statistics of a block, taken at ingest so that the geometric merge methods (slerp, model_stock,
nuslerp, multislerp, karcher) know their coefficients before reading any expert byte (docs/SEMANTICS.md,
"Inner-product statistics").

For an expert block with Δ = e − b (float32, as everywhere) `block_and_gram_stats` returns, in one pass over the
bytes ingest already holds — `block_stats`' tiles, fused: the block's catalog statistics bit for bit as
`delta_block_stats` gives them, and

- ``base_dot`` = Σ b·Δ and ``delta_sq`` = Σ Δ² (float64 sums, reassociated into SIMD lanes),
- ``proj``: a count sketch of Δ with `GRAM_DIM` buckets — element g of the tensor (its flat index) adds
  ``sign(g)·Δ_g`` to bucket ``g mod GRAM_DIM`` — so that for two experts of one base
  ``⟨proj_i, proj_j⟩`` estimates ``⟨Δ_i, Δ_j⟩`` without bias (E[sign(g)·sign(h)] = 0 for g ≠ h), with a
  standard deviation of at most ``√(2/GRAM_DIM)·‖Δ_i‖·‖Δ_j‖`` (~4.4 %); a tensor of at most GRAM_DIM elements
  has each in a bucket of its own, so its products are exact. A tensor's sketch is the sum of its blocks'.

A block's sketch is summed in float32 (each bucket gets one addend per 1,024 elements: ≤ 256 at 1 MiB blocks,
a relative rounding of ~1e-5, far below the sketch's own error), then added to the tensor's in float64.
``sign(g)`` is ``SIGNS[g mod 2^20] · H(g >> 20)``, a fixed table of random signs (seeded) times a hashed sign of
the high bits (splitmix64): one table lookup per element, never the same pair of signs at two places of a
tensor. `count_sketch` is the same sketch written plainly in numpy (tests, and blocks given as float32 Δ).

`base_square` is ``‖θ‖²`` of a block (float64), taken when a base checkpoint is ingested.

Cost, measured with `python -m benchmarks.gram_ingest --both [--cold]` (2 cores shared with other work, load
~5, `ingest_many` of 3 × 134 MB F32 experts, with and without the statistics interleaved, median of 5): before
this pass was fused (a second pass over each block, its sketch loop not vectorized, cross products over Δ
arrays formed in memory) the statistics added 14 % wall / 27 % CPU warm and 15 % wall / 36 % CPU cold; fused,
9 % wall / 8 % CPU warm and −4 % wall (noise) / 7 % CPU cold. What is left is arithmetic: the float64 sums
Σ b·Δ, Σ Δ² and the sketch's multiply-add, ~0.13 ms per 1 MiB block beside `delta_stats`' ~0.19.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from mergepipe_db.core import sketch
from mergepipe_db.kernels.block_stats import _SUBS, _TILE, _tile_hist, _tile_sums
from mergepipe_db.kernels.float_bits import bits_to_f32, f32_to_bits, widen

GRAM_DIM = 1024  #: buckets of a tensor's count sketch (8 KiB per tensor, float64)
_LOW_BITS = 20
_LOW = 1 << _LOW_BITS
SIGNS = np.where(np.random.default_rng(0x5EED_6A4A).random(_LOW) < 0.5, -1.0, 1.0).astype(np.float32)
_SIGNS8 = SIGNS.astype(np.int8)  # the kernel's copy: 1 MiB, not 4 (a block read a stream of signs as long as itself)
_MASK64 = (1 << 64) - 1


def high_sign(hi: int) -> float:
    """The sign of the high part ``g >> 20`` of an element index (splitmix64 of it, top bit)."""
    z = (hi + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return -1.0 if z >> 63 else 1.0


@numba.njit(cache=True, nogil=True, fastmath={"reassoc"})
def _tile_delta(e: np.ndarray, b: np.ndarray, d: np.ndarray, absd: np.ndarray
                ) -> tuple[np.int32, np.int32, np.uint32, float, float]:
    """`block_stats._tile_abs` (the same |Δ| into `absd`, the same counts and max: integer arithmetic, exact)
    that also keeps Δ in `d` and sums Σ b·Δ and Σ Δ² in float64 (reassociated into SIMD lanes)."""
    pos = np.int32(0)
    nonzero = np.int32(0)
    mx = np.uint32(0)
    bd = 0.0
    dd = 0.0
    for i in range(e.shape[0]):
        yv = widen(b[i])
        dv = widen(e[i]) - yv
        d[i] = dv
        a = abs(dv)
        absd[i] = a
        pos = np.int32(pos + np.int32(dv > 0))
        nonzero = np.int32(nonzero + np.int32(a != 0))
        mx = max(mx, f32_to_bits(a))
        x = np.float64(dv)
        bd += np.float64(yv) * x
        dd += x * x
    return pos, nonzero, mx, bd, dd


@numba.njit(cache=True, nogil=True)
def _signed_add(p: np.ndarray, sg: np.ndarray, h: float, d: np.ndarray) -> None:
    """p += sg·h·d over contiguous slices (as slices the compiler vectorizes the loop; indexed from one loop
    over the tile it did not: 6× slower)."""
    for t in range(p.shape[0]):
        p[t] += np.float32(sg[t]) * h * d[t]


@numba.njit(cache=True, nogil=True)
def _tile_sketch(d: np.ndarray, g0: int, base_hi: int, signs: np.ndarray, highs: np.ndarray, p32: np.ndarray
                 ) -> None:
    """p32[g mod M] += sign(g)·Δ for the tile's elements g = g0 + i. Runs of consecutive g inside one M-aligned
    row (M divides 2^20) touch consecutive buckets and signs: contiguous inner loops, vectorized."""
    n = d.shape[0]
    m = p32.shape[0]
    lowmask = signs.shape[0] - 1
    i = 0
    while i < n:
        g = g0 + i
        k0 = g % m
        run = min(n - i, m - k0)
        h = highs[(g >> 20) - base_hi]
        s0 = g & lowmask
        _signed_add(p32[k0:k0 + run], signs[s0:s0 + run], h, d[i:i + run])
        i += run


@numba.njit(cache=True, nogil=True)
def _stats_gram(e: np.ndarray, b: np.ndarray, start: int, signs: np.ndarray, highs: np.ndarray, hist: np.ndarray,
                acc: np.ndarray, proj: np.ndarray, gacc: np.ndarray) -> None:
    """`block_stats._stats` (the same tiles, the same arithmetic: `hist` and `acc` bit for bit) fused with the
    inner products: while a tile of Δ = e − b is in L1, gacc = [Σ b·Δ, Σ Δ²] and proj[g mod M] += sign(g)·Δ
    for g = start + i. A tile whose Δ is zero throughout adds nothing to either (its b is finite: an inf or
    NaN in b makes Δ NaN), so it is skipped as `_stats` skips it. The block's sketch is summed in float32
    (≤ 256 addends a bucket at 1 MiB blocks), then added to `proj` in float64."""
    n = e.shape[0]
    m = proj.shape[0]
    base_hi = start >> 20
    absd = np.empty(_TILE, np.float32)
    d = np.empty(_TILE, np.float32)
    packed = np.empty(_TILE, np.float32)
    bins = np.empty(_TILE, np.int32)
    sub = np.zeros((_SUBS, hist.shape[0]), np.int64)
    p32 = np.zeros(m, np.float32)
    l2 = 0.0
    l1 = 0.0
    bd = 0.0
    dd = 0.0
    pos = 0
    zeros = 0
    mx = np.uint32(0)
    for s in range(0, n, _TILE):
        t = min(_TILE, n - s)
        p, nz, tm, x, z = _tile_delta(e[s:s + t], b[s:s + t], d[:t], absd[:t])
        if nz == 0:  # (then p == 0 and tm == 0 too)
            zeros += t
            continue
        pos += p
        mx = max(mx, tm)
        a, c = _tile_sums(absd[:t])
        l2 += a
        l1 += c
        zeros += _tile_hist(absd[:t], nz, packed, bins, sub)
        bd += x
        dd += z
        _tile_sketch(d[:t], start + s, base_hi, signs, highs, p32)
    for j in range(hist.shape[0]):
        hist[j] = sub[:, j].sum()
    hist[0] += zeros
    acc[0], acc[1], acc[2], acc[3] = l2, l1, bits_to_f32(mx), pos
    for k in range(m):
        proj[k] += np.float64(p32[k])
    gacc[0] += bd
    gacc[1] += dd


@numba.njit(cache=True, nogil=True, fastmath={"reassoc"})
def _cross(x: np.ndarray, y: np.ndarray, b: np.ndarray) -> float:
    """⟨x − b, y − b⟩: each Δ in float32, their products summed in float64 (reassociated into SIMD lanes)."""
    s = 0.0
    for i in range(b.shape[0]):
        v = widen(b[i])
        s += np.float64(widen(x[i]) - v) * np.float64(widen(y[i]) - v)
    return s


@numba.njit(cache=True, nogil=True, fastmath={"reassoc"})
def _square(x: np.ndarray) -> float:
    """Σ x² in float64, reassociated into SIMD lanes (in order, each add waited on the one before: ~4× slower)."""
    s = 0.0
    for i in range(x.shape[0]):
        v = np.float64(widen(x[i]))
        s += v * v
    return s


def _highs(start: int, n: int) -> np.ndarray:
    lo, hi = start >> _LOW_BITS, (start + max(n, 1) - 1) >> _LOW_BITS
    return np.array([high_sign(h) for h in range(lo, hi + 1)], np.float32)


def _values(buf: bytes | bytearray | memoryview, dtype: str) -> np.ndarray:
    """A writable view (or copy) of a block's values, as `block_stats._writable`: every call hits the one
    compiled signature (BF16 as its bits, F16 widened to float32)."""
    if dtype == "BF16":
        arr = np.frombuffer(buf, np.uint16)
    elif dtype == "F16":
        return np.frombuffer(buf, np.float16).astype(np.float32)
    else:
        arr = np.frombuffer(buf, np.float32)
    return arr if arr.flags.writeable else arr.copy()


def block_and_gram_stats(data: bytes | bytearray | memoryview, base: bytes | bytearray | memoryview | None,
                         dtype: str, start: int) -> tuple[dict[str, Any], tuple[float, float, np.ndarray]]:
    """A block's catalog statistics — exactly `block_stats.delta_block_stats`'s — and its inner-product
    statistics (Σ b·Δ, Σ Δ², count sketch of Δ), in one pass over raw bytes whose first element is element
    `start` of its tensor; `base` None: `data` is Δ itself (a delta checkpoint), b = 0."""
    e = _values(data, dtype)
    b = np.zeros_like(e) if base is None else _values(base, dtype)
    hist = np.zeros(sketch.NBINS, dtype=np.int64)
    acc = np.zeros(4, np.float64)
    proj = np.zeros(GRAM_DIM, np.float64)
    gacc = np.zeros(2, np.float64)
    _stats_gram(e, b, int(start), _SIGNS8, _highs(int(start), e.shape[0]), hist, acc, proj, gacc)
    l2sq, l1, mx, pos = acc
    n = e.shape[0]
    row = {"delta_l2": float(np.sqrt(l2sq)), "delta_l1": float(l1), "delta_max": float(mx),
           "pos_frac": (pos / n if n else 0.0), "sketch": sketch.encode(hist)}
    return row, (float(gacc[0]), float(gacc[1]), proj)


def gram_block_stats(data: bytes | bytearray | memoryview, base: bytes | bytearray | memoryview | None, dtype: str,
                     start: int) -> tuple[float, float, np.ndarray]:
    """(Σ b·Δ, Σ Δ², count sketch of Δ) of one block of raw bytes whose first element is element `start` of its
    tensor; `base` None: `data` is Δ itself (a delta checkpoint), b = 0."""
    return block_and_gram_stats(data, base, dtype, start)[1]


def cross_products(changed: list[tuple[int, bytes | bytearray | memoryview]], base: bytes | bytearray | memoryview,
                   dtype: str) -> list[tuple[int, int, float]]:
    """(i, j, ⟨Δ_i, Δ_j⟩) of one block for every pair of `changed` members (member, block bytes), i before j in
    their order: one pass over the three blocks a pair, no Δ formed in memory."""
    b = _values(base, dtype)
    xs = [(k, _values(data, dtype)) for k, data in changed]
    return [(i, j, float(_cross(x, y, b))) for a, (i, x) in enumerate(xs) for (j, y) in xs[a + 1:]]


def base_square(data: bytes | bytearray | memoryview, dtype: str) -> float:
    """‖θ‖² (float64) of one block of raw bytes."""
    return float(_square(_values(data, dtype)))


def count_sketch(delta: np.ndarray, start: int = 0) -> np.ndarray:
    """The count sketch of a flat float32 Δ whose first element is element `start` of its tensor, in plain numpy
    (float64)."""
    d = np.asarray(delta, np.float32).reshape(-1)
    g = start + np.arange(d.shape[0], dtype=np.int64)
    uniq, inv = np.unique(g >> _LOW_BITS, return_inverse=True)
    sign = SIGNS[g & (_LOW - 1)].astype(np.float64) * np.array([high_sign(int(h)) for h in uniq])[inv]
    return np.bincount(g % GRAM_DIM, weights=sign * d.astype(np.float64), minlength=GRAM_DIM)
