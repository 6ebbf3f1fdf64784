"""Block statistics of Δ against the base — the catalog's delta_l2, delta_l1, delta_max, pos_frac and sketch of
a block — one implementation for every producer: ingest of a full or delta checkpoint (`delta_block_stats`,
`zero_block_stats`), the blocks of a merge's output (the same two) and the ΔW row blocks of a LoRA adapter
(`float32_delta_block_stats`, see there why it stays a torch computation).

Fused kernels (numba) compute the first two.

`delta_stats` reads an expert block and the base block once and produces the L2² (float64 accumulation),
L1, max |Δ|, the count of positive deltas and the magnitude histogram of docs/SEMANTICS.md ("Sketch") —
the same bins as `sketch.histogram`, exactly. Δ is computed in float32, as everywhere else. The block is
processed in tiles that stay in L1, in passes the compiler vectorizes, but the last: |Δ| with the positive and
nonzero counts and the max (as integer bits), after which a tile with no nonzero Δ goes to bin 0 whole; the
float64 sums (reassociated into SIMD lanes, so not in sequential order: L2 and L1 move by a few ulps); the bins;
the bin counts, into sub-histograms. Counts and bins stay int32 (numba widens int32 arithmetic to int64, which
halves the SIMD lanes: each pass ran ~2× slower). Counting is the costly pass (a scattered
increment per element), so a tile with at most a quarter of its Δ nonzero (a merge output's changed block at a
low budget: ~7 % of its elements differ from θ₀) first packs its nonzero |Δ| and bins and counts only those:
1.45× faster on such blocks, dense ones unchanged. The kernels release the GIL, so ingest runs them on several
blocks at once. Compiled once and cached on disk by numba (first use in a fresh install takes seconds).
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import numpy as np

from mergepipe_db.core import sketch
from mergepipe_db.core.dtypes import DTYPE_BITS
from mergepipe_db.kernels.float_bits import bits_to_f32, f32_to_bits, widen

_TILE = 2048  # elements per tile: |Δ| (float32) and bins (int32) 16 KiB, in L1 with the inputs
_SUBS = 8  # sub-histograms: a run of equal bins increments 8 counters in turn, not one
_SPARSE = 4  # a tile with at most 1/4 of its |Δ| nonzero bins and counts only those (`_tile_pack_nonzero`)
# int32/uint32/float32 constants, so numba keeps the tile loops in 32-bit lanes
_LAST = np.int32(sketch.LAST_BIN)
_ZERO, _ONE = np.int32(0), np.int32(1)
_SCALE = np.float32(sketch.CODE_SCALE)
_CODE_SHIFT = np.int32(sketch.F32_EXP_BIAS + 48 - sketch.BIN_OFFSET)  # bin = code − this (sketch._CODE_TO_BIN)
_U23, _UFF = np.uint32(23), np.uint32(0xFF)


@numba.njit(cache=True, nogil=True)
def _tile_abs(e: np.ndarray, b: np.ndarray, absd: np.ndarray) -> tuple[np.int32, np.int32, np.uint32]:
    """|Δ| of each element of the tile into `absd`; (#Δ > 0, #|Δ| ≠ 0, max of |Δ|'s bits). For |Δ| ≥ 0 the
    float32 bits order as the values do, and a NaN's bits exceed every number's: the integer max is max |Δ|,
    NaN propagated (and NaN ≠ 0 counts as nonzero). The counts are narrowed to int32 at every step (numba
    widens int32 sums to int64), which keeps the loop in 8 float32 lanes."""
    pos = np.int32(0)
    nonzero = np.int32(0)
    mx = np.uint32(0)
    for i in range(e.shape[0]):
        d = widen(e[i]) - widen(b[i])
        a = abs(d)
        absd[i] = a
        pos = np.int32(pos + np.int32(d > 0))
        nonzero = np.int32(nonzero + np.int32(a != 0))
        mx = max(mx, f32_to_bits(a))
    return pos, nonzero, mx


@numba.njit(cache=True, nogil=True)
def _tile_pack_nonzero(absd: np.ndarray, packed: np.ndarray) -> int:
    """The |Δ| ≠ 0 of the tile (NaN included), in order, into `packed`; their count. Branch-free: each value
    is stored, and the position moves on only past a nonzero one."""
    j = np.int32(0)
    for i in range(absd.shape[0]):
        a = absd[i]
        packed[j] = a
        j += np.int32(a != 0)
    return j


@numba.njit(cache=True, nogil=True)
def _tile_bins(absd: np.ndarray, bins: np.ndarray) -> None:
    """The sketch bin of each |Δ|, computed as `sketch.histogram` does: the float32 exponent field of
    (|Δ|·2^12)^4, shifted and clamped; exact zeros in bin 0, inf and NaN (field 255) in the last."""
    for i in range(absd.shape[0]):
        a = absd[i]
        y = a * _SCALE
        y = y * y
        y = y * y
        code = np.int32((f32_to_bits(y) >> _U23) & _UFF)
        bn = min(max(np.int32(code - _CODE_SHIFT), _ONE), _LAST)  # int32: 8 lanes (numba widens the difference)
        bins[i] = _ZERO if a == 0 else bn


@numba.njit(cache=True, nogil=True, fastmath={"reassoc"})
def _tile_sums(absd: np.ndarray) -> tuple[float, float]:
    l2 = 0.0
    l1 = 0.0
    for i in range(absd.shape[0]):
        x = np.float64(absd[i])
        l2 += x * x
        l1 += x
    return l2, l1


@numba.njit(cache=True, nogil=True)
def _tile_count(bins: np.ndarray, sub: np.ndarray) -> None:
    n = bins.shape[0]
    i = 0
    while i + _SUBS <= n:
        for k in range(_SUBS):
            sub[k, bins[i + k]] += 1
        i += _SUBS
    while i < n:
        sub[0, bins[i]] += 1
        i += 1


@numba.njit(cache=True, nogil=True)
def _tile_hist(absd: np.ndarray, nz: int, packed: np.ndarray, bins: np.ndarray, sub: np.ndarray) -> int:
    """The bins of a tile's |Δ| (`nz` of them nonzero) counted into `sub`; how many zeros are left to bin 0."""
    m = absd.shape[0]
    if nz * _SPARSE <= m:  # bins and counts for the nonzero |Δ| only; the zeros go to bin 0 at once
        _tile_pack_nonzero(absd, packed)
        _tile_bins(packed[:nz], bins[:nz])
        _tile_count(bins[:nz], sub)
        return m - nz
    _tile_bins(absd, bins[:m])
    _tile_count(bins[:m], sub)
    return 0


@numba.njit(cache=True, nogil=True)
def _stats(e: np.ndarray, b: np.ndarray, hist: np.ndarray, acc: np.ndarray) -> None:
    """Statistics of Δ = e − b (float32 or BF16 bits) into `hist` and `acc` = [L2², L1, max |Δ|, #positive].

    A tile whose Δ is zero throughout (most of a merge output's changed block at a low budget: a few elements
    round away from θ₀) is counted into bin 0 after its first pass, without the other three."""
    n = e.shape[0]
    absd = np.empty(_TILE, np.float32)
    packed = np.empty(_TILE, np.float32)
    bins = np.empty(_TILE, np.int32)
    sub = np.zeros((_SUBS, hist.shape[0]), np.int64)
    l2 = 0.0
    l1 = 0.0
    pos = 0
    zeros = 0
    mx = np.uint32(0)
    for s in range(0, n, _TILE):
        m = min(_TILE, n - s)
        p, nz, t = _tile_abs(e[s:s + m], b[s:s + m], absd[:m])
        if nz == 0:  # (then p == 0 and t == 0 too)
            zeros += m
            continue
        pos += p
        mx = max(mx, t)
        a, c = _tile_sums(absd[:m])
        l2 += a
        l1 += c
        zeros += _tile_hist(absd[:m], nz, packed, bins, sub)
    for j in range(hist.shape[0]):
        hist[j] = sub[:, j].sum()
    hist[0] += zeros
    acc[0], acc[1], acc[2], acc[3] = l2, l1, bits_to_f32(mx), pos


def _writable(buf: bytes | bytearray | memoryview, dtype: type) -> np.ndarray:
    """A writable numpy view (or copy) so every call hits the one compiled (and cached) signature."""
    arr = np.frombuffer(buf, dtype=dtype)
    return arr if arr.flags.writeable else arr.copy()


def delta_stats(data: bytes | bytearray | memoryview, base: bytes | bytearray | memoryview, dtype: str
                ) -> tuple[float, float, float, float, np.ndarray]:
    """(L2, L1, max |Δ|, fraction of Δ > 0, histogram) of Δ = expert − base for one block of raw bytes."""
    hist = np.zeros(sketch.NBINS, dtype=np.int64)
    acc = np.zeros(4, dtype=np.float64)
    if dtype == "BF16":
        e = _writable(data, np.uint16)
        b = _writable(base, np.uint16)
        _stats(e, b, hist, acc)
    else:
        np_dtype = np.float16 if dtype == "F16" else np.float32
        e = _writable(data, np_dtype).astype(np.float32, copy=False)
        b = _writable(base, np_dtype).astype(np.float32, copy=False)
        _stats(e, b, hist, acc)
    l2sq, l1, mx, pos = acc
    n = e.shape[0]
    return float(np.sqrt(l2sq)), float(l1), float(mx), (pos / n if n else 0.0), hist


@numba.njit(cache=True, nogil=True)
def _equal_u8(a: np.ndarray, b: np.ndarray) -> bool:
    n = a.shape[0]
    step = 1 << 14  # compare a vectorized chunk at a time; stop at the first that differs
    for s in range(0, n, step):
        diff = np.uint8(0)
        x, y = a[s:s + step], b[s:s + step]
        for i in range(x.shape[0]):
            diff |= x[i] ^ y[i]
        if diff:
            return False
    return True


def same_bytes(a: bytes | bytearray | memoryview, b: bytes | bytearray | memoryview) -> bool:
    """Whether two byte ranges are equal, at memory speed (comparing memoryviews in Python goes item by
    item: about 0.3 GB/s)."""
    x, y = np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)
    return x.shape[0] == y.shape[0] and _equal_u8(x, y)


