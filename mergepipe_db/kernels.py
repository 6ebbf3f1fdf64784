"""Fused single-pass kernels (numba) for ingest statistics.

`delta_stats` reads an expert block and the base block once and produces, in one pass, the L2² (float64
accumulation), L1, max |Δ|, the count of positive deltas and the magnitude histogram of docs/SEMANTICS.md
("Sketch") — the same bins as `sketch.histogram`, exactly. Δ is computed in float32, as everywhere else.
The kernels release the GIL, so ingest runs them on several blocks at once. Compiled once and cached on
disk by numba (first use in a fresh install takes a few seconds).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import overload

from mergepipe_db import sketch
from mergepipe_db.numba_bits import f64_to_bits, widen

_OFFSET = sketch.BINS_PER_OCTAVE * -sketch.MIN_EXP + 1
_LAST = sketch.LAST_BIN


@numba.njit(cache=True, nogil=True, inline="always")
def _step(d: np.float32, l2: float, l1: float, mx: np.float32, pos: float, hist: np.ndarray
          ) -> tuple[float, float, np.float32, float]:
    """Fold one Δ (float32) into (L2², L1, max |Δ|, #positive) and bin |Δ| into `hist`."""
    a = abs(d)
    x = np.float64(a)
    l2 += x * x
    l1 += x
    if a > mx or a != a:
        mx = a
    if d > 0:
        pos += 1.0
    x = x * x
    # |Δ|**4 in float64: its binary exponent is floor(4*log2|Δ|) (see sketch.py)
    code = np.int64((f64_to_bits(x * x) >> np.uint64(52)) & np.uint64(0x7FF))
    if code == 0:
        hist[0] += 1  # zero (|Δ|**4 of a nonzero float32 is never subnormal in float64)
    elif code == 0x7FF:
        hist[_LAST] += 1  # inf / NaN
    else:
        hist[min(max(code - 1023 + _OFFSET, 1), _LAST)] += 1
    return l2, l1, mx, pos


def _same_finite(a, b):  # noqa: ANN001, ANN201 - compiled by the overload below
    raise NotImplementedError("only callable from numba-compiled code")


@overload(_same_finite, inline="always")
def _same_finite_impl(a, b):  # noqa: ANN001, ANN202
    if a == types.uint16:  # equal BF16 bits of a finite value: Δ is exactly 0 (inf - inf would be NaN)
        return lambda a, b: a == b and (a & 0x7F80) != 0x7F80
    return lambda a, b: False


@numba.njit(cache=True, nogil=True)
def _stats(e: np.ndarray, b: np.ndarray, hist: np.ndarray, acc: np.ndarray) -> None:
    """Statistics of Δ = e − b (float32 or BF16 bits) into `hist` and `acc` = [L2², L1, max |Δ|, #positive].
    Equal BF16 bit patterns of a finite value (common in fine-tunes) are an exact zero delta and skip the
    math."""
    l2, l1, mx, pos = acc[0], acc[1], np.float32(acc[2]), acc[3]
    zeros = 0
    for i in range(e.shape[0]):
        if _same_finite(e[i], b[i]):
            zeros += 1
            continue
        l2, l1, mx, pos = _step(widen(e[i]) - widen(b[i]), l2, l1, mx, pos, hist)
    hist[0] += zeros
    acc[0], acc[1], acc[2], acc[3] = l2, l1, mx, pos


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
