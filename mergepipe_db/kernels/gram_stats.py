"""Inner-product statistics of a block, taken at ingest so that the geometric merge methods (model_stock,
nuslerp, multislerp, karcher) know their coefficients before reading any expert byte (docs/SEMANTICS.md,
"Inner-product statistics").

For an expert block with Δ = e − b (float32, as everywhere) `gram_block_stats` returns, in one pass over the
bytes ingest already holds:

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

Cost, measured (2 shared cores, load ~4–6, warm page cache, `ingest_many` of 3 × 134 MB F32 experts): median
0.66 s without these statistics, 0.86 s with them — the count sketch is most of it (0.85 s without the cross
products). Not yet at the I/O floor: the sketch loop is a candidate for the tiling `block_stats` uses.
"""

from __future__ import annotations

import numba
import numpy as np

from mergepipe_db.kernels.float_bits import widen

GRAM_DIM = 1024  #: buckets of a tensor's count sketch (8 KiB per tensor, float64)
_LOW_BITS = 20
_LOW = 1 << _LOW_BITS
SIGNS = np.where(np.random.default_rng(0x5EED_6A4A).random(_LOW) < 0.5, -1.0, 1.0).astype(np.float32)
_MASK64 = (1 << 64) - 1


def high_sign(hi: int) -> float:
    """The sign of the high part ``g >> 20`` of an element index (splitmix64 of it, top bit)."""
    z = (hi + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return -1.0 if z >> 63 else 1.0


@numba.njit(cache=True, nogil=True, fastmath={"reassoc"})
def _gram(e: np.ndarray, b: np.ndarray, start: int, signs: np.ndarray, highs: np.ndarray, proj: np.ndarray,
          acc: np.ndarray) -> None:
    """Δ = e − b (float32 or BF16 bits): acc = [Σ b·Δ, Σ Δ²], proj[g mod M] += sign(g)·Δ for g = start + i.
    Runs of consecutive g that stay inside one M-aligned row (M divides 2^20) touch consecutive buckets and
    signs: the inner loop is contiguous, and the compiler vectorizes it (sums reassociated into lanes)."""
    n = e.shape[0]
    m = proj.shape[0]
    lowmask = signs.shape[0] - 1
    base_hi = start >> 20
    p32 = np.zeros(m, np.float32)  # a block's sketch in float32 (≤ 256 addends a bucket at 1 MiB blocks)
    d = np.empty(m, np.float32)
    y32 = np.empty(m, np.float32)
    bd = 0.0
    dd = 0.0
    i = 0
    while i < n:
        g = start + i
        k0 = g % m
        run = min(n - i, m - k0)
        h = highs[(g >> 20) - base_hi]
        s0 = g & lowmask
        for t in range(run):
            y = widen(b[i + t])
            y32[t] = y
            d[t] = widen(e[i + t]) - y
        for t in range(run):
            bd += np.float64(y32[t]) * np.float64(d[t])
            dd += np.float64(d[t]) * np.float64(d[t])
        for t in range(run):
            p32[k0 + t] += signs[s0 + t] * h * d[t]
        i += run
    for k in range(m):
        proj[k] += np.float64(p32[k])
    acc[0] += bd
    acc[1] += dd


@numba.njit(cache=True, nogil=True)
def _square(x: np.ndarray) -> float:
    s = 0.0
    for i in range(x.shape[0]):
        v = np.float64(widen(x[i]))
        s += v * v
    return s


def _highs(start: int, n: int) -> np.ndarray:
    lo, hi = start >> _LOW_BITS, (start + max(n, 1) - 1) >> _LOW_BITS
    return np.array([high_sign(h) for h in range(lo, hi + 1)], np.float32)


def _values(buf: bytes | bytearray | memoryview, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return np.frombuffer(buf, np.uint16)
    if dtype == "F16":
        return np.frombuffer(buf, np.float16).astype(np.float32)
    return np.frombuffer(buf, np.float32)


def gram_block_stats(data: bytes | bytearray | memoryview, base: bytes | bytearray | memoryview | None, dtype: str,
                     start: int) -> tuple[float, float, np.ndarray]:
    """(Σ b·Δ, Σ Δ², count sketch of Δ) of one block of raw bytes whose first element is element `start` of its
    tensor; `base` None: `data` is Δ itself (a delta checkpoint), b = 0."""
    e = _values(data, dtype)
    b = np.zeros_like(e) if base is None else _values(base, dtype)
    proj = np.zeros(GRAM_DIM, np.float64)
    acc = np.zeros(2, np.float64)
    _gram(e, b, int(start), SIGNS, _highs(int(start), e.shape[0]), proj, acc)
    return float(acc[0]), float(acc[1]), proj


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