def delta_block_stats(data: memoryview | bytearray, base: memoryview | None, dtype: str) -> dict[str, Any]:
    """A block's catalog statistics of Δ = data − base (base None: data is Δ itself), in one fused pass
    (`delta_stats`): delta_l2, delta_l1, delta_max, pos_frac and the encoded sketch."""
    l2, l1, mx, pos, hist = delta_stats(data, bytes(len(data)) if base is None else base, dtype)
    return {"delta_l2": l2, "delta_l1": l1, "delta_max": mx, "pos_frac": pos, "sketch": sketch.encode(hist)}


def zero_block_stats(nbytes: int, dtype: str) -> dict[str, Any]:
    """The statistics of a block of `nbytes` whose Δ is zero throughout (equal to the base's bytes)."""
    return {"delta_l2": 0.0, "delta_l1": 0.0, "delta_max": 0.0, "pos_frac": 0.0,
            "sketch": _zero_sketch(nbytes * 8 // DTYPE_BITS[dtype])}


@functools.lru_cache(maxsize=64)
def _zero_sketch(numel: int) -> bytes:
    """The encoded sketch of `numel` zeros (every element in bin 0); a merge output has many such blocks."""
    hist = np.zeros(sketch.NBINS, dtype=np.int64)
    hist[0] = numel
    return sketch.encode(hist)


def float32_delta_block_stats(delta: Any) -> dict[str, Any]:
    """The statistics of a block given as Δ itself in float32 (a numpy array or a torch tensor, any shape): a
    LoRA adapter's ΔW rows, formed in float32 by the factors' product.

    L2 and L1 are torch's float64 reductions (`vector_norm`, `sum`), not the fused kernel's (which
    reassociates its sums: results differ in the last bits), so the catalog statistics of a LoRA adapter, and
    with them every plan that ranks its blocks, stay what they were. The sketch is `sketch.histogram`'s,
    which bins exactly as the kernel does."""
    import torch

    d = torch.as_tensor(delta).reshape(-1)
    if d.numel() == 0:
        return zero_block_stats(0, "F32")
    a = d.abs()
    return {
        "delta_l2": float(torch.linalg.vector_norm(d, dtype=torch.float64)),
        "delta_l1": float(a.sum(dtype=torch.float64)),
        "delta_max": float(a.max()),
        "pos_frac": float((d > 0).sum()) / d.numel(),
        "sketch": sketch.encode(sketch.histogram(a)),
    }
